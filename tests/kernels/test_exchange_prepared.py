"""PreparedExchange (kernels/exchange_prepared.py): one rank's forwards through it against the module's
functions and the reference plan (a child process per case, as the barrier tests), and its checks."""

from __future__ import annotations

import pytest
import torch

import kernels
from device_waits import assert_passed, child_main, run_in_child
from kernels.reference import exchange as exchange_reference
from test_exchange import check_combine, check_dispatch, check_index, make_problem
from test_exchange_barriers import barrier_group


def prepared_rounds(seed: int, num_local: int, num_tokens: int, top_k: int, hidden: int, alignment: int,
                    masked_max_rows: int) -> None:
    """One rank (its own barrier), two forwards through one PreparedExchange: count-sizes into a
    poisoned count matrix (a row stride past E + 1), the dispatch of bfloat16 rows quantized in the
    kernel, the combine of random expert outputs. Each step against the module's functions and the
    reference plan: the matrix row and the sizes, every pair's row (at the position its ``within``
    gives) and the layout index, each received row in its combine slot; three barriers a forward."""
    torch.manual_seed(seed)
    num_experts = num_local
    # The staged backend's receive rows: every pair, plus each expert's padding.
    capacity = -(-(num_tokens * top_k + num_local * (alignment - 1)) // alignment) * alignment
    pairs_per_rank = num_tokens * top_k + 3
    peers = kernels.ExchangePeers(
        (torch.randint(0, 256, (capacity, hidden), dtype=torch.uint8, device="cuda"),),
        (torch.full((capacity, hidden // 128), float("nan"), device="cuda"),),
        (torch.full((capacity,), float("nan"), device="cuda"),),
        (torch.full((capacity,), -7, dtype=torch.int32, device="cuda"),),
        (torch.full((pairs_per_rank, hidden), float("nan"), dtype=torch.bfloat16, device="cuda"),), 0, pairs_per_rank)
    counts = torch.full((1, num_experts + 3), -5, dtype=torch.int32, device="cuda")
    count_rows = torch.tensor([counts[0].data_ptr()], dtype=torch.int64, device="cuda")
    flag_rows, flags = barrier_group(1)
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    prepared = kernels.PreparedExchange(peers, counts, count_rows, kernels.ExchangeBarrier(flag_rows, flags[0], done),
                                        num_local, capacity)
    for _ in range(2):
        topk_idx = torch.rand(num_tokens, num_experts).topk(top_k, dim=1).indices  # distinct experts per token
        topk_idx[torch.rand(num_tokens, top_k) < 0.1] = -1
        topk_idx = topk_idx.cuda()
        x = torch.randn(num_tokens, hidden, device="cuda").to(torch.bfloat16)
        weights = torch.rand(num_tokens, top_k, device="cuda")
        within, pending = prepared.count_sizes(topk_idx, alignment, masked_max_rows)
        index = prepared.dispatch(x, topk_idx, weights, within, alignment, masked_max_rows, 0)
        torch.cuda.synchronize()
        _, row = kernels.exchange_count(topk_idx.cpu(), num_experts)
        assert torch.equal(counts[0, : num_experts + 1].cpu(), row) and bool((counts[0, num_experts + 1:] == -5).all())
        matrix = row.view(1, -1)
        assert pending.wait() == kernels.exchange_sizes(matrix, 0, num_local, alignment, masked_max_rows)
        plan = exchange_reference.plan_exchange(matrix[:, :num_experts].long().view(1, 1, num_local).transpose(0, 1),
                                                0, alignment, masked_max_rows)
        xq, xs = kernels.per_token_cast_to_fp8(x, use_ue8m0=False, gran_k=128)
        inputs = {"xq": xq.view(torch.uint8), "xs": xs, "topk_idx": topk_idx, "topk_weights": weights}
        check_dispatch(peers, inputs, {"within": within, "num_local_experts": num_local}, plan)
        m = plan.num_layout_rows
        check_index(kernels.exchange.ExchangeIndex(index.m_indices[:m], index.global_ids[:m], index.masked_m), plan, 0)
        expert_out = torch.randn(m, hidden, device="cuda").to(torch.bfloat16)
        for c in peers.combine:
            c.fill_(float("nan"))
        prepared.combine(expert_out, index.m_indices[:m])
        torch.cuda.synchronize()
        rows = (index.m_indices[:m] >= 0).nonzero().view(-1).cpu().tolist()
        slots = peers.slots[0].cpu()
        check_combine(peers, expert_out, {(int(slots[r]) // peers.pairs_per_rank, int(slots[r]) % peers.pairs_per_rank): r
                                          for r in rows})
    assert flags[0].tolist() == [6, 6] and int(done) == 0, "three barriers a forward, the CTA counter back at zero"


@pytest.mark.gpu
@pytest.mark.parametrize("num_local,num_tokens,top_k,hidden,alignment,masked_max_rows",
                         [(16, 37, 4, 384, 16, 8), (32, 300, 8, 7168, 128, 32), (8, 3, 2, 256, 128, 32)])
def test_gpu_prepared_exchange_matches_the_functions(seed, num_local, num_tokens, top_k, hidden, alignment,
                                                     masked_max_rows):
    assert_passed(run_in_child(__file__, "prepared_rounds", 20, seed=seed, num_local=num_local,
                               num_tokens=num_tokens, top_k=top_k, hidden=hidden, alignment=alignment,
                               masked_max_rows=masked_max_rows))


def test_prepared_exchange_checks():
    peers, _, _, _ = make_problem(2, 4, 8, 2, 128, 0, "cpu", 3)
    counts, rows = torch.zeros(2, 9, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="runs on CUDA only"):
        kernels.PreparedExchange(peers, counts, rows, None, 4, 4)
    with pytest.raises(TypeError, match="peers must be ExchangePeers"):
        kernels.PreparedExchange(peers.acts, counts, rows, None, 4, 4)
    # Lazily negated views (the negative bit), named before the device: the kernels take their addresses.
    with pytest.raises(ValueError, match="PreparedExchange: counts must not be a lazily negated view"):
        kernels.PreparedExchange(peers, torch._neg_view(counts), rows, None, 4, 4)
    with pytest.raises(ValueError, match="PreparedExchange: count_rows must not be a lazily negated view"):
        kernels.PreparedExchange(peers, counts, torch._neg_view(rows), None, 4, 4)


if __name__ == "__main__":  # a child of run_in_child
    child_main(globals())
