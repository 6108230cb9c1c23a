// Helpers shared by the CPU attention forward (attention_fwd.cpp) and backward
// (attention_bwd.cpp): tile sizes, loading strided bf16/fp16/fp32/fp64 rows into fp32/fp64
// tiles, and a dynamically scheduled parallel loop.
#pragma once

#include "common/stable.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>
#include <limits>
#include <memory>
#include <type_traits>

#include "common/attention_mask.h"
#include "common/attention_params.h"
#include "common/dropout_rng.h"
#include "cpu/aligned_vec.h"
#include "cpu/attention_microkernels.h"

namespace attn_ext {
namespace cpu_attn {

// Query tile: up to kBlockQ score columns. A multiple of 48 = lcm(16-wide column panels,
// 6-row register tiles) so that every product of the tile runs on full micro-tiles;
// 96 queries amortise each key/value tile load over enough work while the transposed
// score tile (kBlockK x kBlockQ fp32 = 36 KiB) and the q tile stay in L1/L2.
constexpr int64_t kBlockQ = 96;
// Key tile: rows of the transposed score tile per online-softmax step.
constexpr int64_t kBlockK = 96;
// The forward's split-KV plan (attention_fwd_kernel) counts this many workers, not the
// thread count, for calls with dropout, so that their outputs are bitwise the same at every
// thread count (issue 15: the chunk merge's sums depend on the chunking, not the keep bits).
constexpr int64_t kDropoutSplitWorkers = 16;

constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// AlignedVec (64-byte aligned scratch): cpu/aligned_vec.h
constexpr int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// Whether a tile's rows (row_stride elements apart, cols used) may be read in place by the
// inner products: yes when they are dense (a BHSD view) or their byte stride is not a
// multiple of 1 KiB. Rows a multiple of 1-4 KiB apart (the BSHD layout of a Linear's output:
// H * D * 4 bytes = 4 KiB for 16 heads of 64 fp32) map to a few L1 sets and evict each other
// (64 sets of 64 bytes: 4 KiB apart = the same set), so such tiles are packed first.
inline bool rows_read_in_place(int64_t row_stride, int64_t cols, size_t elem_size) {
  return row_stride == cols || (row_stride * static_cast<int64_t>(elem_size)) % 1024 != 0;
}

// Whether rows `row_stride` elements apart, `cols` wide, alias in L1 as a gemm's B operand: the
// zmm gemms read B in column panels of 64 floats (one 256-byte piece of each row); where rows
// are wider than a panel and a multiple of 512 bytes apart (D = 128 fp32 in a BHSD tensor or
// a packed tile), a panel's 96 rows fall into half of L1's 64 sets or fewer: 12 lines a set, as
// many as it has ways, so A's and C's lines evict B's (the forward's pass 3 ran ~13 % below
// pass 1: RESULTS.md, twentieth and twenty-fifth sessions). Such rows are packed with
// padded_ld.
inline bool b_rows_alias(int64_t row_stride, int64_t cols, size_t elem_size) {
  return cols * static_cast<int64_t>(elem_size) > 256 &&
         (row_stride * static_cast<int64_t>(elem_size)) % 512 == 0;
}
// Whether 16-bit rows (bf16 / fp16) `row_stride` elements apart, `cols` wide, alias as the AMX
// tiles' / pair products' operands read in place: not dense and a multiple of 1 KiB apart (a
// BSHD tensor of 8+ heads), so a tile's 16 rows fall into one or two L1 sets. The forward
// copies such k rows `cols` apart first (HeadRows16 in attention_fwd.cpp). (The backward reads
// them in place: copying its key tiles' k / v rows per visit changed nothing measurable.)
inline bool rows16_alias(int64_t row_stride, int64_t cols) {
  return row_stride != cols && (row_stride * 2) % 1024 == 0;
}
// The leading dimension of packed B rows of cols_p (a multiple of 8) columns: cols_p, plus one
// 64-byte line where cols_p would alias (b_rows_alias), so that consecutive rows start one set
// apart.
inline int64_t padded_ld(int64_t cols_p, size_t elem_size) {
  return b_rows_alias(cols_p, cols_p, elem_size) ? cols_p + 64 / static_cast<int64_t>(elem_size)
                                                 : cols_p;
}

// dst[0, n) = src[0, n) converted to acc_t (fp32 for fp32/bf16/fp16, fp64 for fp64).
template <typename scalar_t, typename acc_t>
inline void convert_row(const scalar_t* src, int64_t n, acc_t* dst) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    // (n == 0 may come with src == nullptr (D = 0): memcpy from nullptr is UB even for 0 bytes)
    if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(acc_t));
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    if (mk::cpu_has_avx2_fma()) {
      mk::bf16_to_float_avx2(reinterpret_cast<const uint16_t*>(src), n, dst);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
    }
  } else if constexpr (std::is_same_v<scalar_t, c10::Half> && std::is_same_v<acc_t, float>) {
    if (mk::cpu_has_avx2_fma()) {
      mk::half_to_float_avx2(reinterpret_cast<const uint16_t*>(src), n, dst);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<acc_t>(src[i]);
  }
}

