"""python -m kernels.precompile: offline compilation without a GPU, one line per kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
import kernels.jit

from kernels import precompile


def run_cli(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "kernels.precompile", *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


def test_cli_compiles_then_hits_the_cache(tmp_path: Path):
    args = ("--arch", "sm_90a", "--cache-dir", str(tmp_path), "--family", "per_token_cast_to_fp8",
            "--family", "per_block_cast_to_fp8", "--model", "deepseek-v3", "--jobs", "2")
    first = run_cli(*args)
    kernel_lines = first[:-1]
    assert len(kernel_lines) == 20 and "20 kernels (20 compiled, 0 cached)" in first[-1]
    for line in kernel_lines:
        cubin = Path(line.split()[-1])
        assert cubin.is_file() and cubin.read_bytes()[:4] == b"\x7fELF" and tmp_path in cubin.parents
    second = run_cli(*args)
    assert "20 kernels (0 compiled, 20 cached)" in second[-1]


def test_every_family_generates_deduplicated_sources():
    sources = precompile.collect_sources(max_m=1024)
    families = {s.family for s in sources}
    assert families == set(precompile.FAMILIES)
    assert len({(s.name, s.code) for s in sources}) == len(sources)


def test_dense_sources_cover_calls_inside_a_graph_capture():
    """A captured dense FP8 call gets no split workspace and plans whole tiles: precompile generates
    that kernel too wherever it differs (N = 576 at few rows, whose default splits over K)."""
    native = kernels.jit.native_module()
    codes = {s.code for s in precompile.collect_sources(["fp8_gemm_nt"], max_m=4096)}
    for m, n, k in [(64, 576, 7168), (128, 576, 7168), (1024, 7168, 16384), (4096, 2112, 7168)]:
        for split_workspace in (True, False):
            assert native.fp8_gemm_nt_code(m, n, k, 132, split_workspace=split_workspace)[1] in codes, \
                (m, n, k, split_workspace)


def test_contiguous_sources_follow_the_alignment():
    """Contiguous FP8 kernels are generated for the layout alignment in force: aligned to 256 rows,
    the large layouts' kernels are the 256-row tiles the calls will run."""
    def block_ms():
        sources = precompile.collect_sources(["m_grouped_fp8_gemm_nt_contiguous"], max_m=16384)
        return {int(s.code.split("sm90_fp8_gemm_nt<")[1].split(",")[4]) for s in sources if s.name == "sm90_fp8_gemm_nt"}

    assert 256 not in block_ms()
    kernels.set_mk_alignment_for_contiguous_layout(256)
    try:
        assert 256 in block_ms()
    finally:
        kernels.set_mk_alignment_for_contiguous_layout(128)


def test_contiguous_sources_cover_mn_major_scales():
    """The staged backend's prefill calls the contiguous FP8 GEMM on MN-major A scales: those kernels
    (TMA-loaded A scales) are generated beside the K-major ones, and are what such a call gets."""
    native = kernels.jit.native_module()
    codes = {s.code for s in precompile.collect_sources(["m_grouped_fp8_gemm_nt_contiguous"], max_m=4096)}
    for m, n, k, groups in [(4096, 4096, 7168, 32), (1024, 7168, 2048, 256)]:
        for scale_load in (-1, 1):
            name, code = native.fp8_gemm_nt_code(m, n, k, 132, False, -1, 1, groups, scale_load=scale_load,
                                                 alignment=kernels.get_mk_alignment_for_contiguous_layout())
            assert code in codes, (m, n, k, groups, scale_load)
    sfa = kernels.get_mn_major_tma_aligned_tensor(torch.zeros(4096, 56))
    assert native.fp8_gemm_scale_load(1, 4096, 4096, 7168, 32, 1 << 20, sfa.stride(0), sfa.stride(1), 1 << 21,
                                      32 * 56, 56, 1) == "tma_mn_major"


