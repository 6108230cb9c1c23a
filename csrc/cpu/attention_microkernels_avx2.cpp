// AVX2 / FMA / F16C micro-kernels of the CPU attention (interface and semantics in
// attention_microkernels.h). Every function here is compiled for that target through
// __attribute__((target)) and is only called after cpu_has_avx2_fma() said yes, so the
// library still loads and runs (on the generic kernels) on older x86-64 CPUs.
//
// This file includes no ATen header on purpose: nothing inline from a shared header may be
// compiled for AVX2 here and then picked by the linker for the generic code paths.
#include "cpu/attention_microkernels.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include "cpu/cpu_features.h"
#include "cpu/simd.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ATTN_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ATTN_HAVE_X86 1
#endif

namespace attn_ext {
namespace mk {

#ifdef ATTN_HAVE_X86

bool cpu_has_avx2_fma() { return cpu::simd_enabled(); }  // honours ATTN_EXT_CPU_SIMD=0

namespace {

using cpu::exp2_ps;  // csrc/cpu/simd.h

// Register-blocked tile C (MR, 8 * NV) of gemm_avx2: MR * NV accumulators stay in ymm
// registers across the whole K loop (6 x 16 = 12 accumulators + 2 B vectors + 1 broadcast
// fills the 16 registers). A is read by scalar broadcasts, so its strides are free.
// The K loop runs in the chains of gemm_chain_length (attention_microkernels.h): each chain
// starts from zero and is added to C after (one load / add / store of the tile per chain).

// One step t of a register tile: acc[r][v] += A(r, t) * B(t, 8 v .. 8 v + 7), where a points
// at A(0, t) and A(r, t) = a[r * a_row] (broadcast), b at B's row t. Shared by gemm_tile and
// gemm_at_tile (a_row = 1 there: the six broadcasts at fixed offsets from one pointer).
template <int MR, int NV>
ATTN_AVX2 inline void tile_step(const float* a, int64_t a_row, const float* b,
                                __m256 (&acc)[MR][NV]) {
  __m256 bv[NV];
#pragma GCC unroll 2
  for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(b + 8 * v);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m256 ar = _mm256_broadcast_ss(a + r * a_row);
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(ar, bv[v], acc[r][v]);
  }
}

template <int MR, int NV>
ATTN_AVX2 inline void gemm_tile(int64_t K, const float* A, int64_t a_row, int64_t a_col,
                                const float* B, int64_t ldb, float* C, int64_t ldc,
                                bool accumulate) {
  // Chains of gemm_chain_length: K <= kGemmKSplit (the key-tile products, D <= 96) is one
  // chain, longer K (the score products at D = 128, 256) blocks of kGemmKBlock. Every chain
  // starts from zero; the first chain of a non-accumulating call writes C, every other one
  // is added to it.
  if (K <= 0 && accumulate) return;
  const int64_t kb = gemm_chain_length(K);
  for (int64_t t0 = 0; t0 < K || t0 == 0; t0 += kb) {
    const int64_t t1 = std::min(K, t0 + kb);
    const bool add = accumulate || t0 > 0;
    __m256 acc[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
    }
    for (int64_t t = t0; t < t1; ++t) tile_step<MR, NV>(A + t * a_col, a_row, B + t * ldb, acc);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) {
        float* c = C + r * ldc + 8 * v;
        _mm256_storeu_ps(c, add ? _mm256_add_ps(_mm256_loadu_ps(c), acc[r][v]) : acc[r][v]);
      }
    }
  }
}

template <int NV>
ATTN_AVX2 inline void gemm_cols(int64_t M, int64_t K, const float* A, int64_t a_row,
                                int64_t a_col, const float* B, int64_t ldb, float* C,
                                int64_t ldc, bool accumulate) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) {
    gemm_tile<6, NV>(K, A + m * a_row, a_row, a_col, B, ldb, C + m * ldc, ldc, accumulate);
  }
  const float* a = A + m * a_row;
  float* c = C + m * ldc;
  switch (M - m) {
    case 5: gemm_tile<5, NV>(K, a, a_row, a_col, B, ldb, c, ldc, accumulate); break;
    case 4: gemm_tile<4, NV>(K, a, a_row, a_col, B, ldb, c, ldc, accumulate); break;
    case 3: gemm_tile<3, NV>(K, a, a_row, a_col, B, ldb, c, ldc, accumulate); break;
    case 2: gemm_tile<2, NV>(K, a, a_row, a_col, B, ldb, c, ldc, accumulate); break;
    case 1: gemm_tile<1, NV>(K, a, a_row, a_col, B, ldb, c, ldc, accumulate); break;
    default: break;
  }
}

