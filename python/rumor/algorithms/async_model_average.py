"""Asynchronous model averaging (Bagua's AsyncModelAverage): after a synchronous warm-up, every
rank trains on its own and a background thread averages the weights every sync_interval_ms
while computation goes on (see docs/decentralized_training.md for the semantics).

How it fits together
--------------------
* Warm-up (the first ``warmup_steps`` synchronized backward passes, i.e. optimizer steps): the
  buckets run GradientAllReduce's op, so those steps are exactly GradientAllReduce's.
* Then the buckets switch to the local op (backward communicates nothing) and a daemon thread
  runs *rounds* on a communicator of its own (``rumor.new_group`` of the wrapper's ranks, made
  in ``init``), so its collectives never interleave with the training thread's.
* A round: (1) every rank's thread allreduces a small *census* word saying whether this rank
  contributes its weights (ACTIVE, or LEAVING: finished and idle) or not (PAUSED by abort());
  all threads see the same sums, so they agree on what happens next without any other message;
  (2) if at least two ranks contribute, the weights are averaged: a contributor copies its
  weights into a private snapshot and a work buffer, non-contributors send zeros, and the sum is
  divided by the number of contributors; (3) the thread turns the result into a delta
  ``average - snapshot`` in a private buffer. The training thread adds it to the weights at
  the next fixed point (``before_forward``), so local progress made while the round ran is
  kept: ``x <- x + (average - snapshot)``. With every rank on one host (float32/float64
  weights), the weights themselves and the deltas live in a shared arena (the parameters are
  views into it): the owner of each block reads every rank's weights in place, once, and
  writes each rank's ``average - weights`` into its delta, so a round takes no snapshot copy
  and needs no send buffer: see ``_AllMixer``. Weights therefore never change inside a forward or
  backward, and no lock is held across them (the lock covers one memory copy or one add).
* When every rank has called ``finish()`` the threads run a last round that sets every rank's
  weights to the average of all ranks (identical bits everywhere) and exit.

The communication of a round is a strategy object per ``peer_selection`` (``_Mixer``, in _mixers.py):
"all" is the census + allreduce above; the gossip modes ("ring", "shift_one", "exp2") will put
weights into neighbours' one-sided windows and plug in there.
"""
from __future__ import annotations

import math
import threading
import time
import warnings
from typing import List, Optional

import torch

from .. import _runtime
from .._tensor import address, copy_into, dtype_code
from ..collectives import ReduceOp
from ..errors import RumorError
# shared_arena_possible is not used here: rumor.advisor imports it from this module.
from ._mixers import _Census, _Mixer, _make_mixer, shared_arena_possible  # noqa: F401
from ._warmup import WarmupThenLocal
from .decentralized import check_peer_selection
from .base import Algorithm
from ..engine.flat import FlatWeights

PEER_SELECTION_MODES = ("all", "ring", "shift_one", "exp2")
GOSSIP_MODES = ("ring", "shift_one", "exp2")

# What a rank contributes to a round (its census entry).
ACTIVE = 0   # training; contributes its weights, gets a delta to apply
PAUSED = 1   # abort() was called; contributes nothing, its weights are left alone
LEAVING = 2  # finish() was called; idle, contributes its (no longer moving) weights

_HALF = (torch.float16, torch.bfloat16)
_ONE_FLAT = 1 << 62  # a cap no model reaches: one flat buffer per dtype


# ---- the delta rule, per dtype (pure functions; the unit tests call them directly) ---------------

def delta_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype deltas are kept in: float32 for half types (a difference of two halves is
    exact in float32, and x + delta is then rounded once), the parameter's own otherwise."""
    return torch.float32 if dtype in _HALF else dtype


