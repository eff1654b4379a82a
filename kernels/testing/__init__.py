"""Testing and benchmarking helpers shared by tests/ and bench/."""

from .numeric import calc_diff, count_bytes
from .bench import (bench_kineto, bench_kineto_interleaved, copy_ceiling_gbps, env_call, env_switches,
                    flush_description, flush_mode, output_diff, parse_env_variants, per_call_us, positive_ints,
                    per_call_us_interleaved, repeated_plans, KernelTiming)

__all__ = ["calc_diff", "count_bytes", "bench_kineto", "bench_kineto_interleaved", "copy_ceiling_gbps",
           "env_call", "env_switches", "flush_description", "flush_mode", "output_diff", "parse_env_variants",
           "per_call_us", "per_call_us_interleaved", "positive_ints", "repeated_plans", "KernelTiming"]
