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
//   pass 1: st (nk, C) = kb qt               scores (log2 units), transposed; diagonal mask
//   pass 2: st = exp2(st - lse2)             probabilities P^T
//   pass 3: dvt (nk, Dvp) += st dor          dor (nq, Dvp) = dout rows
//   pass 4: dpt (nk, C) = vb dot             dot (Dv, C) = dout^T
//   pass 5: dpt = st * (dpt - Di)            dS^T
//   pass 6: dkt (nk, Dp) += dpt qr           qr (nq, Dp) = q rows
//   pass 7: dq_w (nq, Dp) += dpt^T kb        into the worker's own dq buffer
//
// dq: every worker accumulates into its own fp32 (B, H, Sq, Dp) buffer; a final pass sums the
// buffers in worker order. Tasks are assigned to workers by a fixed greedy plan (not
// dynamically), so the result is bitwise identical from run to run for a given thread count.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "common/attention_checks.h"
#include "cpu/attention_common.h"

namespace attn_ext {
namespace cpu_attn {
namespace {

template <typename acc_t>
struct BwdScratch {
  int64_t Dp, Dvp;
  std::vector<acc_t> kb;    // (kBlockK, Dp): k rows of the task
  std::vector<acc_t> vb;    // (kBlockK, Dvp): v rows of the task
  std::vector<acc_t> dkt;   // (kBlockK, Dp): dk accumulator (unscaled)
  std::vector<acc_t> dvt;   // (kBlockK, Dvp): dv accumulator
  std::vector<acc_t> qt;    // (D, kBlockQ): scale * log2(e) * q^T
  std::vector<acc_t> qr;    // (kBlockQ, Dp): q rows
  std::vector<acc_t> dot;   // (Dv, kBlockQ): dout^T
  std::vector<acc_t> dor;   // (kBlockQ, Dvp): dout rows
  std::vector<acc_t> st;    // (kBlockK, kBlockQ): scores, then P^T
  std::vector<acc_t> dpt;   // (kBlockK, kBlockQ): dP^T, then dS^T
  std::vector<acc_t> lse2;  // (kBlockQ): lse * log2(e); +inf for padding / empty rows
  std::vector<acc_t> di;    // (kBlockQ): rowsum(dout * out)
  std::vector<acc_t> tmp;   // (max(D, Dv)): one converted row

