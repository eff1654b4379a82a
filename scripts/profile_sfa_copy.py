"""Kernel spans of FP8 GEMMs on K-major A scales with and without the A-scale copy (the default copies
for dense 256-row tiles and large contiguous layouts; MOE_FP8_SFA_COPY=0 gathers; =all adds early
loads) and on the caller's MN-major scales, the runs of all variants interleaved (each round runs
every variant once, in rotated order, each after an L2 flush) so that the GPU's drift over a long
profile falls on all alike: where an A-scale copy's cost goes (the copy's
own duration, the GEMM's start after the copy's, the GEMM's duration, the whole).
    python scripts/profile_sfa_copy.py [--rounds 20]"""
import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor

import torch

import kernels
from kernels.testing import env_switches
from kernels.testing.bench import _l2_flush, flush_mode

VARIANTS = [("default", False, {}), ("no copy (=0)", False, {"MOE_FP8_SFA_COPY": "0"}),
            ("copy, early loads (=all)", False, {"MOE_FP8_SFA_COPY": "all"}),
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


def split(events):
    """(copy us, GEMM start after the copy's us, GEMM us, whole us) of each call, in order."""
    out, i = [], 0
    while i < len(events):
        if "mn_major_sf" in events[i].name and i + 1 < len(events):
            c, g = events[i], events[i + 1]
            out.append((c.time_range.end - c.time_range.start, g.time_range.start - c.time_range.start,
                        g.time_range.end - g.time_range.start, g.time_range.end - c.time_range.start))
            i += 2
        else:
            d = events[i].time_range.end - events[i].time_range.start
            out.append((0.0, 0.0, d, d))
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
        runs = []
        for label, mn, env in VARIANTS:
            operand = a_mn if mn else a
            def run(operand=operand, env=env):
                with env_switches(**env):
                    call(operand)
            for _ in range(3):
                run()
            runs.append((label, run))
        torch.cuda.synchronize()
        order = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for r in range(args.rounds):
                for j in range(len(runs)):
                    which = (r + j) % len(runs)
                    flush()
                    torch.cuda.synchronize()
                    runs[which][1]()
                    torch.cuda.synchronize()
                    order.append(which)
        events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                         and ("fp8_gemm" in e.name or "mn_major_sf" in e.name)), key=lambda e: e.time_range.start)
        calls = split(events)
        if len(calls) != len(order):
            raise RuntimeError(f"{name}: {len(calls)} calls seen, {len(order)} run")
        for v, (label, _) in enumerate(runs):
            mine = [c for c, w in zip(calls, order) if w == v]
            cols = [statistics.median(col) for col in zip(*mine)]
            print(f"{name:>40} {label:>22} | " + "  ".join(f"{x:8.1f}" for x in cols), flush=True)


if __name__ == "__main__":
    main()
