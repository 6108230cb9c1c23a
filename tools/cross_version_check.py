#!/usr/bin/env python3
"""One build, two torches (issue 13): builds attn_ext's wheel once against torch BUILD (plain
`pip wheel .` with build isolation, the build env's torch pinned by PIP_CONSTRAINT /
PIP_BUILD_CONSTRAINT), installs
that same wheel into a venv with torch BUILD and one with torch OTHER, runs
tests/install_smoke.py in each (every op checked against the float64 reference, from outside
the checkout) and compares the ops' outputs exactly.

    python tools/cross_version_check.py [--build 2.13.0] [--other 2.14.1] [--work /tmp/xv]

Venvs under --work are reused when present (the 2.14.1 wheel is a CUDA build with its CUDA
libraries: several GB to install). Prints timings and exits 1 on any difference. Slow: run
by hand, the result is recorded in benchmarks/RESULTS.md.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_pip_install import clean_copy  # noqa: E402


def sh(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, **kw)
    return time.time() - t0


def venv(path, torch_version):
    py = os.path.join(path, "bin", "python")
    if not os.path.exists(py):
        sh([sys.executable, "-m", "venv", path])
        secs = sh([py, "-m", "pip", "install", "-q", f"torch=={torch_version}", "numpy", "ninja"])
        print(f"venv {path}: torch {torch_version} installed in {secs:.0f} s")
    return py


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="2.13.0")
    ap.add_argument("--other", default="2.14.1")
    ap.add_argument("--work", default="/tmp/attn_ext_xv")
    ap.add_argument("--reuse-wheel", action="store_true", help="keep a wheel already in WORK/dist")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)

    py_a = venv(os.path.join(args.work, f"torch-{args.build}"), args.build)
    src = os.path.join(args.work, "src")
    shutil.rmtree(src, ignore_errors=True)
    clean_copy(src)
    dist = os.path.join(args.work, "dist")
    if not (args.reuse_wheel and os.path.isdir(dist) and os.listdir(dist)):
        shutil.rmtree(dist, ignore_errors=True)
        with open(os.path.join(args.work, "constraints.txt"), "w") as f:
            f.write(f"torch=={args.build}\n")
        pin = os.path.join(args.work, "constraints.txt")  # (PIP_BUILD_CONSTRAINT: pip >= 26.2)
        benv = dict(env, PIP_CONSTRAINT=pin, PIP_BUILD_CONSTRAINT=pin)
        secs = sh([py_a, "-m", "pip", "wheel", "--no-deps", "-w", dist, "."], cwd=src, env=benv)
        print(f"built the wheel against torch {args.build} in {secs:.0f} s")
    wheel = [os.path.join(dist, n) for n in os.listdir(dist) if n.endswith(".whl")][0]
    print(f"wheel: {os.path.basename(wheel)}")

    py_b = venv(os.path.join(args.work, f"torch-{args.other}"), args.other)
    smoke_dir = os.path.join(args.work, "run")
    os.makedirs(smoke_dir, exist_ok=True)
    shutil.copy(os.path.join(ROOT, "tests", "install_smoke.py"), smoke_dir)
    outs = {}
    for py, ver in ((py_a, args.build), (py_b, args.other)):
        sh([py, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", wheel], env=env)
        out = os.path.join(smoke_dir, f"results-{ver}.pt")
        sh([py, "install_smoke.py", out], cwd=smoke_dir, env=env)
        outs[ver] = out

    import torch  # the checker's own torch only reads the saved tensors

    a = torch.load(outs[args.build])
    b = torch.load(outs[args.other])
    print(f"torch {a['torch']} vs {b['torch']}; {args.other}: cuda_status = "
          f"{b['build_info']['cuda_status']!r}")
    bad = 0
    for name, ta in a["results"].items():
        tb = b["results"][name]
        same = torch.equal(ta, tb)
        bad += not same
        diff = (ta.double() - tb.double()).abs().max().item() if ta.numel() else 0.0
        print(f"{'equal' if same else 'DIFFERENT'} {name:<20} max |diff| {diff:.3g}")
    if bad:
        sys.exit(f"{bad} ops differ between torch {args.build} and {args.other}")
    print(f"one build, two torches: all {len(a['results'])} op results bitwise equal")


if __name__ == "__main__":
    main()
