"""The CPU decode kernel with score terms (issue 16 item 1 on the shapes real models decode
with: Gemma-2's softcap, BLOOM / MPT's ALiBi, T5's relative bias, with sinks, windows and
padding). softcap, ALiBi and rel_bias run inside the decode kernel (attention_decode.h, by
apply_score_terms_keys: the one rule of common/attention_mask.h in the kernel's layout), not in
the tiled kernel: explain says so, and values, lse and every gradient (d rel_bias, d sinks
included) match the float64 reference by DESIGN.md's rule at 1, 2, 3 and 16 threads, bitwise
repeatable at a fixed count."""

import pytest
import torch

import attn_ext
from attn_ext import _explain as X
from attn_ext import ops, reference
from attn_ext.position_bias import alibi_slopes
from tests.reference_checks import check_against_reference
from tests.utils import randn

pytestmark = pytest.mark.skipif(not X.cpu_simd_enabled(), reason="the decode kernel needs AVX2")


def _terms(H, B, which, M=40):
    t = {}
    if "softcap" in which:
        t["softcap"] = 5.0
    if "alibi" in which:
        t["alibi_slopes"] = alibi_slopes(H)
    if "alibi_bh" in which:
        t["alibi_slopes"] = torch.rand(B, H) * 0.3
    if "rel_bias" in which:
        t["rel_bias"] = torch.randn(H, 2 * M + 1)
    if "sinks" in which:
        t["sinks"] = torch.randn(H)
    return t


def _check(q, k, v, tol_scale=1.0, **kw):
    out, lse = attn_ext.attention(q, k, v, return_lse=True, **kw)
    ref_kw = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t)
              for n, t in kw.items()}
    ro, rl = reference.attention_with_lse(q.double(), k.double(), v.double(), **ref_kw)
    if q.dtype == torch.float32:
        tol = 3e-5
    else:  # 2x the reference's own error in that dtype, plus a floor
        lo, _ = reference.attention_with_lse(q, k, v, **kw)
        tol = 2 * (lo.double() - ro).abs().max().item() + 1e-3
    torch.testing.assert_close(out.double(), ro, rtol=0, atol=tol * tol_scale)
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse))
    torch.testing.assert_close(lse.double()[fin], rl[fin], rtol=0, atol=1e-4)
    return out, lse


def _forward_path(q, k, v, **kw):
    return attn_ext.explain(q, k, v, **kw).forward


TERM_SETS = [("softcap",), ("alibi",), ("alibi_bh",), ("rel_bias",),
             ("softcap", "alibi", "rel_bias", "sinks")]


@pytest.mark.parametrize("which", TERM_SETS)
@pytest.mark.parametrize("B,Sq,Sk,H,Hkv,D", [
    (1, 1, 2048, 16, 4, 64),    # GQA 4, big in-place blocks
    (2, 1, 700, 8, 8, 64),      # MHA
    (2, 4, 333, 8, 2, 32),      # 16 columns, Sq = 4 (d differs per row)
    (1, 1, 301, 6, 2, 59),      # odd D: packed blocks, a 5-key tail
])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_with_terms_matches_reference(which, B, Sq, Sk, H, Hkv, D, causal):
    q, k, v = randn(B, Sq, H, D), randn(B, Sk, Hkv, D), randn(B, Sk, Hkv, D)
    kw = dict(causal=causal, **_terms(H, B, which))
    assert _forward_path(q, k, v, **kw) == "cpu.decode"
    _check(q, k, v, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", [("softcap",), ("alibi", "rel_bias", "sinks")])
def test_decode_with_terms_low_precision(dtype, which):
    q = randn(2, 1, 32, 128).to(dtype)
    k, v = randn(2, 1500, 8, 128).to(dtype), randn(2, 1500, 8, 128).to(dtype)
    kw = dict(causal=True, **_terms(32, 2, which, M=300))
    assert _forward_path(q, k, v, **kw) == "cpu.decode"
    _check(q, k, v, **kw)


@pytest.mark.parametrize("M", [0, 3, 200, 5000])
def test_decode_rel_bias_every_clamp_segment(M):
    """Keys beyond +M, inside [-M, M] (read backwards along the keys) and, with a window to the
    right, below -M: each block of the decode kernel crosses the segment edges somewhere."""
    q, k, v = randn(1, 2, 4, 64), randn(1, 1100, 2, 64), randn(1, 1100, 2, 64)
    rb = torch.randn(4, 2 * M + 1)
    for window in (None, (-1, 40)):
        _check(q, k, v, rel_bias=rb, window=window)


def test_decode_with_terms_window_and_padding():
    B, Sk, H = 3, 900, 8
    q, k, v = randn(B, 2, H, 64), randn(B, Sk, 2, 64), randn(B, Sk, 2, 64)
    kpm = torch.ones(B, Sk, dtype=torch.bool)
    kpm[0, :400] = False
    kpm[1, 500:] = False
    kpm[2, ::3] = False
    kw = dict(causal=True, window=(255, 0), key_padding_mask=kpm,
              **_terms(H, B, ("softcap", "alibi", "rel_bias", "sinks")))
    assert _forward_path(q, k, v, **kw) == "cpu.decode"
    _check(q, k, v, **kw)


def test_decode_with_terms_packed_sequences():
    """Packed sequences: d = i + off - j with each sequence's own off."""
    lens_q, lens_k = [1, 2, 1, 0], [900, 37, 0, 5]
    H, Hkv, D = 8, 2, 64
    cq = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    ck = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v = randn(int(cq[-1]), H, D), randn(int(ck[-1]), Hkv, D), randn(int(ck[-1]), Hkv, D)
    terms = _terms(H, 1, ("softcap", "alibi", "rel_bias", "sinks"))
    out, lse = attn_ext.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=True,
                                         return_lse=True, **terms)
    ro, rl = reference.attention_varlen_with_lse(
        q.double(), k.double(), v.double(), cq, ck, causal=True,
        **{n: t.double() if torch.is_tensor(t) else t for n, t in terms.items()})
    torch.testing.assert_close(out.double(), ro, rtol=0, atol=3e-5)
    fin = torch.isfinite(rl)
    torch.testing.assert_close(lse.double()[fin], rl[fin], rtol=0, atol=1e-4)


