// Block-level building blocks of the CPU attention kernels, with no ATen types.
//
// Both the forward and the backward are written as a few small dense products on fp32 (or
// fp64) tiles plus element-wise softmax steps. Score tiles are stored *transposed*,
//   st (rows = keys, cols = queries), row-major with leading dimension `cols`,
// so every per-query reduction of the online softmax (max, sum) is a vertical vector
// operation and never a horizontal one.
//
// Two implementations share this interface:
//   - generic: plain loops below, templated on float/double (double inputs, and CPUs
//     without AVX2/FMA); the compiler auto-vectorises the inner loops;
//   - avx2: hand-written AVX2/FMA/F16C intrinsics in attention_microkernels_avx2.cpp
//     (compiled for that target only), chosen at run time by cpu_has_avx2_fma().
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace attn_ext {
namespace mk {

// The gemms' chains over K. Every chain starts from zero and is added to the output after
// (C + chain, or ((c0 + c1) + c2) ... for several chains), never started from C: so a sum
// that runs over many tiles (o over the key tiles, dq over the key tiles, dk / dv over the
// query tiles) is rounded in blocks of a tile, not in one chain of every key. (One chain from
// C gave fp32 errors 2.5-4x the textbook reference's on long near-uniform rows, Sk = 4096:
// tests/test_fp32_grad_accuracy.py, test_long_near_uniform_rows_rule.) The AVX2 gemm sums
// K > kGemmKSplit in chains of kGemmKBlock products (a score at D = 128 and |s| >> 1 rounded
// more than the reference's blocked sgemm: TESTING.md, the fuzz item); the products over keys
// (K <= kBlockK = 96) and D <= 96 keep one chain (no extra tile pass), so the split costs only
// the score products at D = 128 / 256. Sums that must equal a gemm output bitwise (the
// backward's row term Di against its dP, the masked products of axpy_as_gemm) follow the
// same chains.
constexpr int64_t kGemmKBlock = 64;
constexpr int64_t kGemmKSplit = 96;
constexpr int64_t gemm_chain_length(int64_t K) {
  return K <= kGemmKSplit ? std::max<int64_t>(K, 1) : kGemmKBlock;
}

// C (M, N; ldc) = [C +] A (M, K) * B (K, N; ldb), where A's element (m, t) is
// A[m * a_row + t * a_col] (so A may be a transposed view). N must be a multiple of 8.
template <typename T>
using GemmFn = void (*)(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_row,
                        int64_t a_col, const T* B, int64_t ldb, T* C, int64_t ldc,
                        bool accumulate);

// Online-softmax update of one transposed score tile st (rows keys, cols queries; scores
// in natural-log units, masked entries -inf). Per column c:
//   m' = max(m[c], max_r st[r][c]);  mu = (m' == -inf ? 0 : m')
//   alpha[c] = exp(m[c] - mu);  st[r][c] = exp(st[r][c] - mu);  l[c] = l[c] * alpha[c] + sum_r st[r][c]
// with exp(x) = exp2(x * log2(e)): the difference is taken first, so it is exact near the
// maximum (the key of the maximum gets exactly 1) and the backward's exp(s - lse) from the
// same scores meets the same numbers. cols must be a multiple of 8.
template <typename T>
using SoftmaxFn = void (*)(T* st, int64_t rows, int64_t cols, T* m, T* l, T* alpha);

// st[r][c] = exp(st[r][c] - sub[c]) (backward: probabilities from the saved lse; the
// difference is taken in natural-log units, where lse was saved, to add no rounding to it).
template <typename T>
using ExpSubFn = void (*)(T* st, int64_t rows, int64_t cols, const T* sub);

// ds[r][c] = p[r][c] * (ds[r][c] - d[c]) (backward: dS = P * (dP - rowsum(dO * O))).
template <typename T>
using DsFn = void (*)(const T* p, T* ds, int64_t rows, int64_t cols, const T* d);

// The forward's pass 3, o = alpha * o + st^T v, with the rescale fused into the gemm's load of
// C: C (M, N; ldc) = C * scale[m] (row-wise; scale may be nullptr) + A' (M, K) B (K, N; ldb)
// with A'(m, t) = A[m + t * a_col]; the same bits as `C[m][:] *= scale[m]` followed by
// gemm(M, N, K, A, 1, a_col, B, ldb, C, ldc, true). N a multiple of 8.
template <typename T>
using GemmAtFn = void (*)(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_col,
                          const T* B, int64_t ldb, T* C, int64_t ldc, const T* scale);

template <typename T>
struct Kernels {
  GemmFn<T> gemm;
  SoftmaxFn<T> softmax;
  ExpSubFn<T> exp_sub;
  DsFn<T> ds;
  GemmAtFn<T> gemm_at;  // nullptr: the separate rescale loop and gemm
};

// ---- generic implementations ----------------------------------------------------------

template <typename T>
void gemm_generic(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_row, int64_t a_col,
                  const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate) {
  // one chain over K per output, started from zero and then added to C when accumulating
  // (the chains of the AVX2 gemm for K <= kGemmKSplit), in column panels of kPanel
  constexpr int64_t kPanel = 64;
  if (K <= 0 && accumulate) return;
  for (int64_t m = 0; m < M; ++m) {
    T* c = C + m * ldc;
    for (int64_t n0 = 0; n0 < N; n0 += kPanel) {
      const int64_t nn = std::min(kPanel, N - n0);
      T acc[kPanel] = {};
      for (int64_t t = 0; t < K; ++t) {
        const T a = A[m * a_row + t * a_col];
        const T* b = B + t * ldb + n0;
        for (int64_t n = 0; n < nn; ++n) acc[n] += a * b[n];
      }
      for (int64_t n = 0; n < nn; ++n) c[n0 + n] = accumulate ? c[n0 + n] + acc[n] : acc[n];
    }
  }
}

template <typename T>
void softmax_generic(T* st, int64_t rows, int64_t cols, T* m, T* l, T* alpha) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  for (int64_t c = 0; c < cols; ++c) {
    T mx = m[c];
    for (int64_t r = 0; r < rows; ++r) mx = std::max(mx, st[r * cols + c]);
    const T mu = mx == kNegInf ? T(0) : mx;
    alpha[c] = std::exp(m[c] - mu);
    T sum = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const T p = std::exp(st[r * cols + c] - mu);
      st[r * cols + c] = p;
      sum += p;
    }
    l[c] = l[c] * alpha[c] + sum;
    m[c] = mx;
  }
}

