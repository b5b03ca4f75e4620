"""One-sided windows (rumor.win_*) and the window optimizers, on spawned ranks.

Closed forms for put / accumulate / get / update on the default ExponentialGraph, a ring and a
dynamic dst_weights subset (x_i = rank); push-sum weights; reset, clone and versions; mutex
ordering; every float dtype; errors; passive progress (a rank that makes no call while the others
put to it); a dead peer; the optimizers against exact references and push-sum's invariants.
Both transports: shared memory (one host) and TCP (RUMOR_SHM=0); two emulated hosts are covered
by test_multihost.py.
"""
from __future__ import annotations

import os

import pytest

import harness
from harness import Checker

# (world size, shared memory)
LAYOUTS = [(1, True), (2, False), (3, True), (4, False), (5, True)]


def _finish(chk):
    import rumor

    rumor.barrier()
    return chk.failures, chk.count


def ops_rank(stage=False):
    import rumor
    import torch
    from rumor import topology as T
    from rumor.neighbor import window

    window._STAGE_CPU = stage  # the CUDA tensors' staging through host twins, on CPU tensors
    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()
    full = lambda v, like: torch.full_like(like, float(v))  # noqa: E731

    # -- default topology (ExponentialGraph), win_put with defaults, win_update with defaults
    x = torch.full((3, 5), float(r))
    rumor.win_create(x, "x")
    chk.check(rumor.get_current_created_window_names() == ["x"], "window names")
    # Before any put the slots hold this rank's own tensor.
    got = rumor.win_update("x", clone=True)
    chk.close(got, full(r, x), "update before any put")
    rumor.barrier()
    rumor.win_put(x, "x")
    rumor.barrier()
    topo = T.ExponentialGraph(n)
    ins = topo.in_neighbor_ranks(r)
    chk.check(rumor.get_win_version("x") == {j: 1 for j in ins}, f"versions after one put: {rumor.get_win_version('x')}")
    out = rumor.win_update("x")
    chk.check(out.data_ptr() == x.data_ptr(), "win_update is in place")
    chk.close(x, full((r + sum(ins)) / (len(ins) + 1), x), "uniform update on ExponentialGraph")
    chk.check(all(v == 0 for v in rumor.get_win_version("x").values()), "versions drop to 0 after update")
    # The tensor changed since: an update combines its current value (a staged window's host
    # copy must be refreshed first).
    x.add_(1.0)
    got = rumor.win_update("x", self_weight=1.0, neighbor_weights={}, clone=True)
    chk.equal(got, x, "update reads the tensor's current value")
    rumor.barrier()
    rumor.win_free("x")
    chk.check(rumor.get_current_created_window_names() == [], "freed")

    # -- directed ring, accumulate twice into zero-initialised slots, then collect
    if n > 1:
        ring = T.RingGraph(n, style=1)
        rumor.set_topology(ring)
        prev = ring.in_neighbor_ranks(r)
        y = torch.full((7,), float(r + 1), dtype=torch.float64)
        rumor.win_create(y, "ring", zero_init=True)
        nxt = ring.out_neighbor_ranks(r)
        for _ in range(2):
            rumor.win_accumulate(y, "ring", dst_weights={j: 0.5 for j in nxt})
        rumor.barrier()
        rumor.win_update_then_collect("ring")
        chk.equal(y, full(r + 1 + sum(j + 1 for j in prev), y), "accumulate x2 then collect (ring)")
        # reset zeroed the slots: a second collect adds nothing
        rumor.barrier()
        before = y.clone()
        rumor.win_update_then_collect("ring")
        chk.equal(y, before, "collect after reset adds nothing")
        rumor.barrier()
        rumor.win_free("ring")
        rumor.set_topology(T.ExponentialGraph(n))

    # -- dynamic subset outside the topology: put to rank + 2 only, weight 2, self_weight 0.5
    if n > 2:
        z = torch.full((4,), float(r))
        rumor.win_create(z, "dyn", zero_init=True)
        dst = (r + 2) % n
        rumor.win_put(z, "dyn", self_weight=0.5, dst_weights={dst: 2.0})
        chk.equal(z, full(0.5 * r, z), "win_put scales the tensor by self_weight afterwards")
        rumor.barrier()
        src = (r - 2) % n
        got = rumor.win_update("dyn", self_weight=1.0, neighbor_weights={src: 1.0}, clone=True)
        chk.equal(got, full(0.5 * r + 2.0 * src, z), "dynamic dst_weights subset")
        chk.equal(z, full(0.5 * r, z), "clone leaves the registered tensor alone")
        rumor.barrier()
        # win_get pulls 0.5 * the value rank - 1 published: its put of the registered tensor
        # published the tensor after the self_weight scaling, 0.5 * (r - 1)
        rumor.win_get("dyn", src_weights={(r - 1) % n: 0.5})
        got = rumor.win_update("dyn", self_weight=0.0, neighbor_weights={(r - 1) % n: 1.0}, clone=True)
        chk.equal(got, full(0.25 * ((r - 1) % n), z), "win_get reads the published value")
        rumor.barrier()
        z.fill_(10.0 * r)  # not visible to win_get until published
        rumor.win_get("dyn", src_weights={(r - 1) % n: 1.0})
        got = rumor.win_update("dyn", self_weight=0.0, neighbor_weights={(r - 1) % n: 1.0}, clone=True)
        chk.equal(got, full(0.5 * ((r - 1) % n), z), "win_get before win_publish")
        rumor.barrier()
        rumor.win_publish("dyn")
        rumor.barrier()
        h = rumor.win_get_nonblocking("dyn", src_weights={(r - 1) % n: 1.0})
        h.wait()
        chk.check(rumor.win_poll(h), "poll after wait")
        got = rumor.win_update("dyn", self_weight=0.0, neighbor_weights={(r - 1) % n: 1.0}, clone=True)
        chk.equal(got, full(10.0 * ((r - 1) % n), z), "win_get after win_publish")
        rumor.barrier()
        rumor.win_free("dyn")

    # -- push-sum weight p: carried with puts, scaled by self_weight, combined by update
    if n > 1:
        rumor.turn_on_win_ops_with_associated_p()
        q = torch.full((5,), float(r), dtype=torch.float64)
        rumor.win_create(q, "p", zero_init=True)
        chk.check(rumor.win_associated_p("p") == 1.0, "p starts at 1")
        nxt, prv = (r + 1) % n, (r - 1) % n
        rumor.win_accumulate(q, "p", self_weight=0.5, dst_weights={nxt: 0.5})
        chk.check(rumor.win_associated_p("p") == 0.5, "p scaled by self_weight")
        rumor.barrier()
        rumor.win_update("p", self_weight=1.0, neighbor_weights={prv: 1.0}, reset=True)
        chk.check(rumor.win_associated_p("p") == 1.0, f"p after collect: {rumor.win_associated_p('p')}")
        chk.equal(q, full(0.5 * r + 0.5 * prv, q), "push-sum x after collect")
        rumor.barrier()
        rumor.win_free("p")
        rumor.turn_off_win_ops_with_associated_p()

    # -- mutex ordering: rank 1 holds rank 0's mutex while it puts a new value; rank 0's update
    #    with require_mutex can only run after the release, so it must see that value.
    if n > 1:
        m = torch.zeros(1000)
        rumor.win_create(m, "mutex", zero_init=True)
        if r == 1:
            with rumor.win_mutex("mutex", ranks=[0]):
                rumor.barrier()
                rumor.win_put(torch.full_like(m, 7.0), "mutex", dst_weights={0: 1.0})
        elif r == 0:
            rumor.barrier()
            got = rumor.win_update("mutex", self_weight=0.0, neighbor_weights={1: 1.0}, clone=True,
                                   require_mutex=True)
            chk.equal(got, full(7.0, m), "update with require_mutex waits for the holder")
        else:
            rumor.barrier()
        rumor.barrier()
        with rumor.win_mutex("mutex", for_self=True):
            pass
        rumor.win_free("mutex")

    # -- every float dtype
    if n > 1:
        for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            t = torch.full((33,), float(r + 1), dtype=dt)
            rumor.win_create(t, f"dt{dt}", zero_init=True)
            rumor.win_put(t, f"dt{dt}", dst_weights={(r + 1) % n: 0.5})
            rumor.barrier()
            rumor.win_update(f"dt{dt}", self_weight=0.5, neighbor_weights={(r - 1) % n: 1.0})
            chk.equal(t, full(0.5 * (r + 1) + 0.5 * ((r - 1) % n + 1), t), f"{dt}")
            rumor.barrier()
        rumor.win_free()

    # -- errors: clear exceptions, nothing corrupted
    def raises(exc, fn, what):
        try:
            fn()
        except exc:
            chk.check(True, what)
        except Exception as e:  # noqa: BLE001
            chk.check(False, f"{what}: raised {type(e).__name__}: {e}")
        else:
            chk.check(False, f"{what}: did not raise")

    e = torch.zeros(4)
    rumor.win_create(e, "err")
    raises(ValueError, lambda: rumor.win_put(e, "nope"), "unknown window")
    raises(ValueError, lambda: rumor.win_create(e, "err"), "duplicate name")
    raises(ValueError, lambda: rumor.win_put(torch.zeros(5), "err"), "size mismatch")
    raises(ValueError, lambda: rumor.win_put(e.double(), "err"), "dtype mismatch")
    raises(TypeError, lambda: rumor.win_create(torch.zeros(4, dtype=torch.int32), "ints"), "int window")
    raises(ValueError, lambda: rumor.win_put(e, "err", dst_weights={r: 1.0}), "self as destination")
    raises(ValueError, lambda: rumor.win_put(e, "err", dst_weights={n: 1.0}), "rank outside the world")
    raises(ValueError, lambda: rumor.win_update("err", self_weight=0.5), "self_weight without neighbor_weights")
    rumor.barrier()
    rumor.win_free("err")
    raises(ValueError, lambda: rumor.win_update("err"), "freed window")
    # Ranks that disagree on the size: ValueError on every rank, and the name stays free.
    if n > 1:
        raises(ValueError, lambda: rumor.win_create(torch.zeros(4 + (r == n - 1)), "bad"), "size disagreement")
        chk.check("bad" not in rumor.get_current_created_window_names(), "failed create leaves nothing")
    return _finish(chk)


