"""BlueFog's ``bluefog.torch`` API on rumor: ``import rumor.compat.bluefog as bf``.

Names and argument conventions follow bluefog.torch (keyword-only weights, ``average=`` for
allreduce, ``root_rank``, ``name=`` accepted and ignored, networkx graphs for topologies); the
work is done by rumor. What rumor lacks raises NotImplementedError naming the feature. See
docs/compat.md for the mapping and the differences.

``rumor.compat.enable_aliases()`` makes ``import bluefog.torch as bf`` resolve to this module.
"""
from __future__ import annotations

import contextlib
import enum
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Union

import networkx as nx
import torch

import rumor as _r
from rumor import _runtime
from rumor import collectives as _coll
from rumor.neighbor import ops as _dec
from rumor import timeline as _tl
from rumor.neighbor import window as _win
from rumor.optim import combine as _optdec
from rumor.optim import win_optimizers as _optwin
from rumor.optim.gradient_allreduce import GradientAllReduceOptimizer as _GradientAllreduce

from . import topology_util  # noqa: F401 (bf.topology_util, as in BlueFog)
from . import topology_util as _tu
from .topology_util import (  # noqa: F401
    ExponentialGraph,
    ExponentialTwoGraph,
    FullyConnectedGraph,
    GetDynamicOnePeerSendRecvRanks,
    GetExp2DynamicSendRecvMachineRanks,
    GetInnerOuterExpo2DynamicSendRecvRanks,
    GetInnerOuterRingDynamicSendRecvRanks,
    GetRecvWeights,
    GetSendWeights,
    IsRegularGraph,
    IsTopologyEquivalent,
    MeshGrid2DGraph,
    RingGraph,
    StarGraph,
    SymmetricExponentialGraph,
)


def _missing(feature: str):
    raise NotImplementedError(f"rumor.compat.bluefog: {feature} is not available in rumor")


# ---- process state -------------------------------------------------------------------------------

class _Compat:
    """What bluefog keeps beside rumor's state: the graphs as given (returned by
    load_topology), and the flags that only BlueFog has."""

    def __init__(self):
        self.topology: Optional[nx.DiGraph] = None
        self.weighted = False
        self.machine_topology: Optional[nx.DiGraph] = None
        self.machine_weighted = False
        self.skip_negotiate = False
        self.generation = -1
        self.activities: Dict[str, tuple] = {}


_st = _Compat()


def _machine_env_host_id():
    # BLUEFOG_NODES_PER_MACHINE=k emulates machines of k consecutive ranks on one host.
    k = os.environ.get("BLUEFOG_NODES_PER_MACHINE")
    if not k or os.environ.get("RUMOR_HOST_ID"):
        return
    rank = None
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if var in os.environ:
            rank = int(os.environ[var])
            break
    if rank is not None:
        os.environ["RUMOR_HOST_ID"] = f"bluefog-machine-{rank // int(k)}"


def init(topology_fn: Optional[Callable[[int], nx.DiGraph]] = None, is_weighted: bool = False) -> None:
    """Joins the job (rumor.init) and sets the topology (topology_fn(size), default
    ExponentialGraph(size)). May be called again: the job stays, the topology is reset.

    Args:
        topology_fn: builds the topology from the size; default None (exponential graph).
        is_weighted: if True (default False), use the topology's weights.
    """
    if not _r.is_initialized():
        _machine_env_host_id()
        _r.init()
    _bluefog_timeline()
    _st.generation = _runtime.generation()
    topo = topology_fn(size()) if topology_fn is not None else ExponentialGraph(size())
    set_topology(topo, is_weighted)
    _st.machine_topology = None
    _st.machine_weighted = False
    set_machine_topology(ExponentialGraph(machine_size()))


def _bluefog_timeline() -> None:
    """BLUEFOG_TIMELINE=prefix records rumor's timeline; BlueFog's file name for it,
    <prefix><rank>.json, is a link to rumor's per-rank file."""
    prefix = os.environ.get("BLUEFOG_TIMELINE")
    if not prefix:
        return
    if not _tl.is_recording():
        _tl.start(prefix + ".json")
    link = f"{prefix}{rank()}.json"
    if not os.path.lexists(link):
        os.symlink(os.path.abspath(_tl.path()), link)


def shutdown() -> None:
    """Ends rumor (rumor.shutdown())."""
    _r.shutdown()
    _st.__init__()


rank = _r.rank
size = _r.size
local_rank = _r.local_rank
local_size = _r.local_size
machine_rank = _r.machine_rank
machine_size = _r.machine_size


def is_homogeneous() -> bool:
    """Every machine runs the same number of ranks."""
    hosts = _runtime.state().hosts
    return len({hosts.count(h) for h in set(hosts)}) == 1


def nccl_built() -> bool:
    """Whether rumor can load NCCL for CUDA tensors.

    Returns:
        A bool.
    """
    return False  # rumor moves CPU tensors over its own transports


