#!/usr/bin/env python
"""GPU benchmark (issue 12): rumor vs torch.distributed on ONE GPU, per BENCHMARKS.md.

Needs: a CUDA device, the installed rumor package, torch with CUDA; matplotlib for the plot and
tqdm for the progress bar (pip install 'rumor[bench]'). Without a visible CUDA
device it says so in one line and exits 0 without writing anything (1 with --require-gpu or
RUMOR_EXPECT_GPU=1, as scripts/gpu_check.sh sets).

Ran on an H200 (docs/gpu.md, "What ran on a GPU"), except the rumor-stream variant below, whose
orchestration, table, JSON and plot have only run on the CPU (the same code with CPU tensors).

What it measures. One GPU allows two set-ups (NCCL refuses two ranks on one device):

  1 rank   rumor.allreduce_ over rumor's NCCL communicator (RUMOR_GPU_TRANSPORT=nccl) vs
           torch.distributed.all_reduce over a one-rank NCCL process group, both in place;
           rumor twice: as configured (gpu_wait=host by default: the call waits on the host for
           its op) and as "rumor-stream" under rumor.set_gpu_wait("stream") (returns once
           queued, like torch's call; its deadline kept by a watch thread).
  2 ranks  two processes sharing cuda:0: rumor staging through page-locked host memory
           (RUMOR_GPU_TRANSPORT=host) vs torch.distributed gloo, which takes CUDA tensors and
           stages them too.
  Both     a third variant, "backend": torch.distributed.all_reduce on a group of torch's rumor
           backend (new_group(backend="cpu:rumor,cuda:nccl") with 1 rank: the rumor group hands
           CUDA tensors to its own NCCL backend; backend="rumor" with 2 ranks: it stages them
           through host memory). backend/torch is its speed next to torch's group of the job.

Each job (one per world size) starts its ranks with a deadline (rumor.testing.launch); each rank
sets cuda:0, calls rumor.init() and then torch.distributed.init_process_group (nccl for 1 rank,
gloo for 2), so both libraries run in the same processes, on the same data, alternating.

  allreduce  float32, 4 KiB .. 256 MiB in powers of 4, SUM in place. Per size: --warmup ops per
      library (the first checked against the exact sum), then --iters samples per library,
      rotating which goes first. A sample is `reps` back-to-back ops (reps > 1 for small sizes,
      the same for both, so a sample lasts >= --target-ms) between a torch.cuda.synchronize()
      before and after (after a gloo barrier with 2 ranks): wall-clock time / reps, the slowest
      rank's. Wall clock, because rumor's blocking call waits on the host for its deadline while
      torch's NCCL call returns once queued: the synchronize makes both pay for the whole op.
      CUDA-event time of the same samples is in the JSON too. Reported: median [min-max];
      algbw = size / time; busbw = algbw * 2(n-1)/n (undefined for n = 1: no bytes cross a
      bus; algbw only); rumor/torch = ratio of median times.
      Bounds, measured in the same job:
        1 rank: a device-to-device copy of the same size (torch copy_, timed as a third variant
          alongside): what a one-rank out-of-place allreduce must move, and the cost of one
          kernel launch at small sizes. In place, NCCL need move nothing, so rumor/bound may
          exceed 1: at one rank the figure is mostly per-call overhead.
        2 ranks: the staging both libraries do, from pinned host<->device copy bandwidth (64 MiB,
          one process) and 1-thread memcpy bandwidth (64 MiB), measured by rank 0 before and
          after the sizes (medians used):
            staged  = n*S/D2H + n*S/H2D + 2(n-1)/n * S/memcpy  (copy out, reduce, copy back,
                      one after another; the n ranks share the GPU's link)
            piped   = the largest of those three terms (a perfectly pipelined staging)
          reported as algbw S/time and rumor's fraction of it.
  ddp  the standard models (rumor.testing.models: mlp25m [32], cnn [32], transformer [16]) on
      cuda:0, SGD(momentum 0.9); a step is zero_grad, forward, cross-entropy, backward, step,
      then torch.cuda.synchronize(); after a gloo barrier with 2 ranks; the slowest rank's time.
      Variants, the same weights and batches:
        compute  the plain model (the bound; with 2 ranks both compute at once on the GPU);
        rumor    rumor.DistributedDataParallel(model, optimizer=opt);
        torch    torch.nn.parallel.DistributedDataParallel(model, device_ids=[0]).
      --warmup steps per variant, then --iters measured, rotating which goes first.
      samples/s = global batch / median step. A variant whose construction or warm-up raises
      is reported as an error with its message; the others still run.

Output: tables (with a progress bar while it runs), JSON with every raw figure (--out, default
docs/benchmarks/gpu.json) and a PNG next to it; the last line printed is the headline ratio.
Exit status: 0, or 1 when a job failed, a result was wrong, or (with --require-gpu or
RUMOR_EXPECT_GPU=1) no GPU is visible. A variant that raised (the DDP row above) is reported
without changing the exit status.

  python benchmarks/gpu.py                       # both world sizes, allreduce and DDP (estimated 1-3 min)
  python benchmarks/gpu.py --quick               # smoke run: 3 sizes, fewer steps
  python benchmarks/gpu.py --worlds 1 --parts allreduce
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Dict, List, Optional

import _common
from _common import Progress, emit
from collectives import KiB, MiB, busbw_factor, fmt_bw, fmt_size, fmt_time, measure_memcpy, parse_size

PARTS = ("allreduce", "ddp")
MODELS = ("mlp25m", "cnn", "transformer")
DEFAULT_OUT = os.path.join(_common.HERE, "..", "docs", "benchmarks", "gpu.json")
BOUND_BYTES = 64 * MiB  # size of the pinned-copy and memcpy measurements
LABEL = {"rumor": "rumor", "rumor-stream": "rumor (gpu_wait=stream)", "torch": "torch", "copy": "D2D copy",
         "compute": "compute-only", "backend": "torch on rumor's backend"}
# The torch.distributed group of the "backend" variant: CUDA tensors on the rumor backend, handed to
# NCCL by its device map with one rank, staged through host memory with two (NCCL: one rank per GPU).
BACKEND_SPELLING = {1: "cpu:rumor,cuda:nccl", 2: "rumor"}


def setup(n: int, device: str) -> Dict[str, str]:
    """The world of n ranks on one device: rumor's transport and torch's backend. One rank: NCCL
    on both sides. Two ranks share the GPU, which NCCL refuses: rumor stages through host memory
    and torch uses gloo (which stages CUDA tensors too). On the CPU (device "cpu", used only to
    exercise this script where there is no GPU) torch has gloo only."""
    if n == 1:
        return dict(transport="nccl", backend="nccl" if device == "cuda" else "gloo")
    return dict(transport="host", backend="gloo")


# ==== inside a rank ==================================================================================

class Rank:
    """What the measurements of one rank need: its device, rank and world, and the ways to wait
    for the device and for the other ranks."""

    def __init__(self, cfg: Dict, rank: int, n: int):
        import torch
        import torch.distributed as dist

        self.cfg, self.rank, self.n = cfg, rank, n
        self.backend_group = None  # the "backend" variant's group (worker_main makes it)
        self.cuda = cfg["device"] == "cuda"
        self.dev = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self._dist = dist
        self._torch = torch

    def sync(self) -> None:
        if self.cuda:
            self._torch.cuda.synchronize()

    def barrier(self) -> None:
        # With several ranks the default group is gloo (setup()), whose barrier is a CPU op; one
        # rank has nobody to wait for (and its NCCL group would need a device for a barrier).
        if self.n > 1:
            self._dist.barrier()

    def events(self):
        """A (start, end) pair of CUDA timing events, or None on the CPU."""
        if not self.cuda:
            return None
        return (self._torch.cuda.Event(enable_timing=True), self._torch.cuda.Event(enable_timing=True))

    def gather_samples(self, samples: Dict[str, List[float]]) -> Dict[str, List[List[float]]]:
        """Every rank's samples per variant (rank 0 takes each sample as the slowest rank's)."""
        if self.n == 1:
            return {v: [list(s)] for v, s in samples.items()}
        return _common.gather_samples(samples)

    def agree_failed(self, failed: Dict[str, str]) -> Dict[str, str]:
        """Variants that failed on any rank, with every rank's message (the first to fail may not be
        the first rank: its peers then time out), the same on every rank, so that all ranks drop
        the same ones and their collectives keep matching."""
        if self.n == 1:
            return dict(failed)
        every = [None] * self.n
        self._dist.all_gather_object(every, failed)
        out: Dict[str, Dict[str, List[int]]] = {}  # variant -> message -> ranks
        for r, f in enumerate(every):
            for v, msg in f.items():
                out.setdefault(v, {}).setdefault(msg, []).append(r)
        return {v: "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {msg}"
                             for msg, rs in msgs.items()) for v, msgs in out.items()}

    def attempt(self, v: str, what: str, fn, failed: Dict[str, str]) -> Optional[float]:
        """Runs one warm-up call of variant v (fn, then a synchronize) and returns its seconds, or
        None after recording in `failed` why it raised here or on another rank. Every rank learns
        the outcome of every call before the next, so a variant that fails is dropped by all ranks
        at the same point and the collectives that follow still match (a rank left waiting in the
        failed op meets the others after that op's deadline)."""
        t0 = time.perf_counter()
        err = None
        try:
            fn()
            self.sync()
        except Exception as e:  # noqa: BLE001 (reported as this variant's error)
            err = _error_text(e)
            sys.stderr.write(f"rank {self.rank}: {v} {what} raised:\n{traceback.format_exc()}")
        took = time.perf_counter() - t0
        merged = self.agree_failed({v: err} if err else {})
        if v in merged:
            failed[v] = merged[v]
            return None
        return took

    def max_over_ranks(self, x: float) -> float:
        if self.n == 1:
            return x
        t = self._torch.tensor([x], dtype=self._torch.float64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        return float(t)


def _error_text(e: BaseException) -> str:
    """One line: the exception's type and the first line of its message."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"


def _describe(ctx: Rank) -> Dict:
    import torch

    import rumor

    d = dict(rank=ctx.rank, size=ctx.n, device=str(ctx.dev), torch=torch.__version__,
             torch_cuda=torch.version.cuda, rumor=getattr(rumor, "__version__", "?"),
             transport_env=os.environ.get("RUMOR_GPU_TRANSPORT"), backend=ctx.cfg["backend"])
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        d.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2 ** 30, 1),
                 visible_devices=torch.cuda.device_count())
        try:
            v = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
            d["torch_nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001 (informational only)
            d["torch_nccl"] = _error_text(e)
        try:
            from rumor.gpu import nccl as _nccl

            lib = _nccl.load()
            d["rumor_nccl"] = f"{lib.version} ({lib.path})"
        except Exception as e:  # noqa: BLE001 (the transport's own error shows where it matters)
            d["rumor_nccl"] = _error_text(e)
    return d


def _rumor_transport() -> Optional[str]:
    """The transport rumor's world group agreed on (None before its first CUDA collective). Read
    from rumor's runtime state: there is no public accessor, and the figure is only a label."""
    try:
        import rumor._runtime as rt

        gpu = getattr(rt.state().world, "_gpu", None)
        return getattr(gpu, "transport", None)
    except Exception:  # noqa: BLE001
        return None


def _link_bandwidth(ctx: Rank, nbytes: int = BOUND_BYTES, iters: int = 10) -> Dict:
    """Pinned host -> device and device -> host copy bandwidth (bytes/s, median of iters copies,
    each synchronized), and 1-thread memcpy: the pieces of the staging bound."""
    import torch

    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True).fill_(1.0)
    devbuf = torch.empty(nbytes // 4, dtype=torch.float32, device=ctx.dev)
    out = dict(bytes=nbytes)
    for name, dst, src in (("h2d", devbuf, host), ("d2h", host, devbuf)):
        samples = []
        for i in range(iters + 2):
            ctx.sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            ctx.sync()
            if i >= 2:  # two warm-up copies
                samples.append(time.perf_counter() - t0)
        out[name + "_samples_s"] = samples
        out[name + "_bw"] = nbytes / statistics.median(samples)
    mc = measure_memcpy(nbytes)
    out["memcpy_samples_s"], out["memcpy_bw"] = mc["samples_s"], mc["bw"]
    del host, devbuf
    return out


def _measure_bounds(ctx: Rank, when: str) -> None:
    """Rank 0 measures the staging bound while the others wait (it needs the link to itself)."""
    if ctx.n > 1 and ctx.cuda:
        if ctx.rank == 0:
            emit("bound", dict(when=when, **_link_bandwidth(ctx)))
        ctx.barrier()


@contextlib.contextmanager
def _gpu_wait(variant: str):
    """rumor's wait mode for one variant: "stream" for rumor-stream, rumor's default otherwise."""
    import rumor

    if variant != "rumor-stream":
        yield
        return
    before = rumor.get_gpu_wait()
    rumor.set_gpu_wait("stream")
    try:
        yield
    finally:
        rumor.set_gpu_wait(before)


def _allreduce_part(ctx: Rank) -> None:
    dead: Dict[str, str] = {}  # variants that raised: skipped in the later sizes
    for size in ctx.cfg["sizes"]:
        cell = _allreduce_cell(ctx, size, dead)
        if ctx.rank == 0:
            emit("cell", cell)


def _allreduce_cell(ctx: Rank, size: int, dead: Dict[str, str]) -> Dict:
    """One size: warm-up and check, then samples of every live variant. A function so that its
    buffers are freed before the next size."""
    import torch
    import torch.distributed as dist

    import rumor

    cfg, n, rank = ctx.cfg, ctx.n, ctx.rank
    numel = size // 4
    # Small positive integers: sums of n ranks are exact, and `reps` in-place sums (each doubling
    # at n = 2) stay exact and finite for reps <= max_reps (64) since they only scale by n^reps.
    pattern = torch.arange(numel, device=ctx.dev) % 13 + 1
    base = (pattern + rank).to(torch.float32)
    want = (pattern * n + n * (n - 1) // 2).to(torch.float32)
    del pattern
    bufs = {"rumor": torch.empty_like(base), "torch": torch.empty_like(base)}
    fns = {"rumor": lambda: rumor.allreduce_(bufs["rumor"], op=rumor.ReduceOp.SUM),
           "torch": lambda: dist.all_reduce(bufs["torch"], op=dist.ReduceOp.SUM)}
    if cfg["transport"] == "nccl":
        # The same call with rumor.set_gpu_wait("stream"): returns once queued, as torch's does.
        bufs["rumor-stream"] = torch.empty_like(base)
        fns["rumor-stream"] = lambda: rumor.allreduce_(bufs["rumor-stream"], op=rumor.ReduceOp.SUM)
    if ctx.backend_group is not None:
        bufs["backend"] = torch.empty_like(base)
        fns["backend"] = lambda: dist.all_reduce(bufs["backend"], op=dist.ReduceOp.SUM, group=ctx.backend_group)
    if n == 1:
        # The one-rank bound: what an out-of-place allreduce must move (base == want at n = 1).
        bufs["copy"] = torch.empty_like(base)
        fns["copy"] = lambda: bufs["copy"].copy_(base)
    variants = [v for v in fns if v not in dead]

    def refill(v):
        if v != "copy":
            bufs[v].copy_(base)

    # Warm-up: the first op of each variant is checked; the fastest op sets reps.
    warm = {v: [] for v in variants}
    correct: Dict[str, object] = {}
    failed: Dict[str, str] = {}
    for w in range(cfg["warmup"]):
        for v in variants:
            if v in failed:
                continue
            refill(v)
            ctx.sync()
            ctx.barrier()
            with _gpu_wait(v):
                took = ctx.attempt(v, f"allreduce {size} B", fns[v], failed)
            if took is None:
                continue
            warm[v].append(took)
            if w == 0:
                ok = bool(torch.equal(bufs[v], want))
                if not ok:
                    bad = (bufs[v] != want).nonzero()
                    first = int(bad[0]) if len(bad) else -1
                    correct[v] = (f"rank {rank}: {v} allreduce {size} B wrong: first bad index {first}, "
                                  f"got {float(bufs[v][first])} want {float(want[first])}")
                else:
                    correct[v] = True
    for v, msg in failed.items():
        dead[v] = f"{msg} (at {fmt_size(size)})"
    variants = [v for v in variants if v not in failed]
    del want

    reps = 1
    if variants:
        fastest = ctx.max_over_ranks(min(min(warm[v]) for v in variants))
        reps = max(1, min(cfg["max_reps"], math.ceil(cfg["target_s"] / max(fastest, 1e-7))))
    samples = {v: [] for v in variants}
    event_samples = {v: [] for v in variants}
    for i in range(cfg["iters"]):
        k = i % max(1, len(variants))
        for v in variants[k:] + variants[:k]:  # rotate who goes first
            refill(v)
            ctx.sync()
            ctx.barrier()
            ev = ctx.events()
            with _gpu_wait(v):
                t0 = time.perf_counter()
                if ev:
                    ev[0].record()
                for _ in range(reps):
                    fns[v]()
                if ev:
                    ev[1].record()
                ctx.sync()
            samples[v].append((time.perf_counter() - t0) / reps)
            event_samples[v].append(ev[0].elapsed_time(ev[1]) / 1e3 / reps if ev else float("nan"))
    per_rank = ctx.gather_samples(samples)
    per_rank_ev = ctx.gather_samples(event_samples)
    oks = [correct]
    if n > 1:
        oks = [None] * n
        dist.all_gather_object(oks, correct)
    cell = dict(part="allreduce", size=size, n=n, reps=reps, rumor_transport=_rumor_transport(),
                variants={}, errors={v: dead[v] for v in fns if v in dead})
    for v in variants:
        errs = [o[v] for o in oks if o.get(v) is not True]
        cell["variants"][v] = dict(
            samples_s=[max(per_rank[v][r][i] for r in range(n)) for i in range(cfg["iters"])],
            event_samples_s=[max(per_rank_ev[v][r][i] for r in range(n)) for i in range(cfg["iters"])],
            per_rank_samples_s=per_rank[v], warmup_s=warm[v], correct=not errs, wrong=errs[:4])
    return cell


def _ddp_part(ctx: Rank) -> None:
    for name in ctx.cfg["models"]:
        cell = _ddp_model(ctx, name)
        if ctx.rank == 0:
            emit("cell", cell)


def _ddp_model(ctx: Rank, name: str) -> Dict:
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import rumor
    from rumor.testing import models

    cfg, n, rank = ctx.cfg, ctx.n, ctx.rank
    batch = cfg["batch"].get(name) or models.BATCH[name]
    wrappers = {
        "compute": lambda m, o: m,
        "rumor": lambda m, o: rumor.DistributedDataParallel(m, optimizer=o),
        "torch": lambda m, o: TorchDDP(m, device_ids=[0]) if ctx.cuda else TorchDDP(m),
    }
    variants: Dict[str, tuple] = {}
    failed: Dict[str, str] = {}
    for v, wrap in wrappers.items():
        model = models.build(name, seed=cfg["seed"]).to(ctx.dev)
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        try:
            # A construction that fails on every rank alike fails before any collective; a
            # failure on some ranks only is settled by agree_failed() below (peers left waiting
            # in the wrapper's collectives raise at their deadline first).
            variants[v] = (wrap(model, opt), opt)
        except Exception as e:  # noqa: BLE001 (reported as this variant's error)
            failed[v] = _error_text(e)
            sys.stderr.write(f"rank {rank}: {v} {name} construction raised:\n{traceback.format_exc()}")
    nparams = models.num_params(model)  # every variant's model is the same network
    data = [tuple(t.to(ctx.dev) for t in models.batch(name, batch, step=i, shard=rank, seed=cfg["seed"]))
            for i in range(4)]

    def step(v, i):
        model, opt = variants[v]
        x, y = data[i % len(data)]
        opt.zero_grad()
        loss = models.loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    failed = ctx.agree_failed(failed)
    counts = {v: 0 for v in variants}
    warm = {v: [] for v in variants}
    for v in [v for v in variants if v not in failed]:
        for _ in range(cfg["ddp_warmup"]):
            ctx.sync()
            ctx.barrier()
            took = ctx.attempt(v, f"{name} warm-up step", lambda: step(v, counts[v]), failed)
            if took is None:
                break
            warm[v].append(took)
            counts[v] += 1
        if rank == 0:
            emit("progress", {"what": f"{name}: warm-up {v}"})
    names = [v for v in variants if v not in failed]

    times = {v: [] for v in names}
    losses = {v: [] for v in names}
    for i in range(cfg["ddp_iters"]):
        k = i % max(1, len(names))
        for v in names[k:] + names[:k]:  # rotate who goes first
            ctx.sync()
            ctx.barrier()
            t0 = time.perf_counter()
            loss = step(v, counts[v])
            ctx.sync()
            times[v].append(time.perf_counter() - t0)
            losses[v].append(float(loss))
            counts[v] += 1
        if rank == 0 and (i + 1) % 5 == 0:
            emit("progress", {"what": f"{name}: step {i + 1}/{cfg['ddp_iters']}"})
    per_rank = ctx.gather_samples(times)
    mean_loss = {}
    for v in names:
        t = torch.tensor(losses[v], dtype=torch.float64)
        if n > 1:
            dist.all_reduce(t)
        mean_loss[v] = (t / n).tolist()
    cell = dict(part="ddp", model=name, n=n, batch=batch, global_batch=batch * n, params=nparams,
                rumor_transport=_rumor_transport(), variants={}, errors=failed)
    for v in names:
        cell["variants"][v] = dict(step_s=[max(per_rank[v][r][i] for r in range(n)) for i in range(len(times[v]))],
                                   per_rank_step_s=per_rank[v], warmup_s=warm[v], loss=mean_loss[v])
    del variants, data
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    return cell


def worker_main(cfg_path: str) -> int:
    """A rank: as _common.worker_main, with the GPU's set-up first (device, rumor's transport)
    and torch's backend from the config (nccl for one rank)."""
    with open(cfg_path) as f:
        cfg = json.load(f)
    rank = int(os.environ["RANK"])
    # Before rumor reads it (at the group's first CUDA collective); the job's choice wins over
    # whatever the caller's environment says, so that each job measures the transport it names.
    os.environ["RUMOR_GPU_TRANSPORT"] = cfg["transport"]
    try:
        _common._guard(cfg)
        import torch
        import torch.distributed as dist

        if cfg["device"] == "cuda":
            torch.cuda.set_device(0)  # every rank: the one GPU, before rumor's first CUDA call
        import rumor

        rumor.init(timeout=cfg["rumor_timeout"])
        # gloo's deadline is longer than rumor's: a rank stuck in a rumor op whose peer gave up
        # raises at rumor's deadline and still meets the others in agree_failed().
        dist.init_process_group(cfg["backend"], timeout=datetime.timedelta(seconds=2 * cfg["rumor_timeout"]))
        n = rumor.size()
        assert dist.get_world_size() == n and dist.get_rank() == rank == rumor.rank()
        assert n == 1 or cfg["backend"] == "gloo", "Rank's barriers and gathers are CPU ops: gloo with n > 1"
        ctx = Rank(cfg, rank, n)
        if "allreduce" in cfg["parts"] and n in BACKEND_SPELLING:
            ctx.backend_group = dist.new_group(backend=BACKEND_SPELLING[n])
        infos = [_describe(ctx)]
        if n > 1:
            infos = [None] * n
            dist.all_gather_object(infos, _describe(ctx))
        if rank == 0:
            emit("info", infos)
        if "allreduce" in cfg["parts"]:
            _measure_bounds(ctx, "start")
            _allreduce_part(ctx)
            _measure_bounds(ctx, "end")
        if "ddp" in cfg["parts"]:
            _ddp_part(ctx)
        ctx.sync()
        # torch's barrier only: after a rumor variant failed, rumor's world may be aborted (an
        # op's deadline aborts it), and that is already reported.
        ctx.barrier()
        if rank == 0:
            emit("done", {})
    except BaseException:  # noqa: BLE001
        tb = traceback.format_exc()
        sys.stderr.write(f"rank {rank} failed:\n{tb}")
        sys.stderr.flush()
        if rank == 0:
            emit("error", {"rank": rank, "traceback": tb})
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the teardown of rumor's, gloo's and NCCL's threads


# ==== the driver =====================================================================================

class Job(_common.Job):
    """One world size on the one GPU, running the parts asked for."""

    def __init__(self, args, n: int, workdir: str, progress, base: int, device: str):
        super().__init__(os.path.abspath(__file__), args, n, workdir, progress, base)
        self.device = device
        self.setup = setup(n, device)
        self.bounds: List[Dict] = []  # rank 0's "bound" messages (2 ranks: the staging figures)

    @property
    def label(self) -> str:
        where = "cuda:0" if self.device == "cuda" else "cpu (dry run)"
        if self.n == 1:
            return f"1 rank on {where}: rumor {self.setup['transport']} vs torch {self.setup['backend']}"
        return (f"{self.n} ranks sharing {where}: rumor {self.setup['transport']} staging vs "
                f"torch {self.setup['backend']}")

    def config(self) -> Dict:
        a = self.args
        return dict(self.setup, device=self.device, parts=a.parts, sizes=a.sizes, iters=a.iters, warmup=a.warmup,
                    target_s=a.target_ms / 1e3, max_reps=a.max_reps, models=a.models, batch=a.batch_map,
                    ddp_iters=a.ddp_iters, ddp_warmup=a.ddp_warmup, lr=a.lr, seed=a.seed)

    def on_message(self, kind: str, data) -> None:
        if kind == "bound":
            self.bounds.append(data)
        elif kind == "cell":
            what = fmt_size(data["size"]) if data["part"] == "allreduce" else data["model"]
            self.progress.update(self.base + len(self.cells), f"n={self.n}: {data['part']} {what} done", force=True)
        elif kind == "progress":
            self.progress.update(None, f"n={self.n}: ddp {data['what']}")


def run_jobs(jobs: List[Job], result: Dict, progress, time_limit: float) -> int:
    """Runs the jobs one after the other, each with a deadline within the run's time limit, into
    result's cells, jobs and errors; 1 if one failed or was not started."""
    rc = 0
    deadline = time.monotonic() + time_limit
    for job in jobs:
        left = deadline - time.monotonic()
        progress.update(job.base, f"n={job.n}: starting", force=True)
        if left < 30:
            job.error = f"not started: --time-limit {time_limit:.0f} s was reached"
        else:
            # Its own copy of the arguments: _common.Job.run reads the deadline from them.
            job.args = copy.copy(job.args)
            job.args.job_timeout = min(job.args.job_timeout, left)
            job.run()
        result["cells"].extend(job.cells)
        result["jobs"].append(dict(label=job.label, n=job.n, setup=job.setup, info=job.info, bounds=job.bounds,
                                   error=job.error))
        if job.error:
            progress.clear()
            print(f"\nERROR in job {job.label}:\n{job.error}", file=sys.stderr)
            result["errors"].append(job.error)
            rc = 1
    return rc


def _stats(samples: List[float]) -> Dict:
    return dict(median_s=statistics.median(samples), min_s=min(samples), max_s=max(samples))


def staged_bound(size: int, n: int, bounds: Dict) -> Dict:
    """The 2-rank bounds at one size (see the module docstring): seconds and algbw."""
    terms = dict(d2h_s=n * size / bounds["d2h_bw"], h2d_s=n * size / bounds["h2d_bw"],
                 reduce_s=busbw_factor("allreduce", n) * size / bounds["memcpy_bw"])
    staged, piped = sum(terms.values()), max(terms.values())
    return dict(terms, staged_s=staged, piped_s=piped, staged_algbw=size / staged, piped_algbw=size / piped)


def job_bounds(job: Dict) -> Optional[Dict]:
    """The medians of rank 0's start and end measurements of one job, None if it made none."""
    got = job.get("bounds") or []
    if not got:
        return None
    return {k: statistics.median(b[k] for b in got) for k in ("h2d_bw", "d2h_bw", "memcpy_bw")}


def summarize(cell: Dict, bounds: Optional[Dict]) -> None:
    """Medians, bandwidths, ratios and the bound of one cell (in place)."""
    v = cell["variants"]
    if cell["part"] == "allreduce":
        size, n = cell["size"], cell["n"]
        for d in v.values():
            d.update(_stats(d["samples_s"]))
            d["algbw"] = size / d["median_s"]
            d["algbw_min"], d["algbw_max"] = size / d["max_s"], size / d["min_s"]
            # n = 1: no bytes cross a bus, so busbw (algbw * 2(n-1)/n) would read 0: undefined.
            d["busbw"] = d["algbw"] * busbw_factor("allreduce", n) if n > 1 else None
            ev = [x for x in d["event_samples_s"] if x == x]
            d["event_median_s"] = statistics.median(ev) if ev else None
        if "rumor" in v and "torch" in v:
            cell["rumor_over_torch"] = v["torch"]["median_s"] / v["rumor"]["median_s"]
        if "rumor-stream" in v and "torch" in v:
            cell["stream_over_torch"] = v["torch"]["median_s"] / v["rumor-stream"]["median_s"]
        if "backend" in v and "torch" in v:
            cell["backend_over_torch"] = v["torch"]["median_s"] / v["backend"]["median_s"]
        if n == 1 and "copy" in v:
            cell["bound"] = dict(kind="device copy", algbw=v["copy"]["algbw"])
        elif n > 1 and bounds:
            b = staged_bound(size, n, bounds)
            cell["bound"] = dict(kind="staged", algbw=b["staged_algbw"], **b)
        if "bound" in cell and "rumor" in v:
            cell["rumor_over_bound"] = v["rumor"]["algbw"] / cell["bound"]["algbw"]
            if "piped_algbw" in cell["bound"]:
                cell["rumor_over_piped"] = v["rumor"]["algbw"] / cell["bound"]["piped_algbw"]
    else:
        gb = cell["global_batch"]
        for d in v.values():
            d.update(_stats(d["step_s"]))
            d["samples_per_s"] = gb / d["median_s"]
            d["samples_per_s_min"], d["samples_per_s_max"] = gb / d["max_s"], gb / d["min_s"]
            d["final_loss"] = d["loss"][-1] if d["loss"] else None
        for d in v.values():
            if "compute" in v:
                d["over_compute"] = d["samples_per_s"] / v["compute"]["samples_per_s"]
            if "torch" in v:
                d["over_torch"] = d["samples_per_s"] / v["torch"]["samples_per_s"]
        if "rumor" in v and "torch" in v:
            cell["rumor_over_torch"] = v["rumor"]["over_torch"]


def _bw(x: Optional[float]) -> str:
    return "-" if x is None else fmt_bw(x)


def _wrap(text: str, indent: str = "    ", width: int = 110) -> str:
    import textwrap

    return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent + "  ")


def print_allreduce(cells: List[Dict], job: Dict) -> None:
    if not cells:
        return
    n = cells[0]["n"]
    iters = max(len(d["samples_s"]) for c in cells for d in c["variants"].values()) if cells else 0
    peer = f"torch {job['setup']['backend']}"
    bus = "busbw = algbw*2(n-1)/n" if n > 1 else "busbw undefined for n = 1 (no bytes cross a bus): algbw only"
    print(f"\n{job['label']}: allreduce float32 SUM in place, n={n}   (time = median [min-max] of {iters} samples, "
          f"wall clock around synchronize; algbw = size/time in GB/s; {bus}; rumor transport: "
          f"{next((c['rumor_transport'] for c in cells if c.get('rumor_transport')), '?')})")
    head = f"{'size':>9} {'reps':>4} |"
    stream = any("rumor-stream" in c["variants"] or "rumor-stream" in c["errors"] for c in cells)
    backend = any("backend" in c["variants"] or "backend" in c["errors"] for c in cells)
    shown = ["rumor"] + (["rumor-stream"] if stream else []) + ["torch"] + (["backend"] if backend else [])
    for name in ["rumor"] + (["rumor stream"] if stream else []) + [peer] + (["backend"] if backend else []):
        head += f" {name + ' time':>27} {'algbw':>7} {'busbw':>7} |"
    head += f" {'rumor/torch':>11} |" + (f" {'stream/torch':>12} |" if stream else "")
    head += f" {'backend/torch':>13} |" if backend else ""
    head += (f" {'D2D copy time':>15} {'algbw':>7} {'rumor/copy':>10}" if n == 1 else
             f" {'staged bound':>12} {'rumor/staged':>12} {'piped':>7} {'rumor/piped':>11}")
    print(head)
    print("-" * len(head))
    for c in cells:
        row = f"{fmt_size(c['size']):>9} {c['reps']:>4} |"
        for v in shown:
            d = c["variants"].get(v)
            if d is None:
                row += f" {'error' if v in c['errors'] else '-':>27} {'-':>7} {'-':>7} |"
                continue
            t = f"{fmt_time(d['median_s'])} [{fmt_time(d['min_s'])}-{fmt_time(d['max_s'])}]" + \
                ("" if d["correct"] else "!")
            row += f" {t:>27} {_bw(d['algbw']):>7} {_bw(d['busbw']):>7} |"
        r = c.get("rumor_over_torch")
        row += f" {f'{r:.2f}x' if r else '-':>11} |"
        if stream:
            r = c.get("stream_over_torch")
            row += f" {f'{r:.2f}x' if r else '-':>12} |"
        if backend:
            r = c.get("backend_over_torch")
            row += f" {f'{r:.2f}x' if r else '-':>13} |"
        b = c.get("bound")
        if n == 1:
            cp = c["variants"].get("copy")
            rb = c.get("rumor_over_bound")
            row += (f" {fmt_time(cp['median_s']) if cp else '-':>15} {_bw(cp['algbw']) if cp else '-':>7} "
                    f"{f'{rb:.2f}' if rb else '-':>10}")
        elif b:
            row += (f" {_bw(b['algbw']):>12} {100 * c['rumor_over_bound']:>11.0f}% {_bw(b['piped_algbw']):>7} "
                    f"{100 * c['rumor_over_piped']:>10.0f}%" if "rumor_over_bound" in c else
                    f" {_bw(b['algbw']):>12} {'-':>12} {_bw(b['piped_algbw']):>7} {'-':>11}")
        print(row)
    if any(not d["correct"] for c in cells for d in c["variants"].values()):
        print("  ! = the first op's result differed from the exact sum (see JSON 'variants.*.wrong')")
    errs = {}
    for c in cells:
        errs.update(c["errors"])
    for v, msg in errs.items():
        print(_wrap(f"{LABEL.get(v, v)} raised: {msg}"))
    if n == 1:
        print(_wrap("bound: a device-to-device copy of the same size (torch copy_), timed alongside: what a "
                    "one-rank out-of-place allreduce moves, one kernel launch at small sizes. In place NCCL "
                    "need move nothing, so rumor/copy may exceed 1: at n = 1 this is per-call overhead."))
        if backend:
            print(_wrap(f"backend: torch.distributed.all_reduce on a group made with new_group(backend="
                        f"\"{BACKEND_SPELLING[1]}\"): the rumor group hands CUDA tensors to its own NCCL backend; "
                        "backend/torch = the cost of that hop next to torch's NCCL group."))
        if stream:
            print(_wrap("rumor stream: the same call under rumor.set_gpu_wait(\"stream\"): it returns once queued "
                        "(as torch's does) and a watch thread keeps the deadline; plain rumor (gpu_wait=host, the "
                        "default) waits on the host for each op's event."))
    else:
        if backend:
            print(_wrap(f"backend: torch.distributed.all_reduce on a group made with new_group(backend="
                        f"\"{BACKEND_SPELLING[2]}\"): the rumor group stages CUDA tensors through host memory "
                        "around its CPU allreduce; backend/torch = next to gloo, which stages them too."))
        b = job_bounds(job)
        if b:
            print(_wrap(f"bound: the staging both libraries do, with pinned H2D {b['h2d_bw'] / 1e9:.1f} GB/s, "
                        f"D2H {b['d2h_bw'] / 1e9:.1f} GB/s, 1-thread memcpy {b['memcpy_bw'] / 1e9:.1f} GB/s "
                        f"({fmt_size(BOUND_BYTES)}, rank 0, medians of start and end): staged = n*S/D2H + "
                        f"n*S/H2D + 2(n-1)/n*S/memcpy; piped = the largest term; columns are algbw S/time."))


def print_ddp(cells: List[Dict], job: Dict) -> None:
    if not cells:
        return
    n = cells[0]["n"]
    iters = max((len(d["step_s"]) for c in cells for d in c["variants"].values()), default=0)
    peer = f"torch DDP {job['setup']['backend']}"
    print(f"\n{job['label']}: training, n={n}   (step ms: median [min-max] of {iters} steps incl. synchronize, "
          f"slowest rank; samples/s = global batch / median step; loss = mean over ranks after the last step)")
    names = {"compute": "compute-only", "rumor": "rumor DDP", "torch": peer}
    head = f"{'model':<12} {'params':>7} {'batch x n':>9} |"
    for v in names.values():
        head += f" {v + ' ms':>21} {'smp/s':>8} |"
    head += f" {'rumor/torch':>11} {'rumor/bound':>11} {'torch/bound':>11} | {'loss rumor':>10} {'loss torch':>10}"
    print(head)
    print("-" * len(head))
    for c in cells:
        row = f"{c['model']:<12} {c['params'] / 1e6:>6.1f}M {str(c['batch']) + 'x' + str(n):>9} |"
        for v in names:
            d = c["variants"].get(v)
            if d is None:
                row += f" {'error' if v in c['errors'] else '-':>21} {'-':>8} |"
                continue
            ms = lambda s: f"{s * 1e3:.1f}" if s < 0.1 else f"{s * 1e3:.0f}"
            t = f"{ms(d['median_s'])} [{ms(d['min_s'])}-{ms(d['max_s'])}]"
            row += f" {t:>21} {d['samples_per_s']:>8.1f} |"
        v = c["variants"]
        r = c.get("rumor_over_torch")
        oc = lambda k: f"{100 * v[k]['over_compute']:.0f}%" if k in v and "over_compute" in v[k] else "-"
        loss = lambda k: f"{v[k]['final_loss']:.4f}" if k in v and v[k]["final_loss"] is not None else "-"
        row += f" {f'{r:.2f}x' if r else '-':>11} {oc('rumor'):>11} {oc('torch'):>11} | {loss('rumor'):>10} " \
               f"{loss('torch'):>10}"
        print(row)
    for c in cells:
        for v, msg in c["errors"].items():
            print(_wrap(f"{c['model']}: {names.get(v, v)} raised: {msg}"))
    print(_wrap("bound: the compute-only step (the same model without a wrapper; with several ranks all of them "
                "compute at once on the one GPU)."))


def plot(path: str, cells: List[Dict], jobs: List[Dict]) -> Optional[str]:
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    ar = [c for c in cells if c["part"] == "allreduce"]
    ddp = [c for c in cells if c["part"] == "ddp"]
    panels = [p for p, cs in (("allreduce", ar), ("ddp", ddp)) if cs]
    if not panels:
        return "no plot (no results)"
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.8), squeeze=False)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for ax, panel in zip(axes[0], panels):
        if panel == "allreduce":
            for j, job in enumerate(jobs):
                cs = sorted((c for c in ar if c["job"] == job["label"]), key=lambda c: c["size"])
                if not cs:
                    continue
                col = colors[j % len(colors)]
                for v, style in (("rumor", "-"), ("rumor-stream", "-."), ("torch", "--"), ("backend", ":")):
                    pts = [(c["size"], c["variants"][v]) for c in cs if v in c["variants"]]
                    if not pts:
                        continue
                    xs = [s for s, _ in pts]
                    name = "torch " + job["setup"]["backend"] if v == "torch" else LABEL[v]
                    ax.plot(xs, [d["algbw"] / 1e9 for _, d in pts], style, color=col, marker="o", ms=3,
                            label=f"{name} (n={job['n']})")
                    ax.fill_between(xs, [d["algbw_min"] / 1e9 for _, d in pts],
                                    [d["algbw_max"] / 1e9 for _, d in pts], color=col, alpha=0.12)
                bpts = [(c["size"], c["bound"]["algbw"]) for c in cs if "bound" in c]
                if bpts:
                    kind = "D2D copy" if job["n"] == 1 else "staged bound"
                    ax.plot([s for s, _ in bpts], [b / 1e9 for _, b in bpts], ":", color=col, lw=1.2,
                            label=f"{kind} (n={job['n']})")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("allreduce size (bytes, float32)")
            ax.set_ylabel("algbw (GB/s), band = min-max")
            ax.set_title("allreduce on one GPU (busbw = algbw*2(n-1)/n for n=2)", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        else:
            groups = [(job, c) for job in jobs for c in ddp if c["job"] == job["label"]]
            width = 0.38
            for k, (v, col) in enumerate((("rumor", "#1f77b4"), ("torch", "#ff7f0e"))):
                xs, ys, lo, hi = [], [], [], []
                for i, (_, c) in enumerate(groups):
                    d, comp = c["variants"].get(v), c["variants"].get("compute")
                    x = i + (k - 0.5) * width
                    if d is None or comp is None:
                        ax.text(x, 0.02, "error" if v in c["errors"] else "n/a", rotation=90, ha="center",
                                va="bottom", fontsize=7, color="red")
                        continue
                    y = d["samples_per_s"] / comp["samples_per_s"]
                    xs.append(x)
                    ys.append(y)
                    lo.append(y - d["samples_per_s_min"] / comp["samples_per_s"])
                    hi.append(d["samples_per_s_max"] / comp["samples_per_s"] - y)
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=col,
                       label="rumor DDP" if v == "rumor" else "torch DDP")
            ax.axhline(1.0, color="k", lw=1, ls=":", label="compute-only (bound)")
            ax.set_xticks(range(len(groups)))
            ax.set_xticklabels([f"{c['model']}\nn={c['n']}" for _, c in groups], fontsize=8)
            ax.set_ylabel("samples/s relative to compute-only")
            ax.set_title("DDP training on one GPU", fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=7)
    gpu = next((j["info"][0].get("gpu") for j in jobs if j.get("info")), None)
    fig.suptitle(f"rumor vs torch.distributed on one GPU ({gpu or 'no GPU: dry run'})", fontsize=10)
    _common.save_figure(plt, fig, path)
    return None


