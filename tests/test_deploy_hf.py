"""Hugging Face transformers with attn_implementation="attn_ext": same logits and the same
greedy generation as transformers' eager attention, on a tiny random Llama (no downloads)."""

import os
import warnings

import pytest
import torch

import attn_ext

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import attn_ext  # noqa: E402
import attn_ext.integrations.hf as attn_ext_hf  # noqa: E402  (registers "attn_ext")


def _tiny_llama(attn_implementation, seed=0):
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=128,
    )
    torch.manual_seed(seed)  # identical random weights for every implementation
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation=attn_implementation, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def models():
    ours, ref = _tiny_llama("attn_ext"), _tiny_llama("eager")
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    return ours, ref


def test_registered_and_selected(models):
    ours, _ = models
    assert ours.config._attn_implementation == "attn_ext"
    assert transformers.AttentionInterface._global_mapping["attn_ext"] is attn_ext_hf.attention_forward


def test_prompt_logits_match_eager_and_use_our_kernel(models, monkeypatch):
    ours, ref = models
    calls = []
    real = torch.ops.attn_ext.attention

    class Spy:  # counts kernel calls and checks q/k/v arrive as views, GQA not repeated
        def __call__(self, q, k, v, causal, scale):
            calls.append((q.shape, k.shape, causal))
            return real(q, k, v, causal, scale)

    monkeypatch.setattr(torch.ops.attn_ext, "attention", Spy())
    idx = torch.randint(0, 100, (2, 13))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the mask-free path
        got = ours(idx).logits
        want = ref(idx).logits
    assert len(calls) == 2  # one per layer
    for q_shape, k_shape, causal in calls:  # (B, S, H, D); kv heads not repeated (GQA)
        assert tuple(q_shape) == (2, 13, 4, 16) and tuple(k_shape) == (2, 13, 2, 16)
        assert causal
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_cached_greedy_generation_matches_eager(models):
    ours, ref = models
    idx = torch.randint(0, 100, (2, 7))
    kw = dict(max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
    attn_ext_hf._warned_fallback = False
    with torch.no_grad():
        got = ours.generate(idx, **kw)
        assert not attn_ext_hf._warned_fallback  # prefill and every decode step ran on attn_ext
        want = ref.generate(idx, **kw)
        # the logits of the whole generated sequence agree too
        torch.testing.assert_close(ours(got).logits, ref(got).logits, rtol=1e-4, atol=1e-5)
    assert got.shape == (2, 19)
    assert torch.equal(got, want)


def test_padded_batch_runs_on_the_kernel_and_matches_eager(models, monkeypatch):
    ours, ref = models
    idx = torch.randint(0, 100, (3, 9))
    mask = torch.ones_like(idx)
    mask[1, :3] = 0  # left padding
    mask[2, 6:] = 0  # right padding
    seen = []
    real = attn_ext.attention

    def spy(q, k, v, **kw):
        seen.append(kw.get("key_padding_mask"))
        return real(q, k, v, **kw)

    monkeypatch.setattr(attn_ext, "attention", spy)
    attn_ext_hf._warned_fallback = False
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        got = ours(idx, attention_mask=mask).logits
    with torch.no_grad():
        want = ref(idx, attention_mask=mask).logits
    assert len(seen) == 2 and all(torch.equal(m, mask.bool()) for m in seen)
    real_tokens = mask.bool()
    torch.testing.assert_close(got[real_tokens], want[real_tokens], rtol=1e-4, atol=1e-5)


def test_left_padded_batched_greedy_generation_equals_eager(models):
    ours, ref = models
    idx = torch.randint(1, 100, (3, 8))
    mask = torch.ones_like(idx)
    mask[0, :5] = 0
    mask[2, :2] = 0
    idx[mask == 0] = 0
    kw = dict(max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0, attention_mask=mask)
    attn_ext_hf._warned_fallback = False
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ours.generate(idx, **kw)
    with torch.no_grad():
        want = ref.generate(idx, **kw)
    assert got.shape == (3, 18)
    assert torch.equal(got, want)


def test_custom_4d_mask_falls_back_to_sdpa_with_a_warning(models):
    ours, ref = models
    idx = torch.randint(0, 100, (1, 6))
    keep = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    keep[..., 4, 1] = False  # not expressible as padding + causal + window
    # additive float form, which eager and SDPA both read the same way
    keep = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    attn_ext_hf._warned_fallback = False
    with torch.no_grad(), pytest.warns(UserWarning, match="fall back to transformers' SDPA"):
        got = ours(idx, attention_mask=keep).logits
    with torch.no_grad():
        want = ref(idx, attention_mask=keep).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _tiny_mistral(attn_implementation, seed=0):
    cfg = transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=128, sliding_window=5,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation=attn_implementation, dtype=torch.float32
    )
    return model.eval()


