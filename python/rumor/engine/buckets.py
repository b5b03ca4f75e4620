"""What every data-parallel path groups parameters into: gradient buckets (flat buffers whose
slices are the .grad of their parameters), the default plan of which parameters share one, and
the one-message-per-dtype broadcast that starts every replica from rank 0's state."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional

import torch

from .._runtime import Group
from .._tensor import SUPPORTED_DTYPES
from ..collectives import broadcast_


@dataclass
class Bucket:
    """A flat buffer whose slices are the .grad of ``params`` (views: no copy to communicate)."""

    index: int
    flat: torch.Tensor
    params: List[torch.nn.Parameter]
    names: List[str]
    offsets: List[int]
    # Set when the bucket lives in shared memory that the group's (all-local) peers read in
    # place; algorithms may then use arena.allreduce_op().
    arena: Optional[object] = None


def coalesced_broadcast(tensors: List[torch.Tensor], group: Group) -> None:
    """Broadcasts tensors from the group's first rank, one message per dtype."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    root = group.ranks[0]
    for dtype in sorted(by_dtype, key=str):  # same order on every rank
        ts = by_dtype[dtype]
        if dtype not in SUPPORTED_DTYPES:
            if dtype == torch.bool:
                flat = torch.cat([t.detach().reshape(-1).to(torch.uint8) for t in ts])
                broadcast_(flat, root, group)
                flat = flat.to(torch.bool)
            else:
                raise TypeError(f"rumor.DistributedDataParallel: cannot broadcast {dtype} parameters or buffers")
        else:
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            broadcast_(flat, root, group)
        off = 0
        with torch.no_grad():
            for t in ts:
                n = t.numel()
                t.copy_(flat[off:off + n].view_as(t))
                off += n


def default_bucket_plan(params: List, cap_bytes: int, first_cap_bytes: int,
                        breaks: FrozenSet[int] = frozenset()) -> List[List[int]]:
    """Consecutive parameters of one dtype share a bucket until it would exceed its cap or a
    break comes; the very first bucket is capped lower so that communication starts early.
    Algorithm.plan_buckets' default.

    Args:
        params: the parameters, in the order their gradients are expected to become ready.
        cap_bytes: the most bytes a bucket holds (a parameter larger than that gets a bucket of
            its own).
        first_cap_bytes: the cap of the first bucket.
        breaks: positions in ``params`` that start new buckets (every open bucket is closed
            there); empty by default.

    Returns:
        One list of indices into ``params`` per bucket, in launch order; each bucket holds a
        single dtype.
    """
    buckets: List[List[int]] = []
    open_by_dtype = {}  # dtype -> (bucket index, bytes so far)
    for i, p in enumerate(params):
        if i in breaks:
            open_by_dtype.clear()
        nbytes = p.numel() * p.element_size()
        cur = open_by_dtype.get(p.dtype)
        if cur is not None:
            b, used = cur
            bucket_cap = first_cap_bytes if b == 0 else cap_bytes
            if used + nbytes <= bucket_cap or used == 0:
                buckets[b].append(i)
                open_by_dtype[p.dtype] = (b, used + nbytes)
                continue
        buckets.append([i])
        open_by_dtype[p.dtype] = (len(buckets) - 1, nbytes)
    return buckets


def merge_for_link(plan: List[List[int]], nbytes: List[int], ready: List[float], dtypes: List,
                   rate: float, latency: float) -> List[List[int]]:
    """Merges runs of neighbouring buckets of a plan into the buckets whose serial schedule over
    the link ends backward's communication soonest. Buckets run one after another, each from when
    it is ready or when the one before it ends, whichever is later, for its bytes at `rate` plus
    `latency` (its round trips, whatever its size). On a slow, far link a bucket the link is still
    busy for when it becomes ready gains nothing by being separate and still pays its round trips:
    at 100 Mbit and 100 ms mlp25m's backward made a 4 KiB bias its own first bucket, which held the
    16 MiB bucket ready 1 ms later behind it for 0.05-0.3 s. And a bucket that waits for the end of
    backward starts late: the small transformer's 21 MB of gradients, ready over 0.8 s with no
    pause, do best as the first 15% and the rest. The earliest end of each prefix of the plan only
    depends on the best end of a shorter prefix and the last run (a later start never ends sooner),
    so it is found exactly, in O(buckets^2); within a microsecond of the best the shorter last run
    wins, so buckets merge only where that gains. Merged buckets may exceed the cap, which is a
    latency knob, not a limit.

    Args:
        plan: lists of positions, one per bucket, in launch order.
        nbytes, ready, dtypes: per position: its bytes, when its gradient was ready (seconds, any
            origin; None or NaN counts as the latest time seen), its dtype (only buckets of one
            dtype merge).
        rate: bytes per second one bucket moves at over the link (inf: bytes cost nothing).
        latency: what one more bucket costs whatever its size, in seconds.

    Returns:
        The plan, with some runs of neighbouring buckets merged (equal lists when none gains).
    """
    known = [t for t in ready if t is not None and t == t]
    latest = max(known, default=0.0)
    when = [latest if t is None or t != t else float(t) for t in ready]
    units = [list(b) for b in plan]
    m = len(units)
    size = [sum(nbytes[j] for j in b) for b in units]
    due = [max(when[j] for j in b) for b in units]
    kind = [dtypes[b[0]] for b in units]
    # end[i]: the earliest end of units[:i] as buckets; first[i]: where the last of them starts.
    end, first = [float("-inf")] + [0.0] * m, [0] * (m + 1)
    for i in range(1, m + 1):
        best = None
        due_max, total = float("-inf"), 0
        for j in range(i - 1, -1, -1):
            if kind[j] != kind[i - 1]:
                break
            due_max, total = max(due_max, due[j]), total + size[j]
            e = max(due_max, end[j]) + total / rate + latency
            # Gains under a microsecond are rounding, not a reason to change the layout.
            if best is None or e < best[0] - 1e-6:
                best = (e, j)
        end[i], first[i] = best
    merged, i = [], m
    while i > 0:
        j = first[i]
        merged.append([p for b in units[j:i] for p in b])
        i = j
    return merged[::-1]
