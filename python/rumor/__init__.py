"""rumor: data-parallel training acceleration for PyTorch with a C++ communication core."""
from ._runtime import (  # noqa: F401
    Group,
    init,
    is_initialized,
    local_rank,
    local_size,
    machine_rank,
    machine_size,
    new_group,
    rank,
    shutdown,
    size,
)
from .collectives import (  # noqa: F401
    Handle,
    ReduceOp,
    allgather,
    allgather_nonblocking,
    allreduce,
    allreduce_,
    allreduce_nonblocking,
    allreduce_nonblocking_,
    alltoall,
    alltoall_nonblocking,
    barrier,
    broadcast,
    broadcast_,
    broadcast_nonblocking,
    broadcast_nonblocking_,
    poll,
    recv,
    reduce,
    reduce_nonblocking,
    reduce_scatter,
    reduce_scatter_nonblocking,
    send,
    synchronize,
)
from . import algorithms  # noqa: F401
from . import compression  # noqa: F401
from .parallel import DistributedDataParallel  # noqa: F401
from .errors import AbortedError, CommTimeoutError, PeerError, ProtocolError, RumorError  # noqa: F401

__version__ = "0.1.0"
