"""``nn.Module`` layers built on ``torch.ops.attn_ext``: multi-head attention without reshape
copies, a preallocated KV cache, positional-encoding modules and a Transformer block.

Every module here is written so that ``torch.jit.script`` works (type annotations, ops called
as ``torch.ops.attn_ext.*``), as well as ``torch.compile`` and ``torch.export``.

The hot path of :class:`MultiHeadAttention` makes no copy of q, k, v or the output:

    x (B, S, d_model) --qkv Linear--> (B, S, (H + Hkv) * D + Hkv * Dv)
        q = [..., :H*D].view(B, S, H, D)            strided views of the projection,
        k = [..., H*D:(H+Hkv)*D].view(B, S, Hkv, D)   read in place by the kernels
        v = [..., (H+Hkv)*D:].view(B, S, Hkv, Dv)
    RoPE rotates q and k in place (inference) or into new tensors (training: autograd)
    attention -> (B, S, H, Dv) contiguous -> .view(B, S, H*Dv) -> out Linear
"""

from __future__ import annotations

import math
import warnings
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ops import (ArgumentTypeError, ArgumentValueError, _attention_probs, _call_inplace_op, _call_op, _check_flag,
                  _check_offset,
                  _checked_dropout, _checked_softcap, _dropout_seed_offset, _is_int, _window_args,
                  rope_inv_freq)
from .position_bias import RelativePositionBias, alibi_slopes

__all__ = [
    "KVCache",
    "RotaryEmbedding",
    "MultiHeadAttention",
    "SinusoidalPositionalEncoding",
    "LearnedPositionalEmbedding",
    "TransformerBlock",
]


def _has_real_memory(t: Tensor) -> bool:
    """Whether t is a real tensor with elements in memory: not meta / fake, not traced by
    torch.compile or export (none has data pointers), not empty. The memory checks below (and
    models._check_caches) read data pointers only of such tensors."""
    return (not torch.compiler.is_compiling() and type(t) is torch.Tensor
            and t.device.type != "meta" and t.numel() > 0)


def _real_same_start(k: Tensor, v: Tensor) -> bool:
    """Whether k and v are real tensors (_has_real_memory) that start at the same memory."""
    return _has_real_memory(k) and _has_real_memory(v) and k.data_ptr() == v.data_ptr()


def _row_spans(t: Tensor):
    """Byte ranges [start, start + length) that t's elements occupy: dims that nest exactly
    (stride = the next dim's size x stride) merged first, then one span per row of the last
    dim where it is contiguous (else one per element); None past 2^24 spans."""
    sizes: List[int] = []
    strides: List[int] = []
    for n, st in zip(t.shape, t.stride()):
        if n == 1:
            continue
        if sizes and strides[-1] == n * st:  # (the previous dim steps over this one whole)
            sizes[-1] *= n
            strides[-1] = st
        else:
            sizes.append(n)
            strides.append(st)
    if not sizes:
        sizes, strides = [1], [1]
    contiguous = strides[-1] == 1
    dims = len(sizes) - 1 if contiguous else len(sizes)
    rows = 1
    for d in range(dims):
        rows *= sizes[d]
    if rows > (1 << 24):
        return None
    item = t.element_size()
    offsets = torch.zeros((), dtype=torch.int64)
    for d in range(dims):
        offsets = offsets.unsqueeze(-1) + torch.arange(sizes[d], dtype=torch.int64) * (strides[d] * item)
    length = sizes[-1] * item if contiguous else item
    return offsets.reshape(-1) + t.data_ptr(), length


def _real_buffers_overlap(k: Tensor, v: Tensor) -> bool:
    """Whether real tensors k and v (_has_real_memory) share a byte of memory, element by
    element: a fused buffer's interleaved k / v halves (kv[:, :, 0], kv[:, :, 1]) do not."""
    if not (_has_real_memory(k) and _has_real_memory(v)):
        return False
    if any(s < 0 for s in k.stride()) or any(s < 0 for s in v.stride()):
        return False

    def extent(t: Tensor):
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (k0, k1), (v0, v1) = extent(k), extent(v)
    if k1 <= v0 or v1 <= k0:
        return False
    ks, vs = _row_spans(k), _row_spans(v)
    if ks is None or vs is None:  # (too many rows to list: the interleaved check is skipped)
        return False
    starts = torch.cat([ks[0], vs[0]])
    ends = torch.cat([ks[0] + ks[1], vs[0] + vs[1]])
    is_v = torch.cat([torch.zeros(ks[0].numel(), dtype=torch.bool),
                      torch.ones(vs[0].numel(), dtype=torch.bool)])
    order = torch.argsort(starts, stable=True)
    starts, ends, is_v = starts[order], ends[order], is_v[order]
    # a span overlaps the other buffer's iff it starts before the farthest end of that buffer's
    # spans that start no later than it (sorted by start)
    none = torch.full_like(ends, torch.iinfo(torch.int64).min)
    end_k = torch.cummax(torch.where(is_v, none, ends), 0).values
    end_v = torch.cummax(torch.where(is_v, ends, none), 0).values
    prev_k = torch.cat([none[:1], end_k[:-1]])
    prev_v = torch.cat([none[:1], end_v[:-1]])
    return bool(((is_v & (starts < prev_k)) | (~is_v & (starts < prev_v))).any())


