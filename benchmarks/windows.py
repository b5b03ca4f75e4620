#!/usr/bin/env python
"""One-sided window benchmark: rumor.win_put / win_accumulate / win_update vs torch.distributed
(gloo) send/recv and rumor.neighbor_allreduce, per benchmarks/BENCHMARKS.md.

Needs: the installed rumor package, torch, and for the plot `pip install matplotlib`.

Modes
  one host (default): 4 ranks on this machine (--ranks). Bound: single-threaded memcpy bandwidth
      of the same size on one rank (variant memcpy_1rank below: torch copy_ between preallocated
      buffers on rank 0 while the other ranks are idle), measured in the same job, interleaved
      with the other variants, so that it sees the same machine load; the driver process also
      measures it before and after the jobs (printed and in the JSON, as a cross-check).
  --hosts H: H emulated hosts (Linux network namespaces on one bridge, rumor.testing.netns), each
      host's link shaped with `tbf rate 1gbit burst 256kb latency 20ms` (--rate), --ranks-per-host
      ranks each (default 1). Needs root. Bound: the link rate B (every rank sends S bytes to
      rank+1 and receives S bytes from rank-1, so each host link carries S per op and direction),
      and the single-stream TCP throughput through one shaped link measured in the same run.

What one sample of each variant is (every rank at once, rank r's neighbours right = r+1 and
left = r-1 modulo n; the tensor is S bytes of fp32):
  win_put             rumor.win_put(src, name, dst_weights={right: 1.0})   (blocking: returns when
                      the write landed in the target's slot, i.e. the target's acknowledgement;
                      src is a separate tensor, not the registered one, so no publish is timed)
  win_put_1pair       the same put, on rank 0 only (to rank 1; the others wait at the next barrier):
                      one stream of writes, the same concurrency as memcpy_1rank, so their ratio is
                      the put's efficiency; win_put (all ranks at once) compares with
                      memcpy_all_ranks
  win_accumulate      rumor.win_accumulate(src, name, dst_weights={right: 1.0})
  win_update          rumor.win_update(name, 0.5, {left: 0.5})   (in place: combines one slot into
                      the registered tensor, which it then publishes; purely local)
  gloo_sendrecv       dist.isend(src, right); dist.recv(buf, left); wait   (the peer)
  neighbor_allreduce  rumor.neighbor_allreduce(src, self_weight=0.5, src_weights={left: 0.5},
                      dst_weights={right: 1.0})   (a one-directional ring: the same bytes on the
                      same pairs as the put, plus the combine; a second reference)
  memcpy_1rank        dst.copy_(src) of S bytes on rank 0 only (one thread; the others wait at the
                      next barrier, which blocks without spinning): the bound
  memcpy_all_ranks    dst.copy_(src) of S bytes on every rank at once (one thread each): what the
                      machine gives when all ranks copy together (on a machine with fewer cores
                      than ranks this is well below the 1-rank bound)
Per size: the results of every variant are checked once against exact values (small integers,
so weighted sums are exact), then warm-up, then --iters samples per variant, rotating which
variant goes first. A sample starts after a gloo barrier and times `reps` back-to-back ops
(reps > 1 only for small sizes, the same for every variant, so a sample lasts >= --target-ms);
its time is the slowest rank's elapsed time / reps. Reported: median and min-max over samples;
GB/s = S / median time (1e9 B/s) = bytes each rank moved per second.

Output: a table per job, JSON with every raw figure and a PNG plot in --out (default
benchmarks/results/windows-<mode>.{json,png}); the last line printed is the headline ratio
(win_put bandwidth for the largest size over the memcpy bound, or over the link rate).

  python benchmarks/windows.py                       # one host, 4 ranks, 1/16/64 MiB, 20 iters
  python benchmarks/windows.py --quick               # under a minute: 1 and 64 MiB, 10 iters
  sudo python benchmarks/windows.py --hosts 4        # 4 emulated hosts x 1 rank, 1 Gbit
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
from _common import Progress, emit, parse_rate
from collectives import MiB, _describe, fmt_bw, fmt_size, measure_memcpy, parse_size

VARIANTS = ("win_put", "win_put_1pair", "win_accumulate", "win_update", "gloo_sendrecv", "neighbor_allreduce", "memcpy_1rank",
            "memcpy_all_ranks")
WIN_OPS = ("win_put", "win_put_1pair", "win_accumulate", "win_update")
NETWORK = ("win_put", "win_put_1pair", "win_accumulate", "gloo_sendrecv", "neighbor_allreduce")  # move bytes between ranks
DEFAULT_SIZES = "1MiB,16MiB,64MiB"
QUICK_SIZES = "1MiB,64MiB"  # the headline size of a full run, so quick headlines compare


# ==== inside a rank ==================================================================================

def _template(numel: int, owner: int):
    """Rank `owner`'s data: integers 1..13 (period 13), so every weighted sum here is exact."""
    import torch

    period = ((torch.arange(13) * 5 + owner * 3) % 13 + 1).to(torch.float32)
    reps = -(-numel // 13)
    return period.repeat(reps)[:numel].clone()


def _measure(cfg: Dict, rank: int, n: int) -> None:
    import torch
    import torch.distributed as dist

    import rumor

    if n < 2:
        raise ValueError("the window benchmark needs at least 2 ranks")
    right, left = (rank + 1) % n, (rank - 1) % n
    variants = [v for v in VARIANTS if v in cfg["variants"]]
    iters, warmup = cfg["iters"], cfg["warmup"]
    units_per_size = iters + 1

    def run_cell(size: int, ci: int) -> None:
        numel = size // 4
        name = f"bench-{ci}-{size}"
        mine, theirs = _template(numel, rank), _template(numel, left)
        x = mine.clone()  # the registered tensor (win_update writes into it)
        src = mine.clone()  # what is put / accumulated / sent
        recv = torch.empty(numel, dtype=torch.float32)
        mc_src, mc_dst = mine.clone(), torch.empty(numel, dtype=torch.float32)
        rumor.win_create(x, name, zero_init=True)

        def sendrecv():
            req = dist.isend(src, right)
            dist.recv(recv, left)
            req.wait()

        nar_out = {}

        def nar():
            nar_out["t"] = rumor.neighbor_allreduce(src, self_weight=0.5, src_weights={left: 0.5},
                                                    dst_weights={right: 1.0})

        fns = {
            "win_put": lambda: rumor.win_put(src, name, dst_weights={right: 1.0}),
            "win_put_1pair": lambda: rumor.win_put(src, name, dst_weights={1: 1.0}) if rank == 0 else None,
            "win_accumulate": lambda: rumor.win_accumulate(src, name, dst_weights={right: 1.0}),
            "win_update": lambda: rumor.win_update(name, 0.5, {left: 0.5}),
            "gloo_sendrecv": sendrecv,
            "neighbor_allreduce": nar,
            "memcpy_1rank": lambda: mc_dst.copy_(mc_src) if rank == 0 else None,
            "memcpy_all_ranks": lambda: mc_dst.copy_(mc_src),
        }

        # ---- correctness, once per size (untimed): every variant against exact values
        correct: Dict[str, object] = {}

        def check(v: str, got, want) -> None:
            if torch.equal(got, want):
                correct[v] = True
            else:
                bad = (got != want).nonzero()
                i = int(bad[0]) if len(bad) else -1
                correct[v] = (f"rank {rank}: {v} {fmt_size(size)} wrong: first bad index {i} "
                              f"(got {float(got[i])}, want {float(want[i])}), {len(bad)} bad elements")

        rumor.win_put(src, name, dst_weights={right: 1.0})
        dist.barrier()
        check("win_put", rumor.win_update(name, 0.0, {left: 1.0}, clone=True), theirs)
        # Rank 1's check above read the slot that rank 0 wrote: win_put_1pair's write.
        correct["win_put_1pair"] = correct["win_put"]
        dist.barrier()  # the left neighbour's accumulate below must not land before this check
        rumor.win_accumulate(src, name, dst_weights={right: 1.0})
        dist.barrier()
        check("win_accumulate", rumor.win_update(name, 0.0, {left: 1.0}, clone=True), 2 * theirs)
        out = rumor.win_update(name, 0.5, {left: 0.5}, clone=True)  # slot = 2 * theirs, x = mine
        check("win_update", out, 0.5 * mine + theirs)
        check("win_update(registered tensor untouched by clone=True)", x, mine)
        dist.barrier()
        sendrecv()
        check("gloo_sendrecv", recv, theirs)
        nar()
        check("neighbor_allreduce", nar_out["t"], 0.5 * mine + 0.5 * theirs)
        mc_dst.copy_(mc_src)
        check("memcpy_all_ranks", mc_dst, mine)
        correct["memcpy_1rank"] = correct["memcpy_all_ranks"]
        del out
        dist.barrier()

        # ---- warm-up (timed, to choose reps)
        warm = {v: [] for v in variants}
        for _ in range(warmup):
            for v in variants:
                dist.barrier()
                t0 = time.perf_counter()
                fns[v]()
                warm[v].append(time.perf_counter() - t0)
        # per variant the slowest rank's fastest warm-up op, then the quickest variant
        t = torch.tensor([min(warm[v]) for v in variants], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        reps = max(1, min(cfg["max_reps"], math.ceil(cfg["target_s"] / max(float(t.min()), 1e-7))))
        if rank == 0:
            emit("progress", dict(done=ci * units_per_size + 1, label=f"{fmt_size(size)}: warm-up done, reps {reps}"))

        # ---- samples
        samples = {v: [] for v in variants}
        for i in range(iters):
            k = i % len(variants)
            for v in variants[k:] + variants[:k]:  # rotate who goes first
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fns[v]()
                samples[v].append((time.perf_counter() - t0) / reps)
            if rank == 0:
                emit("progress", dict(done=ci * units_per_size + 2 + i, label=f"{fmt_size(size)}: sample {i + 1}/{iters}"))
        dist.barrier()
        rumor.win_free(name)

        per_rank = _common.gather_samples(samples)  # a sample's time is the slowest rank's
        oks = [None] * n
        dist.all_gather_object(oks, correct)
        if rank == 0:
            cell = dict(size=size, n=n, reps=reps, warmup_s=warm, variants={},
                        checks={k: [o.get(k) for o in oks] for k in correct})
            for v in variants:
                sm = [max(per_rank[v][r][i] for r in range(n)) for i in range(iters)]
                errs = [o[v] for o in oks if o.get(v) is not True]
                cell["variants"][v] = dict(samples_s=sm, per_rank_samples_s=per_rank[v], correct=not errs,
                                           errors=errs[:4])
            extra = [o[k] for o in oks for k in o if k not in variants and o[k] is not True]
            if extra:
                cell["other_errors"] = extra[:4]
            emit("cell", cell)

    for ci, size in enumerate(cfg["sizes"]):
        run_cell(size, ci)


# ==== the driver =====================================================================================

class Job(_common.Job):
    """One set of ranks running every size."""

    def __init__(self, args, n: int, sizes: List[int], variants: List[str], workdir: str, progress: Progress,
                 base: int, cluster=None):
        super().__init__(os.path.abspath(__file__), args, n, workdir, progress, base, cluster)
        self.sizes, self.variants = sizes, variants

    @property
    def label(self) -> str:
        return f"{self.hosts} hosts x {self.rph} rank(s)" if self.cluster is not None else f"{self.n} ranks, 1 host"

    def config(self) -> Dict:
        a = self.args
        return dict(sizes=self.sizes, variants=self.variants, iters=a.iters, warmup=a.warmup,
                    target_s=a.target_ms / 1e3, max_reps=a.max_reps)

    def on_message(self, kind: str, data) -> None:
        if kind == "progress":
            self.progress.update(self.base + data["done"], f"{self.label}: {data['label']}")
        elif kind == "cell":
            self.progress.update(self.base + len(self.cells) * (self.args.iters + 1),
                                 f"{self.label}: {fmt_size(data['size'])} done")


def summarize(cell: Dict, driver_memcpy_bw: float, link_Bps: Optional[float], tcp_Bps: Optional[float]) -> None:
    """Adds median/min/max, GB/s and the ratios to every variant of a cell (in place). The memcpy
    bound is the cell's memcpy_1rank variant (same job, interleaved); the driver's figure only
    where that variant was not run."""
    size = cell["size"]
    for v, d in cell["variants"].items():
        s = d["samples_s"]
        d["median_s"], d["min_s"], d["max_s"] = statistics.median(s), min(s), max(s)
        d["bw"] = size / d["median_s"]
        d["bw_min"], d["bw_max"] = size / d["max_s"], size / d["min_s"]
    m1 = cell["variants"].get("memcpy_1rank")
    memcpy_bw = m1["bw"] if m1 else driver_memcpy_bw
    cell["memcpy_bound_source"] = "memcpy_1rank (in the job)" if m1 else "driver process (before/after)"
    for d in cell["variants"].values():
        d["over_memcpy"] = d["bw"] / memcpy_bw
    g = cell["variants"].get("gloo_sendrecv")
    for v, d in cell["variants"].items():
        d["over_gloo"] = g["median_s"] / d["median_s"] if g else float("nan")
        if link_Bps and v in NETWORK:
            d["over_link"] = d["bw"] / link_Bps
            d["over_tcp"] = d["bw"] / tcp_Bps if tcp_Bps else float("nan")
    cell["memcpy_bw"] = memcpy_bw
    cell["driver_memcpy_bw"] = driver_memcpy_bw


def print_table(cells: List[Dict], title: str, hosts_mode: bool) -> None:
    if not cells:
        return
    k = len(next(iter(cells[0]["variants"].values()))["samples_s"])
    print(f"\n{title}: one-sided ops to rank+1, n={cells[0]['n']}   (GB/s = size/median time, 1e9 B/s; "
          f"time = median [min-max] of {k} samples; /memcpy: over memcpy_1rank, the 1-rank torch copy_ of the "
          f"same size in the same job)")
    head = (f"{'size':>8} {'op':<19} {'reps':>4} | {'median ms':>10} {'min-max ms':>19} | {'GB/s':>7} |"
            f" {'/memcpy':>8} {'/gloo':>7}")
    if hosts_mode:
        head += f" {'/link':>7} {'/tcp':>7}"
    print(head)
    print("-" * len(head))
    for c in cells:
        for v, d in c["variants"].items():
            flag = "" if d["correct"] else "!"
            mm = f"{d['min_s'] * 1e3:.3f}-{d['max_s'] * 1e3:.3f}"
            row = (f"{fmt_size(c['size']):>8} {v + flag:<19} {c['reps']:>4} | {d['median_s'] * 1e3:>10.3f} {mm:>19} |"
                   f" {fmt_bw(d['bw']):>7} | {100 * d['over_memcpy']:>7.1f}% "
                   + (f"{d['over_gloo']:>6.2f}x" if d["over_gloo"] == d["over_gloo"] else f"{'-':>7}"))
            if hosts_mode:
                if "over_link" in d:
                    row += f" {100 * d['over_link']:>6.1f}% {100 * d['over_tcp']:>6.1f}%"
                else:
                    row += f" {'-':>7} {'-':>7}"
            print(row)
        if "memcpy_1rank" not in c["variants"]:
            print(f"{fmt_size(c['size']):>8} {'(memcpy, driver)':<19} {'':>4} | "
                  f"{c['size'] / c['memcpy_bw'] * 1e3:>10.3f} {'':>19} | {fmt_bw(c['memcpy_bw']):>7} |")
    if any(not d["correct"] for c in cells for d in c["variants"].values()):
        print("  ! = result differed from the exact expected value (see JSON 'wrong_results')")


def plot(path: str, cells: List[Dict], bounds: Dict, hosts_mode: bool) -> Optional[str]:
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 5))
    styles = {"win_put": "-", "win_accumulate": "-", "win_update": "-", "gloo_sendrecv": "--",
              "neighbor_allreduce": "-.", "memcpy_1rank": ":",
              "memcpy_all_ranks": ":"}
    for job in sorted({c["job"] for c in cells}):
        cs = sorted((c for c in cells if c["job"] == job), key=lambda c: c["size"])
        xs = [c["size"] for c in cs]
        for v in cs[0]["variants"]:
            if v == "memcpy_1rank":
                continue  # drawn as the bound below
            d = [c["variants"][v] for c in cs]
            line, = ax_bw.plot(xs, [e["bw"] / 1e9 for e in d], styles.get(v, "-"), marker="o", ms=3,
                               label=f"{v} ({job})")
            ax_bw.fill_between(xs, [e["bw_min"] / 1e9 for e in d], [e["bw_max"] / 1e9 for e in d],
                               color=line.get_color(), alpha=0.15)
            ax_t.plot(xs, [e["median_s"] * 1e3 for e in d], styles.get(v, "-"), marker="o", ms=3,
                      color=line.get_color(), label=f"{v} ({job})")
        ax_bw.plot(xs, [c["memcpy_bw"] / 1e9 for c in cs], "k:", lw=1.5, marker="s", ms=3,
                   label=f"memcpy bound (1 rank, {job})")
    if hosts_mode:
        ax_bw.axhline(bounds["link_Bps"] / 1e9, color="gray", lw=1, ls="--", label=f"link rate ({bounds['rate']})")
        if bounds.get("tcp_Bps"):
            ax_bw.axhline(bounds["tcp_Bps"] / 1e9, color="gray", lw=1, ls=":", label="measured TCP stream")
    for ax in (ax_bw, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.set_ylabel("GB/s per rank (size / median time)")
    ax_bw.set_yscale("log")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time per op (ms)")
    ax_bw.legend(fontsize=7)
    ax_t.legend(fontsize=7)
    fig.suptitle(bounds.get("title", "rumor windows"))
    _common.save_figure(plt, fig, path)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="rumor one-sided window ops vs gloo send/recv (see the module docstring)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common.add_world_args(ap)
    ap.set_defaults(ranks="4")
    ap.add_argument("--sizes", default=None, help=f"comma list of sizes (default {DEFAULT_SIZES}; --quick {QUICK_SIZES})")
    ap.add_argument("--ops", default=",".join(VARIANTS), help="comma list of variants to run")
    ap.add_argument("--iters", type=int, default=None, help="measured samples per variant (default 20; --quick 10; "
                                                            "protocol: >= 10)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up ops per variant per size (default 2; --quick 1)")
    ap.add_argument("--target-ms", type=float, default=5.0,
                    help="small sizes: run several ops per sample so it lasts at least this long")
    ap.add_argument("--max-reps", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and samples (about a minute on 2 cores)")
    _common.add_run_args(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return _common.worker_main(args.worker, _describe, _measure)

    hosts_mode = args.hosts > 0
    sizes = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)).split(",") if s.strip()]
    if args.iters is None:
        args.iters = 10 if args.quick else 20
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    variants = [v.strip() for v in args.ops.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown ops {bad}; choose from {VARIANTS}")
    if "win_put" not in variants:
        ap.error("--ops must include win_put (the headline)")
    for s in sizes:
        if s <= 0 or s % 4:
            ap.error(f"size {s} is not a positive multiple of 4 bytes (fp32)")
    worlds = _common.world_sizes(ap, args)
    if any(n < 2 for n in worlds):
        ap.error("every world needs at least 2 ranks")
    if args.iters < 10:
        print(f"WARNING: --iters {args.iters} is below the protocol's minimum of 10; "
              f"use these figures for smoke tests only", file=sys.stderr)
    if args.warmup < 1:
        ap.error("--warmup must be >= 1")

    os.makedirs(args.out, exist_ok=True)
    tag = f"{args.hosts}hosts" if hosts_mode else "1host"
    json_path = os.path.join(args.out, f"windows-{tag}.json")
    png_path = os.path.join(args.out, f"windows-{tag}.png")

    meta = _common.run_meta(args)
    meta.update(sizes=sizes, worlds=worlds, variants=variants,
                pattern="every rank puts/accumulates/sends S bytes to rank+1 and receives from rank-1",
                sample_time="slowest rank's elapsed time for `reps` back-to-back ops / reps, after a gloo barrier",
                bw="size / median time (bytes each rank moved per second)",
                memcpy_bound="variant memcpy_1rank: 1-thread torch copy_ of S bytes on rank 0 alone, interleaved "
                             "with the other variants; cross-check: the same in the driver process (ranks not "
                             "running) before and after the jobs ('memcpy': [start, end])")
    result = dict(meta=meta, cells=[], jobs=[], targets=[], errors=[], wrong_results=[])
    print(f"rumor {meta['rumor']} vs torch {meta['torch']} gloo | {meta['hostname']}, {meta['cpus']} cpus, "
          f"load {meta['loadavg_start'][0]:.2f} | windows | sizes {', '.join(fmt_size(s) for s in sizes)} | "
          f"iters {args.iters}, warmup {args.warmup}{' (quick)' if args.quick else ''}")

    progress = Progress(len(worlds) * len(sizes) * (args.iters + 1), quiet_s=5.0)
    drv = _common.Driver("rumor-bench-win-", progress, hosts_mode)

    def memcpy_round() -> Dict[int, Dict]:
        return {s: measure_memcpy(s, iters=max(20, min(200, (64 * MiB) // s))) for s in sizes}

    def body() -> int:
        mc = [memcpy_round()]
        big = max(sizes)
        print(f"memcpy in the driver (torch copy_, 1 thread, {fmt_size(big)}): {mc[0][big]['bw'] / 1e9:.2f} GB/s "
              f"[{mc[0][big]['bw_min'] / 1e9:.2f}-{mc[0][big]['bw_max'] / 1e9:.2f}]")
        bounds: Dict = {}
        tcp: List[float] = []
        if hosts_mode:
            tcp0 = drv.start_cluster(args.hosts, args.rate)
            if tcp0 is None:
                return 2
            tcp.append(tcp0)
            bounds = dict(rate=args.rate, link_Bps=parse_rate(args.rate),
                          title=f"{args.hosts} emulated hosts x {args.ranks_per_host} rank(s), tbf {args.rate}: "
                                f"rumor windows vs gloo send/recv")
            print(f"emulated hosts: {args.hosts} x {args.ranks_per_host} rank(s), namespaces "
                  f"{' '.join(drv.cluster.namespaces)}, tbf {args.rate} = {bounds['link_Bps'] / 1e6:.0f} MB/s per "
                  f"link; single TCP stream through one shaped link: {tcp0 / 1e6:.1f} MB/s")
        else:
            bounds = dict(title="one host: rumor windows vs gloo send/recv (bound: 1-thread memcpy)")

        per_job = len(sizes) * (args.iters + 1)
        jobs = [Job(args, n, sizes, variants, drv.workdir, progress, k * per_job, cluster=drv.cluster)
                for k, n in enumerate(worlds)]
        rc = _common.run_jobs(jobs, result, progress)

        if hosts_mode:
            tcp.append(drv.tcp_throughput())
            drv.close_cluster()
            bounds["tcp_Bps"] = statistics.median(tcp)
            result["tcp_single_stream_Bps"] = tcp
        mc.append(memcpy_round())
        progress.clear()
        memcpy_bw = {s: statistics.median([m[s]["bw"] for m in mc]) for s in sizes}
        result["memcpy"] = [{str(s): m[s] for s in sizes} for m in mc]  # start, end
        bounds["driver_memcpy_bw"] = {str(s): memcpy_bw[s] for s in sizes}
        for c in result["cells"]:
            summarize(c, memcpy_bw[c["size"]], bounds.get("link_Bps"), bounds.get("tcp_Bps"))
            for v, d in c["variants"].items():
                result["wrong_results"].extend(d["errors"])
            result["wrong_results"].extend(c.get("other_errors", []))
        result["bounds"] = bounds
        _common.finish_meta(meta)

        # ---- tables
        for job in jobs:
            cs = sorted(job.cells, key=lambda c: c["size"])
            print_table(cs, job.label + (f", tbf {args.rate}" if hosts_mode else ""), hosts_mode)
        print()
        for s in sizes:
            inj = [c["variants"]["memcpy_1rank"]["bw"] for c in result["cells"]
                   if c["size"] == s and "memcpy_1rank" in c["variants"]]
            print(f"memcpy {fmt_size(s):>8} (torch copy_, 1 thread): in the job {', '.join(fmt_bw(b) for b in inj) or '-'}"
                  f" GB/s (the bound); in the driver {' / '.join(fmt_bw(m[s]['bw']) for m in mc)} GB/s (start / end)")
        if hosts_mode:
            print(f"link bound: {args.rate} = {bounds['link_Bps'] / 1e6:.1f} MB/s per direction; measured single-"
                  f"stream TCP through one shaped link: {' / '.join(f'{t / 1e6:.1f}' for t in tcp)} MB/s "
                  f"(before / after)")

        # ---- targets and headline
        headline = None
        n = max(worlds)
        c = next((c for c in result["cells"] if c["n"] == n and c["size"] == big), None)
        if c and "win_put" in c["variants"]:
            put = c["variants"]["win_put"]
            gl = c["variants"].get("gloo_sendrecv")
            allr = c["variants"].get("memcpy_all_ranks")
            extra = f", {put['over_gloo']:.2f}x gloo send/recv" if gl else ""
            if allr and not hosts_mode:
                extra += f", {100 * put['bw'] / allr['bw']:.1f}% of memcpy on all {n} ranks at once"
            if hosts_mode:
                frac = put["over_link"]
                t = dict(name=f"{args.hosts} emulated hosts {args.rate}, win_put {fmt_size(big)}: bandwidth / link rate",
                         value=frac, tcp_value=put["over_tcp"])
                result["targets"].append(t)
                print(f"{t['name']}: {100 * frac:.1f}% (of measured TCP: {100 * put['over_tcp']:.1f}%{extra})")
                headline = (f"win_put bandwidth on {args.hosts} emulated hosts @{args.rate} = {100 * frac:.1f}% of the "
                            f"link rate ({100 * put['over_tcp']:.1f}% of measured TCP)")
            else:
                # The bound at equal concurrency: one put stream against one copy stream, and all
                # ranks putting against all ranks copying (2 cores, 4 ranks: the machine's memory
                # bandwidth is shared the same way in both).
                pair = c["variants"].get("win_put_1pair")
                frac = pair["over_memcpy"] if pair else put["over_memcpy"]
                what = "one pair" if pair else f"{n} ranks at once (vs 1-rank memcpy)"
                t = dict(name=f"win_put {fmt_size(big)} one host, {what}: bandwidth >= 50% of memcpy",
                         value=frac, met=frac >= 0.5)
                if allr:
                    t["all_ranks_value"] = put["bw"] / allr["bw"]
                result["targets"].append(t)
                print(f"target: {t['name']}: {100 * frac:.1f}% -> {'MET' if t['met'] else 'NOT MET'} "
                      f"({fmt_bw(pair['bw'] if pair else put['bw'])} vs {fmt_bw(c['memcpy_bw'])} GB/s{extra})")
                headline = (f"win_put bandwidth on one host = {100 * frac:.1f}% of memcpy ({what}; target >= 50%)"
                            + (f"; all {n} ranks putting = {100 * put['bw'] / allr['bw']:.1f}% of all ranks copying"
                               if allr else ""))
        wrong = [(c["size"], v) for c in result["cells"] for v, d in c["variants"].items() if not d["correct"]]
        if wrong or any(c.get("other_errors") for c in result["cells"]):
            print("WRONG RESULTS: " + ", ".join(f"{v} {fmt_size(s)}" for s, v in wrong) + " (see JSON 'wrong_results')")
            rc = rc or 1
        draw = None if args.no_plot else (lambda: plot(png_path, result["cells"], bounds, hosts_mode))
        _common.write_results(result, headline, "headline: n/a (the run produced no win_put figure)",
                              json_path, png_path, draw)
        return rc

    return drv.run(body)


if __name__ == "__main__":
    sys.exit(main())
