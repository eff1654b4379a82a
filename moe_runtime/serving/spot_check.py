"""Reference spot-checks: rerun a served batch with backend="reference" and compare.

Every ``every`` batches the stack's input is run again with each layer switched to the reference
backend over the same (already quantized) weights, and ``calc_diff`` against the served output
is taken. A reference forward is a collective like any other, so every rank checks the same batch
index (a rank with no tokens takes part and reports 0).
"""

from __future__ import annotations

import contextlib

import torch

from kernels.testing.numeric import calc_diff

from .model import MoEStack

kReferenceBackend = "reference"


@contextlib.contextmanager
def reference_backend(layers):
    """Run ``layers`` (MegaMoELayers) on the reference backend inside the block; the served
    backend's cached state (e.g. its symmetric buffer) is kept rather than rebuilt."""
    with contextlib.ExitStack() as stack:
        for layer in layers:
            stack.enter_context(layer.use_backend(kReferenceBackend))
        yield


class SpotChecker:
    """``due(batch_index)`` says when; ``check(x, out)`` returns this rank's calc_diff (0 if no tokens)."""

    def __init__(self, stack: MoEStack, *, every: int, tol: float):
        if every < 0:
            raise ValueError(f"spot_check_every: expected >= 0 (0 disables), got {every}")
        if not tol > 0:
            raise ValueError(f"spot_check_tol: expected > 0, got {tol}")
        self.stack = stack
        self.every = every
        self.tol = tol

    def due(self, batch_index: int) -> bool:
        return self.every > 0 and batch_index % self.every == 0

    def check(self, x: torch.Tensor, out: torch.Tensor) -> float:
        with torch.no_grad(), reference_backend(list(self.stack.layers)):
            expected = self.stack(x)
        if x.shape[0] == 0:
            return 0.0
        return calc_diff(out, expected)
