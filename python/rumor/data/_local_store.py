"""Node-local cache store: one file per value in a private directory under /dev/shm.

The directory lives in this user's private directory (rumor._secret.private_dir(), mode 0700)
and is itself mode 0700: other local users can neither read the values nor plant any. A
directory opened by path (other ranks, DataLoader workers, local_dir=) is checked the same way
(a directory, not a symlink, owned by this user, no group/other access) before it is used.

Readers take no lock: a value appears by rename(), which is atomic, and a reader that opened a
file keeps its bytes even if it is evicted meanwhile. Writers and eviction serialize on flock()
of a lock file, which the kernel releases when a process dies, so a killed rank never leaves
the store locked. Recency is the file's mtime (a hit touches it); eviction removes the least
recently used files until the total is 10% under capacity, and recounts the total from the
directory while at it, so the running total cannot drift for long after a writer was killed
between rename and bookkeeping.

The directory is removed by the owning process at close/exit, and by a small janitor process
that waits for EOF on a pipe from the owner, which the kernel delivers however the owner dies.
"""
from __future__ import annotations

import atexit
import fcntl
import hashlib
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterable, List, Optional, Tuple

_KEYLEN = struct.Struct("<I")
_SIZE = struct.Struct("<Q")
_PREFIX = "k-"

_JANITOR = (
    "import os, shutil, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "while os.read(0, 65536):\n"
    "    pass\n"
    "shutil.rmtree(sys.argv[1], ignore_errors=True)\n"
)


def shm_root() -> str:
    """Where new cache directories go: this user's private directory (/dev/shm/rumor-<uid>, or
    under the temporary directory where there is no /dev/shm)."""
    from .._secret import private_dir

    return private_dir()


def check_cache_dir(path: str) -> None:
    """Raises UntrustedFileError unless path is a directory (not a symlink) owned by this user
    that group and others cannot enter: values read from it are trusted to be this user's."""
    from .._secret import UntrustedFileError, untrusted_why

    why = untrusted_why(os.lstat(path), "dir")
    if why:
        raise UntrustedFileError(f"rumor.data: refusing the local cache directory {path}: it {why}")


class LocalStore:
    """create=True makes a new directory owned by this process (removed at close/exit or when
    this process dies); create=False opens an existing one (path) without owning it."""

    def __init__(self, capacity: int, name: str = "cache", path: Optional[str] = None, create: bool = True):
        if capacity <= 0:
            raise ValueError(f"capacity_per_node must be positive, got {capacity}")
        self.capacity = int(capacity)
        self._owner_pid = os.getpid() if create else None
        self._janitor: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()
        self._seq = 0
        if create:
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]
            self.path = tempfile.mkdtemp(prefix=f"rumor-cache-{safe}-{os.getpid()}-", dir=path or shm_root())
            with open(os.path.join(self.path, "lock"), "wb"), open(os.path.join(self.path, "size"), "wb") as f:
                f.write(_SIZE.pack(0))
            self._start_janitor()
            atexit.register(self.close)
        else:
            if not path or not os.path.isdir(path):
                raise FileNotFoundError(f"rumor.data local cache directory {path!r} does not exist")
            check_cache_dir(path)
            self.path = path

    def _start_janitor(self) -> None:
        self._janitor = subprocess.Popen([sys.executable, "-S", "-c", _JANITOR, self.path], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                                         start_new_session=True)

    # -- data ------------------------------------------------------------------------------------
    def _file(self, key: bytes) -> str:
        return os.path.join(self.path, _PREFIX + hashlib.blake2b(key, digest_size=16).hexdigest())

    def get(self, key: bytes) -> Optional[bytes]:
        p = self._file(key)
        try:
            with open(p, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            if not os.path.isdir(self.path):
                raise
            return None
        try:
            os.utime(p)  # recency for LRU
        except OSError:
            pass
        (n,) = _KEYLEN.unpack_from(data, 0) if len(data) >= 4 else (None,)
        if n is None or data[4:4 + n] != key:
            return b""  # a foreign or truncated file under this name: the caller sees a corrupt value
        return data[4 + n:]

    def put_many(self, items: Iterable[Tuple[bytes, bytes]]) -> List[bytes]:
        """Stores the items; returns the keys not stored because a value alone exceeds capacity."""
        too_big: List[bytes] = []
        with self._locked():
            total = self._read_size()
            for key, value in items:
                size = 4 + len(key) + len(value)
                if size > self.capacity:
                    too_big.append(key)
                    continue
                p = self._file(key)
                with self._lock:
                    self._seq += 1
                    tmp = os.path.join(self.path, f".tmp-{os.getpid()}-{threading.get_ident()}-{self._seq}")
                with open(tmp, "wb") as f:
                    f.write(_KEYLEN.pack(len(key)))
                    f.write(key)
                    f.write(value)
                try:
                    total -= os.stat(p).st_size
                except FileNotFoundError:
                    pass
                os.replace(tmp, p)
                total += size
                if total > self.capacity:
                    total = self._evict(int(self.capacity * 0.9))
            self._write_size(total)
        return too_big

    def _evict(self, target: int) -> int:
        entries = []
        total = 0
        now = time.time()
        with os.scandir(self.path) as it:
            for e in it:
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                if e.name.startswith(_PREFIX):
                    entries.append((st.st_mtime_ns, e.path, st.st_size))
                    total += st.st_size
                elif e.name.startswith(".tmp-") and now - st.st_mtime > 60:
                    _unlink(e.path)  # left by a writer that died mid-write
        entries.sort()
        for _, p, size in entries:
            if total <= target:
                break
            if _unlink(p):
                total -= size
        return total

    def num_keys(self) -> int:
        with os.scandir(self.path) as it:
            return sum(1 for e in it if e.name.startswith(_PREFIX))

    def total_bytes(self) -> int:
        with self._locked():
            return self._read_size()

    # -- locking and bookkeeping -----------------------------------------------------------------
    class _Flock:
        def __init__(self, path: str):
            self.path = path

        def __enter__(self):
            self.fd = os.open(self.path, os.O_RDWR)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            return self

        def __exit__(self, *exc):
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)

    def _locked(self):
        return LocalStore._Flock(os.path.join(self.path, "lock"))

    def _read_size(self) -> int:
        with open(os.path.join(self.path, "size"), "rb") as f:
            raw = f.read(8)
        return _SIZE.unpack(raw)[0] if len(raw) == 8 else self._evict(1 << 62)

    def _write_size(self, total: int) -> None:
        with open(os.path.join(self.path, "size"), "r+b") as f:
            f.write(_SIZE.pack(max(0, total)))

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def owned(self) -> bool:
        return self._owner_pid == os.getpid()

    def close(self) -> None:
        if not self.owned:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        j, self._janitor = self._janitor, None
        if j is not None:
            try:
                j.stdin.close()  # EOF: the janitor finds the directory gone and exits
                j.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                j.send_signal(signal.SIGKILL)
        self._owner_pid = None
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001
            pass

    def __getstate__(self):
        # A copy in another process (DataLoader worker) uses the directory but never owns it.
        return {"capacity": self.capacity, "path": self.path}

    def __setstate__(self, st):
        self.capacity, self.path = st["capacity"], st["path"]
        self._owner_pid, self._janitor, self._lock, self._seq = None, None, threading.Lock(), 0


def _unlink(p: str) -> bool:
    try:
        os.unlink(p)
        return True
    except FileNotFoundError:
        return False
