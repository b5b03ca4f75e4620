"""rumor.data: data-loading helpers (cached datasets, load-balanced sampling)."""
from .cache import CachedDataset, CacheLoader, CacheWarning  # noqa: F401
