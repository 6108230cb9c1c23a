"""The CPU decode kernel (csrc/cpu/attention_decode.h: few query columns per kv head, K/V
read once, split-K): values and lse against the float64 reference, with GQA/MHA, Sq 1-4,
masks (causal, window, key padding incl. all-padded rows), packed sequences, fp16/bf16,
hidden non-finite keys, NaN queries and thread-count independence."""

import pytest
import torch

import attn_ext
from attn_ext import reference
from utils import assert_close_rule, assert_lse_fp32, randn




def _inputs(B, Sq, Sk, H, Hkv, D, Dv, dtype):
    q = torch.randn(B, Sq, H, D, dtype=dtype)
    k = torch.randn(B, Sk, Hkv, D, dtype=dtype)
    v = torch.randn(B, Sk, Hkv, Dv, dtype=dtype)
    return q, k, v


def _check(out, lse, q, k, v, **kw):
    ro, rl = reference.attention_with_lse(q.double(), k.double(), v.double(), **kw)
    if q.dtype == torch.float32:
        tol = 2e-5
    else:  # 2x the reference's own error in the low precision, plus a floor
        lo, _ = reference.attention_with_lse(q, k, v, **kw)
        tol = 2 * (lo.double() - ro).abs().max().item() + 1e-3
    torch.testing.assert_close(out.double(), ro, rtol=0, atol=tol)
    torch.testing.assert_close(lse.double(), rl.to(torch.float64), rtol=0, atol=1e-4)


@pytest.mark.parametrize("B,Sq,Sk,H,Hkv,D,Dv", [
    (1, 1, 4096, 32, 8, 128, 128),   # GQA 4: 4 columns per kv head
    (3, 1, 1000, 8, 8, 64, 64),      # MHA: 1 column
    (2, 4, 777, 8, 2, 59, 111),      # 16 columns, odd dims
    (1, 2, 300, 16, 1, 32, 32),      # MQA: 32 columns -> tiled kernel, still correct
    (2, 1, 5, 4, 2, 16, 16),         # fewer keys than one block
    (1, 1, 301, 8, 2, 64, 64),       # blocks of 128, 128, 40 (whole 8-key groups) and 5 keys
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_matches_reference(B, Sq, Sk, H, Hkv, D, Dv, dtype):
    q, k, v = _inputs(B, Sq, Sk, H, Hkv, D, Dv, dtype)
    for causal in (False, True):
        out, lse = attn_ext.attention(q, k, v, causal=causal, return_lse=True)
        _check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("window", [(0, 0), (7, 0), (100, -1), (63, 5)])
def test_decode_window(window):
    q, k, v = _inputs(2, 3, 500, 8, 2, 64, 64, torch.float32)
    out, lse = attn_ext.attention(q, k, v, causal=False, window=window, return_lse=True)
    _check(out, lse, q, k, v, window=window)


def test_decode_left_padded_batch_and_empty_rows():
    B, Sk = 4, 700
    q, k, v = _inputs(B, 1, Sk, 8, 2, 64, 64, torch.float32)
    kpm = torch.ones(B, Sk, dtype=torch.bool)
    kpm[0, :300] = False                       # left padding
    kpm[1, 650:] = False                       # right padding
    kpm[2] = torch.rand(Sk) < 0.3              # scattered
    kpm[3] = False                             # a row that sees nothing
    # garbage in the padded slots must not matter, even inf / nan
    k[0, :300] = float("inf")
    v[0, :300] = float("nan")
    out, lse = attn_ext.attention(q, k, v, key_padding_mask=kpm, return_lse=True)
    keep = kpm.clone()
    k2, v2 = k.clone(), v.clone()
    k2[~keep] = 0
    v2[~keep] = 0
    _check(out[:3], lse[:3], q[:3], k2[:3], v2[:3], key_padding_mask=kpm[:3])
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert torch.isneginf(lse[3]).all()


def test_decode_hidden_nonfinite_key_does_not_leak():
    # causal, Sq = 3: the last keys are hidden from the first rows; inf there must stay out
    q, k, v = _inputs(1, 3, 200, 4, 2, 32, 32, torch.float32)
    v[0, 199] = float("inf")
    k[0, 198] = float("nan")
    out, _ = attn_ext.attention(q, k, v, causal=True, return_lse=True)
    assert torch.isfinite(out[0, 0]).all()           # row 0 sees keys <= 197
    assert torch.isnan(out[0, 1:]).all()             # rows 1, 2 see the NaN key


def test_decode_nan_query_row_is_nan():
    q, k, v = _inputs(1, 1, 600, 4, 2, 32, 32, torch.float32)
    q[0, 0, 1] = float("nan")
    out, lse = attn_ext.attention(q, k, v, return_lse=True)
    assert torch.isnan(out[0, 0, 1]).all() and torch.isnan(lse[0, 1]).all()
    assert torch.isfinite(out[0, 0, [0, 2, 3]]).all()


def test_decode_packed_sequences():
    lens_q, lens_k = [1, 2, 1, 0], [900, 37, 0, 5]
    H, Hkv, D = 8, 2, 64
    cq = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    ck = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cq[-1]), H, D)
    k = torch.randn(int(ck[-1]), Hkv, D)
    v = torch.randn(int(ck[-1]), Hkv, D)
    out, lse = attn_ext.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=True,
                                         return_lse=True)
    ro, rl = reference.attention_varlen_with_lse(q.double(), k.double(), v.double(), cq, ck,
                                                 causal=True)
    torch.testing.assert_close(out.double(), ro, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.double(), rl, rtol=0, atol=1e-4)


