"""Issue 18 item 8: where the fp32 gradient error of the CPU attention backward comes from on tiny
shapes. For 2500 random cases (half with Sq 1-2, Sk 2-3; scale up to 2; D up to 80) it prints, per
gradient, the worst ratio of our error (minus the 1e-6 floor) to the fp32 textbook reference's error
(floored at 4 ulps of the largest entry, as tests/test_fuzz.py does), and to the larger of that and
the error of a float32 PyTorch emulation of the FlashAttention-style recomputation (forward scores in
log2 units, backward scores in natural-log units, rounded separately; row term from rowsum(dout*out)).

    python tools/fp32_grad_study.py      (about a minute)
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import attn_ext  # noqa: E402
from attn_ext import reference as R  # noqa: E402
eps = torch.finfo(torch.float32).eps
def grads(q,k,v,dout,causal,scale,dt):
    q,k,v=[t.detach().to(dt).requires_grad_() for t in (q,k,v)]
    out,lse=R.attention_with_lse(q,k,v,causal,scale); out.backward(dout.to(dt))
    return q.grad,k.grad,v.grad
LOG2E=1/math.log(2)
def fa2_style(q,k,v,dout,causal,scale):
    """fp32, the recomputing backward: scores of the forward (log2 units) and of the backward
    (natural units) rounded separately; delta from the stored out."""
    B,Sq,H,D=q.shape; Sk,Hkv=k.shape[1],k.shape[2]; g=H//Hkv
    k=k.repeat_interleave(g,2); v=v.repeat_interleave(g,2)
    qh,kh,vh,dh=[t.transpose(1,2) for t in (q,k,v,dout)]
    mask=R.causal_mask(Sq,Sk) if causal else torch.ones(Sq,Sk,dtype=torch.bool)
    s2=(qh*(scale*LOG2E))@kh.transpose(-1,-2); s2=s2.masked_fill(~mask,float("-inf"))
    m=s2.amax(-1,keepdim=True); m=torch.where(torch.isinf(m),torch.zeros_like(m),m)
    p2=torch.exp2(s2-m); l=p2.sum(-1,keepdim=True)
    out=(p2@vh)/torch.where(l>0,l,torch.ones_like(l))
    lse=((m.double()+torch.log2(l.double()))*math.log(2)).float()
    s=(qh*scale)@kh.transpose(-1,-2); s=s.masked_fill(~mask,float("-inf"))
    p=torch.exp(s-torch.where(torch.isinf(lse),torch.full_like(lse,float("inf")),lse))
    dp=dh@vh.transpose(-1,-2); delta=(dh*out).sum(-1,keepdim=True)
    ds=p*(dp-delta)
    dq=(ds@kh)*scale; dk=(ds.transpose(-1,-2)@qh)*scale; dv=p.transpose(-1,-2)@dh
    dk=dk.view(B,Hkv,g,Sk,D).sum(2); dv=dv.view(B,Hkv,g,Sk,-1).sum(2)
    return dq.transpose(1,2),dk.transpose(1,2),dv.transpose(1,2)
def err(a,b): return (a.double()-b.double()).abs().max().item()
torch.manual_seed(1)
res=[]
for it in range(2500):
    B=int(torch.randint(1,3,(1,))); Hkv=int(torch.randint(1,3,(1,))); H=Hkv*int(torch.randint(1,3,(1,)))
    Sq=int(torch.randint(1,41,(1,))) if it%2 else int(torch.randint(1,3,(1,)))
    Sk=int(torch.randint(1,41,(1,))) if it%2 else int(torch.randint(2,4,(1,)))
    D=int(torch.randint(1,81,(1,))); Dv=D if it%3 else int(torch.randint(1,81,(1,)))
    causal=bool(torch.randint(0,2,(1,)))
    scale=None if it%4 else float(torch.empty(1).uniform_(0.01,2.0))
    s_=scale if scale is not None else D**-0.5
    q=torch.randn(B,Sq,H,D,dtype=torch.float64).float(); k=torch.randn(B,Sk,Hkv,D,dtype=torch.float64).float()
    v=torch.randn(B,Sk,Hkv,Dv,dtype=torch.float64).float(); dout=torch.randn(B,Sq,H,Dv,dtype=torch.float64).float()
    qg,kg,vg=[t.clone().requires_grad_() for t in (q,k,v)]
    o=attn_ext.attention(qg,kg,vg,causal=causal,scale=scale); o.backward(dout)
    g64=grads(q,k,v,dout,causal,scale,torch.float64); g32=grads(q,k,v,dout,causal,scale,torch.float32)
    gf=fa2_style(q,k,v,dout,causal,s_)
    for i,name in enumerate(("dq","dk","dv")):
        ours=(qg.grad,kg.grad,vg.grad)[i]; r64=g64[i]
        mag=r64.abs().max().item()
        ref=max(err(g32[i],r64),4*eps*mag)
        ref2=max(ref, err(gf[i],r64))
        e=err(ours,r64)
        res.append((name,(e-1e-6)/max(ref,1e-30),(e-1e-6)/max(ref2,1e-30),Sq,Sk,D,Dv,causal,scale))
for name in ("dq","dk","dv"):
    r=[x for x in res if x[0]==name]
    print(name,"max ours/textbook32 %.3g"%max(x[1] for x in r),"max ours/max(textbook32,fa2style32) %.3g"%max(x[2] for x in r),
          "#>2: %d %d"%(sum(x[1]>2 for x in r),sum(x[2]>2 for x in r)), "n",len(r))
    for w in sorted(r,key=lambda x:-x[2])[:3]: print("   ",w)
