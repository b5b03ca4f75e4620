"""Neighbor operations (rumor.neighbor_allreduce / neighbor_allgather / hierarchical) on spawned
ranks, against closed forms computed from the topology's weight matrix.

Each test spawns its ranks once and runs a batch of cases (the static topologies: one test id
each, `-k ring2`, the selected ones in one launch); a rank records every mismatch
(harness.Checker) and the test lists them all. Inputs are small integers, so results are exact
where the weights are powers of two and within float tolerance otherwise.
"""
from __future__ import annotations

import functools
import math

import pytest

import harness
from harness import Checker


def _finish(chk):
    import rumor

    rumor.barrier()
    return chk.failures, chk.count


def _expected(W, values, r, weighted=True):
    """Closed form for rank r: column r of W applied to every rank's value (W[j, r] x_j)."""
    import numpy as np
    import torch

    from rumor.topology import uniform_weights

    W = np.asarray(W) if weighted else uniform_weights(W)
    acc = torch.zeros_like(values[0], dtype=torch.float64)
    for j in range(len(values)):
        if W[j, r] != 0:
            acc += float(W[j, r]) * values[j].double()
    return acc


# ---- static topologies -------------------------------------------------------------------------

def _static_topologies(n):
    """The topologies checked one by one: {scenario name: topology}."""
    from rumor import topology as T

    topos = [T.ExponentialGraph(n), T.RingGraph(n, 0), T.RingGraph(n, 1), T.RingGraph(n, 2), T.StarGraph(n),
             T.StarGraph(n, center=n - 1), T.MeshGrid2DGraph(n), T.FullyConnectedGraph(n),
             T.SymmetricExponentialGraph(n, 2)]
    return dict(zip(STATIC_TOPOLOGIES, topos))


STATIC_TOPOLOGIES = ["exponential", "ring0", "ring1", "ring2", "star", "star_last", "mesh2d", "fully_connected",
                     "symmetric_exponential2"]


def _sc_default_topology(chk, n, r, values):
    import rumor
    from rumor import topology as T

    # Default: ExponentialGraph(n) without set_topology.
    chk.check(rumor.load_topology() == T.ExponentialGraph(n), "default topology")


def _sc_topology(chk, n, r, values, name):
    import rumor
    import torch

    topo = _static_topologies(n)[name]
    what = f"{topo.name} {topo.out_neighbor_ranks(0)}"
    rumor.set_topology(topo)
    chk.check(rumor.in_neighbor_ranks() == topo.in_neighbor_ranks(r), f"{what}: in_neighbor_ranks")
    chk.check(rumor.out_neighbor_ranks() == topo.out_neighbor_ranks(r), f"{what}: out_neighbor_ranks")
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        x = values[r].to(dtype)
        got = rumor.neighbor_allreduce(x)
        want = _expected(topo.weights, values, r).to(dtype)
        chk.close(got, want, f"{what} {dtype}")
        chk.equal(x, values[r].to(dtype), f"{what} {dtype}: input unchanged")
    h = rumor.neighbor_allreduce_nonblocking(values[r])
    chk.close(rumor.synchronize(h), _expected(topo.weights, values, r), f"{what}: nonblocking")


def _sc_exponential4_closed_form(chk, n, r, values):
    import rumor
    import torch
    from rumor import topology as T

    # The example of the docs: ExponentialGraph(4), rank 0 gets (0 + 3 + 2) / 3.
    assert n == 4
    rumor.set_topology(T.ExponentialGraph(4))
    got = rumor.neighbor_allreduce(torch.tensor([float(r)], dtype=torch.float64))
    want = {0: (0 + 3 + 2) / 3, 1: (1 + 0 + 3) / 3, 2: (2 + 1 + 0) / 3, 3: (3 + 2 + 1) / 3}[r]
    chk.close(got, torch.tensor([want], dtype=torch.float64), "ExponentialGraph(4) closed form")


def _sc_weighted_matrix(chk, n, r, values):
    import numpy as np
    import rumor

    # is_weighted: the receiver uses column r of an arbitrary non-negative matrix.
    rng = np.random.default_rng(5)
    W = rng.integers(0, 3, size=(n, n)).astype(np.float64) / 4
    rumor.set_topology(W, is_weighted=True)
    chk.close(rumor.neighbor_allreduce(values[r]), _expected(W, values, r), "weighted matrix")
    # Unweighted use of the same matrix: uniform weights over its edges.
    rumor.set_topology(W, is_weighted=False)
    chk.close(rumor.neighbor_allreduce(values[r]), _expected(W, values, r, weighted=False), "uniform on matrix")


