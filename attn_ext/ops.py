"""Thin functional wrappers over ``torch.ops.attn_ext``, plus the fake (meta) kernels and
autograd formulas that make the ops work under torch.compile, torch.export and autograd.

Schemas live in ``csrc/ops.cpp``; semantics in ``shared/DESIGN.md``.
"""

from __future__ import annotations

import contextlib
import decimal
import math
import numbers
import sys
import warnings
from typing import Optional, Tuple

import torch
import torch.autograd.forward_ad as _forward_ad

from .reference import add_score_terms, score_distance, visibility_mask

_lib = torch.ops.attn_ext


class ArgumentTypeError(TypeError, ValueError, RuntimeError):
    """An argument of the wrong Python type (None or a list where a tensor belongs, a string
    where a number belongs): a TypeError, a ValueError and the RuntimeError the ops' parser
    raises for such an argument, so any of those ``except`` clauses catches it."""


class ArgumentValueError(ValueError, RuntimeError):
    """A bad argument value the wrapper refuses where the op used to (a non-finite scale): both
    the ValueError of the Python checks and the RuntimeError the op raises for it."""


def _check_tensor(t, name: str, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor {what}, got {type(t).__name__}")


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
        offset: position of the first row when ``positions`` is not given (must be 0 with
            ``positions``, which are absolute).
        base: the wavelength base (10000 in the paper).

    Returns a new contiguous tensor of ``x``'s shape and dtype. Differentiable in ``x``
    (the gradient passes through unchanged).
    """
    _check_tensor(x, "x", "(B, S, D) or (S, D)")
    _check_offset(offset)
    _check_base(base)
    return _call_op(_lib.sinusoidal_pe, x, positions, offset, base)


def sinusoidal_pe_(
    x: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    offset: int = 0,
    base: float = 10000.0,
) -> torch.Tensor:
    """In-place :func:`sinusoidal_pe`: adds the encoding into ``x`` and returns ``x``.

    ``x``'s last dim must be contiguous. Not differentiable (use the out-of-place op in
    training; a tensor that requires grad is refused)."""
    _check_tensor(x, "x", "(B, S, D) or (S, D)")
    _check_offset(offset)
    _check_base(base)
    _call_inplace_op("sinusoidal_pe_", x, positions, offset, base)
    return x


def sinusoidal_table(
    seq_len: int,
    dim: int,
    base: float = 10000.0,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """The ``(seq_len, dim)`` sinusoidal encoding matrix (for inspection and plots),
    produced by the same kernel as :func:`sinusoidal_pe` applied to zeros: ``base`` as there,
    in ``dtype`` (default: the default dtype) on ``device`` (default: the default device)."""
    for name, n in (("seq_len", seq_len), ("dim", dim)):
        if not _is_int(n):
            raise ArgumentTypeError(f"{name} must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {n}")
    dtype = dtype or torch.get_default_dtype()
    _check_table_dtype(dtype)
    # (int() of a symbolic size would specialise it under torch.export)
    zeros = torch.zeros(*(n if isinstance(n, torch.SymInt) else int(n) for n in (seq_len, dim)),
                        dtype=dtype, device=device)
    return sinusoidal_pe_(zeros, None, 0, base)


_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # what the ops take


def _check_table_dtype(dtype) -> None:
    """dtype of a table builder (sinusoidal_table, rope_cache): a floating dtype the ops take."""
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be float32, float64, float16 or bfloat16, got {dtype}")


def _fake_same_device(ref, ref_name, **others):
    """The kernels' device check, in the fake kernels too: the Meta key wins the dispatch when
    one argument is a meta tensor, and an unchecked fake would return an uninitialised tensor
    on the other arguments' device."""
    for name, t in others.items():
        if t is not None:
            torch._check(t.device == ref.device,
                         lambda: f"{name} must be on the same device as {ref_name} ({ref.device}), "
                                 f"got {t.device}")


# Forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) is refused by every op: the ops
# have reverse-mode formulas only, and torch's custom-op autograd kernel silently drops a
# tangent when no argument requires grad (the result's tangent would be zero: a wrong answer).
# Costs one attribute read per call unless a dual level is open (torch.func.jvp opens one).
# Under torch.func.jvp every call on the transform's (wrapped) tensors is refused: the
# tangents sit inside the wrappers there, and an in-place op's would pass through unrotated.
def _refuse_forward_ad(name, args, kwargs):
    level = _forward_ad._current_level
    if level < 0:
        return
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    top = torch._C._functorch.peek_interpreter_stack()
    if top is not None and top.key() == torch._C._functorch.TransformType.Jvp:
        hit = any(torch._C._functorch.is_functorch_wrapped_tensor(a) for a in tensors)
    else:
        hit = any(_forward_ad.unpack_dual(a, level=level).tangent is not None for a in tensors)
    if hit:
        raise RuntimeError(
            f"attn_ext::{name}: forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) "
            "is not supported: the op has no forward derivative, and torch would silently "
            "give a zero tangent. Use reverse mode (backward, torch.autograd.grad), or "
            "attn_ext.reference for a jvp")


# The Python kernels of this file (the Autograd kernels below, the in-place ops' Autograd and
# ADInplaceOrView kernels) are registered through this one library.
_impl_lib = torch.library.Library("attn_ext", "IMPL")


# ---------------------------------------------------------------------------------------
# calls that record no gradient
# ---------------------------------------------------------------------------------------
#
# Every op has a Python Autograd kernel (_register_autograd, _inplace_kernels): each call made
# outside torch.inference_mode() crosses from the dispatcher into Python and back: 4.5 of the
# smallest call's 11.6 us, ~3 of a 16-key decode step's ~21, ~5 of an in-place rope_qk's ~18
# (RESULTS.md, fortieth session). When that kernel would only redispatch
# (_records_no_gradient), the wrappers and the modules call the op below it themselves
# (_call_op, _call_inplace_op), provided nothing else stands between the caller and the
# dispatcher that the Python kernel's presence matters to: no torch.compile / torch.export /
# jit tracing, no torch.func transform, no torch_function or torch_dispatch mode, and plain
# tensors (a subclass such as FakeTensor goes the usual way). The result is the same tensors
# the usual path gives.

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
# argument types that are plain tensors or no tensor at all
_PLAIN_ARG_TYPES = frozenset(_PLAIN_TENSOR_TYPES + (bool, int, float, type(None)))
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def _any_requires_grad_py(*args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


_any_requires_grad = getattr(torch._C, "_any_requires_grad", _any_requires_grad_py)


def _records_no_gradient(args) -> bool:
    """The ops' Autograd kernels' rule (theirs and the wrappers' fast path's): no dual level is
    open (forward AD) and no gradient is recorded (grad mode off, or no tensor argument
    requires grad). Then the kernel only redispatches below autograd."""
    return _forward_ad._current_level < 0 and not (torch._C.is_grad_enabled()
                                                   and _any_requires_grad(*args))


def _plain_eager_call(args) -> bool:
    """Whether a wrapper may call the op below autograd itself (see above): eager, no
    transform, mode or tracer active, every tensor argument a plain tensor, and
    _records_no_gradient. (torch.compiler.is_compiling first: under dynamo it is a constant
    True, so nothing after it is traced.)"""
    if torch.compiler.is_compiling() or _is_exporting():
        return False
    if (torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._get_tracing_state() is not None):
        return False
    for a in args:
        # (the usual argument types by one set lookup, ~0.25 us less per call than isinstance)
        if type(a) not in _PLAIN_ARG_TYPES and isinstance(a, torch.Tensor):
            return False
    return _records_no_gradient(args)


def _below_inplace_or_view() -> bool:
    """Whether the thread already runs below ADInplaceOrView (inside a __torch_dispatch__
    handler of a call that came through it, or under an explicit guard): the usual path then
    skips the ADInplaceOrView kernel's refusal and version bump, so _call_inplace_op must too."""
    return torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.ADInplaceOrView)


def _call_op(op, *args):
    """op(*args) for an out-of-place op (an OpOverloadPacket with one overload): below its
    Autograd kernel when _plain_eager_call. Under torch.inference_mode() no Autograd kernel
    runs (the mode excludes those keys), so the usual call is already the floor and the checks
    and the guard would only add their ~2 us. The fast calls name the overload (op.default):
    the packet's own call resolves it each time (~0.6 us). (torch.compiler.is_compiling first:
    dynamo cannot trace torch.is_inference_mode_enabled, and is a constant True there.)"""
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
        return op.default(*args)
    if _plain_eager_call(args):
        with torch._C._AutoDispatchBelowAutograd():
            return op.default(*args)
    return op(*args)


def _call_inplace_op(name, *args):
    """attn_ext::name(*args) for an in-place op (its written tensors, _INPLACE_WRITES[name], are
    its first arguments): below its Autograd and ADInplaceOrView kernels when _plain_eager_call,
    doing what the ADInplaceOrView kernel does (_inplace_kernels: the inference-tensor refusal,
    the version bump). A written tensor that requires grad under grad mode is not a plain call:
    the Autograd kernel refuses it."""
    op = getattr(_lib, name)
    if not _plain_eager_call(args) or _below_inplace_or_view():
        return op(*args)
    written = tuple(zip(args, _INPLACE_WRITES[name]))
    _refuse_inference_writes(name, written)
    with torch._C._AutoDispatchBelowADInplaceOrView():
        out = op.default(*args)  # (the overload named: _call_op)
    _bump_versions(written)
    return out


def _register_autograd(name, backward, setup_context):
    """torch.library.register_autograd for attn_ext::name, plus the forward-mode refusal in
    the same (Python) Autograd kernel. That kernel is built with torch._library's
    make_autograd_impl, what register_autograd itself registers; a torch without it gets the
    plain public registration (no refusal). While a torch.func transform is active the same
    formulas are recorded through _functorch_autograd_impl instead (torch.func.grad / vjp)."""
    try:
        from torch._library.autograd import Info, make_autograd_impl
        op = getattr(_lib, name).default
        impl = make_autograd_impl(op, Info(backward, setup_context))
        after_autograd = torch._C._after_autograd_keyset
        below_autograd = torch._C._AutoDispatchBelowAutograd
    except (ImportError, AttributeError, TypeError):
        torch.library.register_autograd(f"attn_ext::{name}", backward, setup_context=setup_context)
        return
    try:
        transforms_active = torch._C._are_functorch_transforms_active
        func_impl = _functorch_autograd_impl(op, backward, setup_context)
    except (ImportError, AttributeError):  # a torch without these: torch's refusal, as before
        transforms_active, func_impl = (lambda: False), None

    def kernel(keyset, *args, **kwargs):
        # No gradient to record and no dual level open: what impl does then (its
        # forward_no_grad), without its calls and Metadata object. Every call of the op passes
        # here, decode steps included (RESULTS.md, thirty-fourth session: ~1-2 us of ~20).
        if _records_no_gradient(args):
            with below_autograd():
                return op.redispatch(keyset & after_autograd, *args, **kwargs)
        _refuse_forward_ad(name, args, kwargs)
        if transforms_active():
            return func_impl(keyset, *args, **kwargs)
        return impl(keyset, *args, **kwargs)

    _impl_lib.impl(name, kernel, "Autograd", with_keyset=True)


