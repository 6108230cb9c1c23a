// Tensor-facing (stable ABI) half of the masks: input checks of window / key_padding_mask / cu_seqlens and
// the filling of AttentionParams::mask, shared by the CPU and CUDA adapters. The rule
// itself is PyTorch-free, in common/attention_mask.h. Every failure names the argument.
#pragma once

#include <optional>
#include <string>

#include "common/attention_checks.h"
#include "common/attention_mask.h"

namespace attn_ext {

inline void check_window(int64_t left, int64_t right) {
  STD_TORCH_CHECK(left >= -1 && right >= -1,
              "window must be (left, right) with each side >= 0, or -1 for unbounded, got (",
              left, ", ", right, ")");
}

// Bounds that keep the band's index sums (i + off + right, j - off + left, ...) far from
// int64 overflow. A block's global start (q_start / k_start) is below 2^60, so every distance
// d = i + off - j a call can have is below 2^60 + its lengths in magnitude, and a window side
// of 2^61 or more reaches every key: it is stored as -1 (unbounded), the same visibility.
constexpr int64_t kMaxBlockStart = int64_t(1) << 60;
constexpr int64_t kWindowUnboundedFrom = int64_t(1) << 61;
inline int64_t window_side(int64_t w) { return w >= kWindowUnboundedFrom ? -1 : w; }

// The window (causal: right = 0) of a dense or packed call into its MaskParams.
inline void fill_window(MaskParams& m, bool causal, int64_t window_left, int64_t window_right) {
  check_window(window_left, window_right);
  m.left = window_side(window_left);
  m.right = causal ? 0 : window_side(window_right);
}

inline void check_key_padding_mask(const Tensor& kpm, const Tensor& q,
                                   const AttentionShape& s) {
  STD_TORCH_CHECK(kpm.scalar_type() == ScalarType::Bool,
              "key_padding_mask must be bool (B, Sk), True = the key takes part, got dtype ",
              kpm.scalar_type());
  check_same_device(kpm, q, "key_padding_mask", "q");
  STD_TORCH_CHECK(kpm.dim() == 2 && kpm.size(0) == s.B && kpm.size(1) == s.Sk,
              "key_padding_mask must have shape (B, Sk) = (", s.B, ", ", s.Sk, "), got shape ",
              shape_of(kpm));
}

// Window, causal (right = 0) and key padding of a (batched) problem into p.mask.
inline void fill_mask_params(AttentionParams& p, const AttentionShape& s, const Tensor& q,
                             bool causal, int64_t window_left, int64_t window_right,
                             const OptTensor& key_padding_mask) {
  fill_window(p.mask, causal, window_left, window_right);
  if (key_padding_mask.has_value()) {
    const Tensor& kpm = *key_padding_mask;
    check_key_padding_mask(kpm, q, s);
    p.mask.key_padding = reinterpret_cast<const uint8_t*>(kpm.data_ptr());
    p.mask.kpm_batch_stride = kpm.stride(0);
    p.mask.kpm_key_stride = kpm.stride(1);
  }
}

// q_start / k_start of the dense ops: the call is the block of queries [q_start, q_start + Sq)
// and keys [k_start, k_start + Sk) of one longer sequence (ring attention). Positions are
// then global: d = (q_start + i) - (k_start + j) for causal, window, ALiBi and rel_bias (off
// = q_start - k_start instead of Sk - Sq), and dropout draws the keep bit of (q_start + i,
// k_start + j). Both None: the call is the whole problem (off = Sk - Sq, dropout of (i, j)).
inline void fill_block_position(AttentionParams& p, std::optional<int64_t> q_start,
                                std::optional<int64_t> k_start, bool has_sinks) {
  STD_TORCH_CHECK(q_start.has_value() == k_start.has_value(),
                  "q_start and k_start must be given together (a block's global position) or "
                  "both be None, got q_start = ",
                  q_start.has_value() ? std::to_string(*q_start) : std::string("None"),
                  ", k_start = ",
                  k_start.has_value() ? std::to_string(*k_start) : std::string("None"));
  if (!q_start.has_value()) return;
  STD_TORCH_CHECK(*q_start >= 0 && *q_start < kMaxBlockStart, "q_start must be >= 0 (and < 2^60), got ",
                  *q_start);
  STD_TORCH_CHECK(!has_sinks,
                  "sinks cannot be combined with q_start / k_start: a block's lse would count "
                  "the sink once per block (add it once, after merging the blocks)");
  STD_TORCH_CHECK(*k_start >= 0 && *k_start < kMaxBlockStart, "k_start must be >= 0 (and < 2^60), got ",
                  *k_start);
  p.mask.block = true;
  p.mask.q_start = *q_start;
  p.mask.k_start = *k_start;
}

// The mask and block-position arguments refused as fill_mask_params / fill_block_position
// refuse them, with nothing kept: for adapters that return early on an empty input before they
// build their params (the CUDA ones), so that an empty call refuses what the same call with
// data (and the CPU adapter) refuses.
inline void check_mask_args(const AttentionShape& s, const Tensor& q, bool causal,
                            int64_t window_left, int64_t window_right,
                            const OptTensor& key_padding_mask, std::optional<int64_t> q_start,
                            std::optional<int64_t> k_start, bool has_sinks) {
  AttentionParams p{};
  fill_mask_params(p, s, q, causal, window_left, window_right, key_padding_mask);
  fill_block_position(p, q_start, k_start, has_sinks);
}

// dlse: the gradient of the forward's lse, same shape and dtype.
inline void check_dlse(const Tensor& dlse, const Tensor& lse) {
  STD_TORCH_CHECK(same_sizes(dlse, sizes_vec(lse)), "dlse must have lse's shape ", shape_of(lse),
                  ", got ", shape_of(dlse));
  STD_TORCH_CHECK(dlse.scalar_type() == lse.scalar_type(), "dlse must have lse's dtype ",
              lse.scalar_type(), ", got ", dlse.scalar_type());
  check_same_device(dlse, lse, "dlse", "lse");
}

// ---- packed sequences (attention_varlen_*) -------------------------------------------------

inline void check_cu_seqlens(const Tensor& cu, const char* name, const Tensor& q,
                             int64_t total, int64_t max_seqlen, const char* max_name) {
  check_defined(cu, name);
  STD_TORCH_CHECK(cu.scalar_type() == ScalarType::Int, name, " must be int32 (N + 1,), got dtype ",
              cu.scalar_type());
  STD_TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, name,
              " must have shape (N + 1,) with N >= 0 sequences, got shape ", shape_of(cu));
  check_same_device(cu, q, name, "q");
  STD_TORCH_CHECK(cu.is_contiguous(), name, " must be contiguous, got strides ", strides_of(cu));
  STD_TORCH_CHECK(max_seqlen >= 0, max_name, " must be >= 0, got ", max_seqlen);
  const int64_t n = cu.size(0) - 1;
  if (!cu.is_cpu()) {
    // On CUDA the values are not read on the host (no sync); the kernels device-assert them.
    // What the sizes alone refute is refused here: N sequences of at most max_seqlen rows
    // cannot hold `total` packed rows (a kernel with no rows to run would assert nothing and
    // leave out / lse unwritten).
    STD_TORCH_CHECK(n > 0 || total == 0, name, " has 0 sequences (shape ", shape_of(cu),
                    "), but there are ", total, " packed rows");
    STD_TORCH_CHECK(total == 0 || max_seqlen >= (total + n - 1) / n, max_name, " = ", max_seqlen,
                    " is smaller than the longest sequence: ", n, " sequences of ", name,
                    " hold ", total, " packed rows");
    return;
  }
  const int32_t* c = static_cast<const int32_t*>(cu.data_ptr());
  STD_TORCH_CHECK(c[0] == 0, name, " must start at 0, got ", name, "[0] = ", c[0]);
  for (int64_t b = 0; b < n; ++b) {
    STD_TORCH_CHECK(c[b + 1] >= c[b], name, " must be non-decreasing, got ", name, "[", b, "] = ",
                c[b], " > ", name, "[", b + 1, "] = ", c[b + 1]);
    STD_TORCH_CHECK(c[b + 1] - c[b] <= max_seqlen, max_name, " = ", max_seqlen,
                " is smaller than sequence ", b, " of ", name, " (length ", c[b + 1] - c[b], ")");
  }
  STD_TORCH_CHECK(c[n] == total, name, " must end at the number of packed rows ", total, ", got ",
              name, "[", n, "] = ", c[n]);
}

