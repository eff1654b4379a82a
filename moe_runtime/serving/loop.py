"""The serving loop: every rank batches its own requests and all ranks step the MoE stack together.

Per step: each rank forms its batch (continuous batching, ``scheduler``); one control all-reduce
decides, for all ranks at once, whether to stop (a signal anywhere, or no work left anywhere),
idle (no rank has a token ready) or run; then every rank runs the stack on its batch (0 tokens is
fine: the forward is a collective), records finished requests, and on rank 0's request the ranks
pool their recent latencies for a progress line. At the end the ranks' records are gathered and
rank 0 writes the metrics.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field

import torch

from .checkpoint import SafetensorsCheckpoint
from .config import MoEModelConfig, config_from_hf, load_hf_config
from .control import ControlPlane, RankFailureError, ShutdownSignal
from .metrics import ProgressDisplay, RankMetrics, SpotCheckRecord, summarize, window_summary, write_metrics
from .model import MoEStack, build_stack
from .precompile import device_target, precompile_stack
from .requests import LengthRange, PoissonRequestSource, load_jsonl_requests
from .scheduler import ContinuousBatcher
from .spot_check import SpotChecker

kIdleSleep_s = 0.002


@dataclass
class ServeOptions:
    """Everything ``serve`` needs; ``launch/serve_moe.py`` builds it from the command line.

    ``model`` is ignored when ``checkpoint`` is given (its config.json decides). ``num_requests``
    None with ``duration_s`` set: an unbounded Poisson stream cut off at ``duration_s``.
    """

    model: MoEModelConfig
    preset: str
    num_layers: int | None
    backend: str = "auto"
    weights: str = "fp8"
    checkpoint: str | None = None
    num_requests: int | None = 64
    duration_s: float | None = None
    request_rate: float = 200.0
    prompt_tokens: LengthRange = field(default_factory=lambda: LengthRange(16, 64))
    output_tokens: LengthRange = field(default_factory=lambda: LengthRange(4, 16))
    requests_jsonl: str | None = None
    max_batch_tokens: int = 256
    metrics_out: str | None = None
    spot_check_every: int = 0
    spot_check_tol: float = 1e-3
    log_interval_s: float = 0.5
    timeout_s: float = 300.0
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16
    progress: bool = True
    precompile: bool = True  # CUDA: compile the expert GEMMs before the timed loop (serving/precompile.py)

    def __post_init__(self) -> None:
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration: expected seconds > 0, got {self.duration_s}")
        if self.spot_check_every < 0:
            raise ValueError(f"spot_check_every: expected >= 0 (0 disables), got {self.spot_check_every}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens: expected >= 1, got {self.max_batch_tokens}")
        if self.num_requests is None and self.duration_s is None and self.requests_jsonl is None:
            raise ValueError("num_requests: give --num-requests, --duration or --requests-jsonl, "
                             "otherwise the synthetic stream never ends")


def _request_source(options: ServeOptions, rank: int, world_size: int):
    if options.requests_jsonl is not None:
        return load_jsonl_requests(options.requests_jsonl, rank=rank, world_size=world_size,
                                   num_requests=options.num_requests)
    return PoissonRequestSource(rate=options.request_rate, num_requests=options.num_requests,
                                prompt_tokens=options.prompt_tokens, output_tokens=options.output_tokens,
                                rank=rank, world_size=world_size, seed=options.seed)


def _expected_requests(options: ServeOptions, control: ControlPlane, local_count: int | None) -> int | None:
    if options.requests_jsonl is not None:
        return sum(control.gather(local_count, "counting requests"))
    return options.num_requests


def _build(options: ServeOptions, ctx, control: ControlPlane) -> tuple[MoEStack, MoEModelConfig]:
    checkpoint = None
    model = options.model
    if options.checkpoint is not None:
        checkpoint = SafetensorsCheckpoint(options.checkpoint)
        model = config_from_hf(load_hf_config(options.checkpoint))
    placement = ctx.placement(model.num_experts)
    stack = build_stack(model, num_layers=options.num_layers, backend=options.backend, weights=options.weights,
                        ep_group=ctx.ep_group, experts=placement.local_experts, capacity=options.max_batch_tokens,
                        dtype=options.dtype, device=ctx.device, seed=options.seed, checkpoint=checkpoint)
    if checkpoint is not None:
        checkpoint.close()
    return stack, model


class _Inputs:
    """Random hidden states [T, H] for each step's tokens, from one generator per rank."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device, seed: int, rank: int):
        self._hidden, self._dtype, self._device = hidden, dtype, device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed * 7919 + rank)

    def __call__(self, num_tokens: int) -> torch.Tensor:
        x = torch.randn((num_tokens, self._hidden), generator=self._generator, device=self._device,
                        dtype=torch.float32)
        return x.to(self._dtype)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def serve(options: ServeOptions, ctx) -> dict:
    """Run the serving loop on this rank (every rank calls it); returns the merged metrics.

    ``ctx``: the ``moe_runtime.DistContext`` of ``init_distributed``. Raises
    ``control.RankFailureError`` naming the rank when a peer dies, raises or hangs.
    """
    control = ControlPlane(options.timeout_s)
    try:
        result = _ServingLoop(options, ctx, control).run()
    except RankFailureError:
        raise
    except BaseException as exc:
        control.report_failure(exc)
        raise
    control.close()
    return result