// dst[0, n) = src[0, n) * mul converted to scalar_t (round to nearest even): the outputs'
// write-out (the product in acc_t first, as the scalar loop's static_cast<scalar_t>(x * mul)).
template <typename scalar_t, typename acc_t>
inline void store_row(const acc_t* src, acc_t mul, int64_t n, scalar_t* dst) {
  if constexpr (std::is_same_v<scalar_t, c10::Half> && std::is_same_v<acc_t, float>) {
    if (mk::cpu_has_avx2_fma()) {
      mk::float_to_half_avx2(src, mul, n, reinterpret_cast<uint16_t*>(dst));
      return;
    }
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    if (mk::cpu_has_avx2_fma()) {
      mk::float_to_bf16_avx2(src, mul, n, reinterpret_cast<uint16_t*>(dst));
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i] * mul);
}

// dst (rows, ld) = src rows (row r at src + r * row_stride, `cols` contiguous values);
// columns [cols, ld) are left as they are (callers keep them zero).
template <typename scalar_t, typename acc_t>
inline void load_rows(const scalar_t* src, int64_t row_stride, int64_t rows, int64_t cols,
                      acc_t* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) convert_row(src + r * row_stride, cols, dst + r * ld);
}

// True when every value of the (rows, cols; ld) block is finite. On the bits, so the loop is
// integer and-add-or that the compiler vectorises: a value is inf or NaN iff its exponent field
// is all ones, and then (bits & exponent mask) + (the exponent's lowest bit) carries into the
// sign bit. (It was a floating-point sum of x * 0, NaN iff some x is not finite: one add
// after the other, ~4 cycles a value, which made the check of a backward query block's q and
// dout 5 % of a D = 128 backward: RESULTS.md, twenty-fifth session.) fp32, fp64, and the
// inputs' fp16 / bf16 (whose exponent fields also end at the sign bit).
template <typename T>
bool all_finite(const T* x, int64_t rows, int64_t cols, int64_t ld) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8, "fp16 / bf16, fp32 or fp64");
  using bits_t = std::conditional_t<sizeof(T) == 2, uint16_t,
                                    std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;
  constexpr int kTop = 8 * sizeof(bits_t) - 1;
  constexpr bits_t kExp = sizeof(T) == 8                      ? bits_t(0x7ff) << 52
                          : sizeof(T) == 4                    ? bits_t(0xff) << 23
                          : std::is_same_v<T, c10::Half>      ? bits_t(0x1f << 10)
                                                              : bits_t(0xff << 7);
  constexpr bits_t kLow = kExp & (~kExp + 1);  // the exponent field's lowest bit
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * ld;
    bits_t bad = 0;
    for (int64_t c = 0; c < cols; ++c) {
      bits_t u;
      std::memcpy(&u, row + c, sizeof(u));
      bad |= (u & kExp) + kLow;
    }
    if ((bad >> kTop) != 0) return false;
  }
  return true;
}

