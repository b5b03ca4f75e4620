"""rumor.gpu.watch: the deadline of blocking NCCL calls that return once queued
(rumor.set_gpu_wait("stream"); docs/gpu.md, "Streams and waiting").

The watch only needs events with query() and a communicator with check() and abort(), so it is
checked here without a GPU: with scripted events and communicators, and (when the C++ tests are
built without sanitizers) with the extension's NcclCommunicator over the fake libnccl, whose
"streams" are integers (fakeNcclStreamIdle plays cudaEventQuery). The same watch on a GPU:
tests/python/test_cuda_collectives.py."""
from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest

import harness
import nccl_fakes
from rumor import _runtime
from rumor.gpu import watch as gpu_watch
from rumor.errors import AbortedError, CommTimeoutError, PeerError, RumorError

FAST = dict(min_pause=0.001, max_pause=0.004)


class Event:
    """An event that passes when the test says so; counts how often it was asked."""

    def __init__(self, passed: bool = False):
        self.passed, self.queries = passed, 0

    def query(self) -> bool:
        self.queries += 1
        return self.passed


class Comm:
    def __init__(self):
        self.checks, self.aborts = [], 0
        self.async_error = None

    def check(self, op: str) -> None:
        self.checks.append(op)
        if self.async_error is not None:
            raise self.async_error

    def abort(self) -> None:
        self.aborts += 1


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_mode_setting():
    assert _runtime.gpu_wait_mode(None, "x") == "host"
    assert _runtime.gpu_wait_mode("", "x") == "host"
    assert _runtime.gpu_wait_mode(" Stream ", "x") == "stream"
    assert _runtime.gpu_wait_mode("host", "x") == "host"
    with pytest.raises(ValueError, match=r"RUMOR_GPU_WAIT: expected one of host, stream, got 'sync'"):
        _runtime.gpu_wait_mode("sync", "RUMOR_GPU_WAIT")


def test_passed_events_are_retired_and_nothing_is_aborted():
    comm = Comm()
    w = gpu_watch.StreamWatch(comm, "group 0", **FAST)
    try:
        evs = [Event() for _ in range(5)]
        for i, ev in enumerate(evs):
            w.add(i % 2, ev, 30.0, f"allreduce #{i}")
        assert w.pending() == 5
        _until(lambda: len(comm.checks) >= 2)  # the watch looks while ops are pending
        assert w.pending() == 5 and w.error is None
        for ev in evs[:3]:
            ev.passed = True
        _until(lambda: w.pending() == 2)
        for ev in evs[3:]:
            ev.passed = True
        w.drain(5.0, "test")
        assert w.pending() == 0 and w.error is None and comm.aborts == 0
        w.raise_error("next op")  # nothing to raise
        # The thread sleeps while nothing is pending, and a new op wakes it.
        checks = len(comm.checks)
        time.sleep(0.05)
        assert len(comm.checks) == checks
        ev = Event()
        w.add(0, ev, 30.0, "broadcast")
        _until(lambda: len(comm.checks) > checks)
        ev.passed = True
        w.drain(5.0, "test")
    finally:
        w.close()


def test_an_op_past_its_deadline_aborts_and_the_next_call_raises():
    comm = Comm()
    w = gpu_watch.StreamWatch(comm, "rumor.Group(id=0, ranks=[0, 1]) on cuda:0", **FAST)
    try:
        w.add(7, Event(passed=True), 30.0, "allreduce of 8 float32")
        w.add(7, Event(), 0.05, "allreduce of 1024 float32")
        _until(lambda: w.error is not None)  # kept once the communicator was aborted
        err = w.error
        assert isinstance(err, CommTimeoutError)
        assert "allreduce of 1024 float32: not finished on the GPU" in str(err)
        assert "communicator of rumor.Group(id=0, ranks=[0, 1]) on cuda:0 was aborted" in str(err)
        assert comm.aborts == 1 and w.pending() == 0
        with pytest.raises(CommTimeoutError, match=r"^broadcast: an earlier op queued on the GPU failed: "
                           r"allreduce of 1024 float32: not finished"):
            w.raise_error("broadcast")
        with pytest.raises(CommTimeoutError, match="allreduce of 1024 float32"):
            w.drain(1.0, "shutdown")
        assert comm.aborts == 1  # once
    finally:
        w.close()


