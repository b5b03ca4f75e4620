#!/usr/bin/env python
"""PowerSGD benchmark: rumor.algorithms.PowerSGD vs torch DDP with torch's own powerSGD_hook (gloo),
per BENCHMARKS.md, on emulated hosts (network namespaces, rumor.testing.netns; needs root).

Models (rumor.testing.models, per-rank batch): mlp25m [32], transformer [16].

What runs
  --hosts H emulated hosts (default 4) x 1 rank, each host's link shaped with tbf at every rate
  of --rates (default 1gbit,100mbit; one cluster per rate, torn down after it). Per model every
  rank builds the same weights once per variant:
    compute     the plain model, no communication (the bound of any overlap);
    rumor rK    rumor.DistributedDataParallel(model, algorithm=PowerSGD(matrix_approximation_rank=K,
                start_powerSGD_iter=--start)), for every K of --psgd-ranks (default 1,4);
    torch rK    torch.nn.parallel.DistributedDataParallel(model) + register_comm_hook(
                PowerSGDState(matrix_approximation_rank=K, start_powerSGD_iter=--start), powerSGD_hook),
                with one bucket (bucket_cap_mb=4096). torch's hook cannot run several buckets on
                gloo: its callbacks issue the P and Q allreduces and wait for them on gloo's worker
                threads, so with gloo's default 2 threads two buckets in that phase deadlock, and
                with more threads the ranks issue the buckets' collectives in different orders and
                gloo pairs mismatched messages ("Received data size doesn't match expected size");
                both seen with 4 ranks on mlp25m (5 buckets). One bucket is the configuration in
                which torch's hook works here; it cannot overlap communication with backward;
    torch DDP   (with --torch-ddp) plain torch DDP: uncompressed.
  Both PowerSGD implementations use the same defaults (error feedback, warm start, min
  compression rate 2, seed 0). --warmup unmeasured steps (default --start + 2: both compress from
  the first measured step on), then --iters measured steps per variant in blocks of --block,
  rotating which variant goes first. A step is zero_grad, forward, cross-entropy, backward,
  SGD(momentum 0.9) step on the same synthetic batches for every variant; it starts after a gloo
  barrier and its time is the slowest rank's.

Reported per (rate, model): median [min-max] step and samples/s per variant; rumor rK / torch rK
(the issue's target: >= 1.5x) with the mean loss over ranks after the same number of steps for
both (the loss of the last measured step: equal steps, same data); and the link bound of PowerSGD
at rank K: the elements one step sends (uncompressed tensors + P + Q, counted by
PowerSGD.compression_stats()) through a ring allreduce at link rate, 2(n-1)/n x 4 bytes each,
and max(compute, that) as the best step any overlap could reach ("rumor/bound": rumor's samples/s
over that bound's).

Output: the tables, JSON with every raw figure and a PNG in --out (default benchmarks/results/);
the last line is the headline.

  sudo python benchmarks/powersgd.py                                    # the full run (lead)
  sudo python benchmarks/powersgd.py --rates 1gbit --models mlp25m --iters 3 --warmup 3   # smoke
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import _common
from _common import Progress, emit, parse_rate

MODELS = ("mlp25m", "transformer")
TARGET = 1.5
TORCH_ONE_BUCKET_MB = 4096


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.0f}" if s >= 0.1 else f"{s * 1e3:.1f}"


# ==== inside a rank ==================================================================================

def _describe(rank: int, n: int) -> Dict:
    import torch

    import rumor

    return dict(rank=rank, size=n, local_size=rumor.local_size(), torch_threads=torch.get_num_threads(),
                netns=os.readlink("/proc/self/ns/net"))


def _train(cfg: Dict, rank: int, n: int) -> None:
    for name in cfg["models"]:
        _run_model(cfg, name, rank, n)


def _run_model(cfg: Dict, name: str, rank: int, n: int) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import rumor
    from rumor.testing import models

    batch = cfg["batch"].get(name) or models.BATCH[name]
    variants: Dict[str, tuple] = {}
    stats: Dict[str, list] = {}

    def add(v, wrap):
        model = models.build(name, seed=cfg["seed"], scale=cfg["scale"])
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        variants[v] = (wrap(model), opt)

    add("compute", lambda m: m)
    for k in cfg["psgd_ranks"]:
        def rumor_wrap(m, k=k):
            algo = rumor.algorithms.PowerSGD(matrix_approximation_rank=k, start_powerSGD_iter=cfg["start"])
            ddp = rumor.DistributedDataParallel(m, algorithm=algo)
            stats[f"rumor_r{k}"] = algo
            return ddp

        def torch_wrap(m, k=k):
            # One bucket: see the module docstring (torch's hook cannot run several on gloo).
            ddp = TorchDDP(m, bucket_cap_mb=TORCH_ONE_BUCKET_MB)
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=k,
                                       start_powerSGD_iter=cfg["start"])
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
            return ddp

        add(f"rumor_r{k}", rumor_wrap)
        add(f"torch_r{k}", torch_wrap)
    if cfg["torch_ddp"]:
        add("torch", lambda m: TorchDDP(m))
    nparams = sum(p.numel() for p in variants["compute"][0].parameters())
    data = [models.batch(name, batch, step=i, shard=rank, seed=cfg["seed"]) for i in range(4)]

    def step(v, i):
        model, opt = variants[v]
        x, y = data[i % len(data)]
        opt.zero_grad()
        loss = models.loss(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    names = list(variants)
    counts = {v: 0 for v in names}
    times = {v: [] for v in names}
    losses = {v: [] for v in names}
    total = len(names) * (cfg["warmup"] + cfg["iters"])
    done = 0
    for v in names:
        for _ in range(cfg["warmup"]):
            dist.barrier()
            step(v, counts[v])
            counts[v] += 1
            done += 1
        if rank == 0:
            emit("progress", {"model": name, "done": done, "total": total, "what": f"warm-up {v}"})
    blocks = -(-cfg["iters"] // cfg["block"])
    for b in range(blocks):
        k = b % len(names)
        for v in names[k:] + names[:k]:  # rotate who goes first
            for _ in range(min(cfg["block"], cfg["iters"] - b * cfg["block"])):
                dist.barrier()
                t0 = time.perf_counter()
                loss = step(v, counts[v])
                times[v].append(time.perf_counter() - t0)
                losses[v].append(loss)
                counts[v] += 1
                done += 1
            if rank == 0:
                emit("progress", {"model": name, "done": done, "total": total,
                                  "what": f"{v} {times[v][-1] * 1e3:.0f} ms/step"})
    per_rank = _common.gather_samples(times)
    loss_t = {v: torch.tensor(losses[v], dtype=torch.float64) for v in names}
    for v in names:
        dist.all_reduce(loss_t[v], op=dist.ReduceOp.SUM)
    if rank == 0:
        cell = dict(model=name, n=n, batch=batch, global_batch=batch * n, params=nparams, variants={})
        for v in names:
            steps = [max(per_rank[v][r][i] for r in range(n)) for i in range(len(times[v]))]
            cell["variants"][v] = dict(step_s=steps, per_rank_step_s=per_rank[v], loss=(loss_t[v] / n).tolist(),
                                       steps_taken=counts[v])
            if v in stats:
                rate, before, after = stats[v].compression_stats()
                cell["variants"][v].update(compression_rate=rate, elements_before=before, elements_sent=after)
        emit("cell", cell)
    del variants, data
    gc.collect()


# ==== the driver =====================================================================================

class Job(_common.Job):
    def __init__(self, args, n, workdir, progress, base, steps_per_model, cluster, rate):
        super().__init__(os.path.abspath(__file__), args, n, workdir, progress, base, cluster)
        self.steps_per_model, self.rate, self.model_index = steps_per_model, rate, 0

    @property
    def label(self) -> str:
        return f"{self.hosts} emulated hosts x 1 rank, tbf {self.rate}"

    def config(self) -> Dict:
        a = self.args
        return dict(models=a.models, batch=a.batch_map, iters=a.iters, warmup=a.warmup, block=a.block, lr=a.lr,
                    seed=a.seed, scale=a.scale, start=a.start, psgd_ranks=a.psgd_ranks, torch_ddp=a.torch_ddp,
)

    def on_message(self, kind: str, data) -> None:
        if kind == "progress":
            self.progress.update(self.base + self.model_index * self.steps_per_model + data["done"],
                                 f"{self.label}: {data['model']} {data['what']}")
        elif kind == "cell":
            data["rate"] = self.rate
            self.model_index += 1


def summarize(cell: Dict, link_Bps: float, psgd_ranks: List[int]) -> None:
    gb, h = cell["global_batch"], cell["hosts"]
    v = cell["variants"]
    for d in v.values():
        s = d["step_s"]
        d["median_s"], d["min_s"], d["max_s"] = statistics.median(s), min(s), max(s)
        d["samples_per_s"] = gb / d["median_s"]
        d["samples_per_s_min"], d["samples_per_s_max"] = gb / d["max_s"], gb / d["min_s"]
        d["over_compute"] = d["samples_per_s"] / v["compute"]["samples_per_s"]
        d["final_loss"] = d["loss"][-1] if d["loss"] else None
    cell["ratios"] = {}
    for k in psgd_ranks:
        r, t = v[f"rumor_r{k}"], v[f"torch_r{k}"]
        ring_s = 2 * (h - 1) / h * r["elements_sent"] * 4 / link_Bps
        bound_s = max(ring_s, v["compute"]["median_s"])
        r["ring_s"], r["bound_s"] = ring_s, bound_s
        r["over_bound"] = bound_s / r["median_s"]
        r["over_torch_hook"] = r["samples_per_s"] / t["samples_per_s"]
        cell["ratios"][k] = dict(rumor_over_torch=r["over_torch_hook"], rumor_over_bound=r["over_bound"],
                                 rumor_loss=r["final_loss"], torch_loss=t["final_loss"],
                                 ceiling=t["median_s"] / bound_s)
    if "torch" in v:
        h_ring = 2 * (h - 1) / h * cell["params"] * 4 / link_Bps
        cell["fp32_ring_s"] = h_ring


LABEL = {"compute": "compute-only", "torch": "torch DDP"}


def label(v: str) -> str:
    if v in LABEL:
        return LABEL[v]
    who, k = v.split("_r")
    return f"{who} PowerSGD r{k}"


def print_table(cells: List[Dict], title: str, psgd_ranks: List[int]) -> None:
    if not cells:
        return
    print(f"\n{title}   (step: median [min-max] ms of {len(cells[0]['variants']['compute']['step_s'])} steps, "
          f"slowest rank; samples/s = global batch / median step; loss = mean over ranks after the last "
          f"measured step, the same step count for every variant)")
    head = (f"{'model':<12} {'variant':<20} {'step ms':>21} {'smp/s':>8} {'of compute':>10} {'loss':>8} "
            f"{'sent/step':>10} {'bound ms':>9}")
    print(head)
    print("-" * len(head))
    for c in cells:
        for v, d in c["variants"].items():
            t = f"{fmt_ms(d['median_s'])} [{fmt_ms(d['min_s'])}-{fmt_ms(d['max_s'])}]"
            sent = f"{d['elements_sent'] / 1e6:.2f}M" if "elements_sent" in d else "-"
            bound = f"{d['bound_s'] * 1e3:.0f}" if "bound_s" in d else "-"
            loss = f"{d['final_loss']:.4f}" if d.get("final_loss") is not None else "-"
            print(f"{c['model']:<12} {label(v):<20} {t:>21} {d['samples_per_s']:>8.1f} "
                  f"{100 * d['over_compute']:>9.0f}% {loss:>8} {sent:>10} {bound:>9}")
        for k in psgd_ranks:
            r = c["ratios"][k]
            print(f"{'':<12} rank {k}: rumor/torch hook = {r['rumor_over_torch']:.2f}x samples/s (target >= "
                  f"{TARGET}; ceiling {r['ceiling']:.2f}x), rumor at {100 * r['rumor_over_bound']:.0f}% of its "
                  f"link bound; loss rumor {r['rumor_loss']:.4f} vs torch {r['torch_loss']:.4f}")
    print("bound = max(compute-only step, the elements PowerSGD sends per step through a ring at link rate, "
          "2(n-1)/n x 4 bytes each); ceiling = torch's step / that bound")


def plot(path: str, cells: List[Dict], psgd_ranks: List[int]) -> Optional[str]:
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    if not cells:
        return "no plot (no results)"
    fig, axes = plt.subplots(1, len(cells), figsize=(max(6.0, 4.6 * len(cells)), 4.4), squeeze=False)
    for ax, c in zip(axes[0], cells):
        v = c["variants"]
        names = list(v)
        ys = [v[k]["samples_per_s"] for k in names]
        lo = [y - v[k]["samples_per_s_min"] for y, k in zip(ys, names)]
        hi = [v[k]["samples_per_s_max"] - y for y, k in zip(ys, names)]
        colors = ["#bbbbbb" if k == "compute" else "#1f77b4" if k.startswith("rumor") else "#ff7f0e" for k in names]
        ax.bar(range(len(names)), ys, yerr=[lo, hi], capsize=2, color=colors)
        for k in psgd_ranks:
            i = names.index(f"rumor_r{k}")
            ax.text(i, ys[i] + hi[i], f"{c['ratios'][k]['rumor_over_torch']:.2f}x", ha="center", fontsize=8,
                    fontweight="bold")
            ax.hlines(c["global_batch"] / v[f"rumor_r{k}"]["bound_s"], i - 0.4, i + 0.4, colors="k",
                      linestyles="dashed", linewidth=1)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([label(k).replace(" PowerSGD", "\nPowerSGD") for k in names], fontsize=7)
        ax.set_ylabel("samples/s")
        ax.set_title(f"{c['model']}, {c['hosts']} hosts @ {c['rate']}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("rumor PowerSGD vs torch DDP + powerSGD_hook\n(labels: rumor/torch samples/s; dashed: link bound)",
                 fontsize=9)
    _common.save_figure(plt, fig, path)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="rumor PowerSGD vs torch's powerSGD_hook (see the docstring)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4, help="emulated hosts (one rank each)")
    ap.add_argument("--rates", default="1gbit,100mbit", help="tbf rate of each host's link, one run per rate")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    ap.add_argument("--psgd-ranks", default="1,4", help="matrix_approximation_rank values")
    ap.add_argument("--start", type=int, default=2, help="start_powerSGD_iter of both (torch needs >= 2)")
    ap.add_argument("--torch-ddp", action="store_true", help="also plain torch DDP (slow at 100mbit)")
    ap.add_argument("--batch", default="", help="per-rank batch overrides, e.g. mlp25m=16")
    ap.add_argument("--scale", type=float, default=1.0, help="model width scale (1 = the benchmark models)")
    ap.add_argument("--iters", type=int, default=10, help="measured steps per variant (protocol: >= 10)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps per variant (default --start + 2)")
    ap.add_argument("--block", type=int, default=1, help="steps per variant before the next one runs")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix for the JSON/PNG file names")
    _common.add_run_args(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return _common.worker_main(args.worker, _describe, _train)
    if args.hosts < 2:
        ap.error("--hosts needs at least 2 hosts")
    if args.start < 2:
        ap.error("--start must be >= 2 (torch's PowerSGDState refuses less with error feedback)")
    args.ranks_per_host = 1  # read by _common.Job
    args.warmup = args.start + 2 if args.warmup is None else args.warmup
    if args.warmup <= args.start:
        ap.error("--warmup must exceed --start so that every measured step compresses")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        ap.error(f"unknown models {bad}; choose from {MODELS}")
    args.psgd_ranks = [int(k) for k in args.psgd_ranks.split(",") if k.strip()]
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    args.batch_map = {}
    for kv in filter(None, args.batch.split(",")):
        k, _, v = kv.partition("=")
        args.batch_map[k.strip()] = int(v)
    if args.iters < 10:
        print(f"WARNING: --iters {args.iters} is below the protocol's minimum of 10; smoke test only",
              file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    tag = f"{args.hosts}hosts" + (f"-{args.tag}" if args.tag else "")
    json_path = os.path.join(args.out, f"powersgd-{tag}.json")
    png_path = os.path.join(args.out, f"powersgd-{tag}.png")

    meta = _common.run_meta(args)
    meta.update(step="zero_grad + forward + cross-entropy + backward + SGD(momentum 0.9) step; after a gloo barrier; "
                     "the slowest rank's time",
                variants={"compute": "plain model, no communication",
                          "rumor_rK": "rumor.DistributedDataParallel, PowerSGD(matrix_approximation_rank=K, "
                                      "start_powerSGD_iter=--start)",
                          "torch_rK": "torch DDP (gloo) + powerSGD_hook, PowerSGDState(matrix_approximation_rank=K, "
                                      "start_powerSGD_iter=--start)",
                          "torch": "torch DDP (gloo), no hook"})
    result = dict(meta=meta, jobs=[], cells=[], targets=[], errors=[])
    print(f"rumor {meta['rumor']} PowerSGD vs torch {meta['torch']} powerSGD_hook | {meta['hostname']}, "
          f"{meta['cpus']} cpus, load {meta['loadavg_start'][0]:.2f} | models {','.join(args.models)} | ranks "
          f"{args.psgd_ranks} | iters {args.iters}, warmup {args.warmup}, start {args.start}")
    n_variants = 1 + 2 * len(args.psgd_ranks) + (1 if args.torch_ddp else 0)
    steps_per_model = n_variants * (args.warmup + args.iters)
    progress = Progress(len(rates) * len(args.models) * steps_per_model, unit="steps", quiet_s=10)
    drv = _common.Driver("rumor-powersgd-bench-", progress, True)

    def body() -> int:
        rc = 0
        jobs = []
        for i, rate in enumerate(rates):
            tcp = drv.start_cluster(args.hosts, rate)
            if tcp is None:
                return 2
            link_Bps = parse_rate(rate)
            result.setdefault("tcp_single_stream_Bps", {})[rate] = tcp
            print(f"emulated hosts: {args.hosts} x 1 rank, tbf {rate} = {link_Bps / 1e6:.1f} MB/s per link; one TCP "
                  f"stream through a shaped link: {tcp / 1e6:.1f} MB/s")
            job = Job(args, args.hosts, drv.workdir, progress, i * len(args.models) * steps_per_model,
                      steps_per_model, drv.cluster, rate)
            rc |= _common.run_jobs([job], result, progress)
            drv.close_cluster()
            for c in job.cells:
                summarize(c, link_Bps, args.psgd_ranks)
            jobs.append(job)
        progress.clear()
        _common.finish_meta(meta)
        for job in jobs:
            print_table(job.cells, job.label, args.psgd_ranks)
        print()
        for c in result["cells"]:
            for k in args.psgd_ranks:
                r = c["ratios"][k]
                t = dict(name=f"{c['job']}: {c['model']} PowerSGD rank {k} rumor/torch hook >= {TARGET}",
                         value=r["rumor_over_torch"], met=r["rumor_over_torch"] >= TARGET, ceiling=r["ceiling"])
                result["targets"].append(t)
                print(f"target: {t['name']}: {t['value']:.2f}x -> {'MET' if t['met'] else 'NOT MET'} "
                      f"(ceiling in this run {t['ceiling']:.2f}x)")
        headline = None
        if result["cells"]:
            worst = min(result["targets"], key=lambda t: t["value"])
            headline = (f"headline: rumor PowerSGD / torch powerSGD_hook samples/s: "
                        + ", ".join(f"{c['model']}@{c['rate']} r{k} {c['ratios'][k]['rumor_over_torch']:.2f}x"
                                    for c in result["cells"] for k in args.psgd_ranks)
                        + f" (lowest {worst['value']:.2f}x)")
        draw = None if args.no_plot else (lambda: plot(png_path, result["cells"], args.psgd_ranks))
        _common.write_results(result, headline, "headline: n/a (no results)", json_path, png_path, draw)
        return rc

    return drv.run(body)


if __name__ == "__main__":
    sys.exit(main())
