"""Score terms (issue 15): rel_bias (with its gradient), ALiBi, softcap, sinks (with its
gradient) and attention dropout, alone and combined with the masks (window, key padding,
packed sequences). Values, lse and every gradient against attn_ext.reference in float64 with
DESIGN.md's tolerance rule; gradcheck, opcheck of the four attention ops; dropout's keep bits
read back from the kernel and compared bit for bit with reference.dropout_keep_mask across
tilings, query splits and thread counts; the keep rate; torch.manual_seed; bad input."""

import random

import pytest
import torch

import attn_ext
from attn_ext import ops, reference
from attn_ext.position_bias import RelativePositionBias, alibi_slopes
from tests.reference_checks import check_against_reference
from tests.utils import max_err, randn

LOW = [torch.float32, torch.bfloat16, torch.float16]
ALL = [torch.float64] + LOW


def make_terms(kind, H, B, dtype, M):
    """(alibi_slopes, rel_bias, softcap, sinks) for a named combination."""
    alibi = rel = cap = sinks = None
    if "alibi" in kind:
        alibi = alibi_slopes(H) if "batch" not in kind else torch.rand(B, H) * 0.5
    if "rel" in kind:
        rel = randn(H, 2 * M + 1, dtype=dtype)
    if "softcap" in kind:
        cap = random.choice([1.5, 5.0, 30.0])
    if "sinks" in kind:
        sinks = randn(H, dtype=dtype)
    return alibi, rel, cap, sinks


KINDS = ["rel", "alibi", "alibi_batch", "softcap", "sinks", "rel+softcap", "alibi+sinks",
         "rel+alibi+softcap+sinks"]
# (B, Sq, Sk, H, Hkv, D, Dv): odd sizes, Sq != Sk both ways, GQA, Dv != D; long enough for
# full, partial and invisible tiles of the CPU kernels (96 x 96); a decode-like shape.
SHAPES = [
    (2, 97, 97, 2, 1, 16, 16),
    (1, 250, 300, 4, 2, 32, 24),
    (2, 300, 130, 2, 2, 8, 8),
    (3, 5, 400, 6, 2, 16, 16),
]
WINDOWS = [None, (20, 0), (50, 7), (-1, 3), (4, 4)]


def _padding(B, Sk):
    m = torch.rand(B, Sk) > 0.3
    m[0] = False  # a fully padded batch row: every query row sees nothing (sinks: lse = sink)
    return m


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_terms_vs_reference(dtype, shape, causal):
    B, Sq, Sk, H, Hkv, D, Dv = shape
    q = randn(B, Sq, H, D, dtype=dtype)
    k = randn(B, Sk, Hkv, D, dtype=dtype)
    v = randn(B, Sk, Hkv, Dv, dtype=dtype)
    for kind in random.sample(KINDS, 3):
        M = random.choice([0, 5, 40, 200])  # 200 > every distance: nothing clamps
        alibi, rel, cap, sinks = make_terms(kind, H, B, dtype, M)
        window = random.choice(WINDOWS)
        kpm = _padding(B, Sk) if random.random() < 0.4 else None

        def ours(q, k, v, rel, sinks):
            return attn_ext.attention(q, k, v, causal=causal, window=window, key_padding_mask=kpm,
                                      alibi_slopes=alibi, rel_bias=rel, softcap=cap, sinks=sinks,
                                      return_lse=True)

        def ref(q, k, v, rel, sinks):
            a = None if alibi is None else alibi.to(q.dtype)
            return reference.attention_with_lse(q, k, v, causal, None, window, kpm, a, rel, cap,
                                                sinks)

        check_against_reference(ours, ref, [q, k, v, rel, sinks],
                                ["dq", "dk", "dv"] + (["drel_bias"] if rel is not None else [])
                                + (["dsinks"] if sinks is not None else []))


def _cu(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return cu


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, (30, 0)), (False, (9, 4))])
def test_varlen_terms(dtype, causal, window):
    H, Hkv, D, Dv, N = 4, 2, 16, 24, 4
    lq = [random.randint(0, 150) for _ in range(N)]
    lk = [random.randint(1, 200) for _ in range(N)]
    cu_q, cu_k = _cu(lq), _cu(lk)
    q = randn(sum(lq), H, D, dtype=dtype)
    k = randn(sum(lk), Hkv, D, dtype=dtype)
    v = randn(sum(lk), Hkv, Dv, dtype=dtype)
    alibi = torch.rand(N, H) * 0.3  # one row of slopes per sequence
    rel = randn(H, 2 * 17 + 1, dtype=dtype)
    sinks = randn(H, dtype=dtype)

    def ours(q, k, v, rel, sinks):
        return attn_ext.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                         window=window, alibi_slopes=alibi, rel_bias=rel,
                                         softcap=7.0, sinks=sinks, return_lse=True)

    def ref(q, k, v, rel, sinks):
        return reference.attention_varlen_with_lse(q, k, v, cu_q, cu_k, causal, None, window,
                                                   alibi.to(q.dtype), rel, 7.0, sinks)

    check_against_reference(ours, ref, [q, k, v, rel, sinks], ["dq", "dk", "dv", "drel_bias", "dsinks"])


