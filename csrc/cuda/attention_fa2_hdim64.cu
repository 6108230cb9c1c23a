// Instantiations of the fast attention forward (attention_fwd_kernel.cuh) for head dim 64.
#include "cuda/attention_fwd_kernel.cuh"
#include "cuda/attention_launch.h"

namespace attn_ext {
namespace cuda {
namespace fa2 {

static_assert(FwdTraits<64>::kBlockM == kBlockM, "attention_launch.h's kBlockM is stale");

template cudaError_t launch_fa2_fwd_impl<__half, 64, false>(const AttentionParams&, cudaStream_t);
template cudaError_t launch_fa2_fwd_impl<__half, 64, true>(const AttentionParams&, cudaStream_t);
template cudaError_t launch_fa2_fwd_impl<__nv_bfloat16, 64, false>(const AttentionParams&,
                                                                   cudaStream_t);
template cudaError_t launch_fa2_fwd_impl<__nv_bfloat16, 64, true>(const AttentionParams&,
                                                                  cudaStream_t);

}  // namespace fa2
}  // namespace cuda
}  // namespace attn_ext
