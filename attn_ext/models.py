"""Small models built from attn_ext modules, used by the demo and the tests."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor, nn

from .modules import (
    KVCache,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TransformerBlock,
)

POSITIONAL = ("none", "learned", "sinusoidal", "rope")


class TinyGPT(nn.Module):
    """A tiny decoder-only Transformer (pre-LN blocks, tied-free LM head).

    Args:
        vocab_size, d_model, num_heads, num_layers, d_ff: sizes.
        max_len: table size of learned positions (and the initial RoPE cache length).
        pos: positional information: "none", "learned" (absolute, cannot extrapolate past
            ``max_len``), "sinusoidal" (added to the embeddings, computed on the fly) or
            "rope" (rotates q and k in every layer).
        causal: False makes it a bidirectional encoder (used by the demo's reversal task).
        num_kv_heads: grouped-query attention.
        context_parallel_group, context_parallel_layout: run every layer's attention as
            ring attention over this process group (see :mod:`attn_ext.distributed`): ``idx``
            is then this rank's shard of each sequence (``shard_sequence(idx, 1, group,
            layout)``), positions (RoPE, learned, sinusoidal) are the global ones, and the
            logits are this rank's rows. Gradients of the (replicated) parameters are partial
            per rank: sum them over the group (or wrap in DDP over it and scale the loss).

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
        context_parallel_group=None,
        context_parallel_layout: str = "zigzag",
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
                )
                for _ in range(num_layers)
            ]
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.context_parallel_group = context_parallel_group
        self.context_parallel_layout = context_parallel_layout
        if context_parallel_group is not None:
            for blk in self.blocks:
                blk.attn.set_context_parallel(context_parallel_group, context_parallel_layout)

    @torch.jit.unused
    def _context_parallel_positions(self, idx: Tensor, has_caches: bool) -> Tensor:
        from .distributed import shard_positions

        if has_caches:
            raise NotImplementedError("context-parallel TinyGPT does not decode with KV caches")
        return shard_positions(idx.size(1), self.context_parallel_group,
                               self.context_parallel_layout, idx.device)

    def new_caches(self, batch: int, max_len: int) -> List[KVCache]:
        return [blk.attn.new_kv_cache(batch, max_len) for blk in self.blocks]

    def forward(self, idx: Tensor, caches: Optional[List[KVCache]] = None) -> Tensor:
        offset = 0 if caches is None else caches[0].length
        positions: Optional[Tensor] = None
        if self.context_parallel_group is not None:
            positions = self._context_parallel_positions(idx, caches is not None)
        x = self.tok(idx)
        if self.learned is not None:
            x = self.learned(x, offset, positions)
        if self.sinusoidal is not None:
            x = self.sinusoidal(x, offset, positions)
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
