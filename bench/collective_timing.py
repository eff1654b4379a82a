"""Timing of one collective call on every rank, for bench/bench_dispatch.py: :class:`Clock` starts
all ranks together and takes the slowest rank's time; :func:`profile_calls` prints torch.profiler's
device time per kernel and cProfile's host time per Python function; :func:`capture_graph` puts a
call in a CUDA graph. How the clock aligns the ranks is told in bench_dispatch.py's docstring."""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from moe_runtime.dist import DistContext

kWarmup = 3
kProfileIters = 5


class Clock:
    """Times one collective call per iteration, all ranks starting together (see the module docstring)."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.cuda = ctx.device.type == "cuda"
        self.device_sync = self.cuda and "nccl" in str(ctx.backend)
        if self.cuda:
            self.token = torch.zeros(1, device=ctx.device)
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _align(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier(group=self.ctx.cpu_group)
        if self.device_sync:
            dist.all_reduce(self.token, group=self.ctx.group)

    def _once(self, fn: Callable[[], object]) -> float:
        self._align()
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        self.start.record()
        fn()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) * 1e-3

    def median_s(self, fn: Callable[[], object], iters: int) -> float:
        """Median over ``iters`` of the slowest rank's seconds for one call of ``fn``."""
        for _ in range(kWarmup):
            self._once(fn)
        samples = torch.tensor([self._once(fn) for _ in range(iters)], dtype=torch.float64)
        dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=self.ctx.cpu_group)
        return statistics.median(samples.tolist())


def profile_calls(ctx: DistContext, clock: Clock, label: str, fn: Callable[[], object],
                  trace_dir: str | None = None) -> None:
    """``--profile``: every rank runs ``kProfileIters`` aligned calls of ``fn`` under torch.profiler;
    rank 0 prints the device time per kernel (the alignment's barrier and one-element all-reduce
    appear as their own rows) and the host time of one call (Python until ``fn`` returns, the
    device not waited for). ``trace_dir``: every rank writes the timeline there as a chrome trace
    (where the host waits and where the device idles)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    host = []
    with profile(activities=activities) as prof:
        for _ in range(kProfileIters):
            clock._align()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            if clock.cuda:
                torch.cuda.synchronize()
    if trace_dir is not None:
        name = "_".join(label.replace(",", "").replace("/", "per").split())
        prof.export_chrome_trace(os.path.join(trace_dir, f"{name}_rank{ctx.rank}.json"))
    # Where the host time goes, by Python function (time blocked in a device sync included).
    python = cProfile.Profile()
    for _ in range(kProfileIters):
        clock._align()
        python.enable()
        fn()
        python.disable()
    if ctx.rank == 0:
        sort = "self_device_time_total" if clock.cuda else "self_cpu_time_total"
        print(f"### profile: {label} (rank 0, {kProfileIters} calls; host time per call: median "
              f"{statistics.median(host) * 1e6:.1f} us)\n" + prof.key_averages().table(sort_by=sort, row_limit=25)
              + "\n" + host_table(pstats.Stats(python), kProfileIters), flush=True)


def host_table(stats: pstats.Stats, calls: int, rows: int = 30) -> str:
    """cProfile's functions by cumulative host time, in µs per profiled call (pstats prints whole
    milliseconds, too coarse for a call of a few hundred µs)."""
    lines = ["| cumulative µs/call | own µs/call | calls/call | function |", "| ---: | ---: | ---: | --- |"]
    entries = sorted(stats.stats.items(), key=lambda item: -item[1][3])[:rows]
    for (path, line, name), (_, num_calls, own, cumulative, _) in entries:
        where = f"{os.path.relpath(path) if path.startswith('/') else path}:{line}({name})"
        lines.append(f"| {cumulative / calls * 1e6:.1f} | {own / calls * 1e6:.1f} | {num_calls / calls:g} | {where} |")
    return "\n".join(lines)


def capture_graph(fn: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """``fn`` (already run eagerly, so its kernels are compiled and its communicators exist) captured
    in a CUDA graph; every rank captures the same calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph
