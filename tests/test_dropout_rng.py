"""The dropout keep bit: csrc/common/dropout_rng.h (what the kernels use) and
attn_ext/reference.py's mirror agree bit for bit, and the bits behave like Bernoulli(1 - p)."""

import math
import os
import shutil
import subprocess

import pytest
import torch

from attn_ext import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROGRAM = r"""
#include <cstdio>
#include <cstdlib>
#include "common/dropout_rng.h"
// argv: seed offset b h i0 ni j0 nj p -> one line of 0/1 per row
int main(int argc, char** argv) {
  using namespace attn_ext::dropout;
  const unsigned long long seed = std::strtoull(argv[1], nullptr, 10);
  const unsigned long long offset = std::strtoull(argv[2], nullptr, 10);
  const long long b = std::atoll(argv[3]), h = std::atoll(argv[4]);
  const long long i0 = std::atoll(argv[5]), ni = std::atoll(argv[6]);
  const long long j0 = std::atoll(argv[7]), nj = std::atoll(argv[8]);
  const unsigned t = threshold(std::atof(argv[9]));
  for (long long i = i0; i < i0 + ni; ++i) {
    const unsigned long long r = row_key(seed, offset, b, h, i);
    for (long long j = j0; j < j0 + nj; ++j) std::putchar(keep(r, j, t) ? '1' : '0');
    std::putchar('\n');
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def rng_binary(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the header's test program")
    d = tmp_path_factory.mktemp("dropout_rng")
    src, exe = d / "rng.cpp", d / "rng"
    src.write_text(_PROGRAM)
    subprocess.run([cxx, "-O1", "-std=c++17", "-I", os.path.join(ROOT, "csrc"), str(src),
                    "-o", str(exe)], check=True)
    return str(exe)


def _header_bits(exe, seed, offset, b, h, i0, ni, j0, nj, p):
    out = subprocess.run([exe, str(seed), str(offset), str(b), str(h), str(i0), str(ni),
                          str(j0), str(nj), repr(p)], capture_output=True, text=True,
                         check=True).stdout.split()
    return torch.tensor([[c == "1" for c in line] for line in out])


@pytest.mark.parametrize("seed,offset,p", [
    (0, 0, 0.1),
    (2**63 + 12345, 7, 0.5),     # seeds past int64 (torch seeds are uint64)
    (987654321, 2**40 + 3, 0.9),
    (42, 0, 0.0),
])
def test_header_and_reference_agree_bit_for_bit(rng_binary, seed, offset, p):
    # Odd starts and lengths: the 4-keys-per-word packing must not depend on the tile start.
    b, h, i0, ni, j0, nj = 3, 5, 1021, 7, 97, 61
    ours = _header_bits(rng_binary, seed, offset, b, h, i0, ni, j0, nj, p)
    ref = reference.dropout_keep_mask(seed, offset, b + 1, h + 1, range(i0, i0 + ni),
                                      range(j0, j0 + nj), p)[b, h]
    assert ours.shape == ref.shape == (ni, nj)
    assert torch.equal(ours, ref)
    if p == 0.0:
        assert bool(ours.all())


def test_keep_bits_are_a_function_of_position_only():
    # The same global (i, j) gets the same bit whichever block of rows/keys asks for it.
    full = reference.dropout_keep_mask(11, 3, 2, 2, range(0, 64), range(0, 80), 0.3)
    part = reference.dropout_keep_mask(11, 3, 2, 2, range(17, 40), range(33, 71), 0.3)
    assert torch.equal(full[:, :, 17:40, 33:71], part)
    other_seed = reference.dropout_keep_mask(12, 3, 2, 2, range(0, 64), range(0, 80), 0.3)
    other_offset = reference.dropout_keep_mask(11, 4, 2, 2, range(0, 64), range(0, 80), 0.3)
    assert not torch.equal(full, other_seed) and not torch.equal(full, other_offset)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_4_sigma(p):
    n_rows, n_keys, B, H = 256, 256, 2, 4
    keep = reference.dropout_keep_mask(2024, 0, B, H, range(n_rows), range(n_keys), p)
    n = keep.numel()
    rate = keep.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 4 * sigma + 2.0**-17, (rate, 1 - p, sigma)
    # Neighbouring keys sharing one 64-bit word are not correlated.
    a, c = keep[..., 0::4].double(), keep[..., 1::4].double()
    corr = ((a - a.mean()) * (c - c.mean())).mean() / (a.std() * c.std())
    assert abs(corr.item()) < 4 / math.sqrt(a.numel())
