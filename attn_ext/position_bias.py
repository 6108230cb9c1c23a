"""Relative position biases that live inside attention (DESIGN.md, "Attention variants").

The kernels take one table ``rel_bias (H, 2M + 1)``: the score of query row ``i`` and key
``j`` gains ``rel_bias[h, M + clamp(d, -M, M)]`` with ``d = i + (Sk - Sq) - j`` (the
textbook's ``i - j``, bottom-right aligned). Everything here only *builds* that table, with
ordinary differentiable PyTorch, so its gradient reaches whatever parameters it came from:

- :class:`RelativePositionBias` owns a learnable ``b_{i-j}`` per head, either one entry per
  distance (Shaw et al.; distances past ``max_distance`` share the last entry) or T5's
  log-spaced buckets (Raffel et al., ``num_buckets=32, max_distance=128`` there), expanded
  into the table by a gather.
- :func:`alibi_slopes` gives ALiBi's per-head slopes (Press et al.), for ``alibi_slopes=``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .ops import _check_flag, _is_int


def alibi_slopes(num_heads: int, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None) -> Tensor:
    """ALiBi's head slopes: the geometric sequence ``2^(-8/n), 2^(-16/n), ...`` for ``n`` a
    power of two; otherwise the ``2^floor(log2 H)`` sequence followed by every other slope of
    the next power's sequence (the paper's recipe). Returns ``(num_heads,)`` in ``dtype`` on
    ``device``."""
    if not _is_int(num_heads) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype!r}")
    num_heads = int(num_heads)

    def geometric(n: int):
        start = 2.0 ** (-8.0 / n)
        return [start ** (k + 1) for k in range(n)]

    m = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(m)
    if m < num_heads:
        slopes += geometric(2 * m)[0::2][: num_heads - m]
    return torch.tensor(slopes, dtype=dtype, device=device)


def _check_t5_buckets(bidirectional: bool, num_buckets: int, max_distance: int) -> None:
    """T5's bucket arguments (t5_bucket's and RelativePositionBias's one rule): at least one
    exact and one log-spaced bucket per half, and the log spacing runs from max_exact
    (num_buckets / 2 of a half's buckets) to max_distance: max_distance <= max_exact would
    divide by log(max_distance / max_exact) <= 0 (inf / NaN bucket indices)."""
    if num_buckets < 2 or (bidirectional and num_buckets < 4):
        raise ValueError(f"num_buckets must be >= 2 (>= 4 bidirectional), got {num_buckets}")
    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if max_distance <= max_exact:
        raise ValueError(
            f"max_distance must be greater than the {max_exact} exact buckets of num_buckets = "
            f"{num_buckets} ({'num_buckets // 4 bidirectional' if bidirectional else 'num_buckets // 2 causal'}: "
            f"T5's log-spaced buckets run from there to max_distance), got max_distance = {max_distance}")


def t5_bucket(distance: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """T5's bucket of each query-minus-key distance ``d = i - j`` (int64 tensor).

    Bidirectional: half the buckets are for keys before the query (``d >= 0``), half for keys
    after it. Within a half, the first ``num_buckets / 2`` distances have a bucket each and
    the rest are spaced logarithmically up to ``max_distance``; farther distances share the
    last bucket. Unidirectional: keys after the query share distance 0's bucket.

    The log-spaced buckets are computed in float32 as T5 and Hugging Face compute them, so on
    the CPU they are HF's bit for bit (on another device its float32 rounding decides;
    :class:`RelativePositionBias` builds its index on the CPU for every device).
    """
    if not isinstance(distance, Tensor) or distance.dtype.is_floating_point or distance.is_complex() \
            or distance.dtype == torch.bool:
        raise ValueError("distance must be an integer tensor of query-minus-key distances, got "
                         + (f"dtype {distance.dtype}" if isinstance(distance, Tensor)
                            else type(distance).__name__))
    _check_flag(bidirectional, "bidirectional")
    for name, v in (("num_buckets", num_buckets), ("max_distance", max_distance)):
        if not _is_int(v):
            raise ValueError(f"{name} must be an int, got {v!r}")
    num_buckets, max_distance = int(num_buckets), int(max_distance)
    _check_t5_buckets(bool(bidirectional), num_buckets, max_distance)
    n = distance.long()
    ret = torch.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        ret = ret + (n < 0).long() * num_buckets
        n = n.abs()
        n = n.masked_fill(n < 0, 9223372036854775807)  # (|-2^63| wraps to -2^63: the farthest)
    else:
        n = n.clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # log-spaced for max_exact <= n < max_distance (n is at least 1 where it is used), in
    # float32 as T5 (mesh-tf) and Hugging Face compute it: where the log formula is a whole
    # number, float64 can land just below it and truncate one bucket lower than the
    # checkpoints were trained with (e.g. num_buckets 18, max_distance 128, d = -8)
    large = max_exact + (
        torch.log(n.clamp(min=1).float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = large.clamp(max=num_buckets - 1)
    return ret + torch.where(is_small, n, large)


class RelativePositionBias(nn.Module):
    """The textbook's learnable relative position bias ``b_{i-j}``, one per head.

    ``forward()`` returns the ``(num_heads, 2 * max_distance + 1)`` table that
    ``attn_ext.attention(..., rel_bias=table)`` reads; column ``max_distance + d`` holds the
    bias of distance ``d = i - j`` (distances past ``max_distance`` clamp to it).

    Args:
        num_heads: H.
        max_distance: M, the farthest distance with its own table column.
        bidirectional: keys after the query (``d < 0``) get their own biases; otherwise they
            share distance 0's (a causal model never sees them).
        num_buckets: None for one learnable entry per distance; an int for T5's log-bucketed
            form (``num_buckets`` learnable entries per head, expanded by a gather, so the
            gradient reaches the buckets). T5 uses 32 buckets and max distance 128.
    """

    def __init__(self, num_heads: int, max_distance: int = 128, bidirectional: bool = False,
                 num_buckets: Optional[int] = None):
        super().__init__()
        for name, v in (("num_heads", num_heads), ("max_distance", max_distance),
                        ("num_buckets", num_buckets)):
            if v is not None and not _is_int(v):
                raise ValueError(f"{name} must be an int, got {v!r}")
        _check_flag(bidirectional, "bidirectional")
        bidirectional = bool(bidirectional)
        num_heads, max_distance = int(num_heads), int(max_distance)
        num_buckets = None if num_buckets is None else int(num_buckets)
        if num_heads <= 0:
            raise ValueError(f"num_heads must be positive, got {num_heads}")
        if max_distance <= 0:
            raise ValueError(f"max_distance must be positive, got {max_distance}")
        if num_buckets is not None:
            _check_t5_buckets(bidirectional, num_buckets, max_distance)
        self.num_heads = num_heads
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.num_buckets = num_buckets
        if num_buckets is not None:
            self.weight = nn.Parameter(torch.zeros(num_heads, num_buckets))
        else:
            # one entry per distance: 2M + 1 entries, or M + 1 when keys after the query share
            # distance 0's entry
            width = 2 * max_distance + 1 if bidirectional else max_distance + 1
            self.weight = nn.Parameter(torch.zeros(num_heads, width))
        self.register_buffer("index", self._index(None), persistent=False)

    def _index(self, device: Optional[torch.device]) -> Tensor:
        """The table entry of each distance -M..M, on ``device`` (None: the default device).
        Computed on the CPU and moved: T5's buckets are float32 arithmetic, which another
        device may round otherwise (CUDA divides by a reciprocal), so one rule on every device."""
        if device is None:  # (torch.get_default_device() cannot be traced by torch.compile)
            device = torch.empty(0).device
        d = torch.arange(-self.max_distance, self.max_distance + 1, device="cpu")
        if self.num_buckets is not None:
            idx = t5_bucket(d, self.bidirectional, self.num_buckets, self.max_distance)
        else:
            idx = d + self.max_distance if self.bidirectional else d.clamp(min=0)
        return idx.to(device)

    def reset_buffers(self) -> None:
        """Recompute the distance -> entry index (a non-persistent buffer) on the weight's
        device: after ``to_empty()`` it holds uninitialised memory, and after a meta-device
        init with ``load_state_dict(..., assign=True)`` it is still on the meta device
        (:func:`attn_ext.reset_buffers`)."""
        self.index = self._index(self.weight.device)

    def forward(self) -> Tensor:
        """The ``(H, 2M + 1)`` table (differentiable in ``weight``)."""
        if self.index.device != self.weight.device:
            # (indexing a CPU weight by a meta index returned uninitialised memory)
            raise RuntimeError(
                f"RelativePositionBias: the index buffer is on {self.index.device}, the weight on "
                f"{self.weight.device} (a meta-device init whose buffers were not rebuilt?); call "
                f"attn_ext.reset_buffers(model) after to_empty() / load_state_dict(assign=True)")
        return self.weight[:, self.index]

    def extra_repr(self) -> str:
        kind = f"num_buckets={self.num_buckets}" if self.num_buckets is not None else "per distance"
        return (f"num_heads={self.num_heads}, max_distance={self.max_distance}, "
                f"bidirectional={self.bidirectional}, {kind}")