def shutdown(ctx) -> None:
    """Destroy the process groups of ``ctx`` after a successful run, all ranks together.

    The barrier first: a gloo rank that closes its sockets while a peer is still draining the last
    collective has made that peer abort under load.
    """
    if ctx.is_distributed:
        torch.distributed.barrier(group=ctx.cpu_group)
    ctx.destroy()


@dataclass
class _Window:
    """What a rank saw since the last progress report."""

    latencies_s: list[float] = field(default_factory=list)
    tokens: int = 0


class _ServingLoop:
    """One rank's side of the lockstep loop (module docstring); ``run()`` returns the merged metrics."""

    def __init__(self, options: ServeOptions, ctx, control: ControlPlane):
        self.options, self.ctx, self.control = options, ctx, control
        self.rank = control.rank
        self.stack, self.model = control.guard("building the layers", _build, options, ctx, control)
        source = _request_source(options, self.rank, control.world_size)
        self.expected = _expected_requests(options, control, len(source) if isinstance(source, list) else None)
        self.batcher = ContinuousBatcher(source, max_batch_tokens=options.max_batch_tokens,
                                         admit_until_s=options.duration_s)
        self.make_inputs = _Inputs(self.model.hidden_size, options.dtype, ctx.device, options.seed, self.rank)
        self.checker = SpotChecker(self.stack, every=options.spot_check_every, tol=options.spot_check_tol)
        self.display = ProgressDisplay(enabled=options.progress and self.rank == 0)
        experts = ctx.placement(self.model.num_experts).local_experts
        self.metrics = RankMetrics(rank=self.rank, experts=(experts.start, experts.stop))
        self.spot_records: list[SpotCheckRecord] = []
        self.periodic: list[dict] = []
        self.window = _Window()
        self.batch_index = 0
        self.precompiled: dict | None = None
        self.start = 0.0
        self.last_log = 0.0

    def _now(self) -> float:
        return time.monotonic() - self.start

    def run(self) -> dict:
        if self.options.precompile and self.ctx.device.type == "cuda" \
                and self.stack.layers[0].backend_name != "reference":
            self._precompile()
        # The first forward compiles the other kernels (JIT); keep it out of the measured latencies.
        with torch.no_grad():
            self.control.guard("warm-up forward", self.stack, self.make_inputs(min(8, self.options.max_batch_tokens)))
        _synchronize(self.ctx.device)
        with ShutdownSignal() as shutdown:
            self.control.sync(stop_signal=0, pending=True, batch_tokens=0, log=False)
            self.start = time.monotonic()
            stopped_by = self._loop(shutdown)
            wall_s = self._now()
        self.display.close()
        return self._finish(stopped_by, wall_s)

    def _precompile(self) -> None:
        """The first rank of each host compiles the expert GEMMs into the cache its host's ranks
        share; the others wait."""
        if self.ctx.local_rank == 0:
            arch, num_sms = device_target(self.ctx.device)
            count, compiled, seconds = self.control.guard(
                "precompiling kernels", lambda: precompile_stack(self.model, self.options.weights,
                                                                 self.control.world_size, self.options.max_batch_tokens,
                                                                 arch=arch, num_sms=num_sms))
            self.precompiled = {"kernels": count, "compiled": compiled, "seconds": round(seconds, 3)}
        self.control.gather(None, "waiting for rank 0 to precompile kernels")

    def _loop(self, shutdown: ShutdownSignal) -> str:
        while True:
            now = self._now()
            batch = self.batcher.next_batch(now)
            want_log = self.rank == 0 and now - self.last_log >= self.options.log_interval_s
            decision = self.control.sync(stop_signal=shutdown.received, pending=self.batcher.has_pending_work,
                                         batch_tokens=batch.num_tokens, log=want_log)
            if decision.stop_signal:
                return signal.Signals(decision.stop_signal).name
            if not decision.any_pending:
                cut = self.options.duration_s is not None and now >= self.options.duration_s
                return "duration" if cut else "completed"
            if decision.any_tokens:
                self._run_batch(batch)
            else:
                upcoming = self.batcher.next_arrival_s
                time.sleep(kIdleSleep_s if upcoming is None else min(kIdleSleep_s, max(0.0, upcoming - now)))
            if decision.log:
                self._report()

    def _run_batch(self, batch) -> None:
        x = self.make_inputs(batch.num_tokens)
        layer_io = [] if self.checker.due(self.batch_index) else None
        t0 = time.monotonic()
        with torch.no_grad():
            self.control.guard(f"forward of batch {self.batch_index}", self.stack, x, layer_io)
        _synchronize(self.ctx.device)
        self.metrics.record_batch(batch.num_tokens, batch.num_prefill_tokens, time.monotonic() - t0)
        finished = self.batcher.complete(batch, self._now())
        self.metrics.record_finished(finished)
        self.window.latencies_s.extend(f.latency_s for f in finished)
        self.window.tokens += batch.num_tokens
        if layer_io is not None:
            self._spot_check(x, layer_io)
        self.batch_index += 1

    def _spot_check(self, x: torch.Tensor, layer_io: list) -> None:
        what = f"spot-check of batch {self.batch_index}"
        worst = self.control.max(self.control.guard(what, self.checker.check, x, layer_io), what)
        tol = self.options.spot_check_tol
        self.spot_records.append(SpotCheckRecord(self.batch_index, worst, worst <= tol))
        if self.rank == 0 and worst > tol:
            print(f"[serve] WARNING: {what}: calc_diff {worst:.3e} against the reference backend exceeds {tol:.1e}",
                  flush=True)

    def _report(self) -> None:
        pooled = self.control.gather(self.window, "progress report")
        self.window = _Window()
        if self.rank != 0:
            return
        elapsed = self._now()
        window = window_summary([v for w in pooled for v in w.latencies_s], sum(w.tokens for w in pooled),
                                elapsed - self.last_log)
        window["elapsed_s"] = round(elapsed, 3)
        self.periodic.append(window)
        finished = sum(w["requests_finished"] for w in self.periodic)
        self.display.update(elapsed, finished, self.expected, window)
        self.last_log = elapsed

    def _finish(self, stopped_by: str, wall_s: float) -> dict:
        counters = self.batcher.counters
        self.metrics.requests_arrived = counters.arrived
        self.metrics.requests_unfinished = counters.in_flight + counters.waiting
        per_rank = self.control.gather(self.metrics, "gathering metrics")
        options = self.options
        run_info = {
            "preset": options.preset if options.checkpoint is None else None,
            "checkpoint": options.checkpoint,
            "model": self.model.to_dict(),
            "layers": self.stack.spec.num_layers,
            "layer_indices": list(self.stack.spec.layer_indices),
            "backend": self.stack.layers[0].backend_name,
            "backend_requested": options.backend,
            "weights": options.weights,
            "world_size": self.control.world_size,
            "device": str(self.ctx.device),
            "dtype": str(options.dtype).replace("torch.", ""),
            "max_batch_tokens": options.max_batch_tokens,
            "request_source": options.requests_jsonl or f"poisson(rate={options.request_rate}/s)",
            "requests_expected": self.expected,
            "precompiled": self.precompiled,
        }
        result = summarize(per_rank, wall_s=wall_s, run_info=run_info, spot_checks=self.spot_records,
                           periodic=self.periodic, stopped_by=stopped_by)
        if self.rank == 0 and options.metrics_out:
            write_metrics(options.metrics_out, result)
        return result


