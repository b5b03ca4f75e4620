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
  per host (the network), fitted as ``t = 2(n-1)/n * bytes / bandwidth + 2(n-1) * latency``;
* the codecs: encode and decode time per element of each compressed algorithm's codec, and
  their exact encoded sizes.

The model and the optimizer are put back as they were (state dicts restored, gradients cleared).

How it predicts: the link-bound model of benchmarks/training.py. Gradients are bucketed as the
wrapper does (25 MB, first 1 MB, in measured ready order); each bucket's communication starts
when it is ready and the previous one is done; its time is the ring time of the bytes it puts on
the wire (each algorithm's codec ratio, hierarchical where the algorithm is) plus its codec work.
A step is forward + max(backward, last bucket done) + optimizer. Decentralized algorithms mix
weights on the comm thread from the start of forward: forward + max(backward, mixing) + optimizer.
Torch DDP is the same model with a flat fp32 ring over all ranks (gloo's own overheads are not
modelled, so the predicted speed-ups over it are, if anything, low).
"""
from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

_MB = 1024 * 1024

# Convergence caveat of each family (what changes against exact data-parallel SGD).
EXACT = "exact (same averaged gradient as torch DDP, up to summation order)"
COMPRESSED = "compressed gradients, no error feedback (lossy averaging; check the loss curve)"
COMPRESSED_EF = "compressed (1-bit) momentum with error feedback; full-precision Adam warm-up first"
HALF = "gradients rounded to 16 bits on the wire (small, unbiased-ish rounding error)"
DECENTRALIZED = "decentralized: ranks hold different weights that mix with peers (not exact SGD)"
DECENTRALIZED_LP = "decentralized with compressed weight differences and error compensation"


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
    """rows: one dict per algorithm, fastest first (algorithm, kwargs, predicted_step_s,
    speedup_over_torch, exposed_comm_s, wire_bytes_per_element, caveat); torch: the torch DDP
    row; measured: what the prediction rests on; table: the printed text."""

    rows: List[Dict]
    torch: Dict
    measured: Dict
    table: str

    @property
    def best(self) -> Dict:
        return self.rows[0]


# ==== measuring ========================================================================================

def _default_loss(model, batch):
    x, y = batch
    out = model(*x) if isinstance(x, (tuple, list)) else model(x)
    out = out.reshape(-1, out.shape[-1])
    if out.dtype not in (torch.float32, torch.float64):
        out = out.float()
    return torch.nn.functional.cross_entropy(out, y.reshape(-1))


def _measure_compute(model, optimizer, batch, loss_fn, steps: int, warmup: int):
    params = [p for p in model.parameters() if p.requires_grad]
    ready = {}
    t_bwd = [0.0]

    def hook_for(i):
        def hook(_p):
            ready[i] = time.perf_counter() - t_bwd[0]
        return hook

    handles = [p.register_post_accumulate_grad_hook(hook_for(i)) for i, p in enumerate(params)]
    fwd, bwd, opt, readies = [], [], [], []
    try:
        for s in range(warmup + steps):
            optimizer.zero_grad(set_to_none=False)
            ready.clear()
            t0 = time.perf_counter()
            loss = loss_fn(model, batch)
            t1 = time.perf_counter()
            t_bwd[0] = t1
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            t3 = time.perf_counter()
            if s >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                opt.append(t3 - t2)
                readies.append([ready.get(i, t2 - t1) for i in range(len(params))])
    finally:
        for h in handles:
            h.remove()
    med = [statistics.median(r[i] for r in readies) for i in range(len(params))]
    return params, statistics.median(fwd), statistics.median(bwd), statistics.median(opt), med


def _time_allreduce(group, nbytes: int, reps: int) -> float:
    from .collectives import allreduce_

    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    allreduce_(buf, group=group, algorithm="ring")
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        allreduce_(buf, group=group, algorithm="ring")
        times.append(time.perf_counter() - t0)
    # The least disturbed repetition: other processes only ever add time.
    return min(times)


def _fit(n: int, small: float, big: float, s_small: int, s_big: int) -> Link:
    # t = a * bytes + b, a = 2(n-1)/n / bandwidth, b = 2(n-1) * latency
    if big > small:
        a = (big - small) / (s_big - s_small)
        b = max(small - a * s_small, 0.0)
    else:  # noise hid the size dependence: all of the large message's time counts as bandwidth
        a, b = max(big, 1e-9) / s_big, max(small, 0.0)
    return Link(n=n, bandwidth_Bps=2 * (n - 1) / n / a, latency_s=b / (2 * (n - 1)),
                samples=[(s_small, small), (s_big, big)])


def _measure_links(link_bytes: int, reps: int):
    """Ring allreduce inside each host (all hosts at once) and among one rank per host; every
    rank gets the slowest figures. Creates the groups it needs (collectively, on every rank)."""
    from . import _runtime
    from .collectives import ReduceOp, allreduce
    from ._runtime import new_group

    st = _runtime._get()
    hosts: List[str] = []
    for h in st.hosts:
        if h not in hosts:
            hosts.append(h)
    members = {h: [r for r in range(st.env.size) if st.hosts[r] == h] for h in hosts}
    me = st.env.rank
    small = 4 * 1024
    big = max(link_bytes, 4 * small)
    out = torch.zeros(4, dtype=torch.float64)
    local_n = max(len(m) for m in members.values())
    if local_n > 1:
        groups = {h: new_group(members[h]) if len(members[h]) > 1 else None for h in hosts}
        g = groups[st.hosts[me]]
        if g is not None:
            out[0] = _time_allreduce(g, small, reps)
            out[1] = _time_allreduce(g, big, reps)
    if len(hosts) > 1:
        leaders = [members[h][0] for h in hosts]
        lg = new_group(leaders)
        if me in leaders:
            out[2] = _time_allreduce(lg, small, reps)
            out[3] = _time_allreduce(lg, big, reps)
    out = allreduce(out, op=ReduceOp.MAX)
    t = out.tolist()
    intra = _fit(local_n, t[0], t[1], small, big) if local_n > 1 else None
    inter = _fit(len(hosts), t[2], t[3], small, big) if len(hosts) > 1 else None
    return len(hosts), local_n, intra, inter


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


# ==== predicting =======================================================================================

def _buckets(ready: List[float], nbytes: List[int], cap_mb: float = 25, first_mb: float = 1):
    """(ready time, bytes) per bucket: the wrapper's default plan over the measured ready order."""
    order = sorted(range(len(ready)), key=lambda i: ready[i])
    out, cur, used, cap = [], [], 0, first_mb * _MB
    for i in order:
        if cur and used + nbytes[i] > cap:
            out.append((max(ready[j] for j in cur), used))
            cur, used, cap = [], 0, cap_mb * _MB
        cur.append(i)
        used += nbytes[i]
    if cur:
        out.append((max(ready[j] for j in cur), used))
    return out


def _overlapped(m: Dict, comm_of: Callable[[float], float]) -> Dict:
    t = 0.0
    for ready, nbytes in m["buckets"]:
        t = max(t, ready) + comm_of(nbytes)
    step = m["forward_s"] + max(m["backward_s"], t) + m["optimizer_s"]
    return dict(predicted_step_s=step, exposed_comm_s=max(0.0, t - m["backward_s"]))


def predict(m: Dict, intra: Optional[Link], inter: Optional[Link], adam: bool) -> List[Dict]:
    """Predicted step of each algorithm from the measured figures (see the module docstring)."""
    H, L, n = m["hosts"], m["local_size"], m["ranks"]
    codecs = m["codecs"]
    param_bytes = m["grad_bytes"]
    elem = m["grad_bytes_per_element"]

    def local(nbytes):  # full-precision reduce + broadcast inside a host (hierarchical's ends)
        return intra.ring(nbytes) if intra is not None and L > 1 else 0.0

    def across(nbytes):
        return inter.ring(nbytes) if inter is not None and H > 1 else 0.0

    def allreduce_fp(nbytes):
        if H > 1:
            return local(nbytes) + across(nbytes)  # hierarchical (the communicator's own pick)
        return local(nbytes)

    def codec_time(name, elements):
        c = codecs[name]
        k = H if H > 1 else n
        # encode all, owner decodes (k-1)/k and re-encodes its 1/k, every rank decodes all
        return elements * (c["encode_s_per_element"] * (1 + 1 / k) + c["decode_s_per_element"] * (2 - 1 / k))

    def compressed(name):
        w = codecs[name]["wire_bytes_per_element"]

        def comm(nbytes):
            if H == 1:  # one host: hierarchical compressed algorithms use the shared-memory allreduce
                return local(nbytes)
            elements = nbytes / elem
            return local(nbytes) + across(elements * w) + codec_time(name, elements)
        return comm

    rows = []

    def add(name, kwargs, caveat, kind, res, wire):
        rows.append(dict(algorithm=name, kwargs=kwargs, caveat=caveat, kind=kind,
                         wire_bytes_per_element=wire, **res))

    add("GradientAllReduce", "algorithm=GradientAllReduce()", EXACT, "exact", _overlapped(m, allreduce_fp), elem)
    if H > 1 and L > 1:
        add("GradientAllReduce hierarchical", "algorithm=GradientAllReduce(hierarchical=True)", EXACT, "exact",
            _overlapped(m, allreduce_fp), elem)
    for name, ctor, cav in (("ByteGrad", "ByteGrad()", COMPRESSED), ("QSGD", "QSGD(levels=16)", COMPRESSED),
                            ("fp16", "LowPrecision(dtype=torch.float16)", HALF),
                            ("bf16", "LowPrecision(dtype=torch.bfloat16)", HALF)):
        add(name, f"algorithm={ctor}", cav, "compressed", _overlapped(m, compressed(name)),
            codecs[name]["wire_bytes_per_element"] if H > 1 else elem)
    if adam:
        w = codecs["1-bit"]["wire_bytes_per_element"]

        def onebit(nbytes):
            elements = nbytes / elem
            link = inter if H > 1 else intra
            t = link.ring(elements * w, n) if link is not None else 0.0
            return t + codec_time("1-bit", elements)
        add("1-bit Adam", "optimizer=rumor.optim.OneBitAdam(...), algorithm=OneBitAdam(optimizer)", COMPRESSED_EF,
            "compressed", _overlapped(m, onebit), w)

    compute = m["forward_s"] + m["backward_s"]

    def decentralized(mix_s):
        step = max(compute, mix_s) + m["optimizer_s"]
        return dict(predicted_step_s=step, exposed_comm_s=max(0.0, mix_s - compute))

    # Weight mixing over hosts (hierarchical=True, the default): average inside each host, one
    # exchange among the host leaders, broadcast inside the host.
    add("Decentralized all", "algorithm=Decentralized(peer_selection='all')", DECENTRALIZED, "decentralized",
        decentralized(allreduce_fp(param_bytes)), elem)
    peer = (inter.hop(param_bytes) if H > 1 and inter is not None else 0.0)
    add("Decentralized shift_one", "algorithm=Decentralized(peer_selection='shift_one')", DECENTRALIZED,
        "decentralized", decentralized(local(param_bytes) + peer), elem)
    w8 = codecs["ByteGrad"]["wire_bytes_per_element"]
    elements = param_bytes / elem
    ring2 = (2 * elements * w8 / inter.bandwidth_Bps + inter.latency_s) if H > 1 and inter is not None else 0.0
    lp = local(param_bytes) + (ring2 + codec_time("ByteGrad", elements) * 1.5 if H > 1 else 0.0)
    add("LowPrecisionDecentralized", "algorithm=LowPrecisionDecentralized()", DECENTRALIZED_LP, "decentralized",
        decentralized(lp), w8 if H > 1 else elem)
    return rows


def predict_torch(m: Dict, intra: Optional[Link], inter: Optional[Link]) -> Dict:
    """torch DDP: a flat fp32 ring over all ranks (gloo), buckets of 25 MB, overlapped the same way."""
    n, H = m["ranks"], m["hosts"]
    link = inter if H > 1 else intra

    def comm(nbytes):
        return link.ring(nbytes, n) if link is not None else 0.0
    return dict(algorithm="torch DDP", **_overlapped(m, comm))


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
    from .collectives import ReduceOp, allreduce, broadcast_

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

    st = _runtime._get()
    model_sd = copy.deepcopy(model.state_dict())
    opt_sd = copy.deepcopy(optimizer.state_dict())
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    was_training = model.training
    model.train()
    try:
        params, fwd, bwd, opt_s, ready = _measure_compute(model, optimizer, sample_batch, loss_fn, steps, warmup)
    finally:
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(opt_sd)
        for p, g in zip(params, grads):
            p.grad = g
        model.train(was_training)
    nbytes = [p.numel() * p.element_size() for p in params]
    elements = sum(p.numel() for p in params)
    # The slowest rank's compute; rank 0's ready times (the wrapper's buckets follow its order).
    comp = allreduce(torch.tensor([fwd, bwd, opt_s], dtype=torch.float64), op=ReduceOp.MAX)
    fwd, bwd, opt_s = comp.tolist()
    rt = torch.tensor(ready, dtype=torch.float64)
    broadcast_(rt, 0)
    ready = rt.tolist()
    hosts, local_n, intra, inter = _measure_links(int(link_mb * _MB), link_reps)
    codecs = _measure_codecs(min(elements, 1 << 20) or 1, 3)
    cflat = torch.tensor([[c["encode_s_per_element"], c["decode_s_per_element"]] for c in codecs.values()],
                         dtype=torch.float64)
    cflat = allreduce(cflat, op=ReduceOp.MAX)
    for (name, c), row in zip(codecs.items(), cflat.tolist()):
        c["encode_s_per_element"], c["decode_s_per_element"] = row

    m = dict(ranks=st.env.size, hosts=hosts, local_size=local_n, forward_s=fwd, backward_s=bwd,
             optimizer_s=opt_s, grad_elements=elements, grad_bytes=sum(nbytes),
             grad_bytes_per_element=sum(nbytes) / elements, params=len(params),
             dtypes=sorted({str(p.dtype).replace("torch.", "") for p in params}),
             last_ready_s=max(ready), codecs=codecs,
             intra=None if intra is None else dict(ranks=intra.n, bandwidth_Bps=intra.bandwidth_Bps,
                                                   latency_s=intra.latency_s, samples=intra.samples),
             inter=None if inter is None else dict(ranks=inter.n, bandwidth_Bps=inter.bandwidth_Bps,
                                                   latency_s=inter.latency_s, samples=inter.samples))
    m["buckets"] = _buckets(ready, nbytes)
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


TIE = 0.01  # predictions this close (relative) are a tie: the algorithm that changes less wins
_KIND_ORDER = {"exact": 0, "compressed": 1, "decentralized": 2}


def rank_rows(rows: List[Dict]) -> List[Dict]:
    """Fastest first. Predictions within TIE of the first of their tier are a tie: inside a tier
    exact beats compressed beats decentralized (a compute-bound job gains nothing from giving up
    exactness), then the step."""
    rows = sorted(rows, key=lambda r: (r["predicted_step_s"], r["algorithm"]))
    out, i = [], 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j]["predicted_step_s"] <= rows[i]["predicted_step_s"] * (1 + TIE):
            j += 1
        out += sorted(rows[i:j], key=lambda r: (_KIND_ORDER[r["kind"]], r["predicted_step_s"], r["algorithm"]))
        i = j
    return out