// Tile of gemm_at_avx2 (the forward's pass 3): gemm_tile's one-chain path for A = a transposed
// view with a_row == 1 known at compile time, so the MR broadcasts of step t read
// A[t * a_col + 0 .. MR - 1] at fixed offsets from one pointer (no per-row address arithmetic in
// the K loop). The chain starts from zero, as gemm_tile's; then C's rows are scaled by
// scale[r] (when scale != nullptr: the online softmax's rescale of o, one multiply, the
// rounding of a separate `o *= alpha` pass) and the chain is added.
template <int MR, int NV>
ATTN_AVX2 inline void gemm_at_tile(int64_t K, const float* A, int64_t a_col, const float* B,
                                   int64_t ldb, float* C, int64_t ldc, const float* scale) {
  __m256 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  for (int64_t t = 0; t < K; ++t) tile_step<MR, NV>(A + t * a_col, 1, B + t * ldb, acc);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m256 sr = scale != nullptr ? _mm256_broadcast_ss(scale + r) : _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      float* cp = C + r * ldc + 8 * v;
      __m256 c = _mm256_loadu_ps(cp);
      if (scale != nullptr) {
        c = _mm256_mul_ps(c, sr);
        // the product rounded on its own, as the separate rescale pass stores it: an empty
        // asm hides it from the compiler, which would otherwise contract the multiply and
        // the add below into one FMA (GCC's default -ffp-contract=fast does so for
        // intrinsics too)
        asm("" : "+x"(c));
      }
      _mm256_storeu_ps(cp, K > 0 ? _mm256_add_ps(c, acc[r][v]) : c);
    }
  }
}

template <int NV>
ATTN_AVX2 inline void gemm_at_cols(int64_t M, int64_t K, const float* A, int64_t a_col,
                                   const float* B, int64_t ldb, float* C, int64_t ldc,
                                   const float* scale) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) {
    gemm_at_tile<6, NV>(K, A + m, a_col, B, ldb, C + m * ldc, ldc,
                        scale != nullptr ? scale + m : nullptr);
  }
  const float* a = A + m;
  float* c = C + m * ldc;
  const float* sc = scale != nullptr ? scale + m : nullptr;
  switch (M - m) {
    case 5: gemm_at_tile<5, NV>(K, a, a_col, B, ldb, c, ldc, sc); break;
    case 4: gemm_at_tile<4, NV>(K, a, a_col, B, ldb, c, ldc, sc); break;
    case 3: gemm_at_tile<3, NV>(K, a, a_col, B, ldb, c, ldc, sc); break;
    case 2: gemm_at_tile<2, NV>(K, a, a_col, B, ldb, c, ldc, sc); break;
    case 1: gemm_at_tile<1, NV>(K, a, a_col, B, ldb, c, ldc, sc); break;
    default: break;
  }
}

}  // namespace

ATTN_AVX2 void gemm_avx2(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row,
                         int64_t a_col, const float* B, int64_t ldb, float* C, int64_t ldc,
                         bool accumulate) {
  // Column panels of 16 outside: the B panel (K, 16) stays in L1 while A streams by.
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) gemm_cols<2>(M, K, A, a_row, a_col, B + n, ldb, C + n, ldc, accumulate);
  if (n < N) gemm_cols<1>(M, K, A, a_row, a_col, B + n, ldb, C + n, ldc, accumulate);
}

