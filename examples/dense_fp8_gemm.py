"""Dense FP8 GEMM, DeepGEMM-style: D[M, N] (bf16) = A[M, K] @ B[N, K]^T.

A has one float32 scale per 1x128 (per token, per 128 channels), B one per 128x128 block, as in
DeepSeek-V3's recipe. ``kernels.fp8_gemm_nt`` keeps DeepGEMM's signature, so code written for
``deep_gemm.fp8_gemm_nt`` switches by changing the import.

    python examples/dense_fp8_gemm.py [--m 128 --n 7168 --k 2048]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels  # noqa: E402
from kernels.reference.quant import per_block_cast_to_fp8, per_token_cast_to_fp8  # noqa: E402
from kernels.testing.numeric import calc_diff  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=128)
    parser.add_argument("--n", type=int, default=7168)
    parser.add_argument("--k", type=int, default=2048)
    args = parser.parse_args()
    if not hasattr(kernels, "fp8_gemm_nt"):
        sys.exit("error: kernels.fp8_gemm_nt is not available yet: the SM90 FP8 GEMM kernel has not landed "
                 "in this checkout")
    if not torch.cuda.is_available():
        sys.exit("error: kernels.fp8_gemm_nt runs on an SM90 GPU (H100/H200); no CUDA device is visible")

    a = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16)
    d = torch.empty(args.m, args.n, device="cuda", dtype=torch.bfloat16)
    a_fp8, b_fp8 = per_token_cast_to_fp8(a), per_block_cast_to_fp8(b)
    kernels.fp8_gemm_nt(a_fp8, b_fp8, d)

    diff = calc_diff(d, a.float() @ b.float().T)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        kernels.fp8_gemm_nt(a_fp8, b_fp8, d)
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) / 20 * 1e3
    print(f"fp8_gemm_nt M={args.m} N={args.n} K={args.k}: calc_diff vs bf16 {diff:.2e}, "
          f"{us:.1f} us per call, {2 * args.m * args.n * args.k / us / 1e6:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
