"""bf16 scores by vdpbf16ps in the tiled CPU kernels (csrc/cpu/attention_bf16dp.cpp, where the
CPU has AVX512_BF16; ATTN_EXT_CPU_BF16DP=0 widens them to fp32 as before): the forward's pass
1 and the backward's recomputed one, against the float64 textbook by the tolerance rule, in
both modes, through every pass-1 shape (whole tiles, the one-head column panels of partial
tiles, key padding with NaN in the padded keys, windows, GQA, packed sequences, BHSD views, the
split-KV forward and the split backward), and the odd head dims that keep the widened path."""

import pytest
import torch

import attn_ext
from attn_ext import reference
from attn_ext._explain import cpu_avx512bf16_enabled
from tests.utils import assert_close_rule, assert_lse_fp32

HAVE_DP = cpu_avx512bf16_enabled()


def _run(q, k, v, dout, kw):
    ts = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = attn_ext.attention(*ts, return_lse=True, **kw)
    grads = torch.autograd.grad((out, lse), ts, (dout, torch.ones_like(lse)))
    return [out.detach(), lse.detach(), *grads]


def _ref(q, k, v, dout, kw, dtype):
    ts = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = reference.attention_with_lse(*ts, **kw)
    grads = torch.autograd.grad((out, lse), ts, (dout.to(dtype), torch.ones_like(lse)))
    return [out.detach(), lse.detach(), *grads]


def _check(q, k, v, kw, bad_keys=None):
    """Ours (k with NaN in bad_keys' rows where given) against the textbook on the clean k, the
    low-precision reference in q's dtype (bf16 here; fp16 in tests/test_fp16_amx.py)."""
    B, Sq, H, _ = q.shape
    dout = torch.randn(B, Sq, H, v.shape[-1]).to(q.dtype)
    kk = k
    if bad_keys is not None:
        kk = k.clone()
        kk[bad_keys] = float("nan")
    ours = _run(q, kk, v, dout, kw)
    ref64 = _ref(q, k, v, dout, kw, torch.float64)
    ref_low = _ref(q, k, v, dout, kw, q.dtype)
    for name, a, r, lo in zip(("out", "lse", "dq", "dk", "dv"), ours, ref64, ref_low):
        if bad_keys is not None and name == "dk":
            a, r, lo = (t.masked_fill(bad_keys[..., None, None], 0) for t in (a, r, lo))
        assert_close_rule(a.double(), r, lo.double(), name)
    assert_lse_fp32(ours[1], ref64[1], q.dtype)
    return ours


CASES = [
    # B, Sq, Sk, H, Hkv, D, kwargs
    (2, 200, 200, 4, 2, 64, dict(causal=True)),           # GQA, whole and diagonal tiles
    (1, 300, 300, 2, 2, 128, dict(causal=True)),          # D > 96: chains of 64
    (1, 97, 130, 4, 1, 40, dict(causal=False)),           # MQA, 24 + 16 columns
    (2, 64, 64, 2, 2, 200, dict(causal=True, window=(20, 5))),  # long chains, a band
    (1, 150, 150, 1, 1, 58, dict(causal=True)),           # one head: partial tiles by panels
    (1, 9, 700, 8, 2, 64, dict(causal=False)),            # few rows: the split-KV forward
]


@pytest.mark.parametrize("mode", ["1", "0"])
@pytest.mark.parametrize("B,Sq,Sk,H,Hkv,D,kw", CASES)
def test_bf16_tiled_scores_by_pairs(monkeypatch, mode, B, Sq, Sk, H, Hkv, D, kw):
    monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", mode)
    torch.manual_seed(Sq * 7 + D)
    q = torch.randn(B, Sq, H, D).bfloat16()
    k, v = torch.randn(B, Sk, Hkv, D).bfloat16(), torch.randn(B, Sk, Hkv, D).bfloat16()
    assert attn_ext.explain(q, k, v, **kw).forward in ("cpu.tiled", "cpu.split_kv")
    _check(q, k, v, kw)