template <typename T>
void exp_sub_generic(T* st, int64_t rows, int64_t cols, const T* sub) {
  for (int64_t r = 0; r < rows; ++r) {
    T* s = st + r * cols;
    for (int64_t c = 0; c < cols; ++c) s[c] = std::exp(s[c] - sub[c]);
  }
}

template <typename T>
void ds_generic(const T* p, T* ds, int64_t rows, int64_t cols, const T* d) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) ds[r * cols + c] = p[r * cols + c] * (ds[r * cols + c] - d[c]);
  }
}

// ALiBi and rel_bias (common/attention_mask.h, ScoreTerms) on `rows` key rows of a transposed
// score tile: row r holds the scores of key j = j_first + r against n consecutive query rows
// (x = st + r * ld, columns [0, n)), with d = d0 - r + c the distance of column c.
//   x[c] -= slope * |d|                 (slope != 0; natural units)
//   x[c] += tab[M + clamp(d, -M, M)]    (tab != nullptr: the head's (2M + 1) row)
// One definition for the forward and the backward (they must round the same way: the backward
// recomputes P = exp(s - lse) from these scores); columns past n are left alone.
template <typename T>
void bias_rows_generic(T* st, int64_t rows, int64_t n, int64_t ld, int64_t d0, T slope,
                       const T* tab, int64_t M) {
  for (int64_t r = 0; r < rows; ++r) {
    T* x = st + r * ld;
    const int64_t dr = d0 - r;
    if (slope != T(0)) {
      for (int64_t c = 0; c < n; ++c) {
        const int64_t d = dr + c;
        x[c] -= slope * static_cast<T>(d < 0 ? -d : d);
      }
    }
    if (tab != nullptr) {
      for (int64_t c = 0; c < n; ++c) {
        const int64_t d = dr + c;
        x[c] += tab[M + (d < -M ? -M : (d > M ? M : d))];
      }
    }
  }
}

