"""The lane-by-lane CPU emulation of the tensor-core CUDA kernels (tools/fa2_emulate.py:
ldmatrix / mma.m16n8k16 fragment maps, tile loops, masking, the backward's dS^T round trip
and GQA walk) reproduces float64 attention and its gradients. It checks the kernels' index
math on machines without a GPU; it does not check rounding, timing or synchronisation.

The emulator takes the kernels' constants and lane maps from the headers
(tools/kernel_constants.py); the tests below check that it does (a header edit reaches the
emulation) and that its cases are exactly the head dims the kernels are built for."""

import importlib.util
import os
import re
import shutil
import sys

import pytest

np = pytest.importorskip("numpy")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")


def _load_emulator():
    """A fresh instance of tools/fa2_emulate.py (it reads the headers when it is loaded)."""
    spec = importlib.util.spec_from_file_location("fa2_emulate_fresh", os.path.join(TOOLS, "fa2_emulate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def kc():
    sys.path.insert(0, TOOLS)
    try:
        import kernel_constants

        yield kernel_constants
    finally:
        sys.path.remove(TOOLS)


def test_fa2_emulation_matches_reference(capsys):
    mod = _load_emulator()
    rc = mod.main()
    out = capsys.readouterr().out
    assert "MISMATCH" not in out, out
    assert out.count(" ok") == len(mod.FWD_CASES) + len(mod.BWD_CASES), out
    assert rc == 0


def test_cases_cover_exactly_the_built_head_dims(kc):
    mod = _load_emulator()
    fwd_dims, bwd_dims = set(kc.fwd_fast_head_dims()), set(kc.bwd_fast_head_dims())
    # the dispatch's lists agree with the translation units that instantiate the kernels
    files = os.listdir(os.path.join(ROOT, "csrc", "cuda"))
    assert fwd_dims == {int(m) for f in files for m in re.findall(r"^attention_fa2_hdim(\d+)\.cu$", f)}
    assert bwd_dims == {int(m) for f in files for m in re.findall(r"^attention_fa2_bwd_hdim(\d+)\.cu$", f)}
    assert {c[2] for c in mod.FWD_CASES} == fwd_dims
    assert {c[2] for c in mod.BWD_CASES} == bwd_dims


def test_emulator_uses_the_header_constants(kc):
    mod = _load_emulator()
    lane = np.arange(32)
    for d in kc.fwd_fast_head_dims():
        want = kc.traits(kc.FWD, "FwdTraits", d)
        got = mod.fwd_constants(d)
        assert {k: got[k] for k in want} == want
        # the launcher's shared-memory size (the adapter's check) is the traits' size
        assert kc.evaluate(kc.launch_function("fwd_smem_bytes"), {"head_dim": d}) == want["kSmemBytes"]
    for d in kc.bwd_fast_head_dims():
        want = kc.traits(kc.BWD, "BwdTraits", d)
        got = mod.bwd_constants(d)
        assert {k: got[k] for k in want} == want
        assert kc.evaluate(kc.launch_function("bwd_smem_bytes"), {"head_dim": d}) == want["kSmemBytes"]
    for name in ("lrow", "lcol", "krow", "kcol"):
        assert np.array_equal(mod.FWD_LANES[name],
                              kc.lane_maps(kc.FWD, "fa2_fwd_kernel", [name], lane)[name])
    assert set(mod.BWD_LANES) == {"lrow", "lcol", "krow", "kcol", "g", "c2"}


def _mutated_tree(tmp_path, rel, old, new):
    """A copy of csrc/ in tmp_path with ``old`` replaced by ``new`` in ``rel``."""
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "csrc")
    path = tmp_path / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} not found once in {rel}"
    path.write_text(text.replace(old, new))
    return tmp_path


@pytest.mark.parametrize("rel,old,new,case", [
    # a wrong ldmatrix lane map in the forward kernel (K's column halves swapped)
    ("csrc/cuda/attention_fwd_kernel.cuh", "const int kcol = ((lane >> 3) & 1) * 8;",
     "const int kcol = ((lane >> 4) & 1) * 8;", ("fwd", 64, 64, 64, False)),
    # Q's row map: matrices 1 and 3 taken from the wrong lanes
    ("csrc/cuda/attention_fwd_kernel.cuh", "const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8;",
     "const int lrow = (lane & 7) + ((lane >> 4) & 1) * 8;", ("fwd", 70, 130, 64, True)),
    # a wrong fragment column map in the backward kernel
    ("csrc/cuda/attention_bwd_kernel.cuh", "c2 = (lane & 3) * 2;", "c2 = ((lane + 1) & 3) * 2;",
     ("bwd", 64, 128, 64, 1, False)),
    # the visibility layer's tile predicate off by one (the kernels' per-element window test):
    # the emulator asks the edited header, so it now disagrees with the plain reference
    ("csrc/common/attention_mask.h", "int64_t hi = m.left >= 0 ? m.left - d0 : R;",
     "int64_t hi = m.left >= 0 ? m.left - d0 + 1 : R;", ("fwd", 150, 200, 64, (20, 0, None))),
    ("csrc/common/attention_mask.h", "int64_t hi = m.left >= 0 ? m.left - d0 : R;",
     "int64_t hi = m.left >= 0 ? m.left - d0 + 1 : R;", ("bwd", 200, 300, 64, 1, (30, 0, None))),
])
def test_a_kernel_edit_reaches_the_emulation(rel, old, new, case, kc, tmp_path, monkeypatch, capsys):
    """Edit the (copied) header: the emulator, reading it, now disagrees with the reference.
    With retyped constants it would have passed unchanged."""
    monkeypatch.setattr(kc, "ROOT", str(_mutated_tree(tmp_path, rel, old, new)))
    mod = _load_emulator()
    rng = np.random.default_rng(0)
    if case[0] == "fwd":
        ok = mod.check_fwd(rng, *case[1:])
    else:
        with np.errstate(all="ignore"):
            ok = mod.check_bwd(rng, *case[1:])
    assert not ok, capsys.readouterr().out
