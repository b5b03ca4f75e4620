"""Where a cache's backend lives: one per (backend, dataset_name) per process, found by the
ranks of a job through rumor's rendezvous store (local rank 0 starts the redis server or creates
the shared-memory directory and publishes it; the other ranks fetch, check and use it).

torch's TCPStore can be read and written by anyone who reaches it on the network, so every entry
the ranks act on carries a MAC keyed by the job secret and is validated before use.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from .. import _secret
from ._backends import _LocalBackend, _RedisBackend, _validate_hosts

log = logging.getLogger("rumor.data")


class StoreEntryRefused(RuntimeError):
    """An entry of rumor's rendezvous store (a redis endpoint, a local cache path) that fails its
    MAC or its validation: someone other than the job's ranks wrote it, or it is malformed."""



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


def _open_redis(name: str, capacity: int, hosts, op_timeout: float, connect_timeout: float, backoff,
                rumor_context: Callable[[], Optional[tuple]] = _rumor_context):
    if hosts is None and os.environ.get("RUMOR_CACHE_HOSTS", "").strip():
        raw = os.environ["RUMOR_CACHE_HOSTS"]
        try:
            hosts = json.loads(raw)
        except ValueError:
            # The value is not echoed: it may hold the servers' passwords.
            raise ValueError("environment variable RUMOR_CACHE_HOSTS is not valid JSON: expected a JSON list of "
                             '{"host": ..., "port": ..., "password": ...} objects, e.g. [{"host": "10.0.0.1", '
                             '"port": 6379}]') from None
    if hosts is not None:
        return _RedisBackend(_validate_hosts(hosts), op_timeout, connect_timeout, backoff, owned=False), None
    from ._redis_server import RedisServer

    with _registry_lock:
        reg = _registry.get(("redis", name))
        if reg is not None:
            # Each loader gets its own client object (own hooks and back-off), same servers.
            return _RedisBackend(reg[0], op_timeout, connect_timeout, backoff, owned=True), None
        ctx = rumor_context()
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


def _open_local(name: str, capacity: int, local_dir: Optional[str],
                rumor_context: Callable[[], Optional[tuple]] = _rumor_context):
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
        ctx = rumor_context()
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
        missing = "redis-server" if have_client else "the redis Python package (pip install 'rumor[cache]')"
        log.info("rumor.data: %s is not installed: caching in node-local shared memory (backend='local')", missing)
    return "local"

