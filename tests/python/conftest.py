"""Shared pytest setup for rumor's Python tests.

Every test that communicates runs its ranks in spawned processes through harness.run(), which
enforces a deadline per test; nothing here talks to rumor in the pytest process itself.
"""
import json
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


# Module order. scripts/test.sh hands whole modules to two pytest-xdist workers in collection order
# (--dist loadfile --no-loadscope-reorder); a long module that starts last leaves the other worker
# idle until it ends, so the longest modules go first. module_times.json holds each module's
# seconds from a whole run; RUMOR_TEST_RECORD_TIMES=<file> writes it afresh at the end of a run.
# A module missing from it (new since the last recording) goes first: its time is unknown.
TIMES_FILE = os.path.join(HERE, "module_times.json")


def _module_of(nodeid):
    return nodeid.split("::", 1)[0]


def _recorded_times():
    try:
        with open(TIMES_FILE, encoding="utf-8") as f:
            times = json.load(f)
    except FileNotFoundError:
        return {}
    if not isinstance(times, dict):
        raise pytest.UsageError(f"{TIMES_FILE}: expected an object of module -> seconds")
    return {str(k): float(v) for k, v in times.items()}


def pytest_collection_modifyitems(session, config, items):
    times = _recorded_times()
    unknown = float("inf")
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(_module_of(item.nodeid), i)
    # Stable within a module: its tests keep their file order (module fixtures, launch batches).
    items.sort(key=lambda it: (-times.get(os.path.basename(_module_of(it.nodeid)), unknown),
                               first_seen[_module_of(it.nodeid)]))


_module_seconds = {}


def pytest_runtest_logreport(report):
    # Under xdist this runs in the controller as well, with every worker's reports.
    name = os.path.basename(_module_of(report.nodeid))
    _module_seconds[name] = _module_seconds.get(name, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("RUMOR_TEST_RECORD_TIMES")
    if not out or hasattr(session.config, "workerinput") or not _module_seconds:
        return
    ranked = dict(sorted(((k, round(v, 1)) for k, v in _module_seconds.items()),
                         key=lambda kv: -kv[1]))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(ranked, f, indent=1)
        f.write("\n")
