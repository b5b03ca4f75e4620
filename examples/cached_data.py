#!/usr/bin/env python
"""A dataset whose samples are expensive to make, cached across ranks (rumor.data.CachedDataset),
read in batches balanced by cost (rumor.data.LoadBalancingDistributedSampler).

    python -m rumor.run --nproc-per-node 4 examples/cached_data.py
    python -m rumor.run --nproc-per-node 4 examples/cached_data.py --backend local

The samples are token sequences of very different lengths (8 to 128 tokens) whose preprocessing
costs time (simulated by --prep-ms per sample). CachedDataset keeps each preprocessed sample in a
cache shared by every rank of the host: redis (a redis-server rumor starts and stops itself;
install redis-server and redis-py) or 'local' (shared memory). From the second epoch on, no
sample is preprocessed again, whichever rank reads it.

With plain DistributedSampler each rank gets the same number of samples, but not the same number
of tokens: in a step the rank with the long sequences is the slowest, and everyone waits for it.
LoadBalancingDistributedSampler gives each rank samples of about equal total cost (here: their
lengths). Rank 0 prints per epoch the loss averaged over the ranks, how many tokens the busiest
and the least busy rank processed, and the time the epoch took.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import rumor
import rumor.data


class Sequences(Dataset):
    """Sample i: a token sequence whose tokens favour the band of its class, and the class.
    Deterministic in i, so that a cached copy and a fresh one are the same."""

    def __init__(self, size: int, vocab: int, classes: int, prep_ms: float, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(8, 129, (size,), generator=g).tolist()
        self.labels = torch.randint(classes, (size,), generator=g).tolist()
        self.vocab, self.classes, self.prep_s, self.seed = vocab, classes, prep_ms / 1e3, seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        time.sleep(self.prep_s)  # stands for decoding, tokenizing, augmenting...
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        band = self.vocab // self.classes
        label = self.labels[i]
        n = self.lengths[i]
        tokens = torch.randint(self.vocab, (n,), generator=g)
        in_band = torch.rand(n, generator=g) < 0.5
        tokens = torch.where(in_band, label * band + tokens % band, tokens)
        return tokens, label


def collate(batch):
    """Flat tokens + offsets for EmbeddingBag (no padding needed)."""
    tokens = [t for t, _ in batch]
    offsets = torch.tensor([0] + [len(t) for t in tokens[:-1]]).cumsum(0)
    return torch.cat(tokens), offsets, torch.tensor([y for _, y in batch])


class BagClassifier(torch.nn.Module):
    def __init__(self, vocab: int, classes: int, d: int = 32):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(vocab, d, mode="mean")
        self.head = torch.nn.Linear(d, classes)

    def forward(self, tokens, offsets):
        return self.head(self.bag(tokens, offsets))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps in all (default: no limit)")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16, help="samples per rank and step")
    ap.add_argument("--backend", default="redis", choices=("redis", "local"))
    ap.add_argument("--prep-ms", type=float, default=2.0, help="simulated preprocessing per sample")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rumor.init()
    rank, world = rumor.rank(), rumor.size()
    vocab, classes = 256, 4
    raw = Sequences(args.samples, vocab, classes, args.prep_ms, args.seed)
    # The name keys the cache: another job with the same name (and job secret) reuses it.
    dataset = rumor.data.CachedDataset(raw, backend=args.backend, dataset_name=f"examples-cached-data-{args.seed}")
    sampler = rumor.data.LoadBalancingDistributedSampler(dataset, costs=raw.lengths, batch_size=args.batch_size,
                                                         seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, collate_fn=collate)

    torch.manual_seed(args.seed)
    model = BagClassifier(vocab, classes)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        tokens_seen, losses = 0, []
        for tokens, offsets, labels in loader:
            opt.zero_grad()
            loss = F.cross_entropy(ddp(tokens, offsets), labels)
            loss.backward()
            opt.step()
            tokens_seen += tokens.numel()
            losses.append(loss.item())
            step += 1
            if args.steps is not None and step >= args.steps:
                break
        dataset.on_epoch_end()  # flushes this rank's pending cache writes
        elapsed = time.perf_counter() - t0
        stats = torch.tensor([sum(losses) / max(1, len(losses)), tokens_seen, -tokens_seen, elapsed],
                             dtype=torch.float64)
        mean_loss = rumor.allreduce(stats[:1], op=rumor.ReduceOp.SUM) / world
        most, least, slowest = rumor.allreduce(stats[1:], op=rumor.ReduceOp.MAX).tolist()
        if rank == 0:
            print(f"epoch {epoch} loss {mean_loss.item():.4f}  tokens per rank {-least:.0f}..{most:.0f}  "
                  f"{slowest:.2f} s  cached samples {dataset.num_keys()}", flush=True)
        if args.steps is not None and step >= args.steps:
            break
    dataset.close()
    rumor.shutdown()


if __name__ == "__main__":
    main()
