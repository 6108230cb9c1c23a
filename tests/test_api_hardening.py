"""API traps of issue 18: cross-attention defaults and cached cross-attention (item 3),
keyword-only arguments (item 5), RotaryEmbedding without host syncs and attention_weights'
checks (item 6)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch.overrides import TorchFunctionMode

import attn_ext
from attn_ext import MultiHeadAttention, RotaryEmbedding
from attn_ext import reference as R
from tests.utils import randn

f64 = torch.float64


# ---- item 3: cross-attention --------------------------------------------------------------


def test_cross_attention_is_not_causal_by_default():
    assert MultiHeadAttention(16, 2, cross_attention=True).causal is False
    assert MultiHeadAttention(16, 2).causal is True  # self-attention: causal by default
    assert MultiHeadAttention(16, 2, cross_attention=True, causal=True).causal is True
    assert MultiHeadAttention(16, 2, causal=False).causal is False


def test_cross_attention_default_sees_the_whole_memory():
    """Every query row attends to every memory position: equal to the textbook without mask."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, cross_attention=True).double().eval()
    x, mem = torch.randn(2, 5, 16, dtype=f64), torch.randn(2, 9, 16, dtype=f64)
    q = layer.q_proj(x).view(2, 5, 2, 8)
    kv = layer.kv_proj(mem)
    k, v = kv[..., :16].view(2, 9, 2, 8), kv[..., 16:].view(2, 9, 2, 8)
    want = layer.out_proj(R.attention(q, k, v, causal=False).reshape(2, 5, 16))
    torch.testing.assert_close(layer(x, mem)[0], want, rtol=1e-10, atol=1e-10)


class _CountCalls:
    def __init__(self, module):
        self.n = 0
        module.register_forward_hook(self._hook)

    def _hook(self, *args):
        self.n += 1


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_fused_layer_over_memory_is_not_causal_by_default():
    """A default (self-attention, causal) fused layer called as forward(x, memory) attends to
    the whole memory: causal over an encoder's memory only when causal=True was asked for (it
    used to hide memory keys 5-8 from query 0 for Sq = 5, Sk = 9)."""
    torch.manual_seed(0)
    x, mem = torch.randn(2, 5, 16, dtype=f64), torch.randn(2, 9, 16, dtype=f64)
    for asked, want_causal in ((None, False), (False, False), (True, True)):
        kw = {} if asked is None else {"causal": asked}
        layer = MultiHeadAttention(16, 2, **kw).double().eval()
        assert layer.causal is (asked is not False)  # self-attention keeps its default
        w, b = layer.qkv.weight, layer.qkv.bias
        q = torch.nn.functional.linear(x, w[:16], b[:16]).view(2, 5, 2, 8)
        kv = torch.nn.functional.linear(mem, w[16:], b[16:])
        k, v = kv[..., :16].view(2, 9, 2, 8), kv[..., 16:].view(2, 9, 2, 8)
        want = layer.out_proj(R.attention(q, k, v, causal=want_causal).reshape(2, 5, 16))
        out, weights = layer(x, mem, need_weights=True)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(layer(x, mem)[0], want, rtol=1e-10, atol=1e-10)
        assert bool((weights[:, :, 0, 5:] > 0).all()) is not want_causal
        torch.testing.assert_close(torch.jit.script(layer)(x, mem)[0], want, rtol=1e-10, atol=1e-10)
        assert torch.equal(layer(x)[0], layer(x, None)[0])  # self-attention unchanged


def test_failed_cached_step_leaves_the_cache_unchanged():
    """A step whose key_padding_mask is wrong is refused before its keys are appended (they
    used to stay in the cache, so a retry attended to them twice), and a (B, 1) mask no longer
    broadcasts against a left-padded cache's own mask."""
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 2, rotary=8).double().eval()
    x = torch.randn(2, 3, 16, dtype=f64)
    full = m(x)[0]
    c = m.new_kv_cache(2, 8)
    m(x[:, :2], kv_cache=c)
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool \(B, Sk\) = \(2, 3\) with a kv_cache"):
        m(x[:, 2:3], kv_cache=c, key_padding_mask=torch.ones(2, 7, dtype=torch.bool))
    assert c.length == 2
    step = m(x[:, 2:3], kv_cache=c, key_padding_mask=torch.ones(2, 3, dtype=torch.bool))[0]
    torch.testing.assert_close(step, full[:, 2:3], rtol=1e-10, atol=1e-10)
    c2 = m.new_kv_cache(2, 8)
    c2.set_left_padding(torch.tensor([1, 0]))
    for bad in (torch.tensor([[True], [False]]), torch.ones(1, 2, dtype=torch.bool)):
        with pytest.raises(ValueError, match="key_padding_mask must be bool"):
            m(x[:, :2], kv_cache=c2, key_padding_mask=bad)
        assert c2.length == 0
    with pytest.raises(ValueError, match="k_new must be a floating-point tensor"):
        c2.update(torch.ones(2, 1, 2, 8, dtype=torch.int64), torch.ones(2, 1, 2, 8, dtype=f64))
    with pytest.raises(ValueError, match="v_new must be on the cache's device"):
        c2.update(torch.ones(2, 1, 2, 8, dtype=f64), torch.ones(2, 1, 2, 8, dtype=f64, device="meta"))
    assert c2.length == 0


def test_causal_and_softcap_arguments_are_checked():
    q = randn(1, 4, 2, 8, dtype=f64)
    for bad in (None, "yes", 2):
        with pytest.raises(ValueError, match="causal must be a bool"):
            attn_ext.attention(q, q, q, causal=bad)
        with pytest.raises(ValueError, match="causal must be a bool"):
            attn_ext.attention_weights(q, q, causal=bad)
    torch.testing.assert_close(attn_ext.attention(q, q, q, causal=1), attn_ext.attention(q, q, q, causal=True))
    for bad in (float("inf"), True, 0.0, "3", 10**400):
        with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
            MultiHeadAttention(16, 2, softcap=bad)
    # an int past float's range is refused by name (float() used to raise a bare OverflowError)
    for name in ("scale", "softcap"):
        for big in (10**400, -(10**400)):
            with pytest.raises(ValueError, match=rf"{name} must be .*an int of 401 digits"):
                attn_ext.attention(q, q, q, **{name: big})
    with pytest.raises(ValueError, match="scale must be finite"):
        attn_ext.attention_weights(q, q, scale=10**400)
    big_ok = attn_ext.attention(q, q, q, scale=10**300)  # an int within float's range is a scale
    assert big_ok.shape == q.shape
    with pytest.raises(ValueError, match="kv_dim .* is for cross_attention=True layers"):
        MultiHeadAttention(16, 2, kv_dim=8)  # used to be dropped without a word
    # flags and sizes by type (cross_attention="no" was truthy: a cross-attention layer;
    # kv_dim=0 was taken; causal="no" failed only at forward)
    for kw, name in (({"cross_attention": "no"}, "cross_attention"), ({"causal": "no"}, "causal"),
                     ({"alibi": "yes"}, "alibi"), ({"kv_dim": 0, "cross_attention": True}, "kv_dim"),
                     ({"num_kv_heads": 1.0}, "num_kv_heads"), ({"qk_dim": 4.5}, "qk_dim")):
        with pytest.raises(ValueError, match=f"{name} must be a"):
            MultiHeadAttention(16, 2, **kw)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        MultiHeadAttention(16, 2.0)