def mpi_threads_supported() -> bool:
    """Whether operations may be issued from any thread; True in rumor.

    Returns:
        True.
    """
    return True  # rumor's operations may be issued from any thread


def unified_mpi_window_model_supported() -> bool:
    """Whether MPI's unified window model is available; False in rumor (no MPI windows).

    Returns:
        False.
    """
    return False


def set_skip_negotiate_stage(value: bool) -> None:
    """Accepted for compatibility: rumor has no negotiation stage (operations are matched by
    their order on every rank, and mismatches are caught by frame checks).

    Args:
        value: the flag (kept for BlueFog compatibility).
    """
    _st.skip_negotiate = bool(value)


def get_skip_negotiate_stage() -> bool:
    """The value set by set_skip_negotiate_stage (default False).

    Returns:
        A bool.
    """
    return _st.skip_negotiate


def suspend():
    """Not available in rumor (BlueFog's interactive suspend).

    Raises:
        NotImplementedError: always.
    """
    _missing("suspend() (interactive BlueFog)")


def resume():
    """Not available in rumor (BlueFog's interactive resume).

    Raises:
        NotImplementedError: always.
    """
    _missing("resume() (interactive BlueFog)")


# ---- topology ----------------------------------------------------------------------------------

def set_topology(topology: Optional[nx.DiGraph] = None, is_weighted: bool = False) -> bool:
    """Sets the static topology for the neighbor operations (rumor.set_topology).

    Args:
        topology: a networkx.DiGraph; None (the default) means ExponentialGraph(size()).
        is_weighted: if True (default False), use the graph's edge weights.

    Returns:
        True.

    Raises:
        ValueError: the ranks passed different topologies.
    """
    if topology is None:
        topology = ExponentialGraph(size())
    if not isinstance(topology, (nx.DiGraph, _r.topology.Topology)):
        raise TypeError("set_topology: topology must be a networkx.DiGraph")
    if _win.get_current_created_window_names():
        # As in BlueFog: windows were made for the current neighbours; keep them consistent.
        return False
    _dec.set_topology(_tu.to_topology(topology), is_weighted)
    _st.topology = topology if isinstance(topology, nx.DiGraph) else topology.graph
    _st.weighted = bool(is_weighted)
    return True


def load_topology() -> nx.DiGraph:
    """The graph given to set_topology (or rumor's current topology, if it was set natively
    since)."""
    current = _dec.load_topology()
    if _st.topology is None or _tu.to_topology(_st.topology) != current:
        _st.topology = current.graph
    return _st.topology


def is_topo_weighted() -> bool:
    """Whether the topology was set with is_weighted=True.

    Returns:
        A bool.
    """
    return _st.weighted


def set_machine_topology(topology: Optional[nx.DiGraph], is_weighted: bool = False) -> bool:
    """Sets the topology among machines (rumor.set_machine_topology).

    Args:
        topology: a networkx.DiGraph over machines; None (the default) means an exponential graph.
        is_weighted: if True (default False), use the graph's edge weights.

    Returns:
        True.
    """
    if topology is None:
        raise ValueError("set_machine_topology: the machine topology must not be None")
    if not isinstance(topology, (nx.DiGraph, _r.topology.Topology)):
        raise TypeError("set_machine_topology: topology must be a networkx.DiGraph")
    _dec.set_machine_topology(_tu.to_topology(topology), is_weighted)
    _st.machine_topology = topology if isinstance(topology, nx.DiGraph) else topology.graph
    _st.machine_weighted = bool(is_weighted)
    return True


def load_machine_topology() -> nx.DiGraph:
    """The topology among machines, as a networkx.DiGraph.

    Returns:
        A networkx.DiGraph.
    """
    current = _dec.load_machine_topology()
    if _st.machine_topology is None or _tu.to_topology(_st.machine_topology) != current:
        _st.machine_topology = current.graph
    return _st.machine_topology


def is_machine_topo_weighted() -> bool:
    """Whether the machine topology was set with is_weighted=True.

    Returns:
        A bool.
    """
    return _st.machine_weighted


in_neighbor_ranks = _dec.in_neighbor_ranks
out_neighbor_ranks = _dec.out_neighbor_ranks
in_neighbor_machine_ranks = _dec.in_neighbor_machine_ranks
out_neighbor_machine_ranks = _dec.out_neighbor_machine_ranks


# ---- collectives -------------------------------------------------------------------------------

def _reduce_op(average: bool):
    return _r.ReduceOp.AVG if average else _r.ReduceOp.SUM


def _local(is_hierarchical_local: bool):
    return _r.local_group() if is_hierarchical_local else None


def allreduce(tensor, average: bool = True, is_hierarchical_local: bool = False, name=None):
    """Average (or sum) over all ranks, or over this machine's ranks with
    is_hierarchical_local=True. Returns a new tensor.

    Args:
        tensor: the tensor to reduce.
        average: if True (the default) average, else sum.
        is_hierarchical_local: if True (default False), reduce within each machine only.
        name: accepted for BlueFog compatibility and ignored; default None.
    """
    return _coll.allreduce(tensor, _reduce_op(average), _local(is_hierarchical_local))


