// Decode attention on CPU: few query rows per kv head (Sq * H / Hkv <= kDecodeCols), long
// key sequences. The work is memory-bound (each K/V element is used by only a handful of
// query columns), so the kernel is organised around reading K and V exactly once:
//
//   columns  c = hh * Sq + ii: query head hkv * group + hh, row ii (all rows of every query
//            head of one kv head: GQA's heads share one read of each K/V row)
//   tasks    (b, hkv, key chunk): the keys a (b, hkv) sees are split into chunks so that
//            there are >= 4 tasks per thread (split-K); each chunk keeps its own running
//            (max, sum, unnormalised output) and a final pass merges the chunks
//   per block of kDecodeKeys keys:
//     pack    kb (nk, Dp), vb (nk, Dvp) fp32: one sequential read of each K/V row (rows of
//             a BSHD cache lie H * D elements apart, often a multiple of 4 KiB, which would
//             alias in L1 if read in place by the inner loops); the next block is prefetched
//     scores  s (C, nk) = qs (C, Dp) kb^T in log2 units (8 keys x 1 column register tiles)
//     mask    hidden (c, j) -> -inf (visibility layer), whole-hidden keys skipped in PV
//     softmax online per column: m, l, o rescale
//     PV      o (C, Dvp) += p (C, nk) vb (d-chunk outer, columns in registers)
//
// Extra memory: per thread one block of K/V and the column state; the chunk partials are
// (tasks, C, Dvp + 2) floats. ATen-free; AVX2+FMA(+F16C) only: callers check
// decode_supported() and otherwise take the tiled kernel.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/attention_params.h"
#include "cpu/attention_common.h"
#include "cpu/simd.h"

namespace attn_ext {
namespace cpu_attn {

// Query columns per kv head the decode kernel takes (group * Sq): 8 columns per register
// pass of the PV product, two passes at most.
constexpr int64_t kDecodeCols = 16;
// Keys per block: 64 keys of K and V at D = 128 fp32 are 64 KiB, in L2 and half in L1.
constexpr int64_t kDecodeKeys = 64;
// Keys per chunk at least (a chunk's fixed costs: q packing, merge).
constexpr int64_t kDecodeMinChunk = 256;

// ATTN_EXT_CPU_DECODE=0 turns the decode kernel off (read once; for benchmarks that compare
// it with the tiled kernel on the same shapes).
inline bool decode_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("ATTN_EXT_CPU_DECODE");
    return !(env != nullptr && std::strcmp(env, "0") == 0);
  }();
  return on;
}

inline bool decode_supported(const AttentionParams& p, bool is_double) {
  if (is_double || !cpu::use_avx2() || !decode_enabled()) return false;
  // score terms, sinks and dropout (issue 15) are in the tiled kernel only
  if (!p.score_terms().plain()) return false;
  if (p.Hkv <= 0 || p.D <= 0 || p.D > 512 || p.Dv > 512) return false;
  return p.Sq * (p.H / p.Hkv) <= kDecodeCols;
}

#if ATTN_EXT_HAVE_AVX2_PATH

namespace decode_detail {

// Sum of each of 8 vectors -> one vector [sum(a0), ..., sum(a7)].
ATTN_EXT_AVX2 inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4,
                                  __m256 a5, __m256 a6, __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
  const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 = [a0 a1 a2 a3 | a0 a1 a2 a3] partial sums of the low / high 128-bit lanes
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// dst[0, n) = src[0, n) as fp32, n a multiple of 8 is not required; dst has room for
// round_up(n, 8) and the tail is zero-filled.
template <typename scalar_t>
ATTN_EXT_AVX2 inline void pack_row(const scalar_t* src, int64_t n, float* dst) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(dst + d, cpu::Avx2IO<scalar_t>::load(src + d));
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  for (; d % 8 != 0; ++d) dst[d] = 0.f;
}

