"""Live membership: a rank that dies leaves the job, the survivors go on in the same processes,
a newcomer joins at a step boundary (docs/elastic.md, "Live membership").

Started by ``rumor-run --live`` (RUMOR_LIVE=1). Everything the members must agree on goes through
the job's store (node 0's launcher hosts it, as torchrun's agent does; or, with --store etcd, an
etcd cluster: RUMOR_ETCD_ENDPOINTS), which orders concurrent writers: the first value a
compare_set writes is everyone's. Under the store's key prefix
``rumor/<run id>/live/``:

- ``e<E>/members``: the members of epoch E in rank order, sealed with the job secret's MAC (a
  stranger who can write to the store cannot add a member). A member's id is ``r<rank>`` for
  the launcher's first workers and ``j<n>`` for the n-th newcomer; ``epoch`` is the newest E.
- ``e<E>/reg/<id>``: a member's registration for epoch E, with how many optimizer steps it has
  applied. A step is applied by a member whose allreduce completed, which needs every rank's
  contribution: so when a member fails in the middle of a step, some members may have applied it
  and others not. The new epoch starts from the state of a member that applied the most (its
  "source"), sent to every member that is behind and to the newcomers: nobody loses more than
  the step in flight, and nothing is agreed on per step while nothing fails.
- ``e<E>/abort``: the first failure anybody saw in epoch E. Every member's watcher thread reads
  it and aborts its communicators, so collectives blocked on a member that is gone fail at once
  instead of waiting out their deadline.
- ``hb/<id>``: each process's heartbeat counter (its watcher writes its next value every other
  beat; an idle spare's only once called); a member whose counter stands still for
  RUMOR_LIVE_HEARTBEAT seconds (SIGSTOP, a lost host) is gone.
  ``dead/<id>``: set by the launcher when the process exits; ``events`` counts exits and
  aborts, so that a watcher reads one key per beat and the others only when it moved.
- ``joinseq``, ``ready/j<n>``, ``done/j<n>``: newcomers are numbered by joinseq (the launcher
  draws the number when it starts one); a newcomer sets ready once it can join, and the epoch
  that admits (or skips) it sets done.

A new epoch gets new connections: rumor.init() runs again with the epoch as its generation, and
connections are keyed by that rendezvous, so nothing a rank of an older epoch sends is accepted.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import traceback
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from . import _rendezvous, _runtime
from ._env import env_float, env_int
from .errors import RumorError

_log = logging.getLogger("rumor.elastic")

LIVE_ENV = "RUMOR_LIVE"
ID_ENV = "RUMOR_LIVE_ID"  # set by the launcher: r<rank> or j<n>
JOIN_ENV = "RUMOR_LIVE_JOIN"  # 1: this process is a newcomer
SPARE_ENV = "RUMOR_LIVE_SPARE"  # a spare's pipe (fd) from its launcher, which calls it there (rumor-run --live-spares)
MIN_ENV = "RUMOR_LIVE_MIN"  # fewest members training goes on with (rumor-run --live-min)
HEARTBEAT_ENV = "RUMOR_LIVE_HEARTBEAT"  # seconds of silence after which a member is gone
_BEAT_S = 0.1  # the watcher's period: a failure is seen within about this, a silence within the heartbeat
_MEMBERS_MAC = "live-members"


class LiveRestart(RumorError):
    """The step in flight is given up and redone with a new membership (raised before an
    optimizer step to admit newcomers, or to grow the group; rumor.elastic.run catches it)."""


class LiveDropped(RumorError):
    """This process was dropped from the job (silent past the heartbeat, or too late for the new
    epoch). It exits; the launcher starts it again as a newcomer."""


@dataclass
class Change:
    """What rumor.elastic.on_change() callbacks receive after each membership change."""

    epoch: int
    size: int  # the new world size
    rank: int  # this process's new rank
    left: List[str]  # ids of the members that left
    joined: List[str]  # ids of the newcomers admitted
    reason: str  # why the previous membership ended
    degraded_s: float  # from the failure (or the step that admitted newcomers) to the new group


@dataclass
class _Live:
    store: object  # the launcher's store, under the live prefix
    watch_store: object  # a second client for the watcher thread
    me: str
    min_size: int
    heartbeat_s: float
    timeout: float  # RUMOR_TIMEOUT: how long forming an epoch (or waiting to be admitted) may take
    epoch: int = 0
    members: List[str] = field(default_factory=list)
    new: List[str] = field(default_factory=list)  # members admitted by this epoch
    applied: int = 0  # optimizer steps this process's state has seen
    # The steps of the epoch's source: this process's count once its state was sent (until then
    # it is not up to date; if the sending fails, the next epoch must not take it for a source).
    target: int = 0
    source: int = 0  # the rank whose state the epoch started from
    sync: bool = False  # whether the epoch starts with the source's state sent (newcomers, or someone behind)
    join_pending: bool = False  # set by the watcher: newcomers are ready
    behind: bool = False  # this process's state is older than the source's: it receives the source's
    trouble: Optional[str] = None  # set by the watcher: why this epoch is over
    trouble_t: Optional[float] = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: Optional[threading.Thread] = None
    joined_fresh: bool = False  # a newcomer until its state arrived
    # Newcomers' numbers settled for good (admitted, refused, or gone): not read again. Not a
    # watermark: an idle spare (rumor-run --live-spares) stays unsettled while later ones settle.
    settled: set = field(default_factory=set)
    changes: List[Change] = field(default_factory=list)
    # The members of the last epoch that trained here (the change callbacks' view): an epoch
    # that failed while it formed is not a change anyone saw, so the next one is told against this.
    seen: List[str] = field(default_factory=list)
    timeline: Optional[str] = None  # RUMOR_TIMELINE as the job was started with
    transfer: Optional[tuple] = None  # the last state received or sent: (bytes, seconds of its broadcast)
    # The user's topologies and window names of the last world (neighbor.ops.carry_topologies,
    # neighbor.window.carry_windows)
    neighbors: Optional[tuple] = None
    # Before the end of the job's first restore (rumor.elastic.State.restore from a commit), from
    # the first init() on. A failure there re-forms the survivors, who all restore again, and no
    # newcomer enters that epoch: it would not take part in the restore's collectives.
    restoring: bool = False
    restore_again: bool = False  # the epoch just formed starts with that restore
    # A member failed while this process built its DDP wrapper, whose construction sends rank 0's
    # weights: the replicas may differ, so the next epoch starts with the source's state sent to
    # all (until a transfer completed).
    unsynced: bool = False
    idle_spare: bool = False  # a spare its launcher has not called yet
    reforming: bool = False  # inside reform(): its init() failing is reform's caller's to handle


_live: Optional[_Live] = None
_callbacks: List[Callable[[Change], None]] = []


def enabled() -> bool:
    return os.environ.get(LIVE_ENV, "").strip() == "1"


def current() -> Optional[_Live]:
    return _live


def _prefix() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"rumor/{run_id}/live/" if run_id else "rumor/live/"


def _client(timeout: float):
    return _rendezvous.prefixed(_rendezvous.shared_store(_rendezvous.read_env(), timeout), _prefix())


def _count(store, key: str) -> int:
    return int(store.add(key, 0))


def _members_key() -> bytes:
    return _runtime.job_secret().key(_MEMBERS_MAC) if _runtime.is_initialized() else \
        _rendezvous.job_secret_for(_rendezvous.read_env()).key(_MEMBERS_MAC)


def _read_members(store, epoch: int) -> dict:
    raw = store.get(f"e{epoch}/members")
    return _rendezvous.unseal(_members_key(), f"{_MEMBERS_MAC}/{epoch}", raw, f"the members of epoch {epoch}")


# ---- before the first init() ------------------------------------------------------------------

def _before_init() -> None:
    """rumor.init() calls this first: in live mode the first init sets up this process's part
    of the membership; a newcomer waits here until an epoch admits it, and init then joins that
    epoch's rendezvous as the rank it was given."""
    global _live
    if not enabled() or _live is not None:
        return
    env = _rendezvous.read_env()
    timeout = env_float("RUMOR_TIMEOUT", _runtime.DEFAULT_TIMEOUT, positive=True)
    joiner = os.environ.get(JOIN_ENV, "").strip() == "1"
    store = _client(timeout)
    me = os.environ.get(ID_ENV, "").strip()
    if not me:
        me = f"j{int(store.add('joinseq', 1))}" if joiner else f"r{env.rank}"
    live = _Live(store=store, watch_store=_client(timeout), me=me,
                 min_size=env_int(MIN_ENV, 1, minimum=1),
                 heartbeat_s=env_float(HEARTBEAT_ENV, 2.0, positive=True), timeout=timeout)
    if joiner:
        live.joined_fresh = True
        _start_watcher(live)
        _warm_up()
        if os.environ.get(SPARE_ENV, "").strip():
            live.idle_spare = True
            _await_call(live, int(os.environ[SPARE_ENV]))
            live.idle_spare = False
        store.set(f"ready/{me}", "1")
        _log.warning("rumor.elastic: newcomer %s is waiting to be admitted", me)
        epoch, sealed = _await_admission(live, timeout)
        live.epoch, live.members, live.new = epoch, sealed["members"], sealed["new"]
        live.source, live.sync, live.target, live.behind = sealed["source"], True, sealed["applied"], True
        live.seen = list(live.members)
        _enter_epoch(live)
    else:
        live.members = [f"r{r}" for r in range(env.size)]
        live.seen = list(live.members)
        live.restoring = True  # until rumor.elastic.run's first restore: no newcomer before it
        _start_watcher(live)
    _live = live


