"""Bagua's ``bagua.torch_api`` on rumor: ``import rumor.compat.bagua as bagua``.

Process setup (init_process_group, get_rank, ...), ``model.with_bagua([optimizer], algorithm)``
(installed on torch.nn.Module when this module is imported, as Bagua does), the algorithm
classes under their Bagua names (``bagua.algorithms``), and Bagua's functional communication
primitives (send/recv tensors as arguments, ``comm=`` for a group). Names and argument
conventions only: the work is rumor's. What rumor lacks raises NotImplementedError naming the
feature. See docs/compat.md.
"""
from __future__ import annotations

import enum
import os
from typing import List, Optional

import torch

import rumor as _r


from . import algorithms  # noqa: F401
from . import contrib  # noqa: F401


def _missing(feature: str):
    raise NotImplementedError(f"rumor.compat.bagua: {feature} is not available in rumor")


# ---- process group -----------------------------------------------------------------------------

def init_process_group(store=None, rank: int = -1, world_size: int = -1, local_world_size: int = -1) -> None:
    """Joins the job described by the launcher's environment (torchrun) with rumor.init(); does
    nothing more if rumor is already initialized. A custom store, or an explicit rank or size
    that differs from the environment's, is not supported.

    Args:
        store: must be None (the default): rumor meets its peers through the launcher's
            environment.
        rank: this process's rank; -1 (the default) takes RANK from the environment, any other
            value must equal it.
        world_size: the number of processes; -1 (the default) takes WORLD_SIZE, any other value
            must equal it.
        local_world_size: the processes on this machine; -1 (the default) takes
            LOCAL_WORLD_SIZE, any other value must equal it.

    Raises:
        NotImplementedError: a store was given.
        ValueError: rank, world_size or local_world_size differs from the launcher's variable.
    """
    if store is not None:
        _missing("init_process_group(store=...) (rumor rendezvous through the launcher's environment)")
    for arg, var, val in (("rank", "RANK", rank), ("world_size", "WORLD_SIZE", world_size),
                          ("local_world_size", "LOCAL_WORLD_SIZE", local_world_size)):
        if val != -1 and var in os.environ and int(os.environ[var]) != int(val):
            raise ValueError(f"init_process_group: {arg}={val} differs from the launcher's {var}={os.environ[var]}")
    if not _r.is_initialized():
        _r.init()


def is_initialized() -> bool:
    """Whether the job was joined (rumor.is_initialized()).

    Returns:
        A bool.
    """
    return _r.is_initialized()


def get_rank() -> int:
    """This process's global rank, 0 to get_world_size() - 1 (rumor.rank()).

    Returns:
        An int.

    Raises:
        RuntimeError: the job was not joined (call init_process_group() first).
    """
    return _r.rank()


def get_world_size() -> int:
    """The number of processes in the job (rumor.size()).

    Returns:
        An int.

    Raises:
        RuntimeError: the job was not joined (call init_process_group() first).
    """
    return _r.size()


def get_local_rank() -> int:
    """This process's rank among the processes on its machine (rumor.local_rank()).

    Returns:
        An int.

    Raises:
        RuntimeError: the job was not joined (call init_process_group() first).
    """
    return _r.local_rank()


def get_local_size() -> int:
    """The number of processes on this machine (rumor.local_size()).

    Returns:
        An int.

    Raises:
        RuntimeError: the job was not joined (call init_process_group() first).
    """
    return _r.local_size()


def get_node_rank() -> int:
    """The index of this process's machine (rumor.machine_rank()).

    Returns:
        An int.

    Raises:
        RuntimeError: the job was not joined (call init_process_group() first).
    """
    return _r.machine_rank()


def get_backend(model_name: str):
    """Not available: rumor has no counterpart of Bagua's per-model backend object.

    Args:
        model_name: the model's name (Bagua's argument; not used).

    Raises:
        NotImplementedError: always.
    """
    _missing("get_backend (Bagua's Rust backend object)")


