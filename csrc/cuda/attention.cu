// attn_ext::attention_forward / attention_backward on CUDA: stable-ABI adapter (checks shared with
// the CPU adapter, outputs, dtype and kernel dispatch, device guard, current stream). Device
// code: attention_fwd_kernel.cuh (fast forward), attention_bwd_kernel.cuh (fast backward) and
// attention_simple_kernel.cuh (everything else).
//
// Kernels are instantiated in attention_simple.cu, the fast forward's
// attention_fa2_hdim32 / 64 / 96 / 128 / 256.cu and the fast backward's
// attention_fa2_bwd_hdim64 / 128.cu (declared in attention_launch.h); this file holds no
// device code.
//
// Forward dispatch, in order:
//   0. split-KV decode path (simple::launch_simple_fwd_split) when Sq <= 16, Sk >= 512 and the
//      B * H * Sq rows alone would fill under a quarter of the GPU's warp slots (16 warps per
//      SM): the keys are cut into chunks of >= 128, one warp per (row, chunk), then merged.
//      Any dtype and head dim. (The fast kernel's 64-row query tiles would waste most of
//      their work on one or a few query rows and leave most SMs idle.)
//   1. fast FA2-style tensor-core kernel (fa2::launch_fa2_fwd) when ALL of:
//        dtype fp16 or bf16; D == Dv and D in {32, 64, 96, 128, 256}; its shared memory
//        fits the device's opt-in limit (99 KiB at D = 256); q, k, v data pointers 16-byte
//        aligned and their batch/row/head strides multiples of 8 elements; Sk > 0;
//        B, H <= 65535 (grid y/z); Sq + Sk < 2^30 (the kernels count a sequence's rows,
//        keys and distances in 32 bits); no score term at D = 256 (the score terms below).
//   2. otherwise the simple kernel (simple::launch_simple_fwd): any dtype (fp32, fp64, fp16,
//      bf16), any D, Dv <= 256, any strides with a contiguous last dim.
// attn_ext::_set_cuda_attention_kernels(1) (attn_ext.ops._simple_cuda_kernels()) skips 0 and
// 1 until it is set back to 0: tests use it to compare the kernels on the same inputs.
// Head dims above 256 are rejected with an error naming the argument.
// Backward dispatch:
//   1. fast FA2-style tensor-core backward (fa2::launch_fa2_bwd, attention_bwd_kernel.cuh)
//      under the fast forward's conditions but D in {64, 128} only (dout also 16-byte aligned with
//      strides multiples of 8) and when its shared memory fits the device (155 KiB at
//      D = 128: not on sm_86 / sm_89 / sm_120), unless the op's deterministic argument is True
//      (the Python autograd formula passes torch.are_deterministic_algorithms_enabled()): its dQ is accumulated with fp32 atomics, so its dq is not bitwise reproducible
//      (dk, dv are).
//   2. otherwise the simple kernels (dQ per query row, then dK/dV per key row; no atomics,
//      deterministic), any dtype and head dim <= 256.
// _set_cuda_attention_kernels(1) forces the simple kernels here too.
// Masks take the same paths: window, key_padding_mask and causal in the batched ops, packed
// sequences (attention_varlen_forward / _backward: one CTA per (tile, head, sequence), the
// sequence from Visibility::seq(b)) and dlse all run on the fast kernels when the conditions
// above hold (for packed input Sq / Sk are max_seqlen_q / max_seqlen_k, and the alignment is
// that of the (T, heads, D) tensors), else on the simple ones; every kernel takes what a row
// sees from common/attention_mask.h. Packed input has no split-KV path. Blocks at a global
// position (q_start / k_start) too: the offset comes from seq(b).off.
// Score terms (issue 15: alibi_slopes, rel_bias, softcap, sinks, dropout_p; checked and filled
// by common/score_checks.h as on the CPU): split-KV and the simple kernels take all of them;
// the fast forward takes softcap, ALiBi, rel_bias, sinks and dropout (its kTerms instances;
// not at D = 256, whose terms instances would spill); the fast backward takes softcap, ALiBi and rel_bias
// (its kTerms instances; d rel_bias by fp32 atomics, like dq; sinks reach the backward only
// through lse) and dropout at D = 64 (fa2::bwd_fast_terms_ok; at D = 128 the simple kernels).
// The simple backward's d rel_bias
// is a fixed-order reduction (simple kernels' pass 3 and 4, no atomics): every gradient of the
// simple kernels, d rel_bias included, is bitwise reproducible, so deterministic=True needs
// nothing else.

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>