def _warm_up() -> None:
    """From a newcomer's admission to its first collective every member waits for it, so what
    it is sure to load after init is loaded before it asks to be admitted: a live job has an
    optimizer (rumor.elastic.State needs one), and torch's first optimizer imports torch._dynamo,
    about a second of one core."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:  # a torch without it, or a broken one: the optimizer will say so itself
        _log.debug("rumor.elastic: newcomer warm-up: %s", e)


def _await_call(live: _Live, fd: int) -> None:
    """A spare, imported and warmed up, waits until its launcher calls it in place of a worker
    that failed, for as long as the job runs: the launcher writes the slot to the pipe fd (a wait
    that costs nothing, and wakes at once). The job's end sends it home (exit status 0: it was
    not needed); so does its launcher's end (the pipe closes)."""
    import select

    while True:
        if select.select([fd], [], [], 0.5)[0]:
            slot = os.read(fd, 64).decode().strip()
            os.close(fd)
            if not slot:
                break  # the launcher is gone
            os.environ["LOCAL_RANK"] = slot  # RANK is the epoch's, set when it is admitted (_enter_epoch)
            os.environ.pop(SPARE_ENV, None)
            _log.warning("rumor.elastic: spare %s called to slot %s", live.me, slot)
            return
        if live.store.check(["job_done"]):
            break
    live.stop.set()
    live.thread.join(timeout=5)
    raise SystemExit(0)


