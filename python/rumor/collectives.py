"""Collective and point-to-point operations on torch tensors.

CPU tensors take rumor's own transports; CUDA tensors (all of one call's tensors on the group's
device) go to rumor.gpu.collectives through rumor.gpu.routing, which picks NCCL or host staging
(docs/gpu.md); the CPU implementation is rumor._host_collectives. Ranks (root, src, dst) are global ranks, as in torch.distributed. Reducing operations default
to ReduceOp.AVG, as in Horovod. Non-contiguous tensors are handled (through a contiguous
copy). Every call releases the GIL while the C++ core works.
"""
from __future__ import annotations

from typing import Optional, Sequence

from . import _runtime
from .gpu import routing
from .gpu import collectives as gpu_collectives
from . import _host_collectives as host
from ._host_collectives import ALGORITHMS, Handle, ReduceOp  # noqa: F401 - re-exported: the API's types live below
from ._runtime import communicator


def poll(handle: Handle) -> bool:
    """Whether the nonblocking operation behind handle has finished, without waiting.

    Args:
        handle: a Handle returned by a *_nonblocking call.

    Returns:
        True once handle.wait() would return without blocking.
    """
    return handle.poll()


def synchronize(handle: Optional[Handle] = None, timeout: Optional[float] = None):
    """Waits for a nonblocking operation, or for the GPU work queued without a host wait.

    synchronize(handle) is handle.wait(): the op's result. synchronize() without a handle waits
    until every blocking NCCL call this rank queued without a host wait (rumor.set_gpu_wait("stream"))
    has finished on the GPU, and raises what one of them met; with nothing queued it returns at once.

    Args:
        handle: a Handle or WinHandle from a *_nonblocking call; None (the default) for the queued GPU work.
        timeout: the most seconds to wait; None (the default) means rumor's timeout (rumor.set_timeout).

    Returns:
        The handle's result, or None without a handle.

    Raises:
        TypeError: handle is not a handle, or timeout is not a number.
        CommTimeoutError: the wait ran past timeout.
        PeerError: a peer failed or left.
    """
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
        raise TypeError(f"rumor.synchronize(): timeout must be a number of seconds, got {type(timeout).__name__}")
    if handle is not None:
        if not callable(getattr(handle, "wait", None)):  # a Handle, or a window's WinHandle
            raise TypeError(f"rumor.synchronize(): expected a handle or nothing, got {type(handle).__name__}")
        return handle.wait() if timeout is None else handle.wait(timeout)
    st = _runtime.state()
    routing.drain_all(st, st.timeout if timeout is None else float(timeout), "rumor.synchronize()")
    return None


# ---- allreduce ---------------------------------------------------------------------------------


def _allreduce(t, op, group, inplace, nonblocking, algorithm, what):
    gpu = routing.route(what, group, ("t", t))
    if gpu is not None:
        return gpu_collectives.allreduce(gpu, communicator(group, what), t, op, group, inplace, nonblocking, algorithm, what)
    return host.allreduce(t, op, group, inplace, nonblocking, algorithm, what)


