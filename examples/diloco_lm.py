#!/usr/bin/env python
"""A small transformer language model trained with DiLoCo, or Streaming DiLoCo (--streaming).

    python -m rumor.run --nproc-per-node 4 examples/diloco_lm.py
    python -m rumor.run --nproc-per-node 4 examples/diloco_lm.py --streaming --inner-steps 16

DiLoCo: every rank takes --inner-steps AdamW steps on its own data with no communication at
all, then the ranks average how far they moved (the pseudo-gradient) and an outer optimizer
(SGD with Nesterov momentum) applies it to the shared weights. Streaming DiLoCo splits the model
into fragments that are averaged at different inner steps, int8 on the wire, so the traffic is
spread over the round and overlaps the local steps (docs/local_sgd.md).

The model: a 2-layer causal transformer (d=64) on synthetic text in which every token is
followed by a fixed successor (a random permutation of the vocabulary), with some noise tokens:
a next-token rule the model learns within a few dozen steps. Rank 0 prints the loss averaged
over the ranks.
"""
from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

import rumor


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, d: int = 64, layers: int = 2, heads: int = 4, context: int = 32):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(context, d))
        block = torch.nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.tok(tokens) + self.pos[:t]
        return self.head(self.blocks(h, mask=self.causal[:t, :t], is_causal=True))


def make_batch(successor: torch.Tensor, batch: int, length: int, noise: float, g: torch.Generator) -> torch.Tensor:
    """Sequences that follow ``successor`` from a random start, a fraction ``noise`` of the
    tokens replaced by random ones (and the chain going on from them)."""
    vocab = successor.numel()
    seq = torch.empty(batch, length + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(vocab, (batch,), generator=g)
    for i in range(1, length + 1):
        nxt = successor[seq[:, i - 1]]
        flip = torch.rand(batch, generator=g) < noise
        seq[:, i] = torch.where(flip, torch.randint(vocab, (batch,), generator=g), nxt)
    return seq


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--streaming", action="store_true", help="StreamingDiLoCo instead of DiLoCo")
    ap.add_argument("--steps", type=int, default=200, help="inner (local) steps")
    ap.add_argument("--inner-steps", type=int, default=8, help="local steps per outer round")
    ap.add_argument("--fragments", type=int, default=2, help="StreamingDiLoCo's fragments")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per rank")
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3, help="the inner AdamW's")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--log-every", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rumor.init()
    rank, world = rumor.rank(), rumor.size()
    torch.manual_seed(args.seed)
    successor = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(args.seed))
    data_gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own text

    model = TinyLM(args.vocab, context=args.context)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    outer = functools.partial(torch.optim.SGD, lr=args.outer_lr, momentum=0.9, nesterov=True)
    if args.streaming:
        algorithm = rumor.algorithms.StreamingDiLoCo(inner_steps=args.inner_steps, outer_optimizer=outer,
                                                     num_fragments=args.fragments)
    else:
        algorithm = rumor.algorithms.DiLoCo(inner_steps=args.inner_steps, outer_optimizer=outer)
    # DiLoCo acts in optimizer.step(): the wrapper needs the (inner) optimizer.
    ddp = rumor.DistributedDataParallel(model, optimizer=inner, algorithm=algorithm)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{type(algorithm).__name__}: {params / 1e3:.0f}k parameters, {world} ranks, "
              f"{args.inner_steps} inner steps per round", flush=True)

    for step in range(1, args.steps + 1):
        seq = make_batch(successor, args.batch_size, args.context, 0.1, data_gen)
        inner.zero_grad()
        logits = ddp(seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), seq[:, 1:].reshape(-1))
        loss.backward()
        inner.step()  # every inner_steps-th step also averages (DiLoCo) or a fragment's turn (streaming)
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            mean = rumor.allreduce(loss.detach().reshape(1), op=rumor.ReduceOp.SUM) / world
            if rank == 0:
                print(f"step {step} loss {mean.item():.4f}", flush=True)
    rumor.shutdown()


if __name__ == "__main__":
    main()
