"""Live membership (rumor-run --live) beyond GradientAllReduce: the compressed allreduces
(LowPrecision, QSGD), PowerSGD, 1-bit Adam, LocalSGD, DiLoCo, Streaming DiLoCo, Decentralized
(exp2), LowPrecisionDecentralized and AsyncModelAverage. Three workers on one host; r1 is SIGKILLed in the middle of training,
the two others go on, and a newcomer is admitted. Every launcher run has a deadline
(harness.launch).

LocalSGD and DiLoCo go by rounds and the decentralized replicas differ: their tests below say
what they check. The step-wise algorithms (r1 killed before its step 3, the newcomer admitted by step
6) check what test_live.py checks of GradientAllReduce: the survivors' pids never change,
every step is applied once, the membership timeline is 3, 2 from the fault, 3 from the admission,
and the members' final parameters are bitwise equal. Then each algorithm's own rule
(docs/elastic.md, "Live membership", the table):

* LowPrecision (float16 on the wire, round to nearest): the float64 run of the timeline, within
  float16's rounding;
* QSGD (stochastic levels): the float64 run of the timeline within the quantization's spread,
  and further from the run where all three always trained than from it;
* PowerSGD (rank 1, compression from step 2, error feedback): a float64 PowerSGD of the timeline,
  whose error feedback restarts from zero at each change and whose warm-started Q goes on, to
  float32 rounding;
* 1-bit Adam (freeze step 2; on one host hierarchical averages the momenta at full precision):
  a float64 Adam that freezes its variance at step 2 and then averages the preconditioned momenta
  of the timeline's ranks, to float32 rounding. The given-up steps run the momentum update inside
  backward, so this fails unless each is undone. Without hierarchical (1-bit on the wire, error
  feedback): the members agree bitwise.
"""
from __future__ import annotations

import math
import re
import sys
import textwrap

import pytest
import torch

import harness
import live_runs
from test_live import _simulate
from test_powersgd import _Reference

DEADLINE_S = 120
STEPS, GROW, FAULT, FREEZE = 10, 6, 3, 2
# Rounds of 3 steps. LocalSGD averages after steps 0, 3, 6, 9 (torch's PeriodicModelAverager):
# r1 dies inside the round of steps 4-6, the newcomer is admitted at the round that starts at
# step 7. DiLoCo takes its outer step after steps 2, 5, 8: r1 dies inside the round of steps
# 3-5, the newcomer is admitted at step 6. (kind, steps, round ends, fault, its round's start, grow)
EVERY = 3
ROUNDS = {"LocalSGD": (10, [0, 3, 6, 9], 5, 4, 7), "DiLoCo": (9, [2, 5, 8], 4, 3, 6)}

WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import torch
    import rumor
    from rumor.parallel import DistributedDataParallel

    kind, victim, fault_step, grow_step, total, out = sys.argv[1:7]
    fault_step, grow_step, total = int(fault_step), int(grow_step), int(total)
    me, pid = os.environ["RUMOR_LIVE_ID"], os.getpid()
    rumor.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    A = rumor.algorithms
    if kind.startswith("OneBitAdam"):
        opt = rumor.optim.OneBitAdamOptimizer(model.parameters(), lr=0.01, freeze_step=%(freeze)d)
        alg = A.OneBitAdamAlgorithm(opt, hierarchical=kind == "OneBitAdam-hierarchical")
        ddp = DistributedDataParallel(model, optimizer=opt, algorithm=alg)
    elif kind == "Decentralized":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = DistributedDataParallel(model, algorithm=A.Decentralized(peer_selection="exp2", hierarchical=False))
    elif kind == "LowPrecisionDecentralized":  # float64: the simulation quantizes the same values
        model.double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = DistributedDataParallel(model, optimizer=opt, algorithm=A.LowPrecisionDecentralized(hierarchical=False))
    elif kind.startswith("AsyncModelAverage"):
        # -all, -ring: no round of its own (an hour apart), so the replicas meet only at the
        # changes and in finish(); -rounds: rounds every 20 ms.
        sel = "ring" if kind.endswith("ring") else "all"
        alg = A.AsyncModelAverage(peer_selection=sel, warmup_steps=%(freeze)d,
                                  sync_interval_ms=20 if kind.endswith("rounds") else 3_600_000)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = DistributedDataParallel(model, optimizer=opt, algorithm=alg)
    elif kind.startswith("StreamingDiLoCo"):
        # fragments 0 and 1 send after inner steps 4k and 4k + 2; -delay: each average is applied
        # one inner step later, keeping half of the local progress made meanwhile
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        delay = kind.endswith("delay")
        alg = A.DiLoCo(inner_steps=4, num_fragments=2, fragment_sync_delay=int(delay),
                       fragment_update_alpha=0.5 if delay else 0.0)
        ddp = DistributedDataParallel(model, optimizer=opt, algorithm=alg)
    elif kind in ("LocalSGD", "DiLoCo"):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        alg = A.LocalSGD(sync_every=%(every)d) if kind == "LocalSGD" else A.DiLoCo(inner_steps=%(every)d)
        ddp = DistributedDataParallel(model, optimizer=opt, algorithm=alg)
    else:
        alg = {"LowPrecision": lambda: A.LowPrecision(hierarchical=False),
               "QSGD": lambda: A.QSGD(levels=256, hierarchical=False),
               "PowerSGD": lambda: A.PowerSGD(matrix_approximation_rank=1, start_powerSGD_iter=%(freeze)d)}[kind]()
        ddp = DistributedDataParallel(model, algorithm=alg)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = rumor.elastic.State(ddp, opt)
    log = open(os.path.join(out, f"{me}.log"), "a")
    changes = []
    rumor.elastic.on_change(lambda c: changes.append([c.epoch, c.size, c.left, c.joined]))


    @rumor.elastic.run
    def train(state):
        while state.step < total:
            if kind.startswith("StreamingDiLoCo") and state.step == fault_step and not changes:
                # Every member has applied the steps before the fault (the inner steps do not
                # wait for each other), so each survivor gives up the same step.
                rumor.barrier()
            if me == victim and state.step == fault_step and kind.endswith("-average"):
                # The others enter this step's average and wait in it; the victim dies inside
                # its own, so that the survivors learn of it from the average that fails.
                time.sleep(1.0)
                os.environ["RUMOR_TEST_DIE_AT"] = "diloco:average"
            elif me == victim and state.step == fault_step:
                os.kill(pid, signal.SIGKILL)
            quiet = kind.startswith("StreamingDiLoCo") or kind.startswith("AsyncModelAverage")
            if quiet and state.step == fault_step and not changes and not kind.endswith("-average"):
                # The members train alone and would run on past the fault: the survivors wait
                # here until the watcher has seen it, so that both give up this step.
                from rumor import _live
                deadline = time.monotonic() + 30
                while _live.current().trouble is None:
                    assert time.monotonic() < deadline, "the fault was not seen within 30 s"
                    time.sleep(0.005)
            if state.step == grow_step:
                rumor.elastic.wait_for_members(3, timeout=60)
            g = torch.Generator().manual_seed(1000 * state.step + rumor.rank())
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)
            if kind == "LowPrecisionDecentralized":
                x, y = x.double(), y.double()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            log.write(json.dumps({"step": state.step, "size": rumor.size(), "rank": rumor.rank(), "pid": pid}) + "\\n")
            log.flush()
            state.step += 1
        if kind.startswith("AsyncModelAverage"):
            alg.finish(timeout=60)


    train(state)
    with open(os.path.join(out, f"{me}.final.json"), "w") as f:
        json.dump({"pid": pid, "changes": changes, "rounds": getattr(ddp.algorithm, "rounds", None),
                   "params": [p.detach().double().flatten().tolist() for p in model.parameters()]}, f)
    """
) % {"freeze": FREEZE, "every": EVERY}


def _run(tmp_path, kind, fault=FAULT, grow=GROW, steps=STEPS):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "rumor.run", "--live", "--nproc-per-node", "3", "--max-restarts", "1",
           "--live-min", "2", str(script), kind, "r1", str(fault), str(grow), str(steps), str(tmp_path)]
    return harness.launch(cmd, tmp_path, env_extra={"RUMOR_TIMEOUT": "60"}, deadline_s=DEADLINE_S)


def _timeline(tmp_path, text):
    """Checks the run's membership and returns (the world size of every step, the members' final
    parameters, bitwise equal across members)."""
    survivors = ["r0", "r2"]
    logs, finals = live_runs.load_and_check(tmp_path, text, survivors + ["j1"], survivors, STEPS)
    for m in survivors:
        assert [(c[1], c[2], c[3]) for c in finals[m]["changes"]] == [(2, ["r1"], []), (3, [], ["j1"])], finals[m]
    sizes = [e["size"] for e in logs["r0"]]
    for m, entries in logs.items():
        assert all(sizes[e["step"]] == e["size"] for e in entries), (m, entries)
    first = logs["j1"][0]["step"]
    assert [e["step"] for e in logs["j1"]] == list(range(first, STEPS))
    assert sizes == [3] * FAULT + [2] * (first - FAULT) + [3] * (STEPS - first) and FAULT < first <= GROW, sizes
    ref = finals["r0"]["params"]
    for m, f in finals.items():
        assert f["params"] == ref, f"{m} differs from r0"
    return sizes, [torch.tensor(p, dtype=torch.float64) for p in ref]


def _model64():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()


def _grads(model, step, n):
    """name -> gradient of each of the ranks 0..n-1 at this step (float64)."""
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(1000 * step + r)
        x, y = torch.randn(6, 8, generator=g).double(), torch.randn(6, 1, generator=g).double()
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        out.append({name: p.grad.clone() for name, p in model.named_parameters()})
    return out


def _simulate_powersgd(sizes):
    """SGD with momentum on PowerSGD's average (test_powersgd's float64 reference), the world
    following the timeline; at each change the error feedback restarts from zero."""
    model = _model64()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = _Reference(sizes[0], rank=1, start=FREEZE)
    bucket = [[(name, tuple(p.shape)) for name, p in model.named_parameters()]]
    for step, n in enumerate(sizes):
        if n != ref.world:
            ref.world, ref.err = n, [dict() for _ in range(n)]
        avg = ref.step(bucket, _grads(model, step, n))
        for name, p in model.named_parameters():
            p.grad = avg[name].reshape(p.shape)
        opt.step()
    return [p.detach().flatten() for p in model.parameters()]


def _simulate_onebit_adam(sizes, lr=0.01, betas=(0.9, 0.999), eps=1e-8):
    """Adam on the averaged gradients up to the freeze step; then the variance stays, and the
    preconditioned momentum u = beta1 u + (1 - beta1) avg(g) / denom drives p -= lr u / (1 - beta1^t)."""
    model = _model64()
    params = dict(model.named_parameters())
    m = {k: torch.zeros_like(p) for k, p in params.items()}
    v = {k: torch.zeros_like(p) for k, p in params.items()}
    b1, b2 = betas
    for step, n in enumerate(sizes):
        grads = _grads(model, step, n)
        t = step + 1
        with torch.no_grad():
            for k, p in params.items():
                g = sum(gr[k] for gr in grads) / n
                if t <= FREEZE:
                    m[k].lerp_(g, 1 - b1)
                    v[k].mul_(b2).addcmul_(g, g, value=1 - b2)
                    denom = (v[k].sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
                    p.addcdiv_(m[k], denom, value=-lr / (1 - b1 ** t))
                    if t == FREEZE:
                        m[k].div_(denom)
                    continue
                inv = 1 / ((v[k].sqrt() / math.sqrt(1 - b2 ** FREEZE)) + eps)
                m[k].mul_(b1).add_(g * inv, alpha=1 - b1)
                p.add_(m[k], alpha=-lr / (1 - b1 ** t))
    return [p.detach().flatten() for p in model.parameters()]


def _close(got, want, rtol, atol):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


def _far(got, want, rtol, atol):
    return any(not torch.allclose(g, w, rtol=rtol, atol=atol) for g, w in zip(got, want))


# ~10 s each on an idle 2-core machine (40-50 s when it is loaded). The compressed allreduces
# need no live code of their own (test_live.py runs ByteGrad live) and 1-bit Adam over the wire
# is checked for agreement only: those three run with the slow scenarios.
@pytest.mark.parametrize("kind", [pytest.param("LowPrecision", marks=pytest.mark.slow),
                                  pytest.param("QSGD", marks=pytest.mark.slow), "PowerSGD",
                                  "OneBitAdam-hierarchical", pytest.param("OneBitAdam", marks=pytest.mark.slow)])
def test_a_killed_worker_leaves_and_a_newcomer_joins(tmp_path, kind):
    text = _run(tmp_path, kind)
    assert "worker r1" in text and "signal 9" in text
    sizes, got = _timeline(tmp_path, text)
    full = [3] * STEPS
    if kind == "LowPrecision":
        _close(got, _simulate(sizes), rtol=2e-3, atol=2e-4)
        assert _far(got, _simulate(full), rtol=2e-3, atol=2e-4)
    elif kind == "QSGD":
        want, other = _simulate(sizes), _simulate(full)
        dist = lambda a: sum(float((g - w).norm() ** 2) for g, w in zip(got, a)) ** 0.5
        assert dist(want) < 0.5 * dist(other), (dist(want), dist(other))
    elif kind == "PowerSGD":
        _close(got, _simulate_powersgd(sizes), rtol=2e-5, atol=2e-6)
        assert _far(got, _simulate_powersgd(full), rtol=1e-3, atol=1e-4)
    elif kind == "OneBitAdam-hierarchical":
        _close(got, _simulate_onebit_adam(sizes), rtol=2e-5, atol=2e-6)
        assert _far(got, _simulate_onebit_adam(full), rtol=1e-3, atol=1e-4)


def _simulate_rounds(kind, sizes, ends):
    """float64: each round (the steps up to each of ends) the timeline's ranks train copies of
    the model alone (SGD, lr 0.1), then LocalSGD sets the model to their average; DiLoCo steps
    its outer optimizer (SGD, lr 0.7, Nesterov momentum 0.9) with the average of outer - copy."""
    import copy

    model = _model64()
    outer_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    start = 0
    for end in ends:
        steps = list(range(start, end + 1))
        n = sizes[start]
        assert all(sizes[s] == n for s in steps), (steps, sizes)
        replicas = []
        for r in range(n):
            m = copy.deepcopy(model)
            for s in steps:
                g = torch.Generator().manual_seed(1000 * s + r)
                x, y = torch.randn(6, 8, generator=g).double(), torch.randn(6, 1, generator=g).double()
                m.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                with torch.no_grad():
                    for p in m.parameters():
                        p -= 0.1 * p.grad
            replicas.append(list(m.parameters()))
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                avg = sum(rep[i] for rep in replicas) / n
                if kind == "LocalSGD":
                    p.copy_(avg)
                else:
                    p.grad = p - avg
        if kind == "DiLoCo":
            outer_opt.step()
        start = end + 1
    return [p.detach().flatten() for p in model.parameters()]


@pytest.mark.parametrize("kind", sorted(ROUNDS))
def test_a_round_a_failure_interrupts_is_given_up_and_newcomers_enter_between_rounds(tmp_path, kind):
    """LocalSGD(sync_every=3), DiLoCo(inner_steps=3): r1 dies inside a round; the two others
    train its remaining local steps alone, fail at the round's average, go back to the round's
    start and train it again with two. The newcomer enters at the next round (or at the round
    given up, should it be ready that early). The result equals a float64 run of those rounds."""
    steps, ends, fault, start, grow = ROUNDS[kind]
    text = _run(tmp_path, kind, fault=fault, grow=grow, steps=steps)
    assert "worker r1" in text and "signal 9" in text
    logs, finals = live_runs.load(tmp_path)
    assert sorted(finals) == ["j1", "r0", "r2"], text[-6000:]
    redone = steps - start
    for m in ("r0", "r2"):
        assert {e["pid"] for e in logs[m]} == {finals[m]["pid"]}, m
        # The round the failure interrupted is trained again from its start; no other step twice.
        assert [e["step"] for e in logs[m]] == list(range(fault + 1)) + list(range(start, steps)), m
        assert [(c[1], c[2], c[3]) for c in finals[m]["changes"]] == [(2, ["r1"], []), (3, [], ["j1"])], finals[m]
    first = logs["j1"][0]["step"]
    assert first in (start, grow) and [e["step"] for e in logs["j1"]] == list(range(first, steps))
    sizes = [3] * start + [e["size"] for e in logs["r0"]][-redone:]
    assert sizes == [3] * start + [2] * (first - start) + [3] * (steps - first), sizes
    assert all(sizes[e["step"]] == e["size"] for e in logs["r2"][-redone:] + logs["j1"])
    # The last average leaves every member with the same parameters.
    ref = finals["r0"]["params"]
    assert all(f["params"] == ref for f in finals.values())
    got = [torch.tensor(p, dtype=torch.float64) for p in ref]
    _close(got, _simulate_rounds(kind, sizes, ends), rtol=2e-5, atol=2e-6)
    assert _far(got, _simulate_rounds(kind, [3] * steps, ends), rtol=1e-3, atol=1e-4)


def _average_at_change(logs, x, s, n):
    """The live rule where the world changed between steps s - 1 and s: every one of the n new
    replicas is the average of those of the members that applied step s - 1 and go on (a member
    behind received a copy; the departed and newcomers are not counted)."""
    keep = [e["rank"] for entries in logs.values() for e in entries
            if e["step"] == s - 1 and entries[-1]["step"] >= s]
    assert keep, (s, logs)
    avg = [sum(x[r][i] for r in keep) / len(keep) for i in range(len(x[0]))]
    return [[t.clone() for t in avg] for _ in range(n)]


def _simulate_decentralized(logs, steps, kind="Decentralized"):
    """float64 decentralized SGD over the exp2 graph of each step's world (rumor's own schedule,
    mixing_matrix): x_{t+1}^i = sum_j W[j, i] x_t^j - 0.1 g^i(x_t^i); or LowPrecisionDecentralized's
    documented ring rule (test_decentralized's reference), quantizing with rumor's MinMaxU8 codec:
    y = x - 0.1 g, x = y + w (xh_left + xh_right - 2 xh), xh += decode(encode(x - xh)). Where the
    world changed between steps s - 1 and s, every replica (and every tracked copy) becomes the
    average of those of the members that applied step s - 1 and go on (a member behind received
    a copy; the departed and newcomers are not counted). Returns the replicas of the last step,
    by rank."""
    from rumor.algorithms.decentralized import mixing_matrix
    from rumor.compression import MinMaxUInt8

    codec = MinMaxUInt8()

    sizes = live_runs.sizes_by_step(logs, steps)
    model = _model64()
    x = [[p.detach().clone() for p in model.parameters()] for _ in range(sizes[0])]
    flat = lambda rep: torch.cat([t.flatten() for t in rep])  # noqa: E731
    xh = [flat(rep) for rep in x]  # the tracked copies (LowPrecisionDecentralized)
    for s, n in enumerate(sizes):
        if s and n != sizes[s - 1]:
            x = _average_at_change(logs, x, s, n)
            xh = [flat(rep) for rep in x]
        grads = []
        for r in range(n):
            with torch.no_grad():
                for p, t in zip(model.parameters(), x[r]):
                    p.copy_(t)
            g = torch.Generator().manual_seed(1000 * s + r)
            xb, yb = torch.randn(6, 8, generator=g).double(), torch.randn(6, 1, generator=g).double()
            model.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        if kind == "Decentralized":
            w = mixing_matrix("exp2", n, s)
            x = [[sum(float(w[j, i]) * x[j][k] for j in range(n)) - 0.1 * grads[i][k] for k in range(len(x[0]))]
                 for i in range(n)]
            continue
        ys = [flat(x[i]) - 0.1 * flat(grads[i]) for i in range(n)]
        if n == 2:
            new = [ys[j] + 0.5 * (xh[1 - j] - xh[j]) for j in range(n)]
        else:
            new = [ys[j] + (1 / 3) * (xh[(j - 1) % n] + xh[(j + 1) % n] - 2 * xh[j]) for j in range(n)]
        for j in range(n):  # one buffer of one chunk: the codec's min and max are the whole difference's
            codec.decode(codec.encode((new[j] - xh[j]).contiguous()), xh[j].shape, out=xh[j], accumulate=True)
        shapes = [t.shape for t in x[0]]
        x = [[t.view(sh) for t, sh in zip(torch.split(v, [sh.numel() for sh in shapes]), shapes)] for v in new]
    return [[t.flatten() for t in rep] for rep in x]


@pytest.mark.parametrize("kind", ["Decentralized", "LowPrecisionDecentralized"])
def test_decentralized_rebuilds_its_graph_over_the_live_ranks(tmp_path, kind):
    """Decentralized(exp2), LowPrecisionDecentralized (ring): r1 dies before its step 3; the step
    in flight is undone (weights, schedule position), the members left start the new epoch from
    the average of the replicas of those that applied the most steps (LowPrecisionDecentralized's
    tracked copies start over from it), and mix over the graph of two ranks; the newcomer
    receives that average too when it is admitted. Each member's final replica equals its
    rank's in a float64 run of the timeline."""
    text = _run(tmp_path, kind)
    assert "worker r1" in text and "signal 9" in text
    logs, finals = live_runs.load_and_check(tmp_path, text, ["j1", "r0", "r2"], ["r0", "r2"], STEPS, every_step=False)
    for m in ("r0", "r2"):
        assert [(c[1], c[2], c[3]) for c in finals[m]["changes"]] == [(2, ["r1"], []), (3, [], ["j1"])], finals[m]
    want = _simulate_decentralized(logs, STEPS, kind)
    # The replicas differ (three ranks mix with one or two peers a step) and each follows its rank.
    assert finals["r0"]["params"] != finals["r2"]["params"]
    tol = dict(rtol=2e-5, atol=2e-6) if kind == "Decentralized" else dict(rtol=1e-9, atol=1e-12)  # float32 / 64
    for m, f in finals.items():
        got = [torch.tensor(p, dtype=torch.float64) for p in f["params"]]
        _close(got, want[logs[m][-1]["rank"]], **tol)


def _simulate_async(logs, steps):
    """float64 AsyncModelAverage whose rounds never come (rounds an hour apart): the warm-up's
    steps are SGD on the average of the step's ranks' gradients; then each rank trains its replica
    alone (SGD, lr 0.1); where the world changed between steps s - 1 and s, every replica becomes
    the average of those of the members that applied step s - 1 and go on (the live rule,
    docs/elastic.md); finish() averages the last step's replicas."""
    sizes = live_runs.sizes_by_step(logs, steps)
    model = _model64()
    x = [[p.detach().clone() for p in model.parameters()] for _ in range(sizes[0])]
    for s, n in enumerate(sizes):
        if s and n != sizes[s - 1]:
            x = _average_at_change(logs, x, s, n)
        grads = []
        for r in range(n):
            with torch.no_grad():
                for p, t in zip(model.parameters(), x[r]):
                    p.copy_(t)
            grads.append(list(_grads(model, s, r + 1)[r].values()))
        if s < FREEZE:  # warm-up: GradientAllReduce, the replicas stay equal
            grads = [[sum(g[k] for g in grads) / n for k in range(len(x[0]))]] * n
        x = [[t - 0.1 * g for t, g in zip(x[r], grads[r])] for r in range(n)]
    return [sum(x[r][i] for r in range(len(x))) / len(x) for i in range(len(x[0]))]


@pytest.mark.parametrize("kind", ["AsyncModelAverage-all", pytest.param("AsyncModelAverage-ring", marks=pytest.mark.slow),
                                  "AsyncModelAverage-rounds"])
def test_async_model_average_starts_each_epoch_from_the_average_and_ends_equal(tmp_path, kind):
    """AsyncModelAverage(warmup_steps=2): r1 dies before its step 3, after the warm-up, where the
    training threads communicate nothing; the survivors find it at their next optimizer step
    (live membership's watcher), give that step up, start the new epoch from the average of
    their replicas and go on with an averaging thread over two ranks; the newcomer receives
    that state at step 6 and finish() gives every member the average of the three. -all and
    -ring (no rounds of their own): the final parameters equal a float64 run of that timeline,
    to float32 rounding. -rounds (a round every 20 ms): the members agree bitwise at the end
    and the last epoch's threads averaged."""
    text = _run(tmp_path, kind)
    assert "worker r1" in text and "signal 9" in text
    logs, finals = live_runs.load_and_check(tmp_path, text, ["j1", "r0", "r2"], ["r0", "r2"], STEPS)
    for m in ("r0", "r2"):
        assert [(c[1], c[2], c[3]) for c in finals[m]["changes"]] == [(2, ["r1"], []), (3, [], ["j1"])], finals[m]
    assert live_runs.sizes_by_step(logs, STEPS) == [3] * FAULT + [2] * (GROW - FAULT) + [3] * (STEPS - GROW)
    ref = finals["r0"]["params"]
    for m, f in finals.items():
        assert f["params"] == ref, f"{m} differs from r0"
    got = [torch.tensor(p, dtype=torch.float64) for p in ref]
    if kind.endswith("rounds"):
        assert all(f["rounds"] > 0 for f in finals.values()), finals
        assert all(math.isfinite(v) for p in ref for v in p)
        return
    want = [t.flatten() for t in _simulate_async(logs, STEPS)]
    _close(got, want, rtol=2e-5, atol=2e-6)
    # Not the run where nobody failed, nor one where the survivors kept their own replicas.
    assert _far(got, [t.flatten() for t in _simulate_async({"r0": [{"step": s, "size": 3, "rank": 0}
                                                                    for s in range(STEPS)]}, STEPS)],
                rtol=1e-3, atol=1e-4)


def _simulate_streaming(logs, steps, H=4, F=2, tau=0, alpha=0.0):
    """float64 DiLoCo(inner_steps=H, num_fragments=F, fragment_sync_delay=tau,
    fragment_update_alpha=alpha) over the timeline's world sizes: each rank trains its replica
    alone (SGD, lr 0.1); after inner step t (t = step + 1) every fragment with t % H == its offset
    (p * H // F) sends the mean of outer - replica over its elements (the parameters flattened in
    order, cut into F equal ranges); tau inner steps later it takes its outer step with it (SGD,
    lr 0.7, Nesterov momentum 0.9) and every replica's fragment becomes alpha * replica +
    (1 - alpha) * outer. Where the world changed between steps s - 1 and s, the averages in flight
    are dropped and every replica becomes the outer parameters of every fragment (the live rule,
    docs/elastic.md). Returns the replicas after the last step, by rank."""
    sizes = live_runs.sizes_by_step(logs, steps)
    model = _model64()
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    L = flat.numel()
    cuts = [(L * p // F, L * (p + 1) // F) for p in range(F)]
    outer = [torch.nn.Parameter(flat[a:b].clone()) for a, b in cuts]
    opt = torch.optim.SGD(outer, lr=0.7, momentum=0.9, nesterov=True)

    def unflat(v):
        out, i = [], 0
        for shape in shapes:
            n = math.prod(shape)
            out.append(v[i:i + n].view(shape))
            i += n
        return out

    x = [flat.clone() for _ in range(sizes[0])]
    pending = {}  # fragment -> (inner step after which it applies, the mean pseudo-gradient)
    for s, n in enumerate(sizes):
        if s and n != sizes[s - 1]:
            x = [torch.cat([o.detach() for o in outer]) for _ in range(n)]
            pending = {}
        for r in range(n):
            with torch.no_grad():
                for p, t in zip(model.parameters(), unflat(x[r])):
                    p.copy_(t)
            g = torch.cat([t.flatten() for t in _grads(model, s, r + 1)[r].values()])
            x[r] = x[r] - 0.1 * g
        t = s + 1

        def outer_step(p, a, b):
            with torch.no_grad():
                outer[p].grad = pending.pop(p)[1]
                opt.step()
                outer[p].grad = None
            for v in x:
                v[a:b] = torch.lerp(outer[p].detach(), v[a:b], alpha)

        for p, (a, b) in enumerate(cuts):
            if p in pending and pending[p][0] == t:
                outer_step(p, a, b)
        for p, (a, b) in enumerate(cuts):
            if t % H == (p * H // F) % H:
                pending[p] = (t + tau, outer[p].detach() - sum(v[a:b] for v in x) / n)
                if tau == 0:
                    outer_step(p, a, b)
    return [[t.flatten() for t in unflat(v)] for v in x]


@pytest.mark.parametrize("kind", ["StreamingDiLoCo", "StreamingDiLoCo-delay", "StreamingDiLoCo-average"])
def test_streaming_diloco_puts_every_fragment_back_to_the_global_model_at_a_change(tmp_path, kind):
    """DiLoCo(inner_steps=4, num_fragments=2) runs live step by step: r1 dies before its step 3
    (after fragment 1's outer step at step 1, before fragment 0's at step 3); the survivors find
    it at their next optimizer step, give it up, put both fragments back to their outer
    parameters and train on with two; the newcomer receives that global model and the outer
    state at step 6, where every member again goes back to the global model. -delay
    (fragment_sync_delay=1, fragment_update_alpha=0.5): r1 dies before its step 2, while fragment
    1's average sent at step 1 is still to be applied: it is given up. -average: r1 dies inside
    fragment 0's average at step 3, which the survivors entered first: they learn of it from that
    average failing, after their inner step was applied, and undo the step. Each member's final
    replica (they differ between outer steps) equals a float64 run of that timeline for its rank,
    to float32 rounding, and not the run where nobody failed."""
    delay = kind.endswith("delay")
    fault = 2 if delay else FAULT
    text = _run(tmp_path, kind, fault=fault)
    assert "worker r1" in text and "signal 9" in text
    logs, finals = live_runs.load_and_check(tmp_path, text, ["j1", "r0", "r2"], ["r0", "r2"], STEPS)
    for m in ("r0", "r2"):
        assert [(c[1], c[2], c[3]) for c in finals[m]["changes"]] == [(2, ["r1"], []), (3, [], ["j1"])], finals[m]
    sizes = live_runs.sizes_by_step(logs, STEPS)
    first = logs["j1"][0]["step"]
    assert sizes == [3] * fault + [2] * (first - fault) + [3] * (STEPS - first) and fault < first <= GROW, sizes
    rule = dict(tau=1, alpha=0.5) if delay else {}
    want = _simulate_streaming(logs, STEPS, **rule)
    full = _simulate_streaming({"r0": [{"step": s, "size": 3, "rank": 0} for s in range(STEPS)]}, STEPS, **rule)
    _each_replica_matches(finals, logs, want, full)
    if kind.endswith("-average"):
        # The survivors' flight recorders: an allreduce (the average) was in flight when the
        # epoch ended, failed by the closed socket or aborted by the watcher, whichever came first.
        assert re.search(r"allreduce \(op #\d+, [^)]*\) (running|failed) bytes=", text), text[-6000:]


def _each_replica_matches(finals, logs, want, full):
    """Each member's final replica equals want[its last rank] to float32 rounding, and differs
    from full[that rank] (the run where nobody failed)."""
    for m, f in finals.items():
        got = [torch.tensor(p, dtype=torch.float64) for p in f["params"]]
        rank = logs[m][-1]["rank"]
        _close(got, want[rank], rtol=2e-5, atol=2e-6)
        assert _far(got, full[rank], rtol=1e-3, atol=1e-4), m


def _undo_rank():
    """One rank: marks DiLoCo(inner_steps=4, num_fragments=2) before a step that takes an outer step,
    runs that step (inner optimizer with momentum, then fragment 1's outer step), and undoes it
    as live membership does when that average fails: the step count, the outer parameters, the
    outer and inner optimizers' states go back to the mark and every fragment to its outer
    parameters."""
    import rumor
    from rumor.parallel import DistributedDataParallel

    rumor.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    alg = rumor.algorithms.DiLoCo(inner_steps=4, num_fragments=2)
    ddp = DistributedDataParallel(model, optimizer=opt, algorithm=alg)

    def step(s):
        g = torch.Generator().manual_seed(s)
        loss = torch.nn.functional.mse_loss(ddp(torch.randn(6, 8, generator=g)), torch.randn(6, 1, generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()

    step(0)  # inner step 1: local
    alg.elastic_live_mark()
    before = dict(steps=alg.steps, sent=[f.sent for f in alg.fragments],
                  outer=[s.outer.detach().clone() for f in alg.fragments for s in f.slots],
                  outer_opt=str(alg.outer_optimizer.state_dict()["state"]),
                  momentum=[opt.state[p]["momentum_buffer"].clone() for p in model.parameters()])
    step(1)  # inner step 2: fragment 1 (offset 2) takes its outer step
    changed = (alg.steps != before["steps"], [f.sent for f in alg.fragments] != before["sent"],
               any(not torch.equal(a, s.outer) for a, s in zip(before["outer"], [s for f in alg.fragments
                                                                                 for s in f.slots])))
    alg.elastic_live_undo()
    after = dict(steps=alg.steps, sent=[f.sent for f in alg.fragments],
                 outer=all(torch.equal(a, s.outer) for a, s in zip(before["outer"], [s for f in alg.fragments
                                                                                      for s in f.slots])),
                 outer_opt=str(alg.outer_optimizer.state_dict()["state"]) == before["outer_opt"],
                 momentum=all(torch.equal(m, opt.state[p]["momentum_buffer"])
                              for m, p in zip(before["momentum"], model.parameters())),
                 global_model=all(torch.equal(s.x, s.outer.data.to(s.x.dtype)) for f in alg.fragments
                                  for s in f.slots))
    rumor.shutdown()
    return changed, before["steps"], before["sent"], after


def test_streaming_diloco_undo_puts_back_a_step_whose_average_ran():
    ((changed, steps, sent, after),) = harness.run(_undo_rank, 1, timeout=DEADLINE_S)
    assert changed == (True, True, True)  # the step did take fragment 1's outer step
    assert after["steps"] == steps and after["sent"] == sent
    assert after["outer"] and after["outer_opt"] and after["momentum"] and after["global_model"], after
