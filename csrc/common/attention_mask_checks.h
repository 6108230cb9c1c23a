// ATen-facing half of the masks: input checks of window / key_padding_mask / cu_seqlens and
// the filling of AttentionParams::mask, shared by the CPU and CUDA adapters. The rule
// itself is ATen-free, in common/attention_mask.h. Every failure names the argument.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "common/attention_checks.h"
#include "common/attention_mask.h"

namespace attn_ext {

inline void check_window(int64_t left, int64_t right) {
  TORCH_CHECK(left >= -1 && right >= -1,
              "window must be (left, right) with each side >= 0, or -1 for unbounded, got (",
              left, ", ", right, ")");
}

inline void check_key_padding_mask(const at::Tensor& kpm, const at::Tensor& q,
                                   const AttentionShape& s) {
  TORCH_CHECK(kpm.scalar_type() == at::kBool,
              "key_padding_mask must be bool (B, Sk), True = the key takes part, got dtype ",
              kpm.scalar_type());
  check_same_device(kpm, q, "key_padding_mask", "q");
  TORCH_CHECK(kpm.dim() == 2 && kpm.size(0) == s.B && kpm.size(1) == s.Sk,
              "key_padding_mask must have shape (B, Sk) = (", s.B, ", ", s.Sk, "), got shape ",
              kpm.sizes());
}

// Window, causal (right = 0) and key padding of a (batched) problem into p.mask.
inline void fill_mask_params(AttentionParams& p, const AttentionShape& s, const at::Tensor& q,
                             bool causal, int64_t window_left, int64_t window_right,
                             const std::optional<at::Tensor>& key_padding_mask) {
  check_window(window_left, window_right);
  p.mask.left = window_left;
  p.mask.right = causal ? 0 : window_right;
  if (key_padding_mask.has_value()) {
    const at::Tensor& kpm = *key_padding_mask;
    check_key_padding_mask(kpm, q, s);
    p.mask.key_padding = reinterpret_cast<const uint8_t*>(kpm.data_ptr());
    p.mask.kpm_batch_stride = kpm.stride(0);
    p.mask.kpm_key_stride = kpm.stride(1);
  }
}

// dlse: the gradient of the forward's lse, same shape and dtype.
inline void check_dlse(const at::Tensor& dlse, const at::Tensor& lse) {
  TORCH_CHECK(dlse.sizes() == lse.sizes(), "dlse must have lse's shape ", lse.sizes(), ", got ",
              dlse.sizes());
  TORCH_CHECK(dlse.scalar_type() == lse.scalar_type(), "dlse must have lse's dtype ",
              lse.scalar_type(), ", got ", dlse.scalar_type());
  check_same_device(dlse, lse, "dlse", "lse");
}

// ---- packed sequences (attention_varlen_*) -------------------------------------------------

inline void check_cu_seqlens(const at::Tensor& cu, const char* name, const at::Tensor& q,
                             int64_t total, int64_t max_seqlen, const char* max_name) {
  TORCH_CHECK(cu.scalar_type() == at::kInt, name, " must be int32 (N + 1,), got dtype ",
              cu.scalar_type());
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, name,
              " must have shape (N + 1,) with N >= 0 sequences, got shape ", cu.sizes());
  check_same_device(cu, q, name, "q");
  TORCH_CHECK(cu.is_contiguous(), name, " must be contiguous, got strides ", cu.strides());
  TORCH_CHECK(max_seqlen >= 0, max_name, " must be >= 0, got ", max_seqlen);
  if (!cu.is_cpu()) return;  // on CUDA the values are not read on the host (no sync)
  const int32_t* c = cu.data_ptr<int32_t>();
  const int64_t n = cu.size(0) - 1;
  TORCH_CHECK(c[0] == 0, name, " must start at 0, got ", name, "[0] = ", c[0]);
  for (int64_t b = 0; b < n; ++b) {
    TORCH_CHECK(c[b + 1] >= c[b], name, " must be non-decreasing, got ", name, "[", b, "] = ",
                c[b], " > ", name, "[", b + 1, "] = ", c[b + 1]);
    TORCH_CHECK(c[b + 1] - c[b] <= max_seqlen, max_name, " = ", max_seqlen,
                " is smaller than sequence ", b, " of ", name, " (length ", c[b + 1] - c[b], ")");
  }
  TORCH_CHECK(c[n] == total, name, " must end at the number of packed rows ", total, ", got ",
              name, "[", n, "] = ", c[n]);
}

// q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv). Returns the shape with B = N sequences,
// Sq = max_seqlen_q, Sk = max_seqlen_k.
inline AttentionShape check_varlen_inputs(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                                          const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                          int64_t max_seqlen_k,
                                          const std::optional<double>& scale) {
  check_dim(q, "q", 3, "(Tq, H, D)");
  check_dim(k, "k", 3, "(Tk, Hkv, D)");
  check_dim(v, "v", 3, "(Tk, Hkv, Dv)");
  TORCH_CHECK(v.size(0) == k.size(0), "v must have Tk = ", k.size(0),
              " packed rows (from k), got shape ", v.sizes());
  // dtypes, devices, heads, head dims, strides: the batched checks on (1, T, H, D) views
  AttentionShape s = check_attention_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale);
  check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q, q.size(0), max_seqlen_q, "max_seqlen_q");
  check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q, k.size(0), max_seqlen_k, "max_seqlen_k");
  TORCH_CHECK(cu_seqlens_k.size(0) == cu_seqlens_q.size(0),
              "cu_seqlens_k must have as many sequences as cu_seqlens_q (", cu_seqlens_q.size(0),
              " entries), got ", cu_seqlens_k.size(0));
  s.B = cu_seqlens_q.size(0) - 1;
  s.Sq = max_seqlen_q;
  s.Sk = max_seqlen_k;
  return s;
}

// Turns params filled from (1, T, ...) views into packed ones: batch strides 0, per-sequence
// rows from cu_seqlens, lse (H, Tq).
inline void make_params_packed(AttentionParams& p, const AttentionShape& s, int64_t Tq,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                               bool causal, int64_t window_left, int64_t window_right) {
  check_window(window_left, window_right);
  p.B = s.B;
  p.Sq = s.Sq;
  p.Sk = s.Sk;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.out_batch_stride = 0;
  p.lse_batch_stride = 0;
  p.lse_head_stride = Tq;
  p.mask.left = window_left;
  p.mask.right = causal ? 0 : window_right;
  p.mask.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  p.mask.cu_seqlens_k = cu_seqlens_k.data_ptr<int32_t>();
}

}  // namespace attn_ext
