"""The CPU implementation of the collectives: rumor's own transports (shared memory, TCP) on
host tensors, and the checks and helpers every path shares. The front door (rumor.collectives)
routes CUDA tensors to rumor.gpu.collectives first; that path stages through these functions
when NCCL is not used. Ranks are global ranks; `what` names the public call in errors."""
from __future__ import annotations

import enum
import math
from typing import Callable, List, Optional

import torch

from . import _C, _runtime
from ._runtime import Group, communicator
from ._tensor import SUPPORTED_DTYPES, address, check_dense, check_movable, check_tensor, dtype_tag, reduce_code

class ReduceOp(enum.IntEnum):
    """How a reducing collective combines the ranks' values, elementwise.

    SUM, AVG (the sum divided by the number of ranks; the default of rumor's collectives, as in
    Horovod), MIN, MAX, PROD. An IntEnum: the value is the code the C++ core takes.
    """
    SUM = 0
    AVG = 1
    MIN = 2
    MAX = 3
    PROD = 4


ALGORITHMS = {"auto": 0, "ring": 1, "recursive_doubling": 2, "hierarchical": 3}


class Handle:
    """The result of a *_nonblocking call. wait() (or rumor.synchronize(h)) returns the result.

    Made by rumor's nonblocking calls, not by users.

    Args:
        work: the C++ core's work item (None when the op finished at once).
        keep: the buffers the C++ side reads or writes until it is done, kept alive here.
        finish: called once after the work finished; its return value is the result.
    """

    def __init__(self, work, keep: tuple, finish: Callable[[], torch.Tensor]):
        self._work = work
        self._keep = keep  # buffers the C++ side reads or writes until it is done
        self._finish = finish
        self._result = None
        self._done = False

    def poll(self) -> bool:
        """Whether the operation finished, without waiting.

        Returns:
            True once wait() would return without blocking.
        """
        return self._done or self._work is None or self._work.done()

    def wait(self, timeout: Optional[float] = None) -> torch.Tensor:
        """Waits for the operation and returns its result (again on later calls).

        Args:
            timeout: a guard, in seconds, against a lost wakeup; None (the default) uses 64 times
                rumor's timeout. The op itself ends at rumor's timeout.

        Returns:
            The operation's result tensor.

        Raises:
            CommTimeoutError: a peer did not take part within rumor's timeout.
            PeerError: a peer failed or left.
        """
        if not self._done:
            if self._work is not None:
                # The op carries its own deadline; this one only guards against a lost wakeup.
                self._work.wait(timeout if timeout is not None else _runtime.state().timeout * 64)
            self._result = self._finish()
            self._done = True
            self._keep = ()
        return self._result


def op_code(op, what: str) -> int:
    if type(op) is ReduceOp:  # the usual argument: no enum lookup (a small collective's Python is ~µs)
        return int(op)
    try:
        return int(ReduceOp(op))
    except ValueError:
        raise ValueError(f"{what}: unknown reduce op {op!r}; use rumor.ReduceOp") from None


def group_rank(g: Group, global_rank: int, what: str, role: str) -> int:
    try:
        return g.ranks.index(int(global_rank))
    except ValueError:
        raise ValueError(f"{what}: {role} {global_rank} is not a member of {g!r}") from None


def run(nonblocking: bool, issue, keep: tuple, finish: Callable[[], torch.Tensor]):
    work = issue(nonblocking)
    h = Handle(work, keep, finish)
    return h if nonblocking else h.wait()


def contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def blocking_result(t: torch.Tensor, buf: torch.Tensor, inplace: bool) -> torch.Tensor:
    """What a call returns once buf holds the result: t itself when in place (a non-contiguous t
    gets buf's values back), else buf."""
    if not inplace:
        return buf
    if buf is not t:  # t was not contiguous: buf is its contiguous copy
        t.copy_(buf)
    return t


_TENSOR = torch.Tensor
_STRIDED = torch.strided


def allreduce_plain(t, op, group, inplace: bool):
    """The blocking allreduce of the usual call (a plain contiguous CPU tensor of a reducible dtype,
    a ReduceOp, the world or a Group) with the fewest Python steps: returns the result (t itself
    in place), or None, having done nothing, for anything else (the general path then checks and
    runs it).

    Why: with more ranks than cores every rank must run once per small collective, each after a
    context switch, and there the Python before the C++ call costs several times its warm time:
    4 ranks on 2 cores, 4 KiB, the general path's Python was ~17 us of CPU per op per rank.
    """
    if (type(t) is not _TENSOR or type(op) is not ReduceOp or not t.is_cpu or t.layout is not _STRIDED
            or not t.is_contiguous()):
        return None
    code = reduce_code(t.dtype)
    if code is None:
        return None
    if group is None:
        st = _runtime.current()
        if st is None:
            return None
        group = st.world
    elif type(group) is not Group:
        return None
    comm = group._comm
    if comm is None:
        return None
    if inplace:
        comm.allreduce(t.data_ptr(), t.numel(), code, op, 0, False)  # 0: ALGORITHMS["auto"]
        return t
    out = torch.empty_like(t)
    comm.allreduce_into(t.data_ptr(), out.data_ptr(), t.numel(), code, op, 0, False)
    return out


