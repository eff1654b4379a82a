"""One rank's low-latency round (dispatch + combine, the experts left out) on one GPU: time per call
from Python, host time per call (launches only), time per call replayed from a CUDA graph, and the
device time of each kernel (torch.profiler). With one rank nothing crosses GPUs, so this isolates
the transport's host overhead and its kernels' fixed costs; bench/bench_dispatch.py measures the
round between ranks.

    python scripts/ll_round_once.py [--tokens 128] [--iters 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from moe_runtime.backends.base import MoEProblem  # noqa: E402
from moe_runtime.backends.low_latency import LowLatencyDispatchCombine  # noqa: E402


def per_call_us(fn, iters: int) -> float:
    """Median of 5 batches of ``iters`` calls, synchronised at the batch's end."""
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    problem = MoEProblem(args.hidden, 2048, args.experts, args.topk, "fp8", torch.bfloat16, device, 1, args.tokens,
                         True)
    dc = LowLatencyDispatchCombine(problem, None, 0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(device, torch.bfloat16)
    idx = torch.stack([torch.randperm(args.experts, generator=g)[: args.topk] for _ in range(args.tokens)]).to(device)
    w = torch.rand(args.tokens, args.topk, generator=g).to(device)
    out = torch.randn(args.experts * dc.rows, args.hidden, generator=g).to(device, torch.bfloat16)
    round_ = lambda: dc.combine(out, dc.dispatch(x, idx, w).handle)  # noqa: E731
    for _ in range(3):
        round_()
    eager = per_call_us(round_, args.iters)
    torch.cuda.synchronize()
    host = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        round_()
        host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        round_()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        round_()
    graphed = per_call_us(graph.replay, args.iters)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            round_()
        torch.cuda.synchronize()
    kernels_us = {e.key: e.device_time_total / e.count for e in prof.key_averages() if e.device_time_total > 0}
    print(f"ll round, 1 rank, {args.tokens} tokens, hidden {args.hidden}, top-{args.topk}, {args.experts} experts: "
          f"eager {eager:.1f} us/call, host {statistics.median(host):.1f} us/call, graph {graphed:.1f} us/call, "
          f"kernels {len(kernels_us)}: " + ", ".join(f"{k[:40]} {v:.1f}" for k, v in sorted(kernels_us.items())))


if __name__ == "__main__":
    main()
