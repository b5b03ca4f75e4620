"""Asynchronous model averaging: rumor.algorithms.AsyncModelAverage.

Behaviour, never speed: ranks are spawned by harness.run and return what they observed; nothing
asserts on how long something took, only on what happened (which values, how many steps, which
error). Covered:

* warm-up steps are GradientAllReduce's, bit for bit (same model, data and optimizer, both
  algorithms in the same processes); after warm-up backward communicates nothing (each rank's
  gradient is its own local gradient);
* with lr=0 and different weights per rank, the background rounds give every rank the exact
  mean (float32, bfloat16, float16): x + (average - snapshot) with no local progress is the
  average;
* the delta rule keeps local progress: unit tests of compute_delta/apply_delta per dtype, and
  end to end: with a constant gradient per rank, different step counts and a slow rank, the
  weights after finish() are w0 - lr/n * sum_r steps_r * g_r on every rank (averaging
  preserves the sum of the replicas, so every local step counts exactly once), identical bits;
  the weights never change between the start of forward and the end of backward;
* a slowed rank (sleep per step) does not hold the others back: they complete their steps while
  the slow one does far fewer; the replicas stay close and the loss decreases;
* abort()/resume() on one rank only (it keeps its weights, the others average among
  themselves; after resume all meet at the mean), on all ranks (nothing moves), before
  wrapping; abort after finish is refused;
* a rank killed during asynchronous training (os._exit, SIGKILL): the survivors raise a rumor
  error on their training thread (at the next forward, and from finish()), never hang;
* gossip modes ("ring", "shift_one", "exp2", over one-sided windows): every rank mixes with the
  values its peers put into its window (each round an average of values, so the weights stay in
  the hull of the initial ones) and finish() ends with the exact mean of the ranks' weights,
  identical bits everywhere; a killed rank makes the survivors raise;
* bad arguments raise ValueError / TypeError.
"""
from __future__ import annotations

import os
import signal
import tempfile

import pytest

import harness

D_IN, HIDDEN, CLASSES, BATCH = 8, 12, 4, 6


# ==== inside a rank ===============================================================================

def _init():
    import torch

    import rumor

    torch.set_num_threads(1)
    rumor.init()


def _net(seed, dtype=None):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)).to(dtype or torch.float32)


def _xy(step, shard, dtype=None):
    import torch

    g = torch.Generator().manual_seed(7919 * step + shard)
    x = torch.randn(BATCH, D_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    return x.to(dtype or torch.float32), y


def _flat(model):
    import torch

    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _step(ddp, opt, t, rank, dtype=None):
    import torch.nn.functional as F

    x, y = _xy(t, rank, dtype)
    opt.zero_grad()
    loss = F.cross_entropy(ddp(x).float(), y)
    loss.backward()
    opt.step()
    return float(loss)


def _until(cond, step, limit_s=20.0, what=""):
    """Calls step() until cond() holds; fails after limit_s (a bound, not a measurement)."""
    import time

    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not reached within {limit_s} s")
        step()


# The averaging thread starts with the wrapper, before a test gives each rank its own weights:
# a round taking a snapshot before (or during) that fill would mix the wrapper's initial weights
# into the exact means the tests expect. These tests build the algorithm with a first round an
# hour away, fill, then bring the interval down and wake the thread (its first round is a
# collective census, so it cannot start before every rank has filled).
_FIRST_ROUND_LATER_MS = 3_600_000


def _start_rounds(alg, interval_ms):
    alg._interval = interval_ms / 1000.0
    alg._wake.set()


def _fill(model, value):
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def rank_warmup(warm):
    """GradientAllReduce and AsyncModelAverage(warmup_steps=warm) on the same data: the first
    `warm` steps must give the same bits. Then one asynchronous step: each rank's gradient is
    its own local one."""
    import torch
    import torch.nn.functional as F

    import rumor

    _init()
    rank = rumor.rank()
    out = {}
    for kind in ("gar", "async"):
        model = _net(100 + rank)  # rank-dependent: wrapping broadcasts rank 0's
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if kind == "gar":
            alg = rumor.algorithms.GradientAllReduce()
        else:  # a long interval: no round runs before finish()
            alg = rumor.algorithms.AsyncModelAverage(sync_interval_ms=60_000, warmup_steps=warm)
        ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=alg, bucket_cap_mb=0.0005,
                                            first_bucket_mb=0.0002)
        traj = []
        for t in range(warm):
            if kind == "async":
                assert not alg.running, "the averaging thread runs during warm-up"
            _step(ddp, opt, t, rank)
            traj.append(_flat(model))
        out[kind] = traj
        if kind == "async":
            assert alg.running, "no averaging thread after warm-up"
            assert len(ddp.buckets) > 1
            # One asynchronous step: the gradient must be this rank's own.
            ref = _net(0)
            with torch.no_grad():
                for p, q in zip(ref.parameters(), model.parameters()):
                    p.copy_(q)
            x, y = _xy(warm, rank)
            F.cross_entropy(ref(x), y).backward()
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            out["local_grad"] = [torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters())]
            out["grad"] = torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])
            opt.step()
            alg.finish()
            out["final"] = _flat(model)
            out["running_after_finish"] = alg.running
    rumor.shutdown()
    return out


