"""torch.distributed's backend "rumor" (rumor.torch_backend) against the same calls on gloo.

Each rank joins the default group on "rumor" and makes a gloo group of the same ranks, runs
every call on both and compares the results locally (exact for integers and exact math,
float32 sums to rounding), so one launch covers many calls.
"""
from __future__ import annotations

import datetime
import os

import pytest
import torch

import harness

TIMEOUT = 120


def _init(timeout_s: float = 60.0):
    import torch.distributed as dist

    import rumor  # noqa: F401 (registers the backend)

    dist.init_process_group("rumor", rank=harness.env_rank(), world_size=harness.env_world(),
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist


def _diff(name, got, want, exact=True):
    if isinstance(got, (list, tuple)):
        for i, (g, w) in enumerate(zip(got, want)):
            d = _diff(f"{name}[{i}]", g, w, exact)
            if d:
                return d
        return None if len(got) == len(want) else f"{name}: {len(got)} results vs {len(want)}"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{name}: {got.dtype} {list(got.shape)} vs gloo's {want.dtype} {list(want.shape)}"
    # Sums of a few values in another order: a few units in the last place of the dtype.
    tol = 8 * torch.finfo(got.dtype).eps if got.dtype.is_floating_point else 0
    ok = torch.equal(got, want) if exact else torch.allclose(got, want, rtol=tol, atol=tol)
    return None if ok else f"{name}: {got} vs gloo's {want}"


def _data(seed, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def _collectives_rank():
    dist = _init()
    r, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    bad = []

    def both(name, fn, exact=True):
        got, want = fn(None), fn(gloo)
        d = _diff(name, got, want, exact)
        if d:
            bad.append(d)

    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16):
        exact = not dtype.is_floating_point
        for op in ("SUM", "MIN", "MAX", "PRODUCT"):
            def ar(g, op=op, dtype=dtype):
                t = _data(r + 1, (5, 7), dtype)
                if op == "PRODUCT":
                    t = t.clamp(-2, 2) if not dtype.is_floating_point else t
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g)
                return t
            both(f"all_reduce {op} {dtype}", ar, exact or op in ("MIN", "MAX"))
    # AVG is not on gloo: the sum divided by n, exact for integers (their sum is divisible here).
    t = torch.full((6,), float(r * n), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    want = torch.full((6,), float(sum(range(n))), dtype=torch.float64)
    if not torch.equal(t, want):
        bad.append(f"all_reduce AVG: {t} vs {want}")
    # PREMUL_SUM: each rank's input scaled by the factor, then summed.
    t = _data(r, (9,), torch.float64)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    s = _data(r, (9,), torch.float64) * 0.5
    dist.all_reduce(s, group=gloo)
    if not torch.allclose(t, s, rtol=1e-12):
        bad.append(f"all_reduce PREMUL_SUM: {t} vs {s}")

    def coalesced(g):
        ts = [_data(r + 10, (3,), torch.float32), _data(r + 20, (2, 2), torch.float32)]
        dist.all_reduce_coalesced(ts, group=g)
        return ts
    both("all_reduce_coalesced", coalesced, exact=False)

    def noncontig(g):
        t = _data(r + 3, (4, 6), torch.int64).t()
        dist.all_reduce(t, group=g)
        return t
    both("all_reduce non-contiguous", noncontig)

    for root in range(n):
        def bc(g, root=root):
            t = _data(r + 30, (3, 4), torch.int32)
            dist.broadcast(t, src=root if g is None else root, group=g)
            return t
        both(f"broadcast root {root}", bc)

        def bcb(g, root=root):
            t = torch.tensor([r % 2 == 0, True, r == root])
            dist.broadcast(t, src=root, group=g)
            return t
        both(f"broadcast bool root {root}", bcb)

        def red(g, root=root):
            t = _data(r + 40, (8,), torch.int64)
            dist.reduce(t, dst=root, group=g)
            return t if r == root else torch.zeros(0)
        both(f"reduce root {root}", red)

        def gat(g, root=root):
            t = _data(r + 50, (2, 3), torch.int64)
            out = [torch.empty(2, 3, dtype=torch.int64) for _ in range(n)] if r == root else None
            dist.gather(t, out, dst=root, group=g)
            return out if r == root else []
        both(f"gather root {root}", gat)

        def sca(g, root=root):
            ins = [_data(100 + i, (4,), torch.float32) for i in range(n)] if r == root else None
            out = torch.empty(4)
            dist.scatter(out, ins, src=root, group=g)
            return out
        both(f"scatter root {root}", sca)

    def ag(g):
        out = [torch.empty(3, 2, dtype=torch.int32) for i in range(n)]
        dist.all_gather(out, _data(r, (3, 2), torch.int32), group=g)
        return out
    both("all_gather", ag)
    # blocks of different sizes (gloo refuses them): rank i's block has i + 1 rows
    out = [torch.empty(i + 1, 2, dtype=torch.int16) for i in range(n)]
    dist.all_gather(out, _data(r, (r + 1, 2), torch.int16))
    d = _diff("all_gather uneven", out, [_data(i, (i + 1, 2), torch.int16) for i in range(n)])
    if d:
        bad.append(d)

    def agt(g):
        out = torch.empty(n * 3, 2, dtype=torch.float64)
        dist.all_gather_into_tensor(out, _data(r + 60, (3, 2), torch.float64), group=g)
        return out
    both("all_gather_into_tensor", agt)

    def agt_in_place(g):
        # The input is this rank's block of the output, as FSDP passes it.
        out = torch.zeros(n * 5, dtype=torch.bfloat16)
        out[r * 5:(r + 1) * 5] = _data(r + 61, (5,), torch.bfloat16)
        dist.all_gather_into_tensor(out, out[r * 5:(r + 1) * 5], group=g)
        return out
    both("all_gather_into_tensor in place", agt_in_place)

    def rs(g):
        out = torch.empty(4, dtype=torch.int64)
        dist.reduce_scatter(out, [_data(r * 10 + i, (4,), torch.int64) for i in range(n)], group=g)
        return out
    if True:
        # gloo has no reduce_scatter of lists on CPU in every torch; compare to a sum of gathers.
        got = rs(None)
        parts = [torch.zeros(4, dtype=torch.int64) for _ in range(n)]
        for src in range(n):
            part = _data(src * 10 + r, (4,), torch.int64)
            parts[src] = part
        want = sum(parts)
        if not torch.equal(got, want):
            bad.append(f"reduce_scatter: {got} vs {want}")

    def rst(g):
        out = torch.empty(2, 3, dtype=torch.int32)
        dist.reduce_scatter_tensor(out, _data(r + 70, (2 * n, 3), torch.int32), group=g)
        return out
    both("reduce_scatter_tensor", rst)

    def rst_max(g):
        out = torch.empty(3, dtype=torch.float32)
        dist.reduce_scatter_tensor(out, _data(r + 71, (3 * n,), torch.float32), op=dist.ReduceOp.MAX, group=g)
        return out
    both("reduce_scatter_tensor max", rst_max)

    def a2a_uneven(g):
        # Rank r sends i + r + 1 rows to rank i: every pair's count differs.
        send = [i + r + 1 for i in range(n)]
        recv = [r + j + 1 for j in range(n)]
        t = _data(r + 80, (sum(send), 2), torch.float32)
        out = torch.empty(sum(recv), 2)
        dist.all_to_all_single(out, t, recv, send, group=g)
        return out
    both("all_to_all_single uneven", a2a_uneven)

    def a2a_even(g):
        out = torch.empty(2 * n, dtype=torch.int64)
        dist.all_to_all_single(out, _data(r + 90, (2 * n,), torch.int64), group=g)
        return out
    both("all_to_all_single even", a2a_even)

    def a2a_list(g):
        ins = [_data(r * 7 + i, (i + 1,), torch.int64) for i in range(n)]
        outs = [torch.empty(r + 1, dtype=torch.int64) for _ in range(n)]
        dist.all_to_all(outs, ins, group=g)
        return outs
    # gloo has no all_to_all of lists: each rank j sent its block for r, of r + 1 elements.
    got = a2a_list(None)
    want = [_data(j * 7 + r, (r + 1,), torch.int64) for j in range(n)]
    d = _diff("all_to_all lists", got, want)
    if d:
        bad.append(d)

    # async work and its future: the future's value is the list of result tensors
    t = _data(r + 5, (16,), torch.float32)
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future()
    val = fut.wait()
    w.wait()
    u = _data(r + 5, (16,), torch.float32)
    dist.all_reduce(u, group=gloo)
    if not (isinstance(val, list) and len(val) == 1 and val[0] is t and torch.allclose(t, u)):
        bad.append(f"async all_reduce future: {val} vs {u}")
    if not (w.is_completed() and w.is_success()):
        bad.append("async all_reduce: work not completed/successful after wait()")
    chained = dist.all_reduce(torch.ones(3), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    if not torch.equal(chained.wait(), torch.full((3,), 2.0 * n)):
        bad.append(f"future.then: {chained.value()}")

    dist.barrier()
    return bad


def test_collectives_match_gloo():
    for rank_bad in harness.run(_collectives_rank, 3, timeout=TIMEOUT):
        assert rank_bad == []


def _subgroup_rank():
    dist = _init()
    r = dist.get_rank()
    bad = []
    # torch calls the creator again for each group, with the group's rank and size.
    evens = dist.new_group([0, 2], backend="rumor")
    evens_gloo = dist.new_group([0, 2], backend="gloo")
    odd = dist.new_group([1, 3], backend="rumor")
    for g, gg in ((evens, evens_gloo),):
        if r in (0, 2):
            a, b = _data(r, (5,), torch.int64), _data(r, (5,), torch.int64)
            dist.all_reduce(a, group=g)
            dist.all_reduce(b, group=gg)
            if not torch.equal(a, b):
                bad.append(f"subgroup all_reduce: {a} vs {b}")
            t = torch.tensor([r])
            dist.broadcast(t, src=2, group=g)  # src is a global rank
            if t.item() != 2:
                bad.append(f"subgroup broadcast from global rank 2 gave {t}")
            if dist.get_rank(g) != r // 2 or dist.get_world_size(g) != 2:
                bad.append("subgroup rank/size")
    if r in (1, 3):
        x = torch.tensor([float(r)])
        dist.all_reduce(x, group=odd)
        if x.item() != 4.0:
            bad.append(f"odd subgroup sum {x}")
        # point to point inside a subgroup names global ranks
        if r == 1:
            dist.send(torch.tensor([7, 8]), dst=3, group=odd)
        else:
            y = torch.zeros(2, dtype=torch.int64)
            dist.recv(y, src=1, group=odd)
            if y.tolist() != [7, 8]:
                bad.append(f"subgroup recv {y}")
    # the world group still works after making groups
    z = torch.ones(1)
    dist.all_reduce(z)
    if z.item() != 4:
        bad.append(f"world after subgroups {z}")
    return bad


def test_subgroups():
    for rank_bad in harness.run(_subgroup_rank, 4, timeout=TIMEOUT):
        assert rank_bad == []


def _p2p_rank():
    dist = _init()
    r = dist.get_rank()
    peer = 1 - r
    # Tags are matched independently: the receiver asks for tag 2 first, then tag 1, while
    # the sender sent tag 1 first; each recv gets its own tag's message.
    if r == 0:
        a = dist.isend(torch.full((1000,), 1.0), dst=1, tag=1)
        b = dist.isend(torch.full((3,), 2.0), dst=1, tag=2)
        c = dist.isend(torch.full((3,), 3.0), dst=1, tag=2)
        for w in (a, b, c):
            w.wait()
        got = None
    else:
        x2 = torch.zeros(3)
        dist.recv(x2, src=0, tag=2)
        x1 = torch.zeros(1000)
        dist.recv(x1, src=0, tag=1)
        x3 = torch.zeros(3)
        dist.irecv(x3, src=0, tag=2).wait()
        got = [x1.unique().tolist(), x2.unique().tolist(), x3.unique().tolist()]
    # both ranks post a receive before their send: batch_isend_irecv and plain isend/irecv
    mine = torch.arange(50_000, dtype=torch.float32) + r
    theirs = torch.empty(50_000)
    ops = [dist.P2POp(dist.irecv, theirs, peer), dist.P2POp(dist.isend, mine, peer)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    exchange_ok = torch.equal(theirs, torch.arange(50_000, dtype=torch.float32) + peer)
    # the future of a recv holds the received tensor
    if r == 0:
        fut_val = None
        dist.send(torch.tensor([42]), dst=1)
    else:
        y = torch.zeros(1, dtype=torch.int64)
        fut_val = dist.irecv(y, src=0).get_future().wait()[0].tolist()
    dist.barrier()
    return got, exchange_ok, fut_val


def test_send_recv_tags_and_batch():
    res = harness.run(_p2p_rank, 2, timeout=TIMEOUT)
    assert res[1][0] == [[1.0], [2.0], [3.0]]
    assert res[0][1] and res[1][1]
    assert res[1][2] == [42]


def _dead_rank(timeout_s):
    dist = _init(timeout_s)
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 2:
        os._exit(0)
    try:
        for _ in range(3):
            dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        return type(e).__module__ + "." + type(e).__name__, str(e)
    return None


def test_dead_rank_fails_survivors_within_timeout():
    # gloo would wait its 30-minute default; here the group's 5 s timeout is rumor's deadline,
    # and the harness deadline (well under gloo's) fails the test if a survivor hangs.
    res = harness.run(_dead_rank, 3, timeout=60, args=(5.0,), may_die=(2,))
    for r in (0, 1):
        kind, msg = res[r]
        assert kind == "torch.distributed.DistBackendError", (kind, msg)
        assert "all_reduce" in msg and "rumor backend" in msg, msg


def _bad_input_rank():
    dist = _init()
    errs = {}

    def catch(name, fn):
        try:
            fn()
            errs[name] = None
        except Exception as e:  # noqa: BLE001
            errs[name] = (type(e).__name__, str(e))

    catch("dtype mix", lambda: dist.all_gather_into_tensor(torch.empty(2, dtype=torch.int32), torch.ones(2)))
    catch("band", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.BAND))
    catch("bool sum", lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool)))
    catch("meta tensor", lambda: dist.all_reduce(torch.ones(2, device="meta")))
    catch("splits", lambda: dist.all_to_all_single(torch.empty(3), torch.ones(3), [1, 1], [2, 1]))
    # torch checks dst itself; the group's own check covers callers that reach it directly
    catch("self send", lambda: dist.distributed_c10d._get_default_group().send([torch.ones(1)], 0, 0))
    # after refused calls the group still works
    t = torch.ones(2)
    dist.all_reduce(t)
    errs["after"] = t.tolist()
    return errs


