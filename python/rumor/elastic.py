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
the surviving ranks" must outlive the worker processes. A commit is a file in this user's
private directory (rumor._secret.private_dir(): /dev/shm/rumor-<uid>, tmpfs: memory, not disk,
mode 0700), one per job, host and launcher agent, written by the host's first rank with mode
0600 under a fresh O_EXCL|O_NOFOLLOW temporary name and an atomic rename, so a worker killed
mid-write leaves the previous commit intact and nothing another user planted is followed. This
needs no keeper process that could itself die or leak and costs one copy of the state per host;
a finished run() removes the files, the launcher (rumor.run) removes its own when the job ends,
and any later rumor.init() or launcher on the host sweeps those whose agent has exited.
``path=`` additionally writes each commit to disk (rank 0), used only when no host has one in
memory (a job restarted from scratch).

What a commit is. A header (magic, step), an HMAC-SHA256 keyed by the job secret
(rumor._runtime.job_secret().key("elastic-commit")) over header and payload, and the payload: a
torch.save of the state, loaded with torch.load(weights_only=True) only after the MAC was
checked, on every rank after the broadcast too. So the user fields, the sampler's and the
algorithm's state must be tensors and plain values (numbers, str, bytes, lists, tuples, dicts,
sets); commit() refuses anything else, naming the field. Types known to be safe can be allowed
with torch.serialization.add_safe_globals([MyType]) (in every process, before the restore).
"""
from __future__ import annotations

import collections
import errno
import functools
import hashlib
import io
import json
import math
import operator
import os
import struct
import time
import warnings
from typing import Any, Callable, Optional, Tuple

import torch

from . import _live, _secret, timeline
from ._parity import Mismatch, ParityError, ParityReport, verify

_PREFIX = "rumor_elastic-"  # not a swept rumor- name: commits must outlive their writer
_HEADER = struct.Struct("<8sq")  # magic, committed step
# "RUMORELM": header, MAC, payload. (The unMACed "RUMORELS" files of earlier versions are never
# read: their magic differs, and they lived in /dev/shm itself, where nothing looks any more.)
_MAGIC = b"RUMORELM"
_TAG = 32  # HMAC-SHA256
_RESERVED = ("model", "optimizer", "sampler", "step", "path", "verify", "verified", "replicas")
_MAC_LABEL = "elastic-commit"


class CommitRefused(RuntimeError):
    """A commit that rumor.elastic will not load: altered or written under another job secret
    (MAC mismatch), malformed, not private to this user, or holding what weights_only refuses."""


def snapshot_dir() -> str:
    """The directory of this host's in-memory commits: this user's private directory."""
    return _secret.private_dir()


def _key() -> bytes:
    from . import _runtime

    return _runtime.job_secret().key(_MAC_LABEL)


def _job() -> str:
    run_id = os.environ.get("RUMOR_ELASTIC_JOB") or os.environ.get("TORCHELASTIC_RUN_ID") or "none"
    return hashlib.sha1(run_id.encode()).hexdigest()[:12]


def _snapshot_file() -> str:
    """This host's commit file. Besides the run id (torchrun's default, "none", is shared by
    every job that does not set --rdzv-id) it names the launcher's agent, the workers' parent,
    which outlives its workers' restarts but not the job: a later job never continues from an
    earlier one's commit, and a sweep (rumor._shm) removes the file once the agent is gone."""
    from . import _rendezvous, _shm

    host = hashlib.sha1(_rendezvous.host_id().encode()).hexdigest()[:12]
    return os.path.join(snapshot_dir(), f"{_PREFIX}{_job()}-{host}@{_shm._pid_namespace()}.{os.getppid()}")


def _commit_name(name: str) -> Optional[str]:
    """The commit a name in the private directory belongs to (itself, or the commit a temporary
    file was going to replace), or None for names that are not elastic commits."""
    from . import _shm

    m = _shm.TMP_NAME.match(name)
    base = m.group(1) if m else name
    return base if base.startswith(_PREFIX) else None


