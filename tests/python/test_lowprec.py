"""Low-precision algorithms: ByteGrad, QSGD, LowPrecision and 1-bit Adam.

Ranks are spawned by harness.run (two spawns: 2 ranks on one host, and 4 ranks faked as 2 hosts
x 2 ranks with RUMOR_HOST_ID); many scenarios run per spawn and a harness.Checker collects
every mismatch; each scenario is a test id of its own (`-k onebit_state_dict`). What is compared:
* the compressed allreduce (rumor._C.compressed_allreduce with ByteGrad's codec) against a
  pure-torch implementation of the same pipeline: min/max uint8 quantization per chunk, each
  block reduced by its owner in float32 with its own part at full precision, re-quantized once
  and decoded by everyone (allclose: torch and the C++ kernels may fuse a multiply-add
  differently); flat on 2 and 4 ranks, hierarchical on 2 hosts x 2 ranks;
* training a small MLP with each algorithm: parameters bitwise identical on every rank after
  every step (gathered and compared), final loss within 10% of GradientAllReduce's;
* rumor.optim.OneBitAdamOptimizer before its freeze step against torch.optim.Adam on the concatenated
  batch (float32 tolerance), and a state_dict round trip (through torch.save) in the
  compression stage that continues bit for bit like the uninterrupted run.
"""
from __future__ import annotations

import pytest

import harness

STEPS = 30
D_IN, HIDDEN, CLASSES, BATCH = 16, 32, 4, 16
SMALL_BUCKETS = dict(bucket_cap_mb=0.002, first_bucket_mb=0.001)


# ==== inside a rank ===============================================================================

def _init():
    import torch

    import rumor

    torch.set_num_threads(1)
    rumor.init()


def _mlp(seed=0):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, CLASSES))


def _batch(step, shard, n=BATCH):
    """Rank `shard`'s batch of `step`: inputs and the labels a fixed random teacher gives them."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + shard)
    x = torch.randn(n, D_IN, generator=g)
    teacher = torch.randn(D_IN, CLASSES, generator=torch.Generator().manual_seed(7))
    return x, (x @ teacher).argmax(1)


def _eval_loss(model):
    import torch
    import torch.nn.functional as F

    x, y = _batch(10**6, 0, n=512)
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def _flat_params(model):
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _check_identical(chk, model, what):
    """Parameters bitwise identical on every rank: gather them all and compare with rank 0's."""
    import torch

    import rumor

    mine = _flat_params(model).unsqueeze(0)
    every = rumor.allgather(mine)
    for r in range(1, every.shape[0]):
        chk.check(torch.equal(every[r], every[0]), f"{what}: rank {r} parameters differ from rank 0's")


def _train(chk, algorithm_factory, optimizer_factory, what, steps=STEPS, model=None):
    """Trains the MLP (or `model`) with the given algorithm; returns the final evaluation loss."""
    import torch.nn.functional as F

    import rumor

    model = _mlp() if model is None else model
    opt = optimizer_factory(model.parameters())
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=algorithm_factory(opt), **SMALL_BUCKETS)
    for step in range(steps):
        x, y = _batch(step, rumor.rank())
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        _check_identical(chk, model, f"{what} step {step}")
    loss = _eval_loss(model)
    chk.check(loss == loss, f"{what}: loss is NaN")
    return loss


def _minmax_roundtrip(x, chunk):
    """ByteGrad's codec in torch: per chunk min and max, round((x - min) * 255 / (max - min))
    to the nearest even integer, decoded as min + code * (max - min) / 255."""
    import torch

    x = x.float()
    out = torch.empty_like(x)
    for c0 in range(0, x.numel(), chunk):
        v = x[c0:c0 + chunk]
        lo, hi = v.min(), v.max()
        rng = hi - lo
        # A tensor division: torch computes `scalar / tensor` as scalar * reciprocal (one more rounding).
        inv = torch.full_like(rng, 255.0) / rng if float(rng) > 0 else torch.zeros_like(rng)
        code = torch.round(((v - lo) * inv).clamp(0, 255))
        out[c0:c0 + chunk] = lo + code * (rng / 255.0)
    return out


def _pipeline_reference(inputs, counts, roundtrip, divisor):
    """The compressed allreduce computed in one place: block j's owner adds the others'
    round-tripped contributions to its own in float32 (rank order), divides, round-trips once."""
    import torch

    out, off = [], 0
    for j, c in enumerate(counts):
        acc = inputs[j][off:off + c].float().clone()
        for q, x in enumerate(inputs):
            if q != j:
                acc += roundtrip(x[off:off + c])
        out.append(roundtrip(acc / divisor) if c else acc)
        off += c
    return torch.cat(out)


