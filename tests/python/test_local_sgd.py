"""rumor.algorithms.LocalSGD, DiLoCo and Streaming DiLoCo.

Every multi-rank test spawns its ranks through harness.run (deadline per test; a failing rank
fails the test with its traceback); several scenarios run per spawn and every mismatch is
collected by a harness.Checker. Each scenario is a test id of its own (`-k q_int8`); the selected
scenarios of one launch share it (harness.batch).

References:
* a float64 single-process simulation of the same rule, written here (``_Sim``): every rank's
  model and inner optimizer, the gradient average of the warm-up, the parameter averages
  (global and per host), DiLoCo's outer step per fragment at its scheduled step, the delayed
  application and the alpha merge. Deterministic data per (step, rank); compared after every
  step with rtol 1e-12 (the sums of the allreduce run in another order);
* torch's own PostLocalSGD hook (post_local_gradient_allreduce=False) + PeriodicModelAverager,
  over gloo in the same processes, on the same data;
* rumor's GradientAllReduce (DiLoCo with H=1 and outer SGD(lr=1) must equal it);
* the loss of GradientAllReduce on the benchmark MLP (small version) at equal steps.
"""
from __future__ import annotations

import functools

import pytest

import harness

TOL = dict(rtol=1e-12, atol=1e-13)
LR = 0.05


# ==== inside a rank ===============================================================================

def _init(gloo=False):
    import datetime

    import torch
    import torch.distributed as dist

    import rumor

    torch.set_num_threads(1)
    rumor.init()
    if gloo:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))


def _net(seed=0, dtype=None):
    import torch

    dtype = dtype or torch.float64
    g = torch.random.get_rng_state()
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 8), torch.nn.Tanh(),
                            torch.nn.Linear(8, 3)).to(dtype)
    torch.random.set_rng_state(g)
    return m


def _data(step, rank, dtype=None):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64).to(dtype or torch.float64)
    y = torch.randint(0, 3, (5,), generator=g)
    return x, y


def _loss(model, x, y):
    import torch

    return torch.nn.functional.cross_entropy(model(x), y)


def _inner(params):
    import torch

    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _flat(module):
    import torch

    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _same_on_all_ranks(chk, t, what):
    import torch

    import rumor

    every = rumor.allgather(t.reshape(1, -1).contiguous())
    chk.check(bool((every == every[0]).all()), f"{what}: differs across ranks")


class _Sim:
    """Float64 simulation of every rank in one process: model copies, their inner optimizers,
    and the synchronization rule (the algorithm under test is not used)."""

    def __init__(self, n, make_model=_net):
        import torch

        self.n = n
        self.models = [make_model() for _ in range(n)]
        self.opts = [_inner(m.parameters()) for m in self.models]
        self.torch = torch

    def params(self, r):
        return list(self.models[r].parameters())

    def local_step(self, step, average_grads=False):
        torch = self.torch
        for r, (m, o) in enumerate(zip(self.models, self.opts)):
            o.zero_grad()
            x, y = _data(step, r)
            _loss(m, x, y).backward()
        if average_grads:
            for ps in zip(*(m.parameters() for m in self.models)):
                avg = sum(p.grad for p in ps) / self.n
                for p in ps:
                    p.grad.copy_(avg)
        for o in self.opts:
            o.step()

    def average(self, ranks):
        with self.torch.no_grad():
            for ps in zip(*(self.params(r) for r in ranks)):
                avg = sum(p for p in ps) / len(ranks)
                for p in ps:
                    p.copy_(avg)


# ---- LocalSGD against the simulation ------------------------------------------------------------

