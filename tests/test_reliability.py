"""Determinism, thread counts, concurrent callers and 64-bit indexing.

* Bitwise determinism: for a fixed thread count the same inputs give the same bits, for
  every op, forward and backward (test_attention.py covers one fp32 causal case; here:
  bf16, GQA, non-causal, the split-KV decode path, RoPE and sinusoidal).
* 1 vs 2 threads agree within the tolerance rule (RoPE and sinusoidal with positions
  bitwise: they have no reductions).
* 4 Python threads calling the ops at once on different tensors get the results a single
  caller gets.
* Tensors past 2^31 elements: the kernels index with int64 (element offsets > 2^31 in a
  strided view, cheap; a dense RoPE over > 2^31 elements, 4.3 GB, ~5 s).
"""

import os
import threading

import pytest
import torch

import attn_ext
from attn_ext import reference as R
from tests.test_attention import assert_close_low, run_ref
from tests.utils import assert_close_rule, assert_lse_fp32, max_err, randn


class _threads:
    """``with _threads(n):`` runs the block with torch.set_num_threads(n)."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.old = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.old)


def _attention_all(q, k, v, causal, dout):
    q, k, v = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = attn_ext.attention(q, k, v, causal=causal, return_lse=True)
    out.backward(dout)
    return [out.detach(), lse, q.grad, k.grad, v.grad]


# (B, Sq, Sk, H, Hkv, D, Dv, dtype, causal)
ATTN_CASES = [
    pytest.param((2, 70, 70, 4, 1, 64, 64, torch.bfloat16, True), id="bf16-mqa-causal"),
    pytest.param((1, 33, 90, 6, 3, 40, 24, torch.float32, False), id="fp32-gqa-dv"),
    pytest.param((1, 1, 3000, 8, 2, 64, 64, torch.float32, True), id="decode-split-kv"),
    pytest.param((1, 130, 130, 2, 2, 128, 128, torch.float16, True), id="fp16-multi-tile"),
]


def _attn_inputs(case):
    B, Sq, Sk, H, Hkv, D, Dv, dtype, causal = case
    return (randn(B, Sq, H, D, dtype=dtype), randn(B, Sk, Hkv, D, dtype=dtype),
            randn(B, Sk, Hkv, Dv, dtype=dtype), causal, randn(B, Sq, H, Dv, dtype=dtype))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", ATTN_CASES)
def test_attention_bitwise_deterministic(case, threads):
    args = _attn_inputs(case)
    with _threads(threads):
        runs = [_attention_all(*args) for _ in range(3)]
    for name, *vals in zip(["out", "lse", "dq", "dk", "dv"], *runs):
        for other in vals[1:]:
            assert torch.equal(vals[0], other), f"{name} differs between runs"


@pytest.mark.parametrize("case", ATTN_CASES)
def test_attention_one_vs_two_threads(case):
    q, k, v, causal, dout = _attn_inputs(case)
    with _threads(1):
        one = _attention_all(q, k, v, causal, dout)
    with _threads(2):
        two = _attention_all(q, k, v, causal, dout)
    # Both are judged against reference.py (float64, and in the inputs' dtype for the rule's
    # low-precision error) and against each other: they may differ only by rounding of fp32
    # accumulations. (The rule's references used to be attn_ext itself: a kernel 30 % off
    # passed.)
    ref = run_ref(q, k, v, causal, dout, torch.float64)
    low = run_ref(q, k, v, causal, dout, q.dtype)
    for i, name in enumerate(["out", "lse", "dq", "dk", "dv"]):
        scale = float(ref[i][torch.isfinite(ref[i])].abs().max())
        assert max_err(one[i], two[i]) <= 1e-5 * max(1.0, scale) + (
            2 * torch.finfo(q.dtype).eps * max(1.0, scale) if q.dtype != torch.float32 else 0), name
        assert_close_low(one[i], ref[i], low[i], name)
        assert_close_low(two[i], ref[i], low[i], name)
    assert_lse_fp32(one[1], ref[1], q.dtype)
    assert_lse_fp32(two[1], ref[1], q.dtype)


def _pos_enc_all(x, cos, sin, pos, xs, spos):
    """Every positional-encoding op on one set of inputs, forward and backward."""
    xg = x.detach().requires_grad_()
    r = attn_ext.rope(xg, cos, sin, pos, 0, True)
    r.backward(torch.ones_like(r) * 0.5 + x.detach())
    y = x.clone()
    attn_ext.rope_(y, cos, sin, None, 3, False)
    q2, k2 = x.clone(), x[:, :, :1].clone()
    attn_ext.rope_qk(q2, k2, cos, sin, pos, inplace=True)
    s = attn_ext.sinusoidal_pe(xs, spos, 0, 10000.0)
    s2 = xs.clone()
    attn_ext.sinusoidal_pe_(s2, None, 123_456, 500.0)
    return [r.detach(), xg.grad, y, q2, k2, s, s2]


def _pos_enc_inputs(dtype):
    x = randn(3, 257, 6, 96, dtype=dtype)
    cos, sin = attn_ext.rope_cache(300, 64)
    pos = torch.randint(0, 300, (3, 257))
    xs = randn(3, 257, 130, dtype=dtype)
    spos = torch.randint(-10**6, 10**6, (3, 257))
    return x, cos, sin, pos, xs, spos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pos_enc_bitwise_across_runs_and_threads(dtype):
    """For a fixed thread count every positional-encoding op is bitwise deterministic.
    Across 1, 2 and all threads RoPE and sinusoidal-with-positions are bitwise equal (pure
    element-wise); sinusoidal with ``offset`` builds rows by angle-addition steps from
    restarts that depend on each thread's chunk, so it agrees by the tolerance rule."""
    args = _pos_enc_inputs(dtype)
    xs = args[4]
    ref64 = R.sinusoidal_pe(xs.double(), None, 123_456, 500.0)
    ref_low = R.sinusoidal_pe(xs, None, 123_456, 500.0)
    with _threads(1):
        base = _pos_enc_all(*args)
    for n in (1, 2, torch.get_num_threads()):
        with _threads(n):
            first = _pos_enc_all(*args)
            again = _pos_enc_all(*args)
        for i, (a, b, c) in enumerate(zip(base, first, again)):
            assert torch.equal(b, c), f"output {i} differs between runs with {n} threads"
            if i == 6:  # sinusoidal_pe_ with offset
                assert_close_rule(b, ref64, ref_low, f"sinusoidal offset, {n} threads")
            else:
                assert torch.equal(a, b), f"output {i} differs between 1 and {n} threads"


