"""BlueFog's topology_util names over rumor.topology.

The generators return networkx.DiGraph objects carrying BlueFog's weights (edge attribute
"weight", self loops holding the self weights, W[i, j] = weight of edge i -> j), as BlueFog's
do, so code that reads the graph with networkx keeps working:

* ExponentialGraph, ExponentialTwoGraph, SymmetricExponentialGraph, RingGraph and
  FullyConnectedGraph are circulant: every rank spreads weight 1 / (out-degree + 1) over itself
  and its out-neighbours. They are regular, so these equal rumor's uniform receive weights.
* StarGraph and MeshGrid2DGraph carry Metropolis-Hastings weights (1 / (1 + max(d_i, d_j)) per
  edge, the rest on the diagonal), equal to rumor.topology.metropolis_hastings_weights of the
  same graph: with is_weighted=True a star or a mesh then averages to the exact mean.

Offsets "power of base" are exact integer powers (BlueFog computed them with a floating-point
logarithm, which misses 243 for base 3 and 1000 for base 10).
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import networkx as nx
import numpy as np

from ... import topology as _T

__all__ = [
    "ExponentialGraph",
    "ExponentialTwoGraph",
    "SymmetricExponentialGraph",
    "RingGraph",
    "StarGraph",
    "MeshGrid2DGraph",
    "FullyConnectedGraph",
    "GetRecvWeights",
    "GetSendWeights",
    "IsRegularGraph",
    "IsTopologyEquivalent",
    "GetDynamicOnePeerSendRecvRanks",
    "GetExp2DynamicSendRecvMachineRanks",
    "GetInnerOuterRingDynamicSendRecvRanks",
    "GetInnerOuterExpo2DynamicSendRecvRanks",
    "to_topology",
]


def _digraph(w: np.ndarray) -> nx.DiGraph:
    g = nx.DiGraph()
    n = w.shape[0]
    g.add_nodes_from(range(n))
    for i, j in zip(*np.nonzero(w)):
        g.add_edge(int(i), int(j), weight=float(w[i, j]))
    return g


def to_topology(graph) -> _T.Topology:
    """A networkx graph (or matrix, or Topology) as a rumor.topology.Topology."""
    return graph if isinstance(graph, _T.Topology) else _T.Topology(graph)


def _circulant(size: int, offsets, what: str) -> nx.DiGraph:
    size = _T._check_size(size, what)
    row = np.zeros(size)
    row[0] = 1.0
    for d in offsets:
        row[d % size] = 1.0
    row /= row.sum()
    w = np.empty((size, size))
    for i in range(size):
        w[i] = np.roll(row, i)
    return _digraph(w)


def _is_power(x: int, base: int) -> bool:
    p = 1
    while p < x:
        p *= base
    return p == x


def ExponentialGraph(size: int, base: int = 2) -> nx.DiGraph:  # noqa: N802
    """Rank i sends to i + base^k (mod size) for every base^k < size."""
    base = _T._check_base(base, "ExponentialGraph")
    return _circulant(size, [d for d in range(1, max(int(size), 1)) if _is_power(d, base)], "ExponentialGraph")


def ExponentialTwoGraph(size: int) -> nx.DiGraph:  # noqa: N802
    """ExponentialGraph(size, base=2)."""
    return ExponentialGraph(size, 2)


def SymmetricExponentialGraph(size: int, base: int = 4) -> nx.DiGraph:  # noqa: N802
    """Offsets d with min(d, size - d) (d <= size // 2: d itself) a power of base."""
    base = _T._check_base(base, "SymmetricExponentialGraph")
    n = max(int(size), 1)
    offs = [d for d in range(1, n) if _is_power(d if d <= n // 2 else n - d, base)]
    return _circulant(size, offs, "SymmetricExponentialGraph")


def RingGraph(size: int, connect_style: int = 0) -> nx.DiGraph:  # noqa: N802
    """connect_style 0: both neighbours (weights 1/3); 1: to the left (i - 1, weights 1/2);
    2: to the right (i + 1). A ring of 2 is one mutual edge with weights 1/2.

    Args:
        size: the number of nodes.
    """
    size = _T._check_size(size, "RingGraph")
    if connect_style not in (0, 1, 2) or isinstance(connect_style, bool):
        raise ValueError(f"RingGraph: connect_style must be 0, 1 or 2, got {connect_style!r}")
    if size <= 2:
        return _circulant(size, [1], "RingGraph")
    return _circulant(size, {0: [1, -1], 1: [-1], 2: [1]}[connect_style], "RingGraph")


def FullyConnectedGraph(size: int) -> nx.DiGraph:  # noqa: N802
    """The complete directed graph on size nodes, uniform weights 1/size.

    Args:
        size: the number of nodes.

    Returns:
        A networkx.DiGraph.
    """
    size = _T._check_size(size, "FullyConnectedGraph")
    return _circulant(size, range(size), "FullyConnectedGraph")


def StarGraph(size: int, center_rank: int = 0) -> nx.DiGraph:  # noqa: N802
    """Every rank exchanges with center_rank; Metropolis-Hastings weights: 1/size on every
    edge and on the center, 1 - 1/size on every other rank's self loop."""
    star = _T.StarGraph(size, center=center_rank)
    return _digraph(_T.metropolis_hastings_weights(star).weights.copy())


def MeshGrid2DGraph(size: int, shape: Optional[Tuple[int, int]] = None) -> nx.DiGraph:  # noqa: N802
    """nrow x ncol grid (row-major; without shape nrow is the largest divisor of size not above
    sqrt(size)) with Metropolis-Hastings weights."""
    mesh = _T.MeshGrid2DGraph(size, shape)
    return _digraph(_T.metropolis_hastings_weights(mesh).weights.copy())


def GetRecvWeights(topo, rank: int) -> Tuple[float, Dict[int, float]]:
    """(self weight, {in-neighbour: weight}) from the graph's weights.

    Args:
        topo: a networkx.DiGraph.
        rank: the receiving node.
    """
    t = to_topology(topo)
    sw, ws = t.receive_weights(rank)
    return sw, dict(ws)


def GetSendWeights(topo, rank: int) -> Tuple[float, Dict[int, float]]:
    """(self weight, {out-neighbour: weight}).

    Args:
        topo: a networkx.DiGraph.
        rank: the sending node.
    """
    t = to_topology(topo)
    return float(t.weights[rank, rank]), t.send_weights(rank)


def IsRegularGraph(topo) -> bool:
    """All ranks have the same degree (in + out, as networkx counts it).

    Args:
        topo: a networkx.DiGraph.
    """
    g = topo if isinstance(topo, nx.DiGraph) else to_topology(topo).graph
    return len({g.degree(r) for r in g.nodes}) <= 1


def IsTopologyEquivalent(topo1, topo2) -> bool:
    """Same number of nodes and the same weight matrix (not an isomorphism test).

    Args:
        topo1: a networkx.DiGraph.
        topo2: a networkx.DiGraph.
    """
    if topo1 is None or topo2 is None:
        return False
    a, b = to_topology(topo1).weights, to_topology(topo2).weights
    return a.shape == b.shape and bool(np.array_equal(a, b))


def GetDynamicOnePeerSendRecvRanks(topo, self_rank: int) -> Iterator[Tuple[List[int], List[int]]]:  # noqa: N802
    """At step k every rank sends to its out-neighbour number k mod out-degree, counted
    clockwise from itself; yields ([send rank], [receive ranks]).

    Args:
        topo: the networkx.DiGraph whose out-edges are cycled through.
        self_rank: this rank.
    """
    return _T.one_peer_schedule(to_topology(topo), self_rank)


def _homogeneous(world_size, local_size, self_rank, what):
    if local_size < 1 or world_size % local_size:
        raise ValueError(f"{what}: world_size {world_size} must be a multiple of local_size {local_size} "
                         "(every machine runs the same number of ranks)")
    if not 0 <= self_rank < world_size:
        raise ValueError(f"{what}: self_rank {self_rank} is outside [0, {world_size})")


def GetExp2DynamicSendRecvMachineRanks(world_size: int, local_size: int, self_rank: int,  # noqa: N802
                                       local_rank: int) -> Iterator[Tuple[List[int], List[int]]]:
    """One peer machine per step at distance 2^(k mod ceil(log2 machines)); yields
    ([send machine], [receive machine]).

    Args:
        world_size: the number of ranks.
        local_size: the number of ranks per machine.
        self_rank: this rank.
        local_rank: this rank's index on its machine.
    """
    what = "GetExp2DynamicSendRecvMachineRanks"
    _homogeneous(world_size, local_size, self_rank, what)
    if self_rank % local_size != local_rank:
        raise ValueError(f"{what}: local_rank {local_rank} is not self_rank % local_size")
    if world_size <= local_size:
        raise ValueError(f"{what}: needs at least two machines (world_size {world_size}, local_size {local_size})")
    return _T.one_peer_machine_schedule(world_size // local_size, self_rank // local_size)


def _inner_outer(world_size, local_size, self_rank, what, exp2):
    _homogeneous(world_size, local_size, self_rank, what)
    if local_size <= 2:
        raise ValueError(f"{what}: needs more than 2 ranks per machine (got {local_size}); use "
                         "hierarchical_neighbor_allreduce or GetDynamicOnePeerSendRecvRanks")
    machines = world_size // local_size
    if machines == 1:
        if exp2:
            raise ValueError(f"{what}: needs at least two machines")
        # One machine: the outgoing rank's "next machine" is its own (a self loop, which the
        # compat neighbor_allreduce folds into the self weight).
        gen = _T.inner_outer_ring_schedule(world_size, local_size, self_rank)

        def with_self_loop():
            k = 0
            for sends, recvs in gen:
                if k % local_size == self_rank % local_size:
                    yield [self_rank], [self_rank]
                else:
                    yield sends, recvs
                k += 1

        return with_self_loop()
    make = _T.inner_outer_exp2_schedule if exp2 else _T.inner_outer_ring_schedule
    return make(world_size, local_size, self_rank)


def GetInnerOuterRingDynamicSendRecvRanks(world_size: int, local_size: int,  # noqa: N802
                                          self_rank: int) -> Iterator[Tuple[List[int], List[int]]]:
    """Dynamic peers: a ring inside each machine and a ring between machines, alternating.

    Args:
        world_size: the number of ranks.
        local_size: the number of ranks per machine.
        self_rank: this rank.

    Returns:
        An endless iterator of (send ranks, receive ranks), one pair per step.
    """
    return _inner_outer(world_size, local_size, self_rank, "GetInnerOuterRingDynamicSendRecvRanks", False)


def GetInnerOuterExpo2DynamicSendRecvRanks(world_size: int, local_size: int,  # noqa: N802
                                           self_rank: int) -> Iterator[Tuple[List[int], List[int]]]:
    """Dynamic peers: a ring inside each machine and exponential-2 hops between machines, alternating.

    Args:
        world_size: the number of ranks.
        local_size: the number of ranks per machine.
        self_rank: this rank.

    Returns:
        An endless iterator of (send ranks, receive ranks), one pair per step.
    """
    return _inner_outer(world_size, local_size, self_rank, "GetInnerOuterExpo2DynamicSendRecvRanks", True)