// The K or V rows of one (sequence, kv head) in the accumulation type, converted once per
// worker and reused by every (query tile, key tile) of that head the worker runs: the
// forward hands tiles out head by head (attention_fwd.cpp, tile_at) and the fused backward
// gives a worker a whole kv head. Converting per tile instead converts each row once per
// query tile that sees it, and at a row stride that aliases in the caches (a BSHD cache at
// 4 KiB) re-reads it from L3 each time (issue 16 item 3). Only for heads whose K plus V fit
// the worker's share (head_rows_fit): at most kHeadRowsBytes, and all workers' shares together
// at most kHeadRowsTotalBytes, so a call's extra memory does not grow with the thread count
// (up to 2 workers each gets 5 MiB; at 4, 2.5 MiB; at 16, 640 KiB; at 64, 160 KiB). 5 MiB
// holds a head of 4096 keys at D = 128 fp32 with its v rows padded (padded_ld: 4096 x (128 +
// 144) x 4 bytes = 4.25 MiB). Longer heads are packed tile by tile, with the same values (the
// conversion is exact), so the choice never changes a result.
constexpr int64_t kHeadRowsBytes = 5242880;         // 5 MiB per worker
constexpr int64_t kHeadRowsTotalBytes = 10485760;  // 10 MiB over all workers

// The per-worker share for a call run by `workers` threads (computed outside the parallel
// region, where the thread count is the call's).
inline int64_t head_rows_budget(int64_t workers) {
  return std::min(kHeadRowsBytes, kHeadRowsTotalBytes / std::max<int64_t>(1, workers));
}

inline bool head_rows_fit(int64_t n, int64_t Dp, int64_t Dvp, size_t acc_size, int64_t budget) {
  return n * (Dp + Dvp) * static_cast<int64_t>(acc_size) <= budget;  // (+ 8 rows)
}

// Software prefetch of [p, p + bytes), one request per 64-byte line (a read into L2, kept in
// the caches). On x86 through a volatile asm, not __builtin_prefetch: GCC's IPA pure-const pass
// counts the builtin as free of side effects, so a call to a function that only prefetches is
// dead code to it when the function is not inlined first. GCC 12 dropped the decode kernel's
// prefetches that way (RESULTS.md, sixth session); an asm volatile stays where it is written.
inline void prefetch_range(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    asm volatile("prefetcht1 %0" : : "m"(*(c + off)));
#else
    __builtin_prefetch(c + off, 0, 2);
#endif
  }
}

// Asks for row r + 8 of a head of n rows (`row_stride` elements apart, `row_bytes` each) while
// row r is packed: rows at a large stride lie in different pages, which the hardware
// prefetchers do not follow, so this keeps several misses in flight instead of one. The head
// caches below (whole or tile by tile) pack their rows with it.
template <typename T>
inline void prefetch_row_ahead(const T* head, int64_t row_stride, int64_t n, int64_t r,
                               int64_t row_bytes) {
  if (r + 8 < n) prefetch_range(head + (r + 8) * row_stride, row_bytes);
}

// What a per-worker head cache (HeadRows below; the forward's HeadPairs, HeadSplit and
// HeadRows16) holds: the head it was filled for and which blocks of `block` rows are done.
// Keyed by the head's first row, its length and the layout the owner keeps the rows in: the
// same first row may come back with another length (packed sequences over rows of stride 0
// give every sequence the same first row), and a head must not be read at another layout than
// it was filled at. done: 0 not yet, else the owner's state (1; or 1 / 2, finite or not).
struct HeadBlocks {
  const void* src = nullptr;
  int64_t n = -1, block = 1, layout = -1;
  std::vector<uint8_t> done;