@pytest.mark.parametrize("world,shm", LAYOUTS, ids=[f"{n}ranks-{'shm' if s else 'tcp'}" for n, s in LAYOUTS])
def test_window_ops(world, shm):
    res = harness.run(ops_rank, world, timeout=90, env={"RUMOR_SHM": "1" if shm else "0"})
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(res) for f in fs]
    assert not failures, "\n".join(failures)
    assert all(count > 5 for _, count in res)


@pytest.mark.parametrize("world,shm", [(2, False), (3, True)], ids=["2ranks-tcp", "3ranks-shm"])
def test_window_ops_staged(world, shm):
    """The same checks with every tensor staged through a host twin, as CUDA tensors are."""
    res = harness.run(ops_rank, world, timeout=90, args=(True,), env={"RUMOR_SHM": "1" if shm else "0"})
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(res) for f in fs]
    assert not failures, "\n".join(failures)
    assert all(count > 5 for _, count in res)


def passive_rank(flag_dir):
    """Rank 0 makes no rumor call while the others put to it and wait for their puts to land;
    it only watches for their files (bounded by the run's deadline)."""
    import time

    import rumor
    import torch

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    x = torch.full((1 << 16,), float(r))
    rumor.win_create(x, "passive", zero_init=True)
    if r == 0:
        deadline = time.monotonic() + 60
        while sum(os.path.exists(os.path.join(flag_dir, f"put{j}")) for j in range(1, n)) < n - 1:
            if time.monotonic() > deadline:
                raise AssertionError("the peers' puts did not complete while rank 0 made no call")
            time.sleep(0.01)
        got = rumor.win_update("passive", self_weight=0.0, neighbor_weights={j: 1.0 for j in range(1, n)})
        want = float(sum(range(1, n)) * 2)
        assert torch.equal(got, torch.full_like(x, want)), f"rank 0 found {got[:4]}, expected {want}"
    else:
        rumor.win_put(x, "passive", dst_weights={0: 2.0})  # returns once it landed at rank 0
        open(os.path.join(flag_dir, f"put{r}"), "w").close()
    rumor.barrier()
    rumor.win_free()
    return True


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_passive_progress(tmp_path, shm):
    assert harness.run(passive_rank, 3, timeout=90, args=(str(tmp_path),),
                       env={"RUMOR_SHM": "1" if shm else "0"}) == [True] * 3


