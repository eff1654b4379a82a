"""Timing helpers for bench/ scripts (GPU only).

Two numbers per benchmark, as the project reports them:
* kernel time: CUDA kernel durations from the torch profiler, with the L2 flushed before every
  run so that inputs come from HBM (``bench_kineto``);
* time per call: one call from Python on an idle stream, CUDA events around it, so host work
  (argument checks, heuristics, JIT cache look-up, launch) is included (``per_call_us``).

The L2 flush (``MOE_BENCH_FLUSH``, read per call):
* ``read`` (default): a sum over a 256 MB buffer. L2 then holds clean lines of that buffer, and
  the timed kernel reads its inputs from HBM without paying for anyone else's writes.
* ``write``: the buffer zeroed (the flush of DeepGEMM's benchmarks, and of this project's results
  before 2026-12-01). The memset leaves the last ~50 MB it wrote dirty in L2, and the next kernel
  pays their write-back to HBM. Measured on an H200 (bench/RESULTS.md, 2026-12-01): +7 µs on a
  68 µs FP4 decode GEMM, +7 µs on a 115 µs FP8 one, +2 µs on a 13.6 µs dense GEMM; level on a
  173 µs compute-bound one.

``MOE_BENCH_GAP_US`` (default 0): the host waits this many microseconds after each flush has
finished before the timed call, so calls with short and long host paths start on a GPU idle for
the same time (DeepGEMM's Python call takes 20-40 µs to launch, ours 5-10).
"""

from __future__ import annotations

import argparse

import contextlib
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

_L2_FLUSH_BYTES = 256 << 20  # several times the H200's 60 MB L2
_FLUSH_MODES = ("read", "write")


@dataclass
class KernelTiming:
    median_s: float
    min_s: float
    num_runs: int
    kernels_per_run: int


def flush_mode() -> str:
    """The L2 flush bench_kineto runs: ``MOE_BENCH_FLUSH`` ("read" unless set); raises ValueError
    naming the variable for any other value."""
    mode = os.environ.get("MOE_BENCH_FLUSH") or "read"
    if mode not in _FLUSH_MODES:
        raise ValueError(f"MOE_BENCH_FLUSH: expected one of {', '.join(_FLUSH_MODES)}, got {mode!r}")
    return mode


