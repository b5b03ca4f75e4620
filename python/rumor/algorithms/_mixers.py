"""The communication of AsyncModelAverage's rounds, one strategy per peer_selection: "all"
(a census, then an allreduce or, with every rank on one host, a shared arena) and the gossip
modes over one-sided windows. The algorithm (async_model_average.py) owns everything else: when
rounds run, the snapshots and deltas, abort/resume/finish."""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch

from .. import _C, _runtime
from .._tensor import address, dtype_code
from ..collectives import ReduceOp
from .decentralized import exp2_peers, ring_peers, shared_arena_possible, shift_one_peer

if TYPE_CHECKING:
    from .async_model_average import _Slot


class _Census:
    """What every rank's thread learnt from a round's census (the same on every rank)."""

    __slots__ = ("active", "paused", "leaving", "ranks", "roles")

    def __init__(self, active: int, paused: int, leaving: int, ranks: int, roles: Optional[List[int]] = None):
        self.active, self.paused, self.leaving, self.ranks = active, paused, leaving, ranks
        self.roles = roles  # shared arena: what each rank brings to the round (SharedArena roles)

    @property
    def contributors(self) -> int:
        return self.active + self.leaving

    @property
    def all_leaving(self) -> bool:
        return self.leaving == self.ranks


class _Mixer:
    """The communication of one averaging round for one peer selection mode. The algorithm owns
    the rest (when rounds run, snapshots, deltas, abort/resume/finish). Only the background
    thread calls these, after ``setup`` (called collectively from the algorithm's init).

    A collective mixer ("all") runs a census every round and its rounds are agreed by all ranks;
    a gossip mixer talks to one peer per round through one-sided windows and needs no agreement
    (the algorithm then runs ``_gossip_loop``)."""

    collective = True

    def setup(self, ddp, slots: List["_Slot"]) -> None:
        raise NotImplementedError

    def census(self, state: int, role: int = 0) -> _Census:
        """Tells the others what this rank does in this round and learns what they do (and,
        with a shared arena, what each one brings: ``role``)."""
        raise NotImplementedError

    def average(self, bufs: List[torch.Tensor], census: _Census) -> None:
        """Each buffer (one per flat weight buffer, in the same order on every rank) holds this
        rank's contribution, zeros if it does not contribute; replaces it with the average of
        the contributors'."""
        raise NotImplementedError

    def final(self, slots: List[_Slot]) -> None:
        """Every rank is idle in finish(): averages the weights themselves, in place."""
        raise NotImplementedError


class _AllMixer(_Mixer):
    """"all": a census allreduce then one allreduce per flat buffer over every rank, on a
    communicator that only the background thread uses.

    When every rank is on this host (and shared memory is on), float32/float64 weights and
    deltas live in a shared arena, like DDP's shared buckets (the parameters become views into
    it), and a round is one ``SharedArena.average_into_deltas`` per buffer: the owner of each
    block reads every contributor's weights in place, once per element, and writes each
    contributor's ``average - weights`` into that rank's delta. Per rank and round that is one
    read of the model and one (cache-bypassing) write in the exchange, and the add of the delta
    at the next forward: about 5x the model through memory, against 7x with snapshots in the
    arena and 10x with private buffers and an allreduce.

    Reading a peer's weights while it trains: the owner may read them in the middle of the
    peer's optimizer step (as the snapshot copy of the other paths may), so the average can mix
    elements from just before and just after a step. That is harmless for asynchronous
    averaging (each element is a value its rank held, at most one step old), and the delta rule
    still keeps every bit of local progress: each element's delta is computed from the very
    value that went into the sum, so ``x + delta`` is the average plus whatever the rank's
    optimizer did since the read. A rank's result that is not applied yet is contributed as
    ``x + delta`` (role 2) and its new delta replaces it in place."""

    def setup(self, ddp, slots) -> None:
        # Every rank wrapping the model calls this at the same point, as rumor.new_group needs.
        self.group = _runtime.new_group(ddp.group.ranks)
        self.comm = self.group._comm
        self._word = torch.zeros(4 + self.comm.size, dtype=torch.int64)
        self._algo = 0  # auto
        self.arena = None
        fits = all(s.x.dtype in (torch.float32, torch.float64) for s in slots)
        # CUDA parameters: the slots hold a host mirror of the weights, not the parameters
        # themselves, so the shared arena (peers reading the parameters in place) does not apply.
        if fits and ddp._device_mode is None and shared_arena_possible(self.comm):
            offsets, total = [], 0
            for s in slots:
                size = (s.x.numel() * s.x.element_size() + 63) // 64 * 64
                offsets.append((total, total + size))
                total += 2 * size
            # Collective: every rank has the same slots (same model) in the same order.
            self.arena = _C.SharedArena(self.comm, total)
            for s, (a, b) in zip(slots, offsets):
                x, delta = (torch.frombuffer(self.arena, dtype=s.x.dtype, count=s.x.numel(), offset=at)
                            for at in (a, b))
                s.use_shared(x, delta)

    def _allreduce(self, t: torch.Tensor, code: int, op: ReduceOp) -> None:
        # Blocking, GIL released by the binding (the training thread keeps computing).
        self.comm.allreduce(address(t), t.numel(), code, int(op), self._algo, False)

    def census(self, state: int, role: int = 0) -> _Census:
        w = self._word
        w.zero_()
        w[state] = 1
        w[3] = 1
        w[4 + self.comm.rank] = role
        self._allreduce(w, 5, ReduceOp.SUM)  # int64
        a, p, l, n, *roles = (int(v) for v in w.tolist())
        return _Census(a, p, l, n, roles)

    def average(self, bufs: List[torch.Tensor], census: _Census) -> None:
        everyone = census.contributors == census.ranks
        for b in bufs:
            # With everyone contributing, AVG divides once inside the reduction; otherwise the
            # non-contributors' zeros are summed in and the sum is divided by the contributors.
            self._allreduce(b, dtype_code(b.dtype, "AsyncModelAverage"), ReduceOp.AVG if everyone else ReduceOp.SUM)
            if not everyone:
                b.div_(census.contributors)

    def average_shared(self, slots: List["_Slot"], census: _Census) -> None:
        """Shared slots: every contributor's delta <- the mean of the contributions - its
        weights (see the class docstring)."""
        for s in slots:
            self.arena.average_into_deltas(address(s.x), address(s.delta), s.x.numel(),
                                           dtype_code(s.x.dtype, "AsyncModelAverage"), census.roles)

    def final(self, slots: List[_Slot]) -> None:
        for s in slots:
            code = dtype_code(s.x.dtype, "AsyncModelAverage")
            if s.shared:  # the weights are in the arena: read in place, the same bits everywhere
                self.arena.allreduce(address(s.x), s.x.numel(), code, int(ReduceOp.AVG))
            else:
                self._allreduce(s.x, code, ReduceOp.AVG)


