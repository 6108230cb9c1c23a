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
    assert res.stdout.startswith("# commit: "), res.stdout[:300]  # the environment comes first
    for key in ("# torch: ", "# threads: ", "# allocator: "):
        assert key in res.stdout.split("\n\n")[0], key


def test_bench_attention_device_cuda_is_the_gpu_matrix(tmp_path):
    """Issue 5's command, bench_attention.py --device cuda, runs bench_attention_cuda.py's
    matrix (its options, bf16 / fp16, fast / simple / SDPA backends); without a GPU it says so
    and exits non-zero, without a traceback."""
    script = os.path.join(ROOT, "benchmarks", "bench_attention.py")
    res = subprocess.run([sys.executable, script, "--device", "cuda", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--full" in res.stdout and "bf16,fp16" in res.stdout and "--max-simple-seconds" in res.stdout
    if not torch.cuda.is_available():
        res = subprocess.run([sys.executable, script, "--device=cuda"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 1 and "no CUDA device" in res.stderr, res.stdout + res.stderr
        assert "Traceback" not in res.stderr


def test_bench_pos_enc_device_cuda_without_a_gpu(tmp_path):
    """bench_pos_enc.py --device cuda without a GPU: a usage error, no traceback (it failed in
    its first torch.randint)."""
    if torch.cuda.is_available():
        pytest.skip("has a CUDA device")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_pos_enc.py"),
                          "--device", "cuda", "--quick"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "no CUDA device" in res.stderr, res.stdout + res.stderr
    assert "Traceback" not in res.stderr


# ---- every benchmark says what it measured ----------------------------------------------------

import ast  # noqa: E402
import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

BENCH = os.path.join(ROOT, "benchmarks")
NOT_BENCHMARKS = {"_env.py", "gpu_sanitize_case.py"}  # the helper; a compute-sanitizer case


def _load(name):
    spec = importlib.util.spec_from_file_location(name.replace(".py", "_under_test"), os.path.join(BENCH, name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_benchmark_prints_the_environment_header():
    scripts = sorted(f for f in os.listdir(BENCH) if f.endswith(".py") and f not in NOT_BENCHMARKS)
    assert len(scripts) >= 5, scripts
    for f in scripts:
        tree = ast.parse(open(os.path.join(BENCH, f)).read())
        main = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        assert main, f"{f}: no main()"
        calls = [n for n in ast.walk(main[0]) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", None) == "print_env_header"]
        assert calls, f"{f}: main() does not call _env.print_env_header"


def test_env_header_fields():
    import io
    import subprocess

    env = _load("_env.py")
    buf = io.StringIO()
    info = env.print_env_header("cpu", file=buf)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert info["commit"].startswith(head.stdout.strip()), info["commit"]
    assert info["torch"].startswith(torch.__version__)
    assert info["threads"].startswith(f"{torch.get_num_threads()} intra-op")
    assert "malloc" in info["allocator"] or "preloaded" in info["allocator"]
    assert buf.getvalue().splitlines()[0] == f"# commit: {info['commit']}"
    # the loaded build's commit (setup.py records it), flagged when it is not the checkout's
    import attn_ext
    built = attn_ext.build_info().get("commit")
    assert info["built from"].startswith(built or "unknown")
    same = built is not None and built.split("+")[0] == info["commit"].split("+")[0].split()[0]
    assert ("NOT the checkout's commit" in info["built from"]) == (not same)
    # which ISA each side of a CPU comparison runs (ours: AVX2 or portable; torch's ATen level)
    assert info["cpu isa"].startswith("attn_ext kernels "), info["cpu isa"]
    assert f"torch ATen {torch.backends.cpu.get_cpu_capability()}" in info["cpu isa"]


def test_env_cpu_isa_follows_the_simd_switch(monkeypatch):
    env = _load("_env.py")
    monkeypatch.setenv("ATTN_EXT_CPU_SIMD", "0")
    assert env.cpu_isa().startswith("attn_ext kernels portable C++")


def test_env_allocator_mode_reports_the_knobs(monkeypatch):
    env = _load("_env.py")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4294967296")
    assert "MALLOC_MMAP_THRESHOLD_=4294967296" in env.allocator_mode("cpu")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "expandable_segments:True" in env.allocator_mode("cuda")
    # the huge-page state: the kernel's mode and whether torch advises them
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert "THP_MEM_ALLOC_ENABLE=1 (torch advises them)" in env.allocator_mode("cpu")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    assert "THP_MEM_ALLOC_ENABLE=unset" in env.allocator_mode("cpu")
    assert "transparent huge pages " in env.allocator_mode("cpu")


def test_env_round_orders_balance_the_neighbours():
    """_env.round_orders: over a whole cycle of rounds every method runs first equally often and
    right after each other method equally often (in the concatenated call sequence), so no
    method always pays for the same predecessor; interleaved_medians times each method once per
    round in that order, warm-up and before() included."""
    from collections import Counter

    env = _load("_env.py")
    for names in (["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d"]):
        n = len(names)
        cycle = 1
        for i in range(2, n + 1):
            cycle *= i
        orders = env.round_orders(names, cycle)
        assert sorted(map(tuple, orders)) == sorted(set(map(tuple, orders)))  # all distinct
        assert all(sorted(o) == names for o in orders)
        assert Counter(o[0] for o in orders) == {x: cycle // n for x in names}
        seq = [x for o in orders for x in o]
        pairs = Counter(zip(seq, seq[1:]))
        for a in names:
            after = [pairs[(b, a)] for b in names if b != a]
            assert max(after) - min(after) <= 1, (names, a, after)
    five = env.round_orders(list("abcde"), 10)
    assert all(sorted(o) == list("abcde") for o in five) and len({tuple(o) for o in five}) == 10
    calls = []
    meds = env.interleaved_medians({"x": lambda: calls.append("x"), "y": lambda: calls.append("y")},
                                   4, before=lambda: calls.append("-"))
    assert calls == ["x", "y"] + ["-", "x", "-", "y", "-", "y", "-", "x"] * 2
    assert set(meds) == {"x", "y"} and all(m >= 0 for m in meds.values())


def test_bench_attention_cuda_times_interleaved():
    mod = _load("bench_attention_cuda.py")
    mod.DEVICE = "cpu"
    order = []
    variants = [dict(fn=lambda n=n: order.append(n), ctx=None, reps=r) for n, r in (("a", 3), ("b", 3), ("c", 1))]
    meds = mod.interleaved_ms(variants, 3, warmup=1)
    assert order == ["a", "b", "c"] + ["a", "b", "c", "a", "b", "a", "b"]  # warm-up, then rounds
    assert len(meds) == 3 and all(m >= 0 for m in meds)


def test_bench_mha_validates_forward_and_backward():
    """bench_mha's validation before timing checks the training backward too: a layer whose
    forward is right but whose gradient is wrong is refused."""
    mod = _load("bench_mha.py")
    torch.manual_seed(0)
    layers = mod.build(32, 4, 2, torch.float32)
    x = torch.randn(2, 16, 32)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(16)
    mod.validate(layers, x, mask, torch.float32)  # all right
    layers["attn_ext"].qkv.weight.register_hook(lambda g: g * 1.1)  # wrong dW_qkv only
    with pytest.raises(AssertionError, match="attn_ext training dW_qkv disagrees"):
        mod.validate(layers, x, mask, torch.float32)


def test_bench_score_terms_smoke(tmp_path):
    """benchmarks/bench_score_terms.py with tiny sizes: every method validates (it exits
    non-zero on a validation failure) and prints its rows with the run's header."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_score_terms.py"), "--quick",
           "--no-flex", "--repeats", "1"]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "torch " in res.stdout and "threads" in res.stdout
    for name in ("ours alibi", "ours rel_bias", "ours softcap", "eager softcap", "ours dropout 0.1",
                 "sdpa dense learnable rel"):
        assert f"| {name} |" in res.stdout, res.stdout


def _build_tool(tmp_path, tool, *kernel_sources):
    """tools/<tool>.cpp built with the kernel sources named (paths under csrc/cpu), as the
    tool's header says: the executable's path (the test skips without g++)."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("no g++")
    exe = tmp_path / tool
    torch_inc = os.path.join(os.path.dirname(torch.__file__), "include")
    sources = [os.path.join(ROOT, "tools", f"{tool}.cpp")]
    sources += [os.path.join(ROOT, "csrc", "cpu", name) for name in kernel_sources]
    subprocess.run(["g++", "-O2", "-std=c++20", "-I", os.path.join(ROOT, "csrc"), "-I", torch_inc,
                    *sources, "-o", str(exe)], check=True, timeout=300)
    return exe


def _run_check_tool(tmp_path, tool, arg, *kernel_sources):
    """Builds tools/<tool>.cpp (_build_tool) and runs it with `arg` (one or a list): its stdout. Exit 2 (no
    AVX2 / FMA on this CPU) skips the test; any other failure fails it."""
    exe = _build_tool(tmp_path, tool, *kernel_sources)
    args = [arg] if isinstance(arg, str) else list(arg)
    res = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)
    if res.returncode == 2:
        pytest.skip("no AVX2 / FMA")
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_gemm_probe_builds_and_measures(tmp_path):
    """tools/gemm_probe.cpp (the micro-kernel rates RESULTS.md quotes) builds from the kernel
    sources as its header says and prints a positive rate for every case."""
    import re

    from attn_ext._explain import cpu_avx512_enabled

    exe = _build_tool(tmp_path, "gemm_probe", "attention_microkernels_avx2.cpp",
                      "attention_microkernels_avx512.cpp", "cpu_features.cpp")
    out = subprocess.run([str(exe), "1"], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    if "nothing to measure" in out:
        pytest.skip("no AVX2 / FMA")
    rates = [float(x) for x in re.findall(r"([0-9.]+) GFLOP/s", out)]
    isas = ["avx2 (ymm)"] + (["avx512 (zmm)"] if cpu_avx512_enabled() else [])
    assert [line[3:] for line in out.splitlines() if line.startswith("== ")] == isas, out
    assert len(rates) == (7 + 4 + 5 + 5) * len(isas), out
    assert all(r > 0 for r in rates), out
    for section in ("pass ", "fwd ", "bwd ", "softmax ", "each gemm"):
        assert section in out


def test_transpose_check_builds_and_passes(tmp_path):
    """tools/transpose_check.cpp: the AVX2 q^T / dout^T pack (mk::transpose_rows_avx2, the CPU
    forward's and backward's) gives the generic loop's bits on 500 random shapes, with NaN,
    inf, -0 and denormal values and scales, and writes nothing outside its block."""
    out = _run_check_tool(tmp_path, "transpose_check", "500", "attention_microkernels_avx2.cpp",
                          "cpu_features.cpp")
    assert "500 cases, 0 with an element that differs in a bit" in out, out


def test_convert_check_builds_and_passes(tmp_path):
    """tools/convert_check.cpp: the AVX2 write-out of fp16 / bf16 outputs and gradients
    (mk::float_to_half_avx2 / float_to_bf16_avx2, store_row) gives c10's bits for x * mul on
    random bit patterns with NaN, inf, denormals, overflow and ties, every tail length, and
    writes nothing past n."""
    out = _run_check_tool(tmp_path, "convert_check", "3000", "attention_microkernels_avx2.cpp",
                          "cpu_features.cpp")
    assert "3000 cases," in out and "0 differ in a bit" in out, out


def test_isa_probe_builds_and_checks_its_arithmetic(tmp_path):
    """tools/isa_probe.cpp (the per-ISA peak rates RESULTS.md quotes: fp32 FMA on ymm and zmm,
    bf16 dot products) builds as its header says, checks each case's sums (exit 0) and prints
    a positive rate or "not supported" for each of its three cases."""
    import re

    exe = _build_tool(tmp_path, "isa_probe")
    res = subprocess.run([str(exe), "0.02"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 3, res.stdout
    for line in lines:
        m = re.search(r"([0-9.]+) GFLOP/s$", line)
        assert (m is not None and float(m.group(1)) > 0) or line.endswith("not supported"), line


def test_exp2_check_builds_and_passes(tmp_path):
    """tools/exp2_check.cpp (the accuracy simd.h's exp2_ps comment quotes) builds as its header
    says; on 1e6 points exp2_ps stays under 1 ulp of exp2 in double and gives the special
    values the softmax relies on (2^0 = 1, masked -inf -> 0, NaN -> NaN); with AVX-512,
    exp2_ps512 (vscalefps and a zero mask) gives exp2_ps's bits on every 4099th of the 2^32
    patterns and on all of [-127, -126], FTZ / DAZ off and on (stride 1, all of them, is
    the tool's default: RESULTS.md, twenty-fifth session)."""
    import re

    from attn_ext._explain import cpu_avx512_enabled

    out = _run_check_tool(tmp_path, "exp2_check", ["1000000", "4099"], "cpu_features.cpp")
    ulp = float(re.search(r"max error ([0-9.]+) ulp", out).group(1))
    assert 0 < ulp < 1.0, out
    special = [line for line in out.splitlines() if line.startswith("special values:")]
    assert len(special) == 1 and special[0].endswith(": ok"), out
    if cpu_avx512_enabled():
        m = re.search(r"exp2_ps512 against exp2_ps: (\d+) patterns .*, (\d+) differ", out)
        assert m is not None and int(m.group(1)) > 2_000_000 and int(m.group(2)) == 0, out


def test_gemm_at_check_builds_and_passes(tmp_path):
    """tools/gemm_at_check.cpp: the forward's fused pass 3 (gemm_at_avx2: o = alpha * o +
    st^T v) gives the same bits as the rescale loop plus gemm_avx2 it replaced, on 400 random
    shapes (misaligned B, the blocked K path, inf / NaN accumulators rescaled by 0)."""
    out = _run_check_tool(tmp_path, "gemm_at_check", "400", "attention_microkernels_avx2.cpp",
                          "cpu_features.cpp")
    assert "400 cases, 0 with an output that differs in a bit" in out, out


def test_gemm512_check_builds_and_passes(tmp_path):
    """tools/gemm512_check.cpp: the AVX-512 fp32 gemms (gemm_avx512, gemm_at_avx512) give the
    AVX2 ones' bits on 400 random shapes (row-major and transposed A, half-vector tails, the
    blocked chains, misaligned B, inf / NaN inputs and special scales), and write nothing
    between N and ldc; softmax / exp_sub / ds likewise (-inf and NaN scores, hidden columns).
    Skips where the CPU has no AVX-512F/BW."""
    exe = _build_tool(tmp_path, "gemm512_check", "attention_microkernels_avx2.cpp",
                      "attention_microkernels_avx512.cpp", "cpu_features.cpp")
    res = subprocess.run([str(exe), "400"], capture_output=True, text=True, timeout=120)
    if res.returncode == 2:
        pytest.skip("no AVX-512F/BW")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "400 cases, 0 gemm and 0 gemm_at outputs that differ in a bit" in res.stdout, res.stdout
    assert "400 cases, 0 softmax / exp_sub / ds outputs that differ in a bit" in res.stdout, res.stdout


def _switch_ab_quick(*switch_args, var=None):
    """bench_switch_ab.py --quick at 2 threads (with --switch NAME when given): its stdout,
    after asserting it ran, printed the environment header and, for var, the values it
    alternated."""
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_switch_ab.py"),
                          *switch_args, "--quick", "--threads", "2"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("# commit: "), res.stdout[:300]
    if var is not None:
        assert f"{var} in ['0', '1']" in res.stdout, res.stdout
    return res.stdout


def test_bench_switch_ab_smoke():
    """benchmarks/bench_switch_ab.py (the ATTN_EXT_CPU_BWD_JOBS A/B RESULTS.md quotes) runs,
    checks the values' gradients bitwise equal, and prints a row per shape."""
    out = _switch_ab_quick()
    rows = [line for line in out.splitlines() if line.startswith("| 1, 2, 256, 32 |")]
    assert len(rows) == 1, out


@pytest.mark.parametrize("switch,var", [("decode-quads", "ATTN_EXT_CPU_DECODE_QUADS"),
                                        ("decode-pv512", "ATTN_EXT_CPU_DECODE_PV512"),
                                        ("decode-pv-pairs", "ATTN_EXT_CPU_DECODE_PV_PAIRS"),
                                        ("decode-scores512", "ATTN_EXT_CPU_DECODE_SCORES512"),
                                        ("bf16dp", "ATTN_EXT_CPU_BF16DP"),
                                        ("dp-tile16", "ATTN_EXT_CPU_DP_TILE16")])
def test_bench_switch_ab_decode_quads_smoke(switch, var):
    """bench_switch_ab.py --switch decode-quads / decode-pv512 (the A/Bs RESULTS.md quotes)
    runs, checks both values' outputs bitwise equal, and prints a row per dtype."""
    out = _switch_ab_quick("--switch", switch, var=var)
    for name in ("fp32", "bf16"):
        rows = [line for line in out.splitlines() if line.startswith(f"| {name} | 1 | 512 | 8/2 |")]
        assert len(rows) == 1, out


def test_bench_switch_ab_decode_head_split_smoke():
    """bench_switch_ab.py --switch decode-head-split (the short-decode A/B RESULTS.md quotes)
    runs, checks both values' outputs bitwise equal and SDPA close, and prints a row per
    dtype with the SDPA column."""
    out = _switch_ab_quick("--switch", "decode-head-split", var="ATTN_EXT_CPU_DECODE_HEAD_SPLIT")
    for name in ("fp32", "bf16"):
        rows = [line for line in out.splitlines() if line.startswith(f"| {name} | 1 | 256 | 8/8 | 64 |")]
        assert len(rows) == 1 and rows[0].count("|") == 12, out


def test_bench_switch_ab_gemm512_smoke():
    """bench_switch_ab.py --switch gemm512 (the A/B RESULTS.md quotes for the zmm gemms) runs,
    checks both values' forward and backward bitwise equal, and prints a row per layout and
    pass."""
    out = _switch_ab_quick("--switch", "gemm512", var="ATTN_EXT_CPU_GEMM512")
    for layout in ("BSHD", "BHSD view"):
        for name in ("fwd", "bwd"):
            rows = [line for line in out.splitlines()
                    if line.startswith(f"| 1, 2, 256, 32 | {layout} | {name} |")]
            assert len(rows) == 1, out


def test_bench_attention_cpu_shapes_and_fp16():
    """bench_attention.py --shapes times the shapes given instead of the matrix, and --dtypes
    takes fp16 (the dtype comparison RESULTS.md quotes): one markdown row per dtype and pass."""
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_attention.py"),
                          "--device", "cpu", "--shapes", "1,2,128,32", "--dtypes", "fp32", "fp16",
                          "--repeats", "1", "--no-memory", "--limits", "", "--markdown"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("# commit: "), res.stdout[:300]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| fp")]
    assert [r.split(" | ")[:3] for r in rows] == [
        ["| fp32", "fwd", "(1, 2, 128, 32)"], ["| fp32", "fwd+bwd", "(1, 2, 128, 32)"],
        ["| fp16", "fwd", "(1, 2, 128, 32)"], ["| fp16", "fwd+bwd", "(1, 2, 128, 32)"]], res.stdout


def test_amx_probe_builds_and_measures(tmp_path):
    """tools/amx_probe.cpp (the per-step cycles of a bf16 forward key tile on AMX tiles that
    RESULTS.md quotes) builds from the kernel sources as its header says and prints a positive
    time for each step and the tile softmax's error; exit 2 (no AMX) skips."""
    import re

    exe = _build_tool(tmp_path, "amx_probe", "attention_amx.cpp", "attention_bf16dp.cpp",
                      "attention_microkernels_avx2.cpp", "attention_microkernels_avx512.cpp",
                      "cpu_features.cpp")
    res = subprocess.run([str(exe), "200"], capture_output=True, text=True, timeout=120)
    if res.returncode == 2:
        pytest.skip("no AMX")
    assert res.returncode == 0, res.stdout + res.stderr
    times = [float(x) for x in re.findall(r"([0-9.]+) us", res.stdout)]
    assert len(times) == 6 and all(t > 0 for t in times), res.stdout
    for step in ("scores_amx", "softmax_avx512", "probs_to_pairs", "scale_cols", "pv_amx",
                 "softmax_pairs_amx"):
        assert step in res.stdout
    # the tile path's exp2 (vreduceps / vscalefps, attention_amx.cpp exp2_tile_ps512): its
    # probabilities within 2 ulp of 2^x in double at the kernel's fp32 argument x
    worst = float(re.search(r"p against 2\^x in double: ([0-9.]+) ulp", res.stdout).group(1))
    assert worst < 2.0, res.stdout


def _cpu_limits_rows(tmp_path, part, prefix):
    """Run ``bench_cpu_limits.py --quick --parts <part>`` (it must succeed and print the
    environment header first) and return the cells of its table rows starting with prefix."""
    script = os.path.join(ROOT, "benchmarks", "bench_cpu_limits.py")
    res = subprocess.run([sys.executable, script, "--quick", "--parts", part], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("# commit: "), res.stdout[:300]
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in res.stdout.splitlines() if line.startswith(prefix)]


def test_bench_cpu_limits_nonfinite_smoke(tmp_path):
    """bench_cpu_limits.py --parts nonfinite (the settle cost RESULTS.md quotes) runs, checks
    each case's lse against the reference first, and prints one row per case after the header."""
    rows = _cpu_limits_rows(tmp_path, "nonfinite", ("| causal prefill", "| decode"))
    assert len(rows) == 2, rows
    for cells in rows:
        assert all(float(c) > 0 for c in cells[1:]), cells


def test_bench_cpu_limits_terms_smoke(tmp_path):
    """bench_cpu_limits.py --parts terms (the decode-with-score-terms rows RESULTS.md quotes)
    runs, validates the decode and the tiled kernel against the reference first, and prints
    five cases per dtype with positive times."""
    rows = _cpu_limits_rows(tmp_path, "terms", "| 1 | 1024 |")
    assert len(rows) == 10, rows
    for cells in rows:
        assert float(cells[7]) > 0 and float(cells[11]) > 0, cells


def test_bench_cpu_limits_decode_rows_smoke(tmp_path):
    """bench_cpu_limits.py --parts decode-rows (the Sq = 2 / 4 decode rows RESULTS.md quotes)
    runs, validates ours against SDPA with the bottom-right mask first, and prints six rows
    with positive times."""
    rows = _cpu_limits_rows(tmp_path, "decode-rows", "| 1 | ")
    assert len(rows) == 6, rows
    for cells in rows:
        assert float(cells[8]) > 0 and float(cells[11]) > 0 and float(cells[12]) > 0, cells


def test_bench_cpu_limits_short_rows_smoke(tmp_path):
    """bench_cpu_limits.py --parts short-rows (the one-tile-per-head rows RESULTS.md quotes)
    runs each row in a fresh process, validates ours against SDPA, and prints eight rows with
    positive times on the tiled kernels."""
    rows = _cpu_limits_rows(tmp_path, "short-rows", "| 1 | ")
    assert len(rows) == 8, rows
    for cells in rows:
        assert cells[6] in ("cpu.tiled", "cpu.split_kv"), cells
        assert all(float(cells[i]) > 0 for i in (7, 9, 11, 13)), cells


def test_bench_cpu_limits_cache_lengths_smoke(tmp_path):
    """bench_cpu_limits.py --parts cache-lengths (the decode steps at lengths 8 n + t that
    RESULTS.md quotes) validates ours against SDPA and prints the eight lengths 16-23 per dtype,
    each with positive times and its ratio to the length 16 one (1.00 there)."""
    rows = _cpu_limits_rows(tmp_path, "cache-lengths", "| ")
    rows = [cells for cells in rows if cells[0].isdigit()]
    assert [int(cells[0]) for cells in rows] == list(range(16, 24)) * 2, rows
    assert [cells[1] for cells in rows] == ["fp32"] * 8 + ["bf16"] * 8, rows
    for cells in rows:
        assert float(cells[2]) > 0 and float(cells[4]) > 0, cells
    assert rows[0][3] == "1.00" and rows[8][3] == "1.00", rows


def test_bench_vmap_smoke():
    """benchmarks/bench_vmap.py (the vmap table RESULTS.md quotes) validates and runs."""
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_vmap.py"),
                          "--quick"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "# commit:" in res.stdout and "| (4, 1, 16, 2, 16) |" in res.stdout
