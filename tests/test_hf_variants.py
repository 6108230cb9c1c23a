"""Hugging Face models whose attention has score terms (issue 15): Gemma 2 (softcap +
alternating sliding window) and GPT-OSS (attention sinks + sliding window) through
attn_implementation="attn_ext" give the logits of transformers' "eager" attention, on the
kernel (no SDPA fallback). Tiny random models, no downloads."""

import copy
import importlib
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import attn_ext.integrations.hf as attn_ext_hf  # noqa: E402  (registers "attn_ext")


def _no_fallback(monkeypatch, eager_too=False):
    """Refuse transformers' SDPA; with eager_too also the hook's own textbook fallback (where a
    layer with softcap or sinks goes: only then is "on the kernel" checked)."""
    def refuse(*args, **kwargs):
        raise AssertionError("attn_ext fell back to transformers' SDPA")
    monkeypatch.setattr(attn_ext_hf, "sdpa_attention_forward", refuse)
    if eager_too:
        def refuse_eager(*args, **kwargs):
            raise AssertionError("attn_ext fell back to the eager formula")
        monkeypatch.setattr(attn_ext_hf, "_eager", refuse_eager)


def _build(cfg, impl, seed=0):
    # a copy: from_config writes attn_implementation into the config it gets, so a second
    # build from the same object used to switch the first model to that implementation too
    # (both "ours" and the reference then ran eager)
    cfg = copy.deepcopy(cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl,
                                                          dtype=torch.float32)
    return model.eval()


def _gemma2_cfg():
    return transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=128,
        sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
    )


def _gpt_oss_cfg():
    return transformers.GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=128,
        num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
    )


@pytest.mark.parametrize("make_cfg", [_gemma2_cfg, _gpt_oss_cfg], ids=["gemma2", "gpt_oss"])
def test_logits_match_eager_on_the_kernel(make_cfg, monkeypatch):
    cfg = make_cfg()
    assert "sliding_attention" in cfg.layer_types  # the window is smaller than the prompt
    ours, ref = _build(cfg, "attn_ext"), _build(cfg, "eager")
    assert ours.config._attn_implementation == "attn_ext"  # each model kept its own
    assert ref.config._attn_implementation == "eager"
    if isinstance(cfg, transformers.GptOssConfig):
        with torch.no_grad():  # random, clearly non-zero sinks
            for layer in ours.model.layers:
                layer.self_attn.sinks.normal_(0, 2, generator=torch.Generator().manual_seed(1))
            for layer_o, layer_r in zip(ours.model.layers, ref.model.layers):
                layer_r.self_attn.sinks.copy_(layer_o.self_attn.sinks)
    idx = torch.randint(0, 100, (2, 13))
    _no_fallback(monkeypatch, eager_too=True)
    with torch.no_grad():
        got = ours(idx).logits
        want = ref(idx).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _t5_cfg():
    return transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
        dropout_rate=0.0,
    )


