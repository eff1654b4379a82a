"""Expert-parallel dispatch and combine of the staged backend against an all-to-all, in one run.

    torchrun --nproc-per-node N bench/bench_dispatch.py [--tokens 4096] [--hidden 7168] [--topk 8]
        [--experts 256] [--latency-tokens 128] [--iters 20] [--symm-backend torch|nvshmem|host]
        [--transport staged|low_latency]

The problem is DeepSeek-V3's: ``--experts`` split evenly over the N ranks, each rank routing its own
random tokens (a fixed seed per rank, ``--topk`` distinct experts per token, uniform over experts).
Both directions run through :class:`moe_runtime.backends.staged.StagedDispatchCombine`, the
staged backend's own classes, over a :class:`moe_runtime.symm.SymmBuffer` of ``--symm-backend``
(``torch`` or ``nvshmem`` on GPUs, ``host`` on CPU with gloo):

* dispatch: bf16 tokens -> 1x128 FP8 quantization -> count exchange (one host sync) -> every
  (token, top-k slot) row written into its owner's contiguous layout (FP8 row, its float32 scales,
  its top-k weight and source slot) -> barrier;
* combine: every received row written back (bf16) into its source rank's slot -> barrier -> the
  source sums its slots in float32.

Bytes that cross between ranks: rows whose owner is another rank, times the bytes of a row: ``H``
(FP8) + ``4 H / 128`` (scales) + 8 (top-k weight, source slot) for dispatch, ``2 H`` for combine.
Rows a rank keeps for itself are moved too (a local copy) but not counted.

``--transport low_latency`` (CUDA): :class:`moe_runtime.backends.low_latency.LowLatencyDispatchCombine`
instead, whose dispatch writes each pair into its owner's masked layout and whose waits are on the
device (no count exchange, no host barrier). Its buffers hold ranks x tokens rows per local expert,
so it runs the latency rows only, and since every dispatch must be followed by its combine (the
transport counts forwards on the device) a row times the pair ("round") against the two
all-to-alls of the same traffic; a second row replays both from CUDA graphs (no host work per call).

``--profile``: rank 0 also prints torch.profiler's device time per kernel and cProfile's host time
per Python function for each timed call. ``--trace DIR`` (implies ``--profile``): every rank also
writes the profiled calls' timeline as a chrome trace into DIR.

The peer is ``all_to_all_single`` of the process group (NCCL on GPUs, gloo on CPU) on one uint8
buffer per rank with the same per-pair byte counts (the rows a rank keeps included), measured in
the same run on the same routing.

The ceiling ("peer copy"), also in the same run: every rank copies the same cross-rank bytes as one
contiguous block per peer straight into that peer's memory (``copy_`` into a SymmBuffer view of the
same backend; the copy engine on GPUs), then the buffer's barrier. No quantization, layout or
metadata: what the links deliver to a plain copy. "ours of peer copy" is its time over ours. Before
timing, every rank checks that each peer's block arrived (a byte pattern per sender and receiver).

Time: every rank waits for the others (host barrier, plus a one-element NCCL all-reduce on GPUs so
that the devices start together), then times one call: CUDA events around it on GPUs (host work
such as the dispatch's count exchange included), ``perf_counter`` on CPU. An iteration's time is
the slowest rank's; the table gives the median over ``--iters`` iterations after warm-up.
GB/s per rank: the mean over ranks of the bytes each rank sends to the others, over that time.

Correctness, before timing, at both token counts: one dispatch + combine round, with a row-local
stand-in for the experts (dequantized row x top-k weight x a per-expert random vector), against
the reference backend's all-gather dispatch and reduce combine with the same stand-in, judged per
token: the worst over tokens of calc_diff between the two output rows. The two sum a token's top-k
rows in different orders, which moves the last bf16 bit (about 1e-6 per row on GPUs, 0 on CPU); a
row, scale, weight or slot gone astray moves its token by 1e-2 or more. Above ``kTolerance`` every
rank raises.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kernels.reference.quant import dequantize_per_token  # noqa: E402
from moe_runtime.backends.base import MoEProblem  # noqa: E402
from moe_runtime.backends.low_latency import LowLatencyDispatchCombine  # noqa: E402
from moe_runtime.backends.reference import ReferenceDispatchCombine  # noqa: E402
from moe_runtime.backends.staged import StagedDispatchCombine, is_supported  # noqa: E402
from moe_runtime.dist import (DistContext, apply_multicast_safety_env, expert_placement,  # noqa: E402
                              init_distributed, kMulticastSafetyEnv)
from moe_runtime.symm import SymmBuffer, ViewSpec, compute_layout  # noqa: E402

from collective_timing import Clock, capture_graph, profile_calls  # noqa: E402

kActGroup = 128
# Per dispatched row beside its FP8 data and scales: the top-k weight (float32) and the source slot (int32).
kMetadataBytes = 8
# Dispatch and combine never read the intermediate size; any multiple of 128 passes the staged checks.
kIntermediate = 2048
kTolerance = 1e-4  # worst per-token calc_diff (see the module docstring)
kSymmBackends = ("torch", "nvshmem", "host")
kTransports = ("staged", "low_latency")


@dataclass(frozen=True)
class BenchConfig:
    tokens: int
    hidden: int
    top_k: int
    experts: int
    latency_tokens: int
    iters: int
    symm_backend: str
    seed: int
    link_gbps: float | None
    transport: str = "staged"
    profile: bool = False
    trace_dir: str | None = None  # --trace: each rank's chrome trace of every profiled row

    @property
    def device_type(self) -> str:
        return "cpu" if self.symm_backend == "host" else "cuda"

    @property
    def dispatch_row_bytes(self) -> int:
        return self.hidden + self.hidden // kActGroup * 4 + kMetadataBytes

    @property
    def combine_row_bytes(self) -> int:
        return self.hidden * 2


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank of the bandwidth rows")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--latency-tokens", type=int, default=128, help="tokens per rank of the latency rows")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per row (median)")
    parser.add_argument("--symm-backend", choices=kSymmBackends, default=None,
                        help="SymmBuffer backend; default torch with CUDA, else host (CPU ranks)")
    parser.add_argument("--seed", type=int, default=0, help="rank r routes with seed 1000 * seed + r")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="one direction of a GPU's link bandwidth, GB/s: adds an 'of link' column")
    parser.add_argument("--profile", action="store_true",
                        help="after the table, rank 0 prints torch.profiler's per-kernel device times and the host "
                             "time of each timed call (collective_timing.kProfileIters calls)")
    parser.add_argument("--trace", metavar="DIR", default=None,
                        help="with --profile implied: every rank also writes the profiled calls' timeline (host "
                             "and device) as a chrome trace, DIR/<row>_rank<r>.json")
    parser.add_argument("--transport", choices=kTransports, default="staged",
                        help="staged: StagedDispatchCombine; low_latency: LowLatencyDispatchCombine (CUDA, latency "
                             "rows only, each dispatch timed with its combine)")
    args = parser.parse_args(argv)
    for name in ("tokens", "hidden", "topk", "experts", "latency_tokens", "iters"):
        value = getattr(args, name)
        if value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {value}")
    if args.hidden % kActGroup:
        raise ValueError(f"--hidden must be a multiple of {kActGroup} (1x128 FP8 scales), got {args.hidden}")
    if args.topk > args.experts:
        raise ValueError(f"--topk={args.topk} exceeds --experts={args.experts}")
    if args.link_gbps is not None and args.link_gbps <= 0:
        raise ValueError(f"--link-gbps must be positive, got {args.link_gbps}")
    backend = args.symm_backend or ("torch" if torch.cuda.is_available() else "host")
    if backend != "host" and not torch.cuda.is_available():
        raise ValueError(f"--symm-backend {backend} needs CUDA, which is not available; use --symm-backend host")
    if args.transport == "low_latency" and backend == "host":
        raise ValueError("--transport low_latency writes peer GPU memory: it needs CUDA (not --symm-backend host)")
    if args.trace is not None:
        os.makedirs(args.trace, exist_ok=True)
    return BenchConfig(args.tokens, args.hidden, args.topk, args.experts, args.latency_tokens, args.iters, backend,
                       args.seed, args.link_gbps, args.transport, args.profile or args.trace is not None, args.trace)


# ---- inputs and traffic ----------------------------------------------------------------------------------


@dataclass
class Batch:
    """One rank's tokens: ``x`` bf16 [T, H], ``topk_idx`` int64 [T, k] (distinct experts per token),
    ``topk_weights`` float32 [T, k]."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