@pytest.mark.parametrize("threads", [3, 16])
@pytest.mark.parametrize("sq,sk,M,kw", [
    (40, 700, 1000, dict(causal=True)),            # chunks' spans inside the table
    (40, 700, 20, dict(causal=False)),             # spans clamped at both edge buckets
    (300, 120, 50, dict(causal=True)),             # Sq > Sk: rows before the first key see none
    (150, 500, 300, dict(window=(60, 5))),         # a band: each chunk's rows are a few blocks
])
def test_rel_bias_grad_of_key_chunks(threads, sq, sk, M, kw):
    """The split backward keeps, per (kv head, key chunk) unit, only the d rel_bias buckets the
    chunk's pairs reach (attention_bwd.cpp DbSpan): the gradient still matches the reference
    wherever the spans start, end or clamp."""
    def run():
        q = randn(2, sq, 4, 16, dtype=torch.float64).requires_grad_()
        k = randn(2, sk, 1, 16, dtype=torch.float64).requires_grad_()
        v = randn(2, sk, 1, 16, dtype=torch.float64).requires_grad_()
        rel = randn(4, 2 * M + 1, dtype=torch.float64).requires_grad_()
        dout = torch.randn(2, sq, 4, 16, dtype=torch.float64)
        ours = torch.autograd.grad((attn_ext.attention(q, k, v, rel_bias=rel, **kw) * dout).sum(),
                                   (q, k, v, rel))
        ref = torch.autograd.grad((reference.attention(q, k, v, kw.get("causal", False),
                                                       window=kw.get("window"), rel_bias=rel)
                                   * dout).sum(), (q, k, v, rel))
        for name, a, r in zip(("dq", "dk", "dv", "drel_bias"), ours, ref):
            assert max_err(a, r) < 1e-9, name

    from tests.utils import with_threads
    with_threads(threads, run)