def _functorch_autograd_impl(op, backward, setup_context):
    """The Autograd kernel's body under torch.func's grad / vjp / jacrev / vmap(grad(...)).

    register_autograd's generated autograd.Function (make_autograd_impl) records the op with
    ``forward(ctx, ...)`` and no ``setup_context`` staticmethod, which Function.apply refuses
    while a functorch transform is active ("must override the setup_context staticmethod").
    That refusal is about the transform's front door; this kernel already runs at the grad
    transform's own level, on its wrapped tensors, where one plain single-level Function is
    what functorch itself records for an autograd.Function (torch._functorch.autograd_function,
    generate_single_level_function). So: the same forward, setup_context and backward as
    register_autograd's, on a _SingleLevelFunction. Used only while a transform is active;
    eager autograd, torch.compile and torch.export keep torch's own path."""
    from torch._functorch.autograd_function import enable_single_level_autograd_function

    schema = op._schema
    after_autograd = torch._C._after_autograd_keyset
    below_autograd = torch._C._AutoDispatchBelowAutograd
    grad_enabled = torch._C.is_grad_enabled

    class _Recorded(torch.autograd.function._SingleLevelFunction):
        @staticmethod
        def forward(ctx, keyset, grad_mode, *args):
            # Function.apply runs forward with grad mode off. Below autograd, the op reaches
            # the next transform level out (grad of grad: the outer torch.func.grad), whose
            # own Autograd kernel must see the caller's grad mode to record the op there;
            # with grad off it would record nothing, and the outer gradient through this op
            # would be a silent zero instead of the double-backward refusal.
            with torch.set_grad_enabled(grad_mode), below_autograd():
                result = op.redispatch(keyset & after_autograd, *args)
            setup_context(ctx=ctx, inputs=args, output=result)
            return result

        @staticmethod
        def backward(ctx, *grads):
            needs = ctx.needs_input_grad
            ctx.needs_input_grad = needs[2:]  # without the keyset's and grad mode's slots
            try:
                result = backward(ctx, *grads)
            finally:
                ctx.needs_input_grad = needs
            return (None, None, *result) if isinstance(result, tuple) else (None, None, result)

    _Recorded.__name__ = f"attn_ext_{op._opname}_{op._overloadname}"

    def func_impl(keyset, *args, **kwargs):
        # Every argument positional, defaults filled (what setup_context reads by index; the
        # schemas have no keyword-only arguments).
        args = (*args, *(kwargs.get(a.name, a.default_value)
                         for a in schema.arguments[len(args):]))
        with enable_single_level_autograd_function():
            return _Recorded.apply(keyset, grad_enabled(), *args)

    return func_impl


def _sinusoidal_fake_checks(x, positions, base):
    """make_sinusoidal_params' rules (sinusoidal_adapter.h) in the fake kernels, which are all
    that runs on meta tensors."""
    torch._check(x.dim() in (2, 3), lambda: f"x must have 3 dims (B, S, D) or 2 dims (S, D), got shape {list(x.shape)}")
    if isinstance(base, (int, float)):  # (a symbolic base is left to the kernel)
        torch._check(math.isfinite(base) and base > 0.0,
                     lambda: f"base must be a positive finite number, got {base}")
    _fake_same_device(x, "x", positions=positions)


@torch.library.register_fake("attn_ext::sinusoidal_pe")
def _sinusoidal_pe_fake(x, positions=None, offset=0, base=10000.0):
    _sinusoidal_fake_checks(x, positions, base)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("attn_ext::sinusoidal_pe_")
def _sinusoidal_pe_inplace_fake(x, positions=None, offset=0, base=10000.0):
    _sinusoidal_fake_checks(x, positions, base)
    return None


def _sinusoidal_pe_setup(ctx, inputs, output):
    pass


def _sinusoidal_pe_backward(ctx, grad):
    # d(x + PE)/dx = I; positions, offset and base get no gradient.
    return grad, None, None, None


_register_autograd("sinusoidal_pe", _sinusoidal_pe_backward, setup_context=_sinusoidal_pe_setup)


# ---------------------------------------------------------------------------------------
# rotary position embedding (RoPE)
# ---------------------------------------------------------------------------------------
#
# Backward design: the rotation R(theta) is orthogonal, so d(R x)/dx applied to a gradient g
# is R(theta)^T g = R(-theta) g, i.e. the same kernel with sin negated. That is the internal
# op attn_ext::_rope_backward (the kernels flip sin's sign bit on load; no negated table is
# materialised). Its own backward is rope again, so double backward works too.
# Gradients for cos/sin are not supported: tables are built by rope_cache, not learned. A
# cos/sin that requires grad raises a ValueError instead of silently getting no gradient.


def _check_tables_no_grad(cos: torch.Tensor, sin: torch.Tensor) -> None:
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            "attn_ext.rope: gradients w.r.t. cos/sin are not supported (the tables come from "
            "rope_cache); pass cos.detach() / sin.detach()"
        )


def _check_rope_args(x, name: str, cos, sin, offset, interleaved) -> None:
    """The rope wrappers' arguments, by the name the caller used (rope_qk rotates q and k by
    the op of rope(), which calls both "x"): x a (B, S, H, D) or (B, S, D) floating tensor with
    a contiguous last dim, at least rotary_dim = 2 * cos.size(-1) wide; cos / sin tensors;
    offset an int; interleaved a bool. The op checks the rest (and these again). The checks
    on sizes do not run while compiling: a comparison of symbolic sizes adds a guard
    (torch.export with a dynamic head dim refused "D >= 8"); the op checks them at run time."""
    _check_tensor(x, name, "(B, S, H, D) or (B, S, D)")
    _check_tensor(cos, "cos", "(S_max, rotary_dim/2)")
    _check_tensor(sin, "sin", "(S_max, rotary_dim/2)")
    _check_offset(offset)
    _check_flag(interleaved, "interleaved")
    # (ArgumentValueError: the RuntimeError the op raised for these, and a ValueError)
    if x.dim() not in (3, 4):
        raise ArgumentValueError(f"{name} must have 4 dims (B, S, H, D) or 3 dims (B, S, D), got "
                                 f"shape {list(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ArgumentValueError(
            f"{name} must be float32, float64, float16 or bfloat16, got {x.dtype}")
    if torch.compiler.is_compiling():  # (sizes may be symbolic: no guards from these)
        return
    _check_last_dim_contiguous(x, name)
    if cos.dim() == 2 and 2 * cos.size(-1) > x.size(-1):
        raise ArgumentValueError(
            f"rotary_dim = 2 * cos.size(-1) = {2 * cos.size(-1)} must be <= the head dim "
            f"D = {name}.size(-1) = {x.size(-1)}")


def _rope_checked(x, cos, sin, positions, offset, interleaved) -> torch.Tensor:
    """rope() after its checks: the op on the 4-D form, 3-D input back to 3-D."""
    out = _call_op(_lib.rope, _rope_4d(x), cos, sin, positions, offset, interleaved)
    return out.squeeze(2) if x.dim() == 3 else out


