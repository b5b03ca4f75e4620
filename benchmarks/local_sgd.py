#!/usr/bin/env python
"""Local SGD and DiLoCo benchmark: communication-rare training vs torch DDP and GradientAllReduce.

Variants (every rank, same model weights, same data sequence, same inner optimizer):
  compute    the plain model, no communication: the bound (all ranks compute at once);
  torch      torch.nn.parallel.DistributedDataParallel over gloo (its defaults);
  rumor      rumor.DistributedDataParallel, GradientAllReduce();
  localsgd   LocalSGD(sync_every=8)                                   (--local-h);
  diloco     DiLoCo(inner_steps=32)                                   (--diloco-h);
  streaming  StreamingDiLoCo(inner_steps=32, num_fragments=4, int8,
             fragment_sync_delay=H // (2F))                           (--fragments, --delay, --quant).

How it measures
  Emulated hosts (default 4 x 1 rank, network namespaces, rumor.testing.netns; each host's link
  shaped with tbf at each --rate in turn, default 1gbit and 100mbit; needs root) or, with
  --hosts 0, ranks on this machine. Per model the variants run in blocks of --block steps (a
  multiple of every H, so that each block holds whole rounds, its synchronizations included),
  rotating which variant goes first; each variant runs one unmeasured block first. A block
  starts after a gloo barrier and ends when this rank's averages in flight are done (DiLoCo's
  wait()); its time is the slowest rank's. The warm-up block is one step short, so measured
  blocks end on step -1 mod H: each holds exactly one round of every fragment's sends and
  applications, and (with fragment_sync_delay <= H/F - 1) nothing is in flight at its end.
  No barrier inside a block: the ranks of a local method run free between synchronizations,
  as they would in training. samples/s = global batch x steps / summed block time.

  Losses after equal samples (every variant sees the same samples): the training loss (mean
  over ranks) of the last --loss-window steps, and the loss of the ranks' averaged model (what
  a user keeps; the local methods' ranks differ between synchronizations) on every rank's
  training batches. The data are rumor.testing.models' synthetic batches (random labels,
  --distinct-batches per rank, cycled): training memorizes them, which favours the methods
  that train on one rank's batches alone in the training loss and penalizes them in the
  averaged model's. DiLoCo takes one outer step per H steps: over a short run it has taken few.

  Bytes per step: what one rank sends per measured step for its synchronizations
  (bandwidth-optimal allreduce, 2(n-1)/n of the buffer; codec headers included for the
  quantized ones; torch and rumor: the fp32 gradients every step). Link bound of a variant:
  the compute-only step over the step its traffic allows at link rate, compute + bytes/rate
  for the methods that wait for their averages (LocalSGD, DiLoCo), max(compute, bytes/rate)
  for those that overlap them. --no-slow-start-after-idle sets tcp_slow_start_after_idle=0 in
  the emulated hosts (all variants).

Output: a table per job, ratios to compute-only and to torch DDP, the issue's targets (at 100
Mbit: DiLoCo >= 0.8 of compute-only samples/s, Streaming DiLoCo >= 0.9), JSON and a PNG in --out.

  sudo python benchmarks/local_sgd.py                                   # 4 hosts, 1gbit and 100mbit
  sudo python benchmarks/local_sgd.py --rate 100mbit --models mlp25m
  python benchmarks/local_sgd.py --hosts 0 --ranks 4                    # one machine, no shaping
  sudo python benchmarks/local_sgd.py --rate 100mbit --models mlp25m --scale 0.25 --block 32 --blocks 1  # smoke
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Optional

import _common
from _common import Progress, emit, parse_rate

MODELS = ("mlp25m", "transformer")
VARIANTS = ("compute", "torch", "rumor", "localsgd", "diloco", "streaming")


def _labels(cfg) -> Dict[str, str]:
    return {"compute": "compute-only", "torch": "torch DDP", "rumor": "GradientAllReduce",
            "localsgd": f"LocalSGD(H={cfg['local_h']})", "diloco": f"DiLoCo(H={cfg['diloco_h']})",
            "streaming": f"Streaming(H={cfg['diloco_h']},{cfg['quant']})"}


def _algorithm(key: str, cfg):
    from rumor import algorithms as A

    if key == "rumor":
        return A.GradientAllReduce()
    if key == "localsgd":
        return A.LocalSGD(sync_every=cfg["local_h"])
    if key == "diloco":
        return A.DiLoCo(inner_steps=cfg["diloco_h"])
    if key == "streaming":
        return A.StreamingDiLoCo(inner_steps=cfg["diloco_h"], num_fragments=cfg["fragments"],
                                 fragment_sync_delay=cfg["delay"], quantization=cfg["quant"])
    raise KeyError(key)


def _optimizer(model, cfg):
    import torch

    if cfg["optimizer"] == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    return torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)


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
    from rumor.algorithms.local_sgd import ring_bytes
    from rumor.testing import models

    batch = cfg["batch"].get(name) or models.BATCH[name]
    variants: Dict[str, tuple] = {}
    for v in cfg["variants"]:
        model = models.build(name, seed=cfg["seed"], scale=cfg["scale"])
        opt = _optimizer(model, cfg)
        if v == "compute":
            wrapped, algo = model, None
        elif v == "torch":
            wrapped, algo = TorchDDP(model), None
        else:
            algo = _algorithm(v, cfg)
            wrapped = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=algo)
        variants[v] = (wrapped, opt, algo)
    nparams = sum(p.numel() for p in variants[cfg["variants"][0]][0].parameters())
    ref = models.build(name, seed=cfg["seed"], scale=cfg["scale"])  # batches shaped for the (scaled) model
    data = [models.batch(ref, batch, step=i, shard=rank, seed=cfg["seed"]) for i in range(cfg["distinct_batches"])]
    del ref

    def step(v, i):
        model, opt, _ = variants[v]
        x, y = data[i % len(data)]
        opt.zero_grad()
        loss = models.loss(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    def block(v, count, k):
        # count steps of one variant; a block ends when its averages in flight are done
        dist.barrier()
        t0 = time.perf_counter()
        losses = [step(v, count + i) for i in range(k)]
        algo = variants[v][2]
        if hasattr(algo, "wait"):
            algo.wait()
        return time.perf_counter() - t0, losses

    names = list(variants)
    counts = {v: 0 for v in names}
    times = {v: [] for v in names}
    losses = {v: [] for v in names}
    total = len(names) * cfg["block"] * (cfg["blocks"] + 1)
    done = 0
    # One unmeasured block each (first rounds, buckets, caches), one step short: measured blocks
    # then end on step t = -1 (mod H), after the last fragment's delayed average was applied and
    # before the next round's first send, so no average is in flight at a block's end (waiting
    # for one there would expose a transfer that training overlaps with the next steps).
    warm = cfg["block"] - 1
    for v in names:
        block(v, counts[v], warm)
        counts[v] += warm
        done += cfg["block"]
        if rank == 0:
            emit("progress", {"model": name, "done": done, "total": total, "what": f"warm-up {v}"})
    sent0 = {v: variants[v][2].wire_bytes for v in names if hasattr(variants[v][2], "wire_bytes")}
    for b in range(cfg["blocks"]):
        k = b % len(names)
        for v in names[k:] + names[:k]:
            t, ls = block(v, counts[v], cfg["block"])
            counts[v] += cfg["block"]
            times[v].append(t)
            losses[v].extend(ls)
            done += cfg["block"]
            if rank == 0:
                emit("progress", {"model": name, "done": done, "total": total,
                                   "what": f"{v} {t / cfg['block'] * 1e3:.0f} ms/step"})
    # The loss after equal samples of the model a user would keep: the ranks' average (the local
    # methods' ranks differ between synchronizations), over every rank's training batches.
    evaluator = models.build(name, seed=cfg["seed"], scale=cfg["scale"])
    eval_loss = {}
    for v in names:
        algo = variants[v][2]
        if hasattr(algo, "wait"):
            algo.wait()
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in variants[v][0].parameters()]).double()
            dist.all_reduce(flat)
            flat /= n
            off = 0
            for p in evaluator.parameters():
                p.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
            mine = torch.tensor([sum(float(models.loss(evaluator(x), y)) for x, y in data) / len(data)],
                                dtype=torch.float64)
        dist.all_reduce(mine)
        eval_loss[v] = float(mine) / n
    per_rank = _common.gather_samples(times)
    loss_t = {v: torch.tensor(losses[v], dtype=torch.float64) for v in names}
    for v in names:
        dist.all_reduce(loss_t[v], op=dist.ReduceOp.SUM)
    wire = {}
    for v in names:
        algo = variants[v][2]
        if v == "compute":
            wire[v] = 0.0
        elif v in ("torch", "rumor"):
            wire[v] = ring_bytes(nparams, 4, n)
        elif v == "localsgd":
            wire[v] = ring_bytes(nparams, 4, n) / cfg["local_h"]
        else:  # what the measured blocks (whole rounds) sent
            wire[v] = (algo.wire_bytes - sent0[v]) / max(1, cfg["block"] * cfg["blocks"])
    if rank == 0:
        cell = dict(model=name, n=n, batch=batch, global_batch=batch * n, params=nparams, block=cfg["block"],
                    variants={})
        for v in names:
            blocks = [max(per_rank[v][r][i] for r in range(n)) for i in range(len(times[v]))]
            cell["variants"][v] = dict(block_s=blocks, per_rank_block_s=per_rank[v],
                                       loss=(loss_t[v] / n).tolist(), eval_loss=eval_loss[v],
                                       wire_bytes_per_step=wire[v],
                                       blocking=v == "localsgd" or (v == "diloco") or (
                                           v == "streaming" and cfg["delay"] == 0))
        emit("cell", cell)
    del variants, data
    gc.collect()


# ==== the driver =====================================================================================

class Job(_common.Job):
    def __init__(self, args, n, workdir, progress, base, steps_per_model, cluster=None, rate=None):
        super().__init__(os.path.abspath(__file__), args, n, workdir, progress, base, cluster)
        self.steps_per_model = steps_per_model
        self.model_index = 0
        self.rate = rate

    @property
    def label(self) -> str:
        if self.cluster is not None:
            return f"{self.hosts} emulated hosts x {self.rph} rank(s), tbf {self.rate}"
        return f"{self.n} ranks, 1 host"

    def config(self) -> Dict:
        a = self.args
        return dict(models=a.models, variants=a.variants, batch=a.batch_map, block=a.block, blocks=a.blocks,
                    lr=a.lr, optimizer=a.optimizer, seed=a.seed, scale=a.scale, local_h=a.local_h,
                    diloco_h=a.diloco_h, fragments=a.fragments, delay=a.delay, quant=a.quant,
                    distinct_batches=a.distinct_batches)

    def on_message(self, kind: str, data) -> None:
        if kind == "progress":
            self.progress.update(self.base + self.model_index * self.steps_per_model + data["done"],
                                 f"{self.label}: {data['model']} {data['what']}")
        elif kind == "cell":
            self.model_index += 1
            if self.rate is not None:
                data["rate"] = self.rate


def summarize(cell: Dict, link_Bps: Optional[float], loss_window: int) -> None:
    steps_per_block = cell["block"]
    v = cell["variants"]
    for d in v.values():
        tot = sum(d["block_s"])
        d["step_s"] = tot / (steps_per_block * len(d["block_s"]))
        d["samples_per_s"] = cell["global_batch"] / d["step_s"]
        d["block_min_s"], d["block_max_s"] = min(d["block_s"]), max(d["block_s"])
        w = d["loss"][-loss_window:]
        d["final_loss"] = sum(w) / len(w) if w else None
    for d in v.values():
        if "compute" in v:
            d["over_compute"] = d["samples_per_s"] / v["compute"]["samples_per_s"]
            if link_Bps:
                comm = d["wire_bytes_per_step"] / link_Bps
                c = v["compute"]["step_s"]
                # LocalSGD and DiLoCo wait for their averages (nothing to overlap them with);
                # the others can hide communication behind computation
                d["link_bound_step_s"] = c + comm if d.get("blocking") else max(c, comm)
                d["link_bound_over_compute"] = v["compute"]["step_s"] / d["link_bound_step_s"]
        if "torch" in v:
            d["over_torch"] = d["samples_per_s"] / v["torch"]["samples_per_s"]


def print_table(cells: List[Dict], title: str, labels: Dict[str, str]) -> None:
    if not cells:
        return
    print(f"\n{title}   (ms/step = summed block time / steps, slowest rank per block; train loss = mean "
          f"training loss of the last steps over ranks; avg-model loss = loss of the ranks' averaged model on "
          f"every rank's training batches; both after equal samples)")
    head = (f"{'model':<12} {'variant':<22} {'ms/step':>8} {'smp/s':>8} {'of compute':>10} {'x torch':>8} "
            f"{'MB/step':>8} {'link bound':>10} {'train loss':>10} {'avg-model loss':>14}")
    print(head)
    print("-" * len(head))
    for c in cells:
        for k, d in c["variants"].items():
            lb = f"{100 * d['link_bound_over_compute']:.0f}%" if "link_bound_over_compute" in d else "-"
            print(f"{c['model']:<12} {labels[k]:<22} {d['step_s'] * 1e3:>8.1f} {d['samples_per_s']:>8.1f} "
                  f"{100 * d.get('over_compute', float('nan')):>9.0f}% {d.get('over_torch', float('nan')):>7.2f}x "
                  f"{d['wire_bytes_per_step'] / 1e6:>8.2f} {lb:>10} {d['final_loss']:>10.4f} {d['eval_loss']:>14.4f}")
    print("of compute: samples/s relative to compute-only; link bound: compute-only step / the step that "
          "variant's traffic allows at link rate: compute + bytes/rate for the methods that wait for their "
          "averages (LocalSGD, DiLoCo), max(compute, bytes/rate) for those that overlap them")


def plot(path: str, jobs: List[Dict], labels: Dict[str, str]) -> Optional[str]:
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    jobs = [j for j in jobs if j["cells"]]
    if not jobs:
        return "no plot (no results)"
    fig, axes = plt.subplots(1, len(jobs), figsize=(max(7.5, 6 * len(jobs)), 4.8), squeeze=False)
    colors = {"compute": "#bbbbbb", "torch": "#ff7f0e", "rumor": "#1f77b4", "localsgd": "#2ca02c",
              "diloco": "#9467bd", "streaming": "#d62728"}
    for ax, job in zip(axes[0], jobs):
        cells = job["cells"]
        variants = list(cells[0]["variants"])
        width = 0.8 / len(variants)
        for k, v in enumerate(variants):
            xs = [i + (k - (len(variants) - 1) / 2) * width for i in range(len(cells))]
            ys = [c["variants"][v].get("over_compute", 0.0) for c in cells]
            ax.bar(xs, ys, width, label=labels[v], color=colors.get(v))
            for x, y, c in zip(xs, ys, cells):
                ax.text(x, y + 0.02, f"{c['variants'][v]['eval_loss']:.2f}", ha="center", fontsize=6, rotation=90)
        ax.axhline(0.8, color="#9467bd", lw=0.8, ls="--")
        ax.axhline(0.9, color="#d62728", lw=0.8, ls="--")
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels([f"{c['model']}\n{c['variants']['compute']['samples_per_s']:.0f} smp/s bound"
                            if "compute" in c["variants"] else c["model"] for c in cells], fontsize=8)
        ax.set_ylim(0, 1.3)
        ax.set_ylabel("samples/s relative to compute-only")
        ax.set_title(job["label"], fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("local SGD / DiLoCo vs GradientAllReduce and torch DDP\nbar labels: loss of the ranks' averaged "
                 "model after equal samples\ndashed: targets at 100 Mbit (0.8 DiLoCo, 0.9 Streaming)", fontsize=9)
    _common.save_figure(plt, fig, path)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="local SGD / DiLoCo throughput and loss (see the docstring)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4, help="emulated hosts (0: ranks on this machine, --ranks)")
    ap.add_argument("--ranks", default="4", help="--hosts 0: world sizes to run")
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--rate", default="1gbit,100mbit", help="comma list: tbf rate of each host's link, one job each")
    ap.add_argument("--link-delay", default=None,
                    help="--hosts mode: one-way delay of every link, e.g. 50ms (a 100 ms round trip; rumor-wanem)")
    ap.add_argument("--link-jitter", default=None, help="--hosts mode: per-packet jitter added to --link-delay")
    ap.add_argument("--link-loss", type=float, default=None, help="--hosts mode: packet loss probability")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    ap.add_argument("--scale", type=float, default=1.0, help="model width scale (1: the benchmark models)")
    ap.add_argument("--batch", default="", help="per-rank batch overrides, e.g. mlp25m=16")
    ap.add_argument("--block", type=int, default=32, help="steps per measured block (a multiple of every H)")
    ap.add_argument("--blocks", type=int, default=3, help="measured blocks per variant")
    ap.add_argument("--loss-window", type=int, default=8, help="final loss = mean of the last this many steps")
    ap.add_argument("--distinct-batches", type=int, default=8, help="distinct batches per rank, cycled")
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                    help="inner optimizer of every variant (adamw: DiLoCo's setting; sgd: momentum 0.9)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--local-h", type=int, default=8)
    ap.add_argument("--diloco-h", type=int, default=32)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--delay", type=int, default=None, help="streaming fragment_sync_delay (default H // (2F))")
    ap.add_argument("--quant", default="int8", help="streaming quantization: fp16, bf16, int8, 4bit or none")
    ap.add_argument("--no-slow-start-after-idle", action="store_true",
                    help="set net.ipv4.tcp_slow_start_after_idle=0 in every emulated host (all variants): a "
                         "connection idle between two rare synchronizations keeps its congestion window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix for the JSON/PNG file names")
    _common.add_run_args(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return _common.worker_main(args.worker, _describe, _train)

    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if any(m not in MODELS for m in args.models) or any(v not in VARIANTS for v in args.variants):
        ap.error(f"models from {MODELS}, variants from {VARIANTS}")
    args.quant = None if args.quant == "none" else args.quant
    if args.delay is None:
        args.delay = min(args.diloco_h - 1, max(1, args.diloco_h // (2 * args.fragments)))
    if args.block % args.local_h or args.block % args.diloco_h:
        ap.error(f"--block ({args.block}) must be a multiple of --local-h and --diloco-h (whole rounds per block)")
    args.batch_map = {}
    for kv in filter(None, args.batch.split(",")):
        k, _, val = kv.partition("=")
        args.batch_map[k.strip()] = int(val)
    hosts_mode = args.hosts > 0
    rates = [r.strip() for r in args.rate.split(",") if r.strip()] if hosts_mode else [None]
    if hosts_mode and args.hosts < 2:
        ap.error("--hosts needs at least 2 hosts (or 0 for one machine)")
    worlds = [args.hosts * args.ranks_per_host] if hosts_mode else [int(x) for x in args.ranks.split(",")]
    os.makedirs(args.out, exist_ok=True)
    tag = f"{args.hosts}hosts" if hosts_mode else "1host"
    if args.tag:
        tag += "-" + args.tag
    json_path = os.path.join(args.out, f"local_sgd-{tag}.json")
    png_path = os.path.join(args.out, f"local_sgd-{tag}.png")
    cfg_view = dict(local_h=args.local_h, diloco_h=args.diloco_h, quant=args.quant)
    labels = _labels(cfg_view)

    meta = _common.run_meta(args)
    meta.update(step="zero_grad + forward + cross-entropy + backward + inner optimizer step (+ the algorithm's "
                     "synchronization); blocks of whole rounds after a gloo barrier; the slowest rank's block time",
                variants={k: labels[k] for k in args.variants},
                streaming=dict(fragments=args.fragments, delay=args.delay, quantization=args.quant))
    result = dict(meta=meta, jobs=[], cells=[], targets=[], errors=[])
    print(f"rumor {meta['rumor']} local SGD / DiLoCo | {meta['hostname']}, {meta['cpus']} cpus, load "
          f"{meta['loadavg_start'][0]:.2f} | models {','.join(args.models)} scale {args.scale} | {args.blocks} blocks "
          f"of {args.block} steps | inner {args.optimizer} lr {args.lr} | streaming F={args.fragments} "
          f"delay={args.delay} {args.quant}")
    steps_per_model = len(args.variants) * args.block * (args.blocks + 1)
    progress = Progress(len(rates) * len(worlds) * len(args.models) * steps_per_model, unit="steps", quiet_s=10)
    drv = _common.Driver("rumor-localsgd-bench-", progress, hosts_mode)

    def body() -> int:
        rc = 0
        all_jobs = []
        base = 0
        for rate in rates:
            link_Bps = None
            if hosts_mode:
                tcp = drv.start_cluster(args.hosts, rate, **_common.wan_kwargs(args, "link_"))
                if tcp is None:
                    return 2
                link_Bps = parse_rate(rate)
                if args.no_slow_start_after_idle:
                    for i in range(args.hosts):
                        drv.cluster.run(i, ["sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0"], check=True)
                    meta["tcp_slow_start_after_idle"] = 0
                print(f"emulated hosts: {args.hosts} x {args.ranks_per_host} rank(s), tbf {rate} = "
                      f"{link_Bps / 1e6:.1f} MB/s per link{_common.wan_label(args, 'link_')}; one TCP stream "
                      f"through it: {tcp / 1e6:.1f} MB/s")
            jobs = []
            for n in worlds:
                jobs.append(Job(args, n, drv.workdir, progress, base, steps_per_model, cluster=drv.cluster, rate=rate))
                base += len(args.models) * steps_per_model
            rc |= _common.run_jobs(jobs, result, progress)
            drv.close_cluster()
            for j in jobs:
                for c in j.cells:
                    summarize(c, link_Bps, args.loss_window)
            all_jobs += jobs
        progress.clear()
        _common.finish_meta(meta)
        for job in all_jobs:
            print_table(job.cells, job.label, labels)
        print()
        targets = result["targets"]
        for c in result["cells"]:
            v = c["variants"]
            if "compute" not in v:
                continue
            slow = str(c.get("rate", "")).lower() == "100mbit"
            for key, goal in (("diloco", 0.8), ("streaming", 0.9)):
                if key in v and slow:
                    d = v[key]
                    targets.append(dict(name=f"{c['job']}: {c['model']} {labels[key]} >= {goal} of compute-only",
                                        value=d["over_compute"], met=d["over_compute"] >= goal,
                                        link_bound=d.get("link_bound_over_compute")))
            for key in ("localsgd", "diloco", "streaming"):
                if key in v and "rumor" in v:
                    print(f"{c['job']}: {c['model']}: {labels[key]}: {v[key]['over_compute']:.2f} of compute-only, "
                          f"{v[key].get('over_torch', float('nan')):.2f}x torch DDP, "
                          f"{v[key]['samples_per_s'] / v['rumor']['samples_per_s']:.2f}x GradientAllReduce; "
                          f"avg-model loss {v[key]['eval_loss']:.4f} vs GradientAllReduce "
                          f"{v['rumor']['eval_loss']:.4f}; "
                          f"{v[key]['wire_bytes_per_step'] / 1e6:.2f} MB/step on the wire "
                          f"(GradientAllReduce {v['rumor']['wire_bytes_per_step'] / 1e6:.2f})")
        for t in targets:
            lb = f"; link bound {t['link_bound']:.2f}" if t.get("link_bound") is not None else ""
            print(f"target: {t['name']}: {t['value']:.2f} -> {'MET' if t['met'] else 'NOT MET'}{lb}")
        headline = None
        pick = [c for c in result["cells"] if "streaming" in c["variants"] and "compute" in c["variants"]]
        if pick:
            c = next((c for c in pick if str(c.get("rate", "")).lower() == "100mbit"), pick[-1])
            v = c["variants"]
            headline = (f"headline: {c['model']} {c['job']}: Streaming DiLoCo at {v['streaming']['over_compute']:.2f} "
                        f"of compute-only samples/s"
                        + (f", DiLoCo {v['diloco']['over_compute']:.2f}" if "diloco" in v else "")
                        + (f", GradientAllReduce {v['rumor']['over_compute']:.2f}" if "rumor" in v else ""))
        draw = None if args.no_plot else (
            lambda: plot(png_path, [dict(label=j.label, cells=j.cells) for j in all_jobs], labels))
        _common.write_results(result, headline, "headline: n/a (no results)", json_path, png_path, draw)
        return rc

    return drv.run(body)


if __name__ == "__main__":
    sys.exit(main())
