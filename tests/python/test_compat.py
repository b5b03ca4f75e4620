"""rumor.compat.bluefog / rumor.compat.bagua and the core fixes they needed (issue 16).

* BlueFog's graphs and dynamic schedules against their published definitions, with the
  expected weights written here from the definitions;
* data-movement ops on every dtype (as bytes) and int8/int16 reductions, against
  torch.distributed gloo and exact references;
* uniform neighbor_allreduce computed as a sum and one division: exact for integer inputs with
  50 nonblocking operations in flight;
* BlueFog's semantics: weighted star consensus to 1e-12, init() twice, pass counting of the
  optimizer wrappers, ATC combined when step() returns, the gradient-allreduce optimizer,
  hierarchical self loops, allreduce inside a machine; pass counting and force_barrier of the
  window optimizers against a float64 simulation of every rank;
* example scripts written against BlueFog's and Bagua's APIs (examples/compat/), run with only
  the import changed, give the same bits as rumor's native API.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import os
import sys

import numpy as np
import pytest

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "compat")


# ==== topology definitions (no ranks) ===========================================================

def _powers_of(base, below):
    out, p = set(), 1
    while p < below:
        out.add(p)
        p *= base
    return out


def _circulant_expected(n, offsets):
    """Row i spreads 1/(k+1) over itself and i + d for the k distinct offsets d (mod n)."""
    offs = {d % n for d in offsets} - {0}
    w = np.zeros((n, n))
    for i in range(n):
        w[i, i] = 1.0 / (len(offs) + 1)
        for d in offs:
            w[i, (i + d) % n] = 1.0 / (len(offs) + 1)
    return w


def _matrix(g):
    import networkx as nx

    return nx.to_numpy_array(g, nodelist=list(range(g.number_of_nodes())))


def test_bluefog_graph_weights_match_definitions():
    import rumor.compat.bluefog.topology_util as tu
    from rumor import topology as T

    for n in range(1, 13):
        for base in (2, 3, 4):
            np.testing.assert_array_equal(_matrix(tu.ExponentialGraph(n, base)),
                                          _circulant_expected(n, _powers_of(base, n)), err_msg=f"Exp {n} {base}")
        np.testing.assert_array_equal(_matrix(tu.ExponentialTwoGraph(n)), _circulant_expected(n, _powers_of(2, n)))
        np.testing.assert_array_equal(T.ExponentialTwoGraph(n).weights, T.ExponentialGraph(n).weights)
        for base in (2, 4):
            # offset d joins when d (or n - d, past the half) is a power of base
            offs = [d for d in range(1, n) if (d if d <= n // 2 else n - d) in _powers_of(base, n)]
            np.testing.assert_array_equal(_matrix(tu.SymmetricExponentialGraph(n, base)), _circulant_expected(n, offs))
        for style, offs in ((0, [1, -1]), (1, [-1]), (2, [1])):
            want = _circulant_expected(n, [1] if n == 2 else offs)
            np.testing.assert_array_equal(_matrix(tu.RingGraph(n, style)), want, err_msg=f"ring {n} {style}")
        np.testing.assert_allclose(_matrix(tu.FullyConnectedGraph(n)), np.full((n, n), 1.0 / n), rtol=0, atol=1e-15)
        for c in {0, n - 1}:
            # BlueFog's star: 1/n on every edge and on the center, 1 - 1/n on the leaves
            want = np.zeros((n, n))
            for i in range(n):
                want[i, i] = 1 - 1 / n
                want[c, i] = want[i, c] = 1 / n
            want[c, c] = 1 / n
            got = _matrix(tu.StarGraph(n, c))
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-15, err_msg=f"star {n} center {c}")
            np.testing.assert_allclose(got, T.metropolis_hastings_weights(T.StarGraph(n, c)).weights, atol=1e-15)
        # Mesh: grid neighbours incl. self N_i; W[i, j] = 1 / max(|N_i|, |N_j|), rest on W[i, i]
        shapes = [None] + [(r, n // r) for r in range(1, n + 1) if n % r == 0]
        for shape in shapes:
            nrow = shape[0] if shape else max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
            ncol = n // nrow
            nb = [{i} for i in range(n)]
            for i in range(n):
                r, c = divmod(i, ncol)
                for rr, cc in ((r, c + 1), (r, c - 1), (r + 1, c), (r - 1, c)):
                    if 0 <= rr < nrow and 0 <= cc < ncol:
                        nb[i].add(rr * ncol + cc)
            want = np.zeros((n, n))
            for i in range(n):
                for j in nb[i] - {i}:
                    want[i, j] = 1.0 / max(len(nb[i]), len(nb[j]))
                want[i, i] = 1.0 - want[i].sum()
            got = _matrix(tu.MeshGrid2DGraph(n, shape))
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-15, err_msg=f"mesh {n} {shape}")
            np.testing.assert_allclose(got, T.metropolis_hastings_weights(T.MeshGrid2DGraph(n, shape)).weights,
                                       atol=1e-15)
    # The numbers: star consensus with BlueFog's weights reaches the mean; uniform stalls.
    x = np.arange(8.0) ** 2
    bf_star = T.Topology(tu.StarGraph(8))
    y = np.linalg.matrix_power(bf_star.mixing_matrix, 2000) @ x
    assert np.abs(y - x.mean()).max() / x.mean() < 1e-12
    y_uniform = np.linalg.matrix_power(T.StarGraph(8).mixing_matrix, 2000) @ x
    assert np.abs(y_uniform - x.mean()).max() / x.mean() > 0.1
    assert tu.GetRecvWeights(tu.StarGraph(4), 0) == (0.25, {1: 0.25, 2: 0.25, 3: 0.25})
    assert tu.GetSendWeights(tu.StarGraph(4), 2) == (0.75, {0: 0.25})
    assert tu.IsTopologyEquivalent(tu.ExponentialTwoGraph(6), tu.ExponentialGraph(6))
    assert not tu.IsTopologyEquivalent(tu.StarGraph(6), tu.ExponentialGraph(6))
    assert tu.IsRegularGraph(tu.RingGraph(6)) and not tu.IsRegularGraph(tu.StarGraph(6))


def _take(gen, k):
    return [next(gen) for _ in range(k)]


def test_bluefog_dynamic_generators_match_definitions():
    import rumor.compat.bluefog.topology_util as tu

    # One peer: rank r's out-neighbours sorted clockwise (r+1, r+2, ...); step k picks number
    # k mod out-degree; receivers are whoever picked this rank.
    for n in (2, 5, 8):
        for g in (tu.ExponentialTwoGraph(n), tu.RingGraph(n), tu.StarGraph(n), tu.MeshGrid2DGraph(n)):
            outs = [sorted((j for j in g.successors(r) if j != r), key=lambda j, r=r: (j - r) % n) for r in range(n)]
            for r in range(n):
                got = _take(tu.GetDynamicOnePeerSendRecvRanks(g, r), 7)
                for k, (send, recv) in enumerate(got):
                    picks = [outs[q][k % len(outs[q])] for q in range(n)]
                    assert send == [picks[r]] and recv == [q for q in range(n) if q != r and picks[q] == r]
    # Exp2 over machines: distance 2^(k mod (floor(log2(M - 1)) + 1)).
    for machines, local in ((2, 1), (3, 2), (5, 1), (8, 2)):
        world = machines * local
        for rank in range(world):
            m = rank // local
            for k, (send, recv) in enumerate(_take(tu.GetExp2DynamicSendRecvMachineRanks(world, local, rank,
                                                                                       rank % local), 9)):
                d = 2 ** (k % (int(math.floor(math.log2(machines - 1))) + 1))
                assert send == [(m + d) % machines] and recv == [(m - d) % machines]
    # Inner/outer: local rank k mod L goes out (to the same local rank on the next machine, or
    # 2^(k mod (floor(log2(M-1))+1)) machines ahead); the others step through local ranks,
    # skipping the outgoing one (ring: one step; expo2: 2^(k mod (floor(log2(L-2))+1)) steps).
    for machines, local in ((2, 3), (3, 4), (4, 5), (1, 3)):
        world = machines * local
        for exp2 in (False, True):
            if exp2 and machines == 1:
                with pytest.raises(ValueError, match="two machines"):
                    tu.GetInnerOuterExpo2DynamicSendRecvRanks(world, local, 0)
                continue
            make = tu.GetInnerOuterExpo2DynamicSendRecvRanks if exp2 else tu.GetInnerOuterRingDynamicSendRecvRanks
            for rank in range(world):
                m, lr = divmod(rank, local)
                for k, (send, recv) in enumerate(_take(make(world, local, rank), 12)):
                    out = k % local
                    if lr == out:
                        d = 2 ** (k % (int(math.log2(machines - 1)) + 1)) if exp2 and machines > 1 else 1
                        want = ([((m + d) % machines) * local + lr], [((m - d) % machines) * local + lr])
                    else:
                        d = 2 ** (k % (int(math.log2(local - 2)) + 1)) if exp2 else 1

                        def walk(step):
                            # step positions along the ring of staying local ranks
                            pos, left = lr, abs(step)
                            while left:
                                pos = (pos + (1 if step > 0 else -1)) % local
                                if pos != out:
                                    left -= 1
                            return m * local + pos

                        want = ([walk(d)], [walk(-d)])
                    assert (send, recv) == want, (machines, local, exp2, rank, k)
    with pytest.raises(ValueError):
        tu.GetInnerOuterRingDynamicSendRecvRanks(4, 2, 0)


def test_aliases_and_missing_features():
    import importlib

    import rumor.compat as compat
    import rumor.compat.bagua as bagua
    import rumor.compat.bluefog as bf

    compat.enable_aliases()
    try:
        assert importlib.import_module("bluefog.torch") is bf
        assert importlib.import_module("bluefog.common.topology_util") is bf.topology_util
        assert importlib.import_module("bagua.torch_api") is bagua
        from bagua.torch_api.algorithms import gradient_allreduce  # noqa: F401
        assert gradient_allreduce.GradientAllReduceAlgorithm is bagua.algorithms.gradient_allreduce.GradientAllReduceAlgorithm
    finally:
        compat.disable_aliases()
    assert "bluefog.torch" not in sys.modules
    with pytest.raises(NotImplementedError, match="suspend"):
        bf.suspend()
    with pytest.raises(NotImplementedError, match="win_lock"):
        bf.win_lock("w")
    with pytest.raises(NotImplementedError, match="BOR"):
        bagua._op(bagua.ReduceOp.BOR)
    with pytest.raises(NotImplementedError, match="store"):
        bagua.init_process_group(store=object())
    with pytest.raises(NotImplementedError, match="get_backend"):
        bagua.get_backend("m")
    assert bf.nccl_built() is False


# ==== ranks: dtypes and exactness ================================================================

def rank_dtypes():
    import torch
    import torch.distributed as dist

    import rumor

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    dist.init_process_group("gloo")
    chk = harness.Checker()

    def mine(q, dtype, numel=37):
        g = torch.Generator().manual_seed(q * 101 + numel)
        raw = torch.randint(-100, 100, (numel,), generator=g)
        if dtype == torch.bool:
            return raw > 0
        if dtype == torch.complex64:
            return torch.complex(raw.float(), -raw.float())
        return raw.to(dtype)

    moved = [torch.int8, torch.uint8, torch.int16, torch.bool, torch.complex64, torch.float64]
    for dtype in moved:
        x = mine(r, dtype)
        for root in range(n):
            chk.equal(rumor.broadcast(x, root), mine(root, dtype), f"broadcast {dtype} root {root}")
        chk.equal(rumor.allgather(x), torch.cat([mine(q, dtype) for q in range(n)]), f"allgather {dtype}")
        chk.equal(rumor.alltoall(torch.cat([x[:4]] * n)), torch.cat([mine(q, dtype)[:4] for q in range(n)]),
                  f"alltoall {dtype}")
        got = rumor.neighbor_allgather(x, src_ranks=[(r - 1) % n], dst_ranks=[(r + 1) % n])
        chk.equal(got, mine((r - 1) % n, dtype), f"neighbor_allgather {dtype}")
        y = x.clone()
        h = rumor.broadcast_nonblocking_(y, 0)
        rumor.synchronize(h)
        chk.equal(y, mine(0, dtype), f"broadcast_nonblocking_ {dtype}")
    # gloo's own answers for the dtypes it has
    for dtype in (torch.int8, torch.uint8, torch.bool):
        x = mine(r, dtype)
        want = x.clone()
        dist.broadcast(want, src=1)
        chk.equal(rumor.broadcast(x, 1), want, f"vs gloo broadcast {dtype}")
        outs = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(outs, x)
        chk.equal(rumor.allgather(x), torch.cat(outs), f"vs gloo all_gather {dtype}")
    # reductions in int8 / int16 (small values: no wrap), against gloo and an exact reference
    for dtype in (torch.int8, torch.int16):
        x = (mine(r, torch.int64) % 20 - 10).to(dtype)
        ref = [(mine(q, torch.int64) % 20 - 10) for q in range(n)]
        for op, ref_fn in (("SUM", lambda t: t.sum(0)), ("MIN", lambda t: t.amin(0)), ("MAX", lambda t: t.amax(0))):
            got = rumor.allreduce(x, op=getattr(rumor.ReduceOp, op))
            chk.equal(got, ref_fn(torch.stack(ref)).to(dtype), f"allreduce {dtype} {op}")
        avg = rumor.allreduce(x, op=rumor.ReduceOp.AVG)
        chk.equal(avg, torch.div(torch.stack(ref).sum(0), n, rounding_mode="trunc").to(dtype), f"AVG {dtype}")
        if dtype == torch.int8:
            want = x.clone()
            dist.all_reduce(want, op=dist.ReduceOp.SUM)
            chk.equal(rumor.allreduce(x, op=rumor.ReduceOp.SUM), want, "vs gloo all_reduce int8 SUM")
    with pytest.raises(TypeError, match="unsupported dtype"):
        rumor.allreduce(torch.zeros(3, dtype=torch.bool))
    dist.barrier()
    dist.destroy_process_group()
    return chk.failures, chk.count


def test_data_movement_every_dtype_and_small_int_reductions():
    res = harness.run(rank_dtypes, 4, timeout=90)
    harness.assert_no_failures([res[r] for r in range(4)], "dtypes")


def rank_uniform_exact():
    import torch

    import rumor
    from rumor import topology as T

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = harness.Checker()
    for topo in (T.ExponentialGraph(n), T.RingGraph(n), T.FullyConnectedGraph(n)):
        rumor.set_topology(topo)
        # BlueFog's fusion test: 50 tensors in flight, values up to ~50, bound 1e-5.
        xs = [torch.full((23, 23), float(r) + 0.0, dtype=dt).mul_(i + 1 if i < 48 else 1)
              for i, dt in zip(range(50), [torch.float32, torch.float64] * 25)]
        hs = [rumor.neighbor_allreduce_nonblocking(x) for x in xs]
        ins = topo.in_neighbor_ranks(r)
        for i, (x, h) in enumerate(zip(xs, hs)):
            got = rumor.synchronize(h)
            k = i + 1 if i < 48 else 1
            # the sum is exact in the dtype; one division by d + 1 rounds once
            total = torch.full_like(x, float(k * (r + sum(ins))))
            chk.equal(got, total / (len(ins) + 1), f"{topo.name} tensor {i}")
    # weights that are not uniform keep the weighted path
    rumor.set_topology(T.RingGraph(n))
    got = rumor.neighbor_allreduce(torch.tensor([float(r)], dtype=torch.float64), self_weight=0.5,
                                   src_weights={(r - 1) % n: 0.25, (r + 1) % n: 0.25})
    chk.close(got, torch.tensor([0.5 * r + 0.25 * ((r - 1) % n) + 0.25 * ((r + 1) % n)], dtype=torch.float64), "weighted")
    return chk.failures, chk.count


@pytest.mark.parametrize("n", [3, 4])
def test_uniform_neighbor_allreduce_is_exact_with_50_in_flight(n):
    res = harness.run(rank_uniform_exact, n, timeout=90)
    harness.assert_no_failures([res[r] for r in range(n)], "uniform neighbor_allreduce")


# ==== ranks: BlueFog semantics ===================================================================

def _model(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Linear(5, 3, dtype=torch.float64)


def rank_bluefog_semantics():
    import torch

    import rumor
    import rumor.compat.bluefog as bf

    bf.init()
    bf.init()  # a second init keeps the job and resets the topology
    n, r = bf.size(), bf.rank()
    chk = harness.Checker()
    chk.check(bf.IsTopologyEquivalent(bf.load_topology(), bf.ExponentialGraph(n)), "default topology")
    bf.set_topology(bf.RingGraph(n))
    bf.init()
    chk.check(bf.IsTopologyEquivalent(bf.load_topology(), bf.ExponentialGraph(n)), "init() resets the topology")
    bf.init(lambda size: bf.RingGraph(size))
    chk.check(bf.in_neighbor_ranks() == sorted({(r - 1) % n, (r + 1) % n}), "init(topology_fn)")

    # weighted star consensus reaches the mean (uniform weights stall)
    bf.set_topology(bf.StarGraph(n), is_weighted=True)
    x = torch.randn(10, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
    mean = bf.allreduce(x)
    y = x
    for _ in range(300):
        y = bf.neighbor_allreduce(y)
    chk.check(float((y - mean).norm() / mean.norm()) < 1e-12, f"weighted star: {float((y - mean).norm() / mean.norm())}")
    bf.set_topology(bf.StarGraph(n), is_weighted=False)
    y = x
    for _ in range(300):
        y = bf.neighbor_allreduce(y)
    mean_err = float(bf.allreduce((y - mean).norm().reshape(1) / mean.norm()))
    chk.check(mean_err > 1e-3, f"uniform star should not reach the mean, error {mean_err}")

    # self loop on one machine (hierarchical dynamic move): keeps the machine average
    t = torch.full((4,), float(r), dtype=torch.float64)
    machine_avg = torch.full((4,), (n - 1) / 2, dtype=torch.float64)
    got = bf.hierarchical_neighbor_allreduce(t, self_weight=0.0, src_machine_weights={0: 1.0}, dst_machine_weights=[0])
    chk.close(got, machine_avg, "self loop, dst list")
    got = bf.hierarchical_neighbor_allreduce(t, self_weight=0.0, src_machine_weights={0: 0.5},
                                             dst_machine_weights={0: 2.0})
    chk.close(got, machine_avg, "self loop, dst weight")
    got = rumor.hierarchical_neighbor_allreduce(t, self_weight=0.25, src_machine_weights={0: 0.75},
                                                dst_machine_weights=[0])
    chk.close(got, machine_avg, "native self loop")

    # AWC, "J passes then one step()": every step combines (lr 0: the combine alone)
    bf.set_topology(bf.RingGraph(n))
    for kind in ("awc", "atc"):
        m = _model(10 + r)
        start = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()
        make = bf.DistributedAdaptWithCombineOptimizer if kind == "awc" else bf.DistributedAdaptThenCombineOptimizer
        opt = make(torch.optim.SGD(m.parameters(), lr=0.0), m, num_steps_per_communication=3)
        chk.check(opt.enable_topo_check is False, "enable_topo_check defaults to False")
        expect = start
        for step in range(2):
            opt.zero_grad()
            for _ in range(3):
                m(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
            opt.step()
            expect = rumor.neighbor_allreduce(expect)
            got = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
            chk.equal(got, expect, f"{kind}: J passes then step, step {step} combined when step() returns")
        # step after every pass: only the J-th (last) of each group of 3 combines
        for step in range(6):
            opt.zero_grad()
            m(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
            opt.step()
            if step % 3 == 2:
                expect = rumor.neighbor_allreduce(expect)
            got = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
            chk.equal(got, expect, f"{kind}: step after every pass, step {step}")
        opt.remove_hooks()

    # DistributedGradientAllreduceOptimizer: SGD on the averaged gradient
    m = _model(3)
    opt = bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD(m.parameters(), lr=0.5), m)
    before = [p.detach().clone() for p in m.parameters()]
    xin = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(50 + r))
    m(xin).pow(2).sum().backward()
    local = [p.grad.clone() for p in m.parameters()]
    opt.step()
    for p, b, g in zip(m.parameters(), before, local):
        chk.equal(p.detach(), b - 0.5 * rumor.allreduce(g), "gradient allreduce optimizer step")
    # BlueFog flags that only exist there
    bf.set_skip_negotiate_stage(True)
    chk.check(bf.get_skip_negotiate_stage() is True, "skip negotiate flag")
    bf.barrier()
    return chk.failures, chk.count


def test_bluefog_semantics():
    res = harness.run(rank_bluefog_semantics, 4, timeout=120)
    harness.assert_no_failures([res[r] for r in range(4)], "bluefog semantics")


def rank_bluefog_machines():
    import torch

    import rumor.compat.bluefog as bf

    bf.init()
    n, r = bf.size(), bf.rank()
    chk = harness.Checker()
    chk.check(bf.local_size() == 2 and bf.local_rank() == r % 2, "BLUEFOG_NODES_PER_MACHINE=2: local_size 2")
    chk.check(bf.machine_size() == n // 2 and bf.machine_rank() == r // 2, "machine rank")
    t = torch.full((3, 3), float(r))
    got = bf.allreduce(t, average=True, is_hierarchical_local=True)
    chk.equal(got, torch.full((3, 3), r - r % 2 + 0.5), "allreduce inside the machine")
    got = bf.allreduce(t, average=False, is_hierarchical_local=True)
    chk.equal(got, torch.full((3, 3), 2.0 * (r - r % 2) + 1), "sum inside the machine")
    ms, m = bf.machine_size(), bf.machine_rank()
    got = bf.hierarchical_neighbor_allreduce(t, self_weight=0.0, src_machine_weights={(m + 1) % ms: 1.0},
                                             dst_machine_weights=[(m - 1) % ms])
    chk.equal(got, torch.full((3, 3), 2.0 * ((m + 1) % ms) + 0.5), "hierarchical dynamic move")
    return chk.failures, chk.count


def test_bluefog_emulated_machines():
    res = harness.run(rank_bluefog_machines, 4, timeout=90, env={"BLUEFOG_NODES_PER_MACHINE": "2"})
    harness.assert_no_failures([res[r] for r in range(4)], "emulated machines")


def _window_reference_step(kind, X, Z, P, S, SP, local, src, grads, lr, due):
    """One step of every rank of a window optimizer in a float64 simulation, in lockstep (all
    exchanges of the previous step have landed). X: parameters per rank; for push-sum Z / P its z
    and p, S / SP the slots, local whether x moved since the last push. Every rank has one
    in-neighbour src[r] and the uniform weights 1/2. Returns the new state."""
    n = len(X)
    if kind != "pushsum":
        if due:  # win_update of what was put / published at the step's start
            X = [0.5 * X[r] + 0.5 * X[src[r]] for r in range(n)]
        return [X[r] - lr * grads[r] for r in range(n)], Z, P, S, SP, local
    if not due:
        return [X[r] - lr * grads[r] for r in range(n)], Z, P, S, SP, True
    if local:  # local steps since the last push: z = x * p before collecting
        Z = [X[r] * P[r] for r in range(n)]
    Z = [Z[r] + S[r] for r in range(n)]
    P = [P[r] + SP[r] for r in range(n)]
    X = [Z[r] / P[r] - lr * grads[r] for r in range(n)]
    Z = [X[r] * P[r] for r in range(n)]
    S = [0.5 * Z[src[r]] for r in range(n)]  # what the in-neighbour pushed
    SP = [0.5 * P[src[r]] for r in range(n)]
    return X, [0.5 * z for z in Z], [0.5 * p for p in P], S, SP, False


def rank_window_pass_counting(cases):
    """BlueFog's window optimizers count passes: with num_steps_per_communication=3, "3 passes
    then one step()" communicates at every step, a step after every pass at every third (the
    third pass of each group for BlueFog's names, the first for rumor's own, which is what
    counting steps gave), and a bare step() counts as a pass. Checked bit for bit against a
    float64 simulation of all ranks (one in-neighbour, weights 1/2, lr 1/8: every operation
    rounds once, in the same order); push-sum also keeps the local steps between its pushes.
    BlueFog's names run with force_barrier, rumor's with explicit waits and barriers.
    cases: [(kind, api)] in order; returns {case: (failures, count)}."""
    import torch

    import rumor
    import rumor.compat.bluefog as bf

    bf.init()
    n, r = bf.size(), bf.rank()
    bf.set_topology(bf.RingGraph(n, connect_style=1))
    (mine,) = bf.in_neighbor_ranks()
    src = [int(v) for v in rumor.allgather(torch.tensor([mine]))]
    chk = harness.Checker()
    lr, J = 0.125, 3
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    kinds = {"winput": "DistributedWinPutOptimizer", "pullget": "DistributedPullGetOptimizer",
             "pushsum": "DistributedPushSumOptimizer"}
    out = {}
    for case in cases:
        kind, api = case
        cls = kinds[kind]
        f0, c0 = len(chk.failures), chk.count
        m = _model(40 + r)
        make = getattr(bf if api == "bluefog" else rumor.optim, cls)
        opt = make(torch.optim.SGD(m.parameters(), lr=lr), m, num_steps_per_communication=J)
        if api == "bluefog":
            chk.check(opt.force_barrier is (kind == "pushsum"), f"{kind}: BlueFog's force_barrier default")
            opt.force_barrier = True
        X = list(rumor.allgather(flat(m).unsqueeze(0)))
        Z, P = list(X), [torch.ones((), dtype=torch.float64)] * n
        S, SP, local = [torch.zeros_like(X[0])] * n, [torch.zeros((), dtype=torch.float64)] * n, False
        gen = torch.Generator().manual_seed(70 + r)
        offset = 1 if api == "bluefog" else 0
        passes = 0
        # (passes before the step, with a forward each; 0 is a bare step(): a pass itself)
        schedule = [3, 3] + [1] * 6 + [0] * 3
        for step, k in enumerate(schedule):
            opt.zero_grad()
            due = any((passes + i + offset) % J == 0 for i in range(max(k, 1)))
            passes += max(k, 1)
            for _ in range(k):
                m(torch.randn(4, 5, dtype=torch.float64, generator=gen)).pow(2).sum().backward()
            g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                           for p in m.parameters()])
            # One-sided exchanges land on their own time: the barriers make this run lockstep
            # (puts and gets of this step before any combine, pushes after every collect);
            # BlueFog's force_barrier does the first inside step().
            if api == "native":
                for h in list(opt._handles):
                    h.wait()
                rumor.barrier()
            if k == 0:
                g = torch.zeros_like(g)
            opt.step(closure=rumor.barrier)
            opt._wait()
            rumor.barrier()
            grads = list(rumor.allgather(g.unsqueeze(0)))
            what = f"{api} {kind}: step {step} ({k} passes, communicates: {due})"
            if k == 0 and kind != "pushsum":
                # A bare step() exchanges and combines inside step(): what a neighbour's slot
                # or published copy holds then depends on timing (one-sided), so only
                # whether it communicated is checked (no gradient: a local step is a no-op).
                before, X = X[r], list(rumor.allgather(flat(m).unsqueeze(0)))
                chk.check(bool((X[r] != before).any()) == due, what)
                continue
            X, Z, P, S, SP, local = _window_reference_step(kind, X, Z, P, S, SP, local, src, grads, lr, due)
            chk.equal(flat(m), X[r], what)
        opt.remove_hooks()
        rumor.barrier()
        opt.free_windows()
        out[case] = (chk.failures[f0:], chk.count - c0)
    return out


PASS_COUNTING = [(kind, api) for kind in ("winput", "pullget", "pushsum") for api in ("bluefog", "native")]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", PASS_COUNTING, ids=[f"{k}-{a}" for k, a in PASS_COUNTING])
def test_window_optimizers_count_passes(n, case, request, batches):
    """One test id per (optimizer, API); the selected ones of a world size run in one launch."""
    res = harness.batch(batches, ("pass counting", n), lambda: harness.run(
        rank_window_pass_counting, n, timeout=120, args=(harness.selected(request, "case"),)))
    assert harness.assert_no_failures(harness.scenario_results(res, case),
                                      f"window optimizers' pass counting, {n} ranks, {case}") > 0


# ==== ranks: example scripts, import changed only, vs rumor's native API ==========================

def _load(name):
    spec = importlib.util.spec_from_file_location(f"compat_example_{name}", os.path.join(EXAMPLES, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _native_consensus(weights, iterations, seed=0, size=16):
    import torch

    import rumor
    from rumor import topology as T

    rumor.set_topology(weights, is_weighted=True)
    x = torch.randn(size, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + rumor.rank()))
    for _ in range(iterations):
        x = rumor.neighbor_allreduce(x)
    del T
    return x


def _native_mnist(mod, optimizer, steps, lr=0.05):
    import torch
    import torch.nn.functional as F

    import rumor

    rumor.set_topology(rumor.topology.ExponentialTwoGraph(rumor.size()))
    torch.manual_seed(0)
    model = mod.Net()
    for p in model.parameters():
        rumor.broadcast_(p.data, 0)
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if optimizer == "gradient_allreduce":
        opt = rumor.optim.GradientAllReduceOptimizer(base, model)
    else:
        wrap = rumor.optim.AdaptWithCombine if optimizer == "awc" else rumor.optim.AdaptThenCombine
        opt = wrap(base, model)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = mod.synthetic_batch(step, rumor.rank())
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _native_bagua(mod, algorithm, steps, lr=0.05):
    import torch
    import torch.nn.functional as F

    import rumor

    torch.manual_seed(0)
    model = mod.Net()
    if algorithm == "qadam":
        optimizer = rumor.optim.OneBitAdamOptimizer(model.parameters(), lr=1e-3, freeze_step=5)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    alg = {"gradient_allreduce": lambda: rumor.algorithms.GradientAllReduce(),
           "decentralized": lambda: rumor.algorithms.Decentralized(peer_selection="all", hierarchical=True),
           "bytegrad": lambda: rumor.algorithms.ByteGrad(),
           "qadam": lambda: rumor.algorithms.OneBitAdamAlgorithm(optimizer, hierarchical=True)}[algorithm]()
    model = rumor.DistributedDataParallel(model, optimizer=optimizer, algorithm=alg)
    losses = []
    for step in range(steps):
        x, y = mod.synthetic_batch(step, rumor.rank())
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _bagua_primitives(chk):
    """Bagua's functional primitives (send/recv tensors, comm=) against exact expectations."""
    import torch

    import rumor.compat.bagua as bagua

    bagua.init_process_group()
    n, r = bagua.get_world_size(), bagua.get_rank()

    def val(q, k=6):
        return torch.arange(k, dtype=torch.float64) + 10 * q

    recv = torch.empty(6, dtype=torch.float64)
    bagua.allreduce(val(r), recv, op=bagua.ReduceOp.SUM)
    chk.equal(recv, sum(val(q) for q in range(n)), "bagua allreduce SUM")
    t = val(r)
    bagua.allreduce_inplace(t, op=bagua.ReduceOp.MAX)
    chk.equal(t, val(n - 1), "bagua allreduce_inplace MAX")
    t = val(r)
    bagua.broadcast(t, src=n - 1)
    chk.equal(t, val(n - 1), "bagua broadcast")
    out = torch.empty(6 * n, dtype=torch.float64)
    bagua.allgather(val(r), out)
    chk.equal(out, torch.cat([val(q) for q in range(n)]), "bagua allgather")
    t = torch.zeros(6 * n, dtype=torch.float64)
    t[6 * r:6 * r + 6] = val(r)
    bagua.allgather_inplace(t)
    chk.equal(t, torch.cat([val(q) for q in range(n)]), "bagua allgather_inplace")
    recv = torch.full((6,), -1.0, dtype=torch.float64)
    bagua.reduce(val(r), recv, dst=0, op=bagua.ReduceOp.SUM)
    chk.equal(recv, sum(val(q) for q in range(n)) if r == 0 else torch.full((6,), -1.0, dtype=torch.float64),
              "bagua reduce")
    send = torch.cat([val(r, 3) + 100 * k for k in range(n)])
    recv = torch.empty(3, dtype=torch.float64)
    bagua.reduce_scatter(send, recv, op=bagua.ReduceOp.SUM)
    chk.equal(recv, sum(val(q, 3) + 100 * r for q in range(n)), "bagua reduce_scatter")
    recv = torch.empty(3 * n, dtype=torch.float64)
    bagua.alltoall(send, recv)
    chk.equal(recv, torch.cat([val(q, 3) + 100 * r for q in range(n)]), "bagua alltoall")
    counts = [1 + q for q in range(n)]
    displs = [sum(counts[:q]) for q in range(n)]
    s = torch.arange(sum(counts), dtype=torch.float64) + 1000 * r
    rc = [1 + r] * n
    rd = [q * (1 + r) for q in range(n)]
    recv = torch.empty(n * (1 + r), dtype=torch.float64)
    bagua.alltoall_v(s, counts, displs, recv, rc, rd)
    want = torch.cat([torch.arange(displs[r], displs[r] + counts[r], dtype=torch.float64) + 1000 * q for q in range(n)])
    chk.equal(recv, want, "bagua alltoall_v")
    recv = torch.empty(6 * n, dtype=torch.float64)
    bagua.gather(val(r), recv, dst=0)
    if r == 0:
        chk.equal(recv, torch.cat([val(q) for q in range(n)]), "bagua gather")
    full = torch.cat([val(q) for q in range(n)]) if r == 0 else torch.empty(0, dtype=torch.float64)
    recv = torch.empty(6, dtype=torch.float64)
    bagua.scatter(full, recv, src=0)
    chk.equal(recv, val(r), "bagua scatter")
    if n >= 2:
        if r == 0:
            bagua.send(val(7), 1)
        elif r == 1:
            got = torch.empty(6, dtype=torch.float64)
            bagua.recv(got, 0)
            chk.equal(got, val(7), "bagua send/recv")
    g = bagua.new_group([0])
    t = val(r)
    bagua.allreduce_inplace(t, op=bagua.ReduceOp.SUM, comm=g)
    chk.equal(t, val(r), "bagua comm= (a group of one; others are not members)")
    bagua.barrier()


