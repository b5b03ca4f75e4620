from rumor.algorithms import Decentralized as _Decentralized
from rumor.algorithms import LowPrecisionDecentralized as _LowPrecisionDecentralized


class DecentralizedAlgorithm(_Decentralized):
    """Bagua's DecentralizedAlgorithm(hierarchical=True, peer_selection_mode="all",
    communication_interval=1)."""

    def __init__(self, hierarchical: bool = True, peer_selection_mode: str = "all", communication_interval: int = 1):
        super().__init__(peer_selection=peer_selection_mode, communication_interval=communication_interval,
                         hierarchical=hierarchical)


class LowPrecisionDecentralizedAlgorithm(_LowPrecisionDecentralized):
    """Bagua's LowPrecisionDecentralizedAlgorithm(hierarchical=True, communication_interval=1)."""

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1):
        super().__init__(hierarchical=hierarchical, communication_interval=communication_interval)

# The public names; everything else here is this module's own business.
__all__ = [
    "DecentralizedAlgorithm", "LowPrecisionDecentralizedAlgorithm",
]
