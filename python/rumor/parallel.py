"""rumor.DistributedDataParallel: data-parallel training on rumor's C++ engine."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import logging
import math
import time
import weakref
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from . import _C, _rendezvous, _runtime, timeline
from .engine import device as device_engine
from ._runtime import Group, communicator
from ._tensor import address, copy_into, dtype_code
from .algorithms import Algorithm, GradientAllReduce
from .collectives import ReduceOp, allgather, allreduce_, broadcast_
from .engine.buckets import Bucket, coalesced_broadcast, merge_for_link
from .errors import AbortedError, RumorError

_MB = 1024 * 1024
# The optimizer state a host-shared update keeps per element, by kernel (Adam: with amsgrad).
_SHARED_STATE = {"adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), "sgd": ("momentum_buffer",)}


def _aligned(nbytes: int) -> int:
    """Arena regions start on cache lines."""
    return (nbytes + 63) // 64 * 64


def _clip_bucket(grads: List[torch.Tensor], max_norm: float) -> None:
    """overlap_optimizer's per-bucket clipping for the Python fallback: what the C++ step op
    does (csrc/optim/step_op.cpp), the norm summed in float64 over the bucket's segments."""
    with torch.no_grad():
        # Accumulated in float64 without a float64 copy of the gradients.
        norm = math.sqrt(sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in grads))
        coef = torch.tensor(max_norm / (norm + 1e-6), dtype=torch.float32)
        if coef < 1:
            for g in grads:
                g.mul_(coef)


