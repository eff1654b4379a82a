"""scripts/sass_census.py: its K-loop filter on a hand-written disassembly, and one row compiled
here (NVRTC, cuobjdump; no GPU) with and without an environment variant."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from kernels.jit import find_cuobjdump

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "sass_census.py"
_spec = importlib.util.spec_from_file_location("sass_census", _PATH)
sass_census = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_census)


def _line(address: int, text: str) -> str:
    return f"        /*{address:04x}*/                   {text} ;"


def test_k_loops_keep_loops_of_whole_k_blocks_only():
    k_block = [*["QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24"] * 4, *["FFMA R1, R2, R3, R1"] * 32]
    loop = [_line(0x100 + 16 * i, op) for i, op in enumerate(k_block * 2 + ["@P0 BRA 0x0100"])]
    # A barrier wait's retry at the end of the code branching back over a loop: one K block's QGMMAs
    # with another count of FFMAs, left out.
    retry = [_line(0x2000, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2"), _line(0x2010, "@!P0 BRA 0x0100")]
    assert sass_census.k_loops("\n".join(loop + retry), 64) == [(len(loop), 2)]
    assert sass_census.k_loops("\n".join(loop), 128) == []


def test_row_compares_the_variant_with_the_default(monkeypatch):
    if not find_cuobjdump():
        pytest.skip("cuobjdump not found (pip nvidia-cuda-cuobjdump)")
    monkeypatch.setenv("MOE_GEMM_BLOCK_N", "0")
    monkeypatch.setenv("MOE_FP8_SCALE_TABLE", "0")  # 64 x 32 tiles of one wave would take the table
    row = sass_census.row(64, 2112, 7168, {"MOE_GEMM_BLOCK_N": "32"})
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:3] == ["64 x 2112 x 7168", "64 x 16, gather", "64 x 32, gather"]
    assert cells[6:] == ["True / True", "False / False"]
    assert os.environ["MOE_GEMM_BLOCK_N"] == "0", "the variant's environment is undone"