def rank_mean(dtypes):
    """lr=0 and weights rank+1 on every rank: rounds must make every rank hold the exact mean."""
    import time

    import torch

    import rumor

    _init()
    rank, n = rumor.rank(), rumor.size()
    out = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        model = _net(1, dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        alg = rumor.algorithms.AsyncModelAverage(sync_interval_ms=_FIRST_ROUND_LATER_MS)
        ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=alg)
        _fill(model, rank + 1)
        _start_rounds(alg, 10)
        mean = (n + 1) / 2
        target = torch.full_like(_flat(model), mean)

        def step():
            _step(ddp, opt, 0, rank, dtype)
            time.sleep(0.005)

        _until(lambda: torch.equal(_flat(model), target), step, what=f"{name}: mean")
        rounds = alg.rounds
        alg.finish()
        out[name] = dict(before=torch.equal(_flat(model), target), rounds=rounds, applied=alg.applied,
                         after=_flat(model))
    rumor.shutdown()
    return out


def _const_model(rank):
    """A model whose loss gradient is a fixed tensor per rank: loss = sum_p <p, g_p>."""
    import torch
    import torch.nn as nn

    class ConstGrad(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(5)
            self.w = nn.Parameter(torch.randn(16, 8, dtype=torch.float64))
            self.b = nn.Parameter(torch.randn(8, dtype=torch.float64))
            self.seen = None

        def forward(self, gs):
            # Weights as forward sees them (after the algorithm's before_forward).
            self.seen = [self.w.detach().clone(), self.b.detach().clone()]
            return (self.w * gs[0]).sum() + (self.b * gs[1]).sum()

    return ConstGrad()


def _const_grads(rank):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(16, 8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)]


def _params_in(model, flat):
    """Whether every parameter is a view into ``flat`` (with the shared arena, the weights the
    peers read are the parameters themselves)."""
    lo = flat.data_ptr()
    hi = lo + flat.numel() * flat.element_size()
    return all(lo <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= hi for p in model.parameters())


def rank_progress(steps, sleeps, warm, lr, interval_ms, mode=None):
    """Constant gradient g_r per rank, `steps[r]` steps each (sleeping sleeps[r] per step):
    returns the weights after finish() and whether the weights ever changed between the start
    of forward and the end of backward."""
    import time

    import torch

    import rumor

    _init()
    rank = rumor.rank()
    model = _const_model(rank)
    w0 = [p.detach().clone() for p in model.parameters()]
    gs = _const_grads(rank)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    alg = rumor.algorithms.AsyncModelAverage(sync_interval_ms=interval_ms, warmup_steps=warm)
    from rumor.engine import device as device_engine

    device_engine.EMULATE = mode  # the engine and host mirror of CUDA parameters, on CPU ones
    try:
        ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=alg)
    finally:
        device_engine.EMULATE = None
    moved_inside = 0
    for _ in range(steps[rank]):
        opt.zero_grad()
        loss = ddp(gs)
        time.sleep(0.002)  # a wider window for a (wrong) write by the averaging thread
        loss.backward()
        now = [model.w.detach(), model.b.detach()]
        moved_inside += int(not all(torch.equal(a, b) for a, b in zip(model.seen, now)))
        opt.step()
        if sleeps[rank]:
            time.sleep(sleeps[rank])
    rounds = alg.rounds
    alg.finish()
    out = dict(w0=w0, final=[p.detach().clone() for p in model.parameters()], moved_inside=moved_inside,
               rounds=rounds, applied=alg.applied, steps=alg.steps, fused=alg._slots[0].shared,
               in_slot=_params_in(model, alg._slots[0].x), mirror=alg._device)
    rumor.shutdown()
    return out


def rank_slow(workdir, fast_steps, fast_sleep, slow_sleep):
    """Rank n-1 sleeps slow_sleep per step, the others fast_sleep. The fast ranks run
    fast_steps steps (and at least 3 averaging rounds), then mark themselves done; the slow rank
    runs until all fast ranks are done. Learnable data: y = x @ w_true, the same w_true
    everywhere; the loss on a fixed evaluation batch is taken before and after training."""
    import time

    import torch
    import torch.nn.functional as F

    import rumor

    _init()
    rank, n = rumor.rank(), rumor.size()
    slow = rank == n - 1
    torch.manual_seed(3)
    w_true = torch.randn(D_IN, 1)
    x_eval = torch.randn(64, D_IN)
    model = torch.nn.Linear(D_IN, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    alg = rumor.algorithms.AsyncModelAverage(sync_interval_ms=20, warmup_steps=2)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=alg)
    g = torch.Generator().manual_seed(rank)

    def eval_loss():
        with torch.no_grad():
            return float(F.mse_loss(model(x_eval), x_eval @ w_true))

    def step():
        x = torch.randn(16, D_IN, generator=g)
        opt.zero_grad()
        F.mse_loss(ddp(x), x @ w_true).backward()
        opt.step()
        time.sleep(slow_sleep if slow else fast_sleep)

    loss0 = eval_loss()
    fast = [os.path.join(workdir, f"fast_done.{r}") for r in range(n - 1)]
    if slow:
        _until(lambda: all(os.path.exists(f) for f in fast), step, limit_s=60, what="fast ranks done")
    else:
        for _ in range(fast_steps):
            step()
        _until(lambda: alg.rounds >= 3, step, what="3 rounds")
        open(fast[rank], "w").close()
    ddp(x_eval[:1])  # a forward applies what the last round left
    loss1 = eval_loss()
    before = _flat(model)
    steps, rounds = alg.steps, alg.rounds
    alg.finish()
    out = dict(steps=steps, rounds=rounds, loss0=loss0, loss1=loss1, before=before, after=_flat(model))
    rumor.shutdown()
    return out


