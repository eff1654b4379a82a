"""bench/bench_grouped.py's problems (the ones it times and scripts/grouped_once.py profiles), built
on CPU at small sizes: each call writes every valid row, and the weight bytes follow the formats."""

from __future__ import annotations

import os

import pytest
import torch
from bench_loader import load_bench

from kernels.testing import env_call

bench = load_bench("bench_grouped")


@pytest.mark.parametrize("weights", ["fp8", "fp4"])
def test_problems_run_and_count_their_bytes(weights, seed):
    groups, rows, n, k = 3, 16, 128, 256
    contiguous = bench.make_contiguous(weights, groups, rows, n, k, device="cpu")
    masked = bench.make_masked(weights, groups, 5, n, k, device="cpu")
    fp8_bytes = groups * n * k + groups * 1 * 2 * 4
    fp4_bytes = groups * (n * k // 2 + n * k // 32)
    for problem in (contiguous, masked):
        assert problem.weight_bytes == (fp8_bytes if weights == "fp8" else fp4_bytes)
        # Every kernel of the call: large contiguous FP8 calls copy A's scales first, staged FP4 calls
        # cast the weights first.
        assert problem.kernel == ""
        problem.call()
    assert contiguous.flops == 2 * groups * rows * n * k and masked.flops == 2 * groups * 5 * n * k


@pytest.mark.parametrize("weights", ["fp8", "fp4"])
def test_problem_outputs_are_written(weights):
    contiguous = bench.make_contiguous(weights, 2, 8, 64, 128, device="cpu")
    masked = bench.make_masked(weights, 2, 3, 64, 128, device="cpu")
    for problem in (contiguous, masked):
        problem.out.fill_(float("nan"))
        problem.call()
    assert torch.isfinite(contiguous.out).all() and torch.isfinite(masked.out[:, :3]).all()


@pytest.mark.parametrize("weights", ["fp8", "fp4"])
def test_sample_diff_checks_first_and_last_group(weights, seed):
    """The benchmark's correctness column: small against the dequantized operands, large when a
    group's output is wrong."""
    for problem in (bench.make_contiguous(weights, 3, 16, 128, 256, device="cpu"),
                    bench.make_masked(weights, 3, 5, 128, 256, device="cpu")):
        problem.call()
        assert bench.sample_diff(problem) < 2e-3
        last = problem.out[2, :5] if problem.masked else problem.out[32:48]
        last.mul_(-1)
        assert bench.sample_diff(problem) > 0.5


def test_fp8_weights_quantized_in_chunks_and_slots_of_max_m(seed):
    """FP8 weights are quantized 32 experts at a time: the last group (second chunk) is as right as
    the first; masked slots take max_m rows."""
    problem = bench.make_masked("fp8", 40, 3, 128, 256, device="cpu", max_m=8)
    assert problem.out.shape == (40, 8, 128) and problem.a[0].shape == (40, 8, 256)
    assert problem.b[1].shape == (40, 1, 2) and bool((problem.b[1] > 0).all())
    problem.call()
    assert bench.sample_diff(problem) < 1e-3


class _FakeTiming:
    def __init__(self, us):
        self.median_s = us * 1e-6


def _fake_interleaved(timed):
    """bench_kineto_interleaved's stand-in: runs each call once and times it 150 µs where it is a
    fake variant's (made by _tagged_env_call with MOE_FAKE_VARIANT), else 100 µs; records the
    kernel names it was given."""
    def interleaved(calls):
        timed.append([kernel for _, kernel in calls])
        for fn, _ in calls:
            fn()
        return [_FakeTiming(150 if getattr(fn, "env", {}).get("MOE_FAKE_VARIANT") else 100) for fn, _ in calls]
    return interleaved


def _tagged_env_call(fn, **env):
    """env_call (which sets the switches during the call: test_testing_bench.py), tagged with them."""
    call = env_call(fn, **env)
    call.env = env
    return call


def test_contiguous_variants_are_timed_beside_the_default(monkeypatch, seed):
    """A contiguous row's variants are timed in one interleaved profile with the default (each ratio
    over the default of that profile) and each variant's own output is checked, with its switch set.
    Timings are faked (a variant costing 1.5x), the problem runs on CPU."""
    timed = []
    monkeypatch.setattr(bench, "bench_kineto", lambda fn, kernel_name, **_: _FakeTiming(100))
    monkeypatch.setattr(bench, "bench_kineto_interleaved", _fake_interleaved(timed))
    monkeypatch.setattr(bench, "env_call", _tagged_env_call)
    monkeypatch.setattr(bench, "per_call_us", lambda fn: 1.0)
    monkeypatch.setattr(bench.kernels, "get_num_sms", lambda *a: 132)  # the config query, no GPU here
    real = bench.make_contiguous
    monkeypatch.setattr(bench, "make_contiguous", lambda *a, **kw: real(*a, **kw, device="cpu"))
    checks = []
    real_check = bench.output_check

    def output_check(problem):
        check = real_check(problem)

        def spy(out):
            checks.append(os.environ.get("MOE_FAKE_VARIANT"))
            return check(out)
        return spy

    monkeypatch.setattr(bench, "output_check", output_check)
    row = bench.contiguous("fp8", 2, 128, 128, 256, variants=[("fake", {"MOE_FAKE_VARIANT": "1"})] * 2)
    (_, us0, diff0, base0), (_, us1, diff1, base1) = row["variants"]
    assert diff0 < 1e-3 and diff1 < 1e-3
    assert us0 / base0 == pytest.approx(1.5) and us1 / base1 == pytest.approx(1.5) and base0 == base1 == pytest.approx(100)
    assert timed == [["", "", ""]]  # one profile: the default and both variants, every kernel of a call
    assert "MOE_FAKE_VARIANT" not in os.environ


def test_contiguous_mn_major_scales_run_beside_the_default(monkeypatch, seed):
    """--sfa-mn-major: the contiguous row also runs the same problem on MN-major TMA-aligned A scales,
    timed beside the default like a variant, its output checked (CPU here, timings faked)."""
    timed = []
    monkeypatch.setattr(bench, "bench_kineto", lambda fn, kernel_name, **_: _FakeTiming(100))
    monkeypatch.setattr(bench, "bench_kineto_interleaved", _fake_interleaved(timed))
    monkeypatch.setattr(bench, "env_call", _tagged_env_call)
    monkeypatch.setattr(bench, "per_call_us", lambda fn: 1.0)
    monkeypatch.setattr(bench.kernels, "get_num_sms", lambda *a: 132)
    real = bench.make_contiguous
    monkeypatch.setattr(bench, "make_contiguous", lambda *a, **kw: real(*a, **kw, device="cpu"))
    seen = []
    real_call = bench.mn_major_call

    def spy(problem, groups, rows):
        call = real_call(problem, groups, rows)
        seen.append(problem)
        return call

    monkeypatch.setattr(bench, "mn_major_call", spy)
    row = bench.contiguous("fp8", 2, 128, 128, 256, mn_major=True)
    [(label, us, diff, base)] = row["variants"]
    assert label == "MN-major A scales" and diff < 1e-3 and us / base == pytest.approx(1.0)
    mn = bench.kernels.get_mn_major_tma_aligned_tensor(seen[0].a[1])
    assert mn.stride(0) == 1 and torch.equal(mn, seen[0].a[1])


def test_aligned_call_declares_the_alignment_for_its_call_only():
    """The 256-aligned column is interleaved with the others: its alignment holds while it runs and
    the one in force before comes back, also when the call raises."""
    import kernels

    seen = []
    call = bench.aligned_call(lambda: seen.append(kernels.get_mk_alignment_for_contiguous_layout()), 256)
    before = kernels.get_mk_alignment_for_contiguous_layout()
    call()
    assert seen == [256] and kernels.get_mk_alignment_for_contiguous_layout() == before

    def fails():
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        bench.aligned_call(fails, 256)()
    assert kernels.get_mk_alignment_for_contiguous_layout() == before
