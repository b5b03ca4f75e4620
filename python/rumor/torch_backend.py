"""torch.distributed backend "rumor": torch's collectives on rumor's core (docs/torch_backend.md).

`import rumor` registers the name; torch calls `_create` once per process group (the default
group and every new_group), with that group's own store prefix, rank, size and timeout. Each
group gets its own rumor Context, met through that store, so the backend works under every
launcher torch supports and never needs rumor.init() (nor disturbs it).

torch only lets Python implement a whole ProcessGroup (its Backend class has no Python
constructor), so when torch sees a Python process group it takes it in place of the group it
was building, for every device of the device map. The group therefore serves every device
itself: CPU tensors run on rumor's core, and CUDA tensors go where the map sends them. With
"cuda:rumor" (what backend="rumor" alone means) they are staged through host memory around
rumor's CPU collectives; with "cuda:nccl" ("cpu:rumor,cuda:nccl") the group makes torch's own
NCCL backend, on its own store prefix, and hands it every call whose tensors are on a GPU.
"""
from __future__ import annotations

import datetime
import math
import os
import queue
import sys
import threading
import time
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import _C, _rendezvous, _runtime, _shm
from ._env import env_bool, env_int
from ._tensor import _DTYPE_CODES, dtype_code, movable_code
from .gpu.staging import host_like, to_host

BACKEND_NAME = "rumor"

# The core's reduce codes (rumor.ReduceOp); PREMUL_SUM becomes a local scale and a SUM.
_RED = dist.ReduceOp.RedOpType
_OPS = {_RED.SUM: 0, _RED.AVG: 1, _RED.MIN: 2, _RED.MAX: 3, _RED.PRODUCT: 4}
# The same keyed by the enum's int: hashing or comparing pybind's enum costs ~1-2 us, a fair part
# of a 4 KiB op's whole time through this backend.
_OP_CODES = {int(k.value): v for k, v in _OPS.items()}
# Point-to-point messages run on one communicator per (source, destination, tag) so that each
# such stream is matched in order on its own and an unmatched irecv holds up nothing else.
# Their ids live above the group's own communicator (0) and below the core's reserved bits.
_P2P_BASE = 1 << 47
_P2P_MAX_TAG = (1 << 23) - 1
_P2P_MAX_RANKS = 1 << 12


def _where(what: str) -> str:
    return f"torch.distributed.{what} on the rumor backend"


def _check_cpu(tensors: Sequence[torch.Tensor], what: str, arg: str) -> None:
    for t in tensors:
        # The common case in a few attribute reads (t.device builds an object: ~0.4 us); anything
        # else falls through to the checks that say what is wrong.
        if isinstance(t, torch.Tensor) and t.is_cpu and t.layout == torch.strided:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_where(what)}: {arg} must hold torch.Tensor values, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{_where(what)}: {arg} is on {t.device} {_DEVICES}")
        if t.layout != torch.strided:
            raise TypeError(f"{_where(what)}: {arg} must be a dense (strided) tensor, got layout {t.layout}")


_DEVICES = ("but the call's other tensors are not: the rumor backend takes CPU tensors, and CUDA tensors "
            "where its device map sends them (backend='rumor' stages them through host memory, "
            "'cpu:rumor,cuda:nccl' hands them to NCCL); the tensors of one call must all be on one device "
            "(docs/torch_backend.md)")
# Supported targets for CUDA tensors in a device map ("cuda:<name>").
_CUDA_TARGETS = ("rumor", "nccl")
# Calls whose first argument (the output) is also read: its staged copy starts from the tensor's data.
_READS_OUTPUT = frozenset({"allreduce", "allreduce_coalesced", "reduce", "broadcast"})
# The method of torch's C++ backends (ProcessGroupNCCL) for each of this group's methods whose
# name differs; the coalesced pairs run as one NCCL group of calls.
_NCCL_NAMES = {"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base",
               "all_to_all_single": "alltoall_base"}
_NCCL_COALESCED = {"allgather_into_tensor_coalesced": "_allgather_base",
                   "reduce_scatter_tensor_coalesced": "_reduce_scatter_base"}
# torch.distributed's names of the calls, for messages.
_CALLS = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
          "reduce_scatter_single": "reduce_scatter_tensor", "allgather": "all_gather",
          "all_gather_single": "all_gather_into_tensor", "allgather_coalesced": "all_gather_coalesced",
          "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced", "alltoall": "all_to_all"}


def _off_cpu(*args) -> bool:
    """Whether any tensor in args (tensors, lists of them, lists of lists) is not a CPU tensor."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if not a.is_cpu:
                return True
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    if not b.is_cpu:
                        return True
                elif isinstance(b, (list, tuple)):
                    for c in b:
                        if isinstance(c, torch.Tensor) and not c.is_cpu:
                            return True
    return False


def _leaves(x) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _leaves(y)]
    return []


def _device_map() -> Optional[dict]:
    """The device map torch is building a group from ({"cpu": "rumor", "cuda": "nccl"}), read
    from torch's group-making frame: the creator it calls is not told the map. None where that
    frame is not found (a torch that builds groups differently): then CUDA tensors are staged."""
    f = sys._getframe(1)
    for _ in range(16):
        if f is None:
            return None
        if f.f_code.co_name == "_new_process_group_helper":
            cfg = f.f_locals.get("backend_config")
            try:
                return {str(d).lower(): str(b).lower() for d, b in cfg.get_device_backend_map().items()}
            except Exception:  # noqa: BLE001 (a torch without this attribute: staging, as documented)
                return None
        f = f.f_back
    return None


def _cuda_target(device_map: Optional[dict]) -> str:
    """Where CUDA tensors go for this device map ('rumor': staged; 'nccl'); refuses the maps
    this group cannot honour."""
    if not device_map:
        return "rumor"
    where = "init_process_group(backend='" + ",".join(f"{d}:{b}" for d, b in device_map.items()) + "')"
    cpu = device_map.get("cpu", BACKEND_NAME)
    if cpu != BACKEND_NAME:
        raise ValueError(f"{where}: the rumor group serves every device of its device map (torch takes a "
                         f"Python process group whole), so CPU tensors cannot go to {cpu!r} beside it; use "
                         f"'cpu:rumor,cuda:<backend>', or keep the other backend on a group of its own "
                         f"(dist.new_group(backend={cpu!r}))")
    target = device_map.get("cuda", BACKEND_NAME)
    if target not in _CUDA_TARGETS:
        raise ValueError(f"{where}: CUDA tensors can go to 'rumor' (staged through host memory) or 'nccl' "
                         f"beside the rumor backend, not {target!r}")
    return target


def _same_dtype(tensors: Sequence[torch.Tensor], dtype: torch.dtype, what: str, arg: str) -> None:
    for t in tensors:
        if t.dtype != dtype:
            raise TypeError(f"{_where(what)}: {arg} must all be {dtype} like the input, got {t.dtype}")


def _reduce_code(t: torch.Tensor, what: str) -> int:
    code = _DTYPE_CODES.get(t.dtype)
    return code if code is not None else dtype_code(t.dtype, _where(what))


def _op(opts_op, what: str):
    """(core op code, premultiplier or None) of torch's ReduceOp."""
    kind = opts_op.op
    code = _OP_CODES.get(kind.value)
    if code is not None:
        return code, None
    if kind == _RED.PREMUL_SUM:
        factor = getattr(opts_op, "factor", None)
        if isinstance(factor, torch.Tensor):
            factor = factor.item() if factor.numel() == 1 else None
        if not isinstance(factor, (int, float)):
            raise ValueError(f"{_where(what)}: ReduceOp.PREMUL_SUM needs a scalar factor; this one is not usable")
        return 0, float(factor)
    if kind not in _OPS:
        raise ValueError(f"{_where(what)}: unsupported reduce op {kind.name}; the rumor backend supports "
                         "SUM, AVG, MIN, MAX, PRODUCT and PREMUL_SUM (bitwise ops are not implemented)")
    return _OPS[kind], None


