"""`pip install .` as a new user runs it (issue 13): a fresh venv with the local torch wheel,
a clean copy of the checkout (the files git knows, nothing built), plain `pip install .` with
pip's default build isolation, then every op called from another directory
(tests/install_smoke.py). PIP_CONSTRAINT (PIP_BUILD_CONSTRAINT on pip >= 26.2) pins the
isolated build env's torch to the venv's version, so nothing big is downloaded (without the pin pip picks the newest torch it can find
for the build env; the libraries would still load in the venv's torch, see
benchmarks/RESULTS.md).

Marked `install` (a venv, two torch installs and a full build: minutes on 2 cores): plain
pytest deselects it, .ci/run runs it explicitly; locally `pytest -m install tests/test_pip_install.py`."""

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_PIN = os.environ.get("ATTN_EXT_INSTALL_TORCH", "torch==" + torch.__version__.split("+")[0])


def clean_copy(dest: str) -> None:
    """The checkout's files as a fresh clone has them (tracked + not ignored), no build output."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):  # deleted in the work tree
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))


def make_venv(path: str, *packages: str) -> str:
    subprocess.run([sys.executable, "-m", "venv", path], check=True)
    py = os.path.join(path, "bin", "python")
    subprocess.run([py, "-m", "pip", "install", "-q", *packages], check=True)
    return py


def run(cmd, **kw):
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    return proc, time.time() - t0


@pytest.mark.install
@pytest.mark.skipif(shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git"))
                    and not os.path.isfile(os.path.join(ROOT, ".git")), reason="needs a git checkout")
def test_plain_pip_install_in_a_fresh_venv(tmp_path):
    src = str(tmp_path / "src")
    clean_copy(src)
    assert not any(n.endswith(".so") for _, _, fs in os.walk(src) for n in fs)
    py = make_venv(str(tmp_path / "venv"), TORCH_PIN, "ninja")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    # (pip >= 26.2 reads only PIP_BUILD_CONSTRAINT for the build env, older pips only PIP_CONSTRAINT)
    env = dict(os.environ, PIP_CONSTRAINT=str(constraints), PIP_BUILD_CONSTRAINT=str(constraints),
               MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    env.pop("PYTHONPATH", None)
    proc, secs = run([py, "-m", "pip", "install", "-v", "."], cwd=src, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    # built in pip's isolated env (not against some torch outside it), with the one-line reason
    assert "Installing build dependencies" in log, log[-3000:]
    assert "attn_ext: building the CPU ops" in log, log[-3000:]
    print(f"pip install . took {secs:.0f} s")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "install_smoke.py"), elsewhere)
    proc, _ = run([py, "install_smoke.py"], cwd=str(elsewhere), env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "all ops ok" in out
    assert os.path.join(str(tmp_path / "venv"), "lib") in out  # the installed copy ran
    assert '"with_cuda": false' in out and '"cuda_loaded": false' in out

    # the clone's scripts run on the installed package: the documented torchrun example and a
    # benchmark (they used to put the clone's unbuilt sources first on sys.path: ImportError,
    # "cannot import name '_C'")
    venv_lib = os.path.join(str(tmp_path / "venv"), "lib")
    proc, _ = run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   os.path.join("examples", "ring_attention.py"), "--steps", "1"], cwd=src, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "step 0: context-parallel loss" in out, out[-3000:]
    proc, _ = run([py, os.path.join("benchmarks", "bench_cpu_limits.py"), "--quick", "--parts",
                   "decode"], cwd=src, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert f"# attn_ext: {venv_lib}" in out, out[:3000]
