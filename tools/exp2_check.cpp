// Accuracy of cpu::exp2_ps (csrc/cpu/simd.h), the exp of every AVX2 softmax (the tiled
// forward and backward, the decode kernel) against exp2 in double:
//
//   g++ -O2 -std=c++20 -I csrc -I "$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/include" \
//       tools/exp2_check.cpp csrc/cpu/cpu_features.cpp -o exp2_check
//   ./exp2_check [points]
//
// Prints the largest error in fp32 ulps over `points` values (default 3.2e7; half uniform on
// [-126, 0], 3/8 on [-1, 0], where the softmax's probabilities live, 1/8 on [0, 127], which
// the backward's exp(s - lse) can meet with an inconsistent lse) and checks the special
// values the kernels rely on: 2^0 = 1 exactly (a row's maximum), -inf and x < -126.5 give 0
// (masked scores), NaN stays NaN, 2^-1 = 0.5. Exits 1 if the error reaches 1 ulp or a special
// value is wrong, 2 without AVX2 / FMA.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "cpu/simd.h"

#if ATTN_EXT_HAVE_AVX2_PATH
namespace {

ATTN_EXT_AVX2 void exp2_of(const float* in, float* out) {
  _mm256_storeu_ps(out, attn_ext::cpu::exp2_ps(_mm256_loadu_ps(in)));
}

}  // namespace

int main(int argc, char** argv) {
  if (!attn_ext::cpu::use_avx2()) {
    std::printf("nothing to check: no AVX2 / FMA\n");
    return 2;
  }
  const long points = argc > 1 ? std::atol(argv[1]) : 32000000L;
  std::mt19937 gen(20261201);
  std::uniform_real_distribution<float> wide(-126.f, 0.f), near(-1.f, 0.f), pos(0.f, 127.f);
  double worst_ulp = 0, worst_x = 0;
  float in[8], out[8];
  for (long i = 0; i < points; i += 8) {
    for (int l = 0; l < 8; ++l) {
      const long k = (i / 8) % 8;  // 4 of 8 vectors on [-126, 0], 3 on [-1, 0], 1 on [0, 127]
      in[l] = k < 4 ? wide(gen) : (k < 7 ? near(gen) : pos(gen));
    }
    exp2_of(in, out);
    for (int l = 0; l < 8; ++l) {
      const double t = std::exp2(static_cast<double>(in[l]));
      const float tf = static_cast<float>(t);
      const double ulp = std::nextafter(tf, 1e30f) - tf;  // of the true value's binade
      const double err = std::fabs(out[l] - t) / ulp;
      if (err > worst_ulp) worst_ulp = err, worst_x = in[l];
    }
  }
  std::printf("points %ld: max error %.3f ulp (at x = %.9g)\n", points, worst_ulp, worst_x);
  const float special[8] = {0.f, -INFINITY, NAN, -126.51f, -127.f, -1000.f, -1.f, -0.f};
  exp2_of(special, out);
  const bool ok_special = out[0] == 1.f && out[1] == 0.f && std::isnan(out[2]) && out[3] == 0.f &&
                          out[4] == 0.f && out[5] == 0.f && out[6] == 0.5f && out[7] == 1.f;
  std::printf("special values: 2^0 = %g, 2^-inf = %g, 2^nan = %g, 2^-126.51 = %g, 2^-127 = %g, "
              "2^-1000 = %g, 2^-1 = %g, 2^-0 = %g: %s\n",
              out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7],
              ok_special ? "ok" : "WRONG");
  return worst_ulp < 1.0 && ok_special ? 0 : 1;
}
#else
int main() {
  std::printf("nothing to check: no AVX2 / FMA\n");
  return 2;
}
#endif