// dst[d * ldd + c] = src[c * lds + d] * scale (scaled) or src[c * lds + d] (not), c < rows,
// d < cols: rows transposed into columns, as the forward and the backward pack q^T (scaled)
// and dout^T. One multiply per element (or none), so every path gives the same bits.
template <typename T>
inline void transpose_rows_generic(const T* src, int64_t lds, int64_t rows, int64_t cols,
                                   T scale, bool scaled, T* dst, int64_t ldd) {
  for (int64_t c = 0; c < rows; ++c) {
    for (int64_t d = 0; d < cols; ++d) {
      const T x = src[c * lds + d];
      dst[d * ldd + c] = scaled ? x * scale : x;
    }
  }
}

// out[r] = sum over d < len of a[r * lda + d] * b[r * ldb + d], rows r < n (n <= 8), rounded as
// a gemm output of that depth: fused, FMA chains of gemm_chain_length(len) from zero added in
// order (the AVX2 / AVX-512 gemms); not fused, one chain of products and adds (gemm_generic).
// The backward's row term Di = rowsum(out * dout) must equal its dP gemm's output bitwise
// (attention_bwd.cpp, pack_query_block): it asks this one rule.
template <typename T>
inline void row_dots_generic(int n, int64_t len, const T* a, int64_t lda, const T* b, int64_t ldb,
                             T* out, bool fused) {
  for (int r = 0; r < n; ++r) {
    const T* x = a + r * lda;
    const T* y = b + r * ldb;
    T tot = 0;
    if (fused) {
      const int64_t chain = gemm_chain_length(len);
      for (int64_t d0 = 0; d0 < len; d0 += chain) {
        T c = 0;
        for (int64_t d = d0; d < std::min(len, d0 + chain); ++d) c = std::fma(x[d], y[d], c);
        tot = d0 == 0 ? c : tot + c;
      }
    } else {
      for (int64_t d = 0; d < len; ++d) tot += x[d] * y[d];
    }
    out[r] = tot;
  }
}

// ---- AVX2 implementations (attention_microkernels_avx2.cpp) --------------------------

bool cpu_has_avx2_fma();  // AVX2 + FMA + F16C and not ATTN_EXT_CPU_SIMD=0 (cpu::simd_enabled)
void gemm_avx2(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row, int64_t a_col,
               const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate);
// GemmAtFn (the forward's pass 3 with the rescale fused in) on ymm registers.
void gemm_at_avx2(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_col, const float* B,
                  int64_t ldb, float* C, int64_t ldc, const float* scale);
void softmax_avx2(float* st, int64_t rows, int64_t cols, float* m, float* l, float* alpha);
void exp_sub_avx2(float* st, int64_t rows, int64_t cols, const float* sub);
void ds_avx2(const float* p, float* ds, int64_t rows, int64_t cols, const float* d);
void bias_rows_avx2(float* st, int64_t rows, int64_t n, int64_t ld, int64_t d0, float slope,
                    const float* tab, int64_t M);
// bias_rows on one query column whose keys are contiguous (x[r], r < n, at d = d0 - r: the
// decode kernel's blocks): bias_rows(x, n, 1, 1, d0, ...) 8 keys at a time, the same bits.
void bias_keys_avx2(float* x, int64_t n, int64_t d0, float slope, const float* tab, int64_t M);
// Softcap on rows [0, rows) x [0, n) of st (leading dimension ld): t = tanh(x / cap) (cpu::tanh_ps),
// x = cap * t, and t to th (same layout) when th is not null: ScoreTerms::apply_row's softcap step
// (common/attention_mask.h), 8 columns at a time.
void softcap_rows_avx2(float* st, int64_t rows, int64_t n, int64_t ld, float cap, float* th);
// One key row of attention dropout (cpu_attn::dropout_tile): for c in [0, n),
// dst[c] = ((words[c] >> shift) & 0xffff) >= thresh ? src[c] * inv_keep : 0.
void dropout_row_avx2(const float* src, float* dst, int64_t n, const uint64_t* words, int shift,
                      uint32_t thresh, float inv_keep);
// transpose_rows_generic by 8 x 8 blocks transposed in registers (the same bits).
void transpose_rows_avx2(const float* src, int64_t lds, int64_t rows, int64_t cols, float scale,
                         bool scaled, float* dst, int64_t ldd);
