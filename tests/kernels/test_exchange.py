"""kernels.exchange_dispatch / kernels.exchange_combine (kernels/exchange.py): the staged backend's
row exchange. P ranks simulated in one process (every rank's views ordinary tensors, "peer"
addresses plain pointers): each pair's row, scales, weight and slot word must land in the row the
plan gives it on its owner, and each received row's expert output in its source's combine slot,
against an independent per-pair loop. GPU: the same against the CPU path, views poisoned first.
The multi-rank layer tests (tests/moe_runtime) run the real peer writes."""

from __future__ import annotations

import re

import pytest
import torch

import kernels
from test_sass import sass


def make_problem(num_ranks: int, num_local: int, num_tokens: int, top_k: int, hidden: int, rank: int, device: str,
                 spare_rows: int = 5):
    """A routing of ``rank``'s tokens (distinct experts per token, some pairs unrouted), the pairs
    sorted by expert and each given a distinct row on its owner (shuffled), every rank's views
    poisoned. Returns (peers, inputs dict, order, rows)."""
    num_experts = num_ranks * num_local
    scores = torch.rand(num_tokens, num_experts)
    topk_idx = scores.topk(top_k, dim=1).indices
    topk_idx[torch.rand(num_tokens, top_k) < 0.1] = -1
    flat = topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, num_experts)
    order = torch.argsort(key, stable=True)[: int((flat >= 0).sum())]
    owner = flat[order] // num_local
    rows_per_rank = num_tokens * top_k + spare_rows
    rows = torch.empty_like(order)
    for q in range(num_ranks):
        mine = (owner == q).nonzero().view(-1)
        rows[mine] = torch.randperm(rows_per_rank)[: mine.numel()]
    pairs_per_rank = num_tokens * top_k + 3
    peers = kernels.ExchangePeers(
        tuple(torch.randint(0, 256, (rows_per_rank, hidden), dtype=torch.uint8, device=device) for _ in range(num_ranks)),
        tuple(torch.full((rows_per_rank, hidden // 128), float("nan"), device=device) for _ in range(num_ranks)),
        tuple(torch.full((rows_per_rank,), float("nan"), device=device) for _ in range(num_ranks)),
        tuple(torch.full((rows_per_rank,), -7, dtype=torch.int32, device=device) for _ in range(num_ranks)),
        tuple(torch.full((pairs_per_rank, hidden), float("nan"), dtype=torch.bfloat16, device=device)
              for _ in range(num_ranks)),
        rank, pairs_per_rank)
    inputs = {"xq": torch.randint(0, 256, (num_tokens, hidden), dtype=torch.uint8).to(device),
              "xs": torch.rand(num_tokens, hidden // 128).add_(0.5).to(device),
              "topk_idx": topk_idx.to(device), "topk_weights": torch.rand(num_tokens, top_k).to(device)}
    return peers, inputs, order.to(device), rows.to(device)


def expected_dispatch(peers, inputs, order, rows, num_local):
    """Per pair, what its owner's views must hold in its row."""
    k = inputs["topk_idx"].shape[1]
    for i in range(order.numel()):
        pair, row = int(order[i]), int(rows[i])
        q = int(inputs["topk_idx"].reshape(-1)[pair]) // num_local
        t = pair // k
        yield q, row, (inputs["xq"][t], inputs["xs"][t], inputs["topk_weights"].reshape(-1)[pair],
                       peers.rank * peers.pairs_per_rank + pair)


def check_dispatch(peers, inputs, order, rows, num_local):
    for q, row, (x, s, w, slot) in expected_dispatch(peers, inputs, order, rows, num_local):
        assert torch.equal(peers.acts[q][row].cpu(), x.cpu())
        assert torch.equal(peers.acts_sf[q][row].cpu(), s.cpu())
        assert float(peers.weights[q][row]) == float(w)
        assert int(peers.slots[q][row]) == slot


kCases = [(1, 4, 9, 2, 128), (3, 5, 37, 4, 384), (2, 16, 64, 8, 7168)]


@pytest.mark.parametrize("num_ranks,num_local,num_tokens,top_k,hidden", kCases)
def test_dispatch_then_combine_cpu(seed, num_ranks, num_local, num_tokens, top_k, hidden):
    rank = num_ranks - 1
    peers, inputs, order, rows = make_problem(num_ranks, num_local, num_tokens, top_k, hidden, rank, "cpu")
    kernels.exchange_dispatch(peers, **inputs, order=order, rows=rows, num_local_experts=num_local)
    check_dispatch(peers, inputs, order, rows, num_local)
    # Combine on an owner: its received rows go back to their sources' slots.
    owner_peers = kernels.ExchangePeers(peers.acts, peers.acts_sf, peers.weights, peers.slots, peers.combine, 0,
                                        peers.pairs_per_rank)
    received = torch.tensor([r for q, r, _ in expected_dispatch(peers, inputs, order, rows, num_local) if q == 0],
                            dtype=torch.int64)
    expert_out = torch.randn(peers.acts[0].shape[0], hidden).to(torch.bfloat16)
    kernels.exchange_combine(owner_peers, expert_out, received)
    for r in received.tolist():
        slot = int(peers.slots[0][r])
        assert torch.equal(peers.combine[slot // peers.pairs_per_rank][slot % peers.pairs_per_rank], expert_out[r])


def test_bad_arguments_name_the_argument():
    peers, inputs, order, rows = make_problem(2, 4, 8, 2, 128, 0, "cpu")
    with pytest.raises(ValueError, match="xs must be"):
        kernels.exchange_dispatch(peers, inputs["xq"], inputs["xs"].double(), inputs["topk_idx"],
                                  inputs["topk_weights"], order, rows, 4)
    with pytest.raises(ValueError, match="rows must be a 1-D int64 tensor of"):
        kernels.exchange_dispatch(peers, **inputs, order=order, rows=rows[:-1], num_local_experts=4)
    with pytest.raises(ValueError, match="num_local_experts must be"):
        kernels.exchange_dispatch(peers, **inputs, order=order, rows=rows, num_local_experts=0)
    with pytest.raises(ValueError, match="expert_out must be"):
        kernels.exchange_combine(peers, torch.zeros(4, 256, dtype=torch.bfloat16), rows)
    with pytest.raises(ValueError, match="combine\\[1\\] has"):
        kernels.ExchangePeers(peers.acts, peers.acts_sf, peers.weights, peers.slots,
                              (peers.combine[0], peers.combine[1][:2]), 0, peers.pairs_per_rank)
    with pytest.raises(ValueError, match="one tensor per rank"):
        kernels.ExchangePeers(peers.acts, peers.acts_sf[:1], peers.weights, peers.slots, peers.combine, 0, 4)
    with pytest.raises(ValueError, match="slots\\[0\\] must be"):
        kernels.ExchangePeers(peers.acts, peers.acts_sf, peers.weights, tuple(s.long() for s in peers.slots),
                              peers.combine, 0, 4)


@pytest.mark.parametrize("kernel,top_k,hidden", [(0, 8, 7168), (0, 6, 2048), (1, 8, 7168), (1, 1, 384)])
def test_exchange_kernels_copy_16_bytes_at_a_time_without_spills(kernel, top_k, hidden):
    text = sass(*kernels.jit.native_module().moe_exchange_code(kernel, top_k, hidden))
    assert re.search(r"LDG\.E[.A-Z]*\.128", text) and re.search(r"STG\.E[.A-Z]*\.128", text)
    assert "STL" not in text and "LDL" not in text, "a row's vectors stay in registers"


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks,num_local,num_tokens,top_k,hidden", kCases)
def test_gpu_dispatch_then_combine_matches_cpu(seed, num_ranks, num_local, num_tokens, top_k, hidden):
    rank = 1 % num_ranks
    gpu, inputs, order, rows = make_problem(num_ranks, num_local, num_tokens, top_k, hidden, rank, "cuda")
    cpu = kernels.ExchangePeers(*(tuple(t.cpu() for t in getattr(gpu, name)) for name in kernels.exchange.kExchangeViews),
                                rank, gpu.pairs_per_rank)
    cpu_inputs = {name: t.cpu() for name, t in inputs.items()}
    kernels.exchange_dispatch(gpu, **inputs, order=order, rows=rows, num_local_experts=num_local)
    kernels.exchange_dispatch(cpu, **cpu_inputs, order=order.cpu(), rows=rows.cpu(), num_local_experts=num_local)
    torch.cuda.synchronize()
    for name in ("acts", "acts_sf", "weights", "slots"):
        for q in range(num_ranks):
            assert torch.equal(getattr(gpu, name)[q].cpu().nan_to_num(-1), getattr(cpu, name)[q].nan_to_num(-1)), name
    check_dispatch(gpu, inputs, order, rows, num_local)

    # Every rank combines what it received (the slot words from the dispatch above).
    for owner in range(num_ranks):
        received = torch.tensor([r for q, r, _ in expected_dispatch(gpu, inputs, order, rows, num_local) if q == owner],
                                dtype=torch.int64)
        expert_out = torch.randn(gpu.acts[0].shape[0], hidden).to(torch.bfloat16)
        for peers, device in ((gpu, "cuda"), (cpu, "cpu")):
            as_owner = kernels.ExchangePeers(peers.acts, peers.acts_sf, peers.weights, peers.slots, peers.combine,
                                             owner, peers.pairs_per_rank)
            kernels.exchange_combine(as_owner, expert_out.to(device), received.to(device))
    torch.cuda.synchronize()
    for q in range(num_ranks):
        assert torch.equal(gpu.combine[q].cpu().nan_to_num(-1), cpu.combine[q].nan_to_num(-1))
