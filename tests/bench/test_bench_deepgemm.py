"""bench/bench_deepgemm.py without a GPU or DeepGEMM: its cells and its argument checks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

kRepo = Path(__file__).resolve().parents[2]


def _load_bench():
    sys.path.insert(0, str(kRepo / "bench"))  # it imports bench_gemm and bench_grouped by name
    spec = importlib.util.spec_from_file_location("bench_deepgemm", kRepo / "bench" / "bench_deepgemm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_deepgemm"] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


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
