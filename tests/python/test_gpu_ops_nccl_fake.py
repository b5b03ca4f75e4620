"""The device bucket ops (rumor._gpu_ops) with several ranks on NCCL's calls, without a GPU.

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

What this does not check: CUDA itself (streams, kernels, real NCCL), which
test_cuda_collectives.py and test_ddp_device.py do on a GPU."""
from __future__ import annotations

import ctypes
import itertools
import threading
import types

import pytest

import harness

N = 3
COUNT = 1001  # blocks of 334, 334, 333 elements: uneven encodings


def _script(tp) -> dict:
    """Runs every device op as DDP runs a bucket's, on rank tp.rank of tp.size; returns the
    tensors each op leaves, by name, with the comparison they admit ('exact', 'close' or
    'bf16')."""
    import torch

    from rumor import _C
    from rumor._gpu_ops import AllreduceOp, CompressedOp, LowPrecisionRing, OneBitMomentumOp, PowerSgdOp, WeightMix

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
    from rumor._gpu_ops import HostTransport

    rumor.init(timeout=60)
    try:
        return _script(HostTransport(_runtime._get().world._comm))
    finally:
        rumor.shutdown()


def _fake_streams(fake: str):
    """torch.cuda's current stream (one per thread) and events, played by the fake's streams."""
    import torch

    idle = ctypes.CDLL(fake).fakeNcclStreamIdle
    idle.argtypes = [ctypes.c_void_p]
    local, handles = threading.local(), itertools.count(0x5150, 16)

    def current_stream(device=None):
        s = getattr(local, "stream", None)
        if s is None:
            s = local.stream = types.SimpleNamespace(cuda_stream=next(handles))
        return s

    class FakeEvent:
        def __init__(self, *a, **k):
            self.handle = None

        def record(self, stream=None):
            self.handle = (stream or current_stream()).cuda_stream

        def query(self):
            return bool(idle(self.handle))

    torch.cuda.current_stream = current_stream
    torch.cuda.Event = FakeEvent


def _fake_ranks(fake: str):
    import torch

    import rumor
    from rumor import _C, _nccl
    from rumor._gpu_ops import NcclTransport

    _fake_streams(fake)
    rumor.init(timeout=60)  # NcclTransport.settle's deadline is rumor's
    try:
        lib = _nccl.load()
        uid = lib.unique_id()
        results, errors = [None] * N, [None] * N

        def rank(r):
            try:
                comm = _C.NcclCommunicator(lib, uid, N, r, 60.0)
                try:
                    gpu = types.SimpleNamespace(comm=comm, torch_device=torch.device("cpu"))
                    results[r] = _script(NcclTransport(gpu))
                finally:
                    comm.close()
            except BaseException as e:  # noqa: BLE001 - reported by rank below
                errors[r] = e

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        failed = [f"rank {r}: {type(e).__name__}: {e}" for r, e in enumerate(errors) if e is not None]
        failed += [f"rank {r}: not finished within 240 s" for r, t in enumerate(threads) if t.is_alive()]
        if failed:
            raise RuntimeError("over the fake NCCL:\n" + "\n".join(failed))
        return results
    finally:
        rumor.shutdown()


def test_device_ops_over_nccl_calls_match_the_host_transport():
    import torch

    import test_nccl

    test_nccl._ext()
    fake = test_nccl._fake_path()
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
    for name in ("AllreduceOp avg", "CompressedOp MinMaxU8 chunk=0 levels=16 call 1", "OneBitMomentumOp step 1 momentum",
                 "PowerSgdOp torch.float32 step 1 gradient", "WeightMix average buffer 1"):
        for r in range(1, N):
            assert torch.equal(nccl[r][name][1], nccl[0][name][1]), (r, name)
    assert checked == N * len(host[0])
