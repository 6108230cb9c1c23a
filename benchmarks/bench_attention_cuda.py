"""GPU benchmark of attn_ext's CUDA attention against PyTorch's SDPA backends.

FlashAttention's benchmark setup: B * S = 16384 tokens, H * D = 2048 (so H = 2048 / D),
S in {512, ..., 16384}; bf16 and fp16, causal and not, D in {64, 128}; forward and forward +
backward. Columns: ours (the fast tensor-core kernels), ours with the simple kernels
(attn_ext.ops._simple_cuda_kernels() switches forward and backward; timed once, batch 0 only, while a
call stays under --max-simple-seconds), and torch.nn.functional.scaled_dot_product_attention
restricted to each backend (flash, efficient, cudnn) with torch.nn.attention.sdpa_kernel.
Roofs measured first in the same run: device copy bandwidth (1 GiB) and a bf16 8192^3 matmul.

Every variant of a configuration is validated first (one call each), then the valid ones
are timed interleaved: each round runs one call of every variant in turn, and the
reported time is each variant's median over the rounds (CUDA events), after warm-up. TFLOP/s count attention as
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (for _env)
from _env import checkout_first, print_env_header  # noqa: E402

checkout_first()

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


DEVICE = "cuda"  # --device cpu: a smoke test of this script's logic on a machine without a GPU


def _time_once(fn, ctx=None) -> float:
    """One call of fn in ms (CUDA events on the GPU, perf_counter on the CPU smoke test);
    ctx (e.g. an sdpa_kernel backend choice) is entered outside the timed region."""
    import contextlib

    with ctx() if ctx is not None else contextlib.nullcontext():
        if DEVICE == "cpu":
            import time

            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def cuda_time_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median of reps timed calls of one function after warmup calls (used for the roofs)."""
    for _ in range(warmup):
        fn()
    return statistics.median(_time_once(fn) for _ in range(reps))


