"""The advisor's probes: what a job's step costs on this machine, measured collectively (every
rank at once, every figure the slowest rank's so that all ranks agree on the table).

* compute: forward, backward and optimizer.step of the plain model on the sample batch (all
  ranks at once, as in training), and when each parameter's gradient became ready during
  backward (post-accumulate-grad hooks) -- the order and times that decide how much
  communication can hide behind backward;
* the links: a ring allreduce at two sizes inside each host (shared memory) and among one rank
  per host (the network), fitted as ``t = 2(n-1)/n * bytes / bandwidth + 2(n-1) * latency``,
  and the CPU (user + system) a byte sent over the network costs this process; with the CPU
  share of compute (CPU seconds per second: below 1 where ranks share cores) that gives what
  network traffic beside compute costs it; between hosts also a swap with one peer (both ways
  at once) and the ring's rate while every rank computes beside it, at a size near the job's;
* the codecs: encode and decode time per element of each compressed algorithm's codec, and
  their exact encoded sizes; one pass of weight arithmetic and one gradient copy per element;
  PowerSGD's kernels per matrix element; how much of a comm thread's CPU work compute loses
  (a codec looping beside forward and backward).

rumor.advisor.model turns these figures into predicted steps.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .model import MB, Link, ring_sent

__all__ = [
    "LOCAL_MAX", "default_loss", "measure_arena_round", "measure_codecs", "measure_compute", "measure_copy",
    "measure_elementwise", "measure_links", "measure_loopback", "measure_mix", "measure_powersgd", "measure_steal",
    "powersgd_probe_shape",
]


def default_loss(model, batch):
    x, y = batch
    out = model(*x) if isinstance(x, (tuple, list)) else model(x)
    out = out.reshape(-1, out.shape[-1])
    if out.dtype not in (torch.float32, torch.float64):
        out = out.float()
    return torch.nn.functional.cross_entropy(out, y.reshape(-1))


def measure_compute(model, optimizer, batch, loss_fn, steps: int, warmup: int,
                     sync: Optional[Callable[[], None]] = None):
    """sync (untimed) before every step starts the ranks' steps together, as a wrapper that
    synchronizes every step does: their spread then is the wait such a step pays. Returns
    (params, forward, backward, optimizer (medians), each gradient's median ready time into
    backward, its ready time in the first step, CPU share, each measured step's ready times
    from the step's start, each measured step's time)."""
    params = [p for p in model.parameters() if p.requires_grad]
    ready = {}
    t_bwd = [0.0]

    def hook_for(i):
        def hook(_p):
            ready[i] = time.perf_counter() - t_bwd[0]
        return hook

    handles = [p.register_post_accumulate_grad_hook(hook_for(i)) for i, p in enumerate(params)]
    fwd, bwd, opt, readies, since_start, totals = [], [], [], [], [], []
    first = None
    wall = cpu = 0.0
    try:
        for s in range(warmup + steps):
            # As torch's default zero_grad() leaves them: autograd makes fresh gradients. Kept
            # gradients make backward add into them instead, a temporary and a pass over every
            # gradient that training does not pay (mlp25m, 4 ranks on 2 cores: backward 186-238
            # ms kept against 130-165 ms fresh); the wrapper's copy into its buckets is modelled
            # apart (model._grad_copy_s).
            optimizer.zero_grad(set_to_none=True)
            ready.clear()
            if sync is not None:
                sync()
            c0 = time.process_time()
            t0 = time.perf_counter()
            loss = loss_fn(model, batch)
            t1 = time.perf_counter()
            t_bwd[0] = t1
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            t3 = time.perf_counter()
            if s == 0:
                first = [ready.get(i, t2 - t1) for i in range(len(params))]
            if s >= warmup:
                wall += t3 - t0
                cpu += time.process_time() - c0
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                opt.append(t3 - t2)
                totals.append(t3 - t0)
                readies.append([ready.get(i, t2 - t1) for i in range(len(params))])
                since_start.append([t1 - t0 + r for r in readies[-1]])
    finally:
        for h in handles:
            h.remove()
    med = [statistics.median(r[i] for r in readies) for i in range(len(params))]
    share = cpu / wall if wall > 0 else 1.0  # CPU seconds per second of compute (threads, sharing)
    return (params, statistics.median(fwd), statistics.median(bwd), statistics.median(opt), med, first, share,
            since_start, totals)



def _process_cpu_s() -> float:
    """User + system CPU of this process, all threads (the kernel's socket work included)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _time_allreduce(group, nbytes: int, reps: int):
    """(seconds of the least disturbed repetition, CPU seconds per byte this rank sent)."""
    from ..collectives import allreduce_

    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    best, cpu = _least_disturbed(lambda: allreduce_(buf, group=group, algorithm="ring"), reps)
    sent = reps * ring_sent(buf.numel() * 4, group.size())
    return best, cpu / sent if sent > 0 else 0.0


def _least_disturbed(fn: Callable[[], object], reps: int):
    """(seconds of the fastest of reps calls after one warm-up, CPU seconds of all reps): other
    processes only ever add time."""
    fn()
    times = []
    c0 = _process_cpu_s()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), _process_cpu_s() - c0