  // Whether the cache was reset for the head at `head` of `rows` rows (the owner then sizes
  // its buffers for it).
  bool start(const void* head, int64_t rows, int64_t blk, int64_t lay = 0) {
    if (head == src && rows == n && blk == block && lay == layout) return false;
    src = head;
    n = rows;
    block = blk;
    layout = lay;
    done.assign(static_cast<size_t>(ceil_div(rows, blk)), 0);
    return true;
  }
  // The owner's buffers hold something else now (one key tile's rows).
  void drop() { src = nullptr; }
  // Rows [r0, r0 + nr) of a head kept by 32-row blocks on first use (the forward's HeadSplit,
  // HeadRows16): when `whole`, the head's rows (size_for(n) on a new head, convert(a, b, 0) for
  // the blocks not done); else only the asked rows (size_for(nr), convert(r0, r0 + nr, r0)).
  // convert(a, b, at) puts rows [a, b) at the owner's rows a - at on. Returns the owner's row
  // of r0.
  template <typename SizeFor, typename Convert>
  int64_t rows_of(bool whole, const void* head, int64_t n, int64_t r0, int64_t nr,
                  SizeFor&& size_for, Convert&& convert) {
    if (!whole) {
      size_for(nr);
      drop();
      convert(r0, r0 + nr, r0);
      return 0;
    }
    if (start(head, n, 32)) size_for(n);
    fill(r0, nr, [&](int64_t a, int64_t b) -> uint8_t {
      convert(a, b, 0);
      return 1;
    });
    return r0;
  }
  // For each block of rows [r0, r0 + nr) not done yet: its state = f(first row, end row).
  template <typename F>
  void fill(int64_t r0, int64_t nr, F&& f) {
    // (locals: the stores to done may alias the members, which would be reloaded, and the
    // bound divided again, on every block)
    const int64_t bs = block, rows = n, end = ceil_div(r0 + nr, bs);
    uint8_t* d = done.data();
    for (int64_t blk = r0 / bs; blk < end; ++blk) {
      if (!d[blk]) d[blk] = f(bs * blk, std::min<int64_t>(rows, bs * blk + bs));
    }
  }
};

template <typename acc_t>
struct HeadRows {
  HeadBlocks blocks;          // rows one at a time (done[r]: 1 converted and finite, 2 not
                              // finite), laid out at ld
  AlignedVec<acc_t> rows;     // (n + 8, ld): padding columns stay zero; the 8 rows past n
                              // (any values: a shorter head may follow a longer one) are read
                              // only by the decode-order scores of the backward, whose results
                              // for them are dropped
  bool check_finite = true;   // false: finite() is not asked (1 means converted only)

  // Rows [j0, j0 + nk) of the head starting at `head` (n rows), (nk, ld).
  template <typename scalar_t>
  const acc_t* get(const scalar_t* head, int64_t row_stride, int64_t n, int64_t cols, int64_t ld,
                   int64_t j0, int64_t nk) {
    const bool relayout = ld != blocks.layout;  // (no stale values left in padding columns)
    if (blocks.start(head, n, 1, ld)) {
      const size_t need = static_cast<size_t>((n + 8) * ld);
      if (rows.size() < need || relayout) rows.assign(std::max(need, rows.size()), acc_t(0));
    }
    const int64_t row_bytes = cols * static_cast<int64_t>(sizeof(scalar_t));
    blocks.fill(j0, nk, [&](int64_t r, int64_t) -> uint8_t {
      prefetch_row_ahead(head, row_stride, n, r, row_bytes);
      acc_t* dst = rows.data() + r * ld;
      convert_row(head + r * row_stride, cols, dst);
      return !check_finite || all_finite(dst, 1, cols, ld) ? 1 : 2;
    });
    return rows.data() + j0 * ld;
  }
  // Rows [j0, j0 + nk), converted by get(), are all finite.
  bool finite(int64_t j0, int64_t nk) const {
    for (int64_t r = j0; r < j0 + nk; ++r)
      if (blocks.done[r] != 1) return false;
    return true;
  }
  // The key tile [j0, j0 + nk) of the head at `head` as (nk, ld) rows: from this head's rows
  // when `whole` (head_rows_fit), else converted into `tile` alone (the per-tile packing).
  template <typename scalar_t>
  const acc_t* tile(bool whole, const scalar_t* head, int64_t row_stride, int64_t n, int64_t cols,
                    int64_t ld, int64_t j0, int64_t nk, AlignedVec<acc_t>& tile_rows) {
    if (whole) return get(head, row_stride, n, cols, ld, j0, nk);
    // (the row 8 ahead asked for as get() does, into the next tile too: the rows of a head
    // packed tile by tile are often read once, straight from memory)
    const int64_t row_bytes = cols * static_cast<int64_t>(sizeof(scalar_t));
    for (int64_t r = j0; r < j0 + nk; ++r) {
      prefetch_row_ahead(head, row_stride, n, r, row_bytes);
      convert_row(head + r * row_stride, cols, tile_rows.data() + (r - j0) * ld);
    }
    return tile_rows.data();
  }
};

