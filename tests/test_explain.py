"""attn_ext.explain(q, k, v, ...): the kernel a call will use and why.

CPU: its split-KV / tiled answer is checked against what the kernel observably did
(tests/profiling.cpu_split_kv_ran). CUDA: the rules are pure functions of shapes, dtype,
alignment and device properties, checked here on CPU with made-up device properties; the
constants they use are read from the C++ sources (tools/kernel_constants.py) and must agree.
tests/test_attention_cuda.py compares explain with the profiled kernels on a GPU."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

import attn_ext
from attn_ext import _explain as X
from tests.profiling import cpu_split_kv_ran
from tests.utils import randn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import kernel_constants as kc  # noqa: E402

H200 = dict(sms=132, smem_optin=227 * 1024)
RTX4090 = dict(sms=128, smem_optin=99 * 1024)  # sm_89: 99 KiB opt-in per block


def shape(B=1, Sq=128, Sk=128, H=4, Hkv=4, D=64, Dv=None):
    return X.Shape(B, Sq, Sk, H, Hkv, D, D if Dv is None else Dv)


# ---- the constants are the kernels' ---------------------------------------------------------


def test_cpu_constants_match_the_header():
    c = kc.cpu_constants()
    assert (c["kBlockQ"], c["kBlockK"]) == (X.CPU_BLOCK_Q, X.CPU_BLOCK_K)
    # the split rule's shape in attention_fwd_kernel
    src = kc.source("csrc/cpu/attention_fwd.cpp")
    assert c["kDropoutSplitWorkers"] == X.CPU_DROPOUT_SPLIT_WORKERS
    assert "p.score_terms().has_dropout() ? kDropoutSplitWorkers : workers;" in src
    assert "if (plan.n_tiles < plan_workers && p.Sk >= 4 * kBlockK)" in src
    assert "n_split = std::min(ceil_div(2 * plan_workers, plan.n_tiles), p.Sk / (2 * kBlockK));" in src


def test_cuda_constants_match_the_headers():
    c = kc.launch_constants()
    assert c["simple.kMaxHeadDim"] == X.CUDA_SIMPLE_MAX_HEAD_DIM
    assert c["fa2.kBlockM"] == X.CUDA_FA2_BLOCK_M
    assert c["fa2.kMaxFastSeqLen"] == X.CUDA_FAST_MAX_SEQ_LEN
    launch = kc.source("csrc/cuda/attention_launch.h")
    for fn in ("fwd_fast_grid_ok", "bwd_fast_grid_ok"):
        body = kc.block(launch, r"inline\s+bool\s+" + fn + r"\s*\([^)]*\)\s*\{")
        assert "fast_lengths_ok(p)" in body, fn
    body = kc.block(launch, r"inline\s+bool\s+fast_lengths_ok\s*\([^)]*\)\s*\{")
    assert "p.Sq + p.Sk + shift < kMaxFastSeqLen" in body  # explain() calls have no shift
    assert kc.fwd_fast_head_dims() == X.CUDA_FWD_FAST_HEAD_DIMS
    terms_fn = kc.block(launch, r"constexpr\s+bool\s+fwd_fast_terms_head_dim\s*\([^)]*\)\s*\{")
    assert "return d != 256;" in terms_fn
    assert X.CUDA_FWD_FAST_TERMS_HEAD_DIMS == tuple(d for d in X.CUDA_FWD_FAST_HEAD_DIMS if d != 256)
    hd256 = kc.source("csrc/cuda/attention_fa2_hdim256.cu")
    assert "ATTN_EXT_INSTANTIATE_FA2_FWD_PLAIN(256)" in hd256
    assert kc.bwd_fast_head_dims() == X.CUDA_BWD_FAST_HEAD_DIMS
    fwd, bwd = kc.launch_function("fwd_smem_bytes"), kc.launch_function("bwd_smem_bytes")
    for d in range(8, 257, 8):
        assert X.cuda_fwd_smem_bytes(d) == kc.evaluate(fwd, {"head_dim": d}), d
        assert X.cuda_bwd_smem_bytes(d) == kc.evaluate(bwd, {"head_dim": d}), d
    cu = kc.source("csrc/cuda/attention.cu")
    split = kc.block(cu, r"SplitPlan\s+plan_split\s*\([^)]*\)\s*\{")
    m = re.search(r"p\.Sq\s*>\s*(\d+)\s*\|\|\s*p\.Sk\s*<\s*(\d+)", split)
    assert m and (int(m.group(1)), int(m.group(2))) == (X.CUDA_SPLIT_MAX_SQ, X.CUDA_SPLIT_MIN_SK)
    assert re.search(r"static_cast<int64_t>\(sms\)\s*\*\s*(\d+)", split).group(1) == str(X.CUDA_SPLIT_WARPS_PER_SM)
    assert "rows * 4 >= target" in split
    m = re.search(r"\(p\.Sk \+ (\d+)\) / (\d+)", split)
    assert m and int(m.group(2)) == X.CUDA_SPLIT_MIN_CHUNK == int(m.group(1)) + 1
    # the conditions explain restates, in the adapter's words
    fast_fwd = kc.block(cu, r"bool\s+use_fast_forward\s*\([^)]*\)\s*\{")
    for cond in ("dt != dtype::kHalf && dt != dtype::kBFloat16", "p.D != p.Dv || !cuda::fa2::fwd_fast_head_dim(p.D)",
                 "!aligned16(q) || !aligned16(k) || !aligned16(v)", "fwd_fast_grid_ok(p)",
                 "fwd_smem_bytes(p.D) > max_smem_optin", "force_simple()"):
        assert cond in fast_fwd, cond
    fast_bwd = kc.block(cu, r"bool\s+use_fast_backward\s*\([^)]*\)\s*\{")
    for cond in ("p.D != 64 && p.D != 128", "aligned16(dout)", "if (deterministic) return false;",
                 "bwd_smem_bytes(p.D) + cuda::fa2::bwd_terms_smem_bytes(p.score_terms()) >\n"
                 "      max_smem_optin", "force_simple()"):
        assert cond in fast_bwd, cond
    # score terms (issue 15): the fast forward has all (its terms instances, not at D = 256),
    # the fast backward all with dropout only at bwd_fast_dropout_head_dim (=
    # CUDA_BWD_DROPOUT_HEAD_DIMS); rel_bias and dropout add shared memory to the fast
    # backward; the split-KV plan does not look
    assert "has_dropout" not in fast_fwd
    assert "if (!p.terms.plain() && !cuda::fa2::fwd_fast_terms_head_dim(p.D)) return false;" in fast_fwd
    assert "if (!cuda::fa2::bwd_fast_terms_ok(p.score_terms(), p.D)) return false;" in fast_bwd
    launch_h = kc.source("csrc/cuda/attention_launch.h")
    terms_ok = kc.block(launch_h, r"inline\s+bool\s+bwd_fast_terms_ok\s*\([^)]*\)\s*\{")
    assert "return !t.has_dropout() || bwd_fast_dropout_head_dim(head_dim);" in terms_ok
    drop_dims = kc.block(launch_h, r"constexpr\s+bool\s+bwd_fast_dropout_head_dim\s*\([^)]*\)\s*\{")
    assert "return d == 64;" in drop_dims and X.CUDA_BWD_DROPOUT_HEAD_DIMS == (64,)
    rel_smem = kc.block(launch_h, r"inline\s+int64_t\s+bwd_terms_smem_bytes\s*\([^)]*\)\s*\{")
    assert ("return (t.has_dropout() ? 2 * 64 * 8 : 0) + (t.rel_bias == nullptr ? 0 : "
            "(2 * t.rel_max + 1) * 4);") in rel_smem
    assert "cuda::fa2::bwd_terms_smem_bytes(p.score_terms())" in fast_bwd
    launch = kc.block(launch_h, r"cudaError_t\s+launch_fa2_fwd_d\s*\([^)]*\)\s*\{")
    assert "has_dropout" not in launch
    assert "if (!p.terms.plain()) {" in launch and "fwd_fast_terms_head_dim(kHeadDim)" in launch
    assert "score_terms" not in split and "terms" not in split
    # the backward never sees the sinks (they reach it through lse), so they cannot turn the
    # fast backward off: the adapter passes no_sinks to the terms it fills
    bwd_fn = kc.block(cu, r"attention_backward_cuda\s*\(")
    assert "{tab.alibi_slopes, tab.rel_bias, softcap, no_sinks, dropout_p" in bwd_fn
    # the CPU decode kernel takes every term but dropout (sinks are not a condition: its
    # backward is not told them); explain's cpu_decode_plan mirrors that
    decode_fn = kc.block(kc.source("csrc/cpu/attention_decode.h"),
                         r"bool\s+decode_supported\s*\([^)]*\)\s*\{")
    assert "if (p.score_terms().has_dropout()) return false;" in decode_fn
    assert "active()" not in decode_fn
    assert "bool force_simple() { return g_kernel_mode.load(std::memory_order_relaxed) == 1; }" in cu
    assert f'm.impl("{X.FORCE_SIMPLE_OP}"' in cu


# ---- CPU: the answer is what the kernel did ---------------------------------------------------


@pytest.mark.parametrize("B,Sq,Sk,H,Hkv", [(1, 1, 1500, 1, 1), (1, 1, 1500, 8, 1), (2, 3, 1500, 2, 1),
                                           (1, 4, 700, 8, 2), (1, 1, 383, 1, 1), (1, 1, 384, 1, 1),
                                           (2, 100, 1500, 4, 4), (1, 200, 2000, 1, 1)])
@pytest.mark.parametrize("threads", [2, 4])
def test_cpu_explain_matches_the_kernel(B, Sq, Sk, H, Hkv, threads):
    q, k, v = randn(B, Sq, H, 32), randn(B, Sk, Hkv, 32), randn(B, Sk, Hkv, 32)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        choice = attn_ext.explain(q, k, v, causal=True)
    finally:
        torch.set_num_threads(prev)
    assert choice.device == "cpu" and choice.details["threads"] == threads
    observed = cpu_split_kv_ran(q, k, v, True, threads)
    if choice.forward == "cpu.decode":
        # the decode kernel (csrc/cpu/attention_decode.h) splits the keys into a number of
        # chunks that depends on the thread count: the result differs bitwise from the
        # one-thread result exactly when the chunk counts differ
        one = X.cpu_decode_plan(X.Shape(B, Sq, Sk, H, Hkv, 32, 32), torch.float32, 1)
        assert (one["n_chunks"] != choice.details["n_chunks"]) == observed, (str(choice), observed)
    else:
        assert (choice.forward == "cpu.split_kv") == observed, (str(choice), observed)
    assert choice.forward in ("cpu.split_kv", "cpu.tiled", "cpu.decode")
    assert choice.backward == "cpu.key_tiles"
    assert str(choice).startswith("attn_ext on cpu:") and choice.forward in str(choice)


def test_cpu_explain_reasons(monkeypatch):
    monkeypatch.setenv("ATTN_EXT_CPU_DECODE", "0")  # the tiled kernel's reasons (decode: below)
    one = X._explain_cpu(shape(Sq=1, Sk=1500, H=1, Hkv=1), torch.float32, 4)
    assert one.forward == "cpu.split_kv" and "1 query tile(s) < 4 threads" in one.forward_reason
    assert one.details["n_split"] == 7  # min(ceil(8 / 1), 1500 // 192)
    few_keys = X._explain_cpu(shape(Sq=1, Sk=100, H=1, Hkv=1), torch.float32, 4)
    assert few_keys.forward == "cpu.tiled" and "Sk = 100 < 384" in few_keys.forward_reason
    many = X._explain_cpu(shape(B=4, Sq=500), torch.bfloat16, 4)
    assert many.forward == "cpu.tiled" and ">= 4 threads" in many.forward_reason
    assert "float64 accumulation" in X._explain_cpu(shape(), torch.float64, 4).forward_reason


def test_cpu_explain_decode_reasons(monkeypatch):
    monkeypatch.delenv("ATTN_EXT_CPU_DECODE", raising=False)
    monkeypatch.delenv("ATTN_EXT_CPU_SIMD", raising=False)
    if not X.cpu_simd_enabled():
        pytest.skip("no AVX2/FMA/F16C: the decode kernel does not run")
    dec = X._explain_cpu(shape(B=1, Sq=1, Sk=1500, H=8, Hkv=2), torch.float32, 4)
    assert dec.forward == "cpu.decode" and "Sq * (H / Hkv) = 4 <= 16" in dec.forward_reason
    assert dec.details["n_chunks"] == 5  # min(ceil(4 threads * 4 / B = 1), 1500 // 256)
    assert X._explain_cpu(shape(B=1, Sq=1, Sk=1500, H=8, Hkv=2), torch.float64, 4).forward != "cpu.decode"
    assert X._explain_cpu(shape(B=1, Sq=3, Sk=1500, H=8, Hkv=1), torch.float32, 4).forward != "cpu.decode"
    monkeypatch.setenv("ATTN_EXT_CPU_DECODE", "0")
    assert X._explain_cpu(shape(B=1, Sq=1, Sk=1500, H=8, Hkv=2), torch.float32, 4).forward == "cpu.split_kv"


def test_explain_3d_empty_and_errors():
    q, k, v = randn(2, 5, 16), randn(2, 7, 16), randn(2, 7, 16)
    assert attn_ext.explain(q, k, v).forward == ("cpu.decode" if X.cpu_simd_enabled() else "cpu.tiled")
    empty = attn_ext.explain(q[:, :0], k, v)
    assert empty.forward == "none" and "no kernel" in empty.forward_reason
    q4, k4, v4 = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)
    with pytest.raises(ValueError, match=r"q must have 4 dims \(B, Sq, H, D\), got shape \[2, 5\]"):
        attn_ext.explain(q4[:, :, 0, 0], k4, v4)
    with pytest.raises(ValueError, match=r"k must have the same dtype as q"):
        attn_ext.explain(q4, k4.double(), v4)
    with pytest.raises(ValueError, match=r"k must have head dim D = 16 \(from q\)"):
        attn_ext.explain(q4, k4[..., :8], v4)
    with pytest.raises(ValueError, match=r"v must have Sk = 7 keys"):
        attn_ext.explain(q4, k4, v4[:, :3])
    with pytest.raises(ValueError, match=r"q must have a contiguous last dim \(stride 1\)"):
        attn_ext.explain(randn(2, 5, 1, 32)[..., ::2], k4, v4)
    with pytest.raises(ValueError, match="scale must be finite"):
        attn_ext.explain(q4, k4, v4, scale=float("inf"))
    with pytest.raises(TypeError):
        attn_ext.explain(q4, k4, v4, True)  # keyword-only


# ---- CUDA rules, on made-up devices -----------------------------------------------------------


def test_aligned16():
    x = torch.empty(2, 5, 4, 64, dtype=torch.bfloat16)
    assert X.aligned16(x) == (x.data_ptr() % 16 == 0)
    assert not X.aligned16(torch.empty(2 * 5 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 5, 4, 64))
    assert not X.aligned16(torch.empty(2, 5, 4, 68, dtype=torch.bfloat16)[..., :64])  # head stride 68


def test_cuda_forward_rules():
    fwd = X.cuda_forward_choice
    path, why, _ = fwd(shape(D=128), torch.bfloat16, True, **H200)
    assert path == "cuda.fa2" and "tensor-core" in why
    path, why, _ = fwd(shape(D=128), torch.float32, True, **H200)
    assert path == "cuda.simple" and "dtype float32" in why
    path, why, _ = fwd(shape(D=80), torch.float16, True, **H200)
    assert path == "cuda.simple" and "head dim 80 not in [32, 64, 96, 128, 256]" in why
    path, why, _ = fwd(shape(D=64, Dv=128), torch.float16, True, **H200)
    assert path == "cuda.simple" and "D = 64 != Dv = 128" in why
    path, why, _ = fwd(shape(), torch.float16, False, **H200)
    assert path == "cuda.simple" and "16-byte aligned" in why
    path, why, det = fwd(shape(D=256), torch.bfloat16, True, sms=100, smem_optin=48 * 1024)
    assert path == "cuda.simple" and "101376 bytes at D = 256" in why and det["smem_needed"] == 101376
    path, why, _ = fwd(shape(), torch.bfloat16, True, force_simple=True, **H200)
    assert path == "cuda.simple" and "_simple_cuda_kernels() is active" in why
    # several reasons at once are all given
    path, why, _ = fwd(shape(D=80), torch.float32, False, **H200)
    assert why.count(";") == 2


def test_cuda_split_rules():
    fwd = X.cuda_forward_choice
    path, why, det = fwd(shape(Sq=1, Sk=4096, H=4, Hkv=1, D=128), torch.bfloat16, True, **H200)
    # rows 4, target 132 * 16 = 2112: n = min(528, 32) = 32 chunks of 128
    assert path == "cuda.split_kv" and (det["n_split"], det["chunk"]) == (32, 128), why
    assert X.cuda_split_plan(shape(Sq=17, Sk=4096), 132)["n_split"] == 1  # Sq > 16
    assert X.cuda_split_plan(shape(Sq=1, Sk=511), 132)["n_split"] == 1  # Sk < 512
    assert X.cuda_split_plan(shape(B=8, Sq=16, Sk=4096, H=8), 132)["n_split"] == 1  # 1024 rows fill it
    assert X.cuda_split_plan(shape(Sq=1, Sk=4096), 132, force_simple=True)["n_split"] == 1
    # any dtype and head dim take the split path
    assert fwd(shape(Sq=2, Sk=1500, D=59), torch.float32, False, **H200)[0] == "cuda.split_kv"


def test_cuda_backward_rules():
    bwd = X.cuda_backward_choice
    path, why, _ = bwd(shape(D=128), torch.bfloat16, True, H200["smem_optin"], False)
    assert path == "cuda.fa2" and "if dout is 16-byte aligned too" in why
    assert bwd(shape(D=128), torch.bfloat16, True, H200["smem_optin"], False, dout_aligned=True)[0] == "cuda.fa2"
    path, why, _ = bwd(shape(D=128), torch.bfloat16, True, RTX4090["smem_optin"], False)
    assert path == "cuda.simple" and "158720 bytes at D = 128" in why
    path, why, _ = bwd(shape(D=64), torch.bfloat16, True, H200["smem_optin"], True)
    assert path == "cuda.simple" and "use_deterministic_algorithms" in why
    path, why, _ = bwd(shape(D=96), torch.bfloat16, True, H200["smem_optin"], False)
    assert path == "cuda.simple" and "head dim 96 not in [64, 128]" in why
    path, why, _ = bwd(shape(D=64), torch.bfloat16, True, H200["smem_optin"], False, dout_aligned=False)
    assert path == "cuda.simple" and "dout not 16-byte aligned" in why


def test_score_terms_rules():
    """Dropout turns the fast CUDA forward and backward off (the backward takes softcap, ALiBi
    and rel_bias, whose gradient needs shared memory; sinks reach it through lse); any term
    the CPU decode kernel; split-KV keeps them all."""
    assert X.score_terms_of() == ()
    assert X.score_terms_of(rel_bias=torch.zeros(1, 3), softcap=2.0, dropout_p=0.1) == (
        "rel_bias", "softcap", "dropout_p")
    assert X.score_terms_of(alibi_slopes=torch.ones(2), sinks=torch.zeros(2)) == ("alibi_slopes", "sinks")
    assert X.score_terms_of(dropout_p=0.0) == ()
    fwd, bwd = X.cuda_forward_choice, X.cuda_backward_choice
    path, why, _ = fwd(shape(D=128), torch.bfloat16, True, terms=("rel_bias", "softcap", "sinks"), **H200)
    assert path == "cuda.fa2" and "with the score terms rel_bias, softcap, sinks" in why
    path, why, _ = fwd(shape(D=64), torch.float16, True, terms=("sinks", "dropout_p"), **H200)
    assert path == "cuda.fa2" and "with the score terms sinks, dropout_p" in why
    path, why, _ = fwd(shape(D=256), torch.float16, True, terms=("dropout_p",), **H200)
    assert path == "cuda.simple" and "score terms at D = 256" in why
    path, why, det = fwd(shape(Sq=1, Sk=4096, H=4, Hkv=1, D=128), torch.bfloat16, True,
                         terms=("alibi_slopes",), **H200)
    assert path == "cuda.split_kv" and det["n_split"] == 32, why
    # the fast backward takes softcap, ALiBi and rel_bias (its gradient's (2M + 1) floats of
    # shared memory on top), and dropout at D = 64 (1 KiB of row keys on top); dropout at
    # D = 128 sends it to the simple kernels
    for ok in (("softcap",), ("alibi_slopes",), ("alibi_slopes", "softcap"), ("rel_bias",),
               ("alibi_slopes", "rel_bias", "softcap")):
        path, why, det = bwd(shape(D=128), torch.bfloat16, True, H200["smem_optin"], False,
                             dout_aligned=True, terms=ok, rel_max=128)
        assert path == "cuda.fa2", (ok, why)
        assert det["smem_needed"] == X.cuda_bwd_smem_bytes(128) + (257 * 4 if "rel_bias" in ok else 0)
    for drop in (("dropout_p",), ("softcap", "dropout_p"), ("rel_bias", "dropout_p")):
        path, why, det = bwd(shape(D=64), torch.float16, True, H200["smem_optin"], False,
                             dout_aligned=True, terms=drop, rel_max=10)
        assert path == "cuda.fa2", (drop, why)
        assert det["smem_needed"] == X.cuda_bwd_smem_bytes(64) + 1024 + (21 * 4 if "rel_bias" in drop else 0)
        path, why, _ = bwd(shape(D=128), torch.float16, True, H200["smem_optin"], False,
                           dout_aligned=True, terms=drop, rel_max=10)
        assert path == "cuda.simple" and "dropout_p at D = 128 (the fast backward's dropout" in why, (drop, why)
    # a table too large for shared memory: the simple kernels (at D = 128: 155 KiB + 4 (2M + 1))
    big = (H200["smem_optin"] - X.cuda_bwd_smem_bytes(128)) // 8 + 1
    path, why, _ = bwd(shape(D=128), torch.bfloat16, True, H200["smem_optin"], False,
                       dout_aligned=True, terms=("rel_bias",), rel_max=big)
    assert path == "cuda.simple" and f"with d rel_bias's {2 * big + 1} entries" in why, why
    assert bwd(shape(D=128), torch.bfloat16, True, H200["smem_optin"], False, dout_aligned=True,
               terms=())[0] == "cuda.fa2"
    # CPU: the decode kernel takes every term but dropout
    s = shape(B=1, Sq=1, Sk=1500, H=8, Hkv=2)
    for terms in (("sinks",), ("rel_bias",), ("alibi_slopes", "softcap", "sinks")):
        assert (X.cpu_decode_plan(s, torch.float32, 4, terms) is not None) == X.cpu_simd_enabled()
    assert X.cpu_decode_plan(s, torch.float32, 4, ("sinks", "dropout_p")) is None
    with_dropout = X._explain_cpu(s, torch.float32, 4, ("rel_bias", "dropout_p"))
    assert with_dropout.forward == "cpu.split_kv", str(with_dropout)
    q, k, v = randn(1, 1, 8, 32), randn(1, 1500, 2, 32), randn(1, 1500, 2, 32)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        choice = attn_ext.explain(q, k, v, causal=True, sinks=torch.zeros(8))
    finally:
        torch.set_num_threads(prev)
    assert (choice.forward == "cpu.decode") == X.cpu_simd_enabled(), str(choice)
    assert choice.forward == X._explain_cpu(s, torch.float32, 2, ("sinks",)).forward


def test_explain_takes_every_keyword_of_attention():
    """A call to attention can be mirrored into explain as it is (issue 18 item 6): every
    keyword of attn_ext.attention is a keyword of explain; the masks and return_lse do not
    change the choice, are checked as attention checks them, and are listed in details."""
    import inspect

    att = {n for n, p in inspect.signature(attn_ext.attention).parameters.items()
           if p.kind is inspect.Parameter.KEYWORD_ONLY}
    exp = set(inspect.signature(attn_ext.explain).parameters)
    assert att <= exp, f"explain lacks {sorted(att - exp)}"
    q = randn(1, 64, 4, 64)
    kpm = torch.ones(1, 64, dtype=torch.bool)
    kpm[0, 50:] = False
    plain = attn_ext.explain(q, q, q, causal=True)
    masked = attn_ext.explain(q, q, q, causal=True, window=(8, 0), key_padding_mask=kpm,
                              return_lse=True)
    assert (masked.forward, masked.backward) == (plain.forward, plain.backward)
    assert masked.details["masks"] == ("causal", "window", "key_padding_mask")
    assert masked.details["return_lse"] is True and plain.details["masks"] == ("causal",)
    with pytest.raises(ValueError, match="window must be"):
        attn_ext.explain(q, q, q, window=(-3, 0))
    with pytest.raises(ValueError, match="key_padding_mask must be bool"):
        attn_ext.explain(q, q, q, key_padding_mask=kpm.float())
    with pytest.raises(ValueError, match="key_padding_mask must be bool"):
        attn_ext.explain(q, q, q, key_padding_mask=torch.ones(2, 64, dtype=torch.bool))


_BAD_CALLS = {
    "softcap": dict(softcap=-1.0),
    "softcap_zero": dict(softcap=0.0),
    "softcap_nan": dict(softcap=float("nan")),
    "dropout_p": dict(dropout_p=1.0),
    "dropout_p_negative": dict(dropout_p=-0.1),
    "alibi_slopes": dict(alibi_slopes=torch.ones(3)),
    "alibi_slopes_grad": dict(alibi_slopes=torch.ones(4, requires_grad=True)),
    "rel_bias": dict(rel_bias=torch.zeros(4, 6)),
    "sinks": dict(sinks=torch.zeros(3)),
    "window": dict(window=(2,)),
    "scale": dict(scale=float("nan")),
    "scale_bool": dict(scale=True),
    "scale_str": dict(scale="a"),
    "causal": dict(causal=None),
    "return_lse": dict(return_lse="yes"),  # (explain took any value)
    # (explain checked the mask's dtype and shape, not its device)
    "key_padding_mask": dict(key_padding_mask=torch.ones(2, 6, dtype=torch.bool, device="meta")),
}


@pytest.mark.parametrize("name", sorted(_BAD_CALLS))
def test_explain_refuses_what_attention_refuses(name):
    """explain runs no kernel, but it refuses each call attention refuses, naming the same
    argument (it used to describe a kernel for softcap <= 0, dropout_p = 1, tables of the
    wrong shape and ALiBi slopes that require grad)."""
    kw = _BAD_CALLS[name]
    arg = next(iter(kw))
    q = randn(2, 6, 4, 16)
    k = randn(2, 6, 2, 16)
    for fn in (attn_ext.attention, attn_ext.explain):
        with pytest.raises((ValueError, RuntimeError), match=arg):
            fn(q, k, k, **kw)
    if arg in ("scale", "causal", "key_padding_mask"):  # the need_weights path refuses them alike
        with pytest.raises((ValueError, RuntimeError), match=arg):
            attn_ext.attention_weights(q, k, **kw)


@pytest.mark.parametrize("window", [None, (100, 0), (1200, 0)])
def test_cpu_explain_decode_chunks_follow_the_window(window):
    """The decode kernel splits only the keys some row sees by the band (4 units per thread,
    at least 256 keys each): 4096 keys give 8 chunks at 2 threads and 4 at 1, a window of
    101 keys 1 and 1, of 1201 keys 4 and 4. explain says the same; observed bitwise: the
    2-thread result equals the 1-thread one exactly when the chunk counts are equal."""
    if not X.cpu_simd_enabled():
        pytest.skip("the decode kernel needs AVX2")
    q, k, v = randn(1, 1, 4, 64), randn(1, 4096, 4, 64), randn(1, 4096, 4, 64)
    prev = torch.get_num_threads()
    try:
        got = {}
        for threads in (2, 1):
            torch.set_num_threads(threads)
            choice = attn_ext.explain(q, k, v, causal=True, window=window)
            assert choice.forward == "cpu.decode"
            assert f"{choice.details['n_chunks']} chunk(s)" in choice.forward_reason
            got[threads] = (choice.details["n_chunks"],
                            attn_ext.attention(q, k, v, causal=True, window=window))
    finally:
        torch.set_num_threads(prev)
    want = {None: (8, 4), (100, 0): (1, 1), (1200, 0): (4, 4)}[window]
    assert (got[2][0], got[1][0]) == want
    assert torch.equal(got[2][1], got[1][1]) == (want[0] == want[1])


def test_explain_on_meta_tensors_names_no_kernel():
    """attention takes meta tensors (its fake kernels give the shapes); explain said "attn_ext
    has kernels for cpu and cuda" and refused them. Bad meta arguments are still refused."""
    q = torch.empty(2, 6, 4, 16, device="meta")
    k = torch.empty(2, 6, 2, 16, device="meta")
    assert attn_ext.attention(q, k, k, causal=True).shape == (2, 6, 4, 16)
    choice = attn_ext.explain(q, k, k, causal=True)
    assert (choice.device, choice.forward, choice.backward) == ("meta", "none", "none")
    with pytest.raises(ValueError, match="softcap"):
        attn_ext.explain(q, k, k, softcap=-1.0)


