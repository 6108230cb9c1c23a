"""Small models built from attn_ext modules, used by the demo and the tests."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor, nn

from .position_bias import RelativePositionBias
from .modules import (
    KVCache,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TransformerBlock,
)

POSITIONAL = ("none", "learned", "sinusoidal", "rope", "relative", "alibi")


class TinyGPT(nn.Module):
    """A tiny decoder-only Transformer (pre-LN blocks, tied-free LM head).

    Args:
        vocab_size, d_model, num_heads, num_layers, d_ff: sizes.
        max_len: table size of learned positions (and the initial RoPE cache length).
        pos: positional information: "none", "learned" (absolute, cannot extrapolate past
            ``max_len``), "sinusoidal" (added to the embeddings, computed on the fly) or
            "rope" (rotates q and k in every layer), "relative" (a learnable bias b_{i-j} per
            head and layer, :class:`attn_ext.RelativePositionBias` with one entry per distance
            up to ``rel_max_distance``, default ``max_len``; farther distances share the last)
            or "alibi" (ALiBi's fixed linear penalty -slope_h * |i - j|).
        causal: False makes it a bidirectional encoder (used by the demo's reversal task).
        num_kv_heads: grouped-query attention.

    ``forward(idx (B, S) int64, caches=None) -> logits (B, S, vocab)``; with ``caches`` (from
    :meth:`new_caches`) the tokens continue the cached sequence (incremental decoding).
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 128,
        num_heads: int = 4,
        num_layers: int = 2,
        max_len: int = 256,
        pos: str = "rope",
        causal: bool = True,
        d_ff: Optional[int] = None,
        num_kv_heads: Optional[int] = None,
        dropout: float = 0.0,
        rel_max_distance: Optional[int] = None,
    ):
        super().__init__()
        if pos not in POSITIONAL:
            raise ValueError(f"pos must be one of {POSITIONAL}, got {pos!r}")
        self.pos = pos
        self.max_len = max_len
        self.tok = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        self.learned = LearnedPositionalEmbedding(max_len, d_model) if pos == "learned" else None
        self.sinusoidal = SinusoidalPositionalEncoding(d_model) if pos == "sinusoidal" else None
        head_dim = d_model // num_heads
        self.blocks = nn.ModuleList(
            [
                TransformerBlock(
                    d_model, num_heads, d_ff=d_ff, num_kv_heads=num_kv_heads, causal=causal,
                    dropout=dropout,
                    rotary=RotaryEmbedding(head_dim, max_seq_len=max_len) if pos == "rope" else None,
                    rel_bias=RelativePositionBias(num_heads, rel_max_distance or max_len,
                                                  bidirectional=not causal)
                    if pos == "relative" else None,
                    alibi=pos == "alibi",
                )
                for _ in range(num_layers)
            ]
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def new_caches(self, batch: int, max_len: int) -> List[KVCache]:
        return [blk.attn.new_kv_cache(batch, max_len) for blk in self.blocks]

    def forward(self, idx: Tensor, caches: Optional[List[KVCache]] = None) -> Tensor:
        offset = 0 if caches is None else caches[0].length
        x = self.tok(idx)
        if self.learned is not None:
            x = self.learned(x, offset)
        if self.sinusoidal is not None:
            x = self.sinusoidal(x, offset)
        for i, blk in enumerate(self.blocks):
            x = blk(x, None if caches is None else caches[i])
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int) -> Tensor:
        """Greedy decoding with a KV cache: one forward over the prompt, then one token per step."""
        B, S = idx.shape
        caches = self.new_caches(B, S + max_new_tokens)
        logits = self(idx, caches)
        out = [idx]
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(max_new_tokens):
            out.append(nxt)
            if len(out) - 1 == max_new_tokens:
                break
            logits = self(nxt, caches)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
        return torch.cat(out, dim=1)
