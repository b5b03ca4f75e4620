"""Process-wide runtime: init(), shutdown(), rank queries and groups.

All mutable state lives in one _State object, created by init() and dropped by shutdown().
"""
from __future__ import annotations

import atexit
import logging
import math
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from . import _C, _rendezvous, _secret, _shm
from ._env import check_core_env, env_bool, env_choice, env_float, env_int  # noqa: F401 (the runtime's API)
from ._env import tls_options_from_env

DEFAULT_TIMEOUT = 300.0
_log = logging.getLogger("rumor")


class Group:
    """A subset of ranks, made by rumor.new_group() or rumor.local_group().

    Ranks in collectives are global ranks. Users get groups from those functions rather than
    constructing one.

    Args:
        ranks: the global ranks of the group, in group-rank order (kept as ``ranks``).
        comm: the group's communicator, or None on a rank outside the group.
        gid: the group's id, the same on every rank (kept as ``id``).
    """

    def __init__(self, ranks: List[int], comm: Optional["_C.Communicator"], gid: int):
        self.ranks = list(ranks)
        self._comm = comm
        self.id = gid
        self._gpu = None  # rumor.gpu.routing.GpuGroup: device, transport, NCCL communicator (GPU path)

    def rank(self) -> int:
        """This process's rank within the group, or -1 if it is not a member."""
        return self._comm.rank if self._comm is not None else -1

    def size(self) -> int:
        """The number of ranks in the group.

        Returns:
            len(ranks).
        """
        return len(self.ranks)

    def __contains__(self, global_rank: int) -> bool:
        return global_rank in self.ranks

    def __repr__(self) -> str:
        return f"rumor.Group(id={self.id}, ranks={self.ranks})"


@dataclass
class _State:
    env: _rendezvous.Env
    ctx: "_C.Context"
    world: Group
    hosts: List[str]
    local_rank: int
    local_size: int
    machine_rank: int
    machine_size: int
    timeout: float
    next_group_id: int = 1
    streams: int = 2  # TCP streams per peer pair at least, fixed for the life of the Context
    groups: list = field(default_factory=list)
    nccl: object = None  # rumor._C.NcclLibrary, loaded on first use by rumor.gpu.nccl.load()
    gpu_wait: str = "host"  # how blocking NCCL calls end (rumor.gpu.watch; docs/gpu.md)
    secret: Optional[_secret.JobSecret] = None  # the job secret (rumor._secret; docs/security.md)
    # A live newcomer until its state arrived: the members are not where it is (rumor.elastic
    # re-forming), so checks that every rank passed the same setting (set_topology) are made
    # later, at the change (rumor.neighbor.ops.check_topologies_agree), not by a collective now,
    # and its DDP wrapper does not broadcast rank 0's weights (the state brings the source's).
    awaiting_state: bool = False
    # One epoch of a live job (rumor-run --live): a collective that fails because a member left
    # ends the epoch and the job re-forms, so a wrapper whose construction it cut is built again.
    live: bool = False


_state: Optional[_State] = None
# The layers above the runtime that act at init() and shutdown() (the timeline, the GPU path)
# register here, so that the runtime does not import them and imports point down.
_init_hooks: list = []
_shutdown_hooks: list = []
_before_init_hooks: list = []
_init_failure_hooks: list = []
_generation = 0
# The TCPStore of the last init() outlives shutdown(): a peer that re-initialises before this
# rank has shut down may still be talking to the server rank 0 hosts. A later init() in this
# process shares the same server (multi_tenant) under a new key prefix.
_store_keepalive = None
# What init() is connecting: its Context while set_peers maps the local peers' doorbells, then
# the world communicator (its first barrier connects every pair). Live membership aborts it when
# a member dies mid-init, so that the others need not wait out the deadline for a peer that will
# never connect, or for the doorbell of one that gave up on this world first (abort_forming).
_forming = None


