// Cache-line aligned vectors: the CPU kernels' scratch (attention_common.h) and the tools'
// probes (tools/gemm_probe.cpp) share this one definition. No ATen / torch headers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <new>
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

}  // namespace cpu_attn
}  // namespace attn_ext
