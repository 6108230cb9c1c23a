// AVX-512F micro-kernels of the CPU attention: the fp32 gemms of attention_microkernels.h
// (gemm, and the forward's pass 3 with the rescale fused in) and the softmax steps (online
// softmax, exp(s - lse), dS) on zmm registers, for CPUs with AVX-512 (cpu::avx512_enabled()),
// chosen at run time by gemm512_enabled().
//
// Every output is the chain gemm_avx2 (attention_microkernels_avx2.cpp) computes for it: FMAs
// over K in order, in chains of gemm_chain_length started from zero and added to C after. A
// vector lane holds one output from the first product to the store, so the register width
// changes which outputs are computed together, never how one is rounded: the two paths give
// the same bits (tools/gemm512_check.cpp; tests/test_gemm512.py on whole calls), and the
// backward, which recomputes P = exp(s - lse) from the forward's exact scores, may run on either.
// One exception: where two NaNs (or a NaN and an invalid operation) meet, which NaN comes out
// (its sign and payload) follows the instruction's operand order, which the compiler picks
// (here the FMAs take A's broadcast from memory as their other multiplicand); a NaN output is
// a NaN on both paths.
// What changes is the tile: MR rows x NV zmm vectors (16 columns each) of accumulators, 24 of
// the 32 zmm registers where the shape allows (6 x 64, 8 x 48, 12 x 32 columns), the NV B
// vectors and one broadcast besides. On a core with two 512-bit FMA units that is twice
// gemm_avx2's multiply-adds per cycle (RESULTS.md, eighteenth session).
//
// ATen-free and compiled for that target through __attribute__((target)), as the AVX2 file.
#include "cpu/attention_microkernels.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "cpu/cpu_features.h"
#include "cpu/simd.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
#define ATTN_HAVE_X86 1
#endif

