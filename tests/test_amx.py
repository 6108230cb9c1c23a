"""bf16 products on AMX tiles in the tiled CPU kernels (csrc/cpu/attention_amx.cpp, where the CPU
has AMX-TILE + AMX-BF16; ATTN_EXT_CPU_AMX=0 turns them off): the forward's scores (D a multiple
of 32) and its o += p v (Dv a multiple of 16), the backward's recomputed scores, its dP and the row
term Di, its dv += P^T dout (Dv a multiple of 16), dk += dS^T q and dq^T += k^T dS^T (D a
multiple of 16), against the float64 textbook by the tolerance rule. The cases reach every tail the tiles
stage (rows and columns not multiples of 16, key tiles that start off a 32-key block: windows,
the split-KV forward), the paths that keep one product off the tiles (D or Dv not a multiple),
inf / NaN in v's hidden keys (the key-by-key sum), the score terms, and the thread counts."""

import pytest
import torch

import attn_ext
from attn_ext._explain import cpu_amx_enabled
from tests.test_bf16dp import _check, _ref, _run
from tests.utils import assert_close_rule, with_threads

pytestmark = pytest.mark.skipif(not cpu_amx_enabled(), reason="no AMX on this CPU")


def _qkv(B, Sq, Sk, H, Hkv, D, Dv, seed):
    torch.manual_seed(seed)
    q = torch.randn(B, Sq, H, D).bfloat16()
    return q, torch.randn(B, Sk, Hkv, D).bfloat16(), torch.randn(B, Sk, Hkv, Dv).bfloat16()


CASES = [
    # B, Sq, Sk, H, Hkv, D, Dv, kwargs
    (2, 200, 200, 4, 2, 64, 64, dict(causal=True)),           # GQA, whole and diagonal tiles
    (1, 300, 300, 2, 2, 128, 128, dict(causal=True)),         # 4 depth steps
    (1, 97, 130, 4, 1, 32, 48, dict(causal=False)),           # MQA, 1 step, Dv of 3 tiles
    (2, 64, 64, 2, 2, 160, 160, dict(causal=True, window=(20, 5))),  # 5 steps, a band
    (1, 150, 150, 1, 1, 96, 96, dict(causal=True)),           # one head: whole partial tiles
    (1, 300, 300, 2, 1, 64, 64, dict(causal=True, window=(50, 0))),  # key tiles off the blocks
    (1, 9, 700, 8, 2, 64, 64, dict(causal=False)),            # few rows: the split-KV forward
    (1, 77, 77, 3, 3, 64, 40, dict(causal=True)),             # scores, dk on tiles; p v, dv not
    (1, 50, 50, 2, 2, 40, 64, dict(causal=True)),             # scores, dk off the tiles; p v, dv on
    (1, 60, 60, 2, 2, 48, 59, dict(causal=True, window=(7, 0))),  # dk only (D 48, Dv odd)
    (2, 33, 47, 2, 2, 32, 16, dict(causal=False)),            # 1-tile rows and columns
]


@pytest.mark.parametrize("B,Sq,Sk,H,Hkv,D,Dv,kw", CASES)
def test_amx_against_textbook(B, Sq, Sk, H, Hkv, D, Dv, kw):
    q, k, v = _qkv(B, Sq, Sk, H, Hkv, D, Dv, Sq * 7 + D + Dv)
    choice = attn_ext.explain(q, k, v, **kw)
    assert choice.forward in ("cpu.tiled", "cpu.split_kv")
    assert (choice.details["bf16_scores"] == "amx") == (D % 32 == 0)
    assert (choice.details["bf16_pv"] == "amx") == (Dv % 16 == 0)
    assert choice.details["bf16_dk"] == ("amx" if D % 16 == 0 else "widened")
    assert choice.details["bf16_dv"] == ("amx" if Dv % 16 == 0 else "widened")
    assert choice.details["bf16_dq"] == choice.details["bf16_dk"]
    _check(q, k, v, kw)


