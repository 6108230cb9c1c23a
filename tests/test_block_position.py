"""Blocks at a global position (issue 17): ``attention_forward / attention_backward(...,
q_start, k_start)`` compute the block of queries ``[q0, q0 + sq)`` and keys ``[k0, k0 + sk)``
of one longer self-attention, with causal, window, ALiBi, rel_bias, softcap and dropout at the
global positions. The block's (out, lse) must equal the whole-sequence reference restricted to
those keys (every other key padded away) on those rows, with every gradient; this is what ring
attention merges through lse."""

import random

import pytest
import torch

from attn_ext import ops, reference
from attn_ext.position_bias import alibi_slopes
from tests.reference_checks import check_against_reference
from tests.utils import randn

_ops = torch.ops.attn_ext


def _embed(x, start, S):
    """x (B, n, ...) placed at rows [start, start + n) of zeros (B, S, ...), differentiably."""
    B, n = x.shape[:2]
    before = x.new_zeros((B, start) + tuple(x.shape[2:]))
    after = x.new_zeros((B, S - start - n) + tuple(x.shape[2:]))
    return torch.cat([before, x, after], dim=1)


def _block_fns(S, q0, k0, causal, window, alibi, softcap, dropout_p, seed, offset):
    """(ours, ref) over (q_block, k_block, v_block, rel_bias)."""
    left, right = window if window is not None else (-1, -1)

    def ours(q, k, v, rel):
        if rel is not None:  # the ops take the table in the accumulation type
            rel = rel.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        return _ops.attention_forward(
            q, k, v, causal, None, left, right, None, alibi, rel, softcap, None, dropout_p,
            seed, offset, q0, k0)

    def ref(q, k, v, rel):
        B, sq, H, D = q.shape
        sk = k.shape[1]
        kpm = torch.zeros(B, S, dtype=torch.bool)
        kpm[:, k0:k0 + sk] = True  # the block's keys only
        mask = None
        if dropout_p > 0:
            mask = reference.dropout_keep_mask(seed, offset, B, H, range(S), range(S), dropout_p)
        out, lse = reference.attention_with_lse(
            _embed(q, q0, S), _embed(k, k0, S), _embed(v, k0, S), causal, 1.0 / D ** 0.5,
            window, kpm, alibi_slopes=alibi, rel_bias=rel, softcap=softcap,
            dropout_p=dropout_p, dropout_mask=mask)
        return out[:, q0:q0 + sq], lse[:, :, q0:q0 + sq]

    return ours, ref


# (S, q0, sq, k0, sk): the diagonal, blocks below and above it, a block cut by the band,
# unequal block sizes, key tiles crossing the CPU kernels' 96-row tiles.
BLOCKS = [
    (64, 0, 32, 0, 32),
    (64, 32, 32, 0, 32),
    (64, 0, 32, 32, 32),
    (80, 40, 17, 13, 30),
    (300, 200, 100, 0, 200),
    (300, 5, 130, 101, 199),
]
CASES = [
    dict(causal=True),
    dict(causal=False),
    dict(causal=True, window=(20, 0)),
    dict(causal=False, window=(9, 5)),
    dict(causal=True, alibi=True),
    dict(causal=False, rel=True),
    dict(causal=True, rel=True, softcap=7.0, window=(50, 0)),
    dict(causal=True, dropout_p=0.3),
    dict(causal=False, dropout_p=0.2, alibi=True, rel=True),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "+".join(f"{k}" for k in c))