// n bfloat16 / float16 values (raw bits) to float.
void bf16_to_float_avx2(const uint16_t* src, int64_t n, float* dst);
void half_to_float_avx2(const uint16_t* src, int64_t n, float* dst);
// dst[i] = the float16 / bfloat16 of src[i] * mul (raw bits), round to nearest even: the bits of
// c10::Half(src[i] * mul) / c10::BFloat16(src[i] * mul) (a NaN: c10's 0x7fc0 for bfloat16, a
// quiet NaN for float16); the outputs' write-out.
void float_to_half_avx2(const float* src, float mul, int64_t n, uint16_t* dst);
void float_to_bf16_avx2(const float* src, float mul, int64_t n, uint16_t* dst);

// row_dots_generic's fused chains for up to 8 rows at once, the rows' chains interleaved (a
// single chain waits on each FMA's latency; std::fma outside an FMA target is a libm call).
void row_dots_fma_avx2(int n, int64_t len, const float* a, int64_t lda, const float* b,
                       int64_t ldb, float* out);

template <typename T>
inline void row_dots(int n, int64_t len, const T* a, int64_t lda, const T* b, int64_t ldb, T* out,
                     bool fused) {
  if constexpr (std::is_same_v<T, float>) {
    if (fused && cpu_has_avx2_fma()) return row_dots_fma_avx2(n, len, a, lda, b, ldb, out);
  }
  row_dots_generic<T>(n, len, a, lda, b, ldb, out, fused);
}

template <typename T>
inline void bias_rows(T* st, int64_t rows, int64_t n, int64_t ld, int64_t d0, T slope,
                      const T* tab, int64_t M) {
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_fma()) return bias_rows_avx2(st, rows, n, ld, d0, slope, tab, M);
  }
  bias_rows_generic<T>(st, rows, n, ld, d0, slope, tab, M);
}

template <typename T>
inline void bias_keys(T* x, int64_t n, int64_t d0, T slope, const T* tab, int64_t M) {
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_fma()) return bias_keys_avx2(x, n, d0, slope, tab, M);
  }
  bias_rows_generic<T>(x, n, 1, 1, d0, slope, tab, M);
}

template <typename T>
inline void transpose_rows(const T* src, int64_t lds, int64_t rows, int64_t cols, T scale,
                           bool scaled, T* dst, int64_t ldd) {
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_fma()) return transpose_rows_avx2(src, lds, rows, cols, scale, scaled, dst, ldd);
  }
  transpose_rows_generic<T>(src, lds, rows, cols, scale, scaled, dst, ldd);
}

// ---- the zmm kernels' lane masks (attention_microkernels_avx512.cpp, attention_bf16dp.cpp) ---
// The lanes of a 16-lane vector that hold columns [0, n): all 16 where n >= 16, else the low n
// (the last vector of a row whose length is not a multiple of 16).
constexpr uint16_t lanes16(int64_t n) {
  return n >= 16 ? uint16_t(0xFFFF) : uint16_t((1u << (n > 0 ? n : 0)) - 1u);
}
// Vector v of a row of nv vectors whose last one holds the lanes `last`.
constexpr uint16_t lanes_of(int v, int nv, uint16_t last) {
  return v == nv - 1 ? last : uint16_t(0xFFFF);
}

