"""attn_ext modules against the textbook MultiHeadAttentionRef (same weights), KV-cache
decoding against full recomputation, attention maps, and no copies on the hot path."""

import copy

import pytest
import torch

import attn_ext
from attn_ext import reference as ref
from attn_ext.models import TinyGPT
from attn_ext.modules import (
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TransformerBlock,
)

f64 = torch.float64


def _copy_weights(ours: MultiHeadAttention, textbook: ref.MultiHeadAttentionRef) -> None:
    """Give the textbook layer the same weights (our fused QKV = its Q, K, V stacked)."""
    with torch.no_grad():
        if ours.qkv is not None:
            w = torch.cat([textbook.w_q.weight, textbook.w_k.weight, textbook.w_v.weight])
            b = torch.cat([textbook.w_q.bias, textbook.w_k.bias, textbook.w_v.bias])
            ours.qkv.weight.copy_(w)
            ours.qkv.bias.copy_(b)
        else:
            ours.q_proj.weight.copy_(textbook.w_q.weight)
            ours.q_proj.bias.copy_(textbook.w_q.bias)
            ours.kv_proj.weight.copy_(torch.cat([textbook.w_k.weight, textbook.w_v.weight]))
            ours.kv_proj.bias.copy_(torch.cat([textbook.w_k.bias, textbook.w_v.bias]))
        ours.out_proj.weight.copy_(textbook.w_o.weight)
        ours.out_proj.bias.copy_(textbook.w_o.bias)


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize(
    "heads, kv_heads, rotary, interleaved, causal",
    [(4, 4, None, False, True), (4, 2, None, False, False), (4, 1, 8, False, True),
     (4, 2, 4, True, True), (2, 2, 8, True, False)],
)
def test_mha_matches_textbook_values_and_grads(device, heads, kv_heads, rotary, interleaved, causal):
    d_model, B, S = 32, 2, 9
    textbook = ref.MultiHeadAttentionRef(d_model, heads, kv_heads, causal=causal).to(device, f64)
    rot = RotaryEmbedding(rotary, interleaved=interleaved) if rotary else None
    ours = MultiHeadAttention(d_model, heads, kv_heads, causal=causal, rotary=rot).to(device, f64)
    _copy_weights(ours, textbook)
    x = torch.randn(B, S, d_model, dtype=f64, device=device, requires_grad=True)
    tables = None
    if rotary:
        cos, sin = ref.rope_cache(S, rotary)
        tables = (cos.to(device), sin.to(device), interleaved)
    y_ref = textbook(x, rope_tables=tables)
    y, w = ours(x)
    assert w is None
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(y)
    (gx_ref,) = torch.autograd.grad(y_ref, x, g, retain_graph=True)
    y_ref.backward(g)
    (gx,) = torch.autograd.grad(y, x, g, retain_graph=True)
    y.backward(g)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-9, atol=1e-9)
    g_ref, g_ours = _grads(textbook), _grads(ours)
    if ours.qkv is not None:
        torch.testing.assert_close(g_ours["qkv.weight"],
                                   torch.cat([g_ref["w_q.weight"], g_ref["w_k.weight"], g_ref["w_v.weight"]]))
    torch.testing.assert_close(g_ours["out_proj.weight"], g_ref["w_o.weight"])


def test_cross_attention_matches_textbook(device):
    d_model, B = 24, 2
    textbook = ref.MultiHeadAttentionRef(d_model, 3, 1, causal=False).to(device, f64)
    ours = MultiHeadAttention(d_model, 3, 1, causal=False, cross_attention=True).to(device, f64)
    _copy_weights(ours, textbook)
    x = torch.randn(B, 5, d_model, dtype=f64, device=device)
    mem = torch.randn(B, 11, d_model, dtype=f64, device=device)
    torch.testing.assert_close(ours(x, mem)[0], textbook(x, memory=mem), rtol=1e-10, atol=1e-10)


def test_need_weights_rows_sum_to_one_and_match_reference(device):
    ours = MultiHeadAttention(32, 4, 2, causal=True).to(device, f64)
    x = torch.randn(2, 7, 32, dtype=f64, device=device)
    y, w = ours(x, need_weights=True)
    assert w.shape == (2, 4, 7, 7)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 7, dtype=f64, device=device))
    assert torch.all(w.triu(1) == 0)  # causal: nothing above the diagonal
    qkv = ours.qkv(x)
    q = qkv[..., :32].view(2, 7, 4, 8)
    k = qkv[..., 32:48].view(2, 7, 2, 8)
    torch.testing.assert_close(w, ref.attention_probs(q, k, causal=True))
    torch.testing.assert_close(y, ours(x)[0])


