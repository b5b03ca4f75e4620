"""Optimizers on one-sided windows (BlueFog's DistributedWinPut / PushSum / PullGet).

Each wraps a torch optimizer (the result is an instance of a subclass of the optimizer's own
class) and keeps the model's trainable parameters as views into one flat buffer per dtype, with
one window per buffer. No rank waits for another: every exchange is one-sided, and a slow
neighbour only means older values in this rank's slots.

DistributedWinPutOptimizer   the model's forward pre-hook starts win_put of the parameters to the
                             out-neighbours; step() waits for it, combines with win_update
                             (topology weights, or ``self_weight`` / ``neighbor_weights``) and
                             applies the optimizer.
DistributedPullGetOptimizer  the forward pre-hook starts win_get from the in-neighbours (their
                             published parameters); step() waits, combines, applies the
                             optimizer and publishes the new parameters.
DistributedPushSumOptimizer  push-sum (gradient push): each rank holds z and a weight p and the
                             model sees x = z / p. step() first collects what neighbours pushed
                             (z += slots, p += their p, slots reset, atomically per slot), applies
                             the optimizer to x, sets z = x * p, then pushes w_j * (z, p) to each
                             out-neighbour with win_accumulate and keeps self_weight * (z, p).
                             The weights form a column-stochastic matrix (default 1/(outdeg+1)),
                             so the sums over ranks and slots of z and of p never change: with no
                             gradient, x converges to the average of the initial parameters on a
                             strongly connected directed graph, whatever the step counts per rank.
                             BlueFog's version scaled a stale tensor and never moved p.
                             ``synchronize()`` collects what is still in the slots.

``num_steps_per_communication = J`` counts training passes (forward passes through ``model`` in
training mode with autograd on), not step() calls, as the combine wrappers in
rumor.optim.combine do: in the pattern "J forward/backward passes, then one step()" every
step() communicates; with a step() after every pass, every J-th step communicates and the others
are local updates. A step() with no forward through the model since the previous one counts as
one pass. The first pass of each group of J communicates (BlueFog's compat layer shifts this to
the last one, as BlueFog does). Push-sum carries the local updates of the steps in between into
its next push (z = x * p before collecting).

``force_barrier = True`` (attribute, BlueFog's name) makes step() wait for this rank's exchange in
flight and then for every rank (a barrier) before it combines: every put, get or push of the
round has landed, so the ranks advance in lockstep (slower, and reproducible). Off by default.

Windows are created collectively when the optimizer is built (every rank must build it, in the
same order); ``free_windows()`` releases them (collective).
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional

import torch

from .. import _runtime
from .. import collectives
from ..neighbor import window as _win
from ..engine.flat import FlatWeights
from ._wrap import ONE_BUFFER_PER_DTYPE, build_subclass, check_args

_serial = itertools.count()


class _WindowOptimizer:
    _kind = "window"
    _base: type = torch.optim.Optimizer

    def __init__(self, *args, **kwargs):
        pass  # built by _wrap

    def _setup(self, model: torch.nn.Module, num_steps_per_communication: int) -> None:
        self._model = model
        self.num_steps_per_communication = num_steps_per_communication
        # Weights of the next communication; None means the static topology's.
        self.self_weight: Optional[float] = None
        self.neighbor_weights: Optional[Dict[int, float]] = None
        self.dst_weights: Optional[Dict[int, float]] = None
        self.src_weights: Optional[Dict[int, float]] = None
        self._passes = 0  # training passes (forwards through the model, or bare step() calls) so far
        self._passes_at_step = 0  # self._passes when the previous step() ran
        self._pass_offset = 0  # 0: the first pass of each group of J communicates; 1: the last
        self._due = False  # a pass since the last step() was one that communicates
        self._handles: List = []
        self._in_step = False
        self.force_barrier = False
        in_opt = {id(p) for g in self.param_groups for p in g["params"]}
        params = [p for p in model.parameters() if p.requires_grad and id(p) in in_opt]
        if not params:
            raise ValueError(f"{type(self).__name__}: the optimizer holds none of the model's trainable parameters")
        self._flat = FlatWeights(params, ONE_BUFFER_PER_DTYPE, f"rumor.optim.{type(self).__name__}")
        serial = next(_serial)
        self._names = [f"rumor.optim.{self._kind}.{serial}.{k}" for k in range(len(self._flat.flats))]
        self._create_windows()
        self._hook = model.register_forward_pre_hook(self._forward_pre_hook)

    def _create_windows(self) -> None:
        for name, flat in zip(self._names, self._flat.flats):
            _win.win_create(flat, name)

    def _count_pass(self) -> bool:
        """Counts one training pass; True when it is the one that communicates."""
        p = self._passes
        self._passes += 1
        due = _runtime.size() > 1 and (p + self._pass_offset) % self.num_steps_per_communication == 0
        self._due = self._due or due
        return due

    def _take_due(self) -> bool:
        """Whether this step() communicates (a due pass since the last step, the step itself
        counting as the pass when no forward ran); clears the flag."""
        if self._passes == self._passes_at_step:
            self._count_pass()
        due, self._due = self._due, False
        self._passes_at_step = self._passes
        return due

    def _forward_pre_hook(self, module, args):
        if self._in_step or not (torch.is_grad_enabled() and module.training):
            return  # a closure's forward inside step(), or an evaluation pass
        if self._count_pass() and not self._handles:
            self._on_due_pass()

    def _on_due_pass(self) -> None:
        self._flat.ensure_views()
        self._handles = self._start()

    def _start(self) -> List:
        return []

    def _wait(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.wait()

    def wait(self) -> None:
        """Waits until this rank's communication in flight has landed at its destinations (a
        barrier after it on every rank: every rank's has). Training's end: wait(), barrier, then
        synchronize() (push-sum) or free_windows()."""
        self._wait()

    def _lockstep(self) -> None:
        """force_barrier: this rank's exchange has landed, then every rank's has."""
        if self.force_barrier and _runtime.size() > 1:
            for h in self._handles:
                h.wait()  # handles stay: step() still owns them (a second wait is a no-op)
            collectives.barrier()

    def _combine(self) -> None:
        kw = {}
        if self.self_weight is not None or self.neighbor_weights is not None:
            kw = dict(self_weight=self.self_weight, neighbor_weights=self.neighbor_weights)
        with torch.no_grad():
            for name in self._names:
                _win.win_update(name, **kw)

    def _base_step(self, closure):
        base_step = self._base.step
        base_step = base_step.__wrapped__ if getattr(base_step, "hooked", False) else base_step
        self._in_step = True
        try:
            return base_step(self, closure)
        finally:
            self._in_step = False

    def step(self, closure=None):
        """One training step. On a pass that communicates: waits for this rank's exchange
        started in forward (or starts it here, when no forward ran since the last step), then
        combines the window's slots into the parameters with win_update. Then applies the wrapped
        optimizer's update (DistributedPullGetOptimizer then publishes the new parameters). With
        force_barrier, every rank's exchange lands first (a barrier).

        Args:
            closure: passed to the wrapped optimizer's step(); default None. Its forward does
                not count as a training pass.

        Returns:
            What the wrapped optimizer's step() returns (the closure's loss, or None).
        """
        self._lockstep()
        if self._take_due():
            if not self._handles:  # no forward through the model since the last step
                self._flat.ensure_views()
                self._handles = self._start()
            self._wait()
            self._combine()
        loss = self._base_step(closure)
        self._after_step()
        return loss

    def _after_step(self) -> None:
        pass

    def remove_hooks(self) -> None:
        """Detaches the forward pre-hook from the model: forwards no longer count as training
        passes nor start exchanges (step() still does both). The windows stay; free_windows()
        releases them."""
        self._hook.remove()

    def free_windows(self) -> None:
        """Waits for the exchange in flight and frees this optimizer's windows (collective)."""
        self._wait()
        for name in self._names:
            _win.win_free(name)
        self._names = []