def test_gemm_family_compiles(tmp_path: Path):
    results = precompile.precompile(["m_grouped_fp8_gemm_nt_masked"], max_m=128, jobs=2, cache_dir=str(tmp_path))
    assert results and all(Path(r.cubin_path).is_file() for r in results)
    assert not [r.source.label for r in results if r.wgmma_serialized]


@pytest.mark.parametrize("bad,match", [(["nope"], "family"), (None, "model")])
def test_bad_names(bad, match):
    with pytest.raises(ValueError, match=match):
        precompile.collect_sources(bad, model="deepseek-v3" if bad else "llama")


@pytest.mark.parametrize("kwargs,match", [
    (dict(families=[]), "non-empty list"),
    (dict(families="fp8_gemm_nt"), "non-empty list"),
    (dict(arch="sm_100a"), "sm_90a"),
    (dict(num_sms=0), "num_sms must be a positive int"),
    (dict(max_m=-5), "max_m must be a positive int"),
])
def test_bad_arguments_raise_before_compiling(kwargs, match):
    with pytest.raises(ValueError, match=match):
        precompile.collect_sources(**kwargs)


@pytest.mark.parametrize("argv", [["--jobs", "-1"], ["--num-sms", "0"], ["--max-m", "x"], ["--arch", "bogus"]])
def test_cli_refuses_bad_numbers_and_arch(argv, capsys):
    with pytest.raises(SystemExit) as info:
        precompile.main(argv)
    assert info.value.code == 2 and "error" in capsys.readouterr().err


def test_a_failing_compile_cancels_the_rest(monkeypatch):
    """The first error stops the pool: sources not started are not compiled."""
    started = []

    def build(name, code, arch):
        started.append(name)
        raise RuntimeError("boom")

    monkeypatch.setattr(kernels.jit, "build", build)
    sources = precompile.collect_sources(["fp8_gemm_nt"], max_m=4096)
    assert len(sources) > 8
    with pytest.raises(RuntimeError, match="boom"):
        precompile._build_all(sources, "sm_90a", 1, None)
    assert len(started) < len(sources)


@pytest.mark.parametrize("family", ["fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous"])
def test_sources_cover_the_copy_of_a_scales(family, monkeypatch):
    """Where a plan copies K-major A scales MN-major first (dense 256-row tiles and contiguous layouts
    of 4096 rows or more; under MOE_FP8_SFA_COPY=all every dense tile), the copy's kernel is among the
    sources, and the GEMM's kernel is the one behind the copy (the MN-major plan's); contiguous
    families also hold the gathers' kernel a call inside a CUDA graph capture (no workspace) runs."""
    native = kernels.jit.native_module()
    copy_code = native.mn_major_sf_code()[1]
    monkeypatch.delenv("MOE_FP8_SFA_COPY", raising=False)
    alignment = kernels.get_mk_alignment_for_contiguous_layout()

    def sources():
        return {s.code for s in precompile.collect_sources([family], max_m=4096)}

    codes = sources()
    assert copy_code in codes
    if family == "m_grouped_fp8_gemm_nt_contiguous":
        behind = native.fp8_gemm_nt_code(4096, 4096, 7168, 132, False, -1, 1, 32, alignment=alignment)[1]
        in_graph = native.fp8_gemm_nt_code(4096, 4096, 7168, 132, False, -1, 1, 32, alignment=alignment,
                                           split_workspace=False)[1]
        assert behind != in_graph and {behind, in_graph} <= codes
    monkeypatch.setenv("MOE_FP8_SFA_COPY", "all")
    codes = sources()
    assert copy_code in codes
    if family == "fp8_gemm_nt":  # 64-row tiles copy only under =all: the MN-major plan's kernel runs
        assert native.fp8_gemm_nt_config(128, 4096, 7168, 132)["sfa_copy"] == 1
        code = native.fp8_gemm_nt_code(128, 4096, 7168, 132)[1]
        assert code == native.fp8_gemm_nt_code(128, 4096, 7168, 132, scale_load=1)[1] and code in codes
