"""rumor.optim.fuse_optimizer: a torch optimizer stepping over a few flat buffers.

The parameters of each (param group, dtype, device) become views into one flat buffer, and so do
their gradients; the optimizer's step then runs over one big tensor per segment instead of
hundreds of small ones (torch's own step for elementwise optimizers, or rumor's C++ kernels for
SGD, Adam and AdamW). Under rumor.DistributedDataParallel the gradient buffers are the DDP
buckets themselves (one segment per bucket and param group), so fusion and bucketing agree by
construction.

The optimizer keeps its identity (same object, class, param_groups and hooks): only step and
zero_grad are replaced on the instance. Its state lives in flat tensors, and optimizer.state[p]
holds views of them, so state_dict() has the keys and shapes of the unfused optimizer's, and
load_state_dict() accepts a plain optimizer's state dict (and a plain optimizer accepts ours).
"""
from __future__ import annotations

import collections
import types
from typing import Dict, List, Optional, Sequence

import torch

from .. import _C

# Optimizers whose update treats every element on its own, with state that is either elementwise
# (the parameter's shape) or one scalar per parameter that all parameters of a group share
# (step counts, NAdam's mu_product, ASGD's eta and mu).
_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
                torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
                torch.optim.Rprop)
# Refused with their reason: their update needs a per-tensor quantity (norm, factored moments) or
# the whole problem at once.
_REFUSED = {
    "LBFGS": "its step is a line search over all parameters (closure-driven)",
    "SparseAdam": "it works on sparse gradients",
    "Adafactor": "its second moment is factored per tensor (row and column statistics)",
    "LAMB": "its trust ratio is a per-tensor norm",
    "Lamb": "its trust ratio is a per-tensor norm",
    "LARS": "its trust ratio is a per-tensor norm",
    "Lars": "its trust ratio is a per-tensor norm",
    "Muon": "its update orthogonalizes each weight matrix",
    "Shampoo": "its preconditioners are per-tensor matrices",
}


class FusionError(TypeError):
    """The optimizer cannot be fused (its update is not elementwise, or an option prevents it)."""


