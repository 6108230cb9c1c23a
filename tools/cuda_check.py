#!/usr/bin/env python3
"""Compile every csrc/**/*.cu for sm_80 and sm_90 without a GPU and without a CUDA build of
torch: nvcc compile-only against the installed torch's headers. Prints ptxas's register /
spill report per kernel and fails (exit 1) on any compile error.

The CPU torch wheel lacks one generated header, c10/cuda/impl/cuda_cmake_macros.h (a single
#define); it is written into build/cuda_check/include. Kernels must not include
ATen/cuda/CUDAContext.h (it pulls in cuBLAS headers the CPU wheel does not ship).

  python tools/cuda_check.py [--arch 80,90] [--fail-on-spill PATTERN] [-j N] [files...]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nvcc_path() -> str:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    path = os.path.join(home, "bin", "nvcc")
    if os.path.exists(path):
        return path
    found = shutil.which("nvcc")
    if not found:
        sys.exit("cuda_check: nvcc not found (set CUDA_HOME)")
    return found


def stable_abi_flags() -> list[str]:
    """setup.py's -DTORCH_TARGET_VERSION (read from it, so the two cannot drift) and USE_CUDA
    (the stable shim's CUDA entry points are declared only with it)."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        m = re.search(r'^TORCH_TARGET_VERSION = "(0x[0-9a-f]{16})"', f.read(), re.M)
    if not m:
        sys.exit("cuda_check: TORCH_TARGET_VERSION not found in setup.py")
    return [f"-DTORCH_TARGET_VERSION={m.group(1)}", "-DUSE_CUDA"]


def torch_flags() -> list[str]:
    import torch
    from torch.utils import cpp_extension

    gen = os.path.join(ROOT, "build", "cuda_check", "include")
    macros = os.path.join(gen, "c10", "cuda", "impl", "cuda_cmake_macros.h")
    os.makedirs(os.path.dirname(macros), exist_ok=True)
    with open(macros, "w") as f:
        f.write("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    flags = [f"-I{gen}", f"-I{os.path.join(ROOT, 'csrc')}"]
    flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags += [
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-DNDEBUG",
        # the same half/bfloat16 flags torch's CUDAExtension passes
        "-D__CUDA_NO_HALF_OPERATORS__",
        "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-D__CUDA_NO_HALF2_OPERATORS__",
    ]
    return flags + stable_abi_flags()


def compile_one(nvcc: str, src: str, archs: list[str], flags: list[str], outdir: str):
    obj = os.path.join(outdir, os.path.relpath(src, ROOT).replace(os.sep, "_") + ".o")
    cmd = [nvcc, "-c", src, "-o", obj, "-std=c++20", "-O3", "--expt-relaxed-constexpr",
           "-Xptxas", "-v", "-Xcompiler", "-fPIC"]
    for a in archs:
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    cmd += flags
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return src, proc.returncode, proc.stdout + proc.stderr


def summarize_ptxas(log: str) -> list[tuple[str, str, int, int, int, int]]:
    """(arch, kernel, registers, spill stores, spill loads, stack frame bytes) per compiled
    function. A stack frame without spills is a local array: a register array indexed at run
    time (the fa2 kernels' exact paths copy theirs into one inside the rare branch; indexing
    the score tile itself put its stores after every tile: RESULTS.md, thirtieth session)."""
    rows = []
    func, arch, spill_st, spill_ld, stack = None, "?", 0, 0, 0
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\d+)'", line)
        if m:
            func, arch = m.group(1), m.group(2)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and func:
            stack, spill_st, spill_ld = int(m.group(1)), int(m.group(2)), int(m.group(3))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and func:
            rows.append((arch, func, int(m.group(1)), spill_st, spill_ld, stack))
            func = None
    return rows


def demangle(names: list[str]) -> dict[str, str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*")
    ap.add_argument("--arch", default="80,90")
    ap.add_argument("-j", type=int, default=int(os.environ.get("MAX_JOBS", "2")))
    ap.add_argument("--fail-on-spill", default=None,
                    help="regex of (demangled) kernel names that must not spill")
    args = ap.parse_args()
    files = args.files or sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True))
    if not files:
        print("cuda_check: no .cu files")
        return 0
    nvcc = nvcc_path()
    print(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1])
    archs = args.arch.split(",")
    flags = torch_flags()
    outdir = os.path.join(ROOT, "build", "cuda_check", "obj")
    os.makedirs(outdir, exist_ok=True)
    failed, spilled = [], []
    with cf.ThreadPoolExecutor(max_workers=max(1, args.j)) as pool:
        futs = [pool.submit(compile_one, nvcc, f, archs, flags, outdir) for f in files]
        for fut in cf.as_completed(futs):
            src, rc, log = fut.result()
            rel = os.path.relpath(src, ROOT)
            if rc != 0:
                failed.append(rel)
                print(f"\n=== FAILED: {rel}\n{log}")
                continue
            rows = summarize_ptxas(log)
            names = demangle(sorted({r[1] for r in rows}))
            print(f"\n=== {rel}: ok ({len(rows)} kernel instances)")
            print(f"  {'arch':6} {'regs':>4} {'spill st/ld':>12} {'stack':>5}  kernel")
            for arch, fn, regs, st, ld, stack in sorted(rows, key=lambda r: (names[r[1]], r[0])):
                name = names[fn]
                short = name if len(name) < 110 else name[:107] + "..."
                print(f"  {arch:6} {regs:4d} {st:5d}/{ld:<6d} {stack:5d}  {short}")
                if (st or ld) and args.fail_on_spill and re.search(args.fail_on_spill, name):
                    spilled.append(f"{arch} {name}")
    if spilled:
        print("\ncuda_check: register spills in kernels that must not spill:")
        for s in spilled:
            print("  " + s)
    if failed:
        print(f"\ncuda_check: {len(failed)} of {len(files)} files FAILED: {', '.join(failed)}")
        return 1
    print(f"\ncuda_check: all {len(files)} .cu files compiled for sm_{', sm_'.join(archs)}")
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