def _check_pipeline(chk, got, want, chunk, what):
    """got == want up to float rounding, except that a value the owner re-quantizes may sit on a
    rounding boundary: where the C++ kernels fuse a decode's multiply-add (FMA) and torch does
    not, such a value lands one level away. Allowed: at most 0.1% of the elements, each at most
    one level (the chunk's range / 255) off."""
    import torch

    tol = dict(rtol=1e-5, atol=1e-5) if got.dtype == torch.float32 else {}
    g, w = got.float(), want.float()
    rtol, atol = tol.get("rtol", 1.6e-2), tol.get("atol", 1e-5)
    off = (g - w).abs() > atol + rtol * w.abs()
    bad = int(off.sum())
    chk.check(bad <= max(1, got.numel() // 1000), f"{what}: {bad} of {got.numel()} elements differ")
    for i in off.nonzero().reshape(-1).tolist()[:50]:
        c0 = i // chunk * chunk
        level = float(w[c0:c0 + chunk].max() - w[c0:c0 + chunk].min()) / 255
        chk.check(abs(float(g[i] - w[i])) <= 1.5 * level + atol + rtol * abs(float(w[i])),
                  f"{what}: element {i} is {float(g[i])}, expected {float(w[i])} (level {level})")


def _compressed_input(rank, count, dtype):
    import torch

    g = torch.Generator().manual_seed(count * 10 + rank)
    scale = torch.linspace(0.5, 4.0, count)
    return (torch.randn(count, generator=g) * scale).to(dtype)


def sc_bytegrad_reference(chk, hierarchical=False, hosts=None, average=True):
    import torch

    import rumor
    from rumor import _C
    from rumor._tensor import dtype_code

    comm = rumor._runtime.state().world._comm
    n, r = rumor.size(), rumor.rank()
    chunk = 256
    for count in (1, 700, 70001):
        for dtype in (torch.float32, torch.bfloat16):
            inputs = [_compressed_input(q, count, dtype) for q in range(n)]
            buf = inputs[r].clone()
            _C.compressed_allreduce(comm, buf.data_ptr(), count, dtype_code(dtype, "test"), kind=1, chunk=chunk,
                                    average=average, hierarchical=hierarchical)
            if hierarchical:
                # Full-precision sums per host (two summands: any order gives the same bits), then
                # the compressed pipeline among the host leaders, dividing by all ranks.
                sums = [(inputs[h[0]].float() + inputs[h[1]].float()).to(dtype) for h in hosts]
                counts = _C.compressed_blocks(count, len(hosts), 1, chunk)
                want = _pipeline_reference(sums, counts, lambda x: _minmax_roundtrip(x, chunk), n if average else 1)
            else:
                counts = _C.compressed_blocks(count, n, 1, chunk)
                want = _pipeline_reference(inputs, counts, lambda x: _minmax_roundtrip(x, chunk), n if average else 1)
            want = want.to(dtype)
            what = (f"compressed allreduce {'hierarchical ' if hierarchical else ''}"
                    f"{'average' if average else 'sum'} {count} {dtype}")
            _check_pipeline(chk, buf, want, chunk, what)
            every = rumor.allgather(buf.unsqueeze(0))
            chk.check(all(torch.equal(every[q], every[0]) for q in range(n)), f"{what}: ranks differ")
            # Not a no-op: the result differs from the exact average by quantization error.
            exact = torch.stack([x.float() for x in inputs]).sum(0) / (n if average else 1)
            if count > 1 and dtype == torch.float32:
                chk.check(not torch.equal(buf, exact), f"{what}: equals the exact average (nothing compressed?)")
                chk.check(float((buf - exact).abs().max()) < 0.1 * n, f"{what}: far from the exact result")


def sc_training(chk, algorithms):
    """Each algorithm against GradientAllReduce with the same optimizer and data."""
    import torch

    import rumor

    sgd = lambda ps: torch.optim.SGD(ps, lr=0.2)  # noqa: E731
    base = _train(chk, lambda opt: rumor.algorithms.GradientAllReduce(), sgd, "GradientAllReduce")
    chk.check(base < 1.0, f"GradientAllReduce did not learn (loss {base})")  # log(4) = 1.39 at start
    for name, make in algorithms:
        loss = _train(chk, make, sgd, name)
        chk.check(abs(loss - base) <= 0.1 * base, f"{name}: loss {loss:.4f} vs GradientAllReduce {base:.4f}")


def sc_single_host_hierarchical(chk):
    """hierarchical=True on one host compresses nothing: the same bits as GradientAllReduce."""
    import torch

    import rumor

    sgd = lambda ps: torch.optim.SGD(ps, lr=0.2)  # noqa: E731
    runs = {}
    for name, make in [("GradientAllReduce", lambda opt: rumor.algorithms.GradientAllReduce()),
                       ("ByteGrad", lambda opt: rumor.algorithms.ByteGrad()),
                       ("QSGD", lambda opt: rumor.algorithms.QSGD(levels=4))]:
        model = _mlp()
        _train(chk, make, sgd, f"{name} (one host, hierarchical)", steps=3, model=model)
        runs[name] = _flat_params(model)
    for name in ("ByteGrad", "QSGD"):
        chk.equal(runs[name], runs["GradientAllReduce"], f"{name}(hierarchical=True) on one host")


def sc_onebit_training(chk, hierarchical=False):
    import torch

    import rumor

    # Warm-up of 5 of 30 steps (DeepSpeed suggests 15-25% of training). Frozen variances make
    # 1-bit Adam less tolerant of large learning rates than Adam: lr 0.01 still trains here, but
    # 10% behind, lr 0.005 keeps up.
    adam = _train(chk, lambda opt: rumor.algorithms.GradientAllReduce(),
                  lambda ps: torch.optim.Adam(ps, lr=0.005), "Adam + GradientAllReduce")
    chk.check(adam < 1.0, f"Adam did not learn (loss {adam})")
    onebit = _train(chk, lambda opt: rumor.algorithms.OneBitAdamAlgorithm(opt),
                    lambda ps: rumor.optim.OneBitAdamOptimizer(ps, lr=0.005, freeze_step=5), "OneBitAdam")
    chk.check(abs(onebit - adam) <= 0.1 * adam, f"OneBitAdam: loss {onebit:.4f} vs Adam {adam:.4f}")
    if hierarchical:
        hier = _train(chk, lambda opt: rumor.algorithms.OneBitAdamAlgorithm(opt, hierarchical=True),
                      lambda ps: rumor.optim.OneBitAdamOptimizer(ps, lr=0.005, freeze_step=5), "OneBitAdam hierarchical")
        chk.check(abs(hier - adam) <= 0.1 * adam, f"OneBitAdam hierarchical: loss {hier:.4f} vs Adam {adam:.4f}")


def sc_onebit_warmup_is_adam(chk):
    """Before freeze_step, OneBitAdam on DDP is Adam on the concatenated batch."""
    import torch
    import torch.nn.functional as F

    import rumor

    n = rumor.size()
    model, ref = _mlp(3), _mlp(3)
    opt = rumor.optim.OneBitAdamOptimizer(model.parameters(), lr=0.01, weight_decay=0.01, freeze_step=10)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=rumor.algorithms.OneBitAdamAlgorithm(opt),
                                        **SMALL_BUCKETS)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, weight_decay=0.01)
    for step in range(6):
        x, y = _batch(step, rumor.rank())
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        xs, ys = zip(*[_batch(step, q) for q in range(n)])
        ref_opt.zero_grad()
        F.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            chk.close(p.detach(), q.detach(), f"OneBitAdam warm-up step {step} [{name}]", rtol=1e-5, atol=1e-6)
        _check_identical(chk, model, f"OneBitAdam warm-up step {step}")


