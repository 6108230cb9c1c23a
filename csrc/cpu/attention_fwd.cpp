// attn_ext::attention_forward on CPU: flash-style tiled attention with an online softmax.
//
//   out (B, Sq, H, Dv) = softmax(scale * q k^T [+ mask]) v,  lse (B, H, Sq)
//   q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv): any strides but the last dim
//   (packed sequences: q (Tq, H, D) ... with per-sequence rows from cu_seqlens)
//
// Which keys a row sees (causal, window, key padding, packed sequences) comes from the
// visibility layer, common/attention_mask.h: a tile's key range, each key tile's class
// (invisible: skipped; full: unmasked; partial: masked) and the per-(i, j) predicate.
//
// Work is split into query tiles: up to kBlockQ score columns, each a (query head, query
// row) pair of one kv head. Normally a tile is up to 96 consecutive rows of one head; when
// Sq is short (decoding) it takes the rows of several query heads sharing a kv head (GQA),
// so each k/v tile loaded serves all of them. For one tile:
//
//   qt (D, C)   = scale * q^T             (packed once; C = columns rounded up to 8)
//   for each key tile of up to kBlockK keys the tile can see (invisible tiles skipped):
//     kb (nk, Dp), vb (nk, Dvp)  = k, v rows converted to the accumulation type
//     pass 1: st (nk, C) = kb qt                  scores, transposed
//             mask (only partial tiles)
//     pass 2: online softmax on st's columns      (running max m, sum l, rescale alpha;
//             on AMX tiles also p's bf16 pairs for pass 3: mk::softmax_pairs_amx)
//     pass 3: o (C, Dvp) = alpha * o + st^T vb
//   out = o / l, lse = m + log l
//
// bf16 on AMX tiles (attention_amx.cpp) reads k's rows in place and packs v^T as bf16 key pairs
// per head (HeadPairs); fp16 there splits k's rows (HeadSplit), v^T's pairs and q's into bf16
// hi / lo parts and runs each product as the hi / lo terms in one chain (s.split): all four for
// the scores (exact products), hi hi + hi lo + lo hi for o += p v (p split to 16 bits).
//
// Scores, m and lse are in natural-log units (exp(x) = exp2(x * log2 e) after the difference
// x = s - m, which is exact near the maximum): the backward recomputes P = exp(s - lse) from
// the same scores (same scale folded into q, same FMA order) and the same units, so its
// probabilities are the forward's up to the rounding of lse (issue 18 item 8). fp16 on tiles
// too: its backward recomputes the scores by the same split products (scores_amx_split) where
// its forward ran on the tiles (attention_bwd.cpp, QueryPackLayout::split).
//
// No (Sq, Sk) buffer exists: the extra memory is O(threads * tile). Tiles run in parallel
// with dynamic scheduling, most expensive (latest causal rows) first. When there are fewer
// tiles than threads (decoding), the keys of each tile are split into chunks processed in
// parallel and merged through their (m, l) (split-KV).

#include <vector>

#include "common/registration.h"
#include "common/attention_checks.h"
#include "common/attention_mask_checks.h"
#include "common/row_lse.h"
#include "common/score_checks.h"
#include "cpu/attention_common.h"
#include "cpu/attention_decode.h"

namespace attn_ext {
namespace cpu_attn {
namespace {

// Columns of one query tile: column c = hh * nq + ii is query head h0 + hh, row i0 + ii of
// sequence b (local row index; packed sequences start at s.q0).
struct QueryTile {
  int64_t b, hkv, h0, nh, i0, nq;
  SeqInfo s;
  int64_t cols() const { return nh * nq; }
};

struct TilePlan {
  int64_t rows_per_tile, heads_per_tile, n_row_blocks, n_head_blocks, n_tiles;
};

TilePlan plan_tiles(const AttentionParams& p) {
  TilePlan t{};
  const int64_t group = p.H / p.Hkv;
  t.rows_per_tile = std::max<int64_t>(1, std::min(p.Sq, kBlockQ));
  t.heads_per_tile = std::max<int64_t>(1, std::min(group, kBlockQ / t.rows_per_tile));
  t.n_row_blocks = ceil_div(p.Sq, t.rows_per_tile);
  t.n_head_blocks = ceil_div(group, t.heads_per_tile);
  t.n_tiles = p.B * p.Hkv * t.n_head_blocks * t.n_row_blocks;
  return t;
}

// Tile index -> tile. Tiles are handed out kv head by kv head (sequence and kv head vary
// slowest), so a worker's consecutive tiles mostly share their K / V rows (HeadRows packs
// them once per worker); within a head the row block runs backwards, so the causal tiles
// with the most keys go first and the last tiles handed out are the cheapest (balance).
// nq <= 0: the tile lies past its (packed) sequence's end and does nothing.
QueryTile tile_at(const AttentionParams& p, const Visibility& vis, const TilePlan& t,
                  int64_t idx) {
  const int64_t per_head = t.n_row_blocks * t.n_head_blocks;
  int64_t rest = idx / per_head;  // b * Hkv + hkv
  const int64_t in_head = idx % per_head;
  const int64_t rb = t.n_row_blocks - 1 - in_head / t.n_head_blocks;
  const int64_t hb = in_head % t.n_head_blocks;
  QueryTile q{};
  q.hkv = rest % p.Hkv;
  q.b = rest / p.Hkv;
  q.s = vis.seq(q.b);
  const int64_t group = p.H / p.Hkv;
  q.h0 = q.hkv * group + hb * t.heads_per_tile;
  q.nh = std::min(t.heads_per_tile, group - hb * t.heads_per_tile);
  q.i0 = rb * t.rows_per_tile;
  q.nq = std::max<int64_t>(0, std::min(t.rows_per_tile, q.s.Sq - q.i0));
  return q;
}

// Keys [lo, hi) that some row of the tile can see (the band's union; attention_mask.h).
Range tile_keys(const Visibility& vis, const QueryTile& q) {
  if (q.nq <= 0) return {0, 0};
  return vis.band_keys_of_rows(q.s, q.i0, q.i0 + q.nq);
}

// Pass 3 on AMX tiles reads a key tile [j0, j0 + nk) as the 32-key blocks that hold it,
// [32 floor(j0 / 32), 32 ceil((j0 + nk) / 32)): at most kBlockK + 62 keys.
constexpr int64_t kAmxKeyRows = round_up(kBlockK + 62, 32);

// v^T of one head as bf16 key pairs (mk::pack_vt_pairs), packed by 32-key blocks on first use:
// the whole head (Dv, 16 * blocks words) when it fits the worker's head-rows share, else the
// blocks of each key tile into `tile` alone. fp16 (`split`): the pairs of the values' hi parts
// there and of their lo parts in vt_lo / tile_lo (mk::split_fp16), at the same places.
struct HeadPairs {
  HeadBlocks blocks;  // by 32-key blocks: 1 packed and finite, 2 not finite
  bool split = false;
  AlignedVec<uint32_t> vt, vt_lo;      // whole head
  AlignedVec<uint32_t> tile, tile_lo;  // (Dv, kAmxKeyRows / 2): one key tile's blocks (sized by
                                       // the scratch)
  AlignedVec<uint16_t> rhi, rlo;       // (32, Dv): one block's rows split (split)