def core_options(timeout: float, socket_streams: Optional[int] = None, shm: Optional[bool] = None) -> "_C.Options":
    """The core's options from rumor's environment variables (docs/environment.md): one builder for
    rumor.init() and the torch.distributed backend's groups, so that both honour every setting."""
    opts = _C.Options()
    opts.timeout = float(timeout)
    if socket_streams is None:
        socket_streams = env_int("RUMOR_SOCKET_STREAMS", opts.streams, minimum=1, maximum=MAX_SOCKET_STREAMS)
    opts.streams = int(socket_streams)
    opts.shm = env_bool("RUMOR_SHM", True) if shm is None else bool(shm)
    opts.shm_ring_bytes = env_int("RUMOR_SHM_RING_BYTES", opts.shm_ring_bytes, minimum=1)
    opts.stripe_min = env_int("RUMOR_STRIPE_MIN_BYTES", opts.stripe_min, minimum=0)
    opts.stripe_steal = env_bool("RUMOR_STRIPE_STEAL", True)
    opts.stripe_adapt = env_bool("RUMOR_STRIPE_ADAPT", True)
    # A pair on a long link gets enough streams for this rate over its round trip (docs/environment.md).
    opts.link_rate = env_float("RUMOR_LINK_GBIT", opts.link_rate * 8e-9, positive=True) * 1.25e8
    opts.spin_us = env_int("RUMOR_SPIN_US", opts.spin_us, minimum=0)
    opts.host_direct = env_bool("RUMOR_HOST_DIRECT", True)
    opts.host_direct_min_bytes = env_int("RUMOR_HOST_DIRECT_MIN_BYTES", opts.host_direct_min_bytes, minimum=0)
    opts.huge_pages = env_bool("RUMOR_HUGE_PAGES", True)
    # Two ranks of one host, allreduce of 1-16 MiB: the path rank 0 names (the others follow it).
    opts.two_rank_path = {"auto": -1, "ring": 0, "direct": 1}[env_choice("RUMOR_TWO_RANK_PATH", ("auto", "ring", "direct"), "auto")]
    opts.site_overlap = env_bool("RUMOR_SITE_OVERLAP", True)
    # Progress deadlines over TCP (issue 46, csrc/net/stall.h): RUMOR_TIMEOUT bounds silence, a
    # peer stopped mid-message is reported after a deadline derived from the link, never sooner
    # than the floor.
    opts.adaptive_deadline = env_bool("RUMOR_ADAPTIVE_DEADLINE", True)
    opts.deadline_floor = env_float("RUMOR_DEADLINE_FLOOR", opts.deadline_floor, positive=True)
    opts.flight_records = flight_records_from_env()
    tls_options_from_env(opts)
    return opts


def init(timeout: Optional[float] = None, *, socket_streams: Optional[int] = None,
         shm: Optional[bool] = None, gpu_wait: Optional[str] = None) -> None:
    """Joins the job described by the launcher's environment (torchrun, mpirun or Slurm).

    timeout: seconds any blocking wait may go with no byte moving before it raises (env
      RUMOR_TIMEOUT, default 300); an op whose bytes keep moving may last longer, and a peer that
      stops in the middle of a TCP message is reported sooner (RUMOR_DEADLINE_FLOOR,
      RUMOR_ADAPTIVE_DEADLINE=0 for the whole-op deadline; docs/environment.md).
    socket_streams: parallel TCP streams per peer pair, at least (env RUMOR_SOCKET_STREAMS, default
      2); a pair on a long link gets more where its round trip needs them (env RUMOR_LINK_GBIT).
    shm: use shared memory between ranks on one host (env RUMOR_SHM, default on).
    gpu_wait: how a blocking collective on CUDA tensors over NCCL ends (env RUMOR_GPU_WAIT):
      "host" (default) once the op finished on the GPU, "stream" once it is queued on the current
      stream, as in torch.distributed (see rumor.set_gpu_wait).
    """
    if _state is not None:
        raise RuntimeError("rumor.init() was already called; call rumor.shutdown() first")
    for hook in list(_before_init_hooks):
        hook()
    try:
        _join(timeout, socket_streams, shm, gpu_wait)
    except Exception as e:
        # Live membership: a member of the world being formed is gone; the hook forms the next
        # world without it (this init() then returns in that one) or declines.
        if _state is None and any(hook(e) for hook in list(_init_failure_hooks)):
            return
        raise