def rank_same_wall_time(window_s, slow_sleep):
    """GradientAllReduce and AsyncModelAverage (all, exp2), each for the same wall-clock window
    on the same regression problem, the last rank slowed: returns each variant's loss on a fixed
    evaluation batch after the window (after finish() for the asynchronous ones)."""
    import time

    import torch
    import torch.nn.functional as F

    import rumor

    _init()
    rank, n = rumor.rank(), rumor.size()
    torch.manual_seed(11)
    w_true = torch.randn(D_IN, 1)
    x_eval = torch.randn(256, D_IN)
    out = {}
    for kind in ("gar", "all", "exp2"):
        torch.manual_seed(12)
        model = torch.nn.Linear(D_IN, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        alg = (rumor.algorithms.GradientAllReduce() if kind == "gar" else
               rumor.algorithms.AsyncModelAverage(kind, sync_interval_ms=20, warmup_steps=1))
        ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=alg)
        g = torch.Generator().manual_seed(100 + rank)
        rumor.barrier()
        end = time.monotonic() + window_s
        steps = 0
        while True:
            x = torch.randn(16, D_IN, generator=g)
            opt.zero_grad()
            F.mse_loss(ddp(x), x @ w_true).backward()
            opt.step()
            steps += 1
            if rank == n - 1:
                time.sleep(slow_sleep)
            if kind == "gar":
                # lockstep: stop together, on rank 0's clock
                flag = torch.tensor([1.0 if rank == 0 and time.monotonic() >= end else 0.0])
                if float(rumor.allreduce(flag, op=rumor.ReduceOp.MAX)) > 0:
                    break
            elif time.monotonic() >= end:
                break
        if kind != "gar":
            alg.finish()
        with torch.no_grad():
            out[kind] = dict(loss=float(F.mse_loss(model(x_eval), x_eval @ w_true)), steps=steps)
    rumor.shutdown()
    return out


def rank_abort_resume(workdir):
    """3 ranks, lr=0, float32. Rank 0 aborts before wrapping: ranks 1 and 2 average among
    themselves (2, 3 -> 2.5) while rank 0 keeps 1. Rank 0 resumes: all meet at 2. All abort:
    new weights 10, 11, 12 stay put through several rounds. All resume: all meet at 11."""
    import time

    import torch

    import rumor

    _init()
    rank = rumor.rank()
    chk = harness.Checker()
    model = _net(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    alg = rumor.algorithms.AsyncModelAverage(sync_interval_ms=_FIRST_ROUND_LATER_MS)
    if rank == 0:
        alg.abort()
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=alg)

    def fill(v):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(v)

    def all_equal(v):
        return torch.equal(_flat(model), torch.full_like(_flat(model), v))

    def step():
        _step(ddp, opt, 0, rank)
        time.sleep(0.005)

    def barrier(name):
        harness.file_barrier(workdir, name, timeout=30)

    fill(rank + 1)
    _start_rounds(alg, 10)
    barrier("filled")
    if rank == 0:
        barrier("others_averaged")
        step()  # nothing may be applied
        chk.check(all_equal(1.0), f"paused rank 0 kept its weights: {_flat(model)[:3].tolist()}")
        alg.resume()
    else:
        _until(lambda: all_equal(2.5), step, what="ranks 1, 2 average among themselves")
        barrier("others_averaged")
    _until(lambda: all_equal(2.0), step, what="all meet at the mean after resume")
    barrier("met")
    alg.abort()
    barrier("aborted")
    # Two censuses after every rank aborted: any round in flight has finished (its result, all
    # at 2.0, changes nothing when applied) and no weight round starts any more.
    ticks = alg._ticks
    _until(lambda: alg._ticks >= ticks + 2, step, what="censuses after abort")
    fill(rank + 10)
    ticks = alg._ticks
    _until(lambda: alg._ticks >= ticks + 4, step, what="census rounds while all are paused")
    chk.check(all_equal(rank + 10.0), f"all paused: rank {rank} kept its weights")
    barrier("checked")
    alg.resume()
    _until(lambda: all_equal(11.0), step, what="all meet at 11 after resume")
    alg.finish()
    chk.check(all_equal(11.0), "finish keeps the common mean")
    chk.raises(RuntimeError, alg.abort, "abort after finish", match="finish")
    chk.raises(RuntimeError, alg.resume, "resume after finish", match="finish")
    chk.raises(RuntimeError, lambda: rumor.DistributedDataParallel(_net(1), algorithm=alg),
               "one algorithm object for two wrappers", match="already")
    rumor.shutdown()
    return chk.failures, chk.count