def _onebit_run(model, opt, ddp, steps):
    import torch.nn.functional as F

    import rumor

    for step in steps:
        x, y = _batch(step, rumor.rank())
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()


def sc_onebit_zero_variance(chk):
    """Weights whose gradient was zero through warm-up have a zero frozen variance. A sign code
    gives them the chunk's mean magnitude; 1-bit Adam must not turn that into a step of
    lr * scale / eps (it blew up the 25M MLP in the benchmark): they move no more than live ones."""
    import torch
    import torch.nn.functional as F

    import rumor

    torch.manual_seed(0)
    model = torch.nn.Linear(D_IN, CLASSES, bias=False)
    opt = rumor.optim.OneBitAdamOptimizer(model.parameters(), lr=0.01, freeze_step=3)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=rumor.algorithms.OneBitAdamAlgorithm(opt))
    start = model.weight.detach().clone()
    half = D_IN // 2
    for step in range(12):
        x, y = _batch(step, rumor.rank())
        x[:, half:] = 0  # these inputs never carry signal: their weights get zero gradients
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    moved = (model.weight.detach() - start).abs()
    chk.check(bool(torch.isfinite(model.weight).all()), "1-bit Adam with zero-variance weights: non-finite weights")
    live, dead = float(moved[:, :half].max()), float(moved[:, half:].max())
    chk.check(dead <= 2 * live, f"1-bit Adam: zero-variance weights moved {dead:.3g}, live ones at most {live:.3g}")
    _check_identical(chk, model, "1-bit Adam with zero-variance weights")


