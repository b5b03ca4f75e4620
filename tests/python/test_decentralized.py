"""Decentralized training: rumor.algorithms.Decentralized / LowPrecisionDecentralized and the
BlueFog-style optimizer wrappers rumor.optim.AdaptWithCombine / AdaptThenCombine.

Ranks are spawned by harness.run and return what they trained (parameters, losses, replica
copies); this process compares against a single-process simulation of the documented update
rules (docs/decentralized_training.md), computed here in float64 on the same data:

* Decentralized, each peer selection (4 ranks; shift_one also on 3), every step and every 2nd
  step, weights copied back or re-pointed: each rank's parameters match the simulation
  (allclose, float64); "all" gives every rank the same averaged bits; bfloat16 / float16
  weights follow the rule within their precision;
* hierarchical on RUMOR_HOST_ID-emulated hosts (2 hosts x 2 ranks; and 3 hosts of 2, 1, 1);
* LowPrecisionDecentralized: a neighbour's replica of a rank equals that rank's tracked copy
  bitwise, and the parameters match a simulation that quantises with rumor's own MinMaxU8
  codec; training reaches a loss within 10% of GradientAllReduce's, as does Decentralized;
* AdaptWithCombine / AdaptThenCombine: neighbour mixing shrinks the consensus distance,
  "empty" lets replicas drift apart, "allreduce" keeps them identical, weights set per step
  are used (compared with a simulation); with "empty" a wrapper steps exactly like the plain
  optimizer (state, hyper-parameters, hooks once per step, LR scheduler);
* wrong arguments raise ValueError / TypeError.
"""
from __future__ import annotations

import pytest

import harness

LR = 0.1
D_IN, HIDDEN, CLASSES, BATCH = 8, 12, 4, 6
TOL = dict(rtol=1e-9, atol=1e-12)
# Small weight buffers, so that even the tiny model spans several of them.
SMALL = dict(bucket_cap_mb=0.0005, first_bucket_mb=0.0002)


# ==== model and data (used by the ranks and by the reference alike) ==============================

def _net(seed, dtype=None):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)).to(dtype or torch.float64)


