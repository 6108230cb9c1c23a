// Argument checks and params filling for attn_ext::sinusoidal_pe(_), shared by the
// CPU and CUDA adapters.
#pragma once


#include <cmath>
#include <limits>
#include <optional>

#include "common/checks.h"
#include "common/pos_enc_params.h"

namespace attn_ext {

// out = x + PE into a new contiguous tensor / x += PE (x must not overlap itself).
inline Tensor sinusoidal_out_like(const Tensor& x) { return alloc(x, sizes_vec(x)); }

inline void check_sinusoidal_inplace(const Tensor& x, const OptTensor& positions) {
  check_last_dim_contiguous(x, "x (in place)");
  check_no_internal_overlap(x, "x", "sinusoidal_pe_");
  if (positions.has_value()) check_disjoint_from_written(x, "x", *positions, "positions", "sinusoidal_pe_");
}

inline void check_sinusoidal_rank(const Tensor& x) {
  STD_TORCH_CHECK(x.dim() == 2 || x.dim() == 3,
              "x must have 3 dims (B, S, D) or 2 dims (S, D), got shape ", shape_of(x));
}

// Checks arguments and fills params for x -> out (out may be x itself).
inline SinusoidalParams make_sinusoidal_params(const Tensor& x, const Tensor& out,
                             const OptTensor& positions, int64_t offset,
                             double base) {
  check_sinusoidal_rank(x);
  check_floating(x, "x");
  STD_TORCH_CHECK(std::isfinite(base) && base > 0.0, "base must be a positive finite number, got ",
              base);
  const bool batched_x = x.dim() == 3;
  SinusoidalParams p{};
  p.B = batched_x ? x.size(0) : 1;
  p.S = x.size(-2);
  p.D = x.size(-1);
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.x_batch_stride = batched_x ? x.stride(0) : 0;
  p.x_row_stride = x.stride(-2);
  p.x_col_stride = x.stride(-1);
  p.out_batch_stride = batched_x ? out.stride(0) : 0;
  p.out_row_stride = out.stride(-2);
  p.offset = offset;
  p.log_base = std::log(base);
  p.positions = nullptr;
  if (positions.has_value()) {
    const Tensor& pos = *positions;
    const bool per_batch = check_positions(pos, x, p.B, p.S, batched_x, offset);
    p.positions = static_cast<const int64_t*>(pos.data_ptr());
    p.pos_batch_stride = per_batch ? pos.stride(0) : 0;
    p.pos_row_stride = pos.stride(-1);
  } else if (p.S > 0) {
    // positions offset + s for s < S must be int64 (no wrap-around to negative positions)
    STD_TORCH_CHECK(offset <= std::numeric_limits<int64_t>::max() - (p.S - 1),
                    "offset + S - 1 = ", offset, " + ", p.S - 1,
                    " overflows int64 (the position of the last row)");
  }
  return p;
}

}  // namespace attn_ext
