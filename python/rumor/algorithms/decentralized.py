"""Decentralized SGD: every rank averages its WEIGHTS with a few peers instead of allreducing
gradients (see docs/decentralized_training.md for the update rule and the peer schedules)."""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from .. import _C, _runtime
from .._tensor import address, dtype_code
from ..engine.flat import FlatWeights
from .base import Algorithm

# The peer selections of the weight-averaging algorithms, one meaning each (Decentralized,
# LowPrecisionDecentralized and AsyncModelAverage accept those that make sense for them):
#   all        the average over every rank
#   shift_one  one partner per round, a round-robin pairing (shift_one_peer)
#   exp2       one peer per round at distance 1, 2, 4, ... (exp2_peers)
#   ring       both ring neighbours (rank - 1, rank + 1) every round, 1/3 each (two ranks: 1/2)
PEER_SELECTIONS = ("all", "shift_one", "exp2", "ring")

# (average_all, self_weight, [(src, weight)], [dst]) in the ranks of the communicator that mixes.
Plan = Tuple[bool, float, List[Tuple[int, float]], List[int]]


# ---- peer schedules (pure functions: the tests' reference uses the same ones) ---------------

def shift_one_peer(n: int, rank: int, round_: int) -> Optional[int]:
    """This rank's partner in communication round ``round_``, or None when it sits out.

    A round-robin tournament (circle method): with n even every rank has a partner in every
    round; with n odd one rank per round sits out (it pairs with a phantom). Over n' - 1
    consecutive rounds (n' = n rounded up to even) every pair of ranks meets exactly once.
    """
    if n <= 1:
        return None
    n_even = n + (n % 2)
    m = n_even - 1  # odd: the ranks that rotate; rank m (phantom when n is odd) stays put
    r = round_ % m
    if rank == m:
        partner = r
    elif rank == r:
        partner = m
    else:
        partner = (2 * r - rank) % m
    return None if partner >= n else partner


def exp2_peers(n: int, rank: int, round_: int) -> Optional[Tuple[int, int]]:
    """(send to, receive from) in round ``round_`` of the one-peer exponential graph: the
    distance cycles through 1, 2, 4, ... (the powers of two below n)."""
    if n <= 1:
        return None
    powers = max(1, math.ceil(math.log2(n)))
    d = 2 ** (round_ % powers)
    return (rank + d) % n, (rank - d) % n


def ring_peers(n: int, rank: int) -> list:
    """This rank's ring neighbours: [rank - 1, rank + 1] mod n, one of them when n == 2, none
    when n == 1."""
    if n <= 1:
        return []
    left, right = (rank - 1) % n, (rank + 1) % n
    return [left] if left == right else [left, right]


def check_peer_selection(owner: str, value, accepted, why: str = "", topology: bool = False):
    """A peer_selection argument checked against what ``owner`` accepts (a subset of
    PEER_SELECTIONS, plus a topology when ``topology``). ``why`` says why the others make no sense
    there; returns the value, or its weight matrix for a topology."""
    what = ", ".join(repr(m) for m in accepted) + (" or a topology" if topology else "")
    if isinstance(value, str):
        if value in accepted:
            return value
        if value in PEER_SELECTIONS:
            raise ValueError(f"{owner}: peer_selection={value!r} is not supported{why}; expected {what}")
        raise ValueError(f"{owner}: unknown peer_selection {value!r}; expected {what}")
    if topology:
        return topology_matrix(value)
    raise TypeError(f"{owner}: peer_selection must be {what}{why}; got {type(value).__name__}")


def topology_matrix(topology) -> torch.Tensor:
    """The weight matrix of a topology as float64 [n, n], W[i, j] = weight of edge i -> j
    (row = sender). Accepts a rumor.topology.Topology, a networkx graph (edge attribute
    'weight', BlueFog style) or a square matrix (tensor, numpy array, nested lists) of finite
    non-negative weights."""
    import networkx as nx
    import numpy as np

    from ..topology import Topology

    if isinstance(topology, torch.Tensor):
        topology = topology.detach().cpu().double().numpy()
    if not isinstance(topology, (Topology, nx.Graph, np.ndarray, list, tuple)):
        raise TypeError("peer_selection: expected 'all', 'shift_one', 'exp2', 'ring' or a topology (rumor.topology.Topology, "
                        f"networkx graph or square weight matrix), got {type(topology).__name__}")
    return torch.from_numpy(np.array(Topology(topology).weights, dtype=np.float64))


