// Decode attention on CPU: few query rows per kv head (Sq * H / Hkv <= kDecodeCols), long
// key sequences. The work is memory-bound (each K/V element is used by only a handful of
// query columns), so the kernel is organised around reading K and V exactly once, in memory
// order:
//
//   columns  c = hh * Sq + ii of kv head hkv: query head hkv * group + hh, row ii (every
//            query head of a kv head shares one read of each K/V row: GQA)
//   units    (sequence, key chunk), covering every kv head: in a BSHD cache the rows of all
//            heads lie next to each other, so a unit streams one contiguous range (pages and
//            hardware prefetch streams used once, in order). The keys of a sequence are
//            split into chunks so that there are >= 4 units per thread (split-K); each
//            (unit, kv head) keeps its running (max, sum, unnormalised output) and a final
//            pass merges the chunks in order.
//   per block of nb keys (the block of every kv head in ~256 KiB of fp32; kDecodeKeysInPlace
//   keys where every block of the unit can be read in place):
//     full block, no mask, D and Dv multiples of 8 (any dtype): K and V read in place
//       scores  s (Hkv, C, nb) = qs kb^T, 8 keys at a time across all kv heads (K in memory
//               order; the next 8 keys of the kv heads prefetched in parts, head by head,
//               as the current 8 are computed (prefetch_next_group); 4 keys x 2 columns
//               register tiles (bf16 / fp16: 2 keys x 4 columns where 4 columns are left;
//               8 keys x 1 column for a last odd column), bf16 / fp16 widened in registers,
//               bf16 16 elements at a time in the decode order (decode_pos); the backward
//               takes its scores from the same function)
//       terms   softcap, ALiBi, rel_bias on each kv head's block of scores
//               (apply_score_terms_keys: the one rule, in this layout; not with dropout,
//               which only the tiled kernel takes)
//       softmax online per (kv head, column): m, l, o rescale
//       PV      o += p vb, 8 keys at a time across all kv heads (V in memory order); bf16
//               where its scores are vdpbf16ps pairs: two keys per vdpbf16ps, p rounded to
//               bf16 (pv_pairs, decode_pv_by_pairs)
//     otherwise: pack kb (Hkv, nb, Dp), vb (Hkv, nb, Dvp) fp32 in the decode order, row by
//     row in memory order (K not where its scores read it in place: bf16 pairs or tiles; V as
//     bf16 rows, vh, where pv_pairs takes the product), then per kv head scores, terms, mask (hidden
//     (c, j) -> -inf, visibility layer, decided once per block), softmax, PV (d-chunk outer,
//     columns in registers; keys hidden from some columns take a path that skips hidden
//     pairs)
//
// Extra memory: per thread one block of K/V and q; the chunk partials are
// (B, chunks, Hkv, C, Dvp + 2) floats. ATen-free; AVX2+FMA(+F16C): callers check
// decode_supported() and otherwise take the tiled kernel. Where the CPU also has AVX-512F/BW
// (cpu::avx512_enabled), the PV product takes 16-float registers (pv512), and the scores of 2
// or more columns two key groups per 16-float register (scores_cols512): the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/attention_params.h"
#include "cpu/attention_common.h"
#include "cpu/simd.h"

namespace attn_ext {
namespace cpu_attn {

// Query columns per kv head the decode kernel takes (group * Sq): 8 columns per register
// pass of the PV product, two passes at most.
constexpr int64_t kDecodeCols = 16;
// Keys per packed block at most: a unit packs the block for every kv head (rows lie next to
// each other in a BSHD cache): 32 keys x 8 kv heads x D = 128 fp32 of K and V are 256 KiB, in
// L2 (block_keys).
constexpr int64_t kDecodeKeys = 32;
// Keys per block when every block of a unit can be read in place (no scratch copy to keep in
// L2): fewer blocks, so fewer per-block softmax passes and loop setups. Measured (RESULTS.md,
// sixth session; alternated call by call): against block_keys' 32 (GQA) / 8 (MHA) keys,
// bf16 +4-8 %, fp32 +0-3 %; 64 in between.
constexpr int64_t kDecodeKeysInPlace = 128;
// Keys per chunk at least (a chunk's fixed costs: q packing, merge).
constexpr int64_t kDecodeMinChunk = 256;
// K + V bytes of a sequence from which a one-chunk decode splits its kv heads into groups
// (attention_decode_kernel).
constexpr int64_t kDecodeHeadSplitMinBytes = int64_t(384) << 10;

// ATTN_EXT_CPU_DECODE=0 turns the decode kernel off (for benchmarks that compare it with the
// tiled kernel on the same shapes). Read per call, as attn_ext.explain() reads it: a process
// that changed it after its first call still ran the decode kernel while explain named the
// tiled one.
inline bool decode_enabled() { return !cpu::env_is("ATTN_EXT_CPU_DECODE", "0"); }

inline int64_t decode_threads() { return num_threads(); }

// ATTN_EXT_CPU_DECODE_HEAD_SPLIT=0: no head groups (key chunks only), for benchmarks comparing
// both on the same shapes. Read per call.
inline bool decode_head_split_enabled() {
  return !cpu::env_is("ATTN_EXT_CPU_DECODE_HEAD_SPLIT", "0");
}

// ATTN_EXT_CPU_DECODE_IN_PLACE=0: always pack fp32 K/V blocks (for benchmarks comparing both;
// the same bits). Read per call.
inline bool decode_in_place_enabled() {
  return !cpu::env_is("ATTN_EXT_CPU_DECODE_IN_PLACE", "0");
}

inline bool decode_supported(const AttentionParams& p, bool is_double) {
  if (is_double || !cpu::use_avx2() || !decode_enabled()) return false;
  // dropout (issue 15) is in the tiled kernel only; softcap, ALiBi and rel_bias go through
  // apply_score_terms_keys on each block (the bits of the tiled kernels' and the backward's
  // apply_score_terms); sinks are not a condition (the backward, which is not told the sinks,
  // asks this too: attention_bwd.cpp)
  if (p.score_terms().has_dropout()) return false;
  if (p.Hkv <= 0 || p.D <= 0 || p.D > 512 || p.Dv > 512) return false;
  return p.Sq <= kDecodeCols / std::max<int64_t>(1, p.H / p.Hkv);  // Sq * group <= kDecodeCols
}

namespace decode_detail {

// The decode order of a row (every K / V / q row the decode kernel reads, and its output
// accumulators): bf16 is widened 16 elements at a time from one 32-byte load, by a shift (the
// even elements) and a mask (the odd ones), so within each whole 16-element chunk of a bf16 row
// positions [0, 8) hold elements 0, 2, ..., 14 and positions [8, 16) elements 1, 3, ..., 15;
// the tail past the last whole chunk, and fp32 / fp16 rows, are in natural order. Packed rows
// (pack_row) and the backward's operands (attention_bwd.cpp) are put in the same order, so the
// scores are the same FMA chains whether K is read in place or packed.
template <typename T>
constexpr bool kDecodePairs = std::is_same_v<T, c10::BFloat16>;

// Position in decode order of element d of a row of n elements.
inline int64_t decode_pos(bool pairs, int64_t d, int64_t n) {
  if (!pairs || d >= n / 16 * 16) return d;
  return (d & ~int64_t(15)) + ((d & 1) << 3) + ((d & 15) >> 1);
}

// dst[d] = src[decode_pos(d)] for d < n: a decode-order row of n elements (an output
// accumulator) back in natural order. bf16's whole 16-element chunks interleave their two
// halves (positions [0, 8) hold the even elements, [8, 16) the odd ones).
template <typename T>
ATTN_EXT_AVX2 inline void from_decode_order(const float* src, int64_t n, float* dst) {
  int64_t d = 0;
  if constexpr (kDecodePairs<T>) {
    for (; d + 16 <= n; d += 16) {
      const __m256 even = _mm256_loadu_ps(src + d), odd = _mm256_loadu_ps(src + d + 8);
      const __m256 lo = _mm256_unpacklo_ps(even, odd);  // e0 o0 e1 o1 | e4 o4 e5 o5
      const __m256 hi = _mm256_unpackhi_ps(even, odd);  // e2 o2 e3 o3 | e6 o6 e7 o7
      _mm256_storeu_ps(dst + d, _mm256_permute2f128_ps(lo, hi, 0x20));
      _mm256_storeu_ps(dst + d + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
  }
  for (; d < n; ++d) dst[d] = src[decode_pos(kDecodePairs<T>, d, n)];
}

// A natural-order fp32 row of n elements (round_up(n, 8) with its zero tail) in the decode
// order of T (the backward's operands: attention_bwd.cpp).
template <typename T>
inline void to_decode_order(const float* src, int64_t n, float* dst) {
  const int64_t n8 = round_up(n, 8);
  for (int64_t d = 0; d < n8; ++d) dst[decode_pos(kDecodePairs<T>, d, n)] = src[d];
}

}  // namespace decode_detail

#if ATTN_EXT_HAVE_AVX2_PATH

namespace decode_detail {

// ATTN_EXT_CPU_DECODE_QUADS=0: score 4+ columns of bf16 / fp16 rows by pairs (NC = 2) as before
// the seventh session, for benchmarks comparing both (the bits are the same). Read on every
// decode call, so that an A/B can alternate it call by call (bench_switch_ab.py).
inline bool decode_quads_enabled() {
  return !cpu::env_is("ATTN_EXT_CPU_DECODE_QUADS", "0");
}

// f(std::integral_constant<int, n>{}) for the row lengths n that have instances fixed at
// compile time (64, 128), else f(std::integral_constant<int, 0>{}) (the length at run time):
// the one list scores() and pv() dispatch on.
template <typename F>
ATTN_EXT_AVX2 inline void with_fixed_length(int64_t n, F&& f) {
  if (n == 128) return f(std::integral_constant<int, 128>{});
  if (n == 64) return f(std::integral_constant<int, 64>{});
  f(std::integral_constant<int, 0>{});
}

// f(std::integral_constant<int, min(n, Max)>{}) for n in [1, Max]: the column count of a
// register tile as a compile-time constant (pv's 8-column passes, pv512's 4-column ones).
template <int Max, typename F>
ATTN_EXT_AVX2 inline void with_col_count(int64_t n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_col_count<Max - 1>(n, std::forward<F>(f));
  }
  f(std::integral_constant<int, Max>{});
}

// Sum of each of 8 vectors -> one vector [sum(a0), ..., sum(a7)].
ATTN_EXT_AVX2 inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4,
                                  __m256 a5, __m256 a6, __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
  const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 = [a0 a1 a2 a3 | a0 a1 a2 a3] partial sums of the low / high 128-bit lanes
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 16 elements of a row of T as two 8-float vectors in decode order.
template <typename T>
struct DecodeIO {
  ATTN_EXT_AVX2 static inline __m256 lo(const T* p) { return cpu::Avx2IO<T>::load(p); }
  ATTN_EXT_AVX2 static inline __m256 hi(const T* p) { return cpu::Avx2IO<T>::load(p + 8); }
};
template <>
struct DecodeIO<c10::BFloat16> {
  ATTN_EXT_AVX2 static inline __m256i raw(const c10::BFloat16* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  ATTN_EXT_AVX2 static inline __m256 lo(const c10::BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(raw(p), 16));
  }
  ATTN_EXT_AVX2 static inline __m256 hi(const c10::BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_and_si256(raw(p), _mm256_set1_epi32(int32_t(0xffff0000u))));
  }
};

// Chunk d of a row in decode order: Part 0 / 1 the low / high half of the 16-element chunk
// at d / d - 8, Part 2 the 8 elements at d (the tail).
template <typename T, int Part>
ATTN_EXT_AVX2 inline __m256 load_part(const T* row, int64_t d) {
  if constexpr (Part == 0) return DecodeIO<T>::lo(row + d);
  if constexpr (Part == 1) return DecodeIO<T>::hi(row + d - 8);
  return cpu::Avx2IO<T>::load(row + d);
}

// Positions [d, d + 8) (d a multiple of 8) of a row of n elements of T in decode order.
template <typename T>
ATTN_EXT_AVX2 inline __m256 decode_load8(const T* row, int64_t d, int64_t n) {
  if (d + 8 > n / 16 * 16) return load_part<T, 2>(row, d);
  return (d & 15) == 0 ? load_part<T, 0>(row, d) : load_part<T, 1>(row, d);
}

// dst[0, n) = src[0, n) as fp32 in decode order; dst has room for round_up(n, 8) and the tail
// is zero-filled.
template <typename scalar_t>
ATTN_EXT_AVX2 inline void pack_row(const scalar_t* src, int64_t n, float* dst) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    _mm256_storeu_ps(dst + d, DecodeIO<scalar_t>::lo(src + d));
    _mm256_storeu_ps(dst + d + 8, DecodeIO<scalar_t>::hi(src + d));
  }
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(dst + d, cpu::Avx2IO<scalar_t>::load(src + d));
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  for (; d % 8 != 0; ++d) dst[d] = 0.f;
}

// One 8-float chunk d of NK rows against NC columns: a[r * NC + c] += q_c[d..] * k_r[d..].
template <typename kT, int NC, int NK, int Part>
ATTN_EXT_AVX2 inline void scores_step(const float* qs, int64_t Dp, const kT* k0, int64_t ldk,
                                      int64_t d, __m256* a) {
  __m256 kv[NK];
#pragma GCC unroll 8
  for (int r = 0; r < NK; ++r) kv[r] = load_part<kT, Part>(k0 + r * ldk, d);
#pragma GCC unroll 4
  for (int c = 0; c < NC; ++c) {
    __m256 q = _mm256_loadu_ps(qs + c * Dp + d);
#if defined(__GNUC__)
    if constexpr (NK > 1) asm("" : "+x"(q));  // one load of q, not one folded into each FMA
#endif
#pragma GCC unroll 8
    for (int r = 0; r < NK; ++r) a[r * NC + c] = _mm256_fmadd_ps(q, kv[r], a[r * NC + c]);
  }
}

// s (NC columns, NK = 8 / NC keys) for the keys [0, NK) of k0: 8 accumulators, so one load of
// each K vector serves NC columns. Each accumulator sums q_c . k_r over the 8-float chunks of
// d in decode order and hsum8 reduces every lane the same way, so the bits do not depend on
// NK / NC, nor on whether kb is the cache's rows or a packed copy.
template <typename kT, int NC, int DC>
ATTN_EXT_AVX2 inline void scores_keys(const float* qs, int64_t Dp_, const kT* k0, int64_t ldk,
                                      float* s, int64_t ld) {
  constexpr int NK = 8 / NC;
  const int64_t Dp = DC ? DC : Dp_;
  const int64_t D16 = Dp / 16 * 16;
  __m256 a[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d < D16; d += 16) {
    scores_step<kT, NC, NK, 0>(qs, Dp, k0, ldk, d, a);
    scores_step<kT, NC, NK, 1>(qs, Dp, k0, ldk, d + 8, a);
  }
  if (d < Dp) scores_step<kT, NC, NK, 2>(qs, Dp, k0, ldk, d, a);
  const __m256 h = hsum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
  if constexpr (NC == 1) {
    _mm256_storeu_ps(s, h);
  } else {
    alignas(32) float t[8];
    _mm256_store_ps(t, h);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) s[(i % NC) * ld + i / NC] = t[i];
  }
}