class DistributedWinPutOptimizer(_WindowOptimizer):
    """``rumor.optim.DistributedWinPutOptimizer(optimizer, model, num_steps_per_communication=1)``:
    puts the parameters to the out-neighbours during forward and combines them with win_update
    before the optimizer's step (see the module doc). ``dst_weights`` ({rank: weight}) sets the
    next put's destinations, ``self_weight`` / ``neighbor_weights`` the next combine."""

    _kind = "winput"

    def __new__(cls, optimizer=None, model=None, num_steps_per_communication=1):
        if cls is not DistributedWinPutOptimizer:
            return super().__new__(cls)
        return _wrap(DistributedWinPutOptimizer, optimizer, model, num_steps_per_communication)

    def _start(self):
        return [_win.win_put_nonblocking(flat, name, dst_weights=self.dst_weights)
                for name, flat in zip(self._names, self._flat.flats)]


class DistributedPullGetOptimizer(_WindowOptimizer):
    """``rumor.optim.DistributedPullGetOptimizer(optimizer, model, num_steps_per_communication=1)``:
    gets the in-neighbours' published parameters during forward, combines before the step and
    publishes the updated parameters after it. ``src_weights`` sets the next get's sources."""

    _kind = "pullget"

    def __new__(cls, optimizer=None, model=None, num_steps_per_communication=1):
        if cls is not DistributedPullGetOptimizer:
            return super().__new__(cls)
        return _wrap(DistributedPullGetOptimizer, optimizer, model, num_steps_per_communication)

    def _start(self):
        return [_win.win_get_nonblocking(name, src_weights=self.src_weights) for name in self._names]

    def _after_step(self) -> None:
        for name in self._names:
            _win.win_publish(name)


