// Input checks shared by the CPU and CUDA adapters. Every failure names the argument,
// says what was expected and what was given (DESIGN.md, "Errors").
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "common/stable.h"

namespace attn_ext {

inline void check_floating(const Tensor& t, const char* name) {
  const auto s = t.scalar_type();
  STD_TORCH_CHECK(s == dtype::kFloat || s == dtype::kDouble || s == dtype::kHalf ||
                      s == dtype::kBFloat16,
                  name, " must be float32, float64, float16 or bfloat16, got ", s);
}

// A tensor argument given as None (a direct torch.ops call) arrives undefined.
inline void check_defined(const Tensor& t, const char* name) {
  STD_TORCH_CHECK(t.defined(), name, " must be a tensor, got None");
}

inline void check_dim(const Tensor& t, const char* name, int64_t ndim, const char* layout) {
  check_defined(t, name);
  STD_TORCH_CHECK(t.dim() == ndim, name, " must have ", ndim, " dims ", layout, ", got shape ",
                  shape_of(t));
}

inline void check_same_device(const Tensor& t, const Tensor& ref, const char* name,
                              const char* ref_name) {
  STD_TORCH_CHECK(t.device() == ref.device(), name, " must be on the same device as ", ref_name,
                  " (", device_of(ref), "), got ", device_of(t));
}

inline void check_last_dim_contiguous(const Tensor& t, const char* name) {
  STD_TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name,
                  " must have a contiguous last dim (stride 1), got strides ", strides_of(t));
}

// positions: int64, shape (S,) or (B, S); returns true when it is per batch (B, S). They are
// absolute, so an offset beside them (which they would silently override) is refused.
inline bool check_positions(const Tensor& positions, const Tensor& x, int64_t B, int64_t S,
                            bool allow_batched, int64_t offset) {
  STD_TORCH_CHECK(offset == 0, "offset must be 0 when positions are given (positions are "
                  "absolute; add the offset to them), got offset = ", offset);
  STD_TORCH_CHECK(positions.scalar_type() == dtype::kLong, "positions must be int64, got ",
                  positions.scalar_type());
  check_same_device(positions, x, "positions", "x");
  if (positions.dim() == 1) {
    STD_TORCH_CHECK(positions.size(0) == S, "positions of shape (S,) must have S = ", S,
                    " entries, got shape ", shape_of(positions));
    return false;
  }
  STD_TORCH_CHECK(allow_batched && positions.dim() == 2,
                  allow_batched ? "positions must have shape (S,) or (B, S), got shape "
                                : "positions must have shape (S,) for 2-D x, got shape ",
                  shape_of(positions));
  STD_TORCH_CHECK(positions.size(0) == B && positions.size(1) == S,
                  "positions of shape (B, S) must be (", B, ", ", S, "), got shape ",
                  shape_of(positions));
  return true;
}

// ---- aliasing of in-place arguments --------------------------------------------------------
// An in-place op writes each element of its argument once; an argument whose elements share
// memory (an expand()ed view, as_strided with overlapping strides) or two arguments that share
// elements (rope_qk_(x, x, ...)) would be rotated twice on CPU and raced on CUDA.
namespace overlap {

// Element runs [start, start + len) (in elements, relative to a common base pointer) of a
// tensor whose last dim is either contiguous (one run per row) or not (one run per element).
inline void append_runs(const Tensor& t, int64_t base, std::vector<std::pair<int64_t, int64_t>>& runs) {
  const int64_t nd = t.dim();
  const bool rows = nd > 0 && (t.size(nd - 1) <= 1 || t.stride(nd - 1) == 1);
  const int64_t len = rows && nd > 0 ? t.size(nd - 1) : 1;
  const int64_t outer_dims = rows ? nd - 1 : nd;
  std::vector<int64_t> idx(static_cast<size_t>(std::max<int64_t>(outer_dims, 0)), 0);
  for (;;) {
    int64_t off = base;
    for (int64_t d = 0; d < outer_dims; ++d) off += idx[d] * t.stride(d);
    runs.emplace_back(off, off + len);
    int64_t d = outer_dims - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < t.size(d)) break;
      idx[d] = 0;
    }
    if (d < 0) break;
  }
}

inline bool runs_overlap(std::vector<std::pair<int64_t, int64_t>>& runs) {
  std::sort(runs.begin(), runs.end());
  for (size_t i = 1; i < runs.size(); ++i) {
    if (runs[i].first < runs[i - 1].second) return true;
  }
  return false;
}

// Sufficient condition for "no two indices address the same element": with the dims of
// size > 1 sorted by stride, each stride exceeds the furthest element the smaller dims reach.
inline bool surely_no_self_overlap(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // furthest element offset the smaller dims reach
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return false;
    reach += stride * (size - 1);
  }
  return true;
}

