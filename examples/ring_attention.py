"""Context parallelism with attn_ext: ring attention and a context-parallel TinyGPT.

Run on CPU with 2 processes (gloo over localhost):

    torchrun --nproc-per-node 2 examples/ring_attention.py

with attn_ext installed (``pip install .`` or ``pip install -e .``: the script imports the
installed package, not the sources beside it, which a plain install leaves unbuilt)
(any number of processes works; ``--backend nccl`` with one GPU per process uses the same
code but is untested). Every rank builds the same full batch from the same seed, keeps its
shard of the sequence, and

1. runs ``attn_ext.distributed.ring_attention`` on its shard of q, k, v (causal, GQA; then with
   a sliding window and ALiBi at global positions) and compares its rows, and their
   gradients, with single-process ``attn_ext.attention`` on the whole sequence;
2. trains a TinyGPT whose attention runs as ring attention (``context_parallel_group``) for a
   few steps, summing the parameter gradients over the group, next to an unsharded copy of
   the same model, and prints both losses.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import attn_ext
from attn_ext import distributed as cp


def log(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def ring_vs_single(layout: str, device: torch.device, **terms) -> None:
    W = dist.get_world_size()
    B, S, H, Hkv, D = 2, 64 * W, 8, 2, 32  # S: the whole sequence, split over the W ranks
    torch.manual_seed(0)  # same full tensors on every rank
    q, k, v = (torch.randn(B, S, h, D, device=device) for h in (H, Hkv, Hkv))
    dout = torch.randn(B, S, H, D, device=device)

    # this rank's shard: rank r holds chunks r and 2W-1-r of 2W (zigzag) or chunk r (contiguous)
    q_l, k_l, v_l = (cp.shard_sequence(t, 1, None, layout).requires_grad_() for t in (q, k, v))
    out_l = cp.ring_attention(q_l, k_l, v_l, causal=True, layout=layout, **terms)
    out_l.backward(cp.shard_sequence(dout, 1, None, layout))

    # the same attention in one process, on the whole sequence
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attn_ext.attention(q, k, v, causal=True, **terms)
    out.backward(dout)
    errs = {
        "out": (out_l - cp.shard_sequence(out, 1, None, layout)).abs().max(),
        "dq": (q_l.grad - cp.shard_sequence(q.grad, 1, None, layout)).abs().max(),
        "dk": (k_l.grad - cp.shard_sequence(k.grad, 1, None, layout)).abs().max(),
        "dv": (v_l.grad - cp.shard_sequence(v.grad, 1, None, layout)).abs().max(),
    }
    for e in errs.values():
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
    extra = "".join(f", {n}" for n in terms)
    log(f"ring_attention ({layout}, causal{extra}, GQA {H}/{Hkv}, S = {S} over {W} ranks) vs one process: "
        + ", ".join(f"{n} max |diff| {e.item():.1e}" for n, e in errs.items()))
    assert max(e.item() for e in errs.values()) < 1e-4


def train_context_parallel(device: torch.device, steps: int) -> None:
    W = dist.get_world_size()
    group = dist.group.WORLD
    layout = "zigzag"
    vocab, B, S = 32, 4, 32 * W

    def make(**kw):
        torch.manual_seed(1)
        return attn_ext.models.TinyGPT(vocab, d_model=64, num_heads=4, num_layers=2, max_len=S,
                                       pos="rope", **kw).to(device)

    model = make(context_parallel_group=group, context_parallel_layout=layout)  # attention = ring
    single = make()  # the same model, unsharded, for comparison
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt_single = torch.optim.AdamW(single.parameters(), lr=3e-3)

    # a toy task: predict the token 3 positions back (needs positions, crosses shard borders)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, vocab, (B, S), generator=g).to(device)
    tgt = torch.roll(idx, 3, dims=1)
    idx_l, tgt_l = cp.shard_sequence(idx, 1, None, layout), cp.shard_sequence(tgt, 1, None, layout)
    for step in range(steps):
        # context parallel: local tokens' loss sum / all tokens; the ranks' sum is the mean loss
        logits_l = model(idx_l)  # (B, S/W, vocab): this rank's rows
        loss_l = F.cross_entropy(logits_l.flatten(0, 1), tgt_l.flatten(), reduction="sum") / tgt.numel()
        opt.zero_grad()
        loss_l.backward()
        for p in model.parameters():  # replicated parameters: sum the ranks' partial gradients
            dist.all_reduce(p.grad)
        opt.step()
        loss = loss_l.detach().clone()
        dist.all_reduce(loss)

        loss_single = F.cross_entropy(single(idx).flatten(0, 1), tgt.flatten())
        opt_single.zero_grad()
        loss_single.backward()
        opt_single.step()
        log(f"step {step}: context-parallel loss {loss.item():.6f}   single-process {loss_single.item():.6f}")
    assert abs(loss.item() - loss_single.item()) < 1e-3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group(args.backend)  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    log(f"{dist.get_world_size()} ranks, backend {args.backend}, torch {torch.__version__}")
    for layout in cp.LAYOUTS:
        ring_vs_single(layout, device)
    # a sliding window and ALiBi at global positions (Mistral / BLOOM style)
    ring_vs_single("zigzag", device, window=(40, 0), alibi_slopes=attn_ext.alibi_slopes(8).to(device))
    train_context_parallel(device, args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