@pytest.mark.parametrize("mode", ["1", "0"])
def test_bf16_tiled_scores_by_pairs_padding_and_layouts(monkeypatch, mode):
    """Key padding with NaN in the padded keys' rows (read in place by the pairs' path, then
    masked), q / k / v as BHSD transpose views, and packed sequences."""
    monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", mode)
    torch.manual_seed(3)
    B, S, H, Hkv, D = 2, 160, 4, 2, 64
    q = torch.randn(B, S, H, D).bfloat16()
    k, v = torch.randn(B, S, Hkv, D).bfloat16(), torch.randn(B, S, Hkv, D).bfloat16()
    kpm = torch.rand(B, S) > 0.25
    _check(q, k, v, dict(key_padding_mask=kpm), bad_keys=~kpm)
    # BHSD memory read through views: the same bits as the contiguous call
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    a = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    b = attn_ext.attention(qt, kt, vt, causal=True, return_lse=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # packed sequences against each sequence on its own
    cu = torch.tensor([0, 70, 160], dtype=torch.int32)
    qv, kv_, vv = q[0], k[0], v[0]
    out = attn_ext.attention_varlen(qv, kv_, vv, cu, cu, 90, 90, causal=True)
    for i in range(2):
        s0, s1 = int(cu[i]), int(cu[i + 1])
        one = attn_ext.attention(qv[None, s0:s1], kv_[None, s0:s1], vv[None, s0:s1], causal=True)
        assert torch.equal(out[s0:s1], one[0])


@pytest.mark.parametrize("threads", [1, 16])
def test_bf16_tiled_scores_by_pairs_threads(monkeypatch, threads):
    """The split backward (few (batch, kv head) units for the threads) and the fused one give
    the textbook's gradients in the pairs' path; at this shape (no split-KV: its chunk count
    follows the threads) the forward's bits do not depend on the thread count."""
    monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", "1")
    torch.manual_seed(5)
    q = torch.randn(1, 256, 2, 64).bfloat16()
    k, v = torch.randn(1, 256, 1, 64).bfloat16(), torch.randn(1, 256, 1, 64).bfloat16()
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attn_ext.attention(q, k, v, causal=True, return_lse=True)
        torch.set_num_threads(threads)
        _check(q, k, v, dict(causal=True))
        many = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    finally:
        torch.set_num_threads(prev)
    assert all(torch.equal(x, y) for x, y in zip(one, many))


@pytest.mark.skipif(not HAVE_DP, reason="no AVX512_BF16 on this CPU")
def test_bf16_tiled_modes_differ_by_rounding_only(monkeypatch):
    """Where the CPU has AVX512_BF16 the pairs' path runs (its lse differs from the widened
    path's, by rounding: 1e-5), except at an odd head dim, which keeps the widened path (the
    same bits in both modes)."""
    torch.manual_seed(7)
    res = {}
    for D in (128, 59):
        q = torch.randn(1, 300, 4, D).bfloat16()
        k, v = torch.randn(1, 300, 2, D).bfloat16(), torch.randn(1, 300, 2, D).bfloat16()
        for mode in ("1", "0"):
            monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", mode)
            res[D, mode] = attn_ext.attention(q, k, v, causal=True, return_lse=True)[1]
    assert not torch.equal(res[128, "1"], res[128, "0"])
    torch.testing.assert_close(res[128, "1"], res[128, "0"], rtol=0, atol=1e-5)
    assert torch.equal(res[59, "1"], res[59, "0"])


@pytest.mark.parametrize("mode", ["1", "0"])
@pytest.mark.parametrize("Sq,Sk,H,Hkv,D,kind", [
    (37, 37, 4, 2, 64, "window00"), (200, 200, 2, 1, 96, "window00"),
    (9, 13, 2, 2, 128, "one_padded_key"), (8, 1, 2, 2, 128, "sk1"), (1, 1, 8, 2, 128, "causal"),
])
def test_bf16_one_visible_key_gradients_exactly_zero(monkeypatch, mode, Sq, Sk, H, Hkv, D, kind):
    """A bf16 row that sees one key has P = 1 and out = that key's v exactly, so dq and dk are
    exactly 0: the row term Di = rowsum(dout * out) must equal that key's dP bitwise, which
    holds when both come from the same chains (pass 4 by scores_bf16dp and Di taken by it too,
    or both the fp32 FMA chains)."""
    monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", mode)
    torch.manual_seed(Sq + D)
    q = torch.randn(2, Sq, H, D).bfloat16()
    k, v = torch.randn(2, Sk, Hkv, D).bfloat16(), torch.randn(2, Sk, Hkv, D).bfloat16()
    kw = {"window00": dict(window=(0, 0)), "sk1": {}, "causal": dict(causal=True)}.get(kind)
    if kind == "one_padded_key":
        m = torch.zeros(2, Sk, dtype=torch.bool)
        m[:, 5] = True
        kw = dict(key_padding_mask=m)
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attn_ext.attention(*ts, **kw)
    dq, dk, dv = torch.autograd.grad(out, ts, torch.randn_like(out))
    assert torch.count_nonzero(dq) == 0 and torch.count_nonzero(dk) == 0
    assert torch.count_nonzero(dv) > 0


@pytest.mark.parametrize("mode", ["1", "0"])
@pytest.mark.parametrize("D,Dv", [(7, 8), (59, 64), (64, 59), (63, 128), (128, 127), (1, 2)])
def test_bf16_pairs_for_one_product_only(monkeypatch, mode, D, Dv):
    """Pass 1 takes the pairs where D is even and pass 4 (with the row term) where Dv is: an
    odd D with an even Dv, and the reverse, runs each product on its own path (the backward's
    pack holds only the pairs it uses)."""
    monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", mode)
    torch.manual_seed(D * 131 + Dv)
    for S, kw in ((40, dict(causal=True)), (300, dict(causal=True, window=(64, 0)))):
        q = torch.randn(2, S, 4, D).bfloat16()
        k, v = torch.randn(2, S, 2, D).bfloat16(), torch.randn(2, S, 2, Dv).bfloat16()
        _check(q, k, v, kw)


@pytest.mark.skipif(not HAVE_DP, reason="no AVX512_BF16 on this CPU")
@pytest.mark.parametrize("B,Sq,Sk,H,Hkv,D", [(1, 1, 300, 32, 8, 128),   # 4 columns: 4 x 4 tiles
                                             (2, 1, 97, 8, 4, 64),      # 2 columns: 2 x 8
                                             (1, 2, 51, 8, 2, 96),      # 8 columns, a masked step
                                             (1, 1, 45, 6, 6, 128),     # MHA: no 16-tile
                                             (3, 1, 200, 12, 4, 40)])   # 3 columns, D % 32 != 0
def test_decode_dp_tile16_same_bits(monkeypatch, B, Sq, Sk, H, Hkv, D):
    """The decode kernel's 16-accumulator score tiles (attention_decode.h dp_scores_tile16, reduced
    16 at a time; ATTN_EXT_CPU_BF16DP=1, the pairs forced) give every score the addition tree of
    the 8-accumulator tiles: out, lse and
    the gradients (the backward recomputes those scores) are bitwise those of
    ATTN_EXT_CPU_DP_TILE16=0, with key counts that leave tails of every size, and match the
    textbook."""
    torch.manual_seed(B * 1000 + Sk)
    q = torch.randn(B, Sq, H, D).bfloat16()
    k = torch.randn(B, Sk, Hkv, D).bfloat16()
    v = torch.randn(B, Sk, Hkv, D).bfloat16()
    dout = torch.randn(B, Sq, H, D).bfloat16()
    kw = dict(causal=True)
    monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", "1")  # the pairs (on Intel CPUs, not the default)
    monkeypatch.setenv("ATTN_EXT_CPU_AMX", "0")  # (where the CPU has AMX: not the tiles)
    choice = attn_ext.explain(q, k, v, **kw)
    assert choice.forward == "cpu.decode" and choice.details["bf16_scores"] == "vdpbf16ps"
    monkeypatch.setenv("ATTN_EXT_CPU_DP_TILE16", "1")
    on = _run(q, k, v, dout, kw)
    monkeypatch.setenv("ATTN_EXT_CPU_DP_TILE16", "0")
    off = _run(q, k, v, dout, kw)
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), on, off):
        assert torch.equal(a.view(bits[a.dtype]), b.view(bits[b.dtype])), name
    ref64 = _ref(q, k, v, dout, kw, torch.float64)
    ref_low = _ref(q, k, v, dout, kw, torch.bfloat16)
    for name, a, r, lo in zip(("out", "lse", "dq", "dk", "dv"), on, ref64, ref_low):
        assert_close_rule(a.double(), r, lo.double(), name)
