"""Scenarios whose kernels wait on the device for other ranks run in a child process: a wait that
times out traps, which ends the CUDA context and would fail every later GPU test of the session.
A test module defines the scenarios as functions, calls :func:`run_in_child` with its own file, and
ends with ``if __name__ == "__main__": child_main(globals())``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

kRepo = Path(__file__).resolve().parents[2]


def run_in_child(test_file: str, function: str, timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    """``function(**kwargs)`` of ``test_file`` in a child process, device waits trapping after
    ``timeout_s`` seconds (MOE_EP_TIMEOUT_S)."""
    # Enough hardware queues for every simulated rank's stream: two streams on one queue can hold a
    # rank's waiting kernel behind another's.
    env = dict(os.environ, MOE_EP_TIMEOUT_S=str(timeout_s), CUDA_DEVICE_MAX_CONNECTIONS="32",
               PYTHONPATH=os.pathsep.join([str(kRepo), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, test_file, function, json.dumps(kwargs)], capture_output=True, text=True,
                          env=env, timeout=300)


def assert_passed(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def assert_timed_out(done: subprocess.CompletedProcess, what: str) -> None:
    """The child failed on a trapped wait for ``what`` ("the dispatch of rank 1"). The kernel's
    printf may be lost with the context it ends; the trap itself reaches the host as a launch
    failure."""
    log = done.stdout[-2000:] + done.stderr[-2000:]
    assert done.returncode != 0, log
    assert f"moe_ep: timed out waiting for {what}" in done.stdout or "launch failure" in log, log


def child_main(scenarios: dict) -> None:
    """The child's entry: one scenario, exit status 0 when it passes."""
    scenarios[sys.argv[1]](**json.loads(sys.argv[2]))
