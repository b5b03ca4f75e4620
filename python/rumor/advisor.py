"""The advisor (rumor.advise): measures a job and predicts which rumor algorithm trains it fastest
(docs/advisor.md).

Inside a job (every rank, after rumor.init())::

    advice = rumor.advise(model, optimizer, (inputs, targets))
    print(advice.best["algorithm"])

From the command line, for a script that defines ``rumor_advise()`` returning
``dict(model=..., optimizer=..., batch=..., loss_fn=None)``::

    python -m rumor.advise --nproc-per-node 4 train.py [script args]
    rumor-run --nnodes 4 ... -m rumor.advise train.py [script args]     (several hosts)

What it measures (every figure is the slowest rank's, so all ranks agree on the table):

* compute: forward, backward and optimizer.step of the plain model on the sample batch (all
  ranks at once, as in training), and when each parameter's gradient became ready during
  backward (post-accumulate-grad hooks) -- the order and times that decide how much
  communication can hide behind backward;
* the gradients: elements, bytes, dtypes;
* the links: a ring allreduce at two sizes inside each host (shared memory) and among one rank
  per host (the network), fitted as ``t = 2(n-1)/n * bytes / bandwidth + 2(n-1) * latency``,
  and the CPU (user + system) a byte sent over the network costs this process; with the CPU
  share of compute (CPU seconds per second: below 1 where ranks share cores) that gives what
  network traffic beside compute costs it; between hosts also a swap with one peer (both ways
  at once) and the ring's rate while every rank computes beside it, at a size near the job's;
* the codecs: encode and decode time per element of each compressed algorithm's codec, and
  their exact encoded sizes; one pass of weight arithmetic and one gradient copy per element;
  PowerSGD's kernels per matrix element; how much of a comm thread's CPU work compute loses
  (a codec looping beside forward and backward);
* the module's buffers (the wrapper broadcasts them before every forward).

The model and the optimizer are put back as they were (state dicts restored, gradients cleared).

How it predicts: the link-bound model of benchmarks/training.py. Gradients are bucketed as the
wrapper does after its first iteration (25 MB, first 1 MB, in ready order, a new bucket where a
gradient came more than 5 ms after the one before; torch DDP: its own plan, 1 MiB then 25 MB, no
splits); each bucket's communication starts when it is ready and the previous one is done; its
time is the ring time of the bytes it puts on the wire (each algorithm's codec ratio,
hierarchical where the algorithm is) plus its codec work. A step is buffer broadcast + forward +
max(backward + network CPU, last bucket done) + optimizer, where network CPU is the cost of the
step's bytes sent between hosts, and traffic between hosts runs at the measured rate beside
compute until backward ends; backward also pays the gradients' copy into the buckets and the
measured share of the comm thread's codec and kernel work. Decentralized algorithms mix weights on the comm thread from
the start of forward: forward + max(backward + network CPU, mixing) + optimizer;
LowPrecisionDecentralized's exchange runs after the step and, when the model has buffers to
broadcast, delays the next forward. Periodic algorithms (LocalSGD, DiLoCo, Streaming DiLoCo)
are a local step (the ranks' mean compute step: nothing makes them wait for each step's
slowest) plus their round's cost divided by its steps; AsyncModelAverage is that local step
plus what its background rounds take from compute (weight passes and network CPU), spread over
the steps of a round. Torch DDP is the same
model with a flat fp32 ring over all ranks (gloo's own overheads are not modelled).
docs/advisor.md has the details.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

_MB = 1024 * 1024

# Convergence caveat of each family (what changes against exact data-parallel SGD).
EXACT = "exact (same averaged gradient as torch DDP, up to summation order)"
COMPRESSED = "compressed gradients, no error feedback (lossy averaging; check the loss curve)"
COMPRESSED_EF = "compressed (1-bit) momentum with error feedback; full-precision Adam warm-up first"
HALF = "gradients rounded to 16 bits on the wire (small, unbiased-ish rounding error)"
DECENTRALIZED = "decentralized: ranks hold different weights that mix with peers (not exact SGD)"
DECENTRALIZED_LP = "decentralized with compressed weight differences and error compensation"
POWERSGD = ("low-rank gradients with error feedback after start_powerSGD_iter exact steps (default 1000; "
            "check the loss curve)")
LOCAL_SGD = "local SGD: ranks train alone and average their weights every few steps (not exact SGD)"
DILOCO = "DiLoCo: ranks train alone, an outer Nesterov step on the averaged change per round (tune the outer lr)"
STREAMING = "Streaming DiLoCo: as DiLoCo, fragments averaged in int8 in the background (stale by a few steps)"
ASYNC = "asynchronous: weights averaged in the background, ranks never wait (stale averages; call finish() at the end)"

# Settings of the candidates the advisor lists (shown in their constructor arguments).
LOCAL_SGD_EVERY = 8
DILOCO_H = 32
STREAMING_FRAGMENTS = 4
AMA_INTERVAL_MS = 500
AMA_MAX_BUSY = 0.1  # AsyncModelAverage's max_busy_fraction default (one host)


@dataclass
class Link:
    """A ring allreduce among n ranks over one kind of link, fitted at two sizes."""

    n: int
    bandwidth_Bps: float
    latency_s: float
    samples: List = field(default_factory=list)  # (bytes, seconds) measured

    def ring(self, nbytes: float, n: Optional[int] = None) -> float:
        n = self.n if n is None else n
        if n <= 1 or nbytes <= 0:
            return 0.0
        return 2 * (n - 1) / n * nbytes / self.bandwidth_Bps + 2 * (n - 1) * self.latency_s

    def hop(self, nbytes: float) -> float:
        """One message to one peer."""
        return nbytes / self.bandwidth_Bps + self.latency_s


@dataclass
class Advice:
    """rows: one dict per algorithm, fastest first (algorithm, kwargs, ctor, kind, period,
    predicted_step_s, speedup_over_torch, exposed_comm_s, wire_bytes_per_element, caveat);
    torch: the torch DDP row; measured: what the prediction rests on; table: the printed text."""

    rows: List[Dict]
    torch: Dict
    measured: Dict
    table: str

    @property
    def best(self) -> Dict:
        return self.rows[0]

    def algorithm(self, row: Optional[Dict] = None, optimizer=None):
        """A new instance of the best row's algorithm (or of ``row``'s), for the wrapper's
        ``algorithm=``; 1-bit Adam needs its optimizer."""
        return build_algorithm(self.best if row is None else row, optimizer)


# ==== measuring ========================================================================================

def _default_loss(model, batch):
    x, y = batch
    out = model(*x) if isinstance(x, (tuple, list)) else model(x)
    out = out.reshape(-1, out.shape[-1])
    if out.dtype not in (torch.float32, torch.float64):
        out = out.float()
    return torch.nn.functional.cross_entropy(out, y.reshape(-1))


def _measure_compute(model, optimizer, batch, loss_fn, steps: int, warmup: int,
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
            # apart (_grad_copy_s).
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


def _ring_sent(nbytes: float, n: int) -> float:
    """Bytes each of n ranks sends in a ring (or all-to-all) allreduce of nbytes."""
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def _net_cost(m: Dict) -> float:
    """Compute time lost per byte sent between hosts (0 on one host: no network)."""
    return m.get("net_cost_s_per_byte", 0.0) if m["hosts"] > 1 else 0.0


def _process_cpu_s() -> float:
    """User + system CPU of this process, all threads (the kernel's socket work included)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _time_allreduce(group, nbytes: int, reps: int):
    """(seconds of the least disturbed repetition, CPU seconds per byte this rank sent)."""
    from .collectives import allreduce_

    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    best, cpu = _least_disturbed(lambda: allreduce_(buf, group=group, algorithm="ring"), reps)
    sent = reps * _ring_sent(buf.numel() * 4, group.size())
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
    from . import _runtime
    from .algorithms.decentralized import shift_one_peer
    from .neighbor.ops import neighbor_allreduce

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
    from . import _runtime
    from ._tensor import address, dtype_code
    from .collectives import ReduceOp

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


def _link_of(d: Optional[Dict]) -> Optional[Link]:
    return None if d is None else Link(n=d["ranks"], bandwidth_Bps=d["bandwidth_Bps"], latency_s=d["latency_s"],
                                       samples=list(d.get("samples", [])))


def _link_dict(link: Optional[Link]) -> Optional[Dict]:
    return None if link is None else dict(ranks=link.n, bandwidth_Bps=link.bandwidth_Bps, latency_s=link.latency_s,
                                          samples=link.samples)


# The network probes' large size: the job's gradient bytes, up to this much link time. Sustained
# transfers run slower than a few MB do (1 Gbit emulated hosts: a swap of 4 MB with one peer at
# 123 MB/s, of 100 MB at 105 MB/s; a ring allreduce 123 vs 117 MB/s).
_SUSTAINED_S = 0.5
_SUSTAINED_MAX = 128 * _MB
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
_LOCAL_MAX = 64 * _MB


def _measure_links(link_bytes: int, reps: int, busy: Optional[Callable[[], None]] = None, job_bytes: int = 0):
    """Ring allreduce inside each host (all hosts at once) and among one rank per host; every
    rank gets the slowest figures. Among the host leaders also a pairwise swap (one peer, both
    directions: what shift_one's mixing does) and, with ``busy`` (one step of compute), the
    ring allreduce again while every rank computes beside it. Between hosts the large size
    grows toward ``job_bytes`` (see _SUSTAINED_S). Where hosts have several ranks, also the
    hierarchical allreduce's ends inside each host (reduce + broadcast, and broadcast alone),
    the local probes at the job's size where there are several hosts (see _LOCAL_MAX), and
    there the ends' rate beside compute. Creates the groups it needs (collectively, on every
    rank). Returns (hosts, ranks per host, intra, inter, pair, the network's CPU per byte sent,
    its rate beside compute, ends, broadcast, the ends' rate beside compute)."""
    from . import _runtime
    from .collectives import ReduceOp, allreduce
    from ._runtime import new_group

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
        local_big = max(big, min(job_bytes, _LOCAL_MAX) // 4096 * 4096)
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
        bw = _ring_sent(big, len(hosts)) / max(first, 1e-9)

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
    from . import _runtime
    from .collectives import allreduce_

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

    from .collectives import ReduceOp, allreduce, barrier

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
    from . import compression as C

    return {"ByteGrad": C.MinMaxUInt8(), "QSGD": C.QSGD(levels=16), "fp16": C.Float16(), "bf16": C.BFloat16(),
            "1-bit": C.SignScale()}


def _measure_codecs(elements: int, reps: int) -> Dict[str, Dict[str, float]]:
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


def _measure_copy(elements: int, reps: int) -> float:
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


def _measure_steal(busy: Callable[[], None], elements: int, reps: int = 3) -> float:
    """How much of the comm thread's CPU work (codecs, PowerSGD's kernels, weight mixing) comes
    out of compute: a C++ codec loops on a thread while ``busy`` (forward and backward) runs
    ``reps`` times, on every rank at once. Returns compute's stretch over the thread's work
    (both in wall seconds as measured with every rank busy): about 0 where each rank has a
    core to spare, about 1 where the ranks already fill the cores (4 ranks on 2 cores)."""
    import threading

    from . import compression as C

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


def _measure_mix(busy: Callable[[], None], nbytes: int, reps: int = 2) -> Tuple[float, float, float]:
    """(seconds alone, rate beside compute, compute's stretch per second of it: _beside_compute)
    of a weight mix on one host: a copy of nbytes of weights and the ring allreduce of the copy
    over every rank (Decentralized's mix there). Collective."""
    from .collectives import ReduceOp, allreduce, allreduce_

    a = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    b = torch.empty_like(a)

    def mix():
        b.copy_(a)
        allreduce_(b, algorithm="ring")
    alone = _least_disturbed(mix, reps)[0]
    alone = allreduce(torch.tensor([alone], dtype=torch.float64), op=ReduceOp.MAX).item()
    return (alone,) + _beside_compute(mix, True, alone, busy, reps, stretch=True)


def _measure_arena_round(busy: Callable[[], None], elements: int,
                         reps: int = 2) -> Optional[Tuple[float, float, float]]:
    """AsyncModelAverage's round with every rank on one host: one SharedArena.average_into_deltas
    over `elements` float32 weights, every rank at once: (seconds alone, and _beside_compute's
    rate and stretch), or None where the world has no shared arena (the algorithm then
    averages private buffers, priced as the weight mix). Collective.

    Timed, not derived from the weight passes: on 4 ranks of 2 cores (mlp25m, 100 MB) a round
    took 84 ms alone where two thirds of a pass priced 32, and 150-275 ms beside training."""
    from . import _C, _runtime
    from ._tensor import address, dtype_code
    from .algorithms.async_model_average import shared_arena_possible
    from .collectives import ReduceOp, allreduce

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
    chunk = min(nbytes, 4 * _MB) or 1
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


def _measure_loopback(busy: Callable[[], None], nbytes: int, reps: int = 2):
    """TCP over loopback on one host, every rank at once: (a Link fitted through a small and an
    nbytes push, its rate beside compute, compute's stretch per second of it:
    _beside_compute). Collective."""
    from .collectives import ReduceOp, allreduce

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


def _measure_elementwise(elements: int, reps: int) -> float:
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


POWERSGD_RANK = 4


def _powersgd_probe_shape(shapes: List[List[int]], cap: int = 1 << 23) -> Tuple[int, int]:
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


def _measure_powersgd(rank: int, reps: int, shape: Tuple[int, int] = (512, 2048)) -> float:
    """Seconds per matrix element of PowerSGD's three kernels (project with error feedback,
    back-project, reconstruct) at this rank: the C++ kernels the bucket op runs."""
    from . import _C

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


# ==== predicting =======================================================================================

SPLIT_GAP_S = 0.005  # DistributedDataParallel(bucket_split_gap_ms=5.0)
TORCH_FIRST_BUCKET = _MB  # torch DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def bucket_plan(ready: List[float], nbytes: List[int], cap_mb: float = 25, first_mb: float = 1,
                first: Optional[List[float]] = None, gap_s: Optional[float] = SPLIT_GAP_S) -> List[List[int]]:
    """Parameter indices per bucket, as rumor's wrapper lays them out after its first iteration
    (Algorithm.plan_buckets): in the order of ``first`` (that iteration's ready times; default
    ``ready``), a bucket closed before it would exceed its cap (``first_mb`` for the first) and
    where the next gradient came more than ``gap_s`` after the one before it."""
    first = ready if first is None else first
    order = sorted(range(len(ready)), key=lambda i: (first[i], i))
    out: List[List[int]] = []
    cur: List[int] = []
    used = 0
    for j, i in enumerate(order):
        if cur:
            cap = (first_mb if not out else cap_mb) * _MB
            gap = gap_s is not None and first[i] - first[order[j - 1]] > gap_s
            if gap or used + nbytes[i] > cap:
                out.append(cur)
                cur, used = [], 0
        cur.append(i)
        used += nbytes[i]
    if cur:
        out.append(cur)
    return out


def torch_bucket_plan(ready: List[float], nbytes: List[int], cap_mb: float = 25,
                      first: Optional[List[float]] = None) -> List[List[int]]:
    """torch DDP's buckets after its rebuild: first-iteration ready order, a bucket closed once
    it reaches its cap (1 MiB for the first, cap_mb after), never split at gaps."""
    first = ready if first is None else first
    order = sorted(range(len(ready)), key=lambda i: (first[i], i))
    out: List[List[int]] = []
    cur: List[int] = []
    used = 0
    for i in order:
        cur.append(i)
        used += nbytes[i]
        if used >= (TORCH_FIRST_BUCKET if not out else cap_mb * _MB):
            out.append(cur)
            cur, used = [], 0
    if cur:
        out.append(cur)
    return out


def _bucket_times(plan: List[List[int]], ready: List[float], nbytes: List[int]):
    """(ready time, bytes) per bucket: ready when its last gradient is."""
    return [(max(ready[i] for i in b), sum(nbytes[i] for i in b)) for b in plan]


def _buckets(ready: List[float], nbytes: List[int], cap_mb: float = 25, first_mb: float = 1,
             first: Optional[List[float]] = None, gap_s: Optional[float] = SPLIT_GAP_S):
    """(ready time, bytes) per bucket of rumor's wrapper (bucket_plan)."""
    return _bucket_times(bucket_plan(ready, nbytes, cap_mb, first_mb, first, gap_s), ready, nbytes)


def _beside(m: Dict) -> float:
    """The network's rate while compute runs beside it, as a fraction of its rate alone."""
    return min(1.0, max(0.1, m.get("comm_rate_beside_compute", 1.0))) if m["hosts"] > 1 else 1.0


def _local_beside(m: Dict) -> float:
    """The hierarchical legs inside a host beside compute, as a fraction of their rate alone (1
    where they were not measured: one host, one rank per host, older tables)."""
    return min(1.0, max(0.1, m.get("local_rate_beside_compute", 1.0)))


def _rate_of(m: Dict, link_s: float, local_s: float) -> float:
    """The rate beside compute of link_s seconds of communication of which local_s run in the
    legs inside a host and the rest on the network."""
    r, rl = _beside(m), _local_beside(m)
    if link_s <= 0 or local_s <= 0:
        return r
    local_s = min(local_s, link_s)
    return link_s / ((link_s - local_s) / r + local_s / rl)


def _finish(start: float, work: float, busy_until: float, rate: float) -> float:
    """When communication of ``work`` seconds (alone) started at ``start`` ends, where it runs
    at ``rate`` of its speed until compute ends at ``busy_until``, then at full speed."""
    if start >= busy_until:
        return start + work
    beside = (busy_until - start) * rate
    return start + work / rate if work <= beside else busy_until + work - beside


def _steal(m: Dict) -> float:
    """The part of the comm thread's CPU work that compute loses (_measure_steal; none where
    the figure is missing, as in tables measured before it was)."""
    return m.get("comm_work_steal", 0.0)


def _grad_copy_s(m: Dict) -> float:
    """One copy of every gradient (the wrapper moves autograd's fresh gradients into the
    buckets once a step)."""
    return m["grad_bytes"] / m["grad_bytes_per_element"] * m.get("copy_s_per_element", 0.0)


def _overlapped(m: Dict, comm_of: Callable[..., float], key: str = "buckets", cpu_s: float = 0.0,
                copies: int = 1, local_of: Optional[Callable[[float, int], float]] = None) -> Dict:
    """Buckets communicate in order, each from when it is ready and the one before is done;
    comm_of(bytes, bucket index) -> seconds on the links, or (seconds on the links, seconds of
    codec or kernel work on the comm thread). Until backward ends, the links' part runs at the
    measured rate beside compute (the work's part is measured with every rank busy already);
    local_of(bytes, bucket index) -> the seconds of those links' spent in the legs inside a
    host, which beside compute run at their own measured rate.
    Before forward the wrapper broadcasts the module's buffers. cpu_s: what the step's network
    traffic costs the compute it runs beside (backward stretched by the CPU it loses).
    Backward also pays the first of ``copies`` gradient copies (the wrapper's move into the
    buckets) and the measured share of the comm thread's work (_steal); a second copy (torch
    DDP's copy back out of its buckets) comes after the last bucket. Every rank waits for
    each step's slowest (straggler_s): it lengthens compute, and the buckets' ready times are
    already the last rank's, so a step bound by its communication pays no more.
    What compute loses before a bucket is ready also makes that bucket late: the copies of the
    gradients so far, and the CPU of the buckets that communicated beside backward (their
    share of cpu_s by bytes, and the taken share of their work). (2 emulated hosts x 2 ranks,
    mlp25m, a timeline: its 64 MB bucket was ready 150 ms later into backward in training than
    in the advisor's compute steps, about 90 ms of it that minute's slower compute, with a 16
    MB bucket's exchange running beside backward.)"""
    rows = []
    for b, (ready, nbytes) in enumerate(m[key]):
        c = comm_of(nbytes, b)
        rows.append((ready, nbytes, c if isinstance(c, tuple) else (c, 0.0),
                     local_of(nbytes, b) if local_of is not None else 0.0))
    copy_s = _grad_copy_s(m)
    steal = _steal(m)
    total = sum(nbytes for _, nbytes, _, _ in rows) or 1
    net_s = cpu_s
    cpu_s += copy_s + steal * sum(w for _, _, (_, w), _ in rows)
    wait = m.get("straggler_s", 0.0)
    busy = m["backward_s"] + cpu_s
    t = lost = 0.0
    for ready, nbytes, (link_s, work_s), local_s in rows:
        lost += copy_s * nbytes / total
        start = max(t, ready + lost)
        t = _finish(start + work_s, link_s, busy, _rate_of(m, link_s, local_s))
        computing = m["backward_s"] + lost  # until when backward still runs
        if start < computing:
            lost += (net_s * nbytes / total + steal * work_s) * min(1.0, (computing - start) / max(t - start, 1e-12))
    after = (copies - 1) * copy_s
    step = m.get("buffer_broadcast_s", 0.0) + m["forward_s"] + max(busy + wait, t) + after + m["optimizer_s"]
    return dict(predicted_step_s=step, exposed_comm_s=max(cpu_s + wait, t - m["backward_s"]) + after)


def _broadcast_s(nbytes: float, n: int, intra: Optional[Link], inter: Optional[Link], H: int, L: int) -> float:
    """A broadcast of nbytes from rank 0: a tree of hops, over the network between hosts."""
    if nbytes <= 0 or n <= 1:
        return 0.0
    t = 0.0
    if H > 1 and inter is not None:
        t += math.ceil(math.log2(H)) * inter.hop(nbytes)
    if L > 1 and intra is not None:
        t += math.ceil(math.log2(L)) * intra.hop(nbytes)
    return t


def _powersgd_bucket(shapes: List[List[int]], members: List[int], rank: int, min_rate: float = 2.0):
    """(P + uncompressed elements, Q elements, matrix elements compressed) of one bucket, by
    PowerSGD's rule: a tensor viewed as (shape[0], rest) is compressed where
    (n + m) k min_rate < n m, k = min(n, m, rank)."""
    first = second = mat = 0
    for i in members:
        shape = shapes[i]
        numel = math.prod(shape) if shape else 1
        if numel == 0:
            continue
        if len(shape) >= 1:
            n = shape[0]
            mm = numel // n
            k = min(n, mm, rank)
            if (n + mm) * k * min_rate < n * mm:
                first += n * k
                second += mm * k
                mat += numel
                continue
        first += numel
    return first, second, mat


def predict(m: Dict, intra: Optional[Link], inter: Optional[Link], adam: bool) -> List[Dict]:
    """Predicted step of each algorithm from the measured figures (see the module docstring)."""
    H, L, n = m["hosts"], m["local_size"], m["ranks"]
    codecs = m["codecs"]
    param_bytes = m["grad_bytes"]
    elem = m["grad_bytes_per_element"]
    elements = param_bytes / elem
    ew = m.get("elementwise_s_per_element", 0.0)
    bc = m.get("buffer_broadcast_s", 0.0)
    compute = m["forward_s"] + m["backward_s"]
    local_step = bc + compute + m["optimizer_s"]  # a step whose backward communicates nothing
    # ... and one that synchronizes nothing either: the ranks' mean step (periodic, asynchronous)
    free_step = bc + m.get("free_step_s", compute + m["optimizer_s"])
    # What sending a byte over the network (and receiving one: the ring does both) costs the
    # compute beside it: the sockets' CPU, measured during the link probe, scaled up where the
    # rank gets less than a core (ranks sharing cores). Traffic inside a host is comm time.
    net = _net_cost(m)

    ends_link, bcast_link = _link_of(m.get("intra_ends")), _link_of(m.get("intra_broadcast"))

    def local(nbytes):  # an allreduce inside a host: the shared-memory ring
        return intra.ring(nbytes) if intra is not None and L > 1 else 0.0

    def ends(nbytes):  # the hierarchical allreduce's legs inside a host: reduce to the leader, broadcast back
        if L <= 1:
            return 0.0
        # (tables measured before the ends were: the ring, as they were predicted then)
        return ends_link.hop(nbytes) if ends_link is not None else local(nbytes)

    def bcast(nbytes):  # the leader's broadcast to its host, hierarchical mixing's last leg
        return bcast_link.hop(nbytes) if bcast_link is not None and L > 1 else 0.0

    def across(nbytes):
        return inter.ring(nbytes) if inter is not None and H > 1 else 0.0

    def allreduce_fp(nbytes, *_):
        if H > 1:
            return ends(nbytes) + across(nbytes)  # hierarchical (the communicator's own pick)
        return local(nbytes)

    def codec_time(name, elements):
        c = codecs[name]
        k = H if H > 1 else n
        # encode all, owner decodes (k-1)/k and re-encodes its 1/k, every rank decodes all
        return elements * (c["encode_s_per_element"] * (1 + 1 / k) + c["decode_s_per_element"] * (2 - 1 / k))

    def compressed(name):
        w = codecs[name]["wire_bytes_per_element"]

        def comm(nbytes, *_):
            if H == 1:  # one host: hierarchical compressed algorithms use the shared-memory allreduce
                return local(nbytes)
            el = nbytes / elem
            return ends(nbytes) + across(el * w), codec_time(name, el)
        return comm

    rows = []

    def add(name, cls, kwargs, caveat, kind, res, wire, period=1, shown=None):
        args = ", ".join(f"{k}={_py(v)}" for k, v in kwargs.items())
        rows.append(dict(algorithm=name, kwargs=shown or f"algorithm={cls}({args})", ctor=dict(cls=cls, kwargs=kwargs),
                         caveat=caveat, kind=kind, period=period, wire_bytes_per_element=wire, **res))

    def legs(nbytes, *_):  # the part of allreduce_fp spent inside the host (its own rate beside compute)
        return ends(nbytes) if H > 1 else 0.0

    fp_cpu = net * _ring_sent(param_bytes, H)
    add("GradientAllReduce", "GradientAllReduce", {}, EXACT, "exact",
        _overlapped(m, allreduce_fp, cpu_s=fp_cpu, local_of=legs), elem)
    if H > 1 and L > 1:
        add("GradientAllReduce hierarchical", "GradientAllReduce", {"hierarchical": True}, EXACT, "exact",
            _overlapped(m, allreduce_fp, cpu_s=fp_cpu, local_of=legs), elem)
    for name, cls, kw, cav in (("ByteGrad", "ByteGrad", {}, COMPRESSED), ("QSGD", "QSGD", {"levels": 16}, COMPRESSED),
                               ("fp16", "LowPrecision", {"dtype": "float16"}, HALF),
                               ("bf16", "LowPrecision", {"dtype": "bfloat16"}, HALF)):
        w = codecs[name]["wire_bytes_per_element"]
        add(name, cls, kw, cav, "compressed",
            _overlapped(m, compressed(name), cpu_s=net * _ring_sent(elements * w, H), local_of=legs),
            w if H > 1 else elem)
    if adam:
        w = codecs["1-bit"]["wire_bytes_per_element"]

        def onebit(nbytes, *_):
            el = nbytes / elem
            link = inter if H > 1 else intra
            t = link.ring(el * w, n) if link is not None else 0.0
            return t, codec_time("1-bit", el)
        add("1-bit Adam", "OneBitAdam", {}, COMPRESSED_EF, "compressed",
            _overlapped(m, onebit, cpu_s=net * _ring_sent(elements * w, n)), w,
            shown="optimizer=rumor.optim.OneBitAdam(...), algorithm=OneBitAdam(optimizer)")

    # PowerSGD: per bucket, P (with the tensors it leaves uncompressed, copied into the send
    # buffer: one pass) and Q are two allreduces, with the three kernels over every compressed
    # matrix. The kernels fold error feedback in (project adds the gradient into the error
    # buffer, reconstruct subtracts the approximation from it), and the probe runs them so: no
    # passes of its own (counting two more predicted mlp25m's step 15-21% long at 1 Gbit).
    shapes = m.get("shapes")
    if shapes is not None and "powersgd_s_per_element" in m:
        r = m.get("powersgd_rank", POWERSGD_RANK)
        plan = m["bucket_params"]

        def powersgd(nbytes, b):
            first, second, mat = _powersgd_bucket(shapes, plan[b], r)
            t = allreduce_fp(first * 4) + (allreduce_fp(second * 4) if second else 0.0)
            return t, mat * m["powersgd_s_per_element"] + first * ew
        def powersgd_legs(nbytes, b):
            first, second, _ = _powersgd_bucket(shapes, plan[b], r)
            return legs(first * 4) + (legs(second * 4) if second else 0.0)
        sent = sum(f + q for f, q, _ in (_powersgd_bucket(shapes, b, r) for b in plan))
        add(f"PowerSGD rank {r}", "PowerSGD", {"matrix_approximation_rank": r}, POWERSGD, "compressed",
            _overlapped(m, powersgd, cpu_s=net * _ring_sent(4 * sent, H), local_of=powersgd_legs),
            4 * sent / elements)

    rate = _beside(m)

    def decentralized(mix_s, cpu_s, local_s=0.0, rate=None):  # rate: the mix's own, where measured
        mix_s = _finish(0.0, mix_s, compute + cpu_s, _rate_of(m, mix_s, local_s) if rate is None else rate)
        step = bc + max(compute + cpu_s, mix_s) + m["optimizer_s"]
        return dict(predicted_step_s=step, exposed_comm_s=max(cpu_s, mix_s - compute))

    # Weight mixing (hierarchical=True, the default), bucket by bucket on the comm thread from
    # the start of forward. "all" copies each weight bucket and averages it with the
    # hierarchical allreduce (a timeline of mlp25m on 2 hosts x 2 ranks); the others average
    # inside each host (its ring), exchange among the host leaders and broadcast inside the host.
    wcopy = elements * m.get("copy_s_per_element", 0.0)
    host_legs = local(param_bytes) + bcast(param_bytes)  # the host's ring before the leaders' part, the broadcast after
    pair = _link_of(m.get("pair")) or inter
    if H == 1 and "mix_s_per_byte" in m:
        # One host: every peer selection is the host's exact average (copy + allreduce; the
        # one-peer schedules broadcast it after). Beside forward and backward it runs at its
        # own measured rate (4 ranks on 2 cores: a seventh to a third of its speed alone), and
        # compute loses its measured stretch per second of the mix's work done meanwhile.
        mix_rate = min(1.0, max(0.1, m.get("mix_rate_beside_compute", 1.0)))
        mix = m["mix_s_per_byte"] * param_bytes
        for name, ps, mix_s in (("Decentralized all", "all", mix),
                                ("Decentralized shift_one", "shift_one", mix + bcast(param_bytes))):
            cpu = m.get("mix_stretch", 0.0) * min(mix_s, compute * mix_rate)
            add(name, "Decentralized", {"peer_selection": ps}, DECENTRALIZED, "decentralized",
                decentralized(mix_s, cpu, rate=mix_rate), elem)
    else:
        add("Decentralized all", "Decentralized", {"peer_selection": "all"}, DECENTRALIZED, "decentralized",
            decentralized(wcopy + allreduce_fp(param_bytes), fp_cpu, wcopy + legs(param_bytes)), elem)
        # The exchange with one peer, both ways at once (measured as such: each host's link then
        # carries its data out beside the acknowledgements of what it receives).
        peer = (pair.hop(param_bytes) if H > 1 and pair is not None else 0.0)
        add("Decentralized shift_one", "Decentralized", {"peer_selection": "shift_one"}, DECENTRALIZED,
            "decentralized", decentralized(host_legs + peer, net * param_bytes, host_legs if H > 1 else 0.0), elem)

    # LowPrecisionDecentralized: after optimizer.step() (blocking) the weights mix toward the
    # neighbours' replicas and the difference is encoded and decoded once; the encoded
    # difference then goes to both ring neighbours (two messages through this host's link) on
    # the comm thread, and both are decoded. The exchange is waited for after the next
    # backward, but the wrapper's buffer broadcast before the next forward queues behind it on
    # the same communicator: with buffers to broadcast it does not overlap compute at all.
    c8 = codecs["ByteGrad"]
    w8 = c8["wire_bytes_per_element"]
    peers = 2 if H > 2 else 1
    prep = host_legs
    xchg = 0.0
    if H > 1 and inter is not None:
        # the mix toward the replicas is one fused pass over six arrays (twice c = a + b's
        # traffic), then the encode and the decode into the tracked copy. Only the host leaders
        # do it, the other ranks waiting for the broadcast: the leaders then get the cores the
        # per-element figures (measured with every rank busy) shared with them.
        lead_speed = max(1.0, min(float(L), 1.0 / max(m.get("compute_cpu_share", 1.0), 0.05)))
        prep += elements * (2 * ew + c8["encode_s_per_element"] + c8["decode_s_per_element"]) / lead_speed
        xchg = peers * elements * w8 / pair.bandwidth_Bps + pair.latency_s + peers * elements * c8["decode_s_per_element"]
    if m.get("buffer_bytes", 0) > 0:
        lp = dict(predicted_step_s=xchg + local_step + prep, exposed_comm_s=xchg + prep)
    else:
        xcpu = net * peers * elements * w8
        xchg = _finish(0.0, xchg, compute + xcpu, rate)
        lp = dict(predicted_step_s=bc + max(compute + xcpu, xchg) + m["optimizer_s"] + prep,
                  exposed_comm_s=max(xcpu, xchg - compute) + prep)
    add("LowPrecisionDecentralized", "LowPrecisionDecentralized", {}, DECENTRALIZED_LP, "decentralized", lp,
        w8 if H > 1 else elem)

    # Periodic averaging: backward communicates nothing; every H-th step pays the average.
    def periodic(every, sync_s):
        return dict(predicted_step_s=free_step + sync_s / every, exposed_comm_s=sync_s / every)

    add(f"LocalSGD every {LOCAL_SGD_EVERY}", "LocalSGD", {"sync_every": LOCAL_SGD_EVERY}, LOCAL_SGD, "periodic",
        periodic(LOCAL_SGD_EVERY, allreduce_fp(param_bytes)), elem / LOCAL_SGD_EVERY, period=LOCAL_SGD_EVERY)
    # DiLoCo: once a round, the pseudo-gradient, its average, the outer Nesterov step and the
    # copy back (about six weight passes besides the average).
    add(f"DiLoCo H={DILOCO_H}", "DiLoCo", {"inner_steps": DILOCO_H}, DILOCO, "periodic",
        periodic(DILOCO_H, allreduce_fp(param_bytes) + 6 * elements * ew), elem / DILOCO_H, period=DILOCO_H)
    # Streaming DiLoCo (its defaults: int8 fragments, each averaged in the background over tau
    # inner steps on a communicator of its own): a fragment's average is exposed only where it
    # outlasts tau steps; its codec work and weight passes run on this rank's cores.
    F = STREAMING_FRAGMENTS
    tau = min(DILOCO_H - 1, max(1, DILOCO_H // (2 * F)))
    frag = elements / F
    link = inter if H > 1 else intra
    frag_comm = link.ring(frag * w8, n) / rate if link is not None else 0.0  # beside the inner steps
    frag_cpu = codec_time("ByteGrad", frag) + 8 * frag * ew + net * _ring_sent(frag * w8, n)
    frag_exposed = max(0.0, frag_comm - tau * free_step)
    add(f"StreamingDiLoCo H={DILOCO_H}", "StreamingDiLoCo", {"inner_steps": DILOCO_H, "num_fragments": F},
        STREAMING, "periodic", periodic(DILOCO_H, F * (frag_exposed + frag_cpu)), w8 / DILOCO_H, period=DILOCO_H)
    # AsyncModelAverage: a background thread averages all weights every sync_interval (or back
    # to back when a round takes longer); the step never waits for it. What it costs the step
    # is the compute its rounds take from the cores training uses: the thread's weight passes
    # and the network's CPU, and the training thread's one pass adding the result. Across
    # hosts the thread copies the weights twice (snapshot and send buffer; a copy moves two
    # thirds of a pass's bytes), reduces (k-1)/k of them and forms the delta: its passes run
    # in turn with the allreduce, so they lengthen the round. Measured on 4 emulated hosts at
    # 1 Gbit, mlp25m, steady state: 182 ms of CPU off the training thread a round (the model:
    # 3.1 passes of 61 ms at half a core plus 130 ms of socket CPU), rounds of 1.77 s (1.66 s).
    # With every rank on one host the weights sit in a shared arena: the thread reads every
    # rank's block it owns and writes their deltas (about two thirds of a pass), and rounds
    # are spaced so that it is busy at most max_busy_fraction (0.1 by default) of the time.
    census = link.ring(32) if link is not None else 0.0  # the round's agreement: one tiny allreduce
    if H > 1:
        k = H
        thread_s = (2 * 2 / 3 + (k - 1) / k + 1) * elements * ew
        round_s = max(AMA_INTERVAL_MS / 1e3, allreduce_fp(param_bytes) / rate + census + thread_s)
        thread_cost = thread_s
    else:
        # The bound is on the thread's wall time, and beside compute its rounds run slower than
        # alone (mlp25m, 4 ranks on 2 cores: rounds of 194 ms, 3.9 s apart, where passes at full
        # speed priced 50 ms every 0.5 s). Where the arena round was timed (alone and beside
        # compute), its time and what it takes from compute; else two thirds of a pass at the
        # weight mix's rate.
        if "arena_round_s_per_element" in m:
            thread_s = m["arena_round_s_per_element"] * elements
            beside, thread_cost = m.get("arena_rate_beside_compute", 1.0), m.get("arena_stretch", 0.0) * thread_s
        else:
            thread_s = 2 / 3 * elements * ew
            beside, thread_cost = m.get("mix_rate_beside_compute", 1.0), thread_s
        wall = thread_s / min(1.0, max(0.1, beside))
        round_s = max(AMA_INTERVAL_MS / 1e3, census + wall / AMA_MAX_BUSY)
    round_cpu = thread_cost + elements * ew + net * _ring_sent(param_bytes, H)
    per_step = free_step / round_s if round_s > 0 else 0.0
    add("AsyncModelAverage", "AsyncModelAverage", {"sync_interval_ms": AMA_INTERVAL_MS}, ASYNC, "async",
        dict(predicted_step_s=free_step + per_step * round_cpu, exposed_comm_s=per_step * round_cpu,
             round_s=round_s), elem * per_step)
    # Algorithms that synchronize the ranks every step wait for each step's slowest rank (the
    # bucketed ones in _overlapped); the periodic ones once a round (the drift of a round is
    # left out), the asynchronous never.
    wait = m.get("straggler_s", 0.0)
    for r in rows:
        if r["kind"] == "decentralized":
            r["predicted_step_s"] += wait
            r["exposed_comm_s"] += wait
    return rows


# The kinds whose rows synchronize the ranks every step, and those that synchronize no step
# (their local step is the ranks' mean compute step, free_step_s).
PER_STEP_SYNC = ("exact", "compressed", "decentralized")
UNSYNCHRONIZED_STEPS = ("periodic", "async")


def predict_torch(m: Dict, intra: Optional[Link], inter: Optional[Link]) -> Dict:
    """torch DDP: a flat fp32 ring over all ranks (gloo) over torch's own buckets, overlapped the
    same way."""
    n, H = m["ranks"], m["hosts"]
    link = inter if H > 1 else intra
    lo = _link_of(m.get("loopback")) if H == 1 else None
    if lo is not None:
        # One host: gloo's ring runs over loopback TCP, whose kernel copies take the cores
        # compute shares (measured beside it: loopback_stretch), and its threads sum what
        # they receive ((n-1)/n of the bucket).
        ew = m.get("elementwise_s_per_element", 0.0)

        def comm(nbytes, *_):
            return (_ring_sent(nbytes, n) / lo.bandwidth_Bps + 2 * (n - 1) * lo.latency_s,
                    (n - 1) / n * nbytes / m["grad_bytes_per_element"] * ew)
        # Beside compute the traffic runs at its own measured rate (the legs' rate in _overlapped:
        # all of it stays inside the host), and compute loses the stretch per second of it
        # done meanwhile (at most all of it).
        r = min(1.0, max(0.1, m.get("loopback_rate_beside_compute", 1.0)))
        total = _ring_sent(m["grad_bytes"], n) / lo.bandwidth_Bps
        cpu = m.get("loopback_stretch", 0.0) * min(total, m["backward_s"] * r)
        res = _overlapped(dict(m, local_rate_beside_compute=r), comm,
                          "torch_buckets" if "torch_buckets" in m else "buckets", cpu_s=cpu, copies=2,
                          local_of=lambda nbytes, b: comm(nbytes)[0])
        return dict(algorithm="torch DDP", predicted_step_s=res["predicted_step_s"],
                    exposed_comm_s=res["exposed_comm_s"])

    def comm(nbytes, *_):
        return link.ring(nbytes, n) if link is not None else 0.0
    cpu = _net_cost(m) * _ring_sent(m["grad_bytes"], n)
    # gradient_as_bucket_view=False, its default: each gradient is copied into its bucket
    # during backward and back out after the allreduce.
    res = _overlapped(m, comm, "torch_buckets" if "torch_buckets" in m else "buckets", cpu_s=cpu, copies=2)
    return dict(algorithm="torch DDP", predicted_step_s=res["predicted_step_s"], exposed_comm_s=res["exposed_comm_s"])


def _py(v) -> str:
    """A constructor argument as Python source (dtypes are stored by name)."""
    if isinstance(v, str) and v in _DTYPES:
        return f"torch.{v}"
    return repr(v)


_DTYPES = ("float16", "bfloat16", "float32")


def build_algorithm(row: Dict, optimizer: Optional[torch.optim.Optimizer] = None):
    """The rumor algorithm of an advice row (``row["ctor"]``), constructed: what the row's
    ``kwargs`` text says. 1-bit Adam needs its optimizer (a rumor.optim.OneBitAdam)."""
    from . import algorithms as A

    ctor = row.get("ctor") if isinstance(row, dict) else None
    if not ctor or not hasattr(A, ctor.get("cls", "")):
        raise ValueError(f"rumor.advisor.build_algorithm: not an advice row with a constructor: {row!r}")
    kwargs = {k: getattr(torch, v) if k in ("dtype", "wire_dtype") and isinstance(v, str) else v
              for k, v in ctor["kwargs"].items()}
    cls = getattr(A, ctor["cls"])
    if ctor["cls"] == "OneBitAdam":
        if optimizer is None:
            raise ValueError("rumor.advisor.build_algorithm: 1-bit Adam needs its optimizer "
                             "(rumor.optim.OneBitAdam)")
        return cls(optimizer, **kwargs)
    return cls(**kwargs)


# ==== the API ==========================================================================================

def advise(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sample_batch,
           loss_fn: Optional[Callable] = None, *, steps: int = 5, warmup: int = 2, link_mb: float = 4,
           link_reps: int = 5, print_table: bool = True, file=None) -> Advice:
    """Measures this job and ranks rumor's algorithms by predicted step time. Collective: every
    rank calls it with its own sample batch, after rumor.init().

    model, optimizer: the plain (unwrapped) model and its optimizer; they are restored afterwards.
    sample_batch: what one training step consumes; with the default loss_fn an (inputs, targets)
      pair (inputs a tensor or a tuple of model arguments) scored by cross-entropy.
    loss_fn(model, batch) -> scalar loss: anything else (a step's forward and loss).
    steps, warmup: measured and unmeasured compute steps; link_mb: the larger allreduce size of
      the link fit; link_reps: allreduces per size.
    Rank 0 prints the table (print_table) to ``file`` (default stdout); every rank gets the same
    Advice back.
    """
    from . import _runtime
    from .collectives import ReduceOp, allreduce, barrier, broadcast_

    what = "rumor.advise"
    if not _runtime.is_initialized():
        raise RuntimeError(f"{what}: call rumor.init() first")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{what}: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{what}: loss_fn must be callable (model, batch) -> loss")
    for name, v, lo in (("steps", steps, 1), ("warmup", warmup, 0), ("link_reps", link_reps, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{what}: {name} must be an int >= {lo}, got {v!r}")
    if not (isinstance(link_mb, (int, float)) and 0.25 <= link_mb <= 1024):
        raise ValueError(f"{what}: link_mb must be a number in [0.25, 1024], got {link_mb!r}")
    if loss_fn is None:
        if not (isinstance(sample_batch, (tuple, list)) and len(sample_batch) == 2):
            raise ValueError(f"{what}: without loss_fn, sample_batch must be an (inputs, targets) pair")
        loss_fn = _default_loss
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{what}: the model has no trainable parameters")

    st = _runtime.state()
    model_sd = copy.deepcopy(model.state_dict())
    opt_sd = copy.deepcopy(optimizer.state_dict())
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    was_training = model.training
    model.train()
    def busy():  # compute beside the link probe: forward and backward, gradients discarded after
        loss_fn(model, sample_batch).backward()

    try:
        params, fwd, bwd, opt_s, ready, first, share, since_start, totals = _measure_compute(
            model, optimizer, sample_batch, loss_fn, steps, warmup, sync=barrier if st.env.size > 1 else None)
        # The slowest rank's compute; rank 0's ready order (the wrapper's buckets follow it).
        comp = allreduce(torch.tensor([fwd, bwd, opt_s, -share, statistics.median(totals)] + totals,
                                      dtype=torch.float64), op=ReduceOp.MAX)
        fwd, bwd, opt_s, share, slowest = comp[:5].tolist()
        share = -share  # the smallest: the rank whose compute is slowed most by stolen CPU
        # A step that synchronizes the ranks waits for the slowest one of that step: the mean of
        # each step's slowest rank over the slowest rank's median step (4 ranks on 2 cores:
        # cnn's steps 50-100 ms apart between ranks).
        straggler = max(0.0, statistics.fmean(comp[5:].tolist()) - slowest)
        # Without a per-step synchronization (periodic and asynchronous algorithms) no rank
        # waits for the slowest of each step: the ranks share the cores over many steps and each
        # runs at about their mean step. (mlp25m, 4 ranks on 2 cores: local steps of 300-330
        # ms measured against 380 ms for the slowest rank's phases taken in lockstep.)
        free = allreduce(torch.tensor([statistics.fmean(totals)], dtype=torch.float64),
                         op=ReduceOp.SUM).item() / st.env.size
        rt = torch.tensor([ready, first], dtype=torch.float64)
        broadcast_(rt, 0)
        ready, first = rt.tolist()
        # A bucket's allreduce ends only once its last rank has the bucket: in a step that starts
        # the ranks together, a gradient is ready everywhere at the latest of its ranks' ready
        # times (from the step's start), median over the steps, counted from the slowest rank's
        # forward. (mlp25m, 4 ranks on 2 cores: its 64 MB bucket ready everywhere 435 ms into
        # backward, on rank 0 at 339 ms; in training on 2 hosts x 2 ranks the bucket's exchange
        # started about 100 ms after rank 0 had it ready.)
        synced = allreduce(torch.tensor(since_start, dtype=torch.float64), op=ReduceOp.MAX).t().tolist()
        ready_all = [max(0.0, statistics.median(col) - fwd) for col in synced]
        nbytes = [p.numel() * p.element_size() for p in params]
        hosts, local_n, intra, inter, pair, net_cpu, beside, ends, bcast, local_beside = _measure_links(
            int(link_mb * _MB), link_reps, busy, sum(nbytes))
        steal = _measure_steal(busy, sum(p.numel() for p in params))
        one_host = {}
        if hosts == 1 and local_n > 1:
            # Every rank on one host, sharing its cores: the weight mix's copies and torch DDP's
            # loopback TCP (gloo) are CPU work that compute loses (4 ranks on 2 cores, mlp25m:
            # Decentralized's step 300 ms over compute where the mix was priced hidden, torch
            # DDP's 400 ms over where rumor's shared-memory ring priced 200).
            size = max(4096, min(sum(nbytes), _LOCAL_MAX) // 4096 * 4096)
            mix_s, mix_rate, mix_stretch = _measure_mix(busy, size)
            lo, lo_rate, lo_stretch = _measure_loopback(busy, size)
            one_host = dict(mix_s_per_byte=mix_s / size, mix_rate_beside_compute=mix_rate, mix_stretch=mix_stretch,
                            loopback=_link_dict(lo), loopback_rate_beside_compute=lo_rate,
                            loopback_stretch=lo_stretch)
            arena_elements = max(1024, min(sum(p.numel() for p in params), _LOCAL_MAX // 4))
            arena = _measure_arena_round(busy, arena_elements)
            if arena is not None:
                one_host.update(arena_round_s_per_element=arena[0] / arena_elements,
                                arena_rate_beside_compute=arena[1], arena_stretch=arena[2])
    finally:
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(opt_sd)
        for p, g in zip(params, grads):
            p.grad = g
        model.train(was_training)
    elements = sum(p.numel() for p in params)
    # Weight passes and codecs stream the job's tensors from memory: probe them at its size (up
    # to 8 M elements); a cache-resident probe ran 2.7x faster per element than 32 MB did.
    probe = min(elements, 1 << 23) or 1
    codecs = _measure_codecs(probe, 3)
    per_element = [[c["encode_s_per_element"], c["decode_s_per_element"]] for c in codecs.values()]
    psgd_shape = _powersgd_probe_shape([list(p.shape) for p in params])
    per_element.append([_measure_elementwise(probe, 3), _measure_powersgd(POWERSGD_RANK, 2, psgd_shape)])
    per_element.append([_measure_copy(probe, 3), steal])
    cflat = allreduce(torch.tensor(per_element, dtype=torch.float64), op=ReduceOp.MAX).tolist()
    for (name, c), row in zip(codecs.items(), cflat):
        c["encode_s_per_element"], c["decode_s_per_element"] = row
    ew, psgd = cflat[-2]
    copy_s, steal = cflat[-1]
    buffers = [b for b in model.buffers()]
    buffer_bytes = sum(b.numel() * b.element_size() for b in buffers)

    m = dict(ranks=st.env.size, hosts=hosts, local_size=local_n, forward_s=fwd, backward_s=bwd,
             optimizer_s=opt_s, grad_elements=elements, grad_bytes=sum(nbytes),
             grad_bytes_per_element=sum(nbytes) / elements, params=len(params),
             dtypes=sorted({str(p.dtype).replace("torch.", "") for p in params}),
             last_ready_s=max(ready_all), codecs=codecs, elementwise_s_per_element=ew, copy_s_per_element=copy_s,
             comm_work_steal=steal, straggler_s=straggler, free_step_s=free,
             compute_cpu_share=share, net_cpu_s_per_byte=net_cpu,
             net_cost_s_per_byte=net_cpu / min(1.0, max(share, 0.05)),
             powersgd_rank=POWERSGD_RANK, powersgd_s_per_element=psgd,
             shapes=[list(p.shape) for p in params], buffer_bytes=buffer_bytes,
             buffer_broadcast_s=_broadcast_s(buffer_bytes, st.env.size, intra, inter, hosts, local_n),
             intra=_link_dict(intra), inter=_link_dict(inter), pair=_link_dict(pair),
             intra_ends=_link_dict(ends), intra_broadcast=_link_dict(bcast),
             comm_rate_beside_compute=beside, local_rate_beside_compute=local_beside)
    m.update(one_host)
    plan = bucket_plan(ready, nbytes, first=first)
    m["bucket_params"] = plan
    m["buckets"] = _bucket_times(plan, ready_all, nbytes)
    m["torch_buckets"] = _bucket_times(torch_bucket_plan(ready, nbytes, first=first), ready_all, nbytes)
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or "adam" in type(optimizer).__name__.lower()
    rows = predict(m, intra, inter, adam)
    tref = predict_torch(m, intra, inter)
    for r in rows:
        r["speedup_over_torch"] = tref["predicted_step_s"] / r["predicted_step_s"]
    rows = rank_rows(rows)
    table = format_table(m, rows, tref)
    if print_table and st.env.rank == 0:
        print(table, file=file or sys.stdout, flush=True)
    return Advice(rows=rows, torch=tref, measured=m, table=table)


# How much faster (relative) a less exact algorithm must be predicted to rank above an exact
# one: a compute-bound job gains nothing from giving up exactness, and the step times of the
# periodic and asynchronous algorithms are averages over rounds.
MARGIN = {"exact": 0.0, "compressed": 0.01, "decentralized": 0.02, "periodic": 0.05, "async": 0.05}


def rank_rows(rows: List[Dict]) -> List[Dict]:
    """Fastest first, by predicted step plus the kind's MARGIN; then more exact first."""
    return sorted(rows, key=lambda r: (r["predicted_step_s"] * (1 + MARGIN[r["kind"]]), list(MARGIN).index(r["kind"]),
                                       r["algorithm"]))


def _rate(bps: float) -> str:
    return f"{bps / 1e9:.2f} GB/s" if bps >= 1e9 else f"{bps / 1e6:.1f} MB/s"


def format_table(m: Dict, rows: List[Dict], tref: Dict) -> str:
    lines = [f"rumor advisor: {m['ranks']} ranks on {m['hosts']} host(s), up to {m['local_size']} per host",
             "measured (slowest rank):",
             f"  compute: forward {m['forward_s'] * 1e3:.1f} ms, backward {m['backward_s'] * 1e3:.1f} ms, "
             f"optimizer {m['optimizer_s'] * 1e3:.1f} ms; last gradient ready on every rank {m['last_ready_s'] * 1e3:.1f} ms "
             f"into backward; each step's slowest rank {m.get('straggler_s', 0.0) * 1e3:.1f} ms over that, "
             f"{m.get('comm_work_steal', 0.0):.2f} of a comm thread's CPU work taken from compute"
             + (f"; the ranks' mean step {m['free_step_s'] * 1e3:.1f} ms (what steps that synchronize nothing take)"
                if "free_step_s" in m else ""),
             f"  gradients: {m['grad_elements'] / 1e6:.2f} M elements, {m['grad_bytes'] / 1e6:.1f} MB "
             f"({', '.join(m['dtypes'])}) in {m['params']} tensors; {len(m['buckets'])} buckets (25 MB, split where "
             f"gradients come > {SPLIT_GAP_S * 1e3:.0f} ms apart), torch DDP {len(m.get('torch_buckets', ()))}",
             f"  buffers broadcast before each forward: {m.get('buffer_bytes', 0) / 1e3:.1f} kB"]
    for key, what in (("intra", "inside a host (ring allreduce over shared memory)"),
                      ("inter", "between hosts (ring allreduce among one rank per host)")):
        link = m[key]
        if link is None:
            lines.append(f"  {what}: not measured (" + ("one rank per host)" if key == "intra" else "one host)"))
        else:
            size = f", fitted up to {link['samples'][-1][0] / 1e6:.1f} MB" if link.get("samples") else ""
            lines.append(f"  {what}: {_rate(link['bandwidth_Bps'])}, {link['latency_s'] * 1e6:.0f} us per hop "
                         f"({link['ranks']} ranks{size})")
            if key == "intra" and m.get("intra_ends") is not None:
                e, b = m["intra_ends"], m.get("intra_broadcast") or {}
                lines.append(f"  the hierarchical allreduce's legs inside a host (reduce to the leader + its broadcast): "
                             f"{_rate(e['bandwidth_Bps'])}, {e['latency_s'] * 1e6:.0f} us; the broadcast alone "
                             f"{_rate(b.get('bandwidth_Bps', 0.0))}")
            if key == "inter" and m.get("pair") is not None:
                p = m["pair"]
                lines.append(f"  a swap with one peer between hosts (both ways at once): {_rate(p['bandwidth_Bps'])}, "
                             f"{p['latency_s'] * 1e6:.0f} us; the network beside compute runs at "
                             f"{m.get('comm_rate_beside_compute', 1.0):.2f} of its rate alone")
            if key == "inter" and "net_cpu_s_per_byte" in m:
                lines.append(f"  network CPU: {m['net_cpu_s_per_byte'] * 1e9:.2f} ms per MB sent; compute uses "
                             f"{m['compute_cpu_share']:.2f} CPU per second, so each MB sent beside it costs "
                             f"{m['net_cost_s_per_byte'] * 1e9:.2f} ms of compute")
    if m.get("loopback") is not None:
        lo = m["loopback"]
        lines.append(f"  one host, beside compute: a weight mix (copy + ring allreduce) "
                     f"{m['mix_s_per_byte'] * 1e9:.2f} ms per MB alone, at {m['mix_rate_beside_compute']:.2f} of that "
                     f"beside compute, lengthening compute {m['mix_stretch']:.2f} s per s of it; TCP over loopback "
                     f"(torch DDP's gloo) {_rate(lo['bandwidth_Bps'])}, {lo['latency_s'] * 1e6:.0f} us, at "
                     f"{m['loopback_rate_beside_compute']:.2f} beside compute, lengthening compute "
                     f"{m['loopback_stretch']:.2f} s per s")
    if "arena_round_s_per_element" in m:
        lines.append(f"  one host: AsyncModelAverage's round in the shared arena "
                     f"{m['arena_round_s_per_element'] / 4 * 1e9:.2f} ms per MB of weights alone, at "
                     f"{m['arena_rate_beside_compute']:.2f} of that beside compute, lengthening compute "
                     f"{m['arena_stretch']:.2f} s per s of it")
    lines.append("  codecs (ns per element, encode/decode; wire bytes per element): " + ", ".join(
        f"{k} {c['encode_s_per_element'] * 1e9:.2f}/{c['decode_s_per_element'] * 1e9:.2f}; "
        f"{c['wire_bytes_per_element']:.3f}" for k, c in m["codecs"].items()))
    if "elementwise_s_per_element" in m:
        lines.append(f"  weight arithmetic {m['elementwise_s_per_element'] * 1e9:.2f} ns per element and pass; "
                     f"PowerSGD kernels (rank {m['powersgd_rank']}) {m['powersgd_s_per_element'] * 1e9:.2f} ns "
                     "per matrix element")
    lines.append(f"predicted step of torch DDP (flat fp32 ring, gloo): {tref['predicted_step_s'] * 1e3:.1f} ms")
    head = f"{'#':>2} {'algorithm':<30} {'step ms':>9} {'x torch':>8} {'exposed ms':>10}  convergence"
    lines += [head, "-" * (len(head) + 40)]
    for i, r in enumerate(rows):
        lines.append(f"{i + 1:>2} {r['algorithm']:<30} {r['predicted_step_s'] * 1e3:>9.1f} "
                     f"{r['speedup_over_torch']:>7.2f}x {r['exposed_comm_s'] * 1e3:>10.1f}  {r['caveat']}")
    best = rows[0]
    lines.append(f"suggestion: rumor.DistributedDataParallel(model, optimizer, {best['kwargs']})")
    return "\n".join(lines)


# ==== python -m rumor.advise ===========================================================================

SCRIPT_HOOK = "rumor_advise"


def _load_script(path: str, argv: Sequence[str]) -> Dict:
    import runpy

    if not os.path.isfile(path):
        raise SystemExit(f"rumor.advise: no such script: {path}")
    old_argv = sys.argv
    sys.argv = [path, *argv]
    try:
        # Not "__main__": the script's own training entry point must not run.
        ns = runpy.run_path(path, run_name="__rumor_advise__")
    finally:
        sys.argv = old_argv
    hook = ns.get(SCRIPT_HOOK)
    if not callable(hook):
        raise SystemExit(f"rumor.advise: {path} defines no function {SCRIPT_HOOK}() returning "
                         "dict(model=..., optimizer=..., batch=..., loss_fn=None)")
    got = hook()
    if not isinstance(got, dict) or not {"model", "optimizer", "batch"} <= set(got):
        raise SystemExit(f"rumor.advise: {SCRIPT_HOOK}() must return a dict with model, optimizer and batch "
                         f"(and optionally loss_fn), got {type(got).__name__}")
    return got


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m rumor.advise",
                                 description="measure a training step and rank rumor's algorithms (docs/advisor.md)")
    ap.add_argument("--nproc-per-node", type=int, default=None,
                    help="start this many ranks on this machine (through rumor-run); without it, run under an "
                         "existing launcher (rumor-run/torchrun ... -m rumor.advise script.py)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--link-mb", type=float, default=4)
    ap.add_argument("--json", default=None, help="also write the measurements and the table as JSON (rank 0)")
    ap.add_argument("script")
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.nproc_per_node is not None and "RANK" not in os.environ:
        if args.nproc_per_node < 1:
            ap.error("--nproc-per-node must be >= 1")
        from .run import main as run_main

        rest = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--link-mb", str(args.link_mb)]
        if args.json:
            rest += ["--json", os.path.abspath(args.json)]
        run_main(["--nproc-per-node", str(args.nproc_per_node), "-m", "rumor.advise", *rest,
                  os.path.abspath(args.script), *args.script_args])
        return 0
    import rumor

    if not rumor.is_initialized():
        rumor.init()
    got = _load_script(args.script, args.script_args)
    advice = advise(got["model"], got["optimizer"], got["batch"], got.get("loss_fn"), steps=args.steps,
                    warmup=args.warmup, link_mb=args.link_mb)
    if args.json and rumor.rank() == 0:
        import json

        with open(args.json, "w") as f:
            json.dump(dict(rows=advice.rows, torch=advice.torch, measured=advice.measured), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
