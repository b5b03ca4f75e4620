"""A cache of computed samples (or any per-key work) shared by the ranks of a job.

    ds = rumor.data.CachedDataset(MyExpensiveDataset(), dataset_name="imagenet-train-v3")
    loader = torch.utils.data.DataLoader(ds, batch_size=..., num_workers=4)

Backends:
  "redis"  one private redis-server per host (started by local rank 0, found by the others
           through rumor's rendezvous store), or the servers given by hosts=[...]; keys are
           spread over the hosts by rendezvous hashing.
  "local"  a shared-memory LRU directory under /dev/shm, shared by the ranks of one host.

A value read back is checked before any of it is parsed: an HMAC keyed by the job secret
(rumor._runtime.job_secret().key("data-cache")) and bound to its key, then header and checksum;
a value that does not check out is recomputed. In an authenticated job (docs/security.md) only
its own ranks can write a value that checks out, so the cache can only make things faster, never
wrong; in an unauthenticated one the MAC key is public and catches accidents only. A backend
that is down makes reads fall back to computing the sample and writes wait in a bounded buffer.
Every such event is counted in stats() and reported once as a warning.

What ranks learn from rumor's rendezvous store (the redis endpoints, the local directory) is
MACed with the job secret and validated (address syntax, a directory of this user's in the
private directory) before use; an entry that does not check out is refused with an error. The
redis password is derived from the job secret on every rank when the job is authenticated and
never enters the store; only an unauthenticated job publishes its (random) password there.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _codec
from ._backends import BackendError, _Unavailable, owner_of
from ._codec import BadMac, CorruptValue, PickleRefused
# _publish is not used here: it stays reachable as rumor.data.cache._publish for the tests.
from ._registry import (StoreEntryRefused, _default_backend, _job_secret, _open_local, _open_redis,  # noqa: F401
                        _publish, _registry, _registry_lock, _rumor_context)

__all__ = ["CacheLoader", "CachedDataset", "CacheWarning", "BackendError", "StoreEntryRefused", "owner_of",
           "DEFAULT_CAPACITY"]

log = logging.getLogger("rumor.data")

DEFAULT_CAPACITY = 1 << 30
_MIB = 1 << 20


class CacheWarning(RuntimeWarning):
    """A cache backend failed or returned a bad value; the data was recomputed or the write dropped."""


_STAT_NAMES = ("hits", "misses", "errors", "corrupt", "bad_mac", "unavailable", "writes", "dropped_writes",
               "bytes_read", "bytes_written")


class CacheLoader:
    """Caches the results of load_fn(key) in a shared backend.

    get(key, load_fn) returns the cached value for key, or computes load_fn(key), returns it and
    queues it for writing. Writes go out in batches of writer_buffer_size and at flush(),
    close(), context exit and interpreter exit.

    backend: "redis", "local" or None (redis where redis-server and redis-py are installed,
      else local).
    dataset_name: names the key space; caches with different contents need different names
      (a cache given by hosts= outlives the job: put a version of the transform in the name).
    writer_buffer_size: values per write batch.
    hosts: redis servers to use instead of starting them: [{"host", "port", "password"}, ...]
      (or env RUMOR_CACHE_HOSTS, JSON).
    capacity_per_node: bytes each host's store may hold before evicting least recently used
      values (redis maxmemory, which also counts the server's own ~1 MiB).
    allow_pickle: store (and load) other objects with pickle. Only for trusted caches:
      unpickling a value can run arbitrary code.
    max_pending_bytes / max_pending_writes: bound the values waiting for a backend that is down;
      beyond it the oldest are dropped (counted in stats()["dropped_writes"]).
    op_timeout / connect_timeout: seconds a redis call / connection may take.
    backoff: (first, longest) seconds a redis host that failed is left alone before it is tried
      again; each further failure doubles the wait up to longest (default (0.5, 10.0)).
    local_dir: backend="local" with a directory you manage (not removed at exit) instead of a
      private one under /dev/shm.
    """

    def __init__(self, backend: Optional[str] = None, dataset_name: str = "", writer_buffer_size: int = 20, *,
                 hosts: Optional[List[Dict[str, Any]]] = None, capacity_per_node: int = DEFAULT_CAPACITY,
                 allow_pickle: bool = False, max_pending_bytes: int = 256 * _MIB,
                 max_pending_writes: Optional[int] = None, op_timeout: float = 2.0, connect_timeout: float = 1.0,
                 backoff: Tuple[float, float] = (0.5, 10.0), local_dir: Optional[str] = None):
        if not isinstance(dataset_name, str) or not dataset_name:
            raise ValueError("dataset_name must be a non-empty str naming what is cached (two caches with the same "
                             f"name share keys), got {dataset_name!r}")
        if backend is None:
            backend = "redis" if hosts is not None else _default_backend()
        if backend not in ("redis", "local"):
            raise ValueError(f"backend must be 'redis', 'local' or None, got {backend!r}")
        if hosts is not None and backend != "redis":
            raise ValueError("hosts= is for backend='redis'")
        if local_dir is not None and backend != "local":
            raise ValueError("local_dir= is for backend='local'")
        if not isinstance(writer_buffer_size, int) or writer_buffer_size < 1:
            raise ValueError(f"writer_buffer_size must be an int >= 1, got {writer_buffer_size!r}")
        if not isinstance(capacity_per_node, int) or capacity_per_node <= 0:
            raise ValueError(f"capacity_per_node must be a positive int (bytes), got {capacity_per_node!r}")
        if max_pending_bytes <= 0:
            raise ValueError(f"max_pending_bytes must be positive, got {max_pending_bytes!r}")
        if max_pending_writes is None:
            max_pending_writes = max(1024, 16 * writer_buffer_size)
        if max_pending_writes < writer_buffer_size:
            raise ValueError(f"max_pending_writes ({max_pending_writes}) must be >= writer_buffer_size "
                             f"({writer_buffer_size})")
        if op_timeout <= 0 or connect_timeout <= 0:
            raise ValueError(f"op_timeout and connect_timeout must be positive, got {op_timeout}, {connect_timeout}")
        if backend == "redis":
            try:
                import redis  # noqa: F401
            except ImportError:
                raise RuntimeError("rumor.data: backend='redis' needs redis-py: pip install 'rumor[cache]' "
                                   "(or pip install redis)") from None
        self.backend_name, self.dataset_name = backend, dataset_name
        self.writer_buffer_size, self.allow_pickle = writer_buffer_size, bool(allow_pickle)
        self.max_pending_bytes, self.max_pending_writes = int(max_pending_bytes), int(max_pending_writes)
        self._prefix = f"rumor:{dataset_name}:".encode()
        # Values are sealed with this key (bound to their cache key): a copy in a DataLoader worker
        # takes it along, so that it reads and writes what the job's ranks do.
        self._mac_key = _job_secret().key("data-cache")
        # _rumor_context is read from this module at each call: it is the one place that decides
        # whether ranks rendezvous, and tests replace it here to play one rank of a larger job.
        if backend == "redis":
            self._backend, self._owned = _open_redis(dataset_name, capacity_per_node, hosts, float(op_timeout),
                                                     float(connect_timeout), tuple(backoff), _rumor_context)
        else:
            self._backend, self._owned = _open_local(dataset_name, capacity_per_node, local_dir, _rumor_context)
        self._init_process_state()
        self._closed = False

    # -- per-process state (rebuilt in DataLoader workers) -----------------------------------------
    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._pending: "OrderedDict[bytes, bytes]" = OrderedDict()
        self._pending_bytes = 0
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        self._warned: set = set()
        self._backend.on_down = self._on_down
        self._backend.on_up = self._on_up
        atexit.register(self._at_exit)
        self._mp_final = None
        try:
            import multiprocessing as mp
            from multiprocessing import util

            if mp.parent_process() is not None:
                # multiprocessing children (DataLoader workers) leave by os._exit: no atexit, but
                # multiprocessing's own finalizers run.
                self._mp_final = util.Finalize(None, self._at_exit, exitpriority=100)
        except Exception:  # noqa: BLE001
            pass

    def _check_process(self) -> None:
        if self._pid != os.getpid():
            # A forked copy: the parent flushes what it queued; this process counts its own.
            self._init_process_state()

    def __getstate__(self):
        with self._lock:
            st = {k: v for k, v in self.__dict__.items()
                  if k not in ("_lock", "_pending", "_pending_bytes", "_stats", "_warned", "_owned", "_mp_final",
                               "_pid")}
        return st

    def __setstate__(self, st):
        self.__dict__.update(st)
        self._owned = None  # a copy in another process never owns the server or directory
        self._init_process_state()

    # -- reporting ---------------------------------------------------------------------------------
    def _report(self, kind: str, msg: str) -> None:
        full = f"rumor.data cache {self.dataset_name!r} ({self.backend_name}): {msg}"
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(full + " (reported once; see stats())", CacheWarning, stacklevel=4)
            log.warning(full)
        else:
            log.debug(full)

    def _on_down(self, host: str, op: str, e: Exception) -> None:
        self._report("down", f"{op} on {host} failed ({type(e).__name__}: {e}); computing samples instead and "
                              "keeping writes in a bounded buffer while retrying with back-off")

    def _on_up(self, host: str) -> None:
        log.warning("rumor.data cache %r: %s answers again", self.dataset_name, host)

    def stats(self) -> Dict[str, int]:
        """This process's counters: hits, misses, errors (failed backend calls), corrupt (values
        rejected by the MAC, header or checksum check, or pickled ones refused), bad_mac (those of
        them that failed the MAC check), unavailable (reads not
        tried while a host backs off), writes, dropped_writes, bytes_read, bytes_written, and
        pending (values waiting to be written)."""
        with self._lock:
            return dict(self._stats, pending=len(self._pending))

    # -- keys --------------------------------------------------------------------------------------
    def _key(self, key) -> bytes:
        if isinstance(key, bool):
            raise TypeError(f"cache key must be an int, str or bytes, got bool {key!r}")
        if isinstance(key, int):
            return self._prefix + b"i" + str(key).encode()
        if isinstance(key, str):
            return self._prefix + b"s" + key.encode("utf-8", "surrogatepass")
        if isinstance(key, bytes):
            return self._prefix + b"b" + key
        raise TypeError(f"cache key must be an int, str or bytes, got {type(key).__name__}")

    # -- the cache ---------------------------------------------------------------------------------
    def get(self, key, load_fn: Callable[[Any], Any]):
        """The value cached for key, or load_fn(key) (which is then cached)."""
        if self._closed:
            raise RuntimeError(f"rumor.data cache {self.dataset_name!r} is closed")
        self._check_process()
        k = self._key(key)
        with self._lock:
            raw = self._pending.get(k)
        if raw is None:
            raw = self._read(k)
        if raw is not None:
            try:
                value = _codec.decode(raw, self.allow_pickle, mac_key=self._mac_key, key=k)
            except BadMac as e:
                # Never decoded: altered, or written by someone without the job's secret.
                self._count("corrupt")
                self._count("bad_mac")
                self._report("mac", f"key {key!r}: rejected a value that fails its MAC check ({e}); recomputed "
                                    "and rewritten")
            except PickleRefused as e:
                self._count("corrupt")
                self._report("pickle", f"key {key!r}: {e}; recomputed (a cache that holds pickles must be opened "
                                       "with allow_pickle=True, and only if it is trusted)")
            except CorruptValue as e:
                self._count("corrupt")
                self._report("corrupt", f"key {key!r}: rejected a corrupt value ({e}); recomputed and rewritten")
            else:
                with self._lock:
                    self._stats["hits"] += 1
                    self._stats["bytes_read"] += len(raw)
                return value
        else:
            self._count("misses")
        value = load_fn(key)
        self._queue(k, _codec.encode(value, self.allow_pickle, mac_key=self._mac_key, key=k))
        return value

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def _read(self, k: bytes) -> Optional[bytes]:
        try:
            return self._backend.get(k)
        except _Unavailable:
            self._count("unavailable")
        except BackendError as e:
            self._count("errors")
            self._report("read", f"{e}; computing the sample instead")
        return None

    def _queue(self, k: bytes, data: bytes) -> None:
        with self._lock:
            old = self._pending.pop(k, None)
            if old is not None:
                self._pending_bytes -= len(old)
            self._pending[k] = data
            self._pending_bytes += len(data)
            self._trim()
            due = len(self._pending) >= self.writer_buffer_size
        if due:
            self.flush()

    def _trim(self) -> None:
        dropped = 0
        while self._pending and (len(self._pending) > self.max_pending_writes
                                 or self._pending_bytes > self.max_pending_bytes):
            _, v = self._pending.popitem(last=False)
            self._pending_bytes -= len(v)
            dropped += 1
        if dropped:
            self._stats["dropped_writes"] += dropped
            self._report("dropped", f"dropped the {dropped} oldest pending write(s): the write buffer is full "
                                    f"(max_pending_writes={self.max_pending_writes}, max_pending_bytes="
                                    f"{self.max_pending_bytes}) while the backend does not take them")

    def flush(self) -> None:
        """Writes every pending value the backend takes now; the others stay pending (bounded)."""
        self._check_process()
        with self._lock:
            if not self._pending:
                return
            items = list(self._pending.items())
        retry, refused, errors = self._backend.put_many(items)
        keep = set(retry)
        gone = {k for k, _ in refused}
        with self._lock:
            written = 0
            for k, v in items:
                if k in keep:
                    continue
                if self._pending.get(k) is v:
                    del self._pending[k]
                    self._pending_bytes -= len(v)
                if k not in gone:
                    written += 1
                    self._stats["bytes_written"] += len(v)
            self._stats["writes"] += written
            self._stats["dropped_writes"] += len(refused)
            self._stats["errors"] += len(errors)
        for e in errors:
            self._report("write", f"{e}; the values stay queued (bounded) and are retried")
        if refused:
            self._report("refused", f"the backend refused {len(refused)} value(s), e.g. {refused[0][1]}")

    def on_epoch_end(self) -> None:
        """Call at the end of each epoch (flushes the pending writes)."""
        self.flush()

    def num_keys(self) -> int:
        """How many values the backend holds for this dataset_name (all hosts)."""
        self._check_process()
        try:
            return self._backend.num_keys(self._prefix)
        except Exception as e:  # noqa: BLE001
            raise BackendError(f"rumor.data cache {self.dataset_name!r}: counting keys failed: {e}") from None

    def _at_exit(self) -> None:
        if self._pid == os.getpid() and not self._closed:
            try:
                self.flush()
                with self._lock:
                    left = len(self._pending)
                    self._pending.clear()
                    self._pending_bytes = 0
                    self._stats["dropped_writes"] += left
                if left:
                    log.warning("rumor.data cache %r: %d pending write(s) dropped at exit (backend unavailable)",
                                self.dataset_name, left)
            except Exception as e:  # noqa: BLE001
                log.warning("rumor.data cache %r: flush at exit failed: %s", self.dataset_name, e)

    def close(self) -> None:
        """Flushes, then releases connections, and stops the server / removes the directory this
        process started (other ranks lose the cache then: close at the end of the job)."""
        if self._closed:
            return
        if self._pid == os.getpid():
            self._at_exit()
        self._closed = True
        try:
            atexit.unregister(self._at_exit)
        except Exception:  # noqa: BLE001
            pass
        if self._mp_final is not None:
            self._mp_final.cancel()
        self._backend.close()
        owned, self._owned = self._owned, None
        if owned is not None:
            with _registry_lock:
                if _registry.get((self.backend_name, self.dataset_name), (None, None))[1] is owned:
                    del _registry[(self.backend_name, self.dataset_name)]
            if hasattr(owned, "stop"):
                owned.stop()
            else:
                owned.close()

    @property
    def server_pid(self) -> Optional[int]:
        """The pid of the redis-server this process started (None if it started none)."""
        return getattr(self._owned, "pid", None)

    @property
    def local_path(self) -> Optional[str]:
        """backend='local': the store's directory."""
        st = getattr(self._backend, "store", None)
        return st.path if st is not None else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


