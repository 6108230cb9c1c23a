"""lse of rows that meet a non-finite value (DESIGN.md: lse is the log-sum-exp of the row's
scores; reference.py takes it with torch.logsumexp): NaN when a visible score is NaN, +inf when
one is +inf and none is NaN, the clean value when the non-finite value is hidden or a -inf
score. The kernels' online softmax subtracts a running max, which turns a +inf score into
exp(inf - inf) = NaN; common/row_lse.h settles those rows. Every CPU path is asked: the tiled
kernels, split-KV, the decode kernel, packed sequences, sinks and the score terms."""

from __future__ import annotations

import itertools

import pytest
import torch

import attn_ext as A
from attn_ext import reference as R
from tests.utils import with_threads

INF, NAN = float("inf"), float("nan")


def _same_non_finite(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    for name, f in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        a, b = f(ours), f(ref)
        assert torch.equal(a, b), f"{what}: {name} at {a.sum().item()} places, the reference at {b.sum().item()}"


def _check(ours, ref, dtype, what):
    (out, lse), (ref_out, ref_lse) = ours, ref
    _same_non_finite(out, ref_out, what + " out")
    _same_non_finite(lse, ref_lse, what + " lse")
    fin = torch.isfinite(ref_lse)
    tol = 1e-9 if dtype == torch.float64 else (2e-5 if dtype == torch.float32 else 3e-2)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], rtol=tol, atol=tol)


def _inputs(dtype, B, Sq, Sk, H, Hkv, D, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=g, dtype=torch.float64).to(dtype)
            for S, h in ((Sq, H), (Sk, Hkv), (Sk, Hkv))]