def _rate(bps: float) -> str:
    return f"{bps / 1e9:.2f} GB/s" if bps >= 1e9 else f"{bps / 1e6:.1f} MB/s"


def format_table(m: Dict, rows: List[Dict], tref: Dict) -> str:
    lines = [f"rumor advisor: {m['ranks']} ranks on {m['hosts']} host(s), up to {m['local_size']} per host",
             "measured (slowest rank):",
             f"  compute: forward {m['forward_s'] * 1e3:.1f} ms, backward {m['backward_s'] * 1e3:.1f} ms, "
             f"optimizer {m['optimizer_s'] * 1e3:.1f} ms; last gradient ready {m['last_ready_s'] * 1e3:.1f} ms "
             f"into backward",
             f"  gradients: {m['grad_elements'] / 1e6:.2f} M elements, {m['grad_bytes'] / 1e6:.1f} MB "
             f"({', '.join(m['dtypes'])}) in {m['params']} tensors, {len(m['buckets'])} buckets of <= 25 MB"]
    for key, what in (("intra", "inside a host (ring allreduce over shared memory)"),
                      ("inter", "between hosts (ring allreduce among one rank per host)")):
        link = m[key]
        if link is None:
            lines.append(f"  {what}: not measured (" + ("one rank per host)" if key == "intra" else "one host)"))
        else:
            lines.append(f"  {what}: {_rate(link['bandwidth_Bps'])}, {link['latency_s'] * 1e6:.0f} us per hop "
                         f"({link['ranks']} ranks)")
    lines.append("  codecs (ns per element, encode/decode; wire bytes per element): " + ", ".join(
        f"{k} {c['encode_s_per_element'] * 1e9:.2f}/{c['decode_s_per_element'] * 1e9:.2f}; "
        f"{c['wire_bytes_per_element']:.3f}" for k, c in m["codecs"].items()))
    lines.append(f"predicted step of torch DDP (flat fp32 ring): {tref['predicted_step_s'] * 1e3:.1f} ms")
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
