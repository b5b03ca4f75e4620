"""rumor: data-parallel training acceleration for PyTorch with a C++ communication core."""


def _require_torch() -> None:
    # rumor.parallel hooks Tensor.register_post_accumulate_grad_hook, which torch 2.1 introduced:
    # an older torch fails here, naming both versions, not at a model's first backward.
    import re

    try:
        import torch
    except ImportError as e:
        raise ImportError("rumor needs PyTorch (torch >= 2.1), which is not installed: "
                          "pip install 'torch>=2.1'") from e
    found = str(getattr(torch, "__version__", "unknown"))
    m = re.match(r"(\d+)\.(\d+)", found)
    if m is None or (int(m[1]), int(m[2])) < (2, 1):
        raise ImportError(f"rumor needs torch >= 2.1, found torch {found} at {getattr(torch, '__file__', '?')}: "
                          "pip install --upgrade 'torch>=2.1'")


_require_torch()
del _require_torch
from ._runtime import (  # noqa: F401
    Group,
    get_gpu_wait,
    get_timeout,
    init,
    is_initialized,
    local_group,
    local_rank,
    local_size,
    machine_rank,
    machine_size,
    new_group,
    rank,
    set_gpu_wait,
    set_timeout,
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
from . import data  # noqa: F401
from . import elastic  # noqa: F401
from . import optim  # noqa: F401
from . import timeline  # noqa: F401
from . import topology  # noqa: F401
from .neighbor.ops import (  # noqa: F401
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
from .neighbor.window import (  # noqa: F401
    WinHandle,
    get_current_created_window_names,
    get_win_version,
    turn_off_win_ops_with_associated_p,
    turn_on_win_ops_with_associated_p,
    win_accumulate,
    win_accumulate_nonblocking,
    win_associated_p,
    win_create,
    win_free,
    win_get,
    win_get_nonblocking,
    win_mutex,
    win_poll,
    win_publish,
    win_put,
    win_put_nonblocking,
    win_update,
    win_update_then_collect,
    win_wait,
)
from .advisor import advise  # noqa: F401
from . import netplugin as _netplugin

from . import torch_backend as _torch_backend

# After `import rumor`, torch.distributed.init_process_group(backend="rumor") runs torch's
# collectives on rumor's core (docs/torch_backend.md); registering starts nothing.
_torch_backend.register()

# RUMOR_NCCL_NET_PLUGIN=1 points NCCL at rumor's net plugin also without rumor-run (docs/netplugin.md).
_netplugin.enable_from_env()

# The public names; everything else here is this module's own business.
__all__ = [
    "AbortedError", "CommTimeoutError", "DistributedDataParallel", "Group", "Handle",
    "PeerError", "ProtocolError", "ReduceOp", "RumorError", "WinHandle", "advise", "allgather",
    "allgather_nonblocking", "allreduce", "allreduce_", "allreduce_nonblocking",
    "allreduce_nonblocking_", "alltoall", "alltoall_nonblocking", "barrier", "broadcast",
    "broadcast_", "broadcast_nonblocking", "broadcast_nonblocking_",
    "get_current_created_window_names", "get_gpu_wait", "get_timeout", "get_win_version",
    "hierarchical_neighbor_allreduce", "hierarchical_neighbor_allreduce_nonblocking",
    "in_neighbor_machine_ranks", "in_neighbor_ranks", "init", "is_initialized",
    "load_machine_topology", "load_topology", "local_group", "local_rank", "local_size",
    "machine_rank", "machine_size", "neighbor_allgather", "neighbor_allgather_nonblocking",
    "neighbor_allreduce", "neighbor_allreduce_nonblocking", "new_group",
    "out_neighbor_machine_ranks", "out_neighbor_ranks", "poll", "rank", "recv", "reduce",
    "reduce_nonblocking", "reduce_scatter", "reduce_scatter_nonblocking", "send",
    "set_gpu_wait", "set_machine_topology", "set_timeout", "set_topology", "shutdown", "size",
    "synchronize", "turn_off_win_ops_with_associated_p", "turn_on_win_ops_with_associated_p",
    "win_accumulate", "win_accumulate_nonblocking", "win_associated_p", "win_create",
    "win_free", "win_get", "win_get_nonblocking", "win_mutex", "win_poll", "win_publish",
    "win_put", "win_put_nonblocking", "win_update", "win_update_then_collect", "win_wait",
]
