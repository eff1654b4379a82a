# Sourced from the repository root after scripts/gpu_env.sh, on the GPU machine: build DeepGEMM (a
# benchmark peer, not part of this project) from its source copy in .peer/DeepGEMM unless built there
# already, and put it on PYTHONPATH. Used by scripts/peer_deepgemm.sh and scripts/ncu_gemm.sh.
# Prepare the copy here, once (the device machine reaches nothing outside itself; .peer/ is ignored
# by git and travels with `carry: [".whl", ".peer"]`):
#   mkdir -p .peer/DeepGEMM/third-party/fmt
#   git -C <DeepGEMM checkout, v2.6.1> archive HEAD | tar -x -C .peer/DeepGEMM
#   git -C <fmt checkout> archive HEAD include | tar -x -C .peer/DeepGEMM/third-party/fmt
# CUTLASS/CuTe headers come from the nvidia-cutlass wheel in .whl/. Build log: $out/peer_build.log.
src=.peer/DeepGEMM
[[ -f $src/csrc/python_api.cpp ]] || { echo "no DeepGEMM source in $src (see scripts/peer_env.sh)"; return 1; }
cutlass_inc=/tmp/site/cutlass_library/source/include
[[ -d $cutlass_inc/cute ]] || { echo "no CuTe headers at $cutlass_inc (the nvidia-cutlass wheel in .whl/)"; return 1; }
ln -sfn "$cutlass_inc/cutlass" "$src/deep_gemm/include/cutlass"
ln -sfn "$cutlass_inc/cute" "$src/deep_gemm/include/cute"
export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}"
export DG_JIT_CACHE_DIR=/tmp/dg_jit_cache
if ! ls "$src"/deep_gemm/_C*.so >/dev/null 2>&1; then
  start=$SECONDS
  python3 scripts/peer_deepgemm_patch.py "$src" || return 1
  # The image's default g++ (/opt/gcc) links libstdc++ statically; beside libtorch's shared one, the
  # second copy's locale state crashes DeepGEMM's first string stream. The system compiler links it shared.
  if [[ -x /usr/bin/g++ ]]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared"; fi
  # DeepGEMM's own setup.py also fetches release wheels and writes stubs; only its extension is built here.
  (cd "$src" && CUTLASS_INC="$cutlass_inc" MAX_JOBS=16 python3 - build_ext --inplace <<'PY'
import os
import sys
import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
flags = ["-std=c++17", "-O2", "-fPIC", "-Wno-psabi", "-Wno-deprecated-declarations",
         f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
setup(name="deep_gemm", packages=[], script_args=sys.argv[1:], cmdclass={"build_ext": BuildExtension},
      ext_modules=[CUDAExtension("deep_gemm._C", ["csrc/python_api.cpp"],
                                 include_dirs=[f"{CUDA_HOME}/include", f"{CUDA_HOME}/include/cccl",
                                               os.path.abspath("deep_gemm/include"), os.environ["CUTLASS_INC"],
                                               os.path.abspath("third-party/fmt/include")],
                                 libraries=["cudart", "nvrtc"], library_dirs=[f"{CUDA_HOME}/lib64"],
                                 extra_compile_args=flags)])
PY
  ) > "$out/peer_build.log" 2>&1 || { tail -40 "$out/peer_build.log"; return 1; }
  echo "DeepGEMM built in $((SECONDS - start)) s with ${CXX:-the default g++}"
  ldd "$src"/deep_gemm/_C*.so | grep -q libstdc++ || echo "warning: DeepGEMM's extension carries a static libstdc++"
fi
export PYTHONPATH="$PWD/$src:$PYTHONPATH"