def test_t5_relative_bias_on_the_kernel(monkeypatch):
    """T5 hands the hook its dense (1, H, Sq, Sk) position_bias; the hook passes its diagonals
    to the kernel as rel_bias (no fallback, no eager formula): logits and the gradient of the
    bucket embedding equal "eager"'s. (A padded batch: the next tests.)"""
    cfg = _t5_cfg()

    def build(impl):
        torch.manual_seed(0)
        return transformers.T5ForConditionalGeneration._from_config(cfg, attn_implementation=impl)

    ours, ref = build("attn_ext"), build("eager")
    _no_fallback(monkeypatch)

    def refuse(*args, **kwargs):
        raise AssertionError("attn_ext used the eager formula for T5's position_bias")
    monkeypatch.setattr(attn_ext_hf, "_eager", refuse)
    x = torch.randint(0, 100, (2, 13))
    y = torch.randint(0, 100, (2, 9))
    grads = []
    for model in (ours, ref):
        model.train()
        out = model(input_ids=x, decoder_input_ids=y)
        out.logits.square().mean().backward()
        emb = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
        dec = model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
        grads.append((out.logits.detach(), emb.grad.clone(), dec.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _pair(cfg):
    """Ours and eager's model with the same weights; GPT-OSS's sinks random and clearly
    non-zero (the same in both)."""
    ours, ref = _build(cfg, "attn_ext"), _build(cfg, "eager")
    if isinstance(cfg, transformers.GptOssConfig):
        with torch.no_grad():
            for layer_o, layer_r in zip(ours.model.layers, ref.model.layers):
                layer_o.self_attn.sinks.normal_(0, 2, generator=torch.Generator().manual_seed(1))
                layer_r.self_attn.sinks.copy_(layer_o.self_attn.sinks)
    return ours, ref


@pytest.mark.parametrize("make_cfg", [_gemma2_cfg, _gpt_oss_cfg], ids=["gemma2", "gpt_oss"])
def test_a_mask_the_kernel_cannot_take_keeps_the_score_terms(make_cfg, monkeypatch):
    """A custom 4-D mask falls back, and with softcap or sinks the fallback is the textbook
    formula with those terms, not transformers' SDPA (which refuses softcap and silently
    drops GPT-OSS's sinks)."""
    cfg = make_cfg()
    ours, ref = _pair(cfg)
    S = 7
    keep = torch.ones(S, S, dtype=torch.bool).tril()
    keep[5, 1] = False  # not padding + causal + window
    additive = torch.zeros(1, 1, S, S).masked_fill(~keep, torch.finfo(torch.float32).min)
    masks = {"full_attention": additive, "sliding_attention": additive}
    idx = torch.randint(0, 100, (1, S))
    _no_fallback(monkeypatch)
    attn_ext_hf._warned_fallback = True  # (the one-time warning is tested elsewhere)
    with torch.no_grad():
        got = ours(idx, attention_mask=masks).logits
        want = ref(idx, attention_mask=masks).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_t5_padded_batch_on_the_kernel(monkeypatch):
    """A padded T5 batch: the encoder's padding and the decoder's cross-attention mask over
    the padded encoder keys reach the kernel as key padding (with T5's bias as rel_bias), not
    the eager formula; logits at the real tokens equal "eager"'s."""
    cfg = _t5_cfg()

    def build(impl):
        torch.manual_seed(0)
        return transformers.T5ForConditionalGeneration._from_config(cfg, attn_implementation=impl).eval()

    ours, ref = build("attn_ext"), build("eager")
    x = torch.randint(1, 100, (2, 11))
    mask = torch.ones_like(x)
    mask[1, 7:] = 0
    y = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        want = ref(input_ids=x, attention_mask=mask, decoder_input_ids=y).logits
        _no_fallback(monkeypatch)

        def refuse(*args, **kwargs):
            raise AssertionError("attn_ext used the eager formula")
        monkeypatch.setattr(attn_ext_hf, "_eager", refuse)
        got = ours(input_ids=x, attention_mask=mask, decoder_input_ids=y).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _llama_cfg():
    return transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=128,
    )


@pytest.mark.parametrize("make_cfg", [_llama_cfg, _gemma2_cfg, _gpt_oss_cfg],
                         ids=["llama", "gemma2", "gpt_oss"])
def test_output_attentions_match_eager(make_cfg, monkeypatch):
    """output_attentions=True on the kernel returns eager's probabilities (softcap, sliding
    window, sinks, left padding), in the prompt and in cached decoding steps; "sdpa" returns
    none."""
    cfg = make_cfg()
    ours, ref = _pair(cfg)
    idx = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    _no_fallback(monkeypatch)
    with torch.no_grad():
        got = ours.generate(idx, attention_mask=mask, do_sample=False, max_new_tokens=4,
                            output_attentions=True, return_dict_in_generate=True)
        want = ref.generate(idx, attention_mask=mask, do_sample=False, max_new_tokens=4,
                            output_attentions=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.attentions) == len(want.attentions) == 4
    for step, (g_step, w_step) in enumerate(zip(got.attentions, want.attentions)):
        assert len(g_step) == len(w_step) == cfg.num_hidden_layers
        for g, w in zip(g_step, w_step):
            assert g is not None and g.shape == w.shape and g.dtype == w.dtype
            if step == 0:  # the prompt: row 1's padded query rows are not compared
                g, w = g.clone(), w.clone()
                g[1, :, :3], w[1, :, :3] = 0, 0
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _gpt2_cfg():
    return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100,
                                   n_positions=32)