def _ratio(cell: Dict) -> str:
    r = cell.get("rumor_over_torch")
    if r:
        return f"{r:.2f}x"
    return "n/a (" + " and ".join(f"{v} raised" for v in cell["errors"]) + ")" if cell["errors"] else "n/a"


def headline(cells: List[Dict]) -> Optional[str]:
    """One line: rumor/torch for allreduce 64 MiB (or the largest size) at each world size, and DDP
    mlp25m (or the first model) at one rank (else the first world size with DDP figures)."""
    parts = []
    ar = [c for c in cells if c["part"] == "allreduce"]
    for n in sorted({c["n"] for c in ar}):
        cs = [c for c in ar if c["n"] == n]
        c = next((c for c in cs if c["size"] == 64 * MiB), max(cs, key=lambda c: c["size"]))
        what = "NCCL" if n == 1 else "host-staged vs gloo"
        bw = "algbw" if n == 1 else "busbw"  # the same ratio (of times); busbw is undefined for n = 1
        st = c.get("stream_over_torch")
        parts.append(f"allreduce {fmt_size(c['size'])} n={n} {what} {bw} {_ratio(c)}"
                     + (f" (gpu_wait=stream {st:.2f}x)" if st else ""))
    ddp = [c for c in cells if c["part"] == "ddp"]
    if ddp:
        ns = sorted({c["n"] for c in ddp})
        cs = [c for c in ddp if c["n"] == ns[0]]
        c = next((c for c in cs if c["model"] == "mlp25m"), cs[0])
        parts.append(f"DDP {c['model']} n={c['n']} samples/s {_ratio(c)}")
    if not parts:
        return None
    return "headline: rumor/torch on one GPU: " + "; ".join(parts)


