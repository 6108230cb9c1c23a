// Loop benchmark of the CPU decode kernel's inner products (csrc/cpu/attention_decode.h), one
// thread, data already in cache: cycles per (key, kv head) of scores() (and, for bf16 where the
// CPU has AVX512_BF16, dp_scores) and pv() (AVX2 and AVX-512 PV), against this core's FMA rate
// measured by the same program. Build and run:
//
//   make -C benchmarks/micro run
//
// It prints the commit it was built from, the compiler and the CPU flags that matter, then one
// row per case (bf16 where the CPU has AVX512_BF16: also pv_pairs, p rounded to bf16): K / V
// rows at the BSHD cache stride (Hkv x D elements) of 8-key groups, as the kernel's in-place
// blocks read them. "L1" cases hold one 8-key group of one kv head; "L2"
// cases 128 keys x Hkv heads (K or V alone 256 KiB at Hkv 8, D 128, bf16). Cycles assume the
// clock the FMA loop implies (2 FMA pipes of 8 lanes). Medians of 5 repeats.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/attention_decode.h"

#ifndef ATTN_EXT_GIT_COMMIT
#define ATTN_EXT_GIT_COMMIT "unknown"
#endif

using namespace attn_ext::cpu_attn;
using BF = c10::BFloat16;
using Clock = std::chrono::steady_clock;

template <typename F>
static double median_ns(F&& f, int reps = 5) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// 12 independent FMA chains of 8 lanes: the core's FMA rate (lane-FMAs per ns).
ATTN_EXT_AVX2 static float fma_loop(long n) {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(0.1f * i);
  const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(0.001f);
  for (long i = 0; i < n; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm256_fmadd_ps(a[j], x, y);
  }
  __m256 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
  return _mm256_cvtss_f32(s);
}

template <typename T>
static void run_case(const char* name, int64_t Hkv, int64_t C, int64_t NK, int64_t D, double ghz) {
  const int64_t rs = Hkv * D, ks = 128;
  std::vector<T> K(NK * rs), V(NK * rs);
  for (size_t i = 0; i < K.size(); ++i) {
    K[i] = T(float((i * 7) % 13) / 13.f - 0.5f);
    V[i] = T(float((i * 5) % 11) / 11.f - 0.5f);
  }
  std::vector<float> qs(Hkv * C * D, 0.01f), s(Hkv * C * ks), o1(Hkv * C * D, 0.f), o2(o1);
  for (size_t i = 0; i < s.size(); ++i) s[i] = float((i * 3) % 7) / 7.f;
  std::vector<uint8_t> use(ks, 1);
  const bool have512 = attn_ext::cpu::avx512_enabled();
  const bool have_dp = sizeof(T) == 2 && attn_ext::cpu::avx512bf16_enabled();
  std::vector<BF> qb(Hkv * C * D, BF(0.01f));
  auto pass = [&](int what, std::vector<float>& o) {
    for (int64_t r0 = 0; r0 < NK; r0 += 8)
      for (int64_t h = 0; h < Hkv; ++h) {
#if ATTN_EXT_HAVE_BF16DP_PATH
        if constexpr (sizeof(T) == 2) {
          if (what == 3) {
            decode_detail::dp_scores(qb.data() + h * C * D, D, C, K.data() + h * D + r0 * rs, rs,
                                     8, D, 1.f, s.data() + h * C * ks + r0, ks, true);
            continue;
          }
          if (what == 4) {
            decode_detail::pv_pairs(s.data() + h * C * ks + r0, ks, C,
                                    reinterpret_cast<const BF*>(V.data()) + h * D + r0 * rs, D, 8,
                                    o.data() + h * C * D, rs);
            continue;
          }
        }
#endif
        if (what == 0)
          decode_detail::scores(qs.data() + h * C * D, C, D, K.data() + h * D + r0 * rs, 8,
                                s.data() + h * C * ks + r0, ks, rs, true, have512);
        else
          decode_detail::pv(s.data() + h * C * ks + r0, ks, C, V.data() + h * D + r0 * rs, D,
                            use.data() + r0, 8, o.data() + h * C * D, rs, what == 2);
      }
  };
  // the same bits from both PV products
  pass(1, o1);
  bool same = true;
  if (have512) {
    pass(2, o2);
    same = std::memcmp(o1.data(), o2.data(), o1.size() * sizeof(float)) == 0;
  }
  const int iters = std::max<int64_t>(1, 2000000 / (NK * Hkv));
  double cyc[5] = {0, 0, 0, 0, 0};
  for (int what = 0; what < 5; ++what) {
    if ((what == 2 && !have512) || (what >= 3 && !have_dp)) continue;
    std::vector<float>& o = what == 2 ? o2 : o1;
    const double ns = median_ns([&] { for (int it = 0; it < iters; ++it) pass(what, o); });
    cyc[what] = ns / iters / (NK * Hkv) * ghz;
  }
  const double ideal = double(C) * D / 16.0;  // FMA-bound cycles of one product per key
  std::printf("| %s | %s | %ld | %ld | %ld | %.1f | %s | %.1f | %s | %s | %.0f | %s |\n", name,
              sizeof(T) == 2 ? "bf16" : "fp32", (long)Hkv, (long)C, (long)D, cyc[0],
              have_dp ? std::to_string(cyc[3]).substr(0, 5).c_str() : "-", cyc[1],
              have512 ? std::to_string(cyc[2]).substr(0, 5).c_str() : "-",
              have_dp ? std::to_string(cyc[4]).substr(0, 5).c_str() : "-", ideal,
              have512 ? (same ? "yes" : "NO") : "-");
}

