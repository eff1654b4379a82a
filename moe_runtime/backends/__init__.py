"""MoE backends: ``reference`` (pure torch), ``staged`` (separate GPU kernels), ``low_latency`` (the
staged experts behind a device-driven transport for decode), ``fused`` (one kernel).

A backend module exposes ``is_supported(problem) -> (bool, reason)`` and
``create(problem, experts, group) -> (DispatchCombine, Experts)``.
"""

from __future__ import annotations

import importlib

from moe_runtime.backends.base import (CombineHandle, DispatchCombine, DispatchResult, Experts, LocalExperts,
                                       MoEProblem)

__all__ = ["CombineHandle", "DispatchCombine", "DispatchResult", "Experts", "LocalExperts", "MoEProblem",
           "kBackendNames", "resolve_backend", "create_backend"]

kBackendNames = ("reference", "staged", "low_latency", "fused", "auto")
_kModules = {"reference": "moe_runtime.backends.reference", "staged": "moe_runtime.backends.staged",
             "low_latency": "moe_runtime.backends.low_latency"}


def resolve_backend(name: str, problem: MoEProblem) -> str:
    """Turn a user's backend name into the one that will run, or raise.

    ``"auto"``: ``"staged"`` on CUDA when it supports ``problem``, else ``"reference"``; bf16 weights
    keep ``"reference"`` until the staged bf16 pair has run on a GPU (ask for ``"staged"`` to use it).
    ``"fused"``, and ``"staged"`` where it does not support ``problem``, raise
    NotImplementedError with the reason.
    """
    if name not in kBackendNames:
        raise ValueError(f"backend must be one of {kBackendNames}, got {name!r}")
    if name == "fused":
        raise NotImplementedError("the fused Mega MoE kernel is not implemented yet; use backend='reference' "
                                  "(or 'auto')")
    if name in ("staged", "low_latency"):
        supported, reason = importlib.import_module(_kModules[name]).is_supported(problem)
        if not supported:
            raise NotImplementedError(f"backend={name!r} cannot run this layer: {reason}; use backend='reference' "
                                      "(or 'auto')")
    if name == "auto":
        if problem.device.type == "cuda" and problem.weights != "bf16":
            module = importlib.import_module(_kModules["staged"])
            if module.is_supported(problem)[0]:
                return "staged"
        return "reference"
    return name


def create_backend(name: str, problem: MoEProblem, experts: LocalExperts, group):
    """``(DispatchCombine, Experts)`` of the resolved backend ``name`` for ``problem``."""
    module = importlib.import_module(_kModules[name])
    return module.create(problem, experts, group)
