"""JIT settings and the Python face of the JIT engine in ``kernels._C``.

Kernels are CUDA C++ generated at call time and compiled for one GPU architecture (NVRTC by
default, NVCC on request) into a cubin that is cached on disk, then in memory. Compiling needs no
GPU: pass ``arch="sm_90a"`` on a CPU-only machine. ``_C`` is configured lazily, once per process,
from the environment variables below, by :func:`ensure_configured` (every helper here calls it).

Environment variables (read at the first JIT use, or again by :func:`configure`):

``MOE_JIT_CACHE_DIR``
    Cache folder; default ``~/.cache/moe_runtime/jit``. Layout:
    ``<cache>/<name>/<key>/{kernel.cu,kernel.cubin[,kernel.ptx,kernel.sass,wgmma_serialized]}`` (the
    last holds the compiler log of a kernel whose wgmmas ptxas serialized); a failed compile's
    source is kept in ``<cache>/failed/<name>/<key>/``.
``MOE_JIT_USE_NVCC=1``
    Compile with NVCC instead of NVRTC.
``MOE_JIT_NVCC``
    Path of nvcc; default ``$CUDA_HOME/bin/nvcc``, else ``nvcc`` on ``PATH``.
``MOE_JIT_NVRTC``
    Path of ``libnvrtc.so``; default: the pip package ``nvidia-cuda-nvrtc``
    (``nvidia/cu13/lib/libnvrtc.so.13``), else ``$CUDA_HOME/lib64``, else ``/usr/local/cuda/lib64``.
``MOE_JIT_DEBUG=1``
    Device debug info (``-G``) and assertions on (no ``-DNDEBUG``).
``MOE_JIT_LINEINFO=1``
    ``-lineinfo``, for profilers.
``MOE_JIT_PTXAS_VERBOSE=1``
    ptxas ``-v``; its report (registers, spills, shared memory) is printed to stderr.
``MOE_JIT_PRINT_COMPILER_COMMAND=1``
    Print each compiler command line or option list and the cache path to stderr.
``MOE_JIT_KEEP_PTX=1``
    Keep ``kernel.ptx`` beside the cubin (NVRTC: the PTX of the same compile; NVCC: a second
    ``-ptx`` run) and, when ``cuobjdump`` is found, ``kernel.sass``. Only for new compiles.
``MOE_JIT_EXTRA_FLAGS``
    More compiler options, split like a shell command line (e.g. ``"-maxrregcount=128"``).
``CUDA_HOME`` (or ``CUDA_PATH``)
    CUDA toolkit folder for nvcc, cuobjdump and headers not found in pip packages; default
    ``/usr/local/cuda``.

Headers: the project's device templates (``kernels/_include`` when installed, ``csrc/include`` in a
checkout), CuTe/CUTLASS from the pip ``nvidia-cutlass`` wheel (``cutlass_library/source/include``;
skipped when absent, so kernels that need CuTe fail to compile with a missing-header error), and
for NVRTC the CUDA headers from pip ``nvidia/cu13/include`` (and its ``cccl/``), else
``$CUDA_HOME/include`` (and its ``cccl/``).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import site
import threading
from dataclasses import dataclass
from pathlib import Path

import torch  # first: _C links its libc10 and libtorch_python (found loaded, whatever _C's rpath says)

from kernels import _C

JitError = _C.JitError
# The entry points that read torch tensors in C++ (csrc/apis/gemm_tensors.cpp) know the tensor layout
# of the torch _C was built with; under another torch the Python checks run instead (rebuild _C).
TENSOR_API = _C.tensor_api_torch_version == torch.__version__

_HEADER_PACKAGES = ("nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cuda-cccl", "nvidia-cutlass")
_NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_MAX_NAME_LENGTH = 96


@dataclass(frozen=True)
class JitSettings:
    """Everything ``_C.jit_configure`` takes; see the module docstring for where each comes from."""

    include_dirs: list[str]
    project_include_dir: str
    nvrtc_path: str
    cache_dir: str
    compiler: str = "nvrtc"
    nvcc_path: str = ""
    cuobjdump_path: str = ""
    extra_flags: list[str] = dataclasses.field(default_factory=list)
    cache_salt: str = ""
    debug: bool = False
    lineinfo: bool = False
    ptxas_verbose: bool = False
    print_command: bool = False
    keep_ptx: bool = False


@dataclass(frozen=True)
class BuildResult:
    """One compiled kernel. ``from_cache`` is true for a disk or memory cache hit;
    ``compile_seconds`` is the time this build took (compile, disk load or memory lookup);
    ``wgmma_serialized``: ptxas put a wait after every wgmma (its C751x remarks), so the tensor
    cores idle between them."""

    name: str
    arch: str
    key: str
    compiler: str
    cubin: bytes
    cubin_path: str
    source_path: str
    from_cache: bool
    memory_hit: bool
    compile_seconds: float
    wgmma_serialized: bool = False


@dataclass(frozen=True)
class DeviceInfo:
    """Facts about one CUDA device; shared-memory and L2 sizes in bytes."""

    major: int
    minor: int
    num_sms: int
    smem_optin: int
    smem_per_sm: int
    l2_bytes: int
    name: str


def env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={os.environ[name]!r}: expected 0/1 (or true/false)")


def cuda_home() -> Path | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            return Path(value)
    default = Path("/usr/local/cuda")
    return default if default.is_dir() else None


def _nvidia_roots() -> list[Path]:
    """Folders of the ``nvidia`` namespace package (pip CUDA wheels), in import order."""
    roots: list[Path] = []
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        roots.extend(Path(p) for p in spec.submodule_search_locations)
    for sp in [*site.getsitepackages(), site.getusersitepackages()]:
        candidate = Path(sp) / "nvidia"
        if candidate.is_dir() and candidate not in roots:
            roots.append(candidate)
    return roots


def find_nvrtc() -> str:
    """Path of libnvrtc, or "" when none is found (compiling then raises JitError)."""
    override = os.environ.get("MOE_JIT_NVRTC")
    if override:
        if not Path(override).is_file():
            raise JitError(f"MOE_JIT_NVRTC={override!r} is not a file")
        return override
    folders = [root / "cu13" / "lib" for root in _nvidia_roots()]
    home = cuda_home()
    if home is not None:
        folders += [home / "lib64", home / "lib"]
    folders.append(Path("/usr/local/cuda/lib64"))
    for folder in folders:
        for name in _NVRTC_NAMES:
            if (folder / name).is_file():
                return str(folder / name)
    return ""


def project_include_dir() -> Path:
    """The device templates: installed ``kernels/_include``, else the checkout's ``csrc/include``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_include", here.parent / "csrc" / "include"):
        if candidate.is_dir():
            return candidate
    raise JitError(f"the kernel headers were not found in {here / '_include'} nor "
                   f"{here.parent / 'csrc' / 'include'}; reinstall the package")