def sc_local_sgd_sim(chk, H=3, warmup=2, steps=12, hierarchical=False, cross=2, hosts=None):
    import torch

    import rumor
    from rumor.algorithms import LocalSGD

    n, me = rumor.size(), rumor.rank()
    model = _net()
    opt = _inner(model.parameters())
    algo = LocalSGD(sync_every=H, warmup_steps=warmup, hierarchical=hierarchical,
                    cross_host_every=cross if hierarchical else None)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=algo)
    sim = _Sim(n)
    tag = f"LocalSGD(H={H}, warmup={warmup}{', hierarchical' if hierarchical else ''}) n={n}"
    for s in range(steps):
        opt.zero_grad()
        x, y = _data(s, me)
        _loss(ddp, x, y).backward()
        # The warm-up's gradients travel in the buckets; local steps leave them where autograd
        # put them (no copy into a bucket nobody sends).
        in_bucket = [any(b.flat.data_ptr() <= p.grad.data_ptr() < b.flat.data_ptr() + b.flat.nbytes
                         for b in ddp.buckets) for p in model.parameters()]
        chk.check(all(in_bucket) if s < warmup else not any(in_bucket),
                  f"{tag} step {s}: gradients in the buckets {in_bucket}")
        opt.step()
        sim.local_step(s, average_grads=s < warmup)
        if s >= warmup and (s - warmup) % H == 0:
            k = (s - warmup) // H
            if hierarchical and k % cross and hosts is not None:
                for h in hosts:
                    sim.average(h)
            else:
                sim.average(range(n))
            if not (hierarchical and k % cross):
                _same_on_all_ranks(chk, _flat(model), f"{tag} after the average of step {s}")
        chk.close(_flat(model), _flat(sim.models[me]), f"{tag} step {s}", **TOL)
    chk.check(algo.steps == steps, f"{tag}: counted {algo.steps} steps")
    return ddp


def sc_local_sgd_state(chk):
    """state_dict round trip of the step counters: a fresh wrapper resumes the same sequence."""
    import rumor
    from rumor.algorithms import LocalSGD

    me = rumor.rank()

    def run(steps, start_sd=None, start_model=None, start_opt=None):
        model = _net()
        opt = _inner(model.parameters())
        algo = LocalSGD(sync_every=3, warmup_steps=1)
        ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=algo)
        if start_sd is not None:
            # after wrapping: wrapping broadcasts rank 0's weights, and between averages the
            # ranks' weights differ
            model.load_state_dict(start_model)
            opt.load_state_dict(start_opt)
            algo.load_state_dict(start_sd)
        for s in steps:
            opt.zero_grad()
            x, y = _data(s, me)
            _loss(ddp, x, y).backward()
            opt.step()
        return model, opt, algo

    import copy

    m_all, _, _ = run(range(10))
    m_a, o_a, a_a = run(range(4))
    m_b, _, a_b = run(range(4, 10), a_a.state_dict(), copy.deepcopy(m_a.state_dict()),
                      copy.deepcopy(o_a.state_dict()))
    chk.equal(_flat(m_b), _flat(m_all), "LocalSGD state_dict round trip: params after resuming")
    chk.check(a_b.steps == 10 and a_b.averages == a_a.averages + 2,
              f"LocalSGD state_dict: steps {a_b.steps}, averages {a_b.averages}")


# ---- LocalSGD against torch's PeriodicModelAverager ---------------------------------------------

def sc_local_sgd_torch(chk, H=3, warmup=2, steps=11):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pl
    from torch.distributed.algorithms.model_averaging import averagers

    import rumor
    from rumor.algorithms import LocalSGD

    me = dist.get_rank()
    model = _net()
    opt = _inner(model.parameters())
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=LocalSGD(sync_every=H, warmup_steps=warmup))
    tmodel = _net()
    tddp = torch.nn.parallel.DistributedDataParallel(tmodel)
    state = pl.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=warmup,
                                 post_local_gradient_allreduce=False)
    tddp.register_comm_hook(state, pl.post_localSGD_hook)
    topt = _inner(tmodel.parameters())
    averager = averagers.PeriodicModelAverager(period=H, warmup_steps=warmup)
    for s in range(steps):
        x, y = _data(s, me)
        for d, o in ((ddp, opt), (tddp, topt)):
            o.zero_grad()
            _loss(d, x, y).backward()
            o.step()
        averager.average_parameters(tmodel.parameters())
        chk.close(_flat(model), _flat(tmodel), f"LocalSGD vs torch PostLocalSGD+PeriodicModelAverager step {s}", **TOL)