def _xy(step, shard, dtype=None):
    import torch

    g = torch.Generator().manual_seed(7919 * step + shard)
    x = torch.randn(BATCH, D_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    return x.to(dtype or torch.float64), y


def _loss(out, y):
    import torch.nn.functional as F

    return F.cross_entropy(out, y)


def _flat_params(model):
    import torch

    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def _grad_at(flat, step, shard):
    """Loss gradient of the reference model with parameters `flat` on (step, shard)'s batch."""
    import torch

    m = _net(0)
    with torch.no_grad():
        off = 0
        for p in m.parameters():
            p.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
    x, y = _xy(step, shard)
    _loss(m(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


# ==== inside a rank ===============================================================================

def _make_alg(spec):
    import torch

    import rumor

    kind = spec["kind"]
    if kind == "decentralized":
        sel = spec["sel"]
        if isinstance(sel, list):
            sel = torch.tensor(sel, dtype=torch.float64)
        alg = rumor.algorithms.Decentralized(peer_selection=sel, communication_interval=spec.get("k", 1),
                                             hierarchical=spec.get("hier", False))
        if spec.get("swap"):  # parameters re-pointed at the mixed buffer instead of copied back
            alg._SWAP_MIN_MEAN = 0
        return alg
    if kind == "lowprec":
        return rumor.algorithms.LowPrecisionDecentralized(hierarchical=spec.get("hier", False),
                                                          communication_interval=spec.get("k", 1))
    if kind == "allreduce":
        return rumor.algorithms.GradientAllReduce()
    raise AssertionError(kind)


def rank_train(specs, steps):
    """Trains the tiny model once per spec; returns, per spec, this rank's flat parameters
    after every step (and, for the low-precision algorithm, its replica copies)."""
    import torch

    import rumor

    torch.set_num_threads(1)
    rumor.init()
    rank = rumor.rank()
    out = []
    for spec in specs:
        if spec["kind"] in ("awc", "atc"):
            out.append(_train_wrapped(spec, steps, rank))
            continue
        if spec["kind"] == "bad_args":
            out.append(_bad_args())
            continue
        dtype = getattr(torch, spec.get("dtype", "float64"))
        model = _net(100 + rank, dtype)  # rank-dependent: wrapping must broadcast rank 0's
        alg = _make_alg(spec)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=alg, **SMALL)
        traj, mixed = [], []
        for t in range(steps):
            x, y = _xy(t, rank, dtype)
            opt.zero_grad()
            _loss(ddp(x), y).backward()
            mixed.append(_flat_params(model))  # after the weight mix, before the step
            opt.step()
            traj.append(_flat_params(model))
        res = {"traj": traj, "mixed": mixed}
        if spec["kind"] == "decentralized":
            res["arena"] = alg._arena is not None
        if spec["kind"] == "lowprec":
            alg.synchronize(ddp)
            res["copies"] = [[torch.tensor(op.copy_state(w), dtype=torch.float64) for w in range(3)]
                             for op in alg.ops]
            res["sizes"] = [op.count for op in alg.ops]
        out.append(res)
    rumor.shutdown()
    return out


def _bad_args():
    """Wrapping errors that need a running job; returns the Checker's (failures, count)."""
    import torch

    import rumor

    chk = harness.Checker()
    n = rumor.size()
    for hier in (False, True):
        alg = rumor.algorithms.Decentralized(rumor.topology.RingGraph(n + 1), hierarchical=hier)
        chk.raises(ValueError, lambda: rumor.DistributedDataParallel(_net(0), algorithm=alg),
                   f"topology of {n + 1} on {n} ranks (hierarchical={hier})", match="topology")
    m = _net(0, dtype=torch.float32)
    chk.raises(ValueError, lambda: rumor.DistributedDataParallel(
        m, algorithm=rumor.algorithms.LowPrecisionDecentralized()), "low precision without optimizer",
        match="optimizer")
    m = _net(0, dtype=torch.float16)
    chk.raises(TypeError, lambda: rumor.DistributedDataParallel(
        m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), algorithm=rumor.algorithms.LowPrecisionDecentralized()),
        "low precision with float16 parameters", match="float32")
    return chk.failures, chk.count


def _train_wrapped(spec, steps, rank):
    """rumor.optim.AdaptWithCombine / AdaptThenCombine around SGD. Returns the flat parameters
    x_1..x_steps, each read when the next forward has begun (where AdaptThenCombine has applied
    the combine) and the last after synchronize()."""
    import torch

    import rumor
    from rumor.algorithms.decentralized import exp2_peers

    n = rumor.size()
    model = _net(100 + rank if spec.get("init") == "rank" else 100)
    wrap = rumor.optim.AdaptWithCombine if spec["kind"] == "awc" else rumor.optim.AdaptThenCombine
    if spec.get("topology") == "ring":
        rumor.set_topology(rumor.topology.RingGraph(n))
    if spec.get("machine_topology") == "ring":
        rumor.set_machine_topology(rumor.topology.RingGraph(rumor.machine_size()))
    opt = wrap(torch.optim.SGD(model.parameters(), lr=spec.get("lr", LR)), model, communication=spec["comm"],
               num_steps_per_communication=spec.get("k", 1))
    traj = []
    for t in range(steps):
        if spec.get("dynamic") == "exp2":
            dst, src = exp2_peers(n, rank, t)
            opt.self_weight, opt.src_weights, opt.dst_weights = 0.5, {src: 0.5}, [dst]
        x, y = _xy(t, rank)
        opt.zero_grad()
        out = model(x)
        if t > 0:
            traj.append(_flat_params(model))
        _loss(out, y).backward()
        opt.step()
    opt.synchronize()
    traj.append(_flat_params(model))
    return {"traj": traj}


# ==== the reference ===============================================================================

def _simulate_decentralized(sel, n, steps, k=1, hosts=None, atc=False):
    """Per-rank flat parameters after every step, following the documented rule: on a
    communicating step x_i <- sum_j W[j, i] x_j (over hosts' averages when hierarchical), then
    x_i <- x_i - lr * g_i(x at the start of the step)."""
    import torch

    from rumor.algorithms.decentralized import mixing_matrix

    x0 = _flat_params(_net(100))
    xs = [x0.clone() for _ in range(n)]
    if hosts is not None:
        order = list(dict.fromkeys(hosts))
        host_of = [order.index(h) for h in hosts]
    traj = [[] for _ in range(n)]
    rounds = 0
    for t in range(steps):
        gs = [_grad_at(xs[i], t, i) for i in range(n)]
        if atc:  # adapt first, then combine
            xs = [xs[i] - LR * gs[i] for i in range(n)]
            gs = [0.0 * g for g in gs]
        if t % k == 0:
            if hosts is None:
                w = mixing_matrix(sel, n, rounds)
                xs = [sum(w[j, i] * xs[j] for j in range(n)) for i in range(n)]
            else:
                m = len(order)
                avg = [torch.stack([xs[i] for i in range(n) if host_of[i] == h]).mean(0) for h in range(m)]
                w = mixing_matrix(sel, m, rounds)
                mixed = [sum(w[j, h] * avg[j] for j in range(m)) for h in range(m)]
                xs = [mixed[host_of[i]].clone() for i in range(n)]
            rounds += 1
        xs = [xs[i] - LR * gs[i] for i in range(n)]
        for i in range(n):
            traj[i].append(xs[i].clone())
    return traj


def _check_traj(chk, got, expected, what):
    for i, (g, e) in enumerate(zip(got, expected)):
        for t, (a, b) in enumerate(zip(g, e)):
            chk.close(a, b, f"{what}: rank {i} step {t}", **TOL)


# ==== tests =======================================================================================

def test_peer_schedules():
    """shift_one is a perfect matching every round (one rank out when n is odd) and meets every
    pair once per n'-1 rounds; exp2 sends to rank + 2^k and receives from rank - 2^k."""
    import torch

    from rumor.algorithms.decentralized import exp2_peers, mixing_matrix, shift_one_peer

    for n in range(1, 10):
        n_even = n + n % 2
        met = set()
        for r in range(max(1, n_even - 1)):
            partners = [shift_one_peer(n, i, r) for i in range(n)]
            for i, p in enumerate(partners):
                if p is not None:
                    assert partners[p] == i, (n, r, partners)
                    met.add((min(i, p), max(i, p)))
            assert partners.count(None) == n % 2 if n > 1 else partners == [None]
            w = mixing_matrix("shift_one", n, r)
            assert bool((w.sum(0) - 1).abs().max() < 1e-15) and bool((w - w.T).abs().max() == 0)
        assert len(met) == n * (n - 1) // 2, (n, met)
    assert [exp2_peers(8, 3, r) for r in range(4)] == [(4, 2), (5, 1), (7, 7), (4, 2)]
    assert [exp2_peers(5, 0, r) for r in range(4)] == [(1, 4), (2, 3), (4, 1), (1, 4)]
    assert exp2_peers(1, 0, 0) is None
    # ring: both neighbours every round, 1/3 each; with two ranks the one neighbour, 1/2
    for r in range(3):
        assert torch.equal(mixing_matrix("ring", 4, r), torch.tensor(RING4, dtype=torch.float64))
    assert torch.equal(mixing_matrix("ring", 2, 0), torch.full((2, 2), 0.5, dtype=torch.float64))
    assert torch.equal(mixing_matrix("ring", 1, 0), torch.ones(1, 1, dtype=torch.float64))


def test_gossip_peers_are_the_decentralized_schedules():
    """AsyncModelAverage's gossip modes put to the peers Decentralized sends to under the same
    name, round for round (its thread's own round count)."""
    from rumor.algorithms._mixers import _GossipMixer
    from rumor.algorithms.decentralized import mixing_plan

    for mode in ("ring", "shift_one", "exp2"):
        for n in range(2, 9):
            for me in range(n):
                m = _GossipMixer(mode)
                m.n, m.me = n, me
                for t in range(2 * n):
                    m.round = t
                    assert sorted(m.peers()) == sorted(mixing_plan(mode, n, me, t)[3]), (mode, n, me, t)


def test_low_precision_peer_selection():
    """LowPrecisionDecentralized runs on the ring only; the other names are refused with the
    reason (its replicas of the neighbours need the same two neighbours every round)."""
    import rumor

    L = rumor.algorithms.LowPrecisionDecentralized
    assert L().peer_selection == "ring" and L(peer_selection="ring").peer_selection == "ring"
    for mode in ("all", "shift_one", "exp2"):
        with pytest.raises(ValueError, match=f"peer_selection='{mode}' is not supported .*replicas .*'ring'"):
            L(peer_selection=mode)
    with pytest.raises(ValueError, match="unknown peer_selection"):
        L(peer_selection="rings")
    with pytest.raises(TypeError, match="peer_selection must be 'ring'"):
        L(peer_selection=RING4)


def test_bad_arguments():
    import rumor

    with pytest.raises(ValueError, match="peer_selection"):
        rumor.algorithms.Decentralized(peer_selection="ring_of_fire")
    for k in (0, -1, 1.5):
        with pytest.raises(ValueError, match="communication_interval"):
            rumor.algorithms.Decentralized(communication_interval=k)
        with pytest.raises(ValueError, match="communication_interval"):
            rumor.algorithms.LowPrecisionDecentralized(communication_interval=k)
    with pytest.raises(ValueError, match="square"):
        rumor.algorithms.Decentralized(peer_selection=[[0.5, 0.5, 0.0]])
    with pytest.raises(TypeError, match="topology"):
        rumor.algorithms.Decentralized(peer_selection=object())


RING4 = [[1 / 3, 1 / 3, 0, 1 / 3], [1 / 3, 1 / 3, 1 / 3, 0], [0, 1 / 3, 1 / 3, 1 / 3], [1 / 3, 0, 1 / 3, 1 / 3]]
# Not symmetric: rank 0 listens only to rank 3, rank 2 to ranks 0 and 1 with unequal weights.
SKEW4 = [[0.5, 0.2, 0.4, 0.0], [0.0, 0.8, 0.1, 0.0], [0.0, 0.0, 0.5, 0.5], [0.5, 0.0, 0.0, 0.5]]


def test_decentralized_matches_simulation_4_ranks():
    import torch

    steps = 4
    specs = [dict(kind="decentralized", sel=s, k=k) for s in ("all", "shift_one", "exp2", "ring") for k in (1, 2)]
    # hierarchical on one host: every round the host's average, through the shared arena
    one_host = [dict(kind="decentralized", sel=s, hier=True) for s in ("shift_one", "exp2")]
    one_host.append(dict(kind="decentralized", sel="exp2", hier=True, swap=True))
    specs += one_host
    specs += [dict(kind="decentralized", sel=RING4), dict(kind="decentralized", sel=SKEW4, k=3),
              dict(kind="decentralized", sel="exp2", swap=True), dict(kind="decentralized", sel=SKEW4, k=2, swap=True)]
    half = [dict(kind="decentralized", sel=s, dtype=d) for s in ("all", "exp2") for d in ("bfloat16", "float16")]
    res = harness.run(rank_train, 4, timeout=90, args=(specs + half, steps))
    chk = harness.Checker()
    # Half-precision weights: the same rule within their precision (simulated in float64).
    for hi, spec in enumerate(half):
        si = len(specs) + hi
        exp = _simulate_decentralized(spec["sel"], 4, 1)
        for r in range(4):
            want = exp[r][0].to(getattr(torch, spec["dtype"])).double()
            chk.close(res[r][si]["traj"][0], want, f"Decentralized({spec['sel']}) {spec['dtype']}: rank {r} step 0",
                      rtol=2e-2, atol=2e-2)
            if spec["sel"] == "all":
                chk.equal(res[r][si]["mixed"][0], res[0][si]["mixed"][0],
                          f"Decentralized(all) {spec['dtype']}: rank {r}'s averaged weights equal rank 0's")
    for si, spec in enumerate(specs):
        got = [res[r][si]["traj"] for r in range(4)]
        hier = spec.get("hier", False)
        what = (f"Decentralized({spec['sel'] if isinstance(spec['sel'], str) else 'matrix'}, k={spec.get('k', 1)}"
                f"{', hierarchical' if hier else ''}{', swap' if spec.get('swap') else ''})")
        _check_traj(chk, got, _simulate_decentralized(spec["sel"], 4, steps, spec.get("k", 1),
                                                      hosts=["h"] * 4 if hier else None), what)
        # Where every round is the host's average, the weights live in the shared arena.
        in_arena = spec["sel"] == "all" or hier
        chk.check(all(res[r][si]["arena"] == in_arena for r in range(4)),
                  f"{what}: weights {'' if in_arena else 'not '}in the shared arena on every rank")
        if spec["sel"] == "all" or hier:  # identical after every average (then each applies its own gradient)
            for r in range(1, 4):
                for t in range(0, steps, spec.get("k", 1)):
                    chk.equal(res[r][si]["mixed"][t], res[0][si]["mixed"][t],
                              f"{what}: rank {r} step {t}: averaged weights bitwise equal to rank 0's")
    harness.assert_no_failures([(chk.failures, chk.count)], "decentralized, 4 ranks")


def test_decentralized_odd_world():
    """shift_one on 3 ranks (one sits out each round)."""
    steps = 4
    chk = harness.Checker()
    specs3 = [dict(kind="decentralized", sel="shift_one"), dict(kind="decentralized", sel="shift_one", k=2),
              dict(kind="decentralized", sel="ring")]
    res = harness.run(rank_train, 3, timeout=90, args=(specs3 + [dict(kind="bad_args")], steps))
    harness.assert_no_failures([res[r][-1] for r in range(3)], "bad arguments")
    for si, spec in enumerate(specs3):
        got = [res[r][si]["traj"] for r in range(3)]
        _check_traj(chk, got, _simulate_decentralized(spec["sel"], 3, steps, spec.get("k", 1)),
                    f"{spec['sel']} on 3 ranks, k={spec.get('k', 1)}")
    harness.assert_no_failures([(chk.failures, chk.count)], "decentralized, odd world")


_SKEW2 = [[0.75, 0.5], [0.25, 0.5]]
_HALF2 = [[0.5, 0.5], [0.5, 0.5]]  # RingGraph(2) with uniform receive weights
HIER_CASES = {("hA", "hA", "hB", "hB"): [dict(kind="decentralized", sel="all", hier=True),
                                         dict(kind="decentralized", sel="shift_one", hier=True),
                                         dict(kind="decentralized", sel=_SKEW2, hier=True),
                                         dict(kind="awc", comm="hierarchical_neighbor_allreduce",
                                              machine_topology="ring", sel=_HALF2),
                                         dict(kind="atc", comm="hierarchical_neighbor_allreduce",
                                              machine_topology="ring", sel=_HALF2)],
              ("hA", "hA", "hB", "hC"): [dict(kind="decentralized", sel="shift_one", hier=True),
                                         dict(kind="decentralized", sel="exp2", hier=True)]}


@pytest.mark.parametrize("hosts", list(HIER_CASES), ids=["2x2", "2+1+1"])
def test_decentralized_hierarchical(hosts):
    """Hierarchical on hosts faked with RUMOR_HOST_ID: 2 hosts x 2 ranks and 3 hosts of 2, 1 and
    1 ranks (one launch each)."""
    steps = 4
    chk = harness.Checker()
    specs = HIER_CASES[hosts]
    res = harness.run(rank_train, 4, timeout=90, args=(specs, steps),
                      rank_env=[{"RUMOR_HOST_ID": h} for h in hosts])
    for si, spec in enumerate(specs):
        got = [res[r][si]["traj"] for r in range(4)]
        what = (f"hierarchical {spec['kind']} {spec['sel'] if isinstance(spec['sel'], str) else 'matrix'} "
                f"on hosts {hosts}")
        exp = _simulate_decentralized(spec["sel"], 4, steps, 1, hosts=list(hosts), atc=spec["kind"] == "atc")
        _check_traj(chk, got, exp, what)
        if spec["kind"] != "decentralized":
            continue
        for r in range(4):  # ranks of a host hold the same mixed weights
            peer = hosts.index(hosts[r])
            for t in range(steps):
                chk.equal(res[r][si]["mixed"][t], res[peer][si]["mixed"][t],
                          f"{what}: rank {r} step {t}: mixed weights equal to its host leader's")
    harness.assert_no_failures([(chk.failures, chk.count)], f"decentralized, hierarchical on hosts {hosts}")


def _simulate_low_precision(n, steps, sizes, k=1, hosts=None):
    """The documented low-precision rule, quantising with rumor's MinMaxU8 codec, each weight
    buffer (of `sizes` elements) on its own. Rank (or host) i's tracked copy xh_i is also what
    its neighbours' replicas of it hold."""
    import torch

    from rumor.compression import MinMaxUInt8

    codec = MinMaxUInt8()
    x0 = _flat_params(_net(100))
    xs = [x0.clone() for _ in range(n)]
    order = list(dict.fromkeys(hosts)) if hosts is not None else list(range(n))
    node_of = [order.index(h) for h in hosts] if hosts is not None else list(range(n))
    m = len(order)
    xh = [x0.clone() for _ in range(m)]
    traj = [[] for _ in range(n)]
    for t in range(steps):
        gs = [_grad_at(xs[i], t, i) for i in range(n)]
        ys = [xs[i] - LR * gs[i] for i in range(n)]
        if t % k == 0:
            ynode = [torch.stack([ys[i] for i in range(n) if node_of[i] == j]).mean(0) for j in range(m)]
            new = []
            for j in range(m):
                x = ynode[j]
                if m == 2:
                    x = x + 0.5 * (xh[1 - j] - xh[j])
                elif m > 2:
                    x = x + (1 / 3) * (xh[(j - 1) % m] + xh[(j + 1) % m] - 2 * xh[j])
                new.append(x)
            if m > 1:
                for j in range(m):
                    diffs = (new[j] - xh[j]).split(sizes)
                    for part, d in zip(xh[j].split(sizes), diffs):
                        codec.decode(codec.encode(d.contiguous()), part.shape, out=part, accumulate=True)
            xs = [new[node_of[i]].clone() for i in range(n)]
        else:
            xs = ys
        for i in range(n):
            traj[i].append(xs[i].clone())
    return traj, xh


LOWPREC_CASES = [(4, None, [dict(kind="lowprec"), dict(kind="lowprec", k=2)]),
                 (2, None, [dict(kind="lowprec")]),
                 (4, ("hA", "hA", "hB", "hB"), [dict(kind="lowprec", hier=True)])]


@pytest.mark.parametrize("n,hosts,specs", LOWPREC_CASES, ids=["4ranks", "2ranks", "2x2hosts"])
def test_low_precision_matches_simulation(n, hosts, specs):
    """Parameters follow the simulation; a neighbour's replica of a rank is that rank's tracked
    copy, bit for bit (4 ranks: 3-neighbour mixing; 2 ranks: one neighbour; 2 hosts x 2); one
    launch each."""
    import torch

    steps = 5
    chk = harness.Checker()
    rank_env = [{"RUMOR_HOST_ID": h} for h in hosts] if hosts else None
    res = harness.run(rank_train, n, timeout=90, args=(specs, steps), rank_env=rank_env)
    for si, spec in enumerate(specs):
        what = f"LowPrecisionDecentralized n={n} k={spec.get('k', 1)} hosts={hosts}"
        exp, xh = _simulate_low_precision(n, steps, res[0][si]["sizes"], spec.get("k", 1),
                                          list(hosts) if hosts else None)
        _check_traj(chk, [res[r][si]["traj"] for r in range(n)], exp, what)
        leaders = [r for r in range(n) if hosts is None or hosts.index(hosts[r]) == r]
        m = len(leaders)
        for j, r in enumerate(leaders):
            mine = torch.cat([c[0] for c in res[r][si]["copies"]])
            chk.close(mine, xh[j], f"{what}: rank {r}'s tracked copy vs simulation", **TOL)
            left = torch.cat([c[1] for c in res[leaders[(j + 1) % m]][si]["copies"]])
            chk.equal(left, mine, f"{what}: the right neighbour's replica of rank {r}")
            if m > 2:
                right = torch.cat([c[2] for c in res[leaders[(j - 1) % m]][si]["copies"]])
                chk.equal(right, mine, f"{what}: the left neighbour's replica of rank {r}")
        for r in range(n):
            if r not in leaders:
                chk.check(all(len(c[0]) == 0 for c in res[r][si]["copies"]),
                          f"{what}: non-leader rank {r} keeps no copies")
    harness.assert_no_failures([(chk.failures, chk.count)], f"low-precision decentralized n={n} hosts={hosts}")


def _consensus(xs):
    """sum_i ||x_i - mean||^2 over the ranks' flat parameters."""
    import torch

    x = torch.stack(xs)
    return float(((x - x.mean(0)) ** 2).sum())


def test_adapt_with_and_then_combine():
    """The wrappers against the simulation (static ring, dynamic one-peer exponential weights
    set every step, allreduce); consensus: neighbour mixing pulls replicas that start apart
    together, "empty" lets replicas that start equal drift apart."""
    steps = 5
    specs = [dict(kind="awc", comm="neighbor_allreduce", topology="ring"),
             dict(kind="atc", comm="neighbor_allreduce", topology="ring"),
             dict(kind="awc", comm="neighbor_allreduce", dynamic="exp2"),
             dict(kind="atc", comm="neighbor_allreduce", dynamic="exp2"),
             dict(kind="awc", comm="allreduce"),
             dict(kind="atc", comm="allreduce"),
             dict(kind="awc", comm="neighbor_allreduce", topology="ring", k=2),
             dict(kind="atc", comm="empty"),
             dict(kind="awc", comm="neighbor_allreduce", topology="ring", init="rank", lr=0.0),
             dict(kind="atc", comm="neighbor_allreduce", topology="ring", init="rank", lr=0.0),
             dict(kind="awc", comm="empty", init="rank", lr=0.0)]
    sims = [("awc", RING4, 1), ("atc", RING4, 1), ("awc", "exp2", 1), ("atc", "exp2", 1), ("awc", "all", 1),
            ("atc", "all", 1), ("awc", RING4, 2), ("atc", None, 1)]
    res = harness.run(rank_train, 4, timeout=90, args=(specs, steps))
    chk = harness.Checker()
    for si, (kind, sel, k) in enumerate(sims):
        got = [res[r][si]["traj"] for r in range(4)]
        what = f"{kind} {specs[si]['comm']} {specs[si].get('dynamic') or specs[si].get('topology') or ''} k={k}"
        if sel is None:  # "empty": every rank alone
            exp = _simulate_decentralized(torch_eye(4), 4, steps, k, atc=(kind == "atc"))
        else:
            exp = _simulate_decentralized(sel, 4, steps, k, atc=(kind == "atc"))
        _check_traj(chk, got, exp, what)
    # allreduce after the step (ATC): every rank holds the same bits
    for r in range(1, 4):
        chk.equal(res[r][5]["traj"][-1], res[0][5]["traj"][-1], f"ATC allreduce: rank {r} equals rank 0")
    # replicas that start equal drift apart without communication
    empty = [res[r][7]["traj"] for r in range(4)]
    d_empty = [_consensus([empty[r][t] for r in range(4)]) for t in range(steps)]
    chk.check(d_empty[0] > 0 and d_empty[-1] > d_empty[0], f"empty: consensus distance {d_empty} does not grow")
    # with the ring (and no gradient steps) replicas that start apart come together
    for si, name in ((8, "AWC"), (9, "ATC")):
        d = [_consensus([res[r][si]["traj"][t] for r in range(4)]) for t in range(steps)]
        chk.check(all(b < a for a, b in zip(d, d[1:])), f"{name} ring: consensus distance {d} does not shrink")
        alone = _consensus([res[r][10]["traj"][-1] for r in range(4)])
        chk.check(d[-1] < 0.25 * alone, f"{name} ring: distance {d[-1]} not well below no mixing ({alone})")
    harness.assert_no_failures([(chk.failures, chk.count)], "AdaptWithCombine / AdaptThenCombine")


def torch_eye(n):
    import torch

    return torch.eye(n, dtype=torch.float64)


def test_wrapper_bad_arguments():
    import torch

    import rumor

    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="communication"):
        rumor.optim.AdaptWithCombine(opt, m, communication="gossip")
    with pytest.raises(ValueError, match="num_steps_per_communication"):
        rumor.optim.AdaptThenCombine(opt, m, num_steps_per_communication=0)
    with pytest.raises(TypeError, match="Optimizer"):
        rumor.optim.AdaptThenCombine("sgd", m)


