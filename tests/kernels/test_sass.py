"""The machine code of every kernel family uses the Hopper instructions it was written for
(compiled here for sm_90a with NVRTC, disassembled with cuobjdump; no GPU needed)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

import kernels
from kernels.jit import find_cuobjdump

H200_SMS = 132
_DTYPE_BF16 = 1


def sass(name: str, code: str) -> str:
    tool = find_cuobjdump()
    if not tool:
        pytest.skip("cuobjdump not found (pip nvidia-cuda-cuobjdump)")
    built = kernels.jit.build(name, code, "sm_90a")
    # No kernel here may leave ptxas serializing its wgmmas (a wait after each: the tensor cores idle).
    assert not built.wgmma_serialized, f"{name}: ptxas serialized the wgmmas (see the C751x remark)"
    cubin = built.cubin_path
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(tool).parent), env.get("PATH", "")])  # nvdisasm sits beside it
    proc = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, env=env, timeout=120)
    if "nvdisasm" in proc.stderr:
        pytest.skip("nvdisasm not found (pip nvidia-cuda-nvdisasm)")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def _k_loop_bodies(code: str, max_bytes: int = 4096) -> list[str]:
    """The instructions of every backward branch's body (target..branch) that is at most
    ``max_bytes`` long, one per line: the K loops and their retry loops."""
    ops = [(int(m.group(1), 16), m.group(2).strip()) for m in _SASS_LINE.finditer(code)]
    bodies = []
    for address, text in ops:
        branch = re.search(r"\bBRA (?:\S+ )?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address and address - int(branch.group(1), 16) <= max_bytes:
            target = int(branch.group(1), 16)
            bodies.append("\n".join(t for a, t in ops if target <= a <= address))
    return bodies


def _innermost_k_loops(code: str, max_bytes: int) -> list[str]:
    """The K loops among the loop bodies: those with wgmmas that hold no other such body (a tile
    loop whose code is short enough also falls under max_bytes)."""
    bodies = [body for body in _k_loop_bodies(code, max_bytes) if "QGMMA" in body]
    return [body for body in bodies if not any(other != body and other in body for other in bodies)]


GEMM_VARIANTS = [  # (m, n, k, gemm type, groups): dense decode/prefill, grouped contiguous, masked
    (64, 2112, 7168, 0, 1), (4096, 7168, 2048, 0, 1), (8192, 4096, 7168, 1, 4), (16, 7168, 2048, 2, 32),
]


@pytest.mark.parametrize("scale_load", [0, 1, 2], ids=["gather", "tma_mn_major", "tma_k_major"])
@pytest.mark.parametrize("m,n,k,gemm_type,groups", GEMM_VARIANTS)
def test_fp8_gemm_uses_qgmma_tma_and_setmaxnreg(m, n, k, gemm_type, groups, scale_load):
    native = kernels.jit.native_module()
    args = (m, n, k, H200_SMS, False, -1, gemm_type, groups)
    config = native.fp8_gemm_nt_config(*args, scale_load=scale_load)
    code = sass(*native.fp8_gemm_nt_code(*args, scale_load=scale_load))
    for instruction in ("QGMMA", "UTMALDG", "UTMASTG", "USETMAXREG"):
        assert instruction in code, instruction
    # Only the scale warps copy with cp.async (LDGSTS); TMA scale loads leave none. K-major scales
    # go by TMA on 256-row tiles only, masked GEMMs' never; dense 256-row tiles and contiguous
    # layouts of 4096 rows or more (N >= 4096) run on a copy of the A scales made MN-major
    # (sfa_copy), so their kernel is the MN-major one.
    gathered = gemm_type == 2 or (scale_load == 2 and config["block_m"] < 256)
    assert config["scale_load"] == ("gather" if gathered else ("gather", "tma_mn_major", "tma_k_major")[scale_load])
    copied = (gemm_type == 0 and config["block_m"] == 256) or (gemm_type == 1 and m >= 4096 and n >= 4096)
    assert config["sfa_copy"] == (copied and scale_load != 1)
    runs = "tma_mn_major" if config["sfa_copy"] else config["scale_load"]
    assert ("LDGSTS" in code) == (runs == "gather")
    # The scale warps keep 32-bit row offsets per tile: no spills at block M 128 either (they had
    # spilled hoisted 64-bit row pointers inside their K loop).
    assert "LDL" not in code and "STL" not in code, "register spills"


@pytest.mark.parametrize("m,n,k,gemm_type,groups", [(300, 2112, 7168, 0, 1), (1000, 7168, 1536, 0, 1),
                                                     (32768, 4096, 7168, 1, 4), (3712, 4096, 1152, 1, 4)])
def test_fp8_gemm_clusters_sharing_b_multicast_b(m, n, k, gemm_type, groups, monkeypatch):
    """MOE_FP8_MULTICAST=b: the TMA warp multicasts half of B (UTMALDG ... MULTICAST) beside plain
    loads (A; a contiguous pair straddling two groups loads B plainly too), and nothing spills.
    (Dense 128 x 192 tiles unrolled 8 times in 2-CTA clusters of either kind, e.g. 4096 x 2112 x
    7168, keep one scheduler value in local memory at tile boundaries: not among these cases.)"""
    monkeypatch.setenv("MOE_FP8_MULTICAST", "b")
    native = kernels.jit.native_module()
    args = (m, n, k, H200_SMS, False, -1, gemm_type, groups)
    assert native.fp8_gemm_nt_config(*args)["share_b"] == 1
    code = sass(*native.fp8_gemm_nt_code(*args))
    for instruction in ("QGMMA", "UTMASTG", "USETMAXREG"):
        assert instruction in code, instruction
    loads = [line for line in code.splitlines() if "UTMALDG" in line]
    assert any("MULTICAST" in line for line in loads) and any("MULTICAST" not in line for line in loads)
    assert "LDL" not in code and "STL" not in code, "register spills"


@pytest.mark.parametrize("pingpong,max_ops", [("0", 128), ("1", 140)])
def test_fp8_gemm_math_loop_is_lean(pingpong, max_ops, monkeypatch):
    """4096 x 4096 x 7168 (block 128 x 128): the warpgroup index broadcast from lane 0 keeps the
    wgmma descriptors in uniform registers (the four QGMMAs issue back to back, no R2UR between
    them), and the math loop stays at 64 FFMAs plus under 64 other instructions per K block. The
    ping-pong adds the turn's two barriers, and ptxas then recomputes the barrier ids and the
    warpgroup's scale rows from the uniform warpgroup index in every K block (137 in all)."""
    monkeypatch.setenv("MOE_FP8_PINGPONG", pingpong)
    monkeypatch.setenv("MOE_GEMM_BLOCK_N", "128")
    code = sass(*kernels.jit.native_module().fp8_gemm_nt_code(4096, 4096, 7168, H200_SMS, False, -1, 0, 1))
    loops = [body for body in _k_loop_bodies(code) if "QGMMA" in body]
    assert loops
    for body in loops:
        ops = [line for line in body.splitlines() if line.strip()]
        qgmma = [i for i, line in enumerate(ops) if "QGMMA" in line]
        assert len(qgmma) == 4
        assert not any("R2UR" in line for line in ops[qgmma[0]:qgmma[-1]]), "descriptors moved into uniform registers per wgmma"
        assert sum("FFMA" in line for line in ops) == 64
        assert len(ops) < max_ops, f"{len(ops)} instructions per K block"