def allreduce(t, op=ReduceOp.AVG, group=None, *, hierarchical=False, algorithm=None):
    """Reduces t over the group and returns the result in a new tensor.

    Args:
        t: the tensor to reduce (CPU, or CUDA on the group's device); same shape and dtype on every rank.
        op: the ReduceOp applied elementwise; default ReduceOp.AVG.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.
        hierarchical: if True (default False), reduce within each host, allreduce among host
            leaders, then broadcast within each host.
        algorithm: the allreduce algorithm by name, one of "auto", "ring",
            "recursive_doubling", "hierarchical"; None (the default) means "hierarchical" when
            hierarchical is set, else "auto".

    Returns:
        A new tensor holding the reduction.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range (an unknown algorithm, a rank not in the group).
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if algorithm is None and not hierarchical:
        out = host.allreduce_plain(t, op, group, False)
        if out is not None:
            return out
    algo = algorithm or ("hierarchical" if hierarchical else "auto")
    return _allreduce(t, op, group, False, False, algo, "rumor.allreduce")


def allreduce_(t, op=ReduceOp.AVG, group=None, *, hierarchical=False, algorithm=None):
    """Reduces t over the group in place: every rank's t ends holding the result.

    Args:
        t: the tensor to reduce (CPU, or CUDA on the group's device); same shape and dtype on every rank.
        op: the ReduceOp applied elementwise; default ReduceOp.AVG.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.
        hierarchical: if True (default False), reduce within each host, allreduce among host
            leaders, then broadcast within each host.
        algorithm: the allreduce algorithm by name, one of "auto", "ring",
            "recursive_doubling", "hierarchical"; None (the default) means "hierarchical" when
            hierarchical is set, else "auto".

    Returns:
        t itself, holding the result.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range (an unknown algorithm, a rank not in the group).
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if algorithm is None and not hierarchical and host.allreduce_plain(t, op, group, True) is not None:
        return t
    algo = algorithm or ("hierarchical" if hierarchical else "auto")
    return _allreduce(t, op, group, True, False, algo, "rumor.allreduce_")


def allreduce_nonblocking(t, op=ReduceOp.AVG, group=None, *, hierarchical=False, algorithm=None) -> Handle:
    """Starts allreduce(t) and returns at once; t must not change until the handle is waited.

    Args:
        t: the tensor to reduce (CPU, or CUDA on the group's device); same shape and dtype on every rank.
        op: the ReduceOp applied elementwise; default ReduceOp.AVG.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.
        hierarchical: if True (default False), reduce within each host, allreduce among host
            leaders, then broadcast within each host.
        algorithm: the allreduce algorithm by name, one of "auto", "ring",
            "recursive_doubling", "hierarchical"; None (the default) means "hierarchical" when
            hierarchical is set, else "auto".

    Returns:
        A Handle; its wait() returns the reduced tensor.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range. Communication errors surface from Handle.wait().
    """
    algo = algorithm or ("hierarchical" if hierarchical else "auto")
    return _allreduce(t, op, group, False, True, algo, "rumor.allreduce_nonblocking")


def allreduce_nonblocking_(t, op=ReduceOp.AVG, group=None, *, hierarchical=False, algorithm=None) -> Handle:
    """Starts allreduce_(t) (in place) and returns at once; t must not be touched until the handle is waited.

    Args:
        t: the tensor to reduce (CPU, or CUDA on the group's device); same shape and dtype on every rank.
        op: the ReduceOp applied elementwise; default ReduceOp.AVG.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.
        hierarchical: if True (default False), reduce within each host, allreduce among host
            leaders, then broadcast within each host.
        algorithm: the allreduce algorithm by name, one of "auto", "ring",
            "recursive_doubling", "hierarchical"; None (the default) means "hierarchical" when
            hierarchical is set, else "auto".

    Returns:
        A Handle; its wait() returns t, reduced in place.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range. Communication errors surface from Handle.wait().
    """
    algo = algorithm or ("hierarchical" if hierarchical else "auto")
    return _allreduce(t, op, group, True, True, algo, "rumor.allreduce_nonblocking_")


# ---- broadcast / reduce ------------------------------------------------------------------------

def _broadcast(t, root, group, inplace, nonblocking, what):
    gpu = routing.route(what, group, ("t", t))
    if gpu is not None:
        return gpu_collectives.broadcast(gpu, communicator(group, what), t, root, group, inplace, nonblocking, what)
    return host.broadcast(t, root, group, inplace, nonblocking, what)


def broadcast(t, root, group=None):
    """Returns root's t on every rank, in a new tensor.

    Args:
        t: the tensor to send (on root) or whose shape and dtype receive (elsewhere).
        root: the global rank whose tensor is broadcast.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.

    Returns:
        A new tensor with root's value.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range (an unknown algorithm, a rank not in the group).
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    return _broadcast(t, root, group, False, False, "rumor.broadcast")


def broadcast_(t, root, group=None):
    """Copies root's t into t on every rank (in place).

    Args:
        t: the tensor to send (on root) or whose shape and dtype receive (elsewhere).
        root: the global rank whose tensor is broadcast.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.

    Returns:
        t, now holding root's value.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range (an unknown algorithm, a rank not in the group).
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    return _broadcast(t, root, group, True, False, "rumor.broadcast_")


def broadcast_nonblocking(t, root, group=None) -> Handle:
    """Starts broadcast(t, root) and returns at once.

    Args:
        t: the tensor to send (on root) or whose shape and dtype receive (elsewhere).
        root: the global rank whose tensor is broadcast.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.

    Returns:
        A Handle whose wait() returns the broadcast tensor.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range. Communication errors surface from Handle.wait().
    """
    return _broadcast(t, root, group, False, True, "rumor.broadcast_nonblocking")


def broadcast_nonblocking_(t, root, group=None) -> Handle:
    """Starts broadcast_(t, root) (in place) and returns at once; t must not be touched until the handle is waited.

    Args:
        t: the tensor to send (on root) or whose shape and dtype receive (elsewhere).
        root: the global rank whose tensor is broadcast.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.

    Returns:
        A Handle whose wait() returns the broadcast tensor.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range. Communication errors surface from Handle.wait().
    """
    return _broadcast(t, root, group, True, True, "rumor.broadcast_nonblocking_")


def _reduce(t, root, op, group, nonblocking, what):
    gpu = routing.route(what, group, ("t", t))
    if gpu is not None:
        return gpu_collectives.reduce(gpu, communicator(group, what), t, root, op, group, nonblocking, what)
    return host.reduce(t, root, op, group, nonblocking, what)


def reduce(t, root, op=ReduceOp.AVG, group=None):
    """On root, returns the reduction of t over the group; elsewhere a copy of t.

    Args:
        t: the tensor to reduce; same shape and dtype on every rank.
        root: the global rank that receives the reduction.
        op: the ReduceOp applied elementwise; default ReduceOp.AVG.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.

    Returns:
        A new tensor: the reduction on root, a copy of t elsewhere.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range (an unknown algorithm, a rank not in the group).
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    return _reduce(t, root, op, group, False, "rumor.reduce")


def reduce_nonblocking(t, root, op=ReduceOp.AVG, group=None) -> Handle:
    """Starts reduce(t, root) and returns at once.

    Args:
        t: the tensor to reduce; must not change until the handle is waited.
        root: the global rank that receives the reduction.
        op: the ReduceOp applied elementwise; default ReduceOp.AVG.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.

    Returns:
        A Handle whose wait() returns what reduce() would.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range. Communication errors surface from Handle.wait().
    """
    return _reduce(t, root, op, group, True, "rumor.reduce_nonblocking")


# ---- allgather ---------------------------------------------------------------------------------


def _allgather(t, group, out, nonblocking, what):
    gpu = routing.route(what, group, ("t", t), ("out", out))
    if gpu is not None:
        return gpu_collectives.allgather(gpu, communicator(group, what), t, group, out, nonblocking, what)
    return host.allgather(t, group, out, nonblocking, what)


def allgather(t, group=None, *, out=None):
    """Concatenates every rank's t along dim 0 (the first dim may differ between ranks).

    Args:
        t: this rank's tensor; the dims after the first and the dtype match on every rank.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.
        out: a contiguous tensor of the concatenated shape that receives the result; None (the
            default) allocates a new one. An out of size() times t's rows on a host's shared
            memory skips the round that compares the ranks' shapes (a small allgather then
            takes one wait); ranks that disagree are still refused on every rank (ProtocolError),
            out then holding this rank's own block and nothing of the others'.

    Returns:
        The concatenation, in rank order (out when given).

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range (an unknown algorithm, a rank not in the group).
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    return _allgather(t, group, out, False, "rumor.allgather")