def _example_consensus(chk, topo):
    import rumor.compat.bluefog as bf

    consensus = _load("bluefog_consensus")
    x, errors = consensus.main(topo, weighted=True, iterations=60)
    native = _native_consensus(bf.topology_util.to_topology(bf.load_topology()), 60)
    chk.equal(x, native, f"bluefog_consensus {topo}: same bits as rumor.neighbor_allreduce")
    chk.check(errors[-1] < 1e-12, f"consensus {topo}: relative error {errors[-1]}")


def _example_bluefog_mnist(chk, opt):
    mnist = _load("bluefog_mnist")
    losses, params = mnist.main(opt, steps=6)
    want_losses, want_params = _native_mnist(mnist, opt, 6)
    chk.equal(params, want_params, f"bluefog_mnist {opt}: parameters")
    chk.check(losses == want_losses, f"bluefog_mnist {opt}: losses {losses} vs {want_losses}")


def _example_bagua_mnist(chk, alg):
    bagua_mnist = _load("bagua_mnist")
    losses, params = bagua_mnist.main(alg, steps=8)
    want_losses, want_params = _native_bagua(bagua_mnist, alg, 8)
    chk.equal(params, want_params, f"bagua_mnist {alg}: parameters")
    chk.check(losses == want_losses, f"bagua_mnist {alg}: losses")


