"""Profile forwards of bench/bench_moe.py's staged DeepSeek-V3 layer (torch profiler): the CPU ops and
CUDA kernels that take the time, largest first. ``--python``: instead, the host's Python functions
(cProfile over 200 forwards, no synchronisation between them) by own and by cumulative time, and the
host microseconds per forward without the profiler.

    python scripts/profile_moe_forward.py [--tokens 1] [--weights fp4] [--local-experts 256] [--python]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

kRepo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [kRepo, os.path.join(kRepo, "bench")]

import torch  # noqa: E402

from bench_moe import deepseek_router, kHidden, kIntermediate, kTopK, make_weights  # noqa: E402
from moe_runtime import MegaMoELayer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--weights", choices=["fp8", "fp4"], default="fp4")
    p.add_argument("--local-experts", type=int, default=256)
    p.add_argument("--rows", type=int, default=25, help="rows of each table")
    p.add_argument("--python", action="store_true", help="cProfile of the host's Python instead")
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    weights = make_weights(args.local_experts, device)
    layer = MegaMoELayer(kHidden, kIntermediate, args.local_experts, kTopK, router=deepseek_router(),
                         weights=args.weights, backend="staged", num_max_tokens_per_rank=max(args.tokens, 1),
                         device=device)
    layer.load_weights(router_weight=weights.router, gate_up=weights.gate_up, down=weights.down,
                       score_bias=weights.bias)
    x = torch.randn(args.tokens, kHidden, device=device).to(torch.bfloat16)
    with torch.inference_mode():
        for _ in range(3):
            layer(x)
        torch.cuda.synchronize()
        if args.python:
            python_profile(layer, x, args.rows)
            return
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                layer(x)
            torch.cuda.synchronize()
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows))


def python_profile(layer, x, rows: int, forwards: int = 200) -> None:
    """Host us per forward (perf_counter, rounds of 20 from an idle GPU, median), then cProfile."""
    samples = []
    for _ in range(11):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            layer(x)
        samples.append((time.perf_counter() - start) / 20 * 1e6)
    torch.cuda.synchronize()
    print(f"host us per forward: median {sorted(samples)[5]:.1f} (min {min(samples):.1f}), {x.shape[0]} tokens")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(forwards):
        layer(x)
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    print(f"cProfile over {forwards} forwards (its own overhead included)")
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)


if __name__ == "__main__":
    main()
