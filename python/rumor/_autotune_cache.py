"""The autotuner's cache of measured settings (rumor.autotune): a JSON file private to this user
(mode 0600, read back only after fstat checks: owner, no group/other bits, not a symlink),
replaced whole by write_private (O_EXCL temporary + rename). Read-modify-write cycles of
concurrent jobs serialize on flock() of "<cache>.lock", waited for with a deadline. Whatever is
in the file, a bad entry is ignored with a warning, never raised."""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import time
import warnings
from typing import Dict, Optional, Sequence

from . import _secret
from ._env import env_float


CACHE_ENV = "RUMOR_AUTOTUNE_CACHE"


CACHE_VERSION = 1


LOCK_TIMEOUT_ENV = "RUMOR_AUTOTUNE_LOCK_TIMEOUT"


LOCK_TIMEOUT_S = 30.0  # how long a write waits for another job's write of the same cache


# Sane bounds for a cached value: a cache entry is data, not something to trust blindly.
_MAX_MB = 1 << 20


def _empty_cache() -> Dict:
    return {"version": CACHE_VERSION, "entries": {}}


def read_cache(path: str) -> Dict:
    """The cache's contents, or an empty cache (with a warning) when the file is unreadable,
    malformed or not private to this user."""
    try:
        raw = _secret.read_private(path)
    except FileNotFoundError:
        return _empty_cache()
    except OSError as e:  # UntrustedFileError included
        warnings.warn(f"rumor autotune: ignoring the cache {path}: {e}", RuntimeWarning, stacklevel=3)
        return _empty_cache()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        warnings.warn(f"rumor autotune: ignoring the unreadable cache {path}: {e}", RuntimeWarning, stacklevel=3)
        return _empty_cache()
    if isinstance(data, dict) and data.get("version") == CACHE_VERSION and isinstance(data.get("entries"), dict):
        return data
    warnings.warn(f"rumor autotune: ignoring the cache {path}: not a version {CACHE_VERSION} cache",
                  RuntimeWarning, stacklevel=3)
    return _empty_cache()


def _lock_timeout() -> float:
    return env_float(LOCK_TIMEOUT_ENV, LOCK_TIMEOUT_S, positive=True)


class _CacheLock:
    """flock() on "<cache>.lock" with a deadline: TimeoutError (an OSError) naming the lock file
    when another process holds it longer. The kernel releases a dead holder's lock."""

    def __init__(self, path: str, timeout: Optional[float] = None):
        self.path = path + ".lock"
        self.timeout = _lock_timeout() if timeout is None else timeout
        self.fd = -1

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        try:
            while True:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return self
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                # flock has no timed wait: poll, backing off to 50 ms, until the deadline.
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        errno.ETIMEDOUT,
                        f"rumor autotune: the cache lock {self.path} was held by another process for more than "
                        f"{self.timeout:g} s (another job writing the cache, or a stuck one: find it with "
                        f"`fuser {self.path}`; {LOCK_TIMEOUT_ENV} sets the wait)")
                time.sleep(min(delay, left))
                delay = min(0.05, delay * 2)
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise

    def __exit__(self, *exc):
        os.close(self.fd)  # releases the lock
        self.fd = -1


def update_cache(path: str, key: str, entry_base: Dict, streams: int, record: Dict,
                 lock_timeout: Optional[float] = None) -> None:
    """Stores record under key and stream count, keeping the other entries: read, modify and
    replace under the cache lock (waited for with a deadline)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    with _CacheLock(path, lock_timeout):
        data = read_cache(path)
        entry = data["entries"].get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("by_streams"), dict):
            entry = data["entries"][key] = dict(entry_base, by_streams={})
        entry["by_streams"][str(streams)] = record
        _secret.write_private(path, json.dumps(data, indent=1, sort_keys=True).encode())


def valid_setting(setting, knobs: Sequence[str]) -> Optional[str]:
    """None when setting is one the wrapper can apply, else why not."""
    if not isinstance(setting, dict) or set(setting) != set(knobs):
        return f"its setting is not a dict of exactly the knobs {sorted(knobs)}"
    for k, v in setting.items():
        if k in ("hierarchical", "shared_buckets"):
            if not isinstance(v, bool):
                return f"{k}={v!r} is not a bool"
            continue
        if v is None and k == "small_allreduce_kb":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            return f"{k}={v!r} is not a number"
        if math.isinf(v) and not (k == "bucket_split_gap_ms" and v > 0):
            return f"{k}={v!r} is not finite"
        if not (v > 0 or (k == "small_allreduce_kb" and v == 0)) or (not math.isinf(v) and v > _MAX_MB * 1024):
            return f"{k}={v!r} is out of range"
    return None


def default_cache_path() -> str:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rumor", "autotune.json")
