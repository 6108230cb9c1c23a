"""attn_ext.attention / causal_attention and the ops behind them (attention_forward,
attention_backward): values, lse and gradients against attn_ext.reference in float64 with
the tolerance rule of DESIGN.md, plus opcheck, gradcheck, layouts, errors, determinism and
TorchScript."""

import math

import pytest
import torch

import attn_ext
from attn_ext import reference
from tests.profiling import cpu_split_kv_ran, kernel_names, ran
from tests.utils import FLOOR, assert_close_rule, assert_lse_fp32, max_err, max_finite_abs, randn

LOW = [torch.float32, torch.bfloat16, torch.float16]


def make_qkv(B, Sq, Sk, H, Hkv, D, Dv, dtype, device, layout="bshd"):
    """q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) as leaf tensors, in one of three
    memory layouts: contiguous BSHD, views of one packed QKV buffer, or transposed BHSD."""
    if layout == "bshd":
        q = randn(B, Sq, H, D, dtype=dtype, device=device)
        k = randn(B, Sk, Hkv, D, dtype=dtype, device=device)
        v = randn(B, Sk, Hkv, Dv, dtype=dtype, device=device)
    elif layout == "packed":  # (B, S, (H + Hkv) * D + Hkv * Dv) projection output, sliced
        assert Sq == Sk
        width = H * D + Hkv * D + Hkv * Dv
        qkv = randn(B, Sq, width, dtype=dtype, device=device)
        q = qkv[..., : H * D].view(B, Sq, H, D)
        k = qkv[..., H * D : (H + Hkv) * D].view(B, Sk, Hkv, D)
        v = qkv[..., (H + Hkv) * D :].view(B, Sk, Hkv, Dv)
        assert not q.is_contiguous() and q.stride(1) == width
    elif layout == "transposed":  # (B, H, S, D) tensors passed as .transpose(1, 2)
        q = randn(B, H, Sq, D, dtype=dtype, device=device).transpose(1, 2)
        k = randn(B, Hkv, Sk, D, dtype=dtype, device=device).transpose(1, 2)
        v = randn(B, Hkv, Sk, Dv, dtype=dtype, device=device).transpose(1, 2)
    else:
        raise ValueError(layout)
    return q, k, v


def run_ours(q, k, v, causal, dout, scale=None):
    q, k, v = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = attn_ext.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def run_ref(q, k, v, causal, dout, dtype, scale=None):
    q, k, v = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = reference.attention_with_lse(q, k, v, causal, scale)
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def check(q, k, v, causal, grads=True, scale=None):
    """Ours vs the float64 reference: float64 to 1e-9; lower precisions by the tolerance rule
    (error at most 2x the error of the reference computed in that precision)."""
    dtype = q.dtype
    B, Sq, H, _ = q.shape
    Dv = v.shape[-1]
    dout = randn(B, Sq, H, Dv, dtype=dtype, device=q.device)
    names = ["out", "lse", "dq", "dk", "dv"]
    if not grads:
        with torch.no_grad():
            out, lse = attn_ext.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
            ref = reference.attention_with_lse(q.double(), k.double(), v.double(), causal, scale)
        ours, ref64 = (out, lse), ref
        ref_low = reference.attention_with_lse(q, k, v, causal, scale) if dtype != torch.float64 else None
    else:
        ours = run_ours(q, k, v, causal, dout, scale)
        ref64 = run_ref(q, k, v, causal, dout, torch.float64, scale)
        ref_low = run_ref(q, k, v, causal, dout, dtype, scale) if dtype != torch.float64 else None
    assert ours[0].dtype == dtype and ours[0].is_contiguous()
    assert ours[1].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    for i, (a, r) in enumerate(zip(ours, ref64)):
        assert not torch.isnan(a).any(), f"{names[i]}: NaN"
        if dtype == torch.float64:
            assert a.shape == r.shape, names[i]
            err = max_err(a, r)
            assert err <= 1e-9, f"{names[i]}: max error {err:.3e} vs float64 reference"
        else:
            assert_close_low(a, r, ref_low[i], name=names[i])
    assert_lse_fp32(ours[1], ref64[1], dtype)


