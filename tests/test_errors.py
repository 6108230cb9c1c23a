"""Bad-input matrix and the defined results of edge cases, for every op and module.

Complements the error tests in test_attention.py / test_rope.py / test_sinusoidal.py (which
cover the main shape, dtype and last-dim checks of the functional wrappers): this file
checks the raw ops and the paths those tests do not reach (attention_backward,
_rope_backward, rope_qk_ and the in-place ops, modules), each failure a RuntimeError /
ValueError / TypeError whose message names the argument.

Defined results (DESIGN.md "Errors", README "Semantics of edge cases"):

* Empty tensors (B = 0, S = 0, Sk = 0, no heads) return empty results of the right shape;
  gradients of empty inputs are empty; in-place ops on empty tensors do nothing.
* NaN or inf in an input never crashes or hangs: it propagates NaN into the outputs that
  depend on it (attention: the query rows whose scores involve it; RoPE and sinusoidal:
  the element pairs / elements it sits in) and leaves independent outputs finite.
* Very large logits (q * 1e4) do not overflow: softmax runs in fp32 with a running max, so
  the output stays finite and within the tolerance rule of the float64 reference.
* A query row that sees no key (causal with Sq > Sk, or Sk = 0) gives output 0 and
  lse = -inf, gradient 0, never NaN (test_attention.py covers this; here with Sk = 0
  and gradients).
"""

import pytest
import torch

import attn_ext
from attn_ext import reference as R
from tests.utils import FLOOR, assert_close_rule, max_err, randn

ops = torch.ops.attn_ext
ERRORS = (RuntimeError, ValueError, TypeError)


def _qkv(dtype=torch.float32, B=2, Sq=8, Sk=8, H=4, Hkv=2, D=16, Dv=16):
    return (randn(B, Sq, H, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype),
            randn(B, Sk, Hkv, Dv, dtype=dtype))


def _strided_last(t):
    """A copy of ``t`` whose last dim has stride 2."""
    buf = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2]
    buf.copy_(t)
    return buf


# ---------------------------------------------------------------------------------------
# attention: the raw backward op and the wrappers' remaining paths
# ---------------------------------------------------------------------------------------


def _bwd_args():
    q, k, v = _qkv()
    out, lse = ops.attention_forward(q, k, v, True)
    return dict(dout=torch.randn_like(out), q=q, k=k, v=v, out=out, lse=lse)


def _replace(**kw):
    a = _bwd_args()
    for name, fn in kw.items():
        a[name] = fn(a)
    return a


BWD_CASES = {
    "q-rank": (dict(q=lambda a: a["q"][0]), r"q must have 4 dims"),
    "k-batch": (dict(k=lambda a: a["k"][:1]), r"k must have batch size B = 2"),
    "v-sk": (dict(v=lambda a: a["v"][:, :3]), r"v must have Sk = 8"),
    "k-dim": (dict(k=lambda a: a["k"][..., :8]), r"k must have head dim D = 16"),
    "gqa": (dict(k=lambda a: a["k"][:, :, :1].expand(2, 8, 3, 16),
                 v=lambda a: a["v"][:, :, :1].expand(2, 8, 3, 16)), r"Hkv = 3 must divide"),
    "k-dtype": (dict(k=lambda a: a["k"].double()), r"k must have the same dtype as q"),
    "int": (dict(q=lambda a: a["q"].int(), k=lambda a: a["k"].int(), v=lambda a: a["v"].int()),
            r"q must be float32"),
    "dout-dtype": (dict(dout=lambda a: a["dout"].half()), r"dout must have the same dtype as q"),
    "dout-rank": (dict(dout=lambda a: a["dout"][0]), r"dout must have 4 dims"),
    "out-shape": (dict(out=lambda a: a["out"][:, :, :2]), r"out must have shape"),
    "out-last-dim": (dict(out=lambda a: _strided_last(a["out"])), r"out must have a contiguous last dim"),
    "lse-rank": (dict(lse=lambda a: a["lse"][0]), r"lse must have 3 dims"),
    "lse-int": (dict(lse=lambda a: a["lse"].long()), r"lse must be Float"),
    "q-last-dim": (dict(q=lambda a: _strided_last(a["q"])), r"q must have a contiguous last dim"),
    "v-last-dim": (dict(v=lambda a: _strided_last(a["v"])), r"v must have a contiguous last dim"),
}


