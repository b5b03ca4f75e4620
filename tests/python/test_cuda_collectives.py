"""CUDA tensors in rumor's collectives (docs/gpu.md): the routing rules, RUMOR_GPU_TRANSPORT, the
group's agreement on a transport, and, on a GPU, every covered collective over host staging
(two ranks sharing one GPU) and NCCL (a one-rank group).

The routing and agreement tests run anywhere: they call the decision functions with devices and
tables, not tensors. The GPU tests skip without CUDA, and fail instead where RUMOR_EXPECT_GPU=1
(scripts/gpu_check.sh)."""
import os

import pytest
import torch

import harness
from harness import Checker, check_reduced, gen, reference
from rumor.gpu import routing
from rumor.errors import RumorError

EXPECT_GPU = os.environ.get("RUMOR_EXPECT_GPU") == "1"
GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU and not EXPECT_GPU, reason="needs a CUDA device")


def test_expect_gpu_means_a_gpu():
    if EXPECT_GPU:
        assert torch.cuda.is_available(), "RUMOR_EXPECT_GPU=1 but torch sees no CUDA device"


# ---- RUMOR_GPU_TRANSPORT -----------------------------------------------------------------------

@pytest.mark.parametrize("raw,want", [(None, "auto"), ("", "auto"), (" ", "auto"), ("auto", "auto"),
                                      ("NCCL", "nccl"), (" host ", "host")])
def test_transport_setting(raw, want):
    env = {} if raw is None else {"RUMOR_GPU_TRANSPORT": raw}
    assert routing.transport_setting(env) == want


@pytest.mark.parametrize("raw", ["gloo", "tcp", "nccl,host", "0"])
def test_transport_setting_rejects(raw):
    with pytest.raises(ValueError) as e:
        routing.transport_setting({"RUMOR_GPU_TRANSPORT": raw})
    msg = str(e.value)
    assert "RUMOR_GPU_TRANSPORT" in msg and repr(raw) in msg
    assert "auto, nccl, host" in msg


# ---- routing decisions ---------------------------------------------------------------------------

def cpu():
    return torch.device("cpu")


def cuda(i=None):
    return torch.device("cuda") if i is None else torch.device("cuda", i)


def test_decide_cpu_path():
    assert routing.decide("op", [("t", cpu())], None) == routing.CPU
    assert routing.decide("op", [("t", cpu()), ("out", "cpu")], 0) == routing.CPU
    assert routing.decide("op", [], 0) == routing.CPU


def test_decide_cuda_path():
    assert routing.decide("op", [("t", cuda(1))], 1) == routing.CUDA
    assert routing.decide("op", [("t", cuda(0)), ("out", cuda(0))], 0) == routing.CUDA
    # "cuda" without an index is torch's current device, which is the rank's.
    assert routing.decide("op", [("t", cuda())], 3) == routing.CUDA


def test_decide_mixed_devices():
    with pytest.raises(ValueError) as e:
        routing.decide("rumor.allgather", [("t", cuda(0)), ("out", cpu())], 0)
    msg = str(e.value)
    assert msg.startswith("rumor.allgather:")
    assert "t on cuda:0" in msg and "out on cpu" in msg and "different devices" in msg


def test_decide_foreign_device():
    with pytest.raises(ValueError) as e:
        routing.decide("rumor.allreduce", [("t", cuda(1))], 0)
    msg = str(e.value)
    assert "t is on cuda:1" in msg and "this rank's device is cuda:0" in msg
    assert "torch.cuda.set_device" in msg
    with pytest.raises(ValueError, match="out is on cuda:2"):
        routing.decide("op", [("t", cuda(0)), ("out", cuda(2))], 0)


def test_decide_other_device_types():
    for d in ("meta", "xpu", "mps"):
        with pytest.raises(ValueError) as e:
            routing.decide("rumor.broadcast", [("t", torch.device(d))], 0)
        assert f"t is on {d}" in str(e.value) and "CPU or CUDA" in str(e.value)


