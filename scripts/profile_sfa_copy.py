"""Kernel spans of FP8 GEMMs on K-major A scales with and without the A-scale copy (the default copies
for dense 256-row tiles and large contiguous layouts; MOE_FP8_SFA_COPY=0 gathers) and on the caller's
MN-major scales, the runs of all variants interleaved (each round runs every variant once, in rotated
order, each after an L2 flush) so that the GPU's drift over a long profile falls on all alike: where
an A-scale copy's cost goes (the copy's own duration, the GEMM's start after the copy's, the GEMM's
duration, the whole).
    python scripts/profile_sfa_copy.py [--rounds 20]"""
import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor

import torch

import kernels
from kernels.testing import env_call, env_switches
from kernels.testing.bench import _l2_flush, _profiled, flush_mode, interleaved_order

VARIANTS = [("default", False, {}), ("no copy (=0)", False, {"MOE_FP8_SFA_COPY": "0"}),
            ("caller's MN-major", True, {})]


CONTIGUOUS = ((4, 8192, 4096, 7168), (4, 8192, 7168, 2048))
DENSE = ((4096, 7168, 16384), (4096, 4096, 7168))


def warm() -> None:
    """Every kernel the variants run, compiled in parallel (one by one they would take minutes)."""
    native, sms = kernels.jit.native_module(), kernels.get_num_sms()
    shapes = [(g * rows, n, k, 1, g) for g, rows, n, k in CONTIGUOUS] + [(m, n, k, 0, 1) for m, n, k in DENSE]
    sources = {native.mn_major_sf_code()}
    for _, mn, env in VARIANTS:
        with env_switches(**env):
            for m, n, k, gemm_type, groups in shapes:
                sources.add(native.fp8_gemm_nt_code(m, n, k, sms, gemm_type=gemm_type, num_groups=groups,
                                                    scale_load=1 if mn else -1))
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda src: kernels.jit.build(src[0], src[1], "sm_90a"), sources))


def cells():
    for g, rows, n, k in CONTIGUOUS:
        a = kernels.per_token_cast_to_fp8(torch.randn(g * rows, k, device="cuda", dtype=torch.bfloat16))
        b = kernels.per_block_cast_to_fp8(torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16))
        idx = torch.arange(g, device="cuda", dtype=torch.int32).repeat_interleave(rows)
        d = torch.empty(g * rows, n, device="cuda", dtype=torch.bfloat16)
        yield f"contiguous {g} x {rows}, {n} x {k}", a, lambda x, b=b, d=d, idx=idx: kernels.m_grouped_fp8_gemm_nt_contiguous(x, b, d, idx)
    for m, n, k in DENSE:
        a = kernels.per_token_cast_to_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        b = kernels.per_block_cast_to_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        yield f"dense {m} x {n} x {k}", a, lambda x, b=b, d=d: kernels.fp8_gemm_nt(x, b, d)


def split(kernels):
    """(copy us, GEMM start after the copy's us, GEMM us, whole us) of each call, in order, from the
    calls' kernels ((name, start µs, duration µs), in start order)."""
    out, i = [], 0
    while i < len(kernels):
        if "mn_major_sf" in kernels[i][0] and i + 1 < len(kernels):
            (_, c_start, c_us), (_, g_start, g_us) = kernels[i], kernels[i + 1]
            out.append((c_us, g_start - c_start, g_us, g_start + g_us - c_start))
            i += 2
        else:
            out.append((0.0, 0.0, kernels[i][2], kernels[i][2]))
            i += 1
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    warm()
    flush, _ = _l2_flush(flush_mode())
    print(f"{'cell':>40} {'variant':>22} | copy us  GEMM start us  GEMM us  whole us  (medians of {args.rounds})")
    for name, a, call in cells():
        a_mn = (a[0], kernels.get_mn_major_tma_aligned_tensor(a[1]))
        runs = [(label, env_call(lambda operand=(a_mn if mn else a): call(operand), **env)) for label, mn, env in VARIANTS]
        for _, run in runs * 3:
            run()
        torch.cuda.synchronize()
        order = interleaved_order(len(runs), args.rounds)
        kernels_seen = _profiled([runs[which][1] for which in order], flush)
        calls = split([kern for kern in kernels_seen if "fp8_gemm" in kern[0] or "mn_major_sf" in kern[0]])
        if len(calls) != len(order):
            raise RuntimeError(f"{name}: {len(calls)} calls seen, {len(order)} run")
        for v, (label, _) in enumerate(runs):
            mine = [c for c, w in zip(calls, order) if w == v]
            cols = [statistics.median(col) for col in zip(*mine)]
            print(f"{name:>40} {label:>22} | " + "  ".join(f"{x:8.1f}" for x in cols), flush=True)


if __name__ == "__main__":
    main()