  BwdScratch(int64_t D, int64_t Dv)
      : Dp(round_up(D, 8)),
        Dvp(round_up(Dv, 8)),
        kb(static_cast<size_t>(kBlockK * Dp), acc_t(0)),
        vb(static_cast<size_t>(kBlockK * Dvp), acc_t(0)),
        dkt(static_cast<size_t>(kBlockK * Dp)),
        dvt(static_cast<size_t>(kBlockK * Dvp)),
        qt(static_cast<size_t>(std::max<int64_t>(D, 1) * kBlockQ)),
        qr(static_cast<size_t>(kBlockQ * Dp), acc_t(0)),
        dot(static_cast<size_t>(std::max<int64_t>(Dv, 1) * kBlockQ)),
        dor(static_cast<size_t>(kBlockQ * Dvp), acc_t(0)),
        st(static_cast<size_t>(kBlockK * kBlockQ)),
        dpt(static_cast<size_t>(kBlockK * kBlockQ)),
        lse2(kBlockQ),
        di(kBlockQ),
        tmp(static_cast<size_t>(std::max<int64_t>(std::max(D, Dv), 1)), acc_t(0)) {}
};

template <typename scalar_t, typename acc_t>
void bwd_task(const AttentionBwdParams& bp, int64_t b, int64_t hkv, int64_t j0,
              const mk::Kernels<acc_t>& K, BwdScratch<acc_t>& s, acc_t* dq_w) {
  const AttentionParams& p = bp.fwd;
  const int64_t D = p.D, Dv = p.Dv, Dp = s.Dp, Dvp = s.Dvp;
  const int64_t off = p.Sk - p.Sq;
  const int64_t nk = std::min(kBlockK, p.Sk - j0);
  const int64_t group = p.H / p.Hkv;
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const auto* dout = static_cast<const scalar_t*>(bp.dout);
  const auto* o = static_cast<const scalar_t*>(bp.out);
  const auto* lse = static_cast<const acc_t*>(bp.lse);
  const acc_t qscale = static_cast<acc_t>(p.scale * kLog2e);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const acc_t pos_inf = std::numeric_limits<acc_t>::infinity();

  load_rows(k + b * p.k_batch_stride + hkv * p.k_head_stride + j0 * p.k_row_stride,
            p.k_row_stride, nk, D, s.kb.data(), Dp);
  load_rows(v + b * p.v_batch_stride + hkv * p.v_head_stride + j0 * p.v_row_stride,
            p.v_row_stride, nk, Dv, s.vb.data(), Dvp);
  std::fill(s.dkt.begin(), s.dkt.end(), acc_t(0));
  std::fill(s.dvt.begin(), s.dvt.end(), acc_t(0));

  // First query row that sees key j0 (causal: j0 <= i + off).
  const int64_t qbeg = p.causal ? std::max<int64_t>(0, j0 - off) : 0;
  for (int64_t h = hkv * group; h < (hkv + 1) * group; ++h) {
    for (int64_t i0 = qbeg; i0 < p.Sq; i0 += kBlockQ) {
      const int64_t nq = std::min(kBlockQ, p.Sq - i0);
      const int64_t C = round_up(nq, 8);
      // Pack q, dout of rows [i0, i0 + nq) of head h; lse2 and Di per row.
      const scalar_t* qh = q + b * p.q_batch_stride + h * p.q_head_stride + i0 * p.q_row_stride;
      const scalar_t* dh = dout + b * bp.dout_batch_stride + h * bp.dout_head_stride + i0 * bp.dout_row_stride;
      const scalar_t* oh = o + b * bp.o_batch_stride + h * bp.o_head_stride + i0 * bp.o_row_stride;
      std::fill(s.qt.begin(), s.qt.begin() + D * C, acc_t(0));
      std::fill(s.dot.begin(), s.dot.begin() + Dv * C, acc_t(0));
      for (int64_t ii = 0; ii < nq; ++ii) {
        convert_row(qh + ii * p.q_row_stride, D, s.qr.data() + ii * Dp);
        for (int64_t d = 0; d < D; ++d) s.qt[d * C + ii] = s.qr[ii * Dp + d] * qscale;
        acc_t* dr = s.dor.data() + ii * Dvp;
        convert_row(dh + ii * bp.dout_row_stride, Dv, dr);
        for (int64_t d = 0; d < Dv; ++d) s.dot[d * C + ii] = dr[d];
        convert_row(oh + ii * bp.o_row_stride, Dv, s.tmp.data());
        acc_t di = 0;
        for (int64_t d = 0; d < Dv; ++d) di += dr[d] * s.tmp[d];
        s.di[ii] = di;
        const acc_t l = lse[(b * p.H + h) * p.Sq + i0 + ii];
        s.lse2[ii] = l == neg_inf ? pos_inf : l * static_cast<acc_t>(kLog2e);
      }
      for (int64_t c = nq; c < C; ++c) {
        s.di[c] = 0;
        s.lse2[c] = pos_inf;  // padding columns: P = 0
      }
      // pass 1: st (nk, C) = kb qt, masked on the diagonal
      K.gemm(nk, C, D, s.kb.data(), Dp, 1, s.qt.data(), C, s.st.data(), C, false);
      if (p.causal && j0 + nk - 1 > i0 + off) {
        for (int64_t r = std::max<int64_t>(0, i0 + off + 1 - j0); r < nk; ++r) {
          acc_t* row = s.st.data() + r * C;
          const int64_t first_seen = j0 + r - off - i0;  // columns c < first_seen are masked
          for (int64_t c = 0; c < std::min(first_seen, C); ++c) row[c] = neg_inf;
        }
      }
      // pass 2: P^T
      K.exp2_sub(s.st.data(), nk, C, s.lse2.data());
      // pass 3: dvt += P^T dout
      K.gemm(nk, Dvp, nq, s.st.data(), C, 1, s.dor.data(), Dvp, s.dvt.data(), Dvp, true);
      // pass 4: dP^T = v dout^T
      K.gemm(nk, C, Dv, s.vb.data(), Dvp, 1, s.dot.data(), C, s.dpt.data(), C, false);
      // pass 5: dS^T = P^T * (dP^T - Di)
      K.ds(s.st.data(), s.dpt.data(), nk, C, s.di.data());
      // pass 6: dkt += dS^T q
      K.gemm(nk, Dp, nq, s.dpt.data(), C, 1, s.qr.data(), Dp, s.dkt.data(), Dp, true);
      // pass 7: dq_w rows += dS k
      acc_t* dqh = dq_w + ((b * p.H + h) * p.Sq + i0) * Dp;
      K.gemm(nq, Dp, nk, s.dpt.data(), 1, C, s.kb.data(), Dp, dqh, Dp, true);
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
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_tasks));
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

  // dq_w: (workers, B, H, Sq, Dp) partial sums, one slice per worker.
  const int64_t dq_size = p.B * p.H * p.Sq * Dp;
  std::vector<acc_t> dq_parts(static_cast<size_t>(workers * dq_size), acc_t(0));
  at::parallel_for(0, workers, 1, [&](int64_t wbeg, int64_t wend) {
    BwdScratch<acc_t> s(p.D, p.Dv);
    for (int64_t w = wbeg; w < wend; ++w) {
      for (int64_t t : plan[w]) {
        const int64_t kb = t % n_kb;
        const int64_t hkv = (t / n_kb) % p.Hkv;
        const int64_t b = t / (n_kb * p.Hkv);
        bwd_task<scalar_t, acc_t>(bp, b, hkv, kb * kBlockK, kern, s, dq_parts.data() + w * dq_size);
      }
    }
  });

  // dq (B, Sq, H, D) = scale * sum over workers (fixed order) of dq_w (B, H, Sq, Dp).
  auto* dq = static_cast<scalar_t*>(bp.dq);
  const acc_t scale = static_cast<acc_t>(p.scale);
  at::parallel_for(0, p.B * p.H * p.Sq, 64, [&](int64_t begin, int64_t end) {
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse_in, bool causal, std::optional<double> scale) {
  const AttentionShape s = check_attention_inputs(q, k, v, scale);
  check_attention_bwd_inputs(dout, out, lse_in, q, s);
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
  AttentionBwdParams bp{};
  bp.fwd = make_attention_params(q, k, v, at::Tensor(), at::Tensor(), s, causal, scale);
  bp.dout = dout.data_ptr();
  bp.out = out.data_ptr();
  bp.lse = lse.data_ptr();
  bp.dout_batch_stride = dout.stride(0);
  bp.dout_row_stride = dout.stride(1);
  bp.dout_head_stride = dout.stride(2);
  bp.o_batch_stride = out.stride(0);
  bp.o_row_stride = out.stride(1);
  bp.o_head_stride = out.stride(2);
  bp.dq = dq.data_ptr();
  bp.dk = dk.data_ptr();
  bp.dv = dv.data_ptr();
  if (s.Sk == 0) {  // no key: every row is empty, dq = 0
    dq.zero_();
    return {dq, dk, dv};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attention_backward",
                                  [&] { attention_bwd_kernel<scalar_t>(bp); });
  return {dq, dk, dv};
}

}  // namespace
}  // namespace cpu_attn

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("attention_backward", &cpu_attn::attention_backward_cpu);
}

}  // namespace attn_ext
