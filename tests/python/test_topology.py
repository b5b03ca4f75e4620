"""rumor.topology: generators, weights, neighbors, spectral gap and dynamic schedules (no ranks)."""
from __future__ import annotations

import itertools
import math

import networkx as nx
import numpy as np
import pytest

from rumor import topology as T


def _edges(topo):
    return {(i, j) for i in range(topo.size) for j in topo.out_neighbor_ranks(i)}


def _check_uniform_columns(topo):
    """Default weights: rank i weighs itself and each in-neighbor by 1/(in_degree+1)."""
    W = topo.weights
    assert W.dtype == np.float64 and W.shape == (topo.size, topo.size)
    for i in range(topo.size):
        d = topo.in_degree(i)
        want = np.zeros(topo.size)
        want[i] = 1 / (d + 1)
        for j in topo.in_neighbor_ranks(i):
            want[j] = 1 / (d + 1)
        np.testing.assert_allclose(W[:, i], want, rtol=0, atol=1e-15)
        sw, srcs = topo.receive_weights(i)
        assert sw == pytest.approx(1 / (d + 1)) and set(srcs) == set(topo.in_neighbor_ranks(i))
        assert topo.uniform_receive_weights(i) == (pytest.approx(1 / (d + 1)), {j: pytest.approx(1 / (d + 1))
                                                                                   for j in topo.in_neighbor_ranks(i)})
        assert topo.send_weights(i) == {j: W[i, j] for j in topo.out_neighbor_ranks(i)}
    np.testing.assert_allclose(W.sum(axis=0), 1.0)


# ---- generators ----------------------------------------------------------------------------------

def test_exponential_graph():
    t = T.ExponentialGraph(4)
    assert _edges(t) == {(0, 1), (0, 2), (1, 2), (1, 3), (2, 3), (2, 0), (3, 0), (3, 1)}
    assert t.out_neighbor_ranks(0) == [1, 2] and t.in_neighbor_ranks(0) == [2, 3]
    np.testing.assert_allclose(t.weights[:, 0], [1 / 3, 0, 1 / 3, 1 / 3])
    assert t.is_regular and t.is_doubly_stochastic() and not t.is_symmetric
    assert T.ExponentialGraph(8).out_neighbor_ranks(3) == [4, 5, 7]
    assert T.ExponentialGraph(10, base=3).out_neighbor_ranks(0) == [1, 3, 9]
    assert T.ExponentialGraph(1).weights.tolist() == [[1.0]]
    for n in range(1, 13):
        _check_uniform_columns(T.ExponentialGraph(n))


def test_symmetric_exponential_graph():
    t = T.SymmetricExponentialGraph(12)  # base 4: offsets +-1, +-4
    assert t.out_neighbor_ranks(0) == [1, 4, 8, 11]
    assert t.is_symmetric and t.is_regular
    assert T.SymmetricExponentialGraph(8, base=2).out_neighbor_ranks(0) == [1, 2, 4, 6, 7]
    for n in range(1, 13):
        tt = T.SymmetricExponentialGraph(n)
        assert tt.is_symmetric
        _check_uniform_columns(tt)


def test_ring_styles():
    both, left, right = T.RingGraph(5, 0), T.RingGraph(5, 1), T.RingGraph(5, 2)
    assert both.out_neighbor_ranks(0) == [1, 4] and both.in_neighbor_ranks(0) == [1, 4]
    # style 1 sends to the left neighbor (i - 1), style 2 to the right (i + 1).
    assert left.out_neighbor_ranks(0) == [4] and left.in_neighbor_ranks(0) == [1]
    assert right.out_neighbor_ranks(0) == [1] and right.in_neighbor_ranks(0) == [4]
    np.testing.assert_allclose(right.weights[4, 0], 0.5)
    np.testing.assert_allclose(both.weights[:, 2], [0, 1 / 3, 1 / 3, 1 / 3, 0])
    for style in (0, 1, 2):
        assert _edges(T.RingGraph(2, style)) == {(0, 1), (1, 0)}
        assert _edges(T.RingGraph(1, style)) == set()
        for n in range(1, 9):
            _check_uniform_columns(T.RingGraph(n, style))
    assert both.is_symmetric and both.is_doubly_stochastic()


def test_star_graph():
    t = T.StarGraph(5, center=2)
    assert t.out_neighbor_ranks(2) == [0, 1, 3, 4] and t.in_neighbor_ranks(2) == [0, 1, 3, 4]
    assert t.out_neighbor_ranks(0) == [2] and t.in_neighbor_ranks(4) == [2]
    np.testing.assert_allclose(t.weights[:, 2], [0.2] * 5)
    np.testing.assert_allclose(t.weights[:, 0], [0.5, 0, 0.5, 0, 0])
    assert not t.is_regular and t.is_symmetric is False  # column weights differ from row weights
    _check_uniform_columns(t)
    _check_uniform_columns(T.StarGraph(1))


