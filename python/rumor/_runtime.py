"""Process-wide runtime: init(), shutdown(), rank queries and groups.

All mutable state lives in one _State object, created by init() and dropped by shutdown().
"""
from __future__ import annotations

import atexit
import datetime
import json
import math
import os
import socket
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from . import _C, _secret, _shm

DEFAULT_TIMEOUT = 300.0
DEFAULT_PORT = 29500


@dataclass
class _Env:
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


def _read_env() -> _Env:
    e = os.environ
    port = int(e.get("MASTER_PORT", DEFAULT_PORT))
    if "RANK" in e and "WORLD_SIZE" in e:
        return _Env(int(e["RANK"]), int(e["WORLD_SIZE"]), e.get("MASTER_ADDR", "127.0.0.1"), port, "torchrun")
    if "OMPI_COMM_WORLD_RANK" in e:
        single = e.get("OMPI_COMM_WORLD_LOCAL_SIZE") == e.get("OMPI_COMM_WORLD_SIZE")
        addr = e.get("MASTER_ADDR", "127.0.0.1" if single else "")
        if not addr:
            raise RuntimeError("rumor.init(): under mpirun on several hosts, set MASTER_ADDR (and MASTER_PORT) to rank 0's host")
        return _Env(int(e["OMPI_COMM_WORLD_RANK"]), int(e["OMPI_COMM_WORLD_SIZE"]), addr, port, "mpirun")
    if "PMI_RANK" in e and "PMI_SIZE" in e:
        addr = e.get("MASTER_ADDR", "")
        if not addr:
            raise RuntimeError("rumor.init(): under an MPICH-style launcher, set MASTER_ADDR (and MASTER_PORT)")
        return _Env(int(e["PMI_RANK"]), int(e["PMI_SIZE"]), addr, port, "pmi")
    if "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
        addr = e.get("MASTER_ADDR") or _first_slurm_host(e.get("SLURM_JOB_NODELIST", e.get("SLURM_NODELIST", "127.0.0.1")))
        return _Env(int(e["SLURM_PROCID"]), int(e["SLURM_NTASKS"]), addr, port, "slurm")
    return _Env(0, 1, "127.0.0.1", port, "single process")


def _advertise_address(master_addr: str, master_port: int) -> str:
    """The local IP other ranks should dial: the one on the route to rank 0's host."""
    explicit = os.environ.get("RUMOR_ADVERTISE_ADDR")
    if explicit:
        return explicit
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, master_port or 9))  # UDP connect sends nothing
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _host_id() -> str:
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


def _test_fault(point: str) -> None:
    # Fault injection for tests of what a crash leaves behind: RUMOR_TEST_DIE_AT=<point>[:<rank>]
    # SIGKILLs the process (of that rank, or every rank) when init reaches the point.
    spec = os.environ.get("RUMOR_TEST_DIE_AT")
    if not spec:
        return
    where, _, who = spec.rpartition(":") if spec.count(":") > 1 else (spec, "", "")
    if where == point and (not who or int(who) == int(os.environ.get("RANK", "-1"))):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _env_bool(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None:
        return default
    return v.strip().lower() not in ("0", "false", "no", "off", "")


class Group:
    """A subset of ranks, made by rumor.new_group(). Ranks in collectives are global ranks."""

    def __init__(self, ranks: List[int], comm: Optional["_C.Communicator"], gid: int):
        self.ranks = list(ranks)
        self._comm = comm
        self.id = gid
        self._gpu = None  # rumor._device.GpuGroup: device, transport, NCCL communicator (GPU path)

    def rank(self) -> int:
        """This process's rank within the group, or -1 if it is not a member."""
        return self._comm.rank if self._comm is not None else -1

    def size(self) -> int:
        return len(self.ranks)

    def __contains__(self, global_rank: int) -> bool:
        return global_rank in self.ranks

    def __repr__(self) -> str:
        return f"rumor.Group(id={self.id}, ranks={self.ranks})"


@dataclass
class _State:
    env: _Env
    ctx: "_C.Context"
    world: Group
    hosts: List[str]
    local_rank: int
    local_size: int
    machine_rank: int
    machine_size: int
    timeout: float
    next_group_id: int = 1
    streams: int = 2  # TCP streams per peer pair, fixed for the life of the Context
    groups: list = field(default_factory=list)
    nccl: object = None  # rumor._C.NcclLibrary, loaded on first use by rumor._nccl.load()
    gpu_wait: str = "host"  # how blocking NCCL calls end (rumor._gpu_watch; docs/gpu.md)
    secret: Optional[_secret.JobSecret] = None  # the job secret (rumor._secret; docs/security.md)


_state: Optional[_State] = None
_generation = 0
# The TCPStore of the last init() outlives shutdown(): a peer that re-initialises before this
# rank has shut down may still be talking to the server rank 0 hosts. A later init() in this
# process shares the same server (multi_tenant) under a new key prefix.
_store_keepalive = None


def _store_for(env: _Env, timeout: float):
    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout)
    if dist.is_available() and dist.is_initialized():
        base = dist.distributed_c10d._get_default_store()
    else:
        # Under torchrun the agent already hosts the store at MASTER_PORT; otherwise rank 0
        # hosts it. multi_tenant lets a later torch.distributed.init_process_group() in this
        # process share the same server instead of failing on a busy port.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        base = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.size,
            is_master=(env.rank == 0 and not agent),
            timeout=td,
            wait_for_workers=False,
            multi_tenant=True,
        )
    return dist.PrefixStore(_rendezvous_prefix(), base)


