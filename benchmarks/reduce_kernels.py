#!/usr/bin/env python
"""Reduction kernels on one core: reduce_into and reduce_many (csrc/core/reduce.h) beside memcpy.

For float32, bfloat16 and float16, at a chunk size that stays in cache (256 KiB per buffer, what
the one-host collective reduces at a time) and at one far larger than the caches (32 MiB), each
row times one operation on buffers of that size:

  memcpy            copy_bytes of one buffer (the bound: 1 read + 1 write)
  reduce_into       dst op= src (2 reads + 1 write)
  chain k=4         memcpy(dst, s0) then 3 reduce_into: the path reduce_many replaces
  reduce_many k=2/4 one pass over k sources (k reads + 1 write)
  torch add         torch.add(a, b, out=dst) with one thread: the peer for k=2

GB/s counts the bytes a perfect kernel must move (reads of every source plus the write of dst;
a chain moves more, but is charged the same as reduce_many k=4 so the two compare by time), and
each row's ratio is to memcpy's GB/s at the same size in the same run. reduce_many writes to a
buffer of its own, as the collective does, so the CPU also reads dst before writing it (a cache
line is filled before it is written): reduce_many k=2 touches one buffer more than reduce_into,
which reads and writes the same dst. Rows alternate within a
repetition, after one warm-up; a figure is the median over --repeats repetitions (min-max
beside it), each repetition long enough (--min-ms) that the Python call (about a microsecond)
is small against it. Buffers hold N(0, 1) data and are allocated once (no page faults timed).
Every figure is taken twice, by wall clock and by the thread's CPU time: on a shared machine
the second leaves out the time spent waiting for a core (ratios compare like with like).

Runs with whatever rumor._C is importable: a build without reduce_many (before issue 44) prints
its rows as missing, which is how the before/after figures of reduce_into are taken.

Writes a table to stdout, JSON to --out (default docs/benchmarks/reduce_kernels.json) and a bar
chart of the ratios next to it (.png, needs matplotlib). The last line is the headline.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import pyplot, save_figure  # noqa: E402

from rumor import _C  # noqa: E402
from rumor._tensor import dtype_code  # noqa: E402

SUM = 0  # rumor::ReduceOp::SUM
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_ops(dtype: torch.dtype, n: int):
    """[(name, reads+writes in buffers, fn)] over freshly allocated buffers of n elements."""
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(n, generator=g).to(dtype) for _ in range(4)]
    dst = torch.empty_like(srcs[0])
    code = dtype_code(dtype, "benchmark")
    nbytes = n * srcs[0].element_size()
    d, s = dst.data_ptr(), [t.data_ptr() for t in srcs]

    def chain4():
        _C.copy_bytes(d, s[0], nbytes)
        for j in range(1, 4):
            _C.reduce_into(d, s[j], n, code, SUM)

    ops = [
        ("memcpy", 2, lambda: _C.copy_bytes(d, s[0], nbytes)),
        ("reduce_into", 3, lambda: _C.reduce_into(d, s[1], n, code, SUM)),
        ("chain k=4", 5, chain4),
    ]
    if hasattr(_C, "reduce_many"):
        ops += [
            ("reduce_many k=2", 3, lambda: _C.reduce_many(d, s[:2], n, code, SUM)),
            ("reduce_many k=4", 5, lambda: _C.reduce_many(d, s, n, code, SUM)),
        ]
    ops.append(("torch add", 3, lambda: torch.add(srcs[0], srcs[1], out=dst)))
    return ops, nbytes


def calls_for(fn, min_s: float) -> int:
    """Calls per repetition so that one repetition lasts at least min_s."""
    calls = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - t0 >= min_s or calls >= 1 << 20:
            return calls
        calls *= 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "..", "docs", "benchmarks", "reduce_kernels.json"),
                    help="JSON path; the PNG goes next to it")
    ap.add_argument("--kib", default="256,32768", help="buffer sizes in KiB, comma-separated")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of " + ", ".join(DTYPES))
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--min-ms", type=float, default=20.0, help="least duration of one timed repetition")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [int(k) for k in args.kib.split(",")]
    dtypes = args.dtypes.split(",")

    cells = []
    for name in dtypes:
        for kib in sizes:
            n = kib * 1024 // torch.empty(0, dtype=DTYPES[name]).element_size()
            ops, nbytes = make_ops(DTYPES[name], n)
            calls = {op: calls_for(fn, args.min_ms / 1e3) for op, _, fn in ops}
            wall = {op: [] for op, _, _ in ops}
            cpu = {op: [] for op, _, _ in ops}
            for _ in range(args.repeats):
                for op, _, fn in ops:  # alternating within a repetition
                    t0, c0 = time.perf_counter(), time.thread_time()
                    for _ in range(calls[op]):
                        fn()
                    c1, t1 = time.thread_time(), time.perf_counter()
                    wall[op].append((t1 - t0) / calls[op])
                    cpu[op].append((c1 - c0) / calls[op])
            moved = {op: buffers * nbytes for op, buffers, _ in ops}
            moved["chain k=4"] = 5 * nbytes  # charged as reduce_many k=4 (see the docstring)
            for op, _, _ in ops:
                c = dict(dtype=name, kib=kib, op=op, calls=calls[op], bytes_moved=moved[op],
                         wall_seconds=wall[op], cpu_seconds=cpu[op])
                for clock, times in (("", wall[op]), ("cpu_", cpu[op])):
                    gbs = sorted(moved[op] / max(t, 1e-12) / 1e9 for t in times)
                    c.update({clock + "gbs": statistics.median(gbs), clock + "gbs_min": gbs[0],
                              clock + "gbs_max": gbs[-1]})
                cells.append(c)
            print(f"  measured {name} {kib} KiB", file=sys.stderr)

    def cell(name, kib, op):
        return next((c for c in cells if c["dtype"] == name and c["kib"] == kib and c["op"] == op), None)

    for c in cells:
        for clock in ("", "cpu_"):
            c[clock + "vs_memcpy"] = c[clock + "gbs"] / cell(c["dtype"], c["kib"], "memcpy")[clock + "gbs"]

    op_names = []
    for c in cells:
        if c["op"] not in op_names:
            op_names.append(c["op"])
    for clock, label in (("", "wall clock"), ("cpu_", "thread CPU time")):
        print(f"reduce kernels: {_C.reduce_isa()}; one thread; median of {args.repeats} (min-max) by {label}; "
              "GB/s of bytes moved (ratio to memcpy)")
        print(f"{'dtype':9s} {'size':>9s} " + " ".join(f"{op:>30s}" for op in op_names))
        for name in dtypes:
            for kib in sizes:
                row = []
                for op in op_names:
                    c = cell(name, kib, op)
                    row.append(f"{c[clock + 'gbs']:6.1f} [{c[clock + 'gbs_min']:5.1f}-{c[clock + 'gbs_max']:5.1f}] "
                               f"({c[clock + 'vs_memcpy']:4.2f}x)" if c else "-")
                print(f"{name:9s} {kib:6d} KiB " + " ".join(f"{r:>30s}" for r in row))

    headline = None
    bf = cell("bfloat16", sizes[0], "reduce_many k=4")
    ch = cell("bfloat16", sizes[0], "chain k=4")
    if bf and ch:
        headline = (f"bfloat16 {sizes[0]} KiB, 4 sources: reduce_many {bf['gbs']:.1f} GB/s = "
                    f"{bf['gbs'] / ch['gbs']:.2f}x the reduce_into chain, {bf['vs_memcpy']:.2f}x memcpy "
                    f"(by CPU time: {bf['cpu_gbs'] / ch['cpu_gbs']:.2f}x, {bf['cpu_vs_memcpy']:.2f}x)")
    result = dict(
        when=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node(), cpu=platform.processor() or platform.machine(), isa=_C.reduce_isa(),
        torch=torch.__version__, threads=1, repeats=args.repeats, min_ms=args.min_ms,
        loadavg=os.getloadavg(), has_reduce_many=hasattr(_C, "reduce_many"), cells=cells, headline=headline)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    png = os.path.splitext(args.out)[0] + ".png"
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: no plot written")
    else:
        groups = [(name, kib) for name in dtypes for kib in sizes]
        fig, ax = plt.subplots(figsize=(11, 4.5))
        width = 0.8 / len(op_names)
        for i, op in enumerate(op_names):
            xs, ys = [], []
            for g, (name, kib) in enumerate(groups):
                c = cell(name, kib, op)
                if c:
                    xs.append(g + (i - (len(op_names) - 1) / 2) * width)
                    ys.append(c["cpu_vs_memcpy"])
            ax.bar(xs, ys, width, label=op)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(groups)), [f"{name}\n{kib} KiB" for name, kib in groups])
        ax.set_ylabel("GB/s moved / memcpy GB/s (thread CPU time)")
        ax.set_title(f"rumor reduce kernels ({_C.reduce_isa()}), one thread")
        ax.legend(fontsize=8, ncol=3)
        save_figure(plt, fig, png)
        print(f"wrote {png}")
    print(headline or "no headline: this rumor._C has no reduce_many")
    return 0


if __name__ == "__main__":
    sys.exit(main())