def allreduce_nonblocking(tensor, average: bool = True, is_hierarchical_local: bool = False, name=None):
    """Starts allreduce(tensor) and returns a handle.

    Args:
        tensor: the tensor to reduce; must not change until waited.
        average: if True (the default) average, else sum.
        is_hierarchical_local: if True (default False), reduce within each machine only.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A handle for bf.synchronize() / bf.wait().
    """
    return _coll.allreduce_nonblocking(tensor, _reduce_op(average), _local(is_hierarchical_local))


def allreduce_(tensor, average: bool = True, is_hierarchical_local: bool = False, name=None):
    """In-place allreduce of tensor over every rank.

    Args:
        tensor: the tensor to reduce; holds the result afterwards.
        average: if True (the default) average, else sum.
        is_hierarchical_local: if True (default False), reduce within each machine only.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        tensor.
    """
    return _coll.allreduce_(tensor, _reduce_op(average), _local(is_hierarchical_local))


def allreduce_nonblocking_(tensor, average: bool = True, is_hierarchical_local: bool = False, name=None):
    """Starts allreduce_(tensor) (in place) and returns a handle.

    Args:
        tensor: the tensor to reduce in place.
        average: if True (the default) average, else sum.
        is_hierarchical_local: if True (default False), reduce within each machine only.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A handle for bf.synchronize() / bf.wait().
    """
    return _coll.allreduce_nonblocking_(tensor, _reduce_op(average), _local(is_hierarchical_local))


def broadcast(tensor, root_rank: int, name=None):
    """Returns root_rank's tensor on every rank (a new tensor).

    Args:
        tensor: the tensor to send (on root_rank) or whose shape receives.
        root_rank: the sending rank.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A new tensor.
    """
    return _coll.broadcast(tensor, root_rank)


def broadcast_nonblocking(tensor, root_rank: int, name=None):
    """Starts broadcast(tensor, root_rank) and returns a handle.

    Args:
        tensor: the tensor to send or receive the shape of.
        root_rank: the sending rank.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A handle for bf.synchronize() / bf.wait().
    """
    return _coll.broadcast_nonblocking(tensor, root_rank)


def broadcast_(tensor, root_rank: int, name=None):
    """Copies root_rank's tensor into tensor on every rank.

    Args:
        tensor: the tensor, overwritten in place.
        root_rank: the sending rank.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        tensor.
    """
    return _coll.broadcast_(tensor, root_rank)


def broadcast_nonblocking_(tensor, root_rank: int, name=None):
    """Starts broadcast_(tensor, root_rank) (in place) and returns a handle.

    Args:
        tensor: the tensor, overwritten in place.
        root_rank: the sending rank.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A handle for bf.synchronize() / bf.wait().
    """
    return _coll.broadcast_nonblocking_(tensor, root_rank)


def allgather(tensor, name=None):
    """Concatenates every rank's tensor along dim 0.

    Args:
        tensor: this rank's tensor.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A new tensor.
    """
    return _coll.allgather(tensor)


def allgather_nonblocking(tensor, name=None):
    """Starts allgather(tensor) and returns a handle.

    Args:
        tensor: this rank's tensor.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A handle for bf.synchronize() / bf.wait().
    """
    return _coll.allgather_nonblocking(tensor)


def neighbor_allgather(tensor, *, src_ranks: Optional[List[int]] = None, dst_ranks: Optional[List[int]] = None,
                       enable_topo_check: bool = True, name=None):
    """Concatenates the in-neighbours' tensors (rumor.neighbor_allgather).

    Args:
        tensor: this rank's tensor.
        src_ranks: dynamic sources; default None (static topology).
        dst_ranks: dynamic destinations; default None.
        enable_topo_check: default True.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A new tensor.
    """
    return _dec.neighbor_allgather(tensor, src_ranks, dst_ranks, enable_topo_check)


def neighbor_allgather_nonblocking(tensor, *, src_ranks=None, dst_ranks=None, enable_topo_check: bool = True,
                                   name=None):
    """Starts neighbor_allgather and returns a handle.

    Args:
        tensor: this rank's tensor.
        src_ranks: default None.
        dst_ranks: default None.
        enable_topo_check: default True.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A handle for bf.synchronize() / bf.wait().
    """
    return _dec.neighbor_allgather_nonblocking(tensor, src_ranks, dst_ranks, enable_topo_check)


def _neighbor_args(self_weight, src_weights, dst_weights, what):
    if dst_weights is not None:
        if len(set(dst_weights)) != len(dst_weights):
            raise ValueError(f"{what}: dst_weights must name each rank once")
        if self_weight is None or src_weights is None:
            raise ValueError(f"{what}: self_weight and src_weights are required with dst_weights "
                             "(dynamic topology)")
    elif (self_weight is None) != (src_weights is None):
        raise ValueError(f"{what}: self_weight and src_weights go together")
    if src_weights is not None and not isinstance(src_weights, dict):
        raise ValueError(f"{what}: src_weights must be a dict {{rank: weight}}")
    return self_weight, src_weights, dst_weights


