// bf16 products on AMX tiles (Intel AMX-TILE + AMX-BF16: Sapphire Rapids and later), the tiled
// kernels' bf16 path where the CPU has them (interface in attention_microkernels.h):
//
//   - scores_amx: C = scale * A B, A's rows bf16 (keys, or out's rows), B bf16 pairs
//     (pack_bf16_pairs' layout: q's or dout's). The forward's pass 1, the backward's recomputed
//     scores and its dP, and the row term Di (scores_amx_diag) all take it, so the backward's
//     P = exp(s - lse) meets the forward's bits and Di meets dP where out is one key's v.
//   - the forward's pass 3, o^T (Dv, C) += v^T p: v^T packed as bf16 key pairs once per head
//     (pack_vt_pairs), the probabilities rounded to bf16 pairs per key tile (probs_to_pairs),
//     o^T accumulated in fp32 tiles (pv_amx). Rounding p to bf16 is what PyTorch's own bf16
//     flash kernel on CPU and FlashAttention on GPU do before that product.
//   - fp16 (scores_amx_split, pv_amx_split, and in the backward scores_amx_diag_split and
//     rows_times_pairs_amx_split): each fp16 value is split exactly into bf16 hi + lo
//     (split_fp16). A product of two fp16 values (the scores q k, and the backward's dP = dout v
//     and its row term Di) takes all four terms, hi hi + hi lo + lo hi + lo lo, as four stretches
//     of one chain (Seg), so it is exact; a product with an fp32 factor (the probabilities, dS:
//     split the same way, to 16 significant bits) takes the first three.
//
// One tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 sums (8192
// multiply-adds); the fp32 zmm FMA does 16. Every output element is the chain of tdpbf16ps over
// its depth in 32-element steps, in order, from zero, so its bits depend only on its own row
// and column, not on where the tile sits (tails are staged into zero-padded tiles). Denormal
// inputs count as zero and results flush to zero (the instruction's rule).
//
// Tiles are configured (ldtilecfg: eight 16 x 64-byte tiles) at the start of every entry point
// and released (tilerelease) at its end: other code on the thread (oneDNN inside torch) may
// configure them differently between our calls. Linux hands out the AMX state only after
// arch_prctl(ARCH_REQ_XCOMP_PERM) (cpu::amx_enabled asks once per process). The instructions
// are written as inline asm with memory clobbers: GCC's tile intrinsics have none, so stores
// into a buffer could move past the tile load that reads it.
#include "cpu/attention_microkernels.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/cpu_features.h"
#include "cpu/simd.h"

namespace attn_ext {
namespace mk {

bool amx_for(int64_t depth) { return tile_rule().amx_for(depth); }

bool amx_pv_for(int64_t Dv) { return tile_rule().amx_pv_for(Dv); }

// The one place of the rules: the pairs where the CPU is not Intel's or ATTN_EXT_CPU_BF16DP=1
// (attention_microkernels.h, bf16dp_tiled_enabled), the tiles where the CPU has them, bf16
// products are not all widened (ATTN_EXT_CPU_BF16DP=0) and ATTN_EXT_CPU_AMX=0 is not set.
TileRule tile_rule() {
  const char* dp_env = std::getenv("ATTN_EXT_CPU_BF16DP");  // (read once)
  auto dp_is = [&](const char* v) { return dp_env != nullptr && std::strcmp(dp_env, v) == 0; };
  TileRule r;
  r.bf16dp = cpu::avx512bf16_enabled() && !dp_is("0");
  r.bf16dp_tiled = r.bf16dp && (dp_is("1") || !cpu::intel_cpu());
  r.amx = r.bf16dp && cpu::amx_enabled() && !cpu::env_is("ATTN_EXT_CPU_AMX", "0");
  return r;
}

void pack_row_pairs(const uint16_t* rows, int64_t stride, int64_t n_rows, int64_t cols,
                    uint32_t* out, int64_t ldo, int64_t pair_rows) {
  for (int64_t t = 0; t < pair_rows; ++t) {
    const int64_t r0 = 2 * t, r1 = r0 + 1;
    uint32_t* dst = out + t * ldo;
    for (int64_t n = 0; n < cols; ++n) {
      const uint32_t lo = r0 < n_rows ? rows[r0 * stride + n] : 0u;
      const uint32_t hi = r1 < n_rows ? rows[r1 * stride + n] : 0u;
      dst[n] = lo | (hi << 16);
    }
  }
}

void zero_nonfinite_pairs(const uint32_t* src, int64_t rows, int64_t cols, int64_t lds,
                          uint32_t* dst, int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < cols; ++t) {
      uint32_t w = src[r * lds + t];
      if ((w & 0x7f80u) == 0x7f80u) w &= 0xffff0000u;
      if ((w & 0x7f800000u) == 0x7f800000u) w &= 0x0000ffffu;
      dst[r * ldd + t] = w;
    }
  }
}

#if ATTN_EXT_HAVE_AMX_PATH

namespace {

#define ATTN_EXT_TILE_LOAD(t, base, stride)                                               \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void*)(base)), "r"((long)(stride)) \
               : "memory")