  // Blocks [b0, b1) of the head at `head` (n rows of Dv): returns v^T's column of key pair
  // 16 b0 (and the lo parts' in *lo, split) and sets *ld (words) and *finite (no inf / NaN in
  // the blocks' rows).
  const uint32_t* get(bool whole, const uint16_t* head, int64_t row_stride, int64_t n,
                      int64_t Dv, int64_t b0, int64_t b1, int64_t* ld, bool* finite,
                      const uint32_t** lo = nullptr) {
    const int64_t nb = ceil_div(n, 32);
    // block blk into column 16 * col of dst (ld words); whether its rows are finite
    auto pack = [&](int64_t blk, uint32_t* dst, uint32_t* dst_lo, int64_t col) {
      bool f = true;
      const int64_t rows = std::min<int64_t>(32, n - 32 * blk);
      const uint16_t* v = head + 32 * blk * row_stride;
      if (!split) {
        mk::pack_vt_pairs(v, row_stride, rows, Dv, dst + 16 * col, *ld, &f);
        return f;
      }
      mk::split_fp16_rows(v, row_stride, rows, Dv, rhi.data(), rlo.data(), Dv);
      bool f_lo = true;  // (lo is 0 where v is not finite)
      mk::pack_vt_pairs(rhi.data(), Dv, rows, Dv, dst + 16 * col, *ld, &f);
      mk::pack_vt_pairs(rlo.data(), Dv, rows, Dv, dst_lo + 16 * col, *ld, &f_lo);
      return f;
    };
    bool fin = true;
    if (!whole) {
      *ld = 16 * (b1 - b0);
      for (int64_t blk = b0; blk < b1; ++blk)
        fin = pack(blk, tile.data(), tile_lo.data(), blk - b0) && fin;
      *finite = fin;
      if (lo != nullptr) *lo = tile_lo.data();
      return tile.data();
    }
    // (a row stride that is a multiple of 4 KiB would put a tile's 16 rows in one L1 set: one
    // more cache line of padding then, outside the share's count: Dv lines)
    const int64_t ld_whole = 16 * nb + (16 * nb * 4 % 4096 == 0 ? 16 : 0);
    if (blocks.start(head, n, 32)) {
      const size_t words = static_cast<size_t>(Dv * ld_whole);
      if (vt.size() < words) vt.resize(words);
      if (split && vt_lo.size() < words) vt_lo.resize(words);
    }
    *ld = ld_whole;
    blocks.fill(32 * b0, 32 * (b1 - b0), [&](int64_t a, int64_t) -> uint8_t {
      return pack(a / 32, vt.data(), vt_lo.data(), a / 32) ? 1 : 2;
    });
    for (int64_t blk = b0; blk < b1; ++blk) fin = fin && blocks.done[blk] == 1;
    *finite = fin;
    if (lo != nullptr) *lo = vt_lo.data() + 16 * b0;
    return vt.data() + 16 * b0;
  }
};

// k's rows of one head split into bf16 hi / lo rows (mk::split_fp16; the fp16 scores on tiles),
// by 32-row blocks on first use: the whole head (n, D) each when it fits the head-rows share,
// else one key tile's rows.
struct HeadSplit {
  HeadBlocks blocks;
  AlignedVec<uint16_t> hi, lo;  // whole head, or one key tile (kBlockK, D)

  // rows [r0, r0 + nr) of the head at `head` (n rows of D): their hi rows (D apart), *lo_out
  // the lo rows'.
  const uint16_t* get(bool whole, const uint16_t* head, int64_t row_stride, int64_t n, int64_t D,
                      int64_t r0, int64_t nr, const uint16_t** lo_out) {
    // rows [a, b) to hi / lo rows from row a - at on
    auto split_rows = [&](int64_t a, int64_t b, int64_t at) {
      mk::split_fp16_rows(head + a * row_stride, row_stride, b - a, D, hi.data() + (a - at) * D,
                          lo.data() + (a - at) * D, D);
    };
    auto size_for = [&](int64_t rows) {
      const size_t need = static_cast<size_t>(rows * D);
      if (hi.size() < need) {
        hi.resize(need);
        lo.resize(need);
      }
    };
    const int64_t at = blocks.rows_of(whole, head, n, r0, nr, size_for, split_rows);  // (may resize)
    *lo_out = lo.data() + at * D;
    return hi.data() + at * D;
  }
};

// k's bf16 rows of one head copied D apart, for pass 1 on the pairs / tiles where the rows lie
// a multiple of 1 KiB apart in place (a BSHD cache: H * D * 2 bytes, 2 KiB at 16 heads of 64 or
// 8 of 128): the tiles' 16-row loads put such rows into one or two L1 sets, 16 rows a set for a
// 2 x 2 block, more than its 12 ways (RESULTS.md, twenty-fifth session). The whole head by
// 32-row blocks on first use when it fits the head-rows share, else the rows asked for, each
// time. The same values, so the same scores.
struct HeadRows16 {
  HeadBlocks blocks;
  AlignedVec<uint16_t> rows;  // (n + 32, D) or (nr + 32, D): rows past the asked ones unused

  // rows [r0, r0 + nr) of the head at `head` (n rows of D): D apart
  const uint16_t* get(bool whole, const uint16_t* head, int64_t row_stride, int64_t n, int64_t D,
                      int64_t r0, int64_t nr) {
    // rows [a, b) to rows from row a - at on
    auto copy = [&](int64_t a, int64_t b, int64_t at) {
      for (int64_t r = a; r < b; ++r) {
        // (a head packed tile by tile, its rows often read once: as HeadRows::tile)
        if (!whole) prefetch_row_ahead(head, row_stride, n, r, D * int64_t(sizeof(uint16_t)));
        std::memcpy(rows.data() + (r - at) * D, head + r * row_stride,
                    static_cast<size_t>(D) * sizeof(uint16_t));
      }
    };
    auto size_for = [&](int64_t n_rows) {
      const size_t need = static_cast<size_t>((n_rows + 32) * D);
      if (rows.size() < need) rows.resize(need);
    };
    const int64_t at = blocks.rows_of(whole, head, n, r0, nr, size_for, copy);  // (may resize)
    return rows.data() + at * D;
  }
};

template <typename acc_t>
struct FwdScratch {
  int64_t Dp, Dvp;
  AlignedVec<acc_t> qt;     // (D, kBlockQ): scaled q^T of the tile
  AlignedVec<acc_t> st;     // (kBlockK, kBlockQ): scores, then probabilities (transposed)
  AlignedVec<acc_t> kb;     // (kBlockK, Dp): k rows, zero-padded columns
  int64_t ldvb;             // padded_ld(Dvp): packed v rows' leading dimension
  AlignedVec<acc_t> vb;     // (kBlockK, ldvb): v rows, zero-padded columns
  AlignedVec<acc_t> o;      // (kBlockQ, Dvp): unnormalised output accumulator
  AlignedVec<acc_t> m, l, alpha;  // (kBlockQ): running max, sum, rescale
  AlignedVec<acc_t> tmp;    // (max(D, Dv)): one converted row
  AlignedVec<acc_t> qrows;  // (kBlockQ, Dp): the tile's q rows converted (q not acc_t; sized
                            // on first use)
  std::vector<uint8_t> kvalid;  // (kBlockK): key padding of the key tile (1 = takes part)
  std::vector<uint64_t> rk, words;  // (kBlockQ): dropout row keys / words of the columns
  HeadRows<acc_t> hk, hv;           // the current head's packed k / v rows
  int64_t head_rows_budget = kHeadRowsBytes;  // this call's per-worker share (head_rows_fit)
  // Whether the worker's next tiles may read the head's rows again (several tiles of one
  // (sequence, kv head), not split-KV): only then are the head's rows packed whole (hk / hv,
  // vp, k16; the share above), else each key tile's alone (kb / vb, the tile buffers). Set per
  // task. A head packed whole for one tile cost a buffer of the whole head per worker and call
  // (zero-filled, up to 4.25 MiB: fresh pages to fault in each call, ~577 faults at (1, 4096,
  // 32 / 1, 128)): RESULTS.md, forty-sixth session. The same values either way.
  bool head_reuse = true;
  bool bf16dp = false;      // pass 1 by mk::scores_pairs (mk::bf16_scores_by_pairs)
  bool amx = false;         // ... on AMX tiles (mk::amx_for(D))
  bool amx_pv = false;      // pass 3 on AMX tiles (mk::amx_pv_for(Dv)): o^T in ot, below
  AlignedVec<float> ot;     // (Dv, C16): o^T, C16 = C rounded up to 16 (amx_pv; sized with it)
  AlignedVec<uint32_t> pp;  // (kAmxKeyRows / 2, C16): the probabilities as bf16 key pairs
                            // (split: then as many of their lo parts' pairs, pp_lo)
  HeadPairs vp;             // the current head's v^T as bf16 key pairs (mk::pack_vt_pairs)
  std::vector<uint32_t> vclean;  // a key tile's v^T pairs with inf / NaN as 0 (pass3_amx)
  AlignedVec<uint32_t> qp;  // (D / 2, kBlockQ): the tile's q as bf16 pairs (bf16dp; sized on
                            // first use); split: (D, kBlockQ), the hi pairs then the lo pairs
  // fp16 on the bf16 tiles (mk::split_fp16; sized with the scratch): the scores take the four
  // hi / lo terms in one chain, o += p v three of them
  bool split = false;
  HeadSplit ksplit;                     // k's rows split
  HeadRows16 k16;                       // k's bf16 rows D apart (bf16dp where they alias)
  AlignedVec<uint16_t> rhi, rlo;        // (kBlockQ, D): the tile's q rows split

