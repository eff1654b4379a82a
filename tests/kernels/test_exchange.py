"""kernels.exchange_dispatch / kernels.exchange_combine (kernels/exchange.py): the staged backend's
row exchange. P ranks simulated in one process (every rank's views ordinary tensors, "peer"
addresses plain pointers), views poisoned first: each pair's row, scales, weight and slot word
must land in the row kernels.reference.exchange.plan_exchange gives it on its owner (the kernel
computes the layouts itself from the count matrix, contiguous and masked), this rank's layout
index must match the plan's, and each received row's expert output must land in its source's
combine slot and nowhere else. The multi-rank layer tests (tests/moe_runtime) run real peer writes."""

from __future__ import annotations

import re

import pytest
import torch

import kernels
from kernels.reference import exchange as exchange_reference
from test_sass import sass


def make_problem(num_ranks: int, num_local: int, num_tokens: int, top_k: int, hidden: int, rank: int, device: str,
                 others: int, alignment: int = 16, masked_max_rows: int = 8):
    """``rank``'s routing (distinct experts per token, some pairs unrouted), its pairs sorted by
    expert, a count matrix whose other rows send up to ``others`` rows per expert, and every
    rank's views poisoned. Returns (peers, inputs, order, counts, plan)."""
    num_experts = num_ranks * num_local
    topk_idx = torch.rand(num_tokens, num_experts).topk(top_k, dim=1).indices
    topk_idx[torch.rand(num_tokens, top_k) < 0.1] = -1
    flat = topk_idx.reshape(-1)
    order = torch.argsort(torch.where(flat >= 0, flat, num_experts), stable=True)[: int((flat >= 0).sum())]
    counts = torch.randint(0, others + 1, (num_ranks, num_experts + 1), dtype=torch.int32)
    counts[rank, :num_experts] = torch.bincount(flat[flat >= 0], minlength=num_experts).to(torch.int32)
    plan = exchange_reference.plan_exchange(counts[:, :num_experts].long().view(num_ranks, num_ranks, num_local)
                                            .transpose(0, 1), rank, alignment, masked_max_rows)
    rows = max(plan.padded_rows) + 3
    pairs_per_rank = num_tokens * top_k + 3
    peers = kernels.ExchangePeers(
        tuple(torch.randint(0, 256, (rows, hidden), dtype=torch.uint8, device=device) for _ in range(num_ranks)),
        tuple(torch.full((rows, hidden // 128), float("nan"), device=device) for _ in range(num_ranks)),
        tuple(torch.full((rows,), float("nan"), device=device) for _ in range(num_ranks)),
        tuple(torch.full((rows,), -7, dtype=torch.int32, device=device) for _ in range(num_ranks)),
        tuple(torch.full((pairs_per_rank, hidden), float("nan"), dtype=torch.bfloat16, device=device)
              for _ in range(num_ranks)),
        rank, pairs_per_rank)
    inputs = {"xq": torch.randint(0, 256, (num_tokens, hidden), dtype=torch.uint8).to(device),
              "xs": torch.rand(num_tokens, hidden // 128).add_(0.5).to(device),
              "topk_idx": topk_idx.to(device), "topk_weights": torch.rand(num_tokens, top_k).to(device)}
    layout = {"order": order.to(device), "counts": counts.to(device), "num_local_experts": num_local,
              "alignment": alignment, "masked_max_rows": masked_max_rows, "num_layout_rows": plan.num_layout_rows,
              "first_expert": rank * num_local}
    return peers, inputs, layout, plan


def check_dispatch(peers, inputs, layout, plan):
    """Each pair in its plan row on its owner; the layout index against the plan."""
    k, num_local = inputs["topk_idx"].shape[1], layout["num_local_experts"]
    rows = exchange_reference.expand_rows(plan.send_delta, plan.send_counts, plan.num_send_rows)
    for i, pair in enumerate(layout["order"].tolist()):
        q = int(inputs["topk_idx"].reshape(-1)[pair]) // num_local
        row, t = int(rows[i]), pair // k
        assert torch.equal(peers.acts[q][row].cpu(), inputs["xq"][t].cpu())
        assert torch.equal(peers.acts_sf[q][row].cpu(), inputs["xs"][t].cpu())
        assert float(peers.weights[q][row]) == float(inputs["topk_weights"].reshape(-1)[pair])
        assert int(peers.slots[q][row]) == peers.rank * peers.pairs_per_rank + pair


def check_index(index, plan, first_expert):
    expected = torch.full((plan.num_layout_rows,), -1, dtype=torch.int32)
    valid = exchange_reference.expand_rows(plan.expert_delta, plan.expert_rows, plan.num_recv_rows)
    expected[valid] = torch.repeat_interleave(torch.arange(plan.num_local_experts, dtype=torch.int32),
                                              plan.expert_rows)
    assert torch.equal(index.m_indices.cpu(), expected)
    assert torch.equal(index.global_ids.cpu(), torch.where(expected >= 0, expected.long() + first_expert, -1))
    assert torch.equal(index.masked_m.cpu(), plan.expert_rows.to(torch.int32))


def make_combine(num_ranks: int, rows: int, hidden: int, rank: int, pairs_per_rank: int, device: str):
    """An owner's layout of ``rows`` rows, about a third padding, each valid row from a distinct
    (source, pair); returns (peers, expert_out, m_indices, expected {(source, pair): row})."""
    m_indices = torch.randint(0, 4, (rows,), dtype=torch.int32)
    m_indices[torch.rand(rows) < 0.3] = -1
    valid = (m_indices >= 0).nonzero().view(-1)
    words = torch.randperm(num_ranks * pairs_per_rank)[: valid.numel()].to(torch.int32)
    slots = torch.full((rows,), -7, dtype=torch.int32)
    slots[valid] = words
    views = [tuple(torch.zeros(rows, hidden, dtype=torch.uint8, device=device) for _ in range(num_ranks)),
             tuple(torch.zeros(rows, hidden // 128, device=device) for _ in range(num_ranks)),
             tuple(torch.zeros(rows, device=device) for _ in range(num_ranks)),
             tuple(slots.to(device) if q == rank else torch.zeros(rows, dtype=torch.int32, device=device)
                   for q in range(num_ranks)),
             tuple(torch.full((pairs_per_rank, hidden), float("nan"), dtype=torch.bfloat16, device=device)
                   for _ in range(num_ranks))]
    peers = kernels.ExchangePeers(*views, rank, pairs_per_rank)
    expert_out = torch.randn(rows, hidden).to(torch.bfloat16).to(device)
    expected = {(int(w) // pairs_per_rank, int(w) % pairs_per_rank): int(r) for r, w in zip(valid, words)}
    return peers, expert_out, m_indices.to(device), expected


def check_combine(peers, expert_out, expected):
    for q in range(peers.num_ranks):
        combine = peers.combine[q].cpu()
        written = {pair for (source, pair) in expected if source == q}
        for pair in range(peers.pairs_per_rank):
            if pair in written:
                assert torch.equal(combine[pair], expert_out[expected[(q, pair)]].cpu())
            else:
                assert bool(combine[pair].isnan().all()), "rows no received row maps to stay untouched"


# (ranks, local experts, tokens, top-k, hidden, others' rows per expert): contiguous and masked layouts.
kCases = [(1, 4, 9, 2, 128, 0), (3, 5, 37, 4, 384, 20), (2, 16, 64, 8, 7168, 40), (4, 8, 3, 2, 256, 1)]


@pytest.mark.parametrize("num_ranks,num_local,num_tokens,top_k,hidden,others", kCases)
def test_dispatch_cpu(seed, num_ranks, num_local, num_tokens, top_k, hidden, others):
    rank = num_ranks - 1
    peers, inputs, layout, plan = make_problem(num_ranks, num_local, num_tokens, top_k, hidden, rank, "cpu", others)
    index = kernels.exchange_dispatch(peers, **inputs, **layout)
    check_dispatch(peers, inputs, layout, plan)
    check_index(index, plan, layout["first_expert"])


@pytest.mark.parametrize("num_ranks,rows,hidden", [(1, 7, 128), (3, 130, 384)])
def test_combine_cpu(seed, num_ranks, rows, hidden):
    peers, expert_out, m_indices, expected = make_combine(num_ranks, rows, hidden, num_ranks - 1, 50, "cpu")
    kernels.exchange_combine(peers, expert_out, m_indices)
    check_combine(peers, expert_out, expected)


def make_routing(num_tokens: int, top_k: int, num_experts: int) -> torch.Tensor:
    """Distinct experts per token, about 10% unrouted (-1) and a few invalid ids (< -1 or >= E)."""
    topk_idx = torch.rand(num_tokens, num_experts).topk(top_k, dim=1).indices
    topk_idx[torch.rand(num_tokens, top_k) < 0.1] = -1
    topk_idx[torch.rand(num_tokens, top_k) < 0.02] = num_experts + 3
    topk_idx[torch.rand(num_tokens, top_k) < 0.02] = -5
    return topk_idx


def expected_count(topk_idx: torch.Tensor, num_experts: int):
    flat = topk_idx.reshape(-1).tolist()
    key = [i if 0 <= i < num_experts else num_experts for i in flat]
    row = [sum(i == g for i in flat) for g in range(num_experts)] + [sum(i < -1 or i >= num_experts for i in flat)]
    return torch.tensor(key), torch.tensor(row, dtype=torch.int32)


@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(1, 1, 1), (37, 4, 15), (300, 8, 256)])
def test_count_cpu(seed, num_tokens, top_k, num_experts):
    topk_idx = make_routing(num_tokens, top_k, num_experts)
    key, row = kernels.exchange_count(topk_idx, num_experts)
    expected_key, expected_row = expected_count(topk_idx, num_experts)
    assert torch.equal(key, expected_key) and torch.equal(row, expected_row)


def test_bad_arguments_name_the_argument():
    peers, inputs, layout, _ = make_problem(2, 4, 8, 2, 128, 0, "cpu", 3)
    with pytest.raises(ValueError, match="xs must be"):
        kernels.exchange_dispatch(peers, **{**inputs, "xs": inputs["xs"].double()}, **layout)
    with pytest.raises(ValueError, match="counts must be an int32 tensor"):
        kernels.exchange_dispatch(peers, **inputs, **{**layout, "counts": layout["counts"][:, :3]})
    with pytest.raises(ValueError, match="num_local_experts must be"):
        kernels.exchange_dispatch(peers, **inputs, **{**layout, "num_local_experts": 0})
    with pytest.raises(ValueError, match="counts say"):
        kernels.exchange_dispatch(peers, **inputs, **{**layout, "order": layout["order"][:-1]})
    with pytest.raises(ValueError, match="topk_idx must be an int64"):
        kernels.exchange_count(inputs["topk_idx"].int(), 8)
    with pytest.raises(ValueError, match="num_experts must be"):
        kernels.exchange_count(inputs["topk_idx"], 0)
    with pytest.raises(ValueError, match="expert_out must be"):
        kernels.exchange_combine(peers, torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="m_indices must be"):
        kernels.exchange_combine(peers, torch.zeros(4, 128, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="combine\\[1\\] has"):
        kernels.ExchangePeers(peers.acts, peers.acts_sf, peers.weights, peers.slots,
                              (peers.combine[0], peers.combine[1][:2]), 0, peers.pairs_per_rank)
    with pytest.raises(ValueError, match="one tensor per rank"):
        kernels.ExchangePeers(peers.acts, peers.acts_sf[:1], peers.weights, peers.slots, peers.combine, 0, 4)
    with pytest.raises(ValueError, match="slots\\[0\\] must be"):
        kernels.ExchangePeers(peers.acts, peers.acts_sf, peers.weights, tuple(s.long() for s in peers.slots),
                              peers.combine, 0, 4)


@pytest.mark.parametrize("kernel,top_k,hidden", [(0, 8, 7168), (0, 6, 2048), (1, 8, 7168), (1, 1, 384), (2, 1, 128)])
def test_exchange_kernels_copy_16_bytes_at_a_time_without_spills(kernel, top_k, hidden):
    text = sass(*kernels.jit.native_module().moe_exchange_code(kernel, top_k, hidden))
    if kernel == 2:  # count: a shared-memory histogram
        assert "ATOMS.ADD" in text or "ATOMS.POPC.INC" in text
        return
    assert re.search(r"LDG\.E[.A-Z]*\.128", text) and re.search(r"STG\.E[.A-Z]*\.128", text)
    # The row's 16-byte vectors stay in registers (the dispatch kernel's bounds checks may spill a
    # scalar or two across the copy: L1-resident, off the bandwidth path).
    assert not re.search(r"(STL|LDL)\.128", text), "a row's vectors stay in registers"
    assert len(re.findall(r"\bSTL\b", text)) <= 4


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks,num_local,num_tokens,top_k,hidden,others", kCases)
def test_gpu_dispatch_matches_cpu(seed, num_ranks, num_local, num_tokens, top_k, hidden, others):
    rank = 1 % num_ranks
    gpu, inputs, layout, plan = make_problem(num_ranks, num_local, num_tokens, top_k, hidden, rank, "cuda", others)
    cpu = kernels.ExchangePeers(*(tuple(t.cpu() for t in getattr(gpu, name)) for name in kernels.exchange.kExchangeViews),
                                rank, gpu.pairs_per_rank)
    index = kernels.exchange_dispatch(gpu, **inputs, **layout)
    cpu_index = kernels.exchange_dispatch(cpu, **{n: t.cpu() for n, t in inputs.items()},
                                          **{n: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                             for n, v in layout.items()})
    torch.cuda.synchronize()
    for name in ("acts", "acts_sf", "weights", "slots"):
        for q in range(num_ranks):
            assert torch.equal(getattr(gpu, name)[q].cpu().nan_to_num(-1), getattr(cpu, name)[q].nan_to_num(-1)), name
    check_dispatch(gpu, inputs, layout, plan)
    check_index(index, plan, layout["first_expert"])
    check_index(cpu_index, plan, layout["first_expert"])


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks,rows,hidden", [(1, 7, 128), (3, 130, 384), (2, 1000, 7168)])
def test_gpu_combine(seed, num_ranks, rows, hidden):
    peers, expert_out, m_indices, expected = make_combine(num_ranks, rows, hidden, 0, 700, "cuda")
    kernels.exchange_combine(peers, expert_out, m_indices)
    torch.cuda.synchronize()
    check_combine(peers, expert_out, expected)


@pytest.mark.gpu
def test_gpu_dispatch_drops_pairs_the_counts_do_not_cover(seed):
    """An order that disagrees with the counts (an unrouted pair, an extra pair of a counted expert)
    writes nothing beyond what the well-formed order writes (the CPU path raises instead)."""
    args = (3, 5, 37, 4, 384, 1, "cuda", 20)
    good, inputs, layout, _ = make_problem(*args)
    torch.manual_seed(seed)
    bad, inputs_bad, layout_bad, _ = make_problem(*args)
    for name in kernels.exchange.kExchangeViews:  # the same poisoned views and inputs
        for q in range(good.num_ranks):
            getattr(bad, name)[q].copy_(getattr(good, name)[q])
    inputs_bad, layout_bad = inputs, dict(layout)
    unrouted = (inputs["topk_idx"].reshape(-1) < 0).nonzero().view(-1)
    assert unrouted.numel(), "the problem has unrouted pairs"
    layout_bad["order"] = torch.cat([layout["order"], unrouted[:1], layout["order"][-1:]])
    kernels.exchange_dispatch(good, **inputs, **layout)
    kernels.exchange_dispatch(bad, **inputs_bad, **layout_bad)
    torch.cuda.synchronize()
    for name in ("acts", "acts_sf", "weights", "slots"):
        for q in range(good.num_ranks):
            assert torch.equal(getattr(bad, name)[q].nan_to_num(-1), getattr(good, name)[q].nan_to_num(-1)), name
    cpu_bad = kernels.ExchangePeers(*(tuple(t.cpu() for t in getattr(bad, n)) for n in kernels.exchange.kExchangeViews),
                                   bad.rank, bad.pairs_per_rank)
    with pytest.raises(ValueError, match="counts say"):
        kernels.exchange_dispatch(cpu_bad, **{n: t.cpu() for n, t in inputs.items()},
                                  **{n: (v.cpu() if isinstance(v, torch.Tensor) else v) for n, v in layout_bad.items()})


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(1, 1, 1), (37, 4, 15), (4096, 8, 256), (5000, 8, 2048)])
def test_gpu_count_matches_cpu(seed, num_tokens, top_k, num_experts):
    topk_idx = make_routing(num_tokens, top_k, num_experts)
    key, row = kernels.exchange_count(topk_idx.cuda(), num_experts)
    expected_key, expected_row = kernels.exchange_count(topk_idx, num_experts)
    assert torch.equal(key.cpu(), expected_key) and torch.equal(row.cpu(), expected_row)
