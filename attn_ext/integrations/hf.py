"""Hugging Face transformers attention hook: ``attn_implementation="attn_ext"``.

Importing this module registers :func:`attention_forward` with transformers'
``AttentionInterface`` (and transformers' SDPA mask builder with ``AttentionMaskInterface``)
under the name ``"attn_ext"``::

    import attn_ext.integrations.hf  # noqa: F401  (registers "attn_ext")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attn_ext")

transformers hands the attention function ``query (B, H, Sq, D)``, ``key``/``value``
``(B, Hkv, Sk, D)``. They are passed to ``torch.ops.attn_ext.attention`` as
``.transpose(1, 2)`` views (the kernels read heads through strides: no copy), grouped-query
attention is done by the kernel itself (no ``repeat_kv``), and the output is returned as the
``(B, Sq, H, Dv)`` tensor transformers expects.

What runs on attn_ext's kernel and what does not:

- Causal (or bidirectional) attention, prefill and cached decoding with ``DynamicCache``.
- Padded batches: the mask builder registered under ``"attn_ext"`` (:func:`attn_ext_mask`)
  hands the attention function the 2-D ``(B, Sk)`` padding mask for a causal pattern and a
  ``(B, 1, 1, Sk)`` one for a bidirectional one, which reach the kernel as
  ``key_padding_mask`` (left padding for generation, right padding for training). A given
  mask decides whether the call is causal, as it does for SDPA (a model may pass
  ``is_causal=False`` with a causal mask); without a mask ``is_causal``, else the module's
  ``is_causal`` (default True), decides.
- Sliding windows (Mistral-style ``config.sliding_window = W``): ``window=(W - 1, 0)``.
- Packed training (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``: the
  ``cu_seq_lens_q/k`` and ``max_length_q/k`` keyword arguments) runs
  :func:`attn_ext.attention_varlen`.
- Static caches: a decode step's 4-D mask (one query row over the filled and unfilled
  slots) is a key padding mask; a chunk's 4-D mask runs once the keys no query sees are cut
  off (:func:`_read_as_padding`). Any boolean 4-D mask that is the kernel's pattern plus key
  padding runs on the kernel.
- A mask that is none of these (a custom 4-D mask, packing given only through
  ``position_ids``) is detected by comparing transformers' own mask with the pattern the
  kernel would apply; it falls back to transformers' SDPA (to the textbook formula when the
  layer has softcap or sinks, which SDPA lacks) with a one-time warning. Results stay
  correct; only the kernel differs. (The comparison forms transformers' boolean
  ``(B, 1, Sq, Sk)`` mask once per forward, as ``"sdpa"`` does, whenever there is padding.)
- ``torch.compile(fullgraph=True)`` / ``torch.export``: no value may steer Python, so the
  mask builder decides from the mask function, sizes and offsets (:func:`_traced_mask`):
  plain causal and bidirectional masks with padding reach the kernel as ``key_padding_mask``
  (bidirectional encoders included);
  one query row's 4-D mask does too; other 4-D masks take SDPA (no warning while tracing),
  and T5's bias the eager formula.
- ``softcap`` (Gemma 2's ``attn_logit_softcapping``), attention sinks (GPT-OSS's ``s_aux``)
  and attention dropout in training run on the kernel (its score terms, DESIGN.md).
- T5's relative position bias: T5Attention computes a dense ``(1, H, Sq, Sk)``
  ``position_bias`` (its bucketed b_{i-j} gathered per (i, j)) before calling the attention
  function and passes it as a keyword. The hook reads its diagonals back into the kernel's
  ``rel_bias (H, 2M + 1)`` table (a differentiable gather, so the gradient still reaches
  T5's bucket embedding), checks that the dense tensor is exactly that table expanded (a
  function of i - j alone), and otherwise falls back to the eager formula. The dense
  tensor itself is T5's own (transformers builds it before the hook is called).
- ``output_attentions=True`` (the keyword, or ``config.output_attentions``: wherever
  transformers' output collector records attentions, :func:`_collector_wants_attentions`)
  returns the attention probabilities (``"sdpa"`` returns none; where only the collector asks
  and autograd is on, detached ones, from a second pass):
  :func:`attn_ext.attention_weights` forms them from q, k and the forward's lse, so that
  call costs the full ``(B, H, Sq, Sk)`` matrix; the output still comes from the kernel.
  Under attention dropout they are the probabilities before dropout. Packed batches
  (``cu_seq_lens_*``) and the fallbacks return no weights.
- Models whose modeling code computes attention itself instead of calling transformers'
  ``AttentionInterface`` (Bloom, XGLM, RoFormer, MegatronBERT, ... in transformers 5.x):
  transformers accepts the name for them, but attn_ext's attention would never run, and
  their own code would read attn_ext's masks as additive float masks. Their first forward
  raises a ValueError that says so (load them with ``"eager"`` or ``"sdpa"``). So does a layer
  that hands the attention function sparse top-k ``indices`` (DeepSeek sparse attention),
  which the dense kernel would ignore.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

import attn_ext  # noqa: F401  (registers torch.ops.attn_ext.*)
from attn_ext.reference import add_score_terms, band_mask, softmax_with_sinks, visibility_mask

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface, bidirectional_mask_function, causal_mask_function, sdpa_mask,
)
try:  # transformers' output collector (capture_outputs), where this version has one
    from transformers.utils.output_capturing import _active_collector as _ACTIVE_COLLECTOR
except ImportError:  # pragma: no cover
    _ACTIVE_COLLECTOR = None

__all__ = ["NAME", "attention_forward", "attn_ext_mask", "register"]

NAME = "attn_ext"

_warned_fallback = False


def _bshd(x: torch.Tensor) -> torch.Tensor:
    # (B, H, S, D) -> (B, S, H, D) view; the kernel only needs a contiguous last dim.
    x = x.transpose(1, 2)
    return x if x.stride(-1) == 1 or x.size(-1) <= 1 else x.contiguous()


def _rel_bias_table(position_bias: torch.Tensor, q_len: int, kv_len: int):
    """The ``(H, 2M + 1)`` table (M = max(q_len, kv_len) - 1) whose entry ``M + d`` is
    ``position_bias[0, h, i, j]`` at ``d = i + (kv_len - q_len) - j``, or None when the dense
    ``(1, H, q_len, kv_len)`` bias is not such a table expanded."""
    if position_bias.dim() != 4 or position_bias.shape[0] != 1 or tuple(position_bias.shape[2:]) != (q_len, kv_len):
        return None
    dev = position_bias.device
    off = kv_len - q_len
    M = max(q_len, kv_len, 1) - 1
    d = torch.arange(-M, M + 1, device=dev)
    # a representative (i, j) of each distance d: i - j = d - off
    i = (d - off).clamp(min=0).clamp(max=q_len - 1)
    j = (i + off - d).clamp(min=0, max=kv_len - 1)
    table = position_bias[0][:, i, j]  # (H, 2M + 1)
    ii = torch.arange(q_len, device=dev)[:, None]
    jj = torch.arange(kv_len, device=dev)[None, :]
    if not torch.equal(table.detach()[:, M + ii + off - jj], position_bias.detach()[0]):
        return None
    return table


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers attention function backed by ``torch.ops.attn_ext.attention``.

    ``query (B, H, Sq, D)``, ``key (B, Hkv, Sk, D)``, ``value (B, Hkv, Sk, Dv)`` ->
    ``(out (B, Sq, H, Dv), None)``, or ``(out, weights (B, H, Sq, Sk))`` with
    ``output_attentions=True``. See the module docstring for what falls back.
    """
    if kwargs.get("indices") is not None:
        # DeepSeek sparse attention (DeepSeek-V3.2, GLM-MoE-DSA, Mistral Large 4, ...): the
        # layer hands the implementation its indexer's top-k keys per query and masks them
        # itself only for "eager" / "sdpa"; the kernel's dense attention would ignore them
        raise ValueError(
            f"attn_implementation={NAME!r}: this layer ({type(module).__name__}) passes "
            f"indices= (its sparse attention's top-k keys per query), which attn_ext's dense "
            f"attention does not take; load the model with attn_implementation='eager' or "
            f"'sdpa', which apply them as a mask")
    # score terms: Gemma 2's softcap, GPT-OSS's sinks (s_aux, (H,)), attention dropout
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    terms = dict(softcap=softcap, sinks=sinks, dropout_p=float(dropout))
    position_bias = kwargs.get("position_bias")  # T5: dense (1, H, Sq, Sk)
    plain = softcap is None and sinks is None and dropout == 0.0 and position_bias is None
    q_len, kv_len = query.shape[2], key.shape[2]

    # Causal or not. A mask decides, as a mask given to SDPA does (models such as Moonshine's
    # decoder or Aimv2's text model build a causal mask and pass is_causal=False with it):
    # attn_ext_mask's (B, n) padding mask is its causal answer, a boolean (B or 1, 1, 1, Sk)
    # mask is the same keys for every query, i.e. bidirectional over key padding (both read
    # from the shape, which survives detach(), reentrant checkpointing and tracing, where an
    # attribute on the tensor did not). With no mask: is_causal, else module.is_causal.
    if is_causal is not None:
        causal_default = bool(is_causal)
    else:
        causal_default = getattr(module, "is_causal", True)
    if attention_mask is not None and attention_mask.dim() == 2:
        causal_default = True
    elif _is_key_row_mask(attention_mask, query.shape[0], kv_len) and q_len > 1:
        causal_default = False
        attention_mask = attention_mask[:, 0, 0].expand(query.shape[0], kv_len)
    sliding = kwargs.get("sliding_window")
    window = _causal_window(sliding, causal_default)

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if position_bias is not None and cu_q is not None and cu_k is not None:
        # (T5's dense bias over a packed batch: the eager formula, each sequence seeing its own
        # keys only)
        keep = _packed_keep(cu_q, cu_k, q_len, kv_len, causal_default, window, query.device)
        return _fallback(module, query, key, value, keep, dropout, scaling, is_causal, kwargs,
                         terms, position_bias), None
    if cu_q is not None and cu_k is not None and query.shape[0] == 1:
        # packed batch (DataCollatorWithFlattening): query (1, H, T, D), one row per token
        out = attn_ext.attention_varlen(
            _bshd(query)[0], _bshd(key)[0], _bshd(value)[0], cu_q.to(torch.int32),
            cu_k.to(torch.int32), int(kwargs.get("max_length_q")), int(kwargs.get("max_length_k")),
            causal=causal_default, scale=scaling, window=window, **terms,
        )
        return out[None], None

    if attention_mask is not None and attention_mask.dim() != 2:
        # A 4-D mask: transformers' own (a static cache's unfilled slots; a pattern the mask
        # builder could not check under torch.compile / torch.export) or a custom one.
        read = _read_as_padding(attention_mask, query.shape[0], q_len, kv_len, causal_default,
                                sliding)
        if read is None:
            return _fallback(module, query, key, value, attention_mask, dropout, scaling,
                             is_causal, kwargs, terms, position_bias), None
        # (the keys past the padding mask are cut off below, as a static cache's slots)
        attention_mask, causal_default, window = read

    key_padding_mask = None
    if attention_mask is not None:  # (B, n) padding mask from attn_ext_mask
        key_padding_mask = attention_mask.to(torch.bool)
        n = key_padding_mask.shape[1]
        if n > kv_len:  # absolute positions [0, n) of a cache holding the last kv_len of them
            key_padding_mask = key_padding_mask[:, n - kv_len:]
        else:
            key, value = key[:, :, :n], value[:, :, :n]  # a static cache's unfilled slots
    elif causal_default and q_len > 1 and kv_len > q_len:
        # transformers only omits the mask here for the prefill of an empty static cache,
        # whose keys past q_len are unfilled slots: its is_causal is top-left aligned, ours
        # bottom-right, so keep just the filled keys (then the two agree).
        key = key[:, :, :q_len]
        value = value[:, :, :q_len]
    if position_bias is not None:
        position_bias = position_bias[..., : key.shape[2]]
        # (the test that the bias is a function of i - j reads values: not in a traced graph)
        table = None if torch.compiler.is_compiling() else _rel_bias_table(
            position_bias, q_len, key.shape[2])
        if table is None:
            # the kernel's whole pattern, not the padding alone (the causal band was dropped:
            # T5's decoder saw later tokens whenever the bias took this path, always under
            # torch.compile)
            keep = visibility_mask(q_len, key.shape[2], causal_default, window, key_padding_mask,
                                   query.device)
            return _fallback(module, query, key, value, keep, dropout, scaling,
                             is_causal, kwargs, terms, position_bias), None
        terms["rel_bias"] = table
    keyword = bool(kwargs.get("output_attentions", False))
    collect = not keyword and _collector_wants_attentions()
    if not collect or not torch.is_grad_enabled():
        return _on_kernel(query, key, value, key_padding_mask, causal_default, scaling, window,
                          terms, plain, kv_len if keyword or collect else None)
    # Only transformers' collector asks (GPT-2 pops the keyword; config.output_attentions is
    # never one), with autograd on: under gradient checkpointing the recomputation runs after
    # the collector is reset, so the output must come as without weights (the same saved
    # tensors: otherwise "a different number of tensors was saved" in the backward), and the
    # weights (detached) from a second, gradient-free pass, its lse without dropout (no random
    # numbers that the recomputation would not draw).
    out, _ = _on_kernel(query, key, value, key_padding_mask, causal_default, scaling, window,
                        terms, plain)
    with torch.no_grad():
        _, weights = _on_kernel(query.detach(), key.detach(), value.detach(), key_padding_mask,
                                causal_default, scaling, window,
                                {n: t for n, t in terms.items() if n != "dropout_p"}, plain,
                                kv_len)
    return out, weights