@pytest.mark.parametrize("make_cfg, how", [(_gpt2_cfg, "keyword"), (_llama_cfg, "config")],
                         ids=["gpt2_keyword", "llama_config"])
def test_output_attentions_reach_the_collector(make_cfg, how, monkeypatch):
    """Attention probabilities wherever transformers collects them, not only where the
    keyword reaches the attention function: GPT-2 pops output_attentions before its layers,
    and config.output_attentions = True is never a keyword. Eager fills the slot in both
    cases; the hook returned None there (no attentions at all)."""
    cfg = make_cfg()
    if how == "config":
        cfg.output_attentions = True
    ours, ref = _build(cfg, "attn_ext"), _build(cfg, "eager")
    idx = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    kw = {"output_attentions": True} if how == "keyword" else {}
    _no_fallback(monkeypatch)
    with torch.no_grad():
        want = ref(idx, attention_mask=mask, **kw).attentions
        got = ours(idx, attention_mask=mask, **kw).attentions
        assert ours(idx, attention_mask=mask, output_attentions=False).attentions is None
    assert len(want) == len(got) == 2
    for g, w in zip(got, want):
        g, w = g.clone(), w.clone()
        g[0, :, :2], w[0, :, :2] = 0, 0  # row 0's padded query rows
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make_cfg, how", [(_gpt2_cfg, "keyword"), (_llama_cfg, "config")],
                         ids=["gpt2_keyword", "llama_config"])
