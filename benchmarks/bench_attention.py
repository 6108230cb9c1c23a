"""Benchmark attn_ext causal attention against PyTorch SDPA and the textbook reference.

    python benchmarks/bench_attention.py --device cpu [--quick] [--markdown] [--no-memory] [--limits PARTS]
                                         [--shapes B,H,S,D ...] [--dtypes fp32 bf16 fp16] [--repeats N]
    python benchmarks/bench_attention.py --device cuda [bench_attention_cuda.py's options]

`--device cuda` runs the GPU matrix of benchmarks/bench_attention_cuda.py (bf16 / fp16; ours
fast, ours simple, SDPA per backend, in TFLOP/s; copy bandwidth and a bf16 matmul measured
first as the roofs); every option after it is that script's (`--full`, `--dtypes bf16,fp16`,
`--seqlens`, `--json`, ...). Everything below is the CPU benchmark.

Timing: for every shape the methods are validated first (ours and SDPA against each other,
and against the textbook where it runs), then timed interleaved (one call of each method per
round, `--repeats` rounds) and the median of each is reported. On CUDA each call is timed
with CUDA events; on CPU with perf_counter.

FLOP convention: causal forward = 2 * B * H * S^2 * D (two S x S x D matmuls, half of the
score matrix); forward + backward = 3.5x the forward (the backward counted as 2.5x the
forward: five matmuls against two, FlashAttention's convention).

The GEMM roof is the rate of one fp32 torch.matmul (2048 x 2048 x 2048) measured in the same
process; `% roof` = our GFLOP/s over it, for both dtypes: without native bf16 arithmetic
(AVX2 machines) bf16 is computed in fp32 by every method, and torch's own bf16 matmul is a
slow fallback there (its rate, on 512^3, is printed too, for the record). `ours/SDPA` is SDPA's time over ours
(> 1: we are faster).

Memory: the peak resident memory added by one causal forward (inputs already allocated):
the peak RSS is reset (/proc/self/clear_refs), and VmHWM after the call minus VmRSS before
it is reported; each method runs in a fresh subprocess (CPU only).

Then (CPU, `--limits`) the rows of benchmarks/bench_cpu_limits.py: decode shapes against the
same-run read-bandwidth floor and SDPA, prefill on BSHD-contiguous vs BHSD views (both
layouts), fwd+bwd vs SDPA, and the backward's peak extra memory at 1 and 2 threads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (for _env)
from _env import (  # noqa: E402
    checkout_first, interleaved_medians as _env_interleaved, print_env_header)

checkout_first()
import attn_ext  # noqa: E402
from attn_ext import reference  # noqa: E402

SHAPES = [(1, 8, 512, 64), (1, 8, 1024, 64), (1, 16, 2048, 64), (1, 8, 4096, 128), (4, 12, 1024, 64)]
QUICK_SHAPES = [(1, 4, 256, 64)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The textbook holds B*H*S*S scores (several copies); skip it above this many score elements.
TEXTBOOK_MAX_SCORES = 8 * 2048 * 2048


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn, device):
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_medians(fns: dict, device, repeats, warmup=1):
    """Medians over `repeats` rounds, one call of each method per round; the order changes
    from round to round (_env.round_orders), so no method always follows the same one."""
    sync(device)
    return _env_interleaved(fns, repeats, warmup=warmup,
                            time_call=lambda fn: time_call(fn, device))


def gemm_roof(dtype, device, n=2048, repeats=5):
    """Best rate (GFLOP/s) of torch.matmul (n, n) x (n, n) over `repeats` calls: a roof is
    what the machine can reach, so the fastest call counts, not the median."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)
    sync(device)
    t = min(time_call(lambda: torch.matmul(a, b), device) for _ in range(repeats))
    return 2 * n**3 / t / 1e9


def make_inputs(B, H, S, D, dtype, device, requires_grad=False):
    # (B, H, S, D) contiguous: SDPA's native layout; ours reads it as .transpose(1, 2) views.
    q, k, v = [torch.randn(B, H, S, D, device=device).to(dtype).requires_grad_(requires_grad)
               for _ in range(3)]
    return q, k, v


def methods(q, k, v, backward, textbook_ok):
    """name -> zero-argument callable running one causal forward (or forward + backward)."""
    dout = torch.randn_like(q)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, H, S, D) -> (B, S, H, D) view

    def ours():
        if backward:
            attn_ext.attention(t(q), t(k), t(v), causal=True).backward(t(dout))
        else:
            torch.ops.attn_ext.attention_forward(t(q), t(k), t(v), True, None)

    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            out.backward(dout)

    def textbook():
        out = reference.attention(t(q), t(k), t(v), causal=True)
        if backward:
            out.backward(t(dout))

    fns = {"ours": ours, "sdpa": sdpa}
    if textbook_ok:
        fns["textbook"] = textbook
    return fns