@pytest.mark.parametrize("threads", [1, 2])
def test_rel_bias_grad_partitions_and_determinism(threads):
    """One (batch, kv head) with 2 threads takes the split backward (d rel_bias from phase 1's
    (kv head, key chunk) units), with 1 thread the fused one: both match the reference, and
    each is bitwise identical from run to run."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q = randn(1, 400, 2, 16, dtype=torch.float64).requires_grad_()
        k = randn(1, 400, 1, 16, dtype=torch.float64).requires_grad_()
        v = randn(1, 400, 1, 16, dtype=torch.float64).requires_grad_()
        rel = randn(2, 2 * 64 + 1, dtype=torch.float64).requires_grad_()
        dout = torch.randn(1, 400, 2, 16, dtype=torch.float64)

        def grads(fn):
            out = fn(q, k, v, rel)
            return torch.autograd.grad((out * dout).sum(), (q, k, v, rel))

        def ours(q, k, v, rel):
            return attn_ext.attention(q, k, v, causal=True, rel_bias=rel)

        a, b = grads(ours), grads(ours)
        r = grads(lambda q, k, v, rel: reference.attention(q, k, v, True, rel_bias=rel))
        for x, y, z in zip(a, b, r):
            assert torch.equal(x, y)
            assert max_err(x, z) < 1e-9
        # float32 too: run-to-run bitwise
        qf, kf, vf, rf = (t.detach().float().requires_grad_() for t in (q, k, v, rel))
        g1 = torch.autograd.grad(attn_ext.attention(qf, kf, vf, causal=True, rel_bias=rf).sum(), rf)
        g2 = torch.autograd.grad(attn_ext.attention(qf, kf, vf, causal=True, rel_bias=rf).sum(), rf)
        assert torch.equal(g1[0], g2[0])
    finally:
        torch.set_num_threads(old)


def test_gradcheck():
    B, Sq, Sk, H, Hkv, D = 1, 6, 9, 2, 1, 4
    q = randn(B, Sq, H, D, dtype=torch.float64).requires_grad_()
    k = randn(B, Sk, Hkv, D, dtype=torch.float64).requires_grad_()
    v = randn(B, Sk, Hkv, D, dtype=torch.float64).requires_grad_()
    rel = randn(H, 2 * 3 + 1, dtype=torch.float64).requires_grad_()
    sinks = randn(H, dtype=torch.float64).requires_grad_()
    slopes = torch.tensor([0.25, 0.5])

    def f(q, k, v, rel, sinks):
        out, lse = attn_ext.attention(q, k, v, causal=True, alibi_slopes=slopes, rel_bias=rel,
                                      softcap=2.0, sinks=sinks, window=(5, 0), return_lse=True)
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v, rel, sinks))

    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    qv = randn(6, H, D, dtype=torch.float64).requires_grad_()
    kv = randn(6, Hkv, D, dtype=torch.float64).requires_grad_()

    def g(q, k, rel, sinks):
        return attn_ext.attention_varlen(q, k, k, cu, cu, 4, 4, causal=True, rel_bias=rel,
                                         softcap=3.0, sinks=sinks, return_lse=True)

    assert torch.autograd.gradcheck(g, (qv, kv, rel, sinks))


def test_gradcheck_with_dropout():
    """Dropout's backward by gradcheck: the op with a fixed seed and offset is a fixed
    function of its inputs (the same keep bits on every call), so finite differences apply;
    the loss also reaches lse (of the undropped scores)."""
    B, Sq, Sk, H, Hkv, D = 1, 6, 9, 2, 1, 4
    q = randn(B, Sq, H, D, dtype=torch.float64).requires_grad_()
    k = randn(B, Sk, Hkv, D, dtype=torch.float64).requires_grad_()
    v = randn(B, Sk, Hkv, D, dtype=torch.float64).requires_grad_()
    rel = randn(H, 2 * 3 + 1, dtype=torch.float64).requires_grad_()

    def f(q, k, v, rel):
        return torch.ops.attn_ext.attention_forward(q, k, v, True, None, -1, -1, None, None, rel,
                                                    None, None, 0.3, 1234, 5)

    out = f(q, k, v, rel)[0]
    assert not torch.equal(out, torch.ops.attn_ext.attention_forward(
        q, k, v, True, None, -1, -1, None, None, rel, None, None, 0.0, 1234, 5)[0])  # drops some
    assert torch.autograd.gradcheck(f, (q, k, v, rel))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    qv, kv, vv = (randn(9, n, D, dtype=torch.float64).requires_grad_() for n in (H, Hkv, Hkv))

    def g(q, k, v):
        return torch.ops.attn_ext.attention_varlen_forward(q, k, v, cu, cu, 5, 5, True, None, -1,
                                                           -1, None, None, None, None, 0.3, 99, 3)

    assert torch.autograd.gradcheck(g, (qv, kv, vv))


def test_opcheck():
    B, Sq, Sk, H, Hkv, D = 2, 7, 11, 2, 1, 8
    q, k, v = randn(B, Sq, H, D), randn(B, Sk, Hkv, D), randn(B, Sk, Hkv, D)
    rel = randn(H, 9).requires_grad_()
    sinks = randn(H).requires_grad_()
    slopes = torch.rand(B, H)
    lib = torch.ops.attn_ext
    args = (q, k, v, True, None, -1, -1, None, slopes, rel, 3.0, sinks, 0.2, 123, 7)
    torch.library.opcheck(lib.attention_forward.default, args)
    out, lse = (t.detach() for t in lib.attention_forward(*args))
    torch.library.opcheck(lib.attention_backward_rel_bias.default,
                          (torch.randn_like(out), q, k, v, out, lse, True, None, -1, -1, None,
                           torch.randn_like(lse), slopes, rel.detach(), 3.0, 0.2, 123, 7))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    cuk = torch.tensor([0, 5, 11], dtype=torch.int32)
    qv, kv, vv = q[0], k[0], v[0]
    vargs = (qv, kv, vv, cu, cuk, 4, 6, True, None, -1, -1, slopes, rel, 3.0, sinks, 0.2, 5, 9)
    torch.library.opcheck(lib.attention_varlen_forward.default, vargs)
    out, lse = (t.detach() for t in lib.attention_varlen_forward(*vargs))
    torch.library.opcheck(lib.attention_varlen_backward_rel_bias.default,
                          (torch.randn_like(out), qv, kv, vv, out, lse, cu, cuk, 4, 6, True, None,
                           -1, -1, None, slopes, rel.detach(), 3.0, 0.2, 5, 9))


def test_sinks_row_without_keys():
    """A row that sees no key: out 0, lse = its sink logit, gradients through the sink only."""
    H = 3
    q = randn(2, 8, H, 16).requires_grad_()
    k = randn(2, 5, H, 16).requires_grad_()
    sinks = randn(H).requires_grad_()
    kpm = torch.ones(2, 5, dtype=torch.bool)
    kpm[1] = False
    out, lse = attn_ext.attention(q, k, k, causal=True, key_padding_mask=kpm, sinks=sinks,
                                  return_lse=True)
    # causal with Sq > Sk: rows 0..2 of batch 0 see nothing; batch 1 sees nothing at all
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0, :3], torch.zeros_like(out[0, :3]))
    assert torch.equal(lse[1], sinks.detach()[:, None].expand(H, 8))
    assert torch.equal(lse[0, :, :3], sinks.detach()[:, None].expand(H, 3))
    lse.sum().backward()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("varlen", [False, True])
def test_sinks_gradient_row_sums_in_slices_are_the_one_expressions_bits(dtype, varlen):
    """d sinks' rowsum(dout * out) runs over slices of rows in eager mode (no out-sized
    temporaries); each row's sum is the one expression's, bit for bit, at every slice size."""
    from attn_ext.ops import _rows_dot

    shape = (13, 3, 40) if varlen else (2, 13, 3, 40)
    dout, out = randn(*shape).to(dtype), randn(*shape).to(dtype)
    whole = (dout.float() * out.float()).sum(-1)
    for max_elems in (1, 40, 41, 130, 1000, 1 << 20):
        got = _rows_dot(dout, out, torch.float32, 0 if varlen else 1, max_elems)
        assert got.shape == whole.shape and torch.equal(got, whole), max_elems


def test_sinks_gradient_slices_the_rows_and_meets_the_reference(monkeypatch):
    """Dense and varlen backwards slice d sinks' row sums over Sq / Tq (not the batch or the
    heads: a batch of 1 was not sliced at all), and d sinks meets the float64 reference."""
    from attn_ext.ops import _rows_dot

    B, S, H, Dv = 1, 520, 2, 1024  # 1.06M elements per tensor: two slices
    q, k = randn(B, S, H, 16).requires_grad_(), randn(B, S, 1, 16)
    v = randn(B, S, 1, Dv)
    sinks = randn(H).requires_grad_()
    dout = randn(B, S, H, Dv)
    seen = []

    def spy(dout, out, dtype, row_dim, *args):  # the backward slices the rows, not the batch
        seen.append(out.shape[row_dim])
        return _rows_dot(dout, out, dtype, row_dim, *args)

    monkeypatch.setattr(ops, "_rows_dot", spy)
    attn_ext.attention(q, k, v, causal=True, sinks=sinks).backward(dout)
    qv = q.detach()[0].requires_grad_()
    cu = torch.tensor([0, 200, S], dtype=torch.int32)
    attn_ext.attention_varlen(qv, k[0], v[0], cu, cu, 320, 320, causal=True,
                              sinks=sinks.detach().requires_grad_()).backward(dout[0])
    assert seen == [S, S]
    sd = sinks.detach().double().requires_grad_()
    reference.attention(q.detach().double(), k.double(), v.double(), causal=True,
                        sinks=sd).backward(dout.double())
    assert max_err(sinks.grad, sd.grad) < 1e-3 * sd.grad.abs().max().item()

    # a backward that is itself differentiated keeps the one expression (the slices' buffers
    # take in-place ops and out=, which autograd refuses): create_graph and torch.func.grad
    monkeypatch.undo()
    s2 = sinks.detach().requires_grad_()
    loss = (attn_ext.attention(q, k, v, causal=True, sinks=s2) * dout).sum()
    (g,) = torch.autograd.grad(loss, s2, create_graph=True)
    assert g.requires_grad and torch.equal(g.detach(), sinks.grad)
    f = lambda s: (attn_ext.attention(q.detach(), k, v, causal=True, sinks=s) * dout).sum()  # noqa: E731
    assert torch.equal(torch.func.grad(f)(sinks.detach()), sinks.grad)


def test_rel_bias_module_gradient_reaches_buckets():
    """T5-bucketed RelativePositionBias: the kernel's d rel_bias flows through the gather."""
    H = 4
    rpb = RelativePositionBias(H, max_distance=32, bidirectional=True, num_buckets=8).double()
    q, k, v = (randn(2, 40, H, 8, dtype=torch.float64) for _ in range(3))
    attn_ext.attention(q, k, v, rel_bias=rpb()).square().sum().backward()
    ours = rpb.weight.grad.clone()
    rpb.zero_grad()
    reference.attention(q, k, v, rel_bias=rpb()).square().sum().backward()
    assert max_err(ours, rpb.weight.grad) < 1e-9


