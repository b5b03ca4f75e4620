"""Starting and stopping a session's processes: the ipyparallel controller and one engine per
rank (on this host, or on hosts= through a launcher), rumor.init() on each, and the cleanup that
leaves nothing running. LaunchMixin is the part of Session that does it."""
from __future__ import annotations

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
from typing import TYPE_CHECKING, Dict, List, Optional

from .._ports import free_port
from . import _engine_side, _hosts

if TYPE_CHECKING:
    from ._session import Session

_PROC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_proc.py")


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


def _proc_table() -> Dict[int, tuple]:
    """pid -> (parent pid, state, start time) of every process of this machine."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().decode(errors="replace").rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(d)] = (int(fields[1]), fields[0], fields[19])
    return out


def process_tree(roots) -> Dict[int, str]:
    """The running processes among roots and everything they started (children, theirs, ...,
    whatever session or process group they moved to): pid -> start time, so that a recycled pid
    is never taken for one of them."""
    table = _proc_table()
    children: Dict[int, List[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: Dict[int, str] = {}
    todo = [int(p) for p in roots]
    while todo:
        pid = todo.pop()
        if pid in found or pid not in table or table[pid][1] in ("Z", "X"):
            continue
        found[pid] = table[pid][2]
        todo += children.get(pid, [])
    return found


def _still_running(tracked: Dict[int, str]) -> List[int]:
    return sorted(p for p, started in tracked.items() if _start_time(p) == started)


def _reap(pids) -> None:
    """Collects the exit status of those of pids that are this process's exited children: a
    zombie is gone for pid_alive, but kill(pid, 0) still finds it until it is reaped."""
    table = _proc_table()
    for pid in pids:
        ppid, state, _ = table.get(pid, (0, "", ""))
        if ppid == os.getpid() and state in ("Z", "X"):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass  # reaped meanwhile by its owner (a Popen, ipyparallel's launcher)


def _owner_spec() -> str:
    return f"{os.getpid()}:{_start_time(os.getpid()) or ''}"


def _machine_id() -> str:
    return _engine_side.machine_id()



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


class LaunchMixin:
    """Session's start and stop (Session holds the state these methods use)."""

    def launch(self, start_timeout: float) -> None:
        """Starts the controller and the n engines (here, or on the layout's hosts through the
        launcher), waits for them to register and runs rumor.init() on each (init_rumor).
        rumor.interactive.start() calls it; on an error it shuts the session down.

        Args:
            start_timeout: seconds the engines may take to register, and rumor.init() to
                finish on them.

        Raises:
            TimeoutError: the engines did not register, or rumor.init() did not finish, in
                time.
            RuntimeError: an engine could not be started, exited or died, or came up with the
                wrong rank.
        """
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
        # The controller creates the file before it writes it: a file that is there but not yet
        # whole JSON is read again, up to the deadline.
        conn = None
        while conn is None:
            try:
                with open(engine_file) as f:
                    conn = json.load(f)
            except (FileNotFoundError, json.JSONDecodeError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rumor.interactive: the controller wrote no engine connection file "
                                       f"({engine_file}) within {start_timeout:.0f} s") from None
                time.sleep(0.05)
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

    def init_rumor(self, wait_timeout: float) -> None:
        """rumor.init() on every engine, engine_ids[r] becoming rank r. Also used by
        restart() to re-initialise rumor on live engines (generation counts the runs).

        Args:
            wait_timeout: seconds rumor.init() may take on the engines.

        Raises:
            TimeoutError: some engine did not finish in wait_timeout seconds.
            RuntimeError: an engine died or failed during rumor.init(), or came up with the
                wrong rank.
        """
        self.generation += 1
        if self.layout is None:
            port = free_port()
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

    # How long stop() lets the processes end after SIGTERM, then after SIGKILL.
    _TERM_GRACE_S = 3.0
    _KILL_WAIT_S = 10.0

    def shutdown(self) -> None:
        """Stops everything this session started; safe to call more than once. Returns only
        when every process it started has exited: the engines, the controller, launchers, and
        everything they started (ipyparallel's nannies and schedulers, subprocesses of user
        code), recorded by pid and start time before anything is stopped. The orderly stop
        (rumor's teardown, ipyparallel's SIGTERM) gets a few seconds, then whatever is left is
        SIGKILLed and waited for; RuntimeError names any process still running after that."""
        if not self.owned:
            if self.client is not None:
                self.client.close()
                self.client = None
            return
        pids = self.all_pids()
        tracked = process_tree(pids)
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
        # What the processes started while being stopped counts too.
        tracked.update(process_tree(_still_running(tracked)))
        for p in _still_running(tracked):
            try:
                os.kill(p, signal.SIGTERM)  # ipyparallel's SIGTERM reaches its own processes only
            except (ProcessLookupError, PermissionError):
                pass
        self._wait_gone(tracked, pids, self._TERM_GRACE_S)
        # Whatever survived SIGTERM: every process was started in a session of its own, so its
        # process group also holds what it forked (the controller's schedulers, subprocesses of
        # user code on the engines); a process that left its group is killed by pid.
        tracked.update(process_tree(_still_running(tracked)))
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in _still_running(tracked):
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        left = self._wait_gone(tracked, pids, self._KILL_WAIT_S)
        _reap(tracked)
        for prefix in self.shm_prefixes:
            for path in glob.glob(f"/dev/shm/{prefix}*"):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if self.profile_dir:
            shutil.rmtree(self.profile_dir, ignore_errors=True)
        self.cluster = None
        if left:
            raise RuntimeError(f"rumor.interactive: process(es) {left} of the session still run "
                               f"{self._KILL_WAIT_S:g} s after SIGKILL (uninterruptible sleep?)")

    @staticmethod
    def _wait_gone(tracked: Dict[int, str], pgids, wait_s: float) -> List[int]:
        """Waits (at most wait_s) until none of the tracked processes, nor anything in the
        process groups pgids, runs; returns what still does."""
        deadline = time.monotonic() + wait_s
        while True:
            _reap(tracked)
            left = sorted(set(_still_running(tracked)) | set(group_members(pgids)))
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.02)

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
        """Writes what rumor.interactive.connect() needs to attach to these ranks from another
        process (JSON: the controller's client file, engine ids, pids, hosts, timeout), through
        a temporary file renamed into place so a reader never sees half of it.

        Args:
            path: where to write the connection file.

        Raises:
            RuntimeError: the controller wrote no client connection file.
            OSError: the file could not be written.
        """
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
        """A Session attached to ranks another process started (rumor.interactive.connect()
        calls it): owned is False, so shutdown() only closes the client.

        Args:
            path: a connection file written by write_connection_file (the one
                `rumor-run --interactive` prints).

        Returns:
            The attached Session, its client connected to the controller.

        Raises:
            OSError: the file cannot be read.
            ValueError: the file is not valid JSON.
            KeyError: the file lacks a field.
        """
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

