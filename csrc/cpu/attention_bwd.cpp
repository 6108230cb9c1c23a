// attn_ext::attention_backward on CPU (FlashAttention-2 style: probabilities are recomputed
// from the saved lse; no (Sq, Sk) buffer).
//
//   P = exp(scale * q k^T - lse)  (masked entries 0),  Di = rowsum(dout * out)
//   (or sum_j P_j dP_j where a row's keys lie in one key tile: refined_row_terms)
//   dv = P^T dout,  dP = dout v^T,  dS = P * (dP - Di),  dq = scale * dS k,  dk = scale * dS^T q
//
// Work units own the gradients they write (no per-worker copy of any gradient): see
// attention_bwd_kernel for the two partitions (fused per (batch, kv head); split in the
// FlashAttention-2 way when there are fewer of those than threads) and bwd_pair for the seven
// passes of one (query block, key tile) pair. Bitwise identical from run to run for a given
// thread count (fused: for any thread count).

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "common/registration.h"
#include "common/attention_checks.h"
#include "common/attention_mask_checks.h"
#include "common/score_checks.h"
#include "cpu/attention_common.h"
#include "cpu/attention_decode.h"

namespace attn_ext {
namespace cpu_attn {
namespace {

// Query blocks that visit the key tiles together in the fused backward: a key tile's K / V
// rows and its dk / dv accumulators come from L3 once for all of them instead of once per
// block. Measured (RESULTS.md, sixth session; alternated call by call): 4 blocks 3-7 % faster
// than 1 at (1, 8, 4096, 128) fp32, 2 threads; 2 and 3 in between. The results are bitwise
// those of one block at a time (visit; d rel_bias through each block's own row).
constexpr int kBwdJobs = 4;

// ATTN_EXT_CPU_BWD_JOBS=n (1..kBwdJobs; default kBwdJobs, also for any other value, which
// attn_ext/_env.py warns about at import): query blocks per visit, read on each call
// (tests/test_backward_partition.py checks that the grouping leaves the bits alone).
inline int bwd_jobs() {
  const char* env = std::getenv("ATTN_EXT_CPU_BWD_JOBS");
  if (env == nullptr) return kBwdJobs;
  static_assert(kBwdJobs <= 9, "one digit");
  if (env[0] < '1' || env[0] > '0' + kBwdJobs || env[1] != '\0') return kBwdJobs;
  return env[0] - '0';
}

template <typename acc_t>
struct BwdScratch {
  int64_t Dp, Dvp;
  // The leading dimension of the key tile's k rows (kb / hk) and of the jobs' dq accumulators:
  // the pack's q rows' (QueryPackLayout::ldq, padded_ld(Dp): rows that would alias as pass 7's
  // B operand and C, 512-byte multiples at D = 128 fp32, are padded), except that k keeps Dp in
  // the decode order (its scores read k's rows at Dp)
  int64_t ldk, ldq;
  AlignedVec<acc_t> kb;    // (kBlockK, ldk): k rows of the key tile
  AlignedVec<acc_t> vb;    // (kBlockK, Dvp): v rows of the key tile
  AlignedVec<acc_t> st;    // (kBlockK, kBlockQ): scores, then P^T
  AlignedVec<acc_t> dpt;   // (kBlockK, kBlockQ): dP^T, then dS^T
  // kBwdJobs query blocks visit the key tiles together (attention_bwd_kernel): per block
  struct Job {
    AlignedVec<acc_t> blk;          // the packed query block (QueryPackLayout::size)
    AlignedVec<acc_t> dqt;          // (kBlockQ, ldq): its dq accumulator (unscaled)
    std::vector<uint64_t> rk;       // (kBlockQ): dropout row keys of its rows
    int64_t h = 0, i0 = 0, nq = 0;  // query head and rows [i0, i0 + nq)
    double* db = nullptr;           // its head's d rel_bias row in the work unit (or nullptr):
    int64_t db_lo = 0, db_n = 0;    // buckets [db_lo, db_lo + db_n) of the (2M + 1), db_n apart
    std::vector<double> dbj;        // (2M + 1): the block's own d rel_bias sums, added to db
                                    // after its visit (so the row's sum does not depend on
                                    // which blocks visit together)
  };
  Job jobs[kBwdJobs];
  AlignedVec<acc_t> tmp;   // (8 * max(Dp, Dvp)): converted rows (8 of out: the row terms)
  AlignedVec<acc_t> sc;    // (kBlockQ, kBlockK): scores in the decode kernel's layout (decode order)
  AlignedVec<acc_t> kdo;   // (kBlockK, Dp): the key tile's k rows in the decode kernel's element
                           // order where it is not natural (bf16: decode_detail::decode_pos);
                           // filled by load_key_tile
  std::vector<uint8_t> kvalid;  // (kBlockK): key padding of the tile's keys (1 = takes part)
  AlignedVec<acc_t> th;    // (kBlockK, kBlockQ): tanh(s / softcap) (softcap only)
  AlignedVec<acc_t> pz;    // (kBlockK, kBlockQ): P^T * Z / (1 - p) (dropout only)
  std::vector<uint64_t> words;  // (kBlockQ): dropout words of the pair's rows
  HeadRows<acc_t> hk, hv;  // the current kv head's converted k / v rows (head_rows_fit)
  int64_t head_rows_budget = kHeadRowsBytes;  // this call's per-worker share
  bool decode_wide = false;  // decode-order scores on zmm (decode_scores512_enabled; per call)
  bool decode_tiles = false;  // decode-order bf16 scores on AMX tiles (decode_scores_on_tiles)
  bool dp_tile16 = true;     // dp_scores' 16-accumulator tiles (dp_tile16_enabled; per call)
  const acc_t* kbp = nullptr;  // the key tile's k rows (nk, ldk): in kb or hk
  const acc_t* vbp = nullptr;  // its v rows (nk, Dvp): in vb or hv
  // The work unit's dk / dv accumulators, (Sk, Dp) then (Sk, Dvp), when the gradients' rows lie
  // apart in memory or are not fp32 (unit_rows in attention_bwd_kernel; sized on the unit's
  // first use).
  AlignedVec<acc_t> unit_kv;
  int64_t unit_j0 = 0, unit_n = 0;  // unit_kv's first key and its rows per part
  // pass 7 on AMX tiles (QueryPackLayout::amx_dq()): the key tile's k^T as bf16 key pairs
  // (D, kKeyPairs; mk::pack_vt_pairs, once per key tile) and dS^T as bf16 key pairs
  // (kKeyPairs, kBlockQ; mk::probs_to_pairs, per pair of tiles)
  static constexpr int64_t kKeyPairs = ceil_div(kBlockK, 32) * 16;
  AlignedVec<uint32_t> kpt, dsp;
  AlignedVec<uint32_t> kpt_z;  // kpt with k's inf / NaN entries as 0 (a partial pair's, sized on use)
  AlignedVec<uint32_t> dn_z, qn_z;  // the block's dout / q row pairs with its non-finite rows as 0
                                    // (a partial pair's, on the tiles; sized on use)
  // fp16 on the tiles (QueryPackLayout::split): the key tile's k rows (kBlockK, D) and v rows
  // (kBlockK, Dv; where pass 4 is on tiles) split into bf16 hi / lo (mk::split_fp16), k^T's and
  // dS^T's lo pairs beside kpt / dsp, and one query block's q / dout / out rows split while it
  // is packed (kBlockQ, max(D, Dv))
  AlignedVec<uint16_t> khi, klo, vhi, vlo, rhi, rlo;
  AlignedVec<uint32_t> kpt_lo, dsp_lo;

