"""Buckets over a slow, far link (issue 46): engine.buckets.merge_for_link merges runs of
neighbouring buckets into those whose serial schedule over the link ends soonest, and nowhere
else."""
from __future__ import annotations

import math

from rumor.engine.buckets import merge_for_link

MiB = 1 << 20
F32, BF16 = "float32", "bfloat16"


def _end(plan, nbytes, ready, rate, latency):
    end = -math.inf
    for b in plan:
        end = max(max(ready[j] for j in b), end) + sum(nbytes[j] for j in b) / rate + latency
    return end


def test_mlp25m_at_100mbit_and_100ms_keeps_two_buckets_of_five():
    # rank 0's first iteration there: a 4 KiB bias, then its 16 MiB weight 1 ms later, a pause in
    # backward, a 16 KiB bias, the 64 MiB weight, the 16 MiB weight and its bias.
    nbytes = [4096, 16 * MiB, 16384, 64 * MiB, 16 * MiB, 4096]
    ready = [0.040, 0.041, 0.378, 0.387, 0.416, 0.417]
    plan = [[0], [1], [2], [3], [4, 5]]
    rate, latency = 8.33e6, 0.3
    merged = merge_for_link(plan, nbytes, ready, [F32] * 6, rate, latency)
    # The first bias rides with its weight; the pause is worth its own bucket (the first one's
    # bytes take longer than it); behind a busy link the rest is one bucket.
    assert merged == [[0, 1], [2, 3, 4, 5]]
    assert _end(merged, nbytes, ready, rate, latency) < _end(plan, nbytes, ready, rate, latency) - 0.8
    assert plan == [[0], [1], [2], [3], [4, 5]]  # the caller's plan is not modified


def test_fast_links_keep_every_split():
    # 1 KiB layers at 15 ms pauses on a LAN: each bucket is done long before the next is ready.
    plan = [[0], [1], [2], [3]]
    assert merge_for_link(plan, [1024] * 4, [0.0, 0.015, 0.03, 0.045], [F32] * 4, 1e9, 2e-4) == plan


def test_a_bucket_that_ends_before_the_next_is_ready_stays_alone():
    # 16 MiB ready at once, 16 MiB five seconds later: the first is over the link by then.
    nbytes, ready = [16 * MiB, 16 * MiB], [0.0, 5.0]
    assert merge_for_link([[0], [1]], nbytes, ready, [F32] * 2, 8.33e6, 0.3) == [[0], [1]]
    # Ready together: one bucket saves a round trip.
    assert merge_for_link([[0], [1]], nbytes, [0.0, 0.0], [F32] * 2, 8.33e6, 0.3) == [[0, 1]]


def test_dtypes_never_share_a_bucket_and_unknown_times_count_as_latest():
    nbytes = [4096, 4096, 4096]
    merged = merge_for_link([[0], [1], [2]], nbytes, [0.0, 0.0, None], [F32, BF16, BF16], math.inf, 0.3)
    # bytes cost nothing at an infinite rate: the two bfloat16 buckets merge, float32 stays alone.
    assert merged == [[0], [1, 2]]
    # NaN is unknown too; with every time unknown, all are ready together.
    assert merge_for_link([[0], [1]], nbytes[:2], [float("nan"), None], [F32] * 2, 1e6, 0.1) == [[0, 1]]


def test_zero_latency_merges_nothing():
    # Within one host a bucket costs no round trips: no merge can end sooner.
    plan = [[0], [1], [2]]
    assert merge_for_link(plan, [MiB] * 3, [0.0, 0.0, 0.0], [F32] * 3, 1e9, 0.0) == plan


def test_a_long_run_without_pauses_splits_where_the_link_gains():
    # The small transformer at 100 Mbit and 100 ms: 21 MB of gradients ready evenly over 0.8 s,
    # cut into 20 buckets by the pauses between layers. One bucket waits for the end of backward;
    # the best schedule sends the first 3 while the rest are computed.
    n = 20
    nbytes, ready = [21_150_000 // n] * n, [0.4 + 0.8 * i / (n - 1) for i in range(n)]
    rate, latency = 12.5e6 / 1.5, 0.3
    merged = merge_for_link([[i] for i in range(n)], nbytes, ready, [F32] * n, rate, latency)
    assert [len(b) for b in merged] == [3, 17]
    one = _end([list(range(n))], nbytes, ready, rate, latency)
    assert _end(merged, nbytes, ready, rate, latency) < one - 0.3


def test_the_merge_is_the_best_of_every_partition():
    # Against brute force over every way to cut a plan of up to 8 buckets into runs.
    import itertools
    import random

    rng = random.Random(7)
    for _ in range(200):
        m = rng.randint(1, 8)
        nbytes = [rng.choice([4096, MiB, 16 * MiB]) for _ in range(m)]
        ready = sorted(rng.uniform(0, 2) for _ in range(m))
        rate, latency = rng.choice([1e6, 1e7, 1e8, math.inf]), rng.choice([0.0, 0.01, 0.3])
        plan = [[i] for i in range(m)]
        got = merge_for_link(plan, nbytes, ready, [F32] * m, rate, latency)
        assert sorted(j for b in got for j in b) == list(range(m))
        assert all(b == list(range(b[0], b[-1] + 1)) for b in got)  # runs of neighbours
        best = min(_end([list(range(c[k], c[k + 1])) for k in range(len(c) - 1)], nbytes, ready, rate, latency)
                   for r in range(m) for cuts in itertools.combinations(range(1, m), r)
                   for c in [(0,) + cuts + (m,)])
        assert _end(got, nbytes, ready, rate, latency) <= best + 1e-6 * m
