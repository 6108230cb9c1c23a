// attn_ext::sinusoidal_pe / sinusoidal_pe_ on CPU.
//
//   out (B, S, D) = x (B, S, D) + PE(pos(b, s), :)
//   PE(pos, 2i) = sin(pos * w_i), PE(pos, 2i+1) = cos(pos * w_i), w_i = base^(-2i/D)
//
// The encoding is computed on the fly (no table read). When all batches share positions
// (offset + s, or positions of shape (S,)), one PE row is computed per s and added to the
// B rows that use it, so the sin/cos cost is divided by B.
//
// Speed path (AVX2+FMA, float/half/bfloat16 x): a PE row is 4 angles at a time: the angle
// pos * w_i is formed and reduced modulo pi/2 in double (a - k*pi/2 with a two-part pi/2 and
// FMA, exact enough for positions far past 1e5), then sin and cos of the reduced angle
// r in [-pi/4, pi/4] come from short minimax polynomials (fp32-accurate) and the quadrant k
// mod 4 swaps / negates them. The add x + PE is 8 lanes at a time. Together this keeps
// the op a pure memory stream. float64 x and the portable path use libm.

#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "common/registration.h"
#include "common/checks.h"
#include "common/pos_enc_params.h"
#include "common/sinusoidal_adapter.h"
#include "cpu/simd.h"

