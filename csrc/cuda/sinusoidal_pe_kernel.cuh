// Device code for attn_ext::sinusoidal_pe(_): pointers, strides and a stream, no ATen or c10
// types (scalar_t = float, double, __half, __nv_bfloat16; conversions from cuda/elem.cuh).
//
//   out (B, S, D) = x (B, S, D) + PE(pos(b, s), :),  PE(pos, 2i) = sin(pos * w_i),
//   PE(pos, 2i+1) = cos(pos * w_i),  w_i = base^(-2i/D)
//
// One thread per column pair (2i, 2i+1) of one row; a 2-D grid: x covers pairs, y covers rows
// (b, s) in a grid-stride loop. The angle is formed and range-reduced in double so that large
// positions keep float accuracy; sin/cos then run in float (double for double tensors).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/pos_enc_params.h"
#include "cuda/elem.cuh"

namespace attn_ext {
namespace cuda {

template <typename scalar_t>
__global__ void sinusoidal_pe_kernel(SinusoidalParams p) {
  using acc_t = typename AccOf<scalar_t>::type;
  const int64_t pairs = (p.D + 1) / 2;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= pairs) return;
  const auto* x = static_cast<const scalar_t*>(p.x);
  auto* out = static_cast<scalar_t*>(p.out);
  const double inv_freq = exp(-(2.0 * static_cast<double>(i) / static_cast<double>(p.D)) * p.log_base);
  const int64_t col = 2 * i;
  const bool has_cos = col + 1 < p.D;
  const int64_t rows = p.B * p.S;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t b = row / p.S;
    const int64_t s = row - b * p.S;
    const int64_t pos = p.positions ? p.positions[b * p.pos_batch_stride + s * p.pos_row_stride]
                                    : p.offset + s;
    double a = static_cast<double>(pos) * inv_freq;
    acc_t sn, cs;
    if constexpr (sizeof(acc_t) == 8) {
      sincos(a, &sn, &cs);
    } else {
      constexpr double kTwoPi = 6.283185307179586476925286766559;
      a -= kTwoPi * rint(a * (1.0 / kTwoPi));
      sincosf(static_cast<float>(a), &sn, &cs);
    }
    const scalar_t* xr = x + b * p.x_batch_stride + s * p.x_row_stride;
    scalar_t* orow = out + b * p.out_batch_stride + s * p.out_row_stride;
    orow[col] = from_acc<scalar_t>(to_acc(xr[col * p.x_col_stride]) + sn);
    if (has_cos) {
      orow[col + 1] = from_acc<scalar_t>(to_acc(xr[(col + 1) * p.x_col_stride]) + cs);
    }
  }
}

// Launch on `stream`. Returns the launch's error code (the caller checks it).
template <typename scalar_t>
cudaError_t launch_sinusoidal_pe(const SinusoidalParams& p, cudaStream_t stream) {
  const int64_t pairs = (p.D + 1) / 2;
  const int threads = pairs >= 256 ? 256 : (pairs >= 64 ? 128 : 32);
  const int64_t rows = p.B * p.S;
  dim3 grid(static_cast<unsigned>((pairs + threads - 1) / threads),
            static_cast<unsigned>(rows < 65535 ? rows : 65535));
  sinusoidal_pe_kernel<scalar_t><<<grid, threads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace attn_ext
