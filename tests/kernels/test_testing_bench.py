"""kernels.testing.bench helpers that need no GPU: the benchmarks' --variant parsing and the
environment switches they time variants under."""

import os

import pytest

from kernels.testing import env_switches, parse_env_variants


def test_parse_env_variants_pairs_and_labels():
    assert parse_env_variants([]) == []
    assert parse_env_variants(["MOE_GEMM_BLOCK_N=192", "A=1,B=x=y"]) == [
        ("MOE_GEMM_BLOCK_N=192", {"MOE_GEMM_BLOCK_N": "192"}), ("A=1,B=x=y", {"A": "1", "B": "x=y"})]


@pytest.mark.parametrize("bad", ["MOE_GEMM_BLOCK_N", "=1", "A=1,", "A=1,B"])
def test_parse_env_variants_rejects_malformed(bad):
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_env_variants([bad])


def test_env_switches_restore(monkeypatch):
    monkeypatch.setenv("MOE_TEST_SWITCH_SET", "before")
    monkeypatch.delenv("MOE_TEST_SWITCH_UNSET", raising=False)
    with env_switches(MOE_TEST_SWITCH_SET="inside", MOE_TEST_SWITCH_UNSET="1"):
        assert os.environ["MOE_TEST_SWITCH_SET"] == "inside" and os.environ["MOE_TEST_SWITCH_UNSET"] == "1"
    assert os.environ["MOE_TEST_SWITCH_SET"] == "before" and "MOE_TEST_SWITCH_UNSET" not in os.environ


def test_flush_mode_reads_the_switch(monkeypatch):
    from kernels.testing import flush_mode

    monkeypatch.delenv("MOE_BENCH_FLUSH", raising=False)
    assert flush_mode() == "read"
    monkeypatch.setenv("MOE_BENCH_FLUSH", "write")
    assert flush_mode() == "write"
    monkeypatch.setenv("MOE_BENCH_FLUSH", "zero")
    with pytest.raises(ValueError, match="MOE_BENCH_FLUSH: expected one of read, write, got 'zero'"):
        flush_mode()


def test_gap_us_reads_the_switch(monkeypatch):
    from kernels.testing.bench import gap_us

    monkeypatch.delenv("MOE_BENCH_GAP_US", raising=False)
    assert gap_us() == 0
    monkeypatch.setenv("MOE_BENCH_GAP_US", "40")
    assert gap_us() == 40
    for bad in ("-5", "2.5", "soon"):
        monkeypatch.setenv("MOE_BENCH_GAP_US", bad)
        with pytest.raises(ValueError, match=f"MOE_BENCH_GAP_US: expected an integer number of microseconds >= 0, "
                                             f"got '{bad}'"):
            gap_us()


def _profile(runs, flush=("sum_kernel",)):
    """A profile's (name, start, duration) kernels, one after the other with a 1 µs gap: per run the
    flush's kernels (duration 100), then the run's (name, duration) pairs."""
    events, t = [], 0.0
    for run in runs:
        for name in flush:
            events.append((name, t, 100.0))
            t += 101
        for name, dur in run:
            events.append((name, t, dur))
            t += dur + 1
    return events


def test_per_run_seconds_sums_matching_kernels_and_drops_the_flush():
    from kernels.testing.bench import per_run_seconds

    runs = [[("gemm_a", 2.0), ("other", 50.0), ("gemm_b", 3.0)], [("gemm_a", 4.0), ("other", 50.0), ("gemm_b", 1.0)]]
    times, per_run = per_run_seconds(_profile(runs), "gemm", 2, ["sum_kernel"])
    assert per_run == 2 and times == pytest.approx([5e-6, 5e-6])
    # "" counts every kernel of the run, never the flush's.
    times, per_run = per_run_seconds(_profile(runs), "", 2, ["sum_kernel"])
    assert per_run == 3 and times == pytest.approx([55e-6, 55e-6])
    # Without a flush nothing is dropped.
    times, _ = per_run_seconds(_profile(runs, flush=()), "", 2, [])
    assert times == pytest.approx([55e-6, 55e-6])


