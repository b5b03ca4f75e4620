"""Average consensus, written as a BlueFog user would write it (bluefog.torch API).

Run on rumor with the one changed import below (or keep ``import bluefog.torch as bf`` after
``rumor.compat.enable_aliases()``):

    torchrun --nproc-per-node 4 examples/compat/bluefog_consensus.py --topology star --weighted
"""
import argparse

import torch

import rumor.compat.bluefog as bf  # was: import bluefog.torch as bf


def main(topology="star", weighted=True, iterations=200, size=16, seed=0):
    bf.init()
    n = bf.size()
    graphs = {"star": bf.StarGraph, "mesh": bf.MeshGrid2DGraph, "ring": bf.RingGraph,
              "expo2": bf.ExponentialTwoGraph, "full": bf.FullyConnectedGraph}
    bf.set_topology(graphs[topology](n), is_weighted=weighted)
    g = torch.Generator().manual_seed(seed + bf.rank())
    x = torch.randn(size, dtype=torch.float64, generator=g)
    mean = bf.allreduce(x, average=True)
    errors = []
    for _ in range(iterations):
        x = bf.neighbor_allreduce(x)
        errors.append(float((x - mean).norm() / mean.norm()))
    return x, errors


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--topology", default="star")
    p.add_argument("--weighted", action="store_true")
    p.add_argument("--iterations", type=int, default=200)
    a = p.parse_args()
    x, errors = main(a.topology, a.weighted, a.iterations)
    if bf.rank() == 0:
        print(f"relative error after {a.iterations} iterations: {errors[-1]:.3e}")