class KVCache:
    """Preallocated keys and values of one attention layer for incremental decoding.

    ``k``: ``(B, max_len, Hkv, D)``, ``v``: ``(B, max_len, Hkv, Dv)``; ``length`` slots are
    filled. :meth:`update` appends new keys/values and returns views of the filled part, which
    the attention kernels read through strides (no copy beyond writing the new tokens).
    Make one with :meth:`MultiHeadAttention.new_kv_cache`.

    Per-row lengths (a batch of prompts of different lengths, prefilled and decoded together):
    call :meth:`set_left_padding` with each row's number of padding slots before the first
    update. Row ``b``'s tokens then occupy slots ``[start[b], length)``: the padding slots
    are masked out of attention (:meth:`key_padding_mask`) and the tokens' positions
    (:meth:`positions`) count from the row's first real token.

    TorchScript: a KVCache passed between Python and a ``torch.jit.script``-ed module is
    copied at the boundary (TorchScript classes are), so a scripted layer called from Python
    writes the new keys / values into the cache's tensors but the Python object's ``length``
    does not advance. Run the decoding loop inside TorchScript (a scripted method that owns
    its caches), or set ``cache.length += s`` after each scripted call; a left-padded batch's
    ``start`` does not come back either: call ``cache.set_left_padding(...)`` on the Python
    caches before the scripted prefill (a scripted model's own ``set_left_padding`` call sets
    only its copies).
    """

    def __init__(self, k: Tensor, v: Tensor):
        # (update() checks the new tokens against k / v: a mismatch here used to surface there,
        # blaming v_new)
        if k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"k and v must have 4 dims (B, max_len, Hkv, D) / (B, max_len, Hkv, Dv), "
                             f"got k {list(k.shape)}, v {list(v.shape)}")
        if v.size(0) != k.size(0) or v.size(1) != k.size(1) or v.size(2) != k.size(2):
            raise ValueError(f"v must have k's B, max_len and Hkv ({k.size(0)}, {k.size(1)}, "
                             f"{k.size(2)}), got k {list(k.shape)}, v {list(v.shape)}")
        if not k.is_floating_point() or v.dtype != k.dtype or v.device != k.device:
            raise ValueError(f"k and v must be floating-point tensors of one dtype and device, got "
                             f"k {k.dtype} on {k.device}, v {v.dtype} on {v.device}")
        if not torch.jit.is_scripting():  # (TorchScript has no data_ptr)
            if _real_same_start(k, v):
                # (KVCache(buf, buf): update() wrote the values over the keys)
                raise ValueError("k and v must be separate buffers (they start at the same memory)")
            if _real_buffers_overlap(k, v):
                # (only an identical start was refused: update() wrote values over keys)
                raise ValueError(f"k and v must not overlap in memory (update() would write the "
                                 f"values over the keys), got k {list(k.shape)} at strides "
                                 f"{list(k.stride())} and v {list(v.shape)} at strides "
                                 f"{list(v.stride())} sharing memory")
        self.k = k
        self.v = v
        self.length = 0
        self.start = torch.jit.annotate(Optional[Tensor], None)  # (B,) int64 first real slot per row

    def set_left_padding(self, start: Tensor) -> None:
        """``start (B,)``: row ``b``'s first ``start[b]`` slots are padding (left padding)."""
        if self.length != 0:
            raise RuntimeError("KVCache.set_left_padding must come before the first update")
        if start.dim() != 1 or start.size(0) != self.k.size(0):
            raise ValueError(
                f"start must have shape (B,) = ({self.k.size(0)},), got {list(start.shape)}"
            )
        if start.is_floating_point() or start.is_complex() or start.dtype == torch.bool:
            raise ValueError(f"start must be an integer tensor (B,), got dtype {start.dtype}")
        start = start.to(device=self.k.device, dtype=torch.long)
        # (the range check reads values: eager only, as models.left_padding's, since under
        # torch.compile a data-dependent raise breaks the graph and fullgraph=True refuses it)
        if start.numel() > 0 and not torch.compiler.is_compiling():
            lo, hi = int(start.min().item()), int(start.max().item())
            if lo < 0 or hi > self.k.size(1):
                raise ValueError(
                    f"start must lie in [0, max_len = {self.k.size(1)}] (padding slots per row), "
                    f"got values in [{lo}, {hi}]")
        self.start = start

    def lengths(self) -> Tensor:
        """``(B,)`` number of real tokens of each row."""
        full = torch.full((self.k.size(0),), self.length, dtype=torch.long, device=self.k.device)
        start = self.start
        return full if start is None else full - start.clamp(max=self.length)

    def key_padding_mask(self) -> Optional[Tensor]:
        """``(B, length)`` bool, True at the real (non-padding) slots; None without padding."""
        start = self.start
        if start is None:
            return None
        slots = torch.arange(self.length, device=self.k.device)
        return slots[None, :] >= start[:, None]

    def positions(self, s: int) -> Optional[Tensor]:
        """``(B, s)`` int64 positions of the next ``s`` tokens (0 at each row's first real
        token; padding slots get 0); None without padding (positions are ``length + i``)."""
        start = self.start
        if start is None:
            return None
        slots = torch.arange(self.length, self.length + s, device=self.k.device)
        return (slots[None, :] - start[:, None]).clamp(min=0)

    def update(self, k_new: Tensor, v_new: Tensor) -> Tuple[Tensor, Tensor]:
        # exact shapes: copy_ would broadcast a batch or head dim of 1 silently
        kb, vb = self.k.shape, self.v.shape
        if k_new.dim() != 4 or k_new.size(0) != kb[0] or k_new.size(2) != kb[2] or k_new.size(3) != kb[3]:
            raise ValueError(
                f"k_new must have shape (B, s, Hkv, D) = ({kb[0]}, s, {kb[2]}, {kb[3]}) (the cache's), "
                f"got {list(k_new.shape)}")
        if (v_new.dim() != 4 or v_new.size(0) != vb[0] or v_new.size(1) != k_new.size(1)
                or v_new.size(2) != vb[2] or v_new.size(3) != vb[3]):
            raise ValueError(
                f"v_new must have shape (B, s, Hkv, Dv) = ({vb[0]}, {k_new.size(1)}, {vb[2]}, {vb[3]}) "
                f"(the cache's, s from k_new), got {list(v_new.shape)}")
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if not t.is_floating_point():
                raise ValueError(f"{name} must be a floating-point tensor (keys / values), got dtype {t.dtype}")
            if t.device != self.k.device:
                raise ValueError(f"{name} must be on the cache's device {self.k.device}, got {t.device}")
        s = k_new.size(1)
        end = self.length + s
        if end > self.k.size(1):
            raise RuntimeError(
                f"KVCache is full: {self.length} + {s} new tokens > max_len {self.k.size(1)}"
            )
        self.k[:, self.length : end].copy_(k_new)
        self.v[:, self.length : end].copy_(v_new)
        self.length = end
        return self.k[:, :end], self.v[:, :end]

    def reset(self) -> None:
        self.length = 0
        self.start = None


class _DerivedBuffers(nn.Module):
    """A module whose own buffers are derived (reset_buffers recomputes them exactly): a dtype
    change (.half(), .to(torch.bfloat16), ...) recomputes them at the new dtype, since a
    conversion rounds them, and a round trip such as .bfloat16().float() used to leave bf16's
    rounding in float32 rotary tables (2.4e-4 off) and ALiBi slopes."""

    def reset_buffers(self) -> None:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        before = [b.dtype for b in self.buffers(recurse=False)]
        super()._apply(fn, recurse)
        if [b.dtype for b in self.buffers(recurse=False)] != before:
            self.reset_buffers()
        return self