def _line(small: float, big: float, s_small: int, s_big: int):
    """(seconds per byte, fixed seconds) of the line through two timed sizes."""
    if big > small:
        a = (big - small) / (s_big - s_small)
        return a, max(small - a * s_small, 0.0)
    # noise hid the size dependence: all of the large message's time counts as bandwidth
    return max(big, 1e-9) / s_big, max(small, 0.0)


def _fit(n: int, small: float, big: float, s_small: int, s_big: int) -> Link:
    # t = a * bytes + b, a = 2(n-1)/n / bandwidth, b = 2(n-1) * latency
    a, b = _line(small, big, s_small, s_big)
    return Link(n=n, bandwidth_Bps=2 * (n - 1) / n / a, latency_s=b / (2 * (n - 1)),
                samples=[(s_small, small), (s_big, big)])


def _fit_hop(small: float, big: float, s_small: int, s_big: int) -> Link:
    # t = bytes / bandwidth + latency (one message each way between two ranks at once)
    a, b = _line(small, big, s_small, s_big)
    return Link(n=2, bandwidth_Bps=1 / a, latency_s=b, samples=[(s_small, small), (s_big, big)])


def _time_exchange(group, nbytes: int, reps: int) -> float:
    """Seconds of the least disturbed swap of nbytes with this rank's partner of a pairing of
    the group (shift_one's first round), both directions at once; 0 for a rank left out."""
    from .. import _runtime
    from ..algorithms.decentralized import shift_one_peer
    from ..neighbor.ops import neighbor_allreduce

    me = group.ranks.index(_runtime.state().env.rank)
    peer = shift_one_peer(group.size(), me, 0)
    if peer is None:
        return 0.0
    other = group.ranks[peer]
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)

    def swap():
        neighbor_allreduce(buf, self_weight=0.5, src_weights={other: 0.5}, dst_weights=[other],
                           enable_topo_check=False, group=group)
    return _least_disturbed(swap, reps)[0]


def _local_ends_ops(group, nbytes: int) -> Tuple[Callable[[], None], Callable[[], None]]:
    """(reduce to the group's first rank then broadcast from it, the broadcast alone) of nbytes:
    the two legs a hierarchical allreduce runs inside a host around the leaders' exchange.
    Called on the C++ communicator directly: the Python reduce copies its input, which at a
    bucket's size would be timed with it."""
    from .. import _runtime
    from .._tensor import address, dtype_code
    from ..collectives import ReduceOp

    c = group._comm
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    code, n = dtype_code(buf.dtype, "rumor.advise"), buf.numel()
    wait_s = float(_runtime.state().timeout) * 4  # the ops carry their own deadline

    def bcast():
        c.broadcast(address(buf), n, code, 0, True).wait(wait_s)

    def ends():
        # SUM as the op does; from ones the values stay small integers over any reps.
        c.reduce(address(buf), n, code, int(ReduceOp.SUM), 0, True).wait(wait_s)
        bcast()
    return ends, bcast


