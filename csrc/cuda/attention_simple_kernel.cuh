// Device code of the simple CUDA attention kernels: the fallback for every shape and dtype the
// fast kernel (attention_fwd_kernel.cuh) does not cover, and the on-GPU oracle the fast kernel
// is tested against. Pointers, strides and a stream; no ATen types.
//
// Shapes (AttentionParams, common/attention_params.h):
//   q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv)   last dim contiguous, any strides
//   out (B, Sq, H, Dv) contiguous, lse (B, H, Sq) contiguous acc_t (float; double for double)
// Query head h reads kv head h / (H / Hkv). Which keys a row sees (causal, window, key
// padding, packed sequences): common/attention_mask.h, asked per row (key range) and per
// (i, j) (predicate); a hidden pair's zero weight is never multiplied into a sum (live bits),
// so a non-finite value at a hidden key never reaches the row.
//
// Scheme: one warp per output row (a query row in the forward and for dQ, a key row for
// dK/dV), 4 warps per block. The warp's own row (q, or k and v) is staged in shared memory in
// acc_t; each lane then takes one of 32 partner rows at a time (keys, or queries), computes
// its dot products over the whole head dim, and the warp folds the 32 results into
// per-lane output columns (lane + 32 c, c < 8, so head dims up to 256). Softmax is online
// in base 2: scores are pre-multiplied by scale * log2(e). Everything accumulates in acc_t
// (fp32 for fp32/fp16/bf16, fp64 for fp64). No atomics: dK/dV loop over the queries that
// see their key, so results are deterministic.
//
// Score terms (issue 15; common/attention_mask.h ScoreTerms, common/dropout_rng.h): every
// kernel takes softcap, ALiBi and rel_bias through ScoreTerms::add on each visible pair's
// score (term_score below), sinks in the forward's normalisation (write_row; the backward
// reads them through lse, and d sinks is computed by the Python caller from lse and out),
// and dropout through ScoreTerms::dropout_row_key / dropout_col and dropout::keep with
// b, h, i, j the local indices of the call (per sequence for packed input; the bases of a
// q_start / k_start block added by ScoreTerms), as the CPU kernels do, so both backends drop
// the same entries. d rel_bias: pass 3 and 4 of the backward (simple_bwd_drel_diag_kernel,
// simple_bwd_drel_reduce_kernel), a fixed-order reduction without atomics: deterministic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/attention_params.h"
#include "common/dropout_rng.h"
#include "common/row_lse.h"
#include "cuda/elem.cuh"  // AccOf, to_acc, from_acc
#include "cuda/attention_launch.h"  // kMaxHeadDim, kWarps and the launcher declarations

namespace attn_ext {
namespace cuda {
namespace simple {

constexpr int kCols = kMaxHeadDim / 32;      // output columns per lane
constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;

__device__ __forceinline__ float exp2_acc(float x) { return exp2f(x); }
__device__ __forceinline__ double exp2_acc(double x) { return exp2(x); }
__device__ __forceinline__ float log2_acc(float x) { return log2f(x); }
__device__ __forceinline__ double log2_acc(double x) { return log2(x); }

template <typename acc_t>
__device__ __forceinline__ acc_t neg_inf() {
  return -static_cast<acc_t>(INFINITY);
}

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

template <typename acc_t>
__device__ __forceinline__ acc_t warp_max(acc_t x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

// dot(a[0, n), b[0, n)) with a in shared memory (acc_t) or global memory, and b in global
// memory (T).
template <typename T, typename A>
__device__ __forceinline__ auto dot_row(const A* a, const T* b, int64_t n) {
  using acc_t = decltype(to_acc(b[0]));
  acc_t s0 = 0, s1 = 0;
  int64_t d = 0;
  for (; d + 1 < n; d += 2) {
    s0 += to_acc(a[d]) * to_acc(b[d]);
    s1 += to_acc(a[d + 1]) * to_acc(b[d + 1]);
  }
  if (d < n) s0 += to_acc(a[d]) * to_acc(b[d]);
  return s0 + s1;
}

// acc[c] += sum_{jj < n, bit jj of live} w_jj * rows[jj * row_stride + lane + 32 c] for the
// lane's columns below ncols, where w_jj is lane jj's `w` (a chunk of up to 32 rows, one
// weight per lane). The forward's o += p v and the backward's dq += ds k, dv += p dout,
// dk += ds q. Rows whose bit is clear (hidden pairs) are not read: 0 * inf would be NaN.
template <typename T, typename acc_t>
__device__ __forceinline__ void add_weighted_rows(acc_t (&acc)[kCols], acc_t w, const T* rows,
                                                  int64_t row_stride, int64_t n, int64_t ncols,
                                                  int lane, unsigned live = 0xffffffffu) {
  for (int jj = 0; jj < n; ++jj) {
    const acc_t wb = __shfl_sync(0xffffffffu, w, jj);
    if (!((live >> jj) & 1u)) continue;  // uniform across the warp
    const T* r = rows + jj * row_stride;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int64_t d = lane + 32 * c;
      if (d < ncols) acc[c] += wb * to_acc(r[d]);
    }
  }
}

// ---- score terms (common/attention_mask.h, common/dropout_rng.h) -----------------------------
// The score of a visible pair after softcap / ALiBi / rel_bias, in the kernels' base-2 units:
// s2 = scale * log2(e) * q.k in, ScoreTerms::add (the per-element rule) in natural units.
// th: tanh(s / softcap) when softcap (the backward's chain factor 1 - th^2).
template <typename acc_t>
__device__ __forceinline__ acc_t term_score(const ScoreTerms& t, acc_t s2, int64_t b, int64_t h,
                                            int64_t d, acc_t* th) {
  return t.add<acc_t>(s2 * static_cast<acc_t>(kLn2), b, h, d, th) * static_cast<acc_t>(kLog2e);
}

// Dropout of one call (ScoreTerms' probability, seed, offset and global row / key bases):
// the keep bit of (b, h, i, j) from ScoreTerms::dropout_row_key / dropout_col and
// common/dropout_rng.h, and the rescaling 1 / (1 - p) of the kept probabilities.
template <typename acc_t>
struct Dropout {
  const ScoreTerms& t;
  bool on;
  uint32_t thresh;
  acc_t inv_keep;

