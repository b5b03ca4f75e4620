"""Communication-rare data parallelism: local SGD (periodic model averaging) and DiLoCo,
including Streaming DiLoCo (see docs/local_sgd.md for the update rules and the schedule).

How they plug into rumor.DistributedDataParallel
------------------------------------------------
Both act after the optimizer step (``Algorithm.after_step``, called by the optimizer's step
post-hook that the wrapper registers), so the wrapper needs the optimizer
(``DistributedDataParallel(model, optimizer=opt, algorithm=...)``). Between synchronizations
backward communicates nothing: the buckets run the local op.

* The trainable parameters become views into flat buffers (``FlatWeights``, as for the other
  weight-averaging algorithms), one per dtype and, for DiLoCo, per fragment, so that an average
  is one collective per buffer and the parameters are never copied to be sent.
* DiLoCo's outer state (the outer parameters, i.e. the start of the current round, and the outer
  optimizer) lives here and is checkpointed through ``state_dict()`` / ``load_state_dict()``.
* Streaming DiLoCo's averages run on a communicator of their own (``rumor.new_group`` of the
  wrapper's ranks, made in ``init``): a nonblocking allreduce queued there never delays the
  training thread's collectives (e.g. the buffer broadcast before forward).
"""
from __future__ import annotations

import collections
import math
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _C, _rendezvous, _runtime
from .._tensor import address, dtype_code
from ..collectives import ReduceOp, ALGORITHMS
from ._warmup import WarmupThenLocal
from .base import Algorithm
from .bytegrad import KIND_BF16, KIND_F16, KIND_MINMAX_U8, KIND_QSGD
from ..engine.flat import FlatWeights

_ONE_FLAT = 1 << 62  # a cap no model reaches: one flat buffer per dtype
_HALF = (torch.float16, torch.bfloat16)

# quantization= of DiLoCo: (codec kind, levels, chunk, wire bits per element as encoded).
# "4bit" is QSGD with 7 levels: a sign and a 3-bit level, 4 bits of information per element,
# with a norm per 32 elements (QSGD's error grows with the chunk's norm); rumor's QSGD codec
# stores one element per byte, so on the wire it costs a little more than int8.
QUANTIZATIONS = {
    None: None,
    "fp16": (KIND_F16, 16, 0),
    "bf16": (KIND_BF16, 16, 0),
    "int8": (KIND_MINMAX_U8, 16, 0),
    "4bit": (KIND_QSGD, 7, 32),
}


# ---- argument checks ----------------------------------------------------------------------------

