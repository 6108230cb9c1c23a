"""What every benchmark prints first: the code measured (git commit of this checkout, dirty or
not), torch, thread counts and the allocator mode, plus the machine, load and command line,
so a number in RESULTS.md can be tied to the code and the settings that produced it.

    from _env import print_env_header   # (benchmarks/ is on sys.path for its scripts)
    print_env_header()                  # "# key: value" lines
    print_env_header(prefix="- ")       # markdown bullets

and how the CPU benchmarks time methods against each other (interleaved_medians: one call of
each method per round, the order changing from round to round).
"""

from __future__ import annotations

import datetime
import itertools
import os
import platform
import subprocess
import sys
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def checkout_first(root: str = ROOT) -> None:
    """Put this checkout first on sys.path where its attn_ext is built (attn_ext/_C*.so next to
    the sources: an editable or in-place build), so that a benchmark measures the code it sits
    beside. An unbuilt checkout stays off the path, and the installed attn_ext (`pip install .`
    builds elsewhere) is imported: the unbuilt sources used to shadow it (ImportError: cannot
    import name '_C'). Call it before `import attn_ext`."""
    lib = os.path.join(root, "attn_ext")
    built = os.path.isdir(lib) and any(
        name.startswith("_C") and name.endswith((".so", ".pyd")) for name in os.listdir(lib))
    if built and root not in sys.path:
        sys.path.insert(0, root)


# glibc malloc knobs that change whether large blocks are mapped fresh per allocation
GLIBC_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "MALLOC_TOP_PAD_")
PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def git_commit(root: str = ROOT) -> str:
    """Short commit of the checkout the benchmark runs from, '+dirty' when tracked files
    differ from it; ATTN_EXT_COMMIT overrides (a copy without .git)."""
    env = os.environ.get("ATTN_EXT_COMMIT")
    if env:
        return f"{env} (from ATTN_EXT_COMMIT)"
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown (not a git checkout)"
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        branch = subprocess.run(["git", "-C", root, "rev-parse", "--abbrev-ref", "HEAD"],
                                capture_output=True, text=True, timeout=10)
        out = sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
        if branch.returncode == 0 and branch.stdout.strip() not in ("", "HEAD"):
            out += f" (branch {branch.stdout.strip()})"
        return out
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"


def allocator_mode(device: str = "cpu") -> str:
    """The host allocator (a preloaded jemalloc/tcmalloc/mimalloc, or glibc with its knobs)
    and, for CUDA, PyTorch's caching-allocator configuration."""
    preloaded = []
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
        preloaded = [a for a in PRELOADED_ALLOCATORS if f"lib{a}" in maps]
    except OSError:
        pass
    if preloaded:
        host = f"{', '.join(preloaded)} (preloaded)"
    else:
        knobs = [f"{k}={os.environ[k]}" for k in GLIBC_KNOBS if k in os.environ]
        host = ("glibc malloc, " + " ".join(knobs)) if knobs else \
            "glibc malloc default (blocks above the mmap threshold are mapped fresh per allocation)"
    host += "; " + huge_pages()
    if device == "cuda":
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
        host += f"; CUDA caching allocator {conf if conf else 'default config'}"
    return host


