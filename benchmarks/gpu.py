#!/usr/bin/env python
"""The GPU benchmark of issue 12, for a machine with one NVIDIA GPU (not yet run on one).

Two parts, both in one process on cuda:0 (one GPU: NCCL refuses two ranks on one device, so
these are world size 1 figures; rumor's multi-rank GPU path on one GPU is host staging, which
scripts/gpu_check.sh's tests cover):

1. allreduce, rumor vs torch.distributed (NCCL), float32, 4 KiB .. 256 MiB: rumor.allreduce_
   over its own NCCL communicator (RUMOR_GPU_TRANSPORT=nccl) against dist.all_reduce, alternating,
   after warm-up, timed with CUDA events over --iters back-to-back calls, median and min-max of
   --repeats runs. With one rank both are NCCL's local copy plus each library's overhead per
   call (rumor's blocking call waits for its event with a deadline; torch's returns at once), so
   algbw is reported and the bound is a device-to-device copy of the same bytes (busbw, which
   is algbw * 2 (n - 1) / n, is 0 for n = 1).
2. DistributedDataParallel training samples/s, rumor vs torch DDP (NCCL), on the standard models
   (mlp25m, cnn, transformer at their standard per-rank batch), against the compute-only step of
   the plain model (the bound): median step of --steps after --warmup, with the GPU synchronized
   at each step's end (events), every variant in the same process on the same data, alternating
   by blocks.

Prints a table, writes JSON with every raw figure (default docs/benchmarks/gpu.json, --out) and
a PNG next to it; the last line printed is the headline. Without a CUDA device it says so and
exits 0 without writing anything (1 with --require-gpu or RUMOR_EXPECT_GPU=1).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

import torch

MIB = 1 << 20


def _events_time(fn, iters: int) -> float:
    """Seconds per call of fn over iters back-to-back calls, timed by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _stats(xs):
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs), samples=list(xs))


