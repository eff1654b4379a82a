"""Runs one dense FP8 GEMM back to back for a few seconds and samples the GPU's power draw, SM
clock and throttle reasons with nvidia-smi meanwhile: whether a shape runs at the board's power
limit (then its speed is FLOPs per joule, and the clock sinks to fit) or at the clock's ceiling.

    python3 scripts/power_probe.py --shapes 4096x7168x16384,4096x4096x7168 --seconds 4

(on the GPU machine: `source scripts/gpu_env.sh` first, as scripts/gpu_check.sh does). Throttle
reason bits (NVML): 0x4 software power cap, 0x20 software thermal, 0x40 hardware thermal,
0x80 hardware power brake."""

from __future__ import annotations

import argparse
import subprocess
import threading
import time

import torch

import kernels

_QUERY = "power.draw,power.limit,clocks.sm,clocks_throttle_reasons.active,temperature.gpu"


def sample_gpu(samples: list[str], stop: threading.Event, period_s: float) -> None:
    while not stop.is_set():
        done = subprocess.run(["nvidia-smi", f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True)
        samples.append(done.stdout.strip().splitlines()[0] if done.stdout.strip() else done.stderr.strip())
        time.sleep(period_s)


def probe(m: int, n: int, k: int, seconds: float, period_s: float) -> None:
    a = kernels.per_token_cast_to_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    b = kernels.per_block_cast_to_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        kernels.fp8_gemm_nt(a, b, d)
    torch.cuda.synchronize()
    samples: list[str] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_gpu, args=(samples, stop, period_s))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.time()
    sampler.start()
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(50):
            kernels.fp8_gemm_nt(a, b, d)
        calls += 50
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    stop.set()
    sampler.join()
    us = start.elapsed_time(end) * 1e3 / calls
    print(f"{m} x {n} x {k}: {us:.1f} us per call back to back, {2 * m * n * k / us / 1e6:.0f} TFLOP/s, {calls} calls")
    print(f"  samples ({_QUERY}), the first second's left out:")
    for s in samples[int(1 / period_s):]:
        print("  ", s)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x7168x16384,4096x4096x7168", metavar="MxNxK[,MxNxK...]")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--period", type=float, default=0.5, help="seconds between nvidia-smi samples")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("power_probe needs a CUDA device")
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        probe(m, n, k, args.seconds, args.period)


if __name__ == "__main__":
    main()
