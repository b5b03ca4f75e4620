"""DistributedDataParallel with a fused optimizer, and with overlap_optimizer=True, against the
plain wrapper with the same (unfused) optimizer, on 2 ranks through the harness.

Compared after 6 steps of different data per rank, two param groups with different
hyper-parameters, an lr scheduler, and small buckets (several buckets, rebuilt after the first
iteration): parameters equal the plain run's bit for bit where torch's own update runs
(RMSprop, Adagrad: the per-bucket Python fallback) and within 1e-6 relative where rumor's C++
kernels run (SGD, Adam, AdamW; see test_fused_optimizer.py for that bound). Parameters are also
checked identical across ranks.

With the kernels and every rank on one host, overlap_optimizer runs each element's update once
per host, inside the shared-bucket allreduce (csrc/optim/shared_step_op.h), with the optimizer
state shared by the host's ranks; "overlap-private" turns that off (RUMOR_SHARED_OPTIMIZER=0) so
that each rank's own update after its bucket (the path of multi-host jobs) is tested too.
"""
from __future__ import annotations

import pytest

import harness

STEPS = 6
SMALL_BUCKETS = dict(bucket_cap_mb=0.004, first_bucket_mb=0.001)


def _model(seed=0):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.LayerNorm(48), torch.nn.ReLU(),
                               torch.nn.Linear(48, 48), torch.nn.ReLU(), torch.nn.Linear(48, 5))


def _groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    other = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": decay}, {"params": other, "weight_decay": 0.0, "lr_scale": 0.5}]


def _make(name, params):
    import torch
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-3, momentum=0.5)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.05)
    raise ValueError(name)


def _wrap(model, opt, mode):
    import os

    import rumor

    os.environ["RUMOR_SHARED_OPTIMIZER"] = "0" if mode == "overlap-private" else "1"
    try:
        return rumor.DistributedDataParallel(model, optimizer=opt, overlap_optimizer=mode.startswith("overlap"),
                                             **SMALL_BUCKETS)
    finally:
        del os.environ["RUMOR_SHARED_OPTIMIZER"]


