"""torch.func.vmap over the ops: the batching rules of attn_ext/_vmap.py.

The mapped dimension folds into the batch (one kernel call for every sample), except where that
would change an answer (dropout's bits, tables mapped per sample, d rel_bias per sample, packed
sequences), where the rule loops over the samples as torch's fallback did. Each case is checked
against the op called sample by sample (float64), and a dispatch mode below vmap counts the
kernel calls and their batch sizes, so a case that silently fell back to the loop fails.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attn_ext

F64 = torch.float64
V, B, S, H, HKV, D, DV = 3, 2, 5, 4, 2, 8, 6
TOL = 1e-12


class _Calls(TorchDispatchMode):
    """The attn_ext kernel calls below vmap: (op name, size of the first argument's dim 0)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("attn_ext::"):
            self.calls.append((name.split("::")[1], args[0].shape[0]))
        return func(*args, **(kwargs or {}))


def _inputs():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, dtype=F64, generator=g)

    q, k, v = r(V, B, S, H, D), r(V, B, S, HKV, D), r(V, B, S, HKV, DV)
    kpm = torch.rand(V, B, S, generator=g) > 0.3
    kpm[..., 0] = True
    pos = torch.randint(0, 16, (V, B, S), generator=g)
    tables = {"alibi": torch.rand(V, H, dtype=F64, generator=g),
              "alibi_b": torch.rand(V, B, H, dtype=F64, generator=g),
              "rel": r(V, H, 7), "sinks": r(V, H)}
    return q, k, v, kpm, pos, tables


def _cases():
    """(id, fn, args, in_dims, expected kernel calls (name, dim-0 size))."""
    q, k, v, kpm, pos, t = _inputs()
    cos, sin = attn_ext.rope_cache(16, D, dtype=F64)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    A = attn_ext.attention
    fold = [("attention_forward", V * B)]
    loop = [("attention_forward", B)] * V
    return [
        ("plain", lambda q, k, v: A(q, k, v), (q, k, v), (0, 0, 0), fold),
        ("causal, k not mapped", lambda q, k, v: A(q, k, v, causal=True), (q, k[0], v),
         (0, None, 0), fold),
        ("mapped at dim 2", lambda q, k, v: attn_ext.causal_attention(q, k, v),
         (q.movedim(0, 2), k, v), (2, 0, 0), fold),
        ("op attention", lambda q, k, v: torch.ops.attn_ext.attention(q, k, v, True, None),
         (q, k, v), (0, 0, 0), fold),
        ("key_padding_mask", lambda q, k, v, m: A(q, k, v, key_padding_mask=m), (q, k, v, kpm),
         (0, 0, 0, 0), fold),
        ("key_padding_mask not mapped", lambda q, k, v, m: A(q, k, v, key_padding_mask=m),
         (q, k, v, kpm[0]), (0, 0, 0, None), fold),
        ("alibi (H,) mapped", lambda q, k, v, a: A(q, k, v, alibi_slopes=a, causal=True),
         (q, k, v, t["alibi"]), (0, 0, 0, 0), fold),
        ("alibi (H,)", lambda q, k, v, a: A(q, k, v, alibi_slopes=a), (q, k, v, t["alibi"][0]),
         (0, 0, 0, None), fold),
        ("alibi (B, H) mapped", lambda q, k, v, a: A(q, k, v, alibi_slopes=a),
         (q, k, v, t["alibi_b"]), (0, 0, 0, 0), fold),
        ("alibi (B, H)", lambda q, k, v, a: A(q, k, v, alibi_slopes=a),
         (q, k, v, t["alibi_b"][0]), (0, 0, 0, None), fold),
        ("rel_bias", lambda q, k, v, r: A(q, k, v, rel_bias=r, return_lse=True),
         (q, k, v, t["rel"][0]), (0, 0, 0, None), fold),
        ("rel_bias mapped: loop", lambda q, k, v, r: A(q, k, v, rel_bias=r), (q, k, v, t["rel"]),
         (0, 0, 0, 0), loop),
        ("sinks mapped: loop", lambda q, k, v, s: A(q, k, v, sinks=s), (q, k, v, t["sinks"]),
         (0, 0, 0, 0), loop),
        ("sinks, softcap, window", lambda q, k, v, s: A(q, k, v, sinks=s, softcap=5.0, window=(2, 1)),
         (q, k, v, t["sinks"][0]), (0, 0, 0, None), fold),
        ("dropout: loop", lambda q, k, v: torch.ops.attn_ext.attention_forward(
            q, k, v, False, dropout_p=0.3, dropout_seed=7), (q, k, v), (0, 0, 0), loop),
        ("varlen: loop", lambda q, k, v: attn_ext.attention_varlen(q, k, v, cu, cu, 3, 3, causal=True),
         (q[:, 0], k[:, 0], v[:, 0]), (0, 0, 0), [("attention_varlen_forward", S)] * V),
        ("rope", lambda x: attn_ext.rope(x, cos, sin, offset=3), (q,), (0,), [("rope", V * B)]),
        ("rope positions (B, S) mapped", lambda x, p: attn_ext.rope(x, cos, sin, positions=p),
         (q, pos), (0, 0), [("rope", V * B)]),
        ("rope positions (B, S)", lambda x, p: attn_ext.rope(x, cos, sin, positions=p),
         (q, pos[0]), (0, None), [("rope", V * B)]),
        ("rope positions (S,) mapped: loop", lambda x, p: attn_ext.rope(x, cos, sin, positions=p),
         (q, pos[:, 0]), (0, 0), [("rope", B)] * V),
        ("rope cos mapped: loop", lambda x, c: attn_ext.rope(x, c, c),
         (q, cos.expand(V, *cos.shape)), (0, 0), [("rope", B)] * V),
        ("sinusoidal (B, S, D)", lambda x: attn_ext.sinusoidal_pe(x, offset=2), (q[..., 0],),
         (0,), [("sinusoidal_pe", V * B)]),
        ("sinusoidal (S, D)", lambda x: attn_ext.sinusoidal_pe(x), (q[:, 0, :, 0],), (0,),
         [("sinusoidal_pe", V)]),
        ("sinusoidal positions", lambda x, p: attn_ext.sinusoidal_pe(x, positions=p),
         (q[..., 0], pos[0]), (0, None), [("sinusoidal_pe", V * B)]),
    ]


