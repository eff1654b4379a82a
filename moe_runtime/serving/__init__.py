"""Serving the MoE layers of a model across ranks: request streams, batching, the lockstep loop,
metrics, reference spot-checks, checkpoint loading. ``launch/serve_moe.py`` is the entry point."""

from .config import PRESETS, MoEModelConfig, config_from_hf
from .control import RankFailureError
from .loop import ServeOptions, format_summary, serve

__all__ = ["PRESETS", "MoEModelConfig", "config_from_hf", "RankFailureError", "ServeOptions", "format_summary",
           "serve"]
