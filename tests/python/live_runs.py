"""What the live-membership tests (test_live*.py) read back from a run and check of it.

Each worker of those tests appends one JSON line per step it applied to <id>.log ({"step",
"size", "pid", ...}) and, when it ends training, writes <id>.final.json ({"pid", "changes",
"params"}). These helpers load them and make the checks every such test starts with.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Tuple


def read_log(path) -> List[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load(out) -> Tuple[Dict[str, List[dict]], Dict[str, dict]]:
    """The run's logs and finals, by worker id (r0, j1, ...)."""
    logs = {f[:-4]: read_log(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".log")}
    finals = {}
    for f in os.listdir(out):
        if f.endswith(".final.json"):
            with open(os.path.join(out, f)) as fh:
                finals[f[:-len(".final.json")]] = json.load(fh)
    return logs, finals


def check_steps_unique(logs: Dict[str, List[dict]]) -> None:
    """No process applied a step twice. (A member that failed a step another member applied gets
    that member's state and goes on after it, so it may skip that one.)"""
    for m, entries in logs.items():
        steps = [e["step"] for e in entries]
        assert steps == sorted(set(steps)), (m, steps)


def check_stayed(logs, finals, members: Iterable[str], total: int, every_step: bool = True) -> None:
    """members trained in their first process to the end: every step 0..total-1 (every_step), or
    at least up to the last one."""
    for m in members:
        assert {e["pid"] for e in logs[m]} == {finals[m]["pid"]}, m
        if every_step:
            assert [e["step"] for e in logs[m]] == list(range(total)), m
        else:
            assert logs[m][-1]["step"] == total - 1, m


def load_and_check(out, text: str, members: Iterable[str], stayed: Iterable[str], total: int,
                   every_step: bool = True):
    """load, then: the processes that ended training are exactly members (text, the launchers'
    output, is shown otherwise), no step was applied twice by one process, and the stayed
    members trained in their first process (check_stayed). Returns (logs, finals)."""
    logs, finals = load(out)
    assert sorted(finals) == sorted(members), text[-6000:]
    check_steps_unique(logs)
    check_stayed(logs, finals, stayed, total, every_step)
    return logs, finals


def sizes_by_step(logs: Dict[str, List[dict]], total: int) -> List[int]:
    """The world size of every step 0..total-1, asserting each was applied by some process and
    that all who applied it agree on how many averaged it."""
    by_step: Dict[int, set] = {}
    for entries in logs.values():
        for e in entries:
            by_step.setdefault(e["step"], set()).add(e["size"])
    assert sorted(by_step) == list(range(total)) and all(len(v) == 1 for v in by_step.values()), by_step
    return [by_step[s].pop() for s in range(total)]
