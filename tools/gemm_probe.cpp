// Rates of the CPU attention's fp32 gemm micro-kernels (csrc/cpu/attention_microkernels_avx2.cpp,
// and attention_microkernels_avx512.cpp where the CPU has AVX-512F/BW) on the shapes the prefill
// forward and the backward give them at D = 128, one thread, no Python: where the fp32 prefill /
// training time goes (benchmarks/RESULTS.md, sixth and eighteenth sessions).
//
//   g++ -O3 -std=c++20 -I csrc -I "$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/include" \
//       tools/gemm_probe.cpp csrc/cpu/attention_microkernels_avx2.cpp \
//       csrc/cpu/attention_microkernels_avx512.cpp csrc/cpu/cpu_features.cpp -o gemm_probe
//   ./gemm_probe [reps]
//
// For each gemm pair (the AVX2 one; then the AVX-512 one, where the CPU has it and
// ATTN_EXT_CPU_GEMM512=0 is not set) prints a "== <isa>" line and GFLOP/s (best of `reps`
// timings, default 5) for
//   pass  one gemm of a (query block, key tile) pair of 96 x 96 at D = 128, operands hot
//         (the four gemm shapes, and the forward's pass 3 with the rescale: gemm_at);
//   softmax  the online softmax of one 96 x 96 score tile alone, ns per score;
//   fwd   the forward's tile pairs of one query block against NT key tiles (pass 1, online
//         softmax, pass 3 with the rescale fused in: gemm_at), NT = 2 (K / V hot) and
//         NT = 43 (K / V of S = 4096 from L3), with and without the softmax; FLOPs of the two
//         gemms counted;
//   bwd   the backward's five gemms of one query block against NT key tiles, dk / dv
//         accumulated at a row stride of 8 heads x 128 (the in-place BSHD gradients), NT = 2
//         and 43, and at NT = 43 with the dk / dv tiles or the K / V tiles held hot, or with
//         the three B operands whose rows are 512 bytes apart (k, q and dout rows) and dq at
//         ld = D + 16 (padded_ld in csrc/cpu/attention_common.h, as the backward packs them
//         since the twenty-sixth session); then each
//         of the five alone, timed inside that loop with two query blocks taking each key tile
//         in turn (as the backward's visits do), NT = 43.
// The FMA peak of this machine is 7.33 G FMA instructions / s per core = 117 GFLOP/s fp32
// (benchmarks/RESULTS.md, fifth session).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>
#include <vector>

#include "cpu/aligned_vec.h"
#include "cpu/attention_microkernels.h"

namespace {


constexpr int64_t D = 128, Q = 96, KB = 96;

// Best rate of `reps` timings of f, which does `flops` floating-point operations.
double best_gflops(int reps, double flops, const std::function<void()>& f) {
  f();  // warm-up
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, flops / s / 1e9);
  }
  return best;
}

// 64-byte aligned storage, as the kernels' scratch and torch's CPU tensors are: a std::vector of
// 2 MiB comes from mmap 16 bytes past a line boundary, and then every 16-float row of a B panel
// spans two cache lines (split loads cost the 96-key gemms about 10 % of their rate: the sixth
// session's probe numbers carry that, RESULTS.md seventh session).
using Buf = attn_ext::cpu_attn::AlignedVec<float>;

Buf filled(int64_t n, float scale) {
  Buf v(static_cast<size_t>(n));
  for (auto& x : v) x = scale * static_cast<float>(std::rand() % 100);
  return v;
}

struct GemmSet {
  const char* isa;
  attn_ext::mk::GemmFn<float> gemm;
  attn_ext::mk::GemmAtFn<float> gemm_at;
  attn_ext::mk::SoftmaxFn<float> softmax;
};

void probe(int reps, const GemmSet& set);

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 5;
  if (!attn_ext::mk::cpu_has_avx2_fma()) {
    std::printf("no AVX2 / FMA on this CPU (or ATTN_EXT_CPU_SIMD=0): nothing to measure\n");
    return 0;
  }
  probe(reps, {"avx2 (ymm)", attn_ext::mk::gemm_avx2, attn_ext::mk::gemm_at_avx2,
               attn_ext::mk::softmax_avx2});
  if (attn_ext::mk::gemm512_enabled())
    probe(reps, {"avx512 (zmm)", attn_ext::mk::gemm_avx512, attn_ext::mk::gemm_at_avx512,
                 attn_ext::mk::softmax_avx512});
  return 0;
}

