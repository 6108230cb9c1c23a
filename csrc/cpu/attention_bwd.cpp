// attn_ext::attention_backward on CPU (FlashAttention-2 style: probabilities are recomputed
// from the saved lse; no (Sq, Sk) buffer).
//
//   P = exp(scale * q k^T - lse)  (masked entries 0),  Di = rowsum(dout * out)
//   dv = P^T dout,  dP = dout v^T,  dS = P * (dP - Di),  dq = scale * dS k,  dk = scale * dS^T q
//
// Masks (causal, window, key padding, packed sequences) come from common/attention_mask.h:
// each (key tile, query tile) is classified invisible (skipped) / full / partial (masked,
// hidden pairs' P and dS exactly 0, and products over visible pairs only when an operand is
// non-finite). dlse (the lse gradient) enters through Di: dS = P * (dP - (Di - dlse)).
//
// Parallel over (batch, kv head, key tile): one task owns kBlockK keys of one kv head and
// accumulates their dk and dv over every query head of the GQA group and every query tile
// that sees them, so dk/dv need no atomics. For one (key tile, query head, query tile):
//
//   pass 1: st (nk, C) = kb qt               scores, transposed; diagonal mask
//   pass 2: st = exp(st - lse)               probabilities P^T
//   pass 3: dvt (nk, Dvp) += st dor          dor (nq, Dvp) = dout rows
//   pass 4: dpt (nk, C) = vb dot             dot (Dv, C) = dout^T
//   pass 5: dpt = st * (dpt - Di)            dS^T
//   pass 6: dkt (nk, Dp) += dpt qr           qr (nq, Dp) = q rows
//   pass 7: dq_w (nq, Dp) += dpt^T kb        into the worker's own dq buffer
//
// The query-side operands (q, q^T, dout, dout^T, lse, Di) are packed once per query block
// by a parallel pre-pass (pass 0), costing (B * H * Sq) * (2 D + 2 Dv + 2) floats of workspace.
// dq: every worker accumulates into its own fp32 (B, H, Sq, Dp) buffer; a final pass sums the
// buffers in worker order. Tasks are assigned to workers by a fixed greedy plan (not
// dynamically), so the result is bitwise identical from run to run for a given thread count.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <vector>

#include "common/attention_checks.h"
#include "common/attention_mask_checks.h"
#include "cpu/attention_common.h"

namespace attn_ext {
namespace cpu_attn {
namespace {

template <typename acc_t>
struct BwdScratch {
  int64_t Dp, Dvp;
  AlignedVec<acc_t> kb;    // (kBlockK, Dp): k rows of the task
  AlignedVec<acc_t> vb;    // (kBlockK, Dvp): v rows of the task
  AlignedVec<acc_t> dkt;   // (kBlockK, Dp): dk accumulator (unscaled)
  AlignedVec<acc_t> dvt;   // (kBlockK, Dvp): dv accumulator
  AlignedVec<acc_t> st;    // (kBlockK, kBlockQ): scores, then P^T
  AlignedVec<acc_t> dpt;   // (kBlockK, kBlockQ): dP^T, then dS^T
  std::vector<uint8_t> kvalid;  // (kBlockK): key padding of the task's keys (1 = takes part)