// The score terms (softcap, ALiBi, rel_bias: ScoreTerms in common/attention_mask.h) on a
// transposed tile st (nk key rows j0 .. j0 + nk - 1, leading dimension C) whose columns are
// nh runs of nq query rows (column hh * nq + ii: head h0 + hh, row i0 + ii), scores in
// natural units; d00 = i0 + off - j0. th (st's layout) receives tanh(s / softcap) when given.
// The forward and the backward both call this, so their scores round alike. ALiBi and
// rel_bias go through mk::bias_rows (vectorised, one call per head). Softcap comes first: in
// fp32 with AVX2 by mk::softcap_rows_avx2 (cpu::tanh_ps, 8 columns at a time; measured in
// RESULTS.md, eleventh session), then the biases as without it; otherwise (fp64, no AVX2) the
// per-row rule ScoreTerms::apply_row for all three.
template <typename acc_t>
void apply_score_terms(const ScoreTerms& t, acc_t* st, int64_t nk, int64_t C, int64_t nq,
                       int64_t nh, int64_t b, int64_t h0, int64_t d00, acc_t* th) {
  bool capped = false;
  if constexpr (std::is_same_v<acc_t, float>) {
    if (t.softcap > 0.0 && mk::cpu_has_avx2_fma()) {
      mk::softcap_rows_avx2(st, nk, nh * nq, C, static_cast<float>(t.softcap), th);
      capped = true;
    }
  }
  if (t.softcap > 0.0 && !capped) {
    for (int64_t r = 0; r < nk; ++r) {
      for (int64_t hh = 0; hh < nh; ++hh) {
        t.apply_row<acc_t>(st + r * C + hh * nq, static_cast<int>(nq), b, h0 + hh, d00 - r,
                           acc_t(1), th != nullptr ? th + r * C + hh * nq : nullptr);
      }
    }
    return;
  }
  if (t.alibi == nullptr && t.rel_bias == nullptr) return;
  const int64_t M = t.rel_max;
  for (int64_t hh = 0; hh < nh; ++hh) {
    const int64_t h = h0 + hh;
    const acc_t slope = t.alibi != nullptr ? t.slope<acc_t>(b, h) : acc_t(0);
    const acc_t* tab =
        t.rel_bias != nullptr ? static_cast<const acc_t*>(t.rel_bias) + h * (2 * M + 1) : nullptr;
    mk::bias_rows<acc_t>(st + hh * nq, nk, nq, C, d00, slope, tab, M);
  }
}

// apply_score_terms on scores kept the other way round: column c = hh * nq + ii (head
// h0 + hh, row i0 + ii) holds its nk keys j0 .. j0 + nk - 1 contiguously at s + c * ld (the
// decode kernel's blocks; d00 = i0 + off - j0 as there). The same pieces on the same values:
// mk::softcap_rows_avx2 (one function of each element) and mk::bias_keys (bias_rows along
// keys), so each score rounds as apply_score_terms rounds it (the backward applies that one to
// the same scores). fp32 with AVX2 only (the decode kernel's condition); else apply_row per
// element, as apply_score_terms without AVX2.
inline void apply_score_terms_keys(const ScoreTerms& t, float* s, int64_t ld, int64_t nk,
                                   int64_t nq, int64_t nh, int64_t b, int64_t h0, int64_t d00) {
  const int64_t M = t.rel_max;
  for (int64_t hh = 0; hh < nh; ++hh) {
    const int64_t h = h0 + hh;
    for (int64_t ii = 0; ii < nq; ++ii) {
      float* x = s + (hh * nq + ii) * ld;
      const int64_t d0 = d00 + ii;  // key r at d = d0 - r
      if (!mk::cpu_has_avx2_fma()) {
        for (int64_t r = 0; r < nk; ++r) t.apply_row<float>(x + r, 1, b, h, d0 - r, 1.f, nullptr);
        continue;
      }
      if (t.softcap > 0.0) mk::softcap_rows_avx2(x, 1, nk, ld, static_cast<float>(t.softcap), nullptr);
      if (t.alibi == nullptr && t.rel_bias == nullptr) continue;
      const float slope = t.alibi != nullptr ? t.slope<float>(b, h) : 0.f;
      const float* tab =
          t.rel_bias != nullptr ? static_cast<const float*>(t.rel_bias) + h * (2 * M + 1) : nullptr;
      mk::bias_keys<float>(x, nk, d0, slope, tab, M);
    }
  }
}