#include "common/registration.h"
#include "common/attention_checks.h"
#include "common/attention_mask_checks.h"
#include "common/score_checks.h"
#include "common/stable_cuda.h"
#include "cuda/attention_launch.h"

namespace attn_ext {
namespace {

// Calls f(T{}) with T the CUDA-side element type of `dtype` (the kernels use the CUDA types
// __half / __nv_bfloat16, which have the same layout as c10::Half / c10::BFloat16).
template <typename F>
void dispatch_cuda_type(ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case dtype::kFloat: f(float{}); break;
    case dtype::kDouble: f(double{}); break;
    case dtype::kHalf: f(__half{}); break;
    case dtype::kBFloat16: f(__nv_bfloat16{}); break;
    default: STD_TORCH_CHECK(false, name, ": unsupported dtype ", dtype);
  }
}

void check_cuda_head_dims(const AttentionShape& s) {
  STD_TORCH_CHECK(s.D <= cuda::simple::kMaxHeadDim, "q and k head dim D must be <= ",
              cuda::simple::kMaxHeadDim, " on CUDA, got D = ", s.D);
  STD_TORCH_CHECK(s.Dv <= cuda::simple::kMaxHeadDim, "v head dim Dv must be <= ",
              cuda::simple::kMaxHeadDim, " on CUDA, got Dv = ", s.Dv);
}

void check_grid_rows(int64_t rows, const char* what) {
  const int64_t blocks = (rows + cuda::simple::kWarps - 1) / cuda::simple::kWarps;
  STD_TORCH_CHECK(blocks <= 0x7fffffff, "attention on CUDA: too many ", what, " rows (", rows,
              ") for one launch");
}

// The score terms of a call (common/score_checks.h), checked before the early returns for
// empty inputs as the CPU adapter does; the caller copies them into its params.
ScoreTerms checked_terms(const ScoreArgs& a, const Tensor& q, const AttentionShape& s) {
  AttentionParams holder{};
  fill_score_terms(holder, a, q, s.B, s.H);
  return holder.terms;
}

// d rel_bias's per-diagonal workspace (B, H, Sq + Sk - 1) float64 of the simple backward
// (attention_simple_kernel.cuh pass 3), or an undefined tensor without rel_bias.
Tensor drel_workspace(const AttentionBwdParams& bp, const Tensor& like) {
  const AttentionParams& p = bp.fwd;
  if (bp.drel_bias == nullptr) return Tensor();
  check_grid_rows(p.B * p.H * (p.Sq + p.Sk - 1), "d rel_bias diagonal");
  return alloc(like, {p.B, p.H, p.Sq + p.Sk - 1}, dtype::kDouble);
}

// Base pointer 16-byte aligned and every stride but the last dim's a multiple of 8 elements
// ((B, S, heads, D) tensors, or the packed (T, heads, D) ones of attention_varlen_*).
bool aligned16(const Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.stride(d) % 8 != 0) return false;
  }
  return true;
}

// 0: dispatch rules above; 1: simple kernels only (attn_ext::_set_cuda_attention_kernels).
std::atomic<int> g_kernel_mode{0};

bool force_simple() { return g_kernel_mode.load(std::memory_order_relaxed) == 1; }

// mode -1 only reads the current mode (explain() asks it: setting and restoring it would switch
// other threads' calls to the simple kernels in between).
int64_t set_cuda_attention_kernels(int64_t mode) {
  STD_TORCH_CHECK(mode == 0 || mode == 1 || mode == -1,
                  "mode must be 0 (automatic), 1 (simple kernels only) or -1 (read the mode), got ",
                  mode);
  if (mode == -1) return g_kernel_mode.load();
  return g_kernel_mode.exchange(static_cast<int>(mode));
}

