// The one visibility and score rule of every attention kernel (CPU forward/backward, CUDA
// simple / split-KV / fast kernels, and tools/fa2_emulate.py through tools/mask_probe.cpp).
// Host and device; no ATen types. DESIGN.md, "Attention variants":
//
//   off = Sk - Sq  (of the row's own sequence),  d = i + off - j
//   (a block of a longer sequence, q_start / k_start of the dense ops: off = q_start - k_start,
//    through MaskParams::block, so d is the global distance)
//   row i sees key j  iff  -right <= d <= left           (window; -1 = unbounded side;
//                                                          causal is right = 0)
//                      and key_padding_mask[b, j]        (when given; True = valid)
//
// The band part (causal / window) makes the keys a row sees one contiguous range, and the
// rows a key is seen by one contiguous range, both non-decreasing in i (resp. j): that is
// what lets kernels skip whole tiles. Padding is a per-key flag on top. A kernel asks:
//   seq(b)                  the sequence's first packed q/k rows and lengths (varlen)
//   band_keys(s, i)         [lo, hi): keys row i can see by the band
//   band_rows(s, j)         [lo, hi): rows that see key j by the band
//   classify(s, i0, i1, j0, j1)   kFull / kPartial / kInvisible for a (query, key) tile,
//                           by the band; key padding then makes a full tile partial
//   full_key_tiles / full_row_tiles   the tiles classify() calls kFull, as one range
//   visible(s, b, i, j)     the per-(i, j) predicate (band and padding)
//   band_visible(s, i, j)   its band part (and the sequence's bounds), without padding
//   tile_band(s, i0, j0, R, C)   band_visible of one tile in tile-local 32-bit coordinates
//                           (what the CUDA fast kernels evaluate per element)
// and the score terms of a visible pair come from ScoreTerms (softcap, ALiBi, rel_bias, sinks,
// dropout; below).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/dropout_rng.h"

#if defined(__CUDACC__)
#include <cassert>
#endif

#if defined(__CUDACC__)
#define ATTN_MASK_FN __host__ __device__ __forceinline__
#else
#define ATTN_MASK_FN inline
#endif

