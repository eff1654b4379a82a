#!/usr/bin/env bash
# One call on the GPU machine: build kernels._C in place, run the GPU tests and the benchmarks.
# Logs go under $OUT (the device tool's output folder) or ./gpu-logs.
#   bash scripts/gpu_check.sh [tests|bench|all] [pytest -k expression]
# GPU_TEST_PATHS="tests/kernels" (space-separated) limits the tests to those paths: the whole GPU
# suite takes longer than one device call, so run it in parts (tests/kernels, then the rest).
# Environment, wheels (.whl/), env.log and the build: scripts/gpu_env.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
select="${2:-}"
source scripts/gpu_env.sh

status=0
if [[ "$what" == tests || "$what" == all ]]; then
  # CPU tests run in CI; here only what needs the GPU.
  read -ra paths <<< "${GPU_TEST_PATHS:-tests}"
  # With pytest-xdist (a wheel in .whl/), test files run in parallel processes sharing the GPU:
  # most of a cold run is JIT compiles, which then overlap. A file stays on one worker (its module
  # fixtures warm the cache once). GPU_TEST_WORKERS=0: one process. GPU_TEST_DIST=load spreads one
  # file's tests over the workers too (few files of many compile-bound tests).
  workers=()
  if [[ "${GPU_TEST_WORKERS:-6}" != 0 ]] && python3 -c "import xdist" 2>/dev/null; then
    workers=(-n "${GPU_TEST_WORKERS:-6}" --dist "${GPU_TEST_DIST:-loadfile}")
  fi
  # A hung kernel fails its own test (pytest-timeout, where the machine has it) instead of eating the
  # device call's 600 s: PER_TEST_TIMEOUT seconds per test, JIT compiles included.
  per_test=()
  if python3 -c "import pytest_timeout" 2>/dev/null; then
    per_test=(--timeout "${PER_TEST_TIMEOUT:-300}")
  fi
  # Tests marked exclusive take most of every GPU's memory: they run alone, after the parallel pass.
  start=$SECONDS
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -m "gpu and not exclusive" -p no:cacheprovider \
    ${workers[@]+"${workers[@]}"} ${per_test[@]+"${per_test[@]}"} ${select:+-k "$select"} "${paths[@]}" 2>&1 \
    | tee "$out/tests.log" | tail -30
  status=${PIPESTATUS[0]}
  [[ $status == 5 ]] && status=0  # nothing selected
  left=$(( ${TEST_TIMEOUT:-540} - (SECONDS - start) ))
  if (( left > 0 )); then
    timeout "$left" python3 -m pytest -q -m "gpu and exclusive" -p no:cacheprovider ${per_test[@]+"${per_test[@]}"} \
      ${select:+-k "$select"} "${paths[@]}" \
      2>&1 | tee "$out/tests_exclusive.log" | tail -15
    s=${PIPESTATUS[0]}
    [[ $s != 0 && $s != 5 ]] && status=$s
  else
    echo "no time left for the exclusive tests"; status=124
  fi
fi
if [[ "$what" == bench || "$what" == all ]]; then
  # BENCHES="bench/bench_gemm.py --ms 64" picks benchmarks (with arguments); default: all.
  IFS=';' read -ra benches <<< "${BENCHES:-$(ls bench/bench_*.py | paste -sd';')}"
  for b in "${benches[@]}"; do
    echo "== $b"
    script=${b%% *}
    timeout "${BENCH_TIMEOUT:-600}" python3 $b 2>&1 | tee "$out/$(basename "$script" .py).log" | tail -40
  done
fi
exit $status
