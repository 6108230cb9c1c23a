"""Calls every attn_ext op once, as a user of an installed attn_ext would, and checks each
result against attn_ext.reference in float64. Run by tests/test_pip_install.py and
tools/cross_version_check.py with an installed (not in-tree) attn_ext, from a directory
outside the checkout:

    python install_smoke.py [results.pt]

Prints build_info() and one line per op; with a path, saves every op's outputs (fixed seed,
fixed thread count) so two torch versions' results can be compared exactly. Exit status 0 iff
every check passed."""

import json
import os
import sys

import torch

import attn_ext
from attn_ext import reference as ref

torch.manual_seed(1234)
torch.set_num_threads(2)
ops = torch.ops.attn_ext
results = {}


def close(name, got, want, tol=1e-4):
    got = got.double()
    err = (got - want.double()).abs().max().item() if got.numel() else 0.0
    ok = err <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {name:<24} max err {err:.2e}")
    if not ok:
        sys.exit(f"{name}: error {err} > {tol}")


info = attn_ext.build_info()
print("attn_ext", attn_ext.__file__)
print("build_info", json.dumps(info, default=str))
here = os.path.dirname(os.path.abspath(__file__))
if os.path.commonpath([here, os.path.abspath(attn_ext.__file__)]) == here:
    sys.exit("attn_ext was imported from the checkout, not from the installed package")

# ---- positional encodings
x = torch.randn(2, 7, 10)
out = ops.sinusoidal_pe(x, None, 3, 10000.0)
close("sinusoidal_pe", out, ref.sinusoidal_pe(x.double(), offset=3))
results["sinusoidal_pe"] = out
y = x.clone()
ops.sinusoidal_pe_(y, None, 3, 10000.0)
close("sinusoidal_pe_", y, ref.sinusoidal_pe(x.double(), offset=3))
results["sinusoidal_pe_"] = y

cos, sin = attn_ext.rope_cache(16, 8, dtype=torch.float32)
q = torch.randn(2, 5, 4, 12)
k = torch.randn(2, 5, 2, 12)
pos = torch.tensor([0, 3, 1, 15, 2])
want_q = ref.rope(q.double(), cos.double(), sin.double(), pos)
want_k = ref.rope(k.double(), cos.double(), sin.double(), pos)
out = ops.rope(q, cos, sin, pos, 0, False)
close("rope", out, want_q)
results["rope"] = out
back = ops._rope_backward(out, cos, sin, pos, 0, False)
close("_rope_backward", back, q.double())
results["_rope_backward"] = back
q1 = q.clone()
ops.rope_(q1, cos, sin, pos, 0, False)
close("rope_", q1, want_q)
q2, k2 = q.clone(), k.clone()
ops.rope_qk_(q2, k2, cos, sin, pos, 0, False)
close("rope_qk_ (q)", q2, want_q)
close("rope_qk_ (k)", k2, want_k)
results["rope_qk_"] = torch.cat([q2.flatten(), k2.flatten()])

# ---- attention
q = torch.randn(2, 9, 4, 16)
k = torch.randn(2, 11, 2, 16)
v = torch.randn(2, 11, 2, 8)
kr, vr = k.double().repeat_interleave(2, dim=2), v.double().repeat_interleave(2, dim=2)
out, lse = ops.attention_forward(q, k, v, True, None)
close("attention_forward", out, ref.attention(q.double(), kr, vr, causal=True))
results["attention_forward"] = torch.cat([out.flatten(), lse.flatten()])
close("attention", ops.attention(q, k, v, False, 0.3), ref.attention(q.double(), kr, vr, scale=0.3))
close("causal_attention", ops.causal_attention(q, k, v, None),
      ref.attention(q.double(), kr, vr, causal=True))
dout = torch.randn_like(out)
dq, dk, dv = ops.attention_backward(dout, q, k, v, out, lse, True, None, deterministic=False)
qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
r = ref.attention(qd, kd.repeat_interleave(2, dim=2), vd.repeat_interleave(2, dim=2), causal=True)
r.backward(dout.double())
close("attention_backward (dq)", dq, qd.grad)
close("attention_backward (dk)", dk, kd.grad)
close("attention_backward (dv)", dv, vd.grad)
results["attention_backward"] = torch.cat([dq.flatten(), dk.flatten(), dv.flatten()])
# autograd through the Python wrapper (composite -> dispatcher -> attention_forward)
qa = q.clone().requires_grad_()
attn_ext.causal_attention(qa, k, v).backward(dout)
close("autograd dq", qa.grad, qd.grad)

threads = ops._parallel_threads(8)
print(f"{'ok  ' if threads == 2 else 'FAIL'} _parallel_threads(8) = {threads} (2 threads set)")
if threads != 2:
    sys.exit("_parallel_threads did not see 2 threads")

if len(sys.argv) > 1:
    torch.save({"torch": str(torch.__version__), "build_info": json.loads(json.dumps(info, default=str)),
                "results": results}, sys.argv[1])
print("all ops ok")
