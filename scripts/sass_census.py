"""Our dense FP8 GEMM's kernels with and without an environment variant, in SASS, without a GPU:
each compiled here for sm_90a with NVRTC and disassembled with cuobjdump; per problem the plan's
tile and stages, the innermost K loops (instructions / K blocks), cp.async copies and spills.

    python scripts/sass_census.py --ms 64,128 --variant MOE_FP8_OVERLAP=0

Prints a Markdown table (the first columns are the default's, the second the variant's).
"""

from __future__ import annotations

import argparse
import os
import sys

kRepo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [kRepo, os.path.join(kRepo, "tests", "kernels")]

import kernels  # noqa: E402
from gemm_cases import DEEPSEEK_NK, H200_SMS  # noqa: E402
from kernels.testing import env_switches, parse_env_variants  # noqa: E402
from test_sass import _innermost_k_loops, sass  # noqa: E402


def k_loops(code: str, block_n: int, waves: int = 1) -> list[tuple[int, int]]:
    """(instructions, K blocks) of each innermost K loop: four QGMMAs and block_n / 2 FFMAs per K
    block and wave (256-row tiles run two waves; the barrier waits' out-of-line retries branch back
    over whole loops and are left out)."""
    loops = set()
    for body in _innermost_k_loops(code, 8192 * waves):
        ops = [op for op in body.splitlines() if op.strip()]
        k_blocks = sum("QGMMA" in op for op in ops) // (4 * waves)
        if k_blocks and sum("FFMA" in op for op in ops) == k_blocks * waves * block_n // 2:
            loops.add((len(ops), k_blocks))
    return sorted(loops)


def census(m: int, n: int, k: int) -> dict:
    native = kernels.jit.native_module()
    config = native.fp8_gemm_nt_config(m, n, k, H200_SMS)
    if config["sfa_copy"]:  # the kernel that runs is the MN-major plan's, on the copy of A's scales
        config = dict(native.fp8_gemm_nt_config(m, n, k, H200_SMS, scale_load=1), scale_load="tma_mn_major (copy)")
    code = sass(*native.fp8_gemm_nt_code(m, n, k, H200_SMS))
    return dict(config=config, loops=k_loops(code, config["block_n"], 2 if config["block_m"] == 256 else 1),
                ldgsts="LDGSTS" in code, spills="LDL" in code or "STL" in code)


def row(m: int, n: int, k: int, variant: dict[str, str]) -> str:
    """One table row: the default (the variant's variables unset) against the variant; the
    environment is left as it was."""
    with env_switches(**variant):
        for name in variant:
            os.environ.pop(name)
        base = census(m, n, k)
    with env_switches(**variant):
        var = census(m, n, k)
    loops = lambda c: ", ".join(f"{ops}/{kb}" for ops, kb in c["loops"])  # noqa: E731
    tile = lambda c: f"{c['config']['block_m']} x {c['config']['block_n']}"  # noqa: E731
    return (f"| {m} x {n} x {k} | {tile(base)}, {base['config']['scale_load']} | {tile(var)}, {var['config']['scale_load']} "
            f"| {base['config']['num_stages']} / {var['config']['num_stages']} | {loops(base)} | {loops(var)} "
            f"| {base['ldgsts']} / {var['ldgsts']} | {base['spills']} / {var['spills']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="64,128")
    parser.add_argument("--variant", required=True, metavar="NAME=VALUE[,NAME=VALUE...]")
    args = parser.parse_args()
    (_, variant), = parse_env_variants([args.variant])
    print("| M x N x K | default tile, scale load | variant tile, scale load | stages | K loops, default "
          "(instructions / K blocks) | K loops, variant | LDGSTS | spills |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in (int(x) for x in args.ms.split(",")):
        for n, k in DEEPSEEK_NK:
            print(row(m, n, k, variant), flush=True)


if __name__ == "__main__":
    main()
