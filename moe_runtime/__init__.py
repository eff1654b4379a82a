"""moe_runtime: a distributed Mixture-of-Experts inference runtime (the top layer).

Process groups from torchrun (:func:`init_distributed`), symmetric buffers (:class:`SymmBuffer`,
:func:`get_symm_buffer_for_mega_moe`), the Mega MoE weight layouts
(:func:`transform_weights_for_mega_moe`), routing (:class:`RouterConfig`) and the MoE block
(:class:`MegaMoELayer`).
"""

from moe_runtime.dist import (DistContext, ExpertPlacement, apply_multicast_safety_env, expert_placement,
                              init_distributed, rank_print, uneven_all_gather)
from moe_runtime.layer import MegaMoELayer
from moe_runtime.mega import (MegaMoEBufferConfig, MegaMoEWeights, WeightPair, dequantize_mega_moe_weights,
                              get_block_m, get_symm_buffer_for_mega_moe, inverse_transform_weights_for_mega_moe,
                              transform_weights_for_mega_moe)
from moe_runtime.router import RouterConfig, RoutingResult, route
from moe_runtime.symm import SymmBuffer, SymmLayout, ViewSpec, compute_layout

__all__ = [
    "MegaMoELayer", "SymmBuffer", "get_symm_buffer_for_mega_moe", "transform_weights_for_mega_moe",
    "inverse_transform_weights_for_mega_moe", "RouterConfig", "init_distributed", "DistContext",
    "ExpertPlacement", "apply_multicast_safety_env", "expert_placement", "rank_print", "uneven_all_gather",
    "MegaMoEBufferConfig", "MegaMoEWeights", "WeightPair", "dequantize_mega_moe_weights", "get_block_m",
    "RoutingResult", "route", "SymmLayout", "ViewSpec", "compute_layout",
]