def compute_delta(average: torch.Tensor, snapshot: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out <- average - snapshot, computed in out's dtype (out may be ``average`` itself)."""
    if out.data_ptr() != average.data_ptr():
        out.copy_(average)
    return out.sub_(snapshot)


def apply_delta(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """x <- x + delta, computed in delta's dtype and rounded once into x's (in-place add with a
    float32 operand computes in float32 for half x). With no local progress since the snapshot
    (x == snapshot) this gives the average exactly whenever average - snapshot is exact in the
    delta dtype: always for half types, and for float32 when the two are within a factor of two."""
    return x.add_(delta)


class _Slot:
    """One flat weight buffer and the private buffers of the averaging thread."""

    def __init__(self, x: torch.Tensor):
        self.x = x                                  # the parameters' storage
        self.snap = torch.empty_like(x)             # weights when the round took them
        self.work: Optional[torch.Tensor] = torch.empty_like(x)  # what is sent; the average comes back here
        dd = delta_dtype(x.dtype)
        # average - snapshot; for full-precision types it lives in ``work`` (no extra copy)
        self.delta = self.work if dd == x.dtype else torch.empty(x.numel(), dtype=dd)
        self.shared = False

    def use_shared(self, x: torch.Tensor, delta: torch.Tensor) -> None:
        """Moves the weights and the delta into the shared arena of ``_AllMixer`` (the caller
        repoints the parameters at ``x``): each block's owner reads every rank's weights there
        and writes each rank's average - weights straight into its delta. No snapshot, no
        ``work`` buffer; a delta not applied yet stays in the arena until it is (a round that
        takes it back, or one this rank sits out, leaves it where it is)."""
        x.copy_(self.x)
        self.x, self.delta, self.snap, self.work = x, delta, None, None
        self.shared = True


# ---- the algorithm ------------------------------------------------------------------------------

def _check_mode(mode) -> str:
    # A topology's weights assume every rank mixes in the same round; asynchronous rounds do not.
    return check_peer_selection("AsyncModelAverage", mode, PEER_SELECTION_MODES,
                                why=" (a static topology's weights need the ranks to mix in common rounds, "
                                    "which asynchronous averaging does not have)")


def _check_interval(ms) -> float:
    if isinstance(ms, bool) or not isinstance(ms, (int, float)):
        raise TypeError(f"AsyncModelAverage: sync_interval_ms must be a number of milliseconds, got "
                        f"{type(ms).__name__}")
    if not math.isfinite(ms) or ms < 0:
        raise ValueError(f"AsyncModelAverage: sync_interval_ms must be finite and >= 0, got {ms!r}")
    return float(ms)


def _check_busy(f) -> float:
    if isinstance(f, bool) or not isinstance(f, (int, float)):
        raise TypeError(f"AsyncModelAverage: max_busy_fraction must be a number in (0, 1], got {type(f).__name__}")
    if not (0 < f <= 1):
        raise ValueError(f"AsyncModelAverage: max_busy_fraction must be in (0, 1], got {f!r}")
    return float(f)


def _check_warmup(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"AsyncModelAverage: warmup_steps must be an integer, got {type(k).__name__}")
    if k < 0:
        raise ValueError(f"AsyncModelAverage: warmup_steps must be >= 0, got {k}")
    return k


class AsyncModelAverage(WarmupThenLocal, Algorithm):
    """Asynchronous model averaging (Bagua's AsyncModelAverageAlgorithm).

    peer_selection: "all" averages over every rank; "ring", "shift_one" and "exp2" gossip over
      one-sided windows, with Decentralized's peers for the same names (each round puts the
      weights to the round's peers and mixes in the latest values that arrived): "ring" both
      ring neighbours, "shift_one" the round-robin partner, "exp2" rank + 2^k. (A topology,
      which Decentralized accepts, is refused: its weights need common rounds.)
      ``peer_selection_mode=`` is the old name of this argument (Bagua's): it still works, with
      a FutureWarning.
    sync_interval_ms: time from the start of one averaging round to the start of the next (a
      round that takes longer is followed at once by the next); 0 runs rounds back to back
      (within max_busy_fraction).
    warmup_steps: the first warmup_steps optimizer steps (synchronized backward passes) average
      gradients exactly like GradientAllReduce; asynchronous averaging starts after them.
    max_busy_fraction: with every rank on one host (weights in shared memory), the largest
      share of wall time the averaging thread spends in weight rounds: after a round that took d
      seconds, the next starts no sooner than d / max_busy_fraction after its start, whatever
      sync_interval_ms says. There a round is memory passes on the cores that train (and, with
      more ranks than cores, their CPU time), so a busy machine, where rounds take longer,
      averages less often instead of training slower. Across hosts a round's time is mostly
      waiting for the network, which costs training nothing: rounds follow sync_interval_ms.
      Default 0.1; 1 turns the bound off (Bagua's behaviour).

    After warm-up, backward communicates nothing; a background thread averages the weights with
    the other ranks every sync_interval_ms and the result is applied, as
    ``x <- x + (average - snapshot)``, at the start of the next forward. Ranks do not wait for
    each other: a slow rank is averaged with whatever it last contributed.

    Every rank must call ``finish()`` at the end of training (also ranks whose data ran out
    early: they wait there, still taking part in the averages, until every rank has called it);
    it returns when all have, with every rank holding the same weights. ``abort()`` /
    ``resume()`` stop and restart this rank's part in the averaging; any subset of ranks may
    call them at any time. An error of the background thread (a dead or stalled peer) is raised
    on the training thread at the next forward, or by finish().
    """

    def __init__(self, peer_selection: str = "all", sync_interval_ms: float = 500, warmup_steps: int = 0,
                 max_busy_fraction: float = 0.1, *, peer_selection_mode: Optional[str] = None):
        if peer_selection_mode is not None:
            if peer_selection != "all":
                raise TypeError("AsyncModelAverage: pass peer_selection only (peer_selection_mode is its old name)")
            warnings.warn("AsyncModelAverage(peer_selection_mode=...) was renamed peer_selection=, the name "
                          "Decentralized and LowPrecisionDecentralized use; the old keyword will go away",
                          FutureWarning, stacklevel=2)
            peer_selection = peer_selection_mode
        self.peer_selection = _check_mode(peer_selection)
        self.sync_interval_ms = _check_interval(sync_interval_ms)
        self.warmup_steps = _check_warmup(warmup_steps)
        self.max_busy_fraction = _check_busy(max_busy_fraction)
        self._interval = self.sync_interval_ms / 1000.0  # seconds; what the thread's loops read
        self.busy_s = 0.0   # wall time the background thread spent in weight rounds
        self.steps = 0      # synchronized backward passes so far (warm-up included)
        self.rounds = 0     # averaging rounds whose result this rank took (as a contributor)
        self.applied = 0    # deltas applied to the weights by the training thread
        self._ticks = 0     # censuses the background thread took part in (tests)
        self._async = self.warmup_steps == 0   # bucket_op is asked before init()
        self._device = False  # CUDA parameters (set by init): the thread works on a host mirror
        self._lock = threading.Lock()
        # Notified (under _lock) when the thread ends an iteration: abort() waits on it.
        self._idle = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._state = ACTIVE   # the state the next census reports (abort/resume/finish change it)
        self._ddp = None
        self._slots: List[_Slot] = []
        self._mixer: Optional[_Mixer] = None
        self._leaving = threading.Event()  # gossip: the thread took the final weights
        # The thread ends: gossip's final average is done, or (live membership) the epoch ended.
        self._stop = threading.Event()
        self._rebind = False     # live membership: init() may serve the rebuilt wrapper
        self._fresh_run()
        self._live_steps = 0     # live membership: ``steps`` after the last applied step

    def _fresh_run(self) -> None:
        """What one averaging thread's life keeps, as before its first start (the constructor,
        and live membership's undo for the wrapper built over the new world)."""
        self._round_state: Optional[int] = None  # the state the thread's iteration in flight read
        self._discard = False  # an abort() timed out: a result arriving after it is dropped
        self._pending = False  # a round's result waits for the training thread to apply it
        self._finished = False
        self._buffers_synced = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._final_works = None
        self._start_due = False  # the thread starts at the next forward (or finish())
        self._leaving.clear()
        self._stop.clear()
        self._wake.clear()

    @staticmethod
    def _live_mode() -> bool:
        # rumor-run --live sets RUMOR_LIVE (rumor._live, a layer above, reads the same variable).
        return _runtime.env_bool("RUMOR_LIVE", False)

    # ---- Algorithm hooks ----------------------------------------------------------------------

    def init(self, ddp) -> None:
        if self._ddp is not None and not self._rebind:
            raise RuntimeError("AsyncModelAverage: this algorithm object already serves a DistributedDataParallel; "
                               "create one per wrapper")
        defer = self._rebind or self._live_mode()
        self._rebind = False
        self._ddp = ddp
        self._flat = FlatWeights(ddp._params, _ONE_FLAT, "AsyncModelAverage")
        self._device = ddp._device_mode is not None
        if self._device:
            # CUDA parameters: the averaging thread works on a page-locked host mirror of the
            # weights. The training thread refreshes the mirror before a forward once the thread
            # took a snapshot of it (so a round's snapshot is at most one step old, and the rule
            # x <- x + (average - snapshot) still keeps every rank's progress since), applies
            # results to the device weights, and finish() copies the final average back.
            from ..gpu.staging import host_like, to_host

            self._slots = [_Slot(to_host(f, host_like(f), "AsyncModelAverage", ddp._timeout))
                           for f in self._flat.flats]
            self._mirror_stale = False
        else:
            self._slots = [_Slot(f) for f in self._flat.flats]
        self._mixer = _make_mixer(self.peer_selection)
        self._mixer.setup(ddp, self._slots)
        if any(s.shared for s in self._slots):
            # The weights moved into the shared arena: the parameters become views into it.
            self._flat.flats = [s.x for s in self._slots]
            self._flat.repoint(copy=True)
        if self._async:
            # Under live membership (rumor-run --live sets RUMOR_LIVE) the thread starts at the
            # first forward: the state a newcomer receives, and the average every member of a new
            # epoch starts from, are loaded on some members only, while no round reads the weights.
            # Otherwise now, so that a rank that does not train yet still answers the rounds.
            self._start_async(ddp, defer=defer)

    # The ranks' replicas differ: a commit (rumor.elastic) keeps their average.
    elastic_consensus = True

    # Live membership (rumor-run --live, docs/elastic.md): after the warm-up a step communicates
    # nothing on the training thread, so the failure of a member is found by the averaging
    # thread (its next round fails) or by live membership's watcher, whose verdict the step
    # checks before the optimizer runs (elastic_live_quiet). Either way the weights have not
    # changed in the step given up: a failure surfaces before the optimizer step, and a result
    # applied at the step's forward came from a round that completed. So the mark keeps only the
    # count of synchronized backward passes (the warm-up's steps may be given up after their
    # backward); the undo stops the thread and drops a result not applied yet. The members then
    # start the epoch from the average of the replicas of those that applied the most steps,
    # and the rebuilt wrapper's thread averages over the new world's ranks.
    elastic_live = True
    elastic_live_quiet = True

    def elastic_live_mark(self) -> None:
        """Keeps the count of synchronized backward passes of the last applied step."""
        self._live_steps = self.steps

    def elastic_live_undo(self) -> None:
        """Stops the averaging thread of the epoch that ended (its round in flight and a result
        not applied yet are dropped), puts back the step count of the last mark and readies
        init() for the wrapper built over the new world. Called again, it does the same."""
        thread = self._thread
        self._stop.set()
        self._wake.set()
        if thread is not None and thread.is_alive():
            thread.join(1.0)
            if thread.is_alive() and self._mixer is not None:
                # A round blocked on a member that is gone: its communicator is this epoch's.
                try:
                    self._mixer.comm.abort("AsyncModelAverage: the live membership epoch ended")
                except Exception:  # noqa: BLE001 - already torn down
                    pass
                thread.join(_runtime.state().timeout if _runtime.is_initialized() else 30.0)
            if thread.is_alive():
                warnings.warn("AsyncModelAverage: the averaging thread of the ended epoch did not stop; "
                              "it is left behind (daemon)", RuntimeWarning, stacklevel=2)
        with self._lock:
            self._fresh_run()
            if self._state == LEAVING:
                self._state = ACTIVE  # finish() given up: the training function runs again and calls it
            self.steps = self._live_steps
            self._async = self.steps >= self.warmup_steps  # bucket_op is asked before init()
            self._rebind = True

    @property
    def peer_selection_mode(self) -> str:
        """The old name of ``peer_selection`` (read only)."""
        return self.peer_selection

    def elastic_state_dict(self):
        """The algorithm's own part of a rumor.elastic commit: the count of synchronized backward
        passes, which says whether the restored job is still in its warm-up.

        Returns:
            A dict with ``steps``.
        """
        return {"steps": self.steps}

    def elastic_before_load(self) -> None:
        """rumor.elastic is about to overwrite the weights on every rank (a collective restore).
        No round may mix old and new weights, nor a result computed from old ones be applied to
        new ones: every rank pauses, and after a barrier (all paused) two censuses of this
        rank's thread pass, so the round in flight has ended and no weight round starts until a
        rank has loaded and resumed (load_elastic_state_dict)."""
        self._resume_to = None
        if self._thread is None:
            return
        from .. import collectives

        with self._lock:
            self._resume_to, self._state = self._state, PAUSED
        collectives.barrier(self._ddp.group)
        ticks, end = self._ticks, time.monotonic() + _runtime.state().timeout
        self._wake.set()
        while self._ticks < ticks + 2:
            self._raise_if_failed()
            if time.monotonic() > end:
                raise TimeoutError("AsyncModelAverage: the averaging thread did not pause for the restore")
            self._wake.set()
            time.sleep(0.002)

    def load_elastic_state_dict(self, sd) -> None:
        """Restores the step count saved by elastic_state_dict() after rumor.elastic loaded the
        weights: drops any averaging result computed from the replaced weights, resumes this
        rank's part in the averaging if elastic_before_load() paused it, and starts the
        asynchronous stage if the commit was taken after the warm-up (on every rank together).

        Args:
            sd: the dict elastic_state_dict() returned.

        Raises:
            KeyError: sd lacks ``steps``.
        """
        self.steps = int(sd["steps"])
        with self._lock:
            self._pending = False  # computed from the weights just replaced
            if self._device:
                self._mirror_stale = True
                self._sync_mirror_locked()  # no round may take the replaced weights
            if getattr(self, "_resume_to", None) is not None:
                self._state, self._resume_to = self._resume_to, None
        if not self._async and self.steps >= self.warmup_steps:
            # A commit taken after warm-up is not warmed up again; every rank restores together.
            self._async = True
            self._ddp._refresh_bucket_ops()
            self._start_async(self._ddp, defer=self._live_mode())

    @property
    def _local(self) -> bool:
        # Backward goes local exactly when the averaging goes asynchronous.
        return self._async

    def before_forward(self, ddp) -> None:
        self._raise_if_failed()
        if self._start_due:
            self._launch()
        if self._thread is None:
            return
        self._flat.ensure_views()
        if self._pending or (self._device and self._mirror_stale):  # hints, checked again under the lock
            with self._lock:
                self._apply_pending_locked()
                if self._device:
                    self._sync_mirror_locked()

    def after_backward(self, ddp) -> None:
        self.steps += 1
        if not self._async and self.steps >= self.warmup_steps:
            # The engine is idle here: the next backward runs the local op on every bucket.
            self._async = True
            ddp._refresh_bucket_ops()
            self._start_async(ddp)

    # ---- public control -----------------------------------------------------------------------

    def abort(self, ddp=None, timeout: Optional[float] = None) -> None:
        """Stops this rank's part in the averaging. When it returns, the weights change only by
        this rank's own training until resume(): as in Bagua, whose abort stops and joins the
        averaging worker, a round this rank had joined before the call is waited for and its
        result applied to the weights here, before returning (nothing is left for a later
        forward to apply); later rounds it sits out. The background thread keeps answering the
        other ranks' rounds, so any subset of ranks may call this, at any time (before wrapping
        or during warm-up too: averaging then starts paused, and nothing is in flight).

        The wait is bounded: ``timeout`` seconds (None: twice the job's deadline, one for the
        round's census and one for its weight average). Past it, TimeoutError names the round;
        the rank stays paused and the late result is dropped when it comes, so the guarantee
        holds either way. Raises the averaging thread's error if the round failed (a dead peer).
        ``ddp`` is accepted for Bagua compatibility (abort(model) there)."""
        self._check_ddp(ddp)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout >= 0):
            raise ValueError(f"AsyncModelAverage.abort(): timeout must be a number of seconds >= 0 or None, "
                             f"got {timeout!r}")
        with self._lock:
            if self._finished:
                raise RuntimeError("AsyncModelAverage.abort(): finish() was called already")
            self._state = PAUSED
            thread = self._thread
            if thread is None:
                return
            wait_s = 2 * _runtime.state().timeout if timeout is None else float(timeout)

            def settled() -> bool:
                return self._round_state != ACTIVE or self._error is not None or not thread.is_alive()

            if not self._idle.wait_for(settled, wait_s):
                self._discard = True
                what = ("its census and weight allreduce with the other ranks' averaging threads"
                        if self._mixer.collective else "its put into the peer's window and the mix")
                raise TimeoutError(f"AsyncModelAverage.abort(): the averaging round in flight ({what}) did not "
                                   f"finish within {wait_s:g} s; this rank is paused and that round's result "
                                   f"will be dropped")
            if self._error is None:
                self._apply_pending_locked()
        self._raise_if_failed()

    def resume(self, ddp=None) -> None:
        """Undoes abort(): this rank contributes again from the next round on. Does not block.

        Args:
            ddp: accepted for Bagua compatibility (resume(model) there); when given, it must be
                the DistributedDataParallel that runs this algorithm. Default None.

        Raises:
            ValueError: ddp is a wrapper that does not use this algorithm.
            RuntimeError: finish() was called already.
        """
        self._check_ddp(ddp)
        with self._lock:
            if self._finished:
                raise RuntimeError("AsyncModelAverage.resume(): finish() was called already")
            self._state = ACTIVE
            self._discard = False

    def finish(self, timeout: Optional[float] = None) -> None:
        """Ends asynchronous averaging; every rank must call it once training is over.

        This rank stops training but keeps contributing its (now fixed) weights to the rounds of
        the ranks still training, so that its progress is not lost and nobody waits for it. When
        every rank has called finish(), a last round gives every rank the average of all ranks'
        weights (the same bits everywhere) and finish() returns. A paused rank rejoins for that
        last round. Raises the background thread's error if it failed (e.g. a dead peer), and
        TimeoutError if ``timeout`` seconds pass first (None: wait while the peers are alive;
        every round still has the job's deadline; call finish() again to keep waiting). Later
        forwards leave the weights alone. Buffers (broadcast only during warm-up) are broadcast
        from the first rank once more at the end. Returns at once if called during warm-up (the
        ranks are in step then; every rank must get through the warm-up steps)."""
        if self._ddp is None:
            raise RuntimeError("AsyncModelAverage.finish(): the algorithm is not wrapped in a DistributedDataParallel")
        if self._start_due and not self._finished:
            self._launch()  # no forward since the wrapper was built: the last round still needs the thread
        thread = self._thread
        with self._lock:
            if not self._finished:
                self._finished = True
                if thread is not None:
                    self._apply_pending_locked()
                    if self._device:  # from now on the mirror is what the last rounds average
                        self._mirror_stale = True
                        self._sync_mirror_locked()
                    self._state = LEAVING
        if thread is not None and self._mixer.collective:
            self._wake.set()
            end = None if timeout is None else time.monotonic() + timeout
            while thread.is_alive():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"AsyncModelAverage.finish(): the other ranks did not all call finish() "
                                       f"within {timeout} s")
                thread.join(0.5 if left is None else min(0.5, left))
        self._raise_if_failed()
        if thread is not None and not self._mixer.collective:
            self._wake.set()
            self._final_gossip(timeout)
        if thread is not None and self._device:
            with self._lock:  # the final average, from the mirror to the device weights
                for s, x in zip(self._slots, self._flat.flats):
                    x.copy_(s.x)
                self._mirror_stale = False
        if thread is not None and not self._buffers_synced:
            self._buffers_synced = True
            if self._saved_broadcast_buffers and self._ddp._buffers_to_sync:
                # The last round completed, so every rank is here: one collective on the
                # wrapper's group makes the buffers (broadcast only during warm-up) equal too.
                from ..engine.buckets import coalesced_broadcast

                coalesced_broadcast(self._ddp._buffers_to_sync, self._ddp.group)

    def _final_gossip(self, timeout: Optional[float]) -> None:
        """Gossip modes: once every rank is in finish(), one exact average on the mixer's own
        communicator gives every rank the same weights; meanwhile this rank's thread keeps
        pushing its fixed weights to the ranks still training. Then the thread stops and the
        windows are freed (a barrier: no rank leaves while a peer may still put to it). Started
        once; a finish() called again after a TimeoutError keeps waiting for the same average."""
        wait_s = _runtime.state().timeout * 2 if timeout is None else timeout
        end = time.monotonic() + wait_s
        # The thread's round in flight may still write x; the average starts after it took x.
        while not self._leaving.wait(0.1):
            self._raise_if_failed()
            if time.monotonic() > end:
                raise TimeoutError("AsyncModelAverage.finish(): the averaging thread did not stop its round")
        self._raise_if_failed()
        if self._final_works is None:
            mixer = self._mixer
            self._final_works = [
                mixer.comm.allreduce(address(s.x), s.x.numel(), dtype_code(s.x.dtype, "AsyncModelAverage"),
                                     int(ReduceOp.AVG), 0, True) for s in self._slots]
        for w in self._final_works:
            try:
                w.wait(max(0.0, end - time.monotonic()))
            except RumorError as e:
                if w.done():
                    raise
                raise TimeoutError(f"AsyncModelAverage.finish(): the other ranks did not all call finish() "
                                   f"within {wait_s} s") from e
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self._raise_if_failed()
        if self._mixer.names:
            self._mixer.free()

    @property
    def running(self) -> bool:
        """Whether the background averaging thread runs (after warm-up, until finish())."""
        return self._thread is not None and self._thread.is_alive()

    # ---- internals ----------------------------------------------------------------------------

    def _check_ddp(self, ddp) -> None:
        # A module given to rumor.compat.bagua's with_bagua is its own wrapper (Bagua's abort(model)).
        ddp = getattr(ddp, "_rumor_ddp", ddp)
        if ddp is not None and self._ddp is not None and getattr(ddp, "algorithm", None) is not self:
            raise ValueError("AsyncModelAverage: the DistributedDataParallel given does not use this algorithm")

    def _raise_if_failed(self) -> None:
        e = self._error
        if e is None:
            return
        msg = f"AsyncModelAverage: background averaging failed: {e}"
        if isinstance(e, RumorError):
            raise type(e)(msg) from e
        raise RuntimeError(msg) from e

    def _apply_pending_locked(self) -> None:
        if self._pending:
            if self._device:
                # The training thread's weights are on the device: the result goes there, and
                # the mirror follows at the next refresh.
                for s, x in zip(self._slots, self._flat.flats):
                    apply_delta(x, s.delta.to(x.device))
                self._mirror_stale = True
            else:
                for s in self._slots:
                    self._apply(s)
            self._pending = False
            self.applied += 1

    def _sync_mirror_locked(self) -> None:
        """Device weights -> the host mirror the averaging thread reads (caller holds the lock)."""
        if self._mirror_stale:
            from ..gpu.staging import to_host

            for s, x in zip(self._slots, self._flat.flats):
                to_host(x, s.x, "AsyncModelAverage", self._ddp._timeout)
            self._mirror_stale = False

    def _apply(self, s: _Slot) -> None:
        """x <- x + (average - snapshot) for a slot's pending result (caller holds the lock)."""
        apply_delta(s.x, s.delta)

    def _start_async(self, ddp, defer: bool = False) -> None:
        # Buffers (e.g. BatchNorm statistics) are broadcast before every forward only while the
        # ranks are in step: afterwards each rank keeps its own (a collective per forward would
        # put the ranks back in lockstep).
        self._saved_broadcast_buffers = ddp.broadcast_buffers
        ddp.broadcast_buffers = False
        if self._finished:
            return
        if defer:
            self._start_due = True
            return
        self._launch()

    def _launch(self) -> None:
        self._start_due = False
        if self._thread is not None:
            return
        loop = self._loop if self._mixer.collective else self._gossip_loop
        self._thread = threading.Thread(target=loop, name="rumor-async-model-average", daemon=True)
        self._thread.start()

    def _gossip_loop(self) -> None:
        """Rounds of a gossip mode: no census and no agreement; a paused rank skips its rounds.
        After finish() the rank keeps pushing its fixed weights (taken once into the window
        buffers, acknowledged through ``_leaving``) until finish() has done the exact final
        average and sets ``_stop``."""
        try:
            next_round = time.monotonic() + self._interval
            leaving = False
            while not self._stop.is_set():
                delay = next_round - time.monotonic()
                if delay > 0:
                    self._wake.wait(delay)
                self._wake.clear()
                if self._stop.is_set():
                    return
                with self._lock:
                    state = self._round_state = self._state
                    if state == LEAVING and not leaving:
                        # finish() applied what was pending and waits: x no longer moves.
                        for s in self._slots:
                            s.work.copy_(s.x)
                        leaving = True
                        self._leaving.set()
                started = time.monotonic()
                self._ticks += 1
                if state == LEAVING:
                    self._mixer.push([s.work for s in self._slots])
                elif state == ACTIVE:
                    self._round(state, None)
                self._iteration_done()
                next_round = self._next_round(started, time.monotonic() - started)
        except BaseException as e:  # noqa: BLE001 - surfaced on the training thread
            self._error = e
            self._leaving.set()
            self._iteration_done()

    def _loop(self) -> None:
        try:
            next_round = time.monotonic() + self._interval
            while True:
                delay = next_round - time.monotonic()
                if delay > 0:
                    self._wake.wait(delay)
                self._wake.clear()
                if self._stop.is_set():
                    return
                with self._lock:
                    state = self._round_state = self._state
                    role = 0
                    if self._shared and state != PAUSED:
                        # Shared arena: the peers read this rank's weights (and a result not
                        # applied yet: role 2, taken back from the training thread now, so
                        # that nothing changes x or the delta until the exchange is over).
                        role = 2 if self._pending else 1
                        self._pending = False
                started = time.monotonic()
                census = self._mixer.census(state, role)
                self._ticks += 1
                next_round = started + self._interval
                if census.all_leaving:
                    self._mixer.final(self._slots)
                    self.rounds += 1
                    self._iteration_done()
                    return
                if census.active >= 1 and census.contributors >= 2:
                    # Busy time: the round itself, not the census (which mostly waits for
                    # the peers' threads to wake).
                    t = time.monotonic()
                    self._round(state, census)
                    next_round = self._next_round(started, time.monotonic() - t)
                elif role == 2:
                    self._give_back()
                self._iteration_done()
        except BaseException as e:  # noqa: BLE001 - surfaced on the training thread
            self._error = e
            self._iteration_done()

    def _iteration_done(self) -> None:
        """The thread's iteration is over (its result, if any, is pending): wakes abort()."""
        with self._lock:
            self._round_state = None
            self._idle.notify_all()

    def _next_round(self, started: float, busy: float) -> float:
        """When the next round may start: sync_interval_ms after this one started, and for
        shared-memory rounds late enough that the thread is busy at most max_busy_fraction of
        the time. All ranks' rounds start together at the census, so the rank whose rounds are
        the slowest sets the pace."""
        self.busy_s += busy
        if not self._shared:
            return started + self._interval
        return started + max(self._interval, busy / self.max_busy_fraction)

    def _round(self, state: int, census: _Census) -> None:
        """One weight round. ``state`` is what this rank reported in the census: it decides what
        it sends, even if abort()/resume()/finish() changed it since (the others count on it)."""
        slots = self._slots
        if slots and slots[0].shared:
            self._round_shared(state, census)
            return
        if state == PAUSED:
            # Zeros, sent from the snapshot buffer: it is free between rounds, whereas ``work``
            # may hold (for full precision) a delta still waiting for the training thread.
            for s in slots:
                s.snap.zero_()
            self._mixer.average([s.snap for s in slots], census)
            return
        with self._lock:
            # A delta the training thread has not applied yet (no forward since the last round)
            # is taken back: this round sends x + delta and its own delta replaces the old one,
            # so x + delta (what the rank would hold) is the quantity being averaged.
            retaken = self._pending
            self._pending = False
            for s in slots:
                copy_into(s.snap, s.x)  # libc's streaming copy: the lock is held for this only
            if self._device:
                self._mirror_stale = True  # the next forward brings the mirror up to date
        for s in slots:
            if retaken:
                s.delta.add_(s.snap)          # snapshot + old delta (in the delta's dtype)
                if s.delta is not s.work:
                    s.work.copy_(s.delta)
            else:
                copy_into(s.work, s.snap)
        self._mixer.average([s.work for s in slots], census)
        if state == LEAVING:
            # Idle since finish() (which applied any pending delta first): x is the snapshot,
            # so x + (average - snapshot) is the average; copy it exactly.
            with self._lock:
                for s in slots:
                    s.x.copy_(s.work)
                self.rounds += 1
            return
        for s in slots:
            compute_delta(s.work, s.snap, s.delta)
        self._finish_round(slots)

    def _finish_round(self, slots: List[_Slot]) -> None:
        with self._lock:
            if self._state == LEAVING:
                # finish() came during the round: the training thread waits there and has
                # applied what was pending; apply this round's result now.
                for s in slots:
                    self._apply(s)
            elif self._discard:
                # An abort() that timed out waiting for this round returned: nothing may change
                # the weights now but local training.
                pass
            else:
                # An abort() during the round waits for this and applies it before returning.
                self._pending = True
            self.rounds += 1

    @property
    def _shared(self) -> bool:
        return bool(self._slots) and self._slots[0].shared

    def _give_back(self) -> None:
        """Shared slots: no weight round ran after the census took this rank's waiting result
        back; it waits again (or, if finish() came meanwhile, is applied now: the training
        thread waits in finish())."""
        with self._lock:
            if self._state == LEAVING:
                for s in self._slots:
                    self._apply(s)
                self.applied += 1
            elif not self._discard:
                self._pending = True

    def _round_shared(self, state: int, census: _Census) -> None:
        """A round of shared slots (see ``_AllMixer``). The census already took back any result
        this rank had not applied (its role says so); the exchange reads the weights in place
        and writes every contributor's new delta, which includes the old one."""
        self._mixer.average_shared(self._slots, census)
        if state == PAUSED:
            return  # sat out: its weights and its waiting delta were left alone
        if state == LEAVING:
            # Idle since finish() (which applied what was pending): x is what was read.
            with self._lock:
                for s in self._slots:
                    apply_delta(s.x, s.delta)
                self.rounds += 1
            return
        self._finish_round(self._slots)
