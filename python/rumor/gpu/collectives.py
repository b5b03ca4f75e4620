"""rumor's collectives on CUDA tensors (docs/gpu.md). rumor.gpu.routing routes a call here once its
tensors are all on the group's CUDA device; the group's transport then decides:

- nccl: the op is queued on torch's current stream of that device through the group's
  rumor._C.NcclCommunicator, followed by an event. A blocking call returns once the event
  passed (waited for with rumor's deadline); a *_nonblocking call returns a Handle whose wait()
  does that wait. So no call returns leaving work that could hang unseen behind it. With
  rumor.set_gpu_wait("stream") a blocking call returns once queued and the group's watch
  (rumor.gpu.watch) keeps the deadline instead: the work cannot hang unseen either, it is
  aborted at the deadline and the group's next call raises.
- host: the input is copied into page-locked host memory on the current stream (waited for with
  a deadline), rumor's CPU collective runs on it, and the result is copied back on the same
  stream; a nonblocking call's Handle.wait() finishes the CPU op and queues that copy.

Either way the result is ordered on the stream that was current when the call was made.
"""
from __future__ import annotations

import math
import time

import torch

from .. import _runtime
from .. import _host_collectives as C
from .routing import GpuGroup, wait_event
from .._tensor import address, check_dense, dtype_code, movable_code


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


# ---- host staging --------------------------------------------------------------------------------

