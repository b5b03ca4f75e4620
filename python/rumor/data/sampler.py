"""Load-balanced distributed sampling for samples of different cost (sequence lengths, ...).

In synchronous data-parallel training every step waits for the slowest rank. When samples differ
in cost (a 2000-token sequence next to a 40-token one), a plain DistributedSampler hands each
rank a random set and the step takes as long as the unluckiest rank's share. The samplers here
give each rank, in each global step, a share of near-equal cost:

    LoadBalancingDistributedSampler       one index at a time, for DataLoader(batch_size=B);
                                          pass batch_size=B so each step's num_replicas*B
                                          samples are balanced together
    LoadBalancingDistributedBatchSampler  whole batches under a token budget (max_tokens) or
                                          from your batch_fn, balanced per step

How an epoch is planned (identically on every rank, from (seed, epoch) alone, with no
communication):
  1. a seeded permutation of the dataset (or its order, shuffle=False);
  2. the count made a multiple of num_replicas: drop_last drops randomly chosen samples; otherwise
     the cheapest samples of the epoch's tail are repeated, so the padding adds the least work to
     the last step;
  3. sampler: consecutive groups of num_replicas*batch_size samples (one global step each) are
     partitioned into num_replicas parts of batch_size samples with near-equal cost sums;
     batch sampler: samples sorted by cost are cut into batches, batches of similar cost are
     grouped into steps of num_replicas batches, and the steps are shuffled;
  4. within each step, the heaviest part goes to the rank with the least cost so far this epoch
     (ties broken by a per-epoch random order of ranks), so no rank systematically gets the
     heaviest share and the running totals stay balanced too, whatever batch size the DataLoader
     really uses.

Costs are known once: a `costs` sequence, the dataset's `lengths` attribute, or complexity_fn
evaluated on rank 0 only and broadcast (rumor's collectives if rumor.init() ran, else
torch.distributed's, else computed locally).
"""
from __future__ import annotations

import heapq
import numbers
import operator
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from torch.utils.data import Sampler

from ._balance import _RankAssigner, _as_costs, _bool, _int, _noisy_keys, _partition_groups

__all__ = ["LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler"]

_STATE_VERSION = 1
# Independent random streams of one (seed, epoch): which samples and in what order, the order of
# work within steps, and the batch sampler's own choices.
_ORDER, _PARTITION, _BATCHES = 0, 1, 2
# Re-planning the rest of an epoch after the world size changed (reshard): stream _RESHARD + k
# for the k-th change within the epoch.
_RESHARD = 16


# ---- the process group and the costs (the balancing itself is in _balance.py) ----------------------

def _process_group() -> Tuple[Optional[int], Optional[int], Optional[str]]:
    """(world size, rank, which) of rumor's job if rumor.init() ran, else torch.distributed's."""
    from .. import _runtime

    if _runtime.is_initialized():
        return _runtime.size(), _runtime.rank(), "rumor"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank(), "torch"
    return None, None, None


def _world_and_rank(num_replicas, rank, what: str) -> Tuple[int, int]:
    if num_replicas is None or rank is None:
        w, r, _ = _process_group()
        if w is None:
            raise ValueError(f"{what}: num_replicas and rank were not given and no process group is "
                             "initialised (neither rumor.init() nor torch.distributed.init_process_group()); "
                             "initialise one or pass both")
        num_replicas = w if num_replicas is None else num_replicas
        rank = r if rank is None else rank
    num_replicas = _int(num_replicas, "num_replicas", what, minimum=1)
    rank = _int(rank, "rank", what)
    if not 0 <= rank < num_replicas:
        raise ValueError(f"{what}: rank must be in [0, {num_replicas - 1}] for num_replicas={num_replicas}, got {rank}")
    return num_replicas, rank


