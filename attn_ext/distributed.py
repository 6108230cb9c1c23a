"""Context parallelism on ``torch.distributed``: ring attention over a sequence split across ranks.

Each rank of a process group holds a slice (a *shard*) of every sequence: queries, keys and
values ``(B, S_local, H, D)``. :func:`ring_attention` passes the key/value blocks round the ring
(rank ``r`` sends to ``r + 1`` and receives from ``r - 1``) with ``torch.distributed``
point-to-point ops, each transfer overlapped with the attention of the block already here,
and merges the partial results of the blocks through their log-sum-exp in fp32 (fp64 for fp64
inputs)::

    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

The backward runs the ring again: ``dq`` accumulates where q lives, while each key/value
block's ``dk``/``dv`` accumulator travels round the ring with it and arrives home after one
more hop. Every block's gradient comes from ``attention_backward`` given the *merged* (global)
``out`` and ``lse``, so the probabilities it recomputes are the global ones.

Layouts (``shard_sequence``): a sequence of length ``S`` is cut into equal chunks.

- ``"contiguous"``: ``W`` chunks, rank ``r`` holds chunk ``r``.
- ``"zigzag"`` (default): ``2W`` chunks, rank ``r`` holds chunks ``r`` and ``2W - 1 - r``, so
  every rank does the same causal work (the early chunk sees few keys, the late one many).

Positions are global: causal, the window, the distance of ALiBi / rel_bias and dropout's keep
bits are those of the unsharded sequence, and :func:`shard_positions` gives the global
position of each local token for RoPE / sinusoidal / learned positions.

:func:`block_call` is the one place that maps a block's global positions to the kernel's
arguments: an invisible block (entirely in the future, or outside the window) is skipped, a
fully visible one or the diagonal of equal chunks runs as a plain / causal call, and any other
block (or every block, when a term reads positions) runs with the ops' ``q_start`` /
``k_start``, which make the kernel apply the global rule at the block's global position.
``key_padding_mask`` is sharded like the keys and travels round the ring with its k/v block
(one message). ``sinks`` belong to a row once, not once per block: the blocks are merged
without them and the sink joins each row's merged log-sum-exp at the end (its gradient is
``P_sink * (dlse - delta)`` per row, ``delta = dout . out``, as in the single-process ops).

Backends: gloo (CPU) is tested; NCCL (GPU) uses the same calls but is untested here.
"""

from __future__ import annotations

import struct
import threading
import time
import zlib
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "LAYOUTS",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
    "shard_positions",
    "chunk_ids",
    "block_call",
    "BlockArgs",
    "ring_stats",
]

LAYOUTS = ("zigzag", "contiguous")

_ops = torch.ops.attn_ext

# Time spent blocked in communication waits (seconds), and counts, since the last reset.
_STATS: Dict[str, float] = {"comm_wait_s": 0.0, "messages": 0, "bytes_sent": 0}


def ring_stats(reset: bool = False) -> Dict[str, float]:
    """Counters of this process's ring communication since the last reset: ``comm_wait_s``
    (seconds spent blocked waiting for a transfer to finish, i.e. communication *not* hidden
    behind compute), ``messages`` and ``bytes_sent``. ``reset=True`` zeroes them after reading."""
    out = dict(_STATS)
    if reset:
        _STATS.update(comm_wait_s=0.0, messages=0, bytes_sent=0)
    return out


# ---------------------------------------------------------------------------------------
# layouts and positions
# ---------------------------------------------------------------------------------------


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _rank_world(group) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "attn_ext.distributed needs an initialised default process group "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    non_member = (isinstance(group, int) and not isinstance(group, bool)
                  and group == dist.GroupMember.NON_GROUP_MEMBER)  # (new_group's answer off it)
    if group is not None and not non_member and not isinstance(group, dist.ProcessGroup):
        # (torch's own message for a name or a number does not say which argument)
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None (the default "
                        f"group), got {type(group).__name__} {group!r}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group")
    return rank, dist.get_world_size(group)


def chunks_per_rank(layout: str) -> int:
    """How many equal chunks of the sequence one rank holds (1 contiguous, 2 zigzag)."""
    _check_layout(layout)
    return 2 if layout == "zigzag" else 1