def test_concurrent_python_threads():
    """4 Python threads call every op at once on their own tensors; each gets the result a
    lone caller gets (bitwise), and no call fails."""
    torch.manual_seed(1234)
    jobs = []
    for j in range(4):
        dtype = [torch.float32, torch.bfloat16, torch.float16, torch.float64][j]
        attn = _attn_inputs((1, 50 + j, 60 + 3 * j, 4, 2, 32, 32, dtype, j % 2 == 0))
        pe = _pos_enc_inputs(dtype)
        jobs.append((attn, pe))
    expected = [(_attention_all(*a), _pos_enc_all(*p)) for a, p in jobs]
    errors, results = [], [None] * 4
    start = threading.Barrier(4)

    def work(j):
        try:
            start.wait()
            got = []
            for _ in range(5):
                got.append((_attention_all(*jobs[j][0]), _pos_enc_all(*jobs[j][1])))
            results[j] = got
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(j,)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    for j in range(4):
        for attn_res, pe_res in results[j]:
            for a, b in zip(attn_res + pe_res, expected[j][0] + expected[j][1]):
                assert torch.equal(a, b), f"thread {j}: result differs from a lone caller"


# ---------------------------------------------------------------------------------------
# 64-bit indexing: element offsets past 2^31
# ---------------------------------------------------------------------------------------

