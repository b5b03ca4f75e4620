"""bagua.torch_api.contrib names that rumor has."""
from __future__ import annotations


def _missing(feature: str):
    raise NotImplementedError(f"rumor.compat.bagua.contrib: {feature} is not available in rumor")


def LoadBalancingDistributedSampler(*args, **kwargs):  # noqa: N802
    """Bagua's load-balancing sampler: builds rumor.data.sampler.LoadBalancingDistributedSampler
    from the same arguments (see there: the dataset, a per-sample complexity function or
    precomputed costs, and the sampler's options), whose ranks get near-equal work per step.

    Returns:
        A rumor.data.sampler.LoadBalancingDistributedSampler.

    Raises:
        NotImplementedError: this rumor has no such sampler.
    """
    from rumor.data import sampler

    cls = getattr(sampler, "LoadBalancingDistributedSampler", None)
    if cls is None:
        _missing("LoadBalancingDistributedSampler")
    return cls(*args, **kwargs)


def CachedDataset(*args, **kwargs):  # noqa: N802
    """Bagua's cached dataset: builds rumor.data.cache.CachedDataset from the same arguments (see
    there), a map-style dataset whose samples are computed once per job and read back from a
    cache afterwards.

    Returns:
        A rumor.data.cache.CachedDataset.
    """
    from rumor.data import cache

    return cache.CachedDataset(*args, **kwargs)


def fuse_optimizer(optimizer, do_flatten: bool = True, check_flatten: bool = True):
    """Makes the optimizer step over flat buffers, with rumor.optim.fuse_optimizer().

    Args:
        optimizer: the torch optimizer to fuse.
        do_flatten: accepted for Bagua compatibility and not used (rumor always lays the
            parameters out flat); default True.
        check_flatten: accepted for Bagua compatibility and not used; default True.

    Returns:
        The same optimizer object, fused.

    Raises:
        TypeError: optimizer is not a torch.optim.Optimizer.
        FusionError: rumor cannot fuse this optimizer (its class or its settings).
        ValueError: the optimizer is already fused.
    """
    from rumor.optim import fuse_optimizer as _fuse

    return _fuse(optimizer)

# The public names; everything else here is this module's own business.
__all__ = [
    "CachedDataset", "LoadBalancingDistributedSampler", "fuse_optimizer",
]