def _collector_wants_attentions() -> bool:
    """Whether transformers' output collector (``capture_outputs``) records some
    ``*attentions`` key: it takes the attention module's second output whatever reached the
    attention function, so GPT-2 (which pops ``output_attentions`` before its layers) and
    ``config.output_attentions = True`` (never a keyword) want probabilities there too (eager
    fills that slot either way; the hook used to return None)."""
    if _ACTIVE_COLLECTOR is None:
        return False
    if torch.compiler.is_compiling():
        # (a ContextVar's get() does not trace; under compile capture_outputs sets the
        # wrapper's plain global instead)
        collected = _ACTIVE_COLLECTOR.global_var if _ACTIVE_COLLECTOR.compiling else None
    else:
        collected = _ACTIVE_COLLECTOR.get()
    return collected is not None and any(key.endswith("attentions") for key in collected)


def _on_kernel(query, key, value, key_padding_mask, causal_default, scaling, window, terms, plain,
               weights_len=None):
    """attn_ext's kernel on transformers' (B, H, S, D) tensors -> ``(out (B, Sq, H, Dv)
    contiguous, None)``.

    With ``weights_len`` (``output_attentions=True``) the second item is the ``(B, H, Sq,
    weights_len)`` probabilities in the query's dtype, as eager returns them, formed by
    :func:`attn_ext.attention_weights` from q, k and the forward's lse (which includes a sink's
    share, so with sinks the rows sum to less than 1, as eager's do once it drops the sink
    column). Keys cut off as unfilled cache slots get weight 0. Under attention dropout these
    are the probabilities before dropout (eager returns them after)."""
    q, k, v = _bshd(query), _bshd(key), _bshd(value)
    if weights_len is None:
        # A single query row sees every key under our bottom-right causal mask anyway.
        causal = causal_default and query.shape[2] > 1
        if key_padding_mask is None and window is None and plain:
            return torch.ops.attn_ext.attention(q, k, v, causal, scaling), None
    out = attn_ext.attention(q, k, v, causal=causal_default, scale=scaling, window=window,
                             key_padding_mask=key_padding_mask, return_lse=weights_len is not None,
                             **terms)
    if weights_len is None:
        return out, None
    out, lse = out
    weights = attn_ext.attention_weights(
        q, k, causal=causal_default, scale=scaling, lse=lse, window=window,
        key_padding_mask=key_padding_mask, softcap=terms.get("softcap"),
        rel_bias=terms.get("rel_bias"))
    if weights.shape[-1] < weights_len:
        weights = torch.nn.functional.pad(weights, (0, weights_len - weights.shape[-1]))
    return out, weights.to(query.dtype)


