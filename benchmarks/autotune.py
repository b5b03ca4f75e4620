#!/usr/bin/env python
"""Autotuner benchmark: rumor.DistributedDataParallel with its defaults vs autotune=True vs the
best point of a grid search (docs/autotune.md), per BENCHMARKS.md.

Models (rumor.testing.models, per-rank batch): mlp25m [32], cnn [32], transformer [16].

Modes (as benchmarks/training.py)
  one host (default): --ranks ranks on this machine (default 4).
  --hosts H: H emulated hosts (network namespaces, tbf --rate, default 1gbit), --ranks-per-host each.

How it measures
  Per model every rank builds the same weights for each variant; a step is zero_grad, forward,
  cross-entropy, backward, SGD(momentum 0.9) step, after a gloo barrier; its time is the slowest
  rank's. Variants, one after the other:
    default   DistributedDataParallel(model, optimizer=opt): bucket_cap_mb=25, first_bucket_mb=1,
              bucket_split_gap_ms=5, shared buckets where possible;
    grid:<p>  the same with one point of the grid (--grid: bucket_cap_mb x first_bucket_mb x
              bucket_split_gap_ms) -- "grid best" is the point with the lowest median;
    autotuned DistributedDataParallel(..., autotune=dict(budget_steps=--budget, use_cache=False)):
              the first iteration plus the budget are its tuning steps (timed, the tuning cost), then
              --warmup + --iters steps at the setting it fixed.
    then the comparison: the tuned wrapper, fresh defaults, a second fresh wrapper with the
    defaults (its ratio to the first is the run's noise floor) and the grid's best point (the lowest
    of many noisy medians is biased low: the point chosen is in part the one that happened to be
    measured at a quiet moment) step in turn, one step each, the order rotating, for 2 x --iters
    rounds: a change in the machine's load (this VM's speed drifts by 10-20% within minutes)
    hits all four alike. autotuned / default and autotuned / grid best are their medians there.
  Each variant is measured for --iters steps after --warmup steps. Reported: median step per
  variant, autotuned / grid best and autotuned / default (targets: <= 1.05 and <= 1.00), the
  tuning cost = sum over the tuning steps of (step - autotuned median), also as a share of a
  10,000-step run, and the setting the tuner chose.

Output: a table per job, JSON and PNG in --out (default benchmarks/results/), headline last.

  python benchmarks/autotune.py                               # one host, 4 ranks, all models
  python benchmarks/autotune.py --models mlp25m --iters 3 --warmup 1 --budget 10 --grid small   # smoke
  sudo python benchmarks/autotune.py --hosts 4                # 4 emulated hosts x 1 rank, 1 Gbit
  sudo python benchmarks/autotune.py --hosts 2 --ranks-per-host 2
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import _common
from _common import Progress, emit

MODELS = ("mlp25m", "cnn", "transformer")
GRIDS = {
    "full": dict(bucket_cap_mb=(2, 10, 25, 100), first_bucket_mb=(0.25, 1, 4), bucket_split_gap_ms=(1, 5, float("inf"))),
    "small": dict(bucket_cap_mb=(5, 50), first_bucket_mb=(1,), bucket_split_gap_ms=(5,)),
}
TARGET_VS_GRID = 1.05
TARGET_VS_DEFAULT = 1.0
LONG_RUN = 10_000


def _grid(name: str) -> List[Dict]:
    g = GRIDS[name]
    return [dict(zip(g, vals)) for vals in itertools.product(*g.values())]


def _label(point: Dict) -> str:
    def f(v):
        return "inf" if v == float("inf") else f"{v:g}"
    return "cap{} first{} gap{}".format(*(f(point[k]) for k in ("bucket_cap_mb", "first_bucket_mb",
                                                                  "bucket_split_gap_ms")))


# ==== inside a rank ==================================================================================

def _describe(rank: int, n: int) -> Dict:
    import rumor

    return dict(rank=rank, size=n, local_size=rumor.local_size(), machine_size=rumor.machine_size(),
                netns=os.readlink("/proc/self/ns/net"))


def _train(cfg: Dict, rank: int, n: int) -> None:
    for name in cfg["models"]:
        _run_model(cfg, name, rank, n)


def _run_model(cfg: Dict, name: str, rank: int, n: int) -> None:
    import gc

    import torch
    import torch.distributed as dist

    import rumor
    from rumor import autotune
    from rumor.testing import models

    batch = cfg["batch"].get(name) or models.BATCH[name]
    data = [models.batch(name, batch, step=i, shard=rank, seed=cfg["seed"]) for i in range(4)]
    times: Dict[str, List[float]] = {}
    extra: Dict[str, Dict] = {}

    def make(kwargs):
        model = models.build(name, seed=cfg["seed"])
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        return rumor.DistributedDataParallel(model, optimizer=opt, **kwargs), opt

    def run(ddp, opt, steps, out=None, counter=[0]):
        for _ in range(steps):
            x, y = data[counter[0] % len(data)]
            counter[0] += 1
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            models.loss(ddp(x), y).backward()
            opt.step()
            if out is not None:
                out.append(time.perf_counter() - t0)

    def measure(variants):
        for v, kw in variants:
            ddp, opt = make(kw)
            run(ddp, opt, cfg["warmup"])
            times[v] = []
            run(ddp, opt, cfg["iters"], times[v])
            if rank == 0:
                emit("progress", {"model": name, "what": f"{v}: {statistics.median(times[v]) * 1e3:.0f} ms/step"})
            del ddp, opt
            gc.collect()

    variants = [("default", {})] + [(f"grid:{_label(p)}", p) for p in cfg["grid"]]
    measure(variants)
    # The grid's best point, the same on every rank: the median of the slowest rank's steps.
    grid_kw = dict(variants)
    slowest = {}
    for v in times:
        t = torch.tensor(times[v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[v] = statistics.median(t.tolist())
    best_point = min((v for v in slowest if v.startswith("grid:")), key=slowest.get, default=None)
    ddp, opt = make(dict(autotune=dict(budget_steps=cfg["budget"], use_cache=False, verbose=False, seed=cfg["seed"])))
    times["tuning"] = []
    t0 = time.perf_counter()
    guard = 0
    while not autotune.status(ddp)["done"]:
        run(ddp, opt, 1, times["tuning"])
        guard += 1
        assert guard <= cfg["budget"] + 2, "autotune ran past its budget"
    # the forward that applied the final setting was a tuning step too (its step runs the new setting)
    tuning_wall = time.perf_counter() - t0
    run(ddp, opt, cfg["warmup"])
    # The comparison: the tuned wrapper, fresh defaults and the grid's best point, one step each
    # in turn (the order rotating), so that a change in the machine's load hits all three alike.
    # A second fresh wrapper with the defaults measures the run's noise floor: two wrappers of one
    # setting, measured side by side.
    final = [("autotuned", ddp, opt), ("default again", *make({})), ("default twin", *make({}))]
    if best_point:
        final.append(("grid best again", *make(grid_kw[best_point])))
    for v, d, o in final[1:]:
        run(d, o, cfg["warmup"])
    for v, _, _ in final:
        times[v] = []
    for i in range(2 * cfg["iters"]):
        k = i % len(final)
        for v, d, o in final[k:] + final[:k]:
            run(d, o, 1, times[v])
    st = autotune.status(ddp)
    extra["autotuned"] = dict(setting=st["best"]["setting"], trials=st["best"]["trials"],
                              tuner_step_s=st["best"]["step_s"], tuner_default_step_s=st["best"]["default_step_s"],
                              tuning_steps=len(times["tuning"]), tuning_wall_s=tuning_wall,
                              kwargs=autotune.ddp_kwargs(st["best"]["setting"]),
                              history=[dict(step=h["step"], kind=h["kind"], setting=h["setting"],
                                            score_s=h.get("score_s")) for h in st["history"]])
    if rank == 0:
        emit("progress", {"model": name, "what": f"autotuned: {statistics.median(times['autotuned']) * 1e3:.0f} ms/step"})
    nparams = sum(p.numel() for p in ddp.module.parameters())
    del ddp, opt, final
    gc.collect()
    extra["autotuned"]["grid_best_point"] = best_point
    extra["autotuned"]["interleaved"] = True
    # tuning has a different number of steps than the measured variants: gather it separately
    tuning = times.pop("tuning")
    per_rank = _common.gather_samples(times)
    per_rank_tuning = _common.gather_samples({"tuning": tuning})["tuning"]
    if rank == 0:
        cell = dict(model=name, n=n, batch=batch, global_batch=batch * n,
                    params=nparams, variants={}, autotune=extra["autotuned"])
        for v in times:
            steps = [max(per_rank[v][r][i] for r in range(n)) for i in range(len(times[v]))]
            cell["variants"][v] = dict(step_s=steps, median_s=statistics.median(steps))
        cell["autotune"]["tuning_step_s"] = [max(per_rank_tuning[r][i] for r in range(n))
                                             for i in range(len(tuning))]
        emit("cell", cell)
    del data
    gc.collect()


# ==== the driver =====================================================================================

class Job(_common.Job):
    def config(self) -> Dict:
        a = self.args
        return dict(models=a.models, batch=a.batch_map, iters=a.iters, warmup=a.warmup, lr=a.lr, seed=a.seed,
                    budget=a.budget, grid=_grid(a.grid))

    def on_message(self, kind: str, data) -> None:
        if kind == "progress":
            self.progress.update(None, f"{self.label}: {data['model']} {data['what']}", force=True)
        elif kind == "cell":
            self.progress.update(self.progress.done + 1, f"{self.label}: {data['model']} done", force=True)


def summarize(cell: Dict) -> None:
    v = cell["variants"]
    grid = {k: d for k, d in v.items() if k.startswith("grid:")}
    best = min(grid, key=lambda k: grid[k]["median_s"]) if grid else None
    auto = v["autotuned"]["median_s"]
    cell["grid_best"] = best
    # The chosen point's fresh re-run and the mean of the defaults' two blocks (see the docstring);
    # results saved before the re-runs existed fall back to the first pass.
    cell["grid_best_s"] = v["grid best again"]["median_s"] if "grid best again" in v else (
        grid[best]["median_s"] if best else None)
    # Interleaved runs (the tuned wrapper, the defaults and the grid's best point a step each in
    # turn) compare with the defaults measured beside it; older results with the mean of the
    # defaults' two blocks.
    if cell["autotune"].get("interleaved"):
        cell["default_s"] = v["default again"]["median_s"]
        if "default twin" in v:
            cell["twin_over_default"] = v["default twin"]["median_s"] / cell["default_s"]
    else:
        cell["default_s"] = statistics.fmean([v[k]["median_s"] for k in ("default", "default again") if k in v])
    cell["auto_over_default"] = auto / cell["default_s"]
    cell["auto_over_grid_best"] = auto / cell["grid_best_s"] if best else None
    tuning = cell["autotune"]["tuning_step_s"]
    cost = sum(max(0.0, t - auto) for t in tuning)
    cell["tuning_cost_s"] = cost
    cell["tuning_cost_share_of_long_run"] = cost / (cost + LONG_RUN * auto)


def _kept_defaults(cell: Dict) -> bool:
    """Whether the tuner ended on the setting of its first trial (the defaults)."""
    hist = cell["autotune"].get("history") or []
    return bool(hist) and hist[0]["setting"] == cell["autotune"]["setting"]


def print_table(cells: List[Dict], title: str) -> None:
    if not cells:
        return
    print(f"\n{title}   (median step of the slowest rank, ms; default, autotuned and grid best measured a step "
          f"each in turn after tuning; grid best: the point with the lowest median in the grid's pass (that median in "
          f"brackets); tuning cost = extra seconds the tuning steps took over the autotuned step, and its share of a "
          f"{LONG_RUN}-step run)")
    head = (f"{'model':<12} {'default':>8} {'autotuned':>9} {'grid best':>17} {'auto/grid':>9} {'auto/def':>8} "
            f"{'tune steps':>10} {'cost s':>7} {'cost %':>7}  grid best point | autotuned setting")
    print(head)
    print("-" * len(head))
    for c in cells:
        v = c["variants"]
        g = c["grid_best"]
        first = f"[{v[g]['median_s'] * 1e3:.1f}]" if g else ""
        print(f"{c['model']:<12} {c['default_s'] * 1e3:>8.1f} {v['autotuned']['median_s'] * 1e3:>9.1f} "
              f"{(c['grid_best_s'] * 1e3 if g else float('nan')):>8.1f} {first:>8} "
              f"{(c['auto_over_grid_best'] or float('nan')):>8.2f}x {c['auto_over_default']:>7.2f}x "
              f"{c['autotune']['tuning_steps']:>10} {c['tuning_cost_s']:>7.2f} "
              f"{100 * c['tuning_cost_share_of_long_run']:>6.2f}%  {(g or '-')[5:]} | {c['autotune']['kwargs']}")


def plot(path: str, jobs: List[Dict]) -> Optional[str]:
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    jobs = [j for j in jobs if j["cells"]]
    fig, axes = plt.subplots(1, len(jobs), figsize=(5.5 * len(jobs), 4.0), squeeze=False)
    for ax, job in zip(axes[0], jobs):
        cells = job["cells"]
        bars = [("default", "#ff7f0e"), ("grid best", "#2ca02c"), ("autotuned", "#1f77b4")]
        def shown_ms(c, label):  # what the table compares: see summarize()
            t = {"default": c["default_s"], "grid best": c["grid_best_s"],
                 "autotuned": c["variants"]["autotuned"]["median_s"]}[label]
            return 0.0 if t is None else t * 1e3

        for k, (label, color) in enumerate(bars):
            ys = [shown_ms(c, label) for c in cells]
            xs = [i + (k - 1) * 0.27 for i in range(len(cells))]
            ax.bar(xs, ys, 0.27, label=label, color=color)
        tops = []
        for i, c in enumerate(cells):
            top = max(shown_ms(c, label) for label, _ in bars)
            tops.append(top)
            ax.text(i, top * 1.02, f"auto/grid {c['auto_over_grid_best'] or 0:.2f}x\nauto/def {c['auto_over_default']:.2f}x",
                    ha="center", fontsize=7)
        ax.set_ylim(0, max(tops) * 1.25)
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels([c["model"] for c in cells])
        ax.set_ylabel("median step (ms, slowest rank)")
        ax.set_title(job["label"], fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("rumor autotune: defaults vs autotuned vs the grid's best point", fontsize=9)
    _common.save_figure(plt, fig, path)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="rumor autotune vs defaults vs grid search (see the docstring)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common.add_world_args(ap)
    ap.set_defaults(ranks="4")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", default="", help="per-rank batch overrides, e.g. mlp25m=16,cnn=8")
    ap.add_argument("--iters", type=int, default=10, help="measured steps per variant (protocol: >= 10)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget", type=int, default=80, help="the autotuner's budget_steps")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="full")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    _common.add_run_args(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return _common.worker_main(args.worker, _describe, _train)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        ap.error(f"unknown models {bad}; choose from {MODELS}")
    args.batch_map = {}
    for kv in filter(None, args.batch.split(",")):
        k, _, v = kv.partition("=")
        args.batch_map[k.strip()] = int(v)
    if args.iters < 10:
        print(f"WARNING: --iters {args.iters} is below the protocol's minimum of 10; smoke test only", file=sys.stderr)
    hosts_mode = args.hosts > 0
    worlds = _common.world_sizes(ap, args)
    os.makedirs(args.out, exist_ok=True)
    tag = (f"{args.hosts}hosts" + (f"x{args.ranks_per_host}" if args.ranks_per_host > 1 else "")) if hosts_mode else "1host"
    if args.tag:
        tag += "-" + args.tag
    json_path = os.path.join(args.out, f"autotune-{tag}.json")
    png_path = os.path.join(args.out, f"autotune-{tag}.png")
    meta = _common.run_meta(args)
    meta.update(worlds=worlds, grid=GRIDS[args.grid],
                step="zero_grad + forward + cross-entropy + backward + SGD(momentum 0.9) step; after a gloo barrier; "
                     "the slowest rank's time")
    result = dict(meta=meta, jobs=[], cells=[], targets=[], errors=[])
    print(f"rumor {meta['rumor']} autotune benchmark | {meta['hostname']}, {meta['cpus']} cpus, load "
          f"{meta['loadavg_start'][0]:.2f} | models {','.join(args.models)} | iters {args.iters}, warmup {args.warmup}, "
          f"budget {args.budget}, grid {args.grid} ({len(_grid(args.grid))} points)")
    progress = Progress(len(worlds) * len(args.models), unit="models", quiet_s=10)
    drv = _common.Driver("rumor-autotune-bench-", progress, hosts_mode)

    def body() -> int:
        if hosts_mode:
            tcp = drv.start_cluster(args.hosts, args.rate)
            if tcp is None:
                return 2
            result["tcp_single_stream_Bps"] = tcp
            print(f"emulated hosts: {args.hosts} x {args.ranks_per_host} rank(s), tbf {args.rate}; one TCP stream: "
                  f"{tcp / 1e6:.1f} MB/s")
        jobs = [Job(os.path.abspath(__file__), args, n, drv.workdir, progress, 0, cluster=drv.cluster) for n in worlds]
        rc = _common.run_jobs(jobs, result, progress)
        drv.close_cluster()
        progress.clear()
        for c in result["cells"]:
            summarize(c)
        _common.finish_meta(meta)
        for job in jobs:
            print_table(job.cells, job.label)
        print()
        for c in result["cells"]:
            for name, value, goal in ((f"{c['job']}: {c['model']} autotuned/grid best <= {TARGET_VS_GRID}",
                                       c["auto_over_grid_best"], TARGET_VS_GRID),
                                      (f"{c['job']}: {c['model']} autotuned/default <= {TARGET_VS_DEFAULT}",
                                       c["auto_over_default"], TARGET_VS_DEFAULT)):
                if value is None:
                    continue
                result["targets"].append(dict(name=name, value=value, met=value <= goal))
                print(f"target: {name}: {value:.3f} -> {'MET' if value <= goal else 'NOT MET'}")
            twin = c.get("twin_over_default")
            if twin is not None:
                # Two wrappers of the default setting differ by this much in the same rotation: a
                # lead or lag of the autotuned run within it is noise, not the tuner.
                noise = abs(twin - 1.0)
                within = c["auto_over_default"] <= TARGET_VS_DEFAULT + noise
                print(f"  noise floor: the defaults' twin wrapper measured {twin:.3f}x the defaults in the same rotation;"
                      f" autotuned/default {c['auto_over_default']:.3f} is "
                      f"{'within' if within else 'beyond'} 1 + that noise ({TARGET_VS_DEFAULT + noise:.3f})"
                      + ("; the tuner kept the defaults' setting" if _kept_defaults(c) else ""))
        headline = None
        if result["cells"]:
            c = next((c for c in result["cells"] if c["model"] == "mlp25m"), result["cells"][0])
            headline = (f"headline: {c['model']} {c['job']}: autotuned/default = {c['auto_over_default']:.2f}x step, "
                        f"autotuned/grid best = {(c['auto_over_grid_best'] or float('nan')):.2f}x, tuning cost "
                        f"{c['tuning_cost_s']:.1f} s ({100 * c['tuning_cost_share_of_long_run']:.2f}% of a "
                        f"{LONG_RUN}-step run)")
        draw = None if args.no_plot else (lambda: plot(png_path, [dict(label=j.label, cells=j.cells) for j in jobs]))
        _common.write_results(result, headline, "headline: n/a (no results)", json_path, png_path, draw)
        return rc

    return drv.run(body)


if __name__ == "__main__":
    sys.exit(main())
