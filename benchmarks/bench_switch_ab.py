"""A/B of a CPU kernel switch read on every call, alternated call by call in one process: this
machine's speed drifts by +-15 % between runs, so the values are only compared within a round.

    python benchmarks/bench_switch_ab.py [--switch bwd-jobs|decode-quads|decode-pv512|decode-pv-pairs|decode-scores512|decode-head-split|bf16dp|gemm512|dp-tile16]
                                         [--repeats N]
                                         [--threads T] [--values A,B] [--quick]

--switch bwd-jobs (default): ATTN_EXT_CPU_BWD_JOBS, query blocks per visit of the key tiles in
the fused backward partition (csrc/cpu/attention_bwd.cpp kBwdJobs). Rows: the backward alone,
fp32 causal, q / k / v as BHSD transpose views, at (1, 8, 4096, 128) and (1, 16, 2048, 64).

--switch decode-quads: ATTN_EXT_CPU_DECODE_QUADS, the decode kernel's scores by 4 columns x 2
keys (1) or by pairs of columns (0) (csrc/cpu/attention_decode.h scores()). Rows: the decode
forward (Sq = 1, BSHD cache, D = 128) at issue 16's GQA shapes, fp32 and bf16, and bytes of K + V
read per second.

--switch decode-pv512: ATTN_EXT_CPU_DECODE_PV512, the decode kernel's PV product with AVX-512
(1; where the CPU has AVX-512F/BW) or AVX2 (0) (csrc/cpu/attention_decode.h pv512). The same
rows as decode-quads, with ATTN_EXT_CPU_DECODE_PV_PAIRS=0 set (bf16's product by pairs, where
it is on, takes neither).

--switch decode-pv-pairs: ATTN_EXT_CPU_DECODE_PV_PAIRS, the bf16 decode's o += p v by vdpbf16ps
pairs with p rounded to bf16 (1; where its scores are pairs, AVX512_BF16 on a CPU that is not
Intel's by default) or widened to fp32 FMAs (0) (csrc/cpu/attention_decode.h pv_pairs). The
same rows as decode-quads (fp32: a control); the two values round differently, so outputs are
checked close, not bitwise.

--switch decode-scores512: ATTN_EXT_CPU_DECODE_SCORES512, the decode kernel's widened scores
(fp32, fp16, and bf16 where they are not vdpbf16ps pairs) on zmm registers, two key groups per
register (1; where the CPU has AVX-512F/BW) or on ymm (0) (csrc/cpu/attention_decode.h
scores_cols512). The same rows as decode-quads; the same bits.

--switch decode-head-split: ATTN_EXT_CPU_DECODE_HEAD_SPLIT, the decode kernel's kv head groups
(1: one unit per group where a sequence's keys make one chunk and there are fewer sequences
than threads) or one unit per sequence (0) (csrc/cpu/attention_decode.h). Rows: short decode
steps (Sq = 1, BSHD cache, Sk 64-480) of GQA D = 128 and MHA D = 64 shapes, fp32 and bf16, with
SDPA (enable_gqa, on BHSD views of the same memory) timed in the same rounds; the same bits.

--switch bf16dp: ATTN_EXT_CPU_BF16DP, bf16 scores by vdpbf16ps (1; where the CPU has
AVX512_BF16) or widened to fp32 (0): the decode kernel's (csrc/cpu/attention_decode.h
dp_scores) and the tiled kernels' pass 1 (csrc/cpu/attention_bf16dp.cpp). The decode-quads rows
(the fp32 ones do not depend on it: a control), then the bf16 causal prefill forward and
backward at (1, 8, 4096, 128) and (1, 16, 2048, 64) (BSHD). Its two values sum in different
orders, so their outputs are checked close (one bf16 rounding of out, 1e-4 of lse), not
bitwise.

--switch dp-tile16: ATTN_EXT_CPU_DP_TILE16, the decode kernel's bf16 scores by vdpbf16ps in tiles
of 16 accumulators (1; 4 columns x 4 keys, reduced 16 at a time) or of 8 only (0)
(csrc/cpu/attention_decode.h dp_scores_tile16; where the CPU has AVX512_BF16), with
ATTN_EXT_CPU_BF16DP=1 set (the pairs, which Intel CPUs do not take by default). The same rows as
decode-quads (fp32: a control); the same bits.

--switch gemm512: ATTN_EXT_CPU_GEMM512, the tiled kernels' fp32 gemms on zmm registers (1; where
the CPU has AVX-512F/BW) or ymm (0) (csrc/cpu/attention_microkernels_avx512.cpp). Rows: the fp32
causal prefill forward and backward at (1, 8, 4096, 128) and (1, 16, 2048, 64), on BSHD memory and
on BHSD memory through transpose views; the same bits.

Every value's outputs are checked bitwise equal first (bf16dp, decode-pv-pairs: close); the order of the values alternates from
round to round; medians over the rounds, and the ratios to the first value.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (for _env)
from _env import checkout_first, print_env_header  # noqa: E402

checkout_first()
import attn_ext  # noqa: E402,F401
from attn_ext import ops  # noqa: E402

SHAPES = [(1, 8, 4096, 128), (1, 16, 2048, 64)]  # (B, H, S, D)
DECODE_SHAPES = [(1, 4096, 32, 8), (4, 2048, 32, 8), (16, 2048, 32, 8), (1, 32768, 32, 8)]
SHORT_DECODE_SHAPES = [(1, 64, 32, 8, 128), (1, 256, 32, 8, 128), (1, 128, 8, 8, 64),
                       (1, 256, 8, 8, 64), (1, 256, 12, 12, 64), (1, 480, 16, 16, 64)]
# switch: (variable, default values, whether every value gives the same bits)
SWITCHES = {"bwd-jobs": ("ATTN_EXT_CPU_BWD_JOBS", "1,4", True),
            "decode-quads": ("ATTN_EXT_CPU_DECODE_QUADS", "0,1", True),
            "decode-pv512": ("ATTN_EXT_CPU_DECODE_PV512", "0,1", True),
            "decode-pv-pairs": ("ATTN_EXT_CPU_DECODE_PV_PAIRS", "0,1", False),
            "decode-scores512": ("ATTN_EXT_CPU_DECODE_SCORES512", "0,1", True),
            "decode-head-split": ("ATTN_EXT_CPU_DECODE_HEAD_SPLIT", "0,1", True),
            "bf16dp": ("ATTN_EXT_CPU_BF16DP", "0,1", False),
            "gemm512": ("ATTN_EXT_CPU_GEMM512", "0,1", True),
            "dp-tile16": ("ATTN_EXT_CPU_DP_TILE16", "0,1", True)}


def table_header(title, lead, cells):
    """A markdown table's title and header: the lead columns, one cell per value, the ratios."""
    print(f"\n## {title}\n")
    print("| " + " | ".join(lead + cells) + " | ratio to the first |")
    print("|" + "---|" * (len(lead) + len(cells) + 1))