namespace attn_ext {

// Mask part of the attention params (filled by fill_mask_params in attention_checks.h).
struct MaskParams {
  // Window (left, right) with causal folded in (causal: right = min(right, 0)); -1 = unbounded.
  int64_t left = -1;
  int64_t right = -1;
  // key_padding_mask (B, Sk) bool as bytes, nullptr when absent. 1 = the key takes part.
  const uint8_t* key_padding = nullptr;
  int64_t kpm_batch_stride = 0, kpm_key_stride = 0;
  // Packed sequences: cu_seqlens_q / cu_seqlens_k int32 (B + 1,), nullptr when not packed.
  // Then B is the number of sequences, Sq / Sk of the params are max_seqlen_q / max_seqlen_k,
  // the batch strides are 0 and sequence b owns packed rows [cu[b], cu[b + 1]).
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  // When packed: the number of sequences and of packed q / k rows (Tq, Tk), against which
  // seq(b) checks the cu_seqlens values (on CUDA they are never read on the host).
  int64_t n_seq = 0, total_q = 0, total_k = 0;
  // A block of a longer sequence at global positions (q_start / k_start of the dense ops):
  // then off = q_start - k_start instead of Sk - Sq, and dropout draws the bits of global rows
  // q_start + i and keys k_start + j (AttentionParams::score_terms() hands them to ScoreTerms).
  bool block = false;
  int64_t q_start = 0, k_start = 0;
};

enum class TileKind : int { kInvisible = 0, kPartial = 1, kFull = 2 };

// One sequence of the batch (or of the packed batch).
struct SeqInfo {
  int64_t q0, k0;  // first packed row (0 when not packed: rows are addressed per batch)
  int64_t Sq, Sk;  // its lengths
  int64_t off;     // Sk - Sq: bottom-right alignment
};

struct Range {
  int64_t lo, hi;  // [lo, hi), lo <= hi
};

// The band predicate of one tile, rows [i0, i0 + R) x keys [j0, j0 + C), in tile-local
// coordinates r = i - i0, c = j - j0 (32-bit: cheap in a kernel's inner loop). Filled by
// Visibility::tile_band; ok(r, c) == band_visible(s, i0 + r, j0 + c) for 0 <= r < R,
// 0 <= c < C (tools/mask_probe.cpp checks it).
struct TileBand {
  int lo, hi;        // r - c must lie in [lo, hi] (d = d0 + r - c, d0 = i0 + off - j0)
  int row_lim, key_lim;  // r < row_lim, c < key_lim: the sequence's rows and keys
  ATTN_MASK_FN bool ok(int r, int c) const {
    return r < row_lim && c < key_lim && r - c >= lo && r - c <= hi;
  }
};

// tile_band in 32-bit arithmetic for the CUDA kernels' tile loops (fewer registers than the
// 64-bit fields of SeqInfo / MaskParams): Visibility::tile_bands(s) fills it once per CTA,
// at(i0, j0, R, C) then equals tile_band(s, i0, j0, R, C) for tiles that start inside the
// sequence (tools/mask_probe.cpp checks it). Exact when every |d| = |i + off - j| of the
// sequence is below 2^30, which Sq + Sk < 2^30 guarantees (the adapters check it before they
// pick the fast kernels; a position shift of the sequence must be counted in): window sides
// >= 2^30 are then as good as unbounded, and d0, -right - d0, left - d0 fit 32 bits.
struct TileBands {
  int off, left, right, Sq, Sk;  // left / right: -1 = unbounded
  ATTN_MASK_FN TileBand at(int i0, int j0, int R, int C) const {
    const int d0 = i0 + off - j0;
    int lo = right >= 0 ? -right - d0 : -C;
    int hi = left >= 0 ? left - d0 : R;
    lo = lo < -C ? -C : (lo > R ? R : lo);
    hi = hi < -C ? -C : (hi > R ? R : hi);
    int rl = Sq - i0, kl = Sk - j0;
    rl = rl < 0 ? 0 : (rl > R ? R : rl);
    kl = kl < 0 ? 0 : (kl > C ? C : kl);
    return TileBand{lo, hi, rl, kl};
  }
};

struct Visibility {
  MaskParams m;
  int64_t Sq, Sk;  // the params' lengths (max lengths when packed)

  ATTN_MASK_FN bool packed() const { return m.cu_seqlens_q != nullptr; }
  ATTN_MASK_FN bool has_padding() const { return m.key_padding != nullptr; }
  // True when every (i, j) of the sequence is visible (no band, no padding): kernels may
  // then skip the mask entirely.
  ATTN_MASK_FN bool dense() const { return m.left < 0 && m.right < 0 && !has_padding(); }

  // Packed: the cu_seqlens values are checked here (the CPU adapters check them on the host
  // first; CUDA never reads them on the host, which would synchronise): they must start at 0,
  // be non-decreasing, end at the packed row counts, and no sequence may be longer than
  // max_seqlen (Sq / Sk). A bad sequence trips a device assert (reported at the next
  // synchronising CUDA call) and is treated as empty, so no kernel reads out of bounds.
  ATTN_MASK_FN SeqInfo seq(int64_t b) const {
    SeqInfo s;
    if (packed()) {
      const int64_t q0 = m.cu_seqlens_q[b], q1 = m.cu_seqlens_q[b + 1];
      const int64_t k0 = m.cu_seqlens_k[b], k1 = m.cu_seqlens_k[b + 1];
      const bool ok = q0 >= 0 && q0 <= q1 && q1 <= m.total_q && q1 - q0 <= Sq && k0 >= 0 &&
                      k0 <= k1 && k1 <= m.total_k && k1 - k0 <= Sk &&
                      (b != 0 || (q0 == 0 && k0 == 0)) &&
                      (b + 1 != m.n_seq || (q1 == m.total_q && k1 == m.total_k));
      if (!ok) {
#if defined(__CUDA_ARCH__)
        __assert_fail(
            "cu_seqlens_q / cu_seqlens_k must start at 0, be non-decreasing, end at the number "
            "of packed rows, and max_seqlen_q / max_seqlen_k must be >= every sequence's length",
            __FILE__, __LINE__, __func__);
#endif
        s.q0 = s.k0 = s.Sq = s.Sk = s.off = 0;
        return s;
      }
      s.q0 = q0;
      s.k0 = k0;
      s.Sq = q1 - q0;
      s.Sk = k1 - k0;
    } else {
      s.q0 = 0;
      s.k0 = 0;
      s.Sq = Sq;
      s.Sk = Sk;
    }
    s.off = m.block ? m.q_start - m.k_start : s.Sk - s.Sq;
    return s;
  }

