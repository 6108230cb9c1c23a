"""The wrappers' and modules' calls below the ops' Python Autograd kernels (attn_ext/ops.py,
_call_op / _call_inplace_op). Every op call used to cross from the dispatcher into that Python
kernel and back (~7 us of a ~40 us decode step) even when it only redispatched. The wrappers
now go below it themselves, but only for a plain eager call that records no gradient; the
results, errors and version bumps are those of the usual path, and everything else (gradients,
forward AD, torch.func, torch.compile, torch.export, jit tracing, modes, subclasses) still takes
the usual path."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import attn_ext
from attn_ext import ops as O
from attn_ext.models import TinyGPT


def _spy(monkeypatch, force=None):
    """Record _plain_eager_call's answers (the modules reach it through ops' globals too);
    force=False turns the fast path off (the usual path, for comparison)."""
    seen = []
    real = O._plain_eager_call

    def spy(args):
        r = real(args) if force is None else force
        seen.append(r)
        return r

    monkeypatch.setattr(O, "_plain_eager_call", spy)
    return seen


def _qkv(requires_grad=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 16, generator=g, dtype=dtype)
    k = torch.randn(2, 7, 2, 16, generator=g, dtype=dtype)
    v = torch.randn(2, 7, 2, 16, generator=g, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _out_of_place_calls():
    q, k, v = _qkv()
    cos, sin = attn_ext.rope_cache(16, 16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    x = torch.randn(2, 5, 16)
    return {
        "attention": lambda: attn_ext.attention(q, k, v, causal=True),
        "attention_terms": lambda: attn_ext.attention(
            q, k, v, causal=True, window=(3, 0), softcap=5.0, return_lse=True,
            alibi_slopes=attn_ext.alibi_slopes(4)),
        "causal_attention": lambda: attn_ext.causal_attention(q, k, v),
        "attention_varlen": lambda: attn_ext.attention_varlen(
            q[0], q[0, :, :2], q[0, :, :2], cu, cu, 3, 3, causal=True, return_lse=True),
        "rope": lambda: attn_ext.rope(q, cos, sin, offset=2),
        "sinusoidal_pe": lambda: attn_ext.sinusoidal_pe(x, offset=3),
    }


def _flat(r):
    return list(r) if isinstance(r, (tuple, list)) else [r]


@pytest.mark.parametrize("name", list(_out_of_place_calls()))
@pytest.mark.parametrize("mode", ["no_grad", "no_input_requires_grad"])
def test_plain_calls_go_below_autograd_with_the_usual_results(monkeypatch, name, mode):
    call = _out_of_place_calls()[name]
    ctx = torch.no_grad() if mode == "no_grad" else torch.enable_grad()
    with ctx:
        seen = _spy(monkeypatch)
        fast = _flat(call())
        assert seen and all(seen)
        _spy(monkeypatch, force=False)
        usual = _flat(call())
    for a, b in zip(fast, usual):
        assert torch.equal(a, b) and not a.requires_grad and a.grad_fn is None


@pytest.mark.parametrize("name", list(_out_of_place_calls()))
def test_inference_mode_calls_skip_the_checks_with_the_usual_results(monkeypatch, name):
    """Under torch.inference_mode() no Autograd kernel runs, so _call_op calls the op at once:
    _plain_eager_call is not asked, and the results are the usual path's."""
    call = _out_of_place_calls()[name]
    with torch.inference_mode():
        seen = _spy(monkeypatch)
        fast = _flat(call())
        assert seen == []
    with torch.no_grad():
        _spy(monkeypatch, force=False)
        usual = _flat(call())
    assert len(fast) == len(usual)
    for a, b in zip(fast, usual):
        assert a.is_inference() and torch.equal(a, b)


def test_a_call_that_records_a_gradient_takes_the_usual_path(monkeypatch):
    q, k, v = _qkv(requires_grad=True)
    seen = _spy(monkeypatch)
    out = attn_ext.attention(q, k, v, causal=True)
    assert seen == [False] and out.grad_fn is not None
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    with torch.no_grad():  # the same tensors, no gradient recorded: below autograd
        attn_ext.attention(q, k, v, causal=True)
    assert seen == [False, True]


def test_forward_ad_takes_the_usual_path_and_is_refused(monkeypatch):
    q, k, v = _qkv()
    seen = _spy(monkeypatch)
    with fwAD.dual_level():
        qd = fwAD.make_dual(q, torch.ones_like(q))
        with pytest.raises(RuntimeError, match="forward-mode AD"):
            attn_ext.attention(qd, k, v, causal=True)
    assert seen == [False]


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class _Passthrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode_cls", [_CountOps, _Passthrough])
def test_modes_take_the_usual_path(monkeypatch, mode_cls):
    q, k, v = _qkv()
    seen = _spy(monkeypatch)
    want = attn_ext.attention(q, k, v, causal=True)
    with torch.no_grad(), mode_cls() as m:
        got = attn_ext.attention(q, k, v, causal=True)
    assert seen == [True, False] and torch.equal(got, want)
    if isinstance(m, _CountOps):
        assert any("attn_ext" in n for n in m.names)


