"""Values, lse and every gradient of an attention call against attn_ext.reference: float64
to 1e-9, low precision by DESIGN.md's rule (assert_close_low). Shared by test_masks.py and
test_score_terms.py."""

import torch

from tests.test_attention import assert_close_low  # the suite's float32 floor, explained there
from tests.utils import assert_lse_fp32, max_err


def _finite(lse):
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _run(fn, inputs, dtype, dout, dlse):
    """[out, lse, grads of every input] of fn on q, k, v cast to dtype and the other inputs
    (tables: rel_bias, sinks) as given, all in float64 for dtype float64 (None inputs stay
    None); the loss uses out AND lse. (Casting a float32 table to bf16 for our run but not
    for the float64 reference put its rounding, 2.5e-3, into lse.)"""
    ts = [None if t is None else
          t.detach().to(dtype if i < 3 or dtype == torch.float64 else t.dtype).requires_grad_()
          for i, t in enumerate(inputs)]
    out, lse = fn(*ts)
    loss = (out.double() * dout).sum() + (_finite(lse).double() * dlse).sum()
    live = [t for t in ts if t is not None]
    grads = torch.autograd.grad(loss, live, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, live)]
    return [out.detach(), lse.detach()] + grads


def check_against_reference(ours_fn, ref_fn, inputs, names):
    """ours_fn / ref_fn take the tensors of `inputs` (q, k, v in the test dtype, then e.g.
    rel_bias / sinks or None, in theirs) and return (out, lse); `names` name the gradients."""
    dtype = inputs[0].dtype
    with torch.no_grad():
        out0, lse0 = ours_fn(*inputs)
    dout = torch.randn(out0.shape, dtype=torch.float64)
    dlse = torch.randn(lse0.shape, dtype=torch.float64)
    ours = _run(ours_fn, inputs, dtype, dout, dlse)
    ref64 = _run(ref_fn, inputs, torch.float64, dout, dlse)
    names = ["out", "lse"] + names
    assert ours[0].dtype == dtype and ours[0].is_contiguous()
    assert torch.equal(torch.isneginf(ours[1]), torch.isneginf(ref64[1]))
    for name, a, r in zip(names, ours, ref64):
        ok = ~torch.isnan(a) if name == "lse" else torch.isfinite(a)
        assert ok.all(), f"{name}: non-finite value"
        if dtype == torch.float64:
            assert max_err(a, r) < 1e-9, f"{name}: {max_err(a, r):.3e}"
    if dtype != torch.float64:
        ref_low = _run(ref_fn, inputs, dtype, dout, dlse)
        for name, a, r, rl in zip(names, ours, ref64, ref_low):
            assert_close_low(a, r, rl, name)
        assert_lse_fp32(ours[1], ref64[1], dtype)