def dead_peer_rank():
    import time

    import rumor
    import torch

    rumor.init()
    x = torch.ones(1 << 14)
    rumor.win_create(x, "dead")
    rumor.barrier()
    if rumor.rank() == 1:
        os._exit(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            rumor.win_put(x, "dead", dst_weights={1: 1.0})
        except rumor.PeerError as e:
            return str(e)
        time.sleep(0.01)
    raise AssertionError("puts to a dead rank kept succeeding")


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_dead_peer_raises(shm):
    res = harness.run(dead_peer_rank, 2, timeout=90, may_die=[1],
                      env={"RUMOR_SHM": "1" if shm else "0", "RUMOR_TIMEOUT": "20"})
    assert "rank 1" in res[0], res[0]


# ---- optimizers ------------------------------------------------------------------------------------

def _model(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


def optim_first_step_rank(kind):
    """Step 1 of WinPut / PullGet: x1 = W x0 - lr * g(x0) with W the uniform ExponentialGraph
    weights, checked exactly against every rank's x0 and g(x0) gathered."""
    import rumor
    import torch
    from rumor import topology as T

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    model = _model(100 + r)  # different initial weights per rank: nothing broadcasts them
    opt = getattr(rumor.optim, kind)(torch.optim.SGD(model.parameters(), lr=0.1), model)
    x0 = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    torch.manual_seed(7 + r)
    data, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    rumor.barrier()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(data), target).backward()
    g0 = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    # The exchange started in forward is one-sided: without this barrier a neighbour's put may
    # land after this rank combined (or a neighbour may publish its step-1 values before this
    # rank's get), which is the point of the method but not a closed form.
    for h in opt._handles:
        h.wait()
    rumor.barrier()
    opt.step()
    x1 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    xs = rumor.allgather(x0.unsqueeze(0))
    topo = T.ExponentialGraph(n)
    sw, srcs = topo.uniform_receive_weights(r)
    want = sw * xs[r] + sum(w * xs[j] for j, w in srcs.items()) - 0.1 * g0
    ok = torch.allclose(x1, want, rtol=0, atol=1e-12)
    rumor.barrier()
    opt.free_windows()
    return ok, float((x1 - want).abs().max())


@pytest.mark.parametrize("kind", ["DistributedWinPutOptimizer", "DistributedPullGetOptimizer"])
def test_window_optimizer_first_step(kind):
    res = harness.run(optim_first_step_rank, 3, timeout=90, args=(kind,))
    assert all(ok for ok, _ in res), res


def pushsum_rank(steps_base, steps_extra):
    """No gradients (lr 0): push-sum only mixes. Unequal step counts per rank on a directed ring.
    The sums over ranks of z = x * p and of p are preserved, and every x reaches the average."""
    import rumor
    import torch
    from rumor import topology as T

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    rumor.set_topology(T.RingGraph(n, style=1))
    model = _model(200 + r)
    opt = rumor.optim.DistributedPushSumOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model)
    x0 = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    # Lockstep rounds first (each round's pushes land before anyone collects), so the mixing
    # rate is the graph's and not the scheduler's; then unequal extra steps per rank.
    for _ in range(steps_base):
        opt.step()
        opt._wait()
        rumor.barrier()
    for _ in range(steps_extra * r):
        opt.step()
    opt._wait()
    rumor.barrier()  # every push has landed
    opt.synchronize()
    x = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    p = opt.associated_p()
    z = x * p
    sums = rumor.allreduce(torch.stack([z, x0]), op=rumor.ReduceOp.SUM)
    psum = rumor.allreduce(torch.tensor([p], dtype=torch.float64), op=rumor.ReduceOp.SUM)
    avg = sums[1] / n
    rumor.barrier()
    opt.free_windows()
    return (float((sums[0] - sums[1]).abs().max()), float(psum[0]), float((x - avg).abs().max()))


