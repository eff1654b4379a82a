#!/usr/bin/env bash
# One call on the GPU machine: build kernels._C in place, run the GPU tests and the benchmarks.
# Logs go under $OUT (the device tool's output folder) or ./gpu-logs.
#   bash scripts/gpu_check.sh [tests|bench|all] [pytest -k expression]
# Wheels the machine lacks (nvidia-cutlass) travel in .whl/ (see README, "GPU machine").
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
select="${2:-}"
out="${OUT:-$PWD/gpu-logs}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MOE_JIT_CACHE_DIR="${MOE_JIT_CACHE_DIR:-/tmp/moe_jit_cache}"

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  git rev-parse --short HEAD 2>/dev/null || true
} 2>&1 | tee "$out/env.log"

python3 setup.py -q build_ext --inplace > "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
echo "build ok"

status=0
if [[ "$what" == tests || "$what" == all ]]; then
  # CPU tests run in CI; here only what needs the GPU.
  python3 -m pytest -q -m gpu -p no:cacheprovider ${select:+-k "$select"} tests 2>&1 | tee "$out/tests.log" | tail -30
  status=${PIPESTATUS[0]}
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
