"""Dense FP8 GEMM, DeepGEMM-style: D[M, N] (bf16) = A[M, K] @ B[N, K]^T.

A has one float32 scale per 1x128 (per token, per 128 channels), B one per 128x128 block, as in
DeepSeek-V3's recipe. ``kernels.fp8_gemm_nt`` keeps DeepGEMM's signature, so code written for
``deep_gemm.fp8_gemm_nt`` switches by changing the import. On an SM90 GPU it runs the JIT kernel;
on the CPU the pure-torch reference.

    python examples/dense_fp8_gemm.py [--m 128 --n 7168 --k 2048]
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels  # noqa: E402
from kernels.testing import calc_diff  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=128)
    parser.add_argument("--n", type=int, default=7168)
    parser.add_argument("--k", type=int, default=2048)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    a = torch.randn(args.m, args.k, device=device, dtype=torch.bfloat16)
    b = torch.randn(args.n, args.k, device=device, dtype=torch.bfloat16)
    d = torch.empty(args.m, args.n, device=device, dtype=torch.bfloat16)
    # (E4M3 [M, K], float32 [M, K/128]); mn_major_sf stores the scales MN-major TMA-aligned, which
    # the GEMM loads fastest (K-major scales work too, gathered per K block).
    a_fp8 = kernels.per_token_cast_to_fp8(a, mn_major_sf=True)
    b_fp8 = kernels.per_block_cast_to_fp8(b)   # (E4M3 [N, K], float32 [N/128, K/128])
    kernels.fp8_gemm_nt(a_fp8, b_fp8, d)
    diff = calc_diff(d, a.float() @ b.float().T)

    iters = 20 if device == "cuda" else 2
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        kernels.fp8_gemm_nt(a_fp8, b_fp8, d)
    if device == "cuda":
        torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    print(f"fp8_gemm_nt on {device}, M={args.m} N={args.n} K={args.k}: calc_diff vs bf16 inputs {diff:.2e} "
          f"(FP8 quantization error), {us:.1f} us per call, {2 * args.m * args.n * args.k / us / 1e6:.2f} TFLOP/s")


if __name__ == "__main__":
    main()
