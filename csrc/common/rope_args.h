// Argument checks, RopeParams filling and the op bodies shared by the CPU and CUDA RoPE
// adapters (which differ only in the `run(x, cos, params)` that launches their kernel).
// Every failure names the argument, what was expected and what was given.
#pragma once


#include <optional>

#include "common/checks.h"
#include "common/pos_enc_params.h"

namespace attn_ext {

// x: (B, S, H, D) floating, last dim contiguous.
inline void check_rope_input(const Tensor& x, const char* name) {
  check_dim(x, name, 4, "(B, S, H, D)");
  check_floating(x, name);
  check_last_dim_contiguous(x, name);
}

// Fills everything but the tensors (added by add_rope_tensor). x gives B, S, dtype, device.
inline RopeParams make_rope_params(const Tensor& x, const Tensor& cos,
                                   const Tensor& sin,
                                   const OptTensor& positions, int64_t offset,
                                   bool interleaved, bool inverse) {
  check_dim(cos, "cos", 2, "(S_max, rotary_dim/2)");
  check_dim(sin, "sin", 2, "(S_max, rotary_dim/2)");
  STD_TORCH_CHECK(same_sizes(cos, sizes_vec(sin)), "cos and sin must have the same shape, got cos ",
              shape_of(cos), " and sin ", shape_of(sin));
  STD_TORCH_CHECK(cos.scalar_type() == sin.scalar_type(), "cos and sin must have the same dtype, got cos ",
              cos.scalar_type(), " and sin ", sin.scalar_type());
  STD_TORCH_CHECK(cos.scalar_type() == dtype::kFloat || cos.scalar_type() == x.scalar_type(),
              "cos/sin must be float32 or x's dtype (", x.scalar_type(), "), got ",
              cos.scalar_type());
  check_same_device(cos, x, "cos", "x");
  check_same_device(sin, x, "sin", "x");
  check_last_dim_contiguous(cos, "cos");
  check_last_dim_contiguous(sin, "sin");

  RopeParams p{};
  p.num_tensors = 0;
  p.B = x.size(0);
  p.S = x.size(1);
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.cos_row_stride = cos.stride(0);
  p.sin_row_stride = sin.stride(0);
  p.S_max = cos.size(0);
  p.half = cos.size(1);
  p.offset = offset;
  p.interleaved = interleaved;
  p.inverse = inverse;
  p.positions = nullptr;
  if (positions.has_value()) {
    const Tensor& pos = *positions;
    const bool per_batch = check_positions(pos, x, p.B, p.S, /*allow_batched=*/true, offset);
    p.positions = static_cast<const int64_t*>(pos.data_ptr());
    p.pos_batch_stride = per_batch ? pos.stride(0) : 0;
    p.pos_row_stride = pos.stride(-1);
  } else if (p.S > 0) {
    // offset <= S_max - S, not offset + S <= S_max: a huge offset must not wrap around.
    STD_TORCH_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
    STD_TORCH_CHECK(offset <= p.S_max - p.S, "offset + S = ", offset, " + ", p.S,
                " must lie in [0, cos.size(0) = ", p.S_max,
                "] (the cos/sin tables have no rows past that)");
  }
  return p;
}

// Adds x -> out (out may be x) as tensor number p.num_tensors.
inline void add_rope_tensor(RopeParams& p, const Tensor& x, const Tensor& out,
                            const char* name) {
  STD_TORCH_CHECK(p.num_tensors < 2, "internal: at most two tensors per RoPE call");
  STD_TORCH_CHECK(x.size(0) == p.B && x.size(1) == p.S, name, " must have B = ", p.B, " and S = ",
              p.S, " (the first two dims of q), got shape ", shape_of(x));
  STD_TORCH_CHECK(2 * p.half <= x.size(3), "rotary_dim = 2 * cos.size(-1) = ", 2 * p.half,
              " must be <= the head dim D = ", name, ".size(-1) = ", x.size(3));
  RopeTensorParams& t = p.t[p.num_tensors++];
  t.x = x.data_ptr();
  t.out = out.data_ptr();
  t.H = x.size(2);
  t.D = x.size(3);
  t.x_batch_stride = x.stride(0);
  t.x_row_stride = x.stride(1);
  t.x_head_stride = x.stride(2);
  t.out_batch_stride = out.stride(0);
  t.out_row_stride = out.stride(1);
  t.out_head_stride = out.stride(2);
}

// rope / _rope_backward: out = rotate(x) (inverse: by -angle) into a new contiguous tensor.
template <typename Run>
Tensor rope_out_of_place_with(Run&& run, const Tensor& x, const Tensor& cos,
                                  const Tensor& sin, const OptTensor& positions,
                                  int64_t offset, bool interleaved, bool inverse) {
  check_rope_input(x, "x");
  RopeParams p = make_rope_params(x, cos, sin, positions, offset, interleaved, inverse);
  Tensor out = alloc(x, sizes_vec(x));  // contiguous
  add_rope_tensor(p, x, out, "x");
  run(x, cos, p);
  return out;
}

// rope_: x rotated in place.
template <typename Run>
void rope_inplace_with(Run&& run, const Tensor& x, const Tensor& cos,
                       const Tensor& sin, const OptTensor& positions,
                       int64_t offset, bool interleaved) {
  check_rope_input(x, "x");
  check_no_internal_overlap(x, "x", "rope_");
  RopeParams p = make_rope_params(x, cos, sin, positions, offset, interleaved, false);
  check_disjoint_from_written(x, "x", cos, "cos", "rope_");
  check_disjoint_from_written(x, "x", sin, "sin", "rope_");
  // positions are read row by row as the rows are written: an x that held them would feed
  // rotated bits back as table indices (past the tables: an out-of-bounds read)
  if (positions.has_value()) check_disjoint_from_written(x, "x", *positions, "positions", "rope_");
  add_rope_tensor(p, x, x, "x");
  run(x, cos, p);
}

// rope_qk_: q and k rotated in place by one kernel run.
template <typename Run>
void rope_qk_inplace_with(Run&& run, const Tensor& q, const Tensor& k,
                          const Tensor& cos, const Tensor& sin,
                          const OptTensor& positions, int64_t offset,
                          bool interleaved) {
  check_rope_input(q, "q");
  check_rope_input(k, "k");
  STD_TORCH_CHECK(k.scalar_type() == q.scalar_type(), "k must have q's dtype (", q.scalar_type(),
              "), got ", k.scalar_type());
  check_same_device(k, q, "k", "q");
  check_no_internal_overlap(q, "q", "rope_qk_");
  check_no_internal_overlap(k, "k", "rope_qk_");
  check_no_overlap(q, "q", k, "k", "rope_qk_");
  RopeParams p = make_rope_params(q, cos, sin, positions, offset, interleaved, false);
  check_disjoint_from_written(q, "q", cos, "cos", "rope_qk_");
  check_disjoint_from_written(q, "q", sin, "sin", "rope_qk_");
  check_disjoint_from_written(k, "k", cos, "cos", "rope_qk_");
  check_disjoint_from_written(k, "k", sin, "sin", "rope_qk_");
  if (positions.has_value()) {
    check_disjoint_from_written(q, "q", *positions, "positions", "rope_qk_");
    check_disjoint_from_written(k, "k", *positions, "positions", "rope_qk_");
  }
  add_rope_tensor(p, q, q, "q");
  add_rope_tensor(p, k, k, "k");
  run(q, cos, p);
}

}  // namespace attn_ext