  BwdScratch(int64_t D, int64_t Dv, int64_t pack_size, const ScoreTerms& terms, bool decode_order,
             bool decode_pairs, int64_t ld_rows)
      : Dp(round_up(D, 8)),
        Dvp(round_up(Dv, 8)),
        ldk(decode_order ? Dp : ld_rows),
        ldq(ld_rows),
        kb(static_cast<size_t>(kBlockK * ldk), acc_t(0)),
        vb(static_cast<size_t>(kBlockK * Dvp), acc_t(0)),
        st(static_cast<size_t>(kBlockK * kBlockQ)),
        dpt(static_cast<size_t>(kBlockK * kBlockQ)),
        tmp(static_cast<size_t>(8 * std::max<int64_t>(std::max(Dp, Dvp), 8))),
        sc(decode_order ? static_cast<size_t>(kBlockQ * kBlockK) : 0),
        kdo(decode_pairs ? static_cast<size_t>(kBlockK * Dp) : 0),
        kvalid(kBlockK, 1),
        th(terms.softcap > 0.0 ? static_cast<size_t>(kBlockK * kBlockQ) : 0),
        pz(terms.has_dropout() ? static_cast<size_t>(kBlockK * kBlockQ) : 0),
        words(kBlockQ),
        pack_size_(pack_size) {}
  // Job j, its buffers allocated on first use (the split partition uses job 0 only). The pack
  // starts zeroed: its padding columns are never written.
  Job& job(int j) {
    Job& x = jobs[j];
    if (x.blk.empty()) {
      x.blk.assign(static_cast<size_t>(pack_size_), acc_t(0));
      x.dqt.resize(static_cast<size_t>(kBlockQ * ldq));
      x.rk.resize(kBlockQ);
    }
    return x;
  }
  int64_t pack_size_;
};

// Query-side operands of one (batch, head, query block of kBlockQ rows), packed into the
// worker's scratch when the block is visited. Offsets in elements; padding rows/columns are
// zero:
//   qt   (D, kBlockQ)    scale * q^T (the forward's scores, bitwise; natural-log units, like lse)
//   qr   (kBlockQ, ldq)  q rows (ldq = padded_ld(Dp): pass 6's B operand)
//   qs   (kBlockQ, Dp)   scale * q rows in the decode kernel's element order (its operand;
//                        filled only where decode_order, else left zero and unused)
//   dot  (Dv, kBlockQ)   dout^T
//   dor  (kBlockQ, ldo)  dout rows (ldo = padded_ld(Dvp): pass 3's B operand)
//   lse  (kBlockQ)       lse; +inf for padding rows and rows that see no key (P = 0)
//   di   (kBlockQ)       rowsum(dout * out) - dlse
//   fin  (1)             1 when the block's q and dout are all finite
//   dl   (kBlockQ)       dlse (0 without it; ds_dropout's rows whose probability is 1)
//   da   (kBlockQ)       sum_d |dout_d out_d|: the scale of Di's rounding (refined_row_terms)
//   qp   (D / 2, kBlockQ) q's bf16 pairs, unscaled (mk::pack_bf16_pairs: pass 1 by
//                        mk::scores_bf16dp, as the forward's; only where pairs, else empty)
//   dp   (Dv / 2, kBlockQ) dout's bf16 pairs (pass 4 by mk::scores_bf16dp, and Di in its
//                        chains; only where dout_pairs, else empty)
//   qn   (kBlockQ / 2, D) q's rows paired (mk::pack_row_pairs: pass 6 on AMX tiles; amx_dk)
//   dn   (kBlockQ / 2, Dv) dout's rows paired (pass 3 on AMX tiles; amx_dv)
// fp16 on the tiles (split): qp, dp, qn and dn each hold the pairs of the values' bf16 hi parts
// and after them those of their lo parts (mk::split_fp16; *_lo below), for the split products.
//
// P = exp(s - lse) must reproduce the forward's probabilities, whose rounding the forward's
// out and lse carry: the scores s are the forward's own (same scale folded into q, same FMA
// order), in the units lse is stored in, so in a row whose probability sits on one key
// lse == s there and P = 1 as in the forward (issue 18 item 8).
struct QueryPackLayout {
  int64_t ldq, ldo;  // qr's and dor's leading dimensions
  int64_t qt, qr, qs, dot, dor, lse, di, fin, dl, da, qp, dp, qn, dn, size;
  bool amx = false;     // the pairs' products (pass 1) on AMX tiles (mk::amx_for(D)), as the forward's
  bool amx_dp = false;  // pass 4 and Di on AMX tiles (mk::amx_for(Dv))
  bool amx_dk = false;  // pass 6 (dk += dS^T q) on AMX tiles (mk::amx_pv_for(D)): qn
  bool amx_dv = false;  // pass 3 (dv += P^T dout) on AMX tiles (mk::amx_pv_for(Dv)): dn
  bool split = false;   // fp16 on the tiles: every product split into bf16 hi / lo terms
  double out_u = 0;     // unit roundoff of out's dtype (refined_row_terms)
  QueryPackLayout(int64_t D, int64_t Dv, int64_t Dp, int64_t Dvp, int64_t ldq_, int64_t ldo_,
                  bool pairs, bool dout_pairs, bool q_rows_pairs = false,
                  bool dout_rows_pairs = false, bool split_ = false)
      : ldq(ldq_),
        ldo(ldo_),
        qt(0),
        qr(qt + D * kBlockQ),
        qs(qr + kBlockQ * ldq),
        dot(qs + kBlockQ * Dp),
        dor(dot + Dv * kBlockQ),
        lse(dor + kBlockQ * ldo),
        di(lse + kBlockQ),
        fin(di + kBlockQ),
        dl(fin + 8),
        da(dl + kBlockQ),
        qp(da + kBlockQ),
        dp(qp + (pairs ? D / 2 * kBlockQ : 0) * (split_ ? 2 : 1)),
        qn(dp + (dout_pairs ? Dv / 2 * kBlockQ : 0) * (split_ ? 2 : 1)),
        dn(qn + (q_rows_pairs ? kBlockQ / 2 * D : 0) * (split_ ? 2 : 1)),
        size(dn + (dout_rows_pairs ? kBlockQ / 2 * Dv : 0) * (split_ ? 2 : 1)),
        amx_dk(q_rows_pairs),
        amx_dv(dout_rows_pairs),
        split(split_),
        D_(D),
        Dv_(Dv) {}
  bool has_q_pairs() const { return dp > qp; }
  bool has_dout_pairs() const { return qn > dp; }
  // pass 7 on AMX tiles as dq^T += k^T dS^T: the rule of pass 6 (D a multiple of 16); the job's
  // dq accumulator is then (D, kBlockQ), transposed
  bool amx_dq() const { return amx_dk; }
  // the lo parts' pairs (split)
  int64_t qp_lo() const { return qp + D_ / 2 * kBlockQ; }
  int64_t dp_lo() const { return dp + Dv_ / 2 * kBlockQ; }
  int64_t qn_lo() const { return qn + kBlockQ / 2 * D_; }
  int64_t dn_lo() const { return dn + kBlockQ / 2 * Dv_; }
  int64_t D_, Dv_;
};

// Packs rows [i0, i0 + nq) of head h of sequence b into blk (layout L; blk starts zeroed and
// only ever holds blocks of this shape, so padding stays zero). fused_dp: the dP gemm uses FMA.
template <typename scalar_t, typename acc_t>
void pack_query_block(const AttentionBwdParams& bp, const QueryPackLayout& L, const SeqInfo& sq,
                      int64_t b, int64_t h, int64_t i0, int64_t nq, acc_t* blk, acc_t* tmp,
                      bool fused_dp, bool decode_order, uint16_t* rhi, uint16_t* rlo) {
  const AttentionParams& p = bp.fwd;
  const int64_t D = p.D, Dv = p.Dv, Dp = round_up(D, 8), Dvp = round_up(Dv, 8);
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* dout = static_cast<const scalar_t*>(bp.dout);
  const auto* o = static_cast<const scalar_t*>(bp.out);
  const auto* lse = static_cast<const acc_t*>(bp.lse);
  const auto* dlse = static_cast<const acc_t*>(bp.dlse);  // may be nullptr (zero)
  // the forward's scale of q (attention_fwd.cpp / attention_decode.h)
  const acc_t qscale = static_cast<acc_t>(p.score_terms().scale);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const acc_t pos_inf = std::numeric_limits<acc_t>::infinity();
  acc_t *qt = blk + L.qt, *qr = blk + L.qr, *dot = blk + L.dot, *dor = blk + L.dor;
  const int64_t r0 = sq.q0 + i0;  // first (packed) row of the block
  const scalar_t* qh = q + b * p.q_batch_stride + h * p.q_head_stride + r0 * p.q_row_stride;
  const scalar_t* dh = dout + b * bp.dout_batch_stride + h * bp.dout_head_stride + r0 * bp.dout_row_stride;
  const scalar_t* oh = o + b * bp.o_batch_stride + h * bp.o_head_stride + r0 * bp.o_row_stride;
  const int64_t stat = b * p.lse_batch_stride + h * p.lse_head_stride + r0;  // lse / dlse of row i0
  // the bf16 pairs of nq rows (at `stride`) of `depth` elements at blk + off, columns [nq,
  // kBlockQ) zero (a shorter last block after a full one left values there)
  // (rows: bf16 values, or the hi / lo parts of split fp16 ones)
  auto pack_pairs = [&](const void* rows, int64_t stride, int64_t depth, int64_t off) {
    auto* dst = reinterpret_cast<uint32_t*>(blk + off);
    mk::pack_bf16_pairs(static_cast<const uint16_t*>(rows), stride, nq, depth, dst, kBlockQ);
    for (int64_t t = 0; t < depth / 2; ++t) std::fill(dst + t * kBlockQ + nq, dst + (t + 1) * kBlockQ, 0u);
    return dst;
  };
  uint32_t* dpp = nullptr;  // dout's pairs (L.dp), where pass 4 is mk::scores_bf16dp
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    if (L.has_dout_pairs()) dpp = pack_pairs(dh, bp.dout_row_stride, Dv, L.dp);
  }
  for (int64_t ii = 0; ii < nq; ++ii) {
    acc_t* qrow = qr + ii * L.ldq;
    convert_row(qh + ii * p.q_row_stride, D, qrow);
    for (int64_t d = 0; decode_order && d < D; ++d)
      blk[L.qs + ii * Dp + decode_detail::decode_pos(decode_detail::kDecodePairs<scalar_t>, d, D)] =
          qrow[d] * qscale;
    acc_t* drow = dor + ii * L.ldo;
    convert_row(dh + ii * bp.dout_row_stride, Dv, drow);
    // Di in the order (and with the rounding) of the dP gemm's chains over d
    // (mk::gemm_chain_length), so that where out equals one key's v (a row whose probability
    // sits on that key) Di equals its dP bitwise and dS = P * (dP - Di) is 0 there, as in the
    // textbook.
    if ((dpp != nullptr || L.split) && L.amx_dp) {
      // taken for the whole block below (mk::scores_amx_diag / _split)
    } else if (dpp != nullptr) {
      // pass 4's own chains (mk::scores_bf16dp: out's row against dout's pairs, one lane per
      // query column, the same vdpbf16ps per lane whatever its position)
      alignas(64) float c8[8];
      mk::scores_bf16dp(1, 8, Dv, reinterpret_cast<const uint16_t*>(oh + ii * bp.o_row_stride),
                        0, dpp + ii / 8 * 8, kBlockQ, 1.f, c8, 8);
      blk[L.di + ii] = c8[ii % 8];
    } else {
      // out's rows in tmp (8 rows at Dvp), their row terms 8 at a time (mk::row_dots: the
      // chains side by side)
      const int64_t g = ii % 8;
      convert_row(oh + ii * bp.o_row_stride, Dv, tmp + g * Dvp);
      if (g == 7 || ii == nq - 1) {
        mk::row_dots<acc_t>(static_cast<int>(g + 1), Dv, tmp, Dvp, dor + (ii - g) * L.ldo, L.ldo,
                            blk + L.di + (ii - g), fused_dp);
      }
    }
    const acc_t l = lse[stat + ii];
    blk[L.lse + ii] = l == neg_inf ? pos_inf : l;
  }
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    if (dpp != nullptr && L.amx_dp) {
      // pass 4's own chains on tiles: out's row i against dout's column i, the element (i, i) of
      // the block's out x dout tile (its bits do not depend on its position)
      mk::scores_amx_diag(nq, Dv, reinterpret_cast<const uint16_t*>(oh), bp.o_row_stride, dpp,
                          kBlockQ, kBlockQ, blk + L.di);
    }
  }
  if constexpr (std::is_same_v<scalar_t, c10::Half> && std::is_same_v<acc_t, float>) {
    if (L.split) {
      // fp16 on the tiles: the rows split into bf16 hi / lo (rhi / rlo), then paired as the
      // bf16 path pairs its rows; lo pairs after the hi ones
      auto pairs_of = [&](const scalar_t* rows, int64_t stride, int64_t depth, int64_t off,
                          int64_t off_lo, int64_t rows_off, int64_t rows_off_lo, bool cols,
                          bool row_pairs) {
        mk::split_fp16_rows(reinterpret_cast<const uint16_t*>(rows), stride, nq, depth, rhi, rlo,
                            depth);
        const uint16_t* part[2] = {rhi, rlo};
        const int64_t at[2] = {off, off_lo}, rat[2] = {rows_off, rows_off_lo};
        for (int x = 0; x < 2; ++x) {
          if (cols) pack_pairs(part[x], depth, depth, at[x]);
          if (row_pairs) {
            mk::pack_row_pairs(part[x], depth, nq, depth, reinterpret_cast<uint32_t*>(blk + rat[x]),
                               depth, kBlockQ / 2);
          }
        }
      };
      pairs_of(qh, p.q_row_stride, D, L.qp, L.qp_lo(), L.qn, L.qn_lo(), L.has_q_pairs(), L.amx_dk);
      pairs_of(dh, bp.dout_row_stride, Dv, L.dp, L.dp_lo(), L.dn, L.dn_lo(), L.has_dout_pairs(),
               L.amx_dv);
      if (L.has_dout_pairs() && L.amx_dp) {
        // Di in pass 4's chains: out's row i against dout's column i, both split
        mk::split_fp16_rows(reinterpret_cast<const uint16_t*>(oh), bp.o_row_stride, nq, Dv, rhi,
                            rlo, Dv);
        mk::scores_amx_diag_split(nq, Dv, rhi, rlo, Dv, reinterpret_cast<const uint32_t*>(blk + L.dp),
                                  reinterpret_cast<const uint32_t*>(blk + L.dp_lo()), kBlockQ,
                                  kBlockQ, blk + L.di);
      }
    }
  }
  // lse's gradient folds into the row term: dS = P * (dP - (Di - dlse_i))
  for (int64_t ii = 0; ii < nq; ++ii) {
    const acc_t dl = dlse != nullptr ? dlse[stat + ii] : acc_t(0);
    blk[L.di + ii] -= dl;
    blk[L.dl + ii] = dl;
  }
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    if (L.has_q_pairs()) pack_pairs(qh, p.q_row_stride, D, L.qp);
    if (L.amx_dk) {
      mk::pack_row_pairs(reinterpret_cast<const uint16_t*>(qh), p.q_row_stride, nq, D,
                         reinterpret_cast<uint32_t*>(blk + L.qn), D, kBlockQ / 2);
    }
    if (L.amx_dv) {
      mk::pack_row_pairs(reinterpret_cast<const uint16_t*>(dh), bp.dout_row_stride, nq, Dv,
                         reinterpret_cast<uint32_t*>(blk + L.dn), Dv, kBlockQ / 2);
    }
  }
  // qt = scale * q^T and dot = dout^T from the converted rows (one rounding, as the forward's qt)
  mk::transpose_rows<acc_t>(qr, L.ldq, nq, D, qscale, true, qt, kBlockQ);
  mk::transpose_rows<acc_t>(dor, L.ldo, nq, Dv, acc_t(1), false, dot, kBlockQ);
  // rows [nq, kBlockQ): a shorter block (the last of a sequence) after a full one left values
  // there; make them padding again
  for (int64_t ii = nq; ii < kBlockQ; ++ii) {
    std::fill(qr + ii * L.ldq, qr + ii * L.ldq + Dp, acc_t(0));
    std::fill(blk + L.qs + ii * Dp, blk + L.qs + (ii + 1) * Dp, acc_t(0));
    std::fill(dor + ii * L.ldo, dor + ii * L.ldo + Dvp, acc_t(0));
    for (int64_t d = 0; d < D; ++d) qt[d * kBlockQ + ii] = 0;
    for (int64_t d = 0; d < Dv; ++d) dot[d * kBlockQ + ii] = 0;
    blk[L.di + ii] = 0;
    blk[L.dl + ii] = 0;
    blk[L.da + ii] = 0;
    blk[L.lse + ii] = pos_inf;
  }
  // sum_d |dout_d out_d| of the rows refined_row_terms may refine: those whose band fits one
  // key tile (out's rows converted in tmp); the others' da is never read
  const Visibility vis = p.visibility();
  for (int64_t ii = 0; ii < nq; ++ii) {
    const Range band = vis.band_keys(sq, i0 + ii);
    if (band.hi - band.lo > kBlockK) continue;
    convert_row(oh + ii * bp.o_row_stride, Dv, tmp);
    const acc_t* drow = dor + ii * L.ldo;
    acc_t a = 0;
    for (int64_t d = 0; d < Dv; ++d) a += std::abs(drow[d] * tmp[d]);
    blk[L.da + ii] = a;
  }
  // Whether the block's q and dout rows are all finite (then a hidden pair's 0 times them is
  // 0, and the partial tiles may use the dense products).
  blk[L.fin] = all_finite(qr, nq, D, L.ldq) && all_finite(dor, nq, Dv, L.ldo) ? acc_t(1) : acc_t(0);
}

