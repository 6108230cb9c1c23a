"""Thin functional wrappers over ``torch.ops.attn_ext``, plus the fake (meta) kernels and
autograd formulas that make the ops work under torch.compile, torch.export and autograd.

Schemas live in ``csrc/ops.cpp``; semantics in ``shared/DESIGN.md``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

_lib = torch.ops.attn_ext

# ---------------------------------------------------------------------------------------
# sinusoidal positional encoding
# ---------------------------------------------------------------------------------------


def sinusoidal_pe(
    x: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    offset: int = 0,
    base: float = 10000.0,
) -> torch.Tensor:
    """Return ``x + PE`` with the sinusoidal encoding of Vaswani et al. computed on the fly.

    ``PE(pos, 2i) = sin(pos / base**(2i/D))``, ``PE(pos, 2i+1) = cos(pos / base**(2i/D))``.

    Args:
        x: ``(B, S, D)`` or ``(S, D)``, float32/float64/float16/bfloat16, any strides.
            Any ``D`` works; for odd ``D`` the last column is a sin.
        positions: optional int64 ``(S,)`` or ``(B, S)`` position of each row. Without it
            row ``s`` is at position ``offset + s`` (e.g. the next tokens of a KV cache).
        offset: position of the first row when ``positions`` is not given.
        base: the wavelength base (10000 in the paper).

    Returns a new contiguous tensor of ``x``'s shape and dtype. Differentiable in ``x``
    (the gradient passes through unchanged).
    """
    return _lib.sinusoidal_pe(x, positions, offset, base)


def sinusoidal_pe_(
    x: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    offset: int = 0,
    base: float = 10000.0,
) -> torch.Tensor:
    """In-place :func:`sinusoidal_pe`: adds the encoding into ``x`` and returns ``x``.

    ``x``'s last dim must be contiguous. Not differentiable (use the out-of-place op in
    training)."""
    _lib.sinusoidal_pe_(x, positions, offset, base)
    return x


def sinusoidal_table(
    seq_len: int,
    dim: int,
    base: float = 10000.0,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """The ``(seq_len, dim)`` sinusoidal encoding matrix (for inspection and plots),
    produced by the same kernel as :func:`sinusoidal_pe` applied to zeros."""
    if seq_len < 0 or dim < 0:
        raise ValueError(f"seq_len and dim must be >= 0, got seq_len={seq_len}, dim={dim}")
    zeros = torch.zeros(seq_len, dim, dtype=dtype or torch.get_default_dtype(), device=device)
    return sinusoidal_pe_(zeros, None, 0, base)


@torch.library.register_fake("attn_ext::sinusoidal_pe")
def _sinusoidal_pe_fake(x, positions=None, offset=0, base=10000.0):
    torch._check(x.dim() in (2, 3), lambda: f"x must have 3 dims (B, S, D) or 2 dims (S, D), got shape {list(x.shape)}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("attn_ext::sinusoidal_pe_")
def _sinusoidal_pe_inplace_fake(x, positions=None, offset=0, base=10000.0):
    return None


def _sinusoidal_pe_setup(ctx, inputs, output):
    pass


def _sinusoidal_pe_backward(ctx, grad):
    # d(x + PE)/dx = I; positions, offset and base get no gradient.
    return grad, None, None, None


torch.library.register_autograd(
    "attn_ext::sinusoidal_pe", _sinusoidal_pe_backward, setup_context=_sinusoidal_pe_setup
)


# ---------------------------------------------------------------------------------------
# scaled dot-product attention
# ---------------------------------------------------------------------------------------


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """``softmax(scale * q k^T [+ causal mask]) v`` without any ``(Sq, Sk)`` buffer.

    Args:
        q: ``(B, Sq, H, D)`` queries, or ``(B, Sq, D)`` for a single head.
        k: ``(B, Sk, Hkv, D)`` keys (``(B, Sk, D)`` with 3-D q). ``Hkv`` must divide ``H``:
            query head ``h`` reads kv head ``h // (H // Hkv)`` (GQA; ``Hkv = 1`` is MQA).
        v: ``(B, Sk, Hkv, Dv)`` values (``(B, Sk, Dv)`` with 3-D q); ``Dv`` may differ from ``D``.
            q, k, v may have any strides on their leading dims (views of a packed QKV
            projection, ``x.transpose(1, 2)`` of a ``(B, H, S, D)`` tensor) but their last
            dim must be contiguous. dtypes: float32, float64, float16, bfloat16 (all three
            the same); fp16/bf16 accumulate in fp32.
        causal: mask the future, aligned to the bottom-right corner: row ``i`` sees key
            ``j`` iff ``j <= i + (Sk - Sq)``. For ``Sq == Sk`` this is the usual lower
            triangle; for ``Sq < Sk`` (decoding with a KV cache) the last query row sees
            every key. Example, ``Sq = 3, Sk = 5`` (``x`` = seen)::

                      keys  0 1 2 3 4
                query 0     x x x . .
                query 1     x x x x .
                query 2     x x x x x

            Note: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``
            aligns the mask top-left instead; the two agree only when ``Sq == Sk``.
            With ``Sq > Sk`` the first ``Sq - Sk`` rows see no key: their output is 0 and
            their lse ``-inf`` (never NaN).
        scale: score scale, default ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp of each score row.

    Returns ``out (B, Sq, H, Dv)`` (contiguous, q's dtype; ``(B, Sq, Dv)`` for 3-D input), and
    with ``return_lse`` also ``lse (B, H, Sq)`` (``(B, Sq)`` for 3-D input), float32 — float64
    for float64 inputs. Differentiable in q, k, v through ``out``; the gradient of ``lse`` is
    not propagated (treated as zero).
    """
    squeeze = q.dim() == 3
    if squeeze:
        if k.dim() != 3 or v.dim() != 3:
            raise ValueError(
                "with 3-D q (B, Sq, D), k and v must be 3-D (B, Sk, D) / (B, Sk, Dv), got "
                f"k shape {list(k.shape)} and v shape {list(v.shape)}"
            )
        q, k, v = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)
    if return_lse:
        out, lse = _lib.attention_forward(q, k, v, causal, scale)
        return (out.squeeze(2), lse.squeeze(1)) if squeeze else (out, lse)
    out = _lib.attention(q, k, v, causal, scale)
    return out.squeeze(2) if squeeze else out


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None
) -> torch.Tensor:
    """:func:`attention` with ``causal=True`` (bottom-right aligned mask; see there)."""
    squeeze = q.dim() == 3
    if squeeze:
        if k.dim() != 3 or v.dim() != 3:
            raise ValueError(
                "with 3-D q (B, Sq, D), k and v must be 3-D (B, Sk, D) / (B, Sk, Dv), got "
                f"k shape {list(k.shape)} and v shape {list(v.shape)}"
            )
        q, k, v = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)
    out = _lib.causal_attention(q, k, v, scale)
    return out.squeeze(2) if squeeze else out


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("attn_ext::attention_forward")
def _attention_forward_fake(q, k, v, causal, scale=None):
    torch._check(q.dim() == 4, lambda: f"q must have 4 dims (B, Sq, H, D), got shape {list(q.shape)}")
    torch._check(k.dim() == 4, lambda: f"k must have 4 dims (B, Sk, Hkv, D), got shape {list(k.shape)}")
    torch._check(v.dim() == 4, lambda: f"v must have 4 dims (B, Sk, Hkv, Dv), got shape {list(v.shape)}")
    B, Sq, H, _ = q.shape
    out = q.new_empty((B, Sq, H, v.shape[3]))
    lse = q.new_empty((B, H, Sq), dtype=_lse_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("attn_ext::attention_backward")
def _attention_backward_fake(dout, q, k, v, out, lse, causal, scale=None):
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
    )


def _attention_forward_setup(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal = causal
    ctx.scale = scale


def _attention_forward_backward(ctx, dout, dlse):
    # Only out's gradient is propagated; lse's (dlse) is ignored (treated as zero).
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1 and dout.shape[-1] > 1:
        dout = dout.contiguous()  # e.g. the expanded gradient of out.sum()
    dq, dk, dv = _lib.attention_backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


torch.library.register_autograd(
    "attn_ext::attention_forward",
    _attention_forward_backward,
    setup_context=_attention_forward_setup,
)
