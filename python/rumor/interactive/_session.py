"""One interactive rumor job: an ipyparallel controller, n engines (one per rank) and a client.

The engines get their rank from the session, not from the order in which they registered:
engine ids are sorted and rank i is told to the i-th engine before rumor.init() runs there.
"""
from __future__ import annotations

import atexit
import glob
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from . import _engine_side, _hosts

_PROC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_proc.py")
# rumor errors that leave the communicators unusable: after them the ranks have to re-init.
_COMM_ERRORS = ("CommTimeoutError", "PeerError", "AbortedError", "ProtocolError")


class RankError(RuntimeError):
    """A cell failed on one or more ranks. `failures` maps rank -> (error name, message,
    traceback text); `first` is the rank whose error is shown first (the likely cause)."""

    def __init__(self, message: str, failures: Dict[int, tuple], first: Optional[int], lines: List[str]):
        super().__init__(message)
        self.failures = failures
        self.first = first
        self._lines = lines

    def _render_traceback_(self):
        # IPython shows these lines instead of the traceback of the magic that raised.
        return self._lines


def _start_time(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().decode(errors="replace").rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def pid_alive(pid: int) -> bool:
    """True while the process runs (a zombie counts as gone)."""
    return _start_time(pid) is not None


def group_members(pgids) -> List[int]:
    """Live processes whose process group is one of pgids."""
    want, found = {int(p) for p in pgids}, []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().decode(errors="replace").rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) in want:
            found.append(int(d))
    return found


def _owner_spec() -> str:
    return f"{os.getpid()}:{_start_time(os.getpid()) or ''}"


def _machine_id() -> str:
    return _engine_side.machine_id()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Running:
    """The cell the session last sent to the engines (for %rumor_status)."""
    ranks: List[int]
    summary: str
    started: float
    ar: object = None