def _rendezvous_prefix() -> str:
    # Under torchrun the agent's store outlives the workers: a restarted worker must not find
    # its predecessors' keys. The run id separates jobs sharing one store; the in-process
    # generation separates init() calls of one process. Restarts of the same run are kept apart
    # by the fresh token rank 0 draws each time (see _exchange), not by
    # TORCHELASTIC_RESTART_COUNT: the agents of a multi-node job count restarts differently
    # (an agent restarts its workers without counting when another node joins or fails), so
    # ranks of one round would disagree on the key and never meet.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"rumor/{run_id}/{_generation}/" if run_id else f"rumor/{_generation}/"


def _listen_port(env: _Env) -> int:
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


def _wait_key(store, key: str, deadline: float, what: str, on_idle=None) -> None:
    """Polls for key until the deadline; on_idle() runs between polls and may raise to retry."""
    import time

    pause = 0.002
    while not store.check([key]):
        if on_idle is not None:
            on_idle()
        if time.monotonic() > deadline:
            from .errors import CommTimeoutError

            raise CommTimeoutError(f"rumor.init(): {what}: store key {key!r} did not appear before the deadline")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


class _Stale(Exception):
    """The token this rank read belongs to an earlier attempt; read it again."""


_PEER_FIELDS = 4  # nonce, "address:port", host id, shm tag
_UNAUTH_WARNED = False


def _single_host(env: _Env) -> bool:
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


def _job_secret(env: _Env) -> _secret.JobSecret:
    global _UNAUTH_WARNED
    js = _secret.resolve(_single_host(env))
    if not js.authenticated and not _UNAUTH_WARNED:
        _UNAUTH_WARNED = True
        import warnings

        warnings.warn(
            f"rumor.init(): rank {env.rank}: this job spans several hosts and no job secret was given "
            f"({_secret.SECRET_ENV} or {_secret.SECRET_FILE_ENV}; rumor.run generates one for a single "
            "node): its connections are NOT authenticated: anyone who can reach the rendezvous store "
            "can join it (docs/security.md)", RuntimeWarning, stacklevel=3)
    return js


def _valid_entry(e, rank: int) -> bool:
    """A peer's advertisement as rendezvous expects it: strings of sane length, "host:port" with
    a port in range, no path separator in the shm tag (it becomes part of a file name)."""
    if not isinstance(e, list) or len(e) != _PEER_FIELDS or not all(isinstance(x, str) for x in e):
        return False
    nonce, addr, host, tag = e
    if len(nonce) > 64 or len(host) > 1024 or len(tag) > 256 or "/" in tag or "\0" in tag:
        return False
    h, sep, port = addr.rpartition(":")
    return bool(sep) and bool(h) and len(h) <= 255 and port.isdigit() and 0 < int(port) < 65536


