"""The advisor's prediction model: from the measured figures (rumor.advisor.measure) to each
algorithm's predicted step. Pure arithmetic on dicts and Links: no torch, no communication, so the
tests drive it with figures worked out by hand.

The link-bound model of benchmarks/training.py. Gradients are bucketed as the wrapper does after
its first iteration (25 MB, first 1 MB, in ready order, a new bucket where a gradient came more
than 5 ms after the one before; torch DDP: its own plan, 1 MiB then 25 MB, no splits); each
bucket's communication starts when it is ready and the previous one is done; its time is the ring
time of the bytes it puts on the wire (each algorithm's codec ratio, hierarchical where the
algorithm is) plus its codec work. A step is buffer broadcast + forward + max(backward + network
CPU, last bucket done) + optimizer, where network CPU is the cost of the step's bytes sent between
hosts, and traffic between hosts runs at the measured rate beside compute until backward ends;
backward also pays the gradients' copy into the buckets and the measured share of the comm
thread's codec and kernel work. Decentralized algorithms mix weights on the comm thread from the
start of forward: forward + max(backward + network CPU, mixing) + optimizer;
LowPrecisionDecentralized's exchange runs after the step and, when the model has buffers to
broadcast, delays the next forward. Periodic algorithms (LocalSGD, DiLoCo, Streaming DiLoCo) are a
local step (the ranks' mean compute step: nothing makes them wait for each step's slowest) plus
their round's cost divided by its steps; AsyncModelAverage is that local step plus what its
background rounds take from compute (weight passes and network CPU), spread over the steps of a
round. Torch DDP is the same model with a flat fp32 ring over all ranks (gloo's own overheads are
not modelled). docs/advisor.md has the details.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

__all__ = [
    "AMA_INTERVAL_MS", "AMA_MAX_BUSY", "ASYNC", "COMPRESSED", "COMPRESSED_EF", "DECENTRALIZED", "DECENTRALIZED_LP",
    "DILOCO", "DILOCO_H", "EXACT", "HALF", "LOCAL_SGD", "LOCAL_SGD_EVERY", "Link", "MARGIN", "MB",
    "PER_STEP_SYNC", "POWERSGD", "POWERSGD_RANK", "SPLIT_GAP_S", "STREAMING", "STREAMING_FRAGMENTS",
    "TORCH_FIRST_BUCKET", "UNSYNCHRONIZED_STEPS", "broadcast_s", "bucket_plan", "bucket_times", "link_dict",
    "predict", "predict_torch", "rank_rows", "ring_sent", "torch_bucket_plan",
]

MB = 1024 * 1024

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
    """A ring allreduce among n ranks over one kind of link, fitted at two sizes.

    Args:
        n: the number of ranks in the ring.
        bandwidth_Bps: the fitted bandwidth, bytes per second.
        latency_s: the fitted latency of one hop, seconds.
        samples: the (bytes, seconds) measurements the fit rests on; default empty.
    """

    n: int
    bandwidth_Bps: float
    latency_s: float
    samples: List = field(default_factory=list)  # (bytes, seconds) measured

    def ring(self, nbytes: float, n: Optional[int] = None) -> float:
        """The predicted time of a ring allreduce: 2(n-1)/n of the bytes at the bandwidth plus
        2(n-1) hops of latency.

        Args:
            nbytes: the bytes each rank reduces.
            n: the ranks in the ring; None (the default) means this link's n.

        Returns:
            Seconds; 0.0 for one rank or no bytes.
        """
        n = self.n if n is None else n
        if n <= 1 or nbytes <= 0:
            return 0.0
        return 2 * (n - 1) / n * nbytes / self.bandwidth_Bps + 2 * (n - 1) * self.latency_s

    def hop(self, nbytes: float) -> float:
        """One message to one peer.

        Args:
            nbytes: the message's size in bytes.

        Returns:
            Seconds: nbytes at the bandwidth plus one latency.
        """
        return nbytes / self.bandwidth_Bps + self.latency_s


def ring_sent(nbytes: float, n: int) -> float:
    """Bytes each of n ranks sends in a ring (or all-to-all) allreduce of nbytes."""
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def _net_cost(m: Dict) -> float:
    """Compute time lost per byte sent between hosts (0 on one host: no network)."""
    return m.get("net_cost_s_per_byte", 0.0) if m["hosts"] > 1 else 0.0


def _link_of(d: Optional[Dict]) -> Optional[Link]:
    return None if d is None else Link(n=d["ranks"], bandwidth_Bps=d["bandwidth_Bps"], latency_s=d["latency_s"],
                                       samples=list(d.get("samples", [])))


def link_dict(link: Optional[Link]) -> Optional[Dict]:
    return None if link is None else dict(ranks=link.n, bandwidth_Bps=link.bandwidth_Bps, latency_s=link.latency_s,
                                          samples=link.samples)


POWERSGD_RANK = 4  # the PowerSGD candidate's matrix_approximation_rank (also its kernels' probe)

SPLIT_GAP_S = 0.005  # DistributedDataParallel(bucket_split_gap_ms=5.0)
TORCH_FIRST_BUCKET = MB  # torch DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def bucket_plan(ready: List[float], nbytes: List[int], cap_mb: float = 25, first_mb: float = 1,
                first: Optional[List[float]] = None, gap_s: Optional[float] = SPLIT_GAP_S) -> List[List[int]]:
    """Parameter indices per bucket, as rumor's wrapper lays them out after its first iteration
    (Algorithm.plan_buckets): in the order of ``first`` (that iteration's ready times; default
    ``ready``), a bucket closed before it would exceed its cap (``first_mb`` for the first) and
    where the next gradient came more than ``gap_s`` after the one before it.

    Args:
        ready: each parameter's gradient ready time, seconds into backward.
        nbytes: each parameter's gradient size in bytes (same order as ready).
        cap_mb: the cap of every bucket after the first, in MiB (default 25).
        first_mb: the first bucket's cap, in MiB (default 1).
        first: the first iteration's ready times that fix the order; None (the default) means
            ready.
        gap_s: the gap in seconds that closes a bucket; None never splits at gaps (default
            SPLIT_GAP_S, 5 ms).

    Returns:
        A list of buckets, each a list of parameter indices.
    """
    first = ready if first is None else first
    order = sorted(range(len(ready)), key=lambda i: (first[i], i))
    out: List[List[int]] = []
    cur: List[int] = []
    used = 0
    for j, i in enumerate(order):
        if cur:
            cap = (first_mb if not out else cap_mb) * MB
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
    it reaches its cap (1 MiB for the first, cap_mb after), never split at gaps.

    Args:
        ready: each parameter's gradient ready time, seconds into backward.
        nbytes: each parameter's gradient size in bytes (same order as ready).
        cap_mb: the cap of every bucket after the first, in MiB (default 25).
        first: the first iteration's ready times that fix the order; None (the default) means
            ready.

    Returns:
        A list of buckets, each a list of parameter indices.
    """
    first = ready if first is None else first
    order = sorted(range(len(ready)), key=lambda i: (first[i], i))
    out: List[List[int]] = []
    cur: List[int] = []
    used = 0
    for i in order:
        cur.append(i)
        used += nbytes[i]
        if used >= (TORCH_FIRST_BUCKET if not out else cap_mb * MB):
            out.append(cur)
            cur, used = [], 0
    if cur:
        out.append(cur)
    return out