class RotaryEmbedding(_DerivedBuffers):
    """Rotary position embedding tables with a growable cos/sin cache.

    Args:
        rotary_dim: number of rotated channels per head (even, <= head dim).
        base, scaling: as in :func:`attn_ext.rope_cache` (linear / ntk / yarn / llama3).
        interleaved: pairing of channels (False: half-split, GPT-NeoX / HF LLaMA;
            True: ``2i, 2i+1``, GPT-J / RoFormer / Meta LLaMA).
        max_seq_len: initial cache length (the cache doubles when a longer sequence comes).
            For the length-dependent "ntk" / "dynamic" scaling it is also the length the base
            is set for, once: unlike Hugging Face's "dynamic" rotary embedding, which sets the
            base per call from the current length, tables that grow keep it. Pass the longest
            length you will run; at or below original_max_position_embeddings the tables are
            the unscaled ones (a warning says so).

    The frequencies are kept as a Python list of floats (not a buffer), so ``model.half()``
    cannot degrade them; tables are built in float64 and stored in float32.

    Calls never read tensor values on the host (no GPU synchronisation): with ``offset`` the
    tables grow to ``offset + S`` (eager; under torch.compile a call past them, and under
    torch.export every call, builds its rows [offset, offset + S) in the graph and leaves the
    tables as they are); with a ``positions`` tensor every position must be below
    the table length (``max_seq_len``, or what the tables grew to; ``tables(n)`` grows them
    to ``n``), checked by the op (an error on CPU, a device assert on CUDA).
    """

    def __init__(
        self,
        rotary_dim: int,
        base: float = 10000.0,
        interleaved: bool = False,
        scaling: Optional[dict] = None,
        max_seq_len: int = 2048,
    ):
        super().__init__()
        _check_flag(interleaved, "interleaved")
        interleaved = bool(interleaved)
        if not _is_int(max_seq_len) or max_seq_len < 0:  # ("x" failed on a comparison, 2.5 and
            # -5 were taken)
            raise ArgumentValueError(f"max_seq_len must be an int >= 0, got {max_seq_len!r}")
        max_seq_len = int(max_seq_len)
        inv_freq, attn_factor = rope_inv_freq(rotary_dim, base, scaling, max_seq_len)
        kind = None if scaling is None else scaling.get("type", scaling.get("rope_type"))
        if kind in ("ntk", "dynamic") and torch.equal(inv_freq, rope_inv_freq(rotary_dim, base)[0]):
            warnings.warn(
                f"RotaryEmbedding: {kind!r} scaling sets the base once, for max_seq_len = "
                f"{max_seq_len}, within original_max_position_embeddings: these tables are "
                f"unscaled at every length. Pass max_seq_len = the longest length to run (tables "
                f"that grow keep the base; there is no per-call rescaling)", stacklevel=2)
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        self.inv_freq: List[float] = [float(f) for f in inv_freq.tolist()]
        self.attention_factor = float(attn_factor)
        cos, sin = self._build(max(1, max_seq_len), torch.device("cpu"), torch.float32)
        self.built_in_float64 = False
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the cos / sin tables (non-persistent buffers: not in the state dict) where
        and as they are now: after ``to_empty()`` (a model built on the meta device) they hold
        uninitialised memory. :func:`attn_ext.reset_buffers` does it for a whole model."""
        self.cos, self.sin = self._build(self.cos.size(0), self.cos.device, self.cos.dtype)
        self.built_in_float64 = self.cos.dtype == torch.float64

    def _build(self, n: int, device: torch.device, dtype: torch.dtype,
               start: int = 0) -> Tuple[Tensor, Tensor]:
        # rows [start, start + n): arange(start, start + n) holds the same float64 integers
        # as rows start... of arange(N), so the rows are bitwise the cache's (eager, aot_eager,
        # export; inductor's float64 cos / sin may differ by an ulp, in the cache too)
        # torch.full per frequency, not torch.tensor(self.inv_freq, dtype=torch.float64):
        # TorchScript's torch.tensor(List[float]) rounds the values through float32 (torch
        # 2.13), which made a scripted model's tables differ from eager by 1e-4 at position
        # 10000 (test_deploy_torchscript checks they are bitwise equal)
        inv = torch.zeros(0, dtype=torch.float64, device=device)
        if len(self.inv_freq) > 0:
            inv = torch.cat([torch.full([1], f, dtype=torch.float64, device=device)
                             for f in self.inv_freq])
        angle = (torch.arange(start, start + n, dtype=torch.float64, device=device)[:, None]
                 * inv[None, :])
        cos = (torch.cos(angle) * self.attention_factor).to(dtype)
        sin = (torch.sin(angle) * self.attention_factor).to(dtype)
        return cos, sin

    def tables(self, seq_len: int, dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
        """``(cos, sin)`` covering positions ``[0, seq_len)``, growing the cache if needed.

        Tables are float32 (the kernels' math precision) for float32/float16/bfloat16
        inputs and float64 for float64 inputs."""
        want = torch.float64 if dtype == torch.float64 else torch.float32
        # (module.to(float64) would up-cast float32 tables: track what they were built in)
        stale = self.cos.dtype != want or (want == torch.float64) != self.built_in_float64
        if seq_len > self.cos.size(0) or stale:
            n = max(seq_len, self.cos.size(0) if stale else 2 * self.cos.size(0))
            cos, sin = self._build(n, self.cos.device, want)
            if not torch.jit.is_scripting():
                # (not while torch.compile traces: it cannot trace the mode query)
                if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
                    cos, sin = _outside_inference_mode(cos, sin)
            self.cos = cos
            self.sin = sin
            self.built_in_float64 = want == torch.float64
        return self.cos, self.sin

    def _tables_for(self, x: Tensor, offset: int,
                    positions: Optional[Tensor]) -> Tuple[Tensor, Tensor, int]:
        """``(cos, sin, off)``: tables and the op's offset for rotating ``x`` at ``offset``
        (or ``positions``).

        Sizes only: reading positions' values (positions.max().item()) would synchronise
        with the GPU on every call. With a positions tensor the tables cover at least
        max_seq_len (or what they have grown to) and the S rows of x; a position past them
        raises on CPU and device-asserts on CUDA (the op's range check), and
        tables(n) grows them ahead of time."""
        off = _op_offset(offset, positions)
        if not torch.jit.is_scripting():
            _check_offset(offset)  # (None failed on `offset + S`, naming nothing)
            if positions is None and (
                    torch.compiler.is_exporting()
                    or (torch.compiler.is_compiling() and offset + x.size(1) > self.cos.size(0))):
                # The rows [offset, offset + S) built in the graph (the same float64 ops as
                # _build), rotated at op offset 0:
                # - torch.export: growing the cache on the host would bound the exported
                #   sequence dim by the cache's length;
                # - torch.compile, past the cache: growing it in the graph gave the buffer a
                #   new static size, so every doubling recompiled (twice) until dynamo's
                #   recompile limit failed the call. Within the cache compiled calls read it.
                want = torch.float64 if x.dtype == torch.float64 else torch.float32
                cos, sin = self._build(x.size(1), self.cos.device, want, offset)
                return cos, sin, 0
        needed = offset + x.size(1) if positions is None else x.size(1)
        if not torch.jit.is_scripting():
            if not torch.compiler.is_compiling():  # (eager: a try block)
                cos, sin = self._tables_named(needed, x.dtype, offset)
                return cos, sin, off
        cos, sin = self.tables(needed, x.dtype)
        return cos, sin, off

    @torch.jit.unused
    def _tables_named(self, needed: int, dtype: torch.dtype, offset: int) -> Tuple[Tensor, Tensor]:
        """tables(needed) in eager mode, its allocation failure named: a huge offset failed in
        the allocator ("you tried to allocate 8000000000032 bytes"), naming neither offset nor
        the tables."""
        try:
            return self.tables(needed, dtype)
        except RuntimeError as e:
            # (torch.OutOfMemoryError and other subclasses keep their type: callers catch them)
            if type(e) is not RuntimeError or needed <= self.cos.size(0) or "alloc" not in str(e).lower():
                raise
            raise RuntimeError(
                f"RotaryEmbedding: positions up to offset + S = {needed} (offset = {offset}) "
                f"need cos / sin tables of {needed} rows x {self.cos.size(1)} frequencies, which "
                f"could not be allocated ({e})") from None

    def rotate(self, x: Tensor, offset: int = 0, positions: Optional[Tensor] = None) -> Tensor:
        """Rotate one ``(B, S, H, D)`` tensor ``x`` at positions ``offset + s`` (or the
        ``positions`` tensor, ``(S,)`` or ``(B, S)``, as :func:`attn_ext.rope`): in place when
        no gradient is needed."""
        cos, sin, off = self._tables_for(x, offset, positions)
        if _rope_out_of_place(x.requires_grad):
            return torch.ops.attn_ext.rope(x, cos, sin, positions, off, self.interleaved)
        if not torch.jit.is_scripting():  # (below the ops' Python Autograd kernels: _call_op)
            _call_inplace_op("rope_", x, cos, sin,
                             positions, off, self.interleaved)
            return x
        torch.ops.attn_ext.rope_(x, cos, sin, positions, off, self.interleaved)
        return x

    def forward(self, q: Tensor, k: Tensor, offset: int = 0,
                positions: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Rotate ``q (B, S, H, D)`` and ``k (B, S, Hkv, D)``: in place (one call, returns the
        same tensors) when no gradient is needed, else out of place (differentiable)."""
        cos, sin, off = self._tables_for(q, offset, positions)
        if _rope_out_of_place(q.requires_grad or k.requires_grad):
            q = torch.ops.attn_ext.rope(q, cos, sin, positions, off, self.interleaved)
            k = torch.ops.attn_ext.rope(k, cos, sin, positions, off, self.interleaved)
            return q, k
        if not torch.jit.is_scripting():
            _call_inplace_op("rope_qk_", q, k,
                             cos, sin, positions, off, self.interleaved)
            return q, k
        torch.ops.attn_ext.rope_qk_(q, k, cos, sin, positions, off, self.interleaved)
        return q, k


def _outside_inference_mode(*ts: Tensor) -> Tuple[Tensor, ...]:
    """Copies of ``ts`` that are normal tensors: a cache grown under torch.inference_mode
    would hold inference tensors, which a later forward that records a gradient cannot save
    for backward (eager only; not compiled by TorchScript)."""
    with torch.inference_mode(False):
        return tuple(t.clone() for t in ts)


def _rope_out_of_place(requires_grad: bool) -> bool:
    """Whether RotaryEmbedding rotates out of place: when a gradient is recorded; under
    torch.jit.trace (the trace checker reruns the module without grad, and both runs must
    record the same graph); and under torch.export, whose program keeps the branch taken while
    exporting (often under no_grad) and must also run where a gradient is recorded (the
    in-place op refuses inputs that require grad). torch.compile guards on grad mode, so it
    keeps the in-place op where it is safe. Under a torch.func transform too (vmap, grad):
    a mapped tensor says requires_grad=False while the tensors it wraps record a gradient."""
    if (torch.is_grad_enabled() and requires_grad) or torch.jit.is_tracing():
        return True
    if not torch.jit.is_scripting():
        return (torch.compiler.is_exporting()
                or torch._C._are_functorch_transforms_active())  # (dynamo reads this one)
    return False



def _check_cache_sizes(batch, max_len) -> None:
    """new_kv_cache's sizes: ints >= 0 (2.5 failed inside torch.empty naming nothing, True
    passed as 1, -1 as a "negative dimension")."""
    for name, n in (("batch", batch), ("max_len", max_len)):
        if isinstance(n, bool) or not _is_int(n):
            raise ArgumentTypeError(f"new_kv_cache: {name} must be an int, got "
                                    f"{type(n).__name__} {n!r}")
        if n < 0:
            raise ArgumentValueError(f"new_kv_cache: {name} must be >= 0, got {n}")


class MultiHeadAttention(_DerivedBuffers):
    """Multi-head (and grouped-query) attention that never copies q, k, v or the output.

    Args:
        d_model: model width.
        num_heads: query heads H.
        num_kv_heads: key/value heads Hkv (divides H; default H; 1 = multi-query).
        causal: bottom-right causal mask (see :func:`attn_ext.attention`). Default: True for
            self-attention, False over a memory (``cross_attention=True``, or a fused layer's
            ``forward(x, memory)``: every query sees the whole memory unless ``causal=True``
            was asked for).
        bias: biases in the projections.
        dropout: dropout on the attention probabilities in training, inside the kernel (keep
            bits from a counter-based RNG seeded from torch's generator: no ``(S, S)`` buffer;
            ``torch.manual_seed`` reproduces a step).
        rel_bias: a :class:`attn_ext.RelativePositionBias` (the learnable ``b_{i-j}``, its
            gradient computed inside the attention backward), or None.
        alibi: add ALiBi's ``-slope_h * |i - j|`` (slopes of Press et al. for H heads).
        softcap: cap the scores at ``softcap * tanh(s / softcap)`` (Gemma 2), or None.
        rotary: None, a rotary dim (int), or a :class:`RotaryEmbedding`.
        qk_dim, v_dim: per-head dims D and Dv (``qk_dim`` defaults to ``d_model // num_heads``,
            ``v_dim`` to ``qk_dim``).
        cross_attention: queries from ``x``, keys/values from ``memory`` (separate q and kv
            projections instead of one fused QKV projection).
        kv_dim: width of ``memory`` for cross-attention (default ``d_model``).
        window: ``(left, right)`` sliding window (see :func:`attn_ext.attention`); with
            ``causal`` the usual local attention is ``(W - 1, 0)``.

    With a ``kv_cache``, self-attention appends each step's keys/values to it. Cross-attention
    fills the cache with the memory's keys/values once, on the first call (which must pass
    ``memory``); later steps pass ``memory=None`` and read them back without projecting the
    memory again (``kv_cache.reset()`` for a new memory). Cross-attention with a ``kv_cache``
    refuses every term that reads the queries' positions (``rotary``, ``alibi``, ``rel_bias``,
    ``window``, ``causal``): the cache cannot tell them, and each step's Sq would move them.

    ``forward(x, memory=None, kv_cache=None, need_weights=False, key_padding_mask=None)``
    (``key_padding_mask (B, Sk)`` bool, True = the key takes part; with a left-padded
    :class:`KVCache` the cache's own mask and positions are used) returns
    ``(out (B, Sq, d_model), weights)`` where ``weights`` is the ``(B, H, Sq, Sk)`` attention
    probabilities when ``need_weights`` (computed from q, k and the kernel's log-sum-exp,
    so the fast path does not pay for it) and None otherwise.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        causal: Optional[bool] = None,
        bias: bool = True,
        dropout: float = 0.0,
        rotary=None,
        qk_dim: Optional[int] = None,
        v_dim: Optional[int] = None,
        cross_attention: bool = False,
        kv_dim: Optional[int] = None,
        window: Optional[Tuple[int, int]] = None,
        rel_bias: Optional[RelativePositionBias] = None,
        alibi: bool = False,
        softcap: Optional[float] = None,
    ):
        super().__init__()
        # flags and sizes by type (a string such as cross_attention="no" used to be truthy)
        for name, flag in (("causal", causal), ("cross_attention", cross_attention),
                           ("alibi", alibi), ("bias", bias)):
            if flag is not None:
                _check_flag(flag, name)
        # (Python bools from here on: TorchScript types the attributes)
        causal = None if causal is None else bool(causal)
        cross_attention, alibi, bias = bool(cross_attention), bool(alibi), bool(bias)
        for name, size in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                           ("d_model", d_model), ("qk_dim", qk_dim), ("v_dim", v_dim),
                           ("kv_dim", kv_dim)):
            # (values <= 0: below, except kv_dim's)
            if size is not None and (not _is_int(size) or (name == "kv_dim" and size <= 0)):
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        # over a memory (forward(x, memory)) a layer is causal only when asked: a decoder's
        # memory is not in its future (causal=None: True for self-attention, False over memory)
        self.memory_causal = bool(causal) if causal is not None else False
        if causal is None:
            causal = not cross_attention
        self.window_left, self.window_right = _window_args(window)
        for name, size in (("num_heads", num_heads), ("d_model", d_model)):
            if size <= 0:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        hkv = num_kv_heads if num_kv_heads is not None else num_heads
        if hkv <= 0 or num_heads % hkv:
            raise ValueError(f"num_kv_heads must divide num_heads, got num_heads={num_heads}, num_kv_heads={hkv}")
        if qk_dim is None and d_model % num_heads:
            raise ValueError(f"d_model must be divisible by num_heads (or give qk_dim), got "
                             f"d_model={d_model}, num_heads={num_heads}")
        d = qk_dim if qk_dim is not None else d_model // num_heads
        dv = v_dim if v_dim is not None else d
        if d <= 0 or dv <= 0:
            raise ValueError(f"head dims must be positive, got qk_dim={d}, v_dim={dv}")
        self.num_heads = num_heads
        self.num_kv_heads = hkv
        self.head_dim = d
        self.v_dim = dv
        self.causal = causal
        self.dropout = _checked_dropout(dropout, "dropout")
        self.scale = 1.0 / math.sqrt(d)
        self.cross_attention = cross_attention
        self.q_size = num_heads * d
        self.k_size = hkv * d
        self.v_size = hkv * dv
        if kv_dim is not None and not cross_attention:
            raise ValueError(f"kv_dim (the memory's width) is for cross_attention=True layers; a "
                             f"fused layer reads memory of width d_model, got kv_dim={kv_dim}")
        if cross_attention:
            self.qkv = None
            self.q_proj = nn.Linear(d_model, self.q_size, bias=bias)
            self.kv_proj = nn.Linear(kv_dim or d_model, self.k_size + self.v_size, bias=bias)
        else:
            self.qkv = nn.Linear(d_model, self.q_size + self.k_size + self.v_size, bias=bias)
            self.q_proj = None
            self.kv_proj = None
        self.out_proj = nn.Linear(num_heads * dv, d_model, bias=bias)
        if isinstance(rotary, int) and not isinstance(rotary, bool):
            rotary = RotaryEmbedding(rotary)
        if rotary is not None and not isinstance(rotary, RotaryEmbedding):
            raise TypeError(f"rotary must be None, an int rotary_dim or a RotaryEmbedding, got {type(rotary).__name__}")
        if rotary is not None and rotary.rotary_dim > d:
            raise ValueError(f"rotary_dim {rotary.rotary_dim} must be <= head dim {d}")
        self.rotary = rotary
        if rel_bias is not None and rel_bias.num_heads != num_heads:
            raise ValueError(f"rel_bias has {rel_bias.num_heads} heads, the layer {num_heads}")
        self.rel_bias = rel_bias
        self.softcap: Optional[float] = _checked_softcap(softcap)
        # float64: exact for .double() layers; every use casts it to the accumulation type
        self.register_buffer("alibi_slopes", alibi_slopes(num_heads, torch.float64) if alibi else None,
                             persistent=False)
        # Context parallelism (attn_ext.distributed): None, or the process group whose ranks
        # hold shards of the sequence; set with set_context_parallel.
        self.context_parallel_group = None
        self.context_parallel_layout = "zigzag"


    def set_context_parallel(self, group, layout: str = "zigzag") -> "MultiHeadAttention":
        """Run attention as :func:`attn_ext.distributed.ring_attention` over ``group`` (None
        switches it off): ``x`` is then this rank's shard (made by ``shard_sequence`` with
        ``layout``) and RoPE uses the global positions of its tokens. Returns self."""
        from .distributed import chunks_per_rank

        chunks_per_rank(layout)  # validates the layout
        self.context_parallel_group = group
        self.context_parallel_layout = layout
        return self

    def _check_forward_inputs(self, x: Tensor, memory: Optional[Tensor]) -> int:
        """forward's checks of x and memory; returns d_model (x's width)."""
        if x.dim() != 3:
            raise ValueError(f"x must have 3 dims (B, S, d_model), got shape {list(x.shape)}")
        if self.qkv is not None:
            d_in = self.qkv.weight.size(1)
        else:
            assert self.q_proj is not None
            d_in = self.q_proj.weight.size(1)
        if x.size(2) != d_in:
            raise ValueError(f"x must have d_model = {d_in} features, got shape {list(x.shape)}")
        if memory is not None:
            kv_in = self.kv_proj.weight.size(1) if self.kv_proj is not None else d_in
            if memory.dim() != 3 or memory.size(0) != x.size(0) or memory.size(2) != kv_in:
                raise ValueError(
                    f"memory must have shape (B, Sk, kv_dim) = ({x.size(0)}, Sk, {kv_in}) "
                    f"(B from x), got {list(memory.shape)}")
        return d_in

    @torch.jit.unused
    def _context_parallel_call(self, x, memory, kv_cache, need_weights):
        """A context-parallel forward's checks: (memory, kv_cache, need_weights, positions),
        or, when they fail on this rank (or a model deferred its own failed checks to this
        layer), the error raised on every rank of the group. They run before the layer calls
        any submodule, so the other ranks' next collective is the ring's agreement, which this
        rank joins as failed (they would otherwise wait in it until the collective timeout).
        Beyond the argument checks, x's dtype and device must be the weights' (outside
        autocast): a projection that fails on one rank alone would leave the others waiting."""
        from .distributed import _fail_together, _take_deferred_error

        try:
            deferred = _take_deferred_error()
            if deferred is not None:
                raise deferred
            memory, kv_cache, need_weights = _forward_args(memory, kv_cache, need_weights)
            if not isinstance(x, torch.Tensor):
                raise ArgumentTypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
            self._check_forward_inputs(x, memory)
            error = _dtype_device_error(x, self.out_proj.weight, "layer")
            if error is not None:
                raise error
            positions = self._context_parallel_positions(x, kv_cache, need_weights, memory)
        except Exception as e:  # noqa: BLE001  (whatever failed here, the other ranks raise too)
            ref = x if isinstance(x, torch.Tensor) else self.out_proj.weight
            _fail_together(e, ref, self.context_parallel_group)
            raise  # (_fail_together raises e; this line is for readers and linters)
        return memory, kv_cache, need_weights, positions

    @torch.jit.unused
    def _context_parallel_positions(self, x: Tensor, kv_cache: Optional[KVCache], need_weights: bool,
                                    memory: Optional[Tensor] = None) -> Tensor:
        from .distributed import _rank_world, shard_positions

        if kv_cache is not None or need_weights or self.cross_attention or memory is not None:
            raise NotImplementedError(
                "context-parallel MultiHeadAttention supports self-attention (with window, "
                "key_padding_mask (this rank's shard), rel_bias, alibi, softcap and attention "
                "dropout at global positions) without kv_cache or need_weights")
        positions = shard_positions(x.size(1), self.context_parallel_group,
                                    self.context_parallel_layout, x.device)
        if self.rotary is not None:
            # the global positions run up to world * S_local - 1 (not S_local - 1): grow the
            # tables to the global length, as a single-process call of that length does
            _, world = _rank_world(self.context_parallel_group)
            self.rotary.tables(world * x.size(1), x.dtype)
        return positions

    @torch.jit.unused
    def _ring_attend(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                     key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """Ring attention with the layer's window, score terms and dropout (global positions);
        ``key_padding_mask`` is this rank's shard ``(B, S_local)``."""
        from .distributed import ring_attention

        window = None
        if self.window_left != -1 or self.window_right != -1:
            window = (self.window_left, self.window_right)
        return ring_attention(q, k, v, group=self.context_parallel_group, causal=self.causal,
                              scale=self.scale, layout=self.context_parallel_layout,
                              window=window, key_padding_mask=key_padding_mask,
                              alibi_slopes=self.alibi_slopes,
                              rel_bias=self._rel_table(q.dtype), softcap=self.softcap,
                              dropout_p=dropout_p)

    @classmethod
    def from_linears(
        cls,
        q_proj: nn.Linear,
        k_proj: nn.Linear,
        v_proj: nn.Linear,
        o_proj: nn.Linear,
        num_heads: int,
        causal: Optional[bool] = None,
        num_kv_heads: Optional[int] = None,
        rotary=None,
    ) -> "MultiHeadAttention":
        """Build the fused layer from the textbook's four projections (as in
        ``reference.MultiHeadAttentionRef``): the QKV weight is ``cat([W_q, W_k, W_v])``.
        Head dims follow from the shapes; ``num_kv_heads`` defaults to what k_proj implies
        for the query head dim."""
        d_model = q_proj.in_features
        if not (k_proj.in_features == v_proj.in_features == d_model):
            raise ValueError("q_proj, k_proj and v_proj must read the same width (self-attention)")
        if q_proj.out_features % num_heads:
            raise ValueError(f"q_proj.out_features {q_proj.out_features} is not a multiple of num_heads {num_heads}")
        d = q_proj.out_features // num_heads
        hkv = num_kv_heads if num_kv_heads is not None else k_proj.out_features // d
        if hkv * d != k_proj.out_features or v_proj.out_features % hkv:
            raise ValueError(
                f"k_proj/v_proj widths ({k_proj.out_features}, {v_proj.out_features}) do not fit "
                f"{hkv} kv heads of dim {d}")
        dv = v_proj.out_features // hkv
        has_bias = [m.bias is not None for m in (q_proj, k_proj, v_proj, o_proj)]
        if any(has_bias) and not all(has_bias):
            raise ValueError("either all four projections have a bias or none does")
        layer = cls(d_model, num_heads, hkv, causal=causal, bias=all(has_bias), rotary=rotary,
                    qk_dim=d, v_dim=dv)
        w = q_proj.weight
        layer = layer.to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            assert layer.qkv is not None
            layer.qkv.weight.copy_(torch.cat([q_proj.weight, k_proj.weight, v_proj.weight]))
            layer.out_proj.weight.copy_(o_proj.weight)
            if all(has_bias):
                layer.qkv.bias.copy_(torch.cat([q_proj.bias, k_proj.bias, v_proj.bias]))
                layer.out_proj.bias.copy_(o_proj.bias)
        return layer

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, causal: bool = False) -> "MultiHeadAttention":
        """Build the layer from a ``torch.nn.MultiheadAttention`` (self-attention with equal
        q/k/v widths; its packed ``in_proj_weight`` is already our fused QKV layout). The
        result takes ``(B, S, E)`` input whatever the source's ``batch_first`` was.
        ``causal`` defaults to False: ``nn.MultiheadAttention`` attends to every key unless
        given a mask (pass ``causal=True`` for its ``is_causal`` / square subsequent mask)."""
        if not mha._qkv_same_embed_dim:
            raise ValueError("from_torch needs kdim == vdim == embed_dim (packed in_proj_weight)")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("from_torch does not support add_bias_kv or add_zero_attn")
        E, H = mha.embed_dim, mha.num_heads
        has_bias = mha.in_proj_bias is not None
        layer = cls(E, H, causal=causal, bias=has_bias, dropout=mha.dropout)
        w = mha.in_proj_weight
        layer = layer.to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            assert layer.qkv is not None
            layer.qkv.weight.copy_(mha.in_proj_weight)
            layer.out_proj.weight.copy_(mha.out_proj.weight)
            if has_bias:
                layer.qkv.bias.copy_(mha.in_proj_bias)
                layer.out_proj.bias.copy_(mha.out_proj.bias)
        return layer

    @torch.jit.export
    def new_kv_cache(self, batch: int, max_len: int, dtype: Optional[torch.dtype] = None,
                     device: Optional[torch.device] = None) -> KVCache:
        """An empty preallocated :class:`KVCache` for this layer: keys ``(batch, max_len,
        num_kv_heads, head_dim)`` and values ``(batch, max_len, num_kv_heads, v_dim)``, in
        ``dtype`` and on ``device`` (default: the weights').

        (Exported to TorchScript, so a scripted decoding loop can make its caches. A cache
        crosses the Python / TorchScript boundary by copy: see :class:`KVCache`.)"""
        if not torch.jit.is_scripting():
            _check_cache_sizes(batch, max_len)
        w = self.out_proj.weight
        dt = w.dtype if dtype is None else dtype
        dev = w.device if device is None else device
        k = torch.empty(batch, max_len, self.num_kv_heads, self.head_dim, dtype=dt, device=dev)
        v = torch.empty(batch, max_len, self.num_kv_heads, self.v_dim, dtype=dt, device=dev)
        return KVCache(k, v)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The attention call of the fast path: ``(B, Sq, H, Dv)`` contiguous. (Benchmarks and
        the demo swap it per instance to time the same model on other attention code.)"""
        if self.context_parallel_group is not None:
            return self._ring_attend(q, k, v)
        if not torch.jit.is_scripting():  # (below the op's Python Autograd kernel: _call_op)
            return _call_op(torch.ops.attn_ext.attention, q, k, v, self.causal, self.scale)
        return torch.ops.attn_ext.attention(q, k, v, self.causal, self.scale)

    def has_score_terms(self) -> bool:
        return self.rel_bias is not None or self.alibi_slopes is not None or self.softcap is not None

    def _rel_table(self, dtype: torch.dtype) -> Optional[Tensor]:
        rb = self.rel_bias
        if rb is None:
            return None
        want = torch.float64 if dtype == torch.float64 else torch.float32
        return rb().to(want).contiguous()

    def _attend_terms(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
                      dropout_p: float, causal: bool) -> Tuple[Tensor, Tensor]:
        """attention_forward with the layer's window, key padding, score terms and in-kernel
        dropout: (out, lse). ``causal``: the mask of this call (self.causal, or
        self.memory_causal over a memory)."""
        seed, offset = (0, 0)
        if dropout_p > 0.0:
            seed, offset = _dropout_seed_offset(q.device)
        slopes = self.alibi_slopes
        if slopes is not None:
            slopes = slopes.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        rel = self._rel_table(q.dtype)
        if not torch.jit.is_scripting():  # (below the op's Python Autograd kernel: _call_op)
            return _call_op(torch.ops.attn_ext.attention_forward, q, k, v, causal, self.scale,
                            self.window_left, self.window_right, key_padding_mask, slopes, rel,
                            self.softcap, None, dropout_p, seed, offset)
        return torch.ops.attn_ext.attention_forward(
            q, k, v, causal, self.scale, self.window_left, self.window_right,
            key_padding_mask, slopes, rel, self.softcap, None, dropout_p, seed, offset)

    def reset_buffers(self) -> None:
        """Recompute the ALiBi slopes (a non-persistent buffer) on the weights' device, in
        their dtype: after ``to_empty()`` they hold uninitialised memory. The rotary tables and the
        relative bias have their own (:func:`attn_ext.reset_buffers` reaches every module)."""
        if self.alibi_slopes is not None:
            # on the weights' device (after a meta-device init with load_state_dict(...,
            # assign=True) the buffer is still on meta), in the buffer's dtype
            self.alibi_slopes = alibi_slopes(self.num_heads, torch.float64).to(
                self.out_proj.weight.device, self.alibi_slopes.dtype)

    def forward(
        self,
        x: Tensor,
        memory: Optional[Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        need_weights: bool = False,
        key_padding_mask: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        cp_positions: Optional[Tensor] = None
        if not torch.jit.is_scripting():
            if self.context_parallel_group is not None:
                # a context-parallel layer: its checks and the global positions of this rank's
                # rows, before any submodule runs; a rank whose checks fail tells the others
                # (cross-attention, kv_cache and need_weights are refused whichever branch
                # below the layer would take)
                memory, kv_cache, need_weights, cp_positions = self._context_parallel_call(
                    x, memory, kv_cache, need_weights)
            else:
                memory, kv_cache, need_weights = _forward_args(memory, kv_cache, need_weights)
        d_in = self._check_forward_inputs(x, memory)
        B, Sq = x.size(0), x.size(1)
        H, Hkv, D, Dv = self.num_heads, self.num_kv_heads, self.head_dim, self.v_dim
        if self.context_parallel_group is not None and cp_positions is None:
            cp_positions = self._context_parallel_positions(x, kv_cache, need_weights, memory)
        fused_cross = self.qkv is not None and memory is not None
        if fused_cross:
            # a fused layer attending to memory (issue 6's forward(x, memory)): q from x and
            # k / v from memory through the row blocks of the one QKV weight (no copy)
            assert self.qkv is not None and memory is not None
            if kv_cache is not None:
                raise ValueError(
                    "kv_cache with memory needs a cross_attention=True layer (it keeps the "
                    "memory's keys/values once); a fused self-attention layer takes memory "
                    "without a cache")
            # (split, not slicing, here and below: the views are the same, but autograd turns
            # each slice into a zero-filled tensor of the whole width plus an add, and a split
            # into one cat of the parts' gradients)
            kv_size = self.k_size + self.v_size
            wq, wkv = self.qkv.weight.split([self.q_size, kv_size], 0)
            bq: Optional[Tensor] = None
            bkv: Optional[Tensor] = None
            if self.qkv.bias is not None:
                bq, bkv = self.qkv.bias.split([self.q_size, kv_size], 0)
            Sk = memory.size(1)
            q = F.linear(x, wq, bq).view(B, Sq, H, D)
            kv = F.linear(memory, wkv, bkv)  # (B, Sk, Hkv * (D + Dv))
            k_flat, v_flat = kv.split([self.k_size, self.v_size], -1)
            k = k_flat.view(B, Sk, Hkv, D)
            v = v_flat.view(B, Sk, Hkv, Dv)
        elif self.qkv is not None:
            qkv = self.qkv(x)  # (B, Sq, (H + Hkv) * D + Hkv * Dv)
            q_flat, k_flat, v_flat = qkv.split([self.q_size, self.k_size, self.v_size], -1)
            q = q_flat.view(B, Sq, H, D)
            k = k_flat.view(B, Sq, Hkv, D)
            v = v_flat.view(B, Sq, Hkv, Dv)
        else:
            assert self.q_proj is not None and self.kv_proj is not None
            q = self.q_proj(x).view(B, Sq, H, D)
            if kv_cache is not None:
                # Every term that reads the distance d = i + (Sk - Sq) - j: with the memory in
                # the cache, each call's Sq (the step's rows) would move the queries' positions,
                # so a cached decode would differ from the whole sequence's call (and from
                # another chunking of the same steps).
                by_position: List[str] = []
                if self.rotary is not None:
                    by_position.append("rotary")
                if self.alibi_slopes is not None:
                    by_position.append("alibi")
                if self.rel_bias is not None:
                    by_position.append("rel_bias")
                if self.window_left != -1 or self.window_right != -1:
                    by_position.append("window")
                if self.causal:
                    by_position.append("causal")
                if len(by_position) > 0:
                    raise ValueError(
                        f"cross-attention with both {' and '.join(by_position)} and kv_cache is "
                        f"not supported: the cache holds the memory, so it cannot tell the "
                        f"decoder position of the queries, which {' and '.join(by_position)} "
                        f"depend{'s' if len(by_position) == 1 else ''} on (the distance i + "
                        f"(Sk - Sq) - j would change with each call's Sq); call the layer "
                        f"without a cache")
            if kv_cache is not None and kv_cache.length > 0:
                # Later decoding steps: the memory's keys/values were computed on the first
                # call and live in the cache; nothing is projected or appended again.
                if memory is not None:
                    raise ValueError(
                        "cross-attention kv_cache already holds the memory's keys/values "
                        f"({kv_cache.length} positions, computed on the first call): pass "
                        "memory=None on later steps, or kv_cache.reset() for a new memory")
                k = kv_cache.k[:, : kv_cache.length]
                v = kv_cache.v[:, : kv_cache.length]
            else:
                if kv_cache is not None and memory is None:
                    raise ValueError(
                        "cross-attention with kv_cache: the first call must pass memory (its "
                        "keys/values are computed once and kept in the cache)")
                if memory is None:  # (it used to attend over x, or fail in kv_proj's matmul)
                    raise ValueError(
                        "a cross_attention=True layer needs memory (the keys'/values' source): "
                        "forward(x, memory)")
                src = memory
                Sk = src.size(1)
                kv = self.kv_proj(src)  # (B, Sk, Hkv * (D + Dv))
                k_flat, v_flat = kv.split([self.k_size, self.v_size], -1)
                k = k_flat.view(B, Sk, Hkv, D)
                v = v_flat.view(B, Sk, Hkv, Dv)
                if kv_cache is not None:
                    _check_step_mask(key_padding_mask, B, Sk)
                    k, v = kv_cache.update(k, v)  # the memory, stored once

        rotary = self.rotary
        if self.qkv is not None and not fused_cross:
            past = 0 if kv_cache is None else kv_cache.length
            # per-row positions of a left-padded cache (None: positions past + i)
            positions = None if kv_cache is None else kv_cache.positions(Sq)
            if self.context_parallel_group is not None:
                positions = cp_positions
            if rotary is not None:
                if positions is not None and kv_cache is not None and self.context_parallel_group is None:
                    # a left-padded cache's positions are below past + Sq (known here without
                    # reading them): grow the tables to that, as the offset path does
                    rotary.tables(past + Sq, q.dtype)
                q, k = rotary(q, k, past if positions is None else 0, positions)
            if kv_cache is not None:
                _check_step_mask(key_padding_mask, B, past + Sq)
                k, v = kv_cache.update(k, v)  # (B, past + Sq, Hkv, D) views of the cache
        elif rotary is not None:
            # cross-attention without a cache: query i and key j at the library's distance
            # d = i + (Sk - Sq) - j (DESIGN.md; the masks and the score terms use the same d, and
            # so does reference.MultiHeadAttentionRef), i.e. q from Sk - Sq and k from 0, or
            # equivalently (RoPE sees only differences) q from 0 and k from Sq - Sk when Sq > Sk
            Sk = k.size(1)
            if torch.jit.is_tracing():
                # torch.jit.trace keeps sizes symbolic only inside tensor ops (max(shift, 0)
                # would be baked in for the traced Sq - Sk): q from Sk and k from Sq, the same
                # distances with both starts >= 0 for any lengths, as position tensors
                rotary.tables(Sq + Sk, q.dtype)
                q = rotary.rotate(q, 0, torch.arange(Sq, device=q.device) + Sk)
                k = rotary.rotate(k, 0, torch.arange(Sk, device=k.device) + Sq)
            else:
                shift = Sk - Sq
                q = rotary.rotate(q, max(shift, 0))
                k = rotary.rotate(k, max(-shift, 0))
        out_dtype = q.dtype
        if kv_cache is not None and q.dtype != k.dtype:
            # the cache's dtype governs (e.g. a float32 cache under bfloat16 autocast, whose
            # Linear gives bfloat16 q): this step's Sq query rows are cast, not the cache
            q = q.to(k.dtype)
        if kv_cache is not None:
            cache_mask = kv_cache.key_padding_mask()
            if cache_mask is not None:
                key_padding_mask = cache_mask if key_padding_mask is None else key_padding_mask & cache_mask
        masked = key_padding_mask is not None or self.window_left != -1 or self.window_right != -1

        weights: Optional[Tensor] = None
        dropout_p = self.dropout if self.training else 0.0
        # a fused layer over a memory: causal only when asked (self.memory_causal)
        causal = self.memory_causal if fused_cross else self.causal
        if need_weights:
            # (weights are the undropped probabilities)
            out, lse = self._attend_terms(q, k, v, key_padding_mask, dropout_p, causal)
            weights = _attention_probs(q, k, causal, self.scale, lse, self.alibi_slopes,
                                       self._rel_table(q.dtype), self.softcap, self.window_left,
                                       self.window_right, key_padding_mask)
        elif self.context_parallel_group is not None:
            out = self._ring_attend(q, k, v, dropout_p, key_padding_mask)
        elif masked or dropout_p > 0.0 or self.has_score_terms() or causal != self.causal:
            out = self._attend_terms(q, k, v, key_padding_mask, dropout_p, causal)[0]
        else:
            out = self._attend(q, k, v)
        if out.dtype != out_dtype:
            out = out.to(out_dtype)
        # out: (B, Sq, H, Dv) contiguous -> (B, Sq, H * Dv) for free
        return self.out_proj(out.view(B, Sq, H * Dv)), weights


def _dtype_device_error(x: Tensor, w: Tensor, owner: str) -> Optional[Exception]:
    """The error a context-parallel layer's or block's x would raise in its first submodule
    (the projection, ln1) for another device or dtype than its weight ``w``, or None. Under
    autocast the float types it casts (float32 / float16 / bfloat16) pass; it leaves float64
    and integers as they are."""
    if x.device != w.device:
        return ValueError(f"x must be on the {owner}'s device {w.device}, got {x.device}")
    if x.dtype == w.dtype:
        return None
    # (the autocast query refuses device types without autocast: meta)
    autocast_takes = (x.dtype in (torch.float32, torch.float16, torch.bfloat16)
                      and x.device.type in ("cpu", "cuda", "xpu", "mps", "hpu")
                      and torch.is_autocast_enabled(x.device.type))
    if not autocast_takes:
        return ValueError(f"x must have the {owner}'s dtype {w.dtype} (or a float type autocast "
                          f"casts), got {x.dtype}")
    return None


def _forward_args(memory, kv_cache, need_weights):
    """MultiHeadAttention.forward's eager reading of its arguments: issue 6 also spells
    forward(x, kv_cache=None, need_weights=False), so a KVCache in memory's place, or a bool in
    kv_cache's, is read in that order (TorchScript checks the types). Returns (memory,
    kv_cache, need_weights)."""
    if isinstance(memory, KVCache):
        if isinstance(kv_cache, bool):
            need_weights = need_weights or kv_cache
        elif kv_cache is not None:
            raise ValueError("kv_cache given twice (positionally in memory's place and by "
                             "keyword)")
        memory, kv_cache = None, memory
    elif isinstance(kv_cache, bool):
        kv_cache, need_weights = None, need_weights or kv_cache
    _check_flag(need_weights, "need_weights")  # ("yes" / "no" both returned weights)
    if kv_cache is not None and not isinstance(kv_cache, KVCache):
        # (a Hugging Face-style (k, v) tuple failed on .length, naming neither)
        raise ArgumentTypeError(
            f"kv_cache must be an attn_ext.KVCache (layer.new_kv_cache(batch, max_len)) or "
            f"None, got {type(kv_cache).__name__}")
    return memory, kv_cache, need_weights


def _check_step_mask(key_padding_mask: Optional[Tensor], B: int, Sk: int) -> None:
    """A key_padding_mask beside a kv_cache, checked before the cache is written: a step that
    fails after its keys were appended would leave them there (a retry then attends to them
    twice), and a (B, 1) mask would broadcast against a left-padded cache's own mask."""
    if key_padding_mask is None:
        return
    m = key_padding_mask
    if m.dtype != torch.bool or m.dim() != 2 or m.size(0) != B or m.size(1) != Sk:
        raise ValueError(
            f"key_padding_mask must be bool (B, Sk) = ({B}, {Sk}) with a kv_cache (Sk: the "
            f"cached keys and this step's), got dtype {m.dtype}, shape {list(m.shape)}")


