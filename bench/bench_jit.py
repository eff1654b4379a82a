"""JIT compile and load times per kernel (no GPU needed for the compile and disk numbers).

    python bench/bench_jit.py [--family NAME ...] [--limit N] [--processes 8]

For each kernel of the DeepSeek-V3 preset (see kernels.precompile): cold compile into an empty
cache, then warm load from the disk cache in a fresh process (what a restarted server pays),
then a memory-cache hit. Finally N processes compile the same kernels at once into another empty
cache: all must succeed and leave exactly one cubin per kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kernels import precompile

_CHILD = r"""
import json, os, sys, time
from kernels import jit, precompile
srcs = [s for f in json.loads(sys.argv[1])
        for s in precompile.collect_sources([f], max_m=int(sys.argv[2]))[: int(sys.argv[3])]]
jit.ensure_configured()
out = []
for s in srcs:
    t = time.perf_counter(); r = jit.build(s.name, s.code, "sm_90a"); out.append([time.perf_counter() - t, r.from_cache])
print(json.dumps(out))
"""


def run_child(families, max_m, limit, cache_dir) -> list:
    env = dict(os.environ, MOE_JIT_CACHE_DIR=str(cache_dir))
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(families), str(max_m), str(limit)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", action="append", default=None)
    parser.add_argument("--limit", type=int, default=2, help="kernels per family")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--max-m", type=int, default=256)
    args = parser.parse_args()
    families = args.family or list(precompile.FAMILIES)
    sources = [s for f in families for s in precompile.collect_sources([f], max_m=args.max_m)[: args.limit]]
    with tempfile.TemporaryDirectory() as tmp:
        cold = run_child(families, args.max_m, args.limit, Path(tmp) / "a")
        warm = run_child(families, args.max_m, args.limit, Path(tmp) / "a")
        print(f"{'kernel':<56} {'cold s':>8} {'warm ms':>8}")
        for src, (c, _), (w, hit) in zip(sources, cold, warm):
            assert hit, "warm load was not served from the disk cache"
            print(f"{src.family + ' ' + src.label:<56} {c:>8.2f} {w * 1e3:>8.1f}")
        print(f"median cold compile {statistics.median(c for c, _ in cold):.2f} s, "
              f"median warm load {statistics.median(w for w, _ in warm) * 1e3:.1f} ms")

        shared = Path(tmp) / "b"
        env = dict(os.environ, MOE_JIT_CACHE_DIR=str(shared))
        start = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(families), str(args.max_m),
                                   str(args.limit)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for _ in range(args.processes)]
        codes = [p.wait() for p in procs]
        cubins = list(shared.rglob("*.cubin"))
        print(f"{args.processes} concurrent processes on an empty cache: exit codes {sorted(set(codes))}, "
              f"{len(cubins)} cubins for {len(sources)} kernels, {time.perf_counter() - start:.1f} s")
        return 0 if set(codes) == {0} and len(cubins) == len(sources) else 1


if __name__ == "__main__":
    sys.exit(main())