#define ATTN_EXT_TILE_STORE(t, base, stride)                                             \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void*)(base)), "r"((long)(stride)) \
               : "memory")
#define ATTN_EXT_TILE_ZERO(t) asm volatile("tilezero %%tmm" #t ::)
// dst += src1 src2 (AT&T order: src2, src1, dst)
#define ATTN_EXT_TILE_DP(dst, src1, src2) \
  asm volatile("tdpbf16ps %%tmm" #src2 ", %%tmm" #src1 ", %%tmm" #dst ::)

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: tmm0-3 fp32 sums, tmm4-5 A, tmm6-7 B.
struct Tiles {
  Tiles() {
    static const TileConfig cfg = [] {
      TileConfig c;
      for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
      }
      return c;
    }();
    asm volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
  }
  ~Tiles() { asm volatile("tilerelease" ::: "memory"); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// x's rest after its bf16 hi part hx (x rounded to bf16, as fp32): x - hx, exact in fp32, and 0
// where hx is not finite (x not finite, or rounded past bf16's largest value: inf - inf or
// x - inf would give NaN / inf). The one split rule of the fp16 values (split_fp16) and of the
// fp32 factors split beside them (store_pairs, rows_times_pairs_tiles); lo = bf16(rest).
ATTN_EXT_AMX inline __m512 split_rest_ps512(__m512 x, __m512 hx) {
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  return _mm512_maskz_sub_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(hx), inf, _CMP_LT_OQ), x, hx);
}

// One stretch of a chain: `steps` depth steps of 32 bf16, A tile i at a[i] (rows sa[i] bytes
// apart, step s at +64 s bytes), B tile j at b[j] (pair rows sb[j] bytes apart, step s at
// +16 sb[j] s).
struct Seg {
  int64_t steps;
  const char* a[2];
  int64_t sa[2];
  const char* b[2];
  int64_t sb[2];
};

// MT x NT (1-2 each) 16 x 16 sums over the stretches seg[0, nseg) in order. With `load`, the
// sums start from c (rows of 16 floats at lc bytes, tile (i, j) at c + i * 16 rows + j * 16
// floats), else from zero; stored to c.
template <int MT, int NT>
ATTN_EXT_AMX void tile_block(int nseg, const Seg* seg, char* c, int64_t lc, bool load) {
  char* c01 = c + 64;
  char* c10 = c + 16 * lc;
  char* c11 = c10 + 64;
  if (load) {
    ATTN_EXT_TILE_LOAD(0, c, lc);
    if constexpr (NT > 1) ATTN_EXT_TILE_LOAD(1, c01, lc);
    if constexpr (MT > 1) ATTN_EXT_TILE_LOAD(2, c10, lc);
    if constexpr (MT > 1 && NT > 1) ATTN_EXT_TILE_LOAD(3, c11, lc);
  } else {
    ATTN_EXT_TILE_ZERO(0);
    if constexpr (NT > 1) ATTN_EXT_TILE_ZERO(1);
    if constexpr (MT > 1) ATTN_EXT_TILE_ZERO(2);
    if constexpr (MT > 1 && NT > 1) ATTN_EXT_TILE_ZERO(3);
  }
  for (int g = 0; g < nseg; ++g) {
    const char* const* a = seg[g].a;
    const char* const* b = seg[g].b;
    const int64_t* sa = seg[g].sa;
    const int64_t* sb = seg[g].sb;
    for (int64_t s = 0; s < seg[g].steps; ++s) {
      ATTN_EXT_TILE_LOAD(4, a[0] + 64 * s, sa[0]);
      ATTN_EXT_TILE_LOAD(6, b[0] + 16 * sb[0] * s, sb[0]);
      if constexpr (MT > 1) ATTN_EXT_TILE_LOAD(5, a[1] + 64 * s, sa[1]);
      if constexpr (NT > 1) ATTN_EXT_TILE_LOAD(7, b[1] + 16 * sb[1] * s, sb[1]);
      ATTN_EXT_TILE_DP(0, 4, 6);
      if constexpr (NT > 1) ATTN_EXT_TILE_DP(1, 4, 7);
      if constexpr (MT > 1) ATTN_EXT_TILE_DP(2, 5, 6);
      if constexpr (MT > 1 && NT > 1) ATTN_EXT_TILE_DP(3, 5, 7);
    }
  }
  ATTN_EXT_TILE_STORE(0, c, lc);
  if constexpr (NT > 1) ATTN_EXT_TILE_STORE(1, c01, lc);
  if constexpr (MT > 1) ATTN_EXT_TILE_STORE(2, c10, lc);
  if constexpr (MT > 1 && NT > 1) ATTN_EXT_TILE_STORE(3, c11, lc);
}

// The stretch of a block of up to 2 x 2 tiles whose operands lie in place: A's rows from a,
// a_row bytes apart (its second tile 16 rows down), B's pair rows from b, b_row bytes apart (its
// second tile 16 words right).
inline Seg block_seg(int64_t steps, const void* a, int64_t a_row, const void* b, int64_t b_row) {
  const char* ac = static_cast<const char*>(a);
  const char* bc = static_cast<const char*>(b);
  return Seg{steps, {ac, ac + 16 * a_row}, {a_row, a_row}, {bc, bc + 64}, {b_row, b_row}};
}