def test_mesh_grid():
    t = T.MeshGrid2DGraph(6)  # 2 x 3
    assert t.in_neighbor_ranks(0) == [1, 3] and t.in_neighbor_ranks(4) == [1, 3, 5]
    assert all((b, a) in _edges(t) for a, b in _edges(t))
    t2 = T.MeshGrid2DGraph(6, shape=(3, 2))
    assert t2.in_neighbor_ranks(2) == [0, 3, 4]
    assert T.MeshGrid2DGraph(7).out_neighbor_ranks(3) == [2, 4]  # prime: a line
    assert T.MeshGrid2DGraph(16).in_neighbor_ranks(5) == [1, 4, 6, 9]
    for n in range(1, 13):
        _check_uniform_columns(T.MeshGrid2DGraph(n))


def test_fully_connected():
    t = T.FullyConnectedGraph(4)
    np.testing.assert_allclose(t.weights, np.full((4, 4), 0.25))
    assert t.spectral_gap() == pytest.approx(1.0)
    _check_uniform_columns(t)


# ---- Topology from matrices and graphs -----------------------------------------------------------

def test_topology_from_matrix_and_graph():
    W = np.array([[0.5, 0.5, 0], [0, 0.5, 1.0], [0.5, 0, 0]])
    t = T.Topology(W)
    assert t.size == 3 and t.in_neighbor_ranks(2) == [1] and t.out_neighbor_ranks(2) == [0]
    assert t.receive_weights(2) == (0.0, {1: 1.0})
    assert t.send_weights(0) == {1: 0.5}
    g = t.graph
    assert isinstance(g, nx.DiGraph) and g[1][2]["weight"] == 1.0 and g[0][0]["weight"] == 0.5
    assert T.Topology(g) == t and T.Topology(t) == t
    assert T.Topology(g).fingerprint() == t.fingerprint() != T.RingGraph(3).fingerprint()
    with pytest.raises(ValueError):
        t.weights[0, 0] = 2.0  # read-only
    # An undirected graph counts both directions; an unweighted edge weighs 1.
    u = T.Topology(nx.cycle_graph(4))
    assert u.in_neighbor_ranks(0) == [1, 3] and u.weights[1, 0] == 1.0


@pytest.mark.parametrize("bad, match", [
    (np.zeros((2, 3)), "square"),
    (np.zeros((0, 0)), "at least one"),
    (np.array([[1.0, -0.5], [0, 1]]), "non-negative"),
    (np.array([[1.0, np.nan], [0, 1]]), "finite"),
    (np.array([[1.0, np.inf], [0, 1]]), "finite"),
    ([[1, 2], [3]], "square matrix"),
    (np.zeros(3), "square"),
])
def test_topology_bad_matrices(bad, match):
    with pytest.raises(ValueError, match=match):
        T.Topology(bad)


def test_bad_generator_arguments():
    for call in [lambda: T.ExponentialGraph(0), lambda: T.ExponentialGraph(4, base=1), lambda: T.RingGraph(4, 3),
                 lambda: T.RingGraph(-1), lambda: T.StarGraph(4, center=4), lambda: T.MeshGrid2DGraph(6, (4, 2)),
                 lambda: T.FullyConnectedGraph(2.5), lambda: T.ExponentialGraph(4).in_neighbor_ranks(4),
                 lambda: T.Topology(nx.relabel_nodes(nx.cycle_graph(3), {0: 5})),
                 lambda: next(T.one_peer_exponential_schedule(4, 4)),
                 lambda: next(T.inner_outer_ring_schedule(7, 2, 0)),
                 lambda: next(T.inner_outer_exp2_schedule(8, 0, 0))]:
        with pytest.raises(ValueError):
            call()


# ---- spectral gap --------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: T.RingGraph(5), lambda: T.RingGraph(8, 2), lambda: T.ExponentialGraph(6),
                                  lambda: T.StarGraph(4), lambda: T.MeshGrid2DGraph(9),
                                  lambda: T.SymmetricExponentialGraph(10)])
def test_spectral_gap_matches_numpy(make):
    t = make()
    ev = np.linalg.eigvals(t.weights.T)
    mods = sorted(abs(ev), reverse=True)
    assert mods[0] == pytest.approx(1.0)
    assert t.spectral_gap() == pytest.approx(1 - mods[1], abs=1e-12)
    assert t.second_largest_eigenvalue_modulus() == pytest.approx(mods[1], abs=1e-12)


def test_spectral_gap_closed_forms():
    # Ring of n with weights 1/3: eigenvalues (1 + 2 cos(2 pi k / n)) / 3.
    for n in (3, 4, 5, 7):
        slem = max(abs((1 + 2 * math.cos(2 * math.pi * k / n)) / 3) for k in range(1, n))
        assert T.RingGraph(n).spectral_gap() == pytest.approx(1 - slem)
    assert T.Topology(np.eye(3)).spectral_gap() == pytest.approx(0.0)  # disconnected
    assert T.FullyConnectedGraph(1).spectral_gap() == 1.0
    assert T.RingGraph(5).is_connected() and not T.Topology(np.eye(3)).is_connected()


# ---- schedules -----------------------------------------------------------------------------------

