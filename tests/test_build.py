"""The build itself: OpenMP really on, the library loadable without the Python package."""

import json
import os
import subprocess
import sys

import pytest
import torch

import attn_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_op_library_uses_openmp_threads():
    # The kernels parallelise through torch::stable::parallel_for (torch's OpenMP pool); the
    # probe counts the distinct threads that ran its chunks.
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        assert torch.ops.attn_ext._parallel_threads(16) == 2
        torch.set_num_threads(1)
        assert torch.ops.attn_ext._parallel_threads(16) == 1
    finally:
        torch.set_num_threads(old)


def test_load_library_in_a_fresh_process_without_the_package():
    code = (
        "import torch, sys; torch.ops.load_library(sys.argv[1]); "
        "x = torch.zeros(1, 2, 4); "
        "print(torch.ops.attn_ext.sinusoidal_pe(x, None, 1, 10000.0)[0, 0, 1].item())"
    )
    out = subprocess.run([sys.executable, "-c", code, attn_ext.library_path()],
                         capture_output=True, text=True, cwd="/", check=True).stdout
    assert abs(float(out) - torch.cos(torch.tensor(1.0)).item()) < 1e-6


def test_without_the_package_the_ops_are_inference_only():
    """README, "Gradients need the Python package": with only the library loaded, a backward
    through attention gets PyTorch's not-registered warning and no gradient, while the
    explicit attention_backward op still gives one (what C++ callers use)."""
    code = (
        "import torch, sys, warnings; torch.ops.load_library(sys.argv[1]); "
        "q = torch.randn(1, 4, 2, 8, dtype=torch.float64, requires_grad=True); "
        "out = torch.ops.attn_ext.attention(q, q, q, True, None); "
        "w = warnings.catch_warnings(record=True); caught = w.__enter__(); warnings.simplefilter('always'); "
        "out.sum().backward(); w.__exit__(None, None, None); "
        "print(q.grad is None, any('autograd kernel was not registered' in str(c.message) for c in caught)); "
        "o, lse = torch.ops.attn_ext.attention_forward(q.detach(), q.detach(), q.detach(), True, None); "
        "dq, dk, dv = torch.ops.attn_ext.attention_backward(torch.ones_like(o), q.detach(), q.detach(), "
        "q.detach(), o, lse, True); print(bool(dq.abs().sum() > 0))"
    )
    out = subprocess.run([sys.executable, "-c", code, attn_ext.library_path()],
                         capture_output=True, text=True, cwd="/", check=True).stdout
    assert out.split() == ["True", "True", "True"], out


def test_limited_api_build():
    # one .abi3 build serves every CPython >= 3.10
    assert os.path.basename(attn_ext.library_path()).endswith(".abi3.so")


def test_stable_abi_only():
    # The op library calls torch only through the stable C shims (aoti_torch_* / torch_*):
    # no C++ symbol of c10 / ATen / torch, so one build loads in every torch >= 2.11.
    nm = subprocess.run(["nm", "-D", "--undefined-only", attn_ext.library_path()],
                        capture_output=True, text=True, check=True).stdout
    names = [line.split()[-1] for line in nm.splitlines() if line.strip()]
    cxx = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    bad = [n for n in cxx.splitlines() if n.startswith(("c10::", "at::", "torch::", "caffe2::"))]
    assert not bad, bad[:10]
    assert "torch_parallel_for" in names  # the kernels run on torch's own pool
    assert not any("omp_" in n or n.startswith("GOMP_") for n in names)  # no second OpenMP


def test_build_info_says_what_was_built():
    info = attn_ext.build_info()
    assert info["torch_target_version"] == "0x020b000000000000"
    assert info["running_torch"] == torch.__version__
    assert info["cpu_library"] == attn_ext.library_path()
    assert isinstance(info["reason"], str) and info["reason"]
    if not info["with_cuda"]:
        assert info["cuda_loaded"] is False
        assert info["cuda_status"].startswith("built without CUDA kernels: ")


def test_cuda_library_loads_only_into_a_matching_cuda_torch(monkeypatch):
    built = {"with_cuda": True, "cuda_version": "13.0", "reason": "test"}
    monkeypatch.setattr(torch.version, "cuda", None)
    loaded, why = attn_ext._load_cuda_kernels(built)
    assert not loaded and "is a CPU build" in why
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    loaded, why = attn_ext._load_cuda_kernels(built)
    assert not loaded and "built for CUDA 13.0" in why and "major versions differ" in why
    loaded, why = attn_ext._load_cuda_kernels({"with_cuda": False, "reason": "ATTN_EXT_CUDA=0"})
    assert not loaded and why == "built without CUDA kernels: ATTN_EXT_CUDA=0"


def _cuda_plan(tmp_path, torch_cuda, cuda_home, forced=None):
    """setup.py's CUDA decision with torch.version.cuda faked to `torch_cuda`."""
    code = ("import json, runpy, sys, torch; torch.version.cuda = json.loads(sys.argv[1]); "
            "runpy.run_path('setup.py', run_name='__main__')")
    env = dict(os.environ, ATTN_EXT_PRINT_CUDA_PLAN="1", CUDA_HOME=cuda_home)
    env.pop("ATTN_EXT_CUDA", None)
    if forced is not None:
        env["ATTN_EXT_CUDA"] = forced
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(torch_cuda)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    return proc