ATTN_EXT_AMX void run_segs(int mt, int nt, int nseg, const Seg* seg, char* c, int64_t lc,
                           bool load) {
  if (mt == 2 && nt == 2) tile_block<2, 2>(nseg, seg, c, lc, load);
  else if (mt == 2) tile_block<2, 1>(nseg, seg, c, lc, load);
  else if (nt == 2) tile_block<1, 2>(nseg, seg, c, lc, load);
  else tile_block<1, 1>(nseg, seg, c, lc, load);
}

// Per-thread staging for tails: A rows (16, D) and B columns (D / 2, 16), zero-padded.
struct Staging {
  std::vector<uint16_t> a, a2;  // (a2, b2: the lo operands of the split products)
  std::vector<uint32_t> b, b2;
};
thread_local Staging t_stage;

// A tile source for rows [m, m + 16) of A (rows at lda elements): in place when all 16 exist,
// else the rows that do, staged with zero rows after them.
const char* a_tile(const uint16_t* A, int64_t lda, int64_t M, int64_t m, int64_t D,
                   std::vector<uint16_t>& stage, int64_t* stride) {
  if (m + 16 <= M) {
    *stride = lda * 2;
    return reinterpret_cast<const char*>(A + m * lda);
  }
  stage.assign(static_cast<size_t>(16 * D), 0);
  for (int64_t r = m; r < M; ++r)
    std::memcpy(stage.data() + (r - m) * D, A + r * lda, static_cast<size_t>(D) * 2);
  *stride = D * 2;
  return reinterpret_cast<const char*>(stage.data());
}

// B tile source for columns [n, n + 16) of B (pairs rows at ldb words): in place when all 16
// exist, else staged with zero columns.
const char* b_tile(const uint32_t* B, int64_t ldb, int64_t N, int64_t n, int64_t pairs,
                   std::vector<uint32_t>& stage, int64_t* stride) {
  if (n + 16 <= N) {
    *stride = ldb * 4;
    return reinterpret_cast<const char*>(B + n);
  }
  stage.assign(static_cast<size_t>(pairs * 16), 0u);
  for (int64_t t = 0; t < pairs; ++t)
    std::memcpy(stage.data() + t * 16, B + t * ldb + n, static_cast<size_t>(N - n) * 4);
  *stride = 64;
  return reinterpret_cast<const char*>(stage.data());
}

// The 1 or 2 tiles of a panel starting at i0 of n rows (A) or columns (B): their sources and
// strides from tile(i, &stride); returns the count. (Only a panel's last tile can be a tail, so
// one staging buffer per side serves both.)
template <typename TileFn>
int panel_tiles(int64_t i0, int64_t n, TileFn tile, const char** src, int64_t* stride) {
  const int count = i0 + 16 < n ? 2 : 1;
  for (int t = 0; t < count; ++t) src[t] = tile(i0 + 16 * t, &stride[t]);
  return count;
}

}  // namespace

namespace {
// scores_amx / scores_amx_split: C = scale * (A B [+ A B_lo + A_lo B + A_lo B_lo]), the split
// terms where A_lo (and B_lo) are given: with all four, each product of two fp16 values (hi + lo
// exactly) is exact, as on the widened path, so the scores (and lse, dP, Di) keep fp32's
// accuracy whatever the size of the products (lo lo alone dropped was 2^-18 of each product: lse
// missed fp32 rounding at scale 1 with a softcap; thirty-ninth session).
ATTN_EXT_AMX void scores_tiles(int64_t M, int64_t N, int64_t D, const uint16_t* A,
                               const uint16_t* A_lo, int64_t lda, const uint32_t* B,
                               const uint32_t* B_lo, int64_t ldb, float scale, float* C,
                               int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  Tiles tiles;
  const int64_t steps = D / 32, pairs = D / 2;
  alignas(64) float sums[32 * 32];
  const __m512 vs = _mm512_set1_ps(scale);
  const bool split = A_lo != nullptr;
  auto a_of = [&](int64_t m, int64_t* st) { return a_tile(A, lda, M, m, D, t_stage.a, st); };
  auto b_of = [&](int64_t n, int64_t* st) { return b_tile(B, ldb, N, n, pairs, t_stage.b, st); };
  auto a2_of = [&](int64_t m, int64_t* st) { return a_tile(A_lo, lda, M, m, D, t_stage.a2, st); };
  auto b2_of = [&](int64_t n, int64_t* st) {
    return b_tile(B_lo, ldb, N, n, pairs, t_stage.b2, st);
  };
  Seg seg[4];
  for (Seg& g : seg) g.steps = steps;
  for (int64_t n0 = 0; n0 < N; n0 += 32) {
    const int nt = panel_tiles(n0, N, b_of, seg[0].b, seg[0].sb);
    if (split) panel_tiles(n0, N, b2_of, seg[1].b, seg[1].sb);
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int mt = panel_tiles(m0, M, a_of, seg[0].a, seg[0].sa);
      if (split) {  // hi hi, hi lo, lo hi, lo lo
        std::copy(seg[0].a, seg[0].a + 2, seg[1].a);
        std::copy(seg[0].sa, seg[0].sa + 2, seg[1].sa);
        panel_tiles(m0, M, a2_of, seg[2].a, seg[2].sa);
        std::copy(seg[0].b, seg[0].b + 2, seg[2].b);
        std::copy(seg[0].sb, seg[0].sb + 2, seg[2].sb);
        std::copy(seg[2].a, seg[2].a + 2, seg[3].a);
        std::copy(seg[2].sa, seg[2].sa + 2, seg[3].sa);
        std::copy(seg[1].b, seg[1].b + 2, seg[3].b);
        std::copy(seg[1].sb, seg[1].sb + 2, seg[3].sb);
      }
      run_segs(mt, nt, split ? 4 : 1, seg, reinterpret_cast<char*>(sums), 32 * 4, false);
      const int64_t rows = std::min<int64_t>(32, M - m0);
      const int64_t cols = std::min<int64_t>(32, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        float* c = C + (m0 + r) * ldc + n0;
        for (int64_t j = 0; j < cols; j += 16) {
          const __mmask16 k = lanes16(cols - j);
          _mm512_mask_storeu_ps(c + j, k, _mm512_mul_ps(_mm512_load_ps(sums + r * 32 + j), vs));
        }
      }
    }
  }
}
}  // namespace

