"""Batching rules for ``torch.func.vmap`` over the ops (without them torch looped over the
mapped dimension, one op call per sample, with its "performance drop" warning).

The rule of the batched ops is to fold: the mapped dimension V joins the batch dimension B, so
one kernel call runs V * B sequences, and the outputs are split back into (V, B, ...). That is
the same attention per sample: sequences never see each other's keys. A call is looped
instead, one sample at a time as torch's fallback did, where folding would change an answer:
- dropout (its keep bits depend on the batch index: a folded call would draw other masks than
  the call of one sample);
- mapped tables that are per head, not per sequence (rel_bias, sinks, cos / sin);
- d rel_bias of a backward (a folded call sums it over every sample; vmap wants one per sample);
- the packed-sequence (varlen) ops and any call whose batched inputs have no batch dimension
  to fold into.
The in-place ops (``rope_``, ``rope_qk_``, ``sinusoidal_pe_``) run sample by sample on views of
the mapped tensors (torch's fallback refuses in-place ops).
"""

from typing import Optional, Sequence

import torch
from torch.library import register_vmap

_lib = torch.ops.attn_ext


def _front(x: torch.Tensor, d: Optional[int], V: int) -> torch.Tensor:
    """x with the mapped dimension first: moved there, or x broadcast over V samples."""
    return x.expand(V, *x.shape) if d is None else x.movedim(d, 0)


def _fold(x: Optional[torch.Tensor], d: Optional[int], V: int) -> Optional[torch.Tensor]:
    """(V, B, ...) -> (V * B, ...): the samples' batches one after another."""
    if x is None:
        return None
    x = _front(x, d, V)
    return x.reshape(V * x.shape[1], *x.shape[2:])


def _unfold(x: torch.Tensor, V: int, B: int) -> torch.Tensor:
    return x.unflatten(0, (V, B))


def _loop(op, V: int, in_dims: Sequence[Optional[int]], args: tuple):
    """torch's fallback without its warning: one call per sample, the outputs stacked first."""
    if V == 0:  # (no sample to call the op on, so no output shape: torch's fallback refuses too)
        raise ValueError(
            f"vmap over a dimension of size 0 is not supported for {op._qualified_op_name} with "
            "these arguments (they are mapped one sample at a time: dropout, a table mapped per "
            "sample, packed sequences)")
    outs = []
    for i in range(V):
        outs.append(op(*(a.select(d, i) if d is not None else a for a, d in zip(args, in_dims))))
    if isinstance(outs[0], torch.Tensor):
        return torch.stack(outs), 0
    return tuple(torch.stack(o) for o in zip(*outs)), (0,) * len(outs[0])


def _full(op, args: tuple, in_dims: Sequence[Optional[int]]):
    """Every argument of op's schema, positionally: vmap hands a rule the arguments up to the
    last one the caller gave (keywords included), and an in_dim for each."""
    schema = op.default._schema.arguments
    args = list(args) + [a.default_value for a in schema[len(args):]]
    return args, tuple(in_dims) + (None,) * (len(schema) - len(in_dims))


def _batched(in_dims: Sequence[Optional[int]], *which: int) -> bool:
    return any(in_dims[i] is not None for i in which)


def _alibi_folded(alibi: Optional[torch.Tensor], d: Optional[int], V: int, B: int):
    """alibi_slopes for the folded call: (H,) as it is when not mapped; else per sequence
    (V * B, H), one row per sample and batch entry."""
    if alibi is None or (d is None and alibi.dim() == 1):
        return alibi
    a = _front(alibi, d, V)  # (V, H) or (V, B, H)
    if a.dim() == 2:
        a = a.unsqueeze(1).expand(V, B, a.shape[-1])
    # (contiguous: with V or B = 1 the reshape is a view with a stride of 0, which the kernels'
    # table check refuses)
    return a.reshape(V * B, a.shape[-1]).contiguous()


def _seqs(x: torch.Tensor, d: Optional[int]) -> int:
    """B of a mapped (B, S, ...) input: its size past the mapped dimension."""
    return _front(x, d, 1).shape[1] if d is not None else x.shape[0]


@register_vmap("attn_ext::attention")
def _attention_vmap(info, in_dims, q, k, v, causal=False, scale=None):
    V, B = info.batch_size, _seqs(q, in_dims[0])
    out = _lib.attention(_fold(q, in_dims[0], V), _fold(k, in_dims[1], V),
                         _fold(v, in_dims[2], V), causal, scale)
    return _unfold(out, V, B), 0