@pytest.mark.parametrize("pos", ["rope", "learned", "sinusoidal", "none"])
def test_kv_cache_decoding_matches_full_recomputation(pos):
    torch.manual_seed(0)
    model = TinyGPT(50, d_model=32, num_heads=4, num_layers=2, max_len=64, pos=pos,
                    num_kv_heads=2).double().eval()
    prompt = torch.randint(0, 50, (2, 5))
    steps = 32
    with torch.no_grad():
        caches = model.new_caches(2, 5 + steps)
        seq = prompt
        logits = model(prompt, caches)
        for step in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            full = model(torch.cat([seq, nxt], 1))  # recompute everything
            seq = torch.cat([seq, nxt], 1)
            logits = model(nxt, caches)  # one token through the cache
            torch.testing.assert_close(logits[:, -1], full[:, -1], rtol=1e-9, atol=1e-9)
        assert caches[0].length == 5 + steps
    gen = model.generate(prompt, 8)
    assert gen.shape == (2, 13) and torch.equal(gen[:, :5], prompt)
    assert torch.equal(gen, seq[:, :13])


def test_generate_projects_only_the_last_position_to_the_vocabulary():
    """generate reads one row of logits per step (forward's logits_to_keep = 1): the prompt's
    other positions skip the vocabulary projection (it built a (B, S, vocab) tensor for the
    prompt). Its tokens are
    those of the loop over model(...) with caches, left-padded prompts included."""
    model = TinyGPT(50, d_model=32, num_heads=4, num_layers=2, max_len=64, pos="rope",
                    num_kv_heads=2).double().eval()
    idx = torch.randint(0, 50, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    shapes, calls = [], []
    hook = model.head.register_forward_hook(lambda m, a, o: shapes.append(tuple(a[0].shape)))
    # every step is a call of the model: its hooks (and FSDP's, a compiled forward) take part
    # (a first version called the submodules directly and skipped them: a review)
    outer = model.register_forward_hook(lambda m, a, o: calls.append(tuple(o.shape)))
    try:
        with torch.no_grad():
            gen = model.generate(idx, 5, attention_mask=mask)
    finally:
        hook.remove()
        outer.remove()
    assert shapes == [(2, 1, 32)] * 5 and calls == [(2, 1, 50)] * 5
    with torch.no_grad():
        caches = model.new_caches(2, 14)
        seq, logits = [idx], model(idx, caches, mask)
        for _ in range(5):
            seq.append(logits[:, -1:].argmax(-1))
            logits = model(seq[-1], caches)
    assert torch.equal(gen, torch.cat(seq, 1))
    with torch.no_grad():
        full = model(idx)
        torch.testing.assert_close(model(idx, logits_to_keep=3), full[:, -3:], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="logits_to_keep must be >= 0"):
        model(idx, logits_to_keep=-1)


def test_no_copies_of_qkv_or_output_on_the_hot_path():
    from torch.profiler import ProfilerActivity, profile

    layer = MultiHeadAttention(64, 4, 2, rotary=RotaryEmbedding(16)).eval()
    x = torch.randn(2, 33, 64)
    # ops that materialise a copy (views such as transpose/view/slice are free)
    copies = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::_to_copy",
              "aten::repeat_interleave", "aten::_reshape_copy"}

    def seen(fn):
        # op names outside nn.Linear (whose addmm copies the bias into its fresh output)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        names = set()
        for e in prof.events():
            parent, inside_linear = e.cpu_parent, False
            while parent is not None:
                inside_linear |= parent.name in ("aten::linear", "aten::addmm", "aten::matmul")
                parent = parent.cpu_parent
            if not inside_linear:
                names.add(e.name)
        return names

    with torch.no_grad():
        layer(x)  # warm the RoPE cache
        names = seen(lambda: layer(x))
    assert "attn_ext::rope_qk_" in names and "attn_ext::attention" in names
    assert not (names & copies), f"copies on the inference hot path: {names & copies}"
    # training forward: RoPE out of place (differentiable), still no copies of q, k, v or out
    layer.train()
    names = seen(lambda: layer(x.requires_grad_()))
    assert "attn_ext::rope" in names
    assert not (names & copies), f"copies on the training forward: {names & copies}"


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projection_backward_joins_the_parts_once(bias):
    """The fused QKV projection's q / k / v are split views: the backward joins their gradients
    in one cat, where slices made each part a zero-filled tensor of the whole width plus an
    add (5 projection-sized tensors for 1). The same for the weight rows of a fused layer
    attending to memory. The gradients are those of the same layer written with slices."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, 2, bias=bias, causal=True).double()
    w, b = layer.qkv.weight, layer.qkv.bias
    x = torch.randn(2, 9, 32, dtype=f64, requires_grad=True)
    memory = torch.randn(2, 5, 32, dtype=f64, requires_grad=True)
    dout = torch.randn(2, 9, 32, dtype=f64)

    def sliced(x, src):  # the layer's forward, written with slices
        q = torch.nn.functional.linear(x, w[:32], None if b is None else b[:32])
        kv = torch.nn.functional.linear(src, w[32:], None if b is None else b[32:])
        o = attn_ext.attention(q.view(2, 9, 4, 8), kv[..., :16].view(2, -1, 2, 8),
                               kv[..., 16:].view(2, -1, 2, 8), causal=True)
        return layer.out_proj(o.reshape(2, 9, 32))

    for args in ((x,), (x, memory)):
        grads = []
        for run in ("layer", "sliced"):
            layer.zero_grad()
            for t in args:
                t.grad = None
            out = layer(*args)[0] if run == "layer" else sliced(x, args[-1])
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out.backward(dout)
            names = {e.name for e in prof.events()}
            assert ("aten::slice_backward" in names) == (run == "sliced"), (len(args), run)
            grads.append([p.grad.clone() for p in layer.parameters()] +
                         [t.grad.clone() for t in args])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_positional_modules():
    x = torch.randn(2, 6, 16, dtype=f64)
    sin = SinusoidalPositionalEncoding(16)
    torch.testing.assert_close(sin(x, offset=3), ref.sinusoidal_pe(x, offset=3))
    learned = LearnedPositionalEmbedding(8, 16).double()
    torch.testing.assert_close(learned(x), x + learned.embedding.weight[:6])
    with pytest.raises(ValueError, match="cannot extrapolate"):
        learned(x, offset=4)
    rot = RotaryEmbedding(8, max_seq_len=4)
    cos, _ = rot.tables(100)  # grows
    assert cos.shape[0] >= 100
    c_ref, _ = ref.rope_cache(100, 8)
    torch.testing.assert_close(cos[:100].double(), c_ref, rtol=0, atol=1e-7)


@pytest.mark.parametrize("norm_first", [True, False])
def test_transformer_block_trains(norm_first):
    torch.manual_seed(0)
    blk = TransformerBlock(32, 4, rotary=8, norm_first=norm_first)
    x = torch.randn(4, 10, 32)
    target = torch.randn(4, 10, 32)
    opt = torch.optim.Adam(blk.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss = torch.nn.functional.mse_loss(blk(x), target)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first


def test_dropout_training_path_is_the_same_attention_without_dropout_rate():
    layer = MultiHeadAttention(32, 4, dropout=0.5).double()
    x = torch.randn(2, 5, 32, dtype=f64)
    layer.eval()
    y_eval = layer(x)[0]
    layer.train()
    layer.dropout = 1e-12  # the in-kernel dropout path with (almost) no dropout
    torch.testing.assert_close(layer(x)[0], y_eval, rtol=1e-9, atol=1e-9)


def test_from_linears_carries_textbook_weights(device):
    textbook = ref.MultiHeadAttentionRef(48, 6, 2, causal=True).to(device, f64)
    ours = MultiHeadAttention.from_linears(textbook.w_q, textbook.w_k, textbook.w_v, textbook.w_o,
                                           num_heads=6, causal=True)
    assert ours.num_kv_heads == 2 and ours.head_dim == 8
    x = torch.randn(3, 10, 48, dtype=f64, device=device)
    torch.testing.assert_close(ours(x)[0], textbook(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_from_torch_matches_nn_multihead_attention(causal):
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).double().eval()
    ours = MultiHeadAttention.from_torch(mha, causal=causal).eval()
    x = torch.randn(2, 9, 32, dtype=f64)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(9, dtype=f64) if causal else None
    want, _ = mha(x, x, x, attn_mask=mask, need_weights=False, is_causal=causal)
    torch.testing.assert_close(ours(x)[0], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("sq, sk", [(5, 11), (11, 5), (7, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention_with_rope_matches_textbook(sq, sk, causal):
    """RoPE in cross-attention puts query i and key j at the library's distance
    d = i + (Sk - Sq) - j, the one the masks and score terms use, in the module and in the
    textbook layer alike (for Sq > Sk too)."""
    d_model, B = 32, 2
    textbook = ref.MultiHeadAttentionRef(d_model, 4, 2, causal=causal).to(torch.float64)
    ours = MultiHeadAttention(d_model, 4, 2, causal=causal, cross_attention=True,
                              rotary=RotaryEmbedding(8)).to(torch.float64)
    _copy_weights(ours, textbook)
    x = torch.randn(B, sq, d_model, dtype=f64)
    mem = torch.randn(B, sk, d_model, dtype=f64)
    cos, sin = ref.rope_cache(64, 8)
    torch.testing.assert_close(ours(x, mem)[0], textbook(x, memory=mem, rope_tables=(cos, sin, False)),
                               rtol=1e-10, atol=1e-10)


def test_rope_tables_grow_for_a_left_padded_cache():
    """Positions from a left-padded KVCache are below past + Sq: the tables grow to that
    (they used to stay at max_seq_len and the op refused the positions past it)."""
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, rotary=RotaryEmbedding(8, max_seq_len=4)).eval().to(f64)
    c = m.new_kv_cache(1, 12)
    c.set_left_padding(torch.tensor([0]))
    x = torch.randn(1, 9, 32, dtype=f64)
    with torch.no_grad():
        steps = [m(x[:, :3], kv_cache=c)[0], m(x[:, 3:6], kv_cache=c)[0], m(x[:, 6:], kv_cache=c)[0]]
        full = m(x)[0]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
    g = TinyGPT(40, d_model=32, num_heads=4, max_len=8, pos="rope").eval()
    p = torch.randint(0, 40, (2, 5))
    am = torch.ones(2, 5, dtype=torch.long)
    am[0, :2] = 0
    with torch.no_grad():
        out = g.generate(p, 12, attention_mask=am)
        alone = g.generate(p[1:], 12)
    assert out.shape == (2, 17) and torch.equal(out[1:], alone)


@pytest.mark.parametrize("call, match", [
    (lambda: MultiHeadAttention(32, 4, cross_attention=True)(torch.randn(2, 3, 32), torch.randn(3, 4, 32)), "memory"),
    (lambda: MultiHeadAttention(32, 4, cross_attention=True, kv_dim=16)(torch.randn(2, 3, 32), torch.randn(2, 4, 32)), "kv_dim"),
    (lambda: MultiHeadAttention(32, 4)(torch.randn(2, 3, 16)), "d_model"),
    (lambda: SinusoidalPositionalEncoding(16)(torch.randn(2, 5, 8)), "d_model"),
    (lambda: attn_ext.alibi_slopes(2.5), "num_heads"),
    (lambda: TinyGPT(40, d_model=32, num_heads=4, max_len=8).generate(torch.zeros(2, 0, dtype=torch.long), 3), "prompt"),
    # sizes <= 0 (TinyGPT's num_heads = 0 was a ZeroDivisionError; MultiHeadAttention's d_model
    # <= 0 blamed qk_dim; TransformerBlock's d_ff = 0 became 4 * d_model silently)
    (lambda: TinyGPT(10, d_model=32, num_heads=0), "num_heads must be a positive int, got 0"),
    (lambda: TinyGPT(10, d_model=32, num_heads=4, num_layers=0), "num_layers must be a positive int"),
    (lambda: TinyGPT(0, d_model=32, num_heads=4), "vocab_size must be a positive int"),
    (lambda: TinyGPT(10, d_model=32, num_heads=4, max_len=-1), "max_len must be a positive int"),
    (lambda: MultiHeadAttention(-8, 4), "d_model must be a positive int, got -8"),
    (lambda: MultiHeadAttention(0, 4, qk_dim=8), "d_model must be a positive int, got 0"),
    (lambda: MultiHeadAttention(32, 0), "num_heads must be a positive int, got 0"),
    (lambda: MultiHeadAttention(32, 4, 0), "num_kv_heads must divide num_heads"),
    (lambda: TransformerBlock(32, 4, d_ff=0), "d_ff must be a positive int"),
    (lambda: TinyGPT(10, d_model=32, num_heads=4, pos="relative", rel_max_distance=0),
     "rel_max_distance must be a positive int"),
    (lambda: TransformerBlock(32, 4, d_ff=-1), "d_ff must be a positive int"),
    # a dropout the kernels refuse (past 1 - 2^-16) was accepted, then every training forward
    # failed blaming dropout_p; a bad context_parallel_layout passed without a group
    (lambda: MultiHeadAttention(32, 4, dropout=0.99999), "dropout must be in \\[0, 1\\)"),
    (lambda: TransformerBlock(32, 4, dropout=1 - 2**-17), "dropout must be in \\[0, 1\\)"),
    (lambda: TinyGPT(10, d_model=32, num_heads=4, context_parallel_layout="bogus"),
     "context_parallel_layout must be one of"),
    # the public T5 bucket function checked nothing (ZeroDivisionError for num_buckets 0 / 1,
    # float buckets for float distances); alibi_slopes gave integer zeros for an int dtype
    (lambda: attn_ext.t5_bucket(torch.arange(-5, 5), True, 0, 128), "num_buckets must be >= 2"),
    (lambda: attn_ext.t5_bucket(torch.arange(-5, 5), True, 2, 128), "num_buckets must be >= 2"),
    (lambda: attn_ext.t5_bucket(torch.arange(-5.0, 5), True, 32, 128), "distance must be an integer tensor"),
    (lambda: attn_ext.t5_bucket(torch.arange(-5, 5), True, 32, 128.0), "max_distance must be an int"),
    (lambda: attn_ext.alibi_slopes(4, dtype=torch.int32), "dtype must be a floating-point dtype"),
    # KVCache(k, v) took mismatched tensors; the first update then blamed v_new
    (lambda: attn_ext.KVCache(torch.zeros(2, 4, 2, 8), torch.zeros(3, 4, 2, 8)), "v must have k's B"),
    (lambda: attn_ext.KVCache(torch.zeros(2, 4, 2, 8), torch.zeros(2, 5, 2, 8)), "v must have k's B"),
    (lambda: attn_ext.KVCache(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)), "k and v must have 4 dims"),
    (lambda: attn_ext.KVCache(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8, dtype=torch.float64)),
     "one dtype and device"),
])
def test_module_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_alibi_layer_in_float64_is_exact():
    """The layer's ALiBi slopes are kept in float64, so a .double() layer matches the float64
    reference to rounding (a float32 buffer up-cast was 1e-8 off)."""
    torch.manual_seed(0)
    ours = MultiHeadAttention(48, 12, alibi=True).double()
    x = torch.randn(2, 40, 48, dtype=f64)
    qkv = ours.qkv(x)
    q, k, v = qkv.split(48, dim=-1)
    q, k, v = (t.view(2, 40, 12, 4) for t in (q, k, v))
    want = ref.attention(q, k, v, causal=True, alibi_slopes=attn_ext.alibi_slopes(12, f64))
    want = ours.out_proj(want.reshape(2, 40, 48))
    torch.testing.assert_close(ours(x)[0], want, rtol=1e-12, atol=1e-12)
    y = MultiHeadAttention(48, 12, alibi=True)(x.float())[0]  # float32 layers unchanged
    assert y.dtype == torch.float32


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotary", [None, 8])
def test_fused_layer_attends_to_memory_like_the_textbook(causal, rotary):
    """Issue 6's cross-attention form forward(x, memory) on a fused (from_linears) layer: q
    from x, k / v from memory through the row blocks of its QKV weight, equal to
    MultiHeadAttentionRef with the same weights (it used to raise "memory is only for
    cross_attention=True layers")."""
    textbook = ref.MultiHeadAttentionRef(32, 4, 2, causal=causal).to(f64)
    ours = MultiHeadAttention.from_linears(textbook.w_q, textbook.w_k, textbook.w_v, textbook.w_o,
                                           4, num_kv_heads=2, causal=causal,
                                           rotary=RotaryEmbedding(rotary) if rotary else None).to(f64)
    tables = (*ref.rope_cache(64, rotary), False) if rotary else None
    x = torch.randn(2, 5, 32, dtype=f64, requires_grad=True)
    mem = torch.randn(2, 9, 32, dtype=f64, requires_grad=True)
    got, want = ours(x, mem)[0], textbook(x, memory=mem, rope_tables=tables)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, (x, mem), g),
                               torch.autograd.grad(want, (x, mem), g), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.jit.script(ours)(x, mem)[0], got, rtol=0, atol=0)
    with pytest.raises(ValueError, match="kv_cache with memory needs a cross_attention=True"):
        ours(x, mem, ours.new_kv_cache(2, 9))
    with pytest.raises(ValueError, match="memory must have shape"):
        ours(x, mem[:1])