// The forward's pass 3 with the online softmax's rescale of o fused in: semantics in
// attention_microkernels.h. Measured (RESULTS.md, seventh session; one-thread probe, 64-byte
// aligned operands): the forward's pass 3 (M = 96 columns, N = 128, K = 96 keys) 113 against
// 111 GFLOP/s for gemm_avx2 after a separate rescale pass; the tile pair with the softmax
// +1-4 %. B rows that are not all 64-byte aligned (a v view at an odd offset) are copied panel
// by panel into an aligned buffer first: a 16-float row across two cache lines costs the
// gemm about 10 % of its rate. The sums are the same either way.
ATTN_AVX2 void gemm_at_avx2(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_col,
                            const float* B, int64_t ldb, float* C, int64_t ldc,
                            const float* scale) {
  if (K > kGemmKSplit) {  // blocked chains: the rescale first, then gemm_avx2 (its bits)
    if (scale != nullptr) {
      for (int64_t m = 0; m < M; ++m) {
        const __m256 sm = _mm256_broadcast_ss(scale + m);
        for (int64_t n = 0; n < N; n += 8)
          _mm256_storeu_ps(C + m * ldc + n, _mm256_mul_ps(_mm256_loadu_ps(C + m * ldc + n), sm));
      }
    }
    gemm_avx2(M, N, K, A, 1, a_col, B, ldb, C, ldc, true);
    return;
  }
  const bool pack = (reinterpret_cast<uintptr_t>(B) | static_cast<uintptr_t>(ldb * 4)) % 64 != 0;
  alignas(64) float panel[kGemmKSplit * 16];
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) {
    if (pack) {
      for (int64_t t = 0; t < K; ++t) {
        _mm256_store_ps(panel + 16 * t, _mm256_loadu_ps(B + t * ldb + n));
        _mm256_store_ps(panel + 16 * t + 8, _mm256_loadu_ps(B + t * ldb + n + 8));
      }
      gemm_at_cols<2>(M, K, A, a_col, panel, 16, C + n, ldc, scale);
    } else {
      gemm_at_cols<2>(M, K, A, a_col, B + n, ldb, C + n, ldc, scale);
    }
  }
  if (n < N) gemm_at_cols<1>(M, K, A, a_col, B + n, ldb, C + n, ldc, scale);
}

// 8 rows x 8 columns of src transposed in registers per block (unpack pairs, then 64-bit
// shuffles, then 128-bit lane swaps); the edges by the generic version.
ATTN_AVX2 void transpose_rows_avx2(const float* src, int64_t lds, int64_t rows, int64_t cols,
                                   float scale, bool scaled, float* dst, int64_t ldd) {
  const __m256 sv = _mm256_set1_ps(scale);
  int64_t c = 0;
  for (; c + 8 <= rows; c += 8) {
    const float* s0 = src + c * lds;
    int64_t d = 0;
    for (; d + 8 <= cols; d += 8) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s0 + i * lds + d);
      // t: pairs of rows interleaved; u: 4-element groups; then the 128-bit halves
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
      __m256 o[8];
      o[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
      o[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
      o[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
      o[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
      o[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
      o[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
      o[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
      o[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        _mm256_storeu_ps(dst + (d + i) * ldd + c, scaled ? _mm256_mul_ps(o[i], sv) : o[i]);
    }
    transpose_rows_generic<float>(s0 + d, lds, 8, cols - d, scale, scaled, dst + d * ldd + c, ldd);
  }
  transpose_rows_generic<float>(src + c * lds, lds, rows - c, cols, scale, scaled, dst + c, ldd);
}

ATTN_AVX2 void softmax_avx2(float* st, int64_t rows, int64_t cols, float* m, float* l,
                            float* alpha) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 log2e = _mm256_set1_ps(1.4426950408889634f);
  for (int64_t c = 0; c < cols; c += 8) {
    // pass 1: running max of the 8 columns
    const __m256 m_old = _mm256_loadu_ps(m + c);
    __m256 mx0 = m_old, mx1 = neg_inf;
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
      mx0 = _mm256_max_ps(mx0, _mm256_loadu_ps(st + r * cols + c));
      mx1 = _mm256_max_ps(mx1, _mm256_loadu_ps(st + (r + 1) * cols + c));
    }
    if (r < rows) mx0 = _mm256_max_ps(mx0, _mm256_loadu_ps(st + r * cols + c));
    const __m256 mx = _mm256_max_ps(mx0, mx1);
    const __m256 mu = _mm256_andnot_ps(_mm256_cmp_ps(mx, neg_inf, _CMP_EQ_OQ), mx);
    const __m256 a = exp2_ps(_mm256_mul_ps(_mm256_sub_ps(m_old, mu), log2e));
    // pass 2: probabilities in place and their column sums
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    r = 0;
    for (; r + 2 <= rows; r += 2) {
      float* p0 = st + r * cols + c;
      float* p1 = p0 + cols;
      const __m256 e0 = exp2_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(p0), mu), log2e));
      const __m256 e1 = exp2_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(p1), mu), log2e));
      _mm256_storeu_ps(p0, e0);
      _mm256_storeu_ps(p1, e1);
      s0 = _mm256_add_ps(s0, e0);
      s1 = _mm256_add_ps(s1, e1);
    }
    if (r < rows) {
      float* p0 = st + r * cols + c;
      const __m256 e0 = exp2_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(p0), mu), log2e));
      _mm256_storeu_ps(p0, e0);
      s0 = _mm256_add_ps(s0, e0);
    }
    const __m256 sum = _mm256_add_ps(s0, s1);
    _mm256_storeu_ps(alpha + c, a);
    _mm256_storeu_ps(l + c, _mm256_fmadd_ps(_mm256_loadu_ps(l + c), a, sum));
    _mm256_storeu_ps(m + c, mx);
  }
}

