// Stable-ABI CUDA helpers for the CUDA adapters (csrc/cuda/*.cu): device guard, current
// stream, error checks. Built only into attn_ext/_C_cuda (with -DUSE_CUDA, which the stable
// shim's CUDA entry points need).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/macros.h>

#include "common/stable.h"

namespace attn_ext {

// torch/headeronly element types -> the CUDA types the PyTorch-free kernels use (same bits).
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
template <typename T>
using cuda_elem_t = typename CudaElem<T>::type;

// RAII: makes t's device current for the adapter's body (c10::cuda::CUDAGuard).
using DeviceGuard = torch::stable::accelerator::DeviceGuard;

// torch's current CUDA stream of `device` (c10::cuda::getCurrentCUDAStream): every launch
// goes there, never to the default stream.
inline cudaStream_t current_cuda_stream(int32_t device) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device, &stream));
  return static_cast<cudaStream_t>(stream);
}

}  // namespace attn_ext

// C10_CUDA_CHECK / C10_CUDA_KERNEL_LAUNCH_CHECK of the stable ABI (torch/csrc/stable/macros.h).
#define ATTN_EXT_CUDA_CHECK(EXPR) STD_CUDA_CHECK(EXPR)
#define ATTN_EXT_CUDA_KERNEL_LAUNCH_CHECK() STD_CUDA_KERNEL_LAUNCH_CHECK()
