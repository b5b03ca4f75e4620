"""How the ranks of one init() find each other: the launcher's environment, the rendezvous store
and the authenticated exchange of addresses (docs/security.md). Below the runtime state: nothing
here holds state between init() calls except the once-only warning of an unauthenticated job."""
from __future__ import annotations

import ctypes
import datetime
import ipaddress
import json
import logging
import os
import socket
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from . import _secret, _storetls
from ._env import env_int


DEFAULT_PORT = 29500


@dataclass
class Env:
    rank: int
    size: int
    master_addr: str
    master_port: int
    source: str


def _first_slurm_host(nodelist: str) -> str:
    # "node[01-04,07],gpu2" -> "node01"; enough for rank 0's host, which is first in the list.
    head = nodelist.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        first = rest.split(",")[0].split("-")[0].rstrip("]")
        return prefix + first
    return head


def read_env() -> Env:
    e = os.environ

    def num(name: str, minimum: int) -> int:
        # The launcher's variables: a bad one names itself rather than failing in a bare int().
        return env_int(name, None, minimum=minimum, env=e) if e.get(name, "").strip() else _missing(name)

    port = env_int("MASTER_PORT", DEFAULT_PORT, minimum=0, maximum=65535, env=e)
    if "RANK" in e and "WORLD_SIZE" in e:
        return Env(num("RANK", 0), num("WORLD_SIZE", 1), e.get("MASTER_ADDR", "127.0.0.1"), port, "torchrun")
    if "OMPI_COMM_WORLD_RANK" in e:
        single = e.get("OMPI_COMM_WORLD_LOCAL_SIZE") == e.get("OMPI_COMM_WORLD_SIZE")
        addr = e.get("MASTER_ADDR", "127.0.0.1" if single else "")
        if not addr:
            raise RuntimeError("rumor.init(): under mpirun on several hosts, set MASTER_ADDR (and MASTER_PORT) to rank 0's host")
        return Env(num("OMPI_COMM_WORLD_RANK", 0), num("OMPI_COMM_WORLD_SIZE", 1), addr, port, "mpirun")
    if "PMI_RANK" in e and "PMI_SIZE" in e:
        addr = e.get("MASTER_ADDR", "")
        if not addr:
            raise RuntimeError("rumor.init(): under an MPICH-style launcher, set MASTER_ADDR (and MASTER_PORT)")
        return Env(num("PMI_RANK", 0), num("PMI_SIZE", 1), addr, port, "pmi")
    if "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
        addr = e.get("MASTER_ADDR") or _first_slurm_host(e.get("SLURM_JOB_NODELIST", e.get("SLURM_NODELIST", "127.0.0.1")))
        return Env(num("SLURM_PROCID", 0), num("SLURM_NTASKS", 1), addr, port, "slurm")
    return Env(0, 1, "127.0.0.1", port, "single process")


def _missing(name: str) -> int:
    raise ValueError(f"rumor.init(): the launcher variable {name} is set but empty")


def advertise_address(master_addr: str, master_port: int) -> str:
    """The local IP other ranks should dial: the one on the route to rank 0's host. Where the
    store is reached through a local tunnel (rumor-run's store TLS: MASTER_ADDR is loopback),
    RUMOR_ROUTE_ADDR names the store's public host, whose route is the one that counts."""
    explicit = os.environ.get("RUMOR_ADVERTISE_ADDR")
    if explicit:
        return explicit
    route = os.environ.get("RUMOR_ROUTE_ADDR", "").strip()
    if route:
        master_addr = route
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, master_port or 9))  # UDP connect sends nothing
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def host_id() -> str:
    """Ranks with the same host id share memory. Network namespaces count as separate hosts,
    so emulated clusters (one namespace per host) really go through the network."""
    explicit = os.environ.get("RUMOR_HOST_ID")
    if explicit:
        return explicit
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return f"{socket.gethostname()}|{netns}"


_MAX_SITE = 256


def site_id() -> str:
    """This rank's site (RUMOR_SITE; "" when unset): hosts that share fast links, e.g. one
    datacenter. Hierarchical collectives then group ranks by site (docs/wan.md)."""
    site = os.environ.get("RUMOR_SITE", "").strip()
    if len(site) > _MAX_SITE or "\0" in site:
        raise ValueError(f"RUMOR_SITE must be at most {_MAX_SITE} characters, without NUL; got {len(site)} characters")
    return site