def test_transforms_and_tracers_take_the_usual_path(monkeypatch):
    q, k, v = _qkv()
    seen = _spy(monkeypatch)
    with torch.no_grad():
        want = torch.stack([attn_ext.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], causal=True)
                            for i in range(2)])
        n_eager = len(seen)
        got = torch.func.vmap(lambda a, b, c: attn_ext.attention(a, b, c, causal=True))(
            q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
        assert seen[n_eager:] == [False]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

        traced = torch.jit.trace(lambda a, b, c: attn_ext.attention(a, b, c, causal=True),
                                 (q, k, v), check_trace=False)
        assert seen[-1] is False
        assert "attn_ext::attention" in str(traced.graph)
        assert torch.equal(traced(q, k, v), attn_ext.attention(q, k, v, causal=True))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compile_keeps_the_op_in_one_graph():
    q, k, v = _qkv()
    cos, sin = attn_ext.rope_cache(16, 16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v):
        return attn_ext.attention(attn_ext.rope(q, cos, sin), k, v, causal=True)

    with torch.no_grad():
        got = torch.compile(f, backend=backend, fullgraph=True)(q, k, v)
        want = f(q, k, v)
    assert torch.equal(got, want)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("attn_ext.attention" in t for t in targets)
    assert any("attn_ext.rope" in t for t in targets)


def test_fake_tensors_take_the_usual_path(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = _spy(monkeypatch)
    with FakeTensorMode() as mode, torch.no_grad():
        q, k, v = (mode.from_tensor(t) for t in _qkv())
        out = attn_ext.attention(q, k, v, causal=True)
    assert seen == [False] and out.shape == (2, 5, 4, 16)


# ---- in-place ops -------------------------------------------------------------------------


def _inplace_calls(x, k):
    cos, sin = attn_ext.rope_cache(16, 16)
    return {
        "rope_": (lambda: attn_ext.rope_(x, cos, sin, offset=1), [x]),
        "rope_qk_": (lambda: attn_ext.rope_qk(x, k, cos, sin, inplace=True), [x, k]),
        "sinusoidal_pe_": (lambda: attn_ext.sinusoidal_pe_(x[:, :, 0], offset=2), [x]),
    }


@pytest.mark.parametrize("name", ["rope_", "rope_qk_", "sinusoidal_pe_"])
def test_inplace_fast_path_bumps_versions_as_the_usual_path(monkeypatch, name):
    results = []
    for force in (None, False):
        torch.manual_seed(0)
        x, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
        call, written = _inplace_calls(x, k)[name]
        before = [t._version for t in written]
        seen = _spy(monkeypatch, force)
        with torch.no_grad():
            call()
        assert seen == [force is None]
        assert [t._version for t in written] == [b + 1 for b in before]
        results.append([t.clone() for t in written])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_inplace_fast_path_keeps_a_saved_tensor_check(monkeypatch):
    """A tensor another graph saved for backward, then rotated in place under no_grad: the
    backward sees the version bump and refuses, as after any in-place op."""
    seen = _spy(monkeypatch)
    w = torch.randn(2, 5, 4, 16, requires_grad=True)
    x = torch.randn(2, 5, 4, 16)
    y = (w * x).sum()  # saves x
    cos, sin = attn_ext.rope_cache(16, 16)
    with torch.no_grad():
        attn_ext.rope_(x, cos, sin)
    assert seen == [True]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("name", ["rope_", "rope_qk_", "sinusoidal_pe_"])
def test_inplace_fast_path_refuses_inference_tensors(monkeypatch, name):
    with torch.inference_mode():
        x, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
    call, _ = _inplace_calls(x, k)[name]
    seen = _spy(monkeypatch)
    with torch.no_grad(), pytest.raises(RuntimeError, match="is an inference tensor"):
        call()
    assert seen == [True]
    with torch.inference_mode():  # inside it, allowed (and no version counter to bump)
        call()


def test_inplace_op_on_a_tensor_that_requires_grad_is_still_refused(monkeypatch):
    seen = _spy(monkeypatch)
    x = torch.randn(2, 5, 4, 16, requires_grad=True)
    cos, sin = attn_ext.rope_cache(16, 16)
    with pytest.raises(RuntimeError, match="x requires grad"):
        attn_ext.rope_(x.clone(), cos, sin)
    assert seen == [False]


# ---- modules ------------------------------------------------------------------------------


@pytest.mark.parametrize("pos", ["rope", "alibi", "sinusoidal"])
def test_model_decoding_goes_below_autograd_with_the_usual_tokens(monkeypatch, pos):
    torch.manual_seed(0)
    model = TinyGPT(50, d_model=32, num_heads=4, num_layers=2, max_len=64, pos=pos).eval()
    idx = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        seen = _spy(monkeypatch)
        fast = model.generate(idx, 5)
        assert seen and all(seen)
        _spy(monkeypatch, force=False)
        usual = model.generate(idx, 5)
    assert torch.equal(fast, usual)
    # training: the parameters require grad, so every call records and takes the usual path
    model.train()
    seen = _spy(monkeypatch)
    model(idx).sum().backward()
    assert seen and not any(seen)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_scripted_layer_calls_the_op_directly():
    layer = attn_ext.MultiHeadAttention(32, 4, causal=True, rotary=8).eval()
    scripted = torch.jit.script(layer)
    assert "_call_op" not in scripted.code and "_call_inplace_op" not in str(scripted.inlined_graph)
    assert "attn_ext::attention" in str(scripted.inlined_graph)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), layer(x), rtol=0, atol=0)


def test_inplace_call_already_below_inplace_or_view_takes_the_usual_path(monkeypatch):
    """Inside a __torch_dispatch__ handler (or under the guard) ADInplaceOrView is already
    excluded: the usual path neither refuses an inference tensor nor bumps the version there,
    and neither may the fast path (a review helper: it refused and bumped)."""
    cos, sin = attn_ext.rope_cache(16, 16)
    with torch.inference_mode():
        inf = torch.randn(2, 5, 4, 16)
    for force in (None, False):
        seen = _spy(monkeypatch, force)
        x = torch.randn(2, 5, 4, 16)
        with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
            attn_ext.rope_(x, cos, sin)
            attn_ext.rope_(inf, cos, sin)  # accepted: the refusal is the skipped kernel's
        assert x._version == 0, force