def make_batch(cfg: BenchConfig, num_tokens: int, rank: int, device: torch.device) -> Batch:
    g = torch.Generator().manual_seed(1000 * cfg.seed + rank + 7919 * num_tokens)
    x = torch.randn(num_tokens, cfg.hidden, generator=g).to(torch.bfloat16)
    idx = torch.rand(num_tokens, cfg.experts, generator=g).topk(cfg.top_k, dim=-1).indices
    weights = torch.rand(num_tokens, cfg.top_k, generator=g) + 0.1
    return Batch(x.to(device), idx.to(device), weights.to(device))


@dataclass(frozen=True)
class Traffic:
    """Rows between ranks of one routing. ``rows[q, p]`` (int64 [P, P], host): rows rank ``p`` sends
    to rank ``q`` in dispatch, which ``q`` sends back to ``p`` in combine; the diagonal stays local."""

    rows: torch.Tensor
    dispatch_row_bytes: int
    combine_row_bytes: int

    @property
    def num_ranks(self) -> int:
        return self.rows.shape[0]

    @property
    def cross_rows(self) -> int:
        return int(self.rows.sum() - self.rows.diagonal().sum())

    def bytes_per_rank(self, op: str) -> float:
        """Mean over ranks of the bytes one rank sends to the others in ``op`` (dispatch, combine, or
        both: ``round``)."""
        if op == "round":
            return self.bytes_per_rank("dispatch") + self.bytes_per_rank("combine")
        return self.cross_rows * self._row_bytes(op) / self.num_ranks

    def _row_bytes(self, op: str) -> int:
        return self.dispatch_row_bytes if op == "dispatch" else self.combine_row_bytes

    def splits(self, op: str, rank: int) -> tuple[list[int], list[int]]:
        """``(input_split_sizes, output_split_sizes)`` in bytes of ``rank``'s all-to-all for ``op``."""
        send_rows = self.rows[:, rank] if op == "dispatch" else self.rows[rank, :]
        recv_rows = self.rows[rank, :] if op == "dispatch" else self.rows[:, rank]
        row_bytes = self._row_bytes(op)
        return [int(n) * row_bytes for n in send_rows], [int(n) * row_bytes for n in recv_rows]


