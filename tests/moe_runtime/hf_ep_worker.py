"""torchrun worker of test_hf.py: replace_moe_blocks with an expert-parallel group of all ranks.

Every rank builds the same tiny model, computes its own tokens' logits with the original model,
then with the replaced one (half the experts per rank, forwards as collectives over the ranks),
and writes ``<local experts of the first block> <experts> <calc_diff>`` to ``OUT/rank<r>.txt``.
"""

import copy
import sys
from pathlib import Path

import torch

from kernels.testing.numeric import calc_diff
from moe_runtime import init_distributed
from moe_runtime.integrations import MegaMoEBlock, replace_moe_blocks

sys.path.insert(0, str(Path(__file__).parent))
from hf_models import kCommon, tiny_model  # noqa: E402
from torchrun_helper import exit_worker  # noqa: E402


def main(family: str, out_dir: str) -> None:
    ctx = init_distributed()
    model = tiny_model(family, torch.float32, seed=1234)
    ids = torch.randint(0, kCommon["vocab_size"], (1, 5 + 4 * ctx.rank),
                        generator=torch.Generator().manual_seed(ctx.rank))
    with torch.no_grad():
        expected = model(ids).logits
        replaced = replace_moe_blocks(copy.deepcopy(model), backend="reference", weights="bf16", ep_group=ctx.ep_group)
        got = replaced(ids).logits
    block = next(m for m in replaced.modules() if isinstance(m, MegaMoEBlock))
    line = f"{block.moe.num_local_experts} {block.moe.num_experts} {calc_diff(got, expected)}\n"
    Path(out_dir, f"rank{ctx.rank}.txt").write_text(line)
    exit_worker(ctx)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
