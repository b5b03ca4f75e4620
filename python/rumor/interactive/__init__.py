"""rumor in a notebook: one engine per rank, cells that run on every rank.

    import rumor.interactive as ri
    ri.start(4)            # controller + 4 engines on this host, rumor.init() on each
    ri.start(4, hosts=["node1:2", "node2:2"])   # ranks 0-1 on node1, 2-3 on node2 (over ssh)
    %%rumor                # the cell runs on every rank ("[rank r]" before each output line)
    %%rank0                # the cell runs on rank 0 only
    %rumor_status          # ranks, hosts, pids, idle/busy
    ri.pull("x")           # [x on rank 0, x on rank 1, ...]
    ri.stop()              # nothing is left running (also at interpreter exit)

See docs/interactive.md. Built on ipyparallel (>= 8), imported only when start() runs.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from . import _hosts, _session
from ._errors import RankError
from ._session import Session

__all__ = ["start", "connect", "stop", "restart", "status", "run", "pull", "push", "client", "session",
           "RankError", "Session", "load_ipython_extension", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 30.0


def _check_args(n, hosts, timeout, start_timeout, launcher=None, controller_ip=None):
    """Validates start()'s arguments; returns the layout of the ranks over hosts (None: all on
    this host, the classic one-host session)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"rumor.interactive.start(): n must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"rumor.interactive.start(): n must be at least 1, got {n}")
    _hosts.check_launcher(launcher)
    if controller_ip is not None and (not isinstance(controller_ip, str) or not controller_ip.strip()):
        raise TypeError(f"rumor.interactive.start(): controller_ip must be an address (str), got {controller_ip!r}")
    layout = None
    if hosts is not None:
        layout = _hosts.layout(hosts, n)
        if launcher is None and all(_hosts.is_local(h.name) for h in layout):
            layout = None  # only this machine: the one-host session, on loopback
    elif launcher is not None:
        raise ValueError("rumor.interactive.start(): launcher= needs hosts= (the hosts it starts engines on)")
    for name, v in (("timeout", timeout), ("start_timeout", start_timeout)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"rumor.interactive.start(): {name} must be a number of seconds, got {type(v).__name__}")
        if not v > 0:
            raise ValueError(f"rumor.interactive.start(): {name} must be positive, got {v}")
    return layout


def _controller_ip(layout, given):
    """Where the controller listens when engines run elsewhere: the address of this machine
    on the route to the first other host (so no more than that interface is exposed); '*'
    (all interfaces) when the name does not resolve here, e.g. an ssh config alias."""
    if given:
        return given
    for h in layout:
        if not _hosts.is_local(h.name):
            return _hosts.route_address(h.name) or "*"
    return "127.0.0.1"