// q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv). Returns the shape with B = N sequences,
// Sq = max_seqlen_q, Sk = max_seqlen_k.
inline AttentionShape check_varlen_inputs(const Tensor& q, const Tensor& k,
                                          const Tensor& v, const Tensor& cu_seqlens_q,
                                          const Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                          int64_t max_seqlen_k,
                                          const std::optional<double>& scale) {
  check_dim(q, "q", 3, "(Tq, H, D)");
  check_dim(k, "k", 3, "(Tk, Hkv, D)");
  check_dim(v, "v", 3, "(Tk, Hkv, Dv)");
  STD_TORCH_CHECK(v.size(0) == k.size(0), "v must have Tk = ", k.size(0),
              " packed rows (from k), got shape ", shape_of(v));
  // The shape and stride rules first on the packed (T, H, D) tensors the caller passed, so
  // that a failure shows them, not the (1, T, H, D) views below.
  STD_TORCH_CHECK(k.size(2) == q.size(2), "k must have head dim D = ", q.size(2),
              " (from q), got shape ", shape_of(k));
  STD_TORCH_CHECK(v.size(1) == k.size(1), "v must have Hkv = ", k.size(1),
              " heads (from k), got shape ", shape_of(v));
  STD_TORCH_CHECK((k.size(1) > 0 && q.size(1) % k.size(1) == 0) || (k.size(1) == 0 && q.size(1) == 0),
              "k's number of heads Hkv = ", k.size(1), " must divide q's number of heads H = ",
              q.size(1), " (GQA/MQA), got k shape ", shape_of(k), " and q shape ", shape_of(q));
  check_row_contiguous(q, "q");
  check_row_contiguous(k, "k");
  check_row_contiguous(v, "v");
  // dtypes, devices: the batched checks on (1, T, H, D) views
  AttentionShape s = check_attention_inputs(torch::stable::unsqueeze(q, 0), torch::stable::unsqueeze(k, 0),
                                                torch::stable::unsqueeze(v, 0), scale);
  check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q, q.size(0), max_seqlen_q, "max_seqlen_q");
  check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q, k.size(0), max_seqlen_k, "max_seqlen_k");
  STD_TORCH_CHECK(cu_seqlens_k.size(0) == cu_seqlens_q.size(0),
              "cu_seqlens_k must have as many sequences as cu_seqlens_q (", cu_seqlens_q.size(0),
              " entries), got ", cu_seqlens_k.size(0));
  s.B = cu_seqlens_q.size(0) - 1;
  // No sequence is longer than all the packed rows: a loose bound (FlashAttention's callers
  // often pass one) is clamped, so the tiling never plans work for rows that do not exist.
  s.Sq = std::min(max_seqlen_q, q.size(0));
  s.Sk = std::min(max_seqlen_k, k.size(0));
  return s;
}