def _time_local_ends(group, nbytes: int, reps: int) -> Tuple[float, float]:
    """Seconds of the least disturbed repetition of each of _local_ends_ops."""
    ends, bcast = _local_ends_ops(group, nbytes)
    return _least_disturbed(ends, reps)[0], _least_disturbed(bcast, reps)[0]



# transfers run slower than a few MB do (1 Gbit emulated hosts: a swap of 4 MB with one peer at
# 123 MB/s, of 100 MB at 105 MB/s; a ring allreduce 123 vs 117 MB/s).
_SUSTAINED_S = 0.5
_SUSTAINED_MAX = 128 * MB
# The pairwise swap is timed at the job's own size, up to this much link time: a swap of a few
# MB through a shaped link ran slower than the model's whole exchange does (100 Mbit emulated
# hosts: 6 MB each way at 8.1 MB/s, the transformer's 21 MB in training at about 11.5 MB/s):
# each host's queue carries its data out and the acknowledgements of what it receives, and a
# short transfer ends before its window has grown past the queueing delay.
_PAIR_S = 2.0


# Inside a host, where hosts have several ranks, the probes run at the job's size up to this
# much: the hierarchical allreduce moves whole buckets through shared memory, and a 4 MB probe
# stays in the cache. 2 emulated hosts x 2 ranks, mlp25m: a 64 MB bucket's reduce + broadcast
# took 90 ms (median) in training, where the ring at the 4 MB probe's rate priced 41 ms; the
# model left 100-200 ms of the step out.
LOCAL_MAX = 64 * MB