@pytest.mark.parametrize("case", list(BWD_CASES))
def test_attention_backward_errors(case):
    kw, pattern = BWD_CASES[case]
    a = _replace(**kw)
    with pytest.raises(RuntimeError, match=pattern):
        ops.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], True)


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), r"Hkv = 0 must divide q's number of heads H = 4"),
        (lambda q, k, v: (q[:, :, :1], k, v), r"Hkv = 2 must divide q's number of heads H = 1"),
        (lambda q, k, v: (q.bool(), k.bool(), v.bool()), r"q must be float32, float64, float16 or bfloat16"),
        (lambda q, k, v: (q.to(torch.complex64), k.to(torch.complex64), v.to(torch.complex64)),
         r"q must be float32, float64, float16 or bfloat16"),
        (lambda q, k, v: (q.half(), k.half(), v.bfloat16()), r"v must have the same dtype as q"),
        (lambda q, k, v: (q[..., None], k, v), r"q must have 4 dims"),
    ],
    ids=["hkv=0", "hkv>h", "bool", "complex", "half-bf16-mix", "q-5d"],
)
def test_attention_more_errors(make, pattern):
    q, k, v = make(*_qkv())
    for call in (lambda: ops.attention_forward(q, k, v, False),
                 lambda: ops.causal_attention(q, k, v)):
        with pytest.raises(RuntimeError, match=pattern):
            call()


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan")])
def test_attention_scale_not_finite(scale):
    q, k, v = _qkv()
    for call in (lambda: attn_ext.attention(q, k, v, scale=scale),
                 lambda: attn_ext.causal_attention(q, k, v, scale=scale)):
        with pytest.raises(RuntimeError, match=r"scale must be finite"):
            call()


def test_attention_wrapper_rank_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"with 3-D q \(B, Sq, D\), k and v must be 3-D"):
        attn_ext.causal_attention(q[:, :, 0], k, v[:, :, 0])
    with pytest.raises(RuntimeError, match=r"q must have 4 dims"):
        attn_ext.attention(q[0, 0], k, v)  # 2-D q


def test_attention_device_mix():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match=r"v must be on the same device as q"):
        ops.attention_forward(q.cuda(), k.cuda(), v, True)
    a = _bwd_args()
    with pytest.raises(RuntimeError, match=r"lse must be on the same device as q"):
        ops.attention_backward(*[a[n].cuda() for n in ("dout", "q", "k", "v", "out")], a["lse"], True)


# ---------------------------------------------------------------------------------------
# RoPE: raw ops, in-place ops, q/k in one call, positions
# ---------------------------------------------------------------------------------------


def _rope_inputs(B=2, S=4, H=2, D=16, s_max=8, rot=16):
    x = randn(B, S, H, D)
    cos, sin = attn_ext.rope_cache(s_max, rot)
    return x, cos, sin


ROPE_OPS = {
    "rope": lambda x, c, s, *a: ops.rope(x, c, s, *a),
    "rope_": lambda x, c, s, *a: ops.rope_(x, c, s, *a),
    "_rope_backward": lambda x, c, s, *a: ops._rope_backward(x, c, s, *a),
    "rope_qk_": lambda x, c, s, *a: ops.rope_qk_(x, x.clone(), c, s, *a),
}

