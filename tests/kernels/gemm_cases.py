"""Operands, references, shapes and random draws shared by the FP8 GEMM tests (test_gemm*.py,
test_grouped.py)."""

from __future__ import annotations

import warnings

import torch

import kernels
from kernels.reference.quant import per_block_cast_to_fp8, per_token_cast_to_fp8
from kernels.testing import calc_diff

DEEPSEEK_NK = [(2112, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
GPU_MS = [1, 7, 64, 128, 129, 1000, 4096, 8191]
H200_SMS = 132


def make_operands(m: int, n: int, k: int, device: str, ue8m0: bool = False):
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    a_fp8 = per_token_cast_to_fp8(a, use_ue8m0=ue8m0)
    b_fp8 = per_block_cast_to_fp8(b, use_ue8m0=ue8m0)
    return a_fp8, b_fp8


def reference_f64(a_fp8, b_fp8, c=None) -> torch.Tensor:
    a = kernels.reference.gemm.dequantize_a(*a_fp8).double()
    b = kernels.reference.gemm.dequantize_b(*b_fp8).double()
    out = a @ b.t()
    return out if c is None else out + c.double()


def with_switch_off(m, n, k, switch, monkeypatch):
    """Fresh operands; D from the kernel as configured (fully written, against float64), then from
    the same call with ``switch=0``, both outputs NaN-poisoned first. Returns (a, b, d, d_off)."""
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.fp8_gemm_nt(a_fp8, b_fp8, d)
    monkeypatch.setenv(switch, "0")
    off = torch.full_like(d, float("nan"))
    kernels.fp8_gemm_nt(a_fp8, b_fp8, off)
    torch.cuda.synchronize()
    assert torch.isfinite(d).all(), "output not fully written"
    assert calc_diff(d, reference_f64(a_fp8, b_fp8)) < 1e-3
    return a_fp8, b_fp8, d, off


def outputs_per_setting(m, n, k, switch, values, monkeypatch, c=None, check=None):
    """Fresh operands; D from one NaN-poisoned dense call per value of the environment `switch`
    (`check(value, plan)` on each plan first). Returns (a_fp8, b_fp8, {value: d}), synchronized."""
    a_fp8, b_fp8 = make_operands(m, n, k, "cuda")
    outputs = {}
    for value in values:
        monkeypatch.setenv(switch, value)
        if check is not None:
            check(value, kernels.jit.native_module().fp8_gemm_nt_config(m, n, k, kernels.get_num_sms()))
        outputs[value] = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernels.fp8_gemm_nt(a_fp8, b_fp8, outputs[value], c=c)
    torch.cuda.synchronize()
    return a_fp8, b_fp8, outputs


def assert_settings_agree(outputs: dict, a_fp8, b_fp8, c=None) -> None:
    """The first setting's D fully written and right against float64, every other's bit for bit it."""
    first, *others = outputs.values()
    assert torch.isfinite(first).all(), "output not fully written"
    assert calc_diff(first, reference_f64(a_fp8, b_fp8, c)) < 1e-3
    for d in others:
        assert torch.equal(first, d)


class TensorSubclass(torch.Tensor):
    """A tensor subclass: the C++ fast checks decline it (it may redefine its storage)."""


class RandomDraws:
    """The random choices of the fast-check agreement tests: ``pick`` one of the options, ``bad``
    true with probability 1/16 (one aspect of a call made wrong)."""

    def __init__(self, g: torch.Generator):
        self.g = g

    def pick(self, *options):
        return options[int(torch.randint(len(options), (1,), generator=self.g))]

    def bad(self) -> bool:
        return bool(torch.rand(1, generator=self.g) < 1 / 16)


def strided_nested(t: torch.Tensor, split: int) -> torch.Tensor:
    """``t``'s rows before and after ``split`` as a strided nested tensor (layout torch.strided, no
    shape of its own: torch raises an internal RuntimeError where code reads it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided nested layout is a prototype
        return torch.nested.nested_tensor([t[:split], t[split:]], layout=torch.strided)


def inference_tensor(*shape: int) -> torch.Tensor:
    """A bfloat16 tensor made under torch.inference_mode() (torch refuses in-place writes to it outside)."""
    with torch.inference_mode():
        return torch.empty(*shape, dtype=torch.bfloat16)