class _L2Flush:
    """Evicts L2 before a timed run (``flush_mode``): reads or zeroes a 256 MB int32 buffer."""

    def __init__(self, mode: str):
        self.mode = mode
        self.buffer = torch.ones(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
        self.sink = torch.empty((), dtype=torch.int64, device="cuda")

    def __call__(self) -> None:
        if self.mode == "write":
            self.buffer.zero_()
        else:
            torch.sum(self.buffer, 0, out=self.sink)


def gap_us() -> int:
    """Microseconds the host waits between a flush's end and the timed call: ``MOE_BENCH_GAP_US``
    (0 unless set); raises ValueError naming the variable for anything but an integer >= 0."""
    value = os.environ.get("MOE_BENCH_GAP_US") or "0"
    if not value.isdigit():
        raise ValueError(f"MOE_BENCH_GAP_US: expected an integer number of microseconds >= 0, got {value!r}")
    return int(value)


def flush_description() -> str:
    """The flush and host wait that kernel timings run, as the benchmarks print them."""
    gap = gap_us()
    return (f"L2 flush before every timed run: {flush_mode()} (MOE_BENCH_FLUSH)"
            + (f", then {gap} µs of host wait (MOE_BENCH_GAP_US)" if gap else ""))


def _wait_us(us: int) -> None:
    """Spins the host for ``us`` microseconds (sleep's granularity is coarser)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


_FLUSHES: dict[tuple[str, int], tuple[_L2Flush, list[str]]] = {}


def _l2_flush(mode: str) -> tuple[_L2Flush, list[str]]:
    """The flush of ``mode`` on the current device and the names of the kernels one call of it
    launches, in order; made once per process, mode and device (the buffer stays allocated)."""
    key = (mode, torch.cuda.current_device())
    if key not in _FLUSHES:
        flush = _L2Flush(mode)
        flush()  # a first call's one-time work stays out of the sequence learned below
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            flush()
            torch.cuda.synchronize()
        names = [name for name, _, _ in _cuda_kernels(prof)]
        if not names:
            raise RuntimeError("bench_kineto: the profiler saw no kernel of the L2 flush, so the runs cannot be "
                               "told apart from it")
        _FLUSHES[key] = (flush, names)
    return _FLUSHES[key]


def _cuda_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every CUDA event of a profile, in start order."""
    events = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(events, key=lambda e: e[1])


def _split_runs(names: list[str], num_tests: int, flush_kernels: list[str]) -> list[tuple[int, int]]:
    """[begin, end) of each run's own kernels in a profile's kernel names: ``num_tests`` times the
    flush's sequence (``flush_kernels``), then the run's kernels. Each run starts after its flush
    has finished and each flush after the previous run, so nothing interleaves. A run's kernels end
    where the flush's sequence next begins (the last run's, at the end)."""
    f = len(flush_kernels)
    runs, i = [], 0
    while i < len(names):
        if names[i:i + f] != flush_kernels:
            raise RuntimeError(f"bench_kineto: expected the L2 flush's kernels {flush_kernels} at kernel {i} of the "
                               f"profile, found {names[i:i + f]}")
        begin = j = i + f
        while j < len(names) and names[j:j + f] != flush_kernels:
            j += 1
        runs.append((begin, j))
        i = j
    if len(runs) != num_tests:
        raise RuntimeError(f"bench_kineto: the profile splits into {len(runs)} runs at the L2 flush's kernels, "
                           f"expected {num_tests}: does the timed function launch the flush's kernels "
                           f"{flush_kernels} itself?")
    return runs


def per_run_seconds(kernels: Iterable[tuple[str, float, float]], kernel_name: str, num_tests: int,
                    flush_kernels: list[str]) -> tuple[list[float], int]:
    """Seconds of each of ``num_tests`` runs and the kernels per run, from a profile's CUDA kernels
    ((name, start µs, duration µs), in start order) of ``num_tests`` flushes and runs.

    ``flush_kernels``: the names one flush launches, in order ([]: no flush). The runs are told
    apart by where the flush's sequence starts, so a run may launch kernels of the same names (a
    memset, say) and keep them; of each run's kernels those whose name contains ``kernel_name`` are
    timed together: the time during which at least one of them runs (busy_seconds), their durations'
    sum where none overlaps. Raises RuntimeError where the profile does not split into ``num_tests``
    runs or the runs count different numbers of matching kernels (none included)."""
    kernels = list(kernels)
    names = [name for name, _, _ in kernels]
    if flush_kernels:
        runs = _split_runs(names, num_tests, flush_kernels)
    else:  # no flush to split at: the matching kernels, as many per run
        matching = [i for i, name in enumerate(names) if kernel_name in name]
        per = len(matching) // num_tests if matching and len(matching) % num_tests == 0 else 0
        runs = [(matching[r * per], matching[r * per + per - 1] + 1) for r in range(num_tests)] if per else []
    counts = [sum(kernel_name in names[i] for i in range(b, e)) for b, e in runs]
    if not runs or counts[0] == 0 or any(c != counts[0] for c in counts):
        seen = sorted(set(names))
        raise RuntimeError(f"bench_kineto: kernels matching {kernel_name!r} per run: {counts or 'none'} over "
                           f"{num_tests} runs; kernels seen: {seen[:20]}")
    seconds = [busy_seconds([kernels[i][1:] for i in range(b, e) if kernel_name in names[i]]) for b, e in runs]
    return seconds, counts[0]


def interleaved_run_seconds(kernels: Iterable[tuple[str, float, float]], kernel_names: Sequence[str],
                            order: Sequence[int], flush_kernels: list[str]) -> tuple[list[list[float]], list[int]]:
    """Seconds of every run of each of several calls whose runs were interleaved in one profile:
    ``order[t]`` is the index of the call run ``t`` made, ``kernel_names[i]`` call i's kernel name
    substring (as in per_run_seconds: its matching kernels' busy_seconds). The runs are told apart at
    the flush's sequence (``flush_kernels``, not empty). Returns one list of seconds per call, in run
    order, and each call's kernels per run; raises RuntimeError where the profile does not split into ``len(order)`` runs or a call's runs
    match different numbers of kernels (none included)."""
    if not flush_kernels:
        raise ValueError("interleaved_run_seconds: the runs are split at the L2 flush's kernels; none given")
    kernels = list(kernels)
    names = [name for name, _, _ in kernels]
    runs = _split_runs(names, len(order), flush_kernels)
    seconds: list[list[float]] = [[] for _ in kernel_names]
    counts: list[int | None] = [None] * len(kernel_names)
    for (begin, end), which in zip(runs, order):
        name = kernel_names[which]
        mine = [i for i in range(begin, end) if name in names[i]]
        if counts[which] is None:
            counts[which] = len(mine)
        if not mine or len(mine) != counts[which]:
            raise RuntimeError(f"bench_kineto_interleaved: call {which} ({name!r}) matched {len(mine)} kernels in one "
                               f"run, {counts[which]} in its first; kernels of that run: {names[begin:end][:20]}")
        seconds[which].append(busy_seconds([kernels[i][1:] for i in mine]))
    return seconds, [c or 0 for c in counts]


def busy_seconds(spans: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start µs, duration µs) spans: kernels that overlap (one
    launched with programmatic dependent launch starts before the one it follows has ended) count
    once, and the gaps between kernels not at all."""
    total, end = 0.0, float("-inf")
    for start, duration in sorted(spans):
        stop = start + duration
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total * 1e-6


def bench_kineto(fn: Callable[[], object], kernel_name: str, num_tests: int = 30,
                 flush_l2: bool = True, warmup: int = 3) -> KernelTiming:
    """Median CUDA kernel time of ``fn`` over ``num_tests`` runs, the L2 flushed before each
    (``flush_mode``; flush_l2=False: none).

    ``kernel_name`` is a substring of the CUDA kernel name(s) to count ("" counts every kernel
    of ``fn``); when ``fn`` launches several matching kernels, a run's time is that during which at
    least one of them runs (their durations' sum where none overlaps; see busy_seconds).
    The flush's kernels are never counted, and each run starts after its flush has finished.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kineto needs a CUDA device")
    flush, flush_kernels = _l2_flush(flush_mode()) if flush_l2 else (None, [])
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times, per_run = per_run_seconds(_profiled([fn] * num_tests, flush), kernel_name, num_tests, flush_kernels)
    return KernelTiming(statistics.median(times), min(times), num_tests, per_run)


def _profiled(runs: Sequence[Callable[[], object]], flush: _L2Flush | None) -> list[tuple[str, float, float]]:
    """The CUDA kernels (_cuda_kernels) of one profile of ``runs``, each called once in order, each
    after the flush (if any) has finished."""
    gap = gap_us()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for fn in runs:
            if flush is not None:
                flush()
                # Our kernels launch with programmatic dependent launch: queued right behind the
                # flush, they would start during its last blocks and count their wait for it.
                torch.cuda.synchronize()
                _wait_us(gap)
            fn()
        torch.cuda.synchronize()
    return _cuda_kernels(prof)


def interleaved_order(num_calls: int, rounds: int) -> list[int]:
    """Which call each run of an interleaved profile makes: every call once per round, the order
    rotated by one each round, so no call always runs first after the flush of a previous call. Call i
    still runs right after call i - 1 in all but one run per round: two calls of one kernel side by
    side favour the second (repeated_plans)."""
    return [(r + j) % num_calls for r in range(rounds) for j in range(num_calls)]


def bench_kineto_interleaved(calls: Sequence[tuple[Callable[[], object], str]], rounds: int = 30,
                             warmup: int = 3) -> list[KernelTiming]:
    """bench_kineto of each (fn, kernel_name) of ``calls``, their runs interleaved in one profile: round
    r runs every call once, in an order rotated by r, each after its own L2 flush. Timed one after
    the other, the same kernel came out 684 and 763 µs in one process (4096 x 7168 x 16384, the
    variant columns of bench_deepgemm.py, sessions 26 and 28): the GPU drifts over a long cell, and
    interleaved runs share the drift. Returns the timings in the order of ``calls``."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kineto_interleaved needs a CUDA device")
    flush, flush_kernels = _l2_flush(flush_mode())
    for _ in range(warmup):
        for fn, _ in calls:
            fn()
    torch.cuda.synchronize()
    order = interleaved_order(len(calls), rounds)
    kernels = _profiled([calls[which][0] for which in order], flush)
    per_call, counts = interleaved_run_seconds(kernels, [name for _, name in calls], order, flush_kernels)
    return [KernelTiming(statistics.median(s), min(s), len(s), c) for s, c in zip(per_call, counts)]


def env_call(fn: Callable[[], object], **env: str) -> Callable[[], object]:
    """``fn`` called with ``env`` set (env_switches), as one callable (for the interleaved timings)."""
    def call():
        with env_switches(**env):
            return fn()
    return call


def per_call_us(fn: Callable[[], object], iters: int = 100, warmup: int = 5) -> float:
    """Median microseconds of one call of ``fn`` issued on an idle stream, host work included."""
    return per_call_us_interleaved([fn], iters, warmup)[0]


def per_call_us_interleaved(fns: Sequence[Callable[[], object]], iters: int = 100,
                            warmup: int = 5) -> list[float]:
    """``per_call_us`` of each of ``fns``, their samples taken in turn (one call of each per round,
    the order rotated every round), so that all see the same host and GPU state: timed one after
    the other, neighbouring calls' medians moved by several microseconds with the machine's state
    (bench/RESULTS.md, session 21). Returns the medians in the order of ``fns``."""
    if not torch.cuda.is_available():
        raise RuntimeError("per_call_us needs a CUDA device")
    for _ in range(warmup):
        for fn in fns:
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples: list[list[float]] = [[] for _ in fns]
    for i in range(iters):
        for j in range(len(fns)):
            which = (i + j) % len(fns)
            torch.cuda.synchronize()
            start.record()
            fns[which]()
            end.record()
            end.synchronize()
            samples[which].append(start.elapsed_time(end) * 1e3)
    return [statistics.median(s) for s in samples]


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


def positive_ints(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers >= 1 (``--groups 32,256``)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


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


def repeated_plans(plan: Callable[[], object], variants: Sequence[tuple[str, dict[str, str]]]) -> list[bool]:
    """For each (label, env) of ``variants``: whether ``plan()`` under its env (env_switches) equals the
    plan without it or under an earlier variant. A benchmark leaves such a variant untimed: its call runs
    the same kernel, and in an interleaved profile a kernel timed right after itself read 0.3-0.8 µs
    faster at 8-15 µs cells (bench/RESULTS.md, session 45), a gain that is not the variant's."""
    seen = [plan()]
    repeated = []
    for _, env in variants:
        with env_switches(**env):
            p = plan()
        repeated.append(p in seen)
        if p not in seen:
            seen.append(p)
    return repeated


def output_diff(fn: Callable[[], object], out: torch.Tensor, check: Callable[[torch.Tensor], float]) -> float:
    """check(out) of ``fn``'s own output: ``out`` NaN-poisoned, then written by one call of ``fn``, so a
    fast wrong variant shows."""
    out.fill_(float("nan"))
    fn()
    return check(out)