  __device__ __forceinline__ explicit Dropout(const ScoreTerms& terms)
      : t(terms),
        on(terms.has_dropout()),
        thresh(dropout::threshold(terms.dropout_p)),
        inv_keep(static_cast<acc_t>(1.0 / (1.0 - terms.dropout_p))) {}
  // b: batch index (sequence index when packed); h: query head; i, j: the call's (the
  // sequence's) query row and key
  __device__ __forceinline__ uint64_t row(int64_t b, int64_t h, int64_t i) const {
    return t.dropout_row_key(b, h, i);
  }
  __device__ __forceinline__ bool keep(uint64_t row_key, int64_t j) const {
    return dropout::keep(row_key, t.dropout_col(j), thresh);
  }
};

// The backward's per-pair quantities of a visible pair (i, j) (every kernel of the backward
// computes them the same way): P = exp(s - lse) of the final score s, dS of the final score
// (what d rel_bias sums) and dS of the scaled dot product (after the softcap chain factor:
// what dq and dk sum), and the probability that multiplies dout in dV (P * Z / (1 - p)).
//   s2: scale * log2(e) * q.k; dp: dout_i . v_j; lse2, di: the row's lse * log2(e) and delta.
template <typename acc_t>
struct PairGrad {
  acc_t pv, ds, ds_raw;
};

template <typename acc_t>
__device__ __forceinline__ PairGrad<acc_t> pair_grad(const ScoreTerms& t, const Dropout<acc_t>& dr,
                                                     acc_t s2, acc_t dp, acc_t lse2, acc_t di,
                                                     int64_t b, int64_t h, int64_t d,
                                                     uint64_t row_key, int64_t j) {
  acc_t th = 0;
  if (t.active()) s2 = term_score(t, s2, b, h, d, &th);
  const acc_t pr = exp2_acc(s2 - lse2);
  acc_t pv = pr;
  if (dr.on) {  // (z = Z / (1 - p); a dropped pair's 0 times a non-finite dp is NaN, as on
                // the CPU and in the fast backward)
    const acc_t z = dr.keep(row_key, j) ? dr.inv_keep : acc_t(0);
    pv = pr * z;
    dp = dp * z;
  }
  PairGrad<acc_t> g;
  g.pv = pv;
  g.ds = pr * (dp - di);
  g.ds_raw = t.softcap > 0.0 ? g.ds * (acc_t(1) - th * th) : g.ds;
  return g;
}

// ---- forward ------------------------------------------------------------------------------
// attend_keys: one warp folds keys [kbeg, kend) of query row i (local index) of sequence b,
// head h, into the unnormalised output o (lane owns columns lane + 32 c), the running max m
// (base-2 scaled scores) and sum l. q_s holds the row's q * scale * log2(e); k, v point at
// the sequence's first key row. Hidden keys (attention_mask.h) are skipped. With no visible
// key: m = -inf, l = 0, o = 0. Score terms on every visible score; dropout on the
// probabilities that multiply v (l sums the undropped ones, as the CPU kernel does).
template <typename T, typename acc_t>
__device__ __forceinline__ void attend_keys(const AttentionParams& p, const Visibility& vis,
                                            const SeqInfo& sq, int64_t b, int64_t h, int64_t i,
                                            const acc_t* q_s, const T* k, const T* v,
                                            int64_t kbeg, int64_t kend, int lane, acc_t& m,
                                            acc_t& l, acc_t (&o)[kCols]) {
  const ScoreTerms terms = p.score_terms();
  const Dropout<acc_t> dr(terms);
  const uint64_t rk = dr.on ? dr.row(b, h, i) : 0;
  m = neg_inf<acc_t>();
  l = 0;
#pragma unroll
  for (int c = 0; c < kCols; ++c) o[c] = 0;
  for (int64_t j0 = kbeg; j0 < kend; j0 += 32) {
    // pass 1: lane computes the score of key j0 + lane
    const int64_t j = j0 + lane;
    const bool live = j < kend && vis.visible(sq, b, i, j);
    acc_t s = neg_inf<acc_t>();
    if (live) {
      s = dot_row(q_s, k + j * p.k_row_stride, p.D);
      if (terms.active()) s = term_score<acc_t>(terms, s, b, h, i + sq.off - j, nullptr);
    }
    const unsigned live_bits = __ballot_sync(0xffffffffu, live);
    if (live_bits == 0u) continue;  // every key of the chunk is hidden (padding)
    // pass 2: online softmax over the 32 scores. m_new stays -inf while every live score so
    // far is -inf (a -inf rel_bias entry, an overflowed q.k): subtract 0 then, never
    // (-inf) - (-inf) (NaN), as the CPU's softmax and the fast forward do
    const acc_t m_new = fmax(m, warp_max(s));
    const acc_t mu = m_new == neg_inf<acc_t>() ? acc_t(0) : m_new;
    const acc_t corr = exp2_acc(m - mu);  // 0 on the first chunk (m = -inf)
    const acc_t pj = live ? exp2_acc(s - mu) : acc_t(0);
    l = l * corr + warp_sum(pj);
    m = m_new;
#pragma unroll
    for (int c = 0; c < kCols; ++c) o[c] *= corr;
    // pass 3: o += p_j * v_j over the live keys, lane owns columns lane + 32 c. With dropout a
    // dropped key's weight is 0 and its v row is still read, as the CPU kernels, the fast
    // kernel and reference.py multiply it: 0 * (inf or NaN) in v_j is NaN there too.
    const int64_t n = (kend - j0) < 32 ? (kend - j0) : 32;
    const acc_t wj = dr.on ? pj * (live && dr.keep(rk, j) ? dr.inv_keep : acc_t(0)) : pj;
    add_weighted_rows(o, wj, v + j0 * p.v_row_stride, p.v_row_stride, n, p.Dv, lane, live_bits);
  }
}

// Writes out = o / l and lse = ln(sum exp) of query row (b, h, i); l == 0: out 0, lse -inf.
// With sinks, exp(sinks[h]) joins the denominator (and lse): a row with no key has out 0 and
// lse = its sink logit.
template <typename T, typename acc_t>
__device__ __forceinline__ void write_row(const AttentionParams& p, const SeqInfo& sq, int64_t b,
                                          int64_t h, int64_t i, int lane, acc_t m, acc_t l,
                                          const acc_t (&o)[kCols]) {
  T* out = static_cast<T*>(p.out) + b * p.out_batch_stride + (sq.q0 + i) * p.out_row_stride +
           h * p.out_head_stride;
  const bool empty = l == 0;  // no key seen: out 0, lse -inf (a NaN sum stays NaN)
  acc_t inv = empty ? acc_t(0) : acc_t(1) / l;
  acc_t lse_row = empty ? neg_inf<acc_t>() : (m + log2_acc(l)) * static_cast<acc_t>(kLn2);
  const ScoreTerms terms = p.score_terms();
  if (terms.has_sinks()) {  // in double, as the CPU kernel (a row without keys: lse = sink)
    double lse_d;
    inv = static_cast<acc_t>(terms.sink_normalise<acc_t>(h, static_cast<double>(m),
                                                          static_cast<double>(l), !empty, &lse_d));
    lse_row = static_cast<acc_t>(lse_d);
  }
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int64_t d = lane + 32 * c;
    if (d < p.Dv) out[d] = from_acc<T>(o[c] * inv);
  }
  if (lane == 0) {
    acc_t* lse = static_cast<acc_t*>(p.lse);
    lse[b * p.lse_batch_stride + h * p.lse_head_stride + sq.q0 + i] = lse_row;
  }
}

// Stages query row (b, h, i) * scale * log2(e) into q_s; returns the row's k and v bases.
template <typename T, typename acc_t>
__device__ __forceinline__ void stage_query(const AttentionParams& p, const SeqInfo& sq, int64_t b,
                                            int64_t h, int64_t i, int lane, acc_t* q_s,
                                            const T*& k, const T*& v) {
  const int64_t hkv = h / (p.H / p.Hkv);
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + (sq.q0 + i) * p.q_row_stride +
               h * p.q_head_stride;
  k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hkv * p.k_head_stride +
      sq.k0 * p.k_row_stride;
  v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hkv * p.v_head_stride +
      sq.k0 * p.v_row_stride;
  const acc_t qscale = static_cast<acc_t>(p.scale * kLog2e);
  for (int64_t d = lane; d < p.D; d += 32) q_s[d] = to_acc(q[d]) * qscale;
  __syncwarp();
}

// One warp per query row (b, h, i); rows ordered (b, h, i) so that a block's 4 rows share k/v.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32, 4) simple_fwd_kernel(AttentionParams p) {
  using acc_t = typename AccOf<T>::type;
  __shared__ acc_t q_s[kWarps][kMaxHeadDim];  // this warp's q row * scale * log2(e)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= p.B * p.H * p.Sq) return;  // uniform per warp; only __syncwarp below
  const QueryRow qr = query_row(p, row);
  if (!qr.ok) return;  // past the end of its packed sequence
  const int64_t b = qr.b, h = qr.h, i = qr.i;
  const SeqInfo& sq = qr.sq;
  const Visibility vis = p.visibility();
  const T *k, *v;
  stage_query<T, acc_t>(p, sq, b, h, i, lane, q_s[warp], k, v);
  const Range keys = vis.band_keys(sq, i);
  acc_t m, l, o[kCols];
  attend_keys<T, acc_t>(p, vis, sq, b, h, i, q_s[warp], k, v, keys.lo, keys.hi, lane, m, l, o);
  write_row<T, acc_t>(p, sq, b, h, i, lane, m, l, o);
}

// ---- split-KV forward (decode: few query rows, many keys) -----------------------------------
// Pass 1 (simple_fwd_split_kernel): one warp per (query row, key chunk of `chunk` keys);
//   writes the chunk's unnormalised output to part_o (rows, n_split, Dv) and its (max, sum)
//   to part_ml (rows, n_split, 2), acc_t, rows in (b, h, i) order.
// Pass 2 (simple_fwd_combine_kernel): one warp per query row merges the n_split partials
//   (chunks that saw no key, max -inf and sum 0, are skipped; a NaN sum is merged, so a NaN
//   reaches the row as in the unsplit kernel) and writes out and lse.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32, 4)
    simple_fwd_split_kernel(AttentionParams p, int64_t chunk, int n_split, void* part_o_ptr,
                            void* part_ml_ptr) {
  using acc_t = typename AccOf<T>::type;
  __shared__ acc_t q_s[kWarps][kMaxHeadDim];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (item >= p.B * p.H * p.Sq * n_split) return;
  const int64_t row = item / n_split;
  const int64_t sp = item - row * n_split;
  const QueryRow qr = query_row(p, row);
  if (!qr.ok) return;
  const int64_t b = qr.b, h = qr.h, i = qr.i;
  const SeqInfo& sq = qr.sq;
  const Visibility vis = p.visibility();
  const T *k, *v;
  stage_query<T, acc_t>(p, sq, b, h, i, lane, q_s[warp], k, v);
  const Range keys = vis.band_keys(sq, i);
  int64_t kbeg = sp * chunk;
  int64_t kend = kbeg + chunk;
  if (kbeg < keys.lo) kbeg = keys.lo;
  if (kend > keys.hi) kend = keys.hi;
  acc_t m, l, o[kCols];
  attend_keys<T, acc_t>(p, vis, sq, b, h, i, q_s[warp], k, v, kbeg, kend, lane, m, l, o);
  acc_t* po = static_cast<acc_t*>(part_o_ptr) + item * p.Dv;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int64_t d = lane + 32 * c;
    if (d < p.Dv) po[d] = o[c];
  }
  if (lane == 0) {
    acc_t* pml = static_cast<acc_t*>(part_ml_ptr) + item * 2;
    pml[0] = m;
    pml[1] = l;
  }
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32, 4)
    simple_fwd_combine_kernel(AttentionParams p, int n_split, const void* part_o_ptr,
                              const void* part_ml_ptr) {
  using acc_t = typename AccOf<T>::type;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= p.B * p.H * p.Sq) return;
  const QueryRow qr = query_row(p, row);
  if (!qr.ok) return;
  const int64_t b = qr.b, h = qr.h, i = qr.i;
  const SeqInfo& sq = qr.sq;
  const acc_t* pml = static_cast<const acc_t*>(part_ml_ptr) + row * n_split * 2;
  const acc_t* po = static_cast<const acc_t*>(part_o_ptr) + row * n_split * p.Dv;
  acc_t mx = neg_inf<acc_t>();
  for (int sp = 0; sp < n_split; ++sp) mx = fmax(mx, pml[2 * sp]);
  const acc_t mu = merged_offset(mx);
  acc_t l = 0, o[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) o[c] = 0;
  for (int sp = 0; sp < n_split; ++sp) {
    const acc_t ms = pml[2 * sp], ls = pml[2 * sp + 1];
    // the CPU's rule (common/attention_mask.h chunk_adds_nothing): a chunk that saw no key of
    // the row adds nothing; one whose visible scores were all NaN (max -inf: fmax drops NaN;
    // NaN sum), or all -inf with 0 * inf = NaN in its output, reaches the row as in one pass
    // (its weight exp2(ms - mu) is 0 or NaN, and 0 * NaN is NaN either way; mu =
    // merged_offset(mx), so a row whose chunks all have max -inf keeps l 0 and lse -inf)
    // (the output's finiteness, a warp vote, only for a chunk it can decide: max -inf and sum
    // 0, the same for every lane)
    if (ms == neg_inf<acc_t>() && ls == acc_t(0)) {
      bool o_finite = true;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int64_t d = lane + 32 * c;
        if (d < p.Dv) o_finite = o_finite && isfinite(po[sp * p.Dv + d]);
      }
      if (chunk_adds_nothing(ms, ls, __all_sync(0xffffffffu, o_finite))) continue;
    }
    const acc_t w = exp2_acc(ms - mu);
    l += w * ls;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int64_t d = lane + 32 * c;
      if (d < p.Dv) o[c] += w * po[sp * p.Dv + d];
    }
  }
  write_row<T, acc_t>(p, sq, b, h, i, lane, mx, l, o);
}