// Split-KV plan for the forward: n_split > 1 when the decode path applies (see the top).
struct SplitPlan {
  int n_split = 1;
  int64_t chunk = 0;
};

SplitPlan plan_split(const AttentionParams& p, int device) {
  SplitPlan plan;
  if (p.Sq > 16 || p.Sk < 512 || force_simple()) return plan;
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms <= 0) {
    (void)cudaGetLastError();  // clear it; fall back to the unsplit kernels
    return plan;
  }
  const int64_t rows = p.B * p.H * p.Sq;
  const int64_t target = static_cast<int64_t>(sms) * 16;  // warps that fill the GPU
  if (rows * 4 >= target) return plan;
  int64_t n = (target + rows - 1) / rows;
  const int64_t max_split = (p.Sk + 127) / 128;  // chunks of at least 128 keys
  if (n > max_split) n = max_split;
  if (n < 2) return plan;
  plan.chunk = (p.Sk + n - 1) / n;
  plan.n_split = static_cast<int>((p.Sk + plan.chunk - 1) / plan.chunk);  // no empty chunk
  return plan;
}

// The device's opt-in shared memory per block (bytes), cached per device; 0 if unknown.
int max_smem_optin(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};  // 0: not queried yet
  if (device < 0 || device >= kMaxDevices) return 0;
  int v = cache[device].load(std::memory_order_relaxed);
  if (v > 0) return v;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    (void)cudaGetLastError();  // clear it; the simple kernels need no opt-in
    return 0;
  }
  cache[device].store(v, std::memory_order_relaxed);
  return v;
}

bool use_fast_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                      const AttentionParams& p) {
  const auto dt = q.scalar_type();
  if (dt != dtype::kHalf && dt != dtype::kBFloat16) return false;
  if (p.D != p.Dv || !cuda::fa2::fwd_fast_head_dim(p.D)) return false;
  if (!p.terms.plain() && !cuda::fa2::fwd_fast_terms_head_dim(p.D)) return false;
  if (p.Sk <= 0 || p.Sq <= 0) return false;
  if (!aligned16(q) || !aligned16(k) || !aligned16(v)) return false;
  if (!cuda::fa2::fwd_fast_grid_ok(p)) return false;
  if (cuda::fa2::fwd_smem_bytes(p.D) > max_smem_optin(q.get_device_index())) return false;
  return !force_simple();
}

bool use_fast_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                       const Tensor& v, const AttentionParams& p, bool deterministic) {
  const auto dt = q.scalar_type();
  if (dt != dtype::kHalf && dt != dtype::kBFloat16) return false;
  if (p.D != p.Dv || (p.D != 64 && p.D != 128)) return false;
  if (p.Sk <= 0 || p.Sq <= 0) return false;
  if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(dout)) return false;
  if (!cuda::fa2::bwd_fast_grid_ok(p)) return false;
  // score terms: the fast kernel's kTerms instances; dropout at D = 128: the simple ones
  if (!cuda::fa2::bwd_fast_terms_ok(p.score_terms(), p.D)) return false;
  if (deterministic) return false;
  // 155 KiB at D = 128: more than sm_86 / sm_89 / sm_120 allow per block (plus d rel_bias's
  // accumulator with rel_bias)
  if (cuda::fa2::bwd_smem_bytes(p.D) + cuda::fa2::bwd_terms_smem_bytes(p.score_terms()) >
      max_smem_optin(q.get_device_index()))
    return false;
  return !force_simple();
}

