"""Build of ``kernels._C`` and packaging of the device templates.

``_C`` is C++17 against Python, pybind11 and (in csrc/apis/*_tensors.cpp only) torch's headers,
with no CUDA headers or libraries, so it builds on a machine without a GPU or a CUDA toolkit; it is
built against the torch it runs with (libc10, libtorch_python through an rpath). The device
templates under ``csrc/include`` are copied into the package as ``kernels/_include`` so that an
installed (non-editable) package can JIT-compile; an editable install reads them from
``csrc/include`` in the checkout instead.
Set ``MOE_BUILD_JOBS`` to compile the C++ sources in parallel.
"""

from __future__ import annotations

import glob
import os
import shutil

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
DEVICE_INCLUDE = os.path.join(CSRC, "include")
PACKAGED_INCLUDE = os.path.join("kernels", "_include")


def host_sources() -> list[str]:
    """Every host .cpp under csrc/ (device code lives in csrc/include and is never built here)."""
    sources = glob.glob(os.path.join(CSRC, "**", "*.cpp"), recursive=True)
    device_prefix = DEVICE_INCLUDE + os.sep
    return sorted(s for s in sources if not s.startswith(device_prefix))


def host_headers() -> list[str]:
    """The headers the host build depends on: its own .hpp, and the .h that the launchers share with
    the device templates (csrc/include/moe_kernels/common/*.h)."""
    headers = glob.glob(os.path.join(CSRC, "**", "*.hpp"), recursive=True)
    headers += glob.glob(os.path.join(CSRC, "**", "*.h"), recursive=True)
    return sorted(headers)


class BuildPyWithDeviceIncludes(build_py):
    """build_py that also copies csrc/include into the package as kernels/_include."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = os.path.join(self.build_lib, PACKAGED_INCLUDE)
        if os.path.isdir(target):
            shutil.rmtree(target)
        shutil.copytree(os.path.join(ROOT, DEVICE_INCLUDE), target)


class BuildExtWithCxxLinker(build_ext):
    """build_ext that links with the C++ driver (some Pythons' LDSHARED is the C driver, which
    knows neither libstdc++ nor -static-libstdc++)."""

    def build_extensions(self) -> None:
        cxx = getattr(self.compiler, "compiler_cxx", None)
        if cxx:
            for attr in ("linker_so", "linker_so_cxx"):
                linker = getattr(self.compiler, attr, None)
                if linker:
                    setattr(self.compiler, attr, [cxx[0], *linker[1:]])
        super().build_extensions()


ParallelCompile("MOE_BUILD_JOBS", default=0).install()


def torch_build_args() -> tuple[list[str], list[str]]:
    """Compile and link arguments for the sources that read torch tensors
    (csrc/apis/*_tensors.cpp): torch's headers as system headers (their warnings are not ours),
    its C++ ABI, and libc10 / libtorch_python found at run time through an rpath."""
    import torch
    from torch.utils import cpp_extension

    compile_args = [f"-isystem{path}" for path in cpp_extension.include_paths()]
    compile_args.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    # The tensor layout _C reads is this torch's: kernels/jit.py uses those entry points only under it.
    compile_args.append(f'-DMOE_TORCH_VERSION="{torch.__version__}"')
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return compile_args, [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_python"]


torch_compile_args, torch_link_args = torch_build_args()

extension = Pybind11Extension(
    "kernels._C",
    sources=host_sources(),
    depends=host_headers(),
    include_dirs=[CSRC, DEVICE_INCLUDE],  # the device headers that the launchers share (no CUDA in them)
    cxx_std=17,
    libraries=["dl", "pthread"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", *torch_compile_args],
    # A private, hidden copy of libstdc++: _C then works whatever libstdc++ the process loaded
    # first. On the H200 image the toolchain (CXX=/opt/gcc/bin/g++) links libstdc++ statically
    # anyway; with its symbols exported, _C crashed at its first C++ exception.
    extra_link_args=["-static-libstdc++", "-Wl,--exclude-libs,ALL", *torch_link_args],
)

setup(
    packages=find_packages(include=["kernels", "kernels.*", "moe_runtime", "moe_runtime.*"]),
    ext_modules=[extension],
    cmdclass={"build_py": BuildPyWithDeviceIncludes, "build_ext": BuildExtWithCxxLinker},
    zip_safe=False,
)