// Loads key tile [j0, j0 + nk) of kv head hkv of sequence b: s.kbp / s.vbp (the head's rows
// converted once per worker when they fit, else this tile's in s.kb / s.vb) and s.kvalid.
// Returns the number of keys that take part (not padded); *k_finite: all of kb is finite.
// rows16: every product of the pair reads k and v as 16-bit rows or pairs (bf16 / fp16 on the
// tiles: rows16 in attention_bwd_kernel), so the fp32 rows are needed only where k
// holds an inf / NaN (the key-by-key fallbacks): then the finiteness is read off k's 16-bit rows
// and s.kbp / s.vbp stay null unless it is not finite (no conversion, and no 4 MiB of fp32 rows
// per worker in the caches beside the tiles' operands).
template <typename scalar_t, typename acc_t>
int64_t load_key_tile(const AttentionParams& p, const Visibility& vis, const SeqInfo& sq,
                      int64_t b, int64_t hkv, int64_t j0, int64_t nk, BwdScratch<acc_t>& s,
                      bool* k_finite, bool rows16 = false) {
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const scalar_t* kh = k + b * p.k_batch_stride + hkv * p.k_head_stride + sq.k0 * p.k_row_stride;
  const scalar_t* vh = v + b * p.v_batch_stride + hkv * p.v_head_stride + sq.k0 * p.v_row_stride;
  int64_t n_valid = nk;
  if (vis.has_padding()) {
    n_valid = 0;
    for (int64_t r = 0; r < nk; ++r) n_valid += (s.kvalid[r] = vis.key_valid(b, j0 + r));
  }
  if constexpr (sizeof(scalar_t) == 2) {
    if (rows16) {
      // a 16-bit float is inf / NaN where its exponent bits are all ones
      const uint16_t e = std::is_same_v<scalar_t, c10::BFloat16> ? 0x7f80 : 0x7c00;
      bool fin = true;
      for (int64_t r = 0; r < nk && fin; ++r) {
        const auto* row = reinterpret_cast<const uint16_t*>(kh + (j0 + r) * p.k_row_stride);
        uint16_t bad = 0;
        for (int64_t d = 0; d < p.D; ++d) bad |= static_cast<uint16_t>((row[d] & e) == e);
        fin = bad == 0;
      }
      if (fin) {
        s.kbp = s.vbp = nullptr;
        *k_finite = true;
        return n_valid;
      }
    }
  }
  const bool whole = head_rows_fit(sq.Sk, s.ldk, s.Dvp, sizeof(acc_t), s.head_rows_budget);
  s.kbp = s.hk.tile(whole, kh, p.k_row_stride, sq.Sk, p.D, s.ldk, j0, nk, s.kb);
  if constexpr (std::is_same_v<acc_t, float>) {
    // pass1_decode's operand in the forward's element order (bf16), once per tile
    for (int64_t r = 0; r < round_up(nk, 8) && !s.kdo.empty(); ++r)
      decode_detail::to_decode_order<c10::BFloat16>(s.kbp + r * s.ldk, p.D, s.kdo.data() + r * s.Dp);
  }
  s.vbp = s.hv.tile(whole, vh, p.v_row_stride, sq.Sk, p.Dv, s.Dvp, j0, nk, s.vb);
  *k_finite = whole ? s.hk.finite(j0, nk) : all_finite(s.kbp, nk, p.D, s.ldk);
  return n_valid;
}

// Gradient accumulators of one key tile: dk / dv rows (unscaled dk) at dkt + r * ldk and
// dvt + r * ldv; nullptr when the pass computes dq only. db: the work unit's partial
// d rel_bias row (2M + 1) of the query head, nullptr when not accumulated here.
template <typename acc_t>
struct KeyAcc {
  acc_t* dkt;
  int64_t ldk;
  acc_t* dvt;
  int64_t ldv;
  double* db;
};

// dS^T = Pz^T * dP^T - P^T * Di with dropout (Pz = P * Z / (1 - p); dv used Pz, and
// dL/dP = dP * Z / (1 - p), while rowsum(dO * O) = Di stays the row term; d = Di - dlse).
// Where P is 1 (the row's probability sits on this key: the others sum below fp32's rounding),
// Di equals dL/dP in exact arithmetic and dS is P * dlse = dl, but the rounded out that Di reads
// (out = v / (1 - p) in bf16 / fp16) leaves their difference at out's rounding, which reached
// dq and dk (a row that sees one key: the first of a causal call; thirty-ninth session). So
// there dS = dl, unless the product is not finite (a NaN / inf dout or v stays in dS).
template <typename acc_t>
void ds_dropout(const acc_t* p, const acc_t* pz, acc_t* ds, int64_t rows, int64_t cols,
                const acc_t* d, const acc_t* dl) {
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t* pr = p + r * cols;
    const acc_t* zr = pz + r * cols;
    acc_t* dr = ds + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const acc_t x = zr[c] * dr[c] - pr[c] * d[c];
      dr[c] = pr[c] == acc_t(1) && std::isfinite(x) ? dl[c] : x;
    }
  }
}

// The score terms' part of the backward of one (query block, key tile) pair:
//   terms():  the terms on the scores st (natural units), tanh(s / softcap) kept in th
//   grad():   after dS^T of the final scores: d rel_bias (into db), then the softcap chain
//             factor dS_raw = dS * (1 - th^2)
template <typename acc_t>
struct PairTerms {
  const ScoreTerms& t;
  const SeqInfo& sq;
  int64_t b, h, i0, nq, j0, nk, C;

  void terms(acc_t* st, acc_t* th) const {
    apply_score_terms<acc_t>(t, st, nk, C, nq, 1, b, h, i0 + sq.off - j0, th);  // as the forward
  }
  void grad(acc_t* ds, const acc_t* th, double* db) const {
    if (db != nullptr) {
      for (int64_t r = 0; r < nk; ++r) {
        t.rel_bias_grad_row<acc_t>(ds + r * C, static_cast<int>(nq), i0 + sq.off - (j0 + r), db);
      }
    }
    if (th != nullptr) {
      for (int64_t r = 0; r < nk; ++r) {
        acc_t* d = ds + r * C;
        const acc_t* x = th + r * C;
        for (int64_t c = 0; c < nq; ++c) d[c] *= acc_t(1) - x[c] * x[c];
      }
    }
  }
};

// The row term of rows whose keys all lie in this key tile, as the textbook's softmax
// backward forms it: Di = sum_j P_j dP_j over the tile (P with dropout's Z / (1 - p), as out
// has it), from the same dP that dS = P (dP - Di) subtracts it from. rowsum(dout * out) reads
// the stored, rounded out: where one key holds nearly all of a row's probability (a key and a
// sink, a large scale) 1 - P is small, dP - Di cancels, and out's rounding alone set dq and dk
// (8x the textbook's fp32 error, 25x in fp16 at Sq = Sk = 1 with sinks: a review's sweep). The
// two are taken as the same term, and the sum used, only where they agree within out's
// rounding and the sums' (tol), and never in a call with a block position (q_start / k_start):
// its out and lse may be a longer sequence's, the merged ones of ring attention (which passes
// a position to every block's backward), whose other keys can hold a share of a row's
// probability below any such tolerance and must still count. Returns the row terms minus dlse
// for pass 5: blk's, or `refined` (kBlockQ) where a row took the sum. NaN / inf sums keep blk's.
template <typename acc_t>
const acc_t* refined_row_terms(const Visibility& vis, const SeqInfo& sq, int64_t i0, int64_t nq,
                               int64_t j0, int64_t nk, int64_t C, const acc_t* pv,
                               const acc_t* dpt, const acc_t* blk, const QueryPackLayout& L,
                               acc_t* refined) {
  const acc_t* di = blk + L.di;
  if (vis.m.block) return di;
  // (the block first: a row's band starts and ends no earlier than the row before's, so none
  // lies in the tile where the last row's starts before it or the first row's ends past it)
  if (nq <= 0 || vis.band_keys(sq, i0 + nq - 1).lo < j0 || vis.band_keys(sq, i0).hi > j0 + nk)
    return di;
  const double u_acc = std::numeric_limits<acc_t>::epsilon() / 2;
  bool any = false;
  for (int64_t c = 0; c < nq; ++c) {
    const Range band = vis.band_keys(sq, i0 + c);
    if (band.lo >= band.hi || band.lo < j0 || band.hi > j0 + nk) continue;
    acc_t sum = 0, mag = 0;
    for (int64_t r = band.lo - j0; r < band.hi - j0; ++r) {
      const acc_t x = pv[r * C + c] * dpt[r * C + c];
      sum += x;
      mag += std::abs(x);
    }
    const double a = static_cast<double>(blk[L.da + c]);
    const double lse = std::abs(static_cast<double>(blk[L.lse + c]));
    const double packed = static_cast<double>(di[c]) + static_cast<double>(blk[L.dl + c]);
    const double tol =
        L.out_u * a + (4 * std::sqrt(static_cast<double>(L.Dv_ + nk)) + 4 + 2 * lse) * u_acc *
                          (a + static_cast<double>(mag));
    if (!(std::abs(static_cast<double>(sum) - packed) <= tol)) continue;
    if (!any) std::copy(di, di + C, refined);
    any = true;
    refined[c] = sum - blk[L.dl + c];
  }
  return any ? refined : di;
}

