"""Bagua's algorithm classes (bagua.torch_api.algorithms) as rumor algorithms.

Each class takes Bagua's arguments and is a rumor.algorithms.Algorithm, so
``model.with_bagua([optimizer], algorithm)`` (or rumor.DistributedDataParallel) runs it.
GlobalAlgorithmRegistry maps Bagua's registry names onto them.
"""
from __future__ import annotations

from rumor.algorithms import Algorithm  # noqa: F401

from . import async_model_average, bytegrad, decentralized, gradient_allreduce, q_adam  # noqa: F401

AlgorithmImpl = Algorithm


class _Registry:
    def __init__(self):
        self._entries = {}

    def register(self, name, cls, description: str = ""):
        self._entries[name] = (cls, description)

    def get(self, name):
        entry = self._entries.get(name)
        return None if entry is None else entry[0]

    def keys(self):
        return list(self._entries)

    def __contains__(self, name):
        return name in self._entries


GlobalAlgorithmRegistry = _Registry()
GlobalAlgorithmRegistry.register("gradient_allreduce", gradient_allreduce.GradientAllReduceAlgorithm,
                                 "Gradient AllReduce")
GlobalAlgorithmRegistry.register("bytegrad", bytegrad.ByteGradAlgorithm, "ByteGrad")
GlobalAlgorithmRegistry.register("decentralized", decentralized.DecentralizedAlgorithm, "Decentralized SGD")
GlobalAlgorithmRegistry.register("low_precision_decentralized", decentralized.LowPrecisionDecentralizedAlgorithm,
                                 "Low-precision decentralized SGD")
GlobalAlgorithmRegistry.register("qadam", q_adam.QAdamAlgorithm, "QAdam (rumor's 1-bit Adam)")
GlobalAlgorithmRegistry.register("async", async_model_average.AsyncModelAverageAlgorithm,
                                 "Asynchronous model average")

# The public names; everything else here is this module's own business.
__all__ = [
    "Algorithm", "AlgorithmImpl", "GlobalAlgorithmRegistry",
]
