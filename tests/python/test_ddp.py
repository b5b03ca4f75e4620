"""rumor.DistributedDataParallel: equivalence with single-process training and with torch DDP.

Every test spawns its ranks through harness.run (deadline per test; a failing rank fails the
test with its traceback). Each rank calls rumor.init() and then
torch.distributed.init_process_group("gloo"), which shares rumor's TCPStore, so rumor's wrapper
and torch DDP train side by side in the same processes on the same data. Many scenarios run per
spawn (process start-up dominates on a 2-core machine); every mismatch is collected by a
harness.Checker, so one run reports all of them. Each scenario is a test id of its own
(`-k mlp_hier`); the selected scenarios of one launch still share it (harness.batch).

What is compared, and how:
* bitwise (torch.equal): parameters and gradients across ranks (sha256 of every tensor, gathered
  to every rank), parameters right after wrapping (rank 0's), no_sync gradients against a plain
  local copy, num_batches_tracked after the buffer broadcast, state_dict round trips;
* allclose: against single-process training on the concatenated batch (float64, SGD without
  momentum, rtol 1e-9) and against torch DDP with gloo in the same processes.
Reference models are tiny versions of the standard models in rumor.testing.models.
Hierarchical runs on 2 hosts x 2 ranks twice: with RUMOR_HOST_ID on one machine, and in network
namespaces (rumor.testing.netns; ranks started by rumor.testing.launch, results and tracebacks
through harness's rank side; skipped with the reason where namespaces cannot be built).
"""
from __future__ import annotations

import os
import pickle
import sys
import tempfile

import pytest

import harness

LR = 0.1
STEPS = 3
TOL64 = dict(rtol=1e-9, atol=1e-12)   # float64, reductions in a different order
TOL32 = dict(rtol=1e-5, atol=1e-7)
SCALE = {"mlp25m": 1 / 64, "cnn": 1 / 8, "transformer": 1 / 32}
BATCH = {"mlp25m": 4, "cnn": 3, "transformer": 2}
# Small buckets so that even the tiny test models span several buckets (fusion + ordering).
SMALL_BUCKETS = dict(bucket_cap_mb=0.01, first_bucket_mb=0.002)


# ==== inside a rank ===============================================================================

def _init():
    import datetime

    import torch
    import torch.distributed as dist

    import rumor

    torch.set_num_threads(1)
    rumor.init()
    # Shares rumor's TCPStore (multi_tenant), so both libraries live in the same processes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))


def _ctx():
    import torch.distributed as dist

    return dist.get_world_size(), dist.get_rank()


def _build(name, seed, dtype=None, scale=None):
    import torch

    from rumor.testing import models

    return models.build(name, seed=seed, scale=scale or SCALE[name], dtype=dtype or torch.float64)


def _batch(model, step, shard, name=None):
    from rumor.testing import models

    name = name or _name_of(model)
    return models.batch(model, BATCH[name], step=step, shard=shard)


def _name_of(model):
    from rumor.testing import models

    m = getattr(model, "_orig_mod", model)
    return {models.MLP: "mlp25m", models.ResNetSmall: "cnn", models.TokenClassifier: "transformer"}[type(m)]


def _loss(out, y):
    from rumor.testing import models

    return models.loss(out, y)


def _strip(name: str) -> str:
    return name.replace("_orig_mod.", "")


def _params(module):
    return {_strip(n): p.detach().clone() for n, p in module.named_parameters()}


