"""The textbook, in plain PyTorch: the ground truth every test and benchmark compares against.

Written to be obviously right, not fast: full score matrices, explicit masks, ``cat`` and
``transpose``. Layouts follow ``shared/DESIGN.md``: q ``(B, Sq, H, D)``,
k ``(B, Sk, Hkv, D)``, v ``(B, Sk, Hkv, Dv)``.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

# ---------------------------------------------------------------------------------------
# scaled dot-product attention
# ---------------------------------------------------------------------------------------


def causal_mask(sq: int, sk: int, device=None) -> torch.Tensor:
    """Boolean ``(sq, sk)`` mask, True where query ``i`` may see key ``j``.

    Bottom-right aligned: ``j <= i + (sk - sq)``. For ``sq == sk`` this is the textbook
    lower triangle (the complement of ``triu(ones, diagonal=1)``).
    """
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + (sk - sq)


def band_mask(d: torch.Tensor, causal: bool = False,
              window: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """True where the distance ``d = i + (sk - sq) - j`` is seen: causal keeps ``d >= 0``;
    ``window = (left, right)`` keeps ``-right <= d <= left`` (a side of -1 is unbounded)."""
    keep = torch.ones_like(d, dtype=torch.bool)
    if causal:
        keep = keep & (d >= 0)
    if window is not None:
        left, right = window
        if left >= 0:
            keep = keep & (d <= left)
        if right >= 0:
            keep = keep & (d >= -right)
    return keep


def visibility_mask(
    sq: int,
    sk: int,
    causal: bool = False,
    window: Optional[Tuple[int, int]] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """True where query ``i`` may see key ``j`` (DESIGN.md, "Attention variants").

    With ``d = i + (sk - sq) - j`` (the textbook's ``i - j``, bottom-right aligned):
    causal keeps ``d >= 0``; ``window = (left, right)`` keeps ``-right <= d <= left`` (a side
    of -1 is unbounded); ``key_padding_mask (B, sk)`` keeps the keys marked True.
    Returns ``(sq, sk)``, or ``(B, 1, sq, sk)`` with a key padding mask.
    """
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    keep = band_mask(i + (sk - sq) - j, causal, window)
    if key_padding_mask is not None:
        keep = keep[None, None] & key_padding_mask[:, None, None, :].to(device)
    return keep


def default_scale(D: int) -> float:
    """The textbook's 1 / sqrt(D); 1 for D = 0 (no score to scale), as the kernels take it."""
    return 1.0 / math.sqrt(D) if D > 0 else 1.0


def kv_group(H: int, Hkv: int) -> int:
    """GQA / MQA: query head h reads kv head h // kv_group(H, Hkv) (1 with no heads at all)."""
    return H // Hkv if Hkv > 0 else 1


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[Tuple[int, int]] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    rel_bias: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    dropout_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """softmax(score terms of q k^T * scale [+ mask]) v, and the log-sum-exp of each score row.

    The score is DESIGN.md's (:func:`add_score_terms`: softcap, then ALiBi and rel_bias at
    distance ``d = i + (Sk - Sq) - j``), the mask :func:`visibility_mask` (causal, window, key
    padding), the softmax :func:`softmax_with_sinks` (``sinks (H,)`` join every row's
    denominator). With ``dropout_p > 0`` the probabilities are multiplied by
    ``dropout_mask (B, H, Sq, Sk)`` (True = kept; :func:`dropout_keep_mask` gives the kernels'
    bits) and divided by ``1 - dropout_p``; lse is that of the undropped scores.
    Returns ``out (B, Sq, H, Dv)`` and ``lse (B, H, Sq)`` (in q's dtype). A row that sees no
    key gives output 0 and lse -inf (its sink logit with sinks).
    """
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if scale is None:
        scale = default_scale(D)
    group = kv_group(H, Hkv)  # query head h reads kv head h // group
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    # (B, H, S, D) for batched matrix products.
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scores = (qh @ kh.transpose(-2, -1)) * scale  # (B, H, Sq, Sk)
    d = score_distance(Sq, Sk, q.device)
    scores = add_score_terms(scores, d, softcap, alibi_slopes, rel_bias)
    keep = None
    if causal or window is not None or key_padding_mask is not None:
        keep = visibility_mask(Sq, Sk, causal, window, key_padding_mask, q.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    # An empty row (every score -inf) has probabilities exp(-inf - lse) = 0, so its output is
    # 0; a NaN anywhere in a row still makes that row NaN.
    probs, lse = softmax_with_sinks(scores, sinks)  # lse (B, H, Sq); -inf for an empty row
    if keep is not None:
        # A hidden pair's probability is exactly 0, also in a row whose lse is NaN (where
        # exp(-inf - lse) is NaN): such a row reaches no gradient of a key it cannot see.
        probs = probs.masked_fill(~keep, 0.0)
    if dropout_p > 0:
        if dropout_mask is None:
            raise ValueError("dropout_p > 0 needs dropout_mask (B, H, Sq, Sk), True = kept "
                             "(dropout_keep_mask gives the kernels' mask)")
        probs = probs * dropout_mask.to(probs.device) / (1.0 - dropout_p)
    out = probs @ vh if keep is None else _product_over_seen_keys(probs, vh, keep)
    return out.transpose(1, 2), lse


def _product_over_seen_keys(probs: torch.Tensor, vh: torch.Tensor, keep: torch.Tensor):
    """``probs @ vh`` (``(B, H, Sq, Sk) @ (B, H, Sk, Dv)``) where a key a row cannot see
    (``keep`` False) adds nothing to it, not even ``0 * inf = NaN`` from a non-finite v
    (DESIGN.md, "Errors"): the product runs on v's finite values, and each key holding a
    non-finite value adds ``p * v`` of those values to the rows that see it."""
    finite = torch.isfinite(vh)
    out = probs @ torch.where(finite, vh, 0.0)
    keys = (~finite).any(dim=-1).any(dim=0).any(dim=0).nonzero().flatten()  # key indices
    if keys.numel() > 0:
        rest = torch.where(finite, 0.0, vh)[:, :, keys, :]  # (B, H, n, Dv): the non-finite values
        term = probs[..., keys, None] * rest[:, :, None]     # (B, H, Sq, n, Dv)
        seen = keep[..., keys]                               # (Sq, n) or (B, 1, Sq, n)
        out = out + torch.where(seen[..., None], term, 0.0).sum(dim=-2)
    return out


def attention(q, k, v, causal: bool = False, scale: Optional[float] = None, window=None,
              key_padding_mask=None, **terms) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) [+ terms, mask]) v on ``(B, S, H, D)`` tensors."""
    return attention_with_lse(q, k, v, causal, scale, window, key_padding_mask, **terms)[0]


def attention_varlen_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool = False,
                              scale: Optional[float] = None, window=None, alibi_slopes=None,
                              rel_bias=None, softcap=None, sinks=None, dropout_p: float = 0.0,
                              dropout_seed: int = 0, dropout_offset: int = 0):
    """Packed sequences: each sequence ``b`` (q rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``,
    k/v rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``) attends on its own, one after another.
    q ``(Tq, H, D)``, k ``(Tk, Hkv, D)``, v ``(Tk, Hkv, Dv)``; returns ``out (Tq, H, Dv)``
    and ``lse (H, Tq)``. Terms as :func:`attention_with_lse` (``alibi_slopes (N, H)`` gives
    sequence b its row); dropout keep bits of sequence b at its local positions
    (:func:`dropout_keep_mask` with batch index b)."""
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    H = q.shape[1]
    for b in range(len(cq) - 1):
        qb = q[cq[b]:cq[b + 1]][None]
        kb, vb = k[ck[b]:ck[b + 1]][None], v[ck[b]:ck[b + 1]][None]
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        mask = None
        if dropout_p > 0:
            mask = dropout_keep_mask(dropout_seed, dropout_offset, b + 1, H, range(cq[b + 1] - cq[b]),
                                     range(ck[b + 1] - ck[b]), dropout_p)[b:b + 1]
        out, lse = attention_with_lse(qb, kb, vb, causal, scale, window, None, slopes, rel_bias,
                                      softcap, sinks, dropout_p, mask)
        outs.append(out[0])
        lses.append(lse[0])
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[2]), q.new_zeros(q.shape[1], 0)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def attention_probs(q, k, causal: bool = False, scale: Optional[float] = None) -> torch.Tensor:
    """The ``(B, H, Sq, Sk)`` attention probabilities (rows that see no key are 0)."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if scale is None:
        scale = default_scale(D)
    k = k.repeat_interleave(kv_group(H, Hkv), dim=2)
    scores = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(Sq, Sk, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse))


