"""Optimizer step time: rumor's fused step vs torch's foreach and per-tensor (for-loop) steps.

For SGD (momentum 0.9) and Adam on mlp25m and the transformer of rumor.testing.models, one
process, gradients filled with fixed random values: the median of --iters timed steps of
  - rumor fused: rumor.optim.fuse_optimizer (flat buffers, rumor's C++ kernels),
  - torch foreach: torch.optim.X(foreach=True),
  - torch for-loop: torch.optim.X(foreach=False),
and the bound: the bytes each step must read and write (params, grads and state) at the memory
bandwidth measured by a large torch copy. Prints ratios (target: fused Adam >= 1.5x foreach),
saves JSON + PNG under benchmarks/results/.

Training throughput with overlap_optimizer is measured by benchmarks/training.py:
  python benchmarks/training.py --world 4 --models mlp25m --algorithms rumor,rumor_fused,rumor_overlap

Run: python benchmarks/optimizer.py   (smoke: --iters 3 --models mlp25m)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import pyplot, run_meta, finish_meta, save_figure  # noqa: E402

import rumor.optim  # noqa: E402
from rumor import _C  # noqa: E402
from rumor.testing import models  # noqa: E402

VARIANTS = ("rumor fused", "torch foreach", "torch for-loop")
STATE_BUFFERS = {"sgd": 1, "adam": 2}  # state tensors per parameter


def make(opt_name, params, variant):
    kw = dict(lr=1e-3)
    if variant != "rumor fused":
        kw["foreach"] = variant == "torch foreach"
    opt = (torch.optim.SGD(params, momentum=0.9, **kw) if opt_name == "sgd" else torch.optim.Adam(params, **kw))
    if variant == "rumor fused":
        rumor.optim.fuse_optimizer(opt)
    return opt


def time_steps(model_name, opt_name, variant, iters, warmup):
    model = models.build(model_name, seed=0)
    opt = make(opt_name, model.parameters(), variant)
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        grad = torch.randn(p.shape, generator=g) * 1e-2
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.copy_(grad)
    times = []
    for i in range(warmup + iters):
        t = time.perf_counter()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    n = sum(p.numel() for p in model.parameters())
    return statistics.median(times), n, len(list(model.parameters()))


def bandwidth():
    a, b = torch.empty(64 << 20, dtype=torch.uint8), torch.empty(64 << 20, dtype=torch.uint8)
    a.fill_(1)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        ts.append(time.perf_counter() - t)
    return 2 * a.numel() / min(ts)  # read + write


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp25m,transformer")
    ap.add_argument("--optimizers", default="sgd,adam")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = run_meta(args)
    bw = bandwidth()
    cells = []
    print(f"optimizer step, median of {args.iters}; kernels: {_C.optim_isa()}; torch threads "
          f"{torch.get_num_threads()}; copy bandwidth {bw / 1e9:.1f} GB/s")
    print(f"{'model':12s} {'opt':5s} {'params':>8s} " + " ".join(f"{v:>15s}" for v in VARIANTS)
          + f" {'bound':>9s} {'vs foreach':>10s} {'vs loop':>8s} {'of bound':>8s}")
    for m in args.models.split(","):
        for o in args.optimizers.split(","):
            res = {}
            for v in VARIANTS:
                res[v], n, tensors = time_steps(m, o, v, args.iters, args.warmup)
            # fp32: params and grads read, params written, each state buffer read and written
            nbytes = 4 * n * (3 + 2 * STATE_BUFFERS[o])
            bound = nbytes / bw
            cell = dict(model=m, optimizer=o, params=n, tensors=tensors, seconds=res, bound_s=bound,
                        vs_foreach=res["torch foreach"] / res["rumor fused"],
                        vs_loop=res["torch for-loop"] / res["rumor fused"], of_bound=bound / res["rumor fused"])
            cells.append(cell)
            print(f"{m:12s} {o:5s} {n / 1e6:7.1f}M " + " ".join(f"{res[v] * 1e3:12.2f} ms" for v in VARIANTS)
                  + f" {bound * 1e3:6.2f} ms {cell['vs_foreach']:9.2f}x {cell['vs_loop']:7.2f}x "
                  f"{cell['of_bound']:7.0%}")
    finish_meta(meta)
    adam = [c["vs_foreach"] for c in cells if c["optimizer"] == "adam"]
    headline = (f"fused Adam step vs torch foreach: {min(adam):.2f}x (worst model; target >= 1.5x)"
                if adam else None)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, "optimizer" + (f"_{args.tag}" if args.tag else ""))
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, bandwidth_Bps=bw, isa=_C.optim_isa(), cells=cells, headline=headline), f, indent=1)
    print(f"wrote {stem}.json")
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: no plot written")
    else:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{c['model']}\n{c['optimizer']}" for c in cells]
        w = 0.2
        for k, v in enumerate(VARIANTS):
            ax.bar([i + (k - 1) * w for i in range(len(cells))], [c["seconds"][v] * 1e3 for c in cells], w, label=v)
        ax.scatter([i + 2 * w for i in range(len(cells))], [c["bound_s"] * 1e3 for c in cells], marker="_", s=200,
                   color="k", label="memory bound")
        ax.set_xticks(range(len(cells)), labels)
        ax.set_ylabel("step time (ms)")
        ax.legend(fontsize=8)
        save_figure(plt, fig, stem + ".png")
        print(f"wrote {stem}.png")
    print(headline or "no Adam cell measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