def interleaved_ms(variants, reps: int, warmup: int = 2) -> list:
    """Median ms of each variant, timed interleaved: every round runs one call of each
    variant in turn, so a clock or thermal drift during the run spreads over all of them
    instead of favouring whichever ran first. variants: dicts with fn, ctx (or None) and
    reps (a variant with fewer reps, e.g. the slow simple kernels, is timed in the first
    rounds only). Returns one median per variant."""
    for v in variants:
        for _ in range(min(warmup, v["reps"])):
            _time_once(v["fn"], v["ctx"])
    times = [[] for _ in variants]
    for r in range(max((v["reps"] for v in variants), default=0)):
        for v, t in zip(variants, times):
            if r < v["reps"]:
                t.append(_time_once(v["fn"], v["ctx"]))
    return [statistics.median(t) if t else float("nan") for t in times]


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
    """All rows of one (dtype, D, causal, S) configuration; returns (rows, simple_ok).
    Pass 1 validates every variant (one call each against the fp32 math reference);
    pass 2 times the valid ones interleaved (interleaved_ms)."""
    import attn_ext

    B = max(1, args.tokens // S)
    H = max(1, args.hidden // D)
    flops_fwd = 4 * B * S * S * H * D / (2 if causal else 1)
    flops_fb = 3.5 * flops_fwd
    base = dict(dtype=str(dt).replace("torch.", ""), D=D, causal=causal, S=S, B=B, H=H)
    q, k, v, dout = (torch.randn(B, S, H, D, device=DEVICE, dtype=dt) for _ in range(4))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views for SDPA

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

    variants = []  # impl, pass_, fn, ctx, reps, flops, b, valid, err

    def add(impl, pass_, fn, ctx, check, flops, reps=args.reps, b=B):
        """Validate: one call of fn (under ctx), then check() -> error."""
        try:
            if ctx is not None:
                with ctx():
                    fn()
            else:
                fn()
            e = check()
            valid, err = e < 2e-2, e
        except Exception as ex:  # backend unavailable for this configuration
            valid, err, fn = False, str(ex).splitlines()[0][:60], None
        variants.append(dict(impl=impl, pass_=pass_, fn=fn, ctx=ctx, reps=reps if fn else 0,
                             flops=flops, b=b, valid=valid, err=err))

    def dq_err(grad_q):
        return rel_err(grad_q[:1, :512], ref_dq[:, :512])

    def grads_err(qg, kg, vg):
        errs = [dq_err(qg)]
        if ref_dkv is not None:
            errs += [rel_err(g[:1], r) for g, r in zip((kg, vg), ref_dkv)]
        return max(errs)

    # forward: ours (fast kernels) and each SDPA backend
    fwd_out = {}

    def ours_fwd():
        fwd_out["ours"] = torch.ops.attn_ext.attention_forward(q, k, v, causal, None)[0]

    add("attn_ext", "fwd", ours_fwd, None, lambda: rel_err(fwd_out["ours"][:1, :512], ref[:, :512]),
        flops_fwd)
    for name, be in backends.items():
        def sdpa_fwd(name=name):
            fwd_out[name] = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        add(f"sdpa-{name}", "fwd", sdpa_fwd, lambda be=be: sdpa_kernel(be),
            lambda name=name: rel_err(fwd_out[name].transpose(1, 2)[:1, :512], ref[:, :512]), flops_fwd)

    # forward + backward: ours, ours with the simple kernels (batch 0, one timed call while a
    # call stays under --max-simple-seconds), each SDPA backend
    qf, kf, vf = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def ours_fb():
        for t in (qf, kf, vf):
            t.grad = None
        attn_ext.attention(qf, kf, vf, causal=causal).backward(dout)

    add("attn_ext", "fwd+bwd", ours_fb, None, lambda: grads_err(qf.grad, kf.grad, vf.grad), flops_fb)
    if simple_ok:
        qg, kg, vg = (t[:1].detach().clone().requires_grad_() for t in (q, k, v))

        def simple_fb():
            for t in (qg, kg, vg):
                t.grad = None
            with attn_ext.ops._simple_cuda_kernels():
                attn_ext.attention(qg, kg, vg, causal=causal).backward(dout[:1])

        add("attn_ext(simple)", "fwd+bwd", simple_fb, None, lambda: grads_err(qg.grad, kg.grad, vg.grad),
            flops_fb / B, reps=1, b=1)
    sdpa_inputs = {}
    for name, be in backends.items():
        qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        sdpa_inputs[name] = (qs, ks, vs)

        def sdpa_fb(qs=qs, ks=ks, vs=vs):
            for t in (qs, ks, vs):
                t.grad = None
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).backward(dout.transpose(1, 2))

        add(f"sdpa-{name}", "fwd+bwd", sdpa_fb, lambda be=be: sdpa_kernel(be),
            lambda qs=qs, ks=ks, vs=vs: grads_err(*(t.grad.transpose(1, 2) for t in (qs, ks, vs))),
            flops_fb)

    # pass 2: interleaved timing of every variant that ran
    timed = [v_ for v_ in variants if v_["fn"] is not None]
    for v_, ms in zip(timed, interleaved_ms(timed, args.reps)):
        v_["ms"] = ms
    rows = []
    for v_ in variants:
        ms = v_.get("ms", float("nan"))
        tflops = v_["flops"] / ms / 1e9 if ms == ms else float("nan")  # NaN when unavailable
        r = dict(base, B=v_["b"], impl=v_["impl"], pass_=v_["pass_"], ms=ms, tflops=tflops,
                 valid=v_["valid"], err=v_["err"])
        rows.append(r)
        print(f"  {r['dtype']:<8} D={D:<3} {'causal' if causal else 'full':<6} S={S:<5} B={r['B']:<3} "
              f"{r['impl']:<18} {r['pass_']:<7} {ms:9.3f} ms {tflops:7.1f} TFLOP/s  valid={r['valid']} "
              f"{r['err'] if not r['valid'] else ''}", flush=True)
        if v_["impl"] == "attn_ext(simple)" and ms == ms:
            simple_ok = ms * 1e-3 < args.max_simple_seconds
    del q, k, v, qt, kt, vt, dout, fwd_out, qf, kf, vf, sdpa_inputs, variants, timed
    if DEVICE == "cuda":
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
    print_env_header(DEVICE)
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