def mixing_plan(peer_selection, n: int, rank: int, round_: int) -> Plan:
    """What rank ``rank`` of ``n`` does in communication round ``round_``."""
    if isinstance(peer_selection, str):
        if peer_selection == "all":
            return True, 1.0, [], []
        if peer_selection == "shift_one":
            p = shift_one_peer(n, rank, round_)
            return (False, 1.0, [], []) if p is None else (False, 0.5, [(p, 0.5)], [p])
        if peer_selection == "exp2":
            peers = exp2_peers(n, rank, round_)
            if peers is None:
                return False, 1.0, [], []
            dst, src = peers
            return False, 0.5, [(src, 0.5)], [dst]
        if peer_selection == "ring":
            peers = ring_peers(n, rank)
            w = 1.0 / (1 + len(peers))
            return False, w, [(p, w) for p in peers], list(peers)
        raise ValueError(f"unknown peer_selection {peer_selection!r}")
    w = peer_selection if isinstance(peer_selection, torch.Tensor) else topology_matrix(peer_selection)
    srcs = [(j, float(w[j, rank])) for j in range(n) if j != rank and float(w[j, rank]) != 0.0]
    dsts = [j for j in range(n) if j != rank and float(w[rank, j]) != 0.0]
    return False, float(w[rank, rank]), srcs, dsts


def mixing_matrix(peer_selection, n: int, round_: int) -> torch.Tensor:
    """W (float64, [n, n]) of one round: rank i's new weights are sum_j W[j, i] x_j."""
    w = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        average_all, self_w, srcs, _ = mixing_plan(peer_selection, n, i, round_)
        if average_all:
            w[:, i] = 1.0 / n
            continue
        w[i, i] = self_w
        for j, wj in srcs:
            w[j, i] = wj
    return w


# ---- the algorithm --------------------------------------------------------------------------

def shared_arena_possible(comm) -> bool:
    """Whether the weights of an average over this communicator can live in a shared arena:
    several ranks, all on this host, shared memory on (host-memory weights are the caller's part).
    Decentralized's whole-host mixes and AsyncModelAverage's "all" rounds use it."""
    return (comm.size > 1 and comm.all_local and comm.uses_shm
            and _runtime.env_bool("RUMOR_SHARED_BUCKETS", True))


def _check_interval(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"communication_interval must be an integer >= 1, got {k!r}")
    return k


def _host_layout(group) -> Tuple[int, int, int]:
    """(number of hosts, this rank's host index, ranks on this host) for a group, with hosts
    in order of their lowest rank: the order of the C++ core's host-leader communicator."""
    st = _runtime.state()
    hosts: List[str] = []
    for r in group.ranks:
        if st.hosts[r] not in hosts:
            hosts.append(st.hosts[r])
    mine = st.hosts[st.env.rank]
    return len(hosts), hosts.index(mine), sum(1 for r in group.ranks if st.hosts[r] == mine)


