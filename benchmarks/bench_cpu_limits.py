"""CPU attention against the machine's limits (issue 16): decode at memory speed, the native
BSHD layout vs BHSD views, forward+backward vs SDPA, and the backward's peak extra memory at
1 and 2 threads.

    python benchmarks/bench_cpu_limits.py [--quick] [--repeats N] [--parts decode,layout,train,memory]
    python benchmarks/bench_cpu_limits.py --parts nonfinite,terms,decode-rows,overhead,short-rows
                                          (not among the defaults)
                                          [--decode-caches cold|interleaved]

Every row is validated first (ours vs SDPA on the same inputs), then the methods are timed
interleaved (one call of each per round) and medians are printed, with the roofs measured in
the same run: the read bandwidth of one pass over a tensor the size of the decode's K + V
(`x.sum()`), and the rate of one fp32 2048^3 `torch.matmul`, timed as one more method in the
prefill rows' rounds.

Decode: q (B, 1, H, D), k/v (B, Sk, Hkv, D) contiguous (a KV cache in BSHD); SDPA reads the
same memory through transpose(1, 2) views with enable_gqa. GB/s = bytes of K + V / time.
With --decode-caches cold, every timed decode call (ours, SDPA and the roof's x.sum()) starts
with cold caches (a 128 MiB read before it, untimed); by default the calls run back to back.
Layout: causal prefill forward on BSHD-contiguous q/k/v (a Linear's output viewed as
(B, S, H, D)) and on BHSD-contiguous tensors passed as transpose(1, 2) views; SDPA on its
native BHSD. Memory: peak RSS growth (VmHWM, reset through /proc/self/clear_refs) of one
attention_backward call in a fresh process; the returned gradients count.
Nonfinite: what settling the lse of rows that meet an inf costs (attention_fwd.cpp,
settle_nan_lse): the same forward on clean inputs, with one K row of +inf channel 0 (every
row after it sees a +inf score), and with an inf in every q row, interleaved; each checked
first for lse +inf where the reference's torch.logsumexp gives it.
Terms: decode (Sq = 1, causal) with softcap, ALiBi, rel_bias and all of them with sinks, in
the decode kernel (explain must say cpu.decode) against the same call on the tiled kernel
(ATTN_EXT_CPU_DECODE=0, read per call), the plain call and the read roof, interleaved; each
checked against the float64 reference first.
Decode-rows: decode with Sq = 2 and 4 query rows (causal; one row with a window), ours (the
decode kernel, which explain must name) against SDPA given the bottom-right band as an
explicit mask, with the read roof over the bytes of the keys the band reaches, interleaved.
Overhead: the per-call cost of small decode steps (Sk = 16 and 512), where the call path
dominates: the wrapper with and without its call below the op's Python Autograd kernel
(attn_ext/ops.py, _call_op), the op through that kernel, the op under inference mode, SDPA, and
the in-place rope_qk of one step, interleaved.
Short-rows: query blocks that one tile per (sequence, kv head) covers (MQA decode; GQA with
Sq * H / Hkv past the decode kernel's 16 columns), each row in a fresh process: ours alone
first (calls 2-11, then 20+ more), then interleaved with SDPA (bottom-right band as an explicit
mask), with the minor page faults per call (SDPA's large frees move glibc's mmap threshold,
which changes ours).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/ (for _env)
sys.path.insert(0, HERE)
from _env import checkout_first, interleaved_medians, print_env_header  # noqa: E402

checkout_first()
import attn_ext  # noqa: E402,F401
from attn_ext import reference  # noqa: E402
from attn_ext.position_bias import alibi_slopes  # noqa: E402

DECODE = [  # (B, Sk, H, Hkv, D, dtype)
    (1, 512, 32, 8, 128, torch.float32),
    (1, 4096, 32, 8, 128, torch.float32),
    (4, 2048, 32, 8, 128, torch.float32),
    (16, 2048, 32, 8, 128, torch.float32),
    (1, 8192, 32, 32, 128, torch.float32),
    (1, 32768, 32, 8, 128, torch.float32),
    (1, 4096, 32, 8, 128, torch.bfloat16),
    (4, 2048, 32, 8, 128, torch.bfloat16),
]
LAYOUT = [(1, 16, 2048, 64), (1, 8, 4096, 128)]  # (B, H, S, D), causal fp32
MEMORY = (1, 8, 8192, 128)


# --decode-caches cold: one read pass over 128 MiB (4x this machine's 32 MiB L3) before every
# timed decode call, so that each method (ours, SDPA, the roof's x.sum()) starts with K / V out
# of the caches, as in a model's decode step, where the other layers' weights and caches pass
# through between two reads of one layer's cache. Back to back, a 16 MiB shape is read partly
# from L3 by whichever call follows another over the same memory, and the roof with it.
_EVICT = None


def evict_caches():
    global _EVICT
    if _EVICT is None:
        _EVICT = torch.ones(32 << 20)  # 128 MiB of fp32
    _EVICT.sum()


# The GEMM roof of the prefill rows: one fp32 2048^3 matmul, timed as one more method in each
# row's interleaved rounds, so that the roof and the kernels are medians over the same window
# of this shared machine (a roof timed once before the rows moved 290-356 GFLOP/s from run to
# run, and the "% roof" column with it: RESULTS.md, twentieth session).
GEMM_N = 2048


def gemm_method():
    a, b = torch.randn(GEMM_N, GEMM_N), torch.randn(GEMM_N, GEMM_N)
    return lambda: a @ b


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def read_roof_method(nbytes):
    """The read roof of a decode row: one read pass (x.sum()) over nbytes, as many bytes as the
    K / V the row reads. On fp32 data whatever the row's dtype: an fp32 sum over bf16 is not a
    read pass at bf16 speed."""
    x = torch.randn(nbytes // 4)
    return lambda: x.sum()


def part_decode(args):
    how = ("caches evicted before every timed call (--decode-caches cold)"
           if args.decode_caches == "cold" else "interleaved calls, caches not evicted")
    print(f"\n## decode (Sq = 1): {how}\n")
    print("| B | Sk | H/Hkv | D | dtype | K+V MiB | read roof GB/s | ours ms | ours GB/s | % roof | SDPA ms | ours/SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    shapes = DECODE[:2] if args.quick else DECODE
    for B, Sk, H, Hkv, D, dt in shapes:
        if args.quick:
            Sk = min(Sk, 1024)
        q = torch.randn(B, 1, H, D, dtype=dt)
        k = torch.randn(B, Sk, Hkv, D, dtype=dt)
        v = torch.randn(B, Sk, Hkv, D, dtype=dt)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        ours = lambda: torch.ops.attn_ext.attention_forward(q, k, v, False, None)
        sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        got = ours()[0].float()
        want = sdpa().transpose(1, 2).float()
        err = (got - want).abs().max().item()
        assert err < (1e-4 if dt == torch.float32 else 2e-2), f"validation failed: {err}"
        byts = 2 * k.numel() * k.element_size()
        t = interleaved_medians({"ours": ours, "sdpa": sdpa, "roof": read_roof_method(byts)},
                                args.repeats,
                                before=evict_caches if args.decode_caches == "cold" else None)
        roof = byts / t["roof"] / 1e9
        bw = byts / t["ours"] / 1e9
        dname = DTYPE_NAMES[dt]
        print(f"| {B} | {Sk} | {H}/{Hkv} | {D} | {dname} | {byts / 2**20:.0f} | {roof:.1f} | "
              f"{t['ours'] * 1e3:.2f} | {bw:.1f} | {100 * bw / roof:.0f} % | {t['sdpa'] * 1e3:.2f} | "
              f"{t['sdpa'] / t['ours']:.2f} |")


def part_layout(args):
    print("\n## causal prefill forward fp32: BSHD vs BHSD views vs SDPA\n")
    print("fp32 matmul 2048^3 (the GEMM roof) timed in the same interleaved rounds as each row\n")
    print("| B, H, S, D | ours BSHD ms | ours BHSD-view ms | BSHD / BHSD | SDPA (BHSD) ms | SDPA / ours BSHD | SDPA / ours BHSD | matmul GFLOP/s | ours BSHD % roof | ours BHSD % roof |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    mm = gemm_method()
    for B, H, S, D in ([(1, 4, 512, 64)] if args.quick else LAYOUT):
        qs, ks, vs = (torch.randn(B, S, H, D) for _ in range(3))
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (qs, ks, vs))
        a = lambda: torch.ops.attn_ext.attention(qs, ks, vs, True, None)
        b = lambda: torch.ops.attn_ext.attention(qh.transpose(1, 2), kh.transpose(1, 2),
                                                 vh.transpose(1, 2), True, None)
        c = lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        assert (a() - c().transpose(1, 2)).abs().max().item() < 1e-4
        assert (b() - c().transpose(1, 2)).abs().max().item() < 1e-4
        t = interleaved_medians({"bshd": a, "bhsd": b, "sdpa": c, "mm": mm}, args.repeats)
        fl = 2 * B * H * S * S * D
        roof = 2 * GEMM_N**3 / t["mm"] / 1e9
        print(f"| {B}, {H}, {S}, {D} | {t['bshd'] * 1e3:.1f} | {t['bhsd'] * 1e3:.1f} | "
              f"{t['bshd'] / t['bhsd']:.3f} | {t['sdpa'] * 1e3:.1f} | {t['sdpa'] / t['bshd']:.2f} | "
              f"{t['sdpa'] / t['bhsd']:.2f} | {roof:.0f} | {100 * fl / t['bshd'] / 1e9 / roof:.0f} % | "
              f"{100 * fl / t['bhsd'] / 1e9 / roof:.0f} % |")


def part_train(args):
    print("\n## causal forward + backward fp32 (BHSD memory, ours through transpose views)\n")
    print("| B, H, S, D | ours ms | SDPA ms | SDPA / ours |")
    print("|---|---|---|---|")
    for B, H, S, D in ([(1, 4, 512, 64)] if args.quick else LAYOUT):
        qh, kh, vh = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
        do = torch.randn(B, H, S, D)

        def ours():
            o = torch.ops.attn_ext.attention(qh.transpose(1, 2), kh.transpose(1, 2),
                                             vh.transpose(1, 2), True, None)
            return torch.autograd.grad(o, (qh, kh, vh), do.transpose(1, 2))

        def sdpa():
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            return torch.autograd.grad(o, (qh, kh, vh), do)

        for g1, g2 in zip(ours(), sdpa()):
            assert (g1 - g2).abs().max().item() < 1e-3
        t = interleaved_medians({"ours": ours, "sdpa": sdpa}, max(2, args.repeats // 2))
        print(f"| {B}, {H}, {S}, {D} | {t['ours'] * 1e3:.0f} | {t['sdpa'] * 1e3:.0f} | "
              f"{t['sdpa'] / t['ours']:.2f} |")


_MEM_CHILD = """
import sys, torch
sys.path[0] = sys.argv[2]  # benchmarks/, for python -c's "" (the cwd: an unbuilt checkout's root)
from _env import checkout_first
checkout_first()
import attn_ext
def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
torch.set_num_threads(int(sys.argv[1]))
B, S, H, D = (int(x) for x in sys.argv[3].split(","))
q, k, v, dout = (torch.randn(B, S, H, D) for _ in range(4))
out, lse = torch.ops.attn_ext.attention_forward(q, k, v, True, None)
t = torch.randn(1, 8, 1, 8)
torch.ops.attn_ext.attention_backward(t, t, t, t, t, torch.zeros(1, 1, 8), True, None)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current RSS
before = status_kib("VmRSS")
grads = torch.ops.attn_ext.attention_backward(dout, q, k, v, out, lse, True, None)
print((status_kib("VmHWM") - before) / 1024.0)
"""


def part_memory(args):
    shape = (1, 4, 2048, 64) if args.quick else MEMORY
    B, H, S, D = shape
    grads = 3 * B * S * H * D * 4 / 2**20
    print(f"\n## backward peak extra memory, causal fp32 (B, H, S, D) = {shape}; the gradients are {grads:.0f} MiB\n")
    print("| threads | peak extra MiB (VmHWM growth of the call) | minus the gradients |")
    print("|---|---|---|")
    for n in (1, 2):
        out = subprocess.run([sys.executable, "-c", _MEM_CHILD, str(n), HERE,
                              ",".join(map(str, (B, S, H, D)))],
                             capture_output=True, text=True, check=True).stdout
        mib = float(out.strip().splitlines()[-1])
        print(f"| {n} | {mib:.1f} | {mib - grads:.1f} |")


def part_nonfinite(args):
    print("\n## forward cost of rows that meet an inf (lse settled to +inf), fp32\n")
    print("| case | clean ms | one +inf K row ms | ratio | inf in every q row ms | ratio |")
    print("|---|---|---|---|---|---|")
    cases = [("causal prefill", 1, 2048, 2048, 16, 16, 64, True),
             ("decode", 1, 1, 4096, 32, 8, 128, False)]
    for kind, B, Sq, Sk, H, Hkv, D, causal in cases:
        if args.quick:
            Sq, Sk = min(Sq, 128), min(Sk, 256)
        name = f"{kind} B {B}, Sq {Sq}, Sk {Sk}, H/Hkv {H}/{Hkv}, D {D}"
        q = torch.randn(B, Sq, H, D)
        q[..., 0] = q[..., 0].abs()
        k, v = torch.randn(B, Sk, Hkv, D), torch.randn(B, Sk, Hkv, D)
        k_inf = k.clone()
        k_inf[:, 3, :, 0] = float("inf")  # a +inf score for every row that sees key 3
        q_inf = q.clone()
        q_inf[..., 1] = float("inf")      # an inf channel in every q row
        calls = {"clean": (q, k), "k_inf": (q, k_inf), "q_inf": (q_inf, k)}
        fns = {n: (lambda qq=qq, kk=kk: torch.ops.attn_ext.attention_forward(qq, kk, v, causal, None))
               for n, (qq, kk) in calls.items()}
        for n, (qq, kk) in calls.items():
            lse = fns[n]()[1]
            # (query head 0 against its kv head 0)
            want = reference.attention_with_lse(qq[:, :, :1].double(), kk[:, :, :1].double(),
                                                v[:, :, :1].double(), causal=causal)[1]
            assert torch.equal(torch.isposinf(lse[:, :1]), torch.isposinf(want)), n
            assert torch.equal(torch.isnan(lse[:, :1]), torch.isnan(want)), n
        t = interleaved_medians(fns, args.repeats)
        print(f"| {name} | {t['clean'] * 1e3:.2f} | {t['k_inf'] * 1e3:.2f} | "
              f"{t['k_inf'] / t['clean']:.2f} | {t['q_inf'] * 1e3:.2f} | {t['q_inf'] / t['clean']:.2f} |")


def _tiled(fn):
    """fn with the decode kernel switched off (ATTN_EXT_CPU_DECODE=0, read per call): the tiled
    kernel on the same shape, what a decode call with score terms ran before they moved into the
    decode kernel."""
    def call():
        os.environ["ATTN_EXT_CPU_DECODE"] = "0"
        try:
            return fn()
        finally:
            del os.environ["ATTN_EXT_CPU_DECODE"]
    return call


def part_terms(args):
    print("\n## decode (Sq = 1) with score terms: the decode kernel vs the tiled kernel, "
          "interleaved calls\n")
    print("| B | Sk | H/Hkv | D | dtype | terms | read roof GB/s | ours ms | ours GB/s | % roof | "
          "ours / plain | tiled ms | tiled / ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for B, Sk, H, Hkv, D, dt in [(1, 4096, 32, 8, 128, torch.float32),
                                 (1, 4096, 32, 8, 128, torch.bfloat16)]:
        if args.quick:
            Sk = min(Sk, 1024)
        q = torch.randn(B, 1, H, D, dtype=dt)
        k = torch.randn(B, Sk, Hkv, D, dtype=dt)
        v = torch.randn(B, Sk, Hkv, D, dtype=dt)
        slopes = alibi_slopes(H)
        rb = torch.randn(H, 2 * 128 + 1)
        sinks = torch.randn(H)
        cases = {"plain": {}, "softcap 50": {"softcap": 50.0}, "ALiBi": {"alibi_slopes": slopes},
                 "rel_bias M 128": {"rel_bias": rb},
                 "all + sinks": {"softcap": 50.0, "alibi_slopes": slopes, "rel_bias": rb,
                                 "sinks": sinks}}
        byts = 2 * k.numel() * k.element_size()
        fns = {"roof": read_roof_method(byts)}
        for name, kw in cases.items():
            fns[name] = lambda kw=kw: attn_ext.attention(q, k, v, causal=True, **kw)
            fns[name + " tiled"] = _tiled(fns[name])
            choice = attn_ext.explain(q, k, v, causal=True, **kw).forward
            assert choice == "cpu.decode", (name, choice)
            want = reference.attention(q.double(), k.double(), v.double(), causal=True,
                                       **{n: t.double() if torch.is_tensor(t) else t
                                          for n, t in kw.items()})
            tol = 1e-4 if dt == torch.float32 else 3e-2
            for fn in (fns[name], fns[name + " tiled"]):
                err = (fn().double() - want).abs().max().item()
                assert err < tol, f"validation failed: {name} {err}"
        t = interleaved_medians(fns, args.repeats)
        roof = byts / t["roof"] / 1e9
        dname = DTYPE_NAMES[dt]
        for name in cases:
            bw = byts / t[name] / 1e9
            print(f"| {B} | {Sk} | {H}/{Hkv} | {D} | {dname} | {name} | {roof:.1f} | "
                  f"{t[name] * 1e3:.2f} | {bw:.1f} | {100 * bw / roof:.0f} % | "
                  f"{t[name] / t['plain']:.2f} | {t[name + ' tiled'] * 1e3:.2f} | "
                  f"{t[name + ' tiled'] / t[name]:.2f} |")


def part_decode_rows(args):
    print("\n## decode with a few query rows (Sq = 2, 4: speculative decoding, short chunks), "
          "causal, interleaved calls\n")
    print("| B | Sq | Sk | H/Hkv | D | dtype | window | read roof GB/s | ours ms | ours GB/s | "
          "% roof | SDPA ms | ours/SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dt in (torch.float32, torch.bfloat16):
        for Sq, window in ((2, None), (4, None), (2, (2047, 0))):
            B, Sk, H, Hkv, D = 1, 1024 if args.quick else 4096, 32, 8, 128
            q = torch.randn(B, Sq, H, D, dtype=dt)
            k = torch.randn(B, Sk, Hkv, D, dtype=dt)
            v = torch.randn(B, Sk, Hkv, D, dtype=dt)
            # SDPA's is_causal aligns top-left: the bottom-right band as an explicit mask
            d = (torch.arange(Sq)[:, None] + (Sk - Sq)) - torch.arange(Sk)[None, :]
            seen = (d >= 0) if window is None else ((d >= 0) & (d <= window[0]))
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            ours = lambda: attn_ext.attention(q, k, v, causal=True, window=window)
            sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=seen, enable_gqa=True)
            assert attn_ext.explain(q, k, v, causal=True, window=window).forward == "cpu.decode"
            err = (ours().float() - sdpa().transpose(1, 2).float()).abs().max().item()
            assert err < (1e-4 if dt == torch.float32 else 2e-2), f"validation failed: {err}"
            # the bytes of the keys some row sees (a window reads only its band)
            byts = 2 * B * int(seen.any(0).sum()) * Hkv * D * k.element_size()
            t = interleaved_medians({"ours": ours, "sdpa": sdpa, "roof": read_roof_method(byts)},
                                    args.repeats)
            roof = byts / t["roof"] / 1e9
            bw = byts / t["ours"] / 1e9
            dname = DTYPE_NAMES[dt]
            wname = "-" if window is None else f"({window[0]}, {window[1]})"
            print(f"| {B} | {Sq} | {Sk} | {H}/{Hkv} | {D} | {dname} | {wname} | {roof:.1f} | "
                  f"{t['ours'] * 1e3:.2f} | {bw:.1f} | {100 * bw / roof:.0f} % | "
                  f"{t['sdpa'] * 1e3:.2f} | {t['sdpa'] / t['ours']:.2f} |")


_SHORT_CHILD = """
import resource, statistics, sys, time, torch
import torch.nn.functional as F
sys.path[0] = sys.argv[1]
from _env import checkout_first
checkout_first()
import attn_ext
torch.set_num_threads(int(sys.argv[2]))
B, Sq, Sk, H, Hkv, D = (int(x) for x in sys.argv[3].split(","))
dt = getattr(torch, sys.argv[4]); repeats = int(sys.argv[5])
q = torch.randn(B, Sq, H, D, dtype=dt)
k, v = (torch.randn(B, Sk, Hkv, D, dtype=dt) for _ in range(2))
seen = (torch.arange(Sq)[:, None] + (Sk - Sq)) >= torch.arange(Sk)[None, :]  # bottom-right
qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
ours = lambda: attn_ext.attention(q, k, v, causal=True)
sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=seen, enable_gqa=True)
def timed(f):
    a = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter(); f(); t = time.perf_counter() - t
    return t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - a
