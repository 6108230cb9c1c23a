// Device code for attn_ext::rope / rope_ / rope_qk_ / _rope_backward: pointers, strides and
// a stream, no ATen types (fp16/bf16 are CUDA's __half / __nv_bfloat16 here).
//
//   x (B, S, H, D) -> out, cos/sin (S_max, half), rotary_dim = 2 * half <= D
//   half-split:  (x[i], x[i+half])  -> (x1 c - x2 s, x2 c + x1 s)
//   interleaved: (x[2i], x[2i+1])   -> same, c = cos[pos, i], s = +-sin[pos, i]
//
// Work layout: a 2-D grid. y walks the B*S rows (b, s) in a grid-stride loop; x enumerates
// the work "units" inside one row: for each tensor (q, then k) and each head, the rotary
// units (V pairs each) and, out of place, the pass-through units (V channels each). One
// row shares one position, so the cos/sin row is read once per row from L2 and the index
// math that needs 64-bit division happens once per row, not per element.
//
// V = 16 bytes / sizeof(T): every x/out access is one 16-byte load/store when the launcher
// proved alignment (base pointers, every stride, half and D multiples of V); otherwise the
// V = 1 instantiation (scalar) runs. Math is fp32 (fp64 for double x).
//
// positions out of range: the kernel never reads past the tables. A bad position trips a
// device assert (reported at the next synchronising CUDA call, like an out-of-range
// index_select) and its row is skipped. No host synchronisation inside the op.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cassert>
#include <cstdint>

#include "common/pos_enc_params.h"
#include "cuda/elem.cuh"

namespace attn_ext {
namespace cuda {

// N elements moved as one aligned unit (16 bytes for the vector path).
template <typename T, int N, int Align>
struct alignas(Align) Pack {
  T v[N];
};

constexpr int kAlignOf(int bytes) { return bytes >= 16 ? 16 : bytes; }

// units0 / units1: one row's work units of tensor 0 / 1 (heads x units per head: uph0 / uph1),
// counted in 64 bits like every index here (a row of 2^31+ units would wrap in 32).
template <typename T, typename TT, int V>
__global__ void rope_kernel(RopeParams p, int64_t units0, int64_t units1, int64_t uph0,
                            int64_t uph1) {
  using acc = typename AccOf<T>::type;
  using XPack = Pack<T, V, kAlignOf(V * int(sizeof(T)))>;
  using TPack = Pack<TT, V, kAlignOf(V * int(sizeof(TT)))>;
  int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w >= units0 + units1) return;
  const int t = w < units0 ? 0 : 1;
  if (t == 1) w -= units0;
  const RopeTensorParams& tp = p.t[t];
  const int64_t uph = t == 0 ? uph0 : uph1;  // units per head
  const int64_t h = w / uph;
  const int64_t unit = w - h * uph;
  const int64_t half = p.half;
  const int64_t nrot = half / V;  // rotary units per head
  const acc sign = p.inverse ? acc(-1) : acc(1);
  const int64_t rows = p.B * p.S;

  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t b = row / p.S;
    const int64_t s = row - b * p.S;
    const T* x = static_cast<const T*>(tp.x) + b * tp.x_batch_stride + s * tp.x_row_stride +
                 h * tp.x_head_stride;  // (D,)
    T* out = static_cast<T*>(tp.out) + b * tp.out_batch_stride + s * tp.out_row_stride +
             h * tp.out_head_stride;
    if (unit >= nrot) {  // pass-through channels (out of place only)
      const int64_t e = 2 * half + (unit - nrot) * V;
      *reinterpret_cast<XPack*>(out + e) = *reinterpret_cast<const XPack*>(x + e);
      continue;
    }
    const int64_t pos = p.positions ? p.positions[b * p.pos_batch_stride + s * p.pos_row_stride]
                                    : p.offset + s;
    if (pos < 0 || pos >= p.S_max) {
      __assert_fail("positions must lie in [0, cos.size(0))", __FILE__, __LINE__, __func__);
      continue;  // never read past the tables
    }
    const int64_t i0 = static_cast<int64_t>(unit) * V;  // first pair of this unit
    const TPack cv = *reinterpret_cast<const TPack*>(static_cast<const TT*>(p.cos) +
                                                     pos * p.cos_row_stride + i0);
    const TPack sv = *reinterpret_cast<const TPack*>(static_cast<const TT*>(p.sin) +
                                                     pos * p.sin_row_stride + i0);
    if (p.interleaved) {
      // Elements [2 i0, 2 i0 + 2V): pair l is (xx[2l], xx[2l+1]).
      XPack xa = *reinterpret_cast<const XPack*>(x + 2 * i0);
      XPack xb = *reinterpret_cast<const XPack*>(x + 2 * i0 + V);
      T xx[2 * V];
#pragma unroll
      for (int l = 0; l < V; ++l) {
        xx[l] = xa.v[l];
        xx[V + l] = xb.v[l];
      }
#pragma unroll
      for (int l = 0; l < V; ++l) {
        const acc c = static_cast<acc>(to_acc(cv.v[l]));
        const acc sn = sign * static_cast<acc>(to_acc(sv.v[l]));
        const acc x1 = to_acc(xx[2 * l]), x2 = to_acc(xx[2 * l + 1]);
        xx[2 * l] = from_acc<T>(x1 * c - x2 * sn);
        xx[2 * l + 1] = from_acc<T>(x2 * c + x1 * sn);
      }
#pragma unroll
      for (int l = 0; l < V; ++l) {
        xa.v[l] = xx[l];
        xb.v[l] = xx[V + l];
      }
      *reinterpret_cast<XPack*>(out + 2 * i0) = xa;
      *reinterpret_cast<XPack*>(out + 2 * i0 + V) = xb;
    } else {
      XPack x1p = *reinterpret_cast<const XPack*>(x + i0);
      XPack x2p = *reinterpret_cast<const XPack*>(x + half + i0);
#pragma unroll
      for (int l = 0; l < V; ++l) {
        const acc c = static_cast<acc>(to_acc(cv.v[l]));
        const acc sn = sign * static_cast<acc>(to_acc(sv.v[l]));
        const acc x1 = to_acc(x1p.v[l]), x2 = to_acc(x2p.v[l]);
        x1p.v[l] = from_acc<T>(x1 * c - x2 * sn);
        x2p.v[l] = from_acc<T>(x2 * c + x1 * sn);
      }
      *reinterpret_cast<XPack*>(out + i0) = x1p;
      *reinterpret_cast<XPack*>(out + half + i0) = x2p;
    }
  }
}

