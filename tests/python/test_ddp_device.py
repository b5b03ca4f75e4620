"""DistributedDataParallel's engine for CUDA parameters (rumor.engine.device, docs/gpu.md).

On any machine: the engine runs for CPU parameters under its emulation (rumor.engine.device.EMULATE:
streams and events are no-ops, the direct mode's ops use rumor's CPU collectives), so everything
but the CUDA calls is checked here:

* staged mode: the algorithms' C++ ops on the host copy of each bucket; parameters and
  gradients must equal, bit for bit, those of the C++ engine running the same ops;
* direct mode: the Python bucket ops of rumor.engine.ops (one allreduce; ByteGrad / QSGD /
  LowPrecision as a compressed reduce-scatter + allgather). They must also equal the C++ engine
  bit for bit (same blocks, seeds, accumulation order and division), on 3 ranks so that the
  average divides by a number that is not a power of two;
* bucket rebuilds, unused parameters and no_sync through the engine; the refusals (algorithms
  without a GPU path); overlap_optimizer and a fused optimizer (the update queued after
  each bucket's op); a peer that dies mid-backward makes the
  survivor's backward raise instead of hang.

On a GPU (skipped elsewhere; RUMOR_EXPECT_GPU=1 makes them fail instead): the same comparisons
with the model on cuda:0 over NCCL (one rank: NCCL refuses two ranks on one GPU) and staged
through host memory (two ranks sharing the GPU).
"""
from __future__ import annotations

import math
import os

import pytest

import harness

STEPS = 4
# No timing-based bucket split (bucket_split_gap_ms): two wrappers compared bit for bit must get
# the same buckets after the first iteration's rebuild, and a compressed op's blocks and seeds
# follow its bucket. With the default 5 ms, a loaded machine split the C++ engine's and the
# emulated engine's buckets differently now and then (staged QSGD on 3 ranks failed so).
SMALL_BUCKETS = dict(bucket_cap_mb=0.004, first_bucket_mb=0.001, bucket_split_gap_ms=math.inf)


# ==== inside a rank ===============================================================================

def _model(seed: int, device="cpu"):
    import torch

    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 33),
                            torch.nn.ReLU(), torch.nn.Linear(33, 7))
    return m.to(device)


def _batch(step: int, rank: int, device="cpu"):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 24, generator=g).to(device), torch.randint(0, 7, (5,), generator=g).to(device)


def _algorithm(name: str):
    import torch

    import rumor.algorithms as A

    return {"allreduce": lambda: A.GradientAllReduce(),
            "allreduce_overlap": lambda: A.GradientAllReduce(),
            "allreduce_fused": lambda: A.GradientAllReduce(),
            "bytegrad_overlap_clip": lambda: A.ByteGrad(hierarchical=False),
            "allreduce_sum": lambda: A.GradientAllReduce(average=False),
            "bytegrad": lambda: A.ByteGrad(hierarchical=False),
            "bytegrad_hier": lambda: A.ByteGrad(),
            "qsgd": lambda: A.QSGD(levels=8, hierarchical=False),
            "fp16": lambda: A.LowPrecision(torch.float16, hierarchical=False),
            "bf16": lambda: A.LowPrecision(torch.bfloat16, hierarchical=False),
            "dec_all": lambda: A.Decentralized("all", hierarchical=False),
            "dec_shift_one": lambda: A.Decentralized("shift_one", hierarchical=False),
            "dec_exp2": lambda: A.Decentralized("exp2", hierarchical=False, communication_interval=2),
            "dec_hier": lambda: A.Decentralized("shift_one"),
            "localsgd": lambda: A.LocalSGD(sync_every=2, warmup_steps=1),
            "lpdec": lambda: A.LowPrecisionDecentralized(hierarchical=False),
            "lpdec_hier": lambda: A.LowPrecisionDecentralized(),
            "diloco": lambda: A.DiLoCo(inner_steps=2),
            "diloco_4bit": lambda: A.DiLoCo(inner_steps=2, quantization="4bit"),
            "streaming": lambda: A.StreamingDiLoCo(inner_steps=4, num_fragments=2, fragment_sync_delay=1),
            "powersgd": lambda: A.PowerSGD(matrix_approximation_rank=2, start_powerSGD_iter=1),
            "powersgd_bf16": lambda: A.PowerSGD(matrix_approximation_rank=1, start_powerSGD_iter=1,
                                                use_error_feedback=False, wire_dtype=torch.bfloat16)}[name]()


