#!/usr/bin/env python
"""Straggler benchmark: asynchronous model averaging vs synchronous training, per BENCHMARKS.md.

Variants (each its own fresh model, same seed, same data, same optimizer):
  torch    torch.nn.parallel.DistributedDataParallel over gloo (its defaults)
  gar      rumor GradientAllReduce()
  dec_exp2 rumor Decentralized(peer_selection="exp2", hierarchical=False)
  ama      rumor AsyncModelAverage("all", sync_interval_ms=--sync-interval-ms, warmup_steps=--warmup,
           max_busy_fraction=--max-busy-fraction when given)
  ama_exp2 rumor AsyncModelAverage("exp2"): gossip over one-sided windows (the same interval)
  push_sum rumor.optim.DistributedPushSumOptimizer over the default ExponentialGraph
  ama_ring, ama_shift_one: the other gossip modes, only with --variants.

Cases (BENCHMARKS.md "straggler case"):
  none       every rank at full speed;
  straggler  the last rank slowed to half speed: after each step it sleeps for its own compute
             step time, measured at the start of the job (compute-only: the plain model, every
             rank computing at once, median of --compute-steps steps).

How it measures
  Per model and case, the variants run one after the other (the order rotates between
  repeats). Each run: --warmup unmeasured steps (for ama these are its synchronous warm-up
  steps), a barrier, then a window of --window seconds of training. A step is zero_grad,
  forward, cross-entropy, backward, SGD(momentum 0.9) step. Data: one pool of 4 x n synthetic
  batches (random labels: the loss falls as the model memorizes them); rank r's step i takes
  batch (4r + i) mod 4n, so in lockstep the ranks take n different batches per step, and at
  their own pace every rank still cycles through the whole pool (as a sampler reshuffling the
  shards every epoch would; fixed per-rank shards of random labels would let local models
  "learn" what the average cannot, flattering the asynchronous loss). Synchronous variants stop
  together (rank 0's clock, through a one-float gloo allreduce per step); ama ranks stop on
  their own clock and then call finish() (not timed).
    samples/s     = per-rank batch x steps that ended inside the window (all ranks) / window
    time to loss  = first time in the window at which the training loss reaches the target:
                    the mean over ranks of each rank's mean loss over its last 4 steps (one pass
                    over its batches); target = (1 - --target-drop) x the initial loss (the mean
                    loss of the first step over ranks, the same for every variant).
  Reported per variant: samples/s (median over --repeats, and min-max), over torch DDP, time to
  loss and torch's over it, steps per rank, the median step time of the fastest and slowest
  rank, ama's averaging rounds and the share of the window its thread spent in them. Bounds
  from the compute-only steps c (per rank) and the straggler's sleep s: no straggler sum_r B/c_r; straggler, synchronous: n B / max_r(c_r + s_r);
  straggler, asynchronous: sum_r B/(c_r + s_r). With more ranks than cores the ranks share the
  CPUs, so a sleeping straggler leaves its CPU to the others (said in the output).

Targets (issue 6): with one 2x straggler, ama >= 1.5x torch DDP samples/s and time to loss at
least 1.3x shorter; without one, ama no slower than rumor GradientAllReduce (>= 1.0x).

Output: a table per job (progress bar while it runs), the targets with the run's ceiling, JSON
with every raw figure and a PNG in --out (default benchmarks/results/); the last line is the
headline ratio (ama / torch DDP samples/s with the straggler).

  python benchmarks/async_training.py --quick            # 4 ranks, one host, a couple of minutes
  python benchmarks/async_training.py                    # 4 ranks, mlp25m and transformer, full size
  sudo python benchmarks/async_training.py --hosts 4     # 4 emulated hosts x 1 rank, 1 Gbit
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import _common
from _common import Progress, emit

MODELS = ("mlp25m", "transformer")
CASES = ("none", "straggler")
# key: (label, description, in the default set)
VARIANTS = {
    "torch": ("torch DDP", "torch.nn.parallel.DistributedDataParallel, gloo, defaults", True),
    "gar": ("GradAllReduce", "rumor GradientAllReduce()", True),
    "dec_exp2": ("Dec exp2", "rumor Decentralized(peer_selection='exp2', hierarchical=False)", True),
    "ama": ("AsyncAvg all", "rumor AsyncModelAverage('all')", True),
    "ama_exp2": ("AsyncAvg exp2", "rumor AsyncModelAverage('exp2'): gossip over one-sided windows", True),
    "push_sum": ("push-sum", "rumor.optim.DistributedPushSumOptimizer (exponential graph, win_accumulate)", True),
    "ama_ring": ("AsyncAvg ring", "rumor AsyncModelAverage('ring'): gossip over windows", False),
    "ama_shift_one": ("AsyncAvg shift1", "rumor AsyncModelAverage('shift_one'): gossip over windows", False),
}
ASYNC = {"ama", "ama_ring", "ama_shift_one", "ama_exp2", "push_sum"}
# The third field: in the default set (the list); the others run with --variants.
DEFAULT_VARIANTS = [k for k, v in VARIANTS.items() if v[2]]
# target_drop: the time-to-loss target is (1 - drop) x the initial loss; chosen so that torch DDP
# with the straggler gets there within about the window (quick: measured on 2 cores; full: an
# estimate from the quick runs, not yet measured at full size).
QUICK = dict(scale={"mlp25m": 0.5, "transformer": 0.5}, batch={"transformer": 4}, window=6.0, repeats=1, warmup=2,
             compute_steps=4, target_drop={"mlp25m": 0.05, "transformer": 0.015})
FULL = dict(scale={"mlp25m": 1.0, "transformer": 1.0}, batch={}, window=40.0, repeats=3, warmup=3, compute_steps=6,
            target_drop={"mlp25m": 0.10, "transformer": 0.02})
N_BATCHES = 4  # distinct batches per rank, cycled


def label(v: str) -> str:
    return VARIANTS[v][0]


# ==== inside a rank ==================================================================================

def _describe(rank: int, n: int) -> Dict:
    import torch

    import rumor

    return dict(rank=rank, size=n, local_size=rumor.local_size(), machine_size=rumor.machine_size(),
                torch_threads=torch.get_num_threads(), netns=os.readlink("/proc/self/ns/net"), cpus=os.cpu_count())


def _wrap(v: str, model, opt, cfg):
    import rumor
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    A = rumor.algorithms
    if v == "torch":
        return TorchDDP(model), None
    if v == "gar":
        alg = A.GradientAllReduce()
    elif v == "dec_exp2":
        alg = A.Decentralized(peer_selection="exp2", hierarchical=False)
    elif v.startswith("ama"):
        mode = "all" if v == "ama" else v[len("ama_"):]
        extra = {} if cfg.get("max_busy_fraction") is None else dict(max_busy_fraction=cfg["max_busy_fraction"])
        alg = A.AsyncModelAverage(mode, sync_interval_ms=cfg["sync_interval_ms"], warmup_steps=cfg["warmup"], **extra)
    elif v == "push_sum":
        # The wrapper is the optimizer; the module itself is trained (same seed: same init).
        return model, rumor.optim.DistributedPushSumOptimizer(opt, model)
    else:
        raise ValueError(f"unknown variant {v}")
    return rumor.DistributedDataParallel(model, optimizer=opt, algorithm=alg), alg


def _train(cfg: Dict, rank: int, n: int) -> None:
    for name in cfg["models"]:
        _run_model(cfg, name, rank, n)


def _run_model(cfg: Dict, name: str, rank: int, n: int) -> None:
    import gc

    import torch
    import torch.distributed as dist

    from rumor.testing import models

    scale = cfg["scale"][name]
    batch = cfg["batch"].get(name) or models.BATCH[name]
    proto = models.build(name, seed=cfg["seed"], scale=scale)
    # One pool of N_BATCHES x n batches; rank r's step i takes batch (r * N_BATCHES + i) mod pool: in
    # step with the others (synchronous variants) the ranks take n different batches per step and
    # cover the pool every N_BATCHES steps; at their own pace (asynchronous) every rank still
    # cycles through the whole pool (as a sampler reshuffling shards every epoch would).
    pool = N_BATCHES * n
    data = [models.batch(proto, batch, step=j, shard=0, seed=cfg["seed"]) for j in range(pool)]
    nparams = models.num_params(proto)
    del proto

    def fresh():
        m = models.build(name, seed=cfg["seed"], scale=scale)
        return m, torch.optim.SGD(m.parameters(), lr=cfg["lr"], momentum=0.9)

    def step(model, opt, i):
        x, y = data[(rank * N_BATCHES + i) % pool]
        opt.zero_grad()
        loss = models.loss(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    # ---- compute-only: the bound, the straggler's sleep and the initial loss
    model, opt = fresh()
    first = step(model, opt, 0)
    comp = []
    for i in range(1, 1 + cfg["compute_steps"]):
        dist.barrier()
        t = time.perf_counter()
        step(model, opt, i)
        comp.append(time.perf_counter() - t)
    del model, opt
    c = torch.tensor([statistics.median(comp), first], dtype=torch.float64)
    every = [torch.empty_like(c) for _ in range(n)]
    dist.all_gather(every, c)
    compute_s = [float(e[0]) for e in every]
    initial_loss = sum(float(e[1]) for e in every) / n
    straggler = n - 1
    sleep_of = {"none": [0.0] * n, "straggler": [compute_s[r] if r == straggler else 0.0 for r in range(n)]}

    total = len(cfg["cases"]) * cfg["repeats"] * len(cfg["variants"])
    done = 0
    for case in cfg["cases"]:
        runs = {v: [] for v in cfg["variants"]}
        for rep in range(cfg["repeats"]):
            k = rep % len(cfg["variants"])
            for v in cfg["variants"][k:] + cfg["variants"][:k]:  # rotate who goes first
                runs[v].append(_window(cfg, v, fresh, step, sleep_of[case][rank], rank, n))
                gc.collect()
                done += 1
                if rank == 0:
                    r0 = runs[v][-1]
                    emit("progress", {"model": name, "done": done, "total": total,
                                      "what": f"{case}: {label(v)} {len(r0['t'])} steps on rank 0"})
        # every rank's records to rank 0
        every = [None] * n
        dist.all_gather_object(every, runs)
        if rank == 0:
            emit("cell", dict(model=name, case=case, n=n, batch=batch, params=nparams, scale=scale,
                              compute_s=compute_s, sleep_s=sleep_of[case], initial_loss=initial_loss,
                              window_s=cfg["window"],
                              runs={v: [[every[r][v][i] for r in range(n)] for i in range(cfg["repeats"])]
                                    for v in cfg["variants"]}))


def _window(cfg: Dict, v: str, fresh, step, sleep_s: float, rank: int, n: int) -> Dict:
    """One run of variant v: warm-up steps, then a window of cfg['window'] seconds. Returns this
    rank's step end times (s from the window start), losses and step durations."""
    import torch
    import torch.distributed as dist

    model, opt = fresh()
    ddp, alg = _wrap(v, model, opt, cfg)
    if v == "push_sum":
        opt = alg
    i = 0
    for _ in range(cfg["warmup"]):
        step(ddp, opt, i)
        i += 1
    window = cfg["window"]
    ends, losses, durs = [], [], []
    flag = torch.zeros(1)
    dist.barrier()
    t0 = time.monotonic()
    while True:
        t = time.monotonic()
        losses.append(step(ddp, opt, i))
        i += 1
        if sleep_s:
            time.sleep(sleep_s)
        now = time.monotonic()
        durs.append(now - t)
        ends.append(now - t0)
        if v in ASYNC:
            if now - t0 >= window:
                break
        else:  # stop together, on rank 0's clock
            flag[0] = 1.0 if (rank == 0 and now - t0 >= window) else 0.0
            dist.all_reduce(flag)
            if flag[0] > 0:
                break
    out = dict(t=[round(x, 5) for x in ends], loss=[round(x, 5) for x in losses], step_s=[round(x, 5) for x in durs])
    if alg is not None and hasattr(alg, "finish"):
        out["rounds"] = alg.rounds
        out["busy_s"] = getattr(alg, "busy_s", None)
        alg.finish()  # waits for every rank; not part of the window
    elif v == "push_sum":
        alg.free_windows()  # waits for this rank's pushes, then a barrier; not part of the window
    del ddp, alg, model, opt
    return out


