"""Functions the notebook sends to the engines (importable by name, so they pickle by reference)."""
from __future__ import annotations

import os
import socket
import sys

from .._env import env_int
from .._ports import free_port

# rumor's /dev/shm name prefixes of the jobs this engine joined: the watchdog of an engine
# started with hosts= removes them when the session is gone (_proc.py).
shm_prefixes = []


def host_label() -> str:
    """The host as the session's hosts= list names it, else this machine's name."""
    return os.environ.get("RUMOR_INTERACTIVE_HOST") or socket.gethostname()


def machine_id() -> str:
    """Boot id and pid namespace: equal to the notebook's exactly when this engine's pid means
    the same process there (then the notebook may watch and signal it by pid)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}|{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def placement() -> dict:
    """Which rank this engine was started for (engines started with hosts=)."""
    return {"slot": env_int("RUMOR_INTERACTIVE_SLOT", -1, minimum=-1), "host": host_label(), "pid": os.getpid(),
            "machine": machine_id()}


def master_address(toward: str) -> list:
    """[address, port] for rank 0's rendezvous: this host's address on the route to `toward`
    (the controller's, which every host reaches) and a port that is free here now."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((toward, 9))  # a UDP connect sends nothing
        addr = s.getsockname()[0]
    return [addr, free_port(addr)]


def setup(rank: int, size: int, master_port: int, timeout: float, generation: int,
          master_addr: str = "127.0.0.1", local_rank: int = -1, local_size: int = -1) -> dict:
    """Gives this engine its rank and joins the rumor job. Returns what the session tracks."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(rank if local_rank < 0 else local_rank),
        LOCAL_WORLD_SIZE=str(size if local_size < 0 else local_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RUMOR_TIMEOUT=repr(float(timeout)),
    )
    from .. import _runtime

    if _runtime.is_initialized():
        _runtime.shutdown()
    # Every rank must use the same store key prefix; a rank whose earlier init() failed would
    # otherwise count generations differently from its peers.
    _runtime.set_generation(generation)
    _runtime.init(timeout=timeout)
    shm_prefix = ""
    if size > 1:
        # The store holds the job token as hex; the core names segments "rumor-" + the hex of
        # the token's first 8 bytes (Context::shm_prefix).
        token = bytes(_runtime.rendezvous_store().get("token")).decode()
        shm_prefix = "rumor-" + token[:16]
        shm_prefixes.append(shm_prefix)
    try:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None:
            import torch

            # Cells use the package as users import it. It is loaded already (this module's
            # parent), so this hands it over without this module depending on it.
            ip.user_ns.update(rumor=sys.modules[__name__.split(".")[0]], torch=torch)
    except ImportError:
        pass
    return {"rank": _runtime.rank(), "pid": os.getpid(), "host": host_label(), "shm_prefix": shm_prefix}


def set_timeout(seconds: float) -> float:
    """rumor's deadline for the waits of the cells that follow (a cell's --timeout)."""
    from .. import _runtime

    _runtime.set_timeout(seconds)
    return _runtime.get_timeout()


def teardown() -> int:
    from .. import _runtime

    if _runtime.is_initialized():
        _runtime.shutdown()
    return os.getpid()


def identify() -> dict:
    """What a session attaching to running engines needs (rumor.interactive.connect)."""
    from .. import _runtime

    return {"rank": _runtime.rank() if _runtime.is_initialized() else -1, "pid": os.getpid(), "host": host_label(),
            "machine": machine_id()}
