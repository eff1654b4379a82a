"""The L1 GEMM with the SwiGLU epilogue against the staged pair it replaces, in one run.

    python bench/bench_grouped_swiglu.py [--experts 32] [--intermediate 2048] [--hidden 7168]
                                         [--rows 512,2048,8192] [--tokens 1,16,64,256]

The staged pair: ``m_grouped_fp8_gemm_nt_*`` into bf16 ``[gate | up]`` rows, then
``swiglu_quant_fp8`` (what the staged backend runs between its two GEMMs); the fused call:
``m_grouped_fp8_gemm_nt_swiglu_*`` on the same weights gate/up interleaved. Contiguous: ``--experts``
groups of ``--rows`` rows each (A scales MN-major, as the staged backend passes them); masked: groups of
``--tokens`` valid rows (max_m = tokens). Kernel µs from the profiler with the L2 flushed before each run,
every kernel of a call counted (the staged pair's two), both interleaved in one profile; time per call
from Python on an idle stream. "act equal": the fraction of act bytes and scales both give alike.
``--share-b`` times the fused call against itself in 2-CTA clusters sharing B (``MOE_FP8_MULTICAST=b``)
instead of against the staged pair; ``--variant NAME=VALUE[,...]`` against itself under those switches
(``MOE_SWIGLU_WIDE=1``: 256-column tiles).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

import kernels
from kernels.testing import bench_kineto_interleaved, env_call, parse_env_variants, per_call_us_interleaved
from moe_runtime.weight_layout import transform_weights_for_mega_moe


def weights(g: int, inter: int, hidden: int):
    """Random FP8 L1 weights [G, 2I, H] with block scales, checkpoint order and interleaved."""
    w = (torch.randn(g, 2 * inter, hidden, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    sf = torch.rand(g, 2 * inter // 128, hidden // 128, device="cuda") + 0.5
    down = (torch.zeros(g, hidden, inter, device="cuda", dtype=torch.float8_e4m3fn),
            torch.ones(g, hidden // 128, inter // 128, device="cuda"))
    return (w, sf), tuple(transform_weights_for_mega_moe((w, sf), down).l1)


def activations(rows: int, hidden: int, mn_major: bool):
    x, sf = kernels.per_token_cast_to_fp8(torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16))
    return x, kernels.get_mn_major_tma_aligned_tensor(sf) if mn_major else sf


def agreement(fused, staged) -> float:
    same = (fused[0].view(torch.uint8) == staged[0].view(torch.uint8)).float().mean()
    return min(float(same), float((fused[1] == staged[1]).float().mean()))


@dataclass
class L1Problem:
    """An L1 problem of ``g`` groups: A (e4m3 [M, hidden] or masked [g, tokens, hidden], f32 scales), the
    index (m_indices int32 [M], or masked_m int32 [g]), top-k weights f32 per row, the staged pair's bf16
    ``h`` [rows, 2I] and the fused call's act e4m3 [rows, I] and act_sf f32 [rows, I/128]."""
    a: tuple[torch.Tensor, torch.Tensor]
    index: torch.Tensor
    topk: torch.Tensor
    h: torch.Tensor
    act: torch.Tensor
    act_sf: torch.Tensor


