"""Algorithms for rumor.DistributedDataParallel."""
from .base import Algorithm, default_bucket_plan  # noqa: F401
from .gradient_allreduce import GradientAllReduce  # noqa: F401
