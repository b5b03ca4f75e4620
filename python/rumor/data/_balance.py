"""The balancing under the load-balanced samplers (rumor.data.sampler): dividing items of known
cost among ranks so every rank's total is close, and the argument checks the samplers share.
Pure NumPy: no process group, no torch."""
from __future__ import annotations

import numbers
import operator
from typing import List, Optional, Sequence, Tuple

import numpy as np


def _int(value, name: str, what: str, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what}: {name} must be an int, got {type(value).__name__}")
    v = operator.index(value)
    if minimum is not None and v < minimum:
        raise ValueError(f"{what}: {name} must be >= {minimum}, got {v}")
    return v


def _bool(value, name: str, what: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what}: {name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _as_costs(values, n: int, source: str, what: str) -> np.ndarray:
    try:
        a = np.array(values, dtype=np.float64)  # a copy: the sampler's costs are made read-only
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: {source} must be a sequence of numbers ({e})") from None
    if a.ndim != 1:
        raise ValueError(f"{what}: {source} must be one-dimensional (one cost per sample), got shape {a.shape}")
    if len(a) != n:
        raise ValueError(f"{what}: {source} has {len(a)} entries but the dataset has {n} samples")
    bad = np.flatnonzero(~np.isfinite(a) | (a < 0))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{what}: {source} must be finite and >= 0; sample {i} has cost {float(a[i])!r}"
                         f" ({len(bad)} bad value(s) in all)")
    return a


def _partition_groups(items: np.ndarray, costs: np.ndarray, keys: np.ndarray, world: int
                      ) -> Tuple[np.ndarray, np.ndarray]:
    """items, costs, keys: (groups, m) with m a multiple of world. Splits every group into `world`
    parts of m/world items each with near-equal cost sums; returns (parts (groups, m/world, world):
    item of round j in part p, loads (groups, world)).

    Balanced LPT in rounds: items in descending key order, `world` at a time, the heaviest of a
    round to the currently lightest part. Chosen over Karmarkar-Karp because every rank's batch
    must hold exactly batch_size samples, which LPT in rounds keeps by construction (KK needs its
    balanced variant for that), it is vectorised over all groups of an epoch at once, and with
    keys == costs the spread of a step's part sums never exceeds the step's largest cost (pairing
    ascending loads with descending items cannot widen the spread beyond max(old spread, item)).
    """
    g, m = items.shape
    rounds = m // world
    srt = np.argsort(-keys, axis=1, kind="stable")
    items = np.take_along_axis(items, srt, axis=1).reshape(g, rounds, world)
    costs = np.take_along_axis(costs, srt, axis=1).reshape(g, rounds, world)
    parts = np.empty((g, rounds, world), dtype=items.dtype)
    loads = np.zeros((g, world), dtype=np.float64)
    for j in range(rounds):
        lightest = np.argsort(loads, axis=1, kind="stable")
        np.put_along_axis(parts[:, j, :], lightest, items[:, j, :], axis=1)
        added = np.empty((g, world), dtype=np.float64)
        np.put_along_axis(added, lightest, costs[:, j, :], axis=1)
        loads += added
    return parts, loads


class _RankAssigner:
    """Gives each step's shares to ranks: the heaviest share to the rank with the least cost so
    far this epoch, ties in a per-epoch random order of ranks."""

    def __init__(self, world: int, rng: np.random.Generator):
        self.world = world
        self.cumulative = [0.0] * world
        self.tiebreak = rng.permutation(world).tolist()

    def assign(self, loads: Sequence[float]) -> List[int]:
        """loads: one per share; returns the share each rank gets."""
        cum, tb = self.cumulative, self.tiebreak
        ranks = sorted(range(self.world), key=lambda r: (cum[r], tb[r]))
        shares = sorted(range(self.world), key=lambda p: -loads[p])
        share_of = [0] * self.world
        for p, r in zip(shares, ranks):
            share_of[r] = p
            cum[r] += loads[p]
        return share_of


def _noisy_keys(c: np.ndarray, random_level: float, rng: np.random.Generator) -> np.ndarray:
    """The costs used to order work: the true costs plus, with random_level > 0, uniform noise up
    to random_level times the epoch's cost range (1: ordering mostly random)."""
    if random_level == 0 or len(c) == 0:
        return c
    spread = float(c.max() - c.min())
    return c + random_level * spread * rng.random(len(c))
