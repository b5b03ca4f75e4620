"""Bad input is rejected with the right exception, and mismatched ranks fail instead of hanging.

Argument errors (dtype, device, layout, ranks, ops, splits) must be raised before any traffic,
so after each one the communicator still works: every rank runs the same sequence of bad calls
and a real collective in between proves the ranks are still in step. Mismatches that only show
up between ranks (shapes across ranks, sizes, different collectives) must raise a
rumor.RumorError (or ValueError/TypeError where rumor checks the shapes up front) on every
rank, well within the deadline.
"""
from __future__ import annotations

import tempfile

import pytest

import harness
from harness import Checker


def _api(rumor, torch, n, r):
    """Every public entry point that takes a tensor, as name -> f(tensor)."""
    other = (r + 1) % n
    return {
        "allreduce": lambda t: rumor.allreduce(t),
        "allreduce_": lambda t: rumor.allreduce_(t),
        "allreduce_nonblocking": lambda t: rumor.allreduce_nonblocking(t).wait(),
        "allreduce_nonblocking_": lambda t: rumor.allreduce_nonblocking_(t).wait(),
        "broadcast": lambda t: rumor.broadcast(t, 0),
        "broadcast_": lambda t: rumor.broadcast_(t, 0),
        "broadcast_nonblocking": lambda t: rumor.broadcast_nonblocking(t, 0).wait(),
        "broadcast_nonblocking_": lambda t: rumor.broadcast_nonblocking_(t, 0).wait(),
        "reduce": lambda t: rumor.reduce(t, 0),
        "reduce_nonblocking": lambda t: rumor.reduce_nonblocking(t, 0).wait(),
        "allgather": lambda t: rumor.allgather(t),
        "allgather_nonblocking": lambda t: rumor.allgather_nonblocking(t).wait(),
        "reduce_scatter": lambda t: rumor.reduce_scatter(t),
        "reduce_scatter_nonblocking": lambda t: rumor.reduce_scatter_nonblocking(t).wait(),
        "alltoall": lambda t: rumor.alltoall(t),
        "alltoall_nonblocking": lambda t: rumor.alltoall_nonblocking(t).wait(),
        "send": lambda t: rumor.send(t, other),
        "recv": lambda t: rumor.recv(t, other),
    }


def _still_in_step(chk, rumor, torch, n, what):
    x = torch.arange(6, dtype=torch.int64) + rumor.rank()
    want = torch.arange(6, dtype=torch.int64) * n + sum(range(n))
    chk.equal(rumor.allreduce(x, rumor.ReduceOp.SUM), want, f"allreduce after {what}")