namespace attn_ext {
namespace mk {

bool gemm512_enabled() {
  return cpu::avx512_enabled() && !cpu::env_is("ATTN_EXT_CPU_GEMM512", "0");
}

#ifdef ATTN_HAVE_X86

namespace {

// Rows of a tile with NV accumulator vectors per row: 24 accumulators (12 for NV = 1, where a
// broadcast serves one FMA and the loads, not the registers, are the limit).
template <int NV>
constexpr int kRows = NV == 4 ? 6 : (NV == 3 ? 8 : 12);

// One step t: acc[r][v] += A(r, t) * B(t, 16 v .. 16 v + 15), a at A(0, t), A(r, t) = a[r * a_row]
// (broadcast), b at B's row t; the last vector's lanes outside `last` are loaded as 0 (and never
// stored).
// (Full: every lane of the last vector, loaded without the mask: a masked load in the loop
// costs ~8 % of the tile's rate.)
template <int MR, int NV, bool Full>
ATTN_AVX512 inline void step512(const float* a, int64_t a_row, const float* b, __mmask16 last,
                                __m512 (&acc)[MR][NV]) {
  __m512 bv[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    bv[v] = v == NV - 1 && !Full ? _mm512_maskz_loadu_ps(last, b + 16 * v)
                                 : _mm512_loadu_ps(b + 16 * v);
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    const __m512 ar = _mm512_set1_ps(a[r * a_row]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
  }
}

// Steps [t0, t1) of a tile, A(r, t) = A[r * a_row + t * a_col], B's row t at B + t * ldb; the
// unmasked loads where the last vector is whole.
template <int MR, int NV>
ATTN_AVX512 inline void steps512(int64_t t0, int64_t t1, const float* A, int64_t a_row,
                                 int64_t a_col, const float* B, int64_t ldb, __mmask16 last,
                                 __m512 (&acc)[MR][NV]) {
  if (last == 0xFFFF) {
    for (int64_t t = t0; t < t1; ++t)
      step512<MR, NV, true>(A + t * a_col, a_row, B + t * ldb, last, acc);
  } else {
    for (int64_t t = t0; t < t1; ++t)
      step512<MR, NV, false>(A + t * a_col, a_row, B + t * ldb, last, acc);
  }
}

template <int MR, int NV>
ATTN_AVX512 inline void zero(__m512 (&acc)[MR][NV]) {
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  }
}

// gemm_tile of the AVX2 file on MR x 16 NV columns: chains of gemm_chain_length from zero; the
// first chain of a non-accumulating call writes C, every other one is added to it (C + chain).
template <int MR, int NV>
ATTN_AVX512 inline void tile512(int64_t K, const float* A, int64_t a_row, int64_t a_col,
                                const float* B, int64_t ldb, float* C, int64_t ldc,
                                bool accumulate, __mmask16 last) {
  if (K <= 0 && accumulate) return;
  const int64_t kb = gemm_chain_length(K);
  for (int64_t t0 = 0; t0 < K || t0 == 0; t0 += kb) {
    const int64_t t1 = std::min(K, t0 + kb);
    const bool add = accumulate || t0 > 0;
    __m512 acc[MR][NV];
    zero<MR, NV>(acc);
    steps512<MR, NV>(t0, t1, A, a_row, a_col, B, ldb, last, acc);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __mmask16 k = lanes_of(v, NV, last);
        float* c = C + r * ldc + 16 * v;
        const __m512 x = add ? _mm512_add_ps(_mm512_maskz_loadu_ps(k, c), acc[r][v]) : acc[r][v];
        _mm512_mask_storeu_ps(c, k, x);
      }
    }
  }
}

// The forward's pass 3 tile (gemm_at_tile of the AVX2 file): one chain over K <= kGemmKSplit
// from zero, A(r, t) = A[r + t * a_col]; then C's rows times scale[r] (when scale is given; the
// product rounded on its own) plus the chain.
template <int MR, int NV>
ATTN_AVX512 inline void at_tile512(int64_t K, const float* A, int64_t a_col, const float* B,
                                   int64_t ldb, float* C, int64_t ldc, const float* scale,
                                   __mmask16 last) {
  __m512 acc[MR][NV];
  zero<MR, NV>(acc);
  steps512<MR, NV>(0, K, A, 1, a_col, B, ldb, last, acc);
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    const __m512 sr = scale != nullptr ? _mm512_set1_ps(scale[r]) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 k = lanes_of(v, NV, last);
      float* cp = C + r * ldc + 16 * v;
      __m512 c = _mm512_maskz_loadu_ps(k, cp);
      if (scale != nullptr) {
        c = _mm512_mul_ps(c, sr);
        asm("" : "+v"(c));  // no contraction into an FMA with the add (see the AVX2 file)
      }
      _mm512_mask_storeu_ps(cp, k, K > 0 ? _mm512_add_ps(c, acc[r][v]) : c);
    }
  }
}

// The last rows of a column panel: tile512 / at_tile512 with MR = rows < kRows<NV>.
template <int R, int NV>
ATTN_AVX512 inline void edge512(int rows, int64_t K, const float* A, int64_t a_row, int64_t a_col,
                                const float* B, int64_t ldb, float* C, int64_t ldc,
                                bool accumulate, __mmask16 last) {
  if constexpr (R > 0) {
    if (rows == R) return tile512<R, NV>(K, A, a_row, a_col, B, ldb, C, ldc, accumulate, last);
    edge512<R - 1, NV>(rows, K, A, a_row, a_col, B, ldb, C, ldc, accumulate, last);
  }
}

template <int R, int NV>
ATTN_AVX512 inline void at_edge512(int rows, int64_t K, const float* A, int64_t a_col,
                                   const float* B, int64_t ldb, float* C, int64_t ldc,
                                   const float* scale, __mmask16 last) {
  if constexpr (R > 0) {
    if (rows == R) return at_tile512<R, NV>(K, A, a_col, B, ldb, C, ldc, scale, last);
    at_edge512<R - 1, NV>(rows, K, A, a_col, B, ldb, C, ldc, scale, last);
  }
}