def traffic_of_routing(ctx: DistContext, cfg: BenchConfig, batch: Batch) -> Traffic:
    """The row matrix of a routing: every rank counts its pairs per owner rank, then all ranks
    share the counts."""
    owners = batch.topk_idx.flatten().cpu() // (cfg.experts // ctx.world_size)
    mine = torch.bincount(owners, minlength=ctx.world_size).to(torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine, group=ctx.cpu_group)
    return Traffic(torch.stack(gathered, dim=1), cfg.dispatch_row_bytes, cfg.combine_row_bytes)


# ---- the correctness round --------------------------------------------------------------------------------


def stand_in_expert(rows: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor,
                    scale: torch.Tensor) -> torch.Tensor:
    """Row-local stand-in for the experts: bf16 [n, H] = ``rows`` float32 [n, H] (dequantized FP8) x
    ``weight`` float32 [n] x ``scale[expert]`` (``scale`` float32 [E, H]; ``expert`` int64 [n], -1 on
    rows that are never combined)."""
    return (rows * weight.unsqueeze(1) * scale[expert.clamp(min=0)]).to(torch.bfloat16)


def staged_round(dc: StagedDispatchCombine, batch: Batch, scale: torch.Tensor) -> torch.Tensor:
    out = dc.dispatch(batch.x, batch.topk_idx, batch.topk_weights)
    # Dequantized whole, padding rows included: float8 tensors are never indexed.
    rows = dequantize_per_token(out.x, out.x_sf, gran_k=kActGroup)
    return dc.combine(stand_in_expert(rows, out.topk_idx[:, 0], out.topk_weights[:, 0], scale), out.handle)


