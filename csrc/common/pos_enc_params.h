// Plain-data parameters of the positional-encoding kernels: pointers, sizes and explicit
// strides (in elements), filled in one place by the ATen adapters and read by both the CPU
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