_TENSOR = torch.Tensor
_STRIDED = torch.strided


def _plain(t) -> bool:
    """Whether t is a dense, contiguous CPU torch.Tensor (not a subclass): what the fast paths of
    the common calls take. Anything else takes the general path, which checks it and says what is
    wrong."""
    return type(t) is _TENSOR and t.is_cpu and t.layout == _STRIDED and t.is_contiguous()


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _as_error(e: BaseException, what: str, peer: str) -> BaseException:
    if isinstance(e, dist.DistBackendError):
        return e
    return dist.DistBackendError(f"{_where(what)} ({peer}) failed: {e}")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Ran:
    """A core work item for an op that already ran on the caller's thread."""

    __slots__ = ("_error",)

    def __init__(self, error: Optional[BaseException]):
        self._error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout: float) -> None:
        if self._error is not None:
            raise self._error


# works= for an op that already ran on the caller's thread, successfully: the work is complete
# when made (an op that failed there passes [_Ran(error)], so that wait() raises it).
_RAN_OK: list = []
_FINISHED_LOCK = threading.Lock()


class _Part:
    """One call of a coalesced work, seen as a core work item (done / wait), so that the
    coalesced work is finished exactly when all of its calls are."""

    __slots__ = ("_work",)

    def __init__(self, work: "RumorWork"):
        self._work = work

    def done(self) -> bool:
        return self._work.is_completed()

    def wait(self, timeout: float) -> None:
        self._work.wait(datetime.timedelta(seconds=timeout))


class _Waiter:
    """One daemon thread per process group that completes futures in issue order, so that a
    torch Future (DDP's comm hooks, FSDP) is set without anyone calling wait() on the work."""

    def __init__(self):
        self._q: "queue.SimpleQueue[Optional[RumorWork]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def put(self, w: "RumorWork") -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="rumor-torch-backend", daemon=True)
                self._thread.start()
        self._q.put(w)

    def _loop(self) -> None:
        while True:
            w = self._q.get()
            if w is None:
                return
            w._settle_future()

    def stop(self) -> None:
        if self._thread is not None:
            self._q.put(None)


