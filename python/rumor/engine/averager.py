"""The outer average of DiLoCo and StreamingDiLoCo on CUDA parameters: one group's average of a
flat buffer, on its own communication stream (NCCL) or staged through page-locked host memory,
run by the same machinery as the bucket engine (rumor.engine.device)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _C
from .._tensor import address, dtype_code
from .device import CudaLayer, DeviceEngine, EmulatedLayer, Ticket, emulated


class GroupAverager:
    """In-place averages of device tensors over a group of their own, in the background: DiLoCo's
    pseudo-gradients on CUDA. average(buf, step) returns a Ticket (wait(timeout) makes the
    current stream wait for the result).

    Over NCCL a plain average is queued right away from the calling thread (an ncclAllReduce on
    the averager's stream); a compressed one (rumor.engine.ops.CompressedOp, which decodes on the
    host's word) runs on the averager's worker, so every average of one averager takes the same
    path and the group sees them in the same order on every rank. Without NCCL (host transport,
    or hierarchical=True across hosts, which only the C++ ops do) each average is staged: a
    page-locked copy, the C++ op, the copy back, on the worker.

    kind/levels/chunk: the codec of rumor.algorithms.bytegrad (None: full precision); seeds and
    blocks as the C++ compressed allreduce with seed=seed and call number `step`."""

    def __init__(self, group, device: Optional[torch.device], codec, hierarchical: bool, timeout_fn):
        from . import ops as device_ops

        self.codec, self.hierarchical = codec, bool(hierarchical)
        self.comm = group._comm
        if device is None:  # EMULATE
            layer = EmulatedLayer()
            direct = emulated() == "direct"
            transport = device_ops.HostTransport(self.comm) if direct else None
        else:
            from ..gpu import routing

            # The group agrees on its transport now: every rank builds its averager together.
            gpu = routing.route("rumor DiLoCo", group, ("buffer", torch.empty(1, device=device)))
            layer = CudaLayer(device)
            direct = gpu.transport == "nccl"
            transport = device_ops.NcclTransport(gpu) if direct else None
        self.staged = not direct or (self.hierarchical and not self.comm.all_local)
        self.engine = DeviceEngine(layer, "direct", transport, self.comm, timeout_fn)
        self._twins = {}

    def average(self, buf: torch.Tensor, step: int) -> Ticket:
        what = f"rumor DiLoCo: average of {buf.numel()} elements"
        if self.staged:
            return self.engine.submit(lambda tp, stream: self._staged(buf, step, stream), what, inline=False)
        if self.codec is None or (self.hierarchical and self.comm.all_local):
            # Full precision, or compressed-and-hierarchical on one host (nothing is compressed
            # there, as in the C++ op): one allreduce.
            return self.engine.submit(lambda tp, stream: tp.allreduce(buf, 1), what, inline=self.codec is None)
        from .ops import CompressedOp

        kind, levels, chunk = self.codec
        op = CompressedOp(kind, chunk, levels, True, seed=1)
        op.calls = step

        def run(tp, stream):
            op.run(buf, tp)

        return self.engine.submit(run, what, inline=False)

    def _staged(self, buf: torch.Tensor, step: int, stream) -> None:
        layer = self.engine.layer
        twin = self._twins.get(id(buf))
        if twin is None or twin.numel() != buf.numel():
            twin = self._twins[id(buf)] = layer.pinned_like(buf)
        with layer.on(stream):
            twin.copy_(buf, non_blocking=True)
            copied = layer.record(stream)
        timeout = self.engine._state.timeout_fn()
        layer.host_wait(copied, timeout, "rumor DiLoCo: copying to host memory")
        code = dtype_code(twin.dtype, "DiLoCo")
        if self.codec is None:
            algo = 3 if self.hierarchical else 0  # collectives.ALGORITHMS: hierarchical / auto
            self.comm.allreduce(address(twin), twin.numel(), code, 1, algo, False)
        else:
            kind, levels, chunk = self.codec
            _C.compressed_allreduce(self.comm, address(twin), twin.numel(), code, kind=kind, chunk=chunk,
                                    levels=levels, average=True, hierarchical=self.hierarchical, seed=1, step=step,
                                    nonblocking=False)
        with layer.on(stream):
            buf.copy_(twin, non_blocking=True)

    def close(self) -> None:
        self.engine.close()