// One (query block [i0, i0 + nq) of one head, key tile [j0, j0 + nk)) pair:
//
//   pass 1: st (nk, C) = kb qt               scores, transposed
//   pass 2: st = exp(st - lse)               probabilities P^T (0 where hidden)
//   pass 3: dvt (nk, Dvp) += st dor          (when acc.dvt)
//   pass 4: dpt (nk, C) = vb dot             dP^T
//   pass 5: dpt = st * (dpt - Di)            dS^T (0 where hidden)
//   pass 6: dkt (nk, Dp) += dpt qr           (when acc.dkt)
//   pass 7: dqt (nq, Dp) += dpt^T kb         (when dqt)
//
// (kb's rows are s.ldk apart, qr's and dqt's L.ldq, dor's L.ldo: padded_ld, QueryPackLayout.)
// The tile is classified by the visibility layer: full tiles run the dense products; partial
// tiles skip their hidden parts in 6-key / 6-query steps and mask what is left.
//
// Score terms (common/attention_mask.h): after pass 1 the terms are added (softcap keeps
// tanh in s.th); with dropout, pass 3 uses P * Z / (1 - p) (s.pz, the forward's keep bits) and
// pass 5 dS = Pz * dP - P * Di; after pass 5 d rel_bias is accumulated and the softcap chain
// factor applied (PairTerms).
template <typename acc_t>
void bwd_pair(const AttentionParams& p, const Visibility& vis, const SeqInfo& sq, int64_t b,
              int64_t h, int64_t i0, int64_t nq, int64_t j0, int64_t nk, int64_t n_valid,
              bool k_finite, bool decode_order, bool decode_dp, const uint16_t* kbf,
              const uint16_t* vbf, const QueryPackLayout& L,
              const acc_t* blk, const uint64_t* rk,
              const KeyAcc<acc_t>& acc, acc_t* dqt, const mk::Kernels<acc_t>& K,
              BwdScratch<acc_t>& s) {
  const int64_t D = p.D, Dv = p.Dv, Dp = s.Dp, Dvp = s.Dvp;
  // (ldkb: the k rows'; ldq: q's rows' and dqt's (s.ldq is L.ldq); ldk / ldv below: the dk /
  // dv accumulators')
  const int64_t ldkb = s.ldk, ldq = L.ldq, ldo = L.ldo;
  const ScoreTerms terms = p.score_terms();
  const bool with_terms = terms.active(), dropout = terms.has_dropout();
  acc_t* const th = terms.softcap > 0.0 ? s.th.data() : nullptr;
  const uint32_t thresh = dropout::threshold(terms.dropout_p);
  const acc_t inv_keep = static_cast<acc_t>(1.0 / (1.0 - terms.dropout_p));
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  TileKind kind = vis.classify(sq, i0, i0 + nq, j0, j0 + nk);
  if (kind == TileKind::kInvisible || n_valid == 0) return;
  if (n_valid < nk) kind = TileKind::kPartial;
  const int64_t C = round_up(nq, 8);
  const acc_t *qt = blk + L.qt, *qr = blk + L.qr, *dot = blk + L.dot, *dor = blk + L.dor;
  acc_t* const dkt = acc.dkt;
  acc_t* const dvt = acc.dvt;
  const int64_t ldk = acc.ldk, ldv = acc.ldv;
  const PairTerms<acc_t> pt{terms, sq, b, h, i0, nq, j0, nk, C};
  // pass 2's P = exp(s - lse): where the scores come from tiles, the tile path's exp
  // (mk::exp_sub_amx), else the kernels' own
  auto exp_sub = [&](acc_t* st, int64_t rows, int64_t cols, const acc_t* sub) {
    if constexpr (std::is_same_v<acc_t, float>) {
      if ((kbf != nullptr || L.split) && L.amx) return mk::exp_sub_amx(st, rows, cols, sub);
    }
    K.exp_sub(st, rows, cols, sub);
  };
  // P^T with dropout applied (what pass 3 multiplies dout by)
  const acc_t* pv = dropout ? s.pz.data() : s.st.data();
  // pass 1 where the forward was the decode kernel: its scores function (its summation
  // order), all of the tile (partial tiles are masked after)
  auto pass1_decode = [&] {
#if ATTN_EXT_HAVE_AVX2_PATH
    if constexpr (std::is_same_v<acc_t, float>) {
      const int64_t nk8 = round_up(nk, 8);
      if (s.decode_tiles) {
        // bf16 on AMX tiles: the forward's chains (mk::decode_scores_amx) by scores_amx on k's
        // rows in place (kbf: the tiles imply bf16dp) and q's pairs, straight into st
        mk::scores_amx(nk, nq, D, kbf, p.k_row_stride,
                       reinterpret_cast<const uint32_t*>(blk + L.qp), kBlockQ,
                       static_cast<float>(terms.scale), s.st.data(), C);
        for (int64_t r = 0; r < nk; ++r)
          std::fill(s.st.data() + r * C + nq, s.st.data() + (r + 1) * C, acc_t(0));
        return;
      }
#if ATTN_EXT_HAVE_BF16DP_PATH
      if (decode_dp) {
        // bf16 with AVX512_BF16: the forward's dp_scores, q and k read where they are
        const auto* qh = static_cast<const c10::BFloat16*>(p.q) + b * p.q_batch_stride +
                         h * p.q_head_stride + (sq.q0 + i0) * p.q_row_stride;
        const auto* kh = static_cast<const c10::BFloat16*>(p.k) + b * p.k_batch_stride +
                         (h / (p.H / p.Hkv)) * p.k_head_stride + (sq.k0 + j0) * p.k_row_stride;
        decode_detail::dp_scores(qh, p.q_row_stride, nq, kh, p.k_row_stride, nk, D,
                                 static_cast<float>(terms.scale), s.sc.data(), kBlockK,
                                 s.dp_tile16);
      } else
#endif
      {
        const acc_t* kd = s.kdo.empty() ? s.kbp : s.kdo.data();  // bf16: load_key_tile's copy
        decode_detail::scores(blk + L.qs, nq, Dp, kd, nk8, s.sc.data(), kBlockK, -1, false,
                              s.decode_wide);
      }
      for (int64_t r = 0; r < nk; ++r) {
        acc_t* row = s.st.data() + r * C;
        for (int64_t c = 0; c < nq; ++c) row[c] = s.sc[c * kBlockK + r];
        std::fill(row + nq, row + C, acc_t(0));
      }
    }
#endif
  };
  // pass 1 of the tiled forward's shapes, rows [r0, r0 + nr) x columns [c0, c0 + n) of st:
  // the fp32 gemm on the converted rows, or (kbf: bf16 with AVX512_BF16) scores_bf16dp on
  // k's bf16 rows in place, as the forward
  auto pass1_tiled = [&](int64_t r0, int64_t nr, int64_t c0, int64_t n) {
    if constexpr (std::is_same_v<acc_t, float>) {
      if (L.split) {  // fp16 on the tiles: the forward's split products (scores_amx_split)
        const auto* qp = reinterpret_cast<const uint32_t*>(blk + L.qp);
        const auto* qp_lo = reinterpret_cast<const uint32_t*>(blk + L.qp_lo());
        mk::scores_amx_split(nr, n, D, s.khi.data() + r0 * D, s.klo.data() + r0 * D, D, qp + c0,
                             qp_lo + c0, kBlockQ, static_cast<float>(terms.scale),
                             s.st.data() + r0 * C + c0, C);
        return;
      }
      if (kbf != nullptr) {
        mk::scores_pairs(L.amx, nr, n, D, kbf + r0 * p.k_row_stride, p.k_row_stride,
                         reinterpret_cast<const uint32_t*>(blk + L.qp) + c0, kBlockQ,
                         static_cast<float>(terms.scale), s.st.data() + r0 * C + c0, C);
        return;
      }
    }
    K.gemm(nr, n, D, s.kbp + r0 * ldkb, ldkb, 1, qt + c0, kBlockQ, s.st.data() + r0 * C + c0, C,
           false);
  };
  // pass 4 likewise: dpt = v dout^T, or (vbf) scores_bf16dp on v's bf16 rows in place and
  // dout's pairs (Di was taken in the same chains: pack_query_block)
  auto pass4_tiled = [&](int64_t r0, int64_t nr, int64_t c0, int64_t n) {
    if constexpr (std::is_same_v<acc_t, float>) {
      if (L.split && L.amx_dp) {
        const auto* dp = reinterpret_cast<const uint32_t*>(blk + L.dp);
        const auto* dp_lo = reinterpret_cast<const uint32_t*>(blk + L.dp_lo());
        mk::scores_amx_split(nr, n, Dv, s.vhi.data() + r0 * Dv, s.vlo.data() + r0 * Dv, Dv,
                             dp + c0, dp_lo + c0, kBlockQ, 1.f, s.dpt.data() + r0 * C + c0, C);
        return;
      }
      if (vbf != nullptr) {
        mk::scores_pairs(L.amx_dp, nr, n, Dv, vbf + r0 * p.v_row_stride, p.v_row_stride,
                         reinterpret_cast<const uint32_t*>(blk + L.dp) + c0, kBlockQ, 1.f,
                         s.dpt.data() + r0 * C + c0, C);
        return;
      }
    }
    K.gemm(nr, n, Dv, s.vbp + r0 * Dvp, Dvp, 1, dot + c0, kBlockQ, s.dpt.data() + r0 * C + c0, C,
           false);
  };
  alignas(64) acc_t di_refined[kBlockQ];
  auto pass5 = [&] {
    // Di = rowsum(dout * out) - dlse from the pack, not sum_j P_j dP_j over this call's keys:
    // out and lse may be those of a longer sequence (ring attention passes the merged ones),
    // and then only rowsum(dout * out) is the row term; except where refined_row_terms finds
    // the two equal up to out's rounding.
    const acc_t* di = refined_row_terms<acc_t>(vis, sq, i0, nq, j0, nk, C, pv, s.dpt.data(), blk,
                                               L, di_refined);
    if (dropout) {
      ds_dropout(s.st.data(), s.pz.data(), s.dpt.data(), nk, C, di, blk + L.dl);
    } else {
      K.ds(s.st.data(), s.dpt.data(), nk, C, di);
    }
  };
  // pass 3: dvt rows [r0, r0 + nr) += P^T dout over queries [c0, c0 + n); on AMX tiles (bf16,
  // L.amx_dv) the whole tile, P rounded to bf16 (as the forward's o += p v); fp16 (L.split): P
  // and dout split into hi + lo, hi hi + hi lo + lo hi
  // the tiles' B operands of passes 3 and 6: dout's and q's row pairs (then their lo pairs,
  // kBlockQ / 2 pair rows on); the non-finite block's copies below
  const uint32_t* dn = reinterpret_cast<const uint32_t*>(blk + L.dn);
  const uint32_t* qn = reinterpret_cast<const uint32_t*>(blk + L.qn);
  const int64_t dn_lo = L.dn_lo() - L.dn, qn_lo = L.qn_lo() - L.qn;  // (words past the hi pairs)
  auto pass3 = [&](int64_t r0, int64_t nr, int64_t c0, int64_t n) {
    if constexpr (std::is_same_v<acc_t, float>) {
      if (L.amx_dv && L.split) {
        mk::rows_times_pairs_amx_split(nk, Dv, nq, pv, C, dn, dn + dn_lo, Dv, dvt, ldv);
        return;
      }
      if (L.amx_dv) {
        mk::rows_times_pairs_amx(nk, Dv, nq, pv, C, dn, Dv, dvt, ldv);
        return;
      }
    }
    K.gemm(nr, Dvp, n, pv + r0 * C + c0, C, 1, dor + c0 * ldo, ldo, dvt + r0 * ldv, ldv, true);
  };
  // pass 6: dkt rows += dS^T q likewise (L.amx_dk: dS rounded to bf16; fp16: split)
  auto pass6 = [&](int64_t r0, int64_t nr, int64_t c0, int64_t n) {
    if constexpr (std::is_same_v<acc_t, float>) {
      if (L.amx_dk && L.split) {
        mk::rows_times_pairs_amx_split(nk, D, nq, s.dpt.data(), C, qn, qn + qn_lo, D, dkt, ldk);
        return;
      }
      if (L.amx_dk) {
        mk::rows_times_pairs_amx(nk, D, nq, s.dpt.data(), C, qn, D, dkt, ldk);
        return;
      }
    }
    K.gemm(nr, Dp, n, s.dpt.data() + r0 * C + c0, C, 1, qr + c0 * ldq, ldq, dkt + r0 * ldk, ldk,
           true);
  };
  // pass 7 on the whole tile: dqt += dS k, or (L.amx_dq()) dq^T += k^T dS^T on AMX tiles, dS
  // rounded to bf16 (fp16: dS and k split) (the job's accumulator transposed, (D, kBlockQ))
  // (kpt: k^T's hi pairs, s.kpt or a copy with k's inf / NaN entries as 0)
  auto pass7_tile = [&](const uint32_t* kpt) {
    if constexpr (std::is_same_v<acc_t, float>) {
      if (L.amx_dq()) {
        const int64_t rows = round_up(nk, 32), C16 = round_up(nq, 16);
        if (L.split) {
          mk::probs_to_pairs_split(s.dpt.data(), C, 0, nk, rows, nq, s.dsp.data(),
                                   s.dsp_lo.data(), C16);
          mk::pv_amx_split(D, C16, rows / 2, kpt, s.kpt_lo.data(),
                           BwdScratch<acc_t>::kKeyPairs, s.dsp.data(), s.dsp_lo.data(), dqt,
                           kBlockQ);
          return;
        }
        mk::probs_to_pairs(s.dpt.data(), C, 0, nk, rows, nq, s.dsp.data(), C16);
        mk::pv_amx(D, C16, rows / 2, kpt, BwdScratch<acc_t>::kKeyPairs, s.dsp.data(), dqt,
                   kBlockQ);
        return;
      }
    }
    K.gemm(nq, Dp, nk, s.dpt.data(), 1, C, s.kbp, ldkb, dqt, ldq, true);
  };
  if (kind == TileKind::kFull) {
    // Every (key, query) pair of the tile is visible.
    if (decode_order) {
      pass1_decode();                                                                 // pass 1
    } else {
      pass1_tiled(0, nk, 0, C);                                                       // pass 1
    }
    if (with_terms) pt.terms(s.st.data(), th);
    exp_sub(s.st.data(), nk, C, blk + L.lse);                       // pass 2
    if (dropout) {
      dropout_tile(s.st.data(), s.pz.data(), nk, C, nq, terms.dropout_col(j0), rk,
                   s.words.data(), thresh, inv_keep);
    }
    if (dvt != nullptr) pass3(0, nk, 0, nq);                                          // pass 3
    pass4_tiled(0, nk, 0, C);                                                         // pass 4
    pass5();                                                                          // pass 5
    if (with_terms) pt.grad(s.dpt.data(), th, acc.db);
    if (dkt != nullptr) pass6(0, nk, 0, nq);                                          // pass 6
    if (dqt != nullptr) pass7_tile(s.kpt.data());                                     // pass 7
    return;
  }
  // Partial tile: key j0 + r is seen by the columns [cols(r).lo, cols(r).hi) (band) if it is
  // not padded. The hidden parts are skipped in 6-key / 6-query steps (pass 1, 3, 4, 6, 7);
  // what pass 1 / 4 leave uncomputed is masked (-inf / 0) before the element-wise passes, and
  // dS is 0 at every hidden pair.
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
  // passes 3 and 6 on AMX tiles over the whole tile of a partial pair: P (exp(-inf - lse) at
  // the hidden pairs, NaN where a row's lse is not finite) set to exactly 0 there first; dS is
  // 0 there already. q and dout must be finite (the products read no k).
  auto dv_dk_tiles = [&](bool dv, bool dk) {
    if (dv) {
      mask(const_cast<acc_t*>(pv), acc_t(0));
      pass3(0, nk, 0, nq);
    }
    if (dk) pass6(0, nk, 0, nq);
  };
  // f(r0, nr, c0, n) for the column panels [c0, c0 + n) some of each 6 rows [r0, r0 + nr)
  // see (the rest is masked after)
  auto for_panels = [&](auto&& f) {
    for (int64_t r0 = 0; r0 < nk; r0 += 6) {
      const int64_t nr = std::min<int64_t>(6, nk - r0);
      const Range pc = panel(r0, nr);
      const int64_t c8 = pc.lo / 8 * 8, ce = std::min(C, round_up(pc.hi, 8));
      if (c8 < ce) f(r0, nr, c8, ce - c8);
    }
  };
  // pass 1: st = kb qt on the visible column panels, then mask
  if (decode_order) {
    pass1_decode();
  } else if ((kbf != nullptr || L.split) && L.amx) {
    pass1_tiled(0, nk, 0, C);  // (tiles: the whole tile, the mask hides the rest)
  } else {
    for_panels(pass1_tiled);
  }
  if (with_terms) pt.terms(s.st.data(), th);
  mask(s.st.data(), neg_inf);
  // pass 2: P^T (0 where hidden). A row whose lse is not finite (it sees an inf / NaN score)
  // gets exp(-inf - lse) = NaN at its hidden pairs too: those are set to exactly 0, so that the
  // row reaches no dv of a key it cannot see (pass 3 reads P over band panels, padded keys
  // included)
  exp_sub(s.st.data(), nk, C, blk + L.lse);
  if (!std::all_of(blk + L.lse, blk + L.lse + nq, [](acc_t x) { return std::isfinite(x); }))
    mask(s.st.data(), acc_t(0));
  if (dropout) {
    dropout_tile(s.st.data(), s.pz.data(), nk, C, nq, terms.dropout_col(j0), rk,
                 s.words.data(), thresh, inv_keep);
  }
  // pass 4: dP^T = v dout^T on the visible column panels, then 0 where hidden
  if ((vbf != nullptr || L.split) && L.amx_dp) {
    pass4_tiled(0, nk, 0, C);
  } else {
    for_panels(pass4_tiled);
  }
  mask(s.dpt.data(), acc_t(0));
  // pass 5: dS^T = P^T * (dP^T - Di), then exactly 0 where hidden (Di may be non-finite)
  pass5();
  mask(s.dpt.data(), acc_t(0));
  if (with_terms) {
    pt.grad(s.dpt.data(), th, acc.db);
    if (th != nullptr) mask(s.dpt.data(), acc_t(0));  // th is not defined where hidden
  }
  if (!(k_finite && blk[L.fin] != acc_t(0))) {
    // A non-finite k, q or dout: 0 (hidden pair) times it must not reach dk, dv or dq of the
    // other side, so the products of pass 3, 6, 7 run over visible pairs only. Each sum keeps
    // the gemms' order and rounding (the AVX2 gemm: one FMA chain from zero over the tile's
    // queries, or keys, added to the accumulator; a hidden pair adds exactly nothing), so a
    // visible pair's gradients get the bits they get when the hidden values are finite.
    static_assert(kBlockK <= mk::kGemmKSplit && kBlockQ <= mk::kGemmKSplit,
                  "a tile's products are one chain");
    // (Each chain in s.tmp from zero, then added: mk::kGemmKBlock.)
    const bool fused = mk::gemm_fuses(K);
    acc_t* chain = s.tmp.data();
    Range seen_by[kBlockK];  // the columns that see key r
    for (int64_t r = 0; r < nk; ++r) seen_by[r] = cols(r);
    // On AMX tiles, where q and dout are finite (only k is not), dv and dk run as in the dense
    // path: P and dS are 0 at the hidden pairs, and those products read no k.
    const bool qd_finite = blk[L.fin] != acc_t(0);
    // Where q or dout is not finite, dv and dk on the tiles too: the B operands in copies with
    // the rows that hold an inf / NaN (bad rows) as 0, so that every key gets from the other
    // rows the products (and bits) it gets when those values are finite; then each bad row's
    // visible pairs added on their own, as the per-pair path below takes them.
    bool bad_rows = false;
    uint8_t bad[kBlockQ] = {};
    if (!qd_finite && ((dvt != nullptr && L.amx_dv) || (dkt != nullptr && L.amx_dk))) {
      bad_rows = true;
      for (int64_t cc = 0; cc < nq; ++cc) {
        bad[cc] = !(all_finite(qr + cc * ldq, 1, D, D) && all_finite(dor + cc * ldo, 1, Dv, Dv));
      }
      // row pairs (cols words a pair row; where split, the lo ones `lo` words on), the bad
      // rows' halves (row 2 t: the low 16 bits) as 0
      auto zeroed = [&](const uint32_t* src, int64_t cols, int64_t lo, AlignedVec<uint32_t>& dst) {
        const int64_t parts = L.split ? 2 : 1, words = lo;
        if (dst.size() < static_cast<size_t>(parts * words)) dst.resize(static_cast<size_t>(parts * words));
        std::copy(src, src + parts * words, dst.data());
        for (int64_t cc = 0; cc < nq; ++cc) {
          if (!bad[cc]) continue;
          const uint32_t keep = cc % 2 == 0 ? 0xFFFF0000u : 0x0000FFFFu;
          for (int64_t x = 0; x < parts; ++x) {
            uint32_t* row = dst.data() + x * words + cc / 2 * cols;
            for (int64_t d = 0; d < cols; ++d) row[d] &= keep;
          }
        }
        return dst.data();
      };
      if (dvt != nullptr && L.amx_dv) dn = zeroed(dn, Dv, dn_lo, s.dn_z);
      if (dkt != nullptr && L.amx_dk) qn = zeroed(qn, D, qn_lo, s.qn_z);
    }
    const bool dv_tiles = dvt != nullptr && L.amx_dv && (qd_finite || bad_rows);
    const bool dk_tiles = dkt != nullptr && L.amx_dk && (qd_finite || bad_rows);
    dv_dk_tiles(dv_tiles, dk_tiles);
    for (int64_t r = 0; r < nk && bad_rows; ++r) {
      const Range c = seen_by[r];
      for (int64_t cc = c.lo; cc < c.hi; ++cc) {
        if (!bad[cc]) continue;
        if (dv_tiles) mk::axpy_as_gemm(dvt + r * ldv, pv[r * C + cc], dor + cc * ldo, Dv, fused);
        if (dk_tiles) mk::axpy_as_gemm(dkt + r * ldk, s.dpt[r * C + cc], qr + cc * ldq, D, fused);
      }
    }
    for (int64_t r = 0; r < nk && ((dvt != nullptr && !dv_tiles) || (dkt != nullptr && !dk_tiles));
         ++r) {
      const Range c = seen_by[r];
      if (c.lo >= c.hi) continue;
      if (dvt != nullptr && !dv_tiles) {
        std::fill(chain, chain + Dv, acc_t(0));
        for (int64_t cc = c.lo; cc < c.hi; ++cc)
          mk::axpy_as_gemm(chain, pv[r * C + cc], dor + cc * ldo, Dv, fused);
        mk::add_chain(dvt + r * ldv, chain, Dv);
      }
      if (dkt != nullptr && !dk_tiles) {
        std::fill(chain, chain + D, acc_t(0));
        for (int64_t cc = c.lo; cc < c.hi; ++cc)
          mk::axpy_as_gemm(chain, s.dpt[r * C + cc], qr + cc * ldq, D, fused);
        mk::add_chain(dkt + r * ldk, chain, D);
      }
    }
    if constexpr (std::is_same_v<acc_t, float>) {
      if (dqt != nullptr && L.amx_dq()) {
        // on tiles as the dense path (dS is 0 at the hidden pairs), k's inf / NaN entries taken
        // as 0 there (in a copy: the other blocks of this visit read s.kpt as it is) and each
        // added on its own to the rows that see its key (lo is 0 where k is not finite)
        const uint32_t* kpt = s.kpt.data();
        if (!k_finite) {
          const int64_t kp = round_up(nk, 32) / 2, ldk2 = BwdScratch<acc_t>::kKeyPairs;
          if (s.kpt_z.size() < s.kpt.size()) s.kpt_z.resize(s.kpt.size());
          mk::zero_nonfinite_pairs(s.kpt.data(), D, kp, ldk2, s.kpt_z.data(), ldk2);
          kpt = s.kpt_z.data();
        }
        pass7_tile(kpt);
        for (int64_t r = 0; r < nk && !k_finite; ++r) {
          const Range c = seen_by[r];
          for (int64_t d = 0; d < D; ++d) {
            const acc_t x = s.kbp[r * ldkb + d];
            if (std::isfinite(x)) continue;
            for (int64_t cc = c.lo; cc < c.hi; ++cc) dqt[d * kBlockQ + cc] += s.dpt[r * C + cc] * x;
          }
        }
        return;
      }
    }
    for (int64_t cc = 0; cc < nq && dqt != nullptr; ++cc) {
      std::fill(chain, chain + D, acc_t(0));
      for (int64_t r = 0; r < nk; ++r) {
        if (cc >= seen_by[r].lo && cc < seen_by[r].hi)
          mk::axpy_as_gemm(chain, s.dpt[r * C + cc], s.kbp + r * ldkb, D, fused);
      }
      mk::add_chain(dqt + cc * ldq, chain, D);
    }
    return;
  }
  dv_dk_tiles(dvt != nullptr && L.amx_dv, dkt != nullptr && L.amx_dk);
  for (int64_t r0 = 0; r0 < nk && ((dvt != nullptr && !L.amx_dv) || (dkt != nullptr && !L.amx_dk));
       r0 += 6) {
    const int64_t nr = std::min<int64_t>(6, nk - r0);
    const Range pc = panel(r0, nr);
    if (pc.lo >= pc.hi) continue;
    // pass 3: dvt += P^T dout over the queries that see each 6 keys
    if (dvt != nullptr && !L.amx_dv) pass3(r0, nr, pc.lo, pc.hi - pc.lo);
    // pass 6: dkt += dS^T q over the queries that see each 6 keys
    if (dkt != nullptr && !L.amx_dk) pass6(r0, nr, pc.lo, pc.hi - pc.lo);
  }
  // pass 7: dqt rows += dS k over the keys each 6 queries see (tiles: the whole tile, dS is 0 at
  // the hidden pairs)
  if (dqt != nullptr && L.amx_dq()) pass7_tile(s.kpt.data());
  for (int64_t c0 = 0; c0 < nq && dqt != nullptr && !L.amx_dq(); c0 += 6) {
    const int64_t mrows = std::min<int64_t>(6, nq - c0);
    const Range keys = vis.band_keys_of_rows(sq, i0 + c0, i0 + c0 + mrows);
    const int64_t klo = std::clamp<int64_t>(keys.lo - j0, 0, nk);
    const int64_t khi = std::clamp<int64_t>(keys.hi - j0, 0, nk);
    if (khi > klo) {
      K.gemm(mrows, Dp, khi - klo, s.dpt.data() + klo * C + c0, 1, C, s.kbp + klo * ldkb, ldkb,
             dqt + c0 * ldq, ldq, true);
    }
  }
}

