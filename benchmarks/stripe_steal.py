#!/usr/bin/env python
"""Striped messages over a lossy long link: pieces taken by whichever stream is free (work
stealing, the default) vs one fixed stripe per stream (RUMOR_STRIPE_STEAL=0), in one run
(issue 46, "large transfers striped across them with work stealing").

    sudo python benchmarks/stripe_steal.py                      # 2 hosts, 200 Mbit, 10 ms RTT, 0.1% loss, 4 streams
    sudo python benchmarks/stripe_steal.py --loss 0 --rounds 1  # the same without loss: stealing must cost nothing

Two emulated hosts (rumor.testing.netns, one rank each) joined by one wire at --rate with --rtt
and --loss each way (rumor-wanem). Every pair has RUMOR_SOCKET_STREAMS=--streams TCP streams;
loss cuts each stream's congestion window on its own, so at any moment some streams carry more
than others. A message striped in fixed 1/k shares ends with its slowest stream; with stealing
the streams that are ahead take the remaining pieces.

Jobs alternate steal, fixed, steal, fixed... (--rounds of each); each times --iters allreduces
of --size bytes of float32 after --warmup. The bound is the wire: an allreduce of S bytes over 2
ranks sends S bytes each way, so no schedule beats S / rate.
Output: a table (median [min-max] seconds, bound/time, fixed/steal), JSON with every sample and
a PNG in --out; the last line is the headline.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common  # noqa: E402
from collectives import parse_size  # noqa: E402

MODES = ("steal", "fixed")


def _body(cfg, rank: int, n: int) -> None:
    import torch
    import torch.distributed as dist

    import rumor

    x = torch.empty(cfg["size"] // 4)
    want = float(n * (n + 1) // 2)
    samples = []
    for i in range(cfg["warmup"] + cfg["iters"]):
        x.fill_(float(rank + 1))
        rumor.barrier()
        t0 = time.perf_counter()
        rumor.allreduce_(x, rumor.ReduceOp.SUM)
        took = time.perf_counter() - t0
        if x[0].item() != want or x[-1].item() != want:
            raise AssertionError(f"allreduce gave {x[0].item()}, expected {want}")
        if i >= cfg["warmup"]:
            samples.append(took)
    times = [None] * n
    dist.all_gather_object(times, samples)
    if rank == 0:
        slowest = [max(t[i] for t in times) for i in range(len(samples))]
        _common.emit("cell", dict(variant=cfg["mode"], round=cfg["round"], samples=slowest))


def _describe(rank: int, n: int):
    return dict(rank=rank, steal=os.environ.get("RUMOR_STRIPE_STEAL"), streams=os.environ.get("RUMOR_SOCKET_STREAMS"))


def worker(cfg_path: str) -> int:
    with open(cfg_path) as f:
        cfg = json.load(f)
    os.environ["RUMOR_STRIPE_STEAL"] = "1" if cfg["mode"] == "steal" else "0"
    os.environ["RUMOR_SOCKET_STREAMS"] = str(cfg["streams"])
    return _common.worker_main(cfg_path, _describe, _body)


class StealJob(_common.Job):
    def __init__(self, mode: str, rnd: int, *a, **kw):
        super().__init__(*a, **kw)
        self.mode, self.rnd = mode, rnd

    @property
    def label(self) -> str:
        return f"2 emulated hosts, {self.mode} stripes, round {self.rnd + 1}"

    def config(self):
        a = self.args
        return dict(size=a.size_bytes, iters=a.iters, warmup=a.warmup, mode=self.mode, round=self.rnd,
                    streams=a.streams)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default="200mbit", help="the wire between the two hosts")
    ap.add_argument("--rtt", default="10ms")
    ap.add_argument("--loss", type=float, default=0.001, help="drop probability of each packet, each way")
    ap.add_argument("--streams", type=int, default=4, help="RUMOR_SOCKET_STREAMS")
    ap.add_argument("--size", default="16MiB")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="jobs per mode, alternating")
    ap.add_argument("--seed", type=int, default=1)
    _common.add_run_args(ap)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    from rumor.testing import netns

    args.size_bytes = parse_size(args.size)
    args.hosts, args.ranks_per_host = 2, 1
    args.rate_label = f"{args.rate}, RTT {args.rtt}, loss {args.loss:g}"
    bound = args.size_bytes * 8 / netns.parse_rate_bps(args.rate)
    meta = _common.run_meta(args)
    result = dict(meta=meta, bound_s=bound, cells=[], jobs=[], errors=[])
    progress = _common.Progress(2 * args.rounds)
    driver = _common.Driver("rumor-steal-", progress, True)

    def body() -> int:
        ok, why = netns.available()
        if not ok:
            print(f"stripe_steal: emulated hosts unavailable: {why}")
            return 1
        driver.cluster = netns.Cluster(2, delay=netns.parse_time(args.rtt) / 2, loss=args.loss,
                                       link_rate=args.rate, seed=args.seed).start()
        jobs = [StealJob(mode, r, os.path.abspath(__file__), args, 2, driver.workdir, progress, 2 * r + i,
                         cluster=driver.cluster)
                for r in range(args.rounds) for i, mode in enumerate(MODES)]
        rc = _common.run_jobs(jobs, result, progress)
        result["wan_stats"] = driver.cluster.wan_stats()
        return rc

    rc = driver.run(body)
    _common.finish_meta(meta)
    samples = {m: [s for c in result["cells"] if c["variant"] == m for s in c["samples"]] for m in MODES}
    med = {m: statistics.median(v) for m, v in samples.items() if v}
    print(f"\n2 emulated hosts (1 rank each): {args.rate}, RTT {args.rtt}, loss {args.loss:g} each way; "
          f"{args.streams} streams per pair; allreduce {args.size} float32, {args.iters} iters x {args.rounds} jobs "
          f"per mode")
    print(f"bound (the wire): {bound:.3f} s")
    print(f"{'stripes':>8} | {'median s':>9} {'[min-max]':>17} | {'bound/time':>10}")
    for m in MODES:
        if m not in med:
            continue
        print(f"{m:>8} | {med[m]:9.3f} [{min(samples[m]):6.3f}-{max(samples[m]):6.3f}] | {bound / med[m]:10.2f}")
    result["medians_s"] = med
    headline = None
    if len(med) == 2:
        result["fixed_over_steal"] = med["fixed"] / med["steal"]
        headline = (f"headline: striped allreduce {args.size} over {args.rate}/{args.rtt}/loss {args.loss:g}, "
                    f"{args.streams} streams: stealing {med['steal']:.3f} s ({bound / med['steal']:.2f} of the wire), "
                    f"fixed stripes {med['fixed']:.3f} s ({bound / med['fixed']:.2f}); fixed/steal = "
                    f"{med['fixed'] / med['steal']:.2f}x")
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "stripe_steal.json")
    png_path = os.path.join(args.out, "stripe_steal.png")

    def plot():
        plt = _common.pyplot()
        if plt is None:
            return "no matplotlib: no plot"
        fig, ax = plt.subplots(figsize=(5, 3.5))
        names = [m for m in MODES if m in med]
        ax.boxplot([samples[m] for m in names], tick_labels=names)
        ax.axhline(bound, color="k", ls="--", label=f"wire bound {bound:.2f} s")
        ax.set_ylabel("allreduce time (s)")
        ax.set_title(f"{args.size}, {args.rate}/{args.rtt}/loss {args.loss:g}, {args.streams} streams")
        ax.legend(fontsize=8)
        _common.save_figure(plt, fig, png_path)
        return None

    _common.write_results(result, headline, "headline: n/a (a job did not finish)", json_path, png_path,
                          None if args.no_plot else plot)
    return rc


if __name__ == "__main__":
    sys.exit(main())
