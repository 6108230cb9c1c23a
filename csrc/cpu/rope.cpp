// attn_ext::rope / rope_ / rope_qk_ / _rope_backward on CPU.
//
//   x (B, S, H, D), cos/sin (S_max, half), rotary_dim = 2 * half <= D
//   half-split:  out[i] = x[i] c_i - x[i+half] s_i,  out[i+half] = x[i+half] c_i + x[i] s_i
//   interleaved: out[2i] = x[2i] c_i - x[2i+1] s_i,  out[2i+1] = x[2i+1] c_i + x[2i] s_i
//   c_i = cos[pos(b, s), i], s_i = +-sin[pos(b, s), i] (minus: _rope_backward, the inverse)
//
// Work split: torch::stable::parallel_for over the B*S (b, s) rows; one row does every head of q (and
// k), so its cos/sin row is read from memory once and then stays in L1. Inner loop: AVX2+FMA
// on 8 pairs at a time with fp32 math (fp16/bf16 widened on load, rounded to nearest even on
// store), scalar tail; a portable scalar loop elsewhere. float64 is computed in double.
// The op is a pure stream (read x once, write out once), so the goal is memory bandwidth.

#include <cstring>
#include <type_traits>

#include "common/registration.h"
#include "common/rope_args.h"
#include "cpu/simd.h"

namespace attn_ext {
namespace {

// Rotates pairs [i0, half) of one head row; out may equal x.
template <typename T, typename TT>
inline void rotate_row_scalar(const T* x, T* out, const TT* c, const TT* sn, int64_t i0,
                              int64_t half, bool interleaved, bool inverse) {
  using acc_t = opmath_t<T>;
  const acc_t sg = inverse ? acc_t(-1) : acc_t(1);
  if (interleaved) {
    for (int64_t i = i0; i < half; ++i) {
      const acc_t ci = static_cast<acc_t>(c[i]), si = sg * static_cast<acc_t>(sn[i]);
      const acc_t x1 = static_cast<acc_t>(x[2 * i]), x2 = static_cast<acc_t>(x[2 * i + 1]);
      out[2 * i] = static_cast<T>(x1 * ci - x2 * si);
      out[2 * i + 1] = static_cast<T>(x2 * ci + x1 * si);
    }
  } else {
    for (int64_t i = i0; i < half; ++i) {
      const acc_t ci = static_cast<acc_t>(c[i]), si = sg * static_cast<acc_t>(sn[i]);
      const acc_t x1 = static_cast<acc_t>(x[i]), x2 = static_cast<acc_t>(x[i + half]);
      out[i] = static_cast<T>(x1 * ci - x2 * si);
      out[i + half] = static_cast<T>(x2 * ci + x1 * si);
    }
  }
}

#if ATTN_EXT_HAVE_AVX2_PATH
// 8 pairs per step; returns the first pair index left for the scalar tail.
template <typename T, typename TT>
ATTN_EXT_AVX2 int64_t rotate_row_avx2(const T* x, T* out, const TT* c, const TT* sn,
                                      int64_t half, bool interleaved, bool inverse) {
  using IO = cpu::Avx2IO<T>;
  using TIO = cpu::Avx2IO<TT>;
  // inverse: flip the sign bit of sin (exact).
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(inverse ? int(0x80000000u) : 0));
  int64_t i = 0;
  if (interleaved) {
    for (; i + 8 <= half; i += 8) {
      const __m256 cv = TIO::load(c + i);
      const __m256 sv = _mm256_xor_ps(TIO::load(sn + i), sign);
      // Duplicate each c_i into lanes 2i, 2i+1: [c0 c0 c1 c1 c2 c2 c3 c3], [c4 c4 ... c7 c7].
      const __m256 clo = _mm256_unpacklo_ps(cv, cv), chi = _mm256_unpackhi_ps(cv, cv);
      const __m256 slo = _mm256_unpacklo_ps(sv, sv), shi = _mm256_unpackhi_ps(sv, sv);
      const __m256 c0 = _mm256_permute2f128_ps(clo, chi, 0x20);
      const __m256 c1 = _mm256_permute2f128_ps(clo, chi, 0x31);
      const __m256 s0 = _mm256_permute2f128_ps(slo, shi, 0x20);
      const __m256 s1 = _mm256_permute2f128_ps(slo, shi, 0x31);
      const __m256 xa = IO::load(x + 2 * i), xb = IO::load(x + 2 * i + 8);
      // swap within pairs: (x1, x2) -> (x2, x1); fmaddsub: even lanes a*b - c, odd a*b + c.
      const __m256 ya = _mm256_fmaddsub_ps(xa, c0, _mm256_mul_ps(_mm256_permute_ps(xa, 0xb1), s0));
      const __m256 yb = _mm256_fmaddsub_ps(xb, c1, _mm256_mul_ps(_mm256_permute_ps(xb, 0xb1), s1));
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        IO::store16(out + 2 * i, ya, yb);  // one pack + one 32-byte store for 16 outputs
      } else {
        IO::store(out + 2 * i, ya);
        IO::store(out + 2 * i + 8, yb);
      }
    }
  } else {
    for (; i + 8 <= half; i += 8) {
      const __m256 cv = TIO::load(c + i);
      const __m256 sv = _mm256_xor_ps(TIO::load(sn + i), sign);
      const __m256 x1 = IO::load(x + i), x2 = IO::load(x + half + i);
      IO::store(out + i, _mm256_fmsub_ps(x1, cv, _mm256_mul_ps(x2, sv)));
      IO::store(out + half + i, _mm256_fmadd_ps(x2, cv, _mm256_mul_ps(x1, sv)));
    }
  }
  return i;
}
#endif