BIG = 2**31 + 2**20  # elements of the backing storage (fp16: 4.3 GB virtual, barely touched)


def _big_storage(dtype=torch.float16):
    try:
        return torch.empty(BIG, dtype=dtype)  # pages are only touched where we write
    except RuntimeError as e:  # pragma: no cover
        pytest.skip(f"cannot reserve {BIG} elements: {e}")


def test_rope_strided_offsets_past_2_31():
    """A (B=2, S=3, H=2, D=64) view whose batch stride is 2^31 - 64 elements: batch 1 lives
    past element 2^31 of the storage. In place and out of place match the reference, and
    nothing between the rows is written."""
    buf = _big_storage()
    shape, strides = (2, 3, 2, 64), (2**31 - 64, 1000, 128, 1)
    x = buf.as_strided(shape, strides)
    guard = buf.as_strided(shape, strides, 64)  # the gap after each head
    guard.fill_(7.0)
    vals = randn(*shape, dtype=torch.float16)
    x.copy_(vals)
    cos, sin = attn_ext.rope_cache(10, 48)
    pos = torch.tensor([[0, 9, 4], [8, 1, 5]])
    ref64 = R.rope(vals.double(), cos.double(), sin.double(), pos, 0, False)
    ref_low = R.rope(vals, cos, sin, pos, 0, False)
    assert_close_rule(attn_ext.rope(x, cos, sin, pos), ref64, ref_low, "rope")
    attn_ext.rope_(x, cos, sin, pos)
    assert_close_rule(x.clone(), ref64, ref_low, "rope_")
    assert torch.all(guard == 7.0)


def test_attention_strided_offsets_past_2_31():
    """q, k, v views of one big storage whose second batch (q) and all of k, v start past
    element 2^31: values and gradients match the reference."""
    buf = _big_storage()
    B, Sq, Sk, H, Hkv, D = 2, 5, 7, 2, 1, 32
    q = buf.as_strided((B, Sq, H, D), (2**31 - 256, H * D, D, 1))
    k = buf.as_strided((B, Sk, Hkv, D), (Sk * D, D, D, 1), 2**31 + 4096)
    v = buf.as_strided((B, Sk, Hkv, D), (Sk * D, D, D, 1), 2**31 + 65536)
    vals = [randn(*t.shape, dtype=torch.float16) for t in (q, k, v)]
    for t, val in zip((q, k, v), vals):
        t.copy_(val)
    dout = randn(B, Sq, H, D, dtype=torch.float16)
    ours = _attention_all(q, k, v, True, dout)
    ref64 = run_ref(*vals, True, dout, torch.float64)  # reference.py, not attn_ext in float64
    ref_low = run_ref(*vals, True, dout, torch.float16)
    for name, a, r, lo in zip(["out", "lse", "dq", "dk", "dv"], ours, ref64, ref_low):
        assert_close_low(a, r, lo, name)
    assert_lse_fp32(ours[1], ref64[1], torch.float16)


def test_sinusoidal_strided_offsets_past_2_31():
    buf = _big_storage()
    x = buf.as_strided((2, 4, 40), (2**31 - 100, 200, 1))
    vals = randn(2, 4, 40, dtype=torch.float16)
    x.copy_(vals)
    ref64 = R.sinusoidal_pe(vals.double(), offset=77)
    ref_low = R.sinusoidal_pe(vals, offset=77)
    assert_close_rule(attn_ext.sinusoidal_pe(x, offset=77), ref64, ref_low)
    attn_ext.sinusoidal_pe_(x, offset=77)
    assert_close_rule(x.clone(), ref64, ref_low)