@pytest.mark.parametrize("form", ["from_linears", "cross_attention"])
def test_cross_attention_defaults_match_the_textbook(form):
    """Both layers at their defaults: causal self-attention, and cross-attention that sees the
    whole memory (issue 18: not causal unless asked), in the fused layer, the
    cross_attention=True layer and MultiHeadAttentionRef alike; values and gradients."""
    torch.manual_seed(0)
    textbook = ref.MultiHeadAttentionRef(32, 4, 2).to(f64)
    if form == "from_linears":
        ours = MultiHeadAttention.from_linears(textbook.w_q, textbook.w_k, textbook.w_v,
                                               textbook.w_o, 4).to(f64)
    else:
        ours = MultiHeadAttention(32, 4, 2, cross_attention=True).to(f64)
        _copy_weights(ours, textbook)
        assert not ours.causal
    x = torch.randn(2, 5, 32, dtype=f64, requires_grad=True)
    mem = torch.randn(2, 9, 32, dtype=f64, requires_grad=True)
    got, want = ours(x, mem)[0], textbook(x, memory=mem)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, (x, mem), g),
                               torch.autograd.grad(want, (x, mem), g), rtol=1e-10, atol=1e-10)
    # not causal over the memory: query 0 sees the last memory row
    assert torch.autograd.grad(textbook(x, memory=mem)[:, 0].sum(), mem)[0][:, -1].abs().max() > 0
    if form == "from_linears":  # and causal in self-attention, also at the defaults
        torch.testing.assert_close(ours(x)[0], textbook(x), rtol=1e-10, atol=1e-10)
        assert torch.autograd.grad(textbook(x)[:, 0].sum(), x)[0][:, 1:].abs().max() == 0


