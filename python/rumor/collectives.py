"""Collective and point-to-point operations on torch tensors.

CPU tensors take rumor's own transports; CUDA tensors (all of one call's tensors on the group's
device) go to rumor._gpu_collectives through rumor._device, which picks NCCL or host staging
(docs/gpu.md). Ranks (root, src, dst) are global ranks, as in torch.distributed. Reducing operations default
to ReduceOp.AVG, as in Horovod. Non-contiguous tensors are handled (through a contiguous
copy). Every call releases the GIL while the C++ core works.
"""
from __future__ import annotations

import enum
import math
from typing import Callable, List, Optional, Sequence

import torch

from . import _device, _runtime
from ._runtime import Group, _comm
from ._tensor import address, check_dense, check_movable, check_tensor, dtype_tag


class ReduceOp(enum.IntEnum):
    SUM = 0
    AVG = 1
    MIN = 2
    MAX = 3
    PROD = 4


_ALGO = {"auto": 0, "ring": 1, "recursive_doubling": 2, "hierarchical": 3}


class Handle:
    """The result of a *_nonblocking call. wait() (or rumor.synchronize(h)) returns the result."""

    def __init__(self, work, keep: tuple, finish: Callable[[], torch.Tensor]):
        self._work = work
        self._keep = keep  # buffers the C++ side reads or writes until it is done
        self._finish = finish
        self._result = None
        self._done = False

    def poll(self) -> bool:
        return self._done or self._work is None or self._work.done()

    def wait(self, timeout: Optional[float] = None) -> torch.Tensor:
        if not self._done:
            if self._work is not None:
                # The op carries its own deadline; this one only guards against a lost wakeup.
                self._work.wait(timeout if timeout is not None else _runtime._get().timeout * 64)
            self._result = self._finish()
            self._done = True
            self._keep = ()
        return self._result


def poll(handle: Handle) -> bool:
    return handle.poll()