def available_memory_bytes(meminfo="/proc/meminfo", cgroup_root="/sys/fs/cgroup"):
    """Memory this process can still allocate: /proc/meminfo's MemAvailable, capped by the
    cgroup's limit minus its usage (a container's limit is not in /proc/meminfo). None when
    neither can be read (not Linux)."""
    avail = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file, usage_file in (("memory.max", "memory.current"),  # cgroup v2
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            with open(os.path.join(cgroup_root, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(cgroup_root, usage_file)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" / a huge number: no limit
            room = max(int(limit) - usage, 0)
            avail = room if avail is None else min(avail, room)
    return avail


def require_memory(nbytes, **where):
    """Skip (with the numbers) unless ``nbytes`` can be allocated without risking the OOM
    killer, which would end the whole test run instead of this test."""
    avail = available_memory_bytes(**where)
    if avail is None:
        pytest.skip(f"needs {nbytes / 2**30:.1f} GiB; available memory unknown")
    if avail < nbytes:
        pytest.skip(f"needs {nbytes / 2**30:.1f} GiB, only {avail / 2**30:.1f} GiB available")


def test_require_memory_skips_on_a_small_machine(tmp_path):
    """The guard of the dense test below: a 2 GiB machine (fake /proc/meminfo), or a 3 GiB
    cgroup limit on a big one, skips it with the reason instead of letting it run."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  4194304 kB\nMemAvailable:  2097152 kB\n")
    with pytest.raises(pytest.skip.Exception, match=r"needs 5.0 GiB, only 2.0 GiB available"):
        require_memory(5 * 2**30, meminfo=str(meminfo), cgroup_root=str(tmp_path / "none"))
    meminfo.write_text("MemAvailable:  67108864 kB\n")  # 64 GiB free on the host ...
    (tmp_path / "memory.max").write_text(str(4 * 2**30))  # ... but a 4 GiB container
    (tmp_path / "memory.current").write_text(str(2**30))
    assert available_memory_bytes(str(meminfo), str(tmp_path)) == 3 * 2**30
    with pytest.raises(pytest.skip.Exception, match=r"only 3.0 GiB available"):
        require_memory(5 * 2**30, meminfo=str(meminfo), cgroup_root=str(tmp_path))
    (tmp_path / "memory.max").write_text("max")
    require_memory(5 * 2**30, meminfo=str(meminfo), cgroup_root=str(tmp_path))  # no skip


def test_rope_dense_more_than_2_31_elements():
    """In-place RoPE over a dense bfloat16 (1, S, H, D) tensor of more than 2^31 elements
    (4.3 GB): rows far into the tensor (element offsets > 2^31) match the reference and
    the untouched channels keep their values. Skipped where that memory is not available."""
    S, H, D = 16400, 1024, 128  # 2_149_580_800 elements > 2^31
    require_memory(S * H * D * 2 + 2**30)  # the tensor + 1 GiB for everything else
    try:
        x = torch.empty(1, S, H, D, dtype=torch.bfloat16)
    except RuntimeError as e:  # pragma: no cover
        pytest.skip(f"cannot allocate {S * H * D} elements: {e}")
    x.fill_(0.5)
    rows = [0, 8191, 16383, S - 1]
    vals = randn(1, len(rows), H, D, dtype=torch.bfloat16)
    x[:, rows] = vals
    cos, sin = attn_ext.rope_cache(S, 96)
    attn_ext.rope_(x, cos, sin)
    pos = torch.tensor(rows)
    ref64 = R.rope(vals.double(), cos.double(), sin.double(), pos)
    ref_low = R.rope(vals, cos, sin, pos)
    assert_close_rule(x[:, rows].clone(), ref64, ref_low, "far rows")
    assert torch.all(x[0, S - 2, :, 96:] == 0.5)


@pytest.mark.skipif(os.environ.get("ATTN_EXT_EXPECT_ASAN") != "1", reason="only under make asan")
def test_asan_build_in_use():
    """make asan really tests the sanitized library (build/asan), with ASan loaded."""
    path = attn_ext._C.__file__
    assert "build/asan" in path, path
    with open("/proc/self/maps") as f:
        assert "libasan" in f.read()
    with open(path, "rb") as f:
        assert b"__asan_report_load" in f.read()  # the library itself is instrumented
