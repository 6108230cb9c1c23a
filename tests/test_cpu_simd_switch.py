"""ATTN_EXT_CPU_SIMD=0 (the one CPU-feature switch, csrc/cpu/cpu_features.cpp) governs the
attention kernels too, not only RoPE / sinusoidal (issue 18, item 11): in a process with the
switch off the attention forward and backward take the portable micro-kernels, whose rounding
differs from the AVX2 ones (another exp2), and both agree with the float64 reference."""

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import sys, torch
import attn_ext
from attn_ext import reference as ref
torch.manual_seed(0)
q = torch.randn(2, 70, 4, 64); k = torch.randn(2, 90, 2, 64); v = torch.randn(2, 90, 2, 64)
q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
out = attn_ext.attention(q, k, v, causal=True)
out.backward(torch.ones_like(out))
kr, vr = (t.detach().double().repeat_interleave(2, dim=2) for t in (k, v))
err = (out.double() - ref.attention(q.detach().double(), kr, vr, causal=True)).abs().max().item()
assert err < 1e-5, err
torch.save([out.detach(), q.grad, k.grad, v.grad], sys.argv[1])
print("ok", err)
"""


def _cpu_has_avx2():
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return all(f in flags.split() for f in ("avx2", "fma", "f16c"))


@pytest.mark.skipif(not _cpu_has_avx2(), reason="needs an AVX2/FMA/F16C CPU (else both paths are portable)")
def test_cpu_simd_switch_governs_attention(tmp_path):
    results = {}
    for simd in ("auto", "0"):
        env = dict(os.environ)
        env.pop("ATTN_EXT_CPU_SIMD", None)
        if simd == "0":
            env["ATTN_EXT_CPU_SIMD"] = "0"
        path = str(tmp_path / f"{simd}.pt")
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, path], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]
        results[simd] = torch.load(path)
    # Same inputs, different micro-kernels: the results must not be bitwise identical (on
    # the pre-fix code the switch did not reach attention and they were).
    assert not all(torch.equal(a, b) for a, b in zip(results["auto"], results["0"]))
    for a, b in zip(results["auto"], results["0"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


_PORTABLE_CHECK = r"""
import torch
import attn_ext
from attn_ext import _explain
from tests.test_attention import check
assert not _explain.cpu_simd_enabled()
torch.manual_seed(0)
n = 0
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for B, Sq, Sk, H, Hkv, D, Dv in ((2, 17, 17, 4, 4, 64, 64), (1, 1, 97, 4, 2, 64, 64),
                                      (1, 33, 70, 4, 2, 40, 24), (1, 130, 250, 2, 1, 64, 48)):
        for causal in (False, True):
            q = torch.randn(B, Sq, H, D).to(dtype)
            k, v = torch.randn(B, Sk, Hkv, D).to(dtype), torch.randn(B, Sk, Hkv, Dv).to(dtype)
            check(q, k, v, causal)
            n += 1
print("ok", n)
"""


def test_portable_path_against_the_reference(tmp_path):
    """The portable kernels (ATTN_EXT_CPU_SIMD=0: every CPU without AVX2) against
    reference.py by tests/test_attention.check, as the SIMD paths are: out, lse and every
    gradient, fp32 / bf16 / fp16, decode, GQA, Dv != D and multi-tile shapes (the switch test
    above compares only fp32 out with the reference)."""
    env = dict(os.environ, ATTN_EXT_CPU_SIMD="0")
    proc = subprocess.run([sys.executable, "-c", _PORTABLE_CHECK], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("ok 24"), proc.stderr[-3000:]


def test_switch_names_and_values_the_kernels_do_not_read_warn():
    """A CPU switch the kernels do not know, or a value they do not read, warns at import
    (ATTN_EXT_CPU_DECODE=off used to leave the decode kernel on without a word); the values
    they read do not."""
    from attn_ext import _env

    msgs = _env.check_switches({"ATTN_EXT_CPU_DECODE": "0", "ATTN_EXT_CPU_BF16DP": "1",
                                "ATTN_EXT_CPU_BWD_JOBS": "3", "ATTN_EXT_CUDA": "0", "PATH": "x"})
    assert msgs == []
    with pytest.warns(UserWarning) as rec:
        msgs = _env.check_switches({"ATTN_EXT_CPU_DECODE": "off", "ATTN_EXT_CPU_DECOD": "0",
                                    "ATTN_EXT_CPU_BWD_JOBS": "abc", "ATTN_EXT_CPU_SIMD": " 0"})
    assert len(msgs) == 4 and [str(w.message) for w in rec] == msgs
    assert "ATTN_EXT_CPU_BWD_JOBS='abc' is not a value" in msgs[0]
    assert "ATTN_EXT_CPU_DECOD is not a switch" in msgs[1]
    assert "ATTN_EXT_CPU_DECODE='off' is not a value attn_ext reads (it reads '0' or '1')" in msgs[2]
    assert "ATTN_EXT_CPU_SIMD=' 0'" in msgs[3]
    # every switch the C++ code reads is in the list (and nothing else)
    src = ""
    for d, _, files in os.walk(os.path.join(ROOT, "csrc")):
        src += "".join(open(os.path.join(d, f)).read() for f in files if f.endswith((".h", ".cpp")))
    assert set(re.findall(r'"(ATTN_EXT_CPU_[A-Z0-9_]+)"', src)) == set(_env.SWITCHES)
    env = dict(os.environ, ATTN_EXT_CPU_DECODE="off")
    r = subprocess.run([sys.executable, "-c", "import attn_ext"], env=env, capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "ATTN_EXT_CPU_DECODE='off' is not a value" in r.stderr, r.stderr