def test_bad_input_is_refused_clearly():
    (errs,) = harness.run(_bad_input_rank, 1, timeout=TIMEOUT)
    # torch or the backend refuses it, naming the dtypes
    assert errs["dtype mix"][0] in ("TypeError", "ValueError") and "int32" in errs["dtype mix"][1]
    assert errs["band"][0] == "ValueError" and "BAND" in errs["band"][1] and "SUM" in errs["band"][1]
    assert errs["bool sum"][0] == "TypeError" and "bool" in errs["bool sum"][1]
    assert errs["meta tensor"][0] == "ValueError" and "CPU" in errs["meta tensor"][1] \
        and "nccl" in errs["meta tensor"][1]
    assert errs["splits"][0] == "ValueError" and "input_split_sizes" in errs["splits"][1]
    assert errs["self send"][0] == "ValueError" and "dst 0" in errs["self send"][1]
    assert errs["after"] == [1.0, 1.0]


def _ddp_rank(hook_name):
    import torch.nn as nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = _init()
    r = dist.get_rank()
    gloo = dist.new_group(backend="gloo")

    def train(group):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))
        # Several buckets, except for PowerSGD: its hook issues collectives from future callbacks,
        # which run on whichever thread completes the future, so with several buckets in flight
        # two ranks may issue them in different orders (gloo has the same race;
        # docs/torch_backend.md). One bucket keeps the order the same on every rank.
        ddp = DDP(model, process_group=group, bucket_cap_mb=25 if hook_name == "powersgd" else 0.001)
        if hook_name == "allreduce":
            ddp.register_comm_hook(group, default_hooks.allreduce_hook)
        elif hook_name == "fp16":
            ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        elif hook_name == "bf16":
            # DDP refuses bf16_compress_hook by name unless torch has NCCL; the same hook through
            # a wrapper runs on CPU (gloo reduces bfloat16 there too).
            def bf16(state, bucket):
                return default_hooks.bf16_compress_hook(state, bucket)
            ddp.register_comm_hook(group, bf16)
        elif hook_name == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                                start_powerSGD_iter=2, random_seed=0)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + r)
        for _ in range(4):
            x, y = torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    mine, ref = train(None), train(gloo)
    return max(float((a - b).abs().max()) for a, b in zip(mine, ref))