def test_a_younger_op_with_a_sooner_deadline_expires_first():
    # rumor.set_timeout() lowered between two calls: the second op's deadline comes first, and
    # it is the one reported, while the older one (with its long deadline) still runs.
    comm = Comm()
    w = gpu_watch.StreamWatch(comm, "group", **FAST)
    try:
        older, younger, newest = Event(), Event(), Event()
        w.add("s", older, 60.0, "allreduce A")
        w.add("s", younger, 0.05, "allreduce B")
        w.add("s", newest, 60.0, "allreduce C")
        _until(lambda: w.error is not None)
        assert str(w.error).startswith("allreduce B: not finished on the GPU"), str(w.error)
        assert comm.aborts == 1 and w.pending() == 0
    finally:
        w.close()
    # Once the op with the sooner deadline passed, the others keep their own (A and B have
    # passed when they are handed over: a look retires them before it reads any deadline, so
    # B's is never the one reported, however late the look comes).
    comm = Comm()
    w = gpu_watch.StreamWatch(comm, "group", **FAST)
    try:
        for passed, timeout, name in zip((True, True, False, False), (60.0, 0.05, 60.0, 0.5), "ABCD"):
            w.add("s", Event(passed=passed), timeout, f"op {name}")
        _until(lambda: w.error is not None)
        assert str(w.error).startswith("op D: not finished on the GPU"), str(w.error)
    finally:
        w.close()


def test_an_nccl_error_is_kept_with_its_type():
    comm = Comm()
    w = gpu_watch.StreamWatch(comm, "group", **FAST)
    try:
        w.add(1, Event(), 30.0, "reduce_scatter")
        _until(lambda: comm.checks)
        assert comm.checks[-1] == "reduce_scatter"  # the check names the oldest pending op
        comm.async_error = PeerError("reduce_scatter: NCCL reported an asynchronous error: remote process exited")
        _until(lambda: w.error is not None)
        assert comm.aborts == 1
        with pytest.raises(PeerError, match="^allgather: an earlier op .*remote process exited"):
            w.raise_error("allgather")
    finally:
        w.close()


def test_a_stream_costs_two_queries_a_look_however_many_ops_it_has():
    comm = Comm()
    w = gpu_watch.StreamWatch(comm, "group", **FAST)
    try:
        evs = [Event() for _ in range(100)]
        for ev in evs:
            w.add("s", ev, 30.0, "allreduce")
        _until(lambda: evs[-1].queries >= 3)
        assert evs[0].queries >= 3
        assert all(ev.queries == 0 for ev in evs[1:-1])
        evs[-1].passed = True  # events of one stream pass in order: the newest retires them all
        _until(lambda: w.pending() == 0)
        assert all(ev.queries == 0 for ev in evs[1:-1])
    finally:
        w.close()


class _PassesWhenAsked(Event):
    """The newest event of a stream, which passes right after its first query: the older ones
    are then asked next and every one of them has passed."""

    def query(self) -> bool:
        self.queries += 1
        passed, self.passed = self.passed, True
        return passed


def test_the_newest_op_passing_during_a_look_retires_the_whole_stream():
    # The queue emptied inside the look raised IndexError in the watch thread, which aborted the
    # communicator (CI, 2026-11-29: "deque index out of range" over the fake NCCL).
    comm = Comm()
    recycled = []
    w = gpu_watch.StreamWatch(comm, "group", recycle=recycled.append, **FAST)
    try:
        older = [Event(passed=True) for _ in range(3)]
        newest = _PassesWhenAsked()
        for ev in older:
            w.add("s", ev, 30.0, "allreduce")
        w.add("s", newest, 30.0, "allreduce")
        _until(lambda: w.pending() == 0)
        w.add("s", Event(passed=True), 30.0, "broadcast")  # the stream's key is usable again
        _until(lambda: w.pending() == 0)
        assert w.error is None and comm.aborts == 0
        assert recycled[:4] == older + [newest] and len(recycled) == 5
    finally:
        w.close()


def test_drain_has_a_deadline_of_its_own():
    comm = Comm()
    w = gpu_watch.StreamWatch(comm, "group 3", **FAST)
    try:
        w.add(0, Event(), 60.0, "send")
        w.add(1, Event(), 60.0, "recv")
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError, match=r"^shutdown: send and 1 more, queued on the GPU by group 3, did not "
                           r"finish within 0.1 s$"):
            w.drain(0.1, "shutdown")
        assert time.monotonic() - t0 < 5.0
        assert w.error is None and comm.aborts == 0  # the ops' own deadlines have not passed
    finally:
        w.close()
    # Both deadlines alike (rumor.synchronize() right after a call, the same timeout): the op's
    # own error is reported, the communicator aborted, not drain's less precise one.
    for _ in range(5):
        comm = Comm()
        w = gpu_watch.StreamWatch(comm, "group 4", **FAST)
        try:
            w.add(0, Event(), 0.05, "allreduce")
            with pytest.raises(CommTimeoutError, match="^synchronize: an earlier op .*allreduce: not finished on the GPU"):
                w.drain(0.05, "synchronize")
            assert comm.aborts == 1
        finally:
            w.close()


