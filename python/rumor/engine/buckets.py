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
