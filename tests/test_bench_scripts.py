"""The GPU benchmark script runs only on the GPU machine, where a failure costs a whole
device session; this runs its logic on the CPU with tiny sizes (--device cpu), from another
working directory (as an uninstalled checkout is used there), and checks that our rows are
measured and validated against SDPA's math backend."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_attention_cuda_smoke_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_attention_cuda.py"),
           "--device", "cpu", "--tokens", "128", "--hidden", "128", "--seqlens", "64",
           "--head-dims", "64", "--causal", "both", "--dtypes", "bf16", "--reps", "1",
           "--json", str(out)]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    import json

    rows = json.loads(out.read_text())["rows"]
    ours = [r for r in rows if r["impl"] == "attn_ext"]
    assert len(ours) == 4  # (causal, full) x (fwd, fwd+bwd)
    assert all(r["valid"] for r in ours), ours
    assert any(r["impl"] == "sdpa-flash" and r["valid"] for r in rows)


def test_bench_score_terms_smoke(tmp_path):
    """benchmarks/bench_score_terms.py with tiny sizes: every method validates (it exits
    non-zero on a validation failure) and prints its rows with the run's header."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_score_terms.py"), "--quick",
           "--no-flex", "--repeats", "1"]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "torch " in res.stdout and "threads" in res.stdout
    for name in ("ours alibi", "ours rel_bias", "ours dropout 0.1", "sdpa dense learnable rel"):
        assert f"| {name} |" in res.stdout, res.stdout