def test_close_stops_the_thread_and_refuses_new_ops():
    before = {t.ident for t in threading.enumerate()}
    w = gpu_watch.StreamWatch(Comm(), "group", **FAST)
    w.add(0, Event(), 30.0, "allreduce")
    threads = [t for t in threading.enumerate() if t.ident not in before and t.name == "rumor-gpu-watch"]
    assert len(threads) == 1
    w.close()
    assert not threads[0].is_alive()
    with pytest.raises(RumorError, match="allreduce: the group's GPU watch is closed"):
        w.add(0, Event(), 30.0, "allreduce")


class _SlowAbortComm(Comm):
    """NCCL's abort ends the kernels at once and returns later: meanwhile a synchronize has
    returned and the caller's next call finds the communicator aborted."""

    def __init__(self):
        super().__init__()
        self.aborting, self.release = threading.Event(), threading.Event()

    def abort(self) -> None:
        super().abort()
        self.aborting.set()
        assert self.release.wait(30.0)


def test_a_call_made_while_the_abort_runs_raises_the_reason():
    # On the H200 (2026-11-29) the call after the synchronize raised "the NCCL communicator is no
    # longer usable (abort() was called)" without the op that had passed its deadline.
    comm = _SlowAbortComm()
    w = gpu_watch.StreamWatch(comm, "group", **FAST)
    try:
        w.add(0, Event(), 0.05, "allreduce of 8 float32")
        assert comm.aborting.wait(10.0)
        assert w.error is None  # kept only once the abort returned (drain and close wait for it)
        with pytest.raises(CommTimeoutError, match=r"^broadcast: an earlier op queued on the GPU failed: "
                           r"allreduce of 8 float32: not finished"):
            w.raise_error("broadcast")
        comm.release.set()
        _until(lambda: w.error is not None)
        assert comm.aborts == 1
    finally:
        comm.release.set()
        w.close()


def test_a_failing_abort_still_keeps_the_error():
    class BadAbort(Comm):
        def abort(self):
            super().abort()
            raise RuntimeError("abort failed")

    comm = BadAbort()
    w = gpu_watch.StreamWatch(comm, "group", **FAST)
    try:
        w.add(0, Event(), 0.01, "allreduce")
        _until(lambda: w.error is not None)
        assert isinstance(w.error, CommTimeoutError) and comm.aborts == 1
    finally:
        w.close()


# ---- over the extension's NcclCommunicator and the fake libnccl -------------------------------

def test_the_watch_aborts_a_hung_op_of_a_real_communicator(monkeypatch):
    C = nccl_fakes.ext()
    import numpy as np

    from rumor.gpu import nccl

    fake = nccl_fakes.fake_path()
    monkeypatch.setenv("RUMOR_NCCL_LIBRARY", fake)
    monkeypatch.setenv("RUMOR_FAKE_NCCL_HANG", "allreduce")
    lib = nccl.load()
    idle = ctypes.CDLL(fake).fakeNcclStreamIdle
    idle.argtypes = [ctypes.c_void_p]

    class StreamEvent:
        def __init__(self, stream):
            self.stream = stream

        def query(self):
            return bool(idle(self.stream))

    comm = C.NcclCommunicator(lib, lib.unique_id(), 1, 0, 30.0)
    w = gpu_watch.StreamWatch(comm, "group", **FAST)
    try:
        x = np.arange(8, dtype=np.float32)
        y = np.zeros(8, dtype=np.float32)
        b = np.arange(4, dtype=np.float32)
        comm.broadcast(b.ctypes.data, b.ctypes.data, 4, 0, 0, 0x10)  # float32, root 0: completes
        w.add(0x10, StreamEvent(0x10), 30.0, "broadcast")
        comm.allreduce(x.ctypes.data, y.ctypes.data, 8, 0, 0, 0x20)  # hangs (RUMOR_FAKE_NCCL_HANG)
        w.add(0x20, StreamEvent(0x20), 0.2, "allreduce of 8 float32")
        with pytest.raises(CommTimeoutError, match="allreduce of 8 float32: not finished on the GPU"):
            w.drain(10.0, "test")
        assert comm.aborted
        with pytest.raises(AbortedError, match="no longer usable"):
            comm.broadcast(b.ctypes.data, b.ctypes.data, 4, 0, 0, 0x10)
    finally:
        w.close()
        comm.abort()


