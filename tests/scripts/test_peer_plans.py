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