// ---- bf16 scores by pairwise dot products (AVX512_BF16: attention_bf16dp.cpp) ----------
// Whether vdpbf16ps may form bf16 scores: the CPU has AVX512_BF16 (and VL,
// cpu::avx512bf16_enabled) and ATTN_EXT_CPU_BF16DP=0 is not set (read on every call: the
// forward and the backward of one call must see the same value).
bool bf16dp_enabled();
// The rule of the tiled kernels and of the decode kernel (decode_scores_by_pairs in
// attention_decode.h): bf16dp_enabled() and either ATTN_EXT_CPU_BF16DP=1,
// or (by default) a CPU that is not Intel's (cpu::intel_cpu: there vdpbf16ps multiplies at
// half the fp32 zmm FMA's rate, and widening to fp32 for the zmm gemms was 1.26-1.33x faster
// on the bf16 prefill forward and backward, RESULTS.md eighteenth session; on a Zen 4 the pairs
// were 1.14-1.33x faster than widening; the decode's widened scores on zmm were 0.85-0.95x the
// pairs' time on that Xeon, nineteenth session). bf16_scores_by_pairs() is the one rule both
// tiled kernels ask. Where the tiles are on (amx_for(D)) they take precedence: the tiled
// kernels' pass 1 and the decode's scores (decode_scores_on_tiles) run on them.
bool bf16dp_tiled_enabled();
// Whether AMX tiles form the bf16 products of this depth (attention_amx.cpp): the CPU has AMX
// (cpu::amx_enabled), depth is a multiple of 32, bf16dp_enabled() (ATTN_EXT_CPU_BF16DP=0
// widens everything) and ATTN_EXT_CPU_AMX=0 is not set (read on every call, as the pairs' switch).
// amx_pv_for: the forward's pass 3 (o += p v) on tiles, Dv a multiple of 16, same switches.
bool amx_for(int64_t depth);
bool amx_pv_for(int64_t Dv);
// The switches above as one snapshot (tile_rule(): each variable read once). A kernel call
// takes every decision of its products from one TileRule, so a switch changed by another
// thread while the call sets up cannot give it a mix of layouts (say the fp16 split pack with
// pass 1 off the tiles). The free functions are the same rules on a fresh snapshot.
struct TileRule {
  bool bf16dp = false;        // bf16dp_enabled()
  bool bf16dp_tiled = false;  // bf16dp_tiled_enabled()
  bool amx = false;           // the tiles: the CPU has them, bf16dp, not ATTN_EXT_CPU_AMX=0
  bool amx_for(int64_t depth) const { return amx && depth > 0 && depth % 32 == 0; }
  bool amx_pv_for(int64_t Dv) const { return amx && Dv > 0 && Dv % 16 == 0; }
  // the one rule of both tiled kernels' bf16 pass 1 (and the backward's pass 4, on Dv)
  bool bf16_scores_by_pairs(bool is_bf16, int64_t D) const {
    return is_bf16 && D % 2 == 0 && (amx_for(D) || bf16dp_tiled);
  }
  // fp16's tiled forward runs on the tiles when both of its products can (below)
  bool fp16_on_tiles(int64_t D, int64_t Dv) const { return amx_for(D) && amx_pv_for(Dv); }
};
TileRule tile_rule();
inline bool bf16_scores_by_pairs(bool is_bf16, int64_t D) {
  return tile_rule().bf16_scores_by_pairs(is_bf16, D);
}

// qp[t * ldq + n] = the bf16 pair (row_n[2t], row_n[2t + 1]) as one 32-bit word, for rows
// n < n_rows (at row_stride elements) and pairs t < D / 2: the B operand of scores_bf16dp.
void pack_bf16_pairs(const uint16_t* rows, int64_t row_stride, int64_t n_rows, int64_t D,
                     uint32_t* qp, int64_t ldq);

// C (M, N; ldc) = scale * A (M, D) B: A's rows bf16 at lda elements, B (D / 2 pairs, N; ldb
// words) packed by pack_bf16_pairs; D even, N a multiple of 8. C(m, n) is a chain of
// vdpbf16ps over the pairs of d in order, from zero, in chains of gemm_chain_length(D)
// elements added in order, then times scale: the same bits whichever rows and columns are
// computed together (the forward's column panels, the backward's tiles).
void scores_bf16dp(int64_t M, int64_t N, int64_t D, const uint16_t* A, int64_t lda,
                   const uint32_t* B, int64_t ldb, float scale, float* C, int64_t ldc);

// ---- bf16 products on AMX tiles (attention_amx.cpp; only where amx_for / amx_pv_for) ------
// scores_bf16dp's contract on tiles: C (M, N; ldc) = scale * A (M, D) B, D a multiple of 32.
// C(m, n) is the chain of tdpbf16ps over d in steps of 32, from zero, then times scale: the same
// bits wherever (m, n) sits in the call (another order than scores_bf16dp's: the two are never
// mixed in one call).
void scores_amx(int64_t M, int64_t N, int64_t D, const uint16_t* A, int64_t lda,
                const uint32_t* B, int64_t ldb, float scale, float* C, int64_t ldc);
// The decode kernel's bf16 scores on tiles (attention_decode.h, decode_scores_on_tiles), for
// every kv head h < Hkv: s[h * s_head + c * ld + r] = scores_amx's C(r, c) with A = k's rows of
// head h (k + h * head_stride, rows row_stride apart, r < nk) and B = qp + h * qp_head (D / 2
// pair rows of 16 words, columns c < C <= 16; the rest zero): the same chains, so the backward
// recomputes them with scores_amx. 32 keys of every head at a time (memory order in a BSHD
// cache), the tiles configured once per call.
void decode_scores_amx(int64_t Hkv, int64_t nk, int64_t D, const uint16_t* k, int64_t row_stride,
                       int64_t head_stride, const uint32_t* qp, int64_t qp_head, int64_t C,
                       float scale, float* s, int64_t s_head, int64_t ld);
