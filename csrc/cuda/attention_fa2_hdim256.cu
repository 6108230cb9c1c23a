// Instantiations of the fast attention forward (attention_fwd_kernel.cuh) for head dim 256
// (one head dim per translation unit: a parallel build compiles them side by side).
#include "cuda/attention_fwd_kernel.cuh"
#include "cuda/attention_launch.h"

namespace attn_ext::cuda::fa2 {
ATTN_EXT_INSTANTIATE_FA2_FWD_PLAIN(256)  // no score-term instances (their registers spill)
}  // namespace attn_ext::cuda::fa2