def test_mistral_sliding_window_matches_eager(monkeypatch):
    ours, ref = _tiny_mistral("attn_ext"), _tiny_mistral("eager")
    idx = torch.randint(0, 100, (2, 17))  # the window (5) is much shorter than the prompt
    mask = torch.ones_like(idx)
    mask[1, :4] = 0
    windows = []
    real = attn_ext.attention

    def spy(q, k, v, **kw):
        windows.append(kw.get("window"))
        return real(q, k, v, **kw)

    monkeypatch.setattr(attn_ext, "attention", spy)
    attn_ext_hf._warned_fallback = False
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ours(idx).logits
        got_pad = ours(idx, attention_mask=mask).logits
    with torch.no_grad():
        want = ref(idx).logits
        want_pad = ref(idx, attention_mask=mask).logits
    assert windows and all(w == (4, 0) for w in windows)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_pad[mask.bool()], want_pad[mask.bool()], rtol=1e-4, atol=1e-5)


def test_packed_batch_matches_sequences_one_by_one(models, monkeypatch):
    ours, _ = models
    seqs = [torch.randint(0, 100, (n,)) for n in (5, 11, 3)]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collator([{"input_ids": s.tolist()} for s in seqs])
    calls = []
    real = attn_ext.attention_varlen

    def spy(*args, **kw):
        calls.append(args[3])
        return real(*args, **kw)

    monkeypatch.setattr(attn_ext, "attention_varlen", spy)
    kwargs = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ours(batch["input_ids"], position_ids=batch["position_ids"], **kwargs).logits[0]
    assert len(calls) == 2  # one varlen call per layer
    start = 0
    with torch.no_grad():
        for s in seqs:
            alone = ours(s[None]).logits[0]
            torch.testing.assert_close(got[start : start + len(s)], alone, rtol=1e-4, atol=1e-5)
            start += len(s)


def test_inputs_are_passed_as_views_and_gqa_is_native(monkeypatch):
    B, H, Hkv, S, D = 2, 4, 2, 5, 8
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    seen = []
    real = torch.ops.attn_ext.attention

    def spy(qq, kk, vv, causal, scale):
        seen.append((qq, kk, vv))
        return real(qq, kk, vv, causal, scale)

    monkeypatch.setattr(torch.ops.attn_ext, "attention", spy)
    module = torch.nn.Module()
    module.is_causal = True
    out, weights = attn_ext_hf.attention_forward(module, q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (B, S, H, D)
    (qq, kk, vv), = seen
    for ours, theirs in ((qq, q), (kk, k), (vv, v)):  # same memory, (B, S, H, D) strides
        assert ours.data_ptr() == theirs.data_ptr() and ours.shape == theirs.transpose(1, 2).shape
        assert not ours.is_contiguous()
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=0.3, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_dropout_runs_in_the_kernel():
    """Attention dropout (training) runs on the kernel's dropout (issue 15): the same keep bits
    as attn_ext.attention(dropout_p=) drawn from the same generator state."""
    q = torch.randn(1, 4, 3, 16).transpose(1, 2).transpose(1, 2)
    module = torch.nn.Module()
    torch.manual_seed(7)
    out, _ = attn_ext_hf.attention_forward(module, q, q, q, None, dropout=0.1)
    torch.manual_seed(7)
    want = attn_ext.attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2),
                              causal=True, dropout_p=0.1)
    assert torch.equal(out, want)