// out[i] = scores_amx's C(i, i) (scale 1) for i < n, B holding N >= n columns: the backward's
// row term Di = out . dout in its dP's chains.
void scores_amx_diag(int64_t n, int64_t D, const uint16_t* A, int64_t lda, const uint32_t* B,
                     int64_t ldb, int64_t N, float* out);
// vt[d * ldvt + kp] = v's bf16 pair (row 2 kp, row 2 kp + 1) of column d, for d < Dv (a multiple
// of 16) and kp < 16 * ceil(nk / 32), rows at or past nk zero; *finite: no inf / NaN among them.
void pack_vt_pairs(const uint16_t* v, int64_t row_stride, int64_t nk, int64_t Dv, uint32_t* vt,
                   int64_t ldvt, bool* finite);
// pp[kp * ldp + c] = (bf16(st row 2 kp - r_begin, c), bf16(st row 2 kp + 1 - r_begin, c)) for
// kp < rows / 2 and c < ldp (a multiple of 16): rows outside [r_begin, r_end) and columns at or
// past cols are zero; round to nearest even.
void probs_to_pairs(const float* st, int64_t ld, int64_t r_begin, int64_t r_end, int64_t rows,
                    int64_t cols, uint32_t* pp, int64_t ldp);
// ot (Dv, C16; ldo floats) += vt (Dv, kpairs words; ldvt) pp (kpairs, C16 words), kpairs a
// multiple of 16, Dv and C16 multiples of 16.
void pv_amx(int64_t Dv, int64_t C16, int64_t kpairs, const uint32_t* vt, int64_t ldvt,
            const uint32_t* pp, float* ot, int64_t ldo);

// C (M, N; ldc floats) += A (M, K) B: A's rows fp32 (lda), rounded to bf16 (columns at or past
// K read as 0), B bf16 pairs of K's rows (ceil(K / 32) * 16 pair rows of N words, ldb; rows past
// K zero: pack_row_pairs), N a multiple of 16: the backward's dv += P^T dout and dk += dS^T q.
void rows_times_pairs_amx(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                          const uint32_t* B, int64_t ldb, float* C, int64_t ldc);
// out[t * ldo + n] = (rows[2 t][n], rows[2 t + 1][n]) as one word for t < pair_rows, n < cols;
// rows at or past n_rows zero (plain C++).
void pack_row_pairs(const uint16_t* rows, int64_t stride, int64_t n_rows, int64_t cols,
                    uint32_t* out, int64_t ldo, int64_t pair_rows);

// dst = src (rows x cols words of bf16 pairs) with every inf / NaN half set to +0: the pairs a
// tile product reads where a zero factor must not meet a non-finite value (0 * inf), whose
// products the caller then adds on its own where they are visible (plain C++).
void zero_nonfinite_pairs(const uint32_t* src, int64_t rows, int64_t cols, int64_t lds,
                          uint32_t* dst, int64_t ldd);

