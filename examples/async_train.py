"""Asynchronous training with a straggler: AsyncModelAverage (all or gossip) or push-sum.

    python -m rumor.run --nproc-per-node 4 examples/async_train.py --mode exp2 --slow-rank 3

Every rank trains the same small regression model on its own data; the last rank (or
--slow-rank) sleeps after each step. With AsyncModelAverage nobody waits for it: a background
thread averages the weights every --interval-ms (over all ranks, or by gossip with one peer over
one-sided windows), and finish() ends with the same weights on every rank. With --mode pushsum
the optimizer is rumor.optim.DistributedPushSumOptimizer (one-sided accumulates every step).
Prints each rank's step count and the final evaluation loss.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import rumor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="all", choices=("all", "ring", "shift_one", "exp2", "pushsum"))
    ap.add_argument("--seconds", type=float, default=3.0, help="training time per rank")
    ap.add_argument("--slow-rank", type=int, default=-1, help="rank that sleeps --slow-ms per step (-1: the last)")
    ap.add_argument("--slow-ms", type=float, default=20.0)
    ap.add_argument("--interval-ms", type=float, default=50.0)
    ap.add_argument("--lr", type=float, default=0.02)
    args = ap.parse_args()

    torch.set_num_threads(1)
    rumor.init()
    rank, n = rumor.rank(), rumor.size()
    slow = (args.slow_rank % n) == rank
    torch.manual_seed(0)
    w_true = torch.randn(32, 1)
    x_eval = torch.randn(512, 32)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    if args.mode == "pushsum":
        opt = rumor.optim.DistributedPushSumOptimizer(opt, model)
        net, alg = model, None
    else:
        alg = rumor.algorithms.AsyncModelAverage(args.mode, sync_interval_ms=args.interval_ms, warmup_steps=5)
        net = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=alg)

    gen = torch.Generator().manual_seed(1000 + rank)
    steps = 0
    end = time.monotonic() + args.seconds
    while time.monotonic() < end or steps < 10:  # at least the warm-up on every rank
        x = torch.randn(32, 32, generator=gen)
        opt.zero_grad()
        F.mse_loss(net(x), x @ w_true).backward()
        opt.step()
        steps += 1
        if slow:
            time.sleep(args.slow_ms / 1e3)

    if alg is not None:
        alg.finish()  # every rank: waits for the others, then the same weights everywhere
    else:
        opt.wait()  # this rank's pushes have landed; after the barrier, everyone's have
        rumor.barrier()
        opt.synchronize()
        opt.free_windows()
    with torch.no_grad():
        loss = float(F.mse_loss(model(x_eval), x_eval @ w_true))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = float((rumor.allreduce(flat, op=rumor.ReduceOp.MAX) - rumor.allreduce(flat, op=rumor.ReduceOp.MIN)).max())
    print(f"rank {rank}{' (slow)' if slow else ''}: {steps} steps, eval loss {loss:.4f}, "
          f"replica spread {spread:.2e}", flush=True)
    rumor.shutdown()


if __name__ == "__main__":
    main()
