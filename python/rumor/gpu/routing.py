"""Where a collective's tensors go: rumor's CPU path or the GPU path (docs/gpu.md, "Routing").

A call whose tensors are all on the CPU takes the CPU path unchanged; this module then costs one
device check per tensor. A call whose tensors are all on this rank's CUDA device takes the GPU
path (rumor.gpu.collectives) over one of two transports:

- ``nccl``: rumor's NCCL communicator (rumor.gpu.nccl), one per group, ops on torch's current stream;
- ``host``: staging through page-locked host memory around rumor's CPU collectives.

``RUMOR_GPU_TRANSPORT`` = ``auto`` (default) | ``nccl`` | ``host`` chooses. Every rank of a
group must use the same transport (otherwise one rank waits in NCCL while another waits on TCP),
so the group agrees once, at its first CUDA collective, and keeps the choice on the Group.

The rank's device is the group's: ``torch.cuda.current_device()`` at the group's first CUDA call
(as for torch's DDP: call ``torch.cuda.set_device(local_rank)`` first), fixed from then on because
the NCCL communicator is bound to it.

All state lives on Group objects (``Group._gpu``), which live in rumor's runtime state.
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple

import torch

from .. import _runtime
from ..errors import CommTimeoutError, RumorError

TRANSPORT_ENV = "RUMOR_GPU_TRANSPORT"
TRANSPORTS = ("auto", "nccl", "host")
_SETTING_CODES = {name: i for i, name in enumerate(TRANSPORTS)}

CPU = "cpu"
CUDA = "cuda"

# The staging cache keeps at most this many free page-locked buffers per group, together at most
# this many bytes: enough for a training loop's few recurring sizes, small next to a GPU host's
# memory (pinned pages cannot be swapped). Sizes round up to powers of two from 64 KiB, so a
# buffer serves every call up to its size (at most 2x the bytes a call needs).
STAGING_CACHE_BUFFERS = 8
STAGING_CACHE_BYTES = 256 << 20
_STAGING_MIN_BYTES = 64 << 10

_HINT = ("call torch.cuda.set_device(rumor.local_rank()) before the group's first CUDA collective, "
         "as with torch's DistributedDataParallel")


def transport_setting(env=None) -> str:
    """RUMOR_GPU_TRANSPORT, validated: 'auto' (also when unset or empty), 'nccl' or 'host'."""
    env = os.environ if env is None else env
    raw = env.get(TRANSPORT_ENV)
    value = (raw or "").strip().lower() or "auto"
    if value not in _SETTING_CODES:
        raise ValueError(f"{TRANSPORT_ENV}={raw!r}: expected one of {', '.join(TRANSPORTS)}")
    return value


def decide(what: str, devices: Sequence[Tuple[str, object]], rank_device: Optional[int]) -> str:
    """CPU or CUDA for one call whose tensor arguments lie on `devices`, (argument name, device)
    pairs; rank_device is this rank's CUDA device index (None where it has none). Raises
    ValueError for a device type other than cpu/cuda, for CPU and CUDA tensors in one call and
    for a CUDA tensor on another device than the rank's."""
    devs = [(name, torch.device(d)) for name, d in devices]
    for name, d in devs:
        if d.type not in (CPU, CUDA):
            raise ValueError(f"{what}: {name} is on {d}; rumor's collectives take CPU or CUDA tensors")
    types = {d.type for _, d in devs}
    if types <= {CPU}:
        return CPU
    if len(types) > 1:
        where = ", ".join(f"{name} on {d}" for name, d in devs)
        raise ValueError(f"{what}: tensors on different devices ({where}); the tensors of one call must all be "
                         f"CPU tensors or all on this rank's CUDA device ({_device_name(rank_device)})")
    if rank_device is None:
        raise ValueError(f"{what}: {devs[0][0]} is on {devs[0][1]} but this process sees no CUDA device")
    for name, d in devs:
        index = rank_device if d.index is None else d.index
        if index != rank_device:
            raise ValueError(f"{what}: {name} is on cuda:{index} but this rank's device is cuda:{rank_device} "
                             f"(torch.cuda.current_device() at the group's first CUDA call; {_HINT})")
    return CUDA