def test_decode_thread_count_independent():
    q, k, v = _inputs(1, 1, 5000, 16, 4, 64, 64, torch.float32)
    old = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 16, 64):
            torch.set_num_threads(n)
            results.append(attn_ext.attention(q, k, v, return_lse=True))
        for out, lse in results[1:]:
            torch.testing.assert_close(out, results[0][0], rtol=0, atol=1e-6)
            torch.testing.assert_close(lse, results[0][1], rtol=0, atol=1e-6)
        # repeated runs at a fixed thread count are bitwise equal (fixed chunking, ordered
        # merge)
        torch.set_num_threads(2)
        again = attn_ext.attention(q, k, v, return_lse=True)
        assert torch.equal(again[0], results[1][0]) and torch.equal(again[1], results[1][1])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_low_precision_thread_counts(dtype):
    """bf16 / fp16 decode (GQA, one and two query rows) at 1, 2, 16 and 64 threads: every count
    within DESIGN.md's rule against the float64 reference, forward, lse and gradients. (The
    keys are split into more chunks at more threads, and the bf16 product rounds p against each
    chunk's max (pv_pairs), so bf16 results differ by an ulp or two between counts, far inside
    the rule; fp16 and a fixed count are bitwise stable.)"""
    torch.manual_seed(0)
    q, k, v = (randn(2, sq, h, 128, dtype=dtype) for sq, h in ((2, 8), (2048, 2), (2048, 2)))
    dout = randn(2, 2, 8, 128, dtype=dtype)
    want = reference.attention_with_lse(*(t.double() for t in (q, k, v)), causal=True)
    low = reference.attention_with_lse(q, k, v, causal=True)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    g64 = torch.autograd.grad(reference.attention(*leaves64, causal=True), leaves64, dout.double())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    glow = torch.autograd.grad(reference.attention(*leaves, causal=True), leaves, dout)
    old = torch.get_num_threads()
    try:
        for n in (1, 2, 16, 64):
            torch.set_num_threads(n)
            assert attn_ext.explain(q, k, v, causal=True).forward == "cpu.decode"
            ins = [t.clone().requires_grad_() for t in (q, k, v)]
            out, lse = attn_ext.attention(*ins, causal=True, return_lse=True)
            assert_close_rule(out.detach(), want[0], low[0], f"out at {n} threads")
            assert_lse_fp32(lse.detach(), want[1], dtype)
            grads = torch.autograd.grad(out, ins, dout)
            for name, g, a, b in zip("qkv", grads, g64, glow):
                assert_close_rule(g, a, b, f"d{name} at {n} threads")
            again = attn_ext.attention(q, k, v, causal=True)
            assert torch.equal(again, out.detach())  # a fixed count: the same bits
    finally:
        torch.set_num_threads(old)


_IN_PLACE_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import attn_ext  # noqa: F401
torch.manual_seed(0)
outs = []
# group sizes 4, 1, 3 (an odd column count: the last column alone) and Sq = 2; every dtype
# (bf16 / fp16 rows are widened in registers when read in place)
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for B, Sq, Sk, H, Hkv in ((1, 1, 1000, 8, 2), (2, 1, 700, 4, 4), (1, 1, 96, 16, 16),
                              (1, 1, 520, 6, 2), (1, 2, 300, 8, 4), (1, 1, 301, 8, 2)):
        q = torch.randn(B, Sq, H, 64).to(dt)
        k, v = torch.randn(B, Sk, Hkv, 64).to(dt), torch.randn(B, Sk, Hkv, 64).to(dt)
        outs += list(torch.ops.attn_ext.attention_forward(q, k, v, False, None))
        outs += list(torch.ops.attn_ext.attention_forward(q, k, v, True, None))
torch.save(outs, sys.argv[2])
"""


def _run_in_both_modes(tmp_path, script_text, env_of):
    """The outputs a script saves when run in a fresh process with the environment variables
    env_of(mode) (None: unset) for mode "1" and "0" (switches read once per process)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "run.py"
    script.write_text(script_text)
    res = {}
    for mode in ("1", "0"):
        env = dict(os.environ)
        for name, value in env_of(mode).items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        out = tmp_path / f"out{mode}.pt"
        subprocess.run([sys.executable, str(script), root, str(out)], env=env, check=True, timeout=120)
        res[mode] = torch.load(out)
    return res


