// Plain-data parameters of the positional-encoding kernels: pointers, sizes and explicit
// strides (in elements), filled in one place by the adapters and read by both the CPU
// and CUDA kernels. No ATen types here.
#pragma once

#include <cstdint>

namespace attn_ext {

// out (B, S, D) = x (B, S, D) + PE(pos(b, s), :)
//   pos(b, s) = positions[b * pos_batch_stride + s * pos_row_stride]  if positions != nullptr
//             = offset + s                                             otherwise
// A 2-D x (S, D) is viewed as B = 1. out may alias x (in-place variant).
struct SinusoidalParams {
  const void* x;
  void* out;
  const int64_t* positions;  // nullable
  int64_t B, S, D;
  int64_t x_batch_stride, x_row_stride, x_col_stride;
  int64_t out_batch_stride, out_row_stride;  // out's last dim is contiguous
  int64_t pos_batch_stride, pos_row_stride;  // pos_batch_stride == 0: shared by all batches
  int64_t offset;
  double log_base;  // ln(base)
};

}  // namespace attn_ext

// RoPE on up to two tensors (q and k) sharing one cos/sin table and one set of positions.
//
//   x (B, S, H, D) -> out (B, S, H, D), rotary_dim = 2 * half <= D
//   angle(b, s, i) = theta_i * pos(b, s), cos/sin read from the tables at row pos(b, s):
//     cos[pos * cos_row_stride + i], sin[pos * sin_row_stride + i], i < half
//   half-split  (GPT-NeoX / HF):   pairs (i, i + half)
//   interleaved (GPT-J / Meta):    pairs (2i, 2i + 1)
//   (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); inverse = true uses -sin (R^T, the
//   backward of the rotation).
//   Channels [2 * half, D) are copied when out != x and left untouched when out == x.
//   pos(b, s) = positions[b * pos_batch_stride + s * pos_row_stride] if positions != nullptr
//             = offset + s                                           otherwise
// The adapters guarantee 0 <= pos(b, s) < S_max on CPU (checked before the kernel runs);
// the CUDA kernel re-checks with a device assert and skips a bad row (never reads past the
// table).
struct RopeTensorParams {
  const void* x;
  void* out;  // may equal x (in place)
  int64_t H, D;
  int64_t x_batch_stride, x_row_stride, x_head_stride;  // x's last dim is contiguous
  int64_t out_batch_stride, out_row_stride, out_head_stride;
};

struct RopeParams {
  RopeTensorParams t[2];  // t[0] = q (or x), t[1] = k; only num_tensors are valid
  int num_tensors;
  int64_t B, S;
  const void* cos;  // (S_max, half), last dim contiguous
  const void* sin;
  int64_t cos_row_stride, sin_row_stride;
  int64_t S_max, half;
  const int64_t* positions;  // nullable
  int64_t pos_batch_stride, pos_row_stride;  // pos_batch_stride == 0: shared by all batches
  int64_t offset;
  bool interleaved;
  bool inverse;
};
