from rumor.algorithms import ByteGrad as _ByteGrad


class ByteGradAlgorithm(_ByteGrad):
    """Bagua's ByteGradAlgorithm(hierarchical=True, average=True): 8-bit min-max gradients."""

    def __init__(self, hierarchical: bool = True, average: bool = True):
        super().__init__(hierarchical=hierarchical, average=average)

# The public names; everything else here is this module's own business.
__all__ = [
    "ByteGradAlgorithm",
]