def test_positional_encoding_flags_and_numbers_are_checked():
    """rope / rope_ / rope_qk / sinusoidal_pe(_) take their flags and numbers by type: the op's
    parser took None or a string as False and 2 as True, a bool offset as 0 / 1 and a bool
    base as 1.0, and rope_qk(..., inplace="no") rotated q and k in place."""
    x = randn(2, 5, 4, 8, dtype=f64)
    cos, sin = attn_ext.rope_cache(10, 8, dtype=f64)
    q, k = x.clone(), x.clone()
    with pytest.raises(ValueError, match="inplace must be a bool"):
        attn_ext.rope_qk(q, k, cos, sin, inplace="no")
    assert torch.equal(q, x) and torch.equal(k, x)  # nothing rotated
    for fn in (lambda **kw: attn_ext.rope(x, cos, sin, **kw),
               lambda **kw: attn_ext.rope_(x.clone(), cos, sin, **kw),
               lambda **kw: attn_ext.rope_qk(x, x, cos, sin, **kw),
               lambda **kw: attn_ext.rope_qk(x.clone(), x.clone(), cos, sin, inplace=True, **kw)):
        for bad in (None, "yes", 2):
            with pytest.raises(ValueError, match="interleaved must be a bool"):
                fn(interleaved=bad)
        for bad in (True, None, 1.0, torch.tensor(1.0)):
            with pytest.raises(TypeError, match="offset must be an int"):
                fn(offset=bad)
    with pytest.raises(ValueError, match="interleaved must be a bool"):
        RotaryEmbedding(8, interleaved="no")
    want = attn_ext.rope(x, cos, sin, offset=2, interleaved=True)
    for offset in (2, torch.tensor(2)):  # an int, or a 0-dim integer tensor
        for flag in (True, 1):
            torch.testing.assert_close(attn_ext.rope(x, cos, sin, offset=offset, interleaved=flag),
                                       want, rtol=0, atol=0)
    y = x[:, :, 0]
    for fn in (attn_ext.sinusoidal_pe, lambda t, **kw: attn_ext.sinusoidal_pe_(t.clone(), **kw)):
        with pytest.raises(TypeError, match="base must be a positive finite number"):
            fn(y, base=True)
        with pytest.raises(TypeError, match="offset must be an int"):
            fn(y, offset=False)
        torch.testing.assert_close(fn(y, base=100, offset=3), attn_ext.sinusoidal_pe(y, None, 3, 100.0),
                                   rtol=0, atol=0)


def test_softcap_past_float32_range_is_refused_below_float64():
    """A finite softcap past float32's range (half of it: the CUDA kernels cap in base-2 units)
    became inf in the float32 kernels, and inf * tanh(s / inf) made every output NaN. Below
    float64 it is refused by name (the op, attention_weights and the layers); float64 takes
    it, and the result is the float64 reference's."""
    q = randn(1, 4, 2, 8, dtype=f64)
    big = 1e39
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x = q.to(dt)
        for call in (lambda: attn_ext.attention(x, x, x, softcap=big),
                     lambda: torch.ops.attn_ext.attention_forward(x, x, x, False, None, softcap=big),
                     lambda: attn_ext.attention_weights(x, x, softcap=big),
                     lambda: MultiHeadAttention(16, 2, softcap=big).to(dt)(x.reshape(1, 4, 16))):
            with pytest.raises(RuntimeError, match="softcap must be at most 1.70141e\\+38 for"):
                call()
        ok = attn_ext.attention(x, x, x, softcap=1.7e38)  # within the bound: no cap in effect
        assert not ok.isnan().any()
        torch.testing.assert_close(ok, attn_ext.attention(x, x, x))
    got = attn_ext.attention(q, q, q, softcap=big)
    torch.testing.assert_close(got, R.attention(q, q, q, softcap=big), rtol=1e-12, atol=1e-12)


def test_numpy_bools_are_bools():
    """numpy's bools (np.True_, e.g. from a config array) are taken wherever a flag is: the ops'
    parser takes them, and the flag checks of this session's first version refused them for
    interleaved (which the op took) as the older ones did for causal."""
    np = pytest.importorskip("numpy")
    x = randn(1, 5, 2, 8, dtype=f64)
    cos, sin = attn_ext.rope_cache(6, 8, dtype=f64)
    yes, no = np.bool_(True), np.bool_(False)
    same = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0)  # noqa: E731
    same(attn_ext.rope(x, cos, sin, interleaved=yes), attn_ext.rope(x, cos, sin, interleaved=True))
    q, k = x.clone(), x.clone()
    attn_ext.rope_qk(q, k, cos, sin, inplace=yes)  # in place: returns the rotated inputs
    same(q, attn_ext.rope(x, cos, sin))
    for flag, py in ((yes, True), (no, False)):
        same(attn_ext.attention(x, x, x, causal=flag), attn_ext.attention(x, x, x, causal=py))
        same(attn_ext.attention_weights(x, x, causal=flag), attn_ext.attention_weights(x, x, causal=py))
    out, lse = attn_ext.attention(x, x, x, return_lse=yes)
    assert lse.shape == (1, 2, 5)
    layer = MultiHeadAttention(16, 2, causal=yes, alibi=no)
    assert layer.causal is True
    torch.jit.script(layer)  # the attributes are Python bools
    assert RotaryEmbedding(8, interleaved=yes).interleaved is True
    assert attn_ext.RelativePositionBias(2, 8, bidirectional=yes).bidirectional is True