class DistributedDataParallel(torch.nn.Module):
    """Wraps a module for data-parallel training with rumor.

    Parameters and buffers are broadcast from rank 0 when wrapping (and buffers before every
    forward in training mode if broadcast_buffers). During backward, gradients are averaged by
    the algorithm (default GradientAllReduce) bucket by bucket, overlapped with the rest of
    backward; when loss.backward() returns, every rank holds the same gradients.

    Parameters listed in ``module._ddp_params_and_buffers_to_ignore`` (names, as for torch DDP)
    and parameters with requires_grad=False are neither broadcast nor averaged.

    With an optimizer fused by rumor.optim.fuse_optimizer, its flat gradient buffers are the
    buckets (each bucket holds one run of parameters per param group). overlap_optimizer=True
    (needs ``optimizer``, fused here if it is not) runs each bucket's optimizer update as soon as
    its communication finished, while backward goes on; optimizer.step() then only runs its hooks
    (and updates parameters outside the buckets). With it, bucket_clip_norm=c clips each bucket's
    averaged gradients to L2 norm c before its update (global clipping is impossible there: the
    other buckets' gradients do not exist yet). See docs/optimizer.md for what changes.

    After the first iteration buckets follow the observed ready order and a bucket is closed where
    the next gradient came more than ``bucket_split_gap_ms`` later (across hosts, only where that
    gap is also longer than one allreduce's round trips: buckets run one after another, and on a
    long link each costs its round trips whatever its size; there the small first bucket goes
    alone only when the rest of backward outlasts them too): a timing decision (the first
    rank's), so two runs of one script may get different buckets, and with them different bits
    from compressed algorithms (their blocks and seeds follow the bucket) and, on three or more
    ranks, possibly from allreduce (an element's order of addition can follow its place in the
    bucket); ``math.inf`` never splits, for runs that must repeat bit for bit.
    ``shared_buckets=False`` keeps buckets out of shared memory when every rank is on this host.
    ``autotune=True`` (or a dict of rumor.autotune.AutotuneConfig fields, or env RUMOR_AUTOTUNE=1
    when left None) searches these settings during the first steps and keeps the fastest
    (docs/autotune.md).

    torch DDP's keyword arguments keep torch's meaning where rumor can give it: device_ids=[d]
    (a module on CUDA device d; tensor inputs are moved there), output_device (only the module's
    device), process_group (a rumor.Group, as group=), gradient_as_bucket_view (gradients are
    always bucket views), static_graph=True (unused parameters need no find_unused_parameters).
    state_dict() has torch DDP's keys ("module." + the module's); load_state_dict() also takes
    the module's own keys. Attributes are not forwarded to the module: use .module. Every
    remaining difference, with what to do instead: docs/torch_ddp.md.

    Args:
        module: the torch.nn.Module to train; its parameters and buffers are broadcast from
            rank 0 when wrapping.
        optimizer: the optimizer of module's parameters; None (the default) for none. Needed by
            algorithms that act after the step (after_step hooks) and by overlap_optimizer.
        algorithm: the rumor.algorithms.Algorithm that decides what is communicated; None (the
            default) means GradientAllReduce (averaged gradients, as torch DDP).
        bucket_cap_mb: the most MiB of gradients one bucket holds; default 25. Must be positive.
        first_bucket_mb: the cap of the first bucket in MiB, small so that communication starts
            early in backward; default 1. Must be positive.
        find_unused_parameters: if True, a parameter that got no gradient in a backward is
            treated as ready (its gradient counted as zero) instead of raising; default False,
            as in torch DDP.
        broadcast_buffers: if True (the default), rank 0's buffers (for instance BatchNorm's
            running statistics) are broadcast before every forward in training mode.
        group: the Group of ranks that train together (rumor.new_group()); None (the
            default) means every rank.
        overlap_optimizer: if True (default False), each bucket's optimizer update runs as soon
            as its communication finished, during backward; needs optimizer.
        bucket_clip_norm: with overlap_optimizer, the L2 norm each bucket's averaged gradients
            are clipped to before its update; None (the default) clips nothing.
        bucket_split_gap_ms: after the first iteration, a bucket is closed where the next
            gradient came more than this many milliseconds later (across hosts: more than this
            or than one allreduce's round trips, whichever is longer); default 5.0, math.inf
            never splits. Must be positive.
        shared_buckets: False keeps buckets out of shared memory when every rank is on this
            host; None (the default) lets rumor decide.
        autotune: True, or a dict of rumor.autotune.AutotuneConfig fields, searches the bucket
            settings during the first steps and keeps the fastest; None (the default) follows
            env RUMOR_AUTOTUNE; False never tunes.
        device_ids: torch DDP's argument: None (the default) or [d], where the module lives on
            CUDA device d; tensor inputs are then moved to d. A CPU module or several devices is
            refused with a ValueError saying what to do.
        output_device: torch DDP's argument; only the module's own device (or None, the
            default) is accepted.
        process_group: a rumor Group, the same as group= (give one of them); a torch
            ProcessGroup is refused with a TypeError (rumor runs its own communicator).
        gradient_as_bucket_view: accepted for torch's API: rumor's gradients are always views of
            their bucket, so True has torch's meaning and False (the default) changes nothing.
        static_graph: True (default False) tells rumor the set of used parameters never changes,
            so unused parameters need no find_unused_parameters.

    Raises:
        RuntimeError: rumor.init() was not called.
        TypeError: module is not a torch.nn.Module, algorithm is not an Algorithm, or
            shared_buckets or bucket_clip_norm has the wrong type.
        ValueError: bucket_cap_mb, first_bucket_mb or bucket_split_gap_ms is not positive, or
            overlap_optimizer is set without optimizer.
        RuntimeError: (at the end of a backward) a parameter got no gradient and
            find_unused_parameters is False.
    """

    def __init__(self, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 algorithm: Optional[Algorithm] = None, bucket_cap_mb: float = 25,
                 first_bucket_mb: float = 1, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, group: Optional[Group] = None,
                 overlap_optimizer: bool = False, bucket_clip_norm: Optional[float] = None,
                 bucket_split_gap_ms: float = 5.0, shared_buckets: Optional[bool] = None,
                 autotune=None, *, device_ids=None, output_device=None, process_group=None,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False):
        super().__init__()
        # What _live_rebind() builds the wrapper again from, after live membership re-formed the job.
        self._ctor_args = dict(
            module=module, optimizer=optimizer, algorithm=algorithm, bucket_cap_mb=bucket_cap_mb,
            first_bucket_mb=first_bucket_mb, find_unused_parameters=find_unused_parameters,
            broadcast_buffers=broadcast_buffers, group=group, overlap_optimizer=overlap_optimizer,
            bucket_clip_norm=bucket_clip_norm, bucket_split_gap_ms=bucket_split_gap_ms,
            shared_buckets=shared_buckets, autotune=autotune, device_ids=device_ids, output_device=output_device,
            process_group=process_group, gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)
        if not _runtime.is_initialized():
            raise RuntimeError("rumor.DistributedDataParallel: call rumor.init() before wrapping a model")
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"rumor.DistributedDataParallel: expected a torch.nn.Module, got {type(module).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            # torch DDP's second positional argument is device_ids: DDP(model, [0]) lands here.
            raise TypeError("rumor.DistributedDataParallel: the second argument is the optimizer (a "
                            f"torch.optim.Optimizer or None), got {type(optimizer).__name__}; torch DDP's "
                            "device_ids, output_device and process_group are keyword arguments here "
                            "(device_ids=[d])")
        for name, flag in (("gradient_as_bucket_view", gradient_as_bucket_view), ("static_graph", static_graph)):
            if not isinstance(flag, bool):
                raise TypeError(f"rumor.DistributedDataParallel: {name} must be True or False, got "
                                f"{type(flag).__name__}")
        group = _group_from(group, process_group)
        if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError("rumor.DistributedDataParallel: bucket_cap_mb and first_bucket_mb must be positive")
        if (isinstance(bucket_split_gap_ms, bool) or not isinstance(bucket_split_gap_ms, (int, float))
                or not bucket_split_gap_ms > 0):
            raise ValueError("rumor.DistributedDataParallel: bucket_split_gap_ms must be a positive number "
                             f"(math.inf: never split), got {bucket_split_gap_ms!r}")
        if shared_buckets is not None and not isinstance(shared_buckets, bool):
            raise TypeError("rumor.DistributedDataParallel: shared_buckets must be None, True or False, got "
                            f"{type(shared_buckets).__name__}")
        if algorithm is not None and not isinstance(algorithm, Algorithm):
            raise TypeError("rumor.DistributedDataParallel: algorithm must be a rumor.algorithms.Algorithm")
        if overlap_optimizer and optimizer is None:
            raise ValueError("rumor.DistributedDataParallel: overlap_optimizer=True needs the optimizer "
                             "(optimizer=...)")
        if bucket_clip_norm is not None:
            if isinstance(bucket_clip_norm, bool) or not isinstance(bucket_clip_norm, (int, float)):
                raise TypeError("rumor.DistributedDataParallel: bucket_clip_norm must be a number, got "
                                f"{type(bucket_clip_norm).__name__}")
            if not math.isfinite(bucket_clip_norm) or bucket_clip_norm <= 0:
                raise ValueError(f"rumor.DistributedDataParallel: bucket_clip_norm must be finite and > 0, got "
                                 f"{bucket_clip_norm!r}")
            if not overlap_optimizer:
                raise ValueError("rumor.DistributedDataParallel: bucket_clip_norm is for overlap_optimizer=True; "
                                 "without it, clip all gradients between backward and step "
                                 "(torch.nn.utils.clip_grad_norm_)")
        self.bucket_clip_norm = None if bucket_clip_norm is None else float(bucket_clip_norm)
        self.module = module
        self.optimizer = optimizer
        self.overlap_optimizer = bool(overlap_optimizer)
        self._fusion = None
        if optimizer is not None:
            from .optim.fused import fuse_optimizer, fusion_of
            if self.overlap_optimizer and fusion_of(optimizer) is None:
                fuse_optimizer(optimizer)
            self._fusion = fusion_of(optimizer)
        self._group_of = {}
        if self._fusion is not None:
            self._group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._step_ops: List[Optional[object]] = []
        self._step_segs: List[list] = []
        self.algorithm = algorithm if algorithm is not None else GradientAllReduce()
        # static_graph: as in torch, parameters unused in every iteration need no
        # find_unused_parameters; here that costs nothing more than with it (zeros are averaged).
        self.static_graph = static_graph
        self.find_unused_parameters = bool(find_unused_parameters) or static_graph
        # Every gradient is a view into its bucket already (torch's gradient_as_bucket_view=True);
        # False is accepted too, see docs/torch_ddp.md.
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = bool(broadcast_buffers)
        self.group = communicator(group, "rumor.DistributedDataParallel")
        self._cap_bytes = int(bucket_cap_mb * _MB)
        # Ready-time gap (first iteration, first rank) at which a bucket is closed early.
        self._split_gap_s = bucket_split_gap_ms / 1e3
        # False keeps buckets out of shared memory even when every rank is local (the autotuner
        # tries both); None/True: shared whenever possible.
        self._shared_setting = shared_buckets
        # overlap_optimizer's update once per host (see _shared_step_possible); read once, so that
        # rebuilt buckets keep the choice.
        self._host_step_setting = _runtime.env_bool("RUMOR_SHARED_OPTIMIZER", True)
        self._autotuner = None
        self._first_cap_bytes = int(first_bucket_mb * _MB)

        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named = [(n, p) for n, p in module.named_parameters() if n not in ignore]
        self._input_device = _input_device(device_ids, output_device, module)
        self.device_ids = None if self._input_device is None else [self._input_device.index]
        self.output_device = None if self._input_device is None else self._input_device.index
        self._check_no_sparse(module)
        # Live membership: why a member's loss cut this construction's collectives (then the
        # first epoch re-forms and starts from one member's state sent to all; rumor.elastic.run).
        self._construction_cut: Optional[str] = None
        self._constructing = True
        self._cut_by_membership("verify", lambda: self._verify_same_model(named))
        # Parameters on a CUDA device (or, in the tests, the emulation of that path on CPU) run
        # on rumor.engine.device.DeviceEngine instead of the C++ engine.
        self._device_mode = self._choose_device_mode(named, autotune)
        self._synced_params = [p for _, p in named]
        self._buffers_to_sync = [b for n, b in module.named_buffers() if n not in ignore]
        if not self._state_follows():
            self._cut_by_membership("broadcast", lambda: coalesced_broadcast(
                [p.data for p in self._synced_params] + self._buffers_to_sync, self.group))

        trainable = [(n, p) for n, p in named if p.requires_grad]
        self._names = [n for n, _ in trainable]
        self._params = [p for _, p in trainable]
        for n, p in trainable:
            dtype_code(p.dtype, f"rumor.DistributedDataParallel (parameter {n})")
        if self._device_mode is None:
            self._engine = _C.BucketEngine(self.group._comm)
        else:
            self._engine = self._make_device_engine()
        self._require_sync = True
        # Checked by every gradient hook: once a bucket's collective failed (a peer gone) or the
        # communicator was aborted (live membership), backward stops at the next gradient
        # instead of computing the rest for buckets that cannot be sent.
        self._hook_comm = self.group._comm
        # time.monotonic() when the last forward began, when the module began (after the buffer
        # broadcast and the algorithm's before_forward, e.g. decentralized weight mixing), and its end
        self._forward_times = (None, None, None)
        self._timeline = None  # raw figures of the last synchronized iteration (see last_iteration_timeline)
        self._marked = [False] * len(self._params)
        self._ready_order: List[int] = []
        self._ready_times: Dict[int, float] = {}
        self._callback_queued = False
        self._rebuilt = False
        # One bucket's latency on this group's links (s), agreed at the first rebuild.
        self._bucket_latency_s = 0.0
        self._link_figures = None  # (ready time per position, bytes/s, s per bucket) from the rebuild
        self.buckets: List[Bucket] = []
        self._bucket_of: List[int] = [0] * len(self._params)
        self._views: List[Optional[torch.Tensor]] = [None] * len(self._params)
        self._carries: List[bool] = []  # per bucket: its op reads the gradients from the bucket
        # Before the first backward, assume gradients arrive in reverse definition order.
        self._build_buckets(list(reversed(range(len(self._params)))))
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                              for i, p in enumerate(self._params)]
        # Sparse gradients must be refused before autograd folds them into the dense bucket view.
        self._hook_handles += [p.register_hook(self._make_sparse_check(i)) for i, p in enumerate(self._params)]
        if optimizer is not None:
            ref = weakref.ref(self)

            def after_step(*_):
                ddp = ref()
                if ddp is not None:
                    ddp.algorithm.after_step(ddp)

            def trace(method):
                def call(*args):
                    ddp = ref()
                    if ddp is not None:
                        getattr(ddp, method)(*args)
                return call

            self._step_hook = optimizer.register_step_post_hook(after_step)
            self._step_trace_hooks = (optimizer.register_step_pre_hook(trace("_trace_step_begin")),
                                      optimizer.register_step_post_hook(trace("_trace_step_end")))
        self._step_t0 = None
        self._backward_t0 = None
        self._hooks_removed = False
        self._cut_by_membership("algorithm", lambda: self.algorithm.init(self))
        from .autotune import _make_autotuner
        self._autotuner = self._cut_by_membership("autotuner", lambda: _make_autotuner(self, autotune))
        self._constructing = False

    # ---- setup ------------------------------------------------------------------------------

    @staticmethod
    def _check_no_sparse(module):
        for name, m in module.named_modules():
            if getattr(m, "sparse", False) is True:
                raise NotImplementedError(
                    f"rumor.DistributedDataParallel: module {name or type(m).__name__} produces sparse "
                    "gradients (sparse=True), which rumor does not support yet; use sparse=False")

    def _verify_same_model(self, named):
        """Every rank must wrap the same parameter shapes: fail at wrap time, on every rank."""
        sig = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in named)
        digest = int.from_bytes(hashlib.sha256(sig.encode()).digest()[:8], "little", signed=True)
        mine = torch.tensor([[len(named), digest]], dtype=torch.int64)
        every = allgather(mine, self.group)
        if not bool((every == every[0]).all()):
            rows = ", ".join(f"rank {self.group.ranks[i]}: {int(every[i, 0])} parameters (signature {int(every[i, 1]) & 0xffffffff:08x})"
                             for i in range(every.shape[0]))
            err = ValueError("rumor.DistributedDataParallel: the wrapped models differ across ranks "
                             f"(parameter names, shapes, dtypes or requires_grad): {rows}")
            # Which ranks differ from the group's first (live membership refuses those newcomers).
            err.ranks_differing = [self.group.ranks[i] for i in range(every.shape[0])
                                   if not bool((every[i] == every[0]).all())]
            raise err

    def _choose_device_mode(self, named, autotune) -> Optional[str]:
        """None for the C++ engine (CPU parameters), else the DeviceEngine's mode: "direct"
        (the algorithm's device ops over NCCL) or "staged" (its CPU ops on page-locked copies)."""
        what = "rumor.DistributedDataParallel"
        emulate = device_engine.emulated()
        if all(p.device.type == "cpu" for _, p in named) and emulate is None:
            return None
        if emulate is None:
            from .gpu import routing

            # Every parameter on this rank's CUDA device, or a ValueError naming the ones that
            # are not; at the group's first CUDA call, the ranks agree on the GPU transport.
            gpu = routing.route(what, self.group, *[(f"parameter {n}", p) for n, p in named])
            nccl = gpu.transport == "nccl"
        else:
            nccl = emulate == "direct"
        self._device_nccl = nccl  # algorithms' device tasks choose NCCL or staging by it
        name = type(self.algorithm).__name__
        if self.algorithm.has_device_ops(self, nccl):
            return "direct"
        if self.algorithm.stages_through_host:
            return "staged"
        raise ValueError(f"{what}: {name} does not run on CUDA parameters yet with this setup: its GPU form needs "
                         "NCCL between the ranks (RUMOR_GPU_TRANSPORT=auto or nccl) and, across hosts, "
                         "hierarchical=False; otherwise keep this model on the CPU")

    def _make_device_engine(self):
        from .engine.ops import HostTransport, NcclTransport

        if device_engine.emulated() is not None:
            layer, transport = device_engine.EmulatedLayer(), HostTransport(self.group._comm)
        else:
            gpu = self.group._gpu
            layer = device_engine.CudaLayer(gpu.torch_device)
            transport = NcclTransport(gpu) if gpu.transport == "nccl" else None
        return device_engine.DeviceEngine(layer, self._device_mode, transport, self.group._comm,
                                        lambda: _runtime.state().timeout)

    def _bucket_spec(self, bucket: Bucket):
        """What the engine takes for one bucket: (address or, on a device, the flat tensor,
        elements, dtype code, parameters, op)."""
        flat = bucket.flat
        head = (flat.numel(), dtype_code(flat.dtype, "bucket"), len(bucket.params))
        if self._device_mode is None:
            op = self._shared_step_ops.get(bucket.index) or self.algorithm.bucket_op(self, bucket)
            return (address(flat),) + head + (op,)
        if self._device_mode == "direct":
            return (flat,) + head + (self.algorithm.device_bucket_op(self, bucket),)
        op = self._engine.staged_op(flat, lambda pinned: self.algorithm.bucket_op(
            self, dataclasses.replace(bucket, flat=pinned, arena=None)))
        return (flat,) + head + (op,)

    def _build_buckets(self, order: List[int], breaks=frozenset(), link=None) -> None:
        """(Re)creates the flat buffers in the given ready order and points every .grad at its
        slice, keeping whatever gradient values the parameters hold now. link: (ready time per
        position, bytes per second, seconds per bucket) over a slow, far link, where neighbouring
        plan's runs of neighbouring buckets merge into the partition whose serial schedule over the
        link ends soonest (engine.buckets.merge_for_link)."""
        ordered = [self._params[i] for i in order]
        plan = self.algorithm.plan_buckets(self, ordered, self._cap_bytes, self._first_cap_bytes,
                                           breaks=frozenset(breaks))
        if link is not None:
            ready, rate, latency = link
            plan = merge_for_link(plan, [p.numel() * p.element_size() for p in ordered], ready,
                                  [p.dtype for p in ordered], rate, latency)
        seen = sorted(j for b in plan for j in b)
        if seen != list(range(len(ordered))):
            raise ValueError("Algorithm.plan_buckets must place every parameter in exactly one bucket")
        layout = []  # (param indices, dtype, elements, byte offset in the arena)
        arena_bytes = 0
        for bi, members in enumerate(plan):
            idx = [order[j] for j in members]
            if self._fusion is not None:
                # One run per optimizer param group inside a bucket: a fused segment each. Order
                # inside a bucket does not matter to when it launches.
                n_groups = len(self.optimizer.param_groups)
                idx.sort(key=lambda i: self._group_of.get(id(self._params[i]), n_groups))
            dtypes = {self._params[i].dtype for i in idx}
            if len(dtypes) != 1:
                raise ValueError(f"Algorithm.plan_buckets: bucket {bi} mixes dtypes {dtypes}")
            dtype = dtypes.pop()
            total = sum(self._params[i].numel() for i in idx)
            layout.append((idx, dtype, total, arena_bytes))
            arena_bytes += _aligned(total * torch.empty((), dtype=dtype).element_size())
        # With the host-shared update, each float32 bucket's arena also holds this rank's
        # parameters, then the host's optimizer state (used in rank 0's arena only).
        self._step_regions = {}
        shared = self._shared_buckets()
        if shared and self._shared_step_possible():
            for bi, (_, dtype, total, _) in enumerate(layout):
                if dtype == torch.float32:
                    n_regions = 1 + len(_SHARED_STATE[self._fusion._kernel])
                    self._step_regions[bi] = [arena_bytes + k * _aligned(total * 4) for k in range(n_regions)]
                    arena_bytes += n_regions * _aligned(total * 4)
        arena = self._cut_by_membership("arena", lambda: _C.SharedArena(self.group._comm, arena_bytes)) \
            if shared else None
        if arena is None:  # none was made (a live job's first epoch lost a member meanwhile)
            self._step_regions = {}
        buckets, specs = [], []
        for bi, (idx, dtype, total, at) in enumerate(layout):
            if arena is not None:
                flat = torch.frombuffer(arena, dtype=dtype, count=total, offset=at)
                flat.zero_()
            else:
                flat = torch.zeros(total, dtype=dtype, device=self._params[idx[0]].device)
            offsets, off = [], 0
            for i in idx:
                p = self._params[i]
                view = flat[off:off + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._views[i] = view
                self._bucket_of[i] = bi
                offsets.append(off)
                off += p.numel()
            bucket = Bucket(bi, flat, [self._params[i] for i in idx], [self._names[i] for i in idx], offsets,
                            arena)
            buckets.append(bucket)
        self._shared_step_ops = {}
        self._set_buckets([self._bucket_spec(b) for b in buckets])
        self.buckets = buckets
        if self._fusion is not None:
            self._relayout_fusion()

    def _shared_step_possible(self) -> bool:
        """overlap_optimizer's update runs once per host, inside the shared-bucket allreduce
        (csrc/optim/shared_step_op.h), when the C++ kernels run the optimizer, no per-bucket
        clipping needs the whole bucket first, and the buckets are plain GradientAllReduce ones."""
        return (self.overlap_optimizer and self._fusion is not None and self._fusion._kernel is not None
                and self.bucket_clip_norm is None and type(self.algorithm).bucket_op is GradientAllReduce.bucket_op
                and self._host_step_setting)

    def _shared_storage(self, bi: int, off: int, n: int):
        """A run of bucket bi's parameters in the arena: this rank's parameters, and the state
        views into rank 0's arena (untouched pages of the other ranks' state regions cost
        nothing: shared memory is allocated when first written)."""
        from .optim.fused import SharedStorage

        arena, regions = self.buckets[bi].arena, self._step_regions[bi]
        flat = torch.frombuffer(arena, dtype=torch.float32, count=n, offset=regions[0] + off * 4)
        host = arena.rank_view(0)
        state = {key: torch.frombuffer(host, dtype=torch.float32, count=n, offset=regions[1 + k] + off * 4)
                 for k, key in enumerate(_SHARED_STATE[self._fusion._kernel])}
        return SharedStorage(flat, state, writer=self.group._comm.rank == 0)

    def _relayout_fusion(self) -> None:
        """The fused optimizer's segments become runs of the buckets (their gradient slices), and
        with overlap_optimizer each bucket gets its update op."""
        import itertools

        fusion = self._fusion
        plan, covered = [], set()
        for bi, b in enumerate(self.buckets):
            runs = [(gi, list(run)) for gi, run in
                    itertools.groupby(zip(b.params, b.offsets), key=lambda t: self._group_of.get(id(t[0])))
                    if gi is not None]
            shared = bi in self._step_regions and runs and all(fusion.group_kernel_ok(gi) for gi, _ in runs)
            for gi, run in runs:
                params = [p for p, _ in run]
                off, n = run[0][1], sum(p.numel() for p in params)
                plan.append((gi, params, b.flat[off:off + n], bi, self._shared_storage(bi, off, n) if shared else None))
                covered.update(id(p) for p in params)
        for gi, params, _ in fusion.default_plan():
            rest = [p for p in params if id(p) not in covered]
            if rest:
                plan.append((gi, rest, None, None))
        fusion.layout(plan)
        if self.overlap_optimizer:
            fusion.overlap = self
            if not hasattr(self, "_amp_flag_before"):
                # What remove_hooks() puts back: the optimizer's own (instance) flag, or none.
                self._amp_flag_before = self.optimizer.__dict__.get("_step_supports_amp_scaling", _NO_FLAG)
            self.optimizer._step_supports_amp_scaling = True  # so that GradScaler is refused, not ignored
            self._step_segs = [[s for s in fusion.segments if s.bucket == bi] for bi in range(len(self.buckets))]
            self._step_ops = [self._make_step_op(bi, segs) for bi, segs in enumerate(self._step_segs)]
            self._shared_step_ops = {bi: op for bi, op in enumerate(self._step_ops)
                                     if isinstance(op, _C.SharedStepAllreduceOp)}
            if self._shared_step_ops:
                self._refresh_bucket_ops()
            else:
                self._engine.set_after(self._step_ops)

    def _after_ops(self):
        """The engine's per-bucket `after` ops: the updates not already inside the bucket's op."""
        return [None if bi in self._shared_step_ops else op for bi, op in enumerate(self._step_ops)]

    def _make_step_op(self, bi: int, segs):
        if not segs:
            return None
        fusion = self._fusion
        if segs[0].shared is not None:
            # Storage is shared only where the kernels run every segment of the bucket.
            op = ReduceOp.AVG if self.algorithm.average else ReduceOp.SUM
            return _C.SharedStepAllreduceOp(self.buckets[bi].arena, int(op))
        clip = self.bucket_clip_norm
        # On a device (or its emulation) the update is torch's, queued on the communication
        # stream right after the bucket's op; the C++ kernels update host memory only.
        if self._device_mode is None and fusion._kernel is not None and all(fusion._kernel_ok(s) for s in segs):
            op = _C.OptimizerStepOp()
            if clip is not None:
                op.set_clip_norm(clip)
            return op

        # Any other optimizer: its own update over this bucket's segments, on the step thread.
        # The op lives in the C++ engine, out of the garbage collector's sight, and the fusion
        # holds this wrapper: a strong reference here would keep a dropped wrapper alive.
        fusion_ref = weakref.ref(fusion)

        def step():
            fusion = fusion_ref()
            if fusion is None:
                return
            if clip is not None:
                _clip_bucket([s.grad for s in segs], clip)
            fusion.step_segments(segs)

        return step if self._device_mode is not None else _C.python_bucket_op(step)

    def _prepare_step_ops(self) -> None:
        """Before a backward's first bucket launches: hand the C++ updates this step's
        hyper-parameters (lr schedulers may have changed them) and state buffers."""
        fusion = self._fusion
        for op, segs in zip(self._step_ops, self._step_segs):
            if isinstance(op, _C.SharedStepAllreduceOp) and not all(fusion._kernel_ok(s) for s in segs):
                raise RuntimeError("rumor.DistributedDataParallel: overlap_optimizer's host-shared update "
                                   "runs rumor's C++ kernels, which a param group no longer allows (a tensor "
                                   "lr or betas, or capturable=True, set after wrapping); set them before "
                                   "wrapping the model")
            if isinstance(op, (_C.OptimizerStepOp, _C.SharedStepAllreduceOp)):
                op.set_segments([fusion.kernel_segment(s) for s in segs])
        fusion.expose_state()

    def _refresh_bucket_ops(self) -> None:
        """Asks the algorithm again for each bucket's op, keeping the buckets (for algorithms
        whose op changes during training, e.g. AsyncModelAverage after its warm-up). Only
        between iterations (no bucket in flight), e.g. from after_backward."""
        self._set_buckets([self._bucket_spec(b) for b in self.buckets])
        if self._step_ops:
            self._engine.set_after(self._after_ops())

    def _set_buckets(self, specs) -> None:
        """Hands the buckets and their ops to the engine. A bucket whose op communicates nothing
        (LocalSGD between averages, DiLoCo, the weight-averaging algorithms) leaves each .grad
        where autograd put it: moving a zero_grad(set_to_none=True) gradient into the bucket
        would copy every gradient once a step for nobody (mlp25m, 4 ranks on 2 cores: 60 ms of
        a 330 ms step). The fused optimizer reads its gradients from the buckets, so with one
        they are carried all the same."""
        from .engine.ops import LocalOp

        self._engine.set_buckets(specs)
        ops = [getattr(s[4], "host_op", s[4]) for s in specs]  # a staged CUDA bucket: its CPU op
        self._carries = [not (isinstance(op, (_C.LocalBucketOp, LocalOp)) and self._fusion is None) for op in ops]

    def _shared_buckets(self) -> bool:
        """Buckets go to shared memory when every rank of the group is on this host."""
        comm = self.group._comm
        return (self._device_mode is None and comm.size > 1 and comm.all_local and comm.uses_shm and self._shared_setting is not False
                and _runtime.env_bool("RUMOR_SHARED_BUCKETS", True))

    # ---- hooks ------------------------------------------------------------------------------

    # Hooks live on the parameters and the optimizer (autograd keeps tensor hooks in C++, where the
    # garbage collector cannot follow them): they reach the wrapper through a weak reference, so
    # that a dropped wrapper, its buckets and its shared memory are freed.
    def _make_sparse_check(self, i: int):
        ref = weakref.ref(self)

        def check(grad: torch.Tensor):
            self = ref()
            if self is None:
                return None
            if grad.layout != torch.strided:
                self._abandon_iteration()
                raise NotImplementedError(f"rumor.DistributedDataParallel: parameter {self._names[i]} got a "
                                          f"{grad.layout} gradient; only dense gradients are supported")
            return None

        return check

    def _abandon_iteration(self, reraise: bool = False) -> None:
        """An error stops this backward on every rank alike: complete the buckets already begun
        (the same ones everywhere) so that the next iteration starts clean. With reraise, the
        buckets' own error is raised (otherwise the error being raised is the one the user needs
        to see)."""
        self._marked = [False] * len(self._params)
        self._callback_queued = False
        if not self._rebuilt:
            self._ready_order = []
        if not self._engine.idle():
            self._engine.launch_all()
        try:
            self._engine.finish(self._finish_guard)
        except Exception:
            if reraise:
                raise

    def _stop_backward(self) -> None:
        """The buckets' communicator is broken: ends this iteration and raises the collective's
        own error (naming the op and the peer), so that autograd unwinds the rest of backward."""
        # A bucket begun failed: its error is raised (finish() of an engine that began nothing
        # complains only of the buckets never filled, which is not what went wrong).
        self._abandon_iteration(reraise=not self._engine.idle())
        raise AbortedError("rumor.DistributedDataParallel: backward stopped: the communicator of the gradient "
                           "buckets is broken (a peer failed or the group was aborted)")

    def _make_hook(self, i: int):
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            self = ref()
            if self is None or not self._require_sync:
                return
            if self._hook_comm.aborted:
                self._stop_backward()
            grad = p.grad
            view = self._views[i]
            if grad.data_ptr() != view.data_ptr() and self._carries[self._bucket_of[i]]:
                # .grad was replaced (zero_grad(set_to_none=True), or assigned): move it back
                # into the bucket so that the bucket carries it.
                copy_into(view, grad)
                p.grad = view
            if self._marked[i]:
                self._abandon_iteration()
                raise RuntimeError(f"rumor.DistributedDataParallel: parameter {self._names[i]} received two "
                                   "gradients in one backward pass (is it used in a loop with "
                                   "retain_graph, or was backward called twice before the step?)")
            self._marked[i] = True
            if not self._rebuilt:
                self._ready_order.append(i)
                self._ready_times[i] = time.perf_counter()
            if not self._callback_queued:
                if self._step_ops:
                    try:
                        self._prepare_step_ops()
                    except Exception:
                        # Autograd drops the backward: leave no gradient marked and no callback
                        # counted, so the next iteration (settings fixed) starts clean.
                        self._abandon_iteration()
                        raise
                self._callback_queued = True
                if timeline._on:
                    self._backward_t0 = time.monotonic()
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._engine.mark_ready(self._bucket_of[i])

        return hook

    def _finish_backward(self) -> None:
        compute_end = time.monotonic()
        self._callback_queued = False
        unmarked = [i for i, m in enumerate(self._marked) if not m]
        self._marked = [False] * len(self._params)
        if unmarked:
            if not self.find_unused_parameters:
                names = ", ".join(self._names[i] for i in unmarked[:10])
                # Finish the iteration (as all ranks do) so the engine is ready for the next one.
                self._engine.launch_all()
                self._engine.finish(self._finish_guard)
                raise RuntimeError(
                    f"rumor.DistributedDataParallel: parameters [{names}] received no gradient in this "
                    "backward pass; if the model has parameters that are not used every iteration, "
                    "wrap it with find_unused_parameters=True")
            with torch.no_grad():
                for i in unmarked:
                    p = self._params[i]
                    if not self._carries[self._bucket_of[i]]:
                        continue
                    if p.grad is None or p.grad.data_ptr() != self._views[i].data_ptr():
                        # Contributes zeros; after the allreduce it holds the others' average.
                        self._views[i].zero_()
                        p.grad = self._views[i]
            self._engine.launch_all()
        self._engine.finish(self._finish_guard)
        end = time.monotonic()
        # An empty after_backward span until the hook has run: if it raises, the timeline stays whole.
        self._timeline = (self._forward_times, compute_end, end, self._engine.last_timings(), (end, end))
        if timeline._on and self._backward_t0 is not None:
            # Autograd runs the first gradient hook once the first parameter's gradient exists;
            # the span starts there (the loss and the last layers' backward come just before).
            timeline._span_s("wait for buckets", "wait", compute_end, end)
            timeline._span_s("backward", "phase", self._backward_t0, end,
                             f'"buckets":{len(self.buckets)}')
            self._backward_t0 = None
        if not self._rebuilt:
            if self.algorithm.rebuild_buckets(self):
                self._rebuild_in_ready_order()
            else:
                self._rebuilt = True
                self._ready_order, self._ready_times = [], {}
        t0 = time.monotonic()
        self.algorithm.after_backward(self)
        t1 = time.monotonic()
        # A decentralized algorithm waits there for its weight mix: communication too, which
        # backward's own span does not show.
        self._timeline = self._timeline[:4] + ((t0, t1),)
        if timeline._on and type(self.algorithm).after_backward is not Algorithm.after_backward:
            timeline._span_s(f"{type(self.algorithm).__name__}.after_backward", "wait", t0, t1)

    def _rebuild_in_ready_order(self) -> None:
        """After the first iteration, buckets follow the order in which gradients really became
        ready, as seen by the group's first rank (every rank must use the same buckets)."""
        self._rebuilt = True
        order = list(dict.fromkeys(self._ready_order))
        seen = set(order)
        order += [i for i in range(len(self._params)) if i not in seen]
        # A bucket should not wait for a gradient that arrives much later than the ones before
        # it: start a new bucket there, so communication begins while backward computes it. But
        # buckets run one after another, and each one pays the group's round trips whatever its
        # size, so a split must gain more than that: over 100 ms links a small transformer's
        # backward was cut into 22 buckets, and trained at half the speed of torch DDP's two.
        # In whole microseconds, as broadcast below, so every test of it agrees on every rank.
        latency = round(self._one_more_bucket_s() * 1e6) / 1e6
        split, by_link = self._bucket_rule(latency)  # the figures are measured below
        times = [self._ready_times.get(i) for i in order]
        gaps = [0] + [int(a is not None and b is not None and b - a > split)
                      for a, b in zip(times, times[1:])]
        merge_first = int(latency > self._split_gap_s and not by_link
                          and not self._first_bucket_pays(order, times, latency))
        n = len(order)
        t0 = min((x for x in times if x is not None), default=0.0)
        ready_us = [-1 if x is None else round((x - t0) * 1e6) for x in times]
        t = torch.tensor(order + gaps + ready_us + [merge_first, round(latency * 1e6), self._link_rate(latency)],
                         dtype=torch.int64)
        broadcast_(t, self.group.ranks[0], self.group)
        if self._autotuner is not None:
            self._autotuner.observe_ready_times(order, times, t[:n].tolist())
        flat = t.tolist()
        order, gaps, ready_us = flat[:n], flat[n:2 * n], flat[2 * n:3 * n]
        merge_first, latency_us, rate = flat[3 * n:]
        self._bucket_latency_s = latency_us / 1e6  # the first rank's estimate, on every rank
        # Every rank merges from the first rank's figures, so all build the same buckets.
        # Kept for the autotuner, whose bucket_split_gap_ms decides again whether the link picks.
        self._link_figures = ([None if u < 0 else u / 1e6 for u in ready_us],
                              float(rate) if rate > 0 else float("inf"), latency_us / 1e6)
        link = self._link_figures if self._bucket_rule(latency_us / 1e6)[1] else None
        if merge_first:
            self._first_cap_bytes = max(self._first_cap_bytes, self._cap_bytes)
        if latency > self._split_gap_s and self.group._comm.rank == 0:
            logging.getLogger("rumor").info(
                "rumor.DistributedDataParallel: one allreduce over this group's links costs about %.0f ms "
                "of round trips, so buckets split only at gaps longer than that%s", latency * 1e3,
                "; the first bucket is not sent on its own (backward ends sooner than it would return)"
                if merge_first else "")
        self._ready_order, self._ready_times = [], {}
        breaks = {j for j, g in enumerate(gaps) if g}
        if order != list(reversed(range(len(self._params)))) or breaks or merge_first or link:
            self._build_buckets(order, breaks, link)

    def _bucket_rule(self, latency: float, figures: bool = True) -> Tuple[float, bool]:
        """(pause, by_link): after the first iteration a bucket closes at every pause in backward
        longer than `pause`. Where the link's serial schedule picks the buckets (by_link: one more
        bucket costs `latency`, more than the split gap, the algorithm lets buckets be re-cut, and
        the first iteration's link figures are known), that is the split gap and merge_for_link
        merges what does not pay for its round trips; elsewhere a split must gain more than a
        bucket's round trips. The one rule of the first rebuild and the autotuner's trials."""
        by_link = figures and latency > self._split_gap_s and bool(self.algorithm.tunable_buckets)
        return (self._split_gap_s if by_link else max(self._split_gap_s, latency)), by_link

    def _link_rate(self, latency: float) -> int:
        """Bytes per second a bucket moved at in the first iteration, past its round trips: the
        fastest of the buckets whose bytes took longer than those round trips (0: none did, so
        bytes cost next to nothing beside them). Only what the first rank measured is used."""
        best = 0.0
        for b, count, _launched, started, ended in self._engine.last_timings():
            busy = ended - started - latency
            if b < len(self.buckets) and busy > latency:
                best = max(best, count * self.buckets[b].flat.element_size() / busy)
        return round(best)

    def _one_more_bucket_s(self) -> float:
        """What one more bucket costs whatever its size, estimated from the links (a collective:
        every rank of the group calls it): a pipelined ring's first piece crosses 2(H-1) links
        between H hosts at half a round trip each, so (H-1) times the slowest round trip any
        rank's kernel sampled on the links the first iteration used (0 within one host, where
        shared memory has none). Only links already open are read, so that a large job opens
        no all-pairs mesh for it."""
        st = _runtime.state()
        hosts = len({st.hosts[r] for r in self.group.ranks})
        if hosts < 2:
            return 0.0
        slowest = torch.tensor([max(self.group._comm.link_rtts(), default=0.0)], dtype=torch.float64)
        allreduce_(slowest, op=ReduceOp.MAX, group=self.group)
        return float(slowest) * (hosts - 1)

    def _first_bucket_pays(self, order: List[int], times: List[Optional[float]], latency: float) -> bool:
        """Whether sending the first (small) bucket on its own gains more than its round trips
        cost: with buckets run one after another, it does when the rest of backward, from the
        moment that bucket is complete, lasts longer than one bucket's latency."""
        if any(x is None for x in times):
            return True
        used, last = 0, None
        for j, i in enumerate(order):
            p = self._params[i]
            used += p.numel() * p.element_size()
            if used > self._first_cap_bytes and j > 0:
                break
            last = j
        if last is None or last == len(order) - 1:
            return True  # one bucket either way
        return max(times) - max(times[:last + 1]) > latency

    # ---- user-facing ------------------------------------------------------------------------

    @property
    def _timeout(self) -> float:
        # Read at each wait: rumor.set_timeout (a notebook cell's deadline) applies to wrappers
        # built before it.
        return _runtime.state().timeout

    @property
    def _finish_guard(self) -> float:
        # The end of backward waits only for launched buckets, each of which ends by its own
        # deadline; with progress deadlines (issue 46) a bucket may outlast RUMOR_TIMEOUT while its
        # bytes move, so this is a guard against a lost wakeup, as for blocking calls (64 x).
        return _runtime.state().timeout * 64

    def forward(self, *args, **kwargs):
        """Runs the wrapped module's forward, with the algorithm's before_forward hook and (in
        training mode, with broadcast_buffers) rank 0's buffers broadcast first.

        Args and keyword arguments are passed to module.forward unchanged.

        Returns:
            What module.forward returns.
        """
        return self._run_forward(self.training, self.module, args, kwargs)

    def _run_forward(self, training: bool, call, args, kwargs):
        """What a forward through the wrapper does around ``call`` (the module's forward):
        the autotuner's tick, the buffer broadcast, the algorithm's before_forward and the
        forward's timings. rumor.compat.bagua's with_bagua runs it around the module's own
        forward, with the module's training flag."""
        if self._hooks_removed:
            raise RuntimeError("rumor.DistributedDataParallel: forward through a wrapper after its "
                               "remove_hooks(): it no longer averages gradients, so a step through it would "
                               "silently train this rank alone; call the module itself (.module), or wrap "
                               "it again")
        training = training and torch.is_grad_enabled()
        if self._autotuner is not None and training:
            self._autotuner.before_forward()
        start = time.monotonic()
        if self.broadcast_buffers and training and self._buffers_to_sync:
            coalesced_broadcast(self._buffers_to_sync, self.group)
        self.algorithm.before_forward(self)
        if self._input_device is not None:
            args, kwargs = _to_device(args, self._input_device), _to_device(kwargs, self._input_device)
        module_start = time.monotonic()
        out = call(*args, **kwargs)
        self._forward_times = (start, module_start, time.monotonic())
        if timeline._on:
            timeline._span_s("forward", "phase", start, self._forward_times[2])
        return out

    def _trace_step_begin(self, *_):
        self._step_t0 = time.monotonic() if timeline._on else None

    def _trace_step_end(self, *_):
        if self._step_t0 is not None and timeline._on:
            timeline._span_s("optimizer step", "phase", self._step_t0, time.monotonic())
        self._step_t0 = None

    def last_iteration_timeline(self) -> Optional[Dict]:
        """Where this rank's last synchronized iteration spent its time, for profiling; None
        before the first one. Seconds from the start of its forward (or, without one, from the
        end of backward's computation):

        - module_start (after the buffer broadcast and the algorithm's before_forward, e.g. a
          decentralized algorithm's weight mixing); forward_end; backward_compute_end (autograd
          done); backward_end (every bucket's communication done, when backward() returns);
        - buckets: one dict per bucket in launch order: bucket, elements, ready (handed to the
          comm thread: its last gradient arrived and every bucket before it had been handed
          over, since buckets go in order on every rank), start and end of its op there;
        - exposed_comm = backward_end - backward_compute_end (communication not hidden behind
          backward), comm_busy = the sum of the buckets' end - start;
        - after_backward_end (when the algorithm's after_backward hook returned and backward()
          with it) and after_backward, the seconds that hook took: a decentralized algorithm
          waits there for its weight mix, communication that exposed_comm does not count.
        """
        if self._timeline is None:
            return None
        (f_start, m_start, f_end), compute_end, end, timings, (hook_start, hook_end) = self._timeline
        if f_start is None or f_start > compute_end:
            f_start, m_start, f_end = compute_end, None, None
        buckets = [dict(bucket=b, elements=n, ready=ready - f_start, start=t0 - f_start, end=t1 - f_start)
                   for b, n, ready, t0, t1 in timings]
        return dict(module_start=None if m_start is None else m_start - f_start,
                    forward_end=None if f_end is None else f_end - f_start,
                    backward_compute_end=compute_end - f_start, backward_end=end - f_start, buckets=buckets,
                    exposed_comm=end - compute_end, comm_busy=sum(b["end"] - b["start"] for b in buckets),
                    after_backward_end=hook_end - f_start, after_backward=hook_end - hook_start)

    def remove_hooks(self) -> None:
        """Gives the module and the optimizer back as they would be without the wrapper.

        Removes every hook the wrapper put on the module's parameters (gradient readiness and the
        sparse-gradient check) and on the optimizer (the algorithm's after_step, the timeline's
        step spans); gradients that were views of the wrapper's buckets become tensors of their
        own; a fused optimizer (rumor.optim.fuse_optimizer) is laid out over its own flat buffers
        again and, with overlap_optimizer, steps every parameter in optimizer.step() again. The
        parameter values, gradients and optimizer state are kept. Afterwards ``.module`` trains
        as a plain module (a backward communicates nothing) and can be wrapped again; a forward
        through this wrapper raises. An optimizer the wrapper fused itself (overlap_optimizer
        with a plain one) stays fused, which computes the same steps.

        Call it between iterations. An algorithm with a background thread (AsyncModelAverage)
        must have finished first (``ddp.algorithm.finish()``): its thread is the algorithm's,
        not a hook. Calling it again does nothing. Nothing here communicates, so ranks may call
        it at different times. The buckets' memory is freed when the wrapper is dropped.

        Raises:
            RuntimeError: called during a backward (from a hook or an autograd callback).
        """
        if self._hooks_removed:
            return
        # Inside autograd (a hook, a queued callback) the backward's buckets are still being
        # averaged. Outside it, a backward that raised half way may have left its flags set: the
        # wrapper is done with, so they do not matter (Lightning's teardown after an error).
        if getattr(torch._C, "_current_graph_task_id", lambda: -1)() != -1:
            raise RuntimeError("rumor.DistributedDataParallel.remove_hooks: called during a backward (its "
                               "buckets are being averaged); call it between iterations")
        handles = list(self._hook_handles)
        if self.optimizer is not None:
            handles.append(self._step_hook)
            handles.extend(self._step_trace_hooks)
        for h in handles:
            h.remove()
        self._hook_handles = []
        self._hooks_removed = True
        fusion = self._fusion
        if fusion is not None:
            if fusion.overlap is self:
                fusion.overlap = None
                flag = getattr(self, "_amp_flag_before", _NO_FLAG)
                if flag is _NO_FLAG:
                    self.optimizer.__dict__.pop("_step_supports_amp_scaling", None)
                else:
                    self.optimizer._step_supports_amp_scaling = flag
            # Segments over bucket slices (shared memory, possibly) become private buffers.
            fusion.layout(fusion.default_plan())
        with torch.no_grad():
            for p, view in zip(self._params, self._views):
                if p.grad is not None and view is not None and p.grad.data_ptr() == view.data_ptr():
                    p.grad = p.grad.clone()

    def _live_rebind(self) -> None:
        """Live membership (rumor.elastic, docs/elastic.md): the job re-formed with other
        members, so the wrapper is built again over the new world from the arguments it was made
        with, keeping the module, the optimizer and the algorithm object. Its collectives (the
        model check, the parameter broadcast) meet a newcomer's construction of its wrapper."""
        a = self._ctor_args
        if a["group"] is not None or a["process_group"] is not None:
            raise ValueError("rumor.DistributedDataParallel: live membership re-forms the world; a wrapper "
                             "over a group of its own cannot follow it (leave group= unset)")
        self.remove_hooks()
        self._rebinding = True
        try:
            DistributedDataParallel.__init__(self, **a)
        finally:
            self._rebinding = False

    def _cut_by_membership(self, what: str, collective):
        """Runs a part of the construction that communicates and returns its result. In a live
        job's first epoch (rumor-run --live) a member may die meanwhile: the failure is recorded
        instead of raised, the construction's later collectives are skipped (None: buckets of
        private memory, no algorithm set-up, no autotuner), and rumor.elastic.run re-forms the
        job before training, builds the wrapper again and sends one member's whole state to the
        others (weights the broadcast did not finish sending included). Anywhere else, and for
        the script's own errors (models that differ), it raises."""
        if self._construction_cut is not None:
            return None
        _rendezvous.fault_point(f"ddp:{what}")  # tests: a member dies while the wrappers are built
        try:
            return collective()
        except RumorError as e:
            if (isinstance(e, ValueError) or not self._constructing or self._state_follows()
                    or not _runtime.state().live):
                raise
            self._construction_cut = f"{type(e).__name__}: {e}"
            return None

    def _state_follows(self) -> bool:
        """Live membership: a wrapper built again after a change, or a newcomer's, is followed
        by the state transfer (rumor.elastic's _live_sync), which sends the source's whole state
        to every member that is behind and then proves every replica equal. A broadcast of rank
        0's parameters here would move the model once more across the links, with every survivor
        waiting for it."""
        return getattr(self, "_rebinding", False) or _runtime.state().awaiting_state

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients of backward passes inside accumulate locally; the first backward outside
        communicates the accumulated sum."""
        old = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = old

    # state_dict() is nn.Module's: the keys are the module's with a "module." prefix, as torch
    # DistributedDataParallel's, so that checkpoints move between the two wrappers.

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads torch DDP's keys ("module." + the module's) into the wrapped module.

        Unlike torch, a state dict with the module's own keys (model.module.state_dict(), or a
        checkpoint of an older rumor wrapper, which had no prefix) loads too: it is recognised by
        its keys matching the module's without the prefix and none matching with it.

        Args:
            state_dict: the state to load, with or without the "module." prefix.
            strict: if True (the default), the keys must match exactly.
            assign: if True (default False), assign the loaded tensors instead of copying into the
                module's own (torch's assign semantics; the wrapper's hooks stay on the old
                parameters, see docs/torch_ddp.md).

        Returns:
            torch's NamedTuple of missing_keys and unexpected_keys.

        Raises:
            RuntimeError: strict is True and keys are missing or unexpected.
        """
        return super().load_state_dict(self._prefixed(state_dict), strict=strict, assign=assign)

    def _prefixed(self, state_dict):
        if not isinstance(state_dict, Mapping):
            return state_dict  # nn.Module's own TypeError says what it takes
        wanted = set(self.module.state_dict(keep_vars=True))
        keys = set(state_dict)
        if any("module." + k in keys for k in wanted) or not any(k in wanted for k in keys):
            return state_dict
        out = collections.OrderedDict(("module." + k, v) for k, v in state_dict.items())
        meta = getattr(state_dict, "_metadata", None)
        if meta is not None:
            out._metadata = collections.OrderedDict(
                ("module" if k == "" else "module." + k, v) for k, v in meta.items())
        return out

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        # As in torch DDP, the module's attributes are not forwarded: a name that exists on both
        # (train, forward, state_dict, ...) would otherwise mean one thing or the other by accident.
        base = f"'DistributedDataParallel' object has no attribute {name!r}"
        if name in _TORCH_DDP_ONLY:
            raise AttributeError(f"{base}: torch DDP's {name} has no counterpart in rumor's wrapper; "
                                 f"{_TORCH_DDP_ONLY[name]} (docs/torch_ddp.md)")
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None and not name.startswith("__") and hasattr(module, name):
            raise AttributeError(f"{base}; the wrapped module has it: use .module.{name} (like torch's "
                                 "DistributedDataParallel, the wrapper does not forward attributes)")
        raise AttributeError(base)


# remove_hooks(): the optimizer had no _step_supports_amp_scaling of its own.
_NO_FLAG = object()

# torch DDP's public methods this wrapper lacks, and what to do instead.
_TORCH_DDP_ONLY = {
    "join": "give every rank the same number of batches (torch's DistributedSampler, or "
            "rumor.data.LoadBalancingDistributedSampler)",
    "join_hook": "give every rank the same number of batches",
    "register_comm_hook": "write a rumor.algorithms.Algorithm (PowerSGD, low-precision and local-SGD "
                          "algorithms exist) and pass it as algorithm=",
    "will_sync_module_buffers": "buffers are broadcast from the group's first rank before each training "
                                "forward when broadcast_buffers=True",
}


def _group_from(group, process_group):
    """group= is rumor's; process_group= (torch's name) takes a rumor.Group too, but not a torch
    ProcessGroup: rumor runs its own communicator, which cannot borrow torch's."""
    if process_group is None:
        return group
    if not isinstance(process_group, Group):
        raise TypeError("rumor.DistributedDataParallel: process_group must be a rumor.Group, got "
                        f"{type(process_group).__module__}.{type(process_group).__name__}; rumor runs its "
                        "own communicator and cannot use a torch.distributed process group. For the whole "
                        "job pass nothing; for a subset pass group=rumor.new_group(ranks) with the same "
                        "ranks (torch.distributed.get_process_group_ranks(pg))")
    if group is not None and group is not process_group:
        raise ValueError("rumor.DistributedDataParallel: group= and process_group= name different groups; "
                         "pass one of them")
    return process_group


def _device_of(d, what: str) -> torch.device:
    if isinstance(d, bool) or not isinstance(d, (int, str, torch.device)):
        raise TypeError(f"rumor.DistributedDataParallel: {what} must be a CUDA device index, a "
                        f"torch.device or a device string, got {type(d).__name__}")
    dev = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _input_device(device_ids, output_device, module) -> Optional[torch.device]:
    """torch's meaning of device_ids: None for a CPU module, [d] for a module on CUDA device d,
    whose forward then gets its inputs moved to d. output_device, if given, must be that device:
    the output stays where the module puts it, as in torch with one device per process."""
    what = "rumor.DistributedDataParallel"
    devices = {t.device for t in itertools.chain(module.parameters(), module.buffers())}
    if device_ids is None or (isinstance(device_ids, (list, tuple)) and len(device_ids) == 0):
        if output_device is not None:
            raise ValueError(f"{what}: output_device={output_device!r} needs device_ids=[d] (a module on one CUDA "
                             "device); the output stays where the module puts it: move it with .to()")
        return None
    if not isinstance(device_ids, (list, tuple)):
        raise TypeError(f"{what}: device_ids must be a list of one device, e.g. [rumor.local_rank()], got "
                        f"{type(device_ids).__name__}")
    if len(device_ids) > 1:
        raise ValueError(f"{what}: device_ids={list(device_ids)!r}: one process drives one device; start one "
                         "process per GPU (python -m rumor.run --nproc-per-node N) and pass device_ids=[d]")
    dev = _device_of(device_ids[0], "device_ids[0]")
    if dev.type != "cuda":
        raise ValueError(f"{what}: device_ids={list(device_ids)!r}: device_ids is for a module on one CUDA "
                         "device; for a CPU module pass device_ids=None")
    if devices != {dev}:
        found = ", ".join(sorted(str(d) for d in devices)) or "no parameters"
        raise ValueError(f"{what}: device_ids=[{dev.index}] says the module is on {dev}, but its parameters "
                         f"and buffers are on {found}: move it first (module.to({str(dev)!r})), or pass "
                         "device_ids=None for a module on the CPU")
    if output_device is not None and _device_of(output_device, "output_device") != dev:
        raise ValueError(f"{what}: output_device={output_device!r} differs from the module's device {dev}: "
                         "rumor leaves the output where the module puts it; move it with .to()")
    return dev


def _to_device(obj, device: torch.device):
    """Tensors inside (nested tuples, lists, dicts) moved to device, as torch DDP does for its
    inputs when given device_ids."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_to_device(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    return obj
