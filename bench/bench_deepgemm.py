"""Our FP8 GEMMs against DeepGEMM's on the same GPU, in the same run, on the same operands (FP4 cells:
the same shapes, each side with its own operands).

    bash scripts/peer_deepgemm.sh [--ms 64,128,4096] [--parts dense,contiguous,masked] [--warm-workers 12]

DeepGEMM is a peer, not a dependency: ``scripts/peer_deepgemm.sh`` builds it from a source copy and
puts it on the path. Cells:

* dense: ``fp8_gemm_nt`` at M in ``--ms`` x the DeepSeek-V3 N x K pairs of bench_gemm.py;
* contiguous: ``m_grouped_fp8_gemm_nt_contiguous``, 4 x 8192 and 8 x 4096 rows, N x K 4096 x 7168 and
  7168 x 2048;
* masked: ``m_grouped_fp8_gemm_nt_masked``, 32 experts x {4, 16} tokens and 256 experts x {1, 8}
  tokens (DESIGN.md's decode cells) in slots of 128 rows, the same N x K pairs;
* fp4: the masked cells with our FP4 weights (``m_grouped_fp8_fp4_gemm_nt_masked`` on the decode
  layout) against DeepGEMM's FP8 masked kernel on FP8 weights of the same shape (issue 4's bar:
  1.8x); rates count each side's own weight bytes;
* bf16_contiguous, bf16_masked (only when named in ``--parts``): ``m_grouped_bf16_gemm_nt_*`` against
  DeepGEMM's, the contiguous and masked cells above on bf16 operands.

``--mn-scales`` also times our FP8 call (dense and contiguous cells) on DeepGEMM's own operands (A scales MN-major and TMA-aligned,
which our kernels take as they are, and which ``per_token_cast_to_fp8(mn_major_sf=True)`` writes), so
both kernels read the same bytes, with its own geometric means. The default column gives ours the K-major scales of ``per_token_cast_to_fp8``,
which DeepGEMM would transpose in a kernel of its own.

``--variant NAME=VALUE[,...]`` (repeatable) also times our FP8 call with those environment switches
set (with ``--mn-scales``: the call on MN-major scales, where the cell has one), its output
checked, as a ratio to DeepGEMM's time. Where a dense cell's variant plans the same kernel as ours (or
as an earlier variant), its column reads "same plan" and it is not timed: a kernel timed right after
itself reads faster (``kernels.testing.repeated_plans``). A cell whose output on either side is off
(calc_diff over 1e-3; ours 2e-3 for FP4) is named at the end and left out of the means, and the
run exits 1.

``--theirs-k-major`` also times DeepGEMM's call on the quantizers' K-major A scales, the issues' signature,
counting every kernel of its call (DeepGEMM then makes them MN-major with a kernel of its own before
its GEMM, as ours copies them before some GEMMs), with its own speed-ups and geometric means: ours and
theirs on the same operands, each call doing what it needs.

``--write-flush-too`` times every call once more after the memset flush (``MOE_BENCH_FLUSH=write``,
kernels/testing/bench.py), with its own speed-ups and geometric means: that flush leaves dirty lines
in L2 whose write-back the next kernel pays, which weighs most on the short decode cells.

Kernel time from the profiler with the L2 flushed before every run, all of a cell's calls (ours,
DeepGEMM's, the variants) timed in one profile with their runs interleaved (ours: every kernel of the call,
the copy of K-major A scales included; DeepGEMM's: its GEMM kernel, its A scales handed over in the
MN-major TMA-aligned layout it wants, so it runs no transpose), and the time per call from Python. "speed-up" = DeepGEMM's kernel time over ours. Both
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
from bench_gemm import OURS_KERNELS, SHAPES, block_scaled, ours_plan
from bench_grouped import NK, make_contiguous, make_masked, make_masked_fragment, output_check
from kernels.testing import (bench_kineto, bench_kineto_interleaved, calc_diff, env_call, env_switches,
                             flush_description, output_diff, parse_env_variants, per_call_us_interleaved,
                             repeated_plans)

_OURS = OURS_KERNELS  # every kernel of our call, the copy of K-major A scales too (bench_gemm.py)
_THEIRS = "sm90_fp8_gemm_1d2d"  # DeepGEMM's SM90 FP8 kernel (1x128 A scales, 128x128 B scales)
_THEIRS_BF16 = "sm90_bf16_gemm"
PARTS = ("dense", "contiguous", "masked", "fp4")  # the default
BF16_PARTS = ("bf16_contiguous", "bf16_masked")
# Our output's bound per part (DeepGEMM's: 1e-3, bf16 parts 1e-4).
_MAX_DIFF = {"dense": 1e-3, "contiguous": 1e-3, "masked": 1e-3, "fp4": 2e-3, "bf16_contiguous": 1e-4,
             "bf16_masked": 1e-4}
_RATE_PARTS = ("masked", "fp4", "bf16_masked")  # decode cells: weight bytes per second
MASKED = [(32, 4), (32, 16), (256, 1), (256, 8)]
CONTIGUOUS = [(4, 8192), (8, 4096)]


@dataclass
class Cell:
    """One problem with both calls ready: ``ours()`` writes ``ours_out``, ``theirs()`` writes ``theirs_out``;
    ``check_ours(out)`` / ``check_theirs(out)`` is calc_diff of an output against float32 math on that
    side's dequantized operands; ``ours_kernel`` the profiler name of our kernel. Weight bytes per side
    (they differ only for FP4 cells)."""

    part: str
    label: str
    ours: Callable[[], None]
    theirs: Callable[[], None]
    ours_out: torch.Tensor
    theirs_out: torch.Tensor
    check_ours: Callable[[torch.Tensor], float]
    check_theirs: Callable[[torch.Tensor], float]
    flops: int
    ours_weight_bytes: int
    theirs_weight_bytes: int
    ours_kernel: str = _OURS
    ours_mn: Callable[[], None] | None = None  # ours on DeepGEMM's MN-major A scales, writing ours_out
    theirs_k: Callable[[], None] | None = None  # DeepGEMM on our K-major A scales, writing theirs_out
    plan: Callable[[bool], object] | None = None  # our call's plans (True: on MN-major A scales); dense only
    theirs_kernel: str = _THEIRS


def cell_specs(ms: list[int], parts: list[str]) -> list[tuple]:
    specs = []
    if "dense" in parts:
        specs += [("dense", m, n, k) for m in ms for n, k in SHAPES]
    if "contiguous" in parts:
        specs += [("contiguous", g, rows, n, k) for g, rows in CONTIGUOUS for n, k in NK]
    for part in ("masked", "fp4"):
        if part in parts:
            specs += [(part, g, tokens, n, k) for g, tokens in MASKED for n, k in NK]
    if "bf16_contiguous" in parts:
        specs += [("bf16_contiguous", g, rows, n, k) for g, rows in CONTIGUOUS for n, k in NK]
    if "bf16_masked" in parts:
        specs += [("bf16_masked", g, tokens, n, k) for g, tokens in MASKED for n, k in NK]
    return specs


def make_bf16_cell(spec: tuple) -> Cell:
    """A bf16 grouped cell: the same bf16 operands on both sides (masked: slots of 128 rows, as the FP8
    cells' for DeepGEMM's whole-tile stores), outputs checked against float32 math on the first and
    last group."""
    import deep_gemm

    part, groups, rows, n, k = spec
    masked = part == "bf16_masked"
    b = torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16)
    if masked:
        a = torch.randn(groups, 128, k, device="cuda", dtype=torch.bfloat16)
        index = torch.full((groups,), rows, device="cuda", dtype=torch.int32)
        outs = [torch.empty(groups, 128, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        ours = lambda: kernels.m_grouped_bf16_gemm_nt_masked(a, b, outs[0], index, rows)  # noqa: E731
        theirs = lambda: deep_gemm.m_grouped_bf16_gemm_nt_masked(a, b, outs[1], index, rows)  # noqa: E731
        label = f"bf16 {groups} experts x {rows} tok, {n} x {k}"
    else:
        a = torch.randn(groups * rows, k, device="cuda", dtype=torch.bfloat16)
        index = torch.arange(groups, device="cuda", dtype=torch.int32).repeat_interleave(rows)
        outs = [torch.empty(groups * rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        ours = lambda: kernels.m_grouped_bf16_gemm_nt_contiguous(a, b, outs[0], index)  # noqa: E731
        theirs = lambda: deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, outs[1], index)  # noqa: E731
        label = f"bf16 {groups} x {rows}, {n} x {k}"

    def check(out: torch.Tensor) -> float:
        worst = 0.0
        for g in sorted({0, groups - 1}):
            lhs = a[g, :rows] if masked else a[g * rows:(g + 1) * rows]
            got = out[g, :rows] if masked else out[g * rows:(g + 1) * rows]
            worst = max(worst, calc_diff(got.float(), lhs.float() @ b[g].float().t()))
        return worst

    return Cell(part, label, ours, theirs, outs[0], outs[1], check, check, 2 * groups * rows * n * k,
                2 * groups * n * k, 2 * groups * n * k, theirs_kernel=_THEIRS_BF16)


def make_cell(spec: tuple) -> Cell:
    import deep_gemm

    tma_sf = deep_gemm.get_mn_major_tma_aligned_tensor
    part = spec[0]
    if part in BF16_PARTS:
        return make_bf16_cell(spec)
    if part == "dense":
        _, m, n, k = spec
        a = kernels.per_token_cast_to_fp8(block_scaled(m, k, 1))
        b = kernels.per_block_cast_to_fp8(block_scaled(n, k, 128))
        a_dg = (a[0], tma_sf(a[1]))
        d_ours, d_theirs = (torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref = kernels.reference.gemm.fp8_gemm_nt(a, b).float()
        check = lambda out: calc_diff(out, ref)  # noqa: E731
        return Cell(part, f"{m} x {n} x {k}", lambda: kernels.fp8_gemm_nt(a, b, d_ours),
                    lambda: deep_gemm.fp8_gemm_nt(a_dg, b, d_theirs), d_ours, d_theirs, check, check,
                    2 * m * n * k, n * k, n * k, ours_mn=lambda: kernels.fp8_gemm_nt(a_dg, b, d_ours),
                    theirs_k=lambda: deep_gemm.fp8_gemm_nt(a, b, d_theirs),
                    plan=lambda mn: ours_plan(m, n, k, mn))
    groups, rows, n, k = spec[1:]
    if part == "contiguous":
        problem = make_contiguous("fp8", groups, rows, n, k)
        m_indices = torch.arange(groups, device="cuda", dtype=torch.int32).repeat_interleave(rows)
        d_theirs = torch.empty_like(problem.out)
        a_dg = (problem.a[0], tma_sf(problem.a[1]))
        theirs = lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a_dg, problem.b, d_theirs, m_indices)  # noqa: E731
        ours_mn = lambda: kernels.m_grouped_fp8_gemm_nt_contiguous(a_dg, problem.b, problem.out, m_indices)  # noqa: E731
        theirs_k = lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(problem.a, problem.b, d_theirs, m_indices)  # noqa: E731
        label = f"{groups} x {rows}, {n} x {k}"
    else:
        # Slots of 128 rows: DeepGEMM stores whole block-M tiles, so slots shorter than its block M
        # let one expert's tile overwrite the next expert's rows.
        problem = make_masked("fp8", groups, rows, n, k, max_m=128)
        masked_m = torch.full((groups,), rows, device="cuda", dtype=torch.int32)
        d_theirs = torch.empty_like(problem.out)
        a_dg = (problem.a[0], tma_sf(problem.a[1]))
        theirs = lambda: deep_gemm.m_grouped_fp8_gemm_nt_masked(a_dg, problem.b, d_theirs, masked_m, rows)  # noqa: E731
        theirs_k = lambda: deep_gemm.m_grouped_fp8_gemm_nt_masked(problem.a, problem.b, d_theirs, masked_m, rows)  # noqa: E731
        # None: DeepGEMM's per-group MN-major scales put each group's block after the previous
        # group's whole [K blocks, max_m] plane, which our masked GEMMs' one row stride cannot
        # address (they gather K-major scales anyway).
        ours_mn = None
        label = f"{groups} experts x {rows} tok, {n} x {k}"
        if part == "fp4":
            ours = make_masked_fragment(groups, rows, n, k, max_m=128)
            return Cell(part, "FP4 " + label, ours.call, theirs, ours.out, d_theirs, output_check(ours),
                        output_check(problem), problem.flops, ours.weight_bytes, problem.weight_bytes, ours.kernel)
    check = output_check(problem)
    return Cell(part, label, problem.call, theirs, problem.out, d_theirs, check, check, problem.flops,
                problem.weight_bytes, problem.weight_bytes, ours_mn=ours_mn, theirs_k=theirs_k)


def warm(specs: list[tuple], index: int, workers: int, variants: list[tuple[str, dict[str, str]]],
         mn_scales: bool, theirs_k_major: bool = False) -> None:
    """Compile this worker's share of the cells' kernels (both sides, our variants too) into the
    on-disk caches."""
    for spec in specs[index::workers]:
        cell = make_cell(spec)
        cell.ours()
        for _, env in variants:
            with env_switches(**env):
                cell.ours()
        if mn_scales and cell.ours_mn is not None:
            cell.ours_mn()
        cell.theirs()
        if theirs_k_major and cell.theirs_k is not None:
            cell.theirs_k()
        torch.cuda.synchronize()
        del cell
        torch.cuda.empty_cache()  # the 256-expert cells' operands: free them before the next cell


def measure(cell: Cell, variants: list[tuple[str, dict[str, str]]], mn_scales: bool, write_flush: bool,
            theirs_k_major: bool = False) -> dict:
    """One cell: each call's output checked (poisoned, one call), then every call's kernel time from
    one profile with their runs interleaved (bench_kineto_interleaved: the GPU's drift over a cell falls
    on all columns alike), then the time per call of ours and DeepGEMM's, sampled in turn."""
    checked = []  # (key, call, kernel name, output, check)
    checked.append(("ours", cell.ours, cell.ours_kernel, cell.ours_out, cell.check_ours))
    checked.append(("theirs", cell.theirs, cell.theirs_kernel, cell.theirs_out, cell.check_theirs))
    on_mn = mn_scales and cell.ours_mn is not None  # FP4 cells have no FP8 twin: no column, as for variants
    if on_mn:
        checked.append(("MN-major scales", cell.ours_mn, cell.ours_kernel, cell.ours_out, cell.check_ours))
    # The switches are the FP8 kernels'; FP4 cells run another kernel. With --mn-scales they switch
    # the call on MN-major scales (the same bytes as DeepGEMM's), where a cell has one.
    variant_call = cell.ours_mn if on_mn else cell.ours
    variants = variants if cell.part != "fp4" else []
    # A variant that plans the default's kernel (or an earlier variant's) is not timed (repeated_plans).
    repeated = repeated_plans(lambda: cell.plan(on_mn), variants) if cell.plan else [False] * len(variants)
    for (label, env), same in zip(variants, repeated):
        if not same:
            checked.append((label, env_call(variant_call, **env), cell.ours_kernel, cell.ours_out, cell.check_ours))
    if theirs_k_major and cell.theirs_k is not None:  # every kernel of DeepGEMM's call: its transpose too
        checked.append(("theirs_k", cell.theirs_k, "", cell.theirs_out, cell.check_theirs))
    diffs = [output_diff(call, out, check) for _, call, _, out, check in checked]
    timings = bench_kineto_interleaved([(call, kernel) for _, call, kernel, _, _ in checked])
    us = [t.median_s * 1e6 for t in timings]
    row = {"ours_us": us[0], "ours_diff": diffs[0], "theirs_us": us[1], "theirs_diff": diffs[1], "variants": []}
    timed = iter(zip(checked[2:], us[2:], diffs[2:]))  # MN-major, the timed variants, theirs_k, in order
    if on_mn:
        (key, *_), t, diff = next(timed)
        row["variants"].append((key, t, diff))
    for (label, _), same in zip(variants, repeated):  # a repeated plan's column: (label, None, None)
        row["variants"].append((label, None, None) if same else (label, *next(timed)[1:]))
    for _, t, diff in timed:
        row["theirs_k_us"], row["theirs_k_diff"] = t, diff
    # Both calls sampled in turn, under the same state of the machine (per_call_us_interleaved).
    row["ours_call_us"], row["theirs_call_us"] = per_call_us_interleaved([cell.ours, cell.theirs])
    if write_flush:  # every call once more after the memset flush, for the record of the flush's cost
        with env_switches(MOE_BENCH_FLUSH="write"):
            row["write"] = [bench_kineto(call, kernel).median_s * 1e6 for call, kernel in
                            ((cell.ours, cell.ours_kernel), (cell.theirs, cell.theirs_kernel))
                            + (((cell.ours_mn, cell.ours_kernel),) if mn_scales and cell.ours_mn is not None else ())]
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="64,128,4096", help="dense M values")
    parser.add_argument("--nk", default=None, metavar="NxK[,NxK...]", help="only these dense N x K pairs")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE...]",
                        help="also time our call with these environment switches set (repeatable)")
    parser.add_argument("--mn-scales", action="store_true",
                        help="also time our call on DeepGEMM's operands (MN-major TMA-aligned A scales)")
    parser.add_argument("--theirs-k-major", action="store_true",
                        help="also time DeepGEMM's call on the K-major A scales ours gets (its transpose counted)")
    parser.add_argument("--write-flush-too", action="store_true",
                        help="also time every call after the memset flush (MOE_BENCH_FLUSH=write)")
    parser.add_argument("--warm-workers", type=int, default=12)
    parser.add_argument("--warm-index", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    parts = args.parts.split(",")
    if any(p not in PARTS + BF16_PARTS for p in parts):
        parser.error(f"--parts takes {', '.join(PARTS + BF16_PARTS)}; got {args.parts!r}")
    try:
        variants = parse_env_variants(args.variant)
    except ValueError as exc:
        parser.error(str(exc))
    if args.mn_scales:  # the variants then run on the MN column's operands: compare them with it, not with ours
        variants = [(f"{label} (on MN)", env) for label, env in variants]
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
        warm(specs, args.warm_index, args.warm_workers, variants, args.mn_scales, args.theirs_k_major)
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
    print(flush_description())
    print(f"{'cell':>38} | {'ours us':>8} {'call us':>8} {'diff':>8} | {'DeepGEMM':>8} {'call us':>8} {'diff':>8} | "
          f"{'speed-up':>8} | {'ours':>14} {'DeepGEMM':>14}"
          + (" | MN-major scales us  speed-up  diff" if args.mn_scales else "")
          + "".join(f" | {label} us  speed-up  diff" for label, _ in variants)
          + (" | DeepGEMM K-major us  speed-up  diff" + "".join(f"  {label} speed-up" for label, _ in variants)
             if args.theirs_k_major else "")
          + (" | write flush: ours us  DeepGEMM us  speed-up" + ("  MN-major us  speed-up" if args.mn_scales else "")
             if args.write_flush_too else ""))
    ratios: dict[str, list[float]] = {}
    mn_ratios: dict[str, list[float]] = {}
    write_ratios: dict[str, list[float]] = {}     # the memset flush (--write-flush-too)
    write_mn_ratios: dict[str, list[float]] = {}
    k_major_ratios: dict[str, list[float]] = {}   # DeepGEMM on K-major scales (--theirs-k-major)
    k_major_variant_ratios: dict[tuple[str, str], list[float]] = {}  # each variant of ours against it
    bad = []
    for spec in specs:
        cell = make_cell(spec)
        row = measure(cell, variants, args.mn_scales, args.write_flush_too, args.theirs_k_major)
        speedup = row["theirs_us"] / row["ours_us"]
        # A wrong output on either side keeps the cell out of the means (NaN fails the comparison too).
        if not (row["ours_diff"] < _MAX_DIFF[cell.part] and row["theirs_diff"] < min(1e-3, _MAX_DIFF[cell.part])
                and row.get("theirs_k_diff", 0.0) < 1e-3
                and all(diff is None or diff < _MAX_DIFF[cell.part] for _, _, diff in row["variants"])):
            bad.append(cell.label)
        else:
            ratios.setdefault(cell.part, []).append(speedup)
            if args.mn_scales and cell.ours_mn is not None:
                mn_ratios.setdefault(cell.part, []).append(row["theirs_us"] / row["variants"][0][1])
            if "theirs_k_us" in row:
                k_major_ratios.setdefault(cell.part, []).append(row["theirs_k_us"] / row["ours_us"])
                for label, us, _ in row["variants"][len(row["variants"]) - len(variants):]:
                    if us is not None:
                        k_major_variant_ratios.setdefault((cell.part, label), []).append(row["theirs_k_us"] / us)
            if "write" in row:
                write_ratios.setdefault(cell.part, []).append(row["write"][1] / row["write"][0])
                if len(row["write"]) > 2:
                    write_mn_ratios.setdefault(cell.part, []).append(row["write"][1] / row["write"][2])
        if cell.part in _RATE_PARTS:
            rates = [f"{nbytes / us / 1e3:>9.0f} GB/s" for nbytes, us in
                     ((cell.ours_weight_bytes, row["ours_us"]), (cell.theirs_weight_bytes, row["theirs_us"]))]
        else:
            rates = [f"{cell.flops / us / 1e6:>6.0f} TFLOP/s" for us in (row["ours_us"], row["theirs_us"])]
        extra = "".join(f" | {us:>{len(label) + 3}.1f} {row['theirs_us'] / us:>8.2f}x {diff:.0e}" if us is not None
                        else f" | {'same plan':>{len(label) + 3}} {'-':>9} {'-':>5}"
                        for label, us, diff in row["variants"])
        if "theirs_k_us" in row:  # and each variant of ours against it (DeepGEMM's K-major call)
            k_us = row["theirs_k_us"]
            extra += f" | {k_us:>19.1f} {k_us / row['ours_us']:>8.2f}x {row['theirs_k_diff']:.0e}" + "".join(
                f" {k_us / us:>{len(label) + 9}.2f}x" if us is not None else f" {'-':>{len(label) + 10}}"
                for label, us, _ in row["variants"][len(row["variants"]) - len(variants):])
        elif args.theirs_k_major:  # a cell without that call (FP4): the columns stay aligned
            extra += f" | {'-':>19} {'-':>9} {'-':>5}" + "".join(f" {'-':>{len(label) + 10}}" for label, _ in variants)
        if "write" in row:
            w = row["write"]
            extra += f" | {w[0]:>8.1f} {w[1]:>8.1f} {w[1] / w[0]:>7.2f}x" + "".join(
                f" {us:>8.1f} {w[1] / us:>7.2f}x" for us in w[2:])
        print(f"{cell.label:>38} | {row['ours_us']:>8.1f} {row['ours_call_us']:>8.1f} {row['ours_diff']:>8.1e} | "
              f"{row['theirs_us']:>8.1f} {row['theirs_call_us']:>8.1f} {row['theirs_diff']:>8.1e} | "
              f"{speedup:>7.2f}x | {rates[0]} {rates[1]}{extra}", flush=True)
    for part, values in ratios.items():
        geo = torch.tensor(values).log().mean().exp().item()
        bar = 1.8 if part == "fp4" else 1.0  # issue 4: FP4 weights >= 1.8x DeepGEMM's FP8 masked kernel
        wins = sum(v > bar for v in values)
        what = "of our FP4 weights over DeepGEMM's FP8" if part == "fp4" else "over DeepGEMM"
        print(f"{part}: geometric mean speed-up {what} {geo:.3f}x, above {bar}x in {wins} of {len(values)}, "
              f"lowest {min(values):.2f}x")
    for part, values in mn_ratios.items():  # both sides on the same MN-major A scales
        geo = torch.tensor(values).log().mean().exp().item()
        print(f"{part}, ours on MN-major A scales: geometric mean speed-up over DeepGEMM {geo:.3f}x, above 1.0x in "
              f"{sum(v > 1.0 for v in values)} of {len(values)}, lowest {min(values):.2f}x")
    for part, values in k_major_ratios.items():  # both calls on the quantizers' K-major A scales
        geo = torch.tensor(values).log().mean().exp().item()
        print(f"{part}, both on K-major A scales (DeepGEMM's transpose counted): geometric mean speed-up over "
              f"DeepGEMM {geo:.3f}x, above 1.0x in {sum(v > 1.0 for v in values)} of {len(values)}, "
              f"lowest {min(values):.2f}x")
    for (part, label), values in k_major_variant_ratios.items():
        geo = torch.tensor(values).log().mean().exp().item()
        print(f"{part}, ours with {label} against DeepGEMM on K-major A scales: geometric mean speed-up {geo:.3f}x, "
              f"above 1.0x in {sum(v > 1.0 for v in values)} of {len(values)}, lowest {min(values):.2f}x")
    for label, table in (("write flush", write_ratios), ("write flush, ours on MN-major A scales", write_mn_ratios)):
        for part, values in table.items():
            geo = torch.tensor(values).log().mean().exp().item()
            print(f"{part}, {label}: geometric mean speed-up {geo:.3f}x, lowest {min(values):.2f}x")
    if bad:
        print(f"WRONG OUTPUT (diff over the bound), left out of the means: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