// dq rows [i0, i0 + nq) of head h of sequence b = scale * dqt.
template <typename scalar_t, typename acc_t>
void write_dq(const AttentionBwdParams& bp, const SeqInfo& sq, int64_t b, int64_t h, int64_t i0,
              int64_t nq, const acc_t* dqt, int64_t ldq, bool transposed) {
  const AttentionParams& p = bp.fwd;
  auto* dq = static_cast<scalar_t*>(bp.dq);
  const acc_t scale = static_cast<acc_t>(p.scale);
  std::vector<acc_t> row(transposed ? static_cast<size_t>(p.D) : 0);
  for (int64_t ii = 0; ii < nq; ++ii) {
    scalar_t* dst = dq + b * bp.dq_batch_stride + (sq.q0 + i0 + ii) * bp.dq_row_stride +
                    h * bp.dq_head_stride;
    const acc_t* src = dqt + ii * ldq;
    if (transposed) {  // (D, kBlockQ): QueryPackLayout::amx_dq; the row gathered first
      for (int64_t d = 0; d < p.D; ++d) row[d] = dqt[d * kBlockQ + ii];
      src = row.data();
    }
    store_row(src, scale, p.D, dst);
  }
}

// dk rows [j_begin, j_end) (default: all) of kv head hkv of sequence b = scale * a's dk rows
// (a's first row is j_begin's); dv rows = a's dv rows when with_dv (else they were accumulated
// in dv itself).
template <typename scalar_t, typename acc_t>
void write_dkv(const AttentionBwdParams& bp, const SeqInfo& sq, int64_t b, int64_t hkv,
               const KeyAcc<acc_t>& a, bool with_dv, int64_t j_begin = 0, int64_t j_end = -1) {
  const AttentionParams& p = bp.fwd;
  auto* dk = static_cast<scalar_t*>(bp.dk);
  auto* dv = static_cast<scalar_t*>(bp.dv);
  const acc_t scale = static_cast<acc_t>(p.scale);
  if (j_end < 0) j_end = sq.Sk;
  for (int64_t j = j_begin; j < j_end; ++j) {
    scalar_t* dkr = dk + b * bp.dk_batch_stride + (sq.k0 + j) * bp.dk_row_stride +
                    hkv * bp.dk_head_stride;
    scalar_t* dvr = dv + b * bp.dv_batch_stride + (sq.k0 + j) * bp.dv_row_stride +
                    hkv * bp.dv_head_stride;
    const acc_t* ks = a.dkt + (j - j_begin) * a.ldk;
    const acc_t* vs = a.dvt + (j - j_begin) * a.ldv;
    store_row(ks, scale, p.D, dkr);
    if (with_dv) store_row(vs, acc_t(1), p.Dv, dvr);
  }
}