def test_forward_takes_issue_6s_positional_order():
    """forward(x, kv_cache=None, need_weights=False) positionally (issue 6) as well as
    forward(x, memory) (eager; TorchScript checks the argument types)."""
    layer = MultiHeadAttention(32, 4, 2).to(f64).eval()
    x = torch.randn(2, 6, 32, dtype=f64)
    a, b = layer.new_kv_cache(2, 8), layer.new_kv_cache(2, 8)
    y1, _ = layer(x[:, :4], a)
    y2, _ = layer(x[:, :4], kv_cache=b)
    assert torch.equal(y1, y2) and a.length == b.length == 4
    out, w = layer(x, None, True)
    assert w is not None and w.shape == (2, 4, 6, 6)
    c = layer.new_kv_cache(2, 8)
    out, w = layer(x, c, True)
    assert w is not None and c.length == 6
    torch.testing.assert_close(out, layer(x)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="kv_cache given twice"):
        layer(x, a, layer.new_kv_cache(2, 8))


@pytest.mark.parametrize("cache_dtype", [None, torch.bfloat16])
def test_kv_cache_under_bf16_autocast(cache_dtype):
    """Under CPU bfloat16 autocast the layer's Linear gives bfloat16 q, k, v: a cache in the
    weights' float32 (the default) or in bfloat16 both decode, equal to the uncached layer
    within bfloat16 rounding (they used to refuse "k must have the same dtype as q")."""
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, 2, rotary=RotaryEmbedding(8)).eval()
    x = torch.randn(2, 7, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = m(x)[0]
        cache = m.new_kv_cache(2, 8, dtype=cache_dtype)
        steps = [m(x[:, :4], kv_cache=cache)[0]] + [m(x[:, i:i + 1], kv_cache=cache)[0]
                                                     for i in range(4, 7)]
    assert cache.k.dtype == (cache_dtype or torch.float32)
    got = torch.cat(steps, 1)
    assert got.dtype == full.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), full.float(), rtol=0, atol=3e-2)


