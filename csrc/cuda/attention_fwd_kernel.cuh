// Fast attention forward for fp16 / bf16 on sm_80+ (FlashAttention-2 structure, our own code).
// Pointers, strides and a stream; no ATen types. The adapter (attention.cu) decides when this
// kernel applies (use_fast_forward) and otherwise runs the simple kernel.
//
//   q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, D)  -> out (B, Sq, H, D), lse (B, H, Sq)
//   (packed sequences: q (Tq, H, D) ..., out (Tq, H, D), lse (H, Tq), rows from cu_seqlens)
//   Requirements (checked by the adapter): D == Dv in {32, 64, 96, 128, 256}; q/k/v base
//   pointers 16-byte aligned and their batch/row/head strides multiples of 8 elements (every
//   16-byte chunk of a row is aligned for cp.async); Sq, Sk > 0, Sq + Sk < 2^30 (32-bit tile math).
//
// Structure
//   * One CTA per (query tile of kBlockM = 64 rows, head, sequence); 4 warps, warp w owns
//     query rows [16 w, 16 w + 16) of the tile, so every softmax statistic lives in one warp.
//     Its sequence (packed rows, lengths, bottom-right offset) comes from Visibility::seq(b);
//     CTAs past the end of a shorter packed sequence exit at once.
//   * Q tile and two K and two V tiles (double buffering) in shared memory, filled with 16-byte
//     cp.async; rows past Sq / Sk are zero-filled (src-size 0), so no NaN from stale memory
//     ever reaches P.V.
//   * S = Q K^T and O += P V with mma.sync.m16n8k16 (fp32 accumulators); A/B fragments by
//     ldmatrix (.trans for V); P stays in registers: the S accumulator layout of two adjacent
//     n8 tiles is exactly the A-fragment layout of one k16 step.
//   * Online softmax in registers, in base 2 (scores times scale * log2 e), per-row max and sum
//     reduced over the 4 lanes of a quad.
//   * Masks (causal, window, key padding) come from the visibility layer
//     (common/attention_mask.h), never from a rule of this file: a query tile visits the key
//     tiles of band_keys_of_rows (none invisible by the band), skips those whose keys are all
//     padded (padding bits by warp ballot), runs the tiles that classify() calls kFull
//     (full_key_tiles: the same answer as one range per CTA, cheaper in registers than a
//     classify per tile) without a predicate, and masks kPartial ones per element (TileBand
//     and the key's padding bit). Rows that see no key give 0 and lse -inf; a hidden key's non-finite V
//     never reaches a row (see pass 3). Grid (query tiles, H, B) with the query tile fastest:
//     the CTAs in flight together are all the tiles of a few heads (their K/V stay in L2),
//     and when masked the last query tiles (most keys, when causal) launch first.
//   * Score terms (kTerms; issue 15): softcap, ALiBi and rel_bias through ScoreTerms::add
//     (common/attention_mask.h) on every element of the score fragment, after the scaling and
//     before the mask; sinks in the epilogue's normalisation (ScoreTerms::sink_normalise, as
//     the simple and CPU kernels). Dropout too: the keep bits of common/dropout_rng.h on P
//     after the row sums (kTerms instances; see "dropout on P" in the key loop).
//
// Tile choice: kBlockM = 64 query rows, 128 threads; kBlockN = 64 keys per step up to
// D = 128, 32 at D = 256. 64 keys give each warp 8 n8 score tiles (32 fp32 registers) next to
// the O accumulator's D/8 n8 tiles (64 registers at D = 128); at D = 256 O alone takes 128,
// so the key step halves to keep S at 16 and the kernel under 255 registers without spilling.
// Shared rows are padded by 16 bytes (row stride D + 8 elements), which moves each of the 8
// rows an ldmatrix phase reads to a different 16-byte bank group (conflict-free without a
// swizzle; the stride is 4 or 20 words mod 32 for every D here, both conflict-free).
// Shared memory: (64 + 4 * kBlockN) rows * (D + 8) * 2 bytes = 25 / 45 / 65 / 85 KiB at
// D = 32 / 64 / 96 / 128 and 99 KiB (101376 bytes) at D = 256, which is exactly the opt-in
// limit of sm_86 / sm_89; the adapter compares it with the device's limit and otherwise runs
// the simple kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/attention_params.h"
#include "cuda/mma_ptx.cuh"

