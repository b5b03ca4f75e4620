"""A private redis-server for one job on one host, owned by the process that started it.

The server must never outlive the job: it is stopped by close() and at interpreter exit, and it
is the kernel, not Python, that kills it when its owner dies in any other way (PR_SET_PDEATHSIG,
set between fork and exec). The password and the rest of the configuration go through the
server's stdin rather than its command line, so that `ps` shows no password. Nothing is
persisted: no RDB snapshots, no AOF, and the working directory is a private temporary one.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Optional

from .._ports import free_port

_PR_SET_PDEATHSIG = 1


def redis_server_path() -> Optional[str]:
    return os.environ.get("RUMOR_REDIS_SERVER") or shutil.which("redis-server")


def _die_with(parent: int):
    """preexec_fn: the child gets SIGKILL when the thread that forked it exits."""
    libc = ctypes.CDLL(None, use_errno=True)

    def fn():
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return fn


class RedisServer:
    """redis-server bound to host:port with a password (given, else random) and maxmemory = capacity bytes
    (allkeys-lru eviction). start() returns once the server answers PING, or raises."""

    def __init__(self, host: str, capacity: int, port: int = 0, start_timeout: float = 20.0,
                 password: Optional[str] = None):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.host, self.capacity, self.start_timeout = host, int(capacity), float(start_timeout)
        self.port = port
        # password: the one every rank derives from the job secret (nothing to publish), else random.
        if password is not None and (not isinstance(password, str) or not password.isalnum()):
            raise ValueError("RedisServer: the password must be a non-empty alphanumeric str (it goes on a config line)")
        self.password = password or secrets.token_hex(24)
        self.proc: Optional[subprocess.Popen] = None
        self._dir: Optional[str] = None
        self._owner_pid = os.getpid()
        self._lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "RedisServer":
        exe = redis_server_path()
        if exe is None:
            raise RuntimeError("rumor.data: redis-server is not installed (Debian: apt-get install redis-server, "
                               "or run scripts/setup.sh); use backend='local' or hosts=[...] instead")
        deadline = time.monotonic() + self.start_timeout
        last = ""
        for _attempt in range(5):  # a free port can be taken between probing and binding
            port = self.port or free_port(self.host)
            try:
                self._spawn(exe, port, deadline)
                self.port = port
                atexit.register(self.stop)
                return self
            except _PortTaken as e:
                last = str(e)
                if self.port:
                    break
        raise RuntimeError(f"rumor.data: could not start redis-server on {self.host}: {last}")

    def _spawn(self, exe: str, port: int, deadline: float) -> None:
        self._dir = tempfile.mkdtemp(prefix="rumor-redis-")
        log = os.path.join(self._dir, "redis.log")
        conf = "\n".join([
            f"bind {self.host}",
            f"port {port}",
            f"requirepass {self.password}",
            'save ""',
            "appendonly no",
            f"maxmemory {self.capacity}",
            "maxmemory-policy allkeys-lru",
            "daemonize no",
            f"dir {self._dir}",
            f"logfile {log}",
            "loglevel warning",
            "databases 1",
            "protected-mode yes",
        ]) + "\n"
        proc_box = {}

        def launch():
            proc_box["p"] = subprocess.Popen([exe, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True,
                                             preexec_fn=_die_with(os.getpid()))

        # PR_SET_PDEATHSIG fires when the forking *thread* exits: fork from the main thread, or
        # from a parked thread that lives as long as the process.
        if threading.current_thread() is threading.main_thread():
            launch()
        else:
            _parked_launch(launch)
        self.proc = proc_box["p"]
        self.proc.stdin.write(conf.encode())
        self.proc.stdin.close()
        import redis

        cli = redis.Redis(self.host, port, password=self.password, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    tail = self._log_tail(log)
                    self._cleanup_dir()
                    if "Address already in use" in tail:
                        raise _PortTaken(tail)
                    raise RuntimeError(f"rumor.data: redis-server on {self.host}:{port} exited with code {rc}: {tail}")
                try:
                    if cli.ping():
                        return
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"rumor.data: redis-server on {self.host}:{port} did not answer PING within "
                                       f"{self.start_timeout:.0f} s: {self._log_tail(log)}")
                time.sleep(0.02)
        finally:
            cli.close()

    @staticmethod
    def _log_tail(path: str) -> str:
        try:
            with open(path, "rb") as f:
                return f.read()[-1500:].decode("utf-8", "replace").strip()
        except OSError:
            return "(no log)"

    def _cleanup_dir(self) -> None:
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 2 s; idempotent; only the starting process stops it."""
        with self._lock:
            if os.getpid() != self._owner_pid:
                return  # a forked copy (e.g. a DataLoader worker) does not own the server
            p, self.proc = self.proc, None
            if p is not None:
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(2.0)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait(2.0)
            self._cleanup_dir()
        try:
            atexit.unregister(self.stop)
        except Exception:  # noqa: BLE001
            pass

    def endpoint(self) -> dict:
        return {"host": self.host, "port": self.port, "password": self.password}


class _PortTaken(RuntimeError):
    pass


_park_lock = threading.Lock()
_parked: Optional["_Parked"] = None


class _Parked:
    """A daemon thread that runs launch functions and then waits forever, so the children it
    forks keep their parent thread (and their PDEATHSIG) until the process exits."""

    def __init__(self):
        import queue

        self.q: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._run, name="rumor-redis-launcher", daemon=True).start()

    def _run(self):
        while True:
            fn, done, box = self.q.get()
            try:
                fn()
            except BaseException as e:  # noqa: BLE001
                box["e"] = e
            done.set()


def _parked_launch(fn) -> None:
    global _parked
    with _park_lock:
        if _parked is None:
            _parked = _Parked()
        p = _parked
    done, box = threading.Event(), {}
    p.q.put((fn, done, box))
    done.wait()
    if "e" in box:
        raise box["e"]