class DistributedPushSumOptimizer(_WindowOptimizer):
    """``rumor.optim.DistributedPushSumOptimizer(optimizer, model, num_steps_per_communication=1)``:
    push-sum with win_accumulate and a weight p carried with every push (see the module doc).
    ``self_weight`` and ``dst_weights`` set the next push (they must sum to 1 for the sums to be
    preserved; the default 1/(out_degree + 1) does)."""

    _kind = "pushsum"

    def __new__(cls, optimizer=None, model=None, num_steps_per_communication=1):
        if cls is not DistributedPushSumOptimizer:
            return super().__new__(cls)
        return _wrap(DistributedPushSumOptimizer, optimizer, model, num_steps_per_communication)

    def _create_windows(self) -> None:
        # The window holds z (zero-initialised slots: nothing has been pushed yet); the
        # parameters hold x = z / p.
        self._z = [flat.detach().clone() for flat in self._flat.flats]
        self._local_steps = False  # x moved by steps that did not push since z was last set
        for name, z in zip(self._names, self._z):
            _win.win_create(z, name, zero_init=True)

    def associated_p(self) -> float:
        """This rank's push-sum weight p (the model's parameters are z / p).

        Returns:
            A float; 1.0 at creation, and after free_windows().
        """
        return _win.win_associated_p(self._names[0]) if self._names else 1.0

    def _push_weights(self):
        out = _win.out_neighbor_ranks()
        if self.dst_weights is None:
            u = 1.0 / (len(out) + 1)
            return (u if self.self_weight is None else float(self.self_weight)), {r: u for r in out}
        dst = dict(self.dst_weights)
        sw = self.self_weight if self.self_weight is not None else 1.0 - sum(dst.values())
        return float(sw), dst

    def _collect(self) -> None:
        """z += what neighbours pushed (slots reset), p likewise; then x = z / p. Local steps
        since the last push moved x and not z: z = x * p first, so they are kept."""
        hub = _win.registry().hub
        with torch.no_grad():
            for name, z, flat in zip(self._names, self._z, self._flat.flats):
                w = _win.find_window(name, "DistributedPushSumOptimizer")
                if self._local_steps:
                    torch.mul(flat, hub.p(w.id), out=z)
                versions = hub.versions(w.id)
                srcs = {r: 1.0 for r, v in enumerate(versions) if v > 0}
                _win.update_registered(w, 1.0, srcs, True, True, "DistributedPushSumOptimizer")
                torch.div(z, hub.p(w.id), out=flat)
        self._local_steps = False

    def step(self, closure=None):
        """One push-sum step: waits for this rank's previous pushes; on a pass that communicates,
        collects what the neighbours pushed (x = z / p), applies the wrapped optimizer's update
        to x, sets z = x p and pushes shares of (z, p) to the out-neighbours (the pushes run
        until the next step). Steps that do not communicate only apply the update. With
        force_barrier, every rank's pushes land first (a barrier).

        Args:
            closure: passed to the wrapped optimizer's step(); default None.

        Returns:
            What the wrapped optimizer's step() returns (the closure's loss, or None).
        """
        self._wait()
        self._lockstep()
        due = self._take_due()
        if due:
            self._collect()
        loss = self._base_step(closure)
        if not due:
            self._local_steps = True
        else:
            self._flat.ensure_views()
            sw, dst = self._push_weights()
            hub = _win.registry().hub
            with torch.no_grad():
                for name, z, flat in zip(self._names, self._z, self._flat.flats):
                    w = _win.find_window(name, "DistributedPushSumOptimizer")
                    torch.mul(flat, hub.p(w.id), out=z)
                    op, src = _win.put_registered(w, dst, True, True, "DistributedPushSumOptimizer")
                    h = _win.WinHandle(w, op, z, sw, True, False)
                    h._keep = src
                    w.handles.append(h)
                    self._handles.append(h)
        return loss

    def _on_due_pass(self) -> None:
        pass  # pushes start at the end of step() and overlap the next forward and backward

    def synchronize(self) -> None:
        """Waits for this rank's pushes and collects what has arrived (call after a barrier at
        the end of training to account for every push)."""
        self._wait()
        self._collect()


def _wrap(kind: type, optimizer, model, num_steps_per_communication):
    name = kind.__name__
    k = check_args(f"rumor.optim.{name}", optimizer, model, num_steps_per_communication,
                   "num_steps_per_communication")
    opt = build_subclass(kind, optimizer)
    opt._setup(model, k)
    return opt