namespace attn_ext {
namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;

// PE row for one position into pe[0, D). acc is float for float/half/bfloat16 inputs and
// double for double. The angle pos * w_i is formed and range-reduced in double, so large
// positions keep full float accuracy after the final float sin/cos.
// Pairs [i0, D/2) of the PE row, and the last sin column of an odd D.
template <typename acc_t>
void pe_row_tail(acc_t* pe, int64_t D, int64_t i0, double pos, const double* inv_freq) {
  const int64_t pairs = D / 2;
  for (int64_t i = i0; i < pairs; ++i) {
    double a = pos * inv_freq[i];
    if constexpr (std::is_same_v<acc_t, double>) {
      pe[2 * i] = std::sin(a);
      pe[2 * i + 1] = std::cos(a);
    } else {
      a -= kTwoPi * std::nearbyint(a * (1.0 / kTwoPi));
      const float af = static_cast<float>(a);
      pe[2 * i] = std::sin(af);
      pe[2 * i + 1] = std::cos(af);
    }
  }
  if (D % 2) {  // odd D: the last column is a sin
    const double a = pos * inv_freq[pairs];
    pe[D - 1] = static_cast<acc_t>(std::sin(a));
  }
}

template <typename acc_t>
void pe_row(acc_t* pe, int64_t D, double pos, const double* inv_freq) {
  pe_row_tail<acc_t>(pe, D, 0, pos, inv_freq);
}

// Rows per block: PE rows are computed up to kRestart at a time, and the angle-addition
// recurrence restarts from an exact row at every position that is a multiple of kRestart.
constexpr int64_t kRestart = 16;

#if ATTN_EXT_HAVE_AVX2_PATH
// Largest |pos| for the fast row: keeps k = round(pos * w / (pi/2)) inside int32 (w <= 1).
constexpr double kFastMaxPos = 1.0e9;

// pe[0, 2*n4) for pairs [0, n4), n4 a multiple of 4: pe[2i] = sin(pos w_i), pe[2i+1] = cos.
// state_sin/state_cos (nullable): also keep the double sin/cos for pe_row_step_avx2.
ATTN_EXT_AVX2 void pe_row_avx2(float* pe, int64_t n4, double pos, const double* inv_freq,
                               double* state_sin, double* state_cos) {
  const __m256d vpos = _mm256_set1_pd(pos);
  const __m256d two_over_pi = _mm256_set1_pd(0.63661977236758134308);
  // pi/2 = kPio2Hi + kPio2Lo (kPio2Hi is the double nearest pi/2).
  const __m256d pio2_hi = _mm256_set1_pd(1.57079632679489655800e+00);
  const __m256d pio2_lo = _mm256_set1_pd(6.12323399573676603587e-17);
  // Minimax polynomials on [-pi/4, pi/4], accurate to about 1 float ulp:
  //   sin r ~ r + r^3 (s1 + r^2 (s2 + r^2 s3)),  cos r ~ 1 - r^2/2 + r^4 (c1 + r^2 (c2 + r^2 c3))
  const __m256d s1 = _mm256_set1_pd(-1.6666654611e-1), s2 = _mm256_set1_pd(8.3321608736e-3),
                s3 = _mm256_set1_pd(-1.9515295891e-4);
  const __m256d c1 = _mm256_set1_pd(4.166664568298827e-2),
                c2 = _mm256_set1_pd(-1.388731625493765e-3),
                c3 = _mm256_set1_pd(2.443315711809948e-5);
  const __m256d one = _mm256_set1_pd(1.0), mhalf = _mm256_set1_pd(-0.5);
  const __m256i i1 = _mm256_set1_epi64x(1), i2 = _mm256_set1_epi64x(2);
  for (int64_t i = 0; i < n4; i += 4) {
    const __m256d a = _mm256_mul_pd(vpos, _mm256_loadu_pd(inv_freq + i));
    const __m256d k = _mm256_round_pd(_mm256_mul_pd(a, two_over_pi),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r = _mm256_fnmadd_pd(k, pio2_hi, a);
    r = _mm256_fnmadd_pd(k, pio2_lo, r);
    const __m256d z = _mm256_mul_pd(r, r);
    __m256d sp = _mm256_fmadd_pd(z, s3, s2);
    sp = _mm256_fmadd_pd(z, sp, s1);
    const __m256d sn = _mm256_fmadd_pd(_mm256_mul_pd(z, r), sp, r);
    __m256d cp = _mm256_fmadd_pd(z, c3, c2);
    cp = _mm256_fmadd_pd(z, cp, c1);
    const __m256d cs = _mm256_fmadd_pd(_mm256_mul_pd(z, z), cp, _mm256_fmadd_pd(z, mhalf, one));
    // Quadrant q = k mod 4: sin(r + q pi/2) = (q odd ? cos r : sin r) * (q & 2 ? -1 : 1),
    //                       cos(r + q pi/2) = (q odd ? sin r : cos r) * ((q + 1) & 2 ? -1 : 1).
    const __m256i q = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(k));
    const __m256d odd = _mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_and_si256(q, i1), i1));
    const __m256d sin_sign = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_and_si256(q, i2), 62));
    const __m256d cos_sign = _mm256_castsi256_pd(
        _mm256_slli_epi64(_mm256_and_si256(_mm256_add_epi64(q, i1), i2), 62));
    const __m256d sin_a = _mm256_xor_pd(_mm256_blendv_pd(sn, cs, odd), sin_sign);
    const __m256d cos_a = _mm256_xor_pd(_mm256_blendv_pd(cs, sn, odd), cos_sign);
    // Interleave into [sin_i, cos_i, ...] floats.
    const __m128 sf = _mm256_cvtpd_ps(sin_a), cf = _mm256_cvtpd_ps(cos_a);
    _mm_storeu_ps(pe + 2 * i, _mm_unpacklo_ps(sf, cf));
    _mm_storeu_ps(pe + 2 * i + 4, _mm_unpackhi_ps(sf, cf));
    if (state_sin != nullptr) {
      _mm256_storeu_pd(state_sin + i, sin_a);
      _mm256_storeu_pd(state_cos + i, cos_a);
    }
  }
}

