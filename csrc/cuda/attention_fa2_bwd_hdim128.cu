// Instantiations of the fast attention backward (attention_bwd_kernel.cuh) for head dim 128
// (one head dim per translation unit: a parallel build compiles them side by side).
#include "cuda/attention_launch.h"  // first: the kernel's launcher uses bwd_terms_smem_bytes
#include "cuda/attention_bwd_kernel.cuh"

namespace attn_ext::cuda::fa2 {
ATTN_EXT_INSTANTIATE_FA2_BWD(128)
}  // namespace attn_ext::cuda::fa2
