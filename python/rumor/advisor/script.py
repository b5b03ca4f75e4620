"""The advisor on an ordinary training script: one with no ``rumor_advise()``.

The script runs as ``__main__`` (its own argument parsing, data, model and optimizer) with
rumor.DistributedDataParallel standing in for a recorder that does not communicate. At the
script's first training forward through the wrapper (grad enabled, module in train mode) the
recorder has the plain model, the batch and, when the script gave ``optimizer=`` to the wrapper,
the optimizer: it calls advise() on them and stops the script. Without ``optimizer=`` that first
step runs on the plain model and the optimizer is the one whose step() updated the model's
parameters; the advice comes at the second training forward. So at most one step of the script
runs, whatever its own step count.

The loss of the measured steps is a stand-in (the mean of each floating-point output): backward
then runs through the whole model as the script's loss would, and the script's loss function, a
few element-wise operations, is all that is left out.
"""
from __future__ import annotations

import contextlib
import os
import runpy
import sys
from typing import Callable, Dict, Optional, Sequence

import torch

from ..parallel import DistributedDataParallel
from .advice import Advice, advise

__all__ = ["AdviceReached", "advise_script"]


class AdviceReached(BaseException):
    """Raised inside the script once the advice is made, to end it there. A BaseException, so that
    a script's ``except Exception`` does not swallow it."""


def _floats(out):
    if torch.is_tensor(out):
        return [out] if out.is_floating_point() and out.requires_grad else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _floats(o)]
    return []


def stand_in_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    args, kwargs = batch
    outs = _floats(model(*args, **kwargs))
    if not outs:
        raise RuntimeError("rumor.advisor: the model's forward returned no floating-point tensor that needs a "
                           "gradient; define rumor_advise() in the script (docs/advisor.md)")
    return sum(o.float().mean() for o in outs)


class _Recorder(DistributedDataParallel):
    """What rumor.DistributedDataParallel(...) builds while the advisor runs a script: the plain
    module, no buckets, no hooks, no communication. Only forward and no_sync work."""

    _session: "_Session"

    def __init__(self, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *args, **kwargs):
        torch.nn.Module.__init__(self)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"rumor.DistributedDataParallel: module must be a torch.nn.Module, got "
                            f"{type(module).__name__}")
        self.module = module
        self.optimizer = optimizer
        self._session.wrapped(module, optimizer)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and self.module.training:
            self._session.training_forward(self.module, args, kwargs)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield


class _Session:
    def __init__(self, path: str, run_advise: Callable[..., Advice]):
        self.path = path
        self.run_advise = run_advise
        self.model: Optional[torch.nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.forwards = 0
        self.advice: Optional[Advice] = None

    def wrapped(self, module, optimizer) -> None:
        if self.model is not None and self.model is not module:
            raise SystemExit(f"rumor.advisor: {self.path} wraps a second model in rumor.DistributedDataParallel; "
                             "the advisor measures one: define rumor_advise() in the script (docs/advisor.md)")
        self.model = module
        if optimizer is not None:
            self.optimizer = optimizer

    def step_pre_hook(self, optimizer, args, kwargs) -> None:
        # The script's own optimizer, recognised by the parameters it updates.
        if self.optimizer is None and self.model is not None:
            mine = {id(p) for p in self.model.parameters()}
            if any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
                self.optimizer = optimizer

    def training_forward(self, module, args, kwargs) -> None:
        self.forwards += 1
        if self.optimizer is None:
            if self.forwards == 1:
                return  # this step runs on the plain model; its optimizer.step() names the optimizer
            raise SystemExit(f"rumor.advisor: {self.path} ran a training step without an optimizer.step() over the "
                             "model's parameters; give the optimizer to the wrapper (optimizer=...) or define "
                             "rumor_advise() in the script (docs/advisor.md)")
        self.advice = self.run_advise(module, self.optimizer, (args, kwargs), stand_in_loss)
        raise AdviceReached()


def advise_script(path: str, argv: Sequence[str], run_advise: Optional[Callable[..., Advice]] = None) -> Advice:
    """Runs the script at ``path`` as ``__main__`` with ``argv`` until its first training
    forward through rumor.DistributedDataParallel (the second without ``optimizer=``), advises
    there and returns the Advice. run_advise(model, optimizer, batch, loss_fn) defaults to
    rumor.advise with its defaults."""
    if run_advise is None:
        def run_advise(model, optimizer, batch, loss_fn):
            from .._runtime import init, is_initialized

            if not is_initialized():  # a script that reaches its training without rumor.init()
                init()
            return advise(model, optimizer, batch, loss_fn)
    session = _Session(path, run_advise)
    recorder = type("DistributedDataParallel", (_Recorder,), {"_session": session})
    # The script's wrapper becomes the recorder in __init__. (Not by assigning __new__ on the
    # class: deleting it afterwards leaves CPython's construction slot behind, and every later
    # DistributedDataParallel(...) in this process fails in object.__new__.) Putting the
    # original __init__ back restores the class exactly.
    original_init = DistributedDataParallel.__dict__["__init__"]

    def init(self, *args, **kwargs):
        if type(self) is DistributedDataParallel:
            self.__class__ = recorder
            recorder.__init__(self, *args, **kwargs)
        else:
            original_init(self, *args, **kwargs)

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    old_argv = sys.argv
    sys.argv = [path, *argv]
    # As `python script.py` does: the script's folder first on the import path.
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    hook = register_optimizer_step_pre_hook(session.step_pre_hook)
    DistributedDataParallel.__init__ = init
    try:
        runpy.run_path(path, run_name="__main__")
    except AdviceReached:
        pass
    finally:
        DistributedDataParallel.__init__ = original_init
        hook.remove()
        sys.argv = old_argv
        if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(path)):
            del sys.path[0]
    if session.advice is None:
        what = ("never wrapped a model in rumor.DistributedDataParallel" if session.model is None
                else "ended before a training forward through rumor.DistributedDataParallel")
        raise SystemExit(f"rumor.advisor: {path} {what}; the advisor measures the script's first training step "
                         "through the wrapper, or what a function rumor_advise() in the script returns "
                         "(dict(model=..., optimizer=..., batch=..., loss_fn=None); docs/advisor.md)")
    return session.advice