def neighbor_allreduce(tensor, *, self_weight: Optional[float] = None, src_weights: Optional[Dict[int, float]] = None,
                       dst_weights: Union[None, Dict[int, float], List[int]] = None,
                       enable_topo_check: bool = True, name=None):
    """Combines tensor with the in-neighbours' (rumor.neighbor_allreduce).

    Args:
        tensor: this rank's tensor.
        self_weight: this rank's weight; None (the default) takes the topology's.
        src_weights: {rank: weight} of the sources; default None.
        dst_weights: None (static topology, the default), or ranks / {rank: weight} for a dynamic step.
        enable_topo_check: check the dynamic lists match; default True.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A new tensor.
    """
    return neighbor_allreduce_nonblocking(tensor, self_weight=self_weight, src_weights=src_weights,
                                          dst_weights=dst_weights, enable_topo_check=enable_topo_check).wait()


def neighbor_allreduce_nonblocking(tensor, *, self_weight=None, src_weights=None, dst_weights=None,
                                   enable_topo_check: bool = True, name=None):
    """Starts neighbor_allreduce and returns a handle.

    Args:
        tensor: this rank's tensor.
        self_weight: as in neighbor_allreduce; default None.
        src_weights: default None.
        dst_weights: default None.
        enable_topo_check: default True.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A handle for bf.synchronize() / bf.wait().
    """
    what = "neighbor_allreduce"
    sw, src, dst = _neighbor_args(self_weight, src_weights, dst_weights, what)
    if dst is not None:
        src, dst, sw = _dec._fold_self_loop(src, dst, rank(), float(sw), what, "rank")
    return _dec.neighbor_allreduce_nonblocking(tensor, sw, src, dst, enable_topo_check)


def hierarchical_neighbor_allreduce(tensor, *, self_weight=None, src_machine_weights=None,
                                    dst_machine_weights=None, enable_topo_check: bool = False, name=None):
    """Averages within each machine and combines machines (rumor.hierarchical_neighbor_allreduce).

    Args:
        tensor: this rank's tensor.
        self_weight: the machine's own weight; default None.
        src_machine_weights: {machine: weight}; default None.
        dst_machine_weights: default None (static machine topology).
        enable_topo_check: default False.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A new tensor.
    """
    return hierarchical_neighbor_allreduce_nonblocking(
        tensor, self_weight=self_weight, src_machine_weights=src_machine_weights,
        dst_machine_weights=dst_machine_weights, enable_topo_check=enable_topo_check).wait()


def hierarchical_neighbor_allreduce_nonblocking(tensor, *, self_weight=None, src_machine_weights=None,
                                                dst_machine_weights=None, enable_topo_check: bool = False,
                                                name=None):
    """Starts hierarchical_neighbor_allreduce and returns a handle.

    Args:
        tensor: this rank's tensor.
        self_weight: default None.
        src_machine_weights: default None.
        dst_machine_weights: default None.
        enable_topo_check: default False.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A handle for bf.synchronize() / bf.wait().
    """
    what = "hierarchical_neighbor_allreduce"
    sw, src, dst = _neighbor_args(self_weight, src_machine_weights, dst_machine_weights, what)
    return _dec.hierarchical_neighbor_allreduce_nonblocking(tensor, sw, src, dst, enable_topo_check)


def pair_gossip(tensor, target_rank: int, self_weight=None, pair_weight=None, name=None):
    """x <- self_weight * x + pair_weight * x_target with one peer (default 1/2 each): a dynamic
    neighbor_allreduce over one edge each way.

    Args:
        tensor: this rank's tensor.
        target_rank: the peer.
        self_weight: default None.
        pair_weight: default None.
        name: accepted for BlueFog compatibility and ignored; default None.
    """
    return pair_gossip_nonblocking(tensor, target_rank, self_weight, pair_weight).wait()


def pair_gossip_nonblocking(tensor, target_rank: int, self_weight=None, pair_weight=None, name=None):
    """Starts pair_gossip and returns a handle.

    Args:
        tensor: this rank's tensor.
        target_rank: the peer.
        self_weight: with pair_weight, or both None (the default: 1/2 each).
        pair_weight: the peer's weight; default None.
        name: accepted for BlueFog compatibility and ignored; default None.

    Returns:
        A handle for bf.synchronize() / bf.wait().

    Raises:
        ValueError: only one of self_weight and pair_weight is given.
    """
    if (self_weight is None) != (pair_weight is None):
        raise ValueError("pair_gossip: self_weight and pair_weight go together")
    sw = 0.5 if self_weight is None else float(self_weight)
    pw = 0.5 if pair_weight is None else float(pair_weight)
    return _dec.neighbor_allreduce_nonblocking(tensor, sw, {int(target_rank): pw}, [int(target_rank)], False)


