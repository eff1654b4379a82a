"""Host cost of one call, broken down (GPU machine).

    python bench/bench_host_overhead.py [--layer-only]

Wall time per call on the host (perf_counter over many calls, no synchronisation between them)
of each public function and of its pieces (argument checks, output allocation, stream lookup,
the _C entry point), next to torch's own launch cost for scale, then the GEMM calls again in a
second process under ``MOE_TMA_MEMO=0`` (every TMA descriptor encoded on every call). The events-around-one-call figure
of the other benchmarks adds the GPU's launch latency to this. ``bench/bench_host_launch.py`` times
the launchers' own C++ share on any machine. Last, the L1 GEMM with the SwiGLU epilogue against the staged
pair it replaces (32 experts of 4096 x 7168, masked 64 and 256 rows): host time, one call on an idle stream,
calls back to back and the kernels' own time, to split what a call adds beyond its kernels into host and GPU.
Then the DeepSeek-V3 layer's eager decode forward (32 local experts, FP8, 1 and 32 tokens) through the staged
pair's Python calls and through ``MOE_STAGED_DECODE=1``'s raw launches, the same columns, outputs compared
(``--layer-only``: that table alone).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch

import kernels
from moe_runtime import router
from kernels import _descriptors, gemm
from kernels.jit import native_module
from kernels.testing.bench import bench_kineto, env_switches, per_call_us_interleaved

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_grouped_swiglu  # noqa: E402  (its L1 problems)
import bench_moe  # noqa: E402  (its DeepSeek-V3 layer)


def host_us(fn, rounds: int = 21, calls: int = 100) -> float:
    """Median host microseconds per call over ``rounds`` rounds of ``calls`` calls, each round
    started on an idle GPU: 100 launches stay well inside the launch queue, so the host never
    waits for a kernel (2000 back to back did: a call whose kernel outlasted its host work read
    as the kernel's time)."""
    for _ in range(20):
        fn()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def call_breakdown(rows: list[tuple[str, str, object]]) -> None:
    """Events around one call on an idle stream next to the kernel's own time (profiler, L2 warm,
    as the call sees it): what the call adds beyond its kernel, against a bare torch launch measured
    the same way in the same rounds (``per_call_us_interleaved``)."""
    print(f"\n{'one call, events around it':<46} {'call us':>8} {'kernel us':>9} {'call - kernel':>13}")
    calls = per_call_us_interleaved([fn for _, _, fn in rows], iters=200)
    for (label, kernel_name, fn), call in zip(rows, calls):
        kernel = bench_kineto(fn, kernel_name, flush_l2=False).median_s * 1e6
        print(f"{label:<46} {call:>8.2f} {kernel:>9.2f} {call - kernel:>13.2f}", flush=True)


def back_to_back_us(fn, calls: int = 50, rounds: int = 11) -> float:
    """Median GPU microseconds per call over ``rounds`` rounds of ``calls`` calls queued back to back
    (events around the round): the GPU's rate once host time hides behind the kernels."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def swiglu_breakdown(groups: int = 32, inter: int = 2048, hidden: int = 7168) -> None:
    """The fused SwiGLU L1 call and the staged pair (masked GEMM into bf16, swiglu_quant_fp8): host us
    per call, events around one call on an idle stream, per call back to back, and the kernels'
    time (profiler, L2 warm, every kernel of the call)."""
    w, w1 = bench_grouped_swiglu.weights(groups, inter, hidden)
    print(f"\nSwiGLU L1, {groups} experts, N x K = {2 * inter} x {hidden}, masked")
    print(f"{'call':<34} {'host us':>8} {'idle-stream us':>14} {'back-to-back us':>15} {'kernels us':>10}")
    for tokens in (64, 256):
        p = bench_grouped_swiglu.masked_problem(groups, tokens, inter, hidden)
        a, masked_m, topk, h, act, act_sf = p.a, p.index, p.topk, p.h, p.act, p.act_sf
        calls = [
            ("fused", lambda: kernels.m_grouped_fp8_gemm_nt_swiglu_masked(a, w1, (act, act_sf), masked_m, tokens,
                                                                          topk)),
            ("staged GEMM", lambda: kernels.m_grouped_fp8_gemm_nt_masked(a, w, h, masked_m, tokens)),
            ("staged swiglu_quant_fp8", lambda: kernels.swiglu_quant_fp8(h.view(groups * tokens, -1), topk.view(-1),
                                                                         masked_m, tokens)),
        ]
        calls.append(("staged pair", lambda: (calls[1][1](), calls[2][1]())))
        idle = per_call_us_interleaved([fn for _, fn in calls], iters=100)
        for (label, fn), one in zip(calls, idle):
            kernel = bench_kineto(fn, "", flush_l2=False).median_s * 1e6
            print(f"{label + f', {tokens} rows':<34} {host_us(fn, rounds=11, calls=20):>8.2f} {one:>14.2f} "
                  f"{back_to_back_us(fn):>15.2f} {kernel:>10.2f}", flush=True)


def layer_breakdown(local_experts: int = 32, weights: str = "fp8") -> None:
    """The layer's eager forward at decode sizes, general path (MOE_STAGED_DECODE=0) against the raw
    launches (=1), interleaved per column: host us per forward, events around one forward on an idle
    stream, per forward back to back, and the kernels' time (profiler, L2 warm, every kernel)."""
    from moe_runtime import MegaMoELayer

    device = torch.device("cuda", torch.cuda.current_device())
    w = bench_moe.make_weights(local_experts, device)
    layer = MegaMoELayer(bench_moe.kHidden, bench_moe.kIntermediate, local_experts, bench_moe.kTopK,
                         router=bench_moe.deepseek_router(), weights=weights, backend="staged",
                         num_max_tokens_per_rank=32, device=device)
    layer.load_weights(router_weight=w.router, gate_up=w.gate_up, down=w.down, score_bias=w.bias)
    del w
    print(f"\nDeepSeek-V3 layer, {local_experts} local experts, {weights}, eager forward")
    print(f"{'forward':<34} {'host us':>8} {'idle-stream us':>14} {'back-to-back us':>15} {'kernels us':>10}")

    def under(value: str, fn):
        def call():
            with env_switches(MOE_STAGED_DECODE=value):
                return fn()
        return call

    with torch.inference_mode():
        for tokens in (1, 32):
            x = torch.randn(tokens, bench_moe.kHidden, device=device).to(torch.bfloat16)
            calls = [("general (Python calls)", under("0", lambda: layer(x))),
                     ("MOE_STAGED_DECODE=1 (raw launches)", under("1", lambda: layer(x)))]
            same = torch.equal(calls[0][1](), calls[1][1]())
            idle = per_call_us_interleaved([fn for _, fn in calls], iters=100)
            for (label, fn), one in zip(calls, idle):
                kernel = bench_kineto(fn, "", flush_l2=False).median_s * 1e6
                print(f"{label + f', {tokens} tok':<34} {host_us(fn, rounds=11, calls=20):>8.2f} {one:>14.2f} "
                      f"{back_to_back_us(fn):>15.2f} {kernel:>10.2f}", flush=True)
            print(f"outputs equal bit for bit at {tokens} tokens: {same}", flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_host_overhead: needs a CUDA device", file=sys.stderr)
        return 1
    if sys.argv[1:] not in ([], ["--layer-only"]):
        print(f"usage: {sys.argv[0]} [--layer-only]", file=sys.stderr)
        return 2
    if sys.argv[1:] == ["--layer-only"]:
        layer_breakdown()
        return 0
    x = torch.randn(64, 7168, device="cuda", dtype=torch.bfloat16)
    a = kernels.per_token_cast_to_fp8(x)
    b = kernels.per_block_cast_to_fp8(torch.randn(2112, 7168, device="cuda", dtype=torch.bfloat16))
    d = torch.empty(64, 2112, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64, 7168, dtype=torch.float8_e4m3fn, device="cuda")
    sf = torch.empty(64, 56, dtype=torch.float32, device="cuda")
    # Grouped calls: 4 experts of 2112 x 7168, 256 rows each (contiguous) or 64 of 64 rows (masked).
    bg = (b[0].unsqueeze(0).expand(4, -1, -1).contiguous(), b[1].unsqueeze(0).expand(4, -1, -1).contiguous())
    ac = kernels.per_token_cast_to_fp8(torch.randn(1024, 7168, device="cuda", dtype=torch.bfloat16))
    dc = torch.empty(1024, 2112, device="cuda", dtype=torch.bfloat16)
    m_indices = torch.arange(4, device="cuda", dtype=torch.int32).repeat_interleave(256)
    am = (ac[0].view(4, 256, 7168)[:, :64].contiguous(), ac[1].view(4, 256, 56)[:, :64].contiguous())
    dm = torch.empty(4, 64, 2112, device="cuda", dtype=torch.bfloat16)
    masked_m = torch.full((4,), 64, device="cuda", dtype=torch.int32)
    # FP4 weights of the same experts: random packed E2M1 codes and UE8M0 bytes (the form
    # transform_sf_for_fp4_gemm gives), and the decode layout of them; masked decode at 16 rows.
    b4 = (torch.randint(0, 256, (4, 2112, 3584), device="cuda", dtype=torch.uint8),
          torch.randint(118, 126, (4, 2112, 224), device="cuda", dtype=torch.uint8))
    b4_decode = kernels.transform_fp4_for_decode(*b4)
    router_config = bench_moe.deepseek_router()
    router_weight = torch.randn(256, 7168, device="cuda")
    score_bias = torch.randn(256, device="cuda") * 0.05
    logits = router.router_logits(x[:1], router_weight, router_config)
    native = native_module()
    dev = x.device
    stream = _descriptors.current_stream(dev)
    sms = kernels.get_num_sms()
    raw_gemm = lambda: native.fp8_gemm_nt(
        a[0].data_ptr(), 7168, a[1].data_ptr(), a[1].stride(0), a[1].stride(1), b[0].data_ptr(), 7168,
        b[1].data_ptr(), b[1].stride(0), b[1].stride(1), d.data_ptr(), 2112, 0, -1, 0, 64, 2112, 7168, False,
        dev.index, 0, 0, stream)
    rows = [
        ("torch: x.add_(0) (launch cost for scale)", lambda: x.add_(0)),
        ("torch: torch.empty(64, 7168, fp8)", lambda: torch.empty(64, 7168, dtype=torch.float8_e4m3fn, device=dev)),
        ("torch: current stream handle", lambda: _descriptors.current_stream(dev)),
        ("torch: 5 x data_ptr()", lambda: (x.data_ptr(), x.data_ptr(), x.data_ptr(), x.data_ptr(), x.data_ptr())),
        ("_C.per_token_cast_to_fp8 (raw)", lambda: native.per_token_cast_to_fp8(
            x.data_ptr(), 1, 64, 7168, 7168, out.data_ptr(), sf.data_ptr(), 56, 1, 128, False, 0, stream)),
        ("kernels.per_token_cast_to_fp8", lambda: kernels.per_token_cast_to_fp8(x)),
        ("_C.fp8_gemm_nt (raw, no split workspace)", raw_gemm),
        ("_C.fp8_gemm_nt_config (heuristic + dict)", lambda: native.fp8_gemm_nt_config(64, 2112, 7168, sms)),
        ("kernels.gemm._launch_args (checks)", lambda: gemm._launch_args(a, b, d, None, False)),
        ("kernels.fp8_gemm_nt", lambda: kernels.fp8_gemm_nt(a, b, d)),
        ("kernels.grouped._contiguous_launch_args (checks)",
         lambda: kernels.grouped._contiguous_launch_args(ac, bg, dc, m_indices)),
        ("kernels.m_grouped_fp8_gemm_nt_contiguous", lambda: kernels.m_grouped_fp8_gemm_nt_contiguous(
            ac, bg, dc, m_indices)),
        ("kernels.m_grouped_fp8_gemm_nt_masked", lambda: kernels.m_grouped_fp8_gemm_nt_masked(
            am, bg, dm, masked_m, 64)),
        ("kernels.m_grouped_fp8_fp4_gemm_nt_contiguous", lambda: kernels.m_grouped_fp8_fp4_gemm_nt_contiguous(
            ac, b4, dc, m_indices)),
        ("kernels.m_grouped_fp8_fp4_gemm_nt_masked", lambda: kernels.m_grouped_fp8_fp4_gemm_nt_masked(
            am, b4, dm, masked_m, 16)),
        ("kernels.m_grouped_fp8_fp4_gemm_nt_masked, decode layout", lambda: kernels.m_grouped_fp8_fp4_gemm_nt_masked(
            am, b4_decode, dm, masked_m, 16)),
        # The router of every layer forward (DeepSeek-V3's, one token): the top-k launch alone, then
        # with the router GEMM and moe_runtime's checks.
        ("kernels.moe_route, DeepSeek-V3, 1 token", lambda: kernels.moe_route(
            logits, 8, sigmoid=True, n_group=8, topk_group=4, scaling=2.5, score_bias=score_bias)),
        ("router.route(router_logits(...)), 1 token", lambda: router.route(
            router.router_logits(x[:1], router_weight, router_config), 8, router_config, score_bias)),
    ]
    # Under MOE_TMA_MEMO=0 (read once per process: this script runs again in a child with it set),
    # only the GEMM calls, labelled so.
    memo_off = os.environ.get("MOE_TMA_MEMO") == "0"
    if memo_off:
        rows = [(label + ", MOE_TMA_MEMO=0", fn) for label, fn in rows
                if "gemm" in label and "config" not in label and "args" not in label]
    else:
        print(f"{'call':<62} {'host us/call':>12}")
    for label, fn in rows:
        print(f"{label:<62} {host_us(fn):>12.2f}", flush=True)
    if not memo_off:
        call_breakdown([("torch: x.add_(0)", "", lambda: x.add_(0)),
                        ("_C.fp8_gemm_nt (raw), 64 x 2112 x 7168", "sm90_fp8_gemm", raw_gemm),
                        ("kernels.fp8_gemm_nt, 64 x 2112 x 7168", "sm90_fp8_gemm",
                         lambda: kernels.fp8_gemm_nt(a, b, d))])
        swiglu_breakdown()
        layer_breakdown()
        sys.stdout.flush()
        return subprocess.run([sys.executable, __file__], env={**os.environ, "MOE_TMA_MEMO": "0"}).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