def test_explain_refuses_non_tensors_like_attention():
    q = randn(1, 4, 2, 8)
    for fn in (attn_ext.attention, attn_ext.explain):
        with pytest.raises(TypeError, match="q must be a torch.Tensor"):
            fn([1.0], q, q)  # explain used to raise AttributeError
        with pytest.raises(TypeError, match="v must be a torch.Tensor"):
            fn(q, q, None)
    with pytest.raises(TypeError, match="dout must be a torch.Tensor"):
        attn_ext.explain(q, q, q, dout=[1.0])
    good = dict(softcap=30.0, dropout_p=0.1, alibi_slopes=torch.ones(1, 2),
                rel_bias=torch.zeros(2, 5, dtype=torch.float64), sinks=torch.zeros(2))
    assert set(attn_ext.explain(q, q, q, **good).details["score_terms"]) >= set(good)


def test_explain_names_the_bf16_decode_scores(monkeypatch):
    """details["bf16_scores"] of a bf16 decode: "amx" where the CPU has AMX (D a multiple of
    32; not ATTN_EXT_CPU_BF16DP=0), else "vdpbf16ps" where the CPU has AVX512_BF16 and
    ATTN_EXT_CPU_BF16DP=1, or by default on a CPU that is not Intel's (the tiled kernels' rule,
    mk::bf16dp_tiled_enabled), else "widened"; None for other dtypes. It agrees with what
    runs: the default's lse is the widened path's bits exactly when it says widened, else the
    pairs' (the two differ by rounding)."""
    from attn_ext._explain import cpu_amx_enabled, cpu_avx512bf16_enabled, cpu_vendor
    torch.manual_seed(0)
    intel = cpu_vendor() == "GenuineIntel"
    q = torch.randn(1, 1, 32, 128).bfloat16()
    k, v = torch.randn(1, 4096, 8, 128).bfloat16(), torch.randn(1, 4096, 8, 128).bfloat16()
    said, lse = {}, {}
    for mode in ("1", "0", None):
        if mode is None:
            monkeypatch.delenv("ATTN_EXT_CPU_BF16DP", raising=False)
        else:
            monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", mode)
        choice = attn_ext.explain(q, k, v)
        assert choice.forward == "cpu.decode"
        said[mode] = choice.details["bf16_scores"]
        assert ("vdpbf16ps" in str(choice)) == (said[mode] == "vdpbf16ps")
        lse[mode] = attn_ext.attention(q, k, v, return_lse=True)[1]
    assert said["0"] == "widened"
    # (D = 128: on a CPU with AMX the decode's scores are on tiles unless ATTN_EXT_CPU_BF16DP=0)
    assert said["1"] == ("amx" if cpu_amx_enabled() else
                         "vdpbf16ps" if cpu_avx512bf16_enabled() else "widened")
    assert said[None] == ("amx" if cpu_amx_enabled() else
                          "vdpbf16ps" if cpu_avx512bf16_enabled() and not intel else "widened")
    assert torch.equal(lse["1"], lse["0"]) == (said["1"] == "widened")
    assert torch.equal(lse[None], lse["0"]) == (said[None] == "widened")
    assert torch.equal(lse[None], lse["1"]) == (said[None] == said["1"])
    assert attn_ext.explain(q.float(), k.float(), v.float()).details["bf16_scores"] is None
    # the tiled kernels (csrc/cpu/attention_bf16dp.cpp): even head dims only; by default
    # (no switch) not on an Intel CPU (mk::bf16dp_tiled_enabled)
    for D in (64, 59):
        qq = torch.randn(1, 300, 4, D).bfloat16()
        kk = torch.randn(1, 300, 2, D).bfloat16()
        for mode in ("1", "0", None):
            if mode is None:
                monkeypatch.delenv("ATTN_EXT_CPU_BF16DP", raising=False)
            else:
                monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", mode)
            choice = attn_ext.explain(qq, kk, kk, causal=True)
            assert choice.forward == "cpu.tiled"
            on = mode == "1" or (mode is None and not intel)
            want = "vdpbf16ps" if (on and D % 2 == 0 and cpu_avx512bf16_enabled()) else "widened"
            if mode != "0" and D % 32 == 0 and cpu_amx_enabled():
                want = "amx"  # AMX tiles where the CPU has them (csrc/cpu/attention_amx.cpp)
            assert choice.details["bf16_scores"] == want
            assert ("vdpbf16ps" in str(choice)) == (want == "vdpbf16ps")
            assert ("AMX tiles" in str(choice)) == (want == "amx")
            # and it agrees with what runs: lse equals the widened path's bits exactly when
            # it says widened (the pairs sum in another order)
            if D == 64:
                got = attn_ext.attention(qq, kk, kk, causal=True, return_lse=True)[1]
                monkeypatch.setenv("ATTN_EXT_CPU_BF16DP", "0")
                widened = attn_ext.attention(qq, kk, kk, causal=True, return_lse=True)[1]
                assert torch.equal(got, widened) == (want == "widened")