template <typename scalar_t>
inline void prefetch_rows(const scalar_t* base, int64_t stride, int64_t rows, int64_t n) {
  const int64_t bytes = n * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(base + r * stride);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

// s[c * ld + r] = qs[c] . kb[r] for r in [0, nk) (nk a multiple of 8 after padding rows).
ATTN_EXT_AVX2 inline void scores(const float* qs, int64_t C, int64_t Dp, const float* kb,
                                 int64_t nk8, float* s, int64_t ld) {
  for (int64_t c = 0; c < C; ++c) {
    const float* qc = qs + c * Dp;
    for (int64_t r0 = 0; r0 < nk8; r0 += 8) {
      const float* k0 = kb + r0 * Dp;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int64_t d = 0; d < Dp; d += 8) {
        const __m256 q = _mm256_loadu_ps(qc + d);
        a0 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k0 + 0 * Dp + d), a0);
        a1 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k0 + 1 * Dp + d), a1);
        a2 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k0 + 2 * Dp + d), a2);
        a3 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k0 + 3 * Dp + d), a3);
        a4 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k0 + 4 * Dp + d), a4);
        a5 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k0 + 5 * Dp + d), a5);
        a6 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k0 + 6 * Dp + d), a6);
        a7 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k0 + 7 * Dp + d), a7);
      }
      _mm256_storeu_ps(s + c * ld + r0, hsum8(a0, a1, a2, a3, a4, a5, a6, a7));
    }
  }
}

// o (C, Dvp) += p (C, nk; ld) vb (nk, Dvp), for the keys r with use[r] (others skipped, so a
// non-finite v of a hidden key never meets a 0 probability).
template <int NC>
ATTN_EXT_AVX2 inline void pv_cols(const float* p, int64_t ld, const float* vb, int64_t Dvp,
                                  const uint8_t* use, int64_t nk, float* o) {
  for (int64_t d = 0; d < Dvp; d += 8) {
    __m256 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_loadu_ps(o + c * Dvp + d);
    for (int64_t r = 0; r < nk; ++r) {
      if (!use[r]) continue;
      const __m256 vv = _mm256_loadu_ps(vb + r * Dvp + d);
      for (int c = 0; c < NC; ++c)
        acc[c] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + c * ld + r), vv, acc[c]);
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(o + c * Dvp + d, acc[c]);
  }
}

ATTN_EXT_AVX2 inline void pv(const float* p, int64_t ld, int64_t C, const float* vb,
                             int64_t Dvp, const uint8_t* use, int64_t nk, float* o) {
  for (int64_t c0 = 0; c0 < C; c0 += 8) {
    const float* pc = p + c0 * ld;
    float* oc = o + c0 * Dvp;
    switch (std::min<int64_t>(8, C - c0)) {
      case 1: pv_cols<1>(pc, ld, vb, Dvp, use, nk, oc); break;
      case 2: pv_cols<2>(pc, ld, vb, Dvp, use, nk, oc); break;
      case 3: pv_cols<3>(pc, ld, vb, Dvp, use, nk, oc); break;
      case 4: pv_cols<4>(pc, ld, vb, Dvp, use, nk, oc); break;
      case 5: pv_cols<5>(pc, ld, vb, Dvp, use, nk, oc); break;
      case 6: pv_cols<6>(pc, ld, vb, Dvp, use, nk, oc); break;
      case 7: pv_cols<7>(pc, ld, vb, Dvp, use, nk, oc); break;
      default: pv_cols<8>(pc, ld, vb, Dvp, use, nk, oc); break;
    }
  }
}

struct DecodeScratch {
  int64_t Dp, Dvp;
  AlignedVec<float> qs;   // (C, Dp): scale * log2(e) * q of every column
  AlignedVec<float> kb;   // (kDecodeKeys, Dp)
  AlignedVec<float> vb;   // (kDecodeKeys, Dvp)
  AlignedVec<float> s;    // (C, kDecodeKeys): scores, then probabilities
  AlignedVec<float> o;    // (C, Dvp)
  AlignedVec<float> m, l; // (C)
  std::vector<uint8_t> use;  // (kDecodeKeys): key seen by some column
  DecodeScratch(int64_t D, int64_t Dv)
      : Dp(round_up(D, 8)), Dvp(round_up(Dv, 8)),
        qs(static_cast<size_t>(kDecodeCols * Dp)),
        kb(static_cast<size_t>(kDecodeKeys * Dp), 0.f),
        vb(static_cast<size_t>(kDecodeKeys * Dvp), 0.f),
        s(static_cast<size_t>(kDecodeCols * kDecodeKeys)),
        o(static_cast<size_t>(kDecodeCols * Dvp)),
        m(kDecodeCols), l(kDecodeCols), use(kDecodeKeys) {}
};

