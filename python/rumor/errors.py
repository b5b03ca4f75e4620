"""Exceptions raised by rumor. The C++ core maps each failure kind onto one of these."""


class RumorError(RuntimeError):
    """Base class of every error raised by rumor's communication core."""


class CommTimeoutError(RumorError, TimeoutError):
    """A blocking operation passed its deadline while waiting on a peer (see rumor.init(timeout=))."""


class PeerError(RumorError, ConnectionError):
    """A peer closed its connection, aborted after an error of its own, or its process exited."""


class ProtocolError(RumorError):
    """A peer sent something other than what this rank expected: ranks called collectives in a
    different order, or with different sizes."""


class AbortedError(RumorError):
    """The communicator failed earlier and refuses new operations."""


class _InvalidArgument(RumorError, ValueError):
    """Bad input detected by the C++ core (it is also a ValueError)."""
