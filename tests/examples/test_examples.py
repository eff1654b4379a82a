"""Every example runs to completion on the CPU (the GPU paths are the same calls)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], timeout: int = 300) -> str:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_dense_fp8_gemm():
    out = run([sys.executable, "examples/dense_fp8_gemm.py", "--m", "16", "--n", "256", "--k", "512"])
    diff = float(out.split("calc_diff vs bf16 inputs ")[1].split()[0])
    assert "on cpu" in out and diff < 2e-3


def test_hf_model_moe():
    pytest.importorskip("transformers")
    out = run([sys.executable, "examples/hf_model_moe.py"])
    assert float(out.split("logits calc_diff ")[1].split()[0]) < 1e-2


@pytest.mark.multirank
def test_expert_parallel():
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "examples/expert_parallel.py"])
    # Searched in the whole output: the two ranks' lines can land on one line of the shared pipe.
    diffs = [float(value) for value in re.findall(r"calc_diff vs single process (\S+)", out)]
    assert len(diffs) == 2 and max(diffs) < 1e-5, out
