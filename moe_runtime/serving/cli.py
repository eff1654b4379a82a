"""Command line of ``launch/serve_moe.py``: argument parsing into ``ServeOptions`` and the main."""

from __future__ import annotations

import argparse
import datetime
import sys
import traceback

import torch

from .config import PRESETS
from .control import RankFailureError
from .requests import LengthRange

# Per-preset defaults for what the user did not say: the embedded config finishes in seconds on
# two CPU ranks; the DeepSeek-V3 preset is sized for H200s.
kPresetDefaults = {
    "small": dict(layers=2, num_requests=128, request_rate=100.0, prompt_tokens="8-48", output_tokens="2-16",
                  max_batch_tokens=256, spot_check_every=16),
    "deepseek-v3": dict(layers=4, num_requests=2048, request_rate=2000.0, prompt_tokens="64-1024",
                        output_tokens="16-128", max_batch_tokens=4096, spot_check_every=64),
}
kDtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


class _HelpFormatter(argparse.HelpFormatter):
    """Each option's default in its help, unless it is none or the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        hidden = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not hidden and "default" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve_moe.py", formatter_class=_HelpFormatter,
        description="Serve the MoE layers of a model across the ranks of torchrun (expert parallelism). "
                    "With no arguments: a small embedded config that runs on CPU.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small", help="embedded layer shape and routing")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="safetensors checkpoint in the transformers layout; its MoE layers replace the preset "
                        "(the families of moe_runtime.integrations.hf, by config.json's model_type, but those "
                        "of moe_runtime.serving.config.kCheckpointUnsupported)")
    p.add_argument("--layers", type=int,
                   help="number of MoE layers to serve (default: per preset; all of a checkpoint)")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "staged", "low_latency", "fused"],
                   help="MegaMoELayer backend (auto: staged on CUDA, reference on CPU; fused is not implemented "
                        "yet and says so)")
    p.add_argument("--weights", default="fp8", choices=["bf16", "fp8", "fp4"], help="expert weight format")
    p.add_argument("--dtype", default="bf16", choices=sorted(kDtypes), help="activation dtype")
    p.add_argument("--num-requests", type=int, help="requests over all ranks (default: per preset: small 128, "
                                                    "deepseek-v3 2048)")
    p.add_argument("--duration", type=float, metavar="S",
                   help="stop admitting requests after S seconds, finish those admitted and exit")
    p.add_argument("--request-rate", type=float, help="Poisson arrivals per second over all ranks (default: per "
                                                      "preset: small 100, deepseek-v3 2000)")
    p.add_argument("--prompt-tokens", help="synthetic prompt length, N or LOW-HIGH (default: per preset: small 8-48, "
                                           "deepseek-v3 64-1024)")
    p.add_argument("--output-tokens", help="synthetic decode steps per request, N or LOW-HIGH (default: per preset: "
                                           "small 2-16, deepseek-v3 16-128)")
    p.add_argument("--requests-jsonl", metavar="FILE",
                   help="requests from a file, one JSON object a line: prompt_tokens, output_tokens, arrival_s, id")
    p.add_argument("--max-batch-tokens", type=int, help="tokens per rank per step, the layer capacity (default: per "
                                                        "preset: small 256, deepseek-v3 4096)")
    p.add_argument("--metrics-out", metavar="FILE", help="write the final metrics as JSON")
    p.add_argument("--spot-check-every", type=int, metavar="N",
                   help="compare against the reference backend every N batches, 0: never (default: per preset: "
                        "small 16, deepseek-v3 64)")
    p.add_argument("--spot-check-tol", type=float, default=1e-3, help="calc_diff above which a spot-check fails")
    p.add_argument("--log-interval", type=float, default=0.5, metavar="S", help="seconds between progress lines")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="a rank that does not reach the next step within S seconds is reported as hung")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the synthetic requests")
    p.add_argument("--no-progress", action="store_true", help="no progress lines, only the final summary")
    p.add_argument("--no-precompile", action="store_true",
                   help="skip compiling the expert GEMMs before the timed loop (they then compile on first use)")
    return p


def options_from_args(args: argparse.Namespace):
    """Parsed arguments -> ``ServeOptions`` (preset defaults filled in)."""
    from .loop import ServeOptions

    defaults = kPresetDefaults[args.preset]

    def pick(value, key):
        return defaults[key] if value is None else value
    num_requests = args.num_requests
    if num_requests is None and args.duration is None and args.requests_jsonl is None:
        num_requests = defaults["num_requests"]
    layers = args.layers if args.layers is not None or args.checkpoint else defaults["layers"]
    return ServeOptions(
        model=PRESETS[args.preset], preset=args.preset, num_layers=layers, backend=args.backend,
        weights=args.weights, checkpoint=args.checkpoint, num_requests=num_requests, duration_s=args.duration,
        request_rate=pick(args.request_rate, "request_rate"),
        prompt_tokens=LengthRange.parse(pick(args.prompt_tokens, "prompt_tokens"), "--prompt-tokens"),
        output_tokens=LengthRange.parse(pick(args.output_tokens, "output_tokens"), "--output-tokens"),
        requests_jsonl=args.requests_jsonl, max_batch_tokens=pick(args.max_batch_tokens, "max_batch_tokens"),
        metrics_out=args.metrics_out, spot_check_every=pick(args.spot_check_every, "spot_check_every"),
        spot_check_tol=args.spot_check_tol, log_interval_s=args.log_interval, timeout_s=args.timeout,
        seed=args.seed, dtype=kDtypes[args.dtype], progress=not args.no_progress, precompile=not args.no_precompile)


def main(argv: list[str] | None = None) -> int:
    """Entry point of every rank; returns the process exit status."""
    from moe_runtime.dist import init_distributed
    from .loop import format_summary, serve, shutdown

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    ctx = init_distributed(timeout=datetime.timedelta(seconds=args.timeout))
    try:
        metrics = serve(options, ctx)
    except RankFailureError as exc:
        print(f"[serve] error: {exc}", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # noqa: BLE001 - every rank reports its own failure, then exits non-zero
        traceback.print_exc()
        print(f"[serve] rank {ctx.rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    # Only on success: tearing down a group whose peers died can block (NCCL).
    shutdown(ctx)
    if ctx.rank == 0:
        print(format_summary(metrics), flush=True)
        if options.metrics_out:
            print(f"[serve] metrics written to {options.metrics_out}", flush=True)
    return 0
