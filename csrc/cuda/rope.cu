// attn_ext::rope / rope_ / rope_qk_ / _rope_backward on CUDA: stable-ABI adapter (checks, output,
// dtype dispatch, device guard, current stream); the kernel is in rope_kernel.cuh.
//
// positions are not range-checked on the host (that would need a device->host sync); the
// kernel device-asserts and skips rows with a bad position (see rope_kernel.cuh). The offset
// path is fully checked on the host (offset + S <= cos.size(0)).
#include "common/registration.h"
#include "common/rope_args.h"
#include "common/stable_cuda.h"
#include "cuda/rope_kernel.cuh"

namespace attn_ext {
namespace {

void run_cuda(const Tensor& x, const Tensor& cos, const RopeParams& p) {
  if (p.B * p.S == 0) return;
  const DeviceGuard guard(x.get_device_index());
  cudaStream_t stream = current_cuda_stream(x.get_device_index());
  ATTN_EXT_DISPATCH_FLOATING(x.scalar_type(), "rope_cuda", [&] {
    using T = typename CudaElem<scalar_t>::type;
    if (cos.scalar_type() == dtype::kFloat) {
      cuda::launch_rope<T, float>(p, stream);
    } else {
      cuda::launch_rope<T, T>(p, stream);
    }
    ATTN_EXT_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

Tensor rope_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin,
                     const OptTensor& positions, int64_t offset,
                     bool interleaved) {
  return rope_out_of_place_with(run_cuda, x, cos, sin, positions, offset, interleaved, false);
}

Tensor rope_backward_cuda(const Tensor& grad, const Tensor& cos,
                              const Tensor& sin, const OptTensor& positions,
                              int64_t offset, bool interleaved) {
  return rope_out_of_place_with(run_cuda, grad, cos, sin, positions, offset, interleaved, true);
}

void rope_inplace_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin,
                       const OptTensor& positions, int64_t offset,
                       bool interleaved) {
  rope_inplace_with(run_cuda, x, cos, sin, positions, offset, interleaved);
}

void rope_qk_inplace_cuda(const Tensor& q, const Tensor& k, const Tensor& cos,
                          const Tensor& sin, const OptTensor& positions,
                          int64_t offset, bool interleaved) {
  rope_qk_inplace_with(run_cuda, q, k, cos, sin, positions, offset, interleaved);
}

}  // namespace

ATTN_EXT_LIBRARY_IMPL(CUDA, m) {
  m.impl("rope", TORCH_BOX(&rope_cuda));
  m.impl("rope_", TORCH_BOX(&rope_inplace_cuda));
  m.impl("rope_qk_", TORCH_BOX(&rope_qk_inplace_cuda));
  m.impl("_rope_backward", TORCH_BOX(&rope_backward_cuda));
}

}  // namespace attn_ext