@register_vmap("attn_ext::causal_attention")
def _causal_attention_vmap(info, in_dims, q, k, v, scale=None):
    V, B = info.batch_size, _seqs(q, in_dims[0])
    out = _lib.causal_attention(_fold(q, in_dims[0], V), _fold(k, in_dims[1], V),
                                _fold(v, in_dims[2], V), scale)
    return _unfold(out, V, B), 0


# attention_forward's arguments: q k v causal scale window_left window_right key_padding_mask
# alibi_slopes rel_bias softcap sinks dropout_p dropout_seed dropout_offset q_start k_start
@register_vmap("attn_ext::attention_forward")
def _attention_forward_vmap(info, in_dims, *args):
    V = info.batch_size
    args, in_dims = _full(_lib.attention_forward, args, in_dims)
    q, k, v, causal, scale, left, right, kpm, alibi, rel, softcap, sinks, dropout_p = args[:13]
    if dropout_p > 0.0 or _batched(in_dims, 9, 11):
        return _loop(_lib.attention_forward, V, in_dims, tuple(args))
    B = _seqs(q, in_dims[0])
    out, lse = _lib.attention_forward(
        _fold(q, in_dims[0], V), _fold(k, in_dims[1], V), _fold(v, in_dims[2], V), causal,
        scale, left, right, _fold(kpm, in_dims[7], V), _alibi_folded(alibi, in_dims[8], V, B),
        rel, softcap, sinks, *args[12:])
    return (_unfold(out, V, B), _unfold(lse, V, B)), (0, 0)


# the backward's arguments: dout q k v out lse causal scale window_left window_right
# key_padding_mask dlse alibi_slopes rel_bias softcap dropout_p dropout_seed dropout_offset
# deterministic q_start k_start
def _attention_backward_vmap(op, with_drel: bool):
    def rule(info, in_dims, *args):
        V = info.batch_size
        args, in_dims = _full(op, args, in_dims)
        rel, dropout_p = args[13], args[15]
        if dropout_p > 0.0 or _batched(in_dims, 13) or (with_drel and rel is not None):
            return _loop(op, V, in_dims, tuple(args))
        B = _seqs(args[1], in_dims[1])
        folded = [_fold(args[i], in_dims[i], V) for i in range(6)]
        rest = list(args[6:])
        rest[10 - 6] = _fold(args[10], in_dims[10], V)  # key_padding_mask
        rest[11 - 6] = _fold(args[11], in_dims[11], V)  # dlse
        rest[12 - 6] = _alibi_folded(args[12], in_dims[12], V, B)
        grads = op(*folded, *rest)
        dq, dk, dv = (_unfold(g, V, B) for g in grads[:3])
        if not with_drel:
            return (dq, dk, dv), (0, 0, 0)
        # no rel_bias: d rel_bias is an empty (0,) tensor, the same for every sample
        return (dq, dk, dv, grads[3]), (0, 0, 0, None)
    return rule


register_vmap("attn_ext::attention_backward",
              _attention_backward_vmap(_lib.attention_backward, False))
register_vmap("attn_ext::attention_backward_rel_bias",
              _attention_backward_vmap(_lib.attention_backward_rel_bias, True))


def _varlen_loop(op):
    def rule(info, in_dims, *args):
        args, in_dims = _full(op, args, in_dims)
        return _loop(op, info.batch_size, in_dims, tuple(args))
    return rule


for _name in ("attention_varlen_forward", "attention_varlen_backward",
              "attention_varlen_backward_rel_bias"):
    register_vmap(f"attn_ext::{_name}", _varlen_loop(getattr(_lib, _name)))


def _positions_folded(pos: Optional[torch.Tensor], d: Optional[int], V: int):
    """positions (S,) as they are; (B, S) folded to (V * B, S)."""
    if pos is None or (d is None and pos.dim() == 1):
        return pos
    return _fold(pos, d, V)


