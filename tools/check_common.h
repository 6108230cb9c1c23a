// The common start of the tools/*_check.cpp bit checks of the AVX2 kernels.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "cpu/attention_microkernels.h"

// The number of cases to run: argv[1], else `fallback`; 0 (after saying so) where the CPU has no
// AVX2 / FMA, which the checks turn into exit status 2 (their tests skip).
inline int check_cases(int argc, char** argv, int fallback) {
  if (!attn_ext::mk::cpu_has_avx2_fma()) {
    std::printf("nothing to check: no AVX2 / FMA\n");
    return 0;
  }
  return argc > 1 ? std::atoi(argv[1]) : fallback;
}