  BwdScratch(int64_t D, int64_t Dv)
      : Dp(round_up(D, 8)),
        Dvp(round_up(Dv, 8)),
        kb(static_cast<size_t>(kBlockK * Dp), acc_t(0)),
        vb(static_cast<size_t>(kBlockK * Dvp), acc_t(0)),
        dkt(static_cast<size_t>(kBlockK * Dp)),
        dvt(static_cast<size_t>(kBlockK * Dvp)),
        st(static_cast<size_t>(kBlockK * kBlockQ)),
        dpt(static_cast<size_t>(kBlockK * kBlockQ)),
        kvalid(kBlockK, 1) {}
};

// Query-side operands of one (batch, head, query block of kBlockQ rows), packed once by a
// parallel pre-pass and then read by every key tile task (instead of being re-packed per
// key tile). One block, offsets in elements; padding rows/columns are zero:
//   qt   (D, kBlockQ)    scale * q^T (scores in natural-log units, like lse)
//   qr   (kBlockQ, Dp)   q rows
//   dot  (Dv, kBlockQ)   dout^T
//   dor  (kBlockQ, Dvp)  dout rows
//   lse  (kBlockQ)       lse; +inf for padding rows and rows that see no key (P = 0)
//   di   (kBlockQ)       rowsum(dout * out) - dlse
//   fin  (1)             1 when the block's q and dout are all finite
struct QueryPackLayout {
  int64_t n_qb, qt, qr, dot, dor, lse, di, fin, size;
  QueryPackLayout(int64_t Sq, int64_t D, int64_t Dv, int64_t Dp, int64_t Dvp)
      : n_qb(ceil_div(Sq, kBlockQ)),
        qt(0),
        qr(qt + D * kBlockQ),
        dot(qr + kBlockQ * Dp),
        dor(dot + Dv * kBlockQ),
        lse(dor + kBlockQ * Dvp),
        di(lse + kBlockQ),
        fin(di + kBlockQ),
        size(fin + 8) {}
};

template <typename scalar_t, typename acc_t>
void pack_query_blocks(const AttentionBwdParams& bp, const QueryPackLayout& L, acc_t* packs) {
  const AttentionParams& p = bp.fwd;
  const int64_t D = p.D, Dv = p.Dv, Dp = round_up(D, 8), Dvp = round_up(Dv, 8);
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* dout = static_cast<const scalar_t*>(bp.dout);
  const auto* o = static_cast<const scalar_t*>(bp.out);
  const auto* lse = static_cast<const acc_t*>(bp.lse);
  const auto* dlse = static_cast<const acc_t*>(bp.dlse);  // may be nullptr (zero)
  const Visibility vis = p.visibility();
  const acc_t qscale = static_cast<acc_t>(p.scale);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const acc_t pos_inf = std::numeric_limits<acc_t>::infinity();
  at::parallel_for(0, p.B * p.H * L.n_qb, 1, [&](int64_t begin, int64_t end) {
    AlignedVec<acc_t> tmp(static_cast<size_t>(std::max<int64_t>(std::max(D, Dv), 1)));
    for (int64_t idx = begin; idx < end; ++idx) {  // idx = (b * H + h) * n_qb + qb
      const int64_t qb = idx % L.n_qb;
      const int64_t h = (idx / L.n_qb) % p.H;
      const int64_t b = idx / (L.n_qb * p.H);
      const SeqInfo sq = vis.seq(b);
      const int64_t i0 = qb * kBlockQ;
      const int64_t nq = std::max<int64_t>(0, std::min(kBlockQ, sq.Sq - i0));
      acc_t* blk = packs + idx * L.size;
      acc_t *qt = blk + L.qt, *qr = blk + L.qr, *dot = blk + L.dot, *dor = blk + L.dor;
      const int64_t r0 = sq.q0 + i0;  // first (packed) row of the block
      const scalar_t* qh = q + b * p.q_batch_stride + h * p.q_head_stride + r0 * p.q_row_stride;
      const scalar_t* dh = dout + b * bp.dout_batch_stride + h * bp.dout_head_stride + r0 * bp.dout_row_stride;
      const scalar_t* oh = o + b * bp.o_batch_stride + h * bp.o_head_stride + r0 * bp.o_row_stride;
      const int64_t stat = b * p.lse_batch_stride + h * p.lse_head_stride + r0;  // lse / dlse of row i0
      for (int64_t ii = 0; ii < nq; ++ii) {
        acc_t* qrow = qr + ii * Dp;
        convert_row(qh + ii * p.q_row_stride, D, qrow);
        for (int64_t d = 0; d < D; ++d) qt[d * kBlockQ + ii] = qrow[d] * qscale;
        acc_t* drow = dor + ii * Dvp;
        convert_row(dh + ii * bp.dout_row_stride, Dv, drow);
        for (int64_t d = 0; d < Dv; ++d) dot[d * kBlockQ + ii] = drow[d];
        convert_row(oh + ii * bp.o_row_stride, Dv, tmp.data());
        acc_t di = 0;
        for (int64_t d = 0; d < Dv; ++d) di += drow[d] * tmp[d];
        // lse's gradient folds into the row term: dS = P * (dP - (Di - dlse_i))
        blk[L.di + ii] = dlse != nullptr ? di - dlse[stat + ii] : di;
        const acc_t l = lse[stat + ii];
        blk[L.lse + ii] = l == neg_inf ? pos_inf : l;
      }
      for (int64_t c = nq; c < kBlockQ; ++c) {
        blk[L.di + c] = 0;
        blk[L.lse + c] = pos_inf;
      }
      // Whether the block's q and dout rows are all finite (then a hidden pair's 0 times them
      // is 0, and the partial tiles may use the dense products).
      blk[L.fin] = all_finite(qr, nq, D, Dp) && all_finite(dor, nq, Dv, Dvp) ? acc_t(1) : acc_t(0);
    }
  });
}

template <typename scalar_t, typename acc_t>
void bwd_task(const AttentionBwdParams& bp, const Visibility& vis, int64_t b, int64_t hkv,
              int64_t j0, const QueryPackLayout& L, const acc_t* packs,
              const mk::Kernels<acc_t>& K, BwdScratch<acc_t>& s, acc_t* dq_w) {
  const AttentionParams& p = bp.fwd;
  const int64_t D = p.D, Dv = p.Dv, Dp = s.Dp, Dvp = s.Dvp;
  const SeqInfo sq = vis.seq(b);
  const int64_t nk = std::min(kBlockK, sq.Sk - j0);
  if (nk <= 0) return;  // past the end of its packed sequence
  const int64_t group = p.H / p.Hkv;
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();

  load_rows(k + b * p.k_batch_stride + hkv * p.k_head_stride + (sq.k0 + j0) * p.k_row_stride,
            p.k_row_stride, nk, D, s.kb.data(), Dp);
  load_rows(v + b * p.v_batch_stride + hkv * p.v_head_stride + (sq.k0 + j0) * p.v_row_stride,
            p.v_row_stride, nk, Dv, s.vb.data(), Dvp);
  std::fill(s.dkt.begin(), s.dkt.end(), acc_t(0));
  std::fill(s.dvt.begin(), s.dvt.end(), acc_t(0));
  int64_t n_valid = nk;
  if (vis.has_padding()) {
    n_valid = 0;
    for (int64_t r = 0; r < nk; ++r) n_valid += (s.kvalid[r] = vis.key_valid(b, j0 + r));
  }
  const bool k_finite = all_finite(s.kb.data(), nk, D, Dp);

  // Query blocks holding the rows that see some key of the tile (the band's union).
  const Range rows = vis.band_rows_of_keys(sq, j0, j0 + nk);
  const int64_t qb_first = rows.lo / kBlockQ;
  const int64_t qb_end = n_valid == 0 ? qb_first : ceil_div(rows.hi, kBlockQ);
  for (int64_t h = hkv * group; h < (hkv + 1) * group; ++h) {
    for (int64_t qb = qb_first; qb < qb_end; ++qb) {
      const int64_t i0 = qb * kBlockQ;
      const int64_t nq = std::min(kBlockQ, sq.Sq - i0);
      TileKind kind = vis.classify(sq, i0, i0 + nq, j0, j0 + nk);
      if (kind == TileKind::kInvisible) continue;
      if (n_valid < nk) kind = TileKind::kPartial;
      const int64_t C = round_up(nq, 8);
      const acc_t* blk = packs + ((b * p.H + h) * L.n_qb + qb) * L.size;
      const acc_t *qt = blk + L.qt, *qr = blk + L.qr, *dot = blk + L.dot, *dor = blk + L.dor;
      acc_t* dqh = dq_w + ((b * p.H + h) * p.Sq + i0) * Dp;
      if (kind == TileKind::kFull) {
        // Every (key, query) pair of the tile is visible.
        // pass 1: st (nk, C) = kb qt
        K.gemm(nk, C, D, s.kb.data(), Dp, 1, qt, kBlockQ, s.st.data(), C, false);
        // pass 2: P^T
        K.exp_sub(s.st.data(), nk, C, blk + L.lse);
        // pass 3: dvt += P^T dout
        K.gemm(nk, Dvp, nq, s.st.data(), C, 1, dor, Dvp, s.dvt.data(), Dvp, true);
        // pass 4: dP^T = v dout^T
        K.gemm(nk, C, Dv, s.vb.data(), Dvp, 1, dot, kBlockQ, s.dpt.data(), C, false);
        // pass 5: dS^T = P^T * (dP^T - Di)
        K.ds(s.st.data(), s.dpt.data(), nk, C, blk + L.di);
        // pass 6: dkt += dS^T q
        K.gemm(nk, Dp, nq, s.dpt.data(), C, 1, qr, Dp, s.dkt.data(), Dp, true);
        // pass 7: dq_w rows += dS k
        K.gemm(nq, Dp, nk, s.dpt.data(), 1, C, s.kb.data(), Dp, dqh, Dp, true);
        continue;
      }
      // Partial tile: key j0 + r is seen by the columns [cols(r).lo, cols(r).hi) (band) if it
      // is not padded. The hidden parts are skipped in 6-key / 6-query steps (pass 1, 3, 4,
      // 6, 7); what pass 1 / 4 leave uncomputed is masked (-inf / 0) before the element-wise
      // passes, and dS is 0 at every hidden pair.
      auto cols = [&](int64_t r) {
        if (vis.has_padding() && !s.kvalid[r]) return Range{0, 0};
        const Range rr = vis.band_rows(sq, j0 + r);
        return Range{std::clamp<int64_t>(rr.lo - i0, 0, nq), std::clamp<int64_t>(rr.hi - i0, 0, nq)};
      };
      // the columns some of keys [r0, r0 + rows) are seen by (band only: a superset)
      auto panel = [&](int64_t r0, int64_t rows) {
        const Range rr = vis.band_rows_of_keys(sq, j0 + r0, j0 + r0 + rows);
        return Range{std::clamp<int64_t>(rr.lo - i0, 0, nq), std::clamp<int64_t>(rr.hi - i0, 0, nq)};
      };
      auto mask = [&](acc_t* t, acc_t hidden) {
        for (int64_t r = 0; r < nk; ++r) {
          const Range c = cols(r);
          std::fill(t + r * C, t + r * C + c.lo, hidden);
          std::fill(t + r * C + c.hi, t + (r + 1) * C, hidden);
        }
      };
      // pass 1: st = kb qt on the visible column panels, then mask
      for (int64_t r0 = 0; r0 < nk; r0 += 6) {
        const int64_t nr = std::min<int64_t>(6, nk - r0);
        const Range pc = panel(r0, nr);
        const int64_t c8 = pc.lo / 8 * 8, ce = std::min(C, round_up(pc.hi, 8));
        if (c8 < ce) {
          K.gemm(nr, ce - c8, D, s.kb.data() + r0 * Dp, Dp, 1, qt + c8, kBlockQ,
                 s.st.data() + r0 * C + c8, C, false);
        }
      }
      mask(s.st.data(), neg_inf);
      // pass 2: P^T (0 where hidden)
      K.exp_sub(s.st.data(), nk, C, blk + L.lse);
      // pass 4: dP^T = v dout^T on the visible column panels, then 0 where hidden
      for (int64_t r0 = 0; r0 < nk; r0 += 6) {
        const int64_t nr = std::min<int64_t>(6, nk - r0);
        const Range pc = panel(r0, nr);
        const int64_t c8 = pc.lo / 8 * 8, ce = std::min(C, round_up(pc.hi, 8));
        if (c8 < ce) {
          K.gemm(nr, ce - c8, Dv, s.vb.data() + r0 * Dvp, Dvp, 1, dot + c8, kBlockQ,
                 s.dpt.data() + r0 * C + c8, C, false);
        }
      }
      mask(s.dpt.data(), acc_t(0));
      // pass 5: dS^T = P^T * (dP^T - Di), then exactly 0 where hidden (Di may be non-finite)
      K.ds(s.st.data(), s.dpt.data(), nk, C, blk + L.di);
      mask(s.dpt.data(), acc_t(0));
      if (!(k_finite && blk[L.fin] != acc_t(0))) {
        // A non-finite k, q or dout: 0 (hidden pair) times it must not reach dk, dv or dq of
        // the other side, so the products of pass 3, 6, 7 run over visible pairs only.
        for (int64_t r = 0; r < nk; ++r) {
          const Range c = cols(r);
          for (int64_t cc = c.lo; cc < c.hi; ++cc) {
            const acc_t pr = s.st[r * C + cc], ds = s.dpt[r * C + cc];
            for (int64_t d = 0; d < Dv; ++d) s.dvt[r * Dvp + d] += pr * dor[cc * Dvp + d];
            for (int64_t d = 0; d < D; ++d) s.dkt[r * Dp + d] += ds * qr[cc * Dp + d];
            for (int64_t d = 0; d < D; ++d) dqh[cc * Dp + d] += ds * s.kb[r * Dp + d];
          }
        }
        continue;
      }
      // pass 3: dvt += P^T dout over the queries that see each 6 keys
      for (int64_t r0 = 0; r0 < nk; r0 += 6) {
        const int64_t nr = std::min<int64_t>(6, nk - r0);
        const Range pc = panel(r0, nr);
        if (pc.lo < pc.hi) {
          K.gemm(nr, Dvp, pc.hi - pc.lo, s.st.data() + r0 * C + pc.lo, C, 1, dor + pc.lo * Dvp,
                 Dvp, s.dvt.data() + r0 * Dvp, Dvp, true);
        }
      }
      // pass 6: dkt += dS^T q over the queries that see each 6 keys
      for (int64_t r0 = 0; r0 < nk; r0 += 6) {
        const int64_t nr = std::min<int64_t>(6, nk - r0);
        const Range pc = panel(r0, nr);
        if (pc.lo < pc.hi) {
          K.gemm(nr, Dp, pc.hi - pc.lo, s.dpt.data() + r0 * C + pc.lo, C, 1, qr + pc.lo * Dp, Dp,
                 s.dkt.data() + r0 * Dp, Dp, true);
        }
      }
      // pass 7: dq_w rows += dS k over the keys each 6 queries see
      for (int64_t c0 = 0; c0 < nq; c0 += 6) {
        const int64_t mrows = std::min<int64_t>(6, nq - c0);
        const Range keys = vis.band_keys_of_rows(sq, i0 + c0, i0 + c0 + mrows);
        const int64_t klo = std::clamp<int64_t>(keys.lo - j0, 0, nk);
        const int64_t khi = std::clamp<int64_t>(keys.hi - j0, 0, nk);
        if (khi > klo) {
          K.gemm(mrows, Dp, khi - klo, s.dpt.data() + klo * C + c0, 1, C, s.kb.data() + klo * Dp,
                 Dp, dqh + c0 * Dp, Dp, true);
        }
      }
    }
  }

  // dk = scale * dkt, dv = dvt (contiguous (B, Sk, Hkv, D / Dv); packed: (Tk, Hkv, D / Dv)).
  auto* dk = static_cast<scalar_t*>(bp.dk);
  auto* dv = static_cast<scalar_t*>(bp.dv);
  const acc_t scale = static_cast<acc_t>(p.scale);
  for (int64_t r = 0; r < nk; ++r) {
    const int64_t j = sq.k0 + j0 + r;
    scalar_t* dkr = dk + b * bp.dk_batch_stride + (j * p.Hkv + hkv) * D;
    scalar_t* dvr = dv + b * bp.dv_batch_stride + (j * p.Hkv + hkv) * Dv;
    for (int64_t d = 0; d < D; ++d) dkr[d] = static_cast<scalar_t>(s.dkt[r * Dp + d] * scale);
    for (int64_t d = 0; d < Dv; ++d) dvr[d] = static_cast<scalar_t>(s.dvt[r * Dvp + d]);
  }
}

template <typename scalar_t>
void attention_bwd_kernel(const AttentionBwdParams& bp) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const AttentionParams& p = bp.fwd;
  const mk::Kernels<acc_t> kern = mk::kernels<acc_t>();
  const int64_t Dp = round_up(p.D, 8);
  const int64_t n_kb = ceil_div(p.Sk, kBlockK);
  const int64_t n_tasks = p.B * p.Hkv * n_kb;
  const Visibility vis = p.visibility();

