"""Compare the K loops of DeepGEMM's SM90 FP8 kernel (the peer) and ours in SASS, without a GPU:
both compiled here for sm_90a with NVRTC and disassembled with cuobjdump, the instruction mix of
each innermost K loop printed per K block.

    python scripts/peer_sass.py --groups 4 --contiguous 8192 --n 4096 --k 7168 \
        --peer "128, 192, 128, 128, 128, 128, 4, 128, 256, 2, false"
    python scripts/peer_sass.py --m 128 --n 4096 --k 7168 --peer "64, 64, 128, 128, 128, 128, 13, 128, 128, 1, false"

--peer gives DeepGEMM's template arguments from block M to its multicast flag (block M, N, K,
swizzles of A, B and D, stages, TMA threads, math threads, cluster size, multicast on A), as its
generated kernel.cu (scripts/peer_deepgemm.sh writes them to deepgemm_kernels.txt) or ncu's kernel
name show them. DeepGEMM's headers come from .peer/DeepGEMM (scripts/peer_env.sh), CuTe from the
nvidia-cutlass wheel; its NVRTC build needs a few stand-ins for what nvcc would bring (std::
utility, the grid dependency calls), written to a temporary folder. Our kernel is the one the
heuristic picks for the same problem (environment switches apply), compiled in the same process
and so with DeepGEMM's flags too (C++20, 128-bit integers; ours ships with C++17), which the
comparisons so far did not show to matter.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile

kRepo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [kRepo, os.path.join(kRepo, "tests", "kernels"), os.path.join(kRepo, "scripts")]

from deepgemm_once import add_problem_args, problem_rows  # noqa: E402  (the same problem options)

_UTILITY_SHIM = """#pragma once
#include <cuda/std/utility>
#include <cuda/std/type_traits>
namespace std { using namespace cuda::std; }
"""
_PDL_SHIMS = """
__device__ __forceinline__ void cudaGridDependencySynchronize() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void cudaTriggerProgrammaticLaunchCompletion() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
"""
_GEMM_TYPES = {0: "Normal", 1: "MGroupedContiguous", 2: "MGroupedMasked"}


def peer_code(m_compiled: int, n: int, k: int, groups: int, gemm_type: int, peer_args: str, num_sms: int) -> str:
    return (_PDL_SHIMS + "#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>\n"
            "static void moe_instantiate() {\n"
            "  auto ptr = reinterpret_cast<void*>(&deep_gemm::sm90_fp8_gemm_1d2d_impl<\n"
            f"      cute::UMMA::Major::K, {m_compiled}, {n}, {k}, {groups}, {peer_args}, {num_sms},\n"
            f"      deep_gemm::GemmType::{_GEMM_TYPES[gemm_type]}, cutlass::bfloat16_t,\n"
            "      deep_gemm::epilogue::transform::EpilogueIdentity>);\n"
            "  (void)ptr;\n}\n")


def k_loop_mix(code: str) -> list[tuple[int, int, collections.Counter]]:
    """(instructions, K blocks, opcode counts) of every innermost K loop holding a whole K block;
    tile loops whose K loop the compiler unrolled whole (an epilogue's F2FP inside) are left out."""
    from test_sass import _innermost_k_loops  # the SASS tests' loop finder
    loops = []
    for body in _innermost_k_loops(code, max_bytes=40960):
        ops = [line for line in body.splitlines() if line.strip()]
        k_blocks = sum("QGMMA" in line for line in ops) // 4
        if k_blocks and not any("F2FP" in line for line in ops):
            names = (re.sub(r"^@!?U?P\w+\s+", "", line).split()[0].split(".")[0] for line in ops)
            loops.append((len(ops), k_blocks, collections.Counter(names)))
    return loops


def report(name: str, code: str, top: int) -> None:
    print(f"== {name}")
    for count, k_blocks, mix in sorted(k_loop_mix(code), key=lambda loop: loop[0] / loop[1]):
        print(f"  {count} instructions, {k_blocks} K blocks: {count / k_blocks:.1f} per K block; "
              + ", ".join(f"{op} {n / k_blocks:.1f}" for op, n in mix.most_common(top)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_problem_args(p)
    p.add_argument("--peer", required=True, help="DeepGEMM's template arguments from block M to its multicast flag")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--top", type=int, default=14, help="opcodes shown per loop")
    args = p.parse_args()

    peer_include = os.path.join(kRepo, ".peer", "DeepGEMM", "deep_gemm", "include")
    if not os.path.isdir(os.path.join(peer_include, "deep_gemm")):
        print(f"no DeepGEMM headers in {peer_include} (see scripts/peer_env.sh)", file=sys.stderr)
        return 1
    shims = tempfile.mkdtemp(prefix="peer_sass_")
    with open(os.path.join(shims, "utility"), "w", encoding="utf-8") as f:
        f.write(_UTILITY_SHIM)
    # DeepGEMM's own NVRTC flags (C++20, 128-bit integers), set before the JIT reads its settings
    # (on the first native_module() call, not at import).
    os.environ["MOE_JIT_EXTRA_FLAGS"] = (f"-I{peer_include} -I{shims} --device-int128 -std=c++20 "
                                         "--diag-suppress=39,161,174,177,186,940")
    os.environ.setdefault("MOE_JIT_CACHE_DIR", os.path.join(tempfile.gettempdir(), "peer_sass_jit"))

    import kernels  # noqa: E402
    from test_sass import sass  # noqa: E402

    gemm_type, groups = (1, args.groups) if args.groups else (0, 1)
    m = problem_rows(args)
    native = kernels.jit.native_module()
    ours_args = (m, args.n, args.k, args.sms, False, -1, gemm_type, groups)
    config = native.fp8_gemm_nt_config(*ours_args)
    report(f"DeepGEMM (.peer) <{args.peer}>", sass("peer_sm90_fp8_gemm_1d2d",
                                                 peer_code(0, args.n, args.k, groups, gemm_type, args.peer, args.sms)),
           args.top)
    report("ours " + " ".join(f"{key}={config[key]}" for key in ("block_m", "block_n", "num_stages", "multicast",
                                                                 "share_b", "pingpong", "k_unroll", "overlap")),
           sass(*native.fp8_gemm_nt_code(*ours_args)), args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
