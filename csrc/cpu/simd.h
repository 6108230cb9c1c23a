// Small x86 SIMD layer for the CPU kernels.
//
// at::vec::Vectorized picks its instruction set from CPU_CAPABILITY macros that ATen's own
// build defines per compiled copy; an extension gets none of them and would fall back to the
// scalar "DEFAULT" path. So the hot loops that matter are written twice: an AVX2+FMA+F16C
// version in functions marked ATTN_EXT_AVX2 (compiled for that ISA whatever the global
// -march), and a portable scalar loop. use_avx2() chooses at run time.
//
// Avx2IO<T>: load 8 elements of T as 8 floats / store 8 floats as T (round to nearest even),
// for T = float, c10::Half (F16C), c10::BFloat16 (integer shifts).
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cstdlib>
#include <cstring>
#include <limits>

#include "cpu/cpu_features.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_EXT_HAVE_AVX2_PATH 1
#include <immintrin.h>
#define ATTN_EXT_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX-512F + BW (+ the AVX2 set): only in functions called where cpu::avx512_enabled().
#define ATTN_EXT_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
#else
#define ATTN_EXT_HAVE_AVX2_PATH 0
#endif
// ... + AVX512_BF16 and VL: only in functions called where cpu::avx512bf16_enabled(). Compilers
// before GCC 10 / clang 9 have no AVX512_BF16: the bf16 decode scores then widen (the same
// results as ATTN_EXT_CPU_BF16DP=0).
#if ATTN_EXT_HAVE_AVX2_PATH && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10))
#define ATTN_EXT_HAVE_BF16DP_PATH 1
#define ATTN_EXT_AVX512BF16_TARGETS "avx512bf16,avx512vl,avx512f,avx512bw,avx2,fma,f16c"
#define ATTN_EXT_AVX512BF16 __attribute__((target(ATTN_EXT_AVX512BF16_TARGETS)))
#else
#define ATTN_EXT_HAVE_BF16DP_PATH 0
#endif
// ... + AMX tiles (AMX-TILE, AMX-BF16; attention_amx.cpp), written as inline asm: assemblers of
// GCC 11 / clang 12 and later know them; Linux only (the state is requested by arch_prctl).
// Their functions also take AVX512DQ (vreduceps in the tile path's exp2; amx_enabled asks).
#if ATTN_EXT_HAVE_BF16DP_PATH && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define ATTN_EXT_HAVE_AMX_PATH 1
#define ATTN_EXT_AMX __attribute__((target(ATTN_EXT_AVX512BF16_TARGETS ",avx512dq")))
#else
#define ATTN_EXT_HAVE_AMX_PATH 0
#endif

namespace attn_ext::cpu {

// True when the CPU has AVX2, FMA and F16C, unless ATTN_EXT_CPU_SIMD=0 (for measuring the
// portable path): the one detector shared with the attention micro-kernels.
inline bool use_avx2() {
#if ATTN_EXT_HAVE_AVX2_PATH
  return simd_enabled();
#else
  return false;
#endif
}


#if ATTN_EXT_HAVE_AVX2_PATH

template <typename T>
struct Avx2IO;

template <>
struct Avx2IO<float> {
  ATTN_EXT_AVX2 static inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  ATTN_EXT_AVX2 static inline void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
  // Non-temporal store (p 32-byte aligned): bypasses the cache, no read-for-ownership.
};

template <>
struct Avx2IO<c10::Half> {
  ATTN_EXT_AVX2 static inline __m256 load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  ATTN_EXT_AVX2 static inline void store(c10::Half* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

template <>
struct Avx2IO<c10::BFloat16> {
  // bf16 is the top half of an fp32: widen by a 16-bit shift.
  ATTN_EXT_AVX2 static inline __m256 load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // Round to nearest even like c10::BFloat16(float): add 0x7fff + lsb, keep the top 16 bits;
  // NaN becomes the quiet NaN 0x7fc0.
  ATTN_EXT_AVX2 static inline void store(c10::BFloat16* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), round(v));
  }
  // 16 floats -> 16 bf16 with one pack and one 32-byte store.
  ATTN_EXT_AVX2 static inline void store16(c10::BFloat16* p, __m256 lo, __m256 hi) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round32(lo), round32(hi)), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  }
  ATTN_EXT_AVX2 static inline __m128i round(__m256 v) {
    const __m256i r = round32(v);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    return _mm256_castsi256_si128(packed);
  }
  // Rounded bf16 bits in the low half of each 32-bit lane.
  ATTN_EXT_AVX2 static inline __m256i round32(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    // (u32 < 2^16 each; callers pack 8 or 16 of them to u16 within 128-bit lanes and
    // gather the lanes with one permute.)
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  }
};