def start(n: int = 4, hosts: Optional[Sequence[str]] = None, timeout: float = DEFAULT_TIMEOUT,
          start_timeout: float = 60.0, quiet: bool = False, *, launcher: "_hosts.Launcher" = None,
          controller_ip: Optional[str] = None) -> "Any":
    """Starts an ipyparallel controller and n engines (on this host, or over hosts), makes
    engine i rank i of a rumor job (rumor.init() on each) and returns the ipyparallel Client.

    timeout: rumor's deadline for every blocking wait on the engines (rumor.init(timeout=)):
        a collective that some rank skipped raises rumor.CommTimeoutError this many seconds
        after the others entered it. Interactive work wants it short; the default is 30 s.
    start_timeout: how long starting the engines and rumor.init() may take.
    hosts: where the engines run, e.g. ["node1:2", "node2:2"] (ranks 0-1 on node1, 2-3 on
        node2) or ["node1", "node2"] (n split evenly). Ranks are contiguous per host; LOCAL_RANK
        and LOCAL_WORLD_SIZE count the ranks of a host. Every host needs this Python and rumor
        at the same path (a shared or identical environment), like mpirun or horovodrun.
        Default: all n on this host.
    launcher: how an engine is started on a host: None = `ssh -o BatchMode=yes host`
        (localhost and this machine's own names run directly); a template with '{host}'
        ("ip netns exec {host}", ["ssh", "-p", "2222", "{host}"]) to which the engine's
        command is appended; or a callable (host, argv) -> argv.
    controller_ip: the address the controller listens on when engines run on other hosts
        (default: this machine's address on the route to the first other host).

    In IPython the %%rumor, %%rank0 and %rumor_status magics are registered.

    Args:
        n: the number of ranks (engines), an int >= 1; default 4.
        hosts: see above; default None (all on this host).
        timeout: see above; default DEFAULT_TIMEOUT (30 s).
        start_timeout: see above; default 60 s.
        quiet: if True (default False), print no "ranks ready" line.
        launcher: see above; default None (ssh). Needs hosts.
        controller_ip: see above; default None.

    Returns:
        The ipyparallel Client of the new session.

    Raises:
        TypeError: n, hosts, launcher, timeout, start_timeout or controller_ip is of the wrong
            type.
        ValueError: n < 1, a timeout is not positive, hosts does not describe n ranks, a
            launcher template lacks '{host}', or launcher is given without hosts.
        ImportError: ipyparallel (>= 8) is not installed.
        RuntimeError: a session is already running, or an engine could not be started.
        TimeoutError: the engines or rumor.init() did not come up within start_timeout.
    """
    layout = _check_args(n, hosts, timeout, start_timeout, launcher, controller_ip)
    try:
        import ipyparallel  # noqa: F401
    except ImportError as e:
        raise ImportError("rumor.interactive needs ipyparallel >= 8: pip install 'rumor[interactive]'") from e
    if _session._session is not None:
        raise RuntimeError("rumor.interactive.start(): a session is running; call stop() or restart() first")
    s = Session(n=n, timeout=float(timeout))
    if layout is not None:
        s.layout, s.launcher, s.controller_ip = layout, launcher, _controller_ip(layout, controller_ip)
    _session._session = s
    _session._last_args = dict(n=n, timeout=float(timeout), start_timeout=float(start_timeout), quiet=quiet,
                               hosts=hosts, launcher=launcher, controller_ip=controller_ip)
    try:
        s.launch(float(start_timeout))
    except BaseException:
        _session._session = None
        s.shutdown()
        raise
    _register_magics()
    if not quiet:
        where = f" on {_hosts.engine_count_label(layout)}" if layout is not None else ""
        print(f"rumor.interactive: {n} rank(s) ready{where} (rumor timeout {timeout:g} s); "
              "use %%rumor, %%rank0, %rumor_status; stop() when done")
    return s.client


def connect(path: str, quiet: bool = False) -> "Any":
    """Attaches this kernel to ranks started from a shell with `rumor-run --interactive -n N`
    (or `python -m rumor.interactive -n N`); path is the connection file it printed. stop()
    then only detaches: the ranks run until Ctrl-C in that shell. Returns the Client.

    Args:
        path: the connection file (str).
        quiet: if True (default False), print no "attached" line.

    Returns:
        The ipyparallel Client of the attached session.

    Raises:
        TypeError: path is not a str.
        RuntimeError: a session is already running in this kernel.
        OSError: the connection file cannot be read.
    """
    if not isinstance(path, str):
        raise TypeError(f"rumor.interactive.connect(): path must be a str, got {type(path).__name__}")
    if _session._session is not None:
        raise RuntimeError("rumor.interactive.connect(): a session is running; call stop() first")
    _session._session = s = Session.attach(path)
    _register_magics()
    if not quiet:
        print(f"rumor.interactive: attached to {s.n} rank(s); use %%rumor, %%rank0, %rumor_status")
    return s.client


def stop() -> None:
    """Stops the engines and the controller and removes what they left (sockets, /dev/shm
    names, the private profile directory). Does nothing when no session runs."""
    s = _session._session
    _session._session = None
    if s is not None:
        s.shutdown()


