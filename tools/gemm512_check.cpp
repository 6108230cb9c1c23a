// Bit check of the AVX-512 fp32 kernels (csrc/cpu/attention_microkernels_avx512.cpp) against the
// AVX2 ones they stand in for: gemm_avx512 against gemm_avx2 and gemm_at_avx512 against
// gemm_at_avx2, on the same inputs, every element of C compared (the columns between N and ldc
// too: neither may write there); then softmax / exp_sub / ds (below). Bits are compared except
// in NaN outputs, which must be NaN in both but may differ in sign and payload (same_bits).
//
//   g++ -O2 -std=c++20 -I csrc -I "$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/include" \
//       tools/gemm512_check.cpp csrc/cpu/attention_microkernels_avx2.cpp \
//       csrc/cpu/attention_microkernels_avx512.cpp csrc/cpu/cpu_features.cpp -o gemm512_check
//   ./gemm512_check [cases]
//
// Random shapes: M 1-100, N 8-200 in steps of 8 (every panel split and a half-vector tail),
// K 0-200 (one chain, and the blocked chains past K = 96); A row-major (a_row = lda, a_col = 1,
// the score products) or transposed (a_row = 1, a_col = lda, the products over keys), strides
// with slack; B at 0-48 bytes past a 64-byte boundary and ldb not a multiple of 16 (the packed
// panels of gemm_at); accumulate or not; C with inf / NaN entries and special scales (-0, inf,
// NaN, a denormal, 0) and NaNs of several signs and payloads in some cases. Exits 1 on any
// output that differs, 2 without AVX-512
// (nothing to check).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/aligned_vec.h"
#include "cpu/attention_microkernels.h"
#include "cpu/cpu_features.h"
#include "gemm_case.h"

