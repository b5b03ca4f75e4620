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
    gpu = routing.route(what, group, ("t", t))
    if gpu is not None:
        return gpu_collectives.broadcast(gpu, communicator(group, what), t, root, group, inplace, nonblocking, what)
    return host.broadcast(t, root, group, inplace, nonblocking, what)


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
    gpu = routing.route(what, group, ("t", t))
    if gpu is not None:
        return gpu_collectives.reduce(gpu, communicator(group, what), t, root, op, group, nonblocking, what)
    return host.reduce(t, root, op, group, nonblocking, what)


def reduce(t, root, op=ReduceOp.AVG, group=None):
    """On root, returns the reduction of t over the group; elsewhere a copy of t."""
    return _reduce(t, root, op, group, False, "rumor.reduce")


def reduce_nonblocking(t, root, op=ReduceOp.AVG, group=None) -> Handle:
    return _reduce(t, root, op, group, True, "rumor.reduce_nonblocking")


# ---- allgather ---------------------------------------------------------------------------------


def _allgather(t, group, out, nonblocking, what):
    gpu = routing.route(what, group, ("t", t), ("out", out))
    if gpu is not None:
        return gpu_collectives.allgather(gpu, communicator(group, what), t, group, out, nonblocking, what)
    return host.allgather(t, group, out, nonblocking, what)


def allgather(t, group=None, *, out=None):
    """Concatenates every rank's t along dim 0 (the first dim may differ between ranks).
    out= (contiguous, of the concatenated shape) receives the result instead of a new tensor."""
    return _allgather(t, group, out, False, "rumor.allgather")


def allgather_nonblocking(t, group=None, *, out=None) -> Handle:
    """Like allgather; the small shape exchange runs before it returns, the data asynchronously."""
    return _allgather(t, group, out, True, "rumor.allgather_nonblocking")


# ---- reduce_scatter ----------------------------------------------------------------------------


def _reduce_scatter(t, op, group, out, nonblocking, what):
    gpu = routing.route(what, group, ("t", t), ("out", out))
    if gpu is not None:
        return gpu_collectives.reduce_scatter(gpu, communicator(group, what), t, op, group, out, nonblocking, what)
    return host.reduce_scatter(t, op, group, out, nonblocking, what)


def reduce_scatter(t, op=ReduceOp.AVG, group=None, *, out=None):
    """Reduces t over the group and returns this rank's block of dim 0 (blocks as in
    torch.tensor_split: the first dim0 % n ranks get one row more). t is not modified; out=
    (contiguous, of the block's shape) receives the result instead of a new tensor."""
    return _reduce_scatter(t, op, group, out, False, "rumor.reduce_scatter")


def reduce_scatter_nonblocking(t, op=ReduceOp.AVG, group=None, *, out=None) -> Handle:
    return _reduce_scatter(t, op, group, out, True, "rumor.reduce_scatter_nonblocking")


# ---- alltoall ----------------------------------------------------------------------------------

def _alltoall(t, splits, group, nonblocking, what):
    gpu = routing.route(what, group, ("t", t), collective=False)
    if gpu is not None:
        return gpu_collectives.alltoall(gpu, communicator(group, what), t, splits, group, nonblocking, what)
    return host.alltoall(t, splits, group, nonblocking, what)


def alltoall(t, splits: Optional[Sequence[int]] = None, group=None):
    """Sends splits[i] rows of t (along dim 0) to rank i and returns the rows received, in
    rank order. Without splits, dim 0 is divided evenly."""
    return _alltoall(t, splits, group, False, "rumor.alltoall")


def alltoall_nonblocking(t, splits: Optional[Sequence[int]] = None, group=None) -> Handle:
    return _alltoall(t, splits, group, True, "rumor.alltoall_nonblocking")


# ---- barrier, send, recv -----------------------------------------------------------------------

def barrier(group=None) -> None:
    host.barrier(group, "rumor.barrier")


def send(t, dst, group=None) -> None:
    """Sends t to global rank dst, which must post a matching rumor.recv."""
    what = "rumor.send"
    # Only two ranks call it: it never starts the group's transport agreement (docs/gpu.md).
    gpu = routing.route(what, group, ("t", t), collective=False)
    if gpu is not None:
        return gpu_collectives.send(gpu, communicator(group, what), t, dst, group, what)
    return host.send(t, dst, group, what)


def recv(t, src, group=None):
    """Receives into t (in place) from global rank src; the sizes must match. Returns t."""
    what = "rumor.recv"
    gpu = routing.route(what, group, ("t", t), collective=False)
    if gpu is not None:
        return gpu_collectives.recv(gpu, communicator(group, what), t, src, group, what)
    return host.recv(t, src, group, what)