ATTN_EXT_AMX void scores_amx(int64_t M, int64_t N, int64_t D, const uint16_t* A, int64_t lda,
                             const uint32_t* B, int64_t ldb, float scale, float* C, int64_t ldc) {
  scores_tiles(M, N, D, A, nullptr, lda, B, nullptr, ldb, scale, C, ldc);
}

ATTN_EXT_AMX void decode_scores_amx(int64_t Hkv, int64_t nk, int64_t D, const uint16_t* k,
                                    int64_t row_stride, int64_t head_stride, const uint32_t* qp,
                                    int64_t qp_head, int64_t C, float scale, float* s,
                                    int64_t s_head, int64_t ld) {
  if (nk <= 0 || C <= 0) return;
  if (C > 16 || D % 32 != 0) std::abort();  // (16-word pair rows; whole depth steps)
  Tiles tiles;
  alignas(64) float sums[32 * 16];
  const __m512 vs = _mm512_set1_ps(scale);
  // (the thread-local staging looked up once: in a loop, each use of a thread_local is a
  // __tls_get_addr call, around which the zmm registers spill)
  std::vector<uint16_t>& stage = t_stage.a;
  for (int64_t m0 = 0; m0 < nk; m0 += 32) {
    for (int64_t h = 0; h < Hkv; ++h) {  // 32 keys of every head: memory order in a BSHD cache
      const uint16_t* A = k + h * head_stride;
      Seg seg{D / 32, {nullptr, nullptr}, {0, 0}, {nullptr, nullptr}, {0, 0}};
      const int mt = panel_tiles(
          m0, nk,
          [&](int64_t m, int64_t* st) { return a_tile(A, row_stride, nk, m, D, stage, st); },
          seg.a, seg.sa);
      seg.b[0] = reinterpret_cast<const char*>(qp + h * qp_head);
      seg.sb[0] = 64;
      run_segs(mt, 1, 1, &seg, reinterpret_cast<char*>(sums), 64, false);
      // (keys, columns) -> s's (column, keys), times scale as scores_tiles
      for (int t = 0; t < mt; ++t) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = _mm512_load_si512(reinterpret_cast<const __m512i*>(sums + (16 * t + i) * 16));
        cpu::transpose_16x16_epi32(r);
        const __mmask16 km = lanes16(std::min<int64_t>(16, nk - m0 - 16 * t));
        float* sh = s + h * s_head + m0 + 16 * t;
        for (int64_t c = 0; c < C; ++c)
          _mm512_mask_storeu_ps(sh + c * ld, km, _mm512_mul_ps(_mm512_castsi512_ps(r[c]), vs));
      }
    }
  }
}

ATTN_EXT_AMX void scores_amx_split(int64_t M, int64_t N, int64_t D, const uint16_t* A,
                                   const uint16_t* A_lo, int64_t lda, const uint32_t* B,
                                   const uint32_t* B_lo, int64_t ldb, float scale, float* C,
                                   int64_t ldc) {
  scores_tiles(M, N, D, A, A_lo, lda, B, B_lo, ldb, scale, C, ldc);
}

namespace {
// scores_amx_diag / scores_amx_diag_split: the diagonal of scores_tiles' sums (scale 1: the sums
// themselves), 16 rows and their 16 columns at a time; the split terms where A_lo is given.
ATTN_EXT_AMX void diag_tiles(int64_t n, int64_t D, const uint16_t* A, const uint16_t* A_lo,
                             int64_t lda, const uint32_t* B, const uint32_t* B_lo, int64_t ldb,
                             int64_t N, float* out) {
  alignas(64) float c[16 * 16];
  for (int64_t m0 = 0; m0 < n; m0 += 16) {
    const int64_t rows = std::min<int64_t>(16, n - m0);
    scores_tiles(rows, std::min<int64_t>(16, N - m0), D, A + m0 * lda,
                 A_lo != nullptr ? A_lo + m0 * lda : nullptr, lda, B + m0,
                 B_lo != nullptr ? B_lo + m0 : nullptr, ldb, 1.f, c, 16);
    for (int64_t r = 0; r < rows; ++r) out[m0 + r] = c[r * 16 + r];
  }
}
}  // namespace