def synchronize(handle: Optional[Handle] = None, timeout: Optional[float] = None):
    """synchronize(h): h.wait(), the op's result. synchronize() without a handle: waits until
    every blocking NCCL call this rank queued without a host wait (rumor.set_gpu_wait("stream"))
    has finished on the GPU, at most `timeout` seconds (default rumor's timeout), and raises what
    one of them met (CommTimeoutError, PeerError); with nothing queued it returns at once."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
        raise TypeError(f"rumor.synchronize(): timeout must be a number of seconds, got {type(timeout).__name__}")
    if handle is not None:
        if not callable(getattr(handle, "wait", None)):  # a Handle, or a window's WinHandle
            raise TypeError(f"rumor.synchronize(): expected a handle or nothing, got {type(handle).__name__}")
        return handle.wait() if timeout is None else handle.wait(timeout)
    st = _runtime._get()
    _device.drain_all(st, st.timeout if timeout is None else float(timeout), "rumor.synchronize()")
    return None


def _op(op, what: str) -> int:
    try:
        return int(ReduceOp(op))
    except ValueError:
        raise ValueError(f"{what}: unknown reduce op {op!r}; use rumor.ReduceOp") from None


def _group_rank(g: Group, global_rank: int, what: str, role: str) -> int:
    try:
        return g.ranks.index(int(global_rank))
    except ValueError:
        raise ValueError(f"{what}: {role} {global_rank} is not a member of {g!r}") from None


def _run(nonblocking: bool, issue, keep: tuple, finish: Callable[[], torch.Tensor]):
    work = issue(nonblocking)
    h = Handle(work, keep, finish)
    return h if nonblocking else h.wait()


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _writeback(target: torch.Tensor, buf: torch.Tensor) -> Callable[[], torch.Tensor]:
    def finish():
        if buf.data_ptr() != target.data_ptr() or not target.is_contiguous():
            target.copy_(buf)
        return target

    return finish


# ---- allreduce ---------------------------------------------------------------------------------

def _gpu():
    from . import _gpu_collectives

    return _gpu_collectives


def _allreduce(t, op, group, inplace, nonblocking, algorithm, what):
    gpu = _device.route(what, group, ("t", t))
    if gpu is not None:
        return _gpu().allreduce(gpu, _comm(group, what), t, op, group, inplace, nonblocking, algorithm, what)
    code = check_tensor(t, what)
    g = _comm(group, what)
    if algorithm not in _ALGO:
        raise ValueError(f"{what}: algorithm must be one of {sorted(_ALGO)}, got {algorithm!r}")
    o = _op(op, what)
    buf = _contig(t) if inplace else t.contiguous().clone()
    issue = lambda nb: g._comm.allreduce(address(buf), buf.numel(), code, o, _ALGO[algorithm], nb)
    finish = _writeback(t, buf) if inplace else (lambda: buf)
    return _run(nonblocking, issue, (buf, t), finish)


def allreduce(t, op=ReduceOp.AVG, group=None, *, hierarchical=False, algorithm=None):
    """Returns a new tensor holding the reduction of t over the group.
    hierarchical=True reduces within each host, allreduces among host leaders, then broadcasts."""
    algo = algorithm or ("hierarchical" if hierarchical else "auto")
    return _allreduce(t, op, group, False, False, algo, "rumor.allreduce")


def allreduce_(t, op=ReduceOp.AVG, group=None, *, hierarchical=False, algorithm=None):
    algo = algorithm or ("hierarchical" if hierarchical else "auto")
    return _allreduce(t, op, group, True, False, algo, "rumor.allreduce_")


def allreduce_nonblocking(t, op=ReduceOp.AVG, group=None, *, hierarchical=False, algorithm=None) -> Handle:
    algo = algorithm or ("hierarchical" if hierarchical else "auto")
    return _allreduce(t, op, group, False, True, algo, "rumor.allreduce_nonblocking")


def allreduce_nonblocking_(t, op=ReduceOp.AVG, group=None, *, hierarchical=False, algorithm=None) -> Handle:
    algo = algorithm or ("hierarchical" if hierarchical else "auto")
    return _allreduce(t, op, group, True, True, algo, "rumor.allreduce_nonblocking_")


# ---- broadcast / reduce ------------------------------------------------------------------------

def _broadcast(t, root, group, inplace, nonblocking, what):
    gpu = _device.route(what, group, ("t", t))
    if gpu is not None:
        return _gpu().broadcast(gpu, _comm(group, what), t, root, group, inplace, nonblocking, what)
    code, per = check_movable(t, what)
    g = _comm(group, what)
    r = _group_rank(g, root, what, "root")
    buf = _contig(t) if inplace else t.contiguous().clone()
    issue = lambda nb: g._comm.broadcast(address(buf), buf.numel() * per, code, r, nb)
    finish = _writeback(t, buf) if inplace else (lambda: buf)
    return _run(nonblocking, issue, (buf, t), finish)


def broadcast(t, root, group=None):
    """Returns root's t on every rank (a new tensor)."""
    return _broadcast(t, root, group, False, False, "rumor.broadcast")


def broadcast_(t, root, group=None):
    return _broadcast(t, root, group, True, False, "rumor.broadcast_")


def broadcast_nonblocking(t, root, group=None) -> Handle:
    return _broadcast(t, root, group, False, True, "rumor.broadcast_nonblocking")


def broadcast_nonblocking_(t, root, group=None) -> Handle:
    return _broadcast(t, root, group, True, True, "rumor.broadcast_nonblocking_")


def _reduce(t, root, op, group, nonblocking, what):
    gpu = _device.route(what, group, ("t", t))
    if gpu is not None:
        return _gpu().reduce(gpu, _comm(group, what), t, root, op, group, nonblocking, what)
    code = check_tensor(t, what)
    g = _comm(group, what)
    r = _group_rank(g, root, what, "root")
    o = _op(op, what)
    buf = t.contiguous().clone()
    scratch_ok = g._comm.rank == r
    issue = lambda nb: g._comm.reduce(address(buf), buf.numel(), code, o, r, nb)
    # Only the root's buffer holds the reduction; elsewhere the input is returned unchanged.
    finish = (lambda: buf) if scratch_ok else (lambda: t.clone())
    return _run(nonblocking, issue, (buf, t), finish)


def reduce(t, root, op=ReduceOp.AVG, group=None):
    """On root, returns the reduction of t over the group; elsewhere a copy of t."""
    return _reduce(t, root, op, group, False, "rumor.reduce")


def reduce_nonblocking(t, root, op=ReduceOp.AVG, group=None) -> Handle:
    return _reduce(t, root, op, group, True, "rumor.reduce_nonblocking")


# ---- allgather ---------------------------------------------------------------------------------

_MAX_DIMS = 8


