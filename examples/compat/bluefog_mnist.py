"""MNIST-style training with BlueFog's optimizer wrappers, on synthetic 28x28 data (no
download). Written as a BlueFog user would; runs on rumor with the one changed import:

    torchrun --nproc-per-node 4 examples/compat/bluefog_mnist.py --optimizer awc
"""
import argparse

import torch
import torch.nn.functional as F

import rumor.compat.bluefog as bf  # was: import bluefog.torch as bf


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
    y = (x.flatten(1)[:, :10].argmax(1))  # a learnable rule
    return x, y


def main(optimizer="awc", steps=20, lr=0.05, passes_per_step=1):
    bf.init()
    bf.set_topology(bf.ExponentialTwoGraph(bf.size()))
    torch.manual_seed(0)
    model = Net()
    bf.broadcast_parameters(model.state_dict(), root_rank=0)
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if optimizer == "awc":
        opt = bf.DistributedAdaptWithCombineOptimizer(base, model=model,
                                                      communication_type=bf.CommunicationType.neighbor_allreduce,
                                                      num_steps_per_communication=passes_per_step)
    elif optimizer == "atc":
        opt = bf.DistributedAdaptThenCombineOptimizer(base, model=model,
                                                      communication_type=bf.CommunicationType.neighbor_allreduce,
                                                      num_steps_per_communication=passes_per_step)
    elif optimizer == "gradient_allreduce":
        opt = bf.DistributedGradientAllreduceOptimizer(base, model=model,
                                                       num_steps_per_communication=passes_per_step)
    else:
        raise ValueError(optimizer)
    bf.broadcast_optimizer_state(opt, root_rank=0)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        for j in range(passes_per_step):
            x, y = synthetic_batch(step * passes_per_step + j, bf.rank())
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="awc", choices=["awc", "atc", "gradient_allreduce"])
    p.add_argument("--steps", type=int, default=100)
    a = p.parse_args()
    losses, _ = main(a.optimizer, a.steps)
    if bf.rank() == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