ATTN_EXT_AMX void scores_amx_diag(int64_t n, int64_t D, const uint16_t* A, int64_t lda,
                                  const uint32_t* B, int64_t ldb, int64_t N, float* out) {
  diag_tiles(n, D, A, nullptr, lda, B, nullptr, ldb, N, out);
}

ATTN_EXT_AMX void scores_amx_diag_split(int64_t n, int64_t D, const uint16_t* A,
                                        const uint16_t* A_lo, int64_t lda, const uint32_t* B,
                                        const uint32_t* B_lo, int64_t ldb, int64_t N,
                                        float* out) {
  diag_tiles(n, D, A, A_lo, lda, B, B_lo, ldb, N, out);
}

ATTN_EXT_AMX void pack_vt_pairs(const uint16_t* v, int64_t row_stride, int64_t nk, int64_t Dv,
                                uint32_t* vt, int64_t ldvt, bool* finite) {
  // keys [0, nk) of 32 * ceil(nk / 32); the rest zero
  const int64_t kp_end = (nk + 31) / 32 * 16;
  bool fin = true;
  __m512i r[16];
  for (int64_t kp0 = 0; kp0 < kp_end; kp0 += 16) {
    for (int64_t d0 = 0; d0 < Dv; d0 += 16) {
      // r[kp] word d = (v[2 kp][d], v[2 kp + 1][d]) for 16 pairs and 16 columns, then transposed
      for (int64_t kp = 0; kp < 16; ++kp) {
        const int64_t r0 = 2 * (kp0 + kp), r1 = r0 + 1;
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        if (r0 < nk)
          lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + r0 * row_stride + d0)));
        if (r1 < nk)
          hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + r1 * row_stride + d0)));
        const __m512i x = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
        // a bf16 is not finite where its exponent bits are all ones
        const __m512i lo_e = _mm512_and_si512(x, _mm512_set1_epi32(0x7f80));
        const __m512i hi_e = _mm512_and_si512(x, _mm512_set1_epi32(0x7f800000));
        fin = fin && _mm512_cmpeq_epi32_mask(lo_e, _mm512_set1_epi32(0x7f80)) == 0 &&
              _mm512_cmpeq_epi32_mask(hi_e, _mm512_set1_epi32(0x7f800000)) == 0;
        r[kp] = x;
      }
      cpu::transpose_16x16_epi32(r);
      for (int64_t d = 0; d < 16; ++d)
        _mm512_storeu_si512(vt + (d0 + d) * ldvt + kp0, r[d]);
    }
  }
  *finite = fin;
}

namespace {
// The 16 words (bf16(a[c]), bf16(b[c])) of two probability rows' vectors into hi, and with lo
// the words of their rests (a[c] - bf16(a[c]), ...: exact in fp32) rounded to bf16 likewise.
ATTN_EXT_AMX inline void store_pairs(__m512 a, __m512 b, uint32_t* hi, uint32_t* lo) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                       24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                       16, 0);
  // (b's 16 bf16 high, a's low), interleaved into 16 words (a[c], b[c])
  const __m512i h = _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  _mm512_storeu_si512(hi, h);
  if (lo == nullptr) return;
  // each word's halves back to fp32: the low half (a's), the high half (b's)
  const __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  const __m512 hb = _mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32(int(0xffff0000u))));
  const __m512 ra = split_rest_ps512(a, ha), rb = split_rest_ps512(b, hb);
  _mm512_storeu_si512(lo, _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(rb, ra)));
}

// probs_to_pairs / probs_to_pairs_split: lo pairs where pp_lo is given.
ATTN_EXT_AMX void rows_to_pairs(const float* st, int64_t ld, int64_t r_begin, int64_t r_end,
                                int64_t rows, int64_t cols, uint32_t* pp, uint32_t* pp_lo,
                                int64_t ldp) {
  // pair row kp of keys (2 kp, 2 kp + 1) - r_begin ... : rows outside [r_begin, r_end) are zero
  for (int64_t kp = 0; kp < rows / 2; ++kp) {
    const int64_t r0 = 2 * kp, r1 = r0 + 1;
    const bool in0 = r0 >= r_begin && r0 < r_end, in1 = r1 >= r_begin && r1 < r_end;
    for (int64_t c = 0; c < ldp; c += 16) {
      const __mmask16 k = lanes16(cols - c);
      const __m512 a = in0 ? _mm512_maskz_loadu_ps(k, st + (r0 - r_begin) * ld + c) : _mm512_setzero_ps();
      const __m512 b = in1 ? _mm512_maskz_loadu_ps(k, st + (r1 - r_begin) * ld + c) : _mm512_setzero_ps();
      store_pairs(a, b, pp + kp * ldp + c, pp_lo != nullptr ? pp_lo + kp * ldp + c : nullptr);
    }
  }
}
}  // namespace

