"""A host-only CUDA driver (``host_driver.cpp``) for machines without a GPU.

A process whose ``LD_LIBRARY_PATH`` starts with the folder of the built ``libcuda.so.1`` loads it
as the driver: ``kernels._C`` then sees one H200 (SM 9.0, 132 SMs), compiles kernels with NVRTC as
usual, and its launchers run their whole host path (heuristics, memos, TMA descriptors, launch
configuration) while the library only records what they asked for. Tests check that record;
``bench/bench_host_launch.py`` times the host path without a driver's own cost.

The library must be loaded before anything else loads a driver, so it goes into a new process::

    lib_dir = build_host_driver(tmp)              # once
    subprocess.run([...], env=host_driver_env(lib_dir))
    # in that process:
    record = HostDriverRecord.attach()
    record.encodes(), record.launches(), record.last_launch(), record.encoded_maps(n)
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_SOURCE = Path(__file__).with_name("host_driver.cpp")
_CSRC = Path(__file__).resolve().parents[2] / "csrc"
LIBRARY = "libcuda.so.1"


def build_host_driver(out_dir: str | os.PathLike) -> Path:
    """Compiles host_driver.cpp into ``out_dir/libcuda.so.1`` (C++17, the checkout's csrc/ headers)
    and returns ``out_dir``. Raises RuntimeError when no C++ compiler is found or the build fails."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not (_CSRC / "jit" / "driver.hpp").is_file():
        raise RuntimeError(f"build_host_driver needs the checkout's csrc/ headers, not found at {_CSRC}")
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("build_host_driver: no C++ compiler (set CXX, or install c++/g++)")
    cmd = [compiler, "-std=c++17", "-O2", "-shared", "-fPIC", f"-I{_CSRC}", str(_SOURCE), "-o", str(out / LIBRARY)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"build_host_driver: {' '.join(cmd)} failed:\n{proc.stderr}")
    return out


def host_driver_env(lib_dir: str | os.PathLike, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with ``lib_dir`` first on LD_LIBRARY_PATH."""
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib_dir), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


@dataclass(frozen=True)
class LaunchRecord:
    """The last launch's configuration: grid and block x, dynamic shared-memory bytes, cluster size
    and whether programmatic dependent launch was asked for."""

    grid: int
    block: int
    smem_bytes: int
    cluster: int
    pdl: bool


@dataclass(frozen=True)
class EncodedMap:
    """A TMA map the launchers encoded: CUtensorMapDataType value, rank, and the sizes and box of its
    first three dimensions (innermost first; 1 past the rank)."""

    dtype: int
    rank: int
    dims: tuple[int, int, int]
    box: tuple[int, int, int]


class HostDriverRecord:
    """The counters of the host-only driver this process loaded."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        for name in ("host_driver_encodes", "host_driver_launches", "host_driver_module_loads"):
            getattr(lib, name).restype = ctypes.c_longlong

    @classmethod
    def attach(cls) -> "HostDriverRecord":
        """The record of the ``libcuda.so.1`` on LD_LIBRARY_PATH; raises RuntimeError when that
        library is not the host-only driver."""
        lib = ctypes.CDLL(LIBRARY)
        if not hasattr(lib, "host_driver_encodes"):
            raise RuntimeError("the libcuda.so.1 this process loads is a real driver, not kernels/testing/host_driver")
        return cls(lib)

    def encodes(self) -> int:
        """cuTensorMapEncodeTiled calls so far."""
        return self._lib.host_driver_encodes()

    def launches(self) -> int:
        """cuLaunchKernelEx calls so far."""
        return self._lib.host_driver_launches()

    def module_loads(self) -> int:
        return self._lib.host_driver_module_loads()

    def encoded_maps(self, count: int) -> list[EncodedMap]:
        """The last ``count`` (at most 64) maps encoded, oldest first."""
        count = min(count, 64, self.encodes())
        out = (ctypes.c_longlong * (8 * max(count, 1)))()
        self._lib.host_driver_encoded_maps(out, count)
        return [EncodedMap(int(out[8 * i]), int(out[8 * i + 1]), tuple(int(v) for v in out[8 * i + 2:8 * i + 5]),
                           tuple(int(v) for v in out[8 * i + 5:8 * i + 8])) for i in range(count)]

    def last_launch(self) -> LaunchRecord:
        out = (ctypes.c_longlong * 5)()
        self._lib.host_driver_last_launch(out)
        return LaunchRecord(int(out[0]), int(out[1]), int(out[2]), int(out[3]), bool(out[4]))