class BaguaProcessGroup:
    """A group of global ranks (a rumor.Group underneath); pass it as ``comm=`` or
    ``process_group=``. Made by new_group().

    Args:
        group: the rumor.Group it stands for.

    Attributes:
        ranks: the group's global ranks, in group order.
    """

    def __init__(self, group):
        self._group = group
        self.ranks = list(group.ranks)

    def get_global_communicator(self):
        """The communicator over all of the group's ranks: the group itself, which the functions
        of this module accept as ``comm=``.

        Returns:
            This BaguaProcessGroup.
        """
        return self

    def get_inter_node_communicator(self):
        """Not available: rumor does not expose a group's communicator among one rank per node
        (its hierarchical algorithms build that internally).

        Raises:
            NotImplementedError: always.
        """
        _missing("inter-node communicators of a process group")

    def get_intra_node_communicator(self):
        """Not available: rumor does not expose a group's communicator among the ranks of one
        node (rumor.local_group() is the job-wide one).

        Raises:
            NotImplementedError: always.
        """
        _missing("intra-node communicators of a process group")


def new_group(ranks: Optional[List[int]] = None, stream=None) -> BaguaProcessGroup:
    """Creates a group of global ranks (rumor.new_group()). Every rank calls it, in the same
    order and with the same ranks (as in Bagua and torch), members or not.

    Args:
        ranks: the global ranks of the group, in group order; None (the default) means every
            rank.
        stream: accepted for Bagua compatibility (a CUDA stream there) and not used.

    Returns:
        A BaguaProcessGroup.

    Raises:
        ValueError: ranks is empty, repeats a rank or names one outside the job.
    """
    ranks = list(range(get_world_size())) if ranks is None else list(ranks)
    return BaguaProcessGroup(_r.new_group(ranks))


def _group(comm, what: str):
    if comm is None:
        return None
    if isinstance(comm, BaguaProcessGroup):
        return comm._group
    if isinstance(comm, _r.Group):
        return comm
    raise TypeError(f"{what}: comm must be a group from new_group(), got {type(comm).__name__}")


def _member(comm) -> bool:
    g = _group(comm, "comm")
    return g is None or _r.rank() in g.ranks


# ---- functional communication --------------------------------------------------------------------

class ReduceOp(enum.IntEnum):
    """Bagua's reduction operators, with Bagua's values. SUM, PRODUCT, MIN, MAX and AVG map onto
    rumor.ReduceOp; the bitwise BOR, BAND and BXOR are not available (a function given one
    raises NotImplementedError)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


_OPS = {ReduceOp.SUM: _r.ReduceOp.SUM, ReduceOp.PRODUCT: _r.ReduceOp.PROD, ReduceOp.MIN: _r.ReduceOp.MIN,
        ReduceOp.MAX: _r.ReduceOp.MAX, ReduceOp.AVG: _r.ReduceOp.AVG}


def _op(op):
    try:
        return _OPS[ReduceOp(op)]
    except (KeyError, ValueError):
        _missing(f"ReduceOp {ReduceOp(op).name if op in ReduceOp._value2member_map_ else op} (bitwise reductions)")


def _into(recv: torch.Tensor, result: torch.Tensor, what: str) -> None:
    if recv.numel() != result.numel():
        raise ValueError(f"{what}: recv_tensor has {recv.numel()} elements, expected {result.numel()}")
    recv.copy_(result.reshape(recv.shape))


def send(tensor: torch.Tensor, dst: int, comm=None) -> None:
    """Sends tensor to rank dst, which posts a matching recv() (rumor.send()).

    Args:
        tensor: the tensor to send.
        dst: the receiving global rank.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        _r.send(tensor, dst, _group(comm, "send"))


def recv(tensor: torch.Tensor, src: int, comm=None) -> None:
    """Receives into tensor (in place) what rank src sent with send(); the sizes must match
    (rumor.recv()).

    Args:
        tensor: the tensor that receives.
        src: the sending global rank.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        _r.recv(tensor, src, _group(comm, "recv"))


def broadcast(tensor: torch.Tensor, src: int = 0, comm=None) -> None:
    """In place: every rank's tensor becomes src's.

    Args:
        tensor: the tensor sent (on src) or overwritten (elsewhere).
        src: the global rank whose tensor is broadcast; default 0.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        _r.broadcast_(tensor, src, _group(comm, "broadcast"))