// The forward's last step, dense and packed alike: the fast kernel when `fast` (fp16 / bf16
// only), else the simple one.
void launch_forward(const AttentionParams& p, ScalarType dtype, bool fast, cudaStream_t stream,
                    const char* name) {
  dispatch_cuda_type(dtype, name, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
      if (fast) {
        ATTN_EXT_CUDA_CHECK(cuda::fa2::launch_fa2_fwd<T>(p, stream));
        return;
      }
    }
    ATTN_EXT_CUDA_CHECK(cuda::simple::launch_simple_fwd<T>(p, stream));
  });
}

// The backward's last step: the fast kernel adds dq with fp32 atomics into a zeroed buffer of
// dq's shape, copied into dq after; the simple kernels write dq, dk, dv (and d rel_bias
// through the diagonal workspace drel_diag, undefined without rel_bias) themselves.
void launch_backward(const AttentionBwdParams& bp, ScalarType dtype, bool fast,
                     const Tensor& delta, const Tensor& drel_diag, Tensor& dq,
                     cudaStream_t stream, const char* name) {
  Tensor dq_accum;
  if (fast) dq_accum = alloc_zeros(delta, sizes_vec(dq), delta.scalar_type());  // fp32 atomics target
  dispatch_cuda_type(dtype, name, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
      if (fast) {
        ATTN_EXT_CUDA_CHECK(cuda::fa2::launch_fa2_bwd<T>(bp, static_cast<float*>(delta.data_ptr()),
                                                         static_cast<float*>(dq_accum.data_ptr()),
                                                         stream));
        return;
      }
    }
    ATTN_EXT_CUDA_CHECK(cuda::simple::launch_simple_bwd<T>(
        bp, delta.data_ptr(), drel_diag.defined() ? drel_diag.data_ptr() : nullptr, stream));
  });
  if (fast) torch::stable::copy_(dq, dq_accum);
}

// After every forward launch: the rows left with lse NaN settled (simple::launch_settle_lse).
void settle_lse(const AttentionParams& p, ScalarType dtype, cudaStream_t stream) {
  dispatch_cuda_type(dtype, "attention_forward", [&](auto tag) {
    using T = decltype(tag);
    ATTN_EXT_CUDA_CHECK(cuda::simple::launch_settle_lse<T>(p, stream));
  });
}