inline bool aligned(const void* ptr, int64_t bytes) {
  return bytes <= 1 || reinterpret_cast<uintptr_t>(ptr) % static_cast<uint64_t>(bytes) == 0;
}

// Can every access of the V-wide instantiation be one aligned Pack?
template <typename T, typename TT, int V>
bool rope_vector_ok(const RopeParams& p) {
  if (p.half % V != 0) return false;
  const int64_t xa = kAlignOf(V * int(sizeof(T))), ta = kAlignOf(V * int(sizeof(TT)));
  if (!aligned(p.cos, ta) || !aligned(p.sin, ta)) return false;
  if ((p.cos_row_stride * int64_t(sizeof(TT))) % ta || (p.sin_row_stride * int64_t(sizeof(TT))) % ta)
    return false;
  for (int t = 0; t < p.num_tensors; ++t) {
    const RopeTensorParams& tp = p.t[t];
    if (tp.D % V != 0 || !aligned(tp.x, xa) || !aligned(tp.out, xa)) return false;
    const int64_t strides[6] = {tp.x_batch_stride,   tp.x_row_stride,   tp.x_head_stride,
                                tp.out_batch_stride, tp.out_row_stride, tp.out_head_stride};
    for (int64_t st : strides) {
      if ((st * int64_t(sizeof(T))) % xa) return false;
    }
  }
  return true;
}

template <typename T, typename TT, int V>
void launch_rope_v(const RopeParams& p, cudaStream_t stream) {
  int64_t units[2] = {0, 0}, uph[2] = {1, 1};
  for (int t = 0; t < p.num_tensors; ++t) {
    const RopeTensorParams& tp = p.t[t];
    const int64_t pass = tp.out != tp.x ? (tp.D - 2 * p.half) / V : 0;
    const int64_t u = p.half / V + pass;
    uph[t] = u > 0 ? u : 1;
    units[t] = u > 0 ? tp.H * u : 0;  // one row's units of this tensor
  }
  const int64_t row_units = units[0] + units[1];
  const int64_t rows = p.B * p.S;
  if (row_units == 0 || rows == 0) return;
  const int threads = row_units >= 256 ? 256 : (row_units >= 64 ? 64 : 32);
  const int64_t gx = (row_units + threads - 1) / threads;
  // Enough y-blocks to fill the GPU many times over; each then strides over rows.
  const int64_t gy = rows < 65535 ? rows : 65535;
  dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  rope_kernel<T, TT, V><<<grid, threads, 0, stream>>>(p, units[0], units[1], uph[0], uph[1]);
}

// Launch on `stream`; the caller checks the launch (C10_CUDA_KERNEL_LAUNCH_CHECK).
template <typename T, typename TT>
void launch_rope(const RopeParams& p, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T) > 0 ? int(16 / sizeof(T)) : 1;
  if (rope_vector_ok<T, TT, V>(p)) {
    launch_rope_v<T, TT, V>(p, stream);
  } else {
    launch_rope_v<T, TT, 1>(p, stream);
  }
}

}  // namespace cuda
}  // namespace attn_ext