ROPE_CASES = {
    # name: (make (x, cos, sin, positions, offset) from the defaults, pattern)
    "x-rank": (lambda x, c, s: (x[0], c, s, None, 0), r"(x|grad|q) must have 4 dims \(B, S, H, D\)"),
    "x-int": (lambda x, c, s: (x.long(), c, s, None, 0), r"(x|grad|q) must be float32, float64, float16 or bfloat16"),
    "x-last-dim": (lambda x, c, s: (_strided_last(x), c, s, None, 0), r"(x|grad|q) must have a contiguous last dim"),
    "rotary>D": (lambda x, c, s: (x[..., :8], c, s, None, 0), r"rotary_dim = 2 \* cos.size\(-1\) = 16 must be <= the head dim D"),
    "sin-shape": (lambda x, c, s: (x, c, s[:4], None, 0), r"cos and sin must have the same shape"),
    "cos-rank": (lambda x, c, s: (x, c[None], s[None], None, 0), r"cos must have 2 dims"),
    "cos-int": (lambda x, c, s: (x, c.long(), s.long(), None, 0), r"cos/sin must be float32 or x's dtype"),
    "cos-last-dim": (lambda x, c, s: (x, _strided_last(c), s, None, 0), r"cos must have a contiguous last dim"),
    "sin-last-dim": (lambda x, c, s: (x, c, _strided_last(s), None, 0), r"sin must have a contiguous last dim"),
    "cos-too-short": (lambda x, c, s: (x, c[:3], s[:3], None, 0), r"offset \+ S = 0 \+ 4 must lie in \[0, cos.size\(0\) = 3\]"),
    "offset-too-large": (lambda x, c, s: (x, c, s, None, 5), r"offset \+ S = 5 \+ 4"),
    "offset-negative": (lambda x, c, s: (x, c, s, None, -3), r"offset must be >= 0, got -3"),
    "offset-huge": (lambda x, c, s: (x, c, s, None, 2**63 - 2), r"offset \+ S = 9223372036854775806 \+ 4"),
    "positions-float": (lambda x, c, s: (x, c, s, torch.arange(4.0), 0), r"positions must be int64"),
    "positions-int32": (lambda x, c, s: (x, c, s, torch.arange(4, dtype=torch.int32), 0), r"positions must be int64"),
    "positions-3d": (lambda x, c, s: (x, c, s, torch.zeros(2, 4, 1, dtype=torch.long), 0), r"positions must have shape \(S,\) or \(B, S\)"),
    "positions-B": (lambda x, c, s: (x, c, s, torch.zeros(3, 4, dtype=torch.long), 0), r"positions of shape \(B, S\) must be \(2, 4\)"),
    "positions-S": (lambda x, c, s: (x, c, s, torch.zeros(5, dtype=torch.long), 0), r"positions of shape \(S,\) must have S = 4"),
    "positions-negative": (lambda x, c, s: (x, c, s, torch.tensor([0, 1, -5, 2]), 0), r"positions\[2\] = -5"),
    "positions-too-large": (lambda x, c, s: (x, c, s, torch.tensor([[0, 1, 2, 3], [0, 1, 2, 2**40]]), 0),
                            r"positions must lie in \[0, cos.size\(0\) = 8\), got positions\[1, 3\] = 1099511627776"),
}


@pytest.mark.parametrize("op", list(ROPE_OPS))
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_op_errors(op, case):
    make, pattern = ROPE_CASES[case]
    args = make(*_rope_inputs())
    before = args[0].clone()
    with pytest.raises(RuntimeError, match=pattern):
        ROPE_OPS[op](*args, False)
    assert torch.equal(args[0], before) or torch.isnan(before).any()  # nothing half-written


@pytest.mark.parametrize(
    "make_k, pattern",
    [
        (lambda q: q[0], r"k must have B = 2 and S = 4"),  # 3-D k is read as (B, S, 1, D)
        (lambda q: q[:, :3], r"k must have B = 2 and S = 4"),
        (lambda q: q[:1], r"k must have B = 2 and S = 4"),
        (lambda q: _strided_last(q), r"k must have a contiguous last dim"),
        (lambda q: q.half(), r"k must have q's dtype"),
        (lambda q: q[..., :8].contiguous(), r"rotary_dim = 2 \* cos.size\(-1\) = 16 must be <= the head dim D = k.size\(-1\) = 8"),
    ],
    ids=["rank", "S", "B", "last-dim", "dtype", "rotary>Dk"],
)
def test_rope_qk_k_errors(make_k, pattern):
    q, cos, sin = _rope_inputs()
    k = make_k(q.clone())
    q0 = q.clone()
    with pytest.raises((RuntimeError, ValueError), match=pattern):
        attn_ext.rope_qk(q, k, cos, sin, inplace=True)
    assert torch.equal(q, q0)  # q not rotated when k is refused


