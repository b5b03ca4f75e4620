"""What every optimizer wrapper of rumor.optim shares: the checks of its arguments and the
subclass it returns (deriving from the wrapper's mix-in and the wrapped optimizer's own class, as
BlueFog's and Horovod's wrappers do, so isinstance checks and LR schedulers keep working)."""
from __future__ import annotations

import inspect

import torch

ONE_BUFFER_PER_DTYPE = 1 << 62  # bucket cap for FlatWeights: no dtype is split


def check_args(what: str, optimizer, model, steps: int, steps_name: str) -> int:
    """Raises a TypeError/ValueError naming `what` unless optimizer is a torch optimizer, model
    a module and steps (called `steps_name`) an integer >= 1; returns steps."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{what}: expected a torch.nn.Module as model, got {type(model).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{what}: {steps_name} must be an integer >= 1, got {steps!r}")
    return steps


def build_subclass(kind: type, optimizer):
    """An instance of a new class deriving from ``kind`` and the optimizer's own class, over the
    same parameter groups (hyper-parameters included) and state; ``kind._setup`` is left to the
    caller. isinstance checks and LR schedulers keep working, as with BlueFog's and Horovod's
    wrappers."""
    name = kind.__name__
    base = type(optimizer)
    cls = type(f"{name}({base.__name__})", (kind, base), {"_base": base})
    opt = cls.__new__(cls)
    # Construct the new optimizer over the same parameter groups (their hyper-parameters
    # included) and carry over any state the wrapped one already has.
    # Some optimizers keep defaults that their constructor does not take (AdamW's
    # decoupled_weight_decay): pass only what it accepts, then restore the full defaults.
    sig = inspect.signature(base.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.values())
    kwargs = {k: v for k, v in optimizer.defaults.items() if takes_any or k in sig}
    base.__init__(opt, optimizer.param_groups, **kwargs)
    opt.defaults = dict(optimizer.defaults)
    opt.load_state_dict(optimizer.state_dict())
    return opt
