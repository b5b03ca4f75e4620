"""rumor.data: data loading for data-parallel training (load-balanced sampling, cached datasets)."""
from .cache import CachedDataset, CacheLoader, CacheWarning  # noqa: F401
from .sampler import LoadBalancingDistributedBatchSampler  # noqa: F401
from .sampler import LoadBalancingDistributedSampler  # noqa: F401
