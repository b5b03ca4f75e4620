"""The harness itself: results come back, a failing rank's traceback is shown, a hung rank is
killed at the deadline, a dead rank is reported, and the comparisons catch what they should."""
from __future__ import annotations

import os
import time

import pytest

import harness


def returns_rank(extra):
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), extra, os.environ.get("ONLY_RANK_1")


def raises_on_rank_1():
    if os.environ["RANK"] == "1":
        raise KeyError("boom from rank one")
    return "fine"


def hangs_on_rank_0():
    if os.environ["RANK"] == "0":
        while True:
            time.sleep(0.05)
    return "fine"


def dies_on_rank_1():
    if os.environ["RANK"] == "1":
        os._exit(3)
    return "fine"


def test_results_and_env():
    res = harness.run(returns_rank, 3, timeout=30, args=({"x": 1},), rank_env=[None, {"ONLY_RANK_1": "yes"}, None])
    assert res == [(0, 3, {"x": 1}, None), (1, 3, {"x": 1}, "yes"), (2, 3, {"x": 1}, None)]


def test_failing_rank_shows_its_traceback():
    with pytest.raises(harness.RankFailed) as info:
        harness.run(raises_on_rank_1, 2, timeout=30)
    msg = str(info.value)
    assert "failed: [1]" in msg and "boom from rank one" in msg and "raises_on_rank_1" in msg, msg


def test_hung_rank_is_killed_at_the_deadline():
    t0 = time.monotonic()
    with pytest.raises(harness.RankFailed) as info:
        harness.run(hangs_on_rank_0, 2, timeout=3)
    assert "did not finish within the 3 s deadline" in str(info.value), str(info.value)
    assert time.monotonic() - t0 < 60  # killed, not waited for


def test_dead_rank_is_reported_unless_allowed():
    with pytest.raises(harness.RankFailed) as info:
        harness.run(dies_on_rank_1, 2, timeout=30)
    assert "exited with code 3" in str(info.value)
    assert harness.run(dies_on_rank_1, 2, timeout=30, may_die=[1]) == ["fine", None]


def test_compare():
    import torch

    a = torch.tensor([1.0, 2.0, float("nan")])
    assert harness.compare(a, a.clone(), exact=True) is None
    assert "1 of 3" in harness.compare(a, torch.tensor([1.0, 2.5, float("nan")]), exact=True)
    assert "dtype" in harness.compare(a, a.double(), exact=True)
    assert "shape" in harness.compare(a, a[:2], exact=True)
    assert harness.compare(torch.tensor([1.0]), torch.tensor([1.0 + 1e-7]), exact=False) is None
    assert harness.compare(torch.tensor([1.0]), torch.tensor([1.0 + 1e-7]), exact=True) is not None
    assert harness.compare(torch.tensor([3], dtype=torch.uint8), torch.tensor([4], dtype=torch.uint8), exact=False)


def test_gen_and_reference_are_exact():
    import torch

    for dtype in harness.dtypes():
        for op in harness.OP_NAMES:
            xs = [harness.gen("k", q, dtype, op, 1000) for q in range(4)]
            assert harness.gen("k", 2, dtype, op, 1000).equal(xs[2])  # deterministic
            ref = harness.reference(xs, op)
            assert ref.dtype == dtype
            # The inputs were chosen so that the exact result fits the dtype.
            wide = torch.stack([x.double() for x in xs])
            exact = {"SUM": wide.sum(0), "PROD": wide.prod(0), "MIN": wide.amin(0), "MAX": wide.amax(0),
                     "AVG": wide.sum(0) / 4}[op]
            if op != "AVG":
                assert torch.equal(ref.double(), exact), (dtype, op)
    ints = [torch.tensor([-7, 7, 5], dtype=torch.int32), torch.tensor([0, 0, 0], dtype=torch.int32)]
    assert harness.reference(ints, "AVG").tolist() == [-3, 3, 2]  # truncation toward zero
