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
import time
from typing import List, Optional

import torch

import rumor as _r

from ... import timeline
from ...engine.buckets import coalesced_broadcast

from . import algorithms  # noqa: F401
from . import contrib  # noqa: F401


def _missing(feature: str):
    raise NotImplementedError(f"rumor.compat.bagua: {feature} is not available in rumor")


# ---- process group -----------------------------------------------------------------------------

def init_process_group(store=None, rank: int = -1, world_size: int = -1, local_world_size: int = -1) -> None:
    """Joins the job described by the launcher's environment (torchrun). A custom store, or an
    explicit rank / world size that differ from the environment's, are not supported."""
    if store is not None:
        _missing("init_process_group(store=...) (rumor rendezvous through the launcher's environment)")
    for arg, var, val in (("rank", "RANK", rank), ("world_size", "WORLD_SIZE", world_size),
                          ("local_world_size", "LOCAL_WORLD_SIZE", local_world_size)):
        if val != -1 and var in os.environ and int(os.environ[var]) != int(val):
            raise ValueError(f"init_process_group: {arg}={val} differs from the launcher's {var}={os.environ[var]}")
    if not _r.is_initialized():
        _r.init()


def is_initialized() -> bool:
    return _r.is_initialized()


def get_rank() -> int:
    return _r.rank()


def get_world_size() -> int:
    return _r.size()


def get_local_rank() -> int:
    return _r.local_rank()


def get_local_size() -> int:
    return _r.local_size()


def get_node_rank() -> int:
    return _r.machine_rank()


def get_backend(model_name: str):
    _missing("get_backend (Bagua's Rust backend object)")


class BaguaProcessGroup:
    """A group of global ranks (a rumor.Group underneath); pass it as ``comm=`` or
    ``process_group=``."""

    def __init__(self, group):
        self._group = group
        self.ranks = list(group.ranks)

    def get_global_communicator(self):
        return self

    def get_inter_node_communicator(self):
        _missing("inter-node communicators of a process group")

    def get_intra_node_communicator(self):
        _missing("intra-node communicators of a process group")


def new_group(ranks: Optional[List[int]] = None, stream=None) -> BaguaProcessGroup:
    """Every rank calls it, in the same order (as in Bagua and torch)."""
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
    if _member(comm):
        _r.send(tensor, dst, _group(comm, "send"))


def recv(tensor: torch.Tensor, src: int, comm=None) -> None:
    if _member(comm):
        _r.recv(tensor, src, _group(comm, "recv"))


def broadcast(tensor: torch.Tensor, src: int = 0, comm=None) -> None:
    """In place: every rank's tensor becomes src's."""
    if _member(comm):
        _r.broadcast_(tensor, src, _group(comm, "broadcast"))


def allreduce(send_tensor, recv_tensor, op=ReduceOp.SUM, comm=None) -> None:
    if _member(comm):
        _into(recv_tensor, _r.allreduce(send_tensor, _op(op), _group(comm, "allreduce")), "allreduce")


def allreduce_inplace(tensor, op=ReduceOp.SUM, comm=None) -> None:
    if _member(comm):
        _r.allreduce_(tensor, _op(op), _group(comm, "allreduce_inplace"))


def reduce(send_tensor, recv_tensor, dst: int, op=ReduceOp.SUM, comm=None) -> None:
    """recv_tensor on dst receives the reduction (elsewhere it is left as it is)."""
    if _member(comm):
        out = _r.reduce(send_tensor, dst, _op(op), _group(comm, "reduce"))
        if _r.rank() == dst:
            _into(recv_tensor, out, "reduce")


def reduce_inplace(tensor, dst: int, op=ReduceOp.SUM, comm=None) -> None:
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
    """recv_tensor (n times send_tensor's elements) receives every rank's send_tensor in rank order."""
    if _member(comm):
        out = _r.allgather(send_tensor.reshape(1, -1), _group(comm, "allgather"))
        _into(recv_tensor, out, "allgather")


def allgather_inplace(tensor, comm=None) -> None:
    """tensor holds n equal chunks; this rank's chunk is the input, the others are filled in."""
    if _member(comm):
        n, me = _size(comm), _index(comm)
        flat = tensor.reshape(n, -1)
        out = _r.allgather(flat[me:me + 1].clone(), _group(comm, "allgather_inplace"))
        _into(tensor, out, "allgather_inplace")


def gather(send_tensor, recv_tensor, dst: int, comm=None) -> None:
    """recv_tensor on dst receives every rank's send_tensor in rank order (an allgather)."""
    if _member(comm):
        out = _r.allgather(send_tensor.reshape(1, -1), _group(comm, "gather"))
        if _r.rank() == dst:
            _into(recv_tensor, out, "gather")


def gather_inplace(tensor, count: int, dst: int, comm=None) -> None:
    if _member(comm):
        n, me = _size(comm), _index(comm)
        flat = tensor.reshape(-1)
        mine = flat[me * count:(me + 1) * count] if _r.rank() == dst else flat[:count]
        out = _r.allgather(mine.reshape(1, -1).clone(), _group(comm, "gather_inplace"))
        if _r.rank() == dst:
            flat[: n * count].copy_(out.reshape(-1))