def _task_batch(step, shard, n=32):
    """A learnable task: the class is the arg-max of a fixed linear map of x."""
    import torch

    w = torch.Generator().manual_seed(424242)
    true_w = torch.randn(D_IN, CLASSES, generator=w)
    g = torch.Generator().manual_seed(104729 * step + shard + 1)
    x = torch.randn(n, D_IN, generator=g)
    return x, (x @ true_w).argmax(1)


def rank_losses(specs, steps, lr):
    """Trains a float32 model per spec on the learnable task; returns this rank's loss on a
    fixed evaluation set after training."""
    import torch

    import rumor

    torch.set_num_threads(1)
    rumor.init()
    rank = rumor.rank()
    xe, ye = _task_batch(10**6, 0, n=512)
    out = []
    for spec in specs:
        model = _net(7, dtype=torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=_make_alg(spec))
        for t in range(steps):
            x, y = _task_batch(t, rank)
            opt.zero_grad()
            _loss(ddp(x), y).backward()
            opt.step()
        with torch.no_grad():
            out.append(float(_loss(model(xe), ye)))
    rumor.shutdown()
    return out


def test_training_loss_close_to_allreduce():
    """After the same number of steps, the decentralized algorithms' loss (mean over ranks) is
    within 10% of GradientAllReduce's."""
    specs = [dict(kind="allreduce"), dict(kind="decentralized", sel="shift_one"),
             dict(kind="decentralized", sel="exp2"), dict(kind="lowprec")]
    res = harness.run(rank_losses, 4, timeout=90, args=(specs, 40, 0.5))
    means = [sum(res[r][i] for r in range(4)) / 4 for i in range(len(specs))]
    start = 1.4  # ~ln(4): the untrained loss; training must have made real progress
    assert means[0] < 0.6 * start, f"GradientAllReduce did not learn: {means}"
    for spec, m in zip(specs[1:], means[1:]):
        assert abs(m - means[0]) <= 0.1 * means[0], f"{spec}: loss {m} vs GradientAllReduce {means[0]} ({means})"