// The next position's row from the previous one by angle addition, in double:
//   sin((p+1) w) = sin(p w) cos w + cos(p w) sin w,  cos((p+1) w) = cos(p w) cos w - sin(p w) sin w
// 4 flops per pair instead of a range reduction and two polynomials. The caller restarts
// from an exact row every kRestart positions, so rounding cannot build up (in double, 16
// steps drift by ~1e-15, far below fp32 resolution).
ATTN_EXT_AVX2 void pe_row_step_avx2(float* pe, int64_t n4, double* state_sin, double* state_cos,
                                    const double* cos_w, const double* sin_w) {
  for (int64_t i = 0; i < n4; i += 4) {
    const __m256d sp = _mm256_loadu_pd(state_sin + i), cp = _mm256_loadu_pd(state_cos + i);
    const __m256d cw = _mm256_loadu_pd(cos_w + i), sw = _mm256_loadu_pd(sin_w + i);
    const __m256d sn = _mm256_fmadd_pd(sp, cw, _mm256_mul_pd(cp, sw));
    const __m256d cs = _mm256_fmsub_pd(cp, cw, _mm256_mul_pd(sp, sw));
    _mm256_storeu_pd(state_sin + i, sn);
    _mm256_storeu_pd(state_cos + i, cs);
    const __m128 sf = _mm256_cvtpd_ps(sn), cf = _mm256_cvtpd_ps(cs);
    _mm_storeu_ps(pe + 2 * i, _mm_unpacklo_ps(sf, cf));
    _mm_storeu_ps(pe + 2 * i + 4, _mm_unpackhi_ps(sf, cf));
  }
}

// fp16/bf16 outputs: the next row straight from the previous fp32 row, 4 pairs per step.
// The row is interleaved [s0 c0 s1 c1 ...]; rotating each pair by w_i is
//   even lanes: s cw + c sw,  odd lanes: c cw - s sw  =  fmsubadd(row, cw2, swap(row) * sw2)
// with cw2/sw2 = cos/sin(w_i) duplicated per lane pair. fp32 rounding over < kRestart steps
// stays near 1e-6, far below fp16/bf16 resolution (fp32 outputs use the double recurrence).
ATTN_EXT_AVX2 void pe_row_step_f32_avx2(float* pe, const float* prev, int64_t n4,
                                        const float* cw2, const float* sw2) {
  for (int64_t e = 0; e < 2 * n4; e += 8) {
    const __m256 v = _mm256_loadu_ps(prev + e);
    const __m256 swapped = _mm256_permute_ps(v, 0xb1);
    _mm256_storeu_ps(pe + e, _mm256_fmsubadd_ps(v, _mm256_loadu_ps(cw2 + e),
                                                _mm256_mul_ps(swapped, _mm256_loadu_ps(sw2 + e))));
  }
}

// out[0, D) = x[0, D) + pe[0, D), 8 lanes at a time; returns the first index not done.
template <typename T>
ATTN_EXT_AVX2 int64_t add_row_avx2(const T* x, T* out, const float* pe, int64_t D) {
  int64_t d = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // 16 at a time: one pack per 16
    using IO = cpu::Avx2IO<T>;
    for (; d + 16 <= D; d += 16) {
      IO::store16(out + d, _mm256_add_ps(IO::load(x + d), _mm256_loadu_ps(pe + d)),
                  _mm256_add_ps(IO::load(x + d + 8), _mm256_loadu_ps(pe + d + 8)));
    }
  }
  for (; d + 8 <= D; d += 8) {
    cpu::Avx2IO<T>::store(out + d, _mm256_add_ps(cpu::Avx2IO<T>::load(x + d), _mm256_loadu_ps(pe + d)));
  }
  return d;
}
#endif

