"""The CPU forward's work partition (issue 16 items 3 and 5): query tiles in groups per
(sequence, kv head), K / V rows converted once per worker and head (HeadRows: rows at an
aliasing stride, bf16 / fp16 rows), helpers at the end. Values against the float64
reference at 1, 2, 16 and 64 threads (16 and 64 oversubscribe this machine); every tile's
result is independent of the worker that ran it, so counts that do not split the keys
(tiles >= threads) give bitwise equal outputs."""
import pytest
import torch

import attn_ext
from attn_ext import reference
from tests.utils import with_threads


# BSHD contiguous with H * D * 4 bytes = 1 KiB (fp32) / 512 B (bf16) per row: fp32 rows alias
# (HeadRows converts them), bf16 rows are always converted
CASES = [
    pytest.param(torch.float32, True, None, id="fp32-causal"),
    pytest.param(torch.float32, False, (150, 20), id="fp32-window"),
    pytest.param(torch.bfloat16, True, (300, 0), id="bf16-causal-window"),
]


@pytest.mark.parametrize("dtype,causal,window", CASES)
def test_forward_partition_threads(dtype, causal, window):
    torch.manual_seed(0)
    B, S, H, Hkv, D = 2, 700, 4, 2, 64
    q = torch.randn(B, S, H, D).to(dtype)
    k = torch.randn(B, S, Hkv, D).to(dtype)
    v = torch.randn(B, S, Hkv, D).to(dtype)
    f = lambda: attn_ext.attention(q, k, v, causal=causal, window=window, return_lse=True)
    ref_out, ref_lse = reference.attention_with_lse(q.double(), k.double(), v.double(),
                                                    causal=causal, window=window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    results = {n: with_threads(n, f) for n in (1, 2, 16, 64)}
    for n, (out, lse) in results.items():
        assert (out.double() - ref_out).abs().max().item() < tol, n
        assert (lse.double() - ref_lse).abs().max().item() < 1e-4, n
    # B * Hkv * 8 row blocks = 32 tiles: no key split up to 16 threads -> the same bits
    for n in (2, 16):
        assert torch.equal(results[n][0], results[1][0]) and torch.equal(results[n][1], results[1][1])
    again = with_threads(64, f)
    assert torch.equal(again[0], results[64][0]) and torch.equal(again[1], results[64][1])


def test_forward_packed_sequences_share_no_rows():
    """Packed sequences of one batch: each (sequence, kv head) has its own rows (HeadRows is
    keyed by the head's first row), also for sequences of different lengths."""
    torch.manual_seed(1)
    lens = [300, 5, 420, 1]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T, H, D = sum(lens), 4, 64
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    out = attn_ext.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    ref, _ = reference.attention_varlen_with_lse(q.double(), k.double(), v.double(), cu, cu, causal=True)
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("threads", [1, 64])
def test_forward_aliasing_v_rows_packed_padded_same_bits(D, threads):
    """v rows a multiple of 512 bytes apart and wider than one 64-float panel alias in L1 as
    the pass-3 gemm's B operand, so the forward packs them at a padded leading dimension
    (b_rows_alias / padded_ld in attention_common.h): the head's rows at 1 thread, each key
    tile's at 64 (the share per worker is then too small for a head). The arithmetic is the
    same: the same values read in place at a stride that does not alias (D + 8 floats) give
    the same bits, with a causal band and a NaN in a hidden key's v (the partial tiles'
    non-finite path)."""
    torch.manual_seed(2)
    B, Hkv, H, S = 1, 2, 4, 300
    q = torch.randn(B, H, S, D).transpose(1, 2)
    k = torch.randn(B, Hkv, S, D).transpose(1, 2)
    v = torch.randn(B, Hkv, S, D)
    v[:, :, S - 1] = float("nan")  # seen by the last row only
    v_alias = v.transpose(1, 2)  # (B, S, Hkv, D) view, rows D floats apart
    wide = torch.zeros(B, Hkv, S, D + 8)
    wide[..., :D] = v
    v_plain = wide[..., :D].transpose(1, 2)  # rows D + 8 floats apart
    assert v_alias.stride(1) * 4 % 512 == 0 and v_plain.stride(1) * 4 % 512 != 0
    for causal in (True, False):
        a = with_threads(threads, lambda: attn_ext.attention(q, k, v_alias, causal=causal, return_lse=True))
        b = with_threads(threads, lambda: attn_ext.attention(q, k, v_plain, causal=causal, return_lse=True))
        for x, y in zip(a, b):
            assert torch.equal(x.isnan(), y.isnan())
            assert torch.equal(x.nan_to_num().view(torch.int32), y.nan_to_num().view(torch.int32))
        if causal:  # the NaN reaches the last row only
            assert a[0][:, :-1].isfinite().all() and a[0][:, -1].isnan().all()


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("threads", [1, 64])
def test_forward_bf16_aliasing_k_rows_copied_same_bits(D, threads):
    """bf16 k rows a multiple of 1 KiB apart (BSHD with 8+ kv heads) alias as the AMX tiles' /
    pair products' operands read in place, so the forward copies them D apart first
    (rows16_alias / HeadRows16 in attention_fwd.cpp: the head's rows at 1 thread, the asked
    rows each time at 64). The same values at a stride that does not alias give the same bits,
    with a causal band, a window and a NaN in a hidden key's k."""
    torch.manual_seed(3)
    B, H, Hkv, S = 1, 16, 8, 700  # (at 64 threads a head's k rows and v^T pairs exceed the 160 KiB share)
    q = torch.randn(B, S, H, D).bfloat16()
    k = torch.randn(B, S, Hkv, D).bfloat16()
    v = torch.randn(B, S, Hkv, D).bfloat16()
    k[:, S - 1, :, 0] = float("nan")  # seen by the last row only (causal)
    wide = torch.zeros(B, S, Hkv * D + 32, dtype=torch.bfloat16)
    wide[..., :Hkv * D] = k.reshape(B, S, Hkv * D)
    k_plain = wide[..., :Hkv * D].unflatten(-1, (Hkv, D))
    assert k.stride(1) * 2 % 1024 == 0 and k_plain.stride(1) * 2 % 1024 != 0
    for kw in (dict(causal=True), dict(causal=True, window=(100, 0))):
        a = with_threads(threads, lambda: attn_ext.attention(q, k, v, return_lse=True, **kw))
        b = with_threads(threads, lambda: attn_ext.attention(q, k_plain, v, return_lse=True, **kw))
        for x, y in zip(a, b):
            assert torch.equal(x.isnan(), y.isnan())
            assert torch.equal(x.float().nan_to_num().view(torch.int32), y.float().nan_to_num().view(torch.int32))
        assert a[0][:, :-1].isfinite().all() and a[0][:, -1].isnan().all()


@pytest.mark.parametrize("dtype,D,lens,expand", [
    (torch.float32, 128, [9500, 9000], "v"),   # padded v rows (HeadRows ld) then Dvp rows
    (torch.float32, 128, [5000, 4500], "kv"),
    (torch.bfloat16, 64, [40, 50], "k"),       # HeadRows16: a longer head in the same block
    (torch.bfloat16, 64, [40, 60, 50], "k"),
    (torch.bfloat16, 64, [200, 100], "v"),     # HeadPairs (v^T pairs)
    (torch.float16, 64, [40, 50], "kv"),       # HeadSplit / HeadPairs split
])
def test_forward_head_caches_keyed_by_length(dtype, D, lens, expand):
    """The forward's per-worker head caches (HeadRows, HeadRows16, HeadSplit, HeadPairs) are
    keyed by the head's first row; packed sequences over k / v rows of stride 0 (expand) give
    every sequence the same first row with another length, so a cache must also be keyed by
    the length (and HeadRows by its leading dimension), else a shorter or longer sequence reads
    rows laid out for the other one (review of stop 44: wrong values, and a read past the
    buffer). Against the same call on contiguous copies."""
    torch.manual_seed(4)
    H = 1
    Tk = sum(lens)
    cu_k = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    nq = 64
    cu_q = torch.arange(0, nq * (len(lens) + 1), nq, dtype=torch.int32)
    q = torch.randn(nq * len(lens), H, D).to(dtype)
    k = torch.randn(Tk, H, D).to(dtype)
    v = torch.randn(Tk, H, D).to(dtype)
    if "k" in expand:
        k = torch.randn(1, H, D).to(dtype).expand(Tk, H, D)
    if "v" in expand:
        v = torch.randn(1, H, D).to(dtype).expand(Tk, H, D)

    def call(kk, vv):
        return attn_ext.attention_varlen(q, kk, vv, cu_q, cu_k, nq, max(lens), causal=False)

    got = with_threads(1, lambda: call(k, v))
    want = with_threads(1, lambda: call(k.contiguous(), v.contiguous()))
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2 if dtype != torch.float32 else 1e-5,
                               atol=2e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("where", ["k0", "k96", "q", "alibi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_split_keys_merge_keeps_nan_rows(where, dtype):
    """Few query tiles and many threads split each tile's keys into chunks merged through their
    (max, sum). A chunk whose only score of a row is NaN can keep the row's max at -inf with a
    NaN sum; the merge used to skip it (and std::max dropped NaN maxima), so the row came back
    as if it had not seen the NaN (out 0 / lse -inf, or the key left out). The NaN rows must be
    the same at every thread count."""
    torch.manual_seed(0)
    Sq = 17 if where == "q" else 700
    q = torch.randn(1, Sq, 1, 96).to(dtype)
    k, v = [torch.randn(1, 700, 1, 96).to(dtype) for _ in range(2)]
    kw = dict(causal=where != "q")
    if where == "k0":
        k[0, 0, 0, 5] = float("nan")  # causal: row 0 sees key 0 only
    elif where == "k96":
        k[0, 96, 0, 5] = float("nan")  # rows 96.. see it
    elif where == "q":
        q[0, 0, 0, 9] = float("nan")
    else:
        kw["alibi_slopes"] = torch.full((1,), float("nan"))
    f = lambda: attn_ext.attention(q, k, v, return_lse=True, **kw)
    one = with_threads(1, f)
    nan_rows = torch.isnan(one[1][0, 0])
    assert nan_rows.any()
    for n in (2, 16):
        out, lse = with_threads(n, f)
        assert torch.equal(torch.isnan(lse[0, 0]), nan_rows), n
        assert torch.equal(torch.isnan(out[0, :, 0]).any(-1), nan_rows), n
        ok = ~nan_rows
        torch.testing.assert_close(out[0, ok], one[0][0, ok], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("Sq", [1, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_split_keys_merge_keeps_a_nan_v_at_a_zero_probability(dtype, Sq):
    """Keys whose scores are all -inf (probability 0) and a NaN v among them: 0 * NaN is NaN in
    one pass over the keys (and in the float64 textbook), so it must stay NaN when the keys are
    split into chunks (split-KV, the decode's chunks): such a chunk has max -inf and sum 0 but a
    NaN partial output, and the merges used to skip it."""
    torch.manual_seed(0)
    Sk, D = 1024, 64
    q = torch.randn(1, Sq, 1, D).abs().to(dtype)
    k, v = [torch.randn(1, Sk, 1, D).to(dtype) for _ in range(2)]
    k[0, :300, 0, 0] = -float("inf")  # q[..., 0] > 0: keys 0..299 score -inf for every row
    v[0, 10, 0, 3] = float("nan")
    ref = reference.attention(q.double(), k.double(), v.double())
    for n in (1, 2, 16):
        out = with_threads(n, lambda: attn_ext.attention(q, k, v))
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), n
