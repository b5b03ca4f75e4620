"""Elastic training that loses nothing: commit the training state, restore it after a restart.

    state = rumor.elastic.State(ddp, optimizer, sampler, epoch=0)

    @rumor.elastic.run
    def train(state):
        while state.step < total_steps:
            ...one step...
            state.step += 1
            if state.step % 10 == 0:
                state.commit()

    train(state)

Under ``rumor.run --max-restarts K`` (or ``--nnodes MIN:MAX``) torchrun restarts every worker
when one dies or the set of nodes changes. The restarted workers construct the same State and
enter ``run``: it finds the newest commit any rank can still see, sends it from that rank to
everyone by broadcast (a new node gets it from a survivor), re-shards the sampler for the new
world and continues from the committed step.

Where the commits live. torchrun kills all workers of a node when one fails, so "the memory of
the surviving ranks" must outlive the worker processes. A commit is a file in /dev/shm (tmpfs:
memory, not disk), one per job, host and launcher agent, written by the host's first rank with
an atomic rename, so a worker killed mid-write leaves the previous commit intact. This needs no
keeper process that could itself die or leak and costs one copy of the state per host; a
finished run() removes the files, the launcher (rumor.run) removes its own when the job ends,
and any later rumor.init() or launcher on the host sweeps those whose agent has exited.
``path=`` additionally writes each commit to disk (rank 0), used only when no host has one in
memory (a job restarted from scratch).
"""
from __future__ import annotations

import functools
import hashlib
import io
import math
import os
import struct
from typing import Any, Callable, Optional

import torch

SNAPSHOT_DIR = "/dev/shm"
_PREFIX = "rumor_elastic-"  # not a swept rumor- name: commits must outlive their writer
_HEADER = struct.Struct("<8sq")  # magic, committed step
_MAGIC = b"RUMORELS"
_RESERVED = ("model", "optimizer", "sampler", "step", "path")


def _job() -> str:
    run_id = os.environ.get("RUMOR_ELASTIC_JOB") or os.environ.get("TORCHELASTIC_RUN_ID") or "none"
    return hashlib.sha1(run_id.encode()).hexdigest()[:12]


def _snapshot_file() -> str:
    """This host's commit file. Besides the run id (torchrun's default, "none", is shared by
    every job that does not set --rdzv-id) it names the launcher's agent, the workers' parent,
    which outlives its workers' restarts but not the job: a later job never continues from an
    earlier one's commit, and a sweep (rumor._shm) removes the file once the agent is gone."""
    from . import _runtime, _shm

    host = hashlib.sha1(_runtime._host_id().encode()).hexdigest()[:12]
    return os.path.join(SNAPSHOT_DIR, f"{_PREFIX}{_job()}-{host}@{_shm._pid_namespace()}.{os.getppid()}")


def remove_snapshots(run_id: str, agent_pid: int) -> None:
    """Removes the in-memory commits of a run's agent on this host (the launcher, at its end)."""
    from . import _shm

    job = hashlib.sha1(run_id.encode()).hexdigest()[:12]
    try:
        names = os.listdir(SNAPSHOT_DIR)
    except OSError:
        return
    for n in names:
        if n.startswith(f"{_PREFIX}{job}-") and n.endswith(f"@{_shm._pid_namespace()}.{agent_pid}"):
            try:
                os.unlink(os.path.join(SNAPSHOT_DIR, n))
            except OSError:
                pass


def _write_atomic(path: str, step: int, payload: bytes) -> None:
    base, at, owner = path.rpartition("@") if os.path.dirname(path) == SNAPSHOT_DIR else (path, "", "")
    # A writer killed mid-write leaves its temporary file: in /dev/shm it keeps the owner tag,
    # so the sweep that removes the commit removes it too.
    tmp = f"{base}.tmp{os.getpid()}{at}{owner}" if at else f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(_MAGIC, step))
        f.write(payload)
    os.replace(tmp, path)


