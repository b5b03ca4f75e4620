"""Running a cell on the ranks: streaming each rank's output with its "[rank r]" prefix, the
cell's deadline (rumor's own, then SIGINT), noticing ranks that die, and turning what failed
into a RankError. CellsMixin is the part of Session that does it."""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from . import _engine_side
from ._errors import _COMM_ERRORS, _rank_error, _remote_parts
from ._launch import _tail

@dataclass
class _Running:
    """The cell the session last sent to the engines (for %rumor_status)."""
    ranks: List[int]
    summary: str
    started: float
    ar: object = None



def _msg_done(ar, i: int) -> bool:
    return ar.msg_ids[i] not in ar._client.outstanding


class CellsMixin:
    """Session's cells and status (Session holds the state these methods use)."""

    def check_usable(self) -> None:
        """Refuses a session whose engines must be restarted.

        Raises:
            RuntimeError: a rank died or would not stop (dead is set); the message says why and
                to run rumor.interactive.restart().
        """
        if self.dead:
            raise RuntimeError(f"rumor.interactive: {self.dead}; run rumor.interactive.restart()")

    def execute(self, code: str, ranks: Optional[List[int]] = None, timeout: Optional[float] = None,
                prefix: bool = True, out=None, err=None) -> list:
        """Runs code on the given ranks (default all), streaming each rank's output with a
        "[rank r]" prefix. Returns each rank's execute_result text (or None). Raises RankError
        with the first failing rank's traceback first.

        A rank still busy 10 s after the deadline is sent SIGINT; one that does not stop 5 s
        later, or that died, leaves the session dead (restart() needed).

        Args:
            code: the Python source to run on every given rank.
            ranks: the ranks to run it on, as a list of ints; None (the default) means all.
            timeout: rumor's deadline in seconds for the cell's blocking waits on the engines;
                None (the default) uses the session's timeout.
            prefix: if True (the default), each output line is prefixed with "[rank r] ".
            out: the stream stdout lines and results are written to; None (the default) means
                sys.stdout.
            err: the stream stderr lines are written to; None (the default) means sys.stderr.

        Returns:
            A list, one entry per given rank in order: the text of the cell's last expression
            value, or None where there is none.

        Raises:
            RuntimeError: the session is dead (check_usable).
            RankError: the cell failed, died or timed out on some rank.
        """
        self.check_usable()
        out = out or sys.stdout
        err = err or sys.stderr
        ranks = list(range(self.n)) if ranks is None else list(ranks)
        # rumor's own deadline follows the cell's limit, so that a collective some rank skipped
        # fails on every rank inside the cell (set on every rank: a cell on some ranks may still
        # talk to the others, whose deadline must match).
        deadline = self.timeout if timeout is None else float(timeout)
        limit = deadline + 10.0  # rumor's own error first; then ranks still busy are interrupted
        if deadline != self.rank_deadline:
            ars = [self.client[eid].apply_async(_engine_side.set_timeout, deadline) for eid in self.engine_ids]
            self._gather(ars, 30.0, "setting the cell's deadline")
            self.rank_deadline = deadline
        view = self.client[[self.engine_ids[r] for r in ranks]]
        view.block = False
        self.cells += 1
        first_line = next((ln.strip() for ln in code.splitlines() if ln.strip()), "")
        ar = view.execute(code, silent=False, block=False)
        self.running = _Running(ranks, first_line[:60], time.monotonic(), ar)
        shown = {r: [0, 0] for r in ranks}
        died: Dict[int, str] = {}
        timed_out: List[int] = []

        def flush(final: bool) -> None:
            for i, r in enumerate(ranks):
                md = ar.metadata[i]
                for k, (key, stream) in enumerate((("stdout", out), ("stderr", err))):
                    text = md.get(key) or ""
                    new = text[shown[r][k]:]
                    if not final:
                        cut = new.rfind("\n")
                        new = new[: cut + 1] if cut >= 0 else ""
                    if new:
                        shown[r][k] += len(new)
                        lines = new.splitlines()
                        tag = f"[rank {r}] " if prefix else ""
                        stream.write("".join(f"{tag}{ln}\n" for ln in lines))
                        stream.flush()

        start = time.monotonic()
        interrupted_at = None
        while True:
            pending = [i for i, _ in enumerate(ranks) if not _msg_done(ar, i)]
            flush(False)
            for i in pending:
                r = ranks[i]
                if r not in died and not self.rank_alive(r):
                    died[r] = self._died_message(r)
            pending = [i for i in pending if ranks[i] not in died]
            if not pending:
                break
            now = time.monotonic()
            if interrupted_at is None and now - start > limit:
                # Python code stops at the KeyboardInterrupt; a rank inside a rumor wait
                # returns at rumor's own deadline (start(timeout=...)).
                timed_out = [ranks[i] for i in pending]
                for r in timed_out:
                    self.interrupt(r)
                interrupted_at = now
            if interrupted_at is not None and now - interrupted_at > 5.0:
                break
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:
                # The notebook's interrupt button: pass it on to the ranks still running.
                for i in pending:
                    self.interrupt(ranks[i])
                raise
        flush(True)
        # The hub may have answered for a dead engine (EngineError) before we saw it die; where a
        # launcher runs the engine (another host), that process ends a moment after the engine.
        for i, r in enumerate(ranks):
            if r not in died and (not self.rank_alive(r) or (self._engine_lost(ar, i) and self._gone_within(r, 5.0))):
                died[r] = self._died_message(r)
        still = [ranks[i] for i, _ in enumerate(ranks) if not _msg_done(ar, i) and ranks[i] not in died]
        if not still:
            self.running = None
        results, failures, order = [], {}, []
        for i, r in enumerate(ranks):
            if r in died:
                failures[r] = ("EngineDied", died[r], "")
                order.append((0, 0.0, r))
                results.append(None)
                continue
            if r in still:
                failures[r] = ("CellTimeout", f"rank {r} is still busy {limit:.0f} s after the cell started "
                                              "and did not stop on SIGINT", "")
                order.append((3, 0.0, r))
                results.append(None)
                continue
            md = ar.metadata[i]
            exc = None
            if md.get("status") == "error":
                exc = md.get("error") or self.client.results.get(ar.msg_ids[i])
                if not isinstance(exc, BaseException):
                    exc = RuntimeError("the engine reported an error without details")
            if exc is not None:
                name, msg, tb = _remote_parts(exc)
                if r in timed_out and name == "KeyboardInterrupt":
                    name, msg = "CellTimeout", f"interrupted after the cell's {limit:.0f} s limit"
                failures[r] = (name, msg, tb)
                # Errors that are consequences of another rank's failure go last.
                rank_of = 2 if name in _COMM_ERRORS else (1 if name != "CellTimeout" else 3)
                t = md.get("completed")
                order.append((rank_of, t.timestamp() if t else 0.0, r))
                results.append(None)
            else:
                er = md.get("execute_result") or {}
                results.append((er.get("data") or {}).get("text/plain"))
                if results[-1] is not None:
                    tag = f"[rank {r}] " if prefix else ""
                    out.write(f"{tag}Out: {results[-1]}\n")
        if died:
            self.dead = "rank(s) " + ", ".join(str(r) for r in sorted(died)) + " died"
        elif still:
            self.dead = "rank(s) " + ", ".join(str(r) for r in still) + " did not stop after the cell timeout"
        elif any(f[0] in _COMM_ERRORS for f in failures.values()):
            self.broken = "a rumor operation failed in cell " + str(self.cells)
        if failures:
            order.sort()
            first = order[0][2]
            raise _rank_error(failures, first, [o[2] for o in order], self.n, self.dead, self.broken)
        return results

    def _engine_lost(self, ar, i: int) -> bool:
        """Whether the reply for ar's i-th engine is the hub's stand-in for an engine that left:
        an error with no exception of the cell's own, or ipyparallel's EngineError."""
        md = ar.metadata[i]
        if md.get("status") != "error":
            return False
        exc = md.get("error") or self.client.results.get(ar.msg_ids[i])
        return not isinstance(exc, BaseException) or _remote_parts(exc)[0] == "EngineError"

    def _gone_within(self, r: int, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.rank_alive(r):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _died_message(self, r: int) -> str:
        where = f" on host {self.host_of(r)!r}" if self.layout is not None else ""
        msg = f"rank {r} (engine pid {self.pids[r]}{where}) died during this cell"
        p = self.procs[r] if r < len(self.procs) else None
        if p is None:
            return msg + self._exit_note(self.pids[r])
        if p.returncode is not None and p.returncode < 0:
            msg += f" (its launcher was killed by {signal.Signals(-p.returncode).name})"
        elif p.returncode is not None:
            msg += f" (exit code {p.returncode})"
        tail = _tail(self.logs[r], 300)
        return msg + (f"; its last output: {tail}" if tail else "")

    @staticmethod
    def _exit_note(pid: int) -> str:
        # The launcher that started the engine reaps it; it knows the exit status.
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return ""
        if reaped != pid:
            return ""
        if os.WIFSIGNALED(status):
            return f" (killed by {signal.Signals(os.WTERMSIG(status)).name})"
        if os.WIFEXITED(status):
            return f" (exit code {os.WEXITSTATUS(status)})"
        return ""

    # ---- status -------------------------------------------------------------------------
    def _busy_engines(self, settle_s: float = 2.0) -> set:
        """Engine ids the controller counts a queued or running task for.

        The hub learns that a task ended from the engine's own report, which can reach it after
        the result has reached this client: right after a pull or a push returned, the hub may
        still count that task. While this client awaits nothing, a count is that lag (or another
        client's work), so it is asked again until the count clears or settle_s has passed.
        """
        deadline = time.monotonic() + settle_s
        while True:
            try:
                qs = self.client.queue_status()
            except Exception:  # noqa: BLE001  (status is best effort: an unreachable hub shows idle)
                return set()
            busy = {eid for eid, q in qs.items() if isinstance(q, dict) and (q.get("queue", 0) or q.get("tasks", 0))}
            if not busy or self.client.outstanding or time.monotonic() >= deadline:
                return busy
            time.sleep(0.05)

    def status(self) -> List[dict]:
        """One row per rank, as %rumor_status shows it.

        Returns:
            A list of dicts with keys rank, host, pid, engine (the engine id) and state:
            "idle", "busy" (with how long and the cell's first line when it is this session's
            cell) or "dead".
        """
        rows = []
        busy_ids = self._busy_engines()
        run = self.running
        if run is not None and all(_msg_done(run.ar, i) for i in range(len(run.ranks))):
            self.running = run = None
        for r in range(self.n):
            pid = self.pids[r] if r < len(self.pids) else 0
            if not pid or not self.rank_alive(r):
                state = "dead"
            elif run is not None and r in run.ranks and not _msg_done(run.ar, run.ranks.index(r)):
                state = f"busy {time.monotonic() - run.started:.0f} s: {run.summary}"
            elif self.engine_ids[r] in busy_ids:
                state = "busy"
            else:
                state = "idle"
            rows.append({"rank": r, "host": self.hosts[r] if r < len(self.hosts) else "?", "pid": pid,
                         "engine": self.engine_ids[r], "state": state})
        return rows