std::tuple<Tensor, Tensor> attention_forward_cuda(
    const Tensor& q, const Tensor& k, const Tensor& v, bool causal, std::optional<double> scale,
    int64_t window_left, int64_t window_right, const OptTensor& key_padding_mask,
    const OptTensor& alibi_slopes, const OptTensor& rel_bias, std::optional<double> softcap,
    const OptTensor& sinks, double dropout_p, int64_t dropout_seed, int64_t dropout_offset,
    std::optional<int64_t> q_start, std::optional<int64_t> k_start) {
  const AttentionShape s = check_attention_inputs(q, k, v, scale);
  check_cuda_head_dims(s);
  Tensor out = alloc(q, {s.B, s.Sq, s.H, s.Dv});
  Tensor lse = alloc(q, {s.B, s.H, s.Sq}, lse_dtype(q.scalar_type()));
  const AccTables tab(alibi_slopes, rel_bias, sinks, q);
  const ScoreTerms terms = checked_terms(
      {tab.alibi_slopes, tab.rel_bias, softcap, tab.sinks, dropout_p, dropout_seed, dropout_offset},
      q, s);
  check_mask_args(s, q, causal, window_left, window_right, key_padding_mask, q_start, k_start,
                  sinks.has_value());
  if (s.B * s.H * s.Sq == 0) return {out, lse};
  check_grid_rows(s.B * s.H * s.Sq, "query");
  const DeviceGuard guard(q.get_device_index());
  cudaStream_t stream = current_cuda_stream(q.get_device_index());
  AttentionParams p = make_attention_params(q, k, v, out, lse, s, causal, scale);
  fill_mask_params(p, s, q, causal, window_left, window_right, key_padding_mask);
  p.terms = terms;
  fill_block_position(p, q_start, k_start, sinks.has_value());
  const SplitPlan split = plan_split(p, q.get_device_index());
  if (split.n_split > 1) {
    const int64_t items = s.B * s.H * s.Sq * split.n_split;
    check_grid_rows(items, "query x key-chunk");
    Tensor part_o = alloc(lse, {items, s.Dv});
    Tensor part_ml = alloc(lse, {items, 2});
    dispatch_cuda_type(q.scalar_type(), "attention_forward", [&](auto tag) {
      using T = decltype(tag);
      ATTN_EXT_CUDA_CHECK(cuda::simple::launch_simple_fwd_split<T>(
          p, split.chunk, split.n_split, part_o.data_ptr(), part_ml.data_ptr(), stream));
    });
  } else {
    launch_forward(p, q.scalar_type(), use_fast_forward(q, k, v, p), stream, "attention_forward");
  }
  settle_lse(p, q.scalar_type(), stream);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> attention_backward_cuda(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse_in, bool causal, std::optional<double> scale, int64_t window_left,
    int64_t window_right, const OptTensor& key_padding_mask, const OptTensor& dlse,
    const OptTensor& alibi_slopes, const OptTensor& rel_bias, std::optional<double> softcap,
    double dropout_p, int64_t dropout_seed, int64_t dropout_offset, bool deterministic,
    std::optional<int64_t> q_start, std::optional<int64_t> k_start) {
  const AttentionShape s = check_attention_inputs(q, k, v, scale);
  check_attention_bwd_inputs(dout, out, lse_in, q, s);
  check_cuda_head_dims(s);
  if (dlse.has_value()) check_dlse(*dlse, lse_in);
  const OptTensor no_sinks;  // the backward reads the sinks through lse
  const AccTables tab(alibi_slopes, rel_bias, no_sinks, q);
  const ScoreTerms terms = checked_terms(
      {tab.alibi_slopes, tab.rel_bias, softcap, no_sinks, dropout_p, dropout_seed, dropout_offset},
      q, s);
  Tensor drel_bias = make_drel_bias(tab.rel_bias, q);
  Tensor dq = alloc(q, {s.B, s.Sq, s.H, s.D});
  Tensor dk = alloc(q, {s.B, s.Sk, s.Hkv, s.D});
  Tensor dv = alloc(q, {s.B, s.Sk, s.Hkv, s.Dv});
  check_mask_args(s, q, causal, window_left, window_right, key_padding_mask, q_start, k_start,
                  /*has_sinks=*/false);
  // (no gradient to compute, unless rel_bias's reaches lse: D = Dv = 0 with a dlse)
  if (dq.numel() == 0 && dk.numel() == 0 && dv.numel() == 0 &&
      !(rel_bias.has_value() && dlse.has_value())) {
    return {dq, dk, dv, drel_as_table(drel_bias, rel_bias)};
  }
  const DeviceGuard guard(q.get_device_index());
  if (s.Sq == 0 || s.H == 0) {  // no query: no gradient reaches k or v
    torch::stable::zero_(dk);
    torch::stable::zero_(dv);
    return {dq, dk, dv, drel_as_table(drel_bias, rel_bias)};
  }
  if (s.Sk == 0) {  // no key: every row is empty, dq = 0
    torch::stable::zero_(dq);
    return {dq, dk, dv, drel_as_table(drel_bias, rel_bias)};
  }
  check_grid_rows(s.B * s.H * s.Sq, "query");
  check_grid_rows(s.B * s.Hkv * s.Sk, "key");
  cudaStream_t stream = current_cuda_stream(q.get_device_index());
  const Tensor lse = torch::stable::contiguous(lse_in);
  // delta_i = rowsum(dO_i * O_i), (B, H, Sq) in the accumulation type (lse's dtype)
  Tensor delta = alloc(lse, {s.B, s.H, s.Sq});
  AttentionBwdParams bp =
      make_attention_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, s, causal, scale);
  fill_mask_params(bp.fwd, s, q, causal, window_left, window_right, key_padding_mask);
  bp.fwd.terms = terms;
  fill_block_position(bp.fwd, q_start, k_start, /*has_sinks=*/false);
  if (rel_bias.has_value()) bp.drel_bias = drel_bias.data_ptr();
  const Tensor dlse_c = dlse.has_value() ? torch::stable::contiguous(*dlse) : Tensor();
  if (dlse_c.defined()) bp.dlse = dlse_c.data_ptr();
  const bool fast = use_fast_backward(dout, q, k, v, bp.fwd, deterministic);
  // the simple kernels' d rel_bias diagonals (the fast kernel sums per CTA in shared memory)
  const Tensor drel_diag = fast ? Tensor() : drel_workspace(bp, lse);
  launch_backward(bp, q.scalar_type(), fast, delta, drel_diag, dq, stream, "attention_backward");
  return {dq, dk, dv, drel_as_table(drel_bias, rel_bias)};
}

