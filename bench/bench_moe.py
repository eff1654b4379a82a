"""One DeepSeek-V3 MoE layer forward: the staged backend (FP8 or FP4 weights) against bf16 torch
(``torch._grouped_mm``).

    python bench/bench_moe.py [--tokens 1,16,128,512,4096,8192] [--local-experts 256|32] [--iters 20]
        [--weights fp8|fp4] [--variant NAME=VALUE[,NAME=VALUE...]]

The layer: hidden 7168, intermediate 2048, top-8, DeepSeek-V3 routing (sigmoid, score bias, 8 groups
of which 4 are kept, scaling 2.5), routed experts only (no shared expert). ``--local-experts 256``
is EP=1; ``--local-experts 32`` is the load of one EP=8 rank, modelled as a 32-expert layer on
which all T x 8 routes land (every rank sends this one its share). Both sides route with the same
weights and include the router.

* staged: ``MegaMoELayer(weights="fp8", backend="staged")``: FP8 quantization, local permutation
  into the contiguous layout, two ``m_grouped_fp8_gemm_nt_contiguous``, SwiGLU x weight, FP8
  requantization, combine; ``--weights fp4``: the same with E2M1 weights (UE8M0 per 1x32) and
  ``m_grouped_fp8_fp4_gemm_nt_contiguous``; ``--weights bf16``: the same bf16 weights as the torch
  side through ``m_grouped_bf16_gemm_nt_contiguous`` (the reference all-gather exchange, one host
  sync per forward; no masked layout, no graph). Batches where no expert gets more than 32 rows take the
  masked layout and the ``m_grouped_*_masked`` GEMMs (FP4: weights in the decode layout); up to 512
  tokens the table also times the same layer forced onto the contiguous layout, in the same run.
  Up to 32 tokens the one-rank forward never syncs with the host: the table also times the same
  forward captured once in a CUDA graph and replayed (what a decode loop does).
* bf16 torch: sort-based permute, ``torch._grouped_mm`` for gate_up and down, SwiGLU,
  weighted combine with ``index_add_``, on the same bf16 weights the FP8 ones were quantized from.

``--variant`` times the staged forward again with environment switches set (e.g.
``MOE_STAGED_MN_MAJOR_SF=0``), beside the default forward timed just before and just after it
(the column gives the variant's time over their mean), after checking its output against the
default forward's (calc_diff < 1e-4). Not sampled in turn: the time per forward includes host work,
and switching the environment before every forward would make the launchers re-plan each time.

Time: median over ``--iters`` forwards of the wall time between CUDA events around one forward
issued on an idle stream (kernels and host work, including the staged backend's host sync).
Accuracy: calc_diff of each output against the reference backend (the FP8 numerics contract).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.testing import env_switches, parse_env_variants, per_call_us
from kernels.testing.numeric import calc_diff
from moe_runtime import MegaMoELayer, RouterConfig
from moe_runtime.backends import staged
from moe_runtime.router import route, router_logits
from moe_runtime.serving.spot_check import reference_backend

kHidden, kIntermediate, kTopK = 7168, 2048, 8
kCompareLayoutsUpTo = 512  # token counts whose batches can take the masked decode layout


def deepseek_router() -> RouterConfig:
    return RouterConfig(scoring_func="sigmoid", norm_topk_prob=True, n_group=8, topk_group=4,
                        routed_scaling_factor=2.5, use_score_bias=True)


@dataclass
class Bf16Weights:
    """``router`` [E, H], ``bias`` float32 [E], ``gate_up`` bf16 [E, 2I, H], ``down`` bf16 [E, H, I]."""

    router: torch.Tensor
    bias: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def make_weights(num_experts: int, device: torch.device, seed: int = 0) -> Bf16Weights:
    """Random weights scaled like a trained layer's (unit-variance activations through each GEMM)."""
    g = torch.Generator(device=device).manual_seed(seed)
    # Drawn in bf16 in place: no float32 copy of the 22 GB of a 256-expert layer.
    gate_up = torch.empty(num_experts, 2 * kIntermediate, kHidden, dtype=torch.bfloat16, device=device)
    gate_up.normal_(0.0, kHidden ** -0.5, generator=g)
    down = torch.empty(num_experts, kHidden, kIntermediate, dtype=torch.bfloat16, device=device)
    down.normal_(0.0, kIntermediate ** -0.5, generator=g)
    # bf16, as MegaMoELayer stores it: both sides then route identically.
    router = (torch.randn(num_experts, kHidden, generator=g, device=device) * kHidden ** -0.5).to(torch.bfloat16)
    bias = torch.randn(num_experts, generator=g, device=device) * 0.01
    return Bf16Weights(router, bias, gate_up, down)