// One column panel of 16 NV columns (the last vector's lanes by `last`), all M rows.
template <int NV>
ATTN_AVX512 void panel512(int64_t M, int64_t K, const float* A, int64_t a_row, int64_t a_col,
                          const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate,
                          __mmask16 last) {
  constexpr int MR = kRows<NV>;
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    tile512<MR, NV>(K, A + m * a_row, a_row, a_col, B, ldb, C + m * ldc, ldc, accumulate, last);
  if (m < M) {
    edge512<MR - 1, NV>(static_cast<int>(M - m), K, A + m * a_row, a_row, a_col, B, ldb,
                        C + m * ldc, ldc, accumulate, last);
  }
}

template <int NV>
ATTN_AVX512 void at_panel512(int64_t M, int64_t K, const float* A, int64_t a_col, const float* B,
                             int64_t ldb, float* C, int64_t ldc, const float* scale,
                             __mmask16 last) {
  constexpr int MR = kRows<NV>;
  int64_t m = 0;
  for (; m + MR <= M; m += MR) {
    at_tile512<MR, NV>(K, A + m, a_col, B, ldb, C + m * ldc, ldc,
                       scale != nullptr ? scale + m : nullptr, last);
  }
  if (m < M) {
    at_edge512<MR - 1, NV>(static_cast<int>(M - m), K, A + m, a_col, B, ldb, C + m * ldc, ldc,
                           scale != nullptr ? scale + m : nullptr, last);
  }
}

// The column panels of N columns: vectors of 16 (the last one's lanes `last` when N % 16 != 0),
// taken 4 at a time, except that 6 left are 3 + 3 (N = 96: two 8 x 48 panels, not 64 + 32).
// f(nv, n0, lanes of the panel's last vector) for each panel, left to right.
template <typename F>
ATTN_AVX512 inline void for_panels512(int64_t N, F&& f) {
  const int64_t nvec = (N + 15) / 16;
  const __mmask16 tail = lanes16(N - 16 * (nvec - 1));
  int64_t v0 = 0;
  while (v0 < nvec) {
    const int64_t left = nvec - v0;
    const int nv = left == 6 ? 3 : static_cast<int>(std::min<int64_t>(left, 4));
    f(nv, 16 * v0, v0 + nv == nvec ? tail : lanes16(16));
    v0 += nv;
  }
}

}  // namespace

ATTN_AVX512 void gemm_avx512(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row,
                             int64_t a_col, const float* B, int64_t ldb, float* C, int64_t ldc,
                             bool accumulate) {
  // column panels outside: the B panel (K, 16 nv) stays in L1 while A streams by
  for_panels512(N, [&](int nv, int64_t n, __mmask16 last) ATTN_AVX512 {
    switch (nv) {
      case 4: panel512<4>(M, K, A, a_row, a_col, B + n, ldb, C + n, ldc, accumulate, last); break;
      case 3: panel512<3>(M, K, A, a_row, a_col, B + n, ldb, C + n, ldc, accumulate, last); break;
      case 2: panel512<2>(M, K, A, a_row, a_col, B + n, ldb, C + n, ldc, accumulate, last); break;
      default: panel512<1>(M, K, A, a_row, a_col, B + n, ldb, C + n, ldc, accumulate, last); break;
    }
  });
}

