"""Compile the expert GEMMs a served stack can call before the timed loop starts.

The JIT compiles a kernel the first time a batch needs its configuration, and the contiguous
grouped GEMMs have one configuration per range of layout rows, so every band first met by a batch
paid a compilation inside the loop (2 x H200, DeepSeek-V3 preset, 256 requests, without this: a
3.6 s window serving 767 tokens when batches shrank from prefill to mixed sizes, forwards 7.26 s of
an 8.58 s run; compilations are the likely cause). ``kernels.precompile`` knows those configurations; the first
rank of each host compiles them (a thread pool, into the disk cache its ranks share) while the
others wait.
"""

from __future__ import annotations

import time

import torch

import kernels
from kernels import precompile as aot

from .config import MoEModelConfig

kGroupedFamilies = {
    "fp8": ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked"),
    "fp4": ("m_grouped_fp8_fp4_gemm_nt_contiguous", "m_grouped_fp8_fp4_gemm_nt_masked"),
}


def stack_shapes(model: MoEModelConfig, world_size: int, max_batch_tokens: int) -> aot.ModelShapes:
    """The expert GEMM shapes of ``model`` served on ``world_size`` ranks: the layout rows of a
    rank reach ``world_size * max_batch_tokens * min(top_k, E_l)`` plus each expert's padding (at
    most the contiguous layout's alignment - 1 rows)."""
    if world_size < 1 or model.num_experts % world_size:
        raise ValueError(f"world_size: expected a divisor of num_experts={model.num_experts}, got {world_size}")
    local = model.num_experts // world_size
    padding = kernels.get_mk_alignment_for_contiguous_layout() - 1
    rows = world_size * max_batch_tokens * min(model.top_k, local) + local * padding
    return aot.ModelShapes(name="served", hidden=model.hidden_size, moe_intermediate=model.intermediate_size,
                           dense_nk=(), num_experts=model.num_experts, max_ep=world_size, max_m=rows,
                           ep_sizes=(world_size,))


def precompile_stack(model: MoEModelConfig, weights: str, world_size: int, max_batch_tokens: int, *, arch: str,
                     num_sms: int, cache_dir: str | None = None) -> tuple[int, int, float]:
    """Compiles (or finds cached) every grouped GEMM kernel the stack can call; returns (kernels,
    compiled now, seconds). ``arch`` e.g. ``sm_90a``; ``num_sms`` what the GEMM heuristics plan
    for (``kernels.get_num_sms``)."""
    if weights not in kGroupedFamilies:
        raise ValueError(f"weights: expected one of {sorted(kGroupedFamilies)}, got {weights!r}")
    start = time.perf_counter()
    results = aot.precompile(list(kGroupedFamilies[weights]), stack_shapes(model, world_size, max_batch_tokens),
                             arch=arch, num_sms=num_sms, cache_dir=cache_dir)
    return len(results), sum(not r.from_cache for r in results), time.perf_counter() - start


def device_target(device: torch.device) -> tuple[str, int]:
    """(arch, SM count the GEMM heuristics plan for) of a CUDA device."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}a", kernels.get_num_sms(device.index)
