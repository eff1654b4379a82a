"""M-grouped FP8 GEMMs (MoE experts) against torch._scaled_grouped_mm, in one run.

    python bench/bench_grouped.py

Contiguous (prefill): 4 x 8192 and 8 x 4096 rows for N x K = 4096 x 7168 and 7168 x 2048, kernel
time (profiler, L2 flushed), TFLOP/s, and `torch._scaled_grouped_mm` with row-wise scales on the
same problem. Masked (decode): 32 and 256 experts at {1, 4, 16, 64, 256} tokens per expert,
reported as weight bytes read per second (the decode bound) next to the copy ceiling.
"""

from __future__ import annotations

import sys

import torch

import kernels
from kernels.testing import bench_kineto, copy_ceiling_gbps, per_call_us

NK = [(4096, 7168), (7168, 2048)]


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


def contiguous(groups: int, rows: int, n: int, k: int) -> dict:
    counts = [rows] * groups
    a = kernels.per_token_cast_to_fp8(torch.randn(groups * rows, k, device="cuda", dtype=torch.bfloat16))
    b = kernels.per_block_cast_to_fp8(torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16))
    m_indices = torch.arange(groups, device="cuda", dtype=torch.int32).repeat_interleave(rows)
    d = torch.empty(groups * rows, n, device="cuda", dtype=torch.bfloat16)
    ours = lambda: kernels.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices)  # noqa: E731
    ours()
    t = bench_kineto(ours, "sm90_fp8_gemm_nt").median_s
    flops = 2 * groups * rows * n * k
    row = dict(ours_us=t * 1e6, tflops=flops / t / 1e12, call_us=per_call_us(ours))
    try:
        theirs = torch_grouped(a, b, counts)
        t_ref = bench_kineto(theirs, "").median_s
        row.update(torch_us=t_ref * 1e6, torch_tflops=flops / t_ref / 1e12, speedup=t_ref / t)
    except Exception as exc:  # noqa: BLE001 - report what the peer refused, keep measuring ours
        row.update(torch_us=float("nan"), torch_tflops=float("nan"), speedup=float("nan"), torch_error=str(exc)[:80])
    return row


def masked(groups: int, tokens: int, n: int, k: int) -> dict:
    max_m = max(tokens, 1)
    a = kernels.per_token_cast_to_fp8(torch.randn(groups * max_m, k, device="cuda", dtype=torch.bfloat16))
    a = (a[0].view(groups, max_m, k), a[1].view(groups, max_m, -1))
    b = kernels.per_block_cast_to_fp8(torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16))
    masked_m = torch.full((groups,), tokens, device="cuda", dtype=torch.int32)
    d = torch.empty(groups, max_m, n, device="cuda", dtype=torch.bfloat16)
    ours = lambda: kernels.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, tokens)  # noqa: E731
    ours()
    t = bench_kineto(ours, "sm90_fp8_gemm_nt").median_s
    weight_bytes = groups * n * k + b[1].numel() * 4
    return dict(ours_us=t * 1e6, weight_gbps=weight_bytes / t / 1e9, tflops=2 * groups * tokens * n * k / t / 1e12,
                call_us=per_call_us(ours))


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_grouped: needs a CUDA device", file=sys.stderr)
        return 1
    copy = copy_ceiling_gbps()
    print(f"copy ceiling (events, read + write): {copy:.0f} GB/s\n")
    print("| contiguous | N x K | ours µs | TFLOP/s | per call µs | torch µs | torch TFLOP/s | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for groups, rows in [(4, 8192), (8, 4096)]:
        for n, k in NK:
            r = contiguous(groups, rows, n, k)
            print(f"| {groups} x {rows} | {n} x {k} | {r['ours_us']:.1f} | {r['tflops']:.0f} | {r['call_us']:.1f} | "
                  f"{r['torch_us']:.1f} | {r['torch_tflops']:.0f} | {r['speedup']:.2f}x |"
                  + (f" {r['torch_error']}" if "torch_error" in r else ""), flush=True)
    print("\n| masked | N x K | tokens/expert | ours µs | weights GB/s | of copy | TFLOP/s | per call µs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for groups in (32, 256):
        for n, k in NK:
            for tokens in (1, 4, 16, 64, 256):
                r = masked(groups, tokens, n, k)
                print(f"| {groups} | {n} x {k} | {tokens} | {r['ours_us']:.1f} | {r['weight_gbps']:.0f} | "
                      f"{r['weight_gbps'] / copy * 100:.0f}% | {r['tflops']:.0f} | {r['call_us']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
