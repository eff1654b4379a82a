"""Continuous batching of one rank's requests into token batches.

Each step the scheduler fills a budget of ``max_batch_tokens`` tokens: first one decode token for
every request past its prefill (decode is latency-bound, so it never waits behind a long prompt),
then prefill chunks, continuing partly prefilled requests before admitting new ones in arrival
order. A prompt longer than the remaining budget is split across steps (chunked prefill), so a
batch never exceeds the layer's per-rank token capacity.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from .requests import Request


@dataclass(frozen=True)
class BatchSlice:
    """``num_tokens`` consecutive tokens of one request inside a batch."""

    request_id: str
    num_tokens: int
    is_prefill: bool


@dataclass(frozen=True)
class Batch:
    """The tokens one rank feeds to the MoE layers in one step (possibly none)."""

    slices: tuple[BatchSlice, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.slices)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.slices if s.is_prefill)


@dataclass(frozen=True)
class FinishedRequest:
    """Timing of a completed request; times are seconds since the serving loop started."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    first_token_s: float
    finish_s: float

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass
class _Active:
    request: Request
    prefilled: int = 0
    decoded: int = 0
    first_token_s: float | None = None

    @property
    def prefill_left(self) -> int:
        return self.request.prompt_tokens - self.prefilled

    @property
    def decode_left(self) -> int:
        return self.request.output_tokens - self.decoded


@dataclass
class SchedulerCounters:
    """Requests seen by one rank's scheduler."""

    arrived: int = 0
    finished: int = 0
    in_flight: int = 0
    waiting: int = 0


@dataclass
class ContinuousBatcher:
    """Turns one rank's request stream into batches of at most ``max_batch_tokens`` tokens.

    ``source`` yields requests in non-decreasing ``arrival_s``. ``admit_until_s``: requests that
    arrive later are never admitted (the ``--duration`` cutoff); those already admitted finish.
    """

    source: Iterable[Request]
    max_batch_tokens: int
    admit_until_s: float | None = None
    _upcoming: Iterator[Request] = field(init=False, repr=False)
    _next: Request | None = field(init=False, default=None, repr=False)
    _waiting: collections.deque = field(init=False, default_factory=collections.deque, repr=False)
    _active: dict = field(init=False, default_factory=dict, repr=False)
    counters: SchedulerCounters = field(init=False, default_factory=SchedulerCounters)

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens: expected >= 1, got {self.max_batch_tokens}")
        self._upcoming = iter(self.source)
        self._advance_source()

    def _advance_source(self) -> None:
        self._next = next(self._upcoming, None)
        if self._next is not None and self.admit_until_s is not None and self._next.arrival_s > self.admit_until_s:
            self._next = None

    def close_admission(self) -> None:
        """Admit nothing more from the stream (shutdown); requests already arrived still finish."""
        self._next = None

    def _collect_arrivals(self, now_s: float) -> None:
        while self._next is not None and self._next.arrival_s <= now_s:
            self._waiting.append(self._next)
            self.counters.arrived += 1
            self._advance_source()

    @property
    def has_pending_work(self) -> bool:
        """True while anything is running, waiting, or may still arrive."""
        return bool(self._active or self._waiting or self._next is not None)

    @property
    def next_arrival_s(self) -> float | None:
        return None if self._next is None else self._next.arrival_s

    def next_batch(self, now_s: float) -> Batch:
        """The batch for the step starting at ``now_s`` (empty when nothing is ready)."""
        self._collect_arrivals(now_s)
        budget = self.max_batch_tokens
        slices: list[BatchSlice] = []
        for active in self._active.values():
            if budget == 0:
                break
            if active.prefill_left == 0 and active.decode_left > 0:
                slices.append(BatchSlice(active.request.request_id, 1, is_prefill=False))
                budget -= 1
        for active in self._active.values():
            if budget == 0:
                break
            if active.prefill_left > 0:
                take = min(active.prefill_left, budget)
                slices.append(BatchSlice(active.request.request_id, take, is_prefill=True))
                budget -= take
        while budget > 0 and self._waiting:
            request = self._waiting.popleft()
            self._active[request.request_id] = _Active(request)
            take = min(request.prompt_tokens, budget)
            slices.append(BatchSlice(request.request_id, take, is_prefill=True))
            budget -= take
        self.counters.waiting = len(self._waiting)
        self.counters.in_flight = len(self._active)
        return Batch(tuple(slices))

    def complete(self, batch: Batch, now_s: float) -> list[FinishedRequest]:
        """Record that ``batch`` finished at ``now_s``; returns the requests it completed."""
        finished: list[FinishedRequest] = []
        for piece in batch.slices:
            active = self._active[piece.request_id]
            if piece.is_prefill:
                active.prefilled += piece.num_tokens
                if active.prefill_left == 0:
                    active.first_token_s = now_s
            else:
                active.decoded += piece.num_tokens
            if active.prefill_left == 0 and active.decode_left == 0:
                request = active.request
                finished.append(FinishedRequest(request.request_id, request.prompt_tokens, request.output_tokens,
                                                request.arrival_s, active.first_token_s, now_s))
                del self._active[piece.request_id]
        self.counters.finished += len(finished)
        self.counters.in_flight = len(self._active)
        return finished
