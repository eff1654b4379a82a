"""Scale-factor layouts, with DeepGEMM's names and signatures.

Our GEMMs read the float32 scales in place with any non-negative strides (the scale warp gathers
them with cp.async), so no call needs a transform: K-major ``[M, K/128]`` scales as the quantizers
return them are read directly. These functions give the layouts other SM90 kernels expect, and
ours accept them too:

* :func:`get_mn_major_tma_aligned_tensor`: MN-major (stride 1 along M) with the M stride padded
  to 16 bytes, the layout DeepGEMM's SM90 kernels load with TMA. ``fp8_gemm_nt`` and
  ``m_grouped_fp8_gemm_nt_contiguous`` read it in place.
* :func:`transform_sf_into_required_layout`: the layout our kernels read for a scale tensor:
  activation scales (1x128) of a 2-D GEMM as MN-major TMA-aligned (as DeepGEMM), masked
  activation scales ``[G, M, K/128]`` K-major with the groups stacked without gaps (the masked
  kernel addresses group g's rows at ``g * M``), weight scales (128x128) contiguous.

CPU and CUDA tensors alike. On an SM90 GPU the MN-major copy is a kernel of ours (``mn_major_sf``,
also what ``fp8_gemm_nt`` runs before its 256-row tiles on scales of another layout), elsewhere
torch's strided copy.
"""

from __future__ import annotations

import torch

from . import _checks, _descriptors, jit

_TMA_ALIGNMENT_BYTES = 16


def get_tma_aligned_size(mn: int, element_size: int) -> int:
    """``mn`` rounded up so that ``mn * element_size`` is a multiple of 16 bytes."""
    if isinstance(mn, bool) or not isinstance(mn, int) or mn < 0:
        raise ValueError(f"get_tma_aligned_size: mn must be a non-negative int, got {mn!r}")
    if isinstance(element_size, bool) or not isinstance(element_size, int) or element_size < 1:
        raise ValueError(f"get_tma_aligned_size: element_size must be a positive int, got {element_size!r}")
    if _TMA_ALIGNMENT_BYTES % element_size:
        raise ValueError(f"get_tma_aligned_size: element_size must divide 16, got {element_size}")
    per_row = _TMA_ALIGNMENT_BYTES // element_size
    return (mn + per_row - 1) // per_row * per_row


def empty_activation_scales(m: int, groups: int, mn_major: bool, device: torch.device) -> torch.Tensor:
    """A new float32 [m, groups] for the quantizers' 1 x gran_k scales: contiguous (K-major), or
    MN-major with the M stride rounded up to 16 bytes (``get_mn_major_tma_aligned_tensor``'s
    layout, which the GEMMs load with one TMA box per K block)."""
    if not mn_major:
        return torch.empty((m, groups), dtype=torch.float32, device=device)
    return torch.empty((groups, get_tma_aligned_size(m, 4)), dtype=torch.float32, device=device).t()[:m]


def _is_mn_major_aligned(x: torch.Tensor, aligned_mn: int) -> bool:
    groups, mn, k = x.shape
    return (x.stride(1) == 1 or mn <= 1) and (x.stride(2) == aligned_mn or k <= 1) and \
        (x.stride(0) == aligned_mn * k or groups <= 1)


def get_mn_major_tma_aligned_tensor(x: torch.Tensor) -> torch.Tensor:
    """Same shape and values as ``x`` ([MN, K] or [G, MN, K], float32), stored MN-major: stride 1
    along MN, stride ``get_tma_aligned_size(MN, 4)`` along K (and ``that * K`` between groups).
    Returns ``x`` itself when it already has that layout."""
    fn = "get_mn_major_tma_aligned_tensor"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{fn}: x must be float32 scales, got {x.dtype}")
    _checks.check_dense(fn, "x", x)
    if x.dim() not in (2, 3):
        raise ValueError(f"{fn}: x must be [MN, K] or [G, MN, K], got shape {tuple(x.shape)}")
    batched = x if x.dim() == 3 else x.unsqueeze(0)
    groups, mn, k = batched.shape
    aligned_mn = get_tma_aligned_size(mn, x.element_size())
    if x.numel() == 0 or _is_mn_major_aligned(batched, aligned_mn):
        return x  # an empty tensor has no layout to change
    storage = torch.empty((groups, k, aligned_mn), dtype=x.dtype, device=x.device)
    out = storage.transpose(1, 2)[:, :mn, :]
    if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9 and min(batched.stride()) >= 0:
        jit.native_module().mn_major_sf(batched.data_ptr(), groups, mn, k, batched.stride(1), batched.stride(2),
                                        batched.stride(0), storage.data_ptr(), aligned_mn, aligned_mn * k,
                                        x.get_device(), _descriptors.current_stream(x.device))
    else:
        out.copy_(batched)
    return out if x.dim() == 3 else out.squeeze(0)


def transform_sf_into_required_layout(sf: torch.Tensor, mn: int, k: int, recipe=(1, 128, 128),
                                      num_groups: int | None = None, is_sfa: bool = False,
                                      disable_ue8m0_cast: bool = False) -> torch.Tensor:
    """The layout our SM90 kernels read for ``sf``: float32 ``[(num_groups,) ceil(mn / g), ceil(k / 128)]``
    with ``g`` = 1 for activation scales (``is_sfa``) and 128 for weight scales, of the
    ``(1, 128, 128)`` recipe. 2-D activation scales come back MN-major TMA-aligned, 3-D ones
    (masked) K-major with groups stacked without gaps, weight scales contiguous.
    ``disable_ue8m0_cast`` is accepted for DeepGEMM compatibility: on SM90 scales stay float32."""
    fn = "transform_sf_into_required_layout"
    _checks.check_recipe(fn, recipe)
    for value, name in ((mn, "mn"), (k, "k")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            _checks.fail(fn, ValueError, f"{name} must be a non-negative int, got {value!r}")
    if num_groups is not None and (isinstance(num_groups, bool) or not isinstance(num_groups, int)
                                   or num_groups < 1):
        _checks.fail(fn, ValueError, f"num_groups must be None or a positive int, got {num_groups!r}")
    if not isinstance(is_sfa, bool) or not isinstance(disable_ue8m0_cast, bool):
        _checks.fail(fn, TypeError, f"is_sfa and disable_ue8m0_cast must be bools, got {is_sfa!r}, "
                                    f"{disable_ue8m0_cast!r}")
    gran_mn = 1 if is_sfa else _checks.BLOCK
    shape = ((num_groups,) if num_groups is not None else ()) + \
        ((mn + gran_mn - 1) // gran_mn, (k + _checks.BLOCK - 1) // _checks.BLOCK)
    name = "sf (SFA)" if is_sfa else "sf (SFB)"
    if isinstance(sf, torch.Tensor) and sf.dtype != torch.float32:
        _checks.fail(fn, NotImplementedError, f"{name} must be float32: packed UE8M0 integer scales are the "
                                              f"SM100 layout, which these SM90 kernels do not read; got {sf.dtype}")
    sf = _checks.check_scales(fn, name, sf, shape)
    if not is_sfa:
        return sf.contiguous()
    if sf.dim() == 2:
        return get_mn_major_tma_aligned_tensor(sf)
    return sf.contiguous()
