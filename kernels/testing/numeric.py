"""Numeric comparison helpers."""

from __future__ import annotations

import torch


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``1 - 2 sum(xy) / sum(x^2 + y^2)`` in float64: 0 for equal tensors, scale-aware.

    A NaN or Inf anywhere gives ``inf`` rather than a small number, so a test can never pass on
    poisoned output. Two all-zero tensors compare as equal (0.0).
    """
    if x.shape != y.shape:
        raise ValueError(f"calc_diff: shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
    x, y = x.double(), y.double()
    if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
        return float("inf")
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)


def count_bytes(*tensors: torch.Tensor) -> int:
    """Total bytes of the given tensors (None entries are skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
