"""Timeline (Chrome trace JSON for Perfetto / chrome://tracing) and flight recorder.

Recording is per rank: ``start(path)`` (collective: every rank calls it) writes
``<path without .json>.rank<r>.json`` on each rank, incrementally, from a C++ background
writer. ``stop(merge=True)`` lets rank 0 merge every rank's file into one, with one process
per rank and clocks aligned on rank 0's. ``RUMOR_TIMELINE=path`` starts it in ``rumor.init()``.

The flight recorder needs no setup: ``flight_records()`` returns this rank's last N operations
(env RUMOR_FLIGHT_RECORDER=N, default 64, 0 off); they are also written to the log (and to the
trace) when an operation fails. See docs/timeline.md.
"""
from __future__ import annotations

import builtins
import contextlib
import glob as _glob
import json
import os
from typing import Dict, Iterable, List, Optional, Union

from . import _C
from . import _runtime
from ._runtime import DEFAULT_FLIGHT_RECORDS  # noqa: F401 - part of this module's API

_CLOCK_ROUNDS = 8

# Module state of the running timeline (None when off). parallel.py reads _on on every step,
# so it is a plain bool.
_on = False
_paths: Optional[Dict[str, str]] = None


def _base(path: str) -> str:
    return path[:-5] if path.endswith(".json") else path


def rank_path(path: str, rank: int) -> str:
    """The file rank `rank` writes for start(path): trace.json -> trace.rank3.json."""
    return f"{_base(path)}.rank{rank}.json"


def _measure_clock_offset():
    """(offset_us, rtt_us): this rank's steady clock minus rank 0's, from the ping-pong round with
    the smallest round trip (its midpoint is the tightest estimate), over rumor's own send/recv."""
    import torch

    st = _runtime.state()
    n, me = st.env.size, st.env.rank
    if n == 1:
        return 0.0, 0.0
    from .collectives import recv, send

    buf = torch.zeros(1, dtype=torch.float64)
    best = (0.0, float("inf"))
    if me == 0:
        for r in builtins.range(1, n):
            for _ in builtins.range(_CLOCK_ROUNDS):
                recv(buf, r)
                buf[0] = _C.trace_now_us()
                send(buf, r)
    else:
        for _ in builtins.range(_CLOCK_ROUNDS):
            t1 = _C.trace_now_us()
            buf[0] = t1
            send(buf, 0)
            recv(buf, 0)
            t2 = _C.trace_now_us()
            rtt = t2 - t1
            if rtt < best[1]:
                best = ((t1 + t2) / 2 - float(buf[0]), rtt)
    return best[0], (0.0 if me == 0 else best[1])


def start(path: Union[str, os.PathLike]) -> str:
    """Starts recording on every rank (collective: all ranks call it, with the same path).
    Returns this rank's file. Measures the clock offset to rank 0 first."""
    global _on, _paths
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"rumor.timeline.start(): path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not path:
        raise ValueError("rumor.timeline.start(): path must not be empty")
    st = _runtime.state()
    if _on:
        raise RuntimeError(f"rumor.timeline.start(): a timeline is already recording to {_paths['rank']}; "
                           "call rumor.timeline.stop() first")
    mine = rank_path(path, st.env.rank)
    parent = os.path.dirname(os.path.abspath(mine))
    if not os.path.isdir(parent):
        raise ValueError(f"rumor.timeline.start(): directory {parent} does not exist")
    offset, rtt = _measure_clock_offset()
    _C.timeline_start(st.ctx, mine, offset, rtt)
    _C.timeline_name_thread(st.ctx, "python main")
    _paths = {"base": path, "rank": mine}
    _on = True
    return mine


