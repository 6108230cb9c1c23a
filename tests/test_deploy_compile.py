"""torch.compile(fullgraph=True) over models that call torch.ops.attn_ext.*: no graph break,
the same values and gradients as eager, and one graph for every sequence length.

The backward-carrying and dynamic-shape cases use the "aot_eager" backend (AOTAutograd +
functionalisation, exactly what inductor receives, minus inductor's C++ code generation,
which costs tens of seconds per graph on a 2-core CI box); one test runs the default
inductor backend end to end."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import attn_ext
from attn_ext.models import TinyGPT
from deploy_utils import JIT_DEPRECATION, rope_attention, tiny_gpt

# Importing inductor imports torch.utils.mkldnn, whose ScriptModules use the deprecated
# @torch.jit.script_method (torch's own code, not ours): that DeprecationWarning is silenced.
pytestmark = pytest.mark.filterwarnings(JIT_DEPRECATION)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_training_step_fullgraph_dynamic_length_matches_eager():
    model = tiny_gpt(seed=11, num_kv_heads=2)
    model.train()  # dropout is 0: train() only selects the differentiable (out-of-place) RoPE
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for S in (9, 14, 23):
        idx = torch.randint(0, 100, (2, S))
        torch._dynamo.mark_dynamic(idx, 1)
        model.zero_grad()
        got = compiled(idx)
        got.square().mean().backward()
        got_grads = _grads(model)
        model.zero_grad()
        want = model(idx)
        want.square().mean().backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for n, g in _grads(model).items():
            torch.testing.assert_close(got_grads[n], g, rtol=1e-5, atol=1e-7, msg=n)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} graphs for 3 lengths"


def test_inference_inplace_rope_fullgraph_dynamic_matches_eager():
    # Under no_grad the modules rotate q/k in place (attn_ext::rope_qk_ on views of the fused
    # QKV projection): the mutation must survive functionalisation.
    gpt, mha = tiny_gpt(seed=12), rope_attention(seed=13)
    for model, make in ((gpt, lambda b, s: torch.randint(0, 100, (b, s))),
                        (mha, lambda b, s: torch.randn(b, s, 32))):
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        with torch.no_grad():
            for b, s in ((2, 7), (3, 12), (2, 30)):  # (sizes 0 and 1 are always specialised)
                x = make(b, s)
                torch._dynamo.mark_dynamic(x, 0)  # batch and sequence symbolic from the start
                torch._dynamo.mark_dynamic(x, 1)
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
        assert counter.frame_count == 1, f"recompiled: {counter.frame_count} graphs for 3 shapes"


def test_inductor_fullgraph_forward_and_backward_match_eager():
    # The default backend: inductor generates C++ around our ops (ExternKernel calls).
    model = rope_attention(seed=14)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 10, 32, requires_grad=True)
    got = compiled(x)
    (gx,) = torch.autograd.grad(got.square().sum(), x)
    g_qkv = model.mha.qkv.weight.grad
    x2 = x.detach().clone().requires_grad_(True)
    want = model(x2)
    (wx,) = torch.autograd.grad(want.square().sum(), x2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, wx, rtol=1e-4, atol=1e-5)
    assert g_qkv is None  # autograd.grad: nothing accumulated


def test_attention_dropout_compiles_fullgraph_and_exports():
    """Training with attention dropout: fullgraph compile (forward and backward) draws the
    seed / offset inside the graph (the ops' SymInt arguments), so each call gets a fresh mask
    and, under the same torch.manual_seed, eager's exact bits with aot_eager (inductor's
    default lowers torch.randint to its own generator; with fallback_random it gives eager's
    bits too: README); torch.export of a train-mode layer with dropout runs too."""
    torch._dynamo.reset()
    q0 = torch.randn(1, 16, 2, 8)

    def f(q):
        return attn_ext.attention(q, q, q, causal=True, dropout_p=0.25)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (compiled, f):
        q = q0.clone().requires_grad_()
        torch.manual_seed(5)
        out = fn(q)
        out.square().sum().backward()
        grads.append((out.detach(), q.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    torch.manual_seed(6)
    assert not torch.equal(compiled(q0), grads[0][0])  # another seed, another mask

    m = attn_ext.MultiHeadAttention(16, 2, dropout=0.2).train()
    x = torch.randn(1, 8, 16, requires_grad=True)
    torch.compile(m, fullgraph=True, backend="aot_eager")(x)[0].sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    ep = torch.export.export(m, (torch.randn(2, 12, 16),))
    y = ep.module()(torch.randn(2, 12, 16))[0]
    assert y.shape == (2, 12, 16) and torch.isfinite(y).all()



@pytest.mark.parametrize("dynamic", [None, True])
def test_softcap_passed_per_call_compiles_fullgraph(dynamic):
    """A softcap that changes between calls becomes a symbolic float (at once with
    dynamic=True, on the second value by default): the wrapper's check of it must trace
    (math.isfinite cannot take one) and every value must give eager's output and gradients."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 8, 2, 8, requires_grad=True) for _ in range(3))

    def layer(q, k, v, cap):
        return attn_ext.attention(q, k, v, causal=True, softcap=cap)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for cap in (30.0, 50.0, 2.5):
        got, want = compiled(q, k, v, cap), layer(q, k, v, cap)
        assert torch.equal(got, want), cap
        g_got = torch.autograd.grad(got.square().sum(), (q, k, v))
        g_want = torch.autograd.grad(want.square().sum(), (q, k, v))
        assert all(torch.equal(a, b) for a, b in zip(g_got, g_want)), cap
    # a bad value is refused with the wrapper's message (fullgraph wraps any exception the
    # traced code raises in dynamo's Unsupported, the message kept)
    with pytest.raises((ValueError, torch._dynamo.exc.Unsupported),
                       match=r"softcap must be a finite number > 0 \(or None\), got -1.0"):
        compiled(q, k, v, -1.0)

