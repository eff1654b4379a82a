"""The staged backend's exchange plan: where every dispatched row goes, computed identically on every
rank from the count matrix all ranks read (host tensors), plus the device-side expansion of its
per-group offsets into row indices."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExchangePlan:
    """The row layout of one forward, from the count matrix every rank reads (host tensors, int64).

    ``counts`` [P_dst, P_src, E_l]: rows rank ``p`` sends to local expert ``e`` of rank ``q`` is
    ``counts[q, p, e]``. Rank ``q``'s contiguous layout has one segment per local expert,
    ``align_up(counts[q, :, e].sum(), alignment)`` rows long, in expert order; inside segment ``e``
    the rows of source 0 come first, then source 1, and so on. In the masked layout
    (``masked_rows[q] > 0``) every segment is ``masked_rows[q]`` long: ``[E_l, masked_rows[q], H]``.
    """

    rank: int
    alignment: int
    counts: torch.Tensor
    padded_rows: tuple[int, ...]            # [P_dst]: rows of each rank's layout, padding included
    send_counts: torch.Tensor               # [E]: rows this rank sends per global expert
    send_delta: torch.Tensor                # [E]: layout row of the i-th sorted pair = i + delta[its expert]
    send_rows_per_rank: tuple[int, ...]     # [P_dst]
    recv_counts: torch.Tensor               # [P_src * E_l], source-major: rows this rank receives
    recv_delta: torch.Tensor                # [P_src * E_l]: as send_delta, for rows grouped by source
    recv_rows_per_source: tuple[int, ...]   # [P_src]
    expert_rows: torch.Tensor               # [E_l]: valid rows of each local expert here
    expert_delta: torch.Tensor              # [E_l]: as send_delta, for rows grouped by expert
    masked_rows: tuple[int, ...] = ()       # [P_dst]: rows per expert segment in the masked layout, 0: contiguous

    @property
    def num_ranks(self) -> int:
        return self.counts.shape[0]

    @property
    def num_local_experts(self) -> int:
        return self.counts.shape[2]

    @property
    def num_layout_rows(self) -> int:
        """Rows of this rank's layout (padding included): the grouped GEMMs' M (or G x max_m)."""
        return self.padded_rows[self.rank]

    @property
    def masked_max_m(self) -> int:
        """Rows per expert of this rank's masked layout; 0 when its layout is contiguous."""
        return self.masked_rows[self.rank] if self.masked_rows else 0

    @property
    def num_send_rows(self) -> int:
        return sum(self.send_rows_per_rank)

    @property
    def num_recv_rows(self) -> int:
        """Valid rows this rank's experts receive (padding excluded)."""
        return sum(self.recv_rows_per_source)


def exclusive_cumsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return x.cumsum(dim) - x


@dataclass(frozen=True)
class LayoutSizes:
    """What a host needs of the layouts (the device lays the rows out): ``padded_rows`` [P_dst]
    rows of each rank's layout, padding included; ``masked_rows`` [P_dst] rows per segment of a
    masked layout, 0 for a contiguous one; ``num_send_rows`` pairs rank ``rank`` sends;
    ``invalid_ids`` [P_src] each source's expert ids outside [-1, E) (``kernels.exchange_sizes``
    reads them from the count matrix's last column; empty from :func:`layout_sizes`)."""

    rank: int
    padded_rows: tuple[int, ...]
    masked_rows: tuple[int, ...]
    num_send_rows: int
    invalid_ids: tuple[int, ...] = ()

    @property
    def num_layout_rows(self) -> int:
        return self.padded_rows[self.rank]

    @property
    def masked_max_m(self) -> int:
        return self.masked_rows[self.rank]


def _segments(counts: torch.Tensor, rank: int, alignment: int, masked_max_rows: int):
    """Checked int64 counts, rows per expert [P_dst, E_l], segment lengths [P_dst, E_l] and the
    masked layouts' rows per segment [P_dst] (0: contiguous)."""
    if counts.dim() != 3 or counts.shape[0] != counts.shape[1] or counts.is_floating_point():
        raise ValueError(f"counts must be an integer tensor [P, P, E_local], got {counts.dtype} {tuple(counts.shape)}")
    if not 0 <= rank < counts.shape[0]:
        raise ValueError(f"rank must be in [0, {counts.shape[0]}), got {rank}")
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"alignment must be a positive int, got {alignment!r}")
    counts = counts.to(device="cpu", dtype=torch.int64)
    if bool((counts < 0).any()):
        raise ValueError(f"counts must be non-negative, got {counts.tolist()}")
    per_expert = counts.sum(1)                                   # [P_dst, E_l]
    padded = (per_expert + alignment - 1) // alignment * alignment
    # amax, not max(1): the CPU max with indices takes ~1.2 ms on a [2, 128] tensor (amax ~2 us).
    most = per_expert.amax(1) if per_expert.numel() else torch.zeros(counts.shape[0], dtype=torch.int64)
    masked = torch.where((most > 0) & (most <= min(masked_max_rows, alignment - 1)), most, 0)
    padded = torch.where(masked[:, None] > 0, masked[:, None].expand_as(padded), padded)
    return counts, per_expert, padded, masked


def layout_sizes(counts: torch.Tensor, rank: int, alignment: int, masked_max_rows: int = 0) -> LayoutSizes:
    """The :class:`LayoutSizes` of :func:`plan_exchange`'s layouts, without the row offsets."""
    counts, _, padded, masked = _segments(counts, rank, alignment, masked_max_rows)
    return LayoutSizes(rank, tuple(padded.sum(1).tolist()), tuple(masked.tolist()), int(counts[:, rank].sum()))


def plan_exchange(counts: torch.Tensor, rank: int, alignment: int, masked_max_rows: int = 0) -> ExchangePlan:
    """Build the :class:`ExchangePlan` of rank ``rank`` from ``counts`` int [P_dst, P_src, E_l] (host).

    A destination whose experts each receive at most ``min(masked_max_rows, alignment - 1)`` rows
    (and some receive rows) gets the masked layout: never more rows than the contiguous layout's
    worst case, so the receive buffers sized for that hold it."""
    counts, per_expert, padded, masked = _segments(counts, rank, alignment, masked_max_rows)
    segment_start = exclusive_cumsum(padded)                   # [P_dst, E_l]
    start = segment_start[:, None, :] + exclusive_cumsum(counts, 1)  # [P_dst, P_src, E_l]
    send_counts = counts[:, rank, :].reshape(-1)
    send_delta = start[:, rank, :].reshape(-1) - exclusive_cumsum(send_counts)
    recv_counts = counts[rank].reshape(-1)
    recv_delta = start[rank].reshape(-1) - exclusive_cumsum(recv_counts)
    expert_rows = per_expert[rank]
    expert_delta = segment_start[rank] - exclusive_cumsum(expert_rows)
    return ExchangePlan(rank, alignment, counts, tuple(padded.sum(1).tolist()), send_counts, send_delta,
                        tuple(counts[:, rank, :].sum(1).tolist()), recv_counts, recv_delta,
                        tuple(counts[rank].sum(1).tolist()), expert_rows, expert_delta, tuple(masked.tolist()))


def expand_rows(delta: torch.Tensor, repeats: torch.Tensor, total: int) -> torch.Tensor:
    """int64 [total]: ``i + delta[g]`` for the i-th element, element ``i`` in group ``g`` (groups of
    ``repeats[g]`` consecutive elements). ``output_size`` keeps it free of a device sync."""
    return torch.arange(total, device=delta.device) + torch.repeat_interleave(delta, repeats, output_size=total)
