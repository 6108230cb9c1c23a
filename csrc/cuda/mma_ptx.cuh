// PTX wrappers shared by the tensor-core attention kernels (attention_fwd_kernel.cuh,
// attention_bwd_kernel.cuh): cp.async, ldmatrix, mma.sync.m16n8k16 (sm_80+), packing and exp2;
// one warp-level product built from them, and the dynamic shared-memory opt-in of a launch.
//
// Fragment maps used throughout (PTX ISA, "Matrix fragments for mma.m16n8k16"; g = lane / 4,
// c = lane % 4):
//   A (16x16, row): a0 = A[g][2c..2c+1], a1 = A[g+8][2c..], a2 = A[g][2c+8..], a3 = A[g+8][2c+8..]
//   B (16x8, col):  b0 = B[2c..2c+1][g], b1 = B[2c+8..2c+9][g]
//   C (16x8 fp32):  c0, c1 = C[g][2c..2c+1], c2, c3 = C[g+8][2c..2c+1]
// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; lane l receives, in
// register i, row l/4, columns 2(l%4) and 2(l%4)+1 of matrix i (.trans: of its transpose).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cuda/elem.cuh"

namespace attn_ext {
namespace cuda {
namespace fa2 {

constexpr float kLog2eF = 1.4426950408889634074f;
constexpr float kLn2F = 0.69314718055994530942f;

// ---- PTX wrappers ---------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; when !valid nothing is read and the 16 bytes are zeroed.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d (16x8 fp32) += a (16x16, row) * b (16x8, col)
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);
// One specialisation per input type; PTX names the type twice (A and B).
#define ATTN_EXT_MMA_16816(T, PTX_TYPE)                                                      \
  template <>                                                                               \
  __device__ __forceinline__ void mma_16816<T>(float (&d)[4], const uint32_t (&a)[4],        \
                                               uint32_t b0, uint32_t b1) {                  \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 "    \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"       \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                          \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));          \
  }
ATTN_EXT_MMA_16816(__half, "f16")
ATTN_EXT_MMA_16816(__nv_bfloat16, "bf16")
#undef ATTN_EXT_MMA_16816

// Two floats -> one register of two 16-bit values, `lo` in the low half (the lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Async-copy rows [row0, row0 + kRows) of a (nrows, kHeadDim) global matrix with row stride
// `stride` (elements) into a (kRows, kHeadDim + 8) shared tile; rows >= nrows are zero-filled.
// Consecutive threads copy consecutive 16-byte chunks of a row (coalesced).
template <typename T, int kHeadDim, int kRows, int kThreads>
__device__ __forceinline__ void load_rows(T* s, const T* g, int64_t stride, int64_t row0,
                                          int64_t nrows, int tid) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kStride = kHeadDim + 8;
  static_assert(kRows * kChunksPerRow % kThreads == 0, "whole copy rounds");
#pragma unroll
  for (int it = 0; it < kRows * kChunksPerRow / kThreads; ++it) {
    const int c = it * kThreads + tid;
    const int r = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    const int64_t gr = row0 + r;
    const bool valid = gr < nrows;
    const T* src = g + (valid ? gr : 0) * stride + col;  // a valid address even when unused
    cp_async_16(smem_addr(s + r * kStride + col), src, valid);
  }
}

// True when one of the 16-byte chunks that this thread copied with load_rows (same kRows,
// kThreads: the same chunks) holds an inf or NaN. Only the thread's own cp.async writes are
// read, so after its cp_async_wait no barrier is needed; zero-filled rows are finite.
template <typename T, int kHeadDim, int kRows, int kThreads>
__device__ __forceinline__ bool own_rows_nonfinite(const T* s, int tid) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kStride = kHeadDim + 8;
  bool bad = false;
#pragma unroll
  for (int it = 0; it < kRows * kChunksPerRow / kThreads; ++it) {
    const int c = it * kThreads + tid;
    const T* x = s + (c / kChunksPerRow) * kStride + (c % kChunksPerRow) * 8;
#pragma unroll
    for (int e = 0; e < 8; ++e) bad |= !isfinite(to_acc(x[e]));
  }
  return bad;
}

// acc (16 x kNCols fp32, kNCols / 8 n8 tiles) += a (16 x 16, A fragments) * B, where B is the
// 16 x kNCols block of a shared tile (row stride kStride elements) starting at `block`, with
// the k dimension along the tile's rows ("row" layout, read with ldmatrix.trans: matrices
// rows +0/+8, then columns +8 — the lrow / lcol lane offsets). The forward's O += P V and the
// backward's dV += P^T dO, dK += dS^T Q and dQ += dS K are all this product.
template <typename T, int kNCols, int kStride>
__device__ __forceinline__ void mma_a_rowblock(float (&acc)[kNCols / 8][4], const uint32_t (&a)[4],
                                               const T* block, int lrow, int lcol) {
  static_assert(kNCols % 16 == 0, "whole pairs of n8 tiles");
#pragma unroll
  for (int dd = 0; dd < kNCols / 16; ++dd) {
    uint32_t b[4];
    ldmatrix_x4_trans(smem_addr(block + lrow * kStride + dd * 16 + lcol), b);
    mma_16816<T>(acc[2 * dd], a, b[0], b[1]);
    mma_16816<T>(acc[2 * dd + 1], a, b[2], b[3]);
  }
}

// Raises kKernel's dynamic shared-memory limit to `bytes` once per device, not on every call
// (keeps the launch path free of extra driver calls, e.g. under graph capture). One flag array
// per kernel (the kernel is a template argument). Racing first calls from two host threads
// both set it, which is harmless.
template <auto kKernel>
cudaError_t ensure_dynamic_smem(int bytes) {
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> done[kMaxDevices] = {};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev < kMaxDevices && done[dev].load(std::memory_order_relaxed)) return cudaSuccess;
  e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess && dev < kMaxDevices) done[dev].store(true, std::memory_order_relaxed);
  return e;
}

}  // namespace fa2
}  // namespace cuda
}  // namespace attn_ext
