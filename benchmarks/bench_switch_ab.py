"""A/B of the CPU backward's ATTN_EXT_CPU_BWD_JOBS (query blocks per visit of the key tiles in
the fused partition, csrc/cpu/attention_bwd.cpp kBwdJobs; read on every call), alternated call by
call in one process: this machine's speed drifts by +-15 % between runs, so the values are only
compared within a round.

    python benchmarks/bench_switch_ab.py [--repeats N] [--threads T] [--values 1,4] [--quick]

Rows: the backward alone, fp32 causal, q / k / v as BHSD transpose views, at (1, 8, 4096, 128)
and (1, 16, 2048, 64); every value's gradients are checked bitwise equal first; medians over the
rounds, and the ratios to the first value.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import attn_ext  # noqa: E402,F401
from attn_ext import ops  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import print_env_header  # noqa: E402

SHAPES = [(1, 8, 4096, 128), (1, 16, 2048, 64)]  # (B, H, S, D)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--values", default="1,4", help="ATTN_EXT_CPU_BWD_JOBS values to alternate")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds (a smoke test)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print_env_header("cpu")
    values = args.values.split(",")
    shapes = [(1, 2, 256, 32)] if args.quick else SHAPES
    repeats = 2 if args.quick else args.repeats
    print(f"\n## backward, ATTN_EXT_CPU_BWD_JOBS in {values}, {args.threads} threads, "
          f"medians of {repeats} rounds\n")
    print("| B, H, S, D | " + " | ".join(f"jobs {v} ms" for v in values) + " | ratio to the first |")
    print("|---|" + "---|" * (len(values) + 1))
    old = os.environ.get("ATTN_EXT_CPU_BWD_JOBS")
    try:
        for B, H, S, D in shapes:
            q, k, v = (torch.randn(B, H, S, D).transpose(1, 2) for _ in range(3))
            out, lse = torch.ops.attn_ext.attention_forward(q, k, v, True, None)
            dout = torch.randn_like(out)

            def bwd():
                return ops._lib.attention_backward(dout, q, k, v, out, lse, True, None, -1, -1,
                                                   None, None, None, None, None, 0.0, 0, 0, False,
                                                   0, 0)

            times = {x: [] for x in values}
            first = {}
            for x in values:  # warm-up, and the results of every value must be the same bits
                os.environ["ATTN_EXT_CPU_BWD_JOBS"] = x
                first[x] = bwd()
            for x in values[1:]:
                assert all(torch.equal(a, b) for a, b in zip(first[values[0]], first[x])), x
            for _ in range(repeats):
                for x in values:
                    os.environ["ATTN_EXT_CPU_BWD_JOBS"] = x
                    t = time.perf_counter()
                    bwd()
                    times[x].append(time.perf_counter() - t)
            med = [statistics.median(times[x]) for x in values]
            print(f"| {B}, {H}, {S}, {D} | " + " | ".join(f"{m * 1e3:.1f}" for m in med) + " | "
                  + " / ".join(f"{m / med[0]:.3f}" for m in med) + " |", flush=True)
    finally:
        if old is None:
            os.environ.pop("ATTN_EXT_CPU_BWD_JOBS", None)
        else:
            os.environ["ATTN_EXT_CPU_BWD_JOBS"] = old


if __name__ == "__main__":
    main()
