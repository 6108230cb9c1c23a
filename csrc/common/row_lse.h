// The lse of a row whose kernel left it NaN: DESIGN.md defines lse as the log-sum-exp of the
// row's visible scores (sinks[h] joined), as torch.logsumexp takes it: NaN when a score is
// NaN, else +inf when a score is +inf. An online softmax cannot tell the two apart: it
// subtracts the running max, and a +inf max gives exp(inf - inf) = NaN at its own key. So the
// kernels write NaN for both, and the adapters run this on the rows they left NaN (rows that
// meet a non-finite q, k, table entry or sink; none otherwise), which recomputes the row's
// scores by the one rule (common/attention_mask.h) and tells them apart. The output of such a
// row stays NaN either way (the reference's probability at a +inf key is NaN too); the
// backward then reads lse +inf as "probability 0 at every finite score", as the reference's
// exp(s - lse) does.
//
// Host and device; no ATen types. Returns +inf or NaN (acc_t: the lse's type).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "common/attention_params.h"

namespace attn_ext {

// q . k of row i (of sequence s, batch / sequence b, query head h) and key j, unscaled,
// every product formed (eight partial sums: no order matters for what is decided from it,
// and they vectorise). to_acc(x): one scalar_t of q / k to acc_t.
template <typename acc_t, typename scalar_t, typename ToAcc>
ATTN_MASK_FN acc_t row_key_dot(const AttentionParams& p, const SeqInfo& s, int64_t b, int64_t h,
                               int64_t i, int64_t j, ToAcc to_acc) {
  const auto* q = static_cast<const scalar_t*>(p.q) + b * p.q_batch_stride +
                  (s.q0 + i) * p.q_row_stride + h * p.q_head_stride;
  const auto* k = static_cast<const scalar_t*>(p.k) + b * p.k_batch_stride +
                  (s.k0 + j) * p.k_row_stride + (h / (p.H / p.Hkv)) * p.k_head_stride;
  acc_t part[8] = {};
  int64_t d = 0;
  for (; d + 8 <= p.D; d += 8)
    for (int u = 0; u < 8; ++u) part[u] += to_acc(q[d + u]) * to_acc(k[d + u]);
  for (; d < p.D; ++d) part[0] += to_acc(q[d]) * to_acc(k[d]);
  acc_t x = acc_t(0);
  for (int u = 0; u < 8; ++u) x += part[u];
  return x;
}

// The lse of row i of sequence s (batch / sequence b), query head h: +inf or NaN.
// dot(j): q . k_j unscaled (row_key_dot), or any value of the same class (finite, +inf,
// -inf or NaN) where the caller knows a cheaper one: 0 for a finite product, the sum over q's
// infinite channels alone (a finite part cannot move +-inf). A finite product can still
// overflow to +-inf in acc_t; such a row is left NaN, as the float64 reference would not
// overflow. only: nullptr (every visible key), or the sorted keys (n_only of them) whose
// scores may be non-finite, the caller having checked that every other visible key's score
// is finite (q's row, the other k rows and the tables hold no inf / NaN).
template <typename acc_t, typename Dot>
ATTN_MASK_FN acc_t nan_row_lse(const AttentionParams& p, const SeqInfo& s, int64_t b, int64_t h,
                               int64_t i, Dot dot, const int64_t* only = nullptr,
                               int64_t n_only = 0) {
  const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  const Visibility vis = p.visibility();
  const ScoreTerms terms = p.score_terms();
  bool pos_inf = false;
  if (terms.has_sinks()) {
    const acc_t sink = terms.sink<acc_t>(h);
    if (sink != sink) return nan;
    pos_inf = sink == inf;
  }
  const Range keys = vis.band_keys(s, i);
  // (the listed keys: from the first one >= keys.lo)
  int64_t t = 0;
  if (only != nullptr) {
    int64_t hi = n_only;
    while (t < hi) {
      const int64_t mid = t + (hi - t) / 2;
      if (only[mid] < keys.lo) t = mid + 1; else hi = mid;
    }
  }
  for (int64_t j = keys.lo; j < keys.hi; ++j) {
    if (only != nullptr) {
      if (t >= n_only || only[t] >= keys.hi) break;
      j = only[t++];
    }
    if (!vis.key_valid(b, j)) continue;
    acc_t x = dot(j) * static_cast<acc_t>(p.scale);
    if (terms.active()) x = terms.add<acc_t>(x, b, h, i + s.off - j);
    if (x != x) return nan;
    if (x == inf) pos_inf = true;
  }
  return pos_inf ? inf : nan;
}

}  // namespace attn_ext