// gemm_at_avx2's semantics (attention_microkernels.h). B rows not all 64-byte aligned are
// copied panel by panel into an aligned buffer first (a zmm row across two cache lines halves
// the load rate); the sums are the same either way.
ATTN_AVX512 void gemm_at_avx512(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_col,
                                const float* B, int64_t ldb, float* C, int64_t ldc,
                                const float* scale) {
  if (K > kGemmKSplit) {  // blocked chains: the rescale first, then the gemm (its bits)
    if (scale != nullptr) {
      for (int64_t m = 0; m < M; ++m) {
        const __m512 sm = _mm512_set1_ps(scale[m]);
        for_panels512(N, [&](int nv, int64_t n0, __mmask16 last) ATTN_AVX512 {
          for (int v = 0; v < nv; ++v) {
            const __mmask16 k = lanes_of(v, nv, last);
            float* c = C + m * ldc + n0 + 16 * v;
            _mm512_mask_storeu_ps(c, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, c), sm));
          }
        });
      }
    }
    gemm_avx512(M, N, K, A, 1, a_col, B, ldb, C, ldc, true);
    return;
  }
  const bool pack = (reinterpret_cast<uintptr_t>(B) | static_cast<uintptr_t>(ldb * 4)) % 64 != 0;
  alignas(64) float panel[kGemmKSplit * 64];
  for_panels512(N, [&](int nv, int64_t n, __mmask16 last) ATTN_AVX512 {
    const float* b = B + n;
    int64_t ld = ldb;
    if (pack) {
      for (int64_t t = 0; t < K; ++t) {
        for (int v = 0; v < nv; ++v) {
          const __mmask16 k = lanes_of(v, nv, last);
          _mm512_store_ps(panel + 64 * t + 16 * v, _mm512_maskz_loadu_ps(k, B + t * ldb + n + 16 * v));
        }
      }
      b = panel;
      ld = 64;
    }
    switch (nv) {
      case 4: at_panel512<4>(M, K, A, a_col, b, ld, C + n, ldc, scale, last); break;
      case 3: at_panel512<3>(M, K, A, a_col, b, ld, C + n, ldc, scale, last); break;
      case 2: at_panel512<2>(M, K, A, a_col, b, ld, C + n, ldc, scale, last); break;
      default: at_panel512<1>(M, K, A, a_col, b, ld, C + n, ldc, scale, last); break;
    }
  });
}

// softmax_avx2 / exp_sub_avx2 / ds_avx2 on 16 columns at a time (the last 8 of a block by a
// mask): each column's max and sum run over the rows in the same order (even and odd rows in
// two chains, joined at the end) and exp2_ps512 is exp2_ps lane by lane, so the same bits.
ATTN_AVX512 void softmax_avx512(float* st, int64_t rows, int64_t cols, float* m, float* l,
                                float* alpha) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 log2e = _mm512_set1_ps(1.4426950408889634f);
  alignas(64) float mxs[96];  // pass 1's maxima of the current 96 columns
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 k = lanes16(cols - c);
    auto ld = [&](const float* p) ATTN_AVX512 { return _mm512_maskz_loadu_ps(k, p); };
    // pass 1 (each 96 columns at once): running max of the 16 columns
    if (c % 96 == 0)
      cpu::column_max_all_ps512(st + c, cols, rows, std::min<int64_t>(96, cols - c), m + c, mxs);
    const __m512 m_old = ld(m + c);
    const __m512 mx = ld(mxs + c % 96);
    const __m512 mu = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mx, neg_inf, _CMP_NEQ_UQ), mx);
    const __m512 a = cpu::exp2_ps512(_mm512_mul_ps(_mm512_sub_ps(m_old, mu), log2e));
    // pass 2: probabilities in place and their column sums
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t r = 0;
    // (four rows a step: four independent exp chains side by side, so fewer of a step's
    // operations wait in the scheduler; the sums keep the rows' order, even rows into s0)
    for (; r + 4 <= rows; r += 4) {
      float* p0 = st + r * cols + c;
      __m512 e[4];
      for (int i = 0; i < 4; ++i) e[i] = _mm512_mul_ps(_mm512_sub_ps(ld(p0 + i * cols), mu), log2e);
      cpu::exp2_ps512_n<4>(e);
      for (int i = 0; i < 4; ++i) _mm512_mask_storeu_ps(p0 + i * cols, k, e[i]);
      s0 = _mm512_add_ps(s0, e[0]);
      s1 = _mm512_add_ps(s1, e[1]);
      s0 = _mm512_add_ps(s0, e[2]);
      s1 = _mm512_add_ps(s1, e[3]);
    }
    for (; r + 2 <= rows; r += 2) {
      float* p0 = st + r * cols + c;
      float* p1 = p0 + cols;
      const __m512 e0 = cpu::exp2_ps512(_mm512_mul_ps(_mm512_sub_ps(ld(p0), mu), log2e));
      const __m512 e1 = cpu::exp2_ps512(_mm512_mul_ps(_mm512_sub_ps(ld(p1), mu), log2e));
      _mm512_mask_storeu_ps(p0, k, e0);
      _mm512_mask_storeu_ps(p1, k, e1);
      s0 = _mm512_add_ps(s0, e0);
      s1 = _mm512_add_ps(s1, e1);
    }
    if (r < rows) {
      float* p0 = st + r * cols + c;
      const __m512 e0 = cpu::exp2_ps512(_mm512_mul_ps(_mm512_sub_ps(ld(p0), mu), log2e));
      _mm512_mask_storeu_ps(p0, k, e0);
      s0 = _mm512_add_ps(s0, e0);
    }
    const __m512 sum = _mm512_add_ps(s0, s1);
    _mm512_mask_storeu_ps(alpha + c, k, a);
    _mm512_mask_storeu_ps(l + c, k, _mm512_fmadd_ps(ld(l + c), a, sum));
    _mm512_mask_storeu_ps(m + c, k, mx);
  }
}