def _read_step(path: str) -> int:
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
    except OSError:
        return -1
    if len(head) != _HEADER.size:
        return -1
    magic, step = _HEADER.unpack(head)
    return step if magic == _MAGIC else -1


def _read_payload(path: str) -> bytes:
    with open(path, "rb") as f:
        f.seek(_HEADER.size)
        return f.read()


def _unwrap(model):
    from .parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module, model.algorithm
    return model, None


def _reshard(sampler, num_replicas: int, rank: int) -> None:
    """Points a sampler at the new world. Samplers may implement reshard(num_replicas, rank);
    torch's DistributedSampler is handled here (its sizes follow the world size)."""
    if hasattr(sampler, "reshard"):
        sampler.reshard(num_replicas, rank)
        return
    from torch.utils.data.distributed import DistributedSampler

    if isinstance(sampler, DistributedSampler):
        n = len(sampler.dataset)
        sampler.num_replicas, sampler.rank = num_replicas, rank
        if sampler.drop_last and n % num_replicas != 0:
            sampler.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            sampler.num_samples = math.ceil(n / num_replicas)
        sampler.total_size = sampler.num_samples * num_replicas
    elif hasattr(sampler, "num_replicas") and hasattr(sampler, "rank"):
        raise TypeError(f"rumor.elastic: cannot re-shard a {type(sampler).__name__} for a new world; "
                        "give it a reshard(num_replicas, rank) method")


