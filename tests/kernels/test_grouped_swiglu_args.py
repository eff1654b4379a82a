"""m_grouped_fp8_gemm_nt_swiglu_contiguous / _masked (kernels/grouped_swiglu.py): the C++ entry points'
argument checks (kernels._C.*_args: the check alone, CPU tensors too) decline every call the Python
checks refuse, and pass the Python path's native arguments on for the ones it accepts. CPU tensors only."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import grouped_swiglu

_FP8 = torch.float8_e4m3fn
kM, kK, kN, kG = 256, 256, 512, 2  # rows (contiguous) or max_m (masked), K, 2I, groups


def _weights(g=kG, n=kN, k=kK):
    return (torch.zeros(g, n, k, dtype=_FP8), torch.ones(g, n // 128, 2, k // 128))


def _contig(**over):
    args = dict(a=(torch.zeros(kM, kK, dtype=_FP8), torch.ones(kM, kK // 128)), b=_weights(),
                d=(torch.empty(kM, kN // 2, dtype=_FP8), torch.empty(kM, kN // 256)),
                m_indices=torch.zeros(kM, dtype=torch.int32), weights=torch.rand(kM))
    args.update(over)
    return args


def _masked(**over):
    args = dict(a=(torch.zeros(kG, kM, kK, dtype=_FP8), torch.ones(kG, kM, kK // 128)), b=_weights(),
                d=(torch.empty(kG, kM, kN // 2, dtype=_FP8), torch.empty(kG, kM, kN // 256)),
                masked_m=torch.zeros(kG, dtype=torch.int32), expected_m=16, weights=torch.rand(kG, kM))
    args.update(over)
    return args


def _cpp(masked: bool):
    native = kernels.jit.native_module()
    return native.m_grouped_fp8_gemm_nt_swiglu_masked_args if masked else \
        native.m_grouped_fp8_gemm_nt_swiglu_contiguous_args


def _python(masked: bool):
    return grouped_swiglu._masked_launch_args if masked else grouped_swiglu._contiguous_launch_args


def _order(masked: bool, args: dict) -> tuple:
    names = ("a", "b", "d", "masked_m", "expected_m", "weights") if masked else ("a", "b", "d", "m_indices", "weights")
    return tuple(args[name] for name in names)


def _inference_scales(*shape: int) -> torch.Tensor:
    """Float32 scales made under torch.inference_mode() (not writable outside it)."""
    with torch.inference_mode():
        return torch.empty(*shape)


def _mn_major(rows, cols, groups=1):
    """Scales [groups, rows, cols] (or [rows, cols]) with stride 1 along the rows, groups stacked."""
    t = torch.ones(groups, cols, rows).transpose(1, 2)
    return t if groups > 1 else t[0]


kAccepted = {
    "contiguous": (False, {}),
    "contiguous, A rows padded, MN-major SFA and act_sf": (False, dict(
        a=(torch.zeros(kM, kK + 128, dtype=_FP8)[:, :kK], _mn_major(kM, kK // 128)),
        d=(torch.empty(kM, kN // 2 + 64, dtype=_FP8)[:, :kN // 2], _mn_major(kM, kN // 256)))),
    "contiguous, one group": (False, dict(b=_weights(g=1))),
    "masked": (True, {}),
    "masked, expected_m past max_m": (True, dict(expected_m=10 ** 6)),
    "masked, one group, act rows padded": (True, dict(
        a=(torch.zeros(1, kM, kK, dtype=_FP8), torch.ones(1, kM, kK // 128)), b=_weights(g=1),
        d=(torch.empty(1, kM, kN // 2 + 32, dtype=_FP8)[:, :, :kN // 2], torch.empty(1, kM, kN // 256)),
        masked_m=torch.zeros(1, dtype=torch.int32), weights=torch.rand(1, kM))),
}


@pytest.mark.parametrize("case", kAccepted.keys())
def test_cpp_checks_pass_the_python_arguments_on(case):
    masked, over = kAccepted[case]
    args = _order(masked, (_masked if masked else _contig)(**over))
    want = _python(masked)(*args)
    assert want[-1] == -1
    assert _cpp(masked)(*args) == want


kRefused = {
    "A not e4m3": (False, dict(a=(torch.zeros(kM, kK, dtype=torch.bfloat16), torch.ones(kM, 2)))),
    "K off the grid": (False, dict(a=(torch.zeros(kM, 200, dtype=_FP8), torch.ones(kM, 2)))),
    "A not K-major": (False, dict(a=(torch.zeros(kM, 2 * kK, dtype=_FP8)[:, ::2], torch.ones(kM, 2)))),
    "SFA shape": (False, dict(a=(torch.zeros(kM, kK, dtype=_FP8), torch.ones(kM, 3)))),
    "B rows not 2I of 128s": (False, dict(b=_weights(n=384))),
    "B K differs": (False, dict(b=_weights(k=128))),
    "B groups with gaps": (False, dict(b=(torch.zeros(4, kN, kK, dtype=_FP8)[::2], torch.ones(2, 4, 2, 2)))),
    "SFB 3-D": (False, dict(b=(torch.zeros(kG, kN, kK, dtype=_FP8), torch.ones(kG, 4, 2)))),
    "SFB halves apart": (False, dict(b=(torch.zeros(kG, kN, kK, dtype=_FP8),
                                        torch.ones(kG, 2, 4, 2).transpose(1, 2)))),
    "act not e4m3": (False, dict(d=(torch.empty(kM, kN // 2, dtype=torch.bfloat16), torch.empty(kM, 2)))),
    "act shape": (False, dict(d=(torch.empty(kM, kN, dtype=_FP8), torch.empty(kM, 2)))),
    "act odd row stride": (False, dict(d=(torch.empty(kM, kN // 2 + 1, dtype=_FP8)[:, :kN // 2],
                                          torch.empty(kM, 2)))),
    "act odd address": (False, dict(d=(torch.empty(kM * (kN // 2) + 2, dtype=_FP8)[1:-1].view(kM, kN // 2),
                                       torch.empty(kM, 2)))),
    "act_sf shape": (False, dict(d=(torch.empty(kM, kN // 2, dtype=_FP8), torch.empty(kM, 4)))),
    "act_sf overlapping": (False, dict(d=(torch.empty(kM, kN // 2, dtype=_FP8), torch.empty(kM, 1).expand(kM, 2)))),
    "act requires grad": (False, dict(d=(torch.empty(kM, kN // 2, dtype=_FP8),
                                         torch.empty(kM, 2, requires_grad=True)))),
    "act_sf an inference tensor": (False, dict(d=(torch.empty(kM, kN // 2, dtype=_FP8), _inference_scales(kM, 2)))),
    "m_indices int64": (False, dict(m_indices=torch.zeros(kM, dtype=torch.int64))),
    "m_indices strided": (False, dict(m_indices=torch.zeros(2 * kM, dtype=torch.int32)[::2])),
    "weights float64": (False, dict(weights=torch.rand(kM, dtype=torch.float64))),
    "weights strided": (False, dict(weights=torch.rand(2 * kM)[::2])),
    "a not a pair": (False, dict(a=torch.zeros(kM, kK, dtype=_FP8))),
    "masked: expected_m 0": (True, dict(expected_m=0)),
    "masked: expected_m a bool": (True, dict(expected_m=True)),
    "masked: expected_m past 32 bits": (True, dict(expected_m=2 ** 31)),
    "masked: groups differ": (True, dict(b=_weights(g=3))),
    "masked: A groups with gaps": (True, dict(a=(torch.zeros(kG, 2 * kM, kK, dtype=_FP8)[:, :kM],
                                                 torch.ones(kG, kM, 2)))),
    "masked: SFA groups with gaps": (True, dict(a=(torch.zeros(kG, kM, kK, dtype=_FP8),
                                                   torch.ones(kG, 2 * kM, 2)[:, :kM]))),
    "masked: act groups with gaps": (True, dict(d=(torch.empty(kG, 2 * kM, kN // 2, dtype=_FP8)[:, :kM],
                                                   torch.empty(kG, kM, 2)))),
    "masked: act_sf groups with gaps": (True, dict(d=(torch.empty(kG, kM, kN // 2, dtype=_FP8),
                                                      torch.empty(kG, 2 * kM, 2)[:, :kM]))),
    "masked: masked_m length": (True, dict(masked_m=torch.zeros(kG + 1, dtype=torch.int32))),
    "masked: weights shape": (True, dict(weights=torch.rand(kG * kM))),
    "masked: weights not contiguous": (True, dict(weights=torch.rand(kM, kG).t())),
    # Lazily negated views (the negative bit): the kernel would read (or write) their memory.
    "SFB negated": (False, dict(b=(_weights()[0], torch._neg_view(_weights()[1])))),
    "act_sf negated": (False, dict(d=(torch.empty(kM, kN // 2, dtype=_FP8), torch._neg_view(torch.empty(kM, 2))))),
    "m_indices negated": (False, dict(m_indices=torch._neg_view(torch.zeros(kM, dtype=torch.int32)))),
    "masked: weights negated": (True, dict(weights=torch._neg_view(torch.rand(kG, kM)))),
}


@pytest.mark.parametrize("case", kRefused.keys())
def test_cpp_checks_decline_what_python_refuses(case):
    masked, over = kRefused[case]
    args = _order(masked, (_masked if masked else _contig)(**over))
    with pytest.raises((TypeError, ValueError)):
        _python(masked)(*args)
    assert _cpp(masked)(*args) is None
    # The unchanged call is taken by both.
    assert _cpp(masked)(*_order(masked, (_masked if masked else _contig)())) is not None