def test_explain_names_the_fp32_gemm(monkeypatch):
    """details["gemm"] of the tiled kernels: "portable" for float64, "avx2" with
    ATTN_EXT_CPU_GEMM512=0 (on an AVX2 CPU), and "avx512" by default where the CPU has AVX-512F/BW
    (csrc/cpu/attention_microkernels.h kernels(); the two give the same bits: test_gemm512.py)."""
    from attn_ext._explain import cpu_avx512_enabled, cpu_simd_enabled

    q = torch.randn(1, 200, 2, 64)
    assert attn_ext.explain(q.double(), q.double(), q.double()).details["gemm"] == "portable"
    monkeypatch.setenv("ATTN_EXT_CPU_GEMM512", "0")
    choice = attn_ext.explain(q, q, q, causal=True)
    assert choice.details["gemm"] == ("avx2" if cpu_simd_enabled() else "portable")
    assert "zmm" not in choice.forward_reason
    monkeypatch.delenv("ATTN_EXT_CPU_GEMM512")
    choice = attn_ext.explain(q, q, q, causal=True)
    if cpu_avx512_enabled():
        assert choice.details["gemm"] == "avx512"
        assert "AVX-512 zmm" in choice.forward_reason


def test_explain_cuda_without_the_cuda_library(monkeypatch):
    """A CUDA q in a process without attn_ext's CUDA kernels (a CPU-only build, or a torch
    whose CUDA the build does not match): attention() fails in the dispatcher, so explain()
    refuses too, quoting why the kernels are not loaded, instead of naming a CUDA kernel. (The
    CUDA branch is called directly: this machine has no CUDA tensors.)"""
    from attn_ext import _explain, ops

    monkeypatch.setattr(ops, "_cuda_library_loaded", lambda: False)
    q = randn(1, 4, 2, 16)
    s = _explain._check(q, q, q)
    with pytest.raises(ValueError, match="CUDA kernels are not loaded in this process: "):
        _explain._explain_cuda(s, q, q, q, None)