// s (NC columns, nk8 keys), 8 / NC keys at a time. scores() takes pairs of columns x 4 keys,
// 1 column x 8 keys for a last odd column (MHA: every column), and for bf16 / fp16 rows read
// in place 4 columns x 2 keys wherever 4 columns are left (GQA 4+, or 2 query rows x 2 heads):
// each row is then widened once for 4 columns instead of once per pair. Measured (RESULTS.md,
// seventh session; bench_switch_ab.py --switch decode-quads, alternated call by call): bf16
// 4 x 2 against pairs -0.6 to -1.3 % time at 1 thread, -3 to +1 % at 2 (the 2-thread decode
// waits on memory as much as on the FMAs); fp32, with nothing to widen, +1 to +3 % at 1 thread,
// so it keeps the pairs. 4 x 3 keys (12 accumulators, all 16 registers) spilled: slower.
template <typename kT, int NC, int DC>
ATTN_EXT_AVX2 inline void scores_cols(const float* qs, int64_t Dp, const kT* kb, int64_t nk8,
                                      float* s, int64_t ld, int64_t ldk) {
  static_assert(NC == 1 || NC == 2 || NC == 4, "1, 2 or 4 columns");
  for (int64_t r0 = 0; r0 < nk8; r0 += 8) {
    const kT* k0 = kb + r0 * ldk;
#pragma GCC unroll 4
    for (int g = 0; g < 8; g += 8 / NC)
      scores_keys<kT, NC, DC>(qs, Dp, k0 + g * ldk, ldk, s + r0 + g, ld);
  }
}

// ---- scores on zmm registers (AVX-512F/BW: where decode_scores512_enabled()) ----------------
// scores_keys' 8 accumulators for two groups of keys at once: zmm accumulator i holds
// scores_keys' accumulator i of keys [0, NK) in its low 8 lanes and of keys [NK, 2 NK) in its
// high 8, so one zmm FMA does two ymm FMAs' work and every lane runs the ymm lane's chain (the
// same products over the same chunks of d in the same order); the reduction applies hsum8's
// tree to each half. So the same bits as scores_keys, with half the FMA instructions (on a core
// with two 512-bit FMA units, twice the multiply-adds per cycle).

// Chunk d (Part as load_part) of rows r0 (low half) and r1 (high half).
template <typename T, int Part>
ATTN_EXT_AVX512 inline __m512 load_part2(const T* r0, const T* r1, int64_t d) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && Part != 2) {
    // the two rows' 16 raw elements side by side, then DecodeIO's shift / mask on 16 lanes
    const int64_t at = Part == 0 ? d : d - 8;
    const __m512i raw = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + at))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + at)), 1);
    if constexpr (Part == 0) return _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    return _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int32_t(0xffff0000u))));
  } else {
    return _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castpd256_pd512(_mm256_castps_pd(load_part<T, Part>(r0, d))),
        _mm256_castps_pd(load_part<T, Part>(r1, d)), 1));
  }
}

// [x0 + x1, x2 + x3, y0 + y1, y2 + y3] in each 128-bit lane: _mm256_hadd_ps's sums on 16 lanes.
ATTN_EXT_AVX512 inline __m512 hadd512(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}

template <typename kT, int NC, int NK, int Part>
ATTN_EXT_AVX512 inline void scores_step512(const float* qs, int64_t Dp, const kT* k0, int64_t ldk,
                                           int64_t d, __m512* a) {
  __m512 kv[NK];
#pragma GCC unroll 8
  for (int r = 0; r < NK; ++r) kv[r] = load_part2<kT, Part>(k0 + r * ldk, k0 + (r + NK) * ldk, d);
#pragma GCC unroll 4
  for (int c = 0; c < NC; ++c) {
    const __m512 q = _mm512_castpd_ps(
        _mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(qs + c * Dp + d))));
#pragma GCC unroll 8
    for (int r = 0; r < NK; ++r) a[r * NC + c] = _mm512_fmadd_ps(q, kv[r], a[r * NC + c]);
  }
}

// scores_keys<kT, NC, DC> for keys [0, 2 NK) of k0 (NK = 8 / NC, NC = 2 or 4). Its d loop is
// scores_keys' (whole 16-element chunks as Part 0 then 1, then the 8-element tail): the chains'
// order, which the two must share for equal bits (a helper taking the step as a lambda kept the
// zmm step out of line: GCC does not inline an AVX-512 lambda through an AVX2 template).
template <typename kT, int NC, int DC>
ATTN_EXT_AVX512 inline void scores_keys512(const float* qs, int64_t Dp_, const kT* k0, int64_t ldk,
                                           float* s, int64_t ld) {
  constexpr int NK = 8 / NC;
  const int64_t Dp = DC ? DC : Dp_;
  const int64_t D16 = Dp / 16 * 16;
  __m512 a[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d < D16; d += 16) {
    scores_step512<kT, NC, NK, 0>(qs, Dp, k0, ldk, d, a);
    scores_step512<kT, NC, NK, 1>(qs, Dp, k0, ldk, d + 8, a);
  }
  if (d < Dp) scores_step512<kT, NC, NK, 2>(qs, Dp, k0, ldk, d, a);
  // hsum8 on each half: t = hadd pairs, u = hadd of those, then the 128-bit lanes' sums
  const __m512 t0 = hadd512(a[0], a[1]), t1 = hadd512(a[2], a[3]);
  const __m512 t2 = hadd512(a[4], a[5]), t3 = hadd512(a[6], a[7]);
  const __m512 u0 = hadd512(t0, t1), u1 = hadd512(t2, t3);
  // 128-bit lanes of u0: [acc 0-3 low keys: d-half 0 | d-half 1 | high keys: half 0 | half 1];
  // lo = [u0.0, u0.2, u1.0, u1.2], hi = [u0.1, u0.3, u1.1, u1.3]: h = lo + hi =
  // [acc 0-3 (low keys), acc 0-3 (high keys), acc 4-7 (low), acc 4-7 (high)]
  const __m512 h = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
  alignas(64) float t[16];
  _mm512_store_ps(t, h);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // accumulator i: column i % NC, key i / NC (+ NK: high half)
    const int at = (i / 4) * 8 + i % 4;
    s[(i % NC) * ld + i / NC] = t[at];
    s[(i % NC) * ld + i / NC + NK] = t[at + 4];
  }
}

template <typename kT, int NC, int DC>
ATTN_EXT_AVX512 inline void scores_cols512(const float* qs, int64_t Dp, const kT* kb, int64_t nk8,
                                           float* s, int64_t ld, int64_t ldk) {
  static_assert(NC == 2 || NC == 4, "2 or 4 columns");
  constexpr int NK = 8 / NC;
  for (int64_t r0 = 0; r0 < nk8; r0 += 8) {
    const kT* k0 = kb + r0 * ldk;
#pragma GCC unroll 2
    for (int g = 0; g < 8; g += 2 * NK)
      scores_keys512<kT, NC, DC>(qs, Dp, k0 + g * ldk, ldk, s + r0 + g, ld);
  }
}

// scores() for one row length: DC = Dp known at compile time (0: Dp at run time).
template <typename kT, int DC>
ATTN_EXT_AVX2 inline void scores_dc(const float* qs, int64_t C, int64_t Dp, const kT* kb,
                                    int64_t nk8, float* s, int64_t ld, int64_t ldk, bool quads,
                                    bool wide) {
  int64_t c0 = 0;
  if (sizeof(kT) == 2 && quads) {
    for (; c0 + 4 <= C; c0 += 4) {
      if (wide)
        scores_cols512<kT, 4, DC>(qs + c0 * Dp, Dp, kb, nk8, s + c0 * ld, ld, ldk);
      else
        scores_cols<kT, 4, DC>(qs + c0 * Dp, Dp, kb, nk8, s + c0 * ld, ld, ldk);
    }
  }
  for (int64_t c = c0; c < C; c += 2) {
    if (C - c >= 2 && wide)
      scores_cols512<kT, 2, DC>(qs + c * Dp, Dp, kb, nk8, s + c * ld, ld, ldk);
    else if (C - c >= 2)
      scores_cols<kT, 2, DC>(qs + c * Dp, Dp, kb, nk8, s + c * ld, ld, ldk);
    else
      scores_cols<kT, 1, DC>(qs + c * Dp, Dp, kb, nk8, s + c * ld, ld, ldk);
  }
}

