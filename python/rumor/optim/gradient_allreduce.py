"""Gradient averaging as an optimizer wrapper (BlueFog's DistributedGradientAllreduceOptimizer).

rumor.DistributedDataParallel is the fast path (buckets, overlap in C++); this wrapper is for
code written against an optimizer wrapper: it leaves the model alone and averages each
gradient with a nonblocking allreduce as soon as backward has accumulated it
``backward_passes_per_step`` times, so the exchange overlaps the rest of backward. step()
waits for the averages, writes them into ``.grad`` and applies the wrapped optimizer.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from .. import collectives
from ._wrap import build_subclass, check_args


class _GradientAllreduce:
    _base: type = torch.optim.Optimizer

    def __init__(self, *args, **kwargs):
        pass  # built by GradientAllReduceOptimizer.__new__

    def _setup(self, model, backward_passes_per_step: int) -> None:
        self._model = model
        self.backward_passes_per_step = backward_passes_per_step
        self._handles = {}  # parameter -> Handle of its gradient's average
        self._should_synchronize = True
        in_opt = {id(p) for g in self.param_groups for p in g["params"]}
        self._params = [p for p in model.parameters() if p.requires_grad and id(p) in in_opt]
        if not self._params:
            raise ValueError(f"{type(self).__name__}: the optimizer holds none of the model's trainable parameters")
        self._delay = {p: backward_passes_per_step for p in self._params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    def _on_grad(self, p) -> None:
        self._delay[p] -= 1
        if self._delay[p] == 0 and p not in self._handles:
            # Accumulated over backward_passes_per_step passes: the average of the sums.
            self._handles[p] = collectives.allreduce_nonblocking(p.grad)

    def synchronize(self) -> None:
        """Waits for every gradient's average (starting those backward did not reach, in model
        order, so all ranks issue the same sequence) and writes them into .grad."""
        for p in self._params:
            if p not in self._handles:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._handles[p] = collectives.allreduce_nonblocking(p.grad)
        with torch.no_grad():
            for p in self._params:
                avg = collectives.synchronize(self._handles[p])
                p.grad.copy_(avg)
                self._delay[p] = self.backward_passes_per_step
        self._handles.clear()

    @contextmanager
    def skip_synchronize(self):
        """For ``synchronize(); clip gradients; with skip_synchronize(): step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Waits for the gradient averages and writes them into ``.grad`` (synchronize()), unless
        inside skip_synchronize(), then applies the wrapped optimizer's update.

        Args:
            closure: passed to the wrapped optimizer's step(); default None.

        Returns:
            What the wrapped optimizer's step() returns (the closure's loss, or None).
        """
        base_step = self._base.step
        base_step = base_step.__wrapped__ if getattr(base_step, "hooked", False) else base_step
        if self._should_synchronize:
            self.synchronize()
        return base_step(self, closure)

    def zero_grad(self, set_to_none: bool = True):
        """The wrapped optimizer's zero_grad(), refused while averages are in flight (they write
        into the gradients).

        Args:
            set_to_none: set the gradients to None instead of zeroing them; default True.

        Raises:
            RuntimeError: gradient averages started by backward have not been waited for yet
                (call step() or synchronize() first).
        """
        if self._handles:
            raise RuntimeError(f"{type(self).__name__}.zero_grad(): gradient averages are still in flight "
                               "(call step() or synchronize() first)")
        return self._base.zero_grad(self, set_to_none)

    def remove_hooks(self) -> None:
        """Detaches the hooks that start each gradient's average from the parameters: after it,
        backward no longer starts averages and synchronize() averages everything itself."""
        for h in self._hooks:
            h.remove()


class GradientAllReduceOptimizer(_GradientAllreduce):
    """``rumor.optim.GradientAllReduceOptimizer(optimizer, model, backward_passes_per_step=1)`` returns
    the optimizer wrapped (an instance of a subclass of its own class) so that step() applies
    the gradients averaged over all ranks (see the module doc)."""

    def __new__(cls, optimizer=None, model=None, backward_passes_per_step=1):
        if cls is not GradientAllReduceOptimizer:
            return super().__new__(cls)
        what = "rumor.optim.GradientAllReduceOptimizer"
        k = check_args(what, optimizer, model, backward_passes_per_step, "backward_passes_per_step")
        opt = build_subclass(_GradientAllreduce, optimizer)
        opt._setup(model, k)
        return opt
