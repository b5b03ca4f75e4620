"""Algorithms for rumor.DistributedDataParallel."""
from .._renamed import module_getattr
from .base import Algorithm, default_bucket_plan
from .gradient_allreduce import GradientAllReduce
from .bytegrad import ByteGrad
from .qsgd import QSGD
from .low_precision import LowPrecision
from .onebit_adam import OneBitAdamAlgorithm
from .decentralized import Decentralized
from .low_precision_decentralized import LowPrecisionDecentralized
from .async_model_average import AsyncModelAverage
from .powersgd import PowerSGD
from .local_sgd import DiLoCo, LocalSGD, StreamingDiLoCo

__all__ = [
    "Algorithm",
    "AsyncModelAverage",
    "ByteGrad",
    "Decentralized",
    "DiLoCo",
    "GradientAllReduce",
    "LocalSGD",
    "LowPrecision",
    "LowPrecisionDecentralized",
    "OneBitAdamAlgorithm",
    "PowerSGD",
    "QSGD",
    "StreamingDiLoCo",
    "default_bucket_plan",
]

# The algorithm of 1-bit Adam shared "OneBitAdam" with its optimizer (rumor.optim).
__getattr__ = module_getattr(__name__, {"OneBitAdam": "OneBitAdamAlgorithm"}, globals())
