// Every attn_ext schema, once. Kernels live in csrc/cpu/<op>.cpp and csrc/cuda/<op>.cu
// (ATTN_EXT_LIBRARY_IMPL per dispatch key, common/registration.h); fake kernels and autograd
// are registered from Python in attn_ext/ops.py. Semantics: ../shared/DESIGN.md. Stable ABI:
// common/stable.h.
#include "common/registration.h"
#include "common/stable.h"

#include <string>

#if defined(ATTN_EXT_STANDALONE_LIBRARY)
#include <dlfcn.h>

#include <cstdio>

namespace attn_ext {
namespace registration {

bool namespace_is_free() {
  static const bool is_free = [] {
    // A DEF library claims the namespace; one that fails means another library holds it
    // (torch's error text is not shown: the shim only returns a failure code). The probe is
    // released at once, so the schema block below claims the namespace again.
    TorchLibraryHandle probe = nullptr;
    if (aoti_torch_library_init_def("attn_ext", __FILE__, __LINE__, &probe) ==
            AOTI_TORCH_SUCCESS &&
        probe != nullptr) {
      aoti_torch_delete_library_object(probe);
      return true;
    }
    Dl_info self{};
    const char* path = dladdr(reinterpret_cast<void*>(&namespace_is_free), &self) != 0 &&
                               self.dli_fname != nullptr
                           ? self.dli_fname
                           : "libattn_ext_ops";
    std::fprintf(stderr,
                 "attn_ext: %s registers no ops: the attn_ext operators are already registered "
                 "in this process (by `import attn_ext`, or another copy of this library); the "
                 "ones registered first stay in use. Load either this library or the Python "
                 "package, not both.\n",
                 path);
    return false;
  }();
  return is_free;
}

}  // namespace registration
}  // namespace attn_ext
#endif

namespace {

// The arguments of each pair of backward schemas (attention_backward and
// attention_backward_rel_bias, and the varlen pair; their meaning at the definitions below):
// one list per pair, so the two cannot drift apart. (def copies the schema text.)
constexpr const char* kBackwardArgs =
      "    Tensor dout,"
      "    Tensor q,"
      "    Tensor k,"
      "    Tensor v,"
      "    Tensor out,"
      "    Tensor lse,"
      "    bool causal,"
      "    float? scale=None,"
      "    int window_left=-1,"
      "    int window_right=-1,"
      "    Tensor? key_padding_mask=None,"
      "    Tensor? dlse=None,"
      "    Tensor? alibi_slopes=None,"
      "    Tensor? rel_bias=None,"
      "    float? softcap=None,"
      "    float dropout_p=0.0,"
      "    SymInt dropout_seed=0,"
      "    SymInt dropout_offset=0,"
      "    bool deterministic=False,"
      "    int? q_start=None,"
      "    int? k_start=None";
constexpr const char* kVarlenBackwardArgs =
      "    Tensor dout,"
      "    Tensor q,"
      "    Tensor k,"
      "    Tensor v,"
      "    Tensor out,"
      "    Tensor lse,"
      "    Tensor cu_seqlens_q,"
      "    Tensor cu_seqlens_k,"
      "    SymInt max_seqlen_q,"
      "    SymInt max_seqlen_k,"
      "    bool causal=False,"
      "    float? scale=None,"
      "    int window_left=-1,"
      "    int window_right=-1,"
      "    Tensor? dlse=None,"
      "    Tensor? alibi_slopes=None,"
      "    Tensor? rel_bias=None,"
      "    float? softcap=None,"
      "    float dropout_p=0.0,"
      "    SymInt dropout_seed=0,"
      "    SymInt dropout_offset=0,"
      "    bool deterministic=False";

}  // namespace