def _grads(module):
    return {_strip(n): (None if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()}


def _buffers(module):
    return {_strip(n): b.detach().clone() for n, b in module.named_buffers()}


def _digest(t) -> str:
    import hashlib

    import torch

    if t is None:
        return "None"
    t = t.detach().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return f"{t.dtype}{tuple(t.shape)}:" + hashlib.sha256(data).hexdigest()


def _same_on_all_ranks(chk, named: dict, what: str) -> None:
    """Every tensor in `named` is bitwise identical on every rank (hashes gathered with gloo)."""
    import torch.distributed as dist

    world, rank = _ctx()
    mine = {n: _digest(t) for n, t in named.items()}
    every = [None] * world
    dist.all_gather_object(every, mine)
    for r in range(1, world):
        diff = sorted(n for n in set(every[0]) | set(every[r]) if every[0].get(n) != every[r].get(n))
        chk.check(not diff, f"{what}: rank {r} differs from rank 0 in {diff[:6]}{' ...' if len(diff) > 6 else ''}")


def _compare(chk, actual: dict, expected: dict, what: str, exact=False, scale=1.0, **tol) -> None:
    """Tensor dicts by name; a missing gradient (None) counts as zeros."""
    import torch

    chk.check(set(actual) == set(expected), f"{what}: names {sorted(set(actual) ^ set(expected))[:6]} differ")
    for n in sorted(set(actual) & set(expected)):
        a, e = actual[n], expected[n]
        if a is None and e is None:
            continue
        if a is None:
            a = torch.zeros_like(e)
        if e is None:
            e = torch.zeros_like(a)
        if scale != 1.0:
            e = e * scale
        if exact:
            chk.equal(a, e, f"{what} [{n}]")
        else:
            chk.close(a, e, f"{what} [{n}]", **(tol or (TOL64 if a.dtype == torch.float64 else TOL32)))


def _check_bucket_views(chk, ddp, what: str, expect_names=None) -> None:
    """Every synchronized gradient is a view into its bucket's flat buffer, at its offset, and
    every trainable (not ignored) parameter is in exactly one bucket."""
    names = []
    for b in ddp.buckets:
        base = b.flat.untyped_storage().data_ptr()
        for p, off, name in zip(b.params, b.offsets, b.names):
            names.append(_strip(name))
            g = p.grad
            ok = (g is not None and g.untyped_storage().data_ptr() == base
                  and g.data_ptr() == b.flat.data_ptr() + off * b.flat.element_size())
            chk.check(ok, f"{what}: {name}.grad is not a view into bucket {b.index} at offset {off}")
    chk.check(len(names) == len(set(names)), f"{what}: a parameter is in two buckets: {names}")
    if expect_names is None:
        expect_names = [_strip(n) for n, p in ddp.module.named_parameters() if p.requires_grad]
    chk.check(sorted(names) == sorted(expect_names),
              f"{what}: buckets hold {sorted(names)}, expected {sorted(expect_names)}")


def _ref_grads(ref, batches, loss_fn=None):
    """Gradients of single-process training on the concatenation of every rank's batch."""
    import torch

    ref.zero_grad(set_to_none=True)
    xs, ys = zip(*batches)
    out = ref(torch.cat(xs))
    (loss_fn or _loss)(out, torch.cat(ys)).backward()
    return _grads(ref)


def _sgd(params, lr=LR):
    import torch

    return torch.optim.SGD(params, lr=lr)


# ---- scenarios (each takes the Checker; all ranks run the same sequence) --------------------------

def sc_equivalence(chk, name="mlp25m", hierarchical=False, average=True, buckets=None, tag="", scale=None):
    """rumor DDP vs single-process training on the concatenated batch vs torch DDP (gloo), with
    rank-dependent initial weights (wrapping must broadcast rank 0's)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import rumor

    world, rank = _ctx()
    what = f"{tag}{name} world={world} hierarchical={hierarchical} average={average}"
    m, tm = _build(name, 10 + rank, scale=scale), _build(name, 10 + rank, scale=scale)
    ref = _build(name, 10, scale=scale)
    alg = rumor.algorithms.GradientAllReduce(hierarchical=hierarchical, average=average)
    ddp = rumor.DistributedDataParallel(m, algorithm=alg, **(buckets if buckets is not None else SMALL_BUCKETS))
    tddp = TorchDDP(tm)
    _compare(chk, _params(m), _params(ref), f"{what}: parameters after wrapping (rank 0's)", exact=True)
    _compare(chk, _buffers(m), _buffers(ref), f"{what}: buffers after wrapping (rank 0's)", exact=True)
    # average=False sums gradients: the same trajectory with lr / world.
    opt = _sgd(ddp.parameters(), LR if average else LR / world)
    topt, ropt = _sgd(tddp.parameters()), _sgd(ref.parameters())
    for step in range(STEPS):
        x, y = _batch(m, step, rank)
        opt.zero_grad(set_to_none=(step % 2 == 0))  # both: .grad replaced, and zeroed in place
        topt.zero_grad()
        loss = _loss(ddp(x), y)
        loss.backward()
        _loss(tddp(x), y).backward()
        rg = _ref_grads(ref, [_batch(ref, step, s) for s in range(world)])
        g = _grads(m)
        _same_on_all_ranks(chk, g, f"{what} step {step}: gradients")
        _check_bucket_views(chk, ddp, f"{what} step {step}")
        _compare(chk, g, rg, f"{what} step {step}: gradients vs single process", scale=1.0 if average else world)
        _compare(chk, g, _grads(tm), f"{what} step {step}: gradients vs torch DDP", scale=1.0 if average else world)
        opt.step()
        topt.step()
        ropt.step()
        _same_on_all_ranks(chk, _params(m), f"{what} step {step}: parameters")
        _compare(chk, _params(m), _params(ref), f"{what} step {step}: parameters vs single process")
        _compare(chk, _params(m), _params(tm), f"{what} step {step}: parameters vs torch DDP")
        chk.check(bool(torch.isfinite(loss)), f"{what} step {step}: loss {loss.item()}")


def sc_default_algorithm(chk):
    """The default algorithm is GradientAllReduce(hierarchical=False, average=True)."""
    import rumor

    m = _build("mlp25m", 1)
    ddp = rumor.DistributedDataParallel(m)
    a = ddp.algorithm
    chk.check(type(a) is rumor.algorithms.GradientAllReduce and a.hierarchical is False and a.average is True,
              f"default algorithm: {type(a).__name__}(hierarchical={getattr(a, 'hierarchical', '?')}, "
              f"average={getattr(a, 'average', '?')})")


def sc_dropped_wrapper_is_freed(chk):
    """A wrapper nobody references any more is freed with its buckets (shared memory on one host),
    although its hooks stay on the parameters and the optimizer (a model re-wrapped in a loop,
    as a grid search does, must not keep every earlier wrapper alive)."""
    import gc
    import weakref

    import torch

    import rumor

    # float64 makes overlap_optimizer take the Python per-bucket step (held by the C++ engine).
    for kw in ({}, {"overlap_optimizer": True}):
        m = _build("mlp25m", 3, scale=1 / 16)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        ddp = rumor.DistributedDataParallel(m, optimizer=opt, **kw)
        for step in range(2):
            x, y = _batch(m, step, rumor.rank(), "mlp25m")
            opt.zero_grad()
            _loss(ddp(x), y).backward()
            opt.step()
        ref = weakref.ref(ddp)
        del ddp
        if kw:
            # overlap_optimizer binds the (fused) optimizer to the wrapper's buckets: the two go together.
            del opt
            gc.collect()
            chk.check(ref() is None, "a dropped DistributedDataParallel and its overlapped optimizer stay alive")
            continue
        gc.collect()
        chk.check(ref() is None, "a dropped DistributedDataParallel stays alive")
        # The parameters and the optimizer (their hooks) outlive the wrapper and still work.
        opt.zero_grad()
        _loss(m(_batch(m, 0, 0, "mlp25m")[0]), _batch(m, 0, 0, "mlp25m")[1]).backward()
        opt.step()


def _two_branch(seed, flip: bool):
    """Two independent branches a, b (each Linear-ReLU-Linear) summed, then a head. `flip`
    evaluates b before a: autograd then produces their gradients in a different order."""
    import torch
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
            self.b = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
            self.head = nn.Linear(8, 4)
            self.flip = flip

        def forward(self, x):
            if self.flip:
                hb = self.b(x)
                ha = self.a(x)
            else:
                ha = self.a(x)
                hb = self.b(x)
            return self.head(ha + hb)

    torch.manual_seed(seed)
    return Net().double()


def _reversed_chain(seed):
    """Layers l0..l3 defined in that order but applied l3 -> l0, so gradients become ready in
    definition order (the opposite of the initial assumption)."""
    import torch
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l0 = nn.Linear(24, 4)
            self.l1 = nn.Linear(24, 24)
            self.l2 = nn.Linear(24, 24)
            self.l3 = nn.Linear(12, 24)

        def forward(self, x):
            return self.l0(torch.relu(self.l1(torch.relu(self.l2(torch.relu(self.l3(x)))))))

    torch.manual_seed(seed)
    return Net().double()


def _xy(step, shard, d_in=16, classes=4, n=4):
    import torch

    g = torch.Generator().manual_seed(1000 * step + shard)
    return (torch.randn(n, d_in, generator=g, dtype=torch.float64), torch.randint(0, classes, (n,), generator=g))


def sc_bucket_rebuild(chk):
    """Buckets are rebuilt after the first iteration in the order gradients became ready (as seen
    by rank 0, so every rank uses the same buckets even when their orders differ)."""
    import torch.nn.functional as F

    import rumor

    world, rank = _ctx()
    # (1) definition order opposite to ready order
    m, ref = _reversed_chain(3), _reversed_chain(3)
    ddp = rumor.DistributedDataParallel(m, bucket_cap_mb=0.004, first_bucket_mb=0.001)
    layer = lambda n: int(n.split(".")[0][1:])  # noqa: E731
    before = [layer(n) for b in ddp.buckets for n in b.names]
    chk.check(before == sorted(before, reverse=True),
              f"rebuild: initial buckets not in reverse definition order: {before}")
    opt, ropt = _sgd(m.parameters()), _sgd(ref.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _xy(step, rank, d_in=12)
        F.cross_entropy(ddp(x), y).backward()
        rg = _ref_grads(ref, [_xy(step, s, d_in=12) for s in range(world)], F.cross_entropy)
        _compare(chk, _grads(m), rg, f"rebuild (reversed chain) step {step}: gradients vs single process")
        _check_bucket_views(chk, ddp, f"rebuild (reversed chain) step {step}")
        after = [layer(n) for b in ddp.buckets for n in b.names]
        chk.check(after == sorted(after) and len(ddp.buckets) > 1,
                  f"rebuild step {step}: buckets not in ready order (l0 first) after the first backward: "
                  f"{after} in {len(ddp.buckets)} bucket(s)")
        opt.step()
        ropt.step()
    _compare(chk, _params(m), _params(ref), "rebuild (reversed chain): parameters vs single process")
    _same_on_all_ranks(chk, _params(m), "rebuild (reversed chain): parameters")

    # (2) ranks whose ready orders differ: they must agree on one bucket layout
    orders = {}
    for flip in (False, True):  # precondition: `flip` really changes the order gradients arrive in
        probe, seen = _two_branch(4, flip), []
        for n, p in probe.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _p, n=n: seen.append(n))
        F.cross_entropy(probe(_xy(0, 0)[0]), _xy(0, 0)[1]).backward()
        orders[flip] = seen
    chk.check(orders[False] != orders[True], f"test precondition: both branch orders give ready order {orders[False]}")
    m, ref = _two_branch(4, flip=(rank % 2 == 1)), _two_branch(4, flip=False)
    ddp = rumor.DistributedDataParallel(m, bucket_cap_mb=0.003, first_bucket_mb=0.001)
    opt, ropt = _sgd(m.parameters()), _sgd(ref.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _xy(step, rank)
        F.cross_entropy(ddp(x), y).backward()
        rg = _ref_grads(ref, [_xy(step, s) for s in range(world)], F.cross_entropy)
        _compare(chk, _grads(m), rg, f"rebuild (two branches, rank-dependent order) step {step}: gradients")
        _same_on_all_ranks(chk, {"layout": _layout_tensor(ddp)}, f"two branches step {step}: bucket layout")
        opt.step()
        ropt.step()
    _compare(chk, _params(m), _params(ref), "rebuild (two branches): parameters vs single process")
    _same_on_all_ranks(chk, _params(m), "rebuild (two branches): parameters")


def sc_overlap(chk):
    """Buckets are communicated during backward: when autograd reaches the first layer, the last
    layer's bucket already holds the averaged gradient (waited for, with a deadline, inside a
    backward pre-hook of the first layer; if communication only started at the end of
    backward, the condition could not become true there)."""
    import time

    import torch

    import rumor

    world, rank = _ctx()
    m, ref = _build("mlp25m", 90), _build("mlp25m", 90)
    ddp = rumor.DistributedDataParallel(m, **SMALL_BUCKETS)
    last = m.net[4].weight
    last_index = [i for i, p in enumerate(ddp._params) if p is last][0]
    chk.check(ddp.last_iteration_timeline() is None, "timeline before any iteration")
    wait_s = 20.0
    for step in range(2):
        x, y = _batch(m, step, rank)
        expected = _ref_grads(ref, [_batch(ref, step, s) for s in range(world)])["net.4.weight"]
        seen = {}

        def pre_hook(module, grad_output):
            deadline = time.monotonic() + wait_s
            while True:
                g = last.grad
                if g is not None and torch.allclose(g, expected, rtol=1e-9, atol=1e-12):
                    seen["ok"] = True
                    return None
                if time.monotonic() > deadline:
                    seen["ok"] = False
                    return None
                time.sleep(0.001)

        h = m.net[0].register_full_backward_pre_hook(pre_hook)
        m.zero_grad()
        _loss(ddp(x), y).backward()
        h.remove()
        chk.check(seen.get("ok") is True, f"overlap step {step}: the last layer's gradient was not averaged while "
                                          f"backward was still running ({seen})")
        _check_timeline(chk, ddp, f"overlap step {step}", sum(p.numel() for p in m.parameters()))
        if seen.get("ok") is True and step >= 1 and world > 1:  # step 0's buckets are rebuilt after it
            # The pre-hook saw the average before the first layer's backward, so that bucket's op
            # must have started before backward's computation ended. (Not that it ended: peers can
            # deliver the average before this rank's op returns from its closing barrier.) On one
            # rank the average is the local gradient, so seeing it proves nothing about the op.
            tl = ddp.last_iteration_timeline()
            b = [x for x in tl["buckets"] if x["bucket"] == ddp._bucket_of[last_index]][0]
            chk.check(b["start"] <= tl["backward_compute_end"],
                      f"overlap step {step}: timeline has the last layer's bucket starting at {b['start']:.4f} s, "
                      f"after backward's computation ({tl['backward_compute_end']:.4f} s)")
        if seen.get("ok") is not True:
            wait_s = 0.0  # failed once: do not wait again (every rank still runs every step)
        _compare(chk, _grads(m), _grads(ref), f"overlap step {step}: gradients vs single process")
        with torch.no_grad():
            for p, q in zip(m.parameters(), ref.parameters()):
                p.sub_(LR * p.grad)
                q.sub_(LR * q.grad)


def _check_timeline(chk, ddp, what: str, elements: int) -> None:
    """last_iteration_timeline() is ordered (forward, each bucket's ready <= start <= end, backward)
    and covers every bucket once, whose elements add up to the model's."""
    tl = ddp.last_iteration_timeline()
    chk.check(tl is not None, f"{what}: no timeline after an iteration")
    if tl is None:
        return
    bs = tl["buckets"]
    # (the layout of the iteration itself: the first one's buckets are rebuilt right after it)
    chk.check([b["bucket"] for b in bs] == list(range(len(bs))), f"{what}: timeline buckets {[b['bucket'] for b in bs]}")
    chk.check(sum(b["elements"] for b in bs) == elements, f"{what}: timeline covers {sum(b['elements'] for b in bs)} "
                                                          f"elements, the model has {elements}")
    chk.check(0 <= tl["module_start"] <= tl["forward_end"] <= tl["backward_compute_end"] <= tl["backward_end"],
              f"{what}: {tl}")
    for b in bs:
        chk.check(tl["forward_end"] <= b["ready"] <= b["start"] <= b["end"] <= tl["backward_end"],
                  f"{what}: bucket {b}, timeline {tl}")
    chk.check(abs(tl["exposed_comm"] - (tl["backward_end"] - tl["backward_compute_end"])) < 1e-9
              and abs(tl["comm_busy"] - sum(b["end"] - b["start"] for b in bs)) < 1e-9, f"{what}: {tl}")
    chk.check(0 <= tl["after_backward"] and tl["backward_end"] <= tl["after_backward_end"] - tl["after_backward"] + 1e-9,
              f"{what}: {tl}")


def _layout_tensor(ddp):
    import zlib

    import torch

    s = "|".join(",".join(b.names) for b in ddp.buckets)
    return torch.tensor([zlib.crc32(s.encode()), len(ddp.buckets)], dtype=torch.int64)


def sc_mixed_dtypes(chk):
    """A float64 layer feeding a float32 layer: one bucket per dtype, each averaged correctly."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import rumor

    world, rank = _ctx()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 32).double()
            self.b = nn.Linear(32, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)).float())

    def make(seed):
        torch.manual_seed(seed)
        return Net()

    m, tm, ref = make(11 + rank), make(11 + rank), make(11)
    ddp = rumor.DistributedDataParallel(m, bucket_cap_mb=0.002, first_bucket_mb=0.001)
    tddp = TorchDDP(tm)
    opt, topt, ropt = _sgd(ddp.parameters()), _sgd(tddp.parameters()), _sgd(ref.parameters())
    # (float32 tolerances throughout: the float64 layer's gradients pass through the float32 one)
    for step in range(STEPS):
        opt.zero_grad()
        topt.zero_grad()
        x, y = _xy(step, rank)
        F.cross_entropy(ddp(x), y).backward()
        F.cross_entropy(tddp(x), y).backward()
        rg = _ref_grads(ref, [_xy(step, s) for s in range(world)], F.cross_entropy)
        g = _grads(m)
        for b in ddp.buckets:
            chk.check(len({p.dtype for p in b.params}) == 1 and b.flat.dtype == b.params[0].dtype,
                      f"mixed dtypes: bucket {b.index} holds {[p.dtype for p in b.params]} in a {b.flat.dtype} buffer")
        _check_bucket_views(chk, ddp, f"mixed dtypes step {step}")
        _same_on_all_ranks(chk, g, f"mixed dtypes step {step}: gradients")
        _compare(chk, g, rg, f"mixed dtypes step {step}: gradients vs single process", **TOL32)
        _compare(chk, g, _grads(tm), f"mixed dtypes step {step}: gradients vs torch DDP", **TOL32)
        opt.step()
        topt.step()
        ropt.step()
    _compare(chk, _params(m), _params(ref), "mixed dtypes: parameters vs single process", **TOL32)
    _same_on_all_ranks(chk, _params(m), "mixed dtypes: parameters")


def sc_no_sync(chk):
    """Gradient accumulation: backward passes inside no_sync() stay local (bitwise equal to a
    plain local model); the first one outside averages the accumulated sum."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import rumor

    world, rank = _ctx()
    K = 3  # micro-batches per step, the first K-1 under no_sync
    m, tm, ref, local = _build("mlp25m", 30), _build("mlp25m", 30), _build("mlp25m", 30), _build("mlp25m", 30)
    ddp = rumor.DistributedDataParallel(m, **SMALL_BUCKETS)
    tddp = TorchDDP(tm)
    opt, topt, ropt = _sgd(ddp.parameters()), _sgd(tddp.parameters()), _sgd(ref.parameters())
    for step in range(2):
        opt.zero_grad(set_to_none=(step == 0))
        topt.zero_grad()
        local.load_state_dict(m.state_dict())
        local.zero_grad(set_to_none=True)
        for k in range(K - 1):
            x, y = _batch(m, step * K + k, rank)
            with ddp.no_sync():
                _loss(ddp(x), y).backward()
            with tddp.no_sync():
                _loss(tddp(x), y).backward()
            _loss(local(x), y).backward()
        _compare(chk, _grads(m), _grads(local), f"no_sync step {step}: accumulated gradients stay local", exact=True)
        x, y = _batch(m, step * K + K - 1, rank)
        _loss(ddp(x), y).backward()
        _loss(tddp(x), y).backward()
        # reference: the sum over micro-batches of the gradient on every rank's micro-batch
        ref.zero_grad()
        import torch

        for k in range(K):
            xs, ys = zip(*[_batch(ref, step * K + k, s) for s in range(world)])
            _loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        g = _grads(m)
        _same_on_all_ranks(chk, g, f"no_sync step {step}: gradients")
        _compare(chk, g, _grads(ref), f"no_sync step {step}: gradients vs single process")
        _compare(chk, g, _grads(tm), f"no_sync step {step}: gradients vs torch DDP")
        _check_bucket_views(chk, ddp, f"no_sync step {step}")
        opt.step()
        topt.step()
        ropt.step()
    _compare(chk, _params(m), _params(ref), "no_sync: parameters vs single process")
    _compare(chk, _params(m), _params(tm), "no_sync: parameters vs torch DDP")
    _same_on_all_ranks(chk, _params(m), "no_sync: parameters")


def _branchy(seed):
    """An MLP with an optional residual branch `extra` (used or not, per call)."""
    import torch
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.extra = nn.Linear(32, 32)
            self.fc2 = nn.Linear(32, 32)
            self.head = nn.Linear(32, 4)

        def forward(self, x, use_extra=True):
            h = torch.relu(self.fc1(x))
            if use_extra:
                h = h + torch.tanh(self.extra(h))
            return self.head(torch.relu(self.fc2(h)))

    torch.manual_seed(seed)
    return Net().double()


def sc_unused(chk):
    """find_unused_parameters=True with a branch that some, all or no ranks use in a step; and
    the clear error (not a hang) without it, after which training goes on."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import rumor

    world, rank = _ctx()
    usage = [lambda r: r == 0, lambda r: True, lambda r: False, lambda r: r == world - 1, lambda r: r % 2 == 1]
    m, tm, ref = _branchy(5), _branchy(5), _branchy(5)
    ddp = rumor.DistributedDataParallel(m, find_unused_parameters=True, bucket_cap_mb=0.004,
                                        first_bucket_mb=0.001)
    tddp = TorchDDP(tm, find_unused_parameters=True)
    opt, topt, ropt = _sgd(ddp.parameters()), _sgd(tddp.parameters()), _sgd(ref.parameters())
    for step, used in enumerate(usage):
        opt.zero_grad()
        topt.zero_grad()
        x, y = _xy(step, rank)
        F.cross_entropy(ddp(x, used(rank)), y).backward()
        F.cross_entropy(tddp(x, used(rank)), y).backward()
        ref.zero_grad()
        # reference: the mean over ranks of each rank's loss, each with its own branch choice
        total = sum(F.cross_entropy(ref(_xy(step, s)[0], used(s)), _xy(step, s)[1]) for s in range(world))
        (total / world).backward()
        g = _grads(m)
        _same_on_all_ranks(chk, g, f"unused step {step}: gradients")
        _compare(chk, g, _grads(ref), f"unused step {step}: gradients vs single process")
        _compare(chk, g, _grads(tm), f"unused step {step}: gradients vs torch DDP")
        opt.step()
        topt.step()
        ropt.step()
        _compare(chk, _params(m), _params(ref), f"unused step {step}: parameters vs single process")
        _compare(chk, _params(m), _params(tm), f"unused step {step}: parameters vs torch DDP")
    _same_on_all_ranks(chk, _params(m), "unused: parameters")

    # Without find_unused_parameters: an unused parameter is an error on every rank...
    m2, ref2 = _branchy(6), _branchy(6)
    ddp2 = rumor.DistributedDataParallel(m2, bucket_cap_mb=0.004, first_bucket_mb=0.001)
    x, y = _xy(50, rank)
    err = chk.raises(RuntimeError, lambda: F.cross_entropy(ddp2(x, False), y).backward(),
                     "unused parameter without find_unused_parameters", match="find_unused_parameters")
    if err is not None:
        chk.check("extra" in str(err), f"the unused-parameter error does not name the parameter: {err}")
    # ... and the wrapper still works afterwards (every rank went through the same collectives).
    opt2 = _sgd(m2.parameters())
    opt2.zero_grad(set_to_none=True)
    for step in (51, 52):
        x, y = _xy(step, rank)
        F.cross_entropy(ddp2(x, True), y).backward()
        rg = _ref_grads(ref2, [_xy(step, s) for s in range(world)], F.cross_entropy)
        # (no optimizer step is taken here: m2 keeps ref2's weights, only gradients are compared)
        _compare(chk, _grads(m2), rg, f"after the unused-parameter error, step {step}: gradients")
        opt2.zero_grad(set_to_none=True)


def sc_frozen_and_ignored(chk):
    """Parameters with requires_grad=False are broadcast at wrap but never averaged nor updated;
    names in _ddp_params_and_buffers_to_ignore are neither broadcast nor averaged (as torch DDP)."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import rumor

    world, rank = _ctx()
    ignore = ["net.2.bias", "net.4.weight"]

    def make(seed):
        mod = _build("mlp25m", seed)
        mod.net[0].weight.requires_grad_(False)
        mod._ddp_params_and_buffers_to_ignore = list(ignore)
        return mod

    m, tm, own, r0 = make(40 + rank), make(40 + rank), make(40 + rank), make(40)
    ddp = rumor.DistributedDataParallel(m, **SMALL_BUCKETS)
    tddp = TorchDDP(tm)
    p, p_own, p_r0 = _params(m), _params(own), _params(r0)
    for n in p:
        chk.equal(p[n], p_own[n] if n in ignore else p_r0[n],
                  f"frozen/ignored: {n} after wrapping ({'own' if n in ignore else 'rank 0'}'s)")
    frozen_before = m.net[0].weight.detach().clone()
    opt = _sgd([q for q in ddp.parameters() if q.requires_grad])
    topt = _sgd([q for q in tddp.parameters() if q.requires_grad])
    for step in range(STEPS):
        opt.zero_grad()
        topt.zero_grad()
        x, y = _batch(m, step, rank)
        _loss(ddp(x), y).backward()
        _loss(tddp(x), y).backward()
        g = _grads(m)
        chk.check(g["net.0.weight"] is None, f"frozen/ignored step {step}: the frozen parameter got a gradient")
        _same_on_all_ranks(chk, {n: t for n, t in g.items() if n not in ignore},
                           f"frozen/ignored step {step}: gradients")
        _compare(chk, g, _grads(tm), f"frozen/ignored step {step}: gradients vs torch DDP")
        _check_bucket_views(chk, ddp, f"frozen/ignored step {step}",
                            expect_names=[n for n, q in m.named_parameters() if q.requires_grad and n not in ignore])
        opt.step()
        topt.step()
        _compare(chk, _params(m), _params(tm), f"frozen/ignored step {step}: parameters vs torch DDP")
    chk.equal(m.net[0].weight.detach(), frozen_before, "frozen/ignored: the frozen parameter changed")
    _same_on_all_ranks(chk, {n: t for n, t in _params(m).items() if n not in ignore}, "frozen/ignored: parameters")


def sc_autocast(chk):
    """Forward under torch.autocast (bf16 on CPU), float32 parameters."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import rumor

    world, rank = _ctx()
    m, tm, ref = (_build("mlp25m", 50, torch.float32) for _ in range(3))
    ddp = rumor.DistributedDataParallel(m, **SMALL_BUCKETS)
    tddp = TorchDDP(tm)
    opt, topt, ropt = _sgd(ddp.parameters()), _sgd(tddp.parameters()), _sgd(ref.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        topt.zero_grad()
        x, y = _batch(m, step, rank)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ddp(x)
            tout = tddp(x)
        chk.check(out.dtype == torch.bfloat16, f"autocast: output dtype {out.dtype}")
        _loss(out, y).backward()
        _loss(tout, y).backward()
        g = _grads(m)
        chk.check(all(t.dtype == torch.float32 for t in g.values()), "autocast: gradients are not float32")
        _same_on_all_ranks(chk, g, f"autocast step {step}: gradients")
        # Identical local bf16 math; only the order of the float32 averaging differs.
        _compare(chk, g, _grads(tm), f"autocast step {step}: gradients vs torch DDP", rtol=1e-5, atol=1e-7)
        if step == 0:
            # The concatenated batch in one bf16 matmul rounds differently: a loose check.
            with torch.autocast("cpu", dtype=torch.bfloat16):
                rg = _ref_grads(ref, [_batch(ref, step, s) for s in range(world)])
            _compare(chk, g, rg, f"autocast step {step}: gradients vs single process (concatenated batch)",
                     rtol=5e-2, atol=2e-3)
        # Single process, one bf16 forward per shard (the same rounding as each rank), gradients
        # accumulated with loss / world (exact: world is a power of two): a tight check.
        ref.zero_grad(set_to_none=True)
        for s in range(world):
            xs, ys = _batch(ref, step, s)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = ref(xs)
            (_loss(out, ys) / world).backward()
        _compare(chk, g, _grads(ref), f"autocast step {step}: gradients vs single process (per-shard forward)",
                 rtol=1e-5, atol=1e-7)
        opt.step()
        topt.step()
        ropt.step()
    _compare(chk, _params(m), _params(tm), "autocast: parameters vs torch DDP", rtol=1e-5, atol=1e-7)
    _compare(chk, _params(m), _params(ref), "autocast: parameters vs single process", rtol=1e-5, atol=1e-7)
    _same_on_all_ranks(chk, _params(m), "autocast: parameters")


def sc_buffers(chk):
    """BatchNorm buffers: broadcast from rank 0 at wrap, and before every training forward when
    broadcast_buffers (as torch DDP); kept local otherwise. Checked exactly through
    num_batches_tracked and against torch DDP for everything."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import rumor

    world, rank = _ctx()
    for bb in (True, False):
        what = f"buffers (broadcast_buffers={bb})"
        m, tm, r0 = _build("cnn", 60 + rank), _build("cnn", 60 + rank), _build("cnn", 60)
        for mod in (m, tm):  # rank-dependent buffers before wrapping
            for b in mod.buffers():
                b.add_(rank + 1)
        for b in r0.buffers():
            b.add_(1)
        ddp = rumor.DistributedDataParallel(m, broadcast_buffers=bb, **SMALL_BUCKETS)
        tddp = TorchDDP(tm, broadcast_buffers=bb)
        if not bb:
            # torch DDP broadcasts buffers at construction only with broadcast_buffers=True; rumor
            # always does (the issue: "parameters and buffers are broadcast when wrapping").
            # Give the torch copy the same start, so the steps below compare like with like.
            with torch.no_grad():
                for tb, b in zip(tm.buffers(), m.buffers()):
                    tb.copy_(b)
        _compare(chk, _buffers(m), _buffers(r0), f"{what}: buffers after wrapping (rank 0's)", exact=True)
        bns = [mod for mod in m.modules() if isinstance(mod, torch.nn.BatchNorm2d)]
        tbns = [mod for mod in tm.modules() if isinstance(mod, torch.nn.BatchNorm2d)]
        opt, topt = _sgd(ddp.parameters()), _sgd(tddp.parameters())
        for step in range(STEPS):
            for bn in bns + tbns:  # make the ranks' buffers differ before every forward
                bn.num_batches_tracked.fill_(100 * rank + 7)
                bn.running_mean.add_(0.5 * rank)
            opt.zero_grad()
            topt.zero_grad()
            x, y = _batch(m, step, rank)
            _loss(ddp(x), y).backward()
            _loss(tddp(x), y).backward()
            want = 7 + 1 if bb else 100 * rank + 7 + 1
            for i, bn in enumerate(bns):
                chk.check(int(bn.num_batches_tracked) == want,
                          f"{what} step {step}: bn{i}.num_batches_tracked = {int(bn.num_batches_tracked)}, "
                          f"expected {want}")
            _compare(chk, _buffers(m), _buffers(tm), f"{what} step {step}: buffers vs torch DDP")
            _compare(chk, _grads(m), _grads(tm), f"{what} step {step}: gradients vs torch DDP")
            _same_on_all_ranks(chk, _grads(m), f"{what} step {step}: gradients")
            opt.step()
            topt.step()
        _compare(chk, _params(m), _params(tm), f"{what}: parameters vs torch DDP")
        _same_on_all_ranks(chk, _params(m), f"{what}: parameters")
        # Eval mode: the forward neither updates nor needs to synchronize statistics.
        ddp.eval()
        with torch.no_grad():
            ddp(_batch(m, 99, rank)[0])
        ddp.train()


def sc_state_dict(chk):
    """state_dict() has torch DDP's keys ("module." + the module's) and round-trips exactly (also
    through torch.save); the module's own keys load too; attributes are not forwarded to the
    module (as in torch DDP); train()/eval() reach the module. Interchange with torch DDP's
    checkpoints: test_ddp_torch_parity.py."""
    import copy
    import io

    import torch

    import rumor

    world, rank = _ctx()
    m = _build("cnn", 70)
    m.custom_tag = "hello"
    ddp = rumor.DistributedDataParallel(m, **SMALL_BUCKETS)
    keys, mkeys = list(ddp.state_dict().keys()), list(m.state_dict().keys())
    chk.check(keys == ["module." + k for k in mkeys], f"state_dict keys {keys[:4]}... are not 'module.' + the "
              f"module's {mkeys[:4]}...")
    # attributes stay the module's, train()/eval()
    chk.raises(AttributeError, lambda: ddp.custom_tag, "an attribute of the module only", match="use .module.custom_tag")
    chk.check(ddp.module.fc is m.fc, "ddp.module is the module")
    chk.raises(AttributeError, lambda: ddp.no_such_attribute_xyz, "a missing attribute")
    ddp.eval()
    chk.check(not m.training and not any(mod.training for mod in m.modules()), "ddp.eval() did not reach the module")
    ddp.train()
    chk.check(m.training and all(mod.training for mod in m.modules()), "ddp.train() did not reach the module")

    opt = _sgd(ddp.parameters())

    def step(s):
        opt.zero_grad()
        x, y = _batch(m, s, rank)
        _loss(ddp(x), y).backward()
        opt.step()

    step(0)
    saved = copy.deepcopy(ddp.state_dict())
    buf = io.BytesIO()
    torch.save(ddp.state_dict(), buf)
    step(1)
    step(2)
    after_a = copy.deepcopy(ddp.state_dict())
    buf.seek(0)
    res = ddp.load_state_dict(torch.load(buf))
    chk.check(not res.missing_keys and not res.unexpected_keys, f"load_state_dict: {res}")
    _compare(chk, dict(ddp.state_dict()), saved, "state_dict round trip through torch.save", exact=True)
    step(1)
    step(2)
    _compare(chk, dict(ddp.state_dict()), after_a, "training again after load_state_dict", exact=True)
    plain = _build("cnn", 71)
    plain.load_state_dict(ddp.module.state_dict())  # strict: the plain module accepts the keys
    _compare(chk, _params(plain), _params(m), "state_dict loaded into a plain module", exact=True)
    _same_on_all_ranks(chk, _params(m), "state_dict: parameters")


def sc_compile(chk):
    """torch.compile: rumor DDP around a compiled module, and a compiled rumor DDP. Graph breaks
    are fine; results must match single-process training."""
    import torch

    import rumor

    world, rank = _ctx()
    for how in ("wrap compiled module", "compile the wrapper"):
        m, ref = _build("mlp25m", 80), _build("mlp25m", 80)
        if how == "wrap compiled module":
            ddp = rumor.DistributedDataParallel(torch.compile(m), **SMALL_BUCKETS)
            run = ddp
        else:
            ddp = rumor.DistributedDataParallel(m, **SMALL_BUCKETS)
            run = torch.compile(ddp)
        opt, ropt = _sgd(ddp.parameters()), _sgd(ref.parameters())
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _batch(m, step, rank)
            _loss(run(x), y).backward()
            rg = _ref_grads(ref, [_batch(ref, step, s) for s in range(world)])
            g = _grads(m)
            _same_on_all_ranks(chk, g, f"compile ({how}) step {step}: gradients")
            _compare(chk, g, rg, f"compile ({how}) step {step}: gradients vs single process")
            opt.step()
            ropt.step()
        _compare(chk, _params(m), _params(ref), f"compile ({how}): parameters vs single process")
        _same_on_all_ranks(chk, _params(m), f"compile ({how}): parameters")


def sc_errors_after_init(chk):
    """Sparse gradients, and models that differ across ranks: clear errors at wrap, on every
    rank, no hang; afterwards the ranks can still train together."""
    import torch
    import torch.nn as nn

    import rumor

    world, rank = _ctx()

    class SparseEmb(nn.Module):
        def __init__(self, cls):
            super().__init__()
            self.emb = cls(50, 8, sparse=True)
            self.fc = nn.Linear(8, 2)

    for cls in (nn.Embedding, nn.EmbeddingBag):
        chk.raises(NotImplementedError, lambda: rumor.DistributedDataParallel(SparseEmb(cls)),
                   f"wrapping a model with {cls.__name__}(sparse=True)", match="sparse")

    # Parameter shapes differ on the last rank (one host with 1 rank: nothing to differ from).
    if world > 1:
        def differ_shape():
            d = 16 if rank != world - 1 else 17
            return nn.Sequential(nn.Linear(d, 8), nn.Linear(8, 2))

        def differ_count():
            layers = [nn.Linear(16, 8), nn.Linear(8, 2)] + ([nn.Linear(2, 2)] if rank == 0 else [])
            return nn.Sequential(*layers)

        for make, what in ((differ_shape, "shapes"), (differ_count, "number of parameters")):
            chk.raises(ValueError, lambda: rumor.DistributedDataParallel(make()),
                       f"models whose {what} differ across ranks", match="differ")

    # After the errors: a normal model trains correctly.
    sc_equivalence(chk, "mlp25m", tag="after the error cases: ")


def errors_rank():
    """Wrapping before rumor.init() (in a fresh process), then the error cases after init."""
    import torch

    import rumor

    chk = harness.Checker()
    chk.raises(RuntimeError, lambda: rumor.DistributedDataParallel(torch.nn.Linear(2, 2)),
               "wrapping before rumor.init()", match="rumor.init")
    _init()
    sc_errors_after_init(chk)
    _finish()
    return chk.failures, chk.count


def sparse_functional_rank():
    """A parameter that receives a sparse gradient through F.embedding(..., sparse=True) (no
    module with sparse=True to find at wrap time): backward raises NotImplementedError on every
    rank, whether or not .grad already existed."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import rumor

    _init()
    chk = harness.Checker()
    rank = rumor.rank()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.table = nn.Parameter(torch.randn(10, 3))
            self.fc = nn.Linear(3, 2)

        def forward(self, idx):
            return self.fc(F.embedding(idx, self.table, sparse=True))

    for case in ("first backward after wrapping", "after zero_grad(set_to_none=True)"):
        m = Net()
        ddp = rumor.DistributedDataParallel(m)
        if case.startswith("after"):
            m.zero_grad(set_to_none=True)
        chk.raises(NotImplementedError, lambda: ddp(torch.tensor([rank, rank + 1])).sum().backward(),
                   f"sparse gradient from F.embedding(sparse=True), {case}", match="sparse")
    return chk.failures, chk.count


def _finish():
    import torch.distributed as dist

    import rumor

    dist.barrier()
    rumor.barrier()


SCENARIOS = {
    "default_algorithm": lambda chk: sc_default_algorithm(chk),
    "mlp": lambda chk: sc_equivalence(chk, "mlp25m"),
    "mlp_sum": lambda chk: sc_equivalence(chk, "mlp25m", average=False),
    "mlp_hier": lambda chk: sc_equivalence(chk, "mlp25m", hierarchical=True),
    "mlp_big_buckets": lambda chk: sc_equivalence(chk, "mlp25m", buckets={}, tag="default bucket sizes: "),
    "transformer": lambda chk: sc_equivalence(chk, "transformer"),
    # ~330k float64 parameters in ~1 MB buckets: the large-message (ring / hierarchical) paths.
    "mlp_medium": lambda chk: sc_equivalence(chk, "mlp25m", scale=1 / 8, tag="medium: ",
                                             buckets=dict(bucket_cap_mb=1, first_bucket_mb=0.25)),
    "mlp_medium_hier": lambda chk: sc_equivalence(chk, "mlp25m", scale=1 / 8, hierarchical=True, tag="medium: ",
                                                  buckets=dict(bucket_cap_mb=1, first_bucket_mb=0.25)),
    "mixed_dtypes": sc_mixed_dtypes,
    "rebuild": sc_bucket_rebuild,
    "overlap": sc_overlap,
    "no_sync": sc_no_sync,
    "unused": sc_unused,
    "frozen_ignored": sc_frozen_and_ignored,
    "autocast": sc_autocast,
    "buffers": sc_buffers,
    "state_dict": sc_state_dict,
    "compile": sc_compile,
    "dropped_wrapper": sc_dropped_wrapper_is_freed,
}


def scenarios_rank(names, expect_hosts=None):
    """Runs the named scenarios in order; returns the topology check's (failures, count) and
    {name: (failures, count)}."""
    import rumor

    _init()
    chk = harness.Checker()
    if expect_hosts is not None:
        hosts, per = expect_hosts
        chk.check(rumor.machine_size() == hosts and rumor.local_size() == per,
                  f"topology: machine_size {rumor.machine_size()}, local_size {rumor.local_size()}, "
                  f"expected {hosts} hosts x {per}")
    topology = (chk.failures[:], chk.count)
    out = harness.run_scenarios(chk, names, SCENARIOS)
    _finish()
    return topology, out


# ==== the tests ===================================================================================

ALL = ["default_algorithm", "mlp", "mlp_sum", "mlp_hier", "mlp_big_buckets", "transformer", "mlp_medium",
       "mixed_dtypes", "rebuild", "overlap", "no_sync",
       "unused", "frozen_ignored", "autocast", "buffers", "state_dict", "dropped_wrapper"]


def _scenario(results, name, what):
    """Asserts the topology check and scenario `name` of a scenarios_rank launch; returns the
    scenario's number of checks."""
    __tracebackhide__ = True
    harness.assert_no_failures([r[0] for r in results], what)
    return harness.assert_no_failures(harness.scenario_results([r[1] for r in results], name), f"{what}: {name}")


EQUIVALENCE = [(world, name) for world in (1, 2, 4) for name in ALL + (["compile"] if world == 2 else [])]


@pytest.mark.parametrize("world,scenario", EQUIVALENCE, ids=[f"{w}ranks-{n}" for w, n in EQUIVALENCE])
def test_equivalence_and_features(world, scenario, request, batches):
    """Every scenario on 1, 2 and 4 ranks of one host (torch.compile on 2: it costs seconds). The
    selected scenarios of one world size run in one launch."""
    def launch():
        names = harness.selected(request, "scenario")
        res = harness.run(scenarios_rank, world, timeout=170, args=(names,))
        if set(names) >= set(ALL):  # the whole batch: it checked a lot
            assert sum(c for r in res for _, c in r[1].values()) > 100
        return res

    res = harness.batch(batches, ("equivalence", world), launch)
    assert _scenario(res, scenario, f"rumor DDP on {world} rank(s)") > 0


def test_error_cases():
    res = harness.run(errors_rank, 2, timeout=90)
    harness.assert_no_failures(res, "error cases")


def test_sparse_gradient_without_sparse_module():
    res = harness.run(sparse_functional_rank, 2, timeout=60)
    harness.assert_no_failures(res, "sparse gradients")


HIER = ["mlp", "mlp_hier", "mlp_big_buckets", "mlp_medium", "mlp_medium_hier", "no_sync", "unused", "buffers"]


@pytest.mark.parametrize("scenario", HIER)
def test_hierarchical_two_hosts_by_host_id(scenario, request, batches):
    """2 hosts x 2 ranks on one machine: RUMOR_HOST_ID makes rumor treat ranks 0,1 and 2,3 as two
    hosts (shared memory inside, TCP between), so hierarchical=True really runs intra-host
    reduce, leader allreduce and intra-host broadcast."""
    rank_env = [{"RUMOR_HOST_ID": h} for h in ("hA", "hA", "hB", "hB")]
    res = harness.batch(batches, "host id", lambda: harness.run(
        scenarios_rank, 4, timeout=150, rank_env=rank_env, args=(harness.selected(request, "scenario"), (2, 2))))
    _scenario(res, scenario, "hierarchical, RUMOR_HOST_ID hA,hA,hB,hB")


@pytest.mark.parametrize("scenario", HIER)
def test_hierarchical_two_emulated_hosts(scenario, request, batches):
    """The same on 2 emulated hosts (network namespaces, rumor.testing.netns) x 2 ranks."""
    from rumor.testing import launch, netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(f"emulated hosts need Linux network namespaces: {why}")
    res = harness.batch(batches, "netns", lambda: _run_in_cluster(
        scenarios_rank, hosts=2, ranks_per_host=2, timeout=150, args=(harness.selected(request, "scenario"), (2, 2)),
        launch=launch, netns=netns))
    _scenario(res, scenario, "hierarchical, 2 emulated hosts x 2 ranks")


def _run_in_cluster(fn, hosts, ranks_per_host, timeout, args, launch, netns):
    """harness.run for ranks inside network namespaces: the rank side is harness's (its boot
    line and result pickles), the processes come from rumor.testing.launch."""
    __tracebackhide__ = True
    world = hosts * ranks_per_host
    workdir = tempfile.mkdtemp(prefix="rumor-ddp-netns-")
    outs = []
    for r in range(world):
        spec = os.path.join(workdir, f"spec{r}.pkl")
        out = os.path.join(workdir, f"result{r}.pkl")
        with open(spec, "wb") as f:
            pickle.dump(dict(module=fn.__module__, name=fn.__qualname__, args=tuple(args), out=out,
                             dump_after=max(1.0, timeout - 4.0)), f)
        outs.append(out)
    # Every rank runs the same command; it picks its own spec by RANK.
    shim = ("import os, sys; r = int(os.environ['RANK']); sys.path.insert(0, {here!r}); import harness; "
            "harness._child_main(os.path.join({wd!r}, f'spec{{r}}.pkl'))").format(here=harness.HERE, wd=workdir)
    env = {"PYTHONPATH": harness.HERE + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
           "RUMOR_TIMEOUT": "30"}
    with netns.Cluster(hosts) as cluster:
        with launch.Ranks([sys.executable, "-c", shim], world, cluster=cluster, ranks_per_host=ranks_per_host,
                          env=env, logdir=workdir) as ranks:
            ranks.wait(timeout, grace_after_failure=20)
    results = []
    for r in range(world):
        res = harness.RankResult(rank=r, ok=False, returncode=ranks.procs[r].returncode, output=ranks.log(r))
        if os.path.exists(outs[r]):
            with open(outs[r], "rb") as f:
                payload = pickle.load(f)
            if payload["ok"]:
                res.ok, res.value = True, payload["value"]
            else:
                res.error, res.error_type = payload["error"], payload["type"]
        elif r in ranks.timed_out:
            res.error, res.error_type = f"rank {r} did not finish within the {timeout:.0f} s deadline", "timeout"
        else:
            res.error = f"rank {r} exited with code {ranks.procs[r].returncode} without a result"
            res.error_type = "died"
        results.append(res)
    import shutil

    shutil.rmtree(workdir, ignore_errors=True)
    bad = [res for res in results if not res.ok]
    if bad:
        raise harness.RankFailed(harness._report(fn, world, results, bad))
    return [res.value for res in results]


def test_models_module():
    """The shared standard models have the sizes BENCHMARKS.md fixes (built on the meta device:
    no memory, no time)."""
    import torch

    from rumor.testing import models

    with torch.device("meta"):
        n = {name: models.num_params(models.build(name)) for name in models.NAMES}
    assert 25_000_000 <= n["mlp25m"] <= 25_400_000, n
    assert 1_000_000 <= n["cnn"] <= 5_000_000, n
    assert 4_500_000 <= n["transformer"] <= 5_800_000, n
    assert models.BATCH == {"mlp25m": 32, "cnn": 32, "transformer": 16}
    small = models.build("mlp25m", scale=1 / 64)
    x1, y1 = models.batch(small, 4, step=2, shard=1)
    x2, y2 = models.batch(small, 4, step=2, shard=1)
    x3, _ = models.batch(small, 4, step=2, shard=0)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)


