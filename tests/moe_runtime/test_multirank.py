"""Expert parallel across processes: torchrun running ep_worker.py (gloo ranks; CPU, or CUDA sharing a GPU)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from torchrun_helper import run_torchrun

_kWorker = Path(__file__).resolve().with_name("ep_worker.py")


def _torchrun(nproc: int, *args: str):
    return run_torchrun(_kWorker, nproc, list(args), f"[rank 0/{nproc}] ep worker ok: {nproc} ranks", timeout=240)


@pytest.mark.multirank
@pytest.mark.parametrize("nproc", [2, 4])
def test_expert_parallel_matches_single_process_under_torchrun(nproc):
    _torchrun(nproc, "--device", "cpu", "--symm-backend", "host")


@pytest.mark.gpu
@pytest.mark.multirank
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend,nproc", [("torch", 1), ("torch", 2), ("torch", 4), ("nvshmem", 1), ("nvshmem", 2)])
def test_gpu_symm_buffer_and_expert_parallel_under_torchrun(backend, nproc):
    if backend == "nvshmem" and importlib.util.find_spec("nvshmem") is None:
        pytest.skip("nvshmem4py-cu13 is not installed")
    if backend == "nvshmem" and nproc > torch.cuda.device_count():
        pytest.skip(f"NVSHMEM needs one GPU per rank: {nproc} ranks, {torch.cuda.device_count()} GPUs")
    # One rank per GPU runs NCCL + gloo; ranks beyond the GPU count share a GPU: gloo plus
    # overlapping-device symmetric memory (NCCL and NVSHMEM refuse two ranks on one GPU, hence one
    # nvshmem rank on a one-GPU machine).
    _torchrun(nproc, "--device", "cuda", "--symm-backend", backend)