def validate(q, k, v, backward, dtype):
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    qs = [x.detach().clone().requires_grad_(backward) for x in (q, k, v)]
    qo = [x.detach().clone().requires_grad_(backward) for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*qs, is_causal=True)
    ours = attn_ext.attention(*[t(x) for x in qo], causal=True)
    pairs = [("out", t(ours), ref)]
    if backward:
        dout = torch.randn_like(ref)
        ref.backward(dout)
        ours.backward(t(dout))
        pairs += [(n, a.grad, b.grad) for n, a, b in zip(("dq", "dk", "dv"), qo, qs)]
    for name, a, b in pairs:
        err = (a.float() - b.float()).abs().max().item()
        scale = b.float().abs().max().item() + 1e-6
        if not err <= tol * max(1.0, scale):
            raise SystemExit(f"validation failed: {name} differs from SDPA by {err:.3e}")


def run_timing(args):
    rows = []
    shapes = QUICK_SHAPES if args.quick else (args.shapes or SHAPES)
    dtypes = ["fp32"] if args.quick else args.dtypes
    roof = gemm_roof(torch.float32, args.device)
    print(f"# GEMM roof fp32: {roof:.1f} GFLOP/s (torch.matmul 2048^3)", flush=True)
    for dname in dtypes:
        dtype = DTYPES[dname]
        if dtype != torch.float32:
            rate = gemm_roof(dtype, args.device, n=512, repeats=3)
            print(f"# torch.matmul {dname} 512^3: {rate:.1f} GFLOP/s", flush=True)
        for mode in ("fwd", "fwd+bwd"):
            backward = mode == "fwd+bwd"
            for B, H, S, D in shapes:
                textbook_ok = B * H * S * S <= TEXTBOOK_MAX_SCORES
                q, k, v = make_inputs(B, H, S, D, dtype, args.device, backward)
                validate(q, k, v, backward, dtype)
                fns = methods(q, k, v, backward, textbook_ok)
                med = interleaved_medians(fns, args.device, args.repeats)
                flops = 2 * B * H * S * S * D * (3.5 if backward else 1.0)
                row = dict(dtype=dname, mode=mode, shape=(B, H, S, D), roof=roof,
                           ours_ms=med["ours"] * 1e3, sdpa_ms=med["sdpa"] * 1e3,
                           textbook_ms=med["textbook"] * 1e3 if textbook_ok else None,
                           gflops=flops / med["ours"] / 1e9,
                           sdpa_gflops=flops / med["sdpa"] / 1e9,
                           ratio=med["sdpa"] / med["ours"])
                rows.append(row)
                print(json.dumps(row), flush=True)
                del q, k, v, fns
    return rows


