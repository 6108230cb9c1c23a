"""Small models built from attn_ext modules, used by the demo and the tests."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor, nn

from .ops import ArgumentTypeError, _is_int
from .position_bias import RelativePositionBias
from .modules import (
    KVCache,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TransformerBlock,
    _has_real_memory,
)

POSITIONAL = ("none", "learned", "sinusoidal", "rope", "relative", "alibi")


def left_padding(attention_mask: Tensor) -> Tensor:
    """``(B,)`` number of leading padding tokens of each row of a left-padded
    ``attention_mask (B, S)`` (1 = real token); raises unless every row is 0...0 1...1."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must have shape (B, S), got {list(attention_mask.shape)}")
    m = attention_mask.to(torch.bool)
    start = m.size(1) - m.sum(1)
    slots = torch.arange(m.size(1), device=m.device)
    # (a check of the values: eager only, since under torch.compile a data-dependent raise
    # would break the graph, and fullgraph=True refuses graph breaks)
    if not torch.compiler.is_compiling() and not torch.equal(m, slots[None, :] >= start[:, None]):
        raise ValueError("attention_mask must be left-padded: each row 0...0 1...1")
    return start


def _check_caches(caches) -> None:
    """TinyGPT.forward's caches: None or one KVCache per layer (a tuple of (k, v) pairs, or of
    None, failed on .length, naming neither), one per layer. Eager only (TorchScript checks the
    types; under torch.compile only the types are checked)."""
    if caches is None:
        return
    if not isinstance(caches, (list, tuple)) or not all(isinstance(c, KVCache) for c in caches):
        got = (type(caches).__name__ if not isinstance(caches, (list, tuple)) else
               f"{type(caches).__name__} of {sorted({type(c).__name__ for c in caches})}")
        raise ArgumentTypeError(f"caches must be a list of attn_ext.KVCache, one per layer "
                                f"(model.new_caches(batch, max_len)), or None, got {got}")
    if torch.compiler.is_compiling():
        # (the identity and memory checks below: eager only. Under torch.compile, id(c) made
        # dynamo guard on each KVCache object, so a compiled generate, which makes fresh
        # caches per call, recompiled on every call and hit the recompile limit)
        return
    seen = {}
    starts = {}
    for i, c in enumerate(caches):
        if id(c) in seen:
            # (one cache for two layers took both layers' keys: wrong logits, no error)
            raise ValueError(f"caches must hold a separate KVCache per layer: caches[{seen[id(c)]}] "
                             f"and caches[{i}] are the same object")
        seen[id(c)] = i
        for name, t in (("k", c.k), ("v", c.v)):
            # (two caches built on the same tensors: the same wrong logits)
            if not _has_real_memory(t):
                continue
            at = starts.setdefault(t.data_ptr(), (i, name))
            if at[0] != i:
                raise ValueError(f"caches must hold a separate KVCache per layer: caches[{at[0]}].{at[1]} "
                                 f"and caches[{i}].{name} start at the same memory")


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
        dropout: the blocks' attention and residual dropout (:class:`TransformerBlock`).
        num_kv_heads: grouped-query attention.
        context_parallel_group, context_parallel_layout: run every layer's attention as
            ring attention over this process group (see :mod:`attn_ext.distributed`): ``idx``
            is then this rank's shard of each sequence (``shard_sequence(idx, 1, group,
            layout)``), positions (RoPE, learned, sinusoidal) are the global ones, and the
            logits are this rank's rows. Gradients of the (replicated) parameters are partial
            per rank: sum them over the group (or wrap in DDP over it and scale the loss).

    ``forward(idx (B, S) int64, caches=None, attention_mask=None) -> logits (B, S, vocab)``;
    with ``caches`` (from :meth:`new_caches`) the tokens continue the cached sequence
    (incremental decoding). ``attention_mask (B, S)`` (1 = real token, 0 = padding, the
    Hugging Face convention) describes a left-padded batch: padding keys are masked out and
    positions count from each row's first real token. :meth:`generate` takes the same mask
    and gives every row the tokens it gives alone.
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
        rel_max_distance: Optional[int] = None,
    ):
        super().__init__()
        if pos not in POSITIONAL:
            raise ValueError(f"pos must be one of {POSITIONAL}, got {pos!r}")
        for name, size in (("vocab_size", vocab_size), ("d_model", d_model),
                           ("num_heads", num_heads), ("num_layers", num_layers),
                           ("max_len", max_len)):
            if not _is_int(size) or size <= 0:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        if rel_max_distance is not None and (not _is_int(rel_max_distance) or rel_max_distance <= 0):
            # (0 used to mean max_len silently)
            raise ValueError(f"rel_max_distance must be a positive int (or None: max_len), got "
                             f"{rel_max_distance!r}")
        if d_model % num_heads:  # (the rotary tables would be built for a truncated head dim)
            raise ValueError(f"d_model must be divisible by num_heads, got d_model={d_model}, "
                             f"num_heads={num_heads}")
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
        from .distributed import LAYOUTS
        if context_parallel_layout not in LAYOUTS:  # with or without a group
            raise ValueError(f"context_parallel_layout must be one of {LAYOUTS}, got "
                             f"{context_parallel_layout!r}")
        self.context_parallel_group = context_parallel_group
        self.context_parallel_layout = context_parallel_layout
        if context_parallel_group is not None:
            for blk in self.blocks:
                blk.attn.set_context_parallel(context_parallel_group, context_parallel_layout)

    @torch.jit.unused
    def _context_parallel_checked(self, idx: Tensor, has_caches: bool,
                                  has_attention_mask: bool) -> Tensor:
        """The global positions of this rank's tokens after the context-parallel checks; a
        failed check goes to _context_parallel_deferred."""
        try:
            return self._context_parallel_positions(idx, has_caches, has_attention_mask)
        except Exception as e:  # noqa: BLE001  (raised by the first layer on every rank)
            self._context_parallel_deferred(idx, e)
            raise

    @torch.jit.unused
    def _context_parallel_deferred(self, idx, error: BaseException) -> None:
        """This rank's context-parallel checks failed: hand the error to the first layer's
        checks, which raise it on every rank, and go there as the other ranks do (the token
        embedding and the first block, whose hooks may gather parameters: FSDP), on stand-in
        tokens. (Raising here at once would leave the other ranks waiting in the first ring,
        and joining its agreement here could meet their FSDP gathers instead.)"""
        from .distributed import _raise_at_first_attention

        if len(self.blocks) == 0:
            raise error
        # stand-in tokens of the caller's (B, S) where it has one (a hook's collective may
        # depend on the shape), through every module the other ranks run before the first
        # attention (the token and position embeddings, the first block)
        B, S = (idx.shape[0], idx.shape[1]) if isinstance(idx, torch.Tensor) and idx.dim() == 2 \
            else (1, 2)
        dev = self.tok.weight.device
        x = self.tok(torch.zeros(B, S, dtype=torch.long, device=dev))
        zeros = torch.zeros(S, dtype=torch.long, device=dev)  # (valid for any max_len)

        def run(x=x):
            if self.learned is not None:
                x = self.learned(x, 0, zeros)
            if self.sinusoidal is not None:
                x = self.sinusoidal(x, 0, zeros)
            for blk in self.blocks:
                x = blk(x)

        _raise_at_first_attention(error, run)

    @torch.jit.unused
    def _context_parallel_positions(self, idx: Tensor, has_caches: bool,
                                    has_attention_mask: bool = False) -> Tensor:
        from .distributed import _rank_world, shard_positions

        if has_caches:
            raise NotImplementedError("context-parallel TinyGPT does not decode with KV caches")
        if has_attention_mask:
            raise NotImplementedError("context-parallel TinyGPT does not take an attention_mask "
                                      "(its left-padded per-row positions are not sharded; pass key_padding_mask shards "
                                      "to MultiHeadAttention.set_context_parallel layers instead)")
        # idx as the embedding takes it (it would fail there on this rank alone)
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"idx must be a (B, S) tensor of token ids, got {type(idx).__name__}")
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be a (B, S) int64 / int32 tensor of token ids, got "
                             f"{idx.dtype} of shape {list(idx.shape)}")
        if idx.device != self.tok.weight.device:
            raise ValueError(f"idx must be on the model's device {self.tok.weight.device}, got "
                             f"{idx.device}")
        if idx.device.type == "cpu" and idx.numel() > 0:
            # (on CPU, where reading the values costs no device sync)
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.tok.num_embeddings:
                raise ValueError(f"idx holds token ids in [{lo}, {hi}], outside the vocabulary "
                                 f"[0, {self.tok.num_embeddings})")
        if self.learned is not None:
            # checked here, alike on every rank (the same S_local everywhere): the embedding of a
            # rank whose global positions pass max_len would raise alone and leave the other
            # ranks waiting in the first ring
            _, world = _rank_world(self.context_parallel_group)
            if world * idx.size(1) > self.max_len:
                raise ValueError(
                    f"learned positions: the global sequence ({world} ranks x {idx.size(1)} "
                    f"tokens) must be at most max_len = {self.max_len}")
        return shard_positions(idx.size(1), self.context_parallel_group,
                               self.context_parallel_layout, idx.device)

    @torch.jit.export
    def new_caches(self, batch: int, max_len: int,
                   dtype: Optional[torch.dtype] = None) -> List[KVCache]:
        """One empty :class:`KVCache` per layer, in ``dtype`` (default: the weights'), exported
        to TorchScript; a cache crosses the Python / TorchScript boundary by copy: see
        :class:`KVCache`."""
        caches: List[KVCache] = []
        for blk in self.blocks:
            caches.append(blk.attn.new_kv_cache(batch, max_len, dtype))
        return caches

    def forward(self, idx: Tensor, caches: Optional[List[KVCache]] = None,
                attention_mask: Optional[Tensor] = None, logits_to_keep: int = 0) -> Tensor:
        """Logits ``(B, S, vocab)``; with ``logits_to_keep = n > 0`` those of the last n
        positions only, ``(B, n, vocab)`` (Hugging Face's argument: :meth:`generate` keeps 1,
        so a long prompt's other rows skip the vocabulary projection)."""
        if logits_to_keep < 0:
            raise ValueError("logits_to_keep must be >= 0 (0 keeps every position), got "
                             + str(logits_to_keep))
        h = self._features(idx, caches, attention_mask)
        if logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        return self.head(h)

    def _features(self, idx: Tensor, caches: Optional[List[KVCache]],
                  attention_mask: Optional[Tensor]) -> Tensor:
        """forward's final hidden states (B, S, d_model), before the vocabulary projection
        (forward keeps the last logits_to_keep positions of them)."""
        positions: Optional[Tensor] = None
        if self.context_parallel_group is not None:
            # first: a failed check is raised by the first layer, on every rank together
            positions = self._context_parallel_checked(idx, caches is not None,
                                                       attention_mask is not None)
        if attention_mask is not None and (attention_mask.dim() != 2
                                           or attention_mask.size(0) != idx.size(0)
                                           or attention_mask.size(1) != idx.size(1)):
            # (with caches a longer or shorter mask used to be read as the prompt's: wrong
            # tokens, no error)
            raise ValueError(f"attention_mask must have idx's shape (B, S) = {list(idx.shape)}, "
                             f"got {list(attention_mask.shape)}")
        if not torch.jit.is_scripting():
            _check_caches(caches)
        if caches is not None and len(caches) != len(self.blocks):  # (an IndexError before)
            raise ValueError(f"caches must hold one KVCache per layer ({len(self.blocks)}), got "
                             f"{len(caches)}")
        offset = 0 if caches is None else caches[0].length
        key_padding_mask: Optional[Tensor] = None
        if caches is not None:  # (None with context parallelism: refused above)
            if attention_mask is not None:
                if offset != 0:
                    raise ValueError("attention_mask is only for the first (prefill) call with caches")
                start = left_padding(attention_mask)
                for c in caches:
                    c.set_left_padding(start)
            positions = caches[0].positions(idx.size(1))  # the blocks read the caches' masks
        elif attention_mask is not None:
            start = left_padding(attention_mask)
            slots = torch.arange(idx.size(1), device=idx.device)
            positions = (slots[None, :] - start[:, None]).clamp(min=0)
            key_padding_mask = attention_mask.to(torch.bool)
        x = self.tok(idx)
        if self.learned is not None:
            x = self.learned(x, offset, positions)
        if self.sinusoidal is not None:
            x = self.sinusoidal(x, offset, positions)
        for i, blk in enumerate(self.blocks):
            if caches is None:
                x = blk(x, None, key_padding_mask)
            else:
                x = blk(x, caches[i])
        return self.ln_f(x)

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int,
                 attention_mask: Optional[Tensor] = None) -> Tensor:
        """Greedy decoding with a KV cache: one forward over the prompt, then one token per step.

        ``attention_mask (B, S)``: a left-padded batch of prompts (1 = real token); each row
        continues as it would alone. Under ``torch.autocast`` the caches take the autocast
        dtype (the keys and values the layers compute there), except for a float64 model,
        which autocast leaves in float64."""
        if not isinstance(idx, Tensor) or idx.dim() != 2:
            got = f"shape {list(idx.shape)}" if isinstance(idx, Tensor) else type(idx).__name__
            raise ValueError(f"generate: idx must be a (B, S) tensor of token ids, got {got}")
        if isinstance(max_new_tokens, bool) or not _is_int(max_new_tokens):
            raise ArgumentTypeError(f"generate: max_new_tokens must be an int, got "
                                    f"{type(max_new_tokens).__name__} {max_new_tokens!r}")
        B, S = idx.shape
        if S == 0:
            raise ValueError("generate: idx must hold a prompt of at least one token per row, got "
                             f"shape {list(idx.shape)}")
        if max_new_tokens < 0:  # (it used to fail as "KVCache is full")
            raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        if self.learned is not None and S + max_new_tokens - 1 > self.max_len:
            # (the last new token is not fed back; the step past max_len used to fail in the
            # position embedding after the steps before it had run)
            raise ValueError(
                f"generate: learned positions reach max_len = {self.max_len}: a prompt of {S} "
                f"tokens takes at most {self.max_len - S + 1} new tokens, got max_new_tokens = "
                f"{max_new_tokens}")
        dev = self.head.weight.device.type
        # (autocast leaves float64 layers in float64, and so the caches)
        autocast = torch.is_autocast_enabled(dev) and self.head.weight.dtype != torch.float64
        dtype = torch.get_autocast_dtype(dev) if autocast else None
        caches = self.new_caches(B, S + max_new_tokens, dtype)
        # only the last position's logits are read: the prompt's other S - 1 rows skip the
        # vocabulary projection (a (B, S, vocab) tensor for a long prompt). Every step is a
        # call of the model (self(...)): its hooks, FSDP's unsharding and a compiled forward
        # take part.
        logits = self(idx, caches, attention_mask, logits_to_keep=1)
        out = [idx]
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(max_new_tokens):
            out.append(nxt)
            if len(out) - 1 == max_new_tokens:
                break
            logits = self(nxt, caches, logits_to_keep=1)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
        return torch.cat(out, dim=1)
