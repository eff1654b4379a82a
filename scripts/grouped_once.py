"""Run one m-grouped GEMM call (for a profiler such as ncu to capture), after one warm-up call: the
masked problem of bench/bench_grouped.py, or with ``--contiguous ROWS`` its contiguous one (ROWS
rows per group).

    ncu -k regex:sm90_fp8 python scripts/grouped_once.py --weights fp4 --groups 32 --tokens 16 --n 4096 --k 7168
    ncu -k regex:sm90_fp8 -s 1 -c 1 python scripts/grouped_once.py --weights fp4 --groups 4 --contiguous 8192

``--swiglu``: the L1 GEMM with the SwiGLU epilogue (``m_grouped_fp8_gemm_nt_swiglu_*``) on the problem
of bench/bench_grouped_swiglu.py instead: N = 2I gate/up rows interleaved, FP8 weights.
"""

from __future__ import annotations

import argparse
import os
import sys

kRepo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [kRepo, os.path.join(kRepo, "bench")]

import torch  # noqa: E402

from bench_grouped import make_contiguous, make_masked, make_masked_fragment  # noqa: E402  (the benchmark's problems)


def swiglu_call(groups: int, rows: int, n: int, k: int, contiguous: bool):
    """The fused L1 call of bench_grouped_swiglu.py: ``rows`` rows per group (contiguous, A scales
    MN-major) or ``rows`` valid rows of ``rows`` per group (masked); ``n`` = 2I."""
    import bench_grouped_swiglu as b
    import kernels
    _, w1 = b.weights(groups, n // 2, k)
    if contiguous:
        p = b.contiguous_problem(groups, rows, n // 2, k)
        return lambda: kernels.m_grouped_fp8_gemm_nt_swiglu_contiguous(p.a, w1, (p.act, p.act_sf), p.index, p.topk)
    p = b.masked_problem(groups, rows, n // 2, k)
    return lambda: kernels.m_grouped_fp8_gemm_nt_swiglu_masked(p.a, w1, (p.act, p.act_sf), p.index, rows, p.topk)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", choices=["fp8", "fp4", "fp4-fragment"], default="fp4",
                   help="fp4-fragment: FP4 weights in the v2 decode layout (tokens <= 32)")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16, help="masked rows per group")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=7168)
    p.add_argument("--contiguous", type=int, default=0, metavar="ROWS",
                   help="the contiguous layout with ROWS rows per group instead of the masked one")
    p.add_argument("--fp4-kernel", choices=["default", "converter", "swapped"], default="default",
                   help="packed FP4 weights: the plan's kernel, or MOE_FP4_SWAP_AB=0 (converter) / =1 (swapped)")
    p.add_argument("--swiglu", action="store_true", help="the L1 GEMM with the SwiGLU epilogue (FP8 weights)")
    args = p.parse_args()
    if args.swiglu:
        if args.weights != "fp8":
            p.error("--swiglu takes --weights fp8")
        call = swiglu_call(args.groups, args.contiguous or args.tokens, args.n, args.k, bool(args.contiguous))
        for _ in range(2):
            call()
            torch.cuda.synchronize()
        print(f"swiglu {'contiguous' if args.contiguous else 'masked'} G={args.groups} N={args.n} K={args.k}: ok")
        return
    if args.fp4_kernel != "default":
        os.environ["MOE_FP4_SWAP_AB"] = "0" if args.fp4_kernel == "converter" else "1"
    if args.contiguous:
        if args.weights == "fp4-fragment":
            p.error("--contiguous takes --weights fp8 or fp4 (the decode layout is masked only)")
        problem = make_contiguous(args.weights, args.groups, args.contiguous, args.n, args.k)
    elif args.weights == "fp4-fragment":
        problem = make_masked_fragment(args.groups, args.tokens, args.n, args.k)
    else:
        problem = make_masked(args.weights, args.groups, args.tokens, args.n, args.k)
    for _ in range(2):
        problem.call()
        torch.cuda.synchronize()
    layout = f"contiguous rows={args.contiguous}" if args.contiguous else f"masked tokens={args.tokens}"
    print(f"{args.weights} {layout} G={args.groups} N={args.n} K={args.k}: ok")


if __name__ == "__main__":
    main()