  // How far a block's offset is from the bottom-right alignment of its own lengths (0 unless
  // block): off = Sk - Sq + pos_shift().
  ATTN_MASK_FN int64_t pos_shift() const {
    return m.block ? (m.q_start - m.k_start) - (Sk - Sq) : 0;
  }

  // Keys [lo, hi) that row i sees by the band: j >= i + off - left, j <= i + off + right.
  ATTN_MASK_FN Range band_keys(const SeqInfo& s, int64_t i) const {
    int64_t lo = 0, hi = s.Sk;
    if (m.left >= 0 && i + s.off - m.left > lo) lo = i + s.off - m.left;
    if (m.right >= 0 && i + s.off + m.right + 1 < hi) hi = i + s.off + m.right + 1;
    if (lo > s.Sk) lo = s.Sk;
    if (hi < lo) hi = lo;
    return {lo, hi};
  }

  // Rows [lo, hi) that see key j by the band: i >= j - off - right, i <= j - off + left.
  ATTN_MASK_FN Range band_rows(const SeqInfo& s, int64_t j) const {
    int64_t lo = 0, hi = s.Sq;
    if (m.right >= 0 && j - s.off - m.right > lo) lo = j - s.off - m.right;
    if (m.left >= 0 && j - s.off + m.left + 1 < hi) hi = j - s.off + m.left + 1;
    if (lo > s.Sq) lo = s.Sq;
    if (hi < lo) hi = lo;
    return {lo, hi};
  }

  // Keys some row of [i0, i1) sees by the band (i0 < i1): both ends are non-decreasing in i.
  ATTN_MASK_FN Range band_keys_of_rows(const SeqInfo& s, int64_t i0, int64_t i1) const {
    const Range a = band_keys(s, i0), z = band_keys(s, i1 - 1);
    return {a.lo, z.hi > a.lo ? z.hi : a.lo};
  }
  // Rows that see some key of [j0, j1) by the band (j0 < j1).
  ATTN_MASK_FN Range band_rows_of_keys(const SeqInfo& s, int64_t j0, int64_t j1) const {
    const Range a = band_rows(s, j0), z = band_rows(s, j1 - 1);
    return {a.lo, z.hi > a.lo ? z.hi : a.lo};
  }

  // The (rows [i0, i1), keys [j0, j1)) tile by the band: kFull when every row sees every key,
  // kInvisible when no row sees any key, else kPartial. (Padding is the caller's second step:
  // a full tile with a padded key is partial, a tile whose keys are all padded is invisible.)
  ATTN_MASK_FN TileKind classify(const SeqInfo& s, int64_t i0, int64_t i1, int64_t j0,
                                 int64_t j1) const {
    if (i0 >= i1 || j0 >= j1) return TileKind::kInvisible;
    const Range keys = band_keys_of_rows(s, i0, i1);
    if (keys.hi <= j0 || keys.lo >= j1) return TileKind::kInvisible;
    const Range first = band_keys(s, i0), last = band_keys(s, i1 - 1);
    // every row's range covers [j0, j1): the latest lo and the earliest hi bound it
    if (last.lo <= j0 && first.hi >= j1) return TileKind::kFull;
    return TileKind::kPartial;
  }

