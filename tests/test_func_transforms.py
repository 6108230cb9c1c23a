"""torch.func reverse-mode transforms through the attn_ext ops: grad, vjp, jacrev, per-sample
gradients (vmap of grad, also over a module's parameters with functional_call), and eager
autograd through vmap.

The ops' autograd kernel (ops._register_autograd) records a single-level Function while a
functorch transform is active (register_autograd's own Function has no setup_context, which
torch refuses under a transform). Every gradient here is checked against eager autograd on the
same op and against the float64 textbook. A gradient of a gradient through attention must be
refused loudly (the backward ops have no derivative), never a silent zero from a level that
did not record the backward op; forward mode stays refused (tests/test_errors.py).
"""
import pytest
import torch

import attn_ext
from attn_ext import ops
from attn_ext import reference as R
from tests.utils import max_err, randn

# (torch's performance warning, should an op call fall back to its loop under vmap)
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")

F64 = torch.float64
TOL = 1e-10


def _qkv(B=2, Sq=5, Sk=7, H=4, Hkv=2, D=8):
    return randn(B, Sq, H, D, dtype=F64), randn(B, Sk, Hkv, D, dtype=F64), randn(B, Sk, Hkv, D, dtype=F64)


def _configs():
    H, Sk = 4, 7
    kpm = torch.ones(2, Sk, dtype=torch.bool)
    kpm[0, 5:] = False
    return {
        "plain": {},
        "causal": {"causal": True},
        "window": {"causal": True, "window": (2, 0)},
        "padding": {"key_padding_mask": kpm},
        "alibi": {"causal": True, "alibi_slopes": torch.rand(H, dtype=F64)},
        "softcap": {"softcap": 3.0},
        "sinks": {"sinks": torch.randn(H, dtype=F64)},
        "rel_bias": {"rel_bias": randn(H, 2 * 3 + 1, dtype=F64)},
    }


def _eager_grads(f, args, argnums):
    xs = [a.detach().clone().requires_grad_(i in argnums) for i, a in enumerate(args)]
    f(*xs).backward()
    return [xs[i].grad for i in argnums]


@pytest.mark.parametrize("name", list(_configs()))
def test_grad_matches_eager_and_reference(name):
    terms = _configs()[name]
    q, k, v = _qkv()

    def loss(q, k, v, impl=attn_ext.attention):
        return impl(q, k, v, **terms).square().sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    eager = _eager_grads(loss, (q, k, v), (0, 1, 2))
    ref = _eager_grads(lambda q, k, v: loss(q, k, v, R.attention), (q, k, v), (0, 1, 2))
    for g, e, r, what in zip(grads, eager, ref, "qkv"):
        assert g.shape == e.shape, what
        assert max_err(g, e) == 0.0, what  # the same kernels, the same order
        assert max_err(g, r) < TOL, what


def test_grad_of_the_score_tables_and_lse():
    """Gradients reach the rel_bias and sinks tables through torch.func as through backward();
    the lse output is differentiable under the transform too."""
    q, k, v = _qkv()
    rb, sinks = randn(4, 7, dtype=F64), torch.randn(4, dtype=F64)

    def loss(rb, sinks, impl=attn_ext.attention):
        return impl(q, k, v, causal=True, rel_bias=rb, sinks=sinks).square().sum()

    g_rb, g_s = torch.func.grad(loss, argnums=(0, 1))(rb, sinks)
    r_rb, r_s = _eager_grads(lambda rb, s: loss(rb, s, R.attention), (rb, sinks), (0, 1))
    assert max_err(g_rb, r_rb) < TOL and max_err(g_s, r_s) < TOL

    def lse_loss(q):
        return attn_ext.attention(q, k, v, causal=True, return_lse=True)[1].square().sum()

    def lse_ref(q):
        return R.attention_with_lse(q, k, v, causal=True)[1].square().sum()

    assert max_err(torch.func.grad(lse_loss)(q), _eager_grads(lse_ref, (q,), (0,))[0]) < TOL