int main() {
  std::printf("# commit: %s\n# torch: %s (its headers and libc10 only)\n# compiler: %s\n"
              "# threads: 1 (this program)\n", ATTN_EXT_GIT_COMMIT, ATTN_EXT_TORCH_VERSION,
              __VERSION__);
  // the buffers are allocated once, before any timing (no allocation is timed)
  const char* knobs[] = {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX"};
  std::printf("# allocator: glibc malloc (");
  for (int i = 0; i < 3; ++i) {
    const char* v = std::getenv(knobs[i]);
    std::printf("%s%s=%s", i ? ", " : "", knobs[i], v ? v : "unset");
  }
  std::printf("; buffers allocated once, before timing)\n");
  __builtin_cpu_init();
  // (__builtin_cpu_supports returns a feature's bit, not 1)
  std::printf("# cpu flags: avx2 %d fma %d avx512f %d avx512bw %d avx512bf16 %d\n",
              !!__builtin_cpu_supports("avx2"), !!__builtin_cpu_supports("fma"),
              !!__builtin_cpu_supports("avx512f"), !!__builtin_cpu_supports("avx512bw"),
              !!__builtin_cpu_supports("avx512bf16"));
  std::printf("# attn_ext: simd %d, avx512 (decode PV) %d, avx512bf16 (bf16 decode scores) %d\n",
              attn_ext::cpu::simd_enabled(), attn_ext::cpu::avx512_enabled(),
              attn_ext::cpu::avx512bf16_enabled());
  const long n = 50000000;
  const double ns = median_ns([&] { volatile float x = fma_loop(n); (void)x; }, 3);
  const double lane_fma_per_ns = n * 12.0 * 8 / ns;
  const double ghz = lane_fma_per_ns / 16.0;  // 2 pipes x 8 lanes per cycle
  std::printf("# fma loop: %.1f G lane-FMA/s = %.2f GHz at 16 lane-FMA per cycle\n\n",
              lane_fma_per_ns, ghz);
  std::printf("| case | dtype | Hkv | columns | D | scores cyc | scores dp cyc | pv AVX2 cyc | "
              "pv AVX-512 cyc | pv dp cyc | FMA-bound cyc (each) | same bits (pv) |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  run_case<BF>("L1", 1, 4, 8, 128, ghz);
  run_case<BF>("L2", 8, 4, 128, 128, ghz);
  run_case<float>("L1", 1, 4, 8, 128, ghz);
  run_case<float>("L2", 8, 4, 128, 128, ghz);
  run_case<float>("L2 MHA", 32, 1, 128, 128, ghz);
  run_case<BF>("L2", 2, 7, 128, 96, ghz);
  run_case<BF>("L2", 8, 8, 128, 64, ghz);
  return 0;
}