def test_positional_encoding_checks_keep_what_the_ops_took():
    """The wrappers' type checks take what the ops' parser took: numpy ints as flags, one-element
    integer tensors as offsets, tensors and Decimals as bases, a symbolic or traced comparison as
    interleaved; their errors stay RuntimeErrors (the parser's) as well; and the size checks add
    no guard under torch.export (a dynamic head dim failed with "D >= 8")."""
    import decimal

    np = pytest.importorskip("numpy")
    x = randn(2, 5, 3, 16)
    cos, sin = attn_ext.rope_cache(16, 8)
    same = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0)  # noqa: E731
    same(attn_ext.rope(x, cos, sin, interleaved=np.int64(1)), attn_ext.rope(x, cos, sin, interleaved=True))
    same(attn_ext.rope(x, cos, sin, offset=torch.tensor([2])), attn_ext.rope(x, cos, sin, offset=2))
    y = x[:, :, 0]
    want = attn_ext.sinusoidal_pe(y, base=100.0)
    same(attn_ext.sinusoidal_pe(y, base=torch.tensor(100.0)), want)
    same(attn_ext.sinusoidal_pe(y, base=decimal.Decimal("100")), want)
    for bad in ({"interleaved": "no"}, {"offset": 1.0}, {"offset": torch.tensor(True)}):
        with pytest.raises(RuntimeError, match="must be"):
            attn_ext.rope(x, cos, sin, **bad)
    with pytest.raises(RuntimeError, match="base must be"):
        attn_ext.sinusoidal_pe(y, base=1j)

    class M(torch.nn.Module):
        def forward(self, x, cos, sin):
            return attn_ext.rope(x, cos, sin, interleaved=x.size(1) > 1)

    want = attn_ext.rope(x, cos, sin, interleaved=True)
    dims = ({1: torch.export.Dim("S"), 3: torch.export.Dim("D")}, None, None)
    for strict in (True, False):
        ep = torch.export.export(M(), (x, cos, sin), dynamic_shapes=dims, strict=strict)
        same(ep.module()(x, cos, sin), want)
        x2 = randn(2, 3, 3, 12)  # another S and D
        same(ep.module()(x2, cos, sin), attn_ext.rope(x2, cos, sin, interleaved=True))
    same(torch.jit.trace(M(), (x, cos, sin))(x, cos, sin), want)  # interleaved: tensor(True)


def test_rope_qk_errors_name_q_and_k():
    """rope_qk out of place runs rope() on q and on k, whose op calls its input x: the wrapper
    checks both by their names first, and holds both paths to one rule (k in q's dtype)."""
    x = randn(2, 5, 4, 8)
    cos, sin = attn_ext.rope_cache(10, 8)
    for inplace in (False, True):
        call = lambda a, b, c=cos: attn_ext.rope_qk(a.clone(), b.clone(), c, c, inplace=inplace)
        with pytest.raises(ValueError, match=r"^k must be float32, float64, float16 or bfloat16"):
            call(x, x.int())
        with pytest.raises(ValueError, match=r"^k must have a contiguous last dim"):
            attn_ext.rope_qk(x.clone(), x.clone().transpose(2, 3), cos, sin, inplace=inplace)
        with pytest.raises(ValueError, match=r"head dim D = k\.size\(-1\) = 2"):
            call(x, x[..., :2])
        with pytest.raises(ValueError, match=r"^q must have 4 dims \(B, S, H, D\) or 3 dims \(B, S, D\), got shape \[4, 8\]"):
            call(x[0, 0], x)
        with pytest.raises(ValueError, match=r"^k must have q's dtype"):
            call(x, x.double())
        with pytest.raises(ValueError, match=r"^cos/sin must be float32 or q's dtype"):
            call(x.bfloat16(), x.bfloat16(), cos.double())


def test_cached_cross_attention_computes_memory_once():
    """Decoding step by step with a cross-attention cache gives the uncached result at every
    step; the memory is projected once and the cache does not grow."""
    torch.manual_seed(1)
    B, Sm, d = 2, 7, 16
    layer = MultiHeadAttention(d, 4, 2, cross_attention=True).double().eval()
    mem = torch.randn(B, Sm, d, dtype=f64)
    xs = [torch.randn(B, 1 + (t == 0), d, dtype=f64) for t in range(5)]  # a 2-token first step
    with torch.no_grad():
        want = [layer(x, mem)[0] for x in xs]
    counter = _CountCalls(layer.kv_proj)
    cache = layer.new_kv_cache(B, Sm)
    with torch.no_grad():
        for t, x in enumerate(xs):
            out = layer(x, mem if t == 0 else None, cache)[0]
            torch.testing.assert_close(out, want[t], rtol=1e-10, atol=1e-10)
            assert cache.length == Sm
    assert counter.n == 1


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_cross_attention_layer_scripts():
    layer = MultiHeadAttention(16, 2, cross_attention=True).double().eval()
    x, mem = torch.randn(1, 3, 16, dtype=f64), torch.randn(1, 5, 16, dtype=f64)
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.script(layer)(x, mem)[0], layer(x, mem)[0])


def test_cached_cross_attention_misuse_is_refused():
    B, Sm, d = 1, 4, 16
    layer = MultiHeadAttention(d, 2, cross_attention=True).eval()
    mem, x = randn(B, Sm, d), randn(B, 1, d)
    cache = layer.new_kv_cache(B, Sm)
    with pytest.raises(ValueError, match="first call must pass memory"):
        layer(x, None, cache)
    layer(x, mem, cache)
    with pytest.raises(ValueError, match=r"already holds the memory's keys/values \(4 positions"):
        layer(x, mem, cache)
    cache.reset()
    layer(x, mem, cache)  # a new memory after reset
    rot = MultiHeadAttention(d, 2, cross_attention=True, rotary=4).eval()
    with pytest.raises(ValueError, match="cross-attention with both rotary and kv_cache"):
        rot(x, mem, rot.new_kv_cache(B, Sm))


@pytest.mark.parametrize("term", ["alibi", "window", "rel_bias", "causal", "rotary"])
def test_cached_cross_attention_refuses_every_position_term(term):
    """Cross-attention keeps the memory in the cache and cannot tell the queries' positions, so
    every term that reads the distance i + (Sk - Sq) - j is refused with a cache: a cached decode
    used to depend on each step's Sq (one row at a time and two at a time differed, and both
    differed from the uncached call: 0.03-0.57 in float64, a review helper)."""
    kw = {"alibi": dict(alibi=True), "window": dict(window=(1, 1)), "causal": dict(causal=True),
          "rel_bias": dict(rel_bias=attn_ext.RelativePositionBias(2, 8, bidirectional=True)),
          "rotary": dict(rotary=4)}[term]
    layer = MultiHeadAttention(16, 2, cross_attention=True, **kw).double().eval()
    x, mem = torch.randn(1, 4, 16, dtype=f64), torch.randn(1, 6, 16, dtype=f64)
    with torch.no_grad():
        layer(x, mem)  # without a cache: the whole decoder sequence at once
        with pytest.raises(ValueError, match=f"cross-attention with both {term} and kv_cache is "
                                             f"not supported.*decoder position of the queries"):
            layer(x[:, :1], mem, layer.new_kv_cache(1, 6))