// s[c * ld + r] = qs[c] . kb[r] for r in [0, nk8) (nk8 a multiple of 8 after padding rows).
// The backward (attention_bwd.cpp) computes its scores with this function too wherever the
// forward is this kernel (decode_supported): it recomputes P = exp(s - lse) from the same bits.
// kb: fp32 (a packed block) or the cache's own rows (kT = its dtype, ldk = its row stride,
// read in place: widening bf16 / fp16 is exact, so the same products and the same bits).
// quads: 4-column tiles for 2-byte rows (decode_quads_enabled; the same bits either way).
// Rows of 64 and 128 take instances with the length fixed at compile time (with_fixed_length;
// the same operations in the same order: the same bits). Measured (RESULTS.md, seventh
// session; alternated call by call through a temporary switch), with pv() likewise: GQA decode
// at D = 128 +2.5-3 % (bf16) and +3.5-7 % (fp32) at 1 thread, +1.5-7 % / 0-5 % at 2; MHA
// unchanged.
template <typename kT = float>
ATTN_EXT_AVX2 inline void scores(const float* qs, int64_t C, int64_t Dp, const kT* kb,
                                 int64_t nk8, float* s, int64_t ld, int64_t ldk = -1,
                                 bool quads = false, bool wide = false) {
  if (ldk < 0) ldk = Dp;
  with_fixed_length(Dp, [&](auto dc) ATTN_EXT_AVX2 {
    scores_dc<kT, decltype(dc)::value>(qs, C, Dp, kb, nk8, s, ld, ldk, quads, wide);
  });
}
// o (C, Dvp) += p (C, nk; ld) vb (nk, Dvp), for the keys r with use[r] (others skipped, so a
// non-finite v of a hidden key never meets a 0 probability). vb: fp32 or the cache's rows.
template <int NC, int DC, typename vT>
ATTN_EXT_AVX2 inline void pv_cols(const float* p, int64_t ld, const vT* vb, int64_t Dvp_,
                                  const uint8_t* use, int64_t nk, float* o, int64_t ldv) {
  const int64_t Dvp = DC ? DC : Dvp_;
  int64_t d = 0;
  if constexpr (NC <= 4) {
    // two 8-float chunks of d at once: 2 NC independent accumulation chains (FMA latency)
    for (; d + 16 <= Dvp; d += 16) {
      __m256 acc[NC][2];
      for (int c = 0; c < NC; ++c) {
        acc[c][0] = _mm256_loadu_ps(o + c * Dvp + d);
        acc[c][1] = _mm256_loadu_ps(o + c * Dvp + d + 8);
      }
      for (int64_t r = 0; r < nk; ++r) {
        if (!use[r]) continue;
        const __m256 v0 = DecodeIO<vT>::lo(vb + r * ldv + d);
        const __m256 v1 = DecodeIO<vT>::hi(vb + r * ldv + d);
        for (int c = 0; c < NC; ++c) {
          const __m256 pr = _mm256_broadcast_ss(p + c * ld + r);
          acc[c][0] = _mm256_fmadd_ps(pr, v0, acc[c][0]);
          acc[c][1] = _mm256_fmadd_ps(pr, v1, acc[c][1]);
        }
      }
      for (int c = 0; c < NC; ++c) {
        _mm256_storeu_ps(o + c * Dvp + d, acc[c][0]);
        _mm256_storeu_ps(o + c * Dvp + d + 8, acc[c][1]);
      }
    }
  }
  for (; d < Dvp; d += 8) {
    __m256 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_loadu_ps(o + c * Dvp + d);
    for (int64_t r = 0; r < nk; ++r) {
      if (!use[r]) continue;
      const __m256 vv = decode_load8(vb + r * ldv, d, Dvp);
      for (int c = 0; c < NC; ++c)
        acc[c] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + c * ld + r), vv, acc[c]);
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(o + c * Dvp + d, acc[c]);
  }
}

// pv() for one row length: DC = Dvp known at compile time (0: Dvp at run time).
template <int DC, typename vT>
ATTN_EXT_AVX2 inline void pv_dc(const float* p, int64_t ld, int64_t C, const vT* vb,
                                int64_t Dvp, const uint8_t* use, int64_t nk, float* o,
                                int64_t ldv) {
  for (int64_t c0 = 0; c0 < C; c0 += 8) {
    with_col_count<8>(C - c0, [&](auto nc) ATTN_EXT_AVX2 {
      pv_cols<decltype(nc)::value, DC>(p + c0 * ld, ld, vb, Dvp, use, nk, o + c0 * Dvp, ldv);
    });
  }
}

// ---- the PV product with AVX-512 (where cpu::avx512_enabled(); Dvp a multiple of 16) ----
// The same fma(p, v, o) per output element, keys in the same order: the same bits as pv_cols.
// Wider registers (16 floats) and twice as many (32) let each key's row be read once per
// 64 elements of d for up to 4 columns, where the AVX2 loop reads it once per 16 (the rows lie
// at the cache's row stride, 2 KiB for 8 kv heads x 128 bf16, so they rarely stay in L1
// between passes), and widen bf16 with one byte shuffle per 16 elements.
// Measured (RESULTS.md, eleventh session): benchmarks/micro/decode_loops.cpp, one thread, V in
// L2, cycles per (key, kv head) AVX2 -> AVX-512: fp32 4 columns x 128 68.5 -> 45.0, bf16 4 x 128
// 47.0 -> 44.2, bf16 7 x 96 80.1 -> 55.2, fp32 MHA 30.4 -> 30.1; the whole decode call
// (bench_switch_ab.py --switch decode-pv512, alternated call by call) 0-7 % faster in fp32,
// 0-3.5 % in bf16.

// 16 elements of a row of T as one 16-float vector in decode order (decode_pos: bf16 chunks
// are [even elements | odd elements]; fp32 / fp16 natural).
template <typename T>
struct DecodeIO16;
template <>
struct DecodeIO16<float> {
  ATTN_EXT_AVX512 static inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
};
template <>
struct DecodeIO16<c10::Half> {
  ATTN_EXT_AVX512 static inline __m512 load(const c10::Half* p) {
    // (the maskz forms, all lanes kept: GCC 12's unmasked ones warn of an undefined source)
    return _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};
template <>
struct DecodeIO16<c10::BFloat16> {
  // The 32 bytes in both halves; each 32-bit lane i of the low half takes the bf16 in bytes
  // 4i, 4i + 1 (element 2i) as its top 16 bits, of the high half bytes 4i + 2, 4i + 3
  // (element 2i + 1): a byte shuffle within 128-bit lanes, whose sources are the same halves.
  ATTN_EXT_AVX512 static inline __m512 load(const c10::BFloat16* p) {
    const __m512i z = _mm512_maskz_broadcast_i64x4(
        0xFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i ctrl = _mm512_set_epi8(
        15, 14, -128, -128, 11, 10, -128, -128, 7, 6, -128, -128, 3, 2, -128, -128,
        15, 14, -128, -128, 11, 10, -128, -128, 7, 6, -128, -128, 3, 2, -128, -128,
        13, 12, -128, -128, 9, 8, -128, -128, 5, 4, -128, -128, 1, 0, -128, -128,
        13, 12, -128, -128, 9, 8, -128, -128, 5, 4, -128, -128, 1, 0, -128, -128);
    return _mm512_castsi512_ps(_mm512_shuffle_epi8(z, ctrl));
  }
};

// The accumulators of NC columns x 64 elements of o (rows ld apart) loaded from (Store false)
// or stored to (true) o: the PV products' register tile (pv512_cols, pv_pairs_cols).
template <int NC, bool Store>
ATTN_EXT_AVX512 inline void acc_tile_io(float* o, int64_t ld, __m512 (&acc)[NC][4]) {
#pragma GCC unroll 4
  for (int c = 0; c < NC; ++c)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      if constexpr (Store)
        _mm512_storeu_ps(o + c * ld + 16 * j, acc[c][j]);
      else
        acc[c][j] = _mm512_loadu_ps(o + c * ld + 16 * j);
    }
}

// o (NC, Dvp) += p (NC, nk; ld) vb (nk rows, stride ldv), NC <= 4: 64 elements of d at a time
// (4 NC accumulators), then single 16-element vectors.
template <int NC, int DC, typename vT>
ATTN_EXT_AVX512 inline void pv512_cols(const float* p, int64_t ld, const vT* vb, int64_t Dvp_,
                                       const uint8_t* use, int64_t nk, float* o, int64_t ldv) {
  const int64_t Dvp = DC ? DC : Dvp_;
  int64_t d0 = 0;
  for (; d0 + 64 <= Dvp; d0 += 64) {
    __m512 acc[NC][4];
    acc_tile_io<NC, false>(o + d0, Dvp, acc);
    for (int64_t r = 0; r < nk; ++r) {
      if (!use[r]) continue;
      __m512 vv[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) vv[j] = DecodeIO16<vT>::load(vb + r * ldv + d0 + 16 * j);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) {
        const __m512 pr = _mm512_set1_ps(p[c * ld + r]);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[c][j] = _mm512_fmadd_ps(pr, vv[j], acc[c][j]);
      }
    }
    acc_tile_io<NC, true>(o + d0, Dvp, acc);
  }
  for (; d0 < Dvp; d0 += 16) {
    __m512 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_loadu_ps(o + c * Dvp + d0);
    for (int64_t r = 0; r < nk; ++r) {
      if (!use[r]) continue;
      const __m512 vv = DecodeIO16<vT>::load(vb + r * ldv + d0);
      for (int c = 0; c < NC; ++c)
        acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(p[c * ld + r]), vv, acc[c]);
    }
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + c * Dvp + d0, acc[c]);
  }
}

template <int DC, typename vT>
ATTN_EXT_AVX512 inline void pv512_dc(const float* p, int64_t ld, int64_t C, const vT* vb,
                                     int64_t Dvp, const uint8_t* use, int64_t nk, float* o,
                                     int64_t ldv) {
  for (int64_t c0 = 0; c0 < C; c0 += 4) {
    with_col_count<4>(C - c0, [&](auto nc) ATTN_EXT_AVX512 {
      pv512_cols<decltype(nc)::value, DC>(p + c0 * ld, ld, vb, Dvp, use, nk, o + c0 * Dvp, ldv);
    });
  }
}

// Row lengths fixed at compile time as in pv() (with_fixed_length: the same list).
template <typename vT>
ATTN_EXT_AVX512 inline void pv512(const float* p, int64_t ld, int64_t C, const vT* vb,
                                  int64_t Dvp, const uint8_t* use, int64_t nk, float* o,
                                  int64_t ldv) {
  with_fixed_length(Dvp, [&](auto dc) ATTN_EXT_AVX512 {
    pv512_dc<decltype(dc)::value>(p, ld, C, vb, Dvp, use, nk, o, ldv);
  });
}

// ATTN_EXT_CPU_DECODE_PV512=0: the AVX2 PV product even where AVX-512 is there (the same
// bits), for benchmarks comparing both (bench_switch_ab.py --switch decode-pv512). Read once
// per decode call.
inline bool decode_pv512_enabled() {
  if (!cpu::avx512_enabled()) return false;
  return !cpu::env_is("ATTN_EXT_CPU_DECODE_PV512", "0");
}