def _costs_on_rank0(dataset, complexity_fn: Callable, n: int, what: str) -> np.ndarray:
    """complexity_fn over the dataset on rank 0 only, the result broadcast to every rank: only one
    rank loads the whole dataset. Collective: every rank of the job must call it."""
    import torch

    _, rank, which = _process_group()

    def local() -> np.ndarray:
        vals = []
        for i in range(n):
            vals.append(complexity_fn(dataset[i]))
        return _as_costs(vals, n, "complexity_fn's values", what)

    if which is None:
        return local()
    if which == "rumor":
        from .. import collectives

        def bcast(t):
            return collectives.broadcast(t, 0)

        def allmax(t):
            return collectives.allreduce(t, op=collectives.ReduceOp.MAX)
    else:
        import torch.distributed as dist

        def bcast(t):
            dist.broadcast(t, 0)
            return t

        def allmax(t):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t

    # Everyone must agree on the size before rank 0 sends n values; [n, -n] maxed gives max and min.
    sizes = allmax(torch.tensor([float(n), -float(n)], dtype=torch.float64))
    if int(sizes[0]) != n or int(-sizes[1]) != n:
        raise ValueError(f"{what}: the dataset has {n} samples on rank {rank} but between "
                         f"{int(-sizes[1])} and {int(sizes[0])} on other ranks")
    error: Optional[BaseException] = None
    costs = None
    if rank == 0:
        try:
            costs = local()
        except Exception as e:  # noqa: BLE001 (re-raised below, after telling the other ranks)
            error = e
    status = bcast(torch.tensor([0.0 if error is not None else 1.0], dtype=torch.float64))
    if error is not None:
        raise error
    if float(status[0]) != 1.0:
        raise RuntimeError(f"{what}: complexity_fn failed on rank 0 (its traceback is in rank 0's output)")
    data = torch.from_numpy(costs) if rank == 0 else torch.empty(n, dtype=torch.float64)
    return bcast(data).numpy().astype(np.float64, copy=True)


def _resolve_costs(dataset, complexity_fn, costs, n: int, what: str) -> np.ndarray:
    if costs is not None and complexity_fn is not None:
        raise ValueError(f"{what}: give costs or complexity_fn, not both")
    if costs is not None:
        return _as_costs(costs, n, "costs", what)
    if complexity_fn is not None:
        if not callable(complexity_fn):
            raise TypeError(f"{what}: complexity_fn must be callable, got {type(complexity_fn).__name__}")
        return _costs_on_rank0(dataset, complexity_fn, n, what)
    lengths = getattr(dataset, "lengths", None)
    if lengths is not None:
        if callable(lengths):
            lengths = lengths()
        return _as_costs(lengths, n, "dataset.lengths", what)
    raise ValueError(f"{what}: the cost of each sample is unknown: pass costs=, complexity_fn=, or a dataset "
                     "with a `lengths` attribute")


# ---- the sampler ------------------------------------------------------------------------------------

