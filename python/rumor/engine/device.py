"""DistributedDataParallel's bucket engine for parameters on a CUDA device (docs/gpu.md,
"DistributedDataParallel on CUDA"). It stands in for rumor._C.BucketEngine with the same calls
(set_buckets, mark_ready, launch_all, finish, idle, last_timings), so the wrapper keeps its
hooks, bucket plans and error handling.

Buckets are flat tensors on the device and each .grad is a view into one, as on CPU. When a
bucket's last gradient arrives, the autograd thread records an event on its current stream and
the bucket is launched, in order, on a communication stream that first waits for that event: by
the autograd thread itself when its op only queues GPU work and the worker has nothing queued or
running, else by the engine's worker thread. finish() (at the end of backward) waits until every
bucket is launched, then makes the caller's current stream wait for the communication stream's
last event: the host never waits for the GPU there. Two modes:

- direct (NCCL): each bucket's op (rumor.engine.ops) is queued on the communication stream. The
  worker then watches each bucket's event with rumor's deadline and NCCL's error state; a dead
  peer or a deadline aborts the communicator, which ends its kernels, and the next call on the
  engine raises the error (so a job fails instead of hanging inside the GPU).
- staged (host transport, or an algorithm without device ops): the worker copies the bucket
  into page-locked host memory on the communication stream, waits for the copy (deadline), and
  hands it to a C++ BucketEngine running the algorithm's CPU op, exactly as for CPU
  parameters; finish() waits for those ops and queues the copies back on the current stream.

EMULATE ("direct" or "staged"; tests only) runs this engine for CPU parameters: streams and
events become no-ops and the direct ops use rumor's CPU collectives (engine.ops.HostTransport),
so everything here except the CUDA calls themselves runs, and is checked, on any machine.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import deque
from typing import List, Optional

import torch

from .. import _C
from .._env import env_bool
from ..errors import CommTimeoutError, RumorError
from .._tensor import address, dtype_code

EMULATE: Optional[str] = None
MODES = ("direct", "staged")
# RUMOR_DEVICE_INLINE_LAUNCH=0 hands every direct bucket to the worker thread, as before inline
# launches existed: a switch to compare the two (benchmarks/gpu.py), not a tuning knob.
INLINE_LAUNCH = env_bool("RUMOR_DEVICE_INLINE_LAUNCH", True)


# ---- device layers -----------------------------------------------------------------------------

class CudaLayer:
    """Streams, events and page-locked memory of one CUDA device, through torch."""

    def __init__(self, device: torch.device):
        self.device = device

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def current(self):
        return torch.cuda.current_stream(self.device)

    def on(self, stream):
        return torch.cuda.stream(stream)

    def record(self, stream):
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def host_wait(self, event, timeout: float, what: str) -> None:
        from ..gpu.routing import wait_event

        wait_event(event, timeout, what)

    def pinned_like(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)


class _Done:
    """An event that has always passed (the emulated layer's work is done when queued)."""

    @staticmethod
    def query() -> bool:
        return True


class EmulatedLayer:
    """The layer for CPU tensors (EMULATE): no streams, every event already passed."""

    device = torch.device("cpu")

    def bind_thread(self) -> None:
        pass

    def new_stream(self):
        return None

    def current(self):
        return None

    def on(self, stream):
        return contextlib.nullcontext()

    def record(self, stream):
        return _Done()

    def wait(self, stream, event) -> None:
        pass

    def host_wait(self, event, timeout: float, what: str) -> None:
        pass

    def pinned_like(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.empty(flat.shape, dtype=flat.dtype)


# ---- the engine --------------------------------------------------------------------------------

_WHAT = "rumor.DistributedDataParallel"


class _Staged:
    """A staged bucket's op: the algorithm's CPU op on a page-locked copy of the bucket."""

    def __init__(self, pinned: torch.Tensor, host_op):
        self.pinned, self.host_op = pinned, host_op


class Ticket:
    """A task handed to the engine's worker (DeviceEngine.submit). wait() returns once the
    worker queued it on the communication stream and makes the caller's current stream wait for
    it; the host does not wait for the GPU."""

    def __init__(self, engine: "DeviceEngine", what: str):
        self._engine, self.what = engine, what
        self.launched = False
        self.done_event = None

    def wait(self, timeout: float) -> None:
        st = self._engine._state
        deadline = time.monotonic() + timeout
        with st.cv:
            while not self.launched and st.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(f"{self.what}: not launched within {timeout:.1f} s")
                st.cv.wait(left)
        self._engine._raise_error()
        if self.done_event is not None:
            st.layer.wait(st.layer.current(), self.done_event)


class _State:
    """Everything the worker thread touches. The engine object owns it; the thread holds only
    this (not the engine or the wrapper), so a dropped wrapper stops its thread."""

    def __init__(self, layer, mode: str, transport, host_engine, timeout_fn):
        self.layer, self.mode, self.transport = layer, mode, transport
        self.host_engine = host_engine
        self.timeout_fn = timeout_fn
        self.cv = threading.Condition()
        self.queue = deque()  # (bucket index, ready event, ready time)
        self.buckets: List[tuple] = []  # (flat, op)
        self.processed = 0  # buckets of this iteration the worker is done with
        self.error: Optional[BaseException] = None
        self.stop = False
        self.watch = deque()  # direct: (event, deadline, what) of launched buckets, oldest first
        self.last_event = None
        self.h2d_event = None  # staged: the copies back of the last iteration (pinned reuse)
        self.timings = []
        self.stream = layer.new_stream()
        self.after: List = []  # per bucket: a callable run right after its op (overlap_optimizer)
        self.pause = 0.002  # the worker's next pause between looks at launched buckets
        self.busy = False  # the worker is running an item it took off the queue


_MIN_PAUSE, _MAX_PAUSE = 0.002, 0.02  # the worker's pauses between looks at launched buckets


def _worker(state: _State) -> None:
    state.layer.bind_thread()
    while True:
        with state.cv:
            while not state.queue and not state.stop:
                if state.watch and state.error is None:
                    # Launched buckets to watch: look again soon, or at once when a bucket
                    # comes. Each look takes the GIL from the training thread, so the pause
                    # grows while nothing finishes (2 ms up to 20 ms: deadlines are seconds).
                    state.cv.wait(state.pause)
                    state.pause = min(state.pause * 2, _MAX_PAUSE)
                    break
                state.pause = _MIN_PAUSE
                state.cv.wait()
            if state.stop and not state.queue:
                return
            item = state.queue.popleft() if state.queue else None
            state.busy = item is not None
        try:
            if state.error is None:
                _poll_watch(state)
                if isinstance(item, tuple) and isinstance(item[0], Ticket):
                    _run_task(state, *item)
                elif item is not None:
                    _launch(state, *item)
        except BaseException as e:  # noqa: BLE001 - stored, raised by the engine's next call
            _fail(state, e)
        if item is not None:
            with state.cv:
                state.busy = False
                if isinstance(item[0], Ticket):
                    item[0].launched = True
                else:
                    state.processed += 1
                state.cv.notify_all()


def _fail(state: _State, e: BaseException) -> None:
    with state.cv:
        if state.error is None:
            state.error = e
        state.watch.clear()
        state.cv.notify_all()
    abort = getattr(state.transport, "abort", None)
    if abort is not None:
        # The other buckets' kernels may wait for a peer that is gone: aborting ends them.
        abort()


def _poll_watch(state: _State) -> None:
    """Direct mode: retires the launched buckets whose event passed, checking NCCL's error
    state on the way; one past its deadline aborts the communicator."""
    check = getattr(getattr(state.transport, "comm", None), "check", None)
    while state.watch:
        event, deadline, what = state.watch[0]
        if check is not None:
            check(what)
        if event.query():
            state.watch.popleft()
            state.pause = _MIN_PAUSE
            continue
        if time.monotonic() > deadline:
            raise CommTimeoutError(f"{what}: not finished on the GPU within {state.timeout_fn():.1f} s (a peer "
                                   "is gone or stopped calling backward); the NCCL communicator was aborted")
        return


def _run_task(state: _State, ticket: Ticket, fn, ready_event) -> None:
    layer = state.layer
    with layer.on(state.stream):
        if ready_event is not None:
            layer.wait(state.stream, ready_event)
        fn(state.transport, state.stream)
        done = layer.record(state.stream)
    ticket.done_event = done
    if not isinstance(done, _Done):
        with state.cv:
            state.watch.append((done, time.monotonic() + state.timeout_fn(), ticket.what))
            state.cv.notify_all()  # the worker may be asleep with nothing to watch


def _launch(state: _State, bi: int, ready_event, ready: float) -> None:
    layer = state.layer
    flat, op = state.buckets[bi]
    what = f"{_WHAT}: bucket {bi} ({flat.numel()} elements)"
    if state.mode == "staged":
        if isinstance(op.host_op, _C.LocalBucketOp):  # nothing to communicate: nothing to copy
            state.host_engine.mark_ready(bi)
            return
        with layer.on(state.stream):
            layer.wait(state.stream, ready_event)
            if state.h2d_event is not None:
                layer.wait(state.stream, state.h2d_event)  # the last copy back still reads pinned
            op.pinned.copy_(flat, non_blocking=True)
            copied = layer.record(state.stream)
        layer.host_wait(copied, state.timeout_fn(), what + ": copying to host memory")
        state.host_engine.mark_ready(bi)
        return
    t0 = time.monotonic()
    after = state.after[bi] if bi < len(state.after) else None
    with layer.on(state.stream):
        layer.wait(state.stream, ready_event)
        op.run(flat, state.transport)
        if after is not None:  # the bucket's optimizer update, ordered after its communication
            after()
        done = layer.record(state.stream)
    t1 = time.monotonic()
    with state.cv:
        state.last_event = done
        state.timings.append((bi, flat.numel(), ready, t0, t1))
        if not isinstance(done, _Done):
            state.watch.append((done, t1 + state.timeout_fn(), what))
            if len(state.watch) == 1:
                state.cv.notify_all()  # a worker asleep with nothing to watch starts watching


def _launches_only(op, transport) -> bool:
    """Whether a direct bucket's op only queues work on the stream (never waits on the host)."""
    f = getattr(op, "launches_only", None)
    return bool(f is not None and f(transport))


class DeviceEngine:
    """See the module docstring. mode: "direct" or "staged"; transport: the direct ops'
    (engine.ops.NcclTransport or HostTransport); comm: the group's C++ communicator (staged)."""

    def __init__(self, layer, mode: str, transport, comm, timeout_fn):
        if mode not in MODES:
            raise ValueError(f"DeviceEngine: mode must be one of {MODES}, got {mode!r}")
        host = _C.BucketEngine(comm) if mode == "staged" else None
        self._state = _State(layer, mode, transport, host, timeout_fn)
        self._counts: List[int] = []
        self._slots: List[int] = []
        self._next = 0  # the next bucket to launch
        self._ready: List[bool] = []
        self._launched = 0
        self._last_timings = []
        self._thread = threading.Thread(target=_worker, args=(self._state,), name="rumor-ddp-device",
                                        daemon=True)
        self._thread.start()
        weakref.finalize(self, DeviceEngine._stop, self._state)

    @property
    def mode(self) -> str:
        return self._state.mode

    @property
    def layer(self):
        return self._state.layer

    @staticmethod
    def _stop(state: _State) -> None:
        with state.cv:
            state.stop = True
            state.cv.notify_all()

    def close(self) -> None:
        DeviceEngine._stop(self._state)

    def staged_op(self, flat: torch.Tensor, host_bucket_op):
        """The op of a staged bucket: host_bucket_op(pinned) is the algorithm's CPU op on the
        page-locked twin of `flat`."""
        pinned = self._state.layer.pinned_like(flat)
        return _Staged(pinned, host_bucket_op(pinned))

    def submit(self, fn, what: str, inline: bool, then=None) -> Ticket:
        """Runs fn(transport, stream) on the communication stream after the work queued so far
        on the caller's current stream (e.g. a weight exchange started before forward).
        inline: fn only queues work (NCCL calls, kernels) and runs right here, so its
        collectives take their place in this thread's order of calls on the group, the same
        on every rank; else (fn waits on the host, e.g. staging) the worker runs it, in order
        with the buckets. then: a second part for the worker after an inline fn (work that must
        wait on the host for fn's, e.g. decoding what fn received)."""
        self._raise_error()
        st = self._state
        ticket = Ticket(self, what)
        ev = st.layer.record(st.layer.current())
        if inline:
            try:
                _run_task(st, ticket, fn, ev)
            except BaseException as e:
                _fail(st, e)
                raise
            if then is None:
                ticket.launched = True
                return ticket
            fn, ev = then, None  # the worker's part: after fn on the same stream
        elif then is not None:
            raise ValueError("DeviceEngine.submit: then= goes with inline=True")
        with st.cv:
            st.queue.append((ticket, fn, ev))
            st.cv.notify_all()
        return ticket

    @property
    def transport(self):
        return self._state.transport

    @property
    def stream(self):
        return self._state.stream

    def _raise_error(self) -> None:
        err = self._state.error
        if err is not None:
            if isinstance(err, RumorError):
                raise type(err)(f"{err} (raised by an earlier bucket's communication; this wrapper cannot "
                                "go on: restart the job or rebuild the group)") from err
            raise RumorError(f"{_WHAT}: an earlier bucket's communication failed: {type(err).__name__}: "
                             f"{err}") from err

    def set_buckets(self, specs) -> None:
        """[(flat tensor, elements, dtype code, parameters, op)], between iterations only."""
        if not self.idle():
            raise RuntimeError("DeviceEngine.set_buckets: buckets are in flight")
        st = self._state
        with st.cv:
            st.buckets = [(s[0], s[4]) for s in specs]
        self._slots = [int(s[3]) for s in specs]
        self._counts = [0] * len(specs)
        self._ready = [False] * len(specs)
        if st.mode == "staged":
            st.host_engine.set_buckets([(address(s[4].pinned), s[1], s[2], 1, s[4].host_op) for s in specs])

    def set_after(self, ops) -> None:
        """Per bucket, None or a callable (overlap_optimizer's update of the bucket's
        parameters) run right after the bucket's op: on the communication stream in direct
        mode, after the copy back at the end of backward when staged."""
        if not self.idle():
            raise RuntimeError("DeviceEngine.set_after: buckets are in flight")
        with self._state.cv:
            self._state.after = list(ops)

    @property
    def num_buckets(self) -> int:
        return len(self._slots)

    def idle(self) -> bool:
        return self._next == 0 and not any(self._counts)

    def mark_ready(self, bi: int) -> None:
        self._raise_error()
        self._counts[bi] += 1
        if self._counts[bi] > self._slots[bi]:
            raise RuntimeError(f"DeviceEngine.mark_ready: bucket {bi} marked more often than it has parameters")
        if self._counts[bi] == self._slots[bi]:
            self._ready[bi] = True
            while self._next < len(self._slots) and self._ready[self._next]:
                self._launch(self._next)

    def _launch(self, bi: int) -> None:
        st = self._state
        ev = st.layer.record(st.layer.current())
        now = time.monotonic()
        self._next = bi + 1
        self._launched += 1
        with st.cv:
            # A direct bucket whose op only queues GPU work (one NCCL call, or nothing) is
            # launched right here on the autograd thread: handing it to the worker costs a
            # thread switch and GIL hand-offs per bucket, more than the launch itself (on one
            # H200, mlp25m's DDP step went from 0.80x to 0.87x of torch's). Only with nothing
            # queued or running on the worker, so NCCL calls keep the order of the calls.
            inline = (INLINE_LAUNCH and st.mode == "direct" and st.error is None and not st.queue and not st.busy
                      and _launches_only(st.buckets[bi][1], st.transport))
            if not inline:
                st.queue.append((bi, ev, now))
                st.cv.notify_all()
                return
        try:
            _launch(st, bi, ev, now)
        except BaseException as e:
            _fail(st, e)
            raise
        finally:
            with st.cv:
                st.processed += 1
                st.cv.notify_all()

    def launch_all(self) -> None:
        """Launches every bucket not launched yet, complete or not (unused parameters, or an
        iteration being abandoned), in order."""
        while self._next < len(self._slots):
            self._launch(self._next)

    def incomplete(self) -> List[int]:
        return [i for i, (c, s) in enumerate(zip(self._counts, self._slots)) if c < s]

    def finish(self, timeout: float) -> None:
        st = self._state
        self.launch_all()
        deadline = time.monotonic() + timeout
        try:
            with st.cv:
                while st.processed < self._launched and st.error is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        pending = self._launched - st.processed
                        raise CommTimeoutError(f"{_WHAT}: {pending} bucket(s) not launched on the "
                                               f"{st.mode} path within {timeout:.1f} s")
                    st.cv.wait(left)
                timings, st.timings = st.timings, []
                last = st.last_event
            self._raise_error()
            if st.mode == "staged":
                st.host_engine.finish(max(deadline - time.monotonic(), 1e-3))
                cur = st.layer.current()
                with st.layer.on(cur):
                    for flat, op in st.buckets:
                        if not isinstance(op.host_op, _C.LocalBucketOp):
                            flat.copy_(op.pinned, non_blocking=True)
                    for after in st.after:
                        if after is not None:
                            after()
                st.h2d_event = st.layer.record(cur)
                timings = st.host_engine.last_timings()
            elif last is not None:
                st.layer.wait(st.layer.current(), last)
            self._last_timings = timings
        finally:
            with st.cv:
                st.processed = 0
            self._launched = 0
            self._next = 0
            self._counts = [0] * len(self._slots)
            self._ready = [False] * len(self._slots)

    def last_timings(self):
        return list(self._last_timings)


def emulated() -> Optional[str]:
    """The emulation mode for CPU parameters, or None (the engine only runs for CUDA ones)."""
    if EMULATE is not None and EMULATE not in MODES:
        raise ValueError(f"rumor.engine.device.EMULATE must be None or one of {MODES}, got {EMULATE!r}")
    return EMULATE


def check_dtype(flat: torch.Tensor) -> int:
    return dtype_code(flat.dtype, f"{_WHAT} bucket")