  // The key tiles of N keys (tile t: keys [t N, min(t N + N, Sk))) that classify() calls kFull
  // for the rows [i0, i1) (i0 < i1): one contiguous range [lo, hi) of tile indices, since
  // both ends of the rows' bands are non-decreasing. Kernels walk the tiles of
  // band_keys_of_rows (none of them invisible by the band: a row's range and the next row's
  // overlap or touch) and take the full ones from here instead of classifying each tile
  // (tools/mask_probe.cpp checks the two against each other).
  ATTN_MASK_FN Range full_key_tiles(const SeqInfo& s, int64_t i0, int64_t i1, int64_t N) const {
    return full_tiles(band_keys(s, i0), band_keys(s, i1 - 1), s.Sk, N);
  }
  // Likewise the query tiles of M rows in which every row sees every key of [j0, j1) by the
  // band (classify(t M, min(t M + M, Sq), j0, j1) == kFull).
  ATTN_MASK_FN Range full_row_tiles(const SeqInfo& s, int64_t j0, int64_t j1, int64_t M) const {
    return full_tiles(band_rows(s, j0), band_rows(s, j1 - 1), s.Sq, M);
  }
  // Tiles t of N (of a dimension of length len) inside every range from `first` to `last`
  // (both ends non-decreasing): t N >= last.lo and min(t N + N, len) <= first.hi.
  ATTN_MASK_FN static Range full_tiles(const Range& first, const Range& last, int64_t len,
                                       int64_t N) {
    const int64_t lo = (last.lo + N - 1) / N;
    int64_t hi = first.hi >= len ? (len + N - 1) / N : first.hi / N;
    if (hi < lo) hi = lo;
    return {lo, hi};
  }

  // The tiles a fast CUDA kernel walks (32-bit: Sq + Sk < 2^30 there), for the rows [i0, i1)
  // over key tiles of N (key_tile_span) or the keys [j0, j1) over query tiles of M
  // (row_tile_span): [begin, end) the tiles holding a pair the band shows (band_keys_of_rows /
  // band_rows_of_keys; empty when it shows none), [full_lo, full_hi) the kFull ones among them
  // (full_key_tiles / full_row_tiles). TileSpan::dense: every tile of len, all full.
  struct TileSpan {
    int begin = 0, end = 0, full_lo = 0, full_hi = 0;
    ATTN_MASK_FN static TileSpan dense(int64_t len, int64_t N) {
      TileSpan t;
      t.end = t.full_hi = static_cast<int>((len + N - 1) / N);
      return t;
    }
  };
  // (i0 < i1, j0 < j1)
  ATTN_MASK_FN TileSpan key_tile_span(const SeqInfo& s, int64_t i0, int64_t i1, int64_t N) const {
    return tile_span(band_keys_of_rows(s, i0, i1), full_key_tiles(s, i0, i1, N), N);
  }
  ATTN_MASK_FN TileSpan row_tile_span(const SeqInfo& s, int64_t j0, int64_t j1, int64_t M) const {
    return tile_span(band_rows_of_keys(s, j0, j1), full_row_tiles(s, j0, j1, M), M);
  }
  ATTN_MASK_FN static TileSpan tile_span(const Range& band, const Range& full, int64_t N) {
    TileSpan t;
    if (band.hi > band.lo) {
      t.begin = static_cast<int>(band.lo / N);
      t.end = static_cast<int>((band.hi + N - 1) / N);
      t.full_lo = static_cast<int>(full.lo);
      t.full_hi = static_cast<int>(full.hi);
    }
    return t;
  }

  ATTN_MASK_FN bool key_valid(int64_t b, int64_t j) const {
    return m.key_padding == nullptr ||
           m.key_padding[b * m.kpm_batch_stride + j * m.kpm_key_stride] != 0;
  }

  // The band part of the predicate: row i and key j lie in the sequence and -right <= d <= left.
  ATTN_MASK_FN bool band_visible(const SeqInfo& s, int64_t i, int64_t j) const {
    const int64_t d = i + s.off - j;
    if (m.right >= 0 && d < -m.right) return false;
    if (m.left >= 0 && d > m.left) return false;
    return i >= 0 && i < s.Sq && j >= 0 && j < s.Sk;
  }