try:
    from torch.utils.data import Dataset as _TorchDataset
except ImportError:  # pragma: no cover
    _TorchDataset = object


class CachedDataset(_TorchDataset):
    """A map-style dataset whose samples are cached: dataset[i] is computed once per job (as
    long as the cache holds it) and read back from the cache afterwards.

    Call on_epoch_end() after each epoch (or flush()); close() at the end, or use it as a
    context manager. Sample values must be tensors, numpy arrays, numbers, str/bytes or
    lists/tuples/dicts of those (or anything with allow_pickle=True). Values come back on the
    CPU, without requires_grad.

    Args:
        dataset: the map-style dataset to cache (it needs __getitem__ and __len__); its
            dataset[i] is called only for samples the cache does not hold.
        backend: "redis", "local" or None (the default: redis where redis-server and redis-py
            are installed, else local), as for CacheLoader.
        dataset_name: names the key space, as for CacheLoader; required (the default "" is
            refused).
        writer_buffer_size: values per write batch (default 20), as for CacheLoader.
        **kwargs: CacheLoader's keyword-only arguments (hosts, capacity_per_node, allow_pickle,
            max_pending_bytes, max_pending_writes, op_timeout, connect_timeout, backoff,
            local_dir).

    Raises:
        TypeError: dataset is not map-style.
        ValueError: dataset_name is empty, or another argument is out of range (see
            CacheLoader).
        RuntimeError: backend="redis" without redis-py installed.
    """

    def __init__(self, dataset, backend: Optional[str] = None, dataset_name: str = "", writer_buffer_size: int = 20,
                 **kwargs):
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(f"dataset must be a map-style dataset (__getitem__ and __len__), got "
                            f"{type(dataset).__name__}")
        self.dataset = dataset
        self.cache_loader = CacheLoader(backend, dataset_name, writer_buffer_size, **kwargs)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        if isinstance(index, bool) or not isinstance(index, int):
            try:
                import operator

                index = operator.index(index)
            except TypeError:
                raise TypeError(f"CachedDataset index must be an int, got {type(index).__name__}") from None
        n = len(self.dataset)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"CachedDataset index {index} out of range for {n} samples")
        return self.cache_loader.get(index, self.dataset.__getitem__)

    def flush(self) -> None:
        """Writes every pending sample the backend takes now (CacheLoader.flush); the others
        stay queued, within the bounds of max_pending_writes / max_pending_bytes."""
        self.cache_loader.flush()

    def on_epoch_end(self) -> None:
        """Call at the end of each epoch: flushes the pending writes."""
        self.cache_loader.on_epoch_end()

    def stats(self) -> Dict[str, int]:
        """This process's cache counters (see CacheLoader.stats).

        Returns:
            A dict of int counters: hits, misses, errors, corrupt, bad_mac, unavailable, writes,
            dropped_writes, bytes_read, bytes_written and pending.
        """
        return self.cache_loader.stats()

    def num_keys(self) -> int:
        """How many samples the backend holds for this dataset_name, over all hosts.

        Returns:
            The number of keys.

        Raises:
            BackendError: the backend could not be asked.
        """
        return self.cache_loader.num_keys()

    def close(self) -> None:
        """Flushes, then releases the backend (CacheLoader.close): a server or directory this
        process started is stopped or removed, so close at the end of the job. Closing twice
        does nothing."""
        self.cache_loader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