def test_decide_no_cuda_device_here():
    with pytest.raises(ValueError, match="sees no CUDA device"):
        routing.decide("op", [("t", cuda(0))], None)


def test_route_cpu_tensors_need_no_runtime():
    # The CPU path's cost: a device check; not even rumor.init() is consulted.
    t = torch.zeros(3)
    assert routing.route("op", None, ("t", t), ("out", None)) is None
    assert routing.route("op", None, ("t", 5)) is None  # left to the CPU path's TypeError


# ---- the group's agreement -----------------------------------------------------------------------

AUTO, NCCL, HOST = 0, 1, 2


def agree(rows, hosts=None, me=0, problem=None):
    ranks = list(range(10, 10 + len(rows)))
    hosts = hosts or [f"h{i}" for i in range(len(rows))]
    return routing.agree(rows, hosts, ranks, me, problem, "rumor.allreduce")


def test_agree_choices():
    assert agree([(AUTO, 1, 0), (AUTO, 1, 0)]) == "nccl"  # one GPU each on two hosts
    assert agree([(NCCL, 1, 0), (NCCL, 1, 1)], hosts=["a", "a"]) == "nccl"
    assert agree([(HOST, 0, 0), (HOST, 0, 0)], hosts=["a", "a"]) == "host"
    assert agree([(HOST, 1, 0), (HOST, 1, 1)]) == "host"
    assert agree([(AUTO, 0, 0), (AUTO, 0, 1)]) == "host"  # no rank has NCCL: auto stages
    assert agree([(AUTO, 1, 0), (AUTO, 1, 0)], hosts=["a", "a"]) == "host"  # two ranks, one GPU
    assert agree([(AUTO, 1, 0)]) == "nccl"


def test_agree_settings_differ():
    with pytest.raises(RumorError) as e:
        agree([(AUTO, 1, 0), (HOST, 1, 1)])
    msg = str(e.value)
    assert "disagree" in msg and "rank 10: auto" in msg and "rank 11: host" in msg


def test_agree_invalid_setting_elsewhere():
    with pytest.raises(RumorError, match=r"rank\(s\) \[11\] have an invalid RUMOR_GPU_TRANSPORT"):
        agree([(AUTO, 1, 0), (3, 0, 0)])


def test_agree_nccl_missing_somewhere():
    rows = [(AUTO, 1, 0), (AUTO, 0, 0), (AUTO, 1, 0)]
    with pytest.raises(RumorError) as e:
        agree(rows, me=0, problem=None)
    msg = str(e.value)
    assert "not usable on rank(s) [11]" in msg and "RUMOR_GPU_TRANSPORT=host" in msg and "this rank" not in msg
    # The rank without NCCL also says why (the loader's message).
    with pytest.raises(RumorError, match="on this rank: no usable NCCL library; tried: x"):
        agree(rows, me=1, problem="no usable NCCL library; tried: x")
    with pytest.raises(RumorError, match="chose nccl"):
        agree([(NCCL, 0, 0), (NCCL, 0, 1)])  # nccl asked for: no quiet fall-back


def test_agree_nccl_on_a_shared_gpu():
    with pytest.raises(RumorError) as e:
        agree([(NCCL, 1, 0), (NCCL, 1, 0)], hosts=["a", "a"])
    assert "ranks 10 and 11 both use cuda:0" in str(e.value)


# ---- the staging cache's bookkeeping (no pinned memory needed) -----------------------------------