namespace attn_ext {
namespace cuda {
namespace fa2 {

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T zero_elem();
template <>
__device__ __forceinline__ __half zero_elem<__half>() { return __float2half(0.f); }
template <>
__device__ __forceinline__ __nv_bfloat16 zero_elem<__nv_bfloat16>() { return __float2bfloat16(0.f); }

template <int kHeadDim_>
struct FwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64;  // query rows per CTA (4 warps x 16)
  // keys per step: 64, or 32 at D = 256 (keeps S at 16 registers next to the 128 of O, and
  // shared memory at 101 KiB instead of 165)
  static constexpr int kBlockN = kHeadDim <= 128 ? 64 : 32;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  // 2 CTAs per SM: lets ptxas use up to 255 registers (without an explicit minimum it capped
  // the D = 64 kernel at 128 on sm_90 and spilled).
  static constexpr int kMinBlocks = 2;
  static constexpr int kStride = kHeadDim + 8;  // padded shared row, elements
  static constexpr int kTile = kBlockN * kStride;  // one K or V buffer, elements
  static constexpr int kSmemBytes = (kBlockM * kStride + 4 * kTile) * 2;
  static_assert(kHeadDim % 16 == 0, "head dim must be a multiple of 16");
};

// ---- the kernel ----------------------------------------------------------------------------
// grid (num_m_blocks, H, B); blockIdx.x = 0 is the heaviest query tile of its head when masked.
// kMask (MaskMode, attention_launch.h): 0 no mask (Visibility::dense(): every key of the
// sequence is visible, only the end of the keys masks), 1 a band (causal / window) without
// key padding, 2 key padding (with or without a band). The padding code costs registers, so
// the plain causal path (1) does not carry it. Packed sequences (varlen) run in every mode:
// the CTA's sequence comes from seq(b).
// kTerms: p.terms has softcap / ALiBi / rel_bias, sinks and / or dropout (the keep bits of
// common/dropout_rng.h on P after the row sums, as every other kernel: the same mask).
template <typename T, int kHeadDim, int kMask, bool kTerms>
__global__ void __launch_bounds__(FwdTraits<kHeadDim>::kThreads, FwdTraits<kHeadDim>::kMinBlocks)
    fa2_fwd_kernel(AttentionParams p) {
  using Tr = FwdTraits<kHeadDim>;
  constexpr bool kMasked = kMask != 0, kPadding = kMask == 2;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kStride = Tr::kStride;
  constexpr int kNTiles = kBlockN / 8;    // n8 score tiles per warp row block
  constexpr int kDTiles = kHeadDim / 8;   // n8 output tiles
  constexpr int kKeyWords = kBlockN / 32;  // 32-bit words of a key tile's padding bits
  static_assert(kBlockN % 32 == 0, "whole ballot words per key tile");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // (kBlockM, kStride)
  T* sK = sQ + kBlockM * kStride;           // 2 x (kBlockN, kStride)
  T* sV = sK + 2 * Tr::kTile;               // 2 x (kBlockN, kStride)

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t hkv = h / (p.H / p.Hkv);
  const int m_block = kMasked ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
  const int m0 = m_block * kBlockM;
  // Which keys a row sees: the visibility layer (common/attention_mask.h) only. sq: this
  // CTA's sequence (its rows q0.., keys k0.. in the packed tensors; lengths; offset).
  // Lengths and tile positions in 32 bits (the adapter checks Sq + Sk < 2^30); bands: the
  // sequence's TileBand in 32-bit arithmetic.
  const Visibility vis = p.visibility();
  const SeqInfo sq = vis.seq(b);
  const TileBands bands = vis.tile_bands(sq);
  const int Sq = bands.Sq, Sk = bands.Sk;
  if (m0 >= Sq) return;  // past the end of its (packed) sequence
  const int m1 = m0 + kBlockM < Sq ? m0 + kBlockM : Sq;  // the tile's rows [m0, m1)

  // key tiles [n_begin, n_end) hold every key some row of this tile sees by the band (none of
  // them is invisible by the band); classify() calls [full_lo, full_hi) of them kFull
  // (full_key_tiles: the same answer as one range, computed once per CTA)
  Visibility::TileSpan span;
  if (!kMasked) {  // every key of the sequence is visible (dense())
    span = Visibility::TileSpan::dense(Sk, kBlockN);
  } else if (Sk > 0) {
    span = vis.key_tile_span(sq, m0, m1, kBlockN);
  }
  const int n_begin = span.begin, n_end = span.end, full_lo = span.full_lo, full_hi = span.full_hi;
  // The class of key tile n (n_begin <= n < n_end) for this query tile: the band's, a tile
  // past the end of the keys is partial (its zero-filled rows must not count), and with key
  // padding the per-key flags: all padded -> invisible (skipped), some -> partial. kv[w] bit
  // c: key n * kBlockN + 32 w + c takes part (every warp computes the same words by ballot).
  auto tile_kind = [&](int n, uint32_t (&kv)[kKeyWords]) -> TileKind {
    const int n0 = n * kBlockN;
    const int n1 = n0 + kBlockN < Sk ? n0 + kBlockN : Sk;
    TileKind kind = n >= full_lo && n < full_hi ? TileKind::kFull : TileKind::kPartial;
    if (kind == TileKind::kFull && n0 + kBlockN > Sk) kind = TileKind::kPartial;
#pragma unroll
    for (int w = 0; w < kKeyWords; ++w) kv[w] = 0xffffffffu;
    if constexpr (kPadding) {
      if (kind != TileKind::kInvisible) {
        int valid = 0;
#pragma unroll
        for (int w = 0; w < kKeyWords; ++w) {
          const int j = n0 + 32 * w + lane;
          kv[w] = __ballot_sync(0xffffffffu, j < n1 && vis.key_valid(b, j));
          valid += __popc(kv[w]);
        }
        if (valid == 0) kind = TileKind::kInvisible;
        else if (valid < n1 - n0) kind = TileKind::kPartial;
      }
    }
    return kind;
  };

  const T* gQ = static_cast<const T*>(p.q) + b * p.q_batch_stride + sq.q0 * p.q_row_stride +
                h * p.q_head_stride;
  const T* gK = static_cast<const T*>(p.k) + b * p.k_batch_stride + sq.k0 * p.k_row_stride +
                hkv * p.k_head_stride;
  const T* gV = static_cast<const T*>(p.v) + b * p.v_batch_stride + sq.k0 * p.v_row_stride +
                hkv * p.v_head_stride;
  // out and lse (B, H, Sq), packed (H, Tq): row i of this sequence at gO()[i * row stride],
  // gLse()[i] (computed where they are written, so they hold no register in the loop)
  auto gO = [&]() {
    return static_cast<T*>(p.out) + b * p.out_batch_stride + sq.q0 * p.out_row_stride +
           h * p.out_head_stride;
  };
  auto gLse = [&]() {
    return static_cast<float*>(p.lse) + b * p.lse_batch_stride + h * p.lse_head_stride + sq.q0;
  };

  // rows of this thread: quad row g = lane / 4 of the warp's 16, and g + 8 (ra, rb: in the tile)
  const int ra = warp * 16 + (lane >> 2), rb = ra + 8;

  // the first tile that is not invisible
  int n = n_begin;
  for (; n < n_end; ++n) {
    uint32_t kv[kKeyWords];
    if (tile_kind(n, kv) != TileKind::kInvisible) break;
  }

  if (n >= n_end) {  // no row of this tile sees a key (Sq > Sk causal, padding, empty keys)
    for (int idx = tid; idx < kBlockM * kHeadDim; idx += Tr::kThreads) {
      const int64_t r = m0 + idx / kHeadDim;
      // +0.0 in fp16 and bf16 is the all-zero 16-bit pattern
      if (r < Sq) reinterpret_cast<uint16_t*>(gO())[r * p.out_row_stride + idx % kHeadDim] = 0;
    }
    if (tid < kBlockM && m0 + tid < Sq) {
      float lse_row = -INFINITY;
      if constexpr (kTerms) {
        if (p.terms.has_sinks()) {
          double lse_d;
          (void)p.terms.sink_normalise<float>(h, -INFINITY, 0.0, false, &lse_d);
          lse_row = static_cast<float>(lse_d);
        }
      }
      gLse()[m0 + tid] = lse_row;
    }
    return;
  }

  // prologue: Q and K tile n (one group)
  load_rows<T, kHeadDim, kBlockM, Tr::kThreads>(sQ, gQ, p.q_row_stride, m0, Sq, tid);
  load_rows<T, kHeadDim, kBlockN, Tr::kThreads>(sK, gK, p.k_row_stride,
                                                static_cast<int64_t>(n) * kBlockN, Sk, tid);
  cp_async_commit();

  float acc_o[kDTiles][4];
#pragma unroll
  for (int t = 0; t < kDTiles; ++t) acc_o[t][0] = acc_o[t][1] = acc_o[t][2] = acc_o[t][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // base-2 scaled
  float row_sum[2] = {0.f, 0.f};               // this thread's partial sums (quad-reduced at end)
  const float scale_log2 = static_cast<float>(p.scale) * kLog2eF;
  // score terms of this CTA's query head (kTerms): ALiBi slope, rel_bias row (centred);
  // dropout: the row keys of this thread's two rows and the keep threshold (the rescaling is
  // the epilogue's)
  float slope_h = 0.f;
  const float* rel_h = nullptr;
  uint64_t drop_ka = 0, drop_kb = 0;
  uint32_t drop_thresh = 0;
  const bool drop = kTerms && p.terms.has_dropout();
  if constexpr (kTerms) {
    if (p.terms.alibi != nullptr) slope_h = p.terms.slope<float>(b, h);
    rel_h = p.terms.rel_row<float>(h);
    if (drop) {
      const ScoreTerms dt = p.score_terms();  // the dropout bases of a block position
      drop_ka = dt.dropout_row_key(b, h, m0 + ra);
      drop_kb = dt.dropout_row_key(b, h, m0 + rb);
      drop_thresh = dropout::threshold(dt.dropout_p);
    }
  }

  // ldmatrix row/column offsets of this lane (see the fragment maps in the comments below)
  const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8;  // A (Q) and V^T: matrices 1,3 rows +8
  const int lcol = (lane >> 4) * 8;                     // A (Q) and V^T: matrices 2,3 cols +8
  const int krow = (lane & 7) + (lane >> 4) * 8;        // K: matrices 2,3 are the next 8 keys
  const int kcol = ((lane >> 3) & 1) * 8;               // K: matrices 1,3 are d + 8

  // Step it visits key tile n (the tiles that are not invisible, in order); buffers by step.
  for (int it = 0; n < n_end; ++it) {
    const int buf = it & 1;
    const int n0 = n * kBlockN;
    const T* sKb = sK + buf * Tr::kTile;
    const T* sVb = sV + buf * Tr::kTile;

    // this tile's class and padding bits (recomputed here rather than carried from the
    // search: fewer live registers), then the next tile that is not invisible (found before
    // S is live); its K is prefetched after pass 1.
    uint32_t kv[kKeyWords];
    const TileKind kind = tile_kind(n, kv);
    int n_next = n + 1;
    for (; n_next < n_end; ++n_next) {
      uint32_t kv_next[kKeyWords];
      if (tile_kind(n_next, kv_next) != TileKind::kInvisible) break;
    }

    // V tile n -> its own group; it lands while S is computed
    load_rows<T, kHeadDim, kBlockN, Tr::kThreads>(sV + buf * Tr::kTile, gV, p.v_row_stride, n0,
                                                 Sk, tid);
    cp_async_commit();
    cp_async_wait<1>();  // everything but V tile n: Q and K tile n are here
    __syncthreads();

    // pass 1: S (16 x kBlockN per warp) = Q K^T.
    //   A = Q rows [16w, 16w+16), cols [16kk, 16kk+16): ldmatrix x4 of the four 8x8 blocks
    //   (rows +0/+8) x (cols +0/+8) -> a0..a3 in mma order.
    //   B = K^T: K rows are keys with d contiguous, which is the "col" layout, so plain
    //   ldmatrix: blocks (keys +0, d +0), (keys +0, d +8) = b0, b1 of n8 tile 2nn, and
    //   (keys +8, d +0/+8) = b0, b1 of n8 tile 2nn + 1.
    float s[kNTiles][4];
#pragma unroll
    for (int t = 0; t < kNTiles; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(smem_addr(sQ + (warp * 16 + lrow) * kStride + kk * 16 + lcol), a);
#pragma unroll
      for (int nn = 0; nn < kBlockN / 16; ++nn) {
        uint32_t bk[4];
        ldmatrix_x4(smem_addr(sKb + (nn * 16 + krow) * kStride + kk * 16 + kcol), bk);
        mma_16816<T>(s[2 * nn], a, bk[0], bk[1]);
        mma_16816<T>(s[2 * nn + 1], a, bk[2], bk[3]);
      }
    }

    // K of the next tile -> the other buffer (last read in step it - 1, before this step's
    // barrier). An empty group on the last step keeps the wait counts uniform.
    if (n_next < n_end) {
      load_rows<T, kHeadDim, kBlockN, Tr::kThreads>(sK + (buf ^ 1) * Tr::kTile, gK, p.k_row_stride,
                                                    static_cast<int64_t>(n_next) * kBlockN, Sk, tid);
    }
    cp_async_commit();

    // pass 2: scale to base 2, then mask (after scaling: scale may be 0 or negative), then the
    // online softmax. Accumulator element e of n8 tile t is (row g + 8 (e >= 2),
    // key n0 + 8 t + 2 (lane % 4) + (e % 2)). A partial tile asks the visibility layer per
    // element: the band in tile coordinates (TileBand) and the key's padding bit.
#pragma unroll
    for (int t = 0; t < kNTiles; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[t][e] *= scale_log2;
    }
    // score terms (natural units in ScoreTerms::add) at d = row + off - key (the sequence's
    // offset from the visibility layer); keys past Sk get a term too (the table index is
    // clamped) and are masked just below
    if constexpr (kTerms) {
      if (p.terms.active()) {
        // ScoreTerms::add_row with the head's slope and table row looked up once per CTA, d in
        // 32 bits as the bands (the backward recomputes the same: attention_bwd_kernel.cuh)
        const int d_row_key = bands.off - n0 - (lane & 3) * 2;
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int d = m0 + (e < 2 ? ra : rb) + d_row_key - (t * 8 + (e & 1));
            s[t][e] = p.terms.add_row<float, int>(s[t][e] * kLn2F, slope_h, rel_h, d) * kLog2eF;
          }
        }
      }
    }
    const bool partial = kind == TileKind::kPartial;
    if (partial) {
      const TileBand band = bands.at(m0, n0, kBlockM, kBlockN);
      uint32_t kl[kKeyWords];  // this lane's padding bits: bit 8 (t % 4) + (e % 2) of word t / 4
#pragma unroll
      for (int w = 0; w < kKeyWords; ++w) kl[w] = kv[w] >> ((lane & 3) * 2);
#pragma unroll
      for (int t = 0; t < kNTiles; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = t * 8 + (lane & 3) * 2 + (e & 1);
          const bool ok = band.ok(e < 2 ? ra : rb, c) && ((kl[t / 4] >> ((t % 4) * 8 + (e & 1))) & 1u);
          if (!ok) s[t][e] = -INFINITY;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int t = 0; t < kNTiles; ++t) mx = fmaxf(mx, fmaxf(s[t][2 * r], s[t][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(row_max[r], mx);
      // a row that has seen no key yet keeps max -inf; subtract 0 then, never (-inf) - (-inf)
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float corr = fast_exp2(row_max[r] - m_use);
      row_max[r] = m_new;
      row_sum[r] *= corr;
#pragma unroll
      for (int t = 0; t < kDTiles; ++t) {
        acc_o[t][2 * r] *= corr;
        acc_o[t][2 * r + 1] *= corr;
      }
#pragma unroll
      for (int t = 0; t < kNTiles; ++t) {
        s[t][2 * r] = fast_exp2(s[t][2 * r] - m_use);
        s[t][2 * r + 1] = fast_exp2(s[t][2 * r + 1] - m_use);
        row_sum[r] += s[t][2 * r] + s[t][2 * r + 1];
      }
    }
    // dropout on P after the sums (the sums are of the undropped probabilities): key j of the
    // pair (j, j + 1) this lane holds in n8 tile t is n0 + 8 t + 2 (lane % 4); the global
    // column dropout_col(j) picks the 16-bit field of one 64-bit word per 4 columns
    if constexpr (kTerms) {
      if (drop) {
        const int64_t col_base = p.score_terms().dropout_col(n0 + (lane & 3) * 2);
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) {
          const int64_t col = col_base + t * 8;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const uint64_t rk = r == 0 ? drop_ka : drop_kb;
            const uint64_t w0 = dropout::word(rk, col);
            const uint64_t w1 = (col & 3) == 3 ? dropout::word(rk, col + 1) : w0;
            const bool k0 = dropout::field(w0, col) >= drop_thresh;
            const bool k1 = dropout::field(w1, col + 1) >= drop_thresh;
            s[t][2 * r] = k0 ? s[t][2 * r] : 0.f;
            s[t][2 * r + 1] = k1 ? s[t][2 * r + 1] : 0.f;
          }
        }
      }
    }

    cp_async_wait<1>();  // V tile n (only the next K tile's group may still be in flight)
    __syncthreads();

    // A hidden key's P is 0, but 0 * (inf or NaN) in its V row would reach rows that cannot
    // see it (issue 18). In a partial tile whose V holds a non-finite value (rare: only then
    // is the extra barrier paid), each thread first adds p * v of the visible (row, key)
    // pairs whose v is non-finite to its own columns exactly, then the non-finite values are
    // zeroed in shared memory and the tile's P V runs as usual. (Unmasked problems: a partial
    // tile only hides keys past Sk, zero-filled by the loads: nothing to do.)
    if (kMasked && partial) {
      bool bad = false;
      for (int idx = tid; idx < kBlockN * kHeadDim; idx += Tr::kThreads) {
        const float x = to_float(sVb[(idx / kHeadDim) * kStride + idx % kHeadDim]);
        bad |= !isfinite(x);
      }
      if (__syncthreads_or(bad)) {
        const TileBand band = bands.at(m0, n0, kBlockM, kBlockN);
        // (a copy of this thread's P made here, in the rare path, and indexed by kk at run
        // time: indexing s itself by a run-time tile put s in local memory, stored after every
        // tile's pass 1 in every masked instance)
        float sp[kNTiles][4];
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) {
#pragma unroll
          for (int e = 0; e < 4; ++e) sp[t][e] = s[t][e];
        }
#pragma unroll 1
        for (int kk = 0; kk < kBlockN; ++kk) {
          // P of key n0 + kk for rows a and b: element (kk % 2) (+2) of n8 tile kk / 8 on quad
          // lane (kk % 8) / 2
          const float* pt = sp[kk / 8];
          float pa = (kk & 1) ? pt[1] : pt[0];
          float pb = (kk & 1) ? pt[3] : pt[2];
          const int src = (lane & ~3) | ((kk & 7) >> 1);
          pa = __shfl_sync(0xffffffffu, pa, src);
          pb = __shfl_sync(0xffffffffu, pb, src);
          const uint32_t word = kKeyWords == 1 || kk < 32 ? kv[0] : kv[kKeyWords - 1];
          const bool key_ok = (word >> (kk & 31)) & 1u;
          const bool ok_a = key_ok && band.ok(ra, kk);
          const bool ok_b = key_ok && band.ok(rb, kk);
          const T* vrow = sVb + kk * kStride + (lane & 3) * 2;
#pragma unroll
          for (int t = 0; t < kDTiles; ++t) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const float x = to_float(vrow[t * 8 + c]);
              if (!isfinite(x)) {
                if (ok_a) acc_o[t][c] += pa * x;
                if (ok_b) acc_o[t][2 + c] += pb * x;
              }
            }
          }
        }
        __syncthreads();
        for (int idx = tid; idx < kBlockN * kHeadDim; idx += Tr::kThreads) {
          T* x = sV + buf * Tr::kTile + (idx / kHeadDim) * kStride + idx % kHeadDim;
          if (!isfinite(to_float(*x))) *x = zero_elem<T>();
        }
        __syncthreads();
      }
    }

