"""In-place ops must not write one element twice (issue 18, item 2): rope_qk_(x, x, ...) used to
rotate x twice on CPU (and race on CUDA). Overlapping or internally overlapping in-place
arguments of rope_, rope_qk_ and sinusoidal_pe_ are rejected with an error naming them, on
both backends; views that share a buffer without sharing elements (fused QKV, heads split from
a transposed (B, H, S, D) buffer) keep working and give the same result as separate tensors."""

import pytest
import torch

import attn_ext
from attn_ext import reference as ref

from utils import randn

ops = torch.ops.attn_ext


def _tables(s_max, rot, device):
    return attn_ext.rope_cache(s_max, rot, dtype=torch.float32, device=device)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_qk_same_tensor_is_rejected(device, interleaved):
    x = randn(2, 5, 3, 16, device=device)
    cos, sin = _tables(5, 16, device)
    before = x.clone()
    with pytest.raises(RuntimeError, match=r"q and k \(in place, rope_qk_\) must not overlap"):
        ops.rope_qk_(x, x, cos, sin, None, 0, interleaved)
    assert torch.equal(x, before)  # rejected before any write


@pytest.mark.parametrize(
    "make_k",
    [
        lambda q: q[:, :, :1],         # k is one of q's heads
        lambda q: q[:, 1:],            # k starts one row later
        lambda q: q[:1],               # k is q's first batch
        lambda q: q.transpose(1, 2),   # same elements, other order (S == H)
    ],
    ids=["head", "row-shift", "batch", "transposed"],
)
def test_rope_qk_overlapping_views_are_rejected(device, make_k):
    q = randn(2, 4, 4, 16, device=device)
    k = make_k(q)
    cos, sin = _tables(8, 16, device)
    # k's own shape may not match q's (B, S); the overlap check must come first or the
    # shape check names the mismatch: either way nothing is written.
    before = q.clone()
    with pytest.raises(RuntimeError, match=r"(must not overlap|must have B = )"):
        ops.rope_qk_(q, k, cos, sin, None, 0, False)
    assert torch.equal(q, before)


def test_rope_qk_row_shift_names_overlap(device):
    buf = randn(2, 5, 3, 16, device=device)
    q, k = buf[:, :4], buf[:, 1:]  # same shape, k is q shifted by one row
    cos, sin = _tables(8, 16, device)
    with pytest.raises(RuntimeError, match=r"q and k \(in place, rope_qk_\) must not overlap in memory"):
        ops.rope_qk_(q, k, cos, sin, None, 0, False)


def test_inplace_ops_refuse_a_negated_view_by_name(device):
    """A written tensor with the negative / conjugate bit set is refused naming the op and the
    argument, in every mode (torch's math-bit fallback failed with "Expected Tensor but got
    None"); a read-only argument with the bit is resolved and used."""
    cos, sin = _tables(8, 16, device)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            x = randn(2, 4, 3, 16, device=device)._neg_view()
            with pytest.raises(RuntimeError, match=r"attn_ext::rope_: x is a lazily negated"):
                ops.rope_(x, cos, sin, None, 0, False)
            with pytest.raises(RuntimeError, match=r"attn_ext::rope_qk_: k is a lazily negated"):
                ops.rope_qk_(randn(2, 4, 3, 16, device=device), x, cos, sin, None, 0, False)
            with pytest.raises(RuntimeError, match=r"attn_ext::sinusoidal_pe_: x is a lazily"):
                ops.sinusoidal_pe_(x[:, :, 0], None, 0, 10000.0)
            y = randn(2, 4, 3, 16, device=device)
            y2 = y.clone()
            ops.rope_(y, (-cos)._neg_view(), sin, None, 0, False)  # reads as cos
            ops.rope_(y2, cos, sin, None, 0, False)
            assert torch.equal(y, y2)


def test_internally_overlapping_inplace_args_are_rejected(device):
    cos, sin = _tables(8, 16, device)
    x = randn(2, 4, 1, 16, device=device).expand(2, 4, 3, 16)  # 3 heads, one memory row
    with pytest.raises(RuntimeError, match=r"x \(in place, rope_\) must not overlap itself"):
        ops.rope_(x, cos, sin, None, 0, False)
    k = randn(2, 4, 2, 16, device=device)
    with pytest.raises(RuntimeError, match=r"q \(in place, rope_qk_\) must not overlap itself"):
        ops.rope_qk_(x, k, cos, sin, None, 0, False)
    with pytest.raises(RuntimeError, match=r"k \(in place, rope_qk_\) must not overlap itself"):
        ops.rope_qk_(k, x, cos, sin, None, 0, False)
    pe = randn(1, 4, 8, device=device).expand(3, 4, 8)
    with pytest.raises(RuntimeError, match=r"x \(in place, sinusoidal_pe_\) must not overlap itself"):
        ops.sinusoidal_pe_(pe, None, 0, 10000.0)
    # an as_strided view whose rows overlap: row stride 4 < row length 8
    base = randn(64, device=device)
    rows = base.as_strided((1, 5, 8), (40, 4, 1))
    with pytest.raises(RuntimeError, match=r"x \(in place, sinusoidal_pe_\) must not overlap itself"):
        ops.sinusoidal_pe_(rows, None, 0, 10000.0)