def _per_sample(fn, args, in_dims):
    n = next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)
    outs = [fn(*(a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)))
            for i in range(n)]
    if isinstance(outs[0], tuple):
        return tuple(torch.stack(o) for o in zip(*outs))
    return torch.stack(outs)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_vmap_equals_the_per_sample_calls(case):
    _, fn, args, in_dims, calls = case
    with _Calls() as seen:
        out = torch.func.vmap(fn, in_dims=in_dims)(*args)
    assert seen.calls == calls  # folded into one call, or looped where folding would differ
    ref = _per_sample(fn, args, in_dims)
    for o, r in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        assert o.shape == r.shape
        assert (o - r).abs().max().item() <= TOL


def _loss(q, k, v, r, m):
    return attn_ext.attention(q, k, v, causal=True, rel_bias=r, key_padding_mask=m).square().sum()


@pytest.mark.parametrize("with_rel", [False, True])
def test_per_sample_gradients_fold_the_backward(with_rel):
    """vmap(grad): the backward folds too, unless d rel_bias is asked for (one per sample:
    a folded call would sum it over the samples)."""
    q, k, v, kpm, _, t = _inputs()
    rel = t["rel"][0] if with_rel else None
    argnums = (0, 1, 2, 3) if with_rel else (0, 1, 2)
    with _Calls() as seen:
        grads = torch.func.vmap(torch.func.grad(_loss, argnums=argnums),
                                in_dims=(0, 0, 0, None, 0))(q, k, v, rel, kpm)
    bwd = [c for c in seen.calls if c[0].startswith("attention_backward")]
    assert bwd == ([("attention_backward_rel_bias", B)] * V if with_rel
                   else [("attention_backward_rel_bias", V * B)])
    for i in range(V):
        want = torch.func.grad(_loss, argnums=argnums)(q[i], k[i], v[i], rel, kpm[i])
        for g, w in zip(grads, want):
            assert (g[i] - w).abs().max().item() <= 1e-10