@pytest.mark.parametrize("switch", ["ATTN_EXT_CPU_DECODE_IN_PLACE", "ATTN_EXT_CPU_DECODE_QUADS"])
def test_decode_in_place_reads_equal_packed_blocks(tmp_path, switch):
    """K/V read in place (full unmasked blocks; fp32, or bf16 / fp16 widened in registers) give
    the same bits as the packed blocks (ATTN_EXT_CPU_DECODE_IN_PLACE=0): the same products in
    the same order. Likewise the scores of 4 columns x 2 keys against pairs of columns x 4 keys
    (ATTN_EXT_CPU_DECODE_QUADS=0; the shapes with group 4, or 2 rows x 2 heads, take quads)."""
    res = _run_in_both_modes(tmp_path, _IN_PLACE_SCRIPT, lambda mode: {switch: mode})
    assert len(res["1"]) == len(res["0"]) == 72
    for a, b in zip(res["1"], res["0"]):
        assert torch.equal(a, b)


_PACKED_SCRATCH_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import attn_ext  # noqa: F401
torch.manual_seed(0)
outs = []
# blocks the decode kernel packs: the last 1-7 keys of a unit, every block where D or Dv is not
# a multiple of 8 (rows padded), key padding, and the band's edges (Sq = 2, a window)
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for B, Sq, Sk, H, Hkv, D, Dv in ((1, 1, 9, 8, 2, 64, 64), (1, 1, 131, 32, 8, 128, 128),
                                     (2, 1, 45, 4, 4, 36, 20), (1, 2, 77, 8, 2, 64, 64),
                                     (1, 1, 301, 8, 1, 128, 128)):
        q = torch.randn(B, Sq, H, D).to(dt)
        k, v = torch.randn(B, Sk, Hkv, D).to(dt), torch.randn(B, Sk, Hkv, Dv).to(dt)
        kpm = torch.rand(B, Sk) < 0.8
        outs += list(torch.ops.attn_ext.attention_forward(q, k, v, True, None))
        outs.append(attn_ext.attention(q, k, v, key_padding_mask=kpm))
        outs.append(attn_ext.attention(q, k, v, window=(20, 0)))
