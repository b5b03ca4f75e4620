"""The standard models of BENCHMARKS.md, with their synthetic data, in one place.

Used by benchmarks/vs_ddp.py, benchmarks/training.py and tests/python/test_ddp.py, so that every
figure and every test talks about the same networks:

    mlp25m       Linear 1024->4096, ReLU, Linear 4096->4096, ReLU, Linear 4096->1024;
                 cross-entropy over 1024 classes (~25.2M parameters), per-rank batch 32
    cnn          a small ResNet-style network for 3x32x32 images (BatchNorm, ~1.2M parameters),
                 10 classes, per-rank batch 32
    transformer  4 encoder layers, d_model 256, 4 heads, feed-forward 1024, sequence 128,
                 vocabulary 8192, token classification into 32 classes (~5.3M parameters),
                 per-rank batch 16

    from rumor.testing import models
    model = models.build("mlp25m", seed=0)                 # same weights for the same seed
    x, y = models.batch("mlp25m", 32, step=3, shard=rank)  # same data for the same (step, shard)
    loss = models.loss(model(x), y)

Every model can be built smaller (``scale``) for tests, keeping its structure. There is no
dropout anywhere, so two copies trained on the same data stay comparable step by step.
Synthetic data is generated in-process from fixed seeds (no downloads); a batch depends only on
(name, batch size, step, shard, seed), so rank r's shard of step s is the same in every
framework, and the concatenation of all shards is the global batch of a single-process run.
"""
from __future__ import annotations

import zlib
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

NAMES = ("mlp25m", "cnn", "transformer")
BATCH: Dict[str, int] = {"mlp25m": 32, "cnn": 32, "transformer": 16}
"""Per-rank batch size of each standard model (BENCHMARKS.md)."""


# ---- models ----------------------------------------------------------------------------------------

class MLP(nn.Module):
    """Linear(d_in, hidden), ReLU, Linear(hidden, hidden), ReLU, Linear(hidden, classes)."""

    def __init__(self, d_in: int = 1024, hidden: int = 4096, classes: int = 1024):
        super().__init__()
        self.d_in, self.classes = d_in, classes
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class BasicBlock(nn.Module):
    """ResNet basic block: conv3x3-BN-ReLU-conv3x3-BN plus a (projected) shortcut, ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.short = None
        if stride != 1 or c_in != c_out:
            self.short = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.short is None else self.short(x)))


class ResNetSmall(nn.Module):
    """Stem conv3x3 (3->w), four basic blocks of widths w, 2w, 4w, 8w (strides 1, 2, 2, 2),
    global average pooling, Linear(8w, classes). w=32: ~1.2M parameters."""

    def __init__(self, width: int = 32, classes: int = 10, image: int = 32):
        super().__init__()
        self.image, self.classes = image, classes
        w = width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(w, w, 1), BasicBlock(w, 2 * w, 2), BasicBlock(2 * w, 4 * w, 2),
                                    BasicBlock(4 * w, 8 * w, 2))
        self.fc = nn.Linear(8 * w, classes)

    def forward(self, x):
        y = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


class TokenClassifier(nn.Module):
    """Token and position embeddings, a TransformerEncoder (post-norm, ReLU, no dropout) and a
    linear head per token."""

    def __init__(self, vocab: int = 8192, d_model: int = 256, heads: int = 4, ff: int = 1024, layers: int = 4,
                 seq: int = 128, classes: int = 32):
        super().__init__()
        self.vocab, self.seq, self.classes = vocab, seq, classes
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok(tokens) + self.pos(pos)[None]
        return self.head(self.norm(self.encoder(h)))


def build(name: str, seed: int = 0, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A standard model with weights drawn from torch.manual_seed(seed) (restoring the global RNG
    afterwards). scale < 1 shrinks the widths for tests; scale=1 is the benchmark model."""
    if name not in NAMES:
        raise ValueError(f"unknown model {name!r}; choose from {NAMES}")
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        if name == "mlp25m":
            m = MLP(max(4, int(1024 * scale)), max(4, int(4096 * scale)), max(4, int(1024 * scale)))
        elif name == "cnn":
            m = ResNetSmall(width=max(2, int(32 * scale)), image=32 if scale >= 0.5 else 16)
        else:
            d = max(8, int(256 * scale) // 4 * 4)
            m = TokenClassifier(vocab=max(16, int(8192 * scale)), d_model=d, heads=4, ff=max(8, int(1024 * scale)),
                                layers=4 if scale >= 0.5 else 2, seq=128 if scale >= 0.5 else 16)
    finally:
        torch.random.set_rng_state(state)
    return m.to(dtype)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- data ------------------------------------------------------------------------------------------

def _generator(name: str, batch_size: int, step: int, shard: int, seed: int) -> torch.Generator:
    key = f"{name}|{batch_size}|{step}|{shard}|{seed}".encode()
    return torch.Generator().manual_seed(zlib.crc32(key) + (seed << 32))


def batch(name_or_model, batch_size: int, step: int = 0, shard: int = 0, seed: int = 0,
          dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Synthetic (inputs, targets) for a standard model: a function of its arguments only.

    name_or_model: a model from build() (its sizes and dtype are read from it; torch.compile'd
      models too) or a name (full size).
    dtype: of floating inputs (default: the model's parameter dtype, else float32).
    """
    if isinstance(name_or_model, str):
        model, name = None, name_or_model
    else:
        model = getattr(name_or_model, "_orig_mod", name_or_model)
        name = {MLP: "mlp25m", ResNetSmall: "cnn", TokenClassifier: "transformer"}[type(model)]
    if dtype is None:
        dtype = next(model.parameters()).dtype if model is not None else torch.float32
    g = _generator(name, batch_size, step, shard, seed)
    if name == "mlp25m":
        d_in, classes = (model.d_in, model.classes) if model is not None else (1024, 1024)
        x = torch.randn(batch_size, d_in, generator=g, dtype=torch.float64).to(dtype)
        y = torch.randint(0, classes, (batch_size,), generator=g)
    elif name == "cnn":
        image, classes = (model.image, model.classes) if model is not None else (32, 10)
        x = torch.randn(batch_size, 3, image, image, generator=g, dtype=torch.float64).to(dtype)
        y = torch.randint(0, classes, (batch_size,), generator=g)
    elif name == "transformer":
        vocab, seq, classes = (model.vocab, model.seq, model.classes) if model is not None else (8192, 128, 32)
        x = torch.randint(0, vocab, (batch_size, seq), generator=g)
        y = torch.randint(0, classes, (batch_size, seq), generator=g)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {NAMES}")
    return x, y


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (over samples, and tokens for the transformer)."""
    out = output.reshape(-1, output.shape[-1])
    if out.dtype not in (torch.float32, torch.float64):
        out = out.float()  # bf16 under autocast: the loss itself in fp32
    return F.cross_entropy(out, target.reshape(-1))
