"""The GEMM launchers' host path under the host-only driver (kernels/testing/host_driver.cpp): what
reaches cuLaunchKernelEx and cuTensorMapEncodeTiled on a CPU-only machine, kernels compiled by NVRTC
and never run. Covers the plan memo (jit/env_memo.hpp) and the descriptor memo (gemm_common.hpp
TmaMemo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.testing.host_driver import build_host_driver, host_driver_env

REPO = Path(__file__).resolve().parents[2]

# Runs in a process whose driver is the host-only one; prints one JSON object of observations.
_CHILD = r"""
import json, os
from kernels.jit import native_module
from kernels.testing.host_driver import HostDriverRecord

rec = HostDriverRecord.attach()
native = native_module()
A, SFA, B, SFB, D = (0x10_0000_0000 * (i + 1) for i in range(5))
out = {}

def dense(m, n, k, d=D, a=A):
    native.fp8_gemm_nt(a, k, SFA, 1, (m + 3) // 4 * 4, B, k, SFB, k // 128, 1, d, n, 0, -1, 0, m, n, k, False, 0, 0,
                       0, 0)

def encodes_of(call):
    before = rec.encodes()
    call()
    return rec.encodes() - before

def launch_of(m, n, k):
    dense(m, n, k)
    last = rec.last_launch()
    plan = native.fp8_gemm_nt_config(m, n, k, 132, split_workspace=False, scale_load=1)
    return {"launch": [last.grid, last.smem_bytes, last.cluster, int(last.pdl)],
            "plan": [plan["grid"], plan["smem_bytes"], plan["multicast"], plan["pdl"]]}

m, n, k = 128, 4096, 7168
out["first"] = encodes_of(lambda: dense(m, n, k))
out["repeat"] = encodes_of(lambda: dense(m, n, k))
out["new_d"] = encodes_of(lambda: dense(m, n, k, d=D + 4096))
out["back_to_d"] = encodes_of(lambda: dense(m, n, k))
out["new_rows"] = encodes_of(lambda: dense(m - 8, n, k))  # the same plan (tiles, boxes)
launches = rec.launches()
out["repeats"] = [encodes_of(lambda: dense(m, n, k)) for _ in range(2)]
out["launches"] = rec.launches() - launches
out["plans"] = [launch_of(*shape) for shape in [(128, 4096, 7168), (64, 2112, 7168), (2048, 7168, 2048),
                                                 (4096, 4096, 7168), (1, 576, 7168)]]