// Online softmax of the block's scores s (C, nk) in place (log2 units; -inf hidden).
ATTN_EXT_AVX2 inline void block_softmax(float* s, int64_t C, int64_t nk, float* m, float* l,
                                        float* o, int64_t Dvp) {
  for (int64_t c = 0; c < C; ++c) {
    float* sc = s + c * kDecodeKeys;
    float mx = m[c];
    for (int64_t r = 0; r < nk; ++r) mx = std::max(mx, sc[r]);
    if (mx == -std::numeric_limits<float>::infinity()) {
      // nothing seen yet, unless a score is NaN (a NaN input): then the row is NaN
      bool nan = false;
      for (int64_t r = 0; r < nk; ++r) {
        nan = nan || std::isnan(sc[r]);
        sc[r] = 0.f;
      }
      if (nan) m[c] = l[c] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float alpha = std::exp2(m[c] - mx);  // m[c] = -inf -> 0
    float sum = 0.f;
    for (int64_t r = 0; r < nk; ++r) {
      const float e = std::exp2(sc[r] - mx);  // -inf -> 0
      sc[r] = e;
      sum += e;
    }
    if (alpha != 1.f) {
      float* oc = o + c * Dvp;
      const __m256 a = _mm256_set1_ps(alpha);
      for (int64_t d = 0; d < Dvp; d += 8) _mm256_storeu_ps(oc + d, _mm256_mul_ps(a, _mm256_loadu_ps(oc + d)));
    }
    l[c] = l[c] * alpha + sum;
    m[c] = mx;
  }
}

}  // namespace decode_detail