def _await_admission(live: _Live, timeout: float):
    deadline = time.monotonic() + timeout
    seen = -1
    while True:
        if live.store.check([f"done/{live.me}"]):
            why = live.store.get(f"done/{live.me}").decode()
            if why != "admitted":
                raise LiveDropped(f"rumor.elastic: newcomer {live.me} was not admitted: {why}")
        epoch = _count(live.store, "epoch")
        if epoch != seen:
            seen = epoch
            if epoch > 0:
                sealed = _read_members(live.store, epoch)
                if live.me in sealed["members"]:
                    return epoch, sealed
        if live.store.check(["job_done"]):
            raise LiveDropped(f"rumor.elastic: newcomer {live.me}: the job finished before it was admitted")
        if time.monotonic() > deadline:
            raise LiveDropped(f"rumor.elastic: newcomer {live.me} was not admitted within {timeout:g} s "
                              "(RUMOR_TIMEOUT): no member reached a step boundary")
        time.sleep(0.02)


def _enter_epoch(live: _Live) -> None:
    """Sets the launcher variables rumor.init() reads to this process's place in the epoch."""
    rank = live.members.index(live.me)
    e = os.environ
    if e.get("LOCAL_WORLD_SIZE") == e.get("WORLD_SIZE"):  # one host: it still is
        e["LOCAL_WORLD_SIZE"] = str(len(live.members))
    e["RANK"] = str(rank)
    e["WORLD_SIZE"] = str(len(live.members))
    # Every member of an epoch counts the same generation: the rendezvous keys are the epoch's.
    _runtime.set_generation(live.epoch)
    # RUMOR_TIMELINE: each epoch records to files of its own (trace.json -> trace.epoch2.rank0.json),
    # since a rank of one epoch may be another rank of the next.
    if live.timeline is None:
        live.timeline = e.get("RUMOR_TIMELINE", "")
    if live.timeline and live.epoch > 0:
        base = live.timeline[:-5] if live.timeline.endswith(".json") else live.timeline
        e["RUMOR_TIMELINE"] = f"{base}.epoch{live.epoch}.json"
    live.trouble = live.trouble_t = None
    live.join_pending = False


