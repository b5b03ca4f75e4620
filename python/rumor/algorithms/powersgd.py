"""PowerSGD: each gradient matrix is averaged as a rank-k approximation (torch's PowerSGD
semantics), computed in C++ on the communication thread while backward goes on."""
from __future__ import annotations

import numbers
import weakref
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import _C
from .._tensor import address, dtype_code
from ..collectives import ALGORITHMS, ReduceOp
from .base import Algorithm

_WIRE = {None: torch.float32, torch.float32: torch.float32, torch.float16: torch.float16,
         torch.bfloat16: torch.bfloat16}


class _Matrix:
    __slots__ = ("slot", "offset", "n", "m", "k", "p_off", "q_off")

    def __init__(self, slot, offset, n, m, k):
        self.slot, self.offset, self.n, self.m, self.k = slot, offset, n, m, k
        self.p_off = self.q_off = 0


class _BucketState:
    """One bucket's layout and its state buffers (float32, flat): the error feedback (one value
    per gradient element, or None), P (n x k per matrix) and Q (m x k per matrix)."""

    def __init__(self, bucket, matrices: List[_Matrix], draw_units: List[List[_Matrix]],
                 uncompressed: List[Tuple[int, int]], error: Optional[torch.Tensor], p: torch.Tensor,
                 q: torch.Tensor):
        self.bucket = bucket
        self.matrices = matrices  # in the order of their P/Q blocks
        self.draw_units = draw_units  # groups whose random initial Q is drawn by one randn call
        self.uncompressed = uncompressed
        self.error, self.p, self.q = error, p, q
        self.initialized = False  # Q holds a previous step's value (warm start) or a fresh draw
        self.op = None

    def views(self):
        """name -> (error view or None, P view or None, Q view or None) for every parameter."""
        by_slot = {mx.slot: mx for mx in self.matrices}
        out = {}
        for slot, (name, prm, off) in enumerate(zip(self.bucket.names, self.bucket.params, self.bucket.offsets)):
            mx = by_slot.get(slot)
            if mx is None:
                out[name] = (None, None, None)
                continue
            err = self.error[off:off + prm.numel()].view(mx.n, mx.m) if self.error is not None else None
            out[name] = (err, self.p[mx.p_off:mx.p_off + mx.n * mx.k].view(mx.n, mx.k),
                         self.q[mx.q_off:mx.q_off + mx.m * mx.k].view(mx.m, mx.k))
        return out


def _check_int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"rumor.algorithms.PowerSGD: {name} must be an integer >= {low}, got {value!r}")
    return int(value)