_kStopReasons = {"completed": "all requests completed", "duration": "duration reached, admitted requests finished"}


def format_summary(metrics: dict) -> str:
    """A few human-readable lines of the final metrics."""
    lat, ttft = metrics["latency_ms"], metrics["ttft_ms"]
    spot = metrics["spot_checks"]

    def ms(v):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f} ms"
    lines = [
        f"[serve] {_kStopReasons.get(metrics['stopped_by'], 'stopped by ' + metrics['stopped_by'])} after "
        f"{metrics['wall_time_s']:.2f}s on "
        f"{metrics['world_size']} rank(s): {metrics['requests_finished']} requests finished, "
        f"{metrics['requests_unfinished']} unfinished",
        f"[serve] {metrics['tokens']} tokens ({metrics['prefill_tokens']} prefill, {metrics['decode_tokens']} decode), "
        f"{metrics['tokens_per_s'] or 0:.1f} tokens/s, {metrics['batches']} batches",
        f"[serve] latency p50 {ms(lat['p50'])}  p99 {ms(lat['p99'])}  |  time to first token "
        f"p50 {ms(ttft['p50'])}  p99 {ms(ttft['p99'])}",
    ]
    if metrics.get("precompiled"):
        pre = metrics["precompiled"]
        lines.append(f"[serve] before the loop: {pre['kernels']} expert GEMM kernels ready ({pre['compiled']} compiled "
                     f"now) in {pre['seconds']:.1f}s")
    if spot["count"]:
        lines.append(f"[serve] spot-checks against the reference backend: {spot['count']}, "
                     f"failures {spot['failures']}, max calc_diff {spot['max_diff']:.3e}")
    return "\n".join(lines)
