"""1-bit Adam (Tang et al., 2021): Adam whose momentum, not its gradient, is communicated, with
1-bit compression once the variance has settled."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch


class OneBitAdamOptimizer(torch.optim.Optimizer):
    """Adam in two stages, for use with ``rumor.algorithms.OneBitAdamAlgorithm(optimizer)``.

    Warm-up (the first ``freeze_step`` steps): gradients are averaged at full precision and the
    update is exactly ``torch.optim.Adam``'s (weight decay added to the gradient, bias
    correction included).

    Compression (every later step): the second moment ``exp_avg_sq`` is frozen (and its bias
    correction with it), so Adam's denominator ``d = sqrt(v / (1 - beta2^freeze_step)) + eps`` is a
    constant. From the last warm-up step on, ``exp_avg`` holds the *preconditioned* momentum
    ``u = m / d``. Each rank updates it from its *local* gradient, ``u = beta1 * u + (1 - beta1) *
    g / d``, and u is averaged across ranks with 1-bit compression and error feedback (on the
    communication thread, while backward goes on); the parameters then take
    ``p -= lr / (1 - beta1^t) * u``: the same update as ``m / d`` with m averaged, since d is equal
    on every rank. Compressing u rather than m matters: a sign code gives every element of a chunk
    the chunk's mean magnitude, and elements whose variance is (near) zero would turn that into a
    huge step; in u's units every element's error is at most the chunk's mean step.
    Weight decay in this stage is decoupled: ``p *= 1 - lr * weight_decay`` before the update.

    Used without the algorithm (no communication), the compression stage updates the momentum
    locally. ``state_dict()`` holds, per parameter, ``step``, ``exp_avg``, ``exp_avg_sq`` and the
    error-feedback buffers ``worker_error`` and ``server_error`` (when the algorithm is used), so a
    checkpoint resumes exactly.

    Args:
        params: the parameters to optimize, or dicts of parameter groups (as for any torch
            optimizer).
        lr: the learning rate, >= 0; default 1e-3.
        betas: (beta1, beta2), the decay rates of the momentum and of the second moment, each in
            [0, 1); default (0.9, 0.999).
        eps: added to the denominator, >= 0; default 1e-8.
        weight_decay: L2 penalty (added to the gradient during warm-up, decoupled afterwards),
            >= 0; default 0.
        freeze_step: the number of warm-up steps, after which the variance is frozen and the
            momentum compressed; an int >= 1, default 100.

    Raises:
        ValueError: an argument is outside the range given above (the message names it).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, freeze_step: int = 100):
        if not (isinstance(lr, (int, float)) and lr >= 0.0):
            raise ValueError(f"rumor.optim.OneBitAdamOptimizer: invalid learning rate {lr!r}")
        try:
            b1, b2 = (float(b) for b in betas)
        except (TypeError, ValueError):
            raise ValueError(f"rumor.optim.OneBitAdamOptimizer: betas must be two floats, got {betas!r}") from None
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"rumor.optim.OneBitAdamOptimizer: betas must lie in [0, 1), got {betas!r}")
        if not (isinstance(eps, (int, float)) and eps >= 0.0):
            raise ValueError(f"rumor.optim.OneBitAdamOptimizer: invalid eps {eps!r}")
        if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0.0):
            raise ValueError(f"rumor.optim.OneBitAdamOptimizer: invalid weight_decay {weight_decay!r}")
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError("rumor.optim.OneBitAdamOptimizer: freeze_step must be an int >= 1 (the variance needs at "
                             f"least one full-precision step), got {freeze_step!r}")
        super().__init__(params, dict(lr=float(lr), betas=(b1, b2), eps=float(eps),
                                      weight_decay=float(weight_decay)))
        self.freeze_step = freeze_step
        self._algorithm = None  # the rumor.algorithms.OneBitAdamAlgorithm that communicates the momentum
        # Once the variance is frozen, Adam's denominator is a constant per parameter: computed once
        # instead of three passes over the parameter every step. Derived, so not in state_dict().
        self._frozen_inv = {}

    def steps_taken(self) -> int:
        """How many steps the parameters have taken (0 before the first)."""
        return max((int(st["step"]) for st in self.state.values() if "step" in st), default=0)

    def compressing(self) -> bool:
        """Whether the next step is in the compression stage."""
        return self.steps_taken() >= self.freeze_step

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """Takes one step: Adam's during the warm-up, the frozen-variance update from the
        (averaged) preconditioned momentum afterwards (see the class docstring). Parameters
        without a gradient are skipped.

        Args:
            closure: optional; re-evaluates the model and returns the loss (run with autograd on,
                before the update). Default None.

        Returns:
            The closure's loss, or None without a closure.

        Raises:
            RuntimeError: a gradient is sparse.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        alg = self._algorithm
        # Momenta that the algorithm already updated and averaged during this backward.
        external = alg._momentum_updated() if alg is not None else frozenset()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("rumor.optim.OneBitAdamOptimizer does not support sparse gradients")
                st = self.state[p]
                if "step" not in st:
                    st["step"] = 0
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if "exp_avg_sq" not in st:
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                t = st["step"]
                m, v = st["exp_avg"], st["exp_avg_sq"]
                if t <= self.freeze_step:
                    grad = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
                    m.lerp_(grad, 1 - beta1)
                    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
                    p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))
                    if t == self.freeze_step:  # from now on exp_avg holds u = m / denom
                        m.div_(denom)
                    continue
                if id(p) not in external:  # not communicated by the algorithm: local update of u
                    m.mul_(beta1).addcmul_(p.grad, self.inverse_denominator(p), value=1 - beta1)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(m, alpha=-lr / (1 - beta1 ** t))
        if alg is not None:
            alg._refresh()
        return loss

    def inverse_denominator(self, p: torch.Tensor) -> torch.Tensor:
        """1 / (sqrt(v / (1 - beta2^freeze_step)) + eps) for parameter p, from its frozen variance."""
        inv = self._frozen_inv.get(p)
        if inv is None or inv.shape != p.shape:
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            bias2 = 1 - group["betas"][1] ** self.freeze_step
            v = self.state[p]["exp_avg_sq"]
            inv = (v.sqrt() / math.sqrt(bias2)).add_(group["eps"]).reciprocal_()
            self._frozen_inv[p] = inv
        return inv

    def load_state_dict(self, state_dict) -> None:
        """Loads the optimizer's state (torch's Optimizer.load_state_dict) and, when a
        rumor.algorithms.OneBitAdamAlgorithm uses this optimizer, copies the loaded momentum and
        error-feedback buffers into the algorithm's flat per-bucket buffers. The frozen
        denominator is recomputed from the loaded variance.

        Args:
            state_dict: a dict returned by state_dict().

        Raises:
            ValueError: as torch's, when state_dict does not match the parameter groups.
        """
        super().load_state_dict(state_dict)
        self._frozen_inv = {}
        # torch replaced the state tensors; the algorithm's flat buffers must hold them again.
        if self._algorithm is not None:
            self._algorithm._rebind()