def poll(handle) -> bool:
    """Whether the operation behind handle finished, without waiting.

    Args:
        handle: a handle from a *_nonblocking call.

    Returns:
        A bool.
    """
    return handle.poll()


def synchronize(handle):
    """Waits for the operation behind handle and returns its result.

    Args:
        handle: a handle from a *_nonblocking call.

    Returns:
        The operation's result.
    """
    return handle.wait()


def wait(handle):
    """Same as synchronize(handle).

    Args:
        handle: a handle from a *_nonblocking call.

    Returns:
        The operation's result.
    """
    return handle.wait()


def barrier() -> None:
    """Returns once every rank has called barrier."""
    _r.barrier()


# ---- one-sided windows -------------------------------------------------------------------------

win_create = _win.win_create
win_free = _win.win_free
win_update = _win.win_update
win_update_then_collect = _win.win_update_then_collect
win_put = _win.win_put
win_put_nonblocking = _win.win_put_nonblocking
win_get = _win.win_get
win_get_nonblocking = _win.win_get_nonblocking
win_accumulate = _win.win_accumulate
win_accumulate_nonblocking = _win.win_accumulate_nonblocking
neighbor_win_put = _win.win_put
neighbor_win_put_nonblocking = _win.win_put_nonblocking
neighbor_win_get = _win.win_get
neighbor_win_get_nonblocking = _win.win_get_nonblocking
neighbor_win_accumulate = _win.win_accumulate
neighbor_win_accumulate_nonblocking = _win.win_accumulate_nonblocking
win_wait = _win.win_wait
win_poll = _win.win_poll
win_mutex = _win.win_mutex
get_win_version = _win.get_win_version
get_current_created_window_names = _win.get_current_created_window_names
win_associated_p = _win.win_associated_p
turn_on_win_ops_with_associated_p = _win.turn_on_win_ops_with_associated_p
turn_off_win_ops_with_associated_p = _win.turn_off_win_ops_with_associated_p


def win_lock(name: str):
    """Not available in rumor: an exclusive MPI window lock; use win_mutex.

    Args:
        name: the window's name.

    Raises:
        NotImplementedError: always.
    """
    _missing("win_lock (an exclusive MPI window lock; use win_mutex)")


# ---- timeline ----------------------------------------------------------------------------------

def timeline_start_activity(tensor_name: str, activity_name: str) -> bool:
    """Opens an activity span for tensor_name on rumor's timeline (written when it ends).

    Args:
        tensor_name: the tensor (row) the activity belongs to.
        activity_name: the activity's name.
    """
    if not _tl.is_recording():
        return False
    _st.activities[(threading.get_ident(), tensor_name)] = (activity_name, time.monotonic())
    return True


def timeline_end_activity(tensor_name: str) -> bool:
    """Closes the activity opened for tensor_name.

    Args:
        tensor_name: the tensor given to timeline_start_activity.

    Returns:
        True.
    """
    started = _st.activities.pop((threading.get_ident(), tensor_name), None)
    if started is None or not _tl.is_recording():
        return False
    activity, t0 = started
    args = _tl._encode_args("timeline_end_activity", {"tensor": tensor_name})
    _tl._span_s(activity, "user", t0, time.monotonic(), args)
    return True


@contextlib.contextmanager
def timeline_context(tensor_name: str, activity_name: str):
    """A context manager: an activity span for tensor_name on rumor's timeline around its body.

    Args:
        tensor_name: the tensor (row) the activity belongs to.
        activity_name: the activity's name.
    """
    timeline_start_activity(tensor_name, activity_name)
    try:
        yield
    finally:
        timeline_end_activity(tensor_name)


# ---- utilities ---------------------------------------------------------------------------------

def broadcast_parameters(params, root_rank: int) -> None:
    """Overwrites every parameter (a state_dict, named_parameters() or (name, tensor) pairs) with
    root_rank's values, in place.

    Args:
        params: a dict name -> tensor or an iterable of (name, tensor) pairs.
        root_rank: the sending rank.
    """
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    handles = [broadcast_nonblocking_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank)
               for _, p in items]
    for h in handles:
        h.wait()


def allreduce_parameters(params) -> None:
    """Averages every parameter over all ranks, in place.

    Args:
        params: a dict name -> tensor or an iterable of (name, tensor) pairs.
    """
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    handles = [allreduce_nonblocking_(p.data if isinstance(p, torch.nn.Parameter) else p) for _, p in items]
    for h in handles:
        h.wait()


