"""Masks (issue 14): sliding window, key padding, packed sequences (attention_varlen), the
lse gradient (issue 18 item 1) and "a key a row cannot see never affects that row" (issue 18
item 4). Values, lse and gradients against attn_ext.reference in float64 with DESIGN.md's
tolerance rule; gradcheck, opcheck, torch.compile / torch.export / TorchScript; bad input."""

import random

import pytest
import torch

import attn_ext
from attn_ext import reference
from tests.reference_checks import check_against_reference as _check
from tests.utils import max_err, randn

LOW = [torch.float32, torch.bfloat16, torch.float16]


def _finite_lse(lse):
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def check_against_reference(ours_fn, ref_fn, q, k, v):
    _check(ours_fn, ref_fn, [q, k, v], ["dq", "dk", "dv"])


def random_padding(B, Sk, kind):
    if kind == "random":
        m = torch.rand(B, Sk) > 0.3
        m[0] = False  # a fully padded batch row: every query row sees nothing
        return m
    lengths = torch.randint(0, Sk + 1, (B,))
    lengths[-1] = Sk
    j = torch.arange(Sk)[None]
    if kind == "left":  # generation: the prompt ends at the last key
        return j >= (Sk - lengths)[:, None]
    return j < lengths[:, None]  # right padding (training)


# (B, Sq, Sk, H, Hkv, D, Dv): odd sizes, Sq != Sk both ways, GQA, Dv != D; long enough to
# have full, partial and invisible tiles of the CPU kernels (96 x 96).
SHAPES = [
    (2, 97, 97, 2, 1, 16, 16),
    (1, 250, 300, 4, 2, 32, 24),
    (2, 300, 130, 2, 2, 8, 8),
    (3, 5, 400, 6, 2, 16, 16),  # decoding-like: query heads packed per tile, split-KV
]
WINDOWS = [None, (20, 0), (0, 0), (50, 7), (-1, 3), (100, -1), (4, 4)]


@pytest.mark.parametrize("dtype", [torch.float64] + LOW)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_window_and_padding(dtype, shape, causal):
    B, Sq, Sk, H, Hkv, D, Dv = shape
    q = randn(B, Sq, H, D, dtype=dtype)
    k = randn(B, Sk, Hkv, D, dtype=dtype)
    v = randn(B, Sk, Hkv, Dv, dtype=dtype)
    cases = [(w, None) for w in random.sample(WINDOWS, 3)]
    cases += [(random.choice(WINDOWS), random_padding(B, Sk, kind)) for kind in ("random", "left", "right")]
    for window, kpm in cases:
        def ours(q, k, v):
            return attn_ext.attention(q, k, v, causal=causal, window=window, key_padding_mask=kpm,
                                      return_lse=True)

        def ref(q, k, v):
            return reference.attention_with_lse(q, k, v, causal, None, window, kpm)

        check_against_reference(ours, ref, q, k, v)


def random_cu_seqlens(n, max_len, allow_empty=True):
    lengths = torch.randint(0 if allow_empty else 1, max_len + 1, (n,))
    if allow_empty and n > 1:
        lengths[random.randrange(n)] = 0
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu, int(lengths.max()) if n else 0


@pytest.mark.parametrize("dtype", [torch.float64] + LOW)
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, (30, 0)), (False, (9, 4))])
def test_varlen(dtype, causal, window):
    H, Hkv, D, Dv = 4, 2, 16, 24
    cu_q, max_q = random_cu_seqlens(5, 150)
    cu_k, max_k = random_cu_seqlens(5, 200)  # Sq != Sk per sequence, both ways
    Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
    q = randn(Tq, H, D, dtype=dtype)
    k = randn(Tk, Hkv, D, dtype=dtype)
    v = randn(Tk, Hkv, Dv, dtype=dtype)

    def ours(q, k, v):
        return attn_ext.attention_varlen(q, k, v, cu_q, cu_k, max_q + 3, max_k, causal=causal,
                                         window=window, return_lse=True)

    def ref(q, k, v):
        return reference.attention_varlen_with_lse(q, k, v, cu_q, cu_k, causal, None, window)

    check_against_reference(ours, ref, q, k, v)