def test_three_dim_input():
    q, k, v = randn(2, 30, 8), randn(2, 30, 8), randn(2, 30, 8)
    rel = randn(1, 11)
    out = attn_ext.attention(q, k, v, causal=True, rel_bias=rel, softcap=4.0)
    ref = reference.attention(q[:, :, None].double(), k[:, :, None].double(),
                              v[:, :, None].double(), True, rel_bias=rel.double(), softcap=4.0)
    assert out.shape == (2, 30, 8) and max_err(out, ref[:, :, 0]) < 1e-5


# ---- dropout ------------------------------------------------------------------------------


def _keep_readout(B, Sq, Sk, H, Hkv, p, seed, offset, dtype=torch.float32, causal=False):
    """Keep bits as the kernel applied them: with q = 0 every visible probability is 1/n, and
    v = identity (Dv = Sk) puts key j's kept weight in output column j."""
    q = torch.zeros(B, Sq, H, 8, dtype=dtype)
    k = randn(B, Sk, Hkv, 8, dtype=dtype)
    v = torch.eye(Sk, dtype=dtype)[None, :, None, :].expand(B, Sk, Hkv, Sk).contiguous()
    out, _ = torch.ops.attn_ext.attention_forward(q, k, v, causal, None, -1, -1, None, None, None,
                                                  None, None, p, seed, offset)
    return out.permute(0, 2, 1, 3) > 0  # (B, H, Sq, Sk)


def test_dropout_keep_bits_match_reference_any_tiling_and_threads():
    p, seed, offset = 0.3, 1234567, 89
    Sk = 400
    want = reference.dropout_keep_mask(seed, offset, 2, 4, range(300), range(Sk), p)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = _keep_readout(2, 300, Sk, 4, 2, p, seed, offset)  # 96-row tiles
            assert torch.equal(full, want)
            # fewer rows (decode-like tiles of several heads, split-KV with 2 threads): the
            # same global rows get the same bits
            few = _keep_readout(2, 3, Sk, 4, 2, p, seed, offset)
            assert torch.equal(few, want[:, :, :3])
            mid = _keep_readout(2, 50, Sk, 4, 4, p, seed, offset, dtype=torch.float64)
            assert torch.equal(mid, want[:, :, :50])
    finally:
        torch.set_num_threads(old)


