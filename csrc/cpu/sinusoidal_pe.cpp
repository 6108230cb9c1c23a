// attn_ext::sinusoidal_pe / sinusoidal_pe_ on CPU.
//
//   out (B, S, D) = x (B, S, D) + PE(pos(b, s), :)
//   PE(pos, 2i) = sin(pos * w_i), PE(pos, 2i+1) = cos(pos * w_i), w_i = base^(-2i/D)
//
// The encoding is computed on the fly (no table read). When all batches share positions
// (offset + s, or positions of shape (S,)), one PE row is computed per s and added to the
// B rows that use it, so the sin/cos cost is divided by B.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "common/checks.h"
#include "common/pos_enc_params.h"
#include "common/sinusoidal_adapter.h"

namespace attn_ext {
namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;

// PE row for one position into pe[0, D). acc is float for float/half/bfloat16 inputs and
// double for double. The angle pos * w_i is formed and range-reduced in double, so large
// positions keep full float accuracy after the final float sin/cos.
template <typename acc_t>
void pe_row(acc_t* pe, int64_t D, double pos, const double* inv_freq) {
  const int64_t pairs = D / 2;
  for (int64_t i = 0; i < pairs; ++i) {
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

template <typename scalar_t>
void sinusoidal_kernel(const SinusoidalParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t B = p.B, S = p.S, D = p.D;
  const int64_t pairs = (D + 1) / 2;
  std::vector<double> inv_freq(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    inv_freq[i] = std::exp(-(2.0 * static_cast<double>(i) / static_cast<double>(D)) * p.log_base);
  }
  const auto* x = static_cast<const scalar_t*>(p.x);
  auto* out = static_cast<scalar_t*>(p.out);
  const bool shared = p.positions == nullptr || p.pos_batch_stride == 0;
  // One work item is a position row: s (shared positions, all B rows) or (b, s).
  const int64_t items = shared ? S : B * S;
  const int64_t rows_per_item = shared ? B : 1;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, D * rows_per_item));

  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> pe(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b0 = shared ? 0 : item / S;
      const int64_t s = shared ? item : item % S;
      const int64_t pos = p.positions
                              ? p.positions[b0 * p.pos_batch_stride + s * p.pos_row_stride]
                              : p.offset + s;
      pe_row<acc_t>(pe.data(), D, static_cast<double>(pos), inv_freq.data());
      for (int64_t r = 0; r < rows_per_item; ++r) {
        const int64_t b = shared ? r : b0;
        const scalar_t* xr = x + b * p.x_batch_stride + s * p.x_row_stride;
        scalar_t* orow = out + b * p.out_batch_stride + s * p.out_row_stride;
        if (p.x_col_stride == 1) {
          for (int64_t d = 0; d < D; ++d) {
            orow[d] = static_cast<scalar_t>(static_cast<acc_t>(xr[d]) + pe[d]);
          }
        } else {
          for (int64_t d = 0; d < D; ++d) {
            orow[d] = static_cast<scalar_t>(static_cast<acc_t>(xr[d * p.x_col_stride]) + pe[d]);
          }
        }
      }
    }
  });
}

void run(const at::Tensor& x, const SinusoidalParams& p) {
  if (p.B * p.S * p.D == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sinusoidal_pe",
                                  [&] { sinusoidal_kernel<scalar_t>(p); });
}

at::Tensor sinusoidal_pe_cpu(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                             int64_t offset, double base) {
  check_sinusoidal_rank(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  run(x, make_sinusoidal_params(x, out, positions, offset, base));
  return out;
}

void sinusoidal_pe_inplace_cpu(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                               int64_t offset, double base) {
  check_sinusoidal_rank(x);
  check_last_dim_contiguous(x, "x (in place)");
  run(x, make_sinusoidal_params(x, x, positions, offset, base));
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("sinusoidal_pe", &sinusoidal_pe_cpu);
  m.impl("sinusoidal_pe_", &sinusoidal_pe_inplace_cpu);
}

}  // namespace attn_ext
