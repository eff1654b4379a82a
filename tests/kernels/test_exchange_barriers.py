"""The exchange's device barriers (kernels/exchange.py): exchange_barrier, count-sizes
(exchange_count_sizes: count, barrier and sizes in one launch) and the barrier the dispatch and
combine kernels raise from their last CTA (ExchangeBarrier). P ranks simulated in one process, each
on its own stream of the one GPU: these check the waits, counts and ordering on one device; the
multi-rank layer tests (tests/moe_runtime) run real peer writes across processes and GPUs."""

from __future__ import annotations

import re

import pytest
import torch

import kernels
from device_waits import assert_passed, assert_timed_out, child_main, run_in_child
from test_exchange import check_dispatch, check_index, kCases, make_combine, make_problem, make_routing
from test_sass import sass


# ---- the group barrier alone ------------------------------------------------------------------------


def barrier_group(num_ranks: int):
    """P simulated ranks' flags (int32 [P + 1] each, zero) in one process: (flag_rows, flags)."""
    flags = [torch.zeros(num_ranks + 1, dtype=torch.int32, device="cuda") for _ in range(num_ranks)]
    rows = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device="cuda")
    return rows, flags


def barriers_order_writes(seed: int, num_ranks: int) -> None:
    """Three rounds on every rank's stream: rank r writes a token into rank (r + 1)'s slot, barrier,
    reads its own slot (it must hold the previous rank's token of the round: the barrier ordered the
    peer's write before the read), barrier (the next round's writes after every read). Each phase
    is queued on every rank before the next (a rank's later work queued behind its barrier could
    otherwise block a peer's barrier on a shared hardware queue). A flag a peer raised past the
    awaited count (here: preset) also lets the barrier pass. The simulated ranks share one GPU:
    this checks the waits and counts, not ordering across GPUs (the staged torchrun tests do)."""
    rows, flags = barrier_group(num_ranks)
    slots = [torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(num_ranks)]
    seen = [[] for _ in range(num_ranks)]
    streams = [torch.cuda.Stream() for _ in range(num_ranks)]
    torch.cuda.synchronize()  # the setup's copies and fills, on the default stream, before the ranks' streams

    def each_rank(step):
        for r in range(num_ranks):
            with torch.cuda.stream(streams[r]):
                step(r)

    for round_ in range(3):
        def write(r):
            torch.cuda._sleep(200_000 * ((r + round_) % 3))  # ranks arrive in varying orders
            slots[(r + 1) % num_ranks].fill_(1000 * round_ + r)
        each_rank(write)
        each_rank(lambda r: kernels.exchange_barrier(rows, flags[r], r))
        each_rank(lambda r: seen[r].append(slots[r].clone()))
        each_rank(lambda r: kernels.exchange_barrier(rows, flags[r], r))
    torch.cuda.synchronize()
    for r in range(num_ranks):
        assert [int(t) for t in seen[r]] == [1000 * i + (r - 1) % num_ranks for i in range(3)], r
        assert int(flags[r][num_ranks]) == 6, "six barriers counted"
    rows, flags = barrier_group(2)
    flags[0][1] = 5  # rank 1 already past this barrier: rank 0 passes alone
    kernels.exchange_barrier(rows, flags[0], 0)
    torch.cuda.synchronize()
    assert int(flags[0][2]) == 1 and int(flags[1][0]) == 1


