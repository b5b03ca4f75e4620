#!/usr/bin/env python
"""rumor.DistributedDataParallel against torch DDP, side by side (what scripts/demo.sh runs).

    python -m rumor.run --nproc-per-node 4 benchmarks/vs_ddp.py                 # mlp25m (~25M params)
    python -m rumor.run --nproc-per-node 4 benchmarks/vs_ddp.py --model cnn --steps 30
    torchrun --nproc-per-node 2 benchmarks/vs_ddp.py --model transformer

Every rank builds the same model twice (same seed): one copy wrapped in
rumor.DistributedDataParallel (GradientAllReduce: bucketed allreduce overlapped with backward),
the other in torch.nn.parallel.DistributedDataParallel over gloo, in the same processes
(rumor.init() first; torch.distributed then shares rumor's store). They train on the same
synthetic batches (rumor.testing.models; a small pool, cycled, so that the loss goes down),
in alternating blocks of steps, so both see the same
machine load. Rank 0 draws a progress bar (tqdm, on stderr) and prints, per framework, samples/s (global batch /
slowest rank's step time) and the loss, then how far apart the two models ended up and, as
the last line, the samples/s ratio.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="mlp25m", choices=("mlp25m", "cnn", "transformer"))
    ap.add_argument("--batch", type=int, default=None, help="per-rank batch (default: the model's standard batch)")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per framework")
    ap.add_argument("--block", type=int, default=5, help="steps per block (the frameworks alternate blocks)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps per framework first")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--hierarchical", action="store_true", help="GradientAllReduce(hierarchical=True)")
    ap.add_argument("--distinct-batches", type=int, default=8,
                    help="cycle over this many synthetic batches per rank (so the loss can go down)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from tqdm import tqdm

    import rumor
    from rumor.testing import models

    rumor.init()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = rumor.rank(), rumor.size()
    if "OMP_NUM_THREADS" not in os.environ:
        # Several ranks per machine: torch's thread pools would only fight each other.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, rumor.local_size())))
    batch = args.batch or models.BATCH[args.model]
    main_rank = rank == 0

    # Two identical replicas; each wrapper also broadcasts rank 0's weights when wrapping.
    rmodel = models.build(args.model, seed=args.seed)
    tmodel = models.build(args.model, seed=args.seed)
    alg = rumor.algorithms.GradientAllReduce(hierarchical=args.hierarchical)
    ropt = torch.optim.SGD(rmodel.parameters(), lr=args.lr, momentum=args.momentum)
    topt = torch.optim.SGD(tmodel.parameters(), lr=args.lr, momentum=args.momentum)
    runs = {
        "rumor": (rumor.DistributedDataParallel(rmodel, optimizer=ropt, algorithm=alg), ropt),
        "torch DDP": (TorchDDP(tmodel), topt),
    }
    if main_rank:
        print(f"{args.model}: {models.num_params(rmodel) / 1e6:.1f}M parameters, {world} ranks on "
              f"{rumor.machine_size()} host(s), batch {batch} per rank ({batch * world} global), "
              f"torch {torch.__version__}, {torch.get_num_threads()} thread(s) per rank", flush=True)

    data = {}

    def get_batch(step):
        if step not in data:  # generated outside the timed region, once for both frameworks
            data[step] = models.batch(args.model, batch, step=step % args.distinct_batches, shard=rank,
                                      seed=args.seed)
        return data[step]

    def train_step(name, step):
        ddp, opt = runs[name]
        x, y = get_batch(step)
        opt.zero_grad()
        loss = models.loss(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    blocks = -(-args.steps // args.block)
    # Off a terminal tqdm would redraw into a log file: one line every few seconds there instead.
    bar = tqdm(total=2 * (args.warmup + blocks * args.block), disable=not main_rank, file=sys.stderr,
               dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 5.0)
    times = {name: [] for name in runs}
    losses = {name: [] for name in runs}
    next_step = {name: 0 for name in runs}
    try:
        for name in runs:  # warm-up: first iterations build buckets, allocate, connect
            for _ in range(args.warmup):
                get_batch(next_step[name])
                train_step(name, next_step[name])
                next_step[name] += 1
                bar.set_postfix_str(f"warm-up {name}", refresh=False)
                bar.update()
        for b in range(blocks):
            order = list(runs) if b % 2 == 0 else list(reversed(list(runs)))
            for name in order:
                n = min(args.block, args.steps - b * args.block)
                for _ in range(n):
                    get_batch(next_step[name])
                    dist.barrier()
                    t0 = time.perf_counter()
                    loss = train_step(name, next_step[name])
                    dt = time.perf_counter() - t0
                    next_step[name] += 1
                    # The slowest rank's step time, and the mean loss over ranks (not timed).
                    slowest = torch.tensor([dt], dtype=torch.float64)
                    total = loss.double().reshape(1)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    dist.all_reduce(total, op=dist.ReduceOp.SUM)
                    times[name].append(float(slowest))
                    losses[name].append(float(total) / world)
                    bar.set_postfix_str(f"{name} block {b + 1}/{blocks}: "
                                        f"{batch * world / float(slowest):7.1f} samples/s, "
                                        f"loss {losses[name][-1]:.4f}", refresh=False)
                    bar.update()
    finally:
        bar.close()

    # How far apart the two replicas ended up (same data, same init, same optimizer).
    diff = torch.zeros(1, dtype=torch.float64)
    for p, q in zip(rmodel.parameters(), tmodel.parameters()):
        diff = torch.maximum(diff, (p.detach() - q.detach()).abs().max().double().reshape(1))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)

    if main_rank:
        global_batch = batch * world
        print(f"\n{'framework':<10} {'samples/s':>10} {'[min - max]':>21} {'step time':>10} "
              f"{'first loss':>10} {'last loss':>10}")
        sps = {}
        for name in runs:
            med = statistics.median(times[name])
            sps[name] = global_batch / med
            lo, hi = global_batch / max(times[name]), global_batch / min(times[name])
            print(f"{name:<10} {sps[name]:>10.1f} {f'[{lo:.1f} - {hi:.1f}]':>21} {med * 1e3:>8.1f}ms "
                  f"{losses[name][0]:>10.4f} {losses[name][-1]:>10.4f}")
        print(f"(median of {args.steps} steps each, in alternating blocks of {args.block}; rumor "
              f"GradientAllReduce{'(hierarchical=True)' if args.hierarchical else ''} vs torch DDP over gloo, "
              f"both with 25 MB buckets)")
        print(f"max |rumor parameter - torch DDP parameter| after training: {float(diff):.3g}")
        print(f"rumor / torch DDP: {sps['rumor'] / sps['torch DDP']:.2f}x samples/s", flush=True)
    dist.barrier()
    rumor.barrier()
    dist.destroy_process_group()
    rumor.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
