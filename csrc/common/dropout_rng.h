// The attention-dropout keep bit: one counter-based rule for every kernel (CPU forward and
// backward, CUDA simple and fast kernels) and for attn_ext/reference.py, which mirrors it
// (tests/test_dropout_rng.py compiles this header and compares the two bit for bit).
//
// The keep bit of (b, h, i, j) is a pure function of (seed, offset, b, h, i, j), with i and j
// the GLOBAL query and key rows (per sequence for packed input; the ring-attention shard's
// global positions), so the forward, the backward, any tiling, any thread count and both
// backends see the same mask. No state, no sizes: a tile anywhere in the (Sq, Sk) plane
// computes its bits on its own.
//
//   row key   r = mix(mix(mix(mix(mix(seed) ^ offset) ^ b) ^ h) ^ i)      once per row
//   word      w = mix(r ^ ((j >> 2) * kGolden))                           one per 4 keys
//   field     u = (w >> (16 * (j & 3))) & 0xffff                          16 bits per key
//   keep  iff u >= threshold,  threshold = dropout_threshold(p) = round(p * 65536)
//
// mix is SplitMix64's finaliser (a bijection of 64-bit words with full avalanche), so the
// words of different (row, j >> 2) are independent for every practical purpose. The keep
// probability is 1 - threshold / 65536, which differs from 1 - p by at most 2^-17; kept
// probabilities are rescaled by 1 / (1 - p).
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ATTN_EXT_HD __host__ __device__ __forceinline__
#else
#define ATTN_EXT_HD inline
#endif

namespace attn_ext {
namespace dropout {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;  // 2^64 / golden ratio, odd
constexpr int kBitsPerKey = 16;
constexpr int kKeysPerWord = 64 / kBitsPerKey;  // 4

ATTN_EXT_HD uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The largest drop probability the 16-bit field represents: past it threshold() rounds to
// 65536 and every key is dropped (the ops refuse p above it).
constexpr double kMaxDropoutP = 1.0 - 1.0 / 65536.0;

// Threshold of the 16-bit field for drop probability p in [0, 1): drop iff field < threshold.
ATTN_EXT_HD uint32_t threshold(double p) {
  const double t = p * 65536.0 + 0.5;
  return t <= 0.0 ? 0u : (t >= 65536.0 ? 65536u : static_cast<uint32_t>(t));
}

// Once per query row.
ATTN_EXT_HD uint64_t row_key(uint64_t seed, uint64_t offset, int64_t b, int64_t h, int64_t i) {
  uint64_t r = mix(seed);
  r = mix(r ^ offset);
  r = mix(r ^ static_cast<uint64_t>(b));
  r = mix(r ^ static_cast<uint64_t>(h));
  return mix(r ^ static_cast<uint64_t>(i));
}

// The 64-bit word holding the fields of keys 4 * (j >> 2) .. 4 * (j >> 2) + 3.
ATTN_EXT_HD uint64_t word(uint64_t row, int64_t j) {
  return mix(row ^ (static_cast<uint64_t>(j >> 2) * kGolden));
}

ATTN_EXT_HD uint32_t field(uint64_t w, int64_t j) {
  return static_cast<uint32_t>(w >> (kBitsPerKey * (j & 3))) & 0xffffu;
}

// True when key j of the row survives dropout.
ATTN_EXT_HD bool keep(uint64_t row, int64_t j, uint32_t thresh) {
  return field(word(row, j), j) >= thresh;
}

}  // namespace dropout
}  // namespace attn_ext