// Attention dropout on a transposed tile st (rows: keys j0 .. j0 + nk - 1, cols: queries;
// leading dimension C): dst[r][c] = src[r][c] * inv_keep where key j0 + r of column c's row
// survives (common/dropout_rng.h; rk[c] is that row's key), else 0; columns [cols, C) get 0.
// One 64-bit word per (column, 4 keys), kept in words (cols) while r walks down the tile.
// src may equal dst.
template <typename acc_t>
void dropout_tile(const acc_t* src, acc_t* dst, int64_t nk, int64_t C, int64_t cols, int64_t j0,
                  const uint64_t* rk, uint64_t* words, uint32_t thresh, acc_t inv_keep) {
  for (int64_t r = 0; r < nk; ++r) {
    const int64_t j = j0 + r;
    if (r == 0 || (j & 3) == 0) {
      for (int64_t c = 0; c < cols; ++c) words[c] = dropout::word(rk[c], j);
    }
    const int shift = dropout::kBitsPerKey * static_cast<int>(j & 3);
    const acc_t* s = src + r * C;
    acc_t* d = dst + r * C;
    if constexpr (std::is_same_v<acc_t, float>) {
      if (mk::cpu_has_avx2_fma()) {  // the same rule, 8 columns at a time
        mk::dropout_row_avx2(s, d, cols, words, shift, thresh, inv_keep);
        for (int64_t c = cols; c < C; ++c) d[c] = acc_t(0);
        continue;
      }
    }
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t u = static_cast<uint32_t>(words[c] >> shift) & 0xffffu;
      d[c] = u >= thresh ? s[c] * inv_keep : acc_t(0);
    }
    for (int64_t c = cols; c < C; ++c) d[c] = acc_t(0);
  }
}

// Runs task(t, scratch) for t in [0, n) on num_threads() workers that take tasks
// in order from a shared counter (dynamic scheduling: robust to uneven tasks and to a
// noisy machine). Each worker builds one Scratch with make_scratch() and reuses it.
// Every task's result must not depend on which worker ran it.
template <typename MakeScratch, typename Task>
void parallel_tasks(int64_t n, MakeScratch&& make_scratch, Task&& task) {
  if (n <= 0) return;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads(), n));
  std::atomic<int64_t> next{0};
  torch::stable::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    (void)begin;
    (void)end;
    auto scratch = make_scratch();
    for (;;) {
      const int64_t t = next.fetch_add(1, std::memory_order_relaxed);
      if (t >= n) break;
      task(t, scratch);
    }
  });
}

// common/attention_mask.h's chunk_adds_nothing for a chunk whose unnormalised output is o (n
// values). (The finiteness scan runs only for a chunk with max -inf and sum 0.)
template <typename acc_t>
inline bool chunk_adds_nothing(acc_t ms, acc_t ls, const acc_t* o, int64_t n) {
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  if (!(ms == neg_inf && ls == acc_t(0))) return false;
  return attn_ext::chunk_adds_nothing(ms, ls, all_finite(o, 1, n, n));
}

// One key chunk's partial state of a row (merge_chunks): max, sum, unnormalised output
template <typename acc_t>
struct ChunkState {
  acc_t m, l;
  const acc_t* o;
};

// One row's merge of n key chunks' partial states (split-KV, the decode kernel): chunk(c)
// returns its max, its sum and its unnormalised output (n_o values, the first n_acc of them
// merged into o). Writes o[0, n_acc) and *l (the merged sum) and returns the row's max: NaN
// when a chunk's is (std::max would drop it), else the largest. Each chunk that takes part
// (chunk_adds_nothing) weighs exp(ms - merged_offset(max)), in chunk order.
template <typename acc_t, typename Chunk>
acc_t merge_chunks(int64_t n, Chunk&& chunk, int64_t n_o, int64_t n_acc, acc_t* o, acc_t* l) {
  acc_t mx = -std::numeric_limits<acc_t>::infinity();
  for (int64_t c = 0; c < n; ++c) {
    const acc_t ms = chunk(c).m;
    mx = std::isnan(ms) || std::isnan(mx) ? std::numeric_limits<acc_t>::quiet_NaN() : std::max(mx, ms);
  }
  const acc_t mu = merged_offset(mx);
  *l = 0;
  std::fill(o, o + n_acc, acc_t(0));
  for (int64_t c = 0; c < n; ++c) {
    const auto s = chunk(c);
    if (chunk_adds_nothing(s.m, s.l, s.o, n_o)) continue;
    const acc_t w = std::exp(s.m - mu);
    *l += w * s.l;
    for (int64_t d = 0; d < n_acc; ++d) o[d] += w * s.o[d];
  }
  return mx;
}

