"""Serving metrics: per-rank records, their merge across ranks, the JSON summary, the progress line.

Latency is end to end (arrival to last token) and time to first token is arrival to the end of
the prefill, both measured on the rank that owns the request. Throughput counts every token that
went through the MoE layers (prefill and decode) over all ranks, divided by the wall time of the
serving loop.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from .scheduler import FinishedRequest


def percentile(values: list[float], q: float) -> float | None:
    """``q``-th percentile (0..100) with linear interpolation; None for an empty list."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _ms_stats(seconds: list[float]) -> dict:
    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 4)
    return {
        "p50": ms(percentile(seconds, 50)),
        "p99": ms(percentile(seconds, 99)),
        "mean": ms(sum(seconds) / len(seconds)) if seconds else None,
        "max": ms(max(seconds)) if seconds else None,
    }


@dataclass
class SpotCheckRecord:
    """One reference spot-check: the batch index and the worst calc_diff over ranks."""

    batch: int
    max_diff: float
    passed: bool


@dataclass
class RankMetrics:
    """What one rank measured; plain data so that it can be gathered with ``all_gather_object``."""

    rank: int
    experts: tuple[int, int] = (0, 0)   # [first, last + 1) of the experts this rank holds
    latencies_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    batches: int = 0
    nonempty_batches: int = 0
    requests_arrived: int = 0
    requests_finished: int = 0
    requests_unfinished: int = 0
    forward_s: float = 0.0

    def record_batch(self, num_tokens: int, num_prefill_tokens: int, forward_s: float) -> None:
        self.batches += 1
        self.nonempty_batches += int(num_tokens > 0)
        self.prefill_tokens += num_prefill_tokens
        self.decode_tokens += num_tokens - num_prefill_tokens
        self.forward_s += forward_s

    def record_finished(self, finished: list[FinishedRequest]) -> None:
        for done in finished:
            self.latencies_s.append(done.latency_s)
            self.ttfts_s.append(done.ttft_s)
        self.requests_finished += len(finished)


def window_summary(latencies_s: list[float], tokens: int, elapsed_s: float) -> dict:
    """Metrics of one periodic window (all ranks): tokens/s and latency percentiles in ms."""
    return {
        "tokens": tokens,
        "tokens_per_s": round(tokens / elapsed_s, 3) if elapsed_s > 0 else None,
        "requests_finished": len(latencies_s),
        "latency_ms": _ms_stats(latencies_s),
    }


def summarize(per_rank: list[RankMetrics], *, wall_s: float, run_info: dict,
              spot_checks: list[SpotCheckRecord], periodic: list[dict], stopped_by: str) -> dict:
    """The final metrics document (the ``--metrics-out`` JSON), merged over all ranks."""
    latencies = [v for m in per_rank for v in m.latencies_s]
    ttfts = [v for m in per_rank for v in m.ttfts_s]
    prefill = sum(m.prefill_tokens for m in per_rank)
    decode = sum(m.decode_tokens for m in per_rank)
    finished = sum(m.requests_finished for m in per_rank)
    tokens = prefill + decode
    return {
        **run_info,
        "stopped_by": stopped_by,
        "wall_time_s": round(wall_s, 4),
        "requests_arrived": sum(m.requests_arrived for m in per_rank),
        "requests_finished": finished,
        "requests_unfinished": sum(m.requests_unfinished for m in per_rank),
        "tokens": tokens,
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
        "requests_per_s": round(finished / wall_s, 3) if wall_s > 0 else None,
        "batches": max((m.batches for m in per_rank), default=0),
        "latency_ms": _ms_stats(latencies),
        "ttft_ms": _ms_stats(ttfts),
        "spot_checks": {
            "count": len(spot_checks),
            "failures": sum(not s.passed for s in spot_checks),
            "max_diff": max((s.max_diff for s in spot_checks), default=None),
            "records": [asdict(s) for s in spot_checks],
        },
        "periodic": periodic,
        "per_rank": [
            {
                "rank": m.rank,
                "experts": list(m.experts),
                "tokens": m.prefill_tokens + m.decode_tokens,
                "requests_finished": m.requests_finished,
                "nonempty_batches": m.nonempty_batches,
                "forward_s": round(m.forward_s, 4),
                "latency_ms": _ms_stats(m.latencies_s),
            }
            for m in per_rank
        ],
    }


def write_metrics(path: str | Path, metrics: dict) -> None:
    """Write ``metrics`` as indented JSON, atomically (a reader never sees a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    os.replace(tmp, path)


class ProgressDisplay:
    """Rank 0's progress: one line redrawn in place on a terminal, appended lines otherwise."""

    def __init__(self, stream: TextIO = sys.stderr, enabled: bool = True):
        self._stream = stream
        self._enabled = enabled
        self._tty = enabled and stream.isatty()
        self._drawn = False

    def update(self, elapsed_s: float, total_finished: int, total_expected: int | None, window: dict) -> None:
        if not self._enabled:
            return
        latency = window["latency_ms"]
        expected = "?" if total_expected is None else str(total_expected)
        tps = window["tokens_per_s"]
        line = (f"[serve] {elapsed_s:7.1f}s  requests {total_finished}/{expected}  "
                f"{0.0 if tps is None else tps:10.1f} tok/s (last interval)  "
                f"p50 {self._fmt(latency['p50'])}  p99 {self._fmt(latency['p99'])}")
        if self._tty:
            self._stream.write("\r" + line.ljust(100))
            self._drawn = True
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._tty and self._drawn:
            self._stream.write("\n")
            self._stream.flush()

    @staticmethod
    def _fmt(ms: float | None) -> str:
        return "   -    " if ms is None else f"{ms:8.2f}ms"
