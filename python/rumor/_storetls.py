"""TLS on the rendezvous store's traffic between hosts (docs/security.md, "The rendezvous store").

torch's TCPStore speaks only clear TCP, and rumor's extension must not include torch headers, so
the launchers carry the store's bytes through TLS tunnels of their own (Python's ssl: TLS 1.3
only, certificates required both ways, the job's CA):

    node 0 (hosts the store)                          node k > 0
    TCPStore on 127.0.0.1:L  <-- Terminator on        Forwarder on 127.0.0.1:F <-- agent, workers
    (agent, workers)             the public port  <== TLS ==  (dials the public port)

torchrun's static rendezvous (--nnodes N --node-rank K --master-addr A --master-port P) makes
node 0's agent host the TCPStore and every agent a client of it, and hands the same address to
its workers as MASTER_ADDR/MASTER_PORT (the agent's store is shared with them). So the launcher
rewrites the address torchrun sees to the local end of its tunnel: node 0 binds the real store
to loopback itself (torch's TCPStore binds every interface unless given a listening socket) and
torch's multi-tenant TCPStore reuses that server on the same port; the other nodes point at their
forwarder. The workers then get a loopback MASTER_ADDR, so the launcher names the public store
address in RUMOR_ROUTE_ADDR, from which rumor.init() finds the interface to advertise.

Where no launcher carries the store, rumor.init() opens the same ends itself: with srun or mpirun
its rank 0 hosts the store (worker_store: the terminator on MASTER_PORT); under a torchrun agent
whose store is across the network (plain torchrun, or a c10d or elastic rendezvous) rumor's keys
move to a store rank 0 serves behind a terminator, and the agent's store holds only its address
(rank_store).

A forwarder listens on loopback, where any local user could connect and be carried to the store
with this node's certificate; it therefore serves only connections of its own uid, found in
/proc/net/tcp{,6} (the connecting socket's line: its uid column). The store's host keeps the
real TCPStore on loopback, reachable by that host's local users as before (torch's TCPStore
checks nobody); what rumor reads from it is MAC'd with the job secret either way.
"""
from __future__ import annotations

import atexit
import collections
import ipaddress
import logging
import os
import selectors
import socket
import ssl
import sys
import threading
import time
from typing import Callable, List, Optional, Tuple

from ._env import env_bool, env_int, tls_files

# Bytes read from one side per call: large, so a big value crosses in few records.
CHUNK = 256 * 1024
# Bytes held for a side that does not read before the other side is not read any more.
CAP = 4 * CHUNK
HANDSHAKE_S = 15.0   # from accept (or connect) to the end of the TLS handshake
CONNECT_S = 300.0    # a forwarder dials the store this long (the store's host may start later)
FLUSH_S = 10.0       # once one side ended: the most time given to deliver what it sent
MAX_CONNECTIONS = 512
# Connections still in their handshake: past this many, the oldest is dropped, so that strangers
# holding connections open cannot keep the job's own from being served.
MAX_PENDING = 64
_TAG = "rumor-run: store TLS"


def _log(text: str, tag: str = _TAG) -> None:
    print(f"{tag}: {text}", file=sys.stderr, flush=True)


class _Limiter:
    """At most `per_s` lines a second, then a count of what was left out."""

    def __init__(self, per_s: int = 5, tag: str = _TAG):
        self.per_s, self.window, self.n, self.dropped = per_s, 0, 0, 0
        self.tag = tag
        self.lock = threading.Lock()

    def __call__(self, text: str) -> None:
        with self.lock:
            now = int(time.monotonic())
            if now != self.window:
                if self.dropped:
                    _log(f"({self.dropped} more like this left out)", self.tag)
                self.window, self.n, self.dropped = now, 0, 0
            self.n += 1
            if self.n > self.per_s:
                self.dropped += 1
                return
        _log(text, self.tag)


