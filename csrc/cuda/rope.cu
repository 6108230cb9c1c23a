// attn_ext::rope / rope_ / rope_qk_ / _rope_backward on CUDA: ATen adapter (checks, output,
// dtype dispatch, device guard, current stream); the kernel is in rope_kernel.cuh.
//
// positions are not range-checked on the host (that would need a device->host sync); the
// kernel device-asserts and skips rows with a bad position (see rope_kernel.cuh). The offset
// path is fully checked on the host (offset + S <= cos.size(0)).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/rope_args.h"
#include "cuda/rope_kernel.cuh"

namespace attn_ext {
namespace {

// c10 element types -> the CUDA types the PyTorch-free kernel uses (same bits).
template <typename T>
struct CudaElem {
  using type = T;
};
template <>
struct CudaElem<c10::Half> {
  using type = __half;
};
template <>
struct CudaElem<c10::BFloat16> {
  using type = __nv_bfloat16;
};

void run_cuda(const at::Tensor& x, const at::Tensor& cos, const RopeParams& p) {
  if (p.B * p.S == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rope_cuda", [&] {
    using T = typename CudaElem<scalar_t>::type;
    if (cos.scalar_type() == at::kFloat) {
      cuda::launch_rope<T, float>(p, stream);
    } else {
      cuda::launch_rope<T, T>(p, stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor rope_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::optional<at::Tensor>& positions, int64_t offset,
                     bool interleaved) {
  return rope_out_of_place_with(run_cuda, x, cos, sin, positions, offset, interleaved, false);
}

at::Tensor rope_backward_cuda(const at::Tensor& grad, const at::Tensor& cos,
                              const at::Tensor& sin, const std::optional<at::Tensor>& positions,
                              int64_t offset, bool interleaved) {
  return rope_out_of_place_with(run_cuda, grad, cos, sin, positions, offset, interleaved, true);
}

void rope_inplace_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       const std::optional<at::Tensor>& positions, int64_t offset,
                       bool interleaved) {
  rope_inplace_with(run_cuda, x, cos, sin, positions, offset, interleaved);
}

void rope_qk_inplace_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                          const at::Tensor& sin, const std::optional<at::Tensor>& positions,
                          int64_t offset, bool interleaved) {
  rope_qk_inplace_with(run_cuda, q, k, cos, sin, positions, offset, interleaved);
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("rope", &rope_cuda);
  m.impl("rope_", &rope_inplace_cuda);
  m.impl("rope_qk_", &rope_qk_inplace_cuda);
  m.impl("_rope_backward", &rope_backward_cuda);
}

}  // namespace attn_ext