ours()  # (warm-up: thread pool; no other method has run in this process yet)
first = [timed(ours) for _ in range(10)]  # ours alone, first: calls 2-11 of the process
steady = [timed(ours) for _ in range(max(20, 2 * repeats))]  # then alone, on
ref = sdpa()
err = (ours().float() - ref.transpose(1, 2).float()).abs().max().item()
assert err < (1e-4 if dt == torch.float32 else 2e-2), f"validation failed: {err}"
inter = [(timed(ours), timed(sdpa)) for _ in range(repeats)]  # then interleaved with SDPA
med = lambda xs: statistics.median(xs)
print(str(attn_ext.explain(q, k, v, causal=True)).splitlines()[1].split()[1],
      med([t for t, _ in first]), med([n for _, n in first]),
      med([t for t, _ in steady]), med([n for _, n in steady]),
      med([o[0] for o, _ in inter]), med([o[1] for o, _ in inter]), med([s[0] for _, s in inter]))
"""


def part_short_rows(args):
    """Short query blocks that one tile per (sequence, kv head) covers (MQA decode, GQA with
    Sq * H / Hkv past the decode kernel's 16 columns), each row in a fresh process: ours alone
    first (calls 2-11 of the process, then 20+ more: the state a model's own loop sees), then
    interleaved with SDPA (whose large frees move glibc's mmap threshold, so that our later
    calls page-fault less)."""
    print("\n## short query blocks, one tile per kv head (causal; each row in a fresh process: "
          "ours alone, then interleaved with SDPA), ms per call and minor page faults per call\n")
    print("| B | Sq | Sk | H/Hkv | D | dtype | path | ours, calls 2-11 ms | faults / call | "
          "ours alone after them ms | faults / call | ours interleaved ms | faults / call | "
          "SDPA ms | SDPA / ours alone after them |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    Sk = 1024 if args.quick else 4096
    rows = [(1, 1, Sk, 32, 1, 128), (1, 8, Sk, 32, 8, 128), (1, 16, Sk, 32, 8, 128),
            (1, 3, Sk, 64, 8, 128)]
    for dt in ("float32", "bfloat16"):
        for shape in rows:
            out = subprocess.run([sys.executable, "-c", _SHORT_CHILD, HERE, str(torch.get_num_threads()),
                                  ",".join(map(str, shape)), dt, str(max(3, args.repeats))],
                                 capture_output=True, text=True, check=True, cwd=HERE).stdout
            path, first, ff, alone, fa, inter, fi, sd = out.strip().splitlines()[-1].split()
            B, Sq, Sk_, H, Hkv, D = shape
            print(f"| {B} | {Sq} | {Sk_} | {H}/{Hkv} | {D} | {DTYPE_NAMES[getattr(torch, dt)]} | "
                  f"{path} | {float(first) * 1e3:.2f} | {float(ff):.0f} | {float(alone) * 1e3:.2f} | "
                  f"{float(fa):.0f} | {float(inter) * 1e3:.2f} | {float(fi):.0f} | "
                  f"{float(sd) * 1e3:.2f} | {float(sd) / float(alone):.2f} |")


def part_overhead(args):
    """Per-call cost of small decode steps, where the call path, not K / V, dominates."""
    from attn_ext import ops as _ops

    calls = 20 if args.quick else 200  # calls per timed sample (one sample: median per call)
    print("\n## per-call cost of small decode steps (Sq = 1, causal), microseconds per call, "
          f"medians of samples of {calls} back-to-back calls, interleaved\n")
    print("wrapper: attn_ext.attention (below the op's Python Autograd kernel when it records "
          "nothing); wrapper, usual path: the same with that fast path off; op: "
          "torch.ops.attn_ext.attention (through the Python Autograd kernel); op, inference "
          "mode: no Python kernel at all (the floor); the inference-mode columns run each "
          "sample's calls inside one torch.inference_mode() (the wrapper then calls the op at "
          "once); rope_qk in place: attn_ext.rope_qk(..., inplace=True) on the step's q and k, "
          "fast path on / off\n")
    print("| B | Sk | H/Hkv | D | dtype | wrapper | wrapper, usual path | op | op, inference mode "
          "| wrapper, inference mode | SDPA | SDPA, inference mode | SDPA / wrapper "
          "| SDPA / wrapper, usual path | SDPA / wrapper, inference mode | rope_qk in place "
          "| rope_qk, usual path |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    real = _ops._plain_eager_call

    def repeat(fn, usual=False, inference=False):
        def run():
            if usual:
                _ops._plain_eager_call = lambda a: False
            try:
                with torch.inference_mode(inference):
                    for _ in range(calls):
                        fn()
            finally:
                _ops._plain_eager_call = real
        return run

    for Sk, dt in ((16, torch.bfloat16), (16, torch.float32), (512, torch.bfloat16)):
        B, H, Hkv, D = 1, 32, 8, 128
        q = torch.randn(B, 1, H, D, dtype=dt)
        k = torch.randn(B, Sk, Hkv, D, dtype=dt)
        v = torch.randn(B, Sk, Hkv, D, dtype=dt)
        kn = torch.randn(B, 1, Hkv, D, dtype=dt)
        cos, sin = attn_ext.rope_cache(Sk + 1, D, dtype=torch.float32)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        wrapper = lambda: attn_ext.attention(q, k, v, causal=True)
        op = lambda: torch.ops.attn_ext.attention(q, k, v, True)
        sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        rope = lambda: attn_ext.rope_qk(q, kn, cos, sin, offset=Sk, inplace=True)
        # (Sq = 1: SDPA's top-left is_causal and ours agree; no mask is needed)
        err = (wrapper().float() - sdpa().transpose(1, 2).float()).abs().max().item()
        assert err < (1e-4 if dt == torch.float32 else 2e-2), f"validation failed: {err}"
        t = interleaved_medians({"wrapper": repeat(wrapper), "usual": repeat(wrapper, True),
                                 "op": repeat(op), "inference": repeat(op, inference=True),
                                 "wrapper_inference": repeat(wrapper, inference=True),
                                 "sdpa": repeat(sdpa), "sdpa_inference": repeat(sdpa, inference=True),
                                 "rope": repeat(rope),
                                 "rope_usual": repeat(rope, True)}, args.repeats)
        us = {n: v / calls * 1e6 for n, v in t.items()}
        print(f"| {B} | {Sk} | {H}/{Hkv} | {D} | {DTYPE_NAMES[dt]} | {us['wrapper']:.1f} | "
              f"{us['usual']:.1f} | {us['op']:.1f} | {us['inference']:.1f} | "
              f"{us['wrapper_inference']:.1f} | {us['sdpa']:.1f} | {us['sdpa_inference']:.1f} | "
              f"{us['sdpa'] / us['wrapper']:.2f} | {us['sdpa'] / us['usual']:.2f} | "
              f"{us['sdpa_inference'] / us['wrapper_inference']:.2f} | "
              f"{us['rope']:.1f} | {us['rope_usual']:.1f} |")


def part_cache_lengths(args):
    """Decode steps at every cache length from 8 n to 8 n + 7: a decode loop meets them all,
    one per step, where the decode rows above are multiples of 8. The decode kernel reads whole
    8-key groups in place and packs the rest of a unit's keys (RESULTS.md, forty-seventh
    session)."""
    calls = 20 if args.quick else 100  # calls per timed sample (one sample: median per call)
    print("\n## decode steps at cache lengths 8 n + t (Sq = 1, causal, B = 1, 32/8 heads, D = 128), "
          f"microseconds per call, medians of samples of {calls} back-to-back calls, "
          "interleaved with SDPA; ours: attn_ext.attention under torch.no_grad()\n")
    print("| Sk | dtype | ours us | ours / ours at 8 n | SDPA us | SDPA / ours |")
    print("|---|---|---|---|---|---|")
    bases = (16,) if args.quick else (16, 512)
    # (a warm-up first: the thread pool and glibc's heap settle over the first calls of a
    # process, and the first row measured up to 1.7x slower than the same call later)
    q = torch.randn(1, 1, 32, 128)
    k, v = torch.randn(1, 17, 8, 128), torch.randn(1, 17, 8, 128)
    with torch.no_grad():
        for _ in range(10 * calls):
            attn_ext.attention(q, k, v, causal=True)
            F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           enable_gqa=True)
    for dt in (torch.float32, torch.bfloat16):
        for base in bases:
            at_base = None
            for Sk in range(base, base + 8):
                B, H, Hkv, D = 1, 32, 8, 128
                q = torch.randn(B, 1, H, D, dtype=dt)
                k = torch.randn(B, Sk, Hkv, D, dtype=dt)
                v = torch.randn(B, Sk, Hkv, D, dtype=dt)
                qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

                def ours():
                    with torch.no_grad():
                        for _ in range(calls):
                            attn_ext.attention(q, k, v, causal=True)

                def sdpa():
                    with torch.no_grad():
                        for _ in range(calls):
                            F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

                # (Sq = 1: SDPA's top-left is_causal and ours agree; no mask is needed)
                got = attn_ext.attention(q, k, v, causal=True).float()
                want = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2).float()
                err = (got - want).abs().max().item()
                assert err < (1e-4 if dt == torch.float32 else 2e-2), f"validation failed: {err}"
                t = interleaved_medians({"ours": ours, "sdpa": sdpa}, max(args.repeats, 3))
                us = {n: x / calls * 1e6 for n, x in t.items()}
                if at_base is None:
                    at_base = us["ours"]
                print(f"| {Sk} | {DTYPE_NAMES[dt]} | {us['ours']:.1f} | {us['ours'] / at_base:.2f} | "
                      f"{us['sdpa']:.1f} | {us['sdpa'] / us['ours']:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--parts", default="decode,layout,train,memory")
    ap.add_argument("--decode-caches", choices=["interleaved", "cold"], default="interleaved",
                    help="decode rows: time back-to-back interleaved calls (the default, as "
                         "issue 16's table was measured) or evict the caches before every timed "
                         "call (cold)")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 2
    print_env_header("cpu")
    parts = {"decode": part_decode, "layout": part_layout, "train": part_train, "memory": part_memory,
             "nonfinite": part_nonfinite, "terms": part_terms, "decode-rows": part_decode_rows,
             "overhead": part_overhead, "short-rows": part_short_rows,
             "cache-lengths": part_cache_lengths}
    for name in args.parts.split(","):
        parts[name](args)


if __name__ == "__main__":
    main()