# ==== the driver =====================================================================================

class Job(_common.Job):
    def __init__(self, args, n: int, workdir: str, progress: Progress, base: int, per_model: int, cluster=None):
        super().__init__(os.path.abspath(__file__), args, n, workdir, progress, base, cluster)
        self.per_model = per_model
        self.model_index = 0

    def config(self) -> Dict:
        a = self.args
        return dict(models=a.models, cases=a.cases, variants=a.variants, scale=a.scale_map, batch=a.batch_map,
                    window=a.window, repeats=a.repeats, warmup=a.warmup, compute_steps=a.compute_steps, lr=a.lr,
                    seed=a.seed, sync_interval_ms=a.sync_interval_ms, max_busy_fraction=a.max_busy_fraction)

    def on_message(self, kind: str, data) -> None:
        if kind == "progress":
            self.progress.update(self.base + self.model_index * self.per_model + data["done"],
                                 f"{self.label}: {data['model']} {data['what']}")
        elif kind == "cell" and data["case"] == self.args.cases[-1]:
            self.model_index += 1


def smoothed_curve(ranks: List[Dict], k: int = N_BATCHES):
    """[(t, L(t))] at every step end: L = mean over ranks of each rank's mean loss over its last
    k steps (ranks without a step yet are left out)."""
    events = sorted((t, r, i) for r, d in enumerate(ranks) for i, t in enumerate(d["t"]))
    cur: Dict[int, float] = {}
    out = []
    for t, r, i in events:
        ls = ranks[r]["loss"][max(0, i - k + 1):i + 1]
        cur[r] = sum(ls) / len(ls)
        if len(cur) == len(ranks):
            out.append((t, sum(cur.values()) / len(cur)))
    return out


