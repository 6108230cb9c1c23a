"""``attn_ext.explain(q, k, v, ...)``: which attention kernel a call will run, and why.

The rules below restate the kernels' dispatch in Python, so they can be read without the C++:

- CPU forward (csrc/cpu/attention_fwd.cpp ``attention_fwd_kernel``): the decode kernel
  (csrc/cpu/attention_decode.h, ``"cpu.decode"``) when ``Sq * H / Hkv`` fits its columns and
  the call has no dropout (not float64, SIMD on, ``ATTN_EXT_CPU_DECODE`` not 0);
  else query tiles of up to ``kBlockQ`` (head, row) columns; split-KV (the keys of each tile cut into chunks run in
  parallel and merged) when there are fewer tiles than threads and ``Sk >= 4 * kBlockK``,
  else the plain tiled kernel. CPU backward (attention_bwd.cpp): fused per (batch, kv head)
  when those units are at least the threads (or Sk <= ``kBlockK``), else the
  FlashAttention-2 split (dk / dv by key chunks, then dq by query blocks).
- CUDA forward (csrc/cuda/attention.cu ``plan_split`` / ``use_fast_forward``): split-KV decode,
  else the fast FA2-style tensor-core kernel, else the simple kernel; CUDA backward
  (``use_fast_backward``): the fast FA2-style kernel, else the simple kernels.
- Masks do not change the choice: causal, ``window``, ``key_padding_mask`` and the packed
  sequences of ``attention_varlen`` (there B is the number of sequences and Sq / Sk are
  ``max_seqlen_q`` / ``max_seqlen_k``; on CPU its decode and split-KV paths are the dense
  ones, on CUDA it has no split-KV path) run on the same kernels under the same conditions,
  and so does a loss on lse.
- Score terms (``alibi_slopes``, ``rel_bias``, ``softcap``, ``sinks``, ``dropout_p > 0``; issue
  15): split-KV and the simple kernels take all of them; the fast CUDA forward takes all
  (its terms instances, not at D = 256); the fast backward all, dropout at D = 64 only
  (``use_fast_backward``: ``fa2::bwd_fast_terms_ok`` / ``bwd_fast_dropout_head_dim``; its
  shared memory grows by d rel_bias's (2M + 1) floats and dropout's 1 KiB of row keys,
  ``bwd_terms_smem_bytes``; sinks reach the backward only through lse and do not change its
  choice). The CPU decode kernel takes every term but dropout (``decode_supported``: not
  ``has_dropout()``; softcap, ALiBi and rel_bias by ``apply_score_terms_keys`` on each block; the
  CPU backward, not told the sinks, asks the same to recompute the decode kernel's scores).

The constants are copies of the kernels' (the headers are not installed with the package);
tests/test_explain.py reads them from csrc/ and fails when the two disagree.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

import torch

from .ops import (_FLOAT_DTYPES, _check_causal, _check_key_padding_mask,
                  _check_last_dim_contiguous, _check_qkv, _check_return_lse, _check_scale,
                  _check_term_shapes,
                  _checked_score_terms, _heads_4d, _window_args)

# csrc/cpu/attention_common.h
CPU_BLOCK_Q = 96  # kBlockQ: score columns (head, query row) per query tile
CPU_BLOCK_K = 96  # kBlockK: keys per key tile
CPU_DROPOUT_SPLIT_WORKERS = 16  # kDropoutSplitWorkers: the split plan's workers with dropout

# csrc/cuda/attention_launch.h
CUDA_SIMPLE_MAX_HEAD_DIM = 256  # simple::kMaxHeadDim
CUDA_FA2_BLOCK_M = 64  # fa2::kBlockM: query rows per CTA of the fast forward
CUDA_FWD_FAST_HEAD_DIMS = (32, 64, 96, 128, 256)  # fa2::fwd_fast_head_dim
CUDA_FWD_FAST_TERMS_HEAD_DIMS = (32, 64, 96, 128)  # fa2::fwd_fast_terms_head_dim (not 256)
# head dims whose fast CUDA backward takes dropout (fa2::bwd_fast_terms_ok)
CUDA_BWD_DROPOUT_HEAD_DIMS = (64,)  # fa2::bwd_fast_dropout_head_dim (128 would spill)
CUDA_BWD_FAST_HEAD_DIMS = (64, 128)  # fa2::launch_fa2_bwd
CUDA_BWD_BLOCK_N = 128  # keys per CTA of the fast backward (bwd_fast_grid_ok)
CUDA_FAST_MAX_SEQ_LEN = 1 << 30  # fa2::kMaxFastSeqLen: Sq + Sk below it (32-bit tile math)

# csrc/cuda/attention.cu plan_split
CUDA_SPLIT_MAX_SQ = 16  # split-KV only for Sq <= 16 ...
CUDA_SPLIT_MIN_SK = 512  # ... and Sk >= 512
CUDA_SPLIT_WARPS_PER_SM = 16  # warps that fill one SM
CUDA_SPLIT_MIN_CHUNK = 128  # keys per chunk, at least

# csrc/cuda/attention.cu force_simple(): the process mode set by the private op
# attn_ext::_set_cuda_attention_kernels (1 = simple kernels only; attn_ext.ops._simple_cuda_kernels())
FORCE_SIMPLE_OP = "_set_cuda_attention_kernels"
FORCE_SIMPLE_WHY = "attn_ext.ops._simple_cuda_kernels() is active"


def _cuda_kernel_mode() -> int:
    """The CUDA attention kernel mode (0 automatic, 1 simple only); 0 without the CUDA library."""
    from .ops import _cuda_library_loaded

    if not _cuda_library_loaded():
        return 0
    return getattr(torch.ops.attn_ext, FORCE_SIMPLE_OP)(-1)  # -1: read, change nothing


def cuda_fwd_smem_bytes(head_dim: int) -> int:
    """fa2::fwd_smem_bytes: dynamic shared memory of the fast forward kernel."""
    return (64 + 4 * (64 if head_dim <= 128 else 32)) * (head_dim + 8) * 2


def cuda_bwd_smem_bytes(head_dim: int) -> int:
    """fa2::bwd_smem_bytes: dynamic shared memory of the fast backward kernel."""
    return ((2 * 128 + 4 * 64) * (head_dim + 8) + 128 * (64 + 8)) * 2 + 4 * 64 * 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Shape:
    B: int
    Sq: int
    Sk: int
    H: int
    Hkv: int
    D: int
    Dv: int


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """What :func:`explain` found. ``forward`` / ``backward`` name the path:

    ``"cpu.decode"`` (few query rows: csrc/cpu/attention_decode.h), ``"cpu.tiled"``,
    ``"cpu.split_kv"``, ``"cpu.key_tiles"`` (the CPU backward),
    ``"cuda.split_kv"``, ``"cuda.fa2"``, ``"cuda.simple"``, or ``"none"`` (empty or meta input: no
    kernel runs). ``details`` holds the numbers the choice was made from (tiles, threads,
    n_split, shared memory, ...). ``str()`` gives a readable summary."""

    device: str
    forward: str
    forward_reason: str
    backward: str
    backward_reason: str
    details: dict

    def __str__(self) -> str:
        return (f"attn_ext on {self.device}:\n"
                f"  forward:  {self.forward} - {self.forward_reason}\n"
                f"  backward: {self.backward} - {self.backward_reason}")


# ---- CPU ---------------------------------------------------------------------------------


def cpu_forward_plan(s: Shape, threads: int, dropout: bool = False) -> dict:
    """The CPU forward's tile plan and split decision (attention_fwd.cpp plan_tiles and
    attention_fwd_kernel), for ``threads`` = at::get_num_threads(). With dropout the split
    plan counts CPU_DROPOUT_SPLIT_WORKERS instead of the threads (thread-independent bits)."""
    group = s.H // s.Hkv
    rows = max(1, min(s.Sq, CPU_BLOCK_Q))
    heads = max(1, min(group, CPU_BLOCK_Q // rows))
    n_tiles = s.B * s.Hkv * _ceil_div(group, heads) * _ceil_div(s.Sq, rows)
    workers = CPU_DROPOUT_SPLIT_WORKERS if dropout else threads
    n_split = 1
    if n_tiles < workers and s.Sk >= 4 * CPU_BLOCK_K:
        n_split = min(_ceil_div(2 * workers, n_tiles), s.Sk // (2 * CPU_BLOCK_K))
    return {"threads": threads, "query_tiles": n_tiles, "rows_per_tile": rows,
            "heads_per_tile": heads, "split_workers": workers, "n_split": max(n_split, 1)}


CPU_DECODE_COLS = 16  # kDecodeCols (csrc/cpu/attention_decode.h): query columns per kv head
CPU_DECODE_MIN_CHUNK = 256  # kDecodeMinChunk: keys per split-K chunk at least
CPU_DECODE_HEAD_SPLIT_MIN_BYTES = 384 << 10  # kDecodeHeadSplitMinBytes


def cpu_flags() -> list:
    """The CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return []