// The backward, parallel over work units that each own the gradients they write, so no
// gradient has per-worker copies and the result does not depend on scheduling:
//
//   fused (B * Hkv >= threads): a unit is one (batch, kv head). Its query blocks (each query
//     head of its GQA group, each block of rows) go kBwdJobs at a time: pack the blocks, visit
//     every key tile some of them see, each block that sees it in turn (passes 1-7),
//     accumulate dk / dv of the kv head in place and dq of each block in its tile, then write
//     the dq. Every gradient element is summed in one fixed order, the order of one block at a
//     time.
//   split (fewer (batch, kv head) pairs than threads, e.g. one long sequence of one head):
//     the FlashAttention-2 way. Phase 1, units (batch, kv head, chunk of key tiles): dk / dv
//     of the chunk (passes 1-6). Phase 2, units (batch, query head, query block): dq (passes
//     1, 2, 4, 5, 7, the probabilities recomputed). More arithmetic, but work for every thread.
//
// Extra memory: dk / dv accumulate in the outputs when those are the accumulation type with
// D, Dv multiples of 8; otherwise (bf16 / fp16, D % 8 != 0) in per-unit buffers of the
// accumulation type (fp32; fp64 for fp64), one per worker: a fused unit's (Sk, Dp + Dvp), a
// split unit's key chunk. In the fused partition that is min(threads, B * Hkv) units' rows,
// at most one padded copy of dk / dv in the accumulation type (the fp32 gradients a 16-bit
// dtype needs), reached only where every (batch, kv head) has its own worker. (Packed
// sequences size the rows by the max_seqlen_k given; only a sequence's own rows are
// touched.) Key-chunk buffers at every thread count would bound it by the tile, but the split
// partition recomputes P and dP for dq: 1.5-1.7x the backward's time at 2 threads, bf16 and
// fp32, (1, 8, 4096 / 8192, 128) and (1, 16, 2048, 64) (RESULTS.md, forty-first session).
// d rel_bias: per work unit and query head, the buckets of the unit's pairs, in doubles
// (DbSpan). Beyond that,
// kBwdJobs query blocks with their dq tiles and one key tile per worker (about 1.2 MiB at
// D = 128; fp16 on the tiles about 1.8 MiB, the pairs of hi and lo parts): independent of the
// thread count. In the fused partition, gradients whose rows lie
// apart (those of BSHD inputs: H * D apart, a page per row at 4 KiB, a few cache sets for a
// whole head) accumulate per work unit in a contiguous (Sk, Dp + Dvp) buffer instead, written
// out at the unit's end, where that fits the head-rows share (head_rows_budget: at most
// kHeadRowsTotalBytes over all workers).
template <typename scalar_t>
void attention_bwd_kernel(const AttentionBwdParams& bp) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const AttentionParams& p = bp.fwd;
  const mk::Kernels<acc_t> kern = mk::kernels<acc_t>();
  // whether the gemm forming dP multiplies and adds in one rounding (the AVX2 FMA kernel)
  const bool fused_dp = mk::gemm_fuses(kern);
  const int64_t Dp = round_up(p.D, 8), Dvp = round_up(p.Dv, 8);
  const int64_t group = p.H / p.Hkv;
  const int64_t n_qb = ceil_div(p.Sq, kBlockQ);
  const int64_t n_kb = ceil_div(p.Sk, kBlockK);
  const Visibility vis = p.visibility();
  // bf16 with AVX512_BF16: pass 1 by mk::scores_bf16dp, as the forward's (the one rule)
  // (every switch read once for the call: mk::TileRule)
  const mk::TileRule rule = mk::tile_rule();
  const bool bf16dp = rule.bf16_scores_by_pairs(std::is_same_v<scalar_t, c10::BFloat16>, p.D);
  // ... and pass 4, dP = dout v^T, whose operands are bf16 too (Dv even)
  const bool bf16dp4 = rule.bf16_scores_by_pairs(std::is_same_v<scalar_t, c10::BFloat16>, p.Dv);
  const ScoreTerms terms = p.score_terms();
  // The forward of these shapes was the decode kernel (attention_decode.h): the scores are
  // recomputed in its summation order, so that P = exp(s - lse) meets the forward's bits.
  const bool decode_order = decode_supported(p, std::is_same_v<acc_t, double>);
  // bf16 where the forward's scores were dp_scores (AVX512_BF16): those, from q and k in place
#if ATTN_EXT_HAVE_AVX2_PATH
  const bool decode_dp = decode_order && decode_detail::decode_scores_by_pairs<scalar_t>(rule, p.D);
  // bf16 where the forward's scores were on tiles (mk::decode_scores_amx): scores_amx on k in
  // place and q's pairs, the same chains
  const bool decode_tiles =
      decode_order && decode_detail::decode_scores_on_tiles<scalar_t>(rule, p.D);
#else
  const bool decode_dp = false, decode_tiles = false;