// ---- fp16 on the bf16 tiles (the tiled kernels where amx_for(D) and amx_pv_for(Dv)) ---------
// An fp16 value x is exactly hi + lo with hi = bf16(x) (round to nearest even) and lo =
// bf16(x - hi): fp16 keeps 11 significant bits, hi 8, and the rest x - hi fits lo's 8. So a
// product x y of two fp16 values is hi_x hi_y + hi_x lo_y + lo_x hi_y + lo_x lo_y, each term
// exact in fp32; scores_amx_split takes all four in one chain (so the product is exact; with
// lo lo dropped, up to 2^-18 of each product, lse missed fp32 rounding where the products are
// large and lse small: scale 1 with a softcap; thirty-ninth session), pv_amx_split, whose
// second factor is an fp32 value split to 16 bits anyway, the first three. Non-finite x: hi =
// x, lo = 0.
// split_fp16: hi[i], lo[i] for i < n (AVX-512F; where amx_for).
void split_fp16(const uint16_t* x, int64_t n, uint16_t* hi, uint16_t* lo);
// split_fp16 of n rows of `cols` values (at `stride` elements) into hi / lo rows ld apart.
inline void split_fp16_rows(const uint16_t* x, int64_t stride, int64_t n, int64_t cols,
                            uint16_t* hi, uint16_t* lo, int64_t ld) {
  for (int64_t r = 0; r < n; ++r) split_fp16(x + r * stride, cols, hi + r * ld, lo + r * ld);
}
// The rule: fp16's tiled forward runs on the tiles when both of its products can (amx_for(D),
// amx_pv_for(Dv)); else it widens to fp32 as before. Its backward follows (attention_bwd.cpp,
// QueryPackLayout::split; dP and Di also need amx_for(Dv)).
inline bool fp16_on_tiles(int64_t D, int64_t Dv) { return tile_rule().fp16_on_tiles(D, Dv); }
// scores_amx with the split terms: C = scale * (A B + A B_lo + A_lo B + A_lo B_lo), one chain
// per element (the four stretches in that order), A / A_lo rows at the same lda, B / B_lo at the
// same ldb.
void scores_amx_split(int64_t M, int64_t N, int64_t D, const uint16_t* A, const uint16_t* A_lo,
                      int64_t lda, const uint32_t* B, const uint32_t* B_lo, int64_t ldb,
                      float scale, float* C, int64_t ldc);
// pv_amx with the split terms: ot += vt pp + vt pp_lo + vt_lo pp, one chain per element.
void pv_amx_split(int64_t Dv, int64_t C16, int64_t kpairs, const uint32_t* vt,
                  const uint32_t* vt_lo, int64_t ldvt, const uint32_t* pp, const uint32_t* pp_lo,
                  float* ot, int64_t ldo);
// The backward's products with the split terms (fp16 on the tiles): scores_amx_diag of
// scores_amx_split's sums (Di in the chains of dP); rows_times_pairs_amx with A's fp32 rows split
// into bf16 hi + lo (lo = bf16(A - hi), 0 where hi is not finite: 16 significant bits) and B's
// hi / lo pairs: C += A B + A B_lo + A_lo B.
void scores_amx_diag_split(int64_t n, int64_t D, const uint16_t* A, const uint16_t* A_lo,
                           int64_t lda, const uint32_t* B, const uint32_t* B_lo, int64_t ldb,
                           int64_t N, float* out);
void rows_times_pairs_amx_split(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                                const uint32_t* B, const uint32_t* B_lo, int64_t ldb, float* C,
                                int64_t ldc);
// probs_to_pairs' pairs of the probabilities' hi (bf16 of p) into pp_hi and of their rest
// (bf16 of p - hi; 0 where hi is not finite) into pp_lo: p = hi + lo to 16 significant bits.
void probs_to_pairs_split(const float* st, int64_t ld, int64_t r_begin, int64_t r_end,
                          int64_t rows, int64_t cols, uint32_t* pp_hi, uint32_t* pp_lo,
                          int64_t ldp);

// softmax_avx512's online step on the tile path, its probabilities written as the pairs
// pv_amx reads: st (rows, ld) holds a key tile's scores, the step runs on its ld columns (m, l,
// alpha as softmax_avx512); pair row kp of pp (ldp words, ldp >= ld a multiple of 16) gets the
// keys st rows 2 kp - r_begin and 2 kp + 1 - r_begin (zero where that row is outside [0, rows)
// and at columns past cols), kp < pair_rows; with
// pp_lo, pp gets bf16 of p and pp_lo bf16 of the rest p - that (the fp16 split), else pp
// rounds p to bf16. st keeps the fp32 probabilities (the key-by-key sums of non-finite v).
// exp2 here is exp2_tile_ps512 (vreduceps / vscalefps: 8 operations against exp2_ps512's 11,
// under 2 ulp): not exp2_ps512's bits, which the widened kernels and the backward keep. The
// max and the sum run over the keys in order, even and odd keys in two chains joined at the end.
void softmax_pairs_amx(float* st, int64_t ld, int64_t rows, int64_t cols, int64_t r_begin,
                       int64_t pair_rows, float* m, float* l, float* alpha, uint32_t* pp,
                       uint32_t* pp_lo, int64_t ldp);