@pytest.mark.parametrize("kw", [{}, dict(softcap=3.0)], ids=["plain", "softcap"])
def test_cached_cross_attention_without_position_terms_matches_any_chunking(kw):
    layer = MultiHeadAttention(16, 2, cross_attention=True, **kw).double().eval()
    x, mem = torch.randn(2, 5, 16, dtype=f64), torch.randn(2, 6, 16, dtype=f64)
    with torch.no_grad():
        full = layer(x, mem)[0]
        for chunks in ((1, 1, 1, 1, 1), (2, 3), (5,)):
            cache, outs, i = layer.new_kv_cache(2, 6), [], 0
            for n in chunks:
                outs.append(layer(x[:, i:i + n], mem if i == 0 else None, cache)[0])
                i += n
            torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-12, atol=1e-12)


def test_generate_and_caches_name_bad_arguments():
    from attn_ext.models import TinyGPT

    m = TinyGPT(40, d_model=32, num_heads=4, num_layers=2, max_len=16).eval()
    idx = torch.randint(0, 40, (2, 5))
    for bad in (2.0, None, "3", True):
        with pytest.raises(TypeError, match="generate: max_new_tokens must be an int"):
            m.generate(idx, bad)
    for bad_idx in (idx[0], idx[None], idx.tolist()):
        with pytest.raises(ValueError, match=r"generate: idx must be a \(B, S\) tensor"):
            m.generate(bad_idx, 2)
    with pytest.raises(TypeError, match="caches must be a list of attn_ext.KVCache"):
        m(idx, (None, None))
    with pytest.raises(TypeError, match="kv_cache must be an attn_ext.KVCache"):
        MultiHeadAttention(32, 4)(torch.randn(2, 3, 32), kv_cache=(torch.zeros(2, 8, 4, 8),) * 2)
    assert m.generate(idx, 2).shape == (2, 7)  # (an int still works, numpy's too)
    import numpy as np
    assert m.generate(idx, np.int64(1)).shape == (2, 6)


# ---- item 5: keyword-only arguments -------------------------------------------------------


def _qkv(dtype=torch.float32):
    return randn(1, 5, 2, 8, dtype=dtype), randn(1, 6, 2, 8, dtype=dtype), randn(1, 6, 2, 8, dtype=dtype)


@pytest.mark.parametrize("fn,first_kw", [(attn_ext.attention, 3), (attn_ext.causal_attention, 3),
                                         (attn_ext.attention_weights, 2), (attn_ext.explain, 3)])
def test_everything_after_the_tensors_is_keyword_only(fn, first_kw):
    params = list(inspect.signature(fn).parameters.values())
    assert len(params) > first_kw
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params[:first_kw])
    assert all(p.kind == p.KEYWORD_ONLY for p in params[first_kw:]), params


def test_positional_flags_are_refused():
    """flash_attn_func's 4th positional argument is dropout_p, SDPA's is attn_mask: code
    ported from them must fail loudly instead of meaning causal."""
    q, k, v = _qkv()
    with pytest.raises(TypeError):
        attn_ext.attention(q, k, v, True)
    with pytest.raises(TypeError):
        attn_ext.attention(q, k, v, 0.0)  # dropout_p as in flash_attn_func
    with pytest.raises(TypeError):
        attn_ext.causal_attention(q, k, v, 0.3)
    with pytest.raises(TypeError):
        attn_ext.attention_weights(q, k, True)
    # the torch.ops schemas keep their positional arguments (TorchScript users call them)
    a = torch.ops.attn_ext.attention(q, k, v, True, 0.3)
    torch.testing.assert_close(a, attn_ext.attention(q, k, v, causal=True, scale=0.3), rtol=0, atol=0)
    b = torch.ops.attn_ext.causal_attention(q, k, v, 0.3)
    torch.testing.assert_close(b, attn_ext.causal_attention(q, k, v, scale=0.3), rtol=0, atol=0)


# ---- item 6: RotaryEmbedding without host syncs --------------------------------------------