namespace {

void probe(int reps, const GemmSet& set) {
  const auto gemm = set.gemm;
  const auto gemm_at = set.gemm_at;
  const auto softmax_fn = set.softmax;
  std::printf("== %s\n", set.isa);
  const int64_t NT_MAX = 43, ldkv = 8 * D;  // dk / dv rows of 8 kv heads (BSHD)
  auto K = filled(NT_MAX * KB * D, 1e-3f), V = filled(NT_MAX * KB * D, 1e-2f);
  auto dk = filled(NT_MAX * KB * ldkv, 0.f), dv = filled(NT_MAX * KB * ldkv, 0.f);
  const int64_t DP = D + 16;  // padded_ld(D) for fp32
  auto Kp = filled(NT_MAX * KB * DP, 1e-3f), qrp = filled(Q * DP, 1e-3f),
       dorp = filled(Q * DP, 1e-3f), dqp = filled(Q * DP, 0.f);
  auto qt = filled(D * Q, 1e-3f), qr = filled(Q * D, 1e-3f), dot = filled(D * Q, 1e-3f),
       dor = filled(Q * D, 1e-3f), st = filled(KB * Q, 0.f), dpt = filled(KB * Q, 1e-3f),
       dq = filled(Q * D, 0.f), o = filled(Q * D, 0.f);
  std::vector<float> m(Q), l(Q), alpha(Q);
  const double pair = 2.0 * KB * Q * D;  // FLOPs of one gemm of a pair
  const int n = 200;

  std::printf("pass (one gemm, operands hot, x%d)\n", n);
  struct Pass { const char* name; int64_t M, N, K; const float* A; int64_t ar, ac; const float* B;
                int64_t ldb; float* C; int64_t ldc; bool acc; };
  const Pass passes[] = {
      {"s = k q^T      (K = D)      ", KB, Q, D, K.data(), D, 1, qt.data(), Q, st.data(), Q, false},
      {"dv += P^T dout (K = queries)", KB, D, Q, st.data(), Q, 1, dor.data(), D, dv.data(), D, true},
      {"  same, dv rows 4 KiB apart ", KB, D, Q, st.data(), Q, 1, dor.data(), D, dv.data(), ldkv, true},
      {"dq += dS k     (K = keys)   ", Q, D, KB, dpt.data(), 1, Q, K.data(), D, dq.data(), D, true},
      {"dv += P^T dout, dout at D+16", KB, D, Q, st.data(), Q, 1, dorp.data(), DP, dv.data(), D, true},
      {"dq += dS k, k and dq at D+16", Q, D, KB, dpt.data(), 1, Q, Kp.data(), DP, dqp.data(), DP, true},
  };
  for (const Pass& c : passes) {
    const double g = best_gflops(reps, n * pair, [&] {
      for (int i = 0; i < n; ++i) gemm(c.M, c.N, c.K, c.A, c.ar, c.ac, c.B, c.ldb, c.C, c.ldc, c.acc);
    });
    std::printf("  %s %6.1f GFLOP/s\n", c.name, g);
  }
  {
    const double g = best_gflops(reps, n * pair, [&] {
      for (int i = 0; i < n; ++i) gemm_at(Q, D, KB, st.data(), Q, V.data(), D, o.data(), D, alpha.data());
    });
    std::printf("  o = alpha o + P^T v (gemm_at)  %6.1f GFLOP/s\n", g);
  }
  {
    auto sc = filled(KB * Q, 1e-2f);
    const int ns = 2000;
    const double g = best_gflops(reps, ns * double(KB * Q), [&] {
      for (int i = 0; i < ns; ++i) {
        std::fill(m.begin(), m.end(), -INFINITY);
        softmax_fn(sc.data(), KB, Q, m.data(), l.data(), alpha.data());
      }
    });
    std::printf("softmax (one 96 x 96 tile, alone): %.3f ns per score\n", 1.0 / g);
  }

  std::printf("fwd (tile pairs of one query block, 2 gemms counted)\n");
  for (int64_t NT : {int64_t(2), NT_MAX}) {
    for (bool softmax : {true, false}) {
      const int rounds = static_cast<int>(std::max<int64_t>(1, 200 / NT));
      const double g = best_gflops(reps, rounds * NT * 2 * pair, [&] {
        for (int i = 0; i < rounds; ++i) {
          std::fill(m.begin(), m.end(), -INFINITY);
          std::fill(l.begin(), l.end(), 0.f);
          std::fill(o.begin(), o.end(), 0.f);
          for (int64_t t = 0; t < NT; ++t) {
            gemm(KB, Q, D, K.data() + t * KB * D, D, 1, qt.data(), Q, st.data(), Q, false);
            if (softmax) softmax_fn(st.data(), KB, Q, m.data(), l.data(), alpha.data());
            // pass 3 as the forward's full tiles run it: the rescale of o fused in
            gemm_at(Q, D, KB, st.data(), Q, V.data() + t * KB * D, D, o.data(), D,
                         softmax ? alpha.data() : nullptr);
          }
        }
      });
      std::printf("  NT %2ld, %s %6.1f GFLOP/s\n", static_cast<long>(NT),
                  softmax ? "with softmax   " : "without softmax", g);
    }
  }

  std::printf("bwd (tile pairs of one query block, 5 gemms)\n");
  // hot: 0 none, 1 the dk / dv tiles (two tiles reused), 2 the K / V tiles; 3 none, with k, q,
  // dout and dq at ld DP
  const struct { int64_t NT; int hot; const char* name; } cases[] = {
      {2, 0, "NT  2                     "}, {NT_MAX, 0, "NT 43                     "},
      {NT_MAX, 1, "NT 43, dk / dv tiles hot  "}, {NT_MAX, 2, "NT 43, K / V tiles hot    "},
      {NT_MAX, 3, "NT 43, B operands at D+16 "}};
  for (const auto& c : cases) {
    const int rounds = static_cast<int>(std::max<int64_t>(1, 100 / c.NT));
    const double g = best_gflops(reps, rounds * c.NT * 5 * pair, [&] {
      for (int i = 0; i < rounds; ++i) {
        for (int64_t t = 0; t < c.NT; ++t) {
          const int64_t tk = c.hot == 2 ? t % 2 : t, td = c.hot == 1 ? t % 2 : t;
          const bool pad = c.hot == 3;
          const int64_t ld = pad ? DP : D;
          const float* kb = (pad ? Kp.data() : K.data()) + tk * KB * ld;
          const float* vb = V.data() + tk * KB * D;
          float* dkt = dk.data() + td * KB * ldkv;
          float* dvt = dv.data() + td * KB * ldkv;
          gemm(KB, Q, D, kb, ld, 1, qt.data(), Q, st.data(), Q, false);                  // s
          gemm(KB, D, Q, st.data(), Q, 1, pad ? dorp.data() : dor.data(), ld, dvt, ldkv,
               true);                                                                    // dv
          gemm(KB, Q, D, vb, D, 1, dot.data(), Q, dpt.data(), Q, false);                 // dP
          gemm(KB, D, Q, dpt.data(), Q, 1, pad ? qrp.data() : qr.data(), ld, dkt, ldkv,
               true);                                                                    // dk
          gemm(Q, D, KB, dpt.data(), 1, Q, kb, ld, pad ? dqp.data() : dq.data(), ld, true);  // dq
        }
      }
    });
    std::printf("  %s %6.1f GFLOP/s\n", c.name, g);
  }
  // each gemm's share of the NT 43 loop, two query blocks taking each key tile in turn
  auto qt2 = filled(D * Q, 1e-3f), dot2 = filled(D * Q, 1e-3f), qr2 = filled(Q * D, 1e-3f),
       dq2 = filled(Q * D, 0.f);
  double secs[5] = {0, 0, 0, 0, 0};
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
    for (int64_t t = 0; t < NT_MAX; ++t) {
      const float* kb = K.data() + t * KB * D;
      const float* vb = V.data() + t * KB * D;
      float* dkt = dk.data() + t * KB * ldkv;
      float* dvt = dv.data() + t * KB * ldkv;
      for (int j = 0; j < 2; ++j) {
        const float* qtj = j ? qt2.data() : qt.data();
        const float* dotj = j ? dot2.data() : dot.data();
        const float* qrj = j ? qr2.data() : qr.data();
        float* dqj = j ? dq2.data() : dq.data();
        const std::function<void()> calls[5] = {
            [&] { gemm(KB, Q, D, kb, D, 1, qtj, Q, st.data(), Q, false); },
            [&] { gemm(KB, D, Q, st.data(), Q, 1, dor.data(), D, dvt, ldkv, true); },
            [&] { gemm(KB, Q, D, vb, D, 1, dotj, Q, dpt.data(), Q, false); },
            [&] { gemm(KB, D, Q, dpt.data(), Q, 1, qrj, D, dkt, ldkv, true); },
            [&] { gemm(Q, D, KB, dpt.data(), 1, Q, kb, D, dqj, D, true); }};
        for (int g = 0; g < 5; ++g) {
          const auto t0 = std::chrono::steady_clock::now();
          calls[g]();
          if (rep > 0) secs[g] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }
      }
    }
  }
  const char* names[5] = {"s  = k q^T   ", "dv += P^T dout", "dP = v dout^T", "dk += dS^T q ",
                          "dq += dS k    "};
  std::printf("bwd, each gemm inside the NT 43 loop (two query blocks per key tile)\n");
  for (int g = 0; g < 5; ++g)
    std::printf("  %s %6.1f GFLOP/s\n", names[g], reps * NT_MAX * 2 * pair / secs[g] / 1e9);
}

}  // namespace
