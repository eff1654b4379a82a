"""kernels.exchange_count / exchange_sizes / exchange_dispatch / exchange_combine (kernels/exchange.py):
the staged backend's row exchange. P ranks simulated in one process (every rank's views ordinary tensors, "peer"
addresses plain pointers), views poisoned first: each pair's row, scales, weight and slot word
must land in the row kernels.reference.exchange.plan_exchange gives it on its owner (the kernel
computes the layouts itself from the count matrix, contiguous and masked), this rank's layout
index must match the plan's, and each received row's expert output must land in its source's
combine slot and nowhere else. The multi-rank layer tests (tests/moe_runtime) run real peer writes;
the device barriers (alone, in count-sizes, raised by the dispatch and combine) are in
test_exchange_barriers.py."""

from __future__ import annotations

import re

import pytest
import torch

import kernels
from kernels.reference import exchange as exchange_reference
from test_sass import sass


def make_problem(num_ranks: int, num_local: int, num_tokens: int, top_k: int, hidden: int, rank: int, device: str,
                 others: int, alignment: int = 16, masked_max_rows: int = 8):
    """``rank``'s routing (distinct experts per token, some pairs unrouted), each pair's position
    among its expert's pairs (``within``, a random order per expert, as the CUDA count kernel's
    atomics may give), a count matrix whose other rows send up to ``others`` rows per expert, and
    every rank's views poisoned. Returns (peers, inputs, layout, plan)."""
    num_experts = num_ranks * num_local
    topk_idx = torch.rand(num_tokens, num_experts).topk(top_k, dim=1).indices
    topk_idx[torch.rand(num_tokens, top_k) < 0.1] = -1
    flat = topk_idx.reshape(-1)
    within = shuffled_positions(flat, num_experts)
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
    layout = {"within": within.to(device), "counts": counts.to(device), "num_local_experts": num_local,
              "alignment": alignment, "masked_max_rows": masked_max_rows, "num_layout_rows": plan.num_layout_rows,
              "first_expert": rank * num_local}
    return peers, inputs, layout, plan