def _rope_4d(x: torch.Tensor) -> torch.Tensor:
    # 3-D (B, S, D) is the single-head form: a free (B, S, 1, D) view.
    return x.unsqueeze(2) if x.dim() == 3 else x


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    offset: int = 0,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotary position embedding (Su et al., RoFormer): rotate channel pairs of ``x`` by
    angle ``pos * theta_i``, returning a new contiguous tensor.

    Args:
        x: ``(B, S, H, D)`` (or ``(B, S, D)`` as ``H = 1``), float32/float64/float16/bfloat16.
            Any strides on B, S, H (slices of a packed QKV buffer, ``(B, H, S, D)``
            tensors passed as ``.transpose(1, 2)``); the last dim must be contiguous.
        cos, sin: ``(S_max, rotary_dim/2)`` tables from :func:`rope_cache`, float32 or
            ``x``'s dtype (math is fp32 either way; float64 for float64 x).
            ``rotary_dim = 2 * cos.size(-1) <= D``; channels past it pass through.
        positions: optional int64 ``(S,)`` or ``(B, S)`` table row of each token; every
            entry must be in ``[0, S_max)`` (checked on CPU; a device assert on CUDA).
            Without it row ``s`` uses table row ``offset + s``; with it ``offset`` must be 0
            (positions are absolute: a nonzero offset is refused, not ignored).
        interleaved: False pairs channel ``i`` with ``i + rotary_dim/2`` (GPT-NeoX / Hugging
            Face LLaMA, ``rotate_half``); True pairs ``2i, 2i+1`` (GPT-J / RoFormer / Meta).

    Differentiable in ``x`` (the backward is the inverse rotation); not in cos/sin.
    """
    _check_rope_args(x, "x", cos, sin, offset, interleaved)
    _check_tables_no_grad(cos, sin)
    return _rope_checked(x, cos, sin, positions, offset, interleaved)


def rope_(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    offset: int = 0,
    interleaved: bool = False,
) -> torch.Tensor:
    """In-place :func:`rope`: rotates ``x`` where it lies (channels past ``rotary_dim`` and
    the rest of a packed buffer are untouched) and returns ``x``. Not differentiable (a
    tensor that requires grad is refused: use :func:`rope` in training)."""
    _check_rope_args(x, "x", cos, sin, offset, interleaved)
    x4 = _rope_4d(x)
    _call_inplace_op("rope_", x4, cos, sin, positions, offset, interleaved)
    return x


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    offset: int = 0,
    interleaved: bool = False,
    inplace: bool = False,
):
    """Rotate ``q (B, S, H, D)`` and ``k (B, S, Hkv, Dk)`` with the same tables and positions.

    ``inplace=True`` rotates both in one parallel region (one kernel launch on CUDA) and
    returns ``(q, k)`` themselves (not differentiable: tensors that require grad are
    refused); otherwise returns two new tensors (differentiable in q, k).
    """
    _check_flag(inplace, "inplace")
    _check_rope_args(q, "q", cos, sin, offset, interleaved)
    _check_rope_args(k, "k", cos, sin, offset, interleaved)
    # one rule for both paths (the in-place op checks these too)
    if k.shape[:2] != q.shape[:2]:
        raise ValueError(f"k must have B = {q.size(0)} and S = {q.size(1)} (the first two dims "
                         f"of q), got shape {list(k.shape)}")
    if k.dtype != q.dtype:
        raise ArgumentValueError(f"k must have q's dtype ({q.dtype}), got {k.dtype}")
    if k.device != q.device:
        raise ArgumentValueError(f"k must be on q's device ({q.device}), got {k.device}")
    if cos.dtype not in (torch.float32, q.dtype):  # (rope() would name x)
        raise ArgumentValueError(
            f"cos/sin must be float32 or q's dtype ({q.dtype}), got {cos.dtype}")
    if inplace:
        q4, k4 = _rope_4d(q), _rope_4d(k)
        _call_inplace_op("rope_qk_", q4, k4, cos, sin, positions, offset, interleaved)
        return q, k
    _check_tables_no_grad(cos, sin)
    return (
        _rope_checked(q, cos, sin, positions, offset, interleaved),
        _rope_checked(k, cos, sin, positions, offset, interleaved),
    )


_SCALING_TYPES = ("default", "linear", "ntk", "dynamic", "yarn", "llama3")
# the keys each scaling type reads (rope_inv_freq), and "partial_rotary_factor", transformers'
# way to say rotary_dim (an argument here), which its rope_parameters carry for every type
_SCALING_KEYS = {"default": {"type", "rope_type", "rope_theta", "partial_rotary_factor"}}
_SCALING_KEYS["linear"] = _SCALING_KEYS["default"] | {"factor"}
_SCALING_KEYS["ntk"] = _SCALING_KEYS["dynamic"] = _SCALING_KEYS["linear"] | {
    "original_max_position_embeddings", "max_position_embeddings"}
_SCALING_KEYS["yarn"] = _SCALING_KEYS["linear"] | {
    "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
    "mscale_all_dim", "truncate"}
_SCALING_KEYS["llama3"] = _SCALING_KEYS["linear"] | {
    "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}


def rope_inv_freq(
    rotary_dim: int, base: float = 10000.0, scaling: Optional[dict] = None, seq_len: int = 0
):
    """``(inv_freq (rotary_dim/2,) float64, attention_factor)`` for a scaling dict; see
    :func:`rope_cache` for the formulas."""
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral):
        raise ArgumentTypeError(f"rotary_dim must be an int, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise ArgumentTypeError(f"base must be a number, got {type(base).__name__}")
    if not (math.isfinite(base) and base > 0):
        raise ValueError(f"base must be a positive finite number, got {base}")
    if scaling is not None and not isinstance(scaling, dict):
        raise ArgumentTypeError(
            f"scaling must be a dict such as {{'type': 'linear', 'factor': 2.0}} or None, got "
            f"{type(scaling).__name__} {scaling!r}")
    dim = rotary_dim
    # (on the CPU whatever the default device: host constants, also under torch.device("meta"))
    exps = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim  # 2i / dim

    def inv(b):
        return 1.0 / (b**exps)

    if scaling is None:
        return inv(base), 1.0
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind not in _SCALING_TYPES:
        raise ValueError(f"scaling['type'] must be one of {_SCALING_TYPES}, got {kind!r}")
    def number(key, default, positive=True):
        v = scaling.get(key, default)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or (
                positive and not v > 0):
            raise ValueError(f"scaling[{key!r}] must be a finite number{' > 0' if positive else ''}"
                             f" for scaling type {kind!r}, got {v!r}")
        return float(v)

    def optional_number(key, positive):  # absent or None: derived (HF's reading)
        return None if scaling.get(key) is None else number(key, None, positive)

    # transformers' rope_parameters carry the base as rope_theta: used by nobody here, so it
    # must not disagree with `base` (it used to be dropped silently)
    theta = optional_number("rope_theta", True)
    if theta is not None and theta != float(base):
        raise ValueError(f"scaling['rope_theta'] = {theta!r} differs from base = {base!r}; pass "
                         f"base={theta!r} (the base is not read from the dict)")
    if kind != "default" and scaling.get("factor") is None:  # (it used to mean 1: unscaled)
        raise ValueError(f"scaling type {kind!r} needs 'factor' (transformers requires it too), "
                         f"got keys {sorted(str(k) for k in scaling)}")
    # keys this type does not read: a warning, as transformers gives (a misspelled optional
    # key would otherwise be dropped without a word)
    unread = sorted(str(k) for k in set(scaling) - _SCALING_KEYS[kind])
    if unread and not torch.compiler.is_compiling():  # (fullgraph cannot trace a warning)
        warnings.warn(f"scaling type {kind!r} does not read the key(s) {unread} (it reads "
                      f"{sorted(_SCALING_KEYS[kind])})", stacklevel=3)
    if kind == "default":  # transformers' name for no scaling
        return inv(base), 1.0
    factor = number("factor", None)

    def orig(default=None):
        # HF's dynamic NTK reads L0 from the config's max_position_embeddings only (an
        # original_max_position_embeddings in its rope_parameters is ignored there): either
        # key is taken, and where a "dynamic" dict carries both, max_position_embeddings, as
        # HF does ("ntk", attn_ext's own name, keeps original_max_position_embeddings first)
        key = "original_max_position_embeddings"
        mpe = scaling.get("max_position_embeddings") is not None
        if mpe and (kind == "dynamic" or (kind == "ntk" and scaling.get(key) is None)):
            key = "max_position_embeddings"
        v = scaling.get(key, default)
        if v is None:
            raise ValueError(f"scaling type {kind!r} needs 'original_max_position_embeddings'"
                             + (" (or 'max_position_embeddings')" if kind in ("ntk", "dynamic") else ""))
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
            raise ValueError(f"scaling[{key!r}] must be an int > 0, got {v!r}")
        return int(v)

    if kind == "linear":
        # Position interpolation: pos / factor, i.e. every frequency divided by factor.
        return inv(base) / factor, 1.0
    if kind in ("ntk", "dynamic"):
        # Dynamic NTK (HF "dynamic"): base' = base * (factor*L/L0 - (factor-1))^(dim/(dim-2))
        # with L = max(seq_len, L0): unchanged up to the original context L0.
        L0 = orig()
        if dim <= 2:
            raise ValueError(f"scaling type {kind!r} needs rotary_dim > 2 (the exponent is "
                             f"d / (d - 2)), got rotary_dim = {dim}")
        L = max(seq_len, L0)
        new_base = base * ((factor * L / L0) - (factor - 1)) ** (dim / (dim - 2))
        return inv(new_base), 1.0
    if kind == "yarn":
        L0 = orig()
        beta_fast = number("beta_fast", 32.0)
        beta_slow = number("beta_slow", 1.0)

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = optional_number("attention_factor", True)
        if attn is None:
            m, m_all = optional_number("mscale", False), optional_number("mscale_all_dim", False)
            attn = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)

        def correction_dim(rotations):  # dim index whose wavelength fits `rotations` times in L0
            return dim * math.log(L0 / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        truncate = scaling.get("truncate", True)
        if truncate is not None:  # (None: no truncation, as transformers reads it)
            _check_flag(truncate, "scaling['truncate']")  # ("no" used to truncate)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low)
                / (high - low)).clamp(0, 1)
        extrapolate = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate (/ factor)
        f = inv(base)
        return f / factor * (1 - extrapolate) + f * extrapolate, float(attn)
    # llama3
    L0 = orig(8192)
    low_ff = number("low_freq_factor", 1.0)
    high_ff = number("high_freq_factor", 4.0)
    if not high_ff > low_ff:
        raise ValueError(f"llama3 scaling needs high_freq_factor > low_freq_factor, got {high_ff}, {low_ff}")
    f = inv(base)
    wavelen = 2 * math.pi / f
    low_wavelen, high_wavelen = L0 / low_ff, L0 / high_ff
    smooth = (L0 / wavelen - low_ff) / (high_ff - low_ff)
    scaled = torch.where(wavelen > low_wavelen, f / factor, f)
    smoothed = (1 - smooth) * f / factor + smooth * f
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def rope_cache(
    seq_len: int,
    rotary_dim: int,
    base: float = 10000.0,
    scaling: Optional[dict] = None,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
):
    """``(cos, sin)`` tables of shape ``(seq_len, rotary_dim/2)`` for :func:`rope`.

    ``cos[p, i] = a * cos(p * inv_freq_i)``, ``sin[p, i] = a * sin(p * inv_freq_i)``, computed
    in float64 and cast to ``dtype`` (default float32, which :func:`rope` accepts for every
    x dtype). Unscaled: ``inv_freq_i = base^(-2i/rotary_dim)``, ``a = 1``. ``scaling`` follows
    Hugging Face transformers' ``modeling_rope_utils`` rope-init functions
    (key ``"type"`` or ``"rope_type"``; a ``"rope_theta"`` entry, as in transformers'
    ``rope_parameters``, must equal ``base``; every type but ``"default"`` needs ``"factor"``,
    and a key the type does not read gives a warning naming it):

    - ``{"type": "default"}``: no scaling (transformers' name for it).
    - ``{"type": "linear", "factor": f}``: position interpolation, ``inv_freq_i / f``
      (same as positions ``p / f``).
    - ``{"type": "ntk" | "dynamic", "factor": f, "original_max_position_embeddings": L0}``
      (or ``"max_position_embeddings": L0``, where Hugging Face's config keeps it; for
      ``"dynamic"`` it wins where both are given, as in transformers):
      *dynamic* NTK (HF ``"dynamic"``): ``base' = base * (f*L/L0 - (f-1))^(d/(d-2))`` with
      ``L = max(seq_len, L0)`` and ``d = rotary_dim``, so tables up to ``L0`` are unscaled.
      (The fixed NTK-aware variant ``base * f^(d/(d-2))`` is not this one.)
    - ``{"type": "yarn", "factor": f, "original_max_position_embeddings": L0, "beta_fast":
      32, "beta_slow": 1, ["attention_factor", "mscale", "mscale_all_dim", "truncate"]}``:
      correction dims ``d_r = d*ln(L0/(2*pi*r)) / (2*ln(base))`` for ``r = beta_fast``
      (low, floored) and ``beta_slow`` (high, ceiled), clamped to ``[0, d-1]``; ramp
      ``m_i = clamp((i - low)/(high - low), 0, 1)``;
      ``inv_freq_i = base^(-2i/d) * (m_i / f + (1 - m_i))``; ``a = 0.1*ln(f) + 1`` (f > 1)
      unless ``attention_factor`` (or mscale/mscale_all_dim) says otherwise.
    - ``{"type": "llama3", "factor": f, "low_freq_factor": 1, "high_freq_factor": 4,
      "original_max_position_embeddings": 8192}``: with wavelength ``w_i = 2*pi/inv_freq_i``:
      ``w_i < L0/high`` unchanged, ``w_i > L0/low`` divided by ``f``, in between
      ``(1 - t) * inv_freq_i / f + t * inv_freq_i`` with ``t = (L0/w_i - low)/(high - low)``.
    """
    if not _is_int(seq_len):
        raise ArgumentTypeError(f"seq_len must be an int, got {type(seq_len).__name__}")
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    dtype = dtype or torch.float32
    _check_table_dtype(dtype)
    inv_freq, attn = rope_inv_freq(rotary_dim, base, scaling, seq_len)
    # (on the CPU, as rope_inv_freq's constants, whatever the default device; then moved to
    # `device`, by default the default device, as a factory function's result)
    if device is None:  # (torch.get_default_device() cannot be traced by torch.compile)
        device = torch.empty(0).device
    angle = torch.arange(seq_len, dtype=torch.float64, device="cpu")[:, None] * inv_freq[None, :]
    cos = (torch.cos(angle) * attn).to(dtype=dtype, device=device)
    sin = (torch.sin(angle) * attn).to(dtype=dtype, device=device)
    return cos, sin


def _rope_fake_checks(x, cos, sin, name="x", positions=None):
    """The kernels' shape and dtype rules (make_rope_params / add_rope_tensor, rope_args.h) in
    the fake kernels, which are all that runs on meta tensors. (The offset's range against
    cos's rows is left to the kernel: under torch.compile it would guard on the values.)"""
    torch._check(x.dim() == 4, lambda: f"{name} must have 4 dims (B, S, H, D), got shape {list(x.shape)}")
    for t_name, t in (("cos", cos), ("sin", sin)):
        torch._check(t.dim() == 2, lambda: f"{t_name} must have 2 dims (S_max, rotary_dim/2), got "
                                           f"shape {list(t.shape)}")
    _fake_check(lambda: list(cos.shape) == list(sin.shape), (*cos.shape, *sin.shape),
                lambda: f"cos and sin must have the same shape, got cos {list(cos.shape)} and "
                        f"sin {list(sin.shape)}")
    torch._check(cos.dtype == sin.dtype, lambda: f"cos and sin must have the same dtype, got cos "
                                                 f"{cos.dtype} and sin {sin.dtype}")
    torch._check(cos.dtype in (torch.float32, x.dtype),
                 lambda: f"cos/sin must be float32 or x's dtype ({x.dtype}), got {cos.dtype}")
    _fake_check(lambda: 2 * cos.shape[1] <= x.shape[3], (cos.shape[1], x.shape[3]),
                lambda: f"rotary_dim = 2 * cos.size(-1) = {2 * cos.shape[1]} must be <= the head "
                        f"dim D = {name}.size(-1) = {x.shape[3]}")
    _fake_same_device(x, name, cos=cos, sin=sin, positions=positions)


def _rope_fake_out(x, cos, sin, name="x", positions=None):
    _rope_fake_checks(x, cos, sin, name, positions)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("attn_ext::rope")
def _rope_fake(x, cos, sin, positions=None, offset=0, interleaved=False):
    return _rope_fake_out(x, cos, sin, positions=positions)


@torch.library.register_fake("attn_ext::_rope_backward")
def _rope_backward_fake(grad, cos, sin, positions=None, offset=0, interleaved=False):
    return _rope_fake_out(grad, cos, sin, "grad", positions)


@torch.library.register_fake("attn_ext::rope_")
def _rope_inplace_fake(x, cos, sin, positions=None, offset=0, interleaved=False):
    _rope_fake_checks(x, cos, sin, "x", positions)
    return None


@torch.library.register_fake("attn_ext::rope_qk_")
def _rope_qk_inplace_fake(q, k, cos, sin, positions=None, offset=0, interleaved=False):
    _rope_fake_checks(q, cos, sin, "q", positions)
    _rope_fake_checks(k, cos, sin, "k", positions)
    torch._check(k.dtype == q.dtype, lambda: f"k must have q's dtype ({q.dtype}), got {k.dtype}")
    _fake_check(lambda: k.shape[0] == q.shape[0] and k.shape[1] == q.shape[1],
                (*q.shape[:2], *k.shape[:2]),
                lambda: f"k must have B = {q.shape[0]} and S = {q.shape[1]} (the first two dims "
                        f"of q), got shape {list(k.shape)}")
    _fake_same_device(q, "q", k=k)
    return None


def _rope_setup(ctx, inputs, output):
    _x, cos, sin, positions, offset, interleaved = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.offset = offset
    ctx.interleaved = interleaved


def _tables_grad_error(ctx):
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        raise RuntimeError(
            "attn_ext.rope: gradients w.r.t. cos/sin are not supported; detach the tables"
        )


def _last_dim_contiguous(g):
    # Autograd may hand us an expanded gradient (e.g. of .sum(): all strides 0); the
    # kernels read rows with stride 1.
    # An empty one may come with all strides 0 and count as contiguous: give it real strides.
    if g.numel() == 0:
        return torch.empty_like(g, memory_format=torch.contiguous_format)
    return g if g.size(-1) <= 1 or g.stride(-1) == 1 else g.contiguous()


def _rope_backward(ctx, grad):
    _tables_grad_error(ctx)
    cos, sin, positions = ctx.saved_tensors
    grad = _last_dim_contiguous(grad)
    gx = _lib._rope_backward(grad, cos, sin, positions, ctx.offset, ctx.interleaved)
    return gx, None, None, None, None, None


def _rope_inverse_backward(ctx, grad):
    _tables_grad_error(ctx)
    cos, sin, positions = ctx.saved_tensors
    grad = _last_dim_contiguous(grad)
    gx = _lib.rope(grad, cos, sin, positions, ctx.offset, ctx.interleaved)
    return gx, None, None, None, None, None


_register_autograd("rope", _rope_backward, setup_context=_rope_setup)
_register_autograd("_rope_backward", _rope_inverse_backward, setup_context=_rope_setup)


# ---------------------------------------------------------------------------------------
# the in-place ops under autograd (rope_, rope_qk_, sinusoidal_pe_; also when called as
# torch.ops.attn_ext.* or from TorchScript)
# ---------------------------------------------------------------------------------------
#
# The C++ library registers only their CPU / CUDA kernels, and torch's fallbacks neither
# refuse a written tensor that autograd tracks nor bump its version counter: a gradient
# through it silently skipped the rotation, and a graph that had saved it backpropagated
# through the overwritten values. The two kernels below do what torch does for its own
# in-place ops (and torch.library.custom_op for mutating ones): the Autograd kernel refuses a
# written argument that requires grad (the ops are not differentiable; the out-of-place ops
# are), the ADInplaceOrView kernel bumps the written arguments' versions.

_INPLACE_WRITES = {"rope_": ("x",), "rope_qk_": ("q", "k"), "sinusoidal_pe_": ("x",)}


def _refuse_inference_writes(name, written) -> None:
    """Outside torch.inference_mode(), writing an inference tensor is refused, as aten's
    in-place ops refuse it. ``written``: (tensor, argument name) pairs."""
    inference_mode = torch.is_inference_mode_enabled()
    for t, arg_name in written:
        if t.is_inference() and not inference_mode:
            raise RuntimeError(
                f"attn_ext::{name}: {arg_name} is an inference tensor (made under "
                f"torch.inference_mode()); an in-place update to it outside InferenceMode "
                f"is not allowed. Clone it, or call this inside torch.inference_mode()")


def _bump_versions(written) -> None:
    """The written tensors' version counters, as torch's in-place ops bump them (inference
    tensors keep none)."""
    for t, _ in written:
        if not t.is_inference():
            torch.autograd.graph.increment_version(t)


def _inplace_kernels(name, written):
    op = getattr(_lib, name).default
    positions = [i for i, a in enumerate(op._schema.arguments) if a.name in written]
    assert positions == list(range(len(written))), name  # (_call_inplace_op reads them so)

    def targets(args, kwargs):  # the written tensors, passed by position or by name
        out = [(args[i] if i < len(args) else kwargs[nm], nm) for i, nm in zip(positions, written)]
        for t, arg_name in out:  # (None reached these kernels before the op's own checks)
            if not isinstance(t, torch.Tensor):
                raise ArgumentTypeError(f"attn_ext::{name}: {arg_name} must be a tensor, got "
                                        f"{'None' if t is None else type(t).__name__}")
        return out

    def autograd_kernel(keyset, *args, **kwargs):
        _refuse_forward_ad(name, args, kwargs)
        if torch.is_grad_enabled():
            for t, arg_name in targets(args, kwargs):
                if t.requires_grad:
                    raise RuntimeError(
                        f"attn_ext::{name}: {arg_name} requires grad, and the in-place op is not "
                        f"differentiable (its gradient would silently skip it); use the "
                        f"out-of-place op in training, or call it under torch.no_grad()")
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)

    def inplace_or_view_kernel(keyset, *args, **kwargs):
        # Runs for every call outside torch.inference_mode() (the key is in the default TLS
        # set), and inside it when another argument is a normal tensor.
        written_now = targets(args, kwargs)
        _refuse_inference_writes(name, written_now)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = op.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args, **kwargs)
        _bump_versions(written_now)
        return out

    def math_bit_kernel(keyset, *args, **kwargs):
        # A written tensor with the negative / conjugate bit set (torch's math-bit fallback
        # failed with "Expected Tensor but got None", naming neither op nor argument: it takes
        # a mutating op to return its argument); in every mode, inference mode included.
        for t, arg_name in targets(args, kwargs):
            if t.is_neg() or t.is_conj():
                raise RuntimeError(
                    f"attn_ext::{name}: {arg_name} is a lazily negated / conjugated view (its "
                    f"negative or conjugate bit is set, e.g. z.conj().imag); write to "
                    f"{arg_name}.resolve_neg().resolve_conj(), or use the out-of-place op")
        # a read-only argument with the bit (cos, sin, positions): its resolved copy
        def resolved(a):
            return a.resolve_neg().resolve_conj() if isinstance(a, torch.Tensor) else a

        rest = keyset.remove(torch._C.DispatchKey.Negative).remove(torch._C.DispatchKey.Conjugate)
        return op.redispatch(rest, *[resolved(a) for a in args],
                             **{k: resolved(a) for k, a in kwargs.items()})

    _impl_lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    _impl_lib.impl(name, inplace_or_view_kernel, "ADInplaceOrView", with_keyset=True)
    _impl_lib.impl(name, math_bit_kernel, "Negative", with_keyset=True)
    _impl_lib.impl(name, math_bit_kernel, "Conjugate", with_keyset=True)


