#!/usr/bin/env python3
"""CPU emulation of csrc/cuda/attention_fwd_kernel.cuh and attention_bwd_kernel.cuh, lane by
lane, to check their fragment index math (ldmatrix / ldmatrix.trans addresses, mma.m16n8k16
fragment maps, register reuse of P and dS^T, the dS^T round trip through shared memory), tile
loops, masking, online softmax, GQA head walk and epilogues without a GPU.

The PTX semantics emulated (PTX ISA, "Matrix fragments for mma.m16n8k16" and "ldmatrix"):
  ldmatrix .x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; lane l receives, in
    register i, row l/4 and columns 2(l%4), 2(l%4)+1 of matrix i (.trans: of its transpose).
  mma m16n8k16 (row.col), g = l/4, t = l%4:
    A: a0 = A[g][2t:2t+2], a1 = A[g+8][2t:2t+2], a2 = A[g][2t+8:2t+10], a3 = A[g+8][2t+8:2t+10]
    B: b0 = B[2t:2t+2][g], b1 = B[2t+8:2t+10][g]
    C: c0,c1 = C[g][2t:2t+2], c2,c3 = C[g+8][2t:2t+2]
The emulation mirrors the kernel's code line by line (same names) in float64, so it checks
indexing, not rounding. Compare its output with a plain softmax(QK^T)V.

Masks (causal, window, key padding) follow the kernels: the tile ranges, the full tiles and
the per-tile predicate come from the visibility layer itself (csrc/common/attention_mask.h,
asked through tools/mask_probe.cpp: band_keys_of_rows / band_rows_of_keys, full_key_tiles /
full_row_tiles, TileBand), the padding rules (all-padded tiles skipped, a padded key makes a
tile partial) are the kernels' own; check_rule_against_header checks the header's answers
against its own predicate and classify(), and the reference is DESIGN.md's rule written out.
Packed sequences (per-sequence pointer offsets) and the rare exact paths for non-finite
values are not emulated.

The kernels' tile constants (FwdTraits / BwdTraits and the kernels' constexpr locals), their
ldmatrix lane maps (lrow, lcol, krow, kcol, g, c2) and the head dims the kernels are built for
are read from the headers (tools/kernel_constants.py), not retyped: an edit of the kernel is
an edit of what is emulated, and the cases below cover exactly the built head dims.

  python tools/fa2_emulate.py        # a few shapes, prints max errors, exit 1 on mismatch
"""

from __future__ import annotations

import functools
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_constants as kc  # noqa: E402

# ---- dropout (common/dropout_rng.h), for the kernels' word / field logic and the reference --
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _load_reference_mix():
    """attn_ext/reference.py's SplitMix64 finaliser (the file alone: no extension needed)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "attn_ext",
                        "reference.py")
    spec = importlib.util.spec_from_file_location("attn_ext_reference_for_emulation", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._mix64


_mix = _load_reference_mix()


def _row_key(seed, offset, b, h, i):
    """dropout::row_key of global row(s) i (numpy uint64)."""
    r = _mix(_mix(np.uint64(seed)) ^ np.uint64(offset))
    r = _mix(_mix(r ^ np.uint64(b)) ^ np.uint64(h))
    return _mix(r ^ np.asarray(i, dtype=np.uint64))


def _word(rk, col):
    with np.errstate(over="ignore"):
        return _mix(rk ^ ((np.asarray(col, dtype=np.int64) >> 2).astype(np.uint64) * _GOLDEN))


def _field(w, col):
    return (w >> (np.uint64(16) * (np.asarray(col, dtype=np.int64) & 3).astype(np.uint64))) & np.uint64(0xFFFF)


def keep_mask(drop, Sq, Sk, h=0):
    """(Sq, Sk) keep bits of DESIGN.md's rule written out per element (the reference side):
    drop = (p, seed, offset, row0, col0), batch 0, head h, global rows row0 + i, keys col0 + j."""
    p, seed, offset, row0, col0 = drop
    rk = _row_key(seed, offset, 0, h, row0 + np.arange(Sq))[:, None]
    col = col0 + np.arange(Sk)[None, :]
    return _field(_word(rk, col), col) >= np.uint64(int(p * 65536.0 + 0.5))


G = np.arange(32) // 4  # quad row of each lane (the mma C fragment map)
T4 = np.arange(32) % 4  # column pair of each lane


@functools.lru_cache(maxsize=None)
def fwd_constants(D: int) -> dict:
    """FwdTraits<D> and fa2_fwd_kernel's constexpr locals, from attention_fwd_kernel.cuh."""
    return kc.kernel_locals(kc.FWD, "fa2_fwd_kernel", kc.traits(kc.FWD, "FwdTraits", D))


@functools.lru_cache(maxsize=None)
def bwd_constants(D: int) -> dict:
    """BwdTraits<D> and fa2_bwd_kernel's constexpr locals, from attention_bwd_kernel.cuh."""
    return kc.kernel_locals(kc.BWD, "fa2_bwd_kernel", kc.traits(kc.BWD, "BwdTraits", D))


LANE = np.arange(32)
FWD_LANES = kc.lane_maps(kc.FWD, "fa2_fwd_kernel", ["lrow", "lcol", "krow", "kcol"], LANE)
BWD_LANES = kc.lane_maps(kc.BWD, "fa2_bwd_kernel", ["lrow", "lcol", "krow", "kcol", "g", "c2"], LANE)


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