# (Sq, Sk): tiles, decode (few rows, many keys), split-KV (one tile, many keys)
SHAPES = [(6, 6), (1, 300), (3, 700), (40, 1100), (130, 130)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Sq,Sk", SHAPES)
@pytest.mark.parametrize("where", ["q", "k"])
def test_lse_of_a_row_with_a_non_finite_score_is_the_references(dtype, Sq, Sk, where):
    for n, (bad, causal) in enumerate(itertools.product((INF, -INF, NAN), (False, True))):
        q, k, v = _inputs(dtype, 2, Sq, Sk, 4, 2, 32, seed=17 * Sq + Sk + n)
        t = q if where == "q" else k
        # one element of batch 0, kv head 0 (query heads 0, 1): its scores have both signs
        t[0, min(2, t.shape[1] - 1), 0, 5] = bad
        if where == "k":
            t[1, t.shape[1] // 2, 1, 0] = bad  # and one in the middle of batch 1, kv head 1
        ours = A.attention(q, k, v, causal=causal, return_lse=True)
        ref = R.attention_with_lse(q.double(), k.double(), v.double(), causal=causal)
        _check(ours, ref, dtype, f"{where}={bad} causal={causal}")


@pytest.mark.parametrize("threads", [1, 3])
def test_split_kv_and_decode_settle_the_same_rows_at_any_thread_count(threads):
    # one row, 4096 keys: the decode kernel and split-KV chunks; +inf in one chunk only
    q, k, v = _inputs(torch.float32, 1, 1, 4096, 8, 2, 64, seed=3)
    k[0, 3001, 0, :] = INF
    q[0, 0, :4, :] = q[0, 0, :4, :].abs()  # heads 0..3 (kv head 0) see +inf at key 3001
    ours = with_threads(threads, lambda: A.attention(q, k, v, return_lse=True))
    ref = R.attention_with_lse(q.double(), k.double(), v.double())
    _check(ours, ref, torch.float32, "decode")
    assert torch.isposinf(ours[1][0, :4]).all() and torch.isfinite(ours[1][0, 4:]).all()


def test_sinks_terms_and_padding_settle_rows_by_the_same_rule():
    q, k, v = _inputs(torch.float64, 2, 7, 9, 4, 2, 16, seed=5)
    q[0, 3, 1, 2] = INF
    kpm = torch.ones(2, 9, dtype=torch.bool)
    kpm[1, 4] = False
    k[1, 4, 0, 0] = NAN  # hidden by padding: no row may see it
    rel = torch.randn(4, 2 * 3 + 1, dtype=torch.float64)
    rel[2, 3] = INF  # d = 0 of head 2: a +inf score from the table alone
    sinks = torch.randn(4, dtype=torch.float64)
    sinks[3] = NAN  # head 3: every row NaN
    for kw in ({}, {"sinks": sinks}, {"rel_bias": rel}, {"softcap": 5.0}, {"alibi_slopes": torch.rand(4, dtype=torch.float64)}):
        for causal, window in ((False, None), (True, None), (False, (2, 1))):
            ours = A.attention(q, k, v, causal=causal, window=window, key_padding_mask=kpm,
                               return_lse=True, **kw)
            ref = R.attention_with_lse(q, k, v, causal=causal, window=window, key_padding_mask=kpm, **kw)
            _check(ours, ref, torch.float64, f"{kw.keys()} causal={causal} window={window}")
    # softcap makes a +inf score finite (softcap * tanh(inf) = softcap): the row stays finite
    ours = A.attention(q, k, v, softcap=5.0, key_padding_mask=kpm, return_lse=True)
    assert torch.isfinite(ours[1][0, 1, 3])


def test_packed_sequences_settle_their_own_rows():
    g = torch.Generator().manual_seed(9)
    q, k, v = [torch.randn(n, h, 16, generator=g, dtype=torch.float64) for n, h in ((10, 4), (12, 2), (12, 2))]
    cq, ck = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    k[7, 1, 0] = INF  # sequence 1, its key 2, kv head 1
    k[2, 0, 0] = NAN  # sequence 0, its key 2, kv head 0
    for causal in (False, True):
        ours = A.attention_varlen(q, k, v, cq, ck, 6, 7, causal=causal, return_lse=True)
        ref = R.attention_varlen_with_lse(q, k, v, cq, ck, causal=causal)
        _check(ours, ref, torch.float64, f"varlen causal={causal}")


def test_a_settled_row_backpropagates_like_the_reference():
    # lse +inf: probability 0 at every finite score and NaN at the +inf key, as the reference's
    # exp(s - lse); so dv is NaN at that key only, not at every key the row sees
    q, k, v = _inputs(torch.float64, 1, 5, 6, 2, 1, 8, seed=11)
    k[0, 2, 0, 3] = INF
    q[0, :, :, 3] = q[0, :, :, 3].abs()  # every row sees +inf at key 2
    qs, ks, vs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = A.attention(qs, ks, vs, return_lse=True)
    assert torch.isposinf(lse).all()
    qr, kr, vr = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = R.attention_with_lse(qr, kr, vr)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, (qs, ks, vs), go)
    want = torch.autograd.grad(ref_out, (qr, kr, vr), go)
    for name, a, b in zip("qkv", got, want):
        _same_non_finite(a, b, "d" + name)
    assert torch.isnan(got[2][0, 2]).all() and torch.isfinite(got[2][0, [0, 1, 3, 4, 5]]).all()


@pytest.mark.parametrize("Sk", [3, 700])
def test_a_plus_inf_sink_meets_nan_and_inf_scores_as_logsumexp_does(Sk):
    # a +inf sink took all the weight (out 0, lse +inf) even where a NaN score met it;
    # torch.logsumexp over the scores and the sink gives NaN there, and +inf beside a +inf score
    # (whose row's out is NaN, as the reference's probability at that key)
    q, k, v = _inputs(torch.float64, 1, 3, Sk, 2, 1, 8, seed=13)
    q[0, :, :, 0] = q[0, :, :, 0].abs()
    k[0, 1, 0, 0] = NAN if Sk == 3 else INF
    k[0, Sk - 1, 0, 1] = INF if Sk == 3 else NAN
    sinks = torch.tensor([INF, 0.5], dtype=torch.float64)
    for causal in (False, True):
        ours = A.attention(q, k, v, causal=causal, sinks=sinks, return_lse=True)
        ref = R.attention_with_lse(q, k, v, causal=causal, sinks=sinks)
        _check(ours, ref, torch.float64, f"sink +inf causal={causal}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Sq,Sk", [(1, 3), (1, 700), (1, 4096), (40, 700), (130, 130)])
def test_rows_whose_scores_are_all_minus_inf_meet_a_nan_v_at_any_thread_count(dtype, Sq, Sk):
    # every visible score -inf (k's channel 0 is +inf, q's -1): probability 0 everywhere, lse
    # -inf, and 0 * v at a visible key, NaN where v is (the reference's; the tiled kernel's).
    # The decode kernel and split-KV merges skipped such chunks (out 0), so the answer changed
    # with the thread count.
    q = torch.ones(1, Sq, 2, 8, dtype=dtype)
    q[..., 0] = -1
    k = torch.randn(1, Sk, 1, 8).to(dtype)
    k[..., 0] = INF
    v = torch.zeros(1, Sk, 1, 3, dtype=dtype)
    v[0, Sk // 2, 0, 1] = NAN
    v[0, Sk - 1, 0, 2] = INF
    ref = R.attention_with_lse(q.double(), k.double(), v.double())
    results = []
    for threads in (1, 3):
        ours = with_threads(threads, lambda: A.attention(q, k, v, return_lse=True))
        _check(ours, ref, dtype, f"threads={threads}")
        results.append(ours)
    assert torch.isnan(results[0][0][..., 1:]).all() and torch.isneginf(results[0][1]).all()
    assert torch.equal(results[0][0][..., 0], torch.zeros_like(results[0][0][..., 0]))
    for a, b in zip(*results):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