def restart(hard: bool = False) -> "Any":
    """Makes the session usable again after a failure, with one call.

    By default, when every engine is alive and idle, rumor is shut down and initialised again
    on every rank (Python variables stay; topologies, groups and windows must be set again).
    With hard=True, or when an engine died or is stuck, the engines are stopped and new ones
    started with the arguments of the last start()."""
    s = _session._session
    if s is None:
        if not _session._last_args:
            raise RuntimeError("rumor.interactive.restart(): start() was never called")
        return start(**_session._last_args)
    if not s.owned:
        raise RuntimeError("rumor.interactive.restart(): this kernel is attached with connect(); "
                           "restart the ranks from the shell that started them")
    if not hard and not s.dead and s.running is None:
        try:
            s.init_rumor(_session._last_args.get("start_timeout", 60.0))
            print(f"rumor.interactive: rumor re-initialised on {s.n} rank(s)")
            return s.client
        except Exception as e:  # noqa: BLE001 - fall back to new engines
            print(f"rumor.interactive: re-initialising rumor failed ({e}); starting new engines")
    args = dict(_session._last_args) or dict(n=s.n, timeout=s.timeout)
    stop()
    return start(**args)


def session() -> Session:
    """The running Session (ranks -> engine ids, pids, hosts)."""
    return _session.current()


def client():
    """The ipyparallel Client of the running session."""
    return _session.current().client


def status() -> List[Dict[str, Any]]:
    """One row per rank: rank, host, pid, engine id, state (idle, busy ..., dead)."""
    return _session.current().status()


def run(code: str, ranks: Optional[Sequence[int]] = None, timeout: Optional[float] = None) -> list:
    """What %%rumor does, as a function: runs code on the ranks (default all) and returns each
    rank's last expression value as text (None where there is none).

    Args:
        code: the Python source to run (str).
        ranks: the ranks to run it on; None (the default) means all.
        timeout: rumor's deadline in seconds for this cell's blocking waits on the engines;
            None (the default) uses the session's (start(timeout=)).

    Returns:
        A list with one entry per rank run on, in the order given.

    Raises:
        TypeError: code is not a str.
        ValueError: a rank is outside 0..n-1.
        RuntimeError: no session runs, or it must be restarted.
        RankError: the code failed on some rank (the first failing rank's traceback first).
    """
    if not isinstance(code, str):
        raise TypeError(f"rumor.interactive.run(): code must be a str, got {type(code).__name__}")
    s = _session.current()
    if ranks is not None:
        ranks = [int(r) for r in ranks]
        bad = [r for r in ranks if not 0 <= r < s.n]
        if bad:
            raise ValueError(f"rumor.interactive.run(): ranks {bad} are outside 0..{s.n - 1}")
    return s.execute(code, ranks=ranks, timeout=timeout)


def pull(name: str) -> list:
    """The value of a variable on every rank, in rank order.

    Args:
        name: the variable's name in the ranks' namespace.

    Returns:
        A list: the value on rank 0, rank 1, ...

    Raises:
        RuntimeError: no session runs, or it must be restarted.
    """
    s = _session.current()
    s.check_usable()
    return [s.client[eid].pull(name, block=True) for eid in s.engine_ids]


def push(values: Dict[str, Any], ranks: Optional[Sequence[int]] = None) -> None:
    """Sets variables on the ranks (default all).

    Args:
        values: {name: value}; each value is sent to every rank given and bound to its name.
        ranks: the ranks to set them on; None (the default) means all.

    Raises:
        RuntimeError: no session runs, or it must be restarted.
        IndexError: a rank is n or more.
    """
    s = _session.current()
    s.check_usable()
    ids = s.engine_ids if ranks is None else [s.engine_ids[int(r)] for r in ranks]
    s.client[ids].push(dict(values), block=True)


def _register_magics() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is not None:
        load_ipython_extension(ip)


def load_ipython_extension(ipython) -> None:
    """Registers the %%rumor, %%rank0 and %rumor_status magics: what `%load_ext
    rumor.interactive` calls (start() and connect() do it too).

    Args:
        ipython: the IPython shell (InteractiveShell) to register the magics with.
    """
    from ._magics import RumorMagics

    ipython.register_magics(RumorMagics)
