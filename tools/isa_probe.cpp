// Peak arithmetic rates of one core by vector ISA: whether a wider ISA than the kernels' AVX2 +
// FMA would raise the roof they are measured against (benchmarks/RESULTS.md, eighth session).
//
//   g++ -O2 -std=c++20 tools/isa_probe.cpp -o isa_probe
//   ./isa_probe [seconds per case]        (default 0.3)
//
// Cases, each as many independent accumulation chains as hide the instruction's latency:
//   fp32 FMA ymm (AVX2 + FMA)      12 chains of vfmadd231ps, 16 FLOP per instruction
//   fp32 FMA zmm (AVX-512F)        24 chains of vfmadd231ps, 32 FLOP per instruction
//   bf16 dot zmm (AVX512_BF16)     24 chains of vdpbf16ps, 64 FLOP per instruction (32 bf16
//                                  pairs multiplied and added into 16 fp32 lanes)
// A case the CPU lacks is printed as "not supported". Prints GFLOP/s (best of 3 timings) and
// checks every case's arithmetic (the fp32 chains against the same recurrence in double, the
// bf16 sums exactly; the chains start at different values): exit 1 on a mismatch, so a rate
// never comes from skipped work.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr float kMul = 0.999f, kAdd = 0.001f;  // x <- x * kMul + kAdd: converges to 1, no overflow

// The value of chain c after `iters` steps, in double (fp32 rounding per step: 1e-3 agreement;
// the fp32 chains' rounding errors stay below ulp / (1 - kMul), about 6e-5).
double expected(int c, long iters) {
  double x = c, m = kMul, a = kAdd;
  const double fixed = a / (1 - m);
  return fixed + (x - fixed) * std::pow(m, static_cast<double>(iters));
}

template <int N>
__attribute__((target("avx2,fma"))) bool fma_ymm(long iters, double* seconds) {
  __m256 acc[N];
  const __m256 m = _mm256_set1_ps(kMul), a = _mm256_set1_ps(kAdd);
  for (int i = 0; i < N; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  const auto t0 = std::chrono::steady_clock::now();
  for (long t = 0; t < iters; ++t) {
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) acc[i] = _mm256_fmadd_ps(acc[i], m, a);
  }
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  alignas(32) float out[8];
  for (int i = 0; i < N; ++i) {
    _mm256_store_ps(out, acc[i]);
    if (std::fabs(out[3] - expected(i, iters)) > 1e-3) return false;
  }
  return true;
}

template <int N>
__attribute__((target("avx512f"))) bool fma_zmm(long iters, double* seconds) {
  __m512 acc[N];
  const __m512 m = _mm512_set1_ps(kMul), a = _mm512_set1_ps(kAdd);
  for (int i = 0; i < N; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const auto t0 = std::chrono::steady_clock::now();
  for (long t = 0; t < iters; ++t) {
#pragma GCC unroll 24
    for (int i = 0; i < N; ++i) acc[i] = _mm512_fmadd_ps(acc[i], m, a);
  }
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  alignas(64) float out[16];
  for (int i = 0; i < N; ++i) {
    _mm512_store_ps(out, acc[i]);
    if (std::fabs(out[11] - expected(i, iters)) > 1e-3) return false;
  }
  return true;
}

// acc += 1 * 2^-11 + 1 * 2^-11 per lane and step: exact while acc < 2^14, i.e. for up to
// kDotMaxIters steps, so acc_i = i + iters * 2^-10 exactly.
constexpr long kDotMaxIters = 1L << 23;
template <int N>
__attribute__((target("avx512f,avx512bf16"))) bool dot_bf16_zmm(long iters, double* seconds) {
  __m512 acc[N];
  // bf16 bit patterns: 1.0 = 0x3f80, 2^-11 = 0x3a00 (so each step adds 2 * 2^-11 = 2^-10)
  const __m512bh one = (__m512bh)_mm512_set1_epi16(0x3f80);
  const __m512bh step = (__m512bh)_mm512_set1_epi16(0x3a00);
  for (int i = 0; i < N; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const auto t0 = std::chrono::steady_clock::now();
  for (long t = 0; t < iters; ++t) {
#pragma GCC unroll 24
    for (int i = 0; i < N; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], one, step);
  }
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  alignas(64) float out[16];
  for (int i = 0; i < N; ++i) {
    _mm512_store_ps(out, acc[i]);
    if (out[5] != static_cast<float>(i + iters * std::ldexp(1.0, -10))) return false;
  }
  return true;
}

// Best GFLOP/s of 3 timings of `run` (chains x FLOP per instruction per step); -1 on a wrong
// result.
template <typename F>
double rate(F run, int chains, int flop_per_instr, double budget, long max_iters = 1L << 34) {
  long iters = 1 << 16;
  double s = 0;
  while (true) {  // grow to about the time budget
    if (!run(iters, &s)) return -1;
    if (s > budget / 4 || iters * 4 > max_iters) break;
    iters *= 4;
  }
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    if (!run(iters, &s)) return -1;
    best = std::max(best, static_cast<double>(iters) * chains * flop_per_instr / s / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const double budget = argc > 1 ? std::atof(argv[1]) : 0.3;
  __builtin_cpu_init();
  bool ok = true;
  auto report = [&](const char* name, bool supported, double r) {
    if (!supported) {
      std::printf("%-30s not supported\n", name);
    } else if (r < 0) {
      std::printf("%-30s WRONG RESULT\n", name);
      ok = false;
    } else {
      std::printf("%-30s %7.1f GFLOP/s\n", name, r);
    }
  };
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  report("fp32 FMA ymm (AVX2 + FMA)", avx2, avx2 ? rate(fma_ymm<12>, 12, 16, budget) : 0);
  report("fp32 FMA zmm (AVX-512F)", avx512, avx512 ? rate(fma_zmm<24>, 24, 32, budget) : 0);
  report("bf16 dot zmm (AVX512_BF16)", bf16, bf16 ? rate(dot_bf16_zmm<24>, 24, 64, budget, kDotMaxIters) : 0);
  return ok ? 0 : 1;
}
