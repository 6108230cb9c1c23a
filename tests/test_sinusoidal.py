"""attn_ext::sinusoidal_pe(_) against reference.sinusoidal_pe in float64."""

import pytest
import torch
from torch.library import opcheck

import attn_ext
from attn_ext import reference as ref
from utils import assert_close_rule, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("D", [1, 2, 7, 64, 65, 130])
@pytest.mark.parametrize("offset", [0, 5, 100_000])
def test_matches_reference_fp64(device, D, offset):
    x = randn(3, 11, D, dtype=torch.float64, device=device)
    got = attn_ext.sinusoidal_pe(x, offset=offset)
    want = ref.sinusoidal_pe(x.cpu(), offset=offset)
    # Two float64 ways of forming the angle pos * w differ by ~pos * 1e-16.
    atol = 1e-12 + 1e-15 * (offset + 11)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [33, 128])
def test_low_precision_tolerance_rule(device, dtype, D):
    x64 = randn(2, 37, D, dtype=torch.float64)
    positions = torch.randint(0, 50_000, (2, 37))
    ref64 = ref.sinusoidal_pe(x64, positions=positions)
    ref_low = ref.sinusoidal_pe(x64.to(dtype), positions=positions)
    got = attn_ext.sinusoidal_pe(x64.to(dtype).to(device), positions=positions.to(device))
    assert got.dtype == dtype
    assert_close_rule(got.cpu(), ref64, ref_low)


def test_positions_shared_and_per_batch(device):
    x = randn(4, 9, 10, dtype=torch.float64, device=device)
    pos_s = torch.randint(0, 1000, (9,), device=device)
    pos_bs = torch.randint(-50, 1000, (4, 9), device=device)
    torch.testing.assert_close(attn_ext.sinusoidal_pe(x, pos_s).cpu(),
                               ref.sinusoidal_pe(x.cpu(), pos_s.cpu()), rtol=0, atol=1e-12)
    torch.testing.assert_close(attn_ext.sinusoidal_pe(x, pos_bs).cpu(),
                               ref.sinusoidal_pe(x.cpu(), pos_bs.cpu()), rtol=0, atol=1e-12)
    # offset + s is the same as positions = arange(S) + offset
    torch.testing.assert_close(attn_ext.sinusoidal_pe(x, offset=17),
                               attn_ext.sinusoidal_pe(x, torch.arange(9, device=device) + 17))


def test_two_dim_input_and_strided_views(device):
    x2 = randn(13, 6, dtype=torch.float64, device=device)
    torch.testing.assert_close(attn_ext.sinusoidal_pe(x2, offset=3).cpu(),
                               ref.sinusoidal_pe(x2.cpu(), offset=3), rtol=0, atol=1e-12)
    # (S, B, D) storage viewed as (B, S, D), and a column-strided view
    xs = randn(13, 4, 6, dtype=torch.float64, device=device).transpose(0, 1)
    xc = randn(4, 13, 12, dtype=torch.float64, device=device)[..., ::2]
    for x in (xs, xc):
        got = attn_ext.sinusoidal_pe(x)
        assert got.is_contiguous()
        torch.testing.assert_close(got.cpu(), ref.sinusoidal_pe(x.cpu()), rtol=0, atol=1e-12)


def test_in_place_and_out_of_place_do_not_disturb(device):
    x = randn(2, 5, 8, device=device)
    x0 = x.clone()
    y = attn_ext.sinusoidal_pe(x, offset=2)
    assert torch.equal(x, x0)  # out of place leaves x untouched
    # in place on a slice of a wider buffer: only that slice changes
    buf = randn(2, 5, 24, device=device)
    buf0 = buf.clone()
    view = buf[..., 8:16]
    assert attn_ext.sinusoidal_pe_(view, offset=2) is view
    torch.testing.assert_close(buf[..., 8:16], attn_ext.sinusoidal_pe(buf0[..., 8:16], offset=2), rtol=0, atol=0)
    assert torch.equal(buf[..., :8], buf0[..., :8]) and torch.equal(buf[..., 16:], buf0[..., 16:])
    assert y.shape == x.shape