def reference_round(ctx: DistContext, cfg: BenchConfig, batch: Batch, scale: torch.Tensor) -> torch.Tensor:
    placement = expert_placement(cfg.experts, ctx.world_size, ctx.rank)
    ref = ReferenceDispatchCombine(ctx.ep_group, use_fp8_dispatch=True)
    out = ref.dispatch(batch.x, batch.topk_idx, batch.topk_weights)
    rows = dequantize_per_token(out.x, out.x_sf, gran_k=kActGroup)
    expert_out = torch.zeros((rows.shape[0], cfg.top_k, cfg.hidden), dtype=torch.bfloat16, device=rows.device)
    for j in range(cfg.top_k):
        expert = out.topk_idx[:, j]
        local = (expert >= placement.first_expert) & (expert < placement.first_expert + placement.num_local_experts)
        mine = local.nonzero().flatten()
        expert_out[mine, j] = stand_in_expert(rows[mine], expert[mine], out.topk_weights[mine, j], scale)
    return ref.combine(expert_out, out.handle)


def worst_row_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max over rows of 1 - 2 x.y / (x.x + y.y) (calc_diff per row); 0 for no rows or all-zero rows, inf
    when any row is not finite."""
    if got.shape != expected.shape:
        raise AssertionError(f"combine returned {tuple(got.shape)}, the reference {tuple(expected.shape)}")
    if not got.numel():
        return 0.0
    x, y = got.double().flatten(1), expected.double().flatten(1)
    denominator = (x * x + y * y).sum(1)
    per_row = 1 - 2 * (x * y).sum(1) / denominator.clamp(min=torch.finfo(torch.float64).tiny)
    worst = float(torch.where(denominator > 0, per_row, torch.zeros_like(per_row)).max())
    # NaN or inf (garbage rows) must fail: an all_reduce MAX can turn a NaN into another rank's value.
    return worst if math.isfinite(worst) else math.inf


def check_round(ctx: DistContext, cfg: BenchConfig, dc: StagedDispatchCombine, batch: Batch) -> float:
    """The worst calc_diff over ranks of staged vs reference; every rank raises above kTolerance."""
    g = torch.Generator().manual_seed(cfg.seed + 17)
    scale = (1 + torch.rand(cfg.experts, cfg.hidden, generator=g)).to(batch.x.device)
    got = staged_round(dc, batch, scale)
    expected = reference_round(ctx, cfg, batch, scale)
    diff = worst_row_diff(got, expected)
    worst = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
    if not worst.item() <= kTolerance:
        raise AssertionError(f"rank {ctx.rank}: {cfg.transport} dispatch + combine of {batch.x.shape[0]} tokens differs from "
                             f"the reference backend: worst per-token calc_diff {diff:.3e} here, "
                             f"{worst.item():.3e} worst over ranks "
                             f"(tolerance {kTolerance:.0e})")
    return worst.item()


# ---- timing (the clock, profiles and graphs: collective_timing.py) ------------------------------------


@dataclass(frozen=True)
class Row:
    op: str
    mode: str
    tokens: int
    bytes_per_rank: float
    ours_s: float
    all_to_all_s: float
    peer_copy_s: float


def all_to_all_fn(ctx: DistContext, traffic: Traffic, op: str) -> Callable[[], object]:
    send_splits, recv_splits = traffic.splits(op, ctx.rank)
    g = torch.Generator().manual_seed(ctx.rank)
    send = torch.randint(0, 256, (sum(send_splits),), dtype=torch.uint8, generator=g).to(ctx.device)
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=ctx.device)
    return lambda: dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                                          group=ctx.group)


class PeerCopy:
    """The ceiling: each rank's cross-rank bytes of ``ops`` (a tuple of "dispatch", "combine") copied as
    one block per peer into that peer's SymmBuffer (collective to build and to destroy).

    Receiver ``q`` holds the block from sender ``p`` at the bytes ``q`` receives from senders before
    ``p``; sender ``p``'s block for ``q`` is filled with :meth:`pattern` ``(p, q)``."""

    def __init__(self, ctx: DistContext, traffic: Traffic, ops: tuple[str, ...], backend: str):
        self.ctx = ctx
        n, me = ctx.world_size, ctx.rank
        # bytes[q][p]: what p sends q over all ops; the diagonal stays local and is not copied.
        sizes = [[0 if p == q else sum(traffic.splits(op, p)[0][q] for op in ops) for p in range(n)] for q in range(n)]
        self.recv_offsets = [[sum(sizes[q][:p]) for p in range(n)] for q in range(n)]
        self.sizes = sizes
        most = max(sum(row) for row in sizes)
        self.buffer = SymmBuffer(compute_layout([ViewSpec("recv", (most,), torch.uint8)]), ctx.ep_group,
                                 backend=backend, device=ctx.device)
        self.send = torch.empty(sum(sizes[q][me] for q in range(n)), dtype=torch.uint8, device=ctx.device)
        self.copies = []
        start = 0
        for q in range(n):
            size = sizes[q][me]
            if not size:
                continue
            src = self.send[start: start + size]
            src.fill_(self.pattern(me, q))
            offset = self.recv_offsets[q][me]
            self.copies.append((self.buffer.peer_view("recv", q)[offset: offset + size], src))
            start += size

    @staticmethod
    def pattern(sender: int, receiver: int) -> int:
        return (31 * sender + 7 * receiver + 1) % 256

    def __call__(self) -> None:
        for dst, src in self.copies:
            dst.copy_(src, non_blocking=True)
        self.buffer.barrier()

    def check(self) -> None:
        """Every rank: each sender's block holds that sender's pattern (raises otherwise)."""
        me, recv = self.ctx.rank, self.buffer.view("recv")
        # A byte no sender's pattern has: nothing that passes can be left from before.
        recv.fill_(min(set(range(256)) - {self.pattern(p, me) for p in range(self.ctx.world_size)}))
        self.buffer.barrier()
        self()
        for p, size in enumerate(self.sizes[me]):
            block = recv[self.recv_offsets[me][p]: self.recv_offsets[me][p] + size]
            if size and not bool((block == self.pattern(p, me)).all()):
                raise AssertionError(f"rank {me}: the peer copy from rank {p} did not arrive ({size} bytes)")

    def destroy(self) -> None:
        self.buffer.destroy()