def cpu_simd_enabled() -> bool:
    """csrc/cpu/cpu_features.cpp's detector: AVX2, FMA and F16C, unless ATTN_EXT_CPU_SIMD=0."""
    if os.environ.get("ATTN_EXT_CPU_SIMD") == "0":
        return False
    flags = cpu_flags()
    return all(x in flags for x in ("avx2", "fma", "f16c"))


def cpu_avx512_enabled() -> bool:
    """csrc/cpu/cpu_features.cpp's avx512_enabled(): cpu_simd_enabled() and AVX-512F + BW,
    unless ATTN_EXT_CPU_AVX512=0 (the decode kernel's AVX-512 PV product)."""
    if not cpu_simd_enabled() or os.environ.get("ATTN_EXT_CPU_AVX512") == "0":
        return False
    flags = cpu_flags()
    return all(x in flags for x in ("avx512f", "avx512bw"))


def cpu_gemm(dtype: torch.dtype) -> str:
    """Which fp32 gemm micro-kernel the tiled kernels run (csrc/cpu/attention_microkernels.h
    kernels()): "avx512" (zmm; mk::gemm512_enabled: cpu_avx512_enabled() and
    ATTN_EXT_CPU_GEMM512 is not 0), "avx2" (ymm), or "portable" (float64 inputs, or no AVX2)."""
    if dtype == torch.float64 or not cpu_simd_enabled():
        return "portable"
    if cpu_avx512_enabled() and os.environ.get("ATTN_EXT_CPU_GEMM512") != "0":
        return "avx512"
    return "avx2"


def cpu_avx512bf16_enabled() -> bool:
    """csrc/cpu/cpu_features.cpp's avx512bf16_enabled(): cpu_avx512_enabled() and AVX512_BF16
    + AVX-512VL (the decode kernel's bf16 scores by vdpbf16ps, unless
    ATTN_EXT_CPU_BF16DP=0 at the call)."""
    flags = cpu_flags()
    return cpu_avx512_enabled() and "avx512_bf16" in flags and "avx512vl" in flags


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD", ...; "" where unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.split(":", 1)[1].strip() if ":" in line else ""


def cpu_amx_enabled() -> bool:
    """csrc/cpu/cpu_features.cpp's amx_enabled(): cpu_avx512bf16_enabled() and AMX-TILE +
    AMX-BF16 on Linux (the tiled kernels' bf16 products on AMX tiles, csrc/cpu/attention_amx.cpp)."""
    flags = cpu_flags()
    return (sys.platform.startswith("linux") and cpu_avx512bf16_enabled()
            and "amx_tile" in flags and "amx_bf16" in flags)


