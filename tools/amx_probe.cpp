// Cycles of one bf16 forward key tile on AMX tiles (csrc/cpu/attention_amx.cpp) and of the zmm
// softmax beside it, at D = Dv = 128, 96 keys x 96 query columns, one thread, no Python, every
// buffer 64-byte aligned as in the kernel: where the bf16 forward's time goes (benchmarks/RESULTS.md,
// twenty-first session).
//
//   g++ -O3 -std=c++20 -I csrc -I "$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/include" \
//       tools/amx_probe.cpp csrc/cpu/attention_amx.cpp csrc/cpu/attention_bf16dp.cpp \
//       csrc/cpu/attention_microkernels_avx2.cpp csrc/cpu/attention_microkernels_avx512.cpp \
//       csrc/cpu/cpu_features.cpp -o amx_probe
//   ./amx_probe [calls]
//
// Prints, per step, microseconds and cycles per call (at the GHz given by ATTN_EXT_PROBE_GHZ,
// default 2.6) against the 144 tdpbf16ps of one product at 16 cycles each (a tdpbf16ps stream ran
// at 13.6 such cycles on the 2-core Xeon); then the tile path's fused softmax
// (mk::softmax_pairs_amx, which replaces softmax_avx512 + probs_to_pairs there; timed with a copy
// of the scores, since it overwrites them) and its probabilities' largest error against 2^x in
// double at the kernel's fp32 argument. "no AMX" and exit status 2 where cpu::amx_enabled() is
// false (it also asks Linux for the tile state).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <cstdio>
#include <cstdlib>

#include "cpu/aligned_vec.h"
#include "cpu/attention_microkernels.h"
#include "cpu/cpu_features.h"

using namespace attn_ext;
using cpu_attn::AlignedVec;

int main(int argc, char** argv) {
  if (!cpu::amx_enabled() || !cpu::avx512_enabled()) {
    std::printf("no AMX\n");
    return 2;
  }
  const int calls = argc > 1 ? std::atoi(argv[1]) : 20000;
  const char* ghz_env = std::getenv("ATTN_EXT_PROBE_GHZ");
  const double ghz = ghz_env != nullptr ? std::atof(ghz_env) : 2.6;
  constexpr int64_t D = 128, nk = 96, C = 96, Sk = 4096;
  AlignedVec<uint16_t> k(Sk * D, 0x3f80);            // bf16 1.0
  AlignedVec<uint32_t> qp(D / 2 * C, 0x3f803f80u);    // pairs of 1.0
  AlignedVec<float> st(nk * C, 0.f), ot(D * C, 0.f), alpha(C, 1.f), m(C, -1e30f), l(C, 0.f),
      al(C, 0.f);
  AlignedVec<uint32_t> vt(D * Sk / 2, 0x3f803f80u), pp(80 * C, 0u);
  alpha[3] = 0.5f;  // one column group rescaled
  auto time = [&](const char* name, auto f) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) f(i);
    const double us =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls * 1e6;
    std::printf("%-34s %8.3f us  %7.0f cycles (144 tdpbf16ps at 16: %d)\n", name, us, us * ghz * 1e3,
                144 * 16);
  };
  // k's key tiles walk one head of 4096 keys (1 MiB), as the forward's do
  time("scores_amx (k walks a head)", [&](int i) {
    mk::scores_amx(nk, C, D, k.data() + (i % 42) * 96 * D, D, qp.data(), C, 0.088f, st.data(), C);
  });
  time("softmax_avx512", [&](int) { mk::softmax_avx512(st.data(), nk, C, m.data(), l.data(), al.data()); });
  time("probs_to_pairs", [&](int) { mk::probs_to_pairs(st.data(), C, 0, nk, nk, C, pp.data(), C); });
  time("scale_cols", [&](int) { mk::scale_cols(ot.data(), D, C, C, alpha.data()); });
  time("pv_amx (v^T walks a head)", [&](int i) {
    mk::pv_amx(D, C, 48, vt.data() + (i % 42) * 48, Sk / 2, pp.data(), ot.data(), C);
  });
  // the tile path's softmax, which writes p's pairs itself (replacing the two steps above)
  AlignedVec<float> st0(nk * C);
  for (int64_t i = 0; i < nk * C; ++i) st0[i] = static_cast<float>((i * 37 % 1000) / 100.0 - 5.0);
  time("softmax_pairs_amx (+ a copy of st)", [&](int) {
    std::memcpy(st.data(), st0.data(), sizeof(float) * nk * C);
    mk::softmax_pairs_amx(st.data(), C, nk, C, 0, nk / 2, m.data(), l.data(), al.data(), pp.data(),
                          nullptr, C);
  });
  // its probabilities against 2^x in double, in fp32 ulps, x the kernel's fp32 argument
  // (s - max) * log2(e) (a fresh column state); the argument's own rounding is not counted
  std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
  std::fill(l.begin(), l.end(), 0.f);
  AlignedVec<float> sx(nk * C);
  for (int64_t i = 0; i < nk * C; ++i) sx[i] = static_cast<float>(-0.013 * (i % 7919)) + 0.25f;
  std::memcpy(st.data(), sx.data(), sizeof(float) * nk * C);
  mk::softmax_pairs_amx(st.data(), C, nk, C, 0, nk / 2, m.data(), l.data(), al.data(), pp.data(),
                        nullptr, C);
  double worst = 0;
  for (int64_t r = 0; r < nk; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      volatile float diff = sx[r * C + c] - m[c];
      const float x = diff * 1.4426950408889634f;
      const double e = std::exp2(static_cast<double>(x));
      if (e < 1e-30) continue;
      const double ulp = std::ldexp(1.0, std::ilogb(e) - 23);
      worst = std::max(worst, std::abs(st[r * C + c] - e) / ulp);
    }
  }
  std::printf("softmax_pairs_amx p against 2^x in double: %.2f ulp at most\n", worst);
  return 0;
}
