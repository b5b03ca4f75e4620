"""MNIST-style training with Bagua's API (model.with_bagua), on synthetic 28x28 data. Written
as a Bagua user would; runs on rumor with the one changed import:

    torchrun --nproc-per-node 4 examples/compat/bagua_mnist.py --algorithm gradient_allreduce
"""
import argparse

import torch
import torch.nn.functional as F

import rumor.compat.bagua as bagua  # was: import bagua.torch_api as bagua


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(784, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def synthetic_batch(step, rank, batch=32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(batch, 1, 28, 28, generator=g)
    return x, x.flatten(1)[:, :10].argmax(1)


def make_algorithm(name, optimizer):
    from rumor.compat.bagua.algorithms import bytegrad, decentralized, gradient_allreduce, q_adam

    if name == "gradient_allreduce":
        return gradient_allreduce.GradientAllReduceAlgorithm()
    if name == "bytegrad":
        return bytegrad.ByteGradAlgorithm()
    if name == "decentralized":
        return decentralized.DecentralizedAlgorithm()
    if name == "low_precision_decentralized":
        return decentralized.LowPrecisionDecentralizedAlgorithm()
    if name == "qadam":
        return q_adam.QAdamAlgorithm(optimizer)
    raise ValueError(name)


def main(algorithm="gradient_allreduce", steps=20, lr=0.05):
    bagua.init_process_group()
    torch.manual_seed(0)
    model = Net()
    if algorithm == "qadam":
        from rumor.compat.bagua.algorithms import q_adam

        optimizer = q_adam.QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=5)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model = model.with_bagua([optimizer], make_algorithm(algorithm, optimizer))
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(step, bagua.get_rank())
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--algorithm", default="gradient_allreduce")
    p.add_argument("--steps", type=int, default=100)
    a = p.parse_args()
    losses, _ = main(a.algorithm, a.steps)
    if bagua.get_rank() == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
