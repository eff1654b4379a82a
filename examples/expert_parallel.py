"""One MegaMoELayer sharded over torchrun ranks (expert parallelism), checked against one process.

Every rank builds the same full weights from a shared seed and loads them; the layer keeps only
the rank's experts. Each rank then routes its own tokens (a different count per rank), and the
output is compared with a single-process layer that holds every expert.

    torchrun --standalone --nproc-per-node 2 examples/expert_parallel.py     # CPU (gloo) is fine
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.testing.numeric import calc_diff  # noqa: E402
from moe_runtime import MegaMoELayer, RouterConfig, init_distributed  # noqa: E402
from moe_runtime.dist import rank_print  # noqa: E402

kHidden, kIntermediate, kExperts, kTopK = 256, 128, 16, 4


def make_layer(ep_group, device):
    router = RouterConfig(scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                          use_score_bias=True)
    return MegaMoELayer(kHidden, kIntermediate, kExperts, kTopK, router=router, shared_intermediate_size=128,
                        weights="fp8", ep_group=ep_group, num_max_tokens_per_rank=256, device=device)


def main() -> None:
    ctx = init_distributed()
    generator = torch.Generator().manual_seed(1234)

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=generator) * scale).to(ctx.device)

    weights = dict(router_weight=randn(kExperts, kHidden, scale=kHidden**-0.5 * 2),
                   gate_up=randn(kExperts, 2 * kIntermediate, kHidden, scale=kHidden**-0.5).bfloat16(),
                   down=randn(kExperts, kHidden, kIntermediate, scale=kIntermediate**-0.5).bfloat16(),
                   score_bias=randn(kExperts, scale=0.1),
                   shared_gate_up=randn(256, kHidden, scale=kHidden**-0.5).bfloat16(),
                   shared_down=randn(kHidden, 128, scale=128**-0.5).bfloat16())

    sharded = make_layer(ctx.ep_group, ctx.device)
    sharded.load_weights(**weights)
    tokens = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(32 + 16 * ctx.rank, kHidden, generator=tokens).bfloat16().to(ctx.device)
    # The reference: every expert in this one process. Its group must hold this rank alone (None
    # would mean the whole world under torchrun, i.e. the same sharding); new_group is collective.
    alone = [dist.new_group([r]) for r in range(ctx.world_size)][ctx.rank] if ctx.world_size > 1 else None
    with torch.no_grad():
        out = sharded(x)
        whole = make_layer(alone, ctx.device)
        whole.load_weights(**weights)
        assert whole.num_local_experts == kExperts, "the reference holds every expert"
        expected = whole(x)
    rank_print(f"{x.shape[0]} tokens, experts {list(ctx.placement(kExperts).local_experts)}: "
               f"calc_diff vs single process {calc_diff(out, expected):.2e}")
    ctx.destroy()


if __name__ == "__main__":
    main()
    # Leave without interpreter teardown: gloo's worker threads can abort a rank at exit after the
    # groups are destroyed (a known PyTorch issue).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
