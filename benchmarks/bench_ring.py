"""Ring attention on 2 ranks vs one process on the same total sequence (CPU, gloo).

    python benchmarks/bench_ring.py [--seq 2048] [--heads 8] [--head-dim 64] [--repeats 5]
                                    [--window W] [--alibi] [--quick]

The single-process baseline is ``attn_ext.attention`` on the whole sequence ``(B, S, H, D)``
with 1 thread and with 2 threads (this process); the ring is
``attn_ext.distributed.ring_attention`` on 2 spawned ranks with 1 thread each, every rank
holding ``S / 2`` tokens (zigzag layout; causal and full attention). "fwd" runs under
``torch.no_grad()``; "fwd+bwd" adds the backward w.r.t. q, k, v. A ring time is the slowest
rank's time of one call (ranks start together after a barrier); the table shows medians over
``--repeats`` calls. "comm wait" is the share of a rank's time spent blocked waiting for a
transfer (``ring_stats()['comm_wait_s']``), i.e. communication not hidden behind compute,
averaged over the ranks; "ring CPU/wall" is a rank's process CPU time over its wall time
(well under 100% means the rank was waiting for a core: on a shared machine, for other work).

Every ring output (and gradient) is validated against the single-process result before timing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue as queue_mod
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (for _env)
from _env import checkout_first, print_env_header  # noqa: E402

checkout_first()
import attn_ext  # noqa: E402
from attn_ext import distributed as cp  # noqa: E402

MODES = [(causal, bwd) for causal in (True, False) for bwd in (False, True)]


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def inputs(B, S, H, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, D, generator=g) for _ in range(4)]  # q, k, v, dout


def run_once(fn, q, k, v, dout, causal, bwd):
    if not bwd:
        with torch.no_grad():
            return fn(q, k, v, causal), None
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal)
    out.backward(dout)
    return out, (q.grad, k.grad, v.grad)


TERMS = {}  # the attention keywords of this run (--window, --alibi), set in main / _rank


def terms_of(args):
    """``--window W`` (a sliding window of W keys) and ``--alibi`` as keywords of
    attn_ext.attention / ring_attention (global positions in the ring). The window is
    resolved per mode by terms_for: every row sees W keys in both."""
    t = {}
    if args.window:
        t["window"] = args.window
    if args.alibi:
        t["alibi_slopes"] = attn_ext.alibi_slopes(args.heads)
    return t


def terms_for(causal):
    """TERMS for one mode: a causal row's window is Mistral's (W - 1 keys before it, itself),
    a full row's is centred ((W - 1) // 2 after it, the rest before), W keys each. (One
    (W - 1, -1) for both let the full rows see every later key.)"""
    t = dict(TERMS)
    if "window" in t:
        W = t["window"]
        t["window"] = (W - 1, -1) if causal else (W - 1 - (W - 1) // 2, (W - 1) // 2)
    return t


def single(q, k, v, causal):
    return attn_ext.attention(q, k, v, causal=causal, **terms_for(causal))


def time_single(args, threads):
    torch.set_num_threads(threads)
    q, k, v, dout = inputs(args.batch, args.seq, args.heads, args.head_dim)
    res = {}
    for causal, bwd in MODES:
        run_once(single, q, k, v, dout, causal, bwd)  # warm-up
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run_once(single, q, k, v, dout, causal, bwd)
            ts.append(time.perf_counter() - t0)
        res[(causal, bwd)] = ts
    return res


def _rank(rank, world, port, args, queue):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    layout = "zigzag"
    TERMS.update(terms_of(args))
    q, k, v, dout = inputs(args.batch, args.seq, args.heads, args.head_dim)
    local = [cp.shard_sequence(t, 1, None, layout).contiguous() for t in (q, k, v, dout)]

    def ring(q_, k_, v_, causal):
        return cp.ring_attention(q_, k_, v_, causal=causal, layout=layout, **terms_for(causal))

    result = {}
    for causal, bwd in MODES:
        # validate against the single-process result (fp32)
        out, grads = run_once(ring, *local, causal, bwd)
        ref_out, ref_grads = run_once(single, q, k, v, dout, causal, bwd)
        errs = [(out - cp.shard_sequence(ref_out, 1, None, layout)).abs().max().item()]
        if bwd:
            errs += [(a - cp.shard_sequence(b, 1, None, layout)).abs().max().item()
                     for a, b in zip(grads, ref_grads)]
        if max(errs) > 1e-3:
            raise AssertionError(f"ring result differs from single-process: {errs}")
        ts, waits, busy = [], [], []
        for _ in range(args.repeats):
            dist.barrier()
            cp.ring_stats(reset=True)
            t0, c0 = time.perf_counter(), time.process_time()
            run_once(ring, *local, causal, bwd)
            t, c = time.perf_counter() - t0, time.process_time() - c0
            waits.append(cp.ring_stats()["comm_wait_s"] / t)
            busy.append(c / t)
            tt = torch.tensor([t], dtype=torch.float64)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            ts.append(tt[0].item())
        w = torch.tensor([statistics.median(waits), statistics.median(busy)], dtype=torch.float64)
        dist.all_reduce(w)
        result[(causal, bwd)] = (ts, w[0].item() / world, max(errs), w[1].item() / world)
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def time_ring(args, world=2):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    procs = mp.start_processes(_rank, args=(world, store.port, args, queue), nprocs=world,
                               join=False, start_method="spawn")
    result = None
    while result is None:  # a failed rank makes join() raise instead of leaving us waiting
        try:
            result = queue.get(timeout=1)
        except queue_mod.Empty:
            procs.join(timeout=0)
    while not procs.join(timeout=60):
        pass
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048, help="total sequence length (both ranks)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--window", type=int, default=0,
                    help="sliding window of W keys (causal rows: window=(W-1, -1); full rows: "
                         "centred, (W-1-(W-1)//2, (W-1)//2); 0 = none)")
    ap.add_argument("--alibi", action="store_true", help="ALiBi slopes on every head")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test of the script)")
    args = ap.parse_args()
    if args.quick:
        args.seq, args.heads, args.head_dim, args.repeats = 256, 2, 32, 2
    TERMS.update(terms_of(args))
    if args.seq % 4:
        raise SystemExit(f"--seq must be a multiple of 4 (2 ranks x 2 zigzag chunks), got {args.seq}")
    print_env_header("cpu")
    print(f"# shape (B, S, H, D) = ({args.batch}, {args.seq}, {args.heads}, {args.head_dim}) float32, "
          f"ring: 2 ranks x 1 thread (gloo, localhost, zigzag), single: 1 process x 1 and 2 threads; "
          f"medians of {args.repeats}; terms: {', '.join(TERMS) or 'none'}"
          + (f" (window {args.window} keys)" if args.window else ""))
    print(f"# load average before: {load()} (the machine is shared with other work: timings are noisy)")
    base1 = time_single(args, 1)
    base2 = time_single(args, 2)
    ring = time_ring(args)
    base1b = time_single(args, 1)  # again after the ring: the load may have changed meanwhile
    base2b = time_single(args, 2)
    print(f"# load average after: {load()}")
    print("| causal | mode | single 1 thr ms | single 2 thr ms | ring 2x1 thr ms | speed-up vs 1 thr | "
          "vs 2 thr | comm wait share | ring CPU/wall | max err vs single |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for causal, bwd in MODES:
        s1 = statistics.median(base1[(causal, bwd)] + base1b[(causal, bwd)])
        s2 = statistics.median(base2[(causal, bwd)] + base2b[(causal, bwd)])
        ts, wait, err, busy = ring[(causal, bwd)]
        r = statistics.median(ts)
        print(f"| {causal} | {'fwd+bwd' if bwd else 'fwd'} | {s1 * 1e3:.1f} | {s2 * 1e3:.1f} | "
              f"{r * 1e3:.1f} | {s1 / r:.2f}x | {s2 / r:.2f}x | {wait * 100:.1f}% | {busy * 100:.0f}% | "
              f"{err:.1e} |")


if __name__ == "__main__":
    main()