def apply_sites(ctx, entries, what: str = "rumor.init()") -> Optional[str]:
    """Gives the context every rank's site, if any rank has one; all of them or none must, else
    the error to raise, which every rank finds alike in the table. The caller raises it only
    after its first barrier: rank 0 may hold the store, and the others still read the table.
    RUMOR_SITE=auto on every rank: the sites come from the hosts' round trips (find_sites)."""
    sites = [e[4] for e in entries]
    if not any(sites):
        return None
    missing = [r for r, s in enumerate(sites) if not s]
    if missing:
        have = [r for r, s in enumerate(sites) if s]
        return (f"{what}: RUMOR_SITE is set on rank(s) {have[:8]} but not on rank(s) {missing[:8]}: "
                "set it on every rank or on none")
    auto = [r for r, s in enumerate(sites) if s == AUTO_SITE]
    if auto and len(auto) != len(sites):
        named = [r for r, s in enumerate(sites) if s != AUTO_SITE]
        return (f"{what}: RUMOR_SITE is auto on rank(s) {auto[:8]} but names a site on rank(s) {named[:8]}: "
                "set auto on every rank or name every rank's site")
    if auto:
        sites = find_sites(ctx, [e[2] for e in entries])
        if sites is None:
            return None
    ctx.set_sites(sites)
    return None


AUTO_SITE = "auto"
# RUMOR_SITE=auto: two hosts share a site when a chain of host pairs joins them whose round trips
# are each at most this many times the smallest round trip between two hosts, or at most the
# floor (docs/wan.md, "Sites found by themselves").
AUTO_SITE_FACTOR = 4.0
AUTO_SITE_FLOOR_S = 0.002
# The measurement's communicators: apart from group ids (counted up from 1) and the torch
# backend's point-to-point ids (1 << 47 and up).
_AUTO_SITE_LEADERS_ID = (1 << 46) + 1
_AUTO_SITE_ALL_ID = (1 << 46) + 2
_F64 = 3  # DType::F64