ATTN_AVX2 void exp_sub_avx2(float* st, int64_t rows, int64_t cols, const float* sub) {
  const __m256 log2e = _mm256_set1_ps(1.4426950408889634f);
  for (int64_t r = 0; r < rows; ++r) {
    float* s = st + r * cols;
    for (int64_t c = 0; c < cols; c += 8) {
      const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + c), _mm256_loadu_ps(sub + c));
      _mm256_storeu_ps(s + c, exp2_ps(_mm256_mul_ps(x, log2e)));
    }
  }
}

ATTN_AVX2 void ds_avx2(const float* p, float* ds, int64_t rows, int64_t cols, const float* d) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* pr = p + r * cols;
    float* dr = ds + r * cols;
    for (int64_t c = 0; c < cols; c += 8) {
      const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(dr + c), _mm256_loadu_ps(d + c));
      _mm256_storeu_ps(dr + c, _mm256_mul_ps(_mm256_loadu_ps(pr + c), x));
    }
  }
}

// bias_rows_generic's rule (attention_microkernels.h), 8 columns at a time: ALiBi as one
// fused x - slope * |d| (the scalar tail uses std::fma, the same single rounding, so a pair
// gets the same bits whichever lane or tail it falls in), rel_bias as plain adds of the
// table's slice.
ATTN_AVX2 void bias_rows_avx2(float* st, int64_t rows, int64_t n, int64_t ld, int64_t d0,
                              float slope, const float* tab, int64_t M) {
  const int64_t dmax = std::max<int64_t>(std::abs(d0) + rows + n, 0);
  const bool int32_ok = dmax < (int64_t(1) << 30);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 vs = _mm256_set1_ps(slope);
  for (int64_t r = 0; r < rows; ++r) {
    float* x = st + r * ld;
    const int64_t dr = d0 - r;
    if (slope != 0.f) {
      int64_t c = 0;
      if (int32_ok) {
        for (; c + 8 <= n; c += 8) {
          const __m256i d = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(dr + c)), iota);
          const __m256 ad = _mm256_cvtepi32_ps(_mm256_abs_epi32(d));
          _mm256_storeu_ps(x + c, _mm256_fnmadd_ps(vs, ad, _mm256_loadu_ps(x + c)));
        }
      }
      for (; c < n; ++c) {
        const int64_t d = dr + c;
        x[c] = std::fma(-slope, static_cast<float>(d < 0 ? -d : d), x[c]);
      }
    }
    if (tab != nullptr) {
      // columns [0, ca): d < -M; [ca, cb): the slice tab[M + dr + c]; [cb, n): d > M
      const int64_t ca = std::clamp<int64_t>(-M - dr, 0, n);
      const int64_t cb = std::clamp<int64_t>(M - dr + 1, ca, n);
      const float lo = tab[0], hi = tab[2 * M];
      int64_t c = 0;
      for (; c + 8 <= ca; c += 8) _mm256_storeu_ps(x + c, _mm256_add_ps(_mm256_loadu_ps(x + c), _mm256_set1_ps(lo)));
      for (; c < ca; ++c) x[c] += lo;
      // column c reads tab[M + dr + c] (an index into the table for c in [ca, cb): no pointer
      // is formed outside it, dr being up to 2^60 for a block far from the keys)
      for (; c + 8 <= cb; c += 8) {
        const __m256 tv = _mm256_loadu_ps(tab + (M + dr + c));
        _mm256_storeu_ps(x + c, _mm256_add_ps(_mm256_loadu_ps(x + c), tv));
      }
      for (; c < cb; ++c) x[c] += tab[M + dr + c];
      for (; c + 8 <= n; c += 8) _mm256_storeu_ps(x + c, _mm256_add_ps(_mm256_loadu_ps(x + c), _mm256_set1_ps(hi)));
      for (; c < n; ++c) x[c] += hi;
    }
  }
}