def rank_pending_then_abort(workdir):
    """Rank 0 makes no forward while rounds run (its delta waits, and is retaken by the next
    rounds), then aborts: abort() applies the delta that waits (the mean of the round, exactly),
    the rounds it now sits out do not touch the weights, and its next forward applies nothing."""
    import time

    import torch

    import rumor

    _init()
    rank = rumor.rank()
    model = _net(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    alg = rumor.algorithms.AsyncModelAverage(sync_interval_ms=_FIRST_ROUND_LATER_MS)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=alg)
    _fill(model, rank + 1)
    _start_rounds(alg, 10)
    target = torch.full_like(_flat(model), 2.0)
    out = {}
    if rank == 0:
        _until(lambda: alg.rounds >= 2, lambda: time.sleep(0.005), what="rounds without a forward")
        alg.abort()
        out["applied_by_abort"] = torch.equal(_flat(model), target)
        ticks = alg._ticks
        # ranks 1 and 2 keep training meanwhile: these are weight rounds rank 0 sits out
        _until(lambda: alg._ticks >= ticks + 4, lambda: time.sleep(0.005), what="rounds sat out")
        out["sat_out"] = alg._ticks - ticks
        # Rank 0's ticks are its own clock: on a loaded machine the others may not have applied
        # the last round it took part in yet. They say when they hold the mean.
        others = [os.path.join(workdir, f"mean{r}") for r in range(1, rumor.size())]
        _until(lambda: all(os.path.exists(f) for f in others), lambda: time.sleep(0.005),
               what="the other ranks at the mean")
        open(os.path.join(workdir, "done"), "w").close()
        out["unchanged_before_forward"] = torch.equal(_flat(model), target)
        _step(ddp, opt, 0, rank)
        out["applied"] = alg.applied
    else:
        def step():
            _step(ddp, opt, 0, rank)
            if torch.equal(_flat(model), target):  # later rounds, without rank 0, keep it there
                open(os.path.join(workdir, f"mean{rank}"), "a").close()
            time.sleep(0.005)

        _until(lambda: os.path.exists(os.path.join(workdir, "done")), step, what="rank 0 done")
    out["mean"] = torch.equal(_flat(model), target)
    alg.finish()
    out["after"] = torch.equal(_flat(model), target)
    out["fused"] = alg._slots[0].shared
    rumor.shutdown()
    return out


def rank_abort_with_round_in_flight(workdir):
    """2 ranks, lr=0, weights 1 and 2. Rank 0's averaging thread enters a round (its census)
    while rank 1's thread is still an hour away from it (a straggler); rank 0 then aborts, and
    only then does rank 1's thread join that round. Bagua's guarantee: once abort() returned,
    the weights change only by local training, so forwards after the round completed (lr=0:
    steps that do not move the weights) must leave rank 0 exactly where abort() left it, and
    that is the round's mean (abort() waited for it and applied it)."""
    import threading
    import time

    import torch

    import rumor

    _init()
    rank = rumor.rank()
    model = _net(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    alg = rumor.algorithms.AsyncModelAverage(sync_interval_ms=_FIRST_ROUND_LATER_MS)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=alg)
    _fill(model, rank + 1.0)
    mean = torch.full_like(_flat(model), 1.5)
    aborting, done = os.path.join(workdir, "aborting"), os.path.join(workdir, "done")
    out = {}
    if rank == 0:
        entered = threading.Event()
        census = alg._mixer.census

        def watched(state, role=0):
            entered.set()  # the thread read its state (ACTIVE) before this: the round is joined
            return census(state, role)

        alg._mixer.census = watched
        _start_rounds(alg, 10)
        out["in_flight"] = entered.wait(30)
        open(aborting, "w").close()  # the straggler's thread may come now, during abort()
        alg._mixer.census = census
        alg.abort()
        at_abort = _flat(model)
        _until(lambda: alg.rounds >= 1, lambda: time.sleep(0.005), what="the round in flight completed")
        for t in range(3):
            _step(ddp, opt, t, rank)
        out["unchanged_after_abort"] = torch.equal(_flat(model), at_abort)
        out["abort_applied_the_round"] = torch.equal(at_abort, mean)
        open(done, "w").close()
    else:
        _until(lambda: os.path.exists(aborting), lambda: time.sleep(0.005), what="rank 0 aborting")
        _start_rounds(alg, 10)

        def step():
            _step(ddp, opt, 0, rank)
            time.sleep(0.005)

        # (a bound: the round in flight gives rank 1 the mean too, applied at its next forward)
        _until(lambda: torch.equal(_flat(model), mean), step, what="rank 1 at the round's mean")
        out["mean"] = True
        _until(lambda: os.path.exists(done), step, what="rank 0 done")
    alg.finish(timeout=60)
    out["after"] = torch.equal(_flat(model), mean)
    rumor.shutdown()
    return out


