"""torch.func.vmap over attn_ext.attention (the batching rules of attn_ext/_vmap.py: the mapped
dimension folds into the batch, one kernel call) against the per-sample loop that torch's
fallback ran before the rules (one call per sample, then a stack), in one process, the two
alternated within each round; medians over rounds.

    python benchmarks/bench_vmap.py [--rounds N] [--calls N] [--quick]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (for _env)
from _env import checkout_first, print_env_header, round_orders  # noqa: E402

checkout_first()
import torch  # noqa: E402

import attn_ext  # noqa: E402

SHAPES = [(32, 1, 64, 8, 64), (8, 1, 256, 8, 64), (4, 2, 1024, 8, 64)]  # (V, B, S, H, D)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds (a smoke run)")
    a = ap.parse_args(argv)
    shapes = [(4, 1, 16, 2, 16)] if a.quick else SHAPES
    rounds, calls = (2, 2) if a.quick else (a.rounds, a.calls)
    print_env_header("cpu")
    print("\n| (V, B, S, H, D) fp32 causal | vmap (rules) ms | per-sample loop ms | loop / vmap |")
    print("|---|---|---|---|")
    for V, B, S, H, D in shapes:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(V, B, S, H, D, generator=g) for _ in range(3))

        def one(q, k, v):
            return attn_ext.attention(q, k, v, causal=True)

        vm = torch.func.vmap(one)
        methods = {"vmap": lambda: vm(q, k, v),
                   "loop": lambda: torch.stack([one(q[i], k[i], v[i]) for i in range(V)])}
        if not torch.equal(methods["vmap"](), methods["loop"]()):  # (validated before timing)
            ref = methods["loop"]()
            err = (methods["vmap"]() - ref).abs().max().item()
            if err > 1e-5:
                print(f"vmap differs from the per-sample calls by {err:.2e}", file=sys.stderr)
                return 1
        times = {n: [] for n in methods}
        for order in round_orders(list(methods), rounds):
            for n in order:
                methods[n]()
                t0 = time.perf_counter()
                for _ in range(calls):
                    methods[n]()
                times[n].append((time.perf_counter() - t0) / calls * 1e3)
        tv, tl = statistics.median(times["vmap"]), statistics.median(times["loop"])
        print(f"| ({V}, {B}, {S}, {H}, {D}) | {tv:.3f} | {tl:.3f} | {tl / tv:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