# ---- masks: the kernels ask the visibility layer (csrc/common/attention_mask.h); so does the
# emulator, through tools/mask_probe.cpp compiled from the same header ----------------------

INVISIBLE, PARTIAL, FULL = 0, 1, 2  # TileKind


_MASK_PROBE = {}


def mask_probe():
    """Path of tools/mask_probe (built from csrc/common/attention_mask.h with g++ on demand, once
    per process and tree, in a temporary directory removed when the process exits)."""
    import atexit
    import shutil
    import subprocess
    import tempfile

    # the headers of kc.ROOT (the tree whose kernels are emulated), this tool's probe source
    root = kc.ROOT
    exe = _MASK_PROBE.get(root)
    if exe is None:
        tmp = tempfile.mkdtemp(prefix="attn_ext_mask_probe_")
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        exe = os.path.join(tmp, "mask_probe")
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mask_probe.cpp")
        subprocess.run(["g++", "-std=c++17", "-O1", "-I", os.path.join(root, "csrc"), src,
                        "-o", exe], check=True)
        _MASK_PROBE[root] = exe
    return exe


def ask_header(lines):
    import subprocess

    res = subprocess.run([mask_probe()], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, check=True)
    return res.stdout.split("\n")


class Mask:
    """One problem's mask: spec True / False (causal or not) or (left, right, padding) with
    padding None, "left" (the first Sk // 3 keys padded) or "random"; kpm (Sk,) bool or None.
    tiles(M, N) asks the header, once, every answer a kernel with (M, N) tiles needs: the key
    range of each query tile, the row range of each key tile, each tile's class and TileBand."""

    def __init__(self, Sq, Sk, spec, rng=None):
        self.Sq, self.Sk = Sq, Sk
        if spec is True or spec is False:
            spec = (-1, 0 if spec else -1, None)
        left, right, pad = spec
        self.left, self.right = left, right
        if pad is None:
            self.kpm = None
        elif pad == "left":
            self.kpm = np.arange(Sk) >= Sk // 3
        else:
            self.kpm = (rng if rng is not None else np.random.default_rng(1)).random(Sk) > 0.3
        self.masked = left >= 0 or right >= 0 or self.kpm is not None  # not Visibility::dense()
        self._tiles = {}

    def __str__(self):
        pad = "" if self.kpm is None else f" pad{int((~self.kpm).sum())}"
        return f"w=({self.left},{self.right}){pad}"

    def tiles(self, M, N):
        if (M, N) in self._tiles:
            return self._tiles[(M, N)]
        Sq, Sk, l, r = self.Sq, self.Sk, self.left, self.right
        head = f"{Sq} {Sk} {l} {r}"
        lines, keys = [], []
        for m0 in range(0, Sq, M):
            lines.append(f"keys {head} {m0} {min(m0 + M, Sq)}")
            keys.append(("keys", m0))
            lines.append(f"fullkeys {head} {m0} {min(m0 + M, Sq)} {N}")
            keys.append(("fullkeys", m0))
        for n0 in range(0, Sk, N):
            lines.append(f"rows {head} {n0} {min(n0 + N, Sk)}")
            keys.append(("rows", n0))
            lines.append(f"fullrows {head} {n0} {min(n0 + N, Sk)} {M}")
            keys.append(("fullrows", n0))
        for m0 in range(0, Sq, M):
            for n0 in range(0, Sk, N):
                lines.append(f"class {head} {m0} {min(m0 + M, Sq)} {n0} {min(n0 + N, Sk)}")
                keys.append(("class", (m0, n0)))
                lines.append(f"tile {head} {m0} {n0} {M} {N}")
                keys.append(("tile", (m0, n0)))
        t = {"keys": {}, "rows": {}, "fullkeys": {}, "fullrows": {}, "class": {}, "tile": {}}
        for (kind, at), ans in zip(keys, ask_header(lines)):
            vals = [int(x) for x in ans.split()]
            t[kind][at] = vals[0] if kind == "class" else tuple(vals)
        self._tiles[(M, N)] = t
        return t

    def visible(self):
        """(Sq, Sk) bool: DESIGN.md's rule written out plainly (for the reference)."""
        i = np.arange(self.Sq)[:, None]
        j = np.arange(self.Sk)[None, :]
        d = i + (self.Sk - self.Sq) - j
        ok = np.ones((self.Sq, self.Sk), bool)
        if self.right >= 0:
            ok &= d >= -self.right
        if self.left >= 0:
            ok &= d <= self.left
        if self.kpm is not None:
            ok &= self.kpm[None, :]
        return ok


def band_ok(tb, r, c):
    """TileBand::ok (mask_probe's "tileok" checks it against band_visible); numpy arrays."""
    lo, hi, row_lim, key_lim = tb
    return (r < row_lim) & (c < key_lim) & (r - c >= lo) & (r - c <= hi)


