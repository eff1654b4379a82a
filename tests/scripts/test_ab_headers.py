"""scripts/ab_headers.sh, run in a scratch copy of the layout it expects (never on the tree's own
headers, which other tests compile from)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ab_headers.sh"
HEADER = "moe_kernels/impls/kernel.cuh"


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "ab_headers.sh")
    (tmp_path / "csrc" / "include" / "moe_kernels" / "impls").mkdir(parents=True)
    (tmp_path / "csrc" / "include" / HEADER).write_text("tree\n")
    (tmp_path / "ab" / "moe_kernels" / "impls").mkdir(parents=True)
    (tmp_path / "ab" / HEADER).write_text("branch\n")
    return tmp_path


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "scripts" / "ab_headers.sh"), *args], cwd=root, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "AB_NO_ENV": "1",
                                                      "OUT": str(root / "out")})


def test_alternates_the_headers_and_restores_them(scratch):
    done = run(scratch, "ab", "2", "cat", f"csrc/include/{HEADER}")
    assert done.returncode == 0, done.stderr
    logs = {p.name: p.read_text() for p in (scratch / "out").iterdir()}
    assert logs == {"ab_A1.log": "tree\n", "ab_B1.log": "branch\n", "ab_A2.log": "tree\n", "ab_B2.log": "branch\n"}
    assert done.stdout.index("== A1") < done.stdout.index("== B1") < done.stdout.index("== A2")
    assert (scratch / "csrc" / "include" / HEADER).read_text() == "tree\n"


def test_restores_the_headers_when_the_command_fails(scratch):
    done = run(scratch, "ab", "1", "sh", "-c", f"cat csrc/include/{HEADER}; exit 3")
    assert done.returncode == 1 and "!! B1 exited 3" in done.stdout
    assert (scratch / "csrc" / "include" / HEADER).read_text() == "tree\n"


@pytest.mark.parametrize("args, message", [
    (("missing", "1", "true"), "is not a folder"),
    (("ab", "1"), "no command"),
])
def test_bad_arguments(scratch, args, message):
    done = run(scratch, *args)
    assert done.returncode == 2 and message in done.stderr


def test_an_overlay_file_the_tree_lacks_is_refused(scratch):
    (scratch / "ab" / "moe_kernels" / "new.cuh").write_text("x\n")
    done = run(scratch, "ab", "1", "true")
    assert done.returncode == 2 and "moe_kernels/new.cuh does not exist" in done.stderr
    assert not (scratch / "out").exists() or not list((scratch / "out").iterdir())
