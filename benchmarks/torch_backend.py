#!/usr/bin/env python
"""torch.distributed on backend "rumor" vs "gloo" vs rumor's own API (issue 43's benchmarks).

Needs: the installed rumor package, torch, tqdm, and for the plot `pip install matplotlib`.

Parts (--parts, default both)
  collectives  allreduce, all_gather_into_tensor and reduce_scatter_tensor of fp32, 4 KiB ..
      64 MiB, three ways in the same processes on the same data:
        backend  torch.distributed call on a group made with new_group(backend="rumor")
        gloo     the same call on the gloo default group
        api      rumor's own API: rumor.allreduce_(x), rumor.allgather(x, out=),
                 rumor.reduce_scatter(x, out=) (after rumor.init())
      Printed per size: time and busbw of each, backend/api and backend/gloo busbw ratios.
      Sizes are the full buffer (allreduce input, allgather output, reduce_scatter input);
      busbw = size/time * 2(n-1)/n for allreduce, * (n-1)/n for the other two. Each cell is
      checked once against exact expected values (benchmarks/collectives.py's inputs). A sample
      is `reps` back-to-back ops after a gloo barrier and one untimed op of the variant.
  training  one torch script per model (rumor.testing.models: mlp25m [32 per rank], transformer
      [16 per rank]); variants differ only in the process group the wrapper is handed:
        compute     the plain model, no communication (the ceiling: every rank computes at once,
                    so they share the cores as in the other variants)
        floor       (one host) compute-only plus torch DDP's memory traffic with a perfect
                    allreduce, each rank in its own thread: _common.DDPFloor
        ddp_rumor   torch.nn.parallel.DistributedDataParallel(model, process_group=<rumor group>)
        ddp_gloo    the same on the gloo group
        ddp_api     rumor.DistributedDataParallel(model) (rumor's own engine, GradientAllReduce, its
                    defaults): what the backend's door costs against the engine behind it
        fsdp_rumor  FSDP2 fully_shard (per layer, then the model) on DeviceMesh.from_group(<rumor group>)
        fsdp_gloo   the same on the gloo group            (FSDP only for --fsdp-models)
      A step is zero_grad, forward, cross-entropy, backward, SGD(momentum 0.9) on the same
      synthetic batches for every variant; after --warmup steps per variant, --iters steps per
      variant in blocks of --block, rotating which variant goes first. Each step starts after a
      gloo barrier; its time is the slowest rank's. samples/s = global batch / median step.
      ceiling = ddp_gloo's step / compute-only's step: the most ddp_rumor/ddp_gloo this run allowed.
      DDP bound (one host): no DDP step is shorter than compute-only's plus the allreduce of the
      gradients ready last that runs past backward's end even at the memory bound (n*S/C per
      allreduce of S bytes, C the all-core copy rate measured before and after the jobs; each
      gradient's ready time from hooks on compute-only's steps): _common.exposed_allreduce_s.
      That bound lets the allreduce run on idle cores; with more ranks than cores none are idle,
      and the floor variant measures instead what the copies DDP needs cost those cores.
      The losses of ddp_rumor and ddp_gloo (and fsdp_*) are compared as a sanity check.

  lightning  Lightning's Trainer (pip install 'rumor[lightning]') on the same models (--lightning-models,
      default mlp25m) and batches, joining the groups every rank already has:
        compute     the plain loop of the training part, no Lightning, no communication (the ceiling)
        lt_rumor    Trainer(strategy=rumor.lightning.RumorStrategy("bytegrad"))
        lt_gloo     Trainer(strategy=DDPStrategy(process_group_backend="gloo"))
      --warmup + --train-iters steps each, every step after a gloo barrier, timed from batch start
      to batch end (optimizer step included). ceiling = lt_gloo's step / compute's step.

Modes
  one host (default): --ranks ranks (default 4) on this machine.
  --hosts H: H emulated hosts (network namespaces, tbf --rate per link; needs root).

Every rank calls rumor.init() (for the api variant) and init_process_group("gloo"), then makes the
rumor-backend group with new_group(backend="rumor"): all three run in the same processes.

  python benchmarks/torch_backend.py                          # one host, 4 ranks, both parts
  python benchmarks/torch_backend.py --parts collectives --max-size 16MiB
  sudo python benchmarks/torch_backend.py --hosts 4 --parts collectives
  sudo python benchmarks/torch_backend.py --hosts 4 --parts training,lightning --fsdp-models ''

Output: tables, the issue's targets (MET / NOT MET), JSON and a PNG in --out; the last line is
the headline.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import _common
import collectives as C
from _common import Progress, emit, parse_rate

OPS = ("allreduce", "allgather", "reduce_scatter")
OP_CALL = {"allreduce": "all_reduce", "allgather": "all_gather_into_tensor",
           "reduce_scatter": "reduce_scatter_tensor"}
KiB, MiB = C.KiB, C.MiB
MODELS = ("mlp25m", "transformer")
LIGHTNING_LABEL = {"compute": "compute-only", "lt_rumor": "L rumor ByteGrad", "lt_gloo": "L DDP gloo"}
TRAIN_LABEL = {"compute": "compute-only", "floor": "DDP floor", "ddp_rumor": "DDP rumor", "ddp_gloo": "DDP gloo",
               "ddp_api": "rumor.DDP", "fsdp_rumor": "FSDP2 rumor", "fsdp_gloo": "FSDP2 gloo"}


# ==== inside a rank ==================================================================================

def _describe(rank: int, n: int) -> Dict:
    import torch

    import rumor

    return dict(rank=rank, size=n, local_size=rumor.local_size(), machine_size=rumor.machine_size(),
                torch_threads=torch.get_num_threads(), netns=os.readlink("/proc/self/ns/net"))


def _body(cfg: Dict, rank: int, n: int) -> None:
    import torch.distributed as dist

    rgroup = dist.new_group(backend="rumor", timeout=datetime.timedelta(seconds=cfg["rumor_timeout"]))
    groups = {"rumor": rgroup, "gloo": dist.group.WORLD}
    if "collectives" in cfg["parts"]:
        k = 0
        for op in cfg["ops"]:
            for size in cfg["sizes"]:
                _cell(cfg, groups, op, size, k, rank, n)
                k += 1
    if "training" in cfg["parts"]:
        for name in cfg["models"]:
            _train(cfg, groups, name, rank, n)
    if "lightning" in cfg["parts"]:
        for name in cfg["lightning_models"]:
            _lightning(cfg, name, rank, n)


def _cell(cfg: Dict, groups: Dict, op: str, size: int, index: int, rank: int, n: int) -> None:
    import torch
    import torch.distributed as dist

    import rumor

    SUM = rumor.ReduceOp.SUM
    numel = size // 4
    per = numel // n
    salt = index % 5
    rg, gg = groups["rumor"], groups["gloo"]
    if op == "allreduce":
        tmpl = C._template(numel, rank, salt)
        bufs = {v: tmpl.clone() for v in ("backend", "gloo", "api")}
        fns = {"backend": lambda: dist.all_reduce(bufs["backend"], group=rg),
               "gloo": lambda: dist.all_reduce(bufs["gloo"], group=gg),
               "api": lambda: rumor.allreduce_(bufs["api"], op=SUM)}
        results = {v: (lambda v=v: bufs[v]) for v in bufs}
        refill = lambda v: bufs[v].copy_(tmpl)
    elif op == "allgather":
        tmpl = C._template(per, rank, salt)
        outs = {v: torch.empty(numel, dtype=torch.float32) for v in ("backend", "gloo", "api")}
        fns = {"backend": lambda: dist.all_gather_into_tensor(outs["backend"], tmpl, group=rg),
               "gloo": lambda: dist.all_gather_into_tensor(outs["gloo"], tmpl, group=gg),
               "api": lambda: rumor.allgather(tmpl, out=outs["api"])}
        results = {v: (lambda v=v: outs[v]) for v in outs}
        refill = lambda v: None
    else:
        tmpl = C._template(numel, rank, salt)
        ins = {v: tmpl.clone() for v in ("backend", "gloo")}
        outs = {v: torch.empty(per, dtype=torch.float32) for v in ("backend", "gloo", "api")}
        fns = {"backend": lambda: dist.reduce_scatter_tensor(outs["backend"], ins["backend"], group=rg),
               "gloo": lambda: dist.reduce_scatter_tensor(outs["gloo"], ins["gloo"], group=gg),
               "api": lambda: rumor.reduce_scatter(tmpl, op=SUM, out=outs["api"])}
        results = {v: (lambda v=v: outs[v]) for v in outs}
        # gloo may use its input as scratch; refilled before every sample, as for the backend
        refill = lambda v: ins[v].copy_(tmpl) if v in ins else None
    variants = list(fns)

    expected = C._expected(op, numel, n, rank, salt, per)
    correct, warm = {}, {v: [] for v in variants}
    for w in range(cfg["warmup"]):
        for v in variants:
            refill(v)
            dist.barrier()
            t0 = time.perf_counter()
            fns[v]()
            warm[v].append(time.perf_counter() - t0)
            if w == 0:
                got = results[v]()
                correct[v] = True if (got.shape == expected.shape and torch.equal(got, expected)) else \
                    f"rank {rank}: {v} {op} {size} B differs from the exact result"
    del expected
    # reps: the same on every rank and for every variant, so that a sample lasts >= target
    fastest = min(min(warm[v]) for v in variants)
    t = torch.tensor([fastest], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    max_reps = max(1, min(cfg["max_reps"], int(180 / math.log2(max(n, 2)))))
    reps = max(1, min(max_reps, math.ceil(cfg["target_s"] / max(float(t), 1e-7))))
    samples = {v: [] for v in variants}
    for i in range(cfg["iters"]):
        k = i % len(variants)
        for v in variants[k:] + variants[:k]:  # rotate who goes first
            refill(v)
            dist.barrier()
            fns[v]()  # untimed: the ranks leave gloo's barrier apart, as in collectives.py
            t0 = time.perf_counter()
            for _ in range(reps):
                fns[v]()
            samples[v].append((time.perf_counter() - t0) / reps)
    per_rank = _common.gather_samples(samples)  # a sample's time is the slowest rank's
    oks = [None] * n
    dist.all_gather_object(oks, correct)
    if rank == 0:
        cell = dict(part="collectives", op=op, size=size, n=n, reps=reps, warmup_s=warm, variants={})
        for v in variants:
            errs = [o[v] for o in oks if o.get(v) is not True]
            cell["variants"][v] = dict(samples_s=[max(per_rank[v][r][i] for r in range(n))
                                                  for i in range(cfg["iters"])],
                                       per_rank_samples_s=per_rank[v], correct=not errs, errors=errs[:4])
        emit("cell", cell)


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    # per layer, then the root: each layer's gathers and reduce-scatters are their own messages,
    # as in FSDP2's usual recipe
    layers = [m for m in model.modules() if type(m).__name__ in ("Linear", "TransformerEncoderLayer")]
    if hasattr(model, "encoder"):  # transformer: shard whole encoder layers, not their Linears
        layers = list(model.encoder.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class _BucketProfile:
    """Where a torch DDP step on the rumor group spends its time, per bucket: when the Reducer
    handed the bucket to the group (the allreduce call and its return) and when the group set
    the bucket's future (which the Reducer waits for at the end of backward), in ms from the
    step's start. Measured on ddp_rumor's steps only, by wrapping two methods of the backend in
    this process (two clock reads per bucket)."""

    def __init__(self):
        from rumor import torch_backend as tb

        self.tb, self.steps, self.cur, self.t0 = tb, [], None, 0.0
        self.saved = (tb.RumorProcessGroup.allreduce, tb.RumorWork._settle_future)
        allreduce, settle = self.saved
        prof = self

        def timed_allreduce(pg, tensors, opts=None):
            a = prof.now()
            w = allreduce(pg, tensors, opts)
            if prof.cur is not None:
                w._bench_bucket = [tensors[0].numel() * tensors[0].element_size(), a, prof.now(), None]
                prof.cur["buckets"].append(w._bench_bucket)
            return w

        def timed_settle(w):
            settle(w)
            b = getattr(w, "_bench_bucket", None)
            if b is not None:
                b[3] = prof.now()

        tb.RumorProcessGroup.allreduce, tb.RumorWork._settle_future = timed_allreduce, timed_settle

    def now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def begin(self, on: bool) -> None:
        self.t0 = time.perf_counter()
        self.cur = {"buckets": [], "t0": self.t0} if on else None

    def mark(self, what: str) -> None:
        if self.cur is not None:
            self.cur[what] = self.now()

    def end(self) -> None:
        if self.cur is not None:
            self.cur["step"] = self.now()
            self.steps.append(self.cur)
            self.cur = None

    def stop(self) -> None:
        self.tb.RumorProcessGroup.allreduce, self.tb.RumorWork._settle_future = self.saved


def bucket_summary(steps: List[Dict], ranks: Optional[List[List[Dict]]] = None) -> Optional[Dict]:
    """Medians over the measured steps of rank 0's bucket timings (ms); with every rank's steps
    (ranks[r], the same steps in the same order), also when the last rank handed its last bucket
    over: no future can be set before that (the clock is the host's, shared by its processes)."""
    done = lambda s: s["buckets"] and all(b[3] is not None for b in s["buckets"])  # noqa: E731
    keep = [i for i, s in enumerate(steps) if done(s)]
    if not keep:
        return None
    med = lambda f: statistics.median(f(steps[i]) for i in keep)  # noqa: E731
    out = dict(buckets=len(steps[keep[0]]["buckets"]), mib=[b[0] / MiB for b in steps[keep[0]]["buckets"]],
               backward=med(lambda s: s["backward_end"] - s["backward"]),
               issue_calls=med(lambda s: sum(b[2] - b[1] for b in s["buckets"])),
               last_ready=med(lambda s: s["buckets"][-1][1] - s["backward"]),
               last_ready_to_settled=med(lambda s: max(b[3] for b in s["buckets"]) - s["buckets"][-1][1]),
               settled_to_backward_end=med(lambda s: s["backward_end"] - max(b[3] for b in s["buckets"])))
    if ranks and all(len(r) == len(steps) and all(r[i]["buckets"] for i in keep) for r in ranks):
        # absolute ms: a step's t0 (s) plus a time in it (ms from t0)
        handed = [[r[i]["t0"] * 1e3 + r[i]["buckets"][-1][1] for r in ranks] for i in keep]
        settled = [steps[i]["t0"] * 1e3 + max(b[3] for b in steps[i]["buckets"]) for i in keep]
        out["last_rank_handed_to_settled"] = statistics.median(s - max(h) for s, h in zip(settled, handed))
        out["handover_spread"] = statistics.median(max(h) - min(h) for h in handed)
    return out


def _train(cfg: Dict, groups: Dict, name: str, rank: int, n: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from rumor.testing import models

    batch = models.BATCH[name]
    names = ["compute"] + (["floor"] if cfg["floor"] else []) + ["ddp_rumor", "ddp_gloo", "ddp_api"]
    if name in cfg["fsdp_models"]:
        names += ["fsdp_rumor", "fsdp_gloo"]
    variants = {}
    for v in names:
        model = models.build(name, seed=cfg["seed"])
        if v == "floor":
            floor = _common.DDPFloor(model)
        elif v == "ddp_api":
            import rumor

            model = rumor.DistributedDataParallel(model)
        elif v.startswith("ddp_"):
            model = TorchDDP(model, process_group=groups[v[4:]])
        elif v.startswith("fsdp_"):
            from torch.distributed.device_mesh import DeviceMesh

            model = _shard(model, DeviceMesh.from_group(groups[v[5:]], "cpu"))
        variants[v] = (model, torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9))
    nparams = sum(p.numel() for p in variants["compute"][0].parameters())
    data = [models.batch(name, batch, step=i, shard=rank, seed=cfg["seed"]) for i in range(4)]
    prof = _BucketProfile()
    ready = _common.GradReady(variants["compute"][0])

    def step(v, i):
        model, opt = variants[v]
        x, y = data[i % len(data)]
        prof.begin(v == "ddp_rumor")
        opt.zero_grad()
        loss = models.loss(model(x), y)
        prof.mark("backward")
        ready.begin(v == "compute")
        loss.backward()
        if v == "floor":
            floor.finish()
        ready.end()
        prof.mark("backward_end")
        opt.step()
        prof.end()
        return float(loss.detach())

    counts = {v: 0 for v in names}
    times, losses, warm = ({v: [] for v in names} for _ in range(3))
    total, done = len(names) * (cfg["warmup"] + cfg["train_iters"]), 0
    for v in names:
        for _ in range(cfg["warmup"]):
            dist.barrier()
            t0 = time.perf_counter()
            losses[v].append(step(v, counts[v]))
            warm[v].append(time.perf_counter() - t0)
            counts[v] += 1
            done += 1
        if rank == 0:
            emit("progress", {"model": name, "done": done, "total": total, "what": f"warm-up {v}"})
    blocks = -(-cfg["train_iters"] // cfg["block"])
    for b in range(blocks):
        k = b % len(names)
        for v in names[k:] + names[:k]:
            for _ in range(min(cfg["block"], cfg["train_iters"] - b * cfg["block"])):
                dist.barrier()
                t0 = time.perf_counter()
                losses[v].append(step(v, counts[v]))
                times[v].append(time.perf_counter() - t0)
                counts[v] += 1
                done += 1
            if rank == 0:
                emit("progress", {"model": name, "done": done, "total": total,
                                   "what": f"{v} {times[v][-1] * 1e3:.0f} ms/step"})
    prof.stop()
    # every rank's bucket timings, for when the last rank handed its buckets over (bucket_summary)
    prof_ranks = [None] * n
    dist.all_gather_object(prof_ranks, prof.steps[cfg["warmup"]:])
    per_rank = _common.gather_samples(times)
    # every variant took the same steps on the same batches: their mean losses over ranks agree
    # up to float32 rounding if the groups computed the same reductions
    loss_t = {v: torch.tensor(losses[v], dtype=torch.float64) for v in names}
    for v in names:
        dist.all_reduce(loss_t[v])
    if rank == 0:
        cell = dict(part="training", model=name, n=n, batch=batch, global_batch=batch * n, params=nparams,
                    variants={})
        for v in names:
            cell["variants"][v] = dict(step_s=[max(per_rank[v][r][i] for r in range(n))
                                               for i in range(len(times[v]))],
                                       per_rank_step_s=per_rank[v], warmup_s=warm[v],
                                       loss=(loss_t[v] / n).tolist())
        cell["bucket_profile"] = prof.steps[cfg["warmup"]:]
        cell["bucket_profile_ranks"] = prof_ranks
        cell["grad_ready"] = ready.summary(cfg["warmup"])
        emit("cell", cell)
    del variants, data
    gc.collect()


def _lightning(cfg: Dict, name: str, rank: int, n: int) -> None:
    """Lightning's Trainer on the same model and batches: RumorStrategy(ByteGrad) against
    Lightning's DDPStrategy on gloo, beside the plain compute-only loop (the ceiling). The
    Trainer joins the groups worker_main made (torch.distributed's gloo group, rumor.init()):
    both strategies skip their own rendezvous when one exists."""
    import lightning as L
    import torch
    import torch.distributed as dist

    import rumor.lightning
    from rumor.testing import models

    batch = models.BATCH[name]
    steps = cfg["warmup"] + cfg["train_iters"]
    data = [models.batch(name, batch, step=i, shard=rank, seed=cfg["seed"]) for i in range(4)]
    # An outside launcher: Lightning's environment reads the node from NODE_RANK.
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", n))
    os.environ["NODE_RANK"] = str(rank // per_host)

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = models.build(name, seed=cfg["seed"])
            self.losses: List[float] = []

        def training_step(self, b, i):
            loss = models.loss(self.model(b[0]), b[1])
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=cfg["lr"], momentum=0.9)

    class Steps(L.Callback):
        """Each step after a gloo barrier (as in the training part), timed to its batch's end
        (the optimizer step included)."""

        def __init__(self):
            self.times: List[float] = []
            self.t0 = 0.0

        def on_train_batch_start(self, trainer, module, b, i):
            dist.barrier()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, out, b, i):
            self.times.append(time.perf_counter() - self.t0)

    def fit(strategy):
        net, steps_cb = Net(), Steps()
        loader = torch.utils.data.DataLoader([data[i % len(data)] for i in range(steps)], batch_size=None)
        trainer = L.Trainer(accelerator="cpu", devices=per_host, num_nodes=n // per_host, strategy=strategy,
                            max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                            use_distributed_sampler=False, callbacks=[steps_cb])
        trainer.fit(net, loader)
        return steps_cb.times, net.losses

    def compute():
        model = models.build(name, seed=cfg["seed"])
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        times, losses = [], []
        for i in range(steps):
            x, y = data[i % len(data)]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = models.loss(model(x), y)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
        return times, losses

    runs = {"compute": compute,
            "lt_rumor": lambda: fit(rumor.lightning.RumorStrategy("bytegrad")),
            "lt_gloo": lambda: fit(L.pytorch.strategies.DDPStrategy(process_group_backend="gloo"))}
    times, losses, warm = {}, {}, {}
    for v, run in runs.items():
        t, losses[v] = run()
        warm[v], times[v] = t[:cfg["warmup"]], t[cfg["warmup"]:]
        if rank == 0:
            emit("progress", {"model": name, "done": 0, "total": 0,
                              "what": f"lightning {v} {statistics.median(times[v]) * 1e3:.0f} ms/step"})
    per_rank = _common.gather_samples(times)
    loss_t = {v: torch.tensor(losses[v], dtype=torch.float64) for v in runs}
    for v in runs:
        dist.all_reduce(loss_t[v])
    if rank == 0:
        cell = dict(part="lightning", model=name, n=n, batch=batch, global_batch=batch * n,
                    params=sum(p.numel() for p in models.build(name, seed=cfg["seed"]).parameters()), variants={})
        for v in runs:
            cell["variants"][v] = dict(step_s=[max(per_rank[v][r][i] for r in range(n))
                                               for i in range(len(times[v]))],
                                       per_rank_step_s=per_rank[v], warmup_s=warm[v], loss=(loss_t[v] / n).tolist())
        emit("cell", cell)
    gc.collect()


# ==== the driver =====================================================================================

class Job(_common.Job):
    def __init__(self, args, n: int, workdir: str, progress: Progress, cluster=None):
        super().__init__(os.path.abspath(__file__), args, n, workdir, progress, 0, cluster)

    def config(self) -> Dict:
        a = self.args
        return dict(parts=a.parts, ops=a.ops, sizes=a.size_list, iters=a.iters, warmup=a.warmup,
                    target_s=a.target_ms / 1e3, max_reps=a.max_reps, models=a.models, fsdp_models=a.fsdp_models,
                    lightning_models=a.lightning_models,
                    train_iters=a.train_iters, block=a.block, lr=a.lr, seed=a.seed,
                    # one host only: the floor's allreduce is memory traffic, not a link's
                    floor=a.hosts == 0)

    def on_message(self, kind: str, data) -> None:
        if kind == "cell":
            what = (f"{data['op']} {C.fmt_size(data['size'])}" if data["part"] == "collectives"
                    else f"{data['model']} done")
            self.progress.update(len(self.cells), f"{self.label}: {what}", force=True)
        elif kind == "progress":
            self.progress.update(None, f"{self.label}: {data['model']} {data['what']}")


def summarize_coll(c: Dict) -> None:
    for v, d in c["variants"].items():
        s = d["samples_s"]
        d["median_s"], d["min_s"], d["max_s"] = statistics.median(s), min(s), max(s)
        d["algbw"] = c["size"] / d["median_s"]
        d["busbw"] = d["algbw"] * C.busbw_factor(c["op"], c["n"])
    b, g, a = (c["variants"][v] for v in ("backend", "gloo", "api"))
    c["backend_over_api_bw"] = a["median_s"] / b["median_s"]
    c["backend_over_gloo_bw"] = g["median_s"] / b["median_s"]


def _step_stats(c: Dict) -> Dict:
    """Each variant's median, min, max step and samples/s; returns the variants."""
    for v, d in c["variants"].items():
        d["median_s"] = statistics.median(d["step_s"])
        d["min_s"], d["max_s"] = min(d["step_s"]), max(d["step_s"])
        d["samples_per_s"] = c["global_batch"] / d["median_s"]
    return c["variants"]


def summarize_train(c: Dict, copy_rate: Optional[float] = None) -> None:
    V = _step_stats(c)
    c["ceiling"] = V["ddp_gloo"]["median_s"] / V["compute"]["median_s"]
    if copy_rate and c.get("grad_ready"):
        # The machine's ceiling for any DDP: compute-only's step plus the exposed allreduce at
        # the memory bound (_common.exposed_allreduce_s); "of bound" is DDP rumor's step against it.
        c["exposed_allreduce_s"] = _common.exposed_allreduce_s(c["grad_ready"], c["n"], copy_rate)
        c["bound_step_s"] = V["compute"]["median_s"] + c["exposed_allreduce_s"]
        c["bound_of_compute"] = V["compute"]["median_s"] / c["bound_step_s"]
        c["ddp_rumor_of_bound"] = c["bound_step_s"] / V["ddp_rumor"]["median_s"]
    if "floor" in V:
        # torch DDP's step with a perfect allreduce on these cores, measured (_common.DDPFloor)
        c["floor_of_compute"] = V["compute"]["median_s"] / V["floor"]["median_s"]
        c["ddp_rumor_of_floor"] = V["floor"]["median_s"] / V["ddp_rumor"]["median_s"]
        c["ddp_gloo_of_floor"] = V["floor"]["median_s"] / V["ddp_gloo"]["median_s"]
        c["floor_loss_diff"] = max(abs(a - b) for a, b in zip(V["floor"]["loss"], V["compute"]["loss"]))
    c["ddp_rumor_over_gloo"] = V["ddp_gloo"]["median_s"] / V["ddp_rumor"]["median_s"]
    c["ddp_rumor_of_ceiling"] = c["ddp_rumor_over_gloo"] / c["ceiling"]
    if "ddp_api" in V:
        c["ddp_rumor_over_api"] = V["ddp_api"]["median_s"] / V["ddp_rumor"]["median_s"]
    c["bucket_summary"] = bucket_summary(c.get("bucket_profile", []), c.get("bucket_profile_ranks"))
    c["loss_max_abs_diff"] = {"ddp": max(abs(a - b) for a, b in zip(V["ddp_rumor"]["loss"], V["ddp_gloo"]["loss"]))}
    if "ddp_api" in V:
        c["loss_max_abs_diff"]["rumor.DDP"] = max(abs(a - b) for a, b in zip(V["ddp_api"]["loss"],
                                                                              V["ddp_gloo"]["loss"]))
    if "fsdp_rumor" in V:
        c["fsdp_rumor_over_gloo"] = V["fsdp_gloo"]["median_s"] / V["fsdp_rumor"]["median_s"]
        c["fsdp_ceiling"] = V["fsdp_gloo"]["median_s"] / V["compute"]["median_s"]
        c["loss_max_abs_diff"]["fsdp"] = max(abs(a - b) for a, b in zip(V["fsdp_rumor"]["loss"],
                                                                         V["fsdp_gloo"]["loss"]))


def summarize_lightning(c: Dict) -> None:
    V = _step_stats(c)
    c["ceiling"] = V["lt_gloo"]["median_s"] / V["compute"]["median_s"]
    c["rumor_over_gloo"] = V["lt_gloo"]["median_s"] / V["lt_rumor"]["median_s"]
    c["rumor_of_ceiling"] = c["rumor_over_gloo"] / c["ceiling"]


def _step_table(cells: List[Dict], labels: Dict, names: List[str], width: int):
    """A step-time table's head and each cell's row (model, parameters, batch, then each variant's
    median [min-max] ms and samples/s, '-' where the cell has no such variant)."""
    head = f"{'model':<12} {'params':>7} {'batch':>6} |"
    for v in names:
        head += f" {labels[v] + ' ms':>{width}} {'smp/s':>6} |"
    rows = []
    for c in cells:
        row = f"{c['model']:<12} {c['params'] / 1e6:>6.1f}M {str(c['batch']) + 'x' + str(c['n']):>6} |"
        for v in names:
            d = c["variants"].get(v)
            if d is None:
                row += f" {'-':>{width}} {'-':>6} |"
                continue
            ms = f"{d['median_s'] * 1e3:.0f} [{d['min_s'] * 1e3:.0f}-{d['max_s'] * 1e3:.0f}]"
            row += f" {ms:>{width}} {d['samples_per_s']:>6.1f} |"
        rows.append(row)
    return head, rows


def print_lightning(cells: List[Dict], title: str, iters: int) -> None:
    print(f"\n{title}: Lightning Trainer   (step time: median [min-max] ms of {iters} steps, slowest rank, "
          f"batch start to batch end; samples/s = global batch / median step)")
    head, rows = _step_table(cells, LIGHTNING_LABEL, list(LIGHTNING_LABEL), 22)
    head += f" {'r/g':>6} {'ceiling':>7} {'of ceil':>7}"
    print(head)
    print("-" * len(head))
    for c, row in zip(cells, rows):
        print(row + f" {c['rumor_over_gloo']:>5.2f}x {c['ceiling']:>6.2f}x {100 * c['rumor_of_ceiling']:>6.0f}%")
    for c in cells:
        last = ", ".join(f"{LIGHTNING_LABEL[v]} {c['variants'][v]['loss'][-1]:.4f}" for v in LIGHTNING_LABEL)
        print(f"  {c['model']}: last step's loss, mean over ranks: {last} (ByteGrad quantizes gradients to 8 "
              "bits: close to, not equal to, DDP's)")
    print("  ceiling = Lightning DDP gloo's step / compute-only's step (a plain loop, no Lightning); "
          "of ceil = (r/g) / ceiling")


def print_coll(cells: List[Dict], title: str, iters: int) -> None:
    op, n = cells[0]["op"], cells[0]["n"]
    f = "2(n-1)/n" if op == "allreduce" else "(n-1)/n"
    print(f"\n{title}: {OP_CALL[op]}, n={n}   (busbw = size/time*{f}, GB/s = 1e9 B/s; "
          f"time = median [min-max] of {iters} samples, slowest rank)")
    head = f"{'size':>9} {'reps':>4} |"
    for v in ("backend", "gloo", "api"):
        head += f" {'rumor-' + v if v != 'gloo' else 'gloo':>14} {'time':>9} {'busbw':>7} |"
    head += f" {'backend/api':>11} {'backend/gloo':>12} {'t backend/gloo':>14}"
    print(head)
    print("-" * len(head))
    for c in cells:
        row = f"{C.fmt_size(c['size']):>9} {c['reps']:>4} |"
        for v in ("backend", "gloo", "api"):
            d = c["variants"][v]
            row += f" {'' if d['correct'] else 'WRONG':>14} {C.fmt_time(d['median_s']):>9} {C.fmt_bw(d['busbw']):>7} |"
        b, g = c["variants"]["backend"], c["variants"]["gloo"]
        row += (f" {c['backend_over_api_bw']:>10.2f}x {c['backend_over_gloo_bw']:>11.2f}x "
                f"{b['median_s'] / g['median_s']:>13.3f}x")
        print(row)


def print_train(cells: List[Dict], title: str, iters: int) -> None:
    print(f"\n{title}   (step time: median [min-max] ms of {iters} steps, slowest rank; "
          f"samples/s = global batch / median step)")
    names = [v for v in TRAIN_LABEL if any(v in c["variants"] for c in cells)]
    head, rows = _step_table(cells, TRAIN_LABEL, names, 20)
    head += f" {'DDP r/g':>7} {'ceiling':>7} {'of ceil':>7} {'DDP r/api':>9} {'FSDP r/g':>8}"
    print(head)
    print("-" * len(head))
    for c, row in zip(cells, rows):
        fs = f"{c['fsdp_rumor_over_gloo']:.2f}x" if "fsdp_rumor_over_gloo" in c else "-"
        api = f"{c['ddp_rumor_over_api']:.2f}x" if "ddp_rumor_over_api" in c else "-"
        row += (f" {c['ddp_rumor_over_gloo']:>6.2f}x {c['ceiling']:>6.2f}x "
                f"{100 * c['ddp_rumor_of_ceiling']:>6.0f}% {api:>9} {fs:>8}")
        print(row)
    for c in cells:
        diffs = ", ".join(f"{k} {v:.2e}" for k, v in c["loss_max_abs_diff"].items())
        print(f"  {c['model']}: max |loss(rumor) - loss(gloo)| over the steps, mean over ranks: {diffs}")
    print("  ceiling = DDP gloo's step / compute-only's step: the most DDP rumor/gloo this run allowed; "
          "of ceil = (DDP r/g) / ceiling; DDP r/api = rumor.DDP's step / DDP rumor's step (torch DDP on the "
          "backend against rumor's own DDP)")
    for c in cells:
        if "bound_step_s" in c:
            print(f"  {c['model']} DDP bound: compute-only's step + {c['exposed_allreduce_s'] * 1e3:.1f} ms of allreduce "
                  f"that no DDP can hide (the gradients ready last, at the memory bound) = "
                  f"{c['bound_step_s'] * 1e3:.0f} ms, {100 * c['bound_of_compute']:.0f}% of compute-only's samples/s; "
                  f"DDP rumor reaches {100 * c['ddp_rumor_of_bound']:.0f}% of that bound")
    for c in cells:
        if "floor_of_compute" in c:
            print(f"  {c['model']} DDP floor: compute-only plus, in each rank's own thread, torch DDP's two copies of "
                  f"every gradient (into its bucket, back into .grad) and the allreduce at the memory bound as one "
                  f"more copy, no rank waiting for another: {100 * c['floor_of_compute']:.0f}% of compute-only's "
                  f"samples/s (loss equal to compute-only's within {c['floor_loss_diff']:.1e}); DDP rumor reaches "
                  f"{100 * c['ddp_rumor_of_floor']:.0f}% of the floor, DDP gloo {100 * c['ddp_gloo_of_floor']:.0f}%")
    for c in cells:
        p = c.get("bucket_summary")
        if p:
            print(f"  {c['model']} DDP rumor, rank 0, median ms of the steps: backward {p['backward']:.0f}; "
                  f"{p['buckets']} buckets ({', '.join(f'{m:.1f}' for m in p['mib'])} MiB), allreduce calls "
                  f"{p['issue_calls']:.1f} in all; last bucket handed over {p['last_ready']:.0f} into backward, "
                  f"every future set {p['last_ready_to_settled']:.0f} after it, backward returned "
                  f"{p['settled_to_backward_end']:.0f} after that")
            if "last_rank_handed_to_settled" in p:
                print(f"  {c['model']} DDP rumor, all ranks: the last bucket's hand-over spread over "
                      f"{p['handover_spread']:.0f} ms between the first rank and the last; rank 0's last future "
                      f"was set {p['last_rank_handed_to_settled']:.0f} ms after the last rank's hand-over")


def plot(path: str, result: Dict) -> Optional[str]:
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    coll = [c for c in result["cells"] if c["part"] == "collectives"]
    train = [c for c in result["cells"] if c["part"] == "training"]
    light = [c for c in result["cells"] if c["part"] == "lightning"]
    ops = [o for o in OPS if any(c["op"] == o for c in coll)]
    ncol = len(ops) + (1 if train else 0) + (1 if light else 0)
    fig, axes = plt.subplots(1, max(1, ncol), figsize=(5.5 * max(1, ncol), 4.5), squeeze=False)
    styles = {"backend": ("-", "rumor backend"), "gloo": ("--", "gloo"), "api": (":", "rumor API")}
    for j, op in enumerate(ops):
        ax = axes[0][j]
        cs = sorted((c for c in coll if c["op"] == op), key=lambda c: c["size"])
        for v, (ls, lab) in styles.items():
            ax.plot([c["size"] for c in cs], [c["variants"][v]["busbw"] / 1e9 for c in cs], ls, marker="o", ms=3,
                    label=lab)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{OP_CALL[op]}, n={cs[0]['n']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for j, (cells, labels, title) in enumerate(x for x in ((train, TRAIN_LABEL, "training"),
                                                           (light, LIGHTNING_LABEL, "Lightning")) if x[0]):
        ax = axes[0][len(ops) + j]
        names = [v for v in labels if any(v in c["variants"] for c in cells)]
        w = 0.8 / len(names)
        for k, v in enumerate(names):
            xs = [i + k * w for i, c in enumerate(cells) if v in c["variants"]]
            ys = [c["variants"][v]["samples_per_s"] for c in cells if v in c["variants"]]
            ax.bar(xs, ys, w, label=labels[v])
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(cells))])
        ax.set_xticklabels([c["model"] for c in cells])
        ax.set_ylabel("samples/s")
        ax.set_title(f"{title}, n={cells[0]['n']}")
        ax.legend(fontsize=8)
    fig.suptitle(result["title"])
    _common.save_figure(plt, fig, path)
    return None