@pytest.mark.parametrize("n,k,multicast,c_dtype", [(4096, 7168, "0", -1), (4096, 7168, "2", -1),
                                                   (7168, 2048, "2", 1), (4616, 7168, "2", 0), (2112, 7168, "0", 0)])
def test_fp8_gemm_256_row_tiles_run_two_waves(n, k, multicast, c_dtype, monkeypatch):
    """Block 256 x 128: each math warpgroup issues two waves of four QGMMAs per K block (rows 0-127,
    then 128-255 of the tile), each promoted with 64 FFMAs, the descriptors in uniform registers and
    nothing spilled, with or without clusters and a residual (bf16 / fp32). The whole tiles' K loop
    is unrolled 4 times (k_unroll), with the next K block's full-barrier wait among the FFMAs."""
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "256")
    monkeypatch.setenv("MOE_FP8_MULTICAST", multicast)
    native = kernels.jit.native_module()
    config = native.fp8_gemm_nt_config(4096, n, k, H200_SMS)
    assert (config["block_m"], config["block_n"], config["multicast"], config["k_unroll"]) == \
        (256, 128, int(multicast) or 1, 4)
    code = sass(*native.fp8_gemm_nt_code(4096, n, k, H200_SMS, False, c_dtype, 0, 1))
    loops = [[line for line in body.splitlines() if line.strip()]
             for body in _k_loop_bodies(code, max_bytes=16384) if "QGMMA" in body]
    assert "LDL" not in code and "STL" not in code, "register spills"
    assert any(sum("QGMMA" in line for line in ops) == 32 for ops in loops), "no loop of 4 K blocks"
    for ops in loops:
        k_blocks, rest = divmod(sum("QGMMA" in line for line in ops), 8)
        assert k_blocks >= 1 and rest == 0
        assert sum("FFMA" in line for line in ops) == 128 * k_blocks
        assert sum("R2UR" in line for line in ops) <= 4 * k_blocks
        assert len(ops) < 256 * k_blocks, f"{len(ops)} instructions per {k_blocks} K blocks"
        if k_blocks > 1:
            waits = [i for i, line in enumerate(ops) if "SYNCS.PHASECHK" in line]
            assert any(0 < i < len(ops) - 1 and "FFMA" in ops[i - 1] and "FFMA" in ops[i + 1] for i in waits), \
                "no full-barrier wait among the FFMAs"


@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048)])
def test_fp8_contiguous_256_row_tiles_run_two_waves(n, k):
    """Contiguous layouts aligned to 256 rows: the grouped kernel's 256 x 128 tile issues two waves of
    four QGMMAs per K block with their FFMAs, no spills, descriptors in uniform registers."""
    native = kernels.jit.native_module()
    args = (32768, n, k, H200_SMS, False, -1, 1, 4)
    assert native.fp8_gemm_nt_config(*args, alignment=256)["block_m"] == 256
    code = sass(*native.fp8_gemm_nt_code(*args, alignment=256))
    assert "LDL" not in code and "STL" not in code, "register spills"
    # Two waves' K block spans more than 4096 bytes of code here (the tile loop is far longer).
    loops = [[line for line in body.splitlines() if line.strip()]
             for body in _k_loop_bodies(code, max_bytes=6144) if "QGMMA" in body]
    assert loops
    for ops in loops:
        assert sum("QGMMA" in line for line in ops) == 8 and sum("FFMA" in line for line in ops) == 128
        assert sum("R2UR" in line for line in ops) <= 4 and len(ops) < 256, f"{len(ops)} instructions per K block"


