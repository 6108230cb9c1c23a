"""Shared fixtures. CUDA cases are the same test functions with device="cuda", skipped when
no GPU is present; nothing queries the GPU at import time."""

import os
import random
import zlib

import pytest
import torch

import attn_ext  # noqa: F401  (registers the ops)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    if request.param == "cuda" and not _cuda_available():
        pytest.skip("no CUDA device")
    return request.param


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs per test, but reproducible from the test id.
    seed = zlib.crc32(request.node.nodeid.encode()) % (2**31)  # stable across processes
    torch.manual_seed(seed)
    random.seed(seed)
    yield


def pytest_collection_modifyitems(config, items):
    """Slow cases: all run with ATTN_EXT_SLOW=1 (or `-m slow`); otherwise (CI) a fixed
    sample of 1 in ATTN_EXT_SLOW_EVERY (default 8) runs, the rest are deselected.
    Install cases (a fresh venv and a full build, minutes): only with ATTN_EXT_SLOW=1 or
    `-m install` (.ci/run runs them explicitly), never in the sample."""
    marks = config.getoption("-m") or ""
    if os.environ.get("ATTN_EXT_SLOW") != "1" and "install" not in marks:
        installs = [i for i in items if i.get_closest_marker("install") is not None]
        if installs:
            config.hook.pytest_deselected(items=installs)
            items[:] = [i for i in items if i.get_closest_marker("install") is None]
    if os.environ.get("ATTN_EXT_SLOW") == "1" or "slow" in marks:
        return
    every = int(os.environ.get("ATTN_EXT_SLOW_EVERY", "8"))
    keep, drop = [], []
    slow_index = 0
    for item in items:
        if item.get_closest_marker("slow") is not None:
            (keep if slow_index % every == 0 else drop).append(item)
            slow_index += 1
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