  // the lo parts' pairs of the probabilities (split), after pp's (C16: the tile's column count)
  uint32_t* pp_lo(int64_t C16) { return pp.data() + kAmxKeyRows / 2 * C16; }

  FwdScratch(int64_t D, int64_t Dv)
      : Dp(round_up(D, 8)),
        Dvp(round_up(Dv, 8)),
        qt(static_cast<size_t>(std::max<int64_t>(D, 1) * kBlockQ)),
        st(static_cast<size_t>(kBlockK * kBlockQ)),
        kb(static_cast<size_t>(kBlockK * Dp), acc_t(0)),
        ldvb(padded_ld(Dvp, sizeof(acc_t))),
        vb(static_cast<size_t>(kBlockK * ldvb), acc_t(0)),
        o(static_cast<size_t>(kBlockQ * std::max<int64_t>(Dvp, 1))),
        m(kBlockQ),
        l(kBlockQ),
        alpha(kBlockQ),
        tmp(static_cast<size_t>(std::max<int64_t>(std::max(D, Dv), 1))),
        kvalid(kBlockK),
        rk(kBlockQ),
        words(kBlockQ) {
    hk.check_finite = hv.check_finite = false;
  }
};

// Pass 3 on AMX tiles (s.amx_pv, bf16): o^T (Dv, C16) = alpha * o^T + v^T p for key tile
// [j0, j0 + nk) of the tile. v^T comes as the 32-key blocks holding the tile (s.vp); p (st, after
// the softmax and dropout) is rounded to bf16 key pairs over the same blocks, zero outside the
// tile. Where a block's v holds inf / NaN, a zero probability must not meet it (0 * inf): the
// tiles take those entries as 0, and each is added on its own to the columns that see its key
// (all of them on a full tile, as the fp32 gemm's products; the visible ones on a partial one).
//
// fp16 (s.split): v^T's pairs of the values' hi and lo parts (s.vp) and p's hi and lo pairs, in
// one chain per element: v p = hi_v hi_p + hi_v lo_p + lo_v hi_p (mk::pv_amx_split).
// With pairs_done the softmax has written p's pairs already (mk::softmax_pairs_amx).
template <typename scalar_t, typename acc_t>
void pass3_amx(const AttentionParams& p, const Visibility& vis, const QueryTile& qt_, int64_t j0,
               int64_t nk, bool partial, bool whole, const scalar_t* vh, int64_t C,
               bool pairs_done, FwdScratch<acc_t>& s) {
  const int64_t Dv = p.Dv, C16 = round_up(C, 16), cols = qt_.cols();
  float* ot = s.ot.data();
  mk::scale_cols(ot, Dv, C16, cols, s.alpha.data());
  const int64_t b0 = j0 / 32, b1 = ceil_div(j0 + nk, 32);
  const int64_t rows = 32 * (b1 - b0), pairs = rows / 2;
  int64_t ldvt = 0;
  bool finite = true;
  const uint32_t* vt_lo = nullptr;
  const uint32_t* vt = s.vp.get(whole, reinterpret_cast<const uint16_t*>(vh), p.v_row_stride,
                                qt_.s.Sk, Dv, b0, b1, &ldvt, &finite, &vt_lo);
  if (!finite) {
    // v's inf / NaN entries as 0 for the tiles (a hidden key's 0 probability then adds exactly
    // 0, as with a finite value there: the visible rows keep their bits), then added one by one
    // where their key is visible (full tile: every column, as the fp32 gemm's products)
    // (lo is 0 where v is not finite: only the hi pairs need it; the copy puts the lo pairs
    // beside them at the same ld)
    s.vclean.resize(static_cast<size_t>(Dv * pairs * (s.split ? 2 : 1)));
    mk::zero_nonfinite_pairs(vt, Dv, pairs, ldvt, s.vclean.data(), pairs);
    if (s.split) {
      for (int64_t d = 0; d < Dv; ++d)
        std::copy(vt_lo + d * ldvt, vt_lo + d * ldvt + pairs, s.vclean.data() + (Dv + d) * pairs);
      vt_lo = s.vclean.data() + Dv * pairs;
    }
    vt = s.vclean.data();
    ldvt = pairs;
  }
  const int64_t r_begin = j0 - 32 * b0;
  uint32_t* pp = s.pp.data();
  uint32_t* pp_lo = s.pp_lo(C16);  // (split)
  if (s.split) {
    if (!pairs_done)
      mk::probs_to_pairs_split(s.st.data(), C, r_begin, r_begin + nk, rows, cols, pp, pp_lo, C16);
    mk::pv_amx_split(Dv, C16, pairs, vt, vt_lo, ldvt, pp, pp_lo, ot, C16);
  } else {
    if (!pairs_done) mk::probs_to_pairs(s.st.data(), C, r_begin, r_begin + nk, rows, cols, pp, C16);
    mk::pv_amx(Dv, C16, pairs, vt, ldvt, pp, ot, C16);
  }
  if (finite) return;
  const int64_t nq = qt_.nq;
  for (int64_t r = 0; r < nk; ++r) {
    const scalar_t* vrow = vh + (j0 + r) * p.v_row_stride;
    for (int64_t d = 0; d < Dv; ++d) {
      const float x = static_cast<float>(vrow[d]);
      if (std::isfinite(x)) continue;
      for (int64_t c = 0; c < cols; ++c) {
        if (partial && !vis.visible(qt_.s, qt_.b, qt_.i0 + c % nq, j0 + r)) continue;
        ot[d * C16 + c] += s.st[r * C + c] * x;
      }
    }
  }
}

// Runs the tile over keys [kbeg, kend): leaves the unnormalised output in s.o (cols, Dvp)
// and the running max / sum in s.m / s.l. Returns the padded column count.
// Every key tile is classified by the visibility layer: invisible tiles are skipped, full
// tiles run unmasked, partial tiles are masked (and their hidden parts skipped in 6-key /
// 6-query steps when the tile holds one head).
template <typename scalar_t, typename acc_t>
int64_t run_tile(const AttentionParams& p, const Visibility& vis, const QueryTile& qt_,
                 int64_t kbeg, int64_t kend, const mk::Kernels<acc_t>& K, FwdScratch<acc_t>& s,
                 const QueryTile* next = nullptr) {
  const int64_t D = p.D, Dv = p.Dv, Dp = s.Dp, Dvp = s.Dvp;
  const int64_t cols = qt_.cols();
  const int64_t C = round_up(cols, 8);
  const SeqInfo& sq = qt_.s;
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);

