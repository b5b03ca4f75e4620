"""Optimizers and optimizer wrappers for distributed training (1-bit Adam, BlueFog-style combine)."""
from .onebit_adam import OneBitAdam  # noqa: F401
from .combine import AdaptThenCombine, AdaptWithCombine  # noqa: F401
from .gradient_allreduce import GradientAllreduce  # noqa: F401
from .win_optimizers import (  # noqa: F401
    DistributedPullGetOptimizer,
    DistributedPushSumOptimizer,
    DistributedWinPutOptimizer,
)
from .fused import FusionError, fuse_optimizer  # noqa: F401
