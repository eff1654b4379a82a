"""Dense FP8 GEMM (fp8_gemm_nt) against cuBLAS (torch scaled_mm) on DeepSeek-V3 shapes.

    python bench/bench_gemm.py [--ms 64,128,4096] [--csv out.csv]

Per shape: our kernel time (profiler, L2 flushed before each run; ours, cuBLAS and every variant of
the shape timed in one profile with their runs interleaved, bench_kineto_interleaved), TFLOP/s, GB/s (bytes of A, B
and D over kernel time), cuBLAS measured the same way in the same run (block scales 1x128 /
128x128 where it accepts them, else row-wise scales, marked), the speed-up, and the time per
call from Python on an idle stream for both. Where our heuristic runs 2-CTA clusters sharing A
(TMA multicast), the same call with them off (``MOE_FP8_MULTICAST=0``) is timed too:
"1-CTA us" and the clusters' speed-up over it. ``--variant NAME=VALUE[,NAME=VALUE...]`` (repeatable) also
times each call with those environment switches set, e.g. ``--variant MOE_FP8_SCALE_WARPS=1`` (one
scale warp instead of three): "NAME=VALUE us" and our default's speed-up over it. A variant that
plans our default's kernel (or an earlier variant's) reads "same plan" and is not timed: timed next
to itself a kernel reads faster (``kernels.testing.repeated_plans``).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import kernels
from kernels.testing import (bench_kineto, bench_kineto_interleaved, calc_diff, env_call, env_switches,
                             flush_description, parse_env_variants, per_call_us, per_call_us_interleaved,
                             repeated_plans)

SHAPES = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (576, 7168)]
# Our kernel time is every kernel a call launches (the profiler's name filter matches all): the GEMM
# and, where its 256-row tiles get A scales of another layout, the copy of them MN-major before it.
OURS_KERNELS = ""


def block_scaled(rows: int, k: int, block_rows: int) -> torch.Tensor:
    """bf16 [rows, k] normal values, each (block_rows x 128) block times a power of two in
    [1/4, 4]: the scales of neighbouring blocks differ, so a GEMM reading them in the wrong layout
    is far off (with plain randn they all sit within a few percent)."""
    x = torch.randn(rows, k, device="cuda")
    factors = torch.exp2(torch.randint(-2, 3, ((rows + block_rows - 1) // block_rows, k // 128), device="cuda").float())
    return (x * factors.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(128, 1)).to(torch.bfloat16)


def cublas_call(a_fp8, b_fp8, d_ref):
    """A cuBLAS FP8 GEMM for the same problem: block scales where torch/cuBLAS take them."""
    (a, sfa), (b, sfb) = a_fp8, b_fp8
    attempts = []
    f = getattr(torch.nn.functional, "scaled_mm", None)
    if f is not None:
        st = torch.nn.functional.ScalingType
        sfa_mn = sfa.t().contiguous().t()
        for sb in (sfb, sfb.t(), sfb.t().contiguous(), sfb.contiguous().t()):
            attempts.append(("block", lambda sb=sb: f(a, b.t(), sfa_mn, st.Blockwise_1x128, sb, st.Blockwise_128x128,
                                                     output_dtype=torch.bfloat16)))
    sfa_mn = sfa.t().contiguous().t()
    for sb in (sfb.t(), sfb):
        attempts.append(("block", lambda sb=sb: torch._scaled_mm(a, b.t(), sfa_mn, sb, out_dtype=torch.bfloat16)))
    row_a = torch.ones(a.shape[0], 1, device=a.device)
    row_b = torch.ones(1, b.shape[0], device=a.device)
    attempts.append(("row-wise", lambda: torch._scaled_mm(a, b.t(), row_a, row_b, out_dtype=torch.bfloat16)))
    last_error = None
    for kind, fn in attempts:
        try:
            out = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - cuBLAS refuses layouts by raising; try the next one
            last_error = exc
            continue
        # A block-scale layout cuBLAS reads wrongly shows at once: the benchmark's operands scale
        # their 128-blocks by factors up to 16 apart (make_operands), so only the right one is this close.
        if kind == "row-wise" or calc_diff(out, d_ref) < 1e-4:
            return kind, fn
    raise RuntimeError("no torch scaled_mm variant ran") from last_error


def ours_plan(m: int, n: int, k: int, mn_scales: bool = False) -> tuple[dict, dict | None]:
    """The plan of our call on K-major (or MN-major) A scales, and where that call copies the scales
    MN-major first (``sfa_copy``) the MN-major plan it then launches, else None: a switch may change
    either (kernels.testing.repeated_plans compares both)."""
    native, sms = kernels.jit.native_module(), kernels.get_num_sms()
    cfg = native.fp8_gemm_nt_config(m, n, k, sms, scale_load=1 if mn_scales else -1)
    return cfg, native.fp8_gemm_nt_config(m, n, k, sms, scale_load=1) if cfg["sfa_copy"] else None


def tile_label(m: int, n: int, k: int, **env: str) -> str:
    """The heuristic's tile for the call, with ``env`` switches set: block M x block N, stages
    ("s4"), 2-CTA clusters sharing A ("c2") or B ("c2b"), ping-pong ("pp"), the last wave's tiles
    split over K ("t3"), e.g. "128x192s4c2ppt4"."""
    with env_switches(**env):
        c = kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms())
    return (f"{c['block_m']}x{c['block_n']}s{c['num_stages']}"
            + (("c2b" if c["share_b"] else "c2") if c["multicast"] > 1 else "")
            + ("pp" if c["pingpong"] else "") + (f"t{c['tail_splits']}" if c["tail_splits"] > 1 else ""))


def graph_replay_us(calls, replays: int = 50) -> float:
    """Microseconds per call of ``calls`` captured in one CUDA graph, from events around replays.
    A first capture compiles the kernels a capture plans (whole tiles: no split workspace)."""
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(calls))


_CHAIN_WEIGHT_BYTES = 128 << 20  # more than the H200's L2 (50 MB) holds


def graph_chain_row(m: int, n: int, k: int, length: int) -> str:
    """One row of the graph-chain table: GEMMs on one activation, each with its own weights, each
    adding the previous one's output as its residual (a residual stream: every GEMM depends on the
    one before), in a CUDA graph without and with MOE_GEMM_PDL=1. At least ``length`` calls, and
    enough for the weights to exceed L2. The last output is checked after the PDL replays."""
    length = max(length, -(-_CHAIN_WEIGHT_BYTES // (n * k)))
    a_fp8 = kernels.per_token_cast_to_fp8(block_scaled(m, k, 1))
    weights = [kernels.per_block_cast_to_fp8(block_scaled(n, k, 128)) for _ in range(length)]
    outs = [torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)] + \
        [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(length)]
    calls = [lambda b=b, c=c, d=d: kernels.fp8_gemm_nt(a_fp8, b, d, c=c)
             for b, c, d in zip(weights, outs[:-1], outs[1:])]
    # The whole-tile kernel a capture runs, alone (L2 flushed).
    with env_switches(MOE_GEMM_SPLIT_K="1", MOE_GEMM_TAIL_SPLIT="0"):
        alone = bench_kineto(calls[0], OURS_KERNELS).median_s * 1e6
    with env_switches(MOE_GEMM_PDL="0"):
        plain = graph_replay_us(calls)
    with env_switches(MOE_GEMM_PDL="1"):
        pdl = graph_replay_us(calls)
    expected = sum(kernels.reference.gemm.fp8_gemm_nt(a_fp8, b).float() for b in weights)
    diff = calc_diff(outs[-1], expected)
    return (f"{m:>5} {n:>6} {k:>6} {length:>6} | {alone:>8.1f} | {plain:>8.1f} | {pdl:>8.1f} {plain / pdl:>7.2f}x | "
            f"{diff:>8.1e}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="64,128,4096")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--nk", default=None, metavar="NxK[,NxK...]",
                        help="these N x K shapes instead of DeepSeek-V3's (N a multiple of 8, K of 128; a long "
                             "GEMM before a shape heats the GPU and slows the next shape's first timings)")
    parser.add_argument("--bf16", action="store_true", help="also time bf16_gemm_nt against torch.mm (cuBLAS)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE...]",
                        help="also time each call with these environment switches set (repeatable)")
    parser.add_argument("--sfa-mn-major", action="store_true",
                        help="also time each call with SFA stored MN-major (the same scales, row stride 1: a K "
                             "block's scales contiguous)")
    parser.add_argument("--graph-chain", type=int, default=0, metavar="CALLS",
                        help="also time at least CALLS calls in one CUDA graph, each with its own weights (as "
                             "many as exceed L2, as the layers of a model) adding the previous output as its "
                             "residual, with and without programmatic dependent launch (MOE_GEMM_PDL=1): time per "
                             "GEMM of a graph replay")
    args = parser.parse_args()
    try:
        variants = parse_env_variants(args.variant)
    except ValueError as exc:
        parser.error(str(exc))
    shapes = SHAPES
    if args.nk:
        try:
            shapes = [(int(n), int(k)) for n, k in (nk.split("x") for nk in args.nk.split(","))]
        except ValueError:
            parser.error(f"--nk takes N x K pairs such as 2112x7168,576x7168, got {args.nk!r}")
        if any(n <= 0 or n % 8 or k <= 0 or k % 128 for n, k in shapes):
            parser.error(f"--nk: N must be a positive multiple of 8 and K of 128, got {args.nk!r}")
    if not torch.cuda.is_available():
        print("bench_gemm: needs a CUDA device", file=sys.stderr)
        return 1
    rows = []
    bare = torch.zeros(1024, device="cuda")
    header = (f"{'M':>5} {'N':>6} {'K':>6} {'tile':>14} | {'ours us':>8} {'TFLOP/s':>8} {'GB/s':>7} {'call us':>8} | "
              f"{'cuBLAS':>8} {'us':>8} {'TFLOP/s':>8} {'call us':>8} | {'add_ call':>9} | {'speedup':>7} {'diff':>8} | "
              f"{'1-CTA us':>8} {'clusters':>8}" + (" | MN-major SFA us  gain     diff" if args.sfa_mn_major else "") + "".join(f" | {label} us  gain {'tile':>14} diff" for label, _ in variants))
    print(flush_description())
    print(header)
    for m in [int(x) for x in args.ms.split(",")]:
        for n, k in shapes:
            a, b = block_scaled(m, k, 1), block_scaled(n, k, 128)
            a_fp8 = kernels.per_token_cast_to_fp8(a)
            b_fp8 = kernels.per_block_cast_to_fp8(b)
            d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ours = lambda: kernels.fp8_gemm_nt(a_fp8, b_fp8, d)  # noqa: E731
            ours()
            ref = kernels.reference.gemm.fp8_gemm_nt(a_fp8, b_fp8)
            diff = calc_diff(d, ref)
            kind, theirs = cublas_call(a_fp8, b_fp8, ref)
            a_mn = (a_fp8[0], a_fp8[1].t().contiguous().t())
            ours_mn = lambda: kernels.fp8_gemm_nt(a_mn, b_fp8, d)  # noqa: E731
            # Every kernel time of the shape from one profile, the runs interleaved: a long GEMM just
            # before a shape left the GPU slower for its first timings (session 8: 10-20% at the shape
            # after 7168 x 16384), and timings one after the other drift apart. cuBLAS kernel names
            # vary (sm90_xmma, cutlass, nvjet): every kernel of its call counts. The same call with
            # the 2-CTA clusters off (MOE_FP8_MULTICAST=0) where they would be on, each variant, and
            # with --sfa-mn-major the call on MN-major A scales.
            # A variant planning the default's kernel, the 1-CTA column's or an earlier variant's is not
            # timed: its column reads "same plan" (kernels.testing.repeated_plans).
            multicast = ours_plan(m, n, k)[0]["multicast"] > 1
            single = [("1-CTA", {"MOE_FP8_MULTICAST": "0"})] if multicast else []
            repeated = repeated_plans(lambda: ours_plan(m, n, k), single + variants)[len(single):]
            distinct = [(label, env) for (label, env), same in zip(variants, repeated) if not same]
            timed = [(ours, OURS_KERNELS), (theirs, "")]
            timed += [(env_call(ours, **env), OURS_KERNELS) for _, env in single + distinct]
            timed += [(ours_mn, OURS_KERNELS)] if args.sfa_mn_major else []
            seconds = [timing.median_s for timing in bench_kineto_interleaved(timed)]
            t, t_ref = seconds[0], seconds[1]
            single_us = seconds[2] * 1e6 if multicast else None
            variant_us = {label: us * 1e6 for (label, _), us in zip(distinct, seconds[2 + multicast:])}
            # Ours, cuBLAS's and a bare torch launch's calls sampled in turn, under the same state.
            call, call_ref, call_bare = per_call_us_interleaved([ours, theirs, lambda: bare.add_(0)])
            flops = 2 * m * n * k
            nbytes = m * k + n * k + m * n * 2
            tile = tile_label(m, n, k)
            row = dict(m=m, n=n, k=k, tile=tile, us=t * 1e6, tflops=flops / t / 1e12, gbps=nbytes / t / 1e9, call_us=call,
                       cublas=kind, cublas_us=t_ref * 1e6, cublas_tflops=flops / t_ref / 1e12, cublas_call_us=call_ref,
                       bare_call_us=call_bare, speedup=t_ref / t, diff=diff, single_us=single_us)
            extra = ""
            if args.sfa_mn_major:
                d.fill_(float("nan"))
                ours_mn()
                mn_diff = calc_diff(d, ref)
                mn_us = seconds[-1] * 1e6
                row["sfa_mn_us"], row["sfa_mn_diff"] = mn_us, mn_diff
                extra += f" | {mn_us:>15.1f} {mn_us / row['us']:>5.2f}x {mn_diff:.0e}"
            for (label, env), same in zip(variants, repeated):
                if same:
                    row[f"{label}_us"] = row[f"{label}_tile"] = row[f"{label}_diff"] = None
                    extra += f" | {'same plan':>{len(label) + 3}} {'-':>6} {'-':>14} {'-':>5}"
                    continue
                d.fill_(float("nan"))
                with env_switches(**env):
                    ours()
                v_us = variant_us[label]
                v_diff = calc_diff(d, ref)  # the variant's own output: a fast wrong kernel must show
                v_tile = tile_label(m, n, k, **env)
                row[f"{label}_us"], row[f"{label}_tile"], row[f"{label}_diff"] = v_us, v_tile, v_diff
                extra += f" | {v_us:>{len(label) + 3}.1f} {v_us / row['us']:>5.2f}x {v_tile:>14} {v_diff:.0e}"
            rows.append(row)
            single = "-" if single_us is None else f"{single_us:.1f}"
            gain = "-" if single_us is None else f"{single_us / row['us']:.2f}x"
            print(f"{m:>5} {n:>6} {k:>6} {tile:>14} | {row['us']:>8.1f} {row['tflops']:>8.0f} {row['gbps']:>7.0f} "
                  f"{call:>8.1f} | {kind:>8} {row['cublas_us']:>8.1f} {row['cublas_tflops']:>8.0f} "
                  f"{call_ref:>8.1f} | {call_bare:>9.1f} | {row['speedup']:>6.2f}x {diff:>8.1e} | {single:>8} {gain:>8}{extra}", flush=True)
    block = [r["speedup"] for r in rows if r["cublas"] == "block"]
    if block:
        geo = torch.tensor(block).log().mean().exp().item()
        print(f"geometric mean speed-up over cuBLAS block-scaled ({len(block)} shapes): {geo:.3f}x")
    if rows:
        median = statistics.median_high  # the upper one of an even count: a value seen
        over = [r["call_us"] - r["us"] for r in rows]
        print(f"time per call - kernel time: at most 10 us in {sum(o <= 10 for o in over)} of {len(over)} shapes, "
              f"median {median(over):.1f} us (cuBLAS: median "
              f"{median([r['cublas_call_us'] - r['cublas_us'] for r in rows]):.1f} us; a bare "
              f"x.add_(0) call: median {median([r['bare_call_us'] for r in rows]):.1f} us)")
    if args.graph_chain > 0:
        print(f"\n{args.graph_chain} calls in a CUDA graph (whole tiles: no split workspace in a capture), "
              "us per GEMM of a replay")
        print(f"{'M':>5} {'N':>6} {'K':>6} {'calls':>6} | {'alone us':>8} | {'chain us':>8} | {'PDL us':>8} {'PDL gain':>8} | "
              f"{'diff':>8}")
        for m in [int(x) for x in args.ms.split(",")]:
            for n, k in shapes:
                print(graph_chain_row(m, n, k, args.graph_chain), flush=True)
    if args.bf16:
        print(f"\n{'M':>5} {'N':>6} {'K':>6} | {'bf16 us':>8} {'TFLOP/s':>8} {'call us':>8} | "
              f"{'torch.mm us':>11} {'TFLOP/s':>8} | {'speedup':>7} {'diff':>8}")
        for m in [int(x) for x in args.ms.split(",")]:
            for n, k in SHAPES:
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                ours = lambda: kernels.bf16_gemm_nt(a, b, d)  # noqa: E731
                theirs = lambda: torch.mm(a, b.t())  # noqa: E731
                ours()
                diff = calc_diff(d, theirs())
                t = bench_kineto(ours, "sm90_bf16_gemm_nt").median_s
                t_ref = bench_kineto(theirs, "").median_s
                flops = 2 * m * n * k
                print(f"{m:>5} {n:>6} {k:>6} | {t * 1e6:>8.1f} {flops / t / 1e12:>8.0f} {per_call_us(ours):>8.1f} | "
                      f"{t_ref * 1e6:>11.1f} {flops / t_ref / 1e12:>8.0f} | {t_ref / t:>6.2f}x {diff:>8.1e}", flush=True)
    if args.csv:
        import csv
        with open(args.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