// Dims of size > 1 merged where they form one arithmetic run: [(size, stride)], outer first.
inline std::vector<std::pair<int64_t, int64_t>> coalesced(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 1) continue;
    if (!out.empty() && out.back().second == t.size(d) * t.stride(d)) {
      out.back() = {out.back().first * t.size(d), t.stride(d)};
    } else {
      out.emplace_back(t.size(d), t.stride(d));
    }
  }
  return out;
}

inline int64_t span_elems(const Tensor& t) {  // offset of the last element + 1
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return last + 1;
}

// [first byte, one past the last byte) that a non-empty tensor with non-negative strides spans.
inline std::pair<intptr_t, intptr_t> byte_range(const Tensor& t) {
  const auto p = reinterpret_cast<intptr_t>(t.data_ptr());
  return {p, p + span_elems(t) * static_cast<intptr_t>(t.element_size())};
}

}  // namespace overlap

// `name` must not address one element twice (in-place argument).
inline void check_no_internal_overlap(const Tensor& t, const char* name, const char* op) {
  if (t.numel() <= 1 || overlap::surely_no_self_overlap(t)) return;
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t d = 0; d < t.dim(); ++d) {
    STD_TORCH_CHECK(t.stride(d) >= 0 || t.size(d) <= 1, name, " (in place, ", op,
                    ") must not have negative strides, got strides ", strides_of(t));
  }
  overlap::append_runs(t, 0, runs);
  STD_TORCH_CHECK(!overlap::runs_overlap(runs), name, " (in place, ", op,
                  ") must not overlap itself (several indices address one element, e.g. an "
                  "expand()ed view), got shape ", shape_of(t), " and strides ", strides_of(t));
}

// `read` (an input the in-place op only reads, e.g. rope_'s cos / sin tables, possibly of
// another dtype) must not lie in the bytes `written` spans: their address ranges must be
// disjoint (a table written while it is read would give a wrong rotation, no error).
inline void check_disjoint_from_written(const Tensor& written, const char* w_name,
                                        const Tensor& read, const char* r_name, const char* op) {
  if (written.numel() == 0 || read.numel() == 0) return;
  const auto [wa, wb] = overlap::byte_range(written);
  const auto [ra, rb] = overlap::byte_range(read);
  STD_TORCH_CHECK(wb <= ra || rb <= wa, r_name, " must not overlap ", w_name, " (", op, " writes ",
                  w_name, " in place while it reads ", r_name, "), got ", r_name,
                  " inside the memory of ", w_name, " (shape ", shape_of(written), ", strides ",
                  strides_of(written), ")");
}

// a and b (same dtype, each free of internal overlap) must not share an element.
inline void check_no_overlap(const Tensor& a, const char* a_name, const Tensor& b,
                             const char* b_name, const char* op) {
  if (a.numel() == 0 || b.numel() == 0) return;
  const auto esize = static_cast<int64_t>(a.element_size());
  const auto [pa, a_end] = overlap::byte_range(a);
  const auto [pb, b_end] = overlap::byte_range(b);
  if (a_end <= pb || b_end <= pa) return;  // disjoint address ranges
  bool shared = true;
  const intptr_t delta_bytes = pb - pa;
  if (delta_bytes % esize == 0) {
    const int64_t delta = static_cast<int64_t>(delta_bytes / esize);
    const auto ca = overlap::coalesced(a);
    const auto cb = overlap::coalesced(b);
    if (ca.size() == 2 && cb.size() == 2 && ca[1].second == 1 && cb[1].second == 1 &&
        ca[0].second == cb[0].second && ca[1].first == cb[1].first && ca[0].second >= ca[1].first) {
      // Both are N runs of R elements every P (e.g. q and k of one fused QKV buffer): b's
      // runs start at delta + m P, a's at n P; they meet iff |delta + (m - n) P| < R.
      const int64_t P = ca[0].second, R = ca[1].first, Na = ca[0].first, Nb = cb[0].first;
      shared = false;
      const int64_t c0 = delta >= 0 ? delta / P : -((-delta + P - 1) / P);  // floor(delta / P)
      for (int64_t c = c0 - 1; c <= c0 + 1; ++c) {
        // n - m = c with 0 <= n < Na, 0 <= m < Nb
        if (c > Na - 1 || c < -(Nb - 1)) continue;
        const int64_t gap = delta - c * P;
        if (gap > -R && gap < R) shared = true;
      }
    } else {
      std::vector<std::pair<int64_t, int64_t>> runs;
      overlap::append_runs(a, 0, runs);
      overlap::append_runs(b, delta, runs);
      shared = overlap::runs_overlap(runs);
    }
  }
  STD_TORCH_CHECK(!shared, a_name, " and ", b_name, " (in place, ", op,
                  ") must not overlap in memory, got ", a_name, " shape ", shape_of(a),
                  " strides ", strides_of(a), " and ", b_name, " shape ", shape_of(b),
                  " strides ", strides_of(b), " sharing elements");
}

}  // namespace attn_ext
