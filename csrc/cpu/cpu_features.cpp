// attn_ext::cpu::simd_enabled(): the single CPU-feature detector (see cpu_features.h).
#include "cpu/cpu_features.h"

#include <cstdlib>
#include <cstring>

namespace attn_ext::cpu {

bool simd_enabled() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool ok = [] {
    const char* env = std::getenv("ATTN_EXT_CPU_SIMD");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace attn_ext::cpu