def _int_arg(who: str, name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{who}: {name} must be an integer, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{who}: {name} must be >= {lo}, got {v}")
    return v


def _need_optimizer(ddp, who: str) -> None:
    if ddp.optimizer is None:
        raise ValueError(f"{who}: acts after each optimizer step; pass the optimizer to the wrapper: "
                         f"rumor.DistributedDataParallel(model, optimizer=opt, algorithm={who}(...))")


def _host_groups(ddp) -> tuple:
    """(groups, this rank's group) with one group per host of the wrapper's ranks, hosts in
    order of their lowest rank. Collective: every rank of the wrapper creates every group."""
    st = _runtime.state()
    hosts: Dict[str, List[int]] = {}
    for r in ddp.group.ranks:
        hosts.setdefault(st.hosts[r], []).append(r)
    groups = [_runtime.new_group(ranks) for ranks in hosts.values()]
    mine = next(g for g in groups if st.env.rank in g.ranks)
    return groups, mine


def _allreduce_avg(group, t: torch.Tensor, algorithm: str = "auto", nonblocking: bool = False):
    """In-place average of a contiguous tensor over ``group``: for a CPU tensor the C++ op
    directly (no Python copy, GIL released); a CUDA one goes through the collectives' GPU path
    (NCCL on the current stream, or staged), where a nonblocking call returns a Handle."""
    if t.device.type != "cpu":
        from .. import collectives

        call = collectives.allreduce_nonblocking_ if nonblocking else collectives.allreduce_
        return call(t, ReduceOp.AVG, group, hierarchical=algorithm == "hierarchical")
    return group._comm.allreduce(address(t), t.numel(), dtype_code(t.dtype, "rumor.algorithms"),
                                 int(ReduceOp.AVG), ALGORITHMS[algorithm], nonblocking)


def ring_bytes(numel: int, element_bytes: float, n: int) -> float:
    """Bytes one rank sends in a bandwidth-optimal allreduce of numel elements over n ranks
    (reduce-scatter + allgather): 2 (n - 1) / n of the buffer."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * numel * element_bytes


# ---- LocalSGD -----------------------------------------------------------------------------------

class LocalSGD(WarmupThenLocal, Algorithm):
    """Local SGD with periodic model averaging (torch's PostLocalSGD + PeriodicModelAverager).

    sync_every (H): after the warm-up, the parameters are averaged over every rank after every
      H-th optimizer step; in between, backward communicates nothing and each rank trains alone.
    warmup_steps: the first warmup_steps backward passes average gradients like
      GradientAllReduce (the ranks stay identical). The optimizer steps are counted from 0;
      the parameters are averaged after step s when s >= warmup_steps and
      (s - warmup_steps) % H == 0, exactly torch's PeriodicModelAverager(period=H,
      warmup_steps=warmup_steps) called after each step (so the first average comes right after
      the first local step).
    hierarchical: average within each host at every such point and across all hosts only at
      every ``cross_host_every``-th one (torch's HierarchicalModelAverager with periods H and
      H * cross_host_every): the slow links carry one model every H * cross_host_every steps.
      On a single host that is the same as hierarchical=False.

    Only parameters are averaged (as in torch); buffers follow the wrapper's broadcast_buffers.
    Needs the optimizer given to the wrapper. ``state_dict()`` holds the step counters.
    """

    def __init__(self, sync_every: int = 8, warmup_steps: int = 0, hierarchical: bool = False,
                 cross_host_every: Optional[int] = None):
        self.sync_every = _int_arg("LocalSGD", "sync_every", sync_every, 1)
        self.warmup_steps = _int_arg("LocalSGD", "warmup_steps", warmup_steps, 0)
        if not isinstance(hierarchical, bool):
            raise TypeError(f"LocalSGD: hierarchical must be a bool, got {type(hierarchical).__name__}")
        self.hierarchical = hierarchical
        if cross_host_every is not None and not hierarchical:
            raise ValueError("LocalSGD: cross_host_every is for hierarchical=True (averages across hosts every "
                             "cross_host_every-th averaging)")
        self.cross_host_every = _int_arg("LocalSGD", "cross_host_every",
                                         4 if cross_host_every is None else cross_host_every, 1)
        self.steps = 0            # optimizer steps so far
        self.backward_passes = 0  # synchronized backward passes so far (warm-up counts these)
        self.averages = 0         # averaging points so far (within a host or global)
        self.global_averages = 0  # of which over every rank
        self._synced_at = 0  # self.steps when the replicas were last made identical (live membership)
        self._ddp = None

    def __repr__(self) -> str:
        extra = f", hierarchical=True, cross_host_every={self.cross_host_every}" if self.hierarchical else ""
        return f"LocalSGD(sync_every={self.sync_every}, warmup_steps={self.warmup_steps}{extra})"

    # CUDA parameters: the parameter averages go through the collectives' GPU path (_allreduce_avg).
    @property
    def _local(self) -> bool:
        return self.backward_passes >= self.warmup_steps

    def init(self, ddp) -> None:
        if self._ddp is not None and self._ddp is not ddp:  # the same wrapper: rebuilt by live membership
            raise RuntimeError("LocalSGD: this algorithm object already serves a DistributedDataParallel; "
                               "create one per wrapper")
        _need_optimizer(ddp, "LocalSGD")
        self._ddp = ddp
        self._flat = FlatWeights(ddp._params, _ONE_FLAT, "LocalSGD")
        self._host_group = None
        if self.hierarchical:
            groups, mine = _host_groups(ddp)
            if len(groups) > 1:
                self._host_group = mine

    def after_backward(self, ddp) -> None:
        was_local = self._local
        self.backward_passes += 1
        if self._local and not was_local:
            # The engine is idle here: the next backward runs the local op on every bucket.
            ddp._refresh_bucket_ops()

    def after_step(self, ddp) -> None:
        s = self.steps
        self.steps += 1
        if s < self.warmup_steps:
            self._synced_at = self.steps  # the warm-up averages gradients: the replicas stay identical
            return
        if (s - self.warmup_steps) % self.sync_every:
            return
        k = (s - self.warmup_steps) // self.sync_every
        self._flat.ensure_views()
        if self._host_group is not None and k % self.cross_host_every:
            for f in self._flat.flats:
                _allreduce_avg(self._host_group, f)
        else:
            # Across hosts: the host-aware allreduce sends each byte over the network once per host.
            algo = "hierarchical" if self.hierarchical else "auto"
            for f in self._flat.flats:
                _allreduce_avg(ddp.group, f, algo)
            self.global_averages += 1
            self._synced_at = self.steps
        self.averages += 1

    def state_dict(self) -> dict:
        """The step counters, to checkpoint with the model and the optimizer.

        Returns:
            A dict with ``steps`` (optimizer steps), ``backward_passes`` (synchronized backward
            passes, which the warm-up counts), ``averages`` (averaging points) and
            ``global_averages`` (of which over every rank).
        """
        return dict(steps=self.steps, backward_passes=self.backward_passes, averages=self.averages,
                    global_averages=self.global_averages)

    # rumor.elastic: between averages the replicas differ; a commit keeps their average.
    elastic_consensus = True
    # Live membership (rumor-run --live) goes by rounds: each average is one quorum of the
    # epoch's ranks. A round that a failure interrupts is given up: every member goes back to the
    # round's start (the last average, and its own optimizer state) and trains it again with the
    # new world; newcomers are admitted only between rounds, with the state a member holds there.
    elastic_live_rounds = True

    def elastic_live_at_boundary(self) -> bool:
        """Whether the replicas are at a round boundary (the warm-up, or the last step ended with
        an average over every rank that completed): live membership keeps the State there and
        admits newcomers there.

        Returns:
            True before the first step, during the warm-up and right after such an average.
        """
        # Across several hosts, hierarchical: only the averages over every rank end a round.
        return self._synced_at == self.steps

    def elastic_state_dict(self) -> dict:
        """The algorithm's own part of a rumor.elastic commit: state_dict().

        Returns:
            The dict state_dict() returns.
        """
        return self.state_dict()

    def load_elastic_state_dict(self, sd) -> None:
        """Restores what elastic_state_dict() saved, as load_state_dict() does (rumor.elastic calls
        it after loading the model and the optimizer).

        Args:
            sd: the dict elastic_state_dict() returned.

        Raises:
            KeyError: as load_state_dict().
        """
        self.load_state_dict(sd)

    def load_state_dict(self, sd: dict) -> None:
        """Restores the step counters saved by state_dict(). Where that moves the algorithm
        across the end of the warm-up, the wrapper's buckets switch between the warm-up's
        gradient average and the local op.

        Args:
            sd: the dict state_dict() returned.

        Raises:
            KeyError: sd lacks one of the counters.
        """
        was_local = self._local
        for k in ("steps", "backward_passes", "averages", "global_averages"):
            setattr(self, k, int(sd[k]))
        self._synced_at = self.steps  # saved at a round boundary (live) or as the ranks' average (commit)
        if self._ddp is not None and self._local != was_local:
            self._ddp._refresh_bucket_ops()


# ---- DiLoCo -------------------------------------------------------------------------------------

class _Slot:
    """One flat parameter buffer of a fragment, its outer copy and its send buffer."""

    def __init__(self, flat: torch.Tensor):
        self.x = flat
        dt = torch.float32 if flat.dtype in _HALF else flat.dtype
        # The outer parameters: the global model at the start of this fragment's round.
        self.outer = torch.nn.Parameter(flat.detach().to(dt).clone(), requires_grad=True)
        # The pseudo-gradient sent, and the average that comes back in place.
        self.buf = torch.zeros_like(self.outer.data)


class _Fragment:
    def __init__(self, index: int, flat: FlatWeights, ranges: List[Tuple[int, int, int]], offset: int):
        self.index = index
        self.offset = offset  # sends after inner steps t with t % H == offset
        self.flat = flat  # the whole model's flat buffers (one per dtype), shared by the fragments
        self.ranges = ranges  # (flat buffer, start, end): this fragment's elements of each buffer
        self.slots = [_Slot(flat.flats[b][a:e]) for b, a, e in ranges]
        self.works: Optional[list] = None  # the averages in flight
        self.apply_at: Optional[int] = None  # inner step after which their result is applied
        self.sent = 0


def split_fragments(lengths: Sequence[int], n: int) -> List[List[Tuple[int, int, int]]]:
    """Cuts flat buffers of the given lengths into n fragments: fragment p holds elements
    [L p // n, L (p + 1) // n) of each buffer of length L, as (buffer, start, end) triples
    (empty ranges left out). Element ranges, not whole parameters: a model whose size is
    mostly one or two large matrices still gets equal fragments, and so equal averages."""
    if not lengths or n > max(lengths):
        raise ValueError(f"DiLoCo: num_fragments={n} exceeds the trainable elements of the largest dtype group "
                         f"({max(lengths, default=0)})")
    return [[(b, L * p // n, L * (p + 1) // n) for b, L in enumerate(lengths) if L * (p + 1) // n > L * p // n]
            for p in range(n)]


def _default_outer(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class DiLoCo(Algorithm):
    """DiLoCo (Douillard et al., 2023) and Streaming DiLoCo (Douillard et al., 2025).

    Every rank runs ``inner_steps`` (H) steps of the user's optimizer (the inner optimizer, the
    one given to the wrapper) on its own data, with no communication. Then, per fragment of the
    model, the pseudo-gradient ``outer - current`` (outer: the global parameters at the start of
    the round) is averaged over the ranks, set as the .grad of the outer parameters and stepped
    by the outer optimizer; the model restarts the next round from the new outer parameters.

    inner_steps: H, inner optimizer steps per round.
    outer_optimizer: a callable that takes the list of outer parameters (one flat tensor per
      fragment and dtype) and returns a torch.optim.Optimizer over them, e.g.
      ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)`` (the default).
    num_fragments: F. 1 is DiLoCo. F > 1 is Streaming DiLoCo: the parameters, flattened in
      definition order (one buffer per dtype), are cut into F consecutive element ranges of
      equal size (a large matrix may span two fragments), and fragment p is
      synchronized after the inner steps t with t % H == p * H // F, so the ranks send 1/F of the
      model F times per round instead of all of it at once.
    fragment_sync_delay: tau. 0: a fragment's average is waited for right where it was started.
      tau >= 1: the average runs in the background (a nonblocking allreduce) while tau more inner
      steps compute, and is applied after the tau-th of them; the fragment's local progress made
      meanwhile is merged by fragment_update_alpha.
    fragment_update_alpha: when the result is applied, the fragment becomes
      ``alpha * local + (1 - alpha) * outer`` (0: the new global parameters, as in DiLoCo and
      torchft's default).
    quantization: the pseudo-gradients on the wire: None (full precision), "fp16", "bf16",
      "int8" (ByteGrad's min/max uint8 codec) or "4bit" (QSGD, 7 levels: 4 bits of information,
      stored one per byte by rumor's codec). Compressed averages give every rank the same bits.
    hierarchical: average inside each host first (shared memory, full precision), then between
      one rank per host (compressed, when quantized), then broadcast inside each host.

    Needs the optimizer given to the wrapper. ``state_dict()`` holds the round state (step
    counter, outer parameters, outer optimizer, results not yet applied): checkpoint it with the
    model and the inner optimizer. ``wire_bytes`` counts the bytes this rank sent for the
    averages (bandwidth-optimal allreduce, codec headers included); ``bytes_per_step()`` divides
    by the inner steps.
    """

    def __init__(self, inner_steps: int = 32, outer_optimizer: Optional[Callable] = None, num_fragments: int = 1,
                 fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0,
                 quantization: Optional[str] = None, hierarchical: bool = False):
        self.inner_steps = _int_arg("DiLoCo", "inner_steps", inner_steps, 1)
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise TypeError("DiLoCo: outer_optimizer must be a callable taking the outer parameters and returning a "
                            "torch.optim.Optimizer (e.g. functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, "
                            f"nesterov=True)), got {type(outer_optimizer).__name__}")
        self._make_outer = outer_optimizer or _default_outer
        self.num_fragments = _int_arg("DiLoCo", "num_fragments", num_fragments, 1)
        if self.num_fragments > self.inner_steps:
            raise ValueError(f"DiLoCo: num_fragments ({num_fragments}) must be <= inner_steps ({inner_steps}): "
                             "each fragment is synchronized at its own inner step of the round")
        self.fragment_sync_delay = _int_arg("DiLoCo", "fragment_sync_delay", fragment_sync_delay, 0)
        if self.fragment_sync_delay >= self.inner_steps:
            raise ValueError(f"DiLoCo: fragment_sync_delay ({fragment_sync_delay}) must be < inner_steps "
                             f"({inner_steps}): a fragment's average must be applied before its next one starts")
        if isinstance(fragment_update_alpha, bool) or not isinstance(fragment_update_alpha, (int, float)):
            raise TypeError("DiLoCo: fragment_update_alpha must be a number, got "
                            f"{type(fragment_update_alpha).__name__}")
        if not (math.isfinite(fragment_update_alpha) and 0.0 <= fragment_update_alpha <= 1.0):
            raise ValueError(f"DiLoCo: fragment_update_alpha must be in [0, 1], got {fragment_update_alpha!r}")
        self.fragment_update_alpha = float(fragment_update_alpha)
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"DiLoCo: quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
        self.quantization = quantization
        if not isinstance(hierarchical, bool):
            raise TypeError(f"DiLoCo: hierarchical must be a bool, got {type(hierarchical).__name__}")
        self.hierarchical = hierarchical
        self.steps = 0        # inner steps so far
        self.wire_bytes = 0.0  # bytes this rank sent for the averages
        # ("send" | "apply", inner step, fragment), in order, the latest ones (tests, diagnostics)
        self.log: Deque[tuple] = collections.deque(maxlen=4096)
        self._ddp = None
        self.fragments: List[_Fragment] = []
        self.outer_optimizer: Optional[torch.optim.Optimizer] = None
        self._synced_at = 0  # self.steps when the last outer step was applied (live membership)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(inner_steps={self.inner_steps}, num_fragments={self.num_fragments}, "
                f"fragment_sync_delay={self.fragment_sync_delay}, fragment_update_alpha={self.fragment_update_alpha}, "
                f"quantization={self.quantization!r})")

    # ---- Algorithm hooks ----------------------------------------------------------------------

    def init(self, ddp) -> None:
        if self._ddp is not None and self._ddp is not ddp:
            raise RuntimeError(f"{type(self).__name__}: this algorithm object already serves a "
                               "DistributedDataParallel; create one per wrapper")
        # The same wrapper built again over a new world (live membership): the round state goes on.
        carry = self.state_dict() if self._ddp is ddp else None
        _need_optimizer(ddp, type(self).__name__)
        self._ddp = ddp
        params = list(ddp._params)
        if not params:
            raise ValueError(f"{type(self).__name__}: the model has no trainable parameters")
        H, F = self.inner_steps, self.num_fragments
        flat = FlatWeights(params, _ONE_FLAT, type(self).__name__)
        runs = split_fragments([f.numel() for f in flat.flats], F)
        self.fragments = [_Fragment(i, flat, run, (i * H // F) % H) for i, run in enumerate(runs)]
        outer = [s.outer for f in self.fragments for s in f.slots]
        opt = self._make_outer(outer)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"{type(self).__name__}: outer_optimizer(params) must return a torch.optim.Optimizer, "
                            f"got {type(opt).__name__}")
        self.outer_optimizer = opt
        self._n = ddp.group.size()
        # Averages run on a communicator of their own, so that one in flight (fragment_sync_delay
        # > 0) never queues ahead of the training thread's collectives.
        self._group = _runtime.new_group(ddp.group.ranks)
        # the ranks that exchange over the network: one per host when hierarchical
        self._hosts = len(_host_names(ddp)) if self.hierarchical else self._n
        self._codec = None
        if self.quantization is not None:
            self._codec = QUANTIZATIONS[self.quantization]
            self._codec_obj = _codec(self.quantization)
        self._device_avg = None
        if ddp._device_mode is not None:
            # CUDA parameters: the outer state and the pseudo-gradients live on the device; the
            # averages run on their own stream (rumor.engine.averager.GroupAverager).
            from ..engine.averager import GroupAverager
            from ..engine.device import emulated

            device = None if emulated() is not None else params[0].device
            self._device_avg = GroupAverager(self._group, device, self._codec, self.hierarchical,
                                             lambda: ddp._timeout)
        if carry is not None:
            self.load_state_dict(carry)

    def bucket_op(self, ddp, bucket):
        return _C.local_op()

    def has_device_ops(self, ddp, nccl: bool) -> bool:
        return True  # backward communicates nothing; the averages pick their own path (init)

    def device_bucket_op(self, ddp, bucket):
        from ..engine.ops import LocalOp

        return LocalOp()

    def rebuild_buckets(self, ddp) -> bool:
        return False

    def after_step(self, ddp) -> None:
        self.steps += 1
        t = self.steps
        H = self.inner_steps
        for f in self.fragments:
            if f.apply_at == t:
                self._apply(f)
        for f in self.fragments:
            if t % H == f.offset:
                self._send(f)
                if self.fragment_sync_delay == 0:
                    self._apply(f)

    # ---- the round ------------------------------------------------------------------------------

    def _send(self, f: _Fragment) -> None:
        f.flat.ensure_views()
        works = []
        with torch.no_grad():
            for s in f.slots:
                torch.sub(s.outer.data, s.x, out=s.buf)  # x is cast up for half parameters
                works.append(self._average(s.buf, nonblocking=self.fragment_sync_delay > 0, step=f.sent))
        f.works = works
        f.apply_at = self.steps + self.fragment_sync_delay
        f.sent += 1
        self.log.append(("send", self.steps, f.index))

    def _average(self, buf: torch.Tensor, nonblocking: bool, step: int):
        _rendezvous.fault_point("diloco:average")  # tests: a member dies inside a fragment's average
        self._count_wire(buf)
        if self._device_avg is not None:
            # Both ways a Ticket: blocking averages (fragment_sync_delay == 0) are waited for by
            # _apply right away, which makes the stream, not the host, wait.
            return self._device_avg.average(buf, step)
        comm = self._group._comm
        code = dtype_code(buf.dtype, type(self).__name__)
        if self._codec is None:
            algo = ALGORITHMS["hierarchical" if self.hierarchical else "auto"]
            return comm.allreduce(address(buf), buf.numel(), code, int(ReduceOp.AVG), algo, nonblocking)
        kind, levels, chunk = self._codec
        return _C.compressed_allreduce(comm, address(buf), buf.numel(), code, kind=kind, chunk=chunk,
                                       levels=levels, average=True, hierarchical=self.hierarchical,
                                       seed=1, step=step, nonblocking=nonblocking)

    def _count_wire(self, buf: torch.Tensor) -> None:
        """Adds the bytes this rank sends for one average of buf (bandwidth-optimal allreduce,
        or the compressed reduce-scatter + allgather with codec headers)."""
        if self._codec is None:
            self.wire_bytes += ring_bytes(buf.numel(), buf.element_size(), self._hosts)
            return
        kind, levels, chunk = self._codec
        n = self._hosts
        if n > 1:
            # reduce-scatter and allgather of encoded blocks: 2 (n - 1) encodings of a 1/n block
            blocks = _C.compressed_blocks(buf.numel(), n, kind, chunk)
            mine = max(blocks)
            self.wire_bytes += 2 * (n - 1) * self._codec_obj.encoded_bytes(mine)

    def _apply(self, f: _Fragment) -> None:
        works, f.works, f.apply_at = f.works, None, None
        timeout = self._ddp._timeout
        for w in works or ():
            if w is not None:
                w.wait(timeout)
        opt = self.outer_optimizer
        alpha = self.fragment_update_alpha
        f.flat.ensure_views()  # a parameter replaced since the send gets the result too
        with torch.no_grad():
            for s in f.slots:
                s.outer.grad = s.buf
            opt.step()
            for s in f.slots:
                s.outer.grad = None
                if alpha == 0.0:
                    s.x.copy_(s.outer.data)
                else:
                    s.x.copy_(torch.lerp(s.outer.data, s.x.to(s.outer.dtype), alpha))
        self.log.append(("apply", self.steps, f.index))
        self._synced_at = self.steps

    def __del__(self):
        # The comm thread may still read or write the send buffers, which this object owns: let
        # the averages in flight finish before they are freed.
        for f in getattr(self, "fragments", ()):
            for w in f.works or ():
                if w is not None:
                    try:
                        w.wait(60.0)
                    except Exception:  # noqa: BLE001 - the error belongs to a step nobody waits for
                        pass

    def bytes_per_step(self) -> float:
        """Bytes this rank sent per inner step so far (averages only)."""
        return self.wire_bytes / max(1, self.steps)

    def wait(self) -> None:
        """Waits for the averages in flight (their results are still applied at their step)."""
        for f in self.fragments:
            if f.works is not None:
                for w in f.works:
                    if w is not None:
                        w.wait(self._ddp._timeout)
                f.works = [None] * len(f.works)

    # ---- checkpointing --------------------------------------------------------------------------

    # rumor.elastic: the inner replicas differ inside a round; a commit keeps their average x̄.
    # Restored, the round goes on from x̄ with the outer parameters and optimizer (the same on
    # every rank): the next average sees outer - x̄, the mean of the ranks' pseudo-gradients at
    # the commit, whatever the new world size.
    elastic_consensus = True

    # Live membership (rumor-run --live) goes by outer steps, as torchft's DiLoCo: each outer step
    # averages over the epoch's ranks; a round that a failure interrupts is given up (every member
    # goes back to its start and trains it again with the new world), and a newcomer enters at
    # the next outer step with the outer parameters and optimizer.
    #
    # Streaming DiLoCo (fragments averaged at different steps, or in the background) has no step
    # where every replica is the global model, so it runs live step by step instead: at every
    # change each member puts every fragment back to its outer parameters (the global model as
    # of that fragment's last outer step, the same on every member), averages in flight are
    # given up, and the step in flight is redone; a newcomer receives that global model, the
    # outer state and a member's inner optimizer. What a change costs is the local progress
    # made since each fragment's last outer step (at most a round, as for DiLoCo). The inner
    # steps communicate nothing, so each step first checks live membership's verdict
    # (elastic_live_quiet); a failure found by an average after the inner optimizer ran puts
    # back the outer state and the inner optimizer kept before that step (mark, below).
    @property
    def elastic_live_rounds(self) -> bool:
        """Whether live membership runs this DiLoCo by outer steps: with one fragment and no
        sync delay (every replica is the global model after each outer step)."""
        return self.num_fragments == 1 and self.fragment_sync_delay == 0

    @property
    def elastic_live(self) -> bool:
        """Whether live membership runs this DiLoCo step by step (Streaming DiLoCo: several
        fragments, or averages in the background)."""
        return not self.elastic_live_rounds

    @property
    def elastic_live_quiet(self) -> bool:
        """Whether each optimizer step checks live membership's verdict first (step by step: the
        inner steps communicate nothing)."""
        return self.elastic_live

    def _communicates(self, t: int) -> bool:
        """Whether inner step t (the value of ``steps`` after it) sends or applies an average."""
        return any(f.apply_at == t or t % self.inner_steps == f.offset for f in self.fragments)

    def elastic_live_mark(self) -> None:
        """Keeps the counters of the last applied step and, when the next step sends or applies
        an average (which may fail after the inner optimizer ran), copies of the outer
        parameters, the outer optimizer's state and the inner optimizer's state."""
        import copy

        self._live_mark = (self.steps, [f.sent for f in self.fragments], self.wire_bytes)
        self._live_keep = None
        if self.fragments and self._communicates(self.steps + 1):
            self._live_keep = ([[s.outer.detach().clone() for s in f.slots] for f in self.fragments],
                               copy.deepcopy(self.outer_optimizer.state_dict()),
                               copy.deepcopy(self._ddp.optimizer.state_dict()))

    def elastic_live_undo(self) -> None:
        """Gives up the averages in flight, puts back the state of the last mark and sets every
        fragment to its outer parameters (the global model), the same on every member. Called
        again, it does the same."""
        pending = [w for f in self.fragments for w in (f.works or ()) if w is not None]
        if pending:
            group = getattr(self, "_group", None)
            if group is not None and self._device_avg is None:
                try:  # an average blocked on a member that is gone: its communicator is this epoch's
                    group._comm.abort("DiLoCo: the live membership epoch ended")
                except Exception:  # noqa: BLE001 - already torn down
                    pass
            for w in pending:
                try:
                    w.wait(self._ddp._timeout)
                except Exception:  # noqa: BLE001 - the average of the step given up
                    pass
        mark = getattr(self, "_live_mark", None)
        if mark is None:
            return
        keep = self._live_keep
        self.steps, sent, self.wire_bytes = mark
        with torch.no_grad():
            if keep is not None:
                for f, outer in zip(self.fragments, keep[0]):
                    for s, o in zip(f.slots, outer):
                        s.outer.data.copy_(o)
                self.outer_optimizer.load_state_dict(keep[1])
                self._ddp.optimizer.load_state_dict(keep[2])
            for f, n in zip(self.fragments, sent):
                f.sent = n
                f.works, f.apply_at = None, None
                f.flat.ensure_views()
                for s in f.slots:
                    s.x.copy_(s.outer.data)
        self._synced_at = self.steps

    def elastic_live_at_boundary(self) -> bool:
        """Whether the last inner step ended with the outer step (every replica is then the
        global model): live membership keeps the State there and admits newcomers there.

        Returns:
            True before the first step and right after an outer step.
        """
        return self._synced_at == self.steps

    def elastic_state_dict(self) -> dict:
        """The algorithm's own part of a rumor.elastic commit: state_dict() (the outer parameters
        and the outer optimizer are the same on every rank).

        Returns:
            The dict state_dict() returns.

        Raises:
            RuntimeError: as state_dict().
        """
        return self.state_dict()

    def load_elastic_state_dict(self, sd) -> None:
        """Restores what elastic_state_dict() saved, as load_state_dict() does (rumor.elastic calls
        it after loading the model and the optimizer).

        Args:
            sd: the dict elastic_state_dict() returned.

        Raises:
            RuntimeError: as load_state_dict().
            ValueError: as load_state_dict().
        """
        self.load_state_dict(sd)

    def state_dict(self) -> dict:
        """The round state: inner step counter, outer parameters (the global model at the start of
        each fragment's round), the outer optimizer's state, and the averaged pseudo-gradients
        of averages in flight (waited for here) with the step after which they apply.

        Returns:
            A dict with ``steps``, ``wire_bytes``, ``sent`` (averages started, per fragment),
            ``outer`` (per fragment, copies of its outer parameters), ``pending`` (per fragment,
            None or (inner step, averaged pseudo-gradients)), ``outer_optimizer`` (its
            state_dict()) and ``config`` (inner_steps, num_fragments, fragment_sync_delay).

        Raises:
            RuntimeError: the model was not wrapped yet (the outer state is made by init()).
        """
        if self._ddp is None:
            raise RuntimeError(f"{type(self).__name__}.state_dict(): wrap the model first")
        self.wait()
        return dict(
            steps=self.steps, wire_bytes=self.wire_bytes,
            sent=[f.sent for f in self.fragments],
            outer=[[s.outer.detach().clone() for s in f.slots] for f in self.fragments],
            pending=[None if f.apply_at is None else (f.apply_at, [s.buf.clone() for s in f.slots])
                     for f in self.fragments],
            outer_optimizer=self.outer_optimizer.state_dict(),
            config=dict(inner_steps=self.inner_steps, num_fragments=self.num_fragments,
                        fragment_sync_delay=self.fragment_sync_delay))

    def load_state_dict(self, sd: dict) -> None:
        """Restores the round state saved by state_dict(): the step counter, the outer parameters,
        the outer optimizer's state and the averages that were in flight, applied at their step
        as they would have been. Waits for this algorithm's own averages in flight first. Load
        the model's and the inner optimizer's state as well.

        Args:
            sd: the dict state_dict() returned.

        Raises:
            RuntimeError: the model was not wrapped yet.
            ValueError: sd was saved with another inner_steps, num_fragments or
                fragment_sync_delay, or its outer parameters do not match this model's.
        """
        if self._ddp is None:
            raise RuntimeError(f"{type(self).__name__}.load_state_dict(): wrap the model first")
        cfg = sd["config"]
        mine = dict(inner_steps=self.inner_steps, num_fragments=self.num_fragments,
                    fragment_sync_delay=self.fragment_sync_delay)
        if cfg != mine:
            raise ValueError(f"{type(self).__name__}.load_state_dict(): the checkpoint was made with {cfg}, this "
                             f"algorithm has {mine}")
        outer = sd["outer"]
        if len(outer) != len(self.fragments) or any(
                len(o) != len(f.slots) or any(t.shape != s.outer.shape or t.dtype != s.outer.dtype
                                              for t, s in zip(o, f.slots))
                for o, f in zip(outer, self.fragments)):
            raise ValueError(f"{type(self).__name__}.load_state_dict(): the outer parameters do not match this model")
        self.wait()
        self.steps = int(sd["steps"])
        self._synced_at = self.steps  # a round boundary (live) or the ranks' average (commit)
        self.wire_bytes = float(sd["wire_bytes"])
        with torch.no_grad():
            for f, o, sent, pend in zip(self.fragments, outer, sd["sent"], sd["pending"]):
                f.sent = int(sent)
                for s, t in zip(f.slots, o):
                    s.outer.data.copy_(t)
                f.works, f.apply_at = None, None
                if pend is not None:
                    f.apply_at = int(pend[0])
                    f.works = [None] * len(f.slots)
                    for s, b in zip(f.slots, pend[1]):
                        s.buf.copy_(b)
        self.outer_optimizer.load_state_dict(sd["outer_optimizer"])


def _host_names(ddp) -> List[str]:
    st = _runtime.state()
    return list(dict.fromkeys(st.hosts[r] for r in ddp.group.ranks))


def _codec(quantization: str):
    """The Python codec object of a quantization (for its encoded sizes)."""
    from .. import compression as C

    return {"fp16": C.Float16, "bf16": C.BFloat16, "int8": C.MinMaxUInt8,
            "4bit": lambda: C.QSGD(levels=QUANTIZATIONS["4bit"][1], chunk=QUANTIZATIONS["4bit"][2])}[quantization]()


class StreamingDiLoCo(DiLoCo):
    """DiLoCo with streaming defaults: 4 fragments, each averaged in the background while the
    next fragment_sync_delay inner steps compute (None: H // (2 F), at least 1: half the gap
    between two fragments' sends), int8 pseudo-gradients on the wire, and
    fragment_update_alpha=0.5 (half of a fragment's local progress made while its average was
    in flight is kept). Same arguments as DiLoCo, with other defaults.

    Args:
        inner_steps: H, inner optimizer steps per round, an integer >= 1; default 32.
        outer_optimizer: builds the outer optimizer from the outer parameters; default None
            (SGD, lr 0.7, Nesterov momentum 0.9).
        num_fragments: F, the fragments synchronized one after the other, 1 <= F <= H;
            default 4.
        fragment_sync_delay: tau, inner steps a fragment's average runs in the background,
            0 <= tau < H; default None: H // (2 F), at least 1 (and at most H - 1).
        fragment_update_alpha: the share of a fragment's local progress kept when its average
            is applied, in [0, 1]; default 0.5.
        quantization: the pseudo-gradients on the wire: None, "fp16", "bf16", "int8" (the
            default) or "4bit".
        hierarchical: average inside each host first, then between one rank per host; default
            False.

    Raises:
        TypeError: an argument has the wrong type (the message names it).
        ValueError: an argument is out of range (the message names it).
    """

    def __init__(self, inner_steps: int = 32, outer_optimizer: Optional[Callable] = None, num_fragments: int = 4,
                 fragment_sync_delay: Optional[int] = None, fragment_update_alpha: float = 0.5,
                 quantization: Optional[str] = "int8", hierarchical: bool = False):
        if fragment_sync_delay is None:
            h = _int_arg("StreamingDiLoCo", "inner_steps", inner_steps, 1)
            f = _int_arg("StreamingDiLoCo", "num_fragments", num_fragments, 1)
            fragment_sync_delay = min(h - 1, max(1, h // (2 * f)))
        super().__init__(inner_steps, outer_optimizer, num_fragments, fragment_sync_delay, fragment_update_alpha,
                         quantization, hierarchical)