ATTN_AVX2 void bias_keys_avx2(float* x, int64_t n, int64_t d0, float slope, const float* tab,
                              int64_t M) {
  // key r at d = d0 - r: bias_rows' terms, vectors of 8 keys (d descending in the lanes)
  const int64_t dmax = std::max<int64_t>(std::abs(d0) + n, 0);
  const __m256i down = _mm256_setr_epi32(0, -1, -2, -3, -4, -5, -6, -7);
  if (slope != 0.f) {
    const __m256 vs = _mm256_set1_ps(slope);
    int64_t r = 0;
    if (dmax < (int64_t(1) << 30)) {
      for (; r + 8 <= n; r += 8) {
        const __m256i d = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(d0 - r)), down);
        const __m256 ad = _mm256_cvtepi32_ps(_mm256_abs_epi32(d));
        _mm256_storeu_ps(x + r, _mm256_fnmadd_ps(vs, ad, _mm256_loadu_ps(x + r)));
      }
    }
    for (; r < n; ++r) {
      const int64_t d = d0 - r;
      x[r] = std::fma(-slope, static_cast<float>(d < 0 ? -d : d), x[r]);
    }
  }
  if (tab != nullptr) {
    // keys [0, ra): d > M; [ra, rb): tab[M + d0 - r]; [rb, n): d < -M
    const int64_t ra = std::clamp<int64_t>(d0 - M, 0, n);
    const int64_t rb = std::clamp<int64_t>(d0 + M + 1, ra, n);
    const float lo = tab[0], hi = tab[2 * M];
    int64_t r = 0;
    for (; r + 8 <= ra; r += 8) _mm256_storeu_ps(x + r, _mm256_add_ps(_mm256_loadu_ps(x + r), _mm256_set1_ps(hi)));
    for (; r < ra; ++r) x[r] += hi;
    // key r reads tab[M + d0 - r] (an index into the table for r in [ra, rb), as bias_rows)
    const __m256i reverse = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    for (; r + 8 <= rb; r += 8) {
      const __m256 tv = _mm256_permutevar8x32_ps(_mm256_loadu_ps(tab + (M + d0 - r - 7)), reverse);
      _mm256_storeu_ps(x + r, _mm256_add_ps(_mm256_loadu_ps(x + r), tv));
    }
    for (; r < rb; ++r) x[r] += tab[M + d0 - r];
    for (; r + 8 <= n; r += 8) _mm256_storeu_ps(x + r, _mm256_add_ps(_mm256_loadu_ps(x + r), _mm256_set1_ps(lo)));
    for (; r < n; ++r) x[r] += lo;
  }
}