def sites_from_rtts(rtt: Sequence[Sequence[float]], factor: float = AUTO_SITE_FACTOR,
                    floor_s: float = AUTO_SITE_FLOOR_S) -> List[int]:
    """Single linkage over a symmetric matrix of round trips (seconds) between hosts: each host's
    site, numbered in order of each site's first host. A pair measured as 0 (no sample) counts
    as near: a missing figure must not split a site."""
    h = len(rtt)
    measured = [rtt[a][b] for a in range(h) for b in range(a + 1, h) if rtt[a][b] > 0]
    limit = max(factor * min(measured), floor_s) if measured else floor_s
    parent = list(range(h))

    def root(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a in range(h):
        for b in range(a + 1, h):
            if rtt[a][b] <= limit:
                parent[max(root(a), root(b))] = min(root(a), root(b))
    index: dict = {}
    return [index.setdefault(root(a), len(index)) for a in range(h)]


def find_sites(ctx, hosts: Sequence[str]) -> Optional[List[str]]:
    """RUMOR_SITE=auto: one rank per host (the lowest) connects to the other hosts' and reads each
    connection's round trip from the kernel (TCP_INFO, sampled by the handshakes); every rank
    receives the whole matrix and groups the hosts alike (sites_from_rtts). Every rank's site,
    or None when that finds one site or one per host: hosts then group ranks as without
    RUMOR_SITE. Two hosts or fewer are not measured (they can only make one of those)."""
    from . import _C

    order = list(dict.fromkeys(hosts))
    n, h = len(hosts), len(order)
    if h < 3:
        return None
    leaders = [hosts.index(x) for x in order]
    rows = (ctypes.c_double * (n * h))()
    if ctx.rank in leaders:
        comm = _C.Communicator(ctx, _AUTO_SITE_LEADERS_ID, "RUMOR_SITE=auto (one rank per host)", leaders)
        for b, v in enumerate(comm.peer_rtts()):
            rows[ctx.rank * h + b] = v
        del comm
    comm = _C.Communicator(ctx, _AUTO_SITE_ALL_ID, "RUMOR_SITE=auto", list(range(n)))
    comm.allgather(ctypes.addressof(rows), [h] * n, _F64, False)
    del comm
    row = lambda a: rows[leaders[a] * h:(leaders[a] + 1) * h]  # noqa: E731
    rtt = [[max(row(a)[b], row(b)[a]) for b in range(h)] for a in range(h)]
    site_of_host = sites_from_rtts(rtt)
    found = max(site_of_host) + 1
    if ctx.rank == 0:
        ms = [[round(v * 1e3, 2) for v in r] for r in rtt]
        logging.getLogger("rumor").info(
            "RUMOR_SITE=auto: %d site(s) among %d hosts %s, round trips (ms) %s%s", found, h, order, ms,
            "" if 1 < found < h else "; hosts group ranks as without RUMOR_SITE")
    if not 1 < found < h:
        return None
    return [f"auto-{site_of_host[order.index(x)]}" for x in hosts]


def fault_point(point: str, generation: Optional[int] = None) -> None:
    # Fault injection for tests of what a crash leaves behind:
    # RUMOR_TEST_DIE_AT=<point>[:<who>][@<generation>] SIGKILLs the process when it reaches the
    # point: who is a rank (RANK) or a live member id (RUMOR_LIVE_ID, e.g. j1), absent for every
    # process; with @<generation>, only in that init() generation (a live epoch), where the
    # caller passes one.
    spec = os.environ.get("RUMOR_TEST_DIE_AT")
    if not spec:
        return
    spec, at, gen = spec.partition("@")
    if at and (generation is None or int(gen) != generation):
        return
    where, _, who = spec.rpartition(":") if spec.count(":") > 1 else (spec, "", "")
    if where != point:
        return
    if not who or (who == os.environ.get("RUMOR_LIVE_ID") if not who.isdigit()
                   else int(who) == int(os.environ.get("RANK", "-1"))):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def shared_store(env: Env, timeout: float, is_master: bool = False):
    """The job's store without a prefix: the etcd cluster RUMOR_ETCD_ENDPOINTS names (rumor-run
    --live --store etcd), else the TCPStore at MASTER_ADDR:MASTER_PORT (hosted here if is_master)."""
    import torch.distributed as dist

    from . import _etcd_store

    etcd = _etcd_store.from_env(timeout)
    if etcd is not None:
        return etcd
    # multi_tenant lets a later torch.distributed.init_process_group() in this process share
    # the same server instead of failing on a busy port.
    return dist.TCPStore(env.master_addr, env.master_port, env.size, is_master=is_master,
                         timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False, multi_tenant=True)


def store_for(env: Env, timeout: float, generation: int):
    import torch.distributed as dist

    from . import _etcd_store

    if os.environ.get(_etcd_store.ENDPOINTS_ENV, "").strip():
        base = shared_store(env, timeout)
    elif dist.is_available() and dist.is_initialized():
        base = dist.distributed_c10d._get_default_store()
    else:
        # Under torchrun the agent already hosts the store at MASTER_PORT; otherwise rank 0 hosts it.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        files = _storetls.worker_files()
        peer_name = os.environ.get("RUMOR_TLS_PEER_NAME") or None
        if files is not None and not agent:
            # srun, mpirun, a launcher of the user's: the store is rumor's own, so its traffic
            # goes through TLS tunnels as rumor-run's launchers carry theirs.
            base = _storetls.worker_store(env.master_addr, env.master_port, env.size, env.rank == 0, timeout,
                                          files, peer_name)
        elif files is not None and not os.environ.get("RUMOR_LIVE") and not _is_loopback(env.master_addr):
            # A torchrun agent's store across the network (rumor-run's own tunnels would have
            # made it loopback): it cannot be carried, so rumor's keys leave it for rank 0's.
            # Not for a live job, whose launchers carry their store whenever TLS is on and whose
            # rank 0 changes from one epoch to the next.
            agent_store = prefixed(shared_store(env, timeout), rendezvous_prefix(generation))
            base = _storetls.rank_store(agent_store, env.rank == 0, env.size,
                                        advertise_address(env.master_addr, env.master_port), timeout, files,
                                        peer_name)
        else:
            base = shared_store(env, timeout, is_master=env.rank == 0 and not agent)
    return prefixed(base, rendezvous_prefix(generation))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def prefixed(base, prefix: str):
    """base's keys under prefix: a torch PrefixStore, or for the etcd store its own prefixed
    copy (a PrefixStore would not keep a Python store's methods alive)."""
    import torch.distributed as dist

    from . import _etcd_store

    if isinstance(base, _etcd_store.EtcdStore):
        return base.with_prefix(prefix)
    return dist.PrefixStore(prefix, base)


def rendezvous_prefix(generation: int) -> str:
    # Under torchrun the agent's store outlives the workers: a restarted worker must not find
    # its predecessors' keys. The run id separates jobs sharing one store; the in-process
    # generation separates init() calls of one process. Restarts of the same run are kept apart
    # by the fresh token rank 0 draws each time (see exchange), not by
    # TORCHELASTIC_RESTART_COUNT: the agents of a multi-node job count restarts differently
    # (an agent restarts its workers without counting when another node joins or fails), so
    # ranks of one round would disagree on the key and never meet.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"rumor/{run_id}/{generation}/" if run_id else f"rumor/{generation}/"


def listen_port(env: Env) -> int:
    """RUMOR_PORT (rumor.run --rumor-port) is the first of a range: a host's workers listen on
    RUMOR_PORT + local rank, so several workers per host do not fight for one port."""
    v = os.environ.get("RUMOR_PORT", "").strip()
    if not v:
        return 0
    if not v.isdigit() or not 0 < int(v) < 65536:
        raise ValueError(f"rumor.init(): RUMOR_PORT must be a port number, got {v!r}")
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK",
                                                            os.environ.get("SLURM_LOCALID", "0"))))
    port = int(v) + local
    if port >= 65536:
        raise ValueError(f"rumor.init(): RUMOR_PORT {v} + local rank {local} is past the last port")
    return port


