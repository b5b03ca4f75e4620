"""CUDA tensors on torch.distributed's "rumor" backend (docs/torch_backend.md, "Device maps and
CUDA tensors"): backend="rumor" stages them through host memory around rumor's CPU collectives,
"cpu:rumor,cuda:nccl" hands them to torch's NCCL backend made by the rumor group.

Anywhere: the device-map rules, the maps torch passes for each spelling, and the staging logic
itself (every call staged through host copies of CPU tensors, against the direct call). On a GPU
(skipped without one, failed instead where RUMOR_EXPECT_GPU=1): two ranks sharing the GPU run
every call on CUDA tensors against gloo on the CPU, and torch DDP and FSDP2 on a CUDA model against
the same on gloo; one rank runs the NCCL map (one GPU allows one NCCL rank), FSDP2 included.
"""
from __future__ import annotations

import datetime
import os

import pytest
import torch

import harness

TIMEOUT = 180
EXPECT_GPU = os.environ.get("RUMOR_EXPECT_GPU") == "1"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() and not EXPECT_GPU, reason="needs a CUDA device")


def _init(backend: str):
    import torch.distributed as dist

    import rumor  # noqa: F401 (registers the backend)

    dist.init_process_group(backend, rank=harness.env_rank(), world_size=harness.env_world(),
                            timeout=datetime.timedelta(seconds=60))
    return dist


# ---- the device map ---------------------------------------------------------------------------

def test_device_map_decides_where_cuda_tensors_go():
    from rumor.torch_backend import _cuda_target

    assert _cuda_target(None) == "rumor"
    assert _cuda_target({"cpu": "rumor"}) == "rumor"
    assert _cuda_target({"cpu": "rumor", "cuda": "rumor"}) == "rumor"
    assert _cuda_target({"cpu": "rumor", "cuda": "nccl"}) == "nccl"
    assert _cuda_target({"cuda": "nccl", "cpu": "rumor"}) == "nccl"
    with pytest.raises(ValueError) as e:
        _cuda_target({"cpu": "gloo", "cuda": "rumor"})
    assert "cpu:gloo,cuda:rumor" in str(e.value) and "new_group(backend='gloo')" in str(e.value)
    with pytest.raises(ValueError) as e:
        _cuda_target({"cpu": "rumor", "cuda": "gloo"})
    assert "'gloo'" in str(e.value) and "'nccl'" in str(e.value)


def _maps_rank():
    import torch.distributed as dist

    import rumor  # noqa: F401

    seen = {}
    dist.init_process_group("cpu:rumor,cuda:nccl", rank=0, world_size=1)
    seen["cpu:rumor,cuda:nccl"] = dist.distributed_c10d._get_default_group()._cuda
    seen["new_group() under it"] = dist.new_group()._cuda
    seen["new_group(rumor)"] = dist.new_group(backend="rumor")._cuda
    try:
        dist.new_group(backend="cpu:gloo,cuda:rumor")
        seen["cpu:gloo,cuda:rumor"] = "accepted"
    except ValueError as e:
        seen["cpu:gloo,cuda:rumor"] = str(e)
    dist.destroy_process_group()
    dist.init_process_group("rumor", rank=0, world_size=1)
    seen["rumor"] = dist.distributed_c10d._get_default_group()._cuda
    t = torch.tensor([3.0])
    dist.all_reduce(t)
    seen["all_reduce"] = t.item()
    dist.destroy_process_group()
    return seen


def test_each_spelling_gives_its_device_map():
    (seen,) = harness.run(_maps_rank, 1, timeout=TIMEOUT)
    assert seen["cpu:rumor,cuda:nccl"] == "nccl"
    assert seen["new_group() under it"] == "nccl"
    assert seen["new_group(rumor)"] == "rumor"
    assert seen["rumor"] == "rumor"
    assert "new_group(backend='gloo')" in seen["cpu:gloo,cuda:rumor"], seen["cpu:gloo,cuda:rumor"]
    assert seen["all_reduce"] == 3.0


# ---- the calls, on both paths -------------------------------------------------------------------

