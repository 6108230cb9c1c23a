"""fp16 on the bf16 AMX tiles in the tiled CPU kernels (csrc/cpu/attention_amx.cpp split_fp16,
scores_amx_split, pv_amx_split, rows_times_pairs_amx_split, scores_amx_diag_split; where the CPU
has AMX-TILE + AMX-BF16, D a multiple of 32 and Dv a multiple of 16; ATTN_EXT_CPU_AMX=0 widens to
fp32 as before). Every fp16 value is exactly hi + lo (two bf16), and a product of two fp16
values (the scores, dP, Di) takes hi hi + hi lo + lo hi + lo lo in one tile chain, so it is
exact; fp32 factors (p, P, dS) are split the same way (16 significant bits) and their products
take the first three terms. The
backward runs where its forward did: the recomputed scores are the forward's split products
(pass 1 in the same chains), dP and the row term Di on the tiles where Dv is a multiple of 32
(else both widened), dv, dk and dq on the tiles. Checked here: the textbook by the tolerance rule
(forward and backward) through every tail the tiles stage and the fallbacks, lse at fp32
rounding (which bf16 operands alone could not meet), the switch, one-key rows,
dropout. tests/test_amx.py runs its hidden inf / NaN in v and k, thread-count and long-head (k
and v split per key tile: HeadSplit / HeadPairs, whole = false) tests on fp16 too, and
tests/test_backward_partition.py its bitwise repeatability and query-block grouping tests."""

import pytest
import torch

import attn_ext
from attn_ext import reference
from attn_ext._explain import cpu_amx_enabled
from tests.test_bf16dp import _check, _run
from tests.utils import assert_lse_fp32

pytestmark = pytest.mark.skipif(not cpu_amx_enabled(), reason="no AMX on this CPU")


def _qkv(B, Sq, Sk, H, Hkv, D, Dv, seed):
    torch.manual_seed(seed)
    return (torch.randn(B, Sq, H, D).half(), torch.randn(B, Sk, Hkv, D).half(),
            torch.randn(B, Sk, Hkv, Dv).half())


CASES = [
    # B, Sq, Sk, H, Hkv, D, Dv, kwargs
    (2, 200, 200, 4, 2, 64, 64, dict(causal=True)),           # GQA, whole and diagonal tiles
    (1, 300, 300, 2, 2, 128, 128, dict(causal=True)),         # 4 depth steps per stretch
    (1, 97, 130, 4, 1, 32, 48, dict(causal=False)),           # MQA, 1 step, Dv of 3 tiles
    (2, 64, 64, 2, 2, 160, 160, dict(causal=True, window=(20, 5))),  # 5 steps, a band
    (1, 150, 150, 1, 1, 96, 96, dict(causal=True)),           # one head: whole partial tiles
    (1, 300, 300, 2, 1, 64, 64, dict(causal=True, window=(50, 0))),  # key tiles off the blocks
    (1, 9, 700, 8, 2, 64, 64, dict(causal=False)),            # few rows: the split-KV forward
    (2, 33, 47, 2, 2, 32, 16, dict(causal=False)),            # 1-tile rows and columns
    (1, 77, 77, 3, 3, 64, 40, dict(causal=True)),             # Dv not a multiple of 16: widened
    (1, 50, 50, 2, 2, 40, 64, dict(causal=True)),             # D not a multiple of 32: widened
]


@pytest.mark.parametrize("B,Sq,Sk,H,Hkv,D,Dv,kw", CASES)
def test_fp16_tiles_against_textbook(B, Sq, Sk, H, Hkv, D, Dv, kw):
    q, k, v = _qkv(B, Sq, Sk, H, Hkv, D, Dv, Sq * 7 + D + Dv)
    choice = attn_ext.explain(q, k, v, **kw)
    assert choice.forward in ("cpu.tiled", "cpu.split_kv")
    on_tiles = D % 32 == 0 and Dv % 16 == 0
    assert choice.details["fp16_products"] == ("amx split" if on_tiles else "widened")
    assert choice.details["fp16_backward"] == choice.details["fp16_products"]
    assert choice.details["fp16_dp"] == ("amx split" if on_tiles and Dv % 32 == 0 else "widened")
    _check(q, k, v, kw)