for _name, _written in _INPLACE_WRITES.items():
    _inplace_kernels(_name, _written)


# ---------------------------------------------------------------------------------------
# scaled dot-product attention
# ---------------------------------------------------------------------------------------


def _check_qkv(q, k, v, q_what: str, k_what: str, v_what: str) -> None:
    _check_tensor(q, "q", q_what)
    _check_tensor(k, "k", k_what)
    _check_tensor(v, "v", v_what)


def _heads_4d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """3-D ``(B, S, D)`` q/k/v are the single-head form: free ``(B, S, 1, D)`` views.
    Returns ``(q, k, v, squeeze)``; ``squeeze`` says the caller must drop the head dim again."""
    if q.dim() != 3:
        return q, k, v, False
    if k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            "with 3-D q (B, Sq, D), k and v must be 3-D (B, Sk, D) / (B, Sk, Dv), got "
            f"k shape {list(k.shape)} and v shape {list(v.shape)}"
        )
    # the kernels' shape rules, stated here in the 3-D shapes the caller passed (the kernels
    # would name the (B, S, 1, D) views)
    B, D = q.size(0), q.size(2)
    shapes = f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
    if k.size(0) != B or v.size(0) != B:
        raise ValueError(f"with 3-D q (B, Sq, D), k and v must have batch size B = {B} (from q), got {shapes}")
    if k.size(2) != D:
        raise ValueError(f"with 3-D q (B, Sq, D), k must have head dim D = {D} (from q), got {shapes}")
    if v.size(1) != k.size(1):
        raise ValueError(f"with 3-D q (B, Sq, D), v must have Sk = {k.size(1)} keys (from k), got {shapes}")
    return q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), True


def _window_args(window) -> tuple:
    """``window=(left, right)`` -> the ops' ``(window_left, window_right)``; None = (-1, -1)."""
    if window is None:
        return -1, -1
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(_is_int(w) for w in window)
    ):
        raise ValueError(f"window must be a pair of ints (left, right), got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(
            f"window must be (left, right) with each side >= 0, or -1 for unbounded, got {window!r}"
        )
    if left >= 2**63 or right >= 2**63:  # the ops take int64 (torch's parser would say only
        raise ValueError(                 # "expected int, found int")
            f"window sides must be below 2**63 (use -1 for unbounded), got {window!r}"
        )
    return left, right


# dropout::kMaxDropoutP of csrc/common/dropout_rng.h: the keep bits have 16-bit resolution, and
# past this every key would be dropped
_MAX_DROPOUT_P = 1.0 - 2.0**-16


_FLOAT_MAX = sys.float_info.max


def _number_repr(x) -> str:
    """A number for an error message (an int as it is, shortened past float's range, where it
    has no float)."""
    if not isinstance(x, numbers.Integral):
        return f"{float(x)!r}"  # (an f-string: dynamo traces it for a symbolic float)
    if abs(x) <= _FLOAT_MAX:
        return f"{x!r}"
    return f"an int of {len(str(abs(int(x))))} digits, beyond float's range"


def _is_int(x) -> bool:
    """An int (numpy's too, and a symbolic one: a size under torch.export), not a bool."""
    return not isinstance(x, bool) and isinstance(x, (numbers.Integral, torch.SymInt))


def _host_number(x):
    """A numpy float scalar as a Python float, anything else as it is: comparing a numpy
    float32 with _FLOAT_MAX casts the bound to float32 (inf, with an overflow warning on every
    call), so np.float32(inf) passed the range checks. (Not float() for everything: an int
    past float's range has none, and a symbolic float under torch.compile stays symbolic.)"""
    if type(x).__module__ == "numpy" and not isinstance(x, numbers.Integral):
        return float(x)
    return x


def _checked_softcap(softcap) -> Optional[float]:
    """softcap: None or a number with 0 < softcap < inf, as a float (the ops' and the layers'
    check). Comparisons, not math.isfinite, and float() to format it, so that a symbolic
    float would trace (torch.compile specialises float arguments by default: each new softcap
    compiles anew, as the op's float schema asks)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ValueError(f"softcap must be a finite number > 0 (or None), got {softcap!r}")
    softcap = _host_number(softcap)
    if not 0 < softcap <= _FLOAT_MAX:
        raise ValueError(
            f"softcap must be a finite number > 0 (or None), got {_number_repr(softcap)}")
    return float(softcap)


def _check_scale(scale) -> None:
    """scale: None or a finite number. A bool is refused (the op's float parser would take it
    as 0 / 1), and so is a string or a tensor, by name. Comparisons, not math.isfinite, as
    for softcap (_checked_softcap)."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ArgumentTypeError(f"scale must be finite (a number or None), got {scale!r}")
    scale = _host_number(scale)
    if not -_FLOAT_MAX <= scale <= _FLOAT_MAX:  # (an int past float's range: no float())
        raise ArgumentValueError(
            f"scale must be finite (a number or None), got {_number_repr(scale)}")


def _check_return_lse(return_lse) -> None:
    """return_lse must be a bool, Python's or numpy's ("no" or a tensor used to count as True /
    fail in bool())."""
    if not isinstance(return_lse, bool) and not _is_numpy_bool(return_lse):
        raise ArgumentTypeError(f"return_lse must be a bool, got {return_lse!r}")


