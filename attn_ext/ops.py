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
