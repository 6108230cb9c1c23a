"""Issue 18 item 8: where the fp32 gradient error of the CPU attention backward comes from on
the tiny shapes where tests/test_fuzz.py saw the 2x rule fail (Sq 1-2, Sk 2-3).

For N random cases of those shapes (D = Dv in 1..80, scale None or up to 2, causal or not;
values as test_fuzz draws them) it measures, per gradient, the max error against the float64
textbook of

  ours        attn_ext.attention (CPU kernels) + backward
  text32      the textbook (attn_ext/reference.py) in fp32: the test's baseline
  sdpa_math   torch SDPA, math backend, fp32 (PyTorch's textbook)
  sdpa_flash  torch SDPA, flash backend on CPU, fp32 (PyTorch's own FlashAttention-style
              kernel: P recomputed from lse, Di = rowsum(dO * O)); where it can express the
              case (not causal, or Sq == Sk)
  emu_fa2     a float32 emulation of the FlashAttention-2 backward with the forward's scores
              reused bitwise and Di = rowsum(dO * O)
  emu_pdp     the same with Di = sum_j P_j dP_j (the textbook's row term)

and prints, for each method X and gradient, how often and how far X's error exceeds 2x the
baseline's, with the baseline floored at 4 ulps of the largest entry and X's error reduced by
the 1e-6 floor, exactly as tests/test_fuzz.py judges ours. Baseline: text32, and (second
table) max(text32, sdpa_flash).

    PYTHONPATH=$PWD python tools/fp32_grad_study.py [N]        (N = 3000: ~1 minute)

Findings and the fix: TESTING.md (2026-12-01, issue 18 item 8); regression tests in
tests/test_fp32_grad_accuracy.py.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import attn_ext  # noqa: E402
from attn_ext import reference as R  # noqa: E402

EPS = torch.finfo(torch.float32).eps
FLOOR = 1e-6
NAMES = ("dq", "dk", "dv")


def err(a, b):
    return float((a.double() - b.double()).abs().max())


def textbook(q, k, v, dout, causal, scale, dt):
    q, k, v = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
    out, _ = R.attention_with_lse(q, k, v, causal, scale)
    out.backward(dout.to(dt))
    return q.grad, k.grad, v.grad


def sdpa(q, k, v, dout, causal, scale, backend):
    """SDPA fp32; the math backend gets the bottom-right causal mask explicitly (its own
    is_causal is top-left aligned), the flash backend only cases where both agree."""
    group = q.shape[2] // k.shape[2]
    q, k, v = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    mask = None
    if causal and backend == SDPBackend.MATH:
        mask, causal = R.causal_mask(q.shape[1], k.shape[1]), False
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2),
                                             vv.transpose(1, 2), attn_mask=mask,
                                             is_causal=causal, scale=scale)
    out.transpose(1, 2).backward(dout)
    return q.grad, k.grad, v.grad


def emulate_fa2(q, k, v, dout, causal, scale, pdp):
    """fp32 FlashAttention-2 backward: P = exp(s - lse) from the forward's own scores s (so P
    equals the forward's up to the lse rounding); row term rowsum(dO * O) or sum(P * dP)."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    kh, vh = [t.repeat_interleave(g, 2).transpose(1, 2) for t in (k, v)]
    qh, dh = q.transpose(1, 2), dout.transpose(1, 2)
    s = (qh * scale) @ kh.transpose(-1, -2)
    if causal:
        s = s.masked_fill(~R.causal_mask(Sq, Sk), float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    out = (e @ vh) / l
    lse = (m.double() + torch.log(l.double())).float()
    p = torch.exp(s - lse)
    dp = dh @ vh.transpose(-1, -2)
    di = (p * dp).sum(-1, keepdim=True) if pdp else (dh * out).sum(-1, keepdim=True)
    ds = p * (dp - di)
    dq = (ds @ kh) * scale
    dk = ((ds.transpose(-1, -2) @ qh) * scale).view(B, Hkv, g, Sk, D).sum(2)
    dv = (p.transpose(-1, -2) @ dh).view(B, Hkv, g, Sk, -1).sum(2)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def ours(q, k, v, dout, causal, scale):
    qg, kg, vg = [t.clone().requires_grad_() for t in (q, k, v)]
    attn_ext.attention(qg, kg, vg, causal=causal, scale=scale).backward(dout)
    return qg.grad, kg.grad, vg.grad


def random_case(gen: torch.Generator):
    """One draw of the study's distribution (tests/test_fp32_grad_accuracy.py draws the same):
    B, Hkv in 1-2, group 1-2, Sq 1-2, Sk 2-3, D 1-80, causal or not, scale the default or
    uniform in [0.01, 2]; fp32 inputs rounded from float64 normals. Returns (Sq, Sk, D,
    causal, scale) and (q, k, v, dout)."""

    def ri(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    B, Hkv = ri(1, 2), ri(1, 2)
    H = Hkv * ri(1, 2)
    Sq, Sk, D = ri(1, 2), ri(2, 3), ri(1, 80)
    causal = bool(ri(0, 1))
    scale = None if ri(0, 1) else float(torch.empty(1).uniform_(0.01, 2.0, generator=gen))
    tensors = [(torch.randn(*sh, generator=gen, dtype=torch.float64)).float()
               for sh in ((B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), (B, Sq, H, D))]
    return (Sq, Sk, D, causal, scale), tensors


def main(n: int) -> None:
    gen = torch.Generator().manual_seed(1)
    rows = []  # (case, {method: (err dq, err dk, err dv)}, mags)
    for _ in range(n):
        (Sq, Sk, D, causal, scale), (q, k, v, dout) = random_case(gen)
        s_ = scale if scale is not None else D ** -0.5
        r64 = textbook(q, k, v, dout, causal, scale, torch.float64)
        res = {
            "ours": ours(q, k, v, dout, causal, scale),
            "text32": textbook(q, k, v, dout, causal, scale, torch.float32),
            "sdpa_math": sdpa(q, k, v, dout, causal, s_, SDPBackend.MATH),
            "emu_fa2": emulate_fa2(q, k, v, dout, causal, s_, pdp=False),
            "emu_pdp": emulate_fa2(q, k, v, dout, causal, s_, pdp=True),
        }
        if not causal or Sq == Sk:  # SDPA's causal is top-left aligned
            res["sdpa_flash"] = sdpa(q, k, v, dout, causal, s_, SDPBackend.FLASH_ATTENTION)
        errs = {m: [err(g, r) for g, r in zip(gs, r64)] for m, gs in res.items()}
        mags = [float(r.abs().max()) for r in r64]
        rows.append(((Sq, Sk, D, causal, scale), errs, mags))

    def table(title, base_of):
        print(f"\n{title}: per method, gradient: #cases over 2x / #cases, worst ratio, worst case")
        for m in ("ours", "sdpa_flash", "emu_fa2", "emu_pdp", "sdpa_math"):
            line = [f"  {m:10s}"]
            for gi, name in enumerate(NAMES):
                worst, over, cnt, wcase = 0.0, 0, 0, None
                for case, errs, mags in rows:
                    if m not in errs:
                        continue
                    base = base_of(errs, gi)
                    if base is None:
                        continue
                    cnt += 1
                    r = (errs[m][gi] - FLOOR) / max(base, 4 * EPS * mags[gi], 1e-30)
                    over += r > 2
                    if r > worst:
                        worst, wcase = r, case
                line.append(f"{name} {over:4d}/{cnt} max {worst:6.2f}")
            print("  ".join(line))

    table("baseline text32 (the test's rule)", lambda e, g: e["text32"][g])
    table("baseline max(text32, sdpa_math): PyTorch's fp32 textbook in two orders",
          lambda e, g: max(e["text32"][g], e["sdpa_math"][g]))
    table("baseline max(text32, emu_fa2): the textbook and the FlashAttention algorithm in fp32",
          lambda e, g: max(e["text32"][g], e["emu_fa2"][g]))
    table("baseline max(text32, sdpa_flash), cases SDPA flash can express",
          lambda e, g: max(e["text32"][g], e["sdpa_flash"][g]) if "sdpa_flash" in e else None)
    # where the worst of ours (against the two-order baseline) come from
    for gi, name in enumerate(NAMES):
        worst = sorted(rows, key=lambda r: -(r[1]["ours"][gi] - FLOOR)
                       / max(r[1]["text32"][gi], r[1]["sdpa_math"][gi], 4 * EPS * r[2][gi],
                             1e-30))[:3]
        for case, errs, mags in worst:
            print(f"  worst {name}: (Sq, Sk, D, causal, scale) = {case}  mag {mags[gi]:.3g}  "
                  + "  ".join(f"{m} {e[gi]:.2e}" for m, e in errs.items()))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