def argument_errors_rank():
    import numpy as np
    import torch

    import rumor

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()
    api = _api(rumor, torch, n, r)

    # Unsupported dtypes in reductions: TypeError that names the dtypes rumor does support.
    # (Operations that only move data take every dtype as bytes: tests/python/test_compat.py.)
    for dtype in [torch.complex64, torch.bool, torch.complex128]:
        for name, call in api.items():
            if "reduce" not in name:
                continue
            e = chk.raises(TypeError, lambda: call(torch.zeros(4 * n, dtype=dtype)), f"{name}({dtype})")
            if isinstance(e, TypeError):
                msg = str(e)
                missing = [d for d in ["float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8",
                                       "int8", "int16"] if d not in msg]
                chk.check(not missing, f"{name}({dtype}): the TypeError does not name {missing}: {msg}")
                chk.check(str(dtype).replace("torch.", "") in msg, f"{name}({dtype}): the message does not "
                          f"name the rejected dtype: {msg}")
    _still_in_step(chk, rumor, torch, n, "dtype errors")

    # Not a tensor.
    for bad in [[1.0, 2.0], np.ones(4, dtype=np.float32), None, 3, "tensor"]:
        for name, call in api.items():
            chk.raises(TypeError, lambda: call(bad), f"{name}({type(bad).__name__})")

    # Not on the CPU: a meta tensor (there is no GPU here) -> ValueError.
    for name, call in api.items():
        chk.raises(ValueError, lambda: call(torch.empty(4 * n, device="meta")), f"{name}(meta tensor)",
                   match="cpu")

    # Sparse -> TypeError.
    sparse = torch.eye(4 * n).to_sparse()
    for name, call in api.items():
        chk.raises(TypeError, lambda: call(sparse), f"{name}(sparse COO)")
    csr = torch.eye(4 * n).to_sparse_csr()
    chk.raises(TypeError, lambda: rumor.allreduce(csr), "allreduce(sparse CSR)")
    _still_in_step(chk, rumor, torch, n, "type/device/layout errors")

    # Bad root / src / dst: global ranks outside the world.
    x = torch.ones(5)
    for bad in [n, n + 3, -1]:
        chk.raises(ValueError, lambda: rumor.broadcast(x, bad), f"broadcast(root={bad})")
        chk.raises(ValueError, lambda: rumor.broadcast_(x.clone(), bad), f"broadcast_(root={bad})")
        chk.raises(ValueError, lambda: rumor.broadcast_nonblocking(x, bad), f"broadcast_nonblocking(root={bad})")
        chk.raises(ValueError, lambda: rumor.reduce(x, bad), f"reduce(root={bad})")
        chk.raises(ValueError, lambda: rumor.reduce_nonblocking(x, bad), f"reduce_nonblocking(root={bad})")
        chk.raises(ValueError, lambda: rumor.send(x, bad), f"send(dst={bad})")
        chk.raises(ValueError, lambda: rumor.recv(x.clone(), bad), f"recv(src={bad})")
    # Sending to / receiving from oneself.
    chk.raises(ValueError, lambda: rumor.send(x, r), "send to oneself")
    chk.raises(ValueError, lambda: rumor.recv(x.clone(), r), "recv from oneself")
    _still_in_step(chk, rumor, torch, n, "rank errors")

    # Bad reduce ops and algorithms.
    for bad in [7, -1, "SUM", None, 2.5]:
        chk.raises(ValueError, lambda: rumor.allreduce(x, bad), f"allreduce(op={bad!r})")
        chk.raises(ValueError, lambda: rumor.allreduce_(x.clone(), bad), f"allreduce_(op={bad!r})")
        chk.raises(ValueError, lambda: rumor.allreduce_nonblocking(x, bad), f"allreduce_nonblocking(op={bad!r})")
        chk.raises(ValueError, lambda: rumor.reduce(x, 0, bad), f"reduce(op={bad!r})")
        chk.raises(ValueError, lambda: rumor.reduce_scatter(x, bad), f"reduce_scatter(op={bad!r})")
    chk.raises(ValueError, lambda: rumor.allreduce(x, algorithm="tree"), "allreduce(algorithm='tree')")
    chk.raises(ValueError, lambda: rumor.allreduce_(x.clone(), algorithm="butterfly"), "allreduce_(algorithm=...)")
    chk.raises(TypeError, lambda: rumor.allreduce(x, group="world"), "allreduce(group='world')")
    chk.raises(TypeError, lambda: rumor.allreduce(x, group=[0, 1]), "allreduce(group=[0, 1])")
    _still_in_step(chk, rumor, torch, n, "op errors")

    # alltoall splits.
    t = torch.arange(4.0 * n)
    bad_splits = [[4 * n] + [0] * (n - 2)] if n > 1 else []
    bad_splits += [[1] * (n + 1), [4 * n + 1] + [0] * (n - 1), [-1, 4 * n + 1] + [0] * (n - 2) if n > 1 else [-1],
                   [0] * n]
    for s in bad_splits:
        chk.raises(ValueError, lambda: rumor.alltoall(t, s), f"alltoall(splits={s})", match="splits")
        chk.raises(ValueError, lambda: rumor.alltoall_nonblocking(t, s), f"alltoall_nonblocking(splits={s})")
    if n > 1:
        chk.raises(ValueError, lambda: rumor.alltoall(torch.arange(4.0 * n + 1)), "alltoall(rows % n != 0)")
    chk.raises(ValueError, lambda: rumor.alltoall(torch.tensor(3.0)), "alltoall(0-dim)")
    chk.raises(ValueError, lambda: rumor.reduce_scatter(torch.tensor(3.0)), "reduce_scatter(0-dim)")
    chk.raises(ValueError, lambda: rumor.allgather(torch.zeros([1] * 9)), "allgather(9 dims)")
    _still_in_step(chk, rumor, torch, n, "split errors")

    # out= of the wrong shape, dtype or layout (the same on every rank, so all raise alike).
    y = torch.ones(2, 3)
    for what, bad_out in [("shape", torch.empty(2 * n + 1, 3)), ("dtype", torch.empty(2 * n, 3, dtype=torch.float64)),
                          ("layout", torch.empty(3, 2 * n).t())]:
        chk.raises(ValueError, lambda: rumor.allgather(y, out=bad_out), f"allgather(out= bad {what})", match="out")
    rows = [2 * n // n + (1 if q < (2 * n) % n else 0) for q in range(n)][r]
    for what, bad_out in [("shape", torch.empty(rows + 1, 3)), ("dtype", torch.empty(rows, 3, dtype=torch.int32)),
                          ("layout", torch.empty(3, rows).t() if rows > 1 else torch.empty(rows, 6)[:, ::2])]:
        chk.raises(ValueError, lambda: rumor.reduce_scatter(torch.ones(2 * n, 3), out=bad_out),
                   f"reduce_scatter(out= bad {what})", match="out")
    chk.raises((TypeError, ValueError), lambda: rumor.allgather(y, out=[0] * 6), "allgather(out=list)")
    _still_in_step(chk, rumor, torch, n, "out= errors")

    # new_group arguments.
    chk.raises(ValueError, lambda: rumor.new_group([]), "new_group([])")
    chk.raises(ValueError, lambda: rumor.new_group([0, 0]), "new_group([0, 0])")
    chk.raises(ValueError, lambda: rumor.new_group([0, n]), f"new_group([0, {n}])")
    chk.raises(ValueError, lambda: rumor.new_group([-1]), "new_group([-1])")

    if n > 1:
        # allgather with trailing dims that differ across ranks: ValueError on every rank.
        y = torch.zeros(3, 4 + (r == n - 1))
        e = chk.raises(ValueError, lambda: rumor.allgather(y), "allgather with mismatched trailing dims",
                       match="dims")
        chk.raises(ValueError, lambda: rumor.allgather_nonblocking(y), "allgather_nonblocking, mismatched dims")
        y = torch.zeros(3, 4) if r else torch.zeros(3, 2, 2)
        chk.raises(ValueError, lambda: rumor.allgather(y), "allgather with a different number of dims")
        # ... and with a dtype that differs across ranks.
        y = torch.zeros(3, dtype=torch.float32 if r else torch.float64)
        chk.raises((TypeError, ValueError), lambda: rumor.allgather(y), "allgather with mismatched dtypes")
        _still_in_step(chk, rumor, torch, n, "allgather shape errors")
        # Only the first dim may differ (and be zero).
        z = torch.full((r, 2), float(r))
        chk.equal(rumor.allgather(z), torch.cat([torch.full((q, 2), float(q)) for q in range(n)]),
                  "allgather with a 0-row rank after the errors")
    rumor.barrier()
    return chk.failures, chk.count


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_argument_errors(world_size):
    res = harness.run(argument_errors_rank, world_size, timeout=120)
    harness.assert_no_failures(res)


# ---- mismatches between ranks ------------------------------------------------------------------

def _expect_rumor_error(chk, rumor, what, call):
    """call() must raise a rumor.RumorError; then the broken communicator refuses further work
    (with a RumorError too) instead of hanging."""
    e = chk.raises(rumor.RumorError, call, what)
    if isinstance(e, rumor.RumorError):
        chk.raises(rumor.RumorError, lambda: rumor.barrier(), f"{what}: the next op on the broken world")
    return type(e).__name__ if e is not None else None


def mismatch_rank(cases, sync_dir):
    """Runs the named cases in order, each followed by a new world; returns {case: (failures, count)}."""
    import torch

    import rumor

    rumor.init()
    chk = Checker()
    kinds, out = {}, {}
    for case in cases:
        f0, c0 = len(chk.failures), chk.count
        # Every rank must have returned from init() before any of them starts the failing op:
        # a rank that aborts makes a peer still finishing the previous op (init's barrier) fail
        # there instead (shared memory: the abort flag wins over data already in the ring).
        harness.file_barrier(sync_dir, f"{case}-start")
        kinds[case] = _mismatch_case(chk, rumor, torch, case)
        # The process can leave the broken job and join a new one (re-init after shutdown).
        rumor.shutdown()
        # Ranks fail at different moments. Without this, a rank may start its next init() while
        # rank 0 still holds the TCPStore server of the previous init(), connect to it, and
        # lose the connection when rank 0's init() returns and drops that server (a library
        # race, seen here as DistNetworkError "Failed to recv, got 0 bytes" in init()).
        harness.file_barrier(sync_dir, case)
        rumor.init()
        n, r = rumor.size(), rumor.rank()
        chk.equal(rumor.allreduce(torch.full((7,), float(r)), rumor.ReduceOp.SUM),
                  torch.full((7,), float(sum(range(n)))), f"{case}: allreduce after shutdown() and a new init()")
        out[case] = (chk.failures[f0:], chk.count - c0)
    rumor.barrier()
    return out


def _mismatch_case(chk, rumor, torch, case):
    n, r = rumor.size(), rumor.rank()
    kinds = []
    if case == "small sizes":      # recursive doubling
        kinds.append(_expect_rumor_error(chk, rumor, case, lambda: rumor.allreduce(torch.ones(10 + r))))
    elif case == "large sizes":    # ring; one rank has one element more
        kinds.append(_expect_rumor_error(
            chk, rumor, case, lambda: rumor.allreduce(torch.ones(300000 + (r == n - 1)), rumor.ReduceOp.SUM)))
    elif case == "dtype":           # same element count, different element size
        kinds.append(_expect_rumor_error(
            chk, rumor, case, lambda: rumor.allreduce(torch.ones(64, dtype=torch.float64 if r == 0 else torch.float32))))
    elif case == "allgather out= dtype":
        # out= sized for equal blocks: on one host with shared memory the shapes are not gathered
        # first and the shared slots refuse the dtypes (same element size, so the sizes agree);
        # elsewhere the shape round raises TypeError. Either way every rank raises, and nothing of
        # another rank reaches out (its own block may already hold its input: the gather is in place).
        y = torch.ones(3, dtype=torch.float32 if r == 0 else torch.int32)
        out = torch.full((3 * n,), 7, dtype=y.dtype)
        e = chk.raises((rumor.RumorError, TypeError), lambda: rumor.allgather(y, out=out), case)
        others = torch.cat([out[: 3 * r], out[3 * r + 3:]])
        chk.equal(others, torch.full((3 * n - 3,), 7, dtype=y.dtype), f"{case}: the other ranks' blocks untouched")
        kinds.append(type(e).__name__ if e is not None else None)
    elif case == "different collectives":
        calls = [lambda: rumor.allreduce(torch.ones(100)), lambda: rumor.reduce_scatter(torch.ones(100)),
                 lambda: rumor.allreduce(torch.ones(100))]
        kinds.append(_expect_rumor_error(chk, rumor, case, calls[r % len(calls)]))
    elif case == "broadcast sizes":
        # Every receiver must notice; the root only sends, so it cannot know and may return.
        call = lambda: rumor.broadcast(torch.ones(1000 * (r + 1)), 0)  # noqa: E731
        if r != 0:
            kinds.append(_expect_rumor_error(chk, rumor, case, call))
        else:
            try:
                call()
            except rumor.RumorError:
                pass
    elif case == "recv size":
        # The receiver expects more than is sent: it must raise (the sender may well succeed).
        if r == 0:
            try:
                rumor.send(torch.ones(10), 1)
            except rumor.RumorError:
                pass
        elif r == 1:
            kinds.append(_expect_rumor_error(chk, rumor, case, lambda: rumor.recv(torch.empty(20), 0)))
    else:
        raise ValueError(case)
    return kinds


MISMATCHES = ["small sizes", "large sizes", "dtype", "allgather out= dtype", "different collectives", "broadcast sizes",
              "recv size"]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("case", MISMATCHES, ids=[c.replace(" ", "_") for c in MISMATCHES])
def test_mismatch_between_ranks_raises_everywhere(transport, case, request, batches):
    """Sizes, dtypes or collectives that differ between ranks: every rank raises a RumorError
    (ProtocolError / PeerError, or at worst CommTimeoutError) within the deadline; none hangs,
    none returns garbage. After each case every rank shuts down and joins a fresh world. The
    selected cases of one transport run in one launch."""
    def launch():
        env = {"RUMOR_TIMEOUT": "15"}
        if transport == "tcp":
            env["RUMOR_SHM"] = "0"
        with tempfile.TemporaryDirectory() as d:
            return harness.run(mismatch_rank, 3, timeout=150, env=env, args=(harness.selected(request, "case"), d))

    res = harness.batch(batches, ("mismatch", transport), launch)
    assert harness.assert_no_failures(harness.scenario_results(res, case), f"{transport}: {case}") > 0


def empty_on_one_rank_rank(op: str):
    import torch

    import rumor

    rumor.init()
    r = rumor.rank()
    chk = Checker()
    x = torch.ones(0 if r == 0 else 5)
    call = {"allreduce": lambda: rumor.allreduce(x), "reduce": lambda: rumor.reduce(x, 1)}[op]
    chk.raises(rumor.RumorError, call, f"{op} with {x.numel()} elements on rank {r}")
    return chk.failures, chk.count


@pytest.mark.parametrize("op", ["allreduce", "reduce"])
def test_empty_tensor_on_one_rank_raises_everywhere(op):
    """One rank passes an empty tensor, the other 5 elements: a size mismatch like any other,
    so every rank, the one with the empty tensor included, must raise a RumorError."""
    res = harness.run(empty_on_one_rank_rank, 2, timeout=60, env={"RUMOR_TIMEOUT": "10"}, args=(op,))
    harness.assert_no_failures(res, op)


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "4k"])
def test_bad_stripe_threshold_is_refused_by_init(value):
    """RUMOR_STRIPE_MIN_BYTES that is not a byte count fails rumor.init() naming the variable."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, RUMOR_STRIPE_MIN_BYTES=value, WORLD_SIZE="1", RANK="0")
    p = subprocess.run([sys.executable, "-c", "import rumor; rumor.init()"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0
    assert "ValueError" in p.stderr and "RUMOR_STRIPE_MIN_BYTES" in p.stderr and repr(value) in p.stderr


def test_empty_stripe_threshold_means_the_default():
    """An empty RUMOR_* variable is the same as an unset one (docs/environment.md)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, RUMOR_STRIPE_MIN_BYTES="", WORLD_SIZE="1", RANK="0")
    p = subprocess.run([sys.executable, "-c", "import rumor; rumor.init(); rumor.shutdown()"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
