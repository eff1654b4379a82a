"""The kernel layer of moe_runtime: JIT-compiled FP8 and FP8 x FP4 kernels for Hopper, with
pure-torch references on the CPU.

Importing this package loads nothing from CUDA: the driver and NVRTC are opened on the first GPU
call. Public functions that share a name with DeepGEMM's keep DeepGEMM's signature.
"""

from . import jit, reference, testing
from ._fp4_fragment import transform_fp4_for_decode
from .ep import EpLayout, ep_buffer_views, ep_combine, ep_dispatch, ep_signal_ints
from .exchange import (ExchangeBarrier, ExchangePeers, exchange_barrier, exchange_combine, exchange_count,
                       exchange_count_sizes, exchange_dispatch, exchange_sizes)
from .exchange_prepared import PreparedExchange
from .gemm import bf16_gemm_nt, fp8_gemm_nt
from .grouped import (
    get_mk_alignment_for_contiguous_layout,
    m_grouped_fp8_fp4_gemm_nt_contiguous,
    m_grouped_fp8_fp4_gemm_nt_masked,
    m_grouped_fp8_gemm_nt_contiguous,
    m_grouped_fp8_gemm_nt_masked,
    set_mk_alignment_for_contiguous_layout,
)
from .grouped_bf16 import m_grouped_bf16_gemm_nt_contiguous, m_grouped_bf16_gemm_nt_masked
from .grouped_swiglu import m_grouped_fp8_gemm_nt_swiglu_contiguous, m_grouped_fp8_gemm_nt_swiglu_masked
from .jit import get_num_sms, set_num_sms
from .layout import get_mn_major_tma_aligned_tensor, get_tma_aligned_size, transform_sf_into_required_layout
from .moe import moe_combine, moe_local_dispatch, moe_route, swiglu_quant_fp8
from .quant import (
    cast_back_from_fp4,
    cast_fp4_to_fp8_blocks,
    ceil_to_ue8m0,
    per_block_cast_to_fp8,
    per_token_cast_to_fp4,
    per_token_cast_to_fp8,
    transform_sf_for_fp4_gemm,
)

# DeepGEMM's other names of the same functions, which callers written for it import (SGLang's
# masked MoE path, for one).
fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
bf16_m_grouped_gemm_nt_masked = m_grouped_bf16_gemm_nt_masked
get_m_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout

__all__ = [
    "EpLayout",
    "ExchangeBarrier",
    "ExchangePeers",
    "PreparedExchange",
    "bf16_gemm_nt",
    "bf16_m_grouped_gemm_nt_masked",
    "cast_back_from_fp4",
    "cast_fp4_to_fp8_blocks",
    "ceil_to_ue8m0",
    "ep_buffer_views",
    "ep_combine",
    "ep_dispatch",
    "ep_signal_ints",
    "exchange_barrier",
    "exchange_combine",
    "exchange_count",
    "exchange_count_sizes",
    "exchange_dispatch",
    "exchange_sizes",
    "fp8_gemm_nt",
    "fp8_m_grouped_gemm_nt_masked",
    "get_m_alignment_for_contiguous_layout",
    "get_mk_alignment_for_contiguous_layout",
    "get_mn_major_tma_aligned_tensor",
    "get_num_sms",
    "get_tma_aligned_size",
    "jit",
    "m_grouped_bf16_gemm_nt_contiguous",
    "m_grouped_bf16_gemm_nt_masked",
    "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "m_grouped_fp8_fp4_gemm_nt_masked",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "m_grouped_fp8_gemm_nt_swiglu_contiguous",
    "m_grouped_fp8_gemm_nt_swiglu_masked",
    "moe_combine",
    "moe_local_dispatch",
    "moe_route",
    "per_block_cast_to_fp8",
    "per_token_cast_to_fp4",
    "per_token_cast_to_fp8",
    "reference",
    "set_mk_alignment_for_contiguous_layout",
    "set_num_sms",
    "swiglu_quant_fp8",
    "testing",
    "transform_fp4_for_decode",
    "transform_sf_for_fp4_gemm",
    "transform_sf_into_required_layout",
]
