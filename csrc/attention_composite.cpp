// attn_ext::attention and attn_ext::causal_attention: CompositeImplicitAutograd kernels that
// call attn_ext::attention_forward through the dispatcher (torch_call_dispatcher, the stable
// ABI's boxed call) and return its out. Every backend (CPU, CUDA, fake) and autograd
// (attention_forward's formula, registered in attn_ext/ops.py) therefore come from
// attention_forward / attention_backward alone, and TorchScript or C++ callers get a
// single-output op.
#include <dlfcn.h>

#include <array>
#include <optional>
#include <stdexcept>
#include <string>

#include "common/registration.h"
#include "common/stable.h"

namespace attn_ext {
namespace {

// The message of the exception that made the last shim call fail. The shim that returns it
// (torch_exception_get_what_without_backtrace) exists from torch 2.13 on; this library
// targets 2.11, so it is looked up at run time and older torches get a pointer to stderr
// (where the shim has printed the message) instead.
std::string last_shim_error() {
  using GetWhat = const char* (*)();
  static const auto get_what = reinterpret_cast<GetWhat>(
      dlsym(RTLD_DEFAULT, "torch_exception_get_what_without_backtrace"));
  const char* what = get_what != nullptr ? get_what() : nullptr;
  if (what == nullptr || *what == '\0') return "(its message was printed to stderr)";
  // A Python kernel's error arrives as "RuntimeError: <message>\n\nAt:\n<Python frames>".
  std::string msg(what);
  const auto frames = msg.find("\n\nAt:\n");
  if (frames != std::string::npos) msg.resize(frames);
  const std::string prefix = "RuntimeError: ";
  if (msg.rfind(prefix, 0) == 0) msg.erase(0, prefix.size());
  return msg;
}

Tensor call_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                              std::optional<double> scale) {
  // torch_call_dispatcher takes the full stack: every argument of attention_forward's schema
  // (csrc/ops.cpp), defaults included (no window, no key_padding_mask, no score terms, no
  // dropout). The outputs come back in its first two slots.
  using torch::stable::detail::from;
  const OptTensor none = std::nullopt;
  const std::optional<double> no_softcap = std::nullopt;
  const std::optional<int64_t> no_start = std::nullopt;
  std::array<StableIValue, 17> stack{
      from(q),         from(k),
      from(v),         from(causal),
      from(scale),     from(static_cast<int64_t>(-1)),  // window_left
      from(static_cast<int64_t>(-1)),                   // window_right
      from(none),                                       // key_padding_mask
      from(none),                                       // alibi_slopes
      from(none),                                       // rel_bias
      from(no_softcap),                                 // softcap
      from(none),                                       // sinks
      from(0.0),                                        // dropout_p
      from(static_cast<int64_t>(0)),                    // dropout_seed
      from(static_cast<int64_t>(0)),                    // dropout_offset
      from(no_start),                                   // q_start
      from(no_start)};                                  // k_start
  if (torch_call_dispatcher("attn_ext::attention_forward", "", stack.data(),
                            TORCH_ABI_VERSION) != TORCH_SUCCESS) {
    throw std::runtime_error(last_shim_error());
  }
  Tensor out = torch::stable::detail::to<Tensor>(stack[0]);
  Tensor lse = torch::stable::detail::to<Tensor>(stack[1]);  // owned here, released on return
  return out;
}

Tensor attention_composite(Tensor q, Tensor k, Tensor v, bool causal,
                           std::optional<double> scale) {
  return call_attention_forward(q, k, v, causal, scale);
}

Tensor causal_attention_composite(Tensor q, Tensor k, Tensor v, std::optional<double> scale) {
  return call_attention_forward(q, k, v, true, scale);
}

}  // namespace

ATTN_EXT_LIBRARY_IMPL(CompositeImplicitAutograd, m) {
  m.impl("attention", TORCH_BOX(&attention_composite));
  m.impl("causal_attention", TORCH_BOX(&causal_attention_composite));
}

}  // namespace attn_ext