def _check_fusible(optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"rumor.optim.fuse_optimizer: optimizer must be a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    name = type(optimizer).__name__
    if name in _REFUSED:
        raise FusionError(f"rumor.optim.fuse_optimizer: cannot fuse {name}: {_REFUSED[name]}, so a step "
                          "over a flat buffer would be wrong; use it unfused")
    if type(optimizer) not in _ELEMENTWISE:
        known = ", ".join(c.__name__ for c in _ELEMENTWISE)
        raise FusionError(f"rumor.optim.fuse_optimizer: cannot fuse {name}: only optimizers known to update "
                          f"elementwise are fused ({known}); a subclass or an unknown optimizer may use "
                          "per-tensor quantities that a flat buffer would get wrong")
    for i, g in enumerate(optimizer.param_groups):
        if g.get("differentiable", False):
            raise FusionError(f"rumor.optim.fuse_optimizer: param group {i} has differentiable=True, "
                              "which fusion does not support")
        for p in g["params"]:
            if p.is_sparse:
                raise FusionError("rumor.optim.fuse_optimizer: sparse parameters cannot be fused")
    if getattr(optimizer, "_rumor_fusion", None) is not None:
        raise ValueError("rumor.optim.fuse_optimizer: this optimizer is already fused")


class SharedStorage:
    """Where a segment's buffers live when DistributedDataParallel(overlap_optimizer=True) updates
    it once per host (csrc/optim/shared_step_op.h): its parameters in this rank's shared arena,
    its optimizer state in memory that every rank of the host views (state key -> flat view).
    `writer`: this rank copies existing state into the shared views (one rank does)."""

    def __init__(self, flat: torch.Tensor, state: Dict[str, torch.Tensor], writer: bool):
        self.flat, self.state, self.writer = flat, state, writer


class _Segment:
    """Parameters of one param group laid out back to back in a flat parameter buffer, with a
    flat gradient buffer of the same layout."""

    def __init__(self, group: int, params: List[torch.Tensor], grad: Optional[torch.Tensor],
                 bucket: Optional[int] = None, shared: Optional[SharedStorage] = None):
        self.group = group
        self.bucket = bucket  # the DistributedDataParallel bucket whose slice `grad` is
        self.shared = shared
        self.params = params
        first = params[0]
        self.numel = sum(p.numel() for p in params)
        self.offsets, off = [], 0
        for p in params:
            self.offsets.append(off)
            off += p.numel()
        if shared is not None and (shared.flat.numel() != self.numel or shared.flat.dtype != first.dtype):
            raise ValueError("rumor.optim: a segment's shared storage does not match its parameters")
        # A Parameter so that optimizers treat it as they treat the user's (it never enters autograd).
        self.flat = torch.nn.Parameter(shared.flat if shared is not None
                                       else torch.empty(self.numel, dtype=first.dtype, device=first.device))
        if grad is None:
            grad = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        elif grad.numel() != self.numel or grad.dtype != first.dtype or not grad.is_contiguous():
            raise ValueError("rumor.optim: a segment's gradient buffer does not match its parameters")
        self.grad = grad

    def views(self, flat: torch.Tensor):
        for p, off in zip(self.params, self.offsets):
            yield p, flat[off:off + p.numel()].view_as(p)


class _Fusion:
    """What fuse_optimizer attaches to an optimizer (as optimizer._rumor_fusion)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.opt = optimizer
        self.segments: List[_Segment] = []
        self.loose: Dict[int, List[torch.Tensor]] = {}  # group -> parameters left unfused
        self.flat_state: Dict[torch.Tensor, dict] = {}
        self.overlap = None  # set by DistributedDataParallel(overlap_optimizer=True)
        self._user_step = optimizer.step  # bound (and possibly wrapped by an lr scheduler)
        self._kernel = _kernel_kind(optimizer)

    # ---- layout -------------------------------------------------------------------------

    def default_plan(self):
        """One segment per (param group, dtype, device), in the group's order."""
        plan = []
        for gi, g in enumerate(self.opt.param_groups):
            by_key: Dict[tuple, List[torch.Tensor]] = {}
            for p in g["params"]:
                if self.fusible(p):
                    by_key.setdefault((p.dtype, str(p.device)), []).append(p)
            for params in by_key.values():
                plan.append((gi, params, None))
        return plan

    @staticmethod
    def fusible(p: torch.Tensor) -> bool:
        # A parameter that gets no gradient must keep torch's "no grad, no update" behaviour:
        # it stays out of the flat buffers.
        return p.requires_grad and p.layout == torch.strided

    def layout(self, plan) -> None:
        """(Re)builds the flat buffers from plan = [(group index, params, gradient buffer or None
        [, bucket index [, SharedStorage]])], keeping parameter values, gradients and optimizer
        state."""
        opt = self.opt
        fused_ids = set()
        segments = []
        for gi, params, grad, *where in plan:
            seg = _Segment(gi, list(params), grad, *where)
            with torch.no_grad():
                for p, view in seg.views(seg.flat.data):
                    view.copy_(p.data)
                grads = list(seg.views(seg.grad))
                for p, gview in grads:
                    if p.grad is not None and p.grad.data_ptr() != gview.data_ptr():
                        gview.copy_(p.grad)
                    elif p.grad is None:
                        gview.zero_()
            segments.append(seg)
            fused_ids.update(id(p) for p in params)
        # Gather each parameter's state (views into the old flat state, or a plain optimizer's
        # tensors after load_state_dict) before any buffer is replaced.
        per_param = {id(p): dict(opt.state[p]) for seg in segments for p in seg.params if p in opt.state}
        flat_state: Dict[torch.Tensor, dict] = {}
        for seg in segments:
            flat_state[seg.flat] = self._concat_state(seg, per_param)
            if seg.shared is not None:
                _into_shared(flat_state[seg.flat], seg)
        with torch.no_grad():
            for seg in segments:
                for (p, view), (_, gview) in zip(seg.views(seg.flat.data), seg.views(seg.grad)):
                    p.data = view
                    p.grad = gview
                seg.flat.grad = seg.grad
        self.segments = segments
        self.flat_state = flat_state
        self.loose = {}
        for gi, g in enumerate(opt.param_groups):
            self.loose[gi] = [p for p in g["params"] if id(p) not in fused_ids]
        self.expose_state()

    def _concat_state(self, seg: _Segment, per_param) -> dict:
        states = [per_param.get(id(p)) for p in seg.params]
        present = [s for s in states if s]
        if not present:
            return {}
        if len(present) != len(states):
            # Some parameters of the group stepped and others did not (they had no gradient):
            # one flat state cannot hold both.
            raise ValueError("rumor.optim.fuse_optimizer: parameters of one param group have optimizer state "
                             "for some and not for others; fuse before the first step or load a full state")
        out = {}
        for key in present[0]:
            vals = [s.get(key) for s in states]
            v0 = vals[0]
            tensors = all(isinstance(v, torch.Tensor) for v in vals)
            if tensors and key not in _SCALAR_KEYS and all(v.shape == p.shape for v, p in zip(vals, seg.params)):
                out[key] = torch.cat([v.detach().reshape(-1).to(device=seg.flat.device) for v in vals])
            elif tensors and all(v.dim() == 0 for v in vals):
                # One scalar per parameter: equal across a group that always steps together.
                if any(not torch.equal(v, v0) for v in vals):
                    raise ValueError(f"rumor.optim.fuse_optimizer: state '{key}' differs between parameters of "
                                     "one param group; a fused segment shares one value")
                out[key] = v0.detach().clone()
            elif tensors:
                shapes = {tuple(v.shape) for v in vals}
                raise ValueError(f"rumor.optim.fuse_optimizer: state '{key}' has shapes {sorted(shapes)}, not "
                                 "the parameters' shapes; only elementwise state can be fused")
            else:
                if any(v != v0 for v in vals):
                    raise ValueError(f"rumor.optim.fuse_optimizer: state '{key}' differs between parameters of "
                                     "one param group")
                out[key] = v0
        return out

    def expose_state(self) -> None:
        """optimizer.state[p] = views of the flat state (same keys and shapes as unfused)."""
        state = self.opt.state
        for seg in self.segments:
            fs = self.flat_state.get(seg.flat, {})
            for i, p in enumerate(seg.params):
                if not fs:
                    state.pop(p, None)
                    continue
                ps = {}
                off, n = seg.offsets[i], p.numel()
                for key, v in fs.items():
                    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == seg.numel:
                        ps[key] = v[off:off + n].view_as(p)
                    else:
                        ps[key] = v  # shared scalar (cloned per parameter by state_dict)
                state[p] = ps

    # ---- step ---------------------------------------------------------------------------

    def sync_grads(self) -> None:
        """Puts gradients that were replaced (assigned, or set to None) back into the flat
        buffers; a parameter without a gradient contributes zeros (see docs/optimizer.md)."""
        with torch.no_grad():
            for seg in self.segments:
                for p, gview in seg.views(seg.grad):
                    g = p.grad
                    if g is None:
                        gview.zero_()
                        p.grad = gview
                    elif g.data_ptr() != gview.data_ptr():
                        gview.copy_(g)
                        p.grad = gview
                seg.flat.grad = seg.grad

    def check_params(self) -> None:
        for seg in self.segments:
            base = seg.flat.data_ptr()
            for p, off in zip(seg.params, seg.offsets):
                if p.data_ptr() != base + off * p.element_size():
                    raise RuntimeError("rumor.optim: a fused parameter's .data was replaced (e.g. by "
                                       "load_state_dict(assign=True) or p.data = ...) after fuse_optimizer; "
                                       "the optimizer would no longer update it")

    def active_segments(self) -> List[_Segment]:
        """The segments optimizer.step() updates: all of them, or with overlap_optimizer those
        that no bucket updates during backward."""
        if self.overlap is None:
            return self.segments
        return [s for s in self.segments if s.bucket is None]

    def step(self, closure=None):
        opt = self.opt
        if self.overlap is not None:
            if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
                raise RuntimeError("rumor.optim: GradScaler cannot drive an optimizer overlapped with "
                                   "communication (DistributedDataParallel(overlap_optimizer=True)): the update "
                                   "already ran during backward, before any inf/nan check")
            if closure is not None:
                raise ValueError("rumor.optim: step(closure) is not supported with overlap_optimizer=True "
                                 "(the update runs inside backward)")
        self.check_params()
        self.sync_grads()
        segs = self.active_segments()
        if self._kernel is not None and all(self._kernel_ok(seg) for seg in segs):
            return _hooked_call(opt, lambda c: self._kernel_step(c, segs), closure)
        if self.overlap is not None:
            return _hooked_call(opt, lambda c: self._swapped(lambda: _unhooked(type(opt).step)(opt), segs), closure)
        return self._swapped(lambda: self._user_step(closure), segs)

    def step_segments(self, segs: List[_Segment]) -> None:
        """torch's update over some segments only (overlap_optimizer's fallback, per bucket)."""
        opt = self.opt
        with torch.no_grad():
            self._swapped(lambda: _unhooked(type(opt).step)(opt), segs, loose=False)

    def kernel_segment(self, seg: _Segment) -> tuple:
        """The C++ step of one segment (see rumor._C.OptimizerStepOp.set_segments), creating its
        state as torch would on the first step."""
        g = self.opt.param_groups[seg.group]
        st = self.flat_state.setdefault(seg.flat, {})
        p, grad = seg.flat.data, seg.grad
        lr, wd, maximize = float(g["lr"]), float(g["weight_decay"]), bool(g.get("maximize", False))
        shared = seg.shared.state if seg.shared is not None else None
        if self._kernel == "sgd":
            first = "momentum_buffer" not in st
            buf = None
            if g["momentum"] != 0:
                if first:
                    st["momentum_buffer"] = shared["momentum_buffer"] if shared else torch.empty_like(p)
                buf = st["momentum_buffer"]
            return (0, p.data_ptr(), grad.data_ptr(), seg.numel, 0 if buf is None else buf.data_ptr(), 0, 0, 0,
                    first, lr, float(g["momentum"]), float(g["dampening"]), 0.0, wd, bool(g["nesterov"]), False,
                    maximize)
        # Shared state is zeroed by the ranks that update it, inside the update (first = True).
        fresh = _init_adam_state(st, p, g, shared)
        vmax = st.get("max_exp_avg_sq") if g["amsgrad"] else None
        b1, b2 = (float(b) for b in g["betas"])
        return (1, p.data_ptr(), grad.data_ptr(), seg.numel, st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(),
                0 if vmax is None else vmax.data_ptr(), st["step"].data_ptr(), fresh, lr, b1, b2, float(g["eps"]), wd,
                bool(g.get("decoupled_weight_decay", False)), bool(g["amsgrad"]), maximize)

    def _swapped(self, fn, segs: Optional[List[_Segment]] = None, loose: bool = True):
        """Runs fn with param_groups and state swapped to the flat segments (and the loose
        parameters), so that the optimizer's own step runs over a few big tensors."""
        opt = self.opt
        segs = self.segments if segs is None else segs
        saved_params = [g["params"] for g in opt.param_groups]
        saved_state = opt.state
        swapped = collections.defaultdict(dict)
        swapped.update(self.flat_state)
        for loose in self.loose.values():
            for p in loose:
                if p in saved_state:
                    swapped[p] = saved_state[p]
        try:
            for gi, g in enumerate(opt.param_groups):
                g["params"] = ([s.flat for s in segs if s.group == gi]
                               + (self.loose.get(gi, []) if loose else []))
            opt.state = swapped
            return fn()
        finally:
            for g, params in zip(opt.param_groups, saved_params):
                g["params"] = params
            opt.state = saved_state
            for seg in segs:
                self.flat_state[seg.flat] = swapped.get(seg.flat, {})
            for loose in self.loose.values():
                for p in loose:
                    if swapped.get(p):
                        saved_state[p] = swapped[p]
            self.expose_state()

    def _kernel_ok(self, seg: _Segment) -> bool:
        return (seg.flat.dtype == torch.float32 and seg.flat.device.type == "cpu"
                and self.group_kernel_ok(seg.group))

    def group_kernel_ok(self, gi: int) -> bool:
        """Whether the C++ kernels can run param group gi's update (on float32 CPU buffers)."""
        g = self.opt.param_groups[gi]
        return (self._kernel is not None and not isinstance(g["lr"], torch.Tensor) and not g.get("capturable", False)
                and not any(isinstance(b, torch.Tensor) for b in g.get("betas", ())))

    def _kernel_step(self, closure, segs):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self.sync_grads()
        opt = self.opt
        for seg in segs:
            _kernel_update(self._kernel, opt.param_groups[seg.group], self.flat_state.setdefault(seg.flat, {}), seg)
        if any(self.loose.values()):
            # Parameters left unfused (no gradient expected) keep torch's own step.
            saved = [g["params"] for g in opt.param_groups]
            try:
                for gi, g in enumerate(opt.param_groups):
                    g["params"] = self.loose.get(gi, [])
                _unhooked(type(opt).step)(opt)
            finally:
                for g, params in zip(opt.param_groups, saved):
                    g["params"] = params
        self.expose_state()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The flat gradient buffers stay (they are the DDP buckets): zeroed, never set to None.
        with torch.no_grad():
            for seg in self.segments:
                seg.grad.zero_()
                for p, gview in seg.views(seg.grad):
                    p.grad = gview
        for loose in self.loose.values():
            for p in loose:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()


_SCALAR_KEYS = frozenset({"step", "mu_product", "eta", "mu"})


def _unhooked(step):
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def _hooked_call(opt, body, closure):
    # torch.optim.Optimizer's step hooks (global and per-instance), as its own wrapper runs them.
    from torch.optim import optimizer as _o
    args, kwargs = (opt,), ({} if closure is None else {"closure": closure})
    for pre in (*_o._global_optimizer_pre_hooks.values(), *opt._optimizer_step_pre_hooks.values()):
        res = pre(opt, args[1:], kwargs)
        if res is not None:
            raise RuntimeError("rumor.optim: a step pre-hook that rewrites the step's arguments is not "
                               "supported on a fused optimizer")
    with torch.no_grad():
        out = body(closure)
    opt._opt_called = True
    for post in (*opt._optimizer_step_post_hooks.values(), *_o._global_optimizer_post_hooks.values()):
        post(opt, args[1:], kwargs)
    return out


def _kernel_kind(opt) -> Optional[str]:
    t = type(opt)
    if t is torch.optim.SGD:
        return "sgd"
    if t in (torch.optim.Adam, torch.optim.AdamW):
        return "adam"
    return None


def _kernel_update(kind: str, g: dict, st: dict, seg: _Segment) -> None:
    p, grad = seg.flat.data, seg.grad
    n = seg.numel
    if kind == "sgd":
        buf = st.get("momentum_buffer")
        first = buf is None
        if g["momentum"] != 0 and first:
            buf = torch.empty_like(p)
        _C.sgd_step(p.data_ptr(), grad.data_ptr(), 0 if buf is None else buf.data_ptr(), n, float(g["lr"]),
                    float(g["momentum"]), float(g["dampening"]), float(g["weight_decay"]), bool(g["nesterov"]),
                    bool(g.get("maximize", False)), first, threads=torch.get_num_threads())
        if g["momentum"] != 0:
            st["momentum_buffer"] = buf
        return
    _init_adam_state(st, p, g)
    step = st["step"]
    step += 1
    beta1, beta2 = (float(b) for b in g["betas"])
    decoupled = bool(g.get("decoupled_weight_decay", False))
    vmax = st.get("max_exp_avg_sq") if g["amsgrad"] else None
    _C.adam_step(p.data_ptr(), grad.data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(),
                 0 if vmax is None else vmax.data_ptr(), n, float(g["lr"]), beta1, beta2, float(g["eps"]),
                 float(g["weight_decay"]), decoupled, bool(g["amsgrad"]), bool(g.get("maximize", False)),
                 float(step.item()), threads=torch.get_num_threads())


def _init_adam_state(st: dict, p: torch.Tensor, g: dict, shared: Optional[Dict[str, torch.Tensor]] = None) -> bool:
    """Creates Adam's state as torch does on its first step (shared: in the given views, left for
    the update to zero). Returns whether it did."""
    if st:
        return False
    st["step"] = torch.tensor(0.0, dtype=torch.float32)
    keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if g["amsgrad"] else ())
    for key in keys:
        st[key] = shared[key] if shared else torch.zeros_like(p, memory_format=torch.preserve_format)
    return True