# ---- the watcher -------------------------------------------------------------------------------

class _Silences:
    """How long each member's heartbeat count has stood still, counted in the watcher's own waking
    time. A watcher that itself did not run for a while (a loaded host, the GIL held through a long
    import, the store slow to answer) saw nothing in that time; on a shared host the member it
    judges was most likely stalled by the same load, so that time is nobody's silence. A member
    stopped while its observer runs is still found after heartbeat_s."""

    def __init__(self, heartbeat_s: float, period_s: float):
        self.heartbeat_s = heartbeat_s
        self.period_s = period_s
        self.moved: Dict[str, Tuple[int, float]] = {}  # member -> (its count, when it last moved)
        self.last_tick: Optional[float] = None

    def tick(self, now: float) -> None:
        """Called once per watcher period: a gap past twice the period is the watcher's own stall,
        and every silence clock is moved forward by the part past one period."""
        if self.last_tick is not None:
            stall = now - self.last_tick - self.period_s
            if stall > self.period_s:
                self.moved = {m: (c, t + stall) for m, (c, t) in self.moved.items()}
        self.last_tick = now

    def silent_for(self, member: str, count: int, now: float) -> Optional[float]:
        """The silence of member (its count read now) when it is past heartbeat_s, else None."""
        prev = self.moved.get(member)
        if prev is None or prev[0] != count:
            self.moved[member] = (count, now)
            return None
        quiet = now - prev[1]
        return quiet if quiet > self.heartbeat_s else None


def _start_watcher(live: _Live) -> None:
    live.thread = threading.Thread(target=_watch, args=(live,), name="rumor-live-watch", daemon=True)
    live.thread.start()