def _causal_window(sliding, causal):
    """The kernel's window for transformers' ``sliding_window = W`` (Mistral-style: W - 1 keys
    back and the query itself), None where there is none or the pattern is not causal."""
    return (int(sliding) - 1, 0) if sliding is not None and causal else None


def _is_key_row_mask(mask, batch, kv_len) -> bool:
    """A boolean ``(B or 1, 1, 1, kv_len)`` mask: every query sees the same keys (what
    attn_ext_mask returns for transformers' bidirectional pattern)."""
    return (mask is not None and mask.dtype == torch.bool and mask.dim() == 4
            and mask.shape[0] in (1, batch) and tuple(mask.shape[1:]) == (1, 1, kv_len))


def _packed_keep(cu_q, cu_k, q_len, kv_len, causal, window, device):
    """The ``(Tq, Tk)`` mask of a packed batch (cu_seq_lens): query t of sequence s sees key u
    of the same sequence under the kernel's per-sequence pattern (bottom-right aligned), as
    attn_ext.attention_varlen applies it."""
    cu_q, cu_k = cu_q.to(device=device, dtype=torch.long), cu_k.to(device=device, dtype=torch.long)
    tq, tk = torch.arange(q_len, device=device), torch.arange(kv_len, device=device)
    last = cu_q.numel() - 2
    sq = torch.searchsorted(cu_q[1:], tq, right=True).clamp(max=last)  # each query's sequence
    sk = torch.searchsorted(cu_k[1:], tk, right=True).clamp(max=last)
    i, j = tq - cu_q[sq], tk - cu_k[sk]
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    d = i[:, None] + (len_k - len_q)[sq][:, None] - j[None, :]
    return (sq[:, None] == sk[None, :]) & band_mask(d, causal, window)