@pytest.mark.parametrize("m,n,k,splits", [(4096, 7168, 16384, 4), (4096, 4096, 16384, 3), (4096, 7168, 8192, 2)])
def test_fp8_gemm_tail_split_keeps_whole_tiles_lean(m, n, k, splits, monkeypatch):
    """The tail split: whole tiles run their compile-time K range in their own loop (one per static
    scale split of the tile's columns), 96 FFMAs and at most 175 instructions per K block at block
    128 x 192 with the wgmma descriptors in uniform registers; the tail unit's run-time range gets
    loops of its own. A run-time range in the one loop had cost 16 R2UR per K block (192-198)."""
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "128")
    monkeypatch.setenv("MOE_GEMM_K_UNROLL", "1")  # one K block per loop body (ping-pong tiles unroll 4)
    native = kernels.jit.native_module()
    config = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert (config["block_n"], config["tail_splits"]) == (192, splits)
    loops = sorted((body.splitlines() for body in _k_loop_bodies(sass(*native.fp8_gemm_nt_code(m, n, k, H200_SMS)))
                    if "QGMMA" in body), key=len)
    assert len(loops) == 4, "whole tiles and the tail unit, each at both static scale splits"
    for ops in loops[:2]:
        ops = [line for line in ops if line.strip()]
        assert sum("FFMA" in line for line in ops) == 96
        assert sum("R2UR" in line for line in ops) <= 4 and len(ops) <= 175, f"{len(ops)} instructions per K block"


@pytest.mark.parametrize("pingpong,unroll,max_ops_per_k_block", [(None, 8, 160), ("1", 4, 155)])
@pytest.mark.parametrize("m,n,k", [(4096, 7168, 16384), (4096, 4096, 16384)])
def test_fp8_gemm_tail_split_unrolled_keeps_whole_tiles_lean(m, n, k, pingpong, unroll, max_ops_per_k_block,
                                                             monkeypatch):
    """128 x 192 tiles with the tail split, as shipped (no ping-pong, the K loop unrolled 8 times:
    1078-1190 instructions per 8 K blocks measured) and with ping-pong (unrolled 4 times, 605 per 4
    against 4 x 163-165 for the plain loop): the whole tiles' loops (one per static scale split)
    hold `unroll` K blocks with at most one R2UR; the tail unit's run-time range gets unrolled loops
    and a one-K-block remainder of its own."""
    monkeypatch.setenv("MOE_GEMM_BLOCK_M", "128")
    monkeypatch.delenv("MOE_GEMM_K_UNROLL", raising=False)
    if pingpong is None:
        monkeypatch.delenv("MOE_FP8_PINGPONG", raising=False)
    else:
        monkeypatch.setenv("MOE_FP8_PINGPONG", pingpong)
    native = kernels.jit.native_module()
    config = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    assert (config["block_n"], config["k_unroll"]) == (192, unroll) and config["tail_splits"] > 1
    loops = sorted((body.splitlines() for body in _innermost_k_loops(sass(*native.fp8_gemm_nt_code(m, n, k, H200_SMS)),
                                                                     max_bytes=24576)), key=len)
    loops = [[line for line in ops if line.strip()] for ops in loops]
    unrolled = [ops for ops in loops if sum("QGMMA" in line for line in ops) == 4 * unroll]
    assert len(unrolled) == 4 and len(loops) == 6, [len(ops) for ops in loops]
    for ops in unrolled[:2]:
        assert sum("FFMA" in line for line in ops) == 96 * unroll
        assert sum("R2UR" in line for line in ops) <= 1 and len(ops) <= max_ops_per_k_block * unroll, \
            f"{len(ops)} instructions per {unroll} K blocks"


@pytest.mark.parametrize("scale_load,layout", [(-1, "tma_k_major"), (1, "tma_mn_major")])
@pytest.mark.parametrize("n,k", [(7168, 16384), (4096, 7168)])
def test_fp8_gemm_256_row_loop_builds_scale_addresses_once(n, k, scale_load, layout, monkeypatch):
    """4096 rows on 256 x 128 tiles (the peer's plan), on each A scale layout: the A scales' loads
    share one IADD3 + LEA per K block and take their rows as immediate offsets, so each wave's 4
    wgmmas come with fewer than 97.4 instructions, the peer's count on the same plan (before: 98.1
    on MN-major scales with 5.1 IADD3 + LEA per wave; bench/RESULTS.md, session 44). K-major
    scales run their own kernel where the MN-major copy is off (MOE_FP8_SFA_COPY=0, and inside
    CUDA graph captures)."""
    monkeypatch.setenv("MOE_FP8_SFA_COPY", "0")
    native = kernels.jit.native_module()
    config = native.fp8_gemm_nt_config(4096, n, k, H200_SMS, scale_load=scale_load)
    assert (config["block_m"], config["block_n"], config["k_unroll"], config["scale_load"]) == (256, 128, 4, layout)
    code = sass(*native.fp8_gemm_nt_code(4096, n, k, H200_SMS, scale_load=scale_load))
    # The unrolled K loops (4 K blocks of 2 waves); a lone K block's loop handles K tails only, and
    # a tile loop whose K loop ptxas unrolled whole holds the epilogue's F2FP.
    loops = [body for body in _innermost_k_loops(code, max_bytes=40960)
             if body.count("QGMMA") == 32 and "F2FP" not in body]
    assert loops
    for body in loops:
        ops = [line for line in body.splitlines() if line.strip()]
        addressing = sum(re.search(r"\b(IADD3|LEA)\b", line) is not None for line in ops)
        assert len(ops) / 8 < 97.4 and addressing / 8 <= 4, (len(ops) / 8, addressing / 8)