def _watch(live: _Live) -> None:
    store = live.watch_store
    silences = _Silences(live.heartbeat_s, _BEAT_S)
    events = 0
    tick = 0
    beats = 0
    while not live.stop.wait(_BEAT_S):
        tick += 1
        silences.tick(time.monotonic())
        try:
            # The heartbeat moves every other tick (a silence is judged over RUMOR_LIVE_HEARTBEAT,
            # 2 s), by a plain write of this process's own count: on an etcd store each write is a
            # Raft entry every member stores, where failures are found by the events read below.
            # An idle spare beats only once called: nobody waits for it before.
            if tick % 2 == 1 and not live.idle_spare:
                beats += 1
                store.set(f"hb/{live.me}", str(beats))
            with live.lock:
                epoch, members = live.epoch, list(live.members)
            if live.trouble is not None or live.joined_fresh and epoch == 0:
                continue
            why = None
            e = _count(store, "events")  # exits and aborts: one read per beat, the details when it moved
            if e != events:
                events = e
                if store.check([f"e{epoch}/abort"]):
                    why = store.get(f"e{epoch}/abort").decode()
                else:
                    gone = [m for m in members if m != live.me and _count(store, f"dead/{m}") > 0]
                    if gone:
                        why = f"member {gone[0]} exited"
            if why is None and tick % 5 == 0:
                now = time.monotonic()
                for m in members:
                    if m == live.me:
                        continue
                    c = _count(store, f"hb/{m}")
                    if c == 0:
                        # Not beating yet (a process still importing on a loaded host starts
                        # seconds after the others): not silent. One that dies first is
                        # reported by its launcher; a host lost first, by init's deadline.
                        continue
                    quiet = silences.silent_for(m, c, now)
                    if quiet is not None:
                        why = f"member {m} was silent for {quiet:.1f} s (heartbeat {live.heartbeat_s:g} s)"
                        break
                if why is None and not live.join_pending and _pending_newcomers(live, store):
                    live.join_pending = True  # the next optimizer step ends the epoch
            if why is not None:
                _fail_epoch(live, epoch, why, store)
        except Exception as e:  # the store gone: the launcher ended; the main thread will see it too
            _log.debug("rumor.elastic: live watcher: %s", e)


def _fail_epoch(live: _Live, epoch: int, why: str, store=None) -> None:
    """Marks epoch as over (once, here and in the store) and aborts this process's communicators,
    so that a collective blocked on a member that is gone fails now."""
    store = store or live.store
    with live.lock:
        if live.epoch != epoch or live.trouble is not None:
            return
        live.trouble, live.trouble_t = why, time.monotonic()
        # Under the lock: the main thread moves to the next epoch under it too, so these are
        # never the next epoch's communicators.
        if _runtime.is_initialized():
            st = _runtime.state()
            for g in [st.world] + list(st.groups):
                comm = getattr(g, "_comm", None)
                if comm is not None:
                    try:
                        comm.abort(f"live membership: {why}")
                    except Exception:
                        pass
        else:  # the epoch's init() may be connecting its members: a dead one would hold it
            _runtime.abort_forming(f"live membership: {why}")
    try:
        if store.compare_set(f"e{epoch}/abort", "", why).decode() == why:
            store.add("events", 1)
    except Exception:
        pass


# ---- newcomers and steps -----------------------------------------------------------------------

def _pending_newcomers(live: _Live, store=None) -> List[str]:
    """Newcomers that are ready and not settled, in number order."""
    store = store or live.store
    n = _count(store, "joinseq")
    out = []
    for j in range(1, n + 1):
        if j in live.settled:
            continue
        jid = f"j{j}"
        # Ready first: an idle spare (or a newcomer still importing) costs this one read per pass.
        if not store.check([f"ready/{jid}"]):
            continue
        if store.check([f"done/{jid}"]) or _count(store, f"dead/{jid}") > 0:
            live.settled.add(j)
            continue
        out.append(jid)
    return out


def _called_spares(live: _Live, store=None) -> List[str]:
    """Spares their launcher called in place of a failed worker that are not ready yet: a
    re-forming waits for them (they are ready within a poll), so that the change that removes
    the failed worker admits its replacement too."""
    store = store or live.store
    out = []
    for j in range(1, _count(store, "joinseq") + 1):
        jid = f"j{j}"
        if j in live.settled or not store.check([f"call/{jid}"]):
            continue
        if not store.check([f"ready/{jid}"]) and not store.check([f"done/{jid}"]):
            out.append(jid)
    return out


def before_step(quiet: bool = False) -> None:
    """Before each optimizer step (a hook rumor.elastic.run installs): newcomers are admitted
    here. The members need not reach this at the same step: one that stops here makes the
    others' next collective fail, and the new epoch starts from the state of the member that
    applied the most steps. With quiet (an algorithm whose steps may not communicate), an epoch
    the watcher ended ends the step here too, before the optimizer changes the weights."""
    live = _live
    if live is not None and quiet and live.trouble is not None:
        raise LiveRestart(f"rumor.elastic: epoch {live.epoch} is over: {live.trouble}")
    if live is not None and live.join_pending:
        _fail_epoch(live, live.epoch, "newcomers are waiting")
        raise LiveRestart("rumor.elastic: the group re-forms to admit newcomers")