// ---- backward ------------------------------------------------------------------------------
// Pass 1 (simple_bwd_dq_kernel): per query row, delta_i = sum_d dO_i,d * O_i,d (written to
//   `delta`, (B, H, Sq) acc_t) and dQ_i = scale * sum_j P_ij (dP_ij - delta_i) k_j,
//   with P_ij = exp(scale q_i.k_j - lse_i) and dP_ij = dO_i . v_j.
// Pass 2 (simple_bwd_dkdv_kernel): per key row (b, hkv, j), over every query head of its
//   group and every query i that sees j: dV_j += P_ij dO_i, dK_j += scale dS_ij q_i.
// With rel_bias (d rel_bias wanted):
// Pass 3 (simple_bwd_drel_diag_kernel): one warp per (b, h, diagonal d = i + off - j): the sum
//   of dS (of the final score) over the diagonal's visible pairs, into a (B, H, Sq + Sk - 1)
//   float64 workspace (diagonal t = d - drel_dmin(p); the params' Sq / Sk, max lengths when
//   packed).
// Pass 4 (simple_bwd_drel_reduce_kernel): one warp per (h, x) of the (H, 2M + 1) table: the
//   sum over b and over the diagonals that clamp to x (one for |x - M| < M, all d <= -M or
//   d >= M at the two ends) of pass 3's sums.
// Both in a fixed order without atomics: d rel_bias is bitwise reproducible, like dq, dk, dv.
// Pass 3 recomputes P and dP of every visible pair once more (a third of the backward's
// arithmetic added); the workspace is O(B H (Sq + Sk)), no (Sq, Sk) buffer.
// Pass 2 and 3 read pass 1's delta: launch them in this order on one stream.

