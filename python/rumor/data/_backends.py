"""The cache's storage backends: redis servers (keys spread by rendezvous hashing) and the
node-local shared-memory store, behind one small interface (get, put_many, num_keys, close).

A backend counts nothing and warns about nothing: it raises BackendError (or _Unavailable while a
host backs off) and reports hosts going down and up through its on_down / on_up hooks, so that
the CacheLoader using it decides what a failure costs.
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple


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