// 2^x for x <= 0 (any x works up to 127): x = n + f, n = round(x), |f| <= 1/2; 2^f by a
// degree-6 polynomial, 2^n through the exponent bits. The polynomial is a minimax fit of 2^f
// on [-1/2, 1/2] in relative error, with p(0) = 1 exactly (so the key of a row's maximum gets
// exactly 1): 2.0e-9 in exact arithmetic, under 1 ulp in fp32 (checked against exp2 in
// double on 3.2e7 points of [-126, 127]: 0.95 ulp at most; the degree-7 Taylor polynomial it
// replaced was 0.87 ulp with one more FMA; tools/exp2_check.cpp). x is clamped to [-127, 127]
// first: n = -127 gives the exponent field 0, i.e. exactly 0 for x < -126.5 (-inf included)
// with no compare and mask, and denormal values on [-126.5, -126) (round to even: n(-126.5)
// = -126); NaN stays NaN.
// (The attention micro-kernels' softmax and the decode kernel share it.)
// The polynomial's coefficients, highest degree first (Horner by FMAs).
inline constexpr float kExp2Poly[7] = {1.5353361011531303e-04f, 1.3398875247965431e-03f,
                                       9.618437368018143e-03f,  5.5503324687813015e-02f,
                                       2.4022647913463155e-01f, 6.931472028563572e-01f,
                                       1.0f};
ATTN_EXT_AVX2 inline __m256 exp2_ps(__m256 x) {
  // (max/min return their second operand for NaN: x goes second so NaN stays NaN.)
  x = _mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), x));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 6
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// exp2_ps on 16 lanes (AVX-512F), with exp2_ps's bits for every input (all 2^32 checked, with
// and without FTZ / DAZ; RESULTS.md, twenty-fifth session). The same clamp at 127, rounding and
// polynomial; the power of two is applied by vscalefps instead of exponent bits and a multiply
// (n in [-126, 127] is a normal 2^n, and both round p * 2^n once), and the lower clamp becomes
// a zero mask: exp2_ps gives 0 exactly where its clamped x rounds to n = -127, i.e. x < -126.5
// (-inf included); NaN is not below it and stays NaN. 11 operations against 14. Only in
// functions called where cpu::avx512_enabled().
// exp2_ps512_n: N vectors in place, each step for all N before the next (the same operations on
// each, so the same bits): N short dependent chains side by side in program order, for loops
// whose own steps would leave the scheduler waiting on one chain (the softmax: N = 4).
// (The clamp stays even where x = s - max: a NaN score can make the column's max chain drop a
// larger score before it, so x may exceed 127 there.)
template <int N>
ATTN_EXT_AVX512 inline void exp2_ps512_n(__m512 (&x)[N]) {
  __m512 n[N], f[N], p[N];
  __mmask16 live[N];
  for (int i = 0; i < N; ++i) x[i] = _mm512_min_ps(_mm512_set1_ps(127.0f), x[i]);  // (NaN: x)
  for (int i = 0; i < N; ++i) live[i] = _mm512_cmp_ps_mask(x[i], _mm512_set1_ps(-126.5f), _CMP_NLT_UQ);
  for (int i = 0; i < N; ++i)
    n[i] = _mm512_roundscale_ps(x[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  for (int i = 0; i < N; ++i) f[i] = _mm512_sub_ps(x[i], n[i]);
  for (int i = 0; i < N; ++i) p[i] = _mm512_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 6
  for (int j = 1; j < 7; ++j) {
    for (int i = 0; i < N; ++i) p[i] = _mm512_fmadd_ps(p[i], f[i], _mm512_set1_ps(kExp2Poly[j]));
  }
  for (int i = 0; i < N; ++i) x[i] = _mm512_maskz_scalef_ps(live[i], p[i], n[i]);
}

ATTN_EXT_AVX512 inline __m512 exp2_ps512(__m512 x) {
  __m512 v[1] = {x};
  exp2_ps512_n<1>(v);
  return v[0];
}

// r[i] word j -> r[j] word i (16 x 16 32-bit words): pairs of rows unpacked by 32 then 64 bits
// (u[4 b + e] holds column 4 L + e of rows 4 b .. 4 b + 3 in its 128-bit lane L), then the lanes
// gathered by two rounds of 128-bit shuffles: 64 instructions. The pair packs of the tile kernels
// (mk::pack_vt_pairs, mk::pack_bf16_pairs). Only where cpu::avx512_enabled().
ATTN_EXT_AVX512 inline void transpose_16x16_epi32(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int a = 0; a < 8; ++a) {
    t[2 * a] = _mm512_unpacklo_epi32(r[2 * a], r[2 * a + 1]);
    t[2 * a + 1] = _mm512_unpackhi_epi32(r[2 * a], r[2 * a + 1]);
  }
  for (int b = 0; b < 4; ++b) {
    u[4 * b + 0] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
    u[4 * b + 3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i p01 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44);
    const __m512i p23 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xee);
    const __m512i q01 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i q23 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xee);
    r[e] = _mm512_shuffle_i32x4(p01, q01, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(p01, q01, 0xdd);
    r[8 + e] = _mm512_shuffle_i32x4(p23, q23, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(p23, q23, 0xdd);
  }
}

// max(init, x[0], x[ld], ..., x[(rows - 1) ld]) lane by lane (a column-wise softmax step's
// running max) for NV 16-column groups at once (the last group's lanes: k_last), init from
// init[16 v ..], results to out[16 v ..]. Per lane: even rows in one chain from init, odd rows
// in one from -inf, joined at the end (max is exact, so the order changes no bit for numbers;
// NaN follows max's operand order, the same in every caller). The NV groups' loads of a row are
// adjacent and their 2 NV chains independent (one group at a time was load-latency bound: ~20 %
// of a softmax step; RESULTS.md, twenty-sixth session). Only where cpu::avx512_enabled().
template <int NV>
ATTN_EXT_AVX512 inline void column_max_group_ps512(const float* x, int64_t ld, int64_t rows,
                                                   __mmask16 k_last, const float* init,
                                                   float* out) {
  auto lanes = [&](int v) ATTN_EXT_AVX512 { return v + 1 == NV ? k_last : __mmask16(0xffff); };
  __m512 mx0[NV], mx1[NV];
  for (int v = 0; v < NV; ++v) {
    mx0[v] = _mm512_maskz_loadu_ps(lanes(v), init + 16 * v);
    mx1[v] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  }
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    for (int v = 0; v < NV; ++v) {
      mx0[v] = _mm512_max_ps(mx0[v], _mm512_maskz_loadu_ps(lanes(v), x + r * ld + 16 * v));
      mx1[v] = _mm512_max_ps(mx1[v], _mm512_maskz_loadu_ps(lanes(v), x + (r + 1) * ld + 16 * v));
    }
  }
  if (r < rows) {
    for (int v = 0; v < NV; ++v)
      mx0[v] = _mm512_max_ps(mx0[v], _mm512_maskz_loadu_ps(lanes(v), x + r * ld + 16 * v));
  }
  for (int v = 0; v < NV; ++v)
    _mm512_mask_storeu_ps(out + 16 * v, lanes(v), _mm512_max_ps(mx0[v], mx1[v]));
}