def test_backward_through_a_vmapped_call_and_nested_vmap():
    q, k, v, *_ = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.func.vmap(lambda q, k, v: attn_ext.attention(q, k, v, causal=True))(*leaves).sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.stack([attn_ext.attention(a, b, c, causal=True) for a, b, c in zip(*ref)]).sum().backward()
    for a, b in zip(leaves, ref):
        assert (a.grad - b.grad).abs().max().item() <= 1e-10
    q2 = torch.stack([q, q.flip(0)])  # (2, V, B, S, H, D)
    with _Calls() as seen:
        out = torch.func.vmap(torch.func.vmap(lambda q: attn_ext.causal_attention(q, q, q)))(q2)
    assert seen.calls == [("attention_forward", 2 * V * B)]
    ref = torch.stack([torch.stack([attn_ext.causal_attention(x, x, x) for x in y]) for y in q2])
    assert (out - ref).abs().max().item() <= TOL


def test_vmap_keeps_the_ops_errors():
    """A folded call refuses what the kernel refuses, naming the argument."""
    q, k, v, *_ = _inputs()
    with pytest.raises(RuntimeError, match="k must have head dim D"):
        torch.func.vmap(attn_ext.causal_attention)(q, k[..., :4], v)


def test_alibi_folds_with_one_sample_or_one_sequence():
    """V = 1 or B = 1: the folded slopes were a stride-0 view, which the kernel's table check
    refused (torch's fallback had taken them)."""
    g = torch.Generator().manual_seed(1)
    for V_, B_ in ((1, 2), (3, 1), (1, 1)):
        q = torch.randn(V_, B_, S, H, D, dtype=F64, generator=g)
        for slopes, dims in ((torch.rand(B_, H, dtype=F64, generator=g), (0, None)),
                             (torch.rand(V_, H, dtype=F64, generator=g), (0, 0))):
            fn = lambda q, a: attn_ext.attention(q, q, q, causal=True, alibi_slopes=a)
            out = torch.func.vmap(fn, in_dims=dims)(q, slopes)
            assert (out - _per_sample(fn, (q, slopes), dims)).abs().max().item() <= TOL
            loss = lambda q, a: fn(q, a).square().sum()
            gq = torch.func.vmap(torch.func.grad(loss), in_dims=dims)(q, slopes)
            want = _per_sample(torch.func.grad(loss), (q, slopes), dims)
            assert (gq - want).abs().max().item() <= 1e-10


def test_size_zero_mapped_dimension():
    q, k, v, _, _, t = _inputs()
    out = torch.func.vmap(attn_ext.causal_attention)(q[:0], k[:0], v[:0])  # folded: empty
    assert out.shape == (0, B, S, H, DV)
    with pytest.raises(ValueError, match="vmap over a dimension of size 0"):  # looped: refused
        torch.func.vmap(lambda q, k, v, r: attn_ext.attention(q, k, v, rel_bias=r))(
            q[:0], k[:0], v[:0], t["rel"][:0])


def test_inplace_ops_under_vmap():
    """rope_, rope_qk_ and sinusoidal_pe_ write each sample's rows in place (torch's fallback
    refused in-place ops); an unmapped written tensor beside mapped arguments is refused."""
    q, k, *_ = _inputs()
    cos, sin = attn_ext.rope_cache(16, D, dtype=F64)

    def rope_qk_inplace(q, k):
        attn_ext.rope_qk(q, k, cos, sin, offset=2, inplace=True)
        return q, k

    qq, kk = q.clone(), k.clone()
    out_q, out_k = torch.func.vmap(rope_qk_inplace)(qq, kk)
    def each(fn, t):  # fn on every sample of t
        return torch.stack([fn(s) for s in t])

    assert (qq - each(lambda s: attn_ext.rope(s, cos, sin, offset=2), q)).abs().max().item() == 0
    assert (kk - each(lambda s: attn_ext.rope(s, cos, sin, offset=2), k)).abs().max().item() == 0
    assert (out_q - qq).abs().max().item() == 0
    x = q[..., 0].clone()
    torch.func.vmap(lambda x: attn_ext.sinusoidal_pe_(x, offset=1))(x)
    assert (x - each(lambda s: attn_ext.sinusoidal_pe(s, offset=1), q[..., 0])).abs().max().item() == 0
    xq = q.clone()
    torch.func.vmap(lambda x, c: attn_ext.rope_(x, c, c), in_dims=(0, 0))(xq, cos.expand(V, *cos.shape))
    assert (xq - each(lambda s: attn_ext.rope(s, cos, cos), q)).abs().max().item() == 0
    with pytest.raises(ValueError, match="writes its argument 0 in place, which is not mapped"):
        torch.func.vmap(lambda c: attn_ext.rope_(q[0].clone(), c, c))(cos.expand(V, *cos.shape))


