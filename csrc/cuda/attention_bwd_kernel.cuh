// Fast attention backward for fp16 / bf16 on sm_80+ (FlashAttention-2 algorithm, our own code).
// Pointers, strides and a stream; no ATen types. The adapter (attention.cu) decides when this
// kernel applies (bwd_fast_supported there) and otherwise runs the simple kernels.
//
//   from q, k, v, out, dout (layouts of AttentionBwdParams) and the forward's lse (B, H, Sq):
//   dk, dv (B, Sk, Hkv, D) in T, and dq accumulated in an fp32 workspace dq_accum laid out as
//   dq, zeroed by the caller and converted to T by the caller afterwards (packed sequences:
//   (Tq / Tk, heads, D) tensors, lse (H, Tq), rows from cu_seqlens).
//   Requirements (checked by the adapter): D == Dv in {64, 128}; q, k, v, dout base pointers
//   16-byte aligned and their batch/row/head strides multiples of 8 elements; Sq + Sk < 2^30.
//
// Algorithm (P = softmax(scale * Q K^T), dS = P o (dP - delta), delta_i = rowsum(dO_i o O_i)
// - dlse_i):
//   1. fa2_bwd_delta_kernel: delta (laid out as lse) fp32, one warp per query row.
//   2. fa2_bwd_kernel: one CTA per (key tile of kBlockN = 128 keys, kv head, sequence); 8
//      warps, warp w owns keys [16 w, 16 w + 16) of the tile. K and V are loaded once; the CTA
//      walks every query head of its kv-head group (GQA) and, for each, the query tiles of
//      kBlockM = 64 rows that band_rows_of_keys says see some key of the tile (the
//      visibility layer, common/attention_mask.h: none of them invisible by the band; the
//      steps classify() calls kFull — full_row_tiles, one range per CTA — run without a
//      predicate, the partial ones with the TileBand predicate and the keys' padding flags;
//      a tile whose keys are all padded has no step and writes dk = dv = 0).
//      Q, dO, lse and delta tiles are double-buffered (cp.async prefetch of the next tile).
//      Per query tile, all in the transposed ("key-major") orientation so that every product
//      whose M dimension is keys keeps its left operand in registers:
//        S^T  = K Q^T                 (A = K from shared, B = Q rows: plain ldmatrix)
//        P^T  = exp2(S^T * scale log2e - lse log2e)   (masked entries exactly 0)
//        dP^T = V dO^T                (A = V from shared, B = dO rows)
//        dS^T = P^T o (dP^T - delta)  (masked entries exactly 0)
//        dV  += P^T dO                (A = P^T in registers, B = dO via ldmatrix.trans)
//        dK  += dS^T Q                (A = dS^T in registers, B = Q via ldmatrix.trans)
//        dQ  += dS K                  (dS^T goes through shared memory; A = dS by
//                                      ldmatrix.trans, B = K by ldmatrix.trans; fp32 atomics)
//      A masked pair's 0 would still meet an inf / NaN of Q, dO (dK, dV) or K (dQ) inside an
//      mma (0 * inf = NaN, issue 18): a masked step whose Q / dO tile, or whose CTA's K tile,
//      holds a non-finite value computes those products by scalar loops over the visible pairs
//      instead (rare; detecting it costs each thread a look at the chunks it copied).
//      dK and dV stay in registers for the whole CTA and are written once at the end (scaled
//      by `scale`), so they are deterministic; dQ's atomics are not (the adapter runs the
//      simple, deterministic kernels when torch.use_deterministic_algorithms(True) is set).
//
// Tile choice: kBlockN = 128 keys x kBlockM = 64 queries, 256 threads. The dK and dV
// accumulators (16 keys x D per warp: 2 x D/2 fp32 registers) are the largest register users;
// 16 keys per warp keeps them at 128 registers at D = 128, and 8 warps share each Q/dO tile
// loaded to shared memory (twice the reuse of a 64-key tile). Shared rows are padded by 16
// bytes (row stride D + 8, dS^T row stride 64 + 8) for conflict-free ldmatrix. Shared memory:
// (2 x 128 + 4 x 64) x (D + 8) x 2 + 128 x 72 x 2 + 1 KiB = 91 KiB at D = 64, 155 KiB at
// D = 128 (fits sm_80 / sm_90's opt-in limits of 163 / 227 KiB, not the 99 KiB of sm_86 /
// sm_89 / sm_120: the adapter checks the device's limit and otherwise runs the simple
// kernels). Registers (ptxas): about 200-225 at D = 64, 253-255 at D = 128 (the kTerms
// instances included: the slope is hoisted per step and d is 32-bit, which is what keeps the
// masked D = 128 terms instances from spilling), so 1 CTA (8 warps) per SM at both head dims.
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