def _rope_vmap(op):
    # rope / _rope_backward: x (B, S, H, D), cos, sin, positions, offset, interleaved
    def rule(info, in_dims, *args):
        V = info.batch_size
        args, dims = _full(op, args, in_dims)
        x, cos, sin, positions, offset, interleaved = args
        per_sample_rows = dims[3] is not None and positions.dim() == 2  # ((V, S) positions)
        if _batched(dims, 1, 2) or per_sample_rows or dims[0] is None or x.dim() != 5:
            return _loop(op, V, dims, tuple(args))
        B = _seqs(x, dims[0])
        pos = positions
        if pos is not None and (dims[3] is not None or pos.dim() == 2):
            pos = _fold(pos, dims[3], V)  # (B, S) or mapped (V, B, S) rows: (V * B, S)
        out = op(_fold(x, dims[0], V), cos, sin, pos, offset, interleaved)
        return _unfold(out, V, B), 0
    return rule


register_vmap("attn_ext::rope", _rope_vmap(_lib.rope))
register_vmap("attn_ext::_rope_backward", _rope_vmap(_lib._rope_backward))


@register_vmap("attn_ext::sinusoidal_pe")
def _sinusoidal_pe_vmap(info, in_dims, *args):
    V = info.batch_size
    args, dims = _full(_lib.sinusoidal_pe, args, in_dims)
    x, positions, offset, base = args
    if dims[0] is None or dims[1] is not None:
        return _loop(_lib.sinusoidal_pe, V, dims, tuple(args))
    xs = _front(x, dims[0], V)
    if xs.dim() == 3:  # (S, D) per sample: the V samples are a batch of their own
        return _lib.sinusoidal_pe(xs, positions, offset, base), 0
    B = xs.shape[1]
    pos = positions if positions is None or positions.dim() == 1 else _fold(positions, None, V)
    return _unfold(_lib.sinusoidal_pe(_fold(x, dims[0], V), pos, offset, base), V, B), 0


def _element_offsets(t: torch.Tensor) -> torch.Tensor:
    """The storage offset of every element of t (int64, t's shape)."""
    off = torch.tensor(t.storage_offset(), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        off = off.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return off


def _check_written(op, args: list, written: Sequence[int]) -> None:
    """The kernels' overlap checks on the whole mapped tensors: a call per sample checks one
    sample's views, not memory that two samples share (an expanded x, or q and k views that
    meet across samples), which would be rotated twice."""
    name = op._qualified_op_name
    for i in written:
        status = torch._debug_has_internal_overlap(args[i])  # 0 no, 1 yes, 2 too hard
        if status == 1 or (status == 2 and args[i].numel() > 0
                           and _element_offsets(args[i]).unique().numel() < args[i].numel()):
            raise ValueError(f"vmap: {name} writes argument {i} in place, whose samples share "
                             "memory (an expanded tensor?): each sample would write it again")
    if len(written) == 2:
        a, b = (args[i] for i in written)
        if (a.numel() > 0 and b.numel() > 0
                and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and torch.isin(_element_offsets(a), _element_offsets(b)).any()):
            raise ValueError(f"vmap: {name} writes arguments {written[0]} and {written[1]} in "
                             "place, and they share memory")


def _inplace_loop(op, V: int, dims: Sequence[Optional[int]], args: list, written: Sequence[int]):
    """An in-place op over mapped tensors: one call per sample on views of them (a folded copy
    would be written instead of the tensors). A written tensor that is not mapped while another
    argument is would take every sample's result in turn: refused, as written tensors whose
    samples share memory."""
    for i in written:
        if dims[i] is None:
            raise ValueError(
                f"vmap: {op._qualified_op_name} writes its argument {i} in place, which is not "
                "mapped while other arguments are (each sample would overwrite it)")
    _check_written(op, args, written)
    if V == 0:
        return None, None
    for s in range(V):
        op(*(a.select(d, s) if d is not None else a for a, d in zip(args, dims)))
    return None, None


def _inplace_rule(op, written: Sequence[int]):
    def rule(info, in_dims, *args):
        args, dims = _full(op, args, in_dims)
        return _inplace_loop(op, info.batch_size, dims, args, written)
    return rule


# rope_ (x), rope_qk_ (q, k), sinusoidal_pe_ (x): written in place, sample by sample
register_vmap("attn_ext::rope_", _inplace_rule(_lib.rope_, (0,)))
register_vmap("attn_ext::rope_qk_", _inplace_rule(_lib.rope_qk_, (0, 1)))
register_vmap("attn_ext::sinusoidal_pe_", _inplace_rule(_lib.sinusoidal_pe_, (0,)))
