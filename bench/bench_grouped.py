"""M-grouped GEMMs (MoE experts), FP8 and FP4 weights, against torch._scaled_grouped_mm, in one run.

    python bench/bench_grouped.py [--weights fp8,fp4]

Contiguous (prefill): 4 x 8192 and 8 x 4096 rows for N x K = 4096 x 7168 and 7168 x 2048, kernel
time (profiler, L2 flushed), TFLOP/s, and `torch._scaled_grouped_mm` with row-wise scales on the
same problem. Masked (decode): 32 and 256 experts at {1, 4, 16, 64, 256} tokens per expert,
reported as weight bytes read per second (the decode bound) next to the copy ceiling.

FP4 weights (``m_grouped_fp8_fp4_gemm_nt_*``): the same problems with random packed E2M1 codes and
UE8M0 exponent bytes per 1x32 (the form ``transform_sf_for_fp4_gemm`` gives); the tables add
the FP4 kernel's time and its speed-up over the FP8 kernel measured in the same run ("FP8 1-CTA":
the FP8 kernel with its 2-CTA clusters off, ``MOE_FP8_MULTICAST=0``, where it runs them; "FP8 ping-pong
flipped": on wide 128-row tiles, its two math warpgroups' turns on the tensor cores flipped,
``MOE_FP8_PINGPONG=1`` where it runs without and ``=0`` where with), and (masked,
<= 32 tokens) the same call on weights in the decode layout (``kernels.transform_fp4_for_decode``).
Weight bytes: FP8 = N K + 4 ceil(N/128) K/128 per expert; FP4 = N K / 2 + N K / 32 (both layouts).
"worst diff": the largest calc_diff of any kernel of the row against float32 math on its
dequantized operands, over the first and last group, outputs NaN-poisoned before the run.
``--variant NAME=VALUE`` times the FP8 kernel with environment switches set, ``--fp4-variant`` the
FP4 call (e.g. ``MOE_FP4_SWAP_AB=0``: the converter kernel; ``MOE_FP4_STAGED=0|1``: the in-kernel
conversion or the staged cast + FP8 GEMM), each interleaved with the default it
is divided by and its output checked; ``--sfa-mn-major``
times the contiguous FP8 kernel on MN-major TMA-aligned A scales. A contiguous row's FP8 columns
and the torch peer are timed in one profile, their runs interleaved (every column once per round,
each after its own L2 flush), so that drift over the row falls on all of them alike.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

import torch

import kernels
from kernels.testing import (bench_kineto, bench_kineto_interleaved, calc_diff, copy_ceiling_gbps,
                             env_call, flush_mode, output_diff, parse_env_variants, per_call_us, positive_ints)

NK = [(4096, 7168), (7168, 2048)]
# Profiler name counted for a call: every kernel of it ("" matches all). Large contiguous FP8 calls
# copy K-major A scales MN-major first (mn_major_sf); staged FP4 calls cast the weights to FP8 and
# run the FP8 GEMM (MOE_FP4_STAGED); the flush between runs is never counted.
_ALL_KERNELS = ""


def torch_grouped(a_fp8, b_fp8, counts):
    """torch._scaled_grouped_mm with row-wise scales on the same FP8 data (its scales are not the
    block scales, so only the time is compared)."""
    a, b = a_fp8[0], b_fp8[0]
    offs = torch.tensor(counts, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    scale_a = torch.ones(a.shape[0], device="cuda", dtype=torch.float32)
    scale_b = torch.ones(b.shape[0], b.shape[1], device="cuda", dtype=torch.float32)
    bt = b.transpose(1, 2)
    fn = lambda: torch._scaled_grouped_mm(a, bt, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)  # noqa: E731
    fn()
    return fn


@dataclass
class Problem:
    """One grouped GEMM call ready to run: ``call()`` writes ``out``; ``kernel`` is the profiler name
    of its kernel; ``a`` and ``b`` are its operands (the torch peer reuses the FP8 ones)."""

    call: Callable[[], None]
    kernel: str
    a: tuple
    b: tuple
    out: torch.Tensor
    weight_bytes: int
    flops: int
    weights: str = "fp8"           # the weights' format: "fp8" or "fp4"
    rows: int = 0                  # rows per group (contiguous) or valid tokens per group (masked)
    masked: bool = False
    ref_b: tuple | None = None     # the weights in their quantized form (b, unless b is a decode layout)


def worst_of(*diffs: float) -> float:
    """The largest diff, NaN if any is (max() would drop a NaN that came second)."""
    return float("nan") if any(d != d for d in diffs) else max(diffs)


def sample_diff(problem: Problem) -> float:
    """Worst calc_diff of the output against float32 math on the dequantized operands, over the
    first and the last group (all of them would take the dequantized weights of every expert)."""
    b, sfb = problem.ref_b if problem.ref_b is not None else problem.b
    groups = b.shape[0]
    worst = 0.0
    for g in sorted({0, groups - 1}):
        if problem.masked:
            a, sfa, got = problem.a[0][g, : problem.rows], problem.a[1][g, : problem.rows], problem.out[g, : problem.rows]
        else:
            rows = slice(g * problem.rows, (g + 1) * problem.rows)
            a, sfa, got = problem.a[0][rows], problem.a[1][rows], problem.out[rows]
        if got.shape[0] == 0:
            continue
        k = a.shape[1]
        lhs = a.float() * sfa.repeat_interleave(128, dim=1)[:, :k]
        if problem.weights == "fp8":
            n = b.shape[1]
            rhs = b[g].float() * sfb[g].repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)[:, :k]
        else:
            rhs = kernels.cast_back_from_fp4(b[g], sfb[g].view(torch.float8_e8m0fnu).float(), gran_k=32)
        worst = worst_of(worst, calc_diff(got.float(), lhs @ rhs.t()))
    return worst


def output_check(problem: Problem) -> Callable[[torch.Tensor], float]:
    """sample_diff of any output of ``problem``'s shape, read in place of ``problem.out`` (a peer's
    output, or a variant's after output_diff poisons and rewrites it)."""
    def check(out: torch.Tensor) -> float:
        saved, problem.out = problem.out, out
        try:
            return sample_diff(problem)
        finally:
            problem.out = saved
    return check