// exp_sub_avx512's step (st = exp(st - sub[c]), as exp2 of (st - sub) log2(e)) with
// exp2_tile_ps512: the backward's P = exp(s - lse) where its scores are on tiles (an exponent
// of 0 gives 1 exactly; -inf, 0; NaN, NaN).
void exp_sub_amx(float* st, int64_t rows, int64_t cols, const float* sub);

// x[r * ld + c] *= alpha[c] for r < rows, c < cols (16 columns at a time, skipping those
// whose alpha are all 1): the online softmax's rescale of o^T.
void scale_cols(float* x, int64_t rows, int64_t ld, int64_t cols, const float* alpha);

// The bf16 scores of a call whose rule is bf16_scores_by_pairs: on tiles where amx (amx_for of
// the depth, taken once per call), else by vdpbf16ps.
inline void scores_pairs(bool amx, int64_t M, int64_t N, int64_t D, const uint16_t* A,
                         int64_t lda, const uint32_t* B, int64_t ldb, float scale, float* C,
                         int64_t ldc) {
  if (amx) return scores_amx(M, N, D, A, lda, B, ldb, scale, C, ldc);
  scores_bf16dp(M, N, D, A, lda, B, ldb, scale, C, ldc);
}

// ---- the fp32 kernels on zmm registers (AVX-512F: attention_microkernels_avx512.cpp) ------
// gemm_avx2 / gemm_at_avx2 with 16-float vectors and larger register tiles: every output is
// the same FMA chain, so the same bits (tools/gemm512_check.cpp); the softmax steps likewise.
// (A NaN output is NaN on both; its sign and payload may differ: the operand order.)
// Used where
// cpu::avx512_enabled() (AVX-512F/BW, not ATTN_EXT_CPU_AVX512=0) and ATTN_EXT_CPU_GEMM512=0 is
// not set (read on every call: for A/B measurements; the bits do not depend on it).
bool gemm512_enabled();
void gemm_avx512(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row, int64_t a_col,
                 const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate);
void gemm_at_avx512(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_col,
                    const float* B, int64_t ldb, float* C, int64_t ldc, const float* scale);
// softmax_avx2 / exp_sub_avx2 / ds_avx2 16 columns at a time: the same bits.
void softmax_avx512(float* st, int64_t rows, int64_t cols, float* m, float* l, float* alpha);
void exp_sub_avx512(float* st, int64_t rows, int64_t cols, const float* sub);
void ds_avx512(const float* p, float* ds, int64_t rows, int64_t cols, const float* d);

template <typename T>
inline Kernels<T> kernels() {
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_fma()) {
      if (gemm512_enabled())
        return {gemm_avx512, softmax_avx512, exp_sub_avx512, ds_avx512, gemm_at_avx512};
      return {gemm_avx2, softmax_avx2, exp_sub_avx2, ds_avx2, gemm_at_avx2};
    }
  }
  return {gemm_generic<T>, softmax_generic<T>, exp_sub_generic<T>, ds_generic<T>, nullptr};
}

// Whether k's gemm multiplies and adds in one rounding (the AVX2 and AVX-512 FMA kernels).
// Sums that must equal its outputs bitwise (the backward's row term, the exact masked
// products) follow it.
template <typename T>
inline bool gemm_fuses(const Kernels<T>& k) {
  if constexpr (std::is_same_v<T, float>) return k.gemm == &gemm_avx2 || k.gemm == &gemm_avx512;
  return false;
}

// y[0, n) += a * x[0, n) in the rounding of one step of a gemm chain: std::fma when the gemm
// fuses (gemm_fuses), else a product and an add (the generic gemm's loop). y is a chain's
// accumulator, started from zero and added to the gemm's output after (add_chain), as the
// gemms' chains are (kGemmKBlock).
template <typename T>
inline void axpy_as_gemm(T* y, T a, const T* x, int64_t n, bool fused) {
  if (fused) {
    for (int64_t d = 0; d < n; ++d) y[d] = std::fma(a, x[d], y[d]);
  } else {
    for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
  }
}

// c[0, n) += chain[0, n): the end of one gemm chain (axpy_as_gemm's accumulator).
template <typename T>
inline void add_chain(T* c, const T* chain, int64_t n) {
  for (int64_t d = 0; d < n; ++d) c[d] += chain[d];
}

}  // namespace mk
}  // namespace attn_ext