def _steps(gens, k):
    return [list(itertools.islice(g, k)) for g in gens]


def _assert_consistent(per_rank, n):
    """At every step, i sends to j exactly when j lists i as a source (and no one names itself)."""
    steps = len(per_rank[0])
    for s in range(steps):
        sends = {(i, j) for i in range(n) for j in per_rank[i][s][0]}
        recvs = {(j, i) for i in range(n) for j in per_rank[i][s][1]}
        assert sends == recvs, f"step {s}: sends {sorted(sends)} vs receives {sorted(recvs)}"
        assert all(i != j for i, j in sends)
        for i in range(n):
            assert len(set(per_rank[i][s][0])) == len(per_rank[i][s][0])


def test_one_peer_exponential_schedule():
    got = list(itertools.islice(T.one_peer_exponential_schedule(8, 3), 7))
    assert got == [([4], [2]), ([5], [1]), ([7], [7]), ([4], [2]), ([5], [1]), ([7], [7]), ([4], [2])]
    got = list(itertools.islice(T.one_peer_exponential_schedule(5, 0), 4))  # t = 3: 1, 2, 4, 1
    assert got == [([1], [4]), ([2], [3]), ([4], [1]), ([1], [4])]
    assert next(T.one_peer_exponential_schedule(1, 0)) == ([], [])
    for n in range(1, 18):
        _assert_consistent(_steps([T.one_peer_exponential_schedule(n, r) for r in range(n)], 9), n)
    assert list(itertools.islice(T.one_peer_machine_schedule(4, 1), 2)) == [([2], [0]), ([3], [3])]


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_one_peer_exponential_exact_average(n):
    """Self weight 1/2 and peer weight 1/2 along the schedule: exact mean after log2(n) steps."""
    x = np.arange(n, dtype=np.float64) ** 2
    gens = [T.one_peer_exponential_schedule(n, r) for r in range(n)]
    for _ in range(int(math.log2(n))):
        plan = [next(g) for g in gens]
        x = np.array([0.5 * x[r] + 0.5 * x[plan[r][1][0]] for r in range(n)])
    assert np.all(x == np.mean(np.arange(n, dtype=np.float64) ** 2))


def test_one_peer_schedule_of_static_topology():
    for topo in [T.ExponentialGraph(6), T.StarGraph(5), T.RingGraph(4, 1), T.MeshGrid2DGraph(6), T.Topology(np.eye(3))]:
        n = topo.size
        per = _steps([T.one_peer_schedule(topo, r) for r in range(n)], 7)
        _assert_consistent(per, n)
        for r in range(n):
            for s, (sends, _) in enumerate(per[r]):
                outs = sorted(topo.out_neighbor_ranks(r), key=lambda j: (j - r) % n)
                assert sends == ([outs[s % len(outs)]] if outs else [])


@pytest.mark.parametrize("world, local", [(8, 4), (12, 3), (6, 2), (4, 1), (4, 4), (16, 4), (24, 6), (10, 5), (2, 2)])
def test_inner_outer_schedules(world, local):
    for make in (T.inner_outer_ring_schedule, T.inner_outer_exp2_schedule):
        per = _steps([make(world, local, r) for r in range(world)], 2 * local + 3)
        _assert_consistent(per, world)
        machines = world // local
        for r in range(world):
            m, lr = divmod(r, local)
            for k, (sends, recvs) in enumerate(per[r]):
                for j in sends + recvs:
                    if lr == k % local:  # the outgoing rank talks to the same local rank elsewhere
                        assert j % local == lr and j // local != m
                    else:  # everyone else stays on its machine, away from the outgoing rank
                        assert j // local == m and j % local != k % local
                if lr == k % local and machines > 1 and make is T.inner_outer_ring_schedule:
                    assert sends == [((m + 1) % machines) * local + lr]
                    assert recvs == [((m - 1) % machines) * local + lr]


def test_metropolis_hastings_weights():
    for topo in (T.StarGraph(5), T.MeshGrid2DGraph(6), T.RingGraph(7), T.SymmetricExponentialGraph(9)):
        mh = T.metropolis_hastings_weights(topo)
        assert _edges(mh) == _edges(topo)
        assert mh.is_symmetric and mh.is_doubly_stochastic() and mh.spectral_gap() > 0
        i, j = next(iter(sorted(_edges(topo))))
        assert mh.weights[i, j] == pytest.approx(1 / (1 + max(topo.out_degree(i), topo.out_degree(j))))
        # Repeated averaging reaches the exact mean (uniform weights on a star do not).
        x = np.arange(topo.size, dtype=np.float64) ** 2
        y = np.linalg.matrix_power(mh.mixing_matrix, 400) @ x
        np.testing.assert_allclose(y, x.mean(), rtol=1e-9)
    star = T.StarGraph(5)
    assert not np.allclose(np.linalg.matrix_power(star.mixing_matrix, 400) @ np.arange(5.0), 2.0)
    with pytest.raises(ValueError, match="undirected"):
        T.metropolis_hastings_weights(T.RingGraph(5, 2))
