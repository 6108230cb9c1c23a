"""CMakeLists.txt builds the pure C++ op library (no Python) and it registers the ops."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from deploy_utils import cmake_configure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_cmake_builds_pure_cpp_op_library(tmp_path):
    build = os.path.join(ROOT, "build", "cmake-test")
    cmake_configure(build)
    proc = subprocess.run(["cmake", "--build", build, "--target", "attn_ext_ops"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lib = os.path.join(build, "libattn_ext_ops.so")
    # No Python symbols: the library must not need libpython.
    nm = subprocess.run(["nm", "-D", "--undefined-only", lib], capture_output=True, text=True).stdout
    assert "PyModule_Create" not in nm and "PyInit__C" not in nm
    code = ("import torch, sys; torch.ops.load_library(sys.argv[1]); "
            "print(torch.ops.attn_ext.sinusoidal_pe(torch.zeros(3, 2), None, 0, 10000.0)[2, 0].item())")
    out = subprocess.run([sys.executable, "-c", code, lib], capture_output=True, text=True,
                         cwd=str(tmp_path), check=True).stdout
    assert abs(float(out) - torch.sin(torch.tensor(2.0)).item()) < 1e-6