def measure_round(ctx: DistContext, cfg: BenchConfig, dc, clock: Clock, batch: Batch, mode: str) -> list[Row]:
    """A dispatch and its combine timed together (the low-latency transport pairs them on the
    device), against the two all-to-alls of the same traffic: called from Python, and on CUDA also
    both replayed from CUDA graphs (how a decode step runs them)."""
    dispatched = dc.dispatch(batch.x, batch.topk_idx, batch.topk_weights)
    dc.combine(torch.zeros(dispatched.x.shape[0], cfg.hidden, dtype=torch.bfloat16, device=ctx.device),
               dispatched.handle)
    traffic = traffic_of_routing(ctx, cfg, batch)
    g = torch.Generator().manual_seed(1000 * cfg.seed + ctx.rank + 1)
    expert_out = torch.randn(dispatched.x.shape[0], cfg.hidden, generator=g).to(torch.bfloat16).to(ctx.device)
    ours = lambda: dc.combine(expert_out, dc.dispatch(batch.x, batch.topk_idx, batch.topk_weights).handle)  # noqa: E731
    to_owner, back = all_to_all_fn(ctx, traffic, "dispatch"), all_to_all_fn(ctx, traffic, "combine")
    ceiling = PeerCopy(ctx, traffic, ("dispatch", "combine"), cfg.symm_backend)
    ceiling.check()
    ours_s = clock.median_s(ours, cfg.iters)
    peer_s = clock.median_s(lambda: (to_owner(), back()), cfg.iters)
    rows = [Row("round", mode, batch.x.shape[0], traffic.bytes_per_rank("round"), ours_s, peer_s,
                clock.median_s(ceiling, cfg.iters))]
    if clock.cuda:  # the decode path's form: all three replayed from CUDA graphs, no host work per call
        graphs = [capture_graph(ours), capture_graph(lambda: (to_owner(), back())), capture_graph(ceiling)]
        rows.append(Row("round", f"{mode}, CUDA graphs", batch.x.shape[0], traffic.bytes_per_rank("round"),
                        *(clock.median_s(g.replay, cfg.iters) for g in graphs)))
    ceiling.destroy()
    if cfg.profile:
        profile_calls(ctx, clock, f"round, {mode}, {batch.x.shape[0]} tokens/rank", ours, cfg.trace_dir)
    return rows