template <typename T>
__global__ void __launch_bounds__(kWarps * 32, 4)
    simple_bwd_dq_kernel(AttentionBwdParams bp, void* delta_ptr) {
  using acc_t = typename AccOf<T>::type;
  const AttentionParams& p = bp.fwd;
  __shared__ acc_t q_s[kWarps][kMaxHeadDim];   // q_i * scale * log2(e)
  __shared__ acc_t do_s[kWarps][kMaxHeadDim];  // dO_i
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= p.B * p.H * p.Sq) return;
  const QueryRow qr = query_row(p, row);
  if (!qr.ok) return;  // past the end of its packed sequence
  const int64_t b = qr.b, h = qr.h, i = qr.i;
  const SeqInfo& sq = qr.sq;
  const int64_t hkv = h / (p.H / p.Hkv);
  const Visibility vis = p.visibility();
  const int64_t gi = sq.q0 + i;  // the row in the (packed) tensors

  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + gi * p.q_row_stride +
               h * p.q_head_stride;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hkv * p.k_head_stride +
               sq.k0 * p.k_row_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hkv * p.v_head_stride +
               sq.k0 * p.v_row_stride;
  const T* dout = static_cast<const T*>(bp.dout) + b * bp.dout_batch_stride +
                  gi * bp.dout_row_stride + h * bp.dout_head_stride;
  const T* o = static_cast<const T*>(bp.out) + b * bp.o_batch_stride + gi * bp.o_row_stride +
               h * bp.o_head_stride;
  const int64_t stat = b * p.lse_batch_stride + h * p.lse_head_stride + gi;  // lse / dlse
  const acc_t qscale = static_cast<acc_t>(p.scale * kLog2e);
  for (int64_t d = lane; d < p.D; d += 32) q_s[warp][d] = to_acc(q[d]) * qscale;
  acc_t di = 0;
  for (int64_t d = lane; d < p.Dv; d += 32) {
    const acc_t g = to_acc(dout[d]);
    do_s[warp][d] = g;
    di += g * to_acc(o[d]);
  }
  di = warp_sum(di);
  // lse's gradient folds into the row term: dS = P * (dP - (delta - dlse))
  if (bp.dlse != nullptr) di -= static_cast<const acc_t*>(bp.dlse)[stat];
  if (lane == 0) static_cast<acc_t*>(delta_ptr)[row] = di;  // row == (b*H + h)*Sq + i
  __syncwarp();
  const acc_t lse2 = lse_log2(static_cast<const acc_t*>(bp.lse)[stat]);

  const ScoreTerms terms = p.score_terms();
  const Dropout<acc_t> dr(terms);
  const uint64_t rk = dr.on ? dr.row(b, h, i) : 0;
  const bool plain = !terms.active() && !dr.on;
  const Range keys = vis.band_keys(sq, i);
  acc_t dq[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) dq[c] = 0;
  for (int64_t j0 = keys.lo; j0 < keys.hi; j0 += 32) {
    const int64_t j = j0 + lane;
    const bool live = j < keys.hi && vis.visible(sq, b, i, j);
    acc_t ds = 0;
    if (live) {
      const acc_t s2 = dot_row(q_s[warp], k + j * p.k_row_stride, p.D);
      const acc_t dp = dot_row(do_s[warp], v + j * p.v_row_stride, p.Dv);
      if (plain) {
        ds = exp2_acc(s2 - lse2) * (dp - di);
      } else {
        ds = pair_grad<acc_t>(terms, dr, s2, dp, lse2, di, b, h, i + sq.off - j, rk, j).ds_raw;
      }
    }
    const unsigned live_bits = __ballot_sync(0xffffffffu, live);
    const int64_t n = (keys.hi - j0) < 32 ? (keys.hi - j0) : 32;
    add_weighted_rows(dq, ds, k + j0 * p.k_row_stride, p.k_row_stride, n, p.D, lane, live_bits);
  }
  // dq (B, Sq, H, D) contiguous (packed: (Tq, H, D))
  T* dqr = static_cast<T*>(bp.dq) + b * bp.dq_batch_stride + (gi * p.H + h) * p.D;
  const acc_t scale = static_cast<acc_t>(p.scale);
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int64_t d = lane + 32 * c;
    if (d < p.D) dqr[d] = from_acc<T>(dq[c] * scale);
  }
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32, 4)
    simple_bwd_dkdv_kernel(AttentionBwdParams bp, const void* delta_ptr) {
  using acc_t = typename AccOf<T>::type;
  const AttentionParams& p = bp.fwd;
  __shared__ acc_t k_s[kWarps][kMaxHeadDim];  // k_j * scale * log2(e)
  __shared__ acc_t v_s[kWarps][kMaxHeadDim];  // v_j
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;  // (b, hkv, j)
  if (row >= p.B * p.Hkv * p.Sk) return;
  const int64_t j = row % p.Sk;
  const int64_t bg = row / p.Sk;
  const int64_t hkv = bg % p.Hkv, b = bg / p.Hkv;
  const int64_t group = p.H / p.Hkv;
  const Visibility vis = p.visibility();
  const SeqInfo sq = vis.seq(b);
  if (j >= sq.Sk) return;  // past the end of its packed sequence
  const int64_t gj = sq.k0 + j;  // the row in the (packed) tensors

  const T* kj = static_cast<const T*>(p.k) + b * p.k_batch_stride + gj * p.k_row_stride +
                hkv * p.k_head_stride;
  const T* vj = static_cast<const T*>(p.v) + b * p.v_batch_stride + gj * p.v_row_stride +
                hkv * p.v_head_stride;
  const acc_t kscale = static_cast<acc_t>(p.scale * kLog2e);
  for (int64_t d = lane; d < p.D; d += 32) k_s[warp][d] = to_acc(kj[d]) * kscale;
  for (int64_t d = lane; d < p.Dv; d += 32) v_s[warp][d] = to_acc(vj[d]);
  __syncwarp();

  // queries that see key j (none when the key is padding)
  Range rows = vis.band_rows(sq, j);
  if (!vis.key_valid(b, j)) rows.hi = rows.lo;
  const acc_t* lse_all = static_cast<const acc_t*>(bp.lse);
  const acc_t* delta_all = static_cast<const acc_t*>(delta_ptr);

  const ScoreTerms terms = p.score_terms();
  const Dropout<acc_t> dr(terms);
  const bool plain = !terms.active() && !dr.on;
  acc_t dk[kCols], dv[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) dk[c] = dv[c] = 0;
  for (int64_t hg = 0; hg < group; ++hg) {
    const int64_t h = hkv * group + hg;
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
                 sq.q0 * p.q_row_stride;
    const T* dout = static_cast<const T*>(bp.dout) + b * bp.dout_batch_stride +
                    h * bp.dout_head_stride + sq.q0 * bp.dout_row_stride;
    const int64_t stat = b * p.lse_batch_stride + h * p.lse_head_stride + sq.q0;  // lse base
    const int64_t dstat = (b * p.H + h) * p.Sq;  // delta (workspace) base
    for (int64_t i0 = rows.lo; i0 < rows.hi; i0 += 32) {
      const int64_t i = i0 + lane;
      const bool live = i < rows.hi;  // the band: row i sees key j
      acc_t pr = 0, ds = 0;  // pr: the weight of dout_i in dV_j (P, or P * Z / (1 - p))
      if (live) {
        const acc_t lse2 = lse_log2(lse_all[stat + i]);
        const acc_t s2 = dot_row(k_s[warp], q + i * p.q_row_stride, p.D);
        const acc_t dp = dot_row(v_s[warp], dout + i * bp.dout_row_stride, p.Dv);
        if (plain) {
          pr = exp2_acc(s2 - lse2);
          ds = pr * (dp - delta_all[dstat + i]);
        } else {
          const PairGrad<acc_t> g =
              pair_grad<acc_t>(terms, dr, s2, dp, lse2, delta_all[dstat + i], b, h,
                               i + sq.off - j, dr.on ? dr.row(b, h, i) : 0, j);
          pr = g.pv;
          ds = g.ds_raw;
        }
      }
      const int64_t n = (rows.hi - i0) < 32 ? (rows.hi - i0) : 32;
      add_weighted_rows(dv, pr, dout + i0 * bp.dout_row_stride, bp.dout_row_stride, n, p.Dv,
                        lane);
      add_weighted_rows(dk, ds, q + i0 * p.q_row_stride, p.q_row_stride, n, p.D, lane);
    }
  }
  // dk (B, Sk, Hkv, D), dv (B, Sk, Hkv, Dv) contiguous (packed: (Tk, Hkv, D / Dv))
  T* dkr = static_cast<T*>(bp.dk) + b * bp.dk_batch_stride + (gj * p.Hkv + hkv) * p.D;
  T* dvr = static_cast<T*>(bp.dv) + b * bp.dv_batch_stride + (gj * p.Hkv + hkv) * p.Dv;
  const acc_t scale = static_cast<acc_t>(p.scale);
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int64_t d = lane + 32 * c;
    if (d < p.D) dkr[d] = from_acc<T>(dk[c] * scale);
    if (d < p.Dv) dvr[d] = from_acc<T>(dv[c]);
  }
}