  // qt (D, C) = scale * q^T (mk::transpose_rows, the backward's too); padding columns zero.
  // bf16dp: qp (D / 2, C), q's pairs unscaled (the scale multiplies the sums), instead.
  const acc_t qscale = static_cast<acc_t>(p.score_terms().scale);
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (s.bf16dp) {
      if (s.qp.empty()) s.qp.resize(static_cast<size_t>(std::max<int64_t>(D / 2, 1) * kBlockQ));
      for (int64_t t = 0; cols < C && t < D / 2; ++t)
        std::fill(s.qp.begin() + t * C + cols, s.qp.begin() + (t + 1) * C, 0u);
      for (int64_t hh = 0; hh < qt_.nh; ++hh) {
        const scalar_t* qh = q + qt_.b * p.q_batch_stride + (qt_.h0 + hh) * p.q_head_stride +
                             (sq.q0 + qt_.i0) * p.q_row_stride;
        mk::pack_bf16_pairs(reinterpret_cast<const uint16_t*>(qh), p.q_row_stride, qt_.nq, D,
                            s.qp.data() + hh * qt_.nq, C);
      }
    }
  }
  if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    if (s.split) {  // qp (D, C): q's pairs [hi; lo], unscaled, padding columns zero
      const int64_t P = D / 2;
      std::fill(s.qp.begin(), s.qp.begin() + 2 * P * C, 0u);
      for (int64_t hh = 0; hh < qt_.nh; ++hh) {
        const scalar_t* qh = q + qt_.b * p.q_batch_stride + (qt_.h0 + hh) * p.q_head_stride +
                             (sq.q0 + qt_.i0) * p.q_row_stride;
        mk::split_fp16_rows(reinterpret_cast<const uint16_t*>(qh), p.q_row_stride, qt_.nq, D,
                            s.rhi.data(), s.rlo.data(), D);
        mk::pack_bf16_pairs(s.rhi.data(), D, qt_.nq, D, s.qp.data() + hh * qt_.nq, C);
        mk::pack_bf16_pairs(s.rlo.data(), D, qt_.nq, D, s.qp.data() + P * C + hh * qt_.nq, C);
      }
    }
  }
  for (int64_t d = 0; !s.bf16dp && cols < C && d < D; ++d)
    std::fill(s.qt.begin() + d * C + cols, s.qt.begin() + (d + 1) * C, acc_t(0));
  for (int64_t hh = 0; !s.bf16dp && hh < qt_.nh; ++hh) {
    const scalar_t* qh = q + qt_.b * p.q_batch_stride + (qt_.h0 + hh) * p.q_head_stride +
                         (sq.q0 + qt_.i0) * p.q_row_stride;
    acc_t* qcols = s.qt.data() + hh * qt_.nq;
    if constexpr (std::is_same_v<scalar_t, acc_t>) {  // q rows read in place
      mk::transpose_rows<acc_t>(qh, p.q_row_stride, qt_.nq, D, qscale, true, qcols, C);
    } else {  // converted first
      if (s.qrows.empty()) s.qrows.resize(static_cast<size_t>(kBlockQ * s.Dp));
      load_rows(qh, p.q_row_stride, qt_.nq, D, s.qrows.data(), s.Dp);
      mk::transpose_rows<acc_t>(s.qrows.data(), s.Dp, qt_.nq, D, qscale, true, qcols, C);
    }
  }
  // score terms and dropout (common/attention_mask.h)
  const ScoreTerms terms = p.score_terms();
  const bool dropout = terms.has_dropout();
  const uint32_t thresh = dropout::threshold(terms.dropout_p);
  const acc_t inv_keep = static_cast<acc_t>(1.0 / (1.0 - terms.dropout_p));
  if (dropout) {
    for (int64_t hh = 0; hh < qt_.nh; ++hh) {
      for (int64_t ii = 0; ii < qt_.nq; ++ii) {
        s.rk[hh * qt_.nq + ii] = terms.dropout_row_key(qt_.b, qt_.h0 + hh, qt_.i0 + ii);
      }
    }
  }
  std::fill(s.m.begin(), s.m.begin() + C, -std::numeric_limits<acc_t>::infinity());
  std::fill(s.l.begin(), s.l.begin() + C, acc_t(0));
  std::fill(s.o.begin(), s.o.begin() + C * Dvp, acc_t(0));
  if (s.amx_pv) std::fill(s.ot.begin(), s.ot.begin() + Dv * round_up(C, 16), 0.f);

