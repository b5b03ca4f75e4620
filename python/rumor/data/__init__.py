"""rumor.data: data loading for data-parallel training (load-balanced sampling, cached datasets)."""
from .cache import CachedDataset, CacheLoader, CacheWarning
from .sampler import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

__all__ = ["CachedDataset", "CacheLoader", "CacheWarning", "LoadBalancingDistributedSampler",
           "LoadBalancingDistributedBatchSampler"]
