#!/usr/bin/env python3
"""CPU emulation of csrc/cuda/attention_fwd_kernel.cuh, lane by lane, to check its fragment
index math (ldmatrix / ldmatrix.trans addresses, mma.m16n8k16 fragment maps, P register
reuse), tile loop, masking, online softmax and epilogue without a GPU.

The PTX semantics emulated (PTX ISA, "Matrix fragments for mma.m16n8k16" and "ldmatrix"):
  ldmatrix .x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; lane l receives, in
    register i, row l/4 and columns 2(l%4), 2(l%4)+1 of matrix i (.trans: of its transpose).
  mma m16n8k16 (row.col), g = l/4, t = l%4:
    A: a0 = A[g][2t:2t+2], a1 = A[g+8][2t:2t+2], a2 = A[g][2t+8:2t+10], a3 = A[g+8][2t+8:2t+10]
    B: b0 = B[2t:2t+2][g], b1 = B[2t+8:2t+10][g]
    C: c0,c1 = C[g][2t:2t+2], c2,c3 = C[g+8][2t:2t+2]
The emulation mirrors the kernel's code line by line (same names) in float64, so it checks
indexing, not rounding. Compare its output with a plain softmax(QK^T)V.

  python tools/fa2_emulate.py        # a few shapes, prints max errors, exit 1 on mismatch
"""

from __future__ import annotations

import math
import sys

import numpy as np

G = np.arange(32) // 4  # quad row of each lane
T4 = np.arange(32) % 4  # column pair of each lane