// Packed sequences, dispatched as the batched ops (split-KV aside). cu_seqlens are read on the
// device only (checking them here would need a host sync): every kernel takes a sequence's
// rows from Visibility::seq(b), which checks the values against the packed row counts and
// max_seqlen, device-asserts on a bad one (a clear message at the next synchronising call)
// and treats it as empty, so nothing is read out of bounds.
std::tuple<Tensor, Tensor> attention_varlen_forward_cuda(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
    const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    std::optional<double> scale, int64_t window_left, int64_t window_right,
    const OptTensor& alibi_slopes, const OptTensor& rel_bias, std::optional<double> softcap,
    const OptTensor& sinks, double dropout_p, int64_t dropout_seed, int64_t dropout_offset) {
  using torch::stable::unsqueeze;
  const AttentionShape s = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, scale);
  check_cuda_head_dims(s);
  const AccTables tab(alibi_slopes, rel_bias, sinks, q);
  const ScoreTerms terms = checked_terms(
      {tab.alibi_slopes, tab.rel_bias, softcap, tab.sinks, dropout_p, dropout_seed, dropout_offset},
      q, s);
  const int64_t Tq = q.size(0);
  Tensor out = alloc(q, {Tq, s.H, s.Dv});
  Tensor lse = alloc(q, {s.H, Tq}, lse_dtype(q.scalar_type()));
  check_mask_args(s, q, causal, window_left, window_right, std::nullopt, std::nullopt,
                  std::nullopt, false);  // (the window: make_params_packed's, below)
  if (Tq * s.H == 0 || s.B == 0) return {out, lse};
  check_grid_rows(s.B * s.H * s.Sq, "query");
  const DeviceGuard guard(q.get_device_index());
  cudaStream_t stream = current_cuda_stream(q.get_device_index());
  AttentionParams p = make_attention_params(unsqueeze(q, 0), unsqueeze(k, 0), unsqueeze(v, 0),
                                            unsqueeze(out, 0), lse, s, causal, scale);
  make_params_packed(p, s, Tq, k.size(0), cu_seqlens_q, cu_seqlens_k, causal, window_left, window_right);
  p.terms = terms;
  // p.Sq / p.Sk are the longest sequence's: the fast kernel's conditions on them hold for all
  launch_forward(p, q.scalar_type(), use_fast_forward(q, k, v, p), stream,
                 "attention_varlen_forward");
  settle_lse(p, q.scalar_type(), stream);
  return {out, lse};
}