def test_rope_tables_requiring_grad_are_refused():
    """cos/sin are not differentiable: out-of-place calls that would silently drop their
    gradient raise instead (rope, rope_qk, RotaryEmbedding with a learnable table)."""
    x, cos, sin = _rope_inputs()
    x.requires_grad_()
    with pytest.raises(ValueError, match=r"cos/sin"):
        attn_ext.rope(x, cos, sin.clone().requires_grad_())
    with pytest.raises(ValueError, match=r"cos/sin"):
        attn_ext.rope_qk(x, x, cos.clone().requires_grad_(), sin)
    # Under no_grad the tables' requires_grad does not matter: no gradient is formed.
    with torch.no_grad():
        out = attn_ext.rope(x, cos.clone().requires_grad_(), sin)
    assert not out.requires_grad


def test_rope_qk_raw_op_rank():
    q, cos, sin = _rope_inputs()
    with pytest.raises(RuntimeError, match=r"k must have 4 dims \(B, S, H, D\)"):
        ops.rope_qk_(q, q[0], cos, sin)
    with pytest.raises(RuntimeError, match=r"q must have 4 dims \(B, S, H, D\)"):
        ops.rope_qk_(q[0], q, cos, sin)


def test_rope_wrapper_3d_and_rank_errors():
    x, cos, sin = _rope_inputs()
    with pytest.raises(RuntimeError, match=r"x must have 4 dims"):
        attn_ext.rope(x[0, 0], cos, sin)  # 2-D: not a 3-D single-head input either
    with pytest.raises(RuntimeError, match=r"x must have 4 dims"):
        attn_ext.rope_(x[..., None], cos, sin)


def test_rope_device_mix():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x, cos, sin = _rope_inputs()
    with pytest.raises(RuntimeError, match=r"cos must be on the same device as x"):
        ops.rope(x.cuda(), cos, sin.cuda())
    with pytest.raises(RuntimeError, match=r"positions must be on the same device as x"):
        ops.rope(x.cuda(), cos.cuda(), sin.cuda(), torch.arange(4))


# ---------------------------------------------------------------------------------------
# sinusoidal
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda x: (x[0, 0],), r"x must have 3 dims \(B, S, D\) or 2 dims \(S, D\)"),
        (lambda x: (x.bool(),), r"x must be float32"),
        (lambda x: (x, torch.arange(3, dtype=torch.int32)), r"positions must be int64"),
        (lambda x: (x, torch.zeros(2, 3, 1, dtype=torch.long)), r"positions must have shape \(S,\) or \(B, S\)"),
        (lambda x: (x, None, 0, float("nan")), r"base must be a positive finite number"),
        (lambda x: (x, None, 0, float("inf")), r"base must be a positive finite number"),
        (lambda x: (x, None, 0, 0.0), r"base must be a positive finite number"),
    ],
    ids=["1d", "bool", "pos-int32", "pos-3d", "base-nan", "base-inf", "base-0"],
)
@pytest.mark.parametrize("inplace", [False, True])
def test_sinusoidal_errors(make, pattern, inplace):
    args = make(randn(2, 3, 4))
    fn = ops.sinusoidal_pe_ if inplace else ops.sinusoidal_pe
    with pytest.raises(RuntimeError, match=pattern):
        fn(*args)


def test_sinusoidal_table_errors():
    with pytest.raises(ValueError, match=r"seq_len must be >= 0, got -1"):
        attn_ext.sinusoidal_table(-1, 8)
    with pytest.raises(ValueError, match=r"dim must be >= 0, got -8"):
        attn_ext.sinusoidal_table(4, -8)