def _seal(key: bytes, what: str, value) -> str:
    body = json.dumps(value)
    return json.dumps([body, _secret.mac(key, what.encode(), body.encode()).hex()])


def _unseal(key: bytes, what: str, raw: bytes, who: str):
    """The value of a store entry written by _seal, or a PermissionError naming the entry when its
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


def _exchange(store, env: _Env, timeout: float, make_ctx, host: str, advertise: str, js: _secret.JobSecret):
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
        _test_fault("init:context")
        store.set("token", t)
        keys = [f"{t}/peer/{r}" for r in range(env.size)]
        entries = [["", f"{advertise}:{ctx.port}", host, ctx.shm_tag]]
        for r in range(1, env.size):
            _wait_key(store, keys[r], deadline, f"waiting for rank {r} of {env.size} to join")
        for r, raw in enumerate(store.multi_get(keys[1:]), start=1):
            e = _unseal(skey, f"peer/{r}", raw, f"rank {r}'s entry")
            if not _valid_entry(e, r):
                raise ValueError(f"rumor.init(): rank {r}'s entry in the rendezvous store is malformed: {e!r}")
            entries.append(e)
        store.set(f"{t}/table", _seal(skey, "table", entries))
        return ctx, token, entries
    while True:
        _wait_key(store, "token", deadline, "waiting for rank 0 to publish the job token")
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
        _test_fault("init:context")
        store.set(f"{t}/peer/{env.rank}",
                  _seal(skey, f"peer/{env.rank}", [nonce, f"{advertise}:{ctx.port}", host, ctx.shm_tag]))

        def token_changed(t=t):
            if store.get("token").decode() != t:
                raise _Stale()

        try:
            _wait_key(store, f"{t}/table", deadline, "waiting for rank 0's table of peers", token_changed)
            entries = _unseal(skey, "table", store.get(f"{t}/table"), "rank 0's table of peers")
            if (not isinstance(entries, list) or len(entries) != env.size
                    or not all(_valid_entry(e, r) for r, e in enumerate(entries))):
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


def init(timeout: Optional[float] = None, *, socket_streams: Optional[int] = None,
         shm: Optional[bool] = None, gpu_wait: Optional[str] = None) -> None:
    """Joins the job described by the launcher's environment (torchrun, mpirun or Slurm).

    timeout: seconds every blocking wait may take before it raises (env RUMOR_TIMEOUT, default 300).
    socket_streams: parallel TCP streams per peer pair (env RUMOR_SOCKET_STREAMS, default 2).
    shm: use shared memory between ranks on one host (env RUMOR_SHM, default on).
    gpu_wait: how a blocking collective on CUDA tensors over NCCL ends (env RUMOR_GPU_WAIT):
      "host" (default) once the op finished on the GPU, "stream" once it is queued on the current
      stream, as in torch.distributed (see rumor.set_gpu_wait).
    """
    global _state, _generation, _store_keepalive
    if _state is not None:
        raise RuntimeError("rumor.init() was already called; call rumor.shutdown() first")
    from ._gpu_watch import WAIT_ENV, mode_setting

    if gpu_wait is None:
        wait_mode = mode_setting(os.environ.get(WAIT_ENV), f"rumor.init(): {WAIT_ENV}")
    else:
        wait_mode = mode_setting(_str_arg(gpu_wait, "rumor.init(): gpu_wait"), "rumor.init(): gpu_wait")
    env = _read_env()
    if timeout is None:
        timeout = float(os.environ.get("RUMOR_TIMEOUT", DEFAULT_TIMEOUT))
    if timeout <= 0:
        raise ValueError(f"rumor.init(): timeout must be positive, got {timeout}")
    if not 0 <= env.rank < env.size:
        raise ValueError(f"rumor.init(): rank {env.rank} is outside a world of size {env.size} ({env.source})")

    opts = _C.Options()
    opts.timeout = float(timeout)
    opts.streams = int(socket_streams if socket_streams is not None else os.environ.get("RUMOR_SOCKET_STREAMS", 2))
    opts.shm = _env_bool("RUMOR_SHM", True) if shm is None else bool(shm)
    if "RUMOR_SHM_RING_BYTES" in os.environ:
        opts.shm_ring_bytes = int(os.environ["RUMOR_SHM_RING_BYTES"])
    if "RUMOR_STRIPE_MIN_BYTES" in os.environ:
        v = os.environ["RUMOR_STRIPE_MIN_BYTES"]
        if not v.strip().isdigit():
            raise ValueError(f"rumor.init(): RUMOR_STRIPE_MIN_BYTES must be a byte count >= 0, got {v!r}")
        opts.stripe_min = int(v)
    if "RUMOR_SPIN_US" in os.environ:
        opts.spin_us = int(os.environ["RUMOR_SPIN_US"])
    from . import timeline as _timeline
    opts.flight_records = _timeline._flight_records_from_env()

    host = _host_id()
    if env.size == 1:
        # No connection to prove, but commits and caches it writes are read by later jobs.
        js = _secret.resolve(single_host=True)
        token = os.urandom(16)
        ctx = _C.Context(0, 1, token, opts, 0)
        addresses, hosts = [f"127.0.0.1:{ctx.port}"], [host]
    else:
        js = _job_secret(env)
        store = _store_for(env, timeout)
        _store_keepalive = store
        port = _listen_port(env)
        if opts.shm:
            _shm.sweep()
        advertise = _advertise_address(env.master_addr, env.master_port)
        bind = os.environ.get("RUMOR_BIND_ADDR", advertise)

        def make_ctx(tok: bytes):
            return _C.Context(env.rank, env.size, tok, opts, port, key=js.key("connection", tok), bind=bind)

        ctx, token, entries = _exchange(store, env, timeout, make_ctx, host, advertise, js)
        addresses, hosts = [e[1] for e in entries], [e[2] for e in entries]
    if env.size == 1:
        ctx.set_peers(addresses, hosts)
    else:
        ctx.set_peers(addresses, hosts, [e[3] for e in entries])
    _test_fault("init:peers")

    order: List[str] = []
    for h in hosts:
        if h not in order:
            order.append(h)
    local = [r for r in range(env.size) if hosts[r] == hosts[env.rank]]
    world_comm = _C.Communicator(ctx, 0, "world", list(range(env.size)))
    # Once every rank has mapped its local peers' doorbells (set_peers), the names can go.
    world_comm.barrier(False)
    ctx.seal()
    _state = _State(
        env=env,
        ctx=ctx,
        world=Group(list(range(env.size)), world_comm, 0),
        hosts=hosts,
        local_rank=local.index(env.rank),
        local_size=len(local),
        machine_rank=order.index(hosts[env.rank]),
        machine_size=len(order),
        timeout=float(timeout),
        streams=int(opts.streams),
        gpu_wait=wait_mode,
        secret=js,
    )
    _generation += 1
    _timeline._start_from_env()


def shutdown() -> None:
    """Releases sockets, shared memory and threads. Outstanding handles must be waited on first."""
    global _state
    if _state is not None:
        from . import _device
        from . import timeline as _timeline
        _timeline.stop()
        errors = _device.close_all(_state)
        if errors:
            import warnings

            warnings.warn("rumor.shutdown(): closing NCCL communicators failed: " + "; ".join(errors),
                          RuntimeWarning, stacklevel=2)
    _state = None


# Release shared memory names and sockets at interpreter exit even if shutdown() was not called.
atexit.register(shutdown)


def is_initialized() -> bool:
    return _state is not None


def job_secret() -> _secret.JobSecret:
    """The job's secret (rumor._secret): the one init() resolved, else, outside a job, the one the
    environment gives or this user's host secret. Use .key(label) for a purpose's own key."""
    if _state is not None and _state.secret is not None:
        return _state.secret
    return _secret.resolve(single_host=True)


def set_timeout(seconds: float) -> None:
    """Sets the limit of every blocking wait that starts from now on (collectives, neighbor and
    window operations, DistributedDataParallel's end of backward), in seconds; waits already
    running keep theirs. rumor.init(timeout=...) set the first value."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"rumor.set_timeout(): seconds must be a number, got {type(seconds).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"rumor.set_timeout(): seconds must be positive and finite, got {seconds!r}")
    st = _get()
    st.ctx.set_timeout(float(seconds))
    st.timeout = float(seconds)


def get_timeout() -> float:
    """The limit, in seconds, of the blocking waits that start now."""
    return _get().timeout


def _str_arg(value, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a str, got {type(value).__name__}")
    return value


def set_gpu_wait(mode: str) -> None:
    """How the blocking collectives on CUDA tensors over NCCL that start from now on end, on
    this rank (ranks may differ; nonblocking calls and host staging are not affected):

    "host": once the op finished on the GPU, waited for on the host with rumor's deadline, so an
      error or a missing peer is raised by the call itself (as in Horovod or BlueFog).
    "stream": once the op is queued on torch's current stream, as in torch.distributed, so
      consecutive calls and the caller's later kernels pipeline on the GPU. A watch thread keeps
      the deadline: an op past it (or an NCCL error) aborts the group's communicator, is logged,
      and is raised by the group's next call.

    rumor.init(gpu_wait=...) or RUMOR_GPU_WAIT set the first value (default "host")."""
    from ._gpu_watch import mode_setting

    st = _get()
    st.gpu_wait = mode_setting(_str_arg(mode, "rumor.set_gpu_wait(): mode"), "rumor.set_gpu_wait()")


def get_gpu_wait() -> str:
    """"host" or "stream": see rumor.set_gpu_wait."""
    return _get().gpu_wait


def _get() -> _State:
    if _state is None:
        raise RuntimeError("rumor is not initialized: call rumor.init() first")
    return _state


def rank() -> int:
    return _get().env.rank


def size() -> int:
    return _get().env.size


def local_rank() -> int:
    return _get().local_rank


def local_size() -> int:
    return _get().local_size


def machine_rank() -> int:
    return _get().machine_rank


def machine_size() -> int:
    return _get().machine_size


def new_group(ranks: Sequence[int]) -> Group:
    """Creates a group of the given global ranks (their order sets the group ranks). Like
    torch.distributed.new_group, every rank must call it, in the same order, with the same list."""
    st = _get()
    ranks = [int(r) for r in ranks]
    if not ranks:
        raise ValueError("rumor.new_group(): ranks must not be empty")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"rumor.new_group(): duplicate ranks in {ranks}")
    bad = [r for r in ranks if not 0 <= r < st.env.size]
    if bad:
        raise ValueError(f"rumor.new_group(): ranks {bad} are outside a world of size {st.env.size}")
    gid = st.next_group_id
    st.next_group_id += 1
    comm = None
    if st.env.rank in ranks:
        comm = _C.Communicator(st.ctx, gid, f"group {gid}", ranks)
    g = Group(ranks, comm, gid)
    st.groups.append(g)
    return g


def local_group() -> Group:
    """The group of this machine's ranks (those sharing its host), e.g. for an allreduce inside
    each machine only: rumor.allreduce(t, group=rumor.local_group()). The first call creates one
    group per machine, in machine order, through new_group(): like new_group, every rank must
    make its first call at the same point of its sequence of group creations."""
    st = _get()
    g = getattr(st, "_local_group", None)
    if g is None:
        order = list(dict.fromkeys(st.hosts))
        for h in order:
            made = new_group([r for r in range(st.env.size) if st.hosts[r] == h])
            if h == st.hosts[st.env.rank]:
                g = made
        st._local_group = g
    return g


def _comm(group: Optional[Group], what: str):
    st = _get()
    g = st.world if group is None else group
    if not isinstance(g, Group):
        raise TypeError(f"{what}: group must be a rumor.Group from rumor.new_group(), got {type(g).__name__}")
    if g._comm is None:
        raise ValueError(f"{what}: rank {st.env.rank} is not a member of {g!r}")
    return g


def _listen_address() -> str:
    """Where this rank's listener accepts peers (for tests and diagnostics)."""
    st = _get()
    return f"127.0.0.1:{st.ctx.port}"