def test_pushsum_preserves_sums_and_converges():
    res = harness.run(pushsum_rank, 4, timeout=120, args=(40, 7))
    for r, (dz, psum, dist) in enumerate(res):
        assert dz < 1e-12, f"rank {r}: sum of z moved by {dz}"
        assert abs(psum - 4.0) < 1e-12, f"rank {r}: sum of p is {psum}"
        assert dist < 1e-4, f"rank {r}: x is {dist} from the average"


def train_rank(kind, stage=False):
    """A few steps of training on a shared regression problem: the loss drops and the replicas
    stay close (consensus + gradient). A barrier per step keeps the ranks in lockstep, so the
    bound on the spread is the algorithm's and not the scheduler's (2 cores, 3 ranks)."""
    import rumor
    import torch
    from rumor.neighbor import window

    window._STAGE_CPU = stage
    rumor.init()
    r = rumor.rank()
    model = _model(300 + r)
    opt = getattr(rumor.optim, kind)(torch.optim.SGD(model.parameters(), lr=0.05), model)
    torch.manual_seed(0)
    w_true = torch.randn(6, 1, dtype=torch.float64)
    losses = []
    gen = torch.Generator().manual_seed(1000 + r)
    for _ in range(60):
        data = torch.randn(16, 6, dtype=torch.float64, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data), data @ w_true)
        loss.backward()
        opt.step()
        losses.append(float(loss))
        rumor.barrier()
    if hasattr(opt, "synchronize"):
        opt._wait()
        rumor.barrier()
        opt.synchronize()
    x = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = rumor.allreduce(x, op=rumor.ReduceOp.MAX) - rumor.allreduce(x, op=rumor.ReduceOp.MIN)
    rumor.barrier()
    opt.free_windows()
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5, float(spread.max())