template <int kHeadDim_>
struct BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64;   // query rows per step
  static constexpr int kBlockN = 128;  // keys per CTA (8 warps x 16)
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMinBlocks = 1;  // 255 registers; smem allows 2 CTAs/SM at D = 64 anyway
  static constexpr int kStride = kHeadDim + 8;  // padded Q/K/V/dO shared row, elements
  static constexpr int kDsStride = kBlockM + 8;  // padded dS^T shared row, elements
  // dQ = dS K: warp w computes query rows [16 (w % 4), +16) x head-dim columns
  // [(w / 4) kHeadDim / 2, +kHeadDim / 2).
  static constexpr int kDqCols = kHeadDim / (kWarps / (kBlockM / 16));
  static constexpr int kSmemElems = (2 * kBlockN + 4 * kBlockM) * kStride + kBlockN * kDsStride;
  static constexpr int kSmemBytes = kSmemElems * 2 + 4 * kBlockM * 4;  // + lse, delta (x2)
  static_assert(kHeadDim % 16 == 0, "head dim must be a multiple of 16");
  static_assert(kBlockN == kWarps * 16, "one 16-key slice per warp");
  static_assert(kDqCols % 16 == 0, "dQ column slices must be whole k16 steps");
};

// delta_i = sum_d dO_i,d * O_i,d - dlse_i in fp32 (dlse: the gradient of lse, folded into the
// row term: dS = P o (dP - delta + dlse)), one warp per row (b, h, i); delta laid out as lse
// ((B, H, Sq), packed (H, Tq)). Rows past the end of a packed sequence are skipped.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(256) fa2_bwd_delta_kernel(AttentionBwdParams bp, float* delta) {
  const AttentionParams& p = bp.fwd;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= p.B * p.H * p.Sq) return;
  const QueryRow qr = query_row(p, row);
  if (!qr.ok) return;
  const int64_t b = qr.b, h = qr.h, i = qr.i;
  const SeqInfo& sq = qr.sq;
  const int64_t gi = sq.q0 + i;  // the row in the (packed) tensors
  const T* o = static_cast<const T*>(bp.out) + b * bp.o_batch_stride + gi * bp.o_row_stride +
               h * bp.o_head_stride;
  const T* d = static_cast<const T*>(bp.dout) + b * bp.dout_batch_stride +
               gi * bp.dout_row_stride + h * bp.dout_head_stride;
  float acc = 0.f;
#pragma unroll
  for (int c = lane; c < kHeadDim; c += 32) acc += to_acc(o[c]) * to_acc(d[c]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  const int64_t stat = b * p.lse_batch_stride + h * p.lse_head_stride + gi;
  if (lane == 0) {
    if (bp.dlse != nullptr) acc -= static_cast<const float*>(bp.dlse)[stat];
    delta[stat] = acc;
  }
}

