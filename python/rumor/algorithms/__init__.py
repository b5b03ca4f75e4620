"""Algorithms for rumor.DistributedDataParallel."""
from .base import Algorithm, default_bucket_plan  # noqa: F401
from .gradient_allreduce import GradientAllReduce  # noqa: F401
from .bytegrad import ByteGrad  # noqa: F401
from .qsgd import QSGD  # noqa: F401
from .low_precision import LowPrecision  # noqa: F401
from .onebit_adam import OneBitAdam  # noqa: F401
from .decentralized import Decentralized  # noqa: F401
from .low_precision_decentralized import LowPrecisionDecentralized  # noqa: F401
from .async_model_average import AsyncModelAverage  # noqa: F401
from .powersgd import PowerSGD  # noqa: F401
from .local_sgd import DiLoCo, LocalSGD, StreamingDiLoCo  # noqa: F401