def test_table(device):
    t = attn_ext.sinusoidal_table(40, 17, base=500.0, dtype=torch.float64, device=device)
    torch.testing.assert_close(t.cpu(), ref.sinusoidal_table(40, 17, base=500.0), rtol=0, atol=1e-12)
    assert attn_ext.sinusoidal_table(0, 8).shape == (0, 8)


def test_empty_inputs(device):
    for shape in [(0, 4, 8), (2, 0, 8), (2, 3, 0), (0, 8)]:
        x = torch.empty(shape, device=device)
        assert attn_ext.sinusoidal_pe(x).shape == shape
        attn_ext.sinusoidal_pe_(x)


def test_opcheck(device):
    x = randn(2, 6, 9, dtype=torch.float64, device=device)
    pos = torch.randint(0, 100, (2, 6), device=device)
    opcheck(torch.ops.attn_ext.sinusoidal_pe.default, (x, None, 3, 10000.0))
    opcheck(torch.ops.attn_ext.sinusoidal_pe.default, (x, pos, 0, 500.0))
    opcheck(torch.ops.attn_ext.sinusoidal_pe_.default, (x.clone(), None, 3, 10000.0))
    opcheck(torch.ops.attn_ext.sinusoidal_pe.default, (randn(6, 8, device=device), None, 0, 10000.0))


def test_gradcheck(device):
    x = randn(2, 4, 5, dtype=torch.float64, device=device).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: attn_ext.sinusoidal_pe(t, offset=3), (x,))
    g = torch.randn(2, 4, 5, dtype=torch.float64, device=device)
    (gx,) = torch.autograd.grad(attn_ext.sinusoidal_pe(x), x, g)
    assert torch.equal(gx, g)


def test_torch_compile_no_graph_break():
    x = randn(2, 8, 16)
    f = torch.compile(lambda t: attn_ext.sinusoidal_pe(t, offset=4) * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(x), attn_ext.sinusoidal_pe(x, offset=4) * 2)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: (randn(2, 3, 4, 5, device=d),), r"x must have 3 dims \(B, S, D\) or 2 dims"),
        (lambda d: (torch.ones(2, 3, 4, dtype=torch.int64, device=d),), r"x must be float32"),
        (lambda d: (randn(2, 3, 4, device=d), torch.arange(3.0, device=d)), r"positions must be int64"),
        (lambda d: (randn(2, 3, 4, device=d), torch.arange(4, device=d)), r"positions of shape \(S,\) must have S = 3"),
        (lambda d: (randn(2, 3, 4, device=d), torch.zeros(3, 3, dtype=torch.long, device=d)), r"positions of shape \(B, S\) must be \(2, 3\)"),
        (lambda d: (randn(3, 4, device=d), torch.zeros(1, 3, dtype=torch.long, device=d)), r"positions must have shape \(S,\) for 2-D x"),
        (lambda d: (randn(2, 3, 4, device=d), None, 0, -1.0), r"base must be a positive"),
    ],
)
def test_errors_name_the_argument(device, make, match):
    with pytest.raises(RuntimeError, match=match):
        attn_ext.sinusoidal_pe(*make(device))


def test_in_place_requires_contiguous_last_dim():
    x = randn(2, 3, 8)[..., ::2]
    with pytest.raises(RuntimeError, match=r"x \(in place\) must have a contiguous last dim"):
        attn_ext.sinusoidal_pe_(x)


def test_device_mix_is_an_error():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with pytest.raises(RuntimeError, match="positions must be on the same device as x"):
        attn_ext.sinusoidal_pe(randn(2, 3, 4, device="cuda"), torch.arange(3))


