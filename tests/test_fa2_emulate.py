"""The lane-by-lane CPU emulation of the tensor-core CUDA kernels (tools/fa2_emulate.py:
ldmatrix / mma.m16n8k16 fragment maps, tile loops, masking, the backward's dS^T round trip
and GQA walk) reproduces float64 attention and its gradients. It checks the kernels' index
math on machines without a GPU; it does not check rounding, timing or synchronisation."""

import importlib.util
import os

import pytest

pytest.importorskip("numpy")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fa2_emulation_matches_reference(capsys):
    spec = importlib.util.spec_from_file_location("fa2_emulate", os.path.join(ROOT, "tools", "fa2_emulate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main()
    out = capsys.readouterr().out
    assert "MISMATCH" not in out, out
    assert out.count(" ok") == 15, out  # 8 forward + 7 backward cases
    assert rc == 0