// out / lse of every (b, h, i) from keys read once per (b, kv head). decode_supported(p).
template <typename scalar_t>
void attention_decode_kernel(const AttentionParams& p) {
  using namespace decode_detail;
  const Visibility vis = p.visibility();
  const int64_t group = p.H / p.Hkv;
  const int64_t Dp = round_up(p.D, 8), Dvp = round_up(p.Dv, 8);
  const int64_t C = p.Sq * group;  // columns per (b, kv head); may be < Sq * group for a
                                   // shorter packed sequence (unused columns hidden)
  const int64_t heads = p.B * p.Hkv;

  // Keys some row of sequence b sees by the band (the same for every kv head).
  auto seq_keys = [&](const SeqInfo& s) -> Range {
    if (s.Sq <= 0) return {0, 0};
    return vis.band_keys_of_rows(s, 0, s.Sq);
  };
  int64_t max_keys = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    const Range r = seq_keys(vis.seq(b));
    max_keys = std::max(max_keys, r.hi - r.lo);
  }
  // Chunks per (b, kv head): enough tasks for every thread (4 per thread for balance), each
  // at least kDecodeMinChunk keys.
  const int64_t workers = std::max<int64_t>(1, num_threads());
  int64_t n_chunks = std::max<int64_t>(1, ceil_div(4 * workers, heads));
  n_chunks = std::min(n_chunks, std::max<int64_t>(1, max_keys / kDecodeMinChunk));
  const int64_t per_part = C * (Dvp + 2);
  std::vector<float> parts(static_cast<size_t>(heads * n_chunks * per_part));

  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const float qscale = static_cast<float>(p.score_terms().scale * kLog2e);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  parallel_tasks(heads * n_chunks, [&] { return DecodeScratch(p.D, p.Dv); },
                 [&](int64_t task, DecodeScratch& w) {
    const int64_t chunk = task % n_chunks, bh = task / n_chunks;
    const int64_t b = bh / p.Hkv, hkv = bh % p.Hkv;
    const SeqInfo sq = vis.seq(b);
    float* part = parts.data() + task * per_part;
    float* pm = part + C * Dvp;
    float* pl = pm + C;
    std::fill(part, part + C * Dvp, 0.f);
    std::fill(pm, pm + C, neg_inf);
    std::fill(pl, pl + C, 0.f);
    const Range keys = seq_keys(sq);
    const int64_t per_chunk = round_up(ceil_div(keys.hi - keys.lo, n_chunks), 8);
    const int64_t kbeg = std::min(keys.hi, keys.lo + chunk * per_chunk);
    const int64_t kend = std::min(keys.hi, kbeg + per_chunk);
    if (kbeg >= kend) return;
    const int64_t nq = sq.Sq;  // rows of this sequence (<= p.Sq)

    // qs: column c = hh * Sq + ii (rows past the sequence stay zero and hidden)
    std::fill(w.qs.begin(), w.qs.begin() + C * Dp, 0.f);
    for (int64_t hh = 0; hh < group; ++hh) {
      const int64_t h = hkv * group + hh;
      for (int64_t ii = 0; ii < nq; ++ii) {
        const scalar_t* src = q + b * p.q_batch_stride + (sq.q0 + ii) * p.q_row_stride + h * p.q_head_stride;
        float* dst = w.qs.data() + (hh * p.Sq + ii) * Dp;
        pack_row(src, p.D, dst);
        for (int64_t d = 0; d < p.D; ++d) dst[d] *= qscale;
      }
    }
    // per column: the band's key range (rows past the sequence see nothing)
    Range ck[kDecodeCols];
    bool band_full = true;  // every column sees all of [kbeg, kend) by the band
    for (int64_t c = 0; c < C; ++c) {
      const int64_t ii = c % p.Sq;
      ck[c] = ii < nq ? vis.band_keys(sq, ii) : Range{0, 0};
      band_full = band_full && ck[c].lo <= kbeg && ck[c].hi >= kend;
    }
    std::fill(w.o.begin(), w.o.begin() + C * Dvp, 0.f);
    std::fill(w.m.begin(), w.m.begin() + C, neg_inf);
    std::fill(w.l.begin(), w.l.begin() + C, 0.f);

    const scalar_t* kh = k + b * p.k_batch_stride + hkv * p.k_head_stride + sq.k0 * p.k_row_stride;
    const scalar_t* vh = v + b * p.v_batch_stride + hkv * p.v_head_stride + sq.k0 * p.v_row_stride;
    for (int64_t j0 = kbeg; j0 < kend; j0 += kDecodeKeys) {
      const int64_t nk = std::min(kDecodeKeys, kend - j0);
      const int64_t nk8 = round_up(nk, 8);
      if (j0 + kDecodeKeys < kend) {
        const int64_t nn = std::min(kDecodeKeys, kend - j0 - kDecodeKeys);
        prefetch_rows(kh + (j0 + kDecodeKeys) * p.k_row_stride, p.k_row_stride, nn, p.D);
        prefetch_rows(vh + (j0 + kDecodeKeys) * p.v_row_stride, p.v_row_stride, nn, p.Dv);
      }
      // which keys take part at all (padding), and whether the block needs masking
      int64_t n_use = 0;
      for (int64_t r = 0; r < nk; ++r) n_use += (w.use[r] = vis.key_valid(b, j0 + r) ? 1 : 0);
      if (n_use == 0) continue;
      bool masked = n_use < nk;
      for (int64_t r = 0; r < nk; ++r) {
        if (!w.use[r]) continue;
        pack_row(kh + (j0 + r) * p.k_row_stride, p.D, w.kb.data() + r * Dp);
        pack_row(vh + (j0 + r) * p.v_row_stride, p.Dv, w.vb.data() + r * Dvp);
      }
      for (int64_t r = nk; r < nk8; ++r) std::fill(w.kb.data() + r * Dp, w.kb.data() + (r + 1) * Dp, 0.f);
      scores(w.qs.data(), C, Dp, w.kb.data(), nk8, w.s.data(), kDecodeKeys);
      if (masked || !band_full) {
        for (int64_t r = 0; r < nk; ++r) {
          const int64_t j = j0 + r;
          bool any = false;
          for (int64_t c = 0; c < C; ++c) {
            const bool vis_c = w.use[r] && j >= ck[c].lo && j < ck[c].hi;
            if (!vis_c) w.s[c * kDecodeKeys + r] = neg_inf;
            any = any || vis_c;
          }
          w.use[r] = any ? 1 : 0;
        }
      }
      block_softmax(w.s.data(), C, nk, w.m.data(), w.l.data(), w.o.data(), Dvp);
      // A key hidden from some columns but seen by others has p = 0 exactly in the hidden
      // columns; a non-finite v there would give 0 * inf. Such keys (only at the band's
      // edges) go through the scalar path, which skips hidden (c, j).
      bool edge = false;
      if (!band_full) {
        for (int64_t r = 0; r < nk && !edge; ++r) {
          if (!w.use[r]) continue;
          for (int64_t c = 0; c < C; ++c)
            if (!(j0 + r >= ck[c].lo && j0 + r < ck[c].hi)) { edge = true; break; }
        }
      }
      if (!edge) {
        pv(w.s.data(), kDecodeKeys, C, w.vb.data(), Dvp, w.use.data(), nk, w.o.data());
      } else {
        for (int64_t c = 0; c < C; ++c) {
          float* oc = w.o.data() + c * Dvp;
          for (int64_t r = 0; r < nk; ++r) {
            const int64_t j = j0 + r;
            if (!w.use[r] || j < ck[c].lo || j >= ck[c].hi) continue;
            const float pr = w.s[c * kDecodeKeys + r];
            const float* vr = w.vb.data() + r * Dvp;
            for (int64_t d = 0; d < Dvp; ++d) oc[d] += pr * vr[d];
          }
        }
      }
    }
    std::copy(w.o.begin(), w.o.begin() + C * Dvp, part);
    std::copy(w.m.begin(), w.m.begin() + C, pm);
    std::copy(w.l.begin(), w.l.begin() + C, pl);
  });

  // merge the chunks of each (b, kv head) column, in chunk order (deterministic)
  auto* out = static_cast<scalar_t*>(p.out);
  auto* lse = static_cast<float*>(p.lse);
  parallel_tasks(heads, [] { return 0; }, [&](int64_t bh, int&) {
    const int64_t b = bh / p.Hkv, hkv = bh % p.Hkv;
    const SeqInfo sq = vis.seq(b);
    std::vector<float> acc(static_cast<size_t>(Dvp));
    for (int64_t c = 0; c < C; ++c) {
      const int64_t hh = c / p.Sq, ii = c % p.Sq;
      if (ii >= sq.Sq) continue;
      const int64_t h = hkv * group + hh;
      float mx = neg_inf;
      for (int64_t ch = 0; ch < n_chunks; ++ch) {
        const float* part = parts.data() + (bh * n_chunks + ch) * per_part;
        mx = std::max(mx, part[C * Dvp + c]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float l = 0.f;
      if (mx != neg_inf) {
        for (int64_t ch = 0; ch < n_chunks; ++ch) {
          const float* part = parts.data() + (bh * n_chunks + ch) * per_part;
          const float pmc = part[C * Dvp + c];
          if (pmc == neg_inf) continue;
          const float a = std::exp2(pmc - mx);
          l += a * part[C * Dvp + C + c];
          const float* oc = part + c * Dvp;
          for (int64_t d = 0; d < p.Dv; ++d) acc[d] += a * oc[d];
        }
      } else {
        // nothing seen, or a NaN max: NaN (from a NaN input) must stay NaN
        for (int64_t ch = 0; ch < n_chunks; ++ch) {
          const float* part = parts.data() + (bh * n_chunks + ch) * per_part;
          if (std::isnan(part[C * Dvp + c])) mx = part[C * Dvp + c];
        }
      }
      // l == 0: the row sees no key (out 0, lse -inf); NaN stays NaN.
      const bool seen = l != 0.f || std::isnan(mx);
      const float inv = seen ? 1.f / l : 0.f;
      scalar_t* orow = out + b * p.out_batch_stride + (sq.q0 + ii) * p.out_row_stride + h * p.out_head_stride;
      for (int64_t d = 0; d < p.Dv; ++d) orow[d] = static_cast<scalar_t>(acc[d] * inv);
      lse[b * p.lse_batch_stride + h * p.lse_head_stride + sq.q0 + ii] =
          seen ? static_cast<float>((static_cast<double>(mx) + std::log2(static_cast<double>(l))) * kLn2)
               : neg_inf;
    }
  });
}

#else
template <typename scalar_t>
void attention_decode_kernel(const AttentionParams&) {}
#endif  // ATTN_EXT_HAVE_AVX2_PATH

}  // namespace cpu_attn
}  // namespace attn_ext
