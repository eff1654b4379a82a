"""Expert parallel across processes: torchrun running ep_worker.py (gloo ranks; CPU, or CUDA sharing a GPU)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_runtime.dist import apply_multicast_safety_env

_kRepo = Path(__file__).resolve().parents[2]
_kWorker = Path(__file__).resolve().with_name("ep_worker.py")


def _torchrun(nproc: int, *args: str):
    env = apply_multicast_safety_env(dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_kRepo), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    # torchrun is torch.distributed.run's console script; the module form uses this interpreter.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(_kWorker), *args]
    proc = subprocess.run(cmd, env=env, cwd=_kRepo, capture_output=True, text=True, timeout=240)
    output = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, output
    assert f"[rank 0/{nproc}] ep worker ok: {nproc} ranks" in proc.stdout, output
    return proc.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("nproc", [2, 4])
def test_expert_parallel_matches_single_process_under_torchrun(nproc):
    _torchrun(nproc, "--device", "cpu", "--symm-backend", "host")


@pytest.mark.gpu
@pytest.mark.multirank
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend,nproc", [("torch", 1), ("torch", 2), ("torch", 4), ("nvshmem", 1)])
def test_gpu_symm_buffer_and_expert_parallel_under_torchrun(backend, nproc):
    if backend == "nvshmem" and importlib.util.find_spec("nvshmem") is None:
        pytest.skip("nvshmem4py-cu13 is not installed")
    # One rank per GPU runs NCCL + gloo; ranks beyond the GPU count share a GPU: gloo plus
    # overlapping-device symmetric memory (NCCL and NVSHMEM refuse two ranks on one GPU, hence one
    # nvshmem rank on a one-GPU machine).
    _torchrun(nproc, "--device", "cuda", "--symm-backend", backend)