// The work units (sequence b, kv head hkv), at b * Hkv + hkv, where an fp16 value of q or k
// that takes part is +-inf (bits: exponent all ones, mantissa 0): k's rows of the keys some row
// sees (band and padding), q's rows that see some key by the band, of the unit's heads. fp16
// runs its products on AMX tiles as bf16 hi + lo parts (mk::fp16_on_tiles), where an inf factor
// meets the other factor's lo part: inf * 0 = NaN where the product is +-inf. A score of +inf
// makes its row NaN either way, but one of -inf (probability 0) or one a softcap makes finite
// (+-softcap) must not. The units where an inf takes part run the widened fp32 path instead,
// forward and backward alike (both ask this, so the backward's scores are the forward's); the
// others keep the tiles (UnitFilter: a call runs the two sets one after the other), so an inf
// changes no other unit's bits. A NaN gives NaN either way and keeps the tiles; a hidden inf
// changes no path; a visible one changes the rounding of its own unit's other rows.
inline std::vector<uint8_t> half_qk_inf_units(const AttentionParams& p, const Visibility& vis) {
  const int64_t units = p.B * p.Hkv, group = p.H / p.Hkv;
  std::unique_ptr<std::atomic<uint8_t>[]> inf(new std::atomic<uint8_t>[static_cast<size_t>(units)]);
  for (int64_t u = 0; u < units; ++u) inf[u].store(0, std::memory_order_relaxed);
  auto has_inf = [](const uint16_t* row, int64_t D) {
    uint32_t bad = 0;
    for (int64_t d = 0; d < D; ++d) bad |= (row[d] & 0x7FFFu) == 0x7C00u;
    return bad != 0;
  };
  // tasks: (sequence, q or k, a chunk of kScanRows rows), so that a long K is read by every
  // worker; per sequence the valid keys before each key (key padding: a q row takes part when
  // its band holds a valid key)
  constexpr int64_t kScanRows = 256;
  int64_t max_q = 0, max_k = 0;
  std::vector<std::vector<int64_t>> valid_before(static_cast<size_t>(vis.has_padding() ? p.B : 0));
  for (int64_t b = 0; b < p.B; ++b) {
    const SeqInfo sq = vis.seq(b);
    max_q = std::max(max_q, sq.Sq);
    max_k = std::max(max_k, sq.Sk);
    if (vis.has_padding()) {
      auto& vb = valid_before[static_cast<size_t>(b)];
      vb.assign(static_cast<size_t>(sq.Sk + 1), 0);
      for (int64_t j = 0; j < sq.Sk; ++j) vb[j + 1] = vb[j] + (vis.key_valid(b, j) ? 1 : 0);
    }
  }
  const int64_t cq = ceil_div(max_q, kScanRows), ck = ceil_div(max_k, kScanRows);
  parallel_tasks(p.B * (cq + ck), [] { return 0; }, [&](int64_t t, int&) {
    const int64_t b = t / (cq + ck), c = t % (cq + ck);
    const SeqInfo sq = vis.seq(b);
    if (c < cq) {
      const auto* q = static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride;
      for (int64_t i = c * kScanRows; i < std::min(sq.Sq, (c + 1) * kScanRows); ++i) {
        const Range keys = vis.band_keys(sq, i);
        const bool sees = vis.has_padding()
                              ? keys.lo < keys.hi && valid_before[static_cast<size_t>(b)][keys.hi] >
                                                         valid_before[static_cast<size_t>(b)][keys.lo]
                              : keys.lo < keys.hi;
        if (!sees) continue;
        const uint16_t* row = q + (sq.q0 + i) * p.q_row_stride;
        for (int64_t h = 0; h < p.H; ++h)
          if (has_inf(row + h * p.q_head_stride, p.D))
            inf[b * p.Hkv + h / group].store(1, std::memory_order_relaxed);
      }
    } else {
      const auto* k = static_cast<const uint16_t*>(p.k) + b * p.k_batch_stride;
      const Range keys = sq.Sq > 0 ? vis.band_keys_of_rows(sq, 0, sq.Sq) : Range{0, 0};
      const int64_t j0 = std::max(keys.lo, (c - cq) * kScanRows);
      const int64_t j1 = std::min(keys.hi, (c - cq + 1) * kScanRows);
      for (int64_t j = j0; j < j1; ++j) {
        if (!vis.key_valid(b, j)) continue;
        const uint16_t* row = k + (sq.k0 + j) * p.k_row_stride;
        for (int64_t hk = 0; hk < p.Hkv; ++hk)
          if (has_inf(row + hk * p.k_head_stride, p.D))
            inf[b * p.Hkv + hk].store(1, std::memory_order_relaxed);
      }
    }
  });
  std::vector<uint8_t> out(static_cast<size_t>(units));
  for (int64_t u = 0; u < units; ++u) out[static_cast<size_t>(u)] = inf[u].load();
  return out;
}