def barrier_alone(seed: int) -> None:
    """Rank 0 of 2 enters a barrier rank 1 never reaches."""
    rows, flags = barrier_group(2)
    kernels.exchange_barrier(rows, flags[0], 0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("kernel", [4, 5])
def test_barrier_machine_code(kernel):
    """One system fence per raising thread, then relaxed flag stores (not a fence per flag); the
    waits: acquire loads (strong system-scope loads, then the L1 invalidation), a sleep between
    them, a trap when a rank never arrives. The barrier alone (4) and inside count-sizes (5)."""
    text = sass(*kernels.jit.native_module().moe_exchange_code(kernel, 1, 128))
    assert "MEMBAR.SC.SYS" in text and "MEMBAR.ALL.SYS" not in text and "STG.E.STRONG.SYS" in text
    assert "LDG.E.STRONG.SYS" in text and "CCTL.IVALL" in text
    assert "NANOSLEEP" in text and "BPT.TRAP" in text


def test_count_sizes_machine_code():
    """Count-sizes numbers a chunk's pairs with shared-memory atomics and takes the chunk's bases
    with global ones (one per expert, not one per pair: no RED), and reads the count matrix, which
    peers write while it runs, through L2 (strong GPU-scope loads); the only read-only-path loads
    are 64-bit (routing ids and addresses, which nothing writes meanwhile)."""
    text = sass(*kernels.jit.native_module().moe_exchange_code(5, 1, 128))
    assert "ATOMS.ADD" in text or "ATOMS.POPC.INC" in text
    assert "ATOMG.E.ADD" in text and "RED.E" not in text
    assert "LDG.E.STRONG.GPU" in text
    assert not re.search(r"LDG\.E(\.[A-Z]+)*\.CONSTANT", text.replace("LDG.E.64.CONSTANT", "")), \
        "a 32-bit load on the read-only path"


def count_sizes_rounds(seed: int, num_ranks: int, num_local: int, num_tokens: int, alignment: int,
                       masked_max_rows: int) -> None:
    """P simulated ranks in one process, each on its own stream, every rank's count matrix a
    separate poisoned tensor (a row stride past E + 1) that the others write through plain
    addresses: two rounds of exchange_count_sizes, fresh routing each (unrouted and invalid ids
    included; 4096 and 5000 tokens x top-8 take 8 and 10 chunks, the last one partial). Each
    rank's positions are exchange_count's up to their order within an expert, each matrix holds
    every rank's count row (the columns past E + 1 untouched), each rank's sizes are
    exchange_sizes of that matrix on the CPU, and each rank's scratch is left zero."""
    torch.manual_seed(seed)
    top_k, num_experts = min(8, num_ranks * num_local), num_ranks * num_local
    width = num_experts + 4
    matrices = [torch.full((num_ranks, width), -5, dtype=torch.int32, device="cuda") for _ in range(num_ranks)]
    peer_rows = [torch.tensor([m[r].data_ptr() for m in matrices], dtype=torch.int64, device="cuda")
                 for r in range(num_ranks)]
    rows, flags = barrier_group(num_ranks)
    barriers = [kernels.ExchangeBarrier(rows, f, torch.zeros(1, dtype=torch.int32, device="cuda")) for f in flags]
    scratch = [torch.zeros(num_experts + 2, dtype=torch.int32, device="cuda") for _ in range(num_ranks)]
    streams = [torch.cuda.Stream() for _ in range(num_ranks)]
    for _ in range(2):
        routing = [make_routing(num_tokens, top_k, num_experts) for _ in range(num_ranks)]
        on_device = [t.cuda() for t in routing]
        torch.cuda.synchronize()
        launched = []
        for r in range(num_ranks):
            with torch.cuda.stream(streams[r]):
                launched.append(kernels.exchange_count_sizes(on_device[r], num_local, peer_rows[r], barriers[r],
                                                             matrices[r], r, alignment, masked_max_rows, scratch[r]))
        torch.cuda.synchronize()
        expected = [kernels.exchange_count(t, num_experts) for t in routing]
        matrix = torch.stack([row for _, row in expected])
        for r, (within, pending) in enumerate(launched):
            got = matrices[r].cpu()
            assert torch.equal(got[:, : num_experts + 1], matrix), f"rank {r}'s count matrix"
            assert bool((got[:, num_experts + 1:] == -5).all()), "columns past E + 1 untouched"
            assert pending.wait() == kernels.exchange_sizes(matrix, r, num_local, alignment, masked_max_rows), r
            within, flat, n = within.cpu().long(), routing[r].reshape(-1), routing[r].numel() + 1
            sent = within >= 0
            assert torch.equal(sent, expected[r][0] >= 0), r
            assert torch.equal(torch.sort(flat[sent] * n + within[sent]).values,
                               torch.sort(flat[sent] * n + expected[r][0].long()[sent]).values), r
    assert all(int(f[num_ranks]) == 2 for f in flags), "two barriers counted on every rank"
    assert all(not bool(t.any()) for t in scratch), "scratch left zero"


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks,num_local,num_tokens,alignment,masked_max_rows",
                         [(2, 8, 37, 16, 8), (3, 5, 300, 64, 0), (8, 32, 4096, 128, 32), (2, 4, 0, 128, 32),
                          (2, 8, 5000, 128, 32)])
def test_gpu_count_sizes_matches_the_three_steps(seed, num_ranks, num_local, num_tokens, alignment, masked_max_rows):
    assert_passed(run_in_child(__file__, "count_sizes_rounds", 30, seed=seed, num_ranks=num_ranks,
                               num_local=num_local, num_tokens=num_tokens, alignment=alignment,
                               masked_max_rows=masked_max_rows))