def bucket_times(plan: List[List[int]], ready: List[float], nbytes: List[int]):
    """(ready time, bytes) per bucket: ready when its last gradient is."""
    return [(max(ready[i] for i in b), sum(nbytes[i] for i in b)) for b in plan]


def _buckets(ready: List[float], nbytes: List[int], cap_mb: float = 25, first_mb: float = 1,
             first: Optional[List[float]] = None, gap_s: Optional[float] = SPLIT_GAP_S):
    """(ready time, bytes) per bucket of rumor's wrapper (bucket_plan)."""
    return bucket_times(bucket_plan(ready, nbytes, cap_mb, first_mb, first, gap_s), ready, nbytes)


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
    """The part of the comm thread's CPU work that compute loses (measure.measure_steal; none where
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


def broadcast_s(nbytes: float, n: int, intra: Optional[Link], inter: Optional[Link], H: int, L: int) -> float:
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
    """Predicted step of each algorithm from the measured figures (see the module docstring).

    Args:
        m: the measured figures (Advice.measured: ranks, hosts, local_size, compute times,
            gradient sizes, buckets, codec rates, ...).
        intra: the ring inside a host, or None where it was not measured (one rank per host).
        inter: the ring among one rank per host, or None on one host.
        adam: whether the optimizer is an Adam; only then is 1-bit Adam a candidate.

    Returns:
        One dict per candidate algorithm (algorithm, kwargs, ctor, caveat, kind, period,
        wire_bytes_per_element, predicted_step_s, exposed_comm_s, ...), not yet ranked.

    Raises:
        KeyError: m lacks a figure the model needs.
    """
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

    fp_cpu = net * ring_sent(param_bytes, H)
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
            _overlapped(m, compressed(name), cpu_s=net * ring_sent(elements * w, H), local_of=legs),
            w if H > 1 else elem)
    if adam:
        w = codecs["1-bit"]["wire_bytes_per_element"]

        def onebit(nbytes, *_):
            el = nbytes / elem
            link = inter if H > 1 else intra
            t = link.ring(el * w, n) if link is not None else 0.0
            return t, codec_time("1-bit", el)
        add("1-bit Adam", "OneBitAdamAlgorithm", {}, COMPRESSED_EF, "compressed",
            _overlapped(m, onebit, cpu_s=net * ring_sent(elements * w, n)), w,
            shown="optimizer=rumor.optim.OneBitAdamOptimizer(...), algorithm=OneBitAdamAlgorithm(optimizer)")

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
            _overlapped(m, powersgd, cpu_s=net * ring_sent(4 * sent, H), local_of=powersgd_legs),
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
    frag_cpu = codec_time("ByteGrad", frag) + 8 * frag * ew + net * ring_sent(frag * w8, n)
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
    round_cpu = thread_cost + elements * ew + net * ring_sent(param_bytes, H)
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
    same way.

    Args:
        m: the measured figures, as for predict.
        intra: the ring inside a host (used on one host when no loopback figure was measured),
            or None.
        inter: the ring among one rank per host (used across hosts), or None.

    Returns:
        A dict with algorithm ("torch DDP"), predicted_step_s and exposed_comm_s.

    Raises:
        KeyError: m lacks a figure the model needs.
    """
    n, H = m["ranks"], m["hosts"]
    link = inter if H > 1 else intra
    lo = _link_of(m.get("loopback")) if H == 1 else None
    if lo is not None:
        # One host: gloo's ring runs over loopback TCP, whose kernel copies take the cores
        # compute shares (measured beside it: loopback_stretch), and its threads sum what
        # they receive ((n-1)/n of the bucket).
        ew = m.get("elementwise_s_per_element", 0.0)

        def comm(nbytes, *_):
            return (ring_sent(nbytes, n) / lo.bandwidth_Bps + 2 * (n - 1) * lo.latency_s,
                    (n - 1) / n * nbytes / m["grad_bytes_per_element"] * ew)
        # Beside compute the traffic runs at its own measured rate (the legs' rate in _overlapped:
        # all of it stays inside the host), and compute loses the stretch per second of it
        # done meanwhile (at most all of it).
        r = min(1.0, max(0.1, m.get("loopback_rate_beside_compute", 1.0)))
        total = ring_sent(m["grad_bytes"], n) / lo.bandwidth_Bps
        cpu = m.get("loopback_stretch", 0.0) * min(total, m["backward_s"] * r)
        res = _overlapped(dict(m, local_rate_beside_compute=r), comm,
                          "torch_buckets" if "torch_buckets" in m else "buckets", cpu_s=cpu, copies=2,
                          local_of=lambda nbytes, b: comm(nbytes)[0])
        return dict(algorithm="torch DDP", predicted_step_s=res["predicted_step_s"],
                    exposed_comm_s=res["exposed_comm_s"])

    def comm(nbytes, *_):
        return link.ring(nbytes, n) if link is not None else 0.0
    cpu = _net_cost(m) * ring_sent(m["grad_bytes"], n)
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


# How much faster (relative) a less exact algorithm must be predicted to rank above an exact
# one: a compute-bound job gains nothing from giving up exactness, and the step times of the
# periodic and asynchronous algorithms are averages over rounds.
MARGIN = {"exact": 0.0, "compressed": 0.01, "decentralized": 0.02, "periodic": 0.05, "async": 0.05}


def rank_rows(rows: List[Dict]) -> List[Dict]:
    """Fastest first, by predicted step plus the kind's MARGIN; then more exact first.

    Args:
        rows: predict()'s rows (each with predicted_step_s, kind and algorithm).

    Returns:
        A new list of the same rows, ranked.
    """
    return sorted(rows, key=lambda r: (r["predicted_step_s"] * (1 + MARGIN[r["kind"]]), list(MARGIN).index(r["kind"]),
                                       r["algorithm"]))