def _is_numpy_bool(value) -> bool:
    """numpy's bool (np.True_), which the ops' parser takes as a bool."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")


def _check_flag(value, name: str) -> None:
    """A bool argument of an op (causal, interleaved, inplace): a bool (Python's or numpy's), an
    int 0 / 1 (numpy's too), a symbolic bool (torch.export: ``x.size(1) > 1``) or a 0-dim bool
    tensor (what such a comparison gives under torch.jit.trace). None or a string used to pass
    the op's parser as False (an in-place rotation for inplace="no"), and 2 as True.
    (ArgumentValueError: the ValueError of the layers' checks and the RuntimeError the op's
    parser raised.)"""
    if isinstance(value, (bool, torch.SymBool)) or _is_numpy_bool(value):
        return
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.bool:
        return
    raise ArgumentValueError(f"{name} must be a bool, got {value!r}")


def _check_causal(causal) -> None:
    _check_flag(causal, "causal")


def _one_number_tensor(t, integral: bool) -> bool:
    """A one-element tensor the ops' parser takes as a number: integer-typed for an int
    (integral), any real type for a float; never bool or complex."""
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype == torch.bool or t.is_complex():
        return False
    return not (integral and t.is_floating_point())


def _check_offset(offset) -> None:
    """offset (rope, sinusoidal_pe): an int (numpy's, symbolic, or a one-element integer
    tensor); a bool used to pass as 0 / 1 and None as 0."""
    if _one_number_tensor(offset, integral=True) or isinstance(offset, torch.SymInt):
        return
    if not _is_int(offset):
        raise ArgumentTypeError(f"offset must be an int, got {offset!r}")
    if not -2**63 <= offset < 2**63:  # (torch's parser: "expected int, found int")
        raise ArgumentValueError(f"offset must fit in int64, got {_number_repr(offset)}")


def _check_base(base) -> None:
    """base (sinusoidal_pe): a real number (numpy's, Decimal, symbolic, or a one-element
    tensor; the op checks that it is positive and finite); a bool used to pass as 1.0."""
    if isinstance(base, (torch.SymFloat, torch.SymInt)) or _one_number_tensor(base, integral=False):
        return
    if isinstance(base, bool) or not isinstance(base, (numbers.Real, decimal.Decimal)):
        raise ArgumentTypeError(f"base must be a positive finite number, got {base!r}")


def _check_key_padding_mask(key_padding_mask, B: int, Sk: int, device=None) -> None:
    """A key_padding_mask checked on the host (where no kernel checks it first): None, or
    bool of shape (B, Sk), on `device` (q's) when given."""
    if key_padding_mask is None:
        return
    if (not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool
            or tuple(key_padding_mask.shape) != (B, Sk)):
        got = (f"dtype {key_padding_mask.dtype}, shape {list(key_padding_mask.shape)}"
               if isinstance(key_padding_mask, torch.Tensor) else type(key_padding_mask).__name__)
        raise ValueError(f"key_padding_mask must be bool (B, Sk) = ({B}, {Sk}), got {got}")
    if device is not None and key_padding_mask.device != torch.device(device):
        raise ValueError(f"key_padding_mask must be on the same device as q ({device}), got "
                         f"{key_padding_mask.device}")


def _dropout_seed_offset(device: torch.device) -> Tuple[int, int]:
    """``(seed, offset)`` of one dropout call, drawn from torch's generator of ``device`` (so
    ``torch.manual_seed`` reproduces a run); the kernels' keep bits are a pure function of
    them and the position (csrc/common/dropout_rng.h, reference.dropout_keep_mask). Used by
    the functional API and the modules (TorchScript-clean)."""
    if torch.jit.is_tracing():
        # the trace would keep this call's draw as two constants: one dropout mask forever
        raise RuntimeError(
            "attention dropout cannot be traced by torch.jit.trace: the trace would record "
            "this call's random seed as a constant (the same dropout mask on every call). "
            "Trace in eval mode (or with dropout_p=0), or use torch.jit.script, torch.compile "
            "or torch.export, which draw a fresh seed per call")
    r = torch.randint(0, 4611686018427387904, (2,), dtype=torch.int64, device=device)  # 2**62
    if torch.jit.is_scripting():
        return int(r[0].item()), int(r[1].item())
    else:
        if not torch.compiler.is_compiling() and (
                r.device.type == "meta" or isinstance(r, torch._subclasses.FakeTensor)):
            # meta tensors or an eager FakeTensorMode: shapes only, no values to draw (the
            # call's output is as empty of values); .tolist() raised there
            return 0, 0
        # eager / torch.compile / torch.export: no int(), which would guard on a
        # data-dependent value under tracing (the ops' dropout_seed / dropout_offset are SymInt)
        return _drawn_seed_offset(r)


def _drawn_seed_offset(r: torch.Tensor) -> Tuple[int, int]:
    """_dropout_seed_offset's two values, outside TorchScript (which cannot parse the try)."""
    try:
        seed, offset = r.tolist()
    except RuntimeError as e:
        # torch.func.vmap(randomness="different") draws one seed per sample, as a batched
        # tensor without values to read here
        if torch._C._are_functorch_transforms_active():
            raise RuntimeError(
                "attn_ext: attention dropout under torch.func.vmap(randomness='different') "
                "is not supported: a call takes one dropout seed (vmap runs the op once per "
                "sample with it), so the samples cannot get different masks. Use "
                "randomness='same' (one mask for every sample), or put the vmapped "
                "dimension into the batch dimension B (each (b, h) gets its own mask)") from e
        raise
    return seed, offset


def _score_term_args(q, alibi_slopes, rel_bias, softcap, sinks, dropout_p):
    """Checks the score-term keywords and returns the ops' arguments
    ``(alibi_slopes, rel_bias, softcap, sinks, dropout_p, seed, offset)``: tables cast to the
    accumulation type (float32; float64 for float64 inputs; differentiable casts) and made
    contiguous, dropout seed/offset drawn when ``dropout_p > 0``."""
    terms = _checked_score_terms(q, alibi_slopes, rel_bias, softcap, sinks, dropout_p)
    seed, offset = _dropout_seed_offset(q.device) if terms[4] > 0 else (0, 0)
    return (*terms, seed, offset)


def _refuse_alibi_grad(alibi_slopes, in_autograd_setup: bool = False) -> None:
    """ALiBi slopes that would record a gradient are refused rather than silently detached
    (DESIGN: no gradient for ALiBi slopes): by the wrappers, and by the ops' autograd setup
    for callers of torch.ops.attn_ext.* (TorchScript, C++), whose slopes used to get none
    (setup_context runs only when a gradient is recorded, with grad mode off)."""
    if (isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.requires_grad
            and (torch.is_grad_enabled() or in_autograd_setup)):
        raise ValueError("alibi_slopes get no gradient (ALiBi's slopes are fixed); pass "
                         "alibi_slopes.detach(), or use rel_bias for a learnable position bias")


# The largest softcap below float64: half of float32's maximum, so that softcap and softcap *
# log2 e (the CUDA kernels' base-2 units) stay finite in float32 (an inf cap made every output
# NaN: inf * tanh(s / inf)).
_MAX_FLOAT_SOFTCAP = float(torch.finfo(torch.float32).max) / 2


def _checked_score_terms(q, alibi_slopes, rel_bias, softcap, sinks, dropout_p):
    """The Python side of the score-term checks (types, softcap, dropout_p, ALiBi without
    gradient): ``(alibi_slopes, rel_bias, softcap, sinks, dropout_p)`` with the tables in the
    accumulation type. The kernels check the tables' shapes (csrc/common/score_checks.h)."""
    acc = _lse_dtype(q.dtype)

    def table(t, name, shape):
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a floating-point tensor {shape}, got {got}")
        return t.to(acc).contiguous()

    _refuse_alibi_grad(alibi_slopes)
    alibi_slopes = table(alibi_slopes, "alibi_slopes", "(H,) or (B, H)")
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach()  # ALiBi slopes are fixed (no gradient)
    rel_bias = table(rel_bias, "rel_bias", "(H, 2M + 1)")
    sinks = table(sinks, "sinks", "(H,)")
    softcap = _checked_softcap(softcap)
    if softcap is not None and q.dtype != torch.float64 and softcap > _MAX_FLOAT_SOFTCAP:
        # (csrc/common/score_checks.h's rule, here too for attention_weights' float32 math)
        raise ArgumentValueError(
            f"softcap must be at most {_MAX_FLOAT_SOFTCAP:g} for {q.dtype} inputs (the kernels "
            f"cap float32 scores), got {softcap!r}")
    dropout_p = _checked_dropout(dropout_p, "dropout_p")
    return alibi_slopes, rel_bias, softcap, sinks, dropout_p


def _checked_dropout(p, name: str) -> float:
    """A dropout probability the kernels take (the ops' dropout_p, the layers' dropout), as a
    float; a ValueError naming ``name`` otherwise."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= _MAX_DROPOUT_P:
        raise ValueError(f"{name} must be in [0, 1) (at most 1 - 2^-16: the keep bits are drawn "
                         f"at 16-bit resolution), got {p!r}")
    return float(p)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    window=None,
    key_padding_mask: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    rel_bias: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
):
    """``softmax(scale * q k^T [+ mask]) v`` without any ``(Sq, Sk)`` buffer.

    Everything after ``v`` is keyword-only: ported code that passed a 4th positional
    argument (``dropout_p`` in ``flash_attn_func``, ``attn_mask`` in SDPA) fails loudly
    instead of silently meaning ``causal``. (``torch.ops.attn_ext.attention(q, k, v, causal,
    scale)`` keeps its positional schema for TorchScript.)

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
        window: ``(left, right)`` sliding window: with ``d = i + (Sk - Sq) - j``, row ``i``
            sees key ``j`` iff ``-right <= d <= left``; ``-1`` leaves a side unbounded;
            ``causal=True`` is ``right = 0``. Hugging Face's ``sliding_window=W`` (W keys
            including the query itself) is ``window=(W - 1, 0)`` with ``causal=True``.
        key_padding_mask: ``(B, Sk)`` bool, True where the key takes part (Hugging Face's
            ``attention_mask == 1``). Any pattern (left or right padding); a row whose keys
            are all masked gives output 0 and lse ``-inf``.

    Score terms (DESIGN.md, "Attention variants"), with the same ``d``; tables may be any
    floating dtype (they are used in float32, float64 for float64 inputs):

        softcap: ``s = softcap * tanh(s / softcap)`` on the scaled score, before the biases
            and the mask (Gemma 2). Must be > 0 and finite; below float64 at most half of
            float32's maximum (1.7e38; the kernels cap float32 scores).
        alibi_slopes: ``(H,)`` or ``(B, H)``: ``s -= slope[b, h] * |d|`` (ALiBi, Press et al.;
            :func:`attn_ext.alibi_slopes`). No gradient (slopes that require grad are refused).
            The lse is exact (not shifted).
        rel_bias: ``(H, 2M + 1)`` learnable relative position bias ``b_{i-j}``:
            ``s += rel_bias[h, M + clamp(d, -M, M)]`` (:class:`attn_ext.RelativePositionBias`
            builds it, T5 buckets included). Differentiable: its gradient is computed inside
            the backward (no ``(Sq, Sk)`` buffer), deterministic for a given thread count.
        sinks: ``(H,)`` attention-sink logits (GPT-OSS): ``exp(sinks[h])`` joins every row's
            softmax denominator and outputs nothing; lse includes it, so a row that sees no
            key has output 0 and lse ``sinks[h]``. Differentiable.
        dropout_p: dropout on the probabilities (rescaled by ``1 / (1 - p)``), applied
            whenever ``dropout_p > 0`` (pass 0 in eval). The keep bit of ``(b, h, i, j)`` is a
            pure function of a seed/offset drawn from torch's generator of q's device and the
            position: the backward sees the same mask, for any tiling and thread count, and
            ``torch.manual_seed`` reproduces it. The keep bits are drawn at 16-bit resolution:
            a probability is dropped with ``round(p * 2^16) / 2^16`` (at most ``1 - 2^-16``;
            a ``p`` below ``2^-17`` drops nothing, though the output is still scaled by
            ``1 / (1 - p)``), within ``2^-17`` of ``p``.
        return_lse: also return the log-sum-exp of each score row.

    A key a row cannot see never affects that row (an inf/NaN in a masked key's k or v
    leaves the row finite), forward and backward.

    Returns ``out (B, Sq, H, Dv)`` (contiguous, q's dtype; ``(B, Sq, Dv)`` for 3-D input), and
    with ``return_lse`` also ``lse (B, H, Sq)`` (``(B, Sq)`` for 3-D input), float32 — float64
    for float64 inputs. Differentiable in q, k, v through ``out`` and ``lse`` (the lse
    gradient folds into the backward's row term).
    """
    _check_qkv(q, k, v, "(B, Sq, H, D) or (B, Sq, D)", "(B, Sk, Hkv, D)", "(B, Sk, Hkv, Dv)")
    q, k, v, squeeze = _heads_4d(q, k, v)
    _check_causal(causal)
    _check_return_lse(return_lse)
    _check_scale(scale)
    left, right = _window_args(window)
    # (no score term and no dropout: nothing to check or convert, which is ~2 us of a small
    # decode step; bool is not a dropout_p, and _checked_dropout refuses it below)
    plain = (alibi_slopes is None and rel_bias is None and softcap is None and sinks is None
             and type(dropout_p) in (float, int) and dropout_p == 0)
    if return_lse or key_padding_mask is not None or (left, right) != (-1, -1) or not plain:
        terms = _score_term_args(q, alibi_slopes, rel_bias, softcap, sinks, dropout_p)
        out, lse = _call_op(_lib.attention_forward, q, k, v, causal, scale, left, right,
                            key_padding_mask, *terms)
        if not return_lse:
            return out.squeeze(2) if squeeze else out
        return (out.squeeze(2), lse.squeeze(1)) if squeeze else (out, lse)
    out = _call_op(_lib.attention, q, k, v, causal, scale)
    return out.squeeze(2) if squeeze else out


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    window=None,
    alibi_slopes: Optional[torch.Tensor] = None,
    rel_bias: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
):
    """:func:`attention` on packed sequences (FlashAttention's varlen convention).

    Args:
        q: ``(Tq, H, D)``, k: ``(Tk, Hkv, D)``, v: ``(Tk, Hkv, Dv)``: the sequences' rows one
            after another (last dim contiguous, any other strides).
        cu_seqlens_q, cu_seqlens_k: int32 ``(N + 1,)``, starting at 0, non-decreasing, ending
            at ``Tq`` / ``Tk``: sequence ``b`` owns q rows ``[cu_seqlens_q[b], cu_seqlens_q[b+1])``
            and k/v rows ``[cu_seqlens_k[b], cu_seqlens_k[b+1])``. Empty sequences are fine.
        max_seqlen_q, max_seqlen_k: bounds on the sequences' lengths (checked on CPU; on CUDA,
            without a sync, only against the packed rows: N * max_seqlen >= T).
        causal, scale, window: as in :func:`attention`, per sequence, bottom-right aligned
            to that sequence's own ``(Sq_b, Sk_b)``.
        alibi_slopes, rel_bias, softcap, sinks, dropout_p: as in :func:`attention`, per
            sequence (``alibi_slopes`` may be ``(N, H)``: one row per sequence; dropout bits at
            each sequence's own positions, batch index = sequence index).

    A row never sees another sequence's keys. Returns ``out (Tq, H, Dv)`` and with
    ``return_lse`` also ``lse (H, Tq)``. Differentiable in q, k, v (through out and lse).
    """
    _check_qkv(q, k, v, "(Tq, H, D)", "(Tk, Hkv, D)", "(Tk, Hkv, Dv)")
    _check_tensor(cu_seqlens_q, "cu_seqlens_q", "int32 (N + 1,)")
    _check_tensor(cu_seqlens_k, "cu_seqlens_k", "int32 (N + 1,)")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(m):
            raise ArgumentTypeError(f"{name} must be an int, got {type(m).__name__}")
        # (torch's parser: "expected int, found int"; a symbolic int, e.g. from .item() under
        # torch.compile, is left to the op: comparing it would guard on its value)
        if (not torch.compiler.is_compiling() and not isinstance(m, torch.SymInt)
                and not -2**63 <= m < 2**63):
            raise ArgumentValueError(f"{name} must fit in int64, got {_number_repr(m)}")
    _check_causal(causal)
    _check_return_lse(return_lse)
    _check_scale(scale)
    left, right = _window_args(window)
    terms = _score_term_args(q, alibi_slopes, rel_bias, softcap, sinks, dropout_p)
    out, lse = _call_op(
        _lib.attention_varlen_forward, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, causal, scale, left, right, *terms
    )
    return (out, lse) if return_lse else out


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None
) -> torch.Tensor:
    """:func:`attention` with ``causal=True`` (bottom-right aligned mask; see there);
    ``scale`` is keyword-only."""
    _check_qkv(q, k, v, "(B, Sq, H, D) or (B, Sq, D)", "(B, Sk, Hkv, D)", "(B, Sk, Hkv, Dv)")
    q, k, v, squeeze = _heads_4d(q, k, v)
    _check_scale(scale)
    out = _call_op(_lib.causal_attention, q, k, v, scale)
    return out.squeeze(2) if squeeze else out


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fake_check(cond, sizes, msg) -> None:
    """torch._check(cond(), msg) when every one of ``sizes`` is a plain int (meta tensors, static
    shapes). Symbolic sizes (torch.compile's dynamic shapes, torch.export's Dims) are left to the
    kernel: a check there would guard on, or constrain, the user's dynamic dimensions."""
    if all(isinstance(n, int) for n in sizes):
        torch._check(cond(), msg)


def _fake_check_qkv(q, k, v):
    """The kernels' shape and dtype rules for q, k, v (check_attention_inputs, attention_checks.h;
    check_varlen_inputs, attention_mask_checks.h), in the fake kernels too: on meta tensors the
    fake kernel is the only one that runs, and unchecked it returned an output for shapes the
    kernels refuse. Batched (B, S, H, D) or packed (T, H, D) by q's rank."""
    packed = q.dim() == 3
    n = 3 if packed else 4
    qs, ks, vs = (("(Tq, H, D)", "(Tk, Hkv, D)", "(Tk, Hkv, Dv)") if packed else
                  ("(B, Sq, H, D)", "(B, Sk, Hkv, D)", "(B, Sk, Hkv, Dv)"))
    torch._check(q.dim() == n, lambda: f"q must have {n} dims {qs}, got shape {list(q.shape)}")
    torch._check(k.dim() == n, lambda: f"k must have {n} dims {ks}, got shape {list(k.shape)}")
    torch._check(v.dim() == n, lambda: f"v must have {n} dims {vs}, got shape {list(v.shape)}")
    for name, t in (("k", k), ("v", v)):
        torch._check(t.dtype == q.dtype,
                     lambda: f"{name} must have the same dtype as q ({q.dtype}), got {t.dtype}")
    if not packed:
        B = q.shape[0]
        _fake_check(lambda: k.shape[0] == B, (B, k.shape[0]),
                    lambda: f"k must have batch size B = {B} (from q), got shape {list(k.shape)}")
        _fake_check(lambda: v.shape[0] == B, (B, v.shape[0]),
                    lambda: f"v must have batch size B = {B} (from q), got shape {list(v.shape)}")
    H, D = q.shape[-2], q.shape[-1]
    Sk, Hkv = k.shape[-3], k.shape[-2]
    _fake_check(lambda: k.shape[-1] == D, (D, k.shape[-1]),
                lambda: f"k must have head dim D = {D} (from q), got shape {list(k.shape)}")
    _fake_check(lambda: v.shape[-3] == Sk, (Sk, v.shape[-3]),
                lambda: f"v must have {'Tk' if packed else 'Sk'} = {Sk} (from k), got shape "
                        f"{list(v.shape)}")
    _fake_check(lambda: v.shape[-2] == Hkv, (Hkv, v.shape[-2]),
                lambda: f"v must have Hkv = {Hkv} heads (from k), got shape {list(v.shape)}")
    _fake_check(lambda: (Hkv > 0 and H % Hkv == 0) or (Hkv == 0 and H == 0), (H, Hkv),
                lambda: f"k's number of heads Hkv = {Hkv} must divide q's number of heads H = {H}")


def _fake_check_terms(q, B, alibi_slopes, rel_bias, sinks, softcap, dropout_p) -> None:
    """fill_score_terms' rules (score_checks.h) in the fake kernels: the tables' shapes, a
    float dtype, softcap and dropout_p's ranges (B: the batch size, or the number of packed
    sequences)."""
    H = q.shape[-2]
    float_dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    for name, t in (("alibi_slopes", alibi_slopes), ("rel_bias", rel_bias), ("sinks", sinks)):
        if t is not None:
            torch._check(t.dtype in float_dtypes,
                         lambda: f"{name} must be a floating-point table, got dtype {t.dtype}")
    if alibi_slopes is not None:
        a = alibi_slopes
        _fake_check(lambda: (a.dim() == 1 and a.shape[0] == H)
                    or (a.dim() == 2 and a.shape[0] == B and a.shape[1] == H),
                    (H, B, *a.shape),
                    lambda: f"alibi_slopes must have shape (H,) = ({H},) or (B, H) = ({B}, {H}), "
                            f"got shape {list(a.shape)}")
    if rel_bias is not None:
        r = rel_bias
        _fake_check(lambda: r.dim() == 2 and r.shape[0] == H and r.shape[1] % 2 == 1,
                    (H, *r.shape),
                    lambda: f"rel_bias must have shape (H, 2M + 1) with H = {H} and an odd number "
                            f"of distances, got shape {list(r.shape)}")
    if sinks is not None:
        _fake_check(lambda: sinks.dim() == 1 and sinks.shape[0] == H, (H, *sinks.shape),
                    lambda: f"sinks must have shape (H,) = ({H},), got shape {list(sinks.shape)}")
    if isinstance(softcap, (int, float)):
        torch._check(math.isfinite(softcap) and softcap > 0.0,
                     lambda: f"softcap must be a finite number > 0 (or None), got {softcap}")
    if isinstance(dropout_p, (int, float)):
        torch._check(math.isfinite(dropout_p) and 0.0 <= dropout_p <= 1.0 - 2.0**-16,
                     lambda: f"dropout_p must be in [0, 1) (at most 1 - 2^-16: the keep bits are "
                             f"drawn at 16-bit resolution), got {dropout_p}")


def _fake_check_cu_seqlens(cu_seqlens_q, cu_seqlens_k):
    """check_cu_seqlens' dtype, shape and stride rules (attention_mask_checks.h) in the varlen fake
    kernels (the values are the kernel's to check). Returns N, the number of sequences."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        torch._check(cu.dtype == torch.int32,
                     lambda: f"{name} must be int32 (N + 1,), got dtype {cu.dtype}")
        torch._check(cu.dim() == 1, lambda: f"{name} must have shape (N + 1,) with N >= 0 "
                                            f"sequences, got shape {list(cu.shape)}")
        _fake_check(lambda: cu.shape[0] >= 1, (cu.shape[0],),
                    lambda: f"{name} must have shape (N + 1,) with N >= 0 sequences, got shape "
                            f"{list(cu.shape)}")
        # (the kernels read the offsets as one int32 array: a strided one is refused there,
        # so here too, or a compiled / exported graph traced and then failed when it ran)
        _fake_check(lambda: cu.shape[0] <= 1 or cu.stride(0) == 1, (cu.shape[0], cu.stride(0)),
                    lambda: f"{name} must be contiguous, got strides {list(cu.stride())}")
    nq, nk = cu_seqlens_q.shape[0], cu_seqlens_k.shape[0]
    _fake_check(lambda: nk == nq, (nq, nk),
                lambda: f"cu_seqlens_k must have as many sequences as cu_seqlens_q ({nq} "
                        f"entries), got {nk}")
    return nq - 1


def _fake_check_grad_inputs(q, v, dout, out, lse, dlse=None):
    """check_attention_bwd_inputs (attention_checks.h) / check_varlen_bwd_inputs in the
    backward's fake kernels: dout and out have the forward's output shape and q's dtype, lse
    its (B, H, Sq) / (H, Tq) shape."""
    if q.dim() == 3:
        o_shape, l_shape, o_dims, l_dims = ([q.shape[0], q.shape[1], v.shape[-1]],
                                            [q.shape[1], q.shape[0]], "(Tq, H, Dv)", "(H, Tq)")
    else:
        B, Sq, H, _ = q.shape
        o_shape, l_shape, o_dims, l_dims = [B, Sq, H, v.shape[-1]], [B, H, Sq], \
            "(B, Sq, H, Dv)", "(B, H, Sq)"
    for name, t in (("dout", dout), ("out", out)):
        _fake_check(lambda: list(t.shape) == o_shape, (*o_shape, *t.shape),
                    lambda: f"{name} must have shape {o_shape} {o_dims}, got {list(t.shape)}")
        torch._check(t.dtype == q.dtype,
                     lambda: f"{name} must have the same dtype as q ({q.dtype}), got {t.dtype}")
    _fake_check(lambda: list(lse.shape) == l_shape, (*l_shape, *lse.shape),
                lambda: f"lse must have shape {l_shape} {l_dims}, got {list(lse.shape)}")
    torch._check(lse.dtype == _lse_dtype(q.dtype),
                 lambda: f"lse must be {_lse_dtype(q.dtype)} for {q.dtype} inputs, got {lse.dtype}")
    if dlse is not None:  # (check_dlse, attention_mask_checks.h)
        _fake_check(lambda: list(dlse.shape) == list(lse.shape), (*lse.shape, *dlse.shape),
                    lambda: f"dlse must have lse's shape {list(lse.shape)}, got {list(dlse.shape)}")
        torch._check(dlse.dtype == lse.dtype,
                     lambda: f"dlse must have lse's dtype {lse.dtype}, got {dlse.dtype}")


@torch.library.register_fake("attn_ext::attention_forward")
def _attention_forward_fake(q, k, v, causal, scale=None, window_left=-1, window_right=-1,
                            key_padding_mask=None, alibi_slopes=None, rel_bias=None,
                            softcap=None, sinks=None, dropout_p=0.0, dropout_seed=0,
                            dropout_offset=0, q_start=None, k_start=None):
    torch._check(q.dim() == 4, lambda: f"q must have 4 dims (B, Sq, H, D), got shape {list(q.shape)}")
    _fake_check_qkv(q, k, v)
    if key_padding_mask is not None:
        want = [q.shape[0], k.shape[1]]
        _fake_check(lambda: list(key_padding_mask.shape) == want,
                    (*want, *key_padding_mask.shape),
                    lambda: f"key_padding_mask must have shape (B, Sk) = {want}, got shape "
                            f"{list(key_padding_mask.shape)}")
    _fake_check_terms(q, q.shape[0], alibi_slopes, rel_bias, sinks, softcap, dropout_p)
    _fake_same_device(q, "q", k=k, v=v, key_padding_mask=key_padding_mask,
                      alibi_slopes=alibi_slopes, rel_bias=rel_bias, sinks=sinks)
    B, Sq, H, _ = q.shape
    out = q.new_empty((B, Sq, H, v.shape[3]))
    lse = q.new_empty((B, H, Sq), dtype=_lse_dtype(q.dtype))
    return out, lse


def _grad_layout_is_bhsd(x):
    """Whether the CPU backward returns the gradient of input x (B, S, H, D) in x's own memory
    layout: x is the transpose(1, 2) view of a contiguous (B, H, S, D) tensor (SDPA's layout).
    Then the gradient is the same kind of view, which autograd gives to the (B, H, S, D) leaf
    without a copy; every other gradient is BSHD contiguous. The rule of grad_layout in
    csrc/cpu/attention_bwd.cpp (the CUDA backward's gradients are always contiguous)."""
    return (x.device.type == "cpu" and x.dim() == 4 and x.shape[1] > 1 and x.shape[2] > 1
            and x.stride(3) == 1 and x.stride(1) == x.shape[3]
            and x.stride(2) == x.shape[1] * x.shape[3])


def _grad_like(x):
    if _grad_layout_is_bhsd(x):
        B, S, H, D = x.shape
        return x.new_empty((B, H, S, D)).transpose(1, 2)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _grads_like(q, k, v, rel_bias):
    drel_bias = (
        q.new_empty((0,), dtype=_lse_dtype(q.dtype)) if rel_bias is None
        else torch.empty_like(rel_bias, memory_format=torch.contiguous_format)
    )
    return _grad_like(q), _grad_like(k), _grad_like(v), drel_bias


@torch.library.register_fake("attn_ext::attention_backward_rel_bias")
def _attention_backward_fake(dout, q, k, v, out, lse, causal, scale=None, window_left=-1,
                             window_right=-1, key_padding_mask=None, dlse=None,
                             alibi_slopes=None, rel_bias=None, softcap=None, dropout_p=0.0,
                             dropout_seed=0, dropout_offset=0, deterministic=False,
                             q_start=None, k_start=None):
    torch._check(q.dim() == 4, lambda: f"q must have 4 dims (B, Sq, H, D), got shape {list(q.shape)}")
    _fake_check_qkv(q, k, v)
    _fake_check_grad_inputs(q, v, dout, out, lse, dlse)
    _fake_check_terms(q, q.shape[0], alibi_slopes, rel_bias, None, softcap, dropout_p)
    _fake_same_device(q, "q", dout=dout, k=k, v=v, out=out, lse=lse, dlse=dlse,
                      key_padding_mask=key_padding_mask, alibi_slopes=alibi_slopes,
                      rel_bias=rel_bias)
    return _grads_like(q, k, v, rel_bias)


@torch.library.register_fake("attn_ext::attention_backward")
def _attention_backward3_fake(*args, **kwargs):
    return _attention_backward_fake(*args, **kwargs)[:3]


@torch.library.register_fake("attn_ext::attention_varlen_forward")
def _attention_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, causal=False, scale=None, window_left=-1,
                                   window_right=-1, alibi_slopes=None, rel_bias=None,
                                   softcap=None, sinks=None, dropout_p=0.0, dropout_seed=0,
                                   dropout_offset=0):
    torch._check(q.dim() == 3, lambda: f"q must have 3 dims (Tq, H, D), got shape {list(q.shape)}")
    _fake_check_qkv(q, k, v)
    N = _fake_check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    _fake_check_terms(q, N, alibi_slopes, rel_bias, sinks, softcap, dropout_p)
    _fake_same_device(q, "q", k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      alibi_slopes=alibi_slopes, rel_bias=rel_bias, sinks=sinks)
    Tq, H, _ = q.shape
    out = q.new_empty((Tq, H, v.shape[2]))
    lse = q.new_empty((H, Tq), dtype=_lse_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("attn_ext::attention_varlen_backward_rel_bias")
def _attention_varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, causal=False, scale=None,
                                    window_left=-1, window_right=-1, dlse=None,
                                    alibi_slopes=None, rel_bias=None, softcap=None,
                                    dropout_p=0.0, dropout_seed=0, dropout_offset=0,
                                    deterministic=False):
    torch._check(q.dim() == 3, lambda: f"q must have 3 dims (Tq, H, D), got shape {list(q.shape)}")
    _fake_check_qkv(q, k, v)
    _fake_check_grad_inputs(q, v, dout, out, lse, dlse)
    N = _fake_check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    _fake_check_terms(q, N, alibi_slopes, rel_bias, None, softcap, dropout_p)
    _fake_same_device(q, "q", dout=dout, k=k, v=v, out=out, lse=lse, dlse=dlse,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      alibi_slopes=alibi_slopes, rel_bias=rel_bias)
    return _grads_like(q, k, v, rel_bias)


@torch.library.register_fake("attn_ext::attention_varlen_backward")
def _attention_varlen_backward3_fake(*args, **kwargs):
    return _attention_varlen_backward_fake(*args, **kwargs)[:3]


def _row_contiguous(g):
    # Autograd may hand us an expanded gradient (e.g. of out.sum(): all strides 0).
    return g.contiguous() if g.stride(-1) != 1 and g.shape[-1] > 1 else g


def _rows_dot(dout, out, dtype: torch.dtype, row_dim: int, max_elems: int = 1 << 20):
    """rowsum(dout * out) over the last dim, in ``dtype``: (..., H) with the rows first. In
    eager mode it runs over slices of ``row_dim`` of at most ``max_elems`` elements, through two
    buffers of that size allocated once (a single expression built out-sized temporaries: the
    product, and for 16-bit inputs both fp32 copies; fresh slices per step grew the heap); each
    row's sum is the same either way. Compiled code keeps the one expression, which inductor
    fuses without the temporaries (and a loop over a symbolic length would specialise it), and
    so does a backward that is itself differentiated (create_graph=True, torch.func
    transforms), which the buffers' in-place ops and out= would refuse."""
    n = out.shape[row_dim]
    per_row = out.numel() // n if n > 0 else 1
    step = max(1, max_elems // max(per_row, 1))
    if (step >= n or torch.compiler.is_compiling() or torch.is_grad_enabled()
            or torch._C._are_functorch_transforms_active()):
        return (dout.to(dtype) * out.to(dtype)).sum(-1)
    res = out.new_empty(out.shape[:-1], dtype=dtype)
    shape = list(out.shape)
    shape[row_dim] = step
    a, b = out.new_empty(shape, dtype=dtype), out.new_empty(shape, dtype=dtype)
    for i in range(0, n, step):
        m = min(step, n - i)
        ai, bi = a.narrow(row_dim, 0, m), b.narrow(row_dim, 0, m)
        ai.copy_(dout.narrow(row_dim, i, m))
        bi.copy_(out.narrow(row_dim, i, m))
        torch.sum(ai.mul_(bi), -1, out=res.narrow(row_dim, i, m))
    return res


def _sinks_grad(sinks, lse, out, dout, dlse, rows_dims, head_first):
    """d sinks[h] = sum over rows of exp(sinks[h] - lse) * (dlse - rowsum(dout * out)): the
    sink's probability times the row term of the softmax backward (from lse and out alone).
    out / dout are (B, Sq, H, Dv) with lse (B, H, Sq) (head_first 1), or (Tq, H, Dv) with lse
    (H, Tq) (head_first 0). Also ring attention's, on its rows."""
    di = _rows_dot(dout, out, lse.dtype, head_first)  # (..., H) rows first: sliced over Sq / Tq
    di = di.movedim(-1, head_first)  # lse's layout: (B, H, Sq) or (H, Tq)
    g = -di if dlse is None else dlse - di
    shape = [1] * lse.dim()
    shape[head_first] = -1
    sk = sinks.to(lse.dtype).view(shape)
    # a sink of -inf (no sink) has probability 0 even in a row that sees no key (lse -inf)
    p_sink = torch.where(torch.isneginf(sk), torch.zeros_like(lse), torch.exp(sk - lse))
    return (p_sink * g).sum(dim=rows_dims).to(sinks.dtype)


def _cuda_library_loaded() -> bool:
    """Whether the CUDA library is loaded: it alone defines _set_cuda_attention_kernels."""
    return hasattr(torch.ops.attn_ext, "_set_cuda_attention_kernels")


@contextlib.contextmanager
def _simple_cuda_kernels():
    """Inside the block every CUDA attention call uses the simple kernels (tests and benchmarks
    compare them with the fast ones on the same inputs). Without the CUDA library loaded
    there are no CUDA kernels to choose between, and the block runs unchanged."""
    if not _cuda_library_loaded():
        yield
        return
    prev = _lib._set_cuda_attention_kernels(1)
    try:
        yield
    finally:
        _lib._set_cuda_attention_kernels(prev)


def _attention_forward_setup(ctx, inputs, output):
    (q, k, v, causal, scale, window_left, window_right, key_padding_mask, alibi_slopes, rel_bias,
     softcap, sinks, dropout_p, dropout_seed, dropout_offset, q_start, k_start) = inputs
    _refuse_alibi_grad(alibi_slopes, in_autograd_setup=True)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, alibi_slopes, rel_bias, sinks)
    ctx.causal = causal
    ctx.scale = scale
    ctx.window = (window_left, window_right)
    ctx.terms = (softcap, dropout_p, dropout_seed, dropout_offset)
    ctx.block_position = (q_start, k_start)


def _attention_forward_backward(ctx, dout, dlse):
    # dlse (the gradient of lse) joins the row term of the backward: dS = P * (dP - (Di - dlse)).
    q, k, v, out, lse, key_padding_mask, alibi_slopes, rel_bias, sinks = ctx.saved_tensors
    softcap, dropout_p, seed, offset = ctx.terms
    dout = torch.zeros_like(out) if dout is None else _row_contiguous(dout)
    dq, dk, dv, drel_bias = _lib.attention_backward_rel_bias(
        dout, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.window[0], ctx.window[1],
        key_padding_mask, dlse, alibi_slopes, rel_bias, softcap, dropout_p, seed, offset,
        # The stable ABI cannot query torch.are_deterministic_algorithms_enabled() from C++,
        # so the choice travels as an argument (CUDA: no fp32-atomic dq under deterministic mode).
        torch.are_deterministic_algorithms_enabled(), *ctx.block_position,
    )
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[11]:
        dsinks = _sinks_grad(sinks, lse, out, dout, dlse, (0, 2), 1)
    return (dq, dk, dv, None, None, None, None, None, None,
            drel_bias if rel_bias is not None else None, None, dsinks, None, None, None, None,
            None)


_register_autograd(
    "attention_forward",
    _attention_forward_backward,
    setup_context=_attention_forward_setup,
)


def _attention_varlen_setup(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, window_right, alibi_slopes,
     rel_bias, softcap, sinks, dropout_p, dropout_seed, dropout_offset) = inputs
    _refuse_alibi_grad(alibi_slopes, in_autograd_setup=True)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi_slopes, rel_bias, sinks)
    ctx.max_seqlen = (max_q, max_k)
    ctx.causal = causal
    ctx.scale = scale
    ctx.window = (window_left, window_right)
    ctx.terms = (softcap, dropout_p, dropout_seed, dropout_offset)


def _attention_varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes, rel_bias, sinks = ctx.saved_tensors
    softcap, dropout_p, seed, offset = ctx.terms
    dout = torch.zeros_like(out) if dout is None else _row_contiguous(dout)
    dq, dk, dv, drel_bias = _lib.attention_varlen_backward_rel_bias(
        dout, q, k, v, out, lse, cu_q, cu_k, ctx.max_seqlen[0], ctx.max_seqlen[1], ctx.causal,
        ctx.scale, ctx.window[0], ctx.window[1], dlse, alibi_slopes, rel_bias, softcap,
        dropout_p, seed, offset, torch.are_deterministic_algorithms_enabled(),
    )
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[14]:
        dsinks = _sinks_grad(sinks, lse, out, dout, dlse, (1,), 0)
    return (dq, dk, dv, None, None, None, None, None, None, None, None, None,
            drel_bias if rel_bias is not None else None, None, dsinks, None, None, None)


_register_autograd(
    "attention_varlen_forward",
    _attention_varlen_backward,
    setup_context=_attention_varlen_setup,
)


# Double backward (a gradient of the gradients) is not implemented: the backward ops refuse it
# clearly when it is asked for, instead of autograd's fallback silently giving zeros.
def _no_double_backward(name):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"attn_ext: double backward through attention is not supported ({name} has no "
            "derivative); a gradient of the gradients (create_graph=True, then backward again) "
            "needs attn_ext.reference.attention")
    return backward


def _no_double_backward_setup(ctx, inputs, output):
    pass


for _name in ("attention_backward", "attention_backward_rel_bias", "attention_varlen_backward",
              "attention_varlen_backward_rel_bias"):
    _register_autograd(_name, _no_double_backward(_name), setup_context=_no_double_backward_setup)


# ---------------------------------------------------------------------------------------
# attention probabilities for inspection (need_weights)
# ---------------------------------------------------------------------------------------


def _check_qk_inputs(q: torch.Tensor, k: torch.Tensor, scale: Optional[float]) -> None:
    """The input checks of the attention ops (csrc/common/attention_checks.h) for 4-D
    ``(B, S, H, D)`` q and k, in Python: for :func:`attention_weights` (no kernel) and
    ``ring_attention`` (which must refuse them before its ring starts)."""
    if q.dim() != 4:
        raise ValueError(f"q must have 4 dims (B, Sq, H, D) or 3 dims (B, Sq, D), got shape {list(q.shape)}")
    if k.dim() != 4:
        raise ValueError(f"k must have 4 dims (B, Sk, Hkv, D), got shape {list(k.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be float32, float64, float16 or bfloat16, got {q.dtype}")
    if k.dtype != q.dtype:
        raise ValueError(f"k must have the same dtype as q ({q.dtype}), got {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"k must be on the same device as q ({q.device}), got {k.device}")
    B, _, H, D = q.shape
    if k.size(0) != B:
        raise ValueError(f"k must have batch size B = {B} (from q), got shape {list(k.shape)}")
    if k.size(3) != D:
        raise ValueError(f"k must have head dim D = {D} (from q), got shape {list(k.shape)}")
    Hkv = k.size(2)
    if not ((Hkv > 0 and H % Hkv == 0) or (Hkv == 0 and H == 0)):
        raise ValueError(f"k's number of heads Hkv = {Hkv} must divide q's number of heads H = {H} "
                         f"(GQA/MQA), got k shape {list(k.shape)} and q shape {list(q.shape)}")
    _check_last_dim_contiguous(q, "q")
    _check_last_dim_contiguous(k, "k")
    _check_scale(scale)


def _check_last_dim_contiguous(t: torch.Tensor, name: str, who: str = "") -> None:
    """The layout rule of DESIGN.md (csrc/common/checks.h check_last_dim_contiguous), in
    Python for the entry points that refuse input before any kernel runs."""
    if t.size(-1) > 1 and t.stride(-1) != 1:  # (the RuntimeError the ops raise, a ValueError)
        raise ArgumentValueError(f"{who}{name} must have a contiguous last dim (stride 1), "
                                 f"got strides {list(t.stride())}")


def _check_term_shapes(q, alibi_slopes, rel_bias, who: str = "", sinks=None) -> None:
    """The shape and device rules of csrc/common/score_checks.h for the ALiBi / rel_bias /
    sinks tables, in Python: for the callers that must refuse them before any kernel runs
    (attention_weights and explain, which run no kernel; ring_attention, whose kernels run
    mid-ring)."""
    # (dim / size comparisons, not tuple(t.shape) in ((H,), (B, H)): under torch.compile with
    # dynamic shapes, dynamo evaluated the tuple test with a symbolic H as False, and the
    # check refused the right shape)
    B, H = q.size(0), q.size(2)
    if sinks is not None and not (sinks.dim() == 1 and sinks.size(0) == H):
        raise ValueError(f"{who}sinks must have shape (H,) = ({H},), got shape {list(sinks.shape)}")
    for name, t in (("alibi_slopes", alibi_slopes), ("rel_bias", rel_bias), ("sinks", sinks)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{who}{name} must be on the same device as q ({q.device}), got {t.device}")
    if alibi_slopes is not None and not (
            (alibi_slopes.dim() == 1 and alibi_slopes.size(0) == H)
            or (alibi_slopes.dim() == 2 and alibi_slopes.size(0) == B and alibi_slopes.size(1) == H)):
        raise ValueError(f"{who}alibi_slopes must have shape (H,) = ({H},) or (B, H) = ({B}, {H}), "
                         f"got shape {list(alibi_slopes.shape)}")
    if rel_bias is not None and (rel_bias.dim() != 2 or rel_bias.size(0) != H
                                 or rel_bias.size(1) % 2 != 1):
        raise ValueError(f"{who}rel_bias must have shape (H, 2M + 1) with H = {H} and an odd "
                         f"number of distances, got shape {list(rel_bias.shape)}")


def _weights_terms(q, alibi_slopes, rel_bias, softcap):
    """attention_weights' score terms under attention's rules, so that the two accept the same
    arguments."""
    alibi_slopes, rel_bias, softcap = _checked_score_terms(q, alibi_slopes, rel_bias, softcap,
                                                           None, 0.0)[:3]
    _check_term_shapes(q, alibi_slopes, rel_bias)
    return alibi_slopes, rel_bias, softcap


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    lse: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    rel_bias: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    window=None,
    key_padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The ``(B, H, Sq, Sk)`` attention probabilities ``exp(scale * q k^T - lse)`` in float32
    (float64 for float64 input), with the score terms and masks of :func:`attention` when
    given: softcap, ALiBi, rel_bias, ``window=(left, right)``, ``key_padding_mask (B, Sk)``
    (hidden pairs are 0).

    For attention maps and plots, not for the fast path: it forms the full score matrix. Pass
    the ``lse`` returned by ``attention(..., return_lse=True)`` to reuse the forward's
    normaliser (rows then sum to 1 up to rounding); without it the normaliser is computed
    here. q ``(B, Sq, H, D)``, k ``(B, Sk, Hkv, D)``, lse ``(B, H, Sq)``; or the single-head
    3-D form of :func:`attention`: q ``(B, Sq, D)``, k ``(B, Sk, D)``, lse ``(B, Sq)``, giving
    ``(B, Sq, Sk)``. Everything after ``k`` is keyword-only.

    Rows that see no key (causal with ``Sq > Sk``) are 0, as in :func:`attention`. A NaN or
    infinite input is not hidden: it shows in the rows it reaches.
    """
    _check_tensor(q, "q", "(B, Sq, H, D) or (B, Sq, D)")
    _check_tensor(k, "k", "(B, Sk, Hkv, D) or (B, Sk, D)")
    if lse is not None:
        _check_tensor(lse, "lse", "(B, H, Sq)")
    squeeze = q.dim() == 3
    if squeeze:
        if k.dim() != 3:
            raise ValueError(f"with 3-D q (B, Sq, D), k must be 3-D (B, Sk, D), got shape {list(k.shape)}")
        q, k = q.unsqueeze(2), k.unsqueeze(2)
        if lse is not None:
            if lse.dim() != 2:
                raise ValueError(f"with 3-D q, lse must have 2 dims (B, Sq), got shape {list(lse.shape)}")
            lse = lse.unsqueeze(1)
    _check_qk_inputs(q, k, scale)
    B, Sq, H, D = q.shape
    Sk, Hkv = k.size(1), k.size(2)
    if lse is not None:
        if tuple(lse.shape) != (B, H, Sq):
            want = [B, Sq] if squeeze else [B, H, Sq]
            got = list(lse.shape)[:1] + list(lse.shape)[2:] if squeeze else list(lse.shape)
            raise ValueError(f"lse must have shape {want} {'(B, Sq)' if squeeze else '(B, H, Sq)'}, got {got}")
        if lse.device != q.device:
            raise ValueError(f"lse must be on the same device as q ({q.device}), got {lse.device}")
        if not lse.is_floating_point():
            raise ValueError(f"lse must be a floating-point tensor, got {lse.dtype}")
    _check_causal(causal)
    left, right = _window_args(window)
    _check_key_padding_mask(key_padding_mask, B, Sk, q.device)
    alibi_slopes, rel_bias, softcap = _weights_terms(q, alibi_slopes, rel_bias, softcap)
    probs = _attention_probs(q, k, causal, scale, lse, alibi_slopes, rel_bias, softcap, left,
                             right, key_padding_mask)
    return probs.squeeze(1) if squeeze else probs


def _attention_probs(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: Optional[float],
                     lse: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor] = None,
                     rel_bias: Optional[torch.Tensor] = None,
                     softcap: Optional[float] = None, window_left: int = -1,
                     window_right: int = -1,
                     key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The math of :func:`attention_weights` on checked 4-D input, written for TorchScript
    (positional arguments, no checks): the modules call it on their own q and k."""
    H, D = q.size(2), q.size(3)
    Sq, Sk, Hkv = q.size(1), k.size(1), k.size(2)
    s = scale if scale is not None else (1.0 / math.sqrt(D) if D > 0 else 1.0)  # (as the kernels)
    if Hkv != H and Hkv > 0:
        k = k.repeat_interleave(H // Hkv, dim=2)
    qf = q.transpose(1, 2).to(torch.float32 if q.dtype != torch.float64 else q.dtype)
    kf = k.transpose(1, 2).to(qf.dtype)
    scores = torch.matmul(qf, kf.transpose(-2, -1)) * s  # (B, H, Sq, Sk)
    if softcap is not None or alibi_slopes is not None or rel_bias is not None:
        d = score_distance(Sq, Sk, q.device)
        scores = add_score_terms(
            scores, d, softcap, None if alibi_slopes is None else alibi_slopes.to(scores.dtype),
            None if rel_bias is None else rel_bias.to(scores.dtype))
    if causal or window_left != -1 or window_right != -1 or key_padding_mask is not None:
        window: Optional[Tuple[int, int]] = None
        if window_left != -1 or window_right != -1:
            window = (window_left, window_right)
        keep = visibility_mask(Sq, Sk, causal, window, key_padding_mask, q.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    if lse is None:
        norm = torch.logsumexp(scores, dim=-1)
    else:
        norm = lse.to(scores.dtype)
    # A row that sees no key has lse = -inf and every score -inf: exp(-inf - 0) = 0 gives
    # its zero row without touching NaN anywhere else.
    norm = torch.where(torch.isneginf(norm), torch.zeros_like(norm), norm)
    return torch.exp(scores - norm.unsqueeze(-1))
