"""TorchScript in C++: examples/cpp/run_model (built by the top-level CMakeLists.txt against
the wheel's libtorch, linking libattn_ext_ops.so with --no-as-needed) loads a scripted
TinyGPT and prints the same logits as Python."""

import os
import shutil
import subprocess

import pytest
import torch

from deploy_utils import JIT_DEPRECATION, ROOT, cmake_configure, parse_printed_tensor, tiny_gpt

pytestmark = [
    pytest.mark.filterwarnings(JIT_DEPRECATION),
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed"),
]

# Shared with tests/test_cmake_build.py (same configure arguments): the op library is
# compiled once per checkout, this test adds one translation unit.
BUILD = os.path.join(ROOT, "build", "cmake-test")


@pytest.fixture(scope="module")
def run_model():
    cmake_configure(BUILD)
    proc = subprocess.run(["cmake", "--build", BUILD, "--target", "run_model"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exe = os.path.join(BUILD, "examples", "cpp", "run_model")
    assert os.access(exe, os.X_OK)
    return exe


def test_run_model_links_the_op_library(run_model):
    # Without --no-as-needed the linker drops libattn_ext_ops.so (no symbol is referenced).
    needed = subprocess.run(["readelf", "-d", run_model], capture_output=True, text=True).stdout
    assert "libattn_ext_ops.so" in needed


def test_cpp_output_equals_python(run_model, tmp_path):
    model = tiny_gpt(seed=5)
    path = str(tmp_path / "tinygpt.pt")
    torch.jit.script(model).save(path)
    idx = torch.randint(0, 100, (2, 11))
    with torch.no_grad():
        want = model(idx).double()
    proc = subprocess.run([run_model, path, "2", "11", *map(str, idx.flatten().tolist())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = parse_printed_tensor(proc.stdout)
    assert got.shape == (2, 11, 100)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_cpp_errors_exit_nonzero_with_a_message(run_model, tmp_path):
    missing = subprocess.run([run_model, str(tmp_path / "missing.pt"), "1", "1", "3"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "run_model: error:" in missing.stderr
    model = tiny_gpt(seed=6)
    path = str(tmp_path / "tinygpt.pt")
    torch.jit.script(model).save(path)
    # A token id past the vocabulary is an op error (c10::Error, from the embedding): it
    # must come back as a one-line message too, not a crash or a backtrace dump.
    bad = subprocess.run([run_model, path, "1", "2", "3", "1000"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1 and "run_model: error:" in bad.stderr
    assert "Exception raised from" not in bad.stderr  # no C++ backtrace dump


def test_cmake_install_gives_a_working_run_model(run_model, tmp_path):
    """`cmake --install` puts lib/libattn_ext_ops.so and bin/run_model under the prefix (the
    install rules used to be missing: nothing was installed), and the installed run_model,
    with the build tree gone from its RPATH, finds the op library and gives the build's
    output."""
    prefix = tmp_path / "prefix"
    proc = subprocess.run(["cmake", "--install", BUILD, "--prefix", str(prefix)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    libs = list(prefix.glob("lib*/libattn_ext_ops.so"))
    exe = prefix / "bin" / "run_model"
    assert len(libs) == 1 and exe.is_file()
    rpath = subprocess.run(["readelf", "-d", str(exe)], capture_output=True, text=True).stdout
    assert BUILD not in rpath and "$ORIGIN/../" in rpath
    model = tiny_gpt(seed=7)
    path = str(tmp_path / "tinygpt.pt")
    torch.jit.script(model).save(path)
    idx = torch.randint(0, 100, (1, 5))
    args = [path, "1", "5", *map(str, idx.flatten().tolist())]
    built = subprocess.run([run_model, *args], capture_output=True, text=True, timeout=120)
    installed = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120,
                               cwd=str(tmp_path))
    assert built.returncode == 0 and installed.returncode == 0, installed.stderr
    assert installed.stdout == built.stdout
