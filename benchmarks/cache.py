#!/usr/bin/env python
"""rumor.data.CachedDataset: epoch 1 and epoch 2 times with an expensive per-sample transform.

Each sample is a 3 x S x S float32 image (S = --size, 64: 48 KiB) made by a deterministic
transform that costs about --work-ms milliseconds on one thread (rounds of matmul + tanh on the
image, the round count calibrated once at start and then fixed for every variant). One process
reads the whole dataset twice, in a new random order each epoch (--workers > 0: through a
torch DataLoader with that many worker processes, batch_size=None).

Variants:
  uncached   the dataset itself (the peer: what a user has without a cache)
  redis      CachedDataset(backend="redis"): rumor's private redis-server on loopback
  local      CachedDataset(backend="local"): the /dev/shm LRU
  bound      epoch 2 served from an in-process dict of the finished samples (clone per read):
             no cache that serializes values can beat it

Figures: seconds per epoch (best of --repeats, each repeat with an empty cache), the speedup of
epoch 2 over uncached, and epoch 1's overhead over uncached (the cost of filling the cache).
Target: epoch 2 >= 5x faster than uncached.

Writes benchmarks/results/cache.json and cache.png (needs matplotlib).

    python benchmarks/cache.py                 # the protocol's figures (~1 min)
    python benchmarks/cache.py --quick         # a smoke run (a few seconds)
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import uuid
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

import torch  # noqa: E402

VARIANTS = ("uncached", "redis", "local", "bound")


class Transformed:
    """Sample i: an image from seed i put through `rounds` rounds of (x @ W, tanh)."""

    def __init__(self, n: int, size: int, rounds: int):
        self.n, self.size, self.rounds = n, size, rounds
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(size, size, generator=g) / size ** 0.5

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(3 * self.size, self.size, generator=g)
        for _ in range(self.rounds):
            x = torch.tanh(x @ self.w) * 1.5
        return x.reshape(3, self.size, self.size), i % 1000


def calibrate(size: int, work_ms: float) -> int:
    ds = Transformed(8, size, 50)
    ds[0]
    t0 = time.perf_counter()
    for i in range(8):
        ds[i]
    per_round = (time.perf_counter() - t0) / 8 / 50
    return max(1, round(work_ms / 1e3 / per_round))


def run_epoch(ds, order: List[int], workers: int) -> float:
    t0 = time.perf_counter()
    if workers:
        sampler = order
        loader = torch.utils.data.DataLoader(ds, batch_size=None, sampler=sampler, num_workers=workers,
                                             multiprocessing_context="fork")
        for _ in loader:
            pass
    else:
        for i in order:
            ds[i]
    return time.perf_counter() - t0


class DictBound:
    def __init__(self, base):
        self.base = base
        self.store: Dict[int, tuple] = {}

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        v = self.store.get(i)
        if v is None:
            v = self.store[i] = self.base[i]
        return v[0].clone(), v[1]


def measure(variant: str, args, rounds: int) -> Dict:
    import random

    from rumor.data import CachedDataset

    best = None
    for rep in range(args.repeats):
        base = Transformed(args.samples, args.size, rounds)
        if variant == "uncached":
            ds, close = base, lambda: None
        elif variant == "bound":
            ds, close = DictBound(base), lambda: None
        else:
            ds = CachedDataset(base, backend=variant, dataset_name=f"bench-{uuid.uuid4().hex[:8]}",
                               writer_buffer_size=args.writer_buffer_size, capacity_per_node=args.capacity_mib << 20)
            close = ds.close
        try:
            rng = random.Random(rep)
            times = []
            for _ in range(2):
                order = list(range(args.samples))
                rng.shuffle(order)
                times.append(run_epoch(ds, order, args.workers))
                if hasattr(ds, "on_epoch_end"):
                    ds.on_epoch_end()
            stats = ds.stats() if hasattr(ds, "stats") else None
        finally:
            close()
        if best is None or times[1] < best["epoch2_s"]:
            best = dict(variant=variant, epoch1_s=times[0], epoch2_s=times[1], stats=stats)
    return best


def plot(png_path: str, cells: List[Dict]) -> str:
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [c["variant"] for c in cells]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [c["epoch1_s"] for c in cells], 0.4, label="epoch 1")
    ax.bar([x + 0.2 for x in xs], [c["epoch2_s"] for c in cells], 0.4, label="epoch 2")
    for x, c in zip(xs, cells):
        if c.get("epoch2_speedup"):
            ax.annotate(f"{c['epoch2_speedup']:.1f}x", (x + 0.2, c["epoch2_s"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names)
    ax.set_yscale("log")
    ax.set_ylabel("seconds per epoch (log)")
    ax.set_title(f"CachedDataset: {cells[0]['samples']} samples x {cells[0]['sample_ms']:.1f} ms transform")
    ax.legend()
    _common.save_figure(plt, fig, png_path)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--size", type=int, default=64, help="image side: samples are 3 x size x size float32")
    ap.add_argument("--work-ms", type=float, default=5.0, help="target cost of one sample's transform")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (0: read in this process)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--writer-buffer-size", type=int, default=64)
    ap.add_argument("--capacity-mib", type=int, default=1024)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--quick", action="store_true", help="200 samples, one repeat")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.repeats = 200, 1
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {','.join(VARIANTS)}")
    if "redis" in variants and shutil.which("redis-server") is None:
        print("redis-server is not installed (scripts/setup.sh installs it): skipping the redis variant")
        variants.remove("redis")
    if args.workers and "bound" in variants:
        print("--workers: no bound variant (an in-process dict does not survive the epoch's worker processes); "
              "cache stats are counted in the workers")
        variants.remove("bound")
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)

    meta = _common.run_meta(args)
    rounds = calibrate(args.size, args.work_ms)
    meta.update(rounds=rounds, variants=variants, sample_bytes=3 * args.size * args.size * 4,
                epoch="every sample once, shuffled; time of epoch 1 (cache empty) and epoch 2",
                figure="best of --repeats by epoch 2 time, each repeat with a fresh cache")
    print(f"rumor {meta['rumor']} | {meta['hostname']}, {meta['cpus']} cpus, load {meta['loadavg_start'][0]:.2f} | "
          f"{args.samples} samples of {meta['sample_bytes'] >> 10} KiB, transform {rounds} rounds (target "
          f"{args.work_ms:g} ms), workers {args.workers}" + (" | QUICK" if args.quick else ""))
    result = dict(meta=meta, cells=[], targets=[], errors=[])
    cells = []
    for v in variants:
        try:
            c = measure(v, args, rounds)
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"{v}: {type(e).__name__}: {e}")
            print(f"ERROR in {v}: {e}", file=sys.stderr)
            continue
        c.update(samples=args.samples, workers=args.workers)
        cells.append(c)
    unc = next((c for c in cells if c["variant"] == "uncached"), None)
    if unc is not None:
        sample_ms = unc["epoch1_s"] / args.samples * 1e3
        for c in cells:
            c["sample_ms"] = sample_ms
            c["epoch2_speedup"] = unc["epoch2_s"] / c["epoch2_s"]
            c["epoch1_overhead"] = c["epoch1_s"] / unc["epoch1_s"]
    _common.finish_meta(meta)
    result["cells"] = cells

    print(f"\n{'variant':10s} {'epoch 1 s':>10s} {'epoch 2 s':>10s} {'ep2 vs uncached':>16s} {'ep1 overhead':>13s}"
          f" {'ms/sample ep2':>14s}")
    for c in cells:
        sp = f"{c['epoch2_speedup']:.1f}x" if "epoch2_speedup" in c else "-"
        ov = f"{c['epoch1_overhead']:.3f}x" if "epoch1_overhead" in c else "-"
        print(f"{c['variant']:10s} {c['epoch1_s']:10.3f} {c['epoch2_s']:10.3f} {sp:>16s} {ov:>13s} "
              f"{c['epoch2_s'] / args.samples * 1e3:14.3f}")
    for c in cells:
        if c.get("stats") and not args.workers:
            s = c["stats"]
            print(f"{c['variant']}: hits {s['hits']} misses {s['misses']} errors {s['errors']} "
                  f"dropped {s['dropped_writes']} corrupt {s['corrupt']}")
    headline = None
    if unc is not None:
        by = {c["variant"]: c for c in cells}
        bound = by.get("bound")
        for v in ("redis", "local"):
            if v in by:
                sp = by[v]["epoch2_speedup"]
                ceil = f" (bound {bound['epoch2_speedup']:.1f}x)" if bound else ""
                result["targets"].append(dict(name=f"{v}: epoch 2 vs uncached >= 5x", value=sp, goal=5.0,
                                              met=sp >= 5.0))
                print(f"target: {v}: epoch 2 {sp:.1f}x faster than uncached (>= 5x) -> "
                      f"{'MET' if sp >= 5 else 'NOT MET'}{ceil}")
        parts = [f"{v} {by[v]['epoch2_speedup']:.1f}x" for v in ("redis", "local") if v in by]
        if parts:
            headline = (f"headline: epoch 2 vs uncached ({unc['epoch1_s'] / args.samples * 1e3:.1f} ms/sample "
                        f"transform): {', '.join(parts)}"
                        + (f"; in-process dict bound {by['bound']['epoch2_speedup']:.1f}x" if "bound" in by else ""))
    if args.quick:
        print("(quick mode: a smoke test, not the protocol's figures)")
    tag = "-quick" if args.quick else ""
    json_path = os.path.join(args.out, f"cache{tag}.json")
    png_path = os.path.join(args.out, f"cache{tag}.png")
    draw = None if args.no_plot else (lambda: plot(png_path, cells))
    _common.write_results(result, headline, "headline: n/a (no uncached figure)", json_path, png_path, draw)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