@pytest.mark.parametrize("m,n,k,groups", [(16, 7168, 2048, 32), (16, 4096, 7168, 32), (256, 4096, 7168, 32)])
def test_fp8_masked_math_loop_keeps_descriptors_uniform(m, n, k, groups):
    """Masked: the stage index broadcast from lane 0 keeps the wgmma descriptors in uniform
    registers although the tile loop runs on per-thread masked_m loads (16 R2UR per K block
    before, 1-3 after)."""
    native = kernels.jit.native_module()
    code = sass(*native.fp8_gemm_nt_code(m, n, k, H200_SMS, False, -1, 2, groups))
    # Overlapped loops (block N <= 128) run rounds of 4 K blocks: 16 and 22 R2UR a round (4-5.5 per
    # K block, against 1-3 in the plain loop; decode tiles wait on the weights). 128 x 192 tiles (256
    # rows) run in step, their K loop unrolled 8 times: its body is the shortest with 8 K blocks' wgmmas
    # (the longer ones are ptxas' copies for K block counts that are not a multiple of 8).
    unroll = native.fp8_gemm_nt_config(m, n, k, H200_SMS, False, -1, 2, groups)["k_unroll"]
    loops = _innermost_k_loops(code, max_bytes=16384 if unroll == 1 else 32768)
    if unroll > 1:
        loops = sorted((body for body in loops if body.count("QGMMA") == 4 * unroll), key=len)[:1]
    assert loops
    for body in loops:
        k_blocks = body.count("QGMMA") // 4
        assert sum("R2UR" in line for line in body.splitlines()) <= (4 if k_blocks == 1 else 6 * k_blocks)


def test_fp8_masked_pairs_sharing_b_keep_spills_out_of_the_k_loop(monkeypatch):
    """MOE_FP8_MULTICAST=b on masked 128 x 192 tiles (pairs of m-blocks inside each group sharing B):
    B arrives by multicast, and the in-step K loop unrolled 8 times holds no local memory (a few
    registers spill per tile, outside it)."""
    monkeypatch.setenv("MOE_FP8_MULTICAST", "b")
    native = kernels.jit.native_module()
    args = (256, 4096, 7168, H200_SMS, False, -1, 2, 32)
    config = native.fp8_gemm_nt_config(*args)
    assert (config["share_b"], config["k_unroll"]) == (1, 8), config
    code = sass(*native.fp8_gemm_nt_code(*args))
    assert "QGMMA" in code and "UTMALDG" in code
    loops = sorted((body for body in _innermost_k_loops(code, max_bytes=32768) if body.count("QGMMA") == 32), key=len)
    assert loops and "LDL" not in loops[0] and "STL" not in loops[0]


@pytest.mark.parametrize("m,n,k,gemm_type,groups,unroll", [
    (64, 2112, 7168, 0, 1, 4), (128, 4096, 7168, 0, 1, 4), (64, 32768, 512, 0, 1, 4), (16, 4096, 7168, 2, 32, 4),
    (128, 4096, 7168, 0, 1, 8), (64, 2112, 7168, 0, 1, 8),
])
def test_fp8_gemm_overlaps_promotion_with_the_next_wgmmas(m, n, k, gemm_type, groups, unroll, monkeypatch):
    """Block M 64, block N <= 128: each round of 4 K blocks (8 with MOE_GEMM_K_UNROLL=8) waits for
    all but the newest wgmma group at every K block but the last (WARPGROUP.DEPBAR.LE gsb0, 0x1) and
    drains once (0x0): K block i + 1's wgmmas run while K block i is promoted. Serialized (ptxas'
    C7514/C7518), every QGMMA would carry the scoreboard and be waited for: only each K block's last
    may. Nothing spills (three accumulator sets)."""
    if unroll != 4:
        monkeypatch.setenv("MOE_GEMM_K_UNROLL", str(unroll))
    native = kernels.jit.native_module()
    args = (m, n, k, H200_SMS, False, -1, gemm_type, groups)
    config = native.fp8_gemm_nt_config(*args)
    assert (config["block_m"], config["overlap"]) == (64, 1), config
    code = sass(*native.fp8_gemm_nt_code(*args))
    assert "LDL" not in code and "STL" not in code, "register spills"
    loops = [body for body in _k_loop_bodies(code, max_bytes=16384) if "QGMMA" in body]
    # The plain loop (the tail split's units) is unrolled as many times and never waits with 0x1.
    rounds = [body for body in loops if body.count("QGMMA") == 4 * unroll and "DEPBAR.LE gsb0, 0x1" in body]
    assert rounds, f"no round of {unroll} K blocks"
    for body in rounds:
        waits = [line.split()[-1] for line in body.splitlines() if "WARPGROUP.DEPBAR" in line]
        assert waits == ["0x1"] * (unroll - 1) + ["0x0"], waits
        scoreboard = ["gsb0" in line for line in body.splitlines() if "QGMMA" in line]
        assert scoreboard == [False, False, False, True] * unroll, scoreboard


