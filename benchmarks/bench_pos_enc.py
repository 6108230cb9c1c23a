#!/usr/bin/env python3
"""Positional encodings at memory speed: attn_ext RoPE and sinusoidal vs their floors.

Each case times, in the same process and interleaved round by round (so machine noise hits
every variant alike), medians over rounds:

  ours in place       attn_ext.rope_qk(..., inplace=True) / attn_ext.sinusoidal_pe_
  ours out of place   attn_ext.rope_qk / attn_ext.sinusoidal_pe (fresh outputs)
  textbook            attn_ext.reference.rope (chunk + cat, rotate_half) / reference.sinusoidal_pe
                      (on CUDA: also torch.compile of the textbook)
  copy_ floor         buffer.copy_(x): the same bytes read and written, no allocation
  clone() floor       x.clone(): the same bytes, into freshly allocated memory

GB/s counts the bytes the op must move: read x once + write x once (q and k for RoPE).
Returning a fresh large tensor costs page faults unless the allocator reuses memory; the
"faults/call" column shows it. glibc's default hands large blocks (> ~32 MiB) back to the OS
on free, so every fresh output is new zero pages; --reuse re-executes this script with
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ raised so freed memory is reused.

  python benchmarks/bench_pos_enc.py                 # CPU, default allocator, 2 threads
  python benchmarks/bench_pos_enc.py --reuse         # CPU, glibc told to reuse freed memory
  python benchmarks/bench_pos_enc.py --device cuda   # GPU (CUDA events, vs torch.compile too)
  python benchmarks/bench_pos_enc.py --quick         # small shapes, CI smoke run
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

REUSE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (for _env)
from _env import checkout_first, print_env_header  # noqa: E402

checkout_first()
import attn_ext  # noqa: E402
from attn_ext import reference as R  # noqa: E402


def allocator_mode() -> str:
    if all(os.environ.get(k) == v for k, v in REUSE_ENV.items()):
        return "glibc reuse (" + " ".join(f"{k}={v}" for k, v in REUSE_ENV.items()) + ")"
    if any(k in os.environ for k in REUSE_ENV):
        return "glibc custom (" + " ".join(f"{k}={os.environ[k]}" for k in REUSE_ENV if k in os.environ) + ")"
    return "glibc default (large blocks mmap'd fresh per allocation)"


def load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "?"


class Timer:
    """Wall time of one call (CPU) or CUDA-event time (GPU), plus minor page faults."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3, 0
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        return dt, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def run_case(title, variants, nbytes, rounds, timer, warmup=1):
    """variants: list of (name, fn). Interleaved rounds; returns rows of results."""
    for _, fn in variants:
        for _ in range(warmup):
            fn()
    times = {n: [] for n, _ in variants}
    faults = {n: [] for n, _ in variants}
    for _ in range(rounds):
        for n, fn in variants:
            dt, fl = timer(fn)
            times[n].append(dt)
            faults[n].append(fl)
    med = {n: statistics.median(v) for n, v in times.items()}
    copy_t, clone_t = med["copy_ floor"], med["clone() floor"]
    print(f"\n### {title}\n")
    print(f"bytes moved per call: {nbytes / 2**20:.0f} MiB (read + write)\n")
    print("| variant | median ms | GB/s | time / copy_ | time / clone() | faults/call |")
    print("|---|---:|---:|---:|---:|---:|")
    for n, _ in variants:
        t = med[n]
        print(f"| {n} | {t * 1e3:.2f} | {nbytes / t / 1e9:.1f} | {t / copy_t:.2f} | {t / clone_t:.2f} "
              f"| {statistics.median(faults[n]):.0f} |")
    return med


def targets(kind, med):
    lines = []
    inp, oop, tb = med.get("ours in place"), med.get("ours out of place"), med.get("textbook")
    copy_t, clone_t = med["copy_ floor"], med["clone() floor"]
    if inp is not None:
        r = copy_t / inp
        lines.append(f"in place: {100 * r:.0f}% of copy_ bandwidth (target >= 80%): {'MET' if r >= 0.8 else 'MISSED'}")
    if kind == "rope" and oop is not None:
        r = oop / clone_t
        lines.append(f"out of place: {r:.2f}x clone() time (target <= 1.25x): {'MET' if r <= 1.25 else 'MISSED'}")
        s = tb / oop
        lines.append(f"out of place vs textbook: {s:.1f}x faster (target >= 4x): {'MET' if s >= 4 else 'MISSED'}")
    for line in lines:
        print(f"- {line}")


def validate(ours, ref64, ref_low, what):
    err = (ours.double() - ref64).abs().max().item()
    ref_err = (ref_low.double() - ref64).abs().max().item()
    floor = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}.get(ours.dtype, 1e-12)
    if not err <= 2 * ref_err + floor:
        sys.exit(f"validation failed for {what}: err {err:.3e} vs reference error {ref_err:.3e}")