def test_collected_attentions_under_gradient_checkpointing(make_cfg, how):
    """Where only transformers' collector asks for the probabilities, a checkpointed layer's
    recomputation (in the backward, after the collector is reset) must save what the forward
    saved: the first version of the collector path made the backward fail ("a different number
    of tensors was saved"). Dropout on: the gradients equal the un-checkpointed run's, so the
    weights' extra pass draws no random numbers."""
    cfg = make_cfg()
    for name in ("attn_pdrop", "attention_dropout"):
        if hasattr(cfg, name):
            setattr(cfg, name, 0.3)
    if how == "config":
        cfg.output_attentions = True
    kw = {"output_attentions": True} if how == "keyword" else {}
    idx = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(4))
    base = _build(cfg, "attn_ext").train()
    grads, losses = [], []
    for checkpointed in (False, True):
        model = copy.deepcopy(base)
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(5)
        out = model(idx, labels=idx, **kw)
        out.loss.backward()
        assert len(out.attentions) == 2 and all(a is not None for a in out.attentions)
        losses.append(out.loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def _encoder(cls_name, cfg_name, impl, **extra):
    cfg = getattr(transformers, cfg_name)(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=4, intermediate_size=32,
                                          max_position_embeddings=64, **extra)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(cfg).eval()


@pytest.mark.parametrize("cls_name,cfg_name,extra", [
    ("AlignTextModel", "AlignTextConfig", {}),
    ("SplinterModel", "SplinterConfig", {"question_token_id": 5}),
], ids=["align_text", "splinter"])
def test_bidirectional_encoder_without_is_causal(cls_name, cfg_name, extra, monkeypatch):
    """Encoders whose attention modules have no is_causal attribute (transformers' eager code
    never reads it): the hook took such a module for causal, so every position but the last
    attended to fewer keys than eager (up to 0.02 apart); the mask builder's bidirectional
    answer now tells the attention function. With and without a padding mask, on the kernel."""
    _no_fallback(monkeypatch, eager_too=True)
    ours = _encoder(cls_name, cfg_name, "attn_ext", **extra)
    ref = _encoder(cls_name, cfg_name, "eager", **extra)
    ours.load_state_dict(ref.state_dict())
    assert not any(hasattr(m, "is_causal") for m in ours.modules() if "Attention" in type(m).__name__)
    torch.manual_seed(1)
    ids = torch.randint(5, 90, (2, 7))
    am = torch.ones(2, 7, dtype=torch.long)
    am[1, 5:] = 0
    with torch.no_grad():
        for kw in ({}, {"attention_mask": am}):
            got, want = ours(input_ids=ids, **kw).last_hidden_state, ref(input_ids=ids, **kw).last_hidden_state
            assert (got - want)[0].abs().max() < 1e-5 and (got - want)[1, :5].abs().max() < 1e-5, kw


def _models(cls_name, cfg, impls=("attn_ext", "eager"), dtype=torch.float64):
    models = []
    for impl in impls:
        c = copy.deepcopy(cfg)
        c._attn_implementation = impl
        torch.manual_seed(0)
        models.append(getattr(transformers, cls_name)(c).eval().to(dtype))
    return models


def test_a_causal_mask_decides_over_is_causal_false(monkeypatch):
    """Moonshine's decoder passes is_causal = self.is_causal and attention_mask is None, and
    Aimv2's text model is_causal=False, each with a causal mask from create_causal_mask; SDPA
    lets the mask decide. The hook took the flag, so padded batches attended to later tokens
    (1.82 and 0.76 from eager at real tokens). Now the builder's (B, n) causal answer decides,
    on the kernel."""
    _no_fallback(monkeypatch, eager_too=True)
    moon = transformers.MoonshineConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, encoder_num_hidden_layers=1,
        decoder_num_hidden_layers=1, encoder_num_attention_heads=4, decoder_num_attention_heads=4,
        max_position_embeddings=64)
    ours, ref = _models("MoonshineModel", moon)
    torch.manual_seed(1)
    audio = torch.randn(2, 4000, dtype=torch.float64)
    dec = torch.randint(3, 100, (2, 6))
    dm = torch.ones(2, 6, dtype=torch.long)
    dm[1, 4:] = 0
    with torch.no_grad():
        got = ours(input_values=audio, decoder_input_ids=dec, decoder_attention_mask=dm).last_hidden_state
        want = ref(input_values=audio, decoder_input_ids=dec, decoder_attention_mask=dm).last_hidden_state
    assert (got - want)[dm.bool()].abs().max() < 1e-5  # (SDPA: 1.1e-7 from eager here)
    aim = transformers.Aimv2TextConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=4,
                                       max_position_embeddings=64, eos_token_id=2)
    ours, ref = _models("Aimv2TextModel", aim)
    ids = torch.randint(3, 100, (2, 7))
    m = torch.ones_like(ids)
    m[1, 5:] = 0
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=m).last_hidden_state
        want = ref(input_ids=ids, attention_mask=m).last_hidden_state
    assert (got - want)[m.bool()].abs().max() < 1e-5


