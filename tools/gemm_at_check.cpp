// Bit check of mk::gemm_at_avx2 (csrc/cpu/attention_microkernels_avx2.cpp), the forward's pass 3
// with the online softmax's rescale fused in, against what it replaces: `C[m][:] *= scale[m]`
// (skipped where scale[m] == 1, as attention_fwd.cpp's loop does) followed by
// gemm_avx2(M, N, K, A, 1, a_col, B, ldb, C, ldc, true).
//
//   g++ -O2 -std=c++20 -I csrc -I "$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/include" \
//       tools/gemm_at_check.cpp csrc/cpu/attention_microkernels_avx2.cpp csrc/cpu/cpu_features.cpp -o gemm_at_check
//   ./gemm_at_check [cases]
//
// Random shapes (M 1-100, N 8-144 in steps of 8, K 0-130: one chain and the blocked path past
// K = 96), strides with slack, B at 0-48 bytes past a 64-byte boundary (the packed-panel
// fallback), scale on or off with some rows at exactly 1, some cases with inf / NaN in C and a
// scale of 0, and some with scales of -0, inf, NaN and a denormal. Exits 1 on any output that differs in a bit, 2 without AVX2 / FMA.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/aligned_vec.h"
#include "check_common.h"
#include "cpu/attention_microkernels.h"
#include "gemm_case.h"

int main(int argc, char** argv) {
  using namespace attn_ext::mk;
  const int cases = check_cases(argc, argv, 3000);
  if (cases == 0) return 2;
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  int differ = 0;
  for (int i = 0; i < cases; ++i) {
    const int64_t M = 1 + gen() % 100, N = 8 * (1 + gen() % 18), K = gen() % 131;
    const int64_t a_col = M + gen() % 5, ldb = N + 4 * (gen() % 5), ldc = N + 8 * (gen() % 2);
    const int64_t b_off = 4 * (gen() % 4);  // floats past the 64-byte boundary: 0, 16, 32, 48 B
    std::vector<float> A(static_cast<size_t>(std::max<int64_t>(K, 1) * a_col)), c0, scale;
    for (float& x : A) x = uni(gen);
    fill_gemm_case(i, M, ldc, gen, uni, c0, scale);
    attn_ext::cpu_attn::AlignedVec<float> bbuf(static_cast<size_t>(std::max<int64_t>(K, 1) * ldb + b_off));
    for (float& x : bbuf) x = uni(gen);
    const float* B = bbuf.data() + b_off;
    const bool use_scale = gen() % 2 == 0;
    std::vector<float> ref = c0, got = c0;
    if (use_scale) {
      for (int64_t m = 0; m < M; ++m)
        if (scale[m] != 1.f)
          for (int64_t n = 0; n < N; ++n) ref[m * ldc + n] *= scale[m];
    }
    gemm_avx2(M, N, K, A.data(), 1, a_col, B, ldb, ref.data(), ldc, true);
    gemm_at_avx2(M, N, K, A.data(), a_col, B, ldb, got.data(), ldc, use_scale ? scale.data() : nullptr);
    if (std::memcmp(ref.data(), got.data(), ref.size() * sizeof(float)) != 0) {
      if (++differ <= 5) {
        std::printf("differs: M %ld N %ld K %ld a_col %ld ldb %ld ldc %ld B +%ld B scale %d\n",
                    static_cast<long>(M), static_cast<long>(N), static_cast<long>(K),
                    static_cast<long>(a_col), static_cast<long>(ldb), static_cast<long>(ldc),
                    static_cast<long>(4 * b_off), use_scale ? 1 : 0);
      }
    }
  }
  std::printf("%d cases, %d with an output that differs in a bit\n", cases, differ);
  return differ == 0 ? 0 : 1;
}
