from rumor.algorithms import GradientAllReduce as _GradientAllReduce


class GradientAllReduceAlgorithm(_GradientAllReduce):
    """Bagua's GradientAllReduceAlgorithm(hierarchical=False, average=True)."""

    def __init__(self, hierarchical: bool = False, average: bool = True):
        super().__init__(hierarchical=hierarchical, average=average)

# The public names; everything else here is this module's own business.
__all__ = [
    "GradientAllReduceAlgorithm",
]