@pytest.mark.parametrize("pingpong", ["1", "0"])
@pytest.mark.parametrize("m,n,k,gemm_type,groups", GEMM_VARIANTS + [
    (4096, 4096, 7168, 0, 1), (4096, 7168, 16384, 0, 1), (4096, 576, 7168, 0, 1), (384, 7168, 2048, 2, 5),
])
def test_fp8_gemm_pingpong_takes_turns_with_asynchronous_wgmmas(m, n, k, gemm_type, groups, pingpong, monkeypatch):
    """Block M 128: in every K loop compiled (one per static scale split) a warpgroup takes its turn
    (one BAR.SYNC) before the wgmmas and passes it (one BAR.ARV) after the last one, before waiting
    on them; the second warpgroup gives the first its first turn (BAR.ARV 0x2) and the first takes
    the last one after its tiles (BAR.SYNC 0x2). ptxas serializes every wgmma of a kernel (a wait
    after each, silently but for a -v remark) when it cannot prove accumulators untouched while in
    flight: then each QGMMA carries the scoreboard (gsb0), not only the group's last. Block M 64 and
    MOE_FP8_PINGPONG=0: no named barrier but the epilogue's (1) and __syncthreads' (0), and the
    per-warpgroup epilogues' (4 + warpgroup, a register) where the tile has them."""
    monkeypatch.setenv("MOE_FP8_PINGPONG", pingpong)
    native = kernels.jit.native_module()
    config = native.fp8_gemm_nt_config(m, n, k, H200_SMS, False, -1, gemm_type, groups)
    assert config["pingpong"] == (pingpong == "1" and config["block_m"] == 128)
    code = sass(*native.fp8_gemm_nt_code(m, n, k, H200_SMS, False, -1, gemm_type, groups))
    # 128 x 192 tiles unroll 8 K blocks of about 150 instructions each (ping-pong: 4, up to 10 KB; the
    # tail units' longer, rotated loops stay out).
    loops = _innermost_k_loops(code, max_bytes=24576 if config["k_unroll"] > 4 else 10240)
    assert loops
    for body in loops:  # a loop may hold several K blocks (k_unroll; block N 16 unrolls by 2)
        ops = [line for line in body.splitlines() if line.strip()]
        qgmma = [i for i, line in enumerate(ops) if "QGMMA" in line]
        k_blocks = len(qgmma) // 4
        assert k_blocks and ["gsb0" in ops[i] for i in qgmma] == [False, False, False, True] * k_blocks, \
            "wgmmas serialized (a wait after each)"
        # The turns' barrier ids are registers, 256 threads; 0 and 1 (immediates) are __syncthreads' and
        # the epilogue's, and the per-warpgroup epilogues' barriers count 128 threads.
        take = [i for i, line in enumerate(ops) if re.search(r"BAR\.SYNC\S* (?!0x[01],)\w+, 0x100", line)]
        give = [i for i, line in enumerate(ops) if "BAR.ARV" in line]
        wait = [i for i, line in enumerate(ops) if "WARPGROUP.DEPBAR" in line]
        if config["pingpong"]:
            # Per K block: take the turn, four wgmmas, pass it, wait on them. ptxas may rotate a loop
            # (the MN-major kernel's remainder loop starts at the wgmmas and ends taking the next turn).
            events = sorted([(i, "T") for i in take] + [(i, "Q") for i in qgmma] + [(i, "G") for i in give] +
                            [(i, "W") for i in wait])
            events = "".join(event for _, event in events)
            assert len(events) == 7 * k_blocks and events in "TQQQQGW" * (k_blocks + 1), events
        else:
            assert not take and not give
    if config["pingpong"]:
        assert re.search(r"BAR\.ARV 0x2, 0x100", code) and re.search(r"BAR\.SYNC\S* 0x2, 0x100", code)
    else:
        assert "BAR.ARV" not in code
        extra = set(re.findall(r"BAR\.SYNC\S* (\w+)", code)) - {"0x0", "0x1"}
        assert not extra or (config["wg_store"] and all(name.startswith("R") for name in extra)), extra


@pytest.mark.parametrize("pdl", ["1", "0", None])
@pytest.mark.parametrize("m,n,k,gemm_type,groups", GEMM_VARIANTS)
def test_fp8_gemm_pdl_waits_before_touching_memory(m, n, k, gemm_type, groups, pdl, monkeypatch):
    """PDL (the default; MOE_GEMM_PDL=1 too): the kernel lets the next one launch (PREEXIT) and waits
    for the previous one (ACQBULK) before its first global access (loads of masked_m or m_indices,
    TMA, scale copies); with MOE_GEMM_PDL=0 neither instruction is there."""
    if pdl is None:
        monkeypatch.delenv("MOE_GEMM_PDL", raising=False)
    else:
        monkeypatch.setenv("MOE_GEMM_PDL", pdl)
    native = kernels.jit.native_module()
    assert native.fp8_gemm_nt_config(m, n, k, H200_SMS, False, -1, gemm_type, groups)["pdl"] == int(pdl != "0")
    ops = [line for line in sass(*native.fp8_gemm_nt_code(m, n, k, H200_SMS, False, -1, gemm_type, groups)).splitlines()
           if _SASS_LINE.search(line)]
    wait = [i for i, line in enumerate(ops) if "ACQBULK" in line]
    trigger = [i for i, line in enumerate(ops) if "PREEXIT" in line]
    if pdl == "0":
        assert not wait and not trigger
        return
    assert len(wait) == 1 and len(trigger) == 1 and trigger[0] < wait[0]
    memory = [i for i, line in enumerate(ops) if re.search(r"\b(LDG|STG|LD|ST|UTMALDG|UTMASTG|UTMAREDG|UBLKCP|LDGSTS|REDG?|ATOMG?)\b", line)]
    assert memory and wait[0] < min(memory)


FP4_VARIANTS = [  # (m or expected m, n, k, gemm type, groups): masked decode, contiguous prefill, a tail shape
    (8, 4096, 7168, 2, 32), (8192, 4096, 7168, 1, 4), (16, 7168, 2048, 2, 256), (64, 136, 384, 2, 4),
]