class _RecordTensorCalls(TorchFunctionMode):
    """Records the torch functions / Tensor methods called (by name)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


HOST_READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy"}


@pytest.mark.parametrize("grad", [False, True])
def test_rotary_positions_read_no_tensor_value(grad):
    """RotaryEmbedding with a positions tensor reads no tensor value on the host (on CUDA
    that would be a device synchronisation per call): no .item(), int(), bool(), ..."""
    rot = RotaryEmbedding(8, max_seq_len=64)
    q, k = randn(2, 5, 2, 8), randn(2, 5, 1, 8)
    pos = torch.tensor([[3, 9, 0, 41, 7], [1, 2, 3, 4, 5]])
    ref_q = R.rope(q.double(), *[t.double() for t in rot.tables(64)], pos)
    if grad:
        q.requires_grad_()
        k.requires_grad_()
    with _RecordTensorCalls() as rec:
        q2, k2 = rot(q, k, positions=pos)
        x2 = rot.rotate(k, positions=pos)
    assert not HOST_READS & set(rec.names), sorted(HOST_READS & set(rec.names))
    torch.testing.assert_close(q2.double(), ref_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(x2, k2, rtol=0, atol=0)


def test_rotary_positions_past_the_table():
    """Past the table (max_seq_len or what it grew to): the op's clear range error on CPU;
    tables(n) grows it ahead of time."""
    rot = RotaryEmbedding(8, max_seq_len=16)
    q, k = randn(1, 3, 2, 8), randn(1, 3, 2, 8)
    pos = torch.tensor([0, 5, 40])
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, cos.size\(0\) = 16\), got positions\[2\] = 40"):
        rot(q.clone(), k.clone(), positions=pos)
    rot.tables(41)
    q2, _ = rot(q.clone(), k.clone(), positions=pos)
    cos, sin = R.rope_cache(41, 8)
    torch.testing.assert_close(q2.double(), R.rope(q.double(), cos, sin, pos), rtol=0, atol=1e-5)


# ---- item 6: attention_weights --------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_attention_weights_matches_reference_and_lse(causal):
    q, k, v = randn(2, 7, 4, 8, dtype=f64), randn(2, 5, 2, 8, dtype=f64), randn(2, 5, 2, 8, dtype=f64)
    w = attn_ext.attention_weights(q, k, causal=causal, scale=0.4)
    torch.testing.assert_close(w, R.attention_probs(q, k, causal, 0.4), rtol=1e-12, atol=1e-12)
    _, lse = attn_ext.attention(q, k, v, causal=causal, scale=0.4, return_lse=True)
    w2 = attn_ext.attention_weights(q, k, causal=causal, scale=0.4, lse=lse)
    torch.testing.assert_close(w2, w, rtol=1e-12, atol=1e-12)
    if causal:  # Sq > Sk: the first two rows see no key -> 0, not NaN
        assert torch.all(w[:, :, :2] == 0) and torch.isfinite(w).all()


@pytest.mark.parametrize("causal,window", [(True, (3, 0)), (False, (2, 1)), (False, None)])
def test_attention_weights_with_masks(causal, window):
    """window and key_padding_mask as in attention(): hidden pairs are 0, weights @ v = out,
    and a fully padded batch row gives zero weights."""
    q, k, v = randn(2, 7, 4, 8, dtype=f64), randn(2, 9, 2, 8, dtype=f64), randn(2, 9, 2, 8, dtype=f64)
    kpm = torch.rand(2, 9) > 0.3
    kpm[1] = False
    out, lse = attn_ext.attention(q, k, v, causal=causal, window=window, key_padding_mask=kpm,
                                  return_lse=True)
    for given in (None, lse):
        w = attn_ext.attention_weights(q, k, causal=causal, window=window, key_padding_mask=kpm,
                                       lse=given)
        keep = R.visibility_mask(7, 9, causal, window, kpm)
        assert torch.all(w[~keep.expand_as(w)] == 0) and torch.all(w[1] == 0)
        got = torch.einsum("bhij,bjhd->bihd", w, v.repeat_interleave(2, dim=2))
        torch.testing.assert_close(got, out, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool \(B, Sk\) = \(2, 9\)"):
        attn_ext.attention_weights(q, k, key_padding_mask=kpm[:, :5])


def test_multihead_need_weights_with_padding_and_window():
    m = attn_ext.MultiHeadAttention(16, 4, causal=True, window=(4, 0)).double().eval()
    x = randn(2, 10, 16, dtype=f64)
    kpm = torch.ones(2, 10, dtype=torch.bool)
    kpm[0, :3] = False  # left padding
    y, w = m(x, None, None, True, kpm)
    y2, _ = m(x, None, None, False, kpm)
    torch.testing.assert_close(y, y2, rtol=1e-12, atol=1e-12)
    assert w.shape == (2, 4, 10, 10) and torch.all(w[0, :, :, :3] == 0)
    i, j = torch.arange(10)[:, None], torch.arange(10)[None, :]
    assert torch.all(w[:, :, (j > i) | (j < i - 4)] == 0)


def test_attention_weights_accepts_3d_like_attention():
    q, k, v = randn(2, 6, 8), randn(2, 9, 8), randn(2, 9, 8)
    out, lse = attn_ext.attention(q, k, v, causal=True, return_lse=True)  # 3-D: one head
    w = attn_ext.attention_weights(q, k, causal=True, lse=lse)
    assert w.shape == (2, 6, 9)
    w4 = attn_ext.attention_weights(q.unsqueeze(2), k.unsqueeze(2), causal=True)
    torch.testing.assert_close(w, w4[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close((w @ v).to(out.dtype), out, rtol=1e-4, atol=1e-5)


def test_attention_weights_does_not_hide_nan():
    q, k = randn(1, 4, 2, 8), randn(1, 4, 2, 8)
    q[0, 2, 1, 3] = float("nan")
    w = attn_ext.attention_weights(q, k, causal=True)
    assert torch.isnan(w[0, 1, 2]).all()  # the row the NaN reaches
    mask = torch.ones_like(w, dtype=torch.bool)
    mask[0, 1, 2] = False
    assert torch.isfinite(w[mask]).all()
    k[0, 1, 0, 0] = float("inf")
    w = attn_ext.attention_weights(randn(1, 4, 2, 8), k, causal=True)
    assert not torch.isfinite(w[0, 0, 1:]).all()  # rows that see key 1 of head 0


@pytest.mark.parametrize("make,match", [
    (lambda q, k: (q[0, 0], k), r"q must have 4 dims \(B, Sq, H, D\) or 3 dims \(B, Sq, D\), got shape \[2, 8\]"),
    (lambda q, k: (q, k[0]), r"k must have 4 dims \(B, Sk, Hkv, D\), got shape \[6, 2, 8\]"),
    (lambda q, k: (q[..., 0, :], k), r"with 3-D q \(B, Sq, D\), k must be 3-D"),
    (lambda q, k: (q, k.double()), r"k must have the same dtype as q \(torch.float32\), got torch.float64"),
    (lambda q, k: (q, torch.cat([k, k])), r"k must have batch size B = 1 \(from q\)"),
    (lambda q, k: (q, k[..., :4]), r"k must have head dim D = 8 \(from q\)"),
    (lambda q, k: (q, torch.cat([k, k[:, :, :1]], 2)), r"Hkv = 3 must divide q's number of heads H = 2"),
    (lambda q, k: (q.int(), k.int()), r"q must be float32, float64, float16 or bfloat16, got torch.int32"),
    (lambda q, k: (torch.cat([q, q], -1)[..., ::2], k), r"q must have a contiguous last dim \(stride 1\), got strides \[160, 32, 16, 2\]"),
    (lambda q, k: (q, torch.cat([k, k], -1)[..., ::2]), r"k must have a contiguous last dim \(stride 1\)"),
    (lambda q, k: (randn(1, 8, 5).transpose(1, 2), k[:, :, 0]), r"q must have a contiguous last dim"),
])
def test_attention_weights_input_errors(make, match):
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match=match):
        attn_ext.attention_weights(*make(q, k))


def test_attention_weights_lse_and_scale_errors():
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match=r"lse must have shape \[1, 2, 5\] \(B, H, Sq\), got \[1, 5\]"):
        attn_ext.attention_weights(q, k, lse=torch.zeros(1, 5))
    with pytest.raises(ValueError, match=r"with 3-D q, lse must have 2 dims \(B, Sq\)"):
        attn_ext.attention_weights(q[:, :, 0], k[:, :, 0], lse=torch.zeros(1, 1, 5))
    with pytest.raises(ValueError, match=r"lse must have shape \[1, 5\] \(B, Sq\), got \[1, 4\]"):
        attn_ext.attention_weights(q[:, :, 0], k[:, :, 0], lse=torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"scale must be finite \(a number or None\), got nan"):
        attn_ext.attention_weights(q, k, scale=float("nan"))


def test_cross_attention_layer_without_memory_is_refused():
    """A cross_attention=True layer called without memory used to attend over x (kv_dim ==
    d_model: silently self-attention, not causal) or fail in kv_proj's matmul without naming
    the argument."""
    for kv_dim in (None, 24):
        layer = MultiHeadAttention(32, 4, cross_attention=True, kv_dim=kv_dim)
        with pytest.raises(ValueError, match="cross_attention=True layer needs memory"):
            layer(torch.randn(2, 5, 32))


# ---- a review's bad-input matrix (forty-first session) ----------------------------------------

def test_raw_ops_name_a_tensor_argument_given_none():
    """A required tensor given as None reached the kernels undefined: "Not yet supported
    ScalarType 46" for cu_seqlens, "x must have 4 dims, got shape [0]" for q, AttributeError
    in the in-place ops' kernels."""
    ops = torch.ops.attn_ext
    q, k, v = randn(6, 2, 8), randn(7, 2, 8), randn(7, 2, 8)
    cq, ck = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be a tensor, got None"):
        ops.attention_varlen_forward(q, k, v, None, ck, 6, 7)
    with pytest.raises(RuntimeError, match="cu_seqlens_k must be a tensor, got None"):
        ops.attention_varlen_forward(q, k, v, cq, None, 6, 7)
    x4 = randn(1, 2, 2, 8)
    with pytest.raises(RuntimeError, match="q must be a tensor, got None"):
        ops.attention_forward(None, x4, x4, False)
    with pytest.raises(RuntimeError, match="v must be a tensor, got None"):
        ops.attention_forward(x4, x4, None, False)
    with pytest.raises(TypeError, match="x must be a tensor, got None"):
        ops.rope_(None, randn(4, 4), randn(4, 4))
    with pytest.raises(TypeError, match="x must be a tensor"):
        ops.sinusoidal_pe_(None)


