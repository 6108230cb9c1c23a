"""Build attn_ext's compiled op library (attn_ext/_C*.so).

Install with ``pip install --no-build-isolation .`` (or ``-e .``): the extension must be
compiled against the torch that is already installed, and pip's build isolation would
install some other torch into a throwaway environment and build against that.

Environment knobs
  ATTN_EXT_CUDA=0|1       force a CPU-only or a CUDA build (default: CUDA when torch is a
                          CUDA build and a CUDA toolkit is found). Never decided by
                          torch.cuda.is_available(): a GPU-less build box must still be able
                          to build the CUDA kernels.
  DEBUG=1                 -O0 -g instead of -O3 -g0.
  ATTN_EXT_SANITIZE=1     AddressSanitizer + UndefinedBehaviorSanitizer build of the C++
                          sources (-O1 -g -fsanitize=address,undefined
                          -fno-omit-frame-pointer, no -fwrapv, compile and link). The result
                          must be loaded with the ASan runtime preloaded; `make asan` builds it
                          into build/asan/ (never over the normal attn_ext/_C*.so) and runs
                          tests against it. CPU only (CUDA sources are left out).
  MAX_JOBS=N              parallel compile jobs (ninja).
  TORCH_CUDA_ARCH_LIST    defaults to "8.0;9.0" when unset and no GPU is visible.
"""

import glob
import os
import sys

from setuptools import setup

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("DEBUG", "0") == "1"
SANITIZE = os.environ.get("ATTN_EXT_SANITIZE", "0") == "1"
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
PY_LIMITED_API = "cp310"  # one build serves every CPython >= 3.10


def _want_cuda():
    if SANITIZE:
        return False
    forced = os.environ.get("ATTN_EXT_CUDA")
    if forced is not None:
        if forced not in ("0", "1"):
            sys.exit(f"ATTN_EXT_CUDA must be 0 or 1, got {forced!r}")
        return forced == "1"
    if torch.version.cuda is None:
        return False
    return _cuda_home() is not None


def _cuda_home():
    # torch guesses CUDA_HOME from `which nvcc`, which here is a wrapper script; pin the
    # real toolkit when the user did not choose one.
    if not os.environ.get("CUDA_HOME") and os.path.isdir("/usr/local/cuda"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
        cpp_extension.CUDA_HOME = "/usr/local/cuda"
    return os.environ.get("CUDA_HOME") or cpp_extension.CUDA_HOME


def _extension():
    use_cuda = _want_cuda()
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    opt = ["-O0", "-g"] if DEBUG else ["-O3", "-g0"]
    cxx = opt + ["-std=c++20", "-fopenmp", "-DPy_LIMITED_API=0x030A0000"]
    link = ["-fopenmp"]
    if SANITIZE:
        # -O1 -g keeps the reports readable; -fno-wrapv (Python's flags add -fwrapv) lets
        # UBSan see signed overflow in index arithmetic.
        cxx = ["-O1", "-g", "-fno-wrapv"] + SANITIZE_FLAGS + cxx[2:]
        link = link + SANITIZE_FLAGS
    kwargs = dict(
        name="attn_ext._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": cxx},
        extra_link_args=link,
        py_limited_api=True,
    )
    if use_cuda:
        if _cuda_home() is None:
            sys.exit("ATTN_EXT_CUDA=1 but no CUDA toolkit found (set CUDA_HOME)")
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            visible = torch.version.cuda is not None and torch.cuda.is_available()
            if not visible:  # only the default arch list, never the build choice
                os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
        kwargs["sources"] += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        kwargs["extra_compile_args"]["nvcc"] = opt[:1] + [
            "-std=c++20",
            "--expt-relaxed-constexpr",
            "-lineinfo" if DEBUG else "-DNDEBUG",
            "-DATTN_EXT_WITH_CUDA",
        ]
        kwargs["extra_compile_args"]["cxx"].append("-DATTN_EXT_WITH_CUDA")
        return cpp_extension.CUDAExtension(**kwargs)
    return cpp_extension.CppExtension(**kwargs)


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": PY_LIMITED_API}},
)
