"""The staged backend's exchange plan (kernels/reference/exchange.py) against a brute-force
layout: contiguous segments padded to the alignment, the masked layout at decode sizes, and the
row indices each side expands from it (CPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.reference.exchange import expand_rows, layout_sizes, plan_exchange


def _brute_force_layouts(counts: torch.Tensor, alignment: int):
    """Per destination rank: {(source, expert, i): row} and the m_indices of its layout."""
    num_ranks, _, num_local = counts.shape
    layouts = []
    for q in range(num_ranks):
        rows, m_indices = {}, []
        for e in range(num_local):
            start = len(m_indices)
            for p in range(num_ranks):
                for i in range(int(counts[q, p, e])):
                    rows[(p, e, i)] = len(m_indices)
                    m_indices.append(e)
            used = len(m_indices) - start
            m_indices += [-1] * ((-used) % alignment)
        layouts.append((rows, m_indices))
    return layouts


@pytest.mark.parametrize("num_ranks,num_local,alignment", [(1, 5, 4), (2, 3, 4), (3, 2, 8), (4, 1, 128)])
def test_plan_matches_brute_force_layout(seed, num_ranks, num_local, alignment):
    counts = torch.randint(0, 11, (num_ranks, num_ranks, num_local))
    counts[0, :, 0] = 0  # an expert that receives nothing
    layouts = _brute_force_layouts(counts, alignment)
    for rank in range(num_ranks):
        plan = plan_exchange(counts, rank, alignment)
        assert plan.padded_rows == tuple(len(m) for _, m in layouts)
        # Sender side: the i-th pair sorted by global expert goes to expert_rows[...] of its owner.
        rows = expand_rows(plan.send_delta, plan.send_counts, plan.num_send_rows).tolist()
        expected, owners = [], []
        for q in range(num_ranks):
            for e in range(num_local):
                for i in range(int(counts[q, rank, e])):
                    expected.append(layouts[q][0][(rank, e, i)])
                    owners.append(q)
        assert rows == expected
        assert list(plan.send_rows_per_rank) == [owners.count(q) for q in range(num_ranks)]
        # Receiver side: rows grouped by source, then by expert.
        got = expand_rows(plan.recv_delta, plan.recv_counts, plan.num_recv_rows).tolist()
        mine = layouts[rank][0]
        assert got == [mine[(p, e, i)] for p in range(num_ranks) for e in range(num_local)
                       for i in range(int(counts[rank, p, e]))]
        valid = expand_rows(plan.expert_delta, plan.expert_rows, plan.num_recv_rows).tolist()
        assert valid == [r for r, e in enumerate(layouts[rank][1]) if e >= 0]
        assert plan.num_layout_rows == len(layouts[rank][1]) and plan.num_layout_rows % alignment == 0


@pytest.mark.parametrize("num_ranks,num_local", [(1, 5), (2, 3), (3, 4)])
def test_plan_masked_layout_gives_every_expert_the_largest_count(seed, num_ranks, num_local):
    counts = torch.randint(0, 6, (num_ranks, num_ranks, num_local))
    counts[0, :, 0] = 0  # an expert that receives nothing still gets its (unused) segment
    counts[-1] = 0  # a rank that receives nothing keeps the (empty) contiguous layout
    counts[0, 0, 1] = 40  # rank 0's experts together exceed the masked range: contiguous
    for rank in range(num_ranks):
        plan = plan_exchange(counts, rank, 128, masked_max_rows=32)
        contiguous = plan_exchange(counts, rank, 128)
        for q in range(num_ranks):
            most = int(counts[q].sum(0).max())
            expected = most if 0 < most <= 32 else 0
            assert plan.masked_rows[q] == expected
            assert plan.padded_rows[q] == (expected * num_local if expected else contiguous.padded_rows[q])
        valid = expand_rows(plan.expert_delta, plan.expert_rows, plan.num_recv_rows).tolist()
        rows = plan.masked_max_m
        if rows:  # expert e's rows start its segment: e * rows, e * rows + 1, ...
            per_expert = counts[rank].sum(0).tolist()
            assert valid == [e * rows + i for e in range(num_local) for i in range(per_expert[e])]
        # Senders agree with the receiver on every row.
        got = expand_rows(plan.recv_delta, plan.recv_counts, plan.num_recv_rows)
        assert sorted(got.tolist()) == sorted(valid)
    assert plan_exchange(counts, 0, 16, masked_max_rows=32).masked_rows[1:num_ranks - 1] == tuple(
        int(counts[q].sum(0).max()) if int(counts[q].sum(0).max()) <= 15 else 0 for q in range(1, num_ranks - 1))


def test_plan_rejects_bad_counts():
    with pytest.raises(ValueError, match=r"counts must be an integer tensor \[P, P, E_local\]"):
        plan_exchange(torch.zeros(2, 3, 4, dtype=torch.int64), 0, 128)
    with pytest.raises(ValueError, match="non-negative"):
        plan_exchange(-torch.ones(1, 1, 4, dtype=torch.int64), 0, 128)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        plan_exchange(torch.zeros(2, 2, 4, dtype=torch.int64), 2, 128)


@pytest.mark.parametrize("num_ranks,num_local,high", [(1, 4, 3), (2, 128, 40), (8, 32, 2), (4, 8, 0)])
def test_layout_sizes_match_the_plan(seed, num_ranks, num_local, high):
    counts = torch.randint(0, high + 1, (num_ranks, num_ranks, num_local))
    for rank in range(num_ranks):
        for alignment, masked in ((128, 32), (16, 8), (1, 32)):
            plan = plan_exchange(counts, rank, alignment, masked)
            sizes = layout_sizes(counts, rank, alignment, masked)
            assert (sizes.padded_rows, sizes.masked_rows, sizes.num_send_rows) == (
                plan.padded_rows, plan.masked_rows, plan.num_send_rows)
            assert (sizes.num_layout_rows, sizes.masked_max_m) == (plan.num_layout_rows, plan.masked_max_m)