def _read_as_padding(mask, batch, q_len, kv_len, causal, sliding):
    """A boolean ``(B or 1, 1, Sq, Sk)`` mask read as the kernel's arguments:
    ``(key_padding_mask (B, n), causal, window)`` for the first ``n`` keys, or None when
    the kernel cannot apply it (the caller falls back). The mask decides whether it is causal
    (``causal``, the layer's default, is tried first; a causal pattern takes the layer's
    ``sliding`` window).

    - One query row (decoding): its mask row is a key padding mask, whatever made it (a
      static cache's unfilled slots, a window): no value is read, so this also holds in a
      traced graph.
    - Several rows, eager only: the keys no query sees are cut off the end (a static cache's
      unfilled slots, which would shift the kernel's bottom-right alignment), and the rest
      must equal ``visibility_mask(Sq, n, causal, window, pad)`` with ``pad`` the keys some
      query sees, causal or not. Under torch.compile / torch.export that test would read
      values: None.
    """
    if (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1
            or mask.shape[2] != q_len or mask.shape[3] != kv_len or mask.shape[0] not in (1, batch)):
        return None
    mask = mask[:, 0].expand(batch, q_len, kv_len)
    if q_len == 1:
        return mask[:, 0], False, None
    if torch.compiler.is_compiling():
        return None
    cols = mask.any(dim=1).any(dim=0).nonzero()
    if cols.numel() == 0:
        return None
    n = int(cols[-1]) + 1
    pad = mask[..., :n].any(dim=1)  # (B, n)
    for c in (causal, not causal):
        window = _causal_window(sliding, c)
        if torch.equal(visibility_mask(q_len, n, c, window, pad, mask.device)[:, 0], mask[..., :n]):
            return pad, c, window
    return None