def allreduce(send_tensor, recv_tensor, op=ReduceOp.SUM, comm=None) -> None:
    """recv_tensor receives the reduction of every rank's send_tensor (send_tensor is left as
    it is).

    Args:
        send_tensor: this rank's input; same shape and dtype on every rank.
        recv_tensor: receives the result; as many elements as send_tensor.
        op: a ReduceOp; default ReduceOp.SUM.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        ValueError: recv_tensor's element count differs from send_tensor's.
        NotImplementedError: op is a bitwise reduction (BOR, BAND, BXOR).
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        _into(recv_tensor, _r.allreduce(send_tensor, _op(op), _group(comm, "allreduce")), "allreduce")


def allreduce_inplace(tensor, op=ReduceOp.SUM, comm=None) -> None:
    """In place: tensor becomes the reduction of every rank's tensor.

    Args:
        tensor: this rank's input and the result; same shape and dtype on every rank.
        op: a ReduceOp; default ReduceOp.SUM.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        NotImplementedError: op is a bitwise reduction (BOR, BAND, BXOR).
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        _r.allreduce_(tensor, _op(op), _group(comm, "allreduce_inplace"))


def reduce(send_tensor, recv_tensor, dst: int, op=ReduceOp.SUM, comm=None) -> None:
    """recv_tensor on dst receives the reduction of every rank's send_tensor (elsewhere it is
    left as it is).

    Args:
        send_tensor: this rank's input; same shape and dtype on every rank.
        recv_tensor: on dst, receives the result (as many elements as send_tensor); not read
            elsewhere.
        dst: the global rank that receives the reduction.
        op: a ReduceOp; default ReduceOp.SUM.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        ValueError: on dst, recv_tensor's element count differs from send_tensor's.
        NotImplementedError: op is a bitwise reduction (BOR, BAND, BXOR).
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        out = _r.reduce(send_tensor, dst, _op(op), _group(comm, "reduce"))
        if _r.rank() == dst:
            _into(recv_tensor, out, "reduce")


def reduce_inplace(tensor, dst: int, op=ReduceOp.SUM, comm=None) -> None:
    """On dst, tensor becomes the reduction of every rank's tensor; elsewhere it is left as it
    is.

    Args:
        tensor: this rank's input (and, on dst, the result); same shape and dtype on every
            rank.
        dst: the global rank that receives the reduction.
        op: a ReduceOp; default ReduceOp.SUM.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        NotImplementedError: op is a bitwise reduction (BOR, BAND, BXOR).
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        out = _r.reduce(tensor, dst, _op(op), _group(comm, "reduce_inplace"))
        if _r.rank() == dst:
            tensor.copy_(out)


def _size(comm) -> int:
    g = _group(comm, "comm")
    return _r.size() if g is None else len(g.ranks)


def _index(comm) -> int:
    g = _group(comm, "comm")
    return _r.rank() if g is None else g.ranks.index(_r.rank())


