"""bench/bench_deepgemm.py without a GPU or DeepGEMM: its cells and its argument checks."""

from __future__ import annotations

import sys

import pytest
from bench_loader import load_bench

bench = load_bench("bench_deepgemm")


def test_cells_cover_every_part():
    specs = bench.cell_specs([64, 128, 4096], list(bench.PARTS))
    counts = {part: sum(s[0] == part for s in specs) for part in bench.PARTS}
    assert counts == {"dense": 21, "contiguous": 4, "masked": 8, "fp4": 8}
    # FP4 cells are decode sizes (the decode layout takes at most 32 tokens per expert).
    assert all(s[2] <= 32 for s in specs if s[0] == "fp4")
    # The bf16 cells run only when named.
    bf16 = bench.cell_specs([64], list(bench.BF16_PARTS))
    assert {part: sum(s[0] == part for s in bf16) for part in bench.BF16_PARTS} == {"bf16_contiguous": 4,
                                                                                  "bf16_masked": 8}


@pytest.mark.parametrize("argv", [["--parts", "dense,bogus"], ["--variant", "NOVALUE"]])
def test_bad_arguments_are_refused(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_deepgemm.py", *argv])
    with pytest.raises(SystemExit) as exc:
        bench.main()
    assert exc.value.code == 2
    assert "bench_deepgemm.py: error" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--theirs-k-major"], ["--mn-scales", "--theirs-k-major", "--parts", "dense"]])
def test_good_arguments_reach_the_device_check(argv, monkeypatch, capsys):
    """Accepted options parse; without a GPU the run stops at the device check (exit 1), not at the
    parser (exit 2)."""
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench_deepgemm.py", *argv])
    assert bench.main() == 1
    assert "needs a CUDA device" in capsys.readouterr().err


def test_k_major_peer_columns_and_means(monkeypatch, capsys):
    """--theirs-k-major with a variant: every row keeps its columns (FP4 rows, which have no K-major
    call, print placeholders), and the K-major means compare DeepGEMM's K-major call with our default
    and with each variant. Cells and timings are stand-ins (no GPU, no DeepGEMM)."""
    import types

    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(__version__="stub", __file__="/stub/x.py"))
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "flush_description", lambda: "L2 flush before every timed run: read (MOE_BENCH_FLUSH)")

    def make_cell(spec):
        return types.SimpleNamespace(part=spec[0], label=f"{spec[0]} {spec[1:]}", ours_mn=None, flops=1e9,
                                     ours_weight_bytes=1e6, theirs_weight_bytes=1e6)

    def measure(cell, variants, mn_scales, write_flush, theirs_k_major=False):
        row = dict(ours_us=10.0, theirs_us=11.0, ours_call_us=20.0, theirs_call_us=30.0, ours_diff=1e-4,
                   theirs_diff=1e-4, variants=[(label, 8.0, 1e-4) for label, _ in variants])
        if theirs_k_major and cell.part != "fp4":
            row.update(theirs_k_us=12.0, theirs_k_diff=1e-4)
        return row

    monkeypatch.setattr(bench, "make_cell", make_cell)
    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(sys, "argv", ["bench_deepgemm.py", "--parts", "dense,fp4", "--ms", "64", "--nk", "2112x7168",
                                      "--warm-workers", "0", "--theirs-k-major", "--variant", "MOE_FP8_SFA_COPY=all"])
    assert bench.main() == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().startswith(("dense (", "fp4 ("))]
    assert len(rows) == 1 + 8 and len({line.count("|") for line in rows}) == 1, rows
    assert "dense, both on K-major A scales (DeepGEMM's transpose counted): geometric mean speed-up over " \
           "DeepGEMM 1.200x" in out
    assert "dense, ours with MOE_FP8_SFA_COPY=all against DeepGEMM on K-major A scales: geometric mean " \
           "speed-up 1.500x" in out