@pytest.mark.parametrize("kind", ["AdaptWithCombine", "AdaptThenCombine"])
def test_wrapper_is_the_optimizer_without_communication(kind):
    """With communication "empty" a wrapped optimizer steps exactly like the optimizer it wraps
    (state carried over, hyper-parameters kept, step hooks run once per step, LR schedulers
    work); no communication, so no job is needed."""
    import torch

    import rumor

    def make(p):
        return torch.optim.AdamW(p, lr=0.05, weight_decay=0.1, foreach=False)

    a, b = _net(3), _net(3)
    oa, ob = make(a.parameters()), make(b.parameters())
    for o, m in ((oa, a), (ob, b)):  # one step before wrapping: the state must carry over
        _loss(m(_xy(0, 0)[0]), _xy(0, 0)[1]).backward()
        o.step()
    wrapped = getattr(rumor.optim, kind)(ob, b, communication="empty")
    assert isinstance(wrapped, torch.optim.AdamW) and isinstance(wrapped, getattr(rumor.optim, kind))
    calls = []
    wrapped.register_step_post_hook(lambda *args: calls.append(1))
    sa, sb = (torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (oa, wrapped))
    for t in range(1, 4):
        x, y = _xy(t, 0)
        for o, m, s in ((oa, a, sa), (wrapped, b, sb)):
            o.zero_grad()
            _loss(m(x), y).backward()
            o.step()
            s.step()
    wrapped.synchronize()
    assert len(calls) == 3
    assert wrapped.param_groups[0]["weight_decay"] == 0.1 and wrapped.param_groups[0]["lr"] == oa.param_groups[0]["lr"]
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