# ---- speed paths (AVX2 sincos row + vectorised add): accuracy where they can go wrong ----


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [7, 8, 9, 18, 130, 1024])
def test_fast_path_large_positions(device, dtype, D):
    # Positions up to 1e5 (the angle of pair 0 is ~1e5 rad): range reduction must hold up.
    # D covers a pure scalar tail (7), exact multiples of the 4-pair vector (8) and tails.
    x64 = randn(2, 33, D, dtype=torch.float64)
    positions = torch.randint(0, 100_000, (33,))
    positions[:2] = torch.tensor([99_999, 100_000])
    ref64 = ref.sinusoidal_pe(x64.to(dtype).double(), positions=positions)
    ref_low = ref.sinusoidal_pe(x64.to(dtype), positions=positions)
    got = attn_ext.sinusoidal_pe(x64.to(dtype).to(device), positions=positions.to(device))
    assert_close_rule(got.cpu(), ref64, ref_low)
    y = x64.to(dtype).to(device)
    attn_ext.sinusoidal_pe_(y, positions.to(device))
    torch.testing.assert_close(y, got, rtol=0, atol=0)


def test_fast_path_table_accuracy():
    # The fp32 PE itself at positions 0 .. 1e5 against float64: within fp32 rounding.
    got = attn_ext.sinusoidal_table(100_001, 64)
    want = ref.sinusoidal_table(100_001, 64)
    assert_close_rule(got, want, want.float(), "table")


def test_fast_path_negative_and_huge_positions(device):
    # Negative positions (quadrant arithmetic mod 4) and positions past the fast path's range
    # (|pos| > 1e9 falls back to the libm row) stay within the tolerance rule.
    x64 = randn(3, 6, 40, dtype=torch.float64)
    positions = torch.tensor([[-1, -2, -3, -100_000, 5, 0],
                              [3_000_000_000, -3_000_000_000, 7, 8, 9, 10],
                              [123_456_789, 999_999_999, 1_000_000_001, 1, 2, 3]])
    ref64 = ref.sinusoidal_pe(x64.float().double(), positions=positions)
    ref_low = ref.sinusoidal_pe(x64.float(), positions=positions)
    got = attn_ext.sinusoidal_pe(x64.float().to(device), positions=positions.to(device))
    assert_close_rule(got.cpu(), ref64, ref_low)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 99_000, -70, 999_999_990])
def test_fast_path_recurrence_rows(device, dtype, offset):
    # offset + s rows are produced by angle-addition steps between exact restarts (every
    # 16 rows): 300 consecutive rows cover many steps and restarts; the last offset crosses
    # the fast path's 1e9 limit mid-chunk.
    x64 = randn(2, 300, 72, dtype=torch.float64)
    ref64 = ref.sinusoidal_pe(x64.to(dtype).double(), offset=offset)
    ref_low = ref.sinusoidal_pe(x64.to(dtype), offset=offset)
    got = attn_ext.sinusoidal_pe(x64.to(dtype).to(device), offset=offset)
    assert_close_rule(got.cpu(), ref64, ref_low)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, -17, 5, 999_999_990])
def test_rows_depend_on_the_position_alone(dtype, offset):
    """A row is the same whatever the thread count and wherever the call starts (prefill vs
    one token at a time, a sequence in pieces): the recurrence restarts at absolute positions.
    (It restarted at each thread's first row: 1243 of 3001 x 64 fp32 values differed between
    1 and 16 threads, and a token-by-token decode differed from the prefill.)"""
    x = randn(2, 301, 72, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = attn_ext.sinusoidal_pe(x, offset=offset)
        pieces = [(0, 7), (7, 40), (40, 41), (41, 301)]
        got = torch.cat([attn_ext.sinusoidal_pe(x[:, a:b], offset=offset + a) for a, b in pieces], 1)
        assert torch.equal(got, want)
        tokens = torch.cat([attn_ext.sinusoidal_pe(x[:, s:s + 1], offset=offset + s)
                            for s in range(0, 301, 13)], 1)
        assert torch.equal(tokens, want[:, ::13])
        for n in (2, 3, 16):
            torch.set_num_threads(n)
            assert torch.equal(attn_ext.sinusoidal_pe(x, offset=offset), want), n
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_path_nan_inf_propagate(device, dtype):
    x = randn(2, 20, 48, dtype=dtype, device=device)
    x[0, 3, 5] = float("nan")
    x[1, 7, 40] = float("-inf")
    got = attn_ext.sinusoidal_pe(x)
    assert torch.isnan(got[0, 3, 5]) and torch.isneginf(got[1, 7, 40])
    assert torch.isfinite(got).sum() == x.numel() - 2
