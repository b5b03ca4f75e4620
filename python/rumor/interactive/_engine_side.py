"""Functions the notebook sends to the engines (importable by name, so they pickle by reference)."""
from __future__ import annotations

import os
import socket


def setup(rank: int, size: int, master_port: int, timeout: float, generation: int) -> dict:
    """Gives this engine its rank and joins the rumor job. Returns what the session tracks."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        RUMOR_TIMEOUT=repr(float(timeout)),
    )
    import rumor
    from rumor import _runtime

    if rumor.is_initialized():
        rumor.shutdown()
    # Every rank must use the same store key prefix; a rank whose earlier init() failed would
    # otherwise count generations differently from its peers.
    _runtime._generation = generation
    rumor.init(timeout=timeout)
    shm_prefix = ""
    if size > 1:
        token = bytes(_runtime._store_keepalive.get("token"))
        shm_prefix = "rumor-" + token[:8].hex()
    try:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None:
            import torch

            ip.user_ns.update(rumor=rumor, torch=torch)
    except ImportError:
        pass
    return {"rank": rumor.rank(), "pid": os.getpid(), "host": socket.gethostname(), "shm_prefix": shm_prefix}


def set_timeout(seconds: float) -> float:
    """rumor's deadline for the waits of the cells that follow (a cell's --timeout)."""
    import rumor

    rumor.set_timeout(seconds)
    return rumor.get_timeout()


def teardown() -> int:
    import rumor

    if rumor.is_initialized():
        rumor.shutdown()
    return os.getpid()


def identify() -> dict:
    """What a session attaching to running engines needs (rumor.interactive.connect)."""
    import rumor

    return {"rank": rumor.rank() if rumor.is_initialized() else -1, "pid": os.getpid(), "host": socket.gethostname()}