    // pass 3: O += P V. A = P for keys [16kk, 16kk + 16): n8 score tiles 2kk and 2kk + 1 give
    //   a0 = (g, 2c..) = s[2kk][0,1], a1 = (g+8, ..) = s[2kk][2,3], a2 = s[2kk+1][0,1],
    //   a3 = s[2kk+1][2,3]. B = V (keys x d, d contiguous: "row"), so ldmatrix.trans:
    //   blocks (keys +0, d +0), (keys +8, d +0) = b0, b1 of n8 output tile 2dd, and
    //   (keys +0/+8, d +8) = b0, b1 of tile 2dd + 1.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      mma_a_rowblock<T, kHeadDim, kStride>(acc_o, a, sVb + kk * 16 * kStride, lrow, lcol);
    }

    n = n_next;
  }
  // The last committed group is empty; nothing is left in flight.

  // epilogue: normalise, write out (B, Sq, H, D) and lse; empty rows -> 0 and -inf
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const bool empty = l == 0.f;  // no key seen (a NaN sum stays NaN, as on the CPU)
    float inv = empty ? 0.f : 1.f / l;
    float lse_row = empty ? -INFINITY : (row_max[r] + __log2f(l)) * kLn2F;
    if constexpr (kTerms) {
      if (p.terms.has_sinks()) {
        double lse_d;
        inv = static_cast<float>(p.terms.sink_normalise<float>(
            h, static_cast<double>(row_max[r]), static_cast<double>(l), !empty, &lse_d));
        lse_row = static_cast<float>(lse_d);
      }
    }
    // dropout's 1 / (1 - p) here, in fp32, not on P: P is packed to T for the P V product,
    // and P * 65536 (p = 1 - 2^-16, the largest p) passes fp16's maximum once P > 0.9995
    if (drop) inv *= static_cast<float>(1.0 / (1.0 - p.terms.dropout_p));
    const int64_t row = m0 + (r == 0 ? ra : rb);
    if (row < Sq) {
      T* orow = gO() + row * p.out_row_stride + (lane & 3) * 2;
#pragma unroll
      for (int t = 0; t < kDTiles; ++t) {
        *reinterpret_cast<uint32_t*>(orow + t * 8) =
            pack2<T>(acc_o[t][2 * r] * inv, acc_o[t][2 * r + 1] * inv);
      }
      if ((lane & 3) == 0) gLse()[row] = lse_row;
    }
  }
}