@pytest.mark.parametrize("m,n,k,gemm_type,groups", FP4_VARIANTS)
def test_fp8_fp4_gemm_uses_qgmma_tma_and_byte_permute_conversion(m, n, k, gemm_type, groups):
    name, code, config = kernels.jit.native_module().fp8_fp4_gemm_nt_code(m, n, k, H200_SMS, gemm_type, groups)
    text = sass(name, code)
    # The scale warps copy with cp.async, or load into registers (128 x 128 tiles, common/scale_gather.cuh).
    scale_loads = "LDGSTS" if config["gather_chunk"] == 0 else "LDG.E.NA"
    for instruction in ("QGMMA", "UTMALDG", "UTMASTG", "USETMAXREG", scale_loads, "PRMT"):
        assert instruction in text, instruction
    assert "LDL" not in text and "STL" not in text, "register spills"


@pytest.mark.parametrize("m,n,k,gemm_type,groups", [(256, 4096, 7168, 2, 32), (6400, 7168, 2048, 1, 32),
                                                     (100, 4096, 7168, 2, 32), (300, 136, 384, 2, 4)])
def test_fp8_fp4_gemm_clusters_copy_their_half_to_the_peer(m, n, k, gemm_type, groups, monkeypatch):
    """MOE_FP4_SHARE_B=1 (2-CTA clusters, each CTA converting half of the weight tile): one bulk
    shared::cluster copy (UBLKCP) per K block, the math warps' remote arrivals, no spills."""
    monkeypatch.setenv("MOE_FP4_SHARE_B", "1")
    name, code, config = kernels.jit.native_module().fp8_fp4_gemm_nt_code(m, n, k, H200_SMS, gemm_type, groups)
    assert config["multicast"] == 2, config
    text = sass(name, code)
    for instruction in ("QGMMA", "UTMALDG", "UTMASTG", "UBLKCP", "PRMT"):
        assert instruction in text, instruction
    assert "LDL" not in text and "STL" not in text, "register spills"


