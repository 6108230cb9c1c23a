// The accumulators and row scales of one random case of the gemm bit checks
// (tools/gemm_at_check.cpp, tools/gemm512_check.cpp): C (M, ldc) in [-10, 10], each row's scale
// |u| or exactly 1 (the rescale loop skips 1); case i % 10 == 0 puts inf and NaN in C and a
// scale of 0 on row 0, case i % 10 == 5 the scales -0, inf, NaN and a denormal on every third
// row. Draws from gen in that order.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

inline void fill_gemm_case(int i, int64_t M, int64_t ldc, std::mt19937& gen,
                           std::uniform_real_distribution<float>& uni, std::vector<float>& c0,
                           std::vector<float>& scale) {
  c0.assign(static_cast<size_t>(M * ldc), 0.f);
  scale.assign(static_cast<size_t>(M), 0.f);
  for (float& x : c0) x = 10.f * uni(gen);
  for (float& x : scale) x = gen() % 3 == 0 ? 1.f : std::fabs(uni(gen));
  if (i % 10 == 0) {  // non-finite accumulators meeting a rescale by 0 (and by 1)
    c0[0] = INFINITY;
    c0[static_cast<size_t>(M * ldc) / 2] = NAN;
    scale[0] = 0.f;
  }
  if (i % 10 == 5) {  // special scales: -0, inf, NaN, a denormal
    const float special[4] = {-0.f, INFINITY, NAN, 1e-40f};
    for (int64_t m = 0; m < M; m += 3) scale[m] = special[(m / 3) % 4];
  }
}