def assert_close_low(ours, ref64, ref_low, name):
    """The tolerance rule (tests/utils.assert_close_rule), with the float32 floor taken
    relative to the largest reference magnitude: in float32 the reference's own error is at
    the rounding level, our tiled kernels sum in another order (and form Di = rowsum(dout *
    out) from the saved out, as FlashAttention does, where the reference differentiates the
    softmax), and gradients of magnitude ~10 made the absolute 1e-6 floor fail about one
    random draw in 30 at 2-2.5x the reference error; a gradient that is exactly 0 (one key)
    comes out at ~1e-6. Hence a floor of 2e-6 * max(1, max|ref|). Float16/bfloat16 use the
    rule unchanged."""
    if ours.dtype != torch.float32:
        assert_close_rule(ours, ref64, ref_low, name=name)
        return
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    magnitude = max(1.0, max_finite_abs(ref64, default=1.0))
    err, ref_err = max_err(ours, ref64), max_err(ref_low, ref64)
    bound = 2.0 * ref_err + 2 * FLOOR[torch.float32] * magnitude
    assert err <= bound, (f"{name}: max error {err:.3e} > 2 * ref error {ref_err:.3e} + "
                          f"2e-6 * max(1, max|ref|) ({bound:.3e})")


ALL_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]

# (B, Sq, Sk, H, Hkv, D, Dv)
SHAPES = [
    pytest.param((2, 17, 17, 4, 4, 64, 64), id="square"),
    pytest.param((1, 1, 97, 4, 2, 64, 64), id="decode-gqa"),
    pytest.param((2, 17, 97, 2, 2, 32, 32), id="sq<sk"),
    pytest.param((1, 97, 17, 2, 1, 59, 59), id="sq>sk-mqa"),
    pytest.param((1, 33, 33, 4, 2, 59, 111), id="dv!=d"),
    pytest.param((1, 130, 250, 6, 2, 64, 48), id="multi-tile"),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_values_lse_grads(shape, dtype, causal, device):
    B, Sq, Sk, H, Hkv, D, Dv = shape
    check(*make_qkv(B, Sq, Sk, H, Hkv, D, Dv, dtype, device), causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [32, 59, 64, 111, 128, 256])
def test_head_dims(D, dtype, device):
    check(*make_qkv(1, 97, 97, 2, 1, D, D, dtype, device), causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "S", [1, 17, 97, pytest.param(1025, marks=pytest.mark.slow)]
)
def test_seq_lens(S, dtype, causal, device):
    check(*make_qkv(1, S, S, 2, 2, 64, 64, dtype, device), causal)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("Sq,Sk", [(1, 1025), (17, 1025), (1025, 97)])
def test_long_uneven(Sq, Sk, dtype, device):
    check(*make_qkv(1, Sq, Sk, 4, 2, 64, 64, dtype, device), causal=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["packed", "transposed"])
@pytest.mark.parametrize("causal", [False, True])
def test_strided_layouts(layout, dtype, causal, device):
    q, k, v = make_qkv(2, 45, 45, 4, 2, 32, 48, dtype, device, layout)
    check(q, k, v, causal)


def test_custom_scale(device):
    check(*make_qkv(1, 40, 50, 2, 1, 64, 64, torch.float64, device), causal=True, scale=0.3)


@pytest.mark.parametrize("B,Sq,H", [(1, 1, 1), (1, 1, 8), (2, 3, 2)])
def test_decode_split_kv(B, Sq, H, device):
    """Few query tiles and many keys: the keys are split across threads and merged. The
    values are checked with the split path on (asserted: on CPU observed as a result that
    differs bitwise from the unsplit one-thread result, on CUDA from the profiled kernels)."""
    threads = 4  # more threads than this shape has query tiles, also on a 2-core machine
    for dtype in (torch.float64, torch.float32):
        for causal in (True, False):
            q, k, v = make_qkv(B, Sq, 1500, H, 1, 64, 64, dtype, device)
            if device == "cpu":
                assert cpu_split_kv_ran(q, k, v, causal, threads), "the split-KV path did not run"
                prev = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    # float32 with few columns per kv head: the decode kernel's split-K
                    # (csrc/cpu/attention_decode.h), else the tiled kernel's split-KV
                    dec = attn_ext._explain.cpu_decode_plan(
                        attn_ext._explain.Shape(B, Sq, 1500, H, 1, 64, 64), dtype, threads)
                    want = "cpu.decode" if dec is not None else "cpu.split_kv"
                    assert attn_ext.explain(q, k, v, causal=causal).forward == want
                    check(q, k, v, causal, grads=False)
                finally:
                    torch.set_num_threads(prev)
            else:
                names = kernel_names(lambda: torch.ops.attn_ext.attention_forward(q, k, v, causal, None))
                assert ran(names, "simple_fwd_split_kernel"), names
                check(q, k, v, causal, grads=False)


def test_cpu_tiled_result_is_thread_count_invariant():
    """What cpu_split_kv_ran relies on: without a split (many query tiles, or few keys) the
    forward is bitwise the same for every thread count."""
    for shape in [(2, 200, 1500, 4, 2), (1, 1, 300, 1, 1)]:  # many tiles / too few keys
        B, Sq, Sk, H, Hkv = shape
        q, k, v = make_qkv(B, Sq, Sk, H, Hkv, 64, 64, torch.float32, "cpu")
        for threads in (2, 4):
            assert not cpu_split_kv_ran(q, k, v, True, threads), (shape, threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_without_keys(dtype, device):
    """Sq > Sk causal: the first Sq - Sk rows see no key -> out exactly 0, lse -inf, no NaN
    anywhere (also in the gradients)."""
    q, k, v = make_qkv(2, 20, 5, 2, 2, 16, 16, dtype, device)
    q, k, v = [t.requires_grad_() for t in (q, k, v)]
    out, lse = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :15] == 0)
    assert torch.all(lse[:, :, :15] == float("-inf"))
    assert torch.isfinite(out[:, 15:]).all() and torch.isfinite(lse[:, :, 15:]).all()
    out.sum().backward()
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all()
    assert torch.all(q.grad[:, :15] == 0)