def test_vjp_with_two_cotangents():
    q, k, v = _qkv()

    def f(q, k, v):
        return attn_ext.attention(q, k, v, causal=True, return_lse=True)

    (out, lse), vjp = torch.func.vjp(f, q, k, v)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    got = vjp((g_out, g_lse))
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    o_r, l_r = R.attention_with_lse(*xs, causal=True)
    want = torch.autograd.grad((o_r, l_r), xs, (g_out, g_lse))
    for a, b in zip(got, want):
        assert max_err(a, b) < TOL


def test_jacrev_matches_reference_jacobian():
    q, k, v = _qkv(B=1, Sq=3, Sk=4, H=2, Hkv=1, D=4)
    J = torch.func.jacrev(lambda q: attn_ext.attention(q, k, v, causal=True))(q)
    J_ref = torch.autograd.functional.jacobian(lambda q: R.attention(q, k, v, causal=True), q)
    assert J.shape == J_ref.shape
    assert J.abs().max() > 0.1  # a real Jacobian, not zeros
    assert max_err(J, J_ref) < TOL


def test_per_sample_gradients_vmap_of_grad():
    q, k, v = _qkv(B=3)

    def loss(q, k, v):
        return attn_ext.attention(q[None], k[None], v[None], causal=True).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 2)))(q, k, v)
    for b in range(3):
        want = _eager_grads(lambda q, k, v: R.attention(q, k, v, causal=True).square().sum(),
                            (q[b:b + 1], k[b:b + 1], v[b:b + 1]), (0, 2))
        assert max_err(per_sample[0][b], want[0][0]) < TOL
        assert max_err(per_sample[1][b], want[1][0]) < TOL


def test_per_sample_gradients_of_a_module():
    """The usual per-sample-gradient recipe (functional_call + vmap(grad)) over
    MultiHeadAttention's parameters equals one backward per sample."""
    torch.manual_seed(0)
    mha = attn_ext.MultiHeadAttention(16, 2).double()
    x = torch.randn(3, 5, 16, dtype=F64)
    params = {n: p.detach() for n, p in mha.named_parameters()}

    def loss(p, xb):
        return torch.func.functional_call(mha, p, (xb[None],))[0].square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for b in range(3):
        mha.zero_grad()
        mha(x[b:b + 1])[0].square().sum().backward()
        for n, p in mha.named_parameters():
            assert max_err(per_sample[n][b], p.grad) < TOL, n


def test_eager_autograd_through_vmap():
    q, k, v = _qkv(B=3)
    qq = q.clone().requires_grad_()
    out = torch.func.vmap(lambda q: attn_ext.attention(q[None], k[:1], v[:1], causal=True)[0])(qq)
    out.square().sum().backward()
    want = _eager_grads(lambda q: R.attention(q, k[:1].expand(3, -1, -1, -1),
                                              v[:1].expand(3, -1, -1, -1), causal=True).square().sum(),
                        (q,), (0,))[0]
    assert max_err(qq.grad, want) < TOL


def test_varlen_and_positional_ops_under_grad():
    q, k, v = _qkv(B=1, Sq=6, Sk=6)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)

    def varlen(q, k, v, impl=attn_ext.attention_varlen):
        return impl(q[0], k[0], v[0], cu, cu, 4, 4, causal=True).square().sum()

    def varlen_ref(q, k, v):
        return R.attention_varlen_with_lse(q[0], k[0], v[0], cu, cu, causal=True)[0].square().sum()

    got = torch.func.grad(varlen, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, _eager_grads(varlen_ref, (q, k, v), (0, 1, 2))):
        assert max_err(a, b) < TOL

    cos, sin = attn_ext.rope_cache(6, 8, dtype=F64)
    x = randn(2, 6, 4, 8, dtype=F64)
    w = randn(2, 6, 4, 8, dtype=F64)
    g = torch.func.grad(lambda x: (attn_ext.rope(x, cos, sin) * w).sum())(x)
    assert max_err(g, _eager_grads(lambda x: (R.rope(x, cos, sin) * w).sum(), (x,), (0,))[0]) < TOL
    g = torch.func.grad(lambda x: attn_ext.rope_qk(x, 2 * x, cos, sin)[1].mul(w).sum())(x)
    assert max_err(g, _eager_grads(lambda x: (R.rope(2 * x, cos, sin) * w).sum(), (x,), (0,))[0]) < TOL
    y = randn(2, 6, 8, dtype=F64)
    g = torch.func.grad(lambda y: attn_ext.sinusoidal_pe(y).square().sum())(y)
    assert max_err(g, _eager_grads(lambda y: R.sinusoidal_pe(y).square().sum(), (y,), (0,))[0]) < TOL


