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