// The smallest distance d = i + off - j of any pair of a call: 1 - Sq, plus the block shift
// of q_start / k_start (Visibility::pos_shift(); packed calls have none and each sequence's
// distances lie in [1 - Sq, Sk - 1] of the max lengths). Diagonal t of the workspace is
// d = drel_dmin(p) + t, t in [0, Sq + Sk - 1).
__device__ __forceinline__ int64_t drel_dmin(const AttentionParams& p) {
  return 1 - p.Sq + p.visibility().pos_shift();
}

// Pass 3: one warp per (b, h, diagonal t), d = drel_dmin(p) + t with d = i + off - j; lane
// takes the diagonal's pairs i = i0 + lane. diag: (B, H, Sq + Sk - 1) double.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32, 4)
    simple_bwd_drel_diag_kernel(AttentionBwdParams bp, const void* delta_ptr, double* diag) {
  using acc_t = typename AccOf<T>::type;
  const AttentionParams& p = bp.fwd;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t ndiag = p.Sq + p.Sk - 1;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;  // (b, h, t)
  if (row >= p.B * p.H * ndiag) return;
  const int64_t t = row % ndiag;
  const int64_t bh = row / ndiag;
  const int64_t h = bh % p.H, b = bh / p.H;
  const int64_t hkv = h / (p.H / p.Hkv);
  const Visibility vis = p.visibility();
  const SeqInfo sq = vis.seq(b);
  const ScoreTerms terms = p.score_terms();
  const Dropout<acc_t> dr(terms);
  const int64_t d = drel_dmin(p) + t;
  // rows of the diagonal: i in [0, Sq), j = i + off - d in [0, Sk)
  int64_t ilo = d - sq.off, ihi = sq.Sk + d - sq.off;
  if (ilo < 0) ilo = 0;
  if (ihi > sq.Sq) ihi = sq.Sq;
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
               sq.q0 * p.q_row_stride;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hkv * p.k_head_stride +
               sq.k0 * p.k_row_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hkv * p.v_head_stride +
               sq.k0 * p.v_row_stride;
  const T* dout = static_cast<const T*>(bp.dout) + b * bp.dout_batch_stride +
                  h * bp.dout_head_stride + sq.q0 * bp.dout_row_stride;
  const acc_t* lse_all = static_cast<const acc_t*>(bp.lse) + b * p.lse_batch_stride +
                         h * p.lse_head_stride + sq.q0;
  const acc_t* delta = static_cast<const acc_t*>(delta_ptr) + (b * p.H + h) * p.Sq;
  const acc_t qscale = static_cast<acc_t>(p.scale * kLog2e);
  double sum = 0;
  for (int64_t i0 = ilo; i0 < ihi; i0 += 32) {
    const int64_t i = i0 + lane;
    const int64_t j = i + sq.off - d;
    if (i < ihi && vis.visible(sq, b, i, j)) {
      const acc_t s2 = dot_row(q + i * p.q_row_stride, k + j * p.k_row_stride, p.D) * qscale;
      const acc_t dp = dot_row(dout + i * bp.dout_row_stride, v + j * p.v_row_stride, p.Dv);
      const acc_t lse2 = lse_log2(lse_all[i]);
      sum += static_cast<double>(
          pair_grad<acc_t>(terms, dr, s2, dp, lse2, delta[i], b, h, d,
                           dr.on ? dr.row(b, h, i) : 0, j).ds);
    }
  }
  sum = warp_sum(sum);
  if (lane == 0) diag[row] = sum;
}