class _GossipMixer(_Mixer):
    """"ring", "shift_one", "exp2": gossip over one-sided windows. Each round this rank puts its
    weights into its peers' windows (a passive write: the peer does nothing and waits for
    nobody), then averages its weights with the values that arrived in its own window since its
    last round (x <- (x + sum of fresh x_j) / (1 + number of fresh senders)). The peers are
    Decentralized's schedules for the same names (rumor.algorithms.decentralized), with this
    thread's own round count:

      ring       both ring neighbours, rank - 1 and rank + 1, every round;
      shift_one  the round-robin partner (shift_one_peer): every other rank in turn, no put
                 in the rounds where this rank sits out (an odd number of ranks);
      exp2       rank + 2^(round mod ceil(log2 n)): the one-peer exponential graph.

    A slow rank only means older values in its peers' windows; nobody ever waits for it. This
    is gossip averaging: replicas converge towards each other, but unlike "all" a round is not
    an exact average of everyone (finish() ends with one exact average)."""

    collective = False

    def __init__(self, mode: str):
        self.mode = mode
        self.round = 0
        self.mixed = 0  # rounds in which fresh values from some peer were averaged in

    def setup(self, ddp, slots) -> None:
        from ..neighbor import window

        world = list(range(_runtime.size()))
        if list(ddp.group.ranks) != world:
            raise ValueError(f"AsyncModelAverage: peer_selection={self.mode!r} gossips over the whole world; "
                             f"the wrapper's group is {ddp.group.ranks}")
        self.n, self.me = len(world), _runtime.rank()
        self.group = _runtime.new_group(world)  # finish()'s exact average, off the training thread's comm
        self.comm = self.group._comm
        self._win = window
        self.names = []
        for k, s in enumerate(slots):
            # The window's value is ``work``: what a round sends and where its average lands.
            # Named by the group, whose id every rank agrees on (a process-wide count would not
            # be: a member that re-formed under live membership has made more than a newcomer).
            name = f"rumor.async_model_average.{self.group.id}.{k}"
            window.win_create(s.work, name, zero_init=True)
            self.names.append(name)

    def peers(self) -> List[int]:
        """Whose windows this round's put goes to."""
        n, r, t = self.n, self.me, self.round
        if self.mode == "ring":
            return ring_peers(n, r)
        if self.mode == "shift_one":
            p = shift_one_peer(n, r, t)
            return [] if p is None else [p]
        return [exp2_peers(n, r, t)[0]]

    def _put(self, hub, w, b, dsts: List[int], timeout: float) -> None:
        assert b.data_ptr() == w.tensor.data_ptr()
        if dsts:
            hub.wait(hub.put(w.id, b.data_ptr(), [(d, 1.0) for d in dsts], False, False, False, timeout), timeout)

    def average(self, bufs: List[torch.Tensor], census=None) -> None:
        """Puts each buffer to this round's peer, then averages it with the fresh slots."""
        if self.n < 2:
            return
        dsts = self.peers()
        got_any = False
        hub = self._win.registry().hub
        timeout = self._win._timeout()
        for name, b in zip(self.names, bufs):
            w = self._win.find_window(name, "AsyncModelAverage")
            self._put(hub, w, b, dsts, timeout)
            fresh = [j for j, v in enumerate(hub.versions(w.id)) if v > 0]
            u = 1.0 / (1 + len(fresh))
            # In place on b (the window's value); the versions of the slots read drop to 0.
            hub.update(w.id, u, [(j, u) for j in fresh], False, False, b.data_ptr(), False, timeout)
            got_any = got_any or bool(fresh)
        self.round += 1
        self.mixed += int(got_any)

    def push(self, bufs: List[torch.Tensor]) -> None:
        """A finished rank's round: its fixed weights go to this round's peer, nothing is mixed
        in, so the ranks still training keep averaging with its final progress."""
        if self.n < 2:
            return
        dsts = self.peers()
        hub = self._win.registry().hub
        timeout = self._win._timeout()
        for name, b in zip(self.names, bufs):
            self._put(hub, self._win.find_window(name, "AsyncModelAverage"), b, dsts, timeout)
        self.round += 1

    def free(self) -> None:
        for name in self.names:
            self._win.win_free(name)
        self.names = []


def _make_mixer(mode: str) -> _Mixer:
    if mode == "all":
        return _AllMixer()
    return _GossipMixer(mode)