def measure(ctx: DistContext, cfg: BenchConfig, dc: StagedDispatchCombine, clock: Clock, batch: Batch,
            mode: str) -> list[Row]:
    """Dispatch and combine rows of one token count: ours and the all-to-all on the same traffic."""
    dispatched = dc.dispatch(batch.x, batch.topk_idx, batch.topk_weights)
    traffic = traffic_of_routing(ctx, cfg, batch)
    g = torch.Generator().manual_seed(1000 * cfg.seed + ctx.rank + 1)
    expert_out = torch.randn(dispatched.x.shape[0], cfg.hidden, generator=g).to(torch.bfloat16).to(ctx.device)
    ours = {"dispatch": lambda: dc.dispatch(batch.x, batch.topk_idx, batch.topk_weights),
            "combine": lambda: dc.combine(expert_out, dispatched.handle)}
    rows = []
    for op in ("dispatch", "combine"):
        ceiling = PeerCopy(ctx, traffic, (op,), cfg.symm_backend)
        ceiling.check()
        ours_s = clock.median_s(ours[op], cfg.iters)
        peer_s = clock.median_s(all_to_all_fn(ctx, traffic, op), cfg.iters)
        copy_s = clock.median_s(ceiling, cfg.iters)
        ceiling.destroy()
        if cfg.profile:
            profile_calls(ctx, clock, f"{op}, {mode}, {batch.x.shape[0]} tokens/rank", ours[op], cfg.trace_dir)
        rows.append(Row(op, mode, batch.x.shape[0], traffic.bytes_per_rank(op), ours_s, peer_s, copy_s))
    return rows


# ---- report ---------------------------------------------------------------------------------------------


def machine() -> str:
    if torch.cuda.is_available():
        return (f"{torch.cuda.get_device_name()} ({torch.cuda.device_count()} visible), torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}")
    return f"CPU {platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}"


def command_line(world_size: int) -> str:
    return f"torchrun --nproc-per-node {world_size} {shlex.join(sys.argv)}"


