"""The staged (or low-latency) expert-parallel layer on several ranks against the single-process
reference layer on each rank's slice of the tokens, run under torchrun by test_staged.py.

Usage: ``torchrun --nproc-per-node N staged_worker.py [--device cpu|cuda] [--preset small|deepseek-v3]
[--symm-backend host|torch|nvshmem] [--backend staged|low_latency]``.
"""

from __future__ import annotations

import argparse

import torch

import kernels
from kernels.testing.numeric import calc_diff
from moe_runtime.backends import MoEProblem
from moe_runtime.backends.staged import StagedDispatchCombine
from staged_cases import E, H, I, S, kTolerance, layer_pair
from torchrun_helper import exit_worker


def _worker_check(condition: bool, message: str) -> None:
    import torch.distributed as dist
    if not condition:
        raise AssertionError(f"rank {dist.get_rank()}: {message}")


def _check_every_rank_raises_on_one_ranks_invalid_id(layer, ctx, hidden: int, num_experts: int) -> None:
    """An expert id outside [-1, E) on rank 1 only: every rank raises the same ValueError (the ids
    are counted in the exchanged count matrix), none waits for the others, and the buffers stay
    usable (the caller's forwards follow)."""
    import torch.distributed as dist

    dispatch_combine, _ = layer._backend(ctx.device)
    g = torch.Generator().manual_seed(7 + ctx.rank)
    x = torch.randn(6, hidden, generator=g).to(device=ctx.device, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[: layer.top_k] for _ in range(6)]).to(ctx.device)
    weights = torch.rand(6, layer.top_k, generator=g).to(ctx.device)
    if ctx.rank == 1:
        idx[2, 0] = num_experts + 5
    message = ""
    try:
        dispatch_combine.dispatch(x, idx, weights)
    except ValueError as err:
        message = str(err)
    expected = [0] * dist.get_world_size()
    expected[1] = 1
    _worker_check(f"ids outside that per rank: {expected}" in message,
                  f"every rank raises on rank 1's invalid id, got {message!r}")


def _check_every_rank_raises_on_an_oversized_layout(ctx, hidden: int) -> None:
    """Top-k larger than a rank's experts with every id on expert 0 (a router never does this):
    rank 0's layout outgrows the receive capacity. Every rank raises the same RuntimeError after
    the dispatch (rows past the views dropped, none written outside them), and the next forward on
    the same buffers matches a per-token sum of the pairs sent."""
    import torch.distributed as dist

    world = dist.get_world_size()
    num_local, top_k, capacity = 2, 3, 200
    problem = MoEProblem(hidden, 64, num_local * world, top_k, "fp8", torch.bfloat16, ctx.device, world, capacity,
                         use_fp8_dispatch=True)
    pair = StagedDispatchCombine(problem, ctx.ep_group, ctx.rank * num_local)
    x = torch.randn(capacity, hidden, generator=torch.Generator().manual_seed(11 + ctx.rank))
    x = x.to(device=ctx.device, dtype=torch.bfloat16)
    weights = torch.rand(capacity, top_k, generator=torch.Generator().manual_seed(3)).to(ctx.device)
    message = ""
    try:
        pair.dispatch(x, torch.zeros(capacity, top_k, dtype=torch.int64, device=ctx.device), weights)
    except RuntimeError as err:
        message = str(err)
    _worker_check("rank 0 would receive" in message, f"every rank raises on the oversized layout, got {message!r}")
    idx = torch.stack([torch.randperm(num_local * world, generator=torch.Generator().manual_seed(ctx.rank * 100 + t))
                       [:top_k] for t in range(5)]).to(ctx.device)
    small = x[:5]
    out = pair.dispatch(small, idx, weights[:5])
    # A stand-in for the experts: the dequantized row times the pair's weight.
    expert_out = (out.x.float() * out.x_sf.repeat_interleave(128, dim=1) * out.topk_weights).to(torch.bfloat16)
    out.handle.out_dtype = torch.float32
    y = pair.combine(expert_out, out.handle)
    xq, xs = kernels.per_token_cast_to_fp8(small, use_ue8m0=False, gran_k=128)
    rows = xq.float() * xs.repeat_interleave(128, dim=1)
    expected = (rows.unsqueeze(1) * weights[:5].unsqueeze(-1)).to(torch.bfloat16).float().sum(1)
    _worker_check(calc_diff(y, expected) < 1e-6, "a forward after the raise still combines every pair")