// ATTN_EXT_CPU_DECODE_SCORES512=0: scores() on ymm registers only even where AVX-512 is there
// (the same bits), for benchmarks comparing both (bench_switch_ab.py --switch decode-scores512).
// Read once per decode call (the forward's and the backward's, each).
inline bool decode_scores512_enabled() {
  if (!cpu::avx512_enabled()) return false;
  return !cpu::env_is("ATTN_EXT_CPU_DECODE_SCORES512", "0");
}

// ATTN_EXT_CPU_DP_TILE16=0: dp_scores without the 16-accumulator tiles (the same bits), for
// A/B runs (bench_switch_ab.py --switch dp-tile16). Read once per decode call (the forward's
// and the backward's, each) and passed to dp_scores.
inline bool dp_tile16_enabled() { return !cpu::env_is("ATTN_EXT_CPU_DP_TILE16", "0"); }

#if ATTN_EXT_HAVE_BF16DP_PATH
// ---- bf16 scores by pairwise dot products (AVX512_BF16: where cpu::avx512bf16_enabled()) ----
// vdpbf16ps multiplies bf16 pairs exactly and adds both products to an fp32 lane: 32 elements
// of d per instruction, with nothing to widen, where scores() widens K and runs 8-float FMAs.
// q is read as bf16 too (the inputs' own values, unscaled), and the scale multiplies the sum:
// s = scale * (q . k). Each (column, key) is one chain over d in 32-element steps (the tail
// by masked loads, zero lanes adding 0), folded 16 -> 8 lanes and reduced by hsum8, so its bits
// do not depend on the tile shape, on which columns or keys are computed together, nor on
// whether q and k are packed or read in place: the forward (attention_decode_kernel) and the
// backward (attention_bwd.cpp, which recomputes P = exp(s - lse)) call this one function where
// decode_scores_by_pairs(). Its bits differ from scores()' (another summation order, and the
// instruction treats denormal inputs and results as zero): the two are alternatives for a
// whole call, never mixed in one. Its range is narrower: q . k is summed unscaled, so a score
// overflows where |q . k| passes the fp32 maximum (3.4e38), where the widened path's bound is
// |scale * q . k| (sqrt(D) times more); no attention input comes near either. Measured: RESULTS.md, seventeenth session.
ATTN_EXT_AVX512BF16 inline __m512bh dp_load(const c10::BFloat16* p, __mmask32 m) {
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}
ATTN_EXT_AVX512BF16 inline __m256 dp_fold(__m512 x) {
  const __m512d xd = _mm512_castps_pd(x);
  return _mm256_add_ps(_mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xF, xd, 0)),
                       _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xF, xd, 1)));
}

// One 32-element step of d (Tail: the last, shorter one, by masked loads) for NC columns x NK
// keys: a[r * NC + c] += pairwise products of q_c and k_r.
template <int NC, int NK, bool Tail>
ATTN_EXT_AVX512BF16 inline void dp_step(const c10::BFloat16* q, int64_t ldq, const c10::BFloat16* k,
                                        int64_t ldk, int64_t d, __mmask32 m, __m512* a) {
  __m512bh kv[NK];
#pragma GCC unroll 8
  for (int r = 0; r < NK; ++r)
    kv[r] = Tail ? dp_load(k + r * ldk + d, m) : (__m512bh)_mm512_loadu_si512(k + r * ldk + d);
#pragma GCC unroll 4
  for (int c = 0; c < NC; ++c) {
    const __m512bh qv = Tail ? dp_load(q + c * ldq + d, m) : (__m512bh)_mm512_loadu_si512(q + c * ldq + d);
#pragma GCC unroll 8
    for (int r = 0; r < NK; ++r) a[r * NC + c] = _mm512_dpbf16_ps(a[r * NC + c], qv, kv[r]);
  }
}

// s[c * ld + r] for NC columns x NK keys (NC * NK <= 8 accumulators).
template <int NC, int NK, int DC>
ATTN_EXT_AVX512BF16 inline void dp_scores_tile(const c10::BFloat16* q, int64_t ldq,
                                               const c10::BFloat16* k, int64_t ldk, int64_t D_,
                                               float scale, float* s, int64_t ld) {
  static_assert(NC * NK <= 8, "8 accumulators at most");
  const int64_t D = DC ? DC : D_;
  __m512 a[NC * NK];
#pragma GCC unroll 8
  for (int i = 0; i < NC * NK; ++i) a[i] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) dp_step<NC, NK, false>(q, ldq, k, ldk, d, 0, a);
  if (d < D) dp_step<NC, NK, true>(q, ldq, k, ldk, d, (__mmask32(1) << (D - d)) - 1, a);
  __m256 y[8];
#pragma GCC unroll 8
  for (int i = 0; i < NC * NK; ++i) y[i] = dp_fold(a[i]);
#pragma GCC unroll 8
  for (int i = NC * NK; i < 8; ++i) y[i] = _mm256_setzero_ps();
  const __m256 h = _mm256_mul_ps(hsum8(y[0], y[1], y[2], y[3], y[4], y[5], y[6], y[7]),
                                 _mm256_set1_ps(scale));
  alignas(32) float t[8];
  _mm256_store_ps(t, h);
#pragma GCC unroll 8
  for (int i = 0; i < NC * NK; ++i) s[(i % NC) * ld + i / NC] = t[i];
}

// dp_scores_tile for NC columns x NK keys with NC * NK = 16 accumulators, reduced 16 at a time:
// accumulator i's 16 lanes x become the sum ((y0 + y1) + (y2 + y3)) + ((y4 + y5) + (y6 + y7)),
// y_j = x_j + x_(j + 8), the tree dp_fold and hsum8 give it in dp_scores_tile (so the same bits
// whichever tile computes a score), in 45 shuffles and adds for 16 scores where the 8-accumulator
// tile takes about as many for 8.
template <int NC, int NK, int DC>
ATTN_EXT_AVX512BF16 inline void dp_scores_tile16(const c10::BFloat16* q, int64_t ldq,
                                                 const c10::BFloat16* k, int64_t ldk,
                                                 int64_t D_, float scale, float* s, int64_t ld) {
  static_assert(NC * NK == 16, "16 accumulators");
  const int64_t D = DC ? DC : D_;
  __m512 a[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) dp_step<NC, NK, false>(q, ldq, k, ldk, d, 0, a);
  if (d < D) dp_step<NC, NK, true>(q, ldq, k, ldk, d, (__mmask32(1) << (D - d)) - 1, a);
  // fold: z[i] = [y(2i) | y(2i + 1)], y(a) = lo256(a) + hi256(a) (lanes [0, 8) of a + [8, 16))
  __m512 z[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  }
  // 128-bit lane L of z[i] holds y(2i + L / 2)'s elements [4 (L % 2), 4 (L % 2) + 4)
  __m512 w[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) w[i] = hadd512(z[2 * i], z[2 * i + 1]);
  const __m512 v0 = hadd512(w[0], w[1]), v1 = hadd512(w[2], w[3]);
  // lane L of v0: [acc 2c + L / 2 for c = 0, 1, 2, 3]'s half sums (L % 2: elements 4-7); v1:
  // accumulators 8 + those. Add the halves: r = [0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15]
  const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
  alignas(64) float t[16];
  _mm512_store_ps(t, _mm512_mul_ps(r, _mm512_set1_ps(scale)));
  constexpr int kAt[16] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};  // acc -> t
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) s[(i % NC) * ld + i / NC] = t[kAt[i]];
}

// NC columns against keys [0, nk): 8 / NC keys at a time, then one at a time.
template <int NC, int DC>
ATTN_EXT_AVX512BF16 inline void dp_scores_cols(const c10::BFloat16* q, int64_t ldq,
                                               const c10::BFloat16* k, int64_t ldk, int64_t nk,
                                               int64_t D, float scale, float* s, int64_t ld,
                                               bool tile16) {
  constexpr int NK = 8 / NC;
  int64_t r = 0;
  if constexpr (NC >= 2) {  // (1 x 16 keys: 16 K vectors and 16 accumulators, too many registers)
    if (tile16) {
      for (; r + 2 * NK <= nk; r += 2 * NK)
        dp_scores_tile16<NC, 2 * NK, DC>(q, ldq, k + r * ldk, ldk, D, scale, s + r, ld);
    }
  }
  for (; r + NK <= nk; r += NK)
    dp_scores_tile<NC, NK, DC>(q, ldq, k + r * ldk, ldk, D, scale, s + r, ld);
  for (; r < nk; ++r) dp_scores_tile<NC, 1, DC>(q, ldq, k + r * ldk, ldk, D, scale, s + r, ld);
}

// s[c * ld + r] = scale * (q_c . k_r) for columns c < C (rows of q at stride ldq) and keys
// r < nk (rows of k at stride ldk), bf16 rows of D elements in natural order, read where they
// are. Column tiles of 4 (2 keys each), then 2 or 1 (MHA: 1 column x 8 keys); of 4 x 4 and 2 x 8
// first where tile16 (dp_tile16_enabled(): the same bits).
ATTN_EXT_AVX512BF16 inline void dp_scores(const c10::BFloat16* q, int64_t ldq, int64_t C,
                                          const c10::BFloat16* k, int64_t ldk, int64_t nk,
                                          int64_t D, float scale, float* s, int64_t ld,
                                          bool tile16) {
  with_fixed_length(D, [&](auto dc) ATTN_EXT_AVX512BF16 {
    constexpr int DC = decltype(dc)::value;
    int64_t c = 0;
    for (; c + 4 <= C; c += 4)
      dp_scores_cols<4, DC>(q + c * ldq, ldq, k, ldk, nk, D, scale, s + c * ld, ld, tile16);
    for (; c + 2 <= C; c += 2)
      dp_scores_cols<2, DC>(q + c * ldq, ldq, k, ldk, nk, D, scale, s + c * ld, ld, tile16);
    for (; c < C; ++c)
      dp_scores_cols<1, DC>(q + c * ldq, ldq, k, ldk, nk, D, scale, s + c * ld, ld, tile16);
  });
}

// ---- the bf16 PV product by pairwise dot products (AVX512_BF16: decode_pv_by_pairs) ----
// o (NC, Dvp) += p v with p rounded to bf16 (round to nearest even), two keys per vdpbf16ps:
// each fp32 lane of o adds bf16(p_r) v_r + bf16(p_r+1) v_r+1 for the keys in pairs (0, 1),
// (2, 3), ... in order, half the instructions of the widened FMAs and no widening of V.
// Rounding p to bf16 before this product is what PyTorch's own bf16 flash kernel on CPU, and
// the tiles' pass 3 (attention_amx.cpp pv_amx), do. vpermt2w puts the pairs (v_r[e], v_r+1[e])
// of 16 elements e of the two rows into the 16 lanes in the decode order (decode_pos: the even
// elements of each 16-element chunk, then the odd ones), so o's layout is the fp32 paths'.
// The instruction counts denormal inputs as zero and flushes denormal sums.
alignas(64) inline constexpr int16_t kPairIdx[2][32] = {
    {0, 32, 2, 34, 4, 36, 6, 38, 8, 40, 10, 42, 12, 44, 14, 46,
     1, 33, 3, 35, 5, 37, 7, 39, 9, 41, 11, 43, 13, 45, 15, 47},
    {16, 48, 18, 50, 20, 52, 22, 54, 24, 56, 26, 58, 28, 60, 30, 62,
     17, 49, 19, 51, 21, 53, 23, 55, 25, 57, 27, 59, 29, 61, 31, 63}};