def _into_shared(fs: dict, seg: _Segment) -> None:
    """Moves a segment's elementwise state into its shared views (written by one rank of the
    host; the others' copies are equal and dropped)."""
    for key, v in list(fs.items()):
        view = seg.shared.state.get(key)
        if view is not None and isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == seg.numel:
            if seg.shared.writer and v.data_ptr() != view.data_ptr():
                view.copy_(v)
            fs[key] = view


def fuse_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Makes ``optimizer`` step over flat buffers (see the module docstring and docs/optimizer.md).

    Returns the same optimizer object. Call it after creating the optimizer and before the first
    step (or after loading its state). Under rumor.DistributedDataParallel, pass the fused
    optimizer to the wrapper (``optimizer=``) so that the flat gradient buffers are the buckets.
    """
    _check_fusible(optimizer)
    fusion = _Fusion(optimizer)
    fusion.layout(fusion.default_plan())
    optimizer._rumor_fusion = fusion

    def step(self, closure=None):
        return self._rumor_fusion.step(closure)

    def zero_grad(self, set_to_none: bool = True):
        return self._rumor_fusion.zero_grad(set_to_none)

    # An lr scheduler created before fusing marked the step it wrapped; keep the mark so that it
    # does not warn that step was replaced (its call counting goes on through _user_step).
    if hasattr(fusion._user_step, "_wrapped_by_lr_sched"):
        step._wrapped_by_lr_sched = True
    # Bound methods, as schedulers created later expect (they wrap step.__func__).
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    optimizer.register_state_dict_post_hook(_state_dict_post_hook)
    optimizer.register_load_state_dict_post_hook(_load_state_dict_post_hook)
    return optimizer


def fusion_of(optimizer) -> Optional[_Fusion]:
    return getattr(optimizer, "_rumor_fusion", None)


def _state_dict_post_hook(opt, state_dict):
    # Scalars (step counts) are one tensor per segment; a plain optimizer loading this dict must
    # get one per parameter, or it would count each step once per parameter.
    for st in state_dict["state"].values():
        for key, v in list(st.items()):
            if isinstance(v, torch.Tensor) and key in _SCALAR_KEYS:
                st[key] = v.clone()
    return state_dict


def _load_state_dict_post_hook(opt):
    fusion = opt._rumor_fusion
    # torch.optim wrote plain per-parameter tensors into opt.state: gather them into flat state.
    if fusion.overlap is not None:
        # The wrapper's per-bucket update ops hold the segments: it must rebuild them with the
        # new ones (they used to go on updating the old flat buffers, no longer the parameters).
        fusion.overlap._relayout_fusion()
        return
    plan = [(s.group, s.params, s.grad, s.bucket, s.shared) for s in fusion.segments]
    fusion.layout(plan)
