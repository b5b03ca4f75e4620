"""Graph topologies and dynamic schedules for decentralized training (BlueFog conventions).

A topology is a weighted directed graph over ranks 0..n-1, held as an n x n matrix W:
W[i, j] is the weight of the edge i -> j (the row is the sender). One step of neighbor
averaging computes, on every rank i,

    x_i <- W[i, i] * x_i + sum over in-neighbors j of W[j, i] * x_j

so column i holds rank i's receive weights and the mixing matrix applied to the stacked
vector x is W.T. An edge i -> j (i != j) exists where W[i, j] > 0.

Generators build the graph and give it *uniform receive weights*: each rank weighs itself and
each of its in-neighbors by 1 / (in_degree + 1), so every column of W sums to 1. For a regular
graph (all in-degrees equal and all out-degrees equal) W is then doubly stochastic and repeated
averaging converges to the exact mean.

Dynamic schedules are generators that yield, step after step, the (send_ranks, recv_ranks) of
one rank; the schedules of all ranks agree (i sends to j at step k exactly when j receives
from i at step k), so they can feed rumor.neighbor_allreduce(dst_weights=...) directly.
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, Iterator, List, Optional, Tuple

import networkx as nx
import numpy as np

__all__ = [
    "Topology",
    "ExponentialGraph",
    "ExponentialTwoGraph",
    "SymmetricExponentialGraph",
    "RingGraph",
    "StarGraph",
    "MeshGrid2DGraph",
    "FullyConnectedGraph",
    "uniform_weights",
    "metropolis_hastings_weights",
    "one_peer_exponential_schedule",
    "one_peer_machine_schedule",
    "one_peer_schedule",
    "inner_outer_ring_schedule",
    "inner_outer_exp2_schedule",
]


def _check_size(n, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise ValueError(f"{what}: size must be an int, got {n!r}")
    if n < 1:
        raise ValueError(f"{what}: size must be at least 1, got {n}")
    return int(n)


def _check_rank(rank, n: int, what: str, role: str = "rank") -> int:
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < n:
        raise ValueError(f"{what}: {role} must be an int in [0, {n}), got {rank!r}")
    return int(rank)


def uniform_weights(adjacency) -> np.ndarray:
    """W for the graph whose edges are the non-zero off-diagonal entries of `adjacency` (row =
    sender): every rank weighs itself and each in-neighbor by 1 / (in_degree + 1)."""
    a = np.asarray(adjacency, dtype=np.float64) != 0
    np.fill_diagonal(a, True)
    w = a.astype(np.float64)
    return w / w.sum(axis=0, keepdims=True)


def metropolis_hastings_weights(topo) -> "Topology":
    """The same edges with Metropolis-Hastings weights W[i, j] = 1 / (1 + max(d_i, d_j)) on every
    edge and the rest on the diagonal. For an undirected edge set (i -> j exactly when j -> i;
    e.g. star, mesh, symmetric rings) W is symmetric and doubly stochastic, so averaging
    converges to the exact mean even on irregular graphs, where uniform weights do not.

    Args:
        topo: a Topology, or anything Topology() takes (a weight matrix, a networkx graph);
            only its edges are used, not its weights.

    Returns:
        A new Topology with the same name and edges.

    Raises:
        ValueError: the edge set is not undirected, or topo is not a valid topology.
    """
    t = topo if isinstance(topo, Topology) else Topology(topo)
    n = t.size
    adj = t.weights > 0
    np.fill_diagonal(adj, False)
    if not np.array_equal(adj, adj.T):
        raise ValueError("rumor.topology.metropolis_hastings_weights: the edge set must be undirected "
                         "(i -> j exactly when j -> i)")
    deg = adj.sum(axis=1)
    w = np.zeros((n, n))
    for i, j in zip(*np.nonzero(adj)):
        w[i, j] = 1.0 / (1 + max(deg[i], deg[j]))
    w[np.diag_indices(n)] = 1.0 - w.sum(axis=1)
    return Topology(w, name=t.name)


class Topology:
    """A weighted directed graph over ranks 0..n-1 (see the module doc for the conventions).

    Topology(W) takes an n x n array-like of finite non-negative weights; Topology(G) takes a
    networkx.DiGraph whose nodes are 0..n-1 (edge attribute "weight", default 1; a self loop
    gives the self weight), or another Topology. Both are stored as W.

    Args:
        weights: the n x n weight matrix, a networkx graph (an undirected one counts both
            directions) or a Topology to copy.
        name: a label for repr() and error messages; None (the default) keeps a copied
            Topology's name, else "Topology".

    Raises:
        ValueError: the matrix is not square, empty, non-finite or has a negative weight, or the
            graph's nodes are not 0..n-1.
    """

    def __init__(self, weights, *, name: Optional[str] = None):
        what = "rumor.topology.Topology"
        family = None
        if isinstance(weights, Topology):
            w = weights.weights
            name = name or weights.name
            family = weights.family
        elif isinstance(weights, nx.Graph):
            g = weights
            if not g.is_directed():
                g = g.to_directed()
            n = g.number_of_nodes()
            if n < 1:
                raise ValueError(f"{what}: the graph has no nodes")
            if set(g.nodes) != set(range(n)):
                raise ValueError(f"{what}: graph nodes must be the ranks 0..{n - 1}, got {sorted(g.nodes)[:10]}")
            w = nx.to_numpy_array(g, nodelist=list(range(n)), weight="weight", dtype=np.float64)
        else:
            try:
                w = np.array(weights, dtype=np.float64)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{what}: weights must be a square matrix of numbers: {e}") from None
        if w.ndim != 2 or w.shape[0] != w.shape[1]:
            raise ValueError(f"{what}: weights must be a square n x n matrix, got shape {list(w.shape)}")
        if w.shape[0] < 1:
            raise ValueError(f"{what}: a topology needs at least one rank")
        if not np.all(np.isfinite(w)):
            raise ValueError(f"{what}: weights must be finite")
        if np.any(w < 0):
            i, j = map(int, np.argwhere(w < 0)[0])
            raise ValueError(f"{what}: weights must be non-negative, W[{i}, {j}] = {w[i, j]}")
        w.setflags(write=False)
        self._w = w
        self.name = name or "Topology"
        n = w.shape[0]
        off = w > 0
        np.fill_diagonal(off, False)
        self._in = [tuple(int(j) for j in np.nonzero(off[:, i])[0]) for i in range(n)]
        self._out = [tuple(int(j) for j in np.nonzero(off[i, :])[0]) for i in range(n)]
        self._graph = None
        self._family = family

    # ---- structure ---------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """The number of ranks n."""
        return self._w.shape[0]

    @property
    def weights(self) -> np.ndarray:
        """W as a read-only float64 n x n array (row = sender)."""
        return self._w

    @property
    def mixing_matrix(self) -> np.ndarray:
        """W.T: one averaging step maps the stacked values x to mixing_matrix @ x."""
        return self._w.T

    @property
    def graph(self) -> nx.DiGraph:
        """The topology as a networkx.DiGraph with "weight" attributes (self loops carry the
        self weights), as BlueFog's topology functions return it."""
        if self._graph is None:
            self._graph = nx.from_numpy_array(np.array(self._w), create_using=nx.DiGraph)
        return self._graph

    def _rank(self, rank) -> int:
        return _check_rank(rank, self.size, f"{self.name}")

    def in_neighbor_ranks(self, rank: int) -> List[int]:
        """Ranks that send to `rank` (sorted, without rank itself)."""
        return list(self._in[self._rank(rank)])

    def out_neighbor_ranks(self, rank: int) -> List[int]:
        """Ranks that `rank` sends to (sorted, without rank itself)."""
        return list(self._out[self._rank(rank)])

    def in_degree(self, rank: int) -> int:
        """How many ranks send to rank (self loops not counted).

        Args:
            rank: a rank in [0, size).

        Returns:
            The number of in-neighbors.

        Raises:
            ValueError: rank is not an int in [0, size).
        """
        return len(self._in[self._rank(rank)])

    def out_degree(self, rank: int) -> int:
        """How many ranks rank sends to (self loops not counted).

        Args:
            rank: a rank in [0, size).

        Returns:
            The number of out-neighbors.

        Raises:
            ValueError: rank is not an int in [0, size).
        """
        return len(self._out[self._rank(rank)])

    def receive_weights(self, rank: int) -> Tuple[float, Dict[int, float]]:
        """(self weight W[rank, rank], {src: W[src, rank]}) from the matrix."""
        r = self._rank(rank)
        return float(self._w[r, r]), {j: float(self._w[j, r]) for j in self._in[r]}

    def uniform_receive_weights(self, rank: int) -> Tuple[float, Dict[int, float]]:
        """(1/(d+1), {src: 1/(d+1)}) with d = in-degree: the weights when is_weighted=False.

        Args:
            rank: the receiving rank, in [0, size).

        Raises:
            ValueError: rank is not an int in [0, size).
        """
        r = self._rank(rank)
        u = 1.0 / (len(self._in[r]) + 1)
        return u, {j: u for j in self._in[r]}

    def send_weights(self, rank: int) -> Dict[int, float]:
        """{dst: W[rank, dst]} over the out-neighbors."""
        r = self._rank(rank)
        return {j: float(self._w[r, j]) for j in self._out[r]}

    @property
    def is_regular(self) -> bool:
        """All ranks have the same in-degree and the same out-degree."""
        ins = {len(x) for x in self._in}
        outs = {len(x) for x in self._out}
        return len(ins) == 1 and len(outs) == 1

    @property
    def is_symmetric(self) -> bool:
        """W == W.T (every edge has its reverse, with the same weight)."""
        return bool(np.array_equal(self._w, self._w.T))

    def is_doubly_stochastic(self, tol: float = 1e-12) -> bool:
        """Rows and columns of W sum to 1: averaging preserves the mean and converges to it
        (on a connected graph).

        Args:
            tol: the absolute tolerance on each row and column sum (default 1e-12).
        """
        return bool(np.allclose(self._w.sum(0), 1, atol=tol) and np.allclose(self._w.sum(1), 1, atol=tol))

    def is_connected(self) -> bool:
        """Strongly connected (information from every rank reaches every other)."""
        return nx.is_strongly_connected(self.graph)

    # ---- mixing rate -------------------------------------------------------------------------

    def second_largest_eigenvalue_modulus(self) -> float:
        """|lambda_2|: the second largest modulus among W's eigenvalues (W and W.T share them).
        For a mixing matrix whose columns sum to 1 the largest is 1, and the distance to
        consensus shrinks asymptotically by |lambda_2| per step."""
        if self.size == 1:
            return 0.0
        mods = np.sort(np.abs(np.linalg.eigvals(self._w)))[::-1]
        return float(mods[1])

    def spectral_gap(self) -> float:
        """1 - |lambda_2| (eigenvalue modulus, not singular value): the asymptotic per-step
        contraction of the disagreement is 1 - spectral_gap(). For symmetric W the two
        notions coincide and the bound holds at every step. 0 for a disconnected graph."""
        return 1.0 - self.second_largest_eigenvalue_modulus()

    # ---- identity ----------------------------------------------------------------------------

    @property
    def family(self) -> Optional[Tuple[str, Tuple[Tuple[str, object], ...]]]:
        """The graph family this topology was made by, as (generator name, its keyword
        arguments other than n), e.g. ("ExponentialGraph", (("base", 2),)); None for a graph
        given by its edges or weights, which has no version for another number of ranks."""
        return self._family

    def resized(self, n: int) -> Optional["Topology"]:
        """The same family over n ranks (live membership lays the topology over each new
        world this way), or None where the topology has no family or the family has no
        member of n ranks (e.g. a StarGraph whose center is not below n).

        Args:
            n: the number of ranks.

        Returns:
            A Topology or None.
        """
        if self._family is None:
            return None
        fn, kwargs = _FAMILIES[self._family[0]], dict(self._family[1])
        try:
            return fn(n, **kwargs)
        except ValueError:
            return None

    def fingerprint(self) -> int:
        """A 63-bit hash of the size and the exact weights (used to check that every rank set
        the same topology)."""
        h = hashlib.blake2b(digest_size=8)
        h.update(np.int64(self.size).tobytes())
        h.update(np.ascontiguousarray(self._w).tobytes())
        return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)

    def __eq__(self, other) -> bool:
        return isinstance(other, Topology) and np.array_equal(self._w, other._w)

    def __hash__(self) -> int:
        return self.fingerprint()

    def __repr__(self) -> str:
        edges = sum(len(o) for o in self._out)
        return f"rumor.topology.{self.name}(size={self.size}, edges={edges})"


