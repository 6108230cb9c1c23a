"""The main job (``make demo`` / ``python -m attn_ext.demo``): a short showcase of attn_ext.

For now it shows the sinusoidal positional encoding (Vaswani et al., section 3.5): the
encoding matrix, the fact that its dot products depend only on the distance between
positions, and the speed of the fused op against the textbook implementation. Later parts of
the demo (a tiny GPT, RoPE, attention maps) grow here.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import attn_ext
from attn_ext import reference as ref


def _median_time(fn, repeat: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def show_sinusoidal(out_dir: str, device: str) -> None:
    print("== Sinusoidal positional encoding, computed on the fly by torch.ops.attn_ext.sinusoidal_pe")
    table = attn_ext.sinusoidal_table(8, 6, device=device, dtype=torch.float64).cpu()
    print("PE(pos, :) for pos 0..7, D = 6 (columns sin, cos, sin, cos, ...):")
    for pos, row in enumerate(table):
        print(f"  pos {pos}: " + " ".join(f"{v:+.3f}" for v in row.tolist()))
    pe = attn_ext.sinusoidal_table(64, 32, dtype=torch.float64, device=device).cpu()
    gram = pe @ pe.T
    print("<PE(p), PE(p+k)> is the same for every p (depends only on the distance k):")
    for k in (0, 1, 4, 16):
        d = torch.diagonal(gram, offset=k)
        print(f"  k={k:2d}: min {float(d.min()):.6f}  max {float(d.max()):.6f}")

    x = torch.randn(8, 2048, 512, device=device)
    ours = attn_ext.sinusoidal_pe(x, offset=3)
    torch.testing.assert_close(ours, ref.sinusoidal_pe(x.double(), offset=3).float(), rtol=0, atol=2e-5)
    t_ours = _median_time(lambda: attn_ext.sinusoidal_pe(x, offset=3))
    t_inplace = _median_time(lambda: attn_ext.sinusoidal_pe_(x, offset=3))
    t_ref = _median_time(lambda: ref.sinusoidal_pe(x, offset=3), repeat=5)
    gb = 2 * x.numel() * x.element_size() / 1e9
    print(f"x + PE on x {tuple(x.shape)} float32, {torch.get_num_threads()} threads, medians:")
    print(f"  textbook (table + add): {t_ref * 1e3:8.2f} ms")
    print(f"  attn_ext out of place : {t_ours * 1e3:8.2f} ms  ({gb / t_ours:5.1f} GB/s, {t_ref / t_ours:4.1f}x faster)")
    print(f"  attn_ext in place     : {t_inplace * 1e3:8.2f} ms  ({gb / t_inplace:5.1f} GB/s, {t_ref / t_inplace:4.1f}x faster)")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: `pip install matplotlib` for the pictures)")
        return
    os.makedirs(out_dir, exist_ok=True)
    big = attn_ext.sinusoidal_table(100, 128, dtype=torch.float64).numpy()
    fig, ax = plt.subplots(figsize=(8, 4))
    im = ax.pcolormesh(big, cmap="RdBu", vmin=-1, vmax=1)
    ax.set_xlabel("encoding dimension")
    ax.set_ylabel("position")
    ax.set_title("Sinusoidal positional encoding, 100 positions x 128 dims")
    fig.colorbar(im, ax=ax)
    path = os.path.join(out_dir, "sinusoidal_pe.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="attn-ext-demo", description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="demo_out", help="directory for the pictures")
    ap.add_argument("--steps", type=int, default=None, help="training steps (later parts)")
    args = ap.parse_args(argv)
    print(f"attn_ext {attn_ext.__version__} on torch {torch.__version__}, device {args.device}")
    show_sinusoidal(args.out, args.device)


if __name__ == "__main__":
    main()
