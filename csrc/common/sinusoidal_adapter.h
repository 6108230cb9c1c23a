// ATen-side argument checks and params filling for attn_ext::sinusoidal_pe(_), shared by the
// CPU and CUDA adapters.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <optional>

#include "common/checks.h"
#include "common/pos_enc_params.h"

namespace attn_ext {

inline void check_sinusoidal_rank(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3,
              "x must have 3 dims (B, S, D) or 2 dims (S, D), got shape ", x.sizes());
}

// Checks arguments and fills params for x -> out (out may be x itself).
inline SinusoidalParams make_sinusoidal_params(const at::Tensor& x, const at::Tensor& out,
                             const std::optional<at::Tensor>& positions, int64_t offset,
                             double base) {
  check_sinusoidal_rank(x);
  check_floating(x, "x");
  TORCH_CHECK(std::isfinite(base) && base > 0.0, "base must be a positive finite number, got ",
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
    const at::Tensor& pos = *positions;
    const bool per_batch = check_positions(pos, x, p.B, p.S, batched_x);
    p.positions = pos.data_ptr<int64_t>();
    p.pos_batch_stride = per_batch ? pos.stride(0) : 0;
    p.pos_row_stride = pos.stride(-1);
  }
  return p;
}

}  // namespace attn_ext