def remove_snapshots(run_id: str, agent_pid: int) -> None:
    """Removes the in-memory commits of a run's agent on this host (the launcher, at its end),
    with any temporary file a killed writer left. Files that cannot be removed, or a private
    directory that does not exist, are left alone without an error.

    Args:
        run_id: the rendezvous run id of the job whose commits are removed.
        agent_pid: the pid of the launcher agent that owned them (commits are named per agent).
    """
    from . import _shm

    job = hashlib.sha1(run_id.encode()).hexdigest()[:12]
    try:
        d = _secret.private_dir(create=False)
        names = os.listdir(d)
    except OSError:  # no private directory (nothing was committed), or not ours: nothing to do
        return
    for n in names:
        base = _commit_name(n)
        if base and base.startswith(f"{_PREFIX}{job}-") and base.endswith(f"@{_shm._pid_namespace()}.{agent_pid}"):
            try:
                os.unlink(os.path.join(d, n))
            except OSError:
                pass


def _seal(step: int, payload: bytes, key: bytes) -> Tuple[bytes, bytes]:
    header = _HEADER.pack(_MAGIC, step)
    return header, _secret.mac(key, header, payload)


def _write_commit(path: str, step: int, payload: bytes, key: bytes) -> None:
    header, tag = _seal(step, payload, key)
    _secret.write_private(path, header, tag, payload)


def _open_commit(raw, key: bytes, where: str) -> Tuple[int, memoryview]:
    """(step, payload) of a commit's bytes, after checking its magic and its MAC. Nothing of the
    payload is parsed before the MAC matched."""
    raw = memoryview(raw)
    if len(raw) < _HEADER.size + _TAG:
        raise CommitRefused(f"rumor.elastic: {where} is not a commit ({len(raw)} bytes)")
    header = bytes(raw[:_HEADER.size])
    magic, step = _HEADER.unpack(header)
    if magic != _MAGIC:
        raise CommitRefused(f"rumor.elastic: {where} is not a commit of this rumor version (magic {magic!r})")
    tag, payload = bytes(raw[_HEADER.size:_HEADER.size + _TAG]), raw[_HEADER.size + _TAG:]
    if not _secret.mac_ok(key, tag, header, payload):
        raise CommitRefused(
            f"rumor.elastic: {where} fails its MAC check: it was altered, or written by a job with another "
            f"job secret ({_secret.SECRET_ENV}); refusing to load it. Remove it to start without it, or run "
            "with the job secret that wrote it")
    if step < 0:
        raise CommitRefused(f"rumor.elastic: {where} has a negative step {step}")
    return step, payload


def _read_local(path: str, key: bytes) -> Optional[Tuple[int, bytes]]:
    """This host's commit, (step, its bytes), or None when there is none. Raises
    UntrustedFileError for a file not private to this user, CommitRefused for a bad MAC."""
    try:
        raw = _secret.read_private(path)
    except FileNotFoundError:
        return None
    step, _ = _open_commit(raw, key, path)
    return step, raw


