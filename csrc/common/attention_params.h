// Plain-data parameters of the attention kernels: pointers, sizes and explicit strides (in
// elements), filled in one place by the ATen adapters (csrc/cpu/attention_*.cpp) and read by
// the kernels. No ATen types here.
#pragma once

#include <cstdint>

#include "common/attention_mask.h"

namespace attn_ext {

// Forward:  out (B, Sq, H, Dv), lse (B, H, Sq) from
//   q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv)   (last dims contiguous)
// Query head h reads kv head h / (H / Hkv). Which keys a row sees: `mask` and
// common/attention_mask.h (causal is folded into mask.right). Packed sequences (varlen):
// q (Tq, H, D) etc. are passed with batch strides 0, B = number of sequences, Sq / Sk = the
// longest sequence, and the mask's cu_seqlens give each sequence's rows.
struct AttentionParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;  // (B, Sq, H, Dv) contiguous
  void* lse;  // (B, H, Sq) (packed: (H, Tq)); float, or double for double inputs
  int64_t B, Sq, Sk, H, Hkv, D, Dv;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t out_batch_stride, out_row_stride, out_head_stride;
  // lse[b * lse_batch_stride + h * lse_head_stride + q0 + i] (q0: the sequence's first row)
  int64_t lse_batch_stride, lse_head_stride;
  double scale;  // softmax(scale * q k^T)
  bool causal;
  MaskParams mask;  // window / key padding / cu_seqlens; causal already folded in
  ScoreTerms terms;  // softcap / ALiBi / rel_bias / sinks / dropout (terms.scale: see score_terms)

  ATTN_MASK_FN Visibility visibility() const { return Visibility{mask, Sq, Sk}; }
  ATTN_MASK_FN ScoreTerms score_terms() const {
    ScoreTerms t = terms;
    t.scale = scale;
    if (mask.block) {
      t.dropout_row0 = mask.q_start;
      t.dropout_col0 = mask.k_start;
    }
    return t;
  }
};

// Query row `row` (< B * H * Sq) in the (b, h, i) order of the kernels that take one row each
// (the CUDA simple kernels, settle_lse_kernel, the fast backward's delta): its indices and its
// sequence; ok is false past the end of its packed sequence.
struct QueryRow {
  int64_t b, h, i;
  SeqInfo sq;
  bool ok;
};
ATTN_MASK_FN QueryRow query_row(const AttentionParams& p, int64_t row) {
  QueryRow r;
  r.i = row % p.Sq;
  const int64_t bh = row / p.Sq;
  r.h = bh % p.H;
  r.b = bh / p.H;
  r.sq = p.visibility().seq(r.b);
  r.ok = r.i < r.sq.Sq;
  return r;
}

// Backward: dq (B, Sq, H, D), dk (B, Sk, Hkv, D), dv (B, Sk, Hkv, Dv) from dout and out
// (B, Sq, H, Dv) and the forward's lse (B, H, Sq), plus the forward's inputs. The gradients'
// last dims are contiguous; their rows and heads are at the strides below (BSHD contiguous, or
// on CPU the BHSD memory of an input passed as a transpose view: grad_layout in
// cpu/attention_bwd.cpp).
struct AttentionBwdParams {
  AttentionParams fwd;  // q, k, v, sizes, strides, scale, causal (fwd.out / fwd.lse unused)
  const void* dout;
  const void* out;
  const void* lse;  // laid out as fwd.lse (fwd's lse strides), float (double for double inputs)
  const void* dlse;  // gradient of lse, laid out as lse, or nullptr (zero)
  int64_t dout_batch_stride, dout_row_stride, dout_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  // Batch strides are 0 when packed (rows then from cu_seqlens).
  int64_t dq_batch_stride, dk_batch_stride, dv_batch_stride;
  int64_t dq_row_stride, dk_row_stride, dv_row_stride;
  int64_t dq_head_stride, dk_head_stride, dv_head_stride;
  void* dq;  // (B, Sq, H, D)
  void* dk;  // (B, Sk, Hkv, D)
  void* dv;  // (B, Sk, Hkv, Dv)
  void* drel_bias;  // (H, 2M + 1) contiguous, accumulation type; nullptr without rel_bias
};

}  // namespace attn_ext