def huge_pages() -> str:
    """Whether large tensors may be in transparent huge pages: the kernel's THP mode and
    THP_MEM_ALLOC_ENABLE (PyTorch's CPU allocator advises huge pages for large tensors when it
    is 1). A read pass over a cache-sized tensor and the decode kernel both move with it
    (RESULTS.md, twenty-ninth session)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        mode = "unknown"
    value = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
    advised = " (torch advises them)" if value == "1" else ""
    return f"transparent huge pages {mode}, THP_MEM_ALLOC_ENABLE={value}{advised}"


def threads() -> str:
    import torch

    env = [f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ]
    return (f"{torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op"
            + (f" ({' '.join(env)})" if env else "") + f"; {os.cpu_count()} logical CPUs")


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {platform.system()} {platform.release()}"


def cpu_isa() -> str:
    """Which vector ISA each side of a CPU comparison runs: attn_ext's kernels (AVX2 + FMA +
    F16C, or the portable C++ path: attn_ext._explain.cpu_simd_enabled, the mirror of
    csrc/cpu/cpu_features.cpp) and torch's ATen kernels (SDPA's flash kernel and the roofs'
    reductions; ATEN_CPU_CAPABILITY may lower it), with the CPU's flags that matter to either."""
    import torch

    try:
        from attn_ext._explain import (cpu_avx512_enabled, cpu_bf16_amx, cpu_bf16_scores,
                                       cpu_decode_scores, cpu_flags, cpu_gemm, cpu_simd_enabled)
    except Exception as e:  # noqa: BLE001 (the attn_ext line says why; keep the header going)
        return f"attn_ext not importable ({type(e).__name__}); torch ATen " + \
            torch.backends.cpu.get_cpu_capability()
    ours = "AVX2+FMA+F16C" if cpu_simd_enabled() else "portable C++ (no SIMD path)"
    if cpu_avx512_enabled():
        ours += " (+ AVX-512F/BW decode PV"
        if cpu_decode_scores(torch.float32) == "zmm":
            ours += ", decode scores"
        if cpu_gemm(torch.float32) == "avx512":
            ours += ", fp32 gemms"
        if cpu_bf16_scores(torch.bfloat16) == "vdpbf16ps":
            ours += (", AVX512_BF16 bf16 decode and tiled scores" +
                     (" where D % 32 != 0" if cpu_bf16_amx(128) else ""))
        elif "avx512_bf16" in cpu_flags() and not cpu_bf16_amx(128):
            ours += "; bf16 decode scores widened to fp32 (Intel CPU or ATTN_EXT_CPU_BF16DP=0)"
        if cpu_bf16_amx(64):
            ours += ("; AMX tiles for the tiled kernels' bf16 products (D % 32 == 0) and the "
                     "fp16 ones, forward and backward (bf16 hi / lo split), and the bf16 decode's "
                     "scores")
        ours += ")"
    flags = cpu_flags()
    shown = [x for x in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16") if x in flags]
    return (f"attn_ext kernels {ours}; torch ATen {torch.backends.cpu.get_cpu_capability()}; "
            f"CPU flags {' '.join(shown) if shown else 'unknown'}")


def load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def describe(device: str = "cpu") -> List[Tuple[str, str]]:
    """(key, value) pairs of the run's environment, in print order."""
    import torch

    tv = torch.__version__ + (f", CUDA {torch.version.cuda}" if torch.version.cuda else "")
    rows = [
        ("commit", git_commit()),
        ("torch", tv),
        ("threads", threads()),
        ("allocator", allocator_mode(device)),
        ("machine", machine()),
        ("cpu isa", cpu_isa()),
    ]
    if device == "cuda" and torch.cuda.is_available():
        rows.append(("gpu", torch.cuda.get_device_name()))
    try:
        import attn_ext

        rows.append(("attn_ext", attn_ext.library_path()))
        # the commit the loaded build was made from (setup.py records it): a build older than
        # the checkout measures other code than the commit line says
        built = attn_ext.build_info().get("commit") or "unknown (no commit recorded)"
        same = built.split("+")[0] == git_commit().split("+")[0].split()[0]
        rows.append(("built from", built if same
                     else f"{built} (NOT the checkout's commit: rebuild to measure it)"))
    except Exception as e:  # noqa: BLE001 (the benchmark will fail on its own; say why here)
        rows.append(("attn_ext", f"not importable: {e}"))
    rows += [
        ("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")),
        ("load average", load()),
        ("command", " ".join([os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "python"] + sys.argv[1:])),
    ]
    return rows


def print_env_header(device: str = "cpu", prefix: str = "# ", file=None) -> Dict[str, str]:
    """Print describe() as ``prefix key: value`` lines (flushed) and return it as a dict."""
    rows = describe(device)
    out = file or sys.stdout
    for k, v in rows:
        print(f"{prefix}{k}: {v}", file=out)
    out.flush()
    return dict(rows)


def round_orders(names: Sequence[str], rounds: int) -> List[List[str]]:
    """The order in which `names` run in each of `rounds` timed rounds. A fixed order puts
    every call of a method right after the same other method: at (1, 8, 512, 64) fwd+bwd on a
    2-core VM, the method that always ran after the textbook reference (whose 70 MiB of fresh
    pages and S x S buffers evict the caches) took 1.3-1.5x as long as when it ran after SDPA,
    and that method was always ours (RESULTS.md, nineteenth session). So the rounds go through
    the permutations of the methods in turn (all n! before any repeats, for n <= 4: over a whole
    cycle each method runs first, and after each other method, equally often); for more
    methods the order and its reverse alternate, rotated by one every two rounds."""
    names = list(names)
    if len(names) <= 4:
        perms = [list(p) for p in itertools.permutations(names)]
        return [perms[r % len(perms)] for r in range(rounds)]
    out = []
    for r in range(rounds):
        k = (r // 2) % len(names)
        order = names[k:] + names[:k]
        out.append(order[::-1] if r % 2 else order)
    return out


def interleaved_medians(fns: Dict[str, Callable[[], object]], repeats: int,
                        before: Optional[Callable[[], object]] = None, warmup: int = 1,
                        time_call: Optional[Callable[[Callable[[], object]], float]] = None
                        ) -> Dict[str, float]:
    """Median seconds of each method over `repeats` rounds with one call of each per round, in
    round_orders' order; `warmup` untimed calls of each first; before(), when given, runs
    untimed before every timed call (e.g. a cache eviction); time_call(fn) -> seconds (default:
    perf_counter around the call)."""
    if time_call is None:
        def time_call(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for order in round_orders(list(fns), repeats):
        for name in order:
            if before is not None:
                before()
            times[name].append(time_call(fns[name]))
    return {name: statistics.median(t) for name, t in times.items()}


if __name__ == "__main__":
    print_env_header(sys.argv[1] if len(sys.argv) > 1 else "cpu")