class RumorWork(dist._Work):
    """An operation issued on the rumor backend, as torch.distributed returns it (async_op=True).

    Made by RumorProcessGroup; users get it from torch.distributed calls.

    Args:
        pg: the process group that issued it.
        what: the torch.distributed call, for error messages.
        peer: who the operation talks to, for error messages.
        works: the core's work items (empty when nothing was sent).
        keep: buffers the core reads or writes until it is done, kept alive here.
        finish: runs once after the works finished and returns the list of result tensors.
    """

    # What a work made finished (works=_RAN_OK, most ops) keeps: __init__ sets only what differs,
    # since a small op's whole Python budget is a few microseconds. A finished work's future
    # needs no lock of its own: the module's one serves them all.
    _works: list = []
    _keep: tuple = ()
    _error: Optional[BaseException] = None
    _future: Optional[torch.futures.Future] = None
    _done = False
    _lock = _FINISHED_LOCK

    def __init__(self, pg: "RumorProcessGroup", what: str, peer: str, works: list, keep: tuple,
                 finish: Callable[[], List[torch.Tensor]]):
        super().__init__()
        self._pg = pg
        self._what = what
        self._peer = peer
        if works is _RAN_OK:
            # Nothing to wait for, and nobody else holds this work yet: the result is set now,
            # as _complete would.
            try:
                self._result = finish()
            except BaseException as e:  # noqa: BLE001 (as in _complete)
                self._result = []
                self._error = _as_error(e, what, peer)
            self._done = True
            return
        self._works = works
        self._keep = keep
        self._finish = finish
        self._lock = threading.Lock()
        self._result: List[torch.Tensor] = []

    def _complete(self) -> None:
        with self._lock:
            if self._done:
                return
            try:
                for w in self._works:
                    # The op carries rumor's deadline (the group's timeout); this one only guards
                    # against a lost wakeup.
                    w.wait(self._pg._timeout * 4 + 60)
                self._result = self._finish()
            except BaseException as e:  # noqa: BLE001 (every failure is the op's result)
                self._error = _as_error(e, self._what, self._peer)
            self._done = True
            self._keep = ()
            self._works = []

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        """Blocks until the operation finished.

        Args:
            timeout: torch's per-call limit; the operation also ends at the group's timeout
                (init_process_group(timeout=...)), which is rumor's deadline.

        Returns:
            True.

        Raises:
            torch.distributed.DistBackendError: the operation failed or passed a deadline; the
                message names the operation and the peer.
        """
        if self._done:
            if self._error is not None:
                raise self._error
            return True
        if timeout is not None and timeout > datetime.timedelta(0):
            limit = timeout.total_seconds()
            try:
                for w in list(self._works):
                    w.wait(limit)
            except Exception:  # noqa: BLE001
                # Works that ended (in failure) are reported by _complete below; the others
                # are still running: only this wait ran out.
                if not all(w.done() for w in self._works):
                    raise dist.DistBackendError(
                        f"{_where(self._what)} ({self._peer}): not finished within wait(timeout={limit}s)") from None
        self._complete()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the operation finished (successfully or not), without waiting.

        Returns:
            A bool.
        """
        if self._done:
            return True
        if not all(w.done() for w in self._works):
            return False
        # Finished: the results are copied into the caller's tensors now, so that a caller who
        # polls and then reads them (without wait()) sees them, as with gloo's work.
        self._complete()
        return True

    def is_success(self) -> bool:
        """Whether the operation finished without error (False while it runs).

        Returns:
            A bool.
        """
        return self._done and self._error is None

    def exception(self) -> Optional[BaseException]:
        """The operation's error once it finished, else None.

        Returns:
            The DistBackendError the operation ended with, or None.
        """
        return self._error

    def result(self) -> List[torch.Tensor]:
        """The result tensors, after wait() (as gloo's work returns them).

        Returns:
            A list of tensors.
        """
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A future set to the list of result tensors when the operation finishes (or to its
        error), as gloo's: DDP comm hooks chain on it.

        Returns:
            A torch.futures.Future.
        """
        with self._lock:
            if self._future is not None:
                return self._future
            self._future = torch.futures.Future()
            done = self._done
        # A future's callbacks run on the waiter thread; one that issues another op and waits on
        # its future (PowerSGD's hook does) would wait for its own thread, so settle it here.
        if done or self._pg._waiter.on_thread():
            self._settle_future()
        else:
            self._pg._waiter.put(self)
        return self._future

    def _settle_future(self) -> None:
        self._complete()
        fut = self._future
        if fut is None or fut.done():
            return
        if self._error is not None:
            fut.set_exception(self._error)
        else:
            fut.set_result(self._result)


class _StagedWork(dist._Work):
    """A call on CUDA tensors staged through host memory: `inner` is the same call on host
    copies (already taken on the caller's stream); the results are copied back into the CUDA
    tensors once it finished, on the stream of whoever waits (wait()) or, for the future, on
    the device's current stream of the thread that completes it, which the future's CUDA
    events then order before its users (DDP's comm hooks chain on it)."""

    def __init__(self, inner: RumorWork, pairs, outputs: List[torch.Tensor], device: torch.device):
        super().__init__()
        self._inner = inner
        self._pairs = pairs  # (CUDA tensor, its host copy) for every tensor the call writes
        self._outputs = outputs
        self._device = device
        self._lock = threading.Lock()
        self._copied = False
        self._future: Optional[torch.futures.Future] = None

    def _copy_back(self) -> None:
        with self._lock:
            if self._copied:
                return
            for dst, src in self._pairs:
                # Queued on the stream; torch keeps the page-locked source until the copy ran.
                dst.copy_(src, non_blocking=True)
            self._copied = True
            self._pairs = ()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        """Waits for the staged call (as RumorWork.wait) and copies its results to the GPU on
        the current stream.

        Args:
            timeout: torch's per-call limit (the group's timeout bounds the call too).

        Returns:
            True.
        """
        self._inner.wait(timeout)
        self._copy_back()
        return True

    def is_completed(self) -> bool:
        """Whether the staged call finished; once it did, its results are queued back to the GPU
        on the current stream.

        Returns:
            A bool.
        """
        if not self._inner.is_completed():
            return False
        if self._inner.is_success():
            self._copy_back()  # on the polling thread's stream, as wait() would
        return True

    def is_success(self) -> bool:
        """Whether the staged call finished without error.

        Returns:
            A bool.
        """
        return self._inner.is_success()

    def exception(self) -> Optional[BaseException]:
        """The staged call's error, or None.

        Returns:
            A DistBackendError or None.
        """
        return self._inner.exception()

    def result(self) -> List[torch.Tensor]:
        """The call's CUDA output tensors, after wait().

        Returns:
            A list of tensors.
        """
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        """A CUDA-aware future set to the output tensors once they are back on the GPU.

        Returns:
            A torch.futures.Future.
        """
        with self._lock:
            if self._future is not None:
                return self._future
            cuda = self._device.type == "cuda"
            self._future = fut = torch.futures.Future(devices=[self._device] if cuda else None)

        def settle(f):
            try:
                f.value()
                if cuda:
                    with torch.cuda.device(self._device):
                        self._copy_back()
                        fut.set_result(self._outputs)
                else:
                    self._copy_back()
                    fut.set_result(self._outputs)
            except BaseException as e:  # noqa: BLE001 (the call's error is the future's)
                fut.set_exception(e)

        self._inner.get_future().add_done_callback(settle)
        return fut


def _store_host(store) -> str:
    """The address of the TCPStore under torch's prefix stores (the host other ranks reached),
    else MASTER_ADDR, else loopback (FileStore and HashStore jobs on one host)."""
    s = store
    for _ in range(16):
        if isinstance(s, dist.TCPStore):
            return s.host
        if isinstance(s, dist.PrefixStore):
            s = s.underlying_store
            continue
        break
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


class RumorProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on rumor's core (CPU tensors;
    CUDA tensors staged through host memory or handed to NCCL, as the device map says).

    torch makes it: pass backend="rumor" to init_process_group or new_group. Ranks in the
    calls torch forwards here are group ranks.

    Args:
        ctx: the group's rumor Context, connected to its peers.
        rank: this process's rank in the group.
        size: the number of ranks in the group.
        timeout: seconds every operation may take (init_process_group's timeout).
        global_ranks: the group's members as global ranks (empty for the default group).
        store: the group's store (monitored_barrier meets there, off the data path).
        cuda: where CUDA tensors go: "rumor" (staged through host memory) or "nccl" (torch's
            NCCL backend, made by this group at its first such call).
    """

    def __init__(self, ctx, rank: int, size: int, timeout: float, global_ranks: Sequence[int], store=None,
                 cuda: str = BACKEND_NAME):
        super().__init__(rank, size)
        if cuda not in _CUDA_TARGETS:
            raise ValueError(f"RumorProcessGroup: cuda must be one of {_CUDA_TARGETS}, got {cuda!r}")
        self._cuda = cuda
        self._nccl = None
        self._nccl_lock = threading.Lock()
        self._store = store
        self._monitored = 0  # monitored_barrier calls so far: each one's keys are its own
        self._ctx = ctx
        self._rank = rank
        self._size = size
        self._timeout = float(timeout)
        self._global = list(global_ranks) or list(range(size))
        self._all_ranks = f"ranks {self._global}"
        self._comm = _C.Communicator(ctx, 0, "torch.distributed group", list(range(size)))
        self._p2p: dict = {}
        self._p2p_lock = threading.Lock()
        self._waiter = _Waiter()
        self._inline_bytes = env_int("RUMOR_TORCH_INLINE_BYTES", 64 << 10, minimum=0)

    # ---- identity -------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        """The backend's name.

        Returns:
            "rumor".
        """
        return BACKEND_NAME

    def name(self) -> str:
        """The backend's name.

        Returns:
            "rumor".
        """
        return BACKEND_NAME

    # torch names every group after making it; with no C++ backend behind this group the name
    # must be kept here (FSDP2, DeviceMesh and functional collectives look groups up by it).
    def setGroupName(self, name: str) -> None:  # noqa: N802 (torch's name)
        """Keeps the name torch gives this group.

        Args:
            name: the group's name.
        """
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802 (torch's name)
        """The name torch gave this group.

        Returns:
            A str ("" before torch named it).
        """
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 (torch's name)
        """Keeps the description torch gives this group.

        Args:
            desc: the group's description.
        """
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802 (torch's name)
        """The description torch gave this group.

        Returns:
            A str.
        """
        return getattr(self, "_group_desc", "")

    def abort(self) -> None:
        """Fails every operation in flight at once, here and (through closed connections) at
        the peers."""
        self._comm.abort("aborted through torch.distributed")
        for c in list(self._p2p.values()):
            c.abort("aborted through torch.distributed")
        if self._nccl is not None:
            self._nccl.abort()

    def shutdown(self) -> None:
        """Stops the thread that completes futures, and the NCCL backend of CUDA tensors if one
        was made; the connections close with the group."""
        self._waiter.stop()
        if self._nccl is not None:
            self._nccl.shutdown()

    # ---- tensors off the CPU ----------------------------------------------------------------
    def _device_call(self, name: str, args: tuple):
        """A call some of whose tensors are not on the CPU: all of them must be on one CUDA
        device; then staged or handed to NCCL, as the group's device map says."""
        what = _CALLS.get(name, name)
        devices = {t.device for a in args for t in _leaves(a)}
        if len(devices) > 1:
            where = ", ".join(sorted(str(d) for d in devices))
            raise ValueError(f"{_where(what)}: tensors on different devices ({where}); the tensors of one call "
                             "must all be CPU tensors or all on one CUDA device")
        (device,) = devices
        if device.type != "cuda":
            raise ValueError(f"{_where(what)}: a tensor is on {device}; the rumor backend takes CPU tensors, "
                             "and CUDA tensors where its device map sends them (backend='rumor' stages them "
                             "through host memory, 'cpu:rumor,cuda:nccl' hands them to NCCL)")
        if self._cuda == "nccl":
            return self._on_nccl(name, args)
        return self._staged(name, args, device)

    def _staged(self, name: str, args: tuple, device: torch.device) -> _StagedWork:
        """The call on page-locked host copies of its tensors; the outputs return at wait() or
        with the future. The copies to the host run on the caller's current stream, so they see
        the work queued before the call, and are waited for with the group's deadline."""
        reads = name in _READS_OUTPUT
        what = _where(_CALLS.get(name, name))
        pairs: list = []

        def host(x, output: bool):
            if isinstance(x, torch.Tensor):
                h = host_like(x)  # page-locked: torch's caching host allocator keeps such buffers
                if reads or not output:
                    to_host(x, h, what, self._timeout)
                if output:
                    pairs.append((x, h))
                return h
            if isinstance(x, (list, tuple)):
                return [host(y, output) for y in x]
            return x

        # Every call's first argument holds what it writes, except send's.
        writes = name != "send"
        staged = [host(a, writes and i == 0) for i, a in enumerate(args)]
        inner = getattr(self, name)(*staged)
        return _StagedWork(inner, pairs, _leaves(args[0]), device)

    def _nccl_backend(self, what: str):
        with self._nccl_lock:
            if self._nccl is not None:
                return self._nccl
            if not dist.is_nccl_available():
                raise ValueError(f"{_where(what)}: the device map sends CUDA tensors to NCCL ('cuda:nccl'), but "
                                 "this torch has no NCCL; use 'cpu:rumor,cuda:rumor' (staged through host memory)")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = datetime.timedelta(seconds=self._timeout)
            if hasattr(opts, "global_ranks_in_group"):
                opts.global_ranks_in_group = list(self._global)
            if hasattr(opts, "group_name"):
                opts.group_name = f"{self.getGroupName()}:cuda"
            # Its own prefix under the group's store: NCCL's ids never meet rumor's keys.
            self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", self._store), self._rank, self._size,
                                               opts)
            return self._nccl

    def _on_nccl(self, name: str, args: tuple):
        backend = self._nccl_backend(_CALLS.get(name, name))
        if args and args[-1] is None and name not in ("send", "recv"):
            args = args[:-1]  # torch's C++ backends take their defaults for a missing options object
        pair = _NCCL_COALESCED.get(name)
        if pair is None:
            return getattr(backend, _NCCL_NAMES.get(name, name))(*args)
        outputs, inputs = args[0], args[1]
        backend._start_coalescing()
        for o, i in zip(outputs, inputs):
            getattr(backend, pair)(o, i, *args[2:])
        return backend._end_coalescing()

    # ---- helpers --------------------------------------------------------------------------
    def _peer(self, group_rank: int) -> str:
        return f"rank {self._global[group_rank]}"

    def _all(self) -> str:
        return self._all_ranks

    def _work(self, what, peer, works, keep, finish) -> RumorWork:
        return RumorWork(self, what, peer, works, keep, finish)

    def _collective(self, opts, what: str, peer: str, nbytes: int, fn) -> list:
        """Issues a collective (fn(nonblocking) calls the core) and returns the works for _work.

        It runs here and now, on the caller's thread, when torch will wait for it at once
        (opts.asyncOp False: a call without async_op=True) or when it is at most
        RUMOR_TORCH_INLINE_BYTES; that spares the hand-off to the communicator's thread and back
        (most of a small op's time when ranks outnumber cores, a fifth of a 1 MiB allreduce's).
        The others (DDP's buckets, FSDP's prefetches, async_op=True) go to that thread and
        overlap with the caller. The core runs a communicator's ops in issue order either way,
        and an error of an op run here still surfaces at wait(), as an asynchronous op's does."""
        if not self._runs_here(opts, nbytes):
            return [self._issue(what, peer, lambda: fn(True))]
        return self._inline(fn, False)

    def _runs_here(self, opts, nbytes: int) -> bool:
        """Whether an op of nbytes runs on the caller's thread (_collective's rule)."""
        return nbytes <= self._inline_bytes or not getattr(opts, "asyncOp", True)

    @staticmethod
    def _inline(call, *args) -> list:
        """Runs a blocking core call, call(*args), here; the works for _work."""
        try:
            call(*args)
        except (TypeError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 (reported at wait(), as for an asynchronous op)
            return [_Ran(e)]
        return _RAN_OK

    def _ran(self, what: str, out: list, call, *args) -> RumorWork:
        """The fast paths' blocking core call, call(*args), on the caller's thread, and its work,
        finished: _collective's inline case without its closures and checks. When ranks share
        cores every op switches processes, and this Python then runs with cold caches at several
        times its cost alone (docs/torch_backend.md, "A small op")."""
        return RumorWork(self, what, self._all_ranks, self._inline(call, *args), (), lambda: out)

    def _issue(self, what: str, peer: str, fn):
        try:
            return fn()
        except (TypeError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 (a communicator broken by an earlier failure)
            raise _as_error(e, what, peer) from None

    def _one(self, tensors, what: str, arg: str = "tensor") -> torch.Tensor:
        if len(tensors) != 1:
            raise ValueError(f"{_where(what)}: expects one {arg} per process, got {len(tensors)}")
        _check_cpu(tensors, what, arg)
        return tensors[0]

    def _root(self, root: int, what: str) -> int:
        if not 0 <= root < self._size:
            raise ValueError(f"{_where(what)}: root rank {root} is outside a group of size {self._size}")
        return root

    # ---- reductions -----------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        """allreduce of one CPU tensor, in place (dist.all_reduce).

        Args:
            tensors: a list of one tensor.
            opts: torch's AllreduceOptions (its reduceOp).

        Returns:
            A RumorWork.
        """
        if opts is not None and len(tensors) == 1 and _plain(t := tensors[0]):
            # The fast path: a blocking or small op with a plain op on a plain tensor.
            code, op, n = _DTYPE_CODES.get(t.dtype), _OP_CODES.get(opts.reduceOp.op.value), t.numel()
            if code is not None and op is not None and self._runs_here(opts, n * t.element_size()):
                return self._ran("all_reduce", [t], self._comm.allreduce, t.data_ptr(), n, code, op, 0, False)
        if _off_cpu(tensors):
            return self._device_call('allreduce', (tensors, opts))
        what = "all_reduce"
        t = self._one(tensors, what)
        code = _reduce_code(t, what)
        op, pre = _op((opts or dist.AllreduceOptions()).reduceOp, what)
        buf = _contig(t)
        if pre is not None:
            buf = buf * pre if buf is not t else buf.mul_(pre)

        def finish():
            if buf.data_ptr() != t.data_ptr():
                t.copy_(buf)
            return [t]

        ws = self._collective(opts, what, self._all(), _nbytes(buf), lambda nb: self._comm.allreduce(
            buf.data_ptr(), buf.numel(), code, op, 0, nb))
        return self._work(what, self._all(), ws, (buf, t), finish)

    def allreduce_coalesced(self, tensors, opts=None):
        """allreduce of several CPU tensors of one dtype as one message (dist.all_reduce_coalesced).

        Args:
            tensors: the tensors, reduced in place.
            opts: torch's AllreduceCoalescedOptions.

        Returns:
            A RumorWork.
        """
        if _off_cpu(tensors):
            return self._device_call('allreduce_coalesced', (tensors, opts))
        what = "all_reduce_coalesced"
        if not tensors:
            raise ValueError(f"{_where(what)}: tensors must not be empty")
        _check_cpu(tensors, what, "tensors")
        _same_dtype(tensors, tensors[0].dtype, what, "tensors")
        code = _reduce_code(tensors[0], what)
        op, pre = _op((opts or dist.AllreduceCoalescedOptions()).reduceOp, what)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if pre is not None:
            flat.mul_(pre)

        def finish():
            off = 0
            for t in tensors:
                t.copy_(flat[off: off + t.numel()].view_as(t))
                off += t.numel()
            return list(tensors)

        ws = self._collective(opts, what, self._all(), _nbytes(flat), lambda nb: self._comm.allreduce(
            flat.data_ptr(), flat.numel(), code, op, 0, nb))
        return self._work(what, self._all(), ws, (flat,), finish)

    def reduce(self, tensors, opts=None):
        """reduce of one CPU tensor onto the root (dist.reduce); other ranks' tensors are left as
        they were.

        Args:
            tensors: a list of one tensor.
            opts: torch's ReduceOptions (rootRank, reduceOp).

        Returns:
            A RumorWork.
        """
        if _off_cpu(tensors):
            return self._device_call('reduce', (tensors, opts))
        what = "reduce"
        opts = opts or dist.ReduceOptions()
        t = self._one(tensors, what)
        code = _reduce_code(t, what)
        op, pre = _op(opts.reduceOp, what)
        root = self._root(opts.rootRank, what)
        mine = root == self._rank
        buf = _contig(t) if mine else t.contiguous().clone()
        if pre is not None:
            buf.mul_(pre)

        def finish():
            if mine and buf.data_ptr() != t.data_ptr():
                t.copy_(buf)
            return [t]

        peer = f"root {self._peer(root)}"
        ws = self._collective(opts, what, peer, _nbytes(buf), lambda nb: self._comm.reduce(
            buf.data_ptr(), buf.numel(), code, op, root, nb))
        return self._work(what, peer, ws, (buf, t), finish)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """reduce_scatter of lists of CPU tensors (dist.reduce_scatter).

        Args:
            output_tensors: a list of one output tensor.
            input_tensors: a list of one list of group-size tensors.
            opts: torch's ReduceScatterOptions (reduceOp).

        Returns:
            A RumorWork.
        """
        if _off_cpu(output_tensors, input_tensors):
            return self._device_call('reduce_scatter', (output_tensors, input_tensors, opts))
        what = "reduce_scatter"
        out = self._one(output_tensors, what, "output tensor")
        if len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
            raise ValueError(f"{_where(what)}: input_list must hold {self._size} tensors (the group size)")
        ins = list(input_tensors[0])
        _check_cpu(ins, what, "input_list")
        _same_dtype(ins, out.dtype, what, "input_list")
        if ins[self._rank].numel() != out.numel():
            raise ValueError(f"{_where(what)}: output has {out.numel()} elements but input_list[{self._rank}] "
                             f"has {ins[self._rank].numel()}")
        return self._reduce_scatter(what, out, torch.cat([t.reshape(-1) for t in ins]),
                                    [t.numel() for t in ins], opts)

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002 (torch's name)
        """reduce_scatter_tensor of CPU tensors (dist.reduce_scatter_tensor).

        Args:
            output: this rank's block of the result.
            input: group-size blocks, one per rank, each of output's size.
            opts: torch's ReduceScatterOptions (reduceOp).

        Returns:
            A RumorWork.
        """
        if opts is not None and _plain(output) and _plain(input) and output.dtype == input.dtype:
            # The fast path, as allreduce's.
            m = output.numel()
            code, op = _DTYPE_CODES.get(output.dtype), _OP_CODES.get(opts.reduceOp.op.value)
            if input.numel() == m * self._size and code is not None and op is not None and \
                    self._runs_here(opts, m * self._size * output.element_size()):
                return self._ran("reduce_scatter_tensor", [output], self._comm.reduce_scatter, input.data_ptr(),
                                 output.data_ptr(), [m] * self._size, code, op, False)
        if _off_cpu(output, input):
            return self._device_call('reduce_scatter_single', (output, input, opts))
        what = "reduce_scatter_tensor"
        _check_cpu([output], what, "output")
        _check_cpu([input], what, "input")
        _same_dtype([input], output.dtype, what, "input")
        if input.numel() != output.numel() * self._size:
            raise ValueError(f"{_where(what)}: input must have group size ({self._size}) x output's "
                             f"{output.numel()} elements, got {input.numel()}")
        return self._reduce_scatter(what, output, _contig(input), [output.numel()] * self._size, opts)

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter(self, what, out, src, counts, opts):
        code = _reduce_code(out, what)
        op, pre = _op((opts or dist.ReduceScatterOptions()).reduceOp, what)
        if pre is not None:
            src = src * pre
        res = _contig(out)

        def finish():
            if res.data_ptr() != out.data_ptr():
                out.copy_(res)
            return [out]

        ws = self._collective(opts, what, self._all(), _nbytes(src), lambda nb: self._comm.reduce_scatter(
            src.data_ptr(), res.data_ptr(), counts, code, op, nb))
        return self._work(what, self._all(), ws, (src, res, out), finish)

    # ---- data movement --------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        """broadcast of one CPU tensor from the root (dist.broadcast); any dtype.

        Args:
            tensors: a list of one tensor.
            opts: torch's BroadcastOptions (rootRank).

        Returns:
            A RumorWork.
        """
        if _off_cpu(tensors):
            return self._device_call('broadcast', (tensors, opts))
        what = "broadcast"
        opts = opts or dist.BroadcastOptions()
        t = self._one(tensors, what)
        root = self._root(opts.rootRank, what)
        code, per = movable_code(t)
        buf = _contig(t)

        def finish():
            if buf.data_ptr() != t.data_ptr():
                t.copy_(buf)
            return [t]

        peer = f"root {self._peer(root)}"
        ws = self._collective(opts, what, peer, _nbytes(buf), lambda nb: self._comm.broadcast(
            buf.data_ptr(), buf.numel() * per, code, root, nb))
        return self._work(what, peer, ws, (buf, t), finish)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """all_gather into a list of CPU tensors (dist.all_gather); blocks may differ in size.

        Args:
            output_tensors: a list of one list of group-size tensors.
            input_tensors: a list of one tensor.
            opts: torch's AllgatherOptions.

        Returns:
            A RumorWork.
        """
        if _off_cpu(output_tensors, input_tensors):
            return self._device_call('allgather', (output_tensors, input_tensors, opts))
        what = "all_gather"
        t = self._one(input_tensors, what)
        if len(output_tensors) != 1 or len(output_tensors[0]) != self._size:
            raise ValueError(f"{_where(what)}: tensor_list must hold {self._size} tensors (the group size)")
        outs = list(output_tensors[0])
        _check_cpu(outs, what, "tensor_list")
        _same_dtype(outs, t.dtype, what, "tensor_list")
        if outs[self._rank].numel() != t.numel():
            raise ValueError(f"{_where(what)}: tensor_list[{self._rank}] has {outs[self._rank].numel()} elements "
                             f"but the input has {t.numel()}")
        return self._allgather_blocks(what, [[o] for o in outs], [t], opts)

    def _allgather_blocks(self, what: str, blocks, inputs, opts=None):
        """Gathers every rank's tensors as one message: blocks[r] are the tensors that receive
        rank r's inputs (blocks[own rank] has this rank's inputs' sizes); one flat buffer, then
        copied out at wait()."""
        code, per = movable_code(inputs[0])
        counts = [sum(b.numel() for b in block) for block in blocks]
        flat = torch.empty(sum(counts), dtype=inputs[0].dtype)
        start = sum(counts[: self._rank])
        torch.cat([t.reshape(-1) for t in inputs], out=flat[start: start + counts[self._rank]])
        outs = [b for block in blocks for b in block]

        def finish():
            off = 0
            for o in outs:
                o.copy_(flat[off: off + o.numel()].view_as(o))
                off += o.numel()
            return outs

        ws = self._collective(opts, what, self._all(), _nbytes(flat), lambda nb: self._comm.allgather(
            flat.data_ptr(), [c * per for c in counts], code, nb))
        return self._work(what, self._all(), ws, (flat,), finish)

    def all_gather_single(self, output, input, opts=None):  # noqa: A002 (torch's name)
        """all_gather_into_tensor of CPU tensors (dist.all_gather_into_tensor).

        Args:
            output: group-size blocks, one per rank, each of input's size.
            input: this rank's block.
            opts: torch's AllgatherOptions.

        Returns:
            A RumorWork.
        """
        if _plain(output) and _plain(input) and output.dtype == input.dtype:
            # The fast path, as allreduce's; the core copies this rank's block into place.
            n = input.numel()
            if output.numel() == n * self._size and \
                    self._runs_here(opts, output.numel() * output.element_size()):
                code, per = movable_code(input)
                return self._ran("all_gather_into_tensor", [output], self._comm.allgather, output.data_ptr(),
                                 [n * per] * self._size, code, False, input.data_ptr())
        if _off_cpu(output, input):
            return self._device_call('all_gather_single', (output, input, opts))
        what = "all_gather_into_tensor"
        _check_cpu([output], what, "output_tensor")
        _check_cpu([input], what, "input_tensor")
        _same_dtype([output], input.dtype, what, "output_tensor")
        n = input.numel()
        if output.numel() != n * self._size:
            raise ValueError(f"{_where(what)}: output_tensor must have group size ({self._size}) x input's "
                             f"{n} elements, got {output.numel()}")
        code, per = movable_code(input)
        buf = _contig(output)
        buf.view(-1)[self._rank * n: (self._rank + 1) * n].copy_(input.reshape(-1))

        def finish():
            if buf.data_ptr() != output.data_ptr():
                output.copy_(buf)
            return [output]

        ws = self._collective(opts, what, self._all(), _nbytes(buf), lambda nb: self._comm.allgather(
            buf.data_ptr(), [n * per] * self._size, code, nb))
        return self._work(what, self._all(), ws, (buf, output), finish)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """all_gather of several CPU tensors of one dtype as one message (dist.all_gather_coalesced).

        Without this method torch's base class looks for a C++ backend of the device and fails
        ("No backend type associated with device type cpu").

        Args:
            output_lists: group-size lists; ``output_lists[r][i]`` receives rank r's ``input_tensors[i]``.
            input_tensors: this rank's tensors.
            opts: torch's AllgatherOptions.

        Returns:
            A RumorWork.
        """
        if _off_cpu(output_lists, input_tensors):
            return self._device_call('allgather_coalesced', (output_lists, input_tensors, opts))
        what = "all_gather_coalesced"
        if len(output_lists) != self._size or any(len(o) != len(input_tensors) for o in output_lists):
            raise ValueError(f"{_where(what)}: output_tensor_lists must hold {self._size} lists (the group size) "
                             f"of {len(input_tensors)} tensors (one per input)")
        if not input_tensors:
            raise ValueError(f"{_where(what)}: input_tensor_list must not be empty")
        _check_cpu(input_tensors, what, "input_tensor_list")
        dtype = input_tensors[0].dtype
        _same_dtype(input_tensors, dtype, what, "input_tensor_list")
        outs = [list(o) for o in output_lists]
        for o in outs:
            _check_cpu(o, what, "output_tensor_lists")
            _same_dtype(o, dtype, what, "output_tensor_lists")
        for i, t in enumerate(input_tensors):
            if outs[self._rank][i].numel() != t.numel():
                raise ValueError(f"{_where(what)}: output_tensor_lists[{self._rank}][{i}] has "
                                 f"{outs[self._rank][i].numel()} elements but input_tensor_list[{i}] has {t.numel()}")
        return self._allgather_blocks(what, outs, list(input_tensors), opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """Several all_gather_into_tensor calls as one work (torch's coalescing manager).

        Args:
            outputs: the output tensors.
            inputs: the input tensors, one per output.
            opts: torch's AllgatherOptions.

        Returns:
            A RumorWork.
        """
        if _off_cpu(outputs, inputs):
            return self._device_call('allgather_into_tensor_coalesced', (outputs, inputs, opts))
        return self._coalesced("all_gather_into_tensor_coalesced",
                               [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)])

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """Several reduce_scatter_tensor calls as one work (torch's coalescing manager).

        Args:
            outputs: the output tensors.
            inputs: the input tensors, one per output.
            opts: torch's ReduceScatterOptions.

        Returns:
            A RumorWork.
        """
        if _off_cpu(outputs, inputs):
            return self._device_call('reduce_scatter_tensor_coalesced', (outputs, inputs, opts))
        return self._coalesced("reduce_scatter_tensor_coalesced",
                               [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)])

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _coalesced(self, what, works: List[RumorWork]) -> RumorWork:
        def finish():
            out = []
            for w in works:
                w.wait()
                out += w._result
            return out

        return self._work(what, self._all(), [_Part(w) for w in works], tuple(works), finish)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        """all_to_all_single of CPU tensors with even or uneven splits along dim 0.

        Args:
            output: receives every rank's block for this rank, in rank order.
            input: holds this rank's block for every rank, in rank order.
            output_split_sizes: rows received from each rank (empty: even split).
            input_split_sizes: rows sent to each rank (empty: even split).
            opts: torch's AllToAllOptions.

        Returns:
            A RumorWork.
        """
        if _off_cpu(output, input):
            return self._device_call('all_to_all_single', (output, input, output_split_sizes, input_split_sizes, opts))
        what = "all_to_all_single"
        _check_cpu([output], what, "output")
        _check_cpu([input], what, "input")
        _same_dtype([output], input.dtype, what, "output")
        n = self._size
        send = self._splits(input, input_split_sizes, what, "input_split_sizes")
        recv = self._splits(output, output_split_sizes, what, "output_split_sizes")
        if input.dim() > 0 and output.dim() > 0 and tuple(input.shape[1:]) != tuple(output.shape[1:]):
            raise ValueError(f"{_where(what)}: input and output must agree on every dim but the first, "
                             f"got {list(input.shape)} and {list(output.shape)}")
        per_row = math.prod(input.shape[1:]) if input.dim() > 0 else 1
        code, per = movable_code(input)
        src, dst = _contig(input), _contig(output)

        def finish():
            if dst.data_ptr() != output.data_ptr():
                output.copy_(dst)
            return [output]

        ws = self._collective(opts, what, self._all(), _nbytes(src), lambda nb: self._comm.alltoall(
            src.data_ptr(), [s * per_row * per for s in send], dst.data_ptr(),
            [r * per_row * per for r in recv], code, nb))
        del n
        return self._work(what, self._all(), ws, (src, dst, output), finish)

    alltoall_base = all_to_all_single

    def _splits(self, t, sizes, what, arg):
        rows = t.shape[0] if t.dim() > 0 else 1
        if not sizes:
            if rows % self._size:
                raise ValueError(f"{_where(what)}: dim 0 ({rows}) is not divisible by the group size "
                                 f"({self._size}); pass {arg}")
            return [rows // self._size] * self._size
        sizes = [int(s) for s in sizes]
        if len(sizes) != self._size or any(s < 0 for s in sizes) or sum(sizes) != rows:
            raise ValueError(f"{_where(what)}: {arg} must be {self._size} non-negative row counts summing "
                             f"to {rows}, got {sizes}")
        return sizes

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """all_to_all of lists of CPU tensors (dist.all_to_all); sizes may differ per rank.

        Args:
            output_tensors: group-size tensors, received from each rank.
            input_tensors: group-size tensors, sent to each rank.
            opts: torch's AllToAllOptions.

        Returns:
            A RumorWork.
        """
        if _off_cpu(output_tensors, input_tensors):
            return self._device_call('alltoall', (output_tensors, input_tensors, opts))
        what = "all_to_all"
        n = self._size
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(f"{_where(what)}: output_tensor_list and input_tensor_list must each hold "
                             f"{n} tensors (the group size)")
        _check_cpu(input_tensors, what, "input_tensor_list")
        _check_cpu(output_tensors, what, "output_tensor_list")
        dtype = input_tensors[0].dtype
        _same_dtype(input_tensors, dtype, what, "input_tensor_list")
        _same_dtype(output_tensors, dtype, what, "output_tensor_list")
        code, per = movable_code(input_tensors[0])
        src = torch.cat([t.reshape(-1) for t in input_tensors])
        dst = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype)

        def finish():
            off = 0
            for o in output_tensors:
                o.copy_(dst[off: off + o.numel()].view_as(o))
                off += o.numel()
            return list(output_tensors)

        ws = self._collective(opts, what, self._all(), _nbytes(src), lambda nb: self._comm.alltoall(
            src.data_ptr(), [t.numel() * per for t in input_tensors], dst.data_ptr(),
            [t.numel() * per for t in output_tensors], code, nb))
        return self._work(what, self._all(), ws, (src, dst), finish)

    def gather(self, output_tensors, input_tensors, opts=None):
        """gather of one CPU tensor per rank onto the root (dist.gather).

        Args:
            output_tensors: on the root a list of one list of group-size tensors, else empty.
            input_tensors: a list of one tensor.
            opts: torch's GatherOptions (rootRank).

        Returns:
            A RumorWork.
        """
        if _off_cpu(output_tensors, input_tensors):
            return self._device_call('gather', (output_tensors, input_tensors, opts))
        what = "gather"
        opts = opts or dist.GatherOptions()
        t = self._one(input_tensors, what)
        root = self._root(opts.rootRank, what)
        peer = f"root {self._peer(root)}"
        if self._rank != root:
            buf = _contig(t)
            w = self._issue(what, peer, lambda: self._comm.send(
                buf.data_ptr(), buf.numel() * buf.element_size(), root, True))
            return self._work(what, peer, [w], (buf,), lambda: [t])
        if len(output_tensors) != 1 or len(output_tensors[0]) != self._size:
            raise ValueError(f"{_where(what)}: on the root, gather_list"
                             f" must hold {self._size} tensors (the group size)")
        outs = list(output_tensors[0])
        _check_cpu(outs, what, "gather_list")
        _same_dtype(outs, t.dtype, what, "gather_list")
        bufs, works = [], []
        for r, o in enumerate(outs):
            if r == root:
                o.copy_(t)
                continue
            b = _contig(o)
            bufs.append((b, o))
            works.append(self._issue(what, self._peer(r), lambda b=b, r=r: self._comm.recv(
                b.data_ptr(), b.numel() * b.element_size(), r, True)))

        def finish():
            for b, o in bufs:
                if b.data_ptr() != o.data_ptr():
                    o.copy_(b)
            return outs

        return self._work(what, self._all(), works, tuple(bufs), finish)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """scatter of the root's list of CPU tensors, one to each rank (dist.scatter).

        Args:
            output_tensors: a list of one tensor, this rank's block.
            input_tensors: on the root a list of one list of group-size tensors, else empty.
            opts: torch's ScatterOptions (rootRank).

        Returns:
            A RumorWork.
        """
        if _off_cpu(output_tensors, input_tensors):
            return self._device_call('scatter', (output_tensors, input_tensors, opts))
        what = "scatter"
        opts = opts or dist.ScatterOptions()
        out = self._one(output_tensors, what)
        root = self._root(opts.rootRank, what)
        peer = f"root {self._peer(root)}"
        if self._rank != root:
            buf = _contig(out)

            def finish_leaf():
                if buf.data_ptr() != out.data_ptr():
                    out.copy_(buf)
                return [out]

            w = self._issue(what, peer, lambda: self._comm.recv(
                buf.data_ptr(), buf.numel() * buf.element_size(), root, True))
            return self._work(what, peer, [w], (buf,), finish_leaf)
        if len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
            raise ValueError(f"{_where(what)}: on the root, scatter_list"
                             f" must hold {self._size} tensors (the group size)")
        ins = list(input_tensors[0])
        _check_cpu(ins, what, "scatter_list")
        _same_dtype(ins, out.dtype, what, "scatter_list")
        keep, works = [], []
        for r, s in enumerate(ins):
            if r == root:
                out.copy_(s)
                continue
            b = _contig(s)
            keep.append(b)
            works.append(self._issue(what, self._peer(r), lambda b=b, r=r: self._comm.send(
                b.data_ptr(), b.numel() * b.element_size(), r, True)))
        return self._work(what, self._all(), works, tuple(keep), lambda: [out])

    def barrier(self, opts=None):
        """A barrier of the group (dist.barrier).

        Args:
            opts: torch's BarrierOptions.

        Returns:
            A RumorWork.
        """
        what = "barrier"
        ws = self._collective(opts, what, self._all(), 0, lambda nb: self._comm.barrier(nb))
        return self._work(what, self._all(), ws, (), lambda: [])

    def monitored_barrier(self, timeout: Optional[datetime.timedelta] = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored_barrier on this group (torch's dist.monitored_barrier refuses every
        backend but gloo: call rumor.torch_backend.monitored_barrier). Every rank reports to
        group rank 0 through the store; rank 0 names the ranks that did not arrive in time.
        It goes through the store, not the group's connections, so it still answers after a
        peer died or a collective failed.

        Args:
            timeout: how long rank 0 waits for the others and they wait for its release
                (default: the group's timeout; 0: rank 0 only looks, as gloo's does).
            wait_all_ranks: rank 0 names every missing rank, not only the first.

        Raises:
            torch.distributed.DistBackendError: on rank 0, the ranks that did not arrive; on the
                others, rank 0 did not release them in time (it failed, or is not there).
        """
        what = "monitored_barrier"
        limit = self._timeout if timeout is None else timeout.total_seconds()
        if limit < 0:
            raise ValueError(f"{_where(what)}: timeout must not be negative, got {timeout}")
        seq = self._monitored
        self._monitored += 1
        if self._size == 1:
            return
        if self._store is None:
            raise ValueError(f"{_where(what)}: this group was made without a store")
        key = f"monitored/{seq}/"
        deadline = time.monotonic() + limit
        if self._rank != 0:
            self._store.set(f"{key}{self._rank}", b"1")
            try:
                self._store.wait([f"{key}released"], datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            except Exception:  # noqa: BLE001 (the store's timeout error; rank 0 is what matters)
                raise dist.DistBackendError(
                    f"{_where(what)}: {self._peer(self._rank)} passed it but {self._peer(0)} did not release it "
                    f"within {limit:g} s (rank 0 failed, or found another rank missing)") from None
            return
        missing = []
        for r in range(1, self._size):
            left = deadline - time.monotonic()
            try:
                if left <= 0 or (missing and not wait_all_ranks):
                    raise TimeoutError
                self._store.wait([f"{key}{r}"], datetime.timedelta(seconds=left))
            except Exception:  # noqa: BLE001 (a timeout of the store's wait)
                if not self._store.check([f"{key}{r}"]):
                    missing.append(r)
                    if not wait_all_ranks:
                        break
        if missing:
            names = ", ".join(str(self._global[r]) for r in missing)
            raise dist.DistBackendError(
                f"{_where(what)}: {'ranks' if len(missing) > 1 else 'rank'} {names} failed to pass "
                f"monitored_barrier in {limit:g} s (waited for by {self._peer(0)})")
        for r in range(1, self._size):
            self._store.delete_key(f"{key}{r}")
        # Everyone arrived here, so everyone has seen the previous call's release: its key goes,
        # and the store holds one such key at most however many barriers a job runs.
        if seq > 0:
            self._store.delete_key(f"monitored/{seq - 1}/released")
        self._store.set(f"{key}released", b"1")

    # ---- point to point -------------------------------------------------------------------
    def _p2p_comm(self, src: int, dst: int, tag: int, what: str):
        if not 0 <= tag <= _P2P_MAX_TAG:
            raise ValueError(f"{_where(what)}: tag must be in [0, {_P2P_MAX_TAG}] on the rumor backend, got {tag}")
        if self._size > _P2P_MAX_RANKS:
            raise ValueError(f"{_where(what)}: point-to-point needs a group of at most {_P2P_MAX_RANKS} ranks")
        key = (src, dst, tag)
        with self._p2p_lock:
            c = self._p2p.get(key)
            if c is None:
                gid = _P2P_BASE | (tag << 24) | (src << 12) | dst
                c = _C.Communicator(self._ctx, gid, f"p2p {self._global[src]}->{self._global[dst]} tag {tag}",
                                    list(range(self._size)))
                self._p2p[key] = c
            return c

    def _p2p_check(self, tensors, other: int, what: str, role: str) -> torch.Tensor:
        t = self._one(tensors, what)
        if not 0 <= other < self._size or other == self._rank:
            raise ValueError(f"{_where(what)}: {role} {other} is not another rank of a group of size {self._size}")
        return t

    def send(self, tensors, dst_rank: int, tag: int = 0):
        """send of one CPU tensor to a peer (dist.send / isend); messages of one tag between two
        ranks arrive in order.

        Args:
            tensors: a list of one tensor.
            dst_rank: the destination's group rank.
            tag: matches the receiver's tag (0 to 2**23 - 1).

        Returns:
            A RumorWork.
        """
        if _off_cpu(tensors):
            return self._device_call('send', (tensors, dst_rank, tag))
        what = "send"
        t = self._p2p_check(tensors, dst_rank, what, "dst")
        c = self._p2p_comm(self._rank, dst_rank, tag, what)
        buf = _contig(t)
        peer = f"to {self._peer(dst_rank)}, tag {tag}"
        w = self._issue(what, peer, lambda: c.send(buf.data_ptr(), buf.numel() * buf.element_size(), dst_rank, True))
        return self._work(what, peer, [w], (buf,), lambda: [t])

    def recv(self, tensors, src_rank: int, tag: int = 0):
        """recv into one CPU tensor from a peer (dist.recv / irecv).

        Args:
            tensors: a list of one tensor, filled with the message.
            src_rank: the source's group rank.
            tag: matches the sender's tag.

        Returns:
            A RumorWork.
        """
        if _off_cpu(tensors):
            return self._device_call('recv', (tensors, src_rank, tag))
        what = "recv"
        t = self._p2p_check(tensors, src_rank, what, "src")
        c = self._p2p_comm(src_rank, self._rank, tag, what)
        buf = _contig(t)

        def finish():
            if buf.data_ptr() != t.data_ptr():
                t.copy_(buf)
            return [t]

        peer = f"from {self._peer(src_rank)}, tag {tag}"
        w = self._issue(what, peer, lambda: c.recv(buf.data_ptr(), buf.numel() * buf.element_size(), src_rank, True))
        return self._work(what, peer, [w], (buf, t), finish)

    def recv_anysource(self, tensors, tag: int = 0):
        """Not supported: rumor matches messages by source; pass src to dist.recv.

        Args:
            tensors: unused.
            tag: unused.

        Raises:
            ValueError: always.
        """
        raise ValueError(f"{_where('recv')}: src=None (receive from any source) is not supported; pass src")


_DYNAMO_HIDDEN = False
# Methods with a leading underscore that torch itself calls on a process group.
_TORCH_PRIVATE = frozenset({"_allgather_base", "_reduce_scatter_base"})


def _hide_from_dynamo() -> None:
    """torch.compile(DDP(model)) traces into the calls DDP makes on its group; dynamo cannot read
    a Python process group's attributes, so the group's methods run eagerly (a graph break),
    as a C++ group's calls do. Done when the first group is made: importing dynamo takes a
    moment, too much for `import rumor`."""
    global _DYNAMO_HIDDEN
    if _DYNAMO_HIDDEN:
        return
    _DYNAMO_HIDDEN = True
    try:
        from torch._dynamo import disable, trace_rules
    except Exception:  # noqa: BLE001 (a torch without dynamo has nothing to hide from)
        return
    # Only what torch calls: everything those call runs eagerly too.
    entries = [
        (cls, name, fn)
        for cls in (RumorProcessGroup, RumorWork, _StagedWork)
        for name, fn in vars(cls).items()
        if callable(fn) and (not name.startswith("_") or name in _TORCH_PRIVATE)
    ]
    try:
        # Where torch has per-code frame actions: a traced call into this file is a graph break
        # (its file is skipped), and an entry point skips dynamo for itself and all it calls.
        # Unlike disable()'s wrapper (~1 us a call, several calls an op, ~10 us of a 4 KiB op
        # on a loaded host), this costs nothing when no compiled code is running.
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        skip = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
        trace_rules.add(__name__)
        for _cls, _name, fn in entries:
            set_code_exec_strategy(fn.__code__, skip)
    except Exception:  # noqa: BLE001 (an older torch: its wrapper does the same, at a cost)
        for cls, name, fn in entries:
            setattr(cls, name, disable(fn, recursive=True))


def _create(opts, backend_options=None):
    """torch's creator (extended API): one RumorProcessGroup per group, met through its store."""
    _hide_from_dynamo()
    cuda = _cuda_target(_device_map())
    rank, size = int(opts.group_rank), int(opts.group_size)
    timeout = opts.timeout.total_seconds() if opts.timeout is not None else 1800.0
    if timeout <= 0:
        raise ValueError(f"init_process_group(backend='rumor'): timeout must be positive, got {opts.timeout}")
    store = dist.PrefixStore("rumor/", opts.store)
    master = _store_host(opts.store)
    # Under torchrun its local world size tells whether every rank is on this host (which
    # decides whether a job secret is required, as for rumor.init()).
    source = "torchrun" if os.environ.get("LOCAL_WORLD_SIZE") and os.environ.get("WORLD_SIZE") else "torch.distributed"
    env = _rendezvous.Env(rank, size, master, 0, source)
    copts = _runtime.core_options(timeout)
    host = _rendezvous.host_id()
    site_error = None
    if size == 1:
        ctx = _C.Context(0, 1, os.urandom(16), copts, 0)
        ctx.set_peers([f"127.0.0.1:{ctx.port}"], [host])
    else:
        js = _rendezvous.job_secret_for(env)
        if copts.shm:
            _shm.sweep()
        advertise = _rendezvous.advertise_address(master, 0)
        bind = os.environ.get("RUMOR_BIND_ADDR", advertise)

        def make_ctx(tok: bytes):
            return _C.Context(rank, size, tok, copts, 0, key=js.key("connection", tok), bind=bind)

        ctx, _token, entries = _rendezvous.exchange(store, env, timeout, make_ctx, host, advertise, js)
        hosts = [e[2] for e in entries]
        ctx.set_peers([e[1] for e in entries], hosts, [e[3] for e in entries])
        site_error = _rendezvous.apply_sites(ctx, entries, "init_process_group(backend='rumor')")
        if env_bool("RUMOR_BIND_CORES", False) and not opts.global_ranks_in_group:
            # As rumor.init() does (docs/environment.md), by the default group's local ranks only:
            # a subgroup's would bind the same process elsewhere.
            local = [r for r in range(size) if hosts[r] == hosts[rank]]
            _runtime._bind_core(local.index(rank), len(local))
    pg = RumorProcessGroup(ctx, rank, size, timeout, list(opts.global_ranks_in_group or []), store=store, cuda=cuda)
    # Every rank must have mapped its local peers' shared memory before the names can go.
    pg._comm.barrier(False)
    ctx.seal()
    if site_error:
        raise ValueError(site_error)
    return pg


def register() -> None:
    """Registers the "rumor" backend with torch.distributed (done by `import rumor`; again is a
    no-op). Cheap: nothing starts until init_process_group(backend="rumor") or new_group."""
    if not dist.is_available() or "RUMOR" in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def monitored_barrier(group: Optional[dist.ProcessGroup] = None, timeout: Optional[datetime.timedelta] = None,
                      wait_all_ranks: bool = False) -> None:
    """dist.monitored_barrier for rumor's groups (torch's own refuses every backend but gloo);
    on any other group it calls torch's.

    Args:
        group: the process group (default: the default group).
        timeout: how long to wait (default: the group's timeout).
        wait_all_ranks: rank 0 names every rank that did not arrive, not only the first.

    Raises:
        torch.distributed.DistBackendError: some rank did not arrive in time (named on rank 0).
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if isinstance(pg, RumorProcessGroup):
        pg.monitored_barrier(timeout, wait_all_ranks)
    else:
        dist.monitored_barrier(group, timeout, wait_all_ranks)


__all__ = ["RumorProcessGroup", "RumorWork", "register", "monitored_barrier", "BACKEND_NAME"]