def _join(timeout: Optional[float], socket_streams: Optional[int], shm: Optional[bool],
          gpu_wait: Optional[str]) -> None:
    global _state, _generation, _store_keepalive, _forming
    if gpu_wait is None:
        wait_mode = gpu_wait_mode(os.environ.get(GPU_WAIT_ENV), f"rumor.init(): {GPU_WAIT_ENV}")
    else:
        wait_mode = gpu_wait_mode(_str_arg(gpu_wait, "rumor.init(): gpu_wait"), "rumor.init(): gpu_wait")
    # Before anything starts: the C++ core reads these by itself, on first use, and would take
    # a misspelt value as the default.
    check_core_env()
    env = _rendezvous.read_env()
    _say_single_process(env)
    if timeout is None:
        timeout = env_float("RUMOR_TIMEOUT", DEFAULT_TIMEOUT, positive=True)
    if timeout <= 0:
        raise ValueError(f"rumor.init(): timeout must be positive, got {timeout}")
    if not 0 <= env.rank < env.size:
        raise ValueError(f"rumor.init(): rank {env.rank} is outside a world of size {env.size} ({env.source})")

    opts = core_options(timeout, socket_streams, shm)

    host = _rendezvous.host_id()
    if env.size == 1:
        # No connection to prove, but commits and caches it writes are read by later jobs.
        js = _secret.resolve(single_host=True)
        token = os.urandom(16)
        ctx = _C.Context(0, 1, token, opts, 0)
        addresses, hosts = [f"127.0.0.1:{ctx.port}"], [host]
    else:
        js = _rendezvous.job_secret_for(env)
        store = _rendezvous.store_for(env, timeout, _generation)
        _store_keepalive = store
        port = _rendezvous.listen_port(env)
        if opts.shm:
            _shm.sweep()
        advertise = _rendezvous.advertise_address(env.master_addr, env.master_port)
        bind = os.environ.get("RUMOR_BIND_ADDR", advertise)

        def make_ctx(tok: bytes):
            return _C.Context(env.rank, env.size, tok, opts, port, key=js.key("connection", tok), bind=bind)

        ctx, token, entries = _rendezvous.exchange(store, env, timeout, make_ctx, host, advertise, js)
        addresses, hosts = [e[1] for e in entries], [e[2] for e in entries]
    site_error = None
    try:
        if env.size == 1:
            ctx.set_peers(addresses, hosts)
        else:
            # Published before the check: live membership's watcher sets its trouble before it
            # reads _forming, so a loss is seen either here or by the abort.
            _forming = ctx
            _check_interrupt()
            ctx.set_peers(addresses, hosts, [e[3] for e in entries])
            site_error = _rendezvous.apply_sites(ctx, entries)
        _rendezvous.fault_point("init:peers", _generation)
        local = [r for r in range(env.size) if hosts[r] == hosts[env.rank]]
        if env_bool("RUMOR_BIND_CORES", False):
            _bind_core(local.index(env.rank), len(local))

        order: List[str] = []
        for h in hosts:
            if h not in order:
                order.append(h)
        world_comm = _C.Communicator(ctx, 0, "world", list(range(env.size)))
        _forming = world_comm
        _check_interrupt()
        # Once every rank has mapped its local peers' doorbells (set_peers), the names can go.
        world_comm.barrier(False)
    finally:
        _forming = None
    ctx.seal()
    if site_error:
        raise ValueError(site_error)
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
    for hook in list(_init_hooks):
        hook()


def _bind_core(local_rank: int, local_size: int) -> None:
    """RUMOR_BIND_CORES=1 (rumor-run --bind-cores): where this host has more ranks than this
    process may run on, bind local rank i to the i-th of those CPUs (modulo), so the shared slots
    know which late rank a waiting one would hand its core to (csrc/comm/direct.cpp). After
    set_peers, which has decided spinning and the direct path from the whole set. Elsewhere it
    does nothing: a rank with a core of its own gains nothing from being held to it."""
    cpus = sorted(os.sched_getaffinity(0))
    if local_size <= len(cpus):
        return
    os.sched_setaffinity(0, {cpus[local_rank % len(cpus)]})


_said_single = False