def test_dropout_keep_rate():
    p = 0.1
    keep = _keep_readout(1, 256, 256, 4, 4, p, 42, 0)
    n = keep.numel()
    rate = keep.double().mean().item()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(rate - (1 - p)) < 4 * sigma, (rate, 1 - p, sigma)


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("causal,window,terms", [(True, None, False), (False, (40, 10), True)])
def test_dropout_vs_reference(dtype, causal, window, terms):
    """Forward and backward use the same keep bits (those of reference.dropout_keep_mask at
    the seed/offset the wrapper draws from torch's generator)."""
    B, Sq, Sk, H, Hkv, D = 2, 130, 210, 4, 2, 16
    p = 0.25
    q, k, v = randn(B, Sq, H, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype)
    rel = randn(H, 21, dtype=dtype) if terms else None
    torch.manual_seed(11)
    seed, offset = ops._dropout_seed_offset("cpu")
    mask = reference.dropout_keep_mask(seed, offset, B, H, range(Sq), range(Sk), p)

    def ours(q, k, v, rel):
        torch.manual_seed(11)  # the wrapper draws the same seed/offset
        return attn_ext.attention(q, k, v, causal=causal, window=window, rel_bias=rel,
                                  softcap=5.0 if terms else None, dropout_p=p, return_lse=True)

    def ref(q, k, v, rel):
        return reference.attention_with_lse(q, k, v, causal, None, window, None, None, rel,
                                            5.0 if terms else None, None, p, mask)

    check_against_reference(ours, ref, [q, k, v, rel],
                            ["dq", "dk", "dv"] + (["drel_bias"] if terms else []))


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("Sq,Sk,causal", [(1, 1, False), (6, 6, True)])
def test_dropout_rows_that_see_one_key(dtype, Sq, Sk, causal):
    """A row whose probability is 1 at one key (it sees only that key: every row at Sk = 1, the
    first row of a causal call) has dS = dlse at that key. With dropout the row term Di reads
    the rounded out = v / (1 - p), which left out's rounding in dS, and dq / dk of bf16 / fp16
    exceeded 2x the low-precision textbook's error (which cancels exactly there; a review
    helper, thirty-ninth session: attention_bwd.cpp ds_dropout)."""
    B, H, D, p = 3, 2, 32, 0.3
    for seed in range(16):
        torch.manual_seed(1000 + seed)
        q, k, v = (randn(B, Sq, H, D, dtype=dtype), randn(B, Sk, H, D, dtype=dtype),
                   randn(B, Sk, H, D, dtype=dtype))
        torch.manual_seed(seed)
        sd, off = ops._dropout_seed_offset("cpu")
        mask = reference.dropout_keep_mask(sd, off, B, H, range(Sq), range(Sk), p)

        def ours(q, k, v):
            torch.manual_seed(seed)  # the wrapper draws the same seed / offset
            return attn_ext.attention(q, k, v, causal=causal, dropout_p=p, return_lse=True)

        def ref(q, k, v):
            return reference.attention_with_lse(q, k, v, causal, dropout_p=p, dropout_mask=mask)

        check_against_reference(ours, ref, [q, k, v], ["dq", "dk", "dv"])


def test_dropout_varlen_bits():
    """Packed sequences: sequence b's bits are those of batch index b at its local rows."""
    p, seed, offset = 0.4, 99, 3
    lq, lk = [5, 120, 0, 33], [40, 130, 7, 33]
    cu_q, cu_k = _cu(lq), _cu(lk)
    H, Sk = 2, max(lk)
    q = torch.zeros(sum(lq), H, 8)
    k = randn(sum(lk), H, 8)
    # v = identity in each sequence: column j of the output is key j of the sequence
    v = torch.zeros(sum(lk), H, Sk)
    for b in range(4):
        for j in range(lk[b]):
            v[int(cu_k[b]) + j, :, j] = 1
    out, _ = torch.ops.attn_ext.attention_varlen_forward(q, k, v, cu_q, cu_k, max(lq), Sk, False,
                                                         None, -1, -1, None, None, None, None,
                                                         p, seed, offset)
    for b in range(4):
        if lq[b] == 0:
            continue
        got = out[int(cu_q[b]):int(cu_q[b + 1]), :, :lk[b]].permute(1, 0, 2) > 0
        want = reference.dropout_keep_mask(seed, offset, b + 1, H, range(lq[b]), range(lk[b]), p)[b]
        assert torch.equal(got, want)


def test_dropout_reproducible_and_thread_independent():
    q, k, v = randn(2, 200, 4, 32), randn(2, 200, 2, 32), randn(2, 200, 2, 32)

    def run():
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attn_ext.attention(*ts, causal=True, dropout_p=0.1)
        out.square().sum().backward()
        return [out.detach()] + [t.grad for t in ts]

    torch.manual_seed(3)
    a = run()
    torch.manual_seed(3)
    b = run()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if old > 1 else 2)
        torch.manual_seed(3)
        c = run()
    finally:
        torch.set_num_threads(old)
    # B * Hkv = 4 units: the fused backward and the plain forward at either thread count
    for x, y in zip(a, c):
        assert torch.equal(x, y)
    torch.manual_seed(4)
    d = run()
    assert not torch.equal(a[0], d[0])  # another draw, another mask


@pytest.mark.parametrize("Sq,Hkv,Sk", [(1, 1, 1500), (3, 1, 1500), (17, 1, 700), (5, 2, 2000)])
def test_dropout_bitwise_across_thread_counts_few_tiles(Sq, Hkv, Sk):
    """Issue 15: CPU dropout is bitwise identical across thread counts, also where the
    forward splits the keys of few query tiles (decode-like shapes, B * Hkv small): with
    dropout the split plan counts kDropoutSplitWorkers, not the threads (the merge's sums
    depended on the chunking)."""
    from tests.utils import with_threads

    q, k, v = randn(1, Sq, 4, 64), randn(1, Sk, Hkv, 64), randn(1, Sk, Hkv, 64)

    def run():
        torch.manual_seed(11)
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attn_ext.attention(*ts, causal=True, dropout_p=0.2)
        out.square().sum().backward()
        return [out.detach()] + [t.grad for t in ts]

    one = with_threads(1, run)
    for n in (2, 3, 16):
        other = with_threads(n, run)
        for name, x, y in zip(("out", "dq", "dk", "dv"), one, other):
            assert torch.equal(x, y), f"{name} differs at {n} threads vs 1"
    assert attn_ext.explain(q, k, v, causal=True, dropout_p=0.2).details["n_split"] == \
        with_threads(16, lambda: attn_ext.explain(q, k, v, causal=True, dropout_p=0.2).details["n_split"])