def cutlass_include_dir() -> Path | None:
    """CuTe/CUTLASS headers of the pip ``nvidia-cutlass`` wheel, when installed."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "source" / "include"
        if (candidate / "cute").is_dir():
            return candidate
    return None


def cuda_include_dirs() -> list[Path]:
    """CUDA headers and CCCL (``cuda/std``) for NVRTC: pip wheels first, then CUDA_HOME."""
    home = cuda_home()
    pip_includes = [root / "cu13" / "include" for root in _nvidia_roots()]
    toolkit = [home / "include"] if home is not None else []
    headers = next((d for d in [*pip_includes, *toolkit] if (d / "cuda_fp16.h").is_file()), None)
    cccl_candidates = [d / "cccl" for d in [*pip_includes, *toolkit]] + toolkit
    cccl = next((d for d in cccl_candidates if (d / "cuda" / "std").is_dir()), None)
    # CUTLASS built for CUDA 13 includes <cccl/cuda/std/...>, so the folder holding cccl/ is
    # needed too when it is not the headers' folder (the toolkit's, beside a pip runtime).
    cccl_parent = cccl.parent if cccl is not None and cccl.name == "cccl" else None
    return list(dict.fromkeys(d for d in (headers, cccl, cccl_parent) if d is not None))


def find_nvcc() -> str:
    override = os.environ.get("MOE_JIT_NVCC")
    if override:
        return override
    home = cuda_home()
    if home is not None and (home / "bin" / "nvcc").is_file():
        return str(home / "bin" / "nvcc")
    return shutil.which("nvcc") or ""


def find_cuobjdump() -> str:
    """cuobjdump from PATH, CUDA_HOME, or the pip wheel (nvidia-cuda-cuobjdump); "" if none."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    home = cuda_home()
    candidates = [home / "bin" / "cuobjdump"] if home is not None else []
    candidates += [root / "cu13" / "bin" / "cuobjdump" for root in _nvidia_roots()]
    return next((str(c) for c in candidates if c.is_file()), "")


