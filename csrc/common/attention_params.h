// Plain-data parameters of the attention kernels: pointers, sizes and explicit strides (in
// elements), filled in one place by the ATen adapters (csrc/cpu/attention_*.cpp) and read by
// the kernels. No ATen types here.
#pragma once

#include <cstdint>

namespace attn_ext {

// Forward:  out (B, Sq, H, Dv), lse (B, H, Sq) from
//   q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv)   (last dims contiguous)
// Query head h reads kv head h / (H / Hkv). Causal: row i sees key j iff j <= i + (Sk - Sq).
struct AttentionParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;  // (B, Sq, H, Dv) contiguous
  void* lse;  // (B, H, Sq) contiguous; float, or double for double inputs
  int64_t B, Sq, Sk, H, Hkv, D, Dv;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t out_batch_stride, out_row_stride, out_head_stride;
  double scale;  // softmax(scale * q k^T)
  bool causal;
};

// Backward: dq (B, Sq, H, D), dk (B, Sk, Hkv, D), dv (B, Sk, Hkv, Dv), all contiguous, from
// dout and out (B, Sq, H, Dv) and the forward's lse (B, H, Sq), plus the forward's inputs.
struct AttentionBwdParams {
  AttentionParams fwd;  // q, k, v, sizes, strides, scale, causal (fwd.out / fwd.lse unused)
  const void* dout;
  const void* out;
  const void* lse;  // (B, H, Sq) contiguous, float (double for double inputs)
  int64_t dout_batch_stride, dout_row_stride, dout_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  void* dq;  // (B, Sq, H, D) contiguous
  void* dk;  // (B, Sk, Hkv, D) contiguous
  void* dv;  // (B, Sk, Hkv, Dv) contiguous
};

}  // namespace attn_ext