def _calls(dist, dev, group=None):
    """Every call on tensors on `dev`, with inputs that depend on the rank (integers in float32,
    so every result is exact); returns {name: result tensors on the CPU}."""
    r, n = dist.get_rank(), dist.get_world_size()
    kw = {} if group is None else {"group": group}
    res = {}

    def t(*values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=dev)

    x = t(r + 1, 10 * (r + 1), -r)
    dist.all_reduce(x, **kw)
    res["all_reduce sum"] = [x]
    x = t(r + 1, 2 * r, 5)
    dist.all_reduce(x, op=dist.ReduceOp.MAX, **kw)
    res["all_reduce max"] = [x]
    x = t(2 * (r + 1), 4.0 - r, dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MIN, **kw)  # (AVG is not on gloo)
    res["all_reduce min f64"] = [x]
    xs = [t(r, r + 1), t(7 * r)]
    dist.all_reduce_coalesced(xs, **kw)
    res["all_reduce_coalesced"] = xs
    x = t(r + 1, r + 2)
    dist.reduce(x, dst=n - 1, **kw)
    res["reduce"] = [x] if r == n - 1 else []
    x = t(r, r, r, dtype=torch.int64)
    dist.broadcast(x, src=n - 1, **kw)
    res["broadcast int64"] = [x]
    outs = [torch.zeros(2, device=dev) for _ in range(n)]
    dist.all_gather(outs, t(r, -r), **kw)
    res["all_gather"] = outs
    out = torch.zeros(2 * n, device=dev)
    dist.all_gather_into_tensor(out, t(r + 1, 100 + r), **kw)
    res["all_gather_into_tensor"] = [out]
    out = torch.zeros(2, device=dev)
    dist.reduce_scatter_tensor(out, torch.arange(2 * n, dtype=torch.float32, device=dev) * (r + 1), **kw)
    res["reduce_scatter_tensor"] = [out]
    out = torch.zeros(1, device=dev)
    dist.reduce_scatter(out, [t(10 * k + r) for k in range(n)], **kw)
    res["reduce_scatter"] = [out]
    # uneven: rank r sends k+1 rows to rank k
    send = torch.cat([torch.full((k + 1, 2), float(10 * r + k), device=dev) for k in range(n)])
    recv = torch.zeros((r + 1) * n, 2, device=dev)
    dist.all_to_all_single(recv, send, [r + 1] * n, [k + 1 for k in range(n)], **kw)
    res["all_to_all_single uneven"] = [recv]
    if group is None:
        outs = [torch.zeros(1, device=dev) for _ in range(n)]
        dist.all_to_all(outs, [t(100 * r + k) for k in range(n)], **kw)
        res["all_to_all"] = outs
    else:  # gloo before torch 2.13 has no all_to_all: what rank r receives from each rank k
        res["all_to_all"] = [t(100 * k + r) for k in range(n)]
    g = [torch.zeros(2, device=dev) for _ in range(n)] if r == 0 else None
    dist.gather(t(r, r * r), g, dst=0, **kw)
    res["gather"] = g or []
    out = torch.zeros(2, device=dev)
    dist.scatter(out, [t(k, -k) for k in range(n)] if r == 0 else None, src=0, **kw)
    res["scatter"] = [out]
    if n > 1:
        peer = (r + 1) % n
        src = (r - 1) % n
        got = torch.zeros(3, device=dev)
        ops = [dist.P2POp(dist.isend, t(r, r + 1, r + 2), peer, **kw),
               dist.P2POp(dist.irecv, got, src, **kw)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        res["batch_isend_irecv"] = [got]
    x = t(r + 1, r + 1)
    fut = dist.all_reduce(x, async_op=True, **kw).get_future().then(lambda f: f.value()[0] * 2)
    res["future then"] = [fut.wait()]
    return {k: [v.detach().cpu() for v in vs] for k, vs in res.items()}


def _compare(got, want) -> list:
    bad = []
    for k in want:
        if k not in got:
            bad.append(f"{k}: missing")
            continue
        if len(got[k]) != len(want[k]) or any(
                a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b) for a, b in zip(got[k], want[k])):
            bad.append(f"{k}: {got[k]} vs gloo's {want[k]}")
    return bad


