"""A torch.distributed.Store kept in an etcd cluster (rumor-run --live --store etcd; docs/elastic.md,
"No single point of failure").

The live protocol and each init()'s rendezvous need one store every process agrees through. A
TCPStore lives in one process: when that process (or its host) goes, the job goes. etcd keeps
its keys on every member of a Raft group, so the store outlives any one member while a majority
is up. This module speaks etcd's v3 JSON gateway (POST /v3/kv/..., keys and values in base64)
with the standard library only: one keep-alive connection per store object, moving on to the
next endpoint when one does not answer.

Semantics are TCPStore's, op for op (tests/python/test_etcd_store.py runs both side by side):
get and wait block until the keys exist, up to the store's timeout; add and compare_set are
atomic, as etcd transactions that compare the key's mod_revision (add) or value (compare_set)
and retry when another writer came first. Every call has a deadline (the store's timeout);
when no endpoint answers before it, the error names the op and the endpoints.

One limit, which TCPStore shares: an add whose request reached a member that then failed
before answering is retried on another member, and may then count twice (the retry cannot tell
whether the first attempt was applied). The live protocol's counters tolerate that: heartbeats
and the events counter only need to move, and a newcomer number drawn twice leaves a gap that
nobody waits for.
"""
from __future__ import annotations

import base64
import datetime
import http.client
import json
import os
import ssl
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union
from urllib.parse import urlsplit

import torch.distributed as dist

ENDPOINTS_ENV = "RUMOR_ETCD_ENDPOINTS"  # comma-separated http(s)://host:port of the store's etcd members
# 1: the endpoints are those of a cluster rumor-run runs, whose members may be replaced: a client
# that had to move on from one learns the current members' client URLs from the cluster.
FOLLOW_ENV = "RUMOR_ETCD_FOLLOW"
# One attempt at one member: past this the member counts as unreachable (a host that vanished
# answers nothing, not even a reset) and the next one is tried, within the call's deadline.
_ATTEMPT_S = 3.0
_RELEARN_S = 0.5
_Value = Union[str, bytes]
# How a kept-alive connection the other side closed while idle fails on its next request.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class EtcdStoreError(dist.DistStoreError):
    """A store op failed: no endpoint answered before the deadline, or etcd refused the request.
    A torch DistStoreError, as TCPStore's failures are."""


class EtcdStoreTimeout(EtcdStoreError, TimeoutError):
    """get/wait: the keys did not appear before the deadline."""


def parse_endpoints(spec: str) -> List[str]:
    """"etcd://h1:2379,h2:2379" or "http://h1:2379,https://h2:2379" -> ["http://h1:2379", ...]
    (etcd:// means plain http; an endpoint without a scheme takes the first one's)."""
    spec = spec.strip()
    scheme = "http"
    if spec.startswith("etcd://"):
        spec = spec[len("etcd://"):]
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "://" in part:
            scheme = part.split("://", 1)[0]
        else:
            part = f"{scheme}://{part}"
        u = urlsplit(part)
        if u.scheme not in ("http", "https") or not u.hostname or u.port is None or u.path not in ("", "/"):
            raise ValueError(f"rumor: etcd endpoint {part!r}: expected http(s)://host:port or host:port")
        out.append(f"{u.scheme}://{u.netloc}")
    if not out:
        raise ValueError(f"rumor: no etcd endpoint in {spec!r}: expected host:port[,host:port...]")
    return out


def _b64(v: _Value) -> str:
    return base64.b64encode(v.encode() if isinstance(v, str) else bytes(v)).decode()


def _unb64(v: Optional[str]) -> bytes:
    return base64.b64decode(v) if v else b""


