"""The plan DeepGEMM's SM90 FP8 GEMM would pick for a problem, beside ours, without a GPU.

DeepGEMM (deepseek-ai/DeepGEMM 54e2261, the peer in .peer/) chooses block sizes and clusters from a
cost model of L1 and L2 traffic over wave efficiency (csrc/jit_kernels/heuristics/sm90.hpp); this is
that model re-expressed here, so a gap between the two kernels can first be split into "different
plans" and "the same plan, run differently" before a device call. Observed plans it agrees with
(bench/RESULTS.md): 4096 x 7168 x 16384 on 256 x 128 tiles, 3 stages, clusters sharing A; 128 x
2112 x 7168 on 64 x 32, 16 stages; 128 x 4096 x 7168 on 64 x 64, 13 stages; 4096 x 2112 x 7168 on
128 x 192 tiles in clusters sharing B.

    python scripts/peer_plans.py                       # the 21 dense cells of issue 3
    python scripts/peer_plans.py --m 128 --n 7168 --k 16384
    python scripts/peer_plans.py --groups 4 --contiguous 8192 --n 4096 --k 7168
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

kRepo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [kRepo, os.path.join(kRepo, "scripts"), os.path.join(kRepo, "bench")]

from bench_gemm import SHAPES  # noqa: E402  (issue 3's N x K pairs)
from deepgemm_once import add_problem_args, problem_rows  # noqa: E402  (the same problem options)

kSmemCapacity = 232448  # bytes of shared memory the peer plans with
kMaxStages = 16
kBlockK = 128
kDenseCells = [(m, n, k) for m in (64, 128, 4096) for n, k in SHAPES]


@dataclasses.dataclass(frozen=True)
class PeerPlan:
    block_m: int
    block_n: int
    stages: int
    cluster_m: int  # CTAs of adjacent m-blocks sharing B
    cluster_n: int  # CTAs of adjacent n-blocks sharing A
    m_blocks: int
    n_blocks: int
    waves: int

    def describe(self) -> str:
        cluster = "" if self.cluster_m * self.cluster_n == 1 else (" c2 A" if self.cluster_n == 2 else " c2 B")
        # The peer's SM90 scheduler turns a pair's multicast off where the pair would be one block.
        if (self.cluster_m, self.m_blocks) == (2, 1) or (self.cluster_n, self.n_blocks) == (2, 1):
            cluster += " (nothing to share: clusters in name)"
        return f"{self.block_m}x{self.block_n} s{self.stages}{cluster}, {self.m_blocks * self.n_blocks} tiles"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _align(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _stages(block_m: int, block_n: int, k: int) -> int:
    """Stages that fit beside D's bf16 tile, the barriers and all K blocks' B scales (twice where a
    tile's columns straddle two 128-column scale blocks)."""
    b_scale_rows = 1 if kBlockK % block_n == 0 else 2
    extra = _align(block_m * block_n * 2, 1024) + kMaxStages * 16 + _align(_cdiv(k, kBlockK) * 4 * b_scale_rows, 8)
    per_stage = block_m * kBlockK + block_n * kBlockK + _align(block_m * 4, 128)
    return min((kSmemCapacity - extra) // per_stage, kMaxStages)


def _candidates(m: int, contiguous: bool, num_sms: int):
    block_ms = [128] if contiguous else [64, 128] + ([16] if m <= 16 else []) + ([32] if m <= 32 else []) + [256]
    for cluster_m, cluster_n in ((1, 1), (1, 2), (2, 1)):
        if num_sms % (cluster_m * cluster_n):
            continue  # whole clusters on the SMs
        for block_m in block_ms:
            for block_n in range(16, 193, 16):
                # The kernel unrolls over the B-scale boundary: block N past 128 must divide evenly.
                over = block_n - kBlockK
                if over > 0 and block_n % over and kBlockK % over:
                    continue
                if block_m > 128 and block_n > 128:
                    continue
                yield cluster_m, cluster_n, block_m, block_n


def peer_plan(m: int, n: int, k: int, num_sms: int = 132, contiguous: bool = False) -> PeerPlan:
    """The lowest modelled cycle count; earlier candidates win ties, as in the peer's loop."""
    l2_bytes_per_cycle = int(min(64.0 * num_sms, 8e6 / 1.3e3))
    l1_bytes_per_cycle = 128 * num_sms
    best, best_cycles = None, None
    for cluster_m, cluster_n, block_m, block_n in _candidates(m, contiguous, num_sms):
        stages = _stages(block_m, block_n, k)
        if stages < 3 or (block_m * block_n < 128 * 192 and stages < 4):
            continue
        m_blocks, n_blocks = _cdiv(m, block_m), _cdiv(n, block_n)
        tiles = m_blocks * n_blocks
        waves = _cdiv(tiles, num_sms)
        d_bytes = block_m * block_n * 2
        l2 = k * (block_m // cluster_n + block_n // cluster_m)
        l1 = k * (block_m + block_n) + k * (max(64, block_m) + block_n) + d_bytes
        cycles = max((l2 + d_bytes) * tiles // l2_bytes_per_cycle, (l1 + d_bytes) * tiles // l1_bytes_per_cycle)
        cycles = int(cycles / (tiles / (waves * num_sms)))
        if cluster_m * cluster_n > 1 and waves <= 1:
            continue  # the peer rules clusters out in one wave
        if best_cycles is None or cycles < best_cycles:
            best = PeerPlan(block_m, block_n, stages, cluster_m, cluster_n, m_blocks, n_blocks, waves)
            best_cycles = cycles
    return best


def our_plan(m: int, n: int, k: int, num_sms: int, scale_load: int, groups: int = 0) -> str:
    """Our heuristic's plan (kernels._C; no GPU needed). scale_load as fp8_gemm_nt_config's."""
    from kernels.jit import native_module

    kw = dict(gemm_type=1, num_groups=groups) if groups else {}
    c = native_module().fp8_gemm_nt_config(m, n, k, num_sms, scale_load=scale_load, **kw)
    cluster = "" if c["multicast"] == 1 else (" c2 B" if c["share_b"] else " c2 A")
    split = f" split {c['tail_splits']}" if c["tail_splits"] > 1 else ""
    return f"{c['block_m']}x{c['block_n']} s{c['num_stages']}{cluster}{split}, {c['grid']} CTAs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_problem_args(p)
    p.set_defaults(m=None)  # without --m (or --groups): issue 3's 21 dense cells
    p.add_argument("--sms", type=int, default=132)
    args = p.parse_args()
    if args.groups:
        problems = [(problem_rows(args), args.n, args.k, args.groups)]
    elif args.m is not None:
        problems = [(args.m, args.n, args.k, 0)]
    else:
        problems = [(m, n, k, 0) for m, n, k in kDenseCells]
    print("| cell | DeepGEMM (modelled) | ours, K-major A scales | ours, MN-major A scales |")
    print("| --- | --- | --- | --- |")
    for m, n, k, groups in problems:
        peer = peer_plan(m, n, k, args.sms, contiguous=bool(groups)).describe()
        cell = f"{groups} x {m // groups}, {n} x {k}" if groups else f"{m} x {n} x {k}"
        print(f"| {cell} | {peer} | {our_plan(m, n, k, args.sms, -1, groups)} | "
              f"{our_plan(m, n, k, args.sms, 1, groups)} |")


if __name__ == "__main__":
    main()
