"""rumor.data samplers: coverage, padding/dropping, determinism, balance, resume, batches, costs.

References: exact set/multiset arithmetic for coverage and padding (the padded samples are
recomputed from the documented rule with shuffle=False); torch.utils.data.DistributedSampler on
the same costs for the balance comparison; the balanced-LPT guarantee (the spread of a step's
per-rank cost sums never exceeds the step's largest cost) checked exactly on arbitrary costs.
Every rank's plan is obtained the way users get it: one sampler per rank, iterated.
The broadcast of complexity_fn's costs runs on a real 2-rank job (harness.run).
"""
from __future__ import annotations

import os
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import harness
from rumor.data import LoadBalancingDistributedBatchSampler as BatchSampler
from rumor.data import LoadBalancingDistributedSampler as Sampler

SETTINGS = dict(deadline=None, max_examples=int(os.environ.get("RUMOR_SAMPLER_EXAMPLES", 100)))
costs_st = st.lists(st.floats(0, 1e4, allow_nan=False, allow_infinity=False), min_size=0, max_size=120)


def plans(n_or_costs, world, **kw):
    """Every rank's sequence for the sampler's current epoch, one sampler per rank."""
    costs = np.asarray(n_or_costs, dtype=np.float64)
    epoch = kw.pop("epoch", 0)
    out = []
    for r in range(world):
        s = Sampler(range(len(costs)), costs=costs, num_replicas=world, rank=r, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def batch_plans(costs, world, sampler_kw=None, **kw):
    out = []
    for r in range(world):
        s = Sampler(range(len(costs)), costs=costs, num_replicas=world, rank=r, **(sampler_kw or {}))
        out.append(list(BatchSampler(s, **kw)))
    return out


def step_sums(ps, costs, b):
    """(steps, world) cost of each rank's batch of b consecutive samples."""
    costs = np.asarray(costs, dtype=np.float64)
    n = len(ps[0])
    return np.array([[costs[p[k:k + b]].sum() for p in ps] for k in range(0, n, b)])


def imbalance(sums):
    """Per step (max - min) / mean over ranks, averaged over steps."""
    sums = np.asarray(sums, dtype=np.float64)
    mean = sums.mean(axis=1)
    ok = mean > 0
    return float(((sums.max(axis=1) - sums.min(axis=1))[ok] / mean[ok]).mean())


def lognormal(n, seed=0, sigma=1.0):
    return np.ceil(np.random.default_rng(seed).lognormal(4.0, sigma, n))


# ==== coverage, padding, dropping ====================================================================

@settings(**SETTINGS)
@given(costs=costs_st, world=st.integers(1, 6), b=st.integers(1, 5), shuffle=st.booleans(), seed=st.integers(0, 2**40))
def test_every_sample_once_and_exact_padding(costs, world, b, shuffle, seed):
    n = len(costs)
    ps = plans(costs, world, batch_size=b, shuffle=shuffle, seed=seed)
    want_per_rank = -(-n // world)
    assert [len(p) for p in ps] == [want_per_rank] * world
    drawn = Counter(i for p in ps for i in p)
    assert set(drawn) == set(range(n))
    pad = want_per_rank * world - n
    assert sum(drawn.values()) - n == pad
    if not shuffle and pad:
        # the documented rule: the cheapest of the last min(n, world*b) samples, repeated
        tail = np.arange(n)[-min(n, world * b):]
        cheapest = tail[np.argsort(np.asarray(costs)[tail], kind="stable")]
        assert drawn - Counter(range(n)) == Counter(np.resize(cheapest, pad).tolist())


@settings(**SETTINGS)
@given(costs=costs_st, world=st.integers(1, 6), b=st.integers(1, 5), seed=st.integers(0, 2**40), shuffle=st.booleans())
def test_drop_last_exact_counts(costs, world, b, seed, shuffle):
    n = len(costs)
    ps = plans(costs, world, batch_size=b, drop_last=True, seed=seed, shuffle=shuffle)
    assert [len(p) for p in ps] == [n // world] * world
    drawn = [i for p in ps for i in p]
    assert len(drawn) == len(set(drawn)) == n - n % world
    assert set(drawn) <= set(range(n))


def test_drop_last_drops_random_samples_not_the_heaviest():
    n, world = 103, 4  # 3 dropped per epoch
    costs = np.arange(n, dtype=np.float64)  # the heaviest are the highest indices
    dropped = []
    for epoch in range(30):
        ps = plans(costs, world, drop_last=True, shuffle=False, epoch=epoch)
        dropped.append(frozenset(range(n)) - frozenset(i for p in ps for i in p))
    assert all(len(d) == 3 for d in dropped)
    assert len(set(dropped)) > 20                       # a different choice most epochs
    heaviest = frozenset(range(n - 3, n))
    assert sum(d == heaviest for d in dropped) <= 1
    mean_cost = np.mean([costs[list(d)].mean() for d in dropped])
    assert 0.25 * n < mean_cost < 0.75 * n              # uniform choice: ~n/2


def test_padding_keeps_last_step_balanced():
    # one very heavy sample at the start: DistributedSampler-style padding (repeat the first
    # samples) would put it into the last step twice; the cheapest of the tail is repeated instead
    world, b = 4, 2
    costs = np.full(4 * 2 * 5 + 1, 10.0)
    costs[0] = 1000.0
    ps = plans(costs, world, batch_size=b, shuffle=False)
    sums = step_sums(ps, costs, b)
    assert sums[-1].max() - sums[-1].min() <= 10.0
    assert Counter(i for p in ps for i in p)[0] == 1


# ==== determinism ===================================================================================

def test_deterministic_per_seed_and_epoch():
    costs = lognormal(500)
    a = plans(costs, 4, seed=7, epoch=3, batch_size=4, random_level=0.3)
    b = plans(costs, 4, seed=7, epoch=3, batch_size=4, random_level=0.3)
    assert a == b
    assert plans(costs, 4, seed=7, epoch=4, batch_size=4) != plans(costs, 4, seed=7, epoch=3, batch_size=4)
    assert plans(costs, 4, seed=8, epoch=3, batch_size=4) != plans(costs, 4, seed=7, epoch=3, batch_size=4)
    # set_epoch on one sampler object, back and forth, reproduces the same epochs
    s = Sampler(range(500), costs=costs, num_replicas=4, rank=2, seed=7, batch_size=4, random_level=0.3)
    s.set_epoch(3)
    e3 = list(s)
    s.set_epoch(4)
    assert list(s) != e3
    s.set_epoch(3)
    assert list(s) == e3 == a[2]


def test_random_level_changes_order_but_not_coverage():
    costs = lognormal(400)
    base = plans(costs, 4, batch_size=4)
    noisy = plans(costs, 4, batch_size=4, random_level=1.0)
    assert noisy != base
    assert sorted(i for p in noisy for i in p) == list(range(400))
    # noise trades balance for randomness: full noise is no better balanced than none
    assert imbalance(step_sums(noisy, costs, 4)) >= imbalance(step_sums(base, costs, 4))


# ==== balance =======================================================================================

@settings(**SETTINGS)
@given(costs=st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=150), world=st.integers(1, 6),
       b=st.integers(1, 6), seed=st.integers(0, 1000))
def test_step_spread_at_most_largest_cost(costs, world, b, seed):
    """Balanced LPT's guarantee, per global step, and for the running totals of every rank."""
    ps = plans(costs, world, batch_size=b, seed=seed)
    c = np.asarray(costs)
    n = len(ps[0])
    cum = np.zeros(world)
    biggest = 0.0
    for k in range(0, n, b):
        parts = [p[k:k + b] for p in ps]
        sums = np.array([c[q].sum() for q in parts])
        largest = max(c[q].max() for q in parts)
        tol = 1e-9 * max(1.0, sums.max())
        assert sums.max() - sums.min() <= largest + tol
        biggest = max(biggest, largest)
        cum += sums
        assert cum.max() - cum.min() <= biggest + tol * (k // b + 1)


@pytest.mark.parametrize("dist", ["lognormal", "pareto"])
@pytest.mark.parametrize("world,b", [(4, 8), (8, 4), (2, 16)])
def test_balance_better_than_distributed_sampler(dist, world, b):
    n = 4096 + 3
    rng = np.random.default_rng(1)
    costs = lognormal(n, 1) if dist == "lognormal" else np.ceil(20 * (1 + rng.pareto(1.5, n)))
    ours = step_sums(plans(costs, world, batch_size=b, seed=3), costs, b)
    ref = [list(torch.utils.data.DistributedSampler(range(n), num_replicas=world, rank=r, seed=3))
           for r in range(world)]
    theirs = step_sums(ref, costs, b)
    assert ours.shape == theirs.shape
    ours_imb, theirs_imb = imbalance(ours), imbalance(theirs)
    assert ours_imb < 0.2 * theirs_imb, (ours_imb, theirs_imb)
    assert ours_imb < 0.1
    # the slowest rank bounds the step: sum over steps of the max rank cost is lower too
    assert ours.max(axis=1).sum() < theirs.max(axis=1).sum()
    # without sorting across steps (each step a random set, balanced only within itself), a
    # single huge sample can dominate a step, but the balance is still strictly better
    alone = step_sums(plans(costs, world, batch_size=b, seed=3, sort_window=1), costs, b)
    assert imbalance(alone) < 0.8 * theirs_imb
    assert alone.max(axis=1).sum() < theirs.max(axis=1).sum()


def test_no_rank_always_gets_the_heaviest():
    world, n = 4, 4000
    costs = lognormal(n, 2)
    ps = plans(costs, world)  # batch_size 1: every group of 4 has one heaviest item
    wins = Counter()
    for k in range(n // world):
        items = [p[k] for p in ps]
        wins[int(np.argmax(costs[items]))] += 1
    fair = n // world / world
    assert all(0.6 * fair < wins[r] < 1.4 * fair for r in range(world)), wins
    totals = [costs[p].sum() for p in ps]
    assert max(totals) - min(totals) <= costs.max()


# ==== resume ========================================================================================

@settings(**SETTINGS)
@given(n=st.integers(0, 90), world=st.integers(1, 4), b=st.integers(1, 4), data=st.data())
def test_resume_mid_epoch(n, world, b, data):
    costs = lognormal(n, 5)
    rank = data.draw(st.integers(0, world - 1))
    epoch = data.draw(st.integers(0, 5))
    full = plans(costs, world, batch_size=b, epoch=epoch, seed=11)[rank]
    k = data.draw(st.integers(0, len(full)))
    a = Sampler(range(n), costs=costs, num_replicas=world, rank=rank, batch_size=b, seed=11)
    a.set_epoch(epoch)
    it = iter(a)
    head = [next(it) for _ in range(k)]
    state = a.state_dict()
    assert state["epoch"] == epoch and state["consumed"] == k
    fresh = Sampler(range(n), costs=costs, num_replicas=world, rank=rank, batch_size=b, seed=11)
    fresh.load_state_dict(state)
    fresh.set_epoch(epoch)  # a training loop's set_epoch of the resumed epoch keeps the point
    assert head + list(fresh) == full
    fresh.set_epoch(epoch + 1)
    assert list(fresh) == plans(costs, world, batch_size=b, epoch=epoch + 1, seed=11)[rank]


def test_resume_state_from_rank0_on_other_ranks_and_checks():
    costs = lognormal(64)
    s0 = Sampler(range(64), costs=costs, num_replicas=4, rank=0, seed=1)
    s0.set_epoch(2)
    it = iter(s0)
    for _ in range(5):
        next(it)
    state = s0.state_dict()
    s3 = Sampler(range(64), costs=costs, num_replicas=4, rank=3, seed=1)
    s3.load_state_dict(state)
    assert list(s3) == plans(costs, 4, seed=1, epoch=2)[3][5:]
    assert s0.state_dict(consumed=3)["consumed"] == 3
    with pytest.raises(ValueError, match="seed"):
        Sampler(range(64), costs=costs, num_replicas=4, rank=0, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="consumed"):
        s3.load_state_dict(dict(state, consumed=17))
    with pytest.raises(ValueError, match="lacks"):
        s3.load_state_dict({"epoch": 1})
    with pytest.raises(TypeError, match="dict"):
        s3.load_state_dict([1, 2])


# ==== batch sampler =================================================================================

@settings(**SETTINGS)
@given(costs=st.lists(st.integers(1, 300), min_size=0, max_size=150), world=st.integers(1, 5),
       budget=st.integers(50, 1200), padded=st.booleans(), drop_last=st.booleans(), seed=st.integers(0, 99))
def test_batches_respect_budget_and_cover(costs, world, budget, padded, drop_last, seed):
    c = np.asarray(costs, dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ps = batch_plans(c, world, sampler_kw=dict(seed=seed), max_tokens=budget, padded=padded,
                         drop_last=drop_last)
    assert len({len(p) for p in ps}) <= 1  # every rank takes the same number of steps
    for p in ps:
        for batch in p:
            assert batch
            cost = len(batch) * c[batch].max() if padded else c[batch].sum()
            assert cost <= budget or len(batch) == 1
    drawn = Counter(i for p in ps for batch in p for i in batch)
    epoch_samples = Counter(i for p in plans(c, world, seed=seed) for i in p)
    if drop_last:  # whole batches dropped, fewer than one per rank
        assert not drawn - epoch_samples
        assert sum(epoch_samples.values()) - sum(drawn.values()) <= (world - 1) * max(1, budget)
    else:
        # every sample; repeats only from the sampler's padding to a multiple of world
        assert set(drawn) == set(range(len(c)))
        assert sum(drawn.values()) == -(-len(c) // world) * world


def test_oversized_sample_is_a_batch_of_one_with_a_warning():
    costs = np.array([10, 10, 5000, 10, 10, 10, 10, 10], dtype=np.float64)
    s = Sampler(range(8), costs=costs, num_replicas=2, rank=0)
    bs = BatchSampler(s, max_tokens=100)
    with pytest.warns(RuntimeWarning, match="1 sample"):
        n = len(bs)
    assert bs.oversized == 1
    with pytest.warns(RuntimeWarning, match="batch of one"):
        ps = batch_plans(costs, 2, max_tokens=100)
    assert len(ps[0]) == len(ps[1]) == n
    assert [2] in [b for p in ps for b in p]


def test_batches_balanced_and_better_than_fixed_batches():
    """Token-budget steps against DistributedSampler with a fixed batch padded to its longest."""
    world, n = 4, 4000
    costs = lognormal(n, 3)
    ps = batch_plans(costs, world, max_tokens=4096)
    per_step = np.array([[len(p[k]) * costs[p[k]].max() for p in ps] for k in range(len(ps[0]))])
    assert imbalance(per_step) < 0.1
    b = 8
    ref = [list(torch.utils.data.DistributedSampler(range(n), num_replicas=world, rank=r, seed=0))
           for r in range(world)]
    ref_step = np.array([[b * costs[p[k:k + b]].max() for p in ref] for k in range(0, len(ref[0]), b)])
    assert imbalance(per_step) < 0.5 * imbalance(ref_step)
    # and the padded work of an epoch (sum of the slowest rank per step) is smaller
    assert per_step.max(axis=1).sum() < ref_step.max(axis=1).sum()


def test_batch_fn_and_split_to_equal_counts():
    costs = np.arange(1, 25, dtype=np.float64)

    def pairs(idx):
        return [idx[k:k + 2] for k in range(0, len(idx), 2)]  # 12 batches for 3 ranks -> even

    ps = batch_plans(costs, 3, batch_fn=pairs)
    assert [len(p) for p in ps] == [4, 4, 4]
    assert sorted(i for p in ps for b in p for i in b) == list(range(24))

    def fives(idx):
        return [idx[k:k + 5] for k in range(0, len(idx), 5)]  # 5 batches for 4 ranks

    ps = batch_plans(costs, 4, batch_fn=fives)  # split into 8: no sample lost or repeated
    assert [len(p) for p in ps] == [2, 2, 2, 2]
    assert sorted(i for p in ps for b in p for i in b) == list(range(24))
    ps = batch_plans(costs, 4, batch_fn=fives, drop_last=True)  # one random batch dropped
    assert [len(p) for p in ps] == [1, 1, 1, 1]
    kept = [sorted(b) for p in ps for b in p]
    assert sorted(map(len, kept)) in ([4, 5, 5, 5], [5, 5, 5, 5])  # whole batches of batch_fn's

    with pytest.raises(ValueError, match="exactly once"):
        batch_plans(costs, 2, batch_fn=lambda idx: [idx[:-1]])
    with pytest.raises(ValueError, match="empty batch"):
        batch_plans(costs, 2, batch_fn=lambda idx: [idx, []])
    with pytest.raises(TypeError, match="int indices"):
        batch_plans(costs, 2, batch_fn=lambda idx: [[0.5]])


def test_batch_sampler_resume_and_epochs():
    costs = lognormal(300, 4)
    mk = lambda: BatchSampler(Sampler(range(300), costs=costs, num_replicas=3, rank=1, seed=5), max_tokens=1500)
    a = mk()
    a.set_epoch(4)
    full = list(a)
    it = iter(a)
    head = [next(it) for _ in range(3)]
    state = a.state_dict()
    b = mk()
    b.load_state_dict(state)
    b.set_epoch(4)
    assert head + list(b) == full
    a.set_epoch(5)
    assert list(a) != full
    with pytest.raises(ValueError, match="max_tokens"):
        BatchSampler(Sampler(range(300), costs=costs, num_replicas=3, rank=1, seed=5),
                     max_tokens=1000).load_state_dict(state)


def test_with_dataloader():
    costs = lognormal(103)
    ds = torch.arange(103)
    s = Sampler(ds, costs=costs, num_replicas=2, rank=1, batch_size=4)
    got = [x.tolist() for x in torch.utils.data.DataLoader(ds, batch_size=4, sampler=s)]
    want = plans(costs, 2, batch_size=4)[1]
    assert got == [want[k:k + 4] for k in range(0, len(want), 4)]
    bs = BatchSampler(Sampler(ds, costs=costs, num_replicas=2, rank=1), max_tokens=600)
    assert [x.tolist() for x in torch.utils.data.DataLoader(ds, batch_sampler=bs)] == list(bs)


# ==== costs and validation ==========================================================================

class Lengths(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        raise AssertionError("the sampler must not load samples when lengths are known")


def test_lengths_attribute_and_local_complexity_fn():
    lengths = [5, 1, 9, 3, 7, 2]
    s = Sampler(Lengths(lengths), num_replicas=2, rank=0)
    assert s.costs.tolist() == lengths
    mine = np.array(lengths, dtype=np.float64)
    s = Sampler(range(6), costs=mine, num_replicas=2, rank=0)
    mine[0] = 99.0  # the caller's array stays writable and the sampler keeps its own copy
    assert s.costs.tolist() == lengths
    calls = []
    s = Sampler([[0] * k for k in lengths], complexity_fn=lambda x: calls.append(1) or len(x) ** 2,
                num_replicas=2, rank=1)  # no process group: computed here, once
    assert s.costs.tolist() == [k * k for k in lengths] and len(calls) == 6
    list(s)
    s.set_epoch(1)
    list(s)
    assert len(calls) == 6


@pytest.mark.parametrize("kw, exc, match", [
    (dict(costs=[1, 2]), ValueError, "costs has 2 entries"),
    (dict(costs=[1, -2, 3, 4]), ValueError, "sample 1 has cost -2"),
    (dict(costs=[1, float("nan"), 3, 4]), ValueError, "finite"),
    (dict(costs=[[1, 2], [3, 4]]), ValueError, "one-dimensional"),
    (dict(costs=["a", "b", "c", "d"]), TypeError, "numbers"),
    (dict(costs=[1] * 4, complexity_fn=len), ValueError, "not both"),
    (dict(complexity_fn=3), TypeError, "callable"),
    (dict(), ValueError, "lengths"),
    (dict(costs=[1] * 4, rank=2, num_replicas=2), ValueError, "rank must be in"),
    (dict(costs=[1] * 4, rank=-1), ValueError, "rank must be in"),
    (dict(costs=[1] * 4, num_replicas=0), ValueError, "num_replicas must be >= 1"),
    (dict(costs=[1] * 4, num_replicas=2.0), TypeError, "num_replicas must be an int"),
    (dict(costs=[1] * 4, random_level=1.5), ValueError, "random_level"),
    (dict(costs=[1] * 4, random_level="x"), TypeError, "random_level"),
    (dict(costs=[1] * 4, shuffle=1), TypeError, "shuffle"),
    (dict(costs=[1] * 4, batch_size=0), ValueError, "batch_size"),
    (dict(costs=[1] * 4, seed=1.5), TypeError, "seed"),
    (dict(costs=[1] * 4, sort_window=0), ValueError, "sort_window"),
])
def test_sampler_validation(kw, exc, match):
    kw = {"num_replicas": 2, "rank": 0, **kw}
    with pytest.raises(exc, match=match):
        Sampler(range(4), **kw)


def test_validation_misc():
    with pytest.raises(ValueError, match="no process group"):
        Sampler(range(4), costs=[1] * 4)
    with pytest.raises(TypeError, match="length"):
        Sampler(iter(range(4)), costs=[1] * 4, num_replicas=1, rank=0)
    s = Sampler(range(4), costs=[1] * 4, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="epoch"):
        s.set_epoch(-1)
    for kw, exc, match in [(dict(max_tokens=0), ValueError, "max_tokens must be positive"),
                           (dict(max_tokens=float("inf")), ValueError, "max_tokens"),
                           (dict(max_tokens="8"), TypeError, "max_tokens"),
                           (dict(), ValueError, "exactly one"),
                           (dict(max_tokens=8, batch_fn=list), ValueError, "exactly one"),
                           (dict(batch_fn=5), TypeError, "callable")]:
        with pytest.raises(exc, match=match):
            BatchSampler(s, **kw)
    with pytest.raises(TypeError, match="LoadBalancingDistributedSampler"):
        BatchSampler(torch.utils.data.SequentialSampler(range(4)), max_tokens=8)
    with pytest.raises(ValueError, match="exceeds"):
        s.state_dict(consumed=3)


# ==== a real 2-rank job: costs computed on rank 0 only ==============================================

class CountingDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n, self.loaded = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded += 1
        return torch.zeros(3 + (i * 7919) % 50)


def _fn_calls_rank(fail_on_root):
    import datetime

    import torch.distributed as dist

    import rumor

    torch.set_num_threads(1)
    rumor.init()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    out = {}
    for backend in ("rumor", "torch"):
        if backend == "torch":
            rumor.shutdown()  # now only torch.distributed is up
        ds = CountingDataset(101)
        calls = []

        def fn(x):
            calls.append(1)
            if fail_on_root:
                raise KeyError("bad sample")
            return float(x.numel())

        try:
            s = Sampler(ds, complexity_fn=fn, batch_size=2)
        except Exception as e:  # noqa: BLE001
            out[backend] = dict(error=f"{type(e).__name__}: {e}", calls=len(calls), loaded=ds.loaded)
            continue
        out[backend] = dict(calls=len(calls), loaded=ds.loaded, costs=s.costs.tolist(),
                            world=s.num_replicas, rank=s.rank, plan=list(s))
    return out


def test_complexity_fn_on_rank0_only_and_broadcast():
    want = [float(3 + (i * 7919) % 50) for i in range(101)]
    res = harness.run(_fn_calls_rank, 2, timeout=90, args=(False,))
    for backend in ("rumor", "torch"):
        r0, r1 = res[0][backend], res[1][backend]
        assert (r0["calls"], r0["loaded"]) == (101, 101)
        assert (r1["calls"], r1["loaded"]) == (0, 0)  # rank 1 never loads a sample
        assert r0["costs"] == r1["costs"] == want
        assert (r0["world"], r0["rank"], r1["world"], r1["rank"]) == (2, 0, 2, 1)
        assert r0["plan"] == plans(want, 2, batch_size=2)[0] and r1["plan"] == plans(want, 2, batch_size=2)[1]
    res = harness.run(_fn_calls_rank, 2, timeout=90, args=(True,))
    for backend in ("rumor", "torch"):
        assert res[0][backend]["error"] == "KeyError: 'bad sample'"
        assert "complexity_fn failed on rank 0" in res[1][backend]["error"]


def _draw_in_phases(make, worlds, takes, epoch, via_reshard):
    """Every rank of worlds[0] draws takes[0] items of the epoch, then the job continues on
    worlds[1] from rank 0's state (loaded into samplers built for the new world, or built for
    the old one and then reshard()ed, as rumor.elastic does), and so on; the last world draws
    the rest. Returns every item drawn and each phase's per-rank lengths of the rest."""
    drawn, state, rest_lengths = [], None, []
    for phase, w in enumerate(worlds):
        ranks = []
        for r in range(w):
            if state is not None and via_reshard:
                smp = make(state["num_replicas"], 0)
                smp.load_state_dict(state)
                smp.reshard(w, r)
            else:
                smp = make(w, r)
                if state is not None:
                    smp.load_state_dict(state)
            smp.set_epoch(epoch)
            ranks.append(smp)
        its = [iter(smp) for smp in ranks]
        if phase < len(worlds) - 1:
            for it in its:
                drawn.extend(next(it) for _ in range(takes[phase]))
            state = ranks[0].state_dict()
        else:
            rests = [list(it) for it in its]
            rest_lengths = [len(x) for x in rests]
            drawn.extend(x for rest in rests for x in rest)
    return drawn, rest_lengths


@pytest.mark.parametrize("via_reshard", [False, True], ids=["load", "reshard"])
@pytest.mark.parametrize("worlds,takes", [((4, 3), (5,)), ((3, 4), (7,)), ((4, 3, 4), (4, 6)), ((2, 5, 1), (9, 3))])
def test_reshard_mid_epoch_draws_every_sample_once(worlds, takes, via_reshard):
    """A world change mid-epoch (rumor.elastic's 4 -> 3, 3 -> 4): the samples the old world had
    not drawn are re-partitioned over the new world, so over the whole epoch every sample is
    drawn exactly once; only padding repeats (at most world - 1 samples per part of the epoch),
    and the ranks of each world get equally many."""
    n, b = 101, 2
    costs = lognormal(n, 7)
    make = lambda w, r: Sampler(range(n), costs=costs, num_replicas=w, rank=r, batch_size=b, seed=3)
    drawn, rest = _draw_in_phases(make, worlds, takes, epoch=2, via_reshard=via_reshard)
    count = Counter(drawn)
    assert set(count) == set(range(n))
    assert len(drawn) - n <= sum(w - 1 for w in worlds)
    assert len(set(rest)) == 1
    # Deterministic: the same phases give the same draws.
    assert _draw_in_phases(make, worlds, takes, epoch=2, via_reshard=via_reshard)[0] == drawn
    # Without drop_last nothing is lost, with it nothing is repeated.
    make_drop = lambda w, r: Sampler(range(n), costs=costs, num_replicas=w, rank=r, batch_size=b, seed=3,
                                     drop_last=True)
    drawn, _ = _draw_in_phases(make_drop, worlds, takes, epoch=2, via_reshard=via_reshard)
    assert len(drawn) == len(set(drawn)) and len(drawn) >= n - sum(w - 1 for w in worlds)


@pytest.mark.parametrize("via_reshard", [False, True], ids=["load", "reshard"])
def test_batch_sampler_reshard_mid_epoch_draws_every_sample_once(via_reshard):
    n = 300
    costs = lognormal(n, 4)
    make = lambda w, r: BatchSampler(Sampler(range(n), costs=costs, num_replicas=w, rank=r, seed=5), max_tokens=1500)
    drawn, rest = _draw_in_phases(make, (4, 3, 4), (3, 2), epoch=1, via_reshard=via_reshard)
    items = [i for batch in drawn for i in batch]
    assert set(items) == set(range(n))
    assert len(items) - n <= 3  # the first world's padding only: batches are split, never repeated
    assert len(set(rest)) == 1
    assert all(sum(costs[i] for i in batch) > 0 for batch in drawn)


def test_reshard_validates_and_between_epochs_only_changes_the_world():
    costs = lognormal(40)
    s = Sampler(range(40), costs=costs, num_replicas=4, rank=1, seed=2)
    with pytest.raises(ValueError, match="rank 3 is not below"):
        s.reshard(3, 3)
    with pytest.raises(TypeError, match="num_replicas"):
        s.reshard("3", 0)
    s.reshard(3, 2)
    s.set_epoch(1)
    assert list(s) == plans(costs, 3, seed=2, epoch=1)[2]
