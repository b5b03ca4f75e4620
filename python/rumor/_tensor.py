"""Turning torch tensors into the (address, count, dtype code) views the C++ core takes."""
from __future__ import annotations

import torch

from . import _C

# Codes match rumor::DType in csrc/core/types.h.
_DTYPE_CODES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.uint8: 6,
    torch.int8: 7,
    torch.int16: 8,
}

SUPPORTED_DTYPES = tuple(_DTYPE_CODES)
_U8 = 6
# Every dtype torch has, numbered for checks that ranks passed the same one (codes above the
# reducible ones, so the two never collide).
_TAGS = {d: 64 + i for i, d in enumerate(sorted({getattr(torch, n) for n in dir(torch)
                                                  if isinstance(getattr(torch, n, None), torch.dtype)}, key=str))}


def dtype_code(dtype: torch.dtype, what: str) -> int:
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        names = ", ".join(str(d).replace("torch.", "") for d in _DTYPE_CODES)
        raise TypeError(f"{what}: unsupported dtype {dtype}; expected one of {names}") from None


def reduce_code(dtype: torch.dtype):
    """dtype's code in the C++ core, or None where rumor cannot reduce it."""
    return _DTYPE_CODES.get(dtype)


def dtype_tag(dtype: torch.dtype) -> int:
    """A number naming any torch dtype (its reduce code where it has one)."""
    code = _DTYPE_CODES.get(dtype)
    return code if code is not None else _TAGS.get(dtype, 63)


def check_movable(t, what: str):
    """For operations that only move data (broadcast, allgather, neighbor_allgather, send):
    any dtype travels as bytes. Returns (dtype code, elements per tensor element)."""
    _check_layout(t, what)
    return movable_code(t)


def movable_code(t: torch.Tensor):
    """(dtype code, elements per tensor element) of a tensor moved as data: its own code where
    rumor has one, else bytes."""
    code = _DTYPE_CODES.get(t.dtype)
    if code is not None:
        return code, 1
    return _U8, t.element_size()


def check_tensor(t, what: str) -> int:
    """Validates a tensor argument and returns its dtype code."""
    _check_layout(t, what)
    return dtype_code(t.dtype, what)


def check_dense(t, what: str) -> None:
    """A dense torch.Tensor on any device (the GPU path's check; _check_layout adds "on the CPU")."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{what}: expected a dense (strided) tensor, got layout {t.layout}")


def _check_layout(t, what: str) -> None:
    check_dense(t, what)
    if not t.is_cpu:
        # The collectives route CUDA tensors before they get here (rumor.gpu.routing); what reaches
        # this check is an operation without a GPU path.
        raise ValueError(
            f"{what}: expected a CPU tensor, got one on {t.device} "
            "(this operation has no GPU path yet; docs/gpu.md lists the ones that do)"
        )


def address(t: torch.Tensor) -> int:
    return t.data_ptr()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), through libc's copy where both are plain contiguous CPU tensors of one
    dtype and shape: it streams large buffers past the cache, about 1.5x faster than copy_ for a
    gradient moving into its bucket. Anything else (other layouts, dtypes, devices, a source that
    autograd tracks) goes through copy_."""
    if (src.dtype == dst.dtype and src.shape == dst.shape and src.is_cpu
            and dst.is_cpu and not src.requires_grad and src.layout == torch.strided
            and src.is_contiguous() and dst.is_contiguous()):
        _C.copy_bytes(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dst.copy_(src)
