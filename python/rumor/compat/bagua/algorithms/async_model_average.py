from rumor.algorithms import AsyncModelAverage as _AsyncModelAverage


class AsyncModelAverageAlgorithm(_AsyncModelAverage):
    """Bagua's AsyncModelAverageAlgorithm(peer_selection_mode="all", sync_interval_ms=500,
    warmup_steps=0); abort(model) / resume(model) as in Bagua."""

    def __init__(self, peer_selection_mode: str = "all", sync_interval_ms: int = 500, warmup_steps: int = 0):
        super().__init__(peer_selection=peer_selection_mode, sync_interval_ms=sync_interval_ms,
                         warmup_steps=warmup_steps)

# The public names; everything else here is this module's own business.
__all__ = [
    "AsyncModelAverageAlgorithm",
]