def test_bidirectional_answer_survives_reentrant_checkpointing():
    """The bidirectional answer was an attribute on the mask tensor, which reentrant
    checkpointing drops when it detaches its inputs: the recomputed forward of AlignText
    (no is_causal attribute) ran causal, and the word embeddings' gradient came back 0.06
    off. Now a (B, 1, 1, n) shape carries it: the same gradients as eager's."""
    cfg = transformers.AlignTextConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=32,
                                       max_position_embeddings=64, attention_probs_dropout_prob=0.0,
                                       hidden_dropout_prob=0.0)
    ids = torch.randint(5, 90, (2, 7))
    am = torch.ones(2, 7, dtype=torch.long)
    am[1, 5:] = 0
    grads = []
    for model in _models("AlignTextModel", cfg):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        for kw in ({}, {"attention_mask": am}):
            out = model(input_ids=ids, **kw).last_hidden_state
            (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append(model.embeddings.word_embeddings.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-7)


def test_t5_bias_fallback_keeps_the_causal_band():
    """A position_bias that is not a function of i - j (always the case under torch.compile,
    where the test cannot read values) went to the eager formula with the padding mask only:
    a causal decoder layer saw later keys (2.5 from SDPA). The fallback now applies the whole
    pattern, with and without padding, and over packed sequences."""
    m = torch.nn.Module()
    m.is_causal = True
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    sdpa = transformers.integrations.sdpa_attention.sdpa_attention_forward
    pad = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    with pytest.warns(UserWarning, match="fall back"):
        attn_ext_hf._warned_fallback = False
        got, _ = attn_ext_hf.attention_forward(m, q, k, v, None, scaling=1.0, position_bias=bias)
    want, _ = sdpa(m, q, k, v, None, scaling=1.0, position_bias=bias)
    torch.testing.assert_close(got, want)
    got, _ = attn_ext_hf.attention_forward(m, q, k, v, pad, scaling=1.0, position_bias=bias)
    full = causal[None, None] & pad[:, None, None, :]
    want, _ = sdpa(m, q, k, v, full, scaling=1.0, position_bias=bias)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1, 1:], want[1, 1:])
    assert torch.equal(got[1, 0], torch.zeros_like(got[1, 0]))  # sees no key (DESIGN: 0)
    # packed: two sequences of 2 and 3 tokens in one row
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    got, _ = attn_ext_hf.attention_forward(m, q[:1], k[:1], v[:1], None, scaling=1.0,
                                           position_bias=bias, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                           max_length_q=3, max_length_k=3)
    block = torch.zeros(5, 5, dtype=torch.bool)
    block[:2, :2] = causal[:2, :2]
    block[2:, 2:] = causal[:3, :3]
    want, _ = sdpa(m, q[:1], k[:1], v[:1], block[None, None], scaling=1.0, position_bias=bias)
    torch.testing.assert_close(got, want)


def test_t5_compiled_decoder_stays_causal():
    """Under torch.compile the T5 bias always takes the fallback (its i - j test reads values);
    it dropped the causal band there: 2.2 from eager, and the last decoder token changed the
    earlier positions' logits."""
    cfg = _t5_cfg()
    cfg.num_layers = cfg.num_decoder_layers = 1
    ours, ref = _models("T5ForConditionalGeneration", cfg, dtype=torch.float32)
    x, y = torch.randint(0, 100, (2, 9)), torch.randint(0, 100, (2, 6))

    def f(model, x, y):
        return model(input_ids=x, decoder_input_ids=y, use_cache=False).logits

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(f, backend="eager", fullgraph=True)(ours, x, y)
        want = f(ref, x, y)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", ["doge", "pix2struct"])
def test_models_that_slice_a_4d_mask_run(model):
    """Doge and Pix2Struct's text model index the mask they are handed as 4-D
    (mask[:, :, :, :k]); the 2-D padding answer raised IndexError with any padding. They get
    transformers' 4-D mask now, and give SDPA's outputs at the real tokens."""
    if model == "doge":
        cfg = transformers.DogeConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
        cls, kw = "DogeForCausalLM", {}
    else:
        cfg = transformers.Pix2StructTextConfig(vocab_size=100, hidden_size=32, d_kv=8, d_ff=64,
                                                num_layers=1, num_heads=4,
                                                relative_attention_num_buckets=8,
                                                initializer_range=0.02)
        cls, kw = "Pix2StructTextModel", {}
    ours, ref = _models(cls, cfg, ("attn_ext", "sdpa"), torch.float32)
    ids = torch.randint(3, 100, (2, 7))
    m = torch.ones_like(ids)
    m[1, :2] = 0 if model == "doge" else 1
    m[1, 5:] = 1 if model == "doge" else 0
    import warnings
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ours(input_ids=ids, attention_mask=m, **kw).logits
        want = ref(input_ids=ids, attention_mask=m, **kw).logits
    assert (got - want)[m.bool()].abs().max() < 1e-4