def _read_disk(path: str, key: bytes) -> Optional[Tuple[int, bytes]]:
    """The path= copy: like _read_local, but a disk file may be readable by others (it is MACed,
    not secret); it must be a regular file (not a symlink) owned by this user that nobody else
    can write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _secret.UntrustedFileError(f"rumor.elastic: refusing to read {path}: it is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        # MACed, not secret: others may read it, nobody else may write it.
        why = _secret.untrusted_why(os.fstat(fd), forbid=0o022)
        if why:
            raise _secret.UntrustedFileError(f"rumor.elastic: refusing to read the commit {path}: it {why}")
        raw = f.read()
    step, _ = _open_commit(raw, key, path)
    return step, raw


# ---- what torch.load(weights_only=True) can restore ---------------------------------------------

_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Size, torch.dtype, torch.device)
_CONTAINERS = (list, tuple, set, dict, collections.OrderedDict)


def _safe_types() -> set:
    out = {torch.Tensor, torch.nn.Parameter}
    for g in torch.serialization.get_safe_globals():
        g = g[0] if isinstance(g, tuple) else g
        if isinstance(g, type):
            out.add(g)
    return out


def _check_loadable(value, where: str, safe: set, depth: int = 0) -> None:
    """Raises TypeError, naming where, for a value torch.load(weights_only=True) would refuse.
    Exact types: a subclass (an IntEnum, a numpy float64, a namedtuple) pickles by its own class,
    which weights_only refuses."""
    t = type(value)
    if t in _PLAIN or t in safe:
        return
    if depth > 100:
        raise TypeError(f"rumor.elastic.State.commit: {where} is nested more than 100 deep")
    if t in (list, tuple, set):
        for i, v in enumerate(value):
            _check_loadable(v, f"{where}[{i}]", safe, depth + 1)
        return
    if t in (dict, collections.OrderedDict):
        for k, v in value.items():
            _check_loadable(k, f"{where} (a key)", safe, depth + 1)
            _check_loadable(v, f"{where}[{k!r}]", safe, depth + 1)
        return
    raise TypeError(
        f"rumor.elastic.State.commit: {where} is a {t.__module__}.{t.__qualname__}, which a restore cannot "
        "load: commits are loaded with torch.load(weights_only=True), which takes tensors and plain values "
        "(None, bool, int, float, complex, str, bytes, list, tuple, set, dict). Store it as such, or, if "
        f"the type is safe to rebuild from a commit, call torch.serialization.add_safe_globals([{t.__qualname__}]) "
        "in every process before the commit and the restore")


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
    wrapper), the optimizer, an optional sampler, ``step`` (``State(..., step=100)`` starts the
    count there, as Horovod's ``TorchState(model, optimizer, step=100)`` does; a restore replaces
    it with the committed step), and any user fields (``State(...,
    epoch=0, best=inf)`` gives ``state.epoch``, ``state.best``): tensors and plain values
    (numbers, str, bytes, lists, tuples, sets, dicts), what torch.load(weights_only=True) loads;
    commit() refuses others unless registered with torch.serialization.add_safe_globals.

    The state must be the same on every rank at a commit (data parallel training with
    GradientAllReduce and the compressed allreduces: ByteGrad, QSGD, LowPrecision), or the
    algorithm says how to make it so: those whose ranks hold different replicas (Decentralized,
    LowPrecisionDecentralized, AsyncModelAverage) set ``elastic_consensus``, and a commit then
    saves the average of every rank's weights and optimizer state (a collective; the restarted
    job, whatever its size, starts from that consensus point). Algorithms with state of their
    own implement ``elastic_state_dict()`` / ``load_elastic_state_dict()``; others are refused.

    Args:
        model: the torch.nn.Module trained, or its DistributedDataParallel wrapper (whose
            algorithm decides how a commit is made consistent, see above).
        optimizer: the torch.optim.Optimizer stepping the model.
        sampler: optional (default None); a sampler with set_epoch() or state_dict() (torch's
            DistributedSampler, rumor.data's samplers) whose position is committed and which is
            resharded for the restarted world.
        path: optional file (default None): rank 0 also writes every commit there, and a job
            restarted from scratch (no commit in any host's memory) continues from it.
        verify: if True (the default), every restore that loaded a commit ends with
            rumor.elastic.verify() over the model, the optimizer, ``step`` and the user fields
            that are tensors or plain values (digests only: two small allgathers and a hash of
            the state), so each restart proves the replicas equal; what differs is repaired
            from the majority with a RuntimeWarning, or raises ParityError. ``state.verified``
            holds the last ParityReport. False skips it.
        replicas: ``"auto"`` (the default): a wrapper's algorithm says whether the ranks' replicas
            differ, and a plain module's are the same everywhere. ``"differ"``: a plain module
            whose replicas legitimately differ, trained with rumor's neighbor ops or windows
            directly (BlueFog style); a commit then saves the average of every rank's weights and
            optimizer state, under live membership every change starts the new world from the
            average of the replicas of the members that applied the most steps (newcomers
            included), and verification compares what must agree (shapes, step counts,
            hyperparameters), not the weights. ``"identical"`` compares everything.
        **fields: user fields, set as attributes (``state.epoch``) and committed with the rest.

    Raises:
        TypeError: model, optimizer or sampler is of the wrong kind.
        ValueError: a field name is reserved (a name State itself uses, or one starting
            with _), or replicas is not one of the three, or not "auto" with a wrapper (whose
            algorithm decides).
        NotImplementedError: the wrapper's algorithm keeps state a restart would lose and
            implements no elastic_state_dict()/load_elastic_state_dict().
    """

    def __init__(self, model, optimizer, sampler=None, *, path: Optional[str] = None, step: int = 0,
                 verify: bool = True, replicas: str = "auto", **fields: Any):
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
        # bool is an int, but State(step=True) is a mistake, not step 1; numpy and torch integer
        # scalars (a counter read back from a checkpoint) are fine.
        try:
            start = operator.index(step) if not isinstance(step, bool) else None
        except TypeError:
            start = None
        if start is None:
            raise TypeError(f"rumor.elastic.State: step must be an int (the starting step), got {step!r}")
        if start < 0:
            raise ValueError(f"rumor.elastic.State: step must be >= 0 (the starting step), got {start}")
        module, algorithm = _unwrap(model)
        if replicas not in ("auto", "identical", "differ"):
            raise ValueError(f"rumor.elastic.State: replicas must be 'auto', 'identical' or 'differ', got {replicas!r}")
        if replicas != "auto" and module is not model:
            raise ValueError("rumor.elastic.State: replicas applies to a plain module; a DistributedDataParallel "
                             "wrapper's algorithm says whether its replicas differ (leave replicas='auto')")
        self._replicas = replicas
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
        self.step = start
        self._fields = list(fields)
        self.restored_step: Optional[int] = None  # the commit run() continued from, if any
        self.restored_from: Optional[int] = None  # the rank that sent it (-1: read from path)
        self._verify = bool(verify)
        self.verified: Optional[ParityReport] = None  # the check that ended the last restore
        for k, v in fields.items():
            setattr(self, k, v)

    # ---- saving -----------------------------------------------------------------------------------

    def _consensus(self, weight: Optional[float] = None):
        """Collective over the wrapper's group: this rank's model and optimizer state dicts with
        every floating-point tensor replaced by its average over the ranks (one allreduce per
        dtype). Integer tensors and the optimizers' step counts stay this rank's. With weight,
        the average counts each rank's state with its weight (live membership: 0 for a copy)."""
        from . import collectives

        group = getattr(self.model, "group", None)  # a plain module's: the world
        total = None
        if weight is not None:
            w = torch.tensor([float(weight)], dtype=torch.float64)
            total = float(collectives.allreduce(w, collectives.ReduceOp.SUM, group)[0])

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
            if total is None:
                avg = collectives.allreduce(flat, collectives.ReduceOp.AVG, group)
            else:
                avg = collectives.allreduce(flat * weight, collectives.ReduceOp.SUM, group) / total
            off = 0
            for d, k in entries:
                n = d[k].numel()
                d[k] = avg[off:off + n].view_as(d[k]).clone()
                off += n
        return model_sd, opt_sd

    def _differ(self) -> bool:
        """Whether the ranks' replicas legitimately differ (a commit saves their average)."""
        if self._algorithm is None:
            return self._replicas == "differ"
        return getattr(self._algorithm, "elastic_consensus", False)

    def _live_average(self) -> bool:
        """Whether a live membership change starts the new world from the replicas' average:
        algorithms whose replicas differ step by step, and plain modules with replicas="differ"."""
        if self._algorithm is None:
            return self._replicas == "differ"
        return getattr(self._algorithm, "elastic_consensus", False) and getattr(self._algorithm, "elastic_live", False)

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
        # Refused here, at the commit, not at a restore after a crash when nothing can be fixed.
        # (The user fields were checked on every rank by commit().)
        safe = _safe_types()
        for k, what in (("model", "the model's state_dict()"), ("optimizer", "the optimizer's state_dict()"),
                        ("sampler", "the sampler's state_dict()"), ("sampler_epoch", "the sampler's epoch"),
                        ("algorithm", f"{type(self._algorithm).__name__}.elastic_state_dict()")):
            if k in snap:
                _check_loadable(snap[k], what, safe)
        buf = io.BytesIO()
        torch.save(snap, buf)  # tensors are copied to the buffer: later steps do not change it
        return buf.getvalue()

    def commit(self) -> None:
        """Makes the current state the one a restart continues from. Every rank calls it at the
        same step; the host's first rank keeps it in memory (this user's private directory in
        /dev/shm), rank 0 also on disk when the State has a path. Raises TypeError, naming the
        field, when a field (or the sampler's or the algorithm's state) is not what
        torch.load(weights_only=True) can restore."""
        from . import _runtime

        # The user fields on every rank, writer or not: a field weights_only cannot load makes
        # every rank raise here, not the writers alone while the others train on.
        safe = _safe_types()
        for k in self._fields:
            _check_loadable(getattr(self, k), f"field {k!r}", safe)
        writer = not _runtime.is_initialized() or _runtime.local_rank() == 0
        to_disk = self.path is not None and (not _runtime.is_initialized() or _runtime.rank() == 0)
        consensus = None
        if self._differ():
            consensus = self._consensus()  # every rank takes part, writer or not
        if not (writer or to_disk):
            return
        payload = self._payload(consensus)
        key = _key()
        if writer:
            _write_commit(_snapshot_file(), int(self.step), payload, key)
        if to_disk:
            _write_commit(self.path, int(self.step), payload, key)

    # ---- restoring --------------------------------------------------------------------------------

    def restore(self) -> Optional[int]:
        """Collective: continues from the newest commit any rank sees (its host's memory, else the
        path on disk), broadcast from the lowest rank that has it. Returns the step, or None when
        there is no commit (a fresh start). Every rank checks the commit's MAC before loading
        it; a commit some rank refuses (not private, altered, another job's secret) makes every
        rank raise CommitRefused (or UntrustedFileError), none waits for the others. Unless the
        State was made with verify=False, a restore that loaded a commit ends with
        rumor.elastic.verify() (see State), which may raise ParityError."""
        from . import _rendezvous, _runtime, collectives

        n, r = _runtime.size(), _runtime.rank()
        key = _key()
        # Each rank reads (and checks) what it has; the refusals travel with the steps, so that
        # one rank's error is every rank's, not a rank raising while the others wait for it.
        local = disk = None
        local_err = disk_err = None
        try:
            local = _read_local(_snapshot_file(), key)
        except (CommitRefused, OSError) as e:  # UntrustedFileError is a PermissionError
            local_err = e
        if self.path is not None and r == 0:
            try:
                disk = _read_disk(self.path, key)
            except (CommitRefused, OSError) as e:
                disk_err = e
        mine = local[0] if local else -1
        _rendezvous.fault_point("elastic:restore")  # tests: a death inside the job's first restore
        info = torch.full([3 + n], -1, dtype=torch.int64)
        info[0], info[1] = mine, disk[0] if disk else -1
        info[2] = 1 if disk_err is not None else 0
        info[3 + r] = 1 if local_err is not None else 0
        info = collectives.allreduce(info, collectives.ReduceOp.MAX)
        newest, disk_step, disk_bad = int(info[0]), int(info[1]), bool(info[2] > 0)
        refused = [i for i in range(n) if info[3 + i] > 0]
        if refused:
            if local_err is not None:
                raise local_err
            raise CommitRefused(f"rumor.elastic: rank(s) {refused} refused their host's commit (see their "
                                "error); no rank continues from an untrusted commit")
        from_disk = newest < 0 <= disk_step
        if newest < 0 and disk_bad:  # the disk copy would have been the one: its refusal stops the job
            if disk_err is not None:
                raise disk_err
            raise CommitRefused(f"rumor.elastic: rank 0 refused the commit at {self.path} (see its error)")
        if disk_err is not None:
            warnings.warn(f"{disk_err} (not needed: a newer commit is in memory)", RuntimeWarning, stacklevel=2)
        if newest < 0 and not from_disk:
            self._reshard_sampler()
            return None
        if from_disk:
            src = 0
        else:
            cand = torch.tensor([r if mine == newest else n], dtype=torch.int64)
            src = int(collectives.allreduce(cand, collectives.ReduceOp.MIN)[0])
        if r == src:
            raw = (disk if from_disk else local)[1]
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            length = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        collectives.broadcast_(length, src)
        if r != src:
            data = torch.empty(int(length[0]), dtype=torch.uint8)
        collectives.broadcast_(data, src)
        raw = data.numpy().tobytes()
        # The MAC again on every rank: what arrived is what the sender checked, and the payload
        # reaches torch.load (weights_only) only after that.
        snap, err = None, None
        try:
            step, payload = _open_commit(raw, key, f"the commit received from rank {src}")
            try:
                snap = torch.load(io.BytesIO(payload), weights_only=True)
            except Exception as e:  # pickle.UnpicklingError and what a bad archive raises
                raise CommitRefused(
                    f"rumor.elastic: the commit of step {step} does not load with torch.load(weights_only=True): "
                    f"{e}. A type it holds must be registered with torch.serialization.add_safe_globals "
                    "in every process before the restore") from e
            if not isinstance(snap, dict) or snap.get("step") != step:
                raise CommitRefused(f"rumor.elastic: the commit of step {step} is malformed")
        except CommitRefused as e:
            err = e
        bad = torch.zeros(n, dtype=torch.int64)
        bad[r] = 1 if err is not None else 0
        bad = collectives.allreduce(bad, collectives.ReduceOp.MAX)
        if err is not None:
            raise err
        if bool(bad.any()):
            raise CommitRefused(f"rumor.elastic: rank(s) {bad.nonzero().flatten().tolist()} refused the commit "
                                f"received from rank {src} (see their error)")
        self._apply(snap)
        # A host that had no (or an older) commit holds the restored one from now on.
        if mine != step and _runtime.local_rank() == 0:
            _secret.write_private(_snapshot_file(), raw)
        self.restored_step = step
        self.restored_from = -1 if from_disk else src
        if self._verify:
            self._verify_restored()
        return self.restored_step

    def _verify_restored(self) -> None:
        """Every rank loaded the same bytes; this proves it of what they now hold (a load that
        silently kept a rank's old tensor, a user field set per rank after the load)."""
        from ._parity import comparable

        extra = {"step": int(self.step)}
        for k in self._fields:
            v = getattr(self, k)
            if comparable(v):
                extra[f"field.{k}"] = v
        report = verify(self.model, self.optimizer, extra=extra, repair=True, replicas=self._replicas)
        if report.repaired:
            warnings.warn(f"rumor.elastic: after the restore of step {self.step} the replicas differed; "
                          f"repaired from the majority: {report}", RuntimeWarning, stacklevel=3)
        self.verified = report

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

    # ---- live membership ------------------------------------------------------------------------

    def _live_sync(self) -> None:
        """After a membership change (collective over the new world): when some member is behind
        (it failed a step others applied) or newcomers came, the source (a member that applied
        the most steps) sends its whole state by broadcast, at link speed; then every member
        proves it holds the same state (verify, repaired from the majority)."""
        from . import _live, _rendezvous, _runtime, collectives

        live = _live.current()
        copy = live.behind  # this member's state is about to be the source's (a newcomer's too)
        if live.sync:
            src = live.source
            if _runtime.rank() == src:
                data = torch.frombuffer(bytearray(self._payload()), dtype=torch.uint8)
                length = torch.tensor([data.numel()], dtype=torch.int64)
            else:
                length = torch.zeros(1, dtype=torch.int64)
            # An allreduce rather than a broadcast: nobody leaves it before every member entered,
            # so the broadcast that follows starts together and its time is the transfer's alone.
            collectives.allreduce_(length, collectives.ReduceOp.MAX)
            _rendezvous.fault_point("live:transfer", live.epoch)  # tests: a death mid-transfer
            if _runtime.rank() != src:
                data = torch.empty(int(length[0]), dtype=torch.uint8)
            t = time.monotonic()
            collectives.broadcast_(data, src)
            # What the state's broadcast took, for the log and benchmarks/elastic.py.
            live.transfer = (data.numel(), time.monotonic() - t)
            if live.behind:
                _live.log_transfer(live, src)
            if live.behind:
                self._apply(torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True))
            else:
                self._reshard_sampler()
        else:
            self._reshard_sampler()
        live.joined_fresh = live.behind = live.unsynced = False
        live.applied = live.target
        alg = self._algorithm
        if self._live_average():
            # Replicas that differ: the epoch starts from the average of those of the members
            # that applied the most steps, each counted once (not the copies just sent).
            model_sd, opt_sd = self._consensus(0.0 if copy else 1.0)
            self._module.load_state_dict(model_sd)
            _load_optimizer(self.optimizer, opt_sd)
            if hasattr(alg, "load_elastic_state_dict"):  # what it derives from the weights starts over from these
                alg.load_elastic_state_dict(alg.elastic_state_dict())
        self._verify_restored()
        from .neighbor.ops import check_topologies_agree

        check_topologies_agree("rumor.elastic (a change of live membership)")

    def _live_rebind(self) -> None:
        from .parallel import DistributedDataParallel

        if isinstance(self.model, DistributedDataParallel):
            try:
                # Built again without broadcasting rank 0's weights: each replica reaches the
                # transfer and the average that follow (_live_sync) as it is.
                self.model._live_rebind()
            except ValueError as e:
                # A newcomer whose model differs: refused (it raises the same error itself), and
                # the members re-form without it.
                if not getattr(e, "ranks_differing", None) or not _live.refuse_ranks(e.ranks_differing, str(e)):
                    raise
                raise _live.LiveRestart(f"rumor.elastic: newcomer(s) refused: {e}") from e
        self._live_sync()

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
        if _live.current() is not None:
            return _run_live(train_fn, st, args, kwargs)
        st.restore()
        out = train_fn(st, *args, **kwargs)
        st._finish()
        return out

    if state is not None:
        return wrapper(state)
    return wrapper