def summarize(cell: Dict) -> None:
    n, B, W = cell["n"], cell["batch"], cell["window_s"]
    target = (1 - cell["target_drop"]) * cell["initial_loss"]
    cell["target_loss"] = target
    c, s = cell["compute_s"], cell["sleep_s"]
    cell["bound_sync_sps"] = n * B / max(ci + si for ci, si in zip(c, s))
    cell["bound_async_sps"] = sum(B / (ci + si) for ci, si in zip(c, s))
    cell["variants"] = {}
    for v, reps in cell["runs"].items():
        sps, ttl, final = [], [], []
        for ranks in reps:
            inside = sum(1 for d in ranks for t in d["t"] if t <= W)
            sps.append(B * inside / W)
            curve = smoothed_curve(ranks)
            hit = next((t for t, L in curve if L <= target), None)
            ttl.append(hit)
            final.append(curve[-1][1] if curve else None)
        ranks0 = reps[0]
        med_steps = [statistics.median(d["step_s"]) for d in ranks0]
        d = dict(samples_per_s=statistics.median(sps), samples_per_s_min=min(sps), samples_per_s_max=max(sps),
                 samples_per_s_all=sps, time_to_loss_s_all=ttl,
                 time_to_loss_s=(statistics.median(ttl) if all(x is not None for x in ttl) else None),
                 final_loss=statistics.median(x for x in final if x is not None) if any(final) else None,
                 steps_per_rank=[len(x["t"]) for x in ranks0], fastest_step_s=min(med_steps),
                 slowest_step_s=max(med_steps), rounds=[x.get("rounds") for x in ranks0],
                 busy_s=[x.get("busy_s") for x in ranks0])
        cell["variants"][v] = d
    t = cell["variants"].get("torch")
    for v, d in cell["variants"].items():
        d["over_torch"] = d["samples_per_s"] / t["samples_per_s"] if t else None
        # torch's time to loss over this variant's; where only this variant got there, the
        # window over its time is a lower bound (torch would have needed longer than the window).
        d["ttl_lower_bound"] = False
        d["ttl_torch_over"] = None
        if t and d["time_to_loss_s"]:
            if t["time_to_loss_s"]:
                d["ttl_torch_over"] = t["time_to_loss_s"] / d["time_to_loss_s"]
            else:
                d["ttl_torch_over"] = W / d["time_to_loss_s"]
                d["ttl_lower_bound"] = True
        bound = cell["bound_async_sps"] if v in ASYNC else cell["bound_sync_sps"]
        d["bound_sps"] = bound
        d["of_bound"] = d["samples_per_s"] / bound