def test_no_keys_at_all(device):
    q, k, v = make_qkv(2, 4, 0, 2, 2, 8, 8, torch.float32, device)
    out, lse = attn_ext.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 4, 2, 8) and torch.all(out == 0)
    assert torch.all(lse == float("-inf"))


@pytest.mark.parametrize(
    "shape",
    [(0, 5, 5, 2, 2, 8, 8), (2, 0, 5, 2, 2, 8, 8), (2, 5, 5, 0, 0, 8, 8), (2, 5, 5, 2, 2, 0, 0)],
    ids=["B=0", "Sq=0", "H=0", "D=0"],
)
def test_empty(shape, device):
    B, Sq, Sk, H, Hkv, D, Dv = shape
    q, k, v = [t.requires_grad_() for t in make_qkv(B, Sq, Sk, H, Hkv, D, Dv, torch.float32, device)]
    out, lse = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (B, Sq, H, Dv) and lse.shape == (B, H, Sq)
    if H > 0:  # (the reference cannot split zero heads into groups)
        # D = 0: every score is 0, so lse(row i) = log(number of keys it sees); the
        # reference needs an explicit scale there.
        ref_out, ref_lse = reference.attention_with_lse(
            q.detach().double(), k.detach().double(), v.detach().double(), True,
            1.0 if D == 0 else None)
        assert max_err(out, ref_out) <= 1e-6 and max_err(lse, ref_lse) <= 1e-6
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    if k.numel():
        assert torch.all(k.grad == 0) and torch.all(v.grad == 0)


