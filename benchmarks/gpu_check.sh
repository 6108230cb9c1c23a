#!/usr/bin/env bash
# One call on the GPU machine (H200, sm_90), run from the repo root there:
#   bash benchmarks/gpu_check.sh
# Builds attn_ext from source in place (nothing downloaded), runs the CUDA tests, the
# compute-sanitizer checks (if the tool is there) and the attention benchmark, writes the logs
# under $OUT (default ./gpu_out) and prints a short summary table LAST.
# The benchmarks print the git commit they measure (benchmarks/_env.py); a copy of the tree
# without .git prints "unknown" unless ATTN_EXT_COMMIT=<sha> is set in the environment.
# Budget: GPU_CHECK_BUDGET seconds (default 480) for everything; steps that would start too
# late are skipped and say so.
set -u
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET:-480}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
SECONDS=0
declare -a SUMMARY
note() { SUMMARY+=("$1"); echo "### $1"; }
left() { echo $(( BUDGET - SECONDS )); }

# the toolkit: $CUDA_HOME, else /usr/local/cuda, else the one nvcc on PATH belongs to
CUDA_ROOT=${CUDA_HOME:-/usr/local/cuda}
if [ ! -x "$CUDA_ROOT/bin/nvcc" ] && command -v nvcc > /dev/null; then
  CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
fi

# ---- 0. machine --------------------------------------------------------------------------
{
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  $PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  echo "CUDA toolkit: $CUDA_ROOT"; "$CUDA_ROOT/bin/nvcc" --version | tail -2
  command -v compute-sanitizer || ls "$CUDA_ROOT/bin/compute-sanitizer" 2>/dev/null
} 2>&1 | tee "$OUT/info.log"

# ---- 1. build ------------------------------------------------------------------------------
t0=$SECONDS
# (bounded: a build that hangs or crawls must leave the budget's last minute for the summary)
CUDA_HOME=$CUDA_ROOT TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 ATTN_EXT_CUDA=1 \
  timeout $(( $(left) > 120 ? $(left) - 60 : 60 )) $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1
rc=$?
note "build rc=$rc in $(( SECONDS - t0 )) s (log build.log)"
if [ $rc -ne 0 ]; then
  tail -40 "$OUT/build.log"
  printf '\n===== SUMMARY =====\n'; printf '%s\n' "${SUMMARY[@]}"
  exit 1
fi
$PY -c "import attn_ext, torch; print('ops:', [n for n in dir(torch.ops.attn_ext) if 'attention' in n])" 2>&1 | tee -a "$OUT/info.log"

# ---- 2. CUDA tests -------------------------------------------------------------------------
# test_attention_cuda.py here (fast vs simple vs reference, forward and backward: the part
# nothing else checks); every `device="cuda"` case of the other test files (-k cuda) in 3b.
# pytest-timeout (if installed) guards against a hung kernel; `timeout` bounds each step.
TO=""; $PY -c "import pytest_timeout" 2>/dev/null && TO="--timeout=60"
t0=$SECONDS
TT=$(( $(left) - 200 )); [ $TT -gt 180 ] && TT=180; [ $TT -lt 60 ] && TT=60
# The fast kernels with masks (window, key padding, varlen, hidden non-finite values, bad
# cu_seqlens) run as their own step 2a with their own time, so that neither part can starve
# the other.
MASKED_K="TestFastMasked or fast_nonfinite or bad_cu_seqlens"
timeout $TT $PY -m pytest -q -p no:cacheprovider $TO tests/test_attention_cuda.py -rfE \
  -k "not ($MASKED_K)" --durations=5 > "$OUT/test_attention_cuda.log" 2>&1
rc=$?
note "test_attention_cuda.py rc=$rc in $(( SECONDS - t0 )) s: $(grep -E '(passed|failed|error|skipped)' "$OUT/test_attention_cuda.log" | tail -1)"
grep -E '^(FAILED|ERROR)' "$OUT/test_attention_cuda.log" | head -20
# ---- 2a. the fast kernels with masks ------------------------------------------------------
t0=$SECONDS
TM=$(( $(left) - 180 )); [ $TM -gt 120 ] && TM=120; [ $TM -lt 45 ] && TM=45
timeout $TM $PY -m pytest -q -p no:cacheprovider $TO tests/test_attention_cuda.py -rfE \
  -k "$MASKED_K" --durations=5 > "$OUT/test_attention_cuda_masked.log" 2>&1