ATTN_AVX512 void exp_sub_avx512(float* st, int64_t rows, int64_t cols, const float* sub) {
  const __m512 log2e = _mm512_set1_ps(1.4426950408889634f);
  for (int64_t r = 0; r < rows; ++r) {
    float* s = st + r * cols;
    // (64 columns a step: four exp chains side by side; lanes past cols are neither loaded
    // nor stored)
    for (int64_t c = 0; c < cols; c += 64) {
      __mmask16 k[4];
      __m512 e[4];
      for (int i = 0; i < 4; ++i) {
        const int64_t left = cols - c - 16 * i;
        k[i] = lanes16(left);
        const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k[i], s + c + 16 * i),
                                       _mm512_maskz_loadu_ps(k[i], sub + c + 16 * i));
        e[i] = _mm512_mul_ps(x, log2e);
      }
      cpu::exp2_ps512_n<4>(e);
      for (int i = 0; i < 4; ++i) _mm512_mask_storeu_ps(s + c + 16 * i, k[i], e[i]);
    }
  }
}

ATTN_AVX512 void ds_avx512(const float* p, float* ds, int64_t rows, int64_t cols, const float* d) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* pr = p + r * cols;
    float* dr = ds + r * cols;
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 k = lanes16(cols - c);
      const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dr + c), _mm512_maskz_loadu_ps(k, d + c));
      _mm512_mask_storeu_ps(dr + c, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, pr + c), x));
    }
  }
}

#else  // not x86-64 with GCC/Clang: gemm512_enabled() is false, never called

void gemm_avx512(int64_t, int64_t, int64_t, const float*, int64_t, int64_t, const float*, int64_t,
                 float*, int64_t, bool) {
  std::abort();
}
void gemm_at_avx512(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t,
                    float*, int64_t, const float*) {
  std::abort();
}
void softmax_avx512(float*, int64_t, int64_t, float*, float*, float*) { std::abort(); }
void exp_sub_avx512(float*, int64_t, int64_t, const float*) { std::abort(); }
void ds_avx512(const float*, float*, int64_t, int64_t, const float*) { std::abort(); }

#endif

}  // namespace mk
}  // namespace attn_ext
