// attn_ext::sinusoidal_pe(_) on CUDA: stable-ABI adapter (checks, output, dtype dispatch, stream);
// the kernel is in sinusoidal_pe_kernel.cuh.
#include "common/registration.h"
#include "common/sinusoidal_adapter.h"
#include "common/stable_cuda.h"
#include "cuda/sinusoidal_pe_kernel.cuh"

namespace attn_ext {
namespace {

void run_cuda(const Tensor& x, const SinusoidalParams& p) {
  if (p.B * p.S * p.D == 0) return;
  const DeviceGuard guard(x.get_device_index());
  cudaStream_t stream = current_cuda_stream(x.get_device_index());
  ATTN_EXT_DISPATCH_FLOATING(x.scalar_type(), "sinusoidal_pe_cuda", [&] {
    ATTN_EXT_CUDA_CHECK(cuda::launch_sinusoidal_pe<cuda_elem_t<scalar_t>>(p, stream));
  });
}

Tensor sinusoidal_pe_cuda(const Tensor& x, const OptTensor& positions,
                              int64_t offset, double base) {
  check_sinusoidal_rank(x);
  Tensor out = sinusoidal_out_like(x);
  run_cuda(x, make_sinusoidal_params(x, out, positions, offset, base));
  return out;
}

void sinusoidal_pe_inplace_cuda(const Tensor& x, const OptTensor& positions,
                                int64_t offset, double base) {
  check_sinusoidal_rank(x);
  check_sinusoidal_inplace(x, positions);
  run_cuda(x, make_sinusoidal_params(x, x, positions, offset, base));
}

}  // namespace

ATTN_EXT_LIBRARY_IMPL(CUDA, m) {
  m.impl("sinusoidal_pe", TORCH_BOX(&sinusoidal_pe_cuda));
  m.impl("sinusoidal_pe_", TORCH_BOX(&sinusoidal_pe_inplace_cuda));
}

}  // namespace attn_ext
