"""LowPrecision: gradients cross the network as float16 or bfloat16."""
from __future__ import annotations

import torch

from .bytegrad import KIND_BF16, KIND_F16, CompressedAllReduce


class LowPrecision(CompressedAllReduce):
    """Compressed gradient allreduce that sends each value as float16 or bfloat16 (round to
    nearest even): half the bytes of float32. The owner of each block still accumulates in
    float32. float16 keeps 11 significant bits but overflows above 65504; bfloat16 keeps
    float32's range with 8 significant bits.

    Args:
        dtype: the wire type, torch.float16 (the default) or torch.bfloat16.
        hierarchical: True (the default) averages inside each host at full precision and sends
            the low-precision values only between one leader per host; False between every pair
            of ranks.
        average: True (the default) divides the sum by the number of ranks; False leaves the sum.

    Raises:
        ValueError: dtype is neither torch.float16 nor torch.bfloat16.
    """

    def __init__(self, dtype: torch.dtype = torch.float16, hierarchical: bool = True, average: bool = True):
        if dtype == torch.float16:
            self._kind = KIND_F16
        elif dtype == torch.bfloat16:
            self._kind = KIND_BF16
        else:
            raise ValueError(f"LowPrecision: dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
        self.dtype = dtype
        super().__init__(hierarchical=hierarchical, average=average)

    def __repr__(self) -> str:
        return f"LowPrecision(dtype={self.dtype}, hierarchical={self.hierarchical}, average={self.average})"