// ---- launcher ------------------------------------------------------------------------------
// Instantiated in attention_fa2_hdim{32,64,96,128,256}.cu (one head dim per translation unit,
// so a parallel build compiles them side by side); dispatched from attention_launch.h.
// T = __half or __nv_bfloat16.
template <typename T, int kHeadDim, int kMask, bool kTerms>
cudaError_t launch_fa2_fwd_impl(const AttentionParams& p, cudaStream_t stream) {
  using Tr = FwdTraits<kHeadDim>;
  constexpr auto kernel = fa2_fwd_kernel<T, kHeadDim, kMask, kTerms>;
  // above 48 KiB at D = 128: opt in (once per device)
  const cudaError_t e = ensure_dynamic_smem<kernel>(Tr::kSmemBytes);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>((p.Sq + Tr::kBlockM - 1) / Tr::kBlockM),
                  static_cast<unsigned>(p.H), static_cast<unsigned>(p.B));
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// One head dim's twelve kernels (fp16 / bf16 x the three mask modes x score terms or not),
// for attention_fa2_hdim*.cu
// (D = 256 has no score-term instances: fwd_fast_terms_head_dim in attention_launch.h.)
#define ATTN_EXT_INSTANTIATE_FA2_FWD_MT(T, D, M, TERMS)                                      \
  template cudaError_t launch_fa2_fwd_impl<T, D, M, TERMS>(const AttentionParams&,          \
                                                           cudaStream_t);
