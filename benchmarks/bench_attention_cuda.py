"""GPU benchmark of attn_ext's CUDA attention against PyTorch's SDPA backends.

FlashAttention's benchmark setup: B * S = 16384 tokens, H * D = 2048 (so H = 2048 / D),
S in {512, ..., 16384}; bf16 and fp16, causal and not, D in {64, 128}; forward and forward +
backward. Columns: ours (the fast tensor-core kernels), ours with the simple kernels
(attn_ext.ops._simple_cuda_kernels() switches forward and backward; timed once, batch 0 only, while a
call stays under --max-simple-seconds), and torch.nn.functional.scaled_dot_product_attention
restricted to each backend (flash, efficient, cudnn) with torch.nn.attention.sdpa_kernel.
Roofs measured first in the same run: device copy bandwidth (1 GiB) and a bf16 8192^3 matmul.

Times are medians of CUDA-event-timed repetitions after warm-up. TFLOP/s count attention as
4 * B * S^2 * H * D forward (half of it when causal) and 2.5x that for the backward, so
forward + backward = 3.5x the forward. "vs best" = our TFLOP/s / the fastest valid SDPA
backend's for the same configuration and pass (> 1: we are faster). Every variant is
validated against SDPA's math backend in fp32 on a slice before it is timed (out; dq, and dk
and dv up to S = 4096) and reported invalid otherwise. Rows are printed as they are measured
(a time limit keeps what was printed); the summary table comes last.

  python benchmarks/bench_attention_cuda.py                      # headline: bf16 causal D=128, S=4k-16k
  python benchmarks/bench_attention_cuda.py --full               # the whole matrix above
  python benchmarks/bench_attention_cuda.py --dtypes bf16,fp16 --causal both --head-dims 64,128
                                            --seqlens 512,1024 --reps 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

# run from a source checkout (gpu_check.sh builds in place, nothing is installed)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


DEVICE = "cuda"  # --device cpu: a smoke test of this script's logic on a machine without a GPU


def cuda_time_ms(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if DEVICE == "cpu":
        import time

        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_roof(n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, reps, warmup=3)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def copy_roof(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in TB/s (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), reps, warmup=3)
    return 2 * nbytes / (ms * 1e-3) / 1e12


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Max error relative to the reference's largest entry."""
    return ((ours.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def bench_config(dt, D, causal, S, args, backends, sdpa_kernel, SDPBackend, F, simple_ok):
    """All rows of one (dtype, D, causal, S) configuration; returns (rows, simple_ok)."""
    import attn_ext

    B = max(1, args.tokens // S)
    H = max(1, args.hidden // D)
    flops_fwd = 4 * B * S * S * H * D / (2 if causal else 1)
    flops_fb = 3.5 * flops_fwd
    base = dict(dtype=str(dt).replace("torch.", ""), D=D, causal=causal, S=S, B=B, H=H)
    q, k, v, dout = (torch.randn(B, S, H, D, device=DEVICE, dtype=dt) for _ in range(4))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views for SDPA
    rows = []

    def row(impl, pass_, ms, flops, valid, err, b=B):
        tflops = flops / ms / 1e9 if ms == ms else float("nan")  # ms is NaN when unavailable
        r = dict(base, B=b, impl=impl, pass_=pass_, ms=ms, tflops=tflops, valid=valid, err=err)
        rows.append(r)
        print(f"  {r['dtype']:<8} D={D:<3} {'causal' if causal else 'full':<6} S={S:<5} B={b:<3} "
              f"{impl:<18} {pass_:<7} {ms:9.3f} ms {r['tflops']:7.1f} TFLOP/s  valid={valid} "
              f"{err if not valid else ''}", flush=True)

    # fp32 math reference on a slice: the first 512 queries of batch 0 (exact for those rows:
    # for causal, with the keys cut to 512 too; for full attention, against every key), and
    # for S <= 4096 every row, so dk and dv can be checked as well
    cut = S if S <= 4096 else 512
    kcut = cut if causal else S
    qr = qt[:1, :, :cut].detach().float().requires_grad_()
    kr = kt[:1, :, :kcut].detach().float().requires_grad_()
    vr = vt[:1, :, :kcut].detach().float().requires_grad_()
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
        ref.backward(dout[:1, :cut].float().transpose(1, 2))
    ref = ref.detach().transpose(1, 2)  # (1, cut, H, D)
    ref_dq = qr.grad.transpose(1, 2)
    ref_dkv = (kr.grad.transpose(1, 2), vr.grad.transpose(1, 2)) if kcut == S and cut == S else None
    del qr, kr, vr

    # ours, forward
    def ours_fwd():
        return torch.ops.attn_ext.attention_forward(q, k, v, causal, None)

    out, _ = ours_fwd()
    e = rel_err(out[:1, :512], ref[:, :512])
    row("attn_ext", "fwd", cuda_time_ms(ours_fwd, args.reps), flops_fwd, e < 2e-2, e)

    # SDPA backends, forward
    for name, be in backends.items():
        try:
            with sdpa_kernel(be):
                f = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
                o = f()
                ms = cuda_time_ms(f, args.reps)
            e = rel_err(o.transpose(1, 2)[:1, :512], ref[:, :512])
            row(f"sdpa-{name}", "fwd", ms, flops_fwd, e < 2e-2, e)
        except Exception as ex:  # backend unavailable for this configuration
            row(f"sdpa-{name}", "fwd", float("nan"), flops_fwd, False, str(ex).splitlines()[0][:60])

    # ours, forward + backward
    qf, kf, vf = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def ours_fb():
        attn_ext.attention(qf, kf, vf, causal=causal).backward(dout)

    ours_fb()
    errs = [rel_err(qf.grad[:1, :512], ref_dq[:, :512])]
    if ref_dkv is not None:
        errs += [rel_err(g[:1], r) for g, r in zip((kf.grad, vf.grad), ref_dkv)]
    e = max(errs)
    row("attn_ext", "fwd+bwd", cuda_time_ms(ours_fb, args.reps), flops_fb, e < 2e-2, e)
    del qf, kf, vf

    # ours with the simple kernels, once, batch 0
    if simple_ok:
        qg, kg, vg = (t[:1].detach().clone().requires_grad_() for t in (q, k, v))

        def simple_fb():
            attn_ext.attention(qg, kg, vg, causal=causal).backward(dout[:1])

        with attn_ext.ops._simple_cuda_kernels():
            ms = cuda_time_ms(simple_fb, 1, warmup=0)
        row("attn_ext(simple)", "fwd+bwd", ms, flops_fb / B, True, 0.0, b=1)
        simple_ok = ms * 1e-3 < args.max_simple_seconds
        del qg, kg, vg

    # SDPA backends, forward + backward (validated by the same dq slice)
    for name, be in backends.items():
        qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        try:
            with sdpa_kernel(be):
                def f():
                    F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).backward(
                        dout.transpose(1, 2))
                f()
                e = rel_err(qs.grad.transpose(1, 2)[:1, :512], ref_dq[:, :512])  # one call so far
                ms = cuda_time_ms(f, args.reps)
            row(f"sdpa-{name}", "fwd+bwd", ms, flops_fb, e < 2e-2, e)
        except Exception as ex:
            row(f"sdpa-{name}", "fwd+bwd", float("nan"), flops_fb, False, str(ex).splitlines()[0][:60])
        del qs, ks, vs
    del q, k, v, qt, kt, vt, dout, out
    torch.cuda.empty_cache()
    return rows, simple_ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true",
                    help="bf16,fp16 x causal,full x D 64,128 x S 512..16384")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--causal", default="causal", choices=["causal", "full", "both"])
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--seqlens", default="4096,8192,16384")
    ap.add_argument("--tokens", type=int, default=16384, help="B * S")
    ap.add_argument("--hidden", type=int, default=2048, help="H * D")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--max-simple-seconds", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: smoke-test this script (tiny sizes, no meaningful numbers)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.full:
        args.dtypes, args.causal, args.head_dims = "bf16,fp16", "both", "64,128"
        args.seqlens = "512,1024,2048,4096,8192,16384"

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_attention_cuda: no CUDA device", file=sys.stderr)
        return 1
    import attn_ext  # noqa: F401
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test)"
    print(f"# {name}  torch {torch.__version__}  cuda {torch.version.cuda}")
    roof = matmul_roof() if DEVICE == "cuda" else matmul_roof(256, 1)
    bw = copy_roof() if DEVICE == "cuda" else copy_roof(1 << 20, 1)
    print(f"# roofs: bf16 matmul 8192^3 {roof:.0f} TFLOP/s; device copy {bw:.2f} TB/s", flush=True)
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    causal_list = {"causal": [True], "full": [False], "both": [True, False]}[args.causal]
    rows = []
    for dname in args.dtypes.split(","):
        for D in (int(d) for d in args.head_dims.split(",")):
            for causal in causal_list:
                simple_ok = True
                for S in (int(s) for s in args.seqlens.split(",")):
                    r, simple_ok = bench_config(DTYPES[dname], D, causal, S, args, backends,
                                                sdpa_kernel, SDPBackend, F, simple_ok)
                    rows.extend(r)

    def key(r):
        return (r["dtype"], r["D"], r["causal"], r["S"], r["pass_"])

    best = {}
    for r in rows:
        if r["impl"].startswith("sdpa-") and r["valid"] and not math.isnan(r["tflops"]):
            best[key(r)] = max(best.get(key(r), 0.0), r["tflops"])
    print(f"\n{'dtype':<8} {'D':>3} {'mask':<6} {'S':>6} {'B':>3} {'impl':<18} {'pass':<8} {'ms':>9} "
          f"{'TFLOP/s':>8} {'%roof':>6} {'vs best':>7}  valid")
    for r in rows:
        pct = 100 * r["tflops"] / roof if not math.isnan(r["tflops"]) else float("nan")
        b = best.get(key(r))
        rel = r["tflops"] / b if b else float("nan")
        r["vs_best_sdpa"] = rel
        print(f"{r['dtype']:<8} {r['D']:>3} {'causal' if r['causal'] else 'full':<6} {r['S']:>6} "
              f"{r['B']:>3} {r['impl']:<18} {r['pass_']:<8} {r['ms']:>9.3f} {r['tflops']:>8.1f} "
              f"{pct:>6.1f} {rel:>7.2f}  {r['valid']} {r['err'] if not r['valid'] else ''}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(roof_tflops=roof, copy_tb_s=bw, rows=rows), fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