@dataclass
class Session:
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

    # ---- start / stop -------------------------------------------------------------------
    def launch(self, start_timeout: float) -> None:
        if self.layout is not None:
            return self._launch_hosts(start_timeout)
        import ipyparallel as ipp
        from traitlets.config import Config

        self.profile_dir = tempfile.mkdtemp(prefix="rumor-ipp-")
        cfg = Config()
        cfg.LocalControllerLauncher.controller_cmd = [sys.executable, _PROC, "controller"]
        cfg.LocalEngineSetLauncher.engine_cmd = [sys.executable, _PROC, "engine"]
        cfg.LocalEngineSetLauncher.delay = 0.0
        # Engines are stopped by SIGTERM, then SIGKILL this much later.
        cfg.LocalProcessLauncher.stop_seconds_until_kill = 3
        self.cluster = ipp.Cluster(
            n=self.n,
            profile_dir=self.profile_dir,
            controller_ip="127.0.0.1",
            shutdown_atexit=False,  # the session's own atexit hook stops it
            delay=0,
            engine_timeout=int(start_timeout),
            log_level=40,
            config=cfg,
        )
        owner = _owner_spec()
        self.cluster.start_controller_sync(
            environment={"RUMOR_INTERACTIVE_OWNER": owner, "RUMOR_INTERACTIVE_PROFILE": self.profile_dir})
        self.controller_pid = int(self.cluster.controller.pid)
        env = {
            "RUMOR_INTERACTIVE_OWNER": owner,
            "RUMOR_INTERACTIVE_CONTROLLER": f"{self.controller_pid}:{_start_time(self.controller_pid) or ''}",
        }
        # n engines each running torch's default thread pool on a small machine would fight
        # for the cores; the user's own setting wins.
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.n))
        self.cluster.start_engines_sync(self.n, environment=env)
        self.client = self.cluster.connect_client_sync()
        self.client.wait_for_engines(self.n, timeout=start_timeout)
        ids = sorted(self.client.ids)[: self.n]
        self.engine_ids = ids
        self.pid_local = [True] * self.n
        self.init_rumor(start_timeout)

    def _launch_hosts(self, start_timeout: float) -> None:
        """Controller here, listening where the hosts reach it; one engine per rank started on
        its host through the launcher, fed its connection info and environment on stdin."""
        import subprocess

        import ipyparallel as ipp
        from traitlets.config import Config

        deadline = time.monotonic() + start_timeout
        self.profile_dir = tempfile.mkdtemp(prefix="rumor-ipp-")
        cfg = Config()
        cfg.LocalControllerLauncher.controller_cmd = [sys.executable, _PROC, "controller"]
        cfg.LocalProcessLauncher.stop_seconds_until_kill = 3
        ip, location = self.controller_ip, ""
        if ip in ("*", "0.0.0.0"):
            ip, location = "*", socket.getfqdn()
        self.cluster = ipp.Cluster(n=self.n, profile_dir=self.profile_dir, controller_ip=ip,
                                   controller_location=location, shutdown_atexit=False, delay=0,
                                   engine_timeout=int(start_timeout), log_level=40, config=cfg)
        owner = _owner_spec()
        self.cluster.start_controller_sync(
            environment={"RUMOR_INTERACTIVE_OWNER": owner, "RUMOR_INTERACTIVE_PROFILE": self.profile_dir})
        self.controller_pid = int(self.cluster.controller.pid)
        engine_file = self.cluster.controller.connection_files["engine"]
        while not os.path.exists(engine_file):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rumor.interactive: the controller wrote no engine connection file ({engine_file}) "
                                   f"within {start_timeout:.0f} s")
            time.sleep(0.05)
        with open(engine_file) as f:
            conn = json.load(f)
        dial = conn.get("location") if ip == "*" else ip
        self.controller_addr = (dial, int(conn["registration"]))
        self.procs = [None] * self.n
        self.logs = [""] * self.n
        argv = [sys.executable, _PROC, "engine-stdin"]
        # The job secret goes to each engine on its stdin with the rest of its environment
        # (docs/security.md): drawn here unless the notebook's environment gives one.
        job_secret = {} if "RUMOR_JOB_SECRET" in os.environ or "RUMOR_JOB_SECRET_FILE" in os.environ \
            else {"RUMOR_JOB_SECRET": secrets.token_hex(32)}
        for h in self.layout:
            local = self.launcher is None and _hosts.is_local(h.name)
            for lr, r in enumerate(h.ranks):
                cmd = _hosts.command(self.launcher, h.name, argv, local)
                self.logs[r] = os.path.join(self.profile_dir, f"engine-{r}.log")
                with open(self.logs[r], "wb") as log:
                    try:
                        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
                    except OSError as e:
                        raise RuntimeError(f"rumor.interactive: could not start the engine of rank {r} on host "
                                           f"{h.name!r}: `{shlex_join(cmd)}`: {e}") from None
                self.procs[r] = p
                env = dict(_forwarded_env(), **job_secret)
                env.update(RUMOR_INTERACTIVE_HOST=h.name, RUMOR_INTERACTIVE_SLOT=str(r),
                           RUMOR_INTERACTIVE_LOCAL_SIZE=str(h.size))
                payload = {"connection": conn, "controller": list(self.controller_addr), "env": env}
                try:
                    p.stdin.write(json.dumps(payload).encode() + b"\n")
                    p.stdin.flush()
                except (BrokenPipeError, OSError):
                    pass  # the launcher already failed: reported below with its output
        self.client = self.cluster.connect_client_sync()
        while len(self.client.ids) < self.n:
            for r, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise RuntimeError(self._launch_failure(r, f"exited with status {p.returncode}"))
            if time.monotonic() > deadline:
                missing = self._missing_slots(max(1.0, deadline - time.monotonic() + 5.0))
                detail = "; ".join(self._launch_failure(r, "has not registered") for r in missing[:3])
                raise TimeoutError(f"rumor.interactive: {len(self.client.ids)} of {self.n} engines registered "
                                   f"within {start_timeout:.0f} s. {detail}")
            time.sleep(0.05)
        ids = sorted(self.client.ids)
        places = self._gather([self.client[eid].apply_async(_engine_side.placement) for eid in ids],
                              max(5.0, deadline - time.monotonic()), "asking the engines where they run")
        by_slot = {pl["slot"]: (eid, pl) for eid, pl in zip(ids, places)}
        if sorted(by_slot) != list(range(self.n)):
            raise RuntimeError(f"rumor.interactive: the engines registered for ranks {sorted(by_slot)}, "
                               f"wanted 0..{self.n - 1}")
        here = _machine_id()
        self.engine_ids = [by_slot[r][0] for r in range(self.n)]
        self.pids = [by_slot[r][1]["pid"] for r in range(self.n)]
        self.hosts = [by_slot[r][1]["host"] for r in range(self.n)]
        self.pid_local = [bool(here) and by_slot[r][1]["machine"] == here for r in range(self.n)]
        self.init_rumor(max(5.0, deadline - time.monotonic()))

    def _launch_failure(self, r: int, what: str) -> str:
        host = self.host_of(r)
        p = self.procs[r]
        cmd = shlex_join(p.args) if p is not None else "?"
        return (f"the engine of rank {r} on host {host!r} {what} (launcher command `{cmd}`); "
                f"its output: {_tail(self.logs[r]) or '(none)'}")

    def _missing_slots(self, wait: float) -> List[int]:
        ids = sorted(self.client.ids)
        try:
            places = self._gather([self.client[eid].apply_async(_engine_side.placement) for eid in ids],
                                  wait, "asking the engines where they run")
        except Exception:  # noqa: BLE001 - only for the error message
            return list(range(self.n))
        have = {pl["slot"] for pl in places}
        return [r for r in range(self.n) if r not in have]

    def host_of(self, r: int) -> str:
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

    def init_rumor(self, wait_timeout: float) -> None:
        """rumor.init() on every engine, engine_ids[r] becoming rank r."""
        self.generation += 1
        if self.layout is None:
            port = _free_port()
            ars = [self.client[eid].apply_async(_engine_side.setup, r, self.n, port, self.timeout, self.generation)
                   for r, eid in enumerate(self.engine_ids)]
        else:
            # Rank 0 hosts the rendezvous: its address on the route to the controller is one
            # every host reaches (they all reach the controller), and the port is free there.
            addr, port = self._gather([self.client[self.engine_ids[0]].apply_async(
                _engine_side.master_address, self.controller_addr[0])], wait_timeout, "choosing rank 0's address")[0]
            local = {r: (i, h.size) for h in self.layout for i, r in enumerate(h.ranks)}
            ars = [self.client[eid].apply_async(_engine_side.setup, r, self.n, port, self.timeout, self.generation,
                                                addr, local[r][0], local[r][1])
                   for r, eid in enumerate(self.engine_ids)]
        infos = self._gather(ars, wait_timeout, "rumor.init()")
        self.pids = [i["pid"] for i in infos]
        self.hosts = [i["host"] for i in infos]
        for i in infos:
            if i["shm_prefix"] and i["shm_prefix"] not in self.shm_prefixes:
                self.shm_prefixes.append(i["shm_prefix"])
        bad = [(r, i["rank"]) for r, i in enumerate(infos) if i["rank"] != r]
        if bad:
            raise RuntimeError(f"rumor.interactive: engines came up with the wrong ranks (wanted, got): {bad}")
        self.broken = ""
        self.rank_deadline = self.timeout

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

    def all_pids(self) -> List[int]:
        """This machine's processes of the session (never a pid of another host)."""
        pids = [p for r, p in enumerate(self.pids) if r >= len(self.pid_local) or self.pid_local[r]]
        pids += [p.pid for p in self.procs if p is not None and p.pid not in pids]
        if self.controller_pid:
            pids.append(self.controller_pid)
        # Engines that never reported (start failed half-way) are known to their launchers.
        if self.cluster is not None:
            for es in self.cluster.engines.values():
                for el in getattr(es, "launchers", {}).values():
                    if el.pid and el.pid not in pids:
                        pids.append(el.pid)
        return pids

    def shutdown(self) -> None:
        """Stops everything this session started; safe to call more than once."""
        if not self.owned:
            if self.client is not None:
                self.client.close()
                self.client = None
            return
        pids = self.all_pids()
        if self.client is not None and not self.dead:
            # Let rumor release its sockets and shared memory in an orderly way first.
            live = [eid for r, eid in enumerate(self.engine_ids) if r < len(self.pids) and self.rank_alive(r)]
            if live and self.running is None:
                try:
                    ar = self.client[live].apply_async(_engine_side.teardown)
                    ar.wait(5)
                except Exception:  # noqa: BLE001 - the processes are stopped below anyway
                    pass
        self._stop_launched()
        if self.cluster is not None:
            try:
                self.cluster.stop_cluster_sync()
            except Exception:  # noqa: BLE001
                pass
        if self.client is not None:
            try:
                self.client.close(linger=0)
            except TypeError:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass
            self.client = None
        # Whatever survived SIGTERM and the launcher's SIGKILL: every process was started in a
        # session of its own, so its process group also holds what it forked (the controller's
        # schedulers, subprocesses of user code on the engines).
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 5
        while (any(pid_alive(p) for p in pids) or group_members(pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for prefix in self.shm_prefixes:
            for path in glob.glob(f"/dev/shm/{prefix}*"):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if self.profile_dir:
            shutil.rmtree(self.profile_dir, ignore_errors=True)
        self.cluster = None

    def _stop_launched(self) -> None:
        """Engines of hosts=: closing their stdin ends them on every host (their watchdog exits
        on EOF; through ssh the EOF travels to the remote side), then the local launcher
        processes get SIGTERM and SIGKILL like the local engines."""
        procs = [p for p in self.procs if p is not None]
        for p in procs:
            try:
                p.stdin.close()
            except (OSError, AttributeError):
                pass
        deadline = time.monotonic() + 5
        for sig, wait in ((None, 5.0), (signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            live = [p for p in procs if p.poll() is None]
            if not live:
                break
            if sig is not None:
                for p in live:
                    try:
                        os.killpg(p.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            deadline = time.monotonic() + wait
            for p in live:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
                    pass

    def write_connection_file(self, path: str) -> None:
        """What rumor.interactive.connect() needs to attach to these ranks from another process."""
        client_file = self.cluster.controller.connection_files["client"]
        if not os.path.exists(client_file):
            raise RuntimeError(f"rumor.interactive: the controller wrote no client file ({client_file})")
        info = {"client_file": client_file, "engine_ids": self.engine_ids, "pids": self.pids,
                "hosts": self.hosts, "timeout": self.timeout, "n": self.n,
                "machines": [_machine_id() if local else "" for local in self.pid_local]}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, path)

    @classmethod
    def attach(cls, path: str) -> "Session":
        import ipyparallel as ipp

        with open(path) as f:
            info = json.load(f)
        s = cls(n=int(info["n"]), timeout=float(info["timeout"]), owned=False)
        s.engine_ids = list(info["engine_ids"])
        s.pids = list(info["pids"])
        s.hosts = list(info["hosts"])
        here = _machine_id()
        s.pid_local = [bool(m) and m == here for m in info.get("machines", [here] * s.n)]
        s.client = ipp.Client(info["client_file"])
        return s

    # ---- running cells ----------------------------------------------------------------
    def check_usable(self) -> None:
        if self.dead:
            raise RuntimeError(f"rumor.interactive: {self.dead}; run rumor.interactive.restart()")

    def execute(self, code: str, ranks: Optional[List[int]] = None, timeout: Optional[float] = None,
                prefix: bool = True, out=None, err=None) -> list:
        """Runs code on the given ranks (default all), streaming each rank's output with a
        "[rank r]" prefix. Returns each rank's execute_result text (or None). Raises RankError
        with the first failing rank's traceback first."""
        self.check_usable()
        out = out or sys.stdout
        err = err or sys.stderr
        ranks = list(range(self.n)) if ranks is None else list(ranks)
        # rumor's own deadline follows the cell's limit, so that a collective some rank skipped
        # fails on every rank inside the cell (set on every rank: a cell on some ranks may still
        # talk to the others, whose deadline must match).
        deadline = self.timeout if timeout is None else float(timeout)
        limit = deadline + 10.0  # rumor's own error first; then ranks still busy are interrupted
        if deadline != self.rank_deadline:
            ars = [self.client[eid].apply_async(_engine_side.set_timeout, deadline) for eid in self.engine_ids]
            self._gather(ars, 30.0, "setting the cell's deadline")
            self.rank_deadline = deadline
        view = self.client[[self.engine_ids[r] for r in ranks]]
        view.block = False
        self.cells += 1
        first_line = next((ln.strip() for ln in code.splitlines() if ln.strip()), "")
        ar = view.execute(code, silent=False, block=False)
        self.running = _Running(ranks, first_line[:60], time.monotonic(), ar)
        shown = {r: [0, 0] for r in ranks}
        died: Dict[int, str] = {}
        timed_out: List[int] = []

        def flush(final: bool) -> None:
            for i, r in enumerate(ranks):
                md = ar.metadata[i]
                for k, (key, stream) in enumerate((("stdout", out), ("stderr", err))):
                    text = md.get(key) or ""
                    new = text[shown[r][k]:]
                    if not final:
                        cut = new.rfind("\n")
                        new = new[: cut + 1] if cut >= 0 else ""
                    if new:
                        shown[r][k] += len(new)
                        lines = new.splitlines()
                        tag = f"[rank {r}] " if prefix else ""
                        stream.write("".join(f"{tag}{ln}\n" for ln in lines))
                        stream.flush()

        start = time.monotonic()
        interrupted_at = None
        while True:
            pending = [i for i, _ in enumerate(ranks) if not _msg_done(ar, i)]
            flush(False)
            for i in pending:
                r = ranks[i]
                if r not in died and not self.rank_alive(r):
                    died[r] = self._died_message(r)
            pending = [i for i in pending if ranks[i] not in died]
            if not pending:
                break
            now = time.monotonic()
            if interrupted_at is None and now - start > limit:
                # Python code stops at the KeyboardInterrupt; a rank inside a rumor wait
                # returns at rumor's own deadline (start(timeout=...)).
                timed_out = [ranks[i] for i in pending]
                for r in timed_out:
                    self.interrupt(r)
                interrupted_at = now
            if interrupted_at is not None and now - interrupted_at > 5.0:
                break
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:
                # The notebook's interrupt button: pass it on to the ranks still running.
                for i in pending:
                    self.interrupt(ranks[i])
                raise
        flush(True)
        # The hub may have answered for a dead engine (EngineError) before we saw it die.
        for r in ranks:
            if r not in died and not self.rank_alive(r):
                died[r] = self._died_message(r)
        still = [ranks[i] for i, _ in enumerate(ranks) if not _msg_done(ar, i) and ranks[i] not in died]
        if not still:
            self.running = None
        results, failures, order = [], {}, []
        for i, r in enumerate(ranks):
            if r in died:
                failures[r] = ("EngineDied", died[r], "")
                order.append((0, 0.0, r))
                results.append(None)
                continue
            if r in still:
                failures[r] = ("CellTimeout", f"rank {r} is still busy {limit:.0f} s after the cell started "
                                              "and did not stop on SIGINT", "")
                order.append((3, 0.0, r))
                results.append(None)
                continue
            md = ar.metadata[i]
            exc = None
            if md.get("status") == "error":
                exc = md.get("error") or self.client.results.get(ar.msg_ids[i])
                if not isinstance(exc, BaseException):
                    exc = RuntimeError("the engine reported an error without details")
            if exc is not None:
                name, msg, tb = _remote_parts(exc)
                if r in timed_out and name == "KeyboardInterrupt":
                    name, msg = "CellTimeout", f"interrupted after the cell's {limit:.0f} s limit"
                failures[r] = (name, msg, tb)
                # Errors that are consequences of another rank's failure go last.
                rank_of = 2 if name in _COMM_ERRORS else (1 if name != "CellTimeout" else 3)
                t = md.get("completed")
                order.append((rank_of, t.timestamp() if t else 0.0, r))
                results.append(None)
            else:
                er = md.get("execute_result") or {}
                results.append((er.get("data") or {}).get("text/plain"))
                if results[-1] is not None:
                    tag = f"[rank {r}] " if prefix else ""
                    out.write(f"{tag}Out: {results[-1]}\n")
        if died:
            self.dead = "rank(s) " + ", ".join(str(r) for r in sorted(died)) + " died"
        elif still:
            self.dead = "rank(s) " + ", ".join(str(r) for r in still) + " did not stop after the cell timeout"
        elif any(f[0] in _COMM_ERRORS for f in failures.values()):
            self.broken = "a rumor operation failed in cell " + str(self.cells)
        if failures:
            order.sort()
            first = order[0][2]
            raise _rank_error(failures, first, [o[2] for o in order], self.n, self.dead, self.broken)
        return results

    def _died_message(self, r: int) -> str:
        where = f" on host {self.host_of(r)!r}" if self.layout is not None else ""
        msg = f"rank {r} (engine pid {self.pids[r]}{where}) died during this cell"
        p = self.procs[r] if r < len(self.procs) else None
        if p is None:
            return msg + self._exit_note(self.pids[r])
        if p.returncode is not None and p.returncode < 0:
            msg += f" (its launcher was killed by {signal.Signals(-p.returncode).name})"
        elif p.returncode is not None:
            msg += f" (exit code {p.returncode})"
        tail = _tail(self.logs[r], 300)
        return msg + (f"; its last output: {tail}" if tail else "")

    @staticmethod
    def _exit_note(pid: int) -> str:
        # The launcher that started the engine reaps it; it knows the exit status.
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return ""
        if reaped != pid:
            return ""
        if os.WIFSIGNALED(status):
            return f" (killed by {signal.Signals(os.WTERMSIG(status)).name})"
        if os.WIFEXITED(status):
            return f" (exit code {os.WEXITSTATUS(status)})"
        return ""

    # ---- status -------------------------------------------------------------------------
    def status(self) -> List[dict]:
        rows = []
        busy_ids = set()
        try:
            qs = self.client.queue_status()
            busy_ids = {eid for eid, q in qs.items() if isinstance(q, dict) and (q.get("queue", 0) or q.get("tasks", 0))}
        except Exception:  # noqa: BLE001
            pass
        run = self.running
        if run is not None and all(_msg_done(run.ar, i) for i in range(len(run.ranks))):
            self.running = run = None
        for r in range(self.n):
            pid = self.pids[r] if r < len(self.pids) else 0
            if not pid or not self.rank_alive(r):
                state = "dead"
            elif run is not None and r in run.ranks and not _msg_done(run.ar, run.ranks.index(r)):
                state = f"busy {time.monotonic() - run.started:.0f} s: {run.summary}"
            elif self.engine_ids[r] in busy_ids:
                state = "busy"
            else:
                state = "idle"
            rows.append({"rank": r, "host": self.hosts[r] if r < len(self.hosts) else "?", "pid": pid,
                         "engine": self.engine_ids[r], "state": state})
        return rows


# Describe one machine, not the job: a copy on another host would be wrong there.
_HOST_SPECIFIC = ("RUMOR_HOST_ID", "RUMOR_ADVERTISE_ADDR", "RUMOR_PORT")


def _forwarded_env() -> Dict[str, str]:
    """The notebook's rumor settings (RUMOR_SOCKET_STREAMS, RUMOR_SHM, RUMOR_LOG, ...) and
    OMP_NUM_THREADS, for engines on hosts where ssh gives a fresh environment; as rumor-run's
    workers inherit its environment."""
    return {k: v for k, v in os.environ.items()
            if (k.startswith("RUMOR_") and not k.startswith("RUMOR_INTERACTIVE_") and k not in _HOST_SPECIFIC)
            or k == "OMP_NUM_THREADS"}


def shlex_join(argv) -> str:
    import shlex

    return shlex.join(str(a) for a in argv) if not isinstance(argv, str) else argv


def _tail(path: str, limit: int = 1500) -> str:
    """The end of a launcher's output file, on one line per line, for error messages."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return " | ".join(ln.strip() for ln in text.strip().splitlines() if ln.strip())


def _msg_done(ar, i: int) -> bool:
    return ar.msg_ids[i] not in ar._client.outstanding


def _remote_parts(exc: BaseException):
    """(error name, message, traceback text) of an error that came back from an engine."""
    name = getattr(exc, "ename", None) or type(exc).__name__
    msg = getattr(exc, "evalue", None)
    if msg is None:
        msg = str(exc)
    tb = getattr(exc, "traceback", None) or ""
    if isinstance(tb, list):
        tb = "\n".join(tb)
    return name, str(msg), tb


def _remote_summary(exc: BaseException) -> str:
    name, msg, _ = _remote_parts(exc)
    return f"{name}: {msg}"


def _rank_error(failures, first, order, n, dead, broken) -> RankError:
    name, msg, tb = failures[first]
    others = [r for r in order if r != first]
    head = f"rank {first}: {name}: {msg}"
    if others:
        head += f" (and {len(others)} more rank(s) failed)"
    lines = [f"--- rank {first} of {n}: {name} ---"]
    if tb:
        lines.extend(tb.rstrip("\n").splitlines())
    else:
        lines.append(f"{name}: {msg}")
    for r in others:
        oname, omsg, _ = failures[r]
        lines.append(f"--- rank {r}: {oname}: {omsg}")
    if dead:
        lines.append(f"rumor.interactive: {dead}; the session must be restarted: rumor.interactive.restart()")
    elif broken:
        lines.append("rumor.interactive: rumor's communicators are unusable after this error; "
                     "rumor.interactive.restart() re-initialises rumor on every rank (Python variables are kept)")
    message = head
    if dead or broken:
        message += "; run rumor.interactive.restart()"
    return RankError(message, failures, first, lines)


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
