"""ByteGrad: gradients cross the network as 8 bits per element (min/max per chunk)."""
from __future__ import annotations

import torch

from .. import _C
from ..collectives import ReduceOp
from .base import Algorithm

# Codec kinds of csrc/compress/codec.h.
KIND_MINMAX_U8 = 1
KIND_QSGD = 2
KIND_SIGN = 3
KIND_F16 = 4
KIND_BF16 = 5

_FLOAT_BUCKETS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_chunk(chunk, who: str) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 <= chunk <= 2**24 or chunk % 8:
        raise ValueError(f"{who}: chunk must be 0 (the codec's default, 1024) or a multiple of 8 up to 2**24 "
                         f"(elements per chunk), got {chunk!r}")
    return chunk


class CompressedAllReduce(Algorithm):
    """Shared base of the compressed-allreduce algorithms (ByteGrad, QSGD, LowPrecision).

    Each bucket is averaged (or summed) by a compressed reduce-scatter + allgather in C++: every
    rank encodes each peer's block of the bucket, the block's owner adds the decoded
    contributions to its own (kept at full precision) in float32, encodes the result once, and
    every rank decodes every block from those same bytes, so all ranks end with identical
    gradients. hierarchical=True reduces inside each host at full precision first and compresses
    only between one leader per host (on a single host nothing is compressed then).
    """

    tunable_buckets = True

    # Every rank ends a step with the same weights and the algorithm keeps nothing across steps:
    # a commit of any rank restores the whole job (rumor.elastic).
    elastic_replicated = True

    _kind = KIND_MINMAX_U8

    def __init__(self, hierarchical: bool = True, average: bool = True, chunk: int = 0, levels: int = 16):
        self.hierarchical = bool(hierarchical)
        self.average = bool(average)
        self.chunk = _check_chunk(chunk, type(self).__name__)
        self.levels = int(levels)

    stages_through_host = True

    def has_device_ops(self, ddp, nccl: bool) -> bool:
        # The hierarchical form across hosts reduces inside each host first: on CUDA that runs
        # staged through host memory (the C++ op), not on the device.
        return nccl and not (self.hierarchical and not ddp.group._comm.all_local)

    def device_bucket_op(self, ddp, bucket):
        from ..engine.ops import AllreduceOp, CompressedOp

        self._check_dtype(bucket)
        if self.hierarchical:  # one host (has_device_ops): nothing is compressed, as in the C++ op
            return AllreduceOp(ReduceOp.AVG if self.average else ReduceOp.SUM)
        return CompressedOp(self._kind, self.chunk, self.levels, self.average, seed=bucket.index + 1)

    def _check_dtype(self, bucket):
        if bucket.flat.dtype not in _FLOAT_BUCKETS:
            raise TypeError(f"{type(self).__name__}: cannot compress a bucket of {bucket.flat.dtype} gradients "
                            "(expected float32, float16, bfloat16 or float64)")

    def bucket_op(self, ddp, bucket):
        self._check_dtype(bucket)
        if self.hierarchical and bucket.arena is not None:
            # All ranks on one host: nothing crosses a network, so nothing is compressed; peers
            # read the shared bucket in place (the fastest full-precision average).
            return bucket.arena.allreduce_op(int(ReduceOp.AVG if self.average else ReduceOp.SUM))
        # A distinct, rank-independent seed per bucket: stochastic rounding differs across buckets
        # and steps but is the same from run to run.
        return _C.compressed_allreduce_op(self._kind, self.chunk, self.levels, self.average, self.hierarchical,
                                          seed=bucket.index + 1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(hierarchical={self.hierarchical}, average={self.average})"


class ByteGrad(CompressedAllReduce):
    """Compressed gradient allreduce with 8-bit min/max quantization (Bagua's ByteGrad).

    Each chunk of a block is sent as its minimum and maximum (float32) and one byte per element
    (round to nearest of 256 evenly spaced levels): about 4x fewer bytes than float32.

    Args:
        hierarchical: True (the default) averages inside each host at full precision and
            compresses only between one leader per host; on a single host nothing is then
            compressed. False compresses between every pair of ranks.
        average: True (the default) divides the sum by the number of ranks; False leaves the sum.
        chunk: elements per quantization chunk (each carries its own minimum and maximum); 0,
            the default, takes the codec's default (1024), otherwise a multiple of 8 up to 2**24.

    Raises:
        ValueError: chunk is not 0 or a multiple of 8 up to 2**24.
        TypeError: (when a bucket is communicated) its gradients are not float32, float16,
            bfloat16 or float64.
    """

    _kind = KIND_MINMAX_U8

    def __init__(self, hierarchical: bool = True, average: bool = True, chunk: int = 0):
        super().__init__(hierarchical=hierarchical, average=average, chunk=chunk)