def test_amx_switch_changes_rounding_only(monkeypatch):
    """ATTN_EXT_CPU_AMX=0 runs the CPU's path without tiles: lse differs by rounding (another
    order of the sums), out by about bf16's rounding (p is rounded to bf16 for the tiles)."""
    q, k, v = _qkv(1, 300, 300, 4, 2, 128, 128, 1)
    on = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    monkeypatch.setenv("ATTN_EXT_CPU_AMX", "0")
    assert attn_ext.explain(q, k, v, causal=True).details["bf16_scores"] != "amx"
    off = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    assert not torch.equal(on[1], off[1])
    torch.testing.assert_close(on[1], off[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(on[0].float(), off[0].float(), rtol=0, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_amx_non_finite_v_of_hidden_keys(bad, dtype):
    """inf / NaN in v's rows of padded keys and of keys past a window must not reach the rows that
    cannot see them (0 * inf in the tiles): those key tiles are summed key by key, and the
    forward's out is bitwise that of a finite value there. A visible key's NaN still reaches its
    rows. fp16 (tests/test_fp16_amx.py): the hi pairs take them as 0 and lo is 0 there."""
    B, S, H, D = 2, 200, 2, 64
    q, k, v = (t.to(dtype) for t in _qkv(B, S, S, H, H, D, D, 11))
    dout = torch.randn(B, S, H, D).to(dtype)
    kpm = torch.rand(B, S) > 0.3
    vv = v.clone()
    vv[~kpm] = bad
    kw = dict(key_padding_mask=kpm, causal=True)
    ours = _run(q, k, vv, dout, kw)
    ref64 = _ref(q, k, v, dout, kw, torch.float64)
    ref_low = _ref(q, k, v, dout, kw, dtype)
    for name, a, r, lo in zip(("out", "lse", "dq", "dk", "dv"), ours, ref64, ref_low):
        if name == "dv":  # the padded keys' dv: no row sees them, 0 in both
            a, r, lo = (t.masked_fill(~kpm[..., None, None], 0) for t in (a, r, lo))
        rows_ok = torch.isfinite(r)
        assert_close_rule(a.double(), r, lo.double(), name)
        assert bool(torch.isfinite(a[rows_ok]).all()), name
    clean = attn_ext.attention(q, k, v.masked_fill(~kpm[..., None, None], 0.5), **kw)
    assert torch.equal(ours[0], clean)
    # window: keys 100 .. 103 hold NaN; rows 0 .. 99 and rows past 103 + 16 cannot see them
    vw = v.clone()
    vw[:, 100:104] = float("nan")
    out = attn_ext.attention(q, k, vw, causal=True, window=(16, 0))
    assert bool(torch.isfinite(out[:, :100]).all()) and bool(torch.isfinite(out[:, 120:]).all())
    assert bool(torch.isnan(out[:, 100:120]).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amx_score_terms_and_layouts(dtype):
    """ALiBi, softcap and sinks on the tiles' scores (forward and backward); BHSD views give the
    contiguous call's bits; packed sequences give each sequence's own bits."""
    B, S, H, Hkv, D = 2, 160, 4, 2, 64
    q, k, v = (t.to(dtype) for t in _qkv(B, S, S, H, Hkv, D, D, 3))
    _check(q, k, v, dict(causal=True, alibi_slopes=torch.rand(H), softcap=20.0,
                         sinks=torch.randn(H)))
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    a = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    b = attn_ext.attention(qt, kt, vt, causal=True, return_lse=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    cu = torch.tensor([0, 70, 160], dtype=torch.int32)
    out = attn_ext.attention_varlen(q[0], k[0], v[0], cu, cu, 90, 90, causal=True)
    for i in range(2):
        s0, s1 = int(cu[i]), int(cu[i + 1])
        one = attn_ext.attention(q[None, 0, s0:s1], k[None, 0, s0:s1], v[None, 0, s0:s1],
                                 causal=True)
        assert torch.equal(out[s0:s1], one[0])


@pytest.mark.parametrize("kind", ["causal", "window00"])
def test_amx_one_visible_key_gradients_exactly_zero(kind):
    """A row that sees one key: P = 1, out = that key's v, and Di (scores_amx_diag) equals that
    key's dP (pass 4 on the tiles) bitwise, so dq = dk = 0 exactly."""
    q, k, v = _qkv(2, 100, 100, 4, 2, 64, 64, 4)
    kw = dict(causal=True) if kind == "causal" else dict(window=(0, 0))
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attn_ext.attention(*ts, **kw)
    dq, dk, dv = torch.autograd.grad(out, ts, torch.randn_like(out))
    if kind == "causal":  # row 0 sees key 0 only
        assert torch.count_nonzero(dq[:, 0]) == 0 and torch.count_nonzero(dq[:, 1]) > 0
    else:
        assert torch.count_nonzero(dq) == 0 and torch.count_nonzero(dk) == 0
    assert torch.count_nonzero(dv) > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 16])
def test_amx_threads(threads, dtype):
    """The tiles' results do not depend on where a tile sits, so the forward's bits do not
    depend on the thread count (no split-KV at this shape), and the backward matches the
    textbook with the fused and the split partition; repeated runs give the same bits (fp16:
    its forward's split products, tests/test_fp16_amx.py)."""
    q, k, v = (t.to(dtype) for t in _qkv(1, 256, 256, 2, 1, 64, 64, 5))
    fwd = lambda: attn_ext.attention(q, k, v, causal=True, return_lse=True)  # noqa: E731
    one = with_threads(1, fwd)
    with_threads(threads, lambda: _check(q, k, v, dict(causal=True)))
    many, again = with_threads(threads, fwd), with_threads(threads, fwd)
    assert all(torch.equal(x, y) for x, y in zip(one, many))
    assert all(torch.equal(x, y) for x, y in zip(many, again))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_amx_hidden_non_finite_k_leaves_every_other_gradient_bitwise_alone(bad, dtype):
    """A padded key whose k holds inf / NaN: every row's out, lse and dq and every other key's
    dk and dv are bitwise those of a finite value there. The tiles take k's non-finite entries as
    0 (dq, dS 0 at the hidden pairs) and dk / dv stay on the tiles (they read no k). fp16: a
    non-finite value's lo part is 0 (split_fp16), so only its hi pairs need it."""
    B, S, H, D = 1, 200, 2, 64
    q, k, v = (t.to(dtype) for t in _qkv(B, S, S, H, H, D, D, 21))
    dout = torch.randn(B, S, H, D).to(dtype)
    kpm = torch.ones(B, S, dtype=torch.bool)
    kpm[:, 130] = False

    def run(val):
        kk = k.clone()
        kk[:, 130, :, 3] = val
        return _run(q, kk, v, dout, dict(key_padding_mask=kpm, causal=True))

    base, dirty = run(0.5), run(bad)
    keep = torch.arange(S) != 130
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), dirty, base):
        if name in ("dk", "dv"):
            a, b = a[:, keep], b[:, keep]
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amx_long_heads_packed_per_tile(dtype):
    """At 16 threads each worker's head-rows share is 640 KiB, so a head of 6000 keys (v^T's pairs:
    752 KiB at Dv = 64) is packed key tile by key tile instead of once (HeadPairs, whole = false;
    fp16: k's hi / lo rows too, HeadSplit), and the few query tiles run split-KV (chunks that
    start off the 32-key blocks); the backward's k^T pairs come per key tile either way. All
    against the textbook."""
    q, k, v = (t.to(dtype) for t in _qkv(1, 100, 6000, 2, 2, 64, 64, 31))

    def run():
        assert attn_ext.explain(q, k, v).forward == "cpu.split_kv"
        _check(q, k, v, dict(causal=False))
        _check(q, k, v, dict(causal=True, window=(1000, 0)))

    with_threads(16, run)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amx_visible_non_finite_k_same_bits_for_any_block_grouping(dtype, monkeypatch):
    """A visible key whose k holds inf: the rows that see it get dq = scale * dS k with 0 * inf
    = NaN in that column, as in the textbook, whichever query blocks visit its key tile together
    (ATTN_EXT_CPU_BWD_JOBS). The partial pairs take k's non-finite entries as 0 on the tiles in a
    copy of k^T's pairs; zeroing the shared pairs in place once left the full pairs visited after
    it in the same visit without the NaN."""
    torch.manual_seed(41)
    B, S, H, D = 1, 300, 1, 64
    q = torch.randn(B, S, H, D)
    q[..., 3] = -q[..., 3].abs() - 1.0  # every row's score for key 5 is -inf: P = dS = 0 there
    k, v = torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    k[:, 5, :, 3] = float("inf")
    q, k, v = (t.to(dtype) for t in (q, k, v))
    dout = torch.randn(B, S, H, D).to(dtype)
    runs = []
    for jobs in ("1", "4"):
        monkeypatch.setenv("ATTN_EXT_CPU_BWD_JOBS", jobs)
        runs.append(with_threads(1, lambda: _run(q, k, v, dout, dict(causal=True))))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)
    dq = runs[0][2][0, :, 0, 3]
    assert bool(dq[5:].isnan().all()) and not bool(dq[:5].isnan().any())