def _context(server: bool, cert: str, key: str, ca: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    if server:
        ctx.num_tickets = 0  # no resumption: every connection proves its certificate
    else:
        ctx.check_hostname = False  # the name, when asked for, is checked by _check_name
    return ctx


def _cert_names(cert: dict) -> List[str]:
    names = [v for k, v in cert.get("subjectAltName", ()) if k in ("DNS", "IP Address")]
    return names + [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]


def _check_name(tls: ssl.SSLSocket, peer_name: Optional[str]) -> None:
    """RUMOR_TLS_PEER_NAME: the peer's certificate must carry it (as the data channels ask)."""
    if peer_name and peer_name not in _cert_names(tls.getpeercert() or {}):
        raise ssl.SSLError(f"the peer's certificate does not name {peer_name!r} (RUMOR_TLS_PEER_NAME)")


def _hex_addr(ip: str) -> str:
    """An address as /proc/net/tcp{,6} writes it: each 32-bit word in host (little-endian) order."""
    raw = ipaddress.ip_address(ip).packed
    return "".join(raw[i:i + 4][::-1].hex().upper() for i in range(0, len(raw), 4))


def _proc_forms(addr: Tuple) -> List[str]:
    """addr ("ip", port) as /proc/net/tcp{,6} may write it: an IPv4 address is in tcp, or in tcp6
    as ::ffff:a.b.c.d when the other end's socket is an IPv6 one (torch's TCPStore client)."""
    ip = ipaddress.ip_address(addr[0].split("%")[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    forms = [str(ip)] if ip.version == 6 else [str(ip), f"::ffff:{ip}"]
    return [f"{_hex_addr(a)}:{addr[1]:04X}" for a in forms]


def peer_uid(conn: socket.socket, proc_net: str = "/proc/self/net") -> Optional[int]:
    """The uid owning the other end of `conn`, a connection accepted on loopback: the line of
    /proc/net/tcp{,6} whose local address is the peer's and whose remote address is ours. None
    when no line matches (the peer closed already, or it is not on this host)."""
    local, remote = _proc_forms(conn.getpeername()), _proc_forms(conn.getsockname())
    for table in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc_net, table)) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and fields[1] in local and fields[2] in remote:
                return int(fields[7])
    return None


def _end(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def pump(plain: socket.socket, tls: socket.socket, stop: threading.Event) -> Optional[str]:
    """Carries bytes both ways between `plain` and `tls` (any two connected sockets; `tls` may be
    an SSLSocket) until either ends, then delivers what that side sent (for at most FLUSH_S) and
    returns. One thread, non-blocking, so an SSL object is never used by two threads at once.
    Returns None when a side ended cleanly, else why it failed. The caller closes both."""
    socks = (plain, tls)
    for s in socks:
        s.setblocking(False)
    bufs = (bytearray(), bytearray())  # bufs[i]: read from socks[i], for the other one
    open_ = [True, True]
    flush_until = None
    sel = selectors.DefaultSelector()
    registered = {}
    try:
        while True:
            progressed = False
            for i, s in enumerate(socks):
                if open_[i] and len(bufs[i]) < CAP:
                    try:
                        data = s.recv(CHUNK)
                    except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        data = None
                    except ssl.SSLZeroReturnError:
                        data = b""
                    if data is not None:
                        progressed = True
                        if data:
                            bufs[i].extend(data)
                        else:
                            open_[i] = False
                out, buf = socks[1 - i], bufs[i]
                if buf and open_[1 - i]:  # a side that ended gets nothing more
                    try:
                        # An SSL write that must be retried is retried with the same bytes.
                        n = out.send(memoryview(buf)[:CHUNK])
                    except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        n = 0
                    if n:
                        del buf[:n]
                        progressed = True
            for i in (0, 1):
                if not open_[i] and (not bufs[i] or not open_[1 - i]):
                    return None  # this side ended and all it sent was delivered (or had nowhere to go)
            if stop.is_set():
                return "the tunnel was closed"
            if not all(open_):
                flush_until = flush_until or time.monotonic() + FLUSH_S
                if time.monotonic() > flush_until:
                    return f"the other side read nothing for {FLUSH_S:.0f} s after this one ended"
            # Bytes OpenSSL already decrypted wake no selector: read them first, when there is room.
            if progressed or (open_[1] and len(bufs[1]) < CAP and getattr(tls, "pending", lambda: 0)()):
                continue
            for i, s in enumerate(socks):
                ev = (selectors.EVENT_READ if open_[i] and len(bufs[i]) < CAP else 0) | \
                     (selectors.EVENT_WRITE if bufs[1 - i] and open_[i] else 0)
                # TLS may need to read to write (and the other way): ask for both while it has work.
                if i == 1 and ev and open_[1]:
                    ev |= selectors.EVENT_READ
                if ev != registered.get(i, 0):
                    if i in registered:
                        sel.unregister(s)
                        del registered[i]
                    if ev:
                        sel.register(s, ev)
                        registered[i] = ev
            sel.select(1.0)
    except ssl.SSLError as e:
        return f"TLS failed: {e.reason or e}"
    except OSError as e:
        return f"{e.strerror or e}"
    finally:
        sel.close()


def _refused_certificate(why: str) -> bool:
    """Whether pump's error is the peer's alert refusing this side's certificate."""
    return why.startswith("TLS failed:") and "ALERT" in why and \
        any(w in why for w in ("CERTIFICATE", "UNKNOWN_CA", "ACCESS_DENIED"))


class _Tunnel:
    """A listening socket whose every connection is served by `serve(conn, peer)` in a thread of
    its own; close() ends the listener and every connection and joins the threads."""

    def __init__(self, listener: socket.socket, name: str, tag: str = _TAG):
        self.listener = listener
        self.name = name
        self.port = listener.getsockname()[1]
        self.stop = threading.Event()
        self.refused = 0
        self._log = _Limiter(tag=tag)
        self._lock = threading.Lock()
        self._live: dict = {}  # thread -> the sockets it holds
        self._threads: List[threading.Thread] = []
        self._pending: "collections.OrderedDict[threading.Thread, Tuple[socket.socket, Tuple]]" = \
            collections.OrderedDict()
        self._wake_r, self._wake_w = socket.socketpair()
        self._acceptor = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self.stop.is_set():
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    try:
                        conn, peer = self.listener.accept()
                    except OSError:
                        continue
                    with self._lock:
                        full = len(self._live) >= MAX_CONNECTIONS
                        oldest = self._pending.popitem(last=False)[1] if len(self._pending) >= MAX_PENDING else None
                    if oldest is not None:
                        self._refuse(oldest[1], f"dropped: the oldest of {MAX_PENDING} connections in their handshake")
                        try:
                            oldest[0].shutdown(socket.SHUT_RDWR)  # ends its handshake at once
                        except OSError:
                            pass
                    if full:
                        self._refuse(peer, f"already {MAX_CONNECTIONS} connections")
                        conn.close()
                        continue
                    t = threading.Thread(target=self._run, args=(conn, peer), name=f"{self.name}-conn", daemon=True)
                    with self._lock:
                        self._live[t] = [conn]
                        # Every thread until it has ended, for close() to join (past its _live entry).
                        self._threads = [x for x in self._threads if x.is_alive()] + [t]
                    t.start()

    def _hold(self, sock: socket.socket) -> None:
        with self._lock:
            self._live[threading.current_thread()].append(sock)
        if self.stop.is_set():
            raise OSError("the tunnel was closed")

    def _handshaking(self, conn: Optional[socket.socket], peer=None) -> None:
        """Marks this thread's connection as in its handshake (conn), or past it (None)."""
        with self._lock:
            if conn is None:
                self._pending.pop(threading.current_thread(), None)
            else:
                self._pending[threading.current_thread()] = (conn, peer)

    def _refuse(self, peer, why: str) -> None:
        with self._lock:
            self.refused += 1
        self._log(f"{self.name}: refused the connection from {_fmt(peer)}: {why}")

    def _run(self, conn: socket.socket, peer) -> None:
        try:
            self.serve(conn, peer)
        except Exception as e:  # one connection's failure never stops the tunnel
            if not self.stop.is_set():
                self._log(f"{self.name}: connection from {_fmt(peer)}: {e}")
        finally:
            with self._lock:
                socks = self._live.pop(threading.current_thread(), [])
                self._pending.pop(threading.current_thread(), None)
            for s in socks:
                _end(s)

    def serve(self, conn: socket.socket, peer) -> None:
        raise NotImplementedError

    def close(self, timeout: float = 5.0) -> None:
        if self.stop.is_set():
            return
        self.stop.set()
        self._wake_w.send(b"x")
        self._acceptor.join(timeout)
        self.listener.close()
        with self._lock:
            live, threads = dict(self._live), list(self._threads)
        for socks in live.values():
            for s in list(socks):
                try:
                    s.shutdown(socket.SHUT_RDWR)  # wakes its thread
                except OSError:
                    pass
        for t in threads:
            t.join(timeout)
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _fmt(addr) -> str:
    host, port = addr[0], addr[1]
    if host.startswith("::ffff:") and "." in host:
        host = host[len("::ffff:"):]  # an IPv4 peer of a dual-stack listener
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen(host: str, port: int) -> socket.socket:
    if host == "" and socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=512)
    return socket.create_server((host, port), backlog=512)


class Terminator(_Tunnel):
    """On the store's host: TLS from the network on (host, port), the bytes to `target` (the
    real store, on loopback). A connection that does not finish a TLS 1.3 handshake with a
    certificate of the job's CA within HANDSHAKE_S is closed having learnt nothing."""

    def __init__(self, host: str, port: int, target: Tuple[str, int], ctx: ssl.SSLContext,
                 peer_name: Optional[str] = None, tag: str = _TAG):
        self.target, self.ctx, self.peer_name = target, ctx, peer_name
        super().__init__(_listen(host, port), "terminator", tag)

    def serve(self, conn: socket.socket, peer) -> None:
        conn.settimeout(HANDSHAKE_S)
        try:
            tls = self.ctx.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            self._hold(tls)
            self._handshaking(tls, peer)
            tls.do_handshake()
            _check_name(tls, self.peer_name)
        except (ssl.SSLError, OSError) as e:
            with self._lock:
                dropped = threading.current_thread() not in self._pending
            if not self.stop.is_set() and not dropped:
                self._refuse(peer, f"TLS handshake: {getattr(e, 'reason', None) or e}")
            return
        self._handshaking(None)
        try:
            store = socket.create_connection(self.target, timeout=HANDSHAKE_S)
        except OSError as e:
            self._log(f"{self.name}: the store at {_fmt(self.target)} for {_fmt(peer)}: {e.strerror or e}")
            return
        self._hold(store)
        store.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        why = pump(store, tls, self.stop)
        if why and not self.stop.is_set():
            self._log(f"{self.name}: the connection from {_fmt(peer)} failed: {why}")


class Forwarder(_Tunnel):
    """On the other hosts: serves this uid's connections on 127.0.0.1 (an ephemeral port) and
    carries each one over TLS to the store's public (host, port), dialled until CONNECT_S.
    `remote` may be a function giving that address, asked again before every try: where the
    address is itself read from a store, an earlier attempt's may come first (rank_store)."""

    def __init__(self, remote, ctx: ssl.SSLContext, peer_name: Optional[str] = None,
                 uid_of: Callable[[socket.socket], Optional[int]] = peer_uid, connect_s: float = CONNECT_S,
                 tag: str = _TAG):
        self.remote, self.ctx, self.peer_name = remote, ctx, peer_name
        self.uid_of, self.connect_s = uid_of, connect_s
        super().__init__(_listen("127.0.0.1", 0), "forwarder", tag)

    def _target(self) -> Tuple[str, int]:
        return self.remote() if callable(self.remote) else self.remote

    def _dial(self, peer) -> Tuple[socket.socket, Tuple[str, int]]:
        deadline = time.monotonic() + self.connect_s
        pause = 0.05
        while True:
            target = self._target()
            try:
                return socket.create_connection(target, timeout=min(HANDSHAKE_S, self.connect_s)), target
            except OSError as e:
                if time.monotonic() + pause > deadline or self.stop.is_set():
                    raise OSError(f"connecting to the store at {_fmt(target)} for {_fmt(peer)}: "
                                  f"{e.strerror or e} (for {self.connect_s:.0f} s)") from None
                self.stop.wait(pause)
                pause = min(pause * 2, 1.0)

    def serve(self, conn: socket.socket, peer) -> None:
        uid = self.uid_of(conn)
        if uid != os.geteuid():
            whose = "no socket of this host's" if uid is None else f"uid {uid}"
            self._refuse(peer, f"it belongs to {whose}, not to this launcher's uid {os.geteuid()}")
            return
        raw, target = self._dial(peer)
        self._hold(raw)
        raw.settimeout(HANDSHAKE_S)
        try:
            tls = self.ctx.wrap_socket(raw, server_side=False, do_handshake_on_connect=False)
            self._hold(tls)
            tls.do_handshake()
            _check_name(tls, self.peer_name)
        except (ssl.SSLError, OSError) as e:
            if not self.stop.is_set():
                hint = " (the same job CA on every node?)" if isinstance(e, ssl.SSLError) else ""
                self._log(f"{self.name}: the TLS handshake with the store at {_fmt(target)} failed: "
                          f"{getattr(e, 'reason', None) or e}{hint}")
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        why = pump(conn, tls, self.stop)
        if why and not self.stop.is_set():
            if _refused_certificate(why):
                # TLS 1.3: the client's handshake ends before the server has checked the client's
                # certificate, so the store's refusal arrives as an alert on the first read.
                self._log(f"{self.name}: the TLS handshake with the store at {_fmt(target)} failed: the store "
                          f"refused this node's certificate: {why} (the same job CA on every node?)")
            else:
                self._log(f"{self.name}: the connection to the store at {_fmt(target)} failed: {why}")


ROUTE_ENV = "RUMOR_ROUTE_ADDR"


def loopback_store(world_size: int, timeout_s: float):
    """A TCPStore server listening on loopback only (torch binds every interface unless it is
    given a listening socket), for a terminator to carry the network's bytes to; (store, port)."""
    import datetime

    import torch.distributed as dist

    sock = socket.create_server(("127.0.0.1", 0), backlog=512)
    port = sock.getsockname()[1]
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, True, datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now
    return store, port


class StoreTls:
    """The launcher's side for torchrun's static rendezvous: start() opens this node's end of the
    tunnel and rewrites where torchrun (and so its workers) find the store; close() ends it."""

    def __init__(self, node_rank: int, nnodes: int, host: str, port: int, cert: str, key: str, ca: str,
                 peer_name: Optional[str] = None, timeout_s: float = 900.0):
        self.node_rank, self.nnodes, self.host, self.port = node_rank, nnodes, host, port
        self.files = (cert, key, ca)
        self.peer_name = peer_name or None
        self.timeout_s = timeout_s
        self.tunnel: Optional[_Tunnel] = None
        self.store = None
        self.local_port = 0

    def start(self) -> int:
        """Returns the loopback port torchrun must use as the store's."""
        if self.node_rank == 0:
            self._host_store()
            self.tunnel = Terminator("", self.port, ("127.0.0.1", self.local_port),
                                     _context(True, *self.files), self.peer_name)
            what = f"node 0 serves the store on port {self.port} over TLS only"
        else:
            self.tunnel = Forwarder((self.host, self.port), _context(False, *self.files), self.peer_name)
            self.local_port = self.tunnel.port
            what = f"the store at {_fmt((self.host, self.port))} is reached over TLS"
        _log(f"{what} (TLS 1.3, mutual certificates)")
        return self.local_port

    def _host_store(self) -> None:
        """The real TCPStore on loopback; torchrun's own multi-tenant TCPStore on the same port
        then uses this server."""
        self.store, self.local_port = loopback_store(self.nnodes, self.timeout_s)

    def close(self) -> None:
        """Idempotent."""
        if self.tunnel is not None:
            self.tunnel.close()
            self.tunnel = None
        self.store = None


def files_from_env(env=os.environ) -> Optional[Tuple[str, str, str]]:
    """RUMOR_TLS_CERT/KEY/CA when all three are set; None when none is; SystemExit for a part."""
    given, missing = tls_files(env)
    if not any(given.values()):
        return None
    if missing:
        raise SystemExit(f"rumor-run: TLS needs RUMOR_TLS_CERT, RUMOR_TLS_KEY and RUMOR_TLS_CA together; "
                         f"{', '.join(missing)} not set (docs/security.md)")
    return given["RUMOR_TLS_CERT"], given["RUMOR_TLS_KEY"], given["RUMOR_TLS_CA"]


def open_tunnel(node_rank: int, nnodes: int, host: str, port: int, files: Tuple[str, str, str],
                env=os.environ) -> StoreTls:
    """Starts this node's end of the store's tunnel (the store at host:port); SystemExit naming
    the node and the address when it cannot."""
    st = StoreTls(node_rank, nnodes, host, port, *files, peer_name=env.get("RUMOR_TLS_PEER_NAME"))
    try:
        st.start()
    except (OSError, ssl.SSLError) as e:
        st.close()
        raise SystemExit(f"rumor-run: store TLS: node {node_rank} cannot open its end of the store's tunnel "
                         f"({_fmt((host, port))}): {e}") from None
    return st


def for_launch(args, env=os.environ) -> Optional[StoreTls]:
    """When the job's store is to be carried over TLS: torchrun's static rendezvous on several
    nodes, with the TLS files set (by --tls auto or by the user). Starts this node's end, points
    args at it and names the public address in RUMOR_ROUTE_ADDR; returns it, or None."""
    files = files_from_env(env)
    min_nodes, _, max_nodes = str(args.nnodes).partition(":")
    if files is None or (max_nodes or min_nodes) == "1":
        return None
    if args.rdzv_backend != "static" or (max_nodes and max_nodes != min_nodes):
        _log("warning: only torchrun's static rendezvous (--nnodes N --node-rank K --master-addr A "
             f"--master-port P) has all its store traffic under TLS; with --rdzv-backend {args.rdzv_backend} "
             "torchrun's own keys travel in clear, and rumor's workers keep theirs in a store rank 0 "
             "serves over TLS (docs/security.md)")
        return None
    endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise SystemExit(f"rumor-run: the store's address {endpoint!r} is not host:port")
    st = open_tunnel(int(args.node_rank), int(min_nodes), host, int(port), files, env)
    local = st.local_port
    args.master_addr, args.master_port = "127.0.0.1", local
    args.rdzv_endpoint = f"127.0.0.1:{local}"
    env.setdefault(ROUTE_ENV, host)
    return st


# ---- workers that host the store themselves (srun, mpirun, RANK and WORLD_SIZE set by hand) ----

WORKER_TAG = "rumor.init(): store TLS"
STORE_TLS_ENV = "RUMOR_STORE_TLS"  # 0: the store in clear even with the TLS files set
STORE_PORT_ENV = "RUMOR_STORE_PORT"  # rank_store's port on rank 0 (unset: any free port)
# One tunnel and store per store address, for the process's life: a later init() (a live epoch,
# a notebook's next job) reuses them, as torch's multi-tenant TCPStore reuses its server.
_workers: dict = {}
_workers_lock = threading.Lock()
# worker_store's local ends, ("127.0.0.1", port) -> the _workers key of the store they lead to.
_local_ends: dict = {}


def worker_files(env=os.environ) -> Optional[Tuple[str, str, str]]:
    """The TLS files when all three are set and RUMOR_STORE_TLS is not 0, else None (a partial
    set is refused by the data channels' options, which rumor.init() reads first)."""
    given, missing = tls_files(env)
    if missing or not env_bool(STORE_TLS_ENV, True, env):
        return None
    return given["RUMOR_TLS_CERT"], given["RUMOR_TLS_KEY"], given["RUMOR_TLS_CA"]


def _open_end(key, is_master: bool, listen_port: int, remote, where: str, world_size: int, timeout_s: float,
              files: Tuple[str, str, str], peer_name: Optional[str]):
    """This process's end of a store that ranks reach over TLS, made once per key: rank 0 serves
    the TCPStore on loopback behind a terminator on listen_port of every interface (0: any free
    port), another rank gets a client through a forwarder of its own to remote. (tunnel, store);
    RuntimeError naming `where` when this end cannot open."""
    import datetime

    import torch.distributed as dist

    with _workers_lock:  # not held while this end opens: that blocks on the network
        have = _workers.get(key)
    if have is not None:
        return have
    tunnel: Optional[_Tunnel] = None
    try:
        if is_master:
            store, local = loopback_store(world_size, timeout_s)
            tunnel = Terminator("", listen_port, ("127.0.0.1", local), _context(True, *files), peer_name,
                                tag=WORKER_TAG)
        else:
            tunnel = Forwarder(remote, _context(False, *files), peer_name, connect_s=timeout_s, tag=WORKER_TAG)
            store = dist.TCPStore("127.0.0.1", tunnel.port, world_size, False,
                                  datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    except (OSError, ssl.SSLError) as e:
        if tunnel is not None:
            tunnel.close()
        end = "serve the store" if is_master else "reach the store"
        raise RuntimeError(f"{WORKER_TAG}: this rank cannot {end} at {where} over TLS: {e}") from None
    except BaseException:
        if tunnel is not None:
            tunnel.close()
        raise
    with _workers_lock:
        _workers.setdefault(key, (tunnel, store))
        kept = _workers[key]
    if kept[0] is not tunnel:  # another thread of this process opened the same end meanwhile
        tunnel.close()
    return kept


def worker_store(addr: str, port: int, world_size: int, is_master: bool, timeout_s: float,
                 files: Tuple[str, str, str], peer_name: Optional[str] = None):
    """The job's store with its traffic under TLS where rumor.init() hosts or reaches it itself
    (no torchrun agent): rank 0 serves it on loopback behind a terminator on `port` of every
    interface, as node 0's launcher does; the other ranks reach (addr, port) through a forwarder of
    their own.

    Then MASTER_ADDR/MASTER_PORT of this process name the local end, and RUMOR_ROUTE_ADDR the
    public address, as rumor-run's launchers hand them to torchrun's workers: a later
    torch.distributed.init_process_group() (env://) in this process finds the store where rumor
    does (rank 0's multi-tenant TCPStore reuses the server; the others go through the forwarder),
    as it shares rumor's store without TLS, instead of failing on the terminator's port. A later
    rumor.init() reading those variables is led back to the same end."""
    with _workers_lock:
        key = _local_ends.get((addr, port))
    if key is None:
        key = ("worker", addr, port, is_master)
    _, public, public_port, _ = key
    tunnel, store = _open_end(key, is_master, public_port, (public, public_port), _fmt((public, public_port)),
                              world_size, timeout_s, files, peer_name)
    local = tunnel.target[1] if is_master else tunnel.port
    with _workers_lock:
        _local_ends[("127.0.0.1", local)] = key
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(local)
    os.environ.setdefault(ROUTE_ENV, public)
    if is_master:
        logging.getLogger("rumor").info("%s: rank 0 serves the store on port %d over TLS only (TLS 1.3, "
                                        "mutual certificates)", WORKER_TAG, public_port)
    return store


POINTER_KEY = "tls-store"


def rank_store(agent_store, is_master: bool, world_size: int, advertise: str, timeout_s: float,
               files: Tuple[str, str, str], peer_name: Optional[str] = None):
    """Under a torchrun agent whose store is reached over the network (plain torchrun, or
    rumor-run with a c10d or elastic rendezvous): rumor's rendezvous moves to a store of rank 0's
    own, reached over TLS, and the agent's store (agent_store, this init()'s prefix of it) holds
    only where that is. The agent's store outlives the workers, so the address an earlier
    attempt's rank 0 left may be read first: the forwarder asks the agent's store again before
    every dial, and a dead address is refused until the new one is there."""
    if is_master:
        # A fixed port where a firewall stands between the hosts; else any free one.
        port = env_int(STORE_PORT_ENV, 0, minimum=1, maximum=65535)
        tunnel, store = _open_end(("rank0",), True, port, None, f"port {port}" if port else "any free port",
                                  world_size, timeout_s, files, peer_name)
        agent_store.set(POINTER_KEY, f"{advertise}:{tunnel.port}")
        return store
    deadline = time.monotonic() + timeout_s
    pause = 0.002
    while not agent_store.check([POINTER_KEY]):
        if time.monotonic() > deadline:
            from .errors import CommTimeoutError

            raise CommTimeoutError(f"rumor.init(): rank 0 did not publish its TLS store's address "
                                   f"({POINTER_KEY!r}) within {timeout_s:g} s (is rank 0 running?)")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)

    def where() -> Tuple[str, int]:
        host, _, port = agent_store.get(POINTER_KEY).decode().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise OSError(f"rank 0's TLS store address in the agent's store is malformed: {host}:{port}")
        return host.strip("[]"), int(port)

    first = where()
    _, store = _open_end(("rank", first), False, 0, where, f"{_fmt(first)} (rank 0's)", world_size, timeout_s,
                         files, peer_name)
    return store


def close_workers() -> None:
    """Ends this process's tunnels (at exit: after rumor's shutdown, registered later)."""
    with _workers_lock:
        ends = [tunnel for tunnel, _ in _workers.values()]
        _workers.clear()
        _local_ends.clear()
    for tunnel in ends:
        tunnel.close()


atexit.register(close_workers)
