#!/usr/bin/env bash
# Where the FP8 GEMMs' time goes, in one GPU call: ncu on one call of each problem below (after a
# warm-up call), clocks left alone (--clock-control none: the GPU runs at its own boost clock, as in
# the benchmarks). Per problem, $out/ncu_<name>.txt holds ncu's details page, and the summary printed
# at the end is: duration, SM clock, SM and tensor-pipe throughput, L2 and DRAM throughput, shared
# memory bank reads / writes as a share of their peak (the suspected bound of 128 x 128 tiles: TMA
# fills plus the wgmmas' operand reads), and the warp stall reasons.
#   bash scripts/ncu_gemm.sh [NAME ...]     (default: every problem of ours)
# peer_* problems run DeepGEMM's kernel on the same problem (built by scripts/peer_env.sh: carry .peer).
# NCU_SOURCE=1 adds a pass with per-instruction counters (SourceCounters), its SASS page as CSV.
# Environment switches reach the kernels (MOE_FP8_MULTICAST=0, MOE_FP8_PINGPONG=0|1); the build,
# wheels and $out come from scripts/gpu_env.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
ncu="${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}"

declare -A problems=(
  [dense_4096x7168x16384]="scripts/gemm_once.py --m 4096 --n 7168 --k 16384"
  [dense_4096x4096x7168]="scripts/gemm_once.py --m 4096 --n 4096 --k 7168"
  [dense_4096x4096x7168_mn]="scripts/gemm_once.py --m 4096 --n 4096 --k 7168 --mn-scales"
  [dense_128x4096x7168]="scripts/gemm_once.py --m 128 --n 4096 --k 7168"
  [dense_128x4096x7168_mn]="scripts/gemm_once.py --m 128 --n 4096 --k 7168 --mn-scales"
  [dense_64x4096x7168_mn]="scripts/gemm_once.py --m 64 --n 4096 --k 7168 --mn-scales"
  [peer_dense_64x4096x7168]="scripts/deepgemm_once.py --m 64 --n 4096 --k 7168"
  [dense_64x2112x7168]="scripts/gemm_once.py --m 64 --n 2112 --k 7168"
  [dense_64x2112x7168_mn]="scripts/gemm_once.py --m 64 --n 2112 --k 7168 --mn-scales"
  [peer_dense_64x2112x7168]="scripts/deepgemm_once.py --m 64 --n 2112 --k 7168"
  [dense_128x2112x7168]="scripts/gemm_once.py --m 128 --n 2112 --k 7168"
  [dense_128x2112x7168_mn]="scripts/gemm_once.py --m 128 --n 2112 --k 7168 --mn-scales"
  [peer_dense_128x2112x7168]="scripts/deepgemm_once.py --m 128 --n 2112 --k 7168"
  [dense_64x576x7168]="scripts/gemm_once.py --m 64 --n 576 --k 7168"
  [contiguous_4x8192_4096x7168]="scripts/grouped_once.py --weights fp8 --groups 4 --contiguous 8192 --n 4096 --k 7168"
  [masked_32x16_7168x2048]="scripts/grouped_once.py --weights fp8 --groups 32 --tokens 16 --n 7168 --k 2048"
  [contiguous_fp4_4x8192_4096x7168]="scripts/grouped_once.py --weights fp4 --groups 4 --contiguous 8192 --n 4096 --k 7168"
  [contiguous_fp4_swapped_4x8192_4096x7168]="scripts/grouped_once.py --weights fp4 --groups 4 --contiguous 8192 --n 4096 --k 7168 --fp4-kernel swapped"
  [masked_fp4_swapped_32x128_4096x7168]="scripts/grouped_once.py --weights fp4 --groups 32 --tokens 128 --n 4096 --k 7168 --fp4-kernel swapped"
  [masked_fp4_converter_32x256_4096x7168]="scripts/grouped_once.py --weights fp4 --groups 32 --tokens 256 --n 4096 --k 7168 --fp4-kernel converter"
  [decode_fp4_32x16_7168x2048]="scripts/grouped_once.py --weights fp4-fragment --groups 32 --tokens 16 --n 7168 --k 2048"
  # DeepGEMM (the peer, built by scripts/peer_env.sh) on the same problems: its kernel matches sm90_fp8 too.
  [peer_dense_4096x4096x7168]="scripts/deepgemm_once.py --m 4096 --n 4096 --k 7168"
  [peer_dense_4096x2112x7168]="scripts/deepgemm_once.py --m 4096 --n 2112 --k 7168"
  [peer_contiguous_4x8192_4096x7168]="scripts/deepgemm_once.py --groups 4 --contiguous 8192 --n 4096 --k 7168"
  [peer_dense_128x4096x7168]="scripts/deepgemm_once.py --m 128 --n 4096 --k 7168"
  [swiglu_contiguous_32x2048_4096x7168]="scripts/grouped_once.py --weights fp8 --swiglu --groups 32 --contiguous 2048 --n 4096 --k 7168"
  [contiguous_32x2048_4096x7168]="scripts/grouped_once.py --weights fp8 --groups 32 --contiguous 2048 --n 4096 --k 7168"
  [swiglu_masked_32x256_4096x7168]="scripts/grouped_once.py --weights fp8 --swiglu --groups 32 --tokens 256 --n 4096 --k 7168"
  [contiguous_8x4096_7168x2048]="scripts/grouped_once.py --weights fp8 --groups 8 --contiguous 4096 --n 7168 --k 2048"
  [peer_contiguous_8x4096_7168x2048]="scripts/deepgemm_once.py --groups 8 --contiguous 4096 --n 7168 --k 2048"
  [dense_4096x2112x7168]="scripts/gemm_once.py --m 4096 --n 2112 --k 7168"
  [dense_4096x32768x512_mn]="scripts/gemm_once.py --m 4096 --n 32768 --k 512 --mn-scales"
  [peer_dense_4096x32768x512]="scripts/deepgemm_once.py --m 4096 --n 32768 --k 512"
  [dense_4096x7168x2048_mn]="scripts/gemm_once.py --m 4096 --n 7168 --k 2048 --mn-scales"
  [peer_dense_4096x7168x2048]="scripts/deepgemm_once.py --m 4096 --n 7168 --k 2048"
  [dense_4096x7168x16384_mn]="scripts/gemm_once.py --m 4096 --n 7168 --k 16384 --mn-scales"
  [peer_dense_4096x7168x16384]="scripts/deepgemm_once.py --m 4096 --n 7168 --k 16384"
  [dense_128x7168x16384]="scripts/gemm_once.py --m 128 --n 7168 --k 16384"
  [dense_128x7168x16384_mn]="scripts/gemm_once.py --m 128 --n 7168 --k 16384 --mn-scales"
  [peer_dense_128x7168x16384]="scripts/deepgemm_once.py --m 128 --n 7168 --k 16384"
  # Partial m-blocks (rows past M in the last box, session 45): 1 and 144 rows against 64 and 192 on
  # the same plans; 160 against 256 rows with MOE_GEMM_BLOCK_M=128 set for both.
  [dense_1x2112x7168]="scripts/gemm_once.py --m 1 --n 2112 --k 7168"
  [dense_1x2112x7168_mn]="scripts/gemm_once.py --m 1 --n 2112 --k 7168 --mn-scales"
  [peer_dense_1x2112x7168]="scripts/deepgemm_once.py --m 1 --n 2112 --k 7168"
  [dense_144x2112x7168]="scripts/gemm_once.py --m 144 --n 2112 --k 7168"
  [dense_144x2112x7168_mn]="scripts/gemm_once.py --m 144 --n 2112 --k 7168 --mn-scales"
  [dense_192x2112x7168_mn]="scripts/gemm_once.py --m 192 --n 2112 --k 7168 --mn-scales"
  [dense_160x2112x7168_mn]="scripts/gemm_once.py --m 160 --n 2112 --k 7168 --mn-scales"
  [dense_256x2112x7168_mn]="scripts/gemm_once.py --m 256 --n 2112 --k 7168 --mn-scales"
)
names=("$@")
[[ ${#names[@]} == 0 ]] && names=(dense_4096x7168x16384 dense_4096x4096x7168 dense_128x4096x7168
                                  contiguous_4x8192_4096x7168 masked_32x16_7168x2048 decode_fp4_32x16_7168x2048)

status=0
# A peer problem needs DeepGEMM built (about 80 s; carry .peer).
if [[ " ${names[*]} " == *" peer_"* ]]; then source scripts/peer_env.sh || exit 1; fi
# The metric names this ncu knows for the TMA and the crossbar into the SMs, for the next passes.
"$ncu" --query-metrics 2>/dev/null | grep -iE "tma|xbar2l1tex|ltcfabric|l1tex__m_" > "$out/ncu_metric_names.txt" || true
for name in "${names[@]}"; do
  cmd="${problems[$name]:-}"
  [[ -n "$cmd" ]] || { echo "unknown problem $name (known: ${!problems[*]})"; status=1; continue; }
  # -s 1 -c 1: skip the warm-up call's kernel, profile the next one.
  timeout "${NCU_TIMEOUT:-240}" "$ncu" --clock-control none -k regex:sm90_fp8 -s 1 -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis_Tables \
    python3 $cmd > "$out/ncu_$name.txt" 2>&1 || { echo "!! ncu $name failed"; tail -5 "$out/ncu_$name.txt"; status=1; }
  # Raw metrics in a pass of their own: a name this ncu does not know fails only this pass.
  timeout "${NCU_TIMEOUT:-240}" "$ncu" --clock-control none -k regex:sm90_fp8 -s 1 -c 1 \
    --metrics sm__cycles_elapsed.avg.per_second,lts__t_bytes.sum.per_second,lts__t_sectors_srcunit_tex.sum,l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed \
    python3 $cmd >> "$out/ncu_$name.txt" 2>&1 || echo "   (raw metrics pass failed: see $out/ncu_$name.txt)"
  # Where the SMs' operand bytes come from and how full the crossbar into them is (small M: the math
  # warps wait on the full barrier most of the time while DRAM and L2 sit at 25-35%, session 9). The
  # ltcfabric counters: sectors an L2 slice took from the other L2 partition, and how busy that link
  # was (the same plan moving the same bytes at 0.95x the peer's L2-to-SM rate, session 31).
  timeout "${NCU_TIMEOUT:-240}" "$ncu" --clock-control none -k regex:sm90_fp8 -s 1 -c 1 \
    --metrics l1tex__m_xbar2l1tex_read_bytes.sum.per_second,l1tex__m_xbar2l1tex_read_bytes.sum.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__ltcfabric2lts_cycles_active.avg.pct_of_peak_sustained_elapsed \
    python3 $cmd >> "$out/ncu_$name.txt" 2>&1 || echo "   (crossbar metrics pass failed: see $out/ncu_$name.txt)"
  if [[ "${NCU_SOURCE:-0}" == 1 ]]; then
    # Per-SASS-instruction counters (shared-memory wavefronts, stall samples) in a pass of their own:
    # which instructions fill the shared-memory pipe and where the warps wait. The report and its
    # source page (CSV, SASS) come back under $out.
    timeout "${NCU_TIMEOUT:-240}" "$ncu" --clock-control none -k regex:sm90_fp8 -s 1 -c 1 \
      --section SourceCounters --section WarpStateStats -f -o "$out/ncu_${name}_source" \
      python3 $cmd > "$out/ncu_${name}_source.log" 2>&1 || echo "   (source pass failed: see $out/ncu_${name}_source.log)"
    "$ncu" --import "$out/ncu_${name}_source.ncu-rep" --page source --print-source sass --csv \
      > "$out/ncu_${name}_sass.csv" 2>&1 || echo "   (source page failed: see $out/ncu_${name}_sass.csv)"
  fi
  echo "== $name ($cmd)"
  grep -E "^\s+(Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy|Memory Throughput|L2 Cache Throughput|DRAM Throughput|sm__cycles_elapsed|lts__t_bytes|lts__t_sectors_srcunit_tex|l1tex__m_xbar2l1tex|lts__t_sectors_srcunit_ltcfabric|lts__ltcfabric2lts|dram__bytes_read|l1tex__data_bank|l1tex__data_pipe_lsu_wavefronts_mem_shared|Shared Memory|Block Size|Grid Size|Registers Per Thread|Warp Cycles Per Issued Instruction)\b" \
    "$out/ncu_$name.txt" | sed 's/^ */   /'
  # The stall reasons ncu ranks (WarpStateStats' rule text names the largest).
  grep -A2 -E "^\s+(OPT|INF)\s+.*[Ss]tall" "$out/ncu_$name.txt" | head -6 | sed 's/^ */   /'
done
exit $status