// grid (key tiles, Hkv, B). kMask (MaskMode, attention_launch.h): 0 no mask (dense()),
// 1 a band (causal / window) without key padding, 2 key padding (with or without a band);
// packed sequences run in every mode (seq(b)).
// kTerms (bwd_fast_terms_ok, attention_launch.h): softcap, ALiBi and rel_bias in ScoreTerms'
// order (common/attention_mask.h: the forward's rule at the forward's d = row + off - key),
// softcap's chain factor 1 - tanh^2 on dS, and d rel_bias[h, M + clamp(d)] += dS (before the
// chain factor: the bias is added after the cap) summed per CTA in shared memory (2M + 1
// floats after the fixed part, bwd_terms_smem_bytes) and added to bp.drel_bias (fp32, zeroed
// by the caller) with one global atomic per entry and query head: not deterministic, as dq.
// Dropout: the forward's keep bit Z of (row, key) (common/dropout_rng.h; the steps' row keys
// in shared memory), dV from P Z / (1 - p), dS = P (Z / (1 - p) dP - delta). Sinks need
// nothing here: lse holds them (d sinks is computed from lse, out and dout by the caller).
// kDropout (with kTerms; bwd_fast_dropout_head_dim: D = 64 only, at D = 128 its registers
// spill 44-56 bytes): the dropout code is compiled in; the instances without it reject
// dropout (the adapter runs the simple kernels).
template <typename T, int kHeadDim, int kMask, bool kTerms, bool kDropout>
__global__ void __launch_bounds__(BwdTraits<kHeadDim>::kThreads, BwdTraits<kHeadDim>::kMinBlocks)
    fa2_bwd_kernel(AttentionBwdParams bp, const float* delta, float* dq_accum) {
  static_assert(kTerms || !kDropout, "dropout comes with the terms instances");
  using Tr = BwdTraits<kHeadDim>;
  constexpr bool kMasked = kMask != 0, kPadding = kMask == 2;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kStride = Tr::kStride;
  constexpr int kDsStride = Tr::kDsStride, kThreads = Tr::kThreads;
  constexpr int kQSub = 32;               // query columns per S^T / dP^T pass
  constexpr int kSubTiles = kQSub / 8;    // n8 tiles of S^T / dP^T per warp and pass
  constexpr int kDTiles = kHeadDim / 8;  // n8 tiles of dK / dV per warp
  constexpr int kDqChunk = 32;  // dQ columns per accumulation pass
  static_assert(Tr::kDqCols % kDqChunk == 0, "whole dQ chunks");
  const AttentionParams& p = bp.fwd;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);  // (kBlockN, kStride)
  T* sV = sK + kBlockN * kStride;          // (kBlockN, kStride)
  T* sQ = sV + kBlockN * kStride;          // 2 x (kBlockM, kStride)
  T* sdO = sQ + 2 * kBlockM * kStride;     // 2 x (kBlockM, kStride)
  T* sdS = sdO + 2 * kBlockM * kStride;    // (kBlockN, kDsStride): dS^T, keys x queries
  float* sLse = reinterpret_cast<float*>(sdS + kBlockN * kDsStride);  // 2 x kBlockM, base 2
  float* sDelta = sLse + 2 * kBlockM;                                 // 2 x kBlockM
  // kTerms, after the fixed part (bwd_terms_smem_bytes): with dropout the steps' row keys,
  // 2 x kBlockM uint64 (8-byte aligned: the fixed part is a multiple of 16 bytes), then with
  // rel_bias d rel_bias's (2M + 1) floats of the current query head
  const bool drop = kDropout && p.terms.has_dropout();
  uint64_t* sRk = reinterpret_cast<uint64_t*>(sDelta + 2 * kBlockM);
  float* sDrel = reinterpret_cast<float*>(sRk + (drop ? 2 * kBlockM : 0));

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t hkv = blockIdx.y, b = blockIdx.z;
  const int n0 = static_cast<int>(blockIdx.x) * kBlockN;
  const int64_t H = p.H, D = kHeadDim;
  const int group = static_cast<int>(H / p.Hkv);
  // Which rows see a key: the visibility layer (common/attention_mask.h) only. sq: this
  // CTA's sequence (packed rows q0.. / k0.., lengths, offset).
  // Lengths and tile positions in 32 bits (the adapter checks Sq + Sk < 2^30); bands: the
  // sequence's TileBand in 32-bit arithmetic.
  const Visibility vis = p.visibility();
  const SeqInfo sq = vis.seq(b);
  const TileBands bands = vis.tile_bands(sq);
  const int Sq = bands.Sq, Sk = bands.Sk;
  if (n0 >= Sk) return;  // past the end of its (packed) sequence: no key to write
  const int n1 = n0 + kBlockN < Sk ? n0 + kBlockN : Sk;  // the tile's keys [n0, n1)

  const int g = lane >> 2, c2 = (lane & 3) * 2;
  // this warp's keys (rows of S^T): key_a and key_a + 8; kra / krb in the tile
  const int kra = warp * 16 + g, krb = kra + 8;
  const int key_a = n0 + kra;
  // key padding, a per-key flag: this thread's two keys, and whether the tile has a padded
  // key (then every step is partial) or only padded keys (then no row sees the tile)
  const bool kok_a = key_a < n1 && vis.key_valid(b, key_a);
  const bool kok_b = key_a + 8 < n1 && vis.key_valid(b, key_a + 8);
  bool all_keys = true, any_key = true;
  if constexpr (kPadding) {
    {
      // (key_a, key_a + 8) over the CTA's threads cover the 128 keys, four times over
      const bool mine_ok = (key_a >= n1 || kok_a) && (key_a + 8 >= n1 || kok_b);
      all_keys = __syncthreads_and(mine_ok);
      any_key = __syncthreads_or(kok_a || kok_b);
    }
  }

  // query tiles [m_begin, m_end) hold every row that sees some key of this tile by the band
  // (none of them invisible by the band); classify() calls [full_lo, full_hi) of them kFull
  // (full_row_tiles: the same answer as one range, computed once per CTA)
  Visibility::TileSpan span;
  if (!kMasked) {  // every pair of the sequence is visible (dense())
    span = Visibility::TileSpan::dense(Sq, kBlockM);
  } else if (Sq > 0 && any_key) {
    span = vis.row_tile_span(sq, n0, n1, kBlockM);
  }
  const int m_begin = span.begin, m_end = span.end, full_lo = span.full_lo, full_hi = span.full_hi;
  // step st = (query head hkv * group + st / n_m, query tile m_begin + st % n_m); 32-bit
  // (the adapter checks group * n_m < 2^31)
  const int n_m = m_end - m_begin;
  const int steps = group * n_m;

  const T* gK = static_cast<const T*>(p.k) + b * p.k_batch_stride + sq.k0 * p.k_row_stride +
                hkv * p.k_head_stride;
  const T* gV = static_cast<const T*>(p.v) + b * p.v_batch_stride + sq.k0 * p.v_row_stride +
                hkv * p.v_head_stride;
  load_rows<T, kHeadDim, kBlockN, kThreads>(sK, gK, p.k_row_stride, n0, Sk, tid);
  load_rows<T, kHeadDim, kBlockN, kThreads>(sV, gV, p.v_row_stride, n0, Sk, tid);

  // Issues the loads of step st (query head, query tile) into buffer st & 1: Q and dO by
  // cp.async (the caller commits), lse (base 2; -inf and rows past Sq -> +inf, so P = 0) and
  // delta (rows past Sq -> 0) by plain loads. lse and delta: (B, H, Sq), packed (H, Tq).
  auto load_step = [&](int st) {
    const int buf = static_cast<int>(st & 1);
    const int64_t h = hkv * group + st / n_m;
    const int m0 = (m_begin + st % n_m) * kBlockM;
    const T* gQ = static_cast<const T*>(p.q) + b * p.q_batch_stride + sq.q0 * p.q_row_stride +
                  h * p.q_head_stride;
    const T* gdO = static_cast<const T*>(bp.dout) + b * bp.dout_batch_stride +
                   sq.q0 * bp.dout_row_stride + h * bp.dout_head_stride;
    load_rows<T, kHeadDim, kBlockM, kThreads>(sQ + buf * kBlockM * kStride, gQ, p.q_row_stride,
                                              m0, Sq, tid);
    load_rows<T, kHeadDim, kBlockM, kThreads>(sdO + buf * kBlockM * kStride, gdO,
                                              bp.dout_row_stride, m0, Sq, tid);
    if (tid < kBlockM) {
      const int row = m0 + tid;
      float l2 = INFINITY, dl = 0.f;
      if (row < Sq) {
        const int64_t idx = b * p.lse_batch_stride + h * p.lse_head_stride + sq.q0 + row;
        const float l = static_cast<const float*>(bp.lse)[idx];
        l2 = lse_log2(l);
        dl = delta[idx];
      }
      sLse[buf * kBlockM + tid] = l2;
      sDelta[buf * kBlockM + tid] = dl;
      if constexpr (kDropout) {  // the row's key (rows past Sq are never kept: P = 0)
        if (drop) sRk[buf * kBlockM + tid] = p.score_terms().dropout_row_key(b, h, row);
      }
    }
  };
  if (steps > 0) load_step(0);
  cp_async_commit();  // K, V and step 0

  float acc_dk[kDTiles][4], acc_dv[kDTiles][4];
