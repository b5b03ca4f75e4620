"""Buckets over a slow, far link (issue 46): engine.buckets.merge_for_link merges neighbouring
buckets where one fewer ends the serial schedule sooner, and nowhere else."""
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