def partition_rank():
    """The same training steps with one bucket, many small ones, and no shared buckets: the
    parameters after each must hold the same bits (returned as one sha256 per variant)."""
    import hashlib

    import torch

    import rumor

    torch.set_num_threads(1)
    rumor.init()
    r = rumor.rank()
    variants = {"one bucket": dict(bucket_cap_mb=25, first_bucket_mb=25),
                "small buckets": dict(bucket_cap_mb=0.01, first_bucket_mb=0.002),
                "no shared buckets": dict(shared_buckets=False)}
    digests, arena = {}, {}
    for name, kw in variants.items():
        torch.manual_seed(0)
        # 160 x 160 weights (100 KiB): past the small-message path, so the direct one runs too.
        model = torch.nn.Sequential(torch.nn.Linear(24, 160), torch.nn.Tanh(), torch.nn.Linear(160, 160),
                                    torch.nn.Tanh(), torch.nn.Linear(160, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = rumor.DistributedDataParallel(model, opt, **kw)
        g = torch.Generator().manual_seed(100 + r)
        for _ in range(4):
            # Inputs of mixed magnitudes: gradients whose float sum depends on its order.
            x = torch.randn(8, 24, generator=g) * torch.exp2(torch.randint(-12, 12, (8, 1), generator=g).float())
            y = torch.randn(8, 3, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        arena[name] = [b.arena is not None for b in ddp.buckets]
        h = hashlib.sha256()
        for p in model.parameters():
            h.update(p.detach().numpy().tobytes())
        digests[name] = h.hexdigest()
    rumor.barrier()
    return digests, arena


@pytest.mark.parametrize("world", [3, 4])
def test_the_sums_do_not_depend_on_the_buckets(world):
    """Where the buckets fall (one, many, cut after the first step by backward's timing) and
    whether they are shared decide which rank sums which elements; on one host's paths (shared
    buckets, shared slots, direct) each element must still sum over the ranks in rank order, so
    the replicas are equal and a run that ends up with other buckets (a restart, another
    timing) equals an uninterrupted one. The direct path from any size: where cores are shared
    it starts at a few MiB, and below that the shm ring sums each chunk from another rank."""
    res = harness.run(partition_rank, world, timeout=120, env={"RUMOR_HOST_DIRECT_MIN_BYTES": "0"})
    arena = res[0][1]
    assert all(arena["one bucket"]) and all(arena["small buckets"]) and len(arena["small buckets"]) > 2, arena
    assert not any(arena["no shared buckets"]), arena
    digests = [d for d, _ in res]
    assert all(d == digests[0] for d in digests), "the replicas differ"
    assert len(set(digests[0].values())) == 1, digests[0]