def test_pinned_cache_bounds():
    assert routing.PinnedCache.size_for(0) == 64 << 10
    assert routing.PinnedCache.size_for((64 << 10) + 1) == 128 << 10
    assert routing.PinnedCache.size_for(1 << 20) == 1 << 20
    c = routing.PinnedCache(max_buffers=2, max_bytes=1 << 20)
    bufs = [torch.empty(64 << 10, dtype=torch.uint8) for _ in range(3)]
    for b in bufs:
        c.give(b)
    assert len(c) == 2 and c.nbytes() == 128 << 10  # the oldest went
    assert c.take(100, 1.0, "op") is bufs[1]  # a free buffer of the size is reused
    c.give(torch.empty(2 << 20, dtype=torch.uint8))  # over the byte bound: not kept
    assert len(c) == 1
    big = torch.empty(1 << 20, dtype=torch.uint8)
    c.give(big)
    assert len(c) == 1 and c.nbytes() == 1 << 20  # the byte bound evicted the small one
    c.clear()
    assert len(c) == 0 and c.nbytes() == 0


# ---- the CPU path through the real API (2 ranks) -------------------------------------------------

def _cpu_unchanged():
    import rumor

    rumor.init()
    chk = Checker()
    r, n = rumor.rank(), rumor.size()
    inputs = [gen("cpu", q, torch.float32, "SUM", 1000) for q in range(n)]
    chk.equal(rumor.allreduce(inputs[r], op=rumor.ReduceOp.SUM), reference(inputs, "SUM"), "allreduce")
    chk.raises(ValueError, lambda: rumor.allreduce(torch.empty(3, device="meta")), "meta", match="t is on meta")
    chk.raises(ValueError, lambda: rumor.allgather(torch.zeros(2), out=torch.empty(4, device="meta")), "out meta",
               match="out is on meta")
    chk.raises(ValueError, lambda: rumor.win_create(torch.empty(3, device="meta"), "w"), "window",
               match="windows take CPU or CUDA tensors")
    model = torch.nn.Linear(2, 2, device="meta")
    chk.raises(ValueError, lambda: rumor.DistributedDataParallel(model), "ddp",
               match="parameter weight is on meta")
    rumor.barrier()
    rumor.shutdown()
    return chk.failures, chk.count


def test_cpu_path_unchanged():
    harness.assert_no_failures(harness.run(_cpu_unchanged, 2, timeout=90))


# ---- GPU: host staging, two ranks on one GPU -----------------------------------------------------

