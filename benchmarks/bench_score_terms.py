"""Score terms on CPU (issue 15): ALiBi, the learnable relative position bias, softcap and
dropout inside attn_ext's kernels against our plain causal kernel, flex_attention compiled on CPU
with the same score_mod (forward only: no CPU backward in torch 2.13) and SDPA with a dense
float bias (forward, and forward+backward with the bias learnable), in one process,
validated before timing.

    python benchmarks/bench_score_terms.py [--quick] [--repeats N] [--threads 2] [--S 1024,2048]

Cases (float32, causal, (1, 16, S, 64)):
  fwd       ours plain | ours ALiBi | ours rel_bias (M = 128) | ours softcap 30 | flex (same
            score_mod + causal BlockMask) | SDPA with the dense (1, H, S, S) float bias
            (causal -inf folded in) | softcap in eager PyTorch (scores materialised: SDPA has
            no score_mod)
  fwd+bwd   ours plain | ours ALiBi | ours rel_bias (gradient to the (H, 2M+1) table) |
            ours softcap 30 | ours dropout 0.1 | SDPA with the dense bias gathered from the
            learnable table (its gradient reaches the table through the gather) | softcap in
            eager PyTorch

Every method is validated before it is timed: against the float32 SDPA result (max abs
error of out, and of the q/k/v and table gradients; plain against SDPA's causal kernel),
softcap against the float64 textbook, dropout against the textbook with the kernels' keep
bits (its first 64 query rows); timing is interleaved (one call of each
per round), medians of --repeats rounds. The ratios are what issue 15 asks for:
terms / plain (goal <= 1.15; softcap is held to the same), dropout / plain (goal <= 1.3), baseline / ours (goal >= 2 fwd,
>= 3 fwd+bwd vs the learnable dense bias).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # benchmarks/ (for _env)
from _env import checkout_first, print_env_header  # noqa: E402

checkout_first()
import attn_ext  # noqa: E402
from attn_ext import reference  # noqa: E402
from bench_masks import check, fwd_bwd, timed  # noqa: E402


def dense_bias(kind, table, slopes, S):
    """(1, H, S, S) float bias of DESIGN.md's rule with the causal -inf folded in."""
    i = torch.arange(S)
    d = i[:, None] - i[None, :]
    if kind == "alibi":
        bias = -slopes[:, None, None] * d.abs()[None].float()
    else:
        M = (table.shape[1] - 1) // 2
        bias = table[:, M + d.clamp(-M, M)]  # a differentiable gather
    return bias.masked_fill(d[None] < 0, float("-inf"))[None]


def sdpa_bias(q, k, v, bias):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=bias)
    return out.transpose(1, 2)


SOFTCAP = 30.0


