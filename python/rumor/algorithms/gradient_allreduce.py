from __future__ import annotations

from typing import Optional

from .. import _C
from ..collectives import ReduceOp, ALGORITHMS
from .base import Algorithm


class GradientAllReduce(Algorithm):
    """Averages (or sums) gradients with one allreduce per bucket, overlapped with backward.

    hierarchical=True reduces inside each host over shared memory, allreduces among one leader
    per host, and broadcasts inside the host, so the network carries each byte once per host.
    With hierarchical=False the communicator still picks that path automatically for large
    buckets when the job spans several hosts with several ranks each.

    small_allreduce_kb: buckets of at most this many KiB use recursive doubling (latency-bound),
    larger ones the ring (bandwidth-bound); None keeps the communicator's own threshold (64 KiB on
    one host, 16 KiB across hosts). Shared-memory buckets (all ranks on one host) ignore it.

    On CUDA parameters over NCCL each bucket is one NCCL allreduce: NCCL picks its own algorithm,
    so hierarchical and small_allreduce_kb apply to rumor's CPU transports only.

    Args:
        hierarchical: reduce inside each host first, then among one leader per host (see
            above); default False.
        average: True (the default) divides the sum by the number of ranks, as torch DDP does;
            False leaves the sum of the ranks' gradients.
        small_allreduce_kb: the size in KiB up to which a bucket uses recursive doubling (see
            above); default None.

    Raises:
        ValueError: small_allreduce_kb is neither None nor a number >= 0.
    """

    tunable_buckets = True

    # Every rank ends a step with the same weights and the algorithm keeps nothing across steps:
    # a commit of any rank restores the whole job (rumor.elastic).
    elastic_replicated = True

    def __init__(self, hierarchical: bool = False, average: bool = True,
                 small_allreduce_kb: Optional[float] = None):
        if small_allreduce_kb is not None and (isinstance(small_allreduce_kb, bool)
                                               or not isinstance(small_allreduce_kb, (int, float))
                                               or not small_allreduce_kb >= 0):
            raise ValueError("GradientAllReduce: small_allreduce_kb must be None or a number >= 0, got "
                             f"{small_allreduce_kb!r}")
        self.hierarchical = bool(hierarchical)
        self.average = bool(average)
        self.small_allreduce_kb = small_allreduce_kb

    stages_through_host = True

    def has_device_ops(self, ddp, nccl: bool) -> bool:
        return nccl

    def device_bucket_op(self, ddp, bucket):
        # NCCL picks its own ring or tree per size and topology: hierarchical and
        # small_allreduce_kb choose among rumor's CPU algorithms only.
        from ..engine.ops import AllreduceOp

        return AllreduceOp(ReduceOp.AVG if self.average else ReduceOp.SUM)

    def bucket_op(self, ddp, bucket):
        op = ReduceOp.AVG if self.average else ReduceOp.SUM
        if bucket.arena is not None:  # all ranks on one host: peers read the bucket in place
            return bucket.arena.allreduce_op(int(op))
        algo = "hierarchical" if self.hierarchical else "auto"
        if self.small_allreduce_kb is not None:
            nbytes = bucket.flat.numel() * bucket.flat.element_size()
            if nbytes <= self.small_allreduce_kb * 1024:
                algo = "recursive_doubling"
            elif not self.hierarchical and nbytes <= 64 * 1024:
                algo = "ring"  # "auto" would still pick recursive doubling below its own threshold
        return _C.allreduce_op(int(op), ALGORITHMS[algo])
