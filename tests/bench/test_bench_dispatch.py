"""bench/bench_dispatch.py on CPU: two gloo ranks under torchrun through the host SymmBuffer, its
correctness round against deliberately broken dispatches, and its argument checks."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

kRepo = Path(__file__).resolve().parents[2]
kScript = kRepo / "bench" / "bench_dispatch.py"
sys.path.insert(0, str(kRepo / "tests" / "moe_runtime"))

from bench_loader import load_bench  # noqa: E402
from torchrun_helper import run_torchrun  # noqa: E402

bench = load_bench("bench_dispatch")

kColumns = ["op", "mode", "tokens/rank", "MB out/rank", "ours µs", "ours GB/s", "all-to-all µs", "all-to-all GB/s",
            "speed-up over all-to-all", "peer copy µs", "peer copy GB/s", "ours of peer copy"]


def _percent(cell: str) -> int:
    assert re.fullmatch(r"\d+%", cell), cell
    return int(cell[:-1])


def _table(stdout: str, columns: list[str]) -> list[dict[str, str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == columns, header
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def _expected_mb_out(cfg, nproc: int, tokens: int) -> dict[str, float]:
    """Mean over ranks of the bytes each rank sends to other ranks, from the bench's own routing."""
    local = cfg.experts // nproc
    cross = sum(int((bench.make_batch(cfg, tokens, rank, torch.device("cpu")).topk_idx // local != rank).sum())
                for rank in range(nproc))
    return {"dispatch": cross * cfg.dispatch_row_bytes / nproc / 1e6,
            "combine": cross * cfg.combine_row_bytes / nproc / 1e6}


@pytest.mark.multirank
@pytest.mark.parametrize("nproc,args", [
    (2, ["--tokens", "96", "--hidden", "256", "--topk", "3", "--experts", "8", "--latency-tokens", "5",
         "--iters", "3", "--seed", "4", "--link-gbps", "450"]),
])
def test_bench_runs_on_two_cpu_ranks_and_prints_the_table(nproc, args):
    stdout = run_torchrun(kScript, nproc, args + ["--symm-backend", "host"], "| dispatch | bandwidth | 96 |",
                          timeout=120)
    assert f"torchrun --nproc-per-node {nproc} " in stdout and "--tokens 96" in stdout
    assert "SymmBuffer: host; process group: gloo" in stdout
    assert "NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1" in stdout
    diffs = re.search(r"calc_diff\): (\S+) at 96 tokens/rank, (\S+) at 5 tokens/rank", stdout)
    assert diffs and all(float(d.rstrip(",")) <= bench.kTolerance for d in diffs.groups()), stdout
    cfg = bench.parse_args(args + ["--symm-backend", "host"])
    table = _table(stdout, kColumns + ["ours of 450 GB/s link"])
    assert [(r["op"], r["mode"], r["tokens/rank"]) for r in table] == [
        ("dispatch", "bandwidth", "96"), ("combine", "bandwidth", "96"),
        ("dispatch", "latency", "5"), ("combine", "latency", "5")]
    for row in table:
        tokens = int(row["tokens/rank"])
        expected = _expected_mb_out(cfg, nproc, tokens)[row["op"]]
        mb, ours_us, peer_us = float(row["MB out/rank"]), float(row["ours µs"]), float(row["all-to-all µs"])
        assert mb == pytest.approx(expected, rel=1e-3), row
        assert ours_us > 0 and peer_us > 0, row
        # GB/s = MB / µs * 1000; the ratio is the all-to-all's time over ours.
        assert float(row["ours GB/s"]) == pytest.approx(mb / ours_us * 1e3, rel=2e-3), row
        assert float(row["all-to-all GB/s"]) == pytest.approx(mb / peer_us * 1e3, rel=2e-3), row
        assert float(row["speed-up over all-to-all"].rstrip("x")) == pytest.approx(peer_us / ours_us, rel=1e-2), row
        # Percentages come from unrounded times; recomputed from the printed 4-digit cells they can
        # land on the other side of a half point.
        assert _percent(row["ours of 450 GB/s link"]) == pytest.approx(float(row["ours GB/s"]) / 450 * 100, abs=0.6), row
        copy_us = float(row["peer copy µs"])
        assert copy_us > 0 and float(row["peer copy GB/s"]) == pytest.approx(mb / copy_us * 1e3, rel=2e-3), row
        assert _percent(row["ours of peer copy"]) == pytest.approx(copy_us / ours_us * 100, abs=0.6), row


@pytest.mark.multirank
def test_trace_writes_every_rank_timeline(tmp_path):
    """--trace DIR: the profile tables on rank 0, and one chrome trace per profiled row and rank."""
    args = ["--tokens", "24", "--hidden", "256", "--topk", "2", "--experts", "4", "--latency-tokens", "3",
            "--iters", "2", "--symm-backend", "host", "--trace", str(tmp_path)]
    stdout = run_torchrun(kScript, 2, args, "| dispatch | bandwidth | 24 |", timeout=180)
    assert stdout.count("### profile: ") == 4, stdout
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"{op}_{mode}_{tokens}_tokensperrank_rank{r}.json"
                           for op in ("dispatch", "combine") for mode, tokens in (("bandwidth", 24), ("latency", 3))
                           for r in (0, 1)), names
    for path in tmp_path.iterdir():
        assert json.loads(path.read_text())["traceEvents"], path


def test_table_cells_from_known_timings():
    cfg = bench.parse_args(["--tokens", "8", "--hidden", "128", "--experts", "8", "--link-gbps", "100",
                            "--symm-backend", "host"])
    ctx = bench.DistContext(0, 2, 0, 2, torch.device("cpu"), "gloo", None, None, None, False)
    rows = [bench.Row("dispatch", "bandwidth", 8, 2e6, 1e-4, 2e-4, 5e-5)]
    text = bench.format_table(ctx, cfg, rows, {8: 0.0})
    assert _table(text, kColumns + ["ours of 100 GB/s link"])
    assert "| dispatch | bandwidth | 8 | 2 | 100.0 | 20 | 200.0 | 10 | 2x | 50.0 | 40 | 50% | 20% |" in text


# ---- the correctness round can fail ----------------------------------------------------------------------


class _Faulty(bench.StagedDispatchCombine):
    """The staged pair with one mistake of a kind a dispatch or combine bug would make."""

    fault = "none"

    def dispatch(self, x, topk_idx, topk_weights):
        out = super().dispatch(x, topk_idx, topk_weights)
        if self.fault == "weights":
            # Each received row gets its neighbour's weight (rows of the layout only: padding rows
            # hold whatever memory held, which may happen to pass).
            rows = (out.m_indices >= 0).nonzero().flatten()
            weights = out.topk_weights.clone()
            weights[rows] = out.topk_weights[rows.roll(1)]
            out.topk_weights = weights
        elif self.fault == "scales":
            out.x_sf = out.x_sf * 1.25  # every scale a quarter off
        return out

    def combine(self, expert_out, handle):
        if self.fault == "rows":
            expert_out = expert_out.roll(1, 0)
        return super().combine(expert_out, handle)


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fault", ["none", "weights", "scales", "rows"])
def test_correctness_round_catches_a_broken_dispatch(one_rank_group, seed, fault):
    cfg = bench.parse_args(["--tokens", "40", "--hidden", "256", "--topk", "3", "--experts", "8",
                            "--seed", str(seed % 1000), "--symm-backend", "host"])
    ctx = bench.DistContext(0, 1, 0, 1, torch.device("cpu"), "gloo", one_rank_group, one_rank_group,
                            one_rank_group, False)
    problem = bench.MoEProblem(cfg.hidden, bench.kIntermediate, cfg.experts, cfg.top_k, "fp8", torch.bfloat16,
                               torch.device("cpu"), 1, cfg.tokens, use_fp8_dispatch=True)
    dc = _Faulty(problem, one_rank_group, 0)
    dc.fault = fault
    batch = bench.make_batch(cfg, cfg.tokens, 0, torch.device("cpu"))
    if fault == "none":
        assert bench.check_round(ctx, cfg, dc, batch) == 0.0
    else:
        with pytest.raises(AssertionError, match="differs from the reference backend"):
            bench.check_round(ctx, cfg, dc, batch)


@pytest.mark.parametrize("argv,match", [
    (["--tokens", "0"], "--tokens must be a positive int, got 0"),
    (["--latency-tokens", "-3"], "--latency-tokens must be a positive int, got -3"),
    (["--hidden", "200"], "--hidden must be a multiple of 128"),
    (["--topk", "9", "--experts", "8"], "--topk=9 exceeds --experts=8"),
    (["--link-gbps", "0"], "--link-gbps must be positive"),
    (["--transport", "low_latency"], "--transport low_latency writes peer GPU memory: it needs CUDA"),
])
def test_bad_arguments_are_named(argv, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        bench.parse_args(argv + ["--symm-backend", "host"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_gpu_backend_without_cuda_says_so():
    with pytest.raises(ValueError, match="--symm-backend torch needs CUDA"):
        bench.parse_args(["--symm-backend", "torch"])
