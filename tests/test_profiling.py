"""The "which kernel ran" helpers of tests/test_attention_cuda.py (tests/profiling.py), on CPU:
an empty profile, or one without an attention kernel, must fail the dispatch checks instead
of passing them vacuously."""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests import profiling
from tests.profiling import EmptyProfile, attention_kernels, did_not_run, kernel_names, ran

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FWD = "void attn_ext::cuda::fa2::fa2_fwd_kernel<__half, 64, true>(attn_ext::AttentionParams)"
SPLIT = "void attn_ext::cuda::simple::simple_fwd_split_kernel<float>(attn_ext::AttentionParams, long, int, float*, float*)"


def test_empty_profile_fails():
    with pytest.raises(EmptyProfile, match="no attn_ext attention kernel"):
        attention_kernels([])


def test_profile_without_attention_kernel_fails():
    # CPU-side records name the op (attn_ext::attention_forward) but are not kernels: the old
    # helper took any name containing "attn_ext" as proof that kernels were recorded.
    events = ["attn_ext::attention_forward", "aten::empty", "cudaLaunchKernel",
              "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"]
    with pytest.raises(EmptyProfile):
        attention_kernels(events)


def test_ran_and_did_not_run_refuse_no_profile():
    for nothing in (None, frozenset(), set()):
        with pytest.raises(EmptyProfile):
            ran(nothing, "fa2_fwd_kernel")
        with pytest.raises(EmptyProfile):
            did_not_run(nothing, "fa2_fwd_kernel")


def test_kernel_names_parsed():
    names = attention_kernels([FWD, "aten::empty", SPLIT])
    assert names == frozenset({"fa2_fwd_kernel", "simple_fwd_split_kernel"})
    assert ran(names, "fa2_fwd_kernel") and ran(names, "simple_fwd_split_kernel")
    # simple_fwd_split_kernel is not simple_fwd_kernel; prefixes select families
    assert did_not_run(names, "simple_fwd_kernel") and did_not_run(names, "fa2_bwd")
    assert ran(names, "simple_fwd")
    with pytest.raises(ValueError, match="names no attention kernel"):
        did_not_run(names, "fa2_fwd_kernal")  # a typo must not pass as "did not run"


def test_kernel_names_on_an_empty_profile(monkeypatch):
    """kernel_names on a fake profile that recorded nothing, or only CPU-side events:
    EmptyProfile (the old helper returned None, and ran()/did_not_run() then passed)."""
    ran_fn = []
    for events in ([], ["attn_ext::attention_forward", "cudaDeviceSynchronize"]):
        monkeypatch.setattr(profiling, "profile_event_names", lambda fn, ev=events: (fn(), ev)[1])
        with pytest.raises(EmptyProfile):
            kernel_names(lambda: ran_fn.append(1))
    assert ran_fn == [1, 1]  # fn itself was run


def test_kernel_list_matches_the_headers():
    found = set()
    for name in os.listdir(os.path.join(ROOT, "csrc", "cuda")):
        if name.startswith("attention") and name.endswith((".cuh", ".cu")):
            with open(os.path.join(ROOT, "csrc", "cuda", name)) as f:
                text = f.read()
            found |= set(re.findall(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\([^)]*\)\s*)?"
                                    r"(?:void\s+)?(\w+)\s*\(", text))
    assert found, "no __global__ function found in csrc/cuda/attention*"
    assert found == set(profiling.ATTN_KERNELS), (sorted(found), profiling.ATTN_KERNELS)
