// attn_ext::cpu::simd_enabled(): the single CPU-feature detector (see cpu_features.h).
#include "cpu/cpu_features.h"
#include "cpu/simd.h"

#include <cstdlib>
#include <cstring>

#if ATTN_EXT_HAVE_AMX_PATH
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace attn_ext::cpu {

bool env_is(const char* name, const char* value) {
  const char* env = std::getenv(name);
  return env != nullptr && std::strcmp(env, value) == 0;
}

bool simd_enabled() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool ok = [] {
    if (env_is("ATTN_EXT_CPU_SIMD", "0")) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return ok;
#else
  return false;
#endif
}

bool avx512_enabled() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool ok = [] {
    if (!simd_enabled()) return false;
    if (env_is("ATTN_EXT_CPU_AVX512", "0")) return false;
    __builtin_cpu_init();
    // (libgcc sets the AVX-512 bits only where the OS saves the ZMM state: XCR0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }();
  return ok;
#else
  return false;
#endif
}

bool intel_cpu() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool ok = (__builtin_cpu_init(), __builtin_cpu_is("intel") != 0);
  return ok;
#else
  return false;
#endif
}

bool avx512bf16_enabled() {
#if ATTN_EXT_HAVE_BF16DP_PATH
  static const bool ok = [] {
    if (!avx512_enabled()) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vl");
  }();
  return ok;
#else
  return false;
#endif
}

bool amx_enabled() {
#if ATTN_EXT_HAVE_AMX_PATH
  static const bool ok = [] {
    if (!avx512bf16_enabled()) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u;
    const bool avx512dq = (b >> 17) & 1u;  // (vreduceps in the tile path's softmax)
    if (!amx_bf16 || !amx_tile || !avx512dq) return false;
    unsigned lo = 0, hi = 0;
    asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3u) != 3u) return false;  // XTILECFG and XTILEDATA
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace attn_ext::cpu
