"""Optimizers and optimizer wrappers for distributed training."""
from .decentralized import AdaptThenCombine, AdaptWithCombine  # noqa: F401
