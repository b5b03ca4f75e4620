"""bagua.torch_api.contrib names that rumor has."""
from __future__ import annotations


def _missing(feature: str):
    raise NotImplementedError(f"rumor.compat.bagua.contrib: {feature} is not available in rumor")


def LoadBalancingDistributedSampler(*args, **kwargs):  # noqa: N802
    from rumor.data import sampler

    cls = getattr(sampler, "LoadBalancingDistributedSampler", None)
    if cls is None:
        _missing("LoadBalancingDistributedSampler")
    return cls(*args, **kwargs)


def CachedDataset(*args, **kwargs):  # noqa: N802
    from rumor.data import cache

    return cache.CachedDataset(*args, **kwargs)


def fuse_optimizer(optimizer, do_flatten: bool = True, check_flatten: bool = True):
    from rumor.optim import fuse_optimizer as _fuse

    return _fuse(optimizer)

# The public names; everything else here is this module's own business.
__all__ = [
    "CachedDataset", "LoadBalancingDistributedSampler", "fuse_optimizer",
]
