"""Smoke test of the main job with tiny settings: it runs end to end and its checks hold."""

import os

import pytest

from attn_ext import demo


def test_demo_quick(tmp_path):
    res = demo.main(["--quick", "--out", str(tmp_path)])
    # the no-PE bidirectional model is permutation-equivariant (up to float32 rounding)
    assert res["equivariance_err"] < 1e-4
    # the TorchScript export reloads and gives the eager model's logits
    assert res["torchscript_diff"] < 1e-5
    assert set(res["reversal_acc"]) == set(demo.VARIANTS)
    assert res["kback_acc"][("learned", 64)] == "no rows"  # no table rows past train length
    assert res["speed"]["decode_tok_s"] > 0
    assert os.path.exists(tmp_path / "tinygpt_rope_kback.pt")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib not installed: pictures not checked")
    for name in ("sinusoidal_pe.png", "learned_pe_similarity.png", "attention_maps.png",
                 "loss_curves.png", "rope_relative.png", "relative_bias.png"):
        assert (tmp_path / name).stat().st_size > 10_000, name


def test_console_script_exits_zero(monkeypatch):
    """`attn-ext-demo` (pyproject's console script) ends with exit status 0: pip's wrapper
    passes the target's return value to sys.exit, so the target must return 0, not main's
    results dict (which sys.exit prints to stderr with status 1)."""
    import importlib
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    target = re.search(r'^attn-ext-demo\s*=\s*"([\w.]+):(\w+)"', text, re.M)
    assert target, "pyproject.toml has no attn-ext-demo console script"
    module = importlib.import_module(target.group(1))
    calls = []
    monkeypatch.setattr(demo, "main", lambda argv=None: calls.append(argv) or {"a": 1})
    with pytest.raises(SystemExit) as e:
        import sys
        sys.exit(getattr(module, target.group(2))(["--quick"]))
    assert e.value.code in (0, None) and calls == [["--quick"]]


def test_unusable_device_is_a_usage_error(capsys):
    """--device cuda on a machine without one (or any device this torch cannot use) is a usage
    error naming the option, not a traceback from the first tensor."""
    import torch

    bad = ["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "nonesuch"]
    with pytest.raises(SystemExit) as e:
        demo.main(["--quick", *bad])
    assert e.value.code == 2
    assert f"--device {bad[1]} is not usable here" in capsys.readouterr().err
