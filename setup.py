"""Build attn_ext's compiled op libraries.

    pip install .                          # build isolation: pip puts torch>=2.11 in a
                                           # throwaway build env (pyproject.toml)
    pip install --no-build-isolation .     # fast path: build against the installed torch

The C++ code uses only PyTorch's LibTorch stable ABI, targeting torch 2.11
(-DTORCH_TARGET_VERSION below), so the libraries load in every torch from 2.11 on, whichever
torch they were built against.

  attn_ext/_C.abi3.so       the schemas and the CPU kernels (always built, always loaded)
  attn_ext/_C_cuda.abi3.so  the CUDA kernels: built only when a real nvcc exists and its CUDA
                            major version equals the build torch's; loaded by
                            attn_ext/__init__.py only into a CUDA torch of that major
  attn_ext/_build_info.py   generated: what was built and why (attn_ext.build_info())

Environment knobs
  ATTN_EXT_CUDA=0|1       0: CPU only. 1: CUDA kernels required (fails without nvcc; with a
                          CPU torch they are built for nvcc's CUDA major). Unset: CUDA when
                          torch is a CUDA build and a toolkit whose major matches is found.
                          Never decided by torch.cuda.is_available(): a GPU-less build box
                          still builds the CUDA kernels.
  CUDA_HOME               the toolkit to use (default: /usr/local/cuda, then nvcc on PATH,
                          each only if it really contains bin/nvcc and include/cuda_runtime.h).
  DEBUG=1                 -O0 -g instead of -O3 -g0.
  ATTN_EXT_SANITIZE=1     AddressSanitizer + UndefinedBehaviorSanitizer build of the C++
                          sources (-O1 -g -fsanitize=address,undefined
                          -fno-omit-frame-pointer, no -fwrapv, compile and link). The result
                          must be loaded with the ASan runtime preloaded; `make asan` builds it
                          into build/asan/ (never over the normal attn_ext/_C*.so) and runs
                          tests against it. CPU only (CUDA sources are left out).
  MAX_JOBS=N              parallel compile jobs (ninja).
  ATTN_EXT_PRINT_CUDA_PLAN=1  print the CUDA decision as JSON and exit (tests).
  TORCH_CUDA_ARCH_LIST    defaults to "8.0;9.0+PTX" when unset and no GPU is visible (+PTX:
                          newer GPUs JIT the sm_90 PTX instead of failing with "no kernel
                          image").
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("DEBUG", "0") == "1"
SANITIZE = os.environ.get("ATTN_EXT_SANITIZE", "0") == "1"
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
PY_LIMITED_API = "cp310"  # one build serves every CPython >= 3.10
# The oldest torch the libraries load in: 2.11.0 (TORCH_TARGET_VERSION's layout is
# major, minor, patch, tweak bytes, then zeros).
TORCH_TARGET_VERSION = "0x020b000000000000"
STABLE_FLAGS = [f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}"]
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - pip's isolated build env always has it
    sys.exit("attn_ext: building needs torch>=2.11 importable (pip install . provides it in "
             "its build environment; with --no-build-isolation install torch first)")


def _major(version):
    return int(version.split(".")[0]) if version else None


def _find_toolkit():
    """(root, nvcc, "13.0") of a real CUDA toolkit, or (None, None, reason)."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    else:
        candidates.append("/usr/local/cuda/bin/nvcc")
        if shutil.which("nvcc"):
            candidates.append(shutil.which("nvcc"))
    for nvcc in candidates:
        if not os.path.isfile(nvcc):
            continue
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if not os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
            continue  # e.g. a wrapper script outside the toolkit
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        m = re.search(r"release (\d+\.\d+)", out)
        if m:
            return root, nvcc, m.group(1)
    where = os.environ.get("CUDA_HOME") or "/usr/local/cuda or PATH"
    return None, None, f"no CUDA toolkit (nvcc and cuda_runtime.h) found in {where}"


def _cuda_plan():
    """(build_cuda, reason, toolkit root, nvcc version)."""
    if SANITIZE:
        return False, "ATTN_EXT_SANITIZE=1 builds the CPU ops only", None, None
    forced = os.environ.get("ATTN_EXT_CUDA")
    if forced not in (None, "0", "1"):
        sys.exit(f"ATTN_EXT_CUDA must be 0 or 1, got {forced!r}")
    if forced == "0":
        return False, "ATTN_EXT_CUDA=0", None, None
    root, nvcc, found = _find_toolkit()
    torch_cuda = torch.version.cuda
    if forced == "1":
        if root is None:
            sys.exit(f"attn_ext: ATTN_EXT_CUDA=1 but {found} (set CUDA_HOME)")
        if torch_cuda is not None and _major(torch_cuda) != _major(found):
            sys.exit(f"attn_ext: ATTN_EXT_CUDA=1 but nvcc {found} does not match the CUDA "
                     f"{torch_cuda} of torch {torch.__version__}")
        return True, f"ATTN_EXT_CUDA=1 (nvcc {found})", root, found
    if torch_cuda is None:
        return False, f"torch {torch.__version__} (the torch built against) is a CPU build", None, None
    if root is None:
        return False, f"torch {torch.__version__} is a CUDA {torch_cuda} build but {found}", None, None
    if _major(found) != _major(torch_cuda):
        return (False, f"nvcc {found} at {root} does not match the CUDA {torch_cuda} of torch "
                f"{torch.__version__} (major versions differ)", None, None)
    return True, f"nvcc {found} at {root} matches torch's CUDA {torch_cuda}", root, found


