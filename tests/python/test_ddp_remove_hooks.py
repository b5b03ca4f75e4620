"""rumor.DistributedDataParallel.remove_hooks(): the module and optimizer it gives back train
exactly as an unwrapped copy does.

On 2 ranks, each case wraps a model, trains 2 synchronized steps, calls remove_hooks() and then
trains 3 more steps on data that differs between ranks, beside a reference made at that moment:
a deep copy of the module with a fresh optimizer of the same kind (fused the same way where the
wrapped one was) loaded from the wrapped optimizer's state_dict. Gradients and parameters must
be bit-equal to the reference's after every step (so nothing is averaged any more and no step is
skipped or doubled), the wrapper's hooks must be gone from parameters and optimizer, a second
remove_hooks() must change nothing, and a forward through the wrapper must raise.

Cases: plain SGD with momentum (gradients in the wrapper's buckets, in shared memory with two
local ranks); ByteGrad with an optimizer (the after_step hook); a fused SGD; overlap_optimizer
with Adam (the update runs in the buckets during backward, on parameters and state in the
host-shared arena).
"""
from __future__ import annotations

import harness

SYNCED_STEPS = 2
LOCAL_STEPS = 3


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))


def _xy(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 12, generator=g), torch.randn(6, 4, generator=g)


def _make(case: str, params):
    import torch

    from rumor.optim import fuse_optimizer

    if case in ("sgd", "bytegrad"):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if case == "fused_sgd":
        return fuse_optimizer(torch.optim.SGD(params, lr=0.05, momentum=0.9))
    return fuse_optimizer(torch.optim.Adam(params, lr=0.01))


def _step(model, opt, x, y):
    import torch

    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return grads


def _hook_counts(model, opt) -> tuple:
    params = list(model.parameters())
    return (sum(len(p._post_accumulate_grad_hooks or {}) for p in params),
            sum(len(p._backward_hooks or {}) for p in params),
            len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks))


def _span(t) -> tuple:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _case(chk, case: str, rank: int) -> None:
    import copy

    import torch

    import rumor

    model = _model()
    opt = _make(case, model.parameters())
    plain_counts = _hook_counts(model, opt)
    kw = dict(algorithm=rumor.algorithms.ByteGrad()) if case == "bytegrad" else {}
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, overlap_optimizer=case == "overlap_adam",
                                        bucket_cap_mb=0.001, first_bucket_mb=0.0005, **kw)
    chk.check(_hook_counts(model, opt) != plain_counts, f"{case}: the wrapper put hooks on")
    for s in range(SYNCED_STEPS):
        _step(ddp, opt, *_xy(s, rank))

    ddp.remove_hooks()
    # Nothing of the module may live in the wrapper's buckets (shared memory here) any more: a
    # zero_grad(set_to_none=False) would otherwise keep training into them. With overlap_optimizer
    # the host-shared arena also holds the parameters.
    spans = [_span(b.flat if b.arena is None else torch.frombuffer(b.arena, dtype=torch.uint8))
             for b in ddp.buckets]
    for i, p in enumerate(model.parameters()):
        for what, t in (("gradient", p.grad), ("parameter", p.data)):
            chk.check(not any(lo <= t.data_ptr() < hi for lo, hi in spans),
                      f"{case}: {what} {i} is still in a bucket after remove_hooks")
    chk.check(_hook_counts(model, opt) == plain_counts,
              f"{case}: hooks left after remove_hooks: {_hook_counts(model, opt)} != {plain_counts}")
    ref = copy.deepcopy(model)
    ref_opt = _make(case, ref.parameters())
    # A copy: load_state_dict keeps the tensors it is given, which opt goes on updating in place.
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for s in range(SYNCED_STEPS, SYNCED_STEPS + LOCAL_STEPS):
        if s == SYNCED_STEPS + 1:
            ddp.remove_hooks()  # again: a no-op
        x, y = _xy(s, rank)
        got, want = _step(model, opt, x, y), _step(ref, ref_opt, x, y)
        for i, (a, b) in enumerate(zip(got, want)):
            chk.equal(a, b, f"{case}: step {s} gradient {i}")
        for i, (a, b) in enumerate(zip(model.parameters(), ref.parameters())):
            chk.equal(a.detach(), b.detach(), f"{case}: step {s} parameter {i}")

    try:
        ddp(torch.zeros(1, 12))
        chk.check(False, f"{case}: forward through the wrapper after remove_hooks() did not raise")
    except RuntimeError as e:
        chk.check("remove_hooks()" in str(e) and ".module" in str(e), f"{case}: unclear error: {e}")


def remove_hooks_rank():
    import torch

    import rumor

    torch.set_num_threads(1)
    rumor.init()
    chk = harness.Checker()
    try:
        for case in ("sgd", "bytegrad", "fused_sgd", "overlap_adam"):
            _case(chk, case, rumor.rank())
    finally:
        rumor.shutdown()
    return chk.failures, chk.count


def test_remove_hooks_gives_back_a_plain_module():
    for rank, (failures, count) in enumerate(harness.run(remove_hooks_rank, 2, timeout=120)):
        assert count > 100, f"rank {rank}: only {count} checks ran"
        assert not failures, f"rank {rank}: " + "\n".join(failures)