def _op_offset(offset: int, positions: Optional[Tensor]) -> int:
    """The modules' rule: a positions tensor replaces offset (left-padded caches pass both);
    the ops themselves refuse a nonzero offset beside positions."""
    return offset if positions is None else 0


class SinusoidalPositionalEncoding(nn.Module):
    """``dropout(x + PE)`` with the sinusoidal encoding computed on the fly: no table, no
    maximum length. ``forward(x, offset=0, positions=None)`` for ``x (B, S, d_model)``."""

    def __init__(self, d_model: int, dropout: float = 0.0, base: float = 10000.0):
        super().__init__()
        self.d_model = d_model
        self.base = float(base)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, offset: int = 0, positions: Optional[Tensor] = None) -> Tensor:
        if x.size(-1) != self.d_model:
            raise ValueError(f"x must have d_model = {self.d_model} features in its last dim, got "
                             f"shape {list(x.shape)}")
        off = _op_offset(offset, positions)
        if not torch.jit.is_scripting():  # (below the op's Python Autograd kernel: _call_op)
            return self.dropout(_call_op(torch.ops.attn_ext.sinusoidal_pe, x, positions, off,
                                         self.base))
        return self.dropout(torch.ops.attn_ext.sinusoidal_pe(x, positions, off, self.base))