def _train(mode, algo: str, device="cpu", steps: int = STEPS, unused: bool = False):
    """Trains a fresh wrapper (engine chosen by `mode`: None is the C++ engine) and returns the
    gradients and parameters after every step, on the CPU."""
    import torch
    import torch.nn.functional as F

    import rumor
    from rumor.engine import device as device_engine

    rank = rumor.rank()
    device_engine.EMULATE = mode if device == "cpu" else None
    try:
        m = _model(10 + rank, device)
        if algo.startswith("onebit"):
            opt = rumor.optim.OneBitAdamOptimizer(m.parameters(), lr=1e-2, freeze_step=2)
            alg = rumor.algorithms.OneBitAdamAlgorithm(opt, hierarchical=algo == "onebit_hier")
        else:
            opt, alg = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), _algorithm(algo)
        extra = {}
        if "fused" in algo:
            rumor.optim.fuse_optimizer(opt)
        if "overlap" in algo:
            extra["overlap_optimizer"] = True
        if "clip" in algo:
            extra["bucket_clip_norm"] = 0.05
        ddp = rumor.DistributedDataParallel(m, algorithm=alg, shared_buckets=False,
                                            find_unused_parameters=unused, optimizer=opt, **extra, **SMALL_BUCKETS)
    finally:
        device_engine.EMULATE = None
    if mode is not None:
        assert isinstance(ddp._engine, device_engine.DeviceEngine), ddp._engine
        if algo.startswith(("lpdec", "diloco", "streaming")):
            assert ddp._engine.mode == "direct"
            avg = getattr(ddp.algorithm, "_device_avg", None)
            assert avg is None or avg.staged == (mode == "staged"), (mode, algo)
        elif algo.startswith("powersgd") or "overlap" in algo or "fused" in algo:
            assert ddp._engine.mode == mode
        elif algo.startswith("dec"):  # local buckets; the weight mix is staged or not
            assert ddp.algorithm._device_mix.staged == (mode == "staged"), (mode, algo)
        else:
            assert ddp._engine.mode == mode, (mode, ddp._engine.mode)
    assert len(ddp.buckets) >= 3, len(ddp.buckets)
    out = []
    for step in range(steps):
        x, y = _batch(step, rank, device)
        opt.zero_grad(set_to_none=(step % 2 == 0))
        h = ddp.module[1](ddp.module[0](x))
        if unused and step == 1:
            # The middle layer gets no gradient this step: its buckets carry zeros.
            loss = F.cross_entropy(h[:, :7], y)
        else:
            loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        grads = [p.grad.detach().cpu().clone() if p.grad is not None else None for p in m.parameters()]
        for b in ddp.buckets:  # .grad stays a view of its bucket (where the bucket carries it)
            if not ddp._carries[b.index]:
                continue
            for p, off in zip(b.params, b.offsets):
                assert p.grad is None or p.grad.data_ptr() == b.flat[off:].data_ptr()
        opt.step()
        out.append((grads, [p.detach().cpu().clone() for p in m.parameters()]))
    timings = ddp.last_iteration_timeline()
    assert timings is not None and len(timings["buckets"]) == len(ddp.buckets), timings
    return out


def _same(a, b) -> bool:
    import torch

    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


def equivalence_rank(cases):
    """[(mode, algorithm, unused)]: each against the C++ engine, bit for bit; returns {case: the
    differences found}."""
    import rumor

    rumor.init()
    out = {}
    for case in cases:
        mode, algo, unused = case
        out[case] = bad = []
        steps = 7 if "diloco" in algo or "streaming" in algo else STEPS
        ref = _train(None, algo, unused=unused, steps=steps)
        got = _train(mode, algo, unused=unused, steps=steps)
        for step, ((rg, rp), (gg, gp)) in enumerate(zip(ref, got)):
            if not _same(rg, gg):
                bad.append(f"{mode} {algo} unused={unused} step {step}: gradients differ from the C++ engine's")
            if not _same(rp, gp):
                bad.append(f"{mode} {algo} unused={unused} step {step}: parameters differ from the C++ engine's")
    # Nothing to compare to if the averaging did nothing: the ranks' gradients started different.
    rumor.shutdown()
    return out


