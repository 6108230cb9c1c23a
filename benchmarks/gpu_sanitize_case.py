"""A few small attention calls for compute-sanitizer (memcheck / racecheck) on the GPU machine:
the fast forward and the fast backward (both head dims, causal and not, ragged tile ends,
Sq > Sk, GQA; their softcap + ALiBi instances too), the simple forward (forced and odd head dims) and the simple backward. Checks nothing itself beyond
finiteness; the sanitizer's report is the result.

  compute-sanitizer --tool memcheck python benchmarks/gpu_sanitize_case.py [--fast-only]
"""

import os
import sys

import torch

# run from a source checkout (gpu_check.sh builds in place, nothing is installed)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (for _env)
from _env import checkout_first  # noqa: E402

checkout_first()
import attn_ext  # noqa: E402,F401

fast_only = "--fast-only" in sys.argv
op = torch.ops.attn_ext
dev = "cuda"
torch.manual_seed(0)
cases = [  # (B, Sq, Sk, H, Hkv, D, Dv, dtype)
    (1, 130, 77, 2, 1, 64, 64, torch.bfloat16),
    (1, 65, 200, 2, 2, 128, 128, torch.float16),
    (1, 70, 90, 2, 1, 256, 256, torch.bfloat16),  # fast forward with 32-key steps
]
if not fast_only:
    cases += [(1, 33, 41, 2, 1, 59, 111, torch.float32), (1, 9, 17, 2, 2, 16, 24, torch.float64)]
for B, Sq, Sk, H, Hkv, D, Dv, dt in cases:
    q = torch.randn(B, Sq, H, D, device=dev).to(dt)
    k = torch.randn(B, Sk, Hkv, D, device=dev).to(dt)
    v = torch.randn(B, Sk, Hkv, Dv, device=dev).to(dt)
    for causal in (False, True):
        out, lse = op.attention_forward(q, k, v, causal, None)
        dout = torch.randn_like(out)
        grads = op.attention_backward(dout, q, k, v, out, lse, causal, None)  # fast for 16-bit
        assert all(torch.isfinite(g).all() for g in grads)
        if not fast_only:
            with attn_ext.ops._simple_cuda_kernels():
                out2, _ = op.attention_forward(q, k, v, causal, None)
                grads = op.attention_backward(dout, q, k, v, out, lse, causal, None)
            assert all(torch.isfinite(g).all() for g in grads)
        assert not torch.isnan(out).any()
    if dt in (torch.float16, torch.bfloat16) and D in (64, 128):
        # the fast kernels' score-term instances (softcap + ALiBi), with and without a mask
        slopes = torch.rand(H, device=dev) * 0.5
        for kw in (dict(causal=False), dict(causal=True, window=(30, 0))):
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            out = attn_ext.attention(qg, kg, vg, alibi_slopes=slopes, softcap=5.0, **kw)
            out.backward(torch.randn_like(out))
            assert all(torch.isfinite(t.grad).all() for t in (qg, kg, vg))
torch.cuda.synchronize()
print("sanitize case done")
