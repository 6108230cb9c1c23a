// Host-side entry points of the CUDA attention kernels, shared by the stable-ABI adapter
// (attention.cu) and the translation units that instantiate them:
//   attention_simple.cu        simple::launch_simple_fwd / launch_simple_bwd / launch_settle_lse, every dtype
//   attention_fa2_hdim{32,64,96,128,256}.cu   fa2::launch_fa2_fwd_impl<T, D, mask mode>, T = __half, bf16
//   attention_fa2_bwd_hdim64.cu / attention_fa2_bwd_hdim128.cu   fa2::launch_fa2_bwd_impl
// Each returns the launch's error code; the caller checks it. No ATen types.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/attention_params.h"

namespace attn_ext {
namespace cuda {

namespace simple {
constexpr int kMaxHeadDim = 256;  // largest D and Dv of the simple kernels
constexpr int kWarps = 4;         // rows (warps) per block: grid.x = ceil(rows / kWarps)

// T = float, double, __half, __nv_bfloat16.
template <typename T>
cudaError_t launch_simple_fwd(const AttentionParams& p, cudaStream_t stream);
// After every forward: the rows left with lse NaN get common/row_lse.h's answer (+inf where
// a score is +inf and none is NaN).
template <typename T>
cudaError_t launch_settle_lse(const AttentionParams& p, cudaStream_t stream);
// Split-KV forward for few query rows and many keys: each (row, chunk of `chunk` keys) is
// one warp; part_o (B*H*Sq, n_split, Dv) and part_ml (B*H*Sq, n_split, 2) are acc_t
// workspaces; a second kernel merges the partials into out and lse.
template <typename T>
cudaError_t launch_simple_fwd_split(const AttentionParams& p, int64_t chunk, int n_split,
                                    void* part_o, void* part_ml, cudaStream_t stream);
// delta: (B, H, Sq) workspace of the accumulation type (float; double for double).
// drel_diag: (B, H, Sq + Sk - 1) double workspace when bp.drel_bias is set (rel_bias given;
// d rel_bias by a fixed-order reduction, deterministic), else nullptr.
template <typename T>
cudaError_t launch_simple_bwd(const AttentionBwdParams& bp, void* delta, void* drel_diag,
                              cudaStream_t stream);
}  // namespace simple

namespace fa2 {
constexpr int kBlockM = 64;  // query rows per CTA (FwdTraits::kBlockM)

// The fast kernels' mask modes (their template argument kMask): what code a kernel carries.
enum MaskMode : int {
  kMaskNone = 0,     // Visibility::dense(): every key of the sequence is visible
  kMaskBand = 1,     // causal / window, no key padding
  kMaskPadding = 2,  // key padding, with or without a band
};
inline int mask_mode(const AttentionParams& p) {
  const Visibility v = p.visibility();
  return v.dense() ? kMaskNone : (v.has_padding() ? kMaskPadding : kMaskBand);
}

// kTerms: softcap / ALiBi / rel_bias / sinks / dropout (attention_fwd_kernel.cuh).
template <typename T, int kHeadDim, int kMask, bool kTerms>
cudaError_t launch_fa2_fwd_impl(const AttentionParams& p, cudaStream_t stream);

// The fast kernels count rows, keys and distances of a sequence in 32 bits (TileBands of
// common/attention_mask.h): Sq + Sk (the longest sequences', when packed) plus the size of a
// block's position shift (q_start / k_start) below 2^30, so every distance fits.
constexpr int kMaxFastSeqLen = 1073741824;  // 2^30
inline bool fast_lengths_ok(const AttentionParams& p) {
  const int64_t d = p.visibility().pos_shift(), shift = d < 0 ? -d : d;
  return p.Sq + p.Sk + shift < kMaxFastSeqLen;
}

// Grid (query tiles, H, B): y and z are limited to 65535.
inline bool fwd_fast_grid_ok(const AttentionParams& p) {
  const int64_t m_blocks = (p.Sq + kBlockM - 1) / kBlockM;
  return m_blocks <= 0x7fffffff && p.H <= 65535 && p.B <= 65535 &&
         fast_lengths_ok(p);
}

// Head dims with a fast forward kernel (attention_fa2_hdim{32,64,96,128,256}.cu).
inline bool fwd_fast_head_dim(int64_t d) {
  return d == 32 || d == 64 || d == 96 || d == 128 || d == 256;
}

// Head dims whose fast forward also has the score-term instances (kTerms): at D = 256 the
// terms' registers spill (255 registers with masks), so such calls run the simple kernel.
constexpr bool fwd_fast_terms_head_dim(int64_t d) { return d != 256; }

// Dynamic shared memory of fa2_fwd_kernel (FwdTraits<D>::kSmemBytes; the instantiating .cu
// files static_assert that they agree): the adapter compares it with the device's limit.
constexpr int fwd_smem_bytes(int64_t head_dim) {
  return static_cast<int>((64 + 4 * (head_dim <= 128 ? 64 : 32)) * (head_dim + 8) * 2);
}

template <typename T, int kHeadDim, bool kTerms>
cudaError_t launch_fa2_fwd_m(const AttentionParams& p, cudaStream_t stream) {
  switch (mask_mode(p)) {
    case kMaskNone: return launch_fa2_fwd_impl<T, kHeadDim, kMaskNone, kTerms>(p, stream);
    case kMaskBand: return launch_fa2_fwd_impl<T, kHeadDim, kMaskBand, kTerms>(p, stream);
    default: return launch_fa2_fwd_impl<T, kHeadDim, kMaskPadding, kTerms>(p, stream);
  }
}

template <typename T, int kHeadDim>
cudaError_t launch_fa2_fwd_d(const AttentionParams& p, cudaStream_t stream) {
  if (!p.terms.plain()) {  // score terms, sinks, dropout
    if constexpr (fwd_fast_terms_head_dim(kHeadDim)) {
      return launch_fa2_fwd_m<T, kHeadDim, true>(p, stream);
    } else {
      return cudaErrorInvalidValue;  // use_fast_forward sends these to the simple kernel
    }
  }
  return launch_fa2_fwd_m<T, kHeadDim, false>(p, stream);
}

// T = __half or __nv_bfloat16; p.D == p.Dv and fwd_fast_head_dim(p.D) (the caller checked).
template <typename T>
cudaError_t launch_fa2_fwd(const AttentionParams& p, cudaStream_t stream) {
  switch (p.D) {
    case 32: return launch_fa2_fwd_d<T, 32>(p, stream);
    case 64: return launch_fa2_fwd_d<T, 64>(p, stream);
    case 96: return launch_fa2_fwd_d<T, 96>(p, stream);
    case 128: return launch_fa2_fwd_d<T, 128>(p, stream);
    case 256: return launch_fa2_fwd_d<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;  // fwd_fast_head_dim and this switch disagree
  }
}

template <typename T, int kHeadDim, int kMask, bool kTerms, bool kDropout>
cudaError_t launch_fa2_bwd_impl(const AttentionBwdParams& bp, float* delta, float* dq_accum,
                                cudaStream_t stream);

// Head dims whose fast backward has dropout instances: at D = 128 the dropout code spills
// (44-56 bytes with a band mask), so dropout there runs the simple kernels.
constexpr bool bwd_fast_dropout_head_dim(int64_t d) { return d == 64; }

// Score terms the fast backward takes (its kTerms instances): softcap, ALiBi, rel_bias (its
// gradient by fp32 atomics: like dq, not deterministic; the adapter's deterministic mode runs
// the simple kernels, whose per-diagonal passes are), and dropout (the forward's keep bits)
// where bwd_fast_dropout_head_dim. Sinks are not the backward's business (lse holds them).
inline bool bwd_fast_terms_ok(const ScoreTerms& t, int64_t head_dim) {
  return !t.has_dropout() || bwd_fast_dropout_head_dim(head_dim);
}

// Extra dynamic shared memory of the kTerms instances: with dropout the steps' row keys
// (2 x 64 uint64), with rel_bias d rel_bias's (2M + 1) fp32 accumulator. The adapter adds it
// to bwd_smem_bytes before comparing with the device's opt-in limit.
inline int64_t bwd_terms_smem_bytes(const ScoreTerms& t) {
  return (t.has_dropout() ? 2 * 64 * 8 : 0) + (t.rel_bias == nullptr ? 0 : (2 * t.rel_max + 1) * 4);
}

// Backward grid (key tiles of 128, Hkv, B).
// Dynamic shared memory of fa2_bwd_kernel (BwdTraits<D>::kSmemBytes; the instantiating .cu
// files static_assert that they agree): the adapter compares it with the device's opt-in limit.
constexpr int bwd_smem_bytes(int64_t head_dim) {
  return static_cast<int>(((2 * 128 + 4 * 64) * (head_dim + 8) + 128 * (64 + 8)) * 2 + 4 * 64 * 4);
}

// Each CTA walks (H / Hkv) x (query tiles of 64) steps, counted in 32 bits.
inline bool bwd_fast_grid_ok(const AttentionParams& p) {
  const int64_t n_blocks = (p.Sk + 127) / 128;
  const int64_t steps = (p.H / p.Hkv) * ((p.Sq + 63) / 64);
  return n_blocks <= 0x7fffffff && steps <= 0x7fffffff && p.Hkv <= 65535 && p.B <= 65535 &&
         fast_lengths_ok(p);
}

// T = __half or __nv_bfloat16; D == Dv in {64, 128} (the caller checked). delta: (B, H, Sq)
// fp32 workspace; dq_accum: (B, Sq, H, D) fp32, zeroed; the caller converts it to dq.
template <typename T, int kHeadDim, bool kTerms, bool kDropout>
cudaError_t launch_fa2_bwd_m(const AttentionBwdParams& bp, float* delta, float* dq_accum,
                             cudaStream_t stream) {
  switch (mask_mode(bp.fwd)) {
    case kMaskNone: return launch_fa2_bwd_impl<T, kHeadDim, kMaskNone, kTerms, kDropout>(bp, delta, dq_accum, stream);
    case kMaskBand: return launch_fa2_bwd_impl<T, kHeadDim, kMaskBand, kTerms, kDropout>(bp, delta, dq_accum, stream);
    default: return launch_fa2_bwd_impl<T, kHeadDim, kMaskPadding, kTerms, kDropout>(bp, delta, dq_accum, stream);
  }
}

template <typename T, int kHeadDim>
cudaError_t launch_fa2_bwd_d(const AttentionBwdParams& bp, float* delta, float* dq_accum,
                             cudaStream_t stream) {
  const ScoreTerms t = bp.fwd.score_terms();
  if (!bwd_fast_terms_ok(t, kHeadDim)) return cudaErrorInvalidValue;  // the adapter runs the simple kernels
  if (t.has_dropout()) {
    if constexpr (bwd_fast_dropout_head_dim(kHeadDim)) {
      return launch_fa2_bwd_m<T, kHeadDim, true, true>(bp, delta, dq_accum, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  }
  if (t.active()) return launch_fa2_bwd_m<T, kHeadDim, true, false>(bp, delta, dq_accum, stream);
  return launch_fa2_bwd_m<T, kHeadDim, false, false>(bp, delta, dq_accum, stream);
}

template <typename T>
cudaError_t launch_fa2_bwd(const AttentionBwdParams& bp, float* delta, float* dq_accum,
                           cudaStream_t stream) {
  if (bp.fwd.D == 64) return launch_fa2_bwd_d<T, 64>(bp, delta, dq_accum, stream);
  if (bp.fwd.D == 128) return launch_fa2_bwd_d<T, 128>(bp, delta, dq_accum, stream);
  return cudaErrorInvalidValue;
}
}  // namespace fa2

}  // namespace cuda
}  // namespace attn_ext