def _say_single_process(env) -> None:
    """A script started without a launcher runs alone; say so (once per process, at INFO) and
    how to start more, since a 1-process job otherwise looks just like a working one."""
    global _said_single
    if env.source != "single process" or _said_single:
        return
    _said_single = True
    _log.info("rumor.init(): no launcher variables are set (RANK and WORLD_SIZE, OMPI_COMM_WORLD_RANK, "
              "PMI_RANK or SLURM_PROCID), so this job runs as one process (world size 1). To start N "
              "processes on this host: python -m rumor.run --nproc-per-node N script.py (or torchrun, "
              "mpirun, srun)")


def shutdown() -> None:
    """Releases sockets, shared memory and threads. Outstanding handles must be waited on first."""
    global _state
    if _state is not None:
        errors = []
        # Upper layers registered last stop first (the timeline before the NCCL communicators).
        for hook in reversed(_shutdown_hooks):
            errors += hook(_state) or []
        if errors:
            import warnings

            warnings.warn("rumor.shutdown(): " + "; ".join(errors), RuntimeWarning, stacklevel=2)
    _state = None


# Release shared memory names and sockets at interpreter exit even if shutdown() was not called.
atexit.register(shutdown)


def abort_forming(why: str) -> bool:
    """Aborts what an init() in progress is connecting (its Context's doorbell waits, then its
    world communicator), if there is one; its waits then fail at once. Returns whether there was
    one."""
    forming = _forming
    if forming is None:
        return False
    forming.abort(why)
    return True


def _check_interrupt() -> None:
    if _rendezvous.interrupt is not None:
        _rendezvous.interrupt()


def on_init(fn) -> None:
    """fn() runs at the end of every init()."""
    if fn not in _init_hooks:
        _init_hooks.append(fn)


def on_init_failure(fn) -> None:
    """fn(error) runs when init() fails; returning True means it joined another world in its
    place (live membership re-forms without the member that left), and init() returns."""
    if fn not in _init_failure_hooks:
        _init_failure_hooks.append(fn)


def before_init(fn) -> None:
    """fn() runs at the start of every init(), before the launcher's variables are read: live
    membership (rumor._live) sets them there for a newcomer."""
    if fn not in _before_init_hooks:
        _before_init_hooks.append(fn)


def on_shutdown(fn) -> None:
    """fn(state) runs at shutdown() while the state is still up, in the reverse order of
    registration; it returns a list of errors as text (reported together in one warning)."""
    if fn not in _shutdown_hooks:
        _shutdown_hooks.append(fn)


def generation() -> int:
    """How many times init() succeeded in this process: objects that hold a communicator compare
    it to notice that the job they were made in is gone."""
    return _generation


def set_generation(n: int) -> None:
    """For engines that join a job again (rumor.interactive): every rank must count the same
    generation, or their store key prefixes differ; a rank whose earlier init() failed would not."""
    global _generation
    if _state is not None:
        raise RuntimeError("set_generation() while initialized; call shutdown() first")
    _generation = int(n)


def rendezvous_store():
    """The store the last init() met its peers through (None for a one-process job); it outlives
    shutdown() (see _store_keepalive)."""
    return _store_keepalive


def is_initialized() -> bool:
    """Whether rumor.init() was called and rumor.shutdown() was not since.

    Returns:
        A bool.
    """
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
    st = state()
    st.ctx.set_timeout(float(seconds))
    st.timeout = float(seconds)


def get_timeout() -> float:
    """The limit, in seconds, of the blocking waits that start now."""
    return state().timeout


