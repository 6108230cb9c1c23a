"""The build itself: OpenMP really on, the library loadable without the Python package."""

import os
import subprocess
import sys

import torch

import attn_ext


def test_op_library_uses_openmp_threads():
    # Without -fopenmp on compile and link, at::parallel_for silently runs on one thread.
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


def test_limited_api_build():
    # one .abi3 build serves every CPython >= 3.10
    assert os.path.basename(attn_ext.library_path()).endswith(".abi3.so")
