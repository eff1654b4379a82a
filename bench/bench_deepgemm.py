"""Our FP8 GEMMs against DeepGEMM's on the same GPU, in the same run, on the same operands.

    bash scripts/peer_deepgemm.sh [--ms 64,128,4096] [--parts dense,contiguous,masked] [--warm-workers 12]

DeepGEMM is a peer, not a dependency: ``scripts/peer_deepgemm.sh`` builds it from a source copy and
puts it on the path. Cells:

* dense: ``fp8_gemm_nt`` at M in ``--ms`` x the DeepSeek-V3 N x K pairs of bench_gemm.py;
* contiguous: ``m_grouped_fp8_gemm_nt_contiguous``, 4 x 8192 and 8 x 4096 rows, N x K 4096 x 7168 and
  7168 x 2048;
* masked: ``m_grouped_fp8_gemm_nt_masked``, 32 experts x {4, 16} tokens and 256 experts x {1, 8}
  tokens (DESIGN.md's decode cells) in slots of 128 rows, the same N x K pairs.

Kernel time from the profiler with the L2 flushed before every run (each side's GEMM kernel only:
DeepGEMM's A scales are handed over in the MN-major TMA-aligned layout it wants, so it runs no
transpose), and the time per call from Python. "speed-up" = DeepGEMM's kernel time over ours. Both
outputs are NaN-poisoned, then checked against float32 math on the dequantized operands (first and
last group for the grouped cells).

Each DeepGEMM kernel compiles once with nvcc (tens of seconds); ``--warm-workers`` processes compile
all cells' kernels (both sides) in parallel into the on-disk caches before the timed pass.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import torch

import kernels
from bench_gemm import SHAPES, block_scaled
from bench_grouped import NK, make_contiguous, make_masked, sample_diff
from kernels.testing import bench_kineto, calc_diff, per_call_us

_OURS = "sm90_fp8_gemm_nt"
_THEIRS = "sm90_fp8_gemm_1d2d"  # DeepGEMM's SM90 FP8 kernel (1x128 A scales, 128x128 B scales)
MASKED = [(32, 4), (32, 16), (256, 1), (256, 8)]
CONTIGUOUS = [(4, 8192), (8, 4096)]


@dataclass
class Cell:
    """One problem with both calls ready: ``ours()`` writes ``ours_out``, ``theirs()`` writes ``theirs_out``;
    ``check(out)`` is calc_diff of an output against float32 math on the dequantized operands."""

    part: str
    label: str
    ours: Callable[[], None]
    theirs: Callable[[], None]
    ours_out: torch.Tensor
    theirs_out: torch.Tensor
    check: Callable[[torch.Tensor], float]
    flops: int
    weight_bytes: int


def cell_specs(ms: list[int], parts: list[str]) -> list[tuple]:
    specs = []
    if "dense" in parts:
        specs += [("dense", m, n, k) for m in ms for n, k in SHAPES]
    if "contiguous" in parts:
        specs += [("contiguous", g, rows, n, k) for g, rows in CONTIGUOUS for n, k in NK]
    if "masked" in parts:
        specs += [("masked", g, tokens, n, k) for g, tokens in MASKED for n, k in NK]
    return specs


def make_cell(spec: tuple) -> Cell:
    import deep_gemm

    tma_sf = deep_gemm.get_mn_major_tma_aligned_tensor
    part = spec[0]
    if part == "dense":
        _, m, n, k = spec
        a = kernels.per_token_cast_to_fp8(block_scaled(m, k, 1))
        b = kernels.per_block_cast_to_fp8(block_scaled(n, k, 128))
        a_dg = (a[0], tma_sf(a[1]))
        d_ours, d_theirs = (torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref = kernels.reference.gemm.fp8_gemm_nt(a, b).float()
        return Cell(part, f"{m} x {n} x {k}", lambda: kernels.fp8_gemm_nt(a, b, d_ours),
                    lambda: deep_gemm.fp8_gemm_nt(a_dg, b, d_theirs), d_ours, d_theirs,
                    lambda out: calc_diff(out, ref), 2 * m * n * k, n * k)
    groups, rows, n, k = spec[1:]
    if part == "contiguous":
        problem = make_contiguous("fp8", groups, rows, n, k)
        m_indices = torch.arange(groups, device="cuda", dtype=torch.int32).repeat_interleave(rows)
        d_theirs = torch.empty_like(problem.out)
        a_dg = (problem.a[0], tma_sf(problem.a[1]))
        theirs = lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a_dg, problem.b, d_theirs, m_indices)  # noqa: E731
        label = f"{groups} x {rows}, {n} x {k}"
    else:
        # Slots of 128 rows: DeepGEMM stores whole block-M tiles, so slots shorter than its block M
        # let one expert's tile overwrite the next expert's rows.
        problem = make_masked("fp8", groups, rows, n, k, max_m=128)
        masked_m = torch.full((groups,), rows, device="cuda", dtype=torch.int32)
        d_theirs = torch.empty_like(problem.out)
        a_dg = (problem.a[0], tma_sf(problem.a[1]))
        theirs = lambda: deep_gemm.m_grouped_fp8_gemm_nt_masked(a_dg, problem.b, d_theirs, masked_m, rows)  # noqa: E731
        label = f"{groups} experts x {rows} tok, {n} x {k}"

    def check(out: torch.Tensor) -> float:
        saved, problem.out = problem.out, out
        try:
            return sample_diff(problem)
        finally:
            problem.out = saved

    return Cell(part, label, problem.call, theirs, problem.out, d_theirs, check, problem.flops, problem.weight_bytes)


def warm(specs: list[tuple], index: int, workers: int) -> None:
    """Compile this worker's share of the cells' kernels (both sides) into the on-disk caches."""
    for spec in specs[index::workers]:
        cell = make_cell(spec)
        cell.ours()
        cell.theirs()
        torch.cuda.synchronize()


def measure(cell: Cell) -> dict:
    row = {}
    for side, call, out, kernel in (("ours", cell.ours, cell.ours_out, _OURS),
                                    ("theirs", cell.theirs, cell.theirs_out, _THEIRS)):
        out.fill_(float("nan"))
        call()
        row[f"{side}_diff"] = cell.check(out)
        row[f"{side}_us"] = bench_kineto(call, kernel).median_s * 1e6
        row[f"{side}_call_us"] = per_call_us(call)
    # Timed again in the other order: the first timings after a long GEMM run slow (bench_gemm.py).
    row["ours_us"] = min(row["ours_us"], bench_kineto(cell.ours, _OURS).median_s * 1e6)
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="64,128,4096", help="dense M values")
    parser.add_argument("--nk", default=None, metavar="NxK[,NxK...]", help="only these dense N x K pairs")
    parser.add_argument("--parts", default="dense,contiguous,masked")
    parser.add_argument("--warm-workers", type=int, default=12)
    parser.add_argument("--warm-index", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    parts = args.parts.split(",")
    if any(p not in ("dense", "contiguous", "masked") for p in parts):
        parser.error(f"--parts takes dense, contiguous, masked; got {args.parts!r}")
    if not torch.cuda.is_available():
        print("bench_deepgemm: needs a CUDA device", file=sys.stderr)
        return 1
    try:
        import deep_gemm
    except ImportError as exc:
        print(f"bench_deepgemm: DeepGEMM is not importable ({exc}); run it through scripts/peer_deepgemm.sh",
              file=sys.stderr)
        return 1
    specs = cell_specs([int(m) for m in args.ms.split(",")], parts)
    if args.nk:
        keep = {tuple(int(v) for v in nk.split("x")) for nk in args.nk.split(",")}
        specs = [s for s in specs if s[0] != "dense" or (s[2], s[3]) in keep]
    if args.warm_index is not None:
        warm(specs, args.warm_index, args.warm_workers)
        return 0
    if args.warm_workers > 0:
        print(f"DeepGEMM {deep_gemm.__version__} from {os.path.dirname(deep_gemm.__file__)}; compiling {len(specs)} "
              f"cells' kernels in {min(args.warm_workers, len(specs))} processes", flush=True)
        procs = [subprocess.Popen([sys.executable, *sys.argv, "--warm-index", str(i)], env=os.environ.copy())
                 for i in range(min(args.warm_workers, len(specs)))]
        failed = {p.args[-1]: p.wait() for p in procs}
        failed = {index: rc for index, rc in failed.items() if rc != 0}
        if failed:
            print(f"bench_deepgemm: warm-up workers failed (index: exit status) {failed}", file=sys.stderr)
            return 1
    print(f"{'cell':>34} | {'ours us':>8} {'call us':>8} {'diff':>8} | {'DeepGEMM':>8} {'call us':>8} {'diff':>8} | "
          f"{'speed-up':>8} | {'ours':>14} {'DeepGEMM':>14}")
    ratios: dict[str, list[float]] = {}
    for spec in specs:
        cell = make_cell(spec)
        row = measure(cell)
        speedup = row["theirs_us"] / row["ours_us"]
        ratios.setdefault(cell.part, []).append(speedup)
        if cell.part == "masked":
            rate = lambda us: f"{cell.weight_bytes / us / 1e3:>9.0f} GB/s"  # noqa: E731
        else:
            rate = lambda us: f"{cell.flops / us / 1e6:>6.0f} TFLOP/s"  # noqa: E731
        print(f"{cell.label:>34} | {row['ours_us']:>8.1f} {row['ours_call_us']:>8.1f} {row['ours_diff']:>8.1e} | "
              f"{row['theirs_us']:>8.1f} {row['theirs_call_us']:>8.1f} {row['theirs_diff']:>8.1e} | "
              f"{speedup:>7.2f}x | {rate(row['ours_us'])} {rate(row['theirs_us'])}", flush=True)
    for part, values in ratios.items():
        geo = torch.tensor(values).log().mean().exp().item()
        wins = sum(v > 1 for v in values)
        print(f"{part}: geometric mean speed-up over DeepGEMM {geo:.3f}x, ours faster in {wins} of {len(values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