def _cache_salt(include_dirs: list[Path]) -> str:
    """Versions of what the cache key's content hash does not cover: the header packages and, for
    toolkit headers, the CUDA version in cuda.h."""
    parts = []
    for package in _HEADER_PACKAGES:
        try:
            parts.append(f"{package}={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{package}=absent")
    # Versions, not paths: the same packages in another install location share the cache (the
    # compiler's version is in the key; its library's path says nothing more).
    for folder in include_dirs:
        cuda_h = folder / "cuda.h"
        if cuda_h.is_file():
            with open(cuda_h, encoding="utf-8", errors="replace") as f:
                version = next((line.strip() for line in f if line.startswith("#define CUDA_VERSION")), "")
            parts.append(f"cuda.h:{version}")
    return ";".join(parts)


def resolve_settings() -> JitSettings:
    """Settings from the environment and the installed packages (does not apply them)."""
    project = project_include_dir()
    use_nvcc = env_flag("MOE_JIT_USE_NVCC")
    nvcc = find_nvcc() if use_nvcc else ""
    if use_nvcc and not nvcc:
        raise JitError("MOE_JIT_USE_NVCC=1 but nvcc was not found: set MOE_JIT_NVCC or CUDA_HOME")
    cutlass = cutlass_include_dir()
    # nvcc brings its own CUDA headers; NVRTC needs them on the include path.
    cuda = [] if use_nvcc else cuda_include_dirs()
    include_dirs = [project, *([cutlass] if cutlass is not None else []), *cuda]
    nvrtc = find_nvrtc()
    keep_ptx = env_flag("MOE_JIT_KEEP_PTX")
    cache = os.environ.get("MOE_JIT_CACHE_DIR") or os.path.join("~", ".cache", "moe_runtime", "jit")
    return JitSettings(
        include_dirs=[str(d) for d in include_dirs],
        project_include_dir=str(project),
        nvrtc_path=nvrtc,
        cache_dir=os.path.abspath(os.path.expanduser(cache)),
        compiler="nvcc" if use_nvcc else "nvrtc",
        nvcc_path=nvcc,
        cuobjdump_path=find_cuobjdump() if keep_ptx else "",
        extra_flags=shlex.split(os.environ.get("MOE_JIT_EXTRA_FLAGS", "")),
        cache_salt=_cache_salt([d for d in include_dirs if d != project]),
        debug=env_flag("MOE_JIT_DEBUG"),
        lineinfo=env_flag("MOE_JIT_LINEINFO"),
        ptxas_verbose=env_flag("MOE_JIT_PTXAS_VERBOSE"),
        print_command=env_flag("MOE_JIT_PRINT_COMPILER_COMMAND"),
        keep_ptx=keep_ptx,
    )


_lock = threading.Lock()
_settings: JitSettings | None = None