#pragma unroll
  for (int t = 0; t < kDTiles; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[t][e] = acc_dv[t][e] = 0.f;
  }
  const float scale = static_cast<float>(p.scale);
  const float scale_log2 = scale * kLog2eF;
  const bool has_cap = kTerms && p.terms.softcap > 0.0;
  const uint32_t drop_thresh = drop ? dropout::threshold(p.terms.dropout_p) : 0u;
  // dropout: P Z and (1 - p) dS go through the tensor-core products (packed to T: P Z / (1 - p)
  // and dS pass fp16's maximum at p near 1); the 1 / (1 - p) joins dv, dk, dq and d rel_bias in
  // fp32 (1 without dropout: the same bits)
  const float drop_scale = drop ? static_cast<float>(1.0 / (1.0 - p.terms.dropout_p)) : 1.f;
  const float keep_p = drop ? static_cast<float>(1.0 - p.terms.dropout_p) : 1.f;
  const float ds_scale = scale * drop_scale;  // dk = ds_scale * acc_dk, dq += ds_scale * acc_dq
  // rel_bias (kTerms): the table and its gradient's accumulator of the current query head
  const float* rel_tab = kTerms ? static_cast<const float*>(p.terms.rel_bias) : nullptr;
  const int rel_m = kTerms ? static_cast<int>(p.terms.rel_max) : 0;
  const int rel_n = 2 * rel_m + 1;
  float* const gDrel = static_cast<float*>(bp.drel_bias);
  if (kTerms && rel_tab != nullptr) {
    for (int i = tid; i < rel_n; i += kThreads) sDrel[i] = 0.f;  // the first step's barrier orders it
  }
  // adds the CTA's d rel_bias of query head hh to the global table and clears it; every
  // thread calls it between two barriers
  auto flush_drel = [&](int64_t hh) {
    for (int i = tid; i < rel_n; i += kThreads) {
      const float x = sDrel[i];
      if (x != 0.f) atomicAdd(gDrel + hh * rel_n + i, x);
      sDrel[i] = 0.f;
    }
  };

  // ldmatrix lane offsets (as in the forward): "A-style" rows/cols of a 16x16 block read in
  // mma A order (matrices: rows +0/+8, then cols +0/+8), "B-style" of a block of two n8 tiles
  // (matrices: cols +0/+8 of rows +0, then of rows +8).
  const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int lcol = (lane >> 4) * 8;
  const int krow = (lane & 7) + (lane >> 4) * 8;
  const int kcol = ((lane >> 3) & 1) * 8;
  // dQ slice of this warp
  const int dq_row0 = (warp % (kBlockM / 16)) * 16;
  const int dq_col0 = (warp / (kBlockM / 16)) * Tr::kDqCols;
  // A non-finite K value of a key some row of a partial step cannot see would reach that
  // row's dq through 0 * inf in dQ = dS K: such steps take the exact dQ path (set at step 0).
  bool k_bad = false;

  for (int st = 0; st < steps; ++st) {
    const int buf = static_cast<int>(st & 1);
    const int64_t h = hkv * group + st / n_m;
    const int mt = m_begin + st % n_m;  // query tile index
    const int m0 = mt * kBlockM;
    T* sQb = sQ + buf * kBlockM * kStride;
    T* sdOb = sdO + buf * kBlockM * kStride;
    const float* sLseb = sLse + buf * kBlockM;
    const float* sDeltab = sDelta + buf * kBlockM;
    const uint64_t* sRkb = sRk + buf * kBlockM;
    // the (query tile, key tile) class by the band (the tiles of band_rows_of_keys are never
    // invisible); rows past Sq, keys past Sk or a padded key make a full tile partial (the
    // predicate then masks them)
    const bool need_mask = !(mt >= full_lo && mt < full_hi) || n0 + kBlockN > Sk ||
                           m0 + kBlockM > Sq || !all_keys;

    cp_async_wait<0>();
    // In a masked step, a non-finite Q or dO value of a row that cannot see some key of the
    // tile would reach that key's dk / dv through 0 * inf in dK += dS^T Q / dV += P^T dO:
    // each thread checks the chunks it copied itself, the barrier ORs the answers.
    bool qo_bad = false;
    if constexpr (kMasked) {
      if (st == 0) {  // K (loaded with step 0): once per CTA
        k_bad = __syncthreads_or(own_rows_nonfinite<T, kHeadDim, kBlockN, kThreads>(sK, tid));
      }
      const bool mine = need_mask && (own_rows_nonfinite<T, kHeadDim, kBlockM, kThreads>(sQb, tid) ||
                                      own_rows_nonfinite<T, kHeadDim, kBlockM, kThreads>(sdOb, tid));
      // step st's tiles are here; every warp is done with step st - 1
      qo_bad = __syncthreads_or(mine);
    } else {
      __syncthreads();  // step st's tiles are here; every warp is done with step st - 1
    }
    if (st + 1 < steps) load_step(st + 1);  // into the other buffer (last read in step st - 1)
    cp_async_commit();
    if constexpr (kTerms) {
      // a new query head: the previous one's d rel_bias goes out first (every warp is done
      // with step st - 1: the barrier above; nobody adds before the barrier below)
      if (rel_tab != nullptr && st > 0 && st % n_m == 0) {
        flush_drel(h - 1);
        __syncthreads();
      }
    }
    // the band in tile coordinates: query column qc, key row kr
    const TileBand band = bands.at(m0, n0, kBlockM, kBlockN);
    // score terms of this step's query head: the ALiBi slope (0 without), and d = row + off -
    // key as (m0 + qc) + d_row_key - (key row in the tile)
    float slope = 0.f;
    const float* rel_h = nullptr;  // the query head's row of the table (centred)
    if constexpr (kTerms) {
      if (p.terms.alibi != nullptr) slope = p.terms.slope<float>(b, h);
      rel_h = p.terms.rel_row<float>(h);
    }
    const int d_row_key = bands.off - n0;
    int64_t drop_col0 = 0;  // dropout: the global column of the tile's first key
    if constexpr (kDropout) {
      if (drop) drop_col0 = p.score_terms().dropout_col(n0);
    }

    // The query columns in two halves of kQSub = 32 (halves the live S^T / dP^T registers,
    // which sit next to the 2 x D/2 dK/dV accumulators; costs a second read of the K and V
    // A fragments).
#pragma unroll 1
    for (int qs = 0; qs < kBlockM / kQSub; ++qs) {
      const int q0 = qs * kQSub;  // first query column of this half, within the tile
      // S^T (16 keys x 32 queries per warp) = K Q^T and dP^T = V dO^T
      float s[kSubTiles][4], dp[kSubTiles][4];
#pragma unroll
      for (int t = 0; t < kSubTiles; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[t][e] = dp[t][e] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        uint32_t ak[4], av[4];
        ldmatrix_x4(smem_addr(sK + (warp * 16 + lrow) * kStride + kk * 16 + lcol), ak);
        ldmatrix_x4(smem_addr(sV + (warp * 16 + lrow) * kStride + kk * 16 + lcol), av);
#pragma unroll
        for (int nn = 0; nn < kQSub / 16; ++nn) {
          uint32_t bq[4], bo[4];
          ldmatrix_x4(smem_addr(sQb + (q0 + nn * 16 + krow) * kStride + kk * 16 + kcol), bq);
          ldmatrix_x4(smem_addr(sdOb + (q0 + nn * 16 + krow) * kStride + kk * 16 + kcol), bo);
          mma_16816<T>(s[2 * nn], ak, bq[0], bq[1]);
          mma_16816<T>(s[2 * nn + 1], ak, bq[2], bq[3]);
          mma_16816<T>(dp[2 * nn], av, bo[0], bo[1]);
          mma_16816<T>(dp[2 * nn + 1], av, bo[2], bo[3]);
        }
      }

      // P^T and dS^T. Accumulator element e of n8 tile t is (key key_a + 8 (e >= 2),
      // query m0 + q0 + 8 t + c2 + (e & 1)). A masked step asks the visibility layer per
      // element: the band (TileBand) and the key's padding flag.
#pragma unroll
      for (int t = 0; t < kSubTiles; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qc = q0 + t * 8 + c2 + (e & 1);
          float pr, ds;
          float chain = 1.f;  // softcap: 1 - tanh^2
          int rd = 0;         // rel_bias: clamp(d, -M, M)
          if constexpr (kTerms) {
            // the forward's score (fa2_fwd_kernel: base 2 to natural units, ScoreTerms::add_row's
            // steps in its order with the flags hoisted, at d = row + off - key, back to base
            // 2); d in 32 bits as the bands. (add_row itself, which re-reads the flags per
            // element, costs the D = 128 masked instances 12 bytes of spills on sm_80.)
            float th = 0.f;  // tanh(s / softcap) (0 without softcap: chain factor 1)
            const int d = m0 + qc + d_row_key - (e < 2 ? kra : krb);
            float x = s[t][e] * scale_log2 * kLn2F;
            if (has_cap) x = p.terms.cap<float>(x, &th);
            x = ScoreTerms::alibi_add(x, slope, d);  // slope 0 without ALiBi
            if (rel_h != nullptr) x = ScoreTerms::rel_add(x, rel_h, rel_m, d, &rd);
            pr = fast_exp2(x * kLog2eF - sLseb[qc]);
            if (kDropout && drop) {
              // the forward's keep bit of (row, key) (common/dropout_rng.h): dV takes
              // P Z / (1 - p), dS = P (Z / (1 - p) dP - delta). Here P Z and (1 - p) dS =
              // P (Z dP - (1 - p) delta) (drop_scale above; Z * dP keeps a dropped pair's
              // non-finite dP NaN, as on the CPU)
              const int64_t col = drop_col0 + (e < 2 ? kra : krb);
              const bool kept = dropout::keep(sRkb[qc], col, drop_thresh);
              ds = pr * ((kept ? 1.f : 0.f) * dp[t][e] - keep_p * sDeltab[qc]);
              pr = kept ? pr : 0.f;
            } else {
              ds = pr * (dp[t][e] - sDeltab[qc]);
            }
            chain = 1.f - th * th;
          } else {
            pr = fast_exp2(fmaf(s[t][e], scale_log2, -sLseb[qc]));
            ds = pr * (dp[t][e] - sDeltab[qc]);
          }
          if (need_mask) {
            const bool ok = (e < 2 ? kok_a : kok_b) && band.ok(qc, e < 2 ? kra : krb);
            // masked: exactly 0, also when v or dout hold inf/NaN (0 * NaN would leak)
            if (!ok) pr = ds = 0.f;
          }
          if constexpr (kTerms) {
            // d rel_bias: dS of the biased score (the bias comes after the cap)
            if (rel_h != nullptr && ds != 0.f) atomicAdd(sDrel + rel_m + rd, drop_scale * ds);
            // a masked 0 stays 0 even when the hidden score was NaN (its chain factor too)
            ds = ds != 0.f ? ds * chain : 0.f;
          }
          s[t][e] = pr;
          dp[t][e] = ds;  // dS^T
        }
      }

      // dV += P^T dO and dK += dS^T Q: A from registers (n8 tiles 2kk, 2kk + 1 form a k16
      // step, as P in the forward), B = dO / Q rows (queries x d, "row") by ldmatrix.trans.
      // dS^T is also stored (as T) to shared memory for dQ.
#pragma unroll
      for (int kk = 0; kk < kQSub / 16; ++kk) {
        uint32_t ap[4], ads[4];
        ap[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
        ap[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        ap[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        ap[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        ads[0] = pack2<T>(dp[2 * kk][0], dp[2 * kk][1]);
        ads[1] = pack2<T>(dp[2 * kk][2], dp[2 * kk][3]);
        ads[2] = pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
        ads[3] = pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
        const int qk = q0 + kk * 16;  // first query of this k16 step
        T* ds_row = sdS + (warp * 16 + g) * kDsStride + qk + c2;
        *reinterpret_cast<uint32_t*>(ds_row) = ads[0];
        *reinterpret_cast<uint32_t*>(ds_row + 8 * kDsStride) = ads[1];
        *reinterpret_cast<uint32_t*>(ds_row + 8) = ads[2];
        *reinterpret_cast<uint32_t*>(ds_row + 8 * kDsStride + 8) = ads[3];
        if (!qo_bad) {
          mma_a_rowblock<T, kHeadDim, kStride>(acc_dv, ap, sdOb + qk * kStride, lrow, lcol);
          mma_a_rowblock<T, kHeadDim, kStride>(acc_dk, ads, sQb + qk * kStride, lrow, lcol);
        }
      }
      if constexpr (kMasked) {
        if (qo_bad) {
          // The exact path (rare: a masked step whose Q or dO holds inf / NaN): dV and dK of
          // this half by scalar products over the visible (key, query) pairs only. P^T and
          // dS^T of query column q0 + q sit in element (q % 2) (+2) of n8 tile (q % 32) / 8 on
          // quad lane (q % 8) / 2.
          // (a copy of this lane's P^T / dS^T values made here, in the rare path, and indexed
          // by q at run time: indexing s / dp themselves by a run-time tile put both arrays in
          // local memory, stored on every step of every masked instance)
          float sp[kSubTiles][4], sd[kSubTiles][4];
#pragma unroll
          for (int t = 0; t < kSubTiles; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              sp[t][e] = s[t][e];
              sd[t][e] = dp[t][e];
            }
          }
#pragma unroll 1
          for (int q = 0; q < kQSub; ++q) {
            const float* pt = sp[q / 8];
            const float* dt = sd[q / 8];
            float pa = (q & 1) ? pt[1] : pt[0];
            float pb = (q & 1) ? pt[3] : pt[2];
            float da = (q & 1) ? dt[1] : dt[0];
            float db = (q & 1) ? dt[3] : dt[2];
            const int src = (lane & ~3) | ((q & 7) >> 1);
            pa = __shfl_sync(0xffffffffu, pa, src);
            pb = __shfl_sync(0xffffffffu, pb, src);
            da = __shfl_sync(0xffffffffu, da, src);
            db = __shfl_sync(0xffffffffu, db, src);
            const int qc = q0 + q;
            const bool ok_a = kok_a && band.ok(qc, kra);
            const bool ok_b = kok_b && band.ok(qc, krb);
            const T* orow = sdOb + qc * kStride + c2;
            const T* qrow = sQb + qc * kStride + c2;
#pragma unroll
            for (int t = 0; t < kDTiles; ++t) {
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                const float o = to_acc(orow[t * 8 + c]), x = to_acc(qrow[t * 8 + c]);
                if (ok_a) {
                  acc_dv[t][c] += pa * o;
                  acc_dk[t][c] += da * x;
                }
                if (ok_b) {
                  acc_dv[t][2 + c] += pb * o;
                  acc_dk[t][2 + c] += db * x;
                }
              }
            }
          }
        }
      }
    }
    __syncthreads();  // all of dS^T is in shared memory

    // dQ (rows [dq_row0, +16) x cols [dq_col0, +kDqCols) of this warp) = dS K over the 128
    // keys. A = dS (queries x keys) read from dS^T with ldmatrix.trans ("B-style" offsets:
    // matrices 1 and 3 are queries +8, 2 and 3 keys +8); B = K (keys x d, "row") by
    // ldmatrix.trans as V in the forward.
    // In chunks of kDqChunk = 32 columns (fewer live accumulators next to dK and dV).
    const bool exact_dq = kMasked && k_bad && need_mask;
#pragma unroll
    for (int dc = 0; dc < Tr::kDqCols; dc += kDqChunk) {
      float acc_dq[kDqChunk / 8][4];
#pragma unroll
      for (int t = 0; t < kDqChunk / 8; ++t) acc_dq[t][0] = acc_dq[t][1] = acc_dq[t][2] = acc_dq[t][3] = 0.f;
      if (!exact_dq) {
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          uint32_t a[4];
          ldmatrix_x4_trans(smem_addr(sdS + (kk * 16 + krow) * kDsStride + dq_row0 + kcol), a);
          mma_a_rowblock<T, kDqChunk, kStride>(acc_dq, a, sK + kk * 16 * kStride + dq_col0 + dc,
                                               lrow, lcol);
        }
      } else {
        // The exact path (rare: a masked step and a non-finite K in the tile): scalar
        // products over the visible (query, key) pairs only.
#pragma unroll 1
        for (int kk = 0; kk < kBlockN; ++kk) {
          const bool key_ok = n0 + kk < n1 && vis.key_valid(b, n0 + kk);
          const T* krow_p = sK + kk * kStride + dq_col0 + dc + c2;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int qr = dq_row0 + g + 8 * r;
            if (!(key_ok && band.ok(qr, kk))) continue;
            const float ds = to_acc(sdS[kk * kDsStride + qr]);
#pragma unroll
            for (int t = 0; t < kDqChunk / 8; ++t) {
              acc_dq[t][2 * r] += ds * to_acc(krow_p[t * 8]);
              acc_dq[t][2 * r + 1] += ds * to_acc(krow_p[t * 8 + 1]);
            }
          }
        }
      }
      // dq_accum (as dq: (B, Sq, H, D), packed (Tq, H, D)) += scale * dQ; rows past Sq skipped
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = m0 + dq_row0 + g + 8 * r;
        if (row < Sq) {
          float* dst = dq_accum + b * bp.dq_batch_stride + ((sq.q0 + row) * H + h) * D + dq_col0 +
                       dc + c2;
#pragma unroll
          for (int t = 0; t < kDqChunk / 8; ++t) {
            atomicAdd(dst + t * 8, ds_scale * acc_dq[t][2 * r]);
            atomicAdd(dst + t * 8 + 1, ds_scale * acc_dq[t][2 * r + 1]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // nothing may be in flight when the CTA exits

  if constexpr (kTerms) {  // the last query head's d rel_bias
    if (rel_tab != nullptr && steps > 0) {
      __syncthreads();
      flush_drel(hkv * group + (steps - 1) / n_m);
    }
  }

  // epilogue: dk = scale * acc_dk and dv = acc_dv, each / (1 - p) with dropout (as dk / dv:
  // (B, Sk, Hkv, D), packed (Tk, Hkv, D), contiguous); keys past Sk skipped
  T* gdK = static_cast<T*>(bp.dk) + b * bp.dk_batch_stride;
  T* gdV = static_cast<T*>(bp.dv) + b * bp.dv_batch_stride;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key_a + 8 * r;
    if (key < Sk) {
      const int64_t off = ((sq.k0 + key) * p.Hkv + hkv) * D + c2;
#pragma unroll
      for (int t = 0; t < kDTiles; ++t) {
        *reinterpret_cast<uint32_t*>(gdK + off + t * 8) =
            pack2<T>(ds_scale * acc_dk[t][2 * r], ds_scale * acc_dk[t][2 * r + 1]);
        *reinterpret_cast<uint32_t*>(gdV + off + t * 8) =
            pack2<T>(drop_scale * acc_dv[t][2 * r], drop_scale * acc_dv[t][2 * r + 1]);
      }
    }
  }
}

// ---- launcher ------------------------------------------------------------------------------
// Instantiated in attention_fa2_bwd_hdim64.cu / attention_fa2_bwd_hdim128.cu; dispatched from
// attention_launch.h. delta: (B, H, Sq) fp32 workspace; dq_accum: (B, Sq, H, D) fp32, zeroed.
template <typename T, int kHeadDim, int kMask, bool kTerms, bool kDropout>
cudaError_t launch_fa2_bwd_impl(const AttentionBwdParams& bp, float* delta, float* dq_accum,
                                cudaStream_t stream) {
  using Tr = BwdTraits<kHeadDim>;
  const AttentionParams& p = bp.fwd;
  const int64_t rows = p.B * p.H * p.Sq;
  fa2_bwd_delta_kernel<T, kHeadDim>
      <<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(bp, delta);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;

  constexpr auto kernel = fa2_bwd_kernel<T, kHeadDim, kMask, kTerms, kDropout>;
  // the terms instances may take d rel_bias's accumulator on top (bwd_terms_smem_bytes): they
  // are allowed the device's whole opt-in limit (the adapter checked the sum against it)
  int limit = Tr::kSmemBytes;
  if constexpr (kTerms) {
    int dev = 0;
    e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e != cudaSuccess) return e;
  }
  e = ensure_dynamic_smem<kernel>(limit);
  if (e != cudaSuccess) return e;
  const int smem = Tr::kSmemBytes + (kTerms ? static_cast<int>(bwd_terms_smem_bytes(p.terms)) : 0);
  if (smem > limit) return cudaErrorInvalidValue;  // the adapter runs the simple kernels
  const dim3 grid(static_cast<unsigned>((p.Sk + Tr::kBlockN - 1) / Tr::kBlockN),
                  static_cast<unsigned>(p.Hkv), static_cast<unsigned>(p.B));
  kernel<<<grid, Tr::kThreads, smem, stream>>>(bp, delta, dq_accum);
  return cudaGetLastError();
}

// One head dim's kernels for attention_fa2_bwd_hdim*.cu: fp16 / bf16 x the three mask modes
// x (plain, score terms, and where bwd_fast_dropout_head_dim: score terms with dropout).
#define ATTN_EXT_INSTANTIATE_FA2_BWD_MT(T, D, M, TERMS, DROP)                                 \
  template cudaError_t launch_fa2_bwd_impl<T, D, M, TERMS, DROP>(const AttentionBwdParams&, \
                                                                 float*, float*, cudaStream_t);
#define ATTN_EXT_INSTANTIATE_FA2_BWD_T(T, D, TERMS, DROP)                                    \
  ATTN_EXT_INSTANTIATE_FA2_BWD_MT(T, D, 0, TERMS, DROP)                                      \
  ATTN_EXT_INSTANTIATE_FA2_BWD_MT(T, D, 1, TERMS, DROP)                                      \
  ATTN_EXT_INSTANTIATE_FA2_BWD_MT(T, D, 2, TERMS, DROP)
#define ATTN_EXT_INSTANTIATE_FA2_BWD_D(T, D)                                                  \
  ATTN_EXT_INSTANTIATE_FA2_BWD_T(T, D, false, false)                                          \
  ATTN_EXT_INSTANTIATE_FA2_BWD_T(T, D, true, false)
#define ATTN_EXT_INSTANTIATE_FA2_BWD(D)                                                       \
  static_assert(BwdTraits<D>::kSmemBytes == bwd_smem_bytes(D),                              \
                "attention_launch.h's bwd_smem_bytes is stale");                            \
  ATTN_EXT_INSTANTIATE_FA2_BWD_D(__half, D)                                                   \
  ATTN_EXT_INSTANTIATE_FA2_BWD_D(__nv_bfloat16, D)
// the dropout instances, for the head dims of bwd_fast_dropout_head_dim
#define ATTN_EXT_INSTANTIATE_FA2_BWD_DROPOUT(D)                                               \
  static_assert(bwd_fast_dropout_head_dim(D), "no dropout instances at this head dim");     \
  ATTN_EXT_INSTANTIATE_FA2_BWD_T(__half, D, true, true)                                       \
  ATTN_EXT_INSTANTIATE_FA2_BWD_T(__nv_bfloat16, D, true, true)

}  // namespace fa2
}  // namespace cuda
}  // namespace attn_ext
