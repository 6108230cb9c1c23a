// Tensor-facing (stable ABI) half of the score terms (issue 15): input checks of alibi_slopes / rel_bias /
// softcap / sinks / dropout, the filling of AttentionParams::terms and the d rel_bias output,
// shared by the CPU adapters (csrc/cpu/attention_fwd.cpp / attention_bwd.cpp) and the CUDA
// adapter (csrc/cuda/attention.cu). The rule itself is PyTorch-free, in
// common/attention_mask.h (ScoreTerms). Every failure names the argument.
#pragma once

#include <cmath>
#include <limits>
#include <optional>

#include "common/attention_checks.h"
#include "common/attention_mask.h"
#include "common/dropout_rng.h"

namespace attn_ext {

// The score-term arguments of the forward / backward ops, as the schema passes them. Hidden
// visibility like the torch::stable::Tensor it refers to (torch's hidden namespace).
struct ATTN_EXT_HIDDEN ScoreArgs {
  const OptTensor& alibi_slopes;
  const OptTensor& rel_bias;
  std::optional<double> softcap;
  const OptTensor& sinks;  // forward only (the backward reads lse)
  double dropout_p;
  int64_t dropout_seed;
  int64_t dropout_offset;
};

// True when any term (or dropout) is asked for.
inline bool score_terms_requested(const ScoreArgs& a) {
  return a.alibi_slopes.has_value() || a.rel_bias.has_value() || a.softcap.has_value() ||
         a.sinks.has_value() || a.dropout_p != 0.0;
}

// A score-term table (alibi_slopes, rel_bias, sinks) of another floating dtype than the
// accumulation type, converted to it (a copy of H or H (2M + 1) values): DESIGN's float32
// tables for float64 inputs (gradcheck), a bf16 model's bf16 rel_bias. A strided one
// (rel_bias.t().contiguous().t(), sinks[::2], an expanded table) is copied contiguous the same
// way: the fake kernels accept any strides, and refusing them here let a compiled or exported
// graph trace and then fail when it ran. Other dtypes pass unchanged, for check_term_tensor
// to refuse by name.
inline bool is_float_table_dtype(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::Half ||
         t == ScalarType::BFloat16;
}
inline OptTensor acc_table(const OptTensor& t, const Tensor& q) {
  if (!t.has_value()) return t;
  const ScalarType want = lse_dtype(q.scalar_type());
  if (!is_float_table_dtype(t->scalar_type())) return t;
  const Tensor same = t->scalar_type() == want ? *t : torch::stable::to(*t, want);
  return same.is_contiguous() ? same : torch::stable::contiguous(same);
}

// The tables of one call in the accumulation type (acc_table), kept alive for the kernels.
struct ATTN_EXT_HIDDEN AccTables {
  OptTensor alibi_slopes, rel_bias, sinks;
  AccTables(const OptTensor& a, const OptTensor& r, const OptTensor& s, const Tensor& q)
      : alibi_slopes(acc_table(a, q)), rel_bias(acc_table(r, q)), sinks(acc_table(s, q)) {}
};

// d rel_bias in the dtype of the rel_bias the caller passed (the kernels accumulate it in the
// accumulation type; the fake kernels promise rel_bias's dtype).
inline Tensor drel_as_table(const Tensor& drel, const OptTensor& rel_bias) {
  if (!rel_bias.has_value() || drel.scalar_type() == rel_bias->scalar_type()) return drel;
  return torch::stable::to(drel, rel_bias->scalar_type());
}

// A float table of the accumulation type (float32; float64 for float64 inputs), contiguous,
// on q's device (after acc_table).
inline void check_term_tensor(const Tensor& t, const char* name, const char* shape,
                              const Tensor& q) {
  const ScalarType want = lse_dtype(q.scalar_type());
  STD_TORCH_CHECK(t.scalar_type() == want, name, " must be a floating-point table ", shape,
              " (the kernels read it as ", want, " for ", q.scalar_type(), " inputs), got dtype ",
              t.scalar_type());
  check_same_device(t, q, name, "q");
  STD_TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", strides_of(t));
}

// Checks the arguments and fills p.terms. B is the batch size (number of sequences when
// packed), H the number of query heads.
inline void fill_score_terms(AttentionParams& p, const ScoreArgs& a, const Tensor& q,
                             int64_t B, int64_t H) {
  ScoreTerms& t = p.terms;
  if (a.softcap.has_value()) {
    STD_TORCH_CHECK(std::isfinite(*a.softcap) && *a.softcap > 0.0,
                "softcap must be a finite number > 0 (or None), got ", *a.softcap);
    // Below float64 the kernels cap float32 scores, the CUDA ones in base-2 units (softcap *
    // log2 e): a softcap past float's range there was inf, and inf * tanh(s / inf) NaN in every
    // output. Half of float's maximum keeps both finite.
    const double max_cap = static_cast<double>(std::numeric_limits<float>::max()) / 2;
    STD_TORCH_CHECK(q.scalar_type() == dtype::kDouble || *a.softcap <= max_cap,
                "softcap must be at most ", max_cap, " for ", q.scalar_type(),
                " inputs (the kernels cap float32 scores), got ", *a.softcap);
    t.softcap = *a.softcap;
  }
  if (a.alibi_slopes.has_value()) {
    const Tensor& s = *a.alibi_slopes;
    check_term_tensor(s, "alibi_slopes", "(H,) or (B, H)", q);
    const bool per_head = s.dim() == 1 && s.size(0) == H;
    const bool per_batch = s.dim() == 2 && s.size(0) == B && s.size(1) == H;
    STD_TORCH_CHECK(per_head || per_batch, "alibi_slopes must have shape (H,) = (", H,
                ",) or (B, H) = (", B, ", ", H, "), got shape ", shape_of(s));
    t.alibi = s.data_ptr();
    t.alibi_batch_stride = per_batch ? H : 0;
  }
  if (a.rel_bias.has_value()) {
    const Tensor& r = *a.rel_bias;
    check_term_tensor(r, "rel_bias", "(H, 2M + 1)", q);
    STD_TORCH_CHECK(r.dim() == 2 && r.size(0) == H && r.size(1) % 2 == 1,
                "rel_bias must have shape (H, 2M + 1) with H = ", H,
                " and an odd number of distances, got shape ", shape_of(r));
    t.rel_bias = r.data_ptr();
    t.rel_max = (r.size(1) - 1) / 2;
  }
  if (a.sinks.has_value()) {
    const Tensor& s = *a.sinks;
    check_term_tensor(s, "sinks", "(H,)", q);
    STD_TORCH_CHECK(s.dim() == 1 && s.size(0) == H, "sinks must have shape (H,) = (", H,
                ",), got shape ", shape_of(s));
    t.sinks = s.data_ptr();
  }
  STD_TORCH_CHECK(std::isfinite(a.dropout_p) && a.dropout_p >= 0.0 &&
                      a.dropout_p <= dropout::kMaxDropoutP,
                  "dropout_p must be in [0, 1) (at most 1 - 2^-16: the keep bits are drawn at "
                  "16-bit resolution), got ", a.dropout_p);
  t.dropout_p = a.dropout_p;
  t.dropout_seed = static_cast<uint64_t>(a.dropout_seed);
  t.dropout_offset = static_cast<uint64_t>(a.dropout_offset);
}

// d rel_bias output of the backward ops: zeros like rel_bias (the kernels write or accumulate
// into it), or an empty (0,) tensor of the accumulation type without it.
inline Tensor make_drel_bias(const OptTensor& rel_bias, const Tensor& q) {
  if (!rel_bias.has_value()) return alloc(q, {0}, lse_dtype(q.scalar_type()));
  return alloc_zeros(*rel_bias, sizes_vec(*rel_bias), rel_bias->scalar_type());
}

}  // namespace attn_ext