def test_tinygpt_generate_under_bf16_autocast():
    """generate under autocast makes its caches in the autocast dtype, and its cached logits
    equal the uncached forward's within bfloat16 rounding."""
    torch.manual_seed(0)
    g = TinyGPT(40, d_model=32, num_heads=4, num_layers=2, max_len=32, pos="rope").eval()
    idx = torch.randint(0, 40, (2, 9))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = g.generate(idx, 4)
        caches = g.new_caches(2, out.size(1), torch.bfloat16)
        cached = torch.cat([g(out[:, :9], caches)] + [g(out[:, i:i + 1], caches)
                                                     for i in range(9, out.size(1))], 1)
        full = g(out)
    assert out.shape == (2, 13) and caches[0].k.dtype == torch.bfloat16
    torch.testing.assert_close(cached.float(), full.float(), rtol=0, atol=5e-2)


def test_float64_tinygpt_generate_under_autocast_keeps_float64_caches(monkeypatch):
    """Autocast leaves a float64 model in float64, so generate keeps float64 caches (a bf16
    cache would round every cached key and value) and decodes as without autocast."""
    torch.manual_seed(0)
    g = TinyGPT(40, d_model=32, num_heads=4, num_layers=2, max_len=32, pos="rope").double().eval()
    idx = torch.randint(0, 40, (2, 9))
    made = []
    new_caches = g.new_caches
    monkeypatch.setattr(g, "new_caches", lambda *a: made.append(new_caches(*a)) or made[-1])
    with torch.no_grad():
        plain = g.generate(idx, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = g.generate(idx, 4)
    assert [c[0].k.dtype for c in made] == [torch.float64, torch.float64]
    assert torch.equal(plain, auto)


def test_rope_tables_grown_in_inference_mode_still_train():
    """Tables rebuilt under torch.inference_mode (a dtype change, or a longer sequence) are
    normal tensors: a later forward that records a gradient can save them for backward."""
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, rotary=RotaryEmbedding(8, max_seq_len=4)).double()
    with torch.inference_mode():
        m(torch.randn(1, 12, 32, dtype=f64))  # rebuilt in float64 and grown past 4 rows
    assert not m.rotary.cos.is_inference() and m.rotary.cos.size(0) >= 12
    x = torch.randn(1, 12, 32, dtype=f64, requires_grad=True)
    m(x)[0].sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("pos", ["rope", "alibi", "relative"])