def close_rank(cases):
    """[(mode, algorithm)] against the C++ engine to float32 rounding: Decentralized's weight
    mix (the device form sums in another order; staged: the C++ WeightMixOp) and PowerSGD (the
    device op's matrix products are torch's). Returns {case: the differences found}."""
    import torch

    import rumor

    rumor.init()
    out = {}
    for case in cases:
        mode, algo = case
        out[case] = bad = []
        ref = _train(None, algo, steps=4)
        got = _train(mode, algo, steps=4)
        for step, ((_, rp), (_, gp)) in enumerate(zip(ref, got)):
            for a, b in zip(rp, gp):
                if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                    bad.append(f"{mode} {algo} step {step}: parameters differ from the C++ engine's by "
                               f"{float((a - b).abs().max()):.3g}")
                    break
    rumor.shutdown()
    return out


def no_sync_rank():
    """Gradients accumulated under no_sync, then communicated by the next backward outside it,
    through the emulated direct engine, against the C++ engine."""
    import torch
    import torch.nn.functional as F

    import rumor
    from rumor.engine import device as device_engine

    rumor.init()
    res = []
    for mode in (None, "direct", "staged"):
        device_engine.EMULATE = mode
        try:
            m = _model(3 + rumor.rank())
            ddp = rumor.DistributedDataParallel(m, shared_buckets=False, **SMALL_BUCKETS)
        finally:
            device_engine.EMULATE = None
        with ddp.no_sync():
            x, y = _batch(0, rumor.rank())
            F.cross_entropy(ddp(x), y).backward()
        local = [p.grad.clone() for p in m.parameters()]
        x, y = _batch(1, rumor.rank())
        F.cross_entropy(ddp(x), y).backward()
        res.append(([g.clone() for g in local], [p.grad.clone() for p in m.parameters()]))
    rumor.shutdown()
    (l0, g0), (l1, g1), (l2, g2) = res
    return _same(l0, l1) and _same(l0, l2), _same(g0, g1) and _same(g0, g2), _same(l0, g0)