ATTN_EXT_AMX void probs_to_pairs(const float* st, int64_t ld, int64_t r_begin, int64_t r_end,
                                 int64_t rows, int64_t cols, uint32_t* pp, int64_t ldp) {
  rows_to_pairs(st, ld, r_begin, r_end, rows, cols, pp, nullptr, ldp);
}

namespace {
// 2^x for x <= 0, -inf (0) and NaN (NaN), 16 lanes: f = x - floor(x) in [0, 1] (vreduceps,
// exact), 2^f by a degree-6 polynomial with p(0) = 1 (a minimax fit of 2^f on [0, 1] in relative
// error: 2.0e-9 in exact arithmetic, under 2 ulp in fp32 with the FMAs' rounding), then
// p * 2^floor(x) by vscalefps, which rounds once (denormal results for x in (-150, -126], 0 below;
// -inf gives f = 0 and 0). 2^0 = 1 exactly, so the key of a column's maximum gets exactly 1.
ATTN_EXT_AMX inline __m512 exp2_tile_ps512(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(2.161292068194598e-04f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.246784464456141e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675451554358006e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5485282093286514e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402293086051941e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931470632553101e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, x);
}
}  // namespace

ATTN_EXT_AMX void softmax_pairs_amx(float* st, int64_t ld, int64_t rows, int64_t cols,
                                    int64_t r_begin, int64_t pair_rows, float* m, float* l,
                                    float* alpha, uint32_t* pp, uint32_t* pp_lo, int64_t ldp) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 log2e = _mm512_set1_ps(1.4426950408889634f);
  alignas(64) float mxs[96];  // pass 1's maxima of the current 96 columns
  for (int64_t c = 0; c < ldp; c += 16) {
    if (c >= ld) {  // padding columns: zero pairs
      for (int64_t kp = 0; kp < pair_rows; ++kp) {
        _mm512_storeu_si512(pp + kp * ldp + c, _mm512_setzero_si512());
        if (pp_lo != nullptr) _mm512_storeu_si512(pp_lo + kp * ldp + c, _mm512_setzero_si512());
      }
      continue;
    }
    const __mmask16 k = lanes16(ld - c);
    const __mmask16 kc = c < cols ? lanes16(cols - c) : __mmask16(0);  // the pairs' columns
    auto load = [&](const float* q) ATTN_EXT_AMX { return _mm512_maskz_loadu_ps(k, q); };
    // pass 1 (each 96 columns at once): running max of the 16 columns
    if (c % 96 == 0)
      cpu::column_max_all_ps512(st + c, ld, rows, std::min<int64_t>(96, ld - c), m + c, mxs);
    const __m512 m_old = load(m + c);
    const __m512 mx = load(mxs + c % 96);
    const __m512 mu = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mx, neg_inf, _CMP_NEQ_UQ), mx);
    const __m512 a = exp2_tile_ps512(_mm512_mul_ps(_mm512_sub_ps(m_old, mu), log2e));
    // pass 2: per pair row, the two keys' probabilities (0 outside the tile), their sums, pairs
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    auto prob = [&](int64_t row) ATTN_EXT_AMX {
      if (row < 0 || row >= rows) return _mm512_setzero_ps();
      float* q = st + row * ld + c;
      const __m512 e = exp2_tile_ps512(_mm512_mul_ps(_mm512_sub_ps(load(q), mu), log2e));
      _mm512_mask_storeu_ps(q, k, e);
      return e;
    };
    for (int64_t kp = 0; kp < pair_rows; ++kp) {
      const int64_t r0 = 2 * kp - r_begin;
      // (the key parity of a row: its chain, so the sum's order is the keys')
      const __m512 e0 = prob(r0), e1 = prob(r0 + 1);
      s0 = _mm512_add_ps(s0, e0);
      s1 = _mm512_add_ps(s1, e1);
      store_pairs(_mm512_maskz_mov_ps(kc, e0), _mm512_maskz_mov_ps(kc, e1), pp + kp * ldp + c,
                  pp_lo != nullptr ? pp_lo + kp * ldp + c : nullptr);
    }
    const __m512 sum = _mm512_add_ps(s0, s1);
    _mm512_mask_storeu_ps(alpha + c, k, a);
    _mm512_mask_storeu_ps(l + c, k, _mm512_fmadd_ps(load(l + c), a, sum));
    _mm512_mask_storeu_ps(m + c, k, mx);
  }
}

ATTN_EXT_AMX void exp_sub_amx(float* st, int64_t rows, int64_t cols, const float* sub) {
  const __m512 log2e = _mm512_set1_ps(1.4426950408889634f);
  for (int64_t r = 0; r < rows; ++r) {
    float* x = st + r * cols;
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 k = lanes16(cols - c);
      const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + c), _mm512_maskz_loadu_ps(k, sub + c));
      _mm512_mask_storeu_ps(x + c, k, exp2_tile_ps512(_mm512_mul_ps(d, log2e)));
    }
  }
}