def fmt_t(x: Optional[float], window: float) -> str:
    return f">{window:.0f}" if x is None else f"{x:.1f}"


def print_table(cells: List[Dict], title: str, oversubscribed: bool) -> None:
    if not cells:
        return
    c0 = cells[0]
    print(f"\n{title}   (window {c0['window_s']:.0f} s; samples/s = per-rank batch x steps ended in the window / "
          f"window, median of {len(next(iter(c0['variants'].values()))['samples_per_s_all'])} run(s) [min-max]; "
          f"time to loss: s from the window start, '>' = not reached)")
    head = (f"{'model':<12} {'case':<10} {'variant':<14} {'samples/s':>20} {'x torch':>8} {'of bound':>8} "
            f"{'to loss s':>9} {'torch/it':>8} {'steps/rank':>16} {'step ms fast/slow':>17} {'loss':>7}")
    print(head)
    print("-" * len(head))
    for c in cells:
        for v, d in c["variants"].items():
            sps = f"{d['samples_per_s']:.1f} [{d['samples_per_s_min']:.0f}-{d['samples_per_s_max']:.0f}]"
            xt = f"{d['over_torch']:.2f}x" if d["over_torch"] else "-"
            tt = (f"{'>=' if d['ttl_lower_bound'] else ''}{d['ttl_torch_over']:.2f}x" if d["ttl_torch_over"]
                  else "-")
            steps = ",".join(str(x) for x in d["steps_per_rank"])
            ms = f"{d['fastest_step_s'] * 1e3:.0f}/{d['slowest_step_s'] * 1e3:.0f}"
            loss = f"{d['final_loss']:.3f}" if d["final_loss"] is not None else "-"
            print(f"{c['model']:<12} {c['case']:<10} {label(v):<14} {sps:>20} {xt:>8} {100 * d['of_bound']:>7.0f}% "
                  f"{fmt_t(d['time_to_loss_s'], c['window_s']):>9} {tt:>8} {steps:>16} {ms:>17} {loss:>7}")
        window = c["window_s"]
        for v, d in c["variants"].items():
            if d.get("rounds") and all(r is not None for r in d["rounds"]) and all(b is not None for b in d["busy_s"]):
                print(f"{'':<12} {c['case']:<10} {label(v):<14} averaging rounds per rank "
                      f"{','.join(str(r) for r in d['rounds'])}; thread busy in rounds "
                      f"{','.join(f'{100 * b / window:.0f}%' for b in d['busy_s'])} of the window")
        print(f"{'':<12} {c['case']:<10} {'(bounds)':<14} sync {c['bound_sync_sps']:.1f}, async "
              f"{c['bound_async_sps']:.1f} samples/s; compute step {statistics.median(c['compute_s']) * 1e3:.0f} ms, "
              f"straggler sleep {max(c['sleep_s']) * 1e3:.0f} ms; target loss {c['target_loss']:.3f} "
              f"(initial {c['initial_loss']:.3f})")
    if oversubscribed:
        print("note: more ranks than CPUs on this host: ranks share cores, so a sleeping straggler leaves its CPU "
              "to the others and the averaging thread competes with computation")