ATTN_EXT_LIBRARY(m) {
  // name(args) -> (dq, dk, dv) and name_rel_bias(args) -> (dq, dk, dv, drel_bias)
  auto def_backward_pair = [&m](const std::string& name, const char* args) {
    m.def((name + "(" + args + ") -> (Tensor dq, Tensor dk, Tensor dv)").c_str());
    m.def((name + "_rel_bias(" + args +
           ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor drel_bias)").c_str());
  };
  // ---- positional encodings -------------------------------------------------------------
  // out = x + PE, PE(pos, 2i) = sin(pos / base^(2i/D)), PE(pos, 2i+1) = cos(...), computed on
  // the fly. x: (B, S, D) or (S, D); positions: int64 (S,) or (B, S); else pos = offset + s.
  m.def(
      "sinusoidal_pe("
      "    Tensor x,"
      "    Tensor? positions=None,"
      "    SymInt offset=0,"
      "    float base=10000.0"
      ") -> Tensor");
  m.def(
      "sinusoidal_pe_("
      "    Tensor(a!) x,"
      "    Tensor? positions=None,"
      "    SymInt offset=0,"
      "    float base=10000.0"
      ") -> ()");

  // ---- rotary position embedding (RoPE) --------------------------------------------------
  // x: (B, S, H, D), any strides on B, S, H, last dim contiguous. cos/sin: (S_max, R/2),
  // float32 or x's dtype; rotary_dim R = 2 * cos.size(-1) <= D, channels past R pass through.
  // Angle of row (b, s): table row pos = positions[s] / positions[b, s] (int64 (S,) or
  // (B, S)) or offset + s. interleaved=False pairs channels (i, i + R/2) (GPT-NeoX / HF),
  // True pairs (2i, 2i + 1) (GPT-J / Meta LLaMA). Out-of-place output is contiguous.
  m.def(
      "rope("
      "    Tensor x,"
      "    Tensor cos,"
      "    Tensor sin,"
      "    Tensor? positions=None,"
      "    SymInt offset=0,"
      "    bool interleaved=False"
      ") -> Tensor");
  m.def(
      "rope_("
      "    Tensor(a!) x,"
      "    Tensor cos,"
      "    Tensor sin,"
      "    Tensor? positions=None,"
      "    SymInt offset=0,"
      "    bool interleaved=False"
      ") -> ()");
  // q (B, S, H, D) and k (B, S, Hkv, Dk) rotated in place in one parallel region / launch.
  m.def(
      "rope_qk_("
      "    Tensor(a!) q,"
      "    Tensor(b!) k,"
      "    Tensor cos,"
      "    Tensor sin,"
      "    Tensor? positions=None,"
      "    SymInt offset=0,"
      "    bool interleaved=False"
      ") -> ()");
  // The inverse rotation (angle -theta, i.e. -sin): the backward of rope, out of place.
  m.def(
      "_rope_backward("
      "    Tensor grad,"
      "    Tensor cos,"
      "    Tensor sin,"
      "    Tensor? positions=None,"
      "    SymInt offset=0,"
      "    bool interleaved=False"
      ") -> Tensor");

  // ---- attention ----------------------------------------------------------------------------
  // q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv): any strides, last dim contiguous.
  // Hkv divides H (query head h reads kv head h / (H / Hkv)); scale defaults to 1/sqrt(D).
  // Which keys row i sees (DESIGN.md "Attention variants", csrc/common/attention_mask.h),
  // with d = i + (Sk - Sq) - j: causal -> d >= 0 (bottom-right aligned); window
  // (window_left, window_right) -> -window_right <= d <= window_left, -1 = unbounded side;
  // key_padding_mask (B, Sk) bool -> key j takes part iff key_padding_mask[b, j].
  // A row that sees no key gives out 0 and lse -inf.
  // out (B, Sq, H, Dv) contiguous; lse (B, H, Sq) float32 (float64 for float64 inputs).
  // Score terms (DESIGN.md, common/attention_mask.h ScoreTerms), float32 tables (float64 for
  // float64 inputs): alibi_slopes (H,) or (B, H) -> s -= slope * |d|; rel_bias (H, 2M + 1) ->
  // s += rel_bias[h, M + clamp(d, -M, M)]; softcap > 0 -> s = softcap * tanh(s / softcap)
  // first; sinks (H,) -> exp(sinks[h]) joins every row's denominator (lse includes it);
  // dropout_p in [0, 1) on the probabilities, keep bit from (dropout_seed, dropout_offset, b, h,
  // i, j) (common/dropout_rng.h; the Python wrapper draws seed/offset from torch's generator).
  // q_start / k_start (both or neither): the call is the block of queries [q_start, q_start +
  // Sq) and keys [k_start, k_start + Sk) of one longer sequence (ring attention, issue 17);
  // causal, window, ALiBi and rel_bias then use the global distance d = (q_start + i) -
  // (k_start + j), and dropout the keep bit of (q_start + i, k_start + j), so the block's
  // (out, lse) is exactly that part of the whole-sequence call (common/attention_mask_checks.h).
  // The mask and term arguments were added after scale with defaults, so the original
  // attention_forward(q, k, v, causal[, scale]) calls (TorchScript, C++) keep working.
  m.def(
      "attention_forward("
      "    Tensor q,"
      "    Tensor k,"
      "    Tensor v,"
      "    bool causal,"
      "    float? scale=None,"
      "    int window_left=-1,"
      "    int window_right=-1,"
      "    Tensor? key_padding_mask=None,"
      "    Tensor? alibi_slopes=None,"
      "    Tensor? rel_bias=None,"
      "    float? softcap=None,"
      "    Tensor? sinks=None,"
      "    float dropout_p=0.0,"
      "    SymInt dropout_seed=0,"
      "    SymInt dropout_offset=0,"
      "    int? q_start=None,"
      "    int? k_start=None"
      ") -> (Tensor out, Tensor lse)");
  // Gradients of out (and of lse, through dlse) with respect to q, k, v (shapes and dtypes of
  // q, k, v; BSHD contiguous, except on CPU for an input that is the transpose(1, 2) view of a
  // contiguous (B, H, S, D) tensor: its gradient is the same kind of view, so autograd adds it
  // to a BHSD leaf without a copy), recomputing the probabilities from lse. dout: (B, Sq, H, Dv),
  // last dim contiguous; dlse: lse's shape and dtype, None = zero. The mask and term arguments
  // are the forward's (sinks need none: lse holds them; their gradient is
  // exp(sink - lse) * (dlse - rowsum(dout * out)) summed over rows, computed by the caller).
  // deterministic=True selects bitwise-reproducible kernels (CUDA: the simple kernels instead
  // of the fast one's fp32 atomics; the CPU backward is always deterministic). The stable ABI
  // cannot read torch.are_deterministic_algorithms_enabled(), so the caller passes it: the
  // Python autograd formula does; C++ / TorchScript callers pass it explicitly. It ends the
  // varlen backward's schema; the dense one adds q_start / k_start after it (as the forward).
  // attention_backward returns the three gradients (issue 4's schema);
  // attention_backward_rel_bias, the same call, also d rel_bias (H, 2M + 1), or an
  // empty (0,) tensor without rel_bias (autograd uses it). One kernel serves both
  // (common/attention_checks.h without_drel).
  def_backward_pair("attention_backward", kBackwardArgs);
  // Packed sequences (FlashAttention's varlen convention): q (Tq, H, D), k (Tk, Hkv, D),
  // v (Tk, Hkv, Dv); sequence b owns rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and
  // [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k / v (int32 (N + 1,), from 0, non-decreasing,
  // ending at Tq / Tk); max_seqlen_* bound every sequence's length. causal and window apply
  // per sequence, bottom-right aligned to that sequence's lengths. out (Tq, H, Dv), lse (H, Tq).
  // Terms as attention_forward's, per sequence (b = sequence; alibi_slopes (N, H) or (H,)).
  m.def(
      "attention_varlen_forward("
      "    Tensor q,"
      "    Tensor k,"
      "    Tensor v,"
      "    Tensor cu_seqlens_q,"
      "    Tensor cu_seqlens_k,"
      "    SymInt max_seqlen_q,"
      "    SymInt max_seqlen_k,"
      "    bool causal=False,"
      "    float? scale=None,"
      "    int window_left=-1,"
      "    int window_right=-1,"
      "    Tensor? alibi_slopes=None,"
      "    Tensor? rel_bias=None,"
      "    float? softcap=None,"
      "    Tensor? sinks=None,"
      "    float dropout_p=0.0,"
      "    SymInt dropout_seed=0,"
      "    SymInt dropout_offset=0"
      ") -> (Tensor out, Tensor lse)");
  // attention_varlen_backward returns the three gradients (issue 4's schema);
  // attention_varlen_backward_rel_bias, the same call, also d rel_bias (H, 2M + 1), or an
  // empty (0,) tensor without rel_bias (autograd uses it). One kernel serves both
  // (common/attention_checks.h without_drel).
  def_backward_pair("attention_varlen_backward", kVarlenBackwardArgs);
  // out of attention_forward. Composite (csrc/attention_composite.cpp): differentiable
  // through attention_forward's autograd formula, so a backend implements only
  // attention_forward / attention_backward.
  m.def(
      "attention("
      "    Tensor q,"
      "    Tensor k,"
      "    Tensor v,"
      "    bool causal=False,"
      "    float? scale=None"
      ") -> Tensor");
  m.def(
      "causal_attention("
      "    Tensor q,"
      "    Tensor k,"
      "    Tensor v,"
      "    float? scale=None"
      ") -> Tensor");

  // ---- diagnostics ------------------------------------------------------------------------
  // Runs a torch::stable::parallel_for over n items and returns how many distinct threads took
  // part: proves the kernels really run on torch's intra-op pool.
  m.def("_parallel_threads(int n) -> int");
  // (_set_cuda_attention_kernels, the CUDA kernel switch, is defined by the CUDA library
  // itself, csrc/cuda/attention.cu: a CPU build has no schema without a kernel.)
}
