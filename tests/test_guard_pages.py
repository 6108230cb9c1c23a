"""No CPU kernel reads or writes outside its tensors: every input is placed so that its last
byte is the last byte before an inaccessible page (PROT_NONE), or its first byte the first
after one, and every op runs forward and backward on such inputs (the in-place RoPE and
sinusoidal ops write into such tensors; outputs that torch allocates are not guarded: writes
past them are `make asan`'s to find): the tiled kernel (fp32 /
bf16 / fp16, odd and aligned head dims, GQA, causal / window / key padding, score terms), the
split-KV path, the decode kernel (every PV product: fp32 / fp16, bf16 widened and by vdpbf16ps
pairs, in-place, packed and band-edge blocks), varlen, RoPE and the sinusoidal encoding. A read
one byte past the end faults, so the process dies; the cases run in a subprocess, and a control
checks that the guard does fault."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="mmap / mprotect guard pages: Linux only")

_GUARD = r'''
import ctypes, mmap, sys
import torch
sys.path.insert(0, sys.argv[1])
import attn_ext

libc = ctypes.CDLL(None, use_errno=True)
PAGE = mmap.PAGESIZE
_keep = []


def guarded(t, before=False):
    """A copy of t in fresh pages, its last byte just before a PROT_NONE page (before=False) or
    its first byte just after one (before=True)."""
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    npages = (nbytes + PAGE - 1) // PAGE + 1
    m = mmap.mmap(-1, npages * PAGE)
    buf = (ctypes.c_char * (npages * PAGE)).from_buffer(m)
    base = ctypes.addressof(buf)
    guard = base if before else base + (npages - 1) * PAGE
    assert libc.mprotect(ctypes.c_void_p(guard), PAGE, 0) == 0, ctypes.get_errno()
    off = PAGE if before else (npages - 1) * PAGE - nbytes
    g = torch.frombuffer(m, dtype=t.dtype, count=t.numel(), offset=off).view(t.shape)
    g.copy_(t)
    _keep.append((m, buf))
    return g
'''

_CASES = _GUARD + r'''
torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[2]))
ops = torch.ops.attn_ext
n = 0


def run_attention(q, k, v, before, causal=False, window=(-1, -1), kpm=None, **terms):
    global n
    q, k, v = (guarded(t, before) for t in (q, k, v))
    kpm = None if kpm is None else guarded(kpm, before)
    terms = {name: guarded(t, before) if isinstance(t, torch.Tensor) else t
             for name, t in terms.items()}
    out, lse = ops.attention_forward(q, k, v, causal, None, window[0], window[1], kpm, **terms)
    dout = guarded(torch.randn_like(out), before)
    out_g, lse_g = guarded(out, before), guarded(lse, before)
    bwd_terms = {name: t for name, t in terms.items() if name != "sinks"}
    ops.attention_backward(dout, q, k, v, out_g, lse_g, causal, None, window[0], window[1], kpm,
                           None, **bwd_terms)
    n += 1


for before in (False, True):
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        # the tiled kernel: BSHD contiguous, odd and aligned D, GQA, partial tiles
        for B, Sq, Sk, H, Hkv, D, Dv in ((1, 150, 150, 4, 2, 37, 37), (2, 97, 203, 4, 4, 64, 48),
                                         (1, 200, 200, 2, 1, 128, 128)):
            q = torch.randn(B, Sq, H, D).to(dt)
            k, v = torch.randn(B, Sk, Hkv, D).to(dt), torch.randn(B, Sk, Hkv, Dv).to(dt)
            kpm = torch.rand(B, Sk) > 0.2
            run_attention(q, k, v, before)
            run_attention(q, k, v, before, causal=True, window=(40, 0))
            run_attention(q, k, v, before, kpm=kpm)
        # score terms (tiled kernel only)
        q = torch.randn(1, 120, 4, 64).to(dt)
        k, v = torch.randn(1, 130, 2, 64).to(dt), torch.randn(1, 130, 2, 64).to(dt)
        run_attention(q, k, v, before, causal=True, alibi_slopes=torch.rand(4), softcap=20.0,
                      sinks=torch.randn(4))
        run_attention(q, k, v, before, rel_bias=torch.randn(4, 2 * 50 + 1))  # distances -50..50
        # split keys: one query tile, many keys
        q = torch.randn(1, 3, 32, 64).to(dt)
        k, v = torch.randn(1, 1500, 1, 64).to(dt), torch.randn(1, 1500, 1, 64).to(dt)
        run_attention(q, k, v, before)
        # the decode kernel: D / Dv multiples of 16 (pairs where bf16 takes them), of 8, and
        # neither; in place, packed (padding) and band-edge (Sq > 1, causal window) blocks
        for B, Sq, Sk, H, Hkv, D, Dv in ((1, 1, 1000, 8, 2, 64, 80), (2, 2, 301, 8, 4, 128, 48),
                                         (1, 3, 300, 6, 2, 96, 144), (2, 1, 77, 4, 4, 59, 40),
                                         (1, 1, 8, 4, 1, 32, 16), (1, 4, 257, 8, 2, 64, 256)):
            q = torch.randn(B, Sq, H, D).to(dt)
            k, v = torch.randn(B, Sk, Hkv, D).to(dt), torch.randn(B, Sk, Hkv, Dv).to(dt)
            assert attn_ext.explain(q, k, v).forward == "cpu.decode"
            kpm = torch.rand(B, Sk) > 0.3
            kpm[:, -1] = True
            run_attention(q, k, v, before)
            run_attention(q, k, v, before, causal=True, window=(0, 0))
            run_attention(q, k, v, before, kpm=kpm)
        # varlen, uneven query lengths (decode-sized and tiled)
        for lq, lk in (([1, 2, 0, 1], [300, 37, 5, 0]), ([70, 1, 33], [90, 64, 33])):
            cq = guarded(torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32), before)
            ck = guarded(torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32), before)
            q = guarded(torch.randn(sum(lq), 8, 64).to(dt), before)
            k = guarded(torch.randn(sum(lk), 2, 64).to(dt), before)
            v = guarded(torch.randn(sum(lk), 2, 48).to(dt), before)
            out, lse = ops.attention_varlen_forward(q, k, v, cq, ck, max(lq), max(lk), True)
            dout = guarded(torch.randn_like(out), before)
            ops.attention_varlen_backward(dout, q, k, v, guarded(out, before), guarded(lse, before),
                                          cq, ck, max(lq), max(lk), True)
            n += 1
        # positional encodings
        x = guarded(torch.randn(2, 33, 4, 38).to(dt), before)
        cos, sin = (guarded(t, before) for t in attn_ext.rope_cache(33, 38, dtype=dt))
        for interleaved in (False, True):
            attn_ext.rope(x, cos, sin, interleaved=interleaved)
        attn_ext.sinusoidal_pe(guarded(torch.randn(2, 33, 38).to(dt), before))
        # the in-place ops write into guarded memory; rope's backward reads a guarded dout
        for interleaved in (False, True):
            attn_ext.rope_(guarded(x[:, :30].clone(), before), cos, sin, None, 3, interleaved)
            q2, k2 = guarded(x.clone(), before), guarded(x[:, :, :1].clone(), before)
            attn_ext.rope_qk(q2, k2, cos, sin, None, inplace=True, interleaved=interleaved)
        xg = guarded(x.clone(), before).requires_grad_()
        attn_ext.rope(xg, cos, sin).backward(guarded(torch.randn(x.shape).to(dt), before))
        attn_ext.sinusoidal_pe_(guarded(torch.randn(2, 33, 38).to(dt), before), None, 123_456, 500.0)
        n += 1
print("ok", n)
'''

_CONTROL = _GUARD + r'''
before = sys.argv[2] == "before"
t = guarded(torch.randn(1000), before)
addr = t.data_ptr() + (-1 if before else t.numel() * t.element_size())
print("reading", flush=True)
ctypes.string_at(addr, 1)
print("read past the guard without a fault")
'''


def _run(tmp_path, text, *args):
    script = tmp_path / "run.py"
    script.write_text(text)
    return subprocess.run([sys.executable, str(script), ROOT, *args], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("where", ["after", "before"])
def test_guard_page_faults_on_one_byte_outside(tmp_path, where):
    """The control: reading the byte just past a guarded tensor's end (or just before its start)
    kills the process with SIGSEGV, so the cases below would fail on any such access."""
    res = _run(tmp_path, _CONTROL, where)
    assert "reading" in res.stdout, res.stdout + res.stderr
    assert res.returncode == -11, (res.returncode, res.stdout, res.stderr)


@pytest.mark.parametrize("threads", [2, 8])
def test_kernels_stay_inside_guarded_tensors(tmp_path, threads):
    """The cases at 2 threads and at 8 (oversubscribed here: more key chunks in the split-KV
    forward and the decode, the split backward for more shapes)."""
    res = _run(tmp_path, _CASES, str(threads))
    assert res.returncode == 0, f"rc {res.returncode}\n{res.stdout}\n{res.stderr[-3000:]}"
    assert res.stdout.strip().endswith("ok 198"), res.stdout[-500:]