def _staged_all():
    import rumor

    torch.cuda.set_device(0)
    rumor.init()
    chk = Checker()
    r, n = rumor.rank(), rumor.size()
    dev = torch.device("cuda", 0)
    expect = os.environ.get("RUMOR_GPU_TRANSPORT", "auto")

    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        for op in ("SUM", "AVG", "MAX", "PROD"):
            key = f"ar{dtype}{op}"
            inputs = [gen(key, q, dtype, op, 1031) for q in range(n)]
            want = reference(inputs, op)
            x = inputs[r].to(dev)
            got = rumor.allreduce(x, op=getattr(rumor.ReduceOp, op))
            chk.check(got.device == dev, f"allreduce {dtype} {op}: on {got.device}")
            check_reduced(chk, got.cpu(), want, op, f"allreduce {dtype} {op}")
            chk.equal(x.cpu(), inputs[r], f"allreduce {dtype} {op}: input unchanged")
            y = inputs[r].to(dev)
            rumor.allreduce_(y, op=getattr(rumor.ReduceOp, op))
            check_reduced(chk, y.cpu(), want, op, f"allreduce_ {dtype} {op}")
            h = rumor.allreduce_nonblocking(inputs[r].to(dev), op=getattr(rumor.ReduceOp, op))
            check_reduced(chk, h.wait().cpu(), want, op, f"allreduce_nonblocking {dtype} {op}")
            z = inputs[r].to(dev)
            h = rumor.allreduce_nonblocking_(z, op=getattr(rumor.ReduceOp, op))
            rumor.synchronize(h)
            check_reduced(chk, z.cpu(), want, op, f"allreduce_nonblocking_ {dtype} {op}")
            for root in range(n):
                got = rumor.reduce(inputs[r].to(dev), root, op=getattr(rumor.ReduceOp, op))
                check_reduced(chk, got.cpu(), want if r == root else inputs[r], op, f"reduce {dtype} {op} root {root}")

    # non-contiguous input, in place
    base = gen("nc", r, torch.float64, "SUM", (6, 8)).to(dev)
    v = base.t()
    want = reference([gen("nc", q, torch.float64, "SUM", (6, 8)).t() for q in range(n)], "SUM")
    rumor.allreduce_(v, op=rumor.ReduceOp.SUM)
    chk.equal(v.cpu(), want, "allreduce_ non-contiguous")

    for root in range(n):
        data = [gen(f"bc{root}", q, torch.float32, "COPY", (5, 7)) for q in range(n)]
        chk.equal(rumor.broadcast(data[r].to(dev), root).cpu(), data[root], f"broadcast root {root}")
        b = data[r].to(dev)
        rumor.broadcast_(b, root)
        chk.equal(b.cpu(), data[root], f"broadcast_ root {root}")
        chk.equal(rumor.broadcast_nonblocking(data[r].to(dev), root).wait().cpu(), data[root], "broadcast_nonblocking")
    flags = torch.tensor([r == 0, True, r == 1], device=dev)  # a dtype moved as bytes
    chk.equal(rumor.broadcast(flags, 0).cpu(), torch.tensor([True, True, False]), "broadcast bool")

    for rows in ((3, 3), (2, 5)):
        parts = [gen(f"ag{rows}", q, torch.bfloat16, "COPY", (rows[q], 4)) for q in range(n)]
        want = torch.cat(parts)
        chk.equal(rumor.allgather(parts[r].to(dev)).cpu(), want, f"allgather {rows}")
        out = torch.empty(want.shape, dtype=want.dtype, device=dev)
        rumor.allgather(parts[r].to(dev), out=out)
        chk.equal(out.cpu(), want, f"allgather out= {rows}")
        chk.equal(rumor.allgather_nonblocking(parts[r].to(dev)).wait().cpu(), want, f"allgather_nonblocking {rows}")

    for d0 in (4, 5, 1):
        inputs = [gen(f"rs{d0}", q, torch.float32, "SUM", (d0, 3)) for q in range(n)]
        full = reference(inputs, "SUM")
        mine = torch.tensor_split(full, n)[r]
        chk.equal(rumor.reduce_scatter(inputs[r].to(dev), op=rumor.ReduceOp.SUM).cpu(), mine, f"reduce_scatter {d0}")
        out = torch.empty(mine.shape, dtype=mine.dtype, device=dev)
        rumor.reduce_scatter(inputs[r].to(dev), op=rumor.ReduceOp.SUM, out=out)
        chk.equal(out.cpu(), mine, f"reduce_scatter out= {d0}")
        h = rumor.reduce_scatter_nonblocking(inputs[r].to(dev), op=rumor.ReduceOp.SUM)
        chk.equal(h.wait().cpu(), mine, f"reduce_scatter_nonblocking {d0}")

    a2a = [gen("a2a", q, torch.int64, "COPY", (2 * n, 3)) for q in range(n)]
    want = torch.cat([a2a[q][2 * r:2 * r + 2] for q in range(n)])
    chk.equal(rumor.alltoall(a2a[r].to(dev)).cpu(), want, "alltoall")

    msg = gen("p2p", 0, torch.float32, "COPY", 300)
    if r == 0:
        rumor.send(msg.to(dev), 1)
    else:
        into = torch.zeros(300, device=dev)
        chk.check(rumor.recv(into, 0) is into, "recv returns its tensor")
        chk.equal(into.cpu(), msg, "send/recv")

    rumor.set_topology(rumor.topology.RingGraph(n))
    x = torch.full((10,), float(r + 1), device=dev)
    got = rumor.neighbor_allreduce(x)
    chk.close(got.cpu(), torch.full((10,), (1.0 + 2.0) / 2), "neighbor_allreduce")

    chk.check(rumor.allreduce(torch.ones(2, device=dev)).device == dev, "result device")
    chk.check(rumor._runtime.state().world._gpu.transport == "host", f"{expect}: two ranks on one GPU stage")
    with_mixed = lambda: rumor.allgather(torch.zeros(2, device=dev), out=torch.empty(4))
    chk.raises(ValueError, with_mixed, "mixed", match="out on cpu")
    if torch.cuda.device_count() > 1:
        chk.raises(ValueError, lambda: rumor.allreduce(torch.ones(2, device="cuda:1")), "foreign",
                   match="this rank's device is cuda:0")
    torch.cuda.synchronize()
    rumor.barrier()
    rumor.shutdown()
    return chk.failures, chk.count