def measure_links(link_bytes: int, reps: int, busy: Optional[Callable[[], None]] = None, job_bytes: int = 0):
    """Ring allreduce inside each host (all hosts at once) and among one rank per host; every
    rank gets the slowest figures. Among the host leaders also a pairwise swap (one peer, both
    directions: what shift_one's mixing does) and, with ``busy`` (one step of compute), the
    ring allreduce again while every rank computes beside it. Between hosts the large size
    grows toward ``job_bytes`` (see _SUSTAINED_S). Where hosts have several ranks, also the
    hierarchical allreduce's ends inside each host (reduce + broadcast, and broadcast alone),
    the local probes at the job's size where there are several hosts (see LOCAL_MAX), and
    there the ends' rate beside compute. Creates the groups it needs (collectively, on every
    rank). Returns (hosts, ranks per host, intra, inter, pair, the network's CPU per byte sent,
    its rate beside compute, ends, broadcast, the ends' rate beside compute)."""
    from .. import _runtime
    from ..collectives import ReduceOp, allreduce
    from .._runtime import new_group

    st = _runtime.state()
    hosts: List[str] = []
    for h in st.hosts:
        if h not in hosts:
            hosts.append(h)
    members = {h: [r for r in range(st.env.size) if st.hosts[r] == h] for h in hosts}
    me = st.env.rank
    small = 4 * 1024
    big = max(link_bytes, 4 * small)
    out = torch.zeros(13, dtype=torch.float64)
    local_n = max(len(m) for m in members.values())
    local_big = big
    if local_n > 1 and len(hosts) > 1:
        local_big = max(big, min(job_bytes, LOCAL_MAX) // 4096 * 4096)
    if local_n > 1:
        groups = {h: new_group(members[h]) if len(members[h]) > 1 else None for h in hosts}
        g = groups[st.hosts[me]]
        if g is not None:
            few = reps if local_big == big else min(reps, 3)
            out[0] = _time_allreduce(g, small, reps)[0]
            out[1] = _time_allreduce(g, local_big, few)[0]
            out[9], out[10] = _time_local_ends(g, small, reps)
            out[11], out[12] = _time_local_ends(g, local_big, few)
    lg, leaders = None, []
    if len(hosts) > 1:
        leaders = [members[h][0] for h in hosts]
        lg = new_group(leaders)
    wide = big  # the network probes' large size
    if lg is not None and me in leaders:
        out[2] = _time_allreduce(lg, small, reps)[0]
        first = allreduce(torch.tensor([_time_allreduce(lg, big, 1)[0]], dtype=torch.float64), op=ReduceOp.MAX,
                          group=lg).item()
        bw = ring_sent(big, len(hosts)) / max(first, 1e-9)

        def sized(seconds: float, floor: int) -> int:
            """The job's bytes, up to what the link moves in ``seconds`` (and _SUSTAINED_MAX),
            in whole pages, at least ``floor``."""
            return max(floor, min(job_bytes, int(seconds * bw), _SUSTAINED_MAX) // 4096 * 4096)
        wide = sized(_SUSTAINED_S, big)
        few = reps if wide == big else 2
        out[3], out[4] = _time_allreduce(lg, wide, few)
        swap = sized(_PAIR_S, wide)
        out[5] = _time_exchange(lg, small, reps)
        out[6] = _time_exchange(lg, swap, few if swap == wide else 2)
        out[7] = wide  # every rank needs the sizes the leaders chose
        out[8] = swap
    out = allreduce(out, op=ReduceOp.MAX)
    t = out.tolist()
    wide = int(t[7]) if lg is not None else big
    intra = _fit(local_n, t[0], t[1], small, local_big) if local_n > 1 else None
    inter = _fit(len(hosts), t[2], t[3], small, wide) if len(hosts) > 1 else None
    pair = _fit_hop(t[5], t[6], small, int(t[8])) if len(hosts) > 1 and t[6] > 0 else None
    ends = bcast = None
    if local_n > 1:
        ends = _fit_hop(t[9], t[11], small, local_big)
        bcast = _fit_hop(t[10], t[12], small, local_big)
    rate = local_rate = 1.0
    if lg is not None and busy is not None:
        rate = _comm_rate_beside(lg, wide, t[3], busy)
    if ends is not None and busy is not None and len(hosts) > 1:
        # The legs inside a host are memory copies on the comm thread: beside compute that
        # shares the cores they slow far more than the sockets do (2 emulated hosts x 2 ranks,
        # mlp25m: a 64 MB reduce took 173 ms beside backward, 50-70 alone).
        g = groups[st.hosts[me]]
        run = _local_ends_ops(g, local_big)[0] if g is not None else (lambda: None)
        local_rate = _rate_beside(run, g is not None, t[11], busy)
    return len(hosts), local_n, intra, inter, pair, t[4], rate, ends, bcast, local_rate


def _comm_rate_beside(lg, nbytes: int, alone_s: float, busy: Callable[[], None], reps: int = 2) -> float:
    """How fast the network ring runs while every rank computes (1 = as fast as alone): the
    leaders time a ring allreduce of nbytes on a thread while every rank runs ``busy`` for
    about twice its time alone. The comm thread, the sockets and compute share the cores."""
    from .. import _runtime
    from ..collectives import allreduce_

    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    lead = _runtime.state().env.rank in lg.ranks
    return _rate_beside(lambda: allreduce_(buf, group=lg, algorithm="ring"), lead, alone_s, busy, reps)


def _rate_beside(op: Callable[[], object], member: bool, alone_s: float, busy: Callable[[], None],
                 reps: int = 2) -> float:
    """How fast ``op`` (a collective of the ranks where ``member``, alone_s seconds alone) runs
    while every rank computes: it runs on a thread while every rank runs ``busy`` for about
    twice its time alone; the slowest member's figure, on every rank (collective)."""
    return _beside_compute(op, member, alone_s, busy, reps)[0]


def _beside_compute(op: Callable[[], object], member: bool, alone_s: float, busy: Callable[[], None],
                    reps: int = 2, stretch: bool = False) -> Tuple[float, float]:
    """(_rate_beside's rate, and with ``stretch`` the seconds compute is lengthened per second of
    op's work done beside it: busy() timed alone again in each repetition, the mean over the
    repetitions, the largest of the members'; else 0). Collective."""
    import threading

    from ..collectives import ReduceOp, allreduce, barrier

    t0 = time.perf_counter()
    busy()
    one = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    one = allreduce(one, op=ReduceOp.MAX).item()
    steps = max(1, math.ceil(2 * alone_s / max(one, 1e-6)))
    best = math.inf
    stretches = []
    for _ in range(reps):
        took = [0.0]
        if stretch:
            barrier()
            c0 = time.perf_counter()
            for _ in range(steps):
                busy()
            c_alone = time.perf_counter() - c0

        def comm():
            c0 = time.perf_counter()
            op()
            took[0] = time.perf_counter() - c0
        barrier()
        th = threading.Thread(target=comm) if member else None
        c0 = time.perf_counter()
        if th is not None:
            th.start()
        for _ in range(steps):
            busy()
        c = time.perf_counter() - c0
        if th is not None:
            th.join()
        if member and took[0] > 0:
            T = took[0]
            # Progress beside compute at rate r, alone after it: T = c + (alone - r c) when the
            # comm outlasts compute, else T = alone / r.
            r = alone_s / T if T <= c else (alone_s - (T - c)) / c
            best = min(best, 1.0 / max(r, 1e-3))
            if stretch:
                done = alone_s if T <= c else max(r, 1e-3) * c  # op's work while compute ran
                stretches.append((c - c_alone) / max(done, 1e-9))
    out = torch.tensor([best if best < math.inf else 0.0, statistics.fmean(stretches) if stretches else 0.0],
                       dtype=torch.float64)
    slow, grew = allreduce(out, op=ReduceOp.MAX).tolist()
    rate = 1.0 if slow <= 0 else min(1.0, max(0.1, 1.0 / slow))
    return rate, min(2.0, max(0.0, grew))


def _codecs():
    from .. import compression as C

    return {"ByteGrad": C.MinMaxUInt8(), "QSGD": C.QSGD(levels=16), "fp16": C.Float16(), "bf16": C.BFloat16(),
            "1-bit": C.SignScale()}


def measure_codecs(elements: int, reps: int) -> Dict[str, Dict[str, float]]:
    x = torch.randn(elements, dtype=torch.float32)
    res = {}
    for name, codec in _codecs().items():
        enc_t, dec_t = [], []
        buf = codec.encode(x)
        out = torch.empty_like(x)
        for _ in range(reps):
            t0 = time.perf_counter()
            codec.encode(x, out=buf)
            t1 = time.perf_counter()
            codec.decode(buf, x.shape, out=out)
            dec_t.append(time.perf_counter() - t1)
            enc_t.append(t1 - t0)
        res[name] = dict(encode_s_per_element=statistics.median(enc_t) / elements,
                         decode_s_per_element=statistics.median(dec_t) / elements,
                         wire_bytes_per_element=codec.encoded_bytes(1 << 20) / (1 << 20))
    return res


def measure_copy(elements: int, reps: int) -> float:
    """Seconds per element of copying a float32 gradient: what the wrapper pays once a step to
    move each gradient autograd made (zero_grad(set_to_none=True), torch's default) into its
    bucket, and torch DDP twice (into its bucket and back)."""
    a, b = torch.randn(elements), torch.empty(elements)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / elements


def measure_steal(busy: Callable[[], None], elements: int, reps: int = 3) -> float:
    """How much of the comm thread's CPU work (codecs, PowerSGD's kernels, weight mixing) comes
    out of compute: a C++ codec loops on a thread while ``busy`` (forward and backward) runs
    ``reps`` times, on every rank at once. Returns compute's stretch over the thread's work
    (both in wall seconds as measured with every rank busy): about 0 where each rank has a
    core to spare, about 1 where the ranks already fill the cores (4 ranks on 2 cores)."""
    import threading

    from .. import compression as C

    codec = C.MinMaxUInt8()
    x = torch.randn(max(1, min(elements, 1 << 22)))
    buf = codec.encode(x)
    t0 = time.perf_counter()
    for _ in range(reps):
        busy()
    alone = time.perf_counter() - t0
    passes = []
    for _ in range(3):
        t = time.perf_counter()
        codec.encode(x, out=buf)
        passes.append(time.perf_counter() - t)
    per_pass = statistics.median(passes)
    stop = threading.Event()
    done = [0]

    def work():
        while not stop.is_set():
            codec.encode(x, out=buf)
            done[0] += 1

    th = threading.Thread(target=work, name="rumor-advise-steal", daemon=True)
    th.start()
    try:
        t0 = time.perf_counter()
        for _ in range(reps):
            busy()
        beside = time.perf_counter() - t0
        n = done[0]
    finally:
        stop.set()
        th.join()
    if n == 0:  # the thread never finished a pass beside compute: it got no CPU to speak of
        return 1.0
    # At most all of it: the excess measured beside a busy memory bus (up to 1.5 on 4 ranks on
    # 2 cores) did not show in training, where the kernels run between compute's bursts.
    return min(1.0, max(0.0, (beside - alone) / (n * per_pass)))


def measure_mix(busy: Callable[[], None], nbytes: int, reps: int = 2) -> Tuple[float, float, float]:
    """(seconds alone, rate beside compute, compute's stretch per second of it: _beside_compute)
    of a weight mix on one host: a copy of nbytes of weights and the ring allreduce of the copy
    over every rank (Decentralized's mix there). Collective."""
    from ..collectives import ReduceOp, allreduce, allreduce_

    a = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    b = torch.empty_like(a)

    def mix():
        b.copy_(a)
        allreduce_(b, algorithm="ring")
    alone = _least_disturbed(mix, reps)[0]
    alone = allreduce(torch.tensor([alone], dtype=torch.float64), op=ReduceOp.MAX).item()
    return (alone,) + _beside_compute(mix, True, alone, busy, reps, stretch=True)


def measure_arena_round(busy: Callable[[], None], elements: int,
                         reps: int = 2) -> Optional[Tuple[float, float, float]]:
    """AsyncModelAverage's round with every rank on one host: one SharedArena.average_into_deltas
    over `elements` float32 weights, every rank at once: (seconds alone, and _beside_compute's
    rate and stretch), or None where the world has no shared arena (the algorithm then
    averages private buffers, priced as the weight mix). Collective.

    Timed, not derived from the weight passes: on 4 ranks of 2 cores (mlp25m, 100 MB) a round
    took 84 ms alone where two thirds of a pass priced 32, and 150-275 ms beside training."""
    from .. import _C, _runtime
    from .._tensor import address, dtype_code
    from ..algorithms.async_model_average import shared_arena_possible
    from ..collectives import ReduceOp, allreduce

    comm = _runtime.communicator(None, "rumor.advise")._comm
    if not shared_arena_possible(comm):
        return None
    size = (elements * 4 + 63) // 64 * 64
    arena = _C.SharedArena(comm, 2 * size)
    x, delta = (torch.frombuffer(arena, dtype=torch.float32, count=elements, offset=at) for at in (0, size))
    # Values to average (the arena mapped its pages when built, so no round below pays a first
    # touch: before it did, mlp25m's first round took 1.6 s against 84 ms for the next ones).
    x.fill_(1.0)
    delta.zero_()
    roles = [1] * comm.size
    code = dtype_code(torch.float32, "rumor.advise")

    def one_round():
        arena.average_into_deltas(address(x), address(delta), elements, code, roles)
    alone = _least_disturbed(one_round, reps)[0]
    alone = allreduce(torch.tensor([alone], dtype=torch.float64), op=ReduceOp.MAX).item()
    return (alone,) + _beside_compute(one_round, True, alone, busy, reps, stretch=True)


def _loopback_ops(nbytes: int):
    """(push, close): push() sends nbytes through a TCP connection over loopback to this same
    process (a thread sends, the caller receives): the kernel's copies that a TCP collective
    between ranks of one host pays (torch DDP's gloo there)."""
    import socket
    import threading

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(60)
        cli = socket.create_connection(srv.getsockname(), timeout=60)
        try:
            conn, _ = srv.accept()
        except BaseException:
            cli.close()
            raise
    conn.settimeout(60)
    for sk in (cli, conn):
        sk.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    chunk = min(nbytes, 4 * MB) or 1
    out = memoryview(bytearray(chunk))
    into = memoryview(bytearray(chunk))

    def push():
        def send():
            left = nbytes
            while left > 0:
                n = min(left, chunk)
                cli.sendall(out[:n])
                left -= n
        th = threading.Thread(target=send, name="rumor-advise-loopback", daemon=True)
        th.start()
        got = 0
        while got < nbytes:
            n = conn.recv_into(into, min(chunk, nbytes - got))
            if n == 0:
                raise RuntimeError("rumor.advise: the loopback probe's connection closed early")
            got += n
        th.join()

    def close():
        cli.close()
        conn.close()
    return push, close


def measure_loopback(busy: Callable[[], None], nbytes: int, reps: int = 2):
    """TCP over loopback on one host, every rank at once: (a Link fitted through a small and an
    nbytes push, its rate beside compute, compute's stretch per second of it:
    _beside_compute). Collective."""
    from ..collectives import ReduceOp, allreduce

    small = 4096
    with contextlib.ExitStack() as opened:
        push_small, close_small = _loopback_ops(small)
        opened.callback(close_small)
        push, close = _loopback_ops(nbytes)
        opened.callback(close)
        t = torch.tensor([_least_disturbed(push_small, reps + 1)[0], _least_disturbed(push, reps)[0]],
                         dtype=torch.float64)
        t_small, t_big = allreduce(t, op=ReduceOp.MAX).tolist()
        rate, stretch = _beside_compute(push, True, t_big, busy, reps, stretch=True)
    return _fit_hop(t_small, t_big, small, nbytes), rate, stretch


def measure_elementwise(elements: int, reps: int) -> float:
    """Seconds per element of one pass over float32 weights (c = a + b): the unit of the weight
    arithmetic of the averaging algorithms (mixing, snapshots, deltas, outer steps)."""
    a, b = torch.randn(elements), torch.randn(elements)
    c = torch.empty_like(a)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        torch.add(a, b, out=c)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / elements




def powersgd_probe_shape(shapes: List[List[int]], cap: int = 1 << 23) -> Tuple[int, int]:
    """(rows, columns) of the PowerSGD kernel probe: the job's largest matrix as PowerSGD views it
    (first dimension by the rest), with rows cut to at most `cap` elements. The kernels stream
    the gradient and its error from memory: on mlp25m's 4096 x 4096 they took 2.4 ns per element
    against 1.2 ns on a cache-friendly 512 x 2048, and the small probe predicted PowerSGD's step
    34% short."""
    mats = [(s[0], math.prod(s[1:])) for s in shapes if len(s) >= 2 and s[0] > 1 and math.prod(s[1:]) > 1]
    if not mats:
        return 512, 2048
    rows, cols = max(mats, key=lambda rc: rc[0] * rc[1])
    return max(1, min(rows, cap // cols)), cols


def measure_powersgd(rank: int, reps: int, shape: Tuple[int, int] = (512, 2048)) -> float:
    """Seconds per matrix element of PowerSGD's three kernels (project with error feedback,
    back-project, reconstruct) at this rank: the C++ kernels the bucket op runs."""
    from .. import _C

    n, m = shape
    g, err = torch.randn(n, m), torch.zeros(n, m)
    qt, p, out = torch.randn(rank, m), torch.empty(n, rank), torch.empty(rank, m)
    ptr = lambda t: t.data_ptr()  # noqa: E731
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        _C.powersgd_kernel("project", "", ptr(err), ptr(g), n, m, ptr(qt), rank, ptr(p))
        _C.powersgd_kernel("back_project", "", ptr(err), 0, n, m, ptr(p), rank, ptr(out))
        _C.powersgd_kernel("reconstruct", "", ptr(p), ptr(err), n, m, ptr(qt), rank, ptr(g))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / (n * m)