def _staging_on_cpu_rank():
    """The staging logic on CPU tensors: every call through host copies (RumorProcessGroup._staged)
    against the same call run directly."""
    dist = _init("rumor")
    pg = dist.distributed_c10d._get_default_group()
    gloo = dist.new_group(backend="gloo")
    import rumor.torch_backend as tb

    # Every call takes the staged path; the call on the host copies inside it runs directly.
    inside = [0]

    def staged(name, args):
        inside[0] += 1
        try:
            return pg._staged(name, args, torch.device("cpu"))
        finally:
            inside[0] -= 1

    off, plain, real = tb._off_cpu, tb._plain, pg._device_call
    tb._off_cpu = lambda *a: inside[0] == 0
    # The fast path of plain CPU tensors comes before the device check: off outside the staging.
    tb._plain = lambda t: inside[0] > 0 and plain(t)
    pg._device_call = staged
    try:
        staged_results = _calls(dist, "cpu")
        kinds = {type(dist.all_reduce(torch.ones(1), async_op=True)).__name__}
    finally:
        tb._off_cpu, tb._plain, pg._device_call = off, plain, real
    want = _calls(dist, "cpu", group=gloo)
    dist.destroy_process_group()
    return _compare(staged_results, want), kinds


def test_staging_logic_on_cpu_tensors():
    for bad, kinds in harness.run(_staging_on_cpu_rank, 3, timeout=TIMEOUT):
        assert bad == [], bad
        assert kinds == {"_StagedWork"}


def _mixed_rank():
    dist = _init("rumor")
    errs = {}
    for name, fn in {
        "meta": lambda: dist.all_reduce(torch.ones(2, device="meta")),
        "meta in list": lambda: dist.all_gather([torch.zeros(1), torch.zeros(1, device="meta")], torch.ones(1)),
    }.items():
        try:
            fn()
            errs[name] = None
        except Exception as e:  # noqa: BLE001
            errs[name] = (type(e).__name__, str(e))
    t = torch.ones(1)
    dist.all_reduce(t)
    errs["after"] = t.item()
    dist.destroy_process_group()
    return errs


def test_tensors_off_the_cpu_are_refused_clearly():
    for errs in harness.run(_mixed_rank, 2, timeout=TIMEOUT):
        name, msg = errs["meta"]
        assert name == "ValueError" and "meta" in msg and "CPU" in msg and "cuda:nccl" in msg, msg
        name, msg = errs["meta in list"]
        assert name == "ValueError" and "different devices" in msg and "meta" in msg, msg
        assert errs["after"] == 2.0


# ---- on a GPU -----------------------------------------------------------------------------------

def _model(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _train(dist, model, dev, steps: int = 4, hook=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    r = dist.get_rank()
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + r)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x.to(dev)), y.to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def _staged_gpu_rank():
    dist = _init("rumor")
    pg = dist.distributed_c10d._get_default_group()
    torch.cuda.set_device(0)  # both ranks share the one GPU: staging allows it, NCCL would not
    dev = torch.device("cuda", 0)
    gloo = dist.new_group(backend="gloo")
    got = _calls(dist, dev)
    want = _calls(dist, "cpu", group=gloo)
    work = dist.all_reduce(torch.ones(4, device=dev), async_op=True)
    kind = type(work).__name__
    work.wait()
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    diffs = {}
    for name, hook in {"no hook": None, "fp16_compress_hook": default_hooks.fp16_compress_hook}.items():
        on_gpu = _train(dist, _model().to(dev), dev, hook=hook)
        ref = _train_on(dist, gloo, hook)  # the same DDP on gloo, with a CPU model
        diffs[name] = max(float((a - b).abs().max()) for a, b in zip(on_gpu, ref))
    dist.destroy_process_group()
    return _compare(got, want), kind, pg._cuda, diffs


def _train_on(dist, group, hook):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.001)
    if hook is not None:
        ddp.register_comm_hook(group, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    r = dist.get_rank()
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + r)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@needs_gpu
def test_cuda_tensors_are_staged_through_rumor_and_match_gloo():
    for bad, kind, cuda, diffs in harness.run(_staged_gpu_rank, 2, timeout=TIMEOUT):
        assert bad == [], bad
        assert kind == "_StagedWork" and cuda == "rumor"
        # a CUDA model and a CPU one: float32 rounding apart; fp16's compression is the same on both
        assert diffs["no hook"] <= 1e-5, diffs
        assert diffs["fp16_compress_hook"] <= 1e-3, diffs