def _git_commit():
    """The checkout's short commit ('+dirty' when tracked files differ), None outside git:
    benchmarks print it next to the checkout's, so a stale build shows."""
    try:
        sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _write_build_info(with_cuda, reason, nvcc_version, arch_list):
    info = {
        "commit": _git_commit(),
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_target_version": TORCH_TARGET_VERSION,
        "with_cuda": with_cuda,
        "cuda_version": nvcc_version if with_cuda else None,
        "cuda_arch_list": arch_list if with_cuda else None,
        "reason": reason,
    }
    text = ('"""Generated by setup.py at build time: what was compiled and why. Read it through\n'
            'attn_ext.build_info()."""\n\nBUILD = ' + repr(info) + "\n")
    path = os.path.join(ROOT, "attn_ext", "_build_info.py")
    old = open(path).read() if os.path.exists(path) else None
    if old != text:
        with open(path, "w") as f:
            f.write(text)


def _extensions():
    with_cuda, reason, root, nvcc_version = _cuda_plan()
    opt = ["-O0", "-g"] if DEBUG else ["-O3", "-g0"]
    # No -fopenmp: the kernels parallelise through torch::stable::parallel_for, i.e. torch's
    # own OpenMP runtime inside libtorch; a second runtime must not be linked in.
    cxx = opt + ["-std=c++20", "-DPy_LIMITED_API=0x030A0000"] + STABLE_FLAGS
    link = []
    if SANITIZE:
        # -O1 -g keeps the reports readable; -fno-wrapv (Python's flags add -fwrapv) lets
        # UBSan see signed overflow in index arithmetic.
        cxx = ["-O1", "-g", "-fno-wrapv"] + SANITIZE_FLAGS + cxx[2:]
        link = link + SANITIZE_FLAGS
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    exts = [cpp_extension.CppExtension(
        name="attn_ext._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": cxx},
        extra_link_args=link,
        py_limited_api=True,
    )]
    arch_list = None
    if with_cuda:
        os.environ["CUDA_HOME"] = root  # the toolkit checked above, for cpp_extension
        cpp_extension.CUDA_HOME = root
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            visible = torch.version.cuda is not None and torch.cuda.is_available()
            if not visible:  # only the default arch list, never the build choice
                os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST
        arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "(visible GPUs)")
        exts.append(cpp_extension.CUDAExtension(
            name="attn_ext._C_cuda",
            sources=sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu"))),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={
                "cxx": opt + ["-std=c++20", "-DUSE_CUDA"] + STABLE_FLAGS,
                "nvcc": opt[:1] + [
                    "-std=c++20",
                    "--expt-relaxed-constexpr",
                    "-lineinfo" if DEBUG else "-DNDEBUG",
                    "-DUSE_CUDA",
                ] + STABLE_FLAGS,
            },
            py_limited_api=True,
        ))
        # CUDAExtension always links c10_cuda / torch_cuda. A CPU torch has neither (the link
        # failed after every .cu had compiled), and the stable-ABI code needs neither at link
        # time: keep the torch libraries this torch has (with a CUDA torch: all of them)
        torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        present = set(os.listdir(torch_lib)) if os.path.isdir(torch_lib) else set()
        exts[-1].libraries = [lib for lib in exts[-1].libraries
                              if lib == "cudart" or f"lib{lib}.so" in present]
        print(f"attn_ext: building the CPU ops and the CUDA kernels ({reason}; "
              f"TORCH_CUDA_ARCH_LIST={arch_list})")
    else:
        print(f"attn_ext: building the CPU ops only; CUDA kernels off: {reason}")
    if not SANITIZE:  # `make asan` builds elsewhere (build/asan): keep the real build's record
        _write_build_info(with_cuda, reason, nvcc_version, arch_list)
    return exts


if os.environ.get("ATTN_EXT_PRINT_CUDA_PLAN") == "1":  # for tests/test_build.py: decide, print, stop
    import json

    with_cuda, reason, root, nvcc_version = _cuda_plan()
    print(json.dumps({"with_cuda": with_cuda, "reason": reason, "root": root, "nvcc": nvcc_version}))
    sys.exit(0)

setup(
    ext_modules=_extensions(),
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": PY_LIMITED_API}},
)