class LearnedPositionalEmbedding(nn.Module):
    """``x + E[pos]`` with a learned ``(max_len, d_model)`` table (GPT-2 / BERT style).

    Learned absolute positions cannot extrapolate: a position >= ``max_len`` has no row, and
    asking for one is a clear error (the textbook's point)."""

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        self.max_len = max_len
        self.embedding = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, x: Tensor, offset: int = 0, positions: Optional[Tensor] = None) -> Tensor:
        d_model = self.embedding.weight.size(1)
        if x.dim() != 3 or x.size(-1) != d_model:
            raise ValueError(f"LearnedPositionalEmbedding: x must have shape (B, S, d_model) with "
                             f"d_model = {d_model}, got shape {list(x.shape)}")
        if positions is not None:
            if positions.dtype != torch.int64 and positions.dtype != torch.int32:
                raise ValueError(f"LearnedPositionalEmbedding: positions must be int64 (or int32), "
                                 f"got {positions.dtype}")
            if positions.device != x.device:
                raise ValueError(f"LearnedPositionalEmbedding: positions must be on x's device "
                                 f"{x.device}, got {positions.device}")
            B, S = x.size(0), x.size(1)
            ok = ((positions.dim() == 1 and positions.size(0) == S) or
                  (positions.dim() == 2 and positions.size(0) == B and positions.size(1) == S))
            if not ok:
                raise ValueError(f"LearnedPositionalEmbedding: positions must have shape (S,) = "
                                 f"({S},) or (B, S) = ({B}, {S}) for x of shape {list(x.shape)}, "
                                 f"got shape {list(positions.shape)}")
        if positions is None:
            end = offset + x.size(1)
            if offset < 0 or end > self.max_len:
                raise ValueError(
                    f"LearnedPositionalEmbedding: positions [{offset}, {end}) exceed max_len "
                    f"{self.max_len}; learned absolute positions cannot extrapolate"
                )
            positions = torch.arange(offset, end, device=x.device)
        elif (positions.numel() > 0 and not torch.compiler.is_compiling()
              and (int(positions.max().item()) >= self.max_len
                   or int(positions.min().item()) < 0)):
            # (a check of the values: eager only, as left_padding's; under torch.compile /
            # torch.export a data-dependent raise breaks the graph, and the lookup itself
            # refuses an index past the table)
            raise ValueError(
                f"LearnedPositionalEmbedding: positions must be in [0, {self.max_len}); learned "
                "absolute positions cannot extrapolate"
            )
        return x + self.embedding(positions).to(x.dtype)


