"""attn_ext.rope / rope_ / rope_qk / rope_cache against attn_ext/reference.py.

Every value test compares with the textbook reference evaluated in float64 on the same inputs
(the same tables, upcast) and applies the tolerance rule of DESIGN.md.
"""

import os
import subprocess
import sys

import pytest
import torch

import attn_ext
from attn_ext import reference as R
from utils import assert_close_rule, randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _tables(s_max, rot, dtype, device):
    cos, sin = attn_ext.rope_cache(s_max, rot, dtype=dtype, device=device)
    return cos, sin


def _positions(mode, B, S, s_max, device):
    if mode == "S":
        return torch.randint(0, s_max, (S,), device=device)
    if mode == "BS":
        return torch.randint(0, s_max, (B, S), device=device)
    return None


def _check(ours, x, cos, sin, positions, offset, interleaved, name="rope"):
    """ours vs the reference in float64 on the same x/cos/sin, tolerance rule."""
    ref64 = R.rope(x.double(), cos.double(), sin.double(), positions, offset, interleaved)
    ref_low = R.rope(x, cos, sin, positions, offset, interleaved)
    assert_close_rule(ours, ref64, ref_low, name)


# ---------------------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("D,rot", [(64, 64), (72, 36)])  # rot = D and D/2 (tail pairs)
@pytest.mark.parametrize("pos_mode,offset", [(None, 0), (None, 9), ("S", 0), ("BS", 0)])
@pytest.mark.parametrize("table", ["fp32", "x"])
def test_rope_values(device, dtype, interleaved, D, rot, pos_mode, offset, table):
    B, S, H, s_max = 2, 37, 3, 64  # odd S
    x = randn(B, S, H, D, dtype=dtype, device=device)
    cos, sin = _tables(s_max, rot, torch.float32 if table == "fp32" else dtype, device)
    pos = _positions(pos_mode, B, S, s_max, device)
    out = attn_ext.rope(x, cos, sin, pos, offset, interleaved)
    assert out.dtype == dtype and out.is_contiguous()
    _check(out, x, cos, sin, pos, offset, interleaved)
    # In place gives the same bits as out of place.
    y = x.clone()
    assert attn_ext.rope_(y, cos, sin, pos, offset, interleaved) is y
    torch.testing.assert_close(y, out, rtol=0, atol=0)


@pytest.mark.parametrize("S", [1, 2, 1025])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_lengths(device, S, interleaved):
    x = randn(1, S, 2, 32, device=device)
    cos, sin = _tables(S + 3, 32, torch.float32, device)
    _check(attn_ext.rope(x, cos, sin, offset=3, interleaved=interleaved), x, cos, sin, None, 3,
           interleaved)


def test_rope_empty(device):
    cos, sin = _tables(8, 16, torch.float32, device)
    for shape in [(0, 4, 2, 16), (2, 0, 2, 16), (2, 4, 0, 16)]:
        x = torch.empty(shape, device=device)
        assert attn_ext.rope(x, cos, sin).shape == shape
        attn_ext.rope_(x, cos, sin)


def test_rope_3d_input_is_one_head(device):
    x = randn(2, 11, 32, device=device)
    cos, sin = _tables(11, 16, torch.float32, device)
    out = attn_ext.rope(x, cos, sin)
    assert out.shape == x.shape
    _check(out[:, :, None], x[:, :, None], cos, sin, None, 0, False)


