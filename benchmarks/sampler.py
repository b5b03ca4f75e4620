#!/usr/bin/env python
"""Sampler benchmark: load-balanced sampling vs torch's DistributedSampler on heavy-tailed lengths.

The BENCHMARKS.md transformer (4 encoder layers, d_model 256, 4 heads, ff 1024, vocabulary 8192,
token classification; its position table extended to --max-len) trained with
rumor.DistributedDataParallel on sequences whose lengths are lognormal (median --median-len,
sigma --sigma, clipped to [8, --max-len]); each rank's batch is padded to its longest sequence
(padding tokens are ignored by the loss but computed, as in a plain padded batch).

Variants (the same model weights, the same dataset, rumor DDP, SGD momentum 0.9):
  torch    torch.utils.data.DistributedSampler, --batch samples per rank
  lb       rumor.data.LoadBalancingDistributedSampler(costs=lengths, batch_size=--batch)
  lb_tok   rumor.data.LoadBalancingDistributedBatchSampler(max_tokens=...): token-budget batches;
           the budget (--max-tokens, default: the mean padded tokens of the torch variant's rank
           batches) is the same memory per batch on average, so its batches hold more samples

How it measures: every variant's steps are taken from its own epoch plan (epoch 0, seed
--seed), batches built before timing. After --warmup steps per variant, --iters steps per
variant run in blocks of --block, rotating which variant goes first; each step starts after a
gloo barrier and its time is the slowest rank's. Per step also: each rank's forward time (pure
compute) and padded tokens, whose spread over the mean is the step's imbalance. Epoch time is
the sum of step times and lengths are heavy-tailed, so the mean step is reported beside the
median, and samples/s = samples in the measured steps / their total time.

  python benchmarks/sampler.py                      # 4 ranks, one host, full size
  python benchmarks/sampler.py --iters 4 --warmup 1 --batch 4 --max-len 128 --dataset 2000   # smoke

Output: a table, JSON and PNG in --out (benchmarks/results/sampler-1host*.json/png); the last line
is the headline (torch step / lb step; the issue's target is >= 1.3x).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import _common
from _common import Progress, emit

VARIANTS = ("torch", "lb", "lb_tok")
LABEL = {"torch": "DistributedSampler", "lb": "LB sampler", "lb_tok": "LB token batches"}
TARGET = 1.3


def lengths_of(cfg) -> "np.ndarray":
    import numpy as np

    rng = np.random.default_rng(cfg["seed"])
    x = rng.lognormal(math.log(cfg["median_len"]), cfg["sigma"], cfg["dataset"])
    return np.clip(np.round(x), 8, cfg["max_len"]).astype(np.int64)


def torch_padded_tokens(cfg, n: int) -> float:
    """The mean padded tokens of a DistributedSampler rank batch over an epoch (the default budget)."""
    import numpy as np
    from torch.utils.data import DistributedSampler

    lens = lengths_of(cfg)
    b = cfg["batch"]
    tot, cnt = 0.0, 0
    for r in range(n):
        s = DistributedSampler(range(len(lens)), num_replicas=n, rank=r, seed=cfg["seed"])
        idx = np.fromiter(s, dtype=np.int64)
        for k in range(0, len(idx) - b + 1, b):
            tot += b * lens[idx[k:k + b]].max()
            cnt += 1
    return tot / max(1, cnt)


# ==== inside a rank ==================================================================================

def _describe(rank: int, n: int) -> Dict:
    import torch

    import rumor

    return dict(rank=rank, size=n, local_size=rumor.local_size(), torch_threads=torch.get_num_threads())


def _sample(i: int, length: int, vocab: int, classes: int):
    import torch

    g = torch.Generator().manual_seed(1_000_003 * i + 17)
    return torch.randint(0, vocab, (length,), generator=g), torch.randint(0, classes, (length,), generator=g)


def _collate(idx: List[int], lens, vocab: int, classes: int):
    """Pads to the batch's longest sequence; padded targets are -100 (ignored by the loss)."""
    import torch

    longest = int(max(lens[i] for i in idx))
    x = torch.zeros(len(idx), longest, dtype=torch.long)
    y = torch.full((len(idx), longest), -100, dtype=torch.long)
    for row, i in enumerate(idx):
        t, c = _sample(i, int(lens[i]), vocab, classes)
        x[row, :len(t)], y[row, :len(c)] = t, c
    return x, y