class TransformerBlock(nn.Module):
    """Multi-head attention + residual + LayerNorm + position-wise feed-forward.

    ``norm_first=True`` is pre-LN (GPT-2 and later: ``x + attn(LN(x))``, ``x + ff(LN(x))``);
    False is the original post-LN of Vaswani et al. (``LN(x + attn(x))``, ``LN(x + ff(x))``).
    ``forward(x, kv_cache=None, key_padding_mask=None) -> (B, S, d_model)``.

    Args:
        d_model, num_heads, num_kv_heads, causal, rotary, bias, rel_bias, alibi, softcap,
            window: the attention's (:class:`MultiHeadAttention`; ``bias`` also for the
            feed-forward's two Linears).
        d_ff: the feed-forward's hidden width (default ``4 * d_model``), GELU between.
        dropout: the attention's in-kernel dropout and the residual branches' dropout.
        norm_first: pre-LN (True) or post-LN (False), above.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: Optional[int] = None,
        num_kv_heads: Optional[int] = None,
        causal: bool = True,
        dropout: float = 0.0,
        rotary=None,
        norm_first: bool = True,
        bias: bool = True,
        rel_bias: Optional[RelativePositionBias] = None,
        alibi: bool = False,
        softcap: Optional[float] = None,
        window: Optional[Tuple[int, int]] = None,
    ):
        super().__init__()
        if d_ff is not None and (not _is_int(d_ff) or d_ff <= 0):
            raise ValueError(f"d_ff must be a positive int (or None: 4 * d_model), got {d_ff!r}")
        d_ff = d_ff if d_ff is not None else 4 * d_model
        _check_flag(norm_first, "norm_first")  # ("no" used to build a pre-LN block)
        self.norm_first = bool(norm_first)
        self.attn = MultiHeadAttention(d_model, num_heads, num_kv_heads, causal=causal, bias=bias,
                                       dropout=dropout, rotary=rotary, window=window,
                                       rel_bias=rel_bias, alibi=alibi, softcap=softcap)
        self.ln1 = nn.LayerNorm(d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff, bias=bias), nn.GELU(),
                                nn.Linear(d_ff, d_model, bias=bias))
        self.drop = nn.Dropout(dropout)

    @torch.jit.unused
    def _context_parallel_input_error(self, x) -> Optional[Exception]:
        """The error this rank's x would raise in the block before its attention's ring (in
        ln1: the wrong width; in the projection: another dtype or device), or None."""
        w = self.ln1.weight
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.size(-1) != w.size(0):
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            return ValueError(f"x must have shape (B, S, d_model = {w.size(0)}), got {got}")
        return _dtype_device_error(x, w, "block")

    @torch.jit.unused
    def _context_parallel_deferred(self, x, error: Exception, kv_cache, key_padding_mask) -> Tensor:
        """This rank's x failed the block's checks: the block runs on a stand-in x, as the
        other ranks run theirs (ln1 and its hooks), to its attention's checks, which raise the
        error on every rank (distributed._raise_at_first_attention)."""
        from .distributed import _raise_at_first_attention

        w = self.ln1.weight
        # (the caller's (B, S) where x has them: a hook's collective may depend on the shape)
        B, S = (x.shape[0], x.shape[1]) if isinstance(x, torch.Tensor) and x.dim() == 3 else (1, 2)
        stand_in = torch.zeros(B, S, w.size(0), dtype=w.dtype, device=w.device)
        _raise_at_first_attention(
            error, lambda: TransformerBlock.forward(self, stand_in, kv_cache, key_padding_mask))
        raise error  # (not reached)

    def forward(self, x: Tensor, kv_cache: Optional[KVCache] = None,
                key_padding_mask: Optional[Tensor] = None) -> Tensor:
        if not torch.jit.is_scripting():
            if self.attn.context_parallel_group is not None:
                error = self._context_parallel_input_error(x)
                if error is not None:
                    return self._context_parallel_deferred(x, error, kv_cache, key_padding_mask)
        if self.norm_first:
            x = x + self.drop(self.attn(self.ln1(x), None, kv_cache, False, key_padding_mask)[0])
            x = x + self.drop(self.ff(self.ln2(x)))
        else:
            x = self.ln1(x + self.drop(self.attn(x, None, kv_cache, False, key_padding_mask)[0]))
            x = self.ln2(x + self.drop(self.ff(x)))
        return x


def reset_buffers(model: nn.Module) -> nn.Module:
    """Recompute the derived, non-persistent buffers of every attn_ext module in ``model``
    (rotary cos / sin tables, ALiBi slopes, the relative bias's index) on their current device
    and dtype, and return ``model``. They are not in the state dict, so a model built on the
    meta device and materialised with ``to_empty()`` (FSDP2's recommended initialisation) holds
    uninitialised memory there until this runs, whether or not a state dict is loaded::

        with torch.device("meta"):
            model = TinyGPT(...)
        model.to_empty(device="cuda")
        attn_ext.reset_buffers(model)
        model.load_state_dict(state)
    """
    for m in model.modules():
        if isinstance(m, (RotaryEmbedding, MultiHeadAttention, RelativePositionBias)):
            m.reset_buffers()
    return model

