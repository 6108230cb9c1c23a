// The one visibility and score rule of every attention kernel (CPU forward/backward, CUDA
// simple / split-KV / fast kernels, and tools/fa2_emulate.py through tools/mask_probe.cpp).
// Host and device; no ATen types. DESIGN.md, "Attention variants":
//
//   off = Sk - Sq  (of the row's own sequence),  d = i + off - j
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
//   visible(s, b, i, j)     the per-(i, j) predicate (band and padding)
// and the score terms of a visible pair come from ScoreTerms (today: only the scale).
#pragma once

#include <cstdint>

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

struct Visibility {
  MaskParams m;
  int64_t Sq, Sk;  // the params' lengths (max lengths when packed)

  ATTN_MASK_FN bool packed() const { return m.cu_seqlens_q != nullptr; }
  ATTN_MASK_FN bool has_padding() const { return m.key_padding != nullptr; }
  // True when every (i, j) of the sequence is visible (no band, no padding): kernels may
  // then skip the mask entirely.
  ATTN_MASK_FN bool dense() const { return m.left < 0 && m.right < 0 && !has_padding(); }

  ATTN_MASK_FN SeqInfo seq(int64_t b) const {
    SeqInfo s;
    if (packed()) {
      s.q0 = m.cu_seqlens_q[b];
      s.k0 = m.cu_seqlens_k[b];
      s.Sq = m.cu_seqlens_q[b + 1] - s.q0;
      s.Sk = m.cu_seqlens_k[b + 1] - s.k0;
    } else {
      s.q0 = 0;
      s.k0 = 0;
      s.Sq = Sq;
      s.Sk = Sk;
    }
    s.off = s.Sk - s.Sq;
    return s;
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

  ATTN_MASK_FN bool key_valid(int64_t b, int64_t j) const {
    return m.key_padding == nullptr ||
           m.key_padding[b * m.kpm_batch_stride + j * m.kpm_key_stride] != 0;
  }

  // The predicate: row i of sequence b (local indices) sees key j.
  ATTN_MASK_FN bool visible(const SeqInfo& s, int64_t b, int64_t i, int64_t j) const {
    const int64_t d = i + s.off - j;
    if (m.right >= 0 && d < -m.right) return false;
    if (m.left >= 0 && d > m.left) return false;
    if (j < 0 || j >= s.Sk) return false;
    return key_valid(b, j);
  }
};

// Score terms of a visible pair (b, h, i, j): s = scale * q . k, then the terms of the next
// issue (softcap, ALiBi, relative bias; DESIGN.md) are added here, in one place. Kernels
// fold `scale` into q (a pure scale needs no per-element work) and call add() on the tile
// only when active() is true; today no term exists, so active() is false.
struct ScoreTerms {
  double scale;
  ATTN_MASK_FN bool active() const { return false; }
  // The score after the terms, given the scaled dot product s and d = i + off - j.
  template <typename T>
  ATTN_MASK_FN T add(T s, int64_t /*b*/, int64_t /*h*/, int64_t /*d*/) const {
    return s;
  }
};

}  // namespace attn_ext
