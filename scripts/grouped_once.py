"""Run one m-grouped GEMM call (for a profiler such as ncu to capture), after one warm-up call.

    ncu -k regex:sm90_fp8 python scripts/grouped_once.py --weights fp4 --groups 32 --tokens 16 --n 4096 --k 7168
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kernels  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", choices=["fp8", "fp4"], default="fp4")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16, help="masked rows per group")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=7168)
    args = p.parse_args()
    g, t, n, k = args.groups, args.tokens, args.n, args.k
    a = kernels.per_token_cast_to_fp8(torch.randn(g * t, k, device="cuda", dtype=torch.bfloat16))
    a = (a[0].view(g, t, k), a[1].view(g, t, -1))
    masked_m = torch.full((g,), t, device="cuda", dtype=torch.int32)
    d = torch.empty(g, t, n, device="cuda", dtype=torch.bfloat16)
    if args.weights == "fp4":
        b = (torch.randint(0, 256, (g, n, k // 2), device="cuda", dtype=torch.uint8),
             torch.randint(118, 126, (g, n, k // 32), device="cuda", dtype=torch.uint8))
        call = lambda: kernels.m_grouped_fp8_fp4_gemm_nt_masked(a, b, d, masked_m, t)  # noqa: E731
    else:
        b = kernels.per_block_cast_to_fp8(torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16))
        call = lambda: kernels.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, t)  # noqa: E731
    call()
    torch.cuda.synchronize()
    call()
    torch.cuda.synchronize()
    print(f"{args.weights} masked G={g} tokens={t} N={n} K={k}: ok")


if __name__ == "__main__":
    main()
