"""launch/serve_moe.py under torchrun with 2 CPU (gloo) ranks: default run, JSONL requests,
clean shutdown on SIGTERM/SIGINT, and a clear error naming a rank that dies."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank

kRepo = Path(__file__).resolve().parents[2]
kMetricFields = ("tokens_per_s", "latency_ms", "ttft_ms", "requests_finished", "tokens", "wall_time_s",
                 "stopped_by", "spot_checks", "per_rank", "world_size", "backend", "weights", "model")


def _command(*args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            str(kRepo / "launch" / "serve_moe.py"), *args]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(kRepo), OMP_NUM_THREADS="1")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(_command(*args), env=_env(), capture_output=True, text=True, timeout=timeout, cwd=kRepo)


def _worker_pid(launcher_pid: int, rank: int) -> int:
    """PID of the torchrun worker with ``RANK=rank`` (a child of the launcher)."""
    children = []
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        children += (task / "children").read_text().split()
    for child in children:
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no worker with RANK={rank} among {children}")


def _start_long_run(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    metrics, log = tmp_path / "metrics.json", tmp_path / "log.txt"
    proc = subprocess.Popen(_command("--duration", "300", "--request-rate", "20", "--log-interval", "0.2",
                                     "--metrics-out", str(metrics), *extra),
                            env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=kRepo,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    # Wait for a progress line with at least one finished request, so the stop is mid-serving.
    while not re.search(r"requests [1-9]\d*/", log.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"serving never started:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, metrics, log


def _wait(proc: subprocess.Popen, log: Path, timeout: float = 60) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"did not stop within {timeout}s:\n{log.read_text()[-3000:]}") from None


def test_default_run(tmp_path):
    metrics_path = tmp_path / "m.json"
    start = time.monotonic()
    proc = _run("--metrics-out", str(metrics_path))
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert elapsed < 60, f"the default run took {elapsed:.1f}s"
    metrics = json.loads(metrics_path.read_text())
    for field in kMetricFields:
        assert field in metrics, field
    assert metrics["stopped_by"] == "completed" and metrics["world_size"] == 2
    assert metrics["requests_finished"] == metrics["requests_expected"] > 0
    assert metrics["tokens_per_s"] > 0 and 0 < metrics["latency_ms"]["p50"] <= metrics["latency_ms"]["p99"]
    assert metrics["spot_checks"]["count"] >= 1 and metrics["spot_checks"]["failures"] == 0
    assert [r["rank"] for r in metrics["per_rank"]] == [0, 1] and all(r["tokens"] > 0 for r in metrics["per_rank"])
    assert "tokens/s" in proc.stdout and "p99" in proc.stdout


def test_jsonl_requests(tmp_path, seed):
    rng = random.Random(seed)
    requests = [dict(id=f"req-{i}", prompt_tokens=rng.randint(1, 40), output_tokens=rng.randint(0, 6),
                     arrival_s=round(rng.random() * 0.3, 3)) for i in range(15)]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    metrics_path = tmp_path / "m.json"
    proc = _run("--requests-jsonl", str(path), "--metrics-out", str(metrics_path), "--max-batch-tokens", "32",
                "--spot-check-every", "3", "--weights", "bf16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads(metrics_path.read_text())
    assert metrics["requests_finished"] == metrics["requests_expected"] == len(requests)
    assert metrics["prefill_tokens"] == sum(r["prompt_tokens"] for r in requests)
    assert metrics["decode_tokens"] == sum(r["output_tokens"] for r in requests)
    assert metrics["request_source"] == str(path) and metrics["weights"] == "bf16"
    assert metrics["spot_checks"]["count"] >= 2


def test_bad_jsonl_fails_with_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_tokens": 4}\n{"prompt_tokens": "many"}\n')
    proc = _run("--requests-jsonl", str(path))
    assert proc.returncode != 0
    assert f"{path}:2" in proc.stderr and "prompt_tokens must be an integer" in proc.stderr


def test_sigterm_to_one_worker_stops_every_rank_cleanly(tmp_path):
    proc, metrics_path, log = _start_long_run(tmp_path)
    os.kill(_worker_pid(proc.pid, 1), signal.SIGTERM)
    assert _wait(proc, log) == 0, log.read_text()[-3000:]
    metrics = json.loads(metrics_path.read_text())
    assert metrics["stopped_by"] == "SIGTERM" and metrics["requests_finished"] > 0
    assert "Traceback" not in log.read_text()


def test_ctrl_c_on_the_process_group_still_writes_metrics(tmp_path):
    """SIGINT reaches torchrun and the workers, and torchrun forwards it again: one clean stop."""
    proc, metrics_path, log = _start_long_run(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)
    _wait(proc, log)  # torchrun itself exits non-zero after a signal, by its own design
    metrics = json.loads(metrics_path.read_text())
    assert metrics["stopped_by"] == "SIGINT"
    assert "[serve] error" not in log.read_text() and "failed:" not in log.read_text()


def test_dead_rank_is_named(tmp_path):
    proc, _, log = _start_long_run(tmp_path, "--timeout", "20")
    os.kill(_worker_pid(proc.pid, 1), signal.SIGKILL)
    assert _wait(proc, log) != 0
    text = log.read_text()
    assert "[serve] error: rank 0:" in text and "rank 1 did not answer" in text, text[-3000:]


def test_checkpoint_is_served_with_each_rank_holding_half_the_experts(tmp_path):
    pytest.importorskip("transformers")
    import torch
    sys.path.insert(0, str(kRepo / "tests" / "moe_runtime"))
    from hf_models import tiny_model
    tiny_model("deepseek_v3", torch.bfloat16, seed=7).save_pretrained(tmp_path / "ckpt")
    metrics_path = tmp_path / "m.json"
    proc = _run("--checkpoint", str(tmp_path / "ckpt"), "--num-requests", "16", "--metrics-out", str(metrics_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads(metrics_path.read_text())
    assert metrics["checkpoint"] == str(tmp_path / "ckpt") and metrics["layer_indices"] == [0, 1]
    assert metrics["model"]["num_experts"] == 16 and metrics["model"]["n_group"] == 4
    assert metrics["requests_finished"] == 16
    assert [r["experts"] for r in metrics["per_rank"]] == [[0, 8], [8, 16]]