def test_scale_past_float_range_refused_below_float64():
    """scale = 1e39 with float32 inputs became inf in the kernels' float32 q: every output NaN
    (the float64 reference and our float64 path give finite values)."""
    q, k, v = (randn(1, 3, 2, 8) for _ in range(3))
    for bad in (1e39, -1e39):
        with pytest.raises(RuntimeError, match="scale must be at most"):
            attn_ext.attention(q, k, v, scale=bad)
    out = attn_ext.attention(q.double(), k.double(), v.double(), scale=1e39)
    assert torch.isfinite(out).all()
    assert torch.isfinite(attn_ext.attention(q, k, v, scale=1e30)).all()


def test_attention_weights_head_dim_zero_default_scale():
    w = attn_ext.attention_weights(randn(1, 3, 2, 0), randn(1, 4, 2, 0))
    assert w.shape == (1, 2, 3, 4) and torch.isfinite(w).all()
    torch.testing.assert_close(w, torch.full_like(w, 0.25))


def test_kv_cache_refuses_one_buffer_for_keys_and_values():
    buf = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="k and v must be separate buffers"):
        attn_ext.KVCache(buf, buf)
    fused = torch.zeros(2, 4, 1, 2, 8)  # k and v side by side in one allocation: fine
    cache = attn_ext.KVCache(fused[:, :, :, 0], fused[:, :, :, 1])
    a, b = cache.update(torch.ones(2, 1, 1, 8), 2 * torch.ones(2, 1, 1, 8))
    assert a[0, 0, 0, 0] == 1 and b[0, 0, 0, 0] == 2


def test_kv_cache_refuses_keys_and_values_that_overlap_in_memory():
    """Only an identical start was refused: k and v overlapping further on made update() write
    the values over the keys. Interleaved halves of one buffer share no element and pass."""
    buf = torch.zeros(1, 8, 1, 12)
    with pytest.raises(ValueError, match="k and v must not overlap in memory"):
        attn_ext.KVCache(buf[..., :8], buf[..., 4:12])
    rows = torch.zeros(1, 9, 2, 8)
    with pytest.raises(ValueError, match="k and v must not overlap in memory"):
        attn_ext.KVCache(rows[:, :5], rows[:, 4:])  # (slot 4 in both)
    cache = attn_ext.KVCache(rows[:, :4], rows[:, 4:8])  # disjoint slots of one buffer
    kv = torch.zeros(2, 6, 2, 3, 8)  # (B, L, k|v, Hkv, D): k and v rows interleaved
    cache = attn_ext.KVCache(kv[:, :, 0], kv[:, :, 1])
    a, b = cache.update(torch.ones(2, 2, 3, 8), torch.full((2, 2, 3, 8), 2.0))
    assert (a == 1).all() and (b == 2).all()
    half = torch.zeros(1, 4, 2, 16)
    attn_ext.KVCache(half[..., :8], half[..., 8:])  # the two halves of each row


def test_rotary_tables_too_large_for_memory_name_the_offset():
    """(The allocator's "you tried to allocate 8000000000032 bytes" named neither offset nor
    the tables.) The tables are left as they were."""
    rot = RotaryEmbedding(8, max_seq_len=16)
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match=r"positions up to offset \+ S = 1000000000004 "
                                           r"\(offset = 1000000000000\) need cos / sin tables"):
        rot.rotate(x, offset=10 ** 12)
    assert rot.cos.size(0) == 16
    torch.testing.assert_close(rot.rotate(x.clone(), offset=3),
                               attn_ext.rope(x, *rot.tables(16), offset=3))

    def oom(*args):  # (a CUDA allocator's error: its type is what batch-size finders catch)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 TiB")

    rot._build = oom
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        rot.rotate(x, offset=10 ** 12)


def test_kv_cache_overlap_check_of_a_large_fused_buffer_is_cheap():
    """The exact overlap check lists row spans only after merging the dims that nest (a fused
    (B, L, 2, Hkv, D) buffer's halves: one span per (b, slot)); it took 0.75 s and 346 MB per
    layer at (8, 32768, 2, 8, 128) bf16 with a span per (b, slot, head)."""
    from attn_ext.modules import _row_spans

    kv = torch.empty(8, 32768, 2, 8, 128, dtype=torch.bfloat16)
    starts, length = _row_spans(kv[:, :, 0])  # (a span per (b, slot): the heads merged)
    assert starts.numel() == 8 * 32768 and length == 8 * 128 * 2
    attn_ext.KVCache(kv[:, :, 0], kv[:, :, 1])
    with pytest.raises(ValueError, match="must not overlap"):
        attn_ext.KVCache(kv[:, :, 0, :, :96], kv[:, :, 0, :, 64:])