// column_max_group_ps512 of columns [0, cols) (cols <= 96) into out[0 .. cols).
ATTN_EXT_AVX512 inline void column_max_all_ps512(const float* x, int64_t ld, int64_t rows,
                                                 int64_t cols, const float* init, float* out) {
  const int nv = static_cast<int>((cols + 15) / 16);
  const int64_t rest = cols - 16 * (nv - 1);
  const __mmask16 k = static_cast<__mmask16>(rest >= 16 ? 0xffff : (1u << rest) - 1);
  switch (nv) {
    case 6: column_max_group_ps512<6>(x, ld, rows, k, init, out); break;
    case 5: column_max_group_ps512<5>(x, ld, rows, k, init, out); break;
    case 4: column_max_group_ps512<4>(x, ld, rows, k, init, out); break;
    case 3: column_max_group_ps512<3>(x, ld, rows, k, init, out); break;
    case 2: column_max_group_ps512<2>(x, ld, rows, k, init, out); break;
    case 1: column_max_group_ps512<1>(x, ld, rows, k, init, out); break;
    default: break;
  }
}

// tanh(x), 8 lanes: x P(x^2) for |x| < 0.625 (P of degree 6, a minimax fit of tanh(x) / x in
// relative error on [0, 0.625]: 1.4e-10 in exact arithmetic), else sign(x) (1 - 2 / (e^{2|x|}
// + 1)) with e^{2|x|} from exp2_ps (clamped there at 2^127: +-inf give +-1). Under 2 ulp in
// fp32 (1.3 ulp for each branch in a float emulation; the ops' softcap test measures it
// through lse: test_score_terms.py). NaN stays NaN.
ATTN_EXT_AVX2 inline __m256 tanh_ps(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_andnot_ps(sign, x);
  // small: x P(x^2)
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(2.1285085782e-03f);
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-8.1591151524e-03f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.1691822031e-02f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.3944698011e-02f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.3333182793e-01f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.3333329698e-01f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(x, z), p, x);  // x + x^3 (P(z) - 1) / z
  // large: 1 - 2 / (e^{2a} + 1), the sign of x put back
  const __m256 e = exp2_ps(_mm256_mul_ps(a, _mm256_set1_ps(2.8853900817779268f)));  // 2 log2(e)
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  const __m256 big_signed = _mm256_or_ps(big, _mm256_and_ps(sign, x));
  // (a < 0.625 is false for NaN: the large branch, NaN through exp2_ps)
  return _mm256_blendv_ps(big_signed, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
}

#endif  // ATTN_EXT_HAVE_AVX2_PATH

}  // namespace attn_ext::cpu
