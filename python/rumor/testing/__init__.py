"""Helpers for rumor's own tests and benchmarks (not part of the training API).

netns: emulate several hosts on one Linux machine with network namespaces, a bridge and
optional tbf bandwidth shaping (see docs in rumor.testing.netns).
"""
from .netns import Cluster, Host, available  # noqa: F401