def _fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs,
              terms, position_bias):
    """A mask (or bias) the kernel cannot take: transformers' SDPA for plain attention, the
    textbook formula with the score terms (SDPA has no softcap, sinks or dense bias)."""
    global _warned_fallback
    if not _warned_fallback and not torch.compiler.is_compiling():
        _warned_fallback = True
        warnings.warn(
            "attn_ext: an attention mask the kernel cannot express (a custom 4-D mask, "
            "packing through position_ids only, ...) or a position_bias that is not a "
            "function of i - j was given; these calls fall back to transformers' SDPA "
            "attention (or to the eager formula with score terms). Padding, packing "
            "(cu_seq_lens) and sliding windows run on attn_ext.",
            stacklevel=3,
        )
    if position_bias is None and terms["softcap"] is None and terms["sinks"] is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)[0]
    return _eager(module, query, key, value, attention_mask, dropout, scaling, position_bias,
                  terms["softcap"], terms["sinks"])


def _eager(module, query, key, value, attention_mask, dropout, scaling, position_bias=None,
           softcap=None, sinks=None):
    """The textbook formula (reference.py) with the mask as given: boolean (True = seen) or
    additive; ``position_bias`` is T5's dense bias."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scale = 1.0 / query.shape[-1] ** 0.5 if scaling is None else scaling
    scores = add_score_terms(torch.matmul(query, key.transpose(2, 3)) * scale, None, softcap=softcap)
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    # (float32 at least, as eager; float64 stays float64)
    work = torch.promote_types(scores.dtype, torch.float32)
    probs, _ = softmax_with_sinks(scores.to(work), sinks)
    probs = torch.nn.functional.dropout(probs.to(query.dtype), dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


# Models that index or concatenate the masks they are handed as 4-D tensors before the
# attention function sees them (Doge and Pix2Struct crop mask[:, :, :, :k], Gemma 4's shared
# KV layers slice mask[:, :, rows, :], T5Gemma 2's decoder concatenates its self- and
# cross-attention masks): the 2-D / (B, 1, 1, n) answers made them fail, so they get
# transformers' own 4-D masks, which the attention function reads back as padding in eager.
_NEEDS_4D_MASK = frozenset({"doge", "pix2struct_text_model", "gemma4_text", "gemma4_unified_text",
                            "t5gemma2_decoder"})


# Names through which a transformers modeling file dispatches attention to the implementation
# the config names (AttentionInterface); a package none of whose modeling files has either
# computes attention in its own code.
_INTERFACE_NAMES = ("ALL_ATTENTION_FUNCTIONS", "AttentionInterface")


def _own_attention_packages() -> frozenset:
    """The packages of ``transformers.models`` with modeling files, none of which dispatches
    through AttentionInterface (Bloom, XGLM, RoFormer, MegatronBERT, ... in transformers 5.x).
    Read from the sources once, at import (~40 ms), so that the check is a set lookup, the same
    in eager and while torch.compile / torch.export trace (no file or sys.modules access)."""
    import glob
    import os

    import transformers
    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    own = set()
    for entry in os.scandir(root):
        files = glob.glob(os.path.join(entry.path, "modeling_*.py")) if entry.is_dir() else []
        texts = []
        for name in files:
            try:
                with open(name, encoding="utf-8") as f:
                    texts.append(f.read())
            except OSError:  # (unreadable: nothing to tell from)
                texts.append(_INTERFACE_NAMES[0])
        if texts and not any(n in t for t in texts for n in _INTERFACE_NAMES):
            own.add(entry.name)
    return frozenset(own)


_OWN_ATTENTION = _own_attention_packages()


# Packages whose files route some attention through the interface, but whose layers that
# read create_*_mask's answer compute attention themselves: GIT's text decoder (only its vision
# tower routes), BigBirdPegasus's encoder (its "original_full" attention, which it also switches
# to by itself for short inputs while the config still says "block_sparse").
_OWN_MASKED_ATTENTION = frozenset({"git", "bigbird_pegasus"})


def _config_package(config) -> Optional[str]:
    """``<name>`` of the first class in the config's MRO defined in
    ``transformers.models.<name>`` (a user's subclass of a transformers config counts as its
    base's model); None for configs from elsewhere (remote code)."""
    for cls in type(config).__mro__:
        parts = cls.__module__.split(".")
        if len(parts) >= 4 and parts[0] == "transformers" and parts[1] == "models":
            return parts[2]
    return None


def _check_routes_attention(config) -> None:
    """Refuse a transformers model whose attention does not go through ``AttentionInterface``.

    transformers accepts ``attn_implementation="attn_ext"`` for every model, but a model whose
    modeling code computes attention itself never calls :func:`attention_forward`; it still
    builds its masks through ``AttentionMaskInterface``, i.e. with :func:`attn_ext_mask`, and
    its own eager code would add the answers (None for the plain causal pattern, a boolean
    padding mask) to its scores as an additive float mask: silently non-causal or wrong
    logits. The model comes from its config's class (``transformers.models.<name>``); configs
    from elsewhere (remote code) pass: there is nothing to tell from."""
    if config is None:
        return
    package = _config_package(config)
    if package is None:
        return
    if package in _OWN_ATTENTION or package in _OWN_MASKED_ATTENTION:
        kind = getattr(config, "model_type", package)
        raise ValueError(
            f"attn_implementation={getattr(config, '_attn_implementation', NAME)!r}: {kind!r} "
            f"models compute attention in their own code, not through transformers' "
            f"AttentionInterface (transformers.models.{package}), so attn_ext's attention would "
            f"never run and the model would read attn_ext's masks as its own (wrong logits). "
            f"Load it with attn_implementation='eager' (or 'sdpa' where the model supports it).")


def attn_ext_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: Optional[torch.Tensor] = None,
    local_size: Optional[int] = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
):
    """transformers mask builder for ``"attn_ext"``. Its answers, which the attention function
    reads by their shape:

    - None when no mask is needed (transformers' own ``sdpa_mask`` gives None, or the causal
      pattern without padding that the attention function applies by itself);
    - transformers' bidirectional pattern (``bidirectional_mask_function``, no window, several
      queries): the ``(B, 1, 1, kv_length)`` boolean key padding mask, the same keys for
      every query (an SDPA-style 4-D mask, so models that slice or add to it still work);
    - a causal pattern with the sliding window ``local_size`` that the attention function
      applies (bottom-right aligned) on top of key padding: the 2-D ``(B, n)`` padding mask;
    - otherwise transformers' full 4-D SDPA mask (-> the attention function reads it as
      padding where it can, else falls back to SDPA).

    A model whose attention does not go through transformers' ``AttentionInterface`` (so
    that its own code would read these answers) is refused (:func:`_check_routes_attention`)."""
    _check_routes_attention(kwargs.get("config"))
    if getattr(kwargs.get("config"), "model_type", None) in _NEEDS_4D_MASK:
        return sdpa_mask(
            batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
            local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs)
    if (mask_function is bidirectional_mask_function and q_length > 1 and local_size is None
            and isinstance(kv_offset, int)
            and (attention_mask is None or attention_mask.dim() == 2)):
        # (decided from the mask function itself, so the same in eager and while tracing)
        return _key_row_mask(batch_size, kv_length, kv_offset, attention_mask,
                             kwargs.get("device", "cpu"))
    full = sdpa_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
        local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs,
    )
    if full is None or (attention_mask is not None and attention_mask.dim() != 2):
        return full
    if torch.compiler.is_compiling():
        return _traced_mask(full, batch_size, q_length, kv_length, q_offset, kv_offset,
                            mask_function, attention_mask, local_size)
    # key j of the kernel is absolute position kv_offset + j; keys past the 2-D mask are
    # unfilled cache slots, cut off by the attention function
    if attention_mask is None:  # e.g. a sliding window longer than the prompt, no padding
        pad = torch.ones(batch_size, kv_length, dtype=torch.bool, device=full.device)
    else:
        pad = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    n = pad.shape[1]
    if n < q_length or not torch.equal(full[..., n:], torch.zeros_like(full[..., n:])):
        return full
    q_pos = torch.arange(q_length, device=pad.device)[:, None] + q_offset
    k_pos = torch.arange(n, device=pad.device)[None, :] + kv_offset
    if q_offset - kv_offset != n - q_length:  # the kernel aligns bottom-right
        return full
    band = k_pos <= q_pos
    if local_size is not None:
        band = band & (q_pos - k_pos < local_size)
    if torch.equal(full[..., :n], band[None, None] & pad[:, None, None, :]):  # causal (+ window)
        if kv_offset > 0:
            # The cache holds positions kv_offset.. only (a sliding window's static layer
            # once full): return the caller's mask over absolute positions [0, kv_offset +
            # n), not its slice. generate() feeds a precomputed mask back into this builder
            # as a 2-D padding mask, which is then read at absolute positions again (the
            # slice would be read as positions 0..n-1: a wrong mask, and wrong tokens);
            # the attention function takes its last kv_len columns.
            if attention_mask is None:  # no padding: every absolute position is real
                return torch.ones(batch_size, kv_offset + n, dtype=torch.bool, device=full.device)
            return attention_mask[:, : kv_offset + n].to(torch.bool)
        return _padding_or_none(attention_mask, pad, q_length)
    if q_length > 1 and torch.equal(full, full[:, :, :1].expand_as(full)):
        return full[:, :, :1]  # every query sees the same keys (a composed bidirectional mask)
    return full