def stop(merge: bool = False, out: Optional[Union[str, os.PathLike]] = None) -> Optional[str]:
    """Stops recording and closes this rank's file. With merge=True (collective), rank 0 then
    writes every rank's events into one file (`out`, default the path given to start) and
    returns its path; other ranks return None."""
    global _on, _paths
    if not _on:
        return None
    st = _runtime.state()
    _C.timeline_stop(st.ctx)
    paths, _paths, _on = _paths, None, False
    if not merge:
        return None
    from .collectives import barrier

    barrier()  # every rank has closed its file
    if st.env.rank != 0:
        return None
    target = os.fspath(out) if out is not None else _base(paths["base"]) + ".json"
    return merge_files([rank_path(paths["base"], r) for r in builtins.range(st.env.size)], target)


def is_recording() -> bool:
    """Whether a timeline is recording in this process (between start() and stop())."""
    return _on


def path() -> Optional[str]:
    """This rank's trace file while recording, else None."""
    return _paths["rank"] if _on else None


@contextlib.contextmanager
def record(path: Union[str, os.PathLike], merge: bool = False):
    """``with rumor.timeline.record(path):`` start on entry, stop (and optionally merge) on exit."""
    start(path)
    try:
        yield
    finally:
        stop(merge=merge)


def _encode_args(what: str, args: dict) -> str:
    if not args:
        return ""
    try:
        return json.dumps(args, separators=(",", ":"), default=str)[1:-1]
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: args must be JSON-serialisable: {e}") from None


class range:  # noqa: A001 - the API's name (rumor.timeline.range)
    """``with rumor.timeline.range("data"):`` a user span on this thread's track. Costs a bool
    test when no timeline is recording. Extra keyword arguments become the event's args.
    An instance also decorates a function: ``@rumor.timeline.range("step")`` records each call.

    Args:
        name: the span's name (str).
        **args: JSON-serialisable values shown as the event's args.

    Raises:
        TypeError: name is not a str; when the span is recorded, args that are not
            JSON-serialisable.
    """

    __slots__ = ("name", "args", "_t0")

    def __init__(self, name: str, **args):
        if not isinstance(name, str):
            raise TypeError(f"rumor.timeline.range(): name must be a str, got {type(name).__name__}")
        self.name = name
        self.args = args
        self._t0 = None

    def __enter__(self):
        self._t0 = _C.trace_now_us() if _on else None
        return self

    def __exit__(self, *exc):
        if self._t0 is not None and _on:
            t1 = _C.trace_now_us()
            _emit(self.name, "user", self._t0, t1 - self._t0, "X", _encode_args("rumor.timeline.range", self.args))
        return False

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapped(*a, **k):
            with range(self.name, **self.args):
                return fn(*a, **k)

        return wrapped


def instant(name: str, **args) -> None:
    """A point event on this thread's track; does nothing when no timeline is recording.

    Args:
        name: the event's name (str).
        **args: JSON-serialisable values shown as the event's args.

    Raises:
        TypeError: args are not JSON-serialisable (only checked while recording).
    """
    if _on:
        _emit(name, "user", _C.trace_now_us(), 0.0, "i", _encode_args("rumor.timeline.instant", args))


def _emit(name: str, cat: str, ts_us: float, dur_us: float, ph: str = "X", args: str = "") -> None:
    st = _runtime._state
    if st is not None:
        _C.timeline_emit(st.ctx, name, cat, ts_us, dur_us, ph, args)


def _span_s(name: str, cat: str, t0_s: float, t1_s: float, args: str = "") -> None:
    """A span from two time.monotonic() stamps (the steady clock the C++ side uses too)."""
    _emit(name, cat, t0_s * 1e6, (t1_s - t0_s) * 1e6, "X", args)


def flight_records() -> List[dict]:
    """This rank's last operations, oldest first: seq, name, comm, tag, bytes, peer, ranks, state
    (queued/running/done/failed), queued/started/ended (time.monotonic() seconds or None), error."""
    return _C.flight_records(_runtime.state().ctx)