def test_meta_device_init_then_reset_buffers(pos):
    """FSDP2-style initialisation: built under torch.device("meta"), materialised with
    to_empty(), weights loaded. The derived buffers (rotary tables, ALiBi slopes, the relative
    bias's index) are not in the state dict, so they held uninitialised memory (ALiBi off by
    0.07, RoPE NaN, the relative index out of bounds); RotaryEmbedding could not even be built
    under meta. attn_ext.reset_buffers recomputes them."""
    from attn_ext.models import TinyGPT

    torch.manual_seed(0)
    ref = TinyGPT(50, d_model=32, num_heads=4, num_layers=1, max_len=16, pos=pos).eval()
    with torch.device("meta"):
        m = TinyGPT(50, d_model=32, num_heads=4, num_layers=1, max_len=16, pos=pos)
    m.to_empty(device="cpu")
    assert attn_ext.reset_buffers(m) is m
    m.load_state_dict(ref.state_dict())
    m.eval()
    for a, b in zip(m.buffers(), ref.buffers()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    idx = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        assert torch.equal(m(idx), ref(idx))


@pytest.mark.parametrize("pos", ["alibi", "relative"])  # (rotary tables have no weight to follow)
def test_meta_device_init_with_assign_then_reset_buffers(pos):
    """Meta-device init, then load_state_dict(assign=True): the parameters arrive on the CPU,
    the derived buffers stay on meta. The relative bias's index used to index the CPU weight
    from meta (uninitialised memory, logits 1.3 off, no error), and reset_buffers rebuilt it on
    meta again: now forward refuses the mix by name, and reset_buffers rebuilds on the
    weight's device."""
    from attn_ext.models import TinyGPT

    torch.manual_seed(0)
    ref = TinyGPT(50, d_model=32, num_heads=4, num_layers=1, max_len=16, pos=pos).eval()
    with torch.device("meta"):
        m = TinyGPT(50, d_model=32, num_heads=4, num_layers=1, max_len=16, pos=pos)
    m.load_state_dict(ref.state_dict(), assign=True)
    m.eval()
    idx = torch.randint(0, 50, (2, 12))
    if pos == "relative":
        with pytest.raises(RuntimeError, match="reset_buffers"):
            m(idx)
    attn_ext.reset_buffers(m)
    with torch.no_grad():
        assert torch.equal(m(idx), ref(idx))


@pytest.mark.parametrize("pos", ["rope", "alibi"])
def test_low_precision_round_trip_recomputes_derived_buffers(pos):
    """.bfloat16().float() (or .half().float()) used to leave the rotary tables and the ALiBi
    slopes with the low precision's rounding (logits 1e-3 / 1e-4 off with the same fp32
    weights); a dtype change now recomputes them."""
    from attn_ext.models import TinyGPT

    torch.manual_seed(0)
    ref = TinyGPT(50, d_model=48, num_heads=12, num_layers=1, max_len=16, pos=pos).eval()
    idx = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        ref(idx)  # (the tables exist at their fp32 size)
        for there in (lambda m: m.bfloat16(), lambda m: m.half(), lambda m: m.double()):
            m = copy.deepcopy(ref)
            there(m).float()
            m.load_state_dict(ref.state_dict())
            for a, b in zip(m.buffers(), ref.buffers()):  # (.float() makes float64 slopes fp32)
                assert torch.equal(a, b.to(a.dtype))
            assert torch.equal(m(idx), ref(idx))
    rot = RotaryEmbedding(8, max_seq_len=32).double()
    want, _ = attn_ext.rope_cache(32, 8, dtype=torch.float64)
    assert torch.equal(rot.cos, want)  # built in float64, not float32 widened


def test_yarn_rotary_builds_under_meta():
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    with torch.device("meta"):
        rot = RotaryEmbedding(8, scaling=scaling, max_seq_len=32)
        cos, _ = attn_ext.rope_cache(32, 8, scaling=scaling)
    assert cos.is_meta  # (rope_cache follows the default device)
    rot.to_empty(device="cpu")
    rot.reset_buffers()
    assert torch.equal(rot.cos, attn_ext.rope_cache(32, 8, scaling=scaling)[0])


def test_tinygpt_attention_mask_must_match_idx():
    """A mask longer or shorter than the prompt used to be read as the prompt's with caches
    (wrong tokens, no error)."""
    from attn_ext.models import TinyGPT

    m = TinyGPT(50, d_model=32, num_heads=4, num_layers=1, max_len=32, pos="rope").eval()
    idx = torch.randint(0, 50, (2, 6))
    for bad in (torch.ones(2, 9, dtype=torch.long), torch.ones(2, 2, dtype=torch.long),
                torch.ones(3, 6, dtype=torch.long), torch.ones(6, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"attention_mask must have idx's shape \(B, S\) = \[2, 6\]"):
            m(idx, m.new_caches(2, 32), bad)
        with pytest.raises(ValueError, match="attention_mask must have idx's shape"):
            m.generate(idx, 3, attention_mask=bad)


def test_tinygpt_argument_errors_name_the_argument():
    """(They failed as "rotary_dim must be even, got 7", "KVCache is full" and an IndexError.)"""
    with pytest.raises(ValueError, match="d_model must be divisible by num_heads"):
        TinyGPT(50, d_model=30, num_heads=4, pos="rope")
    m = TinyGPT(50, d_model=32, num_heads=4, num_layers=2, max_len=16).eval()
    idx = torch.randint(0, 50, (1, 4))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -2"):
        m.generate(idx, -2)
    assert torch.equal(m.generate(idx, 0), idx)
    learned = TinyGPT(50, d_model=32, num_heads=4, num_layers=1, max_len=8, pos="learned").eval()
    assert learned.generate(idx, 5).shape == (1, 9)  # (positions 0..7: the last token not fed)
    with pytest.raises(ValueError, match="takes at most 5 new tokens, got max_new_tokens = 6"):
        learned.generate(idx, 6)
    with pytest.raises(ValueError, match=r"caches must hold one KVCache per layer \(2\), got 1"):
        m(idx, m.new_caches(1, 16)[:1])
