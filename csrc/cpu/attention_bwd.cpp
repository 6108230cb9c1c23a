// attn_ext::attention_backward on CPU (FlashAttention-2 style: probabilities are recomputed
// from the saved lse; no (Sq, Sk) buffer).
//
//   P = exp(scale * q k^T - lse)  (masked entries 0),  Di = rowsum(dout * out)
//   dv = P^T dout,  dP = dout v^T,  dS = P * (dP - Di),  dq = scale * dS k,  dk = scale * dS^T q
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

#include <vector>

#include "common/attention_checks.h"
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

  BwdScratch(int64_t D, int64_t Dv)
      : Dp(round_up(D, 8)),
        Dvp(round_up(Dv, 8)),
        kb(static_cast<size_t>(kBlockK * Dp), acc_t(0)),
        vb(static_cast<size_t>(kBlockK * Dvp), acc_t(0)),
        dkt(static_cast<size_t>(kBlockK * Dp)),
        dvt(static_cast<size_t>(kBlockK * Dvp)),
        st(static_cast<size_t>(kBlockK * kBlockQ)),
        dpt(static_cast<size_t>(kBlockK * kBlockQ)) {}
};

// Query-side operands of one (batch, head, query block of kBlockQ rows), packed once by a
// parallel pre-pass and then read by every key tile task (instead of being re-packed per
// key tile). One block, offsets in elements; padding rows/columns are zero:
//   qt   (D, kBlockQ)    scale * q^T (scores in natural-log units, like lse)
//   qr   (kBlockQ, Dp)   q rows
//   dot  (Dv, kBlockQ)   dout^T
//   dor  (kBlockQ, Dvp)  dout rows
//   lse  (kBlockQ)       lse; +inf for padding rows and rows that see no key (P = 0)
//   di   (kBlockQ)       rowsum(dout * out)
struct QueryPackLayout {
  int64_t n_qb, qt, qr, dot, dor, lse, di, size;
  QueryPackLayout(int64_t Sq, int64_t D, int64_t Dv, int64_t Dp, int64_t Dvp)
      : n_qb(ceil_div(Sq, kBlockQ)),
        qt(0),
        qr(qt + D * kBlockQ),
        dot(qr + kBlockQ * Dp),
        dor(dot + Dv * kBlockQ),
        lse(dor + kBlockQ * Dvp),
        di(lse + kBlockQ),
        size(di + kBlockQ) {}
};

template <typename scalar_t, typename acc_t>
void pack_query_blocks(const AttentionBwdParams& bp, const QueryPackLayout& L, acc_t* packs) {
  const AttentionParams& p = bp.fwd;
  const int64_t D = p.D, Dv = p.Dv, Dp = round_up(D, 8), Dvp = round_up(Dv, 8);
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* dout = static_cast<const scalar_t*>(bp.dout);
  const auto* o = static_cast<const scalar_t*>(bp.out);
  const auto* lse = static_cast<const acc_t*>(bp.lse);
  const acc_t qscale = static_cast<acc_t>(p.scale);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const acc_t pos_inf = std::numeric_limits<acc_t>::infinity();
  torch::stable::parallel_for(0, p.B * p.H * L.n_qb, 1, [&](int64_t begin, int64_t end) {
    AlignedVec<acc_t> tmp(static_cast<size_t>(std::max<int64_t>(std::max(D, Dv), 1)));
    for (int64_t idx = begin; idx < end; ++idx) {  // idx = (b * H + h) * n_qb + qb
      const int64_t qb = idx % L.n_qb;
      const int64_t h = (idx / L.n_qb) % p.H;
      const int64_t b = idx / (L.n_qb * p.H);
      const int64_t i0 = qb * kBlockQ;
      const int64_t nq = std::min(kBlockQ, p.Sq - i0);
      acc_t* blk = packs + idx * L.size;
      acc_t *qt = blk + L.qt, *qr = blk + L.qr, *dot = blk + L.dot, *dor = blk + L.dor;
      const scalar_t* qh = q + b * p.q_batch_stride + h * p.q_head_stride + i0 * p.q_row_stride;
      const scalar_t* dh = dout + b * bp.dout_batch_stride + h * bp.dout_head_stride + i0 * bp.dout_row_stride;
      const scalar_t* oh = o + b * bp.o_batch_stride + h * bp.o_head_stride + i0 * bp.o_row_stride;
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
        blk[L.di + ii] = di;
        const acc_t l = lse[(b * p.H + h) * p.Sq + i0 + ii];
        blk[L.lse + ii] = l == neg_inf ? pos_inf : l;
      }
      for (int64_t c = nq; c < kBlockQ; ++c) {
        blk[L.di + c] = 0;
        blk[L.lse + c] = pos_inf;
      }
    }
  });
}