def test_tinygpt_refuses_one_cache_for_two_layers():
    """The same KVCache object for two layers took both layers' keys: wrong logits, no error."""
    from attn_ext.models import TinyGPT

    m = TinyGPT(50, d_model=32, num_heads=4, num_layers=2, max_len=16).eval()
    idx = torch.randint(0, 50, (1, 6))
    c = m.blocks[0].attn.new_kv_cache(1, 32)
    with pytest.raises(ValueError, match=r"caches\[0\] and caches\[1\] are the same object"):
        m(idx, [c, c])
    assert c.length == 0
    shared = [attn_ext.KVCache(c.k, c.v), attn_ext.KVCache(c.k, c.v)]
    with pytest.raises(ValueError, match=r"caches\[0\].k and caches\[1\].k start at the same memory"):
        m(idx, shared)
    m(idx, m.new_caches(1, 16))  # (separate caches pass)


def test_kv_cache_same_buffer_check_skips_meta_fake_and_traced_tensors():
    """The same-buffer check reads data pointers, which meta / fake tensors (0 for both) and
    torch.compile / export do not have: a meta model's cache, a cache built under
    FakeTensorMode, and one built inside a fullgraph-compiled forward are fine."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = MultiHeadAttention(16, 2)
    layer.new_kv_cache(1, 4, device="meta")
    with FakeTensorMode():
        attn_ext.KVCache(torch.empty(1, 4, 2, 8), torch.empty(1, 4, 2, 8))

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = layer

        def forward(self, x):
            cache = self.m.new_kv_cache(x.size(0), 8)
            return self.m(x, None, cache)[0]

    x = randn(1, 3, 16)
    want = Step()(x)
    torch.testing.assert_close(torch.compile(Step(), fullgraph=True, backend="eager")(x), want)


def test_yarn_truncate_none_means_no_truncation():
    base = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    none = attn_ext.rope_inv_freq(16, 1e4, dict(base, truncate=None), 256)
    false = attn_ext.rope_inv_freq(16, 1e4, dict(base, truncate=False), 256)
    true = attn_ext.rope_inv_freq(16, 1e4, dict(base, truncate=True), 256)
    torch.testing.assert_close(none, false, rtol=0, atol=0)
    assert not torch.equal(none[0], true[0])


def test_string_flags_refused():
    with pytest.raises(ValueError, match="norm_first must be a bool"):
        attn_ext.TransformerBlock(16, 2, norm_first="no")
    with pytest.raises(ValueError, match="need_weights must be a bool"):
        MultiHeadAttention(16, 2)(randn(1, 3, 16), need_weights="yes")
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
               "truncate": "no"}
    with pytest.raises(ValueError, match=r"scaling\['truncate'\] must be a bool"):
        attn_ext.rope_cache(64, 8, scaling=scaling)
    scaling["truncate"] = False
    attn_ext.rope_cache(64, 8, scaling=scaling)


def test_t5_bucket_of_the_most_negative_distance():
    """|-2^63| wraps to -2^63: the bucket was -9223372036854775792."""
    d = torch.tensor([-2**63, -2**63 + 1, -200, 2**63 - 1])
    b = attn_ext.t5_bucket(d, True, 32, 128)
    assert b.tolist() == [31, 31, 31, 15]


def test_rotary_embedding_sizes_and_offset_by_type():
    for bad in ("x", 2.5, -5, True):
        with pytest.raises(ValueError, match="max_seq_len must be an int >= 0"):
            RotaryEmbedding(8, max_seq_len=bad)
    rot = RotaryEmbedding(8, max_seq_len=0)
    q, k = randn(1, 3, 2, 8), randn(1, 3, 2, 8)
    with pytest.raises(TypeError, match="offset must be an int, got None"):
        rot(q, k, offset=None)
    with pytest.raises(TypeError, match="offset must be an int"):
        rot.rotate(q, offset=1.0)
    import numpy as np
    a = rot(q.clone(), k.clone(), offset=np.int64(2))
    b = rot(q.clone(), k.clone(), offset=2)
    c = rot(q.clone(), k.clone(), offset=torch.tensor(2))  # (a one-element tensor, as the ops)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(c[0], b[0]) and torch.equal(c[1], b[1])


def _meta_cases():
    """(name, call(device) -> result): inputs the kernels refuse, each a shape or dtype rule
    that only the C++ checked before (the fake kernels run alone on meta tensors)."""
    L = torch.ops.attn_ext

    def qkv(dev, qs=(2, 5, 4, 8), ks=(2, 7, 2, 8), vs=(2, 7, 2, 6), kdt=torch.float32):
        return (torch.randn(qs, device=dev), torch.randn(ks, device=dev, dtype=kdt),
                torch.randn(vs, device=dev))

    def fwd(dev, **kw):
        q, k, v = qkv(dev, **kw)
        return L.attention_forward(q, k, v, False)

    def bwd(dev, cut_dout=False, lse_dt=torch.float32):
        q, k, v = qkv(dev)
        out = torch.randn(2, 5, 4, 6, device=dev)
        dout = out[:, :4] if cut_dout else out
        lse = torch.randn(2, 4, 5, device=dev, dtype=lse_dt)
        return L.attention_backward(dout, q, k, v, out, lse, False)

    def varlen(dev):
        q, k, v = (torch.randn(5, 4, 8, device=dev), torch.randn(7, 2, 8, device=dev),
                   torch.randn(6, 2, 6, device=dev))
        cq = torch.tensor([0, 5], dtype=torch.int32, device=dev)
        ck = torch.tensor([0, 7], dtype=torch.int32, device=dev)
        return L.attention_varlen_forward(q, k, v, cq, ck, 5, 7)

    def kpm(dev):
        q, k, v = qkv(dev)
        return L.attention_forward(q, k, v, False,
                                   key_padding_mask=torch.ones(2, 6, dtype=torch.bool, device=dev))

    def rope(dev, cs=(16, 4), ss=(16, 4), sdt=torch.float32):
        x = torch.randn(2, 5, 4, 8, device=dev)
        return L.rope(x, torch.randn(cs, device=dev), torch.randn(ss, device=dev, dtype=sdt))

    def rope_qk(dev):
        q, k = torch.randn(2, 5, 4, 8, device=dev), torch.randn(2, 4, 4, 8, device=dev)
        return L.rope_qk_(q, k, torch.randn(16, 4, device=dev), torch.randn(16, 4, device=dev))

    def sinus(dev):
        return L.sinusoidal_pe_(torch.randn(2, 3, 4, 8, device=dev))

    def term(dev, **kw):
        q, k, v = qkv(dev)
        kw = {n: t.to(dev) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
        return L.attention_forward(q, k, v, False, **kw)

    def cu(dev, cq=(0, 5), ck=(0, 7), dt=torch.int32):
        q, k, v = (torch.randn(5, 4, 8, device=dev), torch.randn(7, 2, 8, device=dev),
                   torch.randn(7, 2, 6, device=dev))
        return L.attention_varlen_forward(q, k, v, torch.tensor(cq, dtype=dt, device=dev),
                                          torch.tensor(ck, dtype=torch.int32, device=dev), 5, 7)

    def dlse(dev):
        q, k, v = qkv(dev)
        out, lse = torch.randn(2, 5, 4, 6, device=dev), torch.randn(2, 4, 5, device=dev)
        return L.attention_backward(out, q, k, v, out, lse, False, dlse=lse[:, :, :4])

    return [
        ("k batch", lambda d: fwd(d, ks=(3, 7, 2, 8)), "k must have batch size B = 2"),
        ("k head dim", lambda d: fwd(d, ks=(2, 7, 2, 9)), "k must have head dim D = 8"),
        ("v keys", lambda d: fwd(d, vs=(2, 6, 2, 6)), "v must have Sk = 7"),
        ("v heads", lambda d: fwd(d, vs=(2, 7, 1, 6)), "v must have Hkv = 2"),
        ("heads divide", lambda d: fwd(d, ks=(2, 7, 3, 8), vs=(2, 7, 3, 6)),
         "must divide q's number of heads H = 4"),
        ("k dtype", lambda d: fwd(d, kdt=torch.float64), "k must have the same dtype as q"),
        ("key_padding_mask", kpm, "key_padding_mask must have shape"),
        ("dout shape", lambda d: bwd(d, cut_dout=True), "dout must have shape"),
        ("lse dtype", lambda d: bwd(d, lse_dt=torch.float64), "lse must be"),
        ("varlen v rows", varlen, "v must have Tk = 7"),
        ("rope sin shape", lambda d: rope(d, ss=(16, 3)), "cos and sin must have the same shape"),
        ("rope rotary dim", lambda d: rope(d, cs=(16, 5), ss=(16, 5)), "rotary_dim = 2 * cos.size(-1)"),
        ("rope sin dtype", lambda d: rope(d, sdt=torch.float16), "cos and sin must have the same dtype"),
        ("rope_qk_ k rows", rope_qk, "k must have B = 2 and S = 5"),
        ("sinusoidal rank", sinus, "x must have 3 dims (B, S, D) or 2 dims (S, D)"),
        ("alibi shape", lambda d: term(d, alibi_slopes=torch.randn(3)),
         "alibi_slopes must have shape (H,) = (4,)"),
        ("rel_bias shape", lambda d: term(d, rel_bias=torch.randn(4, 4)),
         "rel_bias must have shape (H, 2M + 1)"),
        ("sinks shape", lambda d: term(d, sinks=torch.randn(4, 1)), "sinks must have shape (H,)"),
        ("sinks dtype", lambda d: term(d, sinks=torch.ones(4, dtype=torch.int64)),
         "sinks must be a floating-point table"),
        ("softcap", lambda d: term(d, softcap=-1.0), "softcap must be a finite number > 0"),
        ("dropout_p", lambda d: term(d, dropout_p=1.0), "dropout_p must be in [0, 1)"),
        ("cu_seqlens dtype", lambda d: cu(d, dt=torch.int64), "cu_seqlens_q must be int32"),
        ("cu_seqlens count", lambda d: cu(d, ck=(0, 3, 7)),
         "cu_seqlens_k must have as many sequences as cu_seqlens_q"),
        ("cu_seqlens rank", lambda d: cu(d, cq=5), "cu_seqlens_q must have shape (N + 1,)"),
        ("dlse shape", dlse, "dlse must have lse's shape"),
    ]


@pytest.mark.parametrize("case", _meta_cases(), ids=lambda c: c[0])
def test_fake_kernels_refuse_what_the_kernels_refuse(case):
    """On meta tensors only the fake kernel runs: it refuses what the CPU kernel refuses, with
    the same words (it used to check ranks and devices only and return outputs for the rest)."""
    _, call, words = case
    with pytest.raises(RuntimeError, match=re.escape(words)):
        call("cpu")
    with pytest.raises(RuntimeError, match=re.escape(words)):
        call("meta")


def test_new_kv_cache_sizes_are_checked():
    layer = attn_ext.MultiHeadAttention(32, 4)
    for bad, err, words in ((2.5, TypeError, "batch must be an int"),
                            (True, TypeError, "batch must be an int"),
                            (-1, ValueError, "batch must be >= 0")):
        with pytest.raises(err, match=words):
            layer.new_kv_cache(bad, 4)
    with pytest.raises(TypeError, match="max_len must be an int"):
        layer.new_kv_cache(1, 8.5)
    with pytest.raises(ValueError, match="max_len must be >= 0"):
        layer.new_kv_cache(1, -1)
    cache = layer.new_kv_cache(2, 0)  # (empty sizes are fine)
    assert cache.k.shape == (2, 0, 4, 8)


def test_explain_checks_dout_like_the_backward():
    q = torch.randn(1, 4, 2, 8)
    v = torch.randn(1, 4, 2, 6)
    attn_ext.explain(q, q, v, dout=torch.randn(1, 4, 2, 6))  # the output's shape: fine
    with pytest.raises(ValueError, match=r"dout must have the output's shape \[1, 4, 2, 6\]"):
        attn_ext.explain(q, q, v, dout=torch.randn(1, 4, 2, 8))
    with pytest.raises(ValueError, match="dout must have q's dtype"):
        attn_ext.explain(q, q, v, dout=torch.randn(1, 4, 2, 6, dtype=torch.float64))


def test_offset_out_of_int64_is_named():
    """A Python int past int64 failed in torch's argument parser ("expected int, found int")."""
    x = torch.randn(1, 4, 2, 8)
    cos, sin = attn_ext.rope_cache(16, 8)
    for big in (2**63, -2**63 - 1):
        with pytest.raises(ValueError, match="offset must fit in int64"):
            attn_ext.rope(x, cos, sin, offset=big)
        with pytest.raises(ValueError, match="offset must fit in int64"):
            attn_ext.sinusoidal_pe(x[:, :, 0], offset=big)
    with pytest.raises(RuntimeError, match="offset must be >= 0"):  # (in range: the op's check)
        attn_ext.rope(x, cos, sin, offset=-2**63)