def _sc_src_weights_and_errors(chk, n, r, values):
    import rumor
    import torch
    from rumor import topology as T

    # Static mode with explicit receive weights (a source left out weighs 0).
    rumor.set_topology(T.ExponentialGraph(n))
    ins = T.ExponentialGraph(n).in_neighbor_ranks(r)
    sw = {ins[0]: 0.25} if ins else {}
    got = rumor.neighbor_allreduce(values[r], self_weight=0.75, src_weights=sw)
    want = 0.75 * values[r] + (0.25 * values[ins[0]] if ins else 0)
    chk.close(got, want, "static with src_weights")
    chk.raises(ValueError, lambda: rumor.neighbor_allreduce(values[r], self_weight=0.5),
               "self_weight without src_weights", match="together")
    bad = (r + n // 2 + 1) % n
    if bad not in ins and bad != r:
        chk.raises(ValueError, lambda: rumor.neighbor_allreduce(values[r], self_weight=0.5, src_weights={bad: 0.5}),
                   "src weight of a non-neighbor", match="not in-neighbors")
    chk.raises(TypeError, lambda: rumor.neighbor_allreduce(torch.ones(3, dtype=torch.int64)), "integer tensor",
               match="floating")
    chk.raises(ValueError, lambda: rumor.set_topology(T.RingGraph(n + 1)), "wrong size", match="ranks")
    # Ranks that set different topologies all get the same ValueError.
    chk.raises(ValueError, lambda: rumor.set_topology(T.StarGraph(n) if r == 1 else T.FullyConnectedGraph(n)),
               "different topologies", match="ranks [1]")


def _sc_digraph_and_dropped_input(chk, n, r, values):
    import rumor
    from rumor import topology as T

    # A networkx DiGraph (as BlueFog's topology functions return) is accepted as it is.
    rumor.set_topology(T.RingGraph(n, 2).graph, is_weighted=True)
    chk.check(rumor.load_topology() == T.RingGraph(n, 2), "set_topology from a DiGraph")
    chk.close(rumor.neighbor_allreduce(values[r]), _expected(T.RingGraph(n, 2).weights, values, r), "DiGraph")
    # A nonblocking call owns its buffers: the caller may drop its tensor before waiting.
    tmp = values[r].clone()
    h = rumor.neighbor_allreduce_nonblocking(tmp)
    del tmp
    chk.close(h.wait(), _expected(T.RingGraph(n, 2).weights, values, r), "input dropped before wait")


def _sc_non_contiguous(chk, n, r, values):
    import rumor
    from rumor import topology as T

    xt = values[r].t()
    rumor.set_topology(T.RingGraph(n))
    chk.close(rumor.neighbor_allreduce(xt), _expected(T.RingGraph(n).weights, [v.t() for v in values], r),
              "non-contiguous")


# In this order ("default_topology" first: it checks the topology before any set_topology).
STATIC = {"default_topology": _sc_default_topology}
STATIC.update({name: functools.partial(_sc_topology, name=name) for name in STATIC_TOPOLOGIES})
STATIC.update({"exponential4_closed_form": _sc_exponential4_closed_form, "weighted_matrix": _sc_weighted_matrix,
               "src_weights_and_errors": _sc_src_weights_and_errors,
               "digraph_and_dropped_input": _sc_digraph_and_dropped_input, "non_contiguous": _sc_non_contiguous})


def static_rank(names):
    """Runs the named scenarios of STATIC in order; returns {name: (failures, count)}."""
    import rumor
    import torch

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()
    values = [torch.arange(6, dtype=torch.float64).reshape(3, 2) + 10 * q for q in range(n)]
    out = harness.run_scenarios(chk, names, STATIC, n, r, values)
    _finish(chk)
    return out


STATIC_CASES = [(n, name) for n in (4, 3) for name in STATIC if n == 4 or name != "exponential4_closed_form"]


@pytest.mark.parametrize("n,scenario", STATIC_CASES, ids=[f"{n}ranks-{s}" for n, s in STATIC_CASES])
def test_static_topologies(n, scenario, request, batches):
    """One test id per topology or check; the selected ones of a world size run in one launch."""
    res = harness.batch(batches, ("static", n), lambda: harness.run(
        static_rank, n, timeout=90, args=(harness.selected(request, "scenario"),)))
    assert harness.assert_no_failures(harness.scenario_results(res, scenario),
                                      f"static topologies on {n} ranks: {scenario}") > 0


# ---- dynamic topologies ------------------------------------------------------------------------

def dynamic_rank():
    import rumor
    import torch

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()
    prev, nxt = (r - 1) % n, (r + 1) % n
    x = torch.full((5,), float(r), dtype=torch.float64)

    # The move: self weight 0, receive from i-1, send to i+1 -> x_i = i-1.
    got = rumor.neighbor_allreduce(x, self_weight=0.0, src_weights={prev: 1.0}, dst_weights=[nxt])
    chk.equal(got, torch.full((5,), float(prev), dtype=torch.float64), "move by one")
    # The sender scales by its dst weight: rank q sends 0.5 * (q + 1) * x_q.
    got = rumor.neighbor_allreduce(x, self_weight=1.0, src_weights={prev: 2.0}, dst_weights={nxt: 0.5 * (r + 1)})
    chk.equal(got, torch.full((5,), r + 2.0 * 0.5 * (prev + 1) * prev, dtype=torch.float64), "dst weight scaling")
    # Several destinations with different weights, all weights 1 on the receiving side.
    dsts = {(r + 1) % n: 1.0, (r + 2) % n: 0.5}
    srcs = {(r - 1) % n: 1.0, (r - 2) % n: 1.0}
    got = rumor.neighbor_allreduce(x, self_weight=0.0, src_weights=srcs, dst_weights=dsts)
    chk.equal(got, torch.full((5,), (r - 1) % n + 0.5 * ((r - 2) % n), dtype=torch.float64), "two dst weights")
    # Empty send lists: everyone sends to rank 0 only; rank 0 sends nothing.
    if r == 0:
        got = rumor.neighbor_allreduce(x, self_weight=1.0, src_weights={q: 1.0 for q in range(1, n)}, dst_weights=[])
        chk.equal(got, torch.full((5,), float(sum(range(n))), dtype=torch.float64), "gather into 0")
    else:
        got = rumor.neighbor_allreduce(x, self_weight=1.0, src_weights={}, dst_weights=[0])
        chk.equal(got, x, "senders only")
    # Nonblocking, several in flight.
    hs = [rumor.neighbor_allreduce_nonblocking(x * k, self_weight=0.5, src_weights={prev: 0.5}, dst_weights=[nxt])
          for k in range(1, 4)]
    for k, h in enumerate(hs, start=1):
        chk.equal(rumor.synchronize(h), torch.full((5,), 0.5 * k * r + 0.5 * k * prev, dtype=torch.float64),
                  f"nonblocking {k}")
    # Half types.
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        got = rumor.neighbor_allreduce(x.to(dtype), self_weight=0.5, src_weights={prev: 0.5}, dst_weights=[nxt])
        chk.equal(got, torch.full((5,), 0.5 * r + 0.5 * prev, dtype=dtype), f"{dtype}")

    # Mismatch: rank 1 also sends to rank 3, which does not expect it -> ValueError everywhere.
    extra = {nxt: 1.0}
    if r == 1:
        extra[3 % n] = 1.0
    e = chk.raises(ValueError, lambda: rumor.neighbor_allreduce(x, self_weight=0.5, src_weights={prev: 0.5},
                                                                 dst_weights=extra),
                   "unexpected send", match="rank 1 sends to rank 3")
    # Rank 2 expects rank 0, which does not send to it.
    src = {prev: 0.5}
    if r == 2:
        src[0] = 0.0
    chk.raises(ValueError, lambda: rumor.neighbor_allreduce(x, self_weight=0.5, src_weights=src, dst_weights=[nxt]),
               "missing send", match="rank 2 receives from rank 0, but rank 0 does not send to rank 2")
    # The communicator is still fine afterwards.
    got = rumor.neighbor_allreduce(x, self_weight=0.0, src_weights={prev: 1.0}, dst_weights=[nxt])
    chk.equal(got, torch.full((5,), float(prev), dtype=torch.float64), "after mismatches")

    # Argument errors (raised locally, before any communication).
    chk.raises(ValueError, lambda: rumor.neighbor_allreduce(x, dst_weights=[nxt]), "dst without src", match="required")
    chk.raises(ValueError, lambda: rumor.neighbor_allreduce(x, 1.0, {r: 1.0}, [nxt]), "self as source", match="itself")
    chk.raises(ValueError, lambda: rumor.neighbor_allreduce(x, 1.0, {prev: 1.0}, [n]), "rank outside", match="member")
    chk.raises(ValueError, lambda: rumor.neighbor_allreduce(x, 1.0, {prev: float("nan")}, [nxt]), "nan weight",
               match="finite")
    chk.raises(TypeError, lambda: rumor.neighbor_allreduce(x, 1.0, [prev], [nxt]), "src list", match="dict")

    # A group: ranks 1 and 3 swap (global ranks in the weights).
    g = rumor.new_group([1, 3])
    if r in (1, 3):
        other = 4 - r
        got = rumor.neighbor_allreduce(x, self_weight=0.0, src_weights={other: 1.0}, dst_weights=[other], group=g)
        chk.equal(got, torch.full((5,), float(other), dtype=torch.float64), "group swap")
    return _finish(chk)


def test_dynamic():
    res = harness.run(dynamic_rank, 4, timeout=90)
    harness.assert_no_failures(res, "dynamic neighbor_allreduce")


def missing_send_rank():
    """Without the check, rank 0 waits for rank 3, which sends nothing: rank 0 must fail (at its
    deadline, or when rank 3 exits); the others finish their part; nobody hangs."""
    import rumor
    import torch

    rumor.init()
    r = rumor.rank()
    x = torch.ones(4)
    src = {3: 1.0} if r == 0 else {}
    try:
        rumor.neighbor_allreduce(x, self_weight=1.0, src_weights=src, dst_weights=[], enable_topo_check=False)
    except rumor.RumorError as e:
        return type(e).__name__, str(e)
    return "ok", ""


def unexpected_send_rank():
    """Without the check, rank 1 sends to rank 0, which does not expect it: rank 0's next
    receive from rank 1 must fail the frame check rather than read the stale data."""
    import rumor
    import torch

    rumor.init()
    r = rumor.rank()
    x = torch.full((4,), 7.0)
    out = []
    try:
        rumor.neighbor_allreduce(x, 1.0, {}, [0] if r == 1 else [], enable_topo_check=False)
        got = rumor.neighbor_allreduce(x * 2, 0.0, {1: 1.0} if r == 0 else {}, [0] if r == 1 else [],
                                       enable_topo_check=False)
        out.append(("ok", got.tolist()))
    except rumor.RumorError as e:
        out.append((type(e).__name__, str(e)))
    return out


def test_mismatch_without_check_is_an_error_not_a_hang():
    res = harness.run(missing_send_rank, 4, timeout=60, env={"RUMOR_TIMEOUT": "3"})
    kind, msg = res[0]
    # A deadline, or (when rank 3 exits first) the dead peer noticed: an error either way.
    assert kind in ("CommTimeoutError", "PeerError"), res[0]
    assert "neighbor_allreduce" in msg and "rank 3" in msg, msg
    res = harness.run(unexpected_send_rank, 2, timeout=60, env={"RUMOR_TIMEOUT": "5"})
    kind, msg = res[0][0]
    assert kind == "ProtocolError", res[0]
    assert "rank 1" in msg, msg


# ---- neighbor_allgather ------------------------------------------------------------------------

def allgather_rank():
    import rumor
    import torch
    from rumor import topology as T

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()

    def mine(q, dtype=torch.float32):
        # Rank q contributes q + 1 rows of 3 (first dims differ between ranks).
        return (torch.arange((q + 1) * 3, dtype=torch.float64).reshape(q + 1, 3) + 100 * q).to(dtype)

    for topo in (T.ExponentialGraph(n), T.RingGraph(n, 2), T.StarGraph(n)):
        rumor.set_topology(topo)
        for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.uint8):
            got = rumor.neighbor_allgather(mine(r, dtype))
            want = torch.cat([mine(q, dtype) for q in topo.in_neighbor_ranks(r)] or [mine(0, dtype)[:0]])
            chk.equal(got, want, f"{topo.name} {dtype}")
    # Dynamic lists in a chosen order: receive from r-2 then r-1.
    srcs, dsts = [(r - 2) % n, (r - 1) % n], [(r + 1) % n, (r + 2) % n]
    got = rumor.neighbor_allgather(mine(r), src_ranks=srcs, dst_ranks=dsts)
    chk.equal(got, torch.cat([mine(q) for q in srcs]), "src_ranks order")
    h = rumor.neighbor_allgather_nonblocking(mine(r), src_ranks=srcs[::-1], dst_ranks=dsts)
    chk.equal(rumor.synchronize(h), torch.cat([mine(q) for q in srcs[::-1]]), "nonblocking, reversed order")
    # A scalar becomes one row.
    got = rumor.neighbor_allgather(torch.tensor(float(r)), src_ranks=[(r - 1) % n], dst_ranks=[(r + 1) % n])
    chk.equal(got, torch.tensor([float((r - 1) % n)]), "scalar")
    # Mismatched trailing dims: rank 1 has 4 columns, the others 3. Rank 1's receiver and rank
    # 1 itself raise (after the data moved, so nobody waits); the others succeed.
    x = torch.zeros(2, 4 if r == 1 else 3)
    src, dst = [(r - 1) % n], [(r + 1) % n]
    if r in (1, 2):
        want = "rank 0 has shape [2, 3], this rank has [2, 4]" if r == 1 else "rank 1 has shape [2, 4]"
        chk.raises(ValueError, lambda: rumor.neighbor_allgather(x, src_ranks=src, dst_ranks=dst),
                   "trailing dims", match=want)
    else:
        chk.equal(rumor.neighbor_allgather(x, src_ranks=src, dst_ranks=dst), torch.zeros(2, 3), "others unaffected")
    # Mismatched lists with the check: every rank raises.
    dst = [(r + 1) % n] + ([(r + 2) % n] if r == 0 else [])
    chk.raises(ValueError, lambda: rumor.neighbor_allgather(mine(r), src_ranks=[(r - 1) % n], dst_ranks=dst),
               "allgather mismatch", match="rank 0 sends to rank 2")
    chk.raises(ValueError, lambda: rumor.neighbor_allgather(mine(r), src_ranks=[(r - 1) % n]), "src without dst",
               match="together")
    return _finish(chk)