template <typename scalar_t, typename acc_t>
void bwd_task(const AttentionBwdParams& bp, int64_t b, int64_t hkv, int64_t j0,
              const QueryPackLayout& L, const acc_t* packs, const mk::Kernels<acc_t>& K,
              BwdScratch<acc_t>& s, acc_t* dq_w) {
  const AttentionParams& p = bp.fwd;
  const int64_t D = p.D, Dv = p.Dv, Dp = s.Dp, Dvp = s.Dvp;
  const int64_t off = p.Sk - p.Sq;
  const int64_t nk = std::min(kBlockK, p.Sk - j0);
  const int64_t group = p.H / p.Hkv;
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();

  load_rows(k + b * p.k_batch_stride + hkv * p.k_head_stride + j0 * p.k_row_stride,
            p.k_row_stride, nk, D, s.kb.data(), Dp);
  load_rows(v + b * p.v_batch_stride + hkv * p.v_head_stride + j0 * p.v_row_stride,
            p.v_row_stride, nk, Dv, s.vb.data(), Dvp);
  std::fill(s.dkt.begin(), s.dkt.end(), acc_t(0));
  std::fill(s.dvt.begin(), s.dvt.end(), acc_t(0));

  // Query blocks from the one holding the first row that sees key j0 (j0 <= i + off).
  const int64_t qb_first = p.causal ? std::max<int64_t>(0, j0 - off) / kBlockQ : 0;
  for (int64_t h = hkv * group; h < (hkv + 1) * group; ++h) {
    for (int64_t qb = qb_first; qb < L.n_qb; ++qb) {
      const int64_t i0 = qb * kBlockQ;
      const int64_t nq = std::min(kBlockQ, p.Sq - i0);
      const int64_t C = round_up(nq, 8);
      const acc_t* blk = packs + ((b * p.H + h) * L.n_qb + qb) * L.size;
      const acc_t *qt = blk + L.qt, *qr = blk + L.qr, *dot = blk + L.dot, *dor = blk + L.dor;
      acc_t* dqh = dq_w + ((b * p.H + h) * p.Sq + i0) * Dp;
      if (!(p.causal && j0 + nk - 1 > i0 + off)) {
        // Off the diagonal: every (key, query) pair of the tile is visible.
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
      // Diagonal tile: key j0 + r is seen by columns c >= first(r) = j0 + r - off - i0, so
      // the hidden triangle is skipped in 6-key / 6-query steps (pass 1, 3, 4, 6, 7); what
      // pass 1 / 4 leave uncomputed is filled with -inf / 0 before the element-wise passes.
      auto first = [&](int64_t r) { return std::clamp<int64_t>(j0 + r - off - i0, 0, C); };
      // pass 1: st = kb qt on the visible column panels, then mask
      for (int64_t r0 = 0; r0 < nk; r0 += 6) {
        const int64_t rows = std::min<int64_t>(6, nk - r0), c8 = first(r0) / 8 * 8;
        if (c8 < C) {
          K.gemm(rows, C - c8, D, s.kb.data() + r0 * Dp, Dp, 1, qt + c8, kBlockQ,
                 s.st.data() + r0 * C + c8, C, false);
        }
      }
      for (int64_t r = 0; r < nk; ++r) {
        std::fill(s.st.data() + r * C, s.st.data() + r * C + first(r), neg_inf);
      }
      // pass 2: P^T
      K.exp_sub(s.st.data(), nk, C, blk + L.lse);
      // pass 3: dvt += P^T dout over the queries that see each 6 keys
      for (int64_t r0 = 0; r0 < nk; r0 += 6) {
        const int64_t rows = std::min<int64_t>(6, nk - r0), c0 = std::min(first(r0), nq);
        if (c0 < nq) {
          K.gemm(rows, Dvp, nq - c0, s.st.data() + r0 * C + c0, C, 1, dor + c0 * Dvp, Dvp,
                 s.dvt.data() + r0 * Dvp, Dvp, true);
        }
      }
      // pass 4: dP^T = v dout^T on the visible column panels; zero elsewhere
      for (int64_t r0 = 0; r0 < nk; r0 += 6) {
        const int64_t rows = std::min<int64_t>(6, nk - r0), c8 = first(r0) / 8 * 8;
        if (c8 < C) {
          K.gemm(rows, C - c8, Dv, s.vb.data() + r0 * Dvp, Dvp, 1, dot + c8, kBlockQ,
                 s.dpt.data() + r0 * C + c8, C, false);
        }
        for (int64_t r = r0; r < r0 + rows; ++r) {
          std::fill(s.dpt.data() + r * C, s.dpt.data() + r * C + c8, acc_t(0));
        }
      }
      // pass 5: dS^T = P^T * (dP^T - Di)  (0 where hidden: P = 0)
      K.ds(s.st.data(), s.dpt.data(), nk, C, blk + L.di);
      // pass 6: dkt += dS^T q over the queries that see each 6 keys
      for (int64_t r0 = 0; r0 < nk; r0 += 6) {
        const int64_t rows = std::min<int64_t>(6, nk - r0), c0 = std::min(first(r0), nq);
        if (c0 < nq) {
          K.gemm(rows, Dp, nq - c0, s.dpt.data() + r0 * C + c0, C, 1, qr + c0 * Dp, Dp,
                 s.dkt.data() + r0 * Dp, Dp, true);
        }
      }
      // pass 7: dq_w rows += dS k over the keys each 6 queries see (j <= i + off)
      for (int64_t c0 = 0; c0 < nq; c0 += 6) {
        const int64_t mrows = std::min<int64_t>(6, nq - c0);
        const int64_t kc = std::clamp<int64_t>(i0 + c0 + mrows + off - j0, 0, nk);
        if (kc > 0) {
          K.gemm(mrows, Dp, kc, s.dpt.data() + c0, 1, C, s.kb.data(), Dp, dqh + c0 * Dp, Dp, true);
        }
      }
    }
  }

  // dk = scale * dkt, dv = dvt (contiguous (B, Sk, Hkv, D / Dv)).
  auto* dk = static_cast<scalar_t*>(bp.dk);
  auto* dv = static_cast<scalar_t*>(bp.dv);
  const acc_t scale = static_cast<acc_t>(p.scale);
  for (int64_t r = 0; r < nk; ++r) {
    const int64_t j = j0 + r;
    scalar_t* dkr = dk + ((b * p.Sk + j) * p.Hkv + hkv) * D;
    scalar_t* dvr = dv + ((b * p.Sk + j) * p.Hkv + hkv) * Dv;
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
  const int64_t off = p.Sk - p.Sq;

  // Fixed greedy plan: tasks by decreasing cost (query rows that see the key tile), each to
  // the least loaded worker (ties: lowest index). Depends only on shapes and thread count.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads(), n_tasks));
  std::vector<std::vector<int64_t>> plan(static_cast<size_t>(workers));
  {
    std::vector<int64_t> order(static_cast<size_t>(n_tasks));
    auto cost = [&](int64_t t) {
      const int64_t j0 = (t % n_kb) * kBlockK;
      return p.causal ? p.Sq - std::clamp<int64_t>(j0 - off, 0, p.Sq) : p.Sq;
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
  torch::stable::parallel_for(0, workers, 1, [&](int64_t wbeg, int64_t wend) {
    BwdScratch<acc_t> s(p.D, p.Dv);
    for (int64_t w = wbeg; w < wend; ++w) {
      for (int64_t t : plan[w]) {
        const int64_t kb = t % n_kb;
        const int64_t hkv = (t / n_kb) % p.Hkv;
        const int64_t b = t / (n_kb * p.Hkv);
        bwd_task<scalar_t, acc_t>(bp, b, hkv, kb * kBlockK, L, packs.data(), kern, s,
                                  dq_parts.data() + w * dq_size);
      }
    }
  });

  // dq (B, Sq, H, D) = scale * sum over workers (fixed order) of dq_w (B, H, Sq, Dp).
  auto* dq = static_cast<scalar_t*>(bp.dq);
  const acc_t scale = static_cast<acc_t>(p.scale);
  torch::stable::parallel_for(0, p.B * p.H * p.Sq, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {  // row = (b * H + h) * Sq + i
      const int64_t i = row % p.Sq;
      const int64_t h = (row / p.Sq) % p.H;
      const int64_t b = row / (p.Sq * p.H);
      scalar_t* dst = dq + ((b * p.Sq + i) * p.H + h) * p.D;
      for (int64_t d = 0; d < p.D; ++d) {
        acc_t sum = 0;
        for (int64_t w = 0; w < workers; ++w) sum += dq_parts[w * dq_size + row * Dp + d];
        dst[d] = static_cast<scalar_t>(sum * scale);
      }
    }
  });
}

// deterministic: ignored, the CPU backward is always deterministic (fixed work plan, dq
// partial sums reduced in a fixed order).
std::tuple<Tensor, Tensor, Tensor> attention_backward_cpu(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out, const Tensor& lse_in, bool causal, std::optional<double> scale,
    bool deterministic) {
  (void)deterministic;
  const AttentionShape s = check_attention_inputs(q, k, v, scale);
  check_attention_bwd_inputs(dout, out, lse_in, q, s);
  Tensor dq = alloc(q, {s.B, s.Sq, s.H, s.D});
  Tensor dk = alloc(q, {s.B, s.Sk, s.Hkv, s.D});
  Tensor dv = alloc(q, {s.B, s.Sk, s.Hkv, s.Dv});
  if (dq.numel() == 0 && dk.numel() == 0 && dv.numel() == 0) return {dq, dk, dv};
  if (s.Sq == 0 || s.H == 0) {  // no query: no gradient reaches k or v
    torch::stable::zero_(dk);
    torch::stable::zero_(dv);
    return {dq, dk, dv};
  }
  const Tensor lse = torch::stable::contiguous(lse_in);
  AttentionBwdParams bp =
      make_attention_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, s, causal, scale);
  if (s.Sk == 0) {  // no key: every row is empty, dq = 0
    torch::stable::zero_(dq);
    return {dq, dk, dv};
  }
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), "attention_backward",
                             [&] { attention_bwd_kernel<scalar_t>(bp); });
  return {dq, dk, dv};
}

}  // namespace
}  // namespace cpu_attn

STABLE_TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("attention_backward", TORCH_BOX(&cpu_attn::attention_backward_cpu));
}

}  // namespace attn_ext