# ---- the setting -------------------------------------------------------------------------------

def _settings_rank():
    import rumor

    out = [rumor.get_gpu_wait()]
    rumor.set_gpu_wait("stream")
    out.append(rumor.get_gpu_wait())
    errors = []
    for bad in ("Host ", "blocking", 3, None):
        try:
            rumor.set_gpu_wait(bad)
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    out.append(rumor.get_gpu_wait())
    out.append(errors)
    sync = [rumor.synchronize()]  # nothing queued on a GPU: returns at once
    for kw in ({"timeout": 0}, {"timeout": "1"}, {"handle": 3}):
        try:
            rumor.synchronize(**kw)
        except (TypeError, ValueError) as e:
            sync.append(f"{type(e).__name__}: {e}")
    out.append(sync)
    return out


def _init_rank(kwargs):
    import rumor

    try:
        rumor.init(**kwargs)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    try:
        return rumor.get_gpu_wait()
    finally:
        rumor.shutdown()


def _settings_after_init():
    import rumor

    rumor.init()
    try:
        return _settings_rank()
    finally:
        rumor.shutdown()


def test_set_gpu_wait_and_its_errors():
    (r,) = harness.run(_settings_after_init, 1, timeout=60)
    assert r[:3] == ["host", "stream", "host"], r
    assert r[3][0] == "ValueError: rumor.set_gpu_wait(): expected one of host, stream, got 'blocking'"
    assert r[3][1].startswith("TypeError: rumor.set_gpu_wait(): mode must be a str, got int")
    assert r[3][2].startswith("TypeError: rumor.set_gpu_wait(): mode must be a str, got NoneType")
    assert len(r[3]) == 3
    assert r[4] == [None, "ValueError: rumor.synchronize(): timeout must be positive, got 0.0",
                    "TypeError: rumor.synchronize(): timeout must be a number of seconds, got str",
                    "TypeError: rumor.synchronize(): expected a handle or nothing, got int"], r[4]


@pytest.mark.parametrize("kwargs, env, want", [
    ({}, {}, "host"),
    ({}, {"RUMOR_GPU_WAIT": "stream"}, "stream"),
    ({"gpu_wait": "host"}, {"RUMOR_GPU_WAIT": "stream"}, "host"),
    ({}, {"RUMOR_GPU_WAIT": "later"}, "ValueError: rumor.init(): RUMOR_GPU_WAIT: expected one of host, stream, "
                                      "got 'later'"),
    ({"gpu_wait": 1}, {}, "TypeError: rumor.init(): gpu_wait must be a str, got int"),
])
def test_init_takes_the_setting_from_its_argument_or_the_environment(kwargs, env, want):
    (r,) = harness.run(_init_rank, 1, timeout=60, env=env, args=(kwargs,))
    assert r == want


# ---- the collectives' NCCL path over the fake libnccl -------------------------------------------
# rumor.gpu.collectives on CPU tensors: the fake works on host memory, and torch.cuda's streams
# and events are played by the fake's (an event passes once its stream is idle). This checks
# rumor's side of the path (ordering, results, the two wait modes, the watch); what CUDA itself
# does is checked on a GPU (test_cuda_collectives.py).

