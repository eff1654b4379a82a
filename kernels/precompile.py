"""Compile kernels ahead of time, without a GPU, so a server pays no JIT time on its first request.

    python -m kernels.precompile --arch sm_90a --cache-dir DIR [--family NAME ...] [--model deepseek-v3]

A family is named by its public function (``per_token_cast_to_fp8``, ``fp8_gemm_nt``, ...). The
model preset gives the shapes: every kernel a MoE layer of that model and its dense projections
need, for every M the GEMM heuristic distinguishes (1 to ``--max-m`` tokens). Compilation runs
on a thread pool (the compiler releases the GIL); one line per kernel is printed with its cubin.
Also callable from Python: :func:`precompile`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from . import _fp4

_DTYPE_BF16 = 1  # csrc/apis/dtypes.hpp


@dataclass(frozen=True)
class ModelShapes:
    """The shapes of one model's MoE layer and dense projections that kernels are compiled for."""

    name: str
    hidden: int
    moe_intermediate: int
    dense_nk: tuple[tuple[int, int], ...]  # (N, K) of the dense FP8 projections
    num_experts: int
    max_ep: int  # expert-parallel sizes 1, 2, 4, ... up to this
    max_m: int = 16384
    ep_sizes: tuple[int, ...] = ()  # when given, these expert-parallel sizes instead of 1, 2, .. max_ep

    @property
    def expert_nk(self) -> tuple[tuple[int, int], ...]:
        """(N, K) of the two expert GEMMs: fused gate/up, then down."""
        return ((2 * self.moe_intermediate, self.hidden), (self.hidden, self.moe_intermediate))

    @property
    def local_experts(self) -> tuple[int, ...]:
        if self.ep_sizes:
            return tuple(self.num_experts // ep for ep in self.ep_sizes)
        sizes, ep = [], 1
        while ep <= self.max_ep:
            sizes.append(self.num_experts // ep)
            ep *= 2
        return tuple(sizes)

    @property
    def gemm_ks(self) -> tuple[int, ...]:
        """Every K of a GEMM: the row lengths of the activations and weights that get quantized."""
        return tuple(sorted({self.hidden, self.moe_intermediate, *(k for _, k in self.dense_nk)}))


MODELS = {
    "deepseek-v3": ModelShapes(
        name="deepseek-v3", hidden=7168, moe_intermediate=2048,
        dense_nk=((2112, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168),
                  (7168, 2048)),
        num_experts=256, max_ep=8),
}


@dataclass(frozen=True)
class KernelSource:
    family: str
    label: str  # the parameters, for the report
    name: str
    code: str = field(repr=False)


@dataclass(frozen=True)
class PrecompileResult:
    source: KernelSource
    cubin_path: str
    from_cache: bool
    seconds: float
    wgmma_serialized: bool = False  # ptxas put a wait after every wgmma (jit.BuildResult.wgmma_serialized)


def _native():
    from .jit import native_module

    return native_module()


def _quant_per_token(model: ModelShapes, arch: str, num_sms: int) -> list[KernelSource]:
    out = []
    for n in model.gemm_ks:
        for ue8m0 in (False, True):
            name, code = _native().per_token_cast_to_fp8_code(_DTYPE_BF16, n, 128, ue8m0, arch)
            out.append(KernelSource("per_token_cast_to_fp8", f"bf16 n={n} gran_k=128 ue8m0={ue8m0}", name, code))
    return out


def _quant_per_block(model: ModelShapes, arch: str, num_sms: int) -> list[KernelSource]:
    out = []
    for k in model.gemm_ks:
        for ue8m0 in (False, True):
            name, code = _native().per_block_cast_to_fp8_code(_DTYPE_BF16, k, ue8m0, arch)
            out.append(KernelSource("per_block_cast_to_fp8", f"bf16 k={k} ue8m0={ue8m0}", name, code))
    return out


def _gemm_ms(max_m: int) -> list[int]:
    """One M per heuristic bucket: the tiles depend on M only through its block count. (Whether an A-scale
    copy fits the workspace, and contiguous layouts' 4096-row threshold, fall inside a bucket: its
    kernels with and without the copy are both emitted, the MN-major one and the graph-capture one.)"""
    return [64] + list(range(128, max_m + 128, 128))


def _dense_gemm(family: str, code_fn: str, graph_variant: bool = False) -> Callable[[ModelShapes, str, int], list[KernelSource]]:
    """Sources of a dense GEMM family: every (N, K) of the model's projections at every M bucket.
    graph_variant: also the kernel a call inside a CUDA graph capture gets where it differs (the FP8
    GEMM plans a single wave split over K only with its workspace, which a capture does not take)."""

    def sources(model: ModelShapes, arch: str, num_sms: int) -> list[KernelSource]:
        generate = getattr(_native(), code_fn)
        out = []
        for n, k in model.dense_nk:
            for m in _gemm_ms(model.max_m):
                name, code = generate(m, n, k, num_sms, False, -1)
                out.append(KernelSource(family, f"n={n} k={k} m<={m}", name, code))
                if graph_variant:
                    name, graph_code = generate(m, n, k, num_sms, False, -1, split_workspace=False)
                    if graph_code != code:
                        out.append(KernelSource(family, f"n={n} k={k} m<={m} in a graph", name, graph_code))
        if code_fn == "fp8_gemm_nt_code":  # 256-row tiles copy K-major A scales MN-major first
            out.append(KernelSource(family, "A scales copied MN-major", *_native().mn_major_sf_code()))
        return out

    return sources


_DECODE_EXPECTED_M = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_CONTIGUOUS, _MASKED = 1, 2
_FP4_SWAP_AB_MAX_M = 32  # the decode layout's (transform_fp4_for_decode) masked calls: expected_m up to this


_SCALE_TMA_MN_MAJOR = 1  # fp8_gemm_nt_code's scale_load: A scales MN-major TMA-aligned


def _grouped_code(fp4_weights: bool, m: int, n: int, k: int, num_sms: int, gemm_type: int, groups: int,
                  scale_load: int = -1, split_workspace: bool = True):
    if fp4_weights:
        if _native().fp8_fp4_gemm_nt_uses_swap_ab(m, n, k, num_sms, gemm_type, groups):
            name, code, _ = _native().fp8_fp4_gemm_nt_swap_ab_code(m, n, k, num_sms, groups, gemm_type=gemm_type)
        else:
            name, code, _ = _native().fp8_fp4_gemm_nt_code(m, n, k, num_sms, gemm_type, groups)
        return name, code
    # Contiguous layouts aligned to 256 rows run 256-row tiles: the kernels of the alignment in force.
    from .grouped import get_mk_alignment_for_contiguous_layout

    return _native().fp8_gemm_nt_code(m, n, k, num_sms, False, -1, gemm_type, groups,
                                      alignment=get_mk_alignment_for_contiguous_layout(), scale_load=scale_load,
                                      split_workspace=split_workspace)


def _grouped(family: str, gemm_type: int, fp4_weights: bool) -> Callable[[ModelShapes, str, int], list[KernelSource]]:
    """Sources of an m-grouped family: every expert (N, K) and local expert count (EP 1..8), at every
    M bucket (contiguous) or expected rows per group (masked)."""

    def sources(model: ModelShapes, arch: str, num_sms: int) -> list[KernelSource]:
        out = []
        copies = False  # some plan copies K-major A scales MN-major first (large contiguous layouts)
        cast = False  # some FP4 call runs staged (cast_fp4_to_fp8_blocks first)
        for n, k in model.expert_nk:
            for groups in model.local_experts:
                contiguous = gemm_type == _CONTIGUOUS
                for m in _gemm_ms(model.max_m) if contiguous else _DECODE_EXPECTED_M:
                    # FP4 weights with many rows per group run staged: the cast, then the FP8 kernels.
                    staged = fp4_weights and (m / groups if contiguous else m) >= _fp4.STAGED_MIN_ROWS
                    cast |= staged
                    fp4 = fp4_weights and not staged
                    if contiguous and not fp4 and not copies:
                        from .grouped import get_mk_alignment_for_contiguous_layout

                        copies = bool(_native().fp8_gemm_nt_config(
                            m, n, k, num_sms, gemm_type=gemm_type, num_groups=groups,
                            alignment=get_mk_alignment_for_contiguous_layout())["sfa_copy"])
                    name, code = _grouped_code(fp4, m, n, k, num_sms, gemm_type, groups)
                    rows = (f"m<={m}" if contiguous else f"expected_m={m}") + (" staged" if staged else "")
                    out.append(KernelSource(family, f"n={n} k={k} G={groups} {rows}", name, code))
                    # Staged calls of more groups than a chunk holds run the FP8 kernel per chunk.
                    chunk = _fp4.staged_chunk(n, k)
                    for part in sorted({chunk, groups % chunk} - {0}) if staged and groups > chunk else ():
                        name, part_code = _grouped_code(False, m, n, k, num_sms, gemm_type, part)
                        out.append(KernelSource(family, f"n={n} k={k} G={groups} {rows}, chunks of {part}", name,
                                                part_code))
                    if contiguous and not fp4:
                        # Inside a CUDA graph capture (no workspace, so no copy): the gathers' kernel.
                        name, graph_code = _grouped_code(False, m, n, k, num_sms, gemm_type, groups,
                                                         split_workspace=False)
                        if graph_code != code:
                            out.append(KernelSource(family, f"n={n} k={k} G={groups} {rows} in a graph", name,
                                                    graph_code))
                    # The staged backend's prefill hands the FP8 GEMMs MN-major A scales (TMA boxes
                    # of B's scales need K a multiple of 512; other K gather either layout).
                    if contiguous and not fp4 and k % 512 == 0:
                        name, code = _grouped_code(False, m, n, k, num_sms, gemm_type, groups, _SCALE_TMA_MN_MAJOR)
                        out.append(KernelSource(family, f"n={n} k={k} G={groups} {rows} MN-major A scales", name,
                                                code))
                    if fp4 and not contiguous and m <= _FP4_SWAP_AB_MAX_M:  # transform_fp4_for_decode weights
                        name, code, _ = _native().fp8_fp4_gemm_nt_swap_ab_code(m, n, k, num_sms, groups, True)
                        out.append(KernelSource(family, f"n={n} k={k} G={groups} {rows} decode layout", name, code))
        if copies:
            out.append(KernelSource(family, "A scales copied MN-major", *_native().mn_major_sf_code()))
        if cast:
            out.append(KernelSource(family, "FP4 -> FP8 weight cast (staged calls)",
                                    *_native().cast_fp4_to_fp8_blocks_code(arch)))
        return out

    return sources


def _grouped_swiglu(family: str, gemm_type: int) -> Callable[[ModelShapes, str, int], list[KernelSource]]:
    """Sources of the L1 GEMM with the SwiGLU epilogue (FP8 weights, intermediate a multiple of 128):
    every local expert count at every M bucket (contiguous, MN-major and K-major A scales) or expected
    rows per group (masked)."""

    def sources(model: ModelShapes, arch: str, num_sms: int) -> list[KernelSource]:
        n, k = model.expert_nk[0]
        if n % 256:
            return []
        out = []
        contiguous = gemm_type == _CONTIGUOUS
        loads = (-1, _SCALE_TMA_MN_MAJOR) if contiguous and k % 512 == 0 else (-1,)
        for groups in model.local_experts:
            for m in _gemm_ms(model.max_m) if contiguous else _DECODE_EXPECTED_M:
                for load in loads:
                    name, code, _ = _native().fp8_gemm_nt_swiglu_code(m, n, k, num_sms, gemm_type, groups, load)
                    rows = f"m<={m}" if contiguous else f"expected_m={m}"
                    out.append(KernelSource(family, f"n={n} k={k} G={groups} {rows} scale_load={load}", name, code))
        return out

    return sources


def _grouped_bf16(family: str, gemm_type: int) -> Callable[[ModelShapes, str, int], list[KernelSource]]:
    """Sources of an m-grouped BF16 family (bf16 expert weights): every expert (N, K) and local expert
    count at every M bucket (contiguous) or expected rows per group (masked)."""

    def sources(model: ModelShapes, arch: str, num_sms: int) -> list[KernelSource]:
        out = []
        contiguous = gemm_type == _CONTIGUOUS
        for n, k in model.expert_nk:
            for groups in model.local_experts:
                for m in _gemm_ms(model.max_m) if contiguous else _DECODE_EXPECTED_M:
                    name, code = _native().bf16_gemm_nt_code(m, n, k, num_sms, gemm_type=gemm_type,
                                                             num_groups=groups)
                    rows = f"m<={m}" if contiguous else f"expected_m={m}"
                    out.append(KernelSource(family, f"n={n} k={k} G={groups} {rows}", name, code))
        return out

    return sources


FAMILIES: dict[str, Callable[[ModelShapes, str, int], list[KernelSource]]] = {
    "per_token_cast_to_fp8": _quant_per_token,
    "per_block_cast_to_fp8": _quant_per_block,
    "fp8_gemm_nt": _dense_gemm("fp8_gemm_nt", "fp8_gemm_nt_code", graph_variant=True),
    "bf16_gemm_nt": _dense_gemm("bf16_gemm_nt", "bf16_gemm_nt_code"),
    "m_grouped_fp8_gemm_nt_contiguous": _grouped("m_grouped_fp8_gemm_nt_contiguous", _CONTIGUOUS, False),
    "m_grouped_fp8_gemm_nt_masked": _grouped("m_grouped_fp8_gemm_nt_masked", _MASKED, False),
    "m_grouped_fp8_fp4_gemm_nt_contiguous": _grouped("m_grouped_fp8_fp4_gemm_nt_contiguous", _CONTIGUOUS, True),
    "m_grouped_fp8_fp4_gemm_nt_masked": _grouped("m_grouped_fp8_fp4_gemm_nt_masked", _MASKED, True),
    "m_grouped_fp8_gemm_nt_swiglu_contiguous": _grouped_swiglu("m_grouped_fp8_gemm_nt_swiglu_contiguous", _CONTIGUOUS),
    "m_grouped_fp8_gemm_nt_swiglu_masked": _grouped_swiglu("m_grouped_fp8_gemm_nt_swiglu_masked", _MASKED),
    "m_grouped_bf16_gemm_nt_contiguous": _grouped_bf16("m_grouped_bf16_gemm_nt_contiguous", _CONTIGUOUS),
    "m_grouped_bf16_gemm_nt_masked": _grouped_bf16("m_grouped_bf16_gemm_nt_masked", _MASKED),
}


def collect_sources(families: list[str] | None = None, model: str | ModelShapes = "deepseek-v3",
                    arch: str = "sm_90a", num_sms: int = 132, max_m: int | None = None) -> list[KernelSource]:
    """The distinct kernel sources the families need for the model (a preset name or its own
    :class:`ModelShapes`), deduplicated by code."""
    if not isinstance(model, ModelShapes) and model not in MODELS:
        raise ValueError(f"model={model!r}: expected one of {sorted(MODELS)} or a ModelShapes")
    if families is not None and (isinstance(families, str) or not isinstance(families, (list, tuple))
                                 or not families):
        raise ValueError(f"families must be None (all) or a non-empty list of names from {sorted(FAMILIES)}, "
                         f"got {families!r}")
    chosen = list(families) if families is not None else list(FAMILIES)
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown:
        raise ValueError(f"family {unknown}: expected names from {sorted(FAMILIES)}")
    if arch != "sm_90a":  # every family's kernels are written for Hopper (wgmma, TMA, setmaxnreg)
        raise ValueError(f"arch={arch!r}: the kernels are built for sm_90a (H100/H200) only")
    for name, value in (("num_sms", num_sms), ("max_m", max_m)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    shapes = model if isinstance(model, ModelShapes) else MODELS[model]
    if max_m is not None:
        shapes = dataclasses.replace(shapes, max_m=max_m)
    seen, sources = set(), []
    for family in chosen:
        for src in FAMILIES[family](shapes, arch, num_sms):
            if (src.name, src.code) not in seen:
                seen.add((src.name, src.code))
                sources.append(src)
    return sources


def precompile(families: list[str] | None = None, model: str | ModelShapes = "deepseek-v3", arch: str = "sm_90a",
               num_sms: int = 132, jobs: int | None = None, cache_dir: str | None = None,
               max_m: int | None = None,
               on_result: Callable[[PrecompileResult], None] | None = None) -> list[PrecompileResult]:
    """Compile (or find in the cache) every kernel of ``families`` for ``model`` on ``arch``.

    ``cache_dir`` reconfigures this process's JIT for the call (and restores it after): other
    threads' builds meanwhile land in that folder too, so pass it from a process of its own (the
    CLI) rather than next to a running server. The first failing compile cancels those not started."""
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs must be None or a positive int, got {jobs!r}")
    from . import jit

    previous = jit.ensure_configured()
    if cache_dir is not None:
        jit.configure(dataclasses.replace(previous, cache_dir=str(cache_dir)))
    try:
        return _build_all(collect_sources(families, model, arch, num_sms, max_m), arch, jobs, on_result)
    finally:
        if cache_dir is not None:
            jit.configure(previous)


def _build_all(sources: list[KernelSource], arch: str, jobs: int | None,
               on_result: Callable[[PrecompileResult], None] | None) -> list[PrecompileResult]:
    from . import jit

    report_lock = threading.Lock()  # one report at a time: print's pieces from two threads interleave

    def build(src: KernelSource) -> PrecompileResult:
        start = time.perf_counter()
        res = jit.build(src.name, src.code, arch)
        result = PrecompileResult(src, res.cubin_path, res.from_cache, time.perf_counter() - start,
                                  res.wgmma_serialized)
        if on_result is not None:
            with report_lock:
                on_result(result)
        return result

    pool = ThreadPoolExecutor(max_workers=jobs or max(1, os.cpu_count() or 1))
    try:
        futures = [pool.submit(build, src) for src in sources]
        return [f.result() for f in futures]
    finally:
        # After a failure, the sources not started yet are dropped instead of compiled for nothing.
        pool.shutdown(wait=True, cancel_futures=True)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.precompile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90a", choices=["sm_90a"], help="target architecture (sm_90a)")
    parser.add_argument("--cache-dir", default=None, help="cache folder (default: MOE_JIT_CACHE_DIR or ~/.cache)")
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="repeatable; default: all")
    parser.add_argument("--model", default="deepseek-v3", choices=sorted(MODELS))
    parser.add_argument("--num-sms", type=_positive_int, default=132, help="SM count of the target GPU (H100/H200: 132)")
    parser.add_argument("--max-m", type=_positive_int, default=None, help="largest token count to plan GEMMs for")
    parser.add_argument("--jobs", type=_positive_int, default=None, help="parallel compilations (default: CPU count)")
    args = parser.parse_args(argv)

    def report(r: PrecompileResult) -> None:
        state = "cached" if r.from_cache else "compiled"
        flag = " (wgmmas serialized)" if r.wgmma_serialized else ""
        print(f"{r.source.family:<24} {r.source.label:<36} {state:<8} {r.seconds:6.2f}s {r.cubin_path}{flag}",
              flush=True)

    start = time.perf_counter()
    results = precompile(args.family, args.model, args.arch, args.num_sms, args.jobs, args.cache_dir, args.max_m,
                         on_result=report)
    compiled = sum(not r.from_cache for r in results)
    print(f"{len(results)} kernels ({compiled} compiled, {len(results) - compiled} cached) "
          f"in {time.perf_counter() - start:.1f}s")
    serialized = [r for r in results if r.wgmma_serialized]
    if serialized:  # they run, slowly: the tensor cores idle between wgmmas
        print(f"warning: ptxas serialized the wgmmas of {len(serialized)} kernels (marked above)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