# ---- bad input ----------------------------------------------------------------------------


def test_bad_input():
    q = randn(1, 8, 2, 8)
    with pytest.raises(ValueError, match=r"softcap must be a finite number > 0"):
        attn_ext.attention(q, q, q, softcap=0.0)
    with pytest.raises(ValueError, match=r"softcap must be a finite number > 0"):
        attn_ext.attention(q, q, q, softcap=-1.0)
    # 1 - 2^-17 and above: the 16-bit keep threshold would drop every key (out = 0, not an
    # expectation-preserving dropout); refused, and 1 - 2^-16 still keeps a 2^-16 share
    for p in (-0.1, 1.0, 1.5, float("nan"), 1 - 2.0**-17, 0.999995):
        with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
            attn_ext.attention(q, q, q, dropout_p=p)
    with pytest.raises(RuntimeError, match=r"at most 1 - 2\^-16"):
        torch.ops.attn_ext.attention_forward(q, q, q, False, None, -1, -1, None, None, None, None,
                                             None, 1 - 2.0**-17)
    assert attn_ext.attention(q, q, q, dropout_p=1 - 2.0**-16).isfinite().all()
    with pytest.raises(ValueError, match=r"rel_bias must be a floating-point tensor"):
        attn_ext.attention(q, q, q, rel_bias=torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"sinks must be a floating-point tensor"):
        attn_ext.attention(q, q, q, sinks=[0.0, 1.0])
    with pytest.raises(RuntimeError, match=r"rel_bias must have shape \(H, 2M \+ 1\) with H = 2"):
        attn_ext.attention(q, q, q, rel_bias=torch.zeros(3, 5))
    with pytest.raises(RuntimeError, match=r"odd number of distances"):
        attn_ext.attention(q, q, q, rel_bias=torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match=r"alibi_slopes must have shape \(H,\) = \(2,\) or \(B, H\)"):
        attn_ext.attention(q, q, q, alibi_slopes=torch.ones(3))
    with pytest.raises(RuntimeError, match=r"sinks must have shape \(H,\) = \(2,\)"):
        attn_ext.attention(q, q, q, sinks=torch.ones(2, 1))
    lib = torch.ops.attn_ext
    with pytest.raises(RuntimeError, match=r"rel_bias must be a floating-point table \(H, 2M \+ 1\)"):
        lib.attention_forward(q.bfloat16(), q.bfloat16(), q.bfloat16(), False, None, -1, -1, None,
                              None, torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"softcap must be a finite number > 0"):
        lib.attention_forward(q, q, q, False, None, -1, -1, None, None, None, 0.0)
    with pytest.raises(RuntimeError, match=r"dropout_p must be in \[0, 1\) .*got 1"):
        lib.attention_forward(q, q, q, False, None, -1, -1, None, None, None, None, None, 1.0)
    # (strided tables are read through a contiguous copy: test_op_tables_of_any_strides)
    out, lse = lib.attention_forward(q, q, q, False, None)
    with pytest.raises(RuntimeError, match=r"dropout_p must be in \[0, 1\)"):
        lib.attention_backward(out, q, q, q, out, lse, False, None, -1, -1, None, None, None,
                               None, None, -0.5)