def _train(opt_name, mode, chk=None):
    import torch

    import rumor
    from rumor.optim import fuse_optimizer

    model = _model()
    opt = _make(opt_name, _groups(model))
    if mode == "fused":
        fuse_optimizer(opt)
    ddp = _wrap(model, opt, mode)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.8 ** s, lambda s: 0.5 * 0.9 ** s])
    g = torch.Generator().manual_seed(100 + rumor.rank())
    for _ in range(STEPS):
        x, y = torch.randn(8, 24, generator=g), torch.randn(8, 5, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        sched.step()
    if chk is not None:  # after the buckets were rebuilt
        want = mode == "overlap" and opt_name in ("sgd", "adam", "adamw")
        chk.check(bool(ddp._shared_step_ops) == want,
                  f"{opt_name}/{mode}: host-shared update {'not ' if want else ''}used")
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def scenarios_rank(names):
    import torch

    import rumor
    from rumor.collectives import allgather

    rumor.init()
    torch.set_num_threads(1)
    chk = harness.Checker()
    out = {}
    for opt_name in names:
        f0, c0 = len(chk.failures), chk.count
        plain, plain_sd = _train(opt_name, "plain")
        kernel = opt_name in ("sgd", "adam", "adamw")
        for mode in ("fused", "overlap", "overlap-private"):
            got, sd = _train(opt_name, mode, chk)
            for i, (a, b) in enumerate(zip(got, plain)):
                if kernel:
                    err = ((a - b).abs() / b.abs().clamp(min=1.0)).max().item()
                    chk.check(err <= 1e-6, f"{opt_name}/{mode}: parameter {i} differs by {err:.3g} relative")
                else:
                    chk.check(torch.equal(a, b), f"{opt_name}/{mode}: parameter {i} differs from the plain run")
            flat = torch.cat([a.reshape(-1) for a in got]).unsqueeze(0)
            every = allgather(flat)
            chk.check(bool((every == every[0]).all()), f"{opt_name}/{mode}: parameters differ across ranks")
            chk.check(sd["state"].keys() == plain_sd["state"].keys(), f"{opt_name}/{mode}: state keys differ")
            for k, st in plain_sd["state"].items():
                for key, v in st.items():
                    ok = key in sd["state"][k] and (not isinstance(v, torch.Tensor)
                                                    or sd["state"][k][key].shape == v.shape)
                    chk.check(ok, f"{opt_name}/{mode}: state {k}/{key} missing or of another shape")
                    if ok and kernel and isinstance(v, torch.Tensor):
                        # The state as every rank reads it (shared on one host) is the plain run's.
                        err = ((sd["state"][k][key] - v).abs() / v.abs().clamp(min=1e-3)).max().item()
                        chk.check(err <= 1e-5, f"{opt_name}/{mode}: state {k}/{key} differs by {err:.3g}")
        out[opt_name] = (chk.failures[f0:], chk.count - c0)
    return out


def resume_rank(opt_name, mode):
    """overlap_optimizer: a run stopped after 3 steps and resumed from model and optimizer
    state dicts into a new wrapper ends where 6 uninterrupted steps end, bit for bit (the
    host-shared state is written back by one rank and read by all). Loading used to leave the
    per-bucket update ops stepping the old flat buffers, no longer the parameters."""
    import copy

    import torch

    import rumor
    from rumor.collectives import allgather

    rumor.init()
    torch.set_num_threads(1)
    chk = harness.Checker()
    g = torch.Generator().manual_seed(100 + rumor.rank())
    batches = [(torch.randn(8, 24, generator=g), torch.randn(8, 5, generator=g)) for _ in range(STEPS)]

    def run(model, opt, ddp, steps):
        for x, y in steps:
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()

    model = _model()
    opt = _make(opt_name, _groups(model))
    ddp = _wrap(model, opt, mode)
    chk.check(bool(ddp._shared_step_ops) == (mode == "overlap"), f"{opt_name}/{mode}: host-shared update used or not")
    run(model, opt, ddp, batches)
    straight = [p.detach().clone() for p in model.parameters()]

    model = _model()
    opt = _make(opt_name, _groups(model))
    ddp = _wrap(model, opt, mode)
    run(model, opt, ddp, batches[:3])
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    # The shared state as rank 1 reads it equals rank 0's.
    flat = torch.cat([v.reshape(-1) for st in saved[1]["state"].values() for v in st.values()
                      if isinstance(v, torch.Tensor)]).unsqueeze(0)
    every = allgather(flat)
    chk.check(bool((every == every[0]).all()), f"{opt_name}: optimizer state differs across ranks")
    del ddp, opt, model
    model = _model(seed=1)  # other initial values: the state dicts must bring everything back
    opt = _make(opt_name, _groups(model))
    ddp = _wrap(model, opt, mode)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    run(model, opt, ddp, batches[3:])
    for i, (a, b) in enumerate(zip(model.parameters(), straight)):
        chk.check(torch.equal(a.detach(), b), f"{opt_name}: resumed parameter {i} differs from the straight run")
    return chk.failures, chk.count


def clip_rank(names, max_norm):
    """overlap_optimizer with bucket_clip_norm against the plain wrapper whose gradients are
    clipped bucket by bucket with torch.nn.utils.clip_grad_norm_, using the buckets the
    overlapped run had at each step (they are rebuilt after the first iteration)."""
    import torch

    import rumor

    rumor.init()
    torch.set_num_threads(1)
    chk = harness.Checker()
    out = {}
    for opt_name in names:
        f0, c0 = len(chk.failures), chk.count
        runs = {}
        layouts = []
        for mode in ("overlap", "plain"):
            model = _model()
            opt = _make(opt_name, _groups(model))
            kw = dict(overlap_optimizer=True, bucket_clip_norm=max_norm) if mode == "overlap" else {}
            ddp = rumor.DistributedDataParallel(model, optimizer=opt, **kw, **SMALL_BUCKETS)
            params = list(model.parameters())
            index = {id(p): i for i, p in enumerate(params)}
            g = torch.Generator().manual_seed(100 + rumor.rank())
            clipped = 0
            for t in range(STEPS):
                if mode == "overlap":
                    layouts.append([[index[id(p)] for p in b.params] for b in ddp.buckets])
                x, y = torch.randn(8, 24, generator=g), torch.randn(8, 5, generator=g)
                opt.zero_grad()
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                if mode == "plain":
                    for idx in layouts[t]:
                        norm = torch.nn.utils.clip_grad_norm_([params[i] for i in idx], max_norm)
                        clipped += int(norm > max_norm)
                opt.step()
            runs[mode] = [p.detach().clone() for p in params]
            if mode == "plain":
                chk.check(clipped > 0, f"{opt_name}: no bucket was ever clipped: the comparison would not see it")
        for i, (a, b) in enumerate(zip(runs["overlap"], runs["plain"])):
            err = ((a - b).abs() / b.abs().clamp(min=1.0)).max().item()
            chk.check(err <= 1e-5, f"{opt_name}: parameter {i} differs from per-bucket clip_grad_norm_ by {err:.3g}")
        out[opt_name] = (chk.failures[f0:], chk.count - c0)
    return out


def sc_kernel_refused_mid_training(chk):
    """A tensor lr set after wrapping stops the host-shared update at the next backward with a
    clear error, on every rank; with the lr set back, training goes on as if the failed
    iteration had never run (equal to a plain run of the same successful steps)."""
    import torch

    import rumor

    def steps(ddp, opt, data):
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()

    g = torch.Generator().manual_seed(7 + rumor.rank())
    before = [(torch.randn(8, 24, generator=g), torch.randn(8, 5, generator=g)) for _ in range(2)]
    after = [(torch.randn(8, 24, generator=g), torch.randn(8, 5, generator=g)) for _ in range(2)]
    model = _model(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ddp = _wrap(model, opt, "overlap")
    steps(ddp, opt, before)
    chk.check(bool(ddp._shared_step_ops), "tensor lr: the host-shared update is not in use")
    opt.param_groups[0]["lr"] = torch.tensor(0.05)
    opt.zero_grad()
    try:
        torch.nn.functional.mse_loss(ddp(after[0][0]), after[0][1]).backward()
        chk.check(False, "a tensor lr set after wrapping was accepted by the host-shared update")
    except RuntimeError as e:
        chk.check("set them before wrapping" in str(e), f"tensor lr: unexpected message: {e}")
    opt.param_groups[0]["lr"] = 0.05
    steps(ddp, opt, after)
    ref = _model(3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    steps(rumor.DistributedDataParallel(ref, optimizer=ref_opt, **SMALL_BUCKETS), ref_opt, before + after)
    for i, (a, b) in enumerate(zip(model.parameters(), ref.parameters())):
        err = ((a - b).abs() / b.abs().clamp(min=1.0)).max().item()
        chk.check(err <= 1e-6, f"tensor lr, recovered: parameter {i} differs from the plain run by {err:.3g}")


def errors_rank():
    import torch

    import rumor

    rumor.init()
    chk = harness.Checker()
    model = _model()
    try:
        rumor.DistributedDataParallel(model, overlap_optimizer=True)
        chk.check(False, "overlap_optimizer without an optimizer was accepted")
    except ValueError as e:
        chk.check("needs the optimizer" in str(e), f"unexpected message: {e}")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for kw, exc, words in ((dict(bucket_clip_norm=1.0), ValueError, "overlap_optimizer=True"),
                           (dict(overlap_optimizer=True, bucket_clip_norm=-1.0), ValueError, "> 0"),
                           (dict(overlap_optimizer=True, bucket_clip_norm=float("nan")), ValueError, "> 0"),
                           (dict(overlap_optimizer=True, bucket_clip_norm=True), TypeError, "number")):
        try:
            rumor.DistributedDataParallel(model, optimizer=opt, **kw)
            chk.check(False, f"{kw} was accepted")
        except exc as e:
            chk.check(words in str(e), f"{kw}: unexpected message: {e}")
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, overlap_optimizer=True)
    scaler = torch.amp.GradScaler("cpu")
    opt.zero_grad()
    scaler.scale(ddp(torch.randn(2, 24)).sum()).backward()
    try:
        scaler.step(opt)
        chk.check(False, "GradScaler with overlap_optimizer was accepted")
    except RuntimeError as e:
        chk.check("GradScaler" in str(e), f"unexpected message: {e}")
    sc_kernel_refused_mid_training(chk)
    try:
        torch.optim.Adafactor  # noqa: B018
        m2 = _model()
        rumor.DistributedDataParallel(m2, optimizer=torch.optim.Adafactor(m2.parameters()), overlap_optimizer=True)
        chk.check(False, "Adafactor was overlapped")
    except TypeError as e:
        chk.check("Adafactor" in str(e), f"unexpected message: {e}")
    return chk.failures, chk.count


# One test id per optimizer; the selected optimizers of a group ("kernels": rumor's fused kernels,
# "fallback": torch's step per bucket) run in one launch, as the whole group did before.
FUSED = [("kernels", o) for o in ("sgd", "adam")] + [("fallback", o) for o in ("adamw", "rmsprop", "adagrad")]


@pytest.mark.parametrize("group,opt_name", FUSED, ids=[f"{g}-{o}" for g, o in FUSED])
def test_fused_and_overlapped_equal_plain(group, opt_name, request, batches):
    res = harness.batch(batches, ("fused", group), lambda: harness.run(
        scenarios_rank, 2, timeout=120, args=(harness.selected(request, "opt_name"),)))
    assert harness.assert_no_failures(harness.scenario_results(res, opt_name), f"overlap_optimizer: {opt_name}") > 0


@pytest.mark.parametrize("mode", ["overlap", "overlap-private"])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_overlap_resumes_from_state_dicts(opt_name, mode):
    res = harness.run(resume_rank, 2, timeout=120, args=(opt_name, mode))
    harness.assert_no_failures(res, "overlap_optimizer resume")


def test_overlap_errors():
    res = harness.run(errors_rank, 2, timeout=60)
    harness.assert_no_failures(res, "overlap_optimizer errors")


CLIP = [("kernels", o) for o in ("sgd", "adam")] + [("fallback", "rmsprop")]


@pytest.mark.parametrize("group,opt_name", CLIP, ids=[f"{g}-{o}" for g, o in CLIP])
def test_bucket_clip_norm_equals_per_bucket_clipping(group, opt_name, request, batches):
    res = harness.batch(batches, ("clip", group), lambda: harness.run(
        clip_rank, 2, timeout=120, args=(harness.selected(request, "opt_name"), 0.05)))
    assert harness.assert_no_failures(harness.scenario_results(res, opt_name), f"bucket_clip_norm: {opt_name}") > 0