def scatter(send_tensor, recv_tensor, src: int, comm=None) -> None:
    """src's send_tensor is cut into n equal chunks; rank i's recv_tensor receives chunk i."""
    if _member(comm):
        n, me = _size(comm), _index(comm)
        full = send_tensor if _r.rank() == src else torch.empty(n * recv_tensor.numel(), dtype=recv_tensor.dtype)
        full = _r.broadcast(full.reshape(-1).contiguous(), src, _group(comm, "scatter"))
        _into(recv_tensor, full.reshape(n, -1)[me], "scatter")


def scatter_inplace(tensor, count: int, src: int, comm=None) -> None:
    if _member(comm):
        me = _index(comm)
        full = _r.broadcast(tensor.reshape(-1).contiguous(), src, _group(comm, "scatter_inplace"))
        tensor.reshape(-1)[:count].copy_(full[me * count:(me + 1) * count])


def reduce_scatter(send_tensor, recv_tensor, op=ReduceOp.SUM, comm=None) -> None:
    """send_tensor holds n equal chunks; recv_tensor receives the reduction of chunk (this rank)."""
    if _member(comm):
        n = _size(comm)
        out = _r.reduce_scatter(send_tensor.reshape(n, -1), _op(op), _group(comm, "reduce_scatter"))
        _into(recv_tensor, out, "reduce_scatter")


def reduce_scatter_inplace(tensor, op=ReduceOp.SUM, comm=None) -> None:
    if _member(comm):
        n, me = _size(comm), _index(comm)
        flat = tensor.reshape(n, -1)
        out = _r.reduce_scatter(flat, _op(op), _group(comm, "reduce_scatter_inplace"))
        flat[me].copy_(out.reshape(-1))


def alltoall(send_tensor, recv_tensor, comm=None) -> None:
    """send_tensor's chunk i goes to rank i; recv_tensor's chunk j comes from rank j."""
    if _member(comm):
        n = _size(comm)
        out = _r.alltoall(send_tensor.reshape(n, -1), None, _group(comm, "alltoall"))
        _into(recv_tensor, out, "alltoall")


def alltoall_inplace(tensor, comm=None) -> None:
    if _member(comm):
        n = _size(comm)
        out = _r.alltoall(tensor.reshape(n, -1).clone(), None, _group(comm, "alltoall_inplace"))
        tensor.copy_(out.reshape(tensor.shape))


def alltoall_v(send_tensor, send_counts, send_displs, recv_tensor, recv_counts, recv_displs, comm=None) -> None:
    """Element counts and displacements per rank, as in MPI's alltoallv."""
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
    tmp = tensor.clone()
    alltoall_v(tmp, counts, displs, tensor, counts, displs, comm)


def barrier(comm=None) -> None:
    if _member(comm):
        _r.barrier(_group(comm, "barrier"))


# ---- model.with_bagua ----------------------------------------------------------------------------

def _forward_with(module, ddp, original):
    """The module's forward after with_bagua: what rumor.DistributedDataParallel.forward does
    around the module (the autotuner's tick, the buffer broadcast, the algorithm's
    before_forward, the forward's timings), with the module's own forward in the middle. The
    module's training flag decides, since the user trains and evaluates the module itself."""
    def forward(*args, **kwargs):
        training = module.training and torch.is_grad_enabled()
        if ddp._autotuner is not None and training:
            ddp._autotuner.before_forward()
        start = time.monotonic()
        if ddp.broadcast_buffers and training and ddp._buffers_to_sync:
            coalesced_broadcast(ddp._buffers_to_sync, ddp.group)
        ddp.algorithm.before_forward(ddp)
        module_start = time.monotonic()
        out = original(*args, **kwargs)
        ddp._forward_times = (start, module_start, time.monotonic())
        if timeline._on:
            timeline._span_s("forward", "phase", start, ddp._forward_times[2])
        return out

    return forward


def with_bagua(self, optimizers, algorithm, process_group=None, do_flatten: bool = True):
    """``model = model.with_bagua([optimizer], algorithm)``: as in Bagua, returns the module
    itself (``isinstance``, its attributes and its state_dict keys unchanged), with rumor's
    DistributedDataParallel machinery attached: gradients are averaged by the algorithm (a class
    from bagua.algorithms or any rumor algorithm) exactly as when the wrapper is called, and the
    module's forward does what the wrapper's forward does. ``model.bagua_algorithm``,
    ``model.bagua_optimizers`` and ``model.bagua_module_name`` are set as in Bagua; the rumor
    wrapper is ``model._rumor_ddp``. Keep using the same optimizer object. A module can be given
    to with_bagua once."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    optimizers = list(optimizers)
    if len(optimizers) > 1:
        _missing("with_bagua with several optimizers")
    if not isinstance(algorithm, _r.algorithms.Algorithm):
        raise TypeError(f"with_bagua: algorithm must be one of bagua.algorithms' classes, got {type(algorithm).__name__}")
    if not _r.is_initialized():
        raise RuntimeError("with_bagua: call init_process_group() first")
    if "_rumor_ddp" in self.__dict__:
        raise RuntimeError(f"with_bagua: this {type(self).__name__} was given to with_bagua already")
    group = _group(process_group, "with_bagua") if process_group is not None else None
    ddp = _r.DistributedDataParallel(self, optimizer=optimizers[0] if optimizers else None,
                                     algorithm=algorithm, group=group)
    # In the instance's __dict__, not as a submodule: the module's state_dict, parameters and
    # children stay what they were (the wrapper holds the module; the module must not hold it
    # as a child in return).
    object.__setattr__(self, "_rumor_ddp", ddp)
    object.__setattr__(self, "forward", _forward_with(self, ddp, self.forward))
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