ATTN_EXT_AMX void split_fp16(const uint16_t* x, int64_t n, uint16_t* hi, uint16_t* lo) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = lanes16(n - i);
    const __m512 v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, x + i));
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    // (fp16's range is inside bf16's: hi is not finite exactly where v is not)
    const __m512 hv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    const __m256i l = (__m256i)_mm512_cvtneps_pbh(split_rest_ps512(v, hv));
    _mm256_mask_storeu_epi16(hi + i, k, h);
    _mm256_mask_storeu_epi16(lo + i, k, l);
  }
}

ATTN_EXT_AMX void probs_to_pairs_split(const float* st, int64_t ld, int64_t r_begin,
                                       int64_t r_end, int64_t rows, int64_t cols,
                                       uint32_t* pp_hi, uint32_t* pp_lo, int64_t ldp) {
  rows_to_pairs(st, ld, r_begin, r_end, rows, cols, pp_hi, pp_lo, ldp);
}

namespace {
// pv_amx / pv_amx_split: ot += vt pp [+ vt pp_lo + vt_lo pp], the split terms where vt_lo
// (and pp_lo) are given.
ATTN_EXT_AMX void pv_tiles(int64_t Dv, int64_t C16, int64_t kpairs, const uint32_t* vt,
                           const uint32_t* vt_lo, int64_t ldvt, const uint32_t* pp,
                           const uint32_t* pp_lo, float* ot, int64_t ldo) {
  Tiles tiles;
  const int nseg = vt_lo != nullptr ? 3 : 1;
  const uint32_t* as[3] = {vt, vt, vt_lo};
  const uint32_t* bs[3] = {pp, pp_lo, pp};
  Seg seg[3];
  for (int64_t d0 = 0; d0 < Dv; d0 += 32) {
    const int mt = d0 + 16 < Dv ? 2 : 1;
    for (int64_t c0 = 0; c0 < C16; c0 += 32) {
      const int nt = c0 + 16 < C16 ? 2 : 1;
      for (int g = 0; g < nseg; ++g) {
        seg[g] = block_seg(kpairs / 16, as[g] + d0 * ldvt, ldvt * 4, bs[g] + c0, C16 * 4);
      }
      run_segs(mt, nt, nseg, seg, reinterpret_cast<char*>(ot + d0 * ldo + c0), ldo * 4, true);
    }
  }
}
}  // namespace

ATTN_EXT_AMX void pv_amx(int64_t Dv, int64_t C16, int64_t kpairs, const uint32_t* vt,
                         int64_t ldvt, const uint32_t* pp, float* ot, int64_t ldo) {
  pv_tiles(Dv, C16, kpairs, vt, nullptr, ldvt, pp, nullptr, ot, ldo);
}

ATTN_EXT_AMX void pv_amx_split(int64_t Dv, int64_t C16, int64_t kpairs, const uint32_t* vt,
                               const uint32_t* vt_lo, int64_t ldvt, const uint32_t* pp,
                               const uint32_t* pp_lo, float* ot, int64_t ldo) {
  pv_tiles(Dv, C16, kpairs, vt, vt_lo, ldvt, pp, pp_lo, ot, ldo);
}

namespace {
// rows_times_pairs_amx / rows_times_pairs_amx_split: C += A B [+ A B_lo + A_lo B], A's rows split
// into bf16 hi (round to nearest even) and lo = bf16(A - hi) where B_lo is given.
ATTN_EXT_AMX void rows_times_pairs_tiles(int64_t M, int64_t N, int64_t K, const float* A,
                                         int64_t lda, const uint32_t* B, const uint32_t* B_lo,
                                         int64_t ldb, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0 || K <= 0) return;
  const bool split = B_lo != nullptr;
  const int64_t steps = (K + 31) / 32, Kp = 32 * steps, M16 = (M + 15) / 16 * 16;
  // A's rows as bf16 (round to nearest even), zero-padded to (M16, Kp); split: the rests too
  // (split_rest_ps512)
  std::vector<uint16_t>& ab = t_stage.a;
  std::vector<uint16_t>& al = t_stage.a2;
  ab.resize(static_cast<size_t>(M16 * Kp));
  if (split) al.resize(ab.size());
  for (int64_t r = 0; r < M16; ++r) {
    uint16_t* dst = ab.data() + r * Kp;
    for (int64_t c = 0; c < Kp; c += 16) {
      const __mmask16 k = r < M ? lanes16(K - c) : __mmask16(0);
      const __m512 x = _mm512_maskz_loadu_ps(k, A + r * lda + c);
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), h);
      if (!split) continue;
      const __m512 hx = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(al.data() + r * Kp + c),
                          (__m256i)_mm512_cvtneps_pbh(split_rest_ps512(x, hx)));
    }
  }
  Tiles tiles;
  alignas(64) float ctmp[32 * 32];
  const int nseg = split ? 3 : 1;
  const uint16_t* as[3] = {ab.data(), ab.data(), al.data()};  // hi hi, hi lo, lo hi
  const uint32_t* bs[3] = {B, B_lo, B};
  Seg seg[3];
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int mt = m0 + 16 < M ? 2 : 1;
    const int64_t rows = std::min<int64_t>(16 * mt, M - m0);
    for (int64_t n0 = 0; n0 < N; n0 += 32) {
      const int nt = n0 + 16 < N ? 2 : 1;
      for (int g = 0; g < nseg; ++g) {
        seg[g] = block_seg(steps, as[g] + m0 * Kp, Kp * 2, bs[g] + n0, ldb * 4);
      }
      float* c = C + m0 * ldc + n0;
      if (rows == 16 * mt) {
        run_segs(mt, nt, nseg, seg, reinterpret_cast<char*>(c), ldc * 4, true);
        continue;
      }
      // a tail of rows: the sums of the rows that exist, staged (the others stay zero)
      const int64_t w = 16 * nt;
      std::fill(ctmp, ctmp + 32 * 32, 0.f);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(ctmp + r * 32, c + r * ldc, w * 4);
      run_segs(mt, nt, nseg, seg, reinterpret_cast<char*>(ctmp), 32 * 4, true);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(c + r * ldc, ctmp + r * 32, w * 4);
    }
  }
}
}  // namespace

