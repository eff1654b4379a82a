"""Multi-rank checks, run under torchrun by test_multirank.py (gloo; CPU, or CUDA with ranks sharing a GPU).

Usage: ``torchrun --nproc-per-node N ep_worker.py [--device cpu|cuda] [--symm-backend host|torch|nvshmem]``.

* uneven_all_gather / reduce_rows_to_owners with a rank that has no rows;
* a SymmBuffer (host backend by default): peer reads, peer writes (pushes), signals, barrier, destroy;
* MegaMoELayer with expert parallelism equals the single-process layer for each rank's slice of
  the tokens (one rank with zero tokens, then other batch sizes): bit for bit on CPU, within
  calc_diff 1e-5 on CUDA.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from kernels.testing.numeric import calc_diff
from moe_runtime import MegaMoELayer, RouterConfig, get_symm_buffer_for_mega_moe, init_distributed, rank_print
from torchrun_helper import exit_worker
from moe_runtime.dist import reduce_rows_to_owners, uneven_all_gather

H, I, E, S = 128, 128, 8, 64


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"rank {dist.get_rank()}: {message}")


def check_collectives(rank: int, world: int, device: torch.device) -> None:
    counts = [(r * 3) % 4 for r in range(world)]  # rank 0 has no rows
    rows = torch.full((counts[rank], 2, 3), rank, dtype=torch.bfloat16, device=device)
    gathered, got = uneven_all_gather(rows)
    _check(got == counts, f"counts {got} != {counts}")
    expected = torch.cat([torch.full((c, 2, 3), r, dtype=torch.bfloat16) for r, c in enumerate(counts)])
    _check(torch.equal(gathered.cpu(), expected), "uneven_all_gather rows")
    partial = torch.arange(sum(counts) * 2, dtype=torch.float32, device=device).view(-1, 2) * (rank + 1)
    mine = reduce_rows_to_owners(partial, counts)
    offset = sum(counts[:rank])
    full = torch.arange(sum(counts) * 2, dtype=torch.float32).view(-1, 2) * sum(range(1, world + 1))
    _check(mine.device == device and torch.equal(mine.cpu(), full[offset: offset + counts[rank]]),
           "reduce_rows_to_owners")


def check_symm_buffer(ctx, backend: str, device: torch.device) -> None:
    rank, world = ctx.rank, ctx.world_size
    group = ctx.cpu_group if backend == "host" else ctx.group
    buf = get_symm_buffer_for_mega_moe(group, num_experts=2 * world, num_max_tokens_per_rank=5,
                                       num_topk=2, hidden=H, intermediate_hidden=I, backend=backend,
                                       device=device)
    with buf:
        _check(buf.world_size == world and len(set(buf.peer_ptrs)) == world, "peer pointers")
        _check(all(p % 128 == 0 for name in buf.layout.names for p in buf.view_ptrs(name)), "view alignment")
        idx = buf.view("topk_idx")
        _check(idx.device.type == device.type, f"views on {idx.device}, expected {device}")
        pattern = torch.arange(idx.numel(), device=device).view(idx.shape)
        idx.copy_(pattern + 1000 * rank)
        buf.barrier()
        for peer in range(world):
            seen = buf.peer_view("topk_idx", peer)
            _check(torch.equal(seen, pattern + 1000 * peer), f"read of {peer}")
        # Push: write into the next rank's combine slot and signal it, then read what was pushed here.
        target = (rank + 1) % world
        buf.peer_view("combine", target)[rank].fill_(rank + 1)
        slots = buf.config.signal_slots
        buf.peer_view("signals", target)[slots.barrier][rank] = rank + 7
        buf.barrier()
        source = (rank - 1) % world
        _check(bool((buf.view("combine")[source] == source + 1).all()), "pushed combine rows")
        signals = buf.view("signals")[slots.barrier]
        _check(int(signals[source]) == source + 7 and int(signals.sum()) == source + 7, f"signals {signals}")
        buf.barrier()
    _check(buf.destroyed, "destroy on exit")


_kCases = [
    ("bf16", RouterConfig(), 2, False),
    ("fp8", RouterConfig(scoring_func="sigmoid", n_group=4, topk_group=2, use_score_bias=True,
                         routed_scaling_factor=2.5), 3, True),
    ("fp4", RouterConfig(norm_topk_prob=False), 2, True),
]


def _build(fmt, router, top_k, shared, group, seed, device):
    g = torch.Generator().manual_seed(seed)
    layer = MegaMoELayer(H, I, E, top_k, router=router, weights=fmt, backend="reference", ep_group=group,
                         shared_intermediate_size=S if shared else 0, num_max_tokens_per_rank=32, device=device)
    w = dict(router_weight=torch.randn(E, H, generator=g),
             gate_up=(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16),
             down=(torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16))
    if router.use_score_bias:
        w["score_bias"] = torch.randn(E, generator=g) * 0.05
    if shared:
        w["shared_gate_up"] = (torch.randn(2 * S, H, generator=g) / H ** 0.5).to(torch.bfloat16)
        w["shared_down"] = (torch.randn(H, S, generator=g) / S ** 0.5).to(torch.bfloat16)
    return layer.load_weights(**w)


def check_expert_parallel(ctx, alone, device: torch.device) -> None:
    rank, world = ctx.rank, ctx.world_size
    steps = [[(5, 0, 7, 3)[r % 4] for r in range(world)],     # rank 1 has no tokens
             [(r * 11) % 17 for r in range(world)],          # rank 0 has no tokens
             [0] * world]                                    # nobody has tokens
    for case, (fmt, router, top_k, shared) in enumerate(_kCases):
        ep = _build(fmt, router, top_k, shared, ctx.ep_group, case, device)
        single = _build(fmt, router, top_k, shared, alone, case, device)
        _check(ep.num_local_experts == E // world and single.num_local_experts == E, "placement")
        for step, counts in enumerate(steps):
            tokens = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(100 + step))
            tokens = tokens.to(device=device, dtype=torch.bfloat16)
            offset = sum(counts[:rank])
            mine = tokens[offset: offset + counts[rank]]
            expected = single(tokens)[offset: offset + counts[rank]]
            got = ep(mine)
            _check(got.shape == mine.shape, f"{fmt} step {step}: shape {tuple(got.shape)}")
            if device.type == "cuda":
                # cuBLAS may pick another kernel for the router and shared-expert GEMMs when a rank
                # holds fewer rows than the single process, so the last bit can differ there.
                diff = calc_diff(got, expected)
                _check(diff < 1e-5, f"{fmt} step {step}: EP vs single process calc_diff {diff}")
            elif not torch.equal(got, expected):
                gap = (got.float() - expected.float()).abs().max().item()
                _check(False, f"{fmt} step {step}: EP differs from the single process by up to {gap}")


def check_host_buffer_failure_leaves_nothing(ctx) -> None:
    """Rank 1 cannot reserve its shared-memory file: every rank raises the same error (none waits
    for the others) and no file is left in /dev/shm; a buffer made after it works."""
    import glob
    import os

    from moe_runtime.symm import SymmBuffer, ViewSpec, compute_layout

    layout = compute_layout([ViewSpec("x", (64,), torch.float32)])
    before = set(glob.glob("/dev/shm/moe_symm_*"))
    real = os.posix_fallocate

    def failing(fd, offset, length):
        raise OSError(28, "No space left on device (test)")

    if ctx.rank == 1:
        os.posix_fallocate = failing
    message = ""
    try:
        SymmBuffer(layout, backend="host", device="cpu")
    except RuntimeError as err:
        message = str(err)
    finally:
        os.posix_fallocate = real
    _check("rank 1 cannot reserve" in message, f"every rank raises rank 1's error, got {message!r}")
    dist.barrier()
    _check(set(glob.glob("/dev/shm/moe_symm_*")) <= before, "a shared-memory file was left behind")
    buf = SymmBuffer(layout, backend="host", device="cpu")
    buf.peer_view("x", (ctx.rank + 1) % ctx.world_size).fill_(ctx.rank + 1)
    buf.barrier()
    _check(bool((buf.view("x") == (ctx.rank - 1) % ctx.world_size + 1).all()), "a buffer made afterwards works")
    buf.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--symm-backend", choices=["host", "torch", "nvshmem"], default="host")
    args = parser.parse_args()
    ctx = init_distributed(device=args.device)
    rank, world = ctx.rank, ctx.world_size
    _check(ctx.is_distributed, "expected torchrun's environment")
    # A group of one per rank: the single-process reference inside the same job.
    alone = [dist.new_group([r]) for r in range(world)][rank]
    check_collectives(rank, world, ctx.device)
    check_symm_buffer(ctx, args.symm_backend, ctx.device)
    if args.device == "cpu" and world > 1:
        check_host_buffer_failure_leaves_nothing(ctx)
    check_expert_parallel(ctx, alone, ctx.device)
    dist.barrier()
    rank_print(f"ep worker ok: {world} ranks, {ctx.device.type}, {args.symm_backend} SymmBuffer, "
               f"{ctx.backend}", only_rank=0)
    exit_worker(ctx)


if __name__ == "__main__":
    main()