def mem_child(method, B, H, S, D, dtype_name):
    """Runs in a fresh process: prints the peak-RSS increase (MiB) of one causal forward."""
    dtype = DTYPES[dtype_name]
    with torch.no_grad():
        q, k, v = make_inputs(B, H, S, D, dtype, "cpu")
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        # Warm the op machinery on a tiny problem so one-time costs are not counted.
        s = make_inputs(1, 1, 8, D, dtype, "cpu")
        torch.ops.attn_ext.attention_forward(*[t(x) for x in s], True, None)
        F.scaled_dot_product_attention(*s, is_causal=True)
        reset = _reset_peak_rss()
        before = _status_kib("VmRSS") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if method == "ours":
            out = torch.ops.attn_ext.attention_forward(t(q), t(k), t(v), True, None)
        elif method == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = reference.attention(t(q), t(k), t(v), causal=True)
        after = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        del out
    print(json.dumps({"method": method, "extra_mib": (after - before) / 1024.0,
                      "peak_reset": reset}))


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss():
    """Resets the peak RSS (VmHWM) of this process (Linux); False where not possible, then
    the lifetime peak ru_maxrss is used and an earlier higher peak can hide the increase."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_memory(args):
    rows = []
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for B, H, S, D in [(1, 8, 16384, 64), (1, 8, 32768, 64)]:
        for method in ("ours", "sdpa", "textbook"):
            need = 3 * B * H * S * S * 4  # textbook: scores, mask fill, probabilities (fp32)
            if method == "textbook" and need > 0.5 * avail:
                rows.append(dict(shape=(B, H, S, D), method=method, extra_mib=None,
                                 note=f"skipped: needs ~{need / 2**30:.0f} GiB of score matrices"))
                continue
            cmd = [sys.executable, os.path.abspath(__file__), "--_mem-child", method,
                   str(B), str(H), str(S), str(D), "fp32"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                rows.append(dict(shape=(B, H, S, D), method=method, extra_mib=None,
                                 note="failed: " + res.stderr.strip().splitlines()[-1]))
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            out_mib = B * S * H * D * 4 / 2**20
            rows.append(dict(shape=(B, H, S, D), method=method, extra_mib=r["extra_mib"],
                             note=f"output itself: {out_mib:.0f} MiB"))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def to_markdown(rows, mem_rows):
    lines = ["| dtype | pass | (B, H, S, D) | ours ms | SDPA ms | textbook ms | ours GFLOP/s | SDPA GFLOP/s | ours/SDPA | % GEMM roof |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tb = f"{r['textbook_ms']:.1f}" if r["textbook_ms"] is not None else "skipped (S x S too big)"
        lines.append(f"| {r['dtype']} | {r['mode']} | {tuple(r['shape'])} | {r['ours_ms']:.1f} | "
                     f"{r['sdpa_ms']:.1f} | {tb} | {r['gflops']:.1f} | {r['sdpa_gflops']:.1f} | "
                     f"{r['ratio']:.2f}x | {100 * r['gflops'] / r['roof']:.0f}% |")
    if mem_rows:
        lines += ["", "| (B, H, S, D) fp32 causal fwd | method | extra peak RSS MiB | note |",
                  "|---|---|---:|---|"]
        for r in mem_rows:
            mib = f"{r['extra_mib']:.0f}" if r["extra_mib"] is not None else "-"
            lines.append(f"| {tuple(r['shape'])} | {r['method']} | {mib} | {r['note']} |")
    return "\n".join(lines)


def _device_of(argv):
    """The value of --device in argv (None when absent)."""
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--device="):
            return a.split("=", 1)[1]
    return None


def _run_cuda(argv):
    """--device cuda: bench_attention_cuda.py's main with the other arguments."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_attention_cuda

    rest, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--device":
            skip = True
        elif not a.startswith("--device="):
            rest.append(a)
    sys.argv = [bench_attention_cuda.__file__] + rest
    return bench_attention_cuda.main()


def main():
    if _device_of(sys.argv[1:]) == "cuda":
        return _run_cuda(sys.argv[1:])
    if len(sys.argv) > 1 and sys.argv[1] == "--_mem-child":
        method, B, H, S, D, dt = sys.argv[2:8]
        mem_child(method, int(B), int(H), int(S), int(D), dt)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="one small shape (CI smoke test)")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--shapes", nargs="+", default=None,
                    type=lambda x: tuple(int(v) for v in x.split(",")),
                    help="B,H,S,D shapes to time instead of the default matrix (e.g. 1,8,512,64)")
    ap.add_argument("--no-memory", action="store_true", help="skip the S=16384/32768 memory runs")
    ap.add_argument("--limits", default="decode,layout,train,memory",
                    help="CPU: the parts of bench_cpu_limits.py to run after the table (decode "
                         "shapes against the same-run read-bandwidth floor, BSHD vs BHSD-view "
                         "prefill, fwd+bwd vs SDPA, backward peak memory at 1 and 2 threads); "
                         "'' skips them")
    args = ap.parse_args()
    print_env_header(args.device)
    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}  torch {torch.__version__}  "
          f"device {args.device}  threads {torch.get_num_threads()}  {platform.processor() or platform.machine()}"
          f"  load {os.getloadavg()}", flush=True)
    rows = run_timing(args)
    mem_rows = [] if (args.quick or args.no_memory or args.device != "cpu") else run_memory(args)
    roof_end = gemm_roof(torch.float32, args.device)
    print(f"# GEMM roof fp32 at the end: {roof_end:.1f} GFLOP/s; % roof uses the larger", flush=True)
    for r in rows:
        r["roof"] = max(r["roof"], roof_end)
    if args.markdown:
        print(to_markdown(rows, mem_rows))
    if args.device == "cpu" and args.limits:
        # issue 16's rows, the same code as benchmarks/bench_cpu_limits.py (one implementation)
        import bench_cpu_limits as limits

        parts = {"decode": limits.part_decode, "layout": limits.part_layout,
                 "train": limits.part_train, "memory": limits.part_memory}
        largs = argparse.Namespace(quick=args.quick, repeats=2 if args.quick else max(args.repeats, 5),
                                   decode_caches="interleaved")
        for name in args.limits.split(","):
            if name not in parts:
                raise SystemExit(f"--limits: unknown part {name!r}; choose from {sorted(parts)}")
            parts[name](largs)


if __name__ == "__main__":
    sys.exit(main())