def _target(result: Dict, name: str, value: float, met: bool, shown: str) -> None:
    result["targets"].append(dict(name=name, value=value, met=met))
    print(f"target: {name}: {shown} -> {'MET' if met else 'NOT MET'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="torch.distributed on rumor vs gloo vs rumor's API (module docstring)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--hosts", type=int, default=0, help="0: one host; H>=2: H emulated hosts (root)")
    ap.add_argument("--ranks", type=int, default=4, help="one-host mode: ranks")
    ap.add_argument("--ranks-per-host", type=int, default=1, help="--hosts mode: ranks per emulated host")
    ap.add_argument("--rate", default="1gbit", help="--hosts mode: tbf rate of each host's link")
    ap.add_argument("--parts", default="collectives,training",
                    help="comma list of collectives,training,lightning (lightning: pip install 'rumor[lightning]')")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma list of {','.join(OPS)}")
    ap.add_argument("--min-size", type=C.parse_size, default=4 * KiB)
    ap.add_argument("--max-size", type=C.parse_size, default=64 * MiB)
    ap.add_argument("--factor", type=int, default=4, help="ratio between consecutive sizes")
    ap.add_argument("--iters", type=int, default=10, help="collectives: measured samples per variant")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up ops (collectives) / steps (training)")
    ap.add_argument("--target-ms", type=float, default=5.0, help="small sizes: ops per sample so it lasts this long")
    ap.add_argument("--max-reps", type=int, default=64)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {','.join(MODELS)}")
    ap.add_argument("--fsdp-models", default="mlp25m", help="models also run under FSDP2 fully_shard ('' for none)")
    ap.add_argument("--lightning-models", default="mlp25m",
                    help="lightning part: models trained with Lightning's Trainer (comma list)")
    ap.add_argument("--train-iters", type=int, default=10, help="training: measured steps per variant")
    ap.add_argument("--block", type=int, default=1, help="training: steps per variant before rotating")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    _common.add_run_args(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return _common.worker_main(args.worker, _describe, _body)

    args.parts = [p for p in args.parts.split(",") if p]
    args.ops = [o for o in args.ops.split(",") if o]
    args.models = [m for m in args.models.split(",") if m]
    args.fsdp_models = [m for m in args.fsdp_models.split(",") if m]
    args.lightning_models = [m for m in args.lightning_models.split(",") if m]
    for what, got, ok in (("--parts", args.parts, ("collectives", "training", "lightning")), ("--ops", args.ops, OPS),
                          ("--models", args.models, MODELS), ("--fsdp-models", args.fsdp_models, MODELS),
                          ("--lightning-models", args.lightning_models, MODELS)):
        bad = [x for x in got if x not in ok]
        if bad:
            ap.error(f"{what}: unknown {bad}; choose from {list(ok)}")
    hosts_mode = args.hosts > 0
    if hosts_mode and args.hosts < 2:
        ap.error("--hosts needs at least 2 hosts")
    n = args.hosts * args.ranks_per_host if hosts_mode else args.ranks
    if args.factor < 2:
        ap.error("--factor must be >= 2")
    args.size_list, s = [], args.min_size
    while s <= args.max_size:
        if s % (4 * n):
            ap.error(f"size {s} is not a multiple of 4*{n} bytes (fp32, split over {n} ranks)")
        args.size_list.append(s)
        s *= args.factor
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first warm-up op is the correctness check)")

    os.makedirs(args.out, exist_ok=True)
    tag = (f"{args.hosts}hosts" if hosts_mode else "1host") + (f"-{args.tag}" if args.tag else "")
    json_path = os.path.join(args.out, f"torch_backend-{tag}.json")
    png_path = os.path.join(args.out, f"torch_backend-{tag}.png")
    meta = _common.run_meta(args)
    meta.update(variants_collectives="backend: dist.<op>(group=new_group(backend='rumor')); gloo: dist.<op> on "
                                     "the gloo default group; api: rumor.allreduce_/allgather/reduce_scatter",
                variants_training=TRAIN_LABEL,
                sample_time="slowest rank's elapsed time for `reps` back-to-back ops / reps, after a gloo barrier "
                            "and one untimed op of the variant",
                busbw="allreduce: algbw*2(n-1)/n; allgather, reduce_scatter: algbw*(n-1)/n")
    result = dict(meta=meta, cells=[], jobs=[], targets=[], errors=[],
                  title=f"torch.distributed: backend 'rumor' vs 'gloo' vs rumor's API, {n} ranks"
                        + (f", {args.hosts} emulated hosts at {args.rate}" if hosts_mode else ", one host"))
    print(f"rumor {meta['rumor']}, torch {meta['torch']}: torch.distributed backend 'rumor' vs 'gloo' vs rumor API"
          f" | {meta['hostname']}, {meta['cpus']} cpus, load {meta['loadavg_start'][0]:.2f} | parts "
          f"{','.join(args.parts)} | ops {','.join(args.ops)} sizes {C.fmt_size(args.size_list[0])}.."
          f"{C.fmt_size(args.size_list[-1])} iters {args.iters} | models {','.join(args.models)} "
          f"(FSDP2: {','.join(args.fsdp_models) or 'none'}) train-iters {args.train_iters} | warmup {args.warmup}")
    cells_total = (len(args.ops) * len(args.size_list) if "collectives" in args.parts else 0) + \
        (len(args.models) if "training" in args.parts else 0) + \
        (len(args.lightning_models) if "lightning" in args.parts else 0)
    progress = Progress(cells_total, "cells", quiet_s=30)
    drv = _common.Driver("rumor-bench-tb-", progress, hosts_mode)

    def body() -> int:
        if hosts_mode:
            tcp = drv.start_cluster(args.hosts, args.rate)
            if tcp is None:
                return 2
            B = parse_rate(args.rate)
            result["link"] = dict(rate=args.rate, link_Bps=B, tcp_single_stream_Bps=tcp)
            print(f"emulated hosts: {args.hosts} x {args.ranks_per_host} rank(s), tbf {args.rate} = "
                  f"{B / 1e6:.0f} MB/s per link; one TCP stream through a shaped link: {tcp / 1e6:.1f} MB/s")
        job = Job(args, n, drv.workdir, progress, cluster=drv.cluster)
        # One host: the all-core copy rate for the DDP bound (_common.exposed_allreduce_s).
        bound_copy = not hosts_mode and "training" in args.parts
        if bound_copy:
            _common.sample_copy_rate(result)
        rc = _common.run_jobs([job], result, progress)
        if bound_copy:
            _common.sample_copy_rate(result)
        drv.close_cluster()
        progress.clear()
        _common.finish_meta(meta)
        coll = [c for c in result["cells"] if c["part"] == "collectives"]
        train = [c for c in result["cells"] if c["part"] == "training"]
        light = [c for c in result["cells"] if c["part"] == "lightning"]
        for c in coll:
            summarize_coll(c)
        for c in train:
            summarize_train(c, result.get("C"))
        for c in light:
            summarize_lightning(c)
        for op in args.ops:
            cs = sorted((c for c in coll if c["op"] == op), key=lambda c: c["size"])
            if cs:
                print_coll(cs, job.label, args.iters)
        if train:
            print_train(train, job.label, args.train_iters)
        if light:
            print_lightning(light, job.label, args.train_iters)
        print()
        if meta["loadavg_start"][0] > 1.0 or meta["loadavg_end"][0] > 1.0:
            print(f"machine load (1-min average) at start / end: {meta['loadavg_start'][0]:.2f} / "
                  f"{meta['loadavg_end'][0]:.2f} on {meta['cpus']} cpus")

        headline = None
        where = f"{args.hosts} emulated hosts" if hosts_mode else "one host"
        if coll:
            big = [c for c in coll if c["size"] >= MiB]
            if big:
                worst = min(big, key=lambda c: c["backend_over_api_bw"])
                ok = all(c["backend_over_api_bw"] >= 0.9 for c in big)
                _target(result, f"{where}: backend busbw >= 0.9x rumor API at >= 1 MiB (every op and size)",
                        worst["backend_over_api_bw"], ok,
                        f"lowest {worst['backend_over_api_bw']:.2f}x ({worst['op']} {C.fmt_size(worst['size'])})")
            for c in sorted((c for c in coll if c["size"] == 64 * MiB), key=lambda c: OPS.index(c["op"])):
                if not hosts_mode:
                    _target(result, f"one host: {OP_CALL[c['op']]} 64 MiB backend busbw >= 3x gloo",
                            c["backend_over_gloo_bw"], c["backend_over_gloo_bw"] >= 3.0,
                            f"{c['backend_over_gloo_bw']:.2f}x")
            for c in sorted((c for c in coll if c["size"] == 4 * KiB), key=lambda c: OPS.index(c["op"])):
                b, g = c["variants"]["backend"]["median_s"], c["variants"]["gloo"]["median_s"]
                _target(result, f"{where}: {OP_CALL[c['op']]} 4 KiB backend time <= 0.1x gloo", b / g, b / g <= 0.1,
                        f"{C.fmt_time(b)} vs {C.fmt_time(g)} ({b / g:.3f}x)")
            ar = [c for c in coll if c["op"] == "allreduce" and c["size"] == max(args.size_list)]
            if ar:
                c = ar[0]
                headline = (f"headline: all_reduce {C.fmt_size(c['size'])} {n} ranks {where}: busbw backend/gloo = "
                            f"{c['backend_over_gloo_bw']:.2f}x, backend/api = {c['backend_over_api_bw']:.2f}x")
        for c in train:
            if c["model"] == "mlp25m" and not hosts_mode:
                _target(result, "one host: mlp25m DDP samples/s rumor/gloo >= 1.3", c["ddp_rumor_over_gloo"],
                        c["ddp_rumor_over_gloo"] >= 1.3,
                        f"{c['ddp_rumor_over_gloo']:.2f}x (ceiling in this run {c['ceiling']:.2f}x)")
            bound = (f"; this machine's bound for any DDP is {100 * c['bound_of_compute']:.0f}% of compute-only, "
                     f"DDP rumor at {100 * c['ddp_rumor_of_bound']:.0f}% of it") if "bound_step_s" in c else ""
            if "floor_of_compute" in c:
                bound += (f"; the measured DDP floor on these cores is {100 * c['floor_of_compute']:.0f}% of "
                          f"compute-only, DDP rumor at {100 * c['ddp_rumor_of_floor']:.0f}% of it")
            _target(result, f"{where}: {c['model']} DDP rumor/gloo >= 0.95 of the ceiling", c["ddp_rumor_of_ceiling"],
                    c["ddp_rumor_of_ceiling"] >= 0.95,
                    f"{100 * c['ddp_rumor_of_ceiling']:.0f}% ({c['ddp_rumor_over_gloo']:.2f}x of {c['ceiling']:.2f}x){bound}")
            if "fsdp_rumor_over_gloo" in c and c["model"] == "mlp25m":
                _target(result, f"{where}: mlp25m FSDP2 samples/s rumor/gloo >= 1.3", c["fsdp_rumor_over_gloo"],
                        c["fsdp_rumor_over_gloo"] >= 1.3,
                        f"{c['fsdp_rumor_over_gloo']:.2f}x (ceiling in this run {c['fsdp_ceiling']:.2f}x)")
            if c["model"] == "mlp25m":
                headline = (headline + "; " if headline else "headline: ") + \
                    f"mlp25m DDP rumor/gloo = {c['ddp_rumor_over_gloo']:.2f}x samples/s"
        for c in light:
            _target(result, f"{where}: {c['model']} Lightning RumorStrategy(ByteGrad) vs Lightning DDP gloo "
                            ">= 0.95 of the ceiling", c["rumor_of_ceiling"], c["rumor_of_ceiling"] >= 0.95,
                    f"{100 * c['rumor_of_ceiling']:.0f}% ({c['rumor_over_gloo']:.2f}x of {c['ceiling']:.2f}x)")
            headline = (headline + "; " if headline else "headline: ") + \
                f"{c['model']} Lightning ByteGrad/DDP-gloo = {c['rumor_over_gloo']:.2f}x samples/s"
        wrong = [(c["op"], c["size"], v) for c in coll for v, d in c["variants"].items() if not d["correct"]]
        if wrong:
            print("WRONG RESULTS: " + ", ".join(f"{v} {o} {C.fmt_size(s)}" for o, s, v in wrong))
            rc = rc or 1
        draw = None if args.no_plot else (lambda: plot(png_path, result))
        _common.write_results(result, headline, "headline: n/a (no figures)", json_path, png_path, draw)
        return rc

    return drv.run(body)


if __name__ == "__main__":
    sys.exit(main())
