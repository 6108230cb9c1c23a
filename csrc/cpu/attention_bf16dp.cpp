// bf16 score products by pairwise dot products (AVX512_BF16 vdpbf16ps): the tiled kernels'
// pass 1 for bf16 inputs where the CPU has them (interface in attention_microkernels.h). Each
// instruction multiplies 32 bf16 pairs exactly and adds them into 16 fp32 lanes, twice the
// multiply-adds of an 8-float FMA pair per cycle, and the inputs' bf16 are read as they are
// (no widening to fp32). The forward (attention_fwd.cpp) and the backward's recomputed scores
// (attention_bwd.cpp) both call scores_bf16dp, so the backward's P = exp(s - lse) meets the
// forward's bits. Compiled for that target through __attribute__((target)) and only called
// where bf16dp_enabled(); ATen-free, as attention_microkernels_avx2.cpp. Bits and range
// differ from the fp32 gemm's (another summation order; denormal inputs and results taken as
// zero; q . k summed unscaled, so it overflows where |q . k| passes 3.4e38, sqrt(D) times
// sooner than scale * q . k): the two are alternatives for a whole call, never mixed in one.
#include "cpu/attention_microkernels.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu/cpu_features.h"
#include "cpu/simd.h"

namespace attn_ext {
namespace mk {

bool bf16dp_enabled() { return tile_rule().bf16dp; }

bool bf16dp_tiled_enabled() { return tile_rule().bf16dp_tiled; }

namespace {
// pack_bf16_pairs on rows [n0, n1) and pairs [t0, t1), one word at a time.
void pack_pairs_scalar(const uint16_t* rows, int64_t row_stride, int64_t n0, int64_t n1,
                       int64_t t0, int64_t t1, uint32_t* qp, int64_t ldq) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = rows + n * row_stride;
    for (int64_t t = t0; t < t1; ++t) {
      uint32_t w;
      std::memcpy(&w, row + 2 * t, sizeof(w));
      qp[t * ldq + n] = w;
    }
  }
}

#if ATTN_EXT_HAVE_AVX2_PATH
// The whole 16 rows x 16 pairs blocks by a register transpose (cpu::transpose_16x16_epi32);
// returns the rows and pairs it covered (multiples of 16).
ATTN_EXT_AVX512 void pack_pairs_512(const uint16_t* rows, int64_t row_stride, int64_t n_rows,
                                    int64_t pairs, uint32_t* qp, int64_t ldq, int64_t* n16,
                                    int64_t* t16) {
  *n16 = n_rows / 16 * 16;
  *t16 = pairs / 16 * 16;
  __m512i r[16];
  for (int64_t n0 = 0; n0 < *n16; n0 += 16) {
    for (int64_t t0 = 0; t0 < *t16; t0 += 16) {
      for (int i = 0; i < 16; ++i)
        r[i] = _mm512_loadu_si512(rows + (n0 + i) * row_stride + 2 * t0);
      cpu::transpose_16x16_epi32(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(qp + (t0 + i) * ldq + n0, r[i]);
    }
  }
}
#endif
}  // namespace

void pack_bf16_pairs(const uint16_t* rows, int64_t row_stride, int64_t n_rows, int64_t D,
                     uint32_t* qp, int64_t ldq) {
  const int64_t pairs = D / 2;
  int64_t n16 = 0, t16 = 0;
#if ATTN_EXT_HAVE_AVX2_PATH
  if (cpu::avx512_enabled()) pack_pairs_512(rows, row_stride, n_rows, pairs, qp, ldq, &n16, &t16);
#endif
  // the rest word by word: pairs past t16 of the blocks' rows, then the rows past n16
  pack_pairs_scalar(rows, row_stride, 0, n16, t16, pairs, qp, ldq);
  pack_pairs_scalar(rows, row_stride, n16, n_rows, 0, pairs, qp, ldq);
}

#if ATTN_EXT_HAVE_BF16DP_PATH

namespace {

// C rows [0, MR) x columns [0, 16 NV) (the last vector's lanes by `last`): chains of
// chain_pairs pairs, each from zero; the first stored, the next ones added to it in order
// ((c0 + c1) + c2 ...), the last times scale.
template <int MR, int NV>
ATTN_EXT_AVX512BF16 void dp_tile(int64_t pairs, int64_t chain_pairs, const uint16_t* A,
                                 int64_t lda, const uint32_t* B, int64_t ldb, float scale,
                                 float* C, int64_t ldc, __mmask16 last) {
  for (int64_t t0 = 0; t0 < pairs; t0 += chain_pairs) {
    const int64_t t1 = std::min(pairs, t0 + chain_pairs);
    __m512 acc[MR][NV];
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
      __m512bh b[NV];
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) {
        const uint32_t* bp = B + t * ldb + 16 * j;
        b[j] = (__m512bh)(j == NV - 1 ? _mm512_maskz_loadu_epi32(last, bp)
                                      : _mm512_loadu_si512(bp));
      }
#pragma GCC unroll 12
      for (int m = 0; m < MR; ++m) {
        uint32_t w;
        std::memcpy(&w, A + m * lda + 2 * t, sizeof(w));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
#pragma GCC unroll 2
        for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, b[j]);
      }
    }
    const bool first = t0 == 0, end = t1 == pairs;
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) {
        const __mmask16 k = lanes_of(j, NV, last);
        float* c = C + m * ldc + 16 * j;
        __m512 x = acc[m][j];
        if (!first) x = _mm512_add_ps(_mm512_maskz_loadu_ps(k, c), x);
        if (end) x = _mm512_mul_ps(x, _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(c, k, x);
      }
    }
  }
}

