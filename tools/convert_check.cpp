// Bit check of mk::float_to_half_avx2 / mk::float_to_bf16_avx2 (csrc/cpu/attention_microkernels_avx2.cpp),
// the CPU kernels' write-out of fp16 / bf16 outputs and gradients (store_row in
// attention_common.h), against c10::Half(x * mul) / c10::BFloat16(x * mul), the scalar loop they
// replaced.
//
//   g++ -O2 -std=c++20 -I csrc -I "$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/include" \
//       tools/convert_check.cpp csrc/cpu/attention_microkernels_avx2.cpp csrc/cpu/cpu_features.cpp -o convert_check
//   ./convert_check [cases]
//
// Random bit patterns (every exponent: NaN, +-inf, denormals, values past fp16's range, ties of
// both roundings), with the specials among them, lengths 0-40 (whole vectors and every tail),
// times a multiplier of 1 or a random one. A NaN must give a NaN (float16: any payload; bfloat16:
// c10's 0x7fc0 exactly); every other output must match in every bit, and nothing past n may be
// written. Exits 1 on a difference, 2 without AVX2 / FMA.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "check_common.h"
#include "cpu/attention_microkernels.h"

int main(int argc, char** argv) {
  using namespace attn_ext::mk;
  const int cases = check_cases(argc, argv, 3000);
  if (cases == 0) return 2;
  std::mt19937 rng(7);
  const float specials[] = {0.f, -0.f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), 65504.f, 65520.f, 65519.99f,
                            5.96e-8f, 2.98e-8f, 1e-45f, 3.0e38f, 1.0f + 1.0f / 256, 1.0f + 3.0f / 512};
  int64_t bad = 0, checked = 0;
  for (int t = 0; t < cases; ++t) {
    const int64_t n = rng() % 41;
    std::vector<float> x(n);
    for (auto& v : x) {
      if (rng() % 8 == 0) {
        v = specials[rng() % (sizeof(specials) / sizeof(float))];
      } else {
        uint32_t u = rng();
        if (rng() % 2) u = (u & 0x807fffffu) | ((100u + rng() % 56) << 23);  // mostly in range
        std::memcpy(&v, &u, 4);
      }
    }
    const float mul = t % 2 ? 1.0f : std::ldexp(1.0f + (rng() % 1000) / 1000.0f, int(rng() % 9) - 4);
    std::vector<uint16_t> h(n + 8, 0xabcd), b(n + 8, 0xabcd);
    float_to_half_avx2(x.data(), mul, n, h.data());
    float_to_bf16_avx2(x.data(), mul, n, b.data());
    for (int64_t i = 0; i < n; ++i, ++checked) {
      const float p = x[i] * mul;
      const uint16_t want_h = c10::Half(p).x, want_b = c10::BFloat16(p).x;
      const bool h_ok = p != p ? ((h[i] & 0x7c00) == 0x7c00 && (h[i] & 0x3ff) != 0) : h[i] == want_h;
      const bool b_ok = b[i] == want_b;
      if (!h_ok || !b_ok) {
        if (bad < 10)
          std::printf("x %a * %a: half %04x want %04x, bf16 %04x want %04x\n", x[i], mul, h[i],
                      want_h, b[i], want_b);
        ++bad;
      }
    }
    for (int64_t i = n; i < n + 8; ++i) bad += (h[i] != 0xabcd) + (b[i] != 0xabcd);
  }
  std::printf("%d cases, %lld values, %lld differ in a bit\n", cases, (long long)checked, (long long)bad);
  return bad ? 1 : 0;
}
