#!/usr/bin/env python
"""Collective benchmark: rumor vs torch.distributed (gloo), per benchmarks/BENCHMARKS.md.

Needs: the installed rumor package, torch, and for the plot `pip install matplotlib`.

Modes
  one host (default): allreduce, allgather and reduce_scatter of fp32, 4 KiB .. 256 MiB, with 2
      and 4 ranks on this machine. Bound: single-threaded memcpy bandwidth (torch copy_ of 64 MiB),
      measured in the same run.
  --hosts H: H emulated hosts (Linux network namespaces on one bridge, rumor.testing.netns), each
      host's link shaped with `tbf rate 1gbit burst 256kb latency 20ms` (--rate), --ranks-per-host
      ranks each (default 1). Needs root. Bound: the ring bound B*n/(2(n-1)) on the shaped link
      rate B (n = hosts), and the same bound on the single-stream TCP throughput measured through
      one shaped link in the same run.

How it measures
  Every job starts its ranks itself (subprocesses with torchrun's env variables); each rank calls
  rumor.init() and then torch.distributed.init_process_group("gloo") (sharing rumor's TCPStore),
  so both libraries run in the same processes on the same data. Per (op, size): warm-up, then
  --iters measured samples per library, alternating which library goes first. A sample starts
  after a gloo barrier and one untimed op of the library timed (which lines the ranks up the
  way that library does), then times `reps` back-to-back ops (reps > 1 only for small sizes, per
  library, from a burst of ops timed after the warm-up (an eighth of a sample), so that each library's sample lasts
  >= --target-ms; "reps" in the tables is rumor's); its time is the slowest rank's elapsed time /
  reps. Reported: median over samples and min-max.
  Both libraries are called through their public APIs, in place where the API allows:
    allreduce       rumor.allreduce_(x, SUM)          dist.all_reduce(x, SUM)
    allgather       rumor.allgather(x, out=out)       dist.all_gather_single(out, x)
    reduce_scatter  rumor.reduce_scatter(x, SUM, out=out)  dist.reduce_scatter_single(out, x, SUM)
  Sizes are the full buffer: allreduce input, allgather output, reduce_scatter input.
  algbw = size / time.  busbw = algbw * 2(n-1)/n for allreduce, algbw * (n-1)/n for allgather
  and reduce_scatter (the nccl-tests convention: the bytes each rank's link must carry).
  Results are checked once per cell against exact expected values (integer multiples of 2^-100,
  so sums are exact), on the first warm-up op; the timed in-place allreduces start from zeros, so
  that any number of reps (--max-reps) stays finite.

Output: a table per job, the issue targets, JSON with every raw figure and a PNG plot in --out
(default benchmarks/results/); the last line printed is the headline ratio.

  python benchmarks/collectives.py                          # full one-host run (2 and 4 ranks)
  python benchmarks/collectives.py --max-size 16MiB         # quicker
  sudo python benchmarks/collectives.py --hosts 4           # 4 emulated hosts x 1 rank, 1 Gbit
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time
from typing import Dict, List, Optional

import _common
from _common import Progress, emit, parse_rate

OPS = ("allreduce", "allgather", "reduce_scatter")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SCALE_EXP = -100  # inputs are small integers times 2^-100 (see _template)


# ==== small helpers ==================================================================================

def parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", s, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r} (examples: 4096, 4KiB, 16MiB, 1GiB)")
    unit = (m.group(2) or "").upper().replace("I", "").replace("B", "")
    mult = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": 1 << 40}[unit]
    return int(float(m.group(1)) * mult)


def fmt_size(b: int) -> str:
    for unit, m in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if b >= m and b % m == 0:
            return f"{b // m} {unit}"
    return f"{b} B"


def fmt_time(s: float) -> str:
    if s != s:  # nan
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f}us"
    if s < 1:
        return f"{s * 1e3:.2f}ms"
    return f"{s:.3f}s"


def fmt_bw(bps: float) -> str:
    if bps != bps:
        return "-"
    return f"{bps / 1e9:.3f}" if bps < 10e9 else f"{bps / 1e9:.2f}"


def busbw_factor(op: str, n: int) -> float:
    if op == "broadcast":  # nccl-tests: every byte crosses each link once
        return 1.0
    return 2 * (n - 1) / n if op == "allreduce" else (n - 1) / n


def measure_memcpy(nbytes: int = 64 * MiB, iters: int = 20, threads: int = 1) -> Dict:
    """torch copy_ bandwidth with `threads` threads (bytes copied per second): with 1 thread the
    bound of this benchmark, with every core the all-core copy rate C of host_collectives.py
    (torch splits a large copy across its intra-op threads)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            dst.copy_(src)
            samples.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    med = statistics.median(samples)
    return dict(bytes=nbytes, threads=threads, samples_s=samples, median_s=med, bw=nbytes / med,
                bw_min=nbytes / max(samples), bw_max=nbytes / min(samples))


