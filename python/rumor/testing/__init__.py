"""Helpers for rumor's own tests and benchmarks (not part of the training API).

netns: emulate several hosts on one Linux machine with network namespaces, a bridge and
optional tbf bandwidth shaping (`from rumor.testing import netns`; see its docstring).
"""

__all__ = ["Cluster", "Host", "available", "netns"]


def __getattr__(name):
    # Lazy, so that `python -m rumor.testing.netns` does not import the module twice.
    if name in ("Cluster", "Host", "available"):
        from . import netns

        return getattr(netns, name)
    raise AttributeError(f"module 'rumor.testing' has no attribute {name!r}")