  const scalar_t* kh = k + qt_.b * p.k_batch_stride + qt_.hkv * p.k_head_stride + sq.k0 * p.k_row_stride;
  const scalar_t* vh = v + qt_.b * p.v_batch_stride + qt_.hkv * p.v_head_stride + sq.k0 * p.v_row_stride;
  const int64_t i0 = qt_.i0, nq = qt_.nq;
  const bool one_head = qt_.nh == 1;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  // k / v rows read in place where they already are acc_t (k is only broadcast from, so any
  // row stride works; v needs Dv % 8 == 0 to be a gemm B operand) and do not alias in the
  // cache, else converted / packed (kb / vb, or the head's rows in hk / hv when those of the
  // packed ones fit the worker's share)
  const bool k_in_place = !s.bf16dp && std::is_same_v<scalar_t, acc_t> &&
                          rows_read_in_place(p.k_row_stride, D, sizeof(acc_t));
  // (v rows that alias as a B operand, b_rows_alias, are packed at the padded s.ldvb: the
  // head's rows when they fit so, else each tile's; v rows packed anyway whose head fits only
  // unpadded keep Dvp)
  const bool v_dense = !s.amx_pv && std::is_same_v<scalar_t, acc_t> && Dv == Dvp &&
                       rows_read_in_place(p.v_row_stride, Dv, sizeof(acc_t));
  const bool v_in_place = v_dense && !b_rows_alias(p.v_row_stride, Dv, sizeof(acc_t));
  const int64_t k_cols = k_in_place || s.bf16dp ? 0 : Dp;
  const bool v_packed = !v_in_place && !s.amx_pv;
  int64_t v_ld = s.ldvb;
  bool head_rows = s.head_reuse &&
                   head_rows_fit(sq.Sk, k_cols, v_packed ? v_ld : 0, sizeof(acc_t), s.head_rows_budget);
  if (s.head_reuse && !head_rows && v_packed && !v_dense &&
      head_rows_fit(sq.Sk, k_cols, Dvp, sizeof(acc_t), s.head_rows_budget)) {
    head_rows = true;
    v_ld = Dvp;
  }
  // v^T's pairs of the whole head (pass 3 on tiles) within the same share, next to k's rows
  // where pass 1 converts them
  // (fp16 on tiles: k's hi / lo rows and v^T's hi / lo pairs, the same bytes as fp32 rows)
  const int64_t split_k_bytes = s.split ? sq.Sk * D * 4 : 0;
  const bool vp_whole =
      s.head_reuse && s.amx_pv && (s.bf16dp ? split_k_bytes : sq.Sk * Dp * int64_t(sizeof(acc_t))) +
                          Dv * round_up(sq.Sk, 32) * (s.split ? 4 : 2) <= s.head_rows_budget;
  const bool k_whole = vp_whole;
  // bf16 k rows a multiple of 1 KiB apart (and not dense): copied D apart first (HeadRows16),
  // the head's when they fit the share next to v^T's pairs
  const bool k16 = s.bf16dp && !s.split && rows16_alias(p.k_row_stride, D);
  const int64_t v_share = s.amx_pv ? Dv * round_up(sq.Sk, 32) * 2  // v^T's pairs, or v's rows
                                   : (v_packed && head_rows ? sq.Sk * v_ld * int64_t(sizeof(acc_t)) : 0);
  const bool k16_whole = s.head_reuse && sq.Sk * D * 2 + v_share <= s.head_rows_budget;
  // the q rows of the worker's likely next tile (`next`), asked for a share at each key tile
  // (into L2), so that its transpose does not wait on them
  const int64_t pf_rows = next != nullptr && next->nq > 0 ? next->nh * next->nq : 0;
  const int64_t pf_step = pf_rows > 0 ? ceil_div(pf_rows, std::max<int64_t>(1, ceil_div(kend - kbeg, kBlockK))) : 0;
  int64_t pf_done = 0;
  for (int64_t j0 = kbeg; j0 < kend; j0 += kBlockK) {
    const int64_t nk = std::min(kBlockK, kend - j0);
    for (const int64_t pf_end = std::min(pf_rows, pf_done + pf_step); pf_done < pf_end; ++pf_done) {
      const int64_t hh = pf_done / next->nq, ii = pf_done % next->nq;
      prefetch_range(q + next->b * p.q_batch_stride + (next->h0 + hh) * p.q_head_stride +
                         (next->s.q0 + next->i0 + ii) * p.q_row_stride,
                     D * static_cast<int64_t>(sizeof(scalar_t)));
    }
    TileKind kind = vis.classify(sq, i0, i0 + nq, j0, j0 + nk);
    if (kind == TileKind::kInvisible) continue;
    if (vis.has_padding()) {
      int64_t n_valid = 0;
      for (int64_t r = 0; r < nk; ++r) n_valid += (s.kvalid[r] = vis.key_valid(qt_.b, j0 + r));
      if (n_valid == 0) continue;
      if (n_valid < nk) kind = TileKind::kPartial;
    }
    const bool partial = kind == TileKind::kPartial;
    // k and v rows in the accumulation type (k_in_place / v_in_place above)
    const acc_t* kt;
    const acc_t* vt;
    int64_t ldk, ldv;
    if (s.bf16dp) {  // pass 1 reads k's bf16 rows in place (kbf below) or splits them (s.ksplit)
      kt = nullptr;
      ldk = 0;
    } else if (k_in_place) {
      kt = reinterpret_cast<const acc_t*>(kh + j0 * p.k_row_stride);
      ldk = p.k_row_stride;
    } else {
      kt = s.hk.tile(head_rows, kh, p.k_row_stride, sq.Sk, D, Dp, j0, nk, s.kb);
      ldk = Dp;
    }
    if (s.amx_pv) {  // pass 3 reads v's bf16 rows (s.vp)
      vt = nullptr;
      ldv = 0;
    } else if (v_in_place) {
      vt = reinterpret_cast<const acc_t*>(vh + j0 * p.v_row_stride);
      ldv = p.v_row_stride;
    } else {
      vt = s.hv.tile(head_rows, vh, p.v_row_stride, sq.Sk, Dv, v_ld, j0, nk, s.vb);
      ldv = v_ld;
    }
    // Columns [a, b) of head block hh that see key j0 + r by the band.
    auto key_cols = [&](int64_t r) {
      const Range rows = vis.band_rows(sq, j0 + r);
      return Range{std::clamp<int64_t>(rows.lo - i0, 0, nq), std::clamp<int64_t>(rows.hi - i0, 0, nq)};
    };
    // pass 1: st (nk, C) = k rows (nk, D) qt (D, C); one head: only the column panels some
    // of each 6 keys' rows see
    // (bf16dp: scores_bf16dp on k's bf16 rows where they are, the same panels)
    const auto* kbf = reinterpret_cast<const uint16_t*>(kh + j0 * p.k_row_stride);
    auto pass1 = [&](int64_t r0, int64_t rows, int64_t c0, int64_t n) {
      if constexpr (std::is_same_v<acc_t, float>) {
        if (s.split) {  // (the whole tile: s.amx)
          const uint16_t* klo = nullptr;
          const uint16_t* khi = s.ksplit.get(k_whole, reinterpret_cast<const uint16_t*>(kh),
                                             p.k_row_stride, sq.Sk, D, j0 + r0, rows, &klo);
          mk::scores_amx_split(rows, n, D, khi, klo, D, s.qp.data() + c0,
                               s.qp.data() + D / 2 * C + c0, C, qscale,
                               s.st.data() + r0 * C + c0, C);
          return;
        }
        if (s.bf16dp) {
          const uint16_t* ka = kbf + r0 * p.k_row_stride;
          int64_t lda = p.k_row_stride;
          if (k16) {
            ka = s.k16.get(k16_whole, reinterpret_cast<const uint16_t*>(kh), p.k_row_stride, sq.Sk,
                           D, j0 + r0, rows);
            lda = D;
          }
          mk::scores_pairs(s.amx, rows, n, D, ka, lda, s.qp.data() + c0, C, qscale,
                           s.st.data() + r0 * C + c0, C);
          return;
        }
      }
      K.gemm(rows, n, D, kt + r0 * ldk, ldk, 1, s.qt.data() + c0, C, s.st.data() + r0 * C + c0, C,
             false);
    };
    if (!(partial && one_head) || s.amx) {  // (tiles: the whole tile, the mask hides the rest)
      pass1(0, nk, 0, C);
    } else {
      for (int64_t r0 = 0; r0 < nk; r0 += 6) {
        const int64_t rows = std::min<int64_t>(6, nk - r0);
        const int64_t c8 = key_cols(r0).lo / 8 * 8;
        const int64_t ce = std::min(C, round_up(key_cols(r0 + rows - 1).hi, 8));
        if (c8 < ce) pass1(r0, rows, c8, ce - c8);
      }
    }
    // terms: softcap, ALiBi, rel_bias on every key row's run of query rows of each head
    if (terms.active()) {
      apply_score_terms<acc_t>(terms, s.st.data(), nk, C, nq, qt_.nh, qt_.b, qt_.h0,
                               i0 + sq.off - j0, nullptr);
    }
    // mask: -inf wherever the visibility layer says hidden (all that pass 1 skipped included)
    if (partial) {
      for (int64_t r = 0; r < nk; ++r) {
        acc_t* row = s.st.data() + r * C;
        std::fill(row + cols, row + C, neg_inf);  // padding columns
        if (vis.has_padding() && !s.kvalid[r]) {
          std::fill(row, row + C, neg_inf);
          continue;
        }
        const Range kc = key_cols(r);
        for (int64_t hh = 0; hh < qt_.nh; ++hh) {
          std::fill(row + hh * nq, row + hh * nq + kc.lo, neg_inf);
          std::fill(row + hh * nq + kc.hi, row + (hh + 1) * nq, neg_inf);
        }
      }
    }
    // pass 2: online softmax; st becomes the probabilities (relative to the new max). On the
    // tile path without dropout it writes p's pairs for pass 3 too (mk::softmax_pairs_amx).
    const bool pairs_done = std::is_same_v<acc_t, float> && s.amx_pv && !dropout;
    if constexpr (std::is_same_v<acc_t, float>) {
      if (pairs_done) {
        const int64_t C16 = round_up(C, 16), b0 = j0 / 32;
        mk::softmax_pairs_amx(s.st.data(), C, nk, cols, j0 - 32 * b0,
                              16 * (ceil_div(j0 + nk, 32) - b0), s.m.data(), s.l.data(),
                              s.alpha.data(), s.pp.data(), s.split ? s.pp_lo(C16) : nullptr, C16);
      }
    }
    if (!pairs_done) K.softmax(s.st.data(), nk, C, s.m.data(), s.l.data(), s.alpha.data());
    // dropout on the probabilities (the sum l above is of the undropped ones)
    if (dropout) {
      dropout_tile(s.st.data(), s.st.data(), nk, C, cols, terms.dropout_col(j0), s.rk.data(),
                   s.words.data(),
                   thresh, inv_keep);
    }
    if constexpr ((std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>) &&
                  std::is_same_v<acc_t, float>) {
      if (s.amx_pv) {
        pass3_amx<scalar_t, acc_t>(p, vis, qt_, j0, nk, partial, vp_whole, vh, C, pairs_done, s);
        continue;
      }
    }
    // pass 3: o = alpha * o + st^T vb. One gemm covers every column unless the tile is
    // partial and either v holds a non-finite value (then a hidden key's must not meet a 0
    // probability) or the tile is one head's band (then each 6 columns take their keys).
    const bool v_finite = !partial || all_finite(vt, nk, Dv, ldv);
    if (K.gemm_at != nullptr && v_finite && (!partial || !one_head)) {
      // the rescale fused into the gemm's load of o: the same bits as the pass below
      K.gemm_at(cols, Dvp, nk, s.st.data(), C, vt, ldv, s.o.data(), Dvp, s.alpha.data());
      continue;
    }
    for (int64_t c = 0; c < cols; ++c) {
      const acc_t a = s.alpha[c];
      if (a != acc_t(1)) {
        acc_t* orow = s.o.data() + c * Dvp;
        for (int64_t d = 0; d < Dvp; ++d) orow[d] *= a;
      }
    }
    if (!partial) {
      K.gemm(cols, Dvp, nk, s.st.data(), 1, C, vt, ldv, s.o.data(), Dvp, true);
    } else if (!v_finite) {
      // A non-finite value in a hidden key's v must not reach the rows that cannot see it
      // (0 * inf): sum over each column's visible keys only, in the gemm's order and rounding
      // (the AVX2 gemm: one FMA chain over the tile's keys from zero, then added to o; a
      // hidden key's 0 probability adds exactly nothing), so a visible row gets the bits it
      // gets when the hidden value is finite.
      static_assert(kBlockK <= mk::kGemmKSplit, "a key tile's products are one chain");
      const bool fused = mk::gemm_fuses(K);
      acc_t* chain = s.tmp.data();  // the column's chain, from zero (mk::kGemmKBlock)
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = i0 + c % nq;
        std::fill(chain, chain + Dv, acc_t(0));
        for (int64_t r = 0; r < nk; ++r) {
          if (!vis.visible(sq, qt_.b, i, j0 + r)) continue;
          mk::axpy_as_gemm(chain, s.st[r * C + c], vt + r * ldv, Dv, fused);
        }
        mk::add_chain(s.o.data() + c * Dvp, chain, Dv);
      }
    } else if (!one_head) {
      K.gemm(cols, Dvp, nk, s.st.data(), 1, C, vt, ldv, s.o.data(), Dvp, true);
    } else {
      // keys [klo, khi) seen by some of each 6 columns (rows i0 + c0 .. i0 + c0 + 5)
      for (int64_t c0 = 0; c0 < cols; c0 += 6) {
        const int64_t mrows = std::min<int64_t>(6, cols - c0);
        const Range keys = vis.band_keys_of_rows(sq, i0 + c0, i0 + c0 + mrows);
        const int64_t klo = std::clamp<int64_t>(keys.lo - j0, 0, nk);
        const int64_t khi = std::clamp<int64_t>(keys.hi - j0, 0, nk);
        if (khi > klo) {
          K.gemm(mrows, Dvp, khi - klo, s.st.data() + klo * C + c0, 1, C, vt + klo * ldv, ldv,
                 s.o.data() + c0 * Dvp, Dvp, true);
        }
      }
    }
  }
  if constexpr (std::is_same_v<acc_t, float>) {
    if (s.amx_pv) {  // o (C, Dvp) from o^T (Dv, C16)
      const int64_t C16 = round_up(C, 16);
      for (int64_t c = 0; c < C; ++c)
        for (int64_t d = 0; d < Dv; ++d) s.o[c * Dvp + d] = s.ot[d * C16 + c];
    }
  }
  return C;
}