// keys [0, nk) of NC columns (nk a multiple of 8, at most kDecodePairKeys; every key used:
// the callers zero the rows and probabilities of keys that take no part)
constexpr int64_t kDecodePairKeys = 16;
template <int NC, int DC>
ATTN_EXT_AVX512BF16 inline void pv_pairs_cols(const float* p, int64_t ld,
                                              const c10::BFloat16* vb, int64_t Dvp_, int64_t nk,
                                              float* o, int64_t ldv) {
  const int64_t Dvp = DC ? DC : Dvp_;
  alignas(64) uint32_t pw[NC][kDecodePairKeys / 2];
#pragma GCC unroll 4
  for (int c = 0; c < NC; ++c)
    for (int64_t r = 0; r < nk; r += 8)
      _mm_store_si128(reinterpret_cast<__m128i*>(&pw[c][r / 2]),
                      (__m128i)_mm256_cvtneps_pbh(_mm256_loadu_ps(p + c * ld + r)));
  const __m512i i0 = _mm512_load_si512(kPairIdx[0]), i1 = _mm512_load_si512(kPairIdx[1]);
  int64_t d0 = 0;
  for (; d0 + 64 <= Dvp; d0 += 64) {
    __m512 acc[NC][4];
    acc_tile_io<NC, false>(o + d0, Dvp, acc);
    for (int64_t t = 0; t < nk / 2; ++t) {
      const c10::BFloat16* a = vb + 2 * t * ldv + d0;
      const __m512i a0 = _mm512_loadu_si512(a), a1 = _mm512_loadu_si512(a + 32);
      const __m512i b0 = _mm512_loadu_si512(a + ldv), b1 = _mm512_loadu_si512(a + ldv + 32);
      const __m512bh x[4] = {(__m512bh)_mm512_permutex2var_epi16(a0, i0, b0),
                             (__m512bh)_mm512_permutex2var_epi16(a0, i1, b0),
                             (__m512bh)_mm512_permutex2var_epi16(a1, i0, b1),
                             (__m512bh)_mm512_permutex2var_epi16(a1, i1, b1)};
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[c][t]));
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[c][j] = _mm512_dpbf16_ps(acc[c][j], x[j], w);
      }
    }
    acc_tile_io<NC, true>(o + d0, Dvp, acc);
  }
  for (; d0 < Dvp; d0 += 16) {  // (Dvp a multiple of 16)
    __m512 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_loadu_ps(o + c * Dvp + d0);
    for (int64_t t = 0; t < nk / 2; ++t) {
      const c10::BFloat16* a = vb + 2 * t * ldv + d0;
      const __m512bh x = (__m512bh)_mm512_permutex2var_epi16(
          _mm512_maskz_loadu_epi16(0xFFFF, a), i0, _mm512_maskz_loadu_epi16(0xFFFF, a + ldv));
      for (int c = 0; c < NC; ++c)
        acc[c] = _mm512_dpbf16_ps(acc[c], x, (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[c][t])));
    }
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + c * Dvp + d0, acc[c]);
  }
}

template <int DC>
ATTN_EXT_AVX512BF16 inline void pv_pairs_dc(const float* p, int64_t ld, int64_t C,
                                            const c10::BFloat16* vb, int64_t Dvp, int64_t nk,
                                            float* o, int64_t ldv) {
  for (int64_t c0 = 0; c0 < C; c0 += 4) {
    with_col_count<4>(C - c0, [&](auto nc) ATTN_EXT_AVX512BF16 {
      pv_pairs_cols<decltype(nc)::value, DC>(p + c0 * ld, ld, vb, Dvp, nk, o + c0 * Dvp, ldv);
    });
  }
}

// o (C, Dvp) += bf16(p) (C, nk; ld) vb (nk rows, stride ldv), nk a multiple of 8: keys taken
// kDecodePairKeys at a time (the same pairs in the same order: the same bits for any split).
ATTN_EXT_AVX512BF16 inline void pv_pairs(const float* p, int64_t ld, int64_t C,
                                         const c10::BFloat16* vb, int64_t Dvp, int64_t nk,
                                         float* o, int64_t ldv) {
  with_fixed_length(Dvp, [&](auto dc) ATTN_EXT_AVX512BF16 {
    for (int64_t r = 0; r < nk; r += kDecodePairKeys)
      pv_pairs_dc<decltype(dc)::value>(p + r, ld, C, vb + r * ldv, Dvp,
                                       std::min(kDecodePairKeys, nk - r), o, ldv);
  });
}

// The keys of a block at a band's edge (seen by some columns, hidden from others; every block
// of a varlen call whose sequence has fewer rows than the call's columns) with the pairs'
// rounding: o_c += bf16(p_c,r) v_r for the pairs (c, r) with seen[c * lds + r], one key at a
// time, so a hidden pair's zero probability never meets a non-finite v; 64 (then 16) elements
// of d in registers, in the decode order (DecodeIO16). Dvp a multiple of 16.
ATTN_EXT_AVX512BF16 inline void pv_pairs_edge(const float* p, int64_t ld, int64_t C,
                                              const c10::BFloat16* vb, int64_t Dvp,
                                              const uint8_t* seen, int64_t lds, int64_t nk,
                                              float* o) {
  for (int64_t c = 0; c < C; ++c) {
    float* oc = o + c * Dvp;
    int64_t d0 = 0;
    for (; d0 < Dvp; d0 += (d0 + 64 <= Dvp ? 64 : 16)) {
      const int nv = d0 + 64 <= Dvp ? 4 : 1;
      __m512 acc[4];
      for (int j = 0; j < nv; ++j) acc[j] = _mm512_loadu_ps(oc + d0 + 16 * j);
      for (int64_t r = 0; r < nk; ++r) {
        if (!seen[c * lds + r]) continue;
        const __m512 pr = _mm512_set1_ps(static_cast<float>(c10::BFloat16(p[c * ld + r])));
        const c10::BFloat16* vr = vb + r * Dvp + d0;
        for (int j = 0; j < nv; ++j)
          acc[j] = _mm512_fmadd_ps(pr, DecodeIO16<c10::BFloat16>::load(vr + 16 * j), acc[j]);
      }
      for (int j = 0; j < nv; ++j) _mm512_storeu_ps(oc + d0 + 16 * j, acc[j]);
    }
  }
}

// The in-place blocks' 8-key group (GroupProducts::pv)
template <int DC>
ATTN_EXT_AVX512BF16 __attribute__((flatten)) void group_pv_pairs(const float* p, int64_t ld,
                                                                 int64_t C, const c10::BFloat16* vb,
                                                                 int64_t Dvp, const uint8_t*,
                                                                 float* o, int64_t ldv) {
  pv_pairs_dc<DC>(p, ld, C, vb, Dvp, 8, o, ldv);
}

#endif  // ATTN_EXT_HAVE_BF16DP_PATH

// Whether a decode call on scalar_t scores by dp_scores: bf16, not on the tiles
// (decode_scores_on_tiles, below, takes precedence) and the rule's bf16dp_tiled, the tiled
// kernels' rule (AVX512_BF16, not ATTN_EXT_CPU_BF16DP=0, and ATTN_EXT_CPU_BF16DP=1 or a CPU
// that is not Intel's). On the Intel Xeon of the nineteenth session, where vdpbf16ps runs
// at half the fp32 zmm FMA rate, the widened scores on zmm (scores_cols512) took 0.85-0.95x the
// pairs' time at issue 16's bf16 decode shapes, 1 and 2 threads (RESULTS.md); on the Zen 4 of
// the seventeenth the pairs were the faster. The one rule the forward and the backward ask, once
// per call each: the two must see the same value (the backward recomputes the forward's scores
// bit for bit).
template <typename scalar_t>
inline bool decode_scores_on_tiles(const mk::TileRule& rule, int64_t D);
template <typename scalar_t>
inline bool decode_scores_by_pairs(const mk::TileRule& rule, int64_t D) {
  return ATTN_EXT_HAVE_BF16DP_PATH && std::is_same_v<scalar_t, c10::BFloat16> &&
         rule.bf16dp_tiled && !decode_scores_on_tiles<scalar_t>(rule, D);
}

// Whether a decode call on scalar_t takes its scores from AMX tiles (mk::decode_scores_amx):
// bf16 where the tiled kernels' products are on tiles at this depth (rule.amx_for(D): AMX,
// D a multiple of 32), for every block of the call, K read where it is. The decode is bound
// by its arithmetic at the cache-resident sizes (RESULTS.md, twenty-fourth session: the same
// time per key with K / V in L2 as in L3); the tiles take a fraction of the widened FMAs'
// time. The backward asks the same rule and recomputes with scores_amx (the same chains).
// As for the pairs: q . k is summed before the scale (it overflows fp32 sqrt(D) times sooner
// than the widened path), and the tiles count denormal inputs as zero.
template <typename scalar_t>
inline bool decode_scores_on_tiles(const mk::TileRule& rule, int64_t D) {
  return std::is_same_v<scalar_t, c10::BFloat16> && rule.amx_for(D);
}

// Whether a decode call on scalar_t forms o += p v by pairs (pv_pairs: p rounded to bf16, two
// keys per vdpbf16ps): where its scores are pairs (decode_scores_by_pairs: a CPU whose
// vdpbf16ps runs at the fp32 FMA's rate or better), Dv a multiple of 16, and
// ATTN_EXT_CPU_DECODE_PV_PAIRS=0 not set (read once per call; for A/B runs: the widened product
// keeps p in fp32, so the bits differ). Every block of the call takes it (in place, packed, and
// the keys at a band's edge, which round p the same way), so reading in place or packing gives
// the same bits. The backward does not ask: it recomputes P in fp32 from lse, as the tiles' and
// PyTorch's bf16 kernels do after their rounded forward product.
template <typename scalar_t>
inline bool decode_pv_by_pairs(const mk::TileRule& rule, int64_t D, int64_t Dv) {
  return decode_scores_by_pairs<scalar_t>(rule, D) && Dv % 16 == 0 &&
         !cpu::env_is("ATTN_EXT_CPU_DECODE_PV_PAIRS", "0");
}

// Rows of 64 and 128 take instances with the length fixed at compile time (with_fixed_length;
// same bits). wide (decode_pv512_enabled()): pv512 where Dvp is a multiple of 16 (the same
// bits).
template <typename vT = float>
ATTN_EXT_AVX2 inline void pv(const float* p, int64_t ld, int64_t C, const vT* vb,
                             int64_t Dvp, const uint8_t* use, int64_t nk, float* o,
                             int64_t ldv = -1, bool wide = false) {
  if (ldv < 0) ldv = Dvp;
  if (wide && Dvp % 16 == 0) return pv512(p, ld, C, vb, Dvp, use, nk, o, ldv);
  with_fixed_length(Dvp, [&](auto dc) ATTN_EXT_AVX2 {
    pv_dc<decltype(dc)::value>(p, ld, C, vb, Dvp, use, nk, o, ldv);
  });
}

// ---- one 8-key group of one kv head, with the dispatch done once per call ----------------
// The in-place blocks take the scores and the PV product of every kv head 8 keys at a time.
// Through scores() / pv() each such call went down 4-5 levels of dispatch (row length, column
// count, ymm / zmm), none of them inlined (the zmm functions cannot inline into the AVX2
// ones). group_products() picks, once per call, one function for each product that runs the
// same loops (scores_dc / pv512_dc / pv_dc, inlined): the same operations in the same order, so
// the same bits. Measured (RESULTS.md, twenty-fourth session; alternated process by process, 2
// threads): bf16 decode 3-8 % faster at (1, 4096) and (4, 2048), fp32 0-8 %.
template <typename T>
struct GroupProducts {
  // s[c * ld + r] = qs[c] . kb[r], r < 8 (scores() with nk8 = 8)
  void (*scores)(const float* qs, int64_t C, int64_t Dp, const T* kb, float* s, int64_t ld,
                 int64_t ldk);
  // o (C, Dvp) += p (C, 8; ld) vb (8 rows, stride ldv) for the keys with use[r] (pv(), nk = 8)
  void (*pv)(const float* p, int64_t ld, int64_t C, const T* vb, int64_t Dvp,
             const uint8_t* use, float* o, int64_t ldv);
};

