"""Request streams for the serving loop: synthetic Poisson arrivals or a JSONL file.

Every rank owns its own stream (expert parallelism keeps the tokens where they arrive and moves
only expert work), so a stream is always built for one ``(rank, world_size)`` pair:

* ``PoissonRequestSource`` draws exponential inter-arrival gaps at ``rate / world_size`` per rank
  (the union of the ranks' streams is a Poisson stream at ``rate``), with prompt and output lengths
  uniform in the given ranges, from a generator seeded by ``(seed, rank)``.
* ``load_jsonl_requests`` reads one JSON object per line and keeps the lines whose index is
  ``rank (mod world_size)``.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


@dataclass(frozen=True)
class Request:
    """One inference request as the MoE layers see it.

    ``prompt_tokens`` tokens go through the layers once (prefill, possibly in chunks), then the
    request takes ``output_tokens`` decode steps of one token each. ``arrival_s`` is seconds after
    the serving loop started.
    """

    request_id: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class LengthRange:
    """Inclusive integer range ``[low, high]`` from which a synthetic length is drawn uniformly."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 0 or self.high < self.low:
            raise ValueError(f"LengthRange: expected 0 <= low <= high, got low={self.low}, high={self.high}")

    @classmethod
    def parse(cls, text: str, name: str) -> "LengthRange":
        """``"32"`` or ``"16-64"`` -> range; ``name`` is the option named in errors."""
        parts = text.split("-")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"{name}: expected an integer or LOW-HIGH, got {text!r}") from None
        if len(values) == 1:
            values = values * 2
        if len(values) != 2:
            raise ValueError(f"{name}: expected an integer or LOW-HIGH, got {text!r}")
        try:
            return cls(values[0], values[1])
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None


class PoissonRequestSource:
    """Synthetic requests of one rank, in arrival order.

    ``rate``: requests per second over all ranks (> 0). ``num_requests``: requests over all ranks,
    split as evenly as possible (rank ``r`` gets one more while ``r < num_requests % world_size``);
    None means unbounded (the serving loop then stops at ``--duration``).
    """

    def __init__(self, *, rate: float, num_requests: int | None, prompt_tokens: LengthRange,
                 output_tokens: LengthRange, rank: int, world_size: int, seed: int = 0):
        if not rate > 0 or math.isinf(rate):
            raise ValueError(f"rate: expected a finite number of requests per second > 0, got {rate}")
        if num_requests is not None and num_requests < 0:
            raise ValueError(f"num_requests: expected >= 0 or None, got {num_requests}")
        if prompt_tokens.low < 1:
            raise ValueError(f"prompt_tokens: every request needs at least one prompt token, got {prompt_tokens}")
        self._rate_per_rank = rate / world_size
        self._limit = None if num_requests is None else (
            num_requests // world_size + (1 if rank < num_requests % world_size else 0))
        self._prompt = prompt_tokens
        self._output = output_tokens
        self._rank = rank
        self._rng = random.Random(seed * 1_000_003 + rank)

    def __iter__(self) -> Iterator[Request]:
        arrival = 0.0
        index = 0
        while self._limit is None or index < self._limit:
            arrival += self._rng.expovariate(self._rate_per_rank)
            yield Request(
                request_id=f"r{self._rank}-{index}",
                prompt_tokens=self._rng.randint(self._prompt.low, self._prompt.high),
                output_tokens=self._rng.randint(self._output.low, self._output.high),
                arrival_s=arrival,
            )
            index += 1


def _field(obj: dict, key: str, default, where: str):
    value = obj.get(key, default)
    if value is None:
        raise ValueError(f"{where}: missing required field {key!r}")
    return value


def parse_request_line(line: str, where: str) -> Request:
    """One JSONL line -> Request.

    Fields: ``prompt_tokens`` (int >= 1; ``num_tokens`` is accepted as a synonym), optional
    ``output_tokens`` (int >= 0, default 0), ``arrival_s`` (float >= 0, default 0: all at start),
    ``id`` (any JSON scalar, default the line label; unique in a file, compared as strings).
    ``where`` names the file and line in errors.
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg}): {line.strip()[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    prompt = _field(obj, "prompt_tokens", obj.get("num_tokens"), where)
    output = _field(obj, "output_tokens", 0, where)
    arrival = _field(obj, "arrival_s", 0.0, where)
    if isinstance(prompt, bool) or not isinstance(prompt, int) or prompt < 1:
        raise ValueError(f"{where}: prompt_tokens must be an integer >= 1, got {prompt!r}")
    if isinstance(output, bool) or not isinstance(output, int) or output < 0:
        raise ValueError(f"{where}: output_tokens must be an integer >= 0, got {output!r}")
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not 0 <= arrival < math.inf:
        raise ValueError(f"{where}: arrival_s must be a finite number >= 0, got {arrival!r}")
    return Request(request_id=str(obj.get("id", where)), prompt_tokens=prompt, output_tokens=output,
                   arrival_s=float(arrival))


def load_jsonl_requests(path: str | Path, *, rank: int, world_size: int,
                        num_requests: int | None = None) -> list[Request]:
    """This rank's requests of a JSONL file, sorted by arrival.

    Blank lines are skipped; the remaining lines are numbered from 0 and line ``i`` goes to rank
    ``i % world_size``. ``num_requests`` keeps only the first that many lines of the file. Every
    line is validated on every rank, so a bad file fails everywhere with the same message.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"requests_jsonl: no such file: {path}")
    mine: list[Request] = []
    index = 0
    first_line: dict[str, int] = {}  # id -> line: the scheduler tracks requests by id
    with path.open() as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            if num_requests is not None and index >= num_requests:
                break
            request = parse_request_line(line, f"{path}:{line_no}")
            if request.request_id in first_line:
                raise ValueError(f"{path}:{line_no}: request id {request.request_id!r} repeats line "
                                 f"{first_line[request.request_id]} (ids are compared as strings)")
            first_line[request.request_id] = line_no
            if index % world_size == rank:
                mine.append(request)
            index += 1
    if index == 0:
        raise ValueError(f"requests_jsonl: {path} holds no requests")
    mine.sort(key=lambda r: r.arrival_s)
    return mine