def _example_synthetic_benchmark(chk):
    import torch

    import rumor

    bench = _load("bagua_synthetic_benchmark")
    rate, params = bench.main("gradient_allreduce", warmup=1, iters=2)
    chk.check(rate > 0, "benchmark rate")
    torch.manual_seed(0)
    model = bench.model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model = rumor.DistributedDataParallel(model, optimizer=optimizer, algorithm=rumor.algorithms.GradientAllReduce())
    data = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(rumor.rank()))
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(data), torch.arange(16) % 10).backward()
        optimizer.step()
    chk.equal(params, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "synthetic benchmark")


# Each example (and setting) is a scenario of its own; each initializes rumor itself.
EXAMPLE_SCENARIOS = {"bagua_primitives": _bagua_primitives}
EXAMPLE_SCENARIOS.update({f"bluefog_consensus_{t}": functools.partial(_example_consensus, topo=t)
                          for t in ("star", "mesh", "expo2")})
EXAMPLE_SCENARIOS.update({f"bluefog_mnist_{o}": functools.partial(_example_bluefog_mnist, opt=o)
                          for o in ("awc", "atc", "gradient_allreduce")})
EXAMPLE_SCENARIOS.update({f"bagua_mnist_{a}": functools.partial(_example_bagua_mnist, alg=a)
                          for a in ("gradient_allreduce", "decentralized", "bytegrad", "qadam")})
