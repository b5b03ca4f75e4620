#!/usr/bin/env python
"""Elastic training: commits with rumor.elastic.State, and a restart that continues from the
last commit instead of from scratch.

    python -m rumor.run --nproc-per-node 4 --max-restarts 3 examples/elastic.py
    python -m rumor.run --nproc-per-node 2 --max-restarts 1 examples/elastic.py --crash-at-step 12

When a worker dies, torchrun's agent (under rumor.run) stops every worker and starts them again.
rumor.elastic.run then finds the newest commit still in memory on some host, loads the model,
the optimizer, the sampler's position and the step counter from it on every rank, and calls
train() again, which goes on from that step. --crash-at-step N makes the last rank exit
abruptly at step N on the first attempt (only then), to show it: the output has "resumed at
step C" with C the last commit before N. Rank 0 prints the loss averaged over the ranks.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import rumor


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16, help="per rank")
    ap.add_argument("--commit-every", type=int, default=5)
    ap.add_argument("--crash-at-step", type=int, default=0, help="0: never")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rumor.init()
    rank, world = rumor.rank(), rumor.size()
    g = torch.Generator().manual_seed(args.seed)
    inputs = torch.randn(1024, 8, generator=g)
    targets = inputs @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(1024, 1, generator=g)
    dataset = TensorDataset(inputs, targets)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt)
    # What a restart must get back: the weights, the optimizer, where the sampler was, the step.
    state = rumor.elastic.State(ddp, opt, sampler, epoch=0)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    @rumor.elastic.run
    def train(state):
        if state.restored_step is not None and rank == 0:
            print(f"resumed at step {state.restored_step} (commit from rank {state.restored_from})", flush=True)
        while state.step < args.steps:
            state.epoch, i = divmod(state.step, len(loader))
            sampler.set_epoch(state.epoch)
            # Batch i of this epoch: the loader is re-entered at the right place after a restart.
            for j, (x, y) in enumerate(loader):
                if j < i:
                    continue
                opt.zero_grad()
                loss = F.mse_loss(ddp(x), y)
                loss.backward()
                opt.step()
                state.step += 1
                if state.step % args.log_every == 0 or state.step == 1:
                    mean = rumor.allreduce(loss.detach().reshape(1), op=rumor.ReduceOp.SUM) / world
                    if rank == 0:
                        print(f"step {state.step} loss {mean.item():.4f}", flush=True)
                if state.step % args.commit_every == 0:
                    state.commit()
                if first_attempt and state.step == args.crash_at_step and rank == world - 1:
                    print(f"rank {rank}: exiting at step {state.step} to show a restart", flush=True)
                    os._exit(1)
                if state.step >= args.steps:
                    break

    train(state)
    rumor.shutdown()


if __name__ == "__main__":
    main()
