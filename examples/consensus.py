#!/usr/bin/env python
"""BlueFog's average consensus two ways: neighbor_allreduce over a static graph, and push-sum
over one-sided windows.

    python -m rumor.run --nproc-per-node 4 examples/consensus.py
    python -m rumor.run --nproc-per-node 8 examples/consensus.py --iterations 30

Every rank holds a vector; the goal is for every rank to hold the mean of all of them, each
rank only ever talking to its neighbours in the graph (here the exponential graph: rank i sends
to i + 1, i + 2, i + 4, ...).

1. neighbor_allreduce: x <- (x + sum of the in-neighbours' x) / (in_degree + 1). The graph is
   regular, so the weights are doubly stochastic and x converges to the mean.
2. push-sum: every rank keeps a pair (x, p), p starting at 1, and pushes shares of both to its
   out-neighbours with win_accumulate (one-sided: the receiver does nothing until it collects).
   The sums of x and of p over all ranks never change, so x / p converges to the mean for any
   column-stochastic weights, also where the in-degrees differ.

Rank 0 prints, per iteration, the largest distance of any rank's estimate to the true mean.
"""
from __future__ import annotations

import argparse

import torch

import rumor
from rumor import topology


def distance(estimate: torch.Tensor, mean: torch.Tensor) -> float:
    """The largest |estimate - mean| over the elements and the ranks."""
    return rumor.allreduce((estimate - mean).abs().max().reshape(1), op=rumor.ReduceOp.MAX).item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--iterations", "--steps", type=int, default=20)
    ap.add_argument("--size", type=int, default=1000, help="elements per rank")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rumor.init()
    rank, world = rumor.rank(), rumor.size()
    rumor.set_topology(topology.ExponentialGraph(world))
    out = rumor.out_neighbor_ranks()
    start = torch.randn(args.size, dtype=torch.float64, generator=torch.Generator().manual_seed(args.seed + rank))
    mean = rumor.allreduce(start, op=rumor.ReduceOp.SUM) / world  # only to measure the distance

    x = start.clone()
    d = distance(x, mean)
    if rank == 0:
        print(f"start distance {d:.3e}", flush=True)
    for it in range(1, args.iterations + 1):
        x = rumor.neighbor_allreduce(x)
        d = distance(x, mean)
        if rank == 0:
            print(f"neighbor_allreduce step {it} distance {d:.3e}", flush=True)

    rumor.turn_on_win_ops_with_associated_p()
    x = start.clone()
    rumor.win_create(x, "pushsum", zero_init=True)  # the slots collect what neighbours push
    share = 1.0 / (len(out) + 1)
    for it in range(1, args.iterations + 1):
        # Keep one share of (x, p), add one share into each out-neighbour's slot.
        rumor.win_accumulate(x, "pushsum", self_weight=share, dst_weights={r: share for r in out})
        rumor.barrier()  # every push of this round has landed (not needed for convergence, only to print it)
        rumor.win_update_then_collect("pushsum")  # (x, p) += what arrived; the slots are emptied
        d = distance(x / rumor.win_associated_p("pushsum"), mean)
        if rank == 0:
            print(f"push-sum step {it} distance {d:.3e}", flush=True)
        rumor.barrier()  # nobody pushes the next round into a slot before its owner emptied it
    rumor.win_free("pushsum")
    rumor.turn_off_win_ops_with_associated_p()
    rumor.shutdown()


if __name__ == "__main__":
    main()
