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


@pytest.mark.skipif(bench.torch.cuda.is_available(), reason="checks the CPU machine's exit")
@pytest.mark.parametrize("argv", [["--theirs-k-major"], ["--mn-scales", "--theirs-k-major", "--parts", "dense"]])
def test_good_arguments_reach_the_device_check(argv, monkeypatch, capsys):
    """Accepted options parse; without a GPU the run stops at the device check (exit 1), not at the
    parser (exit 2)."""
    monkeypatch.setattr(sys, "argv", ["bench_deepgemm.py", *argv])
    assert bench.main() == 1
    assert "needs a CUDA device" in capsys.readouterr().err