def shuffled_positions(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [n]: each routed pair's position among its expert's pairs, in a random order per
    expert; -1 for unrouted pairs."""
    within = torch.full((flat.numel(),), -1, dtype=torch.int32)
    for g in range(num_experts):
        pairs = (flat == g).nonzero().view(-1)
        within[pairs] = torch.randperm(pairs.numel()).to(torch.int32)
    return within


def check_dispatch(peers, inputs, layout, plan):
    """Each pair in its plan row on its owner (the plan's first row of its expert from this rank,
    plus its position); the layout index against the plan."""
    k, num_local = inputs["topk_idx"].shape[1], layout["num_local_experts"]
    first = plan.send_delta + exchange_reference.exclusive_cumsum(plan.send_counts)
    flat, within = inputs["topk_idx"].reshape(-1).cpu(), layout["within"].cpu()
    for pair in (flat >= 0).nonzero().view(-1).tolist():
        g = int(flat[pair])
        q = g // num_local
        row, t = int(first[g]) + int(within[pair]), pair // k
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
    assert num_ranks * pairs_per_rank >= rows, "every valid row needs its own (source, pair)"
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


def _cut(views: dict, peers, rows: int):
    """ExchangePeers over the first ``rows`` rows of ``views`` (slices of the same storage, so a
    write past them would land in the rows after); combine as in ``peers``."""
    return kernels.ExchangePeers(*(tuple(t[:rows] for t in views[n]) for n in ("acts", "acts_sf", "weights", "slots")),
                                 peers.combine, peers.rank, peers.pairs_per_rank)


def check_index_past_layout_and_rows_past_views(device: str, seed: int):
    """An index longer than the layout (a caller that learns the size after the launch) matches
    the exact one on the layout's rows (-1 past them on the CPU, unwritten on CUDA); a shorter one
    raises on the CPU; views shorter than the layout keep what fits, drop the rest (the rows after
    them in the same storage keep their poison) and raise nothing."""
    peers, inputs, layout, plan = make_problem(3, 5, 37, 4, 384, 1, device, 20)
    names = ("acts", "acts_sf", "weights", "slots")
    poisoned = {n: tuple(t.clone() for t in getattr(peers, n)) for n in names}
    spare = {n: tuple(t.clone() for t in poisoned[n]) for n in names}
    index = kernels.exchange_dispatch(peers, **inputs, **layout)
    m = plan.num_layout_rows
    longer = kernels.exchange_dispatch(_cut(spare, peers, spare["acts"][0].shape[0]), **inputs,
                                       **{**layout, "num_layout_rows": m + 7})
    assert torch.equal(longer.m_indices[:m].cpu(), index.m_indices.cpu())
    assert torch.equal(longer.global_ids[:m].cpu(), index.global_ids.cpu())
    if device == "cpu":
        assert bool((longer.m_indices[m:] == -1).all()) and bool((longer.global_ids[m:] == -1).all())
        with pytest.raises(ValueError, match="is below this rank's layout"):
            kernels.exchange_dispatch(_cut(spare, peers, spare["acts"][0].shape[0]), **inputs,
                                      **{**layout, "num_layout_rows": m - 1})
    # The last row written on any owner: cutting there drops at least that one.
    cut = max(int((s.cpu() != -7).nonzero().max()) for s in peers.slots if bool((s != -7).any()))
    assert cut > 0
    short = {n: tuple(t.clone() for t in poisoned[n]) for n in names}
    kernels.exchange_dispatch(_cut(short, peers, cut), **inputs, **layout)
    if device == "cuda":
        torch.cuda.synchronize()
    for n in names:
        for q in range(peers.num_ranks):
            full, part, poison = getattr(peers, n)[q].cpu(), short[n][q].cpu(), poisoned[n][q].cpu()
            assert torch.equal(part[:cut].nan_to_num(-1), full[:cut].nan_to_num(-1)), n
            assert torch.equal(part[cut:].nan_to_num(-1), poison[cut:].nan_to_num(-1)), f"{n}: written past the views"


def test_dispatch_index_past_layout_and_rows_past_views_cpu(seed):
    check_index_past_layout_and_rows_past_views("cpu", seed)


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
    """Brute force: positions in pair order per expert (-1: not sent) and the count row."""
    flat = topk_idx.reshape(-1).tolist()
    within = [flat[:p].count(i) if 0 <= i < num_experts else -1 for p, i in enumerate(flat)]
    row = [sum(i == g for i in flat) for g in range(num_experts)] + [sum(i < -1 or i >= num_experts for i in flat)]
    return torch.tensor(within, dtype=torch.int32), torch.tensor(row, dtype=torch.int32)


@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(1, 1, 1), (37, 4, 15), (300, 8, 256)])
def test_count_cpu(seed, num_tokens, top_k, num_experts):
    topk_idx = make_routing(num_tokens, top_k, num_experts)
    within, row = kernels.exchange_count(topk_idx, num_experts)
    expected_within, expected_row = expected_count(topk_idx, num_experts)
    assert torch.equal(within, expected_within) and torch.equal(row, expected_row)


def make_counts(num_ranks: int, num_local: int, high: int) -> torch.Tensor:
    """int32 [P, E + 1]: random rows per expert (some experts empty), then a few invalid ids."""
    counts = torch.randint(0, high + 1, (num_ranks, num_ranks * num_local + 1), dtype=torch.int32)
    counts[torch.rand(counts.shape) < 0.3] = 0
    return counts


# (ranks, local experts, rows per expert at most, alignment, masked_max_rows): contiguous and masked.
kSizeCases = [(1, 4, 3, 16, 8), (2, 128, 40, 128, 32), (3, 5, 200, 64, 0), (8, 32, 6, 128, 32), (4, 512, 9, 8, 4)]


@pytest.mark.parametrize("num_ranks,num_local,high,alignment,masked_max_rows", kSizeCases)
def test_sizes_cpu(seed, num_ranks, num_local, high, alignment, masked_max_rows):
    counts = make_counts(num_ranks, num_local, high)
    num_experts = num_ranks * num_local
    for rank in range(num_ranks):
        plan = exchange_reference.plan_exchange(counts[:, :num_experts].long().view(num_ranks, num_ranks, num_local)
                                                .transpose(0, 1), rank, alignment, masked_max_rows)
        sizes = kernels.exchange_sizes(counts, rank, num_local, alignment, masked_max_rows)
        assert sizes.padded_rows == plan.padded_rows and sizes.masked_rows == plan.masked_rows
        assert sizes.num_send_rows == plan.num_send_rows and sizes.num_layout_rows == plan.num_layout_rows
        assert sizes.invalid_ids == tuple(counts[:, num_experts].tolist())


def test_bad_arguments_name_the_argument():
    peers, inputs, layout, _ = make_problem(2, 4, 8, 2, 128, 0, "cpu", 3)
    with pytest.raises(ValueError, match="xs must be"):
        kernels.exchange_dispatch(peers, **{**inputs, "xs": inputs["xs"].double()}, **layout)
    with pytest.raises(ValueError, match="counts must be an int32 tensor"):
        kernels.exchange_dispatch(peers, **inputs, **{**layout, "counts": layout["counts"][:, :3]})
    with pytest.raises(ValueError, match="num_local_experts must be"):
        kernels.exchange_dispatch(peers, **inputs, **{**layout, "num_local_experts": 0})
    with pytest.raises(ValueError, match="within must be an int32 tensor of shape"):
        kernels.exchange_dispatch(peers, **inputs, **{**layout, "within": layout["within"][:-1]})
    out_of_range = layout["within"].clone()
    out_of_range[int((out_of_range >= 0).nonzero()[0])] = 10**6
    with pytest.raises(ValueError, match="counts say"):
        kernels.exchange_dispatch(peers, **inputs, **{**layout, "within": out_of_range})
    with pytest.raises(ValueError, match="counts must be an int32 tensor \\[2, >= 9\\]"):
        kernels.exchange_sizes(layout["counts"][:, :8], 0, 4, 16)
    with pytest.raises(ValueError, match="rank must be in"):
        kernels.exchange_sizes(layout["counts"], 2, 4, 16)
    with pytest.raises(ValueError, match="alignment must be"):
        kernels.exchange_sizes(layout["counts"], 0, 4, 0)
    with pytest.raises(ValueError, match="topk_idx must be an int64"):
        kernels.exchange_count(inputs["topk_idx"].int(), 8)
    with pytest.raises(ValueError, match="num_experts must be"):
        kernels.exchange_count(inputs["topk_idx"], 0)
    with pytest.raises(ValueError, match="peer_rows must be None or"):
        kernels.exchange_count(inputs["topk_idx"], 8, torch.zeros(2, dtype=torch.int64))
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
    # A lazily negated view (the negative bit): the kernels would read and write its memory through its address.
    for name in kernels.exchange.kExchangeViews:
        views = {n: getattr(peers, n) for n in kernels.exchange.kExchangeViews}
        views[name] = (views[name][0], torch._neg_view(views[name][1]))
        with pytest.raises(ValueError, match=rf"ExchangePeers: {name}\[1\] must not be a lazily negated view"):
            kernels.ExchangePeers(**views, rank=0, pairs_per_rank=peers.pairs_per_rank)



@pytest.mark.parametrize("call,error,match", [
    (lambda peers, inputs, layout: kernels.ExchangePeers((None, peers.acts[1]), peers.acts_sf, peers.weights,
                                                         peers.slots, peers.combine, 0, 4),
     TypeError, "ExchangePeers: acts\\[0\\] must be a torch.Tensor, got NoneType"),
    (lambda peers, inputs, layout: kernels.ExchangePeers(peers.acts, peers.acts_sf, peers.weights,
                                                         (peers.slots[0], [0]), peers.combine, 0, 4),
     TypeError, "ExchangePeers: slots\\[1\\] must be a torch.Tensor, got list"),
    (lambda peers, inputs, layout: kernels.exchange_dispatch(None, **inputs, **layout),
     TypeError, "exchange_dispatch: peers must be ExchangePeers, got NoneType"),
    (lambda peers, inputs, layout: kernels.exchange_combine(peers.acts, torch.zeros(4, 128, dtype=torch.bfloat16),
                                                            torch.zeros(4, dtype=torch.int32)),
     TypeError, "exchange_combine: peers must be ExchangePeers, got tuple"),
    (lambda peers, inputs, layout: kernels.exchange_count(inputs["topk_idx"].to("meta"), 8),
     ValueError, "exchange_count: topk_idx must be on a CPU or CUDA device, got meta"),
    (lambda peers, inputs, layout: kernels.exchange_sizes(layout["counts"].to("meta"), 0, 4, 16),
     ValueError, "exchange_sizes: counts must be on a CPU or CUDA device, got meta"),
])
def test_bad_argument_types_and_devices(call, error, match):
    peers, inputs, layout, _ = make_problem(2, 4, 8, 2, 128, 0, "cpu", 3)
    with pytest.raises(error, match=match):
        call(peers, inputs, layout)


@pytest.mark.parametrize("kernel,top_k,hidden,in_dtype", [
    (0, 8, 7168, torch.float8_e4m3fn), (0, 6, 2048, torch.float8_e4m3fn), (0, 8, 7168, torch.bfloat16),
    (0, 40, 16384, torch.float32), (1, 8, 7168, None), (1, 1, 384, None), (2, 1, 128, None), (3, 1, 128, None)])
def test_exchange_kernels_copy_16_bytes_at_a_time_without_spills(kernel, top_k, hidden, in_dtype):
    """16-byte row loads and stores; the dispatch quantizes bf16 / fp32 rows itself (the E4M3
    conversion instruction; E4M3 rows are copied), a token's row in registers a chunk at a time at
    any hidden size and top-k (two lanes' rounds of pairs past 32)."""
    code_dtype = kernels._descriptors.DTYPE_CODES[in_dtype or torch.float8_e4m3fn]
    text = sass(*kernels.jit.native_module().moe_exchange_code(kernel, top_k, hidden, code_dtype))
    if kernel == 0:
        assert ("F2FP.SATFINITE.E4M3" in text) == (in_dtype != torch.float8_e4m3fn), "in-kernel quantization"
    if kernel == 2:  # count, one CTA: shared-memory atomics number the pairs; no global atomics, no spills
        assert "ATOMS.ADD" in text or "ATOMS.POPC.INC" in text
        assert "ATOMG" not in text and "RED.E" not in text
        assert "STL" not in text and "LDL" not in text
        return
    if kernel == 3:  # sizes: one CTA over shared memory, no spills
        assert "STL" not in text and "LDL" not in text
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


def test_cpu_dispatch_casts_unquantized_rows(seed):
    """The CPU path casts bfloat16 rows (here with a non-contiguous last dim) with
    per_token_cast_to_fp8 before its reference dispatch."""
    num_ranks, num_local, num_tokens, top_k, hidden, others = kCases[1]
    peers, inputs, layout, plan = make_problem(num_ranks, num_local, num_tokens, top_k, hidden, 1, "cpu", others)
    x = torch.randn(hidden, num_tokens).to(torch.bfloat16).t()
    xq, xs = kernels.per_token_cast_to_fp8(x.contiguous())
    kernels.exchange_dispatch(peers, **dict(inputs, xq=x, xs=None), **layout)
    check_dispatch(peers, dict(inputs, xq=xq.view(torch.uint8), xs=xs), layout, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("case", kCases + [(2, 24, 17, 40, 384, 5)])
def test_gpu_dispatch_quantizes_unquantized_rows(seed, case, dtype):
    """bfloat16 / float16 / float32 rows (a row stride wider than hidden) and no scales, or E4M3
    rows with such a stride and their scales: every view of every rank equals the CPU path's
    (which casts with the reference first: the kernel's quantization is bit for bit the same),
    dropped pairs' rows keeping their poison; top-k 40 takes a second round of lanes."""
    num_ranks, num_local, num_tokens, top_k, hidden, others = case
    rank = 1 % num_ranks
    gpu, inputs, layout, plan = make_problem(num_ranks, num_local, num_tokens, top_k, hidden, rank, "cuda", others)
    cpu = kernels.ExchangePeers(*(tuple(t.cpu() for t in getattr(gpu, name)) for name in kernels.exchange.kExchangeViews),
                                rank, gpu.pairs_per_rank)
    wide = torch.randn(num_tokens, hidden + 64).to("cuda", torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype)
    if dtype == torch.float8_e4m3fn:
        xq, xs = kernels.per_token_cast_to_fp8(wide)
        x, xs_gpu = xq.view(torch.uint8)[:, :hidden], xs[:, : hidden // 128]
        x_cpu, xs_cpu = x.cpu(), xs_gpu.cpu()
    else:
        x, xs_gpu = wide[:, :hidden], None
        x_cpu, xs_cpu = x.cpu(), None
    kernels.exchange_dispatch(gpu, **dict(inputs, xq=x, xs=xs_gpu), **layout)
    kernels.exchange_dispatch(cpu, **{n: t.cpu() for n, t in inputs.items() if n not in ("xq", "xs")}, xq=x_cpu,
                              xs=xs_cpu, **{n: (v.cpu() if isinstance(v, torch.Tensor) else v) for n, v in layout.items()})
    torch.cuda.synchronize()
    for name in ("acts", "acts_sf", "weights", "slots"):
        for q in range(num_ranks):
            assert torch.equal(getattr(gpu, name)[q].cpu().nan_to_num(-1), getattr(cpu, name)[q].nan_to_num(-1)), name


@pytest.mark.gpu
def test_gpu_dispatch_index_past_layout_and_rows_past_views(seed):
    check_index_past_layout_and_rows_past_views("cuda", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks,rows,hidden", [(1, 7, 128), (3, 130, 384), (2, 1000, 7168)])
def test_gpu_combine(seed, num_ranks, rows, hidden):
    peers, expert_out, m_indices, expected = make_combine(num_ranks, rows, hidden, 0, 700, "cuda")
    kernels.exchange_combine(peers, expert_out, m_indices)
    torch.cuda.synchronize()
    check_combine(peers, expert_out, expected)


@pytest.mark.gpu
def test_gpu_dispatch_drops_pairs_the_counts_do_not_cover(seed):
    """Positions the counts do not cover (on unrouted pairs, past an expert's count, negative)
    write nothing: the views equal the well-formed call's but for the rows of the pairs whose
    positions were spoiled, which keep their poison (the CPU path raises instead)."""
    args = (3, 5, 37, 4, 384, 1, "cuda", 20)
    good, inputs, layout, plan = make_problem(*args)
    poisoned = {name: tuple(t.clone() for t in getattr(good, name)) for name in kernels.exchange.kExchangeViews}
    bad = kernels.ExchangePeers(*(tuple(t.clone() for t in poisoned[name]) for name in kernels.exchange.kExchangeViews),
                                good.rank, good.pairs_per_rank)
    flat, within = inputs["topk_idx"].reshape(-1).cpu(), layout["within"].cpu().clone()
    unrouted, routed = (flat < 0).nonzero().view(-1), (flat >= 0).nonzero().view(-1)
    assert unrouted.numel() and routed.numel() >= 2, "the problem has unrouted and routed pairs"
    within[unrouted] = 0
    first = plan.send_delta + exchange_reference.exclusive_cumsum(plan.send_counts)
    spoiled = []
    for pair, value in ((int(routed[0]), int(plan.send_counts[flat[routed[0]]])), (int(routed[-1]), -3)):
        g = int(flat[pair])
        spoiled.append((g // layout["num_local_experts"], int(first[g]) + int(within[pair])))
        within[pair] = value
    kernels.exchange_dispatch(good, **inputs, **layout)
    kernels.exchange_dispatch(bad, **inputs, **{**layout, "within": within.cuda()})
    torch.cuda.synchronize()
    for name in ("acts", "acts_sf", "weights", "slots"):
        for q in range(good.num_ranks):
            expected = getattr(good, name)[q].clone()
            for owner, row in spoiled:
                if owner == q:
                    expected[row] = poisoned[name][q][row]
            assert torch.equal(getattr(bad, name)[q].nan_to_num(-1), expected.nan_to_num(-1)), name
    cpu = kernels.ExchangePeers(*(tuple(t.cpu() for t in poisoned[n]) for n in kernels.exchange.kExchangeViews),
                                good.rank, good.pairs_per_rank)
    with pytest.raises(ValueError, match="counts say"):
        kernels.exchange_dispatch(cpu, **{n: t.cpu() for n, t in inputs.items()},
                                  **{**{n: (v.cpu() if isinstance(v, torch.Tensor) else v) for n, v in layout.items()},
                                     "within": within})


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(1, 1, 1), (37, 4, 15), (4096, 8, 256), (5000, 8, 2048)])
def test_gpu_count_matches_cpu(seed, num_tokens, top_k, num_experts):
    """The row exactly; the positions, numbered by atomics in any order, as a permutation of
    [0, count) per expert (-1 where not sent)."""
    topk_idx = make_routing(num_tokens, top_k, num_experts)
    within, row = kernels.exchange_count(topk_idx.cuda(), num_experts)
    expected_within, expected_row = kernels.exchange_count(topk_idx, num_experts)
    assert torch.equal(row.cpu(), expected_row)
    within, flat = within.cpu().long(), topk_idx.reshape(-1)
    assert torch.equal(within < 0, expected_within < 0)
    n = flat.numel() + 1
    sent = within >= 0
    assert torch.equal(torch.sort(flat[sent] * n + within[sent]).values,
                       torch.sort(flat[sent] * n + expected_within.long()[sent]).values)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(0, 8, 16), (37, 4, 15), (4096, 8, 256)])
def test_gpu_count_writes_every_row_it_is_given(seed, num_tokens, top_k, num_experts):
    """peer_rows: the row lands in each destination (addresses inside one poisoned matrix, as this
    rank's row of every rank's count matrix would), the cells around them untouched; no local row."""
    topk_idx = make_routing(num_tokens, top_k, num_experts) if num_tokens else torch.empty(0, top_k, dtype=torch.int64)
    _, expected_row = kernels.exchange_count(topk_idx, num_experts)
    matrix = torch.full((4, num_experts + 3), -5, dtype=torch.int32, device="cuda")
    targets = [0, 2, 3]
    peer_rows = torch.tensor([matrix[i].data_ptr() + 4 for i in targets], dtype=torch.int64, device="cuda")
    within, row = kernels.exchange_count(topk_idx.cuda(), num_experts, peer_rows)
    torch.cuda.synchronize()
    assert row is None and within.numel() == topk_idx.numel()
    expected = torch.full((4, num_experts + 3), -5, dtype=torch.int32)
    expected[targets, 1: num_experts + 2] = expected_row
    assert torch.equal(matrix.cpu(), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks,num_local,high,alignment,masked_max_rows", kSizeCases)
def test_gpu_sizes_match_cpu(seed, num_ranks, num_local, high, alignment, masked_max_rows):
    counts = make_counts(num_ranks, num_local, high)
    padded = torch.full((num_ranks, counts.shape[1] + 5), -9, dtype=torch.int32)
    padded[:, : counts.shape[1]] = counts  # a row stride past E + 1
    for rank in range(num_ranks):
        assert kernels.exchange_sizes(padded.cuda()[:, : counts.shape[1] + 3], rank, num_local, alignment,
                                      masked_max_rows) == kernels.exchange_sizes(counts, rank, num_local, alignment,
                                                                                 masked_max_rows)


def test_pending_sizes_start_copy_is_a_no_op_off_cuda():
    pending = kernels.exchange.PendingLayoutSizes(0, sizes=torch.arange(7, dtype=torch.int32))
    pending.start_copy(torch.empty(7, dtype=torch.int32), stream=None)
    assert pending.wait().num_layout_rows == 0 and pending.wait().num_send_rows == 6


@pytest.mark.gpu
def test_gpu_pending_sizes_read_waits_for_the_count_alone():
    """start_copy reads the sizes on a side stream: wait() returns while later work (a second of
    spinning queued after it) still runs, with the values the blocking read gives."""
    import time
    sizes = torch.arange(7, dtype=torch.int32, device="cuda") * 3
    pending = kernels.exchange.PendingLayoutSizes(1, sizes=sizes)
    with pytest.raises(ValueError, match="pinned CPU int32"):
        pending.start_copy(torch.empty(7, dtype=torch.int32), torch.cuda.Stream())
    pending.start_copy(torch.empty(7, dtype=torch.int32, pin_memory=True), torch.cuda.Stream())
    torch.cuda._sleep(int(2e9))
    start = time.perf_counter()
    plan = pending.wait()
    waited = time.perf_counter() - start
    torch.cuda.synchronize()
    assert waited < 0.3, f"wait() took {waited:.3f} s: it waited for the later work"
    assert plan == kernels.exchange.PendingLayoutSizes(1, sizes=sizes).wait()