// Turns params filled from (1, T, ...) views into packed ones: batch strides 0, per-sequence
// rows from cu_seqlens, lse (H, Tq); Tq / Tk packed q / k rows.
inline void make_params_packed(AttentionParams& p, const AttentionShape& s, int64_t Tq,
                               int64_t Tk, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                               bool causal, int64_t window_left, int64_t window_right) {
  fill_window(p.mask, causal, window_left, window_right);
  p.B = s.B;
  p.Sq = s.Sq;
  p.Sk = s.Sk;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.out_batch_stride = 0;
  p.lse_batch_stride = 0;
  p.lse_head_stride = Tq;
  p.mask.cu_seqlens_q = static_cast<const int32_t*>(cu_seqlens_q.data_ptr());
  p.mask.cu_seqlens_k = static_cast<const int32_t*>(cu_seqlens_k.data_ptr());
  p.mask.n_seq = s.B;
  p.mask.total_q = Tq;
  p.mask.total_k = Tk;
}

// The backward of packed sequences: checks of dout (Tq, H, Dv), out, lse (H, Tq) and dlse on
// top of check_varlen_inputs. Returns the shape (B = N sequences, Sq / Sk = max lengths).
inline AttentionShape check_varlen_bwd_inputs(const Tensor& dout, const Tensor& q,
                                              const Tensor& k, const Tensor& v, const Tensor& out,
                                              const Tensor& lse, const Tensor& cu_seqlens_q,
                                              const Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                              int64_t max_seqlen_k,
                                              const std::optional<double>& scale,
                                              const OptTensor& dlse) {
  using torch::stable::unsqueeze;
  const AttentionShape s = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, scale);
  check_dim(dout, "dout", 3, "(Tq, H, Dv)");
  check_dim(out, "out", 3, "(Tq, H, Dv)");
  check_dim(lse, "lse", 2, "(H, Tq)");
  // shapes and strides on the packed tensors first (a failure shows them, not the views)
  const std::vector<int64_t> o_shape{q.size(0), s.H, s.Dv};
  STD_TORCH_CHECK(same_sizes(dout, o_shape), "dout must have shape ", IntList{o_shape},
              " (Tq, H, Dv), got ", shape_of(dout));
  STD_TORCH_CHECK(same_sizes(out, o_shape), "out must have shape ", IntList{o_shape},
              " (Tq, H, Dv), got ", shape_of(out));
  const std::vector<int64_t> l_shape{s.H, q.size(0)};
  STD_TORCH_CHECK(same_sizes(lse, l_shape), "lse must have shape ", IntList{l_shape},
              " (H, Tq), got ", shape_of(lse));
  check_row_contiguous(dout, "dout");
  check_row_contiguous(out, "out");
  const AttentionShape s1{1, q.size(0), k.size(0), s.H, s.Hkv, s.D, s.Dv};
  check_attention_bwd_inputs(unsqueeze(dout, 0), unsqueeze(out, 0), unsqueeze(lse, 0), q, s1);
  if (dlse.has_value()) check_dlse(*dlse, lse);
  return s;
}

// Backward params of packed sequences (lse and dlse contiguous, dlse may be undefined): the
// batched params of (1, T, ...) views made packed, every batch stride 0.
inline AttentionBwdParams make_varlen_bwd_params(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, const Tensor& dlse, const Tensor& dq, const Tensor& dk, const Tensor& dv,
    const AttentionShape& s, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, bool causal,
    const std::optional<double>& scale, int64_t window_left, int64_t window_right) {
  using torch::stable::unsqueeze;
  AttentionBwdParams bp = make_attention_bwd_params(
      unsqueeze(dout, 0), unsqueeze(q, 0), unsqueeze(k, 0), unsqueeze(v, 0), unsqueeze(out, 0),
      lse, dq, dk, dv, s, causal, scale);
  make_params_packed(bp.fwd, s, q.size(0), k.size(0), cu_seqlens_q, cu_seqlens_k, causal, window_left,
                     window_right);
  bp.dout_batch_stride = bp.o_batch_stride = 0;
  bp.dq_batch_stride = bp.dk_batch_stride = bp.dv_batch_stride = 0;
  if (dlse.defined()) bp.dlse = dlse.data_ptr();
  return bp;
}

}  // namespace attn_ext
