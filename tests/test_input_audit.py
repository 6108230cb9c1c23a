"""Bad input found by an audit against DESIGN.md ("never a crash, hang, silent wrong answer";
"differentiable ... or the op refuses the gradient clearly"): each case here once crashed,
hung, returned garbage or a wrong gradient, or leaked an unclear Python error."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import attn_ext as A
from attn_ext import reference as R

f64 = torch.float64


def _qkv(dtype=torch.float32):
    torch.manual_seed(0)
    return (torch.randn(2, 8, 4, 16, dtype=dtype), torch.randn(2, 8, 2, 16, dtype=dtype),
            torch.randn(2, 8, 2, 16, dtype=dtype))


def _packed():
    torch.manual_seed(1)
    q, k, v = torch.randn(10, 4, 16, dtype=f64), torch.randn(12, 2, 16, dtype=f64), torch.randn(12, 2, 16, dtype=f64)
    return q, k, v, torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bound", [2**40, 2**62, 2**63 - 1])
def test_varlen_loose_max_seqlen_is_a_bound_not_a_size(bound, causal):
    # used to hang (2**40: the tiling planned max_seqlen / 96 tiles) or crash (2**62: an
    # int64 overflow sent the call to the decode kernel)
    q, k, v, cq, ck = _packed()
    want = A.attention_varlen(q, k, v, cq, ck, 6, 7, causal=causal)
    got = A.attention_varlen(q, k, v, cq, ck, bound, bound, causal=causal)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    qg = q.clone().requires_grad_()
    A.attention_varlen(qg, k, v, cq, ck, bound, bound, causal=causal).sum().backward()
    qr = q.clone().requires_grad_()
    A.attention_varlen(qr, k, v, cq, ck, 6, 7, causal=causal).sum().backward()
    torch.testing.assert_close(qg.grad, qr.grad, rtol=0, atol=0)


@pytest.mark.parametrize("window,causal,same_as", [
    ((-1, 2**63 - 1), False, None), ((2**63 - 8, 2**63 - 8), False, None),
    ((2**63 - 1, 0), False, "causal"), ((2**62, 2**61), False, None),
])
def test_huge_window_sides_mean_unbounded(window, causal, same_as):
    # the band's index sums overflowed int64 and hid keys silently
    q, k, v = _qkv(f64)
    want = A.attention(q, k, v, causal=same_as == "causal")
    torch.testing.assert_close(A.attention(q, k, v, window=window, causal=causal), want)
    qp, kp, vp, cq, ck = _packed()
    torch.testing.assert_close(A.attention_varlen(qp, kp, vp, cq, ck, 6, 7, window=window),
                               A.attention_varlen(qp, kp, vp, cq, ck, 6, 7, causal=same_as == "causal"))


def test_block_start_bounds():
    q, k, v = _qkv(f64)
    for name, qs, ks in (("q_start", 2**60, 0), ("k_start", 0, 2**62)):
        with pytest.raises(RuntimeError, match=name):
            torch.ops.attn_ext.attention_forward(q, k, v, False, None, q_start=qs, k_start=ks)


@pytest.mark.parametrize("case", ["attention", "rope", "sinusoidal"])
def test_one_meta_argument_among_cpu_ones_is_an_error(case):
    # the Meta key won the dispatch and the unchecked fake returned uninitialised CPU memory
    q, k, v = _qkv()
    cos, sin = A.rope_cache(8, 16)
    with pytest.raises(RuntimeError, match="same device"):
        if case == "attention":
            A.attention(q, k.to("meta"), v)
        elif case == "rope":
            A.rope(q, cos.to("meta"), sin)
        else:
            A.sinusoidal_pe(torch.randn(2, 4, 8), torch.arange(4, device="meta"))


def test_in_place_ops_refuse_tensors_that_need_grad():
    cos, sin = A.rope_cache(8, 16)
    w = torch.randn(2, 4, 2, 16, requires_grad=True)
    for call in (lambda: A.rope_(w * 1, cos, sin),
                 lambda: A.rope_qk(w * 1, torch.randn(2, 4, 2, 16), cos, sin, inplace=True),
                 lambda: A.sinusoidal_pe_(torch.randn(4, 8, requires_grad=True))):
        with pytest.raises(RuntimeError, match="requires grad"):
            call()
    with torch.no_grad():  # allowed where no gradient is recorded
        x = w.detach().clone()
        A.rope_(x, cos, sin)
        torch.testing.assert_close(x, A.rope(w.detach(), cos, sin))


def _assert_saved_tensor_guard(op, shape):
    """op(x) writes x in place: it must bump x's version, so that a graph which saved x
    refuses to backward through the overwritten values."""
    x = torch.randn(*shape)
    w = torch.randn(*shape, requires_grad=True)
    loss = (x * w).sum()  # saves x for w's gradient
    v0 = x._version
    op(x)
    assert x._version > v0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_in_place_ops_bump_the_version_counter():
    # a graph that saved x must refuse to backward through the overwritten value
    cos, sin = A.rope_cache(8, 16)
    for op in (lambda x: A.rope_(x, cos, sin), lambda x: A.rope_qk(x, x.clone(), cos, sin, inplace=True)):
        _assert_saved_tensor_guard(op, (2, 4, 2, 16))
    with torch.inference_mode():  # inference tensors keep no version counter: still fine
        x = torch.randn(2, 4, 2, 16)
        A.rope_(x, cos, sin)


def test_rope_in_place_refuses_tables_inside_x():
    buf = torch.randn(256)
    x = buf.view(2, 4, 2, 16)
    with pytest.raises(RuntimeError, match="cos must not overlap x"):
        A.rope_(x, buf[:64].view(8, 8), torch.randn(8, 8))
    with pytest.raises(RuntimeError, match="sin must not overlap k"):
        A.rope_qk(torch.randn(2, 4, 2, 16), x, torch.randn(8, 8), buf[64:128].view(8, 8), inplace=True)


@pytest.mark.parametrize("varlen", [False, True])
def test_double_backward_is_refused_clearly(varlen):
    # autograd's fallback used to return zeros (with a warning only)
    if varlen:
        q, k, v, cq, ck = _packed()
        f = lambda q: A.attention_varlen(q, k, v, cq, ck, 6, 7, causal=True)
    else:
        q, k, v = _qkv(f64)
        f = lambda q: A.attention(q, k, v, causal=True)
    qq = q.clone().requires_grad_()
    g, = torch.autograd.grad(f(qq).sum(), qq, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad((g ** 2).sum(), qq)
    # the first-order gradient itself is unaffected
    qr = q.clone().requires_grad_()
    g1, = torch.autograd.grad(f(qr).sum(), qr)
    torch.testing.assert_close(g.detach(), g1)


@pytest.mark.parametrize("kw,match", [
    (dict(softcap=0.0), "softcap"), (dict(softcap=-1.0), "softcap"),
    (dict(alibi_slopes=torch.ones(1)), "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(1, 4)), "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.int64)), "alibi_slopes"),
    (dict(rel_bias=torch.randn(4, 4)), "rel_bias"), (dict(rel_bias=torch.randn(1, 5)), "rel_bias"),
    (dict(rel_bias=torch.randn(5)), "rel_bias"),
])
def test_attention_weights_takes_attentions_score_term_rules(kw, match):
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match=match):
        A.attention_weights(q, k, **kw)
    with pytest.raises((ValueError, RuntimeError), match=match):
        A.attention(q, k, k, **kw)


def test_attention_weights_with_terms_still_matches_attention():
    q, k, v = _qkv(f64)
    kw = dict(causal=True, alibi_slopes=torch.rand(2, 4), rel_bias=torch.randn(4, 7), softcap=3.0)
    p = A.attention_weights(q, k, **kw)
    got = torch.einsum("bhij,bjhd->bihd", p, v.repeat_interleave(2, dim=2))
    torch.testing.assert_close(got, A.attention(q, k, v, **kw))


def test_kv_cache_checks_shapes_and_padding():
    c = A.MultiHeadAttention(32, 4, 2).new_kv_cache(2, 8)
    with pytest.raises(ValueError, match="k_new"):
        c.update(torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8))  # B = 1 would broadcast
    with pytest.raises(ValueError, match="k_new"):
        c.update(torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8))  # Hkv = 1 likewise
    with pytest.raises(ValueError, match="v_new"):
        c.update(torch.randn(2, 3, 2, 8), torch.randn(2, 2, 2, 8))
    for bad in (torch.tensor([-3, 0]), torch.tensor([100, 0]), torch.tensor([1.5, 0.0])):
        with pytest.raises(ValueError, match="start"):
            c.set_left_padding(bad)
    c.set_left_padding(torch.tensor([2, 0]))
    k, v = c.update(torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8))
    assert k.shape == (2, 3, 2, 8) and c.length == 3


@pytest.mark.parametrize("call,name", [
    (lambda q, k, v: A.attention(None, k, v), "q"),
    (lambda q, k, v: A.attention(q, [1], v), "k"),
    (lambda q, k, v: A.causal_attention(q, k, None), "v"),
    (lambda q, k, v: A.attention_weights(None, k), "q"),
    (lambda q, k, v: A.rope([1], *A.rope_cache(8, 16)), "x"),
    (lambda q, k, v: A.rope(q, None, None), "cos"),
    (lambda q, k, v: A.sinusoidal_pe(None), "x"),
    (lambda q, k, v: A.rope_cache(8, "8"), "rotary_dim"),
    (lambda q, k, v: A.rope_cache("8", 8), "seq_len"),
    (lambda q, k, v: A.rope_cache(8, 8, scaling="linear"), "scaling"),
])
def test_wrong_python_types_name_the_argument(call, name):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=name) as e:  # ArgumentTypeError: a TypeError too
        call(q, k, v)
    assert isinstance(e.value, TypeError)


def test_varlen_wrong_python_types():
    q, k, v, cq, ck = _packed()
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        A.attention_varlen(q, k, v, None, ck, 6, 7)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        A.attention_varlen(q, k, v, cq, ck, 6, 7.0)


@pytest.mark.parametrize("scaling,match", [
    ({"type": "ntk", "factor": 2, "original_max_position_embeddings": 4}, "rotary_dim > 2"),
    ({"type": "dynamic", "factor": 2, "original_max_position_embeddings": 0}, "original_max"),
    ({"type": "llama3", "factor": 2, "low_freq_factor": 0}, "low_freq_factor"),
    ({"type": "yarn", "factor": 2, "original_max_position_embeddings": 4, "beta_fast": 0}, "beta_fast"),
    ({"type": "yarn", "factor": 2, "original_max_position_embeddings": -4}, "original_max"),
    ({"type": "linear", "factor": float("nan")}, "factor"),
    # a scaled type without its factor used to mean factor 1: unscaled tables, no error
    ({"type": "linear"}, "needs 'factor'"),
    ({"type": "linear", "factr": 4.0}, "needs 'factor'"),
    ({"rope_type": "dynamic", "original_max_position_embeddings": 8}, "needs 'factor'"),
    ({"type": "yarn", "original_max_position_embeddings": 8}, "needs 'factor'"),
    ({"type": "llama3", "factor": None}, "needs 'factor'"),
])
def test_rope_scaling_parameters_are_checked(scaling, match):
    rotary = 2 if "rotary_dim" in match else 8
    with pytest.raises(ValueError, match=match):
        A.rope_cache(16, rotary, scaling=scaling)
    if "needs 'factor'" in match:
        with pytest.raises(ValueError, match=match):
            A.RotaryEmbedding(rotary, scaling=scaling)


def test_rope_scaling_keys_the_type_does_not_read_warn():
    """A key the scaling type does not read (a misspelled optional one, or another type's)
    warns, naming it, as transformers does; the tables are those without it."""
    want = A.rope_cache(16, 8, scaling={"type": "linear", "factor": 2.0})
    with pytest.warns(UserWarning, match=r"does not read the key\(s\) \['beta_fast'\]"):
        got = A.rope_cache(16, 8, scaling={"type": "linear", "factor": 2.0, "beta_fast": 3})
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.warns(UserWarning, match="low_freq_factr"):
        A.rope_cache(16, 8, scaling={"type": "llama3", "factor": 2.0, "low_freq_factr": 2.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key a type reads: no warning
        A.rope_cache(16, 8, 500000.0, scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8, "rope_theta": 500000.0})
        A.rope_cache(16, 8, scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "truncate": False})
        # transformers' rope_parameters carry partial_rotary_factor for every type (rotary_dim
        # says it here): no warning
        A.RotaryEmbedding(8, scaling={"rope_type": "default", "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.5})
        A.rope_cache(16, 8, scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5})
    # under torch.compile(fullgraph=True) the warning is left out (dynamo cannot trace it)
    f = lambda x: x * A.rope_cache(16, 8, scaling={"type": "linear", "factor": 2.0, "beta_fast": 3})[0].sum()
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2)),
                               torch.ones(2) * want[0].sum())


def test_numpy_scalars_are_numbers_and_modules_check_their_arguments():
    q, k, v = _qkv()
    torch.manual_seed(3)
    a = A.attention(q, k, v, dropout_p=np.float32(0.25), softcap=np.float32(5.0))
    torch.manual_seed(3)
    b = A.attention(q, k, v, dropout_p=0.25, softcap=5.0)
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="dropout"):
        A.MultiHeadAttention(32, 4, dropout=-1)
    with pytest.raises(ValueError, match="x must have 3 dims"):
        A.MultiHeadAttention(32, 4)(torch.randn(8, 32))


@pytest.mark.parametrize("varlen", [False, True])
def test_infinite_sinks_give_the_references_lse_never_nan(varlen):
    # a sink of -inf (no sink for that head) gave NaN lse in rows that see no key, and a NaN
    # sink gradient; +inf gave NaN lse everywhere
    torch.manual_seed(4)
    q = torch.randn(1, 4, 2, 8, dtype=f64)
    k = torch.randn(1, 2, 2, 8, dtype=f64)  # causal with Sq > Sk: rows 0, 1 see no key
    for sink0 in (float("-inf"), float("inf")):
        s = torch.tensor([sink0, 0.5], dtype=f64, requires_grad=True)
        if varlen:
            cu_q, cu_k = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
            out, lse = A.attention_varlen(q[0], k[0], k[0], cu_q, cu_k, 4, 2, causal=True,
                                          sinks=s, return_lse=True)
            out, lse = out[None], lse[None]
        else:
            out, lse = A.attention(q, k, k, causal=True, sinks=s, return_lse=True)
        ref_out, ref_lse = R.attention_with_lse(q, k, k, causal=True, sinks=s.detach())
        assert not lse.isnan().any()
        torch.testing.assert_close(lse, ref_lse.to(lse.dtype))
        torch.testing.assert_close(out, ref_out)
        if sink0 < 0:
            out.sum().backward()
            assert not s.grad.isnan().any()
            assert s.grad[0] == 0  # no sink, no gradient
            ss = s.detach().clone()[1:].requires_grad_()  # head 1 alone, against the reference
            R.attention_with_lse(q[:, :, 1:], k[:, :, 1:], k[:, :, 1:], causal=True,
                                 sinks=ss)[0].sum().backward()
            torch.testing.assert_close(s.grad[1:], ss.grad)


@pytest.mark.parametrize("op", ["rope_", "rope_qk_", "sinusoidal_pe_"])
def test_raw_in_place_ops_refuse_grad_and_bump_versions(op):
    # torch.ops.attn_ext.* directly (as TorchScript calls them), not only the Python wrappers
    cos, sin = A.rope_cache(8, 16)

    def call(x, **kw):
        if op == "rope_":
            torch.ops.attn_ext.rope_(x, cos, sin, **kw)
        elif op == "rope_qk_":
            torch.ops.attn_ext.rope_qk_(x[:, :, :1], x[:, :, 1:], cos, sin, **kw)
        else:
            torch.ops.attn_ext.sinusoidal_pe_(x.view(1, 8, 32), **kw)

    a = torch.randn(1, 8, 2, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad"):
        call(a * 1.0)
    _assert_saved_tensor_guard(call, (1, 8, 2, 16))
    with torch.no_grad():  # no gradient recorded: allowed, and the values are the op's
        y = a.detach().clone()
        call(y)
        if op == "rope_":
            torch.testing.assert_close(y, A.rope(a.detach(), cos, sin))
    with torch.inference_mode():
        call(torch.randn(1, 8, 2, 16))


def test_alibi_slopes_that_require_grad_are_refused_not_detached():
    q, k, v = _qkv()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)
    with pytest.raises(ValueError, match="alibi_slopes get no gradient"):
        A.attention(q, k, v, causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(A.attention(q, k, v, causal=True, alibi_slopes=slopes.detach()),
                               R.attention(q.double(), k.double(), v.double(), causal=True,
                                           alibi_slopes=slopes.detach().double()).float(),
                               rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        A.attention(q, k, v, causal=True, alibi_slopes=slopes)
    # ... and by the ops themselves (TorchScript / C++ callers): the slopes used to come back
    # with no gradient, silently; dense and varlen
    ops = torch.ops.attn_ext
    with pytest.raises(ValueError, match="alibi_slopes get no gradient"):
        ops.attention_forward(q.requires_grad_(), k, v, True, None, -1, -1, None, slopes)
    with pytest.raises(ValueError, match="alibi_slopes get no gradient"):
        ops.attention_forward(q.detach(), k, v, True, None, -1, -1, None, slopes)
    B, S = q.shape[:2]
    cu = torch.arange(0, B * S + 1, S, dtype=torch.int32)
    with pytest.raises(ValueError, match="alibi_slopes get no gradient"):
        ops.attention_varlen_forward(q.detach().flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                     cu, cu, S, S, True, None, -1, -1, slopes)
    out, _ = ops.attention_forward(q, k, v, True, None, -1, -1, None, slopes.detach())
    out.sum().backward()  # detached slopes: the other gradients flow
    assert q.grad is not None


def test_d_rel_bias_reaches_lse_with_empty_head_dims():
    """D = Dv = 0: the scores are rel_bias alone, so lse depends on it. The dense backward
    returned before its kernel when dq, dk and dv were empty, and d rel_bias came back 0."""
    torch.manual_seed(0)
    q = torch.zeros(1, 4, 2, 0, dtype=torch.float64)
    rel = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    _, lse = A.attention(q, q, q, causal=True, rel_bias=rel, return_lse=True)
    (g,) = torch.autograd.grad((lse * torch.arange(1.0, 5.0, dtype=torch.float64)).sum(), rel)
    rel_r = rel.detach().clone().requires_grad_()
    d = torch.arange(4)[:, None] - torch.arange(4)[None, :]
    s = rel_r[:, d.clamp(-2, 2) + 2].masked_fill(d < 0, float("-inf"))  # (H, Sq, Sk)
    lse_r = torch.logsumexp(s, -1)  # (H, Sq)
    (want,) = torch.autograd.grad((lse_r * torch.arange(1.0, 5.0, dtype=torch.float64)).sum(), rel_r)
    torch.testing.assert_close(lse[0], lse_r.detach())
    torch.testing.assert_close(g, want)
    assert g.abs().sum() > 0


# ---- second audit round -------------------------------------------------------------------


def test_rope_and_sinusoidal_refuse_an_offset_beside_positions():
    """positions are absolute: an offset next to them used to be ignored silently."""
    x = torch.randn(1, 4, 2, 8)
    cos, sin = A.rope_cache(16, 8)
    pos = torch.arange(4)
    with pytest.raises(RuntimeError, match="offset must be 0 when positions are given"):
        A.rope(x, cos, sin, positions=pos, offset=3)
    with pytest.raises(RuntimeError, match="offset must be 0 when positions are given"):
        A.rope_qk(x, x.clone(), cos, sin, positions=pos, offset=3, inplace=True)
    with pytest.raises(RuntimeError, match="offset must be 0 when positions are given"):
        A.sinusoidal_pe(torch.zeros(1, 4, 8), positions=pos, offset=1)
    torch.testing.assert_close(A.rope(x, cos, sin, positions=pos + 3), A.rope(x, cos, sin, offset=3),
                               rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="offset must be >= 0, got -1"):
        A.rope(x, cos, sin, offset=-1)
    with pytest.raises(RuntimeError, match="offset"):
        A.sinusoidal_pe(torch.zeros(1, 5, 4, dtype=torch.float64), offset=2**63 - 1)
    big = A.sinusoidal_pe(torch.zeros(1, 1, 4, dtype=torch.float64), offset=2**63 - 1)
    assert torch.isfinite(big).all()


def test_rope_qk_checks_k_alike_in_place_and_out_of_place():
    cos, sin = A.rope_cache(16, 8)
    q, k = torch.randn(2, 5, 3, 8), torch.randn(2, 4, 3, 8)
    for inplace in (False, True):
        with pytest.raises((ValueError, RuntimeError), match="k must have B = 2 and S = 5"):
            A.rope_qk(q, k, cos, sin, offset=2, inplace=inplace)


def test_table_builders_name_bad_arguments():
    with pytest.raises(ValueError, match="dtype must be float32"):
        A.sinusoidal_table(5, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="dtype must be float32"):
        A.rope_cache(16, 8, dtype=torch.int64)
    with pytest.raises(TypeError, match="seq_len must be an int"):
        A.sinusoidal_table(5.5, 8)
    with pytest.raises(TypeError, match="dim must be an int"):
        A.sinusoidal_table(16, 8.0)
    assert A.sinusoidal_table(3, 4, dtype=torch.float64).dtype == torch.float64


def test_rope_cache_dynamic_takes_hugging_faces_parameters():
    """HF's dynamic NTK reads L0 from config.max_position_embeddings; its rope_parameters
    dict has no original_max_position_embeddings. Both spellings give the same tables."""
    a = A.rope_cache(128, 16, scaling={"rope_type": "dynamic", "factor": 2.0,
                                       "max_position_embeddings": 64})
    b = A.rope_cache(128, 16, scaling={"type": "dynamic", "factor": 2.0,
                                       "original_max_position_embeddings": 64})
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        A.rope_cache(128, 16, scaling={"type": "dynamic", "factor": 2.0})


def test_rope_dynamic_prefers_max_position_embeddings_as_hugging_face_does():
    """transformers' dynamic NTK takes L0 from config.max_position_embeddings alone, also when
    its rope_parameters carry an original_max_position_embeddings: a dict with both keys gives
    the tables of max_position_embeddings (attn_ext and the reference; HF's own where
    transformers is installed)."""
    both = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4096,
            "original_max_position_embeddings": 1024}
    only = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4096}
    for L in (3000, 5000):
        inv, _ = A.rope_inv_freq(64, 10000.0, both, L)
        assert torch.equal(inv, A.rope_inv_freq(64, 10000.0, only, L)[0])
        ref, _ = R.rope_scaled_inv_freq(64, 10000.0, both, L)
        torch.testing.assert_close(inv, torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=0)
    # a None entry counts as absent; attn_ext's own "ntk" keeps original_max_position_embeddings
    none = dict(both, max_position_embeddings=None)
    assert torch.equal(A.rope_inv_freq(64, 10000.0, none, 5000)[0],
                       A.rope_inv_freq(64, 10000.0, dict(none, max_position_embeddings=1024), 5000)[0])
    ntk = dict(both, rope_type="ntk")
    assert torch.equal(A.rope_inv_freq(64, 10000.0, ntk, 5000)[0],
                       A.rope_inv_freq(64, 10000.0, dict(only, rope_type="ntk",
                                                         max_position_embeddings=1024), 5000)[0])
    assert R.rope_scaled_inv_freq(64, 10000.0, none, 5000) == R.rope_scaled_inv_freq(
        64, 10000.0, dict(none, max_position_embeddings=1024), 5000)
    try:
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:
        return
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=4096,
                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0,
                                       "original_max_position_embeddings": 1024})
    hf, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=5000)
    ours, _ = A.rope_inv_freq(64, 10000.0, both, 5000)
    torch.testing.assert_close(ours, hf.double(), rtol=1e-6, atol=0)


def test_reference_dropout_needs_its_mask():
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="dropout_mask"):
        R.attention(q, q, q, dropout_p=0.1)


def test_every_schema_has_a_kernel():
    """Issue 2: no schema without a kernel. In a CPU build every attn_ext op has a CPU or a
    composite kernel (the CUDA kernel switch is defined by the CUDA library, with its kernel)."""
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("attn_ext::"))
    assert "attn_ext::attention_forward" in names
    keys = ("CPU", "CUDA", "CompositeImplicitAutograd", "CompositeExplicitAutograd")
    missing = [n for n in names
               if not any(torch._C._dispatch_has_kernel_for_dispatch_key(n, k) for k in keys)]
    assert not missing, f"schemas without a kernel: {missing}"


@pytest.mark.parametrize("dtype,masking", [
    (dt, m) for dt in (torch.float32, torch.float64, torch.bfloat16) for m in ("padding", "window")
] + [(torch.float16, "padding")])
def test_a_hidden_non_finite_key_leaves_visible_rows_bitwise_alone(dtype, masking):
    """DESIGN: a key a row cannot see never affects that row. With inf / NaN in a hidden key's
    k and v, every visible row's out and lse and dq are bitwise what they are with a finite
    value there (the exact masked product of the non-finite case follows the gemm's FMA chain;
    it used to differ in the last bits). (fp16 with a key some row of the same (sequence, kv
    head) sees, the window case, runs that unit widened: half_qk_inf_units; the next test.)"""
    torch.manual_seed(0)
    B, S, H, D = 1, 150, 2, 32
    q, k, v = (torch.randn(B, S, H, D).to(dtype) for _ in range(3))
    hidden = 100
    kw = {"key_padding_mask": torch.ones(B, S, dtype=torch.bool)}
    if masking == "padding":
        kw["key_padding_mask"][:, hidden] = False
        rows = torch.ones(S, dtype=torch.bool)
    else:  # causal window (3, 0): key 100 is seen by rows 100..103 only
        kw = {"causal": True, "window": (3, 0)}
        rows = torch.ones(S, dtype=torch.bool)
        rows[hidden:hidden + 4] = False

    def run(val):
        k2, v2 = k.clone(), v.clone()
        k2[:, hidden], v2[:, hidden] = val, val
        qd = q.clone().requires_grad_()
        out, lse = A.attention(qd, k2, v2, return_lse=True, **kw)
        out.float().square().sum().backward()
        return out[:, rows], lse[:, :, rows], qd.grad[:, rows]

    base = run(0.5)
    for val in (float("inf"), float("nan"), 123.0):
        for name, a, b in zip(("out", "lse", "dq"), run(val), base):
            assert torch.equal(a, b), f"{name} of visible rows changed with a hidden key of {val}"


@pytest.mark.parametrize("varlen", [False, True])
def test_fp16_visible_inf_leaves_every_other_sequence_and_kv_head_bitwise_alone(varlen):
    """fp16 on AMX runs its products as bf16 hi + lo parts, where a visible inf would meet a 0
    (NaN): the (sequence, kv head) units where an inf of q or k takes part run widened. That
    choice is per unit (half_qk_inf_units): it was per call, so an inf in one sequence changed
    the last bits of every other sequence's out, lse and gradients (a review found it). The
    other units' out, lse, dq, dk, dv and the finite d rel_bias are bitwise those of a finite
    value there; the unit with the inf stays accurate (float64 reference)."""
    torch.manual_seed(0)
    B, S, H, Hkv, D = 3, 130, 4, 2, 64
    group = H // Hkv
    q, k, v, dout = (torch.randn(B, S, h, D).half() for h in (H, Hkv, Hkv, H))
    rel = torch.randn(H, 2 * 16 + 1)

    def run(val):
        k2 = k.clone()
        k2[1, 70, 0, 5] = val  # sequence 1, kv head 0; seen by rows 70.. (causal)
        ts = [t.clone().requires_grad_() for t in (q, k2, v)]
        rb = rel.clone().requires_grad_()
        if varlen:
            cu = torch.arange(B + 1, dtype=torch.int32) * S
            flat = [t.reshape(B * S, *t.shape[2:]) for t in ts]
            out, lse = A.attention_varlen(*flat, cu, cu, S, S, causal=True, rel_bias=rb,
                                          return_lse=True)
            out = out.view(B, S, H, D)
            lse = lse.view(H, B, S).transpose(0, 1)
        else:
            out, lse = A.attention(*ts, causal=True, rel_bias=rb, return_lse=True)
        out.backward(dout)
        return out, lse, ts[0].grad, ts[1].grad, ts[2].grad

    base, dirty = run(0.25), run(float("-inf"))
    for b in range(B):
        for hk in range(Hkv):
            if (b, hk) == (1, 0):
                continue
            hs = slice(hk * group, (hk + 1) * group)
            for name, x, y in (("out", dirty[0][b, :, hs], base[0][b, :, hs]),
                               ("lse", dirty[1][b, hs], base[1][b, hs]),
                               ("dq", dirty[2][b, :, hs], base[2][b, :, hs]),
                               ("dk", dirty[3][b, :, hk], base[3][b, :, hk]),
                               ("dv", dirty[4][b, :, hk], base[4][b, :, hk])):
                assert torch.equal(x, y), f"{name} of sequence {b}, kv head {hk}"
    # the unit with the inf: -inf scores (probability 0) against the rows whose q[5] > 0
    kd = k.double().clone()
    kd[1, 70, 0, 5] = float("-inf")
    want = R.attention(q.double(), kd, v.double(), causal=True, rel_bias=rel.double())
    got = dirty[0].double()
    ok = torch.isfinite(want)
    assert torch.equal(ok, torch.isfinite(got))
    assert (got[ok] - want[ok]).abs().max() < 1e-2


def test_multihead_attention_refuses_an_indivisible_d_model():
    with pytest.raises(ValueError, match="d_model must be divisible by num_heads"):
        A.MultiHeadAttention(30, 4)
    assert A.MultiHeadAttention(30, 4, qk_dim=8).head_dim == 8


@pytest.mark.parametrize("k_shape,v_shape,match", [
    ((3, 5, 8), (3, 5, 8), r"batch size B = 2 \(from q\), got q \[2, 5, 8\], k \[3, 5, 8\]"),
    ((2, 5, 16), (2, 5, 8), r"head dim D = 8 \(from q\), got q \[2, 5, 8\], k \[2, 5, 16\]"),
    ((2, 5, 8), (2, 4, 8), r"v must have Sk = 5 keys \(from k\), got .* v \[2, 4, 8\]"),
])
def test_3d_shape_errors_name_the_3d_shapes(k_shape, v_shape, match):
    """3-D (single-head) inputs that do not fit are refused in the shapes the caller passed,
    not in the (B, S, 1, D) views the kernels see."""
    q = torch.randn(2, 5, 8)
    for fn in (A.attention, A.causal_attention):
        with pytest.raises(ValueError, match=match):
            fn(q, torch.randn(*k_shape), torch.randn(*v_shape))



@pytest.mark.parametrize("shape", [(2, 0, 4, 8), (0, 3, 4, 8)])
def test_rope_backward_of_empty_input(shape):
    """An empty x (B = 0 or S = 0): rope's backward gets autograd's all-zero-stride empty
    gradient and returns an empty x.grad (it used to refuse it as a non-contiguous last dim),
    and opcheck passes."""
    cos, sin = A.rope_cache(8, 8)
    x = torch.randn(*shape, requires_grad=True)
    A.rope(x, cos, sin).sum().backward()
    assert x.grad.shape == x.shape
    torch.library.opcheck(torch.ops.attn_ext.rope.default, (torch.randn(*shape, requires_grad=True), cos, sin))


def test_backward_names_an_argument_on_another_device():
    """The backward's device checks (dout, out, lse; varlen's cu_seqlens) run on CPU CI with a
    meta tensor among CPU ones (the CUDA device-mix tests skip without a GPU)."""
    q, k, v = _qkv()
    out, lse = torch.ops.attn_ext.attention_forward(q, k, v, True)
    for name, args in (("dout", (out.to("meta"), q, k, v, out, lse)),
                       ("out", (out, q, k, v, out.to("meta"), lse)),
                       ("lse", (out, q, k, v, out, lse.to("meta")))):
        with pytest.raises(RuntimeError, match=f"{name} must be on the same device as q"):
            torch.ops.attn_ext.attention_backward(*args, True)
    qp, kp = q[0], k[0]
    cu = torch.tensor([0, qp.shape[0]], dtype=torch.int32)
    ck = torch.tensor([0, kp.shape[0]], dtype=torch.int32)
    for name, cq_, ck_ in (("cu_seqlens_q", cu.to("meta"), ck), ("cu_seqlens_k", cu, ck.to("meta"))):
        with pytest.raises(RuntimeError, match=name):
            A.attention_varlen(qp, kp, kp, cq_, ck_, qp.shape[0], kp.shape[0])