@pytest.mark.parametrize("hook", ["none", "allreduce", "fp16", "bf16", "powersgd"])
def test_torch_ddp_matches_gloo(hook):
    for diff in harness.run(_ddp_rank, 2, timeout=TIMEOUT, args=(hook,)):
        # float32 sums of two values are exact and order-free; the 16-bit hooks round the same
        # values the same way, so the runs agree to float32 rounding.
        assert diff <= 1e-6, diff


def _objects_rank():
    from torch.utils.data import DistributedSampler

    dist = _init()
    r, n = dist.get_rank(), dist.get_world_size()
    gathered = [None] * n
    dist.all_gather_object(gathered, {"rank": r, "name": "x" * (r + 1)})
    objs = [{"from": r}, [r] * 3] if r == 1 else [None, None]
    dist.broadcast_object_list(objs, src=1)
    sampler = DistributedSampler(list(range(10)), shuffle=True, seed=3)
    return gathered, objs, list(sampler)


def test_object_collectives_and_sampler():
    res = harness.run(_objects_rank, 2, timeout=TIMEOUT)
    for gathered, objs, _ in res:
        assert gathered == [{"rank": 0, "name": "x"}, {"rank": 1, "name": "xx"}]
        assert objs == [{"from": 1}, [1, 1, 1]]
    # DistributedSampler takes rank and size from the rumor group: disjoint halves of 10
    assert sorted(res[0][2] + res[1][2]) == list(range(10)) and len(res[0][2]) == 5


