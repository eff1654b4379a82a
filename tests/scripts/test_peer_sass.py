"""scripts/peer_sass.py's pieces that need neither DeepGEMM nor a compiler: the instantiation it
writes and its K-loop census on a hand-written disassembly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "peer_sass.py"
_spec = importlib.util.spec_from_file_location("peer_sass", _PATH)
peer_sass = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_sass)


def test_peer_code_instantiates_the_kernel_with_its_template_order():
    code = peer_sass.peer_code(0, 4096, 7168, 4, 1, "128, 192, 128, 128, 128, 128, 4, 128, 256, 2, false", 132)
    assert "sm90_fp8_gemm_1d2d_impl<" in code
    assert "cute::UMMA::Major::K, 0, 4096, 7168, 4, 128, 192, 128, 128, 128, 128, 4, 128, 256, 2, false, 132," in code
    assert "deep_gemm::GemmType::MGroupedContiguous, cutlass::bfloat16_t" in code
    assert code.index("cudaGridDependencySynchronize") < code.index("#include <deep_gemm/")


def _line(address: int, text: str) -> str:
    return f"        /*{address:04x}*/                   {text} ;"


def test_k_loop_mix_counts_per_k_block_and_skips_tile_loops():
    ops = ["SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2", *["QGMMA.64x192x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ"] * 4,
           "WARPGROUP.DEPBAR.LE gsb0, 0x0", *["FFMA R1, R2, R3, R1"] * 96, "@P0 BRA 0x0100"]
    loop = [_line(0x100 + 16 * i, op) for i, op in enumerate(ops)]
    # A tile loop around it with an epilogue conversion: not a K loop.
    tile = [_line(0x40, "F2FP.BF16.F32.PACK_AB R0, R1, R2")] + loop + [_line(0x100 + 16 * len(ops), "@P1 BRA 0x0040")]
    loops = peer_sass.k_loop_mix("\n".join(tile))
    assert len(loops) == 1
    count, k_blocks, mix = loops[0]
    assert (count, k_blocks, mix["FFMA"], mix["QGMMA"]) == (len(ops), 1, 96, 4)


def test_k_loop_mix_skips_a_tile_loop_whose_k_loop_was_unrolled_whole():
    # No inner branch: the tile loop is innermost, and its epilogue's conversion marks it.
    ops = [*["QGMMA.64x192x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ"] * 8, *["FFMA R1, R2, R3, R1"] * 192,
           "F2FP.BF16.F32.PACK_AB R0, R1, R2", "UTMASTG.2D [UR4], [UR6]", "@P1 BRA 0x0100"]
    assert peer_sass.k_loop_mix("\n".join(_line(0x100 + 16 * i, op) for i, op in enumerate(ops))) == []