def _collectives_on_the_fake(fake: str):
    import torch

    import rumor
    from rumor import _C, _runtime
    from rumor.gpu import routing
    from rumor.gpu import collectives as gpu_collectives
    from rumor.gpu import nccl
    from rumor.errors import CommTimeoutError

    recorded = nccl_fakes.fake_cuda(fake)
    rumor.init(timeout=30)
    out = {}
    try:
        lib = nccl.load()
        g = _runtime.state().world

        class HostGroup(routing.GpuGroup):
            torch_device = torch.device("cpu")  # the fake's "device memory" is host memory

        def group(hang: bool):
            os.environ["RUMOR_FAKE_NCCL_HANG"] = "allreduce" if hang else ""
            gpu = HostGroup(0)
            gpu.transport = "nccl"
            gpu.comm = _C.NcclCommunicator(lib, lib.unique_id(), 1, 0, 30.0)
            gpu.watch = gpu_watch.StreamWatch(gpu.comm, "fake group", min_pause=0.001, max_pause=0.004)
            g._gpu = gpu  # rumor.synchronize() and shutdown() find it there
            return gpu

        for mode in ("host", "stream"):
            rumor.set_gpu_wait(mode)
            gpu = group(hang=False)
            x = torch.arange(12.0).reshape(3, 4)
            y = gpu_collectives.allreduce(gpu, g, x, rumor.ReduceOp.SUM, None, False, False, "auto", "allreduce")
            nc = torch.arange(12.0).reshape(3, 4).t()
            gpu_collectives.allreduce(gpu, g, nc, rumor.ReduceOp.SUM, None, True, False, "auto", "allreduce_")
            b = gpu_collectives.broadcast(gpu, g, torch.arange(5), 0, None, False, False, "broadcast")
            h = gpu_collectives.allreduce(gpu, g, torch.ones(3), rumor.ReduceOp.SUM, None, False, True, "auto",
                                           "allreduce_nonblocking")
            hv = h.wait()
            pending = gpu.watch.pending()
            synced = rumor.synchronize(timeout=10.0)
            left = gpu.watch.pending()
            out[mode] = dict(y=y.tolist(), nc=nc.tolist(), nc_contig=nc.is_contiguous(), b=b.tolist(), h=hv.tolist(),
                             watched=pending, left=left, synced=synced, recorded=len(recorded))
            recorded.clear()
            g._gpu = None
            gpu.close()

            # An allreduce that never finishes, with a 0.3 s deadline.
            rumor.set_timeout(0.3)
            gpu = group(hang=True)
            t0 = time.monotonic()
            try:
                gpu_collectives.allreduce(gpu, g, torch.ones(4), rumor.ReduceOp.SUM, None, True, False, "auto",
                                           "rumor.allreduce_")
                first = "returned"
            except CommTimeoutError as e:
                first = "CommTimeoutError: " + str(e)
            returned_after = time.monotonic() - t0
            try:
                rumor.synchronize()
                drained = "nothing"
            except CommTimeoutError as e:
                drained = "CommTimeoutError: " + str(e)
            try:
                gpu_collectives.broadcast(gpu, g, torch.ones(2), 0, None, True, False, "rumor.broadcast_")
                second = "returned"
            except Exception as e:  # noqa: BLE001
                second = f"{type(e).__name__}: {e}"
            out[mode + "_hang"] = dict(first=first, returned_after=returned_after, drained=drained, second=second,
                                       aborted=gpu.comm.aborted)
            rumor.set_timeout(30)
            g._gpu = None
            try:
                gpu.close(1.0)
            except Exception:  # noqa: BLE001 - the hung op's error again
                pass
    finally:
        rumor.shutdown()
    return out


def test_the_collectives_nccl_path_over_the_fake_in_both_wait_modes():
    nccl_fakes.ext()
    fake = nccl_fakes.fake_path()
    (r,) = harness.run(_collectives_on_the_fake, 1, timeout=120, env={"RUMOR_NCCL_LIBRARY": fake}, args=(fake,))
    want = dict(y=[[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]],
                nc=[[0.0, 4.0, 8.0], [1.0, 5.0, 9.0], [2.0, 6.0, 10.0], [3.0, 7.0, 11.0]], nc_contig=False,
                b=[0, 1, 2, 3, 4], h=[1.0, 1.0, 1.0])
    for mode in ("host", "stream"):
        got = {k: v for k, v in r[mode].items() if k in want}
        assert got == want, (mode, r[mode])
    # host: every blocking call waited, nothing was left to the watch, and only the nonblocking
    # call's tensors were record_stream'ed; stream: the three blocking calls went to the watch.
    assert r["host"]["watched"] == 0 and r["host"]["recorded"] == 1, r["host"]
    assert r["stream"]["recorded"] >= 4, r["stream"]
    for mode in ("host", "stream"):  # rumor.synchronize() leaves nothing pending
        assert r[mode]["synced"] is None and r[mode]["left"] == 0, r[mode]
    host, stream = r["host_hang"], r["stream_hang"]
    assert host["first"].startswith("CommTimeoutError: ") and "rumor.allreduce_" in host["first"], host
    assert host["drained"] == "nothing" and host["aborted"], host  # the call raised it already
    assert host["second"].startswith("AbortedError"), host
    assert stream["first"] == "returned" and stream["returned_after"] < 0.3, stream
    assert "rumor.allreduce_: not finished on the GPU" in stream["drained"], stream
    assert stream["aborted"], stream
    assert stream["second"].startswith("CommTimeoutError: rumor.broadcast_: an earlier op queued on the GPU failed: "
                                       "rumor.allreduce_: not finished on the GPU"), stream
