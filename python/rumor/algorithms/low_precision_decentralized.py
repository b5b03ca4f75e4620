"""Low-precision decentralized SGD: ring neighbours exchange 8-bit (MinMaxU8) compressed
model differences and keep replicas of each other's weights (see docs/decentralized_training.md)."""
from __future__ import annotations

import torch

from .. import _C
from .._tensor import address, dtype_code
from .base import Algorithm
from ..engine.flat import FlatWeights
from .decentralized import _check_interval, check_peer_selection


class LowPrecisionDecentralized(Algorithm):
    """Decentralized SGD on a ring with compressed communication (difference compression with
    error compensation, the scheme of Bagua's low-precision decentralized SGD).

    Every rank i keeps its weights x, its tracked copy xh (what its neighbours believe x to be;
    initially x) and replicas xh_l, xh_r of its left and right ring neighbours' tracked copies.
    A communicating step (every ``communication_interval``-th, after ``optimizer.step()``
    turned x into y)::

        x   = y + w * (xh_l + xh_r) - 2 * w * xh          (w = 1/3; on a ring of two: w = 1/2
                                                           and the one neighbour counts once)
        q   = MinMaxU8(x - xh);   xh += decode(q)
        send q to both neighbours; xh_l += decode(q_l); xh_r += decode(q_r)

    The exchange of q runs on the comm thread while the next forward and backward compute;
    the next communicating step waits for it. Quantisation error is not lost: x - xh carries it
    into the next difference. Steps that do not communicate only apply the optimizer.

    hierarchical: ranks of a host average their weights over shared memory, the ring runs over
    one leader per host, and the leader's result is broadcast inside the host (on a single host:
    an exact average, no ring).

    peer_selection: "ring" (the only one, and the default): the same peers, with the same 1/3
    weights, as ``Decentralized(peer_selection="ring")``. The others are refused: each rank keeps
    replicas of its neighbours' tracked copies, built up from every difference they sent, so the
    neighbours cannot change from round to round ("shift_one", "exp2") nor be everyone ("all").

    Needs the optimizer: ``DistributedDataParallel(model, optimizer=opt, algorithm=...)``.
    Parameters must be float32 or float64.

    Args:
        hierarchical: run the ring over one leader per host after a shared-memory average inside
            each host (see above); default True.
        communication_interval: communicate at every communication_interval-th optimizer step,
            an integer >= 1; default 1.
        chunk: elements per MinMaxU8 chunk (each sends its own minimum and maximum), an integer
            >= 0; 0, the default, takes the codec's default.

    Raises:
        ValueError: communication_interval is not an integer >= 1 or chunk not an integer >= 0;
            at init(), the wrapper was given no optimizer.
    """

    elastic_consensus = True  # the ranks' replicas differ: a commit keeps their average

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1, chunk: int = 0,
                 peer_selection: str = "ring"):
        self.peer_selection = check_peer_selection(
            "LowPrecisionDecentralized", peer_selection, ("ring",),
            why=" (each rank keeps replicas of its ring neighbours' weights, updated by the compressed differences "
                "they send: the neighbours must stay the same two)")
        self.hierarchical = bool(hierarchical)
        self.communication_interval = _check_interval(communication_interval)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"LowPrecisionDecentralized: chunk must be an integer >= 0, got {chunk!r}")
        self.chunk = chunk
        self.step = 0
        self._pending = None
        self._live_mark = None  # (weights, step) after the last applied step, under rumor-run --live

    # Live membership (rumor-run --live): a step's mix runs in after_step and its exchange is
    # waited for in the next backward, so a failure there gives up that next step: the weights and
    # the step count go back to the last applied step. At a change the members start from the
    # average of their replicas (rumor.elastic), the ring is laid over the new world's ranks (1/3
    # each; two ranks: 1/2), and the tracked copies and the neighbours' replicas start over from
    # that average (load_elastic_state_dict), as at the start of training.
    elastic_live = True

    def elastic_live_mark(self) -> None:
        """Keeps a copy of the weights (mixed by the step just applied) and the step count."""
        self._flat.ensure_views()
        self._live_mark = ([f.clone() for f in self._flat.flats], self.step)

    def elastic_live_undo(self) -> None:
        """Puts back the weights and the step count of the last mark; the exchange in flight is
        dropped (its communicator is being shut down)."""
        if self._live_mark is None:
            return
        flats, self.step = self._live_mark
        self._pending = None
        self._flat.ensure_views()
        with torch.no_grad():
            for f, m in zip(self._flat.flats, flats):
                f.copy_(m)

    def init(self, ddp) -> None:
        if ddp.optimizer is None:
            raise ValueError("LowPrecisionDecentralized mixes weights after optimizer.step(): pass the optimizer "
                             "to rumor.DistributedDataParallel(..., optimizer=opt)")
        self._flat = FlatWeights(ddp._params, ddp._cap_bytes, "LowPrecisionDecentralized",
                                 dtypes=(torch.float32, torch.float64))
        self._ddp_device = ddp._device_mode is not None
        self._comm = ddp.group._comm
        self._make_ops()

    def _make_ops(self) -> None:
        # Each op starts its tracked copy and its neighbours' replicas at the current weights.
        if self._ddp_device:
            from ..engine.ops import LowPrecisionRing

            comm = self._comm
            self.ops = [LowPrecisionRing(f, comm.size, comm.rank, self.hierarchical, comm.all_local, self.chunk)
                        for f in self._flat.flats]
            return
        self.ops = [_C.LowPrecisionMixOp(address(f), f.numel(), dtype_code(f.dtype, "LowPrecisionDecentralized"),
                                         self.hierarchical, self.chunk)
                    for f in self._flat.flats]

    def elastic_state_dict(self):
        """The algorithm's own part of a rumor.elastic commit: the step counter (the replicas of
        the neighbours' weights are not saved; they restart from the committed weights).

        Returns:
            A dict with ``step``, the optimizer steps so far.
        """
        return {"step": self.step}

    def load_elastic_state_dict(self, sd) -> None:
        """Restores the step counter saved by elastic_state_dict() and restarts the tracked copy
        and the neighbours' replicas from the weights just loaded, as at the start of training
        (rumor.elastic calls it after loading the model and the optimizer).

        Args:
            sd: the dict elastic_state_dict() returned.

        Raises:
            RuntimeError: an exchange is still in flight (call synchronize() first).
        """
        # Every rank now holds the committed average: the tracked copies (what the neighbours
        # believe of each other) start over from it, as at the start of training.
        if self._pending is not None:
            raise RuntimeError("LowPrecisionDecentralized: cannot restore a commit while an exchange is in flight")
        self.step = int(sd["step"])
        self._flat.ensure_views()
        self._make_ops()

    def bucket_op(self, ddp, bucket):
        return _C.local_op()

    # CUDA parameters: the replicas live on the device and the exchange goes over NCCL; the
    # hierarchical form across hosts (a host average around a ring of leaders) has no device form.
    def has_device_ops(self, ddp, nccl: bool) -> bool:
        return nccl and not (self.hierarchical and not ddp.group._comm.all_local)

    def device_bucket_op(self, ddp, bucket):
        from ..engine.ops import LocalOp

        return LocalOp()

    def _wait(self, ddp) -> None:
        work, self._pending = self._pending, None
        if work is not None:
            work.wait(ddp._timeout)

    def after_backward(self, ddp) -> None:
        # The previous exchange ran behind this forward and backward; surface its errors here.
        self._wait(ddp)

    def after_step(self, ddp) -> None:
        step, self.step = self.step, self.step + 1
        if step % self.communication_interval != 0:
            return
        self._wait(ddp)
        self._flat.ensure_views()
        if self._ddp_device:
            # The mix and the compression on the current stream; the exchange queued from here
            # (its place among this thread's calls on the group); the decoding of what came,
            # which reads headers on the host, on the engine's worker.
            engine, ops = ddp._engine, self.ops
            for op in ops:
                op.prepare(engine.transport)

            def send(tp, stream):
                for op in ops:
                    op.send(tp)

            def receive(tp, stream):
                tp.settle("rumor LowPrecisionDecentralized: exchange with the ring neighbours")
                for op in ops:
                    op.receive()

            self._pending = engine.submit(send, "rumor LowPrecisionDecentralized: exchange", inline=True,
                                          then=receive)
            return
        comm = ddp.group._comm
        _C.low_precision_prepare(comm, self.ops)
        self._pending = _C.low_precision_exchange(comm, self.ops, True)

    def synchronize(self, ddp) -> None:
        """Waits for the exchange in flight (before checkpointing the replicas, say) and raises
        its error, if it failed.

        Args:
            ddp: the wrapper (its timeout bounds the wait).
        """
        self._wait(ddp)
