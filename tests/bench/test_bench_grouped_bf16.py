"""bench/bench_grouped_bf16.py's problems, built on CPU at small sizes: ours and the torch peer write
the same rows, the diff check reads them, and the flop and weight-byte counts follow the shapes."""

from __future__ import annotations

import pytest
import torch
from bench_loader import load_bench

if not hasattr(torch, "_grouped_mm"):
    pytest.skip("this torch has no torch._grouped_mm (the benchmark's peer)", allow_module_level=True)
bench = load_bench("bench_grouped_bf16")


@pytest.mark.parametrize("masked", [False, True])
def test_problems_match_their_peer(masked, seed):
    groups, rows, n, k = 3, 16, 64, 128
    make = bench.make_masked if masked else bench.make_contiguous
    problem = make(groups, rows, n, k, device="cpu")
    problem.out.fill_(float("nan"))
    problem.peer_out[0].fill_(float("nan"))
    problem.call()
    problem.peer()
    for out in (problem.out, problem.peer_out[0]):
        assert torch.isfinite(out).all()
        assert bench.sample_diff(problem, out) < 1e-5
    assert problem.flops == 2 * groups * rows * n * k and problem.weight_bytes == 2 * groups * n * k


def test_sample_diff_sees_a_wrong_group(seed):
    problem = bench.make_contiguous(2, 8, 64, 128, device="cpu")
    problem.call()
    problem.out[8:] = 0
    assert bench.sample_diff(problem, problem.out) > 0.5