def sc_onebit_state_dict(chk):
    """A checkpoint taken in the compression stage (momentum, variance, error buffers, step)
    resumes exactly like the uninterrupted run."""
    import io

    import torch
    import torch.nn.functional as F

    import rumor

    def build(seed):
        model = _mlp(seed)
        opt = rumor.optim.OneBitAdamOptimizer(model.parameters(), lr=0.01, freeze_step=3)
        ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=rumor.algorithms.OneBitAdamAlgorithm(opt),
                                            **SMALL_BUCKETS)
        # Buckets follow the first iteration's ready order, never timing gaps: both runs then
        # use the same buckets (and so the same 1-bit blocks).
        ddp._split_gap_s = float("inf")
        return model, opt, ddp

    model, opt, ddp = build(0)
    _onebit_run(model, opt, ddp, range(6))
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    st = opt.state_dict()["state"][0]
    chk.check(set(st) == {"step", "exp_avg", "exp_avg_sq", "worker_error", "server_error"},
              f"OneBitAdam state keys {sorted(st)}")
    chk.check(st["step"] == 6, f"step {st['step']}")
    chk.check(float(st["worker_error"].abs().sum()) > 0, "worker error buffer unused in the compression stage")
    _onebit_run(model, opt, ddp, range(6, 9))
    uninterrupted = _flat_params(model)

    model2, opt2, ddp2 = build(1)
    # One backward before loading builds the same buckets as the first run's (no step: the
    # optimizer state stays empty until the checkpoint is loaded).
    x, y = _batch(0, rumor.rank())
    F.cross_entropy(ddp2(x), y).backward()
    opt2.zero_grad()
    blob.seek(0)
    ck = torch.load(blob)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    # The loaded state lives in the algorithm's flat buffers again (the bucket ops use those).
    flats = {key: {st.flats[key].untyped_storage().data_ptr() for st in ddp2.algorithm._states.values()}
             for key in ("exp_avg", "worker_error", "server_error")}
    for name, p in model2.named_parameters():
        for key, ptrs in flats.items():
            chk.check(opt2.state[p][key].untyped_storage().data_ptr() in ptrs,
                      f"{name} {key}: not a view into the algorithm's flat buffer after load_state_dict")
    _onebit_run(model2, opt2, ddp2, range(6, 9))
    chk.equal(_flat_params(model2), uninterrupted, "OneBitAdam resumed from a state_dict")


def _algorithms(kinds, hierarchical):
    """sc_training's list of (name, make) for the named algorithms."""
    import torch

    import rumor

    A = rumor.algorithms
    if hierarchical:
        make = {"ByteGrad": lambda opt: A.ByteGrad(), "QSGD": lambda opt: A.QSGD(levels=16)}
        return [(f"{k} hierarchical", make[k]) for k in kinds]
    make = {"ByteGrad": lambda opt: A.ByteGrad(hierarchical=False),
            "QSGD": lambda opt: A.QSGD(levels=16, hierarchical=False),
            "LowPrecision fp16": lambda opt: A.LowPrecision(torch.float16, hierarchical=False),
            "LowPrecision bf16": lambda opt: A.LowPrecision(torch.bfloat16, hierarchical=False)}
    return [(k, make[k]) for k in kinds]


ONE_HOST = {
    "bytegrad_reference": lambda chk: sc_bytegrad_reference(chk),
    "bytegrad_reference_sum": lambda chk: sc_bytegrad_reference(chk, average=False),
    "training": lambda chk: sc_training(chk, _algorithms(
        ["ByteGrad", "QSGD", "LowPrecision fp16", "LowPrecision bf16"], hierarchical=False)),
    "single_host_hierarchical": sc_single_host_hierarchical,
    "onebit_training": lambda chk: sc_onebit_training(chk),
    "onebit_warmup_is_adam": sc_onebit_warmup_is_adam,
    "onebit_state_dict": sc_onebit_state_dict,
    "onebit_zero_variance": sc_onebit_zero_variance,
}