# ---- DiLoCo against the simulation --------------------------------------------------------------

def _outer_sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def sc_diloco_sim(chk, H=3, F=1, delay=0, alpha=0.0, steps=13, outer=None, hierarchical=False):
    import torch

    import rumor
    from rumor.algorithms import DiLoCo

    n, me = rumor.size(), rumor.rank()
    model = _net()
    opt = _inner(model.parameters())
    kw = {} if outer is None else dict(outer_optimizer=outer)
    algo = DiLoCo(inner_steps=H, num_fragments=F, fragment_sync_delay=delay, fragment_update_alpha=alpha,
                  hierarchical=hierarchical, **kw)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=algo)
    tag = f"DiLoCo(H={H}, F={F}, delay={delay}, alpha={alpha}) n={n}"

    # The fragments: the test's rule is F equal element ranges of the flattened model (one
    # dtype here, so one buffer), in definition order.
    total = sum(p.numel() for p in model.parameters())
    ranges = [(total * p // F, total * (p + 1) // F) for p in range(F)]
    chk.check([f.ranges for f in algo.fragments] == [[(0, a, e)] for a, e in ranges],
              f"{tag}: fragments {[f.ranges for f in algo.fragments]} != {ranges}")
    offsets = [p * H // F for p in range(F)]
    chk.check([f.offset for f in algo.fragments] == offsets, f"{tag}: offsets {[f.offset for f in algo.fragments]}")

    sim = _Sim(n)
    pending = {}  # fragment -> (apply at, averaged pseudo-gradient)
    expected_log = []

    def frag(r, p):  # rank r's elements of fragment p (a copy)
        a, e = ranges[p]
        return _flat(sim.models[r])[a:e].clone()

    def set_frag(r, p, v):
        a, e = ranges[p]
        flat = _flat(sim.models[r])
        flat[a:e] = v
        torch.nn.utils.vector_to_parameters(flat, sim.models[r].parameters())

    outer_params = [frag(0, p) for p in range(F)]  # one tensor per fragment, as the algorithm's
    outer_opt = (outer or _outer_sgd)(outer_params)

    def apply(p):
        _, grad = pending.pop(p)
        o = outer_params[p]
        o.grad = grad
        outer_opt.step()
        o.grad = None
        with torch.no_grad():
            for r in range(n):
                set_frag(r, p, alpha * frag(r, p) + (1 - alpha) * o if alpha else o)

    for s in range(steps):
        opt.zero_grad()
        x, y = _data(s, me)
        _loss(ddp, x, y).backward()
        opt.step()
        sim.local_step(s)
        t = s + 1
        for p in range(F):
            if p in pending and pending[p][0] == t:
                apply(p)
                expected_log.append(("apply", t, p))
        for p in range(F):
            if t % H == offsets[p]:
                grad = sum(outer_params[p] - frag(r, p) for r in range(n)) / n
                pending[p] = (t + delay, grad.detach())
                expected_log.append(("send", t, p))
                if delay == 0:
                    apply(p)
                    expected_log.append(("apply", t, p))
        chk.close(_flat(model), _flat(sim.models[me]), f"{tag} step {s}", **TOL)
    chk.check(list(algo.log) == expected_log, f"{tag}: schedule {algo.log} != expected {expected_log}")
    outer_now = torch.cat([s_.outer.detach().reshape(-1) for f in algo.fragments for s_ in f.slots])
    want = torch.cat([o.detach().reshape(-1) for o in outer_params])
    chk.close(outer_now, want, f"{tag}: outer parameters", **TOL)
    _same_on_all_ranks(chk, outer_now, f"{tag}: outer parameters")
    return ddp, algo


def sc_diloco_h1_is_allreduce(chk, steps=6):
    """H=1, outer SGD(lr=1, no momentum): x <- outer - mean(outer - x_i) = mean(x_i), i.e. the
    average of one local SGD step each: GradientAllReduce with the same inner SGD."""
    import torch

    import rumor
    from rumor.algorithms import DiLoCo, GradientAllReduce

    me = rumor.rank()
    outer = functools.partial(torch.optim.SGD, lr=1.0, momentum=0.0)
    a, b = _net(), _net()
    oa = torch.optim.SGD(a.parameters(), lr=LR)
    ob = torch.optim.SGD(b.parameters(), lr=LR)
    da = rumor.DistributedDataParallel(a, optimizer=oa, algorithm=DiLoCo(inner_steps=1, outer_optimizer=outer))
    db = rumor.DistributedDataParallel(b, optimizer=ob, algorithm=GradientAllReduce())
    for s in range(steps):
        x, y = _data(s, me)
        for d, o in ((da, oa), (db, ob)):
            o.zero_grad()
            _loss(d, x, y).backward()
            o.step()
        chk.close(_flat(a), _flat(b), f"DiLoCo(H=1, outer SGD lr=1) vs GradientAllReduce step {s}", **TOL)


def sc_diloco_state(chk, quantization=None):
    """Checkpoint in the middle of a streaming round with an average in flight: a fresh wrapper
    loaded from (model, inner optimizer, algorithm) state dicts continues bit for bit."""
    import copy

    import rumor
    from rumor.algorithms import DiLoCo

    me = rumor.rank()

    def run(steps, start=None):
        model = _net()
        opt = _inner(model.parameters())
        algo = DiLoCo(inner_steps=4, num_fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5,
                      quantization=quantization)
        ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=algo)
        if start is not None:
            model.load_state_dict(start[0])
            opt.load_state_dict(start[1])
            algo.load_state_dict(start[2])
        for s in steps:
            opt.zero_grad()
            x, y = _data(s, me)
            _loss(ddp, x, y).backward()
            opt.step()
        return model, opt, algo

    m_all, _, a_all = run(range(11))
    # after step 5 (t=6): fragment 1 (offset 2) was sent at t=6 and applies at t=7
    m_a, o_a, a_a = run(range(6))
    sd = copy.deepcopy(a_a.state_dict())
    chk.check(sd["pending"][1] is not None and sd["pending"][1][0] == 7, f"state_dict pending: {sd['pending']}")
    m_b, _, a_b = run(range(6, 11), (copy.deepcopy(m_a.state_dict()), copy.deepcopy(o_a.state_dict()), sd))
    what = f"DiLoCo state_dict round trip (quantization={quantization})"
    chk.equal(_flat(m_b), _flat(m_all), f"{what}: params")
    chk.equal(a_b.state_dict()["outer"][0][0], a_all.state_dict()["outer"][0][0], f"{what}: outer params")
    chk.check(a_b.steps == 11, f"{what}: steps {a_b.steps}")


def sc_quantized(chk, quantization, rel, hierarchical=False):
    """Quantized pseudo-gradients: all ranks hold the same bits after each application; the
    outer parameters stay within the codec's error of the full-precision rule; bytes counted."""
    import torch

    import rumor
    from rumor.algorithms import DiLoCo

    n, me = rumor.size(), rumor.rank()
    models, algos, opts = [], [], []
    for q in (None, quantization):
        m = _net()
        o = _inner(m.parameters())
        a = DiLoCo(inner_steps=2, num_fragments=2, fragment_sync_delay=0, quantization=q,
                   hierarchical=hierarchical and q is not None)
        d = rumor.DistributedDataParallel(m, optimizer=o, algorithm=a)
        models.append((d, m))
        opts.append(o)
        algos.append(a)
    for s in range(4):
        x, y = _data(s, me)
        for (d, m), o in zip(models, opts):
            o.zero_grad()
            _loss(d, x, y).backward()
            o.step()
    full = torch.cat([s_.outer.detach().reshape(-1) for f in algos[0].fragments for s_ in f.slots])
    start = _flat(_net())
    q = torch.cat([s_.outer.detach().reshape(-1) for f in algos[1].fragments for s_ in f.slots])
    _same_on_all_ranks(chk, q, f"DiLoCo quantization={quantization}: outer params")
    # fragment 0 (offset 0) was applied after the last step: its parameters are the outer ones
    x0 = torch.cat([s_.x.reshape(-1) for s_ in algos[1].fragments[0].slots])
    _same_on_all_ranks(chk, x0, f"DiLoCo quantization={quantization}: fragment 0 after its sync")
    chk.equal(x0, torch.cat([s_.outer.detach().reshape(-1) for s_ in algos[1].fragments[0].slots]),
              f"DiLoCo quantization={quantization}: fragment 0 = its outer parameters")
    err = float((q - full).norm() / (full - start).norm())
    chk.check(err < rel, f"DiLoCo quantization={quantization}: relative error of the outer update {err:.3g} >= {rel}")
    chk.check(err > 0, f"DiLoCo quantization={quantization}: nothing was quantized")
    # Two rounds of both fragments: 4 sends over n ranks.
    numel = full.numel()
    chk.check(algos[1].wire_bytes < algos[0].wire_bytes,
              f"quantization={quantization}: {algos[1].wire_bytes} wire bytes, full precision {algos[0].wire_bytes}")
    chk.check(abs(algos[0].wire_bytes - 2 * 2 * (n - 1) / n * numel * 8) < 1e-6 * numel,
              f"full precision wire bytes {algos[0].wire_bytes} for {numel} float64 elements, 2 rounds")
    return err


# ---- the training comparison --------------------------------------------------------------------

def _teacher_data(model, step, rank, batch=16):
    """Inputs and the labels a fixed random teacher gives them: a task that can be learnt."""
    import torch

    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(batch, model.d_in, generator=g)
    w = torch.Generator().manual_seed(12345)
    teacher = torch.randn(model.d_in, 8, generator=w)  # 8 of the model's classes are used
    return x, (x @ teacher).argmax(1)


def train_rank(kind, steps):
    """Trains the benchmark MLP (small version) with one algorithm; returns the mean loss of the
    final (synchronized) model over a held-out set, and the training losses."""
    import torch

    import rumor
    from rumor.algorithms import DiLoCo, GradientAllReduce, LocalSGD, StreamingDiLoCo
    from rumor.testing import models

    _init()
    me = rumor.rank()
    model = models.build("mlp25m", seed=0, scale=1 / 32)
    # DiLoCo's setting: AdamW inside, Nesterov SGD outside; every variant uses the same inner one
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    algo = {"allreduce": lambda: GradientAllReduce(), "localsgd": lambda: LocalSGD(sync_every=4),
            # 24 rounds only: the paper's outer momentum 0.9 (tuned for H in the hundreds) overshoots
            # here (held-out loss 2.96 at the end); 0.5 does not
            "diloco": lambda: DiLoCo(inner_steps=8, outer_optimizer=functools.partial(
                torch.optim.SGD, lr=0.7, momentum=0.5, nesterov=True)),
            "streaming": lambda: StreamingDiLoCo(inner_steps=8, num_fragments=2, fragment_sync_delay=1,
                                                 quantization="int8")}[kind]()
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=algo)
    for s in range(steps):
        x, y = _teacher_data(model, s, me)
        opt.zero_grad()
        loss = models.loss(ddp(x), y)
        loss.backward()
        opt.step()
    if hasattr(algo, "wait"):
        algo.wait()
    with torch.no_grad():
        # every rank's model; ranks are equal after a sync, averaged for the local methods
        flat = torch.cat([p.reshape(-1) for p in model.parameters()])
        flat = rumor.allreduce(flat)
        off = 0
        for p in model.parameters():
            p.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        held = [_teacher_data(model, 10_000 + i, 99, batch=64) for i in range(4)]
        return sum(float(models.loss(model(x), y)) for x, y in held) / len(held)


def scenarios_rank(names, gloo=False):
    """Runs the named scenarios in order; returns {name: (failures, count)}."""
    _init(gloo)
    chk = harness.Checker()
    out = harness.run_scenarios(chk, names, SCENARIOS)
    import rumor

    rumor.barrier()
    return out


SCENARIOS = {
    "local": lambda chk: sc_local_sgd_sim(chk),
    "local_h1_nowarmup": lambda chk: sc_local_sgd_sim(chk, H=1, warmup=0, steps=5),
    "local_h4": lambda chk: sc_local_sgd_sim(chk, H=4, warmup=0, steps=10),
    "local_state": sc_local_sgd_state,
    "local_torch": lambda chk: sc_local_sgd_torch(chk),
    "local_torch_nowarmup": lambda chk: sc_local_sgd_torch(chk, H=4, warmup=0, steps=9),
    "diloco": lambda chk: sc_diloco_sim(chk),
    "diloco_h1": sc_diloco_h1_is_allreduce,
    "diloco_adam_outer": lambda chk: sc_diloco_sim(
        chk, H=2, steps=7, outer=functools.partial(__import__("torch").optim.Adam, lr=0.01)),
    "streaming": lambda chk: sc_diloco_sim(chk, H=4, F=2, delay=1, alpha=0.0, steps=13),
    "streaming3_alpha": lambda chk: sc_diloco_sim(chk, H=6, F=3, delay=2, alpha=0.5, steps=16),
    "streaming_nodelay": lambda chk: sc_diloco_sim(chk, H=4, F=4, delay=0, steps=9),
    "diloco_state": sc_diloco_state,
    "diloco_state_int8": lambda chk: sc_diloco_state(chk, "int8"),
    "q_fp16": lambda chk: sc_quantized(chk, "fp16", 2e-3),
    "q_bf16": lambda chk: sc_quantized(chk, "bf16", 2e-2),
    "q_int8": lambda chk: sc_quantized(chk, "int8", 2e-2),
    "q_4bit": lambda chk: sc_quantized(chk, "4bit", 0.5),
}


# ==== the tests ===================================================================================

SIM = ["local", "local_h1_nowarmup", "local_h4", "local_state", "diloco", "diloco_h1", "diloco_adam_outer",
       "streaming", "streaming3_alpha", "streaming_nodelay", "diloco_state", "diloco_state_int8",
       "q_fp16", "q_bf16", "q_int8", "q_4bit"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scenario", SIM)
def test_against_simulation(world, scenario, request, batches):
    """LocalSGD, DiLoCo and Streaming DiLoCo (delays, alpha, quantization) against the float64
    simulation of the rule, every step; state_dict round trips. The selected scenarios of one
    world size run in one launch."""
    def launch():
        names = harness.selected(request, "scenario")
        res = harness.run(scenarios_rank, world, timeout=150, args=(names,))
        if set(names) >= set(SIM):  # the whole batch: it checked a lot
            assert sum(c for r in res for _, c in r.values()) > 100
        return res

    res = harness.batch(batches, ("simulation", world), launch)
    n = harness.assert_no_failures(harness.scenario_results(res, scenario),
                                   f"local SGD / DiLoCo on {world} ranks: {scenario}")
    assert n > 0


@pytest.mark.parametrize("scenario", ["local_torch", "local_torch_nowarmup"])
def test_local_sgd_matches_torch_post_local_sgd(scenario, request, batches):
    res = harness.batch(batches, "torch", lambda: harness.run(
        scenarios_rank, 2, timeout=120, args=(harness.selected(request, "scenario"), True)))
    harness.assert_no_failures(harness.scenario_results(res, scenario),
                               f"LocalSGD vs torch PeriodicModelAverager: {scenario}")


def hier_rank(H, warmup, cross, hosts):
    _init()
    chk = harness.Checker()
    ddp = sc_local_sgd_sim(chk, H=H, warmup=warmup, steps=13, hierarchical=True, cross=cross, hosts=hosts)
    algo = ddp.algorithm
    chk.check(algo.global_averages == 2 and algo.averages == 6,
              f"hierarchical: {algo.averages} averages, {algo.global_averages} global")
    # DiLoCo averaging inside each host, then between the hosts (full precision, then int8)
    sc_diloco_sim(chk, H=4, F=2, delay=1, alpha=0.5, steps=9, hierarchical=True)
    sc_quantized(chk, "int8", 2e-2, hierarchical=True)
    import rumor

    rumor.barrier()
    return chk.failures, chk.count


def test_local_sgd_hierarchical_two_hosts():
    """2 hosts x 2 ranks (RUMOR_HOST_ID): within-host averages every H steps, global every 3rd;
    and DiLoCo with int8 pseudo-gradients between the hosts only (hierarchical=True)."""
    hosts = [[0, 1], [2, 3]]
    rank_env = [{"RUMOR_HOST_ID": h} for h in ("hA", "hA", "hB", "hB")]
    res = harness.run(hier_rank, 4, timeout=120, rank_env=rank_env, args=(2, 1, 3, hosts))
    harness.assert_no_failures(res, "hierarchical LocalSGD, 2 hosts x 2 ranks")


def test_training_within_10_percent_of_allreduce():
    """The benchmark MLP (1/32 scale), 2 ranks, 192 steps of AdamW on a learnable task: the
    held-out loss of LocalSGD(H=4), DiLoCo(H=8, outer Nesterov momentum 0.5) and
    StreamingDiLoCo(H=8, 2 fragments, delay 1, int8, default outer) is within 10% of
    GradientAllReduce's at equal steps, and all of them learn (loss well below the start)."""
    steps = 192
    losses = {}
    for kind in ("allreduce", "localsgd", "diloco", "streaming"):
        res = harness.run(train_rank, 2, timeout=90, args=(kind, steps))
        vals = list(res)
        assert vals[0] == vals[1], f"{kind}: ranks disagree on the held-out loss {vals}"
        losses[kind] = vals[0]
    start = harness.run(train_rank, 1, timeout=60, args=("allreduce", 0))[0]
    print(f"held-out loss after {steps} steps: {losses} (start {start:.4f})")
    assert losses["allreduce"] < 0.2 * start, f"GradientAllReduce did not learn: {losses}, start {start}"
    for kind in ("localsgd", "diloco", "streaming"):
        assert losses[kind] <= 1.1 * losses["allreduce"], f"{kind}: {losses} (start {start})"


def errors_rank():
    import torch

    import rumor
    from rumor.algorithms import DiLoCo, LocalSGD

    _init()
    chk = harness.Checker()
    m = _net()
    chk.raises(ValueError, lambda: rumor.DistributedDataParallel(m, algorithm=LocalSGD()),
               "LocalSGD without the optimizer", match="optimizer")
    chk.raises(ValueError, lambda: rumor.DistributedDataParallel(_net(), algorithm=DiLoCo()),
               "DiLoCo without the optimizer", match="optimizer")
    tiny = torch.nn.Linear(2, 1)  # 3 elements
    chk.raises(ValueError, lambda: rumor.DistributedDataParallel(
        tiny, optimizer=_inner(tiny.parameters()), algorithm=DiLoCo(inner_steps=8, num_fragments=4)),
        "more fragments than elements", match="num_fragments")
    bad_outer = DiLoCo(outer_optimizer=lambda ps: "not an optimizer")
    m2 = _net()
    chk.raises(TypeError, lambda: rumor.DistributedDataParallel(m2, optimizer=_inner(m2.parameters()),
                                                                algorithm=bad_outer),
               "outer_optimizer returning no optimizer", match="outer_optimizer")
    m3 = _net()
    a = DiLoCo(inner_steps=4)
    rumor.DistributedDataParallel(m3, optimizer=_inner(m3.parameters()), algorithm=a)
    sd = a.state_dict()
    chk.raises(ValueError, lambda: DiLoCo_loaded(rumor, DiLoCo(inner_steps=5), sd), "load with another H",
               match="inner_steps")
    del torch
    return chk.failures, chk.count


def DiLoCo_loaded(rumor, algo, sd):
    m = _net()
    rumor.DistributedDataParallel(m, optimizer=_inner(m.parameters()), algorithm=algo)
    algo.load_state_dict(sd)


def test_bad_arguments():
    from rumor.algorithms import DiLoCo, LocalSGD, StreamingDiLoCo

    for kw in (dict(sync_every=0), dict(warmup_steps=-1), dict(cross_host_every=2),
               dict(hierarchical=True, cross_host_every=0)):
        with pytest.raises(ValueError):
            LocalSGD(**kw)
    for kw in (dict(sync_every=2.5), dict(sync_every=True), dict(hierarchical=1)):
        with pytest.raises(TypeError):
            LocalSGD(**kw)
    for kw in (dict(inner_steps=0), dict(num_fragments=0), dict(inner_steps=4, num_fragments=5),
               dict(inner_steps=4, fragment_sync_delay=4), dict(fragment_sync_delay=-1),
               dict(fragment_update_alpha=1.5), dict(fragment_update_alpha=float("nan")),
               dict(quantization="int3"), dict(quantization="INT8")):
        with pytest.raises(ValueError):
            DiLoCo(**kw)
    for kw in (dict(outer_optimizer=3), dict(inner_steps="8"), dict(fragment_update_alpha="0.5")):
        with pytest.raises(TypeError):
            DiLoCo(**kw)
    with pytest.raises(ValueError):
        StreamingDiLoCo(inner_steps=2, num_fragments=4)
    s = StreamingDiLoCo(inner_steps=32)
    assert (s.num_fragments, s.fragment_sync_delay, s.quantization) == (4, 4, "int8")
    res = harness.run(errors_rank, 1, timeout=60)
    harness.assert_no_failures(res, "errors after wrapping")


def test_split_fragments():
    from rumor.algorithms.local_sgd import split_fragments

    # one buffer: equal element ranges, the remainder spread one element at a time
    assert split_fragments([40], 4) == [[(0, 0, 10)], [(0, 10, 20)], [(0, 20, 30)], [(0, 30, 40)]]
    assert split_fragments([10], 3) == [[(0, 0, 3)], [(0, 3, 6)], [(0, 6, 10)]]
    # the mlp25m case that whole parameters could not split evenly (4.2M, 16.8M, 4k, 4.2M
    # elements): each fragment now holds a quarter of the elements
    sizes = sum([4096 * 1024, 4096 * 4096, 4096, 1024 * 4096])
    fr = split_fragments([sizes], 4)
    assert [e - a for (_, a, e), in fr] == [sizes // 4] * 4
    # several dtype buffers: each is cut the same way; a buffer shorter than n leaves some
    # fragments without a range of it
    assert split_fragments([6, 2], 3) == [[(0, 0, 2)], [(0, 2, 4), (1, 0, 1)], [(0, 4, 6), (1, 1, 2)]]
    # ranges cover every element once
    for lengths, n in (([7, 3, 11], 3), ([1000003], 7), ([5, 5], 5)):
        got = split_fragments(lengths, n)
        for b, L in enumerate(lengths):
            cover = sorted((a, e) for f in got for bb, a, e in f if bb == b)
            assert cover[0][0] == 0 and cover[-1][1] == L and all(x[1] == y[0] for x, y in zip(cover, cover[1:]))
    with pytest.raises(ValueError, match="num_fragments"):
        split_fragments([3, 1], 4)
    with pytest.raises(ValueError, match="num_fragments"):
        split_fragments([], 1)