def test_compiled_and_exported_bidirectional_encoder_run_on_the_kernel(monkeypatch):
    """A compiled or exported encoder (BERT, with padding) took SDPA: the bidirectional answer
    was an attribute a traced tensor cannot carry. The (B, 1, 1, n) answer is decided from the
    mask function alone, so tracing gets it too: on the kernel, eager's outputs."""
    _no_fallback(monkeypatch, eager_too=True)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=4, intermediate_size=32,
                                  max_position_embeddings=64)
    ours, ref = _models("BertModel", cfg, dtype=torch.float32)
    ids = torch.randint(5, 90, (2, 7))
    am = torch.ones(2, 7, dtype=torch.long)
    am[1, 5:] = 0

    def f(model, i, a):
        return model(input_ids=i, attention_mask=a).last_hidden_state

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(f, backend="eager", fullgraph=True)(ours, ids, am)
        want = f(ref, ids, am)
        ep = torch.export.export(ours, (), {"input_ids": ids, "attention_mask": am})
        exported = ep.module()(input_ids=ids, attention_mask=am).last_hidden_state
    assert (got - want)[am.bool()].abs().max() < 1e-5
    assert (exported - want)[am.bool()].abs().max() < 1e-5
    assert any("attn_ext" in str(n.target) for n in ep.graph.nodes)


def test_gemma4_shared_kv_layers_get_4d_masks(monkeypatch):
    """Gemma 4 with KV sharing slices the masks it is handed as 4-D (mask[:, :, rows, :]): the
    builder's 2-D answer raised IndexError with any attention_mask (so every generate()), and,
    for a moment in this session, without one too. Its masks are transformers' 4-D ones now:
    eager's logits without a mask and with left padding, on the kernel."""
    cfg = transformers.Gemma4TextConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8,
        max_position_embeddings=64, sliding_window=4, vocab_size_per_layer_input=100,
        hidden_size_per_layer_input=8, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    ours, ref = _models("Gemma4ForCausalLM", cfg, dtype=torch.float32)
    _no_fallback(monkeypatch, eager_too=True)
    idx = torch.randint(3, 100, (2, 9))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, :3] = 0
    with torch.no_grad():
        for kw in ({}, {"attention_mask": am}):
            got, want = ours(idx, **kw).logits, ref(idx, **kw).logits
            keep = am.bool() if kw else torch.ones_like(am, dtype=torch.bool)
            assert (got - want)[keep].abs().max() < 1e-4, kw


# Models whose modeling code computes attention itself (not through transformers'
# AttentionInterface) but builds its masks through AttentionMaskInterface: transformers accepts
# attn_implementation="attn_ext" for them, attn_ext's attention never runs, and before the
# refusal their own eager code added attn_ext_mask's answers (None for plain causal, a boolean
# padding mask) to its scores: Bloom / XGLM non-causal logits, RoFormer / MegatronBERT wrong
# logits with padding, or a shape error.
_OWN_ATTENTION = [
    ("bloom", "BloomForCausalLM", "BloomConfig",
     dict(vocab_size=97, hidden_size=64, n_layer=2, n_head=4)),
    ("xglm", "XGLMForCausalLM", "XGLMConfig",
     dict(vocab_size=97, d_model=64, num_layers=2, attention_heads=4, ffn_dim=96)),
    ("roformer", "RoFormerModel", "RoFormerConfig",
     dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
          intermediate_size=96, embedding_size=64)),
    ("megatron-bert", "MegatronBertModel", "MegatronBertConfig",
     dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
          intermediate_size=96)),
]


@pytest.mark.parametrize("model_type,cls_name,cfg_name,kw", _OWN_ATTENTION,
                         ids=[m[0] for m in _OWN_ATTENTION])
