"""The tiled CPU kernels' fp32 gemms on zmm registers (csrc/cpu/attention_microkernels_avx512.cpp,
where the CPU has AVX-512F/BW) give the same bits as the AVX2 ones (ATTN_EXT_CPU_GEMM512=0): every
output of a whole call, forward and backward (out, lse, dq, dk, dv, d rel_bias, d sinks), through
every gemm shape the kernels make (whole tiles, the one-head panels and key ranges of partial
tiles, the non-finite-v fallback, the blocked chains past K = 96, column counts that leave a
half-vector tail, a v view whose rows are not 64-byte aligned), every mask and score term,
dropout, GQA, packed sequences, the split-KV forward and the split backward, fp32 / fp16 / bf16.
"Same bits" is compared on the integer view (so -0 and +0 differ); a NaN output must be NaN in
both, of any sign and payload (which NaN an FMA passes on follows its operand order, which the
compiler picks). Which gemm ran is taken from explain()'s mirror of the C++ rule
(details["gemm"]): no profiler sees inside the CPU kernels. The micro-kernels alone are checked by
tools/gemm512_check.cpp (test_bench_scripts.py); the AVX2 path is checked against the float64
textbook everywhere else, so equal bits carry that over.
"""

import pytest
import torch

import attn_ext
from attn_ext._explain import cpu_avx512_enabled

pytestmark = pytest.mark.skipif(not cpu_avx512_enabled(),
                                reason="no AVX-512F/BW (or ATTN_EXT_CPU_AVX512=0): one gemm path")


def _call(q, k, v, dout, kw, seed):
    ts = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    extra = [t for t in (kw.get("rel_bias"), kw.get("sinks")) if t is not None]
    torch.manual_seed(seed)  # (dropout's seed and offset)
    out, lse = attn_ext.attention(*ts, return_lse=True, **kw)
    grads = torch.autograd.grad((out, lse), ts + extra,
                                (dout, torch.ones_like(lse).masked_fill(lse.isinf(), 0)))
    return [out.detach(), lse.detach(), *grads]


_INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
        torch.bfloat16: torch.int16}


def assert_same_bits(a, b, name):
    """a and b hold the same bits (integer views: -0 is not +0), except that a NaN in one must be
    a NaN in the other, of any sign and payload."""
    assert a.dtype == b.dtype and a.shape == b.shape, name
    nan = a.isnan()
    assert torch.equal(nan, b.isnan()), name
    ai, bi = a.contiguous().view(_INT[a.dtype]), b.contiguous().view(_INT[b.dtype])
    assert torch.equal(ai[~nan], bi[~nan]), (name, (a.double() - b.double()).abs().max())


def _same_bits(monkeypatch, q, k, v, kw, seed=0):
    B, Sq, H = q.shape[:3]
    dout = torch.randn(B, Sq, H, v.shape[-1]).to(q.dtype)
    res = {}
    for mode, gemm in (("0", "avx2"), ("1", "avx512")):
        monkeypatch.setenv("ATTN_EXT_CPU_GEMM512", mode)
        choice = attn_ext.explain(q, k, v, **kw)
        if choice.forward != "cpu.decode":  # (the decode kernel has no gemm to name)
            assert choice.details["gemm"] == gemm
        res[mode] = _call(q, k, v, dout, kw, seed)
    names = ["out", "lse", "dq", "dk", "dv", "d rel_bias / sinks", "d sinks"]
    for name, a, b in zip(names, res["0"], res["1"]):
        assert_same_bits(a, b, name)
    return res["1"]


