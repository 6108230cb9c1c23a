"""Shared pieces of the deployment tests: the models every route exports, and a runner
for fresh Python processes (so nothing registered in the test process can help them)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch import nn

from attn_ext.models import TinyGPT
from attn_ext.modules import MultiHeadAttention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# torch 2.13 deprecates TorchScript (torch.jit.script / trace / load / save all warn
# "`torch.jit.X` is deprecated. Please switch to torch.compile or torch.export"). TorchScript
# is still the only route to a Python-free C++ runtime that loads our ops through
# libattn_ext_ops.so, so we keep testing it and silence exactly that warning;
# torch.export (tests/test_deploy_export.py) is the forward path.
JIT_DEPRECATION = "ignore:`torch\\.jit\\.[\\w.]+` is deprecated:DeprecationWarning"

# Tracing bakes RotaryEmbedding's "does the cos/sin table need to grow?" test in as a
# constant (TracerWarning): a traced model serves sequence lengths up to the table length at
# trace time (max_len), which is what these tests use.
TRACER_TABLE_WARNING = "ignore:Converting a tensor to a Python boolean:torch.jit.TracerWarning"


def tiny_gpt(seed: int = 0, max_len: int = 64, num_kv_heads=None) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(100, d_model=32, num_heads=4, num_layers=2, max_len=max_len, pos="rope",
                   causal=True, num_kv_heads=num_kv_heads).eval()


class RopeAttention(nn.Module):
    """MultiHeadAttention with RoPE and GQA, returning only the output (traceable)."""

    def __init__(self):
        super().__init__()
        self.mha = MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, rotary=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x)[0]


def rope_attention(seed: int = 1) -> RopeAttention:
    torch.manual_seed(seed)
    return RopeAttention().eval()


def run_python(code: str, *args: str, with_package: bool = False, timeout: int = 300) -> str:
    """Run ``code`` in a fresh interpreter started outside the repo; ``attn_ext`` is
    importable there only ``with_package`` (the copy under test, first on sys.path).
    Returns stdout; fails with stderr."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if with_package:
        import attn_ext

        env["PYTHONPATH"] = os.path.dirname(os.path.dirname(attn_ext.__file__))
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, cwd="/", env=env)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def parse_printed_tensor(stdout: str) -> torch.Tensor:
    """The tensor examples/cpp/run_model and run_aoti print: "shape D0 D1 ..." then
    "values V0 V1 ..." (row-major), as float64."""
    lines = dict(line.split(" ", 1) for line in stdout.strip().splitlines())
    shape = [int(d) for d in lines["shape"].split()]
    values = torch.tensor([float(v) for v in lines["values"].split()], dtype=torch.float64)
    return values.view(shape)


def cmake_configure(build: str) -> None:
    """Configure CMakeLists.txt against the installed torch's libtorch into `build` (shared by
    test_cmake_build.py, test_deploy_cpp.py and test_deploy_aoti_cpp.py). A CUDA build of torch
    makes its CMake config look for a complete CUDA toolkit (nvrtc, cuBLAS, ...); where that is
    missing the tests skip with the reason instead of failing (CI uses the CPU wheel, where it
    always runs)."""
    import shutil
    import subprocess

    import pytest
    import torch

    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    proc = subprocess.run(["cmake", "-S", ROOT, "-B", build, *gen,
                           f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        out = proc.stdout + proc.stderr
        if torch.version.cuda is not None and "CUDA" in out:
            pytest.skip("torch is a CUDA build and its CMake config did not find a complete CUDA "
                        "toolkit: " + " ".join(out.split("CMake Error")[-1].split())[:200])
        raise AssertionError("cmake configure failed:\n" + out)