def _device_name(index: Optional[int]) -> str:
    return "none" if index is None else f"cuda:{index}"


def agree(table: Sequence[Sequence[int]], hosts: Sequence[str], ranks: Sequence[int], me: int,
          local_problem: Optional[str], what: str) -> str:
    """The group's transport, 'nccl' or 'host', from every member's row (setting code, NCCL
    usable 0/1, CUDA device index), in group order; hosts[i] is member i's host id and ranks[i]
    its global rank. Every rank computes the same answer or raises the same error (a
    RumorError), naming the ranks at fault; local_problem is why NCCL is unusable on this rank
    (the loader's message), added to the text on this rank.

    Rules: all ranks must name the same setting; 'host' stages; 'auto' stages when no rank can
    use NCCL, or when two ranks share one GPU (NCCL refuses that); otherwise NCCL, which must
    then be usable on every rank ('auto' with NCCL on some ranks only is a misconfiguration,
    not a reason to run the slow path quietly)."""
    bad = [r for r, row in zip(ranks, table) if not 0 <= int(row[0]) < len(TRANSPORTS)]
    if bad:
        raise RumorError(f"{what}: rank(s) {bad} have an invalid {TRANSPORT_ENV} (expected one of "
                         f"{', '.join(TRANSPORTS)}); see their errors")
    settings = [TRANSPORTS[int(row[0])] for row in table]
    if len(set(settings)) > 1:
        by = ", ".join(f"rank {r}: {s}" for r, s in zip(ranks, settings))
        raise RumorError(f"{what}: the ranks disagree on {TRANSPORT_ENV} ({by}); set the same value on every rank")
    setting = settings[0]
    if setting == "host":
        return "host"
    missing = [r for r, row in zip(ranks, table) if not int(row[1])]
    seen, shared = {}, []
    for r, h, row in zip(ranks, hosts, table):
        key = (h, int(row[2]))
        if key in seen:
            shared.append((seen[key], r, int(row[2])))
        else:
            seen[key] = r
    if setting == "auto" and (len(missing) == len(ranks) or shared):
        return "host"
    if missing:
        here = f"; on this rank: {local_problem}" if local_problem and ranks[me] in missing else ""
        why = "chose nccl" if setting == "nccl" else "chose auto, and NCCL is usable on the other ranks"
        raise RumorError(f"{what}: {TRANSPORT_ENV} {why}, but NCCL is not usable on rank(s) {missing}{here}. "
                         f"Set {TRANSPORT_ENV}=host on every rank to stage CUDA tensors through host memory")
    if shared:
        a, b, dev = shared[0]
        raise RumorError(f"{what}: {TRANSPORT_ENV}=nccl, but ranks {a} and {b} both use cuda:{dev} of one host and "
                         f"NCCL runs one rank per GPU; {_HINT}, or set {TRANSPORT_ENV}=host")
    return "nccl"


def nccl_problem() -> Optional[str]:
    """None where this rank can use NCCL, else why not (the loader's message)."""
    from .. import _C
    from . import nccl

    try:
        if _C.cuda_device_count() < 1:
            return "rumor's extension sees no CUDA device"
        nccl.load()
    except Exception as e:  # noqa: BLE001 - the reason is reported, on every rank, by agree()
        return f"{type(e).__name__}: {e}"
    return None


