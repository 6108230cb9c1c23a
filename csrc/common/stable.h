// The one place attn_ext meets PyTorch's C++ API: the LibTorch stable ABI (torch/csrc/stable,
// torch/headeronly), targeting torch 2.11 (-DTORCH_TARGET_VERSION=0x020b000000000000 on every
// compiler), so one build loads in every torch from 2.11 on. No ATen / c10 library symbols.
//
// What lives here: the tensor and dtype aliases, the printers that let STD_TORCH_CHECK
// messages name shapes / strides / dtypes / devices the way ATen prints them
// ("got shape [2, 3]", "got Float"), the dtype dispatch macro, the accumulation-type trait
// (ATen's opmath_type is not in the stable ABI) and the thread count.
#pragma once

#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/Dispatch_v2.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/Half.h>

#include <cstdint>
#include <ostream>
#include <type_traits>
#include <vector>

#if !defined(TORCH_TARGET_VERSION)
#error "attn_ext is built against the stable ABI: compile with -DTORCH_TARGET_VERSION=0x020b000000000000"
#endif

// For attn_ext types that hold torch::stable::Tensor references (that type lives in torch's
// hidden-visibility namespace; a default-visibility holder draws -Wattributes).
#if defined(__GNUC__)
#define ATTN_EXT_HIDDEN __attribute__((visibility("hidden")))
#else
#define ATTN_EXT_HIDDEN
#endif

namespace attn_ext {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;
using OptTensor = std::optional<torch::stable::Tensor>;

namespace dtype {
constexpr ScalarType kFloat = ScalarType::Float;
constexpr ScalarType kDouble = ScalarType::Double;
constexpr ScalarType kHalf = ScalarType::Half;
constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
constexpr ScalarType kLong = ScalarType::Long;
}  // namespace dtype

// ---- printers for STD_TORCH_CHECK messages ------------------------------------------------
// `<< shape_of(t)` prints "[2, 3]" (ATen's IntArrayRef format); dtypes print as ATen's names
// ("Float", "BFloat16") through torch/headeronly's operator<<.
struct IntList {
  std::vector<int64_t> v;
};
inline std::ostream& operator<<(std::ostream& os, const IntList& l) {
  os << '[';
  for (size_t i = 0; i < l.v.size(); ++i) os << (i ? ", " : "") << l.v[i];
  return os << ']';
}
inline IntList int_list(torch::headeronly::IntHeaderOnlyArrayRef r) {
  return IntList{std::vector<int64_t>(r.begin(), r.end())};
}
inline IntList shape_of(const Tensor& t) { return int_list(t.sizes()); }
inline IntList strides_of(const Tensor& t) { return int_list(t.strides()); }
inline bool same_sizes(const Tensor& t, const std::vector<int64_t>& s) {
  const auto r = t.sizes();
  return r.size() == s.size() && std::equal(r.begin(), r.end(), s.begin());
}

// "cpu", "cuda:0" (ATen's device names for the devices attn_ext supports).
struct DeviceName {
  torch::headeronly::DeviceType type;
  int index;
  bool has_index;
};
inline std::ostream& operator<<(std::ostream& os, const DeviceName& n) {
  switch (n.type) {
    case torch::headeronly::DeviceType::CPU: os << "cpu"; break;
    case torch::headeronly::DeviceType::CUDA: os << "cuda"; break;
    case torch::headeronly::DeviceType::Meta: os << "meta"; break;
    default: os << "device_type_" << static_cast<int>(n.type); break;
  }
  if (n.has_index) os << ':' << n.index;
  return os;
}
inline DeviceName device_of(const Tensor& t) {
  const torch::stable::Device d = t.device();
  return DeviceName{d.type(), static_cast<int>(d.index()), d.has_index()};
}

// ---- accumulation type (ATen's opmath_type): fp32 for fp16 / bf16 / fp32, fp64 for fp64 ----
template <typename T>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;

// ---- threads: torch's intra-op pool (torch::stable::parallel_for runs on it) --------------
inline int64_t num_threads() { return static_cast<int64_t>(torch::stable::get_num_threads()); }

// New contiguous tensors on `like`'s device (dtype: like's, or dt). Through the C shim's
// aoti_torch_empty_strided (at::empty_strided): torch::stable::new_empty goes through
// torch_call_dispatcher, which looks aten::new_empty up by name and boxes its arguments on
// every call, ~1.3 us of a ~7 us tiny forward (two allocations: out, lse).
inline Tensor alloc(const Tensor& like, const std::vector<int64_t>& sizes, ScalarType dt) {
  int32_t device_type = 0, device_index = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  const int64_t n = static_cast<int64_t>(sizes.size());
  int64_t strides[8];
  std::vector<int64_t> strides_heap;
  int64_t* st = strides;
  if (n > 8) {
    strides_heap.resize(static_cast<size_t>(n));
    st = strides_heap.data();
  }
  int64_t step = 1;  // torch's contiguous strides (a size-0 / size-1 dim counts as 1)
  for (int64_t i = n - 1; i >= 0; --i) {
    st[i] = step;
    step *= sizes[static_cast<size_t>(i)] > 1 ? sizes[static_cast<size_t>(i)] : 1;
  }
  const int32_t dtype = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dt));
  AtenTensorHandle out = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(n, sizes.data(), st, dtype, device_type,
                                                         device_index, &out));
  return Tensor(out);
}
inline Tensor alloc(const Tensor& like, const std::vector<int64_t>& sizes) {
  return alloc(like, sizes, like.scalar_type());
}
inline Tensor alloc_zeros(const Tensor& like, const std::vector<int64_t>& sizes, ScalarType dt) {
  return torch::stable::new_zeros(like, sizes, dt);
}
inline std::vector<int64_t> sizes_vec(const Tensor& t) {
  const auto r = t.sizes();
  return std::vector<int64_t>(r.begin(), r.end());
}

}  // namespace attn_ext

// Calls the following lambda body with `scalar_t` = float, double, c10::Half, c10::BFloat16
// (torch/headeronly types) for the dtype `TYPE`; any other dtype raises naming NAME. The
// body is parenthesised so that commas in it (kernel<scalar_t, float>) survive the macros.
#define ATTN_EXT_DISPATCH_FLOATING(TYPE, NAME, ...)                                   \
  THO_DISPATCH_V2(TYPE, NAME, (__VA_ARGS__), AT_FLOATING_TYPES,                       \
                  torch::headeronly::ScalarType::Half, torch::headeronly::ScalarType::BFloat16)