// out / lse of the tile's columns from o (cols, Dvp), m, l. With sinks, exp(sinks[h]) joins
// each row's denominator (a row that sees no key: out 0, lse = its sink).
template <typename scalar_t, typename acc_t>
void write_tile(const AttentionParams& p, const QueryTile& t, const acc_t* o, int64_t Dvp,
                const acc_t* m, const acc_t* l) {
  auto* out = static_cast<scalar_t*>(p.out);
  auto* lse = static_cast<acc_t*>(p.lse);
  const ScoreTerms terms = p.score_terms();
  if (terms.has_sinks()) {
    for (int64_t hh = 0; hh < t.nh; ++hh) {
      const int64_t h = t.h0 + hh;
      for (int64_t ii = 0; ii < t.nq; ++ii) {
        const int64_t c = hh * t.nq + ii;
        const int64_t i = t.i0 + ii;
        double lse_row;
        // m is in natural units here; sink_normalise takes the running max in log2 units
        // (in double: the conversion adds no fp32 rounding)
        const acc_t inv = static_cast<acc_t>(terms.sink_normalise<acc_t>(
            h, static_cast<double>(m[c]) * kLog2e, static_cast<double>(l[c]), l[c] != acc_t(0),
            &lse_row));
        scalar_t* orow = out + t.b * p.out_batch_stride + (t.s.q0 + i) * p.out_row_stride +
                         h * p.out_head_stride;
        store_row(o + c * Dvp, inv, p.Dv, orow);
        lse[t.b * p.lse_batch_stride + h * p.lse_head_stride + t.s.q0 + i] =
            static_cast<acc_t>(lse_row);
      }
    }
    return;
  }
  for (int64_t hh = 0; hh < t.nh; ++hh) {
    const int64_t h = t.h0 + hh;
    for (int64_t ii = 0; ii < t.nq; ++ii) {
      const int64_t c = hh * t.nq + ii;
      const int64_t i = t.i0 + ii;
      // l == 0 exactly: the row sees no key; NaN (a NaN/inf input) stays NaN in out and lse.
      const bool seen = l[c] != acc_t(0);
      const acc_t inv = seen ? acc_t(1) / l[c] : acc_t(0);
      scalar_t* orow = out + t.b * p.out_batch_stride + (t.s.q0 + i) * p.out_row_stride +
                       h * p.out_head_stride;
      store_row(o + c * Dvp, inv, p.Dv, orow);
      lse[t.b * p.lse_batch_stride + h * p.lse_head_stride + t.s.q0 + i] =
          seen ? static_cast<acc_t>(static_cast<double>(m[c]) + std::log(static_cast<double>(l[c])))
               : -std::numeric_limits<acc_t>::infinity();
    }
  }
}

