// attn_ext::attention and attn_ext::causal_attention: CompositeImplicitAutograd kernels that
// call attn_ext::attention_forward through the dispatcher and return its out. Every backend
// (CPU, CUDA, fake) and autograd (attention_forward's formula, registered in
// attn_ext/ops.py) therefore come from attention_forward / attention_backward alone, and
// TorchScript or C++ callers get a single-output op.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace attn_ext {
namespace {

at::Tensor call_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  bool causal, std::optional<double> scale) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attn_ext::attention_forward", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
              std::optional<double>, int64_t, int64_t, const std::optional<at::Tensor>&,
              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
              std::optional<double>, const std::optional<at::Tensor>&, double, int64_t,
              int64_t)>();
  return std::get<0>(op.call(q, k, v, causal, scale, -1, -1, std::nullopt, std::nullopt,
                             std::nullopt, std::nullopt, std::nullopt, 0.0, 0, 0));
}

at::Tensor attention_composite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               bool causal, std::optional<double> scale) {
  return call_attention_forward(q, k, v, causal, scale);
}

at::Tensor causal_attention_composite(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, std::optional<double> scale) {
  return call_attention_forward(q, k, v, true, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CompositeImplicitAutograd, m) {
  m.impl("attention", &attention_composite);
  m.impl("causal_attention", &causal_attention_composite);
}

}  // namespace attn_ext
