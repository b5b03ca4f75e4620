"""Bagua's synthetic benchmark pattern (images/s of a model on random data), written as a Bagua
user would; runs on rumor with the one changed import:

    torchrun --nproc-per-node 4 examples/compat/bagua_synthetic_benchmark.py --algorithm bytegrad
"""
import argparse
import time

import torch
import torch.nn.functional as F

import rumor.compat.bagua as bagua  # was: import bagua.torch_api as bagua
from rumor.compat.bagua.algorithms import GlobalAlgorithmRegistry  # was: from bagua.torch_api.algorithms import ...


def model_fn():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
                               torch.nn.Flatten(), torch.nn.Linear(128, 10))


def main(algorithm="gradient_allreduce", batch_size=16, warmup=2, iters=5, seed=0):
    bagua.init_process_group()
    torch.manual_seed(seed)
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model = model.with_bagua([optimizer], GlobalAlgorithmRegistry.get(algorithm)())
    data = torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(seed + bagua.get_rank()))
    target = torch.arange(batch_size) % 10

    def step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    rate = batch_size * iters / (time.perf_counter() - t0)
    return rate, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--algorithm", default="gradient_allreduce")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    rate, _ = main(a.algorithm, iters=a.iters)
    if bagua.get_rank() == 0:
        print(f"{a.algorithm}: {rate:.1f} img/s per rank, {rate * bagua.get_world_size():.1f} total")
