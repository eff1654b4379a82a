"""Start a worker script under torchrun for the multi-rank tests (shared by several test files)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from moe_runtime.dist import apply_multicast_safety_env

kRepo = Path(__file__).resolve().parents[2]


def run_torchrun(worker: Path, nproc: int, args: list[str], ok_line: str, timeout: int = 300) -> str:
    """Run ``worker`` on ``nproc`` local ranks; assert exit 0 and that ``ok_line`` was printed."""
    env = apply_multicast_safety_env(dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(kRepo), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    # torchrun is torch.distributed.run's console script; the module form uses this interpreter.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(worker), *args]
    proc = subprocess.run(cmd, env=env, cwd=kRepo, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, output
    assert ok_line in proc.stdout, output
    return proc.stdout


def exit_worker(ctx) -> None:
    """End a torchrun worker whose checks all passed: tear the process groups down together, then
    leave without interpreter teardown. A gloo rank has aborted at exit ("terminate called without
    an active exception") after every check had passed and the groups were destroyed, which would
    turn a passing run red."""
    ctx.destroy()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