def test_per_run_seconds_counts_overlapping_kernels_once():
    """A copy kernel, then a GEMM launched with PDL that starts 2 µs before the copy ends: the run
    took the union of their spans, not the sum of their durations."""
    from kernels.testing.bench import busy_seconds, per_run_seconds

    profile = [("sum_kernel", 0.0, 100.0), ("copy", 101.0, 3.0), ("gemm", 102.0, 10.0),
               ("sum_kernel", 200.0, 100.0), ("copy", 301.0, 3.0), ("gemm", 305.0, 10.0)]
    times, per_run = per_run_seconds(profile, "", 2, ["sum_kernel"])
    assert per_run == 2 and times == pytest.approx([11e-6, 13e-6])
    assert busy_seconds([(0.0, 5.0), (1.0, 2.0), (10.0, 1.0)]) == pytest.approx(6e-6)  # one inside another
    assert busy_seconds([]) == 0.0


def test_per_run_seconds_keeps_a_runs_kernels_named_like_one_of_the_flushs():
    """The flush (a memset, then the sum) splits the runs; a run's own memset is its time."""
    from kernels.testing.bench import per_run_seconds

    flush = ("memset", "sum_kernel")
    runs = [[("memset", 1.0), ("gemm", 2.0)], [("memset", 1.0), ("gemm", 4.0)]]
    times, per_run = per_run_seconds(_profile(runs, flush), "", 2, list(flush))
    assert per_run == 2 and times == pytest.approx([3e-6, 5e-6])
    times, per_run = per_run_seconds(_profile(runs, flush), "gemm", 2, list(flush))
    assert per_run == 1 and times == pytest.approx([2e-6, 4e-6])


def test_per_run_seconds_refuses_what_does_not_add_up():
    from kernels.testing.bench import per_run_seconds

    # The timed function launches the flush's whole sequence: the runs cannot be told apart.
    runs = [[("gemm", 2.0), ("sum_kernel", 9.0)], [("gemm", 2.0), ("sum_kernel", 9.0)]]
    with pytest.raises(RuntimeError, match="splits into 4 runs .* expected 2: does the timed function launch"):
        per_run_seconds(_profile(runs), "gemm", 2, ["sum_kernel"])
    # A profile that does not start with the flush.
    with pytest.raises(RuntimeError, match="expected the L2 flush's kernels"):
        per_run_seconds([("gemm", 0.0, 1.0)] + _profile([[("gemm", 1.0)]]), "gemm", 1, ["sum_kernel"])
    # A run without its kernel, and no match at all.
    with pytest.raises(RuntimeError, match=r"matching 'gemm' per run: \[2, 1\]"):
        per_run_seconds(_profile([[("gemm", 1.0), ("gemm", 1.0)], [("gemm", 1.0)]]), "gemm", 2, ["sum_kernel"])
    with pytest.raises(RuntimeError, match=r"matching 'gemm' per run: \[0, 0\]"):
        per_run_seconds(_profile([[("x", 1.0)], [("x", 1.0)]]), "gemm", 2, ["sum_kernel"])
    # Without a flush the matching kernels must divide into the runs.
    with pytest.raises(RuntimeError, match="per run: none"):
        per_run_seconds(_profile([[("gemm", 1.0), ("gemm", 1.0)], [("gemm", 1.0)]], flush=()), "gemm", 2, [])


def test_interleaved_run_seconds_gives_each_call_its_own_runs():
    """Runs of two calls interleaved (A B, B A, A B): each call's seconds from its own runs, in order,
    with its own kernel name ("" = all of the run's), the PDL overlap of a copy counted once."""
    from kernels.testing.bench import interleaved_run_seconds

    runs = [[("copy", 3.0), ("gemm", 10.0)], [("deep_gemm", 7.0)], [("deep_gemm", 8.0)],
            [("copy", 3.0), ("gemm", 12.0)], [("copy", 2.0), ("gemm", 11.0)], [("deep_gemm", 9.0)]]
    profile = _profile(runs)
    profile[2] = ("gemm", profile[1][1] + 2.0, 10.0)  # starts 1 µs before the copy ends
    seconds, counts = interleaved_run_seconds(profile, ["", "deep_gemm"], [0, 1, 1, 0, 0, 1], ["sum_kernel"])
    assert counts == [2, 1]
    assert seconds[0] == pytest.approx([12e-6, 15e-6, 13e-6])  # gaps between kernels not counted
    assert seconds[1] == pytest.approx([7e-6, 8e-6, 9e-6])


