// attn_ext::attention_forward / attention_backward on CUDA: ATen adapter (checks shared with
// the CPU adapter, outputs, dtype and kernel dispatch, device guard, current stream). Device
// code: attention_fwd_kernel.cuh (fast forward) and attention_simple_kernel.cuh (everything
// else, and the backward).
//
// Kernels are instantiated in attention_simple.cu and attention_fa2_hdim{64,128}.cu
// (declared in attention_launch.h); this file holds no device code.
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
//        B, H <= 65535 (grid y/z).
//   2. otherwise the simple kernel (simple::launch_simple_fwd): any dtype (fp32, fp64, fp16,
//      bf16), any D, Dv <= 256, any strides with a contiguous last dim.
// ATTN_EXT_CUDA_ATTN=simple in the environment (read at each call) skips 0 and 1: tests use
// it to compare the kernels on the same inputs.
// Head dims above 256 are rejected with an error naming the argument.
// Backward dispatch:
//   1. fast FA2-style tensor-core backward (fa2::launch_fa2_bwd, attention_bwd_kernel.cuh)
//      under the fast forward's conditions but D in {64, 128} only (dout also 16-byte aligned with
//      strides multiples of 8) and when its shared memory fits the device (155 KiB at
//      D = 128: not on sm_86 / sm_89 / sm_120), unless torch.use_deterministic_algorithms(True)
//      is set: its dQ is accumulated with fp32 atomics, so its dq is not bitwise reproducible
//      (dk, dv are).
//   2. otherwise the simple kernels (dQ per query row, then dK/dV per key row; no atomics,
//      deterministic), any dtype and head dim <= 256.
// ATTN_EXT_CUDA_ATTN=simple forces the simple kernels here too.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>

#include "common/attention_checks.h"
#include "common/attention_mask_checks.h"
#include "common/score_checks.h"
#include "cuda/attention_launch.h"