ATTN_EXT_AMX void rows_times_pairs_amx(int64_t M, int64_t N, int64_t K, const float* A,
                                      int64_t lda, const uint32_t* B, int64_t ldb, float* C,
                                      int64_t ldc) {
  rows_times_pairs_tiles(M, N, K, A, lda, B, nullptr, ldb, C, ldc);
}

ATTN_EXT_AMX void rows_times_pairs_amx_split(int64_t M, int64_t N, int64_t K, const float* A,
                                            int64_t lda, const uint32_t* B, const uint32_t* B_lo,
                                            int64_t ldb, float* C, int64_t ldc) {
  rows_times_pairs_tiles(M, N, K, A, lda, B, B_lo, ldb, C, ldc);
}

ATTN_EXT_AMX void scale_cols(float* ot, int64_t rows, int64_t ld, int64_t cols,
                             const float* alpha) {
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 k = lanes16(cols - c);
    const __m512 a = _mm512_maskz_loadu_ps(k, alpha + c);
    if (_mm512_cmpneq_ps_mask(a, _mm512_set1_ps(1.f)) & k) {
      for (int64_t r = 0; r < rows; ++r) {
        float* x = ot + r * ld + c;
        _mm512_mask_storeu_ps(x, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x), a));
      }
    }
  }
}

#else  // no AMX in this compiler / target: amx_enabled() is false, never called

void scores_amx(int64_t, int64_t, int64_t, const uint16_t*, int64_t, const uint32_t*, int64_t,
                float, float*, int64_t) {
  std::abort();
}
void scores_amx_diag(int64_t, int64_t, const uint16_t*, int64_t, const uint32_t*, int64_t,
                     int64_t, float*) {
  std::abort();
}
void decode_scores_amx(int64_t, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                       const uint32_t*, int64_t, int64_t, float, float*, int64_t, int64_t) {
  std::abort();
}
void pack_vt_pairs(const uint16_t*, int64_t, int64_t, int64_t, uint32_t*, int64_t, bool*) {
  std::abort();
}
void probs_to_pairs(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, uint32_t*,
                    int64_t) {
  std::abort();
}
void pv_amx(int64_t, int64_t, int64_t, const uint32_t*, int64_t, const uint32_t*, float*,
            int64_t) {
  std::abort();
}
void scale_cols(float*, int64_t, int64_t, int64_t, const float*) { std::abort(); }
void scores_amx_split(int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, int64_t,
                      const uint32_t*, const uint32_t*, int64_t, float, float*, int64_t) {
  std::abort();
}
void pv_amx_split(int64_t, int64_t, int64_t, const uint32_t*, const uint32_t*, int64_t,
                  const uint32_t*, const uint32_t*, float*, int64_t) {
  std::abort();
}
void split_fp16(const uint16_t*, int64_t, uint16_t*, uint16_t*) { std::abort(); }
void exp_sub_amx(float*, int64_t, int64_t, const float*) { std::abort(); }
void softmax_pairs_amx(float*, int64_t, int64_t, int64_t, int64_t, int64_t, float*, float*,
                       float*, uint32_t*, uint32_t*, int64_t) {
  std::abort();
}
void probs_to_pairs_split(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, uint32_t*,
                          uint32_t*, int64_t) {
  std::abort();
}

void rows_times_pairs_amx(int64_t, int64_t, int64_t, const float*, int64_t, const uint32_t*,
                          int64_t, float*, int64_t) {
  std::abort();
}
void rows_times_pairs_amx_split(int64_t, int64_t, int64_t, const float*, int64_t,
                                const uint32_t*, const uint32_t*, int64_t, float*, int64_t) {
  std::abort();
}
void scores_amx_diag_split(int64_t, int64_t, const uint16_t*, const uint16_t*, int64_t,
                           const uint32_t*, const uint32_t*, int64_t, int64_t, float*) {
  std::abort();
}

#endif  // ATTN_EXT_HAVE_AMX_PATH

}  // namespace mk
}  // namespace attn_ext
