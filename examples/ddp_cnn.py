#!/usr/bin/env python
"""A torch DDP training script ported to rumor: a small CNN on CIFAR-shaped data.

    python -m rumor.run --nproc-per-node 4 examples/ddp_cnn.py
    python -m rumor.run --nproc-per-node 4 examples/ddp_cnn.py --algorithm powersgd
    python -m rumor.run --nproc-per-node 2 examples/ddp_cnn.py --device cuda      # one GPU per rank

What changes from a torch DDP script is marked "rumor:" below: rumor.init() instead of
torch.distributed.init_process_group, rumor.rank()/size() for the sampler, and
rumor.DistributedDataParallel(model, optimizer=..., algorithm=...) instead of
torch.nn.parallel.DistributedDataParallel(model). The data loading (Dataset, DistributedSampler,
DataLoader), the loss and the optimizer loop are the torch ones, unchanged.

--algorithm picks how the replicas communicate (see ALGORITHMS). The dataset is synthetic (no
download): 3x32x32 images whose class sets the mean of each channel plus noise, so a few steps
already lower the loss. Rank 0 prints the loss averaged over the ranks every --log-every steps.
"""
from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import rumor


ALGORITHMS = (
    "gradient_allreduce", "bytegrad", "qsgd", "low_precision", "onebit_adam", "decentralized",
    "low_precision_decentralized", "async", "powersgd", "local_sgd", "diloco", "streaming_diloco",
)


class SyntheticCIFAR(Dataset):
    """CIFAR-10-shaped images: every class has its own per-channel, per-quadrant mean, and the
    pixels are that mean plus Gaussian noise. Fixed by the seed, the same on every rank."""

    def __init__(self, size: int = 2048, classes: int = 10, noise: float = 1.0, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(classes, (size,), generator=g)
        means = torch.randn(classes, 3, 2, 2, generator=g)
        # Blow each class's 2x2 pattern up to 32x32: a coarse picture a conv net picks up fast.
        pattern = means.repeat_interleave(16, dim=2).repeat_interleave(16, dim=3)
        self.images = pattern[self.labels] + noise * torch.randn(size, 3, 32, 32, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def small_cnn(classes: int = 10) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 64), torch.nn.ReLU(), torch.nn.Linear(64, classes),
    )


def make_algorithm(name: str, optimizer, args):
    """The rumor algorithm called ``name``, with settings that suit a run of a few dozen steps."""
    A = rumor.algorithms
    if name == "gradient_allreduce":
        return A.GradientAllReduce()
    if name == "bytegrad":
        return A.ByteGrad()
    if name == "qsgd":
        return A.QSGD()
    if name == "low_precision":
        return A.LowPrecision(dtype=torch.float16)
    if name == "onebit_adam":
        # Full-precision Adam for the warm-up steps, then 1-bit compressed momentum.
        return A.OneBitAdamAlgorithm(optimizer)
    if name == "decentralized":
        return A.Decentralized(peer_selection="exp2")
    if name == "low_precision_decentralized":
        return A.LowPrecisionDecentralized()
    if name == "async":
        return A.AsyncModelAverage("all", sync_interval_ms=20, warmup_steps=2)
    if name == "powersgd":
        return A.PowerSGD(matrix_approximation_rank=2, start_powerSGD_iter=args.warmup)
    if name == "local_sgd":
        return A.LocalSGD(sync_every=args.sync_every, warmup_steps=args.warmup)
    outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    if name == "diloco":
        return A.DiLoCo(inner_steps=args.sync_every, outer_optimizer=outer)
    if name == "streaming_diloco":
        return A.StreamingDiLoCo(inner_steps=args.sync_every, outer_optimizer=outer, num_fragments=2)
    raise ValueError(f"--algorithm: unknown {name!r}; expected one of {', '.join(ALGORITHMS)}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--algorithm", default="gradient_allreduce", choices=ALGORITHMS)
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--sync-every", type=int, default=4, help="local steps between averages (local_sgd, diloco)")
    ap.add_argument("--warmup", type=int, default=4, help="uncompressed steps first (powersgd, local_sgd)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    rumor.init()  # rumor: instead of torch.distributed.init_process_group
    rank, world = rumor.rank(), rumor.size()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no GPU")
        torch.cuda.set_device(rumor.local_rank() % torch.cuda.device_count())
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")

    dataset = SyntheticCIFAR(seed=args.seed)
    # rumor: the sampler takes the world from rumor (torch.distributed need not be initialized).
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        drop_last=True, pin_memory=args.device == "cuda")

    torch.manual_seed(args.seed)
    model = small_cnn().to(device)
    if args.algorithm == "onebit_adam":
        # 1-bit Adam freezes Adam's variance after the warm-up: a weight whose gradient was ~0 until
        # then (a unit that had not fired yet) would later step by g / eps. With this short warm-up
        # a larger eps than Adam's 1e-8 bounds that; long runs use freeze_step ~ 15-25% of training.
        optimizer = rumor.optim.OneBitAdamOptimizer(model.parameters(), lr=args.lr / 10, eps=1e-3,
                                                    freeze_step=args.warmup)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    algorithm = make_algorithm(args.algorithm, optimizer, args)
    # rumor: the wrapper takes the optimizer (the algorithms that act at step() need it) and the
    # algorithm; it broadcasts rank 0's weights, so every replica starts the same.
    ddp = rumor.DistributedDataParallel(model, optimizer=optimizer, algorithm=algorithm)
    if rank == 0:
        print(f"{args.algorithm} on {world} ranks ({device.type}), batch {args.batch_size} per rank", flush=True)

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(images), labels)
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.log_every == 0 or step == 1 or step == args.steps:
                mean = rumor.allreduce(loss.detach().reshape(1).cpu(), op=rumor.ReduceOp.SUM) / world
                if rank == 0:
                    print(f"step {step} loss {mean.item():.4f}", flush=True)
            if step == args.steps:
                break
        epoch += 1

    if args.algorithm == "async":
        algorithm.finish()  # waits for the other ranks, then every replica holds the same weights
    rumor.shutdown()


if __name__ == "__main__":
    main()
