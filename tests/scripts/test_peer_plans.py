"""scripts/peer_plans.py's model of DeepGEMM's SM90 plan choice against the plans its kernels were
seen to run (bench/RESULTS.md: generated kernels, ncu kernel names, SASS comparisons)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(_SCRIPTS))
_spec = importlib.util.spec_from_file_location("peer_plans", _SCRIPTS / "peer_plans.py")
peer_plans = importlib.util.module_from_spec(_spec)
sys.modules["peer_plans"] = peer_plans  # its dataclass looks its module up
_spec.loader.exec_module(peer_plans)


@pytest.mark.parametrize("m, n, k, contiguous, block_m, block_n, stages, cluster_m, cluster_n", [
    (4096, 7168, 16384, False, 256, 128, 3, 1, 2),
    (4096, 4096, 7168, False, 256, 128, 3, 1, 2),
    (128, 2112, 7168, False, 64, 32, 16, 1, 1),
    (128, 4096, 7168, False, 64, 64, 13, 1, 1),
    (4096, 2112, 7168, False, 128, 192, 4, 2, 1),
    (4 * 8192, 4096, 7168, True, 128, 192, 4, 2, 1),
])
def test_plans_the_peer_was_seen_to_run(m, n, k, contiguous, block_m, block_n, stages, cluster_m, cluster_n):
    plan = peer_plans.peer_plan(m, n, k, 132, contiguous=contiguous)
    assert (plan.block_m, plan.block_n, plan.stages, plan.cluster_m, plan.cluster_n) == (
        block_m, block_n, stages, cluster_m, cluster_n)


def test_clusters_over_a_single_block_are_named_as_such():
    plan = peer_plans.peer_plan(64, 24576, 1536, 132)
    assert plan.cluster_m == 2 and plan.m_blocks == 1
    assert "nothing to share" in plan.describe()
    assert "nothing to share" not in peer_plans.peer_plan(4096, 2112, 7168, 132).describe()


def test_one_wave_plans_have_no_clusters():
    for m, n, k in peer_plans.kDenseCells:
        plan = peer_plans.peer_plan(m, n, k, 132)
        assert plan.waves > 1 or plan.cluster_m * plan.cluster_n == 1, (m, n, k)


# The 24 kernels DeepGEMM 54e2261 generated for bench_deepgemm.py's 21 dense cells and 4 contiguous ones on
# an H200 (2026-12-06, its JIT cache's kernel.cu files): (N, K, contiguous, block M, block N, stages, cluster
# size, multicast on A). M is a run-time argument there, so a plan belongs to an (N, K), not to a cell; the two
# group counts of a contiguous N x K share one plan.
_SEEN = {
    (576, 7168, False, 64, 16, 16, 1, False), (576, 7168, False, 128, 144, 5, 1, False),
    (2112, 7168, False, 64, 16, 16, 1, False), (2112, 7168, False, 64, 32, 16, 1, False),
    (2112, 7168, False, 128, 192, 4, 2, False), (4096, 7168, False, 64, 32, 16, 1, False),
    (4096, 7168, False, 64, 64, 13, 1, False), (4096, 7168, False, 256, 128, 3, 2, True),
    (7168, 2048, False, 64, 64, 13, 1, False), (7168, 2048, False, 64, 112, 9, 1, False),
    (7168, 2048, False, 256, 128, 3, 2, True), (7168, 16384, False, 64, 64, 13, 1, False),
    (7168, 16384, False, 64, 112, 9, 1, False), (7168, 16384, False, 256, 128, 3, 2, True),
    (24576, 1536, False, 64, 96, 10, 2, False), (24576, 1536, False, 128, 192, 4, 1, False),
    (24576, 1536, False, 256, 128, 3, 2, True), (32768, 512, False, 64, 128, 8, 2, False),
    (32768, 512, False, 128, 128, 5, 2, True), (32768, 512, False, 256, 128, 3, 2, True),
    (4096, 7168, True, 128, 192, 4, 2, False), (7168, 2048, True, 128, 192, 4, 2, False),
}


def test_the_model_gives_exactly_the_kernels_the_peer_generated():
    cells = [(m, n, k, False) for m, n, k in peer_plans.kDenseCells]
    cells += [(groups * rows, n, k, True) for groups, rows in ((4, 8192), (8, 4096)) for n, k in ((4096, 7168),
                                                                                                 (7168, 2048))]
    modelled = set()
    for m, n, k, contiguous in cells:
        p = peer_plans.peer_plan(m, n, k, 132, contiguous=contiguous)
        modelled.add((n, k, contiguous, p.block_m, p.block_n, p.stages, p.cluster_m * p.cluster_n, p.cluster_n == 2))
    assert modelled == _SEEN
