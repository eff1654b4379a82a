# Sourced by scripts/gpu_check.sh and scripts/multi_gpu_check.sh, from the repository root: the log
# folder ($out: $OUT, the device tool's output folder, or ./gpu-logs), the environment (NVLink
# multicast off: it can take the host's shared GPUs out of service), the wheels the machine lacks
# (.whl/: nvidia-cutlass, nvshmem4py-cu13, pytest-xdist + execnet), $out/env.log, and kernels._C built in
# place.
out="${OUT:-$PWD/gpu-logs}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MOE_JIT_CACHE_DIR="${MOE_JIT_CACHE_DIR:-/tmp/moe_jit_cache}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.device_count(), 'x',
              torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  git rev-parse --short HEAD 2>/dev/null || true
} 2>&1 | tee "$out/env.log"
python3 setup.py -q build_ext --inplace > "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
echo "build ok"
# The JIT's compiler and cache salt: kernels compiled ahead elsewhere (python -m kernels.precompile
# --cache-dir .jit-cache, carried) are found here only where both match this machine's.
python3 -c "import kernels.jit as j; s = j.resolve_settings(); print('jit', s.compiler, s.cache_salt)" 2>&1 \
  | tee -a "$out/env.log"
if [[ -d .jit-cache ]]; then
  mkdir -p "$MOE_JIT_CACHE_DIR" && cp -rn .jit-cache/. "$MOE_JIT_CACHE_DIR"/
fi
