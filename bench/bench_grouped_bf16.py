"""M-grouped BF16 GEMMs (MoE experts with bfloat16 weights) against torch's grouped GEMMs, in one run.

    python bench/bench_grouped_bf16.py [--groups 32,256] [--tokens 1,4,16,64,256] [--masked-only]

Contiguous (prefill): 4 x 8192 and 8 x 4096 rows for N x K = 4096 x 7168 and 7168 x 2048 against
``torch._grouped_mm`` (``offs`` = the groups' row ends) on the same operands. Masked (decode): 32
and 256 experts at the given tokens per expert (max_m = tokens) against ``torch.bmm`` over the
groups' [max_m, K] x [K, N] (the batched form a masked layout maps to). Kernel µs from the
profiler, ours and the peer's runs interleaved in one profile, each after an L2 flush
(``MOE_BENCH_FLUSH``); TFLOP/s counts the valid rows; weights GB/s = the weight bytes (2 N K per
expert) over kernel time; per call µs: one call from Python on an idle stream, host work included.
"diff": the largest calc_diff of ours and the peer's outputs against float32 math, over the first
and last group, outputs NaN-poisoned before the run.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

import torch

import kernels
from kernels.testing import (bench_kineto_interleaved, calc_diff, copy_ceiling_gbps, flush_mode, per_call_us,
                             positive_ints)

NK = [(4096, 7168), (7168, 2048)]
_ALL_KERNELS = ""  # the profiler counts every kernel of a call (the flush between runs never)


@dataclass
class Problem:
    """One grouped call and its torch peer, each writing its own output."""

    call: Callable[[], None]
    peer: Callable[[], None]
    out: torch.Tensor
    peer_out: list[torch.Tensor]  # [the peer's last output]
    a: torch.Tensor
    b: torch.Tensor
    rows: int        # rows per group (contiguous) or valid tokens per group (masked)
    masked: bool
    flops: int
    weight_bytes: int


def make_contiguous(groups: int, rows: int, n: int, k: int, device="cuda") -> Problem:
    a = torch.randn(groups * rows, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(groups, n, k, device=device, dtype=torch.bfloat16)
    m_indices = torch.arange(groups, device=device, dtype=torch.int32).repeat_interleave(rows)
    out = torch.empty(groups * rows, n, device=device, dtype=torch.bfloat16)
    offs = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * rows
    bt = b.transpose(1, 2)
    # torch._grouped_mm has no out=: the timed call allocates its output (no copy on its time), and
    # its last output is the one checked.
    peer_out = [torch.empty_like(out)]

    def peer():
        peer_out[0] = torch._grouped_mm(a, bt, offs=offs)

    return Problem(lambda: kernels.m_grouped_bf16_gemm_nt_contiguous(a, b, out, m_indices), peer, out, peer_out,
                   a, b, rows, False, 2 * groups * rows * n * k, 2 * groups * n * k)


def make_masked(groups: int, tokens: int, n: int, k: int, device="cuda") -> Problem:
    a = torch.randn(groups, tokens, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(groups, n, k, device=device, dtype=torch.bfloat16)
    masked_m = torch.full((groups,), tokens, device=device, dtype=torch.int32)
    out = torch.empty(groups, tokens, n, device=device, dtype=torch.bfloat16)
    peer_out = torch.empty_like(out)
    bt = b.transpose(1, 2)
    return Problem(lambda: kernels.m_grouped_bf16_gemm_nt_masked(a, b, out, masked_m, tokens),
                   lambda: torch.bmm(a, bt, out=peer_out), out, [peer_out], a, b, tokens, True,
                   2 * groups * tokens * n * k, 2 * groups * n * k)


def sample_diff(problem: Problem, out: torch.Tensor) -> float:
    """Worst calc_diff of ``out`` against float32 math, over the first and the last group."""
    worst = 0.0
    groups = problem.b.shape[0]
    for g in sorted({0, groups - 1}):
        rows = slice(None) if problem.masked else slice(g * problem.rows, (g + 1) * problem.rows)
        a = problem.a[g] if problem.masked else problem.a[rows]
        got = out[g] if problem.masked else out[rows]
        diff = calc_diff(got.float(), a.float() @ problem.b[g].float().t())
        worst = float("nan") if diff != diff or worst != worst else max(worst, diff)
    return worst


def measure(problem: Problem) -> dict:
    problem.out.fill_(float("nan"))
    problem.peer_out[0].fill_(float("nan"))
    problem.call()
    problem.peer()
    diff = max(sample_diff(problem, problem.out), sample_diff(problem, problem.peer_out[0]))
    ours, peer = bench_kineto_interleaved([(problem.call, _ALL_KERNELS), (problem.peer, _ALL_KERNELS)])
    t, tp = ours.median_s, peer.median_s
    return dict(ours_us=t * 1e6, peer_us=tp * 1e6, tflops=problem.flops / t / 1e12, peer_tflops=problem.flops / tp / 1e12,
                weight_gbps=problem.weight_bytes / t / 1e9, peer_weight_gbps=problem.weight_bytes / tp / 1e9,
                speedup=tp / t, call_us=per_call_us(problem.call), peer_call_us=per_call_us(problem.peer), diff=diff)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--masked-only", action="store_true", help="skip the contiguous (prefill) table")
    parser.add_argument("--groups", type=positive_ints, default="32,256",
                        help="masked table: comma-separated expert counts")
    parser.add_argument("--tokens", type=positive_ints, default="1,4,16,64,256",
                        help="masked table: comma-separated tokens per expert")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_grouped_bf16: needs a CUDA device", file=sys.stderr)
        return 1
    print(f"copy ceiling (events, read + write): {copy_ceiling_gbps():.0f} GB/s; L2 flush: {flush_mode()} "
          "(MOE_BENCH_FLUSH)\n")
    if not args.masked_only:
        print("| contiguous | N x K | ours µs | ours TFLOP/s | ours per call µs | torch._grouped_mm µs | torch TFLOP/s "
              "| torch per call µs | ours vs torch | diff |")
        print("| --- " * 10 + "|")
        for groups, rows in [(4, 8192), (8, 4096)]:
            for n, k in NK:
                r = measure(make_contiguous(groups, rows, n, k))
                print(f"| {groups} x {rows} | {n} x {k} | {r['ours_us']:.1f} | {r['tflops']:.0f} | {r['call_us']:.1f} "
                      f"| {r['peer_us']:.1f} | {r['peer_tflops']:.0f} | {r['peer_call_us']:.1f} | {r['speedup']:.2f}x "
                      f"| {r['diff']:.1e} |", flush=True)
                torch.cuda.empty_cache()
        print()
    print("| masked | N x K | tokens | ours µs | ours weights GB/s | ours per call µs | torch.bmm µs "
          "| torch weights GB/s | ours vs torch | diff |")
    print("| --- " * 10 + "|")
    for groups in args.groups:
        for n, k in NK:
            for tokens in args.tokens:
                r = measure(make_masked(groups, tokens, n, k))
                print(f"| {groups} | {n} x {k} | {tokens} | {r['ours_us']:.1f} | {r['weight_gbps']:.0f} "
                      f"| {r['call_us']:.1f} | {r['peer_us']:.1f} | {r['peer_weight_gbps']:.0f} | {r['speedup']:.2f}x "
                      f"| {r['diff']:.1e} |", flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