def _check_int(x, name: str, fn: str, low: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < low:
        raise ValueError(f"{fn}: {name} must be an int >= {low}, got {x!r}")
    return x


def chunk_ids(rank: int, world: int, layout: str) -> List[int]:
    """Global chunk indices held by ``rank`` of ``world``, in their local order."""
    _check_layout(layout)
    _check_int(world, "world", "chunk_ids", 1)
    _check_int(rank, "rank", "chunk_ids", 0)
    if rank >= world:
        raise ValueError(f"chunk_ids: rank must be in [0, world) = [0, {world}), got {rank}")
    if layout == "zigzag":
        return [rank, 2 * world - 1 - rank]
    return [rank]


def shard_sequence(x: torch.Tensor, dim: int = 1, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` along ``dim`` (every rank passes the same
    full ``x``). ``x.size(dim)`` must be a multiple of ``W`` (contiguous) or ``2W`` (zigzag).
    Contiguous returns a view; zigzag a new tensor (two chunks joined). Differentiable."""
    rank, world = _rank_world(group)
    return _shard(x, dim, rank, world, layout)


def _seq_dim(x: torch.Tensor, dim: int, fn: str) -> int:
    """``dim`` as an index of x's dims (negative counts from the end); out of range is an error,
    not a silent wrap-around onto another dim."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{fn}: dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape "
                         f"{list(x.shape)}, got {dim!r}")
    return dim % x.dim()


def _shard(x: torch.Tensor, dim: int, rank: int, world: int, layout: str) -> torch.Tensor:
    n = world * chunks_per_rank(layout)
    dim = _seq_dim(x, dim, "shard_sequence")
    S = x.size(dim)
    if S % n:
        raise ValueError(
            f"shard_sequence: the sequence length x.size({dim}) = {S} must be a multiple of "
            f"{n} (world size {world}, layout {layout!r}: {n} equal chunks)"
        )
    c = S // n
    parts = [x.narrow(dim, g * c, c) for g in chunk_ids(rank, world, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


class _Unshard(torch.autograd.Function):
    """all_gather of the shards, reordered into the full sequence. Backward: every rank's
    gradient of the full tensor is summed (all_reduce) and each rank keeps its own shard's part
    (the adjoint of all_gather, written with all_reduce because gloo has no reduce_scatter)."""

    @staticmethod
    def forward(ctx, x, dim, group, layout):
        rank, world = _rank_world(group)
        ctx.dim, ctx.group, ctx.layout, ctx.rank, ctx.world = dim, group, layout, rank, world
        xc = x.contiguous()
        gathered = [torch.empty_like(xc) for _ in range(world)]
        dist.all_gather(gathered, xc, group=group)
        n_local = chunks_per_rank(layout)
        c = x.size(dim) // n_local
        chunks: List[Optional[torch.Tensor]] = [None] * (world * n_local)
        for r, xr in enumerate(gathered):
            for a, g in enumerate(chunk_ids(r, world, layout)):
                chunks[g] = xr.narrow(dim, a * c, c)
        return torch.cat(chunks, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return _shard(grad, ctx.dim, ctx.rank, ctx.world, ctx.layout), None, None, None


def unshard_sequence(x: torch.Tensor, dim: int = 1, group=None, layout: str = "zigzag") -> torch.Tensor:
    """The full sequence from every rank's shard (an all_gather, then the chunks in global
    order): the inverse of :func:`shard_sequence`. Every rank gets the full tensor.
    Differentiable (the gradient of the full tensor is summed over ranks)."""
    _, world = _rank_world(group)
    # Checked on every rank, then agreed on (one small all_gather) before the data moves: a
    # rank failing alone, or shards whose shapes differ, would abort one rank inside the
    # all_gather and leave the others waiting.
    try:
        _check_layout(layout)
        dim = _seq_dim(x, dim, "unshard_sequence")
        if x.size(dim) % chunks_per_rank(layout):
            raise ValueError(
                f"unshard_sequence: a zigzag shard has two equal chunks, so x.size({dim}) must "
                f"be even, got {x.size(dim)}"
            )
        if x.dim() > _MAX_AGREED_DIMS:
            raise ValueError(f"unshard_sequence: x may have at most {_MAX_AGREED_DIMS} dims, "
                             f"got shape {list(x.shape)}")
        error = None
    except Exception as e:  # (any: raised on this rank after the agreement, none left waiting)
        error = e
    if world == 1:
        if error is not None:
            raise error
        return x
    _agree_on_shard(x, dim, layout, group, error)
    return _Unshard.apply(x, dim, group, layout)


_MAX_AGREED_DIMS = 16


def _gather_checks(sig: List[int], x, group, world: int, error, failed: str) -> List[List[int]]:
    """The one all_gather of an agreement: every rank sends sig (sig[0] = 1 where its own checks
    passed) and gets every rank's. The local error, if any, is raised after the exchange, so no
    rank is left waiting; a rank whose checks passed raises ``failed`` (``{bad}``: the ranks
    that failed) when another rank's did not. Returns the rows of every rank."""
    dev = torch.device("cpu")  # gloo / mpi exchange CPU tensors; nccl the inputs' device
    if isinstance(x, torch.Tensor) and dist.get_backend(group) == "nccl":
        dev = x.device
    mine = torch.tensor(sig, dtype=torch.int64, device=dev)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = [t.tolist() for t in every]
    if error is not None:
        raise error
    bad = [r for r, row in enumerate(rows) if not row[0]]
    if bad:
        raise ValueError(failed.format(bad=bad))
    return rows


def _agree_on_shard(x, dim, layout, group, error) -> None:
    """unshard_sequence's agreement: every rank learns whether every other rank's x passed its
    checks and has the same shape, dtype, dim and layout, and whether every rank records a
    gradient (the backward is an all_reduce: a rank without a graph would never join it, and
    the others would wait, or pair it with another collective); all raise together otherwise."""
    _, world = _rank_world(group)
    ok = error is None
    sig = [int(ok)] + [0] * (5 + _MAX_AGREED_DIMS)  # ..., shape, whether it records a gradient
    if ok:
        sig[1:5] = [x.dim(), dim, zlib.crc32(str(x.dtype).encode()),
                    LAYOUTS.index(layout)]
        sig[5:5 + x.dim()] = list(x.shape)
        sig[-1] = int(torch.is_grad_enabled() and x.requires_grad)
    rows = _gather_checks(sig, x, group, world, error,
                          "unshard_sequence: the shards of rank(s) {bad} of the group failed "
                          "their checks (see the error raised there); no data was gathered")
    if any(row[:-1] != rows[0][:-1] for row in rows):
        desc = "; ".join(f"rank {r}: shape {row[5:5 + row[1]]}, "
                         f"dtype {_DTYPE_OF_CRC.get(row[3], 'unknown')}, "
                         f"dim {row[2]}, layout {LAYOUTS[row[4]]!r}" for r, row in enumerate(rows))
        raise ValueError("unshard_sequence: every rank's shard must have the same shape and "
                         f"dtype, with the same dim and layout, got {desc}")
    if any(row[-1] != rows[0][-1] for row in rows):
        grads = ", ".join(f"rank {r}: {bool(row[-1])}" for r, row in enumerate(rows))
        raise ValueError("unshard_sequence: the ranks differ in whether a gradient is recorded "
                         f"(grad mode and x.requires_grad): {grads}; its backward is a "
                         "collective every rank must join")


def shard_positions(
    local_len: int, group=None, layout: str = "zigzag", device: Optional[torch.device] = None
) -> torch.Tensor:
    """Global position (int64 ``(local_len,)``) of each token of this rank's shard: the
    ``positions`` argument of ``rope`` / ``sinusoidal_pe`` / learned embeddings, so that every
    token is encoded exactly as in the unsharded sequence of length ``local_len * W``."""
    _check_int(local_len, "local_len", "shard_positions", 0)
    rank, world = _rank_world(group)
    n = chunks_per_rank(layout)
    if local_len % n:
        raise ValueError(f"shard_positions: a zigzag shard has two equal chunks, so local_len must "
                         f"be even, got {local_len}")
    c = local_len // n
    return torch.cat(
        [torch.arange(g * c, (g + 1) * c, dtype=torch.int64, device=device) for g in chunk_ids(rank, world, layout)]
    )


# ---------------------------------------------------------------------------------------
# the per-block rule: global positions -> kernel arguments
# ---------------------------------------------------------------------------------------


class BlockArgs(NamedTuple):
    """The kernel arguments of one block: ``causal`` and ``window = (left, right)`` (-1
    unbounded; None = no window argument), and the block's global position ``(q_start,
    k_start)`` (None: the kernel's own bottom-right alignment, for a block that needs no
    positions). With positions the kernel applies the *global* rule at the global distance
    ``d = (q_start + i) - (k_start + j)`` (the ops' ``q_start`` / ``k_start``)."""

    causal: bool
    window: Optional[Tuple[int, int]] = None
    q_start: Optional[int] = None
    k_start: Optional[int] = None


FULL = BlockArgs(False, None)


def block_call(
    q_start: int, sq: int, k_start: int, sk: int, causal: bool,
    window: Optional[Tuple[int, int]] = None, positional: bool = False,
) -> Optional[BlockArgs]:
    """The one rule that maps a block's global positions to the kernel's arguments.

    The block: queries at global positions ``q_start .. q_start+sq-1`` against keys at
    ``k_start .. k_start+sk-1``. Globally (DESIGN.md, with ``d = p_query - p_key``) a pair is
    visible iff ``d >= 0`` when ``causal`` and ``-right <= d <= left`` for ``window``.

    Returns None when no pair is visible (skip the block). Otherwise, without ``positional``
    (no term depends on the distance or the position): :data:`FULL` when every pair is visible,
    ``BlockArgs(True)`` when the global mask is exactly the kernel's bottom-right causal mask
    (the diagonal of equal chunks), else the global ``causal`` / ``window`` at the block's
    global position. With ``positional`` (ALiBi, rel_bias or dropout: they read ``d`` or the
    global row and column) every visible block gets its global position.
    """
    from attn_ext.ops import _window_args

    left, right = _window_args(window)  # (checked: a public helper)
    window = None if window is None else (left, right)
    if sq <= 0 or sk <= 0:
        return None
    lo = 0 if causal else None  # visible iff lo <= d <= hi (None: unbounded)
    if right >= 0:
        lo = -right if lo is None else max(lo, -right)
    hi = left if left >= 0 else None
    d_min, d_max = q_start - (k_start + sk - 1), q_start + sq - 1 - k_start
    if (lo is not None and d_max < lo) or (hi is not None and d_min > hi) or (
            lo is not None and hi is not None and lo > hi):
        return None
    lo_cuts = lo is not None and lo > d_min
    hi_cuts = hi is not None and hi < d_max
    if positional:
        if not lo_cuts and not hi_cuts:
            return BlockArgs(False, None, q_start, k_start)
        return BlockArgs(causal, window, q_start, k_start)
    if not lo_cuts and not hi_cuts:
        return FULL
    # the kernel's own causal mask (d_loc = i + (sk - sq) - j >= 0) is d >= delta
    delta = q_start - k_start - (sk - sq)
    if not hi_cuts and lo == delta:
        return BlockArgs(True)
    return BlockArgs(causal, window, q_start, k_start)


class _Terms(NamedTuple):
    """The score terms of a ring call, as the ops take them (tables in the accumulation type;
    dropout seed/offset the same on every rank)."""

    alibi_slopes: Optional[torch.Tensor] = None
    rel_bias: Optional[torch.Tensor] = None
    softcap: Optional[float] = None
    dropout_p: float = 0.0
    dropout_seed: int = 0
    dropout_offset: int = 0

    @property
    def positional(self) -> bool:
        """True when a term reads the distance or the global position (ALiBi, rel_bias,
        dropout): every block then needs its global position."""
        return self.alibi_slopes is not None or self.rel_bias is not None or self.dropout_p > 0


NO_TERMS = _Terms()


def _window_ops(args: BlockArgs) -> Tuple[int, int]:
    return args.window if args.window is not None else (-1, -1)


def _kernel_forward(q, k, v, args: BlockArgs, scale, terms: _Terms = NO_TERMS, kpm=None):
    """One block's ``attention_forward`` with the arguments :func:`block_call` chose (``kpm``:
    the block's keys' part of the key_padding_mask, or None)."""
    left, right = _window_ops(args)
    return _ops.attention_forward(
        q, k, v, args.causal, scale, left, right, kpm, terms.alibi_slopes, terms.rel_bias,
        terms.softcap, None, terms.dropout_p, terms.dropout_seed, terms.dropout_offset,
        args.q_start, args.k_start)


def _kernel_backward(dout, q, k, v, out, lse, dlse, args: BlockArgs, scale, terms: _Terms = NO_TERMS,
                     kpm=None):
    """One block's ``attention_backward_rel_bias`` (global out and lse; dlse the gradient of the global
    lse, or None) with :func:`block_call`'s arguments: ``(dq, dk, dv, d rel_bias)``.

    Always with a block position: out and lse are the merged ones of every block, and a call
    with a position takes the row term from them alone (rowsum(dout * out)); a whole call may
    take it from its keys' probabilities instead (the CPU backward's refined_row_terms), which
    here would drop the other blocks' share. A block without one (FULL, or the kernel's own
    bottom-right causal mask) gets the position with the same offset: the same pairs visible,
    and no term reads it."""
    left, right = _window_ops(args)
    q_start, k_start = args.q_start, args.k_start
    if q_start is None:
        off = k.size(1) - q.size(1)
        q_start, k_start = max(off, 0), max(-off, 0)
    return _ops.attention_backward_rel_bias(
        dout, q, k, v, out, lse, args.causal, scale, left, right, kpm, dlse, terms.alibi_slopes,
        terms.rel_bias, terms.softcap, terms.dropout_p, terms.dropout_seed, terms.dropout_offset,
        torch.are_deterministic_algorithms_enabled(), q_start, k_start)


def _step_calls(
    q_ids: Sequence[int], k_ids: Sequence[int], c: int, causal: bool,
    window: Optional[Tuple[int, int]] = None, positional: bool = False,
) -> List[Tuple[int, int, int, int, BlockArgs]]:
    """Kernel calls of one ring step: ``(q_row0, q_row1, k_row0, k_row1, BlockArgs)`` in
    local rows, for local query chunks ``q_ids`` against the key chunks ``k_ids`` here now
    (chunk ``g`` covers global positions ``[g*c, (g+1)*c)``). Fully visible chunk pairs that
    share a column (or a row) over all local chunks are joined into one call when no term
    needs positions (a joined call's rows are not contiguous global positions)."""
    nq, nk = len(q_ids), len(k_ids)
    kind = [[block_call(gq * c, c, gk * c, c, causal, window, positional) for gk in k_ids]
            for gq in q_ids]
    done = [[kind[a][b] is None for b in range(nk)] for a in range(nq)]
    calls: List[Tuple[int, int, int, int, BlockArgs]] = []
    if not positional:
        if all(kind[a][b] == FULL for a in range(nq) for b in range(nk)):
            return [(0, nq * c, 0, nk * c, FULL)]
        for b in range(nk):  # a key chunk every local query chunk sees fully: one call
            if nq > 1 and all(kind[a][b] == FULL for a in range(nq)):
                calls.append((0, nq * c, b * c, (b + 1) * c, FULL))
                for a in range(nq):
                    done[a][b] = True
        for a in range(nq):  # a query chunk that sees every key chunk fully: one call
            if nk > 1 and all(kind[a][b] == FULL and not done[a][b] for b in range(nk)):
                calls.append((a * c, (a + 1) * c, 0, nk * c, FULL))
                for b in range(nk):
                    done[a][b] = True
    for a in range(nq):
        for b in range(nk):
            if not done[a][b]:
                calls.append((a * c, (a + 1) * c, b * c, (b + 1) * c, kind[a][b]))
    return calls


# ---------------------------------------------------------------------------------------
# the ring
# ---------------------------------------------------------------------------------------

_TAG_KV, _TAG_DKV = 0, 1


class _Ring:
    """Point-to-point exchange with the ring neighbours: send to ``rank + 1``, receive from
    ``rank - 1`` (group ranks; ``P2POp`` takes global ranks)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world = _rank_world(group)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = to_global((self.rank + 1) % self.world)
        self.prev = to_global((self.rank - 1) % self.world)

    def start(self, send: torch.Tensor, recv: torch.Tensor, tag: int):
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        _STATS["messages"] += 1
        _STATS["bytes_sent"] += send.numel() * send.element_size()
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works) -> None:
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        _STATS["comm_wait_s"] += time.perf_counter() - t0


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pack(k: torch.Tensor, v: torch.Tensor, kpm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One flat contiguous buffer holding k, then v, then the key_padding_mask's 0 / 1 as k's
    dtype when there is one (one message per ring step)."""
    nm = 0 if kpm is None else kpm.numel()
    buf = torch.empty(k.numel() + v.numel() + nm, dtype=k.dtype, device=k.device)
    buf[: k.numel()].view(k.shape).copy_(k)
    buf[k.numel(): k.numel() + v.numel()].view(v.shape).copy_(v)
    if kpm is not None:
        buf[k.numel() + v.numel():].view(kpm.shape).copy_(kpm)
    return buf


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _unpack(buf: torch.Tensor, k_shape, v_shape) -> Tuple[torch.Tensor, torch.Tensor]:
    nk, nv = _numel(k_shape), _numel(v_shape)
    return buf[:nk].view(k_shape), buf[nk: nk + nv].view(v_shape)


def _unpack_mask(buf: torch.Tensor, k_shape, v_shape) -> Optional[torch.Tensor]:
    """The key_padding_mask ``(B, S_local)`` that :func:`_pack` put after k and v, or None."""
    start = _numel(k_shape) + _numel(v_shape)
    if buf.numel() == start:
        return None
    return buf[start:].view(k_shape[0], k_shape[1]) != 0


def _block_mask(mask: Optional[torch.Tensor], k0: int, k1: int) -> Optional[torch.Tensor]:
    return None if mask is None else mask[:, k0:k1].contiguous()


def _merge(out: torch.Tensor, lse: torch.Tensor, r0: int, r1: int, blk_out, blk_lse) -> None:
    """Fold a block's ``(blk_out (B, n, H, Dv), blk_lse (B, H, n))`` into rows ``r0:r1`` of the
    running ``out (B, S, H, Dv)`` / ``lse (B, H, S)`` (accumulation dtype), in place."""
    o = out[:, r0:r1]
    l_old = lse[:, :, r0:r1]
    blk_lse = blk_lse.to(lse.dtype)
    l_new = torch.logaddexp(l_old, blk_lse)
    # A row that has seen no key yet has lse -inf on both sides: its weights must be 0, not NaN.
    base = torch.where(torch.isneginf(l_new), torch.zeros_like(l_new), l_new)
    w_old = torch.exp(l_old - base).transpose(1, 2).unsqueeze(-1)  # (B, n, H, 1)
    w_blk = torch.exp(blk_lse - base).transpose(1, 2).unsqueeze(-1)
    o.mul_(w_old).add_(blk_out.to(o.dtype) * w_blk)
    l_old.copy_(l_new)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.size(-1) <= 1 or t.stride(-1) == 1 else t.contiguous()


def _ring_forward(q, k, v, group, causal, scale, layout, window, terms: _Terms, kpm=None):
    """The merged ``(out, lse)`` of every block, both in the accumulation dtype."""
    ring = _Ring(group)
    W, r = ring.world, ring.rank
    B, S, H, _ = q.shape
    n = chunks_per_rank(layout)
    c = S // n
    acc = _acc_dtype(q.dtype)
    out = torch.zeros(B, S, H, v.size(-1), dtype=acc, device=q.device)
    lse = torch.full((B, H, S), float("-inf"), dtype=acc, device=q.device)
    q_ids = chunk_ids(r, W, layout)
    kv = _pack(k, v, kpm)
    spare = torch.empty_like(kv) if W > 1 else None
    for step in range(W):
        src = (r - step) % W
        works = ring.start(kv, spare, _TAG_KV) if step + 1 < W else None
        k_cur, v_cur = _unpack(kv, k.shape, v.shape)
        m_cur = _unpack_mask(kv, k.shape, v.shape)
        for q0, q1, k0, k1, kc in _step_calls(q_ids, chunk_ids(src, W, layout), c, causal,
                                              window, terms.positional):
            bo, bl = _kernel_forward(q[:, q0:q1], k_cur[:, k0:k1], v_cur[:, k0:k1], kc, scale, terms,
                                     _block_mask(m_cur, k0, k1))
            _merge(out, lse, q0, q1, bo, bl)
        if works is not None:
            ring.wait(works)
            kv, spare = spare, kv
    return out, lse


def _ring_backward(dout, dlse, q, k, v, out, lse, group, causal, scale, layout, window,
                   terms: _Terms, kpm=None):
    ring = _Ring(group)
    W, r = ring.world, ring.rank
    S = q.size(1)
    n = chunks_per_rank(layout)
    c = S // n
    acc = _acc_dtype(q.dtype)
    dout = _last_dim_contiguous(dout)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    drel = None if terms.rel_bias is None else torch.zeros_like(terms.rel_bias)
    q_ids = chunk_ids(r, W, layout)
    kv = _pack(k, v, kpm)
    spare = torch.empty_like(kv) if W > 1 else None
    dkv = None  # accumulator of the block here now; travels round the ring with it
    dkv_works, dkv_recv = None, None
    for step in range(W):
        src = (r - step) % W
        works = ring.start(kv, spare, _TAG_KV) if step + 1 < W else None
        k_cur, v_cur = _unpack(kv, k.shape, v.shape)
        m_cur = _unpack_mask(kv, k.shape, v.shape)
        local = torch.zeros(k.numel() + v.numel(), dtype=acc, device=q.device)
        dk_loc, dv_loc = _unpack(local, k.shape, v.shape)
        for q0, q1, k0, k1, kc in _step_calls(q_ids, chunk_ids(src, W, layout), c, causal,
                                              window, terms.positional):
            dq_b, dk_b, dv_b, drel_b = _kernel_backward(
                dout[:, q0:q1], q[:, q0:q1], k_cur[:, k0:k1], v_cur[:, k0:k1],
                out[:, q0:q1], lse[:, :, q0:q1],
                None if dlse is None else dlse[:, :, q0:q1].contiguous(), kc, scale, terms,
                _block_mask(m_cur, k0, k1),
            )
            dq[:, q0:q1] += dq_b
            dk_loc[:, k0:k1] += dk_b
            dv_loc[:, k0:k1] += dv_b
            if drel is not None:
                drel += drel_b
        if dkv_works is not None:  # the accumulator of this block, from the previous rank
            ring.wait(dkv_works)
            dkv = dkv_recv
            dkv += local
        else:
            dkv = local
        if W > 1:  # pass it on (after the last step this sends each block's total home)
            dkv_recv = torch.empty_like(dkv)
            dkv_works = ring.start(dkv, dkv_recv, _TAG_DKV)
        if works is not None:
            ring.wait(works)
            kv, spare = spare, kv
    if dkv_works is not None:
        ring.wait(dkv_works)
        dkv = dkv_recv
    dk, dv = _unpack(dkv, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), drel


def _add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """The sink logit of each head joins every row's merged softmax: ``lse' = logaddexp(lse,
    sink_h)`` and ``out' = exp(lse - lse') out`` (a row that saw no key keeps out 0 and gets
    lse' = sink_h). In place on the accumulation-dtype ``out`` (B, S, H, Dv), ``lse`` (B, H, S)."""
    s = sinks.detach().to(lse.dtype).view(1, -1, 1).expand_as(lse)
    lse_s = torch.logaddexp(lse, s)
    w = torch.where(torch.isneginf(lse_s), torch.zeros_like(lse_s), torch.exp(lse - lse_s))
    out.mul_(w.transpose(1, 2).unsqueeze(-1))
    lse.copy_(lse_s)


class _NoDoubleBackward(torch.autograd.Function):
    """Marks a gradient of ring_attention's backward taken under create_graph=True: the value
    passes through, and a backward through it (a gradient of the gradients) is refused."""

    @staticmethod
    def forward(g, anchor):  # anchor: a tensor the gradient depends on (requires grad)
        return g.view_as(g)

    @staticmethod
    def setup_context(ctx, inputs, output):  # (nothing to save; the form torch.func accepts)
        pass

    @staticmethod
    def backward(ctx, gg):
        raise RuntimeError(
            "attn_ext: double backward through ring_attention is not supported (its backward "
            "has no derivative); a gradient of the gradients (create_graph=True, then backward "
            "again) needs attn_ext.reference.attention")


class _RingAttention(torch.autograd.Function):
    # forward + setup_context (not forward(ctx, ...)): the form torch.func's grad / vjp accept
    @staticmethod
    def forward(q, k, v, rel_bias, sinks, kpm, group, causal, scale, layout, window, terms):
        terms = terms._replace(rel_bias=rel_bias)
        out, lse = _ring_forward(q, k, v, group, causal, scale, layout, window, terms, kpm)
        if sinks is not None:
            _add_sinks(out, lse, sinks)
        return out.to(q.dtype), lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, rel_bias, sinks, kpm, group, causal, scale, layout, window, terms = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, sinks, kpm)
        ctx.cfg = (group, causal, scale, layout, window, terms._replace(rel_bias=rel_bias))
        ctx.set_materialize_grads(False)  # dout / dlse are None when unused

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(
            "attn_ext: ring_attention does not support forward-mode AD (torch.func.jvp, "
            "torch.autograd.forward_ad): it has no forward derivative. Use reverse mode "
            "(backward, torch.autograd.grad, torch.func.grad / vjp)")

    @staticmethod
    def vmap(info, in_dims, *args):
        raise RuntimeError(
            "attn_ext: ring_attention does not support torch.func.vmap (every vmapped sample "
            "would need its own ring of collectives); put the samples in the batch dimension B, "
            "or call it in a loop")

    @staticmethod
    def backward(ctx, dout, dlse):
        # A batched backward (torch.func.jacrev / hessian, autograd.grad(is_grads_batched=True))
        # is refused before the ring: its blocks would fail mid-ring and leave transfers
        # pending (the group then hung). Every rank gets the same kind of gradient.
        functorch = torch._C._functorch
        if any(g is not None and (functorch.is_batchedtensor(g) or functorch.is_legacy_batchedtensor(g))
               for g in (dout, dlse)):
            raise RuntimeError(
                "attn_ext: ring_attention does not support a batched backward (torch.func.jacrev, "
                "autograd.grad(is_grads_batched=True)): every vmapped cotangent would need its own "
                "ring; take the rows of the Jacobian in a loop of backward calls")
        # First-order only, as the single-process ops: under create_graph=True the ring's
        # backward runs without building a graph (its in-place accumulators would fail mid-ring
        # and leave the group unusable), and its gradients refuse a second backward.
        anchor = None
        if torch.is_grad_enabled():
            anchor = next((t for t in (dout, dlse, *ctx.saved_tensors)
                           if t is not None and t.requires_grad), None)
        with torch.no_grad():
            grads = _RingAttention._backward(ctx, dout, dlse)
        if anchor is not None:
            grads = tuple(_NoDoubleBackward.apply(g, anchor) if isinstance(g, torch.Tensor) else g
                          for g in grads)
        return grads

    @staticmethod
    def _backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks, kpm = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        # dlse joins each block's row term (delta - dlse): every block's probabilities are
        # recomputed from the merged lse (with the sink's term, when there is one), so the
        # blocks' terms add up to the whole row's.
        dq, dk, dv, drel = _ring_backward(dout, dlse, q, k, v, out, lse, *ctx.cfg, kpm)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[4]:
            from attn_ext.ops import _sinks_grad  # (the single-process backward's rule)
            dsinks = _sinks_grad(sinks.detach(), lse, out, dout, dlse, (0, 2), 1)
        return dq, dk, dv, drel, dsinks, None, None, None, None, None, None, None


def _check_inputs(q, k, v, S_local_multiple: int, layout: str, scale) -> None:
    from attn_ext.ops import _check_last_dim_contiguous, _check_qk_inputs

    for name, t, dims in (("q", q, "(B, S_local, H, D)"), ("k", k, "(B, S_local, Hkv, D)"),
                          ("v", v, "(B, S_local, Hkv, Dv)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ring_attention: {name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"ring_attention: {name} must have 4 dims {dims}, got shape {list(t.shape)}")
    _check_qk_inputs(q, k, scale)  # the kernels' rules, before any transfer is posted
    _check_last_dim_contiguous(v, "v", "ring_attention: ")
    if v.dtype != q.dtype or v.device != q.device or v.size(0) != q.size(0) or v.size(2) != k.size(2):
        raise ValueError(f"ring_attention: v must have q's dtype {q.dtype} and device {q.device}, "
                         f"and k's batch size and kv heads (GQA), got v {v.dtype} {v.device} "
                         f"{list(v.shape)}, k {list(k.shape)}")
    if k.size(1) != q.size(1) or v.size(1) != q.size(1):
        raise ValueError(
            "ring_attention: q, k and v must be shards of the same sequence (equal S_local), got "
            f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
        )
    if q.size(1) % S_local_multiple:
        raise ValueError(
            f"ring_attention: a {layout!r} shard holds {S_local_multiple} equal chunks, so S_local "
            f"must be a multiple of {S_local_multiple}, got q shape {list(q.shape)}"
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    scale: Optional[float] = None,
    layout: str = "zigzag",
    window=None,
    key_padding_mask=None,
    alibi_slopes=None,
    rel_bias=None,
    softcap=None,
    sinks=None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
):
    """Attention over a sequence sharded across the ranks of ``group``; every rank calls it
    with its own shard, and gets its own rows of ``attn_ext.attention(q_full, k_full, v_full,
    **same keywords)``.

    Args:
        q: ``(B, S_local, H, D)`` this rank's queries (any strides, last dim contiguous).
        k, v: ``(B, S_local, Hkv, D)`` / ``(B, S_local, Hkv, Dv)`` this rank's keys and values
            (GQA: ``Hkv`` divides ``H``). All ranks' shards have the same shape.
        group: the process group of the ring (default: the world). Its ranks hold the shards
            in the order of ``layout`` (see :func:`shard_sequence`).
        causal: query at global position ``p`` sees key ``t`` iff ``t <= p`` (the unsharded
            sequence's lower triangle); blocks entirely in the future are skipped.
        scale: default ``1 / sqrt(D)``.
        layout: ``"zigzag"`` (rank r holds chunks r and 2W-1-r; balanced causal work) or
            ``"contiguous"`` (rank r holds chunk r). Must match how the shards were made.
        window, alibi_slopes, rel_bias, softcap, dropout_p: as in :func:`attn_ext.attention`,
            at GLOBAL positions: the window and the distance ``d`` of ALiBi / rel_bias are those
            of the unsharded sequence, and dropout drops exactly what the single-process call
            drops (the seed/offset are drawn from torch's generator on the group's first rank
            and broadcast, so ``torch.manual_seed`` on every rank reproduces the single-process
            run). Blocks outside the window are skipped like causal ones. ``rel_bias`` is
            differentiable: each rank's gradient is its own rows' part (sum it over the group,
            as for any replicated parameter; DDP/FSDP do).
        key_padding_mask: ``(B, S_local)`` bool, this rank's shard of the global ``(B, S)``
            mask (True = the key takes part), sharded like k (``shard_sequence(mask, 1)``); it
            travels round the ring with its k/v block.
        sinks: ``(H,)`` per-head sink logits, as in :func:`attn_ext.attention`: each joins the
            softmax denominator of every row once (the merged one); differentiable, each
            rank's gradient being its own rows' part (sum it over the group, like rel_bias).
            The returned lse includes the sink term.
        (Every rank passes the same keywords and shapes, and records a gradient alike: grad
        mode on and some input requiring grad on all ranks or on none, since the backward is a
        ring too; otherwise every rank raises before the ring starts.)
        return_lse: also return the global log-sum-exp ``(B, H, S_local)`` of each local row
            (fp32; fp64 for fp64 inputs); differentiable (its gradient joins the backward's row
            term, as in the single-process ops).

    Returns ``out (B, S_local, H, Dv)`` contiguous, q's dtype (and ``lse``). Differentiable in
    q, k, v (and rel_bias): the backward passes k/v round the ring again and sends dk/dv back;
    torch.func.grad / vjp work too (vmap and forward-mode AD are refused). Under torch.compile
    the call breaks the graph (its agreement between ranks reads values on the host), so
    ``fullgraph=True`` cannot hold for a model that calls it; the rest of the model compiles.
    """
    from attn_ext.ops import (_check_causal, _check_return_lse, _check_term_shapes,
                              _score_term_args, _window_args)

    squeeze = isinstance(q, torch.Tensor) and q.dim() == 3  # (B, S_local, D): one head
    # Every check runs before the first collective, on every rank alike: a rank failing alone
    # once the ring has started would leave its neighbours waiting on transfers that never come.
    # (The kernels check the terms too, but only inside the ring.)
    try:
        if squeeze:
            if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 3
                    and v.dim() == 3):
                raise ValueError("ring_attention: with 3-D q (B, S_local, D), k and v must be 3-D too")
            q, k, v = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)
        _check_layout(layout)
        _check_inputs(q, k, v, chunks_per_rank(layout), layout, scale)
        _check_causal(causal)
        _check_return_lse(return_lse)
        left, right = _window_args(window)
        alibi_t, rel_t, softcap, sinks_t, dropout_p, seed, offset = _score_term_args(
            q, alibi_slopes, rel_bias, softcap, sinks, dropout_p)
        _check_term_shapes(q, alibi_t, rel_t, "ring_attention: ")
        _check_ring_mask_sinks(q, key_padding_mask, sinks_t)
        records_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, rel_t, sinks_t))
        keywords = _keyword_signature(bool(causal), scale, layout, left, right, alibi_t, rel_t,
                                      softcap, dropout_p, key_padding_mask, sinks_t, records_grad,
                                      tables=_rank_world(group)[1] > 1)  # (one rank: no copies)
        error = None
    except Exception as e:  # (any: raised on this rank after the agreement, none left waiting)
        error, keywords = e, None
    _agree_on_inputs(q, k, v, group, error, keywords)
    win = None if (left, right) == (-1, -1) else (left, right)
    if dropout_p > 0:
        seed, offset = _broadcast_seed_offset(seed, offset, group, q.device)
    terms = _Terms(alibi_t, None, softcap, dropout_p, seed, offset)
    out, lse = _RingAttention.apply(q, k, v, rel_t, sinks_t, key_padding_mask, group, bool(causal),
                                    scale, layout, win, terms)
    if squeeze:
        out, lse = out.squeeze(2), lse.squeeze(1)
    return (out, lse) if return_lse else out


def _check_ring_mask_sinks(q, key_padding_mask, sinks) -> None:
    """key_padding_mask (B, S_local) bool and sinks (H,) on q's device, checked on the host
    before the ring starts (the kernels would check them only mid-ring)."""
    from attn_ext.ops import _check_key_padding_mask

    B, S, H = q.size(0), q.size(1), q.size(2)
    try:
        _check_key_padding_mask(key_padding_mask, B, S)
    except ValueError as e:
        raise ValueError(f"ring_attention: {e} (this rank's shard: Sk = S_local)") from None
    if key_padding_mask is not None and key_padding_mask.device != q.device:
        raise ValueError(f"ring_attention: key_padding_mask must be on the same device as q "
                         f"({q.device}), got {key_padding_mask.device}")
    if sinks is not None:
        if sinks.device != q.device:
            raise ValueError(f"ring_attention: sinks must be on the same device as q ({q.device}), "
                             f"got {sinks.device}")
        if tuple(sinks.shape) != (H,):
            raise ValueError(f"ring_attention: sinks must have shape (H,) = ({H},), got shape "
                             f"{list(sinks.shape)}")


# the keywords every rank of a ring must pass alike. The tables (alibi_slopes, rel_bias, sinks)
# are compared by shape and by a crc32 of their bytes (a host copy of each, small tables: a
# rank whose table differs, e.g. one initialised without a shared seed, would otherwise give
# silently wrong dk / dv on every rank)
_KEYWORD_FIELDS = ("causal", "scale", "layout", "window left", "window right", "alibi_slopes shape",
                   "alibi_slopes shape", "rel_bias shape", "rel_bias shape", "softcap", "dropout_p",
                   "key_padding_mask", "sinks shape", "sinks shape",
                   "whether a gradient is recorded (grad mode and requires_grad)",
                   "alibi_slopes values", "rel_bias values", "sinks values")


def _table_crc(t) -> int:
    """crc32 of a table's bytes (-1 for an absent one): equal tables, equal numbers. Read from
    a fresh CPU copy: numpy() marks the storage it reads non-resizable, which FSDP2 (freeing
    an unsharded parameter passed as the table) cannot take; under torch.func the transform's
    wrappers are taken off first (numpy() refuses them)."""
    if t is None:
        return -1
    t = t.detach()
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    with torch._C._DisableFuncTorch():
        data = t.to("cpu", copy=True).contiguous()
        return zlib.crc32(data.view(torch.uint8).numpy().tobytes())


def _float_bits(x: Optional[float]) -> int:
    """An int64 that is equal for equal floats (None: a value no float64 has: a NaN payload)."""
    if x is None:
        return 0x7FF8_DEAD_0000_0001
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _keyword_signature(causal: bool, scale, layout: str, left: int, right: int, alibi_t, rel_t,
                       softcap, dropout_p, key_padding_mask=None, sinks_t=None,
                       records_grad: bool = False, tables: bool = True) -> List[int]:
    """The ring's keywords as ints, one per _KEYWORD_FIELDS entry (shapes: two dims each,
    -1 for an absent term). ``records_grad``: whether this call's backward will pass blocks
    round the ring (a rank without a graph would never join it, and the others would wait).
    ``tables``: whether to add the tables' crc32 (-1 each otherwise)."""
    def dims2(t) -> List[int]:
        if t is None:
            return [-1, -1]
        shape = list(t.shape)
        return [shape[0], shape[1] if len(shape) > 1 else -2]
    return ([int(causal), _float_bits(scale), LAYOUTS.index(layout), left, right]
            + dims2(alibi_t) + dims2(rel_t) + [_float_bits(softcap), _float_bits(dropout_p)]
            + [int(key_padding_mask is not None)] + dims2(sinks_t) + [int(records_grad)]
            + [_table_crc(t) if tables else -1 for t in (alibi_t, rel_t, sinks_t)])


def _agree_on_inputs(q, k, v, group, error, keywords: Optional[List[int]] = None) -> None:
    """One small all_gather before the ring starts: every rank learns whether every other
    rank's q / k / v and keywords passed the checks, and whether all ranks have the same shapes,
    dtype and keywords (``_KEYWORD_FIELDS``); all raise together otherwise. (A rank failing
    alone would leave its neighbours waiting on transfers that never come; shards of different
    lengths would fail inside the transport; ranks with different keywords would compute
    different attentions, or hang where only some of them broadcast a dropout seed.)"""
    _, world = _rank_world(group)
    if world == 1:
        if error is not None:
            raise error
        return
    ok = error is None
    n_kw = len(_KEYWORD_FIELDS)
    sig = [int(ok)] + ([*q.shape, *k.shape, *v.shape, _DTYPE_CODES.get(q.dtype, -1)] + list(keywords)
                       if ok else [0] * (13 + n_kw))
    rows = _gather_checks(sig, q, group, world, error,
                          "ring_attention: the inputs of rank(s) {bad} of the group failed their "
                          "checks (see the error raised there); no rank started the ring")
    if any(row[:14] != rows[0][:14] for row in rows):
        desc = "; ".join(f"rank {r}: q {row[1:5]}, k {row[5:9]}, v {row[9:13]}, "
                         f"dtype {_DTYPE_NAMES.get(row[13], 'unknown')}"
                         for r, row in enumerate(rows))
        raise ValueError("ring_attention: every rank's shards must have the same shapes and "
                         f"dtype (equal S_local), got {desc}")
    differ = sorted({_KEYWORD_FIELDS[i] for row in rows for i in range(n_kw)
                     if row[14 + i] != rows[0][14 + i]})
    if differ:
        raise ValueError("ring_attention: every rank of the group must pass the same keywords; "
                         f"the ranks differ in {', '.join(differ)}")


# per thread: an error deferred to the next context-parallel layer's checks
# (_raise_at_first_attention)
_THREAD = threading.local()


def _fail_together(error: BaseException, x: torch.Tensor, group) -> None:
    """Raise ``error``, the failed checks of a context-parallel layer on this rank, after
    telling the other ranks: this rank joins, as a failed rank, the agreement of the ring they
    are about to start (their next collective: the checks run before the layer calls any
    submodule), so they raise there at once ("the inputs of rank(s) [r] ... failed their
    checks") instead of waiting in it until the collective timeout. ``x`` gives the device of
    the exchange (nccl: the inputs' device)."""
    _agree_on_inputs(x, x, x, group, error)


def _raise_at_first_attention(error: BaseException, run) -> None:
    """Raise ``error``, a TinyGPT's or a TransformerBlock's own failed checks, on every rank:
    ``run()`` carries the model on, on a stand-in input, to its first context-parallel
    attention as the other ranks go there, so that every collective on the way (FSDP's
    parameter gathers, a hook's) still pairs up; that layer's checks take the error (this
    thread's) and raise it on every rank. Cleared however ``run`` ends."""
    _THREAD.deferred = error
    try:
        run()
    finally:
        _THREAD.deferred = None  # (taken by the layer's checks, or dropped with another error)
    raise error  # (not reached: the first layer raises it)


def _take_deferred_error() -> Optional[BaseException]:
    error = getattr(_THREAD, "deferred", None)
    _THREAD.deferred = None
    return error


_DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
_DTYPE_NAMES = {code: str(dt) for dt, code in _DTYPE_CODES.items()}


# the dtypes' names by the crc32 of the name that _agree_on_shard sends (for its error message)
_DTYPE_OF_CRC = {zlib.crc32(str(dt).encode()): str(dt) for dt in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def _broadcast_seed_offset(seed: int, offset: int, group, device) -> Tuple[int, int]:
    """The dropout seed/offset of the group's first rank, on every rank (one tiny broadcast),
    so that all blocks of the ring draw the bits the single-process call draws."""
    rank, world = _rank_world(group)
    if world == 1:
        return seed, offset
    backend = dist.get_backend(group)
    dev = device if backend == "nccl" else torch.device("cpu")
    t = torch.tensor([seed, offset], dtype=torch.int64, device=dev)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(t, src=src, group=group)
    a, b = t.tolist()
    return int(a), int(b)
