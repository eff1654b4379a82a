"""Run one DeepGEMM FP8 GEMM call (the peer, scripts/peer_env.sh) for ncu to capture, after a warm-up.

    ncu -k regex:sm90_fp8 -s 1 -c 1 python scripts/deepgemm_once.py --m 4096 --n 4096 --k 7168
    ... python scripts/deepgemm_once.py --groups 4 --contiguous 8192 --n 4096 --k 7168

The operands are those of scripts/gemm_once.py / grouped_once.py (our quantizers); A's scales are
handed over MN-major and TMA-aligned, so the captured launches are DeepGEMM's GEMM kernel alone.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kernels  # noqa: E402


def add_problem_args(p: argparse.ArgumentParser) -> None:
    """The problem's options, shared with scripts/peer_sass.py: dense M x N x K, or a contiguous
    grouped GEMM of --groups groups of --contiguous rows."""
    p.add_argument("--m", type=int, default=4096, help="rows (dense)")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=7168)
    p.add_argument("--groups", type=int, default=0, help="contiguous grouped GEMM of this many groups")
    p.add_argument("--contiguous", type=int, default=8192, help="rows per group (with --groups)")


def problem_rows(args: argparse.Namespace) -> int:
    """Rows of A: M, or all groups' rows of a contiguous problem."""
    return args.groups * args.contiguous if args.groups else args.m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_problem_args(p)
    args = p.parse_args()
    import deep_gemm  # the peer, on PYTHONPATH through scripts/peer_env.sh

    m = problem_rows(args)
    a = kernels.per_token_cast_to_fp8(torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16))
    a = (a[0], deep_gemm.get_mn_major_tma_aligned_tensor(a[1]))
    d = torch.empty(m, args.n, device="cuda", dtype=torch.bfloat16)
    if args.groups:
        b = kernels.per_block_cast_to_fp8(torch.randn(args.groups, args.n, args.k, device="cuda", dtype=torch.bfloat16))
        m_indices = torch.arange(args.groups, device="cuda", dtype=torch.int32).repeat_interleave(args.contiguous)
        call = lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices)  # noqa: E731
    else:
        b = kernels.per_block_cast_to_fp8(torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16))
        call = lambda: deep_gemm.fp8_gemm_nt(a, b, d)  # noqa: E731
    for _ in range(2):
        call()
        torch.cuda.synchronize()
    print(f"DeepGEMM {deep_gemm.__version__} M={m} N={args.n} K={args.k} groups={args.groups}: ok")


if __name__ == "__main__":
    main()