def after_step() -> None:
    live = _live
    if live is not None:
        live.applied += 1


def wait_for_members(n: int, timeout: float) -> None:
    """Between steps, on every member: returns at once when the epoch has n members or more;
    otherwise waits until enough newcomers are ready, then raises LiveRestart so that the job
    re-forms with them (rumor.elastic.run calls the training function again from the same step).
    Raises TimeoutError when they are not there within timeout seconds."""
    live = _live
    if live is None:
        raise RuntimeError("rumor.elastic.wait_for_members: the job does not run live (rumor-run --live)")
    if len(live.members) >= n:
        return
    deadline = time.monotonic() + timeout
    while live.trouble is None and len(live.members) + len(_pending_newcomers(live)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rumor.elastic.wait_for_members: {len(live.members)} member(s) and "
                               f"{len(_pending_newcomers(live))} newcomer(s) after {timeout:g} s, {n} wanted")
        time.sleep(0.02)
    _fail_epoch(live, live.epoch, f"growing to {n} members")
    raise LiveRestart(f"rumor.elastic: re-forming with the newcomers ({n} members wanted)")


def refuse_ranks(ranks: List[int], why: str) -> bool:
    """Refuses the newcomers at these ranks of the epoch (they exit; the members re-form
    without them). False when one of them is not a newcomer of this epoch."""
    live = _live
    if live is None:
        return False
    ids = [live.members[r] for r in ranks]
    if not ids or any(m not in live.new for m in ids):
        return False
    for m in ids:
        live.store.set(f"done/{m}", f"refused: {why}")
    _log.warning("rumor.elastic: newcomer(s) %s refused: %s", ids, why)
    _fail_epoch(live, live.epoch, f"newcomer(s) {ids} refused")
    return True


def is_membership_failure(e: BaseException) -> bool:
    """Whether e ends the epoch (a peer gone, a collective aborted, a re-forming asked for) rather
    than being the script's own error."""
    return isinstance(e, RumorError) and not isinstance(e, (LiveDropped, ValueError))


# ---- a new epoch -------------------------------------------------------------------------------

def _alive(live: _Live, m: str, seen: dict, now: float) -> bool:
    if _count(live.store, f"dead/{m}") > 0:
        return False
    c = _count(live.store, f"hb/{m}")
    prev = seen.get(m)
    if prev is None or prev[0] != c:
        seen[m] = (c, now)
        return True
    return now - prev[1] <= live.heartbeat_s


def _refused(store, m: str) -> bool:
    return store.check([f"done/{m}"]) and store.get(f"done/{m}").decode().startswith("refused")


