// Input checks shared by the CPU and CUDA adapters. Every failure names the argument,
// says what was expected and what was given (DESIGN.md, "Errors").
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>

namespace attn_ext {

inline void check_floating(const at::Tensor& t, const char* name) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16,
              name, " must be float32, float64, float16 or bfloat16, got ", s);
}

inline void check_dim(const at::Tensor& t, const char* name, int64_t ndim, const char* layout) {
  TORCH_CHECK(t.dim() == ndim, name, " must have ", ndim, " dims ", layout, ", got shape ",
              t.sizes());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on the same device as ", ref_name,
              " (", ref.device(), "), got ", t.device());
}

inline void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name,
              " must have a contiguous last dim (stride 1), got strides ", t.strides());
}

// positions: int64, shape (S,) or (B, S); returns true when it is per batch (B, S).
inline bool check_positions(const at::Tensor& positions, const at::Tensor& x, int64_t B,
                            int64_t S, bool allow_batched) {
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64, got ",
              positions.scalar_type());
  check_same_device(positions, x, "positions", "x");
  if (positions.dim() == 1) {
    TORCH_CHECK(positions.size(0) == S, "positions of shape (S,) must have S = ", S,
                " entries, got shape ", positions.sizes());
    return false;
  }
  TORCH_CHECK(allow_batched && positions.dim() == 2,
              allow_batched ? "positions must have shape (S,) or (B, S), got shape "
                            : "positions must have shape (S,) for 2-D x, got shape ",
              positions.sizes());
  TORCH_CHECK(positions.size(0) == B && positions.size(1) == S,
              "positions of shape (B, S) must be (", B, ", ", S, "), got shape ",
              positions.sizes());
  return true;
}

}  // namespace attn_ext
