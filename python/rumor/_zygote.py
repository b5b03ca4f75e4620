"""A launcher's zygote (rumor-run --live --live-spares): one process per launcher that has
imported torch and rumor once, and forks every spare from there. Started fresh, a spare spends
2-3 s of a core on imports (benchmarks/churn.py), and on a host whose cores train that time is
taken from the training at every failure; forked, it costs a fork.

The zygote never runs the user's script itself (so no thread pool, no store client, nothing of
the user's exists in it when it forks): each spare is a fresh run of the script, with its own
pid, environment and argv, as if started by ``python script.py``. The launcher talks to it over a
Unix socket: a request is one JSON message ``{"env", "cwd", "argv", "module"}`` with the spare's
call pipe attached (SCM_RIGHTS); the zygote forks twice, so that the spare is adopted by the
launcher (a child subreaper, PR_SET_CHILD_SUBREAPER) and the launcher waits for it like for any
child; the reply is the spare's pid. The zygote ends when the launcher's end of the socket
closes.
"""
from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import warnings
from typing import Optional, Tuple

_MAX_REQUEST = 1 << 20


def _warm() -> None:
    import torch  # noqa: F401

    import rumor  # noqa: F401

    try:
        import torch._dynamo  # noqa: F401  (torch's first optimizer imports it: rumor._live._warm_up)
    except Exception:
        pass


def serve(sock: socket.socket) -> Optional[Tuple[dict, int]]:
    """The zygote's loop. Returns in a forked spare only: its request and its call pipe."""
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, _MAX_REQUEST, 1)
        except (OSError, ValueError):
            return None
        if not msg:
            return None  # the launcher is gone
        req = json.loads(msg)
        r, w = os.pipe()
        with warnings.catch_warnings():
            # Python 3.12 warns of forking with threads: torch's import leaves an idle thread of
            # its pool waiting on a futex, holding nothing a child could need.
            warnings.simplefilter("ignore", DeprecationWarning)
            first = os.fork()
        if first == 0:
            os.close(r)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                second = os.fork()
            if second == 0:
                os.close(w)
                sock.close()
                return req, fds[0]
            os.write(w, str(second).encode())
            os._exit(0)
        os.close(w)
        pid = os.read(r, 32).decode()
        os.close(r)
        os.waitpid(first, 0)  # the spare is the launcher's child from here on
        for fd in fds:
            os.close(fd)
        sock.sendall(f"{pid}\n".encode())


def _run(req: dict, call_fd: int) -> None:
    """In the spare: becomes `python [-m] argv...` with the request's environment."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from ._live import SPARE_ENV

    os.environ.clear()
    os.environ.update(req["env"])
    os.environ[SPARE_ENV] = str(call_fd)
    os.chdir(req["cwd"])
    argv = list(req["argv"])
    if req.get("module"):
        sys.argv = argv
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    _warm()
    sock.sendall(b"ready\n")
    got = serve(sock)
    if got is not None:
        _run(*got)


if __name__ == "__main__":
    main()
