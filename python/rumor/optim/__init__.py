"""Optimizers that work with rumor's algorithms."""
from .onebit_adam import OneBitAdam  # noqa: F401