@needs_gpu
@pytest.mark.parametrize("transport", ["host", "auto"])
def test_staged_two_ranks_one_gpu(transport):
    res = harness.run(_staged_all, 2, timeout=240, env={"RUMOR_GPU_TRANSPORT": transport})
    assert harness.assert_no_failures(res) > 100


# ---- GPU: NCCL on a one-rank group ---------------------------------------------------------------

def _nccl_one_rank():
    import rumor

    torch.cuda.set_device(0)
    rumor.init()
    chk = Checker()
    dev = torch.device("cuda", 0)
    ops = ("SUM", "AVG", "MIN", "MAX", "PROD")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.uint8):
        for op in ops:
            x = gen(f"n{op}", 0, dtype, op, 4099)
            rop = getattr(rumor.ReduceOp, op)
            chk.equal(rumor.allreduce(x.to(dev), op=rop).cpu(), x, f"allreduce {dtype} {op}")
            y = x.to(dev)
            rumor.allreduce_(y, op=rop)
            chk.equal(y.cpu(), x, f"allreduce_ {dtype} {op}")
            chk.equal(rumor.allreduce_nonblocking(x.to(dev), op=rop).wait().cpu(), x, f"allreduce_nonblocking {dtype}")
            chk.equal(rumor.reduce(x.to(dev), 0, op=rop).cpu(), x, f"reduce {dtype} {op}")
            chk.equal(rumor.reduce_scatter(x.to(dev).reshape(-1, 1), op=rop).cpu(), x.reshape(-1, 1),
                      f"reduce_scatter {dtype} {op}")
        chk.equal(rumor.broadcast(x.to(dev), 0).cpu(), x, f"broadcast {dtype}")
        chk.equal(rumor.allgather(x.to(dev)).cpu(), x, f"allgather {dtype}")
    chk.equal(rumor.allreduce(torch.zeros(0, device=dev)).cpu(), torch.zeros(0), "empty allreduce")
    nc = torch.arange(12.0, device=dev).reshape(3, 4).t()
    rumor.allreduce_(nc, op=rumor.ReduceOp.SUM)
    chk.equal(nc.cpu(), torch.arange(12.0).reshape(3, 4).t(), "non-contiguous allreduce_")
    # Ordered on the current stream: a side stream's op sees the work queued before it there. Its
    # result is ordered on that stream only (as torch's NCCL group orders it), so it is read there:
    # read on the default stream, a stream wait (RUMOR_GPU_WAIT=stream) let the copy overtake it
    # on the H200 (the output's block still held the freed `ones` in 1440 elements).
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        z = torch.ones(1 << 20, device=dev) * 3
        got = rumor.allreduce(z, op=rumor.ReduceOp.SUM)
        chk.equal(got.cpu(), torch.full((1 << 20,), 3.0), "side stream")
    h = rumor.allreduce_nonblocking(torch.ones(8, device=dev))
    chk.check(isinstance(h.poll(), bool), "poll")
    chk.equal(h.wait().cpu(), torch.ones(8), "handle")
    chk.equal(rumor.alltoall(torch.arange(6, device=dev)).cpu(), torch.arange(6), "alltoall (staged)")
    gpu = rumor._runtime.state().world._gpu
    chk.check(gpu.transport == "nccl" and gpu.comm is not None, f"transport {gpu!r}")
    rumor.shutdown()
    chk.check(gpu.comm is None, "shutdown closed the communicator")
    return chk.failures, chk.count


