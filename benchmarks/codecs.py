#!/usr/bin/env python
"""Codec throughput on one core: encode and decode GB/s of each rumor.compression codec.

Input: 64 MiB of float32 (16 Mi elements of N(0, 1)); GB/s counts float32 input bytes processed
per second (encode reads them, decode writes them). Reference: memcpy of the same 64 MiB in the
same run, the faster of torch's copy_ and ctypes.memmove. torch runs with one thread, and the
codec kernels are single-threaded. Buffers are allocated once and reused, so page faults are
not timed. Each figure is the best of --repeats timed runs after one warm-up.

Each figure is reported twice: by wall-clock time (the headline) and by the thread's CPU
time, which on a shared machine leaves out time spent waiting for a core; ratios compare each
clock with memcpy measured by the same clock.

Writes a table to stdout, JSON to --out (default docs/benchmarks/codecs.json) and a bar chart
next to it (.png, needs matplotlib).

--device cuda measures the CUDA kernels instead: 512 MiB of float32 on the current GPU (--mib),
GB/s of float32 input as above, against a device-to-device copy of the same bytes (torch's
copy_), timed with CUDA events over --iters back-to-back calls, best of --repeats. A decode call
includes its header check (a 32-byte read to the host, which waits for the stream), as a user
pays it. JSON goes to docs/benchmarks/codecs_cuda.json unless --out says otherwise.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import sys
import time

import torch

from rumor import compression as C

MIB = 1 << 20


def best_time(fn, repeats: int):
    """(best wall-clock seconds, best thread CPU seconds) over `repeats` runs after a warm-up.
    On a shared machine CPU time leaves out the time the thread waited for a core."""
    fn()
    wall = cpu = float("inf")
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        c1, t1 = time.thread_time(), time.perf_counter()
        wall, cpu = min(wall, t1 - t0), min(cpu, c1 - c0)
    return wall, cpu


def make_codecs():
    return [
        C.MinMaxUInt8(),
        C.QSGD(levels=16),
        C.QSGD(levels=256),
        C.SignScale(),
        C.Float16(),
        C.BFloat16(),
    ]


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the codecs run (default cpu)")
    ap.add_argument(
        "--out",
        default=None,
        help="JSON path; the PNG goes next to it (default docs/benchmarks/codecs.json, codecs_cuda.json for cuda)",
    )
    ap.add_argument("--mib", type=int, default=None, help="float32 input size in MiB (default 64, 512 for cuda)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20, help="cuda: calls per timed run (default 20)")
    args = ap.parse_args()
    name = "codecs.json" if args.device == "cpu" else "codecs_cuda.json"
    args.out = args.out or os.path.join(here, "..", "docs", "benchmarks", name)
    args.mib = args.mib or (64 if args.device == "cpu" else 512)
    return run_cpu(args) if args.device == "cpu" else run_cuda(args)


def run_cpu(args) -> int:
    torch.set_num_threads(1)
    n = args.mib * MIB // 4
    nbytes = n * 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    dst = torch.empty_like(x)

    t_copy = best_time(lambda: dst.copy_(x), args.repeats)
    t_memmove = best_time(lambda: ctypes.memmove(dst.data_ptr(), x.data_ptr(), nbytes), args.repeats)
    # The reference is the faster of the two, by each clock.
    memcpy = {k: nbytes / min(t_copy[i], t_memmove[i]) / 1e9 for i, k in enumerate(("wall", "cpu"))}
    memcpy_gbs = memcpy["wall"]

    rows = []
    for codec in make_codecs():
        buf = torch.empty(codec.encoded_bytes(n), dtype=torch.uint8)
        times = {
            "encode": best_time(lambda: codec.encode(x, seed=1, out=buf), args.repeats),
            "decode": best_time(lambda: codec.decode(buf, n, out=dst), args.repeats),
            "decode_accumulate": best_time(lambda: codec.decode(buf, n, out=dst, accumulate=True), args.repeats),
        }
        row = {"codec": codec.name, "encoded_bytes": buf.numel(), "bytes_per_element": buf.numel() / n}
        for k, (wall, cpu) in times.items():
            row[k + "_gbs"] = nbytes / wall / 1e9
            row[k + "_vs_memcpy"] = row[k + "_gbs"] / memcpy["wall"]
            row[k + "_cpu_gbs"] = nbytes / cpu / 1e9
            row[k + "_cpu_vs_memcpy"] = row[k + "_cpu_gbs"] / memcpy["cpu"]
        rows.append(row)

    print(f"codec kernels: {C.isa()}; one thread; {args.mib} MiB float32; best of {args.repeats}")
    print(
        f"memcpy: {memcpy['wall']:.2f} GB/s wall-clock, {memcpy['cpu']:.2f} GB/s by thread CPU time "
        f"(torch copy_ {nbytes / t_copy[0] / 1e9:.2f}, memmove {nbytes / t_memmove[0] / 1e9:.2f} wall)"
    )
    print("GB/s of float32 input (ratio to memcpy); wall-clock, then by thread CPU time")
    ops = ("encode", "decode", "decode_accumulate")
    heads = " ".join(f"{o:>21s}" for o in ops)
    print(f"{'codec':30s} {'B/elem':>6s} {heads}   | {heads}")
    for r in rows:
        wall = " ".join(f"{r[o + '_gbs']:12.2f} ({r[o + '_vs_memcpy']:4.2f}x)" for o in ops)
        cpu = " ".join(f"{r[o + '_cpu_gbs']:12.2f} ({r[o + '_cpu_vs_memcpy']:4.2f}x)" for o in ops)
        print(f"{r['codec']:30s} {r['bytes_per_element']:6.3f} {wall}   | {cpu}")

    result = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "isa": C.isa(),
        "torch": torch.__version__,
        "threads": 1,
        "input_mib": args.mib,
        "repeats": args.repeats,
        "memcpy_gbs": memcpy["wall"],
        "memcpy_cpu_gbs": memcpy["cpu"],
        "torch_copy_gbs": nbytes / t_copy[0] / 1e9,
        "memmove_gbs": nbytes / t_memmove[0] / 1e9,
        "codecs": rows,
    }
    return write(result, rows, args.out, memcpy_gbs, "memcpy", "GB/s of float32 input, one core",
                 f"rumor codecs ({C.isa()}), {args.mib} MiB float32")


def run_cuda(args) -> int:
    if not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    if not C.cuda_available():
        print("--device cuda: this rumor build has no CUDA codec kernels or sees no device", file=sys.stderr)
        return 2
    n = args.mib * MIB // 4
    nbytes = n * 4
    x = torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    dst = torch.empty_like(x)

    def best_gpu_time(fn) -> float:
        """Best seconds per call over --repeats runs of --iters calls, after a warm-up, by CUDA
        events on the current stream."""
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(args.repeats):
            start.record()
            for _ in range(args.iters):
                fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / args.iters)
        return best

    copy_gbs = nbytes / best_gpu_time(lambda: dst.copy_(x)) / 1e9
    rows = []
    for codec in make_codecs():
        buf = torch.empty(codec.encoded_bytes(n), dtype=torch.uint8, device="cuda")
        times = {
            "encode": best_gpu_time(lambda: codec.encode(x, seed=1, out=buf)),
            "decode": best_gpu_time(lambda: codec.decode(buf, n, out=dst)),
            "decode_accumulate": best_gpu_time(lambda: codec.decode(buf, n, out=dst, accumulate=True)),
        }
        row = {"codec": codec.name, "encoded_bytes": buf.numel(), "bytes_per_element": buf.numel() / n}
        for k, t in times.items():
            row[k + "_gbs"] = nbytes / t / 1e9
            row[k + "_vs_copy"] = row[k + "_gbs"] / copy_gbs
        rows.append(row)

    gpu = torch.cuda.get_device_name()
    print(f"CUDA codec kernels on {gpu}; {args.mib} MiB float32; best of {args.repeats} x {args.iters} calls")
    print(f"device-to-device copy (torch copy_): {copy_gbs:.1f} GB/s")
    print("GB/s of float32 input (ratio to the copy); decode includes its header check (one stream sync)")
    ops = ("encode", "decode", "decode_accumulate")
    print(f"{'codec':30s} {'B/elem':>6s} " + " ".join(f"{o:>21s}" for o in ops))
    for r in rows:
        cells = " ".join(f"{r[o + '_gbs']:12.1f} ({r[o + '_vs_copy']:4.2f}x)" for o in ops)
        print(f"{r['codec']:30s} {r['bytes_per_element']:6.3f} {cells}")

    result = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": "cuda",
        "gpu": gpu,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "input_mib": args.mib,
        "repeats": args.repeats,
        "iters": args.iters,
        "copy_gbs": copy_gbs,
        "codecs": rows,
    }
    return write(result, rows, args.out, copy_gbs, "device copy", "GB/s of float32 input, one GPU",
                 f"rumor CUDA codecs ({gpu}), {args.mib} MiB float32")


def write(result: dict, rows: list, path: str, ref_gbs: float, ref_name: str, ylabel: str, title: str) -> int:
    """The JSON at path and a bar chart next to it: encode / decode / decode + accumulate per codec,
    with the reference (memcpy or device copy) and half of it as lines."""
    out = os.path.abspath(path)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot written", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(11, 4.5))
    names = [r["codec"] for r in rows]
    w = 0.27
    xs = range(len(rows))
    ax.bar([i - w for i in xs], [r["encode_gbs"] for r in rows], w, label="encode")
    ax.bar(list(xs), [r["decode_gbs"] for r in rows], w, label="decode")
    ax.bar([i + w for i in xs], [r["decode_accumulate_gbs"] for r in rows], w, label="decode + accumulate")
    ax.axhline(ref_gbs, color="k", linestyle="--", label=f"{ref_name} {ref_gbs:.1f} GB/s")
    ax.axhline(ref_gbs / 2, color="gray", linestyle=":", label=f"50% of {ref_name}")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    png = os.path.splitext(out)[0] + ".png"
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
