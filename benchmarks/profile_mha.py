"""Where the time of one attn_ext.MultiHeadAttention forward goes (fp32, no_grad): the fused
QKV projection, the textbook's three projections, our attention on strided views, SDPA on
contiguous and on transposed inputs, and the output projection, each timed alone (medians of
7, two passes). Companion of bench_mha.py; numbers in RESULTS.md.

    python benchmarks/profile_mha.py [--shape B,S,d,H]
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (for _env)
from _env import checkout_first, print_env_header  # noqa: E402

checkout_first()
import attn_ext  # noqa: E402,F401
from attn_ext.modules import MultiHeadAttention  # noqa: E402


def med(fn, n=7):
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,1024,768,12")
    B, S, d, H = (int(v) for v in ap.parse_args().shape.split(","))
    D = d // H
    torch.manual_seed(0)
    m = MultiHeadAttention(d, H, causal=True).eval()
    x = torch.randn(B, S, d)
    print_env_header("cpu")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, shape {(B, S, d, H)}, "
          f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'default')}")
    with torch.no_grad():
        qkv = m.qkv(x)
        q, k, v = qkv.view(B, S, 3, H, D).unbind(2)
        out = torch.ops.attn_ext.attention(q, k, v, True, None)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        qc, kc, vc = (t.contiguous() for t in (qt, kt, vt))
        o2 = out.reshape(B, S, d)
        wq = m.qkv.weight[:d]
        # validated before timing: our attention on the strided views against SDPA, and the
        # layer against its projections around SDPA
        want = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True).transpose(1, 2)
        err = (out - want).abs().max().item()
        layer = m(x)
        layer = layer[0] if isinstance(layer, tuple) else layer
        err_layer = (layer - m.out_proj(want.reshape(B, S, d))).abs().max().item()
        if not (err < 1e-4 and err_layer < 1e-4):
            sys.exit(f"validation failed: attention {err:.2e}, layer {err_layer:.2e} (vs SDPA)")
        print(f"# validated: attention vs SDPA max |diff| {err:.1e}, layer {err_layer:.1e}")
        pieces = {
            "layer": lambda: m(x),
            "fused qkv linear": lambda: m.qkv(x),
            "3x linear d -> d": lambda: (F.linear(x, wq), F.linear(x, wq), F.linear(x, wq)),
            "attn_ext attention (strided)": lambda: torch.ops.attn_ext.attention(q, k, v, True, None),
            "SDPA on contiguous (B,H,S,D)": lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True),
            "SDPA on transposed views": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
            "out proj": lambda: m.out_proj(o2),
        }
        res = {k_: [] for k_ in pieces}
        for _ in range(2):
            for k_, fn in pieces.items():
                res[k_].append(med(fn))
    for k_, v_ in res.items():
        print(f"{k_:32s} " + "  ".join(f"{t:7.1f}" for t in v_) + " ms")


if __name__ == "__main__":
    main()