def _traced_mask(full, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                 attention_mask, local_size):
    """attn_ext_mask under torch.compile / torch.export, where no value may steer Python: the
    same answer as in eager, decided from what is known while tracing (the mask function
    itself, the sizes and offsets), never from the mask's values.

    (transformers' plain bidirectional mask function never gets here: attn_ext_mask answers
    it from the function alone.) Only its plain causal mask function (or the bidirectional
    one for one query row), with no window and offsets that are Python ints aligning the
    queries bottom-right on the keys (no cache, or a cache without a tensor offset), gives the
    2-D padding mask; anything else keeps transformers' 4-D mask, which the attention
    function runs on the kernel for one query row (decoding) and otherwise hands to SDPA."""
    if mask_function is not causal_mask_function and mask_function is not bidirectional_mask_function:
        return full
    if local_size is not None or not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return full
    if kv_offset != 0:  # a sliding window's full static layer: eager returns absolute positions
        return full
    n = kv_length if attention_mask is None else min(kv_length, attention_mask.shape[1])
    if n < q_length or q_offset != n - q_length:
        return full
    if attention_mask is None:
        pad = torch.ones(batch_size, n, dtype=torch.bool, device=full.device)
    else:
        pad = attention_mask[:, :n].to(torch.bool)
    return _padding_or_none(attention_mask, pad, q_length)