// a and b (n floats) hold the same bits, except that where one holds a NaN the other must hold a
// NaN of any sign and payload: which NaN an FMA or add passes on depends on its operand order,
// which the compiler picks (the AVX-512 FMAs take A's broadcast from memory as the multiplicand
// the AVX2 ones take second).
static bool same_bits(const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) {
      if (!(std::isnan(a[i]) && std::isnan(b[i]))) return false;
    } else if (std::memcmp(a + i, b + i, sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

// A quiet NaN with this sign and payload.
static float nan_with(uint32_t payload, bool negative) {
  const uint32_t bits = (negative ? 0xffc00000u : 0x7fc00000u) | (payload & 0x3fffffu);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

int main(int argc, char** argv) {
  using namespace attn_ext::mk;
  if (!cpu_has_avx2_fma() || !attn_ext::cpu::avx512_enabled()) {
    std::printf("nothing to check: no AVX-512F/BW\n");
    return 2;
  }
  const int cases = argc > 1 ? std::atoi(argv[1]) : 3000;
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  int differ_gemm = 0, differ_at = 0;
  for (int i = 0; i < cases; ++i) {
    const int64_t M = 1 + gen() % 100, N = 8 * (1 + gen() % 25), K = gen() % 201;
    const bool transposed = gen() % 2 == 0;
    const int64_t lda = (transposed ? M : std::max<int64_t>(K, 1)) + gen() % 5;
    const int64_t a_row = transposed ? 1 : lda, a_col = transposed ? lda : 1;
    const int64_t a_size = transposed ? std::max<int64_t>(K, 1) * lda : M * lda;
    const int64_t ldb = N + gen() % 9, ldc = N + 8 * (gen() % 3);
    const int64_t b_off = 4 * (gen() % 4);  // floats past the 64-byte boundary: 0, 16, 32, 48 B
    const bool accumulate = gen() % 2 == 0;
    std::vector<float> A(static_cast<size_t>(a_size)), c0, scale;
    for (float& x : A) x = uni(gen);
    fill_gemm_case(i, M, ldc, gen, uni, c0, scale);
    if (i % 10 == 5) {  // non-finite inputs too, NaNs of several signs and payloads
      A[A.size() / 3] = nan_with(1, false);
      A[A.size() / 2] = INFINITY;
      A[A.size() / 5] = nan_with(7, true);
      c0[c0.size() / 3] = nan_with(3, false);
    }
    attn_ext::cpu_attn::AlignedVec<float> bbuf(static_cast<size_t>(std::max<int64_t>(K, 1) * ldb + b_off));
    for (float& x : bbuf) x = uni(gen);
    if (i % 10 == 5) bbuf[bbuf.size() / 2] = nan_with(2, false);
    const float* B = bbuf.data() + b_off;
    std::vector<float> ref = c0, got = c0;
    gemm_avx2(M, N, K, A.data(), a_row, a_col, B, ldb, ref.data(), ldc, accumulate);
    gemm_avx512(M, N, K, A.data(), a_row, a_col, B, ldb, got.data(), ldc, accumulate);
    if (!same_bits(ref.data(), got.data(), ref.size()) && ++differ_gemm <= 5) {
      std::printf("gemm differs: M %ld N %ld K %ld a_row %ld a_col %ld ldb %ld ldc %ld acc %d\n",
                  static_cast<long>(M), static_cast<long>(N), static_cast<long>(K),
                  static_cast<long>(a_row), static_cast<long>(a_col), static_cast<long>(ldb),
                  static_cast<long>(ldc), accumulate ? 1 : 0);
    }
    // gemm_at: A transposed (A(m, t) = A[m + t * a_col]) with a_col >= M
    const int64_t at_col = M + gen() % 5;
    std::vector<float> At(static_cast<size_t>(std::max<int64_t>(K, 1) * at_col));
    for (float& x : At) x = uni(gen);
    const bool use_scale = gen() % 2 == 0;
    ref = c0;
    got = c0;
    gemm_at_avx2(M, N, K, At.data(), at_col, B, ldb, ref.data(), ldc, use_scale ? scale.data() : nullptr);
    gemm_at_avx512(M, N, K, At.data(), at_col, B, ldb, got.data(), ldc, use_scale ? scale.data() : nullptr);
    if (!same_bits(ref.data(), got.data(), ref.size()) && ++differ_at <= 5) {
      std::printf("gemm_at differs: M %ld N %ld K %ld a_col %ld ldb %ld ldc %ld B +%ld B scale %d\n",
                  static_cast<long>(M), static_cast<long>(N), static_cast<long>(K),
                  static_cast<long>(at_col), static_cast<long>(ldb), static_cast<long>(ldc),
                  static_cast<long>(4 * b_off), use_scale ? 1 : 0);
    }
  }
  // The softmax steps: softmax_avx512 / exp_sub_avx512 / ds_avx512 against the AVX2 ones on
  // score tiles with -inf (masked) entries, whole -inf columns, NaN, large and tiny values,
  // running maxima at -inf or finite, every 8-column width.
  int differ_softmax = 0;
  for (int i = 0; i < cases; ++i) {
    const int64_t rows = 1 + gen() % 100, cols = 8 * (1 + gen() % 25);
    std::vector<float> st(static_cast<size_t>(rows * cols)), m(static_cast<size_t>(cols)),
        l(static_cast<size_t>(cols)), sub(static_cast<size_t>(cols)), dd(static_cast<size_t>(cols)),
        p(static_cast<size_t>(rows * cols));
    const float spread = i % 3 == 0 ? 200.f : 8.f;
    for (float& x : st) x = gen() % 7 == 0 ? -INFINITY : spread * uni(gen);
    for (float& x : p) x = std::fabs(uni(gen));
    for (int64_t c = 0; c < cols; ++c) {
      m[c] = gen() % 3 == 0 ? -INFINITY : spread * uni(gen);
      l[c] = m[c] == -INFINITY ? 0.f : 1.f + std::fabs(uni(gen));
      sub[c] = spread * uni(gen);
      dd[c] = uni(gen);
    }
    if (i % 5 == 0) {  // a column hidden everywhere, NaN scores, a NaN row term
      for (int64_t r = 0; r < rows; ++r) st[r * cols + cols - 1] = -INFINITY;
      st[static_cast<size_t>(rows * cols) / 2] = nan_with(1, false);
      st[static_cast<size_t>(rows * cols) / 3] = nan_with(2, true);
      dd[0] = NAN;
    }
    std::vector<float> st2 = st, m2 = m, l2 = l, a1(static_cast<size_t>(cols)), a2 = a1;
    softmax_avx2(st.data(), rows, cols, m.data(), l.data(), a1.data());
    softmax_avx512(st2.data(), rows, cols, m2.data(), l2.data(), a2.data());
    bool same = same_bits(st.data(), st2.data(), st.size()) && same_bits(m.data(), m2.data(), m.size()) &&
                same_bits(l.data(), l2.data(), l.size()) && same_bits(a1.data(), a2.data(), a1.size());
    std::vector<float> e1 = p, e2 = p;
    exp_sub_avx2(e1.data(), rows, cols, sub.data());
    exp_sub_avx512(e2.data(), rows, cols, sub.data());
    same = same && same_bits(e1.data(), e2.data(), e1.size());
    std::vector<float> d1 = st, d2 = st;  // dS from dP = the probabilities above
    ds_avx2(p.data(), d1.data(), rows, cols, dd.data());
    ds_avx512(p.data(), d2.data(), rows, cols, dd.data());
    same = same && same_bits(d1.data(), d2.data(), d1.size());
    if (!same && ++differ_softmax <= 5)
      std::printf("softmax steps differ: rows %ld cols %ld\n", static_cast<long>(rows), static_cast<long>(cols));
  }
  std::printf("%d cases, %d gemm and %d gemm_at outputs that differ in a bit\n", cases,
              differ_gemm, differ_at);
  std::printf("%d cases, %d softmax / exp_sub / ds outputs that differ in a bit\n", cases,
              differ_softmax);
  return differ_gemm == 0 && differ_at == 0 && differ_softmax == 0 ? 0 : 1;
}
