"""The device bucket ops (rumor.engine.ops) with several ranks on NCCL's calls, without a GPU.

DistributedDataParallel's device ops are written once against a transport: NcclTransport on a
GPU, HostTransport in the CPU emulation (whose results the DDP tests check bit for bit against
the C++ ops). One GPU allows one rank per NCCL communicator, so the NCCL form of the ops' message
pattern (grouped sends and receives to each block's owner, the allgather in slots of the largest
encoding, the ring exchange of LowPrecisionDecentralized, the weight mix's sends) never ran with
more than one rank there. Here it runs with three, each a thread of one process, over the fake
libnccl (tests/cpp/fake_nccl.cpp) in its RUMOR_FAKE_NCCL_SYNC mode, where a call returns once its
part ran: host code that reads a result next sees it, as kernels queued after an op on a GPU
stream would. The "device memory" is host memory and torch.cuda's streams and events are played
by the fake's. Every op's outputs must equal, per rank, those of the same ops and inputs over
HostTransport in three processes: bit for bit where the wire only moves bytes, to float32
rounding where NCCL and rumor's allreduce may add the ranks' values in different orders.
The second test runs the collectives' NCCL path (rumor.gpu.collectives) the same way, against
exact expected values.

What this does not check: CUDA itself (streams, kernels, real NCCL), which
test_cuda_collectives.py and test_ddp_device.py do on a GPU."""
from __future__ import annotations

import threading
import time
import types

import harness
import nccl_fakes

N = 3
COUNT = 1001  # blocks of 334, 334, 333 elements: uneven encodings


def _script(tp) -> dict:
    """Runs every device op as DDP runs a bucket's, on rank tp.rank of tp.size; returns the
    tensors each op leaves, by name, with the comparison they admit ('exact', 'close' or
    'bf16')."""
    import torch

    from rumor import _C
    from rumor.engine.ops import AllreduceOp, CompressedOp, LowPrecisionRing, OneBitMomentumOp, PowerSgdOp, WeightMix

    torch.set_num_threads(1)
    r, n = tp.rank, tp.size
    gen = torch.Generator().manual_seed(1000 + r)
    out = {}

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    # Averages of values whose sums are exact in float32 (any order of addition gives them).
    x = torch.randint(-512, 512, (COUNT,), generator=gen).float() / 8
    AllreduceOp(1).run(x, tp)
    out["AllreduceOp avg"] = ("exact", x)
    i = torch.randint(-1000, 1000, (37,), generator=gen, dtype=torch.int32)
    AllreduceOp(0).run(i, tp)
    out["AllreduceOp sum int32"] = ("exact", i)

    # ByteGrad, QSGD, LowPrecision (f16/bf16): two calls each (the seeds move with the call).
    K = _C.CodecKind
    for kind, chunk, levels in [(K.MinMaxU8, 0, 16), (K.MinMaxU8, 128, 16), (K.QSGD, 0, 16), (K.QSGD, 256, 256),
                                (K.F16, 0, 16), (K.BF16, 0, 16)]:
        op = CompressedOp(int(kind), chunk, levels, True, seed=7)
        for step in range(2):
            g = randn(COUNT)
            op.run(g, tp)
            out[f"CompressedOp {kind.name} chunk={chunk} levels={levels} call {step}"] = ("exact", g)

    # 1-bit Adam: the warm-up average, then two compressed steps with a preconditioner.
    m, we, se = torch.zeros(COUNT), torch.zeros(COUNT), torch.zeros(COUNT)
    op = OneBitMomentumOp(m, we, se, 0.9, 0, False)
    g = torch.randint(-64, 64, (COUNT,), generator=gen).float() / 4
    op.run(g, tp)
    out["OneBitMomentumOp warm-up"] = ("exact", g)
    op.compressing = True
    op.set_preconditioner(torch.rand(COUNT, generator=gen) + 0.5)
    for step in range(2):
        op.run(randn(COUNT), tp)
        for name, t in (("momentum", m), ("worker error", we), ("server error", se)):
            out[f"OneBitMomentumOp step {step} {name}"] = ("exact", t.clone())

    # PowerSGD: two matrices and an uncompressed run, Q the same on every rank (as the
    # algorithm seeds it), float32 and bf16 on the wire.
    for wire in (torch.float32, torch.bfloat16):
        matrices = [(0, 20, 10, 2, 0, 0), (207, 8, 6, 2, 40, 20)]
        count = 255
        q = torch.randn(32, generator=torch.Generator().manual_seed(5))
        p, err = torch.zeros(56), torch.zeros(count)
        op = PowerSgdOp(matrices, [(200, 7)], count, p, q, err, 1e-8, wire)
        g = torch.randint(-64, 64, (count,), generator=gen).float() / 4
        op.run(g, tp)
        out[f"PowerSgdOp {wire} warm-up"] = ("exact", g)
        op.compressing = True
        for step in range(2):
            g = randn(count)
            op.run(g, tp)
            for name, t in (("gradient", g), ("P", p), ("Q", q), ("error", err)):
                out[f"PowerSgdOp {wire} step {step} {name}"] = ("close" if wire == torch.float32 else "bf16", t.clone())

    # LowPrecisionDecentralized's ring (both neighbours with three ranks).
    x = randn(500)
    ring = LowPrecisionRing(x, n, r, False, False, 0)
    for step in range(2):
        x.sub_(randn(500), alpha=0.1)  # the optimizer's step
        ring.prepare(tp)
        ring.send(tp)
        tp.settle("the ring's exchange")
        ring.receive()
        for name, t in (("x", x), ("self", ring.self_), ("left", ring.left), ("right", ring.right)):
            out[f"LowPrecisionRing step {step} {name}"] = ("exact", t.clone())

    # Decentralized's weight mix: equal weights (one division), unequal ones, average of all.
    left, right = (r - 1) % n, (r + 1) % n
    mix = WeightMix(None, False, False, None)
    for label, plan in (("ring 1/3", (False, 1 / 3, [(left, 1 / 3), (right, 1 / 3)], [left, right])),
                        ("ring 1/2 1/4 1/4", (False, 0.5, [(left, 0.25), (right, 0.25)], [left, right])),
                        ("to the right 0.7 0.3", (False, 0.7, [(left, 0.3)], [right])),
                        ("average", (True, 0.0, [], []))):
        ins = [randn(300), torch.randint(-64, 64, (41,), generator=gen).double() / 4]
        outs = [torch.empty_like(t) for t in ins]
        mix.run(tp, ins, outs, plan, None, 30.0)
        tp.settle("the weight mix")
        for k, t in enumerate(outs):
            out[f"WeightMix {label} buffer {k}"] = ("close" if label == "average" and k == 0 else "exact", t)
    return out


