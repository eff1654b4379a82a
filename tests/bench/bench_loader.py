"""Load a bench/ script as a module for the tests in this folder (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

kRepo = Path(__file__).resolve().parents[2]


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as module ``name``, with bench/ on sys.path (scripts import their siblings by
    name) and the module in sys.modules (their dataclasses resolve annotations through it)."""
    bench_dir = str(kRepo / "bench")
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)
    spec = importlib.util.spec_from_file_location(name, kRepo / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