def dump_flight_records(why: str = "requested") -> None:
    """Writes the flight recorder to the log (warn level) and, when recording, to the trace.

    Args:
        why: the reason printed with the dump (default "requested").

    Raises:
        RuntimeError: rumor.init() has not run.
    """
    _C.flight_dump(_runtime.state().ctx, str(why))


# ---- reading and merging -----------------------------------------------------------------------

def load(path: Union[str, os.PathLike]) -> List[dict]:
    """Reads a trace file, also one cut short by a killed process (its array lacks only the
    closing bracket, which is what Perfetto and chrome://tracing accept too).

    Args:
        path: the trace file (str or os.PathLike).

    Returns:
        The trace's events, a list of dicts in the Chrome trace event format.

    Raises:
        ValueError: the file is not a JSON-array trace, or its JSON is malformed.
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read().rstrip()
    if not text.startswith("["):
        raise ValueError(f"rumor.timeline.load(): {path} is not a JSON-array trace")
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    return json.loads(text)


def _clock_of(events: List[dict], path: str):
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "rumor_clock":
            return int(e["args"]["rank"]), float(e["args"]["offset_us"])
    raise ValueError(f"rumor.timeline.merge(): {path} has no rumor_clock record (not written by rumor?)")


def merge_files(paths: Union[str, Iterable[str]], out: Union[str, os.PathLike]) -> str:
    """Merges per-rank files (a list, or a glob pattern) into `out`: one process per rank
    ("rank r"), every timestamp moved onto rank 0's clock. Returns out. Also available as
    rumor.timeline.merge.

    Args:
        paths: the per-rank trace files: a list of paths, or one glob pattern such as
            "trace.rank*.json".
        out: the merged trace to write (replaced atomically).

    Returns:
        out, as a str.

    Raises:
        ValueError: no file matches or none is given, a file is not a rumor trace (no clock
            record), or two files are the same rank's.
    """
    if isinstance(paths, (str, os.PathLike)):
        found = sorted(_glob.glob(os.fspath(paths)))
        if not found:
            raise ValueError(f"rumor.timeline.merge(): no file matches {os.fspath(paths)!r}")
        paths = found
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise ValueError("rumor.timeline.merge(): no input files")
    merged: List[dict] = []
    seen = {}
    for p in paths:
        events = load(p)
        rank, offset = _clock_of(events, p)
        if rank in seen:
            raise ValueError(f"rumor.timeline.merge(): {p} and {seen[rank]} are both rank {rank}")
        seen[rank] = p
        for e in events:
            if "ts" in e:
                e["ts"] = round(e["ts"] - offset, 3)
            e["pid"] = rank
            merged.append(e)
    tmp = os.fspath(out) + ".tmp"
    with open(tmp, "w") as f:
        f.write("[\n")
        f.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in merged))
        f.write("\n]\n")
    os.replace(tmp, out)
    return os.fspath(out)


merge = merge_files


def _start_from_env() -> None:
    """rumor.init(): RUMOR_TIMELINE=path starts recording on every rank."""
    path = os.environ.get("RUMOR_TIMELINE")
    if path:
        start(path)


def _stop_at_shutdown(state) -> list:
    stop()
    return []


_runtime.on_init(_start_from_env)
_runtime.on_shutdown(_stop_at_shutdown)


def _main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m rumor.timeline",
                                 description="Merge per-rank rumor timelines into one Chrome trace.")
    ap.add_argument("inputs", nargs="+", help="per-rank files, or a glob pattern such as 'trace.rank*.json'")
    ap.add_argument("-o", "--out", required=True, help="merged trace to write")
    a = ap.parse_args(argv)
    ins = a.inputs[0] if len(a.inputs) == 1 else a.inputs
    print(merge_files(ins, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

# The public names; everything else here is this module's own business.
__all__ = [
    "DEFAULT_FLIGHT_RECORDS", "dump_flight_records", "flight_records", "instant",
    "is_recording", "load", "merge", "merge_files", "path", "range", "rank_path", "record",
    "start", "stop",
]