def reform(reason: str) -> Change:
    """After a failure, or to admit newcomers: leaves the epoch, agrees on the next one's
    members (the survivors that register, then the ready newcomers), and joins it through a
    fresh rumor.init(). Raises LiveDropped when this process is not among them."""
    live = _live
    assert live is not None
    t0 = live.trouble_t or time.monotonic()
    old_epoch, old = live.epoch, list(live.members)
    _fail_epoch(live, old_epoch, reason)
    if _runtime.is_initialized():
        live.timeout = _runtime.get_timeout()  # rumor.init(timeout=) or rumor.set_timeout() may have changed it
    timeout = live.timeout
    from .neighbor import ops as neighbor_ops, window as neighbor_windows

    if _runtime.is_initialized():  # else a re-forming that failed: what it carried still stands
        live.neighbors = (neighbor_ops.carry_topologies(), neighbor_windows.carry_windows())
    with live.lock:  # not while the watcher aborts these communicators
        _runtime.shutdown()
    store, nxt = live.store, old_epoch + 1
    flags = (["restoring"] if live.restoring else []) + (["unsynced"] if live.unsynced else [])
    store.set(f"e{nxt}/reg/{live.me}", ":".join([str(live.applied)] + flags))
    deadline = time.monotonic() + timeout
    seen: dict = {}
    sealed = None
    said_short = False
    mine = old.index(live.me)
    watch_until = 0.0  # while another member is the one to seal: when to look at the others again
    waiting: List[str] = []
    survivors: List[str] = []
    newcomers: List[str] = []
    while sealed is None:
        if store.check([f"e{nxt}/members"]):
            sealed = _read_members(store, nxt)
            break
        now = time.monotonic()
        if now > deadline:
            have = len(survivors) + len(newcomers)
            raise LiveDropped(f"rumor.elastic: epoch {nxt} did not form within {timeout:g} s: {have} member(s) "
                              f"{survivors + newcomers}, at least {live.min_size} wanted (RUMOR_LIVE_MIN); "
                              f"still waiting for {waiting or 'newcomers'}")
        if now < watch_until:
            time.sleep(0.005)
            continue
        waiting, survivors = [], []
        for i, m in enumerate(old):
            if store.check([f"e{nxt}/reg/{m}"]):
                # One ahead of this member that registered and died since would be a sealer that
                # never seals: left out, and the next in line seals.
                if i < mine and not _alive(live, m, seen, now):
                    continue
                survivors.append(m)
            elif _alive(live, m, seen, now) and not _refused(store, m):
                waiting.append(m)
        if survivors[0] != live.me:
            # The first registered member seals: the others only watch for its result, and look
            # at the rest again now and then (whether it still lives), so that the store answers
            # the sealer's reads first (an etcd cluster shares its CPU with the training).
            watch_until = now + 0.1
            continue
        regs = [store.get(f"e{nxt}/reg/{m}").decode().split(":") for m in survivors]
        restore = any("restoring" in r[1:] for r in regs)
        if not restore:
            waiting += [j for j in _called_spares(live) if _alive(live, j, seen, now)]
        newcomers = [] if restore else _pending_newcomers(live)
        size = len(survivors) + len(newcomers)
        if not waiting and size >= live.min_size:
            applied = [int(r[0]) for r in regs]
            top = max(applied)
            # The epoch's first recorded end, which every member's own error follows from (a
            # member whose peer left to re-form sees only a PeerError).
            key = f"e{old_epoch}/abort"
            first = store.get(key).decode() if store.check([key]) else ""
            unsynced = any("unsynced" in r[1:] for r in regs)
            body = {"members": survivors + newcomers, "new": newcomers, "reason": first or reason,
                    "source": applied.index(top), "applied": top, "restore": restore, "unsynced": unsynced,
                    "sync": bool(newcomers) or min(applied) != top or unsynced}
            store.compare_set(f"e{nxt}/members", "", _rendezvous.seal(_members_key(), f"{_MEMBERS_MAC}/{nxt}", body))
            sealed = _read_members(store, nxt)
            for j in sealed["new"]:  # the sealed ones: a member that took the one ahead for dead may have lost the race
                store.set(f"done/{j}", "admitted")
            store.set("epoch", str(nxt))  # newcomers look here for the epoch that admits them
            break
        if not waiting and size < live.min_size and not said_short:
            said_short = True
            _log.warning("rumor.elastic: %d member(s) left, fewer than RUMOR_LIVE_MIN=%d: waiting up to %g s "
                         "for newcomers", size, live.min_size, timeout)
        time.sleep(0.005)
    if live.me not in sealed["members"]:
        raise LiveDropped(f"rumor.elastic: {live.me} was left out of epoch {nxt} (it registered too late); "
                          "it ends here and its launcher starts it again as a newcomer")
    with live.lock:
        live.epoch, live.members, live.new = nxt, sealed["members"], sealed["new"]
    live.source, live.sync = sealed["source"], sealed["sync"]
    live.behind = live.applied < sealed["applied"] or (
        bool(sealed.get("unsynced")) and live.me != sealed["members"][sealed["source"]])
    live.target = sealed["applied"]
    live.restore_again = bool(sealed.get("restore"))
    _enter_epoch(live)
    live.reforming = True
    try:
        _runtime.init(timeout)
    finally:
        live.reforming = False
    # The topologies set in the old world, laid over this one (windows are made again by the
    # training function).
    if live.neighbors is not None:
        neighbor_ops.restore_topologies(live.neighbors[0])
        neighbor_windows.restore_windows(live.neighbors[1])
    # Told against the last epoch that trained here; who was admitted to a failed one and is
    # gone again (a refused newcomer) is told as leaving.
    base = live.seen or old
    change = Change(epoch=nxt, size=len(live.members), rank=live.members.index(live.me),
                    left=[m for m in base + [m for m in old if m not in base] if m not in live.members],
                    joined=[m for m in live.members if m not in base],
                    reason=sealed.get("reason", reason), degraded_s=time.monotonic() - t0)
    live.changes.append(change)
    _log.warning("rumor.elastic: epoch %d: %d member(s), rank %d; left %s, joined %s (%s); %.2f s without a group",
                 nxt, change.size, change.rank, change.left or "none", change.joined or "none", change.reason,
                 change.degraded_s)
    return change


