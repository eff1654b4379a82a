"""Benchmark of the FP8 quantizers and the FP4 -> FP8 weight cast against the device copy ceiling (GPU only).

For every shape: kernel time from the torch profiler with the L2 flushed before each run, the
bandwidth it reaches (bytes read + written), the copy ceiling measured in the same run with the
same method (a device-to-device copy of a large buffer, bytes read + written), their ratio, and
the time of one call from Python (host work included).

    python bench/bench_quant.py [--dtype bfloat16] [--gran-k 128] [--ue8m0]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

import kernels.quant as quant
from kernels.testing import bench_kineto, count_bytes, flush_mode, per_call_us

_MS = (128, 4096, 16384)
_NS = (2048, 7168)
_COPY_BYTES = 1 << 30
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Row:
    kernel: str
    shape: str
    kernel_us: float
    gbps: float
    ratio: float
    per_call_us: float

    def markdown(self) -> str:
        return (f"| {self.kernel} | {self.shape} | {self.kernel_us:.1f} | {self.gbps:.0f} | "
                f"{100 * self.ratio:.0f}% | {self.per_call_us:.1f} |")


def copy_ceiling_gbps_kineto(num_bytes: int = _COPY_BYTES) -> float:
    """Device copy bandwidth (read + write) timed like the kernels: profiler, L2 flushed."""
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = bench_kineto(lambda: dst.copy_(src), "Memcpy DtoD").median_s
    return 2 * num_bytes / seconds / 1e9


def bench_one(kernel: str, fn, x, shape: str, ceiling: float) -> Row:
    """``x``: the input tensor or tensors (bytes read)."""
    x_fp8, sf = fn()
    seconds = bench_kineto(fn, kernel).median_s
    gbps = count_bytes(*(x if isinstance(x, tuple) else (x,)), x_fp8, sf) / seconds / 1e9
    return Row(kernel, shape, seconds * 1e6, gbps, gbps / ceiling, per_call_us(fn))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--gran-k", type=int, default=128, choices=(32, 64, 128))
    parser.add_argument("--ue8m0", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant: needs a CUDA device")
    dtype = _DTYPES[args.dtype]

    ceiling = copy_ceiling_gbps_kineto()
    print(f"{torch.cuda.get_device_name()}: copy ceiling {ceiling:.0f} GB/s (read + write, "
          f"profiler kernel time, L2 flushed: {flush_mode()}); input {args.dtype}, gran_k {args.gran_k}, "
          f"ue8m0 {args.ue8m0}\n")
    print("| kernel | m x n | kernel µs | GB/s | of copy | per call µs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for m in _MS:
        for n in _NS:
            x = torch.randn(m, n, device="cuda").to(dtype)
            shape = f"{m} x {n}"

            def per_token(x=x):
                return quant.per_token_cast_to_fp8(x, use_ue8m0=args.ue8m0, gran_k=args.gran_k)

            def per_token_mn(x=x):
                return quant.per_token_cast_to_fp8(x, use_ue8m0=args.ue8m0, gran_k=args.gran_k, mn_major_sf=True)

            def per_block(x=x):
                return quant.per_block_cast_to_fp8(x, use_ue8m0=args.ue8m0)

            for label, kernel, fn in (("per_token_cast_to_fp8_kernel", "per_token_cast_to_fp8_kernel", per_token),
                                      ("per_token_cast_to_fp8_kernel (MN-major scales)", "per_token_cast_to_fp8_kernel",
                                       per_token_mn),
                                      ("per_block_cast_to_fp8_kernel", "per_block_cast_to_fp8_kernel", per_block)):
                row = bench_one(kernel, fn, x, shape, ceiling)
                row.kernel = label
                print(row.markdown())
    # FP4 expert weights [G, N, K/2] -> FP8 with block scales: the staged FP8 x FP4 GEMMs' first step.
    for g, n, k in ((4, 4096, 7168), (32, 4096, 7168), (8, 7168, 2048)):
        b = quant.per_token_cast_to_fp4(torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16))
        b = (b[0], quant.transform_sf_for_fp4_gemm(b[1]))
        row = bench_one("cast_fp4_to_fp8_blocks_kernel", lambda b=b: quant.cast_fp4_to_fp8_blocks(b), b,
                        f"{g} x {n} x {k}", ceiling)
        print(row.markdown())


if __name__ == "__main__":
    main()