@pytest.mark.parametrize("dtype,bad", [(torch.bfloat16, float("inf")), (torch.bfloat16, float("nan")),
                                       (torch.float16, float("nan"))])
def test_amx_non_finite_q_row_leaves_the_keys_it_cannot_see_bitwise_alone(bad, dtype):
    """Row 0 (causal: it sees key 0 only) with an inf / NaN in q: dk and dv of keys 1.. are
    bitwise those of a finite q there. The tiles run dv / dk with that row's operands as 0 and
    add its visible pairs on their own (before, the whole tile took the per-pair path, whose
    rounding differs from the tiles'). (fp16 with a visible inf runs its (sequence, kv head)
    widened: half_qk_inf_units, which changes that unit's other rows' rounding.)"""
    torch.manual_seed(0)
    q, k, v, dout = [torch.randn(1, 97, 2, 64).to(dtype) for _ in range(4)]

    def grads(qq):
        ts = [t.clone().requires_grad_() for t in (qq, k, v)]
        attn_ext.attention(*ts, causal=True).backward(dout)
        return ts[1].grad, ts[2].grad

    clean = grads(q)
    qb = q.clone()
    qb[0, 0, 1, 3] = bad
    dirty = grads(qb)
    for name, a, b in zip(("dk", "dv"), dirty, clean):
        assert torch.equal(a[0, 1:], b[0, 1:]), name
        assert torch.isfinite(a[0, 1:]).all(), name
