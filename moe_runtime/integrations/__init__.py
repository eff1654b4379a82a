"""Plug ``MegaMoELayer`` into third-party model code."""

from .hf import MegaMoEBlock, find_moe_blocks, replace_moe_blocks

__all__ = ["MegaMoEBlock", "find_moe_blocks", "replace_moe_blocks"]