def allgather_nonblocking(t, group=None, *, out=None) -> Handle:
    """Like allgather; the small shape exchange runs before it returns, the data asynchronously.

    Args:
        t: this rank's tensor; must not change until the handle is waited.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.
        out: a contiguous tensor of the concatenated shape for the result; None (the default)
            allocates one.

    Returns:
        A Handle whose wait() returns the concatenation.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range. Communication errors surface from Handle.wait().
    """
    return _allgather(t, group, out, True, "rumor.allgather_nonblocking")


# ---- reduce_scatter ----------------------------------------------------------------------------


def _reduce_scatter(t, op, group, out, nonblocking, what):
    gpu = routing.route(what, group, ("t", t), ("out", out))
    if gpu is not None:
        return gpu_collectives.reduce_scatter(gpu, communicator(group, what), t, op, group, out, nonblocking, what)
    return host.reduce_scatter(t, op, group, out, nonblocking, what)


def reduce_scatter(t, op=ReduceOp.AVG, group=None, *, out=None):
    """Reduces t over the group and returns this rank's block of dim 0.

    Blocks are as in torch.tensor_split: the first dim0 % n ranks get one row more. t is not modified.

    Args:
        t: the tensor to reduce; same shape and dtype on every rank.
        op: the ReduceOp applied elementwise; default ReduceOp.AVG.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.
        out: a contiguous tensor of the block's shape that receives the result; None (the
            default) allocates a new one.

    Returns:
        This rank's block of the reduction (out when given).

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range (an unknown algorithm, a rank not in the group).
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    return _reduce_scatter(t, op, group, out, False, "rumor.reduce_scatter")


def reduce_scatter_nonblocking(t, op=ReduceOp.AVG, group=None, *, out=None) -> Handle:
    """Starts reduce_scatter(t) and returns at once.

    Args:
        t: the tensor to reduce; must not change until the handle is waited.
        op: the ReduceOp applied elementwise; default ReduceOp.AVG.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.
        out: a contiguous tensor of the block's shape for the result; None (the default)
            allocates one.

    Returns:
        A Handle whose wait() returns this rank's block.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range. Communication errors surface from Handle.wait().
    """
    return _reduce_scatter(t, op, group, out, True, "rumor.reduce_scatter_nonblocking")


# ---- alltoall ----------------------------------------------------------------------------------

def _alltoall(t, splits, group, nonblocking, what):
    gpu = routing.route(what, group, ("t", t), collective=False)
    if gpu is not None:
        return gpu_collectives.alltoall(gpu, communicator(group, what), t, splits, group, nonblocking, what)
    return host.alltoall(t, splits, group, nonblocking, what)


def alltoall(t, splits: Optional[Sequence[int]] = None, group=None):
    """Sends splits[i] rows of t (along dim 0) to rank i and returns the rows received, in rank order.

    Args:
        t: the rows to send, grouped by destination rank.
        splits: how many rows go to each rank of the group (sums to t.shape[0]); None (the
            default) divides dim 0 evenly.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.

    Returns:
        A new tensor with the rows received from every rank, in rank order.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range (an unknown algorithm, a rank not in the group).
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    return _alltoall(t, splits, group, False, "rumor.alltoall")


