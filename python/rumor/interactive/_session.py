"""One interactive rumor job: an ipyparallel controller, n engines (one per rank) and a client.

The engines get their rank from the session, not from the order in which they registered:
engine ids are sorted and rank i is told to the i-th engine before rumor.init() runs there.
"""
from __future__ import annotations

import atexit
import os
import signal
import time
from dataclasses import dataclass, field
from typing import List, Optional

from . import _hosts
from ._cells import CellsMixin, _Running
from ._errors import _remote_summary
from ._launch import LaunchMixin, pid_alive


@dataclass
class Session(LaunchMixin, CellsMixin):
    """The state of one session; starting and stopping it are LaunchMixin's, its cells
    CellsMixin's. rumor.interactive.start() and connect() make one; rumor.interactive.session()
    returns the running one. Its fields are the session's bookkeeping, read by the module's
    functions and the magics; set them only through those.

    Attributes:
        n: the number of ranks (one engine each).
        timeout: rumor's deadline in seconds on the engines (start(timeout=)), the default
            timeout of a cell.
        cluster: the ipyparallel Cluster that runs the controller (and, on one host, the
            engines); None when attached with connect() or before launch().
        client: the ipyparallel Client talking to the controller (None until launched).
        profile_dir: the private ipyparallel profile directory ("" until launched); removed at
            shutdown.
        engine_ids: engine_ids[r] is rank r's ipyparallel engine id.
        pids: pids[r] is the process id of rank r's engine.
        hosts: hosts[r] is the host name rank r's engine reported.
        controller_pid: the controller's process id (0: unknown).
        shm_prefixes: the /dev/shm name prefix of every rumor job this session ran, removed at
            shutdown.
        generation: how many times rumor was initialised on the engines (init_rumor counts).
        broken: why rumor must be re-initialised on the ranks (a communication error in a cell),
            or "" when it need not be.
        dead: why the engines must be restarted (a rank died or would not stop), or "" when
            they need not be; a session with it set runs no more cells.
        running: the cell last sent to the engines while some rank may still run it, else None.
        owned: True when this process started the ranks; False when attached with connect(),
            when stop() only detaches.
        cells: how many cells were run.
        rank_deadline: the rumor deadline set on the engines now (0.0: unknown, set at the next
            cell).
        layout: hosts= sessions: which ranks run on which host; None when every rank runs here.
        launcher: hosts= sessions: how an engine is started on a host (start(launcher=)).
        controller_ip: hosts= sessions: the address the controller listens on.
        controller_addr: hosts= sessions: (ip, registration port) the engines dial.
        procs: hosts= sessions: procs[r] is the local process (subprocess.Popen) that runs rank
            r's engine, directly or through ssh; its stdin is the engine's lifeline.
        logs: hosts= sessions: logs[r] is the file holding that process's output.
        pid_local: pid_local[r] says whether pids[r] is a process of this machine (only those
            are signalled or watched from here).
    """

    n: int
    timeout: float
    cluster: object = None
    client: object = None
    profile_dir: str = ""
    engine_ids: List[int] = field(default_factory=list)   # index = rank
    pids: List[int] = field(default_factory=list)         # index = rank
    hosts: List[str] = field(default_factory=list)
    controller_pid: int = 0
    shm_prefixes: List[str] = field(default_factory=list)  # every rumor job this session ran
    generation: int = 0
    broken: str = ""          # why rumor must be re-initialised, or ""
    dead: str = ""            # why the engines must be restarted, or ""
    running: Optional[_Running] = None
    owned: bool = True        # False: attached with connect(); stop() only detaches
    cells: int = 0
    rank_deadline: float = 0.0  # rumor's deadline on the engines now (0: unknown, set at the next cell)
    # hosts= sessions: the layout, the launcher, and per rank the local process that runs its
    # engine (the engine itself, or ssh), whose stdin is the engine's lifeline.
    layout: Optional[List[_hosts.HostRanks]] = None
    launcher: object = None
    controller_ip: str = ""
    controller_addr: tuple = ()                           # (ip, registration port) engines dial
    procs: List[object] = field(default_factory=list)     # index = rank: subprocess.Popen
    logs: List[str] = field(default_factory=list)         # index = rank: the launcher's output file
    pid_local: List[bool] = field(default_factory=list)   # index = rank: pid is a process of this machine

    def host_of(self, r: int) -> str:
        """The host rank r runs on.

        Args:
            r: the rank.

        Returns:
            The host's name from the layout (hosts= sessions), else the name the engine
            reported, or "?" when it is not known yet.
        """
        if self.layout is not None:
            for h in self.layout:
                if r in h.ranks:
                    return h.name
        return self.hosts[r] if r < len(self.hosts) else "?"

    # ---- ranks: alive, interrupt --------------------------------------------------------
    def rank_alive(self, r: int) -> bool:
        """False once rank r's engine is known to be gone. A rank on another machine, attached
        with connect(), cannot be watched from here and counts as alive."""
        if r < len(self.procs) and self.procs[r] is not None and self.procs[r].poll() is not None:
            return False
        if r >= len(self.pids):
            return True
        if r < len(self.pid_local) and not self.pid_local[r]:
            return True
        return pid_alive(self.pids[r])

    def interrupt(self, r: int) -> None:
        """SIGINT to rank r's engine: directly when its pid is one of this machine's, else
        through ipyparallel's nanny on its host."""
        if r >= len(self.pid_local) or self.pid_local[r]:
            try:
                os.kill(self.pids[r], signal.SIGINT)
            except ProcessLookupError:
                pass
            return
        try:
            self.client.send_signal(int(signal.SIGINT), targets=[self.engine_ids[r]], block=False)
        except Exception:  # noqa: BLE001 - a dead rank is reported by the caller
            pass

    def _gather(self, ars, wait_timeout: float, what: str) -> list:
        deadline = time.monotonic() + wait_timeout
        while not all(a.ready() for a in ars):
            dead = [r for r in range(len(self.pids)) if not self.rank_alive(r)]
            if dead:
                raise RuntimeError(f"rumor.interactive: rank(s) {dead} died during {what}")
            if time.monotonic() > deadline:
                late = [r for r, a in enumerate(ars) if not a.ready()]
                raise TimeoutError(f"rumor.interactive: {what} did not finish within {wait_timeout:.0f} s on rank(s) {late}")
            time.sleep(0.05)
        out = []
        for r, a in enumerate(ars):
            try:
                out.append(a.get())
            except Exception as e:  # noqa: BLE001 - re-raised with the rank
                raise RuntimeError(f"rumor.interactive: {what} failed on rank {r}: {_remote_summary(e)}") from None
        return out


_session: Optional[Session] = None
_last_args: dict = {}


def current() -> Session:
    if _session is None:
        raise RuntimeError("rumor.interactive: no session; call rumor.interactive.start(n) first")
    return _session


def _atexit_stop() -> None:
    global _session
    if _session is not None:
        try:
            _session.shutdown()
        finally:
            _session = None


atexit.register(_atexit_stop)