def test_decode_with_terms_block_position():
    """A decode block of a longer sequence (q_start / k_start, as ring attention calls it): the
    terms at the global distances."""
    S, q0, k0, sk, H = 1500, 1499, 200, 1000, 8
    q, k, v = randn(1, 1, H, 64), randn(1, sk, 2, 64), randn(1, sk, 2, 64)
    slopes, rb = alibi_slopes(H), torch.randn(H, 81)
    out, lse = torch.ops.attn_ext.attention_forward(q, k, v, True, None, -1, -1, None, slopes, rb,
                                                    4.0, None, 0.0, 0, 0, q0, k0)
    Q = torch.zeros(1, S, H, 64, dtype=torch.float64)
    Q[:, q0] = q[:, 0].double()
    K = torch.zeros(1, S, 2, 64, dtype=torch.float64)
    V = torch.zeros(1, S, 2, 64, dtype=torch.float64)
    K[:, k0:k0 + sk], V[:, k0:k0 + sk] = k.double(), v.double()
    kpm = torch.zeros(1, S, dtype=torch.bool)
    kpm[:, k0:k0 + sk] = True
    ro, rl = reference.attention_with_lse(Q, K, V, True, None, None, kpm, alibi_slopes=slopes.double(),
                                          rel_bias=rb.double(), softcap=4.0)
    torch.testing.assert_close(out.double(), ro[:, q0:q0 + 1], rtol=0, atol=3e-5)
    torch.testing.assert_close(lse.double(), rl[:, :, q0:q0 + 1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Sq", [1, 3])
def test_decode_with_terms_gradients(dtype, Sq):
    """The backward of a decode-kernel forward recomputes its scores in the decode order and
    applies the same terms: dq, dk, dv, d rel_bias and d sinks against the reference."""
    B, Sk, H, Hkv, D, M = 2, 400, 8, 2, 64, 30
    q, k, v = (randn(B, Sq, H, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype),
               randn(B, Sk, Hkv, D, dtype=dtype))
    rb, sinks = torch.randn(H, 2 * M + 1), torch.randn(H)
    slopes = alibi_slopes(H)
    assert _forward_path(q, k, v, causal=True, alibi_slopes=slopes, rel_bias=rb, softcap=6.0,
                         sinks=sinks) == "cpu.decode"

    def ours(q, k, v, rb, sinks):
        return attn_ext.attention(q, k, v, causal=True, alibi_slopes=slopes, rel_bias=rb,
                                  softcap=6.0, sinks=sinks, return_lse=True)

    def ref(q, k, v, rb, sinks):
        return reference.attention_with_lse(q, k, v, True, alibi_slopes=slopes.to(q.dtype),
                                            rel_bias=rb, softcap=6.0, sinks=sinks)

    check_against_reference(ours, ref, [q, k, v, rb, sinks], ["dq", "dk", "dv", "drel_bias", "dsinks"])


def test_decode_with_terms_gradcheck():
    q, k, v = (randn(1, 1, 4, 8, dtype=torch.float64), randn(1, 20, 2, 8, dtype=torch.float64),
               randn(1, 20, 2, 8, dtype=torch.float64))
    rb = torch.randn(4, 11, dtype=torch.float64, requires_grad=True)
    f = lambda q, k, v, rb: attn_ext.attention(q, k, v, causal=True, rel_bias=rb, softcap=3.0,
                                               alibi_slopes=alibi_slopes(4).double())
    assert torch.autograd.gradcheck(f, [t.requires_grad_() for t in (q, k, v)] + [rb])


def test_decode_with_terms_thread_counts():
    q, k, v = randn(2, 1, 16, 64), randn(2, 5000, 4, 64), randn(2, 5000, 4, 64)
    kw = dict(causal=True, return_lse=True, **_terms(16, 2, ("softcap", "alibi", "rel_bias", "sinks"), M=100))
    old = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 16):
            torch.set_num_threads(n)
            results.append(attn_ext.attention(q, k, v, **kw))
        for out, lse in results[1:]:
            torch.testing.assert_close(out, results[0][0], rtol=0, atol=2e-6)
            torch.testing.assert_close(lse, results[0][1], rtol=0, atol=2e-6)
        torch.set_num_threads(2)
        again = attn_ext.attention(q, k, v, **kw)
        assert torch.equal(again[0], results[1][0]) and torch.equal(again[1], results[1][1])
    finally:
        torch.set_num_threads(old)


def test_decode_dropout_still_takes_the_tiled_kernel():
    q, k, v = randn(1, 1, 8, 64), randn(1, 600, 2, 64), randn(1, 600, 2, 64)
    assert _forward_path(q, k, v, causal=True, softcap=5.0, dropout_p=0.1) != "cpu.decode"
    assert _forward_path(q, k, v, causal=True, softcap=5.0) == "cpu.decode"