def no_gpu(args) -> Optional[int]:
    """The exit status where no CUDA device is visible (0, or 1 when one is required), else None."""
    import torch

    if torch.cuda.is_available():
        return None
    required = args.require_gpu or os.environ.get("RUMOR_EXPECT_GPU") == "1"
    why = "--require-gpu" if args.require_gpu else "RUMOR_EXPECT_GPU=1"
    print(f"gpu.py: no CUDA device is visible (torch {torch.__version__}, built with CUDA "
          f"{torch.version.cuda or 'none'}); nothing measured, no results written"
          + (f"; FAILED: {why} requires a GPU" if required else ""))
    return 1 if required else 0


def run_benchmark(args, device: str = "cuda") -> int:
    """The whole run: jobs, tables, JSON, plot, headline. device "cpu" runs the same code on CPU
    tensors (only to exercise it where there is no GPU: its figures are not the benchmark)."""
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    png = os.path.splitext(out)[0] + ".png"
    meta = _common.run_meta(args)
    meta.update(device=device, parts=args.parts, worlds=args.worlds, sizes=args.sizes, models=args.models,
                sample="allreduce: wall clock of `reps` back-to-back ops between synchronizes (after a gloo "
                       "barrier with n > 1) / reps, the slowest rank's; ddp: one step incl. synchronize",
                setups={n: setup(n, device) for n in args.worlds})
    result = dict(meta=meta, jobs=[], cells=[], errors=[])
    print(f"rumor {meta['rumor']} vs torch {meta['torch']} on one GPU | {meta['hostname']}, {meta['cpus']} cpus | "
          f"parts {','.join(args.parts)} | worlds {','.join(map(str, args.worlds))} | sizes {fmt_size(args.sizes[0])}.."
          f"{fmt_size(args.sizes[-1])} ({len(args.sizes)}) | models {','.join(args.models)} | iters {args.iters}, "
          f"ddp iters {args.ddp_iters}")

    units = (len(args.sizes) if "allreduce" in args.parts else 0) + (len(args.models) if "ddp" in args.parts else 0)
    progress = Progress(len(args.worlds) * units, unit="cells", quiet_s=10)
    drv = _common.Driver("rumor-gpu-bench-", progress, hosts_mode=False)

    def body() -> int:
        jobs = [Job(args, n, drv.workdir, progress, k * units, device) for k, n in enumerate(args.worlds)]
        rc = run_jobs(jobs, result, progress, args.time_limit)
        progress.clear()
        bounds = {j["label"]: job_bounds(j) for j in result["jobs"]}
        for c in result["cells"]:
            summarize(c, bounds.get(c["job"]))
        _common.finish_meta(meta)
        gpu = next((j["info"][0].get("gpu") for j in result["jobs"] if j.get("info")), None)
        if gpu:
            i0 = next(j["info"][0] for j in result["jobs"] if j.get("info"))
            print(f"GPU: {gpu} (compute {i0.get('capability')}, {i0.get('gpu_memory_gib')} GiB); torch CUDA "
                  f"{i0.get('torch_cuda')}, torch NCCL {i0.get('torch_nccl')}; rumor NCCL {i0.get('rumor_nccl')}")
        for j in result["jobs"]:
            cs = [c for c in result["cells"] if c["job"] == j["label"]]
            print_allreduce(sorted((c for c in cs if c["part"] == "allreduce"), key=lambda c: c["size"]), j)
            print_ddp([c for c in cs if c["part"] == "ddp"], j)
        result["variant_errors"] = [dict(job=c["job"], part=c["part"], what=c.get("model") or c.get("size"),
                                         variant=v, error=e) for c in result["cells"] for v, e in c["errors"].items()]
        wrong = [(c["job"], fmt_size(c["size"]), v) for c in result["cells"] if c["part"] == "allreduce"
                 for v, d in c["variants"].items() if not d["correct"]]
        print()
        if wrong:
            print("WRONG RESULTS: " + "; ".join(f"{v} {s} ({j})" for j, s, v in wrong))
            rc = rc or 1
        if result["variant_errors"]:
            seen = {(e["job"], e["variant"], e["part"]) for e in result["variant_errors"]}
            print(f"{len(seen)} variant(s) raised and were left out (see the tables and JSON 'variant_errors')")
        draw = None if args.no_plot else (lambda: plot(png, result["cells"], result["jobs"]))
        _common.write_results(result, headline(result["cells"]), "headline: n/a (the run produced no figures)",
                              out, png, draw)
        return rc

    return drv.run(body)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="rumor vs torch.distributed on one GPU (see the module docstring)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=os.path.normpath(DEFAULT_OUT), help="JSON path; the PNG goes next to it")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: sizes 4KiB,1MiB,16MiB, 1 warm-up op, 3 warm-up and 10 measured steps")
    ap.add_argument("--require-gpu", action="store_true",
                    help="exit 1 when no CUDA device is visible (also with env RUMOR_EXPECT_GPU=1)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    ap.add_argument("--worlds", default="1,2", help="world sizes: 1 (NCCL) and/or 2 (two ranks sharing the GPU)")
    ap.add_argument("--min-size", type=parse_size, default=4 * KiB)
    ap.add_argument("--max-size", type=parse_size, default=256 * MiB)
    ap.add_argument("--factor", type=int, default=4, help="ratio between consecutive sizes")
    ap.add_argument("--sizes", default=None, help="explicit comma list of sizes (overrides min/max/factor)")
    ap.add_argument("--iters", type=int, default=10, help="allreduce: samples per library (protocol: >= 10)")
    ap.add_argument("--warmup", type=int, default=2, help="allreduce: warm-up ops per library and size")
    ap.add_argument("--target-ms", type=float, default=5.0,
                    help="allreduce: run several ops per sample so that it lasts at least this long")
    ap.add_argument("--max-reps", type=int, default=64, help="allreduce: at most this many ops per sample")
    ap.add_argument("--models", default=",".join(MODELS), help=f"ddp: comma list of {MODELS}")
    ap.add_argument("--batch", default="", help="ddp: per-rank batch overrides, e.g. mlp25m=16,cnn=8")
    ap.add_argument("--ddp-iters", type=int, default=20, help="ddp: measured steps per variant (protocol: >= 10)")
    ap.add_argument("--ddp-warmup", type=int, default=5, help="ddp: unmeasured steps per variant first")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rumor-timeout", type=float, default=60.0, help="rumor.init(timeout); gloo/NCCL get twice it")
    ap.add_argument("--job-timeout", type=float, default=240.0, help="deadline of each job (seconds)")
    ap.add_argument("--time-limit", type=float, default=420.0,
                    help="the whole run: a job gets at most what is left of it, and none starts with < 30 s left")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return ap, args

    if args.quick:
        args.sizes = args.sizes or "4KiB,1MiB,16MiB"
        args.warmup, args.ddp_warmup, args.ddp_iters = 1, 3, 10
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not args.parts or any(p not in PARTS for p in args.parts):
        ap.error(f"--parts: choose from {PARTS}")
    args.worlds = [int(x) for x in args.worlds.split(",") if x.strip()]
    if not args.worlds or any(n not in (1, 2) for n in args.worlds):
        ap.error("--worlds: 1 and/or 2 (one GPU: NCCL for one rank, host staging for two)")
    if args.sizes:
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    else:
        if args.factor < 2:
            ap.error("--factor must be >= 2")
        args.sizes, s = [], args.min_size
        while s <= args.max_size:
            args.sizes.append(s)
            s *= args.factor
    if not args.sizes or any(s <= 0 or s % 4 for s in args.sizes):
        ap.error("sizes must be positive multiples of 4 bytes (float32)")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if "ddp" in args.parts and (not args.models or any(m not in MODELS for m in args.models)):
        ap.error(f"--models: choose from {MODELS}")
    args.batch_map = {}
    for kv in filter(None, args.batch.split(",")):
        k, _, v = kv.partition("=")
        args.batch_map[k.strip()] = int(v)
    if args.warmup < 1 or args.ddp_warmup < 1:
        ap.error("--warmup and --ddp-warmup must be >= 1 (the first warm-up op is also the correctness check)")
    if args.iters < 10 or args.ddp_iters < 10:
        print("WARNING: fewer than the protocol's 10 measured samples: smoke test only", file=sys.stderr)
    return ap, args


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    rc = no_gpu(args)
    if rc is not None:
        return rc
    return run_benchmark(args, "cuda")


if __name__ == "__main__":
    sys.exit(main())
