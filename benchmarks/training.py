#!/usr/bin/env python
"""Training benchmark: rumor.DistributedDataParallel vs torch DDP (gloo), per BENCHMARKS.md.

Models (rumor.testing.models, per-rank batch): mlp25m [32], cnn [32], transformer [16].

Modes
  one host (default): 2 and 4 ranks on this machine (--ranks).
  --hosts H: H emulated hosts (network namespaces on one bridge, rumor.testing.netns), each
      host's link shaped with `tbf rate 1gbit burst 256kb latency 20ms` (--rate), --ranks-per-host
      ranks each (default 1; 2 with --hierarchical adds rumor GradientAllReduce(hierarchical=True)),
      with --delay, --jitter and --loss on every link (rumor-wanem). Needs root.

How it measures
  Each job starts its ranks (rumor.testing.launch: torchrun's environment, one torch thread per
  rank, a deadline); every rank calls rumor.init() and then
  torch.distributed.init_process_group("gloo") (sharing rumor's store). Per model, every rank
  builds the same weights three times:
    compute  the plain model, no communication: the bound (all ranks compute at once, as in
             the other variants, so they share the cores the same way);
    rumor    rumor.DistributedDataParallel(model) (GradientAllReduce, 25 MB buckets, 1 MB first);
    torch    torch.nn.parallel.DistributedDataParallel(model) over gloo (its defaults).
  A step is zero_grad, forward, cross-entropy, backward, SGD(momentum 0.9) step on the same
  synthetic batch for every variant. After --warmup steps per variant, --iters steps per variant
  are measured in blocks of --block, rotating which variant goes first. Each step starts after a
  gloo barrier; its time is the slowest rank's. Reported: median [min-max] step time and
  samples/s = global batch / median step time; ratios rumor/torch and rumor/compute-only.
  With emulated hosts the communication bound is printed too: the ring time 2(n-1)/n * gradient
  bytes / link rate (n = hosts), and max(compute, ring) is the best any overlap can do.
  For every rumor variant rank 0 also records DistributedDataParallel.last_iteration_timeline()
  each measured step; "where the time goes" prints its medians (before forward: the buffer
  broadcast and the algorithm's before_forward, e.g. decentralized mixing; forward, backward compute,
  exposed communication, the algorithm's after_backward hook (a decentralized algorithm's wait for
  its weight mix), optimizer, comm-thread busy) and, with emulated hosts of one rank, the
  link-bound step: each bucket over the links at link rate (WIRE_BYTES per element) from its
  measured ready time, one after another, then the optimizer.
  On one host the memory-bound step bounds the exact-allreduce variants (MEMORY_BOUND_VARIANTS):
  compute-only's step plus what the allreduce of the gradients ready last leaves past backward's
  end even at the memory bound (n*S/C for S bytes per rank, C the all-core copy rate measured
  before and after the jobs; each gradient's ready time from hooks on compute-only's steps;
  _common.exposed_allreduce_s). It enters their ceiling and prints as "memory-bound step".
  That bound lets the allreduce run on idle cores; the variant "memory floor" (one host, beside
  those variants) measures instead compute-only plus the allreduce at the memory bound as one
  copy of each gradient when it is ready, in each rank's own thread and with no rank waiting for
  another (_common.DDPFloor): what that traffic costs where every core computes. The variant
  "bucket floor" adds each gradient's copy into its bucket before it: rumor's DDP makes that copy
  once a step (torch's default zero_grad(set_to_none=True) has autograd put each new gradient
  in memory of its own, and the peers read the shared bucket), so that is the floor of its design.
  "CPU per step" sums the CPU time of every thread of every rank during a step: where ranks share
  cores, a variant loses to compute-only by working more (cpu ms) or by idling cores (busy %).

Output: a table per job (with a progress bar while it runs), the issue's targets, JSON with
every raw figure and a PNG in --out (default benchmarks/results/); the last line is the headline
ratio.

  python benchmarks/training.py                               # one host, 2 and 4 ranks
  python benchmarks/training.py --ranks 4 --models mlp25m --iters 10
  sudo python benchmarks/training.py --hosts 4                # 4 emulated hosts x 1 rank, 1 Gbit
  sudo python benchmarks/training.py --hosts 2 --ranks-per-host 2 --hierarchical
  python benchmarks/training.py --ranks 4 --timeline          # timeline overhead: rumor with it on vs off

--timeline adds the variant rumor_timeline: rumor's default DDP with rumor.timeline recording
(started before each block of its steps, outside the timed region; rank 0 merges the last
block's files); "timeline overhead" prints its median step over rumor's (target < 1.02).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import time
from typing import Dict, List, Optional

import _common
from _common import Progress, emit, parse_rate

MODELS = ("mlp25m", "cnn", "transformer")
# --algorithms: rumor variants beside compute-only and torch DDP. Each is built inside the rank
# (rumor imported there); "onebit_adam" also swaps the optimizer (see _optimizer).
ALGORITHMS = {
    "rumor": ("rumor", "GradientAllReduce()"),
    "rumor_hier": ("rumor hier", "GradientAllReduce(hierarchical=True)"),
    "bytegrad": ("ByteGrad", "ByteGrad()"),
    "qsgd": ("QSGD(16)", "QSGD(levels=16)"),
    "fp16": ("fp16", "LowPrecision(dtype=torch.float16)"),
    "bf16": ("bf16", "LowPrecision(dtype=torch.bfloat16)"),
    "onebit_adam": ("1-bit Adam", "OneBitAdamAlgorithm(optimizer) with rumor.optim.OneBitAdamOptimizer(freeze_step=warmup)"),
    "onebit_adam_hier": ("1-bit Adam hier", "OneBitAdamAlgorithm(optimizer, hierarchical=True), the same optimizer"),
    "dec_all": ("Dec all", "Decentralized(peer_selection='all')"),
    "dec_shift_one": ("Dec shift_one", "Decentralized(peer_selection='shift_one')"),
    "dec_exp2": ("Dec exp2", "Decentralized(peer_selection='exp2')"),
    "dec_private": ("Dec private", "Decentralized(peer_selection='shift_one') with RUMOR_SHARED_BUCKETS=0: the "
                    "weights in private buffers, not the shared arena (one host)"),
    "lp_dec": ("LowPrecDec", "LowPrecisionDecentralized()"),
    "rumor_fused": ("rumor fused", "GradientAllReduce(), optimizer fused (rumor.optim.fuse_optimizer)"),
    "rumor_overlap": ("rumor overlap", "GradientAllReduce(), overlap_optimizer=True (update per bucket in backward; once per host with shared buckets)"),
    "rumor_overlap_rank": ("overlap/rank", "as rumor overlap with RUMOR_SHARED_OPTIMIZER=0: every rank updates "
                           "the whole bucket"),
    "rumor_timeline": ("rumor+timeline", "GradientAllReduce(), rumor.timeline recording during its steps"),
}
VARIANT_LABEL = {"compute": "compute-only", "floor": "memory floor", "floor_bucket": "bucket floor", "torch": "torch DDP", **{k: v[0] for k, v in ALGORITHMS.items()}}


# Bytes per gradient element on the wire between hosts (codec headers and per-chunk scales left
# out, so what they bound stays a lower bound); variants missing here get no link bound.
WIRE_BYTES = {"rumor": 4.0, "rumor_hier": 4.0, "bytegrad": 1.0, "qsgd": 1.0, "fp16": 2.0, "bf16": 2.0,
              "onebit_adam": 1 / 8, "onebit_adam_hier": 1 / 8}

# One host: the variants whose step includes an exact fp32 allreduce of every gradient and the
# whole optimizer step after backward, so the memory-bound step (summarize) bounds them. Not the
# overlapped optimizer (its update runs during backward, once per host) nor the codecs.
MEMORY_BOUND_VARIANTS = ("rumor", "rumor_hier", "rumor_fused", "rumor_timeline")

# The variants that are not a data-parallel wrapper of rumor: no timeline, no ceiling of their own.
NOT_DDP = ("compute", "floor", "floor_bucket", "torch")

# Targets of the algorithm issues (samples/s over torch DDP, 4 emulated hosts at 1 Gbit).
ALGORITHM_TARGETS = {"bytegrad": 2.5, "onebit_adam": 5.0, "fp16": 1.7, "dec_shift_one": 1.4, "dec_exp2": 1.4,
                     "lp_dec": 2.5}


def _algorithm(key: str, opt):
    import torch

    from rumor import algorithms as A

    return {
        "rumor": lambda: A.GradientAllReduce(),
        "rumor_hier": lambda: A.GradientAllReduce(hierarchical=True),
        "bytegrad": lambda: A.ByteGrad(),
        "qsgd": lambda: A.QSGD(levels=16),
        "fp16": lambda: A.LowPrecision(dtype=torch.float16),
        "bf16": lambda: A.LowPrecision(dtype=torch.bfloat16),
        "onebit_adam": lambda: A.OneBitAdamAlgorithm(opt),
        "onebit_adam_hier": lambda: A.OneBitAdamAlgorithm(opt, hierarchical=True),
        "dec_all": lambda: A.Decentralized(peer_selection="all"),
        "dec_shift_one": lambda: A.Decentralized(peer_selection="shift_one"),
        "dec_exp2": lambda: A.Decentralized(peer_selection="exp2"),
        "dec_private": lambda: A.Decentralized(peer_selection="shift_one"),
        "lp_dec": lambda: A.LowPrecisionDecentralized(),
        "rumor_fused": lambda: A.GradientAllReduce(),
        "rumor_overlap": lambda: A.GradientAllReduce(),
        "rumor_overlap_rank": lambda: A.GradientAllReduce(),
        "rumor_timeline": lambda: A.GradientAllReduce(),
    }[key]()


def _warmup_steps(key: str, cfg) -> int:
    return max(cfg["warmup"], cfg["onebit_freeze"]) if key.startswith("onebit_adam") else cfg["warmup"]


def _optimizer(key: str, model, cfg):
    import torch

    if key.startswith("onebit_adam"):
        import rumor.optim

        # frozen variance (the compressed phase) from the first measured step on; the warm-up
        # steps of this variant are its full-precision Adam steps
        return rumor.optim.OneBitAdamOptimizer(model.parameters(), lr=1e-3, freeze_step=_warmup_steps(key, cfg))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    if key == "rumor_fused":
        import rumor.optim

        rumor.optim.fuse_optimizer(opt)
    return opt


# ==== helpers ========================================================================================

def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.0f}" if s >= 0.1 else f"{s * 1e3:.1f}"


# ==== inside a rank ==================================================================================

def _describe(rank: int, n: int) -> Dict:
    import torch

    import rumor

    return dict(rank=rank, size=n, local_size=rumor.local_size(), machine_size=rumor.machine_size(),
                torch_threads=torch.get_num_threads(), netns=os.readlink("/proc/self/ns/net"))


def _train(cfg: Dict, rank: int, n: int) -> None:
    for name in cfg["models"]:
        _run_model(cfg, name, rank, n)


def _run_model(cfg: Dict, name: str, rank: int, n: int) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import rumor
    from rumor.testing import models

    batch = cfg["batch"].get(name) or models.BATCH[name]
    variants: Dict[str, tuple] = {}

    def add(v, wrap):
        model = models.build(name, seed=cfg["seed"])
        opt = _optimizer(v, model, cfg)
        variants[v] = (wrap(model, opt), opt)

    add("compute", lambda m, o: m)
    floors = {}
    if cfg["floor"]:
        # the allreduce at the memory bound alone, and after each gradient's copy into its bucket
        for v, into in (("floor", False), ("floor_bucket", True)):
            add(v, lambda m, o: m)
            floors[v] = _common.DDPFloor(variants[v][0], into_bucket=into, copy_back=False)

    def wrap(m, o, key):
        # read when the wrapper is built; the job's own settings come back afterwards
        forced = {"RUMOR_SHARED_OPTIMIZER": "0" if key == "rumor_overlap_rank" else None,
                  "RUMOR_SHARED_BUCKETS": "0" if key == "dec_private" else None}
        before = {k: os.environ.get(k) for k in forced}
        os.environ.update({k: v for k, v in forced.items() if v is not None})
        try:
            return rumor.DistributedDataParallel(m, optimizer=o, algorithm=_algorithm(key, o),
                                                 overlap_optimizer=key.startswith("rumor_overlap"))
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    for key in cfg["algorithms"]:
        add(key, lambda m, o, key=key: wrap(m, o, key))
    add("torch", lambda m, o: TorchDDP(m))
    nparams = sum(p.numel() for p in variants["compute"][0].parameters())
    # A few distinct batches, made before timing; every variant sees the same sequence.
    data = [models.batch(name, batch, step=i, shard=rank, seed=cfg["seed"]) for i in range(4)]

    breakdown = {v: [] for v in variants if v not in NOT_DDP}
    ready = _common.GradReady(variants["compute"][0])

    def step(v, i, record=False):
        model, opt = variants[v]
        x, y = data[i % len(data)]
        opt.zero_grad()
        loss = models.loss(model(x), y)
        ready.begin(v == "compute")
        loss.backward()
        if v in floors:
            floors[v].finish()
        ready.end()
        t = time.perf_counter()
        opt.step()
        if record and v in breakdown:
            tl = model.last_iteration_timeline()
            if tl is not None:
                breakdown[v].append(dict(before_forward=tl["module_start"],
                                         forward=tl["forward_end"] - tl["module_start"],
                                         backward_compute=tl["backward_compute_end"] - tl["forward_end"],
                                         exposed_comm=tl["exposed_comm"], comm_busy=tl["comm_busy"],
                                         after_backward=tl["after_backward"],
                                         optimizer=time.perf_counter() - t,
                                         buckets=[(b["elements"], b["ready"], b["start"], b["end"])
                                                  for b in tl["buckets"]]))
        return float(loss.detach())

    names = list(variants)

    @contextlib.contextmanager
    def recording(v, merge=False):
        # The timeline variant records during its own steps only; start/stop are collective
        # (every rank runs the same sequence of variants) and stay outside the timed steps.
        if v != "rumor_timeline":
            yield
            return
        rumor.timeline.start(cfg["timeline_path"])
        try:
            yield
        finally:
            merged = rumor.timeline.stop(merge=merge, out=cfg["timeline_merged"] if merge else None)
            if merged:
                emit("progress", {"model": name, "done": done, "total": total, "what": f"timeline {merged}"})

    counts = {v: 0 for v in names}
    times = {v: [] for v in names}
    cpu = {v: [] for v in names}  # CPU seconds of every thread of this rank during the step
    losses = {v: [] for v in names}
    warm = {v: [] for v in names}
    total = sum(_warmup_steps(v, cfg) + cfg["iters"] for v in names)
    done = 0
    for v in names:
        with recording(v):
            for _ in range(_warmup_steps(v, cfg)):
                dist.barrier()
                t0 = time.perf_counter()
                step(v, counts[v])
                warm[v].append(time.perf_counter() - t0)
                counts[v] += 1
                done += 1
        if rank == 0:
            emit("progress", {"model": name, "done": done, "total": total, "what": f"warm-up {v}"})
    blocks = -(-cfg["iters"] // cfg["block"])
    for b in range(blocks):
        k = b % len(names)
        for v in names[k:] + names[:k]:  # rotate who goes first
            with recording(v, merge=b == blocks - 1):
                for _ in range(min(cfg["block"], cfg["iters"] - b * cfg["block"])):
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    loss = step(v, counts[v], record=rank == 0)
                    times[v].append(time.perf_counter() - t0)
                    cpu[v].append(time.process_time() - c0)
                    losses[v].append(loss)
                    counts[v] += 1
                    done += 1
            if rank == 0:
                emit("progress", {"model": name, "done": done, "total": total,
                                   "what": f"{v} {times[v][-1] * 1e3:.0f} ms/step"})
    per_rank = _common.gather_samples(times)  # a step's time is the slowest rank's
    cpu_per_rank = _common.gather_samples(cpu)
    loss_t = {v: torch.tensor(losses[v], dtype=torch.float64) for v in names}
    for v in names:
        dist.all_reduce(loss_t[v], op=dist.ReduceOp.SUM)
    if rank == 0:
        cell = dict(model=name, n=n, batch=batch, global_batch=batch * n, params=nparams,
                    grad_bytes=nparams * 4, variants={},
                    grad_ready=ready.summary(_warmup_steps("compute", cfg)))
        for v in names:
            steps = [max(per_rank[v][r][i] for r in range(n)) for i in range(len(times[v]))]
            # all ranks' CPU seconds in step i: against (cores x step time), how busy the host was
            cpus = [sum(cpu_per_rank[v][r][i] for r in range(n)) for i in range(len(times[v]))]
            cell["variants"][v] = dict(step_s=steps, per_rank_step_s=per_rank[v], warmup_s=warm[v], cpu_s=cpus,
                                       loss=(loss_t[v] / n).tolist())
            if breakdown.get(v):
                # rank 0's DistributedDataParallel.last_iteration_timeline() of each measured step
                cell["variants"][v]["rank0_timeline_s"] = breakdown[v]
        emit("cell", cell)
    del variants, data
    gc.collect()


# ==== the driver =====================================================================================

class Job(_common.Job):
    """One set of ranks (a world size, on one host or in the emulated cluster), all models."""

    def __init__(self, args, n: int, workdir: str, progress: Progress, base: int, steps_per_model: int,
                 cluster=None):
        super().__init__(os.path.abspath(__file__), args, n, workdir, progress, base, cluster)
        self.steps_per_model = steps_per_model
        self.model_index = 0

    def config(self) -> Dict:
        a = self.args
        algorithms = algorithm_list(a, self)
        return dict(models=a.models, batch=a.batch_map, iters=a.iters, warmup=a.warmup, block=a.block, lr=a.lr,
                    seed=a.seed, algorithms=algorithms, onebit_freeze=a.onebit_freeze,
                    # one host: the memory floor (_common.DDPFloor) beside the exact-allreduce variants
                    floor=self.cluster is None and any(k in MEMORY_BOUND_VARIANTS for k in algorithms),
                    timeline_path=os.path.join(self.workdir, f"timeline-{self.n}ranks.json"),
                    timeline_merged=os.path.join(os.path.abspath(a.out), f"timeline-{re.sub('[^A-Za-z0-9]+', '_', self.label)}.json"))

    def on_message(self, kind: str, data) -> None:
        if kind == "progress":
            self.progress.update(self.base + self.model_index * self.steps_per_model + data["done"],
                                 f"{self.label}: {data['model']} {data['what']}")
        elif kind == "cell":
            self.model_index += 1
            self.progress.update(self.base + self.model_index * self.steps_per_model,
                                 f"{self.label}: {data['model']} done", force=True)


def algorithm_list(args, job) -> List[str]:
    """--algorithms, plus GradientAllReduce(hierarchical=True) for --hierarchical on multi-rank hosts."""
    extra = ["rumor_hier"] if (args.hierarchical and job.cluster is not None and job.rph > 1
                               and "rumor_hier" not in args.algorithms) else []
    return args.algorithms + extra


def summarize(cell: Dict, link_Bps: Optional[float], copy_rate: Optional[float] = None) -> None:
    gb = cell["global_batch"]
    for v, d in cell["variants"].items():
        s = d["step_s"]
        d["median_s"], d["min_s"], d["max_s"] = statistics.median(s), min(s), max(s)
        d["samples_per_s"] = gb / d["median_s"]
        d["samples_per_s_min"], d["samples_per_s_max"] = gb / d["max_s"], gb / d["min_s"]
        if d.get("cpu_s"):
            d["cpu_median_s"] = statistics.median(d["cpu_s"])
    v = cell["variants"]
    for k, d in v.items():
        d["over_torch"] = d["samples_per_s"] / v["torch"]["samples_per_s"]
        d["over_compute"] = d["samples_per_s"] / v["compute"]["samples_per_s"]
        d["final_loss"] = d["loss"][-1] if d["loss"] else None
    for key, d in v.items():
        if d.get("rank0_timeline_s"):
            tl = d["rank0_timeline_s"]
            d["rank0_breakdown_s"] = {k: statistics.median(x[k] for x in tl) for k in tl[0] if k != "buckets"}
            if link_Bps and cell.get("ranks_per_host") == 1 and key in WIRE_BYTES:
                # The step had every bucket crossed the links at link rate from the moment it was
                # ready (its ready time as measured in this step, bucket after bucket), then the
                # optimizer: what any schedule of this algorithm could do with this computation.
                h = cell["hosts"]
                bounds = []
                for x in tl:
                    t = 0.0
                    for elements, ready, *_ in x["buckets"]:
                        t = max(t, ready) + 2 * (h - 1) / h * elements * WIRE_BYTES[key] / link_Bps
                    bounds.append(t + x["optimizer"])
                d["rank0_breakdown_s"]["link_bound_step"] = statistics.median(bounds)
    if copy_rate and not link_Bps and cell.get("grad_ready"):
        # One host: compute-only's step plus the allreduce of the gradients ready last that runs
        # past backward's end even at the memory bound (_common.exposed_allreduce_s).
        cell["exposed_allreduce_s"] = _common.exposed_allreduce_s(cell["grad_ready"], cell["n"], copy_rate)
        cell["memory_bound_step_s"] = v["compute"]["median_s"] + cell["exposed_allreduce_s"]
    if "floor" in v:
        cell["floor_loss_diff"] = max(abs(a - b) for f in ("floor", "floor_bucket") if f in v
                                      for a, b in zip(v[f]["loss"], v["compute"]["loss"]))
    for key, d in v.items():
        if key in NOT_DDP:
            continue
        # The most this variant could reach against torch DDP in this run: no step beats the
        # compute-only step, nor (with emulated hosts of one rank) its link-bound step, nor (one
        # host, exact allreduce) the memory-bound step.
        shortest = max(v["compute"]["median_s"], d.get("rank0_breakdown_s", {}).get("link_bound_step", 0.0))
        if key in MEMORY_BOUND_VARIANTS and "memory_bound_step_s" in cell:
            shortest = max(shortest, cell["memory_bound_step_s"])
            d["of_memory_bound"] = cell["memory_bound_step_s"] / d["median_s"]
            if "floor" in v:
                d["of_floor"] = v["floor"]["median_s"] / d["median_s"]
            if "floor_bucket" in v:
                d["of_bucket_floor"] = v["floor_bucket"]["median_s"] / d["median_s"]
        d["ceiling_over_torch"] = v["torch"]["median_s"] / shortest
    main = "rumor" if "rumor" in v else next(k for k in v if k not in NOT_DDP)
    cell["main_variant"] = main
    cell["rumor_over_torch"] = v[main]["over_torch"]
    cell["rumor_over_compute"] = v[main]["over_compute"]
    cell["torch_over_compute"] = v["torch"]["over_compute"]
    if "rumor_hier" in v:
        cell["rumor_hier_over_torch"] = v["rumor_hier"]["over_torch"]
    if link_Bps:
        h = cell["hosts"]
        ring_s = 2 * (h - 1) / h * cell["grad_bytes"] / link_Bps
        cell["ring_s"] = ring_s
        cell["overlap_bound_s"] = max(ring_s, v["compute"]["median_s"])
        cell["overlap_bound_samples_per_s"] = gb / cell["overlap_bound_s"]


def print_table(cells: List[Dict], title: str) -> None:
    if not cells:
        return
    variants = list(cells[0]["variants"])
    if len(variants) > 4:
        return print_long_table(cells, title)
    print(f"\n{title}   (step time: median [min-max] ms of {len(cells[0]['variants']['torch']['step_s'])} "
          f"steps, slowest rank; samples/s = global batch / median step)")
    head = f"{'model':<12} {'params':>7} {'batch x n':>9} |"
    for v in variants:
        head += f" {VARIANT_LABEL[v] + ' ms':>19} {'smp/s':>7} |"
    head += f" {'rumor/torch':>11} {'ceiling':>7} {'rumor/bound':>11}"
    ring = "ring_s" in cells[0]
    if ring:
        head += f" {'ring ms':>8} {'max(c,ring)':>11} {'rumor/max':>9}"
    print(head)
    print("-" * len(head))
    for c in cells:
        row = f"{c['model']:<12} {c['params'] / 1e6:>6.1f}M {str(c['batch']) + 'x' + str(c['n']):>9} |"
        for v in variants:
            d = c["variants"][v]
            t = f"{fmt_ms(d['median_s'])} [{fmt_ms(d['min_s'])}-{fmt_ms(d['max_s'])}]"
            row += f" {t:>19} {d['samples_per_s']:>7.1f} |"
        row += (f" {c['rumor_over_torch']:>10.2f}x {c['variants'][c['main_variant']]['ceiling_over_torch']:>6.2f}x"
                f" {100 * c['rumor_over_compute']:>10.0f}%")
        if ring:
            row += (f" {c['ring_s'] * 1e3:>8.0f} {c['overlap_bound_s'] * 1e3:>9.0f}ms "
                    f"{100 * c['overlap_bound_s'] / c['variants'][c['main_variant']]['median_s']:>8.0f}%")
        print(row)


def print_cpu(cells: List[Dict]) -> None:
    """CPU time of all ranks' threads per step against what the host's cores offered in the
    step: where ranks share cores, a variant loses to compute-only either by doing more work
    (CPU ms) or by leaving cores idle while ranks wait for one another (busy %)."""
    rows = [(c, v, d) for c in cells for v, d in c["variants"].items() if d.get("cpu_median_s")]
    if not rows:
        return
    cores = os.cpu_count() or 1
    print(f"\n{'CPU per step (all ranks, median)':<40} {'cpu ms':>8} {'vs compute':>10} {'busy':>6}   "
          f"(busy = cpu / ({cores} cores x median step))")
    for c, v, d in rows:
        extra = d["cpu_median_s"] - c["variants"]["compute"].get("cpu_median_s", 0.0)
        print(f"{c['model'] + ' ' + VARIANT_LABEL[v]:<40} {d['cpu_median_s'] * 1e3:>8.0f} {extra * 1e3:>+10.0f} "
              f"{100 * d['cpu_median_s'] / (cores * d['median_s']):>5.0f}%")


def print_breakdown(cells: List[Dict]) -> None:
    """Where rumor's step goes (rank 0, medians; from last_iteration_timeline()): communication
    that backward did not hide is what separates a variant from compute-only."""
    rows = [(c, v, d["rank0_breakdown_s"]) for c in cells for v, d in c["variants"].items()
            if d.get("rank0_breakdown_s")]
    if not rows:
        return
    bound = any("link_bound_step" in b for _, _, b in rows)
    print(f"\n{'where the time goes (rank 0, median ms)':<40} {'before fwd':>10} {'forward':>8} {'bwd compute':>11} "
          f"{'exposed comm':>12} {'after bwd':>9} {'optimizer':>9} | {'comm busy':>9}"
          + (f" {'link-bound step':>15}" if bound else ""))
    for c, v, b in rows:
        lb = b.get("link_bound_step")
        print(f"{c['model'] + ' ' + VARIANT_LABEL[v]:<40} {b.get('before_forward', 0.0) * 1e3:>10.0f} "
              f"{b['forward'] * 1e3:>8.0f} {b['backward_compute'] * 1e3:>11.0f} "
              f"{b['exposed_comm'] * 1e3:>12.0f} {b.get('after_backward', 0.0) * 1e3:>9.0f} "
              f"{b['optimizer'] * 1e3:>9.0f} | {b['comm_busy'] * 1e3:>9.0f}"
              + (f" {lb * 1e3:>15.0f}" if lb is not None else (f" {'-':>15}" if bound else "")))
    if bound:
        print("link-bound step: every bucket over the links at link rate from the moment it was ready (as "
              "measured), one after another, then the optimizer; the best any schedule of that algorithm can "
              "do with this computation (codec headers left out)")


def print_long_table(cells: List[Dict], title: str) -> None:
    """One row per (model, variant): for runs that compare many algorithms."""
    print(f"\n{title}   (step time: median [min-max] ms of {len(cells[0]['variants']['torch']['step_s'])} "
          f"steps, slowest rank; samples/s = global batch / median step; loss = mean over ranks after the "
          f"last measured step)")
    head = (f"{'model':<12} {'variant':<14} {'step ms':>19} {'smp/s':>8} {'x torch':>8} {'ceiling':>8} "
            f"{'of bound':>8} {'loss':>8}")
    print(head)
    print("-" * len(head))
    for c in cells:
        for v, d in c["variants"].items():
            t = f"{fmt_ms(d['median_s'])} [{fmt_ms(d['min_s'])}-{fmt_ms(d['max_s'])}]"
            loss = f"{d['final_loss']:.4f}" if d.get("final_loss") is not None else "-"
            ceiling = f"{d['ceiling_over_torch']:.2f}x" if "ceiling_over_torch" in d else "-"
            print(f"{c['model']:<12} {VARIANT_LABEL[v]:<14} {t:>19} {d['samples_per_s']:>8.1f} "
                  f"{d['over_torch']:>7.2f}x {ceiling:>8} {100 * d['over_compute']:>7.0f}% {loss:>8}")
        if "ring_s" in c:
            print(f"{'':<12} {'(fp32 ring)':<14} {c['ring_s'] * 1e3:>17.0f}ms   max(compute, ring) = "
                  f"{c['overlap_bound_s'] * 1e3:.0f} ms")


def plot(path: str, jobs: List[Dict]) -> Optional[str]:
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    jobs = [j for j in jobs if j["cells"]]
    if not jobs:
        return "no plot (no results)"
    fig, axes = plt.subplots(1, len(jobs), figsize=(5.5 * len(jobs), 4.2), squeeze=False)
    palette = ["#1f77b4", "#6baed6", "#2ca02c", "#98df8a", "#9467bd", "#c5b0d5", "#8c564b", "#e377c2",
               "#17becf", "#bcbd22", "#7f7f7f"]
    colors = {"compute": "#bbbbbb", "floor": "#dddddd", "floor_bucket": "#eeeeee", "torch": "#ff7f0e",
              **{k: palette[i % len(palette)] for i, k in enumerate(ALGORITHMS)}}
    for ax, job in zip(axes[0], jobs):
        cells = job["cells"]
        variants = list(cells[0]["variants"])
        width = 0.8 / len(variants)
        for k, v in enumerate(variants):
            xs = [i + (k - (len(variants) - 1) / 2) * width for i in range(len(cells))]
            # normalized to the compute-only bound, so that the models share one axis
            ys = [c["variants"][v]["samples_per_s"] / c["variants"]["compute"]["samples_per_s"] for c in cells]
            lo = [y - c["variants"][v]["samples_per_s_min"] / c["variants"]["compute"]["samples_per_s"]
                  for y, c in zip(ys, cells)]
            hi = [c["variants"][v]["samples_per_s_max"] / c["variants"]["compute"]["samples_per_s"] - y
                  for y, c in zip(ys, cells)]
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=VARIANT_LABEL[v], color=colors[v])
        for i, c in enumerate(cells):  # rumor/torch above each group's highest error bar
            bound = c["variants"]["compute"]["samples_per_s"]
            ytop = max(c["variants"][v]["samples_per_s_max"] for v in variants) / bound
            if len(variants) <= 4:
                ax.text(i, ytop + 0.03, f"rumor/torch {c['rumor_over_torch']:.2f}x", ha="center", fontsize=8,
                        fontweight="bold")
            else:  # many variants: each bar's ratio to torch DDP above it
                for k, v in enumerate(variants):
                    x = i + (k - (len(variants) - 1) / 2) * width
                    y = c["variants"][v]["samples_per_s_max"] / bound
                    ax.text(x, y + 0.02, f"{c['variants'][v]['over_torch']:.2f}x", ha="center", fontsize=6,
                            rotation=90)
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels([f"{c['model']}\n{c['variants']['compute']['samples_per_s']:.0f} smp/s bound"
                            for c in cells], fontsize=8)
        top = max(c["variants"][v]["samples_per_s_max"] / c["variants"]["compute"]["samples_per_s"]
                  for c in cells for v in variants)
        ax.set_ylim(0, max(1.15, top + 0.15))
        ax.set_ylabel("samples/s relative to compute-only")
        ax.set_title(job["label"], fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("rumor DDP vs torch DDP (gloo)\nsamples/s relative to compute-only (labels: rumor/torch)", fontsize=9)
    _common.save_figure(plt, fig, path)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="rumor DDP vs torch DDP training throughput (see the docstring)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common.add_world_args(ap)
    ap.add_argument("--hierarchical", action="store_true",
                    help="also rumor GradientAllReduce(hierarchical=True) (with several ranks per host)")
    ap.add_argument("--algorithms", default="rumor",
                    help=f"comma list of rumor variants to run beside compute-only and torch DDP: {list(ALGORITHMS)}")
    ap.add_argument("--onebit-freeze", type=int, default=10,
                    help="onebit_adam: full-precision Adam steps (its warm-up) before the variance is frozen")
    ap.add_argument("--timeline", action="store_true",
                    help="also rumor with rumor.timeline recording (variant rumor_timeline): its overhead")
    ap.add_argument("--tag", default="", help="suffix for the JSON/PNG file names")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    ap.add_argument("--batch", default="", help="per-rank batch overrides, e.g. mlp25m=16,cnn=8")
    ap.add_argument("--iters", type=int, default=10, help="measured steps per variant (protocol: >= 10)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps per variant first")
    ap.add_argument("--block", type=int, default=1,
                    help="steps per variant before the next one runs (1: finest interleaving, best on a noisy machine)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    _common.add_run_args(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return _common.worker_main(args.worker, _describe, _train)

    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if args.timeline:
        args.algorithms += [a for a in ("rumor", "rumor_timeline") if a not in args.algorithms]
    bad = [a for a in args.algorithms if a not in ALGORITHMS]
    if bad or not args.algorithms:
        ap.error(f"unknown algorithms {bad}; choose from {list(ALGORITHMS)}")

    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        ap.error(f"unknown models {bad}; choose from {MODELS}")
    args.batch_map = {}
    for kv in filter(None, args.batch.split(",")):
        k, _, v = kv.partition("=")
        args.batch_map[k.strip()] = int(v)
    hosts_mode = args.hosts > 0
    worlds = _common.world_sizes(ap, args)
    if args.iters < 10:
        print(f"WARNING: --iters {args.iters} is below the protocol's minimum of 10; smoke test only",
              file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    tag = "1host"
    if hosts_mode:
        tag = f"{args.hosts}hosts" + (f"x{args.ranks_per_host}" if args.ranks_per_host > 1 else "")
    if args.tag:
        tag += "-" + args.tag
    json_path = os.path.join(args.out, f"training-{tag}.json")
    png_path = os.path.join(args.out, f"training-{tag}.png")

    meta = _common.run_meta(args)
    meta.update(worlds=worlds,
                step="zero_grad + forward + cross-entropy + backward + SGD(momentum 0.9) step; after a gloo "
                     "barrier; the slowest rank's time",
                variants={"compute": "plain model, no communication (bound)",
                          **{k: "rumor.DistributedDataParallel, " + ALGORITHMS[k][1] for k in ALGORITHMS},
                          "torch": "torch.nn.parallel.DistributedDataParallel, gloo, defaults"},
                optimizer="SGD(lr, momentum 0.9) for every variant except onebit_adam (rumor.optim.OneBitAdamOptimizer, "
                          "lr 1e-3, variance frozen after its warm-up: max(--warmup, --onebit-freeze) full-precision steps)")
    result = dict(meta=meta, jobs=[], cells=[], targets=[], errors=[])
    print(f"rumor {meta['rumor']} vs torch {meta['torch']} DDP (gloo) | {meta['hostname']}, {meta['cpus']} cpus, "
          f"load {meta['loadavg_start'][0]:.2f} | models {','.join(args.models)} | iters {args.iters}, "
          f"warmup {args.warmup}, block {args.block}")

    n_variants = 2 + len(args.algorithms) + (
        1 if hosts_mode and args.hierarchical and args.ranks_per_host > 1 and "rumor_hier" not in args.algorithms else 0)
    steps_per_model = n_variants * (args.warmup + args.iters) + (
        sum(max(0, args.onebit_freeze - args.warmup) for a in args.algorithms if a.startswith("onebit_adam")))
    progress = Progress(len(worlds) * len(args.models) * steps_per_model, unit="steps", quiet_s=10)
    drv = _common.Driver("rumor-train-bench-", progress, hosts_mode)

    def body() -> int:
        link_Bps = None
        if hosts_mode:
            tcp = drv.start_cluster(args.hosts, args.rate, **_common.wan_kwargs(args))
            if tcp is None:
                return 2
            link_Bps = parse_rate(args.rate)
            result["tcp_single_stream_Bps"] = tcp
            print(f"emulated hosts: {args.hosts} x {args.ranks_per_host} rank(s), tbf {args.rate} = "
                  f"{link_Bps / 1e6:.0f} MB/s per link{_common.wan_label(args)}; one TCP stream through a shaped "
                  f"link: {tcp / 1e6:.1f} MB/s")
        jobs = [Job(args, n, drv.workdir, progress, k * len(args.models) * steps_per_model, steps_per_model,
                    cluster=drv.cluster) for k, n in enumerate(worlds)]
        # One host: the all-core copy rate for the memory-bound step (summarize).
        copy_rate = None
        if not hosts_mode:
            _common.sample_copy_rate(result)
        rc = _common.run_jobs(jobs, result, progress)
        drv.close_cluster()
        progress.clear()
        if not hosts_mode:
            copy_rate = _common.sample_copy_rate(result)
        for c in result["cells"]:
            summarize(c, link_Bps, copy_rate)
        _common.finish_meta(meta)

        for job in jobs:
            print_table(job.cells, job.label)
            print_breakdown(job.cells)
            print_cpu(job.cells)
        if link_Bps:
            print(f"\nring ms = 2(n-1)/n x fp32 gradient bytes / link rate (n = {args.hosts} hosts, "
                  f"{args.rate}); max(c,ring) = the step time of perfect overlap (rumor/max: rumor's samples/s "
                  f"relative to it); rumor/bound is vs compute-only")
        print("ceiling = torch DDP's step / the larger of compute-only and (emulated hosts of one rank) rumor's "
              "link-bound step: the most rumor/torch this run allowed")
        bound_cells = [c for c in result["cells"] if "memory_bound_step_s" in c]
        if bound_cells:
            print(f"memory-bound step (one host; exact allreduce variants, whose ceiling it sets): compute-only's step "
                  f"+ the allreduce of the gradients ready last that runs past backward's end even at the memory "
                  f"bound (n*S/C, all-core copy rate C = {copy_rate / 1e9:.2f} GB/s):")
            for c in bound_cells:
                v = c["variants"]
                ofb = ", ".join(f"{VARIANT_LABEL[k]} {100 * v[k]['of_memory_bound']:.0f}%"
                                for k in v if "of_memory_bound" in v[k])
                print(f"  {c['model']} {c['n']} ranks: +{c['exposed_allreduce_s'] * 1e3:.1f} ms -> "
                      f"{fmt_ms(c['memory_bound_step_s'])} ms, {100 * v['compute']['median_s'] / c['memory_bound_step_s']:.0f}% "
                      f"of compute-only's samples/s; of that bound: {ofb}")
            floor_cells = [c for c in bound_cells if "floor" in c["variants"]]
            if floor_cells:
                print("memory floor (measured, one host): compute-only plus the allreduce at the memory bound as one "
                      "copy of each gradient when it is ready, in each rank's own thread, no rank waiting for "
                      "another (_common.DDPFloor): on cores that all compute, the traffic any exact allreduce needs")
            for c in floor_cells:
                v = c["variants"]
                off = ", ".join(f"{VARIANT_LABEL[k]} {100 * v[k]['of_floor']:.0f}%" for k in v if "of_floor" in v[k])
                print(f"  {c['model']} {c['n']} ranks: {fmt_ms(v['floor']['median_s'])} ms, "
                      f"{100 * v['floor']['over_compute']:.0f}% of compute-only's samples/s (loss equal to "
                      f"compute-only's within {c['floor_loss_diff']:.1e}); of the floor: {off}")
            bucket_cells = [c for c in floor_cells if "floor_bucket" in c["variants"]]
            if bucket_cells:
                print("bucket floor (measured, one host): the memory floor after each gradient's copy into its bucket, "
                      "which rumor's DDP makes once a step (zero_grad(set_to_none=True) lets autograd put each new "
                      "gradient outside the shared bucket the peers read; torch's Python-level extension points "
                      "cannot make it write there): the floor of rumor's design")
            for c in bucket_cells:
                v = c["variants"]
                off = ", ".join(f"{VARIANT_LABEL[k]} {100 * v[k]['of_bucket_floor']:.0f}%"
                                for k in v if "of_bucket_floor" in v[k])
                print(f"  {c['model']} {c['n']} ranks: {fmt_ms(v['floor_bucket']['median_s'])} ms, "
                      f"{100 * v['floor_bucket']['over_compute']:.0f}% of compute-only's samples/s; of that floor: {off}")
        print()

        # ---- targets and headline
        targets = result["targets"]

        def target(prefix: str, c: Dict, v: str, goal: float) -> None:
            d = c["variants"][v]
            targets.append(dict(name=f"{prefix} {VARIANT_LABEL[v]}/torch >= {goal}", value=d["over_torch"],
                                met=d["over_torch"] >= goal, ceiling=d["ceiling_over_torch"]))

        for c in result["cells"]:
            if "rumor" in c["variants"]:
                target(f"{c['job']}: {c['model']}", c, "rumor", 1.0)
            if hosts_mode:  # the algorithm issues' targets, on the emulated cluster
                for v, goal in ALGORITHM_TARGETS.items():
                    if v in c["variants"]:
                        target(f"{c['job']}: {c['model']}", c, v, goal)
        headline = None
        if hosts_mode:
            for c in (c for c in result["cells"] if "rumor" in c["variants"]):
                target(f"{c['job']}: {c['model']}", c, "rumor", 1.1)
            c = next((c for c in result["cells"] if c["model"] == "mlp25m"),
                     result["cells"][0] if result["cells"] else None)
            if c:
                headline = (f"headline: {c['model']} {args.hosts} emulated hosts x {args.ranks_per_host} @{args.rate}"
                            f"{_common.wan_label(args)}: "
                            f"{VARIANT_LABEL[c['main_variant']]}/torch DDP = {c['rumor_over_torch']:.2f}x samples/s "
                            f"(at {100 * c['rumor_over_compute']:.0f}% of compute-only)")
        else:
            nmax = max(worlds)
            for c in result["cells"]:
                if c["model"] == "mlp25m" and c["n"] == 4 and "rumor" in c["variants"]:
                    target("mlp25m 4 ranks one host:", c, "rumor", 1.5)
                if c["model"] == "mlp25m" and c["n"] == 4 and "rumor_overlap" in c["variants"]:
                    # Issue 14's target. Its update runs once per host (docs/optimizer.md), where
                    # compute-only runs it on every rank: it may pass the "ceiling".
                    target("mlp25m 4 ranks one host:", c, "rumor_overlap", 1.6)
            c = next((c for c in result["cells"] if c["model"] == "mlp25m" and c["n"] == nmax), None) \
                or next((c for c in result["cells"] if c["n"] == nmax), None)
            if c:
                headline = (f"headline: {c['model']} {c['n']} ranks one host: rumor/torch DDP = "
                            f"{c['rumor_over_torch']:.2f}x samples/s (rumor at {100 * c['rumor_over_compute']:.0f}% "
                            f"of compute-only)")
        for c in result["cells"]:
            v = c["variants"]
            if "rumor_timeline" in v and "rumor" in v:
                c["timeline_over_rumor_step"] = v["rumor_timeline"]["median_s"] / v["rumor"]["median_s"]
                print(f"timeline overhead: {c['job']}: {c['model']}: rumor+timeline / rumor median step = "
                      f"{c['timeline_over_rumor_step']:.3f} (target < 1.02; "
                      f"{fmt_ms(v['rumor_timeline']['median_s'])} vs {fmt_ms(v['rumor']['median_s'])} ms)")
        for c in result["cells"]:
            if "rumor_hier_over_torch" in c:
                print(f"{c['job']}: {c['model']} rumor hierarchical/torch = {c['rumor_hier_over_torch']:.2f}x")
        for t in targets:
            print(f"target: {t['name']}: {t['value']:.2f}x -> {'MET' if t['met'] else 'NOT MET'} "
                  f"(ceiling in this run {t['ceiling']:.2f}x)")
        draw = None if args.no_plot else (
            lambda: plot(png_path, [dict(label=j.label, cells=j.cells) for j in jobs]))
        _common.write_results(result, headline, "headline: n/a (no results)", json_path, png_path, draw)
        return rc

    return drv.run(body)


if __name__ == "__main__":
    sys.exit(main())
