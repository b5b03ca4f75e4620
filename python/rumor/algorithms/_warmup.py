"""The buckets of an algorithm that averages gradients exactly like GradientAllReduce for a
warm-up and then trains locally (LocalSGD, AsyncModelAverage): once local, backward communicates
nothing and the weights are averaged some other way."""
from __future__ import annotations

from .. import _C
from .gradient_allreduce import GradientAllReduce


class WarmupThenLocal:
    """Mixin, listed before Algorithm in the bases. The algorithm says when backward has gone
    local through ``_local``; when that changes it calls ``ddp._refresh_bucket_ops()`` (with the
    engine idle) so that the buckets ask for their op again."""

    @property
    def _local(self) -> bool:
        raise NotImplementedError

    def bucket_op(self, ddp, bucket):
        if self._local:
            return _C.local_op()
        return GradientAllReduce().bucket_op(ddp, bucket)

    # CUDA parameters: the warm-up's gradient average on the device over NCCL, or staged without;
    # afterwards backward communicates nothing.
    stages_through_host = True

    def has_device_ops(self, ddp, nccl: bool) -> bool:
        return nccl

    def device_bucket_op(self, ddp, bucket):
        from ..engine.ops import LocalOp

        if self._local:
            return LocalOp()
        return GradientAllReduce().device_bucket_op(ddp, bucket)

    def rebuild_buckets(self, ddp) -> bool:
        # Nothing to order once backward never communicates (no collective on the training
        # thread, ever, if local from the first step); during warm-up the ranks are in step.
        return not self._local