template <typename scalar_t>
void sinusoidal_kernel(const SinusoidalParams& p) {
  using acc_t = opmath_t<scalar_t>;
  const int64_t B = p.B, S = p.S, D = p.D;
  const int64_t pairs = (D + 1) / 2;
  std::vector<double> inv_freq(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    inv_freq[i] = std::exp(-(2.0 * static_cast<double>(i) / static_cast<double>(D)) * p.log_base);
  }
  // Rotation by one position step, for the angle-addition recurrence.
  std::vector<double> cos_w(pairs), sin_w(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    cos_w[i] = std::cos(inv_freq[i]);
    sin_w[i] = std::sin(inv_freq[i]);
  }
  // fp16/bf16: step rows in fp32 (pe_row_step_f32_avx2), lanes duplicated per pair.
  constexpr bool kF32Step = !std::is_same_v<scalar_t, float> && !std::is_same_v<scalar_t, double>;
  std::vector<float> cw2(kF32Step ? 2 * pairs : 0), sw2(kF32Step ? 2 * pairs : 0);
  for (int64_t i = 0; kF32Step && i < pairs; ++i) {
    cw2[2 * i] = cw2[2 * i + 1] = static_cast<float>(cos_w[i]);
    sw2[2 * i] = sw2[2 * i + 1] = static_cast<float>(sin_w[i]);
  }
  const auto* x = static_cast<const scalar_t*>(p.x);
  auto* out = static_cast<scalar_t*>(p.out);
  const bool shared = p.positions == nullptr || p.pos_batch_stride == 0;
  // One work item is a position row: s (shared positions, all B rows) or (b, s).
  const int64_t items = shared ? S : B * S;
  const int64_t rows_per_item = shared ? B : 1;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, D * rows_per_item));

  constexpr bool kSimdType = ATTN_EXT_HAVE_AVX2_PATH && std::is_same_v<acc_t, float>;
  const bool simd = kSimdType && cpu::use_avx2();

  torch::stable::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> pe(kRestart * D + 8);
    // Consecutive positions (offset + s): angle-addition steps from the exact row at the last
    // position that is a multiple of kRestart (in the fast range), so that a row is a function
    // of its position alone, whatever the thread count or the call's first position (the
    // restarts used to be counted from each thread's first row: RESULTS.md, thirty-first
    // session). A block of rows ends at such a position; a thread's first row that is not one
    // steps there from the exact row before it (warm, at most kRestart - 1 steps).
    const bool recur = simd && p.positions == nullptr;
    std::vector<double> st_sin(recur ? pairs : 0), st_cos(recur ? pairs : 0);
    std::vector<acc_t> warm(recur ? 2 * (D + 8) : 0);
    auto phase = [](int64_t pos) { return ((pos % kRestart) + kRestart) % kRestart; };
    // Pass 1 computes the PE rows of a block of up to kRestart items into pe (kRestart x D
    // floats, L2-resident); pass 2 adds them to x batch by batch, so each batch reads one
    // contiguous run of rows (long sequential streams for the prefetchers) instead of hopping
    // across all B batches for every row.
    for (int64_t blk = begin; blk < end;) {
      const int64_t n =
          std::min<int64_t>(recur ? kRestart - phase(p.offset + blk) : kRestart, end - blk);
      // pass 1: PE rows of items blk .. blk + n
      for (int64_t j = 0; j < n; ++j) {
        const int64_t item = blk + j;
        const int64_t b0 = shared ? 0 : item / S;
        const int64_t s = shared ? item : item % S;
        const int64_t pos = p.positions
                                ? p.positions[b0 * p.pos_batch_stride + s * p.pos_row_stride]
                                : p.offset + s;
        const double dpos = static_cast<double>(pos);
        acc_t* pe_j = pe.data() + j * D;
#if ATTN_EXT_HAVE_AVX2_PATH
        if constexpr (kSimdType) {
          if (simd && std::abs(dpos) <= kFastMaxPos) {
            // Pairs [0, n4) vectorised, the rest (and an odd D's last sin) below.
            const int64_t n4 = (D / 2) / 4 * 4;
            const int64_t steps = recur ? phase(pos) : 0;  // from the exact row pos - steps
            const bool chain =
                steps > 0 && std::abs(dpos - static_cast<double>(steps)) <= kFastMaxPos;
            const bool keep = recur && !kF32Step;  // double state only for the fp32 step
            if (chain && j > 0) {  // row j - 1 (position pos - 1) is in the block buffer
              if constexpr (kF32Step) {
                pe_row_step_f32_avx2(pe_j, pe_j - D, n4, cw2.data(), sw2.data());
              } else {
                pe_row_step_avx2(pe_j, n4, st_sin.data(), st_cos.data(), cos_w.data(),
                                 sin_w.data());
              }
            } else if (chain) {  // a thread's first row: from the exact row, steps ahead
              acc_t* a = warm.data();
              acc_t* b = warm.data() + D + 8;
              pe_row_avx2(a, n4, dpos - static_cast<double>(steps), inv_freq.data(),
                          keep ? st_sin.data() : nullptr, keep ? st_cos.data() : nullptr);
              for (int64_t t = 1; t <= steps; ++t) {
                acc_t* dst = t == steps ? pe_j : b;
                if constexpr (kF32Step) {
                  pe_row_step_f32_avx2(dst, a, n4, cw2.data(), sw2.data());
                } else {
                  pe_row_step_avx2(dst, n4, st_sin.data(), st_cos.data(), cos_w.data(),
                                   sin_w.data());
                }
                std::swap(a, b);
              }
            } else {
              pe_row_avx2(pe_j, n4, dpos, inv_freq.data(), keep ? st_sin.data() : nullptr,
                          keep ? st_cos.data() : nullptr);
            }
            pe_row_tail<acc_t>(pe_j, D, n4, dpos, inv_freq.data());
          } else {
            pe_row<acc_t>(pe_j, D, dpos, inv_freq.data());
          }
        } else {
          pe_row<acc_t>(pe_j, D, dpos, inv_freq.data());
        }
#else
        pe_row<acc_t>(pe_j, D, dpos, inv_freq.data());
#endif
      }
      // pass 2: out = x + PE, batch-major over the block
      for (int64_t r = 0; r < rows_per_item; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          const int64_t item = blk + j;
          const int64_t b = shared ? r : item / S;
          const int64_t s = shared ? item : item % S;
          const acc_t* pe_j = pe.data() + j * D;
          const scalar_t* xr = x + b * p.x_batch_stride + s * p.x_row_stride;
          scalar_t* orow = out + b * p.out_batch_stride + s * p.out_row_stride;
          if (p.x_col_stride == 1) {
            int64_t d0 = 0;
#if ATTN_EXT_HAVE_AVX2_PATH
            if constexpr (kSimdType) {
              if (simd) d0 = add_row_avx2<scalar_t>(xr, orow, pe_j, D);
            }
#endif
            for (int64_t d = d0; d < D; ++d) {
              orow[d] = static_cast<scalar_t>(static_cast<acc_t>(xr[d]) + pe_j[d]);
            }
          } else {
            for (int64_t d = 0; d < D; ++d) {
              orow[d] = static_cast<scalar_t>(static_cast<acc_t>(xr[d * p.x_col_stride]) + pe_j[d]);
            }
          }
        }
      }
      blk += n;
    }
  });
}

void run(const Tensor& x, const SinusoidalParams& p) {
  if (p.B * p.S * p.D == 0) return;
  ATTN_EXT_DISPATCH_FLOATING(x.scalar_type(), "sinusoidal_pe",
                             [&] { sinusoidal_kernel<scalar_t>(p); });
}

Tensor sinusoidal_pe_cpu(const Tensor& x, const OptTensor& positions,
                             int64_t offset, double base) {
  check_sinusoidal_rank(x);
  Tensor out = sinusoidal_out_like(x);
  run(x, make_sinusoidal_params(x, out, positions, offset, base));
  return out;
}

void sinusoidal_pe_inplace_cpu(const Tensor& x, const OptTensor& positions,
                               int64_t offset, double base) {
  check_sinusoidal_rank(x);
  check_sinusoidal_inplace(x, positions);
  run(x, make_sinusoidal_params(x, x, positions, offset, base));
}

}  // namespace

ATTN_EXT_LIBRARY_IMPL(CPU, m) {
  m.impl("sinusoidal_pe", TORCH_BOX(&sinusoidal_pe_cpu));
  m.impl("sinusoidal_pe_", TORCH_BOX(&sinusoidal_pe_inplace_cpu));
}

}  // namespace attn_ext
