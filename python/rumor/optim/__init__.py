"""Optimizers and optimizer wrappers for distributed training (1-bit Adam, BlueFog-style combine)."""
from .._renamed import module_getattr
from .onebit_adam import OneBitAdamOptimizer
from .combine import AdaptThenCombine, AdaptWithCombine
from .gradient_allreduce import GradientAllReduceOptimizer
from .win_optimizers import (
    DistributedPullGetOptimizer,
    DistributedPushSumOptimizer,
    DistributedWinPutOptimizer,
)
from .fused import FusionError, fuse_optimizer

__all__ = [
    "AdaptThenCombine",
    "AdaptWithCombine",
    "DistributedPullGetOptimizer",
    "DistributedPushSumOptimizer",
    "DistributedWinPutOptimizer",
    "FusionError",
    "GradientAllReduceOptimizer",
    "OneBitAdamOptimizer",
    "fuse_optimizer",
]

# One class per name: the optimizer and the algorithm of 1-bit Adam used to share "OneBitAdam",
# and this wrapper differed from rumor.algorithms.GradientAllReduce by one capital letter.
__getattr__ = module_getattr(__name__, {"OneBitAdam": "OneBitAdamOptimizer",
                                        "GradientAllreduce": "GradientAllReduceOptimizer"}, globals())