class EtcdStore(dist.Store):
    """The store, on the etcd members at endpoints (tried in order; the one that answered last
    first). timeout: seconds every call may take, get and wait included (set_timeout changes
    it, as on any torch Store). ssl_context: for https endpoints (the job CA and this host's
    certificate for mutual TLS); None: the system's defaults."""

    def __init__(self, endpoints: Sequence[str], timeout: float = 300.0,
                 ssl_context: Optional[ssl.SSLContext] = None, follow: bool = False):
        """follow: after a call that had to move on from an endpoint, replace the endpoints by the
        client URLs of the cluster's members (the one that answered first): a member that replaced
        a lost one is found. Only for a cluster whose members advertise URLs every client can
        reach (the ones rumor-run starts do)."""
        super().__init__()
        self.follow = follow
        eps = parse_endpoints(",".join(endpoints)) if not isinstance(endpoints, str) else parse_endpoints(endpoints)
        self.endpoints: List[str] = eps
        self._ssl = ssl_context
        self._cur = 0
        self._conn: Optional[http.client.HTTPConnection] = None
        self._lock = threading.Lock()
        self._prefix = ""
        self._read: dict = {}  # extra fields of every range request
        self._relearn: Optional[float] = None  # follow: when to ask for the members again
        self.set_timeout(datetime.timedelta(seconds=float(timeout)))

    def with_prefix(self, prefix: str) -> "EtcdStore":
        """A store of its own (its own connection) whose keys are under prefix, laid out as a
        torch PrefixStore lays them out. Use it instead of wrapping this store in a PrefixStore:
        torch's PrefixStore keeps only the C++ side of a Python store alive, and the store's
        methods are gone once the last Python reference to it is."""
        s = self.copy()
        s._prefix = f"{self._prefix}{prefix}/"
        return s

    def local_reads(self) -> "EtcdStore":
        """A copy whose reads are serializable: answered by the first member that answers, from
        what it has applied, without asking the majority; so they are answered where a majority
        is gone too, and may miss the latest writes by a heartbeat. Writes are as ever."""
        s = self.copy()
        s._read = {"serializable": True}
        return s

    def copy(self) -> "EtcdStore":
        """The same store (endpoints, TLS, prefix, timeout) over a connection of its own."""
        s = EtcdStore(self.endpoints, self.timeout.total_seconds(), self._ssl, self.follow)
        s._prefix, s._read = self._prefix, dict(self._read)
        return s

    def prefer(self, endpoint: str) -> None:
        """endpoint (one of the cluster's members) is tried first from the next call on."""
        with self._lock:
            self.endpoints = [endpoint] + [e for e in self.endpoints if e != endpoint]
            self._cur = 0
            self._drop()

    def _key(self, key: str) -> str:
        return _b64(self._prefix + key)

    # ---- transport ------------------------------------------------------------------------

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout.total_seconds()

    def _connect(self, i: int, attempt_s: float) -> http.client.HTTPConnection:
        u = urlsplit(self.endpoints[i])
        if u.scheme == "https":
            ctx = self._ssl or ssl.create_default_context()
            return http.client.HTTPSConnection(u.hostname, u.port, timeout=attempt_s, context=ctx)
        return http.client.HTTPConnection(u.hostname, u.port, timeout=attempt_s)

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _call(self, path: str, body: dict, op: str, deadline: Optional[float] = None) -> dict:
        """POSTs body to /v3/<path> on the first member that answers; retries over the members
        (pausing after each full round) until the deadline."""
        deadline = self._deadline() if deadline is None else deadline
        with self._lock:
            out, moved = self._post(path, json.dumps(body).encode(), op, deadline)
            if self.follow and (moved or (self._relearn is not None and time.monotonic() >= self._relearn)):
                self._learn_members(deadline)
            return out

    def _learn_members(self, deadline: float) -> None:
        """The endpoints become the members' client URLs, the one that just answered first (a
        member added but not started yet has none). On no answer they stay as they were."""
        try:
            r, _ = self._post("cluster/member/list", b"{}", "member list", min(deadline, time.monotonic() + _ATTEMPT_S))
        except EtcdStoreError:
            return
        members = r.get("members") or []
        urls = [u.rstrip("/") for m in members for u in m.get("clientURLs") or []]
        # A member added but not started yet (one replacing a lost one) gets its URL when it
        # starts: asked again shortly, so that it is not missed until the next failure.
        self._relearn = time.monotonic() + _RELEARN_S if any(not m.get("clientURLs") for m in members) else None
        here = self.endpoints[self._cur]
        if urls and here in urls:
            self.endpoints = [here] + [u for u in urls if u != here]
            self._cur = 0

    def _post(self, path: str, data: bytes, op: str, deadline: float):
        """_call's transport, under the lock: (the answer, whether an endpoint failed first)."""
        errors: List[str] = []
        moved = False
        pause = 0.01
        while True:
            for _ in range(len(self.endpoints)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                attempt = min(left, _ATTEMPT_S)
                reused = self._conn is not None
                try:
                    if self._conn is None:
                        self._conn = self._connect(self._cur, attempt)
                    self._conn.timeout = attempt
                    if self._conn.sock is not None:
                        self._conn.sock.settimeout(attempt)
                    self._conn.request("POST", f"/v3/{path}", data, {"Content-Type": "application/json"})
                    resp = self._conn.getresponse()
                    raw = resp.read()
                    status = resp.status
                except (OSError, http.client.HTTPException) as e:
                    errors.append(f"{self.endpoints[self._cur]}: {type(e).__name__}: {e}")
                    self._drop()
                    if reused and isinstance(e, _STALE):
                        continue  # a kept-alive connection the member had closed: once more, anew
                    self._cur = (self._cur + 1) % len(self.endpoints)
                    moved = True
                    continue
                if status == 200:
                    return (json.loads(raw) if raw else {}), moved
                msg = raw.decode(errors="replace")[:300]
                if status < 500:  # the request itself is wrong: another member would say the same
                    raise EtcdStoreError(f"rumor: etcd store: {op}: {self.endpoints[self._cur]} refused the "
                                         f"request (HTTP {status}): {msg}")
                # 5xx: no leader, leader changed, a member cut off from the majority: try another
                errors.append(f"{self.endpoints[self._cur]}: HTTP {status}: {msg}")
                self._drop()
                self._cur = (self._cur + 1) % len(self.endpoints)
                moved = True
            if time.monotonic() + pause >= deadline:
                raise EtcdStoreError(
                    f"rumor: etcd store: {op}: no etcd member answered before the call's deadline "
                    f"(store timeout {self.timeout.total_seconds():g} s; endpoints {', '.join(self.endpoints)}); "
                    f"last errors: {'; '.join(errors[-len(self.endpoints):]) or 'none (no time left)'}")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def _range(self, key: str, op: str) -> Optional[dict]:
        kvs = self._call("kv/range", {"key": self._key(key), **self._read}, op).get("kvs") or []
        return kvs[0] if kvs else None

    def _exist(self, keys: Sequence[str], op: str, deadline: Optional[float] = None) -> List[bool]:
        # One transaction of count-only ranges: one round trip for any number of keys.
        r = self._call("kv/txn", {"success": [{"request_range": {"key": self._key(k), "count_only": True, **self._read}}
                                              for k in keys]}, op, deadline)
        return [int(x.get("response_range", {}).get("count", 0)) > 0 for x in r.get("responses", [])]

    def _await(self, keys: Sequence[str], op: str, deadline: float) -> None:
        pause = 0.002
        while True:
            if all(self._exist(keys, op, max(deadline, time.monotonic() + _ATTEMPT_S))):
                return
            if time.monotonic() >= deadline:
                missing = [k for k, ok in zip(keys, self._exist(keys, op)) if not ok]
                raise EtcdStoreTimeout(f"rumor: etcd store: {op}: wait timeout after "
                                       f"{self.timeout.total_seconds():g} s, keys {missing} did not appear "
                                       f"(endpoints {', '.join(self.endpoints)})")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)

    # ---- the Store interface ---------------------------------------------------------------

    def set(self, key: str, value: _Value) -> None:
        self._call("kv/put", {"key": self._key(key), "value": _b64(value)}, f"set({key!r})")

    def get(self, key: str) -> bytes:
        op = f"get({key!r})"
        deadline = self._deadline()
        kv = self._range(key, op)
        if kv is None:
            self._await([key], op, deadline)
            kv = self._range(key, op)
            if kv is None:  # deleted in between
                raise EtcdStoreTimeout(f"rumor: etcd store: {op}: the key was deleted while waiting for it")
        return _unb64(kv.get("value"))

    def add(self, key: str, amount: int) -> int:
        op = f"add({key!r}, {amount})"
        kv = self._range(key, op)
        while True:
            rev = int(kv.get("mod_revision", 0)) if kv else 0
            try:
                now = int(_unb64(kv.get("value"))) if kv else 0
            except ValueError:
                raise EtcdStoreError(f"rumor: etcd store: {op}: the key's value is not an integer") from None
            if kv is not None and amount == 0:
                return now
            new = now + int(amount)
            # Applied only if nobody wrote the key since it was read (mod_revision 0: it still
            # does not exist); else the failure branch returns the key as it is now, and again.
            r = self._call("kv/txn", {
                "compare": [{"key": self._key(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(rev)}],
                "success": [{"request_put": {"key": self._key(key), "value": _b64(str(new))}}],
                "failure": [{"request_range": {"key": self._key(key)}}]}, op)
            if r.get("succeeded"):
                return new
            kvs = r["responses"][0]["response_range"].get("kvs") or []
            kv = kvs[0] if kvs else None

    def compare_set(self, key: str, expected_value: _Value, desired_value: _Value) -> bytes:
        # TCPStore's rule: a missing key is set only when expected is empty, and the value the
        # key holds afterwards is returned (expected itself when the key is missing and stays so).
        op = f"compare_set({key!r})"
        exp = expected_value.encode() if isinstance(expected_value, str) else bytes(expected_value)
        want = desired_value.encode() if isinstance(desired_value, str) else bytes(desired_value)
        if exp:
            cmp = {"key": self._key(key), "target": "VALUE", "result": "EQUAL", "value": _b64(exp)}
        else:
            cmp = {"key": self._key(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        r = self._call("kv/txn", {"compare": [cmp],
                                  "success": [{"request_put": {"key": self._key(key), "value": _b64(want)}}],
                                  "failure": [{"request_range": {"key": self._key(key)}}]}, op)
        if r.get("succeeded"):
            return want
        kvs = r["responses"][0]["response_range"].get("kvs") or []
        return _unb64(kvs[0].get("value")) if kvs else exp

    def check(self, keys: List[str]) -> bool:
        return all(self._exist(list(keys), f"check({list(keys)!r})"))

    def wait(self, keys: List[str], timeout: Optional[datetime.timedelta] = None) -> None:
        t = self.timeout if timeout is None else timeout
        self._await(list(keys), f"wait({list(keys)!r})", time.monotonic() + t.total_seconds())

    def multi_get(self, keys: List[str]) -> List[bytes]:
        op = f"multi_get({list(keys)!r})"
        self._await(list(keys), op, self._deadline())
        ranges = [{"request_range": {"key": self._key(k), **self._read}} for k in keys]
        r = self._call("kv/txn", {"success": ranges}, op)
        out = []
        for k, x in zip(keys, r.get("responses", [])):
            kvs = x.get("response_range", {}).get("kvs") or []
            if not kvs:
                raise EtcdStoreTimeout(f"rumor: etcd store: {op}: {k!r} was deleted while waiting for it")
            out.append(_unb64(kvs[0].get("value")))
        return out

    def multi_set(self, keys: List[str], values: List[_Value]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"rumor: etcd store: multi_set: {len(keys)} keys but {len(values)} values")
        self._call("kv/txn", {"success": [{"request_put": {"key": self._key(k), "value": _b64(v)}}
                                          for k, v in zip(keys, values)]}, f"multi_set({list(keys)!r})")

    def delete_key(self, key: str) -> bool:
        r = self._call("kv/deleterange", {"key": self._key(key)}, f"delete_key({key!r})")
        return int(r.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        """Every key in the cluster (a cluster may hold several jobs' keys, as a shared TCPStore does)."""
        r = self._call("kv/range", {"key": _b64(b"\0"), "range_end": _b64(b"\0"), "count_only": True}, "num_keys()")
        return int(r.get("count", 0))

    # ---- beyond the Store interface: what rumor-run's launchers use ---------------------------

    def scan(self, prefix: str) -> Dict[str, bytes]:
        """Every key under prefix (within this store's own prefix), with its value, in one call."""
        start = (self._prefix + prefix).encode()
        if not start:  # every key: etcd's range from \0 to \0
            start = end = b"\0"
        else:  # keys of rumor's prefixes are text: their last byte is below 0xff
            end = start[:-1] + bytes([start[-1] + 1])
        r = self._call("kv/range", {"key": _b64(start), "range_end": _b64(end), **self._read}, f"scan({prefix!r})")
        cut = len(self._prefix)
        return {_unb64(kv["key"]).decode()[cut:]: _unb64(kv.get("value")) for kv in r.get("kvs") or []}

    def members(self) -> List[dict]:
        """The cluster's members: {"ID", "name", "peerURLs", "clientURLs"} each; a member added but
        not started yet has no name and no client URLs."""
        return self._call("cluster/member/list", {}, "member list").get("members") or []

    def add_member(self, peer_url: str) -> Tuple[str, List[dict]]:
        """Adds a member that will listen for peers at peer_url (started afterwards, with
        --initial-cluster-state existing). Returns its ID and the members, it among them."""
        r = self._call("cluster/member/add", {"peerURLs": [peer_url]}, f"member add({peer_url})")
        return str(r["member"]["ID"]), r.get("members") or []

    def remove_member(self, member_id: str) -> None:
        self._call("cluster/member/remove", {"ID": member_id}, f"member remove({member_id})")

    def try_lock(self, key: str, ttl_s: int) -> Optional[str]:
        """key is created for a lease of ttl_s seconds unless it exists: returns the lease (pass
        it to unlock), or None when another holder has the key. A holder that dies loses it
        when its lease runs out, as it then renews it no more."""
        lease = str(self._call("lease/grant", {"TTL": int(ttl_s)}, f"lease grant({ttl_s} s)")["ID"])
        r = self._call("kv/txn", {
            "compare": [{"key": self._key(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": self._key(key), "value": _b64(lease), "lease": lease}}]},
            f"lock({key!r})")
        if r.get("succeeded"):
            return lease
        self.unlock(lease)
        return None

    def unlock(self, lease: str) -> None:
        """Ends the lease try_lock returned, and with it the key it holds."""
        self._call("lease/revoke", {"ID": lease}, f"lease revoke({lease})")


def tls_context_from_env() -> Optional[ssl.SSLContext]:
    """For https endpoints: the CA in RUMOR_TLS_CA and, when given, this host's certificate and
    key (RUMOR_TLS_CERT/KEY) for members that ask clients for one (rumor-run --tls auto makes all
    three); None without RUMOR_TLS_CA (the system's CAs)."""
    ca = os.environ.get("RUMOR_TLS_CA", "").strip()
    if not ca:
        return None
    ctx = ssl.create_default_context(cafile=ca)
    cert, key = os.environ.get("RUMOR_TLS_CERT", "").strip(), os.environ.get("RUMOR_TLS_KEY", "").strip()
    if cert and key:
        ctx.load_cert_chain(cert, key)
    return ctx


def from_env(timeout: float) -> Optional[EtcdStore]:
    """The store RUMOR_ETCD_ENDPOINTS names (rumor-run --live --store etcd sets it), or None."""
    spec = os.environ.get(ENDPOINTS_ENV, "").strip()
    if not spec:
        return None
    endpoints = parse_endpoints(spec)
    tls = tls_context_from_env() if any(e.startswith("https://") for e in endpoints) else None
    return EtcdStore(endpoints, timeout, tls, follow=os.environ.get(FOLLOW_ENV, "").strip() == "1")