  // The predicate: row i of sequence b (local indices) sees key j.
  ATTN_MASK_FN bool visible(const SeqInfo& s, int64_t b, int64_t i, int64_t j) const {
    return band_visible(s, i, j) && key_valid(b, j);
  }

  // The 32-bit tile_band of sequence s (Sq + Sk < 2^30).
  ATTN_MASK_FN TileBands tile_bands(const SeqInfo& s) const {
    constexpr int64_t kBig = int64_t(1) << 30;
    TileBands t;
    t.off = static_cast<int>(s.off);
    t.left = m.left >= kBig ? -1 : static_cast<int>(m.left);
    t.right = m.right >= kBig ? -1 : static_cast<int>(m.right);
    t.Sq = static_cast<int>(s.Sq);
    t.Sk = static_cast<int>(s.Sk);
    return t;
  }

  // band_visible on the tile rows [i0, i0 + R) x keys [j0, j0 + C) as a TileBand: with
  // d = d0 + (r - c), -right <= d <= left becomes -right - d0 <= r - c <= left - d0, and since
  // r - c lies in [1 - C, R - 1], bounds outside [-C, R] are clamped there without changing
  // any answer (so they fit 32 bits whatever the 64-bit positions are).
  ATTN_MASK_FN TileBand tile_band(const SeqInfo& s, int64_t i0, int64_t j0, int R, int C) const {
    const int64_t d0 = i0 + s.off - j0;
    int64_t lo = m.right >= 0 ? -m.right - d0 : -C;
    int64_t hi = m.left >= 0 ? m.left - d0 : R;
    lo = lo < -C ? -C : (lo > R ? R : lo);
    hi = hi < -C ? -C : (hi > R ? R : hi);
    int64_t rl = s.Sq - i0, kl = s.Sk - j0;
    rl = rl < 0 ? 0 : (rl > R ? R : rl);
    kl = kl < 0 ? 0 : (kl > C ? C : kl);
    TileBand t;
    t.lo = static_cast<int>(lo);
    t.hi = static_cast<int>(hi);
    t.row_lim = static_cast<int>(rl);
    t.key_lim = static_cast<int>(kl);
    return t;
  }
};

// Score terms of a visible pair (b, h, i, j) (DESIGN.md, "Attention variants"), in one place:
//
//   s = scale * q . k                                (kernels fold scale into q)
//   s = softcap * tanh(s / softcap)                  if softcap > 0
//   s += -alibi[b, h] * |d|                          if alibi
//   s += rel_bias[h, M + clamp(d, -M, M)]            if rel_bias (H, 2M + 1)
//
// plus the two row-level terms: sinks[h] joins every row's softmax denominator (handled where
// a kernel normalises, from sink(h)), and dropout with the keep bit of common/dropout_rng.h.
// A kernel calls apply_row() on scores only when active(). Scores may be kept in other units
// than the natural log (e.g. log2 units): `unit` multiplies every term.
// The table pointers are of the accumulation type (float, or double for double inputs).
struct ScoreTerms {
  double scale = 1.0;
  double softcap = 0.0;           // > 0: cap the scores
  const void* alibi = nullptr;    // slope of (b, h) at alibi[b * alibi_batch_stride + h]
  int64_t alibi_batch_stride = 0; // 0 for (H,) slopes
  const void* rel_bias = nullptr; // (H, 2M + 1) contiguous
  int64_t rel_max = 0;            // M
  const void* sinks = nullptr;    // (H,)
  double dropout_p = 0.0;         // drop probability in [0, 1)
  uint64_t dropout_seed = 0, dropout_offset = 0;
  // Global index of the call's first query row / key (MaskParams' q_start / k_start, set by
  // AttentionParams::score_terms(); 0 otherwise): the keep bit is drawn for (b, h, row0 + i,
  // col0 + j), so a block of a longer sequence drops what the whole-sequence call drops.
  int64_t dropout_row0 = 0, dropout_col0 = 0;