# ---------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------


def test_module_errors():
    with pytest.raises(ValueError, match=r"num_kv_heads must divide num_heads"):
        attn_ext.MultiHeadAttention(64, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"num_kv_heads must divide num_heads"):
        attn_ext.MultiHeadAttention(64, num_heads=4, num_kv_heads=0)
    with pytest.raises(ValueError, match=r"d_model must be divisible by num_heads"):
        attn_ext.MultiHeadAttention(2, num_heads=4)
    with pytest.raises(ValueError, match=r"head dims must be positive"):
        attn_ext.MultiHeadAttention(2, num_heads=4, qk_dim=0)
    with pytest.raises(TypeError, match=r"rotary must be None, an int rotary_dim or a RotaryEmbedding"):
        attn_ext.MultiHeadAttention(64, num_heads=4, rotary="yes")
    with pytest.raises(ValueError, match=r"rotary_dim 32 must be <= head dim 16"):
        attn_ext.MultiHeadAttention(64, num_heads=4, rotary=32)
    for bad in (7, 0, -2):
        with pytest.raises(ValueError, match=r"rotary_dim must be a positive even number"):
            attn_ext.RotaryEmbedding(bad)
    with pytest.raises(ValueError, match=r"base must be a positive finite number"):
        attn_ext.RotaryEmbedding(8, base=-1.0)
    # (a fused layer takes memory: tests/test_modules.py; its shape is checked)
    with pytest.raises(ValueError, match=r"memory must have shape \(B, Sk, kv_dim\) = \(1, Sk, 16\)"):
        m = attn_ext.MultiHeadAttention(16, num_heads=2)
        m(randn(1, 3, 16), memory=randn(1, 3, 8))