def test_ensemble_of_blocks_with_rotary():
    """Model ensembling (torch.func.stack_module_state + functional_call under vmap) over
    TransformerBlocks with RoPE, in training (out-of-place RoPE) and in inference (in place)."""
    g = torch.Generator().manual_seed(2)
    blocks = []
    for _ in range(V):
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        blocks.append(attn_ext.TransformerBlock(32, 4, rotary=8).double())
    params, buffers = torch.func.stack_module_state(blocks)
    base = attn_ext.TransformerBlock(32, 4, rotary=8).double().to("meta")
    x = torch.randn(B, S, 32, dtype=F64, generator=g)
    for mode in ("train", "eval"):
        for b in blocks:
            getattr(b, mode)()
        getattr(base, mode)()
        run = lambda p, bf: torch.func.functional_call(base, (p, bf), (x,))
        with torch.no_grad() if mode == "eval" else torch.enable_grad():
            out = torch.func.vmap(run)(params, buffers)
            want = torch.stack([b(x) for b in blocks])
        assert (out - want).abs().max().item() <= 1e-12, mode


def test_inplace_vmap_refuses_shared_memory():
    """A per-sample call checks one sample's views: memory that two samples share (an
    expanded x, q and k views that meet across samples) is refused, as the kernels refuse it in
    one call; q / k views of one packed buffer that do not meet are fine."""
    cos, sin = attn_ext.rope_cache(16, D, dtype=F64)
    x = torch.randn(B, S, H, D, dtype=F64)
    with pytest.raises(ValueError, match="whose samples share memory"):
        torch.func.vmap(lambda t: attn_ext.rope_(t, cos, sin))(x.expand(V, *x.shape))
    buf = torch.randn(V + 1, B, S, H, D, dtype=F64)
    with pytest.raises(ValueError, match="and they share memory"):
        torch.func.vmap(lambda q, k: attn_ext.rope_qk(q, k, cos, sin, inplace=True))(buf[:-1], buf[1:])
    packed = torch.randn(V, B, S, 3 * H * D, dtype=F64)
    q = packed[..., : H * D].unflatten(-1, (H, D))
    k = packed[..., H * D: 2 * H * D].unflatten(-1, (H, D))
    q0, k0 = q.clone(), k.clone()
    torch.func.vmap(lambda q, k: attn_ext.rope_qk(q, k, cos, sin, inplace=True))(q, k)
    assert torch.equal(q, torch.stack([attn_ext.rope(s, cos, sin) for s in q0]))
    assert torch.equal(k, torch.stack([attn_ext.rope(s, cos, sin) for s in k0]))


def test_compiled_inference_rope_stays_in_place():
    """RotaryEmbedding goes out of place under a torch.func transform only: a compiled
    no_grad call keeps the one in-place rope_qk_ (dynamo evaluated the interpreter-stack query
    as a transform, which doubled the compiled RoPE's time)."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    rot = attn_ext.RotaryEmbedding(8)
    q, k = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    with torch.no_grad():
        torch.compile(lambda q, k: rot(q, k), backend=backend, fullgraph=True)(q, k)
    assert any("rope_qk_" in t for t in targets), targets
    assert not any(t.endswith("rope.default") for t in targets), targets