def allreduce(t, op, group, inplace, nonblocking, algorithm, what):
    code = check_tensor(t, what)
    g = communicator(group, what)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{what}: algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    o = op_code(op, what)
    a = ALGORITHMS[algorithm]
    if inplace:
        buf = contig(t)
        if not nonblocking:
            # No Handle, no closures: a 4 KiB allreduce on one host takes a few µs in C++, and the
            # general path's Python doubled it.
            g._comm.allreduce(address(buf), buf.numel(), code, o, a, False)
            return blocking_result(t, buf, inplace)
        issue = lambda nb: g._comm.allreduce(address(buf), buf.numel(), code, o, a, nb)
        return run(nonblocking, issue, (buf, t), lambda: blocking_result(t, buf, inplace))
    # Out of place, the core reads the input where it is: on one host's direct path that spares
    # the copy a clone made first (as many bytes as the allreduce's own bound); elsewhere the core
    # copies it into the result.
    src = contig(t)
    buf = torch.empty_like(src, memory_format=torch.contiguous_format)
    if not nonblocking:
        g._comm.allreduce_into(address(src), address(buf), buf.numel(), code, o, a, False)
        return buf
    issue = lambda nb: g._comm.allreduce_into(address(src), address(buf), buf.numel(), code, o, a, nb)
    return run(nonblocking, issue, (buf, src, t), lambda: buf)


def broadcast(t, root, group, inplace, nonblocking, what):
    code, per = check_movable(t, what)
    g = communicator(group, what)
    r = group_rank(g, root, what, "root")
    buf = contig(t) if inplace else t.clone(memory_format=torch.contiguous_format)
    if not nonblocking:  # as allreduce's
        g._comm.broadcast(address(buf), buf.numel() * per, code, r, False)
        return blocking_result(t, buf, inplace)
    issue = lambda nb: g._comm.broadcast(address(buf), buf.numel() * per, code, r, nb)
    finish = lambda: blocking_result(t, buf, inplace)
    return run(nonblocking, issue, (buf, t), finish)


def reduce(t, root, op, group, nonblocking, what):
    code = check_tensor(t, what)
    g = communicator(group, what)
    r = group_rank(g, root, what, "root")
    o = op_code(op, what)
    buf = t.contiguous().clone()
    scratch_ok = g._comm.rank == r
    issue = lambda nb: g._comm.reduce(address(buf), buf.numel(), code, o, r, nb)
    # Only the root's buffer holds the reduction; elsewhere the input is returned unchanged.
    finish = (lambda: buf) if scratch_ok else (lambda: t.clone())
    return run(nonblocking, issue, (buf, t), finish)


MAX_DIMS = 8


def gather_shapes(t: torch.Tensor, tag: int, g: Group, what: str) -> List[tuple]:
    """Every rank's shape, gathered so all ranks can check them and raise the same error."""
    if t.dim() > MAX_DIMS:
        raise ValueError(f"{what}: tensors of more than {MAX_DIMS} dims are not supported")
    n = g.size()
    meta = torch.zeros(n, MAX_DIMS + 2, dtype=torch.int64)
    # Written and read through a numpy view: a torch indexing op per field cost ~150 us a call,
    # ten times the small allgather itself.
    view = meta.numpy()
    view[g._comm.rank, : 2 + t.dim()] = (t.dim(), tag, *t.shape)
    g._comm.allgather(address(meta), [MAX_DIMS + 2] * n, 5, False)
    shapes = []
    for r, row in enumerate(view.tolist()):
        d, c = row[0], row[1]
        if c != tag:
            raise TypeError(f"{what}: rank {g.ranks[r]} passed a tensor of another dtype than {t.dtype} "
                            f"(dtype tag {c} vs {tag})")
        shapes.append(tuple(row[2 : 2 + d]))
    return shapes


def gather_rows(t: torch.Tensor, g: Group, what: str):
    """(every rank's row count, the shared trailing shape) of an allgather of t (at least 1-D)."""
    shapes = gather_shapes(t, dtype_tag(t.dtype), g, what)
    tail = shapes[g._comm.rank][1:]
    for r, s in enumerate(shapes):
        if len(s) != len(tail) + 1 or s[1:] != tail:
            raise ValueError(
                f"{what}: all dims but the first must match across ranks; rank {g.ranks[r]} has "
                f"shape {list(s)}, rank {g.ranks[g._comm.rank]} has {list(t.shape)}")
    return [s[0] for s in shapes], tail