def eager_softcap(q, k, v, cap=SOFTCAP):
    """Causal attention with s = cap * tanh(s / cap), the (S, S) scores materialised."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    s = (qt @ kt.transpose(-1, -2)) * qt.shape[-1] ** -0.5
    s = cap * torch.tanh(s / cap)
    S = s.shape[-1]
    hidden = torch.ones(S, S, dtype=torch.bool).triu(1)
    out = torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1) @ vt
    return out.transpose(1, 2)


def flex_fn(kind, table, slopes, H, S):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    M = (table.shape[1] - 1) // 2
    if kind == "softcap":
        def score_mod(score, b, h, qi, ki):
            return SOFTCAP * torch.tanh(score / SOFTCAP)
    elif kind == "alibi":
        def score_mod(score, b, h, qi, ki):
            return score - slopes[h] * (qi - ki).abs()
    else:
        def score_mod(score, b, h, qi, ki):
            return score + table[h, M + (qi - ki).clamp(-M, M)]
    block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, None, S, S, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v):
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                       score_mod=score_mod, block_mask=block_mask)
        return out.transpose(1, 2)
    return run


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


def check_dropout(S, q, k, v, run, p=0.1, rows=64):
    """The timed dropout call (seeded: torch.manual_seed(1)) against the textbook with the
    kernels' keep bits (reference.dropout_keep_mask of the seed and offset that call draws),
    on its first `rows` query rows: under the causal mask they see only keys < rows, so the
    (1, H, rows, rows) bits suffice (all S x S bits would be gigabytes of 64-bit words)."""
    out, grads = run()
    torch.manual_seed(1)
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64).tolist()  # (ops' draw)
    H = q.shape[2]
    keep = reference.dropout_keep_mask(seed, offset, 1, H, range(rows), range(rows), p)
    want, _ = reference.attention_with_lse(*(t[:, :rows].double() for t in (q, k, v)), causal=True,
                                           dropout_p=p, dropout_mask=keep)
    check(f"S={S} dropout out (first {rows} rows)", out[:, :rows], want, 1e-4)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--S", default="1024,2048")
    ap.add_argument("--no-flex", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print_env_header("cpu")
    print(f"# bench_score_terms: torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (a shared machine: timings are "
          f"noisy), medians of {args.repeats} interleaved rounds, float32, causal")
    print("| S | mode | method | ms | ratio |")
    print("|---|---|---|---|---|")
    H, D, M = (2, 32, 16) if args.quick else (16, 64, 128)
    sizes = [128, 256] if args.quick else [int(s) for s in args.S.split(",")]
    slopes = attn_ext.alibi_slopes(H)
    for S in sizes:
        q, k, v = [torch.randn(1, S, H, D) for _ in range(3)]
        table = torch.randn(H, 2 * M + 1) * 0.5

        # ---- forward ----------------------------------------------------------------------
        fns = {
            "ours plain": lambda q, k, v: attn_ext.attention(q, k, v, causal=True),
            "ours alibi": lambda q, k, v: attn_ext.attention(q, k, v, causal=True, alibi_slopes=slopes),
            "ours rel_bias": lambda q, k, v: attn_ext.attention(q, k, v, causal=True, rel_bias=table),
            "ours softcap": lambda q, k, v: attn_ext.attention(q, k, v, causal=True, softcap=SOFTCAP),
        }
        dense = {kind: dense_bias(kind, table, slopes, S) for kind in ("alibi", "rel")}
        fns["sdpa dense alibi"] = lambda q, k, v: sdpa_bias(q, k, v, dense["alibi"])
        fns["sdpa dense rel"] = lambda q, k, v: sdpa_bias(q, k, v, dense["rel"])
        fns["eager softcap"] = eager_softcap
        if not args.no_flex:
            fns["flex alibi"] = flex_fn("alibi", table, slopes, H, S)
            fns["flex rel"] = flex_fn("rel", table, slopes, H, S)
            fns["flex softcap"] = flex_fn("softcap", table, slopes, H, S)

        def kind_of(name):
            return "alibi" if "alibi" in name else "softcap" if "softcap" in name else "rel"
        # softcap's reference: the textbook in float64 (eager_softcap is also timed)
        want = {"alibi": fns["sdpa dense alibi"](q, k, v), "rel": fns["sdpa dense rel"](q, k, v),
                "softcap": eager_softcap(q.double(), k.double(), v.double()).float()}
        ours_of = {"alibi": "ours alibi", "rel": "ours rel_bias", "softcap": "ours softcap"}
        plain_want = sdpa_causal(q, k, v)
        for name, fn in fns.items():
            check(f"S={S} {name}", fn(q, k, v),
                  plain_want if name == "ours plain" else want[kind_of(name)], 1e-4)
        ms = timed({n: (lambda fn=fn: fn(q, k, v)) for n, fn in fns.items()}, args.repeats)
        plain = ms["ours plain"]
        for name, t in ms.items():
            if name.startswith("ours"):
                ratio = f"{t / plain:.2f}x of plain" if name != "ours plain" else ""
            else:
                ours = ms[ours_of[kind_of(name)]]
                ratio = f"{t / ours:.2f}x slower than ours"
            print(f"| {S} | fwd | {name} | {t:.1f} | {ratio} |", flush=True)

        # ---- forward + backward -----------------------------------------------------------
        def ours_rel(q, k, v, tab):
            return attn_ext.attention(q, k, v, causal=True, rel_bias=tab)

        def sdpa_rel(q, k, v, tab):
            return sdpa_bias(q, k, v, dense_bias("rel", tab, slopes, S))

        def seeded_dropout(q, k, v):
            torch.manual_seed(1)
            return attn_ext.attention(q, k, v, causal=True, dropout_p=0.1)

        bw = {
            "ours plain": fwd_bwd(lambda q, k, v: attn_ext.attention(q, k, v, causal=True), (q, k, v)),
            "ours alibi": fwd_bwd(lambda q, k, v: attn_ext.attention(q, k, v, causal=True,
                                                                     alibi_slopes=slopes), (q, k, v)),
            "ours rel_bias": fwd_bwd(ours_rel, (q, k, v, table)),
            "ours softcap": fwd_bwd(lambda q, k, v: attn_ext.attention(q, k, v, causal=True,
                                                                       softcap=SOFTCAP), (q, k, v)),
            "ours dropout 0.1": fwd_bwd(seeded_dropout, (q, k, v)),
            "sdpa dense learnable rel": fwd_bwd(sdpa_rel, (q, k, v, table)),
            "eager softcap": fwd_bwd(eager_softcap, (q, k, v)),
        }
        (o0, g0), (op, gp) = bw["ours plain"](), fwd_bwd(sdpa_causal, (q, k, v))()
        check(f"S={S} plain fwd+bwd out", o0, op, 1e-4)
        for name, a, b in zip(("plain dq", "plain dk", "plain dv"), g0, gp):
            check(f"S={S} {name}", a, b, 1e-3)
        check_dropout(S, q, k, v, bw["ours dropout 0.1"])
        (o1, g1), (o2, g2) = bw["ours rel_bias"](), bw["sdpa dense learnable rel"]()
        check(f"S={S} fwd+bwd out", o1, o2, 1e-4)
        for name, a, b in zip(("dq", "dk", "dv", "d rel_bias"), g1, g2):
            check(f"S={S} {name}", a, b, 1e-3 * max(1.0, b.abs().max().item()))
        (o3, g3), (o4, g4) = bw["ours alibi"](), fwd_bwd(
            lambda q, k, v: sdpa_bias(q, k, v, dense["alibi"]), (q, k, v))()
        for name, a, b in zip(("alibi dq", "alibi dk", "alibi dv"), g3, g4):
            check(f"S={S} {name}", a, b, 1e-3)
        (o5, g5), (o6, g6) = bw["ours softcap"](), fwd_bwd(
            eager_softcap, tuple(t.double() for t in (q, k, v)))()
        check(f"S={S} softcap fwd+bwd out", o5, o6.float(), 1e-4)
        for name, a, b in zip(("softcap dq", "softcap dk", "softcap dv"), g5, g6):
            check(f"S={S} {name}", a, b, 1e-3 * max(1.0, b.abs().max().item()))
        ms = timed(bw, max(2, args.repeats // 2))
        plain = ms["ours plain"]
        for name, t in ms.items():
            if name.startswith("ours"):
                ratio = f"{t / plain:.2f}x of plain" if name != "ours plain" else ""
            elif name == "eager softcap":
                ratio = f"{t / ms['ours softcap']:.2f}x slower than ours softcap"
            else:
                ratio = f"{t / ms['ours rel_bias']:.2f}x slower than ours rel_bias"
            print(f"| {S} | fwd+bwd | {name} | {t:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
