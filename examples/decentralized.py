#!/usr/bin/env python
"""Decentralized SGD through the wrapper: each rank averages its weights with one peer per step
on the one-peer exponential graph (peer_selection="exp2"), never with everyone.

    python -m rumor.run --nproc-per-node 4 examples/decentralized.py
    python -m rumor.run --nproc-per-node 8 examples/decentralized.py --interval 2

At step t rank i sends its weights to rank i + 2^k and receives from rank i - 2^k (k cycling
over the powers of two below the world size) and keeps the average of the two, while forward and
backward run; its own gradient is then applied to the average. The replicas are therefore not
identical, only close: the script prints the loss averaged over the ranks and the spread of the
replicas (the largest difference of one weight between two ranks), both going down.

hierarchical=False makes the gossip happen between the ranks of one machine as well (with the
default, hierarchical=True, ranks on one host average exactly over shared memory and only one
rank per host gossips).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import rumor


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--interval", type=int, default=1, help="communicate every this many steps")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rumor.init()
    rank, world = rumor.rank(), rumor.size()
    # A regression task: one fixed teacher, each rank drawing its own inputs.
    teacher = torch.nn.Linear(16, 4)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        teacher.weight.normal_(generator=torch.Generator().manual_seed(args.seed + 100))
    data_gen = torch.Generator().manual_seed(args.seed + 1 + rank)

    # The wrapper starts every replica from rank 0's weights; they drift apart through their
    # own gradients and the gossip pulls them back together.
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    algorithm = rumor.algorithms.Decentralized(peer_selection="exp2", communication_interval=args.interval,
                                               hierarchical=False)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=algorithm)

    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch_size, 16, generator=data_gen)
        with torch.no_grad():
            y = teacher(x)
        opt.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            spread = (rumor.allreduce(flat, op=rumor.ReduceOp.MAX) - rumor.allreduce(flat, op=rumor.ReduceOp.MIN)).max()
            mean = rumor.allreduce(loss.detach().reshape(1), op=rumor.ReduceOp.SUM) / world
            if rank == 0:
                print(f"step {step} loss {mean.item():.4f} spread {spread.item():.2e}", flush=True)
    rumor.shutdown()


if __name__ == "__main__":
    main()