def test_varlen_equals_padded_batch():
    """Packed sequences give what the same sequences give alone (batch of 1 each)."""
    H, D = 2, 16
    lengths = [7, 130, 1, 64]
    xs = [randn(n, H, D) for n in lengths]
    packed = torch.cat(xs)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lengths), 0).tolist(), dtype=torch.int32)
    out = attn_ext.attention_varlen(packed, packed, packed, cu, cu, max(lengths), max(lengths),
                                    causal=True, window=(40, 0))
    for x, a, b in zip(xs, cu[:-1].tolist(), cu[1:].tolist()):
        alone = attn_ext.attention(x[None], x[None], x[None], causal=True, window=(40, 0))[0]
        assert max_err(out[a:b], alone) < 1e-6


def test_varlen_empty_batch():
    q = randn(0, 2, 8)
    cu = torch.zeros(1, dtype=torch.int32)
    out, lse = attn_ext.attention_varlen(q, q, q, cu, cu, 0, 0, causal=True, return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


# ---- gradcheck / opcheck ----------------------------------------------------------------


def test_gradcheck_masks_out_and_lse():
    """gradcheck of a loss using both out and lse (issue 18 item 1), with window + padding."""
    B, Sq, Sk, H, Hkv, D = 2, 6, 9, 2, 1, 4
    q = randn(B, Sq, H, D, dtype=torch.float64).requires_grad_()
    k = randn(B, Sk, Hkv, D, dtype=torch.float64).requires_grad_()
    v = randn(B, Sk, Hkv, 5, dtype=torch.float64).requires_grad_()
    kpm = torch.rand(B, Sk) > 0.3
    kpm[:, -1] = True

    def f(q, k, v):
        out, lse = attn_ext.attention(q, k, v, causal=True, window=(3, 0), key_padding_mask=kpm,
                                      return_lse=True)
        return out, _finite_lse(lse)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_lse_gradient_issue18_repro():
    """lse.sum().backward() must reach q (it was dropped: q.grad all zeros)."""
    q, k, v = [randn(1, 5, 2, 8, dtype=torch.float64).requires_grad_() for _ in range(3)]
    out, lse = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    lse.sum().backward()
    q2, k2, v2 = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    reference.attention_with_lse(q2, k2, v2, True)[1].sum().backward()
    assert q.grad.abs().max() > 0.1
    assert max_err(q.grad, q2.grad) < 1e-12 and max_err(k.grad, k2.grad) < 1e-12
    assert v2.grad is None and (v.grad == 0).all()  # lse does not depend on v


def test_gradcheck_varlen():
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    q = randn(8, 2, 4, dtype=torch.float64).requires_grad_()
    k = randn(9, 1, 4, dtype=torch.float64).requires_grad_()
    v = randn(9, 1, 3, dtype=torch.float64).requires_grad_()

    def f(q, k, v):
        out, lse = attn_ext.attention_varlen(q, k, v, cu_q, cu_k, 5, 4, causal=True,
                                             window=(2, 0), return_lse=True)
        return out, _finite_lse(lse)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_opcheck_masks():
    ops = torch.ops.attn_ext
    q = randn(2, 7, 4, 8, dtype=torch.float32).requires_grad_()
    k = randn(2, 11, 2, 8, dtype=torch.float32).requires_grad_()
    v = randn(2, 11, 2, 8, dtype=torch.float32).requires_grad_()
    kpm = torch.rand(2, 11) > 0.4
    torch.library.opcheck(ops.attention_forward.default, (q, k, v, True, None, 3, 0, kpm))
    torch.library.opcheck(ops.attention_forward.default, (q, k, v, False, 0.3, 2, 2, None))
    with torch.no_grad():
        out, lse = ops.attention_forward(q, k, v, True, None, 3, 0, kpm)
    dout = randn(*out.shape)
    dlse = randn(*lse.shape)
    torch.library.opcheck(ops.attention_backward.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, True, None, 3, 0, kpm, dlse))
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11], dtype=torch.int32)
    qv, kv, vv = [t.detach()[0].requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(ops.attention_varlen_forward.default, (qv, kv, vv, cu_q, cu_k, 4, 6, True, None, 2, 0))
    with torch.no_grad():
        out, lse = ops.attention_varlen_forward(qv, kv, vv, cu_q, cu_k, 4, 6, True, None, 2, 0)
    torch.library.opcheck(ops.attention_varlen_backward.default,
                          (randn(*out.shape), qv.detach(), kv.detach(), vv.detach(), out, lse, cu_q,
                           cu_k, 4, 6, True, None, 2, 0, randn(*lse.shape)))


# ---- a key a row cannot see never affects that row (issue 18 item 4) --------------------

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _assert_near(a, b, name):
    err = (a.double() - b.double()).abs().max().item()
    bound = TOL[a.dtype] * max(1.0, b.double().abs().max().item())
    assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_masked_nonfinite_forward_issue18_repro(dtype, bad):
    """causal, S = 80, v[0, 40] = inf made rows 0-39 NaN (0 * inf inside the diagonal tile)."""
    q, k, v = [randn(1, 80, 1, 16, dtype=dtype) for _ in range(3)]
    good = attn_ext.attention(q, k, v, causal=True)
    v[0, 40, 0, :] = bad
    k[0, 41, 0, 3] = bad
    out = attn_ext.attention(q, k, v, causal=True)
    # finite and the clean values (up to the summation order of the exact masked product)
    assert torch.isfinite(out[0, :40]).all()
    _assert_near(out[0, :40], good[0, :40], "out")
    assert not torch.isfinite(out[0, 41:]).all(dim=-1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("masking", ["window", "padding", "varlen"])
def test_masked_nonfinite_backward(dtype, masking):
    """A non-finite k / v / q / dout reaches only the gradients that depend on it."""
    S, H, D, bad_j = 200, 2, 16, 100
    q, k, v = [randn(1, S, H, D, dtype=dtype) for _ in range(3)]
    dout = randn(1, S, H, D, dtype=dtype)
    kw = {}
    if masking == "window":
        kw = dict(causal=True, window=(10, 0))  # key 100 is seen by rows 100..110 only
        clean_rows, clean_keys = slice(0, 100), slice(0, 89)
    elif masking == "padding":
        kpm = torch.ones(1, S, dtype=torch.bool)
        kpm[0, bad_j] = False
        kw = dict(causal=True, key_padding_mask=kpm)
        clean_rows, clean_keys = slice(0, S), slice(0, S)
    else:
        clean_rows, clean_keys = slice(0, 100), slice(0, 100)

    def grads(q, k, v, dout):
        q, k, v = [t.detach().requires_grad_() for t in (q, k, v)]
        if masking == "varlen":
            cu = torch.tensor([0, 100, S], dtype=torch.int32)
            out = attn_ext.attention_varlen(q[0], k[0], v[0], cu, cu, 100, 100, causal=True)[None]
        else:
            out = attn_ext.attention(q, k, v, **kw)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    clean = grads(q, k, v, dout)
    k[0, bad_j, 0, 2] = float("inf")
    v[0, bad_j, 1, 5] = float("nan")
    if masking == "varlen":  # a bad q / dout in the second sequence, too
        q[0, 150, 0, 1] = float("inf")
        dout[0, 160, 1, 0] = float("nan")
    dirty = grads(q, k, v, dout)
    for name, a, b, sl in zip(["out", "dq", "dk", "dv"], clean, dirty,
                              [clean_rows, clean_rows, clean_keys, clean_keys]):
        rows = list(range(*sl.indices(S)))
        if masking == "padding" and name in ("dk", "dv"):
            rows = [j for j in rows if j != bad_j]
        assert torch.isfinite(b[0, rows]).all(), f"{name}: a masked non-finite value leaked"
        _assert_near(b[0, rows], a[0, rows], name)
    if masking == "padding":  # the padded key's own gradients are exactly 0
        assert (dirty[2][0, bad_j] == 0).all() and (dirty[3][0, bad_j] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("masking", ["window", "padding"])
def test_nonfinite_rows_stay_out_of_the_keys_they_cannot_see(dtype, bad, masking):
    """A visible non-finite k makes the rows that see it non-finite; those rows must not reach
    dv / dk of keys they cannot see (a hidden pair's P is exactly 0, whatever the row's lse).
    The keys past the bad rows' reach lie in a later key tile than the bad key, on a partial
    tile of the bad rows' query block."""
    if masking == "window":
        S, D, bad_j = 300, 40, 286
        kw = dict(window=(3, 2))  # key 286 is seen by rows 284..289, which see keys 281..291
        reach = set(range(281, 292))
    else:
        S, D, bad_j = 128, 8, 0
        kpm = torch.ones(1, S, dtype=torch.bool)
        kpm[0, -1] = False  # the last key is seen by no row
        kw = dict(key_padding_mask=kpm)
        reach = set(range(S - 1))
    q, k, v = [randn(1, S, 2, D, dtype=dtype) for _ in range(3)]
    if masking == "padding":
        q = torch.ones_like(q)  # every row's score with key 0 is inf: every row is non-finite
    dout = randn(1, S, 2, D, dtype=dtype)

    def grads(k):
        qq, kk, vv = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attn_ext.attention(qq, kk, vv, **kw)
        out.backward(dout)
        return out.detach(), qq.grad, kk.grad, vv.grad

    clean = grads(k)
    k = k.clone()
    k[0, bad_j, 0, 0] = bad
    dirty = grads(k)
    keys = [j for j in range(S) if j not in reach]
    for name, a, b in zip(["dk", "dv"], clean[2:], dirty[2:]):
        assert torch.isfinite(b[0, keys]).all(), f"{name}: a non-finite row leaked into {name}"
        _assert_near(b[0, keys], a[0, keys], name)
    if masking == "padding":  # the padded key's own gradients are exactly 0
        assert (dirty[2][0, -1] == 0).all() and (dirty[3][0, -1] == 0).all()
    else:  # rows that do not see the bad key keep their values
        rows = [i for i in range(S) if not 284 <= i <= 289]
        for name, a, b in zip(["out", "dq"], clean[:2], dirty[:2]):
            _assert_near(b[0, rows], a[0, rows], name)


def test_masked_tiles_are_skipped_bitwise_equal_to_dense_on_visible_part():
    """A window wider than the sequence is the same numbers as no window (same tiles)."""
    q, k, v = [randn(2, 150, 2, 32) for _ in range(3)]
    a = attn_ext.attention(q, k, v, causal=True)
    b = attn_ext.attention(q, k, v, causal=True, window=(1000, 1000))
    assert torch.equal(a, b)


def test_backward_deterministic_with_masks():
    q, k, v = [randn(2, 300, 4, 32).requires_grad_() for _ in range(3)]
    kpm = torch.rand(2, 300) > 0.2
    runs = []
    for _ in range(2):
        out = attn_ext.attention(q, k, v, causal=True, window=(64, 0), key_padding_mask=kpm)
        runs.append(torch.autograd.grad(out.sum(), (q, k, v)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ---- deployment -----------------------------------------------------------------------


def _masked(q, k, v, kpm):
    return attn_ext.attention(q, k, v, causal=True, window=(8, 0), key_padding_mask=kpm)


def test_compile_fullgraph_masks_and_varlen():
    q, k, v = [randn(2, 40, 2, 16).requires_grad_() for _ in range(3)]
    kpm = torch.rand(2, 40) > 0.3
    compiled = torch.compile(_masked, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, kpm)
    assert max_err(out, _masked(q, k, v, kpm)) == 0
    g = torch.autograd.grad(out.sum(), (q, k, v))
    g_ref = torch.autograd.grad(_masked(q, k, v, kpm).sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        assert max_err(a, b) < 1e-6

    cu = torch.tensor([0, 10, 40], dtype=torch.int32)

    def varlen(q, k, v):
        return attn_ext.attention_varlen(q, k, v, cu, cu, 30, 30, causal=True, window=(5, 0))

    qv, kv, vv = [t[0] for t in (q, k, v)]
    out = torch.compile(varlen, fullgraph=True, backend="aot_eager")(qv, kv, vv)
    assert max_err(out, varlen(qv, kv, vv)) == 0


def test_export_masks():
    class M(torch.nn.Module):
        def forward(self, q, k, v, kpm):
            return _masked(q, k, v, kpm)

    q, k, v = [randn(2, 40, 2, 16) for _ in range(3)]
    kpm = torch.rand(2, 40) > 0.3
    ep = torch.export.export(M(), (q, k, v, kpm))
    assert "attn_ext.attention_forward" in str(ep.graph)
    assert max_err(ep.module()(q, k, v, kpm), _masked(q, k, v, kpm)) == 0


def test_torchscript_masks_and_old_schemas():
    @torch.jit.script
    def f(q, k, v, kpm):
        a = torch.ops.attn_ext.attention_forward(q, k, v, True, None, 8, 0, kpm)[0]
        b = torch.ops.attn_ext.attention_forward(q, k, v, True)[0]  # the original call
        c = torch.ops.attn_ext.attention(q, k, v, True)
        return a, b, c

    q, k, v = [randn(2, 40, 2, 16) for _ in range(3)]
    kpm = torch.rand(2, 40) > 0.3
    a, b, c = f(q, k, v, kpm)
    assert torch.equal(a, _masked(q, k, v, kpm))
    assert torch.equal(b, c)


# ---- bad input ------------------------------------------------------------------------


def test_bad_window():
    q = randn(1, 4, 1, 8)
    for window, msg in [((-2, 0), "window"), ((1,), "window"), ((1.5, 0), "window"), ("ab", "window")]:
        with pytest.raises(ValueError, match=msg):
            attn_ext.attention(q, q, q, window=window)
    with pytest.raises(RuntimeError, match="window"):
        torch.ops.attn_ext.attention_forward(q, q, q, False, None, -3, 0)
    # sides past int64 (torch's parser alone says "expected int, found int")
    for window in [(0, 2**63), (2**63, 0), (2**64, -1)]:
        with pytest.raises(ValueError, match=r"window sides must be below 2\*\*63"):
            attn_ext.attention(q, q, q, window=window)
    big = 2**63 - 1  # the largest side: unbounded in effect
    assert torch.equal(attn_ext.attention(q, q, q, window=(big, big)), attn_ext.attention(q, q, q))


def test_bad_key_padding_mask():
    q = randn(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="key_padding_mask must be bool"):
        attn_ext.attention(q, q, q, key_padding_mask=torch.ones(2, 4))
    with pytest.raises(RuntimeError, match=r"key_padding_mask must have shape \(B, Sk\) = \(2, 4\)"):
        attn_ext.attention(q, q, q, key_padding_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="key_padding_mask must have shape"):
        attn_ext.attention(q, q, q, key_padding_mask=torch.ones(4, dtype=torch.bool))


def test_positional_causal_is_refused():
    q = randn(1, 4, 1, 8)
    with pytest.raises(TypeError):
        attn_ext.attention(q, q, q, True)


def test_bad_cu_seqlens():
    q = randn(10, 2, 8)
    good = torch.tensor([0, 4, 10], dtype=torch.int32)

    def call(cu_q=good, cu_k=good, mq=6, mk=6, qq=q):
        return attn_ext.attention_varlen(qq, qq, qq, cu_q, cu_k, mq, mk)

    call()
    cases = [
        (dict(cu_q=good.long()), "cu_seqlens_q must be int32"),
        (dict(cu_k=good[None]), r"cu_seqlens_k must have shape \(N \+ 1,\)"),
        (dict(cu_q=torch.tensor([1, 4, 10], dtype=torch.int32)), "cu_seqlens_q must start at 0"),
        (dict(cu_k=torch.tensor([0, 7, 4], dtype=torch.int32), mk=10), "cu_seqlens_k must be non-decreasing"),
        (dict(cu_q=torch.tensor([0, 4, 9], dtype=torch.int32)), "cu_seqlens_q must end at the number of packed rows 10"),
        (dict(cu_q=torch.tensor([0, 4, 11], dtype=torch.int32), mq=7), "cu_seqlens_q must end"),
        (dict(mq=5), "max_seqlen_q = 5 is smaller than sequence 1"),
        (dict(mk=-1), "max_seqlen_k must be >= 0"),
        (dict(cu_k=torch.tensor([0, 10], dtype=torch.int32), mk=10), "as many sequences"),
        (dict(qq=randn(1, 10, 2, 8)), r"q must have 3 dims \(Tq, H, D\)"),
    ]
    for kw, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            call(**kw)


def test_varlen_errors_show_the_packed_shapes():
    """Shape and stride errors of the packed ops show the (T, H, D) tensors the caller passed,
    not the (1, T, H, D) views the kernels read them through."""
    T, H, D = 10, 2, 8
    q, k = randn(T, H, D), randn(T, H, D)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    cases = [
        ((q, k[..., :4], k), r"k must have head dim D = 8 \(from q\), got shape \[10, 2, 4\]"),
        ((randn(T, 3, D), k, k), r"got k shape \[10, 2, 8\] and q shape \[10, 3, 8\]"),
        ((q, k, randn(T, 1, D)), r"v must have Hkv = 2 heads \(from k\), got shape \[10, 1, 8\]"),
        ((randn(T, H, 2 * D)[..., ::2], k, k), r"q must have a contiguous last dim \(stride 1\), got strides \[32, 16, 2\]"),
    ]
    for args, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            attn_ext.attention_varlen(*args, cu, cu, 6, 6)
    out, lse = torch.ops.attn_ext.attention_varlen_forward(q, k, k, cu, cu, 6, 6, False)
    bwd = torch.ops.attn_ext.attention_varlen_backward
    for (dout, o, l), msg in [
        ((out[:5], out, lse), r"dout must have shape \[10, 2, 8\] \(Tq, H, Dv\), got \[5, 2, 8\]"),
        ((out, out[:, :1], lse), r"out must have shape \[10, 2, 8\] \(Tq, H, Dv\)"),
        ((out, out, lse[:1]), r"lse must have shape \[2, 10\] \(H, Tq\), got \[1, 10\]"),
        ((randn(T, H, 2 * D)[..., ::2], out, lse), r"dout must have a contiguous last dim \(stride 1\), got strides \[32, 16, 2\]"),
    ]:
        with pytest.raises(RuntimeError, match=msg):
            bwd(dout, q, k, k, o, l, cu, cu, 6, 6, False)


def test_bad_dlse():
    q = randn(1, 4, 2, 8)
    out, lse = torch.ops.attn_ext.attention_forward(q, q, q, True)
    with pytest.raises(RuntimeError, match="dlse must have lse's shape"):
        torch.ops.attn_ext.attention_backward(out, q, q, q, out, lse, True, None, -1, -1, None, lse[0])
    with pytest.raises(RuntimeError, match="dlse must have lse's dtype"):
        torch.ops.attn_ext.attention_backward(out, q, q, q, out, lse, True, None, -1, -1, None, lse.double())


# ---- modules ----------------------------------------------------------------------------


def _mha_reference(layer, x, key_padding_mask, window):
    B, S, _ = x.shape
    H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    qkv = layer.qkv(x)
    q = qkv[..., : H * D].view(B, S, H, D)
    k = qkv[..., H * D : (H + Hkv) * D].view(B, S, Hkv, D)
    v = qkv[..., (H + Hkv) * D :].view(B, S, Hkv, D)
    out = reference.attention(q, k, v, layer.causal, layer.scale, window, key_padding_mask)
    return layer.out_proj(out.reshape(B, S, H * D))


@pytest.mark.parametrize("causal", [True, False])
def test_mha_key_padding_and_window(causal):
    layer = attn_ext.MultiHeadAttention(32, 4, 2, causal=causal, window=(5, 0 if causal else 2)).double()
    x = randn(3, 20, 32, dtype=torch.float64)
    kpm = random_padding(3, 20, "random")
    out, _ = layer(x, key_padding_mask=kpm)
    assert max_err(out, _mha_reference(layer, x, kpm, layer_window(layer))) < 1e-12
    scripted = torch.jit.script(layer)
    assert max_err(scripted(x, None, None, False, kpm)[0], out) < 1e-12
    out_w, w = layer(x, key_padding_mask=kpm, need_weights=True)  # weights honour the masks
    assert max_err(out_w, out) < 1e-12
    keep = reference.visibility_mask(20, 20, causal, layer_window(layer), kpm)
    assert torch.all(w[~keep.expand_as(w)] == 0)
    assert max_err(scripted(x, None, None, True, kpm)[1], w) < 1e-12


def layer_window(layer):
    return (layer.window_left, layer.window_right)


@pytest.mark.parametrize("pos", ["rope", "learned", "sinusoidal"])
def test_generate_left_padded_batch_equals_each_row_alone(pos):
    from attn_ext.models import TinyGPT

    model = TinyGPT(50, d_model=32, num_heads=4, num_layers=2, max_len=64, pos=pos,
                    num_kv_heads=2).double().eval()
    prompts = [torch.randint(0, 50, (n,)) for n in (3, 9, 1, 6)]
    S = max(len(p) for p in prompts)
    idx = torch.zeros(len(prompts), S, dtype=torch.long)
    mask = torch.zeros(len(prompts), S, dtype=torch.long)
    for b, p in enumerate(prompts):
        idx[b, S - len(p):] = p
        mask[b, S - len(p):] = 1
    out = model.generate(idx, 8, attention_mask=mask)
    for b, p in enumerate(prompts):
        alone = model.generate(p[None], 8)[0, len(p):]
        assert torch.equal(out[b, S:], alone), f"row {b}"
    # the same batch without a cache: the real tokens' logits are each row's own
    logits = model(idx, attention_mask=mask)
    for b, p in enumerate(prompts):
        assert max_err(logits[b, S - len(p):], model(p[None])[0]) < 1e-10
    with pytest.raises(ValueError, match="left-padded"):
        model.generate(idx, 2, attention_mask=mask.flip(1))


def test_kv_cache_per_row_lengths():
    layer = attn_ext.MultiHeadAttention(16, 2)
    cache = layer.new_kv_cache(3, 10)
    cache.set_left_padding(torch.tensor([2, 0, 4]))
    cache.update(randn(3, 5, 2, 8), randn(3, 5, 2, 8))
    assert cache.lengths().tolist() == [3, 5, 1]
    assert cache.key_padding_mask()[2].tolist() == [False] * 4 + [True]
    assert cache.positions(2).tolist() == [[3, 4], [5, 6], [1, 2]]
    with pytest.raises(RuntimeError, match="before the first update"):
        cache.set_left_padding(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"start must have shape \(B,\) = \(3,\)"):
        layer.new_kv_cache(3, 10).set_left_padding(torch.zeros(2, dtype=torch.long))