class LoadBalancingDistributedSampler(Sampler):
    """A DistributedSampler whose ranks get near-equal work in every global step.

    dataset: a map-style dataset (len() is used; samples are read only by complexity_fn).
    complexity_fn: sample -> cost (>= 0), evaluated once, on rank 0 only, and broadcast (so
      constructing the sampler is collective when a process group is up).
    costs: the cost of every sample, precomputed (length len(dataset)); otherwise
      dataset.lengths is used when there is one.
    num_replicas, rank: default to rumor's job if rumor.init() ran, else torch.distributed's.
    shuffle, seed: a new seeded order every epoch (set_epoch); the same on every rank.
    drop_last: with len(dataset) not a multiple of num_replicas, drop randomly chosen samples
      (seeded) instead of repeating the cheapest samples of the epoch's tail.
    random_level: 0 balances as well as possible; up to 1 adds seeded noise to the costs used to
      order the work (not to the costs balanced), trading balance for randomness.
    batch_size: the per-rank batch size of the DataLoader this sampler feeds; each global step's
      num_replicas*batch_size samples are partitioned together. With the default 1 the running
      cost totals of the ranks are still kept within one sample's cost of each other.
    sort_window: with it above 1 (default 16), the samples of each window of sort_window global
      steps are sorted by cost and cut into steps, so that a step holds samples of similar cost
      (less padding), and those steps are shuffled within the window (when shuffle is on); 1
      keeps the permutation's order.

    Resuming mid-epoch: state_dict() says the epoch and how many samples this rank has drawn
    (the same on every rank, so saving rank 0's is enough); load_state_dict() on a fresh
    sampler makes its next iteration yield exactly the rest of that epoch.
    """

    _what = "LoadBalancingDistributedSampler"

    def __init__(self, dataset, complexity_fn: Optional[Callable[[Any], float]] = None,
                 costs: Optional[Sequence[float]] = None, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 random_level: float = 0.0, *, batch_size: int = 1, sort_window: int = 16):
        what = self._what
        try:
            n = len(dataset)
        except TypeError:
            raise TypeError(f"{what}: dataset must have a length (a map-style dataset), got "
                            f"{type(dataset).__name__}") from None
        self.shuffle = _bool(shuffle, "shuffle", what)
        self.drop_last = _bool(drop_last, "drop_last", what)
        self.seed = _int(seed, "seed", what)
        self.batch_size = _int(batch_size, "batch_size", what, minimum=1)
        self.sort_window = _int(sort_window, "sort_window", what, minimum=1)
        if isinstance(random_level, bool) or not isinstance(random_level, numbers.Real):
            raise TypeError(f"{what}: random_level must be a number in [0, 1], got {type(random_level).__name__}")
        if not 0.0 <= float(random_level) <= 1.0:
            raise ValueError(f"{what}: random_level must be in [0, 1], got {random_level}")
        self.random_level = float(random_level)
        self.num_replicas, self.rank = _world_and_rank(num_replicas, rank, what)
        self.dataset = dataset
        self.dataset_size = n
        self.costs = _resolve_costs(dataset, complexity_fn, costs, n, what)
        self.costs.setflags(write=False)
        self.epoch = 0
        self._resume_epoch: Optional[int] = None  # the epoch a loaded state resumes
        self._start = 0                            # ... and where in it
        self._consumed = 0
        # [(world, consumed), ...]: earlier parts of the current epoch at other world sizes.
        self._history: List[Tuple[int, int]] = []
        self._cache: Optional[Tuple[tuple, np.ndarray]] = None

    # ---- sizes
    @property
    def total_size(self) -> int:
        """Samples drawn per epoch over all ranks (a multiple of num_replicas)."""
        n, w = self.dataset_size, self.num_replicas
        return n - n % w if self.drop_last else -(-n // w) * w

    @property
    def num_samples(self) -> int:
        """Samples this rank draws per epoch."""
        return self.total_size // self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    # ---- epochs
    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch to plan (call before each epoch, as with DistributedSampler). Setting
        the epoch a loaded state resumes keeps the resume point."""
        epoch = _int(epoch, "epoch", f"{self._what}.set_epoch", minimum=0)
        self.epoch = epoch
        if self._resume_epoch is not None and epoch != self._resume_epoch:
            self._resume_epoch, self._start, self._history = None, 0, []

    def _rng(self, epoch: int, stream: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence([self.seed % (1 << 64), epoch, stream]))

    def _epoch_order(self, epoch: int, world: Optional[int] = None) -> np.ndarray:
        """The epoch's samples in order, total_size of them: steps 1 and 2 of the module's plan."""
        n = self.dataset_size
        rng = self._rng(epoch, _ORDER)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        return self._fit(order, world or self.num_replicas, rng)

    def _fit(self, order: np.ndarray, w: int, rng: np.random.Generator) -> np.ndarray:
        """order made a multiple of w: drop_last drops random samples, otherwise the cheapest
        samples of the tail are repeated."""
        n = len(order)
        extra = n % w
        if extra and self.drop_last:
            keep = np.ones(n, dtype=bool)
            keep[rng.choice(n, size=extra, replace=False)] = False
            order = order[keep]
        elif extra:
            # The tail is the last step's group: repeating its cheapest samples adds the least work
            # there (repeating the first samples, as DistributedSampler does, can add heavy ones).
            tail = order[-min(n, w * self.batch_size):]
            cheapest = tail[np.argsort(self.costs[tail], kind="stable")]
            order = np.concatenate([order, np.resize(cheapest, w - extra)])
        return order.astype(np.int64, copy=False)

    def _plan_all(self, epoch: int, world: Optional[int] = None, history=()) -> np.ndarray:
        """(world, samples per rank): every rank's order of the epoch (world: num_replicas by
        default). history: [(world, consumed), ...] of earlier parts of this epoch run at other
        world sizes (see reshard); the plan is then that of the samples those parts left."""
        w = world or self.num_replicas
        if history:
            prev = self._plan_all(epoch, history[-1][0], history[:-1])
            # What the earlier world had not consumed, in its step order (ranks in step).
            rest = prev[:, history[-1][1]:].T.reshape(-1)
            rng = self._rng(epoch, _RESHARD + len(history))
            return self._partition(self._fit(rest, w, rng), w, rng)
        return self._partition(self._epoch_order(epoch, w), w, self._rng(epoch, _PARTITION))

    def _partition(self, order: np.ndarray, w: int, rng: np.random.Generator) -> np.ndarray:
        c = self.costs[order]
        keys = _noisy_keys(c, self.random_level, rng)
        g = w * self.batch_size
        if self.sort_window > 1 and len(order) > g:
            order, c, keys = self._sort_into_steps(order, c, keys, g, rng)
        assigner = _RankAssigner(w, rng)
        full = len(order) // g
        pieces = []  # (parts (groups, rounds, world), loads (groups, world))
        if full:
            pieces.append(_partition_groups(order[:full * g].reshape(full, g), c[:full * g].reshape(full, g),
                                            keys[:full * g].reshape(full, g), w))
        if len(order) > full * g:  # the last, shorter step
            pieces.append(_partition_groups(order[None, full * g:], c[None, full * g:], keys[None, full * g:], w))
        out = []
        for parts, loads in pieces:
            share_of = np.array([assigner.assign(row) for row in loads.tolist()], dtype=np.int64).reshape(-1, 1, w)
            # rank r's samples of group k are part share_of[k, r]
            mine = np.take_along_axis(parts, np.broadcast_to(share_of, parts.shape), axis=2)
            out.append(mine.transpose(2, 0, 1).reshape(w, -1))
        if not out:
            return np.empty((w, 0), dtype=np.int64)
        return np.concatenate(out, axis=1)

    def _sort_into_steps(self, order, c, keys, g, rng):
        """Within each window of sort_window steps' samples, sorts by key and cuts into steps, so
        a step holds samples of similar cost, then shuffles those steps within the window. The
        last, short step (if any) stays last: the DataLoader's final partial batch is there."""
        total = len(order)
        window = g * self.sort_window
        perm = []
        for p0 in range(0, total, window):
            p1 = min(total, p0 + window)
            srt = p0 + np.argsort(-keys[p0:p1], kind="stable")
            steps = [srt[k:k + g] for k in range(0, p1 - p0, g)]
            nfull = len(steps) if len(steps[-1]) == g else len(steps) - 1
            if self.shuffle:
                steps[:nfull] = [steps[k] for k in rng.permutation(nfull).tolist()]
            perm.extend(steps)
        perm = np.concatenate(perm)
        return order[perm], c[perm], keys[perm]

    def _rank_plan(self, epoch: int) -> np.ndarray:
        key = (epoch, self.num_replicas, self.rank, tuple(self._history))
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._plan_all(epoch, None, tuple(self._history))[self.rank].copy())
        return self._cache[1]

    def __iter__(self) -> Iterator[int]:
        return (int(i) for i in _iterate(self))

    def reshard(self, num_replicas: int, rank: int) -> None:
        """Points the sampler at a new world (rumor.elastic calls this after a restart). Between
        epochs this only changes whom the next epochs are planned for. With a mid-epoch resume
        pending (load_state_dict) and a new world size, the rest of that epoch, the samples the
        old world had not consumed, is partitioned anew over the new world, balanced the same
        way: every sample of the epoch is still drawn exactly once (padding apart).

        Args:
            num_replicas: the new world size (>= 1).
            rank: this process's rank in the new world (0 <= rank < num_replicas).

        Raises:
            TypeError: num_replicas or rank is not an int.
            ValueError: num_replicas < 1 or rank is out of range.
        """
        what = f"{self._what}.reshard"
        num_replicas = _int(num_replicas, "num_replicas", what, minimum=1)
        rank = _int(rank, "rank", what, minimum=0)
        if rank >= num_replicas:
            raise ValueError(f"{what}: rank {rank} is not below num_replicas={num_replicas}")
        if num_replicas != self.num_replicas and self._resume_epoch is not None:
            self._history = [*self._history, (self.num_replicas, self._start)]
            self._start = 0
        self.num_replicas, self.rank = num_replicas, rank

    # ---- checkpoints
    def _identity(self) -> Dict[str, Any]:
        return dict(num_replicas=self.num_replicas, dataset_size=self.dataset_size, seed=self.seed,
                    shuffle=self.shuffle, drop_last=self.drop_last, random_level=self.random_level,
                    batch_size=self.batch_size, sort_window=self.sort_window)

    def state_dict(self, consumed: Optional[int] = None) -> Dict[str, Any]:
        """{'epoch', 'consumed', ...}: consumed is how many samples this rank has drawn in the
        current epoch. A DataLoader with worker processes draws ahead of the training loop: pass
        consumed= (steps done x batch size) to record what training really used."""
        if consumed is None:
            consumed = self._start if self._resume_epoch == self.epoch else self._consumed
        consumed = _int(consumed, "consumed", f"{self._what}.state_dict", minimum=0)
        if consumed > self.num_samples:
            raise ValueError(f"{self._what}.state_dict: consumed={consumed} exceeds the {self.num_samples} "
                             "samples of an epoch on this rank")
        return dict(version=_STATE_VERSION, epoch=self.epoch, consumed=consumed,
                    history=[list(h) for h in self._history], **self._identity())

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes from state_dict(): the next iteration yields the rest of state['epoch']. A
        state saved by a world of another size resumes too (as after reshard())."""
        what = f"{self._what}.load_state_dict"
        epoch, consumed, history = _check_state(state, self._identity(), what)
        world = state["num_replicas"]
        if world != self.num_replicas:
            history, consumed = [*history, (world, consumed)], 0
        self._history = history
        n = len(self._rank_plan(epoch))
        if consumed > n:
            raise ValueError(f"{what}: consumed={consumed} exceeds the {n} samples of epoch {epoch} on this rank")
        self.epoch, self._resume_epoch, self._start, self._consumed = epoch, epoch, consumed, consumed


def _iterate(smp) -> Iterator[Any]:
    """The current epoch's plan of a sampler (either class), from the resume point if a loaded
    state resumes this epoch; counts what was drawn for state_dict()."""
    resuming = smp._resume_epoch == smp.epoch
    if not resuming:
        smp._history = []
    plan = smp._rank_plan(smp.epoch)
    start = smp._start if resuming else 0
    smp._resume_epoch, smp._start = None, 0
    smp._consumed = start
    for k in range(start, len(plan)):
        smp._consumed = k + 1
        yield plan[k]


def _check_state(state, identity: Dict[str, Any], what: str) -> Tuple[int, int, List[Tuple[int, int]]]:
    """(epoch, consumed, history) of a state; every argument but num_replicas must match (a
    different world size resumes through re-planning, see reshard)."""
    if not isinstance(state, dict):
        raise TypeError(f"{what}: expected a dict from state_dict(), got {type(state).__name__}")
    missing = [k for k in ("version", "epoch", "consumed", *identity) if k not in state]
    if missing:
        raise ValueError(f"{what}: the state lacks {missing}")
    if state["version"] != _STATE_VERSION:
        raise ValueError(f"{what}: state version {state['version']!r} is not {_STATE_VERSION}")
    _int(state["num_replicas"], "state['num_replicas']", what, minimum=1)
    history = []
    for h in state.get("history", []):
        if not (isinstance(h, (list, tuple)) and len(h) == 2):
            raise ValueError(f"{what}: state['history'] must hold [num_replicas, consumed] pairs, got {h!r}")
        history.append((_int(h[0], "history world", what, minimum=1), _int(h[1], "history consumed", what, minimum=0)))
    for k, v in identity.items():
        if k == "num_replicas":
            continue
        if state[k] != v:
            raise ValueError(f"{what}: the state was saved with {k}={state[k]!r} but this sampler has {k}={v!r}; "
                             "the rest of that epoch cannot be reproduced")
    epoch = _int(state["epoch"], "state['epoch']", what, minimum=0)
    consumed = _int(state["consumed"], "state['consumed']", what, minimum=0)
    return epoch, consumed, history


# ---- the batch sampler -----------------------------------------------------------------------------

def _pack(items: List[int], costs: List[float], budget: float, padded: bool) -> Tuple[List[List[int]], int]:
    """Greedy token-budget batches over items in the order given (descending cost): a batch grows
    while its cost stays within budget. An item over budget by itself forms a batch alone.
    Returns (batches, number of over-budget items)."""
    batches: List[List[int]] = []
    cur: List[int] = []
    cur_max = cur_sum = 0.0
    over = 0
    for i, x in zip(items, costs):
        if cur:
            m = x if x > cur_max else cur_max
            if ((len(cur) + 1) * m if padded else cur_sum + x) <= budget:
                cur.append(i)
                cur_max, cur_sum = m, cur_sum + x
                continue
            batches.append(cur)
        cur, cur_max, cur_sum = [i], x, x
        if x > budget:
            over += 1
    if cur:
        batches.append(cur)
    return batches, over


class LoadBalancingDistributedBatchSampler(Sampler):
    """Per-rank batches with near-equal cost in every global step, for DataLoader(batch_sampler=...).

    sampler: a LoadBalancingDistributedSampler; its costs, shuffle, seed, num_replicas, rank,
      random_level and drop_last (which samples are in the epoch) are used.
    max_tokens: the budget of one batch in cost units. With padded=True (default) a batch's cost
      is len(batch) x its largest cost, what a batch padded to its longest sample holds; with
      padded=False it is the sum of its costs (packed sequences). A sample over budget by itself
      forms a batch of one (a warning says how many there are).
    batch_fn: instead of max_tokens, your own batching: called with the epoch's indices sorted by
      descending cost (list of ints), returns a list of batches (lists of indices) that holds
      each given index exactly once.
    drop_last: when the number of batches is not a multiple of num_replicas, drop randomly chosen
      surplus batches; otherwise the batches with the most samples are split in two until every
      rank has as many batches (no sample is repeated or lost).

    Batches of similar cost form each global step and the steps are shuffled (seeded) every
    epoch; every rank yields len(self) batches. set_epoch() and state_dict()/load_state_dict()
    (epoch and batches drawn) work as on the sampler.
    """

    _what = "LoadBalancingDistributedBatchSampler"

    def __init__(self, sampler: LoadBalancingDistributedSampler,
                 batch_fn: Optional[Callable[[List[int]], List[List[int]]]] = None,
                 max_tokens: Optional[float] = None, drop_last: bool = False, *, padded: bool = True):
        what = self._what
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise TypeError(f"{what}: sampler must be a LoadBalancingDistributedSampler, got {type(sampler).__name__}")
        if (batch_fn is None) == (max_tokens is None):
            raise ValueError(f"{what}: give exactly one of batch_fn and max_tokens")
        if batch_fn is not None and not callable(batch_fn):
            raise TypeError(f"{what}: batch_fn must be callable, got {type(batch_fn).__name__}")
        if max_tokens is not None:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Real):
                raise TypeError(f"{what}: max_tokens must be a number, got {type(max_tokens).__name__}")
            if not (np.isfinite(max_tokens) and max_tokens > 0):
                raise ValueError(f"{what}: max_tokens must be positive and finite, got {max_tokens}")
            max_tokens = float(max_tokens)
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.max_tokens = max_tokens
        self.drop_last = _bool(drop_last, "drop_last", what)
        self.padded = _bool(padded, "padded", what)
        self.oversized = 0  # samples over max_tokens in the last planned epoch
        self._warned = False
        self._resume_epoch: Optional[int] = None
        self._start = 0
        self._consumed = 0
        self._history: List[Tuple[int, int]] = []  # as the sampler's
        self._cache: Optional[Tuple[tuple, List[List[int]]]] = None

    @property
    def epoch(self) -> int:
        """The epoch being planned: the wrapped sampler's."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch to plan, on the wrapped sampler too (call before each epoch).
        Setting the epoch a loaded state resumes keeps the resume point.

        Args:
            epoch: the epoch number (an int >= 0).

        Raises:
            TypeError: epoch is not an int.
            ValueError: epoch is negative.
        """
        self.sampler.set_epoch(epoch)
        if self._resume_epoch is not None and self.sampler.epoch != self._resume_epoch:
            self._resume_epoch, self._start, self._history = None, 0, []

    def _batch_cost(self, batch: List[int]) -> float:
        c = self.sampler.costs[batch]
        return float(len(batch) * c.max()) if self.padded else float(c.sum())

    def _make_batches(self, items: np.ndarray) -> List[List[int]]:
        if self.max_tokens is not None:
            batches, over = _pack(items.tolist(), self.sampler.costs[items].tolist(), self.max_tokens, self.padded)
            self.oversized = over
            if over and not self._warned:
                self._warned = True
                warnings.warn(f"{self._what}: {over} sample(s) cost more than max_tokens={self.max_tokens:g} "
                              "by themselves; each forms a batch of one", RuntimeWarning, stacklevel=3)
            return batches
        batches = self.batch_fn(items.tolist())
        what = f"{self._what}: batch_fn"
        try:
            batches = [[operator.index(i) for i in b] for b in batches]
        except TypeError as e:
            raise TypeError(f"{what} must return a list of lists of int indices ({e})") from None
        if any(len(b) == 0 for b in batches):
            raise ValueError(f"{what} returned an empty batch")
        got = np.sort(np.fromiter((i for b in batches for i in b), dtype=np.int64))
        if not np.array_equal(got, np.sort(items)):
            raise ValueError(f"{what} must return each index it was given exactly once "
                             f"(given {len(items)}, returned {len(got)})")
        return batches

    def _plan_all(self, epoch: int, world: Optional[int] = None, history=()) -> List[List[List[int]]]:
        """Every rank's batches of the epoch: [rank][step] -> batch. world and history as for
        the sampler's _plan_all: after a world change, the batches the earlier world had not
        consumed are grouped into steps of the new world."""
        s = self.sampler
        w = world or s.num_replicas
        if history:
            prev = self._plan_all(epoch, history[-1][0], history[:-1])
            done = history[-1][1]
            rest = [prev[r][k] for k in range(done, len(prev[0])) for r in range(len(prev))]
            return self._into_steps(rest, w, s._rng(epoch, _RESHARD + 8 + len(history)), shuffle=False)
        order = s._epoch_order(epoch, w)
        rng = s._rng(epoch, _BATCHES)
        keys = _noisy_keys(s.costs[order], s.random_level, rng)
        items = order[np.argsort(-keys, kind="stable")]
        return self._into_steps(self._make_batches(items), w, rng, shuffle=s.shuffle)

    def _into_steps(self, batches: List[List[int]], w: int, rng: np.random.Generator,
                    shuffle: bool) -> List[List[List[int]]]:
        """Batches made a multiple of w (dropped or split), grouped by cost into steps of w."""
        extra = len(batches) % w
        if extra and self.drop_last:
            drop = set(rng.choice(len(batches), size=extra, replace=False).tolist())
            batches = [b for k, b in enumerate(batches) if k not in drop]
        elif extra:
            # Splitting the fullest batches (alternate items, so both halves keep a similar
            # longest sample) adds batches without repeating or losing a sample. There are
            # always enough samples: their count is a multiple of w and at least the batches'.
            heap = [(-len(b), k) for k, b in enumerate(batches)]
            heapq.heapify(heap)
            for _ in range(w - extra):
                size, k = heapq.heappop(heap)
                if -size < 2:
                    raise RuntimeError(f"{self._what}: cannot make {len(batches)} batches a multiple of {w}")
                b = batches[k]
                batches[k] = b[0::2]
                batches.append(b[1::2])
                heapq.heappush(heap, (-len(batches[k]), k))
                heapq.heappush(heap, (-len(batches[-1]), len(batches) - 1))
        cost = [self._batch_cost(b) for b in batches]
        by_cost = sorted(range(len(batches)), key=lambda k: -cost[k])
        assigner = _RankAssigner(w, rng)
        steps = []
        for k0 in range(0, len(by_cost), w):
            group = by_cost[k0:k0 + w]
            share_of = assigner.assign([cost[k] for k in group])
            steps.append([batches[group[share_of[r]]] for r in range(w)])
        if shuffle:
            steps = [steps[k] for k in rng.permutation(len(steps)).tolist()]
        return [[step[r] for step in steps] for r in range(w)]

    def _rank_plan(self, epoch: int) -> List[List[int]]:
        s = self.sampler
        key = (epoch, s.num_replicas, s.rank, tuple(self._history))
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._plan_all(epoch, None, tuple(self._history))[s.rank])
        return self._cache[1]

    def reshard(self, num_replicas: int, rank: int) -> None:
        """As LoadBalancingDistributedSampler.reshard: with a mid-epoch resume pending and a new
        world size, the batches the old world had not drawn are grouped into steps of the new
        world (split or dropped as drop_last says, to make a multiple of it).

        Args:
            num_replicas: the new world size (>= 1).
            rank: this process's rank in the new world (0 <= rank < num_replicas).

        Raises:
            TypeError: num_replicas or rank is not an int.
            ValueError: num_replicas < 1 or rank is out of range.
        """
        s = self.sampler
        old = s.num_replicas
        s.reshard(num_replicas, rank)
        if num_replicas != old and self._resume_epoch is not None:
            self._history = [*self._history, (old, self._start)]
            self._start = 0

    def __len__(self) -> int:
        """Batches per rank in the current epoch (the same on every rank)."""
        return len(self._rank_plan(self.epoch))

    def __iter__(self) -> Iterator[List[int]]:
        return (list(b) for b in _iterate(self))

    def _identity(self) -> Dict[str, Any]:
        return dict(self.sampler._identity(), max_tokens=self.max_tokens, padded=self.padded,
                    batch_drop_last=self.drop_last)

    def state_dict(self, consumed: Optional[int] = None) -> Dict[str, Any]:
        """{'epoch', 'consumed', ...}: consumed is how many batches this rank has drawn in the
        current epoch (pass it explicitly when DataLoader workers draw ahead)."""
        if consumed is None:
            consumed = self._start if self._resume_epoch == self.epoch else self._consumed
        consumed = _int(consumed, "consumed", f"{self._what}.state_dict", minimum=0)
        return dict(version=_STATE_VERSION, epoch=self.epoch, consumed=consumed,
                    history=[list(h) for h in self._history], **self._identity())

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes from state_dict(): the next iteration yields the rest of state['epoch']'s
        batches (also sets the wrapped sampler's epoch). A state saved by a world of another size
        resumes too (as after reshard()).

        Args:
            state: a dict returned by state_dict().

        Raises:
            TypeError: state is not a dict.
            ValueError: state is malformed, was saved with other arguments (seed, max_tokens,
                padded, ...; num_replicas may differ), or says more batches were drawn than
                the epoch has.
        """
        what = f"{self._what}.load_state_dict"
        epoch, consumed, history = _check_state(state, self._identity(), what)
        if state["num_replicas"] != self.sampler.num_replicas:
            history, consumed = [*history, (state["num_replicas"], consumed)], 0
        self._history = history
        self.sampler.set_epoch(epoch)
        n = len(self._rank_plan(epoch))
        if consumed > n:
            raise ValueError(f"{what}: consumed={consumed} exceeds the {n} batches of epoch {epoch} on this rank")
        self._resume_epoch, self._start, self._consumed = epoch, consumed, consumed