@pytest.mark.parametrize("kind,stage", [("DistributedWinPutOptimizer", False), ("DistributedPullGetOptimizer", False),
                                        ("DistributedPushSumOptimizer", False), ("DistributedPushSumOptimizer", True)])
def test_window_optimizers_train(kind, stage):
    res = harness.run(train_rank, 3, timeout=120, args=(kind, stage))
    for r, (first, last, spread) in enumerate(res):
        assert last < 0.7 * first, f"rank {r}: loss {first:.4f} -> {last:.4f}"
        assert spread < 0.5, f"replicas spread {spread}"


def stress_rank(rounds):
    """Every other rank puts and accumulates into rank 0 as fast as it can while rank 0 combines
    and collects: each combined tensor must be one whole version per sender (all elements equal
    to a value that sender put), and the accumulated ones must add up exactly."""
    import rumor
    import torch

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    k = 1 << 17  # 512 KiB: a copy that is not guarded gets interrupted
    x = torch.zeros(k)
    acc = torch.zeros(k, dtype=torch.float64)
    rumor.win_create(x, "stress", zero_init=True)
    rumor.win_create(acc, "stress_acc", zero_init=True)
    senders = {j: 1.0 for j in range(1, n)}
    if r == 0:
        collected, reads, bad = 0.0, 0, []
        done = rumor.barrier  # the senders' barrier below marks the end
        import threading

        finished = threading.Event()

        def wait_senders():
            done()
            finished.set()

        t = threading.Thread(target=wait_senders)
        t.start()
        while True:
            last = finished.is_set()
            for j in senders:
                got = rumor.win_update("stress", self_weight=0.0, neighbor_weights={j: 1.0}, clone=True)
                v = float(got[0])
                if not torch.all(got == v) or (v != 0 and (int(v) % 1000) != j):
                    bad.append(f"torn or foreign read from rank {j}: {got.unique()[:5].tolist()}")
            got = rumor.win_update("stress_acc", self_weight=0.0, neighbor_weights=senders, reset=True, clone=True)
            if not torch.all(got == got[0]):
                bad.append("torn accumulate")
            collected += float(got[0])
            reads += 1
            if last:
                break
        t.join()
        want = float(sum(range(1, n)) * rounds)
        assert not bad, bad[:5]
        assert collected == want, f"accumulated {collected}, expected {want} (lost or duplicated updates)"
        assert reads > 1
    else:
        one = torch.full((k,), float(r), dtype=torch.float64)
        v = torch.empty(k)
        for t in range(1, rounds + 1):
            v.fill_(float(t * 1000 + r))  # every element carries the version: a torn read shows
            rumor.win_put(v, "stress", dst_weights={0: 1.0})
            rumor.win_accumulate(one, "stress_acc", dst_weights={0: 1.0})
        rumor.barrier()
    rumor.barrier()
    rumor.win_free()
    return True


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_concurrent_puts_no_torn_reads_nothing_lost(shm):
    assert harness.run(stress_rank, 4, timeout=120, args=(150,), env={"RUMOR_SHM": "1" if shm else "0"}) == [True] * 4


