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
import hashlib
import ipaddress
import json
import logging
import os
import re
import threading
import time
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .. import _secret
from . import _codec
from ._codec import BadMac, CorruptValue, PickleRefused

log = logging.getLogger("rumor.data")

DEFAULT_CAPACITY = 1 << 30
_MIB = 1 << 20


class CacheWarning(RuntimeWarning):
    """A cache backend failed or returned a bad value; the data was recomputed or the write dropped."""


# ==== key placement ==================================================================================

def _hrw_score(host_id: bytes, key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, key=host_id[:64]).digest(), "little")


def owner_of(key: bytes, host_ids: Sequence[bytes]) -> int:
    """Rendezvous (highest-random-weight) hashing: the host whose (host, key) score is highest.
    Adding or removing a host moves only the keys that it wins or owned."""
    best, best_i = -1, 0
    for i, h in enumerate(host_ids):
        s = _hrw_score(h, key)
        if s > best:
            best, best_i = s, i
    return best_i


# ==== backends =======================================================================================

class BackendError(RuntimeError):
    """A backend operation failed (names the op and the host)."""


class StoreEntryRefused(RuntimeError):
    """An entry of rumor's rendezvous store (a redis endpoint, a local cache path) that fails its
    MAC or its validation: someone other than the job's ranks wrote it, or it is malformed."""


class _Unavailable(Exception):
    """The host is in its back-off window after a failure: not tried, not a new error."""


def _validate_hosts(hosts) -> List[Dict[str, Any]]:
    if isinstance(hosts, (str, bytes)) or not isinstance(hosts, (list, tuple)) or not hosts:
        raise ValueError(f"hosts must be a non-empty list of {{'host', 'port', 'password'}} dicts, got {hosts!r}")
    out = []
    for i, h in enumerate(hosts):
        if not isinstance(h, dict) or "host" not in h or "port" not in h:
            raise ValueError(f"hosts[{i}] must be a dict with 'host' and 'port' (and optionally 'password'), got {h!r}")
        port = h["port"]
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"hosts[{i}]['port'] must be an int in 1..65535, got {port!r}")
        out.append({"host": str(h["host"]), "port": port, "password": h.get("password")})
    ids = [f"{h['host']}:{h['port']}" for h in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"hosts lists the same server twice: {ids}")
    return out


class _RedisBackend:
    name = "redis"

    def __init__(self, endpoints: List[Dict[str, Any]], op_timeout: float, connect_timeout: float,
                 backoff: Tuple[float, float], owned: bool):
        self.endpoints = endpoints
        self.ids = [f"{e['host']}:{e['port']}".encode() for e in endpoints]
        self.op_timeout, self.connect_timeout = op_timeout, connect_timeout
        self.backoff_min, self.backoff_max = backoff
        self.owned = owned  # one private server per host: DBSIZE counts only our keys
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._clients: List[Any] = [None] * len(self.endpoints)
        self._down_until = [0.0] * len(self.endpoints)
        self._backoff = [0.0] * len(self.endpoints)
        self.on_down: Optional[Callable[[str, str, Exception], None]] = None
        self.on_up: Optional[Callable[[str], None]] = None

    def __getstate__(self):
        st = dict(self.__dict__)
        for k in ("_clients", "_down_until", "_backoff", "on_down", "on_up", "_pid"):
            st.pop(k, None)
        return st

    def __setstate__(self, st):
        self.__dict__.update(st)
        self._reset()

    def host_name(self, i: int) -> str:
        return self.ids[i].decode()

    def _client(self, i: int):
        if self._pid != os.getpid():  # a forked copy must not share the parent's sockets
            hooks = (self.on_down, self.on_up)
            self._reset()
            self.on_down, self.on_up = hooks
        c = self._clients[i]
        if c is None:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            e = self.endpoints[i]
            # Retries and back-off are ours (bounded, counted); redis-py must fail fast.
            c = redis.Redis(e["host"], e["port"], password=e["password"], socket_timeout=self.op_timeout,
                            socket_connect_timeout=self.connect_timeout, retry=Retry(NoBackoff(), 0),
                            health_check_interval=0, socket_keepalive=True)
            self._clients[i] = c
        return c

    def _check_up(self, i: int) -> None:
        if self._down_until[i] > time.monotonic():
            raise _Unavailable()

    def _failed(self, i: int, op: str, e: Exception) -> BackendError:
        was_up = self._backoff[i] == 0.0
        self._backoff[i] = min(self.backoff_max, max(self.backoff_min, 2 * self._backoff[i]))
        self._down_until[i] = time.monotonic() + self._backoff[i]
        c, self._clients[i] = self._clients[i], None
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
        if was_up and self.on_down is not None:
            self.on_down(self.host_name(i), op, e)
        return BackendError(f"redis {op} on {self.host_name(i)} failed: {type(e).__name__}: {e}")

    def _ok(self, i: int) -> None:
        if self._backoff[i] != 0.0:
            self._backoff[i] = 0.0
            self._down_until[i] = 0.0
            if self.on_up is not None:
                self.on_up(self.host_name(i))

    def owner(self, key: bytes) -> int:
        return owner_of(key, self.ids) if len(self.ids) > 1 else 0

    def get(self, key: bytes) -> Optional[bytes]:
        import redis

        i = self.owner(key)
        self._check_up(i)
        try:
            v = self._client(i).get(key)
        except (redis.exceptions.RedisError, OSError) as e:
            raise self._failed(i, "GET", e) from None
        self._ok(i)
        return v

    def put_many(self, items: List[Tuple[bytes, bytes]]):
        """-> (keys to retry later, keys refused for good with the reason, errors raised)."""
        import redis

        by_host: Dict[int, List[Tuple[bytes, bytes]]] = {}
        for kv in items:
            by_host.setdefault(self.owner(kv[0]), []).append(kv)
        retry: List[bytes] = []
        refused: List[Tuple[bytes, str]] = []
        errors: List[BackendError] = []
        for i, kvs in by_host.items():
            try:
                self._check_up(i)
                pipe = self._client(i).pipeline(transaction=False)
                for k, v in kvs:
                    pipe.set(k, v)
                results = pipe.execute(raise_on_error=False)
            except _Unavailable:
                retry += [k for k, _ in kvs]
                continue
            except (redis.exceptions.RedisError, OSError) as e:
                errors.append(self._failed(i, "SET pipeline", e))
                retry += [k for k, _ in kvs]
                continue
            self._ok(i)
            for (k, _), r in zip(kvs, results):
                if isinstance(r, Exception):  # e.g. OOM: one value larger than maxmemory allows
                    refused.append((k, f"{self.host_name(i)}: {r}"))
        return retry, refused, errors

    def num_keys(self, prefix: bytes) -> int:
        total = 0
        for i in range(len(self.endpoints)):
            c = self._client(i)
            total += c.dbsize() if self.owned else sum(1 for _ in c.scan_iter(match=prefix + b"*", count=1000))
        return total

    def close(self) -> None:
        for c in self._clients:
            if c is not None:
                try:
                    c.close()
                except Exception:  # noqa: BLE001
                    pass
        self._clients = [None] * len(self.endpoints)