def test_interleaved_run_seconds_refuses_what_does_not_add_up():
    from kernels.testing.bench import interleaved_run_seconds

    runs = [[("gemm", 1.0)], [("other", 1.0)], [("gemm", 1.0), ("gemm", 1.0)], [("other", 1.0)]]
    with pytest.raises(RuntimeError, match=r"call 0 \('gemm'\) matched 2 kernels in one run, 1 in its first"):
        interleaved_run_seconds(_profile(runs), ["gemm", "other"], [0, 1, 0, 1], ["sum_kernel"])
    with pytest.raises(RuntimeError, match=r"call 1 \('gemm'\) matched 0"):
        interleaved_run_seconds(_profile(runs), ["gemm", "gemm"], [0, 1, 0, 1], ["sum_kernel"])
    with pytest.raises(RuntimeError, match="splits into 4 runs .* expected 3"):
        interleaved_run_seconds(_profile(runs), ["gemm", "other"], [0, 1, 0], ["sum_kernel"])
    with pytest.raises(ValueError, match="split at the L2 flush"):
        interleaved_run_seconds(_profile(runs, flush=()), ["gemm"], [0, 0, 0, 0], [])


def test_env_call_sets_the_switches_for_the_call_only(monkeypatch):
    from kernels.testing import env_call

    monkeypatch.delenv("MOE_TEST_SWITCH", raising=False)
    seen = []
    call = env_call(lambda: seen.append(os.environ.get("MOE_TEST_SWITCH")), MOE_TEST_SWITCH="1")
    call()
    assert seen == ["1"] and "MOE_TEST_SWITCH" not in os.environ


def test_per_call_us_interleaved_takes_turns_and_keeps_each_calls_samples(monkeypatch):
    """Each round calls every function once, the order rotated round by round, and each median is
    made of its own function's samples (a fake device clock: call i costs i + 1 us, and the first
    call of a round 10 us more, so a fixed order would charge one function every round's first)."""
    import torch

    import kernels.testing.bench as bench_helpers

    clock = {"us": 0.0, "calls_this_round": 0}
    order = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.at = 0.0

        def record(self):
            self.at = clock["us"]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return (other.at - self.at) / 1e3  # milliseconds

    def call(i):
        def fn():
            order.append(i)
            clock["us"] += (i + 1) + (10.0 if clock["calls_this_round"] == 0 else 0.0)
            clock["calls_this_round"] = (clock["calls_this_round"] + 1) % 3
        return fn

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    medians = bench_helpers.per_call_us_interleaved([call(0), call(1), call(2)], iters=9, warmup=1)
    timed = order[3:]
    rounds = [timed[r * 3:(r + 1) * 3] for r in range(9)]
    assert all(sorted(r) == [0, 1, 2] for r in rounds)
    assert [r[0] for r in rounds[:3]] == [0, 1, 2], "the first call of a round rotates"
    # Each function was first in 3 of its 9 rounds: its median is its own cost.
    assert medians == pytest.approx([1.0, 2.0, 3.0])


@pytest.mark.gpu
def test_gpu_bench_kineto_interleaved_times_each_call_from_one_profile():
    """On a GPU: two calls of different lengths, interleaved in one profile, each timed from its own
    runs (one kernel each; the longer call's median the longer), the flush's kernels never counted."""
    import torch

    from kernels.testing import bench_kineto_interleaved

    short = torch.ones(1 << 10, device="cuda")
    long = torch.ones(1 << 26, device="cuda")
    timings = bench_kineto_interleaved([(lambda: short.mul_(1.0), ""), (lambda: long.mul_(1.0), "")], rounds=10)
    assert [t.num_runs for t in timings] == [10, 10]
    assert [t.kernels_per_run for t in timings] == [1, 1]
    assert 0 < timings[0].median_s < timings[1].median_s


def test_repeated_plans_flags_a_variant_planning_a_kernel_already_seen(monkeypatch):
    """A variant repeats when its plan (under its switches) is the default's or an earlier variant's;
    the switches are gone afterwards."""
    from kernels.testing import repeated_plans

    monkeypatch.delenv("MOE_TEST_BAND", raising=False)
    plan = lambda: {"band": int(os.environ.get("MOE_TEST_BAND", "8"))}  # noqa: E731
    variants = [("8", {"MOE_TEST_BAND": "8"}), ("1", {"MOE_TEST_BAND": "1"}), ("1 again", {"MOE_TEST_BAND": "1"}),
                ("4", {"MOE_TEST_BAND": "4"})]
    assert repeated_plans(plan, variants) == [True, False, True, False]
    assert "MOE_TEST_BAND" not in os.environ
    assert repeated_plans(plan, []) == []
