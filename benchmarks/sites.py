#!/usr/bin/env python
"""Sites joined by one slow link: rumor's allreduce grouped by site (RUMOR_SITE) vs its flat ring
vs gloo, against the best schedule's bound, in one run (issue 46, "heterogeneous links").

    sudo python benchmarks/sites.py                      # 2 sites x 2 hosts, 1 Gbit/5 ms inside, 100 Mbit/80 ms between
    sudo python benchmarks/sites.py --size 16MiB --iters 5

The emulated hosts (rumor.testing.netns, one rank each) sit in --sites sites of --hosts-per-site.
Inside a site every pair has a wire of its own at --fast with --fast-rtt; between sites each host
has one uplink at --slow (its traffic to every host of the other sites shares it) with --slow-rtt.
Per job, --iters timed allreduces of --size bytes of float32 (after --warmup), SUM:

  rumor sites   RUMOR_SITE set: reduce-scatter inside the site, allreduce of each 1/m block with
                the same member of the other sites, allgather inside (equal sites), the three
                phases overlapped piece by piece
  rumor sites seq  the same with RUMOR_SITE_OVERLAP=0: the phases one after the other (at best
                (2 (m-1)/m S/F + the slow part) for fast links of rate F: 0.83 of the bound here)
  rumor ring    no RUMOR_SITE: rumor's default for this size (the ring, in rank order = site order)
  gloo          torch.distributed on gloo in the same processes as "rumor ring"

Bounds (bytes over the slow uplinks only, the fast links taken as free):
  best   a site must receive what the other sites hold: k sites of m uplinks at rate R move an
         allreduce of S bytes no faster than 2 (k-1)/k * S / (m R) (reduce-scatter plus allgather
         among the k sites, each site's m uplinks working at once)
  ring   the flat ring in site order: each of its 2 (n-1) steps sends S/n over a slow uplink
         wherever the ring crosses sites: 2 (n-1)/n * S / R
Output: a table (time median [min-max], fraction of the best bound, speedups), JSON with every
sample and a PNG in --out; the last line is the headline.
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

VARIANTS = ("rumor sites", "rumor sites seq", "rumor ring", "gloo")


# ---- a rank ------------------------------------------------------------------------------------

def _body(cfg, rank: int, n: int) -> None:
    import torch
    import torch.distributed as dist

    import rumor

    count = cfg["size"] // 4
    x = torch.full((count,), float(rank + 1))
    want = float(n * (n + 1) // 2)
    sites_name = "rumor sites" if cfg["overlap"] else "rumor sites seq"
    runs = {sites_name: lambda: rumor.allreduce_(x, rumor.ReduceOp.SUM, algorithm="hierarchical")} \
        if cfg["sites_on"] else {"rumor ring": lambda: rumor.allreduce_(x, rumor.ReduceOp.SUM),
                                 "gloo": lambda: dist.all_reduce(x)}
    for name, fn in runs.items():
        samples = []
        for i in range(cfg["warmup"] + cfg["iters"]):
            x.fill_(float(rank + 1))
            rumor.barrier()
            t0 = time.perf_counter()
            fn()
            took = time.perf_counter() - t0
            if x[0].item() != want or x[-1].item() != want:
                raise AssertionError(f"{name}: allreduce gave {x[0].item()}, expected {want}")
            if i >= cfg["warmup"]:
                samples.append(took)
        times = [None] * n
        dist.all_gather_object(times, samples)
        if rank == 0:
            slowest = [max(t[i] for t in times) for i in range(len(samples))]
            _common.emit("cell", dict(variant=name, samples=slowest))


def _describe(rank: int, n: int):
    return dict(rank=rank, site=os.environ.get("RUMOR_SITE", ""))


def worker(cfg_path: str) -> int:
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg["sites_on"]:
        os.environ["RUMOR_SITE"] = cfg["sites"][int(os.environ["RANK"])]
        os.environ["RUMOR_SITE_OVERLAP"] = "1" if cfg["overlap"] else "0"
    return _common.worker_main(cfg_path, _describe, _body)


# ---- the driver --------------------------------------------------------------------------------

class SitesJob(_common.Job):
    def __init__(self, sites_on: bool, overlap: bool, *a, **kw):
        super().__init__(*a, **kw)
        self.sites_on = sites_on
        self.overlap = overlap

    @property
    def label(self) -> str:
        return f"{self.n} emulated hosts, " + (("RUMOR_SITE set" + ("" if self.overlap else ", phases in sequence"))
                                               if self.sites_on else "no RUMOR_SITE")

    def config(self):
        a = self.args
        return dict(size=a.size_bytes, iters=a.iters, warmup=a.warmup, sites_on=self.sites_on, overlap=self.overlap,
                    sites=[f"site{h // a.hosts_per_site}" for h in range(self.n)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--hosts-per-site", type=int, default=2)
    ap.add_argument("--fast", default="1gbit", help="rate of each pair's wire inside a site")
    ap.add_argument("--fast-rtt", default="5ms")
    ap.add_argument("--slow", default="100mbit", help="rate of each host's uplink to the other sites")
    ap.add_argument("--slow-rtt", default="80ms")
    ap.add_argument("--size", default="64MiB")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--jobs", default="sites,seq,ring", help="which jobs: sites (RUMOR_SITE set), seq (RUMOR_SITE "
                    "set, RUMOR_SITE_OVERLAP=0), ring (rumor's flat ring and gloo), comma-separated")
    ap.add_argument("--no-slow-start-after-idle", action="store_true",
                    help="set net.ipv4.tcp_slow_start_after_idle=0 in every emulated host (all variants): "
                         "a connection idle between two allreduces then keeps its window, as WAN-tuned hosts do")
    _common.add_run_args(ap)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    from rumor.testing import netns

    k, m = args.sites, args.hosts_per_site
    if k < 2 or m < 1:
        ap.error("--sites must be >= 2 and --hosts-per-site >= 1")
    n = k * m
    args.size_bytes = _common.parse_size(args.size)
    args.hosts, args.ranks_per_host, args.rate = n, 1, f"{args.fast} inside, {args.slow} between"
    site = lambda h: h // m  # noqa: E731
    fast_d, slow_d = netns.parse_time(args.fast_rtt) / 2, netns.parse_time(args.slow_rtt) / 2
    slow_bps = netns.parse_rate_bps(args.slow)
    wan = dict(delay=lambda i, j: fast_d if site(i) == site(j) else slow_d,
               link_rate=lambda i, j: args.fast if site(i) == site(j) else args.slow,
               link_wire=lambda i, j: (i, j) if site(i) == site(j) else ("uplink", i))
    want_jobs = set(args.jobs.split(","))
    if not want_jobs or not want_jobs <= {"sites", "seq", "ring"}:
        ap.error(f"--jobs takes sites, seq and/or ring, got {args.jobs!r}")
    S = args.size_bytes
    best = 2 * (k - 1) / k * S * 8 / (m * slow_bps)
    ring = 2 * (n - 1) / n * S * 8 / slow_bps
    meta = _common.run_meta(args)
    result = dict(meta=meta, bounds=dict(best_s=best, ring_s=ring), cells=[], jobs=[], errors=[])
    progress = _common.Progress(len(want_jobs))
    driver = _common.Driver("rumor-sites-", progress, True)

    def body() -> int:
        ok, why = netns.available()
        if not ok:
            print(f"sites: emulated hosts unavailable: {why}")
            return 1
        driver.cluster = netns.Cluster(n, **wan).start()
        if args.no_slow_start_after_idle:
            for h in range(n):
                driver.cluster.run(h, ["sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0"], check=True)
        wanted = [(on, overlap) for on, overlap, name in ((True, True, "sites"), (True, False, "seq"),
                                                          (False, True, "ring")) if name in want_jobs]
        jobs = [SitesJob(on, overlap, os.path.abspath(__file__), args, n, driver.workdir, progress, i,
                         cluster=driver.cluster)
                for i, (on, overlap) in enumerate(wanted)]
        rc = _common.run_jobs(jobs, result, progress)
        result["wan_stats"] = driver.cluster.wan_stats()
        return rc

    rc = driver.run(body)
    _common.finish_meta(meta)
    med = {c["variant"]: statistics.median(c["samples"]) for c in result["cells"]}
    print(f"\n{k} sites x {m} hosts (1 rank each): inside {args.fast}/{args.fast_rtt}, between "
          f"{args.slow}/{args.slow_rtt} per host uplink; allreduce {args.size} float32, {args.iters} iters"
          + ("; tcp_slow_start_after_idle=0" if args.no_slow_start_after_idle else ""))
    print(f"bounds: best schedule {best:.2f} s, flat ring {ring:.2f} s")
    print(f"{'variant':>15} | {'median s':>9} {'[min-max]':>15} | {'best/time':>9} | {'vs ring':>7} {'vs gloo':>7}")
    for c in result["cells"]:
        v, t = c["variant"], med[c["variant"]]
        lo, hi = min(c["samples"]), max(c["samples"])
        vs = lambda o: f"{med[o] / t:6.2f}x" if o in med else "    n/a"  # noqa: E731
        print(f"{v:>15} | {t:9.2f} [{lo:6.2f}-{hi:6.2f}] | {best / t:9.2f} | {vs('rumor ring')} {vs('gloo')}")
        c.update(median_s=t, fraction_of_best=best / t)
    headline = None
    if "rumor sites" in med:
        headline = (f"headline: rumor sites {med['rumor sites']:.2f} s = {best / med['rumor sites']:.2f} of the best "
                    f"schedule's bound ({best:.2f} s)" +
                    (f"; phases in sequence {best / med['rumor sites seq']:.2f} of it"
                     if "rumor sites seq" in med else "") +
                    (f"; {med['rumor ring'] / med['rumor sites']:.2f}x rumor's ring" if "rumor ring" in med else "") +
                    (f", {med['gloo'] / med['rumor sites']:.2f}x gloo" if "gloo" in med else ""))
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "sites.json")
    png_path = os.path.join(args.out, "sites.png")

    def plot():
        plt = _common.pyplot()
        if plt is None:
            return "no matplotlib: no plot"
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = [c["variant"] for c in result["cells"]]
        colors = {"rumor sites": "tab:green", "rumor sites seq": "tab:olive", "rumor ring": "tab:blue",
                  "gloo": "tab:gray"}
        ax.bar(names, [med[v] for v in names], color=[colors[v] for v in names])
        ax.axhline(best, color="k", ls="--", label=f"best schedule {best:.2f} s")
        ax.axhline(ring, color="tab:red", ls=":", label=f"flat ring {ring:.2f} s")
        ax.set_ylabel("allreduce time (s)")
        ax.set_title(f"{k} sites x {m} hosts, {args.size}: {args.slow}/{args.slow_rtt} between")
        ax.legend(fontsize=8)
        _common.save_figure(plt, fig, png_path)
        return None

    _common.write_results(result, headline, "headline: n/a (the sites job did not finish)", json_path, png_path,
                          None if args.no_plot else plot)
    return rc


if __name__ == "__main__":
    sys.exit(main())
