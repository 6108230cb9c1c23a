"""AOTInductor in C++: examples/cpp/run_aoti (built by the top-level CMakeLists.txt against the
wheel's libtorch, linking libattn_ext_ops.so with --no-as-needed) loads an AOTInductor package
of TinyGPT through torch::inductor::AOTIModelPackageLoader and prints the same logits as Python.
The package calls our ops through AOTInductor's proxy executor, which finds them in the
dispatcher: without the op library the package fails to load with the op's name.

Runs by default (the one tested route to a C++ runtime besides TorchScript): on 2 cores,
compiling the package takes 14-25 s (a minute on a loaded machine) and building run_aoti and
run_aoti_without_ops about 16 s more (the op library is shared with test_deploy_cpp.py)."""

import os
import shutil
import subprocess

import pytest
import torch
from torch.export import Dim

from deploy_utils import JIT_DEPRECATION, ROOT, cmake_configure, parse_printed_tensor, tiny_gpt

# The silenced warnings come from torch (see test_deploy_export.py): importing inductor, and
# aoti_compile_and_package copying pytree specs.
pytestmark = [
    pytest.mark.filterwarnings(JIT_DEPRECATION),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed"),
]

# Shared with test_deploy_cpp.py and test_cmake_build.py: the op library is compiled once.
BUILD = os.path.join(ROOT, "build", "cmake-test")
EXAMPLES = os.path.join(BUILD, "examples", "cpp")
MAX_LEN = 64