def _from_offsets(n: int, offsets, name: str) -> Topology:
    adj = np.zeros((n, n), dtype=bool)
    for i in range(n):
        for d in offsets:
            if d % n:
                adj[i, (i + d) % n] = True
    return Topology(uniform_weights(adj), name=name)


def _powers(base: int, below: int) -> List[int]:
    p, out = 1, []
    while p < below:
        out.append(p)
        p *= base
    return out


def _check_base(base, what: str) -> int:
    if isinstance(base, bool) or not isinstance(base, (int, np.integer)) or base < 2:
        raise ValueError(f"{what}: base must be an int >= 2, got {base!r}")
    return int(base)


def ExponentialGraph(n: int, base: int = 2) -> Topology:  # noqa: N802 (BlueFog's name)
    """Rank i sends to i + base^k (mod n) for every base^k < n (1, 2, 4, ... for base 2), and
    receives from i - base^k. Regular, so uniform weights make W doubly stochastic."""
    what = "rumor.topology.ExponentialGraph"
    n = _check_size(n, what)
    base = _check_base(base, what)
    return _with_family(_from_offsets(n, _powers(base, n), "ExponentialGraph"), "ExponentialGraph", base=base)


def ExponentialTwoGraph(n: int) -> Topology:  # noqa: N802 (BlueFog's name)
    """ExponentialGraph(n, base=2) under BlueFog's other name."""
    t = ExponentialGraph(n, 2)
    return _with_family(Topology(t.weights, name="ExponentialTwoGraph"), "ExponentialTwoGraph")