def combine_with_barriers(seed: int, num_ranks: int) -> None:
    """P simulated ranks on their own streams, each with a layout of received rows (a third of
    them padding) whose slot words name pairs of every source, no pair named twice: two rounds of
    exchange_combine with an ExchangeBarrier, each rank then reading its own combine view on its
    stream. The barrier its peers' combine kernels raised from their last CTA orders their rows
    before that read: every pair holds its row, the rest its poison; each rank counts two
    barriers and its CTA counter is back at zero. Ranks arrive in varying orders."""
    torch.manual_seed(seed)
    hidden, pairs_per_rank, num_rows = 256, 64, 300
    combine = tuple(torch.empty(pairs_per_rank, hidden, dtype=torch.bfloat16, device="cuda") for _ in range(num_ranks))
    words = torch.randperm(num_ranks * pairs_per_rank).to(torch.int32)
    slots, m_indices = [], []
    for r in range(num_ranks):
        mine = words[r::num_ranks]
        rows = torch.randperm(num_rows)[: mine.numel()]
        slot = torch.full((num_rows,), -7, dtype=torch.int32)
        slot[rows] = mine
        index = torch.full((num_rows,), -1, dtype=torch.int32)
        index[rows] = 0
        slots.append(slot.cuda())
        m_indices.append(index.cuda())
    views = (tuple(torch.zeros(num_rows, hidden, dtype=torch.uint8, device="cuda") for _ in range(num_ranks)),
             tuple(torch.zeros(num_rows, hidden // 128, device="cuda") for _ in range(num_ranks)),
             tuple(torch.zeros(num_rows, device="cuda") for _ in range(num_ranks)), tuple(slots), combine)
    peers = [kernels.ExchangePeers(*views, r, pairs_per_rank) for r in range(num_ranks)]
    flag_rows, flags = barrier_group(num_ranks)
    done = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(num_ranks)]
    streams = [torch.cuda.Stream() for _ in range(num_ranks)]
    for round_ in range(2):
        outs = [torch.randn(num_rows, hidden, device="cuda").to(torch.bfloat16) for _ in range(num_ranks)]
        for c in combine:
            c.fill_(float("nan"))
        torch.cuda.synchronize()
        # Every rank's combine is queued before any rank's read (a read queued behind a waiting
        # kernel could otherwise hold a later rank's combine on a shared hardware queue).
        for r in range(num_ranks):
            with torch.cuda.stream(streams[r]):
                torch.cuda._sleep(200_000 * ((r + round_) % 3))
                kernels.exchange_combine(peers[r], outs[r], m_indices[r],
                                         barrier=kernels.ExchangeBarrier(flag_rows, flags[r], done[r]))
        seen = []
        for r in range(num_ranks):
            with torch.cuda.stream(streams[r]):
                seen.append(combine[r].clone())
        torch.cuda.synchronize()
        for q in range(num_ranks):
            expected = torch.full((pairs_per_rank, hidden), float("nan"), dtype=torch.bfloat16)
            for r in range(num_ranks):
                rows = (m_indices[r] >= 0).nonzero().view(-1).cpu()
                for row in rows.tolist():
                    word = int(slots[r][row])
                    if word // pairs_per_rank == q:
                        expected[word % pairs_per_rank] = outs[r][row].cpu()
            assert torch.equal(seen[q].cpu().nan_to_num(7), expected.nan_to_num(7)), f"rank {q}, round {round_}"
    assert all(int(f[num_ranks]) == 2 for f in flags) and all(int(d) == 0 for d in done)


def combine_barrier_alone(seed: int) -> None:
    """Rank 0 of 2 combines with the barrier; rank 1 never does."""
    torch.manual_seed(seed)
    peers, expert_out, m_indices, _ = make_combine(2, 40, 256, 0, 20, "cuda")
    flag_rows, flags = barrier_group(2)
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    kernels.exchange_combine(peers, expert_out, m_indices, barrier=kernels.ExchangeBarrier(flag_rows, flags[0], done))
    torch.cuda.synchronize()


# The barrier alone and raised by the combine kernel: the same rounds and the same lone rank.
@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 3, 8])
@pytest.mark.parametrize("child,timeout", [("barriers_order_writes", 20), ("combine_with_barriers", 30)])
def test_gpu_barrier_orders_peer_writes(seed, child, timeout, num_ranks):
    assert_passed(run_in_child(__file__, child, timeout, seed=seed, num_ranks=num_ranks))


@pytest.mark.gpu
@pytest.mark.parametrize("child", ["barrier_alone", "combine_barrier_alone"])
def test_gpu_barrier_without_a_peer_times_out(child):
    assert_timed_out(run_in_child(__file__, child, 2, seed=0), "the exchange barrier of rank 1")


@pytest.mark.parametrize("kernel", [0, 1])
def test_dispatch_and_combine_raise_the_barrier_from_their_last_cta(kernel):
    """The last-CTA counter (a global atomic) and the barrier's fence, flag stores and trapping
    waits are in the dispatch and combine kernels."""
    text = sass(*kernels.jit.native_module().moe_exchange_code(kernel, 8, 7168))
    assert "ATOMG" in text or "RED.E.ADD" in text
    assert "MEMBAR.SC.SYS" in text and "STG.E.STRONG.SYS" in text and "LDG.E.STRONG.SYS" in text
    assert "BPT.TRAP" in text