def log_transfer(live: _Live, src: int) -> None:
    n, dt = live.transfer
    _log.warning("rumor.elastic: epoch %d: received the state (%.1f MB) from rank %d in %.3f s (%.2f Gbit/s)",
                 live.epoch, n / 1e6, src, dt, n * 8 / dt / 1e9 if dt > 0 else float("inf"))


def on_change(fn: Callable[[Change], None]) -> None:
    if not callable(fn):
        raise TypeError(f"rumor.elastic.on_change: expected a callable taking a Change, got {type(fn).__name__}")
    if fn not in _callbacks:
        _callbacks.append(fn)


def notify(change: Change) -> None:
    if _live is not None:
        _live.seen = list(_live.members)
    for fn in list(_callbacks):
        fn(change)


def finish() -> None:
    """The job's training ended on this member: newcomers still waiting are told so."""
    live = _live
    if live is None:
        return
    try:
        live.store.set("job_done", "1")
    except Exception:
        pass
    _stop_watcher()


def _stop_watcher() -> None:
    # Before the interpreter ends: a daemon thread still inside a store call while the process
    # tears down its C++ objects ends it with std::terminate.
    live = _live
    if live is not None and live.thread is not None:
        live.stop.set()
        live.thread.join(timeout=5)
        live.thread = None


def _interrupt() -> None:
    live = _live
    if live is not None and live.trouble is not None and not live.joined_fresh:
        raise LiveRestart(f"rumor.elastic: epoch {live.epoch} lost a member while it formed: {live.trouble}")


_runtime.before_init(_before_init)


def _after_init() -> None:
    if _live is not None:
        _runtime.state().live = True
        if _live.joined_fresh:
            _runtime.state().awaiting_state = True


def _init_failed(e: BaseException) -> bool:
    """The script's own rumor.init() failed (a member died while the first epoch formed): this
    process re-forms with the members that are left, and that init() returns in the new epoch,
    so the script goes on as if nothing happened. A newcomer's failure is its own (it exits and
    its launcher starts another); an init() inside reform() fails to reform's caller."""
    live = _live
    if live is None or live.joined_fresh or live.reforming or not is_membership_failure(e):
        return False
    why = f"{type(e).__name__}: {e}"
    # The failed attempt's frames hold its context, whose listening socket the next one may need
    # (a fixed RUMOR_PORT); the traceback keeps its lines.
    traceback.clear_frames(e.__traceback__)
    while True:
        try:
            notify(reform(why))  # the callbacks registered before init() (if any) hear of it
            return True
        except Exception as again:  # another member lost while this epoch formed: once more
            if not is_membership_failure(again):
                raise
            why = f"{type(again).__name__}: {again}"


_runtime.on_init(_after_init)
_runtime.on_init_failure(_init_failed)
_rendezvous.interrupt = _interrupt
atexit.register(_stop_watcher)