class _LocalBackend:
    name = "local"

    def __init__(self, store):
        self.store = store
        self.on_down = self.on_up = None

    def get(self, key: bytes) -> Optional[bytes]:
        try:
            return self.store.get(key)
        except OSError as e:
            raise BackendError(f"local cache read in {self.store.path} failed: {e}") from None

    def put_many(self, items):
        try:
            too_big = self.store.put_many(items)
        except OSError as e:
            return [k for k, _ in items], [], [BackendError(f"local cache write in {self.store.path} failed: {e}")]
        return [], [(k, f"value larger than capacity_per_node={self.store.capacity}") for k in too_big], []

    def num_keys(self, prefix: bytes) -> int:
        return self.store.num_keys()

    def close(self) -> None:
        pass


# ==== where the backend lives: per process registry, rendezvous through rumor's store ================

_registry_lock = threading.Lock()
_registry: Dict[Tuple[str, str], Any] = {}  # (backend, dataset_name) -> (endpoints or store, owned resource)


def _rumor_context():
    """(store, machine_rank, machine_size, local_rank, advertise address, timeout) when rumor is
    initialized with more than one rank, else None."""
    from .. import _rendezvous
    from .. import _runtime as rt

    if not rt.is_initialized():
        return None
    st = rt.state()
    if st.env.size == 1 or rt.rendezvous_store() is None:
        return None
    addr = _rendezvous.advertise_address(st.env.master_addr, st.env.master_port)
    return rt.rendezvous_store(), st.machine_rank, st.machine_size, st.local_rank, addr, st.timeout


