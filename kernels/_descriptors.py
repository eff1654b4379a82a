"""Torch tensors -> the integers that cross into ``kernels._C``.

``_C`` is built without libtorch: it sees a tensor as a data pointer, sizes, strides (in
elements), a dtype code and a device ordinal, and the launch stream as an integer. The dtype codes
mirror ``csrc/apis/dtypes.hpp``.
"""

from __future__ import annotations

import torch

DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.uint8: 4,
    torch.int8: 5,
    torch.int32: 6,
    torch.int64: 7,
}


def dtype_code(t: torch.Tensor, name: str) -> int:
    try:
        return DTYPE_CODES[t.dtype]
    except KeyError:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported by the kernel layer") from None


# torch's raw getter costs ~0.2 us against ~5 us for torch.cuda.current_stream(...).cuda_stream;
# CPU-only builds of torch lack it.
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device: torch.device) -> int:
    """The CUstream of torch's current stream on ``device`` (a tensor's device), as an integer."""
    return current_stream_of(device.index)


def current_stream_of(index: int) -> int:
    """current_stream for a CUDA device index (a tensor's ``get_device()``)."""
    if _raw_current_stream is not None:
        return _raw_current_stream(index)
    return torch.cuda.current_stream(index).cuda_stream