#define ATTN_EXT_INSTANTIATE_FA2_FWD_T(T, D, TERMS)                                          \
  ATTN_EXT_INSTANTIATE_FA2_FWD_MT(T, D, 0, TERMS)                                            \
  ATTN_EXT_INSTANTIATE_FA2_FWD_MT(T, D, 1, TERMS)                                            \
  ATTN_EXT_INSTANTIATE_FA2_FWD_MT(T, D, 2, TERMS)
#define ATTN_EXT_INSTANTIATE_FA2_FWD_CHECKS(D)                                               \
  static_assert(FwdTraits<D>::kBlockM == kBlockM, "attention_launch.h's kBlockM is stale");  \
  static_assert(FwdTraits<D>::kSmemBytes == fwd_smem_bytes(D), "fwd_smem_bytes is stale");
#define ATTN_EXT_INSTANTIATE_FA2_FWD(D)                                                      \
  ATTN_EXT_INSTANTIATE_FA2_FWD_CHECKS(D)                                                     \
  static_assert(fwd_fast_terms_head_dim(D), "use ATTN_EXT_INSTANTIATE_FA2_FWD_PLAIN");        \
  ATTN_EXT_INSTANTIATE_FA2_FWD_T(__half, D, false)                                           \
  ATTN_EXT_INSTANTIATE_FA2_FWD_T(__half, D, true)                                            \
  ATTN_EXT_INSTANTIATE_FA2_FWD_T(__nv_bfloat16, D, false)                                    \
  ATTN_EXT_INSTANTIATE_FA2_FWD_T(__nv_bfloat16, D, true)
#define ATTN_EXT_INSTANTIATE_FA2_FWD_PLAIN(D)                                                \
  ATTN_EXT_INSTANTIATE_FA2_FWD_CHECKS(D)                                                     \
  static_assert(!fwd_fast_terms_head_dim(D), "use ATTN_EXT_INSTANTIATE_FA2_FWD");            \
  ATTN_EXT_INSTANTIATE_FA2_FWD_T(__half, D, false)                                           \
  ATTN_EXT_INSTANTIATE_FA2_FWD_T(__nv_bfloat16, D, false)

}  // namespace fa2
}  // namespace cuda
}  // namespace attn_ext