def wait_event(event, timeout: float, what: str) -> None:
    """Waits, at most `timeout` seconds, for a recorded torch.cuda.Event; polls instead of
    Event.synchronize(), which has no deadline."""
    if event.query():
        return
    deadline = time.monotonic() + timeout
    pause = 2e-5
    while not event.query():
        if time.monotonic() > deadline:
            raise CommTimeoutError(f"{what}: the GPU work queued on the stream before it did not finish within "
                                   f"{timeout:.1f} s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class PinnedCache:
    """Free page-locked host buffers of one group, reused by the staged transport (bounded by
    STAGING_CACHE_BUFFERS and STAGING_CACHE_BYTES; the oldest free buffer goes first). A buffer
    comes back with the event of its last copy to the GPU, waited for before its next use."""

    def __init__(self, max_buffers: int = STAGING_CACHE_BUFFERS, max_bytes: int = STAGING_CACHE_BYTES):
        self.max_buffers, self.max_bytes = max_buffers, max_bytes
        self._free: "OrderedDict[int, Tuple[torch.Tensor, object]]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # a Handle may finish on another thread than the one that issued

    @staticmethod
    def size_for(nbytes: int) -> int:
        return max(_STAGING_MIN_BYTES, 1 << max(0, int(nbytes) - 1).bit_length())

    def take(self, nbytes: int, timeout: float, what: str) -> torch.Tensor:
        """A 1-D pinned uint8 buffer of at least nbytes, free of pending copies."""
        want = self.size_for(nbytes)
        with self._lock:
            hit = None
            for key, (buf, ev) in self._free.items():
                if buf.numel() == want:
                    hit = key
                    break
            if hit is not None:
                buf, ev = self._free.pop(hit)
                self._bytes -= buf.numel()
            else:
                buf, ev = None, None
        if buf is None:
            return torch.empty(want, dtype=torch.uint8, pin_memory=True)
        if ev is not None:
            wait_event(ev, timeout, what)
        return buf

    def give(self, buf: torch.Tensor, event=None) -> None:
        if buf.numel() > self.max_bytes:
            return  # too big to keep: torch frees it once the copy's event passed (its host allocator)
        with self._lock:
            self._free[id(buf)] = (buf, event)
            self._bytes += buf.numel()
            while self._free and (len(self._free) > self.max_buffers or self._bytes > self.max_bytes):
                _, (old, _) = self._free.popitem(last=False)
                self._bytes -= old.numel()

    def __len__(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0


_EVENT_POOL = 64  # passed events a group keeps for reuse


class GpuGroup:
    """What a Group keeps for the GPU path: its device, the agreed transport (None until the
    group's first CUDA collective), the NCCL communicator, the watch of its ops queued without a
    host wait (RUMOR_GPU_WAIT=stream; made with the communicator) and the staging buffers."""

    def __init__(self, device: int):
        self.device = int(device)
        self._torch_device = torch.device(CUDA, self.device)
        self.transport: Optional[str] = None
        self.comm = None
        self.watch = None
        self.pinned = PinnedCache()
        # Passed events of NCCL ops, recorded again by later ops: creating a CUDA event costs
        # about as much as queueing a small op (list pop/append are atomic, so the watch's
        # thread may give events back).
        self._events: list = []

    @property
    def torch_device(self) -> torch.device:
        return self._torch_device

    def event(self):
        """A torch.cuda.Event to record after an op: a passed one from the pool, else a new one."""
        try:
            return self._events.pop()
        except IndexError:
            return torch.cuda.Event()

    def recycle(self, event) -> None:
        """Gives back an event that has passed and that nothing will ask again."""
        if len(self._events) < _EVENT_POOL:
            self._events.append(event)

    def close(self, timeout: float = 60.0) -> None:
        """Waits (at most timeout seconds) for the ops queued without a host wait, then closes
        the communicator; an op that failed or did not finish is raised after the close."""
        comm, self.comm = self.comm, None
        watch, self.watch = self.watch, None
        self.pinned.clear()
        pending = None
        if watch is not None:
            try:
                watch.drain(timeout, f"rumor.shutdown() of {self!r}")
            except Exception as e:  # noqa: BLE001 - raised below, once the communicator is closed
                pending = e
                if comm is not None:
                    comm.abort()  # an unfinished op must not hold up the close
            watch.close()
        if comm is not None:
            comm.close()
        if pending is not None:
            raise pending

    def __repr__(self) -> str:
        return f"GpuGroup(cuda:{self.device}, transport={self.transport})"


def _rank_device(g) -> Optional[int]:
    gpu = getattr(g, "_gpu", None)
    if gpu is not None:
        return gpu.device
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def route(what: str, group, *named, collective: bool = True) -> Optional[GpuGroup]:
    """None for the CPU path, else the group's GpuGroup (agreeing on the transport at the
    group's first CUDA collective). named: (argument name, value) pairs of the call's tensors;
    a value that is not a tensor is left to the CPU path's checks. collective=False (send and
    recv, which only two ranks call) never starts the group-wide agreement."""
    for _, t in named:
        if isinstance(t, torch.Tensor) and not t.is_cpu:
            break
    else:
        return None
    from .._runtime import communicator

    g = communicator(group, what)
    gpu = g._gpu
    if gpu is not None and (gpu.transport is not None or not collective):
        # The group's usual call: every tensor on its device (what decide() would accept).
        dev = gpu.device
        if all(t is None or (isinstance(t, torch.Tensor) and t.is_cuda and t.get_device() == dev) for _, t in named):
            return gpu
    named = [(name, t) for name, t in named if t is not None]
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor for {name}, got {type(t).__name__}")
    decide(what, [(name, t.device) for name, t in named], _rank_device(g))
    gpu = g._gpu
    if gpu is None:
        gpu = g._gpu = GpuGroup(torch.cuda.current_device())
    if collective and gpu.transport is None:
        _setup(g, gpu, what)
    return gpu


def _setup(g, gpu: GpuGroup, what: str) -> None:
    """Agrees on the group's transport (one small allgather over the group) and, for NCCL,
    creates its communicator; every member reaches this at the same collective."""
    from .. import _host_collectives as collectives
    from . import nccl

    st = _runtime.state()
    setting_error = None
    try:
        setting = transport_setting()
        code = _SETTING_CODES[setting]
    except ValueError as e:
        setting_error, setting, code = e, "invalid", len(TRANSPORTS)
    problem = nccl_problem() if setting in ("auto", "nccl") else "not probed"
    # A rank with a bad setting still takes part in the exchange, so its peers learn of it and
    # raise too instead of waiting for it in NCCL's init; it raises its own, more precise error.
    row = torch.tensor([[code, 0 if problem else 1, gpu.device]], dtype=torch.int64)
    table = collectives.allgather(row, g, None, False, what).tolist()
    if setting_error is not None:
        raise setting_error
    hosts = [st.hosts[r] for r in g.ranks]
    transport = agree(table, hosts, g.ranks, g.rank(), problem, what)
    if transport == "nccl":
        from .watch import StreamWatch

        gpu.comm = nccl.communicator(g, device=gpu.device)
        gpu.watch = StreamWatch(gpu.comm, f"{g!r} on cuda:{gpu.device}", recycle=gpu.recycle)
    gpu.transport = transport


def drain_all(state, timeout: float, what: str) -> None:
    """Waits for the ops every group queued without a host wait (GpuGroup.watch), within one
    deadline for them all; raises the first error met."""
    if isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"{what}: timeout must be positive, got {timeout!r}")
    deadline = time.monotonic() + timeout
    for g in [state.world] + list(state.groups):
        gpu = getattr(g, "_gpu", None)
        watch = gpu.watch if gpu is not None else None
        if watch is not None:
            watch.drain(max(deadline - time.monotonic(), 1e-3), what)


def close_all(state) -> List[str]:
    """Closes every group's NCCL communicator (rumor.shutdown()); returns what failed, as text,
    so that one failing close does not keep the others open."""
    errors = []
    for g in [state.world] + list(state.groups):
        gpu = getattr(g, "_gpu", None)
        if gpu is None:
            continue
        try:
            gpu.close(state.timeout)
        except Exception as e:  # noqa: BLE001 - shutdown goes on; the caller reports these
            errors.append(f"{g!r}: {type(e).__name__}: {e}")
        g._gpu = None
    return errors


def _close_at_shutdown(state) -> List[str]:
    errors = close_all(state)
    return ["closing NCCL communicators failed: " + "; ".join(errors)] if errors else []


_runtime.on_shutdown(_close_at_shutdown)
