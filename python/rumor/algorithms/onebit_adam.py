"""The algorithm side of 1-bit Adam: momentum communicated with 1-bit compression."""
from __future__ import annotations

from typing import Dict, FrozenSet

import torch

from .. import _C
from ..optim.onebit_adam import OneBitAdamOptimizer
from .._tensor import address
from ..collectives import ALGORITHMS, ReduceOp
from .base import Algorithm
from .bytegrad import _check_chunk

_STATE_KEYS = ("exp_avg", "worker_error", "server_error")


class _BucketState:
    """Flat float32 buffers of one bucket: the momentum and the two error-feedback buffers.
    The optimizer state of each parameter holds views into them."""

    def __init__(self, bucket, op, flats: Dict[str, torch.Tensor]):
        self.bucket = bucket
        self.op = op
        self.flats = flats
        # 1 / Adam's frozen denominator, flat like the bucket; filled when compression starts
        self.inv_denom = torch.zeros_like(flats["exp_avg"])
        self.preconditioned = False

    def views(self, key: str):
        return self.views_of(self.flats[key])

    def views_of(self, flat: torch.Tensor):
        for p, off in zip(self.bucket.params, self.bucket.offsets):
            yield p, flat[off:off + p.numel()].view_as(p)


class OneBitAdamAlgorithm(Algorithm):
    """1-bit Adam with ``rumor.optim.OneBitAdamOptimizer``::

        opt = rumor.optim.OneBitAdamOptimizer(model.parameters(), lr=1e-3, freeze_step=100)
        model = rumor.DistributedDataParallel(model, optimizer=opt,
                                              algorithm=rumor.algorithms.OneBitAdamAlgorithm(opt))

    For the first ``freeze_step`` steps gradients are averaged at full precision and the optimizer
    runs Adam. Afterwards each bucket's op, on the communication thread as soon as the bucket's
    gradients are ready, updates the bucket's momentum from the local gradients and averages it
    across ranks with 1-bit (sign and per-chunk scale) compression and error feedback on both the
    sending ("worker") and the reducing ("server") side; the optimizer then applies it with the
    frozen variance. The momentum is kept preconditioned by that variance once it is frozen
    (see rumor.optim.OneBitAdamOptimizer), so 1-bit errors are bounded in units of the update. Momentum and error buffers are flat per bucket; the optimizer's state holds
    views into them, so ``optimizer.state_dict()`` saves them.

    chunk: elements per 1-bit chunk (one float32 scale each); 0 = the codec's default.
    hierarchical: average the momenta at full precision inside each host (shared memory), compress
    only among one leader per host, then broadcast inside the host: the network carries one 1-bit
    message per host and the compression sees each host's average. The leaders keep the error
    feedback; on one host it is a full-precision average. Off by default (every rank compresses).
    """

    def __init__(self, optimizer, chunk: int = 0, hierarchical: bool = False):
        if not isinstance(optimizer, OneBitAdamOptimizer):
            raise TypeError("rumor.algorithms.OneBitAdamAlgorithm: optimizer must be a rumor.optim.OneBitAdamOptimizer, "
                            f"got {type(optimizer).__name__}")
        if optimizer._algorithm is not None:
            raise ValueError("rumor.algorithms.OneBitAdamAlgorithm: this optimizer already belongs to another "
                             "rumor.algorithms.OneBitAdamAlgorithm")
        self.optimizer = optimizer
        self.chunk = _check_chunk(chunk, "rumor.algorithms.OneBitAdamAlgorithm")
        self.hierarchical = bool(hierarchical)
        self._states: Dict[int, _BucketState] = {}
        self._compressed_last = False
        self._live_mark = None  # (parameter, momentum) at the last applied step, under rumor-run --live

    # ---- elastic (rumor.elastic) ---------------------------------------------------------------

    # Weights, momentum and variance are the same on every rank (the momentum is averaged); the
    # error feedback is each rank's own and, on the server side, belongs to chunks whose owners
    # change with the world size. A restored job keeps the commit's optimizer state and starts
    # its error feedback from zero, as compression does when it begins.
    parity_own_keys = ("worker_error", "server_error")  # not compared by rumor.elastic.verify

    def elastic_state_dict(self):
        """The algorithm's own part of a rumor.elastic commit: nothing (the momentum and the
        variance travel with the optimizer's state; the error feedback restarts from zero on
        load).

        Returns:
            An empty dict.
        """
        return {}

    def load_elastic_state_dict(self, sd) -> None:
        """Called by rumor.elastic after it loaded the model and the optimizer: zeroes this
        rank's error-feedback buffers (worker and server side), as when compression begins.

        Args:
            sd: the dict elastic_state_dict() returned (empty; not read).
        """
        self._zero_errors()

    # Live membership (rumor-run --live): past the warm-up each backward updates the momenta in
    # place (the bucket ops, before optimizer.step): a step given up must find them as the last
    # applied step left them. The error feedback restarts from zero on every member at a change:
    # the server side's chunks change owners with the world size, and the step given up has
    # already folded this rank's gradient into both buffers.
    elastic_live = True

    def elastic_live_mark(self) -> None:
        """Keeps a copy of the momenta when the next backward updates them (the compression
        stage); the warm-up's backward leaves them alone, so nothing is kept then."""
        if not self.optimizer.compressing():
            self._live_mark = None
            return
        st = self.optimizer.state
        self._live_mark = [(p, st[p]["exp_avg"].clone()) for s in self._states.values() for p in s.bucket.params]

    def elastic_live_undo(self) -> None:
        """Puts back the momenta of the last mark (through the optimizer's state, which holds
        views of the flat buffers whatever the bucket layout) and zeroes the error feedback."""
        for p, m in self._live_mark or ():
            self.optimizer.state[p]["exp_avg"].copy_(m)
        self._zero_errors()
        self._compressed_last = False

    def _zero_errors(self) -> None:
        for s in self._states.values():
            s.flats["worker_error"].zero_()
            s.flats["server_error"].zero_()

    # ---- Algorithm hooks ------------------------------------------------------------------------

    def init(self, ddp) -> None:
        self.optimizer._algorithm = self

    def bucket_op(self, ddp, bucket):
        return self._make_op(ddp, bucket, device=False)

    # CUDA parameters: the momentum, its errors and the optimizer state stay on the device, so
    # there is no staged form; the device op runs over NCCL (hierarchical across hosts: none yet).
    def has_device_ops(self, ddp, nccl: bool) -> bool:
        return nccl and not (self.hierarchical and not ddp.group._comm.all_local)

    def device_bucket_op(self, ddp, bucket):
        return self._make_op(ddp, bucket, device=True)

    def _make_op(self, ddp, bucket, device: bool):
        if bucket.flat.dtype != torch.float32:
            raise TypeError(f"rumor.algorithms.OneBitAdamAlgorithm: parameters {bucket.names[:3]} are "
                            f"{bucket.flat.dtype}; 1-bit Adam keeps float32 momenta (use float32 parameters)")
        if bucket.index == 0:  # buckets are being (re)built from scratch
            self._states = {}
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        betas = set()
        for name, p in zip(bucket.names, bucket.params):
            g = group_of.get(id(p))
            if g is None:
                raise ValueError(f"rumor.algorithms.OneBitAdamAlgorithm: parameter {name} is trained by the model but "
                                 "not in the optimizer's parameter groups")
            betas.add(g["betas"][0])
        if len(betas) != 1:
            raise ValueError(f"rumor.algorithms.OneBitAdamAlgorithm: a bucket mixes parameter groups with different "
                             f"beta1 {sorted(betas)}; use one beta1 for all groups")
        count = bucket.flat.numel()
        flats = {k: torch.zeros(count, dtype=torch.float32, device=bucket.flat.device) for k in _STATE_KEYS}
        if device:
            from ..engine.ops import OneBitMomentumOp

            op = OneBitMomentumOp(flats["exp_avg"], flats["worker_error"], flats["server_error"], float(betas.pop()),
                                  self.chunk, self.hierarchical)
        else:
            if bucket.arena is not None:  # peers read shared buckets in place: the fast warm-up average
                warmup = bucket.arena.allreduce_op(int(ReduceOp.AVG))
            else:
                warmup = _C.allreduce_op(int(ReduceOp.AVG), ALGORITHMS["hierarchical" if self.hierarchical else "auto"])
            op = _C.onebit_momentum_op(address(flats["exp_avg"]), address(flats["worker_error"]),
                                       address(flats["server_error"]), count, float(betas.pop()), self.chunk,
                                       warmup, self.hierarchical)
        state = _BucketState(bucket, op, flats)
        self._bind(state)
        self._set_stage(state, self.optimizer.compressing())
        self._states[bucket.index] = state
        return op

    def before_forward(self, ddp) -> None:
        self._refresh()

    def after_backward(self, ddp) -> None:
        self._compressed_last = any(s.op.compressing for s in self._states.values())

    # ---- with the optimizer -----------------------------------------------------------------------

    def _bind(self, state: _BucketState) -> None:
        """Points the optimizer state of the bucket's parameters at views of its flat buffers,
        keeping the values the state holds now."""
        opt_state = self.optimizer.state
        for key in _STATE_KEYS:
            for p, view in state.views(key):
                st = opt_state[p]
                cur = st.get(key)
                if cur is not None and cur.data_ptr() != view.data_ptr():
                    view.copy_(cur)
                elif cur is None:
                    view.zero_()
                st[key] = view

    def _rebind(self) -> None:
        for s in self._states.values():
            self._bind(s)
            s.preconditioned = False  # the variance may have changed with the loaded state
        self._refresh()

    def _refresh(self) -> None:
        """Sets the ops for the next backward (between iterations: no bucket is in flight)."""
        self._compressed_last = False
        on = self.optimizer.compressing()
        for s in self._states.values():
            self._set_stage(s, on)

    def _set_stage(self, s: _BucketState, compressing: bool) -> None:
        if compressing and not s.preconditioned:
            for p, view in s.views_of(s.inv_denom):
                view.copy_(self.optimizer.inverse_denominator(p))
            # The C++ op takes the buffer's address, the device op the tensor.
            s.op.set_preconditioner(address(s.inv_denom) if isinstance(s.op, _C.OneBitMomentumOp) else s.inv_denom)
            s.preconditioned = True
        s.op.compressing = compressing

    def _momentum_updated(self) -> FrozenSet[int]:
        """Parameters whose momentum the last backward updated and averaged (compression stage)."""
        if not self._compressed_last:
            return frozenset()
        return frozenset(id(p) for s in self._states.values() for p in s.bucket.params)