def test_registration_is_cheap_and_idempotent():
    import torch.distributed as dist

    import rumor.torch_backend as tb

    tb.register()
    assert "RUMOR" in dist.Backend._plugins
    assert dist.Backend("rumor") == "rumor"
    assert "rumor" in dist.Backend.backend_capability and dist.Backend.backend_capability["rumor"] == ["cpu", "cuda"]
    # registering does not take over torch's defaults for CPU or CUDA tensors
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"
    assert dist.Backend.default_device_backend_map["cuda"] == "nccl"


def _fsdp_rank():
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    dist = _init()
    r = dist.get_rank()
    gloo = dist.new_group(backend="gloo")

    def train(group):
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, "cpu")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(200 + r)
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    mine, ref = train(None), train(gloo)
    return max(float((a - b).abs().max()) for a, b in zip(mine, ref))


def test_fsdp2_fully_shard_matches_gloo():
    for diff in harness.run(_fsdp_rank, 2, timeout=TIMEOUT):
        assert diff <= 1e-6, diff


def _dcp_rank(path):
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn

    dist = _init()
    r = dist.get_rank()
    torch.manual_seed(1)
    model = nn.Linear(6, 3)
    state = {"model": model.state_dict(), "step": torch.tensor([7 + 0 * r])}
    dcp.save(state, checkpoint_id=path)
    other = nn.Linear(6, 3)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    loaded = {"model": other.state_dict(), "step": torch.tensor([0])}
    dcp.load(loaded, checkpoint_id=path)
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values())), \
        int(loaded["step"])