def rank_arena_average(dtype):
    """average_into_deltas against a float64 reference: everyone contributing; then rank 1
    sitting out (its delta must stay as it was) and rank 0 bringing a result it has not applied
    (x + delta)."""
    import torch

    import rumor
    from rumor import _C, _runtime
    from rumor._tensor import address, dtype_code

    _init()
    chk = harness.Checker()
    rank, n = rumor.rank(), rumor.size()
    dt = getattr(torch, dtype)
    count = 100_003
    es = torch.empty((), dtype=dt).element_size()
    comm = _runtime.new_group(list(range(n)))._comm
    arena = _C.SharedArena(comm, 2 * count * es + 64)
    x = torch.frombuffer(arena, dtype=dt, count=count, offset=0)
    delta = torch.frombuffer(arena, dtype=dt, count=count, offset=(count * es + 63) // 64 * 64)
    every = [torch.arange(count, dtype=torch.float64) % 97 + 10 * q for q in range(n)]
    old = [(torch.arange(count, dtype=torch.float64) * 3 + q) % 5 - 2 for q in range(n)]
    keep = torch.full((count,), -7.0, dtype=torch.float64)
    for roles in ([1] * n, [2, 0] + [1] * (n - 2)):
        x.copy_(every[rank])
        delta.copy_(old[rank] if roles[rank] == 2 else keep)
        _C.SharedArena.average_into_deltas(arena, address(x), address(delta), count, dtype_code(dt, "test"), roles)
        contrib = [q for q in range(n) if roles[q]]
        # The sum is exact in float64 (small integers); the division by 3 rounds, in the
        # buffer's dtype, as the kernel's does, and so does the difference.
        total = sum(every[q] + (old[q] if roles[q] == 2 else 0) for q in contrib)
        avg = total.to(dt) / len(contrib)
        want = (avg - every[rank].to(dt)).double() if roles[rank] else keep
        chk.check(torch.equal(delta.double(), want), f"{dtype}, roles {roles}: rank {rank}'s delta is wrong")
        chk.check(torch.equal(x.double(), every[rank]), f"{dtype}, roles {roles}: rank {rank}'s weights changed")
    for bad, what in (((x, delta, torch.float16, [1] * n), "float32 or float64"),
                      ((x, delta, dt, [1] * (n + 1)), "one role per rank"),
                      ((x, delta, dt, [0] * n), "no rank contributes"),
                      ((x, x[2:], dt, [1] * n), "overlap")):
        try:
            _C.SharedArena.average_into_deltas(arena, address(bad[0]), address(bad[1]), 8,
                                               dtype_code(bad[2], "test"), bad[3])
            chk.check(False, f"accepted: {what}")
        except ValueError as e:
            chk.check(what in str(e), f"unexpected message: {e}")
    rumor.shutdown()
    return chk.failures, chk.count


def rank_gossip(mode, mixes):
    """lr=0, weights rank+1: gossip rounds mix the replicas (each round a convex combination, so
    they stay within [1, n] and move off their start); finish() then gives everyone the exact
    mean of the weights they held, the same bits everywhere."""
    import time

    import torch

    import rumor

    _init()
    rank, n = rumor.rank(), rumor.size()
    model = _net(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    alg = rumor.algorithms.AsyncModelAverage(peer_selection=mode, sync_interval_ms=_FIRST_ROUND_LATER_MS)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=alg)
    _fill(model, rank + 1)
    _start_rounds(alg, 5)

    def step():
        _step(ddp, opt, 0, rank)
        time.sleep(0.002)

    _until(lambda: alg._mixer.mixed >= mixes, step, limit_s=40, what=f"{mode}: {mixes} rounds with fresh values")
    # The weights must hold still from the capture below to finish(): this rank takes no more
    # rounds, and two more ticks of its thread mean the round in flight (if any) has ended.
    alg.abort()
    ticks = alg._ticks
    _until(lambda: alg._ticks >= ticks + 2, lambda: time.sleep(0.002), what=f"{mode}: the round in flight ends")
    ddp(_xy(0, rank)[0])  # a forward applies what the last round left
    before = _flat(model)
    alg.finish()
    after = _flat(model)
    mean = rumor.allreduce(before.double(), op=rumor.ReduceOp.AVG)
    out = dict(before=before, after=after, mean=mean, mixed=alg._mixer.mixed,
               windows=rumor.get_current_created_window_names())
    rumor.shutdown()
    return out


def rank_killed(victim, how, mode="all"):
    """The victim dies during asynchronous training; the others must raise a rumor error on
    their training thread (within the deadline) and from finish()."""
    import time

    import torch

    import rumor

    _init()
    rank = rumor.rank()
    model = _net(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    alg = rumor.algorithms.AsyncModelAverage(peer_selection=mode, sync_interval_ms=20, warmup_steps=1)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=alg)
    for t in range(5):
        _step(ddp, opt, t, rank)
    if rank == victim:
        time.sleep(0.1)  # let a round or two run
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(17)
    start = time.monotonic()
    err = None
    try:
        for t in range(100_000):
            _step(ddp, opt, t, rank)
            time.sleep(0.01)
            if time.monotonic() - start > 60:
                break
    except rumor.RumorError as e:
        err = (type(e).__name__, str(e))
    elapsed = time.monotonic() - start
    try:
        alg.finish(timeout=30)
        fin = None
    except rumor.RumorError as e:
        fin = type(e).__name__
    return dict(err=err, elapsed=elapsed, finish=fin)


# ==== the tests ===================================================================================

BAD_ARGUMENTS = [
    (dict(peer_selection="everyone"), ValueError, "unknown peer_selection"),
    (dict(peer_selection=None), TypeError, "peer_selection"),
    (dict(peer_selection=[[0.5, 0.5], [0.5, 0.5]]), TypeError, "topology.*common rounds"),
    (dict(peer_selection="ring", peer_selection_mode="exp2"), TypeError, "peer_selection only"),
    (dict(sync_interval_ms=-1), ValueError, "sync_interval_ms"),
    (dict(sync_interval_ms=float("nan")), ValueError, "sync_interval_ms"),
    (dict(sync_interval_ms="500"), TypeError, "sync_interval_ms"),
    (dict(sync_interval_ms=True), TypeError, "sync_interval_ms"),
    (dict(warmup_steps=-1), ValueError, "warmup_steps"),
    (dict(warmup_steps=1.5), TypeError, "warmup_steps"),
    (dict(warmup_steps=False), TypeError, "warmup_steps"),
    (dict(max_busy_fraction=0), ValueError, "max_busy_fraction"),
    (dict(max_busy_fraction=1.5), ValueError, "max_busy_fraction"),
    (dict(max_busy_fraction=float("nan")), ValueError, "max_busy_fraction"),
    (dict(max_busy_fraction="0.1"), TypeError, "max_busy_fraction"),
    (dict(max_busy_fraction=True), TypeError, "max_busy_fraction"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_ARGUMENTS,
                         ids=[",".join(f"{k}={v!r}" for k, v in kw.items()) for kw, _, _ in BAD_ARGUMENTS])
def test_bad_arguments(kwargs, exc, match):
    import rumor

    with pytest.raises(exc, match=match):
        rumor.algorithms.AsyncModelAverage(**kwargs)


def test_good_arguments():
    import rumor

    A = rumor.algorithms.AsyncModelAverage
    for mode in ("ring", "shift_one", "exp2"):
        assert A(peer_selection=mode).peer_selection == mode
        assert A(mode).peer_selection_mode == mode  # the old attribute name still reads
    a = A(peer_selection="all", sync_interval_ms=0, warmup_steps=3)
    assert (a.peer_selection, a.sync_interval_ms, a.warmup_steps) == ("all", 0.0, 3)
    with pytest.raises(RuntimeError, match="not wrapped"):
        a.finish()


def _settings(a):
    # What the constructor decided: everything but the thread primitives (new objects each time).
    import threading

    kinds = (type(threading.Lock()), threading.Condition, threading.Event)
    return {k: v for k, v in vars(a).items() if not isinstance(v, kinds)}


@pytest.mark.parametrize("mode", ["all", "ring", "shift_one", "exp2"])
def test_old_peer_selection_mode_keyword_warns_and_is_the_same(mode):
    import warnings

    import rumor
    from rumor.compat.bagua.algorithms.async_model_average import AsyncModelAverageAlgorithm

    A = rumor.algorithms.AsyncModelAverage
    with pytest.warns(FutureWarning, match=r"peer_selection_mode=.*renamed peer_selection="):
        old = A(peer_selection_mode=mode, sync_interval_ms=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = A(peer_selection=mode, sync_interval_ms=20)
        # Bagua's spelling is the compat layer's own: no warning there.
        bagua = AsyncModelAverageAlgorithm(peer_selection_mode=mode, sync_interval_ms=20)
    assert _settings(old) == _settings(new) == _settings(bagua) and new.peer_selection == mode


def test_round_spacing_bounds_the_busy_fraction():
    """When the next round may start (the arithmetic only; values exact in binary): no sooner
    than sync_interval_ms after this one started, nor (shared-memory rounds) than busy /
    max_busy_fraction; with the bound off (1.0) and interval 0, back to back."""
    import types

    import rumor

    A = rumor.algorithms.AsyncModelAverage
    shared = [types.SimpleNamespace(shared=True)]  # weights in one host's shared memory
    assert A().max_busy_fraction == 0.1
    a = A(sync_interval_ms=500, max_busy_fraction=0.25)
    a._slots = shared
    assert a._next_round(8.0, 0.0625) == 8.5      # the interval dominates
    assert a._next_round(8.0, 0.25) == 9.0        # busy 0.25 s at most a quarter of the time
    assert a.busy_s == 0.3125
    b = A(sync_interval_ms=0, max_busy_fraction=1)
    b._slots = shared
    assert b._next_round(8.0, 0.125) == 8.125
    # Across hosts a round mostly waits for the network: the interval alone spaces them.
    c = A(sync_interval_ms=500, max_busy_fraction=0.25)
    c._slots = [types.SimpleNamespace(shared=False)]
    assert c._next_round(8.0, 0.25) == 8.5


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_delta_rule_unit(dtype):
    """x <- x + (average - snapshot), per dtype: keeps local progress, and with no progress gives
    the average exactly (half types: the delta is float32, exact for any two halves)."""
    import torch

    from rumor.algorithms.async_model_average import apply_delta, compute_delta, delta_dtype

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    n = 10_000
    snap = (torch.randn(n, generator=g, dtype=torch.float64) * 4).to(dt)
    avg = (torch.randn(n, generator=g, dtype=torch.float64) * 4).to(dt)
    progress = (torch.randn(n, generator=g, dtype=torch.float64) * 1e-2).to(dt)
    dd = delta_dtype(dt)
    assert dd == (torch.float32 if dt in (torch.float16, torch.bfloat16) else dt)

    # No local progress: exactly the average (for full precision where the difference is exact:
    # values within a factor of two of each other, same sign).
    delta = torch.empty(n, dtype=dd)
    compute_delta(avg, snap, delta)
    x = snap.clone()
    apply_delta(x, delta)
    if dt in (torch.float16, torch.bfloat16):
        assert torch.equal(x, avg)
    else:
        s2 = snap.abs() + 1
        a2 = s2 * 1.5
        d2 = torch.empty(n, dtype=dd)
        compute_delta(a2, s2, d2)
        x2 = s2.clone()
        apply_delta(x2, d2)
        assert torch.equal(x2, a2)
        assert torch.allclose(x.double(), avg.double(), rtol=0, atol=4 * torch.finfo(dt).eps * 16)

    # Local progress made since the snapshot is kept: x_new = average + progress, rounded once.
    x = (snap.double() + progress.double()).to(dt)
    compute_delta(avg, snap, delta)
    apply_delta(x, delta)
    expect = ((snap.double() + progress.double()).to(dt).double() + (avg.double() - snap.double()))
    single = expect.to(dt)
    if dt in (torch.float16, torch.bfloat16):
        assert torch.equal(x, single)  # computed in float32, rounded once
    else:
        assert torch.allclose(x.double(), expect, rtol=0, atol=8 * torch.finfo(dt).eps * expect.abs().max())

    # In place on the work buffer (full precision keeps the delta there).
    if dd == dt:
        w = avg.clone()
        compute_delta(w, snap, w)
        assert torch.equal(w, avg - snap)


def test_warmup_is_gradient_allreduce():
    warm = 3
    res = harness.run(rank_warmup, 2, timeout=60, args=(warm,))
    for r, out in enumerate(res):
        assert len(out["async"]) == warm
        for t in range(warm):
            assert harness.compare(out["async"][t], out["gar"][t], exact=True) is None, (r, t)
        assert all(out["local_grad"]), f"rank {r}: after warm-up the gradient is not the local one"
        assert not out["running_after_finish"]
    # The local gradients differ (different data), so nothing averaged them.
    assert not res[0]["grad"].equal(res[1]["grad"])
    # finish() leaves every rank with the same bits.
    assert res[0]["final"].equal(res[1]["final"])


def test_rounds_average_to_the_mean():
    res = harness.run(rank_mean, 4, timeout=60, args=(["float32", "bfloat16", "float16"],))
    for r, out in enumerate(res):
        for name, d in out.items():
            assert d["before"], (r, name)
            assert d["rounds"] >= 1 and d["applied"] >= 1, (r, name, d)
            assert bool((d["after"].double() == 2.5).all()), (r, name)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-arena", "private-buffers"])
def test_delta_rule_keeps_local_progress_end_to_end(shared):
    """Averaging keeps the sum of the replicas: after finish() every rank holds
    w0 - lr/n * sum_r steps_r * g_r (warm-up steps included), whatever the timing. Both round
    implementations: the shared arena with fused passes (ranks on one host, the default) and
    private buffers with a ring allreduce (what other hosts get; forced here by
    RUMOR_SHARED_BUCKETS=0)."""
    import torch

    n, warm, lr = 3, 2, 0.01
    steps = [40, 25, 12]
    sleeps = [0.0, 0.0, 0.025]  # rank 2 is slower than the 10 ms interval: deltas get retaken
    env = None if shared else {"RUMOR_SHARED_BUCKETS": "0"}
    res = harness.run(rank_progress, n, timeout=75, args=(steps, sleeps, warm, lr, 10), env=env)
    w0 = res[0]["w0"]
    grads = [_const_grads(r) for r in range(n)]
    expect = [w - lr / n * sum(steps[r] * grads[r][i] for r in range(n)) for i, w in enumerate(w0)]
    for r, out in enumerate(res):
        assert out["fused"] == shared, (r, out["fused"])
        assert out["in_slot"], f"rank {r}: the parameters are not views into the averaged buffer"
        assert out["steps"] == steps[r]
        assert out["moved_inside"] == 0, f"rank {r}: weights changed during forward/backward"
        assert out["rounds"] >= 1, (r, out["rounds"])
        for a, e in zip(out["final"], expect):
            assert torch.allclose(a, e, rtol=1e-9, atol=1e-12), (r, (a - e).abs().max())
        for a, b in zip(out["final"], res[0]["final"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_delta_rule_keeps_local_progress_with_a_host_mirror(mode):
    """CUDA parameters' form (the averaging thread on a host mirror of the device weights,
    refreshed after each snapshot; results applied to the device weights; the final average
    copied back), emulated on CPU: the same closed form after finish() as above, although
    rounds now average snapshots up to a step old."""
    import torch

    n, warm, lr = 3, 2, 0.01
    steps = [40, 25, 12]
    sleeps = [0.0, 0.0, 0.025]
    res = harness.run(rank_progress, n, timeout=75, args=(steps, sleeps, warm, lr, 10, mode))
    w0 = res[0]["w0"]
    grads = [_const_grads(r) for r in range(n)]
    expect = [w - lr / n * sum(steps[r] * grads[r][i] for r in range(n)) for i, w in enumerate(w0)]
    for r, out in enumerate(res):
        assert out["mirror"] and not out["fused"] and not out["in_slot"], (r, out["mirror"], out["fused"])
        assert out["steps"] == steps[r]
        assert out["moved_inside"] == 0, f"rank {r}: weights changed during forward/backward"
        assert out["rounds"] >= 1 and out["applied"] >= 1, (r, out["rounds"], out["applied"])
        for a, e in zip(out["final"], expect):
            assert torch.allclose(a, e, rtol=1e-9, atol=1e-12), (r, (a - e).abs().max())
        for a, b in zip(out["final"], res[0]["final"]):
            assert torch.equal(a, b)


def test_slow_rank_does_not_hold_back_the_others():
    import torch

    n, fast_steps = 3, 60
    with tempfile.TemporaryDirectory() as d:
        res = harness.run(rank_slow, n, timeout=75, args=(d, fast_steps, 0.01, 0.1))
    fast, slow = res[:-1], res[-1]
    for out in fast:
        assert out["steps"] >= fast_steps
        # The slow rank trained during the same window (until the fast ones were done), at a
        # tenth of their pace: in lockstep it would have done as many steps as they did.
        assert slow["steps"] < out["steps"] / 2, (slow["steps"], out["steps"])
        assert out["rounds"] >= 3
    for out in res:
        # The slow rank learns too: it gets the fast ranks' progress through the averages.
        assert out["loss1"] < 0.5 * out["loss0"], (out["loss0"], out["loss1"])
    # Replicas stay close to each other (relative to the weights' own size) before finish(),
    # and are identical after.
    scale = max(float(out["before"].norm()) for out in res)
    for out in res[1:]:
        assert float((out["before"] - res[0]["before"]).norm()) < 0.5 * scale
        assert torch.equal(out["after"], res[0]["after"])


def test_loss_after_the_same_wall_time_within_10_percent_of_gradient_allreduce():
    """With a straggler, asynchronous averaging reaches (at least) the synchronous loss in the
    same wall time: the issue's bound is 'within 10%'. A loss comparison, not a speed figure."""
    res = harness.run(rank_same_wall_time, 3, timeout=90, args=(2.0, 0.03))
    for r, out in enumerate(res):
        for kind in ("all", "exp2"):
            assert out[kind]["loss"] <= 1.10 * out["gar"]["loss"], (r, kind, out)
    # every rank ends with the same weights, so the same evaluation loss
    for kind in ("gar", "all", "exp2"):
        assert len({round(out[kind]["loss"], 9) for out in res}) == 1, kind


def test_abort_and_resume():
    with tempfile.TemporaryDirectory() as d:
        res = harness.run(rank_abort_resume, 3, timeout=75, args=(d,))
    harness.assert_no_failures(res, "abort/resume")


@pytest.mark.parametrize("shared", [True, False], ids=["shared-arena", "private-buffers"])
def test_abort_keeps_a_waiting_delta(shared):
    env = None if shared else {"RUMOR_SHARED_BUCKETS": "0"}
    with tempfile.TemporaryDirectory() as d:
        res = harness.run(rank_pending_then_abort, 3, timeout=60, args=(d,), env=env)
    assert res[0]["applied_by_abort"] and res[0]["unchanged_before_forward"] and res[0]["applied"] == 1, res[0]
    for r, out in enumerate(res):
        assert out["fused"] == shared, (r, out["fused"])
        assert out["mean"] and out["after"], (r, out)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-arena", "private-buffers"])
def test_abort_waits_for_the_round_in_flight(shared):
    env = None if shared else {"RUMOR_SHARED_BUCKETS": "0"}
    with tempfile.TemporaryDirectory() as d:
        res = harness.run(rank_abort_with_round_in_flight, 2, timeout=60, args=(d,), env=env)
    assert res[0] == {"in_flight": True, "unchanged_after_abort": True, "abort_applied_the_round": True,
                      "after": True}, res[0]
    assert res[1] == {"mean": True, "after": True}, res[1]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_shared_arena_average_into_deltas(dtype):
    """The exchange of the shared-arena rounds: every contributor's delta becomes the mean of the
    contributions minus its weights, a rank sitting out keeps its delta, and a rank bringing an
    unapplied delta contributes x + delta; against a float64 reference (exact here: small
    integers: exact sums, then one rounding for the mean and one for the difference, in the
    buffer's dtype, as in the reference), for a length that does not split evenly into the ranks' blocks."""
    res = harness.run(rank_arena_average, 4, timeout=60, args=(dtype,))
    harness.assert_no_failures(res, "average_into_deltas")


@pytest.mark.parametrize("mode", ["ring", "shift_one", "exp2"])
def test_gossip_modes_mix_and_finish_at_the_mean(mode):
    import torch

    n = 4
    res = harness.run(rank_gossip, n, timeout=90, args=(mode, 4))
    for r, out in enumerate(res):
        assert out["mixed"] >= 4, (r, out["mixed"])
        b = out["before"]
        assert bool((b >= 1).all() and (b <= n).all()), f"rank {r}: outside the hull: {b.min()}..{b.max()}"
        assert not bool((b == r + 1).all()), f"rank {r}: never mixed"
        assert torch.allclose(out["after"].double(), out["mean"], rtol=0, atol=1e-6), r
        assert torch.equal(out["after"], res[0]["after"])
        assert out["windows"] == [], out["windows"]


@pytest.mark.parametrize("how,mode", [("exit", "all"), ("sigkill", "all"), ("exit", "exp2")])
def test_killed_rank_raises_on_the_others(how, mode):
    n, victim, timeout = 3, 2, 10
    res = harness.run(rank_killed, n, timeout=75, env={"RUMOR_TIMEOUT": str(timeout)}, args=(victim, how, mode),
                      may_die=[victim])
    for r, out in enumerate(res):
        if r == victim:
            continue
        assert out["err"] is not None, f"rank {r}: no error after {out['elapsed']:.0f} s"
        assert out["err"][0] in ("PeerError", "CommTimeoutError", "AbortedError"), out["err"]
        assert "AsyncModelAverage" in out["err"][1]
        # Within the deadline (a bound on a hang, not a speed figure).
        assert out["elapsed"] < timeout + 15, out["elapsed"]
        assert out["finish"] in ("PeerError", "CommTimeoutError", "AbortedError"), out["finish"]
