"""fp32 gradients of the CPU attention backward on the shapes where they used to go wrong
(issue 18 item 8; the measurement is tools/fp32_grad_study.py).

The backward recomputes P = exp(s - lse). It used to take its scores in other units (the
forward worked in log2 units and stored lse in natural units) and, for the decode kernel, in
another summation order than the forward, and it took the row term Di = rowsum(dout * out)
from a dot product rounded apart from dP. In a row whose probability sits on one key the
textbook gets P = 1 and dS = 0 there exactly; ours got P = 1 +- a few ulps and dS of the size
of dP's rounding, so dv was off by up to 16x the fp32 textbook's error and dq / dk by
arbitrarily more (their true values are tiny there). Now the forward and backward share
units and products (P = 1 exactly where the forward's is), and Di cancels dP's rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attn_ext
from attn_ext import reference as R

EPS = torch.finfo(torch.float32).eps


def _grads(q, k, v, dout, causal, scale, dtype):
    q, k, v = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _ = R.attention_with_lse(q, k, v, causal, scale)
    out.backward(dout.to(dtype))
    return q.grad, k.grad, v.grad


def _sdpa_math_grads(q, k, v, dout, causal, scale):
    """PyTorch's fp32 textbook in its own order (SDPA math backend, bottom-right mask)."""
    group = q.shape[2] // k.shape[2]
    q, k, v = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    mask = R.causal_mask(q.shape[1], k.shape[1]) if causal else None
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2),
                                             vv.transpose(1, 2), attn_mask=mask, scale=scale)
    out.transpose(1, 2).backward(dout)
    return q.grad, k.grad, v.grad


def _ours(q, k, v, dout, causal, scale):
    qg, kg, vg = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    attn_ext.attention(qg, kg, vg, causal=causal, scale=scale).backward(dout)
    return qg.grad, kg.grad, vg.grad


def _err(a, b):
    return float((a.double() - b.double()).abs().max())


# Sq = 1: the decode forward; Sq = 40: the tiled forward. Sk = 40: every query block sees one
# key tile; Sk = 136: two (Di from rowsum(dout * out)).
@pytest.mark.parametrize("sq,sk", [(1, 40), (1, 136), (40, 40), (40, 136)])
def test_peaked_rows_exact(sq, sk):
    """Row i's probability sits on key i (P of the others < 1e-15): the textbook's fp32
    gradients are then exact to the rounding of the inputs, and ours must be too."""
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    B, H, D = 1, 2, 64
    q = torch.randn(B, sq, H, D, generator=g)
    k = torch.randn(B, sk, H, D, generator=g)
    k[:, :sq] = 16 * q  # at scale 1/8: s_ii = 2 |q_i|^2 ~ 128, s_ij (j != i) ~ N(0, 16^2)
    v = torch.randn(B, sk, H, D, generator=g)
    dout = torch.randn(B, sq, H, D, generator=g)
    ours = _ours(q, k, v, dout, False, None)
    ref = _grads(q, k, v, dout, False, None, torch.float64)
    # dv row of key i (< sq) is dout_i: exactly, as the textbook's
    dv_err = _err(ours[2], ref[2])
    assert dv_err <= EPS * float(dout.abs().max()), f"dv error {dv_err:.3e}"
    # dq, dk: the true values are ~1e-15 and below; the old kernel's were ~1e-6 off
    for name, a, r in zip(("dq", "dk"), ours[:2], ref[:2]):
        assert _err(a, r) <= 1e-12, f"{name} error {_err(a, r):.3e} (magnitude {float(r.abs().max()):.3e})"


def test_tiny_shapes_rule():
    """The shapes of the old fuzz failures (Sq 1-2, Sk 2-3, scale up to 2): dv within 2x of the
    fp32 textbook's error in every case; dq / dk within 2x of PyTorch's own fp32 error (the
    larger of reference.py's and SDPA math's) in all but a few cases. PyTorch's two fp32
    orders themselves disagree by up to ~8x in this metric on such shapes (measured:
    tools/fp32_grad_study.py, 3000 cases: SDPA math exceeds 2x reference.py's error in 20 /
    12 cases for dq / dk; ours against the larger of the two in 6 / 6). The old kernel: dv
    over 2x in 13% of these cases, dq / dk in 7% / 8%."""
    g = torch.Generator().manual_seed(18)

    def ri(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    n, over = 300, {"dq": 0, "dk": 0, "dv": 0}
    for _ in range(n):
        B, Hkv = ri(1, 2), ri(1, 2)
        H = Hkv * ri(1, 2)
        Sq, Sk, D = ri(1, 2), ri(2, 3), ri(1, 80)
        causal = bool(ri(0, 1))
        scale = None if ri(0, 1) else float(torch.empty(1).uniform_(0.01, 2.0, generator=g))
        s_ = scale if scale is not None else D ** -0.5
        q, k, v, dout = [torch.randn(*sh, generator=g, dtype=torch.float64).float()
                         for sh in ((B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D),
                                    (B, Sq, H, D))]
        ours = _ours(q, k, v, dout, causal, scale)
        r64 = _grads(q, k, v, dout, causal, scale, torch.float64)
        r32 = _grads(q, k, v, dout, causal, scale, torch.float32)
        m32 = _sdpa_math_grads(q, k, v, dout, causal, s_)
        for i, name in enumerate(("dq", "dk", "dv")):
            floor = 4 * EPS * float(r64[i].abs().max())
            base = _err(r32[i], r64[i]) if name == "dv" else max(_err(r32[i], r64[i]),
                                                                   _err(m32[i], r64[i]))
            over[name] += _err(ours[i], r64[i]) > 2 * max(base, floor) + 1e-6
    assert over["dv"] == 0, over
    assert over["dq"] <= 0.02 * n and over["dk"] <= 0.02 * n, over