def _str_arg(value, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a str, got {type(value).__name__}")
    return value


def set_gpu_wait(mode: str) -> None:
    """How the blocking collectives on CUDA tensors over NCCL that start from now on end, on
    this rank (ranks may differ; nonblocking calls and host staging are not affected).

    rumor.init(gpu_wait=...) or RUMOR_GPU_WAIT set the first value (default "host").

    Args:
        mode: "host": once the op finished on the GPU, waited for on the host with rumor's
            deadline, so an error or a missing peer is raised by the call itself (as in Horovod or
            BlueFog). "stream": once the op is queued on torch's current stream, as in
            torch.distributed, so consecutive calls and later kernels pipeline on the GPU; a watch
            thread keeps the deadline, and an op past it (or an NCCL error) aborts the group's
            communicator, is logged, and is raised by the group's next call.

    Raises:
        TypeError: mode is not a str.
        ValueError: mode is neither "host" nor "stream".
        RuntimeError: rumor is not initialized.
    """
    st = state()
    st.gpu_wait = gpu_wait_mode(_str_arg(mode, "rumor.set_gpu_wait(): mode"), "rumor.set_gpu_wait()")


def get_gpu_wait() -> str:
    """"host" or "stream": see rumor.set_gpu_wait."""
    return state().gpu_wait


def current() -> Optional[_State]:
    """The running job's state, or None before rumor.init() (for paths that fall back instead of raising)."""
    return _state


def state() -> _State:
    if _state is None:
        raise RuntimeError("rumor is not initialized: call rumor.init() first")
    return _state


def rank() -> int:
    """This process's global rank, 0 to size() - 1.

    Returns:
        An int.

    Raises:
        RuntimeError: rumor is not initialized (call rumor.init() first).
    """
    return state().env.rank


def size() -> int:
    """The number of processes in the job.

    Returns:
        An int.

    Raises:
        RuntimeError: rumor is not initialized (call rumor.init() first).
    """
    return state().env.size


def local_rank() -> int:
    """This process's rank among the processes on its machine.

    Returns:
        An int.

    Raises:
        RuntimeError: rumor is not initialized (call rumor.init() first).
    """
    return state().local_rank


def local_size() -> int:
    """The number of processes on this machine.

    Returns:
        An int.

    Raises:
        RuntimeError: rumor is not initialized (call rumor.init() first).
    """
    return state().local_size


def machine_rank() -> int:
    """The index of this process's machine, 0 to machine_size() - 1.

    Returns:
        An int.

    Raises:
        RuntimeError: rumor is not initialized (call rumor.init() first).
    """
    return state().machine_rank


def machine_size() -> int:
    """The number of machines in the job.

    Returns:
        An int.

    Raises:
        RuntimeError: rumor is not initialized (call rumor.init() first).
    """
    return state().machine_size


def new_group(ranks: Sequence[int]) -> Group:
    """Creates a group of the given global ranks (their order sets the group ranks). Like
    torch.distributed.new_group, every rank must call it, in the same order, with the same list."""
    st = state()
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
    st = state()
    g = getattr(st, "_local_group", None)
    if g is None:
        order = list(dict.fromkeys(st.hosts))
        for h in order:
            made = new_group([r for r in range(st.env.size) if st.hosts[r] == h])
            if h == st.hosts[st.env.rank]:
                g = made
        st._local_group = g
    return g


def communicator(group: Optional[Group], what: str):
    st = state()
    g = st.world if group is None else group
    if not isinstance(g, Group):
        raise TypeError(f"{what}: group must be a rumor.Group from rumor.new_group(), got {type(g).__name__}")
    if g._comm is None:
        raise ValueError(f"{what}: rank {st.env.rank} is not a member of {g!r}")
    return g


def listen_address() -> str:
    """Where this rank's listener accepts peers (for tests and diagnostics)."""
    st = state()
    return f"127.0.0.1:{st.ctx.port}"




GPU_WAIT_MODES = ("host", "stream")  # how blocking NCCL calls end (docs/gpu.md)


GPU_WAIT_ENV = "RUMOR_GPU_WAIT"


def gpu_wait_mode(raw: Optional[str], where: str) -> str:
    """A validated wait mode: 'host' (also for None or empty) or 'stream'."""
    value = (raw or "").strip().lower() or "host"
    if value not in GPU_WAIT_MODES:
        raise ValueError(f"{where}: expected one of {', '.join(GPU_WAIT_MODES)}, got {raw!r}")
    return value


DEFAULT_FLIGHT_RECORDS = 64
MAX_SOCKET_STREAMS = 16  # net::kMaxStreams (csrc/net/channel.h)


def flight_records_from_env() -> int:
    return env_int("RUMOR_FLIGHT_RECORDER", DEFAULT_FLIGHT_RECORDS, minimum=0)