CASES = [
    # B, Sq, Sk, H, Hkv, D, Dv, kwargs
    (1, 300, 300, 2, 2, 128, 128, dict(causal=True)),       # D = 128: blocked score chains
    (2, 200, 200, 4, 2, 64, 64, dict(causal=True)),         # GQA, 4 x 16 columns
    (1, 150, 150, 1, 1, 58, 58, dict(causal=True)),         # one head: partial tiles by panels
    (1, 97, 130, 4, 1, 40, 40, dict()),                     # MQA, 40 -> 48 columns (a tail)
    (2, 64, 64, 2, 2, 200, 24, dict(causal=True, window=(20, 5))),  # long chains, a band
    (1, 9, 700, 4, 1, 64, 64, dict()),                      # one query tile: the split-KV forward
    (1, 333, 257, 3, 3, 80, 72, dict(causal=True)),         # 80 / 72 columns: 16-lane + 8 tails
    (1, 2, 513, 2, 1, 256, 256, dict()),                    # decode-sized, D = 256: the decode
                                                            # forward, the backward's gemms
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("B,Sq,Sk,H,Hkv,D,Dv,kw", CASES)
def test_gemm512_same_bits(monkeypatch, dtype, B, Sq, Sk, H, Hkv, D, Dv, kw):
    torch.manual_seed(Sq * 7 + D)
    q = torch.randn(B, Sq, H, D).to(dtype)
    k, v = torch.randn(B, Sk, Hkv, D).to(dtype), torch.randn(B, Sk, Hkv, Dv).to(dtype)
    if Sq == 9 and torch.get_num_threads() > 1:  # the case meant for the split-KV forward
        assert attn_ext.explain(q, k, v, **kw).forward == "cpu.split_kv"
    _same_bits(monkeypatch, q, k, v, kw)


def test_gemm512_same_bits_masks_terms_dropout(monkeypatch):
    """Key padding (a fully padded batch row too), ALiBi, rel_bias and sinks with their
    gradients, softcap and dropout, on BHSD transpose views and a v view at an odd offset
    (rows not 64-byte aligned: gemm_at's packed panels)."""
    torch.manual_seed(5)
    B, S, H, Hkv, D = 2, 190, 4, 2, 64
    q = torch.randn(B, H, S, D).transpose(1, 2)
    k = torch.randn(B, Hkv, S, D).transpose(1, 2)
    vbuf = torch.randn(B, S, Hkv, D + 3)
    v = vbuf[..., 3:]  # 12 bytes past the rows' alignment, row stride D + 3
    pad = torch.rand(B, S) > 0.2
    pad[1] = False
    kw = dict(causal=True, key_padding_mask=pad, alibi_slopes=torch.rand(H),
              rel_bias=torch.randn(H, 2 * 40 + 1, requires_grad=True), softcap=20.0,
              sinks=torch.randn(H, requires_grad=True), dropout_p=0.2)
    _same_bits(monkeypatch, q, k, v, kw, seed=7)


def test_gemm512_same_bits_nonfinite_hidden_v_and_varlen(monkeypatch):
    """A NaN in a hidden key's v (the per-column fallback of partial tiles), and packed
    sequences through attention_varlen."""
    torch.manual_seed(9)
    B, S, H, D = 1, 200, 2, 64
    q, k, v = (torch.randn(B, S, H, D) for _ in range(3))
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, 150:] = False
    v[0, 160] = float("nan")
    _same_bits(monkeypatch, q, k, v, dict(causal=True, key_padding_mask=pad))

    lens = [37, 0, 150, 96]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T = int(cu[-1])
    q, k, v = (torch.randn(T, 4, 64) for _ in range(3))
    dout = torch.randn(T, 4, 64)
    res = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("ATTN_EXT_CPU_GEMM512", mode)
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attn_ext.attention_varlen(*ts, cu, cu, max(lens), max(lens), causal=True)
        res[mode] = [out.detach(), *torch.autograd.grad(out, ts, dout)]
    for a, b in zip(res["0"], res["1"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [1, 8])
def test_gemm512_same_bits_split_backward(monkeypatch, threads):
    """One (batch, kv head) unit and 5 query tiles: at 1 thread the fused backward and the plain
    tiled forward; at 8 threads (oversubscribed) the FlashAttention-2 split backward (dk / dv by
    key chunks, dq by query blocks) and the split-KV forward."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(11)
        q, k, v = (torch.randn(1, 400, 1, 96) for _ in range(3))
        choice = attn_ext.explain(q, k, v, causal=True)
        assert choice.forward == ("cpu.split_kv" if threads > 1 else "cpu.tiled")
        assert ("split" in choice.backward_reason) == (threads > 1)
        _same_bits(monkeypatch, q, k, v, dict(causal=True))
    finally:
        torch.set_num_threads(old)


def test_gemm512_nan_outputs_stay_nan(monkeypatch):
    """A NaN in a visible key's v, and an inf v at a key whose probability is exactly 0 (0 * inf
    is the default NaN, of the other sign): every output row is NaN on both paths (which NaN is
    not compared: see the module docstring), and the lse, which no NaN reaches, is the same bits."""
    torch.manual_seed(0)
    q = torch.full((1, 32, 1, 16), 1.0)
    k = torch.randn(1, 192, 1, 16) * 0.1
    v = torch.randn(1, 192, 1, 16)
    v[0, 5] = float("nan")
    k[0, 100] = -100.0
    v[0, 100] = float("inf")
    res = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("ATTN_EXT_CPU_GEMM512", mode)
        res[mode] = attn_ext.attention(q, k, v, return_lse=True)
    for name, a, b in zip(("out", "lse"), res["0"], res["1"]):
        assert_same_bits(a, b, name)
    assert res["1"][0].isnan().all() and not res["1"][1].isnan().any()