TWO_HOSTS = {
    "bytegrad_reference": lambda chk: sc_bytegrad_reference(chk),
    "bytegrad_reference_sum": lambda chk: sc_bytegrad_reference(chk, average=False),
    "bytegrad_reference_hierarchical": lambda chk: sc_bytegrad_reference(chk, hierarchical=True,
                                                                         hosts=[(0, 1), (2, 3)]),
    "training": lambda chk: sc_training(chk, _algorithms(["ByteGrad", "QSGD"], hierarchical=True)),
    "onebit_training": lambda chk: sc_onebit_training(chk, hierarchical=True),
}


def lowprec_rank(names, n_hosts_expected=1):
    """Runs the named scenarios of ONE_HOST (or TWO_HOSTS) in order; returns {name: (failures, count)}."""
    _init()
    chk = harness.Checker()
    return harness.run_scenarios(chk, names, TWO_HOSTS if n_hosts_expected == 2 else ONE_HOST)


# ==== tests =======================================================================================
# One test id per scenario; the selected scenarios of one launch run in it together.

@pytest.mark.parametrize("scenario", list(ONE_HOST))
def test_single_host_two_ranks(scenario, request, batches):
    res = harness.batch(batches, "one host", lambda: harness.run(
        lowprec_rank, 2, timeout=110, args=(harness.selected(request, "scenario"),)))
    harness.assert_no_failures(harness.scenario_results(res, scenario), f"low precision, 2 ranks: {scenario}")


@pytest.mark.parametrize("scenario", list(TWO_HOSTS))
def test_two_hosts_of_two_by_host_id(scenario, request, batches):
    rank_env = [{"RUMOR_HOST_ID": h} for h in ("hA", "hA", "hB", "hB")]
    res = harness.batch(batches, "two hosts", lambda: harness.run(
        lowprec_rank, 4, timeout=110, rank_env=rank_env, args=(harness.selected(request, "scenario"), 2)))
    harness.assert_no_failures(harness.scenario_results(res, scenario), f"low precision, 2 hosts x 2 ranks: {scenario}")


def test_bad_arguments():
    import torch

    import rumor

    with pytest.raises(ValueError, match="levels"):
        rumor.algorithms.QSGD(levels=1)
    with pytest.raises(ValueError, match="levels"):
        rumor.algorithms.QSGD(levels=257)
    with pytest.raises(ValueError, match="dtype"):
        rumor.algorithms.LowPrecision(dtype=torch.int32)
    with pytest.raises(ValueError, match="dtype"):
        rumor.algorithms.LowPrecision(dtype=torch.float32)
    with pytest.raises(ValueError, match="chunk"):
        rumor.algorithms.ByteGrad(chunk=-8)
    with pytest.raises(ValueError, match="chunk"):
        rumor.algorithms.QSGD(chunk=100)
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="freeze_step"):
        rumor.optim.OneBitAdamOptimizer(params, freeze_step=0)
    with pytest.raises(ValueError, match="betas"):
        rumor.optim.OneBitAdamOptimizer(params, betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="learning rate"):
        rumor.optim.OneBitAdamOptimizer(params, lr=-1.0)
    with pytest.raises(TypeError, match="rumor.optim.OneBitAdamOptimizer"):
        rumor.algorithms.OneBitAdamAlgorithm(torch.optim.Adam(params))
    with pytest.raises(ValueError, match="codec kind"):
        rumor._C.compressed_allreduce_op(kind=9)


def test_onebit_adam_alone_is_adam_then_frozen_variance():
    """Without communication: Adam up to freeze_step, then the variance stops changing."""
    import torch

    import rumor

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(50))
    ref = torch.nn.Parameter(w.detach().clone())
    opt = rumor.optim.OneBitAdamOptimizer([w], lr=0.01, freeze_step=4)
    ref_opt = torch.optim.Adam([ref], lr=0.01)
    for step in range(4):
        g = torch.randn(50, generator=torch.Generator().manual_seed(step))
        w.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    # From the freeze step on, exp_avg holds the preconditioned momentum u = m / denom.
    v = opt.state[w]["exp_avg_sq"].clone()
    m = ref_opt.state[ref]["exp_avg"].clone()
    denom = (v.sqrt() / (1 - 0.999 ** 4) ** 0.5) + 1e-8
    torch.testing.assert_close(opt.state[w]["exp_avg"], m / denom)
    before = w.detach().clone()
    g = torch.randn(50, generator=torch.Generator().manual_seed(99))
    w.grad = g
    opt.step()
    assert torch.equal(opt.state[w]["exp_avg_sq"], v)
    m_new = 0.9 * m + 0.1 * g
    torch.testing.assert_close(opt.state[w]["exp_avg"], m_new / denom)
    torch.testing.assert_close(w.detach(), before - 0.01 / (1 - 0.9 ** 5) * m_new / denom)