def broadcast_optimizer_state(optimizer, root_rank: int) -> None:
    """Overwrites the optimizer's state and hyper-parameters with root_rank's (torch.save'd and
    broadcast as bytes, so every rank needs no state of its own first). The bytes come from the
    network: they are loaded with torch.load(weights_only=True), which rebuilds tensors and plain
    values only, never runs code (an optimizer whose state holds other types needs them
    registered with torch.serialization.add_safe_globals on every rank)."""
    import io

    buf = io.BytesIO()
    if rank() == root_rank:
        torch.save(optimizer.state_dict(), buf)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8) if rank() == root_rank else None
    n = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
    n = broadcast(n, root_rank)
    payload = data if data is not None else torch.empty(int(n), dtype=torch.uint8)
    payload = broadcast(payload, root_rank)
    # Every rank, root_rank included, loads the same bytes the same way: a state weights_only
    # refuses fails on every rank alike, none is left waiting for the others.
    try:
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    except Exception as e:  # pickle.UnpicklingError and what a malformed archive raises
        raise ValueError(f"rumor.compat.bluefog.broadcast_optimizer_state: the state broadcast from rank "
                         f"{root_rank} does not load with torch.load(weights_only=True): {e}") from e
    optimizer.load_state_dict(state)


def InferSourceFromDestinationRanks(dst_ranks: List[int], construct_adjacency_matrix: bool = False):  # noqa: N802
    """Collective: the ranks that list this rank among their destinations (and, optionally,
    the n x n matrix, rows normalized, of everyone's lists).

    Args:
        dst_ranks: the ranks this rank sends to.
        construct_adjacency_matrix: if True (default False), also return the adjacency matrix.
    """
    return _infer(dst_ranks, False, construct_adjacency_matrix, "InferSourceFromDestinationRanks")


def InferDestinationFromSourceRanks(src_ranks: List[int], construct_adjacency_matrix: bool = False):  # noqa: N802
    """Given every rank's source ranks, returns this rank's destinations (a collective).

    Args:
        src_ranks: the ranks this rank receives from.
        construct_adjacency_matrix: if True (default False), also return the adjacency matrix.

    Returns:
        The destination ranks, and with construct_adjacency_matrix the matrix too.
    """
    return _infer(src_ranks, True, construct_adjacency_matrix, "InferDestinationFromSourceRanks")


def _infer(ranks, transpose, matrix, what):
    import numpy as np

    n, me = size(), rank()
    ranks = list(ranks)
    if any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n for r in ranks) \
            or len(set(ranks)) != len(ranks) or me in ranks:
        raise ValueError(f"{what}: ranks must be distinct ints in [0, {n}) other than this rank, got {ranks}")
    row = torch.zeros(n, dtype=torch.uint8)
    row[ranks] = 1
    table = allgather(row.reshape(1, n)).numpy().astype(bool)  # table[i, j]: i lists j
    mine = sorted(int(i) for i in np.nonzero(table[:, me])[0])
    if not matrix:
        return mine
    w = np.eye(n) + table
    if transpose:
        w = w.T
    return mine, w / w.sum(axis=1)


# ---- optimizers --------------------------------------------------------------------------------

class CommunicationType(enum.Enum):
    """How the adapt-and-combine optimizers combine parameters: neighbor_allreduce,
    hierarchical_neighbor_allreduce, allreduce or empty (no communication).
    """
    neighbor_allreduce = "neighbor.allreduce"
    hierarchical_neighbor_allreduce = "hierarchical.neighbor.allreduce"
    allreduce = "allreduce"
    empty = "empty"


_COMM_NAMES = {
    CommunicationType.neighbor_allreduce: "neighbor_allreduce",
    CommunicationType.hierarchical_neighbor_allreduce: "hierarchical_neighbor_allreduce",
    CommunicationType.allreduce: "allreduce",
    CommunicationType.empty: "empty",
}


class _CommunicationTypeAttr:
    """BlueFog's optimizer attribute over rumor's ``communication`` string."""

    @property
    def communication_type(self):
        return {v: k for k, v in _COMM_NAMES.items()}[self.communication]

    @communication_type.setter
    def communication_type(self, value):
        if not isinstance(value, CommunicationType):
            raise TypeError("communication_type must be a CommunicationType")
        self.communication = _COMM_NAMES[value]


def _bluefog_flavour(opt):
    cls = type(opt)
    opt.__class__ = type(cls.__name__, (_CommunicationTypeAttr, cls), {})
    opt._pass_offset = 1  # the J-th pass communicates, as in BlueFog
    return opt


def _combine(kind, optimizer, model, communication_type, num_steps_per_communication):
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            _missing("optimizer wrappers over a list of several models")
        model = model[0]
    if not isinstance(communication_type, CommunicationType):
        raise TypeError("communication_type must be a CommunicationType")
    return _bluefog_flavour(kind(optimizer, model, _COMM_NAMES[communication_type], num_steps_per_communication))


