"""CUDA-only checks of the attention kernels (csrc/cuda/attention*.cu): the fast fp16/bf16
forward (FA2-style, head dims 32, 64, 96, 128 and 256) against the simple CUDA kernel and against the
float64 reference, on the shapes where the two kernels differ most (tile boundaries, Sq != Sk,
rows without keys, GQA, strided views), the fast FA2-style backward against the simple
backward and float64 autograd, the dispatch rules (misaligned inputs, deterministic mode and
attn_ext.ops._simple_cuda_kernels() fall back to the simple kernels) and NaN propagation. The generic value / gradient tests of
tests/test_attention.py also run on CUDA through the `device` fixture.

Every test skips without a GPU; nothing queries the GPU at import time.
attn_ext.ops._simple_cuda_kernels() (the private op _set_cuda_attention_kernels) forces the
simple kernels inside a block.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import attn_ext  # noqa: F401  (registers the ops)
from attn_ext import reference
from tests.profiling import did_not_run, kernel_names, ran
from tests.utils import assert_close_rule, max_err, randn, with_deterministic

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import kernel_constants as kc  # noqa: E402  (the kernels' constants, read from the headers)


def smem_bytes(name: str, D: int) -> int:
    """attention_launch.h's fwd_smem_bytes / bwd_smem_bytes at head dim D, evaluated from the
    header itself (the launch code calls the same function), so tests cannot drift from it."""
    return kc.evaluate(kc.launch_function(name), {"head_dim": D})

pytestmark = pytest.mark.cuda

FAST_DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return "cuda"


def _smem_optin() -> int | None:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(props, "shared_memory_per_block_optin", None)


def fast_fwd_fits(D: int) -> bool:
    """The fast forward's shared memory (attention_launch.h fwd_smem_bytes) fits this device."""
    need = smem_bytes("fwd_smem_bytes", D)
    limit = _smem_optin()
    return limit is None or need <= limit


@pytest.fixture
def simple_kernels():
    """Call it to force the simple CUDA kernels for the rest of the test (undone at the end)."""
    previous = []
    yield lambda: previous.append(torch.ops.attn_ext._set_cuda_attention_kernels(1))
    for mode in reversed(previous):
        torch.ops.attn_ext._set_cuda_attention_kernels(mode)


def fwd(q, k, v, causal, scale=None):
    return torch.ops.attn_ext.attention_forward(q, k, v, causal, scale)


def fwd_simple(monkeypatch, q, k, v, causal, scale=None):
    with attn_ext.ops._simple_cuda_kernels():
        return fwd(q, k, v, causal, scale)


def ref64(q, k, v, causal, scale=None):
    out, lse = reference.attention_with_lse(q.double(), k.double(), v.double(), causal, scale)
    return out, lse


def check_fwd(out, lse, q, k, v, causal, scale=None, name=""):
    """out against the float64 reference by the tolerance rule, lse to 1e-3 absolute."""
    r_out, r_lse = ref64(q, k, v, causal, scale)
    low_out, _ = reference.attention_with_lse(q, k, v, causal, scale)
    assert out.dtype == q.dtype and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == r_lse.shape
    assert not torch.isnan(out).any(), f"{name}: NaN in out"
    assert not torch.isnan(lse).any(), f"{name}: NaN in lse"
    assert_close_rule(out, r_out, low_out, name=f"{name} out")
    inf_ours, inf_ref = torch.isinf(lse), torch.isinf(r_lse)
    assert torch.equal(inf_ours.cpu(), inf_ref.cpu()), f"{name}: lse -inf rows differ"
    # fp32 lse: 1e-3 absolute plus a few fp32 ulps of its magnitude (large scores)
    fin = torch.isfinite(r_lse)
    bound = 1e-3 + 4e-6 * (float(r_lse[fin].abs().max()) if fin.any() else 0.0)
    assert max_err(lse, r_lse) <= bound, f"{name}: lse error {max_err(lse, r_lse):.3e} > {bound:.3e}"


# (B, Sq, Sk, H, Hkv): tile-aligned, ragged ends, Sq < Sk (decode-like), Sq > Sk (causal
# rows without keys, inside and across query tiles), GQA and MQA.
SHAPES = [
    (2, 128, 128, 4, 4),
    (1, 97, 203, 4, 2),
    (2, 200, 77, 4, 1),
    (1, 1, 300, 8, 2),
    (1, 65, 65, 2, 2),
    (1, 130, 1, 2, 1),
    (2, 333, 1025, 6, 3),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fast_vs_simple_vs_reference(shape, dtype, D, causal, cuda, monkeypatch):
    B, Sq, Sk, H, Hkv = shape
    q = randn(B, Sq, H, D, dtype=dtype, device=cuda)
    k = randn(B, Sk, Hkv, D, dtype=dtype, device=cuda)
    v = randn(B, Sk, Hkv, D, dtype=dtype, device=cuda)
    out_f, lse_f = fwd(q, k, v, causal)
    out_s, lse_s = fwd_simple(monkeypatch, q, k, v, causal)
    check_fwd(out_f, lse_f, q, k, v, causal, name="fast")
    check_fwd(out_s, lse_s, q, k, v, causal, name="simple")
    # the two kernels agree to a couple of output roundings
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    assert max_err(out_f, out_s) <= 4 * ulp * max(1.0, float(out_s.abs().max()))
    assert max_err(lse_f, lse_s) <= 1e-3
    if causal and Sq > Sk:  # rows 0 .. Sq - Sk - 1 see no key
        n = Sq - Sk
        assert torch.all(out_f[:, :n] == 0) and torch.all(lse_f[:, :, :n] == float("-inf"))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
def test_fast_kernel_is_used_and_misaligned_falls_back(D, causal, cuda, monkeypatch):
    if not fast_fwd_fits(D):
        pytest.skip(f"the fast forward's shared memory at D={D} exceeds this device's limit")
    B, S, H = 1, 150, 2
    q = randn(B, S, H, D, dtype=torch.bfloat16, device=cuda)
    k = randn(B, S, H, D, dtype=torch.bfloat16, device=cuda)
    v = randn(B, S, H, D, dtype=torch.bfloat16, device=cuda)
    names = kernel_names(lambda: fwd(q, k, v, causal))
    assert ran(names, "fa2_fwd_kernel"), names
    # same values one element off 16-byte alignment -> simple kernel
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device=cuda)
    q_mis = buf[1:].view_as(q)
    q_mis.copy_(q)
    names = kernel_names(lambda: fwd(q_mis, k, v, causal))
    assert ran(names, "simple_fwd_kernel"), names
    assert did_not_run(names, "fa2_fwd_kernel"), names
    out_mis, lse_mis = fwd(q_mis, k, v, causal)
    check_fwd(out_mis, lse_mis, q, k, v, causal, name="misaligned")
    out, lse = fwd(q, k, v, causal)
    assert max_err(out, out_mis) <= 2.0 ** -6
    # a row stride that is not a multiple of 8 elements -> simple kernel too
    wide = randn(B, S, H, D + 4, dtype=torch.bfloat16, device=cuda)
    k_odd = wide[..., :D]
    assert k_odd.stride(2) % 8 != 0
    names = kernel_names(lambda: fwd(q, k_odd, v, causal))
    assert did_not_run(names, "fa2_fwd_kernel"), names
    out_odd, lse_odd = fwd(q, k_odd, v, causal)
    check_fwd(out_odd, lse_odd, q, k_odd, v, causal, name="odd stride")
    # forcing the simple kernel
    with attn_ext.ops._simple_cuda_kernels():
        names = kernel_names(lambda: fwd(q, k, v, causal))
    assert did_not_run(names, "fa2_fwd_kernel"), names


@pytest.mark.parametrize("layout", ["packed", "transposed"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
def test_fast_strided_layouts(layout, dtype, causal, cuda, monkeypatch):
    B, S, H, Hkv, D = 2, 157, 4, 2, 64
    if layout == "packed":
        qkv = randn(B, S, (H + 2 * Hkv) * D, dtype=dtype, device=cuda)
        q = qkv[..., : H * D].view(B, S, H, D)
        k = qkv[..., H * D : (H + Hkv) * D].view(B, S, Hkv, D)
        v = qkv[..., (H + Hkv) * D :].view(B, S, Hkv, D)
    else:
        q = randn(B, H, S, D, dtype=dtype, device=cuda).transpose(1, 2)
        k = randn(B, Hkv, S, D, dtype=dtype, device=cuda).transpose(1, 2)
        v = randn(B, Hkv, S, D, dtype=dtype, device=cuda).transpose(1, 2)
    names = kernel_names(lambda: fwd(q, k, v, causal))
    assert ran(names, "fa2_fwd_kernel"), names
    out, lse = fwd(q, k, v, causal)
    check_fwd(out, lse, q, k, v, causal, name=layout)
    out_s, _ = fwd_simple(monkeypatch, q, k, v, causal)
    assert max_err(out, out_s) <= 2.0 ** -6


@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
def test_fast_long_causal(dtype, cuda, monkeypatch):
    """Many key tiles, both pipeline buffers in use, causal skipping; fast vs simple vs float64."""
    B, S, H, Hkv, D = 1, 2048 + 37, 4, 1, 128
    q = randn(B, S, H, D, dtype=dtype, device=cuda)
    k = randn(B, S, Hkv, D, dtype=dtype, device=cuda)
    v = randn(B, S, Hkv, D, dtype=dtype, device=cuda)
    for causal in (True, False):
        out, lse = fwd(q, k, v, causal)
        check_fwd(out, lse, q, k, v, causal, name=f"long causal={causal}")
        out_s, lse_s = fwd_simple(monkeypatch, q, k, v, causal)
        assert max_err(out, out_s) <= 2.0 ** -6
        assert max_err(lse, lse_s) <= 1e-3


def test_fast_custom_and_extreme_scale(cuda, monkeypatch):
    q = randn(1, 70, 2, 64, dtype=torch.float16, device=cuda)
    k = randn(1, 90, 2, 64, dtype=torch.float16, device=cuda)
    v = randn(1, 90, 2, 64, dtype=torch.float16, device=cuda)
    for scale in (0.3, 0.0, -0.2, 3.0):
        out, lse = fwd(q, k, v, True, scale)
        check_fwd(out, lse, q, k, v, True, scale, name=f"scale={scale}")


def test_large_scores_no_overflow(cuda):
    """Scores far beyond fp16 range in exp: the online softmax must stay finite."""
    q = randn(1, 100, 2, 128, dtype=torch.bfloat16, device=cuda, scale=30.0)
    k = randn(1, 100, 2, 128, dtype=torch.bfloat16, device=cuda, scale=30.0)
    v = randn(1, 100, 2, 128, dtype=torch.bfloat16, device=cuda)
    out, lse = fwd(q, k, v, False)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check_fwd(out, lse, q, k, v, False, name="large scores")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D,Dv", [(59, 111), (256, 200), (8, 200)])
def test_simple_odd_head_dims(D, Dv, dtype, cuda):
    q = randn(2, 37, 4, D, dtype=dtype, device=cuda)
    k = randn(2, 41, 2, D, dtype=dtype, device=cuda)
    v = randn(2, 41, 2, Dv, dtype=dtype, device=cuda)
    for causal in (False, True):
        out, lse = fwd(q, k, v, causal)
        check_fwd(out, lse, q, k, v, causal, name=f"D={D} Dv={Dv}")


def test_head_dim_too_large(cuda):
    q = randn(1, 4, 1, 264, device=cuda)
    with pytest.raises(RuntimeError, match="head dim D must be <= 256"):
        fwd(q, q, q, False)
    v = randn(1, 4, 1, 300, device=cuda)
    with pytest.raises(RuntimeError, match="head dim Dv must be <= 256"):
        fwd(q[..., :64], q[..., :64], v, False)


def _grads(q, k, v, dout, causal, dtype):
    q, k, v = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _ = reference.attention_with_lse(q, k, v, causal)
    out.backward(dout.to(dtype))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(2, 70, 70, 4, 2, 64, 64), (1, 33, 90, 4, 1, 128, 128),
                                   (2, 90, 33, 2, 2, 48, 80), (1, 1, 200, 8, 2, 64, 64)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_backward(shape, dtype, causal, cuda):
    B, Sq, Sk, H, Hkv, D, Dv = shape
    q = randn(B, Sq, H, D, dtype=dtype, device=cuda)
    k = randn(B, Sk, Hkv, D, dtype=dtype, device=cuda)
    v = randn(B, Sk, Hkv, Dv, dtype=dtype, device=cuda)
    dout = randn(B, Sq, H, Dv, dtype=dtype, device=cuda)
    out, lse = fwd(q, k, v, causal)
    dq, dk, dv = torch.ops.attn_ext.attention_backward(dout, q, k, v, out, lse, causal, None)
    _, *g64 = _grads(q, k, v, dout, causal, torch.float64)
    _, *glow = _grads(q, k, v, dout, causal, dtype)
    for name, ours, r64, rlow in zip(("dq", "dk", "dv"), (dq, dk, dv), g64, glow):
        assert ours.dtype == dtype and ours.is_contiguous()
        assert torch.isfinite(ours).all(), f"{name}: not finite"
        assert_close_rule(ours, r64, rlow, name=name, factor=2.0)


def test_backward_float64_tight(cuda):
    B, Sq, Sk, H, Hkv, D, Dv = 1, 19, 23, 4, 2, 16, 24
    q = randn(B, Sq, H, D, dtype=torch.float64, device=cuda)
    k = randn(B, Sk, Hkv, D, dtype=torch.float64, device=cuda)
    v = randn(B, Sk, Hkv, Dv, dtype=torch.float64, device=cuda)
    dout = randn(B, Sq, H, Dv, dtype=torch.float64, device=cuda)
    for causal in (False, True):
        out, lse = fwd(q, k, v, causal)
        assert lse.dtype == torch.float64
        r_out, *g = _grads(q, k, v, dout, causal, torch.float64)
        assert max_err(out, r_out) < 1e-10
        grads = torch.ops.attn_ext.attention_backward(dout, q, k, v, out, lse, causal, None)
        for ours, r in zip(grads, g):
            assert max_err(ours, r) < 1e-10


def test_backward_deterministic(cuda):
    """The fast backward accumulates dq with fp32 atomics (dk, dv are written once per CTA);
    deterministic=True selects the simple kernels, bitwise repeatable. The autograd formula
    passes torch.are_deterministic_algorithms_enabled() as that argument (the stable ABI cannot
    read the flag from C++), so torch.use_deterministic_algorithms(True) selects them too."""
    q = randn(2, 330, 4, 64, dtype=torch.bfloat16, device=cuda)
    k = randn(2, 330, 1, 64, dtype=torch.bfloat16, device=cuda)
    v = randn(2, 330, 1, 64, dtype=torch.bfloat16, device=cuda)
    dout = randn(2, 330, 4, 64, dtype=torch.bfloat16, device=cuda)
    out, lse = fwd(q, k, v, True)

    def bwd():
        return torch.ops.attn_ext.attention_backward(
            dout, q, k, v, out, lse, True, None,
            deterministic=torch.are_deterministic_algorithms_enabled())

    a, b = bwd(), bwd()
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])  # dk, dv: no atomics
    assert max_err(a[0], b[0]) <= 2.0 ** -6  # dq: atomics may reorder fp32 sums
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        names = kernel_names(bwd)
        assert did_not_run(names, "fa2_bwd_kernel"), names
        c, d = bwd(), bwd()
        qa = q.detach().clone().requires_grad_()
        names = kernel_names(lambda: attn_ext.attention(qa, k, v, causal=True).backward(dout))
        assert ran(names, "simple_bwd") and did_not_run(names, "fa2_bwd_kernel"), names
    finally:
        torch.use_deterministic_algorithms(prev)
    for x, y in zip(c, d):
        assert torch.equal(x, y)