def SymmetricExponentialGraph(n: int, base: int = 4) -> Topology:  # noqa: N802
    """Rank i sends to i + d and i - d (mod n) for every power d of base with d <= n // 2:
    the exponential graph made symmetric (i -> j exactly when j -> i)."""
    what = "rumor.topology.SymmetricExponentialGraph"
    n = _check_size(n, what)
    base = _check_base(base, what)
    offs = [d for d in range(1, n) if min(d, n - d) in set(_powers(base, n // 2 + 1))]
    return _with_family(_from_offsets(n, offs, "SymmetricExponentialGraph"), "SymmetricExponentialGraph", base=base)


def RingGraph(n: int, style: int = 0) -> Topology:  # noqa: N802
    """A ring. style 0: each rank sends to both neighbors i - 1 and i + 1; style 1: each rank
    sends to its left neighbor i - 1 (so it receives from i + 1); style 2: each rank sends to
    its right neighbor i + 1 (receives from i - 1). As in BlueFog, a ring of 2 ranks is one
    mutual edge whatever the style.

    Args:
        n: the number of ranks (>= 1).
        style: 0 (the default), 1 or 2, as above.

    Returns:
        A Topology with uniform receive weights.

    Raises:
        ValueError: n is not a positive int, or style is not 0, 1 or 2.
    """
    what = "rumor.topology.RingGraph"
    n = _check_size(n, what)
    if style not in (0, 1, 2) or isinstance(style, bool):
        raise ValueError(f"{what}: style must be 0 (both directions), 1 (to the left) or 2 (to the right), got {style!r}")
    if n == 2:
        return _with_family(_from_offsets(n, [1], "RingGraph"), "RingGraph", style=style)
    offs = {0: [1, -1], 1: [-1], 2: [1]}[style]
    return _with_family(_from_offsets(n, offs, "RingGraph"), "RingGraph", style=style)


def StarGraph(n: int, center: int = 0) -> Topology:  # noqa: N802
    """Every rank exchanges with `center` in both directions; no other edges.

    Args:
        n: the number of ranks (>= 1).
        center: the hub rank, in [0, n); default 0.

    Returns:
        A Topology with uniform receive weights.

    Raises:
        ValueError: n is not a positive int, or center is not a rank.
    """
    what = "rumor.topology.StarGraph"
    n = _check_size(n, what)
    c = _check_rank(center, n, what, "center")
    adj = np.zeros((n, n), dtype=bool)
    adj[c, :] = True
    adj[:, c] = True
    return _with_family(Topology(uniform_weights(adj), name="StarGraph"), "StarGraph", center=c)


def MeshGrid2DGraph(n: int, shape: Optional[Tuple[int, int]] = None) -> Topology:  # noqa: N802
    """A 2-D grid (not a torus) of nrow x ncol ranks in row-major order, each connected in both
    directions to its left/right and up/down neighbors. Without shape, nrow is the largest
    divisor of n not above sqrt(n) (a prime n gives a 1 x n line)."""
    what = "rumor.topology.MeshGrid2DGraph"
    n = _check_size(n, what)
    free = shape is None  # a given shape fixes the number of ranks: no family
    if shape is None:
        nrow = int(math.isqrt(n))
        while n % nrow:
            nrow -= 1
        shape = (nrow, n // nrow)
    try:
        nrow, ncol = (int(s) for s in shape)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: shape must be a pair (nrow, ncol), got {shape!r}") from None
    if nrow < 1 or ncol < 1 or nrow * ncol != n:
        raise ValueError(f"{what}: shape {tuple(shape)} does not hold {n} ranks")
    adj = np.zeros((n, n), dtype=bool)
    for i in range(n):
        r, c = divmod(i, ncol)
        if c + 1 < ncol:
            adj[i, i + 1] = adj[i + 1, i] = True
        if r + 1 < nrow:
            adj[i, i + ncol] = adj[i + ncol, i] = True
    t = Topology(uniform_weights(adj), name="MeshGrid2DGraph")
    return _with_family(t, "MeshGrid2DGraph") if free else t


def FullyConnectedGraph(n: int) -> Topology:  # noqa: N802
    """Every rank sends to every other; uniform weights 1/n make one step the exact mean."""
    n = _check_size(n, "rumor.topology.FullyConnectedGraph")
    return _with_family(Topology(np.full((n, n), 1.0 / n), name="FullyConnectedGraph"), "FullyConnectedGraph")


def _with_family(t: Topology, name: str, **kwargs) -> Topology:
    t._family = (name, tuple(sorted(kwargs.items())))
    return t


_FAMILIES = {"ExponentialGraph": ExponentialGraph, "ExponentialTwoGraph": ExponentialTwoGraph,
             "SymmetricExponentialGraph": SymmetricExponentialGraph, "RingGraph": RingGraph, "StarGraph": StarGraph,
             "MeshGrid2DGraph": MeshGrid2DGraph, "FullyConnectedGraph": FullyConnectedGraph}


# ---- dynamic schedules ---------------------------------------------------------------------------

def _ceil_log2(n: int) -> int:
    return (n - 1).bit_length()


def one_peer_exponential_schedule(n: int, rank: int) -> Iterator[Tuple[List[int], List[int]]]:
    """Yields ([send rank], [recv rank]) per step: at step k, with t = ceil(log2 n) and
    d = 2^(k mod t), rank sends to (rank + d) % n and receives from (rank - d) % n. With
    self weight 1/2 and peer weight 1/2, n a power of two, t steps give every rank the exact
    mean. n = 1 yields ([], []) forever."""
    what = "rumor.topology.one_peer_exponential_schedule"
    n = _check_size(n, what)
    rank = _check_rank(rank, n, what)
    t = _ceil_log2(n)
    k = 0
    while True:
        if t == 0:
            yield [], []
        else:
            d = 1 << (k % t)
            yield [(rank + d) % n], [(rank - d) % n]
        k += 1


def one_peer_machine_schedule(machine_size: int, machine_rank: int) -> Iterator[Tuple[List[int], List[int]]]:
    """one_peer_exponential_schedule over machines: yields ([send machine], [recv machine])
    for hierarchical_neighbor_allreduce(dst_machine_weights=..., src_machine_weights=...).

    Args:
        machine_size: the number of machines (>= 1).
        machine_rank: this machine's rank, in [0, machine_size).

    Returns:
        An endless iterator of ([send machine], [recv machine]) pairs.

    Raises:
        ValueError: machine_size is not a positive int or machine_rank is out of range.
    """
    what = "rumor.topology.one_peer_machine_schedule"
    n = _check_size(machine_size, what)
    _check_rank(machine_rank, n, what, "machine_rank")
    return one_peer_exponential_schedule(n, machine_rank)


def one_peer_schedule(topo: Topology, rank: int) -> Iterator[Tuple[List[int], List[int]]]:
    """One outgoing edge of a static topology per step: at step k every rank r sends to its
    out-neighbor number k mod out_degree(r), counted clockwise from r (r+1, r+2, ... mod n),
    and receives from every rank that picked it. A rank without out-neighbors sends nothing.

    Args:
        topo: the static topology (a Topology, or anything Topology() takes).
        rank: the rank whose steps are yielded, in [0, topo.size).

    Returns:
        An endless iterator of (send ranks, recv ranks) lists.

    Raises:
        ValueError: rank is out of range, or topo is not a valid topology.
    """
    topo = topo if isinstance(topo, Topology) else Topology(topo)
    n = topo.size
    rank = _check_rank(rank, n, "rumor.topology.one_peer_schedule")
    clockwise = [sorted(topo.out_neighbor_ranks(r), key=lambda j, r=r: (j - r) % n) for r in range(n)]
    k = 0
    while True:
        pick = [c[k % len(c)] if c else None for c in clockwise]
        sends = [pick[rank]] if pick[rank] is not None else []
        recvs = [r for r in range(n) if pick[r] == rank]
        yield sends, recvs
        k += 1


def _check_hierarchy(world_size, local_size, rank, what):
    world_size = _check_size(world_size, what)
    if isinstance(local_size, bool) or not isinstance(local_size, (int, np.integer)) or local_size < 1:
        raise ValueError(f"{what}: local_size must be a positive int, got {local_size!r}")
    if world_size % local_size:
        raise ValueError(f"{what}: world_size {world_size} is not a multiple of local_size {local_size} "
                         "(every machine must run the same number of ranks)")
    rank = _check_rank(rank, world_size, what)
    return world_size, int(local_size), rank


def _inner_outer(world_size: int, local_size: int, rank: int, exp2: bool):
    machines = world_size // local_size
    m, lr = divmod(rank, local_size)
    t_out = _ceil_log2(machines)
    inner = local_size - 1  # ranks of a machine that stay inside at a step
    t_in = _ceil_log2(inner) if inner > 1 else 0
    k = 0
    while True:
        out_lr = k % local_size
        if lr == out_lr:
            if machines == 1:
                yield [], []
            else:
                d = (1 << (k % t_out)) if exp2 else 1
                yield ([((m + d) % machines) * local_size + lr], [((m - d) % machines) * local_size + lr])
        elif inner < 2:
            yield [], []
        else:
            # Positions of the staying ranks in cyclic order after the outgoing one.
            p = (lr - out_lr - 1) % local_size
            d = (1 << (k % t_in)) if exp2 else 1

            def rank_at(q):
                return m * local_size + (out_lr + 1 + q % inner) % local_size

            yield [rank_at(p + d)], [rank_at(p - d)]
        k += 1


def inner_outer_ring_schedule(world_size: int, local_size: int, rank: int) -> Iterator[Tuple[List[int], List[int]]]:
    """Ranks are laid out machine by machine (rank = machine * local_size + local rank). At step
    k, local rank k mod local_size of every machine sends to the same local rank on the next
    machine and receives from the previous machine; the other local_size - 1 ranks of each
    machine form a ring among themselves (skipping the outgoing rank): send to the next,
    receive from the previous. A rank with nobody to talk to at a step yields ([], []).

    Args:
        world_size: the number of ranks (>= 1), a multiple of local_size.
        local_size: ranks per machine (>= 1).
        rank: the rank whose steps are yielded, in [0, world_size).

    Returns:
        An endless iterator of (send ranks, recv ranks) lists.

    Raises:
        ValueError: a size is not a positive int, world_size is not a multiple of local_size,
            or rank is out of range.
    """
    world_size, local_size, rank = _check_hierarchy(world_size, local_size, rank,
                                                     "rumor.topology.inner_outer_ring_schedule")
    return _inner_outer(world_size, local_size, rank, exp2=False)


def inner_outer_exp2_schedule(world_size: int, local_size: int, rank: int) -> Iterator[Tuple[List[int], List[int]]]:
    """As inner_outer_ring_schedule, but at step k the outgoing rank jumps 2^(k mod
    ceil(log2 machines)) machines ahead (and receives from as far behind), and the staying
    ranks jump 2^(k mod ceil(log2(local_size - 1))) places along their ring.

    Args:
        world_size: the number of ranks (>= 1), a multiple of local_size.
        local_size: ranks per machine (>= 1).
        rank: the rank whose steps are yielded, in [0, world_size).

    Returns:
        An endless iterator of (send ranks, recv ranks) lists.

    Raises:
        ValueError: a size is not a positive int, world_size is not a multiple of local_size,
            or rank is out of range.
    """
    world_size, local_size, rank = _check_hierarchy(world_size, local_size, rank,
                                                     "rumor.topology.inner_outer_exp2_schedule")
    return _inner_outer(world_size, local_size, rank, exp2=True)