def test_neighbor_allgather():
    res = harness.run(allgather_rank, 4, timeout=90)
    harness.assert_no_failures(res, "neighbor_allgather")


# ---- hierarchical ------------------------------------------------------------------------------

def hierarchical_rank():
    import numpy as np
    import rumor
    import torch
    from rumor import topology as T

    rumor.init()
    r = rumor.rank()
    chk = Checker()
    chk.check((rumor.machine_size(), rumor.machine_rank(), rumor.local_size()) == (2, r // 2, 2), "emulated hosts")
    x = torch.arange(4, dtype=torch.float64) + 10 * r
    mean = [(torch.arange(4, dtype=torch.float64) * 2 + 10 * (2 * m) + 10 * (2 * m + 1)) / 2 for m in range(2)]
    m, other = r // 2, 1 - r // 2
    # Default machine topology: ExponentialGraph(2), uniform weights 1/2.
    chk.check(rumor.load_machine_topology() == T.ExponentialGraph(2), "default machine topology")
    chk.check(rumor.in_neighbor_machine_ranks() == [other], "in-neighbor machines")
    got = rumor.hierarchical_neighbor_allreduce(x)
    chk.close(got, 0.5 * mean[0] + 0.5 * mean[1], "static uniform")
    # Weighted machine topology: machine 0 keeps 3/4 of itself, machine 1 keeps 1/2.
    W = np.array([[0.75, 0.5], [0.25, 0.5]])
    rumor.set_machine_topology(W, is_weighted=True)
    got = rumor.hierarchical_neighbor_allreduce(x)
    chk.close(got, W[0, m] * mean[0] + W[1, m] * mean[1], "static weighted")
    # Dynamic: take the other machine's mean only.
    got = rumor.hierarchical_neighbor_allreduce(x, self_weight=0.0, src_machine_weights={other: 1.0},
                                                dst_machine_weights=[other])
    chk.close(got, mean[other], "dynamic swap")
    # The sender scales: machine q sends (q + 1) * its mean.
    got = rumor.hierarchical_neighbor_allreduce(x, self_weight=1.0, src_machine_weights={other: 1.0},
                                                dst_machine_weights={other: m + 1.0})
    chk.close(got, mean[m] + (other + 1.0) * mean[other], "dynamic dst scaling")
    h = rumor.hierarchical_neighbor_allreduce_nonblocking(x.float(), self_weight=0.5,
                                                          src_machine_weights={other: 0.5},
                                                          dst_machine_weights=[other])
    chk.close(rumor.synchronize(h), (0.5 * mean[0] + 0.5 * mean[1]).float(), "nonblocking float32")
    # Machine 1 expects machine 0, which sends nothing: ValueError on every rank, both hosts.
    chk.raises(ValueError, lambda: rumor.hierarchical_neighbor_allreduce(
        x, self_weight=1.0, src_machine_weights={0: 0.5} if m == 1 else {}, dst_machine_weights=[]),
        "machine mismatch", match="machine 1 receives from machine 0")
    got = rumor.hierarchical_neighbor_allreduce(x, self_weight=0.0, src_machine_weights={other: 1.0},
                                                dst_machine_weights=[other])
    chk.close(got, mean[other], "after the mismatch")
    chk.raises(ValueError, lambda: rumor.set_machine_topology(T.RingGraph(3)), "machine topology size",
               match="machines")
    return _finish(chk)


def test_hierarchical_two_hosts_by_host_id():
    rank_env = [{"RUMOR_HOST_ID": h} for h in ("hA", "hA", "hB", "hB")]
    res = harness.run(hierarchical_rank, 4, timeout=90, rank_env=rank_env)
    harness.assert_no_failures(res, "hierarchical_neighbor_allreduce on 2 hosts x 2 ranks")


# ---- consensus ---------------------------------------------------------------------------------

def one_peer_consensus_rank():
    import math

    import rumor
    import torch
    from rumor import topology as T

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()
    x = (torch.arange(6, dtype=torch.float64) + r) ** 2
    want = sum((torch.arange(6, dtype=torch.float64) + q) ** 2 for q in range(n)) / n
    sched = T.one_peer_exponential_schedule(n, r)
    for step in range(int(math.log2(n))):
        sends, recvs = next(sched)
        x = rumor.neighbor_allreduce(x, self_weight=0.5, src_weights={q: 0.5 for q in recvs},
                                     dst_weights={q: 1.0 for q in sends})
    # Inputs are integers and every step halves: exact in float64.
    chk.equal(x, want, f"exact average after log2({n}) steps")
    return _finish(chk)


@pytest.mark.parametrize("n", [4, 8])
def test_one_peer_exponential_consensus(n):
    res = harness.run(one_peer_consensus_rank, n, timeout=120)
    harness.assert_no_failures(res, f"one-peer exponential averaging on {n} ranks")


def ring_rate_rank(steps: int):
    import rumor
    import torch
    from rumor import topology as T

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    topo = T.RingGraph(n)
    rumor.set_topology(topo)
    x = torch.tensor([float((r * 7) % n) - 1.5, float(r * r)], dtype=torch.float64)
    errors = []
    for _ in range(steps + 1):
        allx = rumor.allgather(x.reshape(1, -1))
        errors.append(float((allx - allx.mean(0)).norm()))
        x = rumor.neighbor_allreduce(x)
    return errors, topo.second_largest_eigenvalue_modulus()


def test_static_ring_converges_at_the_spectral_rate():
    """Ring of 5 (weights 1/3, symmetric): the distance to the mean shrinks by at most |lambda_2|
    per step, and by |lambda_2| asymptotically (the other modes decay faster)."""
    steps = 25
    res = harness.run(ring_rate_rank, 5, timeout=90, args=(steps,))
    errors, slem = res[0]
    assert all(res[q][0] == errors for q in range(5))  # every rank saw the same (gathered) state
    assert slem == pytest.approx((1 + 2 * math.cos(2 * math.pi / 5)) / 3)
    ratios = [b / a for a, b in zip(errors, errors[1:])]
    assert all(q <= slem * (1 + 1e-9) for q in ratios), ratios
    assert ratios[-1] == pytest.approx(slem, rel=1e-4), ratios