def allreduce_part(args, progress):
    import torch.distributed as dist

    import rumor

    rows = []
    sizes = [4 << 10]
    while sizes[-1] < args.max_mib * MIB:
        sizes.append(sizes[-1] * 4)
    for nbytes in sizes:
        n = nbytes // 4
        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)
        iters = max(5, min(args.iters, (1 << 30) // nbytes))
        fns = {"rumor": lambda: rumor.allreduce_(x, op=rumor.ReduceOp.SUM),
               "torch": lambda: dist.all_reduce(x),
               "d2d copy": lambda: y.copy_(x)}
        for fn in fns.values():  # warm-up (NCCL sets up its buffers on first use)
            fn()
        torch.cuda.synchronize()
        times = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, fn in fns.items():  # alternating
                times[k].append(_events_time(fn, iters))
        row = dict(bytes=nbytes, iters=iters)
        for k, ts in times.items():
            row[k] = _stats([nbytes / t / 1e9 for t in ts])  # GB/s (algbw)
        row["rumor_vs_torch"] = row["rumor"]["median"] / row["torch"]["median"]
        row["rumor_vs_copy"] = row["rumor"]["median"] / row["d2d copy"]["median"]
        rows.append(row)
        progress(f"allreduce {nbytes / MIB:.3f} MiB")
    return rows


def _step_fn(name, model, opt, args):
    from rumor.testing import models

    batch = models.batch(name, args.batch.get(name, BATCH[name]), step=0)
    x, y = (t.cuda() for t in batch)

    def step():
        opt.zero_grad(set_to_none=True)
        models.loss(model(x), y).backward()
        opt.step()

    return step


BATCH = {"mlp25m": 32, "cnn": 32, "transformer": 16}


def ddp_part(args, progress):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import rumor
    from rumor.testing import models

    rows = []
    for name in args.models:
        variants = {}
        base = models.build(name, seed=0).cuda()
        for kind in ("plain", "rumor", "torch"):
            m = models.build(name, seed=0).cuda()
            m.load_state_dict(base.state_dict())
            opt = torch.optim.SGD(m.parameters(), lr=args.lr)
            try:
                if kind == "rumor":
                    m = rumor.DistributedDataParallel(m, optimizer=opt)
                elif kind == "torch":
                    m = TorchDDP(m, device_ids=[0])
                variants[kind] = _step_fn(name, m, opt, args)
            except Exception as e:  # noqa: BLE001 - reported in the table, the other rows still run
                variants[kind] = e
        times = {k: [] for k, v in variants.items() if callable(v)}
        for k, fn in variants.items():
            if callable(fn):
                for _ in range(args.warmup):
                    fn()
        torch.cuda.synchronize()
        for _ in range(args.steps // 5):
            for k in times:  # alternating blocks of 5 steps
                times[k].append(_events_time(variants[k], 5))
        bsz = args.batch.get(name, BATCH[name])
        row = dict(model=name, batch=bsz)
        for k, v in variants.items():
            if callable(v):
                row[k] = dict(step_s=_stats(times[k]), samples_per_s=bsz / statistics.median(times[k]))
            else:
                row[k] = dict(error=f"{type(v).__name__}: {v}")
        if "rumor" in times and "torch" in times:
            row["rumor_vs_torch"] = row["rumor"]["samples_per_s"] / row["torch"]["samples_per_s"]
        if "rumor" in times and "plain" in times:
            row["rumor_vs_compute_only"] = row["rumor"]["samples_per_s"] / row["plain"]["samples_per_s"]
        rows.append(row)
        progress(f"ddp {name}")
    return rows


def _plot(result, png):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    ar = result["allreduce"]
    mib = [r["bytes"] / MIB for r in ar]
    for k in ("rumor", "torch", "d2d copy"):
        a.plot(mib, [r[k]["median"] for r in ar], marker="o", label=k)
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("MiB")
    a.set_ylabel("GB/s (algbw; copy: the bound)")
    a.set_title("allreduce, 1 rank, NCCL")
    a.legend()
    ddp = result["ddp"]
    names = [r["model"] for r in ddp]
    width = 0.25
    for i, k in enumerate(("plain", "rumor", "torch")):
        vals = [r[k].get("samples_per_s", 0.0) for r in ddp]
        b.bar([j + (i - 1) * width for j in range(len(names))], vals, width, label=k)
    b.set_xticks(range(len(names)))
    b.set_xticklabels(names)
    b.set_ylabel("samples/s")
    b.set_title("training, 1 GPU (plain: compute-only bound)")
    b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()  # a tuple in recent torch, an int (e.g. 21803) in older ones
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(here, "..", "docs", "benchmarks", "gpu.json"))
    ap.add_argument("--models", default="mlp25m,cnn,transformer")
    ap.add_argument("--batch", default="", help="per-rank batch overrides, e.g. mlp25m=64")
    ap.add_argument("--max-mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=50, help="allreduce calls per timed run (fewer for large sizes)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50, help="measured training steps per variant")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    ap.add_argument("--require-gpu", action="store_true", help="exit 1 (not 0) without a CUDA device")
    args = ap.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    args.batch = {k: int(v) for k, v in (kv.split("=") for kv in args.batch.split(",") if kv)}
    if args.quick:
        args.max_mib, args.repeats, args.steps, args.warmup, args.iters = 4, 3, 10, 2, 10
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device is visible; nothing measured")
        return 1 if args.require_gpu or os.environ.get("RUMOR_EXPECT_GPU") == "1" else 0

    import torch.distributed as dist

    import rumor

    os.environ.setdefault("RUMOR_GPU_TRANSPORT", "nccl")
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    rumor.init()
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    try:
        from tqdm import tqdm

        bar = tqdm(total=None, desc="gpu benchmark", file=sys.stderr)
        progress = lambda what: (bar.update(1), bar.set_postfix_str(what))  # noqa: E731
    except ImportError:
        bar, progress = None, lambda what: print(what, file=sys.stderr)  # noqa: E731
    result = dict(meta=dict(date=datetime.datetime.now().isoformat(timespec="seconds"), host=platform.node(),
                            gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
                            nccl=_nccl_version(), args=vars(args)))
    result["allreduce"] = allreduce_part(args, progress)
    result["ddp"] = ddp_part(args, progress)
    if bar is not None:
        bar.close()
    dist.destroy_process_group()
    rumor.shutdown()

    print(f"{result['meta']['gpu']}, torch {result['meta']['torch']}, NCCL {result['meta']['nccl']}")
    print("allreduce, 1 rank (GB/s algbw, median of runs; bound: device-to-device copy)")
    print(f"{'MiB':>10} {'rumor':>9} {'torch':>9} {'copy':>9} {'rumor/torch':>12} {'rumor/copy':>11}")
    for r in result["allreduce"]:
        print(f"{r['bytes'] / MIB:10.3f} {r['rumor']['median']:9.2f} {r['torch']['median']:9.2f} "
              f"{r['d2d copy']['median']:9.2f} {r['rumor_vs_torch']:12.2f} {r['rumor_vs_copy']:11.2f}")
    print("training, 1 GPU (samples/s; plain: the compute-only step, the bound)")
    for r in result["ddp"]:
        cells = []
        for k in ("plain", "rumor", "torch"):
            v = r[k]
            cells.append(f"{k} {v['samples_per_s']:.0f}" if "samples_per_s" in v else f"{k} ERROR {v['error']}")
        ratio = f"rumor/torch {r['rumor_vs_torch']:.2f}" if "rumor_vs_torch" in r else "rumor/torch -"
        print(f"  {r['model']:12s} " + ", ".join(cells) + f"; {ratio}")
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")
    _plot(result, os.path.splitext(out)[0] + ".png")
    big = result["allreduce"][-1]
    ratios = [r["rumor_vs_torch"] for r in result["ddp"] if "rumor_vs_torch" in r]
    ddp = f"DDP samples/s rumor/torch median {statistics.median(ratios):.2f}" if ratios else "DDP: no rumor/torch pair"
    print(f"headline: allreduce {big['bytes'] / MIB:.0f} MiB rumor/torch {big['rumor_vs_torch']:.2f} "
          f"(rumor/copy {big['rumor_vs_copy']:.2f}); {ddp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