class PowerSGD(Algorithm):
    """PowerSGD gradient compression (Vogels et al., 2019) with the arguments and semantics of
    torch's ``PowerSGDState`` + ``powerSGD_hook``::

        algo = rumor.algorithms.PowerSGD(matrix_approximation_rank=2, start_powerSGD_iter=100)
        model = rumor.DistributedDataParallel(model, algorithm=algo)

    For the first ``start_powerSGD_iter`` backward passes gradients are averaged exactly. Then
    each parameter's gradient, viewed as a matrix (shape[0], numel / shape[0]), is replaced by
    the rank-k (k = min(n, m, matrix_approximation_rank)) approximation P Q^T that all ranks
    share, found by one step of power iteration with two small allreduces (P, then Q) instead of
    one of the gradient. Tensors where (n + m) k * min_compression_rate >= n m (vectors, small
    matrices) are averaged uncompressed, in the same allreduce as P. use_error_feedback adds what
    the last approximation left out to the next gradient; warm_start starts each step's power
    iteration from the last Q (else from a fresh random Q). Random Qs come from
    ``numpy.random.RandomState(random_seed)`` exactly as in torch's hook, so with the same buckets
    the sequence is torch's.

    wire_dtype: torch.float16 or torch.bfloat16 sends P, Q and the uncompressed values in that
    type (they are computed in float32), on CPU as on GPU. The bucket op is C++ and runs on the
    communication thread, overlapped with backward. Parameters must be float32.

    State (iteration, random generator, per-parameter error, P and Q) is saved by
    ``state_dict()`` and restored by ``load_state_dict()`` (keyed by parameter name, so it does
    not depend on the bucket layout).

    Args:
        matrix_approximation_rank: the rank k of the approximation, an integer >= 1; default 1.
        start_powerSGD_iter: backward passes averaged exactly before compression starts, an
            integer >= 0; default 1000.
        min_compression_rate: a tensor is compressed only when its compressed size times this
            rate is below its size, a finite number >= 0; default 2.
        use_error_feedback: carry each step's approximation error into the next gradient;
            default True.
        warm_start: start the power iteration from the last step's Q; default True.
        orthogonalization_epsilon: added to each column's norm when Q and P are orthogonalized
            (each column is divided by norm + epsilon), so that a zero column does not divide by
            zero; a finite number >= 0, default 0 (torch's default).
        random_seed: the seed of the numpy generator of the random Qs, 0 <= random_seed < 2**32;
            default 0.
        batch_tensors_with_same_shape: draw the random Q of all matrices of one shape in a
            bucket with one call, as torch's hook does when it batches them; it changes only
            which random numbers each matrix gets, not the arithmetic. Default False.
        wire_dtype: the type P, Q and the uncompressed values are sent in: None or
            torch.float32 (the default, full precision), torch.float16 or torch.bfloat16.

    Raises:
        ValueError: an argument is outside the range given above (the message names it).
        TypeError: (when a bucket is communicated) its parameters are not float32.
    """

    def __init__(self, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0,
                 batch_tensors_with_same_shape: bool = False, wire_dtype: Optional[torch.dtype] = None):
        self.matrix_approximation_rank = _check_int(matrix_approximation_rank, "matrix_approximation_rank", 1)
        self.start_powerSGD_iter = _check_int(start_powerSGD_iter, "start_powerSGD_iter", 0)
        if (isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, numbers.Real)
                or not min_compression_rate >= 0 or not np.isfinite(min_compression_rate)):
            raise ValueError("rumor.algorithms.PowerSGD: min_compression_rate must be a finite number >= 0, "
                             f"got {min_compression_rate!r}")
        self.min_compression_rate = float(min_compression_rate)
        if (isinstance(orthogonalization_epsilon, bool) or not isinstance(orthogonalization_epsilon, numbers.Real)
                or not orthogonalization_epsilon >= 0 or not np.isfinite(orthogonalization_epsilon)):
            raise ValueError("rumor.algorithms.PowerSGD: orthogonalization_epsilon must be a finite number "
                             f">= 0, got {orthogonalization_epsilon!r}")
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        for name, v in (("use_error_feedback", use_error_feedback), ("warm_start", warm_start),
                        ("batch_tensors_with_same_shape", batch_tensors_with_same_shape)):
            if not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"rumor.algorithms.PowerSGD: {name} must be a bool, got {v!r}")
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        self.random_seed = _check_int(random_seed, "random_seed", 0)
        if random_seed >= 2**32:
            raise ValueError(f"rumor.algorithms.PowerSGD: random_seed must be below 2**32, got {random_seed!r}")
        if wire_dtype not in _WIRE:
            raise ValueError("rumor.algorithms.PowerSGD: wire_dtype must be None, torch.float32, torch.float16 "
                             f"or torch.bfloat16, got {wire_dtype!r}")
        self.wire_dtype = _WIRE[wire_dtype]
        self.iter = 0
        self.rng = np.random.RandomState(self.random_seed)
        self._states: Dict[int, _BucketState] = {}
        self._carry: Dict[str, dict] = {}  # per-parameter state waiting for its bucket
        self._retired: List[_BucketState] = []
        self._owner = None  # weak reference to the wrapper whose buckets these are
        self._prepared_iter: Optional[int] = None
        self._live_mark = None  # (iter, generator state, name -> (P, Q, initialized)) under rumor-run --live

    # ---- layout ---------------------------------------------------------------------------------

    def _layout(self, bucket):
        """Which parameters are compressed (torch's rule), their P/Q blocks grouped by matrix
        shape in order of first appearance as torch's hook lays them out, and the runs averaged
        uncompressed."""
        r, rate = self.matrix_approximation_rank, self.min_compression_rate
        by_shape: Dict[Tuple[int, int], List[_Matrix]] = {}
        uncompressed: List[Tuple[int, int]] = []
        for slot, (prm, off) in enumerate(zip(bucket.params, bucket.offsets)):
            numel = prm.numel()
            if numel == 0:
                continue
            if prm.dim() >= 1:
                n = prm.shape[0]
                m = numel // n
                k = min(n, m, r)
                if (n + m) * k * rate < n * m:
                    by_shape.setdefault((n, m), []).append(_Matrix(slot, off, n, m, k))
                    continue
            if uncompressed and uncompressed[-1][0] + uncompressed[-1][1] == off:
                uncompressed[-1] = (uncompressed[-1][0], uncompressed[-1][1] + numel)
            else:
                uncompressed.append((off, numel))
        matrices: List[_Matrix] = []
        units: List[List[_Matrix]] = []
        p_off = q_off = 0
        for group in by_shape.values():
            if self.batch_tensors_with_same_shape:
                units.append(group)
            else:
                units.extend([mx] for mx in group)
            for mx in group:
                mx.p_off, mx.q_off = p_off, q_off
                p_off += mx.n * mx.k
                q_off += mx.m * mx.k
                matrices.append(mx)
        return matrices, units, uncompressed, p_off, q_off

    # ---- Algorithm hooks ------------------------------------------------------------------------

    def bucket_op(self, ddp, bucket):
        return self._make_op(ddp, bucket, device=False)

    # CUDA parameters: over NCCL the op runs on the device (rumor.engine.ops.PowerSgdOp); without
    # NCCL the C++ op runs on a page-locked copy of each bucket (its state stays on the host).
    stages_through_host = True

    def has_device_ops(self, ddp, nccl: bool) -> bool:
        return nccl

    def device_bucket_op(self, ddp, bucket):
        return self._make_op(ddp, bucket, device=True)

    def _make_op(self, ddp, bucket, device: bool):
        owner = self._owner() if self._owner is not None else None
        if owner is not None and owner is not ddp:
            raise ValueError("rumor.algorithms.PowerSGD: this algorithm already serves another "
                             "DistributedDataParallel; give each wrapper its own PowerSGD")
        self._owner = weakref.ref(ddp)
        if bucket.flat.dtype != torch.float32:
            raise TypeError(f"rumor.algorithms.PowerSGD: parameters {bucket.names[:3]} are {bucket.flat.dtype}; "
                            "PowerSGD compresses float32 gradients (use float32 parameters; wire_dtype sends "
                            "them as float16 or bfloat16)")
        if bucket.index == 0 and self._states:  # buckets are being rebuilt: keep each parameter's state
            self._carry.update(self._snapshot(clone=True))
            # The engine holds the old ops, which point into these buffers, until every new op
            # exists: they stay alive until the next forward.
            self._retired = list(self._states.values())
            self._states = {}
        matrices, units, uncompressed, p_count, q_count = self._layout(bucket)
        count = bucket.flat.numel()
        dev = bucket.flat.device if device else torch.device("cpu")
        error = torch.zeros(count, dtype=torch.float32, device=dev) if self.use_error_feedback else None
        s = _BucketState(bucket, matrices, units, uncompressed, error, torch.zeros(max(p_count, 1), device=dev),
                         torch.zeros(max(q_count, 1), device=dev))
        self._restore(s)
        if device:
            from ..engine.ops import PowerSgdOp

            s.op = PowerSgdOp([(mx.offset, mx.n, mx.m, mx.k, mx.p_off, mx.q_off) for mx in matrices], uncompressed,
                              count, s.p, s.q, error, self.orthogonalization_epsilon, self.wire_dtype)
            self._states[bucket.index] = s
            self._prepared_iter = None
            return s.op
        if bucket.arena is not None:  # peers read shared buckets in place: the fast full average
            warmup = bucket.arena.allreduce_op(int(ReduceOp.AVG))
        else:
            warmup = _C.allreduce_op(int(ReduceOp.AVG), ALGORITHMS["auto"])
        s.op = _C.powersgd_op([(mx.offset, mx.n, mx.m, mx.k, mx.p_off, mx.q_off) for mx in matrices],
                              uncompressed, count, address(s.p), p_count, address(s.q), q_count,
                              address(error) if error is not None else 0, self.orthogonalization_epsilon,
                              dtype_code(self.wire_dtype, "wire_dtype"), warmup)
        self._states[bucket.index] = s
        self._prepared_iter = None
        return s.op

    def before_forward(self, ddp) -> None:
        self._prepare()

    def after_backward(self, ddp) -> None:
        self.iter += 1

    def _prepare(self) -> None:
        """Sets the ops for the next backward (between iterations: no bucket is in flight) and
        draws the random initial Q where torch's hook would, in bucket order."""
        self._retired = []
        if self._prepared_iter == self.iter:
            return
        self._prepared_iter = self.iter
        on = self.iter >= self.start_powerSGD_iter
        for idx in sorted(self._states):
            s = self._states[idx]
            if on and (not self.warm_start or not s.initialized):
                self._draw_q(s)
                s.initialized = True
            s.op.compressing = on

    def _draw_q(self, s: _BucketState) -> None:
        # torch's hook: seed a generator with rng.randint(1e9) once per bucket, then one
        # standard normal draw per matrix (or per same-shape batch) in P/Q order.
        gen = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
        for unit in s.draw_units:
            start = unit[0].q_off
            total = sum(mx.m * mx.k for mx in unit)
            s.q[start:start + total].copy_(torch.randn(total, generator=gen, dtype=torch.float32))

    # ---- state ----------------------------------------------------------------------------------

    def _snapshot(self, clone: bool) -> Dict[str, dict]:
        out = {}
        for s in self._states.values():
            for name, (err, p, q) in s.views().items():
                c = (lambda t: t.clone()) if clone else (lambda t: t)
                out[name] = {"error": None if err is None else c(err), "p": None if p is None else c(p),
                             "q": None if q is None else c(q), "initialized": s.initialized}
        return out

    def _restore(self, s: _BucketState) -> None:
        """Fills a new bucket's buffers from the carried per-parameter state, if any."""
        views = s.views()
        got = {name: self._carry.pop(name) for name in list(views) if name in self._carry}
        if not got:
            return
        initialized = len(got) == len(views) and all(st["initialized"] for st in got.values())
        for name, st in got.items():
            err, p, q = views[name]
            if err is not None and st["error"] is not None and st["error"].shape == err.shape:
                err.copy_(st["error"])
            if initialized and q is not None:
                if st["q"] is None or st["q"].shape != q.shape:
                    initialized = False
                else:
                    q.copy_(st["q"])
                    if st["p"] is not None and st["p"].shape == p.shape:
                        p.copy_(st["p"])
        s.initialized = initialized

    # Live membership (rumor-run --live): a backward moves the iteration count, may draw from the
    # random generator, and writes P, Q and the error feedback in place, so a step given up puts
    # back what the last applied step left (the error feedback excepted: it restarts from zero on
    # every member at a change, as in a restore, because the step given up has already folded
    # this rank's gradient into it).
    elastic_live = True

    def elastic_live_mark(self) -> None:
        """Keeps the iteration count, the random generator's state and every parameter's P and
        Q (by name, so a rebuilt bucket layout finds them)."""
        pq = {}
        for s in self._states.values():
            for name, (_, p, q) in s.views().items():
                pq[name] = (None if p is None else p.clone(), None if q is None else q.clone(), s.initialized)
        self._live_mark = (self.iter, self.rng.get_state(), pq)

    def elastic_live_undo(self) -> None:
        """Puts back the state of the last mark and zeroes the error feedback."""
        if self._live_mark is None:
            return
        self.iter, rng, pq = self._live_mark
        self.rng.set_state(rng)
        for s in self._states.values():
            if s.error is not None:
                s.error.zero_()
            views = s.views()
            s.initialized = all(name in pq and pq[name][2] for name in views)
            for name, (_, p, q) in views.items():
                if q is not None and name in pq and pq[name][1] is not None:
                    p.copy_(pq[name][0])
                    q.copy_(pq[name][1])
        self._prepared_iter = None  # the next forward prepares the ops again, drawing as the step given up did

    # rumor.elastic: weights, P and Q (averaged) are the same on every rank; the error feedback
    # is each rank's own, so a restored job keeps the commit's P/Q and iteration and starts its
    # error feedback from zero.
    def elastic_state_dict(self) -> dict:
        """The algorithm's own part of a rumor.elastic commit: state_dict() without the error
        feedback (each rank's own, so the restored job starts it from zero).

        Returns:
            A dict as state_dict()'s, with every parameter's ``error`` set to None.
        """
        sd = self.state_dict()
        for st in sd["params"].values():
            st["error"] = None
        return sd

    def load_elastic_state_dict(self, sd) -> None:
        """Restores what elastic_state_dict() saved, as load_state_dict() does (rumor.elastic calls
        it after loading the model and the optimizer).

        Args:
            sd: the dict elastic_state_dict() returned.

        Raises:
            ValueError: as load_state_dict().
        """
        self.load_state_dict(sd)

    def state_dict(self) -> dict:
        """The algorithm's state: iteration count, random generator, and per parameter (by name)
        its error feedback, P and Q (copies).

        Returns:
            A dict of tensors and plain numbers (it loads with torch.load(weights_only=True)):
            ``iter``, ``rng``, ``params`` (name -> dict of ``error``, ``p``, ``q``,
            ``initialized``) and the
            settings ``matrix_approximation_rank``, ``use_error_feedback`` and ``warm_start``.
        """
        params = self._snapshot(clone=True)
        params.update({k: dict(v) for k, v in self._carry.items()})
        name, keys, pos, has_gauss, gauss = self.rng.get_state()
        # Tensors and plain numbers only: the checkpoint loads with torch.load(weights_only=True).
        rng = {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
               "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
        return {"iter": self.iter, "rng": rng, "params": params,
                "matrix_approximation_rank": self.matrix_approximation_rank,
                "use_error_feedback": self.use_error_feedback, "warm_start": self.warm_start}

    def load_state_dict(self, state: dict) -> None:
        """Restores what state_dict() saved; call before or after wrapping the model. Parameters
        are matched by name, so the bucket layout may differ from the one that saved it.

        Args:
            state: the dict state_dict() returned.

        Raises:
            ValueError: state is not such a dict, was saved with another
                matrix_approximation_rank, or holds a bad random generator state.
        """
        if not isinstance(state, dict) or not {"iter", "rng", "params"} <= set(state):
            raise ValueError("rumor.algorithms.PowerSGD.load_state_dict: expected a dict from "
                             "PowerSGD.state_dict() (keys iter, rng, params)")
        rank = state.get("matrix_approximation_rank", self.matrix_approximation_rank)
        if rank != self.matrix_approximation_rank:
            raise ValueError(f"rumor.algorithms.PowerSGD.load_state_dict: the state was saved with "
                             f"matrix_approximation_rank={rank}, this PowerSGD has "
                             f"{self.matrix_approximation_rank}")
        self.iter = _check_int(state["iter"], "iter", 0)
        rng = state["rng"]
        try:
            self.rng.set_state((rng["name"], rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"],
                                rng["cached_gaussian"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"rumor.algorithms.PowerSGD.load_state_dict: bad random generator state ({e})") from None
        self._carry = {k: dict(v) for k, v in state["params"].items()}
        states, self._states = self._states, {}
        for idx in sorted(states):
            s = states[idx]
            if s.error is not None:
                s.error.zero_()
            s.p.zero_()
            s.q.zero_()
            s.initialized = False
            self._restore(s)
            self._states[idx] = s
        self._prepared_iter = None

    # ---- reporting ------------------------------------------------------------------------------

    def compression_stats(self) -> Tuple[float, int, int]:
        """(rate, elements per step before compression, elements sent per step after) over the
        current buckets, as torch's PowerSGDState.compression_stats() counts them per step."""
        before = after = 0
        for s in self._states.values():
            before += s.bucket.flat.numel()
            after += sum(c for _, c in s.uncompressed) + sum((mx.n + mx.m) * mx.k for mx in s.matrices)
        return (before / after if after else 0.0, before, after)

    def __repr__(self) -> str:
        return (f"PowerSGD(matrix_approximation_rank={self.matrix_approximation_rank}, "
                f"start_powerSGD_iter={self.start_powerSGD_iter}, "
                f"min_compression_rate={self.min_compression_rate}, "
                f"use_error_feedback={self.use_error_feedback}, warm_start={self.warm_start}, "
                f"orthogonalization_epsilon={self.orthogonalization_epsilon}, random_seed={self.random_seed}, "
                f"batch_tensors_with_same_shape={self.batch_tensors_with_same_shape}, "
                f"wire_dtype={self.wire_dtype})")
