"""Static checks of every Python file of the project: pyflakes' undefined names, unused imports,
redefinitions and the like. A merge that leaves a name undefined in a GPU-only branch (as one did in
ep_dispatch) fails here, on the CPU, instead of on the GPU machine."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

kRoot = Path(__file__).resolve().parent.parent
kFolders = ("kernels", "moe_runtime", "launch", "bench", "scripts", "examples", "tests")


def test_pyflakes_finds_nothing():
    api = pytest.importorskip("pyflakes.api")
    reporter_module = pytest.importorskip("pyflakes.reporter")
    out, err = io.StringIO(), io.StringIO()
    files = [str(p) for folder in kFolders for p in sorted((kRoot / folder).rglob("*.py"))
             if "__pycache__" not in p.parts and "_include" not in p.parts]
    files += [str(kRoot / "setup.py")]
    assert len(files) >= 90, files
    warnings = sum(api.checkPath(f, reporter_module.Reporter(out, err)) for f in files)
    assert warnings == 0, out.getvalue() + err.getvalue()