# ---- modules ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["rel_bias", "alibi", "softcap"])
def test_multihead_attention_terms(kind):
    """MultiHeadAttention(rel_bias= | alibi= | softcap=) equals the textbook layer with the
    same terms; need_weights gives the probabilities with the terms; TorchScript-clean; the
    relative bias learns (its gradient reaches the module's table)."""
    H, E = 4, 32
    kw = {"rel_bias": dict(rel_bias=RelativePositionBias(H, 8)), "alibi": dict(alibi=True),
          "softcap": dict(softcap=2.0)}[kind]
    layer = attn_ext.MultiHeadAttention(E, H, causal=True, **kw).double().eval()
    if kind == "rel_bias":
        with torch.no_grad():
            layer.rel_bias.weight.normal_()
    x = randn(2, 25, E, dtype=torch.float64)
    out, w = layer(x, need_weights=True)
    B, S = 2, 25
    qkv = layer.qkv(x)
    q, k, v = qkv.split([E, E, E], dim=-1)
    q, k, v = (t.reshape(B, S, H, E // H) for t in (q, k, v))
    terms = {"rel_bias": dict(rel_bias=layer._rel_table(torch.float64)),
             "alibi": dict(alibi_slopes=alibi_slopes(H, dtype=torch.float64)),
             "softcap": dict(softcap=2.0)}[kind]
    ref_out, ref_lse = reference.attention_with_lse(q, k, v, True, **terms)
    want = layer.out_proj(ref_out.reshape(B, S, E))
    assert max_err(out, want) < 1e-10
    # the probabilities with the terms: softmax of reference.add_score_terms' scores
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    scores = reference.add_score_terms((qt @ kt.transpose(-1, -2)) * (E // H) ** -0.5,
                                       reference.score_distance(S, S), **terms)
    scores = scores.masked_fill(~reference.visibility_mask(S, S, causal=True), float("-inf"))
    assert w.shape == (B, H, S, S)
    assert max_err(w, torch.softmax(scores, dim=-1)) < 1e-10
    scripted = torch.jit.script(layer)
    assert max_err(scripted(x)[0], out) < 1e-12
    if kind == "rel_bias":
        out.square().sum().backward()
        assert layer.rel_bias.weight.grad.abs().sum() > 0


def test_multihead_attention_dropout_in_kernel():
    """dropout > 0 in training runs the kernel's dropout: the same as attention(dropout_p=)
    with the seed drawn from the same generator state, reproducible with manual_seed."""
    layer = attn_ext.MultiHeadAttention(32, 4, causal=True, dropout=0.2).train()
    x = randn(2, 40, 32)
    torch.manual_seed(5)
    a = layer(x)[0]
    torch.manual_seed(5)
    b = layer(x)[0]
    assert torch.equal(a, b)
    # the same bits as attn_ext.attention(dropout_p=0.2) on the layer's q, k, v, seeded alike
    q, k, v = (t.reshape(2, 40, 4, 8) for t in layer.qkv(x).split([32, 32, 32], dim=-1))
    torch.manual_seed(5)
    want = layer.out_proj(attn_ext.attention(q, k, v, causal=True, dropout_p=0.2).reshape(2, 40, 32))
    assert torch.equal(a, want)
    layer.eval()
    assert not torch.equal(a, layer(x)[0])


@pytest.mark.parametrize("pos", ["relative", "alibi"])
def test_tinygpt_positions(pos):
    """TinyGPT(pos="relative" | "alibi"): incremental decoding with the KV cache gives the
    tokens of the full forward (the bias sees global distances), TorchScript-clean, trains."""
    model = attn_ext.models.TinyGPT(17, 32, 4, 2, max_len=64, pos=pos).eval()
    idx = torch.randint(0, 17, (2, 6))
    gen = model.generate(idx, 12)
    full = model(gen[:, :-1]).argmax(-1)[:, 5:]
    assert torch.equal(full, gen[:, 6:])
    assert max_err(torch.jit.script(model)(gen), model(gen)) < 1e-5
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = torch.randint(0, 17, (8, 20))
    first = None
    for _ in range(20):
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 17), data[:, 1:].reshape(-1))
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first


def test_torch_compile_fullgraph():
    """The terms keep attn_ext.attention traceable (tables cast in the wrapper, ops with
    fake kernels and autograd): fullgraph torch.compile equals eager, gradients included."""
    q = randn(1, 40, 2, 16).requires_grad_()
    rel, sinks = randn(2, 9).requires_grad_(), randn(2).requires_grad_()
    slopes = torch.tensor([0.1, 0.2])

    def f(q, rel, sinks):
        return attn_ext.attention(q, q, q, causal=True, rel_bias=rel, sinks=sinks, softcap=3.0,
                                  alibi_slopes=slopes)

    a, b = torch.compile(f, fullgraph=True)(q, rel, sinks), f(q, rel, sinks)
    assert max_err(a, b) < 1e-6
    for x, y in zip(torch.autograd.grad(a.sum(), (q, rel, sinks)),
                    torch.autograd.grad(b.sum(), (q, rel, sinks))):
        assert max_err(x, y) < 1e-5


@pytest.mark.parametrize("dtype,table_dtype", [(torch.float64, torch.float32),
                                               (torch.float32, torch.float64),
                                               (torch.bfloat16, torch.bfloat16)])
def test_op_tables_of_another_float_dtype(dtype, table_dtype):
    """The ops take alibi_slopes / rel_bias / sinks of any float dtype (DESIGN's float32 tables
    beside float64 inputs, a bf16 model's bf16 rel_bias) and read them in the accumulation type:
    the same out / lse / gradients as tables already in it, and the tables' gradients come back
    in the tables' own dtype."""
    torch.manual_seed(3)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (torch.randn(2, 6, 2, 8, dtype=dtype) for _ in range(3))
    al = torch.rand(2, dtype=table_dtype)
    rb = torch.randn(2, 7, dtype=table_dtype)
    sk = torch.randn(2, dtype=table_dtype)
    lib = torch.ops.attn_ext

    def run(al, rb, sk):
        qq, rr, ss = (t.detach().clone().requires_grad_() for t in (q, rb, sk))
        out, lse = lib.attention_forward(qq, k, v, True, None, -1, -1, None, al, rr, None, ss)
        (out.float().sum() + lse.sum()).backward()
        return out, lse, qq.grad, rr.grad, ss.grad

    got = run(al, rb, sk)
    want = run(al.to(acc), rb.to(acc), sk.to(acc))
    for name, a, b in zip(("out", "lse", "dq"), got[:3], want[:3]):
        assert torch.equal(a, b), name
    for name, a, b in zip(("d rel_bias", "d sinks"), got[3:], want[3:]):
        assert a.dtype == table_dtype, name
        assert torch.equal(a, b.to(table_dtype)), name
    # the backward ops alone: d rel_bias in rel_bias's dtype
    out, lse = lib.attention_forward(q, k, v, True, None, -1, -1, None, al, rb)
    drel = lib.attention_backward_rel_bias(torch.ones_like(out), q, k, v, out, lse, True, None, -1,
                                           -1, None, None, al, rb)[3]
    assert drel.dtype == table_dtype and drel.shape == rb.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_op_tables_of_any_strides(dtype):
    """The raw ops take strided alibi_slopes / rel_bias / sinks (a transposed table, a slice
    with a step, an expanded one): the kernels read a contiguous copy, and the result is the
    contiguous tables' bit for bit, forward and gradients. The CPU kernel refused them while
    the fake kernels accepted them, so a compiled or exported graph traced and then failed
    when it ran; opcheck runs the fake kernel beside the real one."""
    torch.manual_seed(4)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    B, S, H, D = 2, 9, 4, 8
    q, k, v = (torch.randn(B, S, H, D, dtype=dtype) for _ in range(3))
    al = torch.rand(H, B, dtype=acc).t()  # (B, H), strides (1, B)
    rb = torch.randn(9, H, dtype=dtype).t()  # (H, 9), strides (1, H)
    sk = torch.randn(2 * H, dtype=acc)[::2]  # (H,), stride 2
    lib = torch.ops.attn_ext

    def run(al, rb, sk):
        qq, rr, ss = (t.detach().requires_grad_() for t in (q, rb, sk))
        out, lse = lib.attention_forward(qq, k, v, True, None, -1, -1, None, al, rr, None, ss)
        (out.float().sum() + lse.sum()).backward()
        return out, lse, qq.grad, rr.grad, ss.grad

    got = run(al, rb, sk)
    want = run(al.contiguous(), rb.contiguous(), sk.contiguous())
    for name, a, b in zip(("out", "lse", "dq", "d rel_bias", "d sinks"), got, want):
        assert torch.equal(a, b), name
    expanded = torch.randn(1, dtype=acc).expand(H)  # stride 0
    got = lib.attention_forward(q, k, v, False, None, -1, -1, None, expanded)
    want = lib.attention_forward(q, k, v, False, None, -1, -1, None, expanded.contiguous())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if dtype == torch.float32:
        torch.library.opcheck(lib.attention_forward.default,
                              (q, k, v, True, None, -1, -1, None, al, rb, None, sk))
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        torch.library.opcheck(lib.attention_varlen_forward.default,
                              (q[0], k[0], v[0], cu, cu, 5, 5, True, None, -1, -1,
                               al[:1].expand(2, H), rb, None, sk))


def test_strided_cu_seqlens_refused_by_the_kernel_and_the_fake_kernel():
    """cu_seqlens must be contiguous (the kernels read one int32 array): refused by name on
    CPU, and now by the fake kernels too (meta tensors), which took a strided one."""
    q = torch.randn(10, 2, 8)
    lib = torch.ops.attn_ext
    for t in (q, q.to("meta")):
        c = torch.tensor([0, 99, 4, 99, 10], dtype=torch.int32, device=t.device)[::2]
        with pytest.raises(RuntimeError, match=r"cu_seqlens_q must be contiguous, got strides \[2\]"):
            lib.attention_varlen_forward(t, t, t, c, c.contiguous(), 6, 6, True)
        with pytest.raises(RuntimeError, match=r"cu_seqlens_k must be contiguous, got strides \[2\]"):
            lib.attention_varlen_forward(t, t, t, c.contiguous(), c, 6, 6, True)


@pytest.mark.parametrize("cap", [1.0, 30.0])
def test_softcap_tanh_accuracy_through_lse(cap):
    """The fp32 softcap's tanh (csrc/cpu/simd.h tanh_ps on AVX2, std::tanh elsewhere), read
    through lse: with one key, lse = softcap * tanh(s / softcap) exactly the score. Within 4 ulp
    of the float64 value over [-12, 12] softcaps, tiny scores and both sides of the polynomial /
    exponential switch; +-inf scores give +-softcap, NaN stays NaN."""
    import numpy as np
    x = torch.cat([torch.linspace(-12, 12, 20001), torch.logspace(-8, 0, 5000),
                   -torch.logspace(-8, 0, 5000), torch.tensor([0.0, 0.6249, 0.625, 0.6251])]) * cap
    q = x.view(1, -1, 1, 1).float()
    k, v = torch.ones(1, 1, 1, 1), torch.ones(1, 1, 1, 1)
    _, lse = attn_ext.attention(q, k, v, scale=1.0, softcap=cap, return_lse=True)
    ref = cap * torch.tanh(q.double().view(-1) / cap)
    ulp = torch.from_numpy(np.spacing(np.abs(ref.float().numpy()))).double()
    err = (lse.view(-1).double() - ref).abs() / ulp
    assert err.max().item() <= 4.0, (err.max().item(), q.view(-1)[err.argmax()].item())
    special = torch.tensor([float("inf"), float("-inf"), float("nan")]).view(1, 3, 1, 1)
    _, lse = attn_ext.attention(special, k, v, scale=1.0, softcap=cap, return_lse=True)
    assert lse[0, 0, 0].item() == cap and lse[0, 0, 1].item() == -cap
    assert torch.isnan(lse[0, 0, 2])