def test_block_equals_whole_sequence_part(dtype, block, case):
    S, q0, sq, k0, sk = block
    B, H, Hkv, D = 2, 4, 2, 16
    torch.manual_seed(S * 7 + q0 + k0)
    q = randn(B, sq, H, D, dtype=dtype)
    k = randn(B, sk, Hkv, D, dtype=dtype)
    v = randn(B, sk, Hkv, D, dtype=dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    alibi = alibi_slopes(H).to(acc) if case.get("alibi") else None
    rel = randn(H, 2 * 24 + 1, dtype=acc) if case.get("rel") else None
    ours, ref = _block_fns(S, q0, k0, case["causal"], case.get("window"), alibi,
                           case.get("softcap"), case.get("dropout_p", 0.0), 1234, 77)
    check_against_reference(ours, ref, [q, k, v, rel], ["dq", "dk", "dv", "drel_bias"])


def test_default_positions_are_the_whole_problem():
    """q_start = k_start = None is the ordinary call. Without dropout, (Sk - Sq, 0) is the same
    problem written as a block (bottom-right alignment), bit for bit; (0, 0) is top-left, a
    different one. Dropout draws its bits at (q_start + i, k_start + j), the ordinary call at
    (i, j): the block (0, 0) of a square problem has the ordinary call's bits."""
    q, k, v = randn(1, 20, 2, 8), randn(1, 50, 2, 8), randn(1, 50, 2, 8)
    rel = randn(2, 11)
    args = (q, k, v, True, None, 9, -1, None, None, rel, None, None, 0.0, 5, 6)
    a = _ops.attention_forward(*args)
    b = _ops.attention_forward(*args, 30, 0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = _ops.attention_forward(*args, 0, 0)
    assert not torch.equal(a[0], c[0])
    sq = (q, k[:, :20], v[:, :20], True, None, 9, -1, None, None, rel, None, None, 0.4, 5, 6)
    d, e = _ops.attention_forward(*sq), _ops.attention_forward(*sq, 0, 0)
    assert torch.equal(d[0], e[0]) and torch.equal(d[1], e[1])
    f = _ops.attention_forward(*sq, 4, 4)  # same distances, other dropout bits
    assert torch.equal(d[1], f[1]) and not torch.equal(d[0], f[0])


def test_blocks_merge_to_the_whole_sequence():
    """Splitting the keys of a whole call into blocks and merging their (out, lse) reproduces
    it: the ring's invariant, with every position-dependent term on."""
    torch.manual_seed(3)
    S, B, H, D = 90, 1, 2, 8
    q, k, v = (randn(B, S, H, D, dtype=torch.float64) for _ in range(3))
    rel = randn(H, 31, dtype=torch.float64)
    kw = (True, None, 40, -1, None, alibi_slopes(H).double(), rel, 3.0, None, 0.1, 9, 4)
    whole, whole_lse = _ops.attention_forward(q, k, v, *kw)
    for r0, r1 in ((0, 30), (30, 90)):
        lse = torch.full((B, H, r1 - r0), float("-inf"), dtype=torch.float64)
        out = torch.zeros(B, r1 - r0, H, D, dtype=torch.float64)
        for c0, c1 in ((0, 25), (25, 61), (61, 90)):
            o, l = _ops.attention_forward(q[:, r0:r1], k[:, c0:c1], v[:, c0:c1], *kw, r0, c0)
            new = torch.logaddexp(lse, l)
            base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
            out = (out * torch.exp(lse - base).transpose(1, 2)[..., None]
                   + o * torch.exp(l - base).transpose(1, 2)[..., None])
            lse = new
        assert torch.allclose(out, whole[:, r0:r1], atol=1e-12, rtol=0)
        assert torch.allclose(lse, whole_lse[:, :, r0:r1], atol=1e-12, rtol=0)


def test_block_position_gradcheck_and_opcheck():
    q, k, v = (randn(1, n, 2, 4, dtype=torch.float64).requires_grad_() for n in (6, 9, 9))
    rel = randn(2, 7, dtype=torch.float64).requires_grad_()

    def f(q, k, v, rel):
        out, lse = _ops.attention_forward(q, k, v, True, None, 5, -1, None, None, rel, 2.0,
                                          None, 0.0, 0, 0, 7, 2)
        return out, lse.masked_fill(torch.isinf(lse), 0)

    assert torch.autograd.gradcheck(f, (q, k, v, rel))
    args = (q.detach(), k.detach(), v.detach(), True, None, 5, -1, None, None, rel.detach(),
            2.0, None, 0.3, 1, 2, 7, 2)
    torch.library.opcheck(_ops.attention_forward, args)
    out, lse = _ops.attention_forward(*args)
    torch.library.opcheck(
        _ops.attention_backward_rel_bias,
        (torch.randn_like(out), *args[:3], out, lse, True, None, 5, -1, None, None, None,
         args[9], 2.0, 0.3, 1, 2, False, 7, 2))


def test_block_position_bad_input():
    q = randn(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="q_start and k_start must be given together"):
        _ops.attention_forward(q, q, q, True, None, -1, -1, None, None, None, None, None, 0.0,
                               0, 0, 3, None)
    with pytest.raises(RuntimeError, match="k_start must be >= 0"):
        _ops.attention_forward(q, q, q, True, None, -1, -1, None, None, None, None, None, 0.0,
                               0, 0, 3, -1)
    with pytest.raises(RuntimeError, match="sinks cannot be combined with q_start"):
        _ops.attention_forward(q, q, q, True, None, -1, -1, None, None, None, None,
                               torch.zeros(1), 0.0, 0, 0, 0, 0)


@pytest.mark.parametrize("causal,window,dropout_p", [(True, (300, 0), 0.3), (False, None, 0.2)])
def test_block_on_the_split_paths(causal, window, dropout_p):
    """One (batch, head): the forward cuts the keys into chunks (split-KV) and the backward
    takes the FlashAttention-2 split (see explain()); positions reach both."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        S, q0, sq, k0, sk = 1000, 600, 50, 100, 450
        q, k, v = (randn(1, n, 1, 16, dtype=torch.float64) for n in (sq, sk, sk))
        rel = randn(1, 41, dtype=torch.float64)
        ours, ref = _block_fns(S, q0, k0, causal, window, alibi_slopes(1).double(), 2.0,
                               dropout_p, 5, 9)
        check_against_reference(ours, ref, [q, k, v, rel], ["dq", "dk", "dv", "drel_bias"])
    finally:
        torch.set_num_threads(before)