def _cpu_amx_on() -> bool:
    """attention_amx.cpp's amx_on(): cpu_amx_enabled() and neither ATTN_EXT_CPU_BF16DP=0 nor
    ATTN_EXT_CPU_AMX=0."""
    return (cpu_amx_enabled() and os.environ.get("ATTN_EXT_CPU_BF16DP") != "0"
            and os.environ.get("ATTN_EXT_CPU_AMX") != "0")


def cpu_bf16_amx(depth: int) -> bool:
    """mk::amx_for(depth): the tiled kernels' bf16 products of this depth (the scores q . k at
    depth D; the backward's dP = dout . v at Dv) on AMX tiles: _cpu_amx_on() and depth a positive
    multiple of 32."""
    return depth > 0 and depth % 32 == 0 and _cpu_amx_on()


def cpu_bf16_pv(dtype: torch.dtype, Dv: int) -> Optional[str]:
    """The tiled forward's o += p v for bf16 (mk::amx_pv_for): "amx" (p rounded to bf16 pairs,
    v^T packed as bf16 key pairs per head) where cpu_amx_enabled(), Dv a positive multiple of 16
    and neither switch is 0; else "widened" (fp32 gemm); None for other dtypes."""
    if dtype != torch.bfloat16:
        return None
    return "amx" if Dv > 0 and Dv % 16 == 0 and _cpu_amx_on() else "widened"


def cpu_fp16_tiles(dtype: torch.dtype, D: int, Dv: int) -> Optional[str]:
    """The tiled forward's products for fp16 (mk::fp16_on_tiles): "amx split" where both can run
    on AMX tiles (cpu_bf16_amx(D) and Dv a positive multiple of 16): every fp16 value is split
    exactly into bf16 hi + lo, and each product takes its hi / lo terms in one tile chain: all
    four for the scores (exact, as widened), hi hi + hi lo + lo hi for o += p v (p split to 16
    bits; csrc/cpu/attention_amx.cpp split_fp16); else "widened" (fp32). None for other dtypes.
    The backward follows the same rule (its recomputed scores are the forward's split products;
    dv, dk and dq split on the tiles too), except dP and its row term Di, which also need Dv a
    multiple of 32 (cpu_fp16_dp)."""
    if dtype != torch.float16:
        return None
    return ("amx split" if cpu_bf16_amx(D) and Dv > 0 and Dv % 16 == 0 and _cpu_amx_on()
            else "widened")


def cpu_fp16_dp(dtype: torch.dtype, D: int, Dv: int) -> Optional[str]:
    """The fp16 backward's dP = dout . v and row term Di = dout . out: "amx split" where
    cpu_fp16_tiles says "amx split" and Dv is a multiple of 32 (mk::amx_for(Dv)), else
    "widened" (the fp32 gemm's chains, Di in the same); None for other dtypes."""
    if dtype != torch.float16:
        return None
    return "amx split" if cpu_fp16_tiles(dtype, D, Dv) == "amx split" and cpu_bf16_amx(Dv) \
        else "widened"


def cpu_bf16_scores(dtype: torch.dtype, even: bool = True,
                    depth: Optional[int] = None) -> Optional[str]:
    """How a bf16 call's scores are formed: "vdpbf16ps" or "widened" (to float32); None for other
    dtypes. vdpbf16ps where cpu_avx512bf16_enabled(), ATTN_EXT_CPU_BF16DP is not 0, and
    ATTN_EXT_CPU_BF16DP=1 or, by default, the CPU is not Intel's (mk::bf16dp_tiled_enabled;
    cpu::intel_cpu): the one rule of the decode kernel (attention_decode.h dp_scores) and of the
    tiled kernels (csrc/cpu/attention_bf16dp.cpp, where the product's depth is even: ``even``).
    The tiled kernels (``depth`` given) say "amx" where cpu_bf16_amx(depth): their scores then
    come from AMX tiles, whatever the vendor rule says (mk::bf16_scores_by_pairs)."""
    if dtype != torch.bfloat16:
        return None
    if depth is not None and cpu_bf16_amx(depth):
        return "amx"
    env = os.environ.get("ATTN_EXT_CPU_BF16DP")
    dp = even and cpu_avx512bf16_enabled() and env != "0"
    if dp and env != "1":
        dp = cpu_vendor() != "GenuineIntel"
    return "vdpbf16ps" if dp else "widened"


def cpu_decode_scores(dtype: torch.dtype, D: Optional[int] = None) -> Optional[str]:
    """The register width of the decode kernel's widened scores (attention_decode.h scores():
    fp32 / fp16, and bf16 where cpu_bf16_scores says "widened"): "zmm" where
    cpu_avx512_enabled() and ATTN_EXT_CPU_DECODE_SCORES512 is not 0
    (decode_scores512_enabled; 2 or 4 columns at a time, one column on ymm), else "ymm"; None
    where the scores are vdpbf16ps pairs or (``D`` given) on AMX tiles."""
    if cpu_bf16_scores(dtype, depth=D) in ("vdpbf16ps", "amx"):
        return None
    if cpu_avx512_enabled() and os.environ.get("ATTN_EXT_CPU_DECODE_SCORES512") != "0":
        return "zmm"
    return "ymm"


