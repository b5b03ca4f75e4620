#!/usr/bin/env python
"""Autotuning the wrapper: DistributedDataParallel(autotune=...) tries bucket sizes, the first
bucket's size, where buckets split, shared-memory buckets and the small-allreduce threshold during
the first steps of training, and keeps the fastest setting.

    python -m rumor.run --nproc-per-node 4 examples/autotune.py
    python -m rumor.run --nproc-per-node 4 --autotune examples/autotune.py --no-autotune-arg

The search needs optuna on rank 0 (pip install optuna). Training goes on during the search: the
settings change how gradients travel, never what they add up to, so every step counts. The
result is cached (default ~/.cache/rumor/autotune.json, keyed by the model's gradients, the
world and the machine), and a later run with the same job starts from it instead of searching;
--no-cache neither reads nor writes it. Rank 0 prints the loss averaged over the ranks and, at
the end of the search, the setting it kept (docs/autotune.md).

The second launch line shows the launcher flag instead: rumor-run --autotune sets
RUMOR_AUTOTUNE=1, which every wrapper in the script reads when its autotune= is left unset.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import rumor


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--budget-steps", type=int, default=60, help="steps the search may take")
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--no-cache", action="store_true", help="do not read or write the autotune cache")
    ap.add_argument("--no-autotune-arg", action="store_true",
                    help="leave autotune= unset (for rumor-run --autotune / RUMOR_AUTOTUNE=1)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rumor.init()
    rank, world = rumor.rank(), rumor.size()
    g = torch.Generator().manual_seed(args.seed)
    teacher = torch.randn(64, 10, generator=g)
    data_gen = torch.Generator().manual_seed(args.seed + 1 + rank)

    torch.manual_seed(args.seed)
    # Several layers of different sizes: enough gradients for bucket settings to matter.
    w = args.width
    model = torch.nn.Sequential(torch.nn.Linear(64, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
                                torch.nn.Linear(w, w // 2), torch.nn.ReLU(), torch.nn.Linear(w // 2, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # A dict of rumor.autotune.AutotuneConfig fields (or True for the defaults).
    tune = None if args.no_autotune_arg else dict(budget_steps=args.budget_steps, use_cache=not args.no_cache,
                                                  seed=args.seed)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=rumor.algorithms.GradientAllReduce(),
                                        autotune=tune)

    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch_size, 64, generator=data_gen)
        y = (x @ teacher).argmax(dim=1)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            mean = rumor.allreduce(loss.detach().reshape(1), op=rumor.ReduceOp.SUM) / world
            if rank == 0:
                print(f"step {step} loss {mean.item():.4f}", flush=True)
    rumor.shutdown()


if __name__ == "__main__":
    main()
