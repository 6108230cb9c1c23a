// Cache-line aligned vectors: the CPU kernels' scratch (attention_common.h) and the tools'
// probes (tools/gemm_probe.cpp) share this one definition. No ATen / torch headers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <new>
#include <type_traits>
#include <vector>

namespace attn_ext {
namespace cpu_attn {

// Allocator of cache-line (64-byte) aligned scratch: tile rows are multiples of 16 floats, so
// with an aligned base no 32-byte vector load or store of a tile straddles two cache lines.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) {
    const size_t bytes = std::max<size_t>(64, (n * sizeof(T) + 63) / 64 * 64);
    void* ptr = std::aligned_alloc(64, bytes);
    if (ptr == nullptr) throw std::bad_alloc();
    return static_cast<T*>(ptr);
  }
  void deallocate(T* ptr, size_t) { std::free(ptr); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};

template <typename T>
using AlignedVec = std::vector<T, CacheLineAllocator<T>>;

// The same allocator, except that an element made without a value is default-initialised
// (left as it is, for float and the 16-bit floats), so ScratchVec<T>(n) and resize(n) allocate
// without writing n zeros: for scratch whose every element is written before it is read.
// (Construction with a value falls back to placement new: std::allocator_traits.)
template <typename T>
struct CacheLineScratchAllocator : CacheLineAllocator<T> {
  CacheLineScratchAllocator() = default;
  template <typename U>
  CacheLineScratchAllocator(const CacheLineScratchAllocator<U>&) {}
  template <typename U>
  void construct(U* ptr) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(ptr)) U;
  }
};

template <typename T>
using ScratchVec = std::vector<T, CacheLineScratchAllocator<T>>;

}  // namespace cpu_attn
}  // namespace attn_ext