def worker_main() -> None:
    """Staged EP layer vs the single-process reference layer on each rank's slice of the tokens.

    ``--preset small``: a 16-expert layer (ranks may share a GPU). ``--preset deepseek-v3``: the
    DeepSeek-V3 layer (7168 hidden, 2048 intermediate, 256 experts in 8 groups, top-8, a shared
    expert), random routing and a skewed one (expert 1 in every token's top-k), one GPU per rank.
    ``--symm-backend`` picks the SymmBuffer backend (``MOE_SYMM_BACKEND``)."""
    import os

    import torch.distributed as dist

    from moe_runtime import init_distributed, rank_print

    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--preset", choices=["small", "deepseek-v3"], default="small")
    parser.add_argument("--symm-backend", choices=["host", "torch", "nvshmem"], default=None)
    parser.add_argument("--backend", choices=["staged", "low_latency"], default="staged")
    parser.add_argument("--weights", choices=["fp8", "bf16"], default="fp8",
                        help="bf16: the staged backend's bf16 pair (the reference exchange, bf16 grouped GEMMs)")
    args = parser.parse_args()
    if args.symm_backend:
        os.environ["MOE_SYMM_BACKEND"] = args.symm_backend
    ctx = init_distributed(device=args.device)
    rank, world = ctx.rank, ctx.world_size
    alone = [dist.new_group([r]) for r in range(world)][rank]
    steps = [[(5, 0, 7, 3)[r % 4] for r in range(world)],      # rank 1 has no tokens
             [(r * 131) % 300 + 1 for r in range(world)],       # more than a block on some ranks
             [0] * world]                                     # nobody has tokens
    if args.preset == "deepseek-v3":
        if args.device != "cuda":
            raise SystemExit("--preset deepseek-v3 needs --device cuda")
        hidden, inter, num_experts, shared_inter = 7168, 2048, 256, 2048
        cases = [("deepseek-v3", False), ("deepseek-v3", True)]
        steps.insert(2, [2048] * world)                        # a prefill batch on every rank
        capacity = 2048 * world                                # the reference takes every rank's tokens
    else:
        hidden, inter, num_experts = (H, I, E) if args.device == "cpu" else (1024, 512, 16)
        shared_inter, cases, capacity = S, [("mixtral", False), ("deepseek", True)], 512
    for case, (router, skew) in enumerate(cases):
        ep, single = layer_pair(router, case, ctx.device, hidden, inter, num_experts, skew=skew,
                                 ep_group=ctx.ep_group, reference_group=alone, capacity=capacity,
                                 shared_inter=shared_inter, backend=args.backend, weights=args.weights)
        _worker_check(ep.backend_name == args.backend and ep.num_local_experts == num_experts // world, "placement")
        if args.backend == "staged" and args.weights != "bf16" and case == 0:
            _check_every_rank_raises_on_one_ranks_invalid_id(ep, ctx, hidden, num_experts)
            if args.preset == "small":
                _check_every_rank_raises_on_an_oversized_layout(ctx, hidden)
        for step, counts in enumerate(steps):
            tokens = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(100 + step))
            tokens = tokens.to(device=ctx.device, dtype=torch.bfloat16)
            offset = sum(counts[:rank])
            mine = tokens[offset: offset + counts[rank]]
            expected = single(tokens)[offset: offset + counts[rank]]
            got = ep(mine)
            _worker_check(got.shape == mine.shape, f"{router} step {step}: shape {tuple(got.shape)}")
            if counts[rank]:
                diff = calc_diff(got, expected)
                _worker_check(diff < kTolerance, f"{router} step {step}: staged EP vs reference calc_diff {diff}")
                rank_print(f"{router} skew={skew} tokens/rank={counts}: calc_diff {diff:.2e}", only_rank=0)
        del ep, single
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    backend = os.environ.get("MOE_SYMM_BACKEND", "default")
    rank_print(f"staged worker ok: {world} ranks, {ctx.device.type}, {args.preset}, {args.weights} weights, "
               f"{backend} SymmBuffer", only_rank=0)
    exit_worker(ctx)


if __name__ == "__main__":
    worker_main()