def alltoall_nonblocking(t, splits: Optional[Sequence[int]] = None, group=None) -> Handle:
    """Starts alltoall(t, splits) and returns at once.

    Args:
        t: the rows to send; must not change until the handle is waited.
        splits: rows per destination rank; None (the default) divides dim 0 evenly.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.

    Returns:
        A Handle whose wait() returns the rows received.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range. Communication errors surface from Handle.wait().
    """
    return _alltoall(t, splits, group, True, "rumor.alltoall_nonblocking")


# ---- barrier, send, recv -----------------------------------------------------------------------

def barrier(group=None) -> None:
    """Returns once every rank of the group has called barrier.

    Args:
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.

    Raises:
        CommTimeoutError: a rank did not arrive within rumor's timeout.
        PeerError: a peer failed or left.
    """
    host.barrier(group, "rumor.barrier")


def send(t, dst, group=None) -> None:
    """Sends t to global rank dst, which must post a matching rumor.recv.

    Args:
        t: the tensor to send.
        dst: the receiving global rank.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range (an unknown algorithm, a rank not in the group).
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    what = "rumor.send"
    # Only two ranks call it: it never starts the group's transport agreement (docs/gpu.md).
    gpu = routing.route(what, group, ("t", t), collective=False)
    if gpu is not None:
        return gpu_collectives.send(gpu, communicator(group, what), t, dst, group, what)
    return host.send(t, dst, group, what)


def recv(t, src, group=None):
    """Receives into t (in place) from global rank src; the sizes must match.

    Args:
        t: the tensor that receives; its size matches what src sends.
        src: the sending global rank.
        group: the Group to run over (rumor.new_group()); None (the default) means every rank.

    Returns:
        t.

    Raises:
        TypeError: t is not a tensor or its dtype is not supported.
        ValueError: an argument is out of range (an unknown algorithm, a rank not in the group).
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    what = "rumor.recv"
    gpu = routing.route(what, group, ("t", t), collective=False)
    if gpu is not None:
        return gpu_collectives.recv(gpu, communicator(group, what), t, src, group, what)
    return host.recv(t, src, group, what)