torch.save(outs, sys.argv[2])
"""


def test_decode_packed_blocks_read_only_what_they_write(tmp_path):
    """The decode kernel's packing buffers are allocated without a fill (kb / vb / vh: every
    row a block reads is packed or zeroed first). glibc's MALLOC_PERTURB_ fills every fresh
    allocation with a byte pattern (0x5a here, a float of ~1.5e16): an element that is read
    before it is written and takes part in a result changes the bits of the outputs against a
    run without it (checked: packing one row fewer of K fails here)."""
    res = _run_in_both_modes(tmp_path, _PACKED_SCRATCH_SCRIPT,
                             lambda mode: {"MALLOC_PERTURB_": "165" if mode == "1" else None})
    assert len(res["1"]) == len(res["0"]) == 60
    for a, b in zip(res["1"], res["0"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_cache_lengths_past_whole_groups(dtype):
    """Cache lengths 8 n + t, t = 0..7, as a decode loop meets them step by step: the whole
    8-key groups are read in place and the last t keys packed (a block of their own), with
    GQA, Sq = 2 causal (the band's edge) and a window."""
    torch.manual_seed(0)
    for n in (0, 1, 3, 16):
        for t in range(8):
            Sk = 8 * n + t
            if Sk == 0:
                continue
            q, k, v = _inputs(1, 1, Sk, 8, 2, 64, 64, dtype)
            out, lse = attn_ext.attention(q, k, v, causal=True, return_lse=True)
            _check(out, lse, q, k, v, causal=True)
            q2 = randn(1, 2, 8, 64, dtype=dtype)
            out, lse = attn_ext.attention(q2, k, v, causal=True, return_lse=True)
            _check(out, lse, q2, k, v, causal=True)
            out, lse = attn_ext.attention(q2, k, v, window=(11, 0), return_lse=True)
            _check(out, lse, q2, k, v, window=(11, 0))


def _same_bits_either_way(monkeypatch, var, call, why):
    """call() with the switch var at 1 and at 0 (read per call): out and lse bitwise equal."""
    res = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(var, mode)
        res[mode] = call()
    for a, b in zip(res["1"], res["0"]):
        assert torch.equal(a, b), why


@pytest.mark.parametrize("threads", [2, 16])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_head_groups_give_the_one_unit_bits(monkeypatch, dt, threads):
    """Short keys (one chunk) and fewer sequences than threads: the decode kernel splits the kv
    heads into groups, a unit each (attention_decode.h). A head's scores, softmax, PV and merge
    are its own, so out and lse are bitwise those of one unit over every kv head
    (ATTN_EXT_CPU_DECODE_HEAD_SPLIT=0, read per call): GQA / MHA, several query rows, masks,
    key padding, every score term, in-place and packed blocks; explain names the groups."""
    from attn_ext import _explain as X

    torch.manual_seed(1)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    n = 0
    try:
        for B, Sq, Sk, H, Hkv, D, Dv in [(1, 1, 400, 8, 8, 64, 64), (1, 1, 300, 32, 8, 128, 128),
                                         (1, 2, 333, 12, 6, 64, 48), (3, 1, 480, 16, 16, 64, 64),
                                         (1, 1, 450, 6, 3, 96, 96)]:
            q = torch.randn(B, Sq, H, D).to(dt)
            k, v = torch.randn(B, Sk, Hkv, D).to(dt), torch.randn(B, Sk, Hkv, Dv).to(dt)
            kpm = torch.rand(B, Sk) > 0.2
            monkeypatch.delenv("ATTN_EXT_CPU_DECODE_HEAD_SPLIT", raising=False)
            plan = X.cpu_decode_plan(X.Shape(B, Sq, Sk, H, Hkv, D, Dv), dt, threads, causal=True)
            # min(Hkv, ceil(threads / B)) groups of whole heads (B = 3, 2 threads: 1 group)
            per = -(-Hkv // min(Hkv, -(-threads // B)))
            groups = -(-Hkv // per) if B < threads else 1
            assert plan["n_chunks"] == 1 and plan["head_groups"] == groups
            reason = attn_ext.explain(q, k, v, causal=True).forward_reason
            assert (f"kv heads in {groups} groups" in reason) == (groups > 1)
            for kw in (dict(causal=True), dict(causal=True, window=(100, 0)),
                       dict(causal=False, key_padding_mask=kpm),
                       dict(causal=True, alibi_slopes=attn_ext.alibi_slopes(H), softcap=20.0,
                            sinks=torch.randn(H)),
                       dict(causal=True, rel_bias=torch.randn(H, 65))):
                _same_bits_either_way(monkeypatch, "ATTN_EXT_CPU_DECODE_HEAD_SPLIT",
                                      lambda: attn_ext.attention(q, k, v, return_lse=True, **kw),
                                      (B, Sq, Sk, H, Hkv, D, Dv, kw))
                n += 1
    finally:
        torch.set_num_threads(prev)
    assert n == 25


@pytest.mark.skipif(not __import__("attn_ext._explain").\
                    _explain.cpu_avx512_enabled(), reason="no AVX-512F/BW on this CPU")
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_avx512_pv_gives_the_avx2_bits(monkeypatch, dt):
    """The AVX-512 PV product (attention_decode.h pv512, where Dvp is a multiple of 16) is the
    same fma per output element as the AVX2 one, keys in the same order: ATTN_EXT_CPU_DECODE_PV512
    (read on every call) 1 and 0 give the same bits, for every column count (1..16, GQA / MHA /
    several query rows), in-place and packed blocks (masks, padding, odd key counts), and row
    lengths with and without a natural-order tail (Dv 40, 72). (bf16's product by vdpbf16ps
    pairs, where it is on, takes neither: turned off here.)"""
    monkeypatch.setenv("ATTN_EXT_CPU_DECODE_PV_PAIRS", "0")
    torch.manual_seed(0)
    cases = [(1, 1, 1000, 8, 2, 64, 64), (2, 1, 700, 4, 4, 128, 128), (1, 1, 96, 16, 16, 128, 128),
             (1, 1, 520, 6, 2, 96, 96), (1, 2, 300, 8, 4, 64, 48), (1, 1, 301, 8, 2, 128, 128),
             (1, 4, 333, 16, 4, 64, 64), (2, 1, 257, 16, 1, 128, 80), (1, 1, 300, 8, 2, 40, 40),
             (2, 2, 200, 8, 4, 128, 72)]
    n = 0
    for B, Sq, Sk, H, Hkv, D, Dv in cases:
        q = torch.randn(B, Sq, H, D).to(dt)
        k, v = torch.randn(B, Sk, Hkv, D).to(dt), torch.randn(B, Sk, Hkv, Dv).to(dt)
        kpm = torch.rand(B, Sk) > 0.2
        assert attn_ext.explain(q, k, v, causal=True).forward == "cpu.decode"
        for kw in (dict(causal=False), dict(causal=True), dict(causal=True, window=(100, 0)),
                   dict(causal=False, key_padding_mask=kpm)):
            _same_bits_either_way(monkeypatch, "ATTN_EXT_CPU_DECODE_PV512",
                                  lambda: attn_ext.attention(q, k, v, return_lse=True, **kw),
                                  (B, Sq, Sk, H, Hkv, D, Dv, kw))
            n += 1
    assert n == 4 * len(cases)


@pytest.mark.parametrize("B,Sq,Sk,H,Hkv,D,Dv", [
    (1, 1, 300, 8, 2, 40, 40),     # two whole 16-element chunks and a natural-order tail of 8
    (2, 2, 200, 8, 4, 128, 72),    # whole chunks only for q / k, a tail for v
    (1, 1, 130, 4, 4, 24, 16),     # MHA, one chunk and a tail
])
def test_decode_bf16_decode_order_forward_and_backward(B, Sq, Sk, H, Hkv, D, Dv):
    """bf16 rows are widened 16 at a time into the even then the odd elements
    (attention_decode.h, decode_pos): the output must come back in natural order, and the
    backward, which recomputes the forward's scores in that element order, must still give the
    textbook's gradients."""
    from tests.test_attention import check, make_qkv
    q, k, v = make_qkv(B, Sq, Sk, H, Hkv, D, Dv, torch.bfloat16, "cpu")
    assert attn_ext.explain(q, k, v, causal=False).forward == "cpu.decode"
    for causal in (False, True):
        check(q, k, v, causal)


_HAVE_BF16DP = __import__("attn_ext._explain")._explain.cpu_avx512bf16_enabled()


@pytest.mark.parametrize("mode", ["1", "0"])
@pytest.mark.parametrize("B,Sq,Sk,H,Hkv,D,Dv", [
    (1, 1, 600, 32, 8, 128, 128),  # GQA 4 x 128: 4-column tiles, whole 32-element steps
    (2, 1, 300, 8, 8, 64, 64),     # MHA: 1 column x 8 keys
    (1, 2, 301, 8, 4, 40, 40),     # 4 columns, a masked tail of 8 in d, 5 keys past the groups
    (2, 4, 257, 8, 2, 59, 111),    # 16 columns, odd D (packed path, masked loads)
    (1, 1, 130, 6, 2, 96, 72),     # 3 columns: tiles of 2 and 1
])
def test_decode_bf16_dot_product_scores(monkeypatch, mode, B, Sq, Sk, H, Hkv, D, Dv):
    """bf16 scores by vdpbf16ps (attention_decode.h dp_scores, where the CPU has AVX512_BF16;
    ATTN_EXT_CPU_BF16DP=0 the fp32 widening): forward (causal, window, key padding) and
    backward (which recomputes the forward's scores with the same function) within the
    tolerance rule of the float64 textbook, in both modes. On such a CPU the two modes sum in
    different orders, so their lse differ somewhere at D = 128 (the dp path ran), by rounding
    only."""
    from tests.test_attention import check
    monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", mode)
    monkeypatch.setenv("ATTN_EXT_CPU_AMX", "0")  # the pairs, not the tiles (test below)
    torch.manual_seed(B * 1000 + Sk)
    q, k, v = _inputs(B, Sq, Sk, H, Hkv, D, Dv, torch.bfloat16)
    assert attn_ext.explain(q, k, v, causal=True).forward == "cpu.decode"
    for causal in (False, True):
        check(q, k, v, causal)
    kpm = torch.rand(B, Sk) > 0.3
    k_bad = k.clone()
    k_bad[~kpm] = float("nan")  # hidden keys' rows are read in place by dp_scores: masked after
    for kw in (dict(causal=True, window=(50, 0)), dict(causal=False, key_padding_mask=kpm)):
        kk = k_bad if "key_padding_mask" in kw else k
        out, lse = attn_ext.attention(q, kk, v, return_lse=True, **kw)
        _check(out, lse, q, k, v, **kw)
    if mode == "1" and _HAVE_BF16DP and D == 128:
        # (at D <= 96 many sums of bf16 products are exact in fp32 either way: equal lse)
        lses = {}
        for m in ("1", "0"):
            monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", m)
            lses[m] = attn_ext.attention(q, k, v, return_lse=True)[1]
        assert not torch.equal(lses["1"], lses["0"])
        torch.testing.assert_close(lses["1"], lses["0"], rtol=0, atol=1e-4)


def _force_pairs(monkeypatch):
    """The bf16 decode's scores and PV product by vdpbf16ps pairs on any AVX512_BF16 CPU (an
    Intel one takes them only with ATTN_EXT_CPU_BF16DP=1, and its tiles come first)."""
    monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", "1")
    monkeypatch.setenv("ATTN_EXT_CPU_AMX", "0")
    monkeypatch.delenv("ATTN_EXT_CPU_DECODE_PV_PAIRS", raising=False)


@pytest.mark.skipif(not _HAVE_BF16DP, reason="no AVX512_BF16 on this CPU")
@pytest.mark.parametrize("B,Sq,Sk,H,Hkv,D,Dv", [
    (1, 1, 1000, 32, 8, 128, 128),  # GQA 4: in-place blocks of 128, 64 d at a time
    (2, 1, 300, 8, 8, 64, 64),      # MHA: one column
    (1, 2, 301, 8, 4, 64, 48),      # 4 columns; Dv = 48: 16 d at a time; 5 keys past the groups
    (2, 4, 257, 8, 2, 59, 80),      # 16 columns (4 passes of 4), odd D, packed blocks
    (1, 1, 130, 6, 2, 96, 96),      # 3 columns
])
def test_decode_bf16_pv_by_pairs(monkeypatch, B, Sq, Sk, H, Hkv, D, Dv):
    """The bf16 decode's o += p v by vdpbf16ps (attention_decode.h pv_pairs, p rounded to bf16,
    two keys per instruction) where its scores are pairs: explain says so; forward (causal,
    window, key padding with NaN / inf in the hidden keys' v, which must meet no probability)
    and backward within the tolerance rule of the float64 textbook; ATTN_EXT_CPU_DECODE_PV_PAIRS=0
    (p in fp32, widened FMAs) gives other bits within that rule too."""
    from tests.test_attention import check
    _force_pairs(monkeypatch)
    torch.manual_seed(B * 1000 + Sk + Dv)
    q, k, v = _inputs(B, Sq, Sk, H, Hkv, D, Dv, torch.bfloat16)
    choice = attn_ext.explain(q, k, v, causal=True)
    assert choice.forward == "cpu.decode" and choice.details["bf16_pv"] == "vdpbf16ps"
    assert "o += p v by vdpbf16ps" in str(choice)
    for causal in (False, True):
        check(q, k, v, causal)
    kpm = torch.rand(B, Sk) > 0.3
    kpm[:, 0] = True
    v_bad = v.clone()
    v_bad[~kpm] = float("nan")
    v_bad[~kpm & (torch.arange(Sk) % 2 == 0)] = float("inf")
    v_win = v.clone()
    v_win[:, : Sk - Sq - 60] = float("nan")  # hidden from every row by the window below
    for kw, vv in ((dict(causal=True, window=(50, 0)), v_win),
                   (dict(causal=False, key_padding_mask=kpm), v_bad),
                   (dict(causal=True, key_padding_mask=kpm), v_bad)):
        out, lse = attn_ext.attention(q, k, vv, return_lse=True, **kw)
        _check(out, lse, q, k, v, **kw)
    res = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("ATTN_EXT_CPU_DECODE_PV_PAIRS", mode)
        assert attn_ext.explain(q, k, v).details["bf16_pv"] == ("vdpbf16ps" if mode == "1" else "widened")
        res[mode] = attn_ext.attention(q, k, v, return_lse=True)
        _check(*res[mode], q, k, v)
    assert torch.equal(res["1"][1], res["0"][1])  # lse: the same scores and sums
    if Dv >= 64:  # (the rounded p shows in some output's last bit)
        assert not torch.equal(res["1"][0], res["0"][0])


@pytest.mark.skipif(not _HAVE_BF16DP, reason="no AVX512_BF16 on this CPU")
def test_decode_bf16_pv_by_pairs_one_visible_key_gives_its_v(monkeypatch):
    """A row that sees one key has p = 1, which bf16 holds exactly: out is that key's v bit for
    bit through the pairs' product, in a packed block (key padding) and at a band's edge (Sq = 2
    and a window of one key: each row's key is hidden from the other row, the block's edge
    path, which must skip the hidden pair: the last key's inf would give row 0 NaN), whatever
    the other keys' v hold."""
    _force_pairs(monkeypatch)
    torch.manual_seed(5)
    B, Sk, H, Hkv, D = 2, 300, 8, 2, 128
    q, k, v = _inputs(B, 1, Sk, H, Hkv, D, D, torch.bfloat16)
    assert attn_ext.explain(q, k, v).details["bf16_pv"] == "vdpbf16ps"
    kpm = torch.zeros(B, Sk, dtype=torch.bool)
    kpm[0, 37] = kpm[1, 299] = True
    v[0, 36] = v[0, 38] = float("inf")
    out = attn_ext.attention(q, k, v, key_padding_mask=kpm)
    group = H // Hkv
    for b, j in ((0, 37), (1, 299)):
        for h in range(H):
            assert torch.equal(out[b, 0, h], v[b, j, h // group])
    out = attn_ext.attention(q, k, v, causal=True, window=(0, 0))  # the last key only
    for b in range(B):
        for h in range(H):
            assert torch.equal(out[b, 0, h], v[b, Sk - 1, h // group])
    q2 = torch.randn(B, 2, H, D).bfloat16()
    v2 = v.clone()
    v2[:, : Sk - 2] = float("nan")
    v2[:, Sk - 1, :, ::3] = float("inf")  # row 1 sees it (inf there), row 0 must not
    assert attn_ext.explain(q2, k, v2, causal=True).details["bf16_pv"] == "vdpbf16ps"
    out = attn_ext.attention(q2, k, v2, causal=True, window=(0, 0))  # row i: key Sk - 2 + i
    for b in range(B):
        for i in range(2):
            for h in range(H):
                assert torch.equal(out[b, i, h], v2[b, Sk - 2 + i, h // group])


_PAIRS_IN_PLACE_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import attn_ext  # noqa: F401
torch.manual_seed(0)
outs = []
# Dv 128 / 64 (whole 64-element steps, fixed lengths), 80 / 48 / 16 (16-element steps); group
# 4, 1, 3 and Sq = 2; key counts that leave a block of whole groups and a last short one
for B, Sq, Sk, H, Hkv, D, Dv in ((1, 1, 1000, 32, 8, 128, 128), (2, 1, 700, 4, 4, 64, 64),
                                 (1, 1, 520, 6, 2, 64, 80), (1, 2, 300, 8, 4, 32, 48),
                                 (1, 1, 301, 8, 2, 128, 16), (2, 1, 257, 8, 8, 128, 256),
                                 (1, 1, 96, 16, 16, 64, 64), (1, 2, 333, 8, 2, 64, 128),
                                 (1, 1, 129, 8, 2, 96, 96), (3, 1, 64, 8, 2, 64, 64)):
    q = torch.randn(B, Sq, H, D).bfloat16()
    k, v = torch.randn(B, Sk, Hkv, D).bfloat16(), torch.randn(B, Sk, Hkv, Dv).bfloat16()
    outs += list(torch.ops.attn_ext.attention_forward(q, k, v, False, None))
    outs += list(torch.ops.attn_ext.attention_forward(q, k, v, True, None))
torch.save(outs, sys.argv[2])
"""


@pytest.mark.skipif(not _HAVE_BF16DP, reason="no AVX512_BF16 on this CPU")
def test_decode_bf16_pv_by_pairs_in_place_equals_packed(tmp_path):
    """With the pairs' product, K / V read in place and packed blocks
    (ATTN_EXT_CPU_DECODE_IN_PLACE=0) give the same bits: the same pairs of keys in the same
    order, whichever group size the product takes them in."""
    res = _run_in_both_modes(tmp_path, _PAIRS_IN_PLACE_SCRIPT,
                             lambda mode: dict(ATTN_EXT_CPU_DECODE_IN_PLACE=mode,
                                               ATTN_EXT_CPU_BF16DP="1", ATTN_EXT_CPU_AMX="0",
                                               ATTN_EXT_CPU_DECODE_PV_PAIRS=None))
    assert len(res["1"]) == len(res["0"]) == 40
    for a, b in zip(res["1"], res["0"]):
        assert torch.equal(a, b)


_HAVE_AMX = __import__("attn_ext._explain")._explain.cpu_amx_enabled()


@pytest.mark.skipif(not _HAVE_AMX, reason="no AMX-TILE / AMX-BF16 on this CPU")
@pytest.mark.parametrize("B,Sq,Sk,H,Hkv,D,Dv", [
    (1, 1, 600, 32, 8, 128, 128),  # GQA 4: 32-key tile pairs, a tail of 24 keys per unit
    (2, 2, 301, 8, 4, 64, 64),     # 4 columns, a unit tail of 5 keys (staged rows)
    (1, 4, 257, 8, 2, 96, 72),     # 16 columns, D = 3 depth steps, Dv with a tail chunk
    (2, 1, 77, 4, 4, 32, 40),      # MHA: one column, fewer than 32 keys past the groups
])
def test_decode_bf16_scores_on_tiles(monkeypatch, B, Sq, Sk, H, Hkv, D, Dv):
    """bf16 decode scores on AMX tiles (attention_decode.h decode_scores_on_tiles,
    mk::decode_scores_amx: K read where it is, 32 keys of every kv head at a time; the backward
    recomputes them with scores_amx): forward (causal, window, key padding with NaN in the
    hidden keys) and backward within the tolerance rule of the float64 textbook; explain says
    so; ATTN_EXT_CPU_AMX=0 widens them again (another summation order: lse differs by rounding
    only)."""
    from tests.test_attention import check
    monkeypatch.delenv("ATTN_EXT_CPU_BF16DP", raising=False)
    monkeypatch.delenv("ATTN_EXT_CPU_AMX", raising=False)
    torch.manual_seed(B * 1000 + Sk + D)
    q, k, v = _inputs(B, Sq, Sk, H, Hkv, D, Dv, torch.bfloat16)
    choice = attn_ext.explain(q, k, v, causal=True)
    assert choice.forward == "cpu.decode" and choice.details["bf16_scores"] == "amx"
    assert choice.details["scores"] is None and "AMX tiles" in str(choice)
    for causal in (False, True):
        check(q, k, v, causal)
    kpm = torch.rand(B, Sk) > 0.3
    kpm[:, 0] = True
    k_bad = k.clone()
    k_bad[~kpm] = float("nan")  # hidden keys' rows are read in place by the tiles: masked after
    for kw in (dict(causal=True, window=(50, 0)), dict(causal=False, key_padding_mask=kpm)):
        kk = k_bad if "key_padding_mask" in kw else k
        out, lse = attn_ext.attention(q, kk, v, return_lse=True, **kw)
        _check(out, lse, q, k, v, **kw)
    lse_tiles = attn_ext.attention(q, k, v, return_lse=True)[1]
    monkeypatch.setenv("ATTN_EXT_CPU_AMX", "0")
    assert attn_ext.explain(q, k, v).details["bf16_scores"] != "amx"
    lse_wide = attn_ext.attention(q, k, v, return_lse=True)[1]
    torch.testing.assert_close(lse_tiles, lse_wide, rtol=0, atol=1e-4)
    if D == 128:  # (sums of 128 bf16 products: the two orders round differently somewhere)
        assert not torch.equal(lse_tiles, lse_wide)


@pytest.mark.skipif(not _HAVE_AMX, reason="no AMX-TILE / AMX-BF16 on this CPU")
def test_decode_tiles_one_visible_key_gives_its_v():
    """A decode row that sees one key (key padding) has p = exp(s - lse) = 1 only if the
    backward's recomputed score is the forward's bit for bit (lse = that score): then out is
    the key's v and dv the row's dout, exactly, with the scores on tiles."""
    torch.manual_seed(3)
    B, Sk, H, Hkv, D = 2, 200, 8, 2, 128
    q = torch.randn(B, 1, H, D).bfloat16().requires_grad_()
    k = torch.randn(B, Sk, Hkv, D).bfloat16().requires_grad_()
    v = torch.randn(B, Sk, Hkv, D).bfloat16().requires_grad_()
    kpm = torch.zeros(B, Sk, dtype=torch.bool)
    kpm[0, 37] = kpm[1, 150] = True
    assert attn_ext.explain(q, k, v, key_padding_mask=kpm).details["bf16_scores"] == "amx"
    out = attn_ext.attention(q, k, v, key_padding_mask=kpm)
    dout = torch.randn_like(out)
    out.backward(dout)
    group = H // Hkv
    for b, j in ((0, 37), (1, 150)):
        for h in range(H):
            assert torch.equal(out[b, 0, h], v[b, j, h // group].detach())
        for hk in range(Hkv):
            want = dout[b, 0, hk * group:(hk + 1) * group].float().sum(0)
            torch.testing.assert_close(v.grad[b, j, hk].float(), want.bfloat16().float(),
                                       rtol=0, atol=0)


@pytest.mark.skipif(not __import__("attn_ext._explain").\
                    _explain.cpu_avx512_enabled(), reason="no AVX-512F/BW on this CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,Sq,Sk,H,Hkv,D,kw", [
    (1, 1, 1000, 32, 8, 128, dict(causal=True)),   # 4 columns: 4 x 2 (2-byte) or 2 x 4 tiles
    (2, 1, 517, 8, 4, 64, dict(causal=True)),      # 2 columns
    (1, 1, 300, 15, 5, 40, dict(causal=False)),    # 3 columns (2 + 1), D = 40: a tail chunk
    (1, 2, 333, 8, 2, 72, dict(causal=True)),      # 8 columns (2 query rows), D = 72
    (1, 1, 777, 10, 2, 128, dict(window=(300, 0))),  # 5 columns, a window: packed blocks
    (1, 1, 200, 6, 6, 64, dict(causal=True)),      # MHA: one column, on ymm either way
])
def test_decode_zmm_scores_same_bits(monkeypatch, dtype, B, Sq, Sk, H, Hkv, D, kw):
    """The decode kernel's scores on zmm registers (attention_decode.h scores_cols512: two key
    groups in the two halves of each register, hsum8's tree on each half) give the bits of the
    ymm scores (ATTN_EXT_CPU_DECODE_SCORES512=0): out, lse and the gradients (the backward
    recomputes the decode order's scores with the same function) equal bitwise, bf16 widened
    (ATTN_EXT_CPU_BF16DP=0), over column counts 1-8, head dims with and without a tail chunk,
    keys read in place and packed blocks; and they match the reference. explain names the
    register width."""
    monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", "0")
    torch.manual_seed(Sk + D)
    q, k, v = _inputs(B, Sq, Sk, H, Hkv, D, D, dtype)
    dout = torch.randn(B, Sq, H, D).to(dtype)
    res = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("ATTN_EXT_CPU_DECODE_SCORES512", mode)
        choice = attn_ext.explain(q, k, v, **kw)
        assert choice.forward == "cpu.decode"
        assert choice.details["scores"] == ("zmm" if mode == "1" else "ymm")
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = attn_ext.attention(*ts, return_lse=True, **kw)
        grads = torch.autograd.grad((out, lse), ts, (dout, torch.ones_like(lse)))
        res[mode] = [out.detach(), lse.detach(), *grads]
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), res["1"], res["0"]):
        assert torch.equal(a.view(bits[a.dtype]), b.view(bits[b.dtype])), name
    _check(res["1"][0], res["1"][1], q, k, v, **kw)