@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "padding"])
def test_a_model_that_computes_attention_itself_is_refused(model_type, cls_name, cfg_name, kw,
                                                           padded):
    cls = getattr(transformers, cls_name)
    cfg = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(0)
    model = cls._from_config(copy.deepcopy(cfg), attn_implementation="attn_ext").eval()
    ids = torch.randint(3, 97, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad(), pytest.raises(ValueError, match=rf"'{model_type}' models compute "
                                        r"attention in their own code.*AttentionInterface.*eager"):
        model(ids, attention_mask=mask if padded else None)
    # the same model in eager runs (the refusal is about attn_ext, not the model)
    eager = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    with torch.no_grad():
        eager(ids, attention_mask=mask if padded else None)


def test_the_refusal_rule_reads_the_config_package():
    """_check_routes_attention: a config from outside transformers.models (remote code) and a
    package that dispatches through the interface pass; a user's subclass of a refused model's
    config is refused as its base; the rule needs no file or sys.modules access per call (the
    refused packages are read from transformers' sources once, at import)."""
    class RemoteConfig:
        model_type = "remote"
    RemoteConfig.__module__ = "transformers_modules.someone.configuration_remote"
    attn_ext_hf._check_routes_attention(RemoteConfig())
    attn_ext_hf._check_routes_attention(transformers.LlamaConfig())
    attn_ext_hf._check_routes_attention(None)

    class MyBloomConfig(transformers.BloomConfig):
        pass
    with pytest.raises(ValueError, match="'bloom' models compute attention in their own code"):
        attn_ext_hf._check_routes_attention(MyBloomConfig())
    own = attn_ext_hf._OWN_ATTENTION
    assert {"bloom", "xglm", "roformer", "megatron_bert"} <= own
    assert not own & {"llama", "mistral", "gemma2", "gpt2", "bert", "t5", "bart", "gpt_oss"}


def test_bigbird_pegasus_is_refused_also_when_its_config_says_block_sparse():
    """BigBirdPegasus's decoder routes through the interface, its encoder does not: with
    attention_type="block_sparse" and a short input the encoder switches itself to its own
    "original_full" attention (the config still says block_sparse) and reads the mask."""
    cfg = transformers.BigBirdPegasusConfig(
        vocab_size=99, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64, attention_type="block_sparse")
    model = transformers.BigBirdPegasusForConditionalGeneration._from_config(
        cfg, attn_implementation="attn_ext").eval()
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad(), pytest.raises(ValueError, match="'bigbird_pegasus' models compute"):
        model(ids, decoder_input_ids=ids[:, :5])


def test_a_compiled_first_forward_is_refused_too():
    """The refusal does not depend on an eager forward first: it is decided from the config's
    class, which torch.compile traces (fullgraph too)."""
    cfg = transformers.BloomConfig(vocab_size=97, hidden_size=64, n_layer=2, n_head=4)
    model = transformers.BloomForCausalLM._from_config(cfg, attn_implementation="attn_ext").eval()
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad(), pytest.raises(Exception, match="'bloom' models compute attention"):
        torch.compile(model, fullgraph=True, backend="eager")(ids)


def test_sparse_attention_indices_are_refused():
    """DeepSeek sparse attention layers hand a non-eager implementation their indexer's top-k
    keys (indices=) and mask nothing themselves: the dense kernel would ignore them."""
    q = torch.randn(1, 4, 6, 16)
    k = v = torch.randn(1, 2, 6, 16)
    layer = torch.nn.Module()
    with pytest.raises(ValueError, match="indices="):
        attn_ext_hf.attention_forward(layer, q, k, v, None,
                                      indices=torch.zeros(1, 6, 2, dtype=torch.int32))
    out, _ = attn_ext_hf.attention_forward(layer, q, k, v, None, indices=None)
    assert out.shape == (1, 6, 4, 16)
