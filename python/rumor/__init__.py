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
from . import optim  # noqa: F401
from . import compression  # noqa: F401
from . import topology  # noqa: F401
from .decentralized import (  # noqa: F401
    hierarchical_neighbor_allreduce,
    hierarchical_neighbor_allreduce_nonblocking,
    in_neighbor_machine_ranks,
    in_neighbor_ranks,
    load_machine_topology,
    load_topology,
    neighbor_allgather,
    neighbor_allgather_nonblocking,
    neighbor_allreduce,
    neighbor_allreduce_nonblocking,
    out_neighbor_machine_ranks,
    out_neighbor_ranks,
    set_machine_topology,
    set_topology,
)
from .parallel import DistributedDataParallel  # noqa: F401
from .errors import AbortedError, CommTimeoutError, PeerError, ProtocolError, RumorError  # noqa: F401

__version__ = "0.1.0"
