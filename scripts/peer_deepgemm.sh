#!/usr/bin/env bash
# On the GPU machine: build DeepGEMM (scripts/peer_env.sh), then run bench/bench_deepgemm.py, which
# times it beside our kernels on the same operands in one run.
#   bash scripts/peer_deepgemm.sh [bench_deepgemm.py arguments]
# Logs: $OUT/peer_build.log, $OUT/bench_deepgemm.log, $OUT/deepgemm_kernels.txt (the kernels it generated).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
source scripts/peer_env.sh || exit 1
timeout "${BENCH_TIMEOUT:-480}" python3 bench/bench_deepgemm.py "$@" 2>&1 | tee "$out/bench_deepgemm.log"
status=${PIPESTATUS[0]}
# The kernels DeepGEMM generated, one file (the device tool returns few files): their template
# arguments are its heuristic's choices (block M/N/K, swizzles, stages, threads, multicast).
find "$DG_JIT_CACHE_DIR" -name "kernel.cu" -exec sh -c 'echo "== $1"; cat "$1"' _ {} \; > "$out/deepgemm_kernels.txt"
exit "$status"
