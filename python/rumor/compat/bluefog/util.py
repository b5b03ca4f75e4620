"""bluefog.common.util names scripts use."""
from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def env(**kwargs):
    """Sets environment variables for the body and restores the previous values after."""
    saved = {k: os.environ.get(k) for k in kwargs}
    os.environ.update({k: str(v) for k, v in kwargs.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def mpi_built(verbose: bool = False) -> bool:
    """Whether BlueFog's MPI backend is built; False in rumor (no MPI).

    Args:
        verbose: accepted for BlueFog compatibility; default False.

    Returns:
        False.
    """
    return False  # rumor needs no MPI

# The public names; everything else here is this module's own business.
__all__ = [
    "env", "mpi_built",
]