#endif
  const bool decode_pairs =
      decode_order && decode_detail::kDecodePairs<scalar_t> && !decode_dp && !decode_tiles;
  constexpr bool is_bf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  // fp16 where its tiled forward ran on the tiles (mk::fp16_on_tiles): every product split
  // (bf16 hi + lo; mk::scores_amx_split, pv_amx_split), pass 1 in the forward's own chains;
  // dP and Di on the tiles where Dv is a multiple of 32 (else widened, in the fp32 gemm's
  // chains)
  // (per unit (b, hkv), as the forward: half_qk_inf_units; the units on the tiles first, then
  // the widened ones, where they differ)
  int run_index = 0;  // (the second run adds its d rel_bias to the first's)
  run_fp16_units(p, vis, std::is_same_v<scalar_t, c10::Half> && !decode_order &&
                             rule.fp16_on_tiles(p.D, p.Dv),
                 [&](bool fp16_split, UnitFilter filter) {
    const bool split_dp = fp16_split && rule.amx_for(p.Dv);
    const bool rows_d = (is_bf16 || fp16_split) && rule.amx_pv_for(p.D);
    const bool rows_dv = (is_bf16 || fp16_split) && rule.amx_pv_for(p.Dv);
    QueryPackLayout L(p.D, p.Dv, Dp, Dvp, padded_ld(Dp, sizeof(acc_t)), padded_ld(Dvp, sizeof(acc_t)),
                      bf16dp || fp16_split, bf16dp4 || split_dp, rows_d, rows_dv, fp16_split);
    L.amx = (bf16dp || fp16_split) && rule.amx_for(p.D);
    L.amx_dp = (bf16dp4 || split_dp) && rule.amx_for(p.Dv);
    L.out_u = std::is_same_v<scalar_t, double>  ? 0x1p-53
              : std::is_same_v<scalar_t, float> ? 0x1p-24
              : std::is_same_v<scalar_t, c10::BFloat16> ? 0x1p-8
                                                        : 0x1p-11;
    // every product reads k and v as 16-bit rows or pairs (load_key_tile's rows16): pass 1 by
    // pairs or split, pass 4 likewise, pass 7 on the tiles, not the decode order
    const bool rows16 = !decode_order && (bf16dp || fp16_split) && (bf16dp4 || split_dp) &&
                        L.amx_dq();
    const int64_t rows_budget = head_rows_budget(num_threads());
#if ATTN_EXT_HAVE_AVX2_PATH
    // the decode kernel's switches, read once for the call (the forward read them once too)
    const bool decode_wide = decode_order && decode_detail::decode_scores512_enabled();
    const bool dp_tile16 = decode_detail::dp_tile16_enabled();
#else
    const bool decode_wide = false, dp_tile16 = true;
#endif
    auto make_scratch = [&] {
      BwdScratch<acc_t> s(p.D, p.Dv, L.size, terms, decode_order, decode_pairs, L.ldq);
      s.head_rows_budget = rows_budget;
      s.decode_wide = decode_wide;
      s.decode_tiles = decode_tiles;
      s.dp_tile16 = dp_tile16;
      if (L.amx_dq()) {  // pass 7 on tiles: k^T's and dS^T's pairs
        s.kpt.resize(static_cast<size_t>(p.D * BwdScratch<acc_t>::kKeyPairs));
        s.dsp.resize(static_cast<size_t>(BwdScratch<acc_t>::kKeyPairs * kBlockQ));
        if (fp16_split) {
          s.kpt_lo.resize(s.kpt.size());
          s.dsp_lo.resize(s.dsp.size());
        }
      }
      if (fp16_split) {
        s.khi.resize(static_cast<size_t>(kBlockK * p.D));
        s.klo.resize(s.khi.size());
        if (L.amx_dp) {
          s.vhi.resize(static_cast<size_t>(kBlockK * p.Dv));
          s.vlo.resize(s.vhi.size());
        }
        s.rhi.resize(static_cast<size_t>(kBlockQ * std::max(p.D, p.Dv)));
        s.rlo.resize(s.rhi.size());
      }
      return s;
    };

    // Rows from j0 of the dk / dv accumulators in a buffer laid out as (n, Dp) then (n, Dvp) (a
    // work unit's unit_kv).
    auto buffer_acc = [&](acc_t* base, int64_t n, int64_t j0) -> KeyAcc<acc_t> {
      return {base + j0 * Dp, Dp, base + n * Dp + j0 * Dvp, Dvp, nullptr};
    };
    // dk / dv accumulated in the outputs themselves (the accumulation type, D and Dv multiples
    // of 8), else in the units' buffers (unit_rows / chunk_rows below): rows j0 .. of (b, hkv)
    // in the outputs.
    const bool in_place = std::is_same_v<scalar_t, acc_t> && p.D == Dp && p.Dv == Dvp;
    auto key_acc = [&](int64_t b, int64_t hkv, const SeqInfo& sq, int64_t j0) -> KeyAcc<acc_t> {
      auto* dk = reinterpret_cast<acc_t*>(bp.dk);
      auto* dv = reinterpret_cast<acc_t*>(bp.dv);
      const int64_t j = sq.k0 + j0;
      return {dk + b * bp.dk_batch_stride + j * bp.dk_row_stride + hkv * bp.dk_head_stride,
              bp.dk_row_stride,
              dv + b * bp.dv_batch_stride + j * bp.dv_row_stride + hkv * bp.dv_head_stride,
              bp.dv_row_stride, nullptr};
    };

    // d rel_bias: each query block visit sums its pairs' dS into its own (2M + 1) row (in key
    // tile order), which is added to its work unit's partial row of its head (the unit's span of
    // buckets, DbSpan below) after the visit, in block order (fused units: (b, hkv); split phase
    // 1: (b, hkv, chunk)); the rows are reduced in unit order at the end. Deterministic for a
    // given thread count, and the same whichever blocks visit the key tiles together.
    const int64_t nbias = terms.rel_bias != nullptr ? 2 * terms.rel_max + 1 : 0;
    const int64_t workers = std::max<int64_t>(1, num_threads());
    const bool split = p.B * p.Hkv < workers && n_kb > 1;
    // The fused units' dk / dv in a per-unit buffer (the comment above attention_bwd_kernel):
    // every visit of the unit reads and writes all its key tiles' rows, which stay in L2 when
    // contiguous and are fetched again from L3 when a page apart (a D = 64 BSHD backward took
    // 1.07x the time of the same call on BHSD views; RESULTS.md, twentieth session). The same
    // additions in the same order: the same bits.
    // Where dk / dv are not the accumulation type with D, Dv multiples of 8 (bf16, fp16; fp32
    // at D % 8 != 0), the fused units always accumulate in such a buffer (the accumulation type),
    // one per worker: at most min(threads, B * Hkv) units' rows, never more than one fp32 buffer
    // for every (batch, kv head), which they used to take where the share below was exceeded
    // (its fresh pages cost 2-3 % of a bf16 backward at (1, 8, 4096, 128)). Gradients of the
    // accumulation type whose rows lie apart take the buffer where it fits the head-rows share,
    // else accumulate in place. The same additions in the same order, the same bits.
    const bool strided_fits = (bp.dk_row_stride != p.D || bp.dv_row_stride != p.Dv) &&
                              p.Sk * (Dp + Dvp) * static_cast<int64_t>(sizeof(acc_t)) <= rows_budget;
    const bool unit_rows = !split && (!in_place || strided_fits);
    const int64_t n_chunks = split ? std::min(n_kb, ceil_div(2 * workers, p.B * p.Hkv)) : 1;
    const int64_t per_chunk = ceil_div(n_kb, n_chunks);
    // ... and so do the split partition's phase-1 units (one kv head's chunk of keys, written by
    // that unit alone)
    const bool chunk_rows = split && !in_place;
    // The unit buffer (unit_rows / chunk_rows) of a unit owning keys [j0, j1): n rows per part
    // ((n, Dp) then (n, Dvp)), the unit's rows zeroed; written to dk / dv at the unit's end (dk
    // scaled, both converted).
    auto open_unit = [&](BwdScratch<acc_t>& s, int64_t j0, int64_t j1, int64_t n) {
      s.unit_j0 = j0;
      s.unit_n = n;
      if (s.unit_kv.size() < static_cast<size_t>(n * (Dp + Dvp)))
        s.unit_kv.resize(static_cast<size_t>(n * (Dp + Dvp)));
      std::fill(s.unit_kv.begin(), s.unit_kv.begin() + (j1 - j0) * Dp, acc_t(0));
      std::fill(s.unit_kv.begin() + n * Dp, s.unit_kv.begin() + n * Dp + (j1 - j0) * Dvp, acc_t(0));
    };
    auto close_unit = [&](BwdScratch<acc_t>& s, const SeqInfo& sq, int64_t b, int64_t hkv,
                          int64_t j0, int64_t j1) {
      write_dkv<scalar_t, acc_t>(bp, sq, b, hkv, buffer_acc(s.unit_kv.data(), s.unit_n, 0), true,
                                 j0, j1);
    };
    // The units' partial tables hold only the buckets their pairs reach (DbSpan): unit (b, hkv,
    // chunk c) pairs the rows of the query blocks that visit the chunk with the chunk's keys, so
    // bucket M + clamp(i + off - j, -M, M) lies between those of the extreme pairs. A chunk of
    // 96-key tiles and a few hundred rows reaches a few hundred of the 2M + 1 buckets: the tables
    // no longer take (2M + 1) doubles per head for each of the ~2 x threads chunks of the split
    // partition (86 MiB at 64 threads for M = 4095, 32 heads of one kv head, Sk = 4096: 43
    // chunks of one key tile). The same sums in the same order (the buckets left out held +0,
    // which added nothing).
    struct DbSpan {
      int64_t lo = 0, n = 0;  // buckets [lo, lo + n), per query head n apart
      size_t at = 0;          // the first head's row in db_parts
    };
    std::vector<DbSpan> db_span(static_cast<size_t>(nbias > 0 ? p.B * n_chunks : 0));
    size_t db_total = 0;
    for (int64_t b = 0; b < p.B && nbias > 0; ++b) {
      const SeqInfo sq = vis.seq(b);
      for (int64_t c = 0; c < n_chunks; ++c) {
        DbSpan& sp = db_span[static_cast<size_t>(b * n_chunks + c)];
        sp.at = db_total;
        // the chunk's keys [j0, j1) (phase 1's) and the rows [i_lo, i_hi) of the query blocks
        // that visit it (phase 1: from the block holding the band's first row to the one holding
        // its last; fused units: every block, every key)
        const int64_t kt0 = c * per_chunk, kt1 = std::min(n_kb, kt0 + per_chunk);
        const int64_t j0 = kt0 * kBlockK, j1 = std::min(sq.Sk, kt1 * kBlockK);
        const Range rows = split ? vis.band_rows_of_keys(sq, j0, j1) : Range{0, sq.Sq};
        if (j0 >= j1 || rows.lo >= rows.hi) continue;
        const int64_t i_lo = rows.lo / kBlockQ * kBlockQ;
        const int64_t i_hi = std::min(sq.Sq, ceil_div(rows.hi, kBlockQ) * kBlockQ);
        const int64_t M = terms.rel_max;
        auto bucket = [&](int64_t d) { return M + std::clamp<int64_t>(d, -M, M); };
        sp.lo = bucket(i_lo + sq.off - (j1 - 1));
        sp.n = bucket(i_hi - 1 + sq.off - j0) - sp.lo + 1;
        db_total += static_cast<size_t>(p.H * sp.n);
      }
    }
    std::vector<double> db_parts(db_total, 0.0);
    // partial row of query head h in the unit (b, hkv, chunk c), and its span
    auto db_row = [&](int64_t b, int64_t h, int64_t c) -> double* {
      if (nbias == 0) return nullptr;
      const DbSpan& sp = db_span[static_cast<size_t>(b * n_chunks + c)];
      return db_parts.data() + sp.at + h * sp.n;
    };

    // Packs query block (h, i0) into job j of the scratch (its dq tile zeroed, its dropout row
    // keys set).
    using Job = typename BwdScratch<acc_t>::Job;
    // (db_chunk: the unit's chunk for d rel_bias (0 in fused units), or -1 for none)
    auto start_job = [&](BwdScratch<acc_t>& s, int j, const SeqInfo& sq, int64_t b, int64_t h,
                         int64_t i0, int64_t db_chunk) -> Job& {
      double* db = db_chunk >= 0 ? db_row(b, h, db_chunk) : nullptr;
      Job& job = s.job(j);
      job.h = h;
      job.i0 = i0;
      job.nq = std::min(kBlockQ, sq.Sq - i0);
      job.db = db;
      if (db != nullptr) {
        job.dbj.assign(static_cast<size_t>(nbias), 0.0);
        const DbSpan& sp = db_span[static_cast<size_t>(b * n_chunks + db_chunk)];
        job.db_lo = sp.lo;
        job.db_n = sp.n;
      }
      pack_query_block<scalar_t, acc_t>(bp, L, sq, b, h, i0, job.nq, job.blk.data(), s.tmp.data(),
                                        fused_dp, decode_order, s.rhi.data(), s.rlo.data());
      std::fill(job.dqt.begin(), job.dqt.begin() + (L.amx_dq() ? p.D * kBlockQ : job.nq * s.ldq), acc_t(0));
      if (terms.has_dropout()) {
        for (int64_t c = 0; c < job.nq; ++c) job.rk[c] = terms.dropout_row_key(b, h, i0 + c);
      }
      return job;
    };

    // Visits key tiles [kt0, kt1) for jobs [0, n_jobs) of the scratch (packed query blocks of
    // heads of kv head hkv): each key tile some of them see is loaded once, and the jobs that see
    // it take it in job order, so every dk / dv element receives the blocks' terms in the order
    // one block after another would give, and each block's dq its key tiles in order.
    auto visit = [&](BwdScratch<acc_t>& s, int n_jobs, const SeqInfo& sq, int64_t b, int64_t hkv,
                     int64_t kt0, int64_t kt1, bool want_kv, bool want_dq) {
      Range tiles[kBwdJobs];
      int64_t lo = kt1, hi = kt0;
      for (int j = 0; j < n_jobs; ++j) {
        const Job& job = s.jobs[j];
        const Range keys = vis.band_keys_of_rows(sq, job.i0, job.i0 + job.nq);
        tiles[j] = {std::max(kt0, keys.lo / kBlockK), std::min(kt1, ceil_div(keys.hi, kBlockK))};
        lo = std::min(lo, tiles[j].lo);
        hi = std::max(hi, tiles[j].hi);
      }
      for (int64_t kt = lo; kt < hi; ++kt) {
        const int64_t j0 = kt * kBlockK;
        const int64_t nk = std::min(kBlockK, sq.Sk - j0);
        if (nk <= 0) break;
        bool sees[kBwdJobs] = {};
        bool any = false;
        for (int j = 0; j < n_jobs; ++j) {
          const Job& job = s.jobs[j];
          sees[j] = kt >= tiles[j].lo && kt < tiles[j].hi &&
                    vis.classify(sq, job.i0, job.i0 + job.nq, j0, j0 + nk) != TileKind::kInvisible;
          any = any || sees[j];
        }
        if (!any) continue;
        bool k_finite = true;
        const int64_t n_valid =
            load_key_tile<scalar_t, acc_t>(p, vis, sq, b, hkv, j0, nk, s, &k_finite, rows16);
        const uint16_t* kbf = bf16dp ? reinterpret_cast<const uint16_t*>(
                                           static_cast<const scalar_t*>(p.k) + b * p.k_batch_stride +
                                           hkv * p.k_head_stride + (sq.k0 + j0) * p.k_row_stride)
                                     : nullptr;
        const uint16_t* vbf = bf16dp4 ? reinterpret_cast<const uint16_t*>(
                                            static_cast<const scalar_t*>(p.v) + b * p.v_batch_stride +
                                            hkv * p.v_head_stride + (sq.k0 + j0) * p.v_row_stride)
                                      : nullptr;
        if (fp16_split) {  // the key tile's k (and v) rows split (mk::split_fp16), k^T's hi / lo pairs
          const auto* kt16 = reinterpret_cast<const uint16_t*>(
              static_cast<const scalar_t*>(p.k) + b * p.k_batch_stride + hkv * p.k_head_stride +
              (sq.k0 + j0) * p.k_row_stride);
          mk::split_fp16_rows(kt16, p.k_row_stride, nk, p.D, s.khi.data(), s.klo.data(), p.D);
          if (L.amx_dp) {
            mk::split_fp16_rows(reinterpret_cast<const uint16_t*>(
                                    static_cast<const scalar_t*>(p.v) + b * p.v_batch_stride +
                                    hkv * p.v_head_stride + (sq.k0 + j0) * p.v_row_stride),
                                p.v_row_stride, nk, p.Dv, s.vhi.data(), s.vlo.data(), p.Dv);
          }
          if (want_dq && L.amx_dq()) {
            bool fin = true;
            mk::pack_vt_pairs(s.khi.data(), p.D, nk, p.D, s.kpt.data(), BwdScratch<acc_t>::kKeyPairs,
                              &fin);
            mk::pack_vt_pairs(s.klo.data(), p.D, nk, p.D, s.kpt_lo.data(),
                              BwdScratch<acc_t>::kKeyPairs, &fin);
          }
        } else if (want_dq && L.amx_dq()) {  // k^T's pairs for pass 7 on tiles
          bool fin = true;
          mk::pack_vt_pairs(reinterpret_cast<const uint16_t*>(
                                static_cast<const scalar_t*>(p.k) + b * p.k_batch_stride +
                                hkv * p.k_head_stride + (sq.k0 + j0) * p.k_row_stride),
                            p.k_row_stride, nk, p.D, s.kpt.data(), BwdScratch<acc_t>::kKeyPairs, &fin);
        }
        KeyAcc<acc_t> acc{nullptr, 0, nullptr, 0, nullptr};
        if (want_kv) {
          acc = unit_rows || chunk_rows ? buffer_acc(s.unit_kv.data(), s.unit_n, j0 - s.unit_j0)
                                        : key_acc(b, hkv, sq, j0);
        }
        for (int j = 0; j < n_jobs; ++j) {
          if (!sees[j]) continue;
          Job& job = s.jobs[j];
          acc.db = job.db != nullptr ? job.dbj.data() : nullptr;
          bwd_pair<acc_t>(p, vis, sq, b, job.h, job.i0, job.nq, j0, nk, n_valid, k_finite,
                          decode_order, decode_dp, kbf, vbf, L, job.blk.data(), job.rk.data(), acc,
                          want_dq ? job.dqt.data() : nullptr, kern, s);
        }
      }
      for (int j = 0; j < n_jobs; ++j) {  // the blocks' d rel_bias sums, in block order
        const Job& job = s.jobs[j];
        if (job.db == nullptr) continue;
        for (int64_t x = 0; x < job.db_n; ++x) job.db[x] += job.dbj[static_cast<size_t>(job.db_lo + x)];
      }
    };

    if (!split) {
      const int jobs = bwd_jobs();
      parallel_tasks(p.B * p.Hkv, make_scratch, [&](int64_t t, BwdScratch<acc_t>& s) {
        const int64_t b = t / p.Hkv, hkv = t % p.Hkv;
        if (!filter.takes(b, hkv)) return;
        const SeqInfo sq = vis.seq(b);
        // the unit's query blocks, head by head, kBwdJobs at a time (one visit of the key tiles)
        const int64_t per_head = ceil_div(sq.Sq, kBlockQ);
        const int64_t n_blocks = group * per_head;
        if (unit_rows) open_unit(s, 0, sq.Sk, p.Sk);
        for (int64_t x0 = 0; x0 < n_blocks; x0 += jobs) {
          const int n_jobs = static_cast<int>(std::min<int64_t>(jobs, n_blocks - x0));
          for (int j = 0; j < n_jobs; ++j) {
            const int64_t h = hkv * group + (x0 + j) / per_head;
            start_job(s, j, sq, b, h, ((x0 + j) % per_head) * kBlockQ, 0);
          }
          visit(s, n_jobs, sq, b, hkv, 0, n_kb, true, true);
          for (int j = 0; j < n_jobs; ++j) {
            const Job& job = s.jobs[j];
            write_dq<scalar_t, acc_t>(bp, sq, b, job.h, job.i0, job.nq, job.dqt.data(), s.ldq,
                                      L.amx_dq());
          }
        }
        if (unit_rows) close_unit(s, sq, b, hkv, 0, sq.Sk);
      });
    } else {
      // phase 1: dk / dv (and d rel_bias) by key chunks
      parallel_tasks(p.B * p.Hkv * n_chunks, make_scratch, [&](int64_t t, BwdScratch<acc_t>& s) {
        const int64_t c = t % n_chunks, bh = t / n_chunks;
        const int64_t b = bh / p.Hkv, hkv = bh % p.Hkv;
        if (!filter.takes(b, hkv)) return;
        const SeqInfo sq = vis.seq(b);
        const int64_t kt0 = c * per_chunk, kt1 = std::min(n_kb, kt0 + per_chunk);
        const int64_t j0 = kt0 * kBlockK, j1 = std::min(sq.Sk, kt1 * kBlockK);
        if (j0 >= j1) return;
        if (chunk_rows) open_unit(s, j0, j1, per_chunk * kBlockK);
        const Range rows = vis.band_rows_of_keys(sq, j0, j1);  // rows that see some key of it
        for (int64_t h = hkv * group; h < (hkv + 1) * group; ++h) {
          for (int64_t i0 = rows.lo / kBlockQ * kBlockQ; i0 < rows.hi; i0 += kBlockQ) {
            start_job(s, 0, sq, b, h, i0, c);
            visit(s, 1, sq, b, hkv, kt0, kt1, true, false);
          }
        }
        if (chunk_rows) close_unit(s, sq, b, hkv, j0, j1);
      });
      // phase 2: dq by query blocks
      parallel_tasks(p.B * p.H * n_qb, make_scratch, [&](int64_t t, BwdScratch<acc_t>& s) {
        const int64_t qb = t % n_qb, bh = t / n_qb;
        const int64_t b = bh / p.H, h = bh % p.H;
        if (!filter.takes(b, h / group)) return;
        const SeqInfo sq = vis.seq(b);
        const int64_t i0 = qb * kBlockQ;
        if (i0 >= sq.Sq) return;
        const Job& job = start_job(s, 0, sq, b, h, i0, -1);
        visit(s, 1, sq, b, h / group, 0, n_kb, false, true);
        write_dq<scalar_t, acc_t>(bp, sq, b, h, i0, job.nq, job.dqt.data(), s.ldq, L.amx_dq());
      });
    }

    // d rel_bias (H, 2M + 1) = the units' partial tables summed in unit order (b, chunk).
    if (nbias > 0 && bp.drel_bias != nullptr) {
      auto* drb = static_cast<acc_t*>(bp.drel_bias);
      for (int64_t h = 0; h < p.H; ++h) {
        for (int64_t x = 0; x < nbias; ++x) {
          double sum = 0;
          for (int64_t b = 0; b < p.B; ++b) {
            for (int64_t c = 0; c < n_chunks; ++c) {
              const DbSpan& sp = db_span[static_cast<size_t>(b * n_chunks + c)];
              if (x >= sp.lo && x < sp.lo + sp.n) sum += db_row(b, h, c)[x - sp.lo];
            }
          }
          drb[h * nbias + x] = run_index == 0 ? static_cast<acc_t>(sum)
                                              : drb[h * nbias + x] + static_cast<acc_t>(sum);
        }
      }
    }

    ++run_index;
    // dk = scale * dk accumulated in place (the units wrote their buffers' rows out themselves,
    // unit_rows / chunk_rows)
    if (unit_rows || chunk_rows) return;
    parallel_tasks(p.B * p.Hkv, [] { return 0; }, [&](int64_t t, int&) {
      const int64_t b = t / p.Hkv, hkv = t % p.Hkv;
      if (!filter.takes(b, hkv)) return;
      const SeqInfo sq = vis.seq(b);
      write_dkv<scalar_t, acc_t>(bp, sq, b, hkv, key_acc(b, hkv, sq, 0), false);
  });
  });
}