def allgather(send_tensor, recv_tensor, comm=None) -> None:
    """recv_tensor (n times send_tensor's elements) receives every rank's send_tensor in rank order.

    Args:
        send_tensor: this rank's input; the same number of elements on every rank.
        recv_tensor: receives the n inputs, one after the other (n: the group's size).
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        ValueError: recv_tensor does not hold n times send_tensor's elements.
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        out = _r.allgather(send_tensor.reshape(1, -1), _group(comm, "allgather"))
        _into(recv_tensor, out, "allgather")


def allgather_inplace(tensor, comm=None) -> None:
    """tensor holds n equal chunks; this rank's chunk is the input, the others are filled in.

    Args:
        tensor: n equal chunks (n: the group's size), chunk i belonging to the group's i-th
            rank.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        n, me = _size(comm), _index(comm)
        flat = tensor.reshape(n, -1)
        out = _r.allgather(flat[me:me + 1].clone(), _group(comm, "allgather_inplace"))
        _into(tensor, out, "allgather_inplace")


def gather(send_tensor, recv_tensor, dst: int, comm=None) -> None:
    """recv_tensor on dst receives every rank's send_tensor in rank order. It runs as an
    allgather, so every rank of the group exchanges data; only dst writes the result.

    Args:
        send_tensor: this rank's input; the same number of elements on every rank.
        recv_tensor: on dst, receives the n inputs, one after the other (n times send_tensor's
            elements); not read elsewhere.
        dst: the global rank that receives.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        ValueError: on dst, recv_tensor does not hold n times send_tensor's elements.
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        out = _r.allgather(send_tensor.reshape(1, -1), _group(comm, "gather"))
        if _r.rank() == dst:
            _into(recv_tensor, out, "gather")


def gather_inplace(tensor, count: int, dst: int, comm=None) -> None:
    """On dst, the first n * count elements of tensor receive every rank's count elements in
    rank order (dst's own chunk, at its group index, is its input); elsewhere the first count
    elements are the input and tensor is left as it is. Runs as an allgather.

    Args:
        tensor: on dst, at least n * count elements (n: the group's size); elsewhere at least
            count.
        count: the number of elements each rank contributes.
        dst: the global rank that receives.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        n, me = _size(comm), _index(comm)
        flat = tensor.reshape(-1)
        mine = flat[me * count:(me + 1) * count] if _r.rank() == dst else flat[:count]
        out = _r.allgather(mine.reshape(1, -1).clone(), _group(comm, "gather_inplace"))
        if _r.rank() == dst:
            flat[: n * count].copy_(out.reshape(-1))


def scatter(send_tensor, recv_tensor, src: int, comm=None) -> None:
    """src's send_tensor is cut into n equal chunks; rank i's recv_tensor receives chunk i.
    Runs as a broadcast of the whole of send_tensor.

    Args:
        send_tensor: on src, n times recv_tensor's elements (n: the group's size); not read
            elsewhere.
        recv_tensor: receives this rank's chunk; the same number of elements on every rank.
        src: the global rank that scatters.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        n, me = _size(comm), _index(comm)
        full = send_tensor if _r.rank() == src else torch.empty(n * recv_tensor.numel(), dtype=recv_tensor.dtype)
        full = _r.broadcast(full.reshape(-1).contiguous(), src, _group(comm, "scatter"))
        _into(recv_tensor, full.reshape(n, -1)[me], "scatter")


def scatter_inplace(tensor, count: int, src: int, comm=None) -> None:
    """src's tensor holds n chunks of count elements; the first count elements of every rank's
    tensor (src's too) receive the chunk at that rank's group index. Runs as a broadcast of
    the whole tensor.

    Args:
        tensor: n * count elements (n: the group's size) on every rank: the input on src; the
            rest of it is left as it is.
        count: the number of elements each rank receives.
        src: the global rank that scatters.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        me = _index(comm)
        full = _r.broadcast(tensor.reshape(-1).contiguous(), src, _group(comm, "scatter_inplace"))
        tensor.reshape(-1)[:count].copy_(full[me * count:(me + 1) * count])


def reduce_scatter(send_tensor, recv_tensor, op=ReduceOp.SUM, comm=None) -> None:
    """send_tensor holds n equal chunks; recv_tensor receives the reduction, over the ranks, of
    the chunk at this rank's group index.

    Args:
        send_tensor: this rank's input, n equal chunks (n: the group's size).
        recv_tensor: receives the result; one chunk's worth of elements.
        op: a ReduceOp; default ReduceOp.SUM.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        ValueError: recv_tensor does not hold one chunk's worth of elements.
        NotImplementedError: op is a bitwise reduction (BOR, BAND, BXOR).
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        n = _size(comm)
        out = _r.reduce_scatter(send_tensor.reshape(n, -1), _op(op), _group(comm, "reduce_scatter"))
        _into(recv_tensor, out, "reduce_scatter")


def reduce_scatter_inplace(tensor, op=ReduceOp.SUM, comm=None) -> None:
    """tensor holds n equal chunks; the chunk at this rank's group index becomes the reduction,
    over the ranks, of that chunk. The other chunks are left as they are.

    Args:
        tensor: n equal chunks (n: the group's size); the same shape on every rank.
        op: a ReduceOp; default ReduceOp.SUM.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        NotImplementedError: op is a bitwise reduction (BOR, BAND, BXOR).
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        n, me = _size(comm), _index(comm)
        flat = tensor.reshape(n, -1)
        out = _r.reduce_scatter(flat, _op(op), _group(comm, "reduce_scatter_inplace"))
        flat[me].copy_(out.reshape(-1))


def alltoall(send_tensor, recv_tensor, comm=None) -> None:
    """send_tensor's chunk i goes to rank i; recv_tensor's chunk j comes from rank j (ranks
    counted in the group).

    Args:
        send_tensor: n equal chunks (n: the group's size).
        recv_tensor: receives n chunks of the same size; as many elements as send_tensor.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        ValueError: recv_tensor's element count differs from send_tensor's.
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        n = _size(comm)
        out = _r.alltoall(send_tensor.reshape(n, -1), None, _group(comm, "alltoall"))
        _into(recv_tensor, out, "alltoall")


def alltoall_inplace(tensor, comm=None) -> None:
    """In place: tensor's chunk i is sent to rank i and replaced by the chunk rank i sent to
    this rank (ranks counted in the group).

    Args:
        tensor: n equal chunks (n: the group's size).
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        n = _size(comm)
        out = _r.alltoall(tensor.reshape(n, -1).clone(), None, _group(comm, "alltoall_inplace"))
        tensor.copy_(out.reshape(tensor.shape))


def alltoall_v(send_tensor, send_counts, send_displs, recv_tensor, recv_counts, recv_displs, comm=None) -> None:
    """An all-to-all with a size per pair of ranks, as MPI's alltoallv: send_counts[i] elements
    of send_tensor, from offset send_displs[i], go to rank i; the recv_counts[j] elements that
    rank j sends land in recv_tensor from offset recv_displs[j]. Ranks are counted in the group;
    offsets and counts are in elements of the flattened tensors.

    Args:
        send_tensor: the elements to send.
        send_counts: n element counts, one per destination (n: the group's size).
        send_displs: n offsets into send_tensor, one per destination.
        recv_tensor: receives the elements; other positions are left as they are.
        recv_counts: n element counts, one per source; recv_counts[j] must equal rank j's
            send_counts for this rank.
        recv_displs: n offsets into recv_tensor, one per source.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        n = _size(comm)
        s = send_tensor.reshape(-1)
        packed = torch.cat([s[int(send_displs[i]):int(send_displs[i]) + int(send_counts[i])] for i in range(n)])
        out = _r.alltoall(packed, [int(c) for c in send_counts], _group(comm, "alltoall_v"))
        r = recv_tensor.reshape(-1)
        off = 0
        for j in range(n):
            c = int(recv_counts[j])
            r[int(recv_displs[j]):int(recv_displs[j]) + c].copy_(out[off:off + c])
            off += c


def alltoall_v_inplace(tensor, counts, displs, comm=None) -> None:
    """alltoall_v() with one tensor, counts and offsets for both directions: counts[i] elements
    from offset displs[i] go to rank i and are replaced by the counts[i] elements rank i sends
    back. Each pair of ranks therefore exchanges equal counts.

    Args:
        tensor: the elements to send and the place they are received into.
        counts: n element counts, one per rank (n: the group's size).
        displs: n offsets into tensor, one per rank.
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    tmp = tensor.clone()
    alltoall_v(tmp, counts, displs, tensor, counts, displs, comm)


def barrier(comm=None) -> None:
    """Returns once every rank of the group has called it.

    Args:
        comm: a group from new_group() (or a rumor.Group); None (the default) means every
            rank. Ranks outside the group return at once and touch nothing.

    Raises:
        TypeError: comm is not a group from new_group().
        CommTimeoutError: a peer did not take part within rumor's timeout.
        PeerError: a peer failed or left.
    """
    if _member(comm):
        _r.barrier(_group(comm, "barrier"))


# ---- model.with_bagua ----------------------------------------------------------------------------

def _forward_with(module, ddp, original):
    """The module's forward after with_bagua: the wrapper's forward around the module's own, with
    the module's training flag (the user trains and evaluates the module itself)."""
    def forward(*args, **kwargs):
        # After the wrapper's remove_hooks() the module is given back as it was: its own forward.
        if ddp._hooks_removed:
            return original(*args, **kwargs)
        return ddp._run_forward(module.training, original, args, kwargs)

    forward.__wrapped__ = original  # what a later with_bagua wraps again
    return forward


def with_bagua(self, optimizers, algorithm, process_group=None, do_flatten: bool = True):
    """``model = model.with_bagua([optimizer], algorithm)``: as in Bagua, returns the module
    itself (``isinstance``, its attributes and its state_dict keys unchanged), with rumor's
    DistributedDataParallel machinery attached: gradients are averaged by the algorithm (a class
    from bagua.algorithms or any rumor algorithm) exactly as when the wrapper is called, and the
    module's forward does what the wrapper's forward does. ``model.bagua_algorithm``,
    ``model.bagua_optimizers`` and ``model.bagua_module_name`` are set as in Bagua; the rumor
    wrapper is ``model._rumor_ddp``. Keep using the same optimizer object. A module can be given
    to with_bagua once; after ``model._rumor_ddp.remove_hooks()`` its forward is its own again
    (a backward communicates nothing) and it can be given to with_bagua again.

    Args:
        optimizers: one optimizer or a list of at most one (an empty list: none); it is given
            to the wrapper as ``optimizer=``.
        algorithm: a rumor.algorithms.Algorithm, e.g. one of bagua.algorithms' classes.
        process_group: a group from new_group() to train over; None (the default) means every
            rank.
        do_flatten: accepted for Bagua compatibility and not used (rumor's gradients always live
            in flat buckets); default True.

    Returns:
        The module itself (Bagua's documented behaviour), with ``bagua_algorithm``,
        ``bagua_optimizers`` and ``bagua_module_name`` set.

    Raises:
        NotImplementedError: more than one optimizer was given.
        TypeError: algorithm is not a rumor algorithm, or process_group not a group.
        RuntimeError: init_process_group() was not called, or with_bagua was already called on
            this module and its hooks were not removed.
    """
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    optimizers = list(optimizers)
    if len(optimizers) > 1:
        _missing("with_bagua with several optimizers")
    if not isinstance(algorithm, _r.algorithms.Algorithm):
        raise TypeError(f"with_bagua: algorithm must be one of bagua.algorithms' classes, got {type(algorithm).__name__}")
    if not _r.is_initialized():
        raise RuntimeError("with_bagua: call init_process_group() first")
    before = self.__dict__.get("_rumor_ddp")
    if before is not None and not before._hooks_removed:
        raise RuntimeError(f"with_bagua: this {type(self).__name__} was given to with_bagua already "
                           "(call model._rumor_ddp.remove_hooks() first to wrap it again)")
    group = _group(process_group, "with_bagua") if process_group is not None else None
    original = self.__dict__["forward"].__wrapped__ if before is not None else self.forward
    ddp = _r.DistributedDataParallel(self, optimizer=optimizers[0] if optimizers else None,
                                     algorithm=algorithm, group=group)
    # In the instance's __dict__, not as a submodule: the module's state_dict, parameters and
    # children stay what they were (the wrapper holds the module; the module must not hold it
    # as a child in return).
    object.__setattr__(self, "_rumor_ddp", ddp)
    object.__setattr__(self, "forward", _forward_with(self, ddp, original))
    for obj in (self, ddp):  # also reachable from the wrapper, as before
        obj.bagua_algorithm = algorithm
        obj.bagua_optimizers = optimizers
        obj.bagua_module_name = type(self).__name__
    return self


torch.nn.Module.with_bagua = with_bagua
BaguaModule = _r.DistributedDataParallel

# The public names; everything else here is this module's own business.
__all__ = [
    "BaguaModule", "BaguaProcessGroup", "ReduceOp", "allgather", "allgather_inplace",
    "allreduce", "allreduce_inplace", "alltoall", "alltoall_inplace", "alltoall_v",
    "alltoall_v_inplace", "barrier", "broadcast", "gather", "gather_inplace", "get_backend",
    "get_local_rank", "get_local_size", "get_node_rank", "get_rank", "get_world_size",
    "init_process_group", "is_initialized", "new_group", "recv", "reduce", "reduce_inplace",
    "reduce_scatter", "reduce_scatter_inplace", "scatter", "scatter_inplace", "send",
    "with_bagua",
]