def DistributedAdaptWithCombineOptimizer(optimizer, model,  # noqa: N802
                                         communication_type=CommunicationType.neighbor_allreduce,
                                         num_steps_per_communication: int = 1):
    """Wraps optimizer so that model's parameters are combined with the neighbours' while the local update runs (adapt with combine).

    Args:
        optimizer: the torch optimizer of model's parameters.
        model: the torch.nn.Module being trained.
        communication_type: a CommunicationType saying how parameters are combined; default
            CommunicationType.neighbor_allreduce.
        num_steps_per_communication: communicate every this many steps; default 1.

    Returns:
        The wrapped optimizer (a rumor.optim optimizer).

    Raises:
        ValueError: an argument is out of range.
    """
    return _combine(_optdec.AdaptWithCombine, optimizer, model, communication_type, num_steps_per_communication)


def DistributedAdaptThenCombineOptimizer(optimizer, model,  # noqa: N802
                                         communication_type=CommunicationType.neighbor_allreduce,
                                         num_steps_per_communication: int = 1):
    """Wraps optimizer so that model's parameters are updated locally first and then combined with the neighbours' (adapt then combine).

    Args:
        optimizer: the torch optimizer of model's parameters.
        model: the torch.nn.Module being trained.
        communication_type: a CommunicationType saying how parameters are combined; default
            CommunicationType.neighbor_allreduce.
        num_steps_per_communication: communicate every this many steps; default 1.

    Returns:
        The wrapped optimizer (a rumor.optim optimizer).

    Raises:
        ValueError: an argument is out of range.
    """
    return _combine(_optdec.AdaptThenCombine, optimizer, model, communication_type, num_steps_per_communication)


def DistributedAllreduceOptimizer(optimizer, model, num_steps_per_communication: int = 1):  # noqa: N802
    """Wraps optimizer so that model's parameters are averaged over every rank with allreduce after the local update.

    Args:
        optimizer: the torch optimizer of model's parameters.
        model: the torch.nn.Module being trained.
        num_steps_per_communication: communicate every this many steps; default 1.

    Returns:
        The wrapped optimizer (a rumor.optim optimizer).

    Raises:
        ValueError: an argument is out of range.
    """
    return DistributedAdaptWithCombineOptimizer(optimizer, model, CommunicationType.allreduce,
                                                num_steps_per_communication)


def DistributedNeighborAllreduceOptimizer(optimizer, model, num_steps_per_communication: int = 1):  # noqa: N802
    """Wraps optimizer so that model's parameters are combined with the in-neighbours' by neighbor_allreduce.

    Args:
        optimizer: the torch optimizer of model's parameters.
        model: the torch.nn.Module being trained.
        num_steps_per_communication: communicate every this many steps; default 1.

    Returns:
        The wrapped optimizer (a rumor.optim optimizer).

    Raises:
        ValueError: an argument is out of range.
    """
    return DistributedAdaptWithCombineOptimizer(optimizer, model, CommunicationType.neighbor_allreduce,
                                                num_steps_per_communication)


def DistributedHierarchicalNeighborAllreduceOptimizer(optimizer, model,  # noqa: N802
                                                      num_steps_per_communication: int = 1):
    """Wraps optimizer so that model's parameters are combined across machines by hierarchical_neighbor_allreduce.

    Args:
        optimizer: the torch optimizer of model's parameters.
        model: the torch.nn.Module being trained.
        num_steps_per_communication: communicate every this many steps; default 1.

    Returns:
        The wrapped optimizer (a rumor.optim optimizer).

    Raises:
        ValueError: an argument is out of range.
    """
    return DistributedAdaptWithCombineOptimizer(optimizer, model, CommunicationType.hierarchical_neighbor_allreduce,
                                                num_steps_per_communication)


def DistributedGradientAllreduceOptimizer(optimizer, model, num_steps_per_communication: int = 1):  # noqa: N802
    """Wraps optimizer so that model's parameters are updated with gradients averaged over every rank.

    Args:
        optimizer: the torch optimizer of model's parameters.
        model: the torch.nn.Module being trained.
        num_steps_per_communication: communicate every this many steps; default 1.

    Returns:
        The wrapped optimizer (a rumor.optim optimizer).

    Raises:
        ValueError: an argument is out of range.
    """
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            _missing("optimizer wrappers over a list of several models")
        model = model[0]
    return _GradientAllreduce(optimizer, model, num_steps_per_communication)


class _WindowNames:
    """BlueFog's method name for freeing a window optimizer's windows."""

    def unregister_window(self) -> None:
        self.free_windows()


def _window_flavour(opt):
    cls = type(opt)
    opt.__class__ = type(cls.__name__, (_WindowNames, cls), {})
    opt._pass_offset = 1  # the J-th pass communicates, as in BlueFog
    return opt


def DistributedWinPutOptimizer(optimizer, model, num_steps_per_communication: int = 1,  # noqa: N802
                               window_prefix: Optional[str] = None):
    """Wraps optimizer so that model's parameters are pushed to the out-neighbours' windows (win_put) and combined.

    Args:
        optimizer: the torch optimizer of model's parameters.
        model: the torch.nn.Module being trained.
        window_prefix: a prefix for the window names, so two such optimizers can coexist; None
            (the default) for none.
        num_steps_per_communication: communicate every this many steps; default 1.

    Returns:
        The wrapped optimizer (a rumor.optim optimizer).

    Raises:
        ValueError: an argument is out of range.
    """
    return _window_flavour(_optwin.DistributedWinPutOptimizer(optimizer, model, num_steps_per_communication))


