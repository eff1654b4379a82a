"""Timing helpers for bench/ scripts (GPU only).

Two numbers per benchmark, as the project reports them:
* kernel time: CUDA kernel durations from the torch profiler, with the L2 flushed before every
  run so that inputs come from HBM (``bench_kineto``);
* time per call: one call from Python on an idle stream, CUDA events around it, so host work
  (argument checks, heuristics, JIT cache look-up, launch) is included (``per_call_us``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from dataclasses import dataclass
from typing import Callable

import torch

_L2_FLUSH_BYTES = 256 << 20  # several times the H200's 60 MB L2
_FLUSH_KERNEL_TAGS = ("Memset", "memset", "FillFunctor", "fill_kernel")


@dataclass
class KernelTiming:
    median_s: float
    min_s: float
    num_runs: int
    kernels_per_run: int


def _flush_l2(buffer: torch.Tensor) -> None:
    buffer.zero_()


def bench_kineto(fn: Callable[[], object], kernel_name: str, num_tests: int = 30,
                 flush_l2: bool = True, warmup: int = 3) -> KernelTiming:
    """Median CUDA kernel time of ``fn`` over ``num_tests`` runs.

    ``kernel_name`` is a substring of the CUDA kernel name(s) to count ("" counts every kernel
    of ``fn``); when ``fn`` launches several matching kernels, their durations are summed per run.
    The L2 flush (a memset or fill) is never counted.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kineto needs a CUDA device")
    flush = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(num_tests):
            if flush is not None:
                _flush_l2(flush)
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and kernel_name in e.name
                     and not any(tag in e.name for tag in _FLUSH_KERNEL_TAGS)),
                    key=lambda e: e.time_range.start)
    if not events or len(events) % num_tests != 0:
        names = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
        raise RuntimeError(f"bench_kineto: found {len(events)} kernels matching {kernel_name!r} for "
                           f"{num_tests} runs; kernels seen: {names[:20]}")
    per_run = len(events) // num_tests
    times = [sum(e.time_range.elapsed_us() for e in events[i * per_run:(i + 1) * per_run]) * 1e-6
             for i in range(num_tests)]
    return KernelTiming(statistics.median(times), min(times), num_tests, per_run)


def per_call_us(fn: Callable[[], object], iters: int = 100, warmup: int = 5) -> float:
    """Median microseconds of one call of ``fn`` issued on an idle stream, host work included."""
    if not torch.cuda.is_available():
        raise RuntimeError("per_call_us needs a CUDA device")
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def copy_ceiling_gbps(num_bytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3)
    return 2 * num_bytes / statistics.median(samples) / 1e9


@contextlib.contextmanager
def env_switches(**env: str):
    """Environment variables set inside the block, restored (or removed) after it. The launchers
    read their switches on every call, so one process compares both variants."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def parse_env_variants(values: list[str]) -> list[tuple[str, dict[str, str]]]:
    """``--variant NAME=VALUE[,NAME=VALUE...]`` arguments as (label, environment) pairs; raises
    ValueError naming a malformed one."""
    variants = []
    for v in values:
        pairs = [p.split("=", 1) for p in v.split(",")]
        if any(len(p) != 2 or not p[0] for p in pairs):
            raise ValueError(f"--variant takes NAME=VALUE[,NAME=VALUE...], got {v!r}")
        variants.append((v, dict(pairs)))
    return variants


def kernel_us_with_env(fn: Callable[[], object], kernel_name: str, **env: str) -> float:
    """Kernel time in µs (bench_kineto's median) with environment variables set for the call, e.g. a
    kernel variant switched off (MOE_FP8_MULTICAST="0"); the environment is restored afterwards."""
    with env_switches(**env):
        fn()
        return bench_kineto(fn, kernel_name).median_s * 1e6


def checked_variant_us(fn: Callable[[], object], kernel_name: str, out: torch.Tensor,
                       check: Callable[[torch.Tensor], float], **env: str) -> tuple[float, float]:
    """A variant's kernel time in µs (kernel_us_with_env) and check(out) of its own output: ``out``
    is NaN-poisoned, then written by one call with ``env`` set, so a fast wrong variant shows."""
    out.fill_(float("nan"))
    with env_switches(**env):
        fn()
    diff = check(out)
    return kernel_us_with_env(fn, kernel_name, **env), diff