def test_autograd_through_wrapper(cuda):
    q, k, v = [randn(1, 50, 2, 64, dtype=torch.bfloat16, device=cuda).requires_grad_()
               for _ in range(3)]
    out = attn_ext.attention(q, k, v, causal=True)
    out.float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_current_stream_and_no_sync(cuda):
    """The ops run on the current stream and never synchronise with the host:
    forward and backward (fast and split-KV paths) on a side stream under
    torch.cuda.set_sync_debug_mode("error") (a host sync inside an op raises), then captured
    into a CUDA graph on a side stream (a launch on the default stream, or a sync, breaks the
    capture). The graph's replay gives the eager results."""
    q = randn(1, 300, 2, 128, dtype=torch.bfloat16, device=cuda)
    k = randn(1, 300, 2, 128, dtype=torch.bfloat16, device=cuda)
    v = randn(1, 300, 2, 128, dtype=torch.bfloat16, device=cuda)
    dout = randn(1, 300, 2, 128, dtype=torch.bfloat16, device=cuda)
    qd = randn(1, 1, 2, 128, dtype=torch.bfloat16, device=cuda)  # decode: split-KV
    kd = randn(1, 4096, 1, 128, dtype=torch.bfloat16, device=cuda)
    vd = randn(1, 4096, 1, 128, dtype=torch.bfloat16, device=cuda)

    def step():
        out, lse = fwd(q, k, v, True)
        grads = bwd(dout, q, k, v, out, lse, True)
        dec = fwd(qd, kd, vd, True)
        return (out, lse, *grads, *dec)

    want = step()  # eager, default stream
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(s):
            side = step()  # also the warm-up before capture
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    s.synchronize()
    # (torch.cuda.graph synchronises the device on entry, so it runs outside "error" mode;
    # inside the capture a sync or a default-stream launch is itself an error)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    check_fwd(side[0], side[1], q, k, v, True, name="side stream")
    check_fwd(side[5], side[6], qd, kd, vd, True, name="side stream decode")
    names = ("out", "lse", "dq", "dk", "dv", "decode out", "decode lse")
    for name, a, b, c in zip(names, want, side, captured):
        if name == "dq":  # the fast backward adds dq with fp32 atomics: order may differ
            assert max_err(a, b) <= 2.0 ** -5 and max_err(a, c) <= 2.0 ** -5, name
        else:
            assert torch.equal(a, b), f"{name}: side stream differs from the default stream"
            assert torch.equal(a, c), f"{name}: graph replay differs from the eager result"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,Sq,Sk,H,Hkv,D", [(1, 1, 4096, 4, 1, 128), (2, 3, 1500, 2, 2, 64),
                                             (1, 16, 777, 2, 1, 59), (1, 5, 600, 1, 1, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_split_kv_decode(B, Sq, Sk, H, Hkv, D, dtype, causal, cuda, monkeypatch):
    """Few query rows, many keys: the split-KV path (key chunks merged by a second kernel)
    against the unsplit simple kernel and the float64 reference."""
    q = randn(B, Sq, H, D, dtype=dtype, device=cuda)
    k = randn(B, Sk, Hkv, D, dtype=dtype, device=cuda)
    v = randn(B, Sk, Hkv, D, dtype=dtype, device=cuda)
    names = kernel_names(lambda: fwd(q, k, v, causal))
    assert ran(names, "simple_fwd_split_kernel"), names
    assert ran(names, "simple_fwd_combine_kernel"), names
    out, lse = fwd(q, k, v, causal)
    check_fwd(out, lse, q, k, v, causal, name="split")
    out_s, lse_s = fwd_simple(monkeypatch, q, k, v, causal)
    assert max_err(out, out_s) <= 2.0 ** -6
    assert max_err(lse, lse_s) <= 1e-4


def test_split_kv_rows_without_keys(cuda):
    """Sq > Sk is not a decode shape, but Sq <= 16 with causal rows that see only part of
    the keys: chunks past a row's last key are empty and must be skipped in the merge."""
    q = randn(1, 16, 2, 64, dtype=torch.bfloat16, device=cuda)
    k = randn(1, 520, 2, 64, dtype=torch.bfloat16, device=cuda)
    v = randn(1, 520, 2, 64, dtype=torch.bfloat16, device=cuda)
    out, lse = fwd(q, k, v, True)
    check_fwd(out, lse, q, k, v, True, name="split causal")


def nan_query_row_only(q, k, v, causal, b, i, h):
    """A NaN in query row (b, i, h) makes exactly that row's out and lse NaN (not 0, not -inf);
    every other output keeps the bits of the call without it. Returns that call's out."""
    clean, _ = fwd(q, k, v, causal)
    qb = q.clone()
    qb[b, i, h, 3] = float("nan")
    out, lse = fwd(qb, k, v, causal)
    assert torch.isnan(out[b, i, h]).all() and torch.isnan(lse[b, h, i])
    mask = torch.ones_like(out, dtype=torch.bool)
    mask[b, i, h] = False
    assert torch.equal(out[mask], clean[mask])
    return clean


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_kv_nan_propagates(dtype, cuda):
    """A NaN query row on the split-KV path: every chunk of that row sees only NaN scores, so
    each keeps max -inf with a NaN sum, and the merge must give NaN (as the unsplit kernel and
    the CPU do), not the out 0 / lse -inf of a row without keys. A NaN in one key reaches the
    rows that see it; the other heads keep their clean bits."""
    q = randn(2, 1, 4, 128, dtype=dtype, device=cuda)
    k = randn(2, 4096, 2, 128, dtype=dtype, device=cuda)
    v = randn(2, 4096, 2, 128, dtype=dtype, device=cuda)
    names = kernel_names(lambda: fwd(q, k, v, False))
    assert ran(names, "simple_fwd_split_kernel"), names
    assert ran(names, "simple_fwd_combine_kernel"), names
    clean = nan_query_row_only(q, k, v, False, 1, 0, 2)
    kb = k.clone()
    kb[0, 3000, 1, 5] = float("nan")  # kv head 1: query heads 2 and 3
    out, lse = fwd(q, kb, v, False)
    assert torch.isnan(out[0, 0, 2:]).all() and torch.isnan(lse[0, 2:, 0]).all()
    assert torch.equal(out[0, 0, :2], clean[0, 0, :2]) and torch.equal(out[1], clean[1])


@pytest.mark.parametrize("path", ["fast", "simple", "split_kv", "varlen"])
def test_inf_score_rows_settle_to_the_cpu_lse(path, cuda, simple_kernels):
    """A +inf score (no NaN) gives the row lse +inf, as torch.logsumexp and the CPU do, not
    the NaN of the online softmax's exp(inf - inf) (common/row_lse.h, settle_lse_kernel); a
    NaN score keeps NaN; rows that see neither keep their bits."""
    Sq, Sk, dtype = (1, 4096, torch.float32) if path == "split_kv" else (80, 80, torch.bfloat16)
    q, k, v = [randn(2, S, h, 64, dtype=dtype, device=cuda) for S, h in ((Sq, 4), (Sk, 2), (Sk, 2))]
    q[..., 3] = q[..., 3].abs()
    kb = k.clone()
    kb[0, Sk // 2, 0, 3] = float("inf")  # kv head 0 of batch 0: query heads 0, 1 see +inf
    kb[1, Sk // 2, 1, 3] = float("nan")  # kv head 1 of batch 1: query heads 2, 3 NaN
    if path == "simple":
        simple_kernels()
    for causal in (False, True):
        if path == "varlen":
            cu = torch.tensor([0, Sq, 2 * Sq], dtype=torch.int32, device=cuda)
            cuk = torch.tensor([0, Sk, 2 * Sk], dtype=torch.int32, device=cuda)
            got = attn_ext.attention_varlen(q.flatten(0, 1), kb.flatten(0, 1), v.flatten(0, 1), cu, cuk,
                                            Sq, Sk, causal=causal, return_lse=True)
            want = attn_ext.attention_varlen(*(t.flatten(0, 1).cpu() for t in (q, kb, v)), cu.cpu(),
                                             cuk.cpu(), Sq, Sk, causal=causal, return_lse=True)
        else:
            got = attn_ext.attention(q, kb, v, causal=causal, return_lse=True)
            want = attn_ext.attention(q.cpu(), kb.cpu(), v.cpu(), causal=causal, return_lse=True)
        for a, b in zip(got, want):
            a = a.cpu()
            for f in (torch.isnan, torch.isposinf, torch.isneginf):
                assert torch.equal(f(a), f(b)), (path, causal, f)
        lse = got[1].cpu() if path != "varlen" else got[1].cpu().unflatten(1, (2, Sq)).transpose(0, 1)
        seen = slice(max(0, Sk // 2 - (Sk - Sq)), None) if causal else slice(None)
        assert torch.isposinf(lse[0, :2, seen]).all() and torch.isnan(lse[1, 2:, seen]).all()
        assert torch.isfinite(lse[0, 2:]).all() and torch.isfinite(lse[1, :2]).all()


@pytest.mark.parametrize("Sq,Sk", [(1, 4096), (80, 80)], ids=["split_kv", "one_pass"])
def test_all_minus_inf_rows_with_a_nan_v_match_the_cpu(Sq, Sk, cuda):
    """Every visible score -inf and a NaN / inf in v: lse -inf and out NaN where v is (0 * v at
    a visible key, as the reference and the CPU at any thread count); the split-KV combine
    weighs such chunks by exp2(-inf - 0) = 0 (common/attention_mask.h merged_offset)."""
    q = torch.ones(1, Sq, 2, 64, device=cuda)
    q[..., 0] = -1
    k = randn(1, Sk, 1, 64, device=cuda)
    k[..., 0] = float("inf")
    v = torch.zeros(1, Sk, 1, 64, device=cuda)
    v[0, Sk // 2, 0, 1] = float("nan")
    v[0, Sk - 1, 0, 2] = float("inf")
    got = attn_ext.attention(q, k, v, return_lse=True)
    want = attn_ext.attention(q.cpu(), k.cpu(), v.cpu(), return_lse=True)
    for a, b in zip(got, want):
        a = a.cpu()
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert torch.isneginf(got[1]).all() and torch.isnan(got[0][..., 1:3]).all()


def op_fwd_bwd(dev, q, k, v, dout, **kw):
    """attention_forward then attention_backward on device dev with the same keyword arguments
    (ones both ops take); returns [out, lse, dq, dk, dv] on the CPU."""
    q, k, v, dout = (x.to(dev) for x in (q, k, v, dout))
    kw = {n: (x.to(dev) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    out, lse = torch.ops.attn_ext.attention_forward(q, k, v, False, **kw)
    grads = torch.ops.attn_ext.attention_backward(dout, q, k, v, out, lse, False, **kw)
    return [x.cpu() for x in (out, lse, *grads)]


def same_nonfinite_and_close(got, want, tol, names=("out", "lse", "dq", "dk", "dv")):
    """Each pair has NaN / inf at the same places with the same signs, and the finite values
    agree within tol relative to the largest of them."""
    for name, a, b in zip(names, got, want):
        a, b = a.double(), b.double()
        assert torch.equal(torch.isnan(a), torch.isnan(b)), name
        fin, inf = torch.isfinite(b), torch.isinf(b)
        assert torch.equal(fin, torch.isfinite(a)) and torch.equal(a[inf], b[inf]), name
        if fin.any():
            scale = max(1.0, b[fin].abs().max().item())
            assert (a[fin] - b[fin]).abs().max().item() <= tol * scale, name


def neg_inf_first_chunks(dev, Sk, inf_v=False):
    """fp32 (the simple CUDA kernels; Sk >= 512: split-KV): one query row whose visible scores
    are all -inf but the last key's (rel_bias [-inf, 0, -inf]: only distance 0, key Sk - 1, is
    finite), so every earlier 32-key chunk of the simple kernel sees only -inf. Its out is that
    key's v row, as on the CPU (the simple kernel made it NaN: exp2(-inf - -inf)). inf_v: an
    inf in the v row of key 10 (score -inf): 0 * inf = NaN in that column, as on the CPU (the
    split-KV merge skipped the chunk: max -inf, sum 0, and a finite column)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, S, 1, 8, generator=g) for S in (1, Sk, Sk))
    if inf_v:
        v[0, 10, 0, 2] = float("inf")
    dout = torch.randn(1, 1, 1, 8, generator=g)
    rel = torch.tensor([[float("-inf"), 0.0, float("-inf")]])
    got = op_fwd_bwd(dev, q, k, v, dout, rel_bias=rel)
    want = op_fwd_bwd("cpu", q, k, v, dout, rel_bias=rel)
    assert torch.isfinite(want[1]).all()
    if inf_v:  # (the forward only: the NaN row term then reaches every gradient of the row)
        assert torch.isnan(want[0][0, 0, 0, 2]) and torch.isfinite(want[0][0, 0, 0, :2]).all()
        got, want = got[:2], want[:2]
    else:
        assert torch.allclose(want[0][0, 0, 0], v[0, -1, 0])
    same_nonfinite_and_close(got, want, 1e-5)


@pytest.mark.parametrize("inf_v", [False, True])
@pytest.mark.parametrize("Sk", [64, 600])
def test_simple_kernels_neg_inf_scores_before_a_finite_one(Sk, inf_v, cuda):
    neg_inf_first_chunks(cuda, Sk, inf_v)


def rows_without_finite_scores(dev, dtype, D):
    """Every visible score -inf (rel_bias [[-inf]]: every distance clamps to its one entry):
    every row is a row without keys, out 0 and lse -inf, and every gradient 0, as on the CPU.
    The simple backward used to take P = exp2(s - lse) = exp2(-inf - -inf) = NaN there."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 70, 2, D, generator=g).to(dtype) for _ in range(3))
    dout = torch.randn(2, 70, 2, D, generator=g).to(dtype)
    rel = torch.full((2, 1), float("-inf"))
    got = op_fwd_bwd(dev, q, k, v, dout, rel_bias=rel)
    want = op_fwd_bwd("cpu", q, k, v, dout, rel_bias=rel)
    assert (want[1] == float("-inf")).all()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    assert all((x == 0).all() for x in want[:1] + want[2:])


@pytest.mark.parametrize("dtype,D", [(torch.float32, 64), (torch.float16, 96)], ids=str)
def test_rows_without_finite_scores_zero_grads_on_cuda(dtype, D, cuda):
    """fp32: the simple forward and backward; fp16 at D = 96: the fast forward, the simple
    backward (the fast one is built for D = 64 / 128 only)."""
    rows_without_finite_scores(cuda, dtype, D)


def dropped_key_nonfinite_v(dev):
    """Dropout with inf in the v row of one key: the rows that see it get 0 * inf = NaN where
    the key is dropped too (reference.py's probs * mask @ v, the CPU kernels, the fast CUDA
    kernels); the simple CUDA kernels used to skip dropped keys' rows and stay finite."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, S, 2, 16, generator=g) for S in (40, 50, 50))
    v[0, 17, 1, 3] = float("inf")
    dout = torch.randn(1, 40, 2, 16, generator=g)
    kw = dict(dropout_p=0.5, dropout_seed=99, dropout_offset=3)
    got = op_fwd_bwd(dev, q, k, v, dout, **kw)
    want = op_fwd_bwd("cpu", q, k, v, dout, **kw)
    keep = reference.dropout_keep_mask(99, 3, 1, 2, range(40), range(50), 0.5)
    kept, col = keep[0, 1, :, 17], want[0][0, :, 1, 3]
    assert not kept.all() and kept.any()
    assert torch.isinf(col[kept]).all() and torch.isnan(col[~kept]).all()  # dropped: 0 * inf
    same_nonfinite_and_close(got, want, 1e-5)


def test_simple_kernels_dropped_nonfinite_v_as_cpu(cuda):
    dropped_key_nonfinite_v(cuda)


def fp16_max_dropout(dev):
    """fp16, dropout_p = 1 - 2^-16 (the largest the ops take): a kept key with P ~ 1 weighs 65536
    P, past fp16's maximum, so the fast kernels must not pack the rescaled P to fp16 (they did:
    out and dv inf / NaN). Row i's own key dominates it (q_i = 40 k_i, k's rows of unit
    length); the seed is the first whose keep mask keeps some (i, i). v and dout are small, so
    the true out and dv fit fp16."""
    p = 1 - 2 ** -16
    seed = next(s for s in range(100000)
                if reference.dropout_keep_mask(s, 0, 1, 1, range(64), range(64), p)[0, 0].diagonal().any())
    g = torch.Generator().manual_seed(6)
    k = torch.nn.functional.normalize(torch.randn(1, 64, 1, 64, generator=g), dim=-1)
    q = 40 * k
    v = 0.01 * torch.randn(1, 64, 1, 64, generator=g)
    dout = 1e-3 * torch.randn(1, 64, 1, 64, generator=g)
    q, k, v, dout = (x.half() for x in (q, k, v, dout))
    kw = dict(dropout_p=p, dropout_seed=seed, dropout_offset=0)
    got = op_fwd_bwd(dev, q, k, v, dout, **kw)
    want = op_fwd_bwd("cpu", q, k, v, dout, **kw)
    i = int(reference.dropout_keep_mask(seed, 0, 1, 1, range(64), range(64), p)[0, 0].diagonal().nonzero()[0])
    assert want[0][0, i, 0].abs().max() > 10  # ~65536 v_i: the kept key's rescaled weight
    for x in got:
        assert torch.isfinite(x).all()
    same_nonfinite_and_close(got, want, 5e-3)
    return got


def test_fast_kernels_fp16_max_dropout_finite(cuda):
    if not (fast_fwd_fits(64) and fast_bwd_fits(64)):
        pytest.skip("the fast kernels' shared memory exceeds this device's limit")
    names = kernel_names(lambda: fp16_max_dropout(cuda))
    assert ran(names, "fa2_fwd_kernel") and ran(names, "fa2_bwd_kernel"), names


def empty_call_refusals(dev):
    """Calls with an empty q (B = 0, Sq = 0 or a packed Tq = 0) and a bad mask / window /
    block-position argument: the CUDA adapters returned the empty result before checking those
    arguments (the CPU refuses them first). Each must raise on dev as on the CPU."""
    lib = torch.ops.attn_ext
    bad = {  # the message each must raise
        "key_padding_mask must be": dict(key_padding_mask=torch.ones(3, 3)),
        "window must be": dict(window_left=-5),
        "q_start and k_start must be given together": dict(q_start=4),
        "sinks cannot be combined": dict(sinks=torch.zeros(2), q_start=0, k_start=0),
    }
    for shape in ((0, 4, 2, 8), (2, 0, 2, 8)):
        q = torch.randn(*shape)
        k = v = torch.randn(shape[0], 3, 2, 8)
        for name, kw in bad.items():
            if name.startswith("sinks") and shape[0] == 0:
                continue
            for d in ("cpu", dev):
                kwd = {n: (x.to(d) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
                with pytest.raises(RuntimeError, match=name):
                    lib.attention_forward(q.to(d), k.to(d), v.to(d), False, **kwd)
                if not name.startswith("sinks"):  # (the backward takes no sinks)
                    out = torch.empty(shape[0], shape[1], 2, 8, device=d)
                    lse = torch.empty(shape[0], 2, shape[1], device=d)
                    with pytest.raises(RuntimeError, match=name):
                        lib.attention_backward(out, q.to(d), k.to(d), v.to(d), out, lse, False, **kwd)
    # packed: Tq = 0, a bad window
    cu = torch.zeros(2, dtype=torch.int32)
    for d in ("cpu", dev):
        q = torch.randn(0, 2, 8, device=d)
        k = torch.randn(3, 2, 8, device=d)
        cuk = torch.tensor([0, 3], dtype=torch.int32, device=d)
        with pytest.raises(RuntimeError, match="window must be"):
            lib.attention_varlen_forward(q, k, k, cu.to(d), cuk, 0, 3, False, None, -5)
        out, lse = torch.empty(0, 2, 8, device=d), torch.empty(2, 0, device=d)
        with pytest.raises(RuntimeError, match="window must be"):
            lib.attention_varlen_backward(out, q, k, k, out, lse, cu.to(d), cuk, 0, 3, False,
                                          None, -5)


def test_empty_calls_refuse_bad_mask_arguments_on_cuda(cuda):
    empty_call_refusals(cuda)


# ---- the fast (tensor-core) backward --------------------------------------------------------


def fast_bwd_fits(D: int) -> bool:
    """The fast backward's shared memory (csrc/cuda/attention_launch.h bwd_smem_bytes) fits
    this device's opt-in limit (155 KiB at D = 128: not on sm_86 / sm_89 / sm_120)."""
    need = smem_bytes("bwd_smem_bytes", D)
    limit = _smem_optin()
    return limit is None or need <= limit


def bwd(dout, q, k, v, out, lse, causal, scale=None):
    return torch.ops.attn_ext.attention_backward(dout, q, k, v, out, lse, causal, scale)


def bwd_simple(monkeypatch, *args):
    with attn_ext.ops._simple_cuda_kernels():
        return bwd(*args)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fast_backward_vs_simple_vs_reference(shape, dtype, D, causal, cuda, monkeypatch):
    """The FA2-style backward (key tiles of 128, query tiles of 64, GQA walk, rows without
    keys) against float64 autograd through the reference (the tolerance rule of DESIGN.md,
    2x) and against the simple backward on the same inputs."""
    B, Sq, Sk, H, Hkv = shape
    q = randn(B, Sq, H, D, dtype=dtype, device=cuda)
    k = randn(B, Sk, Hkv, D, dtype=dtype, device=cuda)
    v = randn(B, Sk, Hkv, D, dtype=dtype, device=cuda)
    dout = randn(B, Sq, H, D, dtype=dtype, device=cuda)
    out, lse = fwd(q, k, v, causal)
    names = kernel_names(lambda: bwd(dout, q, k, v, out, lse, causal))
    if fast_bwd_fits(D):
        assert ran(names, "fa2_bwd_kernel"), names
    else:
        assert did_not_run(names, "fa2_bwd_kernel"), names
    grads = bwd(dout, q, k, v, out, lse, causal)
    simple = bwd_simple(monkeypatch, dout, q, k, v, out, lse, causal)
    _, *g64 = _grads(q, k, v, dout, causal, torch.float64)
    _, *glow = _grads(q, k, v, dout, causal, dtype)
    for name, ours, s_, r64, rlow in zip(("dq", "dk", "dv"), grads, simple, g64, glow):
        assert ours.dtype == dtype and ours.is_contiguous() and ours.shape == r64.shape
        assert torch.isfinite(ours).all(), f"{name}: not finite"
        assert_close_rule(ours, r64, rlow, name=f"fast {name}", factor=2.0)
        assert_close_rule(s_, r64, rlow, name=f"simple {name}", factor=2.0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
def test_fast_backward_long_and_strided(dtype, causal, cuda):
    """Many query tiles per key tile (both Q/dO buffers cycle), a packed-QKV layout (strided
    heads) and a non-contiguous dout; custom scale."""
    B, S, H, D = 2, 700, 4, 64
    qkv = randn(B, S, 3 * H * D, dtype=dtype, device=cuda)
    q, k, v = qkv.view(B, S, 3, H, D).unbind(2)
    dout = randn(B, H, S, D, dtype=dtype, device=cuda).transpose(1, 2)  # strided rows
    scale = 0.3
    out, lse = fwd(q, k, v, causal, scale)
    names = kernel_names(lambda: bwd(dout, q, k, v, out, lse, causal, scale))
    assert ran(names, "fa2_bwd_kernel"), names
    grads = bwd(dout, q, k, v, out, lse, causal, scale)

    def ref_grads(dt):
        qq, kk, vv = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o, _ = reference.attention_with_lse(qq, kk, vv, causal, scale)
        o.backward(dout.to(dt))
        return qq.grad, kk.grad, vv.grad

    for name, ours, r64, rlow in zip(("dq", "dk", "dv"), grads, ref_grads(torch.float64),
                                     ref_grads(dtype)):
        assert_close_rule(ours, r64, rlow, name=name, factor=2.0)


@pytest.mark.parametrize("D", [64, 128])
def test_fast_backward_dispatch(D, cuda, monkeypatch):
    """bf16 with D in {64, 128} and 16-byte aligned rows -> fa2_bwd_kernel (where its shared
    memory fits the device); a misaligned dout or _simple_cuda_kernels() -> the simple
    kernels; all give the same gradients."""
    if not fast_bwd_fits(D):
        pytest.skip(f"the fast backward's shared memory at D={D} exceeds this device's limit")
    q, k, v, dout = [randn(1, 150, 2, D, dtype=torch.bfloat16, device=cuda) for _ in range(4)]
    out, lse = fwd(q, k, v, True)
    names = kernel_names(lambda: bwd(dout, q, k, v, out, lse, True))
    assert ran(names, "fa2_bwd_kernel") and did_not_run(names, "simple_bwd"), names
    fast = bwd(dout, q, k, v, out, lse, True)
    buf = torch.empty(dout.numel() + 1, dtype=dout.dtype, device=cuda)
    dout_mis = buf[1:].view_as(dout).copy_(dout)  # one element off 16-byte alignment
    names = kernel_names(lambda: bwd(dout_mis, q, k, v, out, lse, True))
    assert ran(names, "simple_bwd") and did_not_run(names, "fa2_bwd_kernel"), names
    slow = bwd(dout_mis, q, k, v, out, lse, True)
    for a, b in zip(fast, slow):
        assert max_err(a, b) <= 2.0 ** -5
    simple = bwd_simple(monkeypatch, dout, q, k, v, out, lse, True)
    for a, b in zip(fast, simple):
        assert max_err(a, b) <= 2.0 ** -5


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "simple"])
def test_nan_propagates_on_cuda(fast, cuda, simple_kernels):
    """A NaN in one query row makes exactly that row's output and lse NaN (not 0, not -inf),
    as on the CPU; a NaN in a key reaches the rows that see it."""
    q, k, v = [randn(1, 80, 2, 64, dtype=torch.bfloat16, device=cuda) for _ in range(3)]
    if not fast:
        simple_kernels()
    names = kernel_names(lambda: fwd(q, k, v, True))
    assert ran(names, "fa2_fwd_kernel" if fast else "simple_fwd_kernel"), names
    clean = nan_query_row_only(q, k, v, True, 0, 5, 1)
    kb = k.clone()
    kb[0, 40, 0, 0] = float("nan")
    out = fwd(q, kb, v, True)[0]
    assert torch.isnan(out[0, 40:, 0]).all()
    assert torch.isfinite(out[0, :40, 0]).all() and torch.isfinite(out[0, :, 1]).all()


# ---- attn_ext.explain agrees with the kernels that run -----------------------------------------

_EXPLAINED_KERNEL = {"cuda.fa2": "fa2_fwd_kernel", "cuda.simple": "simple_fwd_kernel",
                     "cuda.split_kv": "simple_fwd_split_kernel"}


@pytest.mark.parametrize("case", ["fast", "fp32", "odd_dim", "misaligned", "decode"])
def test_explain_matches_the_profiled_kernel(case, cuda):
    D, dtype, Sq, Sk = 64, torch.bfloat16, 150, 150
    if case == "fp32":
        dtype = torch.float32
    if case == "odd_dim":
        D = 80
    if case == "decode":
        Sq, Sk = 1, 4096
    q = randn(1, Sq, 2, D, dtype=dtype, device=cuda)
    k = randn(1, Sk, 2, D, dtype=dtype, device=cuda)
    v = randn(1, Sk, 2, D, dtype=dtype, device=cuda)
    if case == "misaligned":
        q = torch.empty(q.numel() + 1, dtype=dtype, device=cuda)[1:].view_as(q).copy_(q)
    choice = attn_ext.explain(q, k, v, causal=True)
    names = kernel_names(lambda: fwd(q, k, v, True))
    want = _EXPLAINED_KERNEL[choice.forward]
    assert ran(names, want), (str(choice), names)
    for other in set(_EXPLAINED_KERNEL.values()) - {want}:
        assert did_not_run(names, other), (str(choice), names)
    if case == "fast" and fast_fwd_fits(D):
        assert choice.forward == "cuda.fa2", str(choice)
    if case in ("fp32", "odd_dim", "misaligned"):
        assert choice.forward == "cuda.simple", str(choice)
    dout = torch.randn_like(fwd(q, k, v, True)[0])
    out, lse = fwd(q, k, v, True)
    choice = attn_ext.explain(q, k, v, causal=True, dout=dout)
    names = kernel_names(lambda: bwd(dout, q, k, v, out, lse, True))
    assert ran(names, "fa2_bwd_kernel" if choice.backward == "cuda.fa2" else "simple_bwd"), (str(choice), names)


# ---- masks (issue 14), lse gradient and masked non-finite values (issue 18) ---------------


def _masked_case(fn_ours, fn_ref, inputs, dtype):
    """Values, lse and gradients (loss on out and lse) on CUDA vs the float64 CPU reference."""
    ts = [t.to("cuda", dtype).requires_grad_() for t in inputs]
    out, lse = fn_ours(*ts)
    dout = torch.randn(out.shape, dtype=torch.float64)
    dlse = torch.randn(lse.shape, dtype=torch.float64)
    fin = lambda l: l.masked_fill(torch.isneginf(l), 0.0)  # noqa: E731
    loss = (out.double().cpu() * dout).sum() + (fin(lse).double().cpu() * dlse).sum()
    got = [out, lse] + list(torch.autograd.grad(loss, ts))
    rs = [t.detach().double().requires_grad_() for t in inputs]
    rout, rlse = fn_ref(*rs)
    rloss = (rout * dout).sum() + (fin(rlse) * dlse).sum()
    want = [rout, rlse] + list(torch.autograd.grad(rloss, rs))
    lows = [t.detach().to(dtype).requires_grad_() for t in inputs]
    lout, llse = fn_ref(*lows)
    lloss = (lout.double() * dout).sum() + (fin(llse).double() * dlse).sum()
    low = [lout, llse] + list(torch.autograd.grad(lloss, lows))
    for name, a, r, lo in zip(["out", "lse", "dq", "dk", "dv"], got, want, low):
        assert_close_rule(a.detach().cpu(), r.detach(), lo.detach(), name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window,padded", [((30, 0), False), (None, True), ((40, 5), True)])
def test_masks_on_cuda(dtype, window, padded, cuda):
    B, Sq, Sk, H, Hkv, D = 2, 150, 170, 4, 2, 64
    inputs = [randn(B, Sq, H, D), randn(B, Sk, Hkv, D), randn(B, Sk, Hkv, D)]
    kpm = (torch.rand(B, Sk) > 0.3) if padded else None
    _masked_case(
        lambda q, k, v: attn_ext.attention(q, k, v, causal=True, window=window, return_lse=True,
                                           key_padding_mask=None if kpm is None else kpm.cuda()),
        lambda q, k, v: reference.attention_with_lse(q, k, v, True, None, window, kpm),
        inputs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_on_cuda(dtype, cuda):
    cu_q = torch.tensor([0, 40, 40, 170], dtype=torch.int32)
    cu_k = torch.tensor([0, 55, 60, 200], dtype=torch.int32)
    inputs = [randn(170, 4, 64), randn(200, 2, 64), randn(200, 2, 64)]
    _masked_case(
        lambda q, k, v: attn_ext.attention_varlen(q, k, v, cu_q.cuda(), cu_k.cuda(), 130, 140,
                                                  causal=True, window=(50, 0), return_lse=True),
        lambda q, k, v: reference.attention_varlen_with_lse(q, k, v, cu_q, cu_k, True, None, (50, 0)),
        inputs, dtype)


@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
@pytest.mark.parametrize("simple", [False, True])
def test_masked_nonfinite_value_stays_out_issue18(dtype, simple, cuda, monkeypatch):
    """causal, S = 80, v[0, 40] = inf: rows 0-39 (which cannot see key 40) stay finite and
    equal the clean result, on the fast forward (the diagonal tile) and the simple kernel."""
    q, k, v = [randn(1, 80, 2, 64, dtype=dtype, device="cuda") for _ in range(3)]
    run = (lambda *a: fwd_simple(monkeypatch, *a)) if simple else fwd
    clean = run(q, k, v, True)[0]
    v[0, 40, 0, :] = float("inf")
    k[0, 41, 1, 3] = float("nan")
    out = run(q, k, v, True)[0]
    assert torch.isfinite(out[0, :40]).all()
    assert max_err(out[0, :40], clean[0, :40]) <= 2e-2
    assert not torch.isfinite(out[0, 41:, 0]).all(-1).any()


def test_lse_gradient_on_cuda(cuda):
    q, k, v = [randn(1, 37, 2, 64, dtype=torch.float32, device="cuda").requires_grad_() for _ in range(3)]
    out, lse = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    g = torch.autograd.grad(lse.sum() + out.sum(), (q, k, v))
    rs = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ro, rl = reference.attention_with_lse(*rs, True)
    rg = torch.autograd.grad(rl.sum() + ro.sum(), rs)
    for a, b in zip(g, rg):
        assert max_err(a.cpu(), b) < 1e-4


def test_func_grad_on_cuda_matches_eager(cuda):
    """torch.func.grad / vmap(grad) through the CUDA kernels (the transform path of the ops'
    autograd kernel, tests/test_func_transforms.py on CPU): the same gradients as backward()."""
    q, k, v = [randn(3, 37, 2, 64, dtype=torch.float32, device="cuda") for _ in range(3)]

    def loss(q, k, v):
        return attn_ext.attention(q, k, v, causal=True).square().sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(loss(*ts), ts)
    for a, b in zip(got, want):
        assert max_err(a, b) <= 1e-5
    per_sample = torch.func.vmap(torch.func.grad(
        lambda q, k, v: loss(q[None], k[None], v[None])))(q, k, v)
    for b in range(3):
        x = q[b:b + 1].clone().requires_grad_()
        (g,) = torch.autograd.grad(loss(x, k[b:b + 1], v[b:b + 1]), x)
        assert max_err(per_sample[b], g[0]) <= 1e-5


# ---- the fast kernels with masks (issue 14 item 8, issue 18 item 4) ----------------------------
# Window, key padding and packed sequences on fa2_fwd_kernel / fa2_bwd_kernel (the profiler
# must show that they ran: an empty profile fails), against the float64 reference: values, lse
# and dq / dk / dv of a loss on out AND lse (the fast backward folds dlse into delta), by
# DESIGN.md's low-precision rule (2x the reference's own error in that dtype).


def _fast_fits_or_skip(D: int) -> None:
    if not fast_fwd_fits(D):
        pytest.skip(f"the fast forward's shared memory at D={D} exceeds this device's limit")


def _grads_of(fn, inputs, dtype, dout, dlse):
    """[out, lse, dq, dk, dv] of fn on the inputs cast to dtype (on their device); the loss
    uses out and lse (lse -inf rows contribute 0)."""
    ts = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out, lse = fn(*ts)
    fin = lse.masked_fill(torch.isinf(lse), 0.0)
    loss = (out.double() * dout).sum() + (fin.double() * dlse).sum()
    return [out.detach(), lse.detach()] + [g.detach() for g in torch.autograd.grad(loss, ts)]


def _check_fast_masked(ours_fn, ref_fn, inputs, dtype, D, name):
    """Runs ours_fn (fwd + bwd) under the profiler: fa2_fwd_kernel (and fa2_bwd_kernel where
    its shared memory fits) must have run, the simple kernels not; then every output against
    the float64 reference by the 2x rule."""
    with torch.no_grad():
        out0, lse0 = ours_fn(*[t.to(dtype) for t in inputs])
    dout = torch.randn(out0.shape, dtype=torch.float64, device=out0.device)
    dlse = torch.randn(lse0.shape, dtype=torch.float64, device=out0.device)
    box = []
    names = kernel_names(lambda: box.append(_grads_of(ours_fn, inputs, dtype, dout, dlse)))
    assert ran(names, "fa2_fwd_kernel") and did_not_run(names, "simple_fwd"), (name, names)
    if fast_bwd_fits(D):
        assert ran(names, "fa2_bwd_kernel") and did_not_run(names, "simple_bwd"), (name, names)
    ours = box[0]
    ref64 = _grads_of(ref_fn, inputs, torch.float64, dout, dlse)
    low = _grads_of(ref_fn, inputs, dtype, dout, dlse)
    assert torch.equal(torch.isneginf(ours[1]), torch.isneginf(ref64[1])), f"{name}: -inf rows"
    for what, a, r, lo in zip(("out", "lse", "dq", "dk", "dv"), ours, ref64, low):
        assert a.shape == r.shape, (name, what)
        ok = ~torch.isnan(a) if what == "lse" else torch.isfinite(a)
        assert ok.all(), f"{name} {what}: non-finite value"
        assert_close_rule(a, r, lo, name=f"{name} {what}", factor=2.0)
    return ours, ref64


# (causal, window, padding, Sq, Sk): band alone, band + padding, padding alone; windows
# narrower than a key tile (many invisible tiles), bidirectional windows; Sq == Sk with left
# padding gives rows that see only padded keys inside a batch row that has others
MASK_CASES = [
    (True, (30, 0), None, 150, 400),
    (False, (40, 5), None, 150, 400),
    (False, (7, 70), None, 300, 170),
    (True, None, "left", 300, 300),
    (True, (50, 0), "random", 150, 400),
    (False, None, "right", 150, 400),
    (False, (20, 20), "random", 300, 300),
]


def _padding(kind, B, Sk, gen):
    if kind is None:
        return None
    if kind == "random":
        kpm = torch.rand(B, Sk, generator=gen) > 0.3
    else:  # left / right padding, a different length per batch row; row 1 fully padded
        lengths = [Sk - 70, 0] + [Sk // 2] * (B - 2)
        pos = torch.arange(Sk)
        kpm = torch.stack([(pos >= Sk - n) if kind == "left" else (pos < n) for n in lengths])
    kpm[1] = False  # a batch row whose every key is padded: its rows see nothing
    return kpm


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
@pytest.mark.parametrize("case", MASK_CASES,
                         ids=lambda c: f"causal{int(c[0])}-w{c[1]}-pad{c[2]}-{c[3]}x{c[4]}")
class TestFastMasked:
    def test_batched(self, case, dtype, D, cuda):
        _fast_fits_or_skip(D)
        causal, window, pad, Sq, Sk = case
        gen = torch.Generator().manual_seed(1000 * D + MASK_CASES.index(case))
        B, H, Hkv = 3, 4, 2
        inputs = [randn(B, Sq, H, D, device=cuda), randn(B, Sk, Hkv, D, device=cuda),
                  randn(B, Sk, Hkv, D, device=cuda)]
        kpm = _padding(pad, B, Sk, gen)
        kpm_dev = None if kpm is None else kpm.to(cuda)
        ours, _ = _check_fast_masked(
            lambda q, k, v: attn_ext.attention(q, k, v, causal=causal, window=window,
                                               key_padding_mask=kpm_dev, return_lse=True),
            lambda q, k, v: reference.attention_with_lse(q, k, v, causal, None, window, kpm_dev),
            inputs, dtype, D, f"batched {case}")
        if kpm is not None:  # the fully padded batch row: out 0, lse -inf, gradients 0
            out, lse, dq, dk, dv = ours
            assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
            assert torch.all(dq[1] == 0) and torch.all(dk[1] == 0) and torch.all(dv[1] == 0)
            # padded keys get no gradient
            assert torch.all(dk[~kpm_dev] == 0) and torch.all(dv[~kpm_dev] == 0)

    def test_varlen(self, case, dtype, D, cuda):
        """Packed sequences with empty ones (no rows, no keys, rows without keys), Sq != Sk
        per sequence, GQA; the window and causal per sequence (padding does not apply)."""
        _fast_fits_or_skip(D)
        causal, window = case[0], case[1]
        lq = [0, 64, 0, 136, 1, 9, 70]
        lk = [10, 64, 0, 226, 1, 0, 200]
        cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
        Tq, Tk, H, Hkv = int(cu_q[-1]), int(cu_k[-1]), 4, 2
        inputs = [randn(Tq, H, D, device=cuda), randn(Tk, Hkv, D, device=cuda),
                  randn(Tk, Hkv, D, device=cuda)]
        cq, ck = cu_q.to(cuda), cu_k.to(cuda)
        ours, _ = _check_fast_masked(
            lambda q, k, v: attn_ext.attention_varlen(q, k, v, cq, ck, max(lq), max(lk),
                                                      causal=causal, window=window,
                                                      return_lse=True),
            lambda q, k, v: reference.attention_varlen_with_lse(q, k, v, cq, ck, causal, None,
                                                                window),
            inputs, dtype, D, f"varlen {case}")
        out, lse = ours[0], ours[1]
        rows = slice(int(cu_q[5]), int(cu_q[6]))  # sequence 5: 9 rows, no key
        assert torch.all(out[rows] == 0) and torch.all(torch.isneginf(lse[:, rows]))
        assert torch.all(ours[2][rows] == 0)


def _fast_fwd_bwd(q, k, v, dout, **kw):
    """out, lse, dq, dk, dv of attn_ext.attention with a loss on out only, and the kernel set."""
    ts = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    box = []

    def run():
        out, lse = attn_ext.attention(*ts, return_lse=True, **kw)
        box.append([out.detach(), lse.detach()] + list(torch.autograd.grad(out, ts, dout)))

    names = kernel_names(run)
    return box[0], names


@pytest.mark.parametrize("terms", ["plain", "softcap+alibi+rel"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
def test_fast_nonfinite_at_padded_keys_stays_out(dtype, D, terms, cuda):
    """inf / NaN / -inf in k and v at padded keys (and at keys outside every row's window)
    change nothing: out, lse, dq, dk, dv equal the run with finite values there (forward and
    backward on the fast kernels; issue 18 item 4), also through the score-term instances
    (a NaN score's softcap chain factor at a hidden pair must not reach dS)."""
    _fast_fits_or_skip(D)
    H_ = 2
    term_kw = {} if terms == "plain" else dict(
        softcap=5.0, alibi_slopes=torch.tensor([0.3, 0.1], device=cuda),
        rel_bias=randn(H_, 2 * 20 + 1, device=cuda))
    B, S, H = 2, 300, 2
    q, k, v, dout = [randn(B, S, H, D, dtype=dtype, device=cuda) for _ in range(4)]
    kpm = torch.ones(B, S, dtype=torch.bool, device=cuda)
    bad_keys = [3, 77, 140, 200, 201, 299]
    kpm[:, bad_keys] = False
    kb, vb = k.clone(), v.clone()
    kb[0, 3] = float("-inf")
    vb[0, 77] = float("inf")
    kb[1, 140, 1, 5] = float("nan")
    vb[1, 200, :, 7] = float("nan")
    kb[0, 201, 0, :] = float("inf")
    vb[0, 299] = float("-inf")
    for causal, window in ((True, None), (False, (60, 60))):
        clean, names = _fast_fwd_bwd(q, k, v, dout, causal=causal, window=window,
                                     key_padding_mask=kpm, **term_kw)
        assert ran(names, "fa2_fwd_kernel"), names
        if fast_bwd_fits(D):
            assert ran(names, "fa2_bwd_kernel"), names
        dirty, _ = _fast_fwd_bwd(q, kb, vb, dout, causal=causal, window=window,
                                 key_padding_mask=kpm, **term_kw)
        for what, a, c in zip(("out", "lse", "dq", "dk", "dv"), dirty, clean):
            fin = torch.isfinite(a) | (torch.isneginf(a) & torch.isneginf(c))
            assert fin.all(), f"{what}: a hidden non-finite value leaked (causal={causal})"
            tol = 2e-2 * max(1.0, float(c.float().abs().max()))
            assert max_err(a.float(), c.float()) <= tol, (what, causal)
        assert torch.all(dirty[3][:, bad_keys] == 0) and torch.all(dirty[4][:, bad_keys] == 0)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
def test_fast_nonfinite_rows_and_keys_causal(dtype, D, cuda):
    """Causal, S = 200 (several tiles, the bad values inside diagonal tiles): v and k of key 100
    non-finite -> rows 0-99 (which cannot see it) keep their out, lse and dq; dout and q of row
    50 non-finite -> keys 51-199 (which row 50 cannot see) keep their dk and dv."""
    _fast_fits_or_skip(D)
    B, S, H = 1, 200, 2
    q, k, v, dout = [randn(B, S, H, D, dtype=dtype, device=cuda) for _ in range(4)]
    clean, names = _fast_fwd_bwd(q, k, v, dout, causal=True)
    assert ran(names, "fa2_fwd_kernel"), names
    if fast_bwd_fits(D):
        assert ran(names, "fa2_bwd_kernel"), names
    kb, vb = k.clone(), v.clone()
    vb[0, 100] = float("inf")
    kb[0, 100, 0, 3] = float("nan")
    dirty, _ = _fast_fwd_bwd(q, kb, vb, dout, causal=True)
    for what, idx in (("out", 0), ("dq", 2)):
        a, c = dirty[idx][0, :100], clean[idx][0, :100]
        assert torch.isfinite(a).all(), f"{what}: key 100 leaked into rows it cannot reach"
        assert max_err(a.float(), c.float()) <= 2e-2 * max(1.0, float(c.float().abs().max())), what
    assert torch.isfinite(dirty[1][0, :, :100]).all()
    assert max_err(dirty[1][0, :, :100], clean[1][0, :, :100]) <= 1e-2
    assert not torch.isfinite(dirty[0][0, 100:]).all()  # rows that see key 100 do see it
    qb, db = q.clone(), dout.clone()
    qb[0, 50, 1, 0] = float("nan")
    db[0, 50, 0, :] = float("inf")
    dirty, _ = _fast_fwd_bwd(qb, k, v, db, causal=True)
    for what, idx in (("dk", 3), ("dv", 4)):
        a, c = dirty[idx][0, 51:], clean[idx][0, 51:]
        assert torch.isfinite(a).all(), f"{what}: row 50 leaked into keys it cannot see"
        assert max_err(a.float(), c.float()) <= 2e-2 * max(1.0, float(c.float().abs().max())), what


def test_fast_varlen_bad_cu_seqlens_device_assert(cuda, tmp_path):
    """Non-monotone / out-of-range cu_seqlens on CUDA are never read past the tensors: the
    kernels' Visibility::seq(b) device-asserts (the op does not synchronise to check on the
    host). A device assert poisons the CUDA context, so each case runs in a subprocess and
    must fail with the assertion's message."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cases = {"non-monotone": "[0, 50, 30, 100]", "past the end": "[0, 50, 100, 5000]",
             "longer than max_seqlen": "[0, 10, 20, 100]"}
    for name, cu in cases.items():
        code = (
            "import torch, attn_ext\n"
            "q = torch.randn(100, 2, 64, device='cuda', dtype=torch.bfloat16)\n"
            f"cu = torch.tensor({cu}, dtype=torch.int32, device='cuda')\n"
            "out = attn_ext.attention_varlen(q, q, q, cu, cu, 50, 50, causal=True)\n"
            "torch.cuda.synchronize()\n"
            "print('NO ERROR')\n")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             cwd=root, timeout=120,
                             env=dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", "")))
        text = res.stdout + res.stderr
        assert res.returncode != 0 and "NO ERROR" not in text, (name, text[-2000:])
        assert "cu_seqlens_q / cu_seqlens_k must start at 0" in text, (name, text[-2000:])


def test_varlen_cu_seqlens_refuted_by_sizes_on_cuda(cuda):
    """What the sizes alone refute is refused on the host, without reading cu_seqlens (no
    sync): max_seqlen 0 with packed rows (no kernel row would run, so nothing would assert
    and out / lse would stay unwritten), N sequences too short for the packed rows, and 0
    sequences with packed rows."""
    q = torch.randn(10, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32, device="cuda")
    for mq, mk, name in ((0, 5, "max_seqlen_q"), (5, 0, "max_seqlen_k"), (4, 5, "max_seqlen_q"),
                         (5, 4, "max_seqlen_k")):
        with pytest.raises(RuntimeError, match=f"{name} = {min(mq, mk)} is smaller than the longest"):
            attn_ext.attention_varlen(q, q, q, cu, cu, mq, mk)
    none = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="cu_seqlens_q has 0 sequences"):
        attn_ext.attention_varlen(q, q, q, none, none, 5, 5)
    out = attn_ext.attention_varlen(q, q, q, cu, cu, 5, 5)  # the tight bound is fine
    assert out.shape == q.shape and torch.isfinite(out).all()
# ---- score terms on CUDA (issue 15): softcap, ALiBi, rel_bias, sinks, dropout ---------------
# The simple kernels (and the split-KV decode path) take every term through ScoreTerms /
# dropout_rng.h; the fast forward takes all of them (its kTerms instances), the fast
# backward softcap, ALiBi and rel_bias (its kTerms instances; d rel_bias by fp32 atomics, the
# simple kernels' deterministic passes under deterministic mode; sinks reach it through lse),
# and dropout at D = 64 only (bwd_fast_dropout_head_dim in attention_launch.h).
# Values, lse and every gradient (d rel_bias, d sinks included) against the float64 CPU
# reference (tests/reference_checks.check_against_reference: float64 to 1e-9, low precision
# by DESIGN.md's rule); dropout's keep bits equal the CPU kernel's and reference.py's bit for
# bit.

from attn_ext import ops as _ops  # noqa: E402
from attn_ext.position_bias import alibi_slopes as _alibi_slopes  # noqa: E402
from tests.reference_checks import check_against_reference  # noqa: E402

TERM_KINDS = ["rel", "alibi", "alibi_batch", "softcap", "sinks", "rel+alibi+softcap+sinks"]
TERM_MASKS = {"none": (False, None, False), "causal": (True, None, False),
              "window+padding": (True, (40, 5), True)}


def _term_tables(kind, B, H, M=9):
    """(alibi_slopes, rel_bias, softcap, sinks) on the CPU for a named combination."""
    alibi = rel = cap = sinks = None
    if "alibi" in kind:
        alibi = _alibi_slopes(H) if "batch" not in kind else torch.rand(B, H) * 0.5
    if "rel" in kind:
        rel = randn(H, 2 * M + 1, dtype=torch.float64)
    if "softcap" in kind:
        cap = 4.0
    if "sinks" in kind:
        sinks = randn(H, dtype=torch.float64)
    return alibi, rel, cap, sinks


def _on_cuda(fn):
    """fn's CUDA call on CPU tensors: inputs moved to the GPU (differentiably), outputs back."""
    def wrapped(*ts):
        outs = fn(*[None if t is None else t.cuda() for t in ts])
        return tuple(o.cpu() for o in outs)
    return wrapped


def _names(rel, sinks):
    return ["dq", "dk", "dv"] + (["drel_bias"] if rel is not None else []) + (
        ["dsinks"] if sinks is not None else [])


class TestScoreTermsCuda:
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("mask", list(TERM_MASKS))
    @pytest.mark.parametrize("kind", TERM_KINDS)
    def test_terms_vs_reference(self, kind, mask, dtype, cuda):
        """Each term alone and all together, with no mask, causal, and a window with key
        padding (a fully padded batch row: with sinks its rows have lse = the sink); D = 64,
        GQA, Sq != Sk. bf16 takes the fast forward and the fast backward (their kTerms
        instances); float32 / float64 the simple kernels (as attention.cu dispatches)."""
        B, Sq, Sk, H, Hkv, D = 2, 70, 90, 4, 2, 64
        causal, window, padded = TERM_MASKS[mask]
        alibi, rel, cap, sinks = _term_tables(kind, B, H)
        kpm = None
        if padded:
            kpm = torch.rand(B, Sk) > 0.3
            kpm[0] = False
        q, k, v = randn(B, Sq, H, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype)
        rel = None if rel is None else rel.to(dtype)
        sinks = None if sinks is None else sinks.to(dtype)

        @_on_cuda
        def ours(q, k, v, rel, sinks):
            return attn_ext.attention(
                q, k, v, causal=causal, window=window, return_lse=True,
                key_padding_mask=None if kpm is None else kpm.cuda(),
                alibi_slopes=None if alibi is None else alibi.cuda(), rel_bias=rel, softcap=cap,
                sinks=sinks)

        def ref(q, k, v, rel, sinks):
            a = None if alibi is None else alibi.to(q.dtype)
            return reference.attention_with_lse(q, k, v, causal, None, window, kpm, a, rel, cap, sinks)

        check_against_reference(ours, ref, [q, k, v, rel, sinks], _names(rel, sinks))

    @pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("causal,window", [(False, None), (True, (30, 0))])
    def test_varlen_terms(self, dtype, causal, window, cuda):
        """Packed sequences (one empty query sequence, (N, H) slopes: a row per sequence)."""
        H, Hkv, D, Dv = 4, 2, 32, 48
        lq, lk = [37, 0, 120, 9], [50, 7, 133, 9]
        cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
        q = randn(sum(lq), H, D, dtype=dtype)
        k, v = randn(sum(lk), Hkv, D, dtype=dtype), randn(sum(lk), Hkv, Dv, dtype=dtype)
        alibi = torch.rand(len(lq), H) * 0.3
        rel = randn(H, 2 * 17 + 1, dtype=dtype)
        sinks = randn(H, dtype=dtype)

        @_on_cuda
        def ours(q, k, v, rel, sinks):
            return attn_ext.attention_varlen(q, k, v, cu_q.cuda(), cu_k.cuda(), max(lq), max(lk),
                                             causal=causal, window=window, alibi_slopes=alibi.cuda(),
                                             rel_bias=rel, softcap=7.0, sinks=sinks, return_lse=True)

        def ref(q, k, v, rel, sinks):
            return reference.attention_varlen_with_lse(q, k, v, cu_q, cu_k, causal, None, window,
                                                       alibi.to(q.dtype), rel, 7.0, sinks)

        check_against_reference(ours, ref, [q, k, v, rel, sinks], _names(rel, sinks))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("kind", ["rel+alibi+softcap+sinks", "alibi_batch"])
    def test_split_kv_decode_terms(self, kind, dtype, cuda):
        """Decode shapes take the split-KV path with the terms (sinks in the merge)."""
        B, Sq, Sk, H, Hkv, D = 1, 2, 1500, 2, 1, 64
        alibi, rel, cap, sinks = _term_tables(kind, B, H, M=300)
        q, k, v = randn(B, Sq, H, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype)
        rel = None if rel is None else rel.to(dtype)
        sinks = None if sinks is None else sinks.to(dtype)
        kw = dict(alibi_slopes=None if alibi is None else alibi.cuda(), softcap=cap)
        qc, kc_, vc = q.cuda(), k.cuda(), v.cuda()
        names = kernel_names(lambda: attn_ext.attention(
            qc, kc_, vc, causal=True, rel_bias=None if rel is None else rel.cuda(),
            sinks=None if sinks is None else sinks.cuda(), **kw))
        assert ran(names, "simple_fwd_split_kernel") and ran(names, "simple_fwd_combine_kernel"), names
        assert did_not_run(names, "fa2_fwd_kernel"), names

        @_on_cuda
        def ours(q, k, v, rel, sinks):
            return attn_ext.attention(q, k, v, causal=True, rel_bias=rel, sinks=sinks,
                                      return_lse=True, **kw)

        def ref(q, k, v, rel, sinks):
            a = None if alibi is None else alibi.to(q.dtype)
            return reference.attention_with_lse(q, k, v, True, None, None, None, a, rel, cap, sinks)

        check_against_reference(ours, ref, [q, k, v, rel, sinks], _names(rel, sinks))

    def test_sinks_row_without_keys(self, cuda):
        """A row that sees no key: out 0, lse = its sink logit exactly (as on the CPU)."""
        H = 3
        q, k = randn(2, 8, H, 16, device=cuda), randn(2, 5, H, 16, device=cuda)
        sinks = randn(H, device=cuda)
        kpm = torch.ones(2, 5, dtype=torch.bool, device=cuda)
        kpm[1] = False
        for split in (False, True):
            kk = k if not split else randn(2, 600, H, 16, device=cuda)
            m = kpm if not split else torch.ones(2, 600, dtype=torch.bool, device=cuda)
            if split:
                m[1] = False
            out, lse = attn_ext.attention(q, kk, kk, causal=True, key_padding_mask=m, sinks=sinks,
                                          return_lse=True)
            assert torch.equal(out[1], torch.zeros_like(out[1]))
            assert torch.equal(lse[1], sinks[:, None].expand(H, 8))
            if not split:  # causal, Sq > Sk: rows 0..2 of batch 0 see nothing
                assert torch.equal(out[0, :3], torch.zeros_like(out[0, :3]))
                assert torch.equal(lse[0, :, :3], sinks[:, None].expand(H, 3))

    @pytest.mark.parametrize("D", [64, 128])
    @pytest.mark.parametrize("mask", list(TERM_MASKS))
    @pytest.mark.parametrize("kind,dtype", [("softcap", torch.bfloat16), ("alibi", torch.bfloat16),
                                            ("alibi_batch", torch.float16), ("rel", torch.bfloat16),
                                            ("rel+alibi+softcap+sinks", torch.bfloat16),
                                            ("rel+alibi+softcap+sinks", torch.float16)], ids=str)
    def test_fast_backward_terms(self, kind, dtype, mask, D, cuda):
        """softcap / ALiBi / rel_bias (and sinks) on fa2_bwd_kernel's kTerms instances: the
        kernel that ran, and every gradient, d rel_bias included (shared-memory sums per CTA,
        then fp32 atomics), against the float64 reference (tile-crossing shapes, GQA, Sq != Sk,
        every mask mode; M = 9 clamps most distances, M = 300 none)."""
        if not fast_bwd_fits(D):
            pytest.skip(f"the fast backward's shared memory at D={D} exceeds this device's limit")
        B, Sq, Sk, H, Hkv = 2, 150, 200, 4, 2
        causal, window, padded = TERM_MASKS[mask]
        alibi, rel, cap, sinks = _term_tables(kind, B, H, M=9 if mask != "none" else 300)
        kpm = None
        if padded:
            kpm = torch.rand(B, Sk) > 0.3
            kpm[0, :50] = False
        q, k, v = randn(B, Sq, H, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype)
        rel = None if rel is None else rel.to(dtype)
        sinks = None if sinks is None else sinks.to(dtype)
        kw = dict(causal=causal, window=window, key_padding_mask=None if kpm is None else kpm.cuda(),
                  alibi_slopes=None if alibi is None else alibi.cuda(), softcap=cap)
        qc, kc_, vc = (t.cuda().requires_grad_() for t in (q, k, v))
        relc = None if rel is None else rel.cuda()
        sinkc = None if sinks is None else sinks.cuda()
        choice = attn_ext.explain(qc, kc_, vc, causal=causal, alibi_slopes=kw["alibi_slopes"],
                                  rel_bias=relc, softcap=cap, sinks=sinkc)
        assert choice.backward == "cuda.fa2", str(choice)
        out = attn_ext.attention(qc, kc_, vc, rel_bias=relc, sinks=sinkc, **kw)
        names = kernel_names(lambda: out.backward(torch.ones_like(out), retain_graph=True))
        assert ran(names, "fa2_bwd_kernel") and did_not_run(names, "simple_bwd"), names

        @_on_cuda
        def ours(q, k, v, rel, sinks):
            return attn_ext.attention(q, k, v, rel_bias=rel, sinks=sinks, return_lse=True, **kw)

        def ref(q, k, v, rel, sinks):
            a = None if alibi is None else alibi.to(q.dtype)
            return reference.attention_with_lse(q, k, v, causal, None, window, kpm, a, rel, cap, sinks)

        check_against_reference(ours, ref, [q, k, v, rel, sinks], _names(rel, sinks))

    def test_fast_backward_rel_bias_deterministic_runs_simple(self, cuda):
        """Under torch.use_deterministic_algorithms(True) rel_bias's backward is the simple
        kernels' (per-diagonal passes, bitwise reproducible); otherwise the fast kernel's (fp32
        atomics: equal within rounding)."""
        q, k, v = (randn(1, 150, 2, 64, dtype=torch.bfloat16, device=cuda).requires_grad_()
                   for _ in range(3))
        rel = randn(2, 2 * 9 + 1, device=cuda).requires_grad_()
        kw = dict(causal=True, rel_bias=rel, softcap=5.0, alibi_slopes=_alibi_slopes(2).cuda())
        grads = {}
        for det in (False, True):
            out = attn_ext.attention(q, k, v, **kw)
            rel.grad = None
            names = with_deterministic(det, lambda: kernel_names(lambda: out.sum().backward()))
            want, other = ("simple_bwd", "fa2_bwd_kernel") if det else ("fa2_bwd_kernel", "simple_bwd")
            if det or fast_bwd_fits(64):
                assert ran(names, want) and did_not_run(names, other), (det, names)
            grads[det] = rel.grad.clone()
        assert torch.isfinite(grads[True]).all()
        assert max_err(grads[False], grads[True]) <= 1e-2 * (1.0 + float(grads[True].abs().max()))

    def test_gradcheck(self, cuda):
        B, Sq, Sk, H, Hkv, D = 1, 6, 9, 2, 1, 4
        q = randn(B, Sq, H, D, dtype=torch.float64, device=cuda).requires_grad_()
        k = randn(B, Sk, Hkv, D, dtype=torch.float64, device=cuda).requires_grad_()
        v = randn(B, Sk, Hkv, D, dtype=torch.float64, device=cuda).requires_grad_()
        rel = randn(H, 2 * 3 + 1, dtype=torch.float64, device=cuda).requires_grad_()
        sinks = randn(H, dtype=torch.float64, device=cuda).requires_grad_()
        slopes = torch.tensor([0.25, 0.5], device=cuda)

        def f(q, k, v, rel, sinks):
            return attn_ext.attention(q, k, v, causal=True, alibi_slopes=slopes, rel_bias=rel,
                                      softcap=2.0, sinks=sinks, window=(5, 0), return_lse=True)

        assert torch.autograd.gradcheck(f, (q, k, v, rel, sinks))
        cu = torch.tensor([0, 4, 6], dtype=torch.int32, device=cuda)
        qv = randn(6, H, D, dtype=torch.float64, device=cuda).requires_grad_()
        kv = randn(6, Hkv, D, dtype=torch.float64, device=cuda).requires_grad_()

        def g(q, k, rel, sinks):
            return attn_ext.attention_varlen(q, k, k, cu, cu, 4, 4, causal=True, rel_bias=rel,
                                             softcap=3.0, sinks=sinks, return_lse=True)

        assert torch.autograd.gradcheck(g, (qv, kv, rel, sinks))

    def test_opcheck(self, cuda):
        B, Sq, Sk, H, Hkv, D = 2, 7, 11, 2, 1, 8
        q, k, v = (randn(B, S, h, D, device=cuda) for S, h in ((Sq, H), (Sk, Hkv), (Sk, Hkv)))
        rel = randn(H, 9, device=cuda)
        sinks = randn(H, device=cuda)
        slopes = torch.rand(B, H, device=cuda)
        lib = torch.ops.attn_ext
        args = (q, k, v, True, None, -1, -1, None, slopes, rel, 3.0, sinks, 0.2, 123, 7)
        torch.library.opcheck(lib.attention_forward.default, args)
        out, lse = lib.attention_forward(*args)
        torch.library.opcheck(lib.attention_backward_rel_bias.default,
                              (torch.randn_like(out), q, k, v, out, lse, True, None, -1, -1, None,
                               torch.randn_like(lse), slopes, rel, 3.0, 0.2, 123, 7))
        cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=cuda)
        cuk = torch.tensor([0, 5, 11], dtype=torch.int32, device=cuda)
        qv, kv, vv = q[0], k[0], v[0]
        vargs = (qv, kv, vv, cu, cuk, 4, 6, True, None, -1, -1, slopes, rel, 3.0, sinks, 0.2, 5, 9)
        torch.library.opcheck(lib.attention_varlen_forward.default, vargs)
        out, lse = lib.attention_varlen_forward(*vargs)
        torch.library.opcheck(lib.attention_varlen_backward_rel_bias.default,
                              (torch.randn_like(out), qv, kv, vv, out, lse, cu, cuk, 4, 6, True, None,
                               -1, -1, None, slopes, rel, 3.0, 0.2, 5, 9))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_rel_bias_grad_deterministic(self, dtype, cuda):
        """d rel_bias (pass 3 and 4 of the simple backward: no atomics) and dq, dk, dv are
        bitwise identical from run to run, and deterministic mode accepts the call. (bf16
        outside deterministic mode takes the fast backward, whose d rel_bias and dq use fp32
        atomics: so bf16 runs in deterministic mode here.)"""
        q, k, v = (randn(2, 300, h, 64, dtype=dtype, device=cuda).requires_grad_() for h in (4, 2, 2))
        rel = randn(4, 2 * 40 + 1, device=cuda).requires_grad_()
        dout = randn(2, 300, 4, 64, dtype=dtype, device=cuda)

        def grads_any():
            out = attn_ext.attention(q, k, v, causal=True, rel_bias=rel, softcap=20.0)
            return torch.autograd.grad(out, (q, k, v, rel), dout)

        def grads():
            return grads_any() if dtype == torch.float32 else with_deterministic(True, grads_any)

        names = kernel_names(grads)
        assert ran(names, "simple_bwd_drel_diag_kernel") and ran(names, "simple_bwd_drel_reduce_kernel"), names
        assert did_not_run(names, "fa2_bwd_kernel"), names
        a, b = grads(), grads()
        for x, y in zip(a, b):
            assert torch.equal(x, y)
        prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            c = grads()
        finally:
            torch.use_deterministic_algorithms(prev)
        for x, y in zip(a, c):
            assert torch.equal(x, y)

    # -- dropout: the same keep bits as the CPU kernel and reference.dropout_keep_mask --

    @staticmethod
    def _keep_readout(B, Sq, Sk, H, Hkv, p, seed, offset, device, causal=False):
        """Keep bits as the kernel applied them: q = 0 makes every visible probability 1/n,
        and v one-hot for the keys [c0, c0 + 256) of a call (zero elsewhere) puts key
        c0 + c's kept weight in output column c (Dv <= 256, the CUDA kernels' limit)."""
        q = torch.zeros(B, Sq, H, 8, device=device)
        k = torch.randn(B, Sk, Hkv, 8).to(device)
        bits = []
        for c0 in range(0, Sk, 256):
            n = min(256, Sk - c0)
            v = torch.zeros(B, Sk, Hkv, n)
            v[:, c0:c0 + n] = torch.eye(n)[None, :, None, :]
            out, _ = torch.ops.attn_ext.attention_forward(
                q, k, v.to(device), causal, None, -1, -1, None, None, None, None, None, p, seed,
                offset)
            bits.append(out.permute(0, 2, 1, 3).cpu() > 0)
        return torch.cat(bits, dim=-1)  # (B, H, Sq, Sk)

    def test_dropout_keep_bits_match_cpu_and_reference(self, cuda):
        p, seed, offset, Sk = 0.3, 1234567, 89, 256
        want = reference.dropout_keep_mask(seed, offset, 2, 4, range(200), range(Sk), p)
        full = self._keep_readout(2, 200, Sk, 4, 2, p, seed, offset, cuda)  # simple kernel
        assert torch.equal(full, want)
        assert torch.equal(full, self._keep_readout(2, 200, Sk, 4, 2, p, seed, offset, "cpu"))
        # a decode shape: the split-KV path (Sk >= 512, few rows)
        Sk2 = 700
        want2 = reference.dropout_keep_mask(seed, offset, 1, 2, range(3), range(Sk2), p)
        names = kernel_names(lambda: self._keep_readout(1, 3, Sk2, 2, 1, p, seed, offset, cuda))
        assert ran(names, "simple_fwd_split_kernel"), names
        assert torch.equal(self._keep_readout(1, 3, Sk2, 2, 1, p, seed, offset, cuda), want2)
        # keep rate within 4 sigma of 1 - p
        rate = full.double().mean().item()
        sigma = (p * (1 - p) / full.numel()) ** 0.5
        assert abs(rate - (1 - p)) < 4 * sigma, (rate, 1 - p)

    def test_dropout_varlen_bits(self, cuda):
        """Packed sequences: sequence b's bits are those of batch index b at its local rows,
        as on the CPU."""
        p, seed, offset = 0.4, 99, 3
        lq, lk = [5, 120, 0, 33], [40, 130, 7, 33]
        cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
        H, Sk = 2, max(lk)
        q = torch.zeros(sum(lq), H, 8)
        k = torch.randn(sum(lk), H, 8)
        v = torch.zeros(sum(lk), H, Sk)
        for b in range(4):
            for j in range(lk[b]):
                v[int(cu_k[b]) + j, :, j] = 1

        def run(dev):
            out, _ = torch.ops.attn_ext.attention_varlen_forward(
                q.to(dev), k.to(dev), v.to(dev), cu_q.to(dev), cu_k.to(dev), max(lq), Sk, False,
                None, -1, -1, None, None, None, None, p, seed, offset)
            return out.cpu()

        got = run(cuda)
        assert torch.equal(got > 0, run("cpu") > 0)
        for b in range(4):
            if lq[b] == 0:
                continue
            bits = got[int(cu_q[b]):int(cu_q[b + 1]), :, :lk[b]].permute(1, 0, 2) > 0
            want = reference.dropout_keep_mask(seed, offset, b + 1, H, range(lq[b]), range(lk[b]), p)[b]
            assert torch.equal(bits, want)

    @pytest.mark.parametrize("terms", [False, True])
    def test_dropout_cuda_equals_cpu_float64(self, terms, cuda):
        """The same inputs, seed and offset on both backends in float64: out, lse and every
        gradient agree to float64 rounding (a single differing keep bit would move them by
        O(1e-2))."""
        B, Sq, Sk, H, Hkv, D = 2, 90, 130, 4, 2, 16
        p, seed, offset = 0.25, 2024, 17
        q, k, v = (randn(B, S, h, D, dtype=torch.float64) for S, h in ((Sq, H), (Sk, Hkv), (Sk, Hkv)))
        rel = randn(H, 21, dtype=torch.float64) if terms else None
        slopes = torch.rand(B, H, dtype=torch.float64) * 0.2 if terms else None
        cap = 5.0 if terms else None
        lib = torch.ops.attn_ext

        def run(dev):
            t = [x.to(dev) for x in (q, k, v)]
            r = None if rel is None else rel.to(dev)
            s = None if slopes is None else slopes.to(dev)
            out, lse = lib.attention_forward(*t, True, None, 40, -1, None, s, r, cap, None, p,
                                             seed, offset)
            dout = torch.ones_like(out).mul_(0.5) + out
            grads = lib.attention_backward_rel_bias(dout, *t, out, lse, True, None, 40, -1, None,
                                                    None, s, r, cap, p, seed, offset)
            return [x.cpu() for x in (out, lse, *grads)]

        for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "drel_bias"], run(cuda), run("cpu")):
            assert a.shape == b.shape, name
            assert max_err(a, b) < 1e-10, f"{name}: {max_err(a, b):.3e}"

    @pytest.mark.parametrize("block", [None, (7, 5)])
    def test_dropout_fast_forward_bits(self, block, cuda):
        """The fast forward's keep bits (bf16, D = 64: fa2_fwd_kernel's terms instances) equal
        the CPU kernel's, also at a block position whose first key is odd (a lane's key pair
        then straddles two 64-bit words)."""
        if not fast_fwd_fits(64):
            pytest.skip("the fast forward's shared memory exceeds this device's limit")
        B, Sq, Sk, H, Hkv, D = 2, 150, 192, 4, 2, 64
        p, seed, offset = 0.3, 4242, 7
        q = torch.zeros(B, Sq, H, D, dtype=torch.bfloat16)
        k = randn(B, Sk, Hkv, D, dtype=torch.bfloat16)
        pos = () if block is None else block

        def bits(dev):
            out_bits = []
            for c0 in range(0, Sk, D):  # v = identity on keys [c0, c0 + 64): out > 0 iff kept
                v = torch.zeros(B, Sk, Hkv, D, dtype=torch.bfloat16)
                v[:, c0:c0 + D] = torch.eye(D, dtype=torch.bfloat16)[None, :, None, :]
                out, _ = torch.ops.attn_ext.attention_forward(
                    q.to(dev), k.to(dev), v.to(dev), False, None, -1, -1, None, None, None, None,
                    None, p, seed, offset, *pos)
                out_bits.append(out.cpu() > 0)
            return torch.cat(out_bits, dim=-1)

        names = kernel_names(lambda: bits(cuda))
        assert ran(names, "fa2_fwd_kernel") and did_not_run(names, "simple_fwd_kernel"), names
        got, want = bits(cuda), bits("cpu")
        assert torch.equal(got, want)
        if block is None:
            ref = reference.dropout_keep_mask(seed, offset, B, H, range(Sq), range(Sk), p)
            assert torch.equal(got.permute(0, 2, 1, 3), ref)

    @pytest.mark.parametrize("D", [64, 128])
    def test_dropout_fast_kernels_vs_reference(self, D, cuda):
        """bf16 with dropout and rel_bias + softcap: the fast forward, and the fast backward at
        D = 64 (bwd_fast_dropout_head_dim; the simple backward at D = 128), against the float64
        reference with reference.dropout_keep_mask's bits."""
        if not (fast_fwd_fits(D) and fast_bwd_fits(D)):
            pytest.skip("the fast kernels' shared memory exceeds this device's limit")
        B, Sq, Sk, H, Hkv = 2, 130, 150, 4, 2
        p = 0.2
        q, k, v = (randn(B, S, h, D, dtype=torch.bfloat16) for S, h in ((Sq, H), (Sk, Hkv), (Sk, Hkv)))
        rel = randn(H, 21, dtype=torch.bfloat16)
        qc, kc_, vc = (t.cuda().requires_grad_() for t in (q, k, v))
        torch.manual_seed(5)
        out = attn_ext.attention(qc, kc_, vc, causal=True, rel_bias=rel.cuda(), softcap=5.0, dropout_p=p)
        names = kernel_names(lambda: out.backward(torch.ones_like(out)))
        assert ran(names, "fa2_bwd_kernel" if D == 64 else "simple_bwd"), names
        self._dropout_vs_reference(q, k, v, rel, p, 5, cuda)

    @staticmethod
    def _dropout_vs_reference(q, k, v, rel, p, torch_seed, cuda):
        """Causal attention with rel_bias, softcap 5 and dropout p through the wrapper (seed /
        offset drawn from the CUDA generator after torch.manual_seed(torch_seed)) against the
        float64 reference with reference.dropout_keep_mask's bits."""
        B, Sq, H = q.shape[:3]
        Sk = k.shape[1]
        torch.manual_seed(torch_seed)
        seed, offset = _ops._dropout_seed_offset(cuda)
        mask = reference.dropout_keep_mask(seed, offset, B, H, range(Sq), range(Sk), p)

        @_on_cuda
        def ours(q, k, v, rel):
            torch.manual_seed(torch_seed)  # the wrapper draws the same seed/offset
            return attn_ext.attention(q, k, v, causal=True, rel_bias=rel, softcap=5.0, dropout_p=p,
                                      return_lse=True)

        def ref(q, k, v, rel):
            return reference.attention_with_lse(q, k, v, True, None, None, None, None, rel, 5.0,
                                                None, p, mask)

        check_against_reference(ours, ref, [q, k, v, rel], ["dq", "dk", "dv", "drel_bias"])

    @pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
    def test_dropout_vs_reference(self, dtype, cuda):
        """Through the wrapper: seed/offset drawn from the CUDA generator (torch.manual_seed
        reproduces them), forward and backward with the bits of reference.dropout_keep_mask."""
        B, Sq, Sk, H, Hkv, D = 2, 80, 110, 4, 2, 32
        q, k, v = randn(B, Sq, H, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype)
        self._dropout_vs_reference(q, k, v, randn(H, 21, dtype=dtype), 0.2, 11, cuda)

    # -- the kernel that ran is the one explain() names --

    @pytest.mark.parametrize("case", ["rel_bias", "sinks", "dropout", "softcap_decode", "softcap", "alibi"])
    def test_explain_names_the_kernel(self, case, cuda):
        D, Sq, Sk = 64, 150, 150
        if case == "softcap_decode":
            Sq, Sk = 1, 4096
        q, k, v = (randn(1, S, 2, D, dtype=torch.bfloat16, device=cuda) for S in (Sq, Sk, Sk))
        kw = {"rel_bias": dict(rel_bias=randn(2, 11, device=cuda)),
              "sinks": dict(sinks=randn(2, device=cuda)),
              "dropout": dict(dropout_p=0.1),
              "softcap_decode": dict(softcap=10.0),
              "softcap": dict(softcap=10.0),
              "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25], device=cuda))}[case]
        choice = attn_ext.explain(q, k, v, causal=True, **kw)
        names = kernel_names(lambda: attn_ext.attention(q, k, v, causal=True, **kw))
        want = _EXPLAINED_KERNEL[choice.forward]
        assert ran(names, want), (str(choice), names)
        for other in set(_EXPLAINED_KERNEL.values()) - {want}:
            assert did_not_run(names, other), (str(choice), names)
        if case == "softcap_decode":
            assert choice.forward == "cuda.split_kv", str(choice)
        elif fast_fwd_fits(D):
            assert choice.forward == "cuda.fa2" and "with the score terms" in choice.forward_reason, str(choice)
        # backward: the fast kernel with sinks (through lse), softcap, ALiBi, rel_bias and (at
        # D = 64) dropout: its kTerms instances
        qg = q.detach().clone().requires_grad_()
        out = attn_ext.attention(qg, k, v, causal=True, **kw)
        dout = torch.randn_like(out)
        choice = attn_ext.explain(q, k, v, causal=True, dout=dout, **kw)
        names = kernel_names(lambda: out.backward(dout, retain_graph=True))
        fast_cases = ("sinks", "softcap_decode", "softcap", "alibi", "rel_bias", "dropout")
        if fast_bwd_fits(D) and case in fast_cases:
            assert choice.backward == "cuda.fa2", str(choice)
        if choice.backward == "cuda.fa2":
            assert case in fast_cases, str(choice)
            assert ran(names, "fa2_bwd_kernel") and did_not_run(names, "simple_bwd"), (str(choice), names)
        else:
            assert ran(names, "simple_bwd") and did_not_run(names, "fa2_bwd_kernel"), (str(choice), names)

    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
    @pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
    @pytest.mark.parametrize("kind", ["rel+alibi+softcap+sinks", "sinks"])
    def test_fast_forward_terms(self, kind, dtype, D, causal, cuda):
        """The fast forward's kTerms instances (ScoreTerms::add on the score fragment, sinks in
        the epilogue) against the simple kernel and the float64 reference: ragged tiles,
        Sq > Sk (causal rows without keys, a whole query tile among them: out 0, lse = the
        sink), GQA, (B, H) slopes."""
        if not fast_fwd_fits(D):
            pytest.skip(f"the fast forward's shared memory at D={D} exceeds this device's limit")
        B, Sq, Sk, H, Hkv = 2, 200, 97, 4, 2  # causal: query tile 0 sees no key at all
        alibi, rel, cap, sinks = _term_tables(kind, B, H, M=40)
        q = randn(B, Sq, H, D, dtype=dtype, device=cuda)
        k, v = randn(B, Sk, Hkv, D, dtype=dtype, device=cuda), randn(B, Sk, Hkv, D, dtype=dtype, device=cuda)
        kw = dict(alibi_slopes=None if alibi is None else alibi.cuda(), softcap=cap,
                  rel_bias=None if rel is None else rel.float().cuda(),
                  sinks=None if sinks is None else sinks.float().cuda())

        def run():
            return attn_ext.attention(q, k, v, causal=causal, return_lse=True, **kw)

        names = kernel_names(run)
        if D == 256:  # no terms instances at D = 256 (they would spill): the simple kernel
            assert ran(names, "simple_fwd") and did_not_run(names, "fa2_fwd_kernel"), names
            assert "score terms at D = 256" in attn_ext.explain(q, k, v, causal=causal, **kw).forward_reason
        else:
            assert ran(names, "fa2_fwd_kernel") and did_not_run(names, "simple_fwd"), names
        out, lse = run()
        with attn_ext.ops._simple_cuda_kernels():
            out_s, lse_s = run()

        def ref(dt):
            a = None if alibi is None else alibi.to(dt)
            return reference.attention_with_lse(
                q.cpu().to(dt), k.cpu().to(dt), v.cpu().to(dt), causal, None, None, None, a,
                None if rel is None else rel.to(dt), cap, None if sinks is None else sinks.to(dt))

        r_out, r_lse = ref(torch.float64)
        low_out, _ = ref(dtype)
        assert_close_rule(out.cpu(), r_out, low_out, name="fast out")
        assert_close_rule(out_s.cpu(), r_out, low_out, name="simple out")
        assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(r_lse))
        fin = torch.isfinite(r_lse)
        bound = 1e-3 + 4e-6 * float(r_lse[fin].abs().max())
        assert max_err(lse.cpu(), r_lse) <= bound and max_err(lse_s.cpu(), r_lse) <= bound
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
        assert max_err(out, out_s) <= 4 * ulp * max(1.0, float(out_s.abs().max()))
        if causal and sinks is not None:  # rows 0 .. Sq - Sk - 1 see no key: lse = the sink
            n = Sq - Sk
            assert torch.all(out[:, :n] == 0)
            assert torch.allclose(lse[:, :, :n], kw["sinks"][None, :, None].expand(B, H, n), atol=1e-6)

    @pytest.mark.parametrize("block", [(64, 32, 32, 0, 32), (300, 5, 130, 101, 199),
                                       (300, 200, 100, 0, 200)], ids=str)
    @pytest.mark.parametrize("causal,window", [(True, None), (False, (9, 5))])
    def test_block_position_cuda_equals_cpu_float64(self, block, causal, window, cuda):
        """q_start / k_start (a block of a longer sequence, issue 17) with ALiBi, rel_bias,
        softcap and dropout: the CUDA ops equal the CPU ops in float64 (global distances in
        the terms and in d rel_bias's diagonals, dropout bits at global rows / keys)."""
        S, q0, sq, k0, sk = block
        B, H, Hkv, D = 2, 4, 2, 16
        q, k, v = (randn(B, n, h, D, dtype=torch.float64) for n, h in ((sq, H), (sk, Hkv), (sk, Hkv)))
        rel = randn(H, 2 * 24 + 1, dtype=torch.float64)
        slopes = _alibi_slopes(H).double()
        left, right = window if window is not None else (-1, -1)
        lib = torch.ops.attn_ext

        def run(dev):
            t = [x.to(dev) for x in (q, k, v)]
            r, s = rel.to(dev), slopes.to(dev)
            out, lse = lib.attention_forward(*t, causal, None, left, right, None, s, r, 6.0, None,
                                             0.2, 99, 5, q0, k0)
            dout = torch.ones_like(out).mul_(0.5) + out
            dlse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse * 0.1)
            grads = lib.attention_backward_rel_bias(dout, *t, out, lse, causal, None, left, right,
                                                    None, dlse, s, r, 6.0, 0.2, 99, 5, False, q0, k0)
            return [x.cpu() for x in (out, lse, *grads)]

        for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "drel_bias"], run(cuda), run("cpu")):
            assert a.shape == b.shape, name
            assert max_err(a, b) < 1e-10, f"{name}: {max_err(a, b):.3e}"


def test_vmap_folds_on_cuda(cuda):
    """The batching rules (attn_ext/_vmap.py) on CUDA tensors: vmap of attention and of its
    per-sample gradients equals the per-sample calls (float64, the simple kernels)."""
    V, B, S, H, Hkv, D = 3, 2, 9, 4, 2, 16
    q = randn(V, B, S, H, D, dtype=torch.float64).to(cuda)
    k, v = (randn(V, B, S, Hkv, D, dtype=torch.float64).to(cuda) for _ in range(2))
    rel = randn(H, 9, dtype=torch.float64).to(cuda)

    def loss(q, k, v):
        return attn_ext.attention(q, k, v, causal=True, rel_bias=rel).square().sum()

    out = torch.func.vmap(lambda q, k, v: attn_ext.attention(q, k, v, causal=True, rel_bias=rel))(q, k, v)
    grads = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for i in range(V):
        ref = attn_ext.attention(q[i], k[i], v[i], causal=True, rel_bias=rel)
        assert max_err(out[i], ref) < 1e-12
        for g, w in zip(grads, torch.func.grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i])):
            assert max_err(g[i], w) < 1e-10