// Pass 4: one warp per (h, x) of d rel_bias (H, 2M + 1): x = M + clamp(d, -M, M) collects the
// diagonals t in [tlo, thi) of every b; lanes stride over (b, t), then a fixed shuffle tree.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32, 4)
    simple_bwd_drel_reduce_kernel(AttentionBwdParams bp, const double* diag) {
  using acc_t = typename AccOf<T>::type;
  const AttentionParams& p = bp.fwd;
  const ScoreTerms terms = p.score_terms();
  const int64_t M = terms.rel_max, nx = 2 * M + 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;  // (h, x)
  if (row >= p.H * nx) return;
  const int64_t h = row / nx, x = row % nx;
  const int64_t ndiag = p.Sq + p.Sk - 1;
  // diagonals d with M + clamp(d, -M, M) == x, as t = d - drel_dmin(p)
  int64_t tlo = x - M - drel_dmin(p), thi = tlo + 1;
  if (x == 0) tlo = 0;
  if (x == 2 * M) thi = ndiag;
  if (tlo < 0) tlo = 0;
  if (thi > ndiag) thi = ndiag;
  const int64_t n = thi > tlo ? thi - tlo : 0;
  double sum = 0;
  for (int64_t e = lane; e < p.B * n; e += 32) {
    const int64_t b = e / n, t = tlo + e % n;
    sum += diag[(b * p.H + h) * ndiag + t];
  }
  sum = warp_sum(sum);
  if (lane == 0) static_cast<acc_t*>(bp.drel_bias)[row] = static_cast<acc_t>(sum);
}

