"""QSGD: stochastic quantization of gradients to a few levels of the chunk's L2 norm."""
from __future__ import annotations

from .bytegrad import KIND_QSGD, CompressedAllReduce


class QSGD(CompressedAllReduce):
    """Compressed gradient allreduce with QSGD quantization (Alistarh et al., 2017).

    Each chunk is sent as its L2 norm and, per element, a sign and a level in [0, levels],
    rounded stochastically so that the decoded value is an unbiased estimate of the input. Seeds
    differ per bucket, step, rank and block and are reproducible.

    Args:
        levels: quantization levels per sign, an int in 2..256; default 16. More levels lower
            the variance; each element takes one byte on the wire up to 127 levels, two above.
        hierarchical: True (the default) averages inside each host at full precision and
            compresses only between one leader per host; False compresses between every pair of
            ranks.
        average: True (the default) divides the sum by the number of ranks; False leaves the sum.
        chunk: elements per chunk (one L2 norm each); 0, the default, takes the codec's default
            (1024), otherwise a multiple of 8 up to 2**24.

    Raises:
        ValueError: levels is not an int in 2..256, or chunk is not 0 or a multiple of 8 up to
            2**24.
    """

    _kind = KIND_QSGD

    def __init__(self, levels: int = 16, hierarchical: bool = True, average: bool = True, chunk: int = 0):
        if isinstance(levels, bool) or not isinstance(levels, int) or not 2 <= levels <= 256:
            raise ValueError(f"QSGD: levels must be an int in 2..256, got {levels!r}")
        super().__init__(hierarchical=hierarchical, average=average, chunk=chunk, levels=levels)

    def __repr__(self) -> str:
        return f"QSGD(levels={self.levels}, hierarchical={self.hierarchical}, average={self.average})"