def bf16_forward(x: torch.Tensor, w: Bf16Weights, config: RouterConfig) -> torch.Tensor:
    """bf16 [T, H] -> bf16 [T, H] with ``torch._grouped_mm`` (2-D tokens x 3-D weights, offsets along M)."""
    num_tokens, num_experts = x.shape[0], w.gate_up.shape[0]
    routing = route(router_logits(x, w.router, config), kTopK, config, w.bias)
    flat = routing.topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // kTopK
    # scatter_add_ rather than bincount, which syncs with the device.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x.index_select(0, tokens), w.gate_up.transpose(1, 2), offs=offs)
    act = (F.silu(h[:, :kIntermediate].float()) * h[:, kIntermediate:].float()).to(torch.bfloat16)
    y = torch._grouped_mm(act, w.down.transpose(1, 2), offs=offs)
    weights = routing.topk_weights.reshape(-1).index_select(0, order)
    out = torch.zeros((num_tokens, kHidden), dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, y.float() * weights.unsqueeze(1))
    return out.to(torch.bfloat16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,16,128,512,4096,8192", help="comma-separated token counts")
    parser.add_argument("--local-experts", type=int, choices=[256, 32], default=256,
                        help="256: the whole layer (EP=1); 32: one EP=8 rank's shard")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-check", action="store_true", help="skip the reference-backend accuracy columns")
    parser.add_argument("--weights", choices=["fp8", "fp4", "bf16"], default="fp8",
                        help="the staged layer's expert weights (bf16: the reference exchange around the bf16 "
                             "grouped GEMMs, no masked layout or graph columns)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE...]",
                        help="also time the staged forward with these environment switches set")
    args = parser.parse_args()
    try:
        variants = parse_env_variants(args.variant)
    except ValueError as err:
        parser.error(str(err))
    if not torch.cuda.is_available():
        print("bench_moe: needs a CUDA device", file=sys.stderr)
        return 1
    token_counts = [int(t) for t in args.tokens.split(",")]
    if not token_counts or min(token_counts) < 1:
        parser.error(f"--tokens must be positive ints, got {args.tokens!r}")
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts, config = args.local_experts, deepseek_router()
    began = time.perf_counter()

    weights = make_weights(num_experts, device)
    layer = MegaMoELayer(kHidden, kIntermediate, num_experts, kTopK, router=config, weights=args.weights,
                         backend="staged", num_max_tokens_per_rank=max(token_counts), device=device)
    layer.load_weights(router_weight=weights.router, gate_up=weights.gate_up, down=weights.down,
                       score_bias=weights.bias)
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - began

    rows = []
    with torch.inference_mode():
        for num_tokens in token_counts:
            x = torch.randn(num_tokens, kHidden, device=device).to(torch.bfloat16)
            staged_out, torch_out = layer(x), bf16_forward(x, weights, config)  # also JIT-compiles on first use
            if args.no_check:
                diffs = ("-", "-")
            else:
                with reference_backend([layer]):
                    expected = layer(x)
                diffs = (f"{calc_diff(staged_out, expected):.1e}", f"{calc_diff(torch_out, expected):.1e}")
            staged_us = per_call_us(lambda: layer(x), args.iters)
            contiguous_us = None
            if num_tokens <= kCompareLayoutsUpTo and args.weights != "bf16":
                dispatch_combine = layer._backend(device)[0]
                dispatch_combine.masked_max_rows = 0
                try:
                    # The same forward in the contiguous layout: the same rows, the same numbers up to
                    # the kernels' accumulation order.
                    contiguous_out = layer(x)
                    if not args.no_check and calc_diff(contiguous_out, staged_out) > 1e-4:
                        raise RuntimeError(f"{num_tokens} tokens: the contiguous layout's forward differs from the "
                                           f"masked one (calc_diff {calc_diff(contiguous_out, staged_out):.1e})")
                    contiguous_us = per_call_us(lambda: layer(x), args.iters)
                finally:
                    dispatch_combine.masked_max_rows = staged.kMaskedMaxRows
            graph_us = None
            if num_tokens <= staged.kMaskedMaxRows and args.weights != "bf16":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    graph_out = layer(x)
                graph.replay()
                if not torch.equal(graph_out, staged_out):
                    raise RuntimeError(f"{num_tokens} tokens: the graph replay differs from the eager forward")
                graph_us = per_call_us(graph.replay, args.iters)
            variant_cells = []
            for label, env in variants:
                with env_switches(**env):
                    variant_out = layer(x)
                    if calc_diff(variant_out, staged_out) > 1e-4:
                        raise RuntimeError(f"{num_tokens} tokens, {label}: the output differs from the default "
                                           f"forward's (calc_diff {calc_diff(variant_out, staged_out):.1e})")
                before = per_call_us(lambda: layer(x), args.iters)
                with env_switches(**env):
                    variant_us = per_call_us(lambda: layer(x), args.iters)
                after = per_call_us(lambda: layer(x), args.iters)
                variant_cells.append(f"{variant_us:.0f} ({2 * variant_us / (before + after):.2f}x)")
            torch_us = per_call_us(lambda: bf16_forward(x, weights, config), args.iters)
            rows.append((num_tokens, staged_us, contiguous_us, graph_us, torch_us, *diffs, variant_cells))
            print(f"tokens {num_tokens}: staged {staged_us:.0f} us, bf16 torch {torch_us:.0f} us", file=sys.stderr,
                  flush=True)

    props = torch.cuda.get_device_properties(device)
    command = " ".join(["python bench/bench_moe.py", *sys.argv[1:]])
    print(f"\n`{command}`")
    print(f"\n{props.name}, torch {torch.__version__}; DeepSeek-V3 MoE layer, hidden {kHidden}, intermediate "
          f"{kIntermediate}, top-{kTopK}, {num_experts} local experts, routed experts only; median of {args.iters} "
          f"forwards, CUDA events around each (host work included); setup {setup_s:.0f} s, total "
          f"{time.perf_counter() - began:.0f} s.\n")
    print(f"| tokens | staged {args.weights.upper()} (µs) | staged, contiguous layout only (µs) "
          "| staged, CUDA graph replay (µs) | bf16 torch._grouped_mm (µs) | speed-up over bf16 "
          "| calc_diff staged vs reference | calc_diff bf16 vs reference |"
          + "".join(f" staged {label} (µs, over the default timed beside it) |" for label, _ in variants))
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(variants))
    for num_tokens, staged_us, contiguous_us, graph_us, torch_us, d_staged, d_torch, variant_cells in rows:
        contiguous = "-" if contiguous_us is None else f"{contiguous_us:.0f}"
        graph = "-" if graph_us is None else f"{graph_us:.0f}"
        print(f"| {num_tokens} | {staged_us:.0f} | {contiguous} | {graph} | {torch_us:.0f} "
              f"| {torch_us / staged_us:.2f}x | {d_staged} | {d_torch} |" + "".join(f" {c} |" for c in variant_cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