def test_three_dim_single_head(device):
    q, k, v = make_qkv(2, 19, 23, 1, 1, 16, 24, torch.float64, device)
    q3, k3, v3 = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    out3, lse3 = attn_ext.attention(q3, k3, v3, causal=True, return_lse=True)
    out4, lse4 = reference.attention_with_lse(q, k, v, True)
    assert out3.shape == (2, 19, 24) and lse3.shape == (2, 19)
    assert max_err(out3, out4[:, :, 0]) <= 1e-12 and max_err(lse3, lse4[:, 0]) <= 1e-12
    c3 = attn_ext.causal_attention(q3, k3, v3)
    assert torch.equal(c3, out3)


def test_causal_attention_matches_attention(device):
    q, k, v = make_qkv(1, 30, 40, 4, 2, 32, 32, torch.float32, device)
    a = attn_ext.causal_attention(q, k, v, scale=0.2)
    b = torch.ops.attn_ext.attention(q, k, v, True, 0.2)
    c = torch.ops.attn_ext.attention_forward(q, k, v, True, 0.2)[0]
    assert torch.equal(a, b) and torch.equal(a, c)


def test_threads_agree(device):
    """One thread and 2 / 3 threads give the same values (up to rounding). The counts are set
    explicitly: with "all threads" a 1-core runner (or OMP_NUM_THREADS=1) compared 1 with 1."""
    q, k, v = make_qkv(1, 200, 200, 4, 2, 64, 64, torch.float32, device)
    dout = randn(1, 200, 4, 64, device=device)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_ours(q, k, v, True, dout)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            many = run_ours(q, k, v, True, dout)
            for a, b in zip(one, many):
                assert max_err(a, b) <= 1e-5
    finally:
        torch.set_num_threads(n)


