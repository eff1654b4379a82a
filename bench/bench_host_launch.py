"""Host cost of the launchers' own C++ path, on any machine (no GPU needed).

    python bench/bench_host_launch.py [--iters 20000]

Runs the ``kernels._C`` GEMM entry points under the host-only driver
(``kernels/testing/host_driver.cpp``, which answers as one H200 and records launches instead of
running them), with device addresses that are never dereferenced, and prints the wall time per call
(perf_counter over ``--iters`` calls, best of 5 repeats): the pybind call, the heuristic (or its
memo), the kernel memo, the TMA descriptors (or their memo) and the launch configuration; not the
real driver's own work (its descriptor encodes and cuLaunchKernelEx, which
``bench/bench_host_overhead.py`` includes on a GPU machine). Each row is timed with the descriptor
memo on and off (``MOE_TMA_MEMO=0``, read once per process: a second process, same build);
"encodes/call" counts the descriptors the driver was asked to encode per call. Kernels compile with
NVRTC on first use (JIT cache).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SMS = 132
A, SFA, B, SFB, D, LAYOUT = (0x10_0000_0000 * (i + 1) for i in range(6))  # 16-byte aligned, never read


def _rows(native):
    """(label, call) pairs: raw entry points with fixed addresses, as a serving loop's buffers."""
    def dense(m, n, k, mn_major_scales=True):
        sfa_m, sfa_k = (1, (m + 3) // 4 * 4) if mn_major_scales else (k // 128, 1)
        return lambda: native.fp8_gemm_nt(A, k, SFA, sfa_m, sfa_k, B, k, SFB, k // 128, 1, D, n, 0, -1, 0, m, n, k,
                                          False, 0, 0, 0, 0)

    def contiguous(m, n, k, groups):
        return lambda: native.m_grouped_fp8_gemm_nt_contiguous(
            A, k, SFA, 1, m, B, k, SFB, (n // 128) * (k // 128), k // 128, 1, D, n, LAYOUT, m, n, k, groups, 128, 0,
            0, 0, 0)

    def masked(max_m, expected_m, n, k, groups):
        return lambda: native.m_grouped_fp8_gemm_nt_masked(
            A, k, SFA, 1, max_m, B, k, SFB, (n // 128) * (k // 128), k // 128, 1, D, n, LAYOUT, max_m, expected_m, n,
            k, groups, 0, 0)

    def fp4_masked(max_m, expected_m, n, k, groups):
        return lambda: native.m_grouped_fp8_fp4_gemm_nt_masked(
            A, k, SFA, 1, max_m, B, k // 2, SFB, n * (k // 32), k // 32, D, n, LAYOUT, max_m, expected_m, n, k,
            groups, 0, 0)

    return [
        ("fp8_gemm_nt 128 x 4096 x 7168 (MN-major scales)", dense(128, 4096, 7168)),
        ("fp8_gemm_nt 64 x 2112 x 7168 (K-major scales)", dense(64, 2112, 7168, mn_major_scales=False)),
        ("fp8_gemm_nt 4096 x 7168 x 16384", dense(4096, 7168, 16384)),
        ("m_grouped_fp8_gemm_nt_contiguous 4 x 2048, 4096 x 7168", contiguous(8192, 4096, 7168, 4)),
        ("m_grouped_fp8_gemm_nt_masked 32 x 64 (16), 4096 x 7168", masked(64, 16, 4096, 7168, 32)),
        ("m_grouped_fp8_fp4_gemm_nt_masked 32 x 64 (8), 4096 x 7168", fp4_masked(64, 8, 4096, 7168, 32)),
    ]


def _per_call_us(fn, iters: int) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    return best


def _child(iters: int) -> int:
    """Prints one JSON line: the pybind floor and (label, µs/call, encodes/call) per row."""
    from kernels.jit import native_module
    from kernels.testing.host_driver import HostDriverRecord

    record = HostDriverRecord.attach()
    native = native_module()
    rows = []
    for label, fn in _rows(native):
        fn()  # compiles (or loads) the kernel
        before = record.encodes()
        fn()
        encodes = record.encodes() - before
        rows.append((label, _per_call_us(fn, iters), encodes))
    floor = _per_call_us(lambda: native.fp8_gemm_split_workspace_bytes(SMS), iters)
    print(json.dumps({"floor": floor, "rows": rows}))
    return 0


def _run_child(env: dict, iters: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", "--iters", str(iters)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_host_launch child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.iters)
    from kernels.testing.host_driver import build_host_driver, host_driver_env

    with tempfile.TemporaryDirectory(prefix="moe_host_driver_") as tmp:
        env = host_driver_env(build_host_driver(tmp))
        env.pop("MOE_TMA_MEMO", None)
        memo = _run_child(env, args.iters)
        fresh = _run_child({**env, "MOE_TMA_MEMO": "0"}, args.iters)
    print(f"pybind call floor (fp8_gemm_split_workspace_bytes): {memo['floor']:.3f} µs\n")
    print("| call (kernels._C, host-only driver) | µs/call | µs/call, MOE_TMA_MEMO=0 | encodes/call | "
          "encodes/call, MOE_TMA_MEMO=0 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for (label, us, encodes), (_, fresh_us, fresh_encodes) in zip(memo["rows"], fresh["rows"]):
        print(f"| {label} | {us:.3f} | {fresh_us:.3f} | {encodes} | {fresh_encodes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
