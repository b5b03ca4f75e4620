"""BlueFog-style decentralized optimizer wrappers: Adapt-With-Combine and Adapt-Then-Combine.

Both wrap a torch optimizer (the result is an instance of a subclass of the optimizer's own
class, sharing its parameter groups) and mix each rank's parameters with its neighbours':

    AdaptWithCombine:  x_{k+1} = combine(x_k) - (optimizer update from g(x_k))
    AdaptThenCombine:  x_{k+1} = combine(x_k - (optimizer update from g(x_k)))

combine() is chosen by ``communication``:
    "neighbor_allreduce"               self_weight * x + sum_j w_j x_j over in-neighbours: the
                                       topology of rumor.set_topology(), or the weights set on
                                       the optimizer for this step (dynamic topologies)
    "hierarchical_neighbor_allreduce"  average inside each machine, then the same over machines
                                       (rumor.set_machine_topology(); weights keyed by machine)
    "allreduce"                        the average over all ranks
    "empty"                            no communication (each rank trains alone)

The weights used by the next communication are the attributes ``self_weight``,
``src_weights`` ({rank: weight}) and ``dst_weights`` ([rank] or {rank: weight}); all None means
the static topology. They may be changed before every step.

num_steps_per_communication = J counts training passes (forward passes through ``model`` with
autograd on, as BlueFog does), not step() calls: in the pattern "J forward/backward passes, then
one step()" every step() combines; with a step() after every pass, every J-th step combines and
the others are local updates. A step() with no forward through the model since the previous
one counts as one pass. The first pass of each group of J communicates (BlueFog's compat layer
shifts this to the last one, as BlueFog does).

Overlap: AdaptWithCombine starts the exchange of x_k in a forward pre-hook of ``model`` (the
parameters are read-only until step()), so it runs while forward and backward compute; step()
waits for it, writes the combined values into the parameters and applies the optimizer.
AdaptThenCombine starts the exchange of the updated parameters at the end of step() and, by
default, waits for it there, so the parameters hold combined values whenever step() has
returned (as in BlueFog). With ``overlap=True`` the result is instead written into the
parameters by the model's next forward pre-hook (or by ``synchronize()``, or the next step()),
so it overlaps whatever the training loop does in between.

``enable_topo_check`` (dynamic weights) is off by default, as in BlueFog: it only adds an
exchange per step; set the attribute to True while debugging a schedule.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .. import collectives
from ..neighbor import ops as _dec
from ..engine.flat import FlatWeights
from ._wrap import ONE_BUFFER_PER_DTYPE, build_subclass, check_args

COMMUNICATIONS = ("neighbor_allreduce", "hierarchical_neighbor_allreduce", "allreduce", "empty")


class _Combine:
    """The methods shared by both wrappers (mixed into a subclass of the wrapped optimizer's
    class, as BlueFog and Horovod do, so isinstance checks and LR schedulers keep working)."""

    _atc = False
    _base: type = torch.optim.Optimizer  # the wrapped optimizer's class (set per subclass)

    def __init__(self, *args, **kwargs):
        # Python calls __init__ on what AdaptWithCombine(...) returned: it was built already.
        pass

    def _setup(self, model: torch.nn.Module, communication: str, num_steps_per_communication: int,
               overlap: bool = False) -> None:
        self._model = model
        self.communication = communication
        self.num_steps_per_communication = num_steps_per_communication
        self.self_weight: Optional[float] = None
        self.src_weights: Optional[Dict[int, float]] = None
        self.dst_weights = None
        # BlueFog's names for the machine weights of "hierarchical_neighbor_allreduce" (when
        # left None, src_weights / dst_weights serve for machines too).
        self.src_machine_weights: Optional[Dict[int, float]] = None
        self.dst_machine_weights = None
        self.enable_topo_check = False
        self._overlap = bool(overlap)
        self._passes = 0  # training passes (forwards through the model, or bare step() calls) so far
        self._passes_at_step = 0  # self._passes when the previous step() ran
        self._pass_offset = 0  # 0: the first pass of each group of J communicates; 1: the last
        self._atc_due = False  # ATC: a pass since the last step() asked for a combine
        self._pending = None  # [(handle, flat buffer)] of the exchange in flight
        self._in_step = False  # a closure's forward inside step() must not start an exchange
        # Parameters in model order, as views into one flat buffer per dtype: one message per
        # dtype and step, sent straight from the parameters' memory.
        named = [p for p in model.parameters() if p.requires_grad]
        in_opt = {id(p) for g in self.param_groups for p in g["params"]}
        params = [p for p in named if id(p) in in_opt]
        if not params:
            raise ValueError(f"{type(self).__name__}: the optimizer holds none of the model's trainable parameters")
        self._flat = FlatWeights(params, ONE_BUFFER_PER_DTYPE, f"rumor.optim.{type(self).__name__}")
        self._hook = model.register_forward_pre_hook(self._forward_pre_hook)

    # ---- communication ------------------------------------------------------------------------

    def _due(self, pass_index: int) -> bool:
        return (self.communication != "empty"
                and (pass_index + self._pass_offset) % self.num_steps_per_communication == 0)

    def _count_pass(self) -> bool:
        """Counts one training pass; True when it is the one that communicates."""
        p = self._passes
        self._passes += 1
        return self._due(p)

    def _launch(self):
        """Starts combining the current parameter values; returns what _finish needs."""
        self._flat.ensure_views()
        return [(self._start(flat), flat) for flat in self._flat.flats]

    def _start(self, flat: torch.Tensor):
        c = self.communication
        if c == "allreduce":
            return collectives.allreduce_nonblocking(flat)
        src, dst = self.src_weights, self.dst_weights
        if c != "neighbor_allreduce" and (self.src_machine_weights is not None or self.dst_machine_weights is not None):
            src, dst = self.src_machine_weights, self.dst_machine_weights
        kw = {}
        if self.self_weight is not None or src is not None or dst is not None:
            kw = dict(self_weight=self.self_weight)
        if c == "neighbor_allreduce":
            if kw:
                kw.update(src_weights=src, dst_weights=dst)
            return _dec.neighbor_allreduce_nonblocking(flat, enable_topo_check=self.enable_topo_check, **kw)
        if kw:
            kw.update(src_machine_weights=src, dst_machine_weights=dst)
        return _dec.hierarchical_neighbor_allreduce_nonblocking(flat, enable_topo_check=self.enable_topo_check, **kw)

    @staticmethod
    def _finish(pending) -> None:
        with torch.no_grad():
            for handle, flat in pending:
                flat.copy_(collectives.synchronize(handle))

    def synchronize(self) -> None:
        """Waits for the exchange in flight and writes its result into the parameters."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._finish(pending)

    # ---- hooks and step -------------------------------------------------------------------------

    def _forward_pre_hook(self, module, args):
        if self._in_step:
            return
        if self._atc:
            self.synchronize()  # this forward must see the combined parameters
        if not (torch.is_grad_enabled() and module.training):
            return  # evaluation passes are not training passes
        due = self._count_pass()
        if self._atc:
            self._atc_due = self._atc_due or due
        elif due and self._pending is None:
            self._pending = self._launch()

    def step(self, closure=None):
        """One training step: waits for the exchange in flight and writes the combined
        parameters (AdaptWithCombine), applies the wrapped optimizer's update, then (for
        AdaptThenCombine, on a pass that communicates) combines the updated parameters, waiting
        for the result unless overlap=True. A step() with no forward through the model since the
        previous one counts as a training pass itself.

        Args:
            closure: passed to the wrapped optimizer's step(); default None. Its forward does
                not count as a training pass.

        Returns:
            What the wrapped optimizer's step() returns (the closure's loss, or None).
        """
        # The wrapped class's own step, without torch's hook wrapper: this step() already runs
        # the optimizer's step hooks once.
        base_step = self._base.step
        base_step = base_step.__wrapped__ if getattr(base_step, "hooked", False) else base_step
        if self._passes == self._passes_at_step:
            # No forward through the model since the last step: the step is the pass.
            due = self._count_pass()
            if self._atc:
                self._atc_due = self._atc_due or due
            elif due and self._pending is None:
                self._pending = self._launch()
        self.synchronize()
        self._in_step = True
        try:
            loss = base_step(self, closure)
        finally:
            self._in_step = False
        if self._atc and self._atc_due:
            self._atc_due = False
            self._pending = self._launch()
            if not self._overlap:
                self.synchronize()
        self._passes_at_step = self._passes
        return loss

    def remove_hooks(self) -> None:
        """Detaches the forward pre-hook from the model (after synchronize())."""
        self._hook.remove()