def test_chunked_prefill_on_a_cache_without_a_mask_matches_eager(models):
    """A second prompt chunk on a DynamicCache, no attention_mask: the chunk's queries see the
    cached keys (bottom-right causal), not only the first q_len keys (a static cache's empty
    prefill, the one case transformers sends no mask with more keys than queries)."""
    ours, ref = models
    idx = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        got, want = [], []
        for model, out in ((ours, got), (ref, want)):
            cache = transformers.DynamicCache(config=model.config)
            model(idx[:, :5], cache=cache, use_cache=True)
            out.append(model(idx[:, 5:], cache=cache, use_cache=True).logits)
            out.append(model(idx[:, -1:], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)


def test_mistral_static_cache_sliding_window_left_padding_generate():
    """A sliding-window model (Mistral) with a static cache and a left-padded batch: once the
    window's static layer is full its keys start past position 0 (kv_offset > 0), and
    generate() feeds the precomputed mask back into the mask builder; greedy tokens equal
    transformers' "sdpa" (they used to differ from the second new token on)."""
    import transformers

    def model(impl):
        cfg = transformers.MistralConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, max_position_embeddings=128, sliding_window=4)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation=impl, dtype=torch.float64).eval()

    ours, ref = model("attn_ext"), model("sdpa")
    torch.manual_seed(0)
    idx = torch.randint(0, 100, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :6] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    assert torch.equal(ours.generate(idx, **kw), ref.generate(idx, **kw))


def _refuse_sdpa(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("attn_ext fell back to transformers' SDPA")
    monkeypatch.setattr(attn_ext_hf, "sdpa_attention_forward", refuse)


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "left_padded"])
def test_static_cache_generation_runs_on_the_kernel(models, monkeypatch, padded):
    """cache_implementation="static": a decode step's mask spans the unfilled slots, so it is
    not a key padding mask over the filled keys; the attention function reads one query
    row's 4-D mask as the kernel's key padding mask (every step used to fall back to SDPA
    when generate() got no attention_mask). Greedy tokens equal eager's."""
    ours, ref = models
    torch.manual_seed(3)
    idx = torch.randint(1, 100, (2, 7))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    if padded:
        mask = torch.ones_like(idx)
        mask[0, :3] = 0
        idx[mask == 0] = 0
        kw["attention_mask"] = mask
    with torch.no_grad():
        want = ref.generate(idx, **kw)
        _refuse_sdpa(monkeypatch)
        got = ours.generate(idx, **kw)
    assert got.shape == (2, 13)
    assert torch.equal(got, want)


def test_a_4d_boolean_padding_mask_runs_on_the_kernel(models, monkeypatch):
    """A 4-D boolean mask that is the causal pattern with key padding (built by hand, as a
    user's collator would) runs on the kernel; one that is not falls back (the custom-mask
    test above)."""
    ours, ref = models
    idx = torch.randint(0, 100, (2, 9))
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, :4] = False
    keep = torch.ones(9, 9, dtype=torch.bool).tril()[None, None] & pad[:, None, None, :]
    _refuse_sdpa(monkeypatch)
    with torch.no_grad():
        got = ours(idx, attention_mask=keep).logits
        want = ref(idx, attention_mask=pad.long()).logits
    torch.testing.assert_close(got[pad], want[pad], rtol=1e-4, atol=1e-5)


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, mask):
        return self.model(input_ids=idx, attention_mask=mask, use_cache=False).logits