def _host_rank():
    import rumor
    from rumor import _runtime
    from rumor.engine.ops import HostTransport

    rumor.init(timeout=60)
    try:
        return _script(HostTransport(_runtime.state().world._comm))
    finally:
        rumor.shutdown()


def _fake_ranks(fake: str):
    import torch

    import rumor
    from rumor import _C
    from rumor.gpu import nccl as _nccl
    from rumor.engine.ops import NcclTransport

    nccl_fakes.fake_cuda(fake)
    rumor.init(timeout=60)  # NcclTransport.settle's deadline is rumor's
    try:
        lib = _nccl.load()
        uid = lib.unique_id()

        def rank(r):
            comm = _C.NcclCommunicator(lib, uid, N, r, 60.0)
            try:
                return _script(NcclTransport(types.SimpleNamespace(comm=comm, torch_device=torch.device("cpu"))))
            finally:
                comm.close()

        return _thread_ranks(rank, "over the fake NCCL")
    finally:
        rumor.shutdown()


def _thread_ranks(rank, what: str, timeout: float = 240.0) -> list:
    """rank(r) on N threads at once; their results by rank, or every rank's error."""
    results, errors = [None] * N, [None] * N

    def run(r):
        try:
            results[r] = rank(r)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(N)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    failed = [f"rank {r}: {type(e).__name__}: {e}" for r, e in enumerate(errors) if e is not None]
    failed += [f"rank {r}: not finished within {timeout:.0f} s" for r, t in enumerate(threads) if t.is_alive()]
    if failed:
        raise RuntimeError(f"{what}:\n" + "\n".join(failed))
    return results


def test_device_ops_over_nccl_calls_match_the_host_transport():
    import torch

    nccl_fakes.ext()
    fake = nccl_fakes.fake_path()
    host = harness.run(_host_rank, N, timeout=180)
    (nccl,) = harness.run(_fake_ranks, 1, timeout=300, env={"RUMOR_NCCL_LIBRARY": fake, "RUMOR_FAKE_NCCL_SYNC": "1"},
                          args=(fake,))
    assert list(host[0]) == list(nccl[0])
    checked = 0
    for r in range(N):
        for name, (how, want) in host[r].items():
            how2, got = nccl[r][name]
            assert how2 == how and got.dtype == want.dtype and got.shape == want.shape, (r, name)
            if how == "exact":
                assert torch.equal(got, want), (r, name, (got - want).abs().max().item())
            else:
                # bf16 on the wire: sums rounded to 8 bits per addition, in another order, and
                # P's orthogonalization magnifies the difference; a misrouted message is off by ~1.
                tol = dict(rtol=2e-5, atol=2e-6) if how == "close" else dict(rtol=0.03, atol=0.03)
                torch.testing.assert_close(got, want, **tol, msg=lambda m: f"rank {r}, {name}: {m}")
            checked += 1
    # Every rank ends with the same averaged values where the op averages over everyone.
    for name in ("AllreduceOp avg", "CompressedOp MinMaxU8 chunk=0 levels=16 call 1",
                 "OneBitMomentumOp step 1 momentum", "PowerSgdOp torch.float32 step 1 gradient",
                 "WeightMix average buffer 1"):
        for r in range(1, N):
            assert torch.equal(nccl[r][name][1], nccl[0][name][1]), (r, name)
    assert checked == N * len(host[0])


