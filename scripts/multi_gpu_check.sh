#!/usr/bin/env bash
# One call on a machine with several GPUs (issue 6): expert parallelism with one rank per GPU.
# Logs go under $OUT (the device tool's output folder) or ./gpu-logs.
#   bash scripts/multi_gpu_check.sh [STEPS] [NPROC]
# STEPS: any of "tests deepseek dispatch lowlatency serve profile" (default: all but profile; one call runs at
# most 10 minutes, so split them over calls), NPROC: ranks (default: every GPU).
# 1. the multi-rank GPU tests (SymmBuffer torch + nvshmem, ranks sharing a GPU);
# 2. the staged DeepSeek-V3 layer against the reference, random and skewed routing, both backends;
# 3. bench/bench_dispatch.py with both backends (4096 and 128 tokens per rank, NCCL all-to-all beside);
# 3b. lowlatency: the low-latency transport's transport tests and its dispatch+combine round at 128
#     tokens per rank (bench_dispatch --transport low_latency), the staged round's all-to-all beside;
# 4. launch/serve_moe.py --preset deepseek-v3 (throughput, latency, reference spot checks);
# 5. profile: bench_dispatch's staged rows under the profilers, each rank's timeline as chrome traces
#    ($out/traces), to see where a call's host time goes.
# Environment, wheels (.whl/), env.log and the build: scripts/gpu_env.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
steps="${1:-tests deepseek dispatch lowlatency serve}"
nproc="${2:-$(nvidia-smi -L | wc -l)}"
source scripts/gpu_env.sh
export OMP_NUM_THREADS=1

status=0
step() {  # step NAME TIMEOUT CMD...: run, log to $out/NAME.log, remember a failure
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  grep -v "^\s*$" "$out/$name.log" | tail -25
  [[ $rc == 0 ]] || { echo "!! $name exited $rc"; status=1; }
}
run="python3 -m torch.distributed.run --standalone --nproc-per-node=$nproc"
want() { [[ " $steps " == *" $1 "* ]]; }
want tests && step multirank_tests 400 python3 -m pytest -q -m "gpu and multirank" -p no:cacheprovider \
  -k "not deepseek_v3" tests/moe_runtime
if want deepseek; then
  for backend in torch nvshmem; do
    step "deepseek_v3_$backend" 300 $run tests/moe_runtime/staged_worker.py --device cuda --preset deepseek-v3 \
      --symm-backend "$backend"
  done
fi
if want dispatch; then
  for backend in torch nvshmem; do
    step "dispatch_$backend" 240 $run bench/bench_dispatch.py --symm-backend "$backend"
  done
fi
if want lowlatency; then
  step lowlatency_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider -k "low_latency or test_ep" tests
  step dispatch_low_latency 240 $run bench/bench_dispatch.py --transport low_latency
fi
want profile && step dispatch_profile 240 $run bench/bench_dispatch.py --symm-backend torch --iters 10 \
  --trace "$out/traces"
want serve && step serve_deepseek_v3 300 $run launch/serve_moe.py --preset deepseek-v3 \
  --num-requests "${SERVE_REQUESTS:-512}" --no-progress --metrics-out "$out/serve_metrics.json"
exit $status
