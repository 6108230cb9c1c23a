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

- Causal (or bidirectional) attention without padding — prefill, and cached decoding with
  ``DynamicCache`` — runs on the kernel. For those cases transformers' mask builder (the
  same one ``"sdpa"`` uses) passes ``attention_mask=None``.
- Any explicit attention mask (padding in a batch, chunked prefill on a filled cache,
  sliding windows once the window is exceeded, custom 4-D masks, and every mask built under
  ``torch.export``) falls back to transformers' own SDPA implementation, with a one-time
  warning. Results stay correct; only the kernel differs.
- ``dropout > 0`` (training with attention dropout), ``softcap`` and attention sinks
  (``s_aux``) raise ``ValueError``: the kernel has none of them.
- ``output_attentions=True`` returns ``None`` weights, as with ``"sdpa"``.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

import attn_ext  # noqa: F401  (registers torch.ops.attn_ext.*)

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["NAME", "attention_forward", "register"]

NAME = "attn_ext"

_warned_fallback = False


def _bshd(x: torch.Tensor) -> torch.Tensor:
    # (B, H, S, D) -> (B, S, H, D) view; the kernel only needs a contiguous last dim.
    x = x.transpose(1, 2)
    return x if x.stride(-1) == 1 or x.size(-1) <= 1 else x.contiguous()


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
) -> Tuple[torch.Tensor, None]:
    """transformers attention function backed by ``torch.ops.attn_ext.attention``.

    ``query (B, H, Sq, D)``, ``key (B, Hkv, Sk, D)``, ``value (B, Hkv, Sk, Dv)`` ->
    ``(out (B, Sq, H, Dv), None)``. See the module docstring for what falls back.
    """
    if dropout != 0.0:
        raise ValueError(
            f"attn_implementation='attn_ext' supports dropout=0 only, got dropout={dropout} "
            "(set config.attention_dropout=0, or call model.eval())"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("attn_implementation='attn_ext' does not support softcap")
    if kwargs.get("s_aux") is not None:
        raise ValueError("attn_implementation='attn_ext' does not support attention sinks (s_aux)")

    if attention_mask is not None:
        global _warned_fallback
        if not _warned_fallback:
            _warned_fallback = True
            warnings.warn(
                "attn_ext: an explicit attention mask (padding, chunked prefill, sliding window "
                "or a custom mask) was given; these calls fall back to transformers' SDPA "
                "attention. Only mask-free causal/bidirectional attention runs on attn_ext.",
                stacklevel=2,
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask,
            dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs,
        )

    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    q_len, kv_len = query.shape[2], key.shape[2]
    if is_causal and q_len > 1 and kv_len > q_len:
        # transformers only omits the mask here for the prefill of an empty static cache,
        # whose keys past q_len are unfilled slots: its is_causal is top-left aligned, ours
        # bottom-right, so keep just the filled keys (then the two agree).
        key = key[:, :, :q_len]
        value = value[:, :, :q_len]
    # A single query row sees every key under our bottom-right causal mask anyway.
    causal = bool(is_causal) and q_len > 1
    out = torch.ops.attn_ext.attention(_bshd(query), _bshd(key), _bshd(value), causal, scaling)
    return out, None  # out: (B, Sq, H, Dv) contiguous


def register(name: str = NAME) -> None:
    """Register :func:`attention_forward` (and the SDPA mask builder) under ``name``.

    Done once with ``"attn_ext"`` when this module is imported."""
    AttentionInterface.register(name, attention_forward)
    # Without a mask builder registered under the same name transformers would pass no mask
    # at all (and silently ignore padding); the SDPA builder gives None exactly when the
    # pattern is plain causal, and a real mask (-> fallback above) otherwise.
    AttentionMaskInterface.register(name, sdpa_mask)


register()
