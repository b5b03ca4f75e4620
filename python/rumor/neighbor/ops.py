"""BlueFog-style neighbor operations over graph topologies.

Conventions (as in BlueFog): W[i, j] is the weight of the edge i -> j (row = sender), and
neighbor_allreduce computes on every rank i

    x_i <- self_weight * x_i + sum over sources j of src_weights[j] * (dst weight of j for i) * x_j

Static mode (no dst_weights) follows the topology set by set_topology(): sources are the
in-neighbors, destinations the out-neighbors; the weights are uniform (1 / (in_degree + 1) for
self and every source) unless the topology was set with is_weighted=True, in which case the
receiver uses column i of W. Dynamic mode (dst_weights given) takes the lists from the call:
every rank names whom it sends to and whom it receives from, and enable_topo_check verifies
that these agree before any data moves (a ValueError on every rank otherwise).

Ranks in these calls are global ranks; machine ranks (hierarchical ops) are rumor.machine_rank()
values.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import _C, _runtime
from ..gpu import routing
from .._runtime import Group, communicator
from .._tensor import address, check_movable, check_tensor, dtype_tag
from .._host_collectives import Handle, run as _run
from ..topology import ExponentialGraph, Topology

__all__ = [
    "set_topology",
    "load_topology",
    "set_machine_topology",
    "load_machine_topology",
    "in_neighbor_ranks",
    "out_neighbor_ranks",
    "in_neighbor_machine_ranks",
    "out_neighbor_machine_ranks",
    "neighbor_allreduce",
    "neighbor_allreduce_nonblocking",
    "neighbor_allgather",
    "neighbor_allgather_nonblocking",
    "hierarchical_neighbor_allreduce",
    "hierarchical_neighbor_allreduce_nonblocking",
]

_FLOAT_CODES = {0, 1, 2, 3}  # float32, float16, bfloat16, float64 (rumor::DType)
_ELEMENT_BYTES = {0: 4, 1: 2, 2: 2, 3: 8, 4: 4, 5: 8, 6: 1}
_MAX_DIMS = 8


class _Topologies:
    """The topologies of one rumor.init() (kept on the runtime state, so shutdown drops them)."""

    def __init__(self, size: int, machine_size: int):
        self._topo = ExponentialGraph(size)
        self.weighted = False
        self._machine_topo = ExponentialGraph(machine_size)
        self.machine_weighted = False
        # Whether the user set each (set_topology / set_machine_topology): live membership lays
        # such a topology over the next world; the defaults are made for it anyway.
        self.topo_set = self.machine_set = False
        # Why a topology carried over from an earlier live epoch cannot serve this one (a fixed
        # graph of another world): raised by every use until it is set again.
        self.stale: Dict[str, str] = {}
        # One reusable receive/scale buffer set per communicator (group id), so repeated calls
        # do not allocate and fault in fresh pages; a communicator runs one operation at a time.
        self.scratch = {}

    @property
    def topo(self) -> Topology:
        if "topo" in self.stale:
            raise ValueError(self.stale["topo"])
        return self._topo

    @topo.setter
    def topo(self, t: Topology) -> None:
        self._topo = t
        self.stale.pop("topo", None)

    @property
    def machine_topo(self) -> Topology:
        if "machine_topo" in self.stale:
            raise ValueError(self.stale["machine_topo"])
        return self._machine_topo

    @machine_topo.setter
    def machine_topo(self, t: Topology) -> None:
        self._machine_topo = t
        self.stale.pop("machine_topo", None)

    def scratch_for(self, g: Group):
        s = self.scratch.get(g.id)
        if s is None:
            s = self.scratch[g.id] = _C.NeighborScratch()
        return s


def _topologies() -> _Topologies:
    st = _runtime.state()
    t = getattr(st, "_rumor_topologies", None)
    if t is None:
        t = _Topologies(st.env.size, st.machine_size)
        st._rumor_topologies = t
    return t


def _as_topology(topo, what: str) -> Topology:
    if isinstance(topo, Topology):
        return topo
    try:
        return Topology(topo)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _check_same_everywhere(fingerprint: int, what: str, kind: str) -> None:
    """Every rank must set the same topology: gather the fingerprints and compare (every rank
    sees the same table, so every rank raises the same error)."""
    st = _runtime.state()
    if st.awaiting_state:
        return  # a live newcomer: checked at the change, check_topologies_agree()
    g = st.world
    n = g.size()
    table = torch.zeros(n, dtype=torch.int64)
    table[g._comm.rank] = fingerprint
    g._comm.allgather(address(table), [1] * n, 5, False)
    differ = [r for r in range(n) if int(table[r]) != int(table[0])]
    if differ:
        raise ValueError(f"{what}: ranks {differ} set a different {kind} than rank 0; "
                         "every rank must pass the same topology and is_weighted")


def _verified_topology(topo, is_weighted: bool, size: int, unit: str, kind: str, what: str) -> Topology:
    """topo as a Topology of `size` nodes (None: ExponentialGraph(size)), checked to be the same
    on every rank (a collective)."""
    t = ExponentialGraph(size) if topo is None else _as_topology(topo, what)
    if t.size != size:
        raise ValueError(f"{what}: the topology has {t.size} {unit}, the job has {size}")
    _check_same_everywhere(t.fingerprint() ^ (1 if is_weighted else 0), what, kind)
    return t


def set_topology(topo=None, is_weighted: bool = False) -> bool:
    """Sets the static topology for neighbor_allreduce / neighbor_allgather (a Topology, a
    networkx.DiGraph or an n x n weight matrix; None = ExponentialGraph(size)). Every rank must
    call it with the same topology: a cheap allgather of a fingerprint checks this and raises
    ValueError on every rank if they differ. is_weighted: use the matrix's weights instead of
    uniform ones. Returns True.

    Args:
        topo: a Topology, a networkx.DiGraph or an n x n weight matrix; None (the default) means
            ExponentialGraph(size).
        is_weighted: if True (default False), use the topology's weights instead of uniform ones.

    Raises:
        ValueError: the ranks passed different topologies, or its size is not rumor.size().
    """
    t = _verified_topology(topo, is_weighted, _runtime.state().env.size, "ranks", "topology", "rumor.set_topology")
    tops = _topologies()
    tops.topo, tops.weighted, tops.topo_set = t, bool(is_weighted), True
    return True


def load_topology() -> Topology:
    """The static topology (ExponentialGraph(size) until set_topology() is called)."""
    return _topologies().topo


def set_machine_topology(topo=None, is_weighted: bool = False) -> bool:
    """Sets the topology among machines for hierarchical_neighbor_allreduce (size =
    rumor.machine_size(); None = ExponentialGraph(machine_size)). Same rules as set_topology.

    Args:
        topo: a Topology, networkx.DiGraph or weight matrix over machines; None (the default)
            means ExponentialGraph(machine_size).
        is_weighted: if True (default False), use its weights instead of uniform ones.

    Returns:
        True.

    Raises:
        ValueError: the ranks passed different topologies, or its size is not machine_size().
    """
    t = _verified_topology(topo, is_weighted, _runtime.state().machine_size, "machines", "machine topology",
                           "rumor.set_machine_topology")
    tops = _topologies()
    tops.machine_topo, tops.machine_weighted, tops.machine_set = t, bool(is_weighted), True
    return True


# Where a live job makes what a change of membership does not carry (error messages).
LIVE_WHERE = ("the training function, which rumor.elastic.run calls again after every change of membership, "
              "or in a rumor.elastic.on_change callback")


def check_topologies_agree(what: str) -> None:
    """Collective over the world, on every member after a live membership change: the members'
    topologies (and machine topologies), with their weighting, must be the same; raises
    ValueError on every rank naming those that differ. A newcomer's set_topology() made before
    it joined was not compared when it was made (awaiting_state); it is here."""
    st = _runtime.state()
    st.awaiting_state = False
    tops = _topologies()
    g = st.world
    n = g.size()
    table = torch.zeros(2 * n, dtype=torch.int64)
    for i, (attr, weighted) in enumerate((("topo", tops.weighted), ("machine_topo", tops.machine_weighted))):
        t = getattr(tops, "_" + attr)
        # -1: a fixed graph of an earlier world, refused at its first use
        table[g._comm.rank * 2 + i] = -1 if attr in tops.stale else t.fingerprint() ^ (1 if weighted else 0)
    g._comm.allgather(address(table), [2] * n, 5, False)
    rows = table.view(n, 2)
    differ = [r for r in range(n) if not torch.equal(rows[r], rows[0])]
    if differ:
        raise ValueError(f"{what}: ranks {differ} hold a different topology (or machine topology) than rank 0; "
                         f"a newcomer sets the one the members have (a graph family over the new world), or "
                         f"every member sets it again in {LIVE_WHERE}")


class TopologyCarry:
    """The topologies the user set in one live epoch's rumor.init(), with their weighting, made
    by carry_topologies() before the old world shuts down and laid over the next one by
    restore_topologies()."""

    def __init__(self, topo, weighted, machine_topo, machine_weighted):
        self.topo, self.weighted = topo, weighted
        self.machine_topo, self.machine_weighted = machine_topo, machine_weighted


def carry_topologies() -> Optional[TopologyCarry]:
    """The topologies the user set in the current rumor.init(), or None where it set none (the
    next world's defaults then serve)."""
    tops = getattr(_runtime.state(), "_rumor_topologies", None)
    if tops is None or not (tops.topo_set or tops.machine_set):
        return None
    return TopologyCarry(tops._topo if tops.topo_set else None, tops.weighted,
                         tops._machine_topo if tops.machine_set else None, tops.machine_weighted)


def restore_topologies(carry: Optional[TopologyCarry]) -> None:
    """Lays the carried topologies over the new world (after rumor.init() of the next live epoch,
    on every member; deterministic, so no exchange): a topology made by a graph family
    (ExponentialGraph, RingGraph, ...) becomes the same family over the new number of ranks
    (machines), with its uniform weights; a graph given by its edges or weights has no version
    for another world, so every later use raises, saying to set it again in the training
    function."""
    if carry is None:
        return
    st = _runtime.state()
    tops = _topologies()
    for attr, old, weighted, size, unit, setter in (
            ("topo", carry.topo, carry.weighted, st.env.size, "ranks", "set_topology"),
            ("machine_topo", carry.machine_topo, carry.machine_weighted, st.machine_size, "machines",
             "set_machine_topology")):
        if old is None:
            continue
        new = old.resized(size)
        if new is not None:
            setattr(tops, attr, new)
            if attr == "topo":
                tops.weighted, tops.topo_set = weighted, True
            else:
                tops.machine_weighted, tops.machine_set = weighted, True
            continue
        tops.stale[attr] = (f"rumor.{setter}: the {old!r} set before the membership changed is a fixed graph of "
                            f"{old.size} {unit}, and the world now has {size}; call rumor.{setter} again "
                            f"in {LIVE_WHERE} (a graph family such as ExponentialGraph or RingGraph is laid "
                            f"over the new world by itself)")


def load_machine_topology() -> Topology:
    """The topology among machines (ExponentialGraph(machine_size) until set_machine_topology()).

    Returns:
        A rumor.topology.Topology over machine ranks.
    """
    return _topologies().machine_topo


def in_neighbor_ranks() -> List[int]:
    """This rank's in-neighbors in the static topology (sorted)."""
    return _topologies().topo.in_neighbor_ranks(_runtime.rank())


def out_neighbor_ranks() -> List[int]:
    """This rank's out-neighbors in the static topology (sorted)."""
    return _topologies().topo.out_neighbor_ranks(_runtime.rank())


def in_neighbor_machine_ranks() -> List[int]:
    """This machine's in-neighbors in the machine topology (sorted machine ranks).

    Returns:
        A list of ints.
    """
    return _topologies().machine_topo.in_neighbor_ranks(_runtime.machine_rank())


def out_neighbor_machine_ranks() -> List[int]:
    """This machine's out-neighbors in the machine topology (sorted machine ranks).

    Returns:
        A list of ints.
    """
    return _topologies().machine_topo.out_neighbor_ranks(_runtime.machine_rank())


# ---- argument handling ---------------------------------------------------------------------------

def _weight(w, what: str, which: str) -> float:
    try:
        f = float(w)
    except (TypeError, ValueError):
        raise TypeError(f"{what}: {which} must be a number, got {w!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"{what}: {which} must be finite, got {f}")
    return f


def _rank_index(ranks: Sequence[int], r, what: str, role: str, unit: str = "rank") -> int:
    if isinstance(r, bool) or not isinstance(r, int):
        try:
            r = int(r)
        except (TypeError, ValueError):
            raise TypeError(f"{what}: {role} {unit}s must be ints, got {r!r}") from None
    try:
        return ranks.index(int(r))
    except ValueError:
        raise ValueError(f"{what}: {role} {unit} {r} is not a member ({unit}s {list(ranks)[:16]})") from None


def _edges(spec, ranks: Sequence[int], me: int, what: str, role: str, unit: str = "rank",
           allow_list: bool = True) -> List[Tuple[int, float]]:
    """{rank: weight} or [rank, ...] (weight 1) -> [(communicator rank, weight)]."""
    if isinstance(spec, dict):
        items = list(spec.items())
    elif allow_list and isinstance(spec, (list, tuple)):
        items = [(r, 1.0) for r in spec]
    else:
        kinds = "a dict {rank: weight} or a list of ranks" if allow_list else "a dict {rank: weight}"
        raise TypeError(f"{what}: {role} weights must be {kinds}, got {type(spec).__name__}")
    out, seen = [], set()
    for r, w in items:
        idx = _rank_index(ranks, r, what, role, unit)
        if idx == me:
            raise ValueError(f"{what}: {role} {unit}s include this {unit} itself ({r}); use self_weight")
        if idx in seen:
            raise ValueError(f"{what}: {role} {unit} {r} is named twice")
        seen.add(idx)
        out.append((idx, _weight(w, what, f"the weight of {role} {unit} {r}")))
    return out


def _float_tensor(t, what: str) -> int:
    code = check_tensor(t, what)
    if code not in _FLOAT_CODES:
        raise TypeError(f"{what}: expected a floating-point tensor (float32, float64, float16, bfloat16), "
                        f"got {t.dtype}")
    return code


def _static_receive(topo: Topology, weighted: bool, me: int, self_weight, src_weights, what: str, unit: str):
    """(self weight, [(src, weight)]) in static mode: the topology's or the caller's weights
    over exactly the topology's in-neighbors (a source left out of src_weights gets 0)."""
    ins = topo.in_neighbor_ranks(me)
    if self_weight is None and src_weights is None:
        sw, sws = topo.receive_weights(me) if weighted else topo.uniform_receive_weights(me)
        return sw, [(s, sws[s]) for s in ins]
    if self_weight is None or src_weights is None:
        raise ValueError(f"{what}: pass self_weight and src_weights together (or neither)")
    if not isinstance(src_weights, dict):
        raise TypeError(f"{what}: src weights must be a dict {{{unit}: weight}}, got {type(src_weights).__name__}")
    extra = sorted(set(int(r) for r in src_weights) - set(ins))
    if extra:
        raise ValueError(f"{what}: src {unit}s {extra} are not in-neighbors of {unit} {me} in the topology "
                         f"(in-neighbors {ins}); pass dst weights for a dynamic topology")
    return (_weight(self_weight, what, "self_weight"),
            [(s, _weight(src_weights.get(s, 0.0), what, f"the weight of src {unit} {s}")) for s in ins])


# ---- neighbor_allreduce --------------------------------------------------------------------------

def _staged(t, group, nonblocking, what, cpu_call):
    """CUDA tensors: the neighbor ops stage through host memory on either GPU transport
    (docs/gpu.md), which needs no agreement of the group; None for CPU tensors."""
    gpu = routing.route(what, group, ("t", t), collective=False)
    if gpu is None:
        return None
    from ..gpu import collectives as gpu_collectives

    return gpu_collectives.staged(gpu, t, nonblocking, what, cpu_call)


def _neighbor_allreduce(t, self_weight, src_weights, dst_weights, enable_topo_check, group, nonblocking, what):
    res = _staged(t, group, nonblocking, what, lambda buf, nb: _neighbor_allreduce(
        buf, self_weight, src_weights, dst_weights, enable_topo_check, group, nb, what))
    if res is not None:
        return res
    code = _float_tensor(t, what)
    g = communicator(group, what)
    me = g._comm.rank
    check = bool(enable_topo_check)
    if dst_weights is None:
        if group is not None and g is not _runtime.state().world:
            raise ValueError(f"{what}: static mode uses the world topology; with a group, pass self_weight, "
                             "src_weights and dst_weights")
        tops = _topologies()
        sw, srcs = _static_receive(tops.topo, tops.weighted, me, self_weight, src_weights, what, "rank")
        dsts = [(d, 1.0) for d in tops.topo.out_neighbor_ranks(me)]
        # Both lists come from one topology that set_topology() verified on every rank.
        check = False
    else:
        if self_weight is None or src_weights is None:
            raise ValueError(f"{what}: with dst_weights (dynamic topology), self_weight and src_weights are required")
        sw = _weight(self_weight, what, "self_weight")
        srcs = _edges(src_weights, g.ranks, me, what, "src", allow_list=False)
        dsts = _edges(dst_weights, g.ranks, me, what, "dst")
    buf = t if t.is_contiguous() else t.contiguous()
    out = torch.empty_like(buf)
    scratch = _topologies().scratch_for(g)
    issue = lambda nb: _C.neighbor_allreduce(g._comm, address(buf), address(out), buf.numel(), code,
                                             sw, srcs, dsts, check, nb, scratch)
    return _run(nonblocking, issue, (buf, out, t), lambda: out)


def neighbor_allreduce(t, self_weight: Optional[float] = None, src_weights: Optional[Dict[int, float]] = None,
                       dst_weights: Union[None, Dict[int, float], Sequence[int]] = None,
                       enable_topo_check: bool = True, group: Optional[Group] = None) -> torch.Tensor:
    """Returns self_weight * t + sum of weighted in-neighbor tensors (a new tensor).

    Static (dst_weights None): the topology of set_topology(); optional self_weight +
    src_weights {rank: weight} override the weights of its in-neighbors. Dynamic: dst_weights
    is a list of ranks to send to (weight 1) or {rank: weight} (the sender scales its tensor by
    the weight before sending); self_weight and src_weights {rank: weight} are then required.
    enable_topo_check (dynamic mode) raises ValueError on every rank when some rank's sends
    do not match its receivers' src lists; without it such a mismatch ends in an error
    (deadline or protocol check), never in mixed-up data. Floating-point tensors only.

    Args:
        t: this rank's tensor; same shape and dtype on every rank.
        self_weight: the weight of this rank's own t; None (the default) takes the topology's.
        src_weights: {in-neighbor rank: weight}; None (the default) takes the topology's.
        dst_weights: None (the default) for the static topology; a list of ranks or
            {rank: weight} to send to for a dynamic step.
        enable_topo_check: in dynamic mode, check that every rank's sends match its receivers' lists and raise ValueError on every rank if not; default True.
        group: the Group whose ranks take part; None (the default) means every rank.

    Returns:
        A new tensor: self_weight * t + the weighted in-neighbor tensors.
    """
    return _neighbor_allreduce(t, self_weight, src_weights, dst_weights, enable_topo_check, group, False,
                               "rumor.neighbor_allreduce")


def neighbor_allreduce_nonblocking(t, self_weight=None, src_weights=None, dst_weights=None,
                                   enable_topo_check: bool = True, group: Optional[Group] = None) -> Handle:
    """neighbor_allreduce, returning a Handle (rumor.synchronize(h) gives the result).

    Args:
        t: this rank's tensor; must not change until the handle is waited.
        self_weight: as in neighbor_allreduce; default None.
        src_weights: as in neighbor_allreduce; default None.
        dst_weights: as in neighbor_allreduce; default None (static topology).
        enable_topo_check: in dynamic mode, check that every rank's sends match its receivers' lists and raise ValueError on every rank if not; default True.
        group: the Group whose ranks take part; None (the default) means every rank.

    Returns:
        A Handle; rumor.synchronize(h) or h.wait() gives the result.
    """
    return _neighbor_allreduce(t, self_weight, src_weights, dst_weights, enable_topo_check, group, True,
                               "rumor.neighbor_allreduce_nonblocking")


# ---- neighbor_allgather --------------------------------------------------------------------------

def _neighbor_allgather(t, src_ranks, dst_ranks, enable_topo_check, group, nonblocking, what):
    res = _staged(t, group, nonblocking, what, lambda buf, nb: _neighbor_allgather(
        buf, src_ranks, dst_ranks, enable_topo_check, group, nb, what))
    if res is not None:
        return res
    check_movable(t, what)
    code = dtype_tag(t.dtype)
    g = communicator(group, what)
    me = g._comm.rank
    check = bool(enable_topo_check)
    if src_ranks is None and dst_ranks is None:
        if group is not None and g is not _runtime.state().world:
            raise ValueError(f"{what}: static mode uses the world topology; with a group, pass src_ranks and dst_ranks")
        topo = _topologies().topo
        srcs, dsts = topo.in_neighbor_ranks(me), topo.out_neighbor_ranks(me)
        check = False
    elif src_ranks is None or dst_ranks is None:
        raise ValueError(f"{what}: pass src_ranks and dst_ranks together (or neither, for the static topology)")
    else:
        srcs = [i for i, _ in _edges(list(src_ranks), g.ranks, me, what, "src")]
        dsts = [i for i, _ in _edges(list(dst_ranks), g.ranks, me, what, "dst")]
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dim() > _MAX_DIMS:
        raise ValueError(f"{what}: tensors of more than {_MAX_DIMS} dims are not supported")
    buf = t if t.is_contiguous() else t.contiguous()
    nbytes = buf.numel() * buf.element_size()
    words = [nbytes, code, buf.dim()] + list(buf.shape) + [0] * (_MAX_DIMS - buf.dim())
    got = _C.neighbor_exchange_words(g._comm, words, srcs, dsts, check)
    width = len(words)
    recs = [got[k * width:(k + 1) * width] for k in range(len(srcs))]
    recv_bytes = [int(r[0]) for r in recs]
    raw = torch.empty(sum(recv_bytes), dtype=torch.uint8)
    # The data moves even when shapes disagree (every sender has already committed to sending),
    # and the disagreement is raised afterwards, so no peer is left waiting.
    problem = None
    tail = tuple(buf.shape[1:])
    rows = 0
    for k, r in enumerate(recs):
        src_global = g.ranks[srcs[k]]
        shape = tuple(int(x) for x in r[3:3 + int(r[2])])
        if int(r[1]) != code:
            problem = TypeError(f"{what}: rank {src_global} sent a tensor of another dtype (code {int(r[1])}, "
                                f"this rank has {t.dtype})")
            break
        if len(shape) != len(tail) + 1 or shape[1:] != tail:
            problem = ValueError(f"{what}: all dims but the first must match; rank {src_global} has shape "
                                 f"{list(shape)}, this rank has {list(buf.shape)}")
            break
        rows += shape[0]

    def finish():
        if problem is not None:
            raise problem
        return raw.view(t.dtype).reshape((rows,) + tail)

    issue = lambda nb: _C.neighbor_allgather(g._comm, address(buf), nbytes, srcs, recv_bytes, dsts,
                                                       address(raw), False, nb)
    return _run(nonblocking, issue, (buf, raw), finish)


def neighbor_allgather(t, src_ranks: Optional[Sequence[int]] = None, dst_ranks: Optional[Sequence[int]] = None,
                       enable_topo_check: bool = True, group: Optional[Group] = None) -> torch.Tensor:
    """Concatenates the in-neighbors' tensors along dim 0 (not including this rank's own), in
    the order of the static topology's in-neighbors (ascending) or of src_ranks. First dims may
    differ between ranks; the other dims and the dtype must match. Dynamic mode: src_ranks and
    dst_ranks together (checked like neighbor_allreduce's lists).

    Args:
        t: this rank's tensor.
        src_ranks: dynamic mode, the ranks to receive from; None (the default) for the static topology.
        dst_ranks: dynamic mode, the ranks to send to; None (the default) for the static topology.
        enable_topo_check: in dynamic mode, check that every rank's sends match its receivers' lists and raise ValueError on every rank if not; default True.
        group: the Group whose ranks take part; None (the default) means every rank.

    Returns:
        A new tensor, the in-neighbors' tensors concatenated along dim 0.
    """
    return _neighbor_allgather(t, src_ranks, dst_ranks, enable_topo_check, group, False, "rumor.neighbor_allgather")


def neighbor_allgather_nonblocking(t, src_ranks=None, dst_ranks=None, enable_topo_check: bool = True,
                                   group: Optional[Group] = None) -> Handle:
    """Like neighbor_allgather; the small shape exchange runs before it returns.

    Args:
        t: this rank's tensor; must not change until the handle is waited.
        src_ranks: as in neighbor_allgather; default None.
        dst_ranks: as in neighbor_allgather; default None.
        enable_topo_check: in dynamic mode, check that every rank's sends match its receivers' lists and raise ValueError on every rank if not; default True.
        group: the Group whose ranks take part; None (the default) means every rank.

    Returns:
        A Handle; rumor.synchronize(h) or h.wait() gives the result.
    """
    return _neighbor_allgather(t, src_ranks, dst_ranks, enable_topo_check, group, True,
                               "rumor.neighbor_allgather_nonblocking")


# ---- hierarchical ----------------------------------------------------------------------------------

def _fold_self_loop(src_spec, dst_spec, me: int, sw: float, what: str, unit: str):
    """A machine that names itself as source and destination (a schedule's "next machine" on a
    one-machine job) keeps its own value: the edge becomes self weight src_w * dst_w, with no
    message. Naming itself on one side only is an error (it would wait for itself)."""
    src_has = isinstance(src_spec, dict) and any(_is(r, me) for r in src_spec)
    if isinstance(dst_spec, dict):
        dst_has = any(_is(r, me) for r in dst_spec)
    else:
        dst_has = isinstance(dst_spec, (list, tuple)) and any(_is(r, me) for r in dst_spec)
    if not (src_has or dst_has):
        return src_spec, dst_spec, sw
    if src_has != dst_has:
        side = "src" if src_has else "dst"
        raise ValueError(f"{what}: {unit} {me} names itself among its {side} {unit}s only; a self loop "
                         "needs it on both sides (or use self_weight)")
    w_src = next(float(w) for r, w in src_spec.items() if _is(r, me))
    if isinstance(dst_spec, dict):
        w_dst = next(float(w) for r, w in dst_spec.items() if _is(r, me))
        dst_spec = {r: w for r, w in dst_spec.items() if not _is(r, me)}
    else:
        w_dst = 1.0
        dst_spec = [r for r in dst_spec if not _is(r, me)]
    src_spec = {r: w for r, w in src_spec.items() if not _is(r, me)}
    return src_spec, dst_spec, sw + _weight(w_src, what, f"the weight of src {unit} {me}") * w_dst


def _is(r, me: int) -> bool:
    try:
        return not isinstance(r, bool) and int(r) == me
    except (TypeError, ValueError):
        return False


def _hierarchical(t, self_weight, src_machine_weights, dst_machine_weights, enable_topo_check, nonblocking, what):
    res = _staged(t, None, nonblocking, what, lambda buf, nb: _hierarchical(
        buf, self_weight, src_machine_weights, dst_machine_weights, enable_topo_check, nb, what))
    if res is not None:
        return res
    code = _float_tensor(t, what)
    st = _runtime.state()
    g = st.world
    m, nm = st.machine_rank, st.machine_size
    machines = list(range(nm))
    check = bool(enable_topo_check)
    if dst_machine_weights is None:
        tops = _topologies()
        sw, srcs = _static_receive(tops.machine_topo, tops.machine_weighted, m, self_weight, src_machine_weights,
                                   what, "machine")
        dsts = [(d, 1.0) for d in tops.machine_topo.out_neighbor_ranks(m)]
        check = False
    else:
        if self_weight is None or src_machine_weights is None:
            raise ValueError(f"{what}: with dst_machine_weights, self_weight and src_machine_weights are required")
        sw = _weight(self_weight, what, "self_weight")
        src_machine_weights, dst_machine_weights, sw = _fold_self_loop(
            src_machine_weights, dst_machine_weights, m, sw, what, "machine")
        srcs = _edges(src_machine_weights, machines, m, what, "src", "machine", allow_list=False)
        dsts = _edges(dst_machine_weights, machines, m, what, "dst", "machine")
    buf = t if t.is_contiguous() else t.contiguous()
    out = torch.empty_like(buf)
    scratch = _topologies().scratch_for(g)
    issue = lambda nb: _C.hierarchical_neighbor_allreduce(g._comm, address(buf), address(out), buf.numel(),
                                                          code, sw, srcs, dsts, check, nb, scratch)
    return _run(nonblocking, issue, (buf, out, t), lambda: out)


def hierarchical_neighbor_allreduce(t, self_weight: Optional[float] = None,
                                    src_machine_weights: Optional[Dict[int, float]] = None,
                                    dst_machine_weights: Union[None, Dict[int, float], Sequence[int]] = None,
                                    enable_topo_check: bool = True) -> torch.Tensor:
    """Averages t over the ranks of this machine, combines the machine averages over the
    machine topology (set_machine_topology(); or dynamic, with machine ranks as keys, like
    neighbor_allreduce), and returns the result on every rank of the machine (a new tensor).
    Every rank of a machine must pass the same machine weights (the machine's first rank's
    are used).

    Args:
        t: this rank's tensor; same shape and dtype on every rank.
        self_weight: the weight of this machine's own average; None (the default) takes the
            machine topology's.
        src_machine_weights: {machine rank: weight} of the in-neighbor machines; None (the
            default) takes the machine topology's.
        dst_machine_weights: None (the default) for the static machine topology; a list of
            machine ranks or {machine rank: weight} for a dynamic step.
        enable_topo_check: in dynamic mode, check that every rank's sends match its receivers' lists and raise ValueError on every rank if not; default True.

    Returns:
        A new tensor with the combined machine averages.
    """
    return _hierarchical(t, self_weight, src_machine_weights, dst_machine_weights, enable_topo_check, False,
                         "rumor.hierarchical_neighbor_allreduce")


def hierarchical_neighbor_allreduce_nonblocking(t, self_weight=None, src_machine_weights=None,
                                                dst_machine_weights=None, enable_topo_check: bool = True) -> Handle:
    """Starts hierarchical_neighbor_allreduce(t, ...) and returns at once.

    Args:
        t: this rank's tensor; must not change until the handle is waited.
        self_weight: as in hierarchical_neighbor_allreduce; default None.
        src_machine_weights: as in hierarchical_neighbor_allreduce; default None.
        dst_machine_weights: as in hierarchical_neighbor_allreduce; default None.
        enable_topo_check: in dynamic mode, check that every rank's sends match its receivers' lists and raise ValueError on every rank if not; default True.

    Returns:
        A Handle; rumor.synchronize(h) or h.wait() gives the result.
    """
    return _hierarchical(t, self_weight, src_machine_weights, dst_machine_weights, enable_topo_check, True,
                         "rumor.hierarchical_neighbor_allreduce_nonblocking")