# Set by live membership (rumor._live): raises when the membership being formed lost a member,
# so that an init() waiting for it gives up at once instead of at its deadline.
interrupt: Optional[Callable[[], None]] = None


def wait_key(store, key: str, deadline: float, what: str, on_idle=None) -> None:
    """Polls for key until the deadline; on_idle() runs between polls and may raise to retry."""
    import time

    pause = 0.002
    while not store.check([key]):
        if interrupt is not None:
            interrupt()
        if on_idle is not None:
            on_idle()
        if time.monotonic() > deadline:
            from .errors import CommTimeoutError

            raise CommTimeoutError(f"rumor.init(): {what}: store key {key!r} did not appear before the deadline")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


class _Stale(Exception):
    """The token this rank read belongs to an earlier attempt; read it again."""


_PEER_FIELDS = 5  # nonce, "address:port", host id, shm tag, site ("" for none)


_UNAUTH_WARNED = False


def single_host(env: Env) -> bool:
    """True when the launcher's environment says every rank runs on this host (before any rank
    has met another): torchrun's LOCAL_WORLD_SIZE, Open MPI's local size, Slurm's node count, or
    a store on a loopback address."""
    e = os.environ
    if env.source == "torchrun" and e.get("LOCAL_WORLD_SIZE"):
        return e["LOCAL_WORLD_SIZE"] == e.get("WORLD_SIZE")
    if env.source == "mpirun":
        return e.get("OMPI_COMM_WORLD_LOCAL_SIZE") == e.get("OMPI_COMM_WORLD_SIZE")
    if env.source == "slurm" and (e.get("SLURM_NNODES") or e.get("SLURM_JOB_NUM_NODES")):
        return (e.get("SLURM_NNODES") or e.get("SLURM_JOB_NUM_NODES")) == "1"
    return env.master_addr in ("localhost", "::1") or env.master_addr.startswith("127.")


def job_secret_for(env: Env) -> _secret.JobSecret:
    global _UNAUTH_WARNED
    js = _secret.resolve(single_host(env))
    if not js.authenticated and not _UNAUTH_WARNED:
        _UNAUTH_WARNED = True
        import warnings

        warnings.warn(
            f"rumor.init(): rank {env.rank}: this job spans several hosts and no job secret was given "
            f"({_secret.SECRET_ENV} or {_secret.SECRET_FILE_ENV}; rumor.run generates one for a single "
            "node): its connections are NOT authenticated: anyone who can reach the rendezvous store "
            "can join it (docs/security.md)", RuntimeWarning, stacklevel=3)
    return js


def valid_entry(e, rank: int) -> bool:
    """A peer's advertisement as rendezvous expects it: strings of sane length, "host:port" with
    a port in range, no path separator in the shm tag (it becomes part of a file name)."""
    if not isinstance(e, list) or len(e) != _PEER_FIELDS or not all(isinstance(x, str) for x in e):
        return False
    nonce, addr, host, tag, site = e
    if (len(nonce) > 64 or len(host) > 1024 or len(tag) > 256 or "/" in tag or "\0" in tag
            or len(site) > _MAX_SITE):
        return False
    h, sep, port = addr.rpartition(":")
    return bool(sep) and bool(h) and len(h) <= 255 and port.isdigit() and 0 < int(port) < 65536


