"""QAdam under Bagua's names, mapped onto rumor's two-stage compressed Adam.

Same structure as Bagua's QAdam: plain Adam with full-precision gradient averaging for
``warmup_steps`` steps, then Adam with the second moment frozen and the momentum averaged in
compressed form. rumor compresses the momentum to 1 bit per element with error feedback
(rumor.algorithms.OneBitAdamAlgorithm) where Bagua quantized it to 8 bits, so the trajectories are close
but not bit-equal to Bagua's.
"""
from rumor.algorithms import OneBitAdamAlgorithm as _OneBitAdamAlgorithm
from rumor.optim import OneBitAdamOptimizer as _OneBitAdam


def QAdamOptimizer(params, lr: float = 1e-3, warmup_steps: int = 100, betas=(0.9, 0.999),  # noqa: N802
                   eps: float = 1e-8, weight_decay: float = 0.0):
    """Bagua's QAdam optimizer, as rumor.optim.OneBitAdamOptimizer with freeze_step=warmup_steps:
    Adam with full-precision gradient averaging for the warm-up, then a frozen second moment and
    a compressed momentum (1 bit per element in rumor; see the module docstring). Pair it with
    QAdamAlgorithm.

    Args:
        params: the parameters to optimize, or dicts of parameter groups.
        lr: the learning rate; default 1e-3.
        warmup_steps: steps of plain Adam before the momentum is compressed, an int >= 1;
            default 100.
        betas: (beta1, beta2), each in [0, 1); default (0.9, 0.999).
        eps: added to Adam's denominator; default 1e-8.
        weight_decay: L2 penalty; default 0.

    Returns:
        A rumor.optim.OneBitAdamOptimizer.

    Raises:
        ValueError: an argument is out of range (the message names OneBitAdamOptimizer's name
            for it: freeze_step for warmup_steps).
    """
    return _OneBitAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, freeze_step=warmup_steps)


class QAdamAlgorithm(_OneBitAdamAlgorithm):
    """Bagua's QAdamAlgorithm(q_adam_optimizer, hierarchical=True)."""

    def __init__(self, q_adam_optimizer, hierarchical: bool = True):
        super().__init__(q_adam_optimizer, hierarchical=hierarchical)

# The public names; everything else here is this module's own business.
__all__ = [
    "QAdamAlgorithm", "QAdamOptimizer",
]
