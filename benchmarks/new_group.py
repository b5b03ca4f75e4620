#!/usr/bin/env python
"""What a new communicator costs on a long link: rumor's new group (connection setup, then its
first and second large allreduce) vs a warm communicator vs gloo's new group, in one run (issue
46: DiLoCo averages on a group of its own, and torch's process groups are groups too).

    sudo python benchmarks/new_group.py                               # 4 hosts, 100 Mbit, 100 ms round trip
    sudo python benchmarks/new_group.py --rate 1gbit --delay 50ms --size 256MiB

Emulated hosts (rumor.testing.netns, one rank each) at --rate with --delay one way. Each rank
first runs two allreduces of --size bytes of float32 on rumor's world (untimed: the world's
channels connect and learn the path), then --repeats times:

  rumor connect     rumor.new_group(every rank), then an allreduce of 4 floats on it: the
                    group's channels connect on first use (a long link's streams, TLS if on)
  rumor first       the group's first allreduce of --size bytes
  rumor second      its second
  rumor warm        the same on the world's communicator, for comparison
  gloo connect      torch.distributed.new_group(backend="gloo") and an allreduce of 4 floats
  gloo first        that group's first allreduce of --size bytes

Times are the slowest rank's, each step after a barrier. Bounds: connect, the round trip
(nothing connects in less); a large allreduce, the ring bound 2 (n-1)/n * S / R at the link's
rate R (round trips add to it). Output: a table (median [min-max] over the repeats, fraction of
the bound), JSON with every sample and a PNG in --out; the last line is the headline.
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

STEPS = ("rumor connect", "rumor first", "rumor second", "rumor warm", "gloo connect", "gloo first")


# ---- a rank ------------------------------------------------------------------------------------

def _body(cfg, rank: int, n: int) -> None:
    import torch
    import torch.distributed as dist

    import rumor

    big = torch.empty(cfg["size"] // 4)
    tiny = torch.empty(4)
    want = float(n * (n + 1) // 2)

    def fill_and_check(t, run, name):
        t.fill_(float(rank + 1))
        run(t)
        if t[0].item() != want or t[-1].item() != want:
            raise AssertionError(f"{name}: allreduce gave {t[0].item()} .. {t[-1].item()}, expected {want}")

    for _ in range(2):  # the world's channels connect and learn the path
        fill_and_check(big, lambda t: rumor.allreduce_(t, rumor.ReduceOp.SUM), "warm-up")
    samples = {s: [] for s in STEPS}

    def timed(step, fn):
        rumor.barrier()
        t0 = time.perf_counter()
        fn()
        samples[step].append(time.perf_counter() - t0)

    for _ in range(cfg["repeats"]):
        holder = {}

        def rumor_connect():
            holder["g"] = rumor.new_group(list(range(n)))
            fill_and_check(tiny, lambda t: rumor.allreduce_(t, rumor.ReduceOp.SUM, group=holder["g"]), step)

        step = "rumor connect"
        timed(step, rumor_connect)
        for step in ("rumor first", "rumor second"):
            timed(step, lambda: fill_and_check(big, lambda t: rumor.allreduce_(t, rumor.ReduceOp.SUM,
                                                                               group=holder["g"]), step))
        step = "rumor warm"
        timed(step, lambda: fill_and_check(big, lambda t: rumor.allreduce_(t, rumor.ReduceOp.SUM), step))

        def gloo_connect():
            holder["pg"] = dist.new_group(backend="gloo")
            fill_and_check(tiny, lambda t: dist.all_reduce(t, group=holder["pg"]), step)

        step = "gloo connect"
        timed(step, gloo_connect)
        step = "gloo first"
        timed(step, lambda: fill_and_check(big, lambda t: dist.all_reduce(t, group=holder["pg"]), step))
    every = [None] * n
    dist.all_gather_object(every, samples)
    if rank == 0:
        for s in STEPS:
            slowest = [max(r[s][i] for r in every) for i in range(len(samples[s]))]
            _common.emit("cell", dict(variant=s, samples=slowest))


def _describe(rank: int, n: int):
    return dict(rank=rank)


def worker(cfg_path: str) -> int:
    return _common.worker_main(cfg_path, _describe, _body)


# ---- the driver --------------------------------------------------------------------------------

class NewGroupJob(_common.Job):
    def config(self):
        a = self.args
        return dict(size=a.size_bytes, repeats=a.repeats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="100mbit", help="tbf rate of each host's link")
    ap.add_argument("--delay", default="50ms", help="one-way delay of every link (50ms: a 100 ms round trip)")
    ap.add_argument("--loss", type=float, default=None, help="packet loss probability, e.g. 0.001")
    ap.add_argument("--size", default="64MiB")
    ap.add_argument("--repeats", type=int, default=2, help="new groups per library")
    _common.add_run_args(ap)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    from rumor.testing import netns

    n = args.hosts
    if n < 2 or args.repeats < 1:
        ap.error("--hosts must be >= 2 and --repeats >= 1")
    args.size_bytes = _common.parse_size(args.size)
    if args.size_bytes < 16 or args.size_bytes % 4:
        ap.error("--size must be a multiple of 4 bytes, at least 16")
    args.ranks_per_host, args.jitter = 1, None
    rtt = 2 * netns.parse_time(args.delay)
    ring = 2 * (n - 1) / n * args.size_bytes * 8 / netns.parse_rate_bps(args.rate)
    bounds = {s: (rtt if s.endswith("connect") else ring) for s in STEPS}
    meta = _common.run_meta(args)
    result = dict(meta=meta, bounds=dict(round_trip_s=rtt, ring_s=ring), cells=[], jobs=[], errors=[])
    progress = _common.Progress(1)
    driver = _common.Driver("rumor-newgroup-", progress, True)

    def body() -> int:
        ok, why = netns.available()
        if not ok:
            print(f"new_group: emulated hosts unavailable: {why}")
            return 1
        driver.cluster = netns.Cluster(n, args.rate, **_common.wan_kwargs(args)).start()
        job = NewGroupJob(os.path.abspath(__file__), args, n, driver.workdir, progress, 0, cluster=driver.cluster)
        return _common.run_jobs([job], result, progress)

    rc = driver.run(body)
    _common.finish_meta(meta)
    med = {c["variant"]: statistics.median(c["samples"]) for c in result["cells"]}
    print(f"\n{n} emulated hosts x 1 rank, tbf {args.rate}, round trip {rtt * 1e3:g} ms"
          + (f", loss {args.loss}" if args.loss else "") + f"; allreduce {args.size} float32, {args.repeats} new groups")
    print(f"bounds: connect {rtt:.2f} s (one round trip), large allreduce {ring:.2f} s (ring)")
    print(f"{'step':>14} | {'median s':>9} {'[min-max]':>17} | {'bound/time':>10}")
    for c in result["cells"]:
        v, t = c["variant"], med[c["variant"]]
        print(f"{v:>14} | {t:9.2f} [{min(c['samples']):7.2f}-{max(c['samples']):7.2f}] | {bounds[v] / t:10.2f}")
        c.update(median_s=t, fraction_of_bound=bounds[v] / t)
    headline = None
    if all(s in med for s in STEPS):
        rumor_new = med["rumor connect"] + med["rumor first"]
        gloo_new = med["gloo connect"] + med["gloo first"]
        headline = (f"headline: a new group's connect + first {args.size} allreduce: rumor {rumor_new:.2f} s, "
                    f"gloo {gloo_new:.2f} s ({gloo_new / rumor_new:.2f}x); rumor's first {med['rumor first']:.2f} s "
                    f"= {med['rumor first'] / med['rumor warm']:.2f}x its warm allreduce, "
                    f"{ring / med['rumor first']:.2f} of the ring bound")
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "new_group.json")
    png_path = os.path.join(args.out, "new_group.png")

    def plot():
        plt = _common.pyplot()
        if plt is None:
            return "no matplotlib: no plot"
        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = [c["variant"] for c in result["cells"]]
        ax.bar(names, [med[v] for v in names],
               color=["tab:gray" if v.startswith("gloo") else "tab:blue" for v in names])
        ax.axhline(ring, color="k", ls="--", label=f"ring bound {ring:.2f} s")
        ax.set_ylabel("time (s), slowest rank")
        ax.set_title(f"new group on {n} hosts, {args.rate}, {rtt * 1e3:g} ms round trip, {args.size}")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=8)
        _common.save_figure(plt, fig, png_path)
        return None

    _common.write_results(result, headline, "headline: n/a (the job did not finish)", json_path, png_path,
                          None if args.no_plot else plot)
    return rc


if __name__ == "__main__":
    sys.exit(main())
