"""The deadline of blocking NCCL calls that return once queued (RUMOR_GPU_WAIT=stream; docs/gpu.md,
"Streams and waiting").

With ``host`` waiting (the default) a blocking call waits on the host for its event, so the
deadline has a waiter. With ``stream`` waiting the call returns as soon as its work is queued on
torch's current stream, as torch.distributed's NCCL calls do, so consecutive calls pipeline on
the GPU; the waiter is then this watch, one thread per group's communicator:

- every such call hands over the event recorded after it and its deadline;
- the thread looks at the pending events (2 ms apart, growing to 20 ms while nothing finishes:
  deadlines are seconds, and each look takes the GIL from the training thread) and asks NCCL
  for asynchronous errors;
- an event past its deadline, or an NCCL error, aborts the communicator (which ends its kernels,
  so a later synchronize or .item() returns instead of hanging), logs the error at once, and
  keeps it: the next call on the group raises it, naming the op that did not finish.

Events of one stream pass in order, so only the newest one of a stream is asked while it has not
passed. Deadlines need not be in that order (set_timeout may lower the timeout between two ops),
so each stream also keeps its pending ops' soonest deadlines as a monotonic queue: the soonest is
its head, found without a scan however many ops are pending.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Dict, Optional

from ..errors import CommTimeoutError, RumorError


_MIN_PAUSE, _MAX_PAUSE = 0.002, 0.02
_DRAIN_GRACE = 1.0  # seconds drain() waits past its own time for the watch to report an overdue op

_log = logging.getLogger("rumor")


class StreamWatch:
    """Keeps the deadlines of queued ops of one communicator (see the module docstring).

    comm: has check(op) (raises on NCCL's asynchronous error, after aborting) and abort(); the
    events have query(). name says whose ops these are, in the errors."""

    def __init__(self, comm, name: str, min_pause: float = _MIN_PAUSE, max_pause: float = _MAX_PAUSE,
                 recycle=None):
        self._comm, self.name = comm, name
        self._recycle = recycle  # given each passed event, for reuse (GpuGroup.recycle)
        self._min_pause, self._max_pause = min_pause, max_pause
        self._cv = threading.Condition()
        self._streams: Dict[object, _Queue] = {}  # stream key -> its pending ops
        self._count = 0
        self._error: Optional[BaseException] = None
        self._failing: Optional[BaseException] = None  # being aborted for; kept once the abort returns
        self._stop = False
        self._thread: Optional[threading.Thread] = None

    # ---- the calling thread -------------------------------------------------------------------

    def add(self, stream_key, event, timeout: float, what: str) -> None:
        """Watches an op queued on stream_key, whose completion is event.query(); it must pass
        within timeout seconds from now."""
        now = time.monotonic()
        with self._cv:
            if self._stop:
                raise RumorError(f"{what}: the group's GPU watch is closed (rumor.shutdown() was called)")
            q = self._streams.get(stream_key)
            if q is None:
                q = self._streams[stream_key] = _Queue()
            q.push((event, now + timeout, what, now))
            self._count += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rumor-gpu-watch", daemon=True)
                self._thread.start()
            elif self._count == 1:
                self._cv.notify_all()  # asleep with nothing to watch

    def raise_error(self, what: str) -> None:
        """Raises the error the watch met (an op past its deadline, an NCCL error), if any."""
        err = self._error if self._error is not None else self._failing
        if err is not None:
            raise _later(err, what) from err

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def pending(self) -> int:
        with self._cv:
            return self._count

    def drain(self, timeout: float, what: str) -> None:
        """Waits until every watched op has finished (the watch's own deadlines still apply);
        raises the watch's error, or CommTimeoutError after timeout seconds."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._count and self._error is None:
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    # An op past its own deadline is the watch's to report (it aborts, then
                    # keeps the error): give it a few looks rather than report less precisely.
                    overdue = any(q.soonest()[_DEADLINE] < now for q in self._streams.values())
                    if not (overdue and now < deadline + _DRAIN_GRACE):
                        more = f" and {self._count - 1} more" if self._count > 1 else ""
                        raise CommTimeoutError(f"{what}: {self._oldest_what()}{more}, queued on the GPU by "
                                               f"{self.name}, did not finish within {timeout:.1f} s")
                self._cv.notify_all()  # the watch looks now rather than after its pause
                self._cv.wait(self._min_pause)
        self.raise_error(what)

    def close(self) -> None:
        """Stops the thread (pending ops are no longer watched)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)

    # ---- the watch thread ---------------------------------------------------------------------

    def _run(self) -> None:
        pause = self._min_pause
        while True:
            failed = None
            with self._cv:
                while not self._count and not self._stop:
                    pause = self._min_pause
                    self._cv.wait()
                if self._stop:
                    return
                self._cv.wait(pause)
                if self._stop:
                    return
                try:
                    retired = self._look()
                except BaseException as e:  # noqa: BLE001 - kept, raised by the group's next call
                    failed = e
                else:
                    if retired:
                        self._cv.notify_all()  # drain() may be waiting
                    pause = self._min_pause if retired else min(pause * 2, self._max_pause)
            if failed is not None:
                # Aborted outside the lock (an abort may take a while; add() must not wait for
                # it), and before the error is kept: drain() and close() find NCCL stopped. The
                # abort ends the kernels first, so a call made meanwhile (after a synchronize that
                # just returned) finds the communicator aborted: it must raise this error, the
                # reason, not the bare abort.
                with self._cv:
                    self._failing = failed
                self._abort(failed)
                with self._cv:
                    self._keep(failed)

    def _look(self) -> bool:
        """Retires the passed events (under the lock); raises for an NCCL error or an op past
        its deadline."""
        retired = 0
        now = time.monotonic()
        for key in list(self._streams):
            q = self._streams[key]
            if q.ops[-1][_EVENT].query():
                retired += len(q.ops)
                del self._streams[key]
                if self._recycle is not None:
                    for op in q.ops:
                        self._recycle(op[_EVENT])
                continue
            # The newest may pass while the older ones are asked: then the queue empties here.
            while q.ops and q.ops[0][_EVENT].query():
                event = q.ops[0][_EVENT]
                q.pop()
                retired += 1
                if self._recycle is not None:
                    self._recycle(event)
            if not q.ops:
                del self._streams[key]
                continue
            _, deadline, what, t0 = q.soonest()
            if now > deadline:  # _keep() forgets every pending op
                raise CommTimeoutError(
                    f"{what}: not finished on the GPU {now - t0:.1f} s after it was queued (deadline "
                    f"{deadline - t0:.1f} s; a peer that never called it, or called a different op, leaves it "
                    f"waiting); the NCCL communicator of {self.name} was aborted")
        self._count -= retired
        if self._count:
            self._comm.check(self._oldest_what())
        return retired > 0

    def _oldest_what(self) -> str:
        return min((q.ops[0] for q in self._streams.values()), key=lambda op: op[_T0])[_WHAT]

    def _keep(self, e: BaseException) -> None:
        """Under the lock: keeps the first error and forgets the pending ops."""
        if self._error is None:
            self._error = e
        self._streams.clear()
        self._count = 0
        self._cv.notify_all()

    def _abort(self, e: BaseException) -> None:
        try:
            self._comm.abort()
        except Exception as ab:  # noqa: BLE001 - the error being kept is the one to report
            _log.warning("rumor: aborting the NCCL communicator of %s failed: %s", self.name, ab)
        _log.error("rumor: %s: %s (raised by the group's next call)", type(e).__name__, e)


_EVENT, _DEADLINE, _WHAT, _T0 = range(4)  # an op: a tuple (plain tuples keep add() cheap)


class _Queue:
    """One stream's pending ops, oldest first, and the candidates for the soonest deadline: each
    is sooner than every op queued before it that is still pending (a sliding-window minimum)."""

    __slots__ = ("ops", "_soonest")

    def __init__(self):
        self.ops: deque = deque()
        self._soonest: deque = deque()

    def push(self, op: tuple) -> None:
        self.ops.append(op)
        soonest = self._soonest
        while soonest and soonest[-1][_DEADLINE] >= op[_DEADLINE]:
            soonest.pop()  # never the soonest again: op is sooner and retires later
        soonest.append(op)

    def pop(self) -> None:
        op = self.ops.popleft()
        if self._soonest[0] is op:
            self._soonest.popleft()

    def soonest(self) -> tuple:
        return self._soonest[0]


def _later(err: BaseException, what: str) -> BaseException:
    """The watch's error, raised by a later call `what`: same type where it is rumor's."""
    text = (f"{what}: an earlier op queued on the GPU failed: {err} (RUMOR_GPU_WAIT=stream reports it here; "
            "this group cannot go on: restart the job or rebuild the group)")
    if isinstance(err, RumorError):
        try:
            return type(err)(text)
        except TypeError:
            pass
    return RumorError(text)