# ---- on a GPU: windows of CUDA tensors, staged through host twins (docs/gpu.md) -----------------

def gpu_window_rank():
    import rumor
    import torch

    torch.cuda.set_device(0)
    rumor.init()
    n, r = rumor.size(), rumor.rank()
    dev = torch.device("cuda", 0)
    nxt, prv = (r + 1) % n, (r - 1) % n
    x = torch.full((1000,), float(r), device=dev)
    rumor.win_create(x, "g", zero_init=True)
    rumor.win_put(x, "g", self_weight=0.5, dst_weights={nxt: 1.0})
    rumor.barrier()
    out = rumor.win_update("g", self_weight=1.0, neighbor_weights={prv: 1.0})
    checks = {"update in place on the device": out.data_ptr() == x.data_ptr() and out.device == dev,
              "put, scale, update": torch.equal(x.cpu(), torch.full((1000,), 0.5 * r + prv))}
    rumor.barrier()
    # The put published 0.5 * r (after its self_weight scaling); the update then published x.
    rumor.win_get("g", src_weights={prv: 1.0})
    got = rumor.win_update("g", self_weight=0.0, neighbor_weights={prv: 1.0}, clone=True)
    checks["get reads the published value"] = got.device == dev and torch.equal(
        got.cpu(), torch.full((1000,), 0.5 * prv + (prv - 1) % n))
    rumor.barrier()
    try:
        rumor.win_put(torch.zeros(1000), "g")
        checks["a CPU tensor into a CUDA window is refused"] = False
    except ValueError:
        checks["a CPU tensor into a CUDA window is refused"] = True
    rumor.barrier()
    rumor.win_free()
    rumor.shutdown()
    return checks


def test_windows_of_cuda_tensors():
    try:
        import torch

        ready = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        ready = False
    if not ready:
        if os.environ.get("RUMOR_EXPECT_GPU") == "1":
            pytest.fail("RUMOR_EXPECT_GPU=1 but no CUDA device")
        pytest.skip("needs a CUDA device")
    res = harness.run(gpu_window_rank, 2, timeout=120)
    bad = [f"rank {r}: {k}" for r, checks in enumerate(res) for k, ok in checks.items() if not ok]
    assert not bad, "\n".join(bad)