  ATTN_MASK_FN bool active() const {
    return softcap > 0.0 || alibi != nullptr || rel_bias != nullptr;
  }
  ATTN_MASK_FN bool has_sinks() const { return sinks != nullptr; }
  ATTN_MASK_FN bool has_dropout() const { return dropout_p > 0.0; }
  // Nothing beyond the scale: the plain kernel applies.
  ATTN_MASK_FN bool plain() const { return !active() && !has_sinks() && !has_dropout(); }

  template <typename T>
  ATTN_MASK_FN T slope(int64_t b, int64_t h) const {
    return static_cast<const T*>(alibi)[b * alibi_batch_stride + h];
  }
  template <typename T>
  ATTN_MASK_FN T sink(int64_t h) const {
    return static_cast<const T*>(sinks)[h];
  }
  // A row's normalisation with sinks[h] joining its softmax denominator (DESIGN.md: every
  // row's, and lse includes it), in double: m2 and l are the running max (log2 units) and sum
  // of exp2(s2 - m2) over the row's keys, seen = (l != 0). Returns the factor that multiplies
  // the row's unnormalised output and writes its lse (natural units): a row that saw no key
  // gets factor 0 and lse = sinks[h]; a NaN m2 or l gives NaN. T: the table's type.
  template <typename T>
  ATTN_MASK_FN double sink_normalise(int64_t h, double m2, double l, bool seen, double* lse) const {
    using std::exp2;
    using std::log2;
    constexpr double kLog2e_ = 1.4426950408889634074, kLn2_ = 0.69314718055994530942;
    const double sink2 = static_cast<double>(sink<T>(h)) * kLog2e_;
    // A sink of -inf is no sink (a row with no key keeps lse = -inf); +inf takes all the
    // weight (out 0, lse +inf), unless a NaN (or +inf) score met it: then NaN, as
    // torch.logsumexp over the scores and the sink (the adapters' row_lse.h settles a +inf
    // score's row to lse +inf; its out stays NaN, as the reference's). Without these two
    // cases inf - inf below would give NaN.
    if (sink2 == INFINITY) {
      const bool nan = seen && (l != l || m2 != m2);
      *lse = nan ? NAN : INFINITY;
      return nan ? NAN : 0.0;
    }
    if (sink2 == -INFINITY && !seen) {
      *lse = -INFINITY;
      return 0.0;
    }
    const double mc = seen ? m2 : -INFINITY;
    const double mm = mc > sink2 ? mc : sink2;
    const double w = seen ? exp2(mc - mm) : 0.0;  // weight of the keys' part
    const double total = l * w + exp2(sink2 - mm);
    *lse = (mm + log2(total)) * kLn2_;
    return seen ? w / total : 0.0;
  }

  // Dropout: the row key of local row i of (b, h), and the global column of local key j
  // (for dropout::word / dropout::keep of common/dropout_rng.h).
  ATTN_MASK_FN uint64_t dropout_row_key(int64_t b, int64_t h, int64_t i) const {
    return dropout::row_key(dropout_seed, dropout_offset, b, h, dropout_row0 + i);
  }
  ATTN_MASK_FN int64_t dropout_col(int64_t j) const { return dropout_col0 + j; }

  ATTN_MASK_FN static int64_t clamp_d(int64_t d, int64_t M) {
    return d < -M ? -M : (d > M ? M : d);
  }

  // The score after the terms (natural units), given the scaled dot product s and
  // d = i + off - j: the per-element form of the rule (CUDA kernels, emulator). With softcap,
  // tanh(s / softcap) is also written to *th when th is given (the backward's chain factor
  // 1 - th^2, as apply_row).
  template <typename T>
  ATTN_MASK_FN T add(T s, int64_t b, int64_t h, int64_t d, T* th = nullptr) const {
    return add_row<T, int64_t>(s, alibi != nullptr ? slope<T>(b, h) : T(0), rel_row<T>(h), d, th);
  }

