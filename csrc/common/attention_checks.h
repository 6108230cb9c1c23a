// Input checks and params filling of the attention ops, shared by the CPU and CUDA adapters.
// Every failure names the argument, what was expected and what was given (DESIGN.md, "Errors").
#pragma once

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "common/attention_params.h"
#include "common/checks.h"

namespace attn_ext {

// Last dim contiguous (stride 1); empty tensors (any strides) are accepted.
inline void check_row_contiguous(const Tensor& t, const char* name) {
  if (t.numel() > 0) check_last_dim_contiguous(t, name);
}

struct AttentionShape {
  int64_t B, Sq, Sk, H, Hkv, D, Dv;
};

inline AttentionShape check_attention_inputs(const Tensor& q, const Tensor& k,
                                             const Tensor& v,
                                             const std::optional<double>& scale) {
  check_dim(q, "q", 4, "(B, Sq, H, D)");
  check_dim(k, "k", 4, "(B, Sk, Hkv, D)");
  check_dim(v, "v", 4, "(B, Sk, Hkv, Dv)");
  check_floating(q, "q");
  STD_TORCH_CHECK(k.scalar_type() == q.scalar_type(), "k must have the same dtype as q (",
              q.scalar_type(), "), got ", k.scalar_type());
  STD_TORCH_CHECK(v.scalar_type() == q.scalar_type(), "v must have the same dtype as q (",
              q.scalar_type(), "), got ", v.scalar_type());
  check_same_device(k, q, "k", "q");
  check_same_device(v, q, "v", "q");
  AttentionShape s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  STD_TORCH_CHECK(k.size(0) == s.B, "k must have batch size B = ", s.B, " (from q), got shape ",
              shape_of(k));
  STD_TORCH_CHECK(v.size(0) == s.B, "v must have batch size B = ", s.B, " (from q), got shape ",
              shape_of(v));
  STD_TORCH_CHECK(k.size(3) == s.D, "k must have head dim D = ", s.D, " (from q), got shape ",
              shape_of(k));
  STD_TORCH_CHECK(v.size(1) == s.Sk, "v must have Sk = ", s.Sk, " keys (from k), got shape ",
              shape_of(v));
  STD_TORCH_CHECK(v.size(2) == s.Hkv, "v must have Hkv = ", s.Hkv, " heads (from k), got shape ",
              shape_of(v));
  STD_TORCH_CHECK((s.Hkv > 0 && s.H % s.Hkv == 0) || (s.Hkv == 0 && s.H == 0),
              "k's number of heads Hkv = ", s.Hkv, " must divide q's number of heads H = ", s.H,
              " (GQA/MQA), got k shape ", shape_of(k), " and q shape ", shape_of(q));
  check_row_contiguous(q, "q");
  check_row_contiguous(k, "k");
  check_row_contiguous(v, "v");
  if (scale.has_value()) {
    STD_TORCH_CHECK(std::isfinite(*scale), "scale must be finite, got ", *scale);
    // Below float64 the kernels fold the scale into float32 q (the CUDA ones in base-2 units,
    // scale * log2 e): past float's range it was inf there, and every output NaN. Half of
    // float's maximum keeps both finite (as softcap's bound, score_checks.h).
    const double max_scale = static_cast<double>(std::numeric_limits<float>::max()) / 2;
    STD_TORCH_CHECK(q.scalar_type() == dtype::kDouble || std::abs(*scale) <= max_scale,
                    "scale must be at most half of float32's largest value (", max_scale,
                    ") in magnitude for ", q.scalar_type(),
                    " inputs (the kernels scale float32 q), got ", *scale);
  }
  return s;
}

// The dtype of lse: float32, or float64 for float64 inputs (gradcheck needs its precision).
inline ScalarType lse_dtype(ScalarType input) {
  return input == dtype::kDouble ? dtype::kDouble : dtype::kFloat;
}

inline void check_attention_bwd_inputs(const Tensor& dout, const Tensor& out,
                                       const Tensor& lse, const Tensor& q,
                                       const AttentionShape& s) {
  check_dim(dout, "dout", 4, "(B, Sq, H, Dv)");
  check_dim(out, "out", 4, "(B, Sq, H, Dv)");
  check_dim(lse, "lse", 3, "(B, H, Sq)");
  const std::vector<int64_t> o_shape{s.B, s.Sq, s.H, s.Dv};
  STD_TORCH_CHECK(same_sizes(dout, o_shape), "dout must have shape ",
              IntList{o_shape}, " (B, Sq, H, Dv), got ", shape_of(dout));
  STD_TORCH_CHECK(same_sizes(out, o_shape), "out must have shape ",
              IntList{o_shape}, " (B, Sq, H, Dv), got ", shape_of(out));
  const std::vector<int64_t> l_shape{s.B, s.H, s.Sq};
  STD_TORCH_CHECK(same_sizes(lse, l_shape), "lse must have shape ",
              IntList{l_shape}, " (B, H, Sq), got ", shape_of(lse));
  STD_TORCH_CHECK(dout.scalar_type() == q.scalar_type(), "dout must have the same dtype as q (",
              q.scalar_type(), "), got ", dout.scalar_type());
  STD_TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out must have the same dtype as q (",
              q.scalar_type(), "), got ", out.scalar_type());
  STD_TORCH_CHECK(lse.scalar_type() == lse_dtype(q.scalar_type()), "lse must be ",
              lse_dtype(q.scalar_type()), " for ", q.scalar_type(), " inputs, got ",
              lse.scalar_type());
  check_same_device(dout, q, "dout", "q");
  check_same_device(out, q, "out", "q");
  check_same_device(lse, q, "lse", "q");
  check_row_contiguous(dout, "dout");
  check_row_contiguous(out, "out");
}

// Fills the forward params; out (B, Sq, H, Dv) and lse (B, H, Sq) are contiguous.
inline AttentionParams make_attention_params(const Tensor& q, const Tensor& k,
                                             const Tensor& v, const Tensor& out,
                                             const Tensor& lse, const AttentionShape& s,
                                             bool causal, const std::optional<double>& scale) {
  AttentionParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.defined() ? out.data_ptr() : nullptr;
  p.lse = lse.defined() ? lse.data_ptr() : nullptr;
  p.B = s.B;
  p.Sq = s.Sq;
  p.Sk = s.Sk;
  p.H = s.H;
  p.Hkv = s.Hkv;
  p.D = s.D;
  p.Dv = s.Dv;
  p.q_batch_stride = q.stride(0);
  p.q_row_stride = q.stride(1);
  p.q_head_stride = q.stride(2);
  p.k_batch_stride = k.stride(0);
  p.k_row_stride = k.stride(1);
  p.k_head_stride = k.stride(2);
  p.v_batch_stride = v.stride(0);
  p.v_row_stride = v.stride(1);
  p.v_head_stride = v.stride(2);
  p.out_batch_stride = s.Sq * s.H * s.Dv;
  p.out_row_stride = s.H * s.Dv;
  p.out_head_stride = s.Dv;
  p.lse_batch_stride = s.H * s.Sq;
  p.lse_head_stride = s.Sq;
  p.scale = scale.has_value() ? *scale : (s.D > 0 ? 1.0 / std::sqrt(static_cast<double>(s.D)) : 1.0);
  p.causal = causal;
  p.mask.right = causal ? 0 : -1;  // window and padding: fill_mask_params (attention_mask_checks.h)
  return p;
}

// Fills the backward params (forward params plus dout/out/lse/gradient pointers and strides)
// in one place for the CPU and CUDA adapters. lse must be contiguous (B, H, Sq).
inline AttentionBwdParams make_attention_bwd_params(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out, const Tensor& lse, const Tensor& dq, const Tensor& dk,
    const Tensor& dv, const AttentionShape& s, bool causal, std::optional<double> scale) {
  AttentionBwdParams bp{};
  bp.fwd = make_attention_params(q, k, v, Tensor(), Tensor(), s, causal, scale);
  bp.dout = dout.data_ptr();
  bp.out = out.data_ptr();
  bp.lse = lse.data_ptr();
  bp.dout_batch_stride = dout.stride(0);
  bp.dout_row_stride = dout.stride(1);
  bp.dout_head_stride = dout.stride(2);
  bp.o_batch_stride = out.stride(0);
  bp.o_row_stride = out.stride(1);
  bp.o_head_stride = out.stride(2);
  bp.dlse = nullptr;
  // (B, S, H, D) gradients, or (T, H, D) of packed sequences (batch strides set there)
  auto strides = [](const Tensor& g, int64_t& batch, int64_t& row, int64_t& head) {
    const int64_t n = g.dim();
    batch = n == 4 ? g.stride(0) : 0;
    row = g.stride(n - 3);
    head = g.stride(n - 2);
  };
  strides(dq, bp.dq_batch_stride, bp.dq_row_stride, bp.dq_head_stride);
  strides(dk, bp.dk_batch_stride, bp.dk_row_stride, bp.dk_head_stride);
  strides(dv, bp.dv_batch_stride, bp.dv_row_stride, bp.dv_head_stride);
  bp.dq = dq.data_ptr();
  bp.dk = dk.data_ptr();
  bp.dv = dv.data_ptr();
  return bp;
}

// attention_backward / attention_varlen_backward (three gradients, issue 4's schema) from the
// backend's *_rel_bias kernel (dq, dk, dv, d rel_bias), for each backend's registration:
// m.impl("attention_backward", TORCH_BOX(without_drel<&attention_backward_cpu>)).
template <auto F, typename Sig>
struct WithoutDrel;
template <auto F, typename... Args>
struct WithoutDrel<F, std::tuple<Tensor, Tensor, Tensor, Tensor>(Args...)> {
  static std::tuple<Tensor, Tensor, Tensor> call(Args... args) {
    auto grads = F(std::forward<Args>(args)...);
    return {std::move(std::get<0>(grads)), std::move(std::get<1>(grads)),
            std::move(std::get<2>(grads))};
  }
};
template <auto F>
constexpr auto without_drel = &WithoutDrel<F, std::remove_pointer_t<decltype(F)>>::call;

}  // namespace attn_ext