// (flatten: scores_dc / pv512_dc and the zmm functions they call are inlined here, which an
// AVX2 caller cannot do)
template <typename kT, int DC, bool Quads>
ATTN_EXT_AVX512 __attribute__((flatten)) void group_scores512(const float* qs, int64_t C,
                                                              int64_t Dp, const kT* kb, float* s,
                                                              int64_t ld, int64_t ldk) {
  scores_dc<kT, DC>(qs, C, Dp, kb, 8, s, ld, ldk, Quads, true);
}

template <typename kT, int DC, bool Quads>
ATTN_EXT_AVX2 void group_scores256(const float* qs, int64_t C, int64_t Dp, const kT* kb,
                                   float* s, int64_t ld, int64_t ldk) {
  scores_dc<kT, DC>(qs, C, Dp, kb, 8, s, ld, ldk, Quads, false);
}

template <int DC, typename vT>
ATTN_EXT_AVX512 __attribute__((flatten)) void group_pv512(const float* p, int64_t ld, int64_t C,
                                                          const vT* vb, int64_t Dvp,
                                                          const uint8_t* use, float* o,
                                                          int64_t ldv) {
  pv512_dc<DC>(p, ld, C, vb, Dvp, use, 8, o, ldv);
}

template <int DC, typename vT>
ATTN_EXT_AVX2 void group_pv256(const float* p, int64_t ld, int64_t C, const vT* vb,
                               int64_t Dvp, const uint8_t* use, float* o, int64_t ldv) {
  pv_dc<DC>(p, ld, C, vb, Dvp, use, 8, o, ldv);
}

// The functions scores(..., nk8 = 8, ldk, quads, wide_scores) and pv(..., nk = 8, ldv, wide_pv)
// would run for rows of Dp / Dvp elements; for bf16 with pairs_pv (decode_pv_by_pairs),
// pv_pairs' 8-key group instead of pv().
template <typename T>
GroupProducts<T> group_products(int64_t Dp, int64_t Dvp, bool quads, bool wide_scores,
                                bool wide_pv, bool pairs_pv) {
  GroupProducts<T> g{};
  with_fixed_length(Dp, [&](auto dc) {
    constexpr int DC = decltype(dc)::value;
    if (wide_scores)
      g.scores = quads ? &group_scores512<T, DC, true> : &group_scores512<T, DC, false>;
    else
      g.scores = quads ? &group_scores256<T, DC, true> : &group_scores256<T, DC, false>;
  });
  with_fixed_length(Dvp, [&](auto dc) {
    constexpr int DC = decltype(dc)::value;
    g.pv = wide_pv && Dvp % 16 == 0 ? &group_pv512<DC, T> : &group_pv256<DC, T>;
#if ATTN_EXT_HAVE_BF16DP_PATH
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (pairs_pv) g.pv = &group_pv_pairs<DC>;  // (decode_pv_by_pairs)
    }
#endif
  });
  return g;
}

// Software prefetch of rows [r0, min(r1, kend)) of one kv head.
template <typename T>
inline void prefetch_rows(const T* base, int64_t r0, int64_t r1, int64_t kend, int64_t row_stride,
                          int64_t n) {
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t r = r0; r < std::min(r1, kend); ++r) prefetch_range(base + r * row_stride, bytes);
}

// The prefetch of the next 8-key group, issued at kv head hkv's step of the current group
// (keys [g0, g0 + 8)): the next group's rows of heads hkv, hkv - 1, ..., hkv - P + 1 (mod Hkv),
// 8 / P rows each (head hkv - i: the rows [8 i / P, 8 (i + 1) / P) of the group). So each head's
// next rows are asked for in P parts over P steps, the last part one step before the head's
// turn. Measured (RESULTS.md, sixth session; alternated call by call), against all 8 rows of
// head hkv at its own step (P = 1), which already beat one burst for every head before the
// group: fp32 GQA +13-16 % with P = 8 (MHA -3 %, at the read roof either way); bf16 +0-9 % with
// P = 2 and slower at P = 8 (its steps are shorter: half the bytes for the same arithmetic).
template <typename T>
constexpr int kPrefetchParts = sizeof(T) == 4 ? 8 : 2;

template <typename T>
inline void prefetch_next_group(const T* seq, int64_t hkv, int64_t Hkv, int64_t g0, int64_t kend,
                                int64_t row_stride, int64_t head_stride, int64_t n) {
  constexpr int P = kPrefetchParts<T>;
  for (int i = 0; i < P; ++i) {
    int64_t h = hkv - i;  // mod Hkv, without a division (this runs once per head and 8 keys)
    while (h < 0) h += Hkv;
    prefetch_rows(seq + h * head_stride, g0 + 8 + i * 8 / P, g0 + 8 + (i + 1) * 8 / P, kend,
                  row_stride, n);
  }
}

// Keys per block: the block of every kv head in ~256 KiB of fp32 (L2), 8..kDecodeKeys.
inline int64_t block_keys(int64_t Hkv, int64_t Dp, int64_t Dvp) {
  return std::clamp<int64_t>((int64_t(256) << 10) / (4 * Hkv * (Dp + Dvp)) / 8 * 8, 8, kDecodeKeys);
}

struct DecodeScratch {
  int64_t Dp, Dvp;
  AlignedVec<float> qs;   // (Hkv, C, Dp): scale * q of every column of every kv head
  AlignedVec<c10::BFloat16> qb;  // (Hkv, C, D): q of every column, bf16 (dp_scores only)
  std::vector<uint32_t> qp;  // (Hkv, D / 2, 16): q's bf16 pairs, column c at word c (tiles only)
  int64_t nb;             // keys per block where some block may be packed (block_keys)
  int64_t ks;             // keys per block at most: nb, or kDecodeKeysInPlace (big_blocks)
  int64_t pack_cap;       // keys a packed block holds: nb, or ks when the big blocks are
                          // packed too (ATTN_EXT_CPU_DECODE_IN_PLACE=0)
  ScratchVec<float> kb;   // (Hkv, pack_cap, Dp): the block's k rows of every kv head; sized
  ScratchVec<float> vb;   // (Hkv, pack_cap, Dvp)   by pack_blocks() on the first packed block
                          // only (blocks read in place need neither: no fresh pages to fault in)
  ScratchVec<c10::BFloat16> vh;  // (Hkv, pack_cap, Dvp): V's bf16 rows where pv_pairs takes
                                 // the product (instead of vb; Dvp = Dv there)
  AlignedVec<float> s;    // (Hkv, C, ks): scores, then probabilities
  std::vector<uint8_t> use;  // (ks): key seen by some column
  std::vector<uint8_t> seen; // (C, ks): column c sees key r (band and padding)
  std::vector<float> merge;  // (2, Dvp): a column's merged o and its row in natural order
  DecodeScratch(int64_t Hkv, int64_t C, int64_t D, int64_t Dv, bool big_blocks, bool pack_big)
      : Dp(round_up(D, 8)), Dvp(round_up(Dv, 8)),
        qs(static_cast<size_t>(Hkv * C * Dp)),
        nb(block_keys(Hkv, Dp, Dvp)),
        ks(big_blocks ? std::max(nb, kDecodeKeysInPlace) : nb),
        pack_cap(pack_big ? ks : nb),
        s(static_cast<size_t>(Hkv * C * ks)),
        use(static_cast<size_t>(ks)), seen(static_cast<size_t>(C * ks)),
        merge(static_cast<size_t>(2 * Dvp)), Hkv_(Hkv) {}
  // with_k: K is packed too (not where dp_scores reads it in place); v_pairs: V as bf16 rows
  // (pv_pairs), else fp32 ones. Not filled (ScratchVec): a block packs or zeroes every k and
  // vh row it reads, and the fp32 PV skips the vb rows it did not pack (use)
  void pack_blocks(bool with_k, bool v_pairs) {
    if (with_k && kb.empty()) kb.resize(static_cast<size_t>(Hkv_ * pack_cap * Dp));
    if (v_pairs && vh.empty()) vh.resize(static_cast<size_t>(Hkv_ * pack_cap * Dvp));
    if (!v_pairs && vb.empty()) vb.resize(static_cast<size_t>(Hkv_ * pack_cap * Dvp));
  }
  int64_t Hkv_;
};

// Online softmax of the block's scores s (C, nk; row stride ks) in place, natural
// units as the tiled kernels (exp(x) = exp2(x * log2 e) after the difference), -inf hidden;
// vectorised over the keys (exp2 from simd.h). A NaN score (a NaN input
// the column sees) makes the column NaN for good.
ATTN_EXT_AVX2 inline void block_softmax(float* s, int64_t ks, int64_t C, int64_t nk, float* m,
                                        float* l, float* o, int64_t Dvp) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t nk8 = round_up(nk, 8);
  for (int64_t c = 0; c < C; ++c) {
    float* sc = s + c * ks;
    for (int64_t r = nk; r < nk8; ++r) sc[r] = neg_inf;  // the tail of the last vector
    if (std::isnan(m[c])) {  // NaN already: stays NaN, nothing more to add
      std::fill(sc, sc + nk8, 0.f);
      continue;
    }
    __m256 vmx = _mm256_set1_ps(m[c]);
    __m256 vnan = _mm256_setzero_ps();
    for (int64_t r = 0; r < nk8; r += 8) {
      const __m256 x = _mm256_loadu_ps(sc + r);
      vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      vmx = _mm256_max_ps(vmx, x);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float mx = _mm_cvtss_f32(h);
    if (_mm256_movemask_ps(vnan) != 0) {
      m[c] = l[c] = std::numeric_limits<float>::quiet_NaN();
      std::fill(sc, sc + nk8, 0.f);
      continue;
    }
    if (mx == neg_inf) {  // nothing seen yet
      std::fill(sc, sc + nk8, 0.f);
      continue;
    }
    const float alpha = std::exp(m[c] - mx);  // m[c] = -inf -> 0
    const __m256 vm = _mm256_set1_ps(mx);
    const __m256 log2e = _mm256_set1_ps(1.4426950408889634f);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t r = 0; r < nk8; r += 8) {
      const __m256 e = cpu::exp2_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(sc + r), vm), log2e));  // -inf -> 0
      _mm256_storeu_ps(sc + r, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
    if (alpha != 1.f) {
      float* oc = o + c * Dvp;
      const __m256 a = _mm256_set1_ps(alpha);
      for (int64_t d = 0; d < Dvp; d += 8) _mm256_storeu_ps(oc + d, _mm256_mul_ps(a, _mm256_loadu_ps(oc + d)));
    }
    l[c] = l[c] * alpha + _mm_cvtss_f32(t);
    m[c] = mx;
  }
}

}  // namespace decode_detail