using BwdResult = std::tuple<Tensor, Tensor, Tensor, Tensor>;

// The gradient of input x (B, S, H, D) (sizes): BSHD contiguous, except when x is the
// transpose(1, 2) view of a contiguous (B, H, S, D) tensor (SDPA's layout, read by the forward
// through strides): then the gradient has that layout too, the same (B, H, S, D) memory seen
// through the same view. Autograd then hands it to the (B, H, S, D) leaf as it is, where a BSHD
// gradient would be copied into the leaf's layout (4 % of a fwd + bwd at (1, 16, 2048, 64):
// RESULTS.md, twentieth session). The rule is _grad_layout_is_bhsd in attn_ext/ops.py (the fake
// tensors' strides must match).
bool is_bhsd_view(const Tensor& x) {
  return x.dim() == 4 && x.size(1) > 1 && x.size(2) > 1 && x.stride(3) == 1 &&
         x.stride(1) == x.size(3) && x.stride(2) == x.size(1) * x.size(3);
}

Tensor grad_layout(const Tensor& x, const Tensor& like, const std::vector<int64_t>& sizes,
                   bool zeros) {
  const ScalarType dt = like.scalar_type();
  if (!is_bhsd_view(x)) return zeros ? alloc_zeros(like, sizes, dt) : alloc(like, sizes, dt);
  const std::vector<int64_t> bhsd{sizes[0], sizes[2], sizes[1], sizes[3]};
  const Tensor g = zeros ? alloc_zeros(like, bhsd, dt) : alloc(like, bhsd, dt);
  return torch::stable::transpose(g, 1, 2);
}

// deterministic: ignored, the CPU backward is always deterministic (work units own the
// gradients they write; partial sums are reduced in a fixed order).
BwdResult attention_backward_cpu(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse_in, bool causal, std::optional<double> scale, int64_t window_left,
    int64_t window_right, const OptTensor& key_padding_mask, const OptTensor& dlse_in,
    const OptTensor& alibi_slopes, const OptTensor& rel_bias, std::optional<double> softcap,
    double dropout_p, int64_t dropout_seed, int64_t dropout_offset, bool deterministic,
    std::optional<int64_t> q_start, std::optional<int64_t> k_start) {
  (void)deterministic;
  const AttentionShape s = check_attention_inputs(q, k, v, scale);
  check_attention_bwd_inputs(dout, out, lse_in, q, s);
  if (dlse_in.has_value()) check_dlse(*dlse_in, lse_in);
  Tensor dq = grad_layout(q, q, {s.B, s.Sq, s.H, s.D}, false);
  Tensor dk = grad_layout(k, q, {s.B, s.Sk, s.Hkv, s.D}, true);  // accumulated in place
  Tensor dv = grad_layout(v, q, {s.B, s.Sk, s.Hkv, s.Dv}, true);
  const Tensor lse = torch::stable::contiguous(lse_in);
  AttentionBwdParams bp =
      make_attention_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, s, causal, scale);
  fill_mask_params(bp.fwd, s, q, causal, window_left, window_right, key_padding_mask);
  const OptTensor no_sinks;
  const AccTables tab(alibi_slopes, rel_bias, no_sinks, q);
  fill_score_terms(bp.fwd, {tab.alibi_slopes, tab.rel_bias, softcap, no_sinks, dropout_p,
                            dropout_seed, dropout_offset}, q, s.B, s.H);
  fill_block_position(bp.fwd, q_start, k_start, /*has_sinks=*/false);
  Tensor drel_bias = make_drel_bias(tab.rel_bias, q);
  if (rel_bias.has_value()) bp.drel_bias = drel_bias.data_ptr();
  // (no gradient to compute, unless rel_bias's reaches lse: D = Dv = 0 with a dlse)
  if (dq.numel() == 0 && dk.numel() == 0 && dv.numel() == 0 &&
      !(rel_bias.has_value() && dlse_in.has_value())) {
    return {dq, dk, dv, drel_as_table(drel_bias, rel_bias)};
  }
  if (s.Sq == 0 || s.H == 0) {  // no query: no gradient reaches k or v
    return {dq, dk, dv, drel_as_table(drel_bias, rel_bias)};
  }
  const Tensor dlse = dlse_in.has_value() ? torch::stable::contiguous(*dlse_in) : Tensor();
  if (dlse.defined()) bp.dlse = dlse.data_ptr();
  if (s.Sk == 0) {  // no key: every row is empty, dq = 0
    torch::stable::zero_(dq);
    return {dq, dk, dv, drel_as_table(drel_bias, rel_bias)};
  }
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), "attention_backward",
                             [&] { attention_bwd_kernel<scalar_t>(bp); });
  return {dq, dk, dv, drel_as_table(drel_bias, rel_bias)};
}

// Packed sequences (attention_varlen_forward's backward): dq (Tq, H, D), dk (Tk, Hkv, D),
// dv (Tk, Hkv, Dv), d rel_bias. deterministic: ignored, as above.
BwdResult attention_varlen_backward_cpu(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse_in, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal, std::optional<double> scale,
    int64_t window_left, int64_t window_right, const OptTensor& dlse_in,
    const OptTensor& alibi_slopes, const OptTensor& rel_bias, std::optional<double> softcap,
    double dropout_p, int64_t dropout_seed, int64_t dropout_offset, bool deterministic) {
  (void)deterministic;
  const AttentionShape s = check_varlen_bwd_inputs(dout, q, k, v, out, lse_in, cu_seqlens_q,
                                                   cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   scale, dlse_in);
  const int64_t Tq = q.size(0), Tk = k.size(0);
  Tensor dq = alloc(q, {Tq, s.H, s.D});
  Tensor dk = alloc_zeros(q, {Tk, s.Hkv, s.D}, q.scalar_type());
  Tensor dv = alloc_zeros(q, {Tk, s.Hkv, s.Dv}, q.scalar_type());
  const Tensor lse = torch::stable::contiguous(lse_in);
  const Tensor dlse = dlse_in.has_value() ? torch::stable::contiguous(*dlse_in) : Tensor();
  AttentionBwdParams bp = make_varlen_bwd_params(dout, q, k, v, out, lse, dlse, dq, dk, dv, s,
                                                 cu_seqlens_q, cu_seqlens_k, causal, scale,
                                                 window_left, window_right);
  const OptTensor no_sinks;
  const AccTables tab(alibi_slopes, rel_bias, no_sinks, q);
  fill_score_terms(bp.fwd, {tab.alibi_slopes, tab.rel_bias, softcap, no_sinks, dropout_p,
                            dropout_seed, dropout_offset}, q, s.B, s.H);
  Tensor drel_bias = make_drel_bias(tab.rel_bias, q);
  if (rel_bias.has_value()) bp.drel_bias = drel_bias.data_ptr();
  if (Tq == 0 || s.H == 0 || Tk == 0 || s.B == 0) {
    torch::stable::zero_(dq);
    return {dq, dk, dv, drel_as_table(drel_bias, rel_bias)};
  }
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), "attention_varlen_backward",
                             [&] { attention_bwd_kernel<scalar_t>(bp); });
  return {dq, dk, dv, drel_as_table(drel_bias, rel_bias)};
}

}  // namespace
}  // namespace cpu_attn

ATTN_EXT_LIBRARY_IMPL(CPU, m) {
  m.impl("attention_backward_rel_bias", TORCH_BOX(&cpu_attn::attention_backward_cpu));
  m.impl("attention_backward", TORCH_BOX(without_drel<&cpu_attn::attention_backward_cpu>));
  m.impl("attention_varlen_backward_rel_bias", TORCH_BOX(&cpu_attn::attention_varlen_backward_cpu));
  m.impl("attention_varlen_backward",
         TORCH_BOX(without_drel<&cpu_attn::attention_varlen_backward_cpu>));
}

}  // namespace attn_ext