def _bench(cfg: Dict, rank: int, n: int) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    import rumor
    from rumor.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
    from rumor.testing import models

    lens = lengths_of(cfg)
    steps_needed = cfg["warmup"] + cfg["iters"]
    b = cfg["batch"]
    plans: Dict[str, List[List[int]]] = {}
    ds = range(len(lens))
    s = DistributedSampler(ds, num_replicas=n, rank=rank, seed=cfg["seed"])
    idx = list(s)
    plans["torch"] = [idx[k:k + b] for k in range(0, len(idx) - b + 1, b)]
    s = LoadBalancingDistributedSampler(ds, costs=lens, num_replicas=n, rank=rank, seed=cfg["seed"], batch_size=b)
    idx = list(s)
    plans["lb"] = [idx[k:k + b] for k in range(0, len(idx) - b + 1, b)]
    s = LoadBalancingDistributedSampler(ds, costs=lens, num_replicas=n, rank=rank, seed=cfg["seed"])
    plans["lb_tok"] = list(LoadBalancingDistributedBatchSampler(s, max_tokens=cfg["max_tokens"]))
    for v in VARIANTS:
        if len(plans[v]) < steps_needed:
            raise RuntimeError(f"{v}: the epoch has {len(plans[v])} steps, fewer than warmup+iters={steps_needed}; "
                               "raise --dataset")

    vocab, classes = 8192, 32
    variants = {}
    for v in VARIANTS:
        state = torch.random.get_rng_state()
        torch.manual_seed(cfg["seed"])
        model = models.TokenClassifier(vocab=vocab, seq=cfg["max_len"], classes=classes)
        torch.random.set_rng_state(state)
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        variants[v] = (rumor.DistributedDataParallel(model, optimizer=opt), opt)
    data = {v: [_collate(plans[v][i], lens, vocab, classes) for i in range(steps_needed)] for v in VARIANTS}
    padded = {v: [int(data[v][i][0].numel()) for i in range(steps_needed)] for v in VARIANTS}
    real = {v: [int(sum(lens[j] for j in plans[v][i])) for i in range(steps_needed)] for v in VARIANTS}
    nsamp = {v: [len(plans[v][i]) for i in range(steps_needed)] for v in VARIANTS}

    def step(v, i):
        model, opt = variants[v]
        x, y = data[v][i]
        opt.zero_grad()
        t0 = time.perf_counter()
        out = model(x)
        fwd = time.perf_counter() - t0
        loss = models.loss(out, y)
        loss.backward()
        opt.step()
        return fwd

    counts = {v: 0 for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    fwd = {v: [] for v in VARIANTS}
    used = {v: [] for v in VARIANTS}  # which plan step each measured step was
    total = len(VARIANTS) * steps_needed
    done = 0
    for v in VARIANTS:
        for _ in range(cfg["warmup"]):
            dist.barrier()
            step(v, counts[v])
            counts[v] += 1
            done += 1
        if rank == 0:
            emit("progress", {"done": done, "total": total, "what": f"warm-up {LABEL[v]}"})
    blocks = -(-cfg["iters"] // cfg["block"])
    for blk in range(blocks):
        k = blk % len(VARIANTS)
        for v in VARIANTS[k:] + VARIANTS[:k]:
            for _ in range(min(cfg["block"], cfg["iters"] - blk * cfg["block"])):
                dist.barrier()
                t0 = time.perf_counter()
                f = step(v, counts[v])
                times[v].append(time.perf_counter() - t0)
                fwd[v].append(f)
                used[v].append(counts[v])
                counts[v] += 1
                done += 1
            if rank == 0:
                emit("progress", {"done": done, "total": total, "what": f"{LABEL[v]} {times[v][-1] * 1e3:.0f} ms/step"})
    per_rank_t = _common.gather_samples(times)
    per_rank_f = _common.gather_samples(fwd)
    per_rank_pad = _common.gather_samples({v: [float(padded[v][i]) for i in used[v]] for v in VARIANTS})
    per_rank_real = _common.gather_samples({v: [float(real[v][i]) for i in used[v]] for v in VARIANTS})
    per_rank_n = _common.gather_samples({v: [float(nsamp[v][i]) for i in used[v]] for v in VARIANTS})
    if rank == 0:
        cell = dict(n=n, batch=b, max_tokens=cfg["max_tokens"], dataset=len(lens),
                    lengths=dict(median=float(np.median(lens)), mean=float(lens.mean()),
                                 p99=float(np.percentile(lens, 99)), max=int(lens.max())),
                    params=sum(p.numel() for p in variants["torch"][0].parameters()), variants={})
        for v in VARIANTS:
            m = len(times[v])
            cell["variants"][v] = dict(
                step_s=[max(per_rank_t[v][r][i] for r in range(n)) for i in range(m)],
                per_rank_step_s=per_rank_t[v], per_rank_forward_s=per_rank_f[v],
                per_rank_padded_tokens=per_rank_pad[v], per_rank_real_tokens=per_rank_real[v],
                per_rank_samples=per_rank_n[v])
        emit("cell", cell)


# ==== the driver =====================================================================================

class Job(_common.Job):
    def config(self) -> Dict:
        a = self.args
        return dict(seed=a.seed, batch=a.batch, max_tokens=a.max_tokens_value, dataset=a.dataset, max_len=a.max_len,
                    median_len=a.median_len, sigma=a.sigma, iters=a.iters, warmup=a.warmup, block=a.block, lr=a.lr)

    def on_message(self, kind: str, data) -> None:
        if kind == "progress":
            self.progress.update(self.base + data["done"], f"{self.label}: {data['what']}")


def _imbalance(per_rank: List[List[float]]) -> List[float]:
    """Per step: (max - min) / mean over ranks."""
    out = []
    for i in range(len(per_rank[0])):
        xs = [r[i] for r in per_rank]
        mean = sum(xs) / len(xs)
        out.append((max(xs) - min(xs)) / mean if mean > 0 else 0.0)
    return out


def summarize(cell: Dict) -> None:
    for v, d in cell["variants"].items():
        s = d["step_s"]
        d["median_s"], d["mean_s"], d["min_s"], d["max_s"] = statistics.median(s), statistics.mean(s), min(s), max(s)
        samples = sum(sum(r) for r in d["per_rank_samples"])
        real = sum(sum(r) for r in d["per_rank_real_tokens"])
        padded = sum(sum(r) for r in d["per_rank_padded_tokens"])
        d["samples_per_s"] = samples / sum(s)
        d["real_tokens_per_s"] = real / sum(s)
        d["padding_overhead"] = padded / real  # computed tokens per real token
        d["imbalance_padded_tokens"] = statistics.mean(_imbalance(d["per_rank_padded_tokens"]))
        d["imbalance_forward_time"] = statistics.mean(_imbalance(d["per_rank_forward_s"]))
    v = cell["variants"]
    for k, d in v.items():
        d["step_over_torch"] = v["torch"]["mean_s"] / d["mean_s"]          # >1: faster steps
        d["samples_per_s_over_torch"] = d["samples_per_s"] / v["torch"]["samples_per_s"]


def print_table(cell: Dict, title: str) -> None:
    print(f"\n{title}: lengths median {cell['lengths']['median']:.0f}, mean {cell['lengths']['mean']:.0f}, "
          f"p99 {cell['lengths']['p99']:.0f}, max {cell['lengths']['max']}; batch {cell['batch']}/rank, "
          f"max_tokens {cell['max_tokens']:.0f}; {len(cell['variants']['torch']['step_s'])} measured steps each, "
          f"slowest rank")
    head = (f"{'variant':<20} {'mean step ms':>12} {'median [min-max] ms':>22} {'samples/s':>10} {'x torch step':>12} "
            f"{'x torch smp/s':>13} {'pad/real':>8} {'imb tokens':>10} {'imb fwd':>8}")
    print(head)
    print("-" * len(head))
    for k, d in cell["variants"].items():
        mm = f"{d['median_s'] * 1e3:.0f} [{d['min_s'] * 1e3:.0f}-{d['max_s'] * 1e3:.0f}]"
        print(f"{LABEL[k]:<20} {d['mean_s'] * 1e3:>12.0f} {mm:>22} {d['samples_per_s']:>10.1f} "
              f"{d['step_over_torch']:>11.2f}x {d['samples_per_s_over_torch']:>12.2f}x {d['padding_overhead']:>8.2f} "
              f"{100 * d['imbalance_padded_tokens']:>9.0f}% {100 * d['imbalance_forward_time']:>7.0f}%")
    print("pad/real: computed (padded) tokens per real token, the bound is 1.00; imb: per-step (max-min)/mean over "
          "ranks of padded tokens and of forward time, the bound is 0%")


def plot(path: str, cell: Dict) -> Optional[str]:
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = {"torch": "#ff7f0e", "lb": "#1f77b4", "lb_tok": "#2ca02c"}
    for k, d in cell["variants"].items():
        axes[0].plot([t * 1e3 for t in d["step_s"]], "o-", ms=3, label=LABEL[k], color=colors[k])
    axes[0].set_xlabel("measured step")
    axes[0].set_ylabel("step time, slowest rank (ms)")
    axes[0].set_title("step time")
    axes[0].legend(fontsize=7)
    names = list(cell["variants"])
    x = range(len(names))
    axes[1].bar(x, [cell["variants"][k]["samples_per_s_over_torch"] for k in names], color=[colors[k] for k in names])
    axes[1].axhline(TARGET, ls="--", color="gray", lw=1)
    axes[1].set_xticks(list(x))
    axes[1].set_xticklabels([LABEL[k] for k in names], fontsize=8)
    axes[1].set_title("samples/s relative to DistributedSampler (dashed: 1.3x)")
    w = 0.4
    axes[2].bar([i - w / 2 for i in x], [100 * cell["variants"][k]["imbalance_padded_tokens"] for k in names], w,
                label="padded tokens", color="#888888")
    axes[2].bar([i + w / 2 for i in x], [100 * cell["variants"][k]["imbalance_forward_time"] for k in names], w,
                label="forward time", color="#444444")
    axes[2].set_xticks(list(x))
    axes[2].set_xticklabels([LABEL[k] for k in names], fontsize=8)
    axes[2].set_ylabel("mean per-step (max-min)/mean, %")
    axes[2].set_title("per-step imbalance across ranks")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"transformer, {cell['n']} ranks, lognormal lengths (median {cell['lengths']['median']:.0f}, "
                 f"max {cell['lengths']['max']}), rumor DDP", fontsize=9)
    _common.save_figure(plt, fig, path)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="load-balanced sampling vs DistributedSampler (see the docstring)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="samples per rank batch (torch and lb variants)")
    ap.add_argument("--max-tokens", type=float, default=0.0,
                    help="lb_tok budget in padded tokens; 0: the mean padded tokens of a torch-variant rank batch")
    ap.add_argument("--dataset", type=int, default=20000, help="samples in the dataset")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--median-len", type=float, default=48.0)
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the lengths")
    ap.add_argument("--iters", type=int, default=20, help="measured steps per variant (protocol: >= 10)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--block", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix for the JSON/PNG file names")
    _common.add_run_args(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return _common.worker_main(args.worker, _describe, _bench)
    if args.iters < 10:
        print(f"WARNING: --iters {args.iters} is below the protocol's minimum of 10; smoke test only", file=sys.stderr)
    cfg = dict(seed=args.seed, dataset=args.dataset, max_len=args.max_len, median_len=args.median_len,
               sigma=args.sigma, batch=args.batch)
    args.max_tokens_value = args.max_tokens or torch_padded_tokens(cfg, args.ranks)
    os.makedirs(args.out, exist_ok=True)
    tag = "1host" + (f"-{args.tag}" if args.tag else "")
    json_path = os.path.join(args.out, f"sampler-{tag}.json")
    png_path = os.path.join(args.out, f"sampler-{tag}.png")
    meta = _common.run_meta(args)
    meta.update(step="zero_grad + forward + cross-entropy + backward + SGD(momentum 0.9) step with "
                     "rumor.DistributedDataParallel; after a gloo barrier; the slowest rank's time",
                variants={k: LABEL[k] for k in VARIANTS}, max_tokens=args.max_tokens_value)
    result = dict(meta=meta, jobs=[], cells=[], targets=[], errors=[])
    print(f"rumor {meta['rumor']} | {meta['hostname']}, {meta['cpus']} cpus, load {meta['loadavg_start'][0]:.2f} | "
          f"{args.ranks} ranks, batch {args.batch}, max_tokens {args.max_tokens_value:.0f}, iters {args.iters}")
    progress = Progress(len(VARIANTS) * (args.warmup + args.iters), unit="steps", quiet_s=10)
    drv = _common.Driver("rumor-sampler-bench-", progress, False)

    def body() -> int:
        job = Job(os.path.abspath(__file__), args, args.ranks, drv.workdir, progress, 0)
        rc = _common.run_jobs([job], result, progress)
        progress.clear()
        _common.finish_meta(meta)
        headline = None
        for c in result["cells"]:
            summarize(c)
            print_table(c, job.label)
            lb, tok = c["variants"]["lb"], c["variants"]["lb_tok"]
            for name, value in (("LB sampler step time vs DistributedSampler", lb["step_over_torch"]),
                                ("LB token batches samples/s vs DistributedSampler", tok["samples_per_s_over_torch"])):
                result["targets"].append(dict(name=f"{name} >= {TARGET}", value=value, met=value >= TARGET))
                print(f"target: {name}: {value:.2f}x (>= {TARGET}) -> {'MET' if value >= TARGET else 'NOT MET'}")
            imb = 100 * c["variants"]["torch"]["imbalance_padded_tokens"]
            headline = (f"headline: transformer {c['n']} ranks, lognormal lengths: DistributedSampler step / LB "
                        f"sampler step = {lb['step_over_torch']:.2f}x (token batches: "
                        f"{tok['samples_per_s_over_torch']:.2f}x samples/s); per-step token imbalance {imb:.0f}% "
                        f"-> {100 * lb['imbalance_padded_tokens']:.0f}%")
        draw = None if args.no_plot or not result["cells"] else (lambda: plot(png_path, result["cells"][0]))
        _common.write_results(result, headline, "headline: n/a (no results)", json_path, png_path, draw)
        return rc

    return drv.run(body)


if __name__ == "__main__":
    sys.exit(main())
