"""How a failed cell is shown: one RankError whose traceback is the first failing rank's (the
likely cause), the other ranks' errors listed after it, and what the session needs next."""
from __future__ import annotations

from typing import Dict, List, Optional

# rumor errors that leave the communicators unusable: after them the ranks have to re-init.
_COMM_ERRORS = ("CommTimeoutError", "PeerError", "AbortedError", "ProtocolError")


class RankError(RuntimeError):
    """A cell failed on one or more ranks. `failures` maps rank -> (error name, message,
    traceback text); `first` is the rank whose error is shown first (the likely cause).

    Session.execute raises it; the arguments are kept as the attributes of the same names.

    Args:
        message: the one-line summary (str(error)).
        failures: {rank: (error name, message, traceback text)} of every rank that failed.
        first: the rank whose error is shown first, or None.
        lines: the lines IPython shows instead of a local traceback: the first rank's remote
            traceback, one line per other failed rank, and what the session needs next.
    """

    def __init__(self, message: str, failures: Dict[int, tuple], first: Optional[int], lines: List[str]):
        super().__init__(message)
        self.failures = failures
        self.first = first
        self._lines = lines

    def _render_traceback_(self):
        # IPython shows these lines instead of the traceback of the magic that raised.
        return self._lines


def _remote_parts(exc: BaseException):
    """(error name, message, traceback text) of an error that came back from an engine."""
    name = getattr(exc, "ename", None) or type(exc).__name__
    msg = getattr(exc, "evalue", None)
    if msg is None:
        msg = str(exc)
    tb = getattr(exc, "traceback", None) or ""
    if isinstance(tb, list):
        tb = "\n".join(tb)
    return name, str(msg), tb


def _remote_summary(exc: BaseException) -> str:
    name, msg, _ = _remote_parts(exc)
    return f"{name}: {msg}"


def _rank_error(failures, first, order, n, dead, broken) -> RankError:
    name, msg, tb = failures[first]
    others = [r for r in order if r != first]
    head = f"rank {first}: {name}: {msg}"
    if others:
        head += f" (and {len(others)} more rank(s) failed)"
    lines = [f"--- rank {first} of {n}: {name} ---"]
    if tb:
        lines.extend(tb.rstrip("\n").splitlines())
    else:
        lines.append(f"{name}: {msg}")
    for r in others:
        oname, omsg, _ = failures[r]
        lines.append(f"--- rank {r}: {oname}: {omsg}")
    if dead:
        lines.append(f"rumor.interactive: {dead}; the session must be restarted: rumor.interactive.restart()")
    elif broken:
        lines.append("rumor.interactive: rumor's communicators are unusable after this error; "
                     "rumor.interactive.restart() re-initialises rumor on every rank (Python variables are kept)")
    message = head
    if dead or broken:
        message += "; run rumor.interactive.restart()"
    return RankError(message, failures, first, lines)