def contiguous_problem(g: int, per: int, inter: int, hidden: int) -> L1Problem:
    """``per`` rows per group, sorted by group; A's scales and act_sf MN-major (as the staged backend
    passes them)."""
    m = g * per
    return L1Problem(activations(m, hidden, True),
                     torch.arange(g, device="cuda", dtype=torch.int32).repeat_interleave(per),
                     torch.rand(m, device="cuda"), torch.empty(m, 2 * inter, device="cuda", dtype=torch.bfloat16),
                     torch.empty(m, inter, device="cuda", dtype=torch.float8_e4m3fn),
                     kernels.get_mn_major_tma_aligned_tensor(torch.zeros(m, inter // 128, device="cuda")))


def masked_problem(g: int, tokens: int, inter: int, hidden: int) -> L1Problem:
    """``tokens`` valid rows in each group of max_m = tokens rows."""
    x, sf = activations(g * tokens, hidden, False)
    return L1Problem((x.view(g, tokens, hidden), sf.view(g, tokens, -1)),
                     torch.full((g,), tokens, device="cuda", dtype=torch.int32), torch.rand(g, tokens, device="cuda"),
                     torch.empty(g, tokens, 2 * inter, device="cuda", dtype=torch.bfloat16),
                     torch.empty(g, tokens, inter, device="cuda", dtype=torch.float8_e4m3fn),
                     torch.empty(g, tokens, inter // 128, device="cuda"))


def contiguous_row(g: int, per: int, inter: int, hidden: int, w, w1, peer_env: dict) -> list[str]:
    m = g * per
    p = contiguous_problem(g, per, inter, hidden)
    a, m_indices, topk, h, act, act_sf = p.a, p.index, p.topk, p.h, p.act, p.act_sf

    def staged():
        kernels.m_grouped_fp8_gemm_nt_contiguous(a, w, h, m_indices)
        return kernels.swiglu_quant_fp8(h, topk, mn_major_sf=True)

    def fused():
        kernels.m_grouped_fp8_gemm_nt_swiglu_contiguous(a, w1, (act, act_sf), m_indices, topk)
        return act, act_sf

    return row(f"contiguous {g} x {per}", m, inter, hidden, fused, staged, peer_env)


def masked_row(g: int, tokens: int, inter: int, hidden: int, w, w1, peer_env: dict) -> list[str]:
    p = masked_problem(g, tokens, inter, hidden)
    a, masked_m, topk, h, act, act_sf = p.a, p.index, p.topk, p.h, p.act, p.act_sf

    def staged():
        kernels.m_grouped_fp8_gemm_nt_masked(a, w, h, masked_m, tokens)
        out, out_sf = kernels.swiglu_quant_fp8(h.view(g * tokens, -1), topk.view(-1), masked_m, tokens)
        return out.view(g, tokens, -1), out_sf.view(g, tokens, -1)

    def fused():
        kernels.m_grouped_fp8_gemm_nt_swiglu_masked(a, w1, (act, act_sf), masked_m, tokens, topk)
        return act, act_sf

    return row(f"masked {g} x {tokens}", g * tokens, inter, hidden, fused, staged, peer_env)


def row(name: str, m: int, inter: int, hidden: int, fused, staged, peer_env: dict) -> list[str]:
    if peer_env:  # the peer: the fused call under other switches
        staged = env_call(fused, **peer_env)
        first = tuple(t.clone() for t in fused())
        equal = agreement(first, staged())
    else:
        equal = agreement(fused(), staged())
    t_fused, t_staged = bench_kineto_interleaved([(fused, ""), (staged, "")])
    c_fused, c_staged = per_call_us_interleaved([fused, staged])
    tflops = 2 * m * 2 * inter * hidden / t_fused.median_s / 1e12
    return [name, f"{t_fused.median_s * 1e6:.1f}", f"{t_staged.median_s * 1e6:.1f}",
            f"{t_staged.median_s / t_fused.median_s:.2f}x", f"{tflops:.0f}", f"{c_fused:.1f} / {c_staged:.1f}",
            f"{equal:.4f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--rows", default="512,2048,8192", help="contiguous rows per expert (multiples of 128)")
    parser.add_argument("--tokens", default="1,16,64,256", help="masked rows per expert")
    parser.add_argument("--share-b", action="store_true", help="the peer: the fused call in clusters sharing B")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE[,...]",
                        help="the peer: the fused call under these switches")
    args = parser.parse_args()
    peer_env = dict(MOE_FP8_MULTICAST="b") if args.share_b else {}
    for _, env in parse_env_variants(args.variant):
        peer_env.update(env)
    if not torch.cuda.is_available():
        raise SystemExit("bench_grouped_swiglu.py needs a CUDA device")
    torch.manual_seed(0)
    g, inter, hidden = args.experts, args.intermediate, args.hidden
    w, w1 = weights(g, inter, hidden)
    print(f"{torch.cuda.get_device_name()}; {g} experts, N x K = {2 * inter} x {hidden} (L1 of intermediate {inter})")
    peer = (f"fused, {','.join(f'{k}={v}' for k, v in peer_env.items())}" if peer_env else "staged (GEMM + SwiGLU)")
    print(f"| layout | fused µs | {peer} µs | speed-up | fused TFLOP/s | per call µs fused / peer | act equal |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    cells = [(contiguous_row, int(r)) for r in args.rows.split(",") if r]
    cells += [(masked_row, int(t)) for t in args.tokens.split(",") if t]
    for make, rows in cells:
        print("| " + " | ".join(make(g, rows, inter, hidden, w, w1, peer_env)) + " |", flush=True)


if __name__ == "__main__":
    main()