// The rows every kernel below left with lse NaN get common/row_lse.h's answer (+inf where
// a score is +inf and none is NaN). Nothing but a scan of lse unless such a row exists. Then
// one pass over K lists, per (sequence, kv head), the keys whose row holds an inf / NaN, and
// a row's scores are classified without forming most products: a key with a finite K row
// scores finite against a finite q row (0 stands in) and +-inf / NaN against a q row with
// inf channels (their products alone decide); only the listed keys need the whole dot. A
// finite q row with finite score tables visits the listed keys alone. So even a call where
// every row meets an inf costs about one extra pass over q and K, not a second attention.
template <typename scalar_t>
void settle_nan_lse(const AttentionParams& p) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const Visibility vis = p.visibility();
  auto* lse = static_cast<acc_t*>(p.lse);
  auto lse_at = [&](const SeqInfo& s, int64_t b, int64_t h, int64_t i) -> acc_t& {
    return lse[b * p.lse_batch_stride + h * p.lse_head_stride + s.q0 + i];
  };
  bool any = false;
  for (int64_t b = 0; b < p.B && !any; ++b) {
    const SeqInfo s = vis.seq(b);
    for (int64_t h = 0; h < p.H && !any; ++h)
      for (int64_t i = 0; i < s.Sq; ++i) any |= std::isnan(lse_at(s, b, h, i));
  }
  if (!any) return;
  auto finite = [](const auto* x, int64_t n) { return all_finite(x, 1, n, n); };
  // Tables of the terms: finite ones turn a finite score into a finite one.
  const ScoreTerms terms = p.score_terms();
  const bool tables_ok =
      (terms.alibi == nullptr ||
       finite(static_cast<const acc_t*>(terms.alibi),
              terms.alibi_batch_stride == 0 ? p.H : p.B * terms.alibi_batch_stride)) &&
      (terms.rel_bias == nullptr ||
       finite(static_cast<const acc_t*>(terms.rel_bias), p.H * (2 * terms.rel_max + 1)));
  // per (sequence b, kv head hk), at b * Hkv + hk: k_ok[j] (its K row j is finite) and bad,
  // the sorted keys whose row is not
  std::vector<std::vector<uint8_t>> k_ok(static_cast<size_t>(p.B * p.Hkv));
  std::vector<std::vector<int64_t>> bad(static_cast<size_t>(p.B * p.Hkv));
  int64_t max_k = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t sk = vis.seq(b).Sk;
    max_k = std::max(max_k, sk);
    for (int64_t hk = 0; hk < p.Hkv; ++hk) k_ok[static_cast<size_t>(b * p.Hkv + hk)].resize(static_cast<size_t>(sk));
  }
  // (in memory order: tasks of kRows key rows of a sequence, every kv head of a row in turn;
  // one kv head's rows alone sit a whole row stride apart, 4 KiB and more)
  constexpr int64_t kRows = 256;
  const int64_t chunks = ceil_div(max_k, kRows);
  parallel_tasks(p.B * chunks, [] { return 0; }, [&](int64_t t, int&) {
    const int64_t b = t / chunks;
    const SeqInfo s = vis.seq(b);
    const auto* k = static_cast<const scalar_t*>(p.k) + b * p.k_batch_stride + s.k0 * p.k_row_stride;
    for (int64_t j = (t % chunks) * kRows; j < std::min(s.Sk, (t % chunks + 1) * kRows); ++j)
      for (int64_t hk = 0; hk < p.Hkv; ++hk)
        k_ok[static_cast<size_t>(b * p.Hkv + hk)][static_cast<size_t>(j)] =
            finite(k + j * p.k_row_stride + hk * p.k_head_stride, p.D);
  });
  for (size_t g = 0; g < bad.size(); ++g)
    for (size_t j = 0; j < k_ok[g].size(); ++j)
      if (!k_ok[g][j]) bad[g].push_back(static_cast<int64_t>(j));
  parallel_tasks(p.B * p.H, [] { return std::vector<int64_t>(); }, [&](int64_t t, std::vector<int64_t>& inf_d) {
    const int64_t b = t / p.H, h = t % p.H, g = b * p.Hkv + h / (p.H / p.Hkv);
    const std::vector<int64_t>& keys = bad[static_cast<size_t>(g)];
    const std::vector<uint8_t>& ok = k_ok[static_cast<size_t>(g)];
    const SeqInfo s = vis.seq(b);
    const auto* k = static_cast<const scalar_t*>(p.k) + b * p.k_batch_stride +
                    s.k0 * p.k_row_stride + (h / (p.H / p.Hkv)) * p.k_head_stride;
    auto to_acc = [](scalar_t x) { return static_cast<acc_t>(x); };
    for (int64_t i = 0; i < s.Sq; ++i) {
      acc_t& l = lse_at(s, b, h, i);
      if (!std::isnan(l)) continue;
      const scalar_t* q = static_cast<const scalar_t*>(p.q) + b * p.q_batch_stride +
                          (s.q0 + i) * p.q_row_stride + h * p.q_head_stride;
      // q's infinite channels; a NaN one makes every score NaN: the row stays NaN
      inf_d.clear();
      bool q_nan = false;
      for (int64_t d = 0; d < p.D; ++d) {
        const acc_t x = to_acc(q[d]);
        q_nan |= x != x;
        if (std::isinf(x)) inf_d.push_back(d);
      }
      if (q_nan) continue;
      auto dot = [&](int64_t j) -> acc_t {
        if (!ok[static_cast<size_t>(j)]) return row_key_dot<acc_t, scalar_t>(p, s, b, h, i, j, to_acc);
        acc_t x = acc_t(0);
        for (const int64_t d : inf_d) x += to_acc(q[d]) * to_acc(k[j * p.k_row_stride + d]);
        return x;
      };
      l = inf_d.empty() && tables_ok
              ? nan_row_lse<acc_t>(p, s, b, h, i, dot, keys.data(), static_cast<int64_t>(keys.size()))
              : nan_row_lse<acc_t>(p, s, b, h, i, dot);
    }
  });
}

template <typename scalar_t>
void attention_fwd_rows(const AttentionParams& p);

template <typename scalar_t>
void attention_fwd_kernel(const AttentionParams& p) {
  attention_fwd_rows<scalar_t>(p);
  settle_nan_lse<scalar_t>(p);
}