def table_row(lead, cells, med):
    """One row: the lead columns, the values' cells, each median's ratio to the first."""
    print("| " + " | ".join(lead + cells) + " | " + " / ".join(f"{m / med[0]:.3f}" for m in med)
          + " |", flush=True)


def check_values(var, values, fn, same_bits=True):
    """fn() once per value (the warm-up): the results of every value are the same bits
    (asserted; close where not same_bits). Returns the last value's results."""
    first = {}
    for x in values:
        os.environ[var] = x
        first[x] = fn()
    for x in values[1:]:
        for a, b in zip(first[values[0]], first[x]):
            if same_bits:
                assert torch.equal(a, b), x
            else:  # out: within one rounding of its dtype; lse (fp32): 1e-4
                tol = 1e-4 if a.dtype == torch.float32 else 2 * torch.finfo(a.dtype).eps
                assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol), (x, (a.float() - b.float()).abs().max())
    return first[values[-1]]


def alternate(var, values, repeats, fn, same_bits=True):
    """fn()'s results for every value (bitwise equal, asserted; close where not same_bits)
    and its median seconds."""
    check_values(var, values, fn, same_bits)
    times = {x: [] for x in values}
    for r in range(repeats):
        for x in (values if r % 2 == 0 else values[::-1]):
            os.environ[var] = x
            t = time.perf_counter()
            fn()
            times[x].append(time.perf_counter() - t)
    return [statistics.median(times[x]) for x in values]