def test_distributed_checkpoint_save_load(tmp_path):
    for same, step in harness.run(_dcp_rank, 2, timeout=TIMEOUT, args=(str(tmp_path / "ckpt"),)):
        assert same and step == 7


def _compiled_ddp_rank(outer):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = _init()
    r = dist.get_rank()
    gloo = dist.new_group(backend="gloo")

    def train(group):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 2))
        if outer:  # dynamo traces DDP's own calls on the group too
            ddp = torch.compile(DDP(model, process_group=group), backend="aot_eager")
        else:
            ddp = DDP(torch.compile(model, backend="aot_eager"), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(300 + r)
        for _ in range(3):
            x, y = torch.randn(4, 10, generator=g), torch.randn(4, 2, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    mine, ref = train(None), train(gloo)
    return max(float((a - b).abs().max()) for a, b in zip(mine, ref))


@pytest.mark.parametrize("outer", [False, True], ids=["ddp_of_compiled", "compiled_ddp"])
def test_compiled_model_under_ddp_matches_gloo(outer):
    for diff in harness.run(_compiled_ddp_rank, 2, timeout=TIMEOUT, args=(outer,)):
        assert diff <= 1e-6, diff


def _device_map_rank():
    import torch.distributed as dist

    import rumor  # noqa: F401

    dist.init_process_group("cpu:rumor,cuda:nccl", rank=harness.env_rank(), world_size=harness.env_world(),
                            timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([dist.get_rank() + 1], dtype=torch.int64)
    dist.all_reduce(t)
    pg = dist.distributed_c10d._get_default_group()
    return int(t), type(pg).__name__


def test_device_map_puts_cpu_tensors_on_rumor():
    for total, kind in harness.run(_device_map_rank, 2, timeout=TIMEOUT):
        assert total == 3 and kind == "RumorProcessGroup"


def _wait_timeout_rank():
    dist = _init()
    r = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    if r == 0:
        x = torch.zeros(3)
        w = dist.irecv(x, src=1, tag=3)
        # rank 1 sends only after this rank passed the gloo barrier below, so nothing can arrive
        # within this wait
        try:
            w.wait(datetime.timedelta(milliseconds=300))
            first = None
        except Exception as e:  # noqa: BLE001
            first = (type(e).__name__, str(e))
        dist.barrier(group=gloo)
        w.wait()
        return first, x.tolist()
    dist.barrier(group=gloo)
    dist.send(torch.full((3,), 9.0), dst=0, tag=3)
    return None


def test_work_wait_timeout_then_completes():
    res = harness.run(_wait_timeout_rank, 2, timeout=TIMEOUT)
    first, got = res[0]
    assert first is not None and first[0] == "DistBackendError" and "recv" in first[1], first
    assert got == [9.0, 9.0, 9.0]


def _with_rumor_init_rank():
    import rumor

    dist = _init()
    rumor.init()  # meets its peers through torch's default store, next to the backend's group
    a = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(a)
    b = rumor.allreduce(torch.tensor([float(dist.get_rank() + 1)]), op=rumor.ReduceOp.SUM)
    c = torch.tensor([2.0])
    dist.all_reduce(c, op=dist.ReduceOp.PRODUCT)
    rumor.shutdown()
    return a.item(), b.item(), c.item()


def test_coexists_with_rumor_init():
    for got in harness.run(_with_rumor_init_rank, 2, timeout=TIMEOUT):
        assert got == (3.0, 3.0, 4.0)


def _monitored_rank():
    """gloo's monitored_barrier semantics through rumor.torch_backend.monitored_barrier: all
    arrive -> all pass; group rank 2 stays away -> rank 0 names it, rank 1 hears rank 0 did not
    release it; two stay away with wait_all_ranks -> rank 0 names both. Each outcome is gloo's."""
    import re

    import torch.distributed as dist

    from rumor.torch_backend import monitored_barrier

    dist_ = _init()
    r = dist_.get_rank()
    short = datetime.timedelta(seconds=2)
    out = {}

    def outcome(group, skip, wait_all):
        if r in skip:
            return "skipped"
        try:
            if group is None:
                monitored_barrier(timeout=short, wait_all_ranks=wait_all)
            else:
                dist.monitored_barrier(group, timeout=short, wait_all_ranks=wait_all)
            return "passed"
        except RuntimeError as e:
            if r != 0:
                return "failed"
            m = re.search(r"[Rr]anks? ([\d, ]+) failed to pass", str(e))
            if not m:
                return f"failed: {e}"
            return f"failed {sorted(int(x) for x in m.group(1).replace(',', ' ').split())}"

    for name, skip, wait_all in (("all", (), False), ("one", (2,), False), ("two", (1, 2), True)):
        got = outcome(None, skip, wait_all)
        dist.barrier()
        # A failed monitored_barrier breaks gloo's group: a fresh one for each case.
        want = outcome(dist.new_group(backend="gloo"), skip, wait_all)
        dist.barrier()
        out[name] = (got, want)
    # torch's own function refuses rumor's group, which is why rumor has one.
    try:
        dist.monitored_barrier(timeout=short)
        out["torch"] = "accepted"
    except ValueError as e:
        out["torch"] = "refused" if "GLOO" in str(e) else str(e)
    dist.barrier()
    # Passing barriers leave one release key in the group's store at most: the latest. (A fresh
    # group: after the failed cases above the ranks' barrier counts differ, as gloo's group is
    # broken after a failure.)
    pg = dist.new_group(backend="rumor")
    for _ in range(3):
        monitored_barrier(pg, timeout=short)
    out["keys"] = [k for k in range(3) if pg._store.check([f"monitored/{k}/released"])]
    dist.barrier()
    return out


def test_monitored_barrier_matches_gloo():
    res = harness.run(_monitored_rank, 3, timeout=TIMEOUT)
    for r, out in enumerate(res):
        assert out.pop("torch") == "refused"
        assert out.pop("keys") == [2], r
        for name, (got, want) in out.items():
            assert got == want, (r, name, got, want)
    assert res[0]["one"][0] == "failed [2]"
    assert res[0]["two"][0] == "failed [1, 2]"
    assert res[1]["one"][0] == "failed"
    assert res[2]["all"][0] == "passed"


def _gather_coalesced_rank():
    dist = _init()
    r, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    bad = []
    # Inputs of different shapes, one of them empty; each rank's values its own.
    for dtype, shapes in ((torch.int64, [(2, 3), (0,), (5,)]), (torch.complex64, [(4,), (1, 2)])):
        def run(g, dtype=dtype, shapes=shapes):
            ins = [_data(r * 10 + i, s, torch.float32).to(dtype) if dtype.is_complex else _data(r * 10 + i, s, dtype)
                   for i, s in enumerate(shapes)]
            outs = [[torch.full(s, -1, dtype=dtype) for s in shapes] for _ in range(n)]
            dist.all_gather_coalesced(outs, ins, group=g)
            return [t for o in outs for t in o]
        got, want = run(None), run(gloo)
        d = _diff(f"all_gather_coalesced {dtype}", got, want)
        if d:
            bad.append(d)
    # async: the future completes with the gathered tensors in place.
    ins = [_data(r, (3,), torch.float64)]
    outs = [[torch.empty(3, dtype=torch.float64)] for _ in range(n)]
    dist.all_gather_coalesced(outs, ins, async_op=True).wait()
    d = _diff("all_gather_coalesced async", [o[0] for o in outs], [_data(i, (3,), torch.float64) for i in range(n)])
    if d:
        bad.append(d)
    dist.destroy_process_group()
    return bad


def test_all_gather_coalesced_matches_gloo():
    for rank_bad in harness.run(_gather_coalesced_rank, 3, timeout=TIMEOUT):
        assert rank_bad == []


def _compiled_group_call(r):
    """Collectives on the rumor group from a compiled function; returns (result equal to the
    eager run's, graphs compiled, graph breaks)."""
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    def step(x):
        y = x + 1
        dist.all_reduce(y)
        dist.broadcast(y, src=0)
        return y * 2

    torch._dynamo.reset()
    counters.clear()
    x = _data(r + 11, (8,), torch.float64)
    got = torch.compile(step, backend="eager")(x)
    graphs, breaks = int(counters["stats"]["unique_graphs"]), len(counters["graph_break"])
    torch._dynamo.reset()
    return torch.equal(got, step(x)), graphs, breaks


def _inline_work_rank():
    """Ops at most RUMOR_TORCH_INLINE_BYTES run on the caller's thread and come back complete;
    larger ones go through the communicator's thread; a failure of either surfaces at wait()."""
    dist = _init()
    r, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, numel in (("small", 16), ("large", (64 << 10) // 4 + 1)):
        # non-contiguous: the result is copied back into the caller's tensor by finish()
        base = _data(r + 7, (2, numel), torch.float64)
        t, want = base.t(), base.t().clone()
        w = dist.all_reduce(t, async_op=True)
        done_at_issue = w.is_completed() if name == "small" else None
        fut = w.get_future()
        val = fut.wait()
        w.wait()
        dist.all_reduce(want, group=gloo)
        out[name] = dict(done_at_issue=done_at_issue, success=w.is_success(), same=val[0] is t,
                         result_is_t=w.result()[0] is t, exact=torch.allclose(t, want, rtol=1e-12, atol=0),
                         error=w.exception())
    pg = dist.distributed_c10d._get_default_group()
    # Above the inline size, what torch waits for at once (no async_op) also runs on the
    # caller's thread; DDP's and async_op=True's calls go to the communicator's thread.
    real, calls = pg._comm, []

    class Spy:
        def __getattr__(self, name):
            def call(*a):
                calls.append((name, a[-1]))  # the core's last argument: nonblocking
                return getattr(real, name)(*a)
            return call

    big = (64 << 10) // 8 + 3
    pg._comm = Spy()
    try:
        a, b, c = (_data(r + k, (big,), torch.float64) for k in (1, 2, 3))
        dist.all_reduce(a)
        dist.all_reduce(b, async_op=True).wait()
        dist.broadcast(c, src=1)
    finally:
        pg._comm = real
    a2, b2, c2 = (_data(r + k, (big,), torch.float64) for k in (1, 2, 3))
    dist.all_reduce(a2, group=gloo)
    dist.all_reduce(b2, group=gloo)
    dist.broadcast(c2, src=1, group=gloo)
    out["nonblocking"] = calls
    out["sync_exact"] = [torch.allclose(x, y, rtol=1e-12, atol=0) for x, y in ((a, a2), (b, b2))] + [torch.equal(c, c2)]
    out["compiled"] = _compiled_group_call(r)
    dist.barrier(group=gloo)
    pg.abort()
    errs = {}
    for name, numel in (("small", 4), ("large", 1 << 16)):
        try:
            w = dist.all_reduce(torch.ones(numel), async_op=True)
        except Exception as e:  # noqa: BLE001 (a large op may be refused at issue)
            errs[name] = ("issue", type(e).__name__, str(e))
            continue
        try:
            w.wait()
            errs[name] = ("none",)
        except Exception as e:  # noqa: BLE001
            errs[name] = ("wait", type(e).__name__, str(e))
    out["aborted"] = errs
    dist.barrier(group=gloo)
    return out


def test_inline_and_queued_works_complete_and_fail_at_wait():
    for r, got in enumerate(harness.run(_inline_work_rank, 2, timeout=TIMEOUT)):
        for name in ("small", "large"):
            d = got[name]
            assert d["success"] and d["same"] and d["result_is_t"] and d["exact"] and d["error"] is None, (name, d)
        assert got["small"]["done_at_issue"] is True
        assert got["nonblocking"] == [("allreduce", False), ("allreduce", True), ("broadcast", False)], got
        assert got["sync_exact"] == [True, True, True]
        for name in ("small", "large"):
            e = got["aborted"][name]
            assert e[0] in ("issue", "wait") and e[1] == "DistBackendError" and "all_reduce" in e[2], (name, e)
        # the small op's failure waits for wait(), as an asynchronous op's does
        assert got["aborted"]["small"][0] == "wait"
        # a compiled function's call on the group breaks its graph there and runs eagerly, with
        # nothing the group's method calls compiled: two graphs, around the call
        same, graphs, breaks = got["compiled"]
        assert same and graphs == 2 and breaks >= 1, got["compiled"]


def _polling_rank():
    import time

    dist = _init()
    r, n = dist.get_rank(), dist.get_world_size()
    # 512 KiB: past RUMOR_TORCH_INLINE_BYTES, so it runs on the group's thread while this one polls
    x = torch.full((1 << 17,), float(r + 1))
    outs = [torch.zeros_like(x) for _ in range(n)]
    w = dist.all_gather(outs, x, async_op=True)
    deadline = time.monotonic() + 60
    while not w.is_completed():
        assert time.monotonic() < deadline, "all_gather never completed"
        time.sleep(1e-3)
    # read without wait(): is_completed() promised the results are there
    got = sorted({float(v) for o in outs for v in (o[0], o[-1])})
    a, b = torch.zeros(2 * n), torch.zeros(4 * n)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(a, torch.full((2,), float(r)))
        dist.all_gather_into_tensor(b, torch.full((4,), float(r)))
    while not all(w.is_completed() for w in cm.works):
        assert time.monotonic() < deadline, "the coalesced work never completed"
        time.sleep(1e-3)
    return got, a.tolist(), b.tolist()


def test_a_polled_work_holds_its_results_once_completed():
    for got, a, b in harness.run(_polling_rank, 2, timeout=TIMEOUT):
        assert got == [1.0, 2.0]
        assert a == [0.0, 0.0, 1.0, 1.0] and b == [0.0] * 4 + [1.0] * 4


def _bind_rank():
    cpus = sorted(os.sched_getaffinity(0))
    dist = _init()
    bound = sorted(os.sched_getaffinity(0))
    sub = dist.new_group([1, 3], backend="rumor")  # a subgroup's local ranks do not bind again
    t = torch.ones(1)
    if dist.get_rank() in (1, 3):
        dist.all_reduce(t, group=sub)
    dist.barrier()  # rank 0 holds the store the subgroup met through
    return cpus, bound, sorted(os.sched_getaffinity(0)), t.item()


def test_bind_cores_binds_by_the_default_groups_local_rank():
    """RUMOR_BIND_CORES=1 (rumor-run --bind-cores) binds a backend-only job's ranks as rumor.init()
    does: where the host has more ranks than CPUs, local rank i to the i-th CPU (modulo)."""
    res = harness.run(_bind_rank, 4, timeout=TIMEOUT, env={"RUMOR_BIND_CORES": "1"})
    for rank, (cpus, bound, later, total) in enumerate(res):
        want = cpus if len(cpus) >= 4 else [cpus[rank % len(cpus)]]
        assert bound == want and later == want, (rank, cpus, bound, later)
        assert total == (2.0 if rank in (1, 3) else 1.0)