namespace attn_ext {
namespace {

// Calls f(T{}) with T the CUDA-side element type of `dtype` (the kernels use the CUDA types
// __half / __nv_bfloat16, which have the same layout as c10::Half / c10::BFloat16).
template <typename F>
void dispatch_cuda_type(at::ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kDouble: f(double{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", dtype);
  }
}

void check_cuda_head_dims(const AttentionShape& s) {
  TORCH_CHECK(s.D <= cuda::simple::kMaxHeadDim, "q and k head dim D must be <= ",
              cuda::simple::kMaxHeadDim, " on CUDA, got D = ", s.D);
  TORCH_CHECK(s.Dv <= cuda::simple::kMaxHeadDim, "v head dim Dv must be <= ",
              cuda::simple::kMaxHeadDim, " on CUDA, got Dv = ", s.Dv);
}

void check_grid_rows(int64_t rows, const char* what) {
  const int64_t blocks = (rows + cuda::simple::kWarps - 1) / cuda::simple::kWarps;
  TORCH_CHECK(blocks <= 0x7fffffff, "attention on CUDA: too many ", what, " rows (", rows,
              ") for one launch");
}

// The CUDA kernels do not take the score terms of issue 15 yet (alibi_slopes, rel_bias, softcap, sinks, dropout).
void check_cuda_terms_unsupported(const ScoreArgs& a) {
  const char* what = a.alibi_slopes.has_value() ? "alibi_slopes"
                     : a.rel_bias.has_value()   ? "rel_bias"
                     : a.softcap.has_value()    ? "softcap"
                     : a.sinks.has_value()      ? "sinks"
                                                : "dropout_p";
  TORCH_CHECK(!score_terms_requested(a), "attention on CUDA: ", what,
              " is not supported yet (CPU only)");
}

bool aligned16(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (t.stride(d) % 8 != 0) return false;
  }
  return true;
}

bool force_simple() {
  const char* env = std::getenv("ATTN_EXT_CUDA_ATTN");
  return env != nullptr && std::strcmp(env, "simple") == 0;
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

bool use_fast_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const AttentionParams& p) {
  const auto dt = q.scalar_type();
  if (dt != at::kHalf && dt != at::kBFloat16) return false;
  if (p.D != p.Dv || !cuda::fa2::fwd_fast_head_dim(p.D)) return false;
  if (p.Sk <= 0 || p.Sq <= 0) return false;
  if (!aligned16(q) || !aligned16(k) || !aligned16(v)) return false;
  if (!cuda::fa2::fwd_fast_grid_ok(p)) return false;
  if (cuda::fa2::fwd_smem_bytes(p.D) > max_smem_optin(q.device().index())) return false;
  return !force_simple();
}

bool use_fast_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const AttentionParams& p) {
  const auto dt = q.scalar_type();
  if (dt != at::kHalf && dt != at::kBFloat16) return false;
  if (p.D != p.Dv || (p.D != 64 && p.D != 128)) return false;
  if (p.Sk <= 0 || p.Sq <= 0) return false;
  if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(dout)) return false;
  if (!cuda::fa2::bwd_fast_grid_ok(p)) return false;
  if (at::globalContext().deterministicAlgorithms()) return false;
  // 155 KiB at D = 128: more than sm_86 / sm_89 / sm_120 allow per block
  if (cuda::fa2::bwd_smem_bytes(p.D) > max_smem_optin(q.device().index())) return false;
  return !force_simple();
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cuda(const at::Tensor& q,
                                                          const at::Tensor& k,
                                                          const at::Tensor& v, bool causal,
                                                          std::optional<double> scale,
                                                          int64_t window_left, int64_t window_right,
                                                          const std::optional<at::Tensor>& key_padding_mask,
                                                          const std::optional<at::Tensor>& alibi_slopes,
                                                          const std::optional<at::Tensor>& rel_bias,
                                                          std::optional<double> softcap,
                                                          const std::optional<at::Tensor>& sinks,
                                                          double dropout_p, int64_t dropout_seed,
                                                          int64_t dropout_offset) {
  const AttentionShape s = check_attention_inputs(q, k, v, scale);
  check_cuda_head_dims(s);
  check_cuda_terms_unsupported(
      {alibi_slopes, rel_bias, softcap, sinks, dropout_p, dropout_seed, dropout_offset});
  at::Tensor out = at::empty({s.B, s.Sq, s.H, s.Dv}, q.options());
  at::Tensor lse = at::empty({s.B, s.H, s.Sq}, q.options().dtype(lse_dtype(q.scalar_type())));
  if (s.B * s.H * s.Sq == 0) return {out, lse};
  check_grid_rows(s.B * s.H * s.Sq, "query");
  const c10::cuda::CUDAGuard guard(q.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  AttentionParams p = make_attention_params(q, k, v, out, lse, s, causal, scale);
  fill_mask_params(p, s, q, causal, window_left, window_right, key_padding_mask);
  // the fast kernel knows causal only; windows and padding run on the simple kernels
  const bool masked = window_left != -1 || window_right != -1 || key_padding_mask.has_value();
  const SplitPlan split = plan_split(p, q.device().index());
  if (split.n_split > 1) {
    const int64_t items = s.B * s.H * s.Sq * split.n_split;
    check_grid_rows(items, "query x key-chunk");
    at::Tensor part_o = at::empty({items, s.Dv}, lse.options());
    at::Tensor part_ml = at::empty({items, 2}, lse.options());
    dispatch_cuda_type(q.scalar_type(), "attention_forward", [&](auto tag) {
      using T = decltype(tag);
      C10_CUDA_CHECK(cuda::simple::launch_simple_fwd_split<T>(
          p, split.chunk, split.n_split, part_o.data_ptr(), part_ml.data_ptr(), stream));
    });
    return {out, lse};
  }
  const bool fast = !masked && use_fast_forward(q, k, v, p);
  dispatch_cuda_type(q.scalar_type(), "attention_forward", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
      if (fast) {
        C10_CUDA_CHECK(cuda::fa2::launch_fa2_fwd<T>(p, stream));
        return;
      }
    }
    C10_CUDA_CHECK(cuda::simple::launch_simple_fwd<T>(p, stream));
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse_in, bool causal, std::optional<double> scale,
    int64_t window_left, int64_t window_right, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& dlse, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& rel_bias, std::optional<double> softcap, double dropout_p,
    int64_t dropout_seed, int64_t dropout_offset) {
  const AttentionShape s = check_attention_inputs(q, k, v, scale);
  check_attention_bwd_inputs(dout, out, lse_in, q, s);
  check_cuda_head_dims(s);
  if (dlse.has_value()) check_dlse(*dlse, lse_in);
  const std::optional<at::Tensor> no_sinks;
  check_cuda_terms_unsupported(
      {alibi_slopes, rel_bias, softcap, no_sinks, dropout_p, dropout_seed, dropout_offset});
  const at::Tensor drel_bias = at::empty({0}, q.options().dtype(lse_dtype(q.scalar_type())));
  at::Tensor dq = at::empty({s.B, s.Sq, s.H, s.D}, q.options());
  at::Tensor dk = at::empty({s.B, s.Sk, s.Hkv, s.D}, q.options());
  at::Tensor dv = at::empty({s.B, s.Sk, s.Hkv, s.Dv}, q.options());
  if (dq.numel() == 0 && dk.numel() == 0 && dv.numel() == 0) return {dq, dk, dv, drel_bias};
  const c10::cuda::CUDAGuard guard(q.device());
  if (s.Sq == 0 || s.H == 0) {  // no query: no gradient reaches k or v
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv, drel_bias};
  }
  if (s.Sk == 0) {  // no key: every row is empty, dq = 0
    dq.zero_();
    return {dq, dk, dv, drel_bias};
  }
  check_grid_rows(s.B * s.H * s.Sq, "query");
  check_grid_rows(s.B * s.Hkv * s.Sk, "key");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  const at::Tensor lse = lse_in.contiguous();
  // delta_i = rowsum(dO_i * O_i), (B, H, Sq) in the accumulation type (lse's dtype)
  at::Tensor delta = at::empty({s.B, s.H, s.Sq}, lse.options());
  AttentionBwdParams bp =
      make_attention_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, s, causal, scale);
  fill_mask_params(bp.fwd, s, q, causal, window_left, window_right, key_padding_mask);
  const at::Tensor dlse_c = dlse.has_value() ? dlse->contiguous() : at::Tensor();
  if (dlse_c.defined()) bp.dlse = dlse_c.data_ptr();
  // the fast backward knows causal only, without dlse: the rest runs on the simple kernels
  const bool masked = window_left != -1 || window_right != -1 || key_padding_mask.has_value() ||
                      dlse.has_value();
  const bool fast = !masked && use_fast_backward(dout, q, k, v, bp.fwd);
  at::Tensor dq_accum;
  if (fast) dq_accum = at::zeros({s.B, s.Sq, s.H, s.D}, lse.options());  // fp32 atomics target
  dispatch_cuda_type(q.scalar_type(), "attention_backward", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
      if (fast) {
        C10_CUDA_CHECK(cuda::fa2::launch_fa2_bwd<T>(bp, delta.data_ptr<float>(),
                                                    dq_accum.data_ptr<float>(), stream));
        return;
      }
    }
    C10_CUDA_CHECK(cuda::simple::launch_simple_bwd<T>(bp, delta.data_ptr(), stream));
  });
  if (fast) dq.copy_(dq_accum);
  return {dq, dk, dv, drel_bias};
}