# ---------------------------------------------------------------------------------------
# sinusoidal positional encoding (Vaswani et al. 2017, section 3.5)
# ---------------------------------------------------------------------------------------


def sinusoidal_table(
    seq_len: int,
    dim: int,
    base: float = 10000.0,
    positions: Optional[torch.Tensor] = None,
    dtype=torch.float64,
) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/dim)), PE(pos, 2i+1) = cos(pos / base^(2i/dim)).

    Rows are positions ``0 .. seq_len-1``, or ``positions`` (any shape, a trailing ``dim``
    axis is added). For odd ``dim`` the last column is a sin.
    """
    if positions is None:
        positions = torch.arange(seq_len)
    pos = positions.to(torch.float64)[..., None]  # (..., 1)
    two_i = torch.arange(0, dim, 2, dtype=torch.float64)  # 2i for each sin column
    angle = pos / base ** (two_i / dim)  # (..., ceil(dim/2))
    pe = torch.zeros(*pos.shape[:-1], dim, dtype=torch.float64)
    pe[..., 0::2] = torch.sin(angle)
    pe[..., 1::2] = torch.cos(angle)[..., : dim // 2]
    return pe.to(dtype)


def sinusoidal_pe(
    x: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    offset: int = 0,
    base: float = 10000.0,
) -> torch.Tensor:
    """x + PE for ``x (B, S, D)`` or ``(S, D)``; positions ``(S,)``/``(B, S)`` or offset + s."""
    S, D = x.shape[-2], x.shape[-1]
    if positions is None:
        positions = torch.arange(S) + offset
    pe = sinusoidal_table(S, D, base, positions.cpu(), dtype=x.dtype).to(x.device)
    return x + pe


# ---------------------------------------------------------------------------------------
# rotary position embedding (Su et al. 2021, RoFormer)
# ---------------------------------------------------------------------------------------


def rope_cache(
    seq_len: int, rotary_dim: int, base: float = 10000.0, dtype=torch.float64
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables ``(seq_len, rotary_dim/2)`` of angle ``pos * base^(-2i/rotary_dim)``."""
    theta = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = torch.arange(seq_len, dtype=torch.float64)[:, None] * theta[None, :]
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def rope_scaled_inv_freq(rotary_dim: int, base: float, scaling: dict, seq_len: int = 0):
    """One frequency at a time, straight from the formulas (Hugging Face transformers'
    ``modeling_rope_utils``): returns (list of inv_freq_i, attention factor).

    linear: theta_i / factor. ntk/dynamic: base -> base * (factor * L/L0 - (factor - 1))
    ** (d/(d-2)), L = max(seq_len, L0). yarn: blend theta_i/factor and theta_i by a linear
    ramp between the correction dims of beta_fast and beta_slow; attention factor
    0.1 ln(factor) + 1. llama3: wavelength > L0/low_freq_factor -> theta_i/factor, wavelength
    < L0/high_freq_factor -> theta_i, smooth blend in between.
    """
    d = rotary_dim
    kind = scaling.get("type", scaling.get("rope_type"))
    factor = scaling.get("factor", 1.0)
    theta = [base ** (-(2 * i) / d) for i in range(d // 2)]
    if kind == "linear":
        return [t / factor for t in theta], 1.0
    if kind in ("ntk", "dynamic"):
        # L0: for "dynamic", HF's config.max_position_embeddings where given
        L0, mpe = scaling.get("original_max_position_embeddings"), scaling.get("max_position_embeddings")
        if mpe is not None and (kind == "dynamic" or L0 is None):
            L0 = mpe
        L = max(seq_len, L0)
        b = base * (factor * L / L0 - (factor - 1)) ** (d / (d - 2))
        return [b ** (-(2 * i) / d) for i in range(d // 2)], 1.0
    if kind == "yarn":
        L0 = scaling["original_max_position_embeddings"]

        def corr(rot):
            return d * math.log(L0 / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(scaling.get("beta_fast", 32))), 0)
        high = min(math.ceil(corr(scaling.get("beta_slow", 1))), d - 1)
        if low == high:
            high += 0.001
        out = []
        for i, t in enumerate(theta):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep t, 1: t / factor
            out.append(t * (1 - ramp) + (t / factor) * ramp)
        attn = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        return out, attn
    if kind == "llama3":
        L0 = scaling.get("original_max_position_embeddings", 8192)
        lo = scaling.get("low_freq_factor", 1.0)
        hi = scaling.get("high_freq_factor", 4.0)
        out = []
        for t in theta:
            wavelen = 2 * math.pi / t
            if wavelen < L0 / hi:
                out.append(t)
            elif wavelen > L0 / lo:
                out.append(t / factor)
            else:
                smooth = (L0 / wavelen - lo) / (hi - lo)
                out.append((1 - smooth) * t / factor + smooth * t)
        return out, 1.0
    raise ValueError(f"unknown scaling type {kind!r}")


def rope_cache_scaled(seq_len: int, rotary_dim: int, base: float, scaling: dict):
    """cos, sin float64 ``(seq_len, rotary_dim/2)`` from :func:`rope_scaled_inv_freq`."""
    inv_freq, attn = rope_scaled_inv_freq(rotary_dim, base, scaling, seq_len)
    cos = torch.tensor([[math.cos(p * f) * attn for f in inv_freq] for p in range(seq_len)],
                       dtype=torch.float64)
    sin = torch.tensor([[math.sin(p * f) * attn for f in inv_freq] for p in range(seq_len)],
                       dtype=torch.float64)
    return cos.reshape(seq_len, rotary_dim // 2), sin.reshape(seq_len, rotary_dim // 2)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim (GPT-NeoX / HF LLaMA)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    offset: int = 0,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotate channel pairs of ``x (B, S, H, D)`` by angle ``pos * theta_i``.

    ``cos``/``sin`` are ``(S_max, rotary_dim/2)``; channels past ``rotary_dim`` pass through.
    Half-split pairs channel ``i`` with ``i + rotary_dim/2``; interleaved pairs ``2i, 2i+1``.
    Positions are ``offset + s`` or ``positions`` of shape ``(S,)`` or ``(B, S)``.
    """
    B, S = x.shape[0], x.shape[1]
    rot = 2 * cos.shape[-1]
    if positions is None:
        positions = torch.arange(S, device=x.device) + offset
    c = cos[positions].to(x.dtype)  # (S, rot/2) or (B, S, rot/2)
    s = sin[positions].to(x.dtype)
    if c.dim() == 2:
        c, s = c[None], s[None]
    c, s = c[:, :, None, :], s[:, :, None, :]  # broadcast over heads: (B|1, S, 1, rot/2)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        c2, s2 = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
        out = x_rot * c2 + rotate_half(x_rot) * s2
    return torch.cat((out, x_pass), dim=-1)


# ---------------------------------------------------------------------------------------
# multi-head attention, the textbook way
# ---------------------------------------------------------------------------------------


class MultiHeadAttentionRef(nn.Module):
    """Q/K/V/O projections, split heads, scaled dot-product attention, concat heads.

    ``forward(x, memory=None)``: self-attention on ``x (B, S, d_model)``, or cross-attention
    with queries from ``x`` and keys/values from ``memory``. ``causal``: the bottom-right causal
    mask; the default (None) is causal for self-attention and not over a memory (an encoder's
    output is not in the decoder's future), as in ``attn_ext.MultiHeadAttention``; True or
    False applies to both. ``rope_tables=(cos, sin,
    interleaved)`` rotates q and k before attention, at positions whose difference is the
    library's distance ``d = i + (Sk - Sq) - j`` (self-attention: both at 0..S-1).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        causal: Optional[bool] = None,
        bias: bool = True,
        qk_dim: Optional[int] = None,
        v_dim: Optional[int] = None,
    ):
        super().__init__()
        self.h = num_heads
        self.hkv = num_kv_heads or num_heads
        self.d = qk_dim or d_model // num_heads
        self.dv = v_dim or self.d
        self.causal = True if causal is None else bool(causal)  # self-attention
        self.memory_causal = False if causal is None else bool(causal)  # over a memory
        self.w_q = nn.Linear(d_model, self.h * self.d, bias=bias)
        self.w_k = nn.Linear(d_model, self.hkv * self.d, bias=bias)
        self.w_v = nn.Linear(d_model, self.hkv * self.dv, bias=bias)
        self.w_o = nn.Linear(self.h * self.dv, d_model, bias=bias)

    def forward(self, x, memory=None, rope_tables=None):
        causal = self.causal if memory is None else self.memory_causal
        memory = x if memory is None else memory
        B, Sq, _ = x.shape
        Sk = memory.shape[1]
        q = self.w_q(x).view(B, Sq, self.h, self.d)
        k = self.w_k(memory).view(B, Sk, self.hkv, self.d)
        v = self.w_v(memory).view(B, Sk, self.hkv, self.dv)
        if rope_tables is not None:
            # query i at position i + (Sk - Sq), key j at j: RoPE's relative position is the
            # library's d = i + (Sk - Sq) - j. RoPE sees only differences, so with Sq > Sk the
            # same d comes from q at i and k at j + (Sq - Sk) (no negative table row).
            cos, sin, interleaved = rope_tables
            q = rope(q, cos, sin, interleaved=interleaved, offset=max(Sk - Sq, 0))
            k = rope(k, cos, sin, interleaved=interleaved, offset=max(Sq - Sk, 0))
        out = attention(q, k, v, causal=causal)  # (B, Sq, H, Dv)
        return self.w_o(out.reshape(B, Sq, self.h * self.dv))


# ---------------------------------------------------------------------------------------
# attention dropout: the counter-based keep bit (mirror of csrc/common/dropout_rng.h)
# ---------------------------------------------------------------------------------------

_U64 = 0xFFFFFFFFFFFFFFFF


def _mix64(z):
    """SplitMix64's finaliser on a numpy uint64 array (arithmetic wraps mod 2**64)."""
    import numpy as np

    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def dropout_threshold(p: float) -> int:
    """Drop a key iff its 16-bit field is below this: round(p * 2**16)."""
    return min(max(int(math.floor(p * 65536.0 + 0.5)), 0), 65536)


def dropout_keep_mask(seed: int, offset: int, batch: int, heads: int, rows, keys,
                      p: float) -> torch.Tensor:
    """Keep bits ``(batch, heads, len(rows), len(keys))`` of attention dropout.

    ``rows`` / ``keys`` are the GLOBAL query / key positions (sequences of ints). Key ``j`` of
    row ``(b, h, i)`` survives iff the 16-bit field ``j % 4`` of
    ``mix(row_key ^ (j // 4) * golden)`` is at least ``round(p * 2**16)``, where
    ``row_key = mix(mix(mix(mix(mix(seed) ^ offset) ^ b) ^ h) ^ i)`` and ``mix`` is
    SplitMix64's finaliser: a pure function of (seed, offset, b, h, i, j).
    """
    import numpy as np

    u = np.uint64
    b = np.arange(batch, dtype=u)[:, None, None, None]
    h = np.arange(heads, dtype=u)[None, :, None, None]
    i = np.asarray(list(rows), dtype=u)[None, None, :, None]
    j = np.asarray(list(keys), dtype=np.int64)[None, None, None, :]
    r = _mix64(_mix64(np.asarray(seed & _U64, dtype=u)) ^ u(offset & _U64))
    r = _mix64(_mix64(_mix64(r ^ b) ^ h) ^ i)
    with np.errstate(over="ignore"):
        w = _mix64(r ^ ((j >> 2).astype(u) * u(0x9E3779B97F4A7C15)))
    field = (w >> (u(16) * (j & 3).astype(u))) & u(0xFFFF)
    return torch.from_numpy(field >= u(dropout_threshold(p)))


# ---------------------------------------------------------------------------------------
# score terms (DESIGN.md, "Attention variants"), applied to a full score matrix
# ---------------------------------------------------------------------------------------


def score_distance(sq: int, sk: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """``d[i, j] = i + (sk - sq) - j``: the textbook's ``i - j``, bottom-right aligned."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return i + (sk - sq) - j


def add_score_terms(scores: torch.Tensor, d: torch.Tensor, softcap: Optional[float] = None,
                    alibi_slopes: Optional[torch.Tensor] = None,
                    rel_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The score of DESIGN.md on ``scores = scale * q k^T`` of shape ``(B, H, Sq, Sk)``:

        s = softcap * tanh(s / softcap)              if softcap
        s += -alibi_slopes[h] * |d|                  if alibi_slopes ((H,) or (B, H))
        s += rel_bias[h, M + clamp(d, -M, M)]        if rel_bias (H, 2M + 1)
    """
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype)
        slopes = slopes[None, :] if slopes.dim() == 1 else slopes  # (B or 1, H)
        scores = scores - slopes[:, :, None, None] * d.abs().to(scores.dtype)
    if rel_bias is not None:
        M = (rel_bias.shape[-1] - 1) // 2
        scores = scores + rel_bias.to(scores.dtype)[:, M + d.clamp(-M, M)]  # (H, Sq, Sk)
    return scores


def softmax_with_sinks(scores: torch.Tensor, sinks: Optional[torch.Tensor] = None):
    """Row softmax of ``(B, H, Sq, Sk)`` scores (-inf = invisible) whose denominator also holds
    ``exp(sinks[h])`` when given. Returns ``(probs, lse)``; a row with no visible key and no
    sink has probabilities 0 and lse -inf."""
    if sinks is not None:
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)
    lse_finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - lse_finite[..., None]), lse