def seal(key: bytes, what: str, value) -> str:
    body = json.dumps(value)
    return json.dumps([body, _secret.mac(key, what.encode(), body.encode()).hex()])


def unseal(key: bytes, what: str, raw: bytes, who: str):
    """The value of a store entry written by seal, or a PermissionError naming the entry when its
    MAC does not match: it was written by someone without the job secret."""
    try:
        body, tag = json.loads(raw)
        ok = isinstance(body, str) and _secret.mac_ok(key, bytes.fromhex(tag), what.encode(), body.encode())
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise PermissionError(
            f"rumor.init(): {who} in the rendezvous store failed its MAC check: it was written by "
            f"someone who does not hold this job's secret (or the ranks were given different "
            f"{_secret.SECRET_ENV} values); refusing it")
    return json.loads(body)


def exchange(store, env: Env, timeout: float, make_ctx, host: str, advertise: str, js: _secret.JobSecret):
    """Rendezvous of one init(): returns (ctx, token, entries [nonce, address, host, shm tag]).

    Rank 0 draws a fresh session token and publishes it; every rank advertises itself under that
    token with a nonce, and rank 0 answers with the table of everyone's entries. The token is
    public (the store answers anyone); the connection key is derived from it and the job secret,
    which never enters the store. Entries and the table carry a MAC keyed by the secret and are
    checked before use, so whoever can write to the store cannot point a rank elsewhere.
    Keys of an earlier attempt that died in the same store (torchrun restarts the workers, the
    agent's store stays) can be read before rank 0 overwrites the token: such a token leads to a
    table without this rank's nonce (or to no table while the token changes), and the rank
    starts over with the token it then finds, so a stale entry is never used."""
    import time

    deadline = time.monotonic() + timeout
    if env.rank == 0:
        token = os.urandom(16)
        t = token.hex()
        skey = js.key("store", token)
        ctx = make_ctx(token)
        fault_point("init:context")
        store.set("token", t)
        keys = [f"{t}/peer/{r}" for r in range(env.size)]
        entries = [["", f"{advertise}:{ctx.port}", host, ctx.shm_tag, site_id()]]
        for r in range(1, env.size):
            wait_key(store, keys[r], deadline, f"waiting for rank {r} of {env.size} to join")
        for r, raw in enumerate(store.multi_get(keys[1:]), start=1):
            e = unseal(skey, f"peer/{r}", raw, f"rank {r}'s entry")
            if not valid_entry(e, r):
                raise ValueError(f"rumor.init(): rank {r}'s entry in the rendezvous store is malformed: {e!r}")
            entries.append(e)
        store.set(f"{t}/table", seal(skey, "table", entries))
        return ctx, token, entries
    while True:
        wait_key(store, "token", deadline, "waiting for rank 0 to publish the job token")
        t = store.get("token").decode()
        try:
            token = bytes.fromhex(t)
        except ValueError:
            token = b""
        if len(token) != 16:
            raise ValueError(f"rumor.init(): rank {env.rank}: the session token in the rendezvous store is "
                             f"malformed ({t[:40]!r})")
        skey = js.key("store", token)
        ctx = make_ctx(token)
        nonce = os.urandom(8).hex()
        fault_point("init:context")
        store.set(f"{t}/peer/{env.rank}",
                  seal(skey, f"peer/{env.rank}", [nonce, f"{advertise}:{ctx.port}", host, ctx.shm_tag, site_id()]))

        def token_changed(t=t):
            if store.get("token").decode() != t:
                raise _Stale()

        try:
            wait_key(store, f"{t}/table", deadline, "waiting for rank 0's table of peers", token_changed)
            entries = unseal(skey, "table", store.get(f"{t}/table"), "rank 0's table of peers")
            if (not isinstance(entries, list) or len(entries) != env.size
                    or not all(valid_entry(e, r) for r, e in enumerate(entries))):
                raise ValueError(f"rumor.init(): rank {env.rank}: rank 0's table of peers is malformed")
            if entries[env.rank][0] != nonce:
                time.sleep(0.01)
                raise _Stale()
        except _Stale:
            del ctx
            if time.monotonic() > deadline:
                from .errors import CommTimeoutError

                raise CommTimeoutError(f"rumor.init(): rank {env.rank}: the store held only tokens of earlier "
                                       "attempts until the deadline (is rank 0 running?)")
            continue
        return ctx, token, entries