rc=$?
note "test_attention_cuda.py masked fast kernels rc=$rc in $(( SECONDS - t0 )) s: $(grep -E '(passed|failed|error|skipped)' "$OUT/test_attention_cuda_masked.log" | tail -1)"
grep -E '^(FAILED|ERROR)' "$OUT/test_attention_cuda_masked.log" | head -20
# ---- 3. benchmark --------------------------------------------------------------------------
t0=$SECONDS
if [ "$(left)" -gt 100 ]; then
  TB=$(( $(left) - 60 )); [ $TB -gt 150 ] && TB=150
  # headline: bf16 causal D=128, S = 4k, 8k, 16k (the issue's targets), through issue 5's
  # command (bench_attention.py --device cuda runs bench_attention_cuda.py's matrix)
  timeout $TB $PY benchmarks/bench_attention.py --device cuda --json "$OUT/bench.json" \
    > "$OUT/bench.log" 2>&1
  note "bench (headline) rc=$? in $(( SECONDS - t0 )) s (log bench.log)"
else
  note "bench skipped (budget)"
fi

# ---- 3b. the other CUDA tests (after the benchmark: its numbers matter more) -------------
t0=$SECONDS
TT=$(( $(left) - 100 )); [ $TT -gt 150 ] && TT=150
if [ $TT -ge 30 ]; then
  timeout $TT $PY -m pytest -q -p no:cacheprovider $TO tests -k cuda \
    --ignore=tests/test_attention_cuda.py -rfE --durations=5 > "$OUT/test_cuda.log" 2>&1
  rc=$?
  note "other CUDA tests rc=$rc in $(( SECONDS - t0 )) s: $(grep -E '(passed|failed|error|skipped)' "$OUT/test_cuda.log" | tail -1)"
  grep -E '^(FAILED|ERROR)' "$OUT/test_cuda.log" | head -20
else
  note "other CUDA tests skipped (budget)"
fi

# ---- 3c. the demo on the GPU, tiny settings ------------------------------------------------
if [ "$(left)" -gt 100 ]; then
  t0=$SECONDS
  timeout 60 $PY -m attn_ext.demo --device cuda --quick --out "$OUT/demo" > "$OUT/demo.log" 2>&1
  note "demo --device cuda --quick rc=$? in $(( SECONDS - t0 )) s (log demo.log)"
else
  note "demo skipped (budget)"
fi

# ---- 4. compute-sanitizer ------------------------------------------------------------------
SAN=$(command -v compute-sanitizer || echo "$CUDA_ROOT/bin/compute-sanitizer")
if [ -x "$SAN" ]; then
  if [ "$(left)" -gt 70 ]; then
    t0=$SECONDS
    TM=$(( $(left) - 40 )); [ $TM -gt 90 ] && TM=90
    timeout $TM "$SAN" --tool memcheck --error-exitcode 9 $PY benchmarks/gpu_sanitize_case.py \
      > "$OUT/memcheck.log" 2>&1
    note "memcheck rc=$? in $(( SECONDS - t0 )) s: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
  else
    note "memcheck skipped (budget)"
  fi
  if [ "$(left)" -gt 50 ]; then
    t0=$SECONDS
    timeout 60 "$SAN" --tool racecheck --racecheck-report hazard --error-exitcode 9 \
      $PY benchmarks/gpu_sanitize_case.py --fast-only > "$OUT/racecheck.log" 2>&1
    note "racecheck rc=$? in $(( SECONDS - t0 )) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/racecheck.log" | tail -1)"
  else
    note "racecheck skipped (budget)"
  fi
else
  note "compute-sanitizer not found"
fi

# ---- 5. the full benchmark matrix with whatever time is left --------------------------------
# bf16/fp16 x causal/full x D 64/128 x S 512..16k; rows are printed as measured, so a timeout
# keeps what was done (log bench_full.log)
if [ "$(left)" -gt 45 ]; then
  t0=$SECONDS
  timeout $(( $(left) - 20 )) $PY benchmarks/bench_attention.py --device cuda --full --reps 5 \
    --json "$OUT/bench_full.json" > "$OUT/bench_full.log" 2>&1
  note "bench --full rc=$? in $(( SECONDS - t0 )) s: $(grep -c ' TFLOP/s ' "$OUT/bench_full.log") rows (log bench_full.log)"
else
  note "bench --full skipped (budget)"
fi

# ---- summary (last) ------------------------------------------------------------------------
printf '\n===== SUMMARY (%d s) =====\n' $SECONDS
printf '%s\n' "${SUMMARY[@]}"
# the benchmark's header (commit, torch, device), then its table: the table is the last output
grep -E "^# " "$OUT/bench.log" 2>/dev/null
[ -f "$OUT/bench.log" ] && sed -n '/^dtype /,$p' "$OUT/bench.log" | grep -vE "^# "
exit 0