def test_band_keys_is_the_masks_seen_columns():
    """band_keys (O(1); the decode plan used to build the (Sq, Sk) mask, gigabytes at a long
    decode) counts the keys some row sees, as reference.visibility_mask's columns with a True."""
    from attn_ext.reference import visibility_mask
    for sq in (0, 1, 2, 5, 9):
        for sk in (0, 1, 3, 8, 13):
            for causal in (False, True):
                for window in ((-1, -1), (0, 0), (2, -1), (-1, 1), (3, 0), (0, 4), (6, 2), (1, 1)):
                    mask = visibility_mask(sq, sk, causal, window)
                    want = int(mask.any(0).sum()) if sq and sk else 0
                    assert X.band_keys(sq, sk, causal, window) == want, (sq, sk, causal, window)


def test_decode_switch_is_read_per_call_as_explain_reads_it(monkeypatch):
    """ATTN_EXT_CPU_DECODE=0 set after the first call turns the decode kernel off for the next
    call, as explain says (the C++ read it once per process: explain named the tiled kernel
    while the decode kernel still ran). The decode and the tiled kernel give different bits
    on these random inputs; clearing the switch gives the decode's bits back."""
    if not X.cpu_simd_enabled():
        pytest.skip("the decode kernel needs AVX2")
    q, k, v = randn(1, 1, 1, 64), randn(1, 1500, 1, 64), randn(1, 1500, 1, 64)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.delenv("ATTN_EXT_CPU_DECODE", raising=False)
        assert attn_ext.explain(q, k, v).forward == "cpu.decode"
        decode = attn_ext.attention(q, k, v)
        monkeypatch.setenv("ATTN_EXT_CPU_DECODE", "0")
        assert attn_ext.explain(q, k, v).forward == "cpu.tiled"
        tiled = attn_ext.attention(q, k, v)
        monkeypatch.delenv("ATTN_EXT_CPU_DECODE")
        again = attn_ext.attention(q, k, v)
    finally:
        torch.set_num_threads(prev)
    assert not torch.equal(decode, tiled)
    assert torch.equal(decode, again)
    torch.testing.assert_close(decode, tiled, rtol=1e-5, atol=1e-5)