ATTN_AVX2 void softcap_rows_avx2(float* st, int64_t rows, int64_t n, int64_t ld, float cap,
                                 float* th) {
  const float inv = 1.0f / cap;
  const __m256 vinv = _mm256_set1_ps(inv), vcap = _mm256_set1_ps(cap);
  for (int64_t r = 0; r < rows; ++r) {
    float* x = st + r * ld;
    float* t = th != nullptr ? th + r * ld : nullptr;
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
      const __m256 tv = cpu::tanh_ps(_mm256_mul_ps(_mm256_loadu_ps(x + c), vinv));
      if (t != nullptr) _mm256_storeu_ps(t + c, tv);
      _mm256_storeu_ps(x + c, _mm256_mul_ps(vcap, tv));
    }
    if (c < n) {  // the tail through a zero-padded vector: the same function for every column
      alignas(32) float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = c; i < n; ++i) buf[i - c] = x[i];
      const __m256 tv = cpu::tanh_ps(_mm256_mul_ps(_mm256_load_ps(buf), vinv));
      _mm256_store_ps(buf, tv);
      for (int64_t i = c; i < n; ++i) {
        if (t != nullptr) t[i] = buf[i - c];
        x[i] = cap * buf[i - c];
      }
    }
  }
}

ATTN_AVX2 void dropout_row_avx2(const float* src, float* dst, int64_t n, const uint64_t* words,
                                int shift, uint32_t thresh, float inv_keep) {
  const __m128i count = _mm_cvtsi32_si128(shift);
  const __m256i lo16 = _mm256_set1_epi32(0xffff);
  // u >= thresh  <=>  u > thresh - 1 (u < 2^16, thresh <= 2^16: no overflow)
  const __m256i tm1 = _mm256_set1_epi32(static_cast<int32_t>(thresh) - 1);
  // the interleaved 32-bit halves of two 4-word vectors back in column order
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256 vinv = _mm256_set1_ps(inv_keep);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256i w0 = _mm256_srl_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + c)), count);
    const __m256i w1 = _mm256_srl_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + c + 4)), count);
    // 32-bit lanes: c, c+4, c+1, c+5, ... (low halves of w0 and w1 interleaved)
    const __m256i both = _mm256_blend_epi32(w0, _mm256_slli_epi64(w1, 32), 0xaa);
    const __m256i u = _mm256_and_si256(_mm256_permutevar8x32_epi32(both, order), lo16);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(u, tm1));
    _mm256_storeu_ps(dst + c, _mm256_and_ps(keep, _mm256_mul_ps(_mm256_loadu_ps(src + c), vinv)));
  }
  for (; c < n; ++c) {
    const uint32_t u = static_cast<uint32_t>(words[c] >> shift) & 0xffffu;
    dst[c] = u >= thresh ? src[c] * inv_keep : 0.f;
  }
}

ATTN_AVX2 void bf16_to_float_avx2(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

ATTN_AVX2 void half_to_float_avx2(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  if (i < n) {  // tail through a zero-padded vector
    alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    alignas(32) float out[8];
    std::memcpy(tmp, src + i, static_cast<size_t>(n - i) * sizeof(uint16_t));
    _mm256_store_ps(out, _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp))));
    std::memcpy(dst + i, out, static_cast<size_t>(n - i) * sizeof(float));
  }
}

namespace {
// dst[0, n) from src[0, n) 8 values at a time by eight(src8, dst8), the tail through a
// zero-padded vector (float_to_half_avx2 / float_to_bf16_avx2)
template <typename Eight>
ATTN_AVX2 inline void by_eight(const float* src, int64_t n, uint16_t* dst, Eight eight) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) eight(src + i, dst + i);
  if (i < n) {
    float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint16_t out[8];
    std::memcpy(tmp, src + i, static_cast<size_t>(n - i) * sizeof(float));
    eight(tmp, out);
    std::memcpy(dst + i, out, static_cast<size_t>(n - i) * sizeof(uint16_t));
  }
}
}  // namespace

ATTN_AVX2 void float_to_half_avx2(const float* src, float mul, int64_t n, uint16_t* dst) {
  const __m256 m = _mm256_set1_ps(mul);
  by_eight(src, n, dst, [&](const float* s8, uint16_t* d8) ATTN_AVX2 {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s8), m);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d8),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  });
}