# ==== inside a rank ==================================================================================

def _template(numel: int, owner: int, salt: int, dtype: str = "float32"):
    """Rank `owner`'s input: small positive integers times 2^SCALE_EXP. Sums over ranks are exact
    (also in bfloat16: at most 13*n < 2^8 for n < 19). The pattern has period 13, so it is built
    by tiling (cheap even at 256 MiB). It is the data of the warm-up, whose first op is checked;
    the timed in-place allreduces run on zeros (run_cell), whose repeated sums never overflow."""
    import torch

    period = (((torch.arange(13) * 7 + owner * 3 + salt) % 13 + 1).to(torch.float32) * (2.0 ** SCALE_EXP)).to(
        getattr(torch, dtype))
    reps = -(-numel // 13)
    return period.repeat(reps)[:numel].clone() if reps * 13 != numel else period.repeat(reps)


def _expected(op: str, numel: int, n: int, rank: int, salt: int, per: int, dtype: str = "float32"):
    import torch

    if op == "allgather":
        return torch.cat([_template(per, r, salt, dtype) for r in range(n)])
    if op == "broadcast":  # rank 0's buffer
        return _template(numel, 0, salt, dtype)
    period = sum(_template(13, r, salt, dtype).double() for r in range(n)).to(getattr(torch, dtype))  # exact
    total = period.repeat(-(-numel // 13))[:numel]
    if op == "reduce_scatter":
        return total[rank * per:(rank + 1) * per]
    return total


def _describe(rank: int, n: int) -> Dict:
    import torch

    import rumor

    return dict(rank=rank, size=n, local_size=rumor.local_size(), machine_size=rumor.machine_size(),
                machine_rank=rumor.machine_rank(), torch_threads=torch.get_num_threads(),
                host_id=os.readlink("/proc/self/ns/net"))


def _measure(cfg: Dict, rank: int, n: int, peers: Optional[Dict] = None) -> None:
    """Every cell of cfg on this rank. peers: more allreduce implementations to time beside
    rumor and gloo, name -> fn(dtype) giving an in-place allreduce of a tensor, or None where
    that implementation cannot reduce this dtype here."""
    import torch
    import torch.distributed as dist

    import rumor

    SUM = rumor.ReduceOp.SUM
    ag_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    max_reps = max(1, cfg["max_reps"])
    hier_ok = rumor.machine_size() > 1 and rumor.local_size() > 1
    cell_index = 0

    def run_cell(op: str, size: int, cell_index: int, dtype: str) -> None:
        # One (op, size): a function so that its buffers are freed before the next one.
        numel = size // getattr(torch, dtype).itemsize
        per = numel // n
        salt = cell_index % 5
        # Buffers and the functions each library runs (one call = one op).
        if op == "allreduce":
            tmpl = _template(numel, rank, salt, dtype)
            bufs = {"rumor": tmpl.clone(), "gloo": tmpl.clone()}
            fns = {"rumor": lambda: rumor.allreduce_(bufs["rumor"], op=SUM),
                   "gloo": lambda: dist.all_reduce(bufs["gloo"], op=dist.ReduceOp.SUM)}
            results = {"rumor": lambda: bufs["rumor"], "gloo": lambda: bufs["gloo"]}
            if hier_ok and cfg.get("hierarchical"):
                bufs["rumor_hier"] = tmpl.clone()
                fns["rumor_hier"] = lambda: rumor.allreduce_(bufs["rumor_hier"], op=SUM, hierarchical=True)
                results["rumor_hier"] = lambda: bufs["rumor_hier"]
            for name, make in (peers or {}).items():
                fn = make(dtype)
                if fn is not None:
                    bufs[name] = tmpl.clone()
                    fns[name] = (lambda f, b: lambda: f(b))(fn, bufs[name])
                    results[name] = (lambda b: lambda: b)(bufs[name])
            # The timed samples start from zeros: reps in-place sums of the template would grow as
            # n^reps and overflow within a few hundred reps, which capped reps for small sizes and
            # left a descheduled rank's time slice spread over few ops (4 ranks on 2 cores).
            # Adding zeros costs what adding other normal floats does.
            zeros = torch.zeros_like(tmpl)
            refill = lambda v: bufs[v].copy_(tmpl)
            refill_timed = lambda v: bufs[v].copy_(zeros)
        elif op == "allgather":
            tmpl = _template(per, rank, salt, dtype)
            out_g = torch.empty(numel, dtype=tmpl.dtype)
            out_r = torch.empty(numel, dtype=tmpl.dtype)
            # Both libraries write into preallocated outputs.
            fns = {"rumor": lambda: rumor.allgather(tmpl, out=out_r),
                   "gloo": lambda: ag_single(out_g, tmpl)}
            results = {"rumor": lambda: out_r, "gloo": lambda: out_g}
            refill = lambda v: None
        elif op == "broadcast":  # from rank 0; the others start from zeros, so a miss shows
            tmpl = _template(numel, 0, salt, dtype) if rank == 0 else torch.zeros(numel, dtype=getattr(torch, dtype))
            bufs = {"rumor": tmpl.clone(), "gloo": tmpl.clone()}
            fns = {"rumor": lambda: rumor.broadcast_(bufs["rumor"], 0),
                   "gloo": lambda: dist.broadcast(bufs["gloo"], 0)}
            results = {"rumor": lambda: bufs["rumor"], "gloo": lambda: bufs["gloo"]}
            refill = lambda v: bufs[v].copy_(tmpl)
        else:  # reduce_scatter
            tmpl = _template(numel, rank, salt, dtype)
            out_g = torch.empty(per, dtype=tmpl.dtype)
            out_r = torch.empty(per, dtype=tmpl.dtype)
            in_g = tmpl.clone()
            fns = {"rumor": lambda: rumor.reduce_scatter(tmpl, op=SUM, out=out_r),
                   "gloo": lambda: rs_single(out_g, in_g, op=dist.ReduceOp.SUM)}
            results = {"rumor": lambda: out_r, "gloo": lambda: out_g}
            refill = lambda v: in_g.copy_(tmpl) if v == "gloo" else None
        variants = list(fns)
        if op != "allreduce":  # nothing else reduces in place: the timed samples refill as the warm-up
            refill_timed = refill

        # Warm-up; the first op of each library is checked against the exact result.
        expected = _expected(op, numel, n, rank, salt, per, dtype)
        correct = {}
        warm = {v: [] for v in variants}
        for w in range(cfg["warmup"]):
            for v in variants:
                refill(v)
                dist.barrier()
                t0 = time.perf_counter()
                fns[v]()
                warm[v].append(time.perf_counter() - t0)
                if w == 0:
                    got = results[v]()
                    ok = bool(got.shape == expected.shape and torch.equal(got, expected))
                    if not ok:
                        diff = (got != expected).nonzero() if got.shape == expected.shape else None
                        first = int(diff[0]) if diff is not None and len(diff) else -1
                        correct[v] = (f"rank {rank}: {v} {op} {size} B wrong: shape {tuple(got.shape)} "
                                      f"vs {tuple(expected.shape)}, first bad index {first}")
                    else:
                        correct[v] = True
        del expected
        # reps, per library and the same on every rank, so that each library's sample lasts >=
        # target: from a short burst timed as the samples are (a warm-up op alone includes the
        # ranks' skew leaving the barrier: 4 ranks on 2 cores, 4 KiB, ~360 us against ~40 us a
        # rep, which sized rumor's samples at ~7 ms, where one hiccup of the VM moved the median).
        # The burst lasts about an eighth of a sample by the warm-up's (pessimistic) time per op.
        w = torch.tensor([min(warm[v]) for v in variants], dtype=torch.float64)
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
        burst = {}
        for i, v in enumerate(variants):
            k = max(4, min(256, math.ceil(cfg["target_s"] / 8 / max(float(w[i]), 1e-7))))
            refill_timed(v)
            dist.barrier()
            fns[v]()
            t0 = time.perf_counter()
            for _ in range(k):
                fns[v]()
            burst[v] = (time.perf_counter() - t0) / k
        t = torch.tensor([burst[v] for v in variants], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        reps = {v: max(1, min(max_reps, math.ceil(cfg["target_s"] / max(float(t[i]), 1e-7))))
                for i, v in enumerate(variants)}

        samples = {v: [] for v in variants}
        for i in range(cfg["iters"]):
            k = i % len(variants)
            for v in variants[k:] + variants[:k]:  # rotate who goes first
                refill_timed(v)
                dist.barrier()
                # One untimed op of the library being timed: ranks leave gloo's barrier up to a
                # few ms apart on an oversubscribed host, and that skew is the harness's, not the
                # op's (4 ranks on 2 cores, 4 KiB: 90 us a rep with it in 64 reps, 46 us in 512).
                fns[v]()
                t0 = time.perf_counter()
                for _ in range(reps[v]):
                    fns[v]()
                samples[v].append((time.perf_counter() - t0) / reps[v])
        per_rank = _common.gather_samples(samples)  # a sample's time is the slowest rank's
        oks = [None] * n
        dist.all_gather_object(oks, correct)
        if rank == 0:
            cell = dict(op=op, size=size, n=n, dtype=dtype, reps=reps["rumor"], reps_by_variant=reps,
                        warmup_s={v: warm[v] for v in variants},
                        variants={})
            for v in variants:
                sm = [max(per_rank[v][r][i] for r in range(n)) for i in range(cfg["iters"])]
                errs = [o[v] for o in oks if o.get(v) is not True]
                cell["variants"][v] = dict(samples_s=sm, per_rank_samples_s=per_rank[v],
                                           correct=not errs, errors=errs[:4])
            emit("cell", cell)

    for dtype in cfg.get("dtypes", ["float32"]):
        for op in cfg["ops"]:
            for size in cfg["sizes"]:
                run_cell(op, size, cell_index, dtype)
                cell_index += 1


# ==== the driver =====================================================================================

class Job(_common.Job):
    """One set of ranks (one world size), running the whole size list for every op."""

    def __init__(self, args, n: int, ops: List[str], sizes: List[int], workdir: str, progress: Progress,
                 base: int, cluster=None, script: str = os.path.abspath(__file__)):
        super().__init__(script, args, n, workdir, progress, base, cluster)
        self.ops, self.sizes = ops, sizes

    @property
    def label(self) -> str:
        return f"{self.hosts} hosts x {self.rph} rank(s)" if self.cluster is not None else f"{self.n} ranks, 1 host"

    def config(self) -> Dict:
        a = self.args
        return dict(ops=self.ops, sizes=self.sizes, iters=a.iters, warmup=a.warmup, target_s=a.target_ms / 1e3,
                    max_reps=a.max_reps, hierarchical=(self.cluster is not None and self.rph > 1))

    def on_message(self, kind: str, data) -> None:
        if kind == "cell":
            self.progress.update(self.base + len(self.cells),
                                 f"{self.label}: {data['op']} {fmt_size(data['size'])} done")


def summarize(cell: Dict, bound: Dict) -> None:
    """Adds median/min/max, algbw and busbw to every variant of a cell (in place)."""
    op, n, size = cell["op"], cell["n"], cell["size"]
    for v, d in cell["variants"].items():
        s = d["samples_s"]
        d["median_s"], d["min_s"], d["max_s"] = statistics.median(s), min(s), max(s)
        d["algbw"] = size / d["median_s"]
        d["busbw"] = d["algbw"] * busbw_factor(op, n)
        d["algbw_min"], d["algbw_max"] = size / d["max_s"], size / d["min_s"]
    r, g = cell["variants"].get("rumor"), cell["variants"].get("gloo")
    if r and g:
        cell["rumor_over_gloo_bw"] = g["median_s"] / r["median_s"]
    cell["bound"] = bound


def print_table(cells: List[Dict], title: str, bound_kind: str, bound_bw: Optional[float],
                extra_bound: Optional[float] = None) -> None:
    if not cells:
        return
    op, n = cells[0]["op"], cells[0]["n"]
    variants = list(cells[0]["variants"])
    bw_name = "busbw" if bound_kind == "memcpy" else "algbw"
    formula = ("busbw = algbw*2(n-1)/n" if op == "allreduce" else "busbw = algbw*(n-1)/n")
    print(f"\n{title}: {op}, n={n}   (algbw = size/time; {formula}; GB/s = 1e9 B/s; "
          f"time = median [min-max] of {len(cells[0]['variants']['rumor']['samples_s'])} samples)")
    head = f"{'size':>9} {'reps':>4} |"
    for v in variants:
        head += f" {v + ' time':>27} {'algbw':>7} {'busbw':>7} |"
    head += f" {'rumor/gloo':>10}"
    if bound_kind == "memcpy":
        head += f" {'rumor busbw/memcpy':>18}"
    else:
        head += f" {'ring bound':>10} {'rumor/bound':>11}"
        if extra_bound:
            head += f" {'rumor/tcp-bound':>15}"
    print(head)
    print("-" * len(head))
    for c in cells:
        row = f"{fmt_size(c['size']):>9} {c['reps']:>4} |"
        for v in variants:
            d = c["variants"][v]
            t = f"{fmt_time(d['median_s'])} [{fmt_time(d['min_s'])}-{fmt_time(d['max_s'])}]"
            flag = "" if d["correct"] else "!"
            row += f" {t + flag:>27} {fmt_bw(d['algbw']):>7} {fmt_bw(d['busbw']):>7} |"
        row += f" {c.get('rumor_over_gloo_bw', float('nan')):>9.2f}x"
        rb = c["variants"]["rumor"][bw_name]
        if bound_kind == "memcpy":
            row += f" {rb / bound_bw:>18.2f}"
        else:
            row += f" {fmt_bw(bound_bw):>10} {100 * rb / bound_bw:>10.1f}%"
            if extra_bound:
                row += f" {100 * rb / extra_bound:>14.1f}%"
        print(row)
    if any(not d["correct"] for c in cells for d in c["variants"].values()):
        print("  ! = result differed from the exact expected value (see JSON 'errors')")


def plot(path: str, cells: List[Dict], mode: str, bounds: Dict) -> Optional[str]:
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    ops = [o for o in OPS if any(c["op"] == o for c in cells)]
    fig, axes = plt.subplots(2, len(ops), figsize=(6 * len(ops), 8), squeeze=False)
    styles = {"rumor": "-", "gloo": "--", "rumor_hier": "-."}
    for j, op in enumerate(ops):
        ax_bw, ax_t = axes[0][j], axes[1][j]
        groups = sorted({(c["job"], c["n"]) for c in cells if c["op"] == op}, key=lambda x: x[1])
        for job, n in groups:
            cs = sorted((c for c in cells if c["op"] == op and c["job"] == job), key=lambda c: c["size"])
            for v in cs[0]["variants"]:
                xs = [c["size"] for c in cs]
                key = "busbw" if mode == "memcpy" else "algbw"
                ys = [c["variants"][v][key] / 1e9 for c in cs]
                lo = [c["variants"][v][key] / 1e9 * (c["variants"][v]["median_s"] / c["variants"][v]["max_s"]) for c in cs]
                hi = [c["variants"][v][key] / 1e9 * (c["variants"][v]["median_s"] / c["variants"][v]["min_s"]) for c in cs]
                lab = f"{v} ({job})"
                line, = ax_bw.plot(xs, ys, styles.get(v, ":"), marker="o", ms=3, label=lab)
                ax_bw.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
                ax_t.plot(xs, [c["variants"][v]["median_s"] * 1e3 for c in cs], styles.get(v, ":"),
                          marker="o", ms=3, color=line.get_color(), label=lab)
        if mode == "memcpy":
            ax_bw.axhline(bounds["memcpy_bw"] / 1e9, color="k", lw=1, ls=":", label="memcpy (1 thread)")
            ax_bw.set_ylabel("busbw (GB/s)")
        else:
            ax_bw.axhline(bounds["ring_bound"] / 1e9, color="k", lw=1, ls=":", label=f"ring bound ({bounds['rate']})")
            if bounds.get("tcp_ring_bound"):
                ax_bw.axhline(bounds["tcp_ring_bound"] / 1e9, color="gray", lw=1, ls=":",
                              label="ring bound (measured TCP)")
            ax_bw.set_ylabel("algbw (GB/s)")
        for ax in (ax_bw, ax_t):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("size (bytes)")
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_yscale("log")
        ax_t.set_ylabel("time per op (ms)")
        ax_bw.set_title(op)
        ax_bw.legend(fontsize=7)
    fig.suptitle(bounds.get("title", "rumor vs gloo"))
    _common.save_figure(plt, fig, path)
    return None


def find(cells, op, n, size, job_hosts=None):
    for c in cells:
        if c["op"] == op and c["n"] == n and c["size"] == size and (job_hosts is None or c["hosts"] == job_hosts):
            return c
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="rumor vs gloo collectives (see the module docstring)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common.add_world_args(ap)
    ap.add_argument("--ops", default=None,
                    help="comma list of allreduce,allgather,reduce_scatter "
                         "(default: all three; --hosts mode: allreduce)")
    ap.add_argument("--min-size", type=parse_size, default=4 * KiB)
    ap.add_argument("--max-size", type=parse_size, default=None,
                    help="largest size (default 256MiB; --hosts mode 64MiB)")
    ap.add_argument("--factor", type=int, default=4, help="ratio between consecutive sizes (2 or 4)")
    ap.add_argument("--sizes", default=None, help="explicit comma list of sizes (overrides min/max/factor)")
    ap.add_argument("--iters", type=int, default=10, help="measured samples per library (protocol: >= 10)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up ops per library per cell")
    ap.add_argument("--target-ms", type=float, default=5.0,
                    help="small sizes: run several ops per sample so it lasts at least this long")
    ap.add_argument("--max-reps", type=int, default=64)
    _common.add_run_args(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return _common.worker_main(args.worker, _describe, _measure)

    hosts_mode = args.hosts > 0
    ops = [o.strip() for o in (args.ops or ("allreduce" if hosts_mode else ",".join(OPS))).split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        ap.error(f"unknown ops {bad}; choose from {OPS}")
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    else:
        mx = args.max_size or (64 * MiB if hosts_mode else 256 * MiB)
        if args.factor < 2:
            ap.error("--factor must be >= 2")
        sizes, s = [], args.min_size
        while s <= mx:
            sizes.append(s)
            s *= args.factor
    worlds = _common.world_sizes(ap, args)
    for n in worlds:
        for s in sizes:
            if s % (4 * n):
                ap.error(f"size {s} is not a multiple of 4*{n} bytes (fp32, split over {n} ranks)")
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first warm-up op is also the correctness check)")
    if args.iters < 10:
        print(f"WARNING: --iters {args.iters} is below the protocol's minimum of 10; "
              f"use these figures for smoke tests only", file=sys.stderr)

    os.makedirs(args.out, exist_ok=True)
    tag = f"{args.hosts}hosts" if hosts_mode else "1host"
    json_path = os.path.join(args.out, f"collectives-{tag}.json")
    png_path = os.path.join(args.out, f"collectives-{tag}.png")

    meta = _common.run_meta(args)
    meta.update(ops=ops, sizes=sizes, worlds=worlds,
                sample_time="slowest rank's elapsed time for `reps` back-to-back ops / reps, after a gloo barrier "
                            "and one untimed op of the library timed",
                busbw="allreduce: algbw*2(n-1)/n; allgather, reduce_scatter: algbw*(n-1)/n",
                size_meaning="allreduce: buffer; allgather: gathered output; reduce_scatter: input")
    result = dict(meta=meta, cells=[], jobs=[], targets=[], errors=[])
    print(f"rumor {meta['rumor']} vs torch {meta['torch']} gloo | {meta['hostname']}, {meta['cpus']} cpus, "
          f"load {meta['loadavg_start'][0]:.2f} | ops {','.join(ops)} | sizes {fmt_size(sizes[0])}.."
          f"{fmt_size(sizes[-1])} ({len(sizes)}) | iters {args.iters}, warmup {args.warmup}")

    progress = Progress(len(worlds) * len(ops) * len(sizes))
    drv = _common.Driver("rumor-bench-", progress, hosts_mode)

    def body() -> int:
        mc = measure_memcpy()
        result["memcpy"] = [mc]
        print(f"memcpy (torch copy_, 1 thread, {fmt_size(mc['bytes'])}): {mc['bw'] / 1e9:.2f} GB/s "
              f"[{mc['bw_min'] / 1e9:.2f}-{mc['bw_max'] / 1e9:.2f}]")
        bounds: Dict = {}
        if hosts_mode:
            tcp0 = drv.start_cluster(args.hosts, args.rate, **_common.wan_kwargs(args))
            if tcp0 is None:
                return 2
            B = parse_rate(args.rate)
            tcp = [tcp0]
            n_h = args.hosts
            bounds = dict(rate=args.rate, link_Bps=B, ring_bound=B * n_h / (2 * (n_h - 1)),
                          title=f"{args.hosts} emulated hosts x {args.ranks_per_host} rank(s), tbf {args.rate}"
                                f"{_common.wan_label(args)}")
            print(f"emulated hosts: {args.hosts} x {args.ranks_per_host} rank(s), namespaces "
                  f"{' '.join(drv.cluster.namespaces)}, tbf {args.rate} = {B / 1e6:.0f} MB/s per link"
                  f"{_common.wan_label(args)}; "
                  f"single TCP stream through one shaped link: {tcp[0] / 1e6:.1f} MB/s")
        else:
            bounds = dict(memcpy_bw=mc["bw"], title="one host: rumor vs gloo (bound: 1-thread memcpy)")

        jobs = [Job(args, n, ops, sizes, drv.workdir, progress, k * len(ops) * len(sizes), cluster=drv.cluster)
                for k, n in enumerate(worlds)]
        rc = _common.run_jobs(jobs, result, progress)

        if hosts_mode:
            tcp.append(drv.tcp_throughput())
            drv.close_cluster()
            result["tcp_single_stream_Bps"] = tcp
            tcp_b = statistics.median(tcp)
            n_h = args.hosts
            bounds["tcp_Bps"] = tcp_b
            bounds["tcp_ring_bound"] = tcp_b * n_h / (2 * (n_h - 1))
        mc2 = measure_memcpy()
        result["memcpy"].append(mc2)
        if not hosts_mode:
            bounds["memcpy_bw"] = statistics.median([m["bw"] for m in result["memcpy"]])
        progress.clear()

        for c in result["cells"]:
            summarize(c, bounds)
        result["bounds"] = bounds
        _common.finish_meta(meta)

        # ---- tables
        for job in jobs:
            for op in ops:
                cs = sorted((c for c in job.cells if c["op"] == op), key=lambda c: c["size"])
                if hosts_mode:
                    print_table(cs, job.label + f", tbf {args.rate}", "ring", bounds["ring_bound"],
                                bounds.get("tcp_ring_bound"))
                else:
                    print_table(cs, job.label, "memcpy", bounds["memcpy_bw"])
        print()
        if hosts_mode:
            print(f"bounds: link B = {args.rate} = {bounds['link_Bps'] / 1e6:.1f} MB/s -> ring bound "
                  f"B*n/(2(n-1)) = {bounds['ring_bound'] / 1e6:.1f} MB/s algbw (n = {args.hosts} hosts); "
                  f"measured single-stream TCP through one shaped link: "
                  f"{' / '.join(f'{t / 1e6:.1f}' for t in tcp)} MB/s (before / after) -> "
                  f"{bounds['tcp_ring_bound'] / 1e6:.1f} MB/s")
            N = worlds[0]
            if args.ranks_per_host > 1:
                flat = bounds["link_Bps"] * N / (2 * (N - 1))
                bounds["flat_ring_bound"] = flat
                print(f"        (n = hosts is the bound of a hierarchical allreduce; a flat ring over all {N} "
                      f"ranks crosses each host link with 2(N-1)/N of the data: bound {flat / 1e6:.1f} MB/s)")
        memcpys = " / ".join(f"{m['bw'] / 1e9:.2f}" for m in result["memcpy"])
        print(f"memcpy bound (torch copy_ 64 MiB, 1 thread): {memcpys} GB/s (start / end)")

        # ---- targets and headline
        headline = None
        if hosts_mode:
            n = worlds[0]
            size = 64 * MiB if 64 * MiB in sizes else max(sizes)
            c = find(result["cells"], "allreduce", n, size)
            if c:
                frac = c["variants"]["rumor"]["algbw"] / bounds["ring_bound"]
                tfrac = c["variants"]["rumor"]["algbw"] / bounds["tcp_ring_bound"]
                t = dict(name=f"{args.hosts} emulated hosts {args.rate}, allreduce {fmt_size(size)}: "
                              f"rumor algbw >= 90% of ring bound", value=frac, met=frac >= 0.9)
                result["targets"].append(t)
                print(f"target: {t['name']}: {100 * frac:.1f}% (of the bound on measured TCP: {100 * tfrac:.1f}%)"
                      f" -> {'MET' if t['met'] else 'NOT MET'}")
                hv = c["variants"].get("rumor_hier")
                if hv:
                    print(f"        hierarchical: {100 * hv['algbw'] / bounds['ring_bound']:.1f}% of the ring bound")
                headline = (f"headline: allreduce {fmt_size(size)} {args.hosts} hosts x {args.ranks_per_host} "
                            f"@{args.rate} algbw rumor/ring bound = {100 * frac:.1f}% "
                            f"(rumor/gloo = {c['rumor_over_gloo_bw']:.2f}x)")
        else:
            nmax = max(worlds)
            big = 64 * MiB if 64 * MiB in sizes else max(sizes)
            c = find(result["cells"], "allreduce", nmax, big)
            if c:
                ratio = c["rumor_over_gloo_bw"]
                t = dict(name=f"allreduce {fmt_size(big)} {nmax} ranks one host: rumor busbw >= 3x gloo",
                         value=ratio, met=ratio >= 3.0)
                result["targets"].append(t)
                note = "" if big == 64 * MiB else " (64 MiB not in the size list: largest size used)"
                print(f"target: {t['name']}: {ratio:.2f}x -> {'MET' if t['met'] else 'NOT MET'}{note}")
                headline = f"headline: allreduce {fmt_size(big)} {nmax} ranks busbw rumor/gloo = {ratio:.2f}x"
            small = 4 * KiB
            c = find(result["cells"], "allreduce", nmax, small)
            if c:
                r_t, g_t = c["variants"]["rumor"]["median_s"], c["variants"]["gloo"]["median_s"]
                t = dict(name=f"allreduce {fmt_size(small)} {nmax} ranks: rumor latency <= gloo",
                         value=r_t / g_t, rumor_s=r_t, gloo_s=g_t, met=r_t <= g_t)
                result["targets"].append(t)
                print(f"target: {t['name']}: {fmt_time(r_t)} vs {fmt_time(g_t)} ({r_t / g_t:.2f}x) -> "
                      f"{'MET' if t['met'] else 'NOT MET'}")
        slower = [(c["op"], c["n"], c["size"]) for c in result["cells"] if c.get("rumor_over_gloo_bw", 9) < 1.0]
        if slower:
            print("rumor slower than gloo in: " + ", ".join(f"{o} n={n} {fmt_size(s)}" for o, n, s in slower))
        wrong = [(c["op"], c["n"], c["size"], v) for c in result["cells"] for v, d in c["variants"].items()
                 if not d["correct"]]
        if wrong:
            print("WRONG RESULTS: " + ", ".join(f"{v} {o} n={n} {fmt_size(s)}" for o, n, s, v in wrong))
            rc = rc or 1
        draw = None if args.no_plot else (
            lambda: plot(png_path, result["cells"], "ring" if hosts_mode else "memcpy", bounds))
        _common.write_results(result, headline, "headline: n/a (the run produced no allreduce figure)",
                              json_path, png_path, draw)
        return rc

    return drv.run(body)


if __name__ == "__main__":
    sys.exit(main())