def DistributedPullGetOptimizer(optimizer, model, num_steps_per_communication: int = 1):  # noqa: N802
    """Wraps optimizer so that model's parameters are combined with values pulled from the in-neighbours' windows (win_get).

    Args:
        optimizer: the torch optimizer of model's parameters.
        model: the torch.nn.Module being trained.
        num_steps_per_communication: communicate every this many steps; default 1.

    Returns:
        The wrapped optimizer (a rumor.optim optimizer).

    Raises:
        ValueError: an argument is out of range.
    """
    return _window_flavour(_optwin.DistributedPullGetOptimizer(optimizer, model, num_steps_per_communication))


def DistributedPushSumOptimizer(optimizer, model, num_steps_per_communication: int = 1):  # noqa: N802
    """Wraps optimizer so that model's parameters are combined by push-sum over windows (win_accumulate with the associated weight p).

    Args:
        optimizer: the torch optimizer of model's parameters.
        model: the torch.nn.Module being trained.
        num_steps_per_communication: communicate every this many steps; default 1.

    Returns:
        The wrapped optimizer (a rumor.optim optimizer).

    Raises:
        ValueError: an argument is out of range.
    """
    opt = _window_flavour(_optwin.DistributedPushSumOptimizer(optimizer, model, num_steps_per_communication))
    opt.force_barrier = True  # BlueFog's default for push-sum (False for put and get)
    return opt

# The public names; everything else here is this module's own business.
__all__ = [
    "CommunicationType", "DistributedAdaptThenCombineOptimizer",
    "DistributedAdaptWithCombineOptimizer", "DistributedAllreduceOptimizer",
    "DistributedGradientAllreduceOptimizer",
    "DistributedHierarchicalNeighborAllreduceOptimizer",
    "DistributedNeighborAllreduceOptimizer", "DistributedPullGetOptimizer",
    "DistributedPushSumOptimizer", "DistributedWinPutOptimizer", "ExponentialGraph",
    "ExponentialTwoGraph", "FullyConnectedGraph", "GetDynamicOnePeerSendRecvRanks",
    "GetExp2DynamicSendRecvMachineRanks", "GetInnerOuterExpo2DynamicSendRecvRanks",
    "GetInnerOuterRingDynamicSendRecvRanks", "GetRecvWeights", "GetSendWeights",
    "InferDestinationFromSourceRanks", "InferSourceFromDestinationRanks", "IsRegularGraph",
    "IsTopologyEquivalent", "MeshGrid2DGraph", "RingGraph", "StarGraph",
    "SymmetricExponentialGraph", "allgather", "allgather_nonblocking", "allreduce",
    "allreduce_", "allreduce_nonblocking", "allreduce_nonblocking_", "allreduce_parameters",
    "barrier", "broadcast", "broadcast_", "broadcast_nonblocking", "broadcast_nonblocking_",
    "broadcast_optimizer_state", "broadcast_parameters", "get_current_created_window_names",
    "get_skip_negotiate_stage", "get_win_version", "hierarchical_neighbor_allreduce",
    "hierarchical_neighbor_allreduce_nonblocking", "in_neighbor_machine_ranks",
    "in_neighbor_ranks", "init", "is_homogeneous", "is_machine_topo_weighted",
    "is_topo_weighted", "load_machine_topology", "load_topology", "local_rank", "local_size",
    "machine_rank", "machine_size", "mpi_threads_supported", "nccl_built", "neighbor_allgather",
    "neighbor_allgather_nonblocking", "neighbor_allreduce", "neighbor_allreduce_nonblocking",
    "neighbor_win_accumulate", "neighbor_win_accumulate_nonblocking", "neighbor_win_get",
    "neighbor_win_get_nonblocking", "neighbor_win_put", "neighbor_win_put_nonblocking",
    "out_neighbor_machine_ranks", "out_neighbor_ranks", "pair_gossip",
    "pair_gossip_nonblocking", "poll", "rank", "resume", "set_machine_topology",
    "set_skip_negotiate_stage", "set_topology", "shutdown", "size", "suspend", "synchronize",
    "timeline_context", "timeline_end_activity", "timeline_start_activity",
    "turn_off_win_ops_with_associated_p", "turn_on_win_ops_with_associated_p",
    "unified_mpi_window_model_supported", "wait", "win_accumulate",
    "win_accumulate_nonblocking", "win_associated_p", "win_create", "win_free", "win_get",
    "win_get_nonblocking", "win_lock", "win_mutex", "win_poll", "win_put",
    "win_put_nonblocking", "win_update", "win_update_then_collect", "win_wait",
]
