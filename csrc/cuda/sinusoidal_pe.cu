// attn_ext::sinusoidal_pe(_) on CUDA: ATen adapter (checks, output, dtype dispatch, stream);
// the kernel is in sinusoidal_pe_kernel.cuh.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/sinusoidal_adapter.h"
#include "cuda/sinusoidal_pe_kernel.cuh"

namespace attn_ext {
namespace {

void run_cuda(const at::Tensor& x, const SinusoidalParams& p) {
  if (p.B * p.S * p.D == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sinusoidal_pe_cuda", [&] {
    C10_CUDA_CHECK(cuda::launch_sinusoidal_pe<scalar_t>(p, stream));
  });
}

at::Tensor sinusoidal_pe_cuda(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                              int64_t offset, double base) {
  check_sinusoidal_rank(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  run_cuda(x, make_sinusoidal_params(x, out, positions, offset, base));
  return out;
}

void sinusoidal_pe_inplace_cuda(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                                int64_t offset, double base) {
  check_sinusoidal_rank(x);
  check_last_dim_contiguous(x, "x (in place)");
  run_cuda(x, make_sinusoidal_params(x, x, positions, offset, base));
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("sinusoidal_pe", &sinusoidal_pe_cuda);
  m.impl("sinusoidal_pe_", &sinusoidal_pe_inplace_cuda);
}

}  // namespace attn_ext
