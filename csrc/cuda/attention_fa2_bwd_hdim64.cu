// Instantiations of the fast attention backward (attention_bwd_kernel.cuh) for head dim 64.
#include "cuda/attention_bwd_kernel.cuh"
#include "cuda/attention_launch.h"

namespace attn_ext {
namespace cuda {
namespace fa2 {

static_assert(BwdTraits<64>::kSmemBytes == bwd_smem_bytes(64), "attention_launch.h's bwd_smem_bytes is stale");

#define ATTN_EXT_BWD(T, causal)                                                              \
  template cudaError_t launch_fa2_bwd_impl<T, 64, causal>(const AttentionBwdParams&, float*, \
                                                          float*, cudaStream_t);
ATTN_EXT_BWD(__half, false)
ATTN_EXT_BWD(__half, true)
ATTN_EXT_BWD(__nv_bfloat16, false)
ATTN_EXT_BWD(__nv_bfloat16, true)
#undef ATTN_EXT_BWD

}  // namespace fa2
}  // namespace cuda
}  // namespace attn_ext