// Which work units (b, hkv) a run of a kernel takes: all (units == nullptr), else those with
// units[b * Hkv + hkv] == want (half_qk_inf_units: a call's fp16 units on the tiles, then the
// widened ones).
struct UnitFilter {
  const uint8_t* units = nullptr;
  uint8_t want = 0;
  int64_t Hkv = 1;
  bool takes(int64_t b, int64_t hkv) const {
    return units == nullptr || units[b * Hkv + hkv] == want;
  }
};

// The fp16 tile decision of a call (forward and backward alike): run(split, filter) once where
// every unit agrees, else twice, the units on the tiles first. tiles_possible: the shapes and
// switches allow the tiles (mk::fp16_on_tiles); without it a single widened run.
template <typename Run>
void run_fp16_units(const AttentionParams& p, const Visibility& vis, bool tiles_possible, Run&& run) {
  if (!tiles_possible) {
    run(false, UnitFilter{});
    return;
  }
  const std::vector<uint8_t> inf = half_qk_inf_units(p, vis);
  const bool any = std::find(inf.begin(), inf.end(), uint8_t(1)) != inf.end();
  const bool all = std::find(inf.begin(), inf.end(), uint8_t(0)) == inf.end();
  if (!any) {
    run(true, UnitFilter{});
  } else if (all) {
    run(false, UnitFilter{});
  } else {
    run(true, UnitFilter{inf.data(), 0, p.Hkv});
    run(false, UnitFilter{inf.data(), 1, p.Hkv});
  }
}

// Tasks in groups (task = group * per_group + k), dynamically scheduled with group affinity:
// a worker takes a whole group and runs its tasks in order; when no group is left it helps
// with the tasks the other workers have not reached yet (the last ones of each group). So a
// worker's consecutive tasks share what a group shares (a head's converted K / V rows: the
// forward) while the end stays balanced task by task. Each worker builds one Scratch.
template <typename MakeScratch, typename Task>
void parallel_groups(int64_t n_groups, int64_t per_group, MakeScratch&& make_scratch, Task&& task) {
  if (n_groups <= 0 || per_group <= 0) return;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads(), n_groups * per_group));
  std::vector<std::atomic<int64_t>> next(static_cast<size_t>(n_groups));
  for (auto& a : next) a.store(0, std::memory_order_relaxed);
  std::atomic<int64_t> next_group{0};
  torch::stable::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    (void)begin;
    (void)end;
    auto scratch = make_scratch();
    auto drain = [&](int64_t g) {
      for (;;) {
        const int64_t k = next[g].fetch_add(1, std::memory_order_relaxed);
        if (k >= per_group) break;
        task(g * per_group + k, scratch);
      }
    };
    for (;;) {
      const int64_t g = next_group.fetch_add(1, std::memory_order_relaxed);
      if (g >= n_groups) break;
      drain(g);
    }
    for (int64_t g = 0; g < n_groups; ++g) drain(g);  // help with what is left
  });
}

}  // namespace cpu_attn
}  // namespace attn_ext