def plot(path: str, cells: List[Dict]) -> Optional[str]:
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    models = list(dict.fromkeys(c["model"] for c in cells))
    if not models:
        return "no plot (no results)"
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    colors = {"torch": "#ff7f0e", "gar": "#1f77b4", "dec_exp2": "#2ca02c", "ama": "#d62728", "ama_ring": "#9467bd",
              "ama_shift_one": "#8c564b", "ama_exp2": "#e377c2", "push_sum": "#17becf"}
    for j, m in enumerate(models):
        mc = [c for c in cells if c["model"] == m]
        ax = axes[0][j]
        variants = list(mc[0]["variants"])
        width = 0.8 / len(variants)
        for k, v in enumerate(variants):
            xs = [i + (k - (len(variants) - 1) / 2) * width for i in range(len(mc))]
            ys = [c["variants"][v]["samples_per_s"] for c in mc]
            lo = [y - c["variants"][v]["samples_per_s_min"] for y, c in zip(ys, mc)]
            hi = [c["variants"][v]["samples_per_s_max"] - y for y, c in zip(ys, mc)]
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=label(v), color=colors.get(v))
            for x, c in zip(xs, mc):
                ot = c["variants"][v]["over_torch"]
                if ot:
                    ax.text(x, c["variants"][v]["samples_per_s_max"] * 1.01, f"{ot:.2f}x", ha="center", fontsize=7)
        ax.set_xticks(range(len(mc)))
        ax.set_xticklabels([f"{c['case']}\nbounds {c['bound_sync_sps']:.0f} / {c['bound_async_sps']:.0f}" for c in mc],
                           fontsize=8)
        ax.set_ylabel("samples/s (all ranks)")
        ax.set_title(f"{m}: samples/s (labels: over torch DDP)", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
        ax = axes[1][j]
        sc = next((c for c in mc if c["case"] == "straggler"), mc[-1])
        for v in sc["variants"]:
            curve = smoothed_curve(sc["runs"][v][0])
            if curve:
                ts, ls = zip(*curve)
                ax.plot(ts, ls, label=label(v), color=colors.get(v))
        ax.axhline(sc["target_loss"], color="k", ls="--", lw=0.8, label="target")
        ax.set_xlabel("s from the window start")
        ax.set_ylabel("training loss (mean over ranks of last 4 steps)")
        ax.set_title(f"{m}: loss, case {sc['case']}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.suptitle("asynchronous model averaging vs synchronous training (one 2x straggler)", fontsize=10)
    _common.save_figure(plt, fig, path)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="AsyncModelAverage vs synchronous training with a straggler "
                                             "(see the docstring)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common.add_world_args(ap)
    ap.set_defaults(ranks="4")
    ap.add_argument("--quick", action="store_true",
                    help=f"smaller models and one short window per run (a couple of minutes on 2 cores): {QUICK}")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {CASES}")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma list of {list(VARIANTS)}")
    ap.add_argument("--scale", default="", help="model width scale overrides, e.g. mlp25m=0.5,transformer=1")
    ap.add_argument("--batch", default="", help="per-rank batch overrides, e.g. mlp25m=16")
    ap.add_argument("--window", type=float, default=None, help="seconds of training measured per run")
    ap.add_argument("--repeats", type=int, default=None, help="runs per variant and case (median reported)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps before each window "
                                                              "(ama: its synchronous warm-up steps)")
    ap.add_argument("--compute-steps", type=int, default=None, help="compute-only steps measured per model")
    ap.add_argument("--sync-interval-ms", type=float, default=500.0, help="AsyncModelAverage's sync_interval_ms")
    ap.add_argument("--max-busy-fraction", type=float, default=None,
                    help="AsyncModelAverage's max_busy_fraction (default: the algorithm's; 1 = no bound)")
    ap.add_argument("--target-drop", default="",
                    help="time-to-loss target as a fraction below the initial loss, per model, e.g. mlp25m=0.1 "
                         f"(defaults: quick {QUICK['target_drop']}, full {FULL['target_drop']})")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix for the JSON/PNG file names")
    _common.add_run_args(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return _common.worker_main(args.worker, _describe, _train)

    base = QUICK if args.quick else FULL
    for k in ("window", "repeats", "warmup", "compute_steps"):
        if getattr(args, k) is None:
            setattr(args, k, base[k])

    def kv(s: str, cast) -> Dict:
        out = {}
        for item in filter(None, s.split(",")):
            k, _, v = item.partition("=")
            out[k.strip()] = cast(v)
        return out

    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for what, got, allowed in (("models", args.models, MODELS), ("cases", args.cases, CASES),
                               ("variants", args.variants, VARIANTS)):
        bad = [x for x in got if x not in allowed]
        if bad or not got:
            ap.error(f"unknown {what} {bad}; choose from {list(allowed)}")
    args.scale_map = dict(base["scale"], **kv(args.scale, float))
    args.batch_map = dict(base["batch"], **kv(args.batch, int))
    drops = dict(base["target_drop"], **kv(args.target_drop, float))
    hosts_mode = args.hosts > 0
    worlds = _common.world_sizes(ap, args)
    os.makedirs(args.out, exist_ok=True)
    tag = (f"{args.hosts}hosts" + (f"x{args.ranks_per_host}" if args.ranks_per_host > 1 else "")) if hosts_mode \
        else "1host"
    if args.quick:
        tag += "-quick"
    if args.tag:
        tag += "-" + args.tag
    json_path = os.path.join(args.out, f"async_training-{tag}.json")
    png_path = os.path.join(args.out, f"async_training-{tag}.png")

    meta = _common.run_meta(args)
    meta.update(worlds=worlds, variants={v: VARIANTS[v][1] for v in args.variants},
                step="zero_grad + forward + cross-entropy + backward + SGD(lr, momentum 0.9) step; rank r's step i "
                     "takes batch (4r + i) mod 4n of a pool of 4n; straggler: + sleep of its compute step",
                samples_per_s="per-rank batch x steps ended within the window, all ranks, / window",
                time_to_loss="first time the mean over ranks of each rank's last-4-step mean loss <= target; "
                             "target = (1 - drop) x initial loss",
                target_drop=drops)
    result = dict(meta=meta, jobs=[], cells=[], targets=[], errors=[])
    print(f"rumor {meta['rumor']} vs torch {meta['torch']} | {meta['hostname']}, {meta['cpus']} cpus, load "
          f"{meta['loadavg_start'][0]:.2f} | models {','.join(args.models)} (scale "
          f"{','.join(f'{m}={args.scale_map[m]:g}' for m in args.models)}) | cases {','.join(args.cases)} | window "
          f"{args.window:.0f} s x {args.repeats} | sync_interval_ms {args.sync_interval_ms:g}"
          + ("" if args.max_busy_fraction is None else f" | max_busy_fraction {args.max_busy_fraction:g}")
          + (" | QUICK" if args.quick else ""))

    per_model = len(args.cases) * args.repeats * len(args.variants)
    progress = Progress(len(worlds) * len(args.models) * per_model, unit="runs", quiet_s=10)
    drv = _common.Driver("rumor-async-bench-", progress, hosts_mode)

    def body() -> int:
        if hosts_mode:
            tcp = drv.start_cluster(args.hosts, args.rate)
            if tcp is None:
                return 2
            print(f"emulated hosts: {args.hosts} x {args.ranks_per_host} rank(s), tbf {args.rate}; one TCP stream "
                  f"through a shaped link: {tcp / 1e6:.1f} MB/s")
        jobs = [Job(args, n, drv.workdir, progress, k * len(args.models) * per_model, per_model, cluster=drv.cluster)
                for k, n in enumerate(worlds)]
        rc = _common.run_jobs(jobs, result, progress)
        drv.close_cluster()
        progress.clear()
        for c in result["cells"]:
            c["target_drop"] = drops[c["model"]]
            summarize(c)
        _common.finish_meta(meta)
        for job in jobs:
            over = job.n > (os.cpu_count() or 1)  # emulated hosts share this machine's CPUs too
            print_table(job.cells, job.label, over)
        print()

        targets = result["targets"]

        def target(name: str, value: Optional[float], goal: float, ceiling: Optional[float],
                   lower_bound: bool = False) -> None:
            targets.append(dict(name=name, value=value, goal=goal, met=value is not None and value >= goal,
                                ceiling=ceiling, lower_bound=lower_bound))

        headline = None
        for c in result["cells"]:
            v = c["variants"]
            if "ama" not in v:
                continue
            where = f"{c['job']}: {c['model']} {c['case']}"
            if c["case"] == "straggler" and "torch" in v:
                ceil = c["bound_async_sps"] / v["torch"]["samples_per_s"]
                target(f"{where}: AsyncAvg/torch DDP samples/s >= 1.5", v["ama"]["over_torch"], 1.5, ceil)
                target(f"{where}: torch DDP/AsyncAvg time to loss >= 1.3", v["ama"]["ttl_torch_over"], 1.3, None,
                       lower_bound=v["ama"]["ttl_lower_bound"])
                if headline is None or c["model"] == "mlp25m":
                    headline = (f"headline: {c['model']} {c['job']}, one 2x straggler: AsyncModelAverage/torch DDP = "
                                f"{v['ama']['over_torch']:.2f}x samples/s (time to loss "
                                + (f"{'>=' if v['ama']['ttl_lower_bound'] else ''}{v['ama']['ttl_torch_over']:.2f}x "
                                   "shorter)" if v["ama"]["ttl_torch_over"]
                                   else f"{fmt_t(v['ama']['time_to_loss_s'], c['window_s'])} s vs torch "
                                        f"{fmt_t(v['torch']['time_to_loss_s'], c['window_s'])} s)"))
            if c["case"] == "none" and "gar" in v:
                r = v["ama"]["samples_per_s"] / v["gar"]["samples_per_s"]
                ceil = c["bound_async_sps"] / v["gar"]["samples_per_s"]
                target(f"{where}: AsyncAvg/GradAllReduce samples/s >= 1.0", r, 1.0, ceil)
        for t in targets:
            val = ("n/a (AsyncAvg did not reach the target loss in the window)" if t["value"] is None
                   else f"{'>=' if t['lower_bound'] else ''}{t['value']:.2f}x"
                   + (" (torch DDP did not reach it in the window: window / AsyncAvg's time)" if t["lower_bound"] else ""))
            ceil = f" (ceiling in this run {t['ceiling']:.2f}x)" if t["ceiling"] else ""
            print(f"target: {t['name']}: {val} -> {'MET' if t['met'] else 'NOT MET'}{ceil}")
        if args.quick:
            print("(quick mode: smaller models and one short window per run; a smoke test, not the protocol's figures)")
        draw = None if args.no_plot else (lambda: plot(png_path, result["cells"]))
        _common.write_results(result, headline, "headline: n/a (no straggler results)", json_path, png_path, draw)
        return rc

    return drv.run(body)


if __name__ == "__main__":
    sys.exit(main())