def _apply(settings: JitSettings) -> None:
    global _settings
    _C.jit_configure(**dataclasses.asdict(settings))
    _settings = settings


def configure(settings: JitSettings | None = None) -> JitSettings:
    """Apply ``settings`` (default: :func:`resolve_settings`, re-reading the environment). Empties
    the in-memory kernel cache."""
    with _lock:
        chosen = settings if settings is not None else resolve_settings()
        _apply(chosen)
        return chosen


def ensure_configured() -> JitSettings:
    """Configure ``_C`` from the environment on the first call; later calls return the settings."""
    settings = _settings
    if settings is not None:
        return settings
    with _lock:
        if _settings is None:
            _apply(resolve_settings())
        return _settings


def native_module():
    """``kernels._C``, configured: what the kernel modules call their entry points on."""
    ensure_configured()
    return _C


def cache_dir() -> Path:
    return Path(ensure_configured().cache_dir)


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME_LENGTH or name.startswith(".") or \
            any(not (c.isascii() and (c.isalnum() or c in "_-.")) for c in name):
        raise ValueError(f"name={name!r}: expected 1-{_MAX_NAME_LENGTH} characters of [A-Za-z0-9_.-] "
                         "not starting with '.'")


def _check_arch(arch: object) -> None:
    body = arch[3:] if isinstance(arch, str) and arch.startswith("sm_") else ""
    digits = body[:-1] if body[-1:] in ("a", "f") else body
    if not (digits.isascii() and digits.isdigit() and 2 <= len(digits) <= 3):
        raise ValueError(f"arch={arch!r}: expected 'sm_<digits>' with an optional 'a'/'f' suffix, "
                         "e.g. 'sm_90a'")


def build(name: str, code: str, arch: str | None = None) -> BuildResult:
    """Compile ``code`` (a whole translation unit with exactly one ``__global__`` function) for
    ``arch`` (default: the current device's, see :func:`device_arch`), or load it from the caches.
    Releases the GIL while compiling, so builds can run on a thread pool. Raises JitError with the
    compiler log and the path of the generated source when compilation fails."""
    _check_name(name)
    if not isinstance(code, str) or not code.strip():
        raise ValueError(f"code: expected a non-empty CUDA source string, got {code!r:.80}")
    if arch is None:
        arch = device_arch()
    _check_arch(arch)
    ensure_configured()
    return BuildResult(**_C.jit_build(name, code, arch))


def _device(device: int | None) -> int:
    if device is not None:
        if not isinstance(device, int) or device < 0:
            raise ValueError(f"device={device!r}: expected a non-negative CUDA device ordinal")
        return device
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def device_arch(device: int | None = None) -> str:
    """"sm_90a" for compute capability 9.0, "sm_100a" for 10.0, else "sm_<major><minor>"."""
    return _C.device_arch(_device(device))


def device_info(device: int | None = None) -> DeviceInfo:
    return DeviceInfo(**_C.device_info(_device(device)))


def get_num_sms(device: int | None = None) -> int:
    """The SM count kernels plan for: the :func:`set_num_sms` override, else the device's count."""
    return _C.get_num_sms(_device(device))


def set_num_sms(num_sms: int, device: int | None = None) -> None:
    """Make kernels plan for ``num_sms`` SMs (1 to the SM count of ``device``) on every device."""
    if not isinstance(num_sms, int) or isinstance(num_sms, bool):
        raise ValueError(f"num_sms={num_sms!r}: expected an int")
    dev = _device(device)
    limit = _C.device_info(dev)["num_sms"]
    if not 1 <= num_sms <= limit:
        raise ValueError(f"num_sms={num_sms}: expected 1 <= num_sms <= {limit} (SMs of device {dev})")
    _C.set_num_sms(num_sms, dev)


def reset_num_sms() -> None:
    """Drop the :func:`set_num_sms` override."""
    _C.reset_num_sms()
