"""Reference spot-checks: rerun a served batch with backend="reference" and compare, layer by layer.

Every ``every`` batches the served forward records each layer's input and output, each layer is
run again with the reference backend on that input (the served residual stream, with the same
already-quantized weights), and the two outputs are compared with ``calc_diff``; the check
reports the worst layer.
Comparing whole stacks would judge the routing instead of the backend: top-k selection is
discontinuous, so the last-bit differences of one layer flip near-tied experts in the next ones
(the DeepSeek-V3 preset's 4-layer stack, staged vs reference on two H200s: 1.4e-2 for the whole
stack, at most 8.6e-5 for any layer).
A reference forward is a collective like any other, so every rank checks the same batch index (a
rank with no tokens takes part and reports 0).
"""

from __future__ import annotations

import contextlib
import math

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

    def check(self, x: torch.Tensor, layer_io: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Worst calc_diff over layers of the served output against the reference output on the same
        input; ``x`` [T, H] the batch, ``layer_io`` what the served forward recorded
        (``MoEStack.forward(x, layer_io)``). 0 when this rank has no tokens; inf when an output is
        not finite."""
        if len(layer_io) != len(self.stack.layers):
            raise ValueError(f"layer_io holds {len(layer_io)} layers' inputs and outputs, the stack has "
                             f"{len(self.stack.layers)}")
        worst = 0.0
        with torch.no_grad():
            for layer, (block_input, served) in zip(self.stack.layers, layer_io):
                with reference_backend([layer]):
                    expected = layer(block_input)
                if x.shape[0]:
                    diff = calc_diff(served, expected)
                    worst = max(worst, diff if math.isfinite(diff) else math.inf)
        return worst