// out / lse of every (b, h, i) from keys read once. Work units are (sequence, key chunk) and
// cover every kv head: a BSHD cache holds the rows of all heads next to each other, so a unit
// streams one contiguous range of memory (pages and prefetch streams used once, in order).
// decode_supported(p).
template <typename scalar_t>
void attention_decode_kernel(const AttentionParams& p) {
  using namespace decode_detail;
  const Visibility vis = p.visibility();
  const int64_t group = p.H / p.Hkv;
  const int64_t Dp = round_up(p.D, 8), Dvp = round_up(p.Dv, 8);
  const int64_t C = p.Sq * group;  // columns per kv head (hh * Sq + ii); rows past a shorter
                                   // packed sequence are hidden
  const int64_t Hkv = p.Hkv;
  // K / V read in place (whole 8-element vectors per row; bf16 / fp16 widened in registers)
  const bool kInPlace = p.D == Dp && p.Dv == Dvp && decode_in_place_enabled();
  const bool quads = decode_quads_enabled();
  const bool wide = decode_pv512_enabled();  // pv512 (the same bits)
  const bool wide_scores = decode_scores512_enabled();  // scores_cols512 (the same bits)
  [[maybe_unused]] const bool tile16 = dp_tile16_enabled();  // dp_scores_tile16 (same bits)
  // bf16 scores by vdpbf16ps (dp_scores) for every block of the call, in place or not
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  const mk::TileRule rule = mk::tile_rule();
  const bool tiles = decode_scores_on_tiles<scalar_t>(rule, p.D);  // mk::decode_scores_amx
  const bool dp = decode_scores_by_pairs<scalar_t>(rule, p.D);
  const bool k_direct = tiles || dp;  // scores from K where it is (no packed fp32 K)
  // o += p v by pairs (pv_pairs; p rounded to bf16) in every block of the call
  const bool v_pairs = decode_pv_by_pairs<scalar_t>(rule, p.D, p.Dv);
  // the in-place blocks' products of one 8-key group, resolved once
  const GroupProducts<scalar_t> gp =
      group_products<scalar_t>(Dp, Dvp, quads, wide_scores, wide, v_pairs);
  const int64_t qp_head = p.D / 2 * 16;  // tiles: q's pairs of one kv head (16 columns)

  // Keys some row of sequence b sees by the band (the same for every kv head).
  auto seq_keys = [&](const SeqInfo& s) -> Range {
    if (s.Sq <= 0) return {0, 0};
    return vis.band_keys_of_rows(s, 0, s.Sq);
  };
  int64_t max_keys = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    const Range r = seq_keys(vis.seq(b));
    max_keys = std::max(max_keys, r.hi - r.lo);
  }
  // Chunks per sequence: 4 units per thread (balance), each at least kDecodeMinChunk keys.
  const int64_t workers = std::max<int64_t>(1, decode_threads());
  int64_t n_chunks = std::max<int64_t>(1, ceil_div(4 * workers, p.B));
  n_chunks = std::min(n_chunks, std::max<int64_t>(1, max_keys / kDecodeMinChunk));
  // Head groups: short keys (one chunk) and fewer sequences than threads left threads idle
  // (B = 1, Sk < 512: one unit on one thread, while SDPA splits the heads). Then the kv heads
  // split into groups, one unit each; a head's scores, softmax, PV and merge are its own, so a
  // unit of fewer heads gives each head the same bits. Below kDecodeHeadSplitMinBytes of K + V
  // the fork and join cost more than the second thread saves. (Head groups in place of key
  // chunks for longer keys measured 5-26 % slower than the chunks and their merge region:
  // RESULTS.md, forty-fifth session.)
  const int64_t seq_bytes =
      max_keys * Hkv * (p.D + p.Dv) * static_cast<int64_t>(sizeof(scalar_t));
  int64_t heads_per = Hkv;
  if (decode_head_split_enabled() && n_chunks == 1 && p.B < workers && Hkv > 1 &&
      seq_bytes >= kDecodeHeadSplitMinBytes)
    heads_per = ceil_div(Hkv, std::min(Hkv, ceil_div(workers, p.B)));
  const int64_t n_hg = ceil_div(Hkv, heads_per);
  // partial state of (b, chunk, hkv): o (C, Dvp), m (C), l (C)
  const int64_t per_part = C * (Dvp + 2);
  // (not zero-filled: every task initialises its own parts first, and the fill would cost a
  // pass over them per call)
  ScratchVec<float> parts(static_cast<size_t>(p.B * n_chunks * Hkv * per_part));
  auto part_of = [&](int64_t b, int64_t chunk, int64_t hkv) {
    return parts.data() + ((b * n_chunks + chunk) * Hkv + hkv) * per_part;
  };

  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const ScoreTerms terms = p.score_terms();
  const float qscale = static_cast<float>(terms.scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Blocks of up to kDecodeKeysInPlace keys for the units whose blocks can all be read in
  // place (whole 8-element rows, no key padding, every column sees every key). The block
  // structure depends on that only, not on ATTN_EXT_CPU_DECODE_IN_PLACE, so reading in place
  // and packing give the same bits.
  const bool big_blocks = p.D == Dp && p.Dv == Dvp && !vis.has_padding();
  // one unit: the partial state of kv heads [h_lo, h_hi) (head group hg; every kv head
  // unless the heads split) of sequence b over key chunk `chunk`
  auto unit = [&](int64_t task, DecodeScratch& w) {
    const int64_t hg = task % n_hg, chunk = task / n_hg % n_chunks, b = task / n_hg / n_chunks;
    const int64_t h_lo = hg * heads_per, h_hi = std::min(Hkv, h_lo + heads_per);
    const int64_t nh = h_hi - h_lo;
    const SeqInfo sq = vis.seq(b);
    for (int64_t hkv = h_lo; hkv < h_hi; ++hkv) {
      float* part = part_of(b, chunk, hkv);
      std::fill(part, part + C * Dvp, 0.f);
      std::fill(part + C * Dvp, part + C * Dvp + C, neg_inf);
      std::fill(part + C * Dvp + C, part + per_part, 0.f);
    }
    const Range keys = seq_keys(sq);
    const int64_t per_chunk = round_up(ceil_div(keys.hi - keys.lo, n_chunks), 8);
    const int64_t kbeg = std::min(keys.hi, keys.lo + chunk * per_chunk);
    const int64_t kend = std::min(keys.hi, kbeg + per_chunk);
    if (kbeg >= kend) return;
    const int64_t nq = sq.Sq;  // rows of this sequence (<= p.Sq)

    // qs (or qb): kv head hkv, column c = hh * Sq + ii (rows past the sequence stay zero and
    // hidden); only the unit's heads [h_lo, h_hi) are cleared and read
    if (tiles) {
      w.qp.resize(static_cast<size_t>(Hkv * qp_head));
      std::fill(w.qp.begin() + h_lo * qp_head, w.qp.begin() + h_hi * qp_head, 0u);
    } else if (dp) {
      w.qb.resize(static_cast<size_t>(Hkv * C * p.D));
      std::fill(w.qb.begin() + h_lo * C * p.D, w.qb.begin() + h_hi * C * p.D, c10::BFloat16());
    } else {
      std::fill(w.qs.begin() + h_lo * C * Dp, w.qs.begin() + h_hi * C * Dp, 0.f);
    }
    for (int64_t h = h_lo * group; h < h_hi * group; ++h) {
      const int64_t hkv = h / group, hh = h % group;
      for (int64_t ii = 0; ii < nq; ++ii) {
        const scalar_t* src = q + b * p.q_batch_stride + (sq.q0 + ii) * p.q_row_stride + h * p.q_head_stride;
        if constexpr (kBf16) {
          if (tiles) {  // pair t of the row (elements 2 t, 2 t + 1) is its word t
            uint32_t* dst = w.qp.data() + hkv * qp_head + hh * p.Sq + ii;
            for (int64_t t = 0; t < p.D / 2; ++t) std::memcpy(dst + t * 16, src + 2 * t, 4);
            continue;
          }
          if (dp) {
            std::memcpy(w.qb.data() + (hkv * C + hh * p.Sq + ii) * p.D, src, p.D * sizeof(scalar_t));
            continue;
          }
        }
        float* dst = w.qs.data() + (hkv * C + hh * p.Sq + ii) * Dp;
        pack_row(src, p.D, dst);
        for (int64_t d = 0; d < p.D; ++d) dst[d] *= qscale;
      }
    }
    // per column: the band's key range (the same for every kv head); all: the keys every
    // column sees (the ranges' intersection)
    Range ck[kDecodeCols];
    Range all{std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()};
    for (int64_t c = 0; c < C; ++c) {
      const int64_t ii = c % p.Sq;
      ck[c] = ii < nq ? vis.band_keys(sq, ii) : Range{0, 0};
      all.lo = std::max(all.lo, ck[c].lo);
      all.hi = std::min(all.hi, ck[c].hi);
    }
    // every column sees every key of [a, e) by the band
    auto band_covers = [&](int64_t a, int64_t e) { return all.lo <= a && e <= all.hi; };
    // blocks of up to w.ks keys (whole 8-key groups) wherever every column sees the whole block
    // (all of the unit but the band's edges: with Sq > 1 the last keys of a causal sequence,
    // with a window its two ends), else blocks of w.nb
    const int64_t nb = w.nb, pc = w.pack_cap;
    const int64_t ks = w.ks;  // row stride of the scores in w.s
    const scalar_t* kseq = k + b * p.k_batch_stride + sq.k0 * p.k_row_stride;
    const scalar_t* vseq = v + b * p.v_batch_stride + sq.k0 * p.v_row_stride;
    // on the tiles: scores of kv heads [h0, h0 + nh) for keys [j0, j0 + n) of the unit into
    // sc (kv head h0's; the next heads' C * ks floats on, rows ks apart)
    auto tile_scores = [&](int64_t h0, int64_t nh, int64_t j0, int64_t n, float* sc) {
      mk::decode_scores_amx(nh, n, p.D,
                            reinterpret_cast<const uint16_t*>(kseq + h0 * p.k_head_stride +
                                                              j0 * p.k_row_stride),
                            p.k_row_stride, p.k_head_stride, w.qp.data() + h0 * qp_head, qp_head,
                            C, qscale, sc, C * w.ks, w.ks);
    };
    // scores of kv head hkv for keys [j0, j0 + n) of the unit into sc (row stride ks): on the
    // tiles or by dp_scores from K where it is (returns true), else false (the caller's
    // scores() call)
    auto dp_block = [&](int64_t hkv, int64_t j0, int64_t n, float* sc) {
      if (tiles) {
        tile_scores(hkv, 1, j0, n, sc);
        return true;
      }
#if ATTN_EXT_HAVE_BF16DP_PATH
      if constexpr (kBf16) {
        if (dp) {
          dp_scores(w.qb.data() + hkv * C * p.D, p.D, C,
                    kseq + hkv * p.k_head_stride + j0 * p.k_row_stride, p.k_row_stride, n, p.D,
                    qscale, sc, w.ks, tile16);
          return true;
        }
      }
#endif
      return false;
    };
    for (int64_t j0 = kbeg, nk = 0; j0 < kend; j0 += nk) {
      // where the blocks may be big, whole 8-key groups every column sees come in blocks of up
      // to ks keys (read in place unless ATTN_EXT_CPU_DECODE_IN_PLACE=0), the last ones of the
      // unit included; the keys past them (fewer than 8), and the keys near the band's edges,
      // come in blocks of nb (packed). (A unit of 8 n + t keys, t < 8, packed its last 8 + t
      // or all of them where that was at most nb: a decode step whose cache length is not a
      // multiple of 8 took 3-7 us longer, RESULTS.md, forty-seventh session.)
      nk = std::min(nb, kend - j0);
      if (big_blocks) {
        const int64_t big = std::min(ks, kend - j0) / 8 * 8;
        if (big >= 8 && band_covers(j0, j0 + big)) nk = big;
      }
      const int64_t nk8 = round_up(nk, 8);
      // which keys take part (padding) and which column sees which key: the same for every
      // kv head, decided once per block
      int64_t n_use = 0;
      for (int64_t r = 0; r < nk; ++r) n_use += (w.use[r] = vis.key_valid(b, j0 + r) ? 1 : 0);
      if (n_use == 0) continue;
      const bool masked = n_use < nk || !band_covers(j0, j0 + nk);
      bool edge = false;  // a key seen by some columns and hidden from others
      if (masked) {
        for (int64_t r = 0; r < nk; ++r) {
          const int64_t j = j0 + r;
          int64_t n_seen = 0;
          for (int64_t c = 0; c < C; ++c) {
            const bool sc = w.use[r] && j >= ck[c].lo && j < ck[c].hi;
            w.seen[c * ks + r] = sc ? 1 : 0;
            n_seen += sc;
          }
          w.use[r] = n_seen > 0 ? 1 : 0;
          edge = edge || (n_seen > 0 && n_seen < C);
        }
      }
      // whole 8-key groups every key of which every column sees: read K and V where they are
      // (no copy); else the block's rows of every kv head are packed, row by row: one pass
      // over a contiguous range of a BSHD cache (k first, then v)
      const bool in_place = kInPlace && !masked && nk % 8 == 0;
      if (!in_place) w.pack_blocks(!k_direct, v_pairs);
      for (int64_t r = 0; r < nk && !in_place && !k_direct; ++r) {  // (else from K in place)
        if (!w.use[r]) continue;
        for (int64_t hkv = h_lo; hkv < h_hi; ++hkv)
          pack_row(kseq + (j0 + r) * p.k_row_stride + hkv * p.k_head_stride, p.D,
                   w.kb.data() + (hkv * pc + r) * Dp);
      }
      for (int64_t r = 0; r < nk && !in_place && !v_pairs; ++r) {
        if (!w.use[r]) continue;
        for (int64_t hkv = h_lo; hkv < h_hi; ++hkv)
          pack_row(vseq + (j0 + r) * p.v_row_stride + hkv * p.v_head_stride, p.Dv,
                   w.vb.data() + (hkv * pc + r) * Dvp);
      }
      // (pv_pairs: V's rows as they are; the rows of keys that take no part, up to whole
      // 8-key groups, zero, so that a non-finite v there meets no probability)
      for (int64_t r = 0; r < nk8 && !in_place && v_pairs; ++r) {
        for (int64_t hkv = h_lo; hkv < h_hi; ++hkv) {
          c10::BFloat16* dst = w.vh.data() + (hkv * pc + r) * Dvp;
          if (r < nk && w.use[r])
            std::memcpy(dst, vseq + (j0 + r) * p.v_row_stride + hkv * p.v_head_stride,
                        p.Dv * sizeof(scalar_t));
          else
            std::fill(dst, dst + Dvp, c10::BFloat16());
        }
      }
      const int64_t s_head = C * ks;  // scores of one kv head in w.s
      if (in_place && tiles) {
        // on the tiles, 32 keys of every kv head at a time (memory order in a BSHD cache)
        tile_scores(h_lo, nh, j0, nk, w.s.data() + h_lo * s_head);
      } else if (in_place) {
        // scores of every kv head first, 8 keys at a time across the heads: in a BSHD cache
        // that reads K in memory order (one pass, hardware prefetch streams in order), each
        // row once per pair of columns (bf16 / fp16 with quads: once per 4 columns)
        const scalar_t* kgrp = kseq + h_lo * p.k_head_stride;  // (the group's heads)
        for (int64_t r0 = 0; r0 < nk8; r0 += 8) {
          for (int64_t hkv = h_lo; hkv < h_hi; ++hkv) {
            const scalar_t* kh = kseq + hkv * p.k_head_stride;
            // (dp: the group after the next; its scores take less time than the widening
            // ones, and one group ahead left the misses exposed: RESULTS.md, seventeenth
            // session)
            prefetch_next_group(kgrp, hkv - h_lo, nh, j0 + r0 + (dp ? 8 : 0), kend,
                                p.k_row_stride, p.k_head_stride, p.D);
            if (dp && j0 == kbeg && r0 == 0)  // (the unit's second group, which none asks for)
              prefetch_next_group(kgrp, hkv - h_lo, nh, j0, kend, p.k_row_stride,
                                  p.k_head_stride, p.D);
            if (dp_block(hkv, j0 + r0, 8, w.s.data() + hkv * s_head + r0)) continue;
            gp.scores(w.qs.data() + hkv * C * Dp, C, Dp, kh + (j0 + r0) * p.k_row_stride,
                      w.s.data() + hkv * s_head + r0, ks, p.k_row_stride);
          }
        }
      }
      for (int64_t hkv = h_lo; hkv < h_hi; ++hkv) {
        float* sh = w.s.data() + hkv * s_head;
        float* part = part_of(b, chunk, hkv);
        float *o = part, *m = part + C * Dvp, *l = m + C;
        float* kbh = in_place || k_direct ? nullptr : w.kb.data() + hkv * pc * Dp;
        const float* vbh = in_place || v_pairs ? nullptr : w.vb.data() + hkv * pc * Dvp;
        if (!in_place && !dp_block(hkv, j0, nk, sh)) {
          // (dp_block: every row's score from K where it is; hidden and padding rows are
          // masked below, so a non-finite k there never counts)
          for (int64_t r = 0; r < nk8; ++r) {  // hidden and padding rows: zero (finite scores)
            if (r < nk && w.use[r]) continue;
            std::fill(kbh + r * Dp, kbh + (r + 1) * Dp, 0.f);
          }
          scores(w.qs.data() + hkv * C * Dp, C, Dp, static_cast<const float*>(kbh), nk8, sh,
                 ks, -1, false, wide_scores);
        }
        if (terms.active()) {
          // softcap, ALiBi, rel_bias by the one rule, in this layout (apply_score_terms_keys:
          // the bits of apply_score_terms, which the backward applies to the same scores):
          // column hh * Sq + ii = head hkv * group + hh, row ii of the sequence, key j0 + r at
          // d = ii + off - (j0 + r)
          apply_score_terms_keys(terms, sh, ks, nk, p.Sq, group, b, hkv * group, sq.off - j0);
        }
        if (masked) {
          for (int64_t c = 0; c < C; ++c)
            for (int64_t r = 0; r < nk; ++r)
              if (!w.seen[c * ks + r]) sh[c * ks + r] = neg_inf;
        }
        block_softmax(sh, ks, C, nk, m, l, o, Dvp);
        // Hidden (c, r) have p = 0 exactly; a non-finite v there would give 0 * inf. Such keys
        // (only at the band's edges) go through the scalar path, which skips hidden pairs.
        if (in_place) continue;  // PV of every head below, in memory order
#if ATTN_EXT_HAVE_BF16DP_PATH
        if constexpr (kBf16) {
          if (v_pairs) {
            const c10::BFloat16* vhh = w.vh.data() + hkv * pc * Dvp;
            if (!edge) {
              pv_pairs(sh, ks, C, vhh, Dvp, nk8, o, Dvp);
            } else {  // p rounded as pv_pairs rounds it; hidden pairs skipped
              pv_pairs_edge(sh, ks, C, vhh, Dvp, w.seen.data(), ks, nk, o);
            }
            continue;
          }
        }
#endif
        if (!edge) {
          pv(sh, ks, C, vbh, Dvp, w.use.data(), nk, o, -1, wide);
        } else {
          for (int64_t c = 0; c < C; ++c) {
            float* oc = o + c * Dvp;
            for (int64_t r = 0; r < nk; ++r) {
              if (!w.seen[c * ks + r]) continue;
              const float pr = sh[c * ks + r];
              const float* vr = vbh + r * Dvp;
              for (int64_t d = 0; d < Dvp; ++d) oc[d] += pr * vr[d];
            }
          }
        }
      }
      if (in_place) {
        // PV of every kv head, 8 keys at a time across the heads (V in memory order, as the
        // scores read K); o of (c, d) takes the keys in the same order as one pass would
        const scalar_t* vgrp = vseq + h_lo * p.v_head_stride;  // (the group's heads)
        for (int64_t r0 = 0; r0 < nk8; r0 += 8) {
          for (int64_t hkv = h_lo; hkv < h_hi; ++hkv) {
            const scalar_t* vh = vseq + hkv * p.v_head_stride;
            prefetch_next_group(vgrp, hkv - h_lo, nh, j0 + r0, kend, p.v_row_stride,
                                p.v_head_stride, p.Dv);
            gp.pv(w.s.data() + hkv * s_head + r0, ks, C, vh + (j0 + r0) * p.v_row_stride, Dvp,
                  w.use.data() + r0, part_of(b, chunk, hkv), p.v_row_stride);
          }
        }
      }
    }
  };

  // merge the chunks of each (b, kv head) column, in chunk order (deterministic); scratch:
  // 2 * Dvp floats (the merged o, then its row in natural order)
  auto* out = static_cast<scalar_t*>(p.out);
  auto* lse = static_cast<float*>(p.lse);
  auto merge_head = [&](int64_t b, int64_t hkv, float* scratch) {
    const SeqInfo sq = vis.seq(b);
    float* acc = scratch;
    float* row = scratch + Dvp;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t hh = c / p.Sq, ii = c % p.Sq;
      if (ii >= sq.Sq) continue;
      const int64_t h = hkv * group + hh;
      float l;
      const float mx = merge_chunks<float>(n_chunks, [&](int64_t ch) {
        const float* part = part_of(b, ch, hkv);
        return ChunkState<float>{part[C * Dvp + c], part[C * Dvp + C + c], part + c * Dvp};
      }, Dvp, p.Dv, acc, &l);
      // l == 0: the row sees no key (out 0, lse -inf); NaN stays NaN.
      const bool seen = l != 0.f || std::isnan(mx);
      float inv = seen ? 1.f / l : 0.f;
      double lse_c = seen ? static_cast<double>(mx) + std::log(static_cast<double>(l))
                          : -std::numeric_limits<double>::infinity();
      if (p.terms.has_sinks()) {  // exp(sinks[h]) joins the denominator (as write_tile)
        inv = static_cast<float>(p.terms.sink_normalise<float>(
            h, static_cast<double>(mx) * kLog2e, static_cast<double>(l), seen, &lse_c));
      }
      scalar_t* orow = out + b * p.out_batch_stride + (sq.q0 + ii) * p.out_row_stride + h * p.out_head_stride;
      from_decode_order<scalar_t>(acc, p.Dv, row);
      store_row(row, inv, p.Dv, orow);  // (static_cast<scalar_t>(row[d] * inv), vectorised)
      lse[b * p.lse_batch_stride + h * p.lse_head_stride + sq.q0 + ii] = static_cast<float>(lse_c);
    }
  };

  // One chunk per sequence (short keys: fewer than 2 * kDecodeMinChunk, or B >= 4 x the
  // threads): a unit merges its own heads (the same merge_chunks call, so the same bits), and
  // the call runs one parallel region instead of two (a small decode step's fork and join:
  // RESULTS.md, fortieth session). Else the merge waits for every chunk.
  parallel_tasks(p.B * n_chunks * n_hg,
                 [&] { return DecodeScratch(Hkv, C, p.D, p.Dv, big_blocks, big_blocks && !kInPlace); },
                 [&](int64_t task, DecodeScratch& w) {
    unit(task, w);
    if (n_chunks == 1) {  // (task = b * n_hg + hg)
      const int64_t h_lo = task % n_hg * heads_per, h_hi = std::min(Hkv, h_lo + heads_per);
      for (int64_t hkv = h_lo; hkv < h_hi; ++hkv) merge_head(task / n_hg, hkv, w.merge.data());
    }
  });
  if (n_chunks == 1) return;
  parallel_tasks(p.B * Hkv, [&] { return std::vector<float>(static_cast<size_t>(2 * Dvp)); },
                 [&](int64_t bh, std::vector<float>& scratch) {
    merge_head(bh / Hkv, bh % Hkv, scratch.data());
  });
}

#else
template <typename scalar_t>
void attention_decode_kernel(const AttentionParams&) {}
#endif  // ATTN_EXT_HAVE_AVX2_PATH

}  // namespace cpu_attn
}  // namespace attn_ext
