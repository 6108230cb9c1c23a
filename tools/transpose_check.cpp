// Bit check of mk::transpose_rows_avx2 (csrc/cpu/attention_microkernels_avx2.cpp), the q^T /
// dout^T packs of the CPU forward and backward, against transpose_rows_generic
// (csrc/cpu/attention_microkernels.h): dst[d * ldd + c] = src[c * lds + d] (* scale).
//
//   g++ -O2 -std=c++20 -I csrc -I "$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/include" \
//       tools/transpose_check.cpp csrc/cpu/attention_microkernels_avx2.cpp csrc/cpu/cpu_features.cpp -o transpose_check
//   ./transpose_check [cases]
//
// Random shapes (rows 0-100, cols 0-140: whole 8 x 8 blocks and both edges), strides with
// slack, scaled or not, values with NaN, +-inf, -0 and denormals among them, a scale of -0,
// inf or a denormal in some cases. The destination starts filled with a marker, so a write
// outside (rows, cols) or a missing one is caught too. Exits 1 on any element that differs in a
// bit, 2 without AVX2 / FMA.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "check_common.h"
#include "cpu/attention_microkernels.h"

int main(int argc, char** argv) {
  using namespace attn_ext::mk;
  const int cases = check_cases(argc, argv, 3000);
  if (cases == 0) return 2;
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> uni(-2.f, 2.f);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), -0.f, 1e-40f, -3e-39f};
  const float scales[] = {0.125f, 0.08838835f, 1.f, -0.f, std::numeric_limits<float>::infinity(), 1e-39f};
  int differ = 0;
  for (int i = 0; i < cases; ++i) {
    const int64_t rows = gen() % 101, cols = gen() % 141;
    const int64_t lds = cols + gen() % 9, ldd = rows + gen() % 9;
    const bool scaled = gen() % 4 != 0;
    const float scale = scales[gen() % 6];
    std::vector<float> src(static_cast<size_t>(std::max<int64_t>(rows, 1) * std::max<int64_t>(lds, 1)));
    for (auto& x : src) x = gen() % 50 == 0 ? specials[gen() % 6] : uni(gen);
    const size_t n = static_cast<size_t>(std::max<int64_t>(cols, 1) * std::max<int64_t>(ldd, 1));
    std::vector<float> want(n, 12345.f), got(n, 12345.f);
    transpose_rows_generic<float>(src.data(), lds, rows, cols, scale, scaled, want.data(), ldd);
    transpose_rows_avx2(src.data(), lds, rows, cols, scale, scaled, got.data(), ldd);
    if (std::memcmp(want.data(), got.data(), n * sizeof(float)) != 0) {
      if (++differ <= 5)
        std::printf("differs: rows %ld cols %ld lds %ld ldd %ld scaled %d scale %g\n",
                    static_cast<long>(rows), static_cast<long>(cols), static_cast<long>(lds),
                    static_cast<long>(ldd), scaled ? 1 : 0, scale);
    }
  }
  std::printf("%d cases, %d with an element that differs in a bit\n", cases, differ);
  return differ == 0 ? 0 : 1;
}