def _run_live(train_fn, st: State, args, kwargs):
    """run() under rumor-run --live: when a member fails (or newcomers wait) the step in flight
    is given up, the job re-forms in these same processes from the state of the member that
    applied the most steps, and train_fn is called again from there."""
    if getattr(st.model, "overlap_optimizer", False):
        raise ValueError("rumor.elastic: live membership counts the steps each member applied in optimizer.step(); "
                         "overlap_optimizer=True applies them during backward, so it cannot be used live")
    alg = st._algorithm
    step_wise = getattr(alg, "elastic_live", False)
    rounds = getattr(alg, "elastic_live_rounds", False)
    quiet = step_wise and getattr(alg, "elastic_live_quiet", False)
    if alg is not None and not getattr(alg, "elastic_replicated", False) and not step_wise and not rounds:
        raise NotImplementedError(
            f"rumor.elastic: live membership runs the algorithms of docs/elastic.md's table (every one of "
            f"rumor.algorithms but Decentralized over a fixed topology); this {type(alg).__name__} is not one: "
            f"run it without --live (restarts from commits)")
    live = _live.current()
    fresh = live.joined_fresh
    kept = []  # rounds: the State's bytes at the start of the round, and the steps applied then
    # A plain module whose replicas differ (neighbor ops or windows used directly) may have had
    # its weights mixed in place by the step given up: each member keeps them per applied step.
    own = alg is None and st._replicas == "differ"

    def mark():
        """What undoes the step (the round) in flight: elastic_live algorithms keep their own state
        of the last applied step; with rounds, the whole State at the round's start is kept; a
        plain module whose replicas differ keeps its weights of the last applied step."""
        if step_wise:
            alg.elastic_live_mark()
        elif rounds:
            kept[:] = [st._payload(), live.applied]
        elif own:
            kept[:] = [{k: v.detach().clone() for k, v in st._module.state_dict().items()}]

    def undo():
        if step_wise:
            alg.elastic_live_undo()
        elif rounds and kept and not alg.elastic_live_at_boundary():  # between rounds nothing is given up
            st._apply(torch.load(io.BytesIO(kept[0]), weights_only=True))
            live.applied = kept[1]
        elif own and kept:
            st._module.load_state_dict(kept[0])

    def before_step(*_):
        if rounds:
            if not alg.elastic_live_at_boundary():
                return  # inside a round the ranks train alone: newcomers wait for its end
            mark()
        _live.before_step(quiet)

    def applied(*_):
        _live.after_step()
        if step_wise or own:
            mark()

    live.restoring = not fresh  # a newcomer receives the state the members restored
    mark()

    def install():
        return (st.optimizer.register_step_pre_hook(before_step), st.optimizer.register_step_post_hook(applied))

    hooks = install()
    ended = None  # why the last epoch ended, while the next one is being formed
    cut = getattr(st.model, "_construction_cut", None)
    if cut is not None and not fresh:
        # A member died while the wrapper was built: its weights broadcast may not have reached
        # every replica, so the job re-forms first and the source's state goes to all.
        live.unsynced = True
        ended = f"a member failed while the DDP wrapper was built: {cut}"
    try:
        while True:
            try:
                if fresh:  # a newcomer: the survivors send the state from their re-forming
                    fresh = live.joined_fresh = False  # from here a failure re-forms, as on the members
                    st._live_sync()
                    mark()
                    _mark_change(_live.Change(epoch=live.epoch, size=len(live.members),
                                              rank=live.members.index(live.me), left=[], joined=list(live.new),
                                              reason="admitted", degraded_s=0.0))
                elif ended is not None:
                    change = _live.reform(ended)
                    ended = None
                    st._live_rebind()  # a failure in here ends that epoch too, and the loop goes again
                    for h in hooks:  # again after the rebuilt wrapper's: a mark sees the algorithm's after_step
                        h.remove()
                    hooks = install()
                    live.restoring = live.restore_again
                    mark()
                    _mark_change(change)
                    _live.notify(change)
                if live.restoring:  # the job's first restore (again, by every member, if a failure cut it)
                    st.restore()
                    live.restoring = False
                    mark()
                out = train_fn(st, *args, **kwargs)
                st._finish()
                break
            except Exception as e:
                if not _live.is_membership_failure(e):
                    raise
                ended = f"{type(e).__name__}: {e}"
                undo()  # before the wrapper is built again: the step (round) in flight is redone from the mark
    finally:
        for h in hooks:
            h.remove()
    _live.finish()
    return out


