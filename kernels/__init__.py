"""The kernel layer of moe_runtime: JIT-compiled FP8/FP4 kernels for Hopper with pure-torch
references on the CPU.

Importing this package loads nothing from CUDA: the driver and NVRTC are opened on the first GPU
call. Public functions that share a name with DeepGEMM's keep DeepGEMM's signature.
"""

from . import jit, reference, testing
from .gemm import fp8_gemm_nt
from .jit import get_num_sms, set_num_sms
from .quant import ceil_to_ue8m0, per_block_cast_to_fp8, per_token_cast_to_fp8

__all__ = [
    "ceil_to_ue8m0",
    "fp8_gemm_nt",
    "get_num_sms",
    "jit",
    "per_block_cast_to_fp8",
    "per_token_cast_to_fp8",
    "reference",
    "set_num_sms",
    "testing",
]
