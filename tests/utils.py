"""Tolerance rule of DESIGN.md: a low-precision result passes when its error against the
float64 reference is at most 2x the error of the same reference computed in that low
precision, plus a tiny absolute floor (the rule of FlashAttention's test suite)."""

from __future__ import annotations

import torch

# Absolute floors per dtype: rounding of a single output element.
FLOOR = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}


def floor(dtype: torch.dtype, ref64: torch.Tensor) -> float:
    """The rule's absolute floor for a result of this dtype: FLOOR, shrunk with the
    reference's largest finite magnitude where that is below 1 (down to 1e-2 of it), so that
    on small values (long rows average v down to ~1e-2) the floor stays a rounding of the
    values and not a third of them."""
    return FLOOR[dtype] * min(1.0, max(max_finite_abs(ref64, default=1.0), 1e-2))


def max_finite_abs(t: torch.Tensor, default: float) -> float:
    """The largest finite |t| (default where t has no finite element)."""
    finite = t[torch.isfinite(t)] if t.is_floating_point() else t
    return float(finite.abs().max()) if finite.numel() else default


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    diff = (a - b).abs()
    diff = torch.where(both_inf, torch.zeros_like(diff), diff)
    return float(diff.max()) if diff.numel() else 0.0


def assert_close_rule(ours: torch.Tensor, ref64: torch.Tensor, ref_low: torch.Tensor,
                      name: str = "output", factor: float = 2.0) -> None:
    """ours vs float64 reference, allowed 2x the low-precision reference's own error."""
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    assert not torch.isnan(ours).any() or torch.isnan(ref64).any(), f"{name}: NaN in result"
    err = max_err(ours, ref64)
    ref_err = max_err(ref_low, ref64)
    bound = factor * ref_err + floor(ours.dtype, ref64)
    assert err <= bound, f"{name}: max error {err:.3e} > {factor} * ref error {ref_err:.3e} + floor ({bound:.3e})"


def assert_lse_fp32(lse: torch.Tensor, lse64: torch.Tensor, dtype: torch.dtype) -> None:
    """For bf16 / fp16 inputs: lse is fp32 from fp32 sums (DESIGN), so it must sit at fp32
    rounding of the exact lse of these inputs, 1e-5 * max(1, max|lse|), not merely within 2x
    of the low-precision reference's (which rounds lse to the dtype, ~1e-2 for bf16: ring
    attention merges partial results through lse). No-op for other dtypes."""
    if dtype not in (torch.float16, torch.bfloat16):
        return
    assert lse.dtype == torch.float32, f"lse dtype {lse.dtype} for {dtype} inputs"
    magnitude = max(1.0, max_finite_abs(lse64, default=1.0))
    err = max_err(lse, lse64)
    assert err <= 1e-5 * magnitude, f"lse: max error {err:.3e} against float64 (fp32 rounding)"


def randn(*shape, dtype=torch.float32, device="cpu", scale=1.0):
    """Random normal input, never zeros (fresh per call)."""
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype=dtype, device=device)



def _with_setting(get, set_, value, f):
    """f() with a global torch setting (get / set_) at value, the previous one restored after."""
    prev = get()
    set_(value)
    try:
        return f()
    finally:
        set_(prev)


def with_threads(n: int, f):
    """f() with torch's intra-op thread count set to n."""
    return _with_setting(torch.get_num_threads, torch.set_num_threads, n, f)


def with_deterministic(flag: bool, f):
    """f() under torch.use_deterministic_algorithms(flag)."""
    return _with_setting(torch.are_deterministic_algorithms_enabled,
                         torch.use_deterministic_algorithms, flag, f)