# ---- the collectives' NCCL path (rumor.gpu.collectives) with three ranks -----------------------
# The calls a user makes on CUDA tensors, each rank a thread over the fake in its SYNC mode, in
# both wait modes: uneven allgather (grouped sends and receives into offsets of the result),
# reduce_scatter of rows that do not split evenly (padded blocks), reduce's root-only result,
# broadcast from a root other than 0, send/recv, AVG on integers (rumor's rule on the CPU path:
# the sum, then division truncated toward zero; NCCL's ncclAvg on integers is assumed the same,
# not checked on a GPU), out-of-place and non-contiguous in-place calls, a nonblocking handle.
# Expected values are computed here from every rank's inputs, exact.
# In stream mode each rank's StreamWatch asks its communicator for errors while the rank's own
# thread may be inside an NCCL call holding the communicator's lock: NcclCommunicator.check
# must not hold the GIL while it waits for that lock (it did, and this test then hung until the
# fake gave up: the peers' threads need the GIL to make their part of the call).

def _inputs(r: int) -> dict:
    import torch

    def base(shape, dtype, scale=1):
        n = 1
        for s in shape:
            n *= s
        return ((torch.arange(n, dtype=torch.float64) * scale + 100 * r - 7 * (r % 2)).reshape(shape)).to(dtype)

    return {
        "allreduce sum float32": base((3, 4), torch.float32),
        "allreduce_ avg int32 (transposed)": base((4, 3), torch.int32, scale=-5),
        "allreduce max float64": base((5,), torch.float64, scale=1 - r),
        "broadcast from 1 int64": base((6,), torch.int64),
        "reduce to 2 sum float32": base((2, 3), torch.float32),
        "allgather uneven float32": base((r + 1, 3), torch.float32),
        "allgather bf16": base((2, 5), torch.bfloat16),
        "reduce_scatter uneven sum float32": base((7, 2), torch.float32),
        "reduce_scatter avg float64": base((6,), torch.float64),
        "send/recv uint8": base((9,), torch.uint8, scale=3),
        "nonblocking allreduce sum int64": base((4,), torch.int64),
    }


def _expected(r: int, n: int) -> dict:
    import torch

    ins = [_inputs(q) for q in range(n)]

    def total(name):
        return sum(i[name].to(torch.float64) for i in ins)

    rows = [3, 2, 2]
    start = sum(rows[:r])
    avg_int = torch.div(sum(i["allreduce_ avg int32 (transposed)"].to(torch.int64) for i in ins), n,
                        rounding_mode="trunc").to(torch.int32)
    return {
        "allreduce sum float32": total("allreduce sum float32").float(),
        "allreduce_ avg int32 (transposed)": avg_int.t(),
        "allreduce max float64": torch.stack([i["allreduce max float64"] for i in ins]).amax(0),
        "broadcast from 1 int64": ins[1]["broadcast from 1 int64"],
        "reduce to 2 sum float32": (total("reduce to 2 sum float32").float() if r == 2
                                    else ins[r]["reduce to 2 sum float32"]),
        "allgather uneven float32": torch.cat([i["allgather uneven float32"] for i in ins]),
        "allgather bf16": torch.cat([i["allgather bf16"] for i in ins]),
        "reduce_scatter uneven sum float32": total("reduce_scatter uneven sum float32").float()[start:start + rows[r]],
        "reduce_scatter avg float64": (total("reduce_scatter avg float64") / n)[2 * r:2 * r + 2],
        "send/recv uint8": {0: ins[2], 1: ins[0], 2: ins[2]}[r]["send/recv uint8"],
        "nonblocking allreduce sum int64": total("nonblocking allreduce sum int64").long(),
    }