def ldmatrix_x4(smem, addr_rc, trans=False):
    """smem: 2-D array (rows, stride); addr_rc: per lane (row, col) of the 8 contiguous
    elements it points at. Returns regs[lane][i] = (lo, hi) pair of matrix i."""
    regs = np.zeros((32, 4, 2))
    for i in range(4):
        mat = np.stack([smem[addr_rc[8 * i + r][0], addr_rc[8 * i + r][1]: addr_rc[8 * i + r][1] + 8]
                        for r in range(8)])  # (8, 8): row r from lane 8i + r
        if trans:
            mat = mat.T
        for l in range(32):
            regs[l, i] = mat[l // 4, 2 * (l % 4): 2 * (l % 4) + 2]
    return regs


def mma(d, a, b0, b1):
    """d: (32, 4) accumulators; a: (32, 4, 2); b0, b1: (32, 2). d += A @ B (16x16 @ 16x8)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for l in range(32):
        g, t = l // 4, l % 4
        A[g, 2 * t: 2 * t + 2] = a[l, 0]
        A[g + 8, 2 * t: 2 * t + 2] = a[l, 1]
        A[g, 2 * t + 8: 2 * t + 10] = a[l, 2]
        A[g + 8, 2 * t + 8: 2 * t + 10] = a[l, 3]
        B[2 * t: 2 * t + 2, g] = b0[l]
        B[2 * t + 8: 2 * t + 10, g] = b1[l]
    C = A @ B
    for l in range(32):
        g, t = l // 4, l % 4
        d[l, 0:2] += C[g, 2 * t: 2 * t + 2]
        d[l, 2:4] += C[g + 8, 2 * t: 2 * t + 2]


def fa2_fwd_cta(q, k, v, Sq, Sk, D, causal, scale, m_block, out, lse):
    """One CTA (query tile m_block) of fa2_fwd_kernel for one (b, h); q (Sq, D), k/v (Sk, D)."""
    kBlockM = kBlockN = 64
    kStride = D + 8
    kNTiles, kDTiles = kBlockN // 8, D // 8
    m0 = m_block * kBlockM
    diag = Sk - Sq
    n_end = Sk
    if causal:
        n_end = min(min(m0 + kBlockM, Sq) + diag, Sk)
    n_tiles = (n_end + kBlockN - 1) // kBlockN if n_end > 0 else 0
    if n_tiles == 0:
        for r in range(m0, min(m0 + kBlockM, Sq)):
            out[r] = 0
            lse[r] = -math.inf
        return

    def load_tile(g, row0, nrows):
        s = np.full((64, kStride), np.nan)  # padding columns never read: NaN would show it
        for r in range(64):
            s[r, :D] = g[row0 + r] if row0 + r < nrows else 0.0
        return s

    sQ = load_tile(q, m0, Sq)
    log2e = 1.0 / math.log(2.0)
    scale_log2 = scale * log2e
    for warp in range(4):
        lane = np.arange(32)
        acc_o = np.zeros((kDTiles, 32, 4))
        row_max = np.full((2, 32), -np.inf)
        row_sum = np.zeros((2, 32))
        row_a = m0 + warp * 16 + G
        row_b = row_a + 8
        lrow = (lane & 7) + ((lane >> 3) & 1) * 8
        lcol = (lane >> 4) * 8
        krow = (lane & 7) + (lane >> 4) * 8
        kcol = ((lane >> 3) & 1) * 8
        for n in range(n_tiles):
            n0 = n * kBlockN
            sKb = load_tile(k, n0, Sk)
            sVb = load_tile(v, n0, Sk)
            s = np.zeros((kNTiles, 32, 4))
            for kk in range(D // 16):
                a = ldmatrix_x4(sQ, [(warp * 16 + lrow[l], kk * 16 + lcol[l]) for l in range(32)])
                for nn in range(kBlockN // 16):
                    bk = ldmatrix_x4(sKb, [(nn * 16 + krow[l], kk * 16 + kcol[l]) for l in range(32)])
                    mma(s[2 * nn], a, bk[:, 0], bk[:, 1])
                    mma(s[2 * nn + 1], a, bk[:, 2], bk[:, 3])
            s *= scale_log2
            need_mask = (n0 + kBlockN > Sk) or (causal and n0 + kBlockN - 1 > m0 + diag)
            if need_mask:
                for t in range(kNTiles):
                    for e in range(4):
                        key = n0 + t * 8 + (lane & 3) * 2 + (e & 1)
                        row = row_a if e < 2 else row_b
                        ok = (key < Sk) & ((not causal) | (key <= row + diag))
                        s[t, ~ok, e] = -np.inf
            for r in range(2):
                mx = np.max(np.maximum(s[:, :, 2 * r], s[:, :, 2 * r + 1]), axis=0)  # (32,)
                mx = np.maximum(mx, mx[lane ^ 1])
                mx = np.maximum(mx, mx[lane ^ 2])
                m_new = np.maximum(row_max[r], mx)
                m_use = np.where(m_new == -np.inf, 0.0, m_new)
                corr = np.exp2(row_max[r] - m_use)
                row_max[r] = m_new
                row_sum[r] *= corr
                acc_o[:, :, 2 * r] *= corr
                acc_o[:, :, 2 * r + 1] *= corr
                s[:, :, 2 * r] = np.exp2(s[:, :, 2 * r] - m_use)
                s[:, :, 2 * r + 1] = np.exp2(s[:, :, 2 * r + 1] - m_use)
                row_sum[r] += (s[:, :, 2 * r] + s[:, :, 2 * r + 1]).sum(axis=0)
            for kk in range(kBlockN // 16):
                a = np.zeros((32, 4, 2))
                a[:, 0] = s[2 * kk][:, 0:2]
                a[:, 1] = s[2 * kk][:, 2:4]
                a[:, 2] = s[2 * kk + 1][:, 0:2]
                a[:, 3] = s[2 * kk + 1][:, 2:4]
                for dd in range(D // 16):
                    bv = ldmatrix_x4(sVb, [(kk * 16 + lrow[l], dd * 16 + lcol[l]) for l in range(32)],
                                     trans=True)
                    mma(acc_o[2 * dd], a, bv[:, 0], bv[:, 1])
                    mma(acc_o[2 * dd + 1], a, bv[:, 2], bv[:, 3])
        for r in range(2):
            l = row_sum[r].copy()
            l = l + l[lane ^ 1]
            l = l + l[lane ^ 2]
            empty = ~(l > 0)
            inv = np.where(empty, 0.0, 1.0 / np.where(empty, 1.0, l))
            row = row_a if r == 0 else row_b
            for ln in range(32):
                if row[ln] < Sq:
                    for t in range(kDTiles):
                        c = t * 8 + (ln & 3) * 2
                        out[row[ln], c: c + 2] = acc_o[t, ln, 2 * r: 2 * r + 2] * inv[ln]
                    if ln & 3 == 0:
                        lse[row[ln]] = -math.inf if empty[ln] else (row_max[r][ln] + math.log2(l[ln])) * math.log(2.0)


def reference(q, k, v, causal, scale):
    Sq, Sk = q.shape[0], k.shape[0]
    s = q @ k.T * scale
    if causal:
        i = np.arange(Sq)[:, None]
        j = np.arange(Sk)[None, :]
        s = np.where(j <= i + (Sk - Sq), s, -np.inf)
    mx = s.max(axis=1, keepdims=True)
    mx = np.where(np.isinf(mx), 0, mx)
    p = np.exp(s - mx)
    l = p.sum(axis=1, keepdims=True)
    out = np.where(l > 0, p @ v / np.where(l > 0, l, 1), 0)
    lse = np.where(l[:, 0] > 0, np.log(np.where(l[:, 0] > 0, l[:, 0], 1)) + mx[:, 0], -np.inf)
    return out, lse


def main() -> int:
    rng = np.random.default_rng(0)
    bad = 0
    for Sq, Sk, D, causal in [(64, 64, 64, False), (70, 130, 64, True), (130, 70, 16, True),
                              (5, 200, 32, True), (100, 37, 128, False), (65, 1, 16, True)]:
        q, k, v = (rng.standard_normal((n, D)) for n in (Sq, Sk, Sk))
        scale = 1 / math.sqrt(D)
        out = np.full((Sq, D), np.nan)
        lse = np.full(Sq, np.nan)
        for m_block in range((Sq + 63) // 64):
            fa2_fwd_cta(q, k, v, Sq, Sk, D, causal, scale, m_block, out, lse)
        r_out, r_lse = reference(q, k, v, causal, scale)
        e_out = np.nanmax(np.abs(out - r_out)) if not np.isnan(out).any() else np.inf
        same_inf = np.array_equal(np.isinf(lse), np.isinf(r_lse))
        fin = np.isfinite(r_lse)
        e_lse = np.abs(lse[fin] - r_lse[fin]).max() if fin.any() else 0.0
        ok = e_out < 1e-9 and same_inf and e_lse < 1e-9 and not np.isnan(lse).any()
        bad += not ok
        print(f"Sq={Sq:4d} Sk={Sk:4d} D={D:3d} causal={causal!s:5}: out err {e_out:.2e}, "
              f"lse err {e_lse:.2e}, -inf rows match {same_inf}  {'ok' if ok else 'MISMATCH'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
