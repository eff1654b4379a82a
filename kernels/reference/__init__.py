"""Pure-torch references of every kernel: the CPU path and the oracle of the GPU tests."""

from . import exchange, fp4, gemm, quant, swiglu

__all__ = ["exchange", "fp4", "gemm", "quant", "swiglu"]
