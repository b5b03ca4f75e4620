"""rumor.advise: measures the job (rumor.advisor.measure), predicts each algorithm's step
(rumor.advisor.model), ranks them and prints the table (rumor.advisor.report); the Advice it
returns builds the chosen algorithm. The model and the optimizer are put back as they were (state
dicts restored, gradients cleared).
"""
from __future__ import annotations

import copy
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from .measure import (
    LOCAL_MAX,
    default_loss,
    measure_arena_round,
    measure_codecs,
    measure_compute,
    measure_copy,
    measure_elementwise,
    measure_links,
    measure_loopback,
    measure_mix,
    measure_powersgd,
    measure_steal,
    powersgd_probe_shape,
)
from .model import (
    MB,
    POWERSGD_RANK,
    broadcast_s,
    bucket_plan,
    bucket_times,
    link_dict,
    predict,
    predict_torch,
    rank_rows,
    torch_bucket_plan,
)
from .report import format_table

__all__ = ["Advice", "advise", "build_algorithm"]


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
        """The top-ranked row (rows[0]): the algorithm predicted to train fastest."""
        return self.rows[0]

    def algorithm(self, row: Optional[Dict] = None, optimizer=None):
        """A new instance of the best row's algorithm (or of ``row``'s), for the wrapper's
        ``algorithm=``; 1-bit Adam needs its optimizer."""
        return build_algorithm(self.best if row is None else row, optimizer)


def build_algorithm(row: Dict, optimizer: Optional[torch.optim.Optimizer] = None):
    """The rumor algorithm of an advice row (``row["ctor"]``), constructed: what the row's
    ``kwargs`` text says. 1-bit Adam needs its optimizer (a rumor.optim.OneBitAdamOptimizer)."""
    from .. import algorithms as A

    ctor = row.get("ctor") if isinstance(row, dict) else None
    if not ctor or not hasattr(A, ctor.get("cls", "")):
        raise ValueError(f"rumor.advisor.build_algorithm: not an advice row with a constructor: {row!r}")
    kwargs = {k: getattr(torch, v) if k in ("dtype", "wire_dtype") and isinstance(v, str) else v
              for k, v in ctor["kwargs"].items()}
    cls = getattr(A, ctor["cls"])
    if ctor["cls"] == "OneBitAdamAlgorithm":
        if optimizer is None:
            raise ValueError("rumor.advisor.build_algorithm: 1-bit Adam needs its optimizer "
                             "(rumor.optim.OneBitAdamOptimizer)")
        return cls(optimizer, **kwargs)
    return cls(**kwargs)


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
    from .. import _runtime
    from ..collectives import ReduceOp, allreduce, barrier, broadcast_

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
        loss_fn = default_loss
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
        params, fwd, bwd, opt_s, ready, first, share, since_start, totals = measure_compute(
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
        hosts, local_n, intra, inter, pair, net_cpu, beside, ends, bcast, local_beside = measure_links(
            int(link_mb * MB), link_reps, busy, sum(nbytes))
        steal = measure_steal(busy, sum(p.numel() for p in params))
        one_host = {}
        if hosts == 1 and local_n > 1:
            # Every rank on one host, sharing its cores: the weight mix's copies and torch DDP's
            # loopback TCP (gloo) are CPU work that compute loses (4 ranks on 2 cores, mlp25m:
            # Decentralized's step 300 ms over compute where the mix was priced hidden, torch
            # DDP's 400 ms over where rumor's shared-memory ring priced 200).
            size = max(4096, min(sum(nbytes), LOCAL_MAX) // 4096 * 4096)
            mix_s, mix_rate, mix_stretch = measure_mix(busy, size)
            lo, lo_rate, lo_stretch = measure_loopback(busy, size)
            one_host = dict(mix_s_per_byte=mix_s / size, mix_rate_beside_compute=mix_rate, mix_stretch=mix_stretch,
                            loopback=link_dict(lo), loopback_rate_beside_compute=lo_rate,
                            loopback_stretch=lo_stretch)
            arena_elements = max(1024, min(sum(p.numel() for p in params), LOCAL_MAX // 4))
            arena = measure_arena_round(busy, arena_elements)
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
    codecs = measure_codecs(probe, 3)
    per_element = [[c["encode_s_per_element"], c["decode_s_per_element"]] for c in codecs.values()]
    psgd_shape = powersgd_probe_shape([list(p.shape) for p in params])
    per_element.append([measure_elementwise(probe, 3), measure_powersgd(POWERSGD_RANK, 2, psgd_shape)])
    per_element.append([measure_copy(probe, 3), steal])
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
             buffer_broadcast_s=broadcast_s(buffer_bytes, st.env.size, intra, inter, hosts, local_n),
             intra=link_dict(intra), inter=link_dict(inter), pair=link_dict(pair),
             intra_ends=link_dict(ends), intra_broadcast=link_dict(bcast),
             comm_rate_beside_compute=beside, local_rate_beside_compute=local_beside)
    m.update(one_host)
    plan = bucket_plan(ready, nbytes, first=first)
    m["bucket_params"] = plan
    m["buckets"] = bucket_times(plan, ready_all, nbytes)
    m["torch_buckets"] = bucket_times(torch_bucket_plan(ready, nbytes, first=first), ready_all, nbytes)
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