def _wrap(kind: type, optimizer, model, communication, num_steps_per_communication, overlap=False):
    name = kind.__name__
    k = check_args(f"rumor.optim.{name}", optimizer, model, num_steps_per_communication,
                   "num_steps_per_communication")
    if communication not in COMMUNICATIONS:
        raise ValueError(f"rumor.optim.{name}: unknown communication {communication!r}; expected one of "
                         f"{', '.join(COMMUNICATIONS)}")
    opt = build_subclass(kind, optimizer)
    opt._setup(model, communication, k, overlap)
    return opt


class AdaptWithCombine(_Combine):
    """x_{k+1} = combine(x_k) - (update from g(x_k)); the exchange overlaps forward and backward.

    ``rumor.optim.AdaptWithCombine(optimizer, model, communication="neighbor_allreduce",
    num_steps_per_communication=1)`` returns the wrapped optimizer (see the module doc)."""

    _atc = False

    def __new__(cls, optimizer=None, model=None, communication="neighbor_allreduce", num_steps_per_communication=1):
        if cls is not AdaptWithCombine:  # the dynamic subclass being created by _wrap
            return super().__new__(cls)
        return _wrap(AdaptWithCombine, optimizer, model, communication, num_steps_per_communication)


class AdaptThenCombine(_Combine):
    """x_{k+1} = combine(x_k - update from g(x_k)); the exchange runs at the end of step()
    (with overlap=True: until the model's next forward, or synchronize()).

    ``rumor.optim.AdaptThenCombine(optimizer, model, communication="neighbor_allreduce",
    num_steps_per_communication=1, overlap=False)`` returns the wrapped optimizer (see the
    module doc)."""

    _atc = True

    def __new__(cls, optimizer=None, model=None, communication="neighbor_allreduce", num_steps_per_communication=1,
                overlap=False):
        if cls is not AdaptThenCombine:
            return super().__new__(cls)
        return _wrap(AdaptThenCombine, optimizer, model, communication, num_steps_per_communication, overlap)