// ---- launchers (return the launch error; the caller checks it) -----------------------------

inline unsigned blocks_for(int64_t rows) {
  return static_cast<unsigned>((rows + kWarps - 1) / kWarps);
}

// common/row_lse.h on every row the forward left with lse NaN: one thread per row (b, h, i),
// rows ordered as simple_fwd_kernel's. A row whose lse is not NaN returns at once, so a call
// without non-finite input costs this launch and one read of lse; a NaN row forms its scores
// one by one (every dot product: no list of the non-finite keys here).
template <typename T>
__global__ void settle_lse_kernel(AttentionParams p) {
  using acc_t = typename AccOf<T>::type;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= p.B * p.H * p.Sq) return;
  const QueryRow r = query_row(p, row);
  if (!r.ok) return;
  acc_t* lse = static_cast<acc_t*>(p.lse) + r.b * p.lse_batch_stride + r.h * p.lse_head_stride + r.sq.q0 + r.i;
  if (!isnan(*lse)) return;
  *lse = nan_row_lse<acc_t>(p, r.sq, r.b, r.h, r.i, [&](int64_t j) {
    return row_key_dot<acc_t, T>(p, r.sq, r.b, r.h, r.i, j, [](T x) { return to_acc(x); });
  });
}

template <typename T>
cudaError_t launch_settle_lse(const AttentionParams& p, cudaStream_t stream) {
  const int64_t rows = p.B * p.H * p.Sq;
  if (rows == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  settle_lse_kernel<T><<<static_cast<unsigned>((rows + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_simple_fwd(const AttentionParams& p, cudaStream_t stream) {
  const int64_t rows = p.B * p.H * p.Sq;
  if (rows == 0) return cudaSuccess;
  simple_fwd_kernel<T><<<blocks_for(rows), kWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_simple_fwd_split(const AttentionParams& p, int64_t chunk, int n_split,
                                    void* part_o, void* part_ml, cudaStream_t stream) {
  const int64_t rows = p.B * p.H * p.Sq;
  if (rows == 0) return cudaSuccess;
  simple_fwd_split_kernel<T><<<blocks_for(rows * n_split), kWarps * 32, 0, stream>>>(
      p, chunk, n_split, part_o, part_ml);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  simple_fwd_combine_kernel<T><<<blocks_for(rows), kWarps * 32, 0, stream>>>(p, n_split, part_o,
                                                                              part_ml);
  return cudaGetLastError();
}

// delta: (B, H, Sq) acc_t workspace; drel_diag: (B, H, Sq + Sk - 1) double workspace when
// bp.drel_bias is set (rel_bias given), else unused.
template <typename T>
cudaError_t launch_simple_bwd(const AttentionBwdParams& bp, void* delta, void* drel_diag,
                              cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  const int64_t qrows = p.B * p.H * p.Sq;
  const int64_t krows = p.B * p.Hkv * p.Sk;
  if (qrows > 0) {
    simple_bwd_dq_kernel<T><<<blocks_for(qrows), kWarps * 32, 0, stream>>>(bp, delta);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (krows > 0) {
    simple_bwd_dkdv_kernel<T><<<blocks_for(krows), kWarps * 32, 0, stream>>>(bp, delta);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (bp.drel_bias != nullptr && p.terms.rel_bias != nullptr) {
    if (drel_diag == nullptr) return cudaErrorInvalidValue;
    auto* diag = static_cast<double*>(drel_diag);
    const int64_t drows = p.B * p.H * (p.Sq + p.Sk - 1);
    if (drows > 0) {
      simple_bwd_drel_diag_kernel<T><<<blocks_for(drows), kWarps * 32, 0, stream>>>(bp, delta,
                                                                                    diag);
      const cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return e;
    }
    const int64_t xrows = p.H * (2 * p.terms.rel_max + 1);
    simple_bwd_drel_reduce_kernel<T><<<blocks_for(xrows), kWarps * 32, 0, stream>>>(bp, diag);
  }
  return cudaGetLastError();
}

}  // namespace simple
}  // namespace cuda
}  // namespace attn_ext