def fp4_weights(groups: int, n: int, k: int, device="cuda"):
    """(packed E2M1 [G, N, K/2], UE8M0 exponent bytes [G, N, K/32]): random codes and scales drawn
    directly (quantizing 256 experts of 4096 x 7168 through the float32 reference would need over
    100 GB; the kernel's time does not depend on the values)."""
    packed = torch.randint(0, 256, (groups, n, k // 2), device=device, dtype=torch.uint8)
    exponents = torch.randint(118, 126, (groups, n, k // 32), device=device, dtype=torch.uint8)
    return packed, exponents


def make_weights(weights: str, groups: int, n: int, k: int, device) -> tuple[tuple, int]:
    """The ``weights`` ("fp8" or "fp4") operand of ``groups`` experts and its bytes."""
    if weights == "fp8":
        # Quantized 32 experts at a time: 256 experts of 4096 x 7168 in bf16 alone would take 15 GB.
        b = (torch.empty(groups, n, k, device=device, dtype=torch.float8_e4m3fn),
             torch.empty(groups, (n + 127) // 128, (k + 127) // 128, device=device, dtype=torch.float32))
        for g0 in range(0, groups, 32):
            chunk = kernels.per_block_cast_to_fp8(torch.randn(min(32, groups - g0), n, k, device=device,
                                                              dtype=torch.bfloat16))
            b[0][g0:g0 + 32].copy_(chunk[0])
            b[1][g0:g0 + 32].copy_(chunk[1])
        return b, groups * n * k + b[1].numel() * 4
    return fp4_weights(groups, n, k, device), groups * (n * k // 2 + n * k // 32)


def make_contiguous(weights: str, groups: int, rows: int, n: int, k: int, device="cuda") -> Problem:
    a = kernels.per_token_cast_to_fp8(torch.randn(groups * rows, k, device=device, dtype=torch.bfloat16))
    b, weight_bytes = make_weights(weights, groups, n, k, device)
    m_indices = torch.arange(groups, device=device, dtype=torch.int32).repeat_interleave(rows)
    d = torch.empty(groups * rows, n, device=device, dtype=torch.bfloat16)
    gemm = (kernels.m_grouped_fp8_gemm_nt_contiguous if weights == "fp8"
            else kernels.m_grouped_fp8_fp4_gemm_nt_contiguous)
    return Problem(lambda: gemm(a, b, d, m_indices), _ALL_KERNELS, a, b, d, weight_bytes,
                   2 * groups * rows * n * k, weights, rows)


def make_masked(weights: str, groups: int, tokens: int, n: int, k: int, device="cuda",
                max_m: int | None = None) -> Problem:
    """``tokens`` valid rows per expert in slots of ``max_m`` rows (default: ``tokens``)."""
    max_m = max(tokens, 1) if max_m is None else max_m
    a = kernels.per_token_cast_to_fp8(torch.randn(groups * max_m, k, device=device, dtype=torch.bfloat16))
    a = (a[0].view(groups, max_m, k), a[1].view(groups, max_m, -1))
    b, weight_bytes = make_weights(weights, groups, n, k, device)
    masked_m = torch.full((groups,), tokens, device=device, dtype=torch.int32)
    d = torch.empty(groups, max_m, n, device=device, dtype=torch.bfloat16)
    gemm = kernels.m_grouped_fp8_gemm_nt_masked if weights == "fp8" else kernels.m_grouped_fp8_fp4_gemm_nt_masked
    return Problem(lambda: gemm(a, b, d, masked_m, tokens), _ALL_KERNELS, a, b, d, weight_bytes,
                   2 * groups * tokens * n * k, weights, tokens, masked=True)


def make_masked_fragment(groups: int, tokens: int, n: int, k: int, device="cuda",
                         max_m: int | None = None) -> Problem:
    """The masked FP4 problem with the weights in the decode layout; decode sizes only (tokens <= 32)."""
    problem = make_masked("fp4", groups, tokens, n, k, device, max_m)
    packed, exponents = problem.b
    b = kernels.transform_fp4_for_decode(packed, exponents)
    a, d, masked_m = problem.a, problem.out, torch.full((groups,), tokens, device=device, dtype=torch.int32)
    return Problem(lambda: kernels.m_grouped_fp8_fp4_gemm_nt_masked(a, b, d, masked_m, tokens),
                   "sm90_fp8_fp4_gemm_nt_swap_ab", a, b, d, problem.weight_bytes, problem.flops, "fp4", tokens,
                   masked=True, ref_b=problem.b)


def measure(problem: Problem) -> dict:
    problem.out.fill_(float("nan"))
    problem.call()
    diff = sample_diff(problem)
    t = bench_kineto(problem.call, problem.kernel).median_s
    return dict(ours_us=t * 1e6, tflops=problem.flops / t / 1e12, weight_gbps=problem.weight_bytes / t / 1e9,
                call_us=per_call_us(problem.call), diff=diff)


def fp8_switch_columns(problem: Problem, m: int, n: int, k: int, gemm_type: int, groups: int) -> list:
    """(row key, call) of the FP8 kernel with one of its choices flipped, where it applies: single_us
    without the 2-CTA clusters (MOE_FP8_MULTICAST=0) where it runs them; turns_flipped_us on a wide
    128-row tile (block N >= 145) with the math warpgroups' ping-pong flipped (MOE_FP8_PINGPONG=1 where
    it runs without, the K loop then unrolled 4 times; =0 where it runs with)."""
    native = kernels.jit.native_module()
    config = native.fp8_gemm_nt_config(m, n, k, kernels.get_num_sms(), False, -1, gemm_type, groups)
    wide = config["block_m"] == 128 and config["block_n"] >= 145  # the launcher's kPingPongMinBlockN
    columns = []
    if config["multicast"] > 1:
        columns.append(("single_us", env_call(problem.call, MOE_FP8_MULTICAST="0")))
    if wide:
        columns.append(("turns_flipped_us", env_call(problem.call, MOE_FP8_PINGPONG="0" if config["pingpong"] else "1")))
    return columns


def aligned_call(fn: Callable[[], object], alignment: int) -> Callable[[], object]:
    """``fn`` called with the contiguous layout declared aligned to ``alignment`` rows
    (set_mk_alignment_for_contiguous_layout), the alignment in force before restored after."""
    def call():
        before = kernels.get_mk_alignment_for_contiguous_layout()
        kernels.set_mk_alignment_for_contiguous_layout(alignment)
        try:
            return fn()
        finally:
            kernels.set_mk_alignment_for_contiguous_layout(before)
    return call


def mn_major_call(problem: Problem, groups: int, rows: int) -> Callable[[], None]:
    """``problem``'s FP8 contiguous call on the same A scales stored MN-major and TMA-aligned
    (get_mn_major_tma_aligned_tensor), which the kernel loads by TMA instead of gathering."""
    a = (problem.a[0], kernels.get_mn_major_tma_aligned_tensor(problem.a[1]))
    m_indices = torch.arange(groups, device=a[0].device, dtype=torch.int32).repeat_interleave(rows)
    return lambda: kernels.m_grouped_fp8_gemm_nt_contiguous(a, problem.b, problem.out, m_indices)


def variant_timings(problem: Problem, variants) -> tuple[list[tuple[float, float]], list[float]]:
    """``problem``'s call with each of ``variants`` (label, environment switches), timed interleaved
    with the default in one profile: (µs, time over the default's) per variant, and their outputs'
    diffs."""
    if not variants:
        return [], []
    check = output_check(problem)
    calls = [env_call(problem.call, **env) for _, env in variants]
    diffs = [output_diff(call, problem.out, check) for call in calls]
    timings = bench_kineto_interleaved([(problem.call, problem.kernel)] + [(call, problem.kernel) for call in calls])
    base = timings[0].median_s
    return [(t.median_s * 1e6, t.median_s / base) for t in timings[1:]], diffs


def variant_cells(timings: list[tuple[float, float]]) -> list[str]:
    """One cell "µs (over the default)" per variant of :func:`variant_timings`."""
    return [f"{us:.1f} ({ratio:.2f}x)" for us, ratio in timings]


def contiguous(weights: str, groups: int, rows: int, n: int, k: int, variants=(), mn_major: bool = False) -> dict:
    """Ours; for FP8 weights also the same kernel without clusters or with ping-pong flipped
    (fp8_switch_columns), with each of ``variants`` (label, environment switches), with ``mn_major``
    on MN-major A scales (mn_major_call), declared 256-row aligned (with and without clusters) where
    the rows allow, and the torch peer on the same operands. Every FP8 column but the peer's has
    its output checked; all are timed in one profile, their runs interleaved
    (bench_kineto_interleaved): these cells run a millisecond each, and timed one after the other
    identical kernels came out up to 1.12x apart (bench/RESULTS.md, session 28)."""
    problem = make_contiguous(weights, groups, rows, n, k)
    row = measure(problem)
    if weights != "fp8":
        timings, diffs = variant_timings(problem, variants)
        row["variant_cells"] = variant_cells(timings)
        row["diff"] = worst_of(row["diff"], *diffs)
        return row
    check = output_check(problem)
    columns = fp8_switch_columns(problem, groups * rows, n, k, 1, groups)
    columns += [(("variant", label), env_call(problem.call, **env)) for label, env in variants]
    if mn_major:
        columns.append((("variant", "MN-major A scales"), mn_major_call(problem, groups, rows)))
    if rows % 256 == 0:
        # 256-aligned rows let the heuristic run 256-row tiles (in clusters); a failure is reported
        # in the row, the table goes on.
        aligned = aligned_call(problem.call, 256)
        aligned_single = env_call(aligned, MOE_FP8_MULTICAST="0")
        try:
            row["aligned_diff"] = worst_of(output_diff(aligned, problem.out, check),
                                           output_diff(aligned_single, problem.out, check))
            columns += [("aligned_us", aligned), ("aligned_single_us", aligned_single)]
        except Exception as exc:  # noqa: BLE001
            row.update(aligned_diff=float("nan"), aligned_error=str(exc)[:80])
    diffs = {key: output_diff(call, problem.out, check) for key, call in columns
             if key not in ("aligned_us", "aligned_single_us")}
    try:
        columns.append(("torch_us", torch_grouped(problem.a, problem.b, [rows] * groups)))
    except Exception as exc:  # noqa: BLE001 - report what the peer refused, keep measuring ours
        row.update(torch_error=str(exc)[:80])
    timings = bench_kineto_interleaved([(problem.call, problem.kernel)] + [(call, problem.kernel) for _, call in columns])
    base = timings[0].median_s
    row.update(ours_us=base * 1e6, tflops=problem.flops / base / 1e12, weight_gbps=problem.weight_bytes / base / 1e9,
               single_us=None, turns_flipped_us=None, torch_us=float("nan"), variants=[],
               diff=worst_of(row["diff"], *diffs.values()))
    for (key, _), t in zip(columns, timings[1:]):
        if isinstance(key, tuple):
            row["variants"].append((key[1], t.median_s * 1e6, diffs[key], base * 1e6))
        else:
            row[key] = t.median_s * 1e6
    row.update(torch_tflops=problem.flops / row["torch_us"] * 1e-6, speedup=row["torch_us"] / row["ours_us"])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="fp8,fp4", help="comma-separated: fp8, fp4 (default both)")
    parser.add_argument("--masked-only", action="store_true", help="skip the contiguous (prefill) table")
    parser.add_argument("--groups", type=positive_ints, default="32,256",
                        help="masked table: comma-separated expert counts")
    parser.add_argument("--tokens", type=positive_ints, default="1,4,16,64,256",
                        help="masked table: comma-separated tokens per expert")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE...]",
                        help="also time the FP8 kernel with these environment switches set (repeatable); its "
                             "output is checked too")
    parser.add_argument("--fp4-variant", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE...]",
                        help="also time the FP4 kernel with these environment switches set (repeatable); its "
                             "output is checked too")
    parser.add_argument("--sfa-mn-major", action="store_true",
                        help="contiguous table: also time the FP8 kernel on MN-major TMA-aligned A scales, beside "
                             "the default like a variant")
    args = parser.parse_args(argv)
    try:
        variants = parse_env_variants(args.variant)
        fp4_variants = parse_env_variants(args.fp4_variant)
    except ValueError as exc:
        parser.error(str(exc))
    masked_groups, masked_tokens = args.groups, args.tokens
    weights = set(args.weights.split(","))
    if not weights or weights - {"fp8", "fp4"}:
        parser.error(f"--weights: expected fp8 and/or fp4, got {args.weights!r}")
    if not torch.cuda.is_available():
        print("bench_grouped: needs a CUDA device", file=sys.stderr)
        return 1
    fp8, fp4 = "fp8" in weights, "fp4" in weights
    copy = copy_ceiling_gbps()
    print(f"copy ceiling (events, read + write): {copy:.0f} GB/s; L2 flush: {flush_mode()} (MOE_BENCH_FLUSH)\n")
    contiguous_labels = [label for label, _ in variants] + (["MN-major A scales"] if args.sfa_mn_major else [])
    if not args.masked_only:
        print("| contiguous | N x K | FP8 µs | FP8 TFLOP/s | FP8 per call µs | FP8 1-CTA µs | FP8 ping-pong flipped µs "
              "| FP8 256-aligned µs | FP8 256-aligned TFLOP/s | FP8 256-aligned 1-CTA µs | torch µs | torch TFLOP/s "
              "| FP8 vs torch | 256-aligned vs torch | FP4 µs | FP4 TFLOP/s | FP4 per call µs | worst diff |"
              + "".join(f" FP8 {label} µs (over FP8, runs interleaved) |" for label in contiguous_labels)
              + "".join(f" FP4 {label} µs (over FP4, runs interleaved) |" for label, _ in fp4_variants))
        print("| --- " * (18 + len(contiguous_labels) + len(fp4_variants)) + "|")
        for groups, rows in [(4, 8192), (8, 4096)]:
            for n, k in NK:
                cells = [f"{groups} x {rows}", f"{n} x {k}"]
                if fp8:
                    r = contiguous("fp8", groups, rows, n, k, variants, args.sfa_mn_major)
                    single, plain = ("-" if r[key] is None else f"{r[key]:.1f}" for key in ("single_us", "turns_flipped_us"))
                    peer = f"{r['speedup']:.2f}x" + (f" {r['torch_error']}" if "torch_error" in r else "")
                    aligned, aligned_single = r.get("aligned_us"), r.get("aligned_single_us")
                    flops = 2 * groups * rows * n * k
                    cells += [f"{r['ours_us']:.1f}", f"{r['tflops']:.0f}", f"{r['call_us']:.1f}", single, plain,
                              r.get("aligned_error", "-") if aligned is None else f"{aligned:.1f}",
                              "-" if aligned is None else f"{flops / aligned / 1e6:.0f}",
                              "-" if aligned_single is None else f"{aligned_single:.1f}",
                              f"{r['torch_us']:.1f}", f"{r['torch_tflops']:.0f}", peer,
                              "-" if aligned is None else f"{r['torch_us'] / aligned:.2f}x"]
                    r["diff"] = worst_of(r["diff"], r.get("aligned_diff", 0.0))
                    extra = variant_cells([(us, us / base) for _, us, _, base in r["variants"]])
                else:
                    cells += ["-"] * 12
                    extra = ["-"] * len(contiguous_labels)
                if fp4:
                    r4 = contiguous("fp4", groups, rows, n, k, fp4_variants)
                    cells += [f"{r4['ours_us']:.1f}", f"{r4['tflops']:.0f}", f"{r4['call_us']:.1f}"]
                    extra += r4["variant_cells"]
                else:
                    cells += ["-"] * 3
                    extra += ["-"] * len(fp4_variants)
                cells.append(f"{worst_of(*(x['diff'] for x in (r if fp8 else None, r4 if fp4 else None) if x)):.1e}")
                print("| " + " | ".join(cells + extra) + " |", flush=True)
    print("\n| masked | N x K | tokens/expert | FP8 µs | FP8 weights GB/s | FP8 of copy | FP8 per call µs "
          "| FP4 µs | FP4 weights GB/s | FP4 per call µs | FP4 speed-up over FP8 "
          "| FP4 decode-layout µs | FP4 decode-layout weights GB/s | FP4 decode-layout speed-up over FP8 | worst diff |"
          + "".join(f" FP8 {label} µs | over FP8 |" for label, _ in variants)
          + "".join(f" FP4 {label} µs (over FP4, runs interleaved) |" for label, _ in fp4_variants))
    print("| --- " * (15 + 2 * len(variants) + len(fp4_variants)) + "|")
    for groups in masked_groups:
        for n, k in NK:
            for tokens in masked_tokens:
                cells = [str(groups), f"{n} x {k}", str(tokens)]
                p8 = make_masked("fp8", groups, tokens, n, k) if fp8 else None
                r = measure(p8) if fp8 else None
                p4 = make_masked("fp4", groups, tokens, n, k) if fp4 else None
                r4 = measure(p4) if fp4 else None
                cells += ([f"{r['ours_us']:.1f}", f"{r['weight_gbps']:.0f}", f"{r['weight_gbps'] / copy * 100:.0f}%",
                           f"{r['call_us']:.1f}"] if r else ["-"] * 4)
                cells += ([f"{r4['ours_us']:.1f}", f"{r4['weight_gbps']:.0f}", f"{r4['call_us']:.1f}"] if r4
                          else ["-"] * 3)
                cells.append(f"{r['ours_us'] / r4['ours_us']:.2f}x" if r and r4 else "-")
                v2 = measure(make_masked_fragment(groups, tokens, n, k)) if fp4 and tokens <= 32 else None
                cells += ([f"{v2['ours_us']:.1f}", f"{v2['weight_gbps']:.0f}",
                           f"{r['ours_us'] / v2['ours_us']:.2f}x" if r else "-"] if v2 else ["-"] * 3)
                diffs = [x["diff"] for x in (r, r4, v2) if x]
                # Each variant against the default timed in the same profile, runs interleaved.
                extra = []
                if r is None:
                    extra += ["-", "-"] * len(variants)
                else:
                    timings, fp8_diffs = variant_timings(p8, variants)
                    extra += [cell for us, ratio in timings for cell in (f"{us:.1f}", f"{ratio:.2f}x")]
                    diffs += fp8_diffs
                if p4 is None:
                    extra += ["-"] * len(fp4_variants)
                else:
                    timings, fp4_diffs = variant_timings(p4, fp4_variants)
                    extra += variant_cells(timings)
                    diffs += fp4_diffs
                cells.append(f"{worst_of(*diffs):.1e}")
                print("| " + " | ".join(cells + extra) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
