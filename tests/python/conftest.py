"""Shared pytest setup for rumor's Python tests.

Every test that communicates runs its ranks in spawned processes through harness.run(), which
enforces a deadline per test; nothing here talks to rumor in the pytest process itself.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture(scope="module")
def batches():
    """A cache per test module for harness.batch(): one launch's result per batch of scenarios."""
    return {}