# The grouped entry points share the memos: (first call, repeat) encodes each.
def contiguous():
    native.m_grouped_fp8_gemm_nt_contiguous(A, k, SFA, 1, 8192, B, k, SFB, (n // 128) * (k // 128), k // 128, 1, D, n,
                                            0x60_0000_0000, 8192, n, k, 4, 128, 0, 0, 0, 0)

def masked(sfb_strides=None):
    sg, sn, sk = sfb_strides or ((n // 128) * (k // 128), k // 128, 1)
    native.m_grouped_fp8_gemm_nt_masked(A, k, SFA, 1, 64, B, k, SFB, sg, sn, sk, D, n, 0x60_0000_0000, 64, 16, n, k,
                                        32, 0, 0)

def fp4_masked():
    native.m_grouped_fp8_fp4_gemm_nt_masked(A, k, SFA, 1, 64, B, k // 2, SFB, n * (k // 32), k // 32, D, n,
                                            0x60_0000_0000, 64, 8, n, k, 32, 0, 0)

out["grouped"] = {name: [encodes_of(call), encodes_of(call)]
                  for name, call in (("contiguous", contiguous), ("masked", masked), ("fp4_masked", fp4_masked))}
# A model's worth of weights: 60 layers of two grouped GEMMs, each B and its scales its own buffers.
def layers():
    for layer in range(60):
        for gemm in range(2):
            b = B + (2 * layer + gemm + 1) * 0x1000_0000
            native.m_grouped_fp8_gemm_nt_masked(A, k, SFA, 1, 64, b, k, b + 0x800_0000, (n // 128) * (k // 128),
                                                k // 128, 1, D, n, 0x60_0000_0000, 64, 16, n, k, 32, 0, 0)
layers()
out["model_repeat"] = encodes_of(layers)
# MOE_FP8_SCALE_TMA=0, read by the memoized plan: a new row count encodes A, its tail box and D only
# (the scales are gathered), with the gathering plan's shared memory.
os.environ["MOE_FP8_SCALE_TMA"] = "0"
out["gather_encodes"] = encodes_of(lambda: dense(m - 16, n, k))
out["gather_smem"] = [rec.last_launch().smem_bytes,
                      native.fp8_gemm_nt_config(m - 16, n, k, 132, split_workspace=False, scale_load=0)["smem_bytes"]]
del os.environ["MOE_FP8_SCALE_TMA"]
dense(m, n, k)
out["pdl_default"] = rec.last_launch().pdl
os.environ["MOE_GEMM_PDL"] = "0"
dense(m, n, k)
out["pdl_off"] = rec.last_launch().pdl
del os.environ["MOE_GEMM_PDL"]
dense(m, n, k)
out["pdl_back"] = rec.last_launch().pdl
# K-major A scales with a workspace: 256-row tiles copy them (mn_major_sf), then the GEMM runs the
# MN-major plan; not without room for the copy, with MOE_FP8_SFA_COPY=0, or on 128-row tiles.
WS = 0x70_0000_0000
ws_bytes = native.fp8_gemm_split_workspace_bytes(132)

def dense_k_major(m, n, k, nbytes=ws_bytes):
    native.fp8_gemm_nt(A, k, SFA, k // 128, 1, B, k, SFB, k // 128, 1, D, n, 0, -1, 0, m, n, k, False, 0, WS, nbytes,
                       0)

def launches_of(call):
    before = rec.launches()
    call()
    return rec.launches() - before

plans = [native.fp8_gemm_nt_config(4096, 7168, 2048, 132, scale_load=load)["smem_bytes"] for load in (1, 2)]
out["copy"] = [launches_of(lambda: dense_k_major(4096, 7168, 2048)), rec.last_launch().smem_bytes, *plans]
out["copy_small_workspace"] = [launches_of(lambda: dense_k_major(4096, 7168, 2048, ws_bytes - 1)),
                               rec.last_launch().smem_bytes]
os.environ["MOE_FP8_SFA_COPY"] = "0"
out["copy_off"] = [launches_of(lambda: dense_k_major(4096, 7168, 2048)), rec.last_launch().smem_bytes]
del os.environ["MOE_FP8_SFA_COPY"]
out["copy_128_rows"] = launches_of(lambda: dense_k_major(4096, 2112, 7168))
# Contiguous layouts of 4096 rows or more (N >= 4096) copy K-major A scales likewise (not below, not
# at N = 2112, not without a workspace: a graph capture); under MOE_FP8_SFA_COPY=all dense tiles of
# any height too.
def contiguous_k_major(m, ws=WS, nbytes=ws_bytes, n=n):
    native.m_grouped_fp8_gemm_nt_contiguous(A, k, SFA, k // 128, 1, B, k, SFB, (n // 128) * (k // 128), k // 128,
                                            1, D, n, 0x60_0000_0000, m, n, k, 4, 128, 0, ws, nbytes, 0)

grouped_plans = [native.fp8_gemm_nt_config(8192, n, k, 132, gemm_type=1, num_groups=4, scale_load=load)["smem_bytes"]
                 for load in (1, 0)]
out["contiguous_copy"] = [launches_of(lambda: contiguous_k_major(8192)), rec.last_launch().smem_bytes, *grouped_plans]
out["contiguous_no_workspace"] = [launches_of(lambda: contiguous_k_major(8192, 0, 0)), rec.last_launch().smem_bytes]
out["contiguous_small"] = launches_of(lambda: contiguous_k_major(2048))
out["contiguous_narrow"] = launches_of(lambda: contiguous_k_major(8192, n=2112))
os.environ["MOE_FP8_SFA_COPY"] = "0"
out["contiguous_off"] = launches_of(lambda: contiguous_k_major(8192))
os.environ["MOE_FP8_SFA_COPY"] = "all"
out["contiguous_copy_all"] = [launches_of(lambda: contiguous_k_major(8192)), rec.last_launch().smem_bytes]
small_plans = [native.fp8_gemm_nt_config(128, n, k, 132, scale_load=load)["smem_bytes"] for load in (1, 0)]
out["dense_small_copy"] = [launches_of(lambda: dense_k_major(128, n, k)), rec.last_launch().smem_bytes, *small_plans]
# Planned with a copy but no room for it: the K-major plan's own kernel.
out["dense_small_no_room"] = [launches_of(lambda: dense_k_major(128, n, k, ws_bytes - 1)),
                              rec.last_launch().smem_bytes]
out["dense_small_k_384"] = launches_of(lambda: dense_k_major(128, n, 384))
del os.environ["MOE_FP8_SFA_COPY"]
# The maps of launches whose M and N cut their last blocks: tail boxes by default, whole boxes only
# under MOE_FP8_TIGHT_BOXES=0; complete only without the memo.
def maps_of(m, n, k):
    before = rec.encodes()
    dense(m, n, k)
    plan = native.fp8_gemm_nt_config(m, n, k, 132, split_workspace=False, scale_load=1)
    return {"shape": [m, n, k], "plan": {key: plan[key] for key in ("block_m", "block_n", "multicast", "tight_boxes")},
            "maps": [[e.dtype, list(e.box)] for e in rec.encoded_maps(rec.encodes() - before)]}
tail_shapes = [(144, 4096, 7168), (1000, 7168, 2048), (33, 7168, 16384), (1040, 7168, 2048), (4100, 7168, 2048),
               (7, 7168, 16384)]
out["tail_maps"] = [maps_of(*shape) for shape in tail_shapes]
os.environ["MOE_FP8_TIGHT_BOXES"] = "0"
out["whole_maps"] = [maps_of(*shape) for shape in tail_shapes]
del os.environ["MOE_FP8_TIGHT_BOXES"]
# B's scales with strides past the kernel's 32-bit offsets: refused before any launch.
def sfb_span_error(sfb_strides=None):
    try:
        masked(sfb_strides)
    except Exception as error:  # noqa: BLE001 (the message is the observation)
        return str(error)
    return None
kb = k // 128
out["sfb_span"] = [sfb_span_error(((n // 128) * kb, 1 << 32, 1)), sfb_span_error(((n // 128) * kb, kb, 1 << 27)),
                   sfb_span_error()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def host_driver_dir(tmp_path_factory) -> Path:
    try:
        return build_host_driver(tmp_path_factory.mktemp("host_driver"))
    except RuntimeError as error:
        if "no C++ compiler" in str(error):
            pytest.skip(str(error))
        raise


def _observe(lib_dir: Path, **switches: str) -> dict:
    env = host_driver_env(lib_dir)
    for name in ("MOE_TMA_MEMO", "MOE_GEMM_PDL", "MOE_GEMM_BLOCK_M", "MOE_GEMM_BLOCK_N", "MOE_FP8_MULTICAST",
                 "MOE_FP8_SCALE_TMA", "MOE_FP8_SFA_COPY"):
        env.pop(name, None)
    env.update(switches, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def observed(host_driver_dir) -> dict:
    return _observe(host_driver_dir)


@pytest.fixture(scope="module")
def observed_without_memo(host_driver_dir) -> dict:
    return _observe(host_driver_dir, MOE_TMA_MEMO="0")


def test_b_scales_past_32_bit_offsets_are_refused(observed):
    too_far, k_too_far, fine = observed["sfb_span"]
    for message in (too_far, k_too_far):
        assert message is not None and "the scales of B span more than 2^32 elements" in message, message
    assert fine is None


def test_descriptors_are_encoded_once_per_buffer(observed):
    """Five maps (A, B, D, A's and B's scales) on the first call; none when the same buffers come
    back; one when only D moves (also when it moves back: the old one is still held); A, D and A's
    scales, and A's and its scales' tail boxes, when the row count changes (120 rows cut the last
    m-block)."""
    assert observed["first"] == 5
    assert observed["repeat"] == 0
    assert observed["new_d"] == 1
    assert observed["back_to_d"] == 0
    assert observed["new_rows"] == 5


def test_memo_holds_a_models_weights(observed):
    """Two grouped GEMMs in each of 60 layers, with their own weights: the second pass encodes
    nothing (the 600 maps fit the sets)."""
    assert observed["repeats"] == [0, 0] and observed["launches"] == 2
    assert observed["model_repeat"] == 0


def test_memo_switch_encodes_every_map(observed_without_memo):
    """MOE_TMA_MEMO=0 (read when the process starts) encodes every map on every call."""
    assert observed_without_memo["repeats"] == [5, 5]
    assert observed_without_memo["model_repeat"] == 60 * 2 * 3
    assert observed_without_memo["grouped"] == {"contiguous": [5, 5], "masked": [3, 3], "fp4_masked": [3, 3]}


def test_grouped_calls_share_the_descriptor_memo(observed):
    """Contiguous (A, B, D and both scales by TMA), masked FP8 and masked FP8 x FP4 (A, B, D) GEMMs
    encode their maps once and reuse them. The FP4 call's D map is the masked FP8 call's before it
    (the same buffer in boxes of 8 rows x 64 columns, 128-byte swizzled): found, not encoded."""
    assert observed["grouped"] == {"contiguous": [5, 0], "masked": [3, 0], "fp4_masked": [2, 0]}


def test_launches_follow_the_plan(observed):
    """Grid, shared memory, cluster size and PDL of what reaches the driver are the heuristic's
    (planned for a launch without the split workspace, as the raw call here has none)."""
    for case in observed["plans"]:
        assert case["launch"] == case["plan"], case


def test_env_switch_reaches_the_next_launch(observed):
    """Switches read by the memoized plan apply from the next call on, and their removal too:
    MOE_GEMM_PDL, and MOE_FP8_SCALE_TMA=0 (gathered scales: no scale maps)."""
    assert observed["gather_encodes"] == 3
    assert observed["gather_smem"][0] == observed["gather_smem"][1]
    assert observed["pdl_default"] is True
    assert observed["pdl_off"] is False
    assert observed["pdl_back"] is True


def test_k_major_scales_of_wide_tiles_are_copied_first(observed):
    """Dense 256-row tiles on K-major A scales with the workspace: two launches, the copy and then
    the GEMM with the MN-major plan's shared memory; one launch (the K-major plan) where the
    workspace lacks the copy's room or MOE_FP8_SFA_COPY=0, and on 128-row tiles."""
    launches, smem, mn_smem, k_major_smem = observed["copy"]
    assert mn_smem != k_major_smem
    assert (launches, smem) == (2, mn_smem)
    assert observed["copy_small_workspace"] == [1, k_major_smem]
    assert observed["copy_off"] == [1, k_major_smem]
    assert observed["copy_128_rows"] == 1


def test_contiguous_k_major_scales_are_copied_first(observed):
    """Contiguous layouts of 4096 rows or more and N >= 4096 on K-major A scales with the workspace:
    the copy, then the GEMM with the MN-major plan's shared memory (under MOE_FP8_SFA_COPY=all too);
    one launch (the gathers' plan) without the workspace, below 4096 rows, at N = 2112, and with
    MOE_FP8_SFA_COPY=0."""
    launches, smem, mn_smem, gather_smem = observed["contiguous_copy"]
    assert mn_smem != gather_smem
    assert (launches, smem) == (2, mn_smem)
    assert observed["contiguous_copy_all"] == [2, mn_smem]
    assert observed["contiguous_no_workspace"] == [1, gather_smem]
    assert observed["contiguous_small"] == 1
    assert observed["contiguous_narrow"] == 1
    assert observed["contiguous_off"] == 1


def test_sfa_copy_all_copies_narrow_tiles_first(observed):
    """MOE_FP8_SFA_COPY=all, K-major A scales with the workspace: dense 64-row tiles launch the copy,
    then the GEMM with the MN-major plan's shared memory; one launch (the gathers' plan) without room
    in the workspace and at K = 384."""
    launches, smem, mn_smem, gather_smem = observed["dense_small_copy"]
    assert (launches, smem) == (2, mn_smem)
    assert observed["dense_small_no_room"] == [1, gather_smem]
    assert observed["dense_small_k_384"] == 1


_UINT8, _FLOAT32 = 0, 7  # CUtensorMapDataType


def _boxes(case: dict) -> tuple[list, list]:
    """(A's and B's boxes, A's scale boxes) of a launch's maps, sorted."""
    fp8 = sorted(tuple(box[:2]) for dtype, box in case["maps"] if dtype == _UINT8)
    sfa = sorted(tuple(box[:2]) for dtype, box in case["maps"] if dtype == _FLOAT32 and box[1] == 1)
    return fp8, sfa


def test_tail_boxes_end_where_m_and_n_do(observed_without_memo):
    """Besides the whole boxes a launch encodes A's tail box (the rows M leaves its last m-block, in a
    cluster those M leaves the CTA it cuts), the MN-major A scales' (those rows rounded up to 4
    floats) and B's (the rows N leaves its last n-block), and nothing else. Under
    MOE_FP8_TIGHT_BOXES=0 only the whole boxes."""
    for case in observed_without_memo["tail_maps"]:
        (m, n, _), plan = case["shape"], case["plan"]
        block_m, block_n = plan["block_m"], plan["block_n"]
        share = block_m // plan["multicast"]
        tail = m % block_m or block_m
        assert plan["tight_boxes"] == 1, case
        fp8 = [(128, share), (128, tail % share or share), (128, block_n)]
        fp8 += [(128, n % block_n)] if n % block_n else []
        sfa = [(block_m, 1), (min(-(-tail // 4) * 4, block_m), 1)]
        assert _boxes(case) == (sorted(fp8), sorted(sfa)), case
    for case in observed_without_memo["whole_maps"]:
        plan = case["plan"]
        assert plan["tight_boxes"] == 0, case
        fp8 = sorted([(128, plan["block_m"] // plan["multicast"]), (128, plan["block_n"])])
        assert _boxes(case) == (fp8, [(plan["block_m"], 1)]), case