@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_left_padded_attention_mask_compiles_fullgraph(pos):
    """TinyGPT's left-padded ``attention_mask`` path compiles without a graph break (its value
    checks run in eager only: left_padding's, and learned positions' range check, which broke
    the graph on a data-dependent .item()) and gives eager's logits; eager still refuses a mask
    that is not left-padded."""
    model = tiny_gpt(seed=5, num_kv_heads=2).eval()
    if pos == "learned":
        torch.manual_seed(5)
        model = TinyGPT(100, d_model=32, num_heads=4, num_layers=2, max_len=64, pos="learned",
                        causal=True, num_kv_heads=2).eval()
    idx = torch.randint(0, 100, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    want = model(idx, attention_mask=mask)
    got = torch.compile(model, backend="aot_eager", fullgraph=True)(idx, attention_mask=mask)
    assert torch.equal(got, want)
    bad = mask.clone()
    bad[0, 4] = 0
    with pytest.raises(ValueError, match="left-padded"):
        model(idx, attention_mask=bad)


def test_left_padded_prefill_with_caches_compiles_fullgraph():
    """generate(attention_mask=)'s prefill, the caches' set_left_padding included, compiles
    without a graph break (its range check read start.min() and broke the graph) and gives
    eager's logits and cache contents; eager still refuses an out-of-range start."""
    model = tiny_gpt(seed=5, num_kv_heads=2).eval()
    idx = torch.randint(0, 100, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        caches_e, caches_c = model.new_caches(2, 16), model.new_caches(2, 16)
        want = model(idx, caches_e, mask)
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(idx, caches_c, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for ce, cc in zip(caches_e, caches_c):
        assert cc.length == ce.length == 10 and torch.equal(cc.start, ce.start)
        torch.testing.assert_close(cc.k[:, :10], ce.k[:, :10], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="start must lie in"):
        model.new_caches(2, 16)[0].set_left_padding(torch.tensor([0, 17]))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_rope_tables_grown_inside_a_compiled_call(fullgraph):
    """A compiled layer whose RoPE tables are rebuilt during the call (a positions tensor of
    more rows than max_seq_len): the inference-mode guard of RotaryEmbedding.tables is not
    traced (dynamo cannot trace torch.is_inference_mode_enabled), and the output equals
    eager's."""
    from attn_ext.modules import RotaryEmbedding

    eager, model = RotaryEmbedding(8, max_seq_len=4), RotaryEmbedding(8, max_seq_len=4)
    x = torch.randn(2, 12, 4, 8)  # 12 rows > max_seq_len = 4: the tables are rebuilt
    pos = torch.arange(12)
    with torch.no_grad():
        want = eager.rotate(x.clone(), positions=pos)
        got = torch.compile(lambda t: model.rotate(t, positions=pos), backend="aot_eager",
                            fullgraph=fullgraph)(x.clone())
    assert model.cos.size(0) >= 12
    assert torch.equal(got, want)


def test_rope_past_the_cache_compiles_once_and_matches_eager_bitwise():
    """TinyGPT(pos="rope") compiled with dynamic=True, fullgraph=True, run at lengths past its
    RoPE cache (max_len 16) up to 80x it: the rows [offset, offset + S) are built in the graph
    (eager grows the cache; the rows are the same float64 ops), so one graph serves every
    length past the cache. Growing the cache in the graph gave the buffer a new static size:
    two recompiles per doubling, then dynamo's recompile limit failed the call at S = 200."""
    import copy

    torch.manual_seed(0)
    model = TinyGPT(100, d_model=32, num_heads=4, num_layers=1, max_len=16, pos="rope").eval()
    eager = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    graphs = []
    with torch.no_grad():
        for S in (8, 12, 20, 40, 96, 200, 700, 1300):
            idx = torch.randint(0, 100, (1, S))
            assert torch.equal(compiled(idx), eager(idx)), S
            graphs.append(counter.frame_count)
    assert model.blocks[0].attn.rotary.cos.size(0) == 16  # the compiled calls left it alone
    assert graphs[-1] == graphs[2] <= 4, f"graphs after each length: {graphs}"


def test_compiled_generate_does_not_recompile_per_call():
    """generate() on a model compiled with fullgraph=True, dynamic=True makes fresh caches per
    call: TinyGPT's per-layer cache check (one object, one memory per layer) is eager-only, or
    dynamo guarded on each KVCache's id and recompiled on every call (fullgraph failed on the
    fifth). Tokens equal eager's."""
    torch.manual_seed(0)
    model = TinyGPT(100, d_model=32, num_heads=4, num_layers=2, max_len=64, pos="rope").eval()
    eager = TinyGPT(100, d_model=32, num_heads=4, num_layers=2, max_len=64, pos="rope").eval()
    eager.load_state_dict(model.state_dict())
    counter = CompileCounterWithBackend("aot_eager")
    model.compile(backend=counter, fullgraph=True, dynamic=True)  # generate calls self(...)
    idx = torch.randint(0, 100, (2, 5))
    want = eager.generate(idx, 4)
    graphs = []
    for _ in range(6):
        assert torch.equal(model.generate(idx, 4), want)
        graphs.append(counter.frame_count)
    assert graphs[0] > 0 and graphs[1:] == graphs[:1] * 5, f"graphs after each call: {graphs}"


def test_attention_weights_with_a_static_table_compiles_with_dynamic_shapes():
    """attention_weights(alibi_slopes=<a module buffer>) under torch.compile(dynamic=True):
    its host-side shape check compared tuple(slopes.shape) with (H,) / (B, H) where H was
    symbolic, which dynamo evaluated as a mismatch: the call raised its own shape error."""

    class Maps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("slopes", attn_ext.alibi_slopes(4))

        def forward(self, q, k):
            return attn_ext.attention_weights(q, k, causal=True, alibi_slopes=self.slopes)

    m = Maps()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager", dynamic=True)
    for B, S in ((2, 5), (3, 9)):
        q, k = torch.randn(B, S, 4, 8), torch.randn(B, S, 2, 8)
        torch.testing.assert_close(compiled(q, k), m(q, k))


def test_varlen_max_seqlen_from_item_and_rope_cache_compile():
    """attention_varlen with max_seqlen read by .item() (the FlashAttention idiom) compiles
    with fullgraph=True (its int64 range check guarded on the unbacked value), and so does
    rope_cache without a device (torch.get_default_device() cannot be traced)."""
    cq = torch.tensor([0, 2, 5], dtype=torch.int32)
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)

    def f(q, k, v, cq):
        m = (cq[1:] - cq[:-1]).max().item()
        return attn_ext.attention_varlen(q, k, v, cq, cq, m, m, causal=True)

    prev = torch._dynamo.config.capture_scalar_outputs
    torch._dynamo.config.capture_scalar_outputs = True
    try:
        torch._dynamo.reset()
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, cq)
    finally:
        torch._dynamo.config.capture_scalar_outputs = prev
    torch.testing.assert_close(got, f(q, k, v, cq))
    x = torch.randn(2, 5, 3, 8)

    def g(x):
        return attn_ext.rope(x, *attn_ext.rope_cache(16, 8))

    torch.testing.assert_close(torch.compile(g, fullgraph=True, backend="aot_eager")(x), g(x))


def test_dropout_on_meta_and_fake_tensors_gives_shapes():
    """dropout_p > 0 on meta tensors, or under an eager FakeTensorMode, raised (the seed draw
    read values: 'Cannot copy out of meta tensor'); it now gives the output's shape, as
    dropout_p = 0 does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        mha = attn_ext.MultiHeadAttention(16, 2, dropout=0.1, causal=True)
        x = torch.randn(1, 4, 16)
    out = mha.train()(x)
    out = out[0] if isinstance(out, tuple) else out
    assert out.device.type == "meta" and out.shape == (1, 4, 16)
    with FakeTensorMode():
        q = torch.randn(1, 4, 2, 8)
        assert attn_ext.attention(q, q, q, dropout_p=0.1).shape == (1, 4, 2, 8)