def cpu_decode_pv(dtype: torch.dtype, D: int, Dv: int) -> Optional[str]:
    """How the bf16 decode kernel forms o += p v (attention_decode.h decode_pv_by_pairs):
    "vdpbf16ps" (p rounded to bf16, two keys per instruction) where its scores are vdpbf16ps
    pairs (cpu_bf16_scores), Dv is a multiple of 16 and ATTN_EXT_CPU_DECODE_PV_PAIRS is not 0,
    else "widened" (fp32 FMAs, p in fp32); None for other dtypes."""
    if dtype != torch.bfloat16:
        return None
    if (cpu_bf16_scores(dtype, depth=D) == "vdpbf16ps" and Dv % 16 == 0
            and os.environ.get("ATTN_EXT_CPU_DECODE_PV_PAIRS") != "0"):
        return "vdpbf16ps"
    return "widened"


def band_keys(sq: int, sk: int, causal: bool = False, window=(-1, -1)) -> int:
    """How many keys some row of an (sq, sk) call sees by the band (causal, window): the
    length of the union of the rows' key ranges, as reference.visibility_mask's column count
    with some True, in O(1) (a decode shape's mask can be gigabytes). Row i sees the keys j
    with dmin <= i + (sk - sq) - j <= dmax; the rows' ranges shift by one key per row, so
    their union is one range, cut to [0, sk)."""
    left, right = window if window is not None else (-1, -1)
    dmin = max(0 if causal else -(sk + sq), -right if right >= 0 else -(sk + sq))
    dmax = left if left >= 0 else sk + sq
    if sq <= 0 or sk <= 0 or dmin > dmax:
        return 0
    off = sk - sq
    return max(0, min(sk - 1, sq - 1 + off - dmin) - max(0, off - dmax) + 1)