def test_module_input_errors():
    rot = attn_ext.RotaryEmbedding(8)
    q = randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match=r"offset must be >= 0, got -2"):
        rot(q, q.clone(), offset=-2)
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, cos.size\(0\) = \d+\), got positions\[1\] = -1"):
        rot(q, q.clone(), positions=torch.tensor([0, -1, 2, 3]))
    cache = attn_ext.MultiHeadAttention(16, num_heads=2).new_kv_cache(1, 4)
    k = randn(1, 3, 2, 8)
    cache.update(k, k)
    with pytest.raises(RuntimeError, match=r"KVCache is full: 3 \+ 3 new tokens > max_len 4"):
        cache.update(k, k)
    pe = attn_ext.LearnedPositionalEmbedding(8, 16)
    with pytest.raises(ValueError, match=r"positions must be in \[0, 8\)"):
        pe(randn(1, 2, 16), positions=torch.tensor([3, -1]))
    # the wrong shape, dtype or width names the argument (it used to be a broadcasting error
    # from deep inside torch that named no argument)
    x = randn(2, 5, 16)
    for bad in (torch.arange(4), torch.zeros(3, 5, dtype=torch.long), torch.zeros(2, 5, 1, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"positions must have shape \(S,\) = \(5,\) or \(B, S\) = \(2, 5\)"):
            pe(x, positions=bad)
    with pytest.raises(ValueError, match="positions must be int64"):
        pe(x, positions=torch.arange(5.0))
    with pytest.raises(ValueError, match="x must have shape .B, S, d_model. with d_model = 16"):
        pe(randn(2, 5, 8))
    for good in (torch.arange(5), torch.arange(5, dtype=torch.int32), torch.arange(5).expand(2, 5)):
        torch.testing.assert_close(pe(x, positions=good), x + pe.embedding.weight[:5])


# ---------------------------------------------------------------------------------------
# defined results of edge cases
# ---------------------------------------------------------------------------------------


def test_zero_query_heads_is_empty():
    """H = 0 query heads with Hkv = 2 kv heads (0 is a multiple of 2): an empty result."""
    q, k, v = _qkv()
    out, lse = attn_ext.attention(q[:, :, :0], k, v, return_lse=True)
    assert out.shape == (2, 8, 0, 16) and lse.shape == (2, 0, 8)


def test_empty_keys_with_gradients():
    """Sk = 0: every row sees no key -> out 0, lse -inf; gradients are 0 (q) / empty (k, v)."""
    q, k, v = [t.requires_grad_() for t in _qkv(Sk=0)]
    out, lse = attn_ext.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 8, 4, 16) and torch.all(out == 0)
    assert torch.all(lse == float("-inf"))
    out.sum().backward()
    assert torch.all(q.grad == 0) and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_empty_rope_and_sinusoidal_edge_cases():
    """S = 0 with positions of shape (0,) / (B, 0), and zero-row tables: empty, no error."""
    x = torch.empty(2, 0, 3, 16)
    cos, sin = attn_ext.rope_cache(0, 16)
    assert ops.rope(x, cos, sin).shape == x.shape
    assert ops.rope(x, cos, sin, torch.empty(0, dtype=torch.long)).shape == x.shape
    ops.rope_qk_(x, torch.empty(2, 0, 1, 16), cos, sin, torch.empty(2, 0, dtype=torch.long))
    assert ops._rope_backward(x, cos, sin).shape == x.shape
    y = torch.empty(0, 5, 7)
    assert attn_ext.sinusoidal_pe(y, torch.empty(0, 5, dtype=torch.long)).shape == y.shape
    assert attn_ext.sinusoidal_pe(torch.empty(3, 0, 7), torch.empty(0, dtype=torch.long)).shape == (3, 0, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_nan_inf_propagate_attention(dtype):
    """NaN/inf in one query row reaches exactly that row's output (NaN) and lse (the
    reference's torch.logsumexp: NaN for NaN, +inf where a score is +inf), every other row
    stays finite and equal to the clean run; NaN in a key reaches the rows that see it."""
    q, k, v = _qkv(dtype, Sq=12, Sk=12)
    # Keys 0 and 1 of kv head 1 (read by query head 3) have opposite signs in channel 2, so
    # an inf in q[..., 3, 2] makes scores of both signs (+inf and -inf), whatever the seed.
    k[1, 0, 1, 2], k[1, 1, 1, 2] = 1.0, -1.0
    clean, clean_lse = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    for bad in (float("nan"), float("inf"), float("-inf")):
        qb = q.clone()
        qb[1, 5, 3, 2] = bad
        out, lse = attn_ext.attention(qb, k, v, causal=True, return_lse=True)
        # inf * k gives +-inf scores of both signs -> inf - inf = NaN in the softmax, while
        # the log-sum-exp of a row holding +inf is +inf.
        assert torch.isnan(out[1, 5, 3]).all(), bad
        if bad != bad:
            assert torch.isnan(lse[1, 3, 5]), bad
        else:
            assert lse[1, 3, 5] == float("inf"), bad
        mask = torch.ones_like(out, dtype=torch.bool)
        mask[1, 5, 3] = False
        assert torch.equal(out[mask], clean[mask]), bad
    kb = k.clone()
    kb[0, 7, 1, 0] = float("nan")  # kv head 1 serves query heads 2, 3
    out = attn_ext.attention(q, kb, v, causal=True)
    assert torch.isnan(out[0, 7:, 2:4]).all()  # rows 7.. see key 7
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[0, :, :2]).all()