def _fake_toolkit(tmp_path, release):
    root = tmp_path / f"cuda-{release}"
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("// fake\n")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return str(root)


def test_setup_builds_cuda_only_with_a_real_matching_toolkit(tmp_path):
    def plan(*args, **kw):
        proc = _cuda_plan(tmp_path, *args, **kw)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    p = plan(None, "/nonexistent")  # a CPU torch
    assert not p["with_cuda"] and p["root"] is None and "is a CPU build" in p["reason"], p
    # a CUDA torch without a toolkit (CUDA_HOME names a directory that does not exist)
    p = plan("13.0", "/nonexistent/cuda")
    assert not p["with_cuda"] and "no CUDA toolkit" in p["reason"], p
    # a toolkit of another CUDA major
    tk12 = _fake_toolkit(tmp_path, "12.4")
    p = plan("13.0", tk12)
    assert not p["with_cuda"] and "nvcc 12.4" in p["reason"] and "major versions differ" in p["reason"], p
    # same major: CUDA kernels built, for that toolkit
    p = plan("12.8", tk12)
    assert p["with_cuda"] and p["root"] == tk12 and p["nvcc"] == "12.4", p
    # forced without a toolkit: a clear failure, not a broken build
    proc = _cuda_plan(tmp_path, "13.0", "/nonexistent/cuda", forced="1")
    assert proc.returncode != 0 and "ATTN_EXT_CUDA=1 but no CUDA toolkit" in proc.stderr + proc.stdout


def test_decode_kernel_keeps_its_prefetches():
    """The CPU decode kernel's software prefetches are in the built code. GCC's IPA pure-const
    pass counts __builtin_prefetch as free of side effects and dropped calls to small functions
    that only prefetch (the decode kernel lost all of them once, 30 % of its bandwidth), so
    csrc/cpu/attention_common.h's prefetch_range uses an asm volatile on x86."""
    import platform
    import shutil

    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None:
        pytest.skip("x86-64 with objdump only")
    asm = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", attn_ext.library_path()],
                         capture_output=True, text=True, check=True).stdout
    fn, hits = None, {}
    for line in asm.splitlines():
        if line.endswith(">:") and "<" in line:
            fn = line
        elif "prefetcht1" in line and fn is not None:
            hits[fn] = hits.get(fn, 0) + 1
    for dtype in ("float", "c10::BFloat16", "c10::Half"):
        name = f"attention_decode_kernel<{dtype}>"
        assert any(name in f for f in hits), f"no prefetcht1 in {name}"


_LIBS_PROBE = r"""
import os, runpy, setuptools, sys
captured = {}
setuptools.setup = lambda **kw: captured.update(kw)
sys.argv = ["setup.py", "--version"]
runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="__main__")
for e in captured["ext_modules"]:
    print(e.name, ",".join(e.libraries))
"""


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA torch has every CUDA library")
def test_forced_cuda_build_with_a_cpu_torch_links_only_libraries_it_has(tmp_path):
    """ATTN_EXT_CUDA=1 with a CPU torch (README: the kernels are built for nvcc's CUDA major):
    the CUDA library must not ask the linker for c10_cuda / torch_cuda, which a CPU torch does
    not ship (the build used to fail at the link, after every .cu had compiled)."""
    import shutil

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        pytest.skip("no nvcc")
    work = tmp_path / "src"
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns("build", ".git", "*.so"))
    env = dict(os.environ, ATTN_EXT_CUDA="1")
    proc = subprocess.run([sys.executable, "-c", _LIBS_PROBE.replace("ROOT", repr(str(work)))],
                          cwd=work, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    libs = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines() if line.startswith("attn_ext."))
    cuda_libs = libs["attn_ext._C_cuda"].split(",")
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for lib in cuda_libs:
        assert lib == "cudart" or os.path.exists(os.path.join(torch_lib, f"lib{lib}.so")), cuda_libs
    assert "cudart" in cuda_libs and "torch_cuda" not in cuda_libs and "c10_cuda" not in cuda_libs


def test_sdist_carries_every_source_file(tmp_path):
    """The source distribution holds every tracked file under csrc/ (headers and CUDA files
    included: without MANIFEST.in it had only setup.py's .cpp sources, and a wheel built from
    it failed on the first #include), the CMake build and its example."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    files = tracked.stdout.split()
    work = tmp_path / "src"
    for f in files:  # a copy of the tracked tree (sdist writes its egg-info next to setup.py)
        dst = work / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        if os.path.isfile(os.path.join(ROOT, f)):
            dst.write_bytes(open(os.path.join(ROOT, f), "rb").read())
    env = dict(os.environ, ATTN_EXT_CUDA="0")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import tarfile
    (sdist,) = (tmp_path / "dist").iterdir()
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    want = [f for f in files if f.startswith("csrc/")]
    want += ["CMakeLists.txt", "examples/cpp/CMakeLists.txt", "examples/cpp/run_model.cpp",
             "pyproject.toml", "setup.py", "README.md"]
    missing = [f for f in want if f not in names]
    assert not missing, missing
    assert any(f.endswith(".h") for f in want) and any(f.endswith(".cu") for f in want)