def _nccl_map_rank(spelling):
    dist = _init(spelling)
    pg = dist.distributed_c10d._get_default_group()
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    gloo = dist.new_group(backend="gloo")
    got = _calls(dist, dev)
    want = _calls(dist, "cpu", group=gloo)
    kinds = {"cuda": type(dist.all_reduce(torch.ones(4, device=dev), async_op=True)).__name__,
             "cpu": type(dist.all_reduce(torch.ones(4), async_op=True)).__name__,
             "backend": type(pg._nccl).__name__}
    # torch's coalescing manager: one NCCL group of calls
    outs = [torch.zeros(2, device=dev), torch.zeros(4, device=dev)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], torch.tensor([1.0, 2.0], device=dev))
        dist.all_gather_into_tensor(outs[1], torch.tensor([3.0, 4.0, 5.0, 6.0], device=dev))
    cm.wait()
    coalesced = [o.cpu().tolist() for o in outs]
    on_gpu = _train(dist, _model().to(dev), dev)
    ref = _train_on(dist, gloo, None)
    diff = max(float((a - b).abs().max()) for a, b in zip(on_gpu, ref))
    dist.destroy_process_group()
    return _compare(got, want), kinds, coalesced, diff


@needs_gpu
@pytest.mark.parametrize("spelling", ["cpu:rumor,cuda:nccl", "cuda:nccl,cpu:rumor"])
def test_device_map_hands_cuda_tensors_to_nccl(spelling):
    ((bad, kinds, coalesced, diff),) = harness.run(_nccl_map_rank, 1, timeout=TIMEOUT, args=(spelling,))
    assert bad == [], bad
    assert kinds["backend"] == "ProcessGroupNCCL", kinds
    assert kinds["cuda"] not in ("RumorWork", "_StagedWork") and kinds["cpu"] == "RumorWork", kinds
    assert coalesced == [[1.0, 2.0], [3.0, 4.0, 5.0, 6.0]]
    assert diff <= 1e-5, diff


def _fsdp_train(dist, group, dev, mp: bool):
    """Three steps of FSDP2 (`fully_shard` per layer and the root) on `group`'s mesh over `dev`;
    with `mp`, parameters in bf16 and gradients reduced in float32 (what CUDA users run)."""
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, torch.device(dev).type)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mp else {}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(200 + dist.get_rank())
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(dev)).float(), y.to(dev)).backward()
        opt.step()
    return [p.full_tensor().detach().cpu().clone() for p in model.parameters()]


def _fsdp_gpu_rank(spelling):
    """FSDP2 on a CUDA model over the default group (`spelling`) against FSDP2 on a CPU model over
    gloo, float32 and bf16 mixed precision."""
    dist = _init(spelling)
    pg = dist.distributed_c10d._get_default_group()
    torch.cuda.set_device(0)
    gloo = dist.new_group(backend="gloo")
    diffs = {}
    for mp in (False, True):
        on_gpu = _fsdp_train(dist, None, "cuda:0", mp)
        ref = _fsdp_train(dist, gloo, "cpu", mp)
        diffs["bf16" if mp else "float32"] = max(float((a - b).abs().max()) for a, b in zip(on_gpu, ref))
    cuda = pg._cuda
    dist.destroy_process_group()
    return cuda, diffs


@needs_gpu
def test_fsdp2_on_cuda_staged_matches_gloo():
    # two ranks share the GPU: rumor stages FSDP2's all-gathers and reduce-scatters through host memory
    for cuda, diffs in harness.run(_fsdp_gpu_rank, 2, timeout=TIMEOUT, args=("rumor",)):
        assert cuda == "rumor"
        assert diffs["float32"] <= 1e-5, diffs
        # bf16 matmuls on the GPU and the CPU round differently; the reductions themselves are float32
        assert diffs["bf16"] <= 2e-2, diffs


@needs_gpu
def test_fsdp2_on_cuda_through_the_nccl_map_matches_gloo():
    # one GPU allows one NCCL rank: FSDP2's collectives go to the NCCL backend the rumor group made
    ((cuda, diffs),) = harness.run(_fsdp_gpu_rank, 1, timeout=TIMEOUT, args=("cpu:rumor,cuda:nccl",))
    assert cuda == "nccl"
    assert diffs["float32"] <= 1e-5, diffs
    assert diffs["bf16"] <= 2e-2, diffs