class State:
    """What a restarted job needs to continue: the model (or its DistributedDataParallel
    wrapper), the optimizer, an optional sampler, ``step``, and any user fields (``State(...,
    epoch=0, best=inf)`` gives ``state.epoch``, ``state.best``; picklable values).

    The state must be the same on every rank at a commit (data parallel training with
    GradientAllReduce and the compressed allreduces: ByteGrad, QSGD, LowPrecision), or the
    algorithm says how to make it so: those whose ranks hold different replicas (Decentralized,
    LowPrecisionDecentralized, AsyncModelAverage) set ``elastic_consensus``, and a commit then
    saves the average of every rank's weights and optimizer state (a collective; the restarted
    job, whatever its size, starts from that consensus point). Algorithms with state of their
    own implement ``elastic_state_dict()`` / ``load_elastic_state_dict()``; others are refused.
    """

    def __init__(self, model, optimizer, sampler=None, *, path: Optional[str] = None, **fields: Any):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"rumor.elastic.State: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("rumor.elastic.State: optimizer must be a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        if sampler is not None and not (hasattr(sampler, "set_epoch") or hasattr(sampler, "state_dict")):
            raise TypeError("rumor.elastic.State: sampler must have set_epoch() or state_dict() "
                            f"(torch's DistributedSampler, rumor.data samplers), got {type(sampler).__name__}")
        bad = [k for k in fields if k in _RESERVED or k.startswith("_")]
        if bad:
            raise ValueError(f"rumor.elastic.State: field names {bad} are reserved")
        module, algorithm = _unwrap(model)
        if algorithm is not None and not getattr(algorithm, "elastic_replicated", False) \
                and not getattr(algorithm, "elastic_consensus", False) \
                and not hasattr(algorithm, "load_elastic_state_dict"):
            raise NotImplementedError(
                f"rumor.elastic.State: {type(algorithm).__name__} keeps state that a restart would lose "
                "(per-rank replicas, error feedback or momenta of its own) and does not implement "
                "elastic_state_dict()/load_elastic_state_dict(); elastic training supports "
                "the algorithms of rumor.algorithms")
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self._module, self._algorithm = module, algorithm
        self.path = path
        self.step = 0
        self._fields = list(fields)
        self.restored_step: Optional[int] = None  # the commit run() continued from, if any
        self.restored_from: Optional[int] = None  # the rank that sent it (-1: read from path)
        for k, v in fields.items():
            setattr(self, k, v)

    # ---- saving -----------------------------------------------------------------------------------

    def _consensus(self):
        """Collective over the wrapper's group: this rank's model and optimizer state dicts with
        every floating-point tensor replaced by its average over the ranks (one allreduce per
        dtype). Integer tensors and the optimizers' step counts stay this rank's."""
        from . import collectives

        if hasattr(self._algorithm, "synchronize"):
            self._algorithm.synchronize(self.model)  # no exchange may still write the replicas
        model_sd = self._module.state_dict()
        opt_sd = self.optimizer.state_dict()
        slots = [(model_sd, k) for k in model_sd]
        slots += [(st, k) for st in opt_sd["state"].values() for k in st if k != "step"]
        by_dtype = {}
        for d, k in slots:
            v = d[k]
            if torch.is_tensor(v) and v.is_floating_point() and v.numel() > 0:
                by_dtype.setdefault(v.dtype, []).append((d, k))
        for dtype in sorted(by_dtype, key=str):  # the same order on every rank
            entries = by_dtype[dtype]
            flat = torch.cat([d[k].detach().reshape(-1) for d, k in entries])
            avg = collectives.allreduce(flat, collectives.ReduceOp.AVG, self.model.group)
            off = 0
            for d, k in entries:
                n = d[k].numel()
                d[k] = avg[off:off + n].view_as(d[k]).clone()
                off += n
        return model_sd, opt_sd

    def _payload(self, consensus=None) -> bytes:
        model_sd, opt_sd = consensus if consensus is not None else \
            (self._module.state_dict(), self.optimizer.state_dict())
        snap = {
            "step": int(self.step),
            "model": model_sd,
            "optimizer": opt_sd,
            "fields": {k: getattr(self, k) for k in self._fields},
        }
        if self.sampler is not None:
            snap["sampler"] = self.sampler.state_dict() if hasattr(self.sampler, "state_dict") else None
            snap["sampler_epoch"] = getattr(self.sampler, "epoch", None)
        if self._algorithm is not None and hasattr(self._algorithm, "elastic_state_dict"):
            snap["algorithm"] = self._algorithm.elastic_state_dict()
        buf = io.BytesIO()
        torch.save(snap, buf)  # tensors are copied to the buffer: later steps do not change it
        return buf.getvalue()

    def commit(self) -> None:
        """Makes the current state the one a restart continues from. Every rank calls it at the
        same step; the host's first rank keeps it in memory (/dev/shm), rank 0 also on disk when
        the State has a path."""
        from . import _runtime

        writer = not _runtime.is_initialized() or _runtime.local_rank() == 0
        to_disk = self.path is not None and (not _runtime.is_initialized() or _runtime.rank() == 0)
        consensus = None
        if getattr(self._algorithm, "elastic_consensus", False):
            consensus = self._consensus()  # every rank takes part, writer or not
        if not (writer or to_disk):
            return
        payload = self._payload(consensus)
        if writer:
            _write_atomic(_snapshot_file(), int(self.step), payload)
        if to_disk:
            _write_atomic(self.path, int(self.step), payload)

    # ---- restoring --------------------------------------------------------------------------------

    def restore(self) -> Optional[int]:
        """Collective: continues from the newest commit any rank sees (its host's memory, else the
        path on disk), broadcast from the lowest rank that has it. Returns the step, or None when
        there is no commit (a fresh start)."""
        from . import _runtime, collectives

        n, r = _runtime.size(), _runtime.rank()
        mine = _read_step(_snapshot_file())
        on_disk = _read_step(self.path) if self.path is not None and r == 0 else -1
        best = collectives.allreduce(torch.tensor([mine, on_disk], dtype=torch.int64), collectives.ReduceOp.MAX)
        newest, disk = int(best[0]), int(best[1])
        from_disk = newest < 0 <= disk
        if newest < 0 and not from_disk:
            self._reshard_sampler()
            return None
        if from_disk:
            src = 0
        else:
            cand = torch.tensor([r if mine == newest else n], dtype=torch.int64)
            src = int(collectives.allreduce(cand, collectives.ReduceOp.MIN)[0])
        if r == src:
            raw = _read_payload(self.path if from_disk else _snapshot_file())
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            length = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        collectives.broadcast_(length, src)
        if r != src:
            data = torch.empty(int(length[0]), dtype=torch.uint8)
        collectives.broadcast_(data, src)
        raw = data.numpy().tobytes()
        snap = torch.load(io.BytesIO(raw), weights_only=False)
        self._apply(snap)
        # A host that had no (or an older) commit holds the restored one from now on.
        if mine != int(snap["step"]) and _runtime.local_rank() == 0:
            _write_atomic(_snapshot_file(), int(snap["step"]), raw)
        self.restored_step = int(snap["step"])
        self.restored_from = -1 if from_disk else src
        return self.restored_step

    def _apply(self, snap) -> None:
        if hasattr(self._algorithm, "elastic_before_load"):
            self._algorithm.elastic_before_load()  # e.g. a background thread reading the weights
        self._module.load_state_dict(snap["model"])
        _load_optimizer(self.optimizer, snap["optimizer"])
        for k, v in snap["fields"].items():
            setattr(self, k, v)
        self.step = int(snap["step"])
        if self.sampler is not None:
            if snap.get("sampler") is not None and hasattr(self.sampler, "load_state_dict"):
                self.sampler.load_state_dict(snap["sampler"])
            if snap.get("sampler_epoch") is not None and hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(snap["sampler_epoch"])
        self._reshard_sampler()
        if "algorithm" in snap:
            self._algorithm.load_elastic_state_dict(snap["algorithm"])

    def _reshard_sampler(self) -> None:
        from . import _runtime

        if self.sampler is not None:
            _reshard(self.sampler, _runtime.size(), _runtime.rank())

    def _finish(self) -> None:
        from . import _runtime, collectives

        collectives.barrier()  # nobody may still need a commit
        if _runtime.local_rank() == 0:
            try:
                os.unlink(_snapshot_file())
            except OSError:
                pass