def _collectives_script(gpu, g) -> dict:
    import rumor
    from rumor.gpu import collectives as G

    r = g.rank()
    ins = _inputs(r)
    SUM, AVG, MAX = rumor.ReduceOp.SUM, rumor.ReduceOp.AVG, rumor.ReduceOp.MAX
    out = {}
    out["allreduce sum float32"] = G.allreduce(gpu, g, ins["allreduce sum float32"], SUM, None, False, False, "auto",
                                               "rumor.allreduce")
    t = ins["allreduce_ avg int32 (transposed)"].t()  # not contiguous: written back in place
    G.allreduce(gpu, g, t, AVG, None, True, False, "auto", "rumor.allreduce_")
    out["allreduce_ avg int32 (transposed)"] = t
    out["allreduce max float64"] = G.allreduce(gpu, g, ins["allreduce max float64"], MAX, None, False, False, "auto",
                                               "rumor.allreduce")
    out["broadcast from 1 int64"] = G.broadcast(gpu, g, ins["broadcast from 1 int64"], 1, None, False, False,
                                                "rumor.broadcast")
    out["reduce to 2 sum float32"] = G.reduce(gpu, g, ins["reduce to 2 sum float32"], 2, SUM, None, False,
                                              "rumor.reduce")
    out["allgather uneven float32"] = G.allgather(gpu, g, ins["allgather uneven float32"], None, None, False,
                                                  "rumor.allgather")
    out["allgather bf16"] = G.allgather(gpu, g, ins["allgather bf16"], None, None, False, "rumor.allgather")
    out["reduce_scatter uneven sum float32"] = G.reduce_scatter(gpu, g, ins["reduce_scatter uneven sum float32"], SUM,
                                                                None, None, False, "rumor.reduce_scatter")
    out["reduce_scatter avg float64"] = G.reduce_scatter(gpu, g, ins["reduce_scatter avg float64"], AVG, None, None,
                                                         False, "rumor.reduce_scatter")
    buf = ins["send/recv uint8"].clone()
    if r == 0:  # 0 -> 1, then 2 -> 0
        G.send(gpu, g, buf, 1, None, "rumor.send")
        G.recv(gpu, g, buf, 2, None, "rumor.recv")
    elif r == 1:
        G.recv(gpu, g, buf, 0, None, "rumor.recv")
    else:
        G.send(gpu, g, buf, 0, None, "rumor.send")
    out["send/recv uint8"] = buf
    h = G.allreduce(gpu, g, ins["nonblocking allreduce sum int64"], SUM, None, False, True, "auto", "rumor.allreduce")
    out["nonblocking allreduce sum int64"] = h.wait()
    if gpu.watch is not None:
        gpu.watch.drain(30.0, "the test")
    return out


class _Ranks:
    """What the NCCL path asks of a rumor.Group: its members and this rank."""

    def __init__(self, rank: int, size: int):
        self._rank, self.ranks = rank, list(range(size))

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.ranks)


def _collectives_over_the_fake(fake: str):
    import torch

    import rumor
    from rumor import _C
    from rumor.gpu import routing
    from rumor.gpu import watch as gpu_watch
    from rumor.gpu import nccl as _nccl
    from rumor import _host_collectives as C

    nccl_fakes.fake_cuda(fake)
    # allgather learns every rank's row count through the group's CPU communicator; the thread
    # ranks share a list instead.
    shapes, barrier = [None] * N, threading.Barrier(N)

    def gather_rows(t, g, what):
        shapes[g.rank()] = tuple(t.shape)
        barrier.wait(60)
        got = list(shapes)
        barrier.wait(60)
        return [s[0] for s in got], got[g.rank()][1:]

    C.gather_rows = gather_rows

    class HostGroup(routing.GpuGroup):
        torch_device = torch.device("cpu")  # the fake's "device memory" is host memory

    rumor.init(timeout=60)
    try:
        lib = _nccl.load()
        results = {}
        for mode in ("host", "stream"):
            rumor.set_gpu_wait(mode)
            uid = lib.unique_id()

            def rank(r):
                gpu = HostGroup(0)
                gpu.transport = "nccl"
                gpu.comm = _C.NcclCommunicator(lib, uid, N, r, 60.0)
                gpu.watch = gpu_watch.StreamWatch(gpu.comm, f"rank {r}", min_pause=0.001, max_pause=0.004)
                try:
                    return _collectives_script(gpu, _Ranks(r, N))
                finally:
                    gpu.close(10.0)

            results[mode] = _thread_ranks(rank, f"{mode} mode, over the fake NCCL", timeout=120.0)
        return results
    finally:
        rumor.shutdown()


def test_collectives_nccl_path_with_three_ranks():
    import torch

    nccl_fakes.ext()
    fake = nccl_fakes.fake_path()
    (res,) = harness.run(_collectives_over_the_fake, 1, timeout=300,
                         env={"RUMOR_NCCL_LIBRARY": fake, "RUMOR_FAKE_NCCL_SYNC": "1"}, args=(fake,))
    for mode in ("host", "stream"):
        for r in range(N):
            want = _expected(r, N)
            got = res[mode][r]
            assert list(got) == list(want)
            for name, w in want.items():
                g = got[name]
                assert g.dtype == w.dtype and g.shape == w.shape, (mode, r, name, g.dtype, list(g.shape), list(w.shape))
                assert torch.equal(g, w), (mode, r, name, g, w)