def _mark_change(change) -> None:
    """The change as the first event of the epoch's timeline (RUMOR_TIMELINE), when one records.
    An event's args hold about 110 characters: past that, counts stand for the lists of ids (the
    log names them all, and the reason)."""
    args = dict(size=change.size, rank=change.rank, left=change.left, joined=change.joined,
                degraded_s=round(change.degraded_s, 4))
    if len(json.dumps(args)) > 100:
        args.update(left=len(change.left), joined=len(change.joined))
    timeline.instant(f"rumor.elastic: epoch {change.epoch}", **args)


def on_change(fn: Callable) -> None:
    """Under rumor-run --live, fn(change) runs on every member after each membership change,
    before training goes on: change.epoch, .size, .rank (this process's new rank), .left and
    .joined (member ids), .reason and .degraded_s (seconds without a group). Use it to rescale
    the learning rate or re-shard data of your own (State's sampler is re-sharded already)."""
    _live.on_change(fn)


def wait_for_members(n: int, timeout: float = 300.0) -> None:
    """Under rumor-run --live, inside the training function and at a step boundary (after
    ``state.step`` was advanced), on every member: when fewer than n members train, waits for
    newcomers (started by the launcher after failures) and re-forms the job with them; the
    training function is then called again from the same step. Returns at once with n members
    or more. Raises TimeoutError after timeout seconds without enough newcomers."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"rumor.elastic.wait_for_members: n must be an int >= 1, got {n!r}")
    _live.wait_for_members(n, float(timeout))


# The public names; everything else here is this module's own business.
__all__ = [
    "CommitRefused", "Mismatch", "ParityError", "ParityReport", "State", "on_change", "remove_snapshots", "run",
    "snapshot_dir", "verify", "wait_for_members",
]