# ---------------------------------------------------------------------------------------
# strided inputs: packed QKV slices and transposed views
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot_frac", [0.5, 1.0])
def test_rope_packed_qkv_inplace(device, dtype, interleaved, rot_frac):
    B, S, H, Hkv, D = 2, 19, 4, 2, 64
    rot = int(D * rot_frac)
    widths = [H * D, Hkv * D, Hkv * D]
    buf = randn(B, S, sum(widths), dtype=dtype, device=device)
    before = buf.clone()
    q = buf[..., : H * D].view(B, S, H, D)
    k = buf[..., H * D : (H + Hkv) * D].view(B, S, Hkv, D)
    assert not q.is_contiguous()
    cos, sin = _tables(S, rot, torch.float32, device)
    pos = torch.randperm(S, device=device)
    # Out of place first: x untouched, values right.
    q_out, k_out = attn_ext.rope_qk(q, k, cos, sin, pos, interleaved=interleaved)
    torch.testing.assert_close(buf, before, rtol=0, atol=0)
    _check(q_out, q, cos, sin, pos, 0, interleaved, "q")
    _check(k_out, k, cos, sin, pos, 0, interleaved, "k")
    # In place, q and k in one call: same bits; v and non-rotary channels untouched.
    q2, k2 = attn_ext.rope_qk(q, k, cos, sin, pos, interleaved=interleaved, inplace=True)
    assert q2 is q and k2 is k
    torch.testing.assert_close(q, q_out, rtol=0, atol=0)
    torch.testing.assert_close(k, k_out, rtol=0, atol=0)
    torch.testing.assert_close(buf[..., (H + Hkv) * D :], before[..., (H + Hkv) * D :], rtol=0, atol=0)
    qb = before[..., : H * D].view(B, S, H, D)
    torch.testing.assert_close(q[..., rot:], qb[..., rot:], rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_transposed_input(device, interleaved):
    B, H, S, D = 2, 3, 29, 32
    x_bhsd = randn(B, H, S, D, device=device)
    x = x_bhsd.transpose(1, 2)  # (B, S, H, D) view, S stride D, H stride S*D
    before = x_bhsd.clone()
    cos, sin = _tables(40, 32, torch.float32, device)
    out = attn_ext.rope(x, cos, sin, offset=4, interleaved=interleaved)
    torch.testing.assert_close(x_bhsd, before, rtol=0, atol=0)  # out of place: x untouched
    _check(out, x, cos, sin, None, 4, interleaved)
    attn_ext.rope_(x, cos, sin, offset=4, interleaved=interleaved)
    torch.testing.assert_close(x, out, rtol=0, atol=0)


def test_rope_inplace_leaves_non_rotary_channels(device):
    x = randn(2, 9, 3, 96, device=device)
    before = x.clone()
    cos, sin = _tables(9, 32, torch.float32, device)
    attn_ext.rope_(x, cos, sin)
    torch.testing.assert_close(x[..., 32:], before[..., 32:], rtol=0, atol=0)
    assert not torch.equal(x[:, 1:, :, :32], before[:, 1:, :, :32])


def test_rope_qk_gqa_values(device):
    q = randn(2, 13, 8, 64, device=device)
    k = randn(2, 13, 2, 64, device=device)
    cos, sin = _tables(20, 64, torch.float32, device)
    pos = torch.randint(0, 20, (2, 13), device=device)
    qo, ko = attn_ext.rope_qk(q, k, cos, sin, pos)
    _check(qo, q, cos, sin, pos, 0, False, "q")
    _check(ko, k, cos, sin, pos, 0, False, "k")


# ---------------------------------------------------------------------------------------
# rotation properties (float64)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_preserves_norm(device, interleaved):
    x = randn(2, 50, 3, 64, dtype=torch.float64, device=device)
    cos, sin = _tables(50, 64, torch.float64, device)
    out = attn_ext.rope(x, cos, sin, interleaved=interleaved)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_dot_product_depends_on_relative_position(device, interleaved):
    q = randn(1, 1, 1, 64, dtype=torch.float64, device=device).expand(1, 4, 1, 64)
    k = randn(1, 1, 1, 64, dtype=torch.float64, device=device).expand(1, 4, 1, 64)
    cos, sin = _tables(600, 64, torch.float64, device)
    m = torch.tensor([5, 40, 300, 599], device=device)
    qr = attn_ext.rope(q, cos, sin, m, interleaved=interleaved)
    kr = attn_ext.rope(k, cos, sin, m - 3, interleaved=interleaved)
    dots = (qr * kr).sum(-1).flatten()  # all at m - n = 3
    torch.testing.assert_close(dots, dots[:1].expand(4), rtol=1e-10, atol=1e-10)
    kr0 = attn_ext.rope(k, cos, sin, m - 4, interleaved=interleaved)
    assert not torch.allclose((qr * kr0).sum(-1).flatten(), dots)  # and m - n matters


def test_rope_inverse_roundtrip(device):
    x = randn(2, 7, 2, 32, dtype=torch.float64, device=device)
    cos, sin = _tables(7, 32, torch.float64, device)
    y = attn_ext.rope(x, cos, sin, interleaved=True)
    back = torch.ops.attn_ext._rope_backward(y, cos, sin, None, 0, True)
    torch.testing.assert_close(back, x, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------
# autograd and op registration
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("pos_mode", [None, "BS"])
def test_rope_gradcheck(device, interleaved, pos_mode):
    x = randn(2, 5, 2, 12, dtype=torch.float64, device=device).requires_grad_()
    cos, sin = _tables(8, 8, torch.float64, device)
    pos = _positions(pos_mode, 2, 5, 8, device)
    off = 0 if pos is not None else 2
    fn = lambda t: attn_ext.rope(t, cos, sin, pos, off, interleaved)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_grad_low_precision(device, dtype):
    x = randn(2, 9, 2, 40, dtype=dtype, device=device)
    g = randn(2, 9, 2, 40, dtype=dtype, device=device)
    cos, sin = _tables(9, 32, torch.float32, device)

    def grad_of(fn, xx):
        xx = xx.detach().requires_grad_()
        fn(xx).backward(g.to(xx.dtype))
        return xx.grad

    ours = grad_of(lambda t: attn_ext.rope(t, cos, sin, interleaved=True), x)
    ref64 = grad_of(lambda t: R.rope(t, cos.double(), sin.double(), interleaved=True), x.double())
    ref_low = grad_of(lambda t: R.rope(t, cos, sin, interleaved=True), x)
    assert_close_rule(ours, ref64, ref_low, "grad x")


def test_rope_table_grad_is_refused(device):
    x = randn(1, 3, 1, 8, device=device, dtype=torch.float64).requires_grad_()
    cos, sin = _tables(3, 8, torch.float64, device)
    with pytest.raises(ValueError, match="cos/sin"):
        attn_ext.rope(x, cos.requires_grad_(), sin)
    out = torch.ops.attn_ext.rope(x, cos, sin)  # the raw op: refused at backward
    with pytest.raises(RuntimeError, match="cos/sin"):
        out.sum().backward()


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_opcheck(device, interleaved):
    x = randn(2, 5, 3, 16, device=device)
    k = randn(2, 5, 1, 16, device=device)
    cos, sin = _tables(9, 8, torch.float32, device)
    pos = torch.randint(0, 9, (2, 5), device=device)
    ops = torch.ops.attn_ext
    arg_sets = [(x, cos, sin, pos, 0, interleaved)]
    if not interleaved:  # defaults and the offset path once
        arg_sets += [(x, cos, sin), (x, cos, sin, None, 3, interleaved)]
    for args in arg_sets:
        torch.library.opcheck(ops.rope.default, args)
        torch.library.opcheck(ops._rope_backward.default, args)
        torch.library.opcheck(ops.rope_.default, (x.clone(),) + args[1:])
    torch.library.opcheck(ops.rope_qk_.default, (x.clone(), k.clone(), cos, sin, pos, 0, interleaved))
    x64 = x.double().requires_grad_()
    torch.library.opcheck(ops.rope.default, (x64, cos.double(), sin.double(), pos, 0, interleaved))


def test_rope_torch_compile(device):
    x = randn(2, 6, 2, 16, device=device)
    cos, sin = _tables(6, 16, torch.float32, device)
    fn = torch.compile(lambda t: attn_ext.rope(t, cos, sin) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(fn(x), attn_ext.rope(x, cos, sin) * 2)


# ---------------------------------------------------------------------------------------
# errors name the argument
# ---------------------------------------------------------------------------------------


def test_rope_errors(device):
    x = randn(2, 4, 2, 16, device=device)
    cos, sin = _tables(8, 16, torch.float32, device)
    rope = attn_ext.rope
    cases = [
        (lambda: rope(x, *_tables(8, 32, torch.float32, device)), "rotary_dim"),
        (lambda: rope(x, cos, sin[:, :4]), "same shape"),
        (lambda: rope(x, cos, sin.double()), "same dtype"),
        (lambda: rope(x, cos.half(), sin.half()), "float32 or x's dtype"),
        (lambda: rope(x, cos[0], sin[0]), "cos must have 2 dims"),
        (lambda: rope(x, cos.t().contiguous().t(), sin), "cos must have a contiguous last dim"),
        (lambda: rope(x, cos, sin, torch.arange(4, device=device, dtype=torch.int32)), "positions must be int64"),
        (lambda: rope(x, cos, sin, torch.arange(5, device=device)), "positions of shape"),
        (lambda: rope(x, cos, sin, None, 5), "offset"),
        (lambda: rope(x, cos, sin, None, -1), "offset"),
        (lambda: rope(x.transpose(-1, -2), cos[:, :1], sin[:, :1]), "x must have a contiguous last dim"),
        (lambda: torch.ops.attn_ext.rope(x[0], cos, sin), "x must have 4 dims"),
        (lambda: rope(x.to(torch.int32), cos, sin), "x must be float32"),
        (lambda: attn_ext.rope_qk(x, randn(2, 5, 2, 16, device=device), cos, sin, inplace=True), "k must have B = 2 and S = 4"),
        (lambda: attn_ext.rope_qk(x, x.double(), cos, sin, inplace=True), "k must have q's dtype"),
    ]
    for fn, msg in cases:
        with pytest.raises((RuntimeError, ValueError), match=msg):
            fn()


def test_rope_positions_out_of_range_cpu():
    # CPU checks every position before reading the tables. (CUDA does not sync to check:
    # the kernel device-asserts and skips the row, which would poison the test process.)
    x = randn(2, 4, 2, 16)
    cos, sin = _tables(8, 16, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, cos.size\(0\) = 8\), got positions\[2\] = 8"):
        attn_ext.rope(x, cos, sin, torch.tensor([0, 1, 8, 2]))
    with pytest.raises(RuntimeError, match=r"positions\[1, 1\] = -1"):
        attn_ext.rope_(x, cos, sin, torch.tensor([[0, 1, 2, 3], [0, -1, 2, 3]]))
    with pytest.raises(RuntimeError, match=r"positions\[0\] = 1000000"):
        attn_ext.rope_qk(x, x.clone(), cos, sin, torch.tensor([1000000, 0, 1, 2]), inplace=True)


# ---------------------------------------------------------------------------------------
# rope_cache and its scalings
# ---------------------------------------------------------------------------------------

SCALINGS = [
    {"type": "linear", "factor": 4.0},
    {"type": "ntk", "factor": 2.0, "original_max_position_embeddings": 64},
    {"type": "dynamic", "factor": 3.0, "original_max_position_embeddings": 200},
    {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2},
    {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
]


def test_rope_cache_unscaled_matches_reference(device):
    cos, sin = attn_ext.rope_cache(100, 48, dtype=torch.float64, device=device)
    rc, rs = R.rope_cache(100, 48)
    torch.testing.assert_close(cos.cpu(), rc, rtol=0, atol=1e-13)
    torch.testing.assert_close(sin.cpu(), rs, rtol=0, atol=1e-13)
    c32, _ = attn_ext.rope_cache(100, 48, device=device)
    assert c32.dtype == torch.float32 and c32.device.type == device


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s.get("type", s.get("rope_type")))
def test_rope_cache_scaled_matches_reference(scaling):
    seq_len, rot = 128, 32
    cos, sin = attn_ext.rope_cache(seq_len, rot, 500.0, scaling, dtype=torch.float64)
    rc, rs = R.rope_cache_scaled(seq_len, rot, 500.0, scaling)
    torch.testing.assert_close(cos, rc, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sin, rs, rtol=1e-12, atol=1e-12)


def test_rope_cache_scaling_properties():
    base_cos, _ = attn_ext.rope_cache(64, 16, dtype=torch.float64)
    # linear: position p with factor 4 is unscaled position p / 4.
    lin, _ = attn_ext.rope_cache(64, 16, scaling={"type": "linear", "factor": 4.0}, dtype=torch.float64)
    torch.testing.assert_close(lin[::4], base_cos[:16])
    # dynamic NTK: unchanged while seq_len <= original context.
    ntk, _ = attn_ext.rope_cache(64, 16, scaling={"type": "ntk", "factor": 4.0, "original_max_position_embeddings": 64}, dtype=torch.float64)
    torch.testing.assert_close(ntk, base_cos)
    # yarn: the attention factor scales both tables at position 0.
    yc, ys = attn_ext.rope_cache(4, 16, scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, dtype=torch.float64)
    torch.testing.assert_close(yc[0], torch.full((8,), 0.1 * torch.log(torch.tensor(4.0)).item() + 1, dtype=torch.float64))
    # llama3: highest frequency unchanged, lowest divided by the factor.
    f, _ = attn_ext.rope_inv_freq(128, 500000.0, {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192})
    f0, _ = attn_ext.rope_inv_freq(128, 500000.0)
    assert f[0] == f0[0] and torch.isclose(f[-1], f0[-1] / 8)


def test_rope_cache_errors():
    with pytest.raises(ValueError, match="rotary_dim"):
        attn_ext.rope_cache(4, 7)
    with pytest.raises(ValueError, match="type"):
        attn_ext.rope_cache(4, 8, scaling={"type": "bogus", "factor": 2.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        attn_ext.rope_cache(4, 8, scaling={"type": "yarn", "factor": 2.0})
    # YaRN's optional numbers are checked like the others (NaN / inf / 0 / a string used to
    # be taken: NaN, inf, all-zero tables, or a TypeError naming nothing)
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    for key, bad in (("attention_factor", float("nan")), ("attention_factor", float("inf")),
                     ("attention_factor", 0), ("attention_factor", -2.0), ("attention_factor", "1.1"),
                     ("mscale", "a"), ("mscale", float("nan")), ("mscale_all_dim", float("inf"))):
        extra = {"mscale": 1.0, "mscale_all_dim": 1.0} if key != "attention_factor" else {}
        with pytest.raises(ValueError, match=rf"scaling\['{key}'\] must be a finite number"):
            attn_ext.rope_cache(8, 8, scaling={**yarn, **extra, key: bad})
    # None means "derived", as in transformers
    torch.testing.assert_close(attn_ext.rope_cache(8, 8, scaling={**yarn, "attention_factor": None}),
                               attn_ext.rope_cache(8, 8, scaling=yarn), rtol=0, atol=0)


def test_rope_cache_takes_transformers_rope_parameters():
    """transformers 5's config.rope_parameters: {"rope_type": "default", "rope_theta": ...} is
    no scaling; a rope_theta must agree with base (it used to be dropped silently)."""
    plain = attn_ext.rope_cache(16, 8, base=500000.0)
    got = attn_ext.rope_cache(16, 8, base=500000.0,
                              scaling={"rope_type": "default", "rope_theta": 500000.0})
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    a = attn_ext.rope_cache(16, 8, base=500000.0, scaling={**llama3, "rope_theta": 500000})
    b = attn_ext.rope_cache(16, 8, base=500000.0, scaling=llama3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match=r"rope_theta'\] = 500000.0 differs from base = 10000.0"):
        attn_ext.rope_cache(16, 8, scaling={**llama3, "rope_theta": 500000.0})


def test_rotary_embedding_warns_when_dynamic_scaling_does_nothing():
    """The module sets the ntk / dynamic base once, for max_seq_len: at or below L0 the
    tables are unscaled at every length, which used to pass without a word."""
    scaling = {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}
    with pytest.warns(UserWarning, match="unscaled at every length"):
        rot = attn_ext.RotaryEmbedding(16, scaling=scaling, max_seq_len=64)
    plain = attn_ext.RotaryEmbedding(16, max_seq_len=64)
    assert torch.equal(rot.tables(256)[0], plain.tables(256)[0])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rot = attn_ext.RotaryEmbedding(16, scaling=scaling, max_seq_len=256)
    want, _ = attn_ext.rope_cache(256, 16, scaling=scaling)
    assert torch.equal(rot.tables(256)[0], want)


# ---------------------------------------------------------------------------------------
# the portable (non-AVX2) CPU path: values and gradients by the tolerance rule
# ---------------------------------------------------------------------------------------

_SCALAR_SCRIPT = r"""
import torch, attn_ext
from attn_ext import reference as R
from tests.utils import assert_close_rule
torch.manual_seed(0)
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for inter in (False, True):
        x = torch.randn(2, 7, 3, 70).to(dt)
        cos, sin = attn_ext.rope_cache(7, 36)
        xg = x.clone().requires_grad_()
        out = attn_ext.rope(xg, cos, sin, interleaved=inter)
        dout = torch.randn(out.shape).to(dt)
        out.backward(dout)
        refs = []
        for rdt in (torch.float64, dt):  # the rule: float64, and the reference in dt
            xr = x.to(rdt).requires_grad_()
            r = R.rope(xr, cos.to(rdt), sin.to(rdt), interleaved=inter)
            r.backward(dout.to(rdt))
            refs.append((r.detach(), xr.grad))
        assert_close_rule(out.detach(), refs[0][0], refs[1][0], f"rope {dt} {inter}")
        assert_close_rule(xg.grad, refs[0][1], refs[1][1], f"rope grad {dt} {inter}")
        s = torch.rand(3, 50).to(dt)
        assert_close_rule(attn_ext.sinusoidal_pe(s), R.sinusoidal_pe(s.double()),
                          R.sinusoidal_pe(s), f"sinusoidal {dt}")
print("scalar-ok")
"""


def test_portable_cpu_path():
    env = dict(os.environ, ATTN_EXT_CPU_SIMD="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", _SCALAR_SCRIPT], env=env, cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "scalar-ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_large_out_of_place_equals_in_place_cpu(dtype, interleaved):
    # A large (>= 8 MiB) out-of-place output: same bits as the in-place path.
    q = randn(4, 512, 16, 128, dtype=dtype)
    cos, sin = _tables(512, 128, torch.float32, "cpu")
    out = attn_ext.rope(q, cos, sin, interleaved=interleaved)
    y = q.clone()
    attn_ext.rope_(y, cos, sin, interleaved=interleaved)
    torch.testing.assert_close(out, y, rtol=0, atol=0)
    _check(out[:, :64], q[:, :64], cos, sin, None, 0, interleaved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_nan_inf_propagate(device, dtype, interleaved):
    # The vector paths' fp32 -> bf16/fp16 rounding must keep NaN a NaN and inf an inf.
    x = randn(1, 3, 2, 32, dtype=dtype, device=device)
    x[0, 1, 0, 5] = float("nan")
    x[0, 2, 1, 7] = float("inf")
    cos, sin = _tables(3, 32, torch.float32, device)
    out = attn_ext.rope(x, cos, sin, interleaved=interleaved)
    ref = R.rope(x.double(), cos.double(), sin.double(), interleaved=interleaved)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))


def test_rope_cuda_row_of_more_than_2_31_units():
    """One token row of 2^32 + 32 heads (bf16, D = 2: one work unit per head on the scalar
    path): the CUDA launcher counted a row's units in 32 bits, so this call rotated heads 0-31
    only and left the rest of `out` unwritten (and rope_qk_'s sum of two such counts wrapped
    negative). 16 GiB each for x and out; skipped without a GPU that has the room."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    H = 2 ** 32 + 32
    if torch.cuda.mem_get_info()[0] < 2 * (2 * H * 2) + (2 << 30):
        pytest.skip("needs ~34 GiB of free GPU memory")
    x = torch.randn(1, 1, H, 2, dtype=torch.bfloat16, device="cuda")
    cos, sin = attn_ext.rope_cache(4, 2, dtype=torch.float32, device="cuda")
    out = attn_ext.rope(x, cos, sin, offset=3)
    for h0 in (0, 2 ** 31 - 8, 2 ** 32 - 8, H - 16):  # around both 32-bit boundaries, and the end
        _check(out[:, :, h0:h0 + 16].cpu(), x[:, :, h0:h0 + 16].cpu(), cos.cpu(), sin.cpu(),
               None, 3, False, name=f"heads {h0}+")
    del out
    torch.cuda.empty_cache()