  // add() with its (b, h) lookups done once by the caller (the fast CUDA kernels: per CTA or
  // per step, in 32-bit distances): slope = slope<T>(b, h) (unused without ALiBi), row =
  // rel_row<T>(h) (nullptr without rel_bias). *rd = clamp(d, -M, M) when rel_bias (the
  // backward's d rel_bias index).
  template <typename T>
  ATTN_MASK_FN const T* rel_row(int64_t h) const {
    return rel_bias == nullptr ? nullptr : static_cast<const T*>(rel_bias) + h * (2 * rel_max + 1) + rel_max;
  }
  template <typename T, typename I>
  ATTN_MASK_FN T add_row(T s, T slope_bh, const T* row, I d, T* th = nullptr, I* rd = nullptr) const {
    if (softcap > 0.0) s = cap(s, th);
    if (alibi != nullptr) s = alibi_add(s, slope_bh, d);
    // (32-bit I: the fast kernels' distances, |d| < 2^30 (fast_lengths_ok), so M is clamped
    // to 2^30 there exactly, rather than narrowed: a table of M >= 2^31 would wrap)
    const int64_t m = sizeof(I) < sizeof(int64_t) && rel_max > (int64_t(1) << 30)
                          ? (int64_t(1) << 30)
                          : rel_max;
    if (row != nullptr) s = rel_add(s, row, static_cast<I>(m), d, rd);
    return s;
  }
  // add_row's last step: s + row[clamp(d, -m, m)] (row centred, m = rel_max), the clamped
  // index to *rd when given
  template <typename T, typename I>
  ATTN_MASK_FN static T rel_add(T s, const T* row, I m, I d, I* rd = nullptr) {
    const I c = d < -m ? -m : (d > m ? m : d);
    if (rd != nullptr) *rd = c;
    return s + row[c];
  }

  // add()'s first two steps: softcap * tanh(s / softcap), with tanh(s / softcap) to *th when
  // th is given (softcap > 0); s - slope * |d|.
  template <typename T>
  ATTN_MASK_FN T cap(T s, T* th) const {
    using std::tanh;
    const T t = tanh(s / static_cast<T>(softcap));
    if (th != nullptr) *th = t;
    return static_cast<T>(softcap) * t;
  }
  template <typename T, typename I>
  ATTN_MASK_FN static T alibi_add(T s, T slope, I d) {
    return s - slope * static_cast<T>(d < 0 ? -d : d);
  }

  // The terms on one key's run of consecutive query rows: x[c], c in [0, n), is the score
  // (in units of `unit`) of query row i_first + c of head h against key j, and
  // d0 = i_first + off - j, so column c has distance d0 + c. Softcap first (writing
  // tanh(s / softcap) to th[c] when th is given: the backward's chain factor 1 - th^2), then
  // ALiBi (linear in c on each side of d = 0) and rel_bias (a contiguous slice of the table
  // between the two clamped ends): plain loops the compiler vectorises.
  template <typename T>
  inline void apply_row(T* x, int n, int64_t b, int64_t h, int64_t d0, T unit, T* th) const {
    if (softcap > 0.0) {
      const T cu = static_cast<T>(softcap) * unit, inv = T(1) / cu;
      if (th != nullptr) {
        for (int c = 0; c < n; ++c) {
          const T t = std::tanh(x[c] * inv);
          th[c] = t;
          x[c] = cu * t;
        }
      } else {
        for (int c = 0; c < n; ++c) x[c] = cu * std::tanh(x[c] * inv);
      }
    }
    if (alibi != nullptr) {
      const T su = slope<T>(b, h) * unit;
      // d = d0 + c < 0 for c < cz: |d| = -(d0 + c); else |d| = d0 + c
      const int cz = static_cast<int>(d0 >= 0 ? 0 : (-d0 < n ? -d0 : n));
      const T base = su * static_cast<T>(d0);
      for (int c = 0; c < cz; ++c) x[c] += base + su * static_cast<T>(c);
      for (int c = cz; c < n; ++c) x[c] -= base + su * static_cast<T>(c);
    }
    if (rel_bias != nullptr) {
      const int64_t M = rel_max;
      const T* tab = static_cast<const T*>(rel_bias) + h * (2 * M + 1);
      int ca, cb;
      clamp_segments(d0, n, &ca, &cb);
      const T lo = tab[0] * unit, hi = tab[2 * M] * unit;
      for (int c = 0; c < ca; ++c) x[c] += lo;
      const int64_t m0 = M + d0;  // column c reads tab[m0 + c] for c in [ca, cb)
      for (int c = ca; c < cb; ++c) x[c] += tab[m0 + c] * unit;
      for (int c = cb; c < n; ++c) x[c] += hi;
    }
  }