def test_positions_inside_the_written_tensor_are_rejected(device):
    """positions stored in the memory an in-place op writes: the rows rotated first would turn
    the later rows' positions into garbage indices (rope_ / rope_qk_ used to read past the
    tables and crash). Refused before any write, naming positions."""
    cos, sin = _tables(16, 8, device)
    x = randn(2, 6, 2, 8, dtype=torch.float64, device=device)
    pos = x.view(torch.int64)[0, :, 0, 0]  # 6 int64 slots inside x
    pos.copy_(torch.arange(6, device=device))
    before = x.clone()
    with pytest.raises(RuntimeError, match=r"positions must not overlap x \(rope_ writes x"):
        ops.rope_(x, cos, sin, pos, 0, False)
    q = randn(2, 6, 2, 8, dtype=torch.float64, device=device)
    with pytest.raises(RuntimeError, match=r"positions must not overlap k \(rope_qk_ writes k"):
        ops.rope_qk_(q, x, cos, sin, pos, 0, False)
    with pytest.raises(RuntimeError, match=r"positions must not overlap q \(rope_qk_ writes q"):
        ops.rope_qk_(x, q, cos, sin, pos, 0, False)
    pe = x[:, :, 0, :]  # (B, S, D) view of x, holding pos in its first column
    with pytest.raises(RuntimeError, match=r"positions must not overlap x \(sinusoidal_pe_ writes x"):
        ops.sinusoidal_pe_(pe, pos, 0, 10000.0)
    assert torch.equal(x, before)
    # the same positions in their own memory work
    ops.rope_(x, cos, sin, pos.clone(), 0, False)


@pytest.mark.parametrize("layout", ["fused", "per-head-fused", "transposed-heads"])
def test_rope_qk_disjoint_views_of_one_buffer_work(device, layout):
    B, S, H, D = 2, 6, 4, 16
    if layout == "fused":  # Linear output (B, S, 3 H D) split into q, k, v
        buf = randn(B, S, 3 * H * D, device=device)
        q = buf[..., : H * D].view(B, S, H, D)
        k = buf[..., H * D : 2 * H * D].view(B, S, H, D)
    elif layout == "per-head-fused":  # (B, S, H, 3, D): q, k interleaved per head
        buf = randn(B, S, H, 3, D, device=device)
        q, k = buf[:, :, :, 0], buf[:, :, :, 1]
    else:  # one (B, 2H, S, D) buffer, heads [0, H) are q, [H, 2H) are k
        buf = randn(B, 2 * H, S, D, device=device).transpose(1, 2)
        q, k = buf[:, :, :H], buf[:, :, H:]
    cos, sin = _tables(S, D, device)
    want_q = ref.rope(q.double(), cos.double(), sin.double())
    want_k = ref.rope(k.double(), cos.double(), sin.double())
    ops.rope_qk_(q, k, cos, sin, None, 0, False)
    torch.testing.assert_close(q.double(), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.double(), want_k, rtol=1e-5, atol=1e-5)


def test_inplace_on_disjoint_strided_views_still_works(device):
    # rope_ / sinusoidal_pe_ on views that are strided but never alias themselves
    cos, sin = _tables(6, 16, device)
    buf = randn(2, 6, 4, 2, 16, device=device)
    x = buf[:, :, :, 1]
    want = ref.rope(x.double(), cos.double(), sin.double())
    ops.rope_(x, cos, sin, None, 0, False)
    torch.testing.assert_close(x.double(), want, rtol=1e-5, atol=1e-5)
    pe_buf = randn(3, 5, 2, 8, device=device)
    y = pe_buf[:, :, 0]
    want = ref.sinusoidal_pe(y.double())
    ops.sinusoidal_pe_(y, None, 0, 10000.0)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


def test_inplace_on_an_inference_tensor_outside_inference_mode_is_refused():
    """As aten's in-place ops: an inference tensor is written only inside
    torch.inference_mode() (outside it, autograd could not track the write)."""
    with torch.inference_mode():
        x = torch.randn(1, 4, 2, 8)
        z = torch.randn(1, 4, 16)
    cos, sin = attn_ext.rope_cache(16, 8)
    with pytest.raises(RuntimeError, match="x is an inference tensor"):
        attn_ext.rope_(x, cos, sin)
    with pytest.raises(RuntimeError, match="x is an inference tensor"):
        attn_ext.sinusoidal_pe_(z)  # no other tensor argument
    with pytest.raises(RuntimeError, match="k is an inference tensor"):
        attn_ext.rope_qk(torch.randn(1, 4, 2, 8), x, cos, sin, inplace=True)
    want = attn_ext.rope(x, cos, sin)  # out of place: fine
    with torch.inference_mode():
        attn_ext.rope_(x, cos, sin)
        attn_ext.sinusoidal_pe_(z)
    assert torch.equal(x, want)