  // Fixed greedy plan: tasks by decreasing cost (query rows that see the key tile), each to
  // the least loaded worker (ties: lowest index). Depends only on shapes and thread count.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_tasks));
  std::vector<std::vector<int64_t>> plan(static_cast<size_t>(workers));
  {
    std::vector<int64_t> order(static_cast<size_t>(n_tasks));
    auto cost = [&](int64_t t) {  // rows that see the key tile by the band
      const int64_t j0 = (t % n_kb) * kBlockK;
      const SeqInfo sq = vis.seq(t / (n_kb * p.Hkv));
      if (j0 >= sq.Sk) return int64_t(0);
      const Range r = vis.band_rows_of_keys(sq, j0, std::min(sq.Sk, j0 + kBlockK));
      return r.hi - r.lo;
    };
    for (int64_t t = 0; t < n_tasks; ++t) order[t] = t;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
    std::vector<int64_t> load(static_cast<size_t>(workers), 0);
    for (int64_t t : order) {
      const auto w = std::min_element(load.begin(), load.end()) - load.begin();
      plan[w].push_back(t);
      load[w] += cost(t) + 1;
    }
  }

  // pass 0: pack the query-side operands once.
  const QueryPackLayout L(p.Sq, p.D, p.Dv, Dp, round_up(p.Dv, 8));
  AlignedVec<acc_t> packs(static_cast<size_t>(p.B * p.H * L.n_qb * L.size), acc_t(0));
  pack_query_blocks<scalar_t, acc_t>(bp, L, packs.data());