// Packed sequences on the simple kernels (cu_seqlens are read on the device only: their
// values are not checked here, which would need a host sync; the kernels read rows
// [cu[b], cu[b + 1]) as given, so the caller must pass valid cu_seqlens and max_seqlen).
std::tuple<at::Tensor, at::Tensor> attention_varlen_forward_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    std::optional<double> scale, int64_t window_left, int64_t window_right,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& rel_bias,
    std::optional<double> softcap, const std::optional<at::Tensor>& sinks, double dropout_p,
    int64_t dropout_seed, int64_t dropout_offset) {
  const AttentionShape s = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, scale);
  check_cuda_head_dims(s);
  check_cuda_terms_unsupported(
      {alibi_slopes, rel_bias, softcap, sinks, dropout_p, dropout_seed, dropout_offset});
  const int64_t Tq = q.size(0);
  at::Tensor out = at::empty({Tq, s.H, s.Dv}, q.options());
  at::Tensor lse = at::empty({s.H, Tq}, q.options().dtype(lse_dtype(q.scalar_type())));
  if (Tq * s.H == 0 || s.B == 0) return {out, lse};
  check_grid_rows(s.B * s.H * s.Sq, "query");
  const c10::cuda::CUDAGuard guard(q.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  AttentionParams p = make_attention_params(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                            out.unsqueeze(0), lse, s, causal, scale);
  make_params_packed(p, s, Tq, cu_seqlens_q, cu_seqlens_k, causal, window_left, window_right);
  dispatch_cuda_type(q.scalar_type(), "attention_varlen_forward", [&](auto tag) {
    using T = decltype(tag);
    C10_CUDA_CHECK(cuda::simple::launch_simple_fwd<T>(p, stream));
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse_in, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    std::optional<double> scale, int64_t window_left, int64_t window_right,
    const std::optional<at::Tensor>& dlse, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& rel_bias, std::optional<double> softcap, double dropout_p,
    int64_t dropout_seed, int64_t dropout_offset) {
  const AttentionShape s = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, scale);
  check_cuda_head_dims(s);
  const std::optional<at::Tensor> no_sinks;
  check_cuda_terms_unsupported(
      {alibi_slopes, rel_bias, softcap, no_sinks, dropout_p, dropout_seed, dropout_offset});
  const at::Tensor drel_bias = at::empty({0}, q.options().dtype(lse_dtype(q.scalar_type())));
  const int64_t Tq = q.size(0), Tk = k.size(0);
  check_dim(dout, "dout", 3, "(Tq, H, Dv)");
  check_dim(out, "out", 3, "(Tq, H, Dv)");
  check_dim(lse_in, "lse", 2, "(H, Tq)");
  const AttentionShape s1{1, Tq, Tk, s.H, s.Hkv, s.D, s.Dv};
  check_attention_bwd_inputs(dout.unsqueeze(0), out.unsqueeze(0), lse_in.unsqueeze(0), q, s1);
  if (dlse.has_value()) check_dlse(*dlse, lse_in);
  at::Tensor dq = at::zeros({Tq, s.H, s.D}, q.options());
  at::Tensor dk = at::zeros({Tk, s.Hkv, s.D}, q.options());
  at::Tensor dv = at::zeros({Tk, s.Hkv, s.Dv}, q.options());
  if (Tq == 0 || s.H == 0 || Tk == 0 || s.B == 0) return {dq, dk, dv, drel_bias};
  check_grid_rows(s.B * s.H * s.Sq, "query");
  check_grid_rows(s.B * s.Hkv * s.Sk, "key");
  const c10::cuda::CUDAGuard guard(q.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  const at::Tensor lse = lse_in.contiguous();
  at::Tensor delta = at::empty({s.B, s.H, s.Sq}, lse.options());
  AttentionBwdParams bp = make_attention_bwd_params(
      dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0), lse,
      dq, dk, dv, s, causal, scale);
  make_params_packed(bp.fwd, s, Tq, cu_seqlens_q, cu_seqlens_k, causal, window_left, window_right);
  bp.dout_batch_stride = bp.o_batch_stride = 0;
  bp.dq_batch_stride = bp.dk_batch_stride = bp.dv_batch_stride = 0;
  const at::Tensor dlse_c = dlse.has_value() ? dlse->contiguous() : at::Tensor();
  if (dlse_c.defined()) bp.dlse = dlse_c.data_ptr();
  dispatch_cuda_type(q.scalar_type(), "attention_varlen_backward", [&](auto tag) {
    using T = decltype(tag);
    C10_CUDA_CHECK(cuda::simple::launch_simple_bwd<T>(bp, delta.data_ptr(), stream));
  });
  return {dq, dk, dv, drel_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("attention_forward", &attention_forward_cuda);
  m.impl("attention_backward", &attention_backward_cuda);
  m.impl("attention_varlen_forward", &attention_varlen_forward_cuda);
  m.impl("attention_varlen_backward", &attention_varlen_backward_cuda);
}

}  // namespace attn_ext