class Decentralized(Algorithm):
    """Decentralized SGD: ranks average model weights with peers; gradients stay local.

    Each step that communicates (every ``communication_interval``-th), the exchange of the
    current weights x_t starts on the comm thread before forward and runs while forward and
    backward compute the local gradient g_t at x_t. At the end of backward the mixed weights
    replace the parameters, and ``optimizer.step()`` then applies g_t to them::

        x_{t+1} = sum_j W_t[j, i] * x_t^(j)  -  (optimizer update from g_t^(i))

    peer_selection (W_t):
      "all"        average over every rank (an allreduce of the weights: every rank holds the same
                   bits before it applies its own gradient)
      "shift_one"  one peer per step, 1/2 each; a round-robin pairing that changes every
                   communication and also works for an odd number of ranks (one sits out)
      "exp2"       one-peer exponential graph: send to rank + 2^k, receive from rank - 2^k,
                   k cycling over the powers of two below the world size; 1/2 each
      "ring"       both ring neighbours every step, 1/3 each (rank - 1, itself, rank + 1;
                   with two ranks the one neighbour, 1/2)
      a topology   static: W from a rumor.topology.Topology (W[i, j] = weight of edge i -> j),
                   a networkx DiGraph or a square matrix; its size must be the world size
                   (or the number of hosts when hierarchical)
    hierarchical: average inside each host over shared memory first, mix among one leader per
      host (the schedules then run over hosts), broadcast inside the host. On a single host
      that is an exact average over all ranks whatever the peer selection.
    """

    _SWAP_MIN_MEAN = 16384  # elements per parameter from which the buffers swap roles
    elastic_consensus = True  # the ranks' replicas differ: a commit keeps their average

    def __init__(self, peer_selection="all", communication_interval: int = 1, hierarchical: bool = True):
        checked = check_peer_selection("Decentralized", peer_selection, PEER_SELECTIONS, topology=True)
        self._matrix = None if isinstance(checked, str) else checked
        self.peer_selection = peer_selection
        self.communication_interval = _check_interval(communication_interval)
        self.hierarchical = bool(hierarchical)
        self.step = 0       # backward passes so far
        self.rounds = 0     # communications so far
        self._pending = None
        self._live_mark = None  # (weights, step, rounds) after the last applied step, under rumor-run --live

    # The communicator that runs the schedule: hosts when hierarchical, else ranks.
    def _layout(self, ddp) -> Tuple[int, int]:
        if self.hierarchical:
            hosts, host, _ = _host_layout(ddp.group)
            return hosts, host
        return ddp.group.size(), ddp.group.rank()

    def init(self, ddp) -> None:
        n, me = self._layout(ddp)
        self._n, self._me = n, me  # the schedule's nodes, fixed for the wrapper's life
        if self._matrix is not None and self._matrix.shape[0] != n:
            hint = (" (with hierarchical=True the topology is over hosts; pass hierarchical=False to mix ranks)"
                    if self.hierarchical else "")
            unit = "hosts" if self.hierarchical else "ranks"
            raise ValueError(f"Decentralized: the topology has {self._matrix.shape[0]} nodes but the job has {n} "
                             f"{unit}{hint}")
        self._flat = FlatWeights(ddp._params, ddp._cap_bytes, "Decentralized")
        # Two buffer sets: the parameters live in one while the mix writes into the other;
        # after the mix the parameters are re-pointed at the output (no copy of the model).
        self._bufs = [list(self._flat.flats), [torch.empty_like(f) for f in self._flat.flats]]
        total = sum(p.numel() for p in ddp._params)
        self._swap = total >= self._SWAP_MIN_MEAN * max(1, len(ddp._params))
        self._cur = 0  # which buffer set holds the parameters
        self._device_mix = None
        self._arena = None
        if ddp._device_mode is not None:
            # On a CUDA device the mix is a task of the wrapper's DeviceEngine, on its
            # communication stream: on the device over NCCL, else through host memory.
            from ..engine.ops import WeightMix

            comm = ddp.group._comm
            staged = not ddp._device_nccl or (self.hierarchical and not comm.all_local)
            self._device_mix = WeightMix(comm, self.hierarchical, staged, ddp._engine.layer)
            return
        self._arena = arena = self._move_to_arena(ddp)
        self._ops = [[_C.WeightMixOp(address(a), address(b), a.numel(), dtype_code(a.dtype, "Decentralized"),
                                     self.hierarchical, arena) for a, b in zip(self._bufs[c], self._bufs[1 - c])]
                     for c in (0, 1)]
        for a, b in zip(*self._ops):  # one mix in flight at a time: one receive buffer
            b.share_scratch(a)

    def _move_to_arena(self, ddp):
        """Where every round is an average over the host (every rank on it, and hierarchical or
        'all'), both buffer sets move into a shared arena and the parameters become views into
        it: the mix then reads the peers' weights in place (WeightMixOp with the arena). Returns
        the arena, or None where the buffers stay private."""
        comm = ddp.group._comm
        if not (shared_arena_possible(comm) and (self.hierarchical or self.peer_selection == "all")
                and self._matrix is None):
            return None
        sizes = [(f.numel() * f.element_size() + 63) // 64 * 64 for f in self._flat.flats]
        # Collective: every rank has the same model, so the same buffers in the same order.
        arena = _C.SharedArena(comm, 2 * sum(sizes))
        at, sets = 0, [[], []]
        for c in (0, 1):
            for f, size in zip(self._flat.flats, sizes):
                sets[c].append(torch.frombuffer(arena, dtype=f.dtype, count=f.numel(), offset=at))
                at += size
        with torch.no_grad():
            for f, a in zip(self._flat.flats, sets[0]):
                a.copy_(f)
        self._flat.flats = sets[0]
        self._flat.repoint(copy=False)
        self._bufs = sets
        return arena

    def bucket_op(self, ddp, bucket):
        return _C.local_op()

    def has_device_ops(self, ddp, nccl: bool) -> bool:
        return True  # backward communicates nothing; the weight mix picks its own path (init)

    def device_bucket_op(self, ddp, bucket):
        from ..engine.ops import LocalOp

        return LocalOp()

    def elastic_state_dict(self):
        """The algorithm's own part of a rumor.elastic commit: the position in the peer schedule,
        so that a restarted job mixes with the peers it would have had next.

        Returns:
            A dict with ``step`` (backward passes so far) and ``rounds`` (communications so far).
        """
        return {"step": self.step, "rounds": self.rounds}

    def load_elastic_state_dict(self, sd) -> None:
        """Restores the schedule position saved by elastic_state_dict() (rumor.elastic calls it
        after loading the model and the optimizer).

        Args:
            sd: the dict elastic_state_dict() returned.

        Raises:
            KeyError: sd lacks ``step`` or ``rounds``.
        """
        self.step, self.rounds = int(sd["step"]), int(sd["rounds"])

    # Live membership (rumor-run --live): the exchange starts before forward and its result
    # replaces the weights at the end of backward, so a step given up puts back the weights and
    # the schedule's position of the last applied step. At a change the members start from the
    # average of their replicas (rumor.elastic), and init() lays the same graph family over the
    # new world's ranks; its weights (1/2, 1/3, ...) keep W doubly stochastic, so the replicas
    # still converge to their average. A topology given as a matrix has a fixed size: not live.
    @property
    def elastic_live(self) -> bool:
        """Whether live membership can run this Decentralized: with a named peer selection
        ('all', 'shift_one', 'exp2', 'ring'), which is laid again over each new world; not with a
        topology, whose size is fixed."""
        return self._matrix is None

    def elastic_live_mark(self) -> None:
        """Keeps a copy of the weights and the schedule's position."""
        self._flat.ensure_views()
        self._live_mark = ([f.clone() for f in self._flat.flats], self.step, self.rounds)

    def elastic_live_undo(self) -> None:
        """Puts back the weights and the schedule's position of the last mark; the exchange in
        flight is dropped (its communicator is being shut down)."""
        if self._live_mark is None:
            return
        flats, self.step, self.rounds = self._live_mark
        self._pending = None
        self._flat.ensure_views()
        with torch.no_grad():
            for f, m in zip(self._flat.flats, flats):
                f.copy_(m)

    def plan(self, ddp, round_: int) -> Plan:
        """What this rank (or, when hierarchical, this rank's host) does in one communication
        round under the algorithm's peer selection. Valid after init().

        Args:
            ddp: the wrapper.
            round_: the index of the communication round (0 for the first).

        Returns:
            A tuple (average_all, self_weight, sources, destinations): average_all is True when
            the round is an average over every node; otherwise the new weights are self_weight
            times this node's own plus the sum of weight times x_src over the (src, weight)
            pairs of sources, and this node's weights go to every node in destinations. Nodes
            are ranks of the wrapper's group, or host indices when hierarchical.
        """
        sel = self._matrix if self._matrix is not None else self.peer_selection
        return mixing_plan(sel, self._n, self._me, round_)

    def before_forward(self, ddp) -> None:
        if self._pending is not None or not torch.is_grad_enabled():
            return
        if self.step % self.communication_interval != 0:
            return
        self._flat.ensure_views()
        plan = self.plan(ddp, self.rounds)
        if self._device_mix is not None:
            mix, ins, outs = self._device_mix, self._bufs[self._cur], self._bufs[1 - self._cur]
            timeout = ddp._timeout
            self._pending = ddp._engine.submit(lambda tp, stream: mix.run(tp, ins, outs, plan, stream, timeout),
                                               "rumor Decentralized: weight mix", inline=not mix.staged)
            return
        average_all, self_w, srcs, dsts = plan
        self._pending = _C.weight_mix(ddp.group._comm, self._ops[self._cur], average_all, self_w, srcs, dsts, True)

    def __del__(self):
        # The comm thread may still be reading the weight buffers and writing the output
        # buffers, which this object owns: let it finish before they are freed.
        work = getattr(self, "_pending", None)
        if work is not None:
            try:
                work.wait(60.0)
            except Exception:  # noqa: BLE001 - the error belongs to a step nobody waits for
                pass

    def after_backward(self, ddp) -> None:
        self.step += 1
        work, self._pending = self._pending, None
        if work is None:
            return
        work.wait(ddp._timeout)
        if self._swap:
            self._cur = 1 - self._cur
            self._flat.flats = self._bufs[self._cur]
            self._flat.repoint(copy=False)
        else:
            with torch.no_grad():
                for flat, out in zip(self._bufs[self._cur], self._bufs[1 - self._cur]):
                    flat.copy_(out)
        self.rounds += 1