@pytest.mark.parametrize("m,gemm_type,groups", [(8192, 1, 4), (8, 2, 32)])
def test_fp8_fp4_gemm_k_loops_are_lean(m, gemm_type, groups, monkeypatch):
    """N x K = 4096 x 7168, contiguous 4 x 8192 (block 128 x 128) and masked decode (block 64 x 128).
    Math: the warp index and the tile loop's answer broadcast from lane 0 keep the wgmma descriptors
    in uniform registers (no R2UR in the loop; there were 16 per K block), the column scales come in
    16-byte loads: 64 FFMAs, 64 FMULs and under 64 other instructions per K block (was 240 in all).
    Scale warps: (block M + block N) / 32 copies per K block from per-tile 32-bit offsets, under 80
    instructions per K block with the other warps' turns' bookkeeping (one warp issued ~225). The
    copies (MOE_FP8_GATHER_CHUNK=0; unset, 128 x 128 tiles load into registers)."""
    monkeypatch.setenv("MOE_FP8_GATHER_CHUNK", "0")
    name, code, config = kernels.jit.native_module().fp8_fp4_gemm_nt_code(m, 4096, 7168, H200_SMS, gemm_type, groups)
    assert config["scale_warps"] == 3
    bodies = [[line for line in body.splitlines() if line.strip()] for body in _k_loop_bodies(sass(name, code))]
    math = min((ops for ops in bodies if any("QGMMA" in line for line in ops)), key=len)
    assert sum("QGMMA" in line for line in math) == 4
    assert not any("R2UR" in line for line in math), "wgmma descriptors moved into uniform registers per K block"
    assert sum("FFMA" in line for line in math) == 64 and sum("FMUL" in line for line in math) == 64
    assert sum("LDS.128" in line for line in math) == 8, "column scales in 16-byte loads"
    assert len(math) < 192, f"{len(math)} math instructions per K block"
    scale = min((ops for ops in bodies if any("LDGSTS.E" in line for line in ops)), key=len)
    copies, per_k_block = sum("LDGSTS.E" in line for line in scale), (config["block_m"] + config["block_n"]) // 32
    assert copies % per_k_block == 0, f"{copies} copies in the scale warps' loop"
    assert len(scale) / (copies // per_k_block) < 80, f"{len(scale)} instructions for {copies // per_k_block} K blocks"
    for ops in bodies:
        assert not any("LDL" in line or "STL" in line for line in ops), "local memory in a K loop"


@pytest.mark.parametrize("expected_m,n,k,groups", [(16, 4096, 7168, 32), (1, 7168, 2048, 256), (32, 136, 384, 4)])
@pytest.mark.parametrize("fragment_layout", [False, True])
def test_fp8_fp4_swap_ab_gemm_uses_register_operand_qgmma(expected_m, n, k, groups, fragment_layout, monkeypatch):
    monkeypatch.delenv("MOE_FP4_BLOCK_REF", raising=False)
    name, code, config = kernels.jit.native_module().fp8_fp4_gemm_nt_swap_ab_code(expected_m, n, k, H200_SMS, groups,
                                                                                 fragment_layout)
    text = sass(name, code)
    # Packed weights are converted by byte permutes, their scale warps reduce each K block's exponents
    # to the tile's reference (REDUX); the decode layout's fragments are decoded by bit masks, its A
    # scales copied by cp.async (LDGSTS).
    extra = ("LDGSTS",) if fragment_layout else ("PRMT", "REDUX")
    for instruction in ("QGMMA", "UTMALDG", "UTMASTG") + extra:
        assert instruction in text, instruction
    assert "LDL" not in text and "STL" not in text, "register spills"
    if not fragment_layout:
        _check_tile_reference_loops(text, config["block_t"] * config["k_blocks"] // 2)


def _check_tile_reference_loops(text: str, accumulators: int):
    """Packed weights' K loops: the one on the tile's reference exponent (the shortest) promotes with
    one FFMA per accumulator and builds no checked tables (no vote); another loop, for K blocks
    without it, keeps the rows' own scales (FMUL and FFMA) and the vote between the table forms.
    `accumulators`: per thread per trip of the loop. Neither keeps values in local memory."""
    loops = sorted(_innermost_k_loops(text, 32768), key=len)
    assert len(loops) >= 2, "no separate K loop on the tile's reference"
    count = lambda loop, op: sum(op in line for line in loop.splitlines())  # noqa: E731
    hot = loops[0]
    assert (count(hot, "FFMA"), count(hot, "FMUL"), count(hot, "VOTE")) == (accumulators, 0, 0)
    assert any(count(loop, "VOTE.ALL") and count(loop, "FMUL") >= accumulators for loop in loops[1:])
    for loop in loops:
        assert not any("LDL" in line or "STL" in line for line in loop.splitlines()), "local memory in a K loop"


@pytest.mark.parametrize("m,n,k,groups,gemm_type", [(32768, 4096, 7168, 4, 1), (8192, 7168, 2048, 32, 1),
                                                    (64, 4096, 7168, 32, 2), (100, 576, 2048, 4, 2)])
def test_fp8_fp4_swap_ab_prefill_tiles_use_setmaxnreg_and_transposed_stores(m, n, k, groups, gemm_type, monkeypatch):
    """128 weight rows x up to 128 tokens: the producer warpgroup hands its registers to math (the
    accumulators, two fragment sets and the block's scales stay in registers through the K loop: at
    128 tokens a few tile values wait in local memory for the epilogue), and the epilogue writes the
    transposed tile with stmatrix."""
    monkeypatch.delenv("MOE_FP4_BLOCK_REF", raising=False)
    name, code, config = kernels.jit.native_module().fp8_fp4_gemm_nt_swap_ab_code(m, n, k, H200_SMS, groups,
                                                                                 gemm_type=gemm_type)
    text = sass(name, code)
    for instruction in ("QGMMA", "UTMALDG", "UTMASTG", "REDUX", "PRMT", "USETMAXREG", "STSM"):
        assert instruction in text, instruction
    _check_tile_reference_loops(text, config["block_t"])


@pytest.mark.parametrize("m,n,k,gemm_type,groups,scale_load,multicast", [
    (4096, 7168, 16384, 0, 1, -1, True), (4096, 576, 7168, 0, 1, -1, False), (8192, 4096, 7168, 1, 4, -1, False),
    (8192, 7168, 2048, 1, 4, -1, True),
    (1024, 7168, 2048, 2, 8, -1, True), (128, 7168, 2048, 0, 1, 1, True), (128, 7168, 2048, 0, 1, -1, False),
    (64, 2112, 7168, 0, 1, -1, False), (64, 7168, 16384, 0, 1, -1, True),
    (64, 4096, 7168, 2, 32, -1, False), (128, 4096, 7168, 1, 8, -1, False),
])
def test_fp8_gemm_multicasts_a_in_clusters(m, n, k, gemm_type, groups, scale_load, multicast, monkeypatch):
    """Two CTAs on adjacent n-blocks share A (dense GEMMs of up to 64 rows from K = 8192, of 65-128
    rows on MN-major A scales from N = 7168, of more rows at N > 4096; grouped ones from 512 rows
    per group): each loads half with a multicast TMA and releases stages on both CTAs' empty
    barriers (remote arrive, without a GPU-wide fence). MOE_FP8_MULTICAST=a: contiguous 128 x 192
    tiles share A, not their default B. ``scale_load`` -1: K-major A scales, 1: MN-major."""
    monkeypatch.setenv("MOE_FP8_MULTICAST", "a")
    text = sass(*kernels.jit.native_module().fp8_gemm_nt_code(m, n, k, H200_SMS, False, -1, gemm_type, groups,
                                                              scale_load=scale_load))
    assert ("UTMALDG.2D.MULTICAST" in text) == multicast
    assert ("UCGABAR_WAIT" in text) == multicast, "cluster barrier after the mbarrier inits"
    if multicast:
        assert "SYNCS.ARRIVE.TRANS64.RED" in text and "MEMBAR.ALL.GPU" not in text.split("QGMMA", 1)[1]


@pytest.mark.parametrize("m,n,k", [(64, 2112, 7168), (4096, 7168, 2048)])
def test_bf16_gemm_uses_hgmma_tma_and_setmaxnreg(m, n, k):
    code = sass(*kernels.jit.native_module().bf16_gemm_nt_code(m, n, k, H200_SMS))
    for instruction in ("HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG"):
        assert instruction in code, instruction
    assert "LDL" not in code and "STL" not in code, "register spills"


def test_quantizers_use_wide_loads_and_fp8_conversion():
    native = kernels.jit.native_module()
    for name, code in (native.per_token_cast_to_fp8_code(_DTYPE_BF16, 7168, 128, False, "sm_90a"),
                       native.per_block_cast_to_fp8_code(_DTYPE_BF16, 7168, False, "sm_90a")):
        text = sass(name, code)
        assert re.search(r"LDG\.E[.A-Z]*\.128", text), "16-byte loads"
        assert "F2FP.SATFINITE.E4M3" in text, "hardware E4M3 conversion"
        assert "LDL" not in text and "STL" not in text, "register spills"


@pytest.mark.parametrize("top_k,hidden,float_out", [(8, 7168, False), (3, 256, True)])
def test_moe_combine_reads_and_writes_16_bytes(top_k, hidden, float_out):
    text = sass(*kernels.jit.native_module().moe_combine_code(top_k, hidden, float_out))
    assert re.search(r"LDG\.E[.A-Z]*\.128", text) and re.search(r"STG\.E[.A-Z]*\.128", text)
    assert "LDL" not in text and "STL" not in text, "register spills"


@pytest.mark.parametrize("top_k,num_local,hidden", [(8, 256, 7168), (3, 16, 256)])
def test_moe_local_dispatch_copies_rows_16_bytes_at_a_time(top_k, num_local, hidden):
    text = sass(*kernels.jit.native_module().moe_local_dispatch_code(top_k, num_local, hidden))
    assert re.search(r"LDG\.E[.A-Z]*\.128", text) and re.search(r"STG\.E[.A-Z]*\.128", text)
    assert "LDL" not in text and "STL" not in text, "register spills"


@pytest.mark.parametrize("args", [(256, 8, 8, 4, True, True, True), (8, 2, 0, 0, False, True, False),
                                  (128, 8, 0, 0, False, True, False), (64, 6, 8, 3, True, True, True)])
def test_moe_route_keeps_everything_in_registers(args):
    """The models' configurations (DeepSeek-V3, Mixtral, Qwen3-MoE, DeepSeek-V2-Lite). At 1024 experts
    the 32 unrolled divisions' slow-path calls save registers on the stack; no model routes that wide."""
    text = sass(*kernels.jit.native_module().moe_route_code(*args))
    assert "LDL" not in text and "STL" not in text, "local memory (spills or an indexed array)"


def test_mn_major_sf_copy_waits_then_loads_before_storing():
    """The scale copy before the wide-tile GEMMs: it waits for the kernels before it (griddepcontrol,
    ACQBULK) and lets the next one launch (PREEXIT), and issues its four loads per thread before the
    first store to shared memory (one memory latency a CTA), without local memory."""
    code = sass(*kernels.jit.native_module().mn_major_sf_code())
    ops = [op for _, op in (m.groups() for m in _SASS_LINE.finditer(code))]
    assert any("ACQBULK" in op for op in ops) and any("PREEXIT" in op for op in ops)
    loads = [i for i, op in enumerate(ops) if "LDG" in op]
    first_store = next(i for i, op in enumerate(ops) if op.startswith("STS") or " STS " in op)
    assert len(loads) == 4 and max(loads) < first_store, ops
    assert "LDL" not in code and "STL" not in code


@pytest.mark.parametrize("m,n,k,gemm_type,groups", [
    (128, 4096, 7168, 0, 1), (64, 2112, 7168, 0, 1), (1000, 7168, 1536, 0, 1), (4096, 7168, 2048, 0, 1),
    (32768, 4096, 7168, 1, 4),
])
def test_fp8_gemm_behind_the_copy_waits_before_its_first_tma_load(m, n, k, gemm_type, groups):
    """The GEMM behind the copy of A's scales (the MN-major plan, PDL): griddepcontrol.wait (ACQBULK)
    once, before every TMA load (UTMALDG), since the copy may still be writing the scales it loads;
    it lets the next kernel launch (PREEXIT), and nothing spills."""
    native = kernels.jit.native_module()
    args = (m, n, k, H200_SMS, False, -1, gemm_type, groups)
    code = sass(*native.fp8_gemm_nt_code(*args, scale_load=1))
    ops = [op for _, op in (match.groups() for match in _SASS_LINE.finditer(code))]
    waits = [i for i, op in enumerate(ops) if "ACQBULK" in op]
    assert len(waits) == 1 and all(i > waits[0] for i, op in enumerate(ops) if "UTMALDG" in op)
    for instruction in ("QGMMA", "UTMASTG", "USETMAXREG", "PREEXIT"):
        assert instruction in code, instruction
    assert "LDL" not in code and "STL" not in code, "register spills"


@pytest.mark.parametrize("m,n,k,scale_load,layout,multicast", [
    (1, 2112, 7168, -1, "gather", 1), (1, 2112, 7168, 1, "tma_mn_major", 1),
    (16, 4096, 7168, -1, "tma_k_major_table", 1),
    (7, 7168, 16384, 1, "tma_mn_major", 2),             # the first CTA loads and multicasts A's rows
    (144, 2112, 7168, 1, "tma_mn_major", 1), (1000, 7168, 2048, -1, "gather", 2),   # the last of several
    (144, 4096, 7168, 1, "tma_mn_major", 1),            # and B's last n-block
])
def test_fp8_gemm_tight_boxes_build(m, n, k, scale_load, layout, multicast, monkeypatch):
    """The kernels whose boxes end at row M and N where they cut the last m-block and n-block (tail
    maps) build for each A-scale layout that takes them, on lone CTAs and in clusters sharing A,
    with QGMMA and TMA loads and nothing spilled."""
    native = kernels.jit.native_module()
    monkeypatch.delenv("MOE_FP8_TIGHT_BOXES", raising=False)
    cfg = native.fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=scale_load)
    assert (cfg["tight_boxes"], cfg["scale_load"], cfg["multicast"]) == (1, layout, multicast), cfg
    name, source = native.fp8_gemm_nt_code(m, n, k, H200_SMS, False, -1, 0, 1, 128, True, scale_load)
    assert source.split(">);")[0].endswith(f"{cfg['table_slots']}, false, true"), "the kTightBoxes argument"
    code = sass(name, source)
    for instruction in ("QGMMA", "UTMALDG", "USETMAXREG"):
        assert instruction in code, instruction
    assert "LDL" not in code and "STL" not in code, "register spills"
