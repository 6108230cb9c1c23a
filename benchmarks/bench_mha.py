"""Multi-head attention layer: attn_ext.MultiHeadAttention vs the textbook layer (on the
reference attention and on SDPA) and torch.nn.MultiheadAttention, same process, interleaved.

    python benchmarks/bench_mha.py [--quick] [--dtypes float32,bfloat16] [--markdown]

All layers are causal self-attention with the same weights. "fwd" runs under
torch.no_grad() in eval mode (inference; nn.MultiheadAttention takes its fast path there);
"fwd+bwd" is one training step's forward and backward w.r.t. the input and weights.
Times are medians of interleaved repeats; ratios are baseline time / attn_ext time. Before
timing, every layer's eval forward and training forward + backward (output, input and weight
gradients) are checked against the textbook layer in float64.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (for _env)
from _env import checkout_first, print_env_header, round_orders  # noqa: E402

checkout_first()
import attn_ext  # noqa: E402
from attn_ext import reference as ref  # noqa: E402
from attn_ext.modules import MultiHeadAttention  # noqa: E402


class TextbookSDPA(ref.MultiHeadAttentionRef):
    """The textbook layer with PyTorch's fused SDPA: view -> transpose -> SDPA ->
    transpose -> contiguous -> W_o (the copies attn_ext avoids)."""

    def forward(self, x, memory=None, rope_tables=None):
        B, S, _ = x.shape
        q = self.w_q(x).view(B, S, self.h, self.d).transpose(1, 2)
        k = self.w_k(x).view(B, S, self.hkv, self.d).transpose(1, 2)
        v = self.w_v(x).view(B, S, self.hkv, self.dv).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                             enable_gqa=self.hkv != self.h)
        return self.w_o(out.transpose(1, 2).contiguous().view(B, S, self.h * self.dv))


def build(d_model, heads, kv_heads, dtype):
    textbook = ref.MultiHeadAttentionRef(d_model, heads, kv_heads, causal=True)
    sdpa = TextbookSDPA(d_model, heads, kv_heads, causal=True)
    sdpa.load_state_dict(textbook.state_dict())
    ours = MultiHeadAttention.from_linears(textbook.w_q, textbook.w_k, textbook.w_v, textbook.w_o,
                                           heads, causal=True, num_kv_heads=kv_heads)
    layers = {"attn_ext": ours, "textbook+SDPA": sdpa, "textbook+ref": textbook}
    if kv_heads == heads:
        torch_mha = nn.MultiheadAttention(d_model, heads, batch_first=True)
        with torch.no_grad():
            torch_mha.in_proj_weight.copy_(ours.qkv.weight)
            torch_mha.in_proj_bias.copy_(ours.qkv.bias)
            torch_mha.out_proj.weight.copy_(ours.out_proj.weight)
            torch_mha.out_proj.bias.copy_(ours.out_proj.bias)
        layers["nn.MultiheadAttention"] = torch_mha
    return {k: v.to(dtype) for k, v in layers.items()}


def call(name, layer, x, mask):
    if name == "attn_ext":
        return layer(x)[0]
    if name == "nn.MultiheadAttention":
        return layer(x, x, x, attn_mask=mask, need_weights=False, is_causal=True)[0]
    return layer(x)


def _weight_grads(name, m):
    """(W_qkv grad, W_out grad) in the fused layout [W_q; W_k; W_v] whatever the layer."""
    if name == "attn_ext":
        return m.qkv.weight.grad, m.out_proj.weight.grad
    if name == "nn.MultiheadAttention":
        return m.in_proj_weight.grad, m.out_proj.weight.grad
    return torch.cat([m.w_q.weight.grad, m.w_k.weight.grad, m.w_v.weight.grad]), m.w_o.weight.grad


def validate(layers, x, mask, dtype):
    """Before anything is timed, every layer must give the textbook's numbers (computed in
    float64 from the same weights): the eval forward (the "fwd" mode, nn.MultiheadAttention's
    fast path included) and the training forward + backward (the "fwd+bwd" mode: the output,
    the input gradient and the QKV / output weight gradients)."""
    ref64 = copy.deepcopy(layers["textbook+ref"]).double().train()
    x64 = x.detach().double().requires_grad_()
    dout = torch.randn(x.shape, dtype=torch.float64)
    want = ref64(x64)
    want.backward(dout)
    want_grads = {"out": want.detach(), "dx": x64.grad, **dict(zip(("dW_qkv", "dW_out"), _weight_grads("textbook+ref", ref64)))}
    tol = 2e-3 if dtype == torch.float32 else 8e-2  # relative to the largest reference entry

    def check(name, what, got, ref):
        err = (got.double() - ref).abs().max().item()
        bound = tol * max(1.0, ref.abs().max().item())
        assert err <= bound, f"{name} {what} disagrees with the float64 textbook: {err:.3e} > {bound:.3e}"

    for name, m in layers.items():
        m.eval()
        with torch.no_grad():
            check(name, "eval forward", call(name, m, x, mask), want_grads["out"])
        m.train()
        xi = x.detach().requires_grad_()
        out = call(name, m, xi, mask)
        out.backward(dout.to(dtype))
        got = {"out": out.detach(), "dx": xi.grad, **dict(zip(("dW_qkv", "dW_out"), _weight_grads(name, m)))}
        for what, ref in want_grads.items():
            check(name, f"training {what}", got[what], ref)
        m.zero_grad(set_to_none=True)


def bench_shape(B, S, d_model, heads, kv_heads, dtype, repeats, modes):
    torch.manual_seed(0)
    layers = build(d_model, heads, kv_heads, dtype)
    x = torch.randn(B, S, d_model, dtype=dtype)
    mask = nn.Transformer.generate_square_subsequent_mask(S, dtype=dtype)
    validate(layers, x, mask, dtype)  # fwd and fwd+bwd, before timing
    rows = []
    for mode in modes:
        names = list(layers)
        times = {n: [] for n in names}

        def run(name):
            m = layers[name]
            if mode == "fwd":
                m.eval()
                with torch.no_grad():
                    call(name, m, x, mask)
            else:
                m.train()
                xi = x.detach().requires_grad_()
                call(name, m, xi, mask).sum().backward()
                for p in m.parameters():
                    p.grad = None

        for n in names:
            run(n)  # warm up
        for order in round_orders(names, repeats):  # interleaved, the order varied by round
            for n in order:
                t0 = time.perf_counter()
                run(n)
                times[n].append(time.perf_counter() - t0)
        med = {n: statistics.median(t) for n, t in times.items()}
        rows.append((mode, med))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small shape, few repeats (CI smoke)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--shapes", default=None,
                    help="B,S,d,H,Hkv[;B,S,d,H,Hkv...] (default: (4,1024,768,12,12) and its GQA form)")
    args = ap.parse_args()
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    if args.quick:
        shapes = [(2, 128, 128, 4, 4)]
        args.repeats = 2
    elif args.shapes:
        shapes = [tuple(int(v) for v in sh.split(",")) for sh in args.shapes.split(";")]
    else:
        shapes = [(4, 1024, 768, 12, 12), (4, 1024, 768, 12, 4)]
    print_env_header("cpu")
    print(f"# bench_mha: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, glibc allocator "
          f"(MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'default')}), "
          f"medians of {args.repeats} interleaved repeats")
    header = "| shape (B,S,d,H,Hkv) | dtype | mode | attn_ext ms | textbook+SDPA ms | textbook+ref ms | nn.MHA ms | vs SDPA layer | vs nn.MHA | vs textbook |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for shape in shapes:
        for dtype in dtypes:
            for mode, med in bench_shape(*shape, dtype, args.repeats, ["fwd", "fwd+bwd"]):
                ours = med["attn_ext"]

                def ms(n):
                    return f"{med[n] * 1e3:.1f}" if n in med else "n/a"

                def ratio(n):
                    return f"{med[n] / ours:.2f}x" if n in med else "n/a"

                print(f"| {shape} | {str(dtype).replace('torch.', '')} | {mode} | {ours * 1e3:.1f} | "
                      f"{ms('textbook+SDPA')} | {ms('textbook+ref')} | {ms('nn.MultiheadAttention')} | "
                      f"{ratio('textbook+SDPA')} | {ratio('nn.MultiheadAttention')} | {ratio('textbook+ref')} |",
                      flush=True)


if __name__ == "__main__":
    main()