template <typename T, typename TT>
constexpr bool kHasSimd = ATTN_EXT_HAVE_AVX2_PATH && !std::is_same_v<T, double> &&
                          (std::is_same_v<TT, float> || std::is_same_v<TT, T>);

template <typename T, typename TT>
void rope_kernel(const RopeParams& p) {
  const bool simd = kHasSimd<T, TT> && cpu::use_avx2();
  const int64_t half = p.half, rot = 2 * p.half;
  int64_t row_elems = 0;  // elements of one (b, s) row over all tensors
  for (int t = 0; t < p.num_tensors; ++t) row_elems += p.t[t].H * p.t[t].D;
  // ~64 KB of x per chunk at least: enough to hide the per-chunk cost, fine enough to balance.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems));
  const auto* cos_base = static_cast<const TT*>(p.cos);
  const auto* sin_base = static_cast<const TT*>(p.sin);

  torch::stable::parallel_for(0, p.B * p.S, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / p.S, s = item % p.S;
      const int64_t pos = p.positions
                              ? p.positions[b * p.pos_batch_stride + s * p.pos_row_stride]
                              : p.offset + s;
      const TT* c = cos_base + pos * p.cos_row_stride;  // (half,)
      const TT* sn = sin_base + pos * p.sin_row_stride;
      for (int t = 0; t < p.num_tensors; ++t) {
        const RopeTensorParams& tp = p.t[t];
        const T* x_row = static_cast<const T*>(tp.x) + b * tp.x_batch_stride + s * tp.x_row_stride;
        T* out_row = static_cast<T*>(tp.out) + b * tp.out_batch_stride + s * tp.out_row_stride;
        for (int64_t h = 0; h < tp.H; ++h) {
          const T* xh = x_row + h * tp.x_head_stride;  // (D,)
          T* oh = out_row + h * tp.out_head_stride;
          int64_t i0 = 0;
#if ATTN_EXT_HAVE_AVX2_PATH
          if constexpr (kHasSimd<T, TT>) {
            if (simd) i0 = rotate_row_avx2<T, TT>(xh, oh, c, sn, half, p.interleaved, p.inverse);
          }
#endif
          rotate_row_scalar<T, TT>(xh, oh, c, sn, i0, half, p.interleaved, p.inverse);
          if (oh != xh && tp.D > rot) {  // pass-through channels
            std::memcpy(oh + rot, xh + rot, (tp.D - rot) * sizeof(T));
          }
        }
      }
    }
  });
}

// Positions must index a row of the tables; checked here, before any read.
void check_positions_in_range(const RopeParams& p) {
  if (p.positions == nullptr) return;
  const int64_t nb = p.pos_batch_stride == 0 ? 1 : p.B;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t s = 0; s < p.S; ++s) {
      const int64_t v = p.positions[b * p.pos_batch_stride + s * p.pos_row_stride];
      STD_TORCH_CHECK(v >= 0 && v < p.S_max, "positions must lie in [0, cos.size(0) = ", p.S_max,
                  "), got positions[", nb > 1 ? std::to_string(b) + ", " : std::string(), s,
                  "] = ", v);
    }
  }
}

void run(const Tensor& x, const Tensor& cos, RopeParams& p) {
  check_positions_in_range(p);
  if (p.B * p.S == 0) return;
  ATTN_EXT_DISPATCH_FLOATING(x.scalar_type(), "rope", [&] {
    if (cos.scalar_type() == dtype::kFloat) {
      rope_kernel<scalar_t, float>(p);
    } else {
      rope_kernel<scalar_t, scalar_t>(p);
    }
  });
}

Tensor rope_cpu(const Tensor& x, const Tensor& cos, const Tensor& sin,
                    const OptTensor& positions, int64_t offset, bool interleaved) {
  return rope_out_of_place_with(run, x, cos, sin, positions, offset, interleaved, false);
}

Tensor rope_backward_cpu(const Tensor& grad, const Tensor& cos, const Tensor& sin,
                             const OptTensor& positions, int64_t offset,
                             bool interleaved) {
  return rope_out_of_place_with(run, grad, cos, sin, positions, offset, interleaved, true);
}

void rope_inplace_cpu(const Tensor& x, const Tensor& cos, const Tensor& sin,
                      const OptTensor& positions, int64_t offset,
                      bool interleaved) {
  rope_inplace_with(run, x, cos, sin, positions, offset, interleaved);
}

void rope_qk_inplace_cpu(const Tensor& q, const Tensor& k, const Tensor& cos,
                         const Tensor& sin, const OptTensor& positions,
                         int64_t offset, bool interleaved) {
  rope_qk_inplace_with(run, q, k, cos, sin, positions, offset, interleaved);
}

}  // namespace

ATTN_EXT_LIBRARY_IMPL(CPU, m) {
  m.impl("rope", TORCH_BOX(&rope_cpu));
  m.impl("rope_", TORCH_BOX(&rope_inplace_cpu));
  m.impl("rope_qk_", TORCH_BOX(&rope_qk_inplace_cpu));
  m.impl("_rope_backward", TORCH_BOX(&rope_backward_cpu));
}

}  // namespace attn_ext
