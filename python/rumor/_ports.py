"""A TCP port for a listener that starts later (a store, an etcd member, redis-server).

A port the kernel picked (bind to port 0, then released) is free only until the next outgoing
connection on the host: connect() draws its local port from the same ephemeral range, so
ipyparallel's or a store client's connection can take it before the listener binds (a
rendezvous once failed with EADDRINUSE that way). Ports below that range are never handed out
by the kernel itself; only a process that names one can hold it, and the test bind here sees
those."""
from __future__ import annotations

import errno
import random
import socket
from typing import Tuple

_LOWEST = 10000  # clear of the well-known and registered ports services commonly use


def _ephemeral_range() -> Tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody holds on `host` now, outside the kernel's ephemeral range where it can.

    Raises:
        OSError: `host` is not an address of this machine.
    """
    lo, hi = _ephemeral_range()
    candidates = [(_LOWEST, lo - 1), (hi + 1, 65535)]
    candidates = [(a, b) for a, b in candidates if b - a >= 100]
    rng = random.SystemRandom()
    for _ in range(64 if candidates else 0):
        a, b = rng.choice(candidates)
        port = rng.randint(a, b)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    continue
                raise
            return port
    # The range covers (nearly) every port, or 64 draws were taken: the kernel's pick.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
