"""Argument checks shared by the kernel front ends. Each raises with the function's name, the
argument, what it got and what was expected."""

from __future__ import annotations

import torch

BLOCK = 128


def fail(fn: str, kind: type[Exception], message: str):
    raise kind(f"{fn}: {message}")


def check_dense(fn: str, name: str, t: torch.Tensor, negated_ok: bool = False) -> None:
    """A strided (dense), not nested tensor: sparse and other layouts have no data pointer and strides
    to read, nested ones (strided nested tensors too) no shape of their own. Nor a lazily negated
    view (the negative bit, e.g. ``conj().imag``): a kernel reads its memory, not the values it
    shows, and writes through it unnegated. ``negated_ok``: the caller resolves it (or runs torch
    ops, which see the values)."""
    if t.layout is not torch.strided or t.is_nested:
        fail(fn, ValueError, f"{name} must be a dense (strided) tensor, got "
                             + ("a nested tensor" if t.is_nested else f"layout {t.layout}"))
    if not negated_ok and t.is_neg():
        fail(fn, ValueError, f"{name} must not be a lazily negated view (its negative bit is set, as by "
                             "conj().imag): pass t.resolve_neg()")


def check_dense_args(fn: str, negated_ok: bool = False, **tensors: object) -> None:
    """:func:`check_dense` of each tensor in ``tensors``, before any shape is read; None and other
    non-tensors are left to the argument's own check, which says what it expected."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            check_dense(fn, name, t, negated_ok)


def check_recipe(fn: str, recipe: object, recipe_a: object = None, recipe_b: object = None,
                 weights: tuple[int, int] = (BLOCK, BLOCK)) -> None:
    """Only DeepSeek-V3's recipe exists: 1x128 activation scales, 128x128 weight scales (``weights``:
    (1, 32) for FP4 weights' 1x32). DeepGEMM's ``recipe_a`` / ``recipe_b`` name the same granularities
    per operand."""
    if recipe is not None and (not isinstance(recipe, (tuple, list)) or tuple(recipe) != (1, BLOCK, BLOCK)):
        fail(fn, NotImplementedError, f"recipe {recipe!r} is not supported; only (1, 128, 128) "
                                      "(1x128 activation scales, 128x128 weight scales)")
    for name, value, supported in (("recipe_a", recipe_a, (1, BLOCK)), ("recipe_b", recipe_b, weights)):
        if value is not None and (not isinstance(value, (tuple, list)) or tuple(value) != supported):
            fail(fn, NotImplementedError, f"{name} {value!r} is not supported; only {supported}")


def unpack(fn: str, name: str, pair: object) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        fail(fn, TypeError, f"{name} must be a (tensor, scales) pair, got {type(pair).__name__}")
    return pair[0], pair[1]


def check_fp8_operand(fn: str, name: str, t: object, shape: tuple[int | None, ...]) -> torch.Tensor:
    """E4M3, ``len(shape)`` dims matching ``shape`` (None: any), K-major rows whose stride is a
    multiple of 16 bytes, and for 3-D operands groups stacked without gaps (one 2-D TMA view)."""
    if not isinstance(t, torch.Tensor):
        fail(fn, TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float8_e4m3fn:
        fail(fn, TypeError, f"{name} must be float8_e4m3fn, got {t.dtype}")
    check_dense(fn, name, t)
    if t.dim() != len(shape) or any(e is not None and s != e for s, e in zip(t.shape, shape)):
        expected = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        fail(fn, ValueError, f"{name} must have shape {expected}, got {list(t.shape)}")
    stride = t.stride()
    # K = 0 has no layout to check (torch gives such a tensor unit strides), and a K off the 128 grid
    # no row stride that fits: the K checks name both.
    if t.shape[-1] and t.shape[-1] % BLOCK == 0 and (stride[-1] != 1 or stride[-2] % 16 != 0 or stride[-2] < t.shape[-1]):
        fail(fn, ValueError, f"{name} must be K-major (stride 1 along K, a row stride that is a multiple of 16 "
                             f"elements), got strides {stride}")
    if t.dim() == 3 and t.shape[0] > 1 and t.shape[1] > 0 and stride[0] != t.shape[1] * stride[1]:
        fail(fn, ValueError, f"{name} must stack its groups without gaps (stride[0] == shape[1] * stride[1]), "
                             f"got strides {stride}")
    return t


def check_scales(fn: str, name: str, sf: object, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(sf, torch.Tensor):
        fail(fn, TypeError, f"{name} must be a torch.Tensor, got {type(sf).__name__}")
    if sf.dtype != torch.float32:
        fail(fn, TypeError, f"{name} must be float32 (UE8M0 scales as float32 powers of two), got {sf.dtype}")
    check_dense(fn, name, sf)
    if tuple(sf.shape) != tuple(shape):
        fail(fn, ValueError, f"{name} must have shape {list(shape)}, got {list(sf.shape)}")
    if sf.numel() and min(sf.stride()) < 0:
        fail(fn, ValueError, f"{name} must have non-negative strides, got {sf.stride()}")
    return sf


def writable(t: torch.Tensor) -> bool:
    """Whether a kernel may write ``t`` in place where torch would let an in-place op: not a tensor
    whose update autograd would have to record (one requiring grad, grad mode on; the kernels write
    through its pointer, unrecorded), nor an inference tensor outside inference mode."""
    return not ((t.requires_grad and torch.is_grad_enabled())
                or (t.is_inference() and not torch.is_inference_mode_enabled()))


def check_writable(fn: str, name: str, t: torch.Tensor) -> None:
    """A tensor a kernel writes in place must be :func:`writable`; the error says why it is not."""
    if not writable(t):
        why = ("requires grad with grad mode on (autograd cannot record the kernel's write: pass one that does not, "
               "or call under torch.no_grad())" if t.requires_grad else
               "is an inference tensor outside inference mode (call under torch.inference_mode(), or pass another)")
        fail(fn, ValueError, f"{name} is written in place but {why}")


def check_output(fn: str, d: object, shape: tuple[int, ...]) -> torch.Tensor:
    check_dense_args(fn, d=d)
    if not isinstance(d, torch.Tensor) or d.dtype != torch.bfloat16 or tuple(d.shape) != tuple(shape):
        fail(fn, ValueError, f"d must be a bfloat16 tensor of shape {list(shape)}, got "
                             f"{getattr(d, 'dtype', type(d).__name__)} {list(getattr(d, 'shape', ()))}")
    check_writable(fn, "d", d)
    stride = d.stride()
    if stride[-1] != 1 or stride[-2] % 8 != 0 or stride[-2] < shape[-1] or \
            (d.dim() == 3 and d.shape[0] > 1 and d.shape[1] > 0 and stride[0] != d.shape[1] * stride[1]):
        fail(fn, ValueError, f"d must be row-major with a row stride that is a multiple of 8 (groups without "
                             f"gaps), got strides {stride}")
    return d


def check_nk(fn: str, n: int, k: int) -> None:
    if k % BLOCK != 0 or k == 0:
        fail(fn, ValueError, f"K must be a positive multiple of 128, got {k}")
    if n % 8 != 0 or n == 0:
        fail(fn, ValueError, f"N must be a positive multiple of 8, got {n}")


def check_ints(fn: str, values: tuple) -> None:
    """``values``: (name, value, lowest allowed) triples; each must be an int (not a bool) >= lowest."""
    for name, value, low in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            fail(fn, ValueError, f"{name} must be an int >= {low}, got {value!r}")


def check_bool(fn: str, name: str, value: object) -> bool:
    """``value``, which must be a bool (a TypeError naming ``name`` otherwise)."""
    if not isinstance(value, bool):
        fail(fn, TypeError, f"{name} must be a bool, got {value!r}")
    return value


def check_same_device(fn: str, tensors: list[torch.Tensor]) -> torch.device:
    device = tensors[0].device
    if all(t.device == device for t in tensors) and device.type in ("cpu", "cuda"):
        return device  # the common case, without the strings the message below needs (2.3 -> 0.9 us)
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) != 1:
        fail(fn, ValueError, f"all tensors must be on one device, got {devices}")
    device = tensors[0].device
    if device.type not in ("cpu", "cuda"):
        fail(fn, ValueError, f"tensors must be on a CPU or CUDA device, got {device}")
    return device


def check_token_pairs(fn: str, xq: object, xs: object, topk_idx: object, topk_weights: object, hidden: int,
                      top_k: int | None = None, x_name: str = "xq",
                      unquantized: bool = False) -> tuple[torch.Tensor, int, int]:
    """The routed tokens a dispatch reads: ``xq`` E4M3 [T, hidden] (float8_e4m3fn or its uint8
    bits) with ``xs`` float32 [T, hidden/128], or, where ``unquantized`` and ``xs`` is None,
    bfloat16 / float16 / float32 rows [T, hidden] to be quantized; ``topk_idx`` int64 [T, k],
    ``topk_weights`` float32 [T, k], with k = ``top_k`` when given, else topk_idx's. ``x_name``
    names ``xq`` in messages. Returns (xq, as uint8 bits when E4M3, T, k)."""
    unquantized = unquantized and xs is None
    if isinstance(xq, torch.Tensor) and xq.dtype == torch.float8_e4m3fn:
        xq = xq.view(torch.uint8)
    num_tokens = xq.shape[0] if isinstance(xq, torch.Tensor) and xq.dim() == 2 else -1
    k = top_k if top_k is not None else (
        topk_idx.shape[1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 else -1)
    rows = (xq, (torch.bfloat16, torch.float16, torch.float32) if unquantized else (torch.uint8,), (num_tokens, hidden))
    expected = {x_name: rows}
    if not unquantized:
        expected["xs"] = (xs, (torch.float32,), (num_tokens, hidden // BLOCK))
    expected.update(topk_idx=(topk_idx, (torch.int64,), (num_tokens, k)),
                    topk_weights=(topk_weights, (torch.float32,), (num_tokens, k)))
    for name, (t, dtypes, shape) in expected.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or tuple(t.shape) != shape:
            want = " or ".join(str(d) for d in dtypes)
            if name == x_name:
                want = ("bfloat16, float16 or float32 (xs None: quantized in the kernel)" if unquantized else
                        "E4M3 (float8_e4m3fn or its uint8 bits)")
            fail(fn, ValueError, f"{name} must be a {want} tensor of shape {list(shape)} (hidden {hidden}, top_k {k}), "
                                 f"got {getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', ()))}")
    return xq, num_tokens, k


def contiguous_aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous with a 16-byte aligned base, for kernels that address its rows by their width
    alone and read them 16 bytes at a time; a copy where ``x`` is not."""
    if not x.is_contiguous():
        return x.contiguous()
    return x.clone() if x.data_ptr() % 16 else x


def vector_rows(x: torch.Tensor, row_elems: int) -> torch.Tensor:
    """``x`` [T, H] as rows a kernel reads 16 bytes at a time: a contiguous last dim, a 16-byte aligned
    base and row stride, rows at least ``row_elems`` apart; a copy where ``x`` is not."""
    if x.stride(-1) != 1 or x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16 or x.stride(0) < row_elems:
        return x.clone(memory_format=torch.contiguous_format)
    return x