ATTN_AVX2 void float_to_bf16_avx2(const float* src, float mul, int64_t n, uint16_t* dst) {
  // round to nearest even on the bits: (u + 0x7fff + ((u >> 16) & 1)) >> 16; NaN -> 0x7fc0
  const __m256 m = _mm256_set1_ps(mul);
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
  const __m256i qnan = _mm256_set1_epi32(0x7fc0);
  by_eight(src, n, dst, [&](const float* s8, uint16_t* d8) ATTN_AVX2 {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s8), m);
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), lsb), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    // 8 words from the low halves of the 8 lanes (each < 2^16: packus keeps them)
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d8), packed);
  });
}

namespace {
// N rows' chains side by side: one FMA of each row per step d, so N chains are in flight.
template <int N>
ATTN_AVX2 inline void row_dots_n(int64_t len, const float* a, int64_t lda, const float* b,
                                 int64_t ldb, float* out) {
  const int64_t chain = gemm_chain_length(len);
  float tot[N] = {};
  for (int64_t d0 = 0; d0 < len; d0 += chain) {
    const int64_t d1 = std::min(len, d0 + chain);
    float c[N] = {};
    for (int64_t d = d0; d < d1; ++d) {
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r) c[r] = __builtin_fmaf(a[r * lda + d], b[r * ldb + d], c[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) tot[r] = d0 == 0 ? c[r] : tot[r] + c[r];
  }
#pragma GCC unroll 8
  for (int r = 0; r < N; ++r) out[r] = tot[r];
}
}  // namespace

ATTN_AVX2 void row_dots_fma_avx2(int n, int64_t len, const float* a, int64_t lda, const float* b,
                                 int64_t ldb, float* out) {
  switch (n) {
    case 8: return row_dots_n<8>(len, a, lda, b, ldb, out);
    case 7: return row_dots_n<7>(len, a, lda, b, ldb, out);
    case 6: return row_dots_n<6>(len, a, lda, b, ldb, out);
    case 5: return row_dots_n<5>(len, a, lda, b, ldb, out);
    case 4: return row_dots_n<4>(len, a, lda, b, ldb, out);
    case 3: return row_dots_n<3>(len, a, lda, b, ldb, out);
    case 2: return row_dots_n<2>(len, a, lda, b, ldb, out);
    case 1: return row_dots_n<1>(len, a, lda, b, ldb, out);
    default: return;
  }
}

#else  // not x86-64 with GCC/Clang: the generic kernels are always used

bool cpu_has_avx2_fma() { return false; }
void gemm_avx2(int64_t, int64_t, int64_t, const float*, int64_t, int64_t, const float*, int64_t,
               float*, int64_t, bool) {}
void gemm_at_avx2(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t, float*,
                  int64_t, const float*) {}
void softmax_avx2(float*, int64_t, int64_t, float*, float*, float*) {}
void exp_sub_avx2(float*, int64_t, int64_t, const float*) {}
void ds_avx2(const float*, float*, int64_t, int64_t, const float*) {}
void bias_rows_avx2(float*, int64_t, int64_t, int64_t, int64_t, float, const float*, int64_t) {}
void dropout_row_avx2(const float*, float*, int64_t, const uint64_t*, int, uint32_t, float) {}
void softcap_rows_avx2(float*, int64_t, int64_t, int64_t, float, float*) {}
void bias_keys_avx2(float*, int64_t, int64_t, float, const float*, int64_t) {}
void bf16_to_float_avx2(const uint16_t*, int64_t, float*) {}
void half_to_float_avx2(const uint16_t*, int64_t, float*) {}
void float_to_half_avx2(const float*, float, int64_t, uint16_t*) {}
void float_to_bf16_avx2(const float*, float, int64_t, uint16_t*) {}
void transpose_rows_avx2(const float*, int64_t, int64_t, int64_t, float, bool, float*, int64_t) {}
void row_dots_fma_avx2(int, int64_t, const float*, int64_t, const float*, int64_t, float*) {}

#endif

}  // namespace mk
}  // namespace attn_ext