// deterministic: True keeps the fast backward (fp32 dq atomics) out, as in the batched op;
// the simple kernels are always deterministic (no atomics; d rel_bias too).
std::tuple<Tensor, Tensor, Tensor, Tensor> attention_varlen_backward_cuda(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse_in, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal, std::optional<double> scale,
    int64_t window_left, int64_t window_right, const OptTensor& dlse,
    const OptTensor& alibi_slopes, const OptTensor& rel_bias, std::optional<double> softcap,
    double dropout_p, int64_t dropout_seed, int64_t dropout_offset, bool deterministic) {
  const AttentionShape s = check_varlen_bwd_inputs(dout, q, k, v, out, lse_in, cu_seqlens_q,
                                                   cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   scale, dlse);
  check_cuda_head_dims(s);
  const OptTensor no_sinks;  // the backward reads the sinks through lse
  const AccTables tab(alibi_slopes, rel_bias, no_sinks, q);
  const ScoreTerms terms = checked_terms(
      {tab.alibi_slopes, tab.rel_bias, softcap, no_sinks, dropout_p, dropout_seed, dropout_offset},
      q, s);
  Tensor drel_bias = make_drel_bias(tab.rel_bias, q);
  const int64_t Tq = q.size(0), Tk = k.size(0);
  Tensor dq = alloc_zeros(q, {Tq, s.H, s.D}, q.scalar_type());
  Tensor dk = alloc_zeros(q, {Tk, s.Hkv, s.D}, q.scalar_type());
  Tensor dv = alloc_zeros(q, {Tk, s.Hkv, s.Dv}, q.scalar_type());
  check_mask_args(s, q, causal, window_left, window_right, std::nullopt, std::nullopt,
                  std::nullopt, false);  // (the window: make_varlen_bwd_params', below)
  if (Tq == 0 || s.H == 0 || Tk == 0 || s.B == 0) return {dq, dk, dv, drel_as_table(drel_bias, rel_bias)};
  check_grid_rows(s.B * s.H * s.Sq, "query");
  check_grid_rows(s.B * s.Hkv * s.Sk, "key");
  const DeviceGuard guard(q.get_device_index());
  cudaStream_t stream = current_cuda_stream(q.get_device_index());
  const Tensor lse = torch::stable::contiguous(lse_in);
  const Tensor dlse_c = dlse.has_value() ? torch::stable::contiguous(*dlse) : Tensor();
  AttentionBwdParams bp = make_varlen_bwd_params(dout, q, k, v, out, lse, dlse_c, dq, dk, dv, s,
                                                 cu_seqlens_q, cu_seqlens_k, causal, scale,
                                                 window_left, window_right);
  bp.fwd.terms = terms;
  if (rel_bias.has_value()) bp.drel_bias = drel_bias.data_ptr();
  const bool fast = use_fast_backward(dout, q, k, v, bp.fwd, deterministic);
  const Tensor drel_diag = fast ? Tensor() : drel_workspace(bp, lse);
  // delta: (B, H, Sq) for the simple kernels; laid out as lse (H, Tq) for the fast one
  Tensor delta = fast ? alloc(lse, {s.H, Tq}) : alloc(lse, {s.B, s.H, s.Sq});
  launch_backward(bp, q.scalar_type(), fast, delta, drel_diag, dq, stream,
                  "attention_varlen_backward");
  return {dq, dk, dv, drel_as_table(drel_bias, rel_bias)};
}

}  // namespace

ATTN_EXT_LIBRARY_IMPL(CUDA, m) {
  m.impl("attention_forward", TORCH_BOX(&attention_forward_cuda));
  m.impl("attention_backward_rel_bias", TORCH_BOX(&attention_backward_cuda));
  m.impl("attention_backward", TORCH_BOX(without_drel<&attention_backward_cuda>));
  m.impl("attention_varlen_forward", TORCH_BOX(&attention_varlen_forward_cuda));
  m.impl("attention_varlen_backward_rel_bias", TORCH_BOX(&attention_varlen_backward_cuda));
  m.impl("attention_varlen_backward", TORCH_BOX(without_drel<&attention_varlen_backward_cuda>));
}

// Which CUDA attention kernels later calls in this process use: 0 = the dispatch rules above
// (fast where supported), 1 = the simple kernels only (tests and benchmarks compare the
// kernels on the same inputs). Returns the previous mode. Defined here, not in csrc/ops.cpp,
// so that the op exists exactly when its kernel does (this library loaded).
ATTN_EXT_LIBRARY_FRAGMENT(m) {
  m.def("_set_cuda_attention_kernels(int mode) -> int");
}

ATTN_EXT_LIBRARY_IMPL(CompositeExplicitAutograd, m) {
  m.impl("_set_cuda_attention_kernels", TORCH_BOX(&set_cuda_attention_kernels));
}

}  // namespace attn_ext