def test_deterministic(device):
    """Forward and backward are bitwise identical from run to run (fixed thread count)."""
    q, k, v = make_qkv(2, 300, 300, 4, 2, 64, 64, torch.float32, device)
    dout = randn(2, 300, 4, 64, device=device)
    first = run_ours(q, k, v, True, dout)
    second = run_ours(q, k, v, True, dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ---- opcheck / gradcheck -----------------------------------------------------------------

OPCHECK_CASES = [
    pytest.param((2, 9, 9, 2, 2, 16, 16), True, id="causal"),
    pytest.param((1, 5, 11, 4, 2, 16, 8), False, id="gqa-dv"),
]


@pytest.mark.parametrize("shape,causal", OPCHECK_CASES)
def test_opcheck(shape, causal, device):
    B, Sq, Sk, H, Hkv, D, Dv = shape
    q, k, v = [t.requires_grad_() for t in make_qkv(B, Sq, Sk, H, Hkv, D, Dv, torch.float32, device)]
    ops = torch.ops.attn_ext
    torch.library.opcheck(ops.attention_forward.default, (q, k, v, causal, None))
    torch.library.opcheck(ops.attention_forward.default, (q, k, v, causal, 0.5))
    torch.library.opcheck(ops.attention.default, (q, k, v, causal, None))
    torch.library.opcheck(ops.causal_attention.default, (q, k, v, None))
    with torch.no_grad():
        out, lse = ops.attention_forward(q, k, v, causal, None)
    dout = randn(*out.shape, device=device)
    torch.library.opcheck(ops.attention_backward.default, (dout, q.detach(), k.detach(),
                                                           v.detach(), out, lse, causal, None))


@pytest.mark.parametrize("S", [37, 250])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("Hkv", [2, 1], ids=["gqa", "mqa"])
def test_gradient_layout_of_bhsd_views(Hkv, dtype, S, device):
    """q / k / v passed as transpose(1, 2) views of contiguous (B, H, S, D) tensors: on CPU
    each gradient is returned in its input's (B, H, S, D) memory layout (so autograd hands it
    to a BHSD leaf without a transpose copy), with the bits of the BSHD-contiguous call; every
    other input (BSHD, a single head, CUDA) gets BSHD-contiguous gradients. opcheck checks that
    the fake tensors' strides agree. (On CPU the BSHD call's dk / dv, rows H * D apart,
    accumulate in a per-unit buffer and the views' in the gradients themselves: S = 250 gives
    each unit several query blocks and key tiles, so the bits compare those two paths.)"""
    B, H, D, Dv = 2, 4, 16, 24
    q, k, v = make_qkv(B, S, S, H, Hkv, D, Dv, dtype, device, "transposed")
    ops = torch.ops.attn_ext
    out, lse = ops.attention_forward(q, k, v, True, None)
    dout = randn(*out.shape, dtype=dtype, device=device)
    grads = ops.attention_backward(dout, q, k, v, out, lse, True, None)
    contig = ops.attention_backward(dout, q.contiguous(), k.contiguous(), v.contiguous(), out,
                                    lse, True, None)
    for x, g, c in zip((q, k, v), grads, contig):
        assert g.shape == x.shape and c.is_contiguous()
        assert torch.equal(g, c)
        heads = x.shape[2]
        if device == "cpu" and heads > 1:
            assert g.transpose(1, 2).is_contiguous() and not g.is_contiguous(), g.stride()
        else:
            assert g.is_contiguous(), g.stride()
    # q as a BHSD view, k / v BSHD contiguous: each gradient follows its own input
    mixed = ops.attention_backward(dout, q, k.contiguous(), v.contiguous(), out, lse, True, None)
    assert mixed[1].is_contiguous() and mixed[2].is_contiguous()
    assert mixed[0].is_contiguous() == (device != "cpu")
    if dtype == torch.float32 and S < 100:
        torch.library.opcheck(ops.attention_backward.default, (dout, q, k, v, out, lse, True, None))
        torch.library.opcheck(ops.attention_backward.default,
                              (dout, q, k.contiguous(), v.contiguous(), out, lse, True, None))


def test_bhsd_leaf_gradients_are_not_copied():
    """Autograd through BHSD leaves passed as views: the backward's gradients reach the leaves
    without a copy into their layout (no aten::copy_ in the backward; before the CPU backward
    returned gradients in its inputs' layout there were three, one per gradient)."""
    leaves = [randn(1, h, 64, 32).requires_grad_() for h in (4, 2, 2)]  # (B, H, S, D)
    out = attn_ext.attention(*(x.transpose(1, 2) for x in leaves), causal=True)
    dout = randn(*out.shape)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.backward(dout)
    names = [e.name for e in prof.events()]
    assert "attn_ext::attention_backward_rel_bias" in names
    assert "aten::copy_" not in names, [n for n in names if n.startswith("aten::")]
    want = torch.ops.attn_ext.attention_backward(
        dout, *(x.detach().transpose(1, 2).contiguous() for x in leaves),
        *torch.ops.attn_ext.attention_forward(*(x.detach().transpose(1, 2) for x in leaves), True,
                                              None), True, None)
    for leaf, g in zip(leaves, want):
        assert leaf.grad.is_contiguous() and torch.equal(leaf.grad, g.transpose(1, 2))


@pytest.mark.parametrize(
    "shape,causal",
    [
        pytest.param((1, 5, 5, 2, 2, 6, 6), True, id="causal"),
        pytest.param((2, 4, 7, 4, 2, 5, 3), False, id="gqa-dv"),
        pytest.param((1, 7, 4, 2, 1, 4, 4), True, id="sq>sk"),
        pytest.param((1, 3, 9, 2, 2, 4, 4), True, id="sq<sk"),
    ],
)
def test_gradcheck(shape, causal, device):
    B, Sq, Sk, H, Hkv, D, Dv = shape
    q, k, v = [t.requires_grad_() for t in make_qkv(B, Sq, Sk, H, Hkv, D, Dv, torch.float64, device)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: attn_ext.attention(q, k, v, causal=causal), (q, k, v)
    )


# ---- errors ------------------------------------------------------------------------------


def _inputs(device, dtype=torch.float32):
    return make_qkv(2, 8, 8, 4, 2, 16, 16, dtype, device)


ERROR_CASES = {
    "q-rank": (lambda q, k, v: (q[0], k, v), r"q must have 4 dims \(B, Sq, H, D\)"),
    "k-rank": (lambda q, k, v: (q, k[0], v), r"k must have 4 dims"),
    "v-rank": (lambda q, k, v: (q, k, v[..., None]), r"v must have 4 dims"),
    "batch": (lambda q, k, v: (q, k[:1], v), r"k must have batch size B = 2"),
    "v-batch": (lambda q, k, v: (q, k, v[:1]), r"v must have batch size B = 2"),
    "head-dim": (lambda q, k, v: (q, k[..., :8], v), r"k must have head dim D = 16"),
    "sk": (lambda q, k, v: (q, k, v[:, :5]), r"v must have Sk = 8 keys"),
    "v-heads": (lambda q, k, v: (q, k, v[:, :, :1]), r"v must have Hkv = 2 heads"),
    "gqa": (lambda q, k, v: (q[:, :, :3], k, v), r"Hkv = 2 must divide q's number of heads H = 3"),
    "dtype": (lambda q, k, v: (q, k.double(), v), r"k must have the same dtype as q"),
    "v-dtype": (lambda q, k, v: (q, k, v.half()), r"v must have the same dtype as q"),
    "int": (lambda q, k, v: (q.int(), k.int(), v.int()), r"q must be float32, float64, float16 or bfloat16"),
    "q-last-dim": (lambda q, k, v: (q.transpose(2, 3).contiguous().transpose(2, 3), k, v),
                   r"q must have a contiguous last dim"),
    "k-last-dim": (lambda q, k, v: (q, torch.empty(2, 8, 2, 32)[..., ::2], v),
                   r"k must have a contiguous last dim"),
    "v-last-dim": (lambda q, k, v: (q, k, torch.empty(2, 8, 2, 32)[..., ::2]), r"v must have a contiguous last dim"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors(case, device):
    make, pattern = ERROR_CASES[case]
    q, k, v = make(*_inputs(device))
    q, k, v = q.to(device), k.to(device), v.to(device)
    for call in (
        lambda: torch.ops.attn_ext.attention_forward(q, k, v, True),
        lambda: torch.ops.attn_ext.attention(q, k, v),
        lambda: torch.ops.attn_ext.causal_attention(q, k, v),
    ):
        with pytest.raises(RuntimeError, match=pattern):
            call()


def test_errors_backward(device):
    q, k, v = _inputs(device)
    out, lse = torch.ops.attn_ext.attention_forward(q, k, v, True)
    bwd = torch.ops.attn_ext.attention_backward
    with pytest.raises(RuntimeError, match=r"lse must have shape \[2, 4, 8\]"):
        bwd(out, q, k, v, out, lse[:, :2], True)
    with pytest.raises(RuntimeError, match=r"lse must be Float for Float inputs"):
        bwd(out, q, k, v, out, lse.double(), True)
    with pytest.raises(RuntimeError, match=r"dout must have shape"):
        bwd(out[:, :4], q, k, v, out, lse, True)
    with pytest.raises(RuntimeError, match=r"dout must have a contiguous last dim"):
        bwd(torch.empty(2, 8, 4, 32, device=device)[..., ::2], q, k, v, out, lse, True)
    with pytest.raises(RuntimeError, match=r"out must have the same dtype as q"):
        bwd(out, q, k, v, out.double(), lse, True)


def test_error_scale_and_wrapper(device):
    q, k, v = _inputs(device)
    with pytest.raises(RuntimeError, match=r"scale must be finite"):
        torch.ops.attn_ext.attention_forward(q, k, v, False, float("nan"))
    with pytest.raises(ValueError, match=r"with 3-D q"):
        attn_ext.attention(q[:, :, 0], k, v)


def test_error_device_mix(device):
    if device != "cuda":
        pytest.skip("needs a second device type")
    q, k, v = _inputs(device)
    with pytest.raises(RuntimeError, match=r"k must be on the same device as q"):
        torch.ops.attn_ext.attention_forward(q, k.cpu(), v, True)


# ---- TorchScript ---------------------------------------------------------------------------


def test_torchscript(device):
    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.attn_ext.causal_attention(q, k, v)

    scripted = torch.jit.script(f)
    q, k, v = make_qkv(1, 12, 12, 2, 2, 16, 16, torch.float64, device)
    got = scripted(q, k, v)
    want = reference.attention(q, k, v, causal=True)
    assert max_err(got, want) <= 1e-12
    assert "attn_ext::causal_attention" in str(scripted.graph)


def test_attention_backward_schema_is_issue_4s_three_gradients():
    """Issue 4: attention_backward(dout, q, k, v, out, lse, causal, scale=None) -> (dq, dk, dv).
    attention_backward_rel_bias is the same call with d rel_bias as a fourth output (what
    autograd uses); both run one kernel, so the three gradients are bitwise equal. The varlen
    pair is alike."""
    lib = torch.ops.attn_ext
    assert str(lib.attention_backward.default._schema).endswith("-> (Tensor dq, Tensor dk, Tensor dv)")
    assert str(lib.attention_varlen_backward.default._schema).endswith(
        "-> (Tensor dq, Tensor dk, Tensor dv)")
    q, k, v = randn(2, 9, 4, 16), randn(2, 11, 2, 16), randn(2, 11, 2, 8)
    out, lse = lib.attention_forward(q, k, v, True)
    dout = torch.randn_like(out)
    grads = lib.attention_backward(dout, q, k, v, out, lse, True)
    assert len(grads) == 3
    dq, dk, dv = grads
    rel = torch.randn(4, 7)
    out_r, lse_r = lib.attention_forward(q, k, v, True, None, -1, -1, None, None, rel)
    full = lib.attention_backward_rel_bias(dout, q, k, v, out_r, lse_r, True, None, -1, -1, None,
                                           None, None, rel)
    three = lib.attention_backward(dout, q, k, v, out_r, lse_r, True, None, -1, -1, None, None,
                                   None, rel)
    assert len(full) == 4 and full[3].shape == rel.shape
    for a, b in zip(three, full[:3]):
        assert torch.equal(a, b)
    qd, kd, vd = [t.clone().requires_grad_() for t in (q, k, v)]
    attn_ext.attention(qd, kd, vd, causal=True).backward(dout)
    for ours, ref_grad in zip((dq, dk, dv), (qd.grad, kd.grad, vd.grad)):
        assert torch.equal(ours, ref_grad)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11], dtype=torch.int32)
    vo, vl = lib.attention_varlen_forward(q[0], k[0], v[0], cu_q, cu_k, 5, 6, True)
    vg = lib.attention_varlen_backward(torch.ones_like(vo), q[0], k[0], v[0], vo, vl, cu_q, cu_k,
                                       5, 6, True)
    vf = lib.attention_varlen_backward_rel_bias(torch.ones_like(vo), q[0], k[0], v[0], vo, vl,
                                                cu_q, cu_k, 5, 6, True)
    assert len(vg) == 3 and all(torch.equal(a, b) for a, b in zip(vg, vf[:3]))
    torch.library.opcheck(lib.attention_backward.default, (dout, q, k, v, out, lse, True, None))