def test_export_with_a_padding_mask_runs_on_the_kernel(models):
    """torch.export of a model on attn_implementation="attn_ext" (it used to fail: the mask
    builder read the mask's values); the mask builder decides from the mask function and the
    sizes while tracing, so the exported graph (batch and length dynamic) calls attn_ext's
    kernel, once per layer, and gives eager's logits for any padding and size."""
    ours, ref = models
    idx = torch.randint(0, 100, (3, 9))
    mask = torch.ones_like(idx)
    mask[1, :3] = 0
    mask[2, 6:] = 0
    B, S = torch.export.Dim("B", min=2, max=8), torch.export.Dim("S", min=2, max=64)
    with torch.no_grad():
        ep = torch.export.export(_Logits(ours), (idx, mask),
                                 dynamic_shapes=({0: B, 1: S}, {0: B, 1: S}))
        kernels = [n for n in ep.graph.nodes if n.op == "call_function" and "attn_ext" in str(n.target)]
        assert len(kernels) == 2
        other = torch.ones_like(mask)
        other[0, :5] = 0
        longer = torch.randint(0, 100, (4, 17))
        left = torch.ones_like(longer)
        left[2, :11] = 0
        for x, m in ((idx, mask), (idx, other), (idx, torch.ones_like(mask)), (longer, left)):
            got = ep.module()(x, m)
            want = ref(x, attention_mask=m).logits
            torch.testing.assert_close(got[m.bool()], want[m.bool()], rtol=1e-4, atol=1e-5)


def test_compile_fullgraph_with_a_padding_mask_matches_eager(models):
    ours, ref = models
    idx = torch.randint(0, 100, (3, 9))
    mask = torch.ones_like(idx)
    mask[1, :3] = 0
    mask[2, 6:] = 0
    torch._dynamo.reset()
    compiled = torch.compile(_Logits(ours), fullgraph=True)
    with torch.no_grad():
        got = compiled(idx, mask)
        want = ref(idx, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-5)


def test_chunked_prefill_on_a_static_cache_runs_on_the_kernel(models, monkeypatch):
    """A second prompt chunk on a StaticCache without attention_mask: transformers' 4-D mask
    spans the cache's unfilled slots (keys no query sees); they are cut off, after which the
    chunk's queries align bottom-right on the filled keys and the kernel runs it."""
    ours, ref = models
    idx = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        got, want = [], []
        for model, out in ((ref, want), (ours, got)):
            if model is ours:
                _refuse_sdpa(monkeypatch)
            cache = transformers.StaticCache(config=model.config, max_cache_len=16)
            for chunk in (idx[:, :5], idx[:, 5:8], idx[:, 8:]):
                n = cache.get_seq_length()
                pos = torch.arange(n, n + chunk.shape[1])
                out.append(model(chunk, cache=cache, use_cache=True, cache_position=pos).logits)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_executorch_style_export_with_a_static_cache_runs_on_the_kernel():
    """transformers' own export recipe (convert_and_export_with_cache: one token per call on a
    StaticCache, the ExecuTorch path): each decode step's 4-D mask is one query row, which
    the exported graph hands to attn_ext's kernel as a key padding mask; its greedy tokens
    equal eager generation's."""
    from transformers.integrations.executorch import (
        TorchExportableModuleWithStaticCache, convert_and_export_with_cache)

    model = _tiny_llama("attn_ext")
    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": 32}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # dynamo's note on transformers' collector
        ep = convert_and_export_with_cache(model)
    assert sum("attn_ext" in str(n.target) for n in ep.graph.nodes) == 2  # one per layer
    idx = torch.randint(1, 100, (1, 5))
    got = TorchExportableModuleWithStaticCache.generate(ep, idx, max_new_tokens=6)
    with torch.no_grad():
        want = _tiny_llama("eager").generate(idx, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("cache", [None, "static"])
def test_sliding_window_generation_past_the_window_without_padding(cache):
    """No padding (no mask reaches the builder) and a full sliding-window cache layer
    (kv_offset > 0): the builder used to index the missing mask and crash."""
    ours, ref = _tiny_mistral("attn_ext"), _tiny_mistral("eager")
    idx = torch.randint(1, 100, (2, 3))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    if cache:
        kw["cache_implementation"] = cache
    with torch.no_grad():
        assert torch.equal(ours.generate(idx, **kw), ref.generate(idx, **kw))