def refusals_rank():
    """Algorithms and options without a GPU path are refused with a message saying so."""
    import torch

    import rumor
    import rumor.algorithms as A
    from rumor.engine import device as device_engine

    rumor.init()
    msgs = {}
    cases = {
        "onebit_staged": dict(onebit=True),
    }
    for name, kw in cases.items():
        m = _model(1)
        mode = "direct"
        if "optimizer" in kw:
            kw = dict(kw, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
        if kw.pop("onebit", False):  # 1-bit Adam's state lives on the device: no staged form
            opt = rumor.optim.OneBitAdamOptimizer(m.parameters(), lr=1e-3, freeze_step=2)
            kw = dict(kw, optimizer=opt, algorithm=A.OneBitAdamAlgorithm(opt))
            mode = "staged"
        device_engine.EMULATE = mode
        try:
            rumor.DistributedDataParallel(m, **kw)
            msgs[name] = None
        except ValueError as e:
            msgs[name] = str(e)
        finally:
            device_engine.EMULATE = None
    rumor.shutdown()
    return msgs


def dead_peer_rank(mode):
    """Rank 1 leaves during its second backward; rank 0's backward must raise a rumor error."""
    import os as _os

    import torch
    import torch.nn.functional as F

    import rumor
    from rumor.engine import device as device_engine

    rumor.init()
    rumor.set_timeout(20)
    device_engine.EMULATE = mode
    try:
        m = _model(5)
        ddp = rumor.DistributedDataParallel(m, shared_buckets=False, **SMALL_BUCKETS)
    finally:
        device_engine.EMULATE = None
    x, y = _batch(0, rumor.rank())
    F.cross_entropy(ddp(x), y).backward()
    if rumor.rank() == 1:
        _os._exit(0)
    try:
        for step in range(1, 4):
            x, y = _batch(step, 0)
            F.cross_entropy(ddp(x), y).backward()
    except rumor.errors.RumorError as e:
        return type(e).__name__, str(e)
    except RuntimeError as e:  # autograd re-raises a hook's error as it is
        return type(e).__name__, str(e)
    return None


# ==== the tests ===================================================================================

EQUIVALENCE = [("staged", "allreduce", False), ("direct", "allreduce", False), ("direct", "allreduce_sum", False),
               ("direct", "bytegrad", False), ("direct", "qsgd", False), ("staged", "qsgd", False),
               ("direct", "fp16", False), ("direct", "bytegrad_hier", False), ("direct", "allreduce", True),
               ("staged", "bytegrad", True), ("direct", "localsgd", False), ("staged", "localsgd", False),
               ("direct", "onebit", False), ("direct", "onebit_hier", False), ("direct", "lpdec", False),
               ("direct", "lpdec_hier", False), ("direct", "diloco", False), ("staged", "diloco", False),
               ("direct", "diloco_4bit", False), ("staged", "diloco_4bit", False), ("direct", "streaming", False),
               ("staged", "streaming", False)]
EQUIVALENCE = [(3, c) for c in EQUIVALENCE] + [
    (2, c) for c in EQUIVALENCE if c[1] in ("allreduce", "bytegrad", "localsgd", "onebit", "lpdec", "streaming")] + [
    (2, ("direct", "bf16", False))]
CLOSE = [(mode, algo) for mode in ("direct", "staged") for algo in ("dec_all", "dec_shift_one", "dec_exp2", "dec_hier")]
CLOSE += [("direct", "powersgd"), ("direct", "powersgd_bf16"), ("staged", "powersgd"),
          ("direct", "allreduce_overlap"), ("staged", "allreduce_overlap"), ("direct", "allreduce_fused"),
          ("direct", "bytegrad_overlap_clip")]
CLOSE = [(w, c) for w in (2, 3) for c in CLOSE]

# One test id per (world size, case); the selected cases of one world size run in one launch.


def _case_id(world, case):
    mode, algo, *unused = case
    return f"{world}ranks-{mode}-{algo}" + ("-unused" if unused and unused[0] else "")


@pytest.mark.parametrize("world,case", EQUIVALENCE, ids=[_case_id(w, c) for w, c in EQUIVALENCE])
def test_emulated_engine_matches_the_cpp_engine(world, case, request, batches):
    res = harness.batch(batches, ("equivalence", world), lambda: harness.run(
        equivalence_rank, world, timeout=240, args=(harness.selected(request, "case"),)))
    problems = [f"rank {r}: {p}" for r, out in enumerate(res) for p in out[case]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world,case", CLOSE, ids=[_case_id(w, c) for w, c in CLOSE])
def test_emulated_engine_close_to_the_cpp_engine(world, case, request, batches):
    res = harness.batch(batches, ("close", world), lambda: harness.run(
        close_rank, world, timeout=150, args=(harness.selected(request, "case"),)))
    problems = [f"rank {r}: {p}" for r, out in enumerate(res) for p in out[case]]
    assert not problems, "\n".join(problems)


def test_emulated_engine_no_sync():
    res = harness.run(no_sync_rank, 2, timeout=60)
    for r, (local_same, synced_same, local_is_synced) in enumerate(res):
        assert local_same, f"rank {r}: no_sync gradients differ between engines"
        assert synced_same, f"rank {r}: gradients after the synchronized backward differ between engines"
        assert not local_is_synced, f"rank {r}: the synchronized backward changed nothing"


def test_refusals_name_what_has_no_gpu_path():
    (msgs,) = harness.run(refusals_rank, 1, timeout=60)
    assert "OneBitAdamAlgorithm does not run on CUDA parameters yet" in msgs["onebit_staged"], msgs


def test_direct_engine_launches_queue_only_buckets_from_the_calling_thread():
    """A bucket whose op only queues work is launched on the thread that marked it ready (the
    autograd thread); one that waits on the host goes to the worker, and while the worker has
    anything queued or running the buckets after it follow it there, in order."""
    import threading

    import torch

    from rumor.engine import device as device_engine

    log = []

    class Op:
        def __init__(self, name, only, gate=None):
            self.name, self.only, self.gate = name, only, gate

        def launches_only(self, tp):
            return self.only

        def run(self, flat, tp):
            log.append((self.name, threading.get_ident()))
            if self.gate is not None:
                assert self.gate.wait(30), "the test's gate was never opened"

    class Transport:
        size, rank = 2, 0

    gate = threading.Event()
    ops = [Op("a", True), Op("b", False, gate), Op("c", True), Op("d", True)]
    eng = device_engine.DeviceEngine(device_engine.EmulatedLayer(), "direct", Transport(), None, lambda: 30.0)
    try:
        eng.set_buckets([(torch.zeros(4), 4, 0, 1, op) for op in ops])
        me = threading.get_ident()
        eng.mark_ready(0)
        assert log == [("a", me)]
        eng.mark_ready(1)  # to the worker, which holds it at the gate
        eng.mark_ready(2)  # b is queued or running: c must follow it on the worker
        gate.set()
        eng.mark_ready(3)
        eng.finish(30.0)
        assert [n for n, _ in log] == ["a", "b", "c", "d"]
        worker = log[1][1]
        assert worker != me and log[2][1] == worker
        # Next iteration: the worker is idle, so every queue-only bucket launches right here.
        log.clear()
        ops[1].only = True
        for i in range(4):
            eng.mark_ready(i)
        eng.finish(30.0)
        assert log == [(n, me) for n in "abcd"]
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_dead_peer_makes_backward_raise(mode):
    res = harness.run(dead_peer_rank, 2, timeout=90, args=(mode,), may_die=(1,))
    assert res[0] is not None, "rank 0 trained on after its peer left"
    kind, msg = res[0]
    assert kind in ("PeerError", "CommTimeoutError", "RumorError"), (kind, msg)


# ==== on a GPU =====================================================================================

def _gpu_ready():
    try:
        import torch

        import rumor._C as C

        return torch.cuda.is_available() and C.cuda_built() and C.cuda_device_count() > 0
    except Exception:  # noqa: BLE001
        return False


def _need_gpu():
    if not _gpu_ready():
        if os.environ.get("RUMOR_EXPECT_GPU") == "1":
            pytest.fail("RUMOR_EXPECT_GPU=1 but no CUDA device or no CUDA build of rumor")
        pytest.skip("needs a CUDA device and rumor built with its CUDA kernels")


# Algorithms whose result moves by a whole quantization step (a sign, a level, a half-precision
# ulp) where the device's float32 rounding moved a value across a boundary: compared by the
# relative size of the difference, not element by element.
_QUANTIZED = ("bytegrad", "qsgd", "fp16", "bf16", "lpdec", "onebit", "diloco_4bit", "streaming", "powersgd_bf16")

# On one rank over NCCL every algorithm takes its device form; two ranks sharing the GPU stage
# through host memory, where 1-bit Adam and LowPrecisionDecentralized are refused (NCCL only).
GPU_ALGOS_NCCL = ["allreduce", "allreduce_sum", "bytegrad", "qsgd", "fp16", "bf16", "dec_all", "dec_shift_one",
                  "dec_exp2", "localsgd", "lpdec", "diloco", "diloco_4bit", "streaming", "powersgd",
                  "powersgd_bf16", "allreduce_overlap", "allreduce_fused", "onebit"]
GPU_ALGOS_HOST = ["allreduce", "allreduce_sum", "bytegrad", "bytegrad_hier", "qsgd", "fp16", "bf16", "dec_all",
                  "dec_shift_one", "dec_hier", "localsgd", "diloco", "diloco_4bit", "streaming", "powersgd",
                  "allreduce_overlap", "allreduce_fused"]


def _gpu_close(algo: str, a, b) -> str:
    """'' when the CPU result a and the device result b agree, else how far apart they are."""
    import torch

    if a is None or b is None:
        return "" if a is None and b is None else "one side has no gradient"
    diff = float((a - b).abs().max())
    if algo.startswith(_QUANTIZED):
        rel = float((a - b).norm() / b.norm().clamp_min(1e-12))
        return "" if rel <= 2e-2 or torch.allclose(a, b, rtol=1e-4, atol=1e-5) else f"relative |diff| {rel:.3g}"
    # PowerSGD orthogonalizes on the device with torch's kernels: a few more rounding steps.
    tol = dict(rtol=1e-3, atol=1e-4) if algo.startswith("powersgd") else dict(rtol=1e-4, atol=1e-5)
    return "" if torch.allclose(a, b, **tol) else f"max |diff| {diff:.3g}"


def gpu_rank(algos):
    """The model on cuda:0 against the same model on the CPU with the C++ engine: gradients and
    parameters after every step, to float32 rounding (the device's matmuls round differently)."""
    import torch

    import rumor

    torch.cuda.set_device(0)
    rumor.init()
    bad = []
    for algo in algos:
        try:
            ref = _train(None, algo)
            got = _train(None, algo, device="cuda")
        except Exception as e:  # noqa: BLE001 - one algorithm's failure must not hide the others'
            bad.append(f"{algo}: {type(e).__name__}: {e}")
            continue
        for step, ((rg, rp), (gg, gp)) in enumerate(zip(ref, got)):
            why = next((w for w in (_gpu_close(algo, a, b) for a, b in zip(rg + rp, gg + gp)) if w), "")
            if why:
                bad.append(f"{algo} step {step}: {why}")
                break
    rumor.shutdown()
    return bad


@pytest.mark.parametrize("transport,world,algos", [("nccl", 1, GPU_ALGOS_NCCL), ("host", 2, GPU_ALGOS_HOST),
                                                    ("auto", 2, ["allreduce", "bytegrad", "dec_shift_one"])])
def test_cuda_model_matches_cpu(transport, world, algos):
    _need_gpu()
    res = harness.run(gpu_rank, world, timeout=300, args=(algos,), env={"RUMOR_GPU_TRANSPORT": transport})
    problems = [f"rank {r}: {p}" for r, bad in enumerate(res) for p in bad]
    assert not problems, "\n".join(problems)


def _train_torch_ddp(device: str, steps: int = STEPS):
    """_train's model, data and steps under torch's own DistributedDataParallel."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank = dist.get_rank()
    m = _model(10 + rank, device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ddp = torch.nn.parallel.DistributedDataParallel(m, device_ids=[0] if device == "cuda" else None)
    out = []
    for step in range(steps):
        x, y = _batch(step, rank, device)
        opt.zero_grad(set_to_none=(step % 2 == 0))
        F.cross_entropy(ddp(x), y).backward()
        grads = [p.grad.detach().cpu().clone() for p in m.parameters()]
        opt.step()
        out.append((grads, [p.detach().cpu().clone() for p in m.parameters()]))
    return out


def torch_ddp_rank(store_path: str, device: str = "cuda"):
    """rumor's GradientAllReduce on cuda:0 against torch DDP on cuda:0 (NCCL for one rank; gloo
    on CUDA tensors for two ranks sharing the GPU, beside rumor's host staging): gradients and
    parameters after every step, bit for bit (an average of one or two float32 values is exact
    in either order)."""
    import torch
    import torch.distributed as dist

    import rumor

    if device == "cuda":
        torch.cuda.set_device(0)
    rumor.init()
    world = rumor.size()
    dist.init_process_group("nccl" if world == 1 and device == "cuda" else "gloo", store=dist.FileStore(store_path, world),
                            rank=rumor.rank(), world_size=world)
    bad = []
    try:
        ref = _train_torch_ddp(device)
        got = _train(None, "allreduce", device=device)
        for step, ((rg, rp), (gg, gp)) in enumerate(zip(ref, got)):
            for i, (a, b) in enumerate(zip(rg + rp, gg + gp)):
                if not torch.equal(a, b):
                    what = "gradient" if i < len(rg) else "parameter"
                    bad.append(f"step {step} {what} {i % len(rg)}: max |diff| {float((a - b).abs().max()):.3g}")
            if bad:
                break
    finally:
        dist.destroy_process_group()
        rumor.shutdown()
    return bad


@pytest.mark.parametrize("transport,world", [("nccl", 1), ("host", 2)])
def test_cuda_model_matches_torch_ddp(transport, world, tmp_path):
    _need_gpu()
    res = harness.run(torch_ddp_rank, world, timeout=180, args=(str(tmp_path / "store"),),
                      env={"RUMOR_GPU_TRANSPORT": transport})
    problems = [f"rank {r}: {p}" for r, bad in enumerate(res) for p in bad]
    assert not problems, "\n".join(problems)


def overlap_rank(algo: str):
    """Trains a wide MLP on cuda:0 and returns the GPU activity of two profiled steps (torch's
    profiler, CUPTI): [(stream, kind, name, start_us, end_us)] for kernels and copies."""
    import json
    import tempfile

    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    import rumor

    torch.cuda.set_device(0)
    rumor.init()
    torch.manual_seed(0)
    width = 2048
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    m = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10)).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    # A bucket per layer or so (a 2048 x 2048 float32 weight is 16 MiB): the first buckets are
    # ready while the earlier layers' backward still runs.
    if algo == "onebit":  # after freeze_step its op updates the momentum on the device, even on one rank
        opt = rumor.optim.OneBitAdamOptimizer(m.parameters(), lr=1e-4, freeze_step=2)
        alg = rumor.algorithms.OneBitAdamAlgorithm(opt)
    else:
        alg = _algorithm(algo)
    ddp = rumor.DistributedDataParallel(m, algorithm=alg, bucket_cap_mb=17, first_bucket_mb=17, optimizer=opt)
    x = torch.randn(2048, width, device="cuda")
    y = torch.randint(0, 10, (2048,), device="cuda")

    def step():
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        torch.cuda.synchronize()

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            stream = e.get("args", {}).get("stream")
            events.append((stream, e["cat"], e["name"][:80], float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    n_buckets = len(ddp.buckets)
    rumor.shutdown()
    return n_buckets, events


# One GPU allows one NCCL rank, where the compressed ops and the allreduce have nothing to do:
# over NCCL, the ops that still compute on one rank (1-bit Adam's momentum, PowerSGD's factors).
@pytest.mark.parametrize("transport,algo", [("host", "allreduce"), ("nccl", "onebit"), ("nccl", "powersgd")])
def test_cuda_buckets_overlap_backward(transport, algo):
    """The engine's communication-stream work (host staging's copies out; the device ops'
    kernels over NCCL) runs on the GPU while the compute stream still runs backward: without
    overlap it would only start after backward's last kernel (the optimizer step waits for it)."""
    _need_gpu()
    [(n_buckets, events)] = harness.run(overlap_rank, 1, timeout=240, args=(algo,),
                                        env={"RUMOR_GPU_TRANSPORT": transport})
    assert n_buckets >= 3, n_buckets
    busy = {}
    for s, kind, _, t0, t1 in events:
        if kind == "kernel":
            busy[s] = busy.get(s, 0.0) + (t1 - t0)
    assert busy, f"no kernels in the trace: {events[:5]}"
    compute = max(busy, key=busy.get)  # the stream of the matmuls
    mine = [e for e in events if e[0] != compute]
    theirs = [(t0, t1) for s, kind, _, t0, t1 in events if s == compute and kind == "kernel"]
    assert mine, f"nothing ran outside the compute stream {compute}: {sorted(busy.items())}"
    overlap = sum(max(0.0, min(a1, b1) - max(a0, b0)) for _, _, _, a0, a1 in mine for b0, b1 in theirs)
    total = sum(t1 - t0 for _, _, _, t0, t1 in mine)
    print(f"{transport} {algo}: {len(mine)} events off the compute stream, {total:.0f} us, "
          f"{overlap:.0f} us of it beside compute kernels; kinds {sorted({e[1] for e in mine})}")
    assert overlap > 0, f"communication never ran beside the compute stream's kernels: {mine[:8]}"