def _wait_key(store, key: str, timeout: float, what: str) -> bytes:
    import datetime

    try:
        store.wait([key], datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001  (torch raises its own DistStoreError / RuntimeError)
        raise RuntimeError(f"rumor.data: {what} was not published within {timeout:.0f} s (rendezvous key "
                           f"{key!r}): does every host create the cache with the same dataset_name? ({e})") from None
    return bytes(store.get(key))


def _single_process_note() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        log.info("rumor.data: rumor.init() was not called, so this process uses a cache of its own; call "
                 "rumor.init() first to share one cache per host between the ranks")


# ---- entries of rumor's rendezvous store ----
# torch's TCPStore can be read and written by anyone who reaches it on the network: entries the
# ranks act on carry a MAC keyed by the job secret (bound to the entry's name) and are validated.

_STORE_MAC_LABEL = "data-cache-store"
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def _job_secret() -> _secret.JobSecret:
    from .. import _runtime

    return _runtime.job_secret()


def _publish(store, key: str, value: Any) -> None:
    body = json.dumps(value, sort_keys=True)
    tag = _secret.mac(_job_secret().key(_STORE_MAC_LABEL), key.encode(), body.encode())
    store.set(key, json.dumps({"v": body, "mac": tag.hex()}))


def _fetch(store, key: str, timeout: float, what: str) -> Any:
    raw = _wait_key(store, key, timeout, what)
    try:
        outer = json.loads(raw)
        body, tag = outer["v"], bytes.fromhex(outer["mac"])
        if not isinstance(body, str):
            raise TypeError("'v' is not a str")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise StoreEntryRefused(f"rumor.data: the rendezvous entry {key!r} ({what}) is malformed ({e}); "
                                "refusing it") from None
    if not _secret.mac_ok(_job_secret().key(_STORE_MAC_LABEL), tag, key.encode(), body.encode()):
        raise StoreEntryRefused(
            f"rumor.data: the rendezvous entry {key!r} ({what}) fails its MAC check: it was not written by a rank "
            f"of this job (or the ranks have different job secrets, {_secret.SECRET_ENV}); refusing it")
    try:
        return json.loads(body)
    except ValueError as e:
        raise StoreEntryRefused(f"rumor.data: the rendezvous entry {key!r} ({what}) is malformed ({e})") from None


def _check_endpoint(e: Any, key: str, password: Optional[str]) -> Dict[str, Any]:
    """A redis endpoint from the store: {"host": an IP address or host name, "port": 1..65535}
    (+ "password" in an unauthenticated job). password: the derived one, which replaces any."""
    def bad(why):
        return StoreEntryRefused(f"rumor.data: the redis endpoint in rendezvous entry {key!r} is refused: {why}")

    if not isinstance(e, dict) or not {"host", "port"} <= set(e) or set(e) - {"host", "port", "password"}:
        raise bad(f"expected {{'host', 'port'}}, got {e!r}")
    host, port = e["host"], e["port"]
    if not isinstance(host, str):
        raise bad(f"host {host!r} is not a str")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.match(host):
            raise bad(f"host {host!r} is neither an IP address nor a host name") from None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise bad(f"port {port!r} is not an int in 1..65535")
    if password is None:
        pw = e.get("password")
        if not isinstance(pw, str) or not pw:
            raise bad("no password")
    else:
        pw = password
    return {"host": host, "port": port, "password": pw}


def _check_local_path(path: Any, key: str) -> str:
    """A local cache directory from the store: one of this user's cache directories directly in
    this user's private directory, private itself."""
    from ._local_store import check_cache_dir

    def bad(why):
        return StoreEntryRefused(f"rumor.data: the local cache path in rendezvous entry {key!r} is refused: {why}")

    if not isinstance(path, str):
        raise bad(f"{path!r} is not a str")
    private = _secret.private_dir()
    if os.path.dirname(path) != private or not os.path.basename(path).startswith("rumor-cache-"):
        raise bad(f"{path!r} is not a rumor-cache-* directory in the private directory {private}")
    try:
        check_cache_dir(path)
    except FileNotFoundError:
        raise bad(f"{path} does not exist") from None
    except _secret.UntrustedFileError as e:
        raise bad(str(e)) from None
    return path


def _redis_password() -> Optional[str]:
    """The password of the job's own redis servers when the job is authenticated: derived from the
    job secret on every rank, so it never enters the store. None: unauthenticated (random, published)."""
    js = _job_secret()
    return js.key("redis-password").hex() if js.authenticated else None


def _open_redis(name: str, capacity: int, hosts, op_timeout: float, connect_timeout: float, backoff):
    if hosts is None and os.environ.get("RUMOR_CACHE_HOSTS"):
        hosts = json.loads(os.environ["RUMOR_CACHE_HOSTS"])
    if hosts is not None:
        return _RedisBackend(_validate_hosts(hosts), op_timeout, connect_timeout, backoff, owned=False), None
    from ._redis_server import RedisServer

    with _registry_lock:
        reg = _registry.get(("redis", name))
        if reg is not None:
            # Each loader gets its own client object (own hooks and back-off), same servers.
            return _RedisBackend(reg[0], op_timeout, connect_timeout, backoff, owned=True), None
        ctx = _rumor_context()
        server = None
        if ctx is None:
            _single_process_note()
            server = RedisServer("127.0.0.1", capacity).start()
            endpoints = [server.endpoint()]
        else:
            store, machine, machines, local, addr, timeout = ctx
            password = _redis_password()
            if local == 0:
                if machines == 1:
                    bind = "127.0.0.1"
                elif addr.startswith("127.") and not os.environ.get("RUMOR_ADVERTISE_ADDR"):
                    raise RuntimeError(
                        f"rumor.data: this host's address resolves to {addr}, a loopback address the other "
                        f"{machines - 1} host(s) cannot reach (often /etc/hosts maps the hostname to 127.0.1.1); "
                        "set RUMOR_ADVERTISE_ADDR to this host's address on the job's network")
                else:
                    bind = addr
                server = RedisServer(bind, capacity, password=password).start()
                entry = {"host": server.host, "port": server.port}
                if password is None:  # unauthenticated job: the ranks have nothing to derive it from
                    entry["password"] = server.password
                _publish(store, f"cache/redis/{name}/{machine}", entry)
            endpoints = []
            for m in range(machines):
                key = f"cache/redis/{name}/{m}"
                e = _fetch(store, key, timeout, f"the redis server of host {m} (its local rank 0 starts it)")
                endpoints.append(_check_endpoint(e, key, password))
        _registry[("redis", name)] = (endpoints, server)
        return _RedisBackend(endpoints, op_timeout, connect_timeout, backoff, owned=True), server


def _open_local(name: str, capacity: int, local_dir: Optional[str]):
    from ._local_store import LocalStore

    if local_dir is not None:
        from ._local_store import check_cache_dir

        os.makedirs(local_dir, mode=0o700, exist_ok=True)
        check_cache_dir(local_dir)  # this user's and private, or refused naming the fix
        for f in ("lock", "size"):
            p = os.path.join(local_dir, f)
            if not os.path.exists(p):
                with open(p, "ab"):
                    pass
        return _LocalBackend(LocalStore(capacity, name, path=local_dir, create=False)), None
    with _registry_lock:
        reg = _registry.get(("local", name))
        if reg is not None:
            return _LocalBackend(reg[0]), None
        ctx = _rumor_context()
        owned = None
        if ctx is None:
            _single_process_note()
            owned = store = LocalStore(capacity, name)
        else:
            rstore, machine, _, local, _, timeout = ctx
            key = f"cache/local/{name}/{machine}"
            if local == 0:
                owned = store = LocalStore(capacity, name)
                _publish(rstore, key, store.path)
            else:
                path = _check_local_path(_fetch(rstore, key, timeout, f"the local cache directory of host {machine}"),
                                         key)
                store = LocalStore(capacity, name, path=path, create=False)
        _registry[("local", name)] = (store, owned)
        return _LocalBackend(store), owned


_default_note = [False]


def _default_backend() -> str:
    from ._redis_server import redis_server_path

    try:
        import redis  # noqa: F401
        have_client = True
    except ImportError:
        have_client = False
    if have_client and redis_server_path() is not None:
        return "redis"
    if not _default_note[0]:
        _default_note[0] = True
        missing = "redis-server" if have_client else "the redis Python package (pip install redis)"
        log.info("rumor.data: %s is not installed: caching in node-local shared memory (backend='local')", missing)
    return "local"


# ==== the cache ======================================================================================

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
                raise RuntimeError("rumor.data: backend='redis' needs redis-py: pip install redis") from None
        self.backend_name, self.dataset_name = backend, dataset_name
        self.writer_buffer_size, self.allow_pickle = writer_buffer_size, bool(allow_pickle)
        self.max_pending_bytes, self.max_pending_writes = int(max_pending_bytes), int(max_pending_writes)
        self._prefix = f"rumor:{dataset_name}:".encode()
        # Values are sealed with this key (bound to their cache key): a copy in a DataLoader worker
        # takes it along, so that it reads and writes what the job's ranks do.
        self._mac_key = _job_secret().key("data-cache")
        if backend == "redis":
            self._backend, self._owned = _open_redis(dataset_name, capacity_per_node, hosts, float(op_timeout),
                                                     float(connect_timeout), tuple(backoff))
        else:
            self._backend, self._owned = _open_local(dataset_name, capacity_per_node, local_dir)
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

    Arguments as CacheLoader's (dataset_name is required). Call on_epoch_end() after each epoch
    (or flush()); close() at the end, or use it as a context manager. Sample values must be
    tensors, numpy arrays, numbers, str/bytes or lists/tuples/dicts of those (or anything with
    allow_pickle=True). Values come back on the CPU, without requires_grad.
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
        self.cache_loader.flush()

    def on_epoch_end(self) -> None:
        self.cache_loader.on_epoch_end()

    def stats(self) -> Dict[str, int]:
        return self.cache_loader.stats()

    def num_keys(self) -> int:
        return self.cache_loader.num_keys()

    def close(self) -> None:
        self.cache_loader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
