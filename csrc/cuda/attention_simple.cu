// Instantiations of the simple attention kernels (attention_simple_kernel.cuh), every dtype.
#include "cuda/attention_launch.h"
#include "cuda/attention_simple_kernel.cuh"

namespace attn_ext {
namespace cuda {
namespace simple {

#define ATTN_EXT_SIMPLE_INSTANTIATE(T)                                                       \
  template cudaError_t launch_simple_fwd<T>(const AttentionParams&, cudaStream_t);          \
  template cudaError_t launch_settle_lse<T>(const AttentionParams&, cudaStream_t);          \
  template cudaError_t launch_simple_bwd<T>(const AttentionBwdParams&, void*, void*,          \
                                            cudaStream_t);                                  \
  template cudaError_t launch_simple_fwd_split<T>(const AttentionParams&, int64_t, int, void*,  \
                                                  void*, cudaStream_t);

ATTN_EXT_SIMPLE_INSTANTIATE(float)
ATTN_EXT_SIMPLE_INSTANTIATE(double)
ATTN_EXT_SIMPLE_INSTANTIATE(__half)
ATTN_EXT_SIMPLE_INSTANTIATE(__nv_bfloat16)
#undef ATTN_EXT_SIMPLE_INSTANTIATE

}  // namespace simple
}  // namespace cuda
}  // namespace attn_ext
