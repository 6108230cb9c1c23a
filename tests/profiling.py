"""Which attn_ext CUDA kernels a call launched, from the torch profiler, for the dispatch
tests of tests/test_attention_cuda.py.

The parsing is separate from the profiling so that it is tested on CPU
(tests/test_profiling.py): a profile in which no attention kernel shows up is a failure
(nothing could be told about the dispatch), never a vacuous pass of ``ran`` or
``did_not_run``.
"""

from __future__ import annotations

import re
from typing import Callable, FrozenSet, Iterable

# Every attention kernel (__global__ function) in csrc/cuda/attention_*_kernel.cuh;
# tests/test_profiling.py checks this list against the headers.
ATTN_KERNELS = (
    "fa2_fwd_kernel",
    "fa2_bwd_delta_kernel",
    "fa2_bwd_kernel",
    "simple_fwd_kernel",
    "simple_fwd_split_kernel",
    "simple_fwd_combine_kernel",
    "simple_bwd_dq_kernel",
    "simple_bwd_dkdv_kernel",
    "simple_bwd_drel_diag_kernel",
    "simple_bwd_drel_reduce_kernel",
    "settle_lse_kernel",  # after every forward (common/row_lse.h)
)

_PATTERNS = {k: re.compile(r"(?<![A-Za-z0-9_])" + k + r"(?![A-Za-z0-9_])") for k in ATTN_KERNELS}


class EmptyProfile(AssertionError):
    """The profiler recorded no attn_ext attention kernel: the dispatch cannot be checked."""


def attention_kernels(event_names: Iterable[str]) -> FrozenSet[str]:
    """The attention kernels (names from ATTN_KERNELS) among the profiler's event names
    (demangled symbols such as ``void attn_ext::cuda::fa2::fa2_fwd_kernel<__half, 64, true>
    (...)``). Raises EmptyProfile when there is none."""
    names = list(event_names)
    found = frozenset(k for k, pat in _PATTERNS.items() if any(pat.search(n) for n in names))
    if not found:
        raise EmptyProfile(
            f"the profiler recorded no attn_ext attention kernel ({len(names)} events: "
            f"{sorted(names)[:8]}); which kernel ran cannot be told")
    return found


def _matching(kernels: FrozenSet[str], kernel: str):
    if not isinstance(kernels, frozenset) or not kernels:
        raise EmptyProfile(f"no recorded kernels to look for {kernel!r} in (got {kernels!r})")
    known = [k for k in ATTN_KERNELS if k.startswith(kernel)]
    if not known:
        raise ValueError(f"{kernel!r} names no attention kernel (known: {list(ATTN_KERNELS)})")
    return [k for k in kernels if k.startswith(kernel)]


def ran(kernels: FrozenSet[str], kernel: str) -> bool:
    """An attention kernel whose name starts with ``kernel`` was recorded."""
    return bool(_matching(kernels, kernel))


def did_not_run(kernels: FrozenSet[str], kernel: str) -> bool:
    """Attention kernels were recorded, and none whose name starts with ``kernel``."""
    return not _matching(kernels, kernel)


def profile_event_names(fn: Callable[[], object]) -> list:
    """Names of the events the torch profiler (CUDA activity) recorded while fn() ran."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages()]


def kernel_names(fn: Callable[[], object]) -> FrozenSet[str]:
    """The attention kernels fn() launched; EmptyProfile when the profiler saw none."""
    return attention_kernels(profile_event_names(fn))


# ---- CPU: did the split-KV forward run? ------------------------------------------------------


def cpu_split_kv_ran(q, k, v, causal: bool, threads: int) -> bool:
    """Whether the CPU forward took its split-KV path for these inputs at ``threads``
    threads, observed from the results: with one thread the plain tiled kernel runs (split
    needs fewer tiles than threads), and the tiled kernel's result does not depend on the
    thread count (each query tile is one task, its keys walked in order), so a bitwise
    difference from the one-thread result can only come from the keys having been split
    into chunks and merged. (Random float inputs: a split merge that happened to round
    every output element identically is not a practical outcome.)"""
    import torch

    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.attn_ext.attention_forward(q, k, v, causal, None)
        torch.set_num_threads(threads)
        many = torch.ops.attn_ext.attention_forward(q, k, v, causal, None)
    finally:
        torch.set_num_threads(prev)
    return not (torch.equal(one[0], many[0]) and torch.equal(one[1], many[1]))
