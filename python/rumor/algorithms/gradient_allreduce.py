from __future__ import annotations

from .. import _C
from ..collectives import ReduceOp, _ALGO
from .base import Algorithm


class GradientAllReduce(Algorithm):
    """Averages (or sums) gradients with one allreduce per bucket, overlapped with backward.

    hierarchical=True reduces inside each host over shared memory, allreduces among one leader
    per host, and broadcasts inside the host, so the network carries each byte once per host.
    With hierarchical=False the communicator still picks that path automatically for large
    buckets when the job spans several hosts with several ranks each.
    """

    # Every rank ends a step with the same weights and the algorithm keeps nothing across steps:
    # a commit of any rank restores the whole job (rumor.elastic).
    elastic_replicated = True

    def __init__(self, hierarchical: bool = False, average: bool = True):
        self.hierarchical = bool(hierarchical)
        self.average = bool(average)

    def bucket_op(self, ddp, bucket):
        op = ReduceOp.AVG if self.average else ReduceOp.SUM
        if bucket.arena is not None:  # all ranks on one host: peers read the bucket in place
            return bucket.arena.allreduce_op(int(op))
        algo = _ALGO["hierarchical" if self.hierarchical else "auto"]
        return _C.allreduce_op(int(op), algo)
