// Accuracy of cpu::exp2_ps (csrc/cpu/simd.h), the exp of every AVX2 softmax (the tiled
// forward and backward, the decode kernel) against exp2 in double:
//
//   g++ -O2 -std=c++20 -I csrc -I "$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/include" \
//       tools/exp2_check.cpp csrc/cpu/cpu_features.cpp -o exp2_check
//   ./exp2_check [points] [stride]
//
// Prints the largest error in fp32 ulps over `points` values (default 3.2e7; half uniform on
// [-126, 0], 3/8 on [-1, 0], where the softmax's probabilities live, 1/8 on [0, 127], which
// the backward's exp(s - lse) can meet with an inconsistent lse) and checks the special
// values the kernels rely on: 2^0 = 1 exactly (a row's maximum), -inf and x < -126.5 give 0
// (masked scores), NaN stays NaN, 2^-1 = 0.5. Where the CPU has AVX-512 (cpu::avx512_enabled()),
// also checks that cpu::exp2_ps512 gives exp2_ps's bits on every stride-th of the 2^32 bit
// patterns (default 1: all of them, ~25 s; NaN against NaN of any payload), with and without
// FTZ / DAZ, and on every pattern in [-127, -126] (the zero mask's edge and the denormal
// results). Exits 1 if the error reaches 1 ulp, a special value is
// wrong or a bit differs, 2 without AVX2 / FMA.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <random>

#include "cpu/simd.h"

#if ATTN_EXT_HAVE_AVX2_PATH
namespace {

ATTN_EXT_AVX2 void exp2_of(const float* in, float* out) {
  _mm256_storeu_ps(out, attn_ext::cpu::exp2_ps(_mm256_loadu_ps(in)));
}

ATTN_EXT_AVX512 void exp2_of512(const float* in, float* out) {
  _mm512_storeu_ps(out, attn_ext::cpu::exp2_ps512(_mm512_loadu_ps(in)));
}

bool same_bits(float a, float b) {
  uint32_t ua, ub;
  std::memcpy(&ua, &a, 4);
  std::memcpy(&ub, &b, 4);
  return ua == ub || (std::isnan(a) && std::isnan(b));
}

// Patterns [lo, hi) at `stride` through exp2_ps512 and exp2_ps: how many differ.
uint64_t bits_differ(uint64_t lo, uint64_t hi, uint64_t stride, uint64_t* checked) {
  uint64_t bad = 0;
  float in[16], a[16], b[16];
  for (uint64_t u = lo; u < hi;) {
    int n = 0;
    for (; n < 16 && u < hi; ++n, u += stride) {
      const uint32_t w = static_cast<uint32_t>(u);
      std::memcpy(in + n, &w, 4);
    }
    for (int l = n; l < 16; ++l) in[l] = in[0];
    exp2_of512(in, a);
    exp2_of(in, b);
    exp2_of(in + 8, b + 8);
    for (int l = 0; l < n; ++l) {
      if (!same_bits(a[l], b[l])) {
        if (bad < 5) std::printf("differ: x = %a: exp2_ps512 %a, exp2_ps %a\n", in[l], a[l], b[l]);
        ++bad;
      }
    }
    *checked += n;
  }
  return bad;
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
  bool ok_bits = true;
  if (attn_ext::cpu::avx512_enabled()) {
    const uint64_t stride = argc > 2 ? std::max(1L, std::atol(argv[2])) : 1;
    uint64_t checked = 0, bad = 0;
    const unsigned csr = _mm_getcsr();
    for (int ftz = 0; ftz < 2; ++ftz) {
      _mm_setcsr(ftz ? (csr | 0x8040) : (csr & ~0x8040u));
      bad += bits_differ(0, uint64_t(1) << 32, stride, &checked);
      float lo = -127.f, hi = -126.f;  // the zero mask's edge, every pattern
      uint32_t ulo, uhi;
      std::memcpy(&ulo, &hi, 4);
      std::memcpy(&uhi, &lo, 4);
      bad += bits_differ(ulo, uint64_t(uhi) + 1, 1, &checked);
    }
    _mm_setcsr(csr);
    ok_bits = bad == 0;
    std::printf("exp2_ps512 against exp2_ps: %llu patterns (stride %llu, FTZ / DAZ off and on), "
                "%llu differ\n",
                static_cast<unsigned long long>(checked), static_cast<unsigned long long>(stride),
                static_cast<unsigned long long>(bad));
  } else {
    std::printf("exp2_ps512 against exp2_ps: no AVX-512, not checked\n");
  }
  return worst_ulp < 1.0 && ok_special && ok_bits ? 0 : 1;
}
#else
int main() {
  std::printf("nothing to check: no AVX2 / FMA\n");
  return 2;
}
#endif