def test_nan_inf_propagate_pos_enc():
    """RoPE: NaN/inf in a channel reaches its rotation pair only (inf * 0 = NaN inside the
    pair is allowed); sinusoidal: x + PE keeps NaN/inf where they are."""
    x, cos, sin = _rope_inputs(D=32, rot=16)
    x[1, 2, 0, 3] = float("nan")
    x[0, 1, 1, 20] = float("inf")  # a pass-through channel: stays inf
    out = attn_ext.rope(x, cos, sin, offset=1)
    bad = torch.zeros_like(out, dtype=torch.bool)
    bad[1, 2, 0, [3, 11]] = True  # half-split: channel 3 pairs with 3 + 8
    assert torch.isnan(out[bad]).all()
    assert out[0, 1, 1, 20] == float("inf")
    bad[0, 1, 1, 20] = True
    assert torch.isfinite(out[~bad]).all()
    y = randn(2, 5, 6)
    y[0, 1, 2] = float("nan")
    y[1, 4, 5] = float("-inf")
    pe = attn_ext.sinusoidal_pe(y, offset=3)
    assert torch.isnan(pe[0, 1, 2]) and pe[1, 4, 5] == float("-inf")
    assert torch.isfinite(pe).sum() == pe.numel() - 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_large_logits_do_not_overflow(dtype, causal):
    """Scores of order 1e4..1e5 (far past exp's range) stay finite: the running max makes
    every exponent <= 0. Values and lse follow the float64 reference by the tolerance rule;
    gradients are finite."""
    mult = 1e3 if dtype == torch.float16 else 1e4  # fp16 inputs themselves top out at 65504
    q64 = torch.randn(1, 24, 2, 16, dtype=torch.float64) * mult
    q, k, v = q64.to(dtype), randn(1, 24, 2, 16, dtype=dtype), randn(1, 24, 2, 16, dtype=dtype)
    q.requires_grad_()
    out, lse = attn_ext.attention(q, k, v, causal=causal, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert lse.abs().max() > 1000  # the logits really are large
    ref64 = R.attention_with_lse(q.detach().double(), k.double(), v.double(), causal)
    ref32 = R.attention_with_lse(q.detach().float(), k.float(), v.float(), causal)
    # The reference in fp32 is the fair comparison: fp16/bf16 reference scores of this size
    # are meaningless (fp16 overflows to inf; ours accumulates in fp32), so the bound is
    # 2x the fp32 reference's error plus rounding the output to the input dtype.
    if dtype == torch.float32:
        assert_close_rule(out, ref64[0], ref32[0], "out")
    else:
        eps = torch.finfo(dtype).eps
        bound = 2 * max_err(ref32[0], ref64[0]) + eps * float(ref64[0].abs().max()) + FLOOR[dtype]
        assert max_err(out, ref64[0]) <= bound
    # lse ~ 1e4: a few fp32 ulps of it (1e-3 each) come from the summation order alone.
    lse_bound = 2 * max_err(ref32[1], ref64[1]) + 8 * torch.finfo(torch.float32).eps * float(ref64[1].abs().max())
    assert max_err(lse, ref64[1]) <= lse_bound
    out.float().sum().backward()
    assert torch.isfinite(q.grad).all()


# ---- forward-mode AD: refused, never a silent zero tangent ----------------------------------
# The ops have reverse-mode formulas only. torch's custom-op autograd kernel drops a tangent it
# has no formula for when no argument requires grad, which would give jvp a zero tangent; every
# op refuses instead (ops._refuse_forward_ad).

def _fwd_ad_cases():
    q, k, v = (randn(1, 4, 2, 8, dtype=torch.float64) for _ in range(3))
    cos, sin = attn_ext.rope_cache(8, 8, dtype=torch.float64)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    mha = attn_ext.MultiHeadAttention(8, 2).double()
    return q, {
        "attention": lambda x: attn_ext.attention(x, k, v, causal=True),
        "attention_padding_lse": lambda x: attn_ext.attention(
            x, k, v, key_padding_mask=torch.ones(1, 4, dtype=torch.bool), return_lse=True)[1],
        "tangent_on_v": lambda x: attn_ext.attention(q, k, x),
        "op_attention": lambda x: ops.attention(x, k, v, True),
        "op_causal_attention": lambda x: ops.causal_attention(x, k, v),
        "attention_varlen": lambda x: attn_ext.attention_varlen(x[0], k[0], v[0], cu, cu, 4, 4),
        "rope": lambda x: attn_ext.rope(x, cos, sin),
        "rope_qk": lambda x: attn_ext.rope_qk(x, x, cos, sin)[1],
        "rope_inplace": lambda x: attn_ext.rope_(x.clone(), cos, sin),
        "sinusoidal_pe": lambda x: attn_ext.sinusoidal_pe(x[:, :, 0]),
        "module": lambda x: mha(x[:, :, 0])[0],
    }


@pytest.mark.parametrize("how", ["func.jvp", "forward_ad"])
@pytest.mark.parametrize("case", list(_fwd_ad_cases()[1]))
def test_forward_mode_ad_is_refused(case, how):
    q, cases = _fwd_ad_cases()
    f, t = cases[case], randn(*q.shape, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="forward-mode AD .* is not supported"):
        if how == "func.jvp":
            torch.func.jvp(f, (q,), (t,))
        else:
            import torch.autograd.forward_ad as fwAD
            with fwAD.dual_level():
                f(fwAD.make_dual(q, t))


def test_forward_mode_ad_elsewhere_and_reverse_mode_still_work():
    """A dual level whose tangent never reaches an attn_ext op is fine, and reverse mode and
    vmap are untouched by the refusal."""
    import torch.autograd.forward_ad as fwAD
    q, k, v = (randn(1, 4, 2, 8, dtype=torch.float64) for _ in range(3))
    t = randn(1, 4, 2, 8, dtype=torch.float64)
    with fwAD.dual_level():
        y = 2 * fwAD.make_dual(q, t) + attn_ext.attention(q, k, v)
        assert torch.equal(fwAD.unpack_dual(y).tangent, 2 * t)
    qq = q.clone().requires_grad_()
    (g,) = torch.autograd.grad(attn_ext.attention(qq, k, v, causal=True), qq, t)
    qr = q.clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(R.attention(qr, k, v, causal=True), qr, t)
    assert max_err(g, g_ref) < 1e-10
    batched = torch.func.vmap(attn_ext.attention)(q[:, None], k[:, None], v[:, None])
    assert max_err(batched[:, 0], R.attention(q, k, v)) < 1e-10


def test_numpy_scalars_for_scale_softcap_window_and_max_seqlen():
    """numpy float scalars: a finite one is taken silently as the same Python float (comparing
    a float32 with float's max cast the bound to inf: an overflow warning on every call, and
    np.float32(inf) passed to the op, which refused it without naming the argument); numpy
    ints are a window's sides like ints; a max_seqlen past int64 is refused by name."""
    import warnings

    import numpy as np

    import attn_ext
    from attn_ext.ops import ArgumentValueError

    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 5, 2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = attn_ext.attention(q, k, k, scale=np.float32(0.5), softcap=np.float16(30))
    assert torch.equal(got, attn_ext.attention(q, k, k, scale=0.5, softcap=30.0))
    with pytest.raises(ArgumentValueError, match="scale must be finite"):
        attn_ext.attention(q, k, k, scale=np.float32("inf"))
    with pytest.raises(ValueError, match="softcap must be a finite number"):
        attn_ext.attention(q, k, k, softcap=np.float32("inf"))
    assert torch.equal(attn_ext.attention(q, k, k, window=(np.int64(2), np.int32(0))),
                       attn_ext.attention(q, k, k, window=(2, 0)))
    qv, cu = torch.randn(5, 2, 8), torch.tensor([0, 5], dtype=torch.int32)
    for name, args in (("max_seqlen_q", (2**63, 5)), ("max_seqlen_k", (5, -2**63 - 1))):
        with pytest.raises(ArgumentValueError, match=f"{name} must fit in int64"):
            attn_ext.attention_varlen(qv, qv, qv, cu, cu, *args)


def test_return_lse_must_be_a_bool():
    """return_lse="no" counted as True (the output became a tuple); a non-bool is refused by
    name, in attention and attention_varlen."""
    import attn_ext
    from attn_ext.ops import ArgumentTypeError

    q = torch.randn(1, 3, 2, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ArgumentTypeError, match="return_lse must be a bool"):
        attn_ext.attention(q, q, q, return_lse="no")
    with pytest.raises(ArgumentTypeError, match="return_lse must be a bool"):
        attn_ext.attention_varlen(q[0], q[0], q[0], cu, cu, 3, 3, return_lse=1)