  // dq_w: (workers, B, H, Sq, Dp) partial sums, one slice per worker.
  const int64_t dq_size = p.B * p.H * p.Sq * Dp;
  AlignedVec<acc_t> dq_parts(static_cast<size_t>(workers * dq_size), acc_t(0));
  at::parallel_for(0, workers, 1, [&](int64_t wbeg, int64_t wend) {
    BwdScratch<acc_t> s(p.D, p.Dv);
    for (int64_t w = wbeg; w < wend; ++w) {
      for (int64_t t : plan[w]) {
        const int64_t kb = t % n_kb;
        const int64_t hkv = (t / n_kb) % p.Hkv;
        const int64_t b = t / (n_kb * p.Hkv);
        bwd_task<scalar_t, acc_t>(bp, vis, b, hkv, kb * kBlockK, L, packs.data(), kern, s,
                                  dq_parts.data() + w * dq_size);
      }
    }
  });

  // dq (B, Sq, H, D) = scale * sum over workers (fixed order) of dq_w (B, H, Sq, Dp).
  // (Packed: dq (Tq, H, D); rows past a sequence's end are no rows.)
  auto* dq = static_cast<scalar_t*>(bp.dq);
  const acc_t scale = static_cast<acc_t>(p.scale);
  at::parallel_for(0, p.B * p.H * p.Sq, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {  // row = (b * H + h) * Sq + i
      const int64_t i = row % p.Sq;
      const int64_t h = (row / p.Sq) % p.H;
      const int64_t b = row / (p.Sq * p.H);
      const SeqInfo sq = vis.seq(b);
      if (i >= sq.Sq) continue;
      scalar_t* dst = dq + b * bp.dq_batch_stride + ((sq.q0 + i) * p.H + h) * p.D;
      for (int64_t d = 0; d < p.D; ++d) {
        acc_t sum = 0;
        for (int64_t w = 0; w < workers; ++w) sum += dq_parts[w * dq_size + row * Dp + d];
        dst[d] = static_cast<scalar_t>(sum * scale);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse_in, bool causal, std::optional<double> scale,
    int64_t window_left, int64_t window_right, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& dlse_in) {
  const AttentionShape s = check_attention_inputs(q, k, v, scale);
  check_attention_bwd_inputs(dout, out, lse_in, q, s);
  if (dlse_in.has_value()) check_dlse(*dlse_in, lse_in);
  at::Tensor dq = at::empty({s.B, s.Sq, s.H, s.D}, q.options());
  at::Tensor dk = at::empty({s.B, s.Sk, s.Hkv, s.D}, q.options());
  at::Tensor dv = at::empty({s.B, s.Sk, s.Hkv, s.Dv}, q.options());
  if (dq.numel() == 0 && dk.numel() == 0 && dv.numel() == 0) return {dq, dk, dv};
  if (s.Sq == 0 || s.H == 0) {  // no query: no gradient reaches k or v
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }
  const at::Tensor lse = lse_in.contiguous();
  AttentionBwdParams bp =
      make_attention_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, s, causal, scale);
  fill_mask_params(bp.fwd, s, q, causal, window_left, window_right, key_padding_mask);
  const at::Tensor dlse = dlse_in.has_value() ? dlse_in->contiguous() : at::Tensor();
  if (dlse.defined()) bp.dlse = dlse.data_ptr();
  if (s.Sk == 0) {  // no key: every row is empty, dq = 0
    dq.zero_();
    return {dq, dk, dv};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attention_backward",
                                  [&] { attention_bwd_kernel<scalar_t>(bp); });
  return {dq, dk, dv};
}

// Packed sequences (attention_varlen_forward's backward): dq (Tq, H, D), dk (Tk, Hkv, D),
// dv (Tk, Hkv, Dv).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse_in, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    std::optional<double> scale, int64_t window_left, int64_t window_right,
    const std::optional<at::Tensor>& dlse_in) {
  const AttentionShape s = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, scale);
  const int64_t Tq = q.size(0), Tk = k.size(0);
  check_dim(dout, "dout", 3, "(Tq, H, Dv)");
  check_dim(out, "out", 3, "(Tq, H, Dv)");
  check_dim(lse_in, "lse", 2, "(H, Tq)");
  const AttentionShape s1{1, Tq, Tk, s.H, s.Hkv, s.D, s.Dv};
  check_attention_bwd_inputs(dout.unsqueeze(0), out.unsqueeze(0), lse_in.unsqueeze(0), q, s1);
  if (dlse_in.has_value()) check_dlse(*dlse_in, lse_in);
  at::Tensor dq = at::empty({Tq, s.H, s.D}, q.options());
  at::Tensor dk = at::zeros({Tk, s.Hkv, s.D}, q.options());
  at::Tensor dv = at::zeros({Tk, s.Hkv, s.Dv}, q.options());
  if (Tq == 0 || s.H == 0 || Tk == 0 || s.B == 0) {
    dq.zero_();
    return {dq, dk, dv};
  }
  const at::Tensor lse = lse_in.contiguous();
  AttentionBwdParams bp = make_attention_bwd_params(
      dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0),
      lse, dq, dk, dv, s, causal, scale);
  make_params_packed(bp.fwd, s, Tq, cu_seqlens_q, cu_seqlens_k, causal, window_left, window_right);
  bp.dout_batch_stride = bp.o_batch_stride = 0;
  bp.dq_batch_stride = bp.dk_batch_stride = bp.dv_batch_stride = 0;
  const at::Tensor dlse = dlse_in.has_value() ? dlse_in->contiguous() : at::Tensor();
  if (dlse.defined()) bp.dlse = dlse.data_ptr();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(),
                                  "attention_varlen_backward",
                                  [&] { attention_bwd_kernel<scalar_t>(bp); });
  return {dq, dk, dv};
}

}  // namespace
}  // namespace cpu_attn

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("attention_backward", &cpu_attn::attention_backward_cpu);
  m.impl("attention_varlen_backward", &cpu_attn::attention_varlen_backward_cpu);
}

}  // namespace attn_ext