def check_rule_against_header(Sq, Sk, D, spec) -> bool:
    """The header's tile answers the kernels use are consistent with its own predicate on every
    tile of the problem: the key range of a query tile holds every visible key, a tile called
    full / invisible has all / none of its pairs visible, and TileBand agrees with band_visible
    (forward and backward tile sizes)."""
    mask = Mask(Sq, Sk, spec)
    vis_band = Mask(Sq, Sk, (mask.left, mask.right, None)).visible()
    ok = True
    sizes = [(fwd_constants(D)["kBlockM"], fwd_constants(D)["kBlockN"])]
    if D in kc.bwd_fast_head_dims():
        sizes.append((bwd_constants(D)["kBlockM"], bwd_constants(D)["kBlockN"]))
    head = f"{Sq} {Sk} {mask.left} {mask.right}"
    for M, N in sizes:
        t = mask.tiles(M, N)
        lines = []
        for m0 in range(0, Sq, M):
            lo, hi = t["keys"][m0]
            rows = vis_band[m0: m0 + M]
            ok &= not rows[:, :lo].any() and not rows[:, hi:].any()
            f_lo, f_hi = t["fullkeys"][m0]
            for n0 in range(0, Sk, N):
                cls = t["class"][(m0, n0)]
                ok &= (cls == FULL) == (f_lo <= n0 // N < f_hi)  # full_key_tiles == classify
                if hi > lo and lo // N <= n0 // N < (hi + N - 1) // N:
                    ok &= cls != INVISIBLE  # the walked tiles are never invisible by the band
                blk = vis_band[m0: m0 + M, n0: n0 + N]
                if cls == FULL:
                    ok &= bool(blk.all())
                elif cls == INVISIBLE:
                    ok &= not blk.any()
                r = np.arange(M)[:, None]
                c = np.arange(N)[None, :]
                got = band_ok(t["tile"][(m0, n0)], r, c)
                want = np.zeros((M, N), bool)
                want[: blk.shape[0], : blk.shape[1]] = blk
                ok &= np.array_equal(got, want)
                lines.append(f"tileok {head} {m0} {n0} {M} {N}")
        for n0 in range(0, Sk, N):
            lo, hi = t["rows"][n0]
            cols = vis_band[:, n0: n0 + N]
            ok &= not cols[:lo].any() and not cols[hi:].any()
            f_lo, f_hi = t["fullrows"][n0]
            for m0 in range(0, Sq, M):
                cls = t["class"][(m0, n0)]
                ok &= (cls == FULL) == (f_lo <= m0 // M < f_hi)  # full_row_tiles == classify
                if hi > lo and lo // M <= m0 // M < (hi + M - 1) // M:
                    ok &= cls != INVISIBLE
        ok &= all(a == "1" for a in ask_header(lines)[: len(lines)])
    print(f"rule vs attention_mask.h Sq={Sq:4d} Sk={Sk:4d} D={D:3d} {mask!s:14}: "
          f"{'agree' if ok else 'DISAGREE'}")
    return ok


def fa2_fwd_cta(q, k, v, Sq, Sk, D, mask, scale, m_block, out, lse, slope=None, cap=None,
                rel=None, drop=None):
    """One CTA (query tile m_block) of fa2_fwd_kernel for one (b, h); q (Sq, D), k/v (Sk, D);
    mask: a Mask (the kernel's kMasked is mask.masked). slope / cap / rel (the head's table
    row, 2M + 1): the kTerms instances' ALiBi, softcap and rel_bias (None: plain)."""
    terms = slope is not None or cap is not None or rel is not None
    rel_m = (len(rel) - 1) // 2 if rel is not None else 0
    c = fwd_constants(D)
    kBlockM, kBlockN, kStride = c["kBlockM"], c["kBlockN"], c["kStride"]
    kNTiles, kDTiles = c["kNTiles"], c["kDTiles"]
    masked = mask.masked
    m0 = m_block * kBlockM
    m1 = min(m0 + kBlockM, Sq)
    hdr = mask.tiles(kBlockM, kBlockN)
    n_begin, n_end, full_lo, full_hi = 0, 0, 0, 0
    if not masked:
        n_end = full_hi = (Sk + kBlockN - 1) // kBlockN
    elif Sk > 0:
        lo, hi = hdr["keys"][m0]
        if hi > lo:
            n_begin, n_end = lo // kBlockN, (hi + kBlockN - 1) // kBlockN
            full_lo, full_hi = hdr["fullkeys"][m0]

    def tile_kind(n):
        n0 = n * kBlockN
        n1 = min(n0 + kBlockN, Sk)
        kind = FULL if full_lo <= n < full_hi else PARTIAL
        if kind == FULL and n0 + kBlockN > Sk:
            kind = PARTIAL
        kv = np.ones(kBlockN, bool)
        if masked and mask.kpm is not None and kind != INVISIBLE:
            keys = n0 + np.arange(kBlockN)
            kv = (keys < n1) & mask.kpm[np.minimum(keys, Sk - 1)]
            valid = int(kv.sum())
            if valid == 0:
                kind = INVISIBLE
            elif valid < n1 - n0:
                kind = PARTIAL
        return kind, kv

    tiles = []  # the key tiles the CTA visits, in order, with their class and padding bits
    for n in range(n_begin, n_end):
        kind, kv = tile_kind(n)
        if kind != INVISIBLE:
            tiles.append((n, kind, kv))
    if not tiles:
        for r in range(m0, m1):
            out[r] = 0
            lse[r] = -math.inf
        return

    def load_tile(g, row0, nrows, rows):
        s = np.full((rows, kStride), np.nan)  # padding columns never read: NaN would show it
        for r in range(rows):
            s[r, :D] = g[row0 + r] if row0 + r < nrows else 0.0
        return s

    sQ = load_tile(q, m0, Sq, kBlockM)
    log2e = 1.0 / math.log(2.0)
    scale_log2 = scale * log2e
    for warp in range(4):
        lane = np.arange(32)
        acc_o = np.zeros((kDTiles, 32, 4))
        row_max = np.full((2, 32), -np.inf)
        row_sum = np.zeros((2, 32))
        row_a = m0 + warp * 16 + G
        row_b = row_a + 8
        lrow, lcol, krow, kcol = (FWD_LANES[n] for n in ("lrow", "lcol", "krow", "kcol"))
        ra = warp * 16 + G
        rb = ra + 8
        for n, kind, kv in tiles:
            n0 = n * kBlockN
            sKb = load_tile(k, n0, Sk, kBlockN)
            sVb = load_tile(v, n0, Sk, kBlockN)
            s = np.zeros((kNTiles, 32, 4))
            for kk in range(D // 16):
                a = ldmatrix_x4(sQ, [(warp * 16 + lrow[l], kk * 16 + lcol[l]) for l in range(32)])
                for nn in range(kBlockN // 16):
                    bk = ldmatrix_x4(sKb, [(nn * 16 + krow[l], kk * 16 + kcol[l]) for l in range(32)])
                    mma(s[2 * nn], a, bk[:, 0], bk[:, 1])
                    mma(s[2 * nn + 1], a, bk[:, 2], bk[:, 3])
            s *= scale_log2
            if terms:  # ScoreTerms::add_row at d = row + off - key, 32-bit as the kernel
                d_row_key = (Sk - Sq) - n0 - (lane & 3) * 2
                for t in range(kNTiles):
                    for e in range(4):
                        d = m0 + (ra if e < 2 else rb) + d_row_key - (t * 8 + (e & 1))
                        x = s[t, :, e] * math.log(2.0)
                        if cap is not None:
                            x = cap * np.tanh(x / cap)
                        if slope is not None:
                            x = x - slope * np.abs(d)
                        if rel is not None:
                            x = x + rel[rel_m + np.clip(d, -rel_m, rel_m)]
                        s[t, :, e] = x * log2e
            if kind == PARTIAL:
                band = hdr["tile"][(m0, n0)]
                for t in range(kNTiles):
                    for e in range(4):
                        cc = t * 8 + (lane & 3) * 2 + (e & 1)
                        ok = band_ok(band, ra if e < 2 else rb, cc) & kv[cc]
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
            if drop is not None:  # the kernel's pair logic: one word per pair unless it straddles
                p_, seed, offset, row0, col0 = drop
                thresh = np.uint64(int(p_ * 65536.0 + 0.5))
                col_base = col0 + n0 + (lane & 3) * 2
                for t in range(kNTiles):
                    col = col_base + t * 8
                    for r in range(2):
                        rk = _row_key(seed, offset, 0, 0, row0 + m0 + (ra if r == 0 else rb))
                        w0 = _word(rk, col)
                        w1 = np.where((col & 3) == 3, _word(rk, col + 1), w0)
                        k0 = _field(w0, col) >= thresh
                        k1 = _field(w1, col + 1) >= thresh
                        s[t, :, 2 * r] = np.where(k0, s[t, :, 2 * r], 0.0)
                        s[t, :, 2 * r + 1] = np.where(k1, s[t, :, 2 * r + 1], 0.0)
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
            empty = l == 0
            inv = np.where(empty, 0.0, 1.0 / np.where(empty, 1.0, l))
            if drop is not None:  # 1 / (1 - p) in the epilogue, not on P
                inv = inv / (1 - drop[0])
            row = row_a if r == 0 else row_b
            for ln in range(32):
                if row[ln] < Sq:
                    for t in range(kDTiles):
                        c = t * 8 + (ln & 3) * 2
                        out[row[ln], c: c + 2] = acc_o[t, ln, 2 * r: 2 * r + 2] * inv[ln]
                    if ln & 3 == 0:
                        lse[row[ln]] = -math.inf if empty[ln] else (row_max[r][ln] + math.log2(l[ln])) * math.log(2.0)


def fa2_bwd_cta(q, k, v, do, lse, delta, Sq, Sk, D, mask, scale, n_block, dq_acc, dk, dv,
                slopes=None, cap=None, rel=None, drel=None, drop=None):
    """One CTA (key tile n_block, one kv head) of fa2_bwd_kernel. q, do: (group, Sq, D) (the
    query heads of the kv head); k, v: (Sk, D); lse, delta: (group, Sq); dq_acc: (group, Sq, D)
    accumulated; dk, dv: (Sk, D) written for this tile's keys; mask: a Mask. slopes (group,)
    / cap / rel (group, 2M + 1): the kTerms instances' ALiBi, softcap and rel_bias (None: the
    plain instances); drel (group, 2M + 1) accumulates d rel_bias (the CTA's shared sums)."""
    c = bwd_constants(D)
    kBlockM, kBlockN, kWarps = c["kBlockM"], c["kBlockN"], c["kWarps"]
    kStride, kDsStride = c["kStride"], c["kDsStride"]
    kQSub, kSubTiles, kDTiles = c["kQSub"], c["kSubTiles"], c["kDTiles"]
    kDqCols, kDqChunk = c["kDqCols"], c["kDqChunk"]
    group = q.shape[0]
    masked = mask.masked
    n0 = n_block * kBlockN
    n1 = min(n0 + kBlockN, Sk)
    hdr = mask.tiles(kBlockM, kBlockN)
    keys = n0 + np.arange(kBlockN)
    kok = keys < n1  # the keys' padding flags (kok_a / kok_b of each thread)
    if mask.kpm is not None:
        kok &= mask.kpm[np.minimum(keys, Sk - 1)]
    all_keys = bool(np.all(kok | (keys >= n1)))
    any_key = bool(kok.any())
    m_begin, m_end, full_lo, full_hi = 0, 0, 0, 0
    if not masked:
        m_end = full_hi = (Sq + kBlockM - 1) // kBlockM
    elif Sq > 0 and any_key:
        lo, hi = hdr["rows"][n0]
        if hi > lo:
            m_begin, m_end = lo // kBlockM, (hi + kBlockM - 1) // kBlockM
            full_lo, full_hi = hdr["fullrows"][n0]
    n_m = m_end - m_begin
    steps = group * n_m

    def load_rows(g, row0, nrows, rows):
        s = np.full((rows, kStride), np.nan)
        for r in range(rows):
            s[r, :D] = g[row0 + r] if row0 + r < nrows else 0.0
        return s

    sK = load_rows(k, n0, Sk, kBlockN)
    sV = load_rows(v, n0, Sk, kBlockN)
    log2e = 1.0 / math.log(2.0)
    scale_log2 = scale * log2e
    lrow, lcol, krow, kcol = (BWD_LANES[n] for n in ("lrow", "lcol", "krow", "kcol"))
    g_, c2 = BWD_LANES["g"], BWD_LANES["c2"]
    acc_dk = np.zeros((kWarps, kDTiles, 32, 4))
    acc_dv = np.zeros((kWarps, kDTiles, 32, 4))
    terms = slopes is not None or cap is not None or rel is not None or drop is not None
    rel_m = (rel.shape[1] - 1) // 2 if rel is not None else 0
    drop_scale = 1.0 if drop is None else 1.0 / (1 - drop[0])
    off = Sk - Sq  # TileBands::off (no block position in these cases)
    for st in range(steps):
        h = st // n_m
        m0 = (m_begin + st % n_m) * kBlockM
        slope = 0.0 if slopes is None else slopes[h]
        d_row_key = off - n0
        if drop is not None:  # sRk of the step: the row keys of its 64 rows
            p_, seed, offset, row0, col0 = drop
            sRkb = _row_key(seed, offset, 0, h, row0 + m0 + np.arange(kBlockM))
            drop_col0 = col0 + n0
            drop_thresh = np.uint64(int(p_ * 65536.0 + 0.5))
        sQb = load_rows(q[h], m0, Sq, kBlockM)
        sdOb = load_rows(do[h], m0, Sq, kBlockM)
        sLseb = np.array([(math.inf if lse[h, m0 + t] == -math.inf else lse[h, m0 + t] * log2e)
                          if m0 + t < Sq else math.inf for t in range(kBlockM)])
        sDeltab = np.array([delta[h, m0 + t] if m0 + t < Sq else 0.0 for t in range(kBlockM)])
        sdS = np.full((kBlockN, kDsStride), np.nan)
        mt = m0 // kBlockM
        need_mask = (not (full_lo <= mt < full_hi) or n0 + kBlockN > Sk or m0 + kBlockM > Sq
                     or not all_keys)
        band = hdr["tile"][(m0, n0)]
        for warp in range(kWarps):
            for qs in range(kBlockM // kQSub):
                q0 = qs * kQSub
                s = np.zeros((kSubTiles, 32, 4))
                dp = np.zeros((kSubTiles, 32, 4))
                for kk in range(D // 16):
                    ak = ldmatrix_x4(sK, [(warp * 16 + lrow[l], kk * 16 + lcol[l]) for l in range(32)])
                    av = ldmatrix_x4(sV, [(warp * 16 + lrow[l], kk * 16 + lcol[l]) for l in range(32)])
                    for nn in range(kQSub // 16):
                        bq = ldmatrix_x4(sQb, [(q0 + nn * 16 + krow[l], kk * 16 + kcol[l]) for l in range(32)])
                        bo = ldmatrix_x4(sdOb, [(q0 + nn * 16 + krow[l], kk * 16 + kcol[l]) for l in range(32)])
                        mma(s[2 * nn], ak, bq[:, 0], bq[:, 1])
                        mma(s[2 * nn + 1], ak, bq[:, 2], bq[:, 3])
                        mma(dp[2 * nn], av, bo[:, 0], bo[:, 1])
                        mma(dp[2 * nn + 1], av, bo[:, 2], bo[:, 3])
                for t in range(kSubTiles):
                    for e in range(4):
                        qc = q0 + t * 8 + c2 + (e & 1)  # (32,)
                        with np.errstate(over="ignore", invalid="ignore"):
                            if terms:
                                th = np.zeros(32)
                                x = s[t, :, e] * scale_log2 * math.log(2.0)
                                if cap is not None:
                                    th = np.tanh(x / cap)
                                    x = cap * th
                                kr = warp * 16 + g_ + (e >> 1) * 8  # kra / krb
                                d = m0 + qc + d_row_key - kr
                                x = x - slope * np.abs(d)
                                rd = np.clip(d, -rel_m, rel_m)
                                if rel is not None:
                                    x = x + rel[h, rel_m + rd]
                                pr = np.exp2(x * log2e - sLseb[qc])
                                if drop is not None:
                                    col = drop_col0 + kr
                                    kept = _field(_word(sRkb[qc], col), col) >= drop_thresh
                                    # (1 - p) dS and P Z; 1 / (1 - p) on dv, dk, dq, d rel_bias
                                    ds = pr * (np.where(kept, 1.0, 0.0) * dp[t, :, e] - (1 - p_) * sDeltab[qc])
                                    pr = np.where(kept, pr, 0.0)
                                else:
                                    ds = pr * (dp[t, :, e] - sDeltab[qc])
                                chain = 1.0 - th * th
                            else:
                                pr = np.exp2(s[t, :, e] * scale_log2 - sLseb[qc])
                                ds = pr * (dp[t, :, e] - sDeltab[qc])
                        if need_mask:
                            kr = warp * 16 + g_ + (e >> 1) * 8
                            ok = kok[kr] & band_ok(band, qc, kr)
                            pr = np.where(ok, pr, 0.0)
                            ds = np.where(ok, ds, 0.0)
                            if terms:
                                chain = np.where(ok, chain, 1.0)
                        if terms:
                            if rel is not None:  # sDrel[rel_m + rd] += ds (shared atomics)
                                np.add.at(drel[h], rel_m + rd, drop_scale * ds)
                            ds = ds * chain
                        s[t, :, e] = pr
                        dp[t, :, e] = ds
                for kk in range(kQSub // 16):
                    ap = np.zeros((32, 4, 2))
                    ads = np.zeros((32, 4, 2))
                    for i, (tt, lo) in enumerate(((2 * kk, 0), (2 * kk, 2), (2 * kk + 1, 0), (2 * kk + 1, 2))):
                        ap[:, i] = s[tt][:, lo: lo + 2]
                        ads[:, i] = dp[tt][:, lo: lo + 2]
                    qk = q0 + kk * 16
                    for l in range(32):
                        r = warp * 16 + g_[l]
                        c = qk + c2[l]
                        sdS[r, c: c + 2] = ads[l, 0]
                        sdS[r + 8, c: c + 2] = ads[l, 1]
                        sdS[r, c + 8: c + 10] = ads[l, 2]
                        sdS[r + 8, c + 8: c + 10] = ads[l, 3]
                    for dd in range(D // 16):
                        bo = ldmatrix_x4(sdOb, [(qk + lrow[l], dd * 16 + lcol[l]) for l in range(32)], trans=True)
                        mma(acc_dv[warp, 2 * dd], ap, bo[:, 0], bo[:, 1])
                        mma(acc_dv[warp, 2 * dd + 1], ap, bo[:, 2], bo[:, 3])
                    for dd in range(D // 16):
                        bq = ldmatrix_x4(sQb, [(qk + lrow[l], dd * 16 + lcol[l]) for l in range(32)], trans=True)
                        mma(acc_dk[warp, 2 * dd], ads, bq[:, 0], bq[:, 1])
                        mma(acc_dk[warp, 2 * dd + 1], ads, bq[:, 2], bq[:, 3])
        # __syncthreads(): dS^T complete
        for warp in range(kWarps):
            dq_row0 = (warp % (kBlockM // 16)) * 16
            dq_col0 = (warp // (kBlockM // 16)) * kDqCols
            for dc in range(0, kDqCols, kDqChunk):
                acc_dq = np.zeros((kDqChunk // 8, 32, 4))
                for kk in range(kBlockN // 16):
                    a = ldmatrix_x4(sdS, [(kk * 16 + krow[l], dq_row0 + kcol[l]) for l in range(32)], trans=True)
                    for dd in range(kDqChunk // 16):
                        bk = ldmatrix_x4(sK, [(kk * 16 + lrow[l], dq_col0 + dc + dd * 16 + lcol[l])
                                              for l in range(32)], trans=True)
                        mma(acc_dq[2 * dd], a, bk[:, 0], bk[:, 1])
                        mma(acc_dq[2 * dd + 1], a, bk[:, 2], bk[:, 3])
                for r in range(2):
                    for l in range(32):
                        row = m0 + dq_row0 + g_[l] + 8 * r
                        if row < Sq:
                            for t in range(kDqChunk // 8):
                                col = dq_col0 + dc + c2[l] + t * 8
                                dq_acc[h, row, col] += scale * drop_scale * acc_dq[t, l, 2 * r]
                                dq_acc[h, row, col + 1] += scale * drop_scale * acc_dq[t, l, 2 * r + 1]
    for warp in range(kWarps):
        for r in range(2):
            for l in range(32):
                key = n0 + warp * 16 + g_[l] + 8 * r
                if key < Sk:
                    for t in range(kDTiles):
                        col = c2[l] + t * 8
                        dk[key, col: col + 2] = scale * drop_scale * acc_dk[warp, t, l, 2 * r: 2 * r + 2]
                        dv[key, col: col + 2] = drop_scale * acc_dv[warp, t, l, 2 * r: 2 * r + 2]


def reference_bwd(q, k, v, do, mask, scale, slopes=None, cap=None, rel=None, drop=None):
    """Gradients of out = softmax(terms(scale q k^T) (masked)) v for the query heads q
    (group, Sq, D) sharing k, v (Sk, D), terms = softcap (cap tanh(x / cap)) then ALiBi
    (- slope_h |d|, d = i + Sk - Sq - j) then rel_bias (+ rel[h, M + clamp(d)]), as DESIGN.md;
    returns out, lse, dq, dk, dv, drel."""
    drel = None if rel is None else np.zeros_like(rel)
    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    outs, lses = [], []
    vis = mask.visible()
    Sq, Sk = q.shape[1], k.shape[0]
    dsign = np.arange(Sq)[:, None] + (Sk - Sq) - np.arange(Sk)[None, :]
    dist = np.abs(dsign)
    rel_m = (rel.shape[1] - 1) // 2 if rel is not None else 0
    for h in range(q.shape[0]):
        x = q[h] @ k.T * scale
        t = np.tanh(x / cap) if cap is not None else np.zeros_like(x)
        y = cap * t if cap is not None else x
        if slopes is not None:
            y = y - slopes[h] * dist
        if rel is not None:
            y = y + rel[h, rel_m + np.clip(dsign, -rel_m, rel_m)]
        s = np.where(vis, y, -np.inf)
        m = np.where(vis.any(1), s.max(1), 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            e = np.where(vis, np.exp(s - m[:, None]), 0.0)
            lse = np.where(vis.any(1), m + np.log(e.sum(1)), -np.inf)
            p = np.where(np.isfinite(lse)[:, None], np.exp(s - np.where(np.isfinite(lse), lse, 0)[:, None]), 0.0)
        z = np.ones_like(p) if drop is None else keep_mask(drop, Sq, Sk, h) / (1 - drop[0])
        out = (p * z) @ v
        dp = do[h] @ v.T
        dsy = p * (z * dp - (do[h] * out).sum(1, keepdims=True))
        if rel is not None:
            np.add.at(drel[h], rel_m + np.clip(dsign, -rel_m, rel_m), dsy)
        ds = dsy * (1.0 - t * t)
        dq[h] = scale * ds @ k
        dk += scale * ds.T @ q[h]
        dv += (p * z).T @ do[h]
        outs.append(out)
        lses.append(lse)
    return np.stack(outs), np.stack(lses), dq, dk, dv, drel


def check_bwd(rng, Sq, Sk, D, group, spec, terms=None) -> bool:
    q = rng.standard_normal((group, Sq, D))
    do = rng.standard_normal((group, Sq, D))
    k, v = rng.standard_normal((Sk, D)), rng.standard_normal((Sk, D))
    scale = 1 / math.sqrt(D)
    mask = Mask(Sq, Sk, spec, rng)
    # terms: "alibi" (slopes per query head), "softcap" (a cap the scores reach), or both
    slopes = 0.05 + 0.3 * rng.random(group) if terms and "alibi" in terms else None
    cap = 1.5 if terms and "softcap" in terms else None
    rel = rng.standard_normal((group, 2 * 40 + 1)) if terms and "rel" in terms else None
    drop = (0.3, 77, 2, 6, 3) if terms and "dropout" in terms else None
    out, lse, r_dq, r_dk, r_dv, r_drel = reference_bwd(q, k, v, do, mask, scale, slopes, cap, rel, drop)
    drel = None if rel is None else np.zeros_like(rel)
    delta = (do * out).sum(-1)  # fa2_bwd_delta_kernel
    dq = np.zeros_like(q)
    dk = np.full_like(k, np.nan)
    dv = np.full_like(v, np.nan)
    kBlockN = bwd_constants(D)["kBlockN"]
    for n_block in range((Sk + kBlockN - 1) // kBlockN):
        fa2_bwd_cta(q, k, v, do, lse, delta, Sq, Sk, D, mask, scale, n_block, dq, dk, dv,
                    slopes, cap, rel, drel, drop)
    pairs = [(dq, r_dq), (dk, r_dk), (dv, r_dv)] + ([(drel, r_drel)] if rel is not None else [])
    errs = [np.abs(a - b).max() if not np.isnan(a).any() else np.inf for a, b in pairs]
    ok = max(errs) < 1e-9
    print(f"bwd Sq={Sq:4d} Sk={Sk:4d} D={D:3d} group={group} {mask!s:14} {terms or '':13}: dq err {errs[0]:.2e}, "
          f"dk err {errs[1]:.2e}, dv err {errs[2]:.2e}"
          f"{f', drel err {errs[3]:.2e}' if rel is not None else ''}  {'ok' if ok else 'MISMATCH'}")
    return ok


def reference(q, k, v, mask, scale, slope=None, cap=None, rel=None, drop=None):
    Sq, Sk = q.shape[0], k.shape[0]
    x = q @ k.T * scale
    dsign = np.arange(Sq)[:, None] + (Sk - Sq) - np.arange(Sk)[None, :]
    if cap is not None:
        x = cap * np.tanh(x / cap)
    if slope is not None:
        x = x - slope * np.abs(dsign)
    if rel is not None:
        m = (len(rel) - 1) // 2
        x = x + rel[m + np.clip(dsign, -m, m)]
    s = np.where(mask.visible(), x, -np.inf)
    mx = s.max(axis=1, keepdims=True)
    mx = np.where(np.isinf(mx), 0, mx)
    p = np.exp(s - mx)
    l = p.sum(axis=1, keepdims=True)
    pv = p if drop is None else p * keep_mask(drop, Sq, Sk) / (1 - drop[0])
    out = np.where(l > 0, pv @ v / np.where(l > 0, l, 1), 0)
    lse = np.where(l[:, 0] > 0, np.log(np.where(l[:, 0] > 0, l[:, 0], 1)) + mx[:, 0], -np.inf)
    return out, lse


# (Sq, Sk, D, mask): tile-aligned, ragged, Sq > Sk (rows without keys), one key; windows
# (left, right, padding) with and without causal (right = 0), narrower than a tile, key
# padding (left: whole padded key tiles; random); every head dim a fast forward kernel is
# built for (fwd_fast_head_dim), and no other.
FWD_CASES = [(64, 64, 64, False), (70, 130, 64, True), (130, 70, 32, True),
             (5, 200, 32, True), (100, 37, 128, False), (65, 1, 32, True),
             (90, 150, 96, True), (70, 100, 256, True),
             (150, 200, 64, (20, 0, None)), (130, 260, 32, (5, 9, None)),
             (100, 300, 64, (-1, 0, "left")), (90, 90, 64, (30, 30, "random")),
             (70, 70, 128, (-1, -1, "random")),
             # the kTerms instances (not built at D = 256: fwd_fast_terms_head_dim)
             (130, 200, 64, True, "rel+alibi+softcap"), (100, 37, 128, False, "rel"),
             (90, 260, 32, (30, 5, "random"), "alibi+softcap"), (70, 70, 96, True, "rel+alibi"),
             (100, 150, 64, (-1, -1, "random"), "dropout"), (130, 90, 128, True, "rel+dropout")]
# (Sq, Sk, D, group, mask): likewise for the fast backward (launch_fa2_bwd), with GQA.
BWD_CASES = [(64, 128, 64, 1, False), (70, 130, 64, 2, True),
             (130, 70, 64, 1, True), (100, 37, 128, 1, False),
             (5, 200, 64, 1, True), (65, 1, 64, 1, True),
             (140, 150, 128, 2, True),
             (200, 300, 64, 1, (30, 0, None)), (150, 140, 64, 2, (10, 40, None)),
             (100, 400, 64, 1, (-1, 0, "left")), (90, 200, 128, 1, (25, 25, "random")),
             # the kTerms instances (softcap, ALiBi): distances across tiles and Sq != Sk
             (130, 200, 64, 2, True, "alibi"), (150, 70, 128, 1, False, "softcap"),
             (140, 300, 128, 2, (40, 10, "random"), "alibi+softcap"),
             (70, 130, 64, 1, (-1, 0, "left"), "alibi+softcap"),
             (150, 170, 64, 2, True, "rel"), (100, 260, 128, 1, (50, 20, None), "rel+alibi+softcap"),
             # dropout (bwd_fast_dropout_head_dim: D = 64)
             (130, 200, 64, 2, (-1, -1, "random"), "dropout"), (90, 140, 64, 1, True, "rel+softcap+dropout")]


def check_fwd(rng, Sq, Sk, D, spec, terms=None) -> bool:
    q, k, v = (rng.standard_normal((n, D)) for n in (Sq, Sk, Sk))
    scale = 1 / math.sqrt(D)
    mask = Mask(Sq, Sk, spec, rng)
    out = np.full((Sq, D), np.nan)
    lse = np.full(Sq, np.nan)
    kBlockM = fwd_constants(D)["kBlockM"]
    tk = dict(slope=0.05 + 0.3 * rng.random() if terms and "alibi" in terms else None,
              cap=1.5 if terms and "softcap" in terms else None,
              rel=rng.standard_normal(2 * 40 + 1) if terms and "rel" in terms else None,
              # dropout at a block position whose first key is odd: pairs straddle words
              drop=(0.3, 1234, 5, 3, 5) if terms and "dropout" in terms else None)
    for m_block in range((Sq + kBlockM - 1) // kBlockM):
        fa2_fwd_cta(q, k, v, Sq, Sk, D, mask, scale, m_block, out, lse, **tk)
    r_out, r_lse = reference(q, k, v, mask, scale, **tk)
    e_out = np.nanmax(np.abs(out - r_out)) if not np.isnan(out).any() else np.inf
    same_inf = np.array_equal(np.isinf(lse), np.isinf(r_lse))
    fin = np.isfinite(r_lse)
    e_lse = np.abs(lse[fin] - r_lse[fin]).max() if fin.any() else 0.0
    ok = e_out < 1e-9 and same_inf and e_lse < 1e-9 and not np.isnan(lse).any()
    print(f"Sq={Sq:4d} Sk={Sk:4d} D={D:3d} {mask!s:14} {terms or '':17}: out err {e_out:.2e}, "
          f"lse err {e_lse:.2e}, -inf rows match {same_inf}  {'ok' if ok else 'MISMATCH'}")
    return ok


def main() -> int:
    rng = np.random.default_rng(0)
    bad = 0
    for case in FWD_CASES:
        bad += not check_fwd(rng, *case)
    for case in BWD_CASES:
        bad += not check_bwd(rng, *case)
    for Sq, Sk, D, spec in [(70, 130, 64, True), (130, 70, 64, True), (200, 200, 32, True),
                            (100, 37, 128, False), (70, 100, 256, True), (5, 200, 64, True),
                            (150, 300, 64, (20, 0, None)), (130, 260, 128, (5, 70, None)),
                            (300, 100, 64, (0, 0, None)), (64, 640, 32, (-1, 3, None))]:
        bad += not check_rule_against_header(Sq, Sk, D, spec)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