@pytest.mark.parametrize("scale,softcap", [(None, None), (1.0, 2.0), (1.0, 5.0)])
def test_fp16_tiles_keep_lse_at_fp32_rounding(scale, softcap):
    """lse is the scores' log-sum-exp before any fp16 rounding. Each score's products take all
    four hi / lo terms, so they are exact and lse sits at fp32 rounding of the float64 textbook
    (tests/utils.assert_lse_fp32), where rounding q and k to bf16 alone would be off by ~1e-3
    relative; out's error is fp16's rounding either way. With lo lo dropped (up to 2^-18 of each
    product) lse missed that bound where the products are large but lse small: scale 1 with a
    softcap, 5 of these 12 seeds at softcap 2 and 2 at softcap 5 (up to 5.3e-5 against 3.4e-5;
    thirty-ninth session)."""
    for seed in range(12):
        if scale is None:
            q, k, v = _qkv(1, 256, 256, 2, 2, 128, 128, 9 + seed)
            q, k = q * 2, k * 2  # scores of ~+-20: their relative rounding shows in lse
        else:  # products of ~+-100 summed into scores capped to +-softcap, 4 keys: lse ~1
            q, k, v = _qkv(1, 64, 4, 2, 2, 128, 128, seed)
        kw = dict(causal=scale is None, scale=scale, softcap=softcap)
        assert attn_ext.explain(q, k, v, **kw).details["fp16_products"] == "amx split"
        out, lse = attn_ext.attention(q, k, v, return_lse=True, **kw)
        ref_out, ref = reference.attention_with_lse(q.double(), k.double(), v.double(), **kw)
        assert_lse_fp32(lse, ref, torch.float16)
        bf = reference.attention_with_lse(q.bfloat16().double(), k.bfloat16().double(),
                                          v.double(), **kw)[1]
        assert (bf - ref).abs().max() > 10 * (lse.double() - ref).abs().max()
        half_ulp = ref_out.abs().clamp_min(2.0 ** -14) * 2.0 ** -11
        assert bool(((out.double() - ref_out).abs() <= half_ulp + 5e-5).all())


def test_fp16_tiles_switch_changes_rounding_only(monkeypatch):
    """ATTN_EXT_CPU_AMX=0 widens fp16 to fp32: lse differs by the sums' rounding, out by at most
    about one fp16 rounding step."""
    q, k, v = _qkv(1, 300, 300, 4, 2, 128, 128, 1)
    on = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    monkeypatch.setenv("ATTN_EXT_CPU_AMX", "0")
    assert attn_ext.explain(q, k, v, causal=True).details["fp16_products"] == "widened"
    off = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    assert not torch.equal(on[1], off[1])
    torch.testing.assert_close(on[1], off[1], rtol=0, atol=2e-5)
    torch.testing.assert_close(on[0].float(), off[0].float(), rtol=0, atol=2e-3)


