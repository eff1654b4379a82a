"""One-off probe (2026-12-01, bench/RESULTS.md "L2 flush"): kernel times after different L2 flushes,
to show that the memset flush (zero_ of 256 MB) leaves dirty lines whose write-back the next kernel
pays. Unlike kernels.testing.bench_kineto it does not wait for the flush, so kernels launched with
programmatic dependent launch may start during the flush (the "none" column runs them back to back).

    python3 scripts/l2_flush_probe.py          (on the GPU machine, after source scripts/gpu_env.sh)
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import kernels  # noqa: E402
from bench_grouped import make_masked, make_masked_fragment  # noqa: E402

buf = torch.ones(256 << 20 >> 2, dtype=torch.int32, device="cuda")
sink = torch.empty((), dtype=torch.int64, device="cuda")
FLUSH = {
    "none": lambda: None,
    "write": lambda: buf.zero_(),
    "read": lambda: torch.sum(buf, 0, out=sink),
    "write+read": lambda: (buf.zero_(), torch.sum(buf, 0, out=sink)),
}

def timed(fn, name, flush, n=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            flush()
            fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and name in e.name),
                key=lambda e: e.time_range.start)
    assert len(ev) == n, (len(ev), name)
    return statistics.median(e.time_range.elapsed_us() for e in ev)

probs = []
for g, t, n, k in [(32, 16, 7168, 2048), (32, 16, 4096, 7168), (256, 8, 7168, 2048)]:
    p = make_masked_fragment(g, t, n, k); probs.append((f"fp4 decode {g}x{t} {n}x{k}", p))
    p = make_masked("fp8", g, t, n, k); probs.append((f"fp8 masked {g}x{t} {n}x{k}", p))
a = kernels.per_token_cast_to_fp8(torch.randn(128, 7168, device="cuda", dtype=torch.bfloat16))
b = kernels.per_block_cast_to_fp8(torch.randn(4096, 7168, device="cuda", dtype=torch.bfloat16))
d = torch.empty(128, 4096, device="cuda", dtype=torch.bfloat16)
class P: pass
pd = P(); pd.call = lambda: kernels.fp8_gemm_nt(a, b, d); pd.kernel = "sm90_fp8_gemm_nt"
probs.append(("dense 128x4096x7168", pd))
a2 = kernels.per_token_cast_to_fp8(torch.randn(4096, 7168, device="cuda", dtype=torch.bfloat16))
d2 = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
pd2 = P(); pd2.call = lambda: kernels.fp8_gemm_nt(a2, b, d2); pd2.kernel = "sm90_fp8_gemm_nt"
probs.append(("dense 4096x4096x7168", pd2))
print("| problem | " + " | ".join(FLUSH) + " |")
for rep in range(2):
    for label, p in probs:
        row = [timed(p.call, p.kernel, f) for f in FLUSH.values()]
        print(f"| {label} | " + " | ".join(f"{x:.1f}" for x in row) + " |", flush=True)