def rope_case(shape, dtype, interleaved, device, rounds, timer, compile_ref):
    B, S, H, D = shape
    q = torch.randn(shape, device=device).to(dtype)
    k = torch.randn(shape, device=device).to(dtype)
    cos, sin = attn_ext.rope_cache(S, D, device=device)  # fp32 tables, the friendly default
    # validate on a slice (the reference in float64 on the full tensor costs GBs)
    qs, ks = q[:1, : min(S, 256)], k[:1, : min(S, 256)]
    for ours_q, ours_k, what in (
            (*attn_ext.rope_qk(qs, ks, cos, sin, interleaved=interleaved), "rope_qk"),
            (*attn_ext.rope_qk(qs.clone(), ks.clone(), cos, sin, interleaved=interleaved,
                               inplace=True), "rope_qk(inplace=True)")):
        for ours, x in ((ours_q, qs), (ours_k, ks)):
            validate(ours, R.rope(x.double(), cos.double(), sin.double(), interleaved=interleaved),
                     R.rope(x, cos, sin, interleaved=interleaved), what)
    qb, kb = torch.empty_like(q), torch.empty_like(k)
    variants = [
        ("ours in place", lambda: attn_ext.rope_qk(q, k, cos, sin, interleaved=interleaved, inplace=True)),
        ("ours out of place", lambda: attn_ext.rope_qk(q, k, cos, sin, interleaved=interleaved)),
        ("textbook", lambda: (R.rope(q, cos, sin, interleaved=interleaved), R.rope(k, cos, sin, interleaved=interleaved))),
        ("copy_ floor", lambda: (qb.copy_(q), kb.copy_(k))),
        ("clone() floor", lambda: (q.clone(), k.clone())),
    ]
    if compile_ref:
        cref = torch.compile(R.rope)
        variants.insert(3, ("torch.compile(textbook)",
                            lambda: (cref(q, cos, sin, interleaved=interleaved), cref(k, cos, sin, interleaved=interleaved))))
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
    title = (f"RoPE q, k {tuple(shape)} {str(dtype).replace('torch.', '')}, "
             f"{'interleaved' if interleaved else 'half-split'}, fp32 tables")
    med = run_case(title, variants, nbytes, rounds, timer)
    targets("rope", med)
    return med


def sinusoidal_case(shape, dtype, device, rounds, timer, compile_ref):
    x = torch.randn(shape, device=device).to(dtype)
    xs = x[:1, :256]
    for ours, what in ((attn_ext.sinusoidal_pe(xs), "sinusoidal_pe"),
                       (attn_ext.sinusoidal_pe_(xs.clone()), "sinusoidal_pe_")):
        validate(ours, R.sinusoidal_pe(xs.double()), R.sinusoidal_pe(xs), what)
    xb = torch.empty_like(x)
    variants = [
        ("ours in place", lambda: attn_ext.sinusoidal_pe_(x)),
        ("ours out of place", lambda: attn_ext.sinusoidal_pe(x)),
        ("textbook", lambda: R.sinusoidal_pe(x)),
        ("copy_ floor", lambda: xb.copy_(x)),
        ("clone() floor", lambda: x.clone()),
    ]
    if compile_ref:
        cref = torch.compile(R.sinusoidal_pe)
        variants.insert(3, ("torch.compile(textbook)", lambda: cref(x)))
    nbytes = 2 * x.numel() * x.element_size()
    title = f"sinusoidal x {tuple(shape)} {str(dtype).replace('torch.', '')}"
    med = run_case(title, variants, nbytes, rounds, timer)
    targets("sinusoidal", med)
    return med


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="small shapes, 3 rounds (CI smoke)")
    ap.add_argument("--reuse", action="store_true",
                    help="re-exec with glibc told to keep and reuse freed memory")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")

    if args.reuse and allocator_mode().startswith("glibc default"):
        env = dict(os.environ, **REUSE_ENV)
        os.execve(sys.executable, [sys.executable] + sys.argv, env)

    torch.set_num_threads(args.threads)
    rounds = args.rounds or (3 if args.quick else 9)
    timer = Timer(args.device)
    compile_ref = args.device == "cuda"
    if args.quick:
        qk_shape, x_shape = (2, 256, 8, 64), (2, 256, 256)
    else:
        qk_shape, x_shape = (4, 2048, 32, 128), (8, 2048, 1024)

    print_env_header(args.device, prefix="- ")  # commit, torch, threads, allocator, machine, ...
    print(f"\n## Positional encodings ({args.device.upper()})\n")
    if args.reuse:
        print("- (re-executed with the reuse env)")
    print(f"- SIMD path: {'off (ATTN_EXT_CPU_SIMD=0)' if os.environ.get('ATTN_EXT_CPU_SIMD') == '0' else 'auto'}")
    print(f"- rounds: {rounds}, interleaved; medians. load average before: {load()}")

    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        results[("rope", dtype, False)] = rope_case(qk_shape, dtype, False, args.device, rounds, timer, compile_ref)
    results[("rope", torch.float32, True)] = rope_case(qk_shape, torch.float32, True, args.device, rounds, timer, compile_ref)
    for dtype in (torch.float32, torch.bfloat16):
        results[("sin", dtype)] = sinusoidal_case(x_shape, dtype, args.device, rounds, timer, compile_ref)
    print(f"\nload average after: {load()}")


if __name__ == "__main__":
    main()