@pytest.mark.parametrize("Dv", [64, 48])
def test_fp16_tiles_one_visible_key_gives_its_v(Dv):
    """A row that sees one key: p = 1 (hi 1, lo 0) and v = hi + lo exactly, so out is that
    key's v bitwise. The backward recomputes that key's score in the forward's split chains, so
    P = 1 there, and its row term Di takes dP's chains (split on the tiles at Dv = 64, widened at
    Dv = 48), so dS's factor dP - Di is 0 and dq = dk = 0 exactly."""
    q, k, v = _qkv(2, 100, 100, 4, 2, 64, Dv, 4)
    assert attn_ext.explain(q, k, v).details["fp16_dp"] == ("amx split" if Dv == 64 else "widened")
    out = attn_ext.attention(q, k, v, window=(0, 0))
    assert torch.equal(out, v.repeat_interleave(2, dim=2))
    out = attn_ext.attention(q, k, v, causal=True)
    assert torch.equal(out[:, 0], v[:, 0].repeat_interleave(2, dim=1))
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attn_ext.attention(*ts, window=(0, 0))
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, ts, dout)
    assert torch.count_nonzero(dq) == 0 and torch.count_nonzero(dk) == 0
    # P = 1 exactly (hi 1, lo 0), so dv is the group's dout summed in fp32 (a P off by one
    # rounding of its score would move some of its fp16 roundings)
    B, S, H, _ = dout.shape
    assert torch.equal(dv, dout.float().view(B, S, 2, H // 2, Dv).sum(3).half())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tiles_with_dropout_match_the_widened_path(monkeypatch, dtype):
    """With dropout the tile path's softmax leaves p in fp32 for the keep mask, and the pairs
    are made after it (probs_to_pairs / probs_to_pairs_split). The keep mask depends only on the
    seed, offset and position, so the widened path (ATTN_EXT_CPU_AMX=0, checked against the
    textbook elsewhere) drops the same probabilities: out within the dtype's rounding of it, lse
    (of the undropped probabilities) within the sums' rounding, the gradients close."""
    q, k, v = _qkv(1, 200, 200, 2, 2, 64, 64, 13)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    dout = torch.randn(1, 200, 2, 64).to(dtype)
    kw = dict(causal=True, dropout_p=0.3)

    def run():
        torch.manual_seed(5)
        return _run(q, k, v, dout, kw)

    on = run()
    monkeypatch.setenv("ATTN_EXT_CPU_AMX", "0")
    off = run()
    atol = 2e-3 if dtype == torch.float16 else 3e-2
    torch.testing.assert_close(on[0].float(), off[0].float(), rtol=0, atol=atol)
    torch.testing.assert_close(on[1], off[1], rtol=0, atol=1e-4)
    for a, b in zip(on[2:], off[2:]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=atol * 5)


def test_fp16_backward_switch_changes_rounding_only(monkeypatch):
    """ATTN_EXT_CPU_AMX=0 widens the fp16 backward too: the gradients differ from the tiles' by
    the split products' rounding (under 2^-16 of each term) and fp16's own rounding, and both
    meet the textbook (tests above)."""
    q, k, v = _qkv(1, 200, 200, 4, 2, 64, 64, 17)
    dout = torch.randn(1, 200, 4, 64).half()
    kw = dict(causal=True)
    assert attn_ext.explain(q, k, v, **kw).details["fp16_backward"] == "amx split"
    on = _run(q, k, v, dout, kw)
    monkeypatch.setenv("ATTN_EXT_CPU_AMX", "0")
    assert attn_ext.explain(q, k, v, **kw).details["fp16_backward"] == "widened"
    off = _run(q, k, v, dout, kw)
    for name, a, b in zip(("dq", "dk", "dv"), on[2:], off[2:]):
        assert not torch.equal(a, b), name
        scale = b.float().abs().max()
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=4e-3 * scale, msg=name)


@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf")])
@pytest.mark.parametrize("D", [64, 128])
def test_fp16_inf_in_q_or_k_keeps_the_math_finite_where_it_is(where, bad, D):
    """On the tiles fp16 is split into bf16 hi + lo, and an inf factor met the other factor's
    lo part 0 (inf * 0 = NaN) where the score is +-inf. With a softcap that score is finite
    (+-softcap), so the row is finite; a call with inf / NaN in q or k takes the widened path
    (forward and backward alike) and gives what fp32 gives on the same values."""
    torch.manual_seed(0)
    q, k, v, g = [torch.randn(1, 40, 2, D).half() for _ in range(4)]
    (q if where == "q" else k)[0, 3, 1, 7] = bad

    def run(dt):
        ts = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        out, lse = attn_ext.attention(*ts, causal=True, softcap=20.0, return_lse=True)
        (out * g.to(dt)).sum().add_(lse.sum()).backward()
        return [out.detach(), lse.detach()] + [t.grad for t in ts]

    half, single = run(torch.float16), run(torch.float32)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], half, single):
        fin = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), fin), name
        torch.testing.assert_close(a.float()[fin], b[fin], rtol=2e-2, atol=2e-2, msg=name)
    assert torch.isfinite(half[0]).all() and torch.isfinite(half[1]).all()


def test_fp16_hidden_inf_keeps_the_tiles_and_every_other_bit():
    """An inf in a padded key, or in a q row whose band keys are all padded, takes part in no
    score: the call stays on the tiles, and every other row's results keep their bits."""
    torch.manual_seed(0)
    q, k, v, g = [torch.randn(1, 100, 2, 64).half() for _ in range(4)]
    kpm = torch.ones(1, 100, dtype=torch.bool)
    kpm[0, 0] = False  # causal: row 0 sees key 0 only, which is padded

    def run(q, k):
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attn_ext.attention(*ts, causal=True, key_padding_mask=kpm)
        out.backward(g)
        return [out.detach()] + [t.grad for t in ts]

    clean = run(q, k)
    qb, kb = q.clone(), k.clone()
    qb[0, 0, 1, 5] = float("inf")
    kb[0, 0, 0, 7] = float("inf")
    for dirty in (run(qb, k), run(q, kb)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), dirty, clean):
            assert torch.equal(a[0, 1:], b[0, 1:]), name