def test_measure_times_every_column_in_one_interleaved_profile(monkeypatch):
    """measure(): every call's own output checked once, with its switches set; then all of them timed
    together (one bench_kineto_interleaved), each timing landing in its own column. Stand-in cell and
    timings (no GPU, no DeepGEMM)."""
    import os
    import types

    import torch

    calls = []

    def call(name):
        return lambda: calls.append((name, os.environ.get("MOE_TEST_SWITCH")))

    cell = types.SimpleNamespace(part="dense", ours=call("ours"), theirs=call("theirs"), ours_mn=call("mn"),
                                 theirs_k=call("theirs_k"), ours_kernel="", theirs_kernel=bench._THEIRS,
                                 ours_out=torch.zeros(2),
                                 theirs_out=torch.zeros(2), check_ours=lambda out: 1e-4, check_theirs=lambda out: 2e-4,
                                 plan=None)
    timed = []

    def interleaved(pairs):
        timed.append([kernel for _, kernel in pairs])
        for fn, _ in pairs:
            fn()
        return [types.SimpleNamespace(median_s=(i + 1) * 1e-6) for i in range(len(pairs))]

    monkeypatch.setattr(bench, "bench_kineto_interleaved", interleaved)
    monkeypatch.setattr(bench, "per_call_us_interleaved", lambda fns: [20.0, 30.0])
    row = bench.measure(cell, [("MOE_TEST_SWITCH=1", {"MOE_TEST_SWITCH": "1"})], mn_scales=True, write_flush=False,
                        theirs_k_major=True)
    checks = [("ours", None), ("theirs", None), ("mn", None), ("mn", "1"), ("theirs_k", None)]
    assert calls == checks + checks  # each checked once, then each timed, the variant with its switch
    assert timed == [["", bench._THEIRS, "", "", ""]]
    assert (row["ours_us"], row["theirs_us"], row["theirs_k_us"]) == pytest.approx((1.0, 2.0, 5.0))
    assert [(label, round(us, 6)) for label, us, _ in row["variants"]] == [("MN-major scales", 3.0),
                                                                         ("MOE_TEST_SWITCH=1", 4.0)]
    assert (row["ours_diff"], row["theirs_diff"], row["theirs_k_diff"]) == (1e-4, 2e-4, 2e-4)
    assert (row["ours_call_us"], row["theirs_call_us"]) == (20.0, 30.0)
    assert "MOE_TEST_SWITCH" not in os.environ


def test_variants_planning_a_repeated_kernel_are_not_timed(monkeypatch, capsys):
    """A variant whose plan is the default's, or an earlier variant's, is neither checked nor timed (its
    kernel would run right after itself), and its column reads "same plan", left out of the means;
    the other columns keep their timings. Stand-in cell, plans and timings (no GPU, no DeepGEMM)."""
    import os
    import types

    import torch

    calls = []

    def call(name):
        return lambda: calls.append((name, os.environ.get("MOE_TEST_SWITCH")))

    cell = types.SimpleNamespace(part="dense", ours=call("ours"), theirs=call("theirs"), ours_mn=call("mn"),
                                 theirs_k=None, ours_kernel="", theirs_kernel=bench._THEIRS, ours_out=torch.zeros(2),
                                 theirs_out=torch.zeros(2),
                                 check_ours=lambda out: 1e-4, check_theirs=lambda out: 2e-4,
                                 plan=lambda mn: {"mn": mn, "switch": os.environ.get("MOE_TEST_SWITCH") == "1"})
    monkeypatch.setattr(bench, "bench_kineto_interleaved",
                        lambda pairs: [types.SimpleNamespace(median_s=(i + 1) * 1e-6) for i in range(len(pairs))])
    monkeypatch.setattr(bench, "per_call_us_interleaved", lambda fns: [20.0, 30.0])
    variants = [("A", {"MOE_TEST_SWITCH": "0"}), ("B", {"MOE_TEST_SWITCH": "1"}),
                ("C", {"MOE_TEST_SWITCH": "1", "MOE_TEST_OTHER": "2"})]
    row = bench.measure(cell, variants, mn_scales=True, write_flush=False)
    assert calls == [("ours", None), ("theirs", None), ("mn", None), ("mn", "1")]
    assert [(label, us and round(us, 6), diff) for label, us, diff in row["variants"]] == [
        ("MN-major scales", 3.0, 1e-4), ("A", None, None), ("B", 4.0, 1e-4), ("C", None, None)]

    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(__version__="stub", __file__="/stub/x.py"))
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "flush_description", lambda: "flush")
    monkeypatch.setattr(bench, "make_cell", lambda spec: types.SimpleNamespace(
        part="dense", label="dense cell", ours_mn=None, flops=1e9, ours_weight_bytes=1e6, theirs_weight_bytes=1e6))
    monkeypatch.setattr(bench, "measure", lambda *args, **kwargs: row)
    monkeypatch.setattr(sys, "argv", ["bench_deepgemm.py", "--parts", "dense", "--ms", "64", "--nk", "2112x7168",
                                      "--warm-workers", "0", "--mn-scales", "--variant", "MOE_TEST_SWITCH=0",
                                      "--variant", "MOE_TEST_SWITCH=1", "--variant",
                                      "MOE_TEST_SWITCH=1,MOE_TEST_OTHER=2"])
    assert bench.main() == 0
    out = capsys.readouterr().out
    header, line = [s for s in out.splitlines() if s.strip().startswith(("cell", "dense cell"))]
    assert line.count("same plan") == 2 and line.count("|") == header.count("|"), (header, line)