@contextlib.contextmanager
def restored_env(names):
    """The environment variables `names` as they were before the block, on the way out."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="bwd-jobs")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--values", default=None, help="values to alternate (bwd-jobs: 1,4; "
                                                   "the others: 0,1)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds (a smoke test)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print_env_header("cpu")
    var, default_values, same_bits = SWITCHES[args.switch]
    values = (args.values or default_values).split(",")
    repeats = 2 if args.quick else args.repeats
    # other switches a decode A/B holds fixed: dp-tile16 the pairs (on an Intel CPU not the
    # default); decode-pv512 bf16's widened product (its pairs take neither)
    pinned = {"dp-tile16": {"ATTN_EXT_CPU_BF16DP": "1"},
              "decode-pv512": {"ATTN_EXT_CPU_DECODE_PV_PAIRS": "0"}}.get(args.switch, {})
    with restored_env([var]):
        if args.switch == "bwd-jobs":
            bench_bwd_jobs(var, values, repeats, args)
        elif args.switch == "gemm512":
            bench_fp32_prefill(var, values, repeats, args)
        elif args.switch == "decode-head-split":
            bench_short_decode(var, values, repeats, args)
        else:
            with restored_env(pinned):
                os.environ.update(pinned)
                bench_decode_quads(var, values, repeats, args, same_bits)
            if args.switch == "bf16dp":
                bench_bf16_prefill(var, values, repeats, args)


def bench_bwd_jobs(var, values, repeats, args):
    shapes = [(1, 2, 256, 32)] if args.quick else SHAPES
    table_header(f"backward, {var} in {values}, {args.threads} threads, medians of {repeats} rounds",
                 ["B, H, S, D"], [f"jobs {v} ms" for v in values])
    for B, H, S, D in shapes:
        q, k, v = (torch.randn(B, H, S, D).transpose(1, 2) for _ in range(3))
        out, lse = torch.ops.attn_ext.attention_forward(q, k, v, True, None)
        dout = torch.randn_like(out)

        def bwd():
            return ops._lib.attention_backward(dout, q, k, v, out, lse, True, None, -1, -1,
                                               None, None, None, None, None, 0.0, 0, 0, False,
                                               0, 0)

        med = alternate(var, values, repeats, bwd)
        table_row([f"{B}, {H}, {S}, {D}"], [f"{m * 1e3:.1f}" for m in med], med)


def bench_bf16_prefill(var, values, repeats, args):
    shapes = [(1, 2, 256, 32)] if args.quick else SHAPES
    table_header(f"bf16 causal prefill (BSHD), {var} in {values}, {args.threads} threads, "
                 f"medians of {repeats} rounds", ["B, H, S, D", "pass"], [f"{v}: ms" for v in values])
    for B, H, S, D in shapes:
        q, k, v, dout = (torch.randn(B, S, H, D).bfloat16() for _ in range(4))

        def fwd():
            return torch.ops.attn_ext.attention_forward(q, k, v, True, None)

        saved = {}  # each value's backward of its own forward (out, lse)
        for x in values:
            os.environ[var] = x
            saved[x] = fwd()

        def bwd():
            out, lse = saved[os.environ[var]]
            return torch.ops.attn_ext.attention_backward(dout, q, k, v, out, lse, True, None)

        for name, fn in (("fwd", fwd), ("bwd", bwd)):  # (the two values' bits differ)
            med = alternate(var, values, repeats, fn, same_bits=False)
            table_row([f"{B}, {H}, {S}, {D}", name], [f"{m * 1e3:.1f}" for m in med], med)


def bench_fp32_prefill(var, values, repeats, args):
    shapes = [(1, 2, 256, 32)] if args.quick else SHAPES
    table_header(f"fp32 causal prefill, {var} in {values}, {args.threads} threads, medians of "
                 f"{repeats} rounds", ["B, H, S, D", "layout", "pass"], [f"{v}: ms" for v in values])
    for B, H, S, D in shapes:
        for layout in ("BSHD", "BHSD view"):
            if layout == "BSHD":
                q, k, v, dout = (torch.randn(B, S, H, D) for _ in range(4))
            else:
                q, k, v, dout = (torch.randn(B, H, S, D).transpose(1, 2) for _ in range(4))

            def fwd():
                return torch.ops.attn_ext.attention_forward(q, k, v, True, None)

            out, lse = fwd()

            def bwd():
                return torch.ops.attn_ext.attention_backward(dout, q, k, v, out, lse, True, None)

            for name, fn in (("fwd", fwd), ("bwd", bwd)):
                med = alternate(var, values, repeats, fn)
                table_row([f"{B}, {H}, {S}, {D}", layout, name], [f"{m * 1e3:.1f}" for m in med], med)


def bench_decode_quads(var, values, repeats, args, same_bits=True):
    shapes = [(1, 512, 8, 2)] if args.quick else DECODE_SHAPES
    D = 128
    table_header(f"decode (Sq = 1, BSHD cache, D = {D}), {var} in {values}, {args.threads} threads, "
                 f"medians of {repeats} rounds (each round: every value once, in alternating order)",
                 ["dtype", "B", "Sk", "H/Hkv"], [f"{v}: ms (GB/s of K + V)" for v in values])
    for dt in (torch.float32, torch.bfloat16):
        for B, Sk, H, Hkv in shapes:
            q = torch.randn(B, 1, H, D).to(dt)
            k, v = torch.randn(B, Sk, Hkv, D).to(dt), torch.randn(B, Sk, Hkv, D).to(dt)

            def dec():
                return torch.ops.attn_ext.attention_forward(q, k, v, False, None)

            # enough rounds for short calls: about 0.2 s of each value per round count
            reps = repeats if args.quick else max(repeats, int(0.2 / max(1e-4, B * Sk * 2e-7)))
            med = alternate(var, values, reps, dec, same_bits=same_bits)
            gbs = 2 * k.numel() * k.element_size() / 1e9
            name = "fp32" if dt == torch.float32 else "bf16"
            table_row([name, str(B), str(Sk), f"{H}/{Hkv}"],
                      [f"{m * 1e3:.3f} ({gbs / m:.1f})" for m in med], med)



def bench_short_decode(var, values, repeats, args):
    shapes = [(1, 256, 8, 8, 64)] if args.quick else SHORT_DECODE_SHAPES
    table_header(f"short decode steps (Sq = 1, BSHD cache), {var} in {values}, {args.threads} "
                 f"threads, medians of rounds (each round: every value, then SDPA, several calls "
                 f"each)", ["dtype", "B", "Sk", "H/Hkv", "D", "K + V KiB"],
                 [f"{v}: us" for v in values] + ["SDPA us", "SDPA / last value"])
    for dt in (torch.float32, torch.bfloat16):
        for B, Sk, H, Hkv, D in shapes:
            q = torch.randn(B, 1, H, D).to(dt)
            k, v = torch.randn(B, Sk, Hkv, D).to(dt), torch.randn(B, Sk, Hkv, D).to(dt)
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

            def dec():
                return torch.ops.attn_ext.attention_forward(q, k, v, False, None)

            def sdpa():
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, enable_gqa=H != Hkv)

            last = check_values(var, values, dec)  # (the warm-up; the same bits)
            torch.testing.assert_close(sdpa().transpose(1, 2), last[0], rtol=2e-2, atol=2e-2)
            calls = 5 if args.quick else 200  # calls per value per round (steps of 10-200 us)
            times = {x: [] for x in [*values, "sdpa"]}
            for r in range(2 if args.quick else max(repeats, 9)):
                for x in (values if r % 2 == 0 else values[::-1]):
                    os.environ[var] = x
                    t = time.perf_counter()
                    for _ in range(calls):
                        dec()
                    times[x].append((time.perf_counter() - t) / calls)
                t = time.perf_counter()
                for _ in range(calls):
                    sdpa()
                times["sdpa"].append((time.perf_counter() - t) / calls)
            med = [statistics.median(times[x]) for x in values]
            sd = statistics.median(times["sdpa"])
            name = "fp32" if dt == torch.float32 else "bf16"
            kib = 2 * k.numel() * k.element_size() / 1024
            print(f"| {name} | {B} | {Sk} | {H}/{Hkv} | {D} | {kib:.0f} | "
                  + " | ".join(f"{m * 1e6:.1f}" for m in med)
                  + f" | {sd * 1e6:.1f} | {sd / med[-1]:.2f} | "
                  + " / ".join(f"{m / med[0]:.3f}" for m in med) + " |", flush=True)


if __name__ == "__main__":
    main()