def _build(target: str) -> str:
    cmake_configure(BUILD)
    proc = subprocess.run(["cmake", "--build", BUILD, "--target", target],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exe = os.path.join(EXAMPLES, target)
    assert os.access(exe, os.X_OK)
    return exe


@pytest.fixture(scope="module")
def run_aoti():
    return _build("run_aoti")


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """TinyGPT (RoPE, causal, GQA) exported with a dynamic batch and sequence dim, compiled
    to an AOTInductor package: (eager model, package path)."""
    model = tiny_gpt(seed=31, max_len=MAX_LEN, num_kv_heads=2)
    dims = {"idx": {0: Dim("batch", min=1, max=32), 1: Dim("seq", min=2, max=MAX_LEN)}}
    with torch.no_grad():
        ep = torch.export.export(model, (torch.randint(0, 100, (2, 8)),), dynamic_shapes=dims)
    path = str(tmp_path_factory.mktemp("aoti") / "tinygpt_aoti.pt2")
    return model, torch._inductor.aoti_compile_and_package(ep, package_path=path)


def _run(exe, pkg, idx, env=None):
    b, s = idx.shape
    return subprocess.run([exe, pkg, str(b), str(s), *map(str, idx.flatten().tolist())],
                          capture_output=True, text=True, timeout=300,
                          env=None if env is None else {**os.environ, **env})


def test_run_aoti_links_the_op_library(run_aoti):
    needed = subprocess.run(["readelf", "-d", run_aoti], capture_output=True, text=True).stdout
    assert "libattn_ext_ops.so" in needed


def test_cpp_output_equals_python(run_aoti, package):
    """One package serves several batch sizes and lengths (dynamic dims). C++ gives eager's
    logits within fp32 rounding, and exactly what the same package gives from Python."""
    model, pkg = package
    in_python = torch._inductor.aoti_load_package(pkg)  # attn_ext is imported (conftest)
    for b, s in ((2, 11), (1, 5), (3, MAX_LEN)):
        idx = torch.randint(0, 100, (b, s))
        proc = _run(run_aoti, pkg, idx)
        assert proc.returncode == 0, proc.stderr
        got = parse_printed_tensor(proc.stdout)
        assert got.shape == (b, s, 100)
        with torch.no_grad():
            want = model(idx)
        torch.testing.assert_close(got, want.double(), rtol=1e-5, atol=1e-6)
        # printed with 9 significant digits, so float32 values come back exactly
        torch.testing.assert_close(got.float(), in_python(idx), rtol=0, atol=0)


def test_cpp_errors_exit_nonzero_with_a_message(run_aoti, package, tmp_path):
    _, pkg = package
    usage = subprocess.run([run_aoti, pkg], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage:" in usage.stderr
    count = subprocess.run([run_aoti, pkg, "1", "2", "3"], capture_output=True, text=True,
                           timeout=60)
    assert count.returncode == 1
    assert "run_aoti: error: expected B*S = 1 * 2 tokens, got 1" in count.stderr
    # sizes past int64, or whose product is: named, no overflow
    for b, s, what in (("99999999999999999999", "1", "B is out of the int64 range"),
                       ("4611686018427387904", "4", "expected B*S = 4611686018427387904 * 4")):
        big = subprocess.run([run_aoti, pkg, b, s, "3"], capture_output=True, text=True,
                             timeout=60)
        assert big.returncode == 1 and f"run_aoti: error: {what}" in big.stderr, big.stderr
    missing = _run(run_aoti, str(tmp_path / "missing.pt2"), torch.tensor([[1, 2]]))
    assert missing.returncode == 1 and "run_aoti: error:" in missing.stderr
    not_zip = tmp_path / "not_a_package.pt2"
    not_zip.write_text("not a zip archive")
    bad = _run(run_aoti, str(not_zip), torch.tensor([[1, 2]]))
    assert bad.returncode == 1 and "run_aoti: error:" in bad.stderr and "zip" in bad.stderr

    # A token id past the vocabulary fails inside the compiled model. AOTInductor's runtime
    # prints that error with a backtrace itself; our own line is the message alone.
    oob = _run(run_aoti, pkg, torch.tensor([[3, 1000]]))
    assert oob.returncode == 1, oob.stderr
    ours = oob.stderr[oob.stderr.index("run_aoti: error:"):]
    assert "index out of bounds" in ours and "Exception raised from" not in ours, ours

    # The declared length range is checked only with AOTI_RUNTIME_CHECK_INPUTS=1.
    too_long = _run(run_aoti, pkg, torch.randint(0, 100, (2, MAX_LEN + 1)),
                    env={"AOTI_RUNTIME_CHECK_INPUTS": "1"})
    assert too_long.returncode == 1
    want = f"run_aoti: error: input_handles[0]: dim value is too large at 1, expected to be <= {MAX_LEN}"
    assert want in too_long.stderr, too_long.stderr


def test_without_the_op_library_the_package_fails_to_load_by_name(package):
    """run_aoti_without_ops is run_aoti without libattn_ext_ops.so (as a program linked without
    --no-as-needed ends up): the loader refuses the package, naming our op, and the program
    exits with that message instead of crashing."""
    _, pkg = package
    exe = _build("run_aoti_without_ops")
    needed = subprocess.run(["readelf", "-d", exe], capture_output=True, text=True).stdout
    assert "libattn_ext_ops.so" not in needed
    proc = _run(exe, pkg, torch.tensor([[1, 2]]))
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "run_aoti: error: Could not find schema for attn_ext::" in proc.stderr, proc.stderr


def test_cmake_install_gives_a_working_run_aoti(run_aoti, package, tmp_path):
    """`cmake --install` puts bin/run_aoti beside bin/run_model once it is built; the installed
    program finds the op library through $ORIGIN/../lib and prints what the built one does."""
    _, pkg = package
    _build("run_model")  # installed unconditionally (run_aoti is OPTIONAL: installed if built)
    prefix = tmp_path / "prefix"
    proc = subprocess.run(["cmake", "--install", BUILD, "--prefix", str(prefix)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exe = prefix / "bin" / "run_aoti"
    assert exe.is_file() and not (prefix / "bin" / "run_aoti_without_ops").exists()
    rpath = subprocess.run(["readelf", "-d", str(exe)], capture_output=True, text=True).stdout
    assert BUILD not in rpath and "$ORIGIN/../" in rpath
    idx = torch.randint(0, 100, (1, 6))
    built, installed = _run(run_aoti, pkg, idx), _run(str(exe), pkg, idx)
    assert built.returncode == 0 and installed.returncode == 0, installed.stderr
    assert installed.stdout == built.stdout