  // d rel_bias of one key's run (as apply_row): db[M + clamp(d0 + c)] += ds[c], where ds is
  // the gradient of the final score (after softcap) and db the head's (2M + 1) row.
  template <typename T>
  inline void rel_bias_grad_row(const T* ds, int n, int64_t d0, double* db) const {
    const int64_t M = rel_max;
    int ca, cb;
    clamp_segments(d0, n, &ca, &cb);
    double lo = 0, hi = 0;
    for (int c = 0; c < ca; ++c) lo += ds[c];
    const int64_t m0 = M + d0;
    for (int c = ca; c < cb; ++c) db[m0 + c] += ds[c];
    for (int c = cb; c < n; ++c) hi += ds[c];
    db[0] += lo;
    db[2 * M] += hi;
  }

 private:
  // Columns [0, ca) have d0 + c < -M, [ca, cb) are in [-M, M], [cb, n) are > M.
  ATTN_MASK_FN void clamp_segments(int64_t d0, int n, int* ca, int* cb) const {
    const int64_t M = rel_max;
    int64_t a = -M - d0, z = M - d0 + 1;
    a = a < 0 ? 0 : (a > n ? n : a);
    z = z < a ? a : (z > n ? n : z);
    *ca = static_cast<int>(a);
    *cb = static_cast<int>(z);
  }
};

// A row's lse in base 2 for a CUDA backward's P = exp2(s2 - lse2): a row that saw no key (lse
// -inf; its visible scores, if any, all -inf) takes +inf, so its P is 0, never
// exp2((-inf) - (-inf)) = NaN (the CPU backward maps lse -inf the same way).
template <typename T>
ATTN_MASK_FN T lse_log2(T lse) {
  return lse == -static_cast<T>(INFINITY) ? static_cast<T>(INFINITY)
                                          : lse * static_cast<T>(1.4426950408889634074);
}

// Whether one key chunk's partial state of a row (max ms, sum ls; o_finite: its unnormalised
// output holds no inf / NaN) adds nothing when a row's chunks are merged (split-KV on CPU and
// CUDA, the CPU decode's chunks): max -inf with sum exactly 0 and a finite output (the chunk
// saw no key, or only -inf scores against finite v). Otherwise it takes part, as one pass
// over the keys would: a chunk whose only scores are NaN can keep its max -inf with a NaN
// sum, and one whose scores are all -inf can hold 0 * inf = NaN from a non-finite v (the
// reference's 0 * v at a visible key: NaN in that row's out even where every score is -inf,
// lse -inf). The merge weighs chunk s by exp(ms - mu), mu = merged_offset(the largest chunk
// max), so such a chunk's weight is 0, never exp(-inf - -inf) = NaN.
template <typename acc_t>
ATTN_MASK_FN bool chunk_adds_nothing(acc_t ms, acc_t ls, bool o_finite) {
  const acc_t neg_inf = -static_cast<acc_t>(INFINITY);
  return ms == neg_inf && ls == acc_t(0) && o_finite;
}
// The offset a merge subtracts from the chunks' maxima: the largest (mx), or 0 when it is -inf
// (no chunk saw a finite score), as a one-pass kernel's running max.
template <typename acc_t>
ATTN_MASK_FN acc_t merged_offset(acc_t mx) {
  return mx == -static_cast<acc_t>(INFINITY) ? acc_t(0) : mx;
}

}  // namespace attn_ext