template <typename scalar_t>
void attention_fwd_rows(const AttentionParams& p) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  // Few query columns per kv head (decoding): the memory-bound kernel that reads K/V once.
  if constexpr (!std::is_same_v<scalar_t, double>) {
    if (decode_supported(p, false)) {
      attention_decode_kernel<scalar_t>(p);
      return;
    }
  }
  const mk::Kernels<acc_t> kern = mk::kernels<acc_t>();
  const TilePlan plan = plan_tiles(p);
  const Visibility vis = p.visibility();
  const int64_t workers = num_threads();
  const int64_t rows_budget = head_rows_budget(workers);
  constexpr bool is_bf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  // fp16 on the tiles when both products can (mk::fp16_on_tiles): pass 1 as bf16dp / amx
  // (every switch read once for the call: mk::TileRule)
  const mk::TileRule rule = mk::tile_rule();
  // (and no inf in the q and k of the unit (b, hkv) that take part: half_qk_inf_units; a call
  // whose units differ runs the tiled ones, then the widened ones)
  run_fp16_units(p, vis, std::is_same_v<scalar_t, c10::Half> && rule.fp16_on_tiles(p.D, p.Dv),
                 [&](bool split, UnitFilter filter) {
    const bool bf16dp = split || rule.bf16_scores_by_pairs(is_bf16, p.D);
    const bool amx = split || (bf16dp && rule.amx_for(p.D));
    const bool amx_pv = split || (is_bf16 && rule.amx_pv_for(p.Dv));
    auto make_scratch = [&] {
      FwdScratch<acc_t> s(p.D, p.Dv);
      s.head_rows_budget = rows_budget;
      s.bf16dp = bf16dp;
      s.amx = amx;
      s.amx_pv = amx_pv;
      s.split = split;
      s.vp.split = split;
      if (amx_pv) {  // pass 3 on tiles: o^T, p's pairs, one key tile's v^T pairs
        const int64_t C16 = round_up(kBlockQ, 16);
        s.ot.resize(static_cast<size_t>(p.Dv * C16));
        s.pp.resize(static_cast<size_t>((split ? 2 : 1) * kAmxKeyRows / 2 * C16));
        s.vp.tile.resize(static_cast<size_t>(p.Dv * kAmxKeyRows / 2));
      }
      if (split) {
        s.vp.tile_lo.resize(static_cast<size_t>(p.Dv * kAmxKeyRows / 2));
        s.vp.rhi.resize(static_cast<size_t>(32 * p.Dv));
        s.vp.rlo.resize(static_cast<size_t>(32 * p.Dv));
        s.qp.resize(static_cast<size_t>(p.D * kBlockQ));
        s.rhi.resize(static_cast<size_t>(kBlockQ * p.D));
        s.rlo.resize(s.rhi.size());
      }
      return s;
    };

    // Split-KV when there are fewer tiles than threads and enough keys to share. With dropout
    // the plan counts kDropoutSplitWorkers instead of the threads (bitwise the same output at
    // any thread count).
    const int64_t plan_workers = p.score_terms().has_dropout() ? kDropoutSplitWorkers : workers;
    int64_t n_split = 1;
    if (plan.n_tiles < plan_workers && p.Sk >= 4 * kBlockK) {
      n_split = std::min(ceil_div(2 * plan_workers, plan.n_tiles), p.Sk / (2 * kBlockK));
    }
    if (n_split <= 1) {
      // groups: the tiles of one (sequence, kv head) (tile_at's order), so a worker converts a
      // head's K / V rows once (HeadRows) and the tiles with the most keys go first
      const int64_t per_head = plan.n_row_blocks * plan.n_head_blocks;
      parallel_groups(plan.n_tiles / per_head, per_head, make_scratch, [&](int64_t idx, FwdScratch<acc_t>& s) {
        const QueryTile t = tile_at(p, vis, plan, idx);
        if (t.nq <= 0 || !filter.takes(t.b, t.hkv)) return;
        s.head_reuse = per_head > 1;
        const Range keys = tile_keys(vis, t);
        // (the group's next tile: the one this worker most likely takes next)
        const QueryTile next = (idx + 1) % per_head != 0 ? tile_at(p, vis, plan, idx + 1) : QueryTile{};
        run_tile<scalar_t, acc_t>(p, vis, t, keys.lo, keys.hi, kern, s, &next);
        write_tile<scalar_t, acc_t>(p, t, s.o.data(), s.Dvp, s.m.data(), s.l.data());
      });
      return;
    }

    // Split-KV. pass 1: each (tile, chunk) writes its partial o, m, l;
    // pass 2: each tile merges its chunks through their maxima.
    const int64_t Dvp = round_up(p.Dv, 8);
    const int64_t per_part = kBlockQ * (Dvp + 2);  // o (kBlockQ, Dvp), m, l (kBlockQ)
    AlignedVec<acc_t> parts(static_cast<size_t>(plan.n_tiles * n_split * per_part));
    parallel_tasks(plan.n_tiles * n_split, make_scratch, [&](int64_t idx, FwdScratch<acc_t>& s) {
      const QueryTile t = tile_at(p, vis, plan, idx / n_split);
      if (t.nq <= 0 || !filter.takes(t.b, t.hkv)) return;
      const int64_t chunk = idx % n_split;
      const Range keys = tile_keys(vis, t);
      const int64_t per_chunk = round_up(ceil_div(keys.hi - keys.lo, n_split), kBlockK);
      const int64_t kbeg = std::min(keys.hi, keys.lo + chunk * per_chunk);
      const int64_t kstop = std::min(keys.hi, kbeg + per_chunk);
      s.head_reuse = false;  // (a chunk's rows: one tile reads them)
      run_tile<scalar_t, acc_t>(p, vis, t, kbeg, kstop, kern, s);
      acc_t* dst = parts.data() + idx * per_part;
      const int64_t cols = t.cols();
      std::copy(s.o.begin(), s.o.begin() + cols * Dvp, dst);
      std::copy(s.m.begin(), s.m.begin() + cols, dst + kBlockQ * Dvp);
      std::copy(s.l.begin(), s.l.begin() + cols, dst + kBlockQ * Dvp + kBlockQ);
  });
  parallel_tasks(plan.n_tiles, [&] { return AlignedVec<acc_t>(static_cast<size_t>(kBlockQ * (Dvp + 2))); },
                 [&](int64_t idx, AlignedVec<acc_t>& merged) {
    const QueryTile t = tile_at(p, vis, plan, idx);
    if (t.nq <= 0 || !filter.takes(t.b, t.hkv)) return;
    const int64_t cols = t.cols();
    acc_t* o = merged.data();
    acc_t* m = o + kBlockQ * Dvp;
    acc_t* l = m + kBlockQ;
    for (int64_t c = 0; c < cols; ++c) {
      m[c] = merge_chunks<acc_t>(n_split, [&](int64_t sp) {
        const acc_t* part = parts.data() + (idx * n_split + sp) * per_part;
        return ChunkState<acc_t>{part[kBlockQ * Dvp + c], part[kBlockQ * Dvp + kBlockQ + c], part + c * Dvp};
      }, Dvp, Dvp, o + c * Dvp, l + c);
    }
    write_tile<scalar_t, acc_t>(p, t, o, Dvp, m, l);
  });
  });
}

std::tuple<Tensor, Tensor> attention_forward_cpu(
    const Tensor& q, const Tensor& k, const Tensor& v, bool causal, std::optional<double> scale,
    int64_t window_left, int64_t window_right, const OptTensor& key_padding_mask,
    const OptTensor& alibi_slopes, const OptTensor& rel_bias, std::optional<double> softcap,
    const OptTensor& sinks, double dropout_p, int64_t dropout_seed, int64_t dropout_offset,
    std::optional<int64_t> q_start, std::optional<int64_t> k_start) {
  const AttentionShape s = check_attention_inputs(q, k, v, scale);
  Tensor out = alloc(q, {s.B, s.Sq, s.H, s.Dv});
  Tensor lse = alloc(q, {s.B, s.H, s.Sq}, lse_dtype(q.scalar_type()));
  AttentionParams p = make_attention_params(q, k, v, out, lse, s, causal, scale);
  fill_mask_params(p, s, q, causal, window_left, window_right, key_padding_mask);
  const AccTables tab(alibi_slopes, rel_bias, sinks, q);
  fill_score_terms(p, {tab.alibi_slopes, tab.rel_bias, softcap, tab.sinks, dropout_p, dropout_seed,
                       dropout_offset}, q, s.B, s.H);
  fill_block_position(p, q_start, k_start, sinks.has_value());
  if (s.B * s.H * s.Sq == 0) return {out, lse};
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), "attention_forward",
                             [&] { attention_fwd_kernel<scalar_t>(p); });
  return {out, lse};
}

// Packed sequences: q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv) -> out (Tq, H, Dv),
// lse (H, Tq).
std::tuple<Tensor, Tensor> attention_varlen_forward_cpu(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
    const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    std::optional<double> scale, int64_t window_left, int64_t window_right,
    const OptTensor& alibi_slopes, const OptTensor& rel_bias, std::optional<double> softcap,
    const OptTensor& sinks, double dropout_p, int64_t dropout_seed, int64_t dropout_offset) {
  const AttentionShape s = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, scale);
  const int64_t Tq = q.size(0);
  Tensor out = alloc(q, {Tq, s.H, s.Dv});
  Tensor lse = alloc(q, {s.H, Tq}, lse_dtype(q.scalar_type()));
  AttentionParams p = make_attention_params(
      torch::stable::unsqueeze(q, 0), torch::stable::unsqueeze(k, 0),
      torch::stable::unsqueeze(v, 0), torch::stable::unsqueeze(out, 0), lse, s, causal, scale);
  make_params_packed(p, s, Tq, k.size(0), cu_seqlens_q, cu_seqlens_k, causal, window_left, window_right);
  const AccTables tab(alibi_slopes, rel_bias, sinks, q);
  fill_score_terms(p, {tab.alibi_slopes, tab.rel_bias, softcap, tab.sinks, dropout_p, dropout_seed,
                       dropout_offset}, q, s.B, s.H);
  if (Tq * s.H == 0 || s.B == 0) return {out, lse};
  ATTN_EXT_DISPATCH_FLOATING(q.scalar_type(), "attention_varlen_forward",
                             [&] { attention_fwd_kernel<scalar_t>(p); });
  return {out, lse};
}

}  // namespace
}  // namespace cpu_attn

ATTN_EXT_LIBRARY_IMPL(CPU, m) {
  m.impl("attention_forward", TORCH_BOX(&cpu_attn::attention_forward_cpu));
  m.impl("attention_varlen_forward", TORCH_BOX(&cpu_attn::attention_varlen_forward_cpu));
}

}  // namespace attn_ext