def cpu_decode_plan(s: Shape, dtype: torch.dtype, threads: int, terms: tuple = (),
                    causal: bool = False, window=(-1, -1)) -> Optional[dict]:
    """csrc/cpu/attention_decode.h decode_supported and its split-K chunk count, or None when
    the tiled kernel runs. ``terms``: the names of the score terms of the call (dropout_p:
    the tiled kernel). The chunks split the keys some row sees by the band (causal, window;
    key padding does not narrow it), as the kernel's max_keys."""
    if dtype == torch.float64 or not cpu_simd_enabled() or "dropout_p" in terms:
        return None
    if os.environ.get("ATTN_EXT_CPU_DECODE") == "0":
        return None
    if s.Hkv <= 0 or s.D <= 0 or s.D > 512 or s.Dv > 512:
        return None
    group = s.H // s.Hkv
    if s.Sq * group > CPU_DECODE_COLS:
        return None
    # work units (sequence, key chunk, kv head group), a group every kv head unless one chunk
    # and fewer sequences than threads split the heads
    workers = max(threads, 1)
    keys = band_keys(s.Sq, s.Sk, causal, window)
    n_chunks = max(1, _ceil_div(4 * workers, max(s.B, 1)))
    n_chunks = min(n_chunks, max(1, keys // CPU_DECODE_MIN_CHUNK))
    elem = torch.empty(0, dtype=dtype).element_size()
    head_groups = 1
    if (os.environ.get("ATTN_EXT_CPU_DECODE_HEAD_SPLIT") != "0" and n_chunks == 1
            and s.B < workers and s.Hkv > 1
            and keys * s.Hkv * (s.D + s.Dv) * elem >= CPU_DECODE_HEAD_SPLIT_MIN_BYTES):
        per = _ceil_div(s.Hkv, min(s.Hkv, _ceil_div(workers, max(s.B, 1))))
        head_groups = _ceil_div(s.Hkv, per)
    return {"threads": threads, "columns_per_kv_head": s.Sq * group, "kv_heads": s.B * s.Hkv,
            "n_chunks": n_chunks, "head_groups": head_groups,
            "bf16_scores": cpu_bf16_scores(dtype, depth=s.D),
            "scores": cpu_decode_scores(dtype, s.D), "bf16_pv": cpu_decode_pv(dtype, s.D, s.Dv)}


def _explain_cpu(s: Shape, dtype: torch.dtype, threads: int, terms: tuple = (),
                 causal: bool = False, window=(-1, -1)) -> KernelChoice:
    acc = "float64" if dtype == torch.float64 else "float32"
    inner = ("portable loops" if dtype == torch.float64 else
             "AVX2/FMA microkernels when the CPU has AVX2+FMA+F16C, else portable loops")
    if s.B * s.H * s.Sq == 0:
        return KernelChoice("cpu", "none", "empty output (B * H * Sq = 0): no kernel runs",
                            "none", "nothing to differentiate", {"threads": threads})
    plan = cpu_forward_plan(s, threads, dropout="dropout_p" in terms)
    plan["accumulation"] = acc
    decode = cpu_decode_plan(s, dtype, threads, terms, causal, window)
    workers_text = (f"{plan['split_workers']} planned workers (dropout: the same chunks at every "
                    "thread count)" if "dropout_p" in terms else f"{threads} threads")
    if decode is not None:
        plan.update(decode)
        fwd, why = "cpu.decode", (
            f"Sq * (H / Hkv) = {decode['columns_per_kv_head']} <= {CPU_DECODE_COLS} query columns "
            f"per kv head ({dtype} on an AVX2 CPU): K/V read once, in memory order, by units of "
            f"(sequence, key chunk) covering every kv head; {decode['n_chunks']} chunk(s) per "
            f"sequence (4 units per thread, at least {CPU_DECODE_MIN_CHUNK} keys each) merged in "
            "chunk order"
            + (f"; the kv heads in {decode['head_groups']} groups, a unit each (one chunk, fewer "
               "sequences than threads; the same bits; ATTN_EXT_CPU_DECODE_HEAD_SPLIT=0 turns "
               "them off)" if decode["head_groups"] > 1 else "")
            + "; float32 accumulation"
            + ("; bf16 scores by vdpbf16ps (AVX512_BF16; ATTN_EXT_CPU_BF16DP=0 widens "
               "them to float32 instead)" if decode["bf16_scores"] == "vdpbf16ps" else "")
            + ("; bf16 scores on AMX tiles, K read where it is (ATTN_EXT_CPU_AMX=0 or "
               "ATTN_EXT_CPU_BF16DP=0 turns them off)" if decode["bf16_scores"] == "amx"
               else "")
            + ("; o += p v by vdpbf16ps, p rounded to bf16 as PyTorch's bf16 flash kernel does "
               "(ATTN_EXT_CPU_DECODE_PV_PAIRS=0: fp32 FMAs)" if decode["bf16_pv"] == "vdpbf16ps"
               else "")
            + ("; scores of 2+ columns on zmm registers (ATTN_EXT_CPU_DECODE_SCORES512=0: ymm, "
               "same bits)" if decode["scores"] == "zmm" else "")
            + " (ATTN_EXT_CPU_DECODE=0 turns it off)")
    elif plan["n_split"] > 1:
        fwd, why = "cpu.split_kv", (
            f"{plan['query_tiles']} query tile(s) < {workers_text} and Sk = {s.Sk} >= "
            f"{4 * CPU_BLOCK_K}: the keys of each tile are cut into {plan['n_split']} chunks "
            f"run in parallel and merged through their (max, sum); {acc} accumulation, {inner}")
    else:
        reason = (f"{plan['query_tiles']} query tile(s) >= {workers_text}"
                  if plan["query_tiles"] >= plan["split_workers"] else
                  f"Sk = {s.Sk} < {4 * CPU_BLOCK_K}, too few keys to split")
        fwd, why = "cpu.tiled", (
            f"{reason}: one task per query tile of up to {CPU_BLOCK_Q} (head, row) columns, "
            f"key tiles of {CPU_BLOCK_K}; {acc} accumulation, {inner}")
    if decode is None:  # the tiled kernels' pass 1 (csrc/cpu/attention_bf16dp.cpp)
        plan["gemm"] = cpu_gemm(dtype)
        if plan["gemm"] == "avx512":
            why += "; fp32 gemms on AVX-512 zmm registers (ATTN_EXT_CPU_GEMM512=0: AVX2, same bits)"
        plan["bf16_scores"] = cpu_bf16_scores(dtype, even=s.D % 2 == 0, depth=s.D)
        if plan["bf16_scores"] == "vdpbf16ps":
            why += "; bf16 scores by vdpbf16ps (AVX512_BF16; ATTN_EXT_CPU_BF16DP=0 widens them)"
        elif plan["bf16_scores"] == "amx":
            why += ("; bf16 scores on AMX tiles (tdpbf16ps; ATTN_EXT_CPU_AMX=0: the CPU's "
                    "default without them, ATTN_EXT_CPU_BF16DP=0: widened)")
        plan["bf16_pv"] = cpu_bf16_pv(dtype, s.Dv)
        if plan["bf16_pv"] == "amx":
            why += "; o += p v on AMX tiles (p rounded to bf16, as PyTorch's bf16 flash kernel)"
        plan["fp16_products"] = cpu_fp16_tiles(dtype, s.D, s.Dv)
        if plan["fp16_products"] == "amx split":
            why += ("; fp16 scores and o += p v on AMX tiles, each value split exactly into bf16 "
                    "hi + lo (the scores exact from all four hi / lo terms, o += p v from three; "
                    "ATTN_EXT_CPU_AMX=0: widened); "
                    "its backward on the tiles too (dP and Di where Dv % 32 == 0)")
        # fp16's backward on the tiles where its forward is (QueryPackLayout split)
        plan["fp16_backward"] = plan["fp16_products"]
        plan["fp16_dp"] = cpu_fp16_dp(dtype, s.D, s.Dv)
        # the backward's dk += dS^T q and dv += P^T dout (QueryPackLayout amx_dk / amx_dv)
        plan["bf16_dk"] = cpu_bf16_pv(dtype, s.D)
        plan["bf16_dv"] = plan["bf16_pv"]
        plan["bf16_dq"] = plan["bf16_dk"]  # dq^T += k^T dS^T (QueryPackLayout amx_dq)
    if s.B * s.Hkv >= threads or s.Sk <= CPU_BLOCK_K:
        bwd_why = (f"fused per (batch, kv head) ({s.B * s.Hkv} unit(s), {threads} threads): each "
                   f"unit walks its query blocks and key tiles of {CPU_BLOCK_K}, owning the dq, "
                   "dk and dv it writes (bitwise repeatable for any thread count)")
    else:
        bwd_why = (f"FlashAttention-2 split ({s.B * s.Hkv} (batch, kv head) units < {threads} "
                   "threads): dk/dv by key chunks, then dq by query blocks (bitwise repeatable "
                   "for a thread count)")
    if s.Sq == 0 or s.Sk == 0:
        bwd_why = "no query or no key: the gradients are zeros, no kernel runs"
    return KernelChoice("cpu", fwd, why, "cpu.key_tiles" if s.Sq and s.Sk else "none",
                        bwd_why, plan)


# ---- CUDA --------------------------------------------------------------------------------


def aligned16(t: torch.Tensor) -> bool:
    """attention.cu aligned16: data pointer 16-byte aligned and the batch/row/head strides
    multiples of 8 elements (what the fast kernels' 16-byte loads need)."""
    return t.data_ptr() % 16 == 0 and all(t.stride(d) % 8 == 0 for d in range(3))


def cuda_split_plan(s: Shape, sms: int, force_simple: bool = False) -> dict:
    """attention.cu plan_split: ``n_split > 1`` when the split-KV decode path runs."""
    plan = {"n_split": 1, "chunk": 0, "sms": sms}
    if s.Sq > CUDA_SPLIT_MAX_SQ or s.Sk < CUDA_SPLIT_MIN_SK or force_simple or sms <= 0:
        return plan
    rows = s.B * s.H * s.Sq
    target = sms * CUDA_SPLIT_WARPS_PER_SM
    if rows * 4 >= target:
        return plan
    n = min(_ceil_div(target, rows), _ceil_div(s.Sk, CUDA_SPLIT_MIN_CHUNK))
    if n < 2:
        return plan
    chunk = _ceil_div(s.Sk, n)
    plan.update(n_split=_ceil_div(s.Sk, chunk), chunk=chunk)
    return plan


def _fast_input_reasons(s: Shape, dtype: torch.dtype, what: str, head_dims: tuple, aligned: bool,
                        stride_rule: str) -> list:
    """The input conditions the fast forward and backward share (use_fast_forward /
    use_fast_backward): dtype, head dims, non-empty, alignment; the reasons they fail."""
    reasons = []
    if dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"dtype {str(dtype).replace('torch.', '')} (the fast {what} is fp16/bf16 only)")
    if s.D != s.Dv:
        reasons.append(f"D = {s.D} != Dv = {s.Dv}")
    elif s.D not in head_dims:
        reasons.append(f"head dim {s.D} not in {list(head_dims)}")
    if s.Sk <= 0 or s.Sq <= 0:
        reasons.append("no key or no query")
    if not aligned:
        reasons.append(f"q, k or v not 16-byte aligned or {stride_rule}")
    return reasons


def cuda_forward_choice(s: Shape, dtype: torch.dtype, aligned: bool, sms: int,
                        smem_optin: int, force_simple: bool = False, terms: tuple = ()):
    """(path, reason, details) of the CUDA forward (attention.cu attention_forward_cuda).
    ``aligned``: aligned16() of q, k and v; ``smem_optin``: the device's opt-in shared
    memory per block (0 if unknown); ``terms``: the names of the call's score terms (the
    split-KV path takes them all, the fast kernel too but not at D = 256)."""
    split = cuda_split_plan(s, sms, force_simple)
    if split["n_split"] > 1:
        return "cuda.split_kv", (
            f"decode shape (Sq = {s.Sq} <= {CUDA_SPLIT_MAX_SQ}, Sk = {s.Sk} >= "
            f"{CUDA_SPLIT_MIN_SK}) whose {s.B * s.H * s.Sq} rows fill under a quarter of "
            f"{sms} SMs x {CUDA_SPLIT_WARPS_PER_SM} warps: keys cut into {split['n_split']} "
            f"chunks of {split['chunk']}, one warp per (row, chunk), then merged"), split
    need = cuda_fwd_smem_bytes(s.D)
    details = dict(split, smem_needed=need, smem_optin=smem_optin)
    reasons = _fast_input_reasons(s, dtype, "kernel", CUDA_FWD_FAST_HEAD_DIMS, aligned,
                                  "a batch/row/head stride not a multiple of 8 elements")
    if not (_ceil_div(s.Sq, CUDA_FA2_BLOCK_M) <= 0x7FFFFFFF and s.H <= 65535 and s.B <= 65535):
        reasons.append(f"grid too large (B = {s.B}, H = {s.H} must be <= 65535)")
    if s.Sq + s.Sk >= CUDA_FAST_MAX_SEQ_LEN:
        reasons.append("Sq + Sk >= 2^30 (the fast kernels count rows, keys and distances in 32 bits)")
    if terms and s.D == s.Dv and s.D in CUDA_FWD_FAST_HEAD_DIMS and s.D not in CUDA_FWD_FAST_TERMS_HEAD_DIMS:
        reasons.append(f"score terms at D = {s.D} (the fast kernel's terms instances exist for D in "
                       f"{list(CUDA_FWD_FAST_TERMS_HEAD_DIMS)}: at 256 their registers spill)")
    if s.D == s.Dv and s.D in CUDA_FWD_FAST_HEAD_DIMS and need > smem_optin:
        reasons.append(f"its shared memory ({need} bytes at D = {s.D}) exceeds the device's "
                       f"opt-in limit ({smem_optin} bytes)")
    if force_simple:
        reasons.append(FORCE_SIMPLE_WHY)
    if not reasons:
        with_terms = f", with the score terms {', '.join(terms)}" if terms else ""
        return "cuda.fa2", (f"fp16/bf16, D = Dv = {s.D}, 16-byte aligned, shared memory "
                            f"{need} <= {smem_optin} bytes: FA2-style tensor-core kernel "
                            f"(query tiles of {CUDA_FA2_BLOCK_M}){with_terms}"), details
    return "cuda.simple", "simple kernel (one warp per query row) because " + "; ".join(reasons), details


def cuda_backward_choice(s: Shape, dtype: torch.dtype, aligned: bool, smem_optin: int,
                         deterministic: bool, force_simple: bool = False,
                         dout_aligned: Optional[bool] = None, terms: tuple = (),
                         rel_max: int = 0):
    """(path, reason, details) of the CUDA backward (attention.cu use_fast_backward).
    ``dout_aligned`` None: dout not known yet (the gradient that autograd hands in, usually
    contiguous and aligned). ``terms``: the call's score terms other than sinks (the
    backward reads the sinks through lse); ``rel_max``: M of a (H, 2M + 1) rel_bias (its
    gradient's accumulator takes (2M + 1) * 4 bytes of shared memory more, dropout's row keys
    1 KiB: fa2::bwd_terms_smem_bytes)."""
    need = (cuda_bwd_smem_bytes(s.D) + ((2 * rel_max + 1) * 4 if "rel_bias" in terms else 0)
            + (2 * 64 * 8 if "dropout_p" in terms else 0))
    details = {"smem_needed": need, "smem_optin": smem_optin, "deterministic": deterministic}
    reasons = _fast_input_reasons(s, dtype, "backward", CUDA_BWD_FAST_HEAD_DIMS, aligned,
                                  "a stride not a multiple of 8 elements")
    if dout_aligned is False:
        reasons.append("dout not 16-byte aligned or a stride not a multiple of 8 elements")
    steps = (s.H // max(s.Hkv, 1)) * _ceil_div(s.Sq, 64)
    if not (steps <= 0x7FFFFFFF and s.Hkv <= 65535 and s.B <= 65535
            and _ceil_div(s.Sk, CUDA_BWD_BLOCK_N) <= 0x7FFFFFFF
            and s.Sq + s.Sk < CUDA_FAST_MAX_SEQ_LEN):
        reasons.append("grid too large")
    if "dropout_p" in terms and s.D == s.Dv and s.D in CUDA_BWD_FAST_HEAD_DIMS \
            and s.D not in CUDA_BWD_DROPOUT_HEAD_DIMS:
        reasons.append(f"dropout_p at D = {s.D} (the fast backward's dropout instances exist "
                       f"for D in {list(CUDA_BWD_DROPOUT_HEAD_DIMS)}: at 128 their registers "
                       f"spill)")
    if deterministic:
        reasons.append("torch.use_deterministic_algorithms(True) (the fast backward adds dq "
                       "with fp32 atomics)")
    if s.D == s.Dv and s.D in CUDA_BWD_FAST_HEAD_DIMS and need > smem_optin:
        with_rel = f" with d rel_bias's {2 * rel_max + 1} entries" if "rel_bias" in terms else ""
        reasons.append(f"its shared memory ({need} bytes at D = {s.D}{with_rel}) exceeds the "
                       f"device's opt-in limit ({smem_optin} bytes)")
    if force_simple:
        reasons.append(FORCE_SIMPLE_WHY)
    if not reasons:
        cond = "" if dout_aligned else " (if dout is 16-byte aligned too)"
        return "cuda.fa2", (f"fp16/bf16, D = Dv = {s.D}, aligned, shared memory {need} <= "
                            f"{smem_optin} bytes: FA2-style tensor-core backward{cond}"), details
    return ("cuda.simple", "simple kernels (dq per query row, then dk/dv per key row; "
            "deterministic) because " + "; ".join(reasons), details)


def _explain_cuda(s: Shape, q, k, v, dout, terms: tuple = (), rel_max: int = 0) -> KernelChoice:
    from . import build_info
    from .ops import _cuda_library_loaded

    if not _cuda_library_loaded():  # attention() on q would fail in the dispatcher
        raise ValueError(f"q is on {q.device}, but attn_ext's CUDA kernels are not loaded in this "
                         f"process: {build_info()['cuda_status']}")
    if s.D > CUDA_SIMPLE_MAX_HEAD_DIM or s.Dv > CUDA_SIMPLE_MAX_HEAD_DIM:
        raise ValueError(f"head dims must be <= {CUDA_SIMPLE_MAX_HEAD_DIM} on CUDA, got "
                         f"D = {s.D}, Dv = {s.Dv} (the call would fail)")
    if s.B * s.H * s.Sq == 0:
        return KernelChoice(str(q.device), "none", "empty output (B * H * Sq = 0): no kernel runs",
                            "none", "nothing to differentiate", {})
    props = torch.cuda.get_device_properties(q.device)
    sms = int(getattr(props, "multi_processor_count", 0))
    optin = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    force = _cuda_kernel_mode() == 1
    aligned = aligned16(q) and aligned16(k) and aligned16(v)
    fwd, fwhy, fdet = cuda_forward_choice(s, q.dtype, aligned, sms, optin, force, terms)
    bwd, bwhy, bdet = cuda_backward_choice(
        s, q.dtype, aligned, optin, torch.are_deterministic_algorithms_enabled(), force,
        None if dout is None else aligned16(dout), tuple(t for t in terms if t != "sinks"),
        rel_max)
    if s.Sk == 0:
        bwd, bwhy = "none", "no key: dq is zeros, no kernel runs"
    details = dict(fdet, backward=bdet)
    return KernelChoice(str(q.device), fwd, fwhy, bwd, bwhy, details)


# ---- entry point -------------------------------------------------------------------------


def _check(q, k, v):
    for name, t, dims in (("q", q, "(B, Sq, H, D)"), ("k", k, "(B, Sk, Hkv, D)"),
                          ("v", v, "(B, Sk, Hkv, Dv)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims {dims}, got shape {list(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have the same dtype as q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be float32, float64, float16 or bfloat16, got {q.dtype}")
    B, Sq, H, D = q.shape
    _, Sk, Hkv, Dk = k.shape
    if k.size(0) != B or v.size(0) != B:
        raise ValueError(f"k and v must have batch size B = {B} (from q), got shapes "
                         f"{list(k.shape)} and {list(v.shape)}")
    if Dk != D:
        raise ValueError(f"k must have head dim D = {D} (from q), got shape {list(k.shape)}")
    if v.size(1) != Sk or v.size(2) != Hkv:
        raise ValueError(f"v must have Sk = {Sk} keys and Hkv = {Hkv} heads (from k), got shape {list(v.shape)}")
    if not ((Hkv > 0 and H % Hkv == 0) or (Hkv == 0 and H == 0)):
        raise ValueError(f"k's number of heads Hkv = {Hkv} must divide q's number of heads H = {H}")
    return Shape(B, Sq, Sk, H, Hkv, D, v.size(3))


def score_terms_of(alibi_slopes=None, rel_bias=None, softcap=None, sinks=None,
                   dropout_p: float = 0.0) -> tuple:
    """The names of the score terms a call asks for (ScoreTerms not plain() when any)."""
    named = (("alibi_slopes", alibi_slopes is not None), ("rel_bias", rel_bias is not None),
             ("softcap", softcap is not None), ("sinks", sinks is not None),
             ("dropout_p", bool(dropout_p)))
    return tuple(name for name, on in named if on)


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
            scale: Optional[float] = None, window=None,
            key_padding_mask: Optional[torch.Tensor] = None,
            alibi_slopes: Optional[torch.Tensor] = None, rel_bias: Optional[torch.Tensor] = None,
            softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
            dropout_p: float = 0.0, return_lse: bool = False,
            dout: Optional[torch.Tensor] = None) -> KernelChoice:
    """Say which kernel ``attn_ext.attention(q, k, v, **keywords)`` will run for these tensors,
    and why (the forward and, for training, the backward). It takes every keyword of
    :func:`attn_ext.attention`, so a call can be mirrored as it is.

    The masks (``causal``, ``window``, ``key_padding_mask``) and ``return_lse`` do not change
    the choice (see the module docstring); they are checked as attention checks them and
    listed in ``details["masks"]`` (the score terms given in ``details["score_terms"]``).
    The score terms (``alibi_slopes``, ``rel_bias``, ``softcap``, ``sinks``, ``dropout_p``)
    count only by being given (and rel_bias by its size, on CUDA): on CUDA any term rules
    out the fast forward at D = 256 and dropout the fast backward at D = 128 (sinks reach the
    backward through lse); dropout rules out the CPU decode kernel.

    Runs no kernel and reads no tensor values: only shapes, dtypes, strides, data pointers,
    the thread count (CPU), the device's properties and torch's deterministic flag (CUDA).
    ``dout``: the output gradient, when known (its alignment matters on CUDA). The answer
    holds for the current settings (``torch.set_num_threads``,
    ``torch.use_deterministic_algorithms``, the ``ATTN_EXT_CPU_*`` switches) at the time of the
    call; the C++ reads ``ATTN_EXT_CPU_SIMD`` and ``ATTN_EXT_CPU_AVX512`` once per process (at
    the first kernel that asks), so set those before any attn_ext call. ``print()`` it::

        >>> print(attn_ext.explain(q, k, v, causal=True))
        attn_ext on cuda:0:
          forward:  cuda.simple - simple kernel (one warp per query row) because dtype float32 ...
    """
    # attention's own checks, in its order (explain refuses what attention refuses)
    _check_qkv(q, k, v, "(B, Sq, H, D) or (B, Sq, D)", "(B, Sk, Hkv, D)", "(B, Sk, Hkv, Dv)")
    q, k, v, squeeze = _heads_4d(q, k, v)
    if squeeze and isinstance(dout, torch.Tensor) and dout.dim() == 3:
        dout = dout.unsqueeze(2)
    if dout is not None and not isinstance(dout, torch.Tensor):
        raise TypeError(f"dout must be a torch.Tensor or None, got {type(dout).__name__}")
    s = _check(q, k, v)
    if dout is not None:  # (attention's backward refuses any other dout)
        want = [s.B, s.Sq, s.H, s.Dv]
        if list(dout.shape) != want:
            raise ValueError(f"dout must have the output's shape {want} (B, Sq, H, Dv), got "
                             f"{list(dout.shape)}")
        if dout.dtype != q.dtype or dout.device != q.device:
            raise ValueError(f"dout must have q's dtype and device ({q.dtype}, {q.device}), got "
                             f"{dout.dtype}, {dout.device}")
    _check_causal(causal)
    _check_return_lse(return_lse)
    _check_scale(scale)
    left, right = _window_args(window)
    _check_key_padding_mask(key_padding_mask, s.B, s.Sk, q.device)
    alibi_slopes, rel_bias, softcap, sinks, dropout_p = _checked_score_terms(
        q, alibi_slopes, rel_bias, softcap, sinks, dropout_p)
    _check_term_shapes(q, alibi_slopes, rel_bias, sinks=sinks)
    masks = tuple(name for name, on in (("causal", bool(causal)),
                                        ("window", (left, right) != (-1, -1)),
                                        ("key_padding_mask", key_padding_mask is not None)) if on)
    choice = _explain(s, q, k, v, dout, alibi_slopes, rel_bias, softcap, sinks, dropout_p,
                      bool(causal), (left, right))
    choice.details["masks"] = masks
    choice.details["score_terms"] = score_terms_of(alibi_slopes, rel_bias, softcap, sinks, dropout_p)
    choice.details["return_lse"] = bool(return_lse)
    return choice


def _explain(s: Shape, q, k, v, dout, alibi_slopes, rel_bias, softcap, sinks, dropout_p,
             causal: bool = False, window=(-1, -1)) -> KernelChoice:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_last_dim_contiguous(t, name)
    terms = score_terms_of(alibi_slopes, rel_bias, softcap, sinks, dropout_p)
    if q.device.type == "cuda":
        rel_max = (rel_bias.shape[-1] - 1) // 2 if rel_bias is not None else 0
        return _explain_cuda(s, q, k, v, dout, terms, rel_max)
    if q.device.type == "cpu":
        return _explain_cpu(s, q.dtype, torch.get_num_threads(), terms, causal, window)
    if q.device.type == "meta":  # (attention takes meta tensors: its fake kernels give shapes)
        return KernelChoice("meta", "none", "meta tensors: the ops' fake kernels give the output "
                            "shapes, no kernel runs", "none", "meta tensors: no kernel runs", {})
    raise ValueError(f"attn_ext has kernels for cpu and cuda, got q on {q.device}")