class _Stage:
    """One staged call: page-locked buffers from the group's cache, copies on the caller's stream."""

    def __init__(self, gpu: GpuGroup, what: str):
        self.gpu, self.what = gpu, what
        self.stream = torch.cuda.current_stream(gpu.torch_device)
        self.timeout = _runtime.state().timeout
        self.taken = []

    def pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(shape)
        nbytes = math.prod(shape) * _element_size(dtype)
        raw = self.gpu.pinned.take(nbytes, self.timeout, self.what)
        self.taken.append(raw)
        return raw[:nbytes].view(dtype).view(shape)

    def copy_in(self, t: torch.Tensor) -> torch.Tensor:
        """A page-locked CPU copy of t, complete when this returns: the CPU collective reads it
        from the host, outside any stream's order."""
        buf = self.pinned(t.shape, t.dtype)
        with torch.cuda.stream(self.stream):
            buf.copy_(t, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        wait_event(ev, self.timeout, f"{self.what}: copying the input to host memory")
        return buf

    def to_gpu(self, src: torch.Tensor, dst=None) -> torch.Tensor:
        """dst (new when None) <- src, queued on the call's stream (also when a Handle finishes
        under another current stream), so the caller's later work on that stream sees it."""
        with torch.cuda.stream(self.stream):
            if dst is None:
                dst = torch.empty(src.shape, dtype=src.dtype, device=self.gpu.torch_device)
            dst.copy_(src, non_blocking=True)
        return dst

    def release(self) -> None:
        """Gives the buffers back with an event after the copies queued so far: the next user
        waits for it, so a buffer is never overwritten while a copy still reads it."""
        if not self.taken:
            return
        ev = torch.cuda.Event()
        ev.record(self.stream)
        for raw in self.taken:
            self.gpu.pinned.give(raw, ev)
        self.taken = []

    def run(self, nonblocking: bool, cpu_call, back):
        """cpu_call(nonblocking) runs the CPU collective on the pinned buffers (a result or a
        Handle); back(CPU result) queues the copy to the GPU and returns the CUDA result."""
        try:
            res = cpu_call(nonblocking)
        except BaseException:
            self.release()
            raise
        if not nonblocking:
            try:
                return back(res)
            finally:
                self.release()

        def finish():
            try:
                return back(res.wait())
            finally:
                self.release()

        return C.Handle(res._work, (res,), finish)


# ---- NCCL --------------------------------------------------------------------------------------

class _NcclWork:
    """The Handle's work for an op queued on a stream: done() asks the event (and NCCL for
    errors), wait() polls both through the communicator until the op's deadline."""

    def __init__(self, comm, event, deadline: float, what: str, watch=None):
        self.comm, self.event, self.deadline, self.what = comm, event, deadline, what
        self.gpu_watch = watch  # an earlier op queued without a host wait may have failed

    def done(self) -> bool:
        self.comm.check(self.what)
        return bool(self.event.query())

    def wait(self, timeout: float) -> None:
        watch = self.gpu_watch
        if watch is not None:
            watch.raise_error(self.what)
        left = min(float(timeout), self.deadline - time.monotonic())
        # A wait that starts after the deadline still sees an op that has completed: the
        # communicator asks the event before it looks at the clock.
        self.comm.wait(self.event.query, max(left, 1e-3), self.what)


_SPIN_S = 50e-6  # a blocking call asks its event alone this long before the deadline-keeping wait


class _Nccl:
    """One NCCL call: the group's communicator, torch's current stream of the group's device."""

    def __init__(self, gpu: GpuGroup, g, what: str, nonblocking: bool = False):
        self.gpu, self.g, self.what = gpu, g, what
        self.comm = gpu.comm
        if gpu.watch is not None:
            gpu.watch.raise_error(what)
        self.stream = torch.cuda.current_stream(gpu.torch_device)
        self.handle = self.stream.cuda_stream
        st = _runtime.state()
        self.timeout = st.timeout
        # RUMOR_GPU_WAIT=stream: a blocking call returns once queued, its deadline kept by the watch.
        self.queue_only = st.gpu_wait == "stream" and not nonblocking and gpu.watch is not None
        self.returns_early = nonblocking or self.queue_only

    def empty(self, shape, dtype) -> torch.Tensor:
        # Allocated on the op's stream (the current stream of the tensor's device, whatever the
        # current device): the caching allocator reuses its memory only for work ordered after
        # the op. The same holds for the contiguous copies the ops make.
        return torch.empty(tuple(shape), dtype=dtype, device=self.gpu.torch_device)

    def uses(self, *tensors) -> None:
        # A caller's tensor made on another stream must not be reused while NCCL reads or writes
        # it. Not needed where the call returns only after the op finished (a blocking call with
        # host waiting, the default).
        if not self.returns_early:
            return
        for t in tensors:
            if t is not None and t.numel():
                t.record_stream(self.stream)

    def call(self, fn, *args) -> None:
        # NCCL launches on the communicator's device; the current device may be another.
        if torch.cuda.current_device() == self.gpu.device:
            fn(*args, self.handle)
        else:
            with torch.cuda.device(self.gpu.device):
                fn(*args, self.handle)

    def _work(self, ev) -> _NcclWork:
        return _NcclWork(self.comm, ev, time.monotonic() + self.timeout, self.what, self.gpu.watch)

    def done(self, nonblocking: bool, keep: tuple, finish):
        gpu = self.gpu
        ev = gpu.event()
        ev.record(self.stream)
        if self.queue_only:
            # The watch keeps the deadline (and gives the event back once it passed). The tensors
            # need no holding: those made here were allocated on this stream and the caller's are
            # record_stream'ed (uses()). finish() queues on the current stream, still the op's.
            gpu.watch.add(self.handle, ev, self.timeout, self.what)
            return finish()
        if not nonblocking:
            # A small op passes within microseconds of being queued: asking the event alone for
            # that long answers sooner than the deadline-keeping wait, whose polls each go
            # through the communicator's lock and NCCL's error state.
            spin_end = time.perf_counter() + _SPIN_S
            query = ev.query
            while not query():
                if time.perf_counter() > spin_end:
                    self._work(ev).wait(self.timeout)
                    break
            gpu.recycle(ev)
            return finish()
        work = self._work(ev)

        def on_stream():
            # Handle.wait() may run under another current stream than the call's.
            with torch.cuda.stream(self.stream):
                return finish()

        return C.Handle(work, keep, on_stream)


# ---- the collectives -----------------------------------------------------------------------------

def allreduce(gpu, g, t, op, group, inplace, nonblocking, algorithm, what):
    check_dense(t, what)
    if gpu.transport == "host":
        s = _Stage(gpu, what)
        buf = s.copy_in(t)
        return s.run(nonblocking, lambda nb: C.allreduce(buf, op, group, True, nb, algorithm, what),
                     lambda res: s.to_gpu(res, t if inplace else None))
    code = dtype_code(t.dtype, what)
    o = C.op_code(op, what)
    if algorithm not in C.ALGORITHMS:
        raise ValueError(f"{what}: algorithm must be one of {sorted(C.ALGORITHMS)}, got {algorithm!r}")
    # algorithm= chooses among rumor's CPU algorithms; NCCL picks its own.
    n = _Nccl(gpu, g, what, nonblocking)
    src = _contig(t)
    out = src if inplace else n.empty(src.shape, src.dtype)
    n.uses(t)
    if src.numel():
        n.call(n.comm.allreduce, address(src), address(out), src.numel(), code, o)
    finish = (lambda: C.blocking_result(t, out, True)) if inplace else (lambda: out)
    return n.done(nonblocking, (src, out, t), finish)


def broadcast(gpu, g, t, root, group, inplace, nonblocking, what):
    check_dense(t, what)
    if gpu.transport == "host":
        s = _Stage(gpu, what)
        buf = s.copy_in(t)
        return s.run(nonblocking, lambda nb: C.broadcast(buf, root, group, True, nb, what),
                     lambda res: s.to_gpu(res, t if inplace else None))
    code, per = movable_code(t)
    r = C.group_rank(g, root, what, "root")
    n = _Nccl(gpu, g, what, nonblocking)
    src = _contig(t)
    out = src if inplace else n.empty(src.shape, src.dtype)
    n.uses(t)
    if src.numel():
        n.call(n.comm.broadcast, address(src), address(out), src.numel() * per, code, r)
    finish = (lambda: C.blocking_result(t, out, True)) if inplace else (lambda: out)
    return n.done(nonblocking, (src, out, t), finish)


def reduce(gpu, g, t, root, op, group, nonblocking, what):
    check_dense(t, what)
    if gpu.transport == "host":
        s = _Stage(gpu, what)
        buf = s.copy_in(t)
        return s.run(nonblocking, lambda nb: C.reduce(buf, root, op, group, nb, what), lambda res: s.to_gpu(res))
    code = dtype_code(t.dtype, what)
    r = C.group_rank(g, root, what, "root")
    o = C.op_code(op, what)
    n = _Nccl(gpu, g, what, nonblocking)
    src = _contig(t)
    is_root = g.rank() == r
    # NCCL writes the result on the root only; elsewhere its receive address is never touched.
    out = n.empty(src.shape, src.dtype) if is_root else src
    n.uses(t)
    if src.numel():
        n.call(n.comm.reduce, address(src), address(out), src.numel(), code, o, r)
    finish = (lambda: out) if is_root else (lambda: t.clone())
    return n.done(nonblocking, (src, out, t), finish)


def allgather(gpu, g, t, group, out, nonblocking, what):
    check_dense(t, what)
    if gpu.transport == "host":
        s = _Stage(gpu, what)
        buf = s.copy_in(t)

        def back(res):
            dst = None if out is None else C.check_out(out, t.dtype, res.shape, what, device=out.device)
            return s.to_gpu(res, dst)

        return s.run(nonblocking, lambda nb: C.allgather(buf, group, None, nb, what), back)
    code, per = movable_code(t)
    if t.dim() == 0:
        t = t.reshape(1)
    rows, tail = C.gather_rows(t, g, what)
    per_row = math.prod(tail)
    n = _Nccl(gpu, g, what, nonblocking)
    res = C.check_out(out, t.dtype, (sum(rows),) + tuple(tail), what, device=gpu.torch_device) if out is not None \
        else n.empty((sum(rows),) + tuple(tail), t.dtype)
    me = g.rank()
    src = _contig(t)
    n.uses(t, out)
    if sum(rows) == 0:
        pass
    elif len(set(rows)) == 1:
        n.call(n.comm.allgather, address(src), address(res), rows[me] * per_row * per, code)
    else:
        # Blocks of different sizes: NCCL's allgather takes one count, so each block travels by
        # send/recv, all in one NCCL group.
        starts = [sum(rows[:i]) for i in range(len(rows))]
        row_bytes = per_row * res.element_size()
        with torch.cuda.stream(n.stream):
            res[starts[me]:starts[me] + rows[me]].copy_(src)
        sends = [(address(src), rows[me] * per_row * per, p) for p in range(len(rows)) if p != me and rows[me]]
        recvs = [(address(res) + starts[p] * row_bytes, rows[p] * per_row * per, p)
                 for p in range(len(rows)) if p != me and rows[p]]
        n.call(n.comm.exchange, sends, recvs, code)
    return n.done(nonblocking, (src, res, t), lambda: res)


def reduce_scatter(gpu, g, t, op, group, out, nonblocking, what):
    check_dense(t, what)
    if t.dim() == 0:
        raise ValueError(f"{what}: expected a tensor with at least one dim to split along dim 0")
    rows = C.split_rows(t.shape[0], g.size())
    me = g.rank()
    shape = (rows[me],) + tuple(t.shape[1:])
    if out is not None:
        out = C.check_out(out, t.dtype, shape, what, device=gpu.torch_device)
    if gpu.transport == "host":
        s = _Stage(gpu, what)
        buf = s.copy_in(t)
        res = s.pinned(shape, t.dtype)
        return s.run(nonblocking, lambda nb: C.reduce_scatter(buf, op, group, res, nb, what),
                     lambda r: s.to_gpu(r, out))
    code = dtype_code(t.dtype, what)
    o = C.op_code(op, what)
    n = _Nccl(gpu, g, what, nonblocking)
    res = out if out is not None else n.empty(shape, t.dtype)
    n.uses(t, out)
    with torch.cuda.stream(n.stream):
        if len(set(rows)) == 1:
            src, tmp = _contig(t), res
        else:
            # Blocks as in torch.tensor_split (the first dim0 % n ranks get a row more); NCCL's
            # reduce_scatter takes equal blocks, so each block is padded to the largest.
            m = rows[0]
            src = torch.zeros((m * len(rows),) + tuple(t.shape[1:]), dtype=t.dtype, device=gpu.torch_device)
            start = 0
            for i, k in enumerate(rows):
                src[i * m:i * m + k].copy_(t[start:start + k])
                start += k
            tmp = torch.empty((m,) + tuple(t.shape[1:]), dtype=t.dtype, device=gpu.torch_device)
    if tmp.numel():
        n.call(n.comm.reduce_scatter, address(src), address(tmp), tmp.numel(), code, o)
    if tmp is not res:
        with torch.cuda.stream(n.stream):
            res.copy_(tmp[:rows[me]])
    return n.done(nonblocking, (src, tmp, res, t), lambda: res)


def alltoall(gpu, g, t, splits, group, nonblocking, what):
    """Staged on both transports (docs/gpu.md)."""
    check_dense(t, what)
    s = _Stage(gpu, what)
    buf = s.copy_in(t)
    return s.run(nonblocking, lambda nb: C.alltoall(buf, splits, group, nb, what), lambda res: s.to_gpu(res))


def send(gpu, g, t, dst, group, what):
    check_dense(t, what)
    if gpu.transport != "nccl":
        s = _Stage(gpu, what)
        buf = s.copy_in(t)
        try:
            C.send(buf, dst, group, what)
        finally:
            s.release()
        return None
    code, per = movable_code(t)
    d = C.group_rank(g, dst, what, "dst")
    n = _Nccl(gpu, g, what)
    src = _contig(t)
    n.uses(t)
    if src.numel():
        n.call(n.comm.send, address(src), src.numel() * per, code, d)
    n.done(False, (src, t), lambda: None)
    return None


def recv(gpu, g, t, src, group, what):
    check_dense(t, what)
    if gpu.transport != "nccl":
        s = _Stage(gpu, what)
        buf = s.pinned(t.shape, t.dtype)
        try:
            C.recv(buf, src, group, what)
            s.to_gpu(buf, t)
        finally:
            s.release()
        return t
    code, per = movable_code(t)
    p = C.group_rank(g, src, what, "src")
    n = _Nccl(gpu, g, what)
    buf = _contig(t)
    n.uses(t)
    if buf.numel():
        n.call(n.comm.recv, address(buf), buf.numel() * per, code, p)
    return n.done(False, (buf, t), lambda: C.blocking_result(t, buf, True))


def staged(gpu, t, nonblocking, what, cpu_call):
    """The neighbor ops: cpu_call(CPU tensor, nonblocking) is the CPU op; staged on both transports."""
    check_dense(t, what)
    s = _Stage(gpu, what)
    buf = s.copy_in(t)
    return s.run(nonblocking, lambda nb: cpu_call(buf, nb), lambda res: s.to_gpu(res))

