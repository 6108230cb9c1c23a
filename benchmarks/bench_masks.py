"""Masks on CPU (issue 14): attn_ext against flex_attention (compiled, with the equivalent
BlockMask) and SDPA with a dense bool mask, in one process, validated before timing.

    python benchmarks/bench_masks.py [--quick] [--repeats N] [--threads 2]

Cases (float32):
  window  sliding window W = 256, causal, (1, 16, S, 64), S = 2048 / 4096 / 8192: fwd vs flex
          and SDPA; fwd+bwd vs SDPA (flex has no CPU backward in torch 2.13)
  padded  B = 8, S = 1024, H = 16, D = 64, causal, right padding, lengths spread 25-100 %:
          fwd and fwd+bwd vs SDPA (and fwd vs flex)
  packed  the same tokens as 8 packed sequences (attention_varlen), causal: fwd and fwd+bwd
          vs SDPA with the block-diagonal causal mask (and fwd vs flex)

Each method is validated against SDPA (max abs error of out, and of the gradients for
fwd+bwd) before it is timed; timing is interleaved (one call of each method per round) and
the median of `--repeats` rounds is reported. ratio = baseline time / ours (> 1: faster).
The machine may be shared: the load average is printed next to the numbers.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (for _env)
from _env import checkout_first, interleaved_medians, print_env_header  # noqa: E402

checkout_first()
import attn_ext  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(fns: dict, repeats: int) -> dict:
    """Median ms of each method: one warm-up call (and compilation) each, then `repeats`
    rounds of one call each, in _env.round_orders' order (a fixed order biased the method that
    always ran after the one that evicts the caches)."""
    return {name: t * 1e3 for name, t in interleaved_medians(fns, repeats).items()}


def fwd_bwd(fn, inputs):
    def run():
        ts = [t.detach().requires_grad_() for t in inputs]
        out = fn(*ts)
        out.backward(torch.ones_like(out))
        return out.detach(), [t.grad for t in ts]
    return run


def check(name, got, want, tol):
    err = (got.double() - want.double()).abs().max().item()
    if not err <= tol:
        raise SystemExit(f"validation failed: {name}: max error {err:.3e} > {tol}")
    return err


def flex_fn(mask_mod, B, H, Sq, Sk):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(mask_mod, B, None, Sq, Sk, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v):  # BSHD in, BSHD out
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
        return out.transpose(1, 2)
    return run


def sdpa_fn(dense_mask):
    def run(q, k, v):  # dense_mask (B or 1, 1, Sq, Sk) bool
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=dense_mask)
        return out.transpose(1, 2)
    return run


def report(rows, case, mode, ms, base_names):
    ours = ms["attn_ext"]
    for b in base_names:
        rows.append((case, mode, ours, b, ms[b], ms[b] / ours))
        print(f"| {case} | {mode} | {ours:.1f} | {b} | {ms[b]:.1f} | {ms[b] / ours:.2f}x |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default="window,padded,packed")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--seqlens", default="2048,4096,8192", help="window case lengths")
    ap.add_argument("--max-sdpa-bwd", type=int, default=4096,
                    help="longest S whose SDPA fwd+bwd with a dense mask is run (memory: "
                         "B*H*S^2 fp32 scores several times over; 8192 needs > 15 GB)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cases = args.cases.split(",")
    print_env_header("cpu")  # commit, torch, threads, allocator, machine, load
    print(f"# bench_masks: medians of {args.repeats} interleaved rounds, float32 (on a shared "
          f"machine timings are noisy: see the load above)")
    print("| case | mode | attn_ext ms | baseline | baseline ms | ratio |")
    print("|---|---|---|---|---|---|")
    rows = []
    H, D = (2, 32) if args.quick else (16, 64)
    W = 32 if args.quick else 256

    if "window" in cases:
        per_query = {}
        for S in ([256, 512] if args.quick else [int(x) for x in args.seqlens.split(",")]):
            q, k, v = [torch.randn(1, S, H, D) for _ in range(3)]
            i = torch.arange(S)
            dense = ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < W))[None, None]
            ours = lambda q, k, v: attn_ext.attention(q, k, v, causal=True, window=(W - 1, 0))  # noqa: E731
            fns = {"attn_ext": ours, "sdpa+mask": sdpa_fn(dense)}
            if not args.no_flex:
                fns["flex"] = flex_fn(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < W), 1, H, S, S)
            want = fns["sdpa+mask"](q, k, v)
            for name, fn in fns.items():
                check(f"window S={S} {name}", fn(q, k, v), want, 1e-4)
            ms = timed({n: (lambda fn=fn: fn(q, k, v)) for n, fn in fns.items()}, args.repeats)
            report(rows, f"window W={W} S={S}", "fwd", ms, [n for n in fns if n != "attn_ext"])
            per_query[S] = ms["attn_ext"] / S
            if S > args.max_sdpa_bwd:
                print(f"# window S={S}: fwd+bwd vs SDPA skipped (--max-sdpa-bwd {args.max_sdpa_bwd})")
                continue
            bw = {n: fwd_bwd(fns[n], (q, k, v)) for n in ("attn_ext", "sdpa+mask")}
            (o1, g1), (o2, g2) = bw["attn_ext"](), bw["sdpa+mask"]()
            for a, b in zip(g1, g2):
                check(f"window S={S} grads", a, b, 1e-3)
            ms = timed(bw, max(2, args.repeats // 2))
            report(rows, f"window W={W} S={S}", "fwd+bwd", ms, ["sdpa+mask"])
        Ss = sorted(per_query)
        if len(Ss) > 1:
            print(f"# window: per-query fwd cost at S={Ss[-1]} / S={Ss[0]}: "
                  f"{per_query[Ss[-1]] / per_query[Ss[0]]:.2f}x (goal <= 1.3x)")

    B, S = (2, 128) if args.quick else (8, 1024)
    lengths = torch.linspace(0.25 * S, S, B).round().long()
    if "padded" in cases:
        q, k, v = [torch.randn(B, S, H, D) for _ in range(3)]
        kpm = torch.arange(S)[None, :] < lengths[:, None]
        i = torch.arange(S)
        dense = (i[:, None] >= i[None, :])[None, None] & kpm[:, None, None, :]
        ours = lambda q, k, v: attn_ext.attention(q, k, v, causal=True, key_padding_mask=kpm)  # noqa: E731
        fns = {"attn_ext": ours, "sdpa+mask": sdpa_fn(dense)}
        if not args.no_flex:
            lens = lengths.clone()
            fns["flex"] = flex_fn(lambda b, h, qi, ki: (qi >= ki) & (ki < lens[b]), B, H, S, S)
        want = fns["sdpa+mask"](q, k, v)
        for name, fn in fns.items():
            check(f"padded {name}", fn(q, k, v), want, 1e-4)
        ms = timed({n: (lambda fn=fn: fn(q, k, v)) for n, fn in fns.items()}, args.repeats)
        report(rows, f"padded B={B} S={S}", "fwd", ms, [n for n in fns if n != "attn_ext"])
        bw = {n: fwd_bwd(fns[n], (q, k, v)) for n in ("attn_ext", "sdpa+mask")}
        (o1, g1), (o2, g2) = bw["attn_ext"](), bw["sdpa+mask"]()
        for a, b in zip(g1, g2):
            check("padded grads", a, b, 1e-3)
        ms = timed(bw, max(2, args.repeats // 2))
        report(rows, f"padded B={B} S={S}", "fwd+bwd", ms, ["sdpa+mask"])

    if "packed" in cases:
        T = int(lengths.sum())
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        mx = int(lengths.max())
        q, k, v = [torch.randn(T, H, D) for _ in range(3)]
        seq = torch.repeat_interleave(torch.arange(B), lengths)
        i = torch.arange(T)
        dense = ((seq[:, None] == seq[None, :]) & (i[:, None] >= i[None, :]))[None, None]
        ours = lambda q, k, v: attn_ext.attention_varlen(q, k, v, cu, cu, mx, mx, causal=True)  # noqa: E731
        sd = sdpa_fn(dense)
        fns = {"attn_ext": ours, "sdpa+blockdiag": lambda q, k, v: sd(q[None], k[None], v[None])[0]}
        if not args.no_flex:
            fl = flex_fn(lambda b, h, qi, ki: (seq[qi] == seq[ki]) & (qi >= ki), 1, H, T, T)
            fns["flex"] = lambda q, k, v: fl(q[None], k[None], v[None])[0]
        want = fns["sdpa+blockdiag"](q, k, v)
        for name, fn in fns.items():
            check(f"packed {name}", fn(q, k, v), want, 1e-4)
        ms = timed({n: (lambda fn=fn: fn(q, k, v)) for n, fn in fns.items()}, args.repeats)
        report(rows, f"packed N={B} T={T}", "fwd", ms, [n for n in fns if n != "attn_ext"])
        bw = {n: fwd_bwd(fns[n], (q, k, v)) for n in ("attn_ext", "sdpa+blockdiag")}
        (o1, g1), (o2, g2) = bw["attn_ext"](), bw["sdpa+blockdiag"]()
        for a, b in zip(g1, g2):
            check("packed grads", a, b, 1e-3)
        ms = timed(bw, max(2, args.repeats // 2))
        report(rows, f"packed N={B} T={T}", "fwd+bwd", ms, ["sdpa+blockdiag"])
    return rows


if __name__ == "__main__":
    main()
