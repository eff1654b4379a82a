#!/usr/bin/env bash
# A/B of a kernel-header change in one GPU call, without a second build: the JIT hashes the headers
# under csrc/include per process, so a process started with other headers compiles other kernels.
#   bash scripts/ab_headers.sh OVERLAY ROUNDS COMMAND...
# OVERLAY: a folder mirroring csrc/include (e.g. ab/moe_kernels/impls/sm90_fp8_gemm.cuh), its files
# laid over csrc/include for the B runs and taken back off after each (and on exit). COMMAND runs
# ROUNDS times as A (the tree's headers), then B, alternating, so drift falls on both sides; logs
# $out/ab_A<i>.log and $out/ab_B<i>.log. Make an overlay from a branch:
#   git show BRANCH:csrc/include/moe_kernels/impls/sm90_fp8_gemm.cuh > ab/moe_kernels/impls/sm90_fp8_gemm.cuh
# Environment, wheels and the build: scripts/gpu_env.sh (AB_NO_ENV=1 skips it: CPU tests).
set -uo pipefail
cd "$(dirname "$0")/.."
overlay="${1:?overlay folder}"
rounds="${2:?rounds}"
shift 2
(( $# > 0 )) || { echo "ab_headers.sh: no command" >&2; exit 2; }
[[ -d "$overlay" ]] || { echo "ab_headers.sh: overlay $overlay is not a folder" >&2; exit 2; }
if [[ "${AB_NO_ENV:-0}" == 1 ]]; then out="${OUT:-gpu-logs}"; mkdir -p "$out"; else source scripts/gpu_env.sh; fi

saved=$(mktemp -d)
mapfile -t files < <(cd "$overlay" && find . -type f | sed 's|^\./||' | sort)
for f in "${files[@]}"; do
  [[ -f "csrc/include/$f" ]] || { echo "ab_headers.sh: csrc/include/$f does not exist (overlay $f)" >&2; exit 2; }
  mkdir -p "$saved/$(dirname "$f")" && cp "csrc/include/$f" "$saved/$f"
done
restore() { for f in "${files[@]}"; do cp "$saved/$f" "csrc/include/$f"; done; }
trap 'restore; rm -rf "$saved"' EXIT

status=0
for (( i = 1; i <= rounds; ++i )); do
  for side in A B; do
    [[ $side == B ]] && for f in "${files[@]}"; do cp "$overlay/$f" "csrc/include/$f"; done
    echo "== $side$i: $*"
    "$@" > "$out/ab_$side$i.log" 2>&1 || { echo "!! $side$i exited $?"; status=1; }
    tail -n "${AB_TAIL:-20}" "$out/ab_$side$i.log"
    [[ $side == B ]] && restore
  done
done
exit $status