def _shapes(t: torch.Tensor, tag: int, g: Group, what: str) -> List[tuple]:
    """Every rank's shape, gathered so all ranks can check them and raise the same error."""
    if t.dim() > _MAX_DIMS:
        raise ValueError(f"{what}: tensors of more than {_MAX_DIMS} dims are not supported")
    n = g.size()
    meta = torch.zeros(n, _MAX_DIMS + 2, dtype=torch.int64)
    mine = meta[g._comm.rank]
    mine[0] = t.dim()
    mine[1] = tag
    mine[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    g._comm.allgather(address(meta), [_MAX_DIMS + 2] * n, 5, False)
    shapes = []
    for r in range(n):
        d, c = int(meta[r, 0]), int(meta[r, 1])
        if c != tag:
            raise TypeError(f"{what}: rank {g.ranks[r]} passed a tensor of another dtype than {t.dtype} "
                            f"(dtype tag {c} vs {tag})")
        shapes.append(tuple(int(x) for x in meta[r, 2 : 2 + d]))
    return shapes


def _gather_rows(t: torch.Tensor, g: Group, what: str):
    """(every rank's row count, the shared trailing shape) of an allgather of t (at least 1-D)."""
    shapes = _shapes(t, dtype_tag(t.dtype), g, what)
    tail = shapes[g._comm.rank][1:]
    for r, s in enumerate(shapes):
        if len(s) != len(tail) + 1 or s[1:] != tail:
            raise ValueError(
                f"{what}: all dims but the first must match across ranks; rank {g.ranks[r]} has "
                f"shape {list(s)}, rank {g.ranks[g._comm.rank]} has {list(t.shape)}")
    return [s[0] for s in shapes], tail


def _allgather(t, group, out, nonblocking, what):
    gpu = _device.route(what, group, ("t", t), ("out", out))
    if gpu is not None:
        return _gpu().allgather(gpu, _comm(group, what), t, group, out, nonblocking, what)
    code, per = check_movable(t, what)
    g = _comm(group, what)
    if t.dim() == 0:
        t = t.reshape(1)
    rows, tail = _gather_rows(t, g, what)
    per_row = math.prod(tail)
    out = _check_out(out, t.dtype, (sum(rows),) + tuple(tail), what)
    start = sum(rows[: g._comm.rank])
    out[start : start + rows[g._comm.rank]].copy_(t)
    counts = [r_ * per_row * per for r_ in rows]
    issue = lambda nb: g._comm.allgather(address(out), counts, code, nb)
    return _run(nonblocking, issue, (out,), lambda: out)


def allgather(t, group=None, *, out=None):
    """Concatenates every rank's t along dim 0 (the first dim may differ between ranks).
    out= (contiguous, of the concatenated shape) receives the result instead of a new tensor."""
    return _allgather(t, group, out, False, "rumor.allgather")


def allgather_nonblocking(t, group=None, *, out=None) -> Handle:
    """Like allgather; the small shape exchange runs before it returns, the data asynchronously."""
    return _allgather(t, group, out, True, "rumor.allgather_nonblocking")


# ---- reduce_scatter ----------------------------------------------------------------------------

def _split_rows(rows: int, n: int) -> List[int]:
    return [rows // n + (1 if i < rows % n else 0) for i in range(n)]


def _check_out(out, dtype, shape, what, device=None):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    # The caller routed out together with the input (rumor._device): it is on their device.
    check_dense(out, what)
    if out.dtype != dtype or tuple(out.shape) != tuple(shape) or not out.is_contiguous():
        raise ValueError(f"{what}: out must be a contiguous {dtype} tensor of shape {list(shape)}, "
                         f"got {out.dtype} {list(out.shape)}{'' if out.is_contiguous() else ' (non-contiguous)'}")
    return out


def _reduce_scatter(t, op, group, out, nonblocking, what):
    gpu = _device.route(what, group, ("t", t), ("out", out))
    if gpu is not None:
        return _gpu().reduce_scatter(gpu, _comm(group, what), t, op, group, out, nonblocking, what)
    code = check_tensor(t, what)
    g = _comm(group, what)
    o = _op(op, what)
    if t.dim() == 0:
        raise ValueError(f"{what}: expected a tensor with at least one dim to split along dim 0")
    n = g.size()
    rows = _split_rows(t.shape[0], n)
    per_row = math.prod(t.shape[1:])
    src = _contig(t)
    me = g._comm.rank
    res = _check_out(out, t.dtype, (rows[me],) + tuple(t.shape[1:]), what)
    issue = lambda nb: g._comm.reduce_scatter(address(src), address(res), [r * per_row for r in rows], code, o, nb)
    return _run(nonblocking, issue, (src, res), lambda: res)


def reduce_scatter(t, op=ReduceOp.AVG, group=None, *, out=None):
    """Reduces t over the group and returns this rank's block of dim 0 (blocks as in
    torch.tensor_split: the first dim0 % n ranks get one row more). t is not modified; out=
    (contiguous, of the block's shape) receives the result instead of a new tensor."""
    return _reduce_scatter(t, op, group, out, False, "rumor.reduce_scatter")


def reduce_scatter_nonblocking(t, op=ReduceOp.AVG, group=None, *, out=None) -> Handle:
    return _reduce_scatter(t, op, group, out, True, "rumor.reduce_scatter_nonblocking")


# ---- alltoall ----------------------------------------------------------------------------------

def _alltoall(t, splits, group, nonblocking, what):
    # Staged on either GPU transport, so the group need not agree on one first.
    gpu = _device.route(what, group, ("t", t), collective=False)
    if gpu is not None:
        return _gpu().alltoall(gpu, _comm(group, what), t, splits, group, nonblocking, what)
    code, per = check_movable(t, what)
    g = _comm(group, what)
    n = g.size()
    if t.dim() == 0:
        raise ValueError(f"{what}: expected a tensor with at least one dim to split along dim 0")
    if splits is None:
        if t.shape[0] % n != 0:
            raise ValueError(f"{what}: dim 0 ({t.shape[0]}) is not divisible by the group size ({n}); pass splits=")
        splits = [t.shape[0] // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != t.shape[0]:
        raise ValueError(f"{what}: splits must be {n} non-negative row counts summing to {t.shape[0]}, got {splits}")
    send_rows = torch.tensor(splits, dtype=torch.int64)
    recv_rows = torch.empty(n, dtype=torch.int64)
    g._comm.alltoall(address(send_rows), [1] * n, address(recv_rows), [1] * n, 5, False)
    per_row = math.prod(t.shape[1:])
    src = _contig(t)
    out = torch.empty((int(recv_rows.sum()),) + tuple(t.shape[1:]), dtype=t.dtype)
    issue = lambda nb: g._comm.alltoall(address(src), [s * per_row * per for s in splits], address(out),
                                        [int(r) * per_row * per for r in recv_rows], code, nb)
    return _run(nonblocking, issue, (src, out), lambda: out)


def alltoall(t, splits: Optional[Sequence[int]] = None, group=None):
    """Sends splits[i] rows of t (along dim 0) to rank i and returns the rows received, in
    rank order. Without splits, dim 0 is divided evenly."""
    return _alltoall(t, splits, group, False, "rumor.alltoall")


def alltoall_nonblocking(t, splits: Optional[Sequence[int]] = None, group=None) -> Handle:
    return _alltoall(t, splits, group, True, "rumor.alltoall_nonblocking")


# ---- barrier, send, recv -----------------------------------------------------------------------

def barrier(group=None) -> None:
    g = _comm(group, "rumor.barrier")
    g._comm.barrier(False)


def send(t, dst, group=None) -> None:
    """Sends t to global rank dst, which must post a matching rumor.recv."""
    what = "rumor.send"
    # Only two ranks call it: it never starts the group's transport agreement (docs/gpu.md).
    gpu = _device.route(what, group, ("t", t), collective=False)
    if gpu is not None:
        return _gpu().send(gpu, _comm(group, what), t, dst, group, what)
    check_movable(t, what)
    g = _comm(group, what)
    d = _group_rank(g, dst, what, "dst")
    buf = _contig(t)
    g._comm.send(address(buf), buf.numel() * buf.element_size(), d, False)


def recv(t, src, group=None):
    """Receives into t (in place) from global rank src; the sizes must match. Returns t."""
    what = "rumor.recv"
    gpu = _device.route(what, group, ("t", t), collective=False)
    if gpu is not None:
        return _gpu().recv(gpu, _comm(group, what), t, src, group, what)
    check_movable(t, what)
    g = _comm(group, what)
    s = _group_rank(g, src, what, "src")
    buf = _contig(t)
    g._comm.recv(address(buf), buf.numel() * buf.element_size(), s, False)
    if buf.data_ptr() != t.data_ptr():
        t.copy_(buf)
    return t
