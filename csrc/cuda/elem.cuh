// Element types of the CUDA kernels: each input type's accumulation type (fp32, fp64 for
// double) and the conversions to and from it. Written with the cuda_fp16 / cuda_bf16
// intrinsics, not the __half / __nv_bfloat16 operators (torch builds with
// __CUDA_NO_HALF_CONVERSIONS__ and friends).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace attn_ext {
namespace cuda {

template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_acc(typename AccOf<T>::type x);
template <>
__device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <>
__device__ __forceinline__ double from_acc<double>(double x) { return x; }
template <>
__device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

}  // namespace cuda
}  // namespace attn_ext