def test_rope_second_derivative_under_grad():
    """RoPE's backward is differentiable (the inverse rotation is an op with its own
    formula): a gradient of a gradient through it equals the reference's."""
    cos, sin = attn_ext.rope_cache(6, 8, dtype=F64)
    x = randn(1, 6, 2, 8, dtype=F64)

    def inner(impl):
        return lambda x: torch.func.grad(lambda x: impl(x, cos, sin).pow(3).sum())(x).square().sum()

    got = torch.func.grad(inner(attn_ext.rope))(x)
    want = torch.func.grad(inner(R.rope))(x)
    assert got.abs().max() > 0.1
    assert max_err(got, want) < TOL


@pytest.mark.parametrize("wrt", ["q", "k"])
def test_gradient_of_a_gradient_through_attention_is_refused(wrt):
    """Nested torch.func.grad: the outer level must record the backward op (and refuse it),
    not see the inner gradient as a constant and return zeros."""
    q, k, v = _qkv(B=1)

    def inner(q, k):
        return torch.func.grad(lambda q: attn_ext.attention(q, k, v).square().sum())(q).sum()

    outer = torch.func.grad(inner, argnums=0 if wrt == "q" else 1)
    with pytest.raises(RuntimeError, match="double backward through attention is not supported"):
        outer(q, k)


def test_dropout_under_grad_matches_eager_with_the_same_seed():
    q, k, v = _qkv()

    def loss(q):
        return attn_ext.attention(q, k, v, causal=True, dropout_p=0.3).square().sum()

    torch.manual_seed(7)
    got = torch.func.grad(loss)(q)
    torch.manual_seed(7)
    want = _eager_grads(loss, (q,), (0,))[0]
    assert got.abs().max() > 0
    assert max_err(got, want) == 0.0


def test_eager_autograd_keeps_torchs_register_autograd_path():
    """Outside a transform the ops keep torch's register_autograd Function (what
    torch.compile and torch.export trace), not the transform path's single-level one."""
    q, k, v = _qkv()
    out = attn_ext.attention(q.clone().requires_grad_(), k, v, causal=True)
    names, stack = [], [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.append(type(node).__name__)
            stack.extend(n for n, _ in node.next_functions)
    assert any(n.startswith("GeneratedBackwardFor_attn_ext_attention_forward") for n in names), names
    assert not any(n.startswith("attn_ext_") for n in names), names


def test_dropout_under_vmap():
    """vmap's randomness modes with dropout: 'error' is torch's refusal, 'same' gives every
    sample the mask of one call, 'different' (one seed per sample, which the op cannot take)
    is refused by name instead of torch's "Cannot access data pointer"."""
    q, k, v = (randn(3, 1, 5, 2, 8, dtype=F64) for _ in range(3))

    def f(q, k, v):
        return attn_ext.attention(q, k, v, dropout_p=0.3)

    with pytest.raises(RuntimeError, match="randomness"):
        torch.func.vmap(f)(q, k, v)
    torch.manual_seed(3)
    same = torch.func.vmap(f, randomness="same")(q, k, v)
    torch.manual_seed(3)
    seed, offset = ops._dropout_seed_offset(q.device)
    for b in range(3):
        want = torch.ops.attn_ext.attention_forward(q[b], k[b], v[b], False, None, -1, -1, None,
                                                    None, None, None, None, 0.3, seed, offset)[0]
        assert max_err(same[b], want) == 0.0
    with pytest.raises(RuntimeError, match="randomness='different'.* not supported"):
        torch.func.vmap(f, randomness="different")(q, k, v)