template <int MR>
ATTN_EXT_AVX512BF16 void dp_rows(int64_t N, int64_t pairs, int64_t chain_pairs,
                                 const uint16_t* A, int64_t lda, const uint32_t* B, int64_t ldb,
                                 float scale, float* C, int64_t ldc) {
  int64_t n0 = 0;
  for (; n0 + 32 <= N; n0 += 32)
    dp_tile<MR, 2>(pairs, chain_pairs, A, lda, B + n0, ldb, scale, C + n0, ldc, lanes16(16));
  const int64_t rest = N - n0;  // 0, 8, 16 or 24
  if (rest > 16)
    dp_tile<MR, 2>(pairs, chain_pairs, A, lda, B + n0, ldb, scale, C + n0, ldc, lanes16(rest - 16));
  else if (rest > 0)
    dp_tile<MR, 1>(pairs, chain_pairs, A, lda, B + n0, ldb, scale, C + n0, ldc, lanes16(rest));
}

}  // namespace

void scores_bf16dp(int64_t M, int64_t N, int64_t D, const uint16_t* A, int64_t lda,
                   const uint32_t* B, int64_t ldb, float scale, float* C, int64_t ldc) {
  const int64_t pairs = D / 2, chain_pairs = gemm_chain_length(D) / 2;
  if (pairs == 0) {  // (D = 0: every score is 0)
    for (int64_t m = 0; m < M; ++m) std::fill(C + m * ldc, C + m * ldc + N, 0.f);
    return;
  }
  int64_t m0 = 0;
  constexpr int MR = 8;
  for (; m0 + MR <= M; m0 += MR)
    dp_rows<MR>(N, pairs, chain_pairs, A + m0 * lda, lda, B, ldb, scale, C + m0 * ldc, ldc);
  const int64_t rest = M - m0;
  const uint16_t* a = A + m0 * lda;
  float* c = C + m0 * ldc;
  switch (rest) {
    case 7: dp_rows<7>(N, pairs, chain_pairs, a, lda, B, ldb, scale, c, ldc); break;
    case 6: dp_rows<6>(N, pairs, chain_pairs, a, lda, B, ldb, scale, c, ldc); break;
    case 5: dp_rows<5>(N, pairs, chain_pairs, a, lda, B, ldb, scale, c, ldc); break;
    case 4: dp_rows<4>(N, pairs, chain_pairs, a, lda, B, ldb, scale, c, ldc); break;
    case 3: dp_rows<3>(N, pairs, chain_pairs, a, lda, B, ldb, scale, c, ldc); break;
    case 2: dp_rows<2>(N, pairs, chain_pairs, a, lda, B, ldb, scale, c, ldc); break;
    case 1: dp_rows<1>(N, pairs, chain_pairs, a, lda, B, ldb, scale, c, ldc); break;
    default: break;
  }
}

#else  // no AVX512_BF16 in this compiler: bf16dp_enabled() is false, never called

void scores_bf16dp(int64_t, int64_t, int64_t, const uint16_t*, int64_t, const uint32_t*,
                   int64_t, float, float*, int64_t) {
  std::abort();
}

#endif  // ATTN_EXT_HAVE_BF16DP_PATH

}  // namespace mk
}  // namespace attn_ext
