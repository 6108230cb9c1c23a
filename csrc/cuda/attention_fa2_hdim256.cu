// Instantiations of the fast attention forward (attention_fwd_kernel.cuh) for head dim 256
// (one head dim per translation unit: a parallel build compiles them side by side).
#include "cuda/attention_fwd_kernel.cuh"
#include "cuda/attention_launch.h"

namespace attn_ext::cuda::fa2 {
ATTN_EXT_INSTANTIATE_FA2_FWD(256)
}  // namespace attn_ext::cuda::fa2