def even_rows(t, out, g: Group, code: int, per: int) -> Optional[List[int]]:
    """Every rank's row count without a round of its own, where that is safe: `out` sized for n
    equal blocks of t's shape (so, if every rank's out is right, every rank has t's rows), a dtype
    with its own code, and a path that refuses ranks whose block sizes or dtype differ before any
    buffer is touched (Communicator.allgather_checks_blocks: the shared slots). A small allgather
    then costs one wait, not two. None: gather the shapes first."""
    # A dtype without its own code (bool, complex...) moves as bytes: the slots could not tell it
    # from uint8.
    if not isinstance(out, torch.Tensor) or per != 1 or t.dtype not in SUPPORTED_DTYPES or out.dtype != t.dtype:
        return None
    n, d = g.size(), t.dim()
    if d != out.dim() or t.numel() == 0:
        return None
    # 1-D (the common case) by element counts: torch.Size slices cost microseconds here.
    if out.numel() != n * t.numel() or (d > 1 and (out.shape[0] != n * t.shape[0] or out.shape[1:] != t.shape[1:])):
        return None
    return [t.shape[0]] * n if g._comm.allgather_checks_blocks([t.numel()] * n, code) else None


def allgather(t, group, out, nonblocking, what):
    code, per = check_movable(t, what)
    g = communicator(group, what)
    if t.dim() == 0:
        t = t.reshape(1)
    rows = even_rows(t, out, g, code, per)
    if rows is not None:
        tail = tuple(t.shape[1:])
    else:
        rows, tail = gather_rows(t, g, what)
    per_row = math.prod(tail)
    out = check_out(out, t.dtype, (sum(rows),) + tuple(tail), what)
    start = sum(rows[: g._comm.rank])
    counts = [r_ * per_row * per for r_ in rows]
    if not nonblocking and t.is_contiguous():
        # The core reads this rank's block where it is (one host's direct path: no copy into out
        # first, a third of a two-rank allgather's bytes) or copies it into place.
        g._comm.allgather(address(out), counts, code, False, address(t))
        return out
    if t.is_contiguous() and not t.requires_grad:
        # libc's copy by address: a slice and copy_ cost 2.4 us, most of a 4 KiB allgather's Python.
        es = t.element_size()
        _C.copy_bytes(address(out) + start * per_row * es, address(t), t.numel() * es)
    else:
        out[start : start + rows[g._comm.rank]].copy_(t)
    if not nonblocking:  # as allreduce's
        g._comm.allgather(address(out), counts, code, False)
        return out
    issue = lambda nb: g._comm.allgather(address(out), counts, code, nb)
    return run(nonblocking, issue, (out,), lambda: out)


def split_rows(rows: int, n: int) -> List[int]:
    return [rows // n + (1 if i < rows % n else 0) for i in range(n)]


def check_out(out, dtype, shape, what, device=None):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    # The caller routed out together with the input (rumor.gpu.routing): it is on their device.
    check_dense(out, what)
    if out.dtype != dtype or tuple(out.shape) != tuple(shape) or not out.is_contiguous():
        raise ValueError(f"{what}: out must be a contiguous {dtype} tensor of shape {list(shape)}, "
                         f"got {out.dtype} {list(out.shape)}{'' if out.is_contiguous() else ' (non-contiguous)'}")
    return out


def reduce_scatter(t, op, group, out, nonblocking, what):
    code = check_tensor(t, what)
    g = communicator(group, what)
    o = op_code(op, what)
    if t.dim() == 0:
        raise ValueError(f"{what}: expected a tensor with at least one dim to split along dim 0")
    n = g.size()
    rows = split_rows(t.shape[0], n)
    per_row = math.prod(t.shape[1:])
    src = contig(t)
    me = g._comm.rank
    res = check_out(out, t.dtype, (rows[me],) + tuple(t.shape[1:]), what)
    counts = [r * per_row for r in rows]
    if not nonblocking:  # as allreduce's
        g._comm.reduce_scatter(address(src), address(res), counts, code, o, False)
        return res
    issue = lambda nb: g._comm.reduce_scatter(address(src), address(res), counts, code, o, nb)
    return run(nonblocking, issue, (src, res), lambda: res)


def alltoall(t, splits, group, nonblocking, what):
    # Staged on either GPU transport, so the group need not agree on one first.
    code, per = check_movable(t, what)
    g = communicator(group, what)
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
    src = contig(t)
    out = torch.empty((int(recv_rows.sum()),) + tuple(t.shape[1:]), dtype=t.dtype)
    issue = lambda nb: g._comm.alltoall(address(src), [s * per_row * per for s in splits], address(out),
                                        [int(r) * per_row * per for r in recv_rows], code, nb)
    return run(nonblocking, issue, (src, out), lambda: out)


def barrier(group, what: str) -> None:
    g = communicator(group, what)
    g._comm.barrier(False)


def send(t, dst, group, what: str) -> None:
    check_movable(t, what)
    g = communicator(group, what)
    d = group_rank(g, dst, what, "dst")
    buf = contig(t)
    g._comm.send(address(buf), buf.numel() * buf.element_size(), d, False)


def recv(t, src, group, what: str):
    check_movable(t, what)
    g = communicator(group, what)
    s = group_rank(g, src, what, "src")
    buf = contig(t)
    g._comm.recv(address(buf), buf.numel() * buf.element_size(), s, False)
    if buf.data_ptr() != t.data_ptr():
        t.copy_(buf)
    return t