def test_exchange_barrier_checks():
    rows, flags, done = torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32), \
        torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"flags must be a contiguous torch.int32 tensor of shape \[3\]"):
        kernels.ExchangeBarrier(rows, flags[:2], done)
    with pytest.raises(ValueError, match=r"done must be a contiguous torch.int32 tensor of shape \[1\]"):
        kernels.ExchangeBarrier(rows, flags, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="runs on CUDA"):
        kernels.ExchangeBarrier(rows, flags, done)
    # Lazily negated views (the negative bit): the kernels would read and write their memory.
    for name, args in (("flag_rows", (torch._neg_view(rows), flags, done)),
                       ("flags", (rows, torch._neg_view(flags), done)), ("done", (rows, flags, torch._neg_view(done)))):
        with pytest.raises(ValueError, match=f"ExchangeBarrier: {name} must not be a lazily negated view"):
            kernels.ExchangeBarrier(*args)
    peers, expert_out, m_indices, _ = make_combine(2, 10, 128, 0, 8, "cpu")
    with pytest.raises(TypeError, match="barrier must be None or an ExchangeBarrier"):
        kernels.exchange_combine(peers, expert_out, m_indices, barrier=(rows, flags, done))


def test_count_sizes_argument_checks():
    topk_idx = torch.zeros(4, 2, dtype=torch.int64)
    rows, flags, counts = torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32), \
        torch.zeros(2, 9, dtype=torch.int32)
    # A barrier of CPU tensors, which ExchangeBarrier refuses: every check below comes before the
    # device one.
    barrier = object.__new__(kernels.ExchangeBarrier)
    for name, value in (("flag_rows", rows), ("flags", flags), ("done", torch.zeros(1, dtype=torch.int32))):
        object.__setattr__(barrier, name, value)
    good = dict(topk_idx=topk_idx, num_local_experts=4, peer_rows=rows, barrier=barrier, counts=counts,
                rank=1, alignment=128, masked_max_rows=32)
    with pytest.raises(TypeError, match="barrier must be an ExchangeBarrier"):
        kernels.exchange_count_sizes(**{**good, "barrier": (rows, flags)})
    for change, match in [({"topk_idx": topk_idx.int()}, "topk_idx must be an int64"),
                          ({"peer_rows": rows.int()}, "peer_rows must be a contiguous torch.int64"),
                          ({"peer_rows": rows[:1]}, r"peer_rows must be a contiguous torch.int64 tensor of shape \[2\]"),
                          ({"counts": counts[:, :8]}, r"counts must be an int32 tensor \[2, >= 9\]"),
                          ({"rank": 2}, r"rank must be in \[0, 2\)"),
                          ({"alignment": 0}, "alignment must be an int >= 1"),
                          ({"num_local_experts": 1025, "counts": torch.zeros(2, 2051, dtype=torch.int32)},
                           "at most 2048 experts"),
                          ({}, "runs on CUDA only")]:
        with pytest.raises(ValueError, match=match):
            kernels.exchange_count_sizes(**{**good, **change})


def test_barrier_argument_checks():
    rows = torch.zeros(2, dtype=torch.int64)
    flags = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="flag_rows must be"):
        kernels.exchange_barrier(rows.int(), flags, 0)
    with pytest.raises(ValueError, match=r"flags must be a contiguous int32 tensor \[3\]"):
        kernels.exchange_barrier(rows, flags[:2], 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        kernels.exchange_barrier(rows, flags, 2)
    with pytest.raises(ValueError, match="runs on CUDA"):
        kernels.exchange_barrier(rows, flags, 1)


@pytest.mark.gpu
def test_gpu_dispatch_raises_its_barrier_on_one_rank(seed):
    """With an ExchangeBarrier the dispatch writes what it writes without one, then its last CTA
    passes the group's barrier (one rank: its own flag) and leaves the CTA counter at zero."""
    num_ranks, num_local, num_tokens, top_k, hidden, others = kCases[0]
    gpu, inputs, layout, plan = make_problem(num_ranks, num_local, num_tokens, top_k, hidden, 0, "cuda", others)
    rows, flags = barrier_group(1)
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(2):
        index = kernels.exchange_dispatch(gpu, **inputs, **layout, barrier=kernels.ExchangeBarrier(rows, flags[0], done))
    torch.cuda.synchronize()
    check_dispatch(gpu, inputs, layout, plan)
    check_index(index, plan, layout["first_expert"])
    assert flags[0].tolist() == [2, 2] and int(done) == 0


if __name__ == "__main__":  # a child of run_in_child
    child_main(globals())