EXAMPLE_SCENARIOS["bagua_synthetic_benchmark"] = _example_synthetic_benchmark


def rank_examples(names):
    """Runs the named example scenarios in order; returns {name: (failures, count)}."""
    return harness.run_scenarios(harness.Checker(), names, EXAMPLE_SCENARIOS)


@pytest.mark.parametrize("scenario", list(EXAMPLE_SCENARIOS))
def test_example_scripts_equal_native_api(scenario, request, batches):
    """One test id per example and setting; the selected ones run in one launch of 2 ranks."""
    res = harness.batch(batches, "examples", lambda: harness.run(
        rank_examples, 2, timeout=150, args=(harness.selected(request, "scenario"),)))
    assert harness.assert_no_failures(harness.scenario_results(res, scenario), f"examples: {scenario}") > 0


# ==== with_bagua returns the module itself ========================================================

def rank_with_bagua_returns_the_module(algorithm):
    """Bagua: with_bagua "Returns: the original module". The same object comes back (its class,
    attributes and state_dict keys), its own forward hooks run once per call, and training it
    gives the same bits as rumor.DistributedDataParallel called as a wrapper (what with_bagua
    returned before), for an algorithm that only averages gradients and for one whose
    before_forward mixes the weights."""
    import torch
    import torch.nn.functional as F

    import rumor
    import rumor.compat.bagua as bagua
    from rumor.compat.bagua.algorithms import decentralized, gradient_allreduce

    class MyNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)
            self.bn = torch.nn.BatchNorm1d(16)
            self.tag = "mine"

        def forward(self, x):
            return self.fc2(torch.relu(self.bn(self.fc1(x))))

    def make():
        return {"gradient_allreduce": gradient_allreduce.GradientAllReduceAlgorithm,
                "decentralized": lambda: decentralized.DecentralizedAlgorithm(hierarchical=False,
                                                                              peer_selection_mode="shift_one"),
                }[algorithm]()

    bagua.init_process_group()
    chk = harness.Checker()
    r = bagua.get_rank()

    def train(model, call):
        opt = model_opt[id(model)]
        for t in range(4):
            g = torch.Generator().manual_seed(100 * t + r)
            x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
            opt.zero_grad()
            F.cross_entropy(call(x), y).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()] +
                         [b.detach().reshape(-1).double() for b in model.buffers()])

    model_opt = {}
    torch.manual_seed(r)  # rank-different: wrapping broadcasts rank 0's weights
    plain = MyNet()
    keys = list(plain.state_dict().keys())
    calls = []
    plain.register_forward_pre_hook(lambda m, a: calls.append(1))
    model_opt[id(plain)] = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    got = plain.with_bagua([model_opt[id(plain)]], make())
    chk.check(got is plain, "with_bagua returned another object")
    chk.check(isinstance(got, MyNet) and got.tag == "mine" and got.fc1 is plain.fc1, "class and attributes")
    chk.check(list(got.state_dict().keys()) == keys, f"state_dict keys {list(got.state_dict().keys())} vs {keys}")
    chk.check(type(got.bagua_algorithm).__module__.startswith("rumor.compat.bagua.algorithms")
              and got.bagua_module_name == "MyNet" and got.bagua_optimizers == [model_opt[id(plain)]],
              "bagua_algorithm, bagua_module_name, bagua_optimizers")
    mine = train(got, got)
    chk.check(len(calls) == 4, f"the module's forward pre-hook ran {len(calls)} times in 4 forwards")

    torch.manual_seed(r)
    ref = MyNet()
    model_opt[id(ref)] = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ddp = rumor.DistributedDataParallel(ref, optimizer=model_opt[id(ref)], algorithm=make())
    want = train(ref, ddp)
    chk.equal(mine, want, f"{algorithm}: parameters and buffers after training, with_bagua vs the wrapper")
    got.eval()
    with torch.no_grad():
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(9))
        ddp.eval()
        chk.equal(got(x), ddp(x), "evaluation forward")
    try:
        got.with_bagua([model_opt[id(plain)]], make())
        chk.check(False, "with_bagua accepted a module twice")
    except RuntimeError as e:
        chk.check("already" in str(e), str(e))

    # remove_hooks() gives the module back: its own forward, gradients of this rank's data alone
    # (a module built from the same state is the reference), and it can be wrapped again.
    got.train()
    got._rumor_ddp.remove_hooks()
    alone = MyNet()
    alone.load_state_dict(got.state_dict())
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(50 + r))
    for m in (got, alone):
        m.zero_grad()
        m(x).square().sum().backward()
    chk.equal(torch.cat([p.grad.reshape(-1) for p in got.parameters()]),
              torch.cat([p.grad.reshape(-1) for p in alone.parameters()]),
              "gradients after remove_hooks: this rank's own")
    old = got._rumor_ddp
    chk.check(got.with_bagua([model_opt[id(plain)]], make()) is got and got._rumor_ddp is not old,
              "with_bagua after remove_hooks wraps the module again")
    if algorithm == "gradient_allreduce":
        got.zero_grad()
        got(x).square().sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in got.parameters()])
        every = rumor.allgather(grads).reshape(2, -1)
        chk.equal(every[0], every[1], "gradients averaged again after the second with_bagua")
    return chk.failures, chk.count


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "decentralized"])
def test_with_bagua_returns_the_module_and_trains_the_same(algorithm):
    res = harness.run(rank_with_bagua_returns_the_module, 2, timeout=90, args=(algorithm,))
    assert harness.assert_no_failures(res, f"with_bagua, {algorithm}") > 0