def _padding_or_none(attention_mask, pad, q_length):
    """The builder's answer once the mask is the kernel's causal pattern over ``pad (B, n)``.

    No mask where there is no padding and no past keys precede several queries (or one query,
    which sees every key): the attention function then applies the layer's causal pattern and
    window itself, as before any mask existed (models that slice a non-None mask as 4-D, such
    as Gemma 4's shared KV layers, keep working); a missing mask with more keys than queries
    (q_len > 1) would be read as an empty static cache's prefill, so a chunk after cached keys
    keeps them through the all-True padding mask."""
    if attention_mask is None and (pad.shape[1] == q_length or q_length == 1):
        return None
    return pad


def _key_row_mask(batch_size, kv_length, kv_offset, attention_mask, device):
    """transformers' bidirectional mask as one row per sequence, ``(B, 1, 1, kv_length)``
    boolean: key ``j`` (absolute position ``kv_offset + j``) is seen where the 2-D padding
    mask says so, and not past its end (unfilled cache slots), as sdpa_mask pads it."""
    if attention_mask is None:
        return torch.ones(batch_size, 1, 1, kv_length, dtype=torch.bool, device=device)
    pad = attention_mask.to(torch.bool)
    short = kv_offset + kv_length - pad.shape[1]
    if short > 0:
        pad = torch.nn.functional.pad(pad, (0, short))
    return pad[:, None, None, kv_offset: kv_offset + kv_length]


def register(name: str = NAME) -> None:
    """Register :func:`attention_forward` (and the SDPA mask builder) under ``name``.

    Done once with ``"attn_ext"`` when this module is imported."""
    AttentionInterface.register(name, attention_forward)
    # Without a mask builder registered under the same name transformers would pass no mask
    # at all (and silently ignore padding); ours gives None for plain causal, the 2-D
    # padding mask when that is all there is, and the full mask (-> SDPA fallback) otherwise.
    AttentionMaskInterface.register(name, attn_ext_mask)


register()