@needs_gpu
@pytest.mark.parametrize("wait", ["host", "stream"])
def test_nccl_one_rank_group(wait):
    res = harness.run(_nccl_one_rank, 1, timeout=180, env={"RUMOR_GPU_TRANSPORT": "nccl", "RUMOR_GPU_WAIT": wait})
    assert harness.assert_no_failures(res) > 100


def _nccl_past_deadline():
    """An allreduce queued behind a 3 s kernel with a 0.5 s deadline: with host waiting the call
    raises; with stream waiting it returns at once and the group's next call raises."""
    import rumor

    torch.cuda.set_device(0)
    rumor.init()
    chk = Checker()
    x = torch.ones(1 << 10, device="cuda")
    rumor.allreduce_(x)  # the communicator exists; its setup is not part of the deadline
    torch.cuda.synchronize()
    rumor.set_timeout(0.5)
    cycles = int(3.0 * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # clock_rate: kHz
    torch.cuda._sleep(cycles)
    stream_mode = rumor.get_gpu_wait() == "stream"
    try:
        rumor.allreduce_(x)
        returned = "returned"
    except rumor.CommTimeoutError as e:
        returned = str(e)
    if stream_mode:
        chk.check(returned == "returned", f"stream: the call returned once queued ({returned})")
        chk.check(not torch.cuda.current_stream().query(), "stream: the kernel before it still runs")
        try:
            torch.cuda.synchronize()
            rumor.broadcast(x, 0)
            chk.check(False, "stream: the next call raised")
        except rumor.CommTimeoutError as e:
            chk.check("broadcast: an earlier op queued on the GPU failed" in str(e) and "allreduce" in str(e), str(e))
    else:
        chk.check("not complete after" in returned and "allreduce" in returned, f"host: {returned}")
        torch.cuda.synchronize()
    try:
        rumor.allreduce_(x)
        refused = ""
    except rumor.RumorError as e:
        refused = str(e)
    chk.check(refused != "", "the aborted communicator refuses later calls")
    rumor.shutdown()
    return chk.failures, chk.count


@needs_gpu
@pytest.mark.parametrize("wait", ["host", "stream"])
def test_nccl_op_past_its_deadline(wait):
    res = harness.run(_nccl_past_deadline, 1, timeout=120, env={"RUMOR_GPU_TRANSPORT": "nccl", "RUMOR_GPU_WAIT": wait})
    assert harness.assert_no_failures(res) >= 2


# ---- GPU: a peer killed during a staged op -------------------------------------------------------

def _killed_peer(workdir):
    import time

    import rumor

    torch.cuda.set_device(0)
    rumor.init()
    r = rumor.rank()
    x = torch.ones(1 << 16, device="cuda")
    rumor.allreduce(x)  # the group has agreed (host) and both ranks work
    harness.file_barrier(workdir, "warm")
    if r == 1:
        os._exit(3)
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        rumor.allreduce(x)
    except rumor.RumorError as e:
        return type(e).__name__, time.monotonic() - t0, str(e)
    return "nothing raised", time.monotonic() - t0, ""


@needs_gpu
def test_killed_peer_during_staged_op(tmp_path):
    res = harness.run(_killed_peer, 2, timeout=90, env={"RUMOR_GPU_TRANSPORT": "host", "RUMOR_TIMEOUT": "20"},
                      args=(str(tmp_path),), may_die=[1])
    kind, waited, text = res[0]
    assert kind in ("PeerError", "CommTimeoutError", "AbortedError"), (kind, text)
    assert waited < 25, (waited, text)