def _load_optimizer(optimizer, sd) -> None:
    """load_state_dict, but into the existing state tensors where there are some: the
    optimizer's state may be views that others hold (rumor's flat buckets)."""
    if not optimizer.state:
        optimizer.load_state_dict(sd)
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = sd["state"]
    for i, p in enumerate(params):
        cur, new = optimizer.state.get(p), saved.get(i)
        if cur is None or new is None or set(cur) != set(new):
            optimizer.load_state_dict(sd)
            return
    for i, p in enumerate(params):
        for k, v in saved[i].items():
            cur = optimizer.state[p][k]
            if torch.is_tensor(cur) and torch.is_tensor(v) and cur.shape == v.shape:
                cur.copy_(v)
            else:
                optimizer.state[p][k] = v
    for g, sg in zip(optimizer.param_groups, sd["param_groups"]):
        for k, v in sg.items():
            if k != "params":
                g[k] = v


def run(train_fn: Optional[Callable] = None, state: Optional[State] = None):
    """``run(train_fn, state)`` restores ``state`` (see State.restore), calls ``train_fn(state)``
    and, when it returns, drops the job's commits. As a decorator, ``@rumor.elastic.run`` makes
    ``train_fn(state, ...)`` do the same. rumor.init() must have been called."""
    if train_fn is None or not callable(train_fn):
        raise TypeError("rumor.elastic.run: train_fn must be a callable taking the State")

    @functools.wraps(train_fn)
    def wrapper(st: State, *args, **kwargs):
        from . import _runtime

        if not isinstance(st, State):
            raise TypeError(f"rumor.elastic.run: the first argument must be a rumor.elastic.State, "
                            f"got {type(st).__name__}")
        if not _runtime.is_initialized():
            raise RuntimeError("rumor.elastic.run: call rumor.init() first")
        st.restore()
        out = train_fn(st, *args, **kwargs)
        st._finish()
        return out

    if state is not None:
        return wrapper(state)
    return wrapper
