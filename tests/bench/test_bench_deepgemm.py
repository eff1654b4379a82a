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
    monkeypatch.setattr(bench, "flush_mode", lambda: "read")

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
