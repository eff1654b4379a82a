"""Run one dense FP8 GEMM call (for a profiler such as ncu to capture), after one warm-up call.

    ncu -k regex:sm90_fp8 -s 1 -c 1 python scripts/gemm_once.py --m 4096 --n 7168 --k 16384
MOE_FP8_MULTICAST=0 in the environment turns the 2-CTA clusters off. --mn-scales hands the kernel
A's scales MN-major and TMA-aligned (kernels.get_mn_major_tma_aligned_tensor), as DeepGEMM gets them
in scripts/deepgemm_once.py; the transpose runs before the calls, so ncu's kernel filter sees only
the GEMM.
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
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=7168)
    p.add_argument("--k", type=int, default=16384)
    p.add_argument("--mn-scales", action="store_true", help="A's scales MN-major, TMA-aligned")
    args = p.parse_args()
    a = kernels.per_token_cast_to_fp8(torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16))
    if args.mn_scales:
        a = (a[0], kernels.get_mn_major_tma_aligned_tensor(a[1]))
    b = kernels.per_block_cast_to_fp8(torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16))
    d = torch.empty(args.m, args.n, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        kernels.fp8_gemm_nt(a, b, d)
        torch.cuda.synchronize()
    print(f"fp8_gemm_nt M={args.m} N={args.n} K={args.k}: ok",
          kernels.jit.native_module().fp8_gemm_nt_config(args.m, args.n, args.k, kernels.get_num_sms(),
                                                         scale_load=1 if args.mn_scales else -1))


if __name__ == "__main__":
    main()