def format_table(ctx: DistContext, cfg: BenchConfig, rows: list[Row], diffs: dict[int, float]) -> str:
    n = ctx.world_size
    multicast = ", ".join(f"{k}={os.environ.get(k)}" for k in kMulticastSafetyEnv)
    checks = ", ".join(f"{d:.1e} at {t} tokens/rank" for t, d in diffs.items())
    lines = [
        f"## dispatch / combine · N={n} · {machine()}",
        "",
        f"Command: `{command_line(n)}`",
        f"Problem: hidden {cfg.hidden}, top-{cfg.top_k}, {cfg.experts} experts ({cfg.experts // n} per rank), random "
        f"routing; FP8 dispatch ({cfg.dispatch_row_bytes} B per row), BF16 combine ({cfg.combine_row_bytes} B per "
        f"row). Transport: {cfg.transport}; SymmBuffer: {cfg.symm_backend}; process group: {ctx.backend}; "
        f"{multicast}.",
        f"Correctness (one dispatch + combine round vs the reference backend, worst per-token calc_diff): {checks}.",
        "Time: median over iterations of the slowest rank; GB/s: bytes sent to other ranks per rank / time.",
        "",
    ]
    header = ["op", "mode", "tokens/rank", "MB out/rank", "ours µs", "ours GB/s", "all-to-all µs",
              "all-to-all GB/s", "speed-up over all-to-all", "peer copy µs", "peer copy GB/s", "ours of peer copy"]
    if cfg.link_gbps is not None:
        header.append(f"ours of {cfg.link_gbps:g} GB/s link")
    lines += ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for r in rows:
        ours_gbps, peer_gbps = r.bytes_per_rank / r.ours_s / 1e9, r.bytes_per_rank / r.all_to_all_s / 1e9
        cells = [r.op, r.mode, str(r.tokens), f"{r.bytes_per_rank / 1e6:.4g}", f"{r.ours_s * 1e6:.1f}",
                 f"{ours_gbps:.4g}", f"{r.all_to_all_s * 1e6:.1f}", f"{peer_gbps:.4g}",
                 f"{r.all_to_all_s / r.ours_s:.3g}x", f"{r.peer_copy_s * 1e6:.1f}",
                 f"{r.bytes_per_rank / r.peer_copy_s / 1e9:.4g}", f"{r.peer_copy_s / r.ours_s:.0%}"]
        if cfg.link_gbps is not None:
            cells.append(f"{ours_gbps / cfg.link_gbps:.0%}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build(ctx: DistContext, cfg: BenchConfig):
    """The transport's dispatch/combine over the EP group (collective: allocates the SymmBuffer)."""
    placement = expert_placement(cfg.experts, ctx.world_size, ctx.rank)
    # The low-latency transport holds P x num_max_tokens_per_rank rows per local expert: sized for
    # the latency rows only.
    capacity = cfg.latency_tokens if cfg.transport == "low_latency" else max(cfg.tokens, cfg.latency_tokens)
    problem = MoEProblem(cfg.hidden, kIntermediate, cfg.experts, cfg.top_k, "fp8", torch.bfloat16, ctx.device,
                         ctx.world_size, capacity, use_fp8_dispatch=True)
    os.environ["MOE_SYMM_BACKEND"] = cfg.symm_backend
    if cfg.transport == "low_latency":
        dc = LowLatencyDispatchCombine(problem, ctx.ep_group, placement.first_expert)
        if ctx.world_size > 1 and dc.buffer.backend != cfg.symm_backend:
            raise RuntimeError(f"the low-latency SymmBuffer runs backend {dc.buffer.backend!r}, "
                               f"not --symm-backend {cfg.symm_backend}")
        return dc
    ok, reason = is_supported(problem)
    if not ok:
        raise NotImplementedError(f"the staged backend cannot run this problem: {reason}")
    # The staged backend allocates its SymmBuffer with the default backend, which MOE_SYMM_BACKEND selects.
    dc = StagedDispatchCombine(problem, ctx.ep_group, placement.first_expert)
    if dc.exchange.buffer.backend != cfg.symm_backend:
        raise RuntimeError(f"the staged SymmBuffer runs backend {dc.exchange.buffer.backend!r}, "
                           f"not --symm-backend {cfg.symm_backend}")
    return dc


def main(argv: list[str] | None = None) -> int:
    apply_multicast_safety_env()
    cfg = parse_args(argv)
    ctx = init_distributed(device=cfg.device_type)
    if ctx.world_size < 2:
        raise ValueError(f"bench_dispatch needs at least 2 ranks (torchrun --nproc-per-node N, N >= 2), got "
                         f"{ctx.world_size}")
    dc = build(ctx, cfg)
    clock = Clock(ctx)
    sizes = {"bandwidth": cfg.tokens, "latency": cfg.latency_tokens}
    if cfg.transport == "low_latency":
        sizes.pop("bandwidth")
    batches = {mode: make_batch(cfg, tokens, ctx.rank, ctx.device) for mode, tokens in sizes.items()}
    diffs = {batch.x.shape[0]: check_round(ctx, cfg, dc, batch) for batch in batches.values()}
    timed = measure_round if cfg.transport == "low_latency" else measure
    rows = [row for mode, batch in batches.items() for row in timed(ctx, cfg, dc, clock, batch, mode)]
    if ctx.rank == 0:
        print(format_table(ctx, cfg, rows, diffs), flush=True)
    (dc.buffer if cfg.transport == "low_latency" else dc.exchange.buffer).destroy()
    ctx.destroy()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without interpreter teardown: a gloo rank has aborted at exit ("terminate called without
    # an active exception") after the groups were destroyed, turning a finished run into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
