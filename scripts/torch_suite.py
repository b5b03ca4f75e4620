#!/usr/bin/env python
"""Runs torch's own generic distributed tests (DistributedTest._DistTestBase, the class torch's
test_distributed_spawn.py runs for gloo) on the "rumor" backend and, in the same run, on gloo as
the reference; writes a JSON summary and prints pass/fail counts (issue 43). Not part of
scripts/test.sh: the 285 tests take minutes on each backend.

    PYTHONPATH=python python scripts/torch_suite.py        # every test: rumor, rumor-as-gloo, gloo
    PYTHONPATH=python python scripts/torch_suite.py -k "all_reduce or barrier"
    PYTHONPATH=python python scripts/torch_suite.py --backends rumor --world-size 3

BACKEND=rumor runs the tests torch's suite allows a plugin backend (CPU, DDP and subgroups);
"rumor-as-gloo" runs the suite as for gloo (BACKEND=gloo, so also the tests it keeps for gloo
by name) with every group it makes on rumor; gloo itself is the reference.

Each backend runs one pytest of scripts/torch_suite_tests.py with BACKEND, WORLD_SIZE and
TEMP_DIR set as torch's suite expects; DISTRIBUTED_TESTS_DEFAULT_TIMEOUT (--timeout) is the
suite's own deadline per test, after which it fails the test and ends its ranks. Ranks are
forked from the pytest process (TORCH_SUITE_START=spawn: spawned, as torch's CI does, about 30 s
a test on a loaded 2-core machine instead of about 1 s). Needs
`expecttest` (torch's test utilities import it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SUITE = os.path.join(HERE, "torch_suite_tests.py")

# An exception's "Type: message" line; the suite wraps each failed rank's traceback in
# "Process N exited with error code 10 and exception:".
_EXC = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Failure|Exit|Timeout)\w*)(?::\s?(.*))?$")
_WRAPPER = re.compile(r"Process \d+ (?:exited with error code|terminated or timed out)")


def first_error_line(message: str, text: str) -> str:
    """What the first failed rank raised last (after any exception it was handling), as
    'Type: message'; else the report's first line."""
    lines = [re.sub(r"^E\s+", "", raw).strip() for raw in (message or text or "").splitlines()]
    found = ""
    for i, line in enumerate(lines):
        if _WRAPPER.search(line):
            if found:
                break
            continue
        if _EXC.match(line):
            found = line
    if found:
        return found[:300]
    return next((line[:300] for line in lines if line), "")


def parse_junit(path: str) -> dict:
    """{test name: {"outcome": passed|failed|error|skipped, "time_s", "error"}} of one run."""
    tests = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name")
        out = {"outcome": "passed", "time_s": round(float(case.get("time") or 0), 2)}
        for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                out["outcome"] = outcome
                out["error"] = first_error_line(el.get("message", ""), el.text or "")
                break
        # pytest reports a teardown error as a second entry of the same test; the worse wins.
        if name in tests and tests[name]["outcome"] != "passed":
            continue
        tests[name] = out
    return tests


def run_backend(backend: str, args, logdir: str) -> dict:
    tmp = tempfile.mkdtemp(prefix=f"torch-suite-{backend}-")
    os.makedirs(os.path.join(tmp, "barrier"))
    env = dict(os.environ)
    # "rumor-as-gloo": the suite runs its gloo tests, every group it makes is rumor's.
    name, _, as_ = backend.partition("-as-")
    suite_backend, substitute = (as_, name) if as_ else (backend, "")
    env.update(BACKEND=suite_backend, TORCH_SUITE_AS=substitute, WORLD_SIZE=str(args.world_size), TEMP_DIR=tmp,
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.timeout), PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "python"), env.get("PYTHONPATH")) if p)
    xml = os.path.join(logdir, f"{backend}.xml")
    log = os.path.join(logdir, f"{backend}.log")
    cmd = [sys.executable, "-m", "pytest", SUITE, "-p", "no:cacheprovider", "-q", "-rN",
           f"--junitxml={xml}", "-o", "junit_logging=no"]
    if args.k:
        cmd += ["-k", args.k]
    print(f"[{backend}] world size {args.world_size}, {args.timeout} s a test; log {log}", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    if not os.path.exists(xml):
        raise SystemExit(f"[{backend}] pytest wrote no report (exit {rc}); see {log}")
    tests = parse_junit(xml)
    counts = {k: sum(1 for t in tests.values() if t["outcome"] == k) for k in ("passed", "failed", "error", "skipped")}
    print(f"[{backend}] {len(tests)} tests in {wall:.0f} s: " + ", ".join(f"{v} {k}" for k, v in counts.items()), flush=True)
    return {"backend": backend, "pytest_exit": rc, "wall_s": round(wall, 1), "counts": counts, "tests": tests}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="rumor,rumor-as-gloo,gloo",
                    help="comma-separated; the last is the reference. X-as-Y runs the suite's tests for Y "
                         "with every group made on X (default: rumor,rumor-as-gloo,gloo)")
    ap.add_argument("-k", default="", help="pytest -k expression selecting tests")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=120, help="seconds a test may run (the suite's own deadline)")
    ap.add_argument("--json", default=os.path.join(ROOT, "docs", "benchmarks", "torch_suite.json"))
    ap.add_argument("--logdir", default="", help="where pytest's logs and JUnit XML go (default: a temporary folder)")
    args = ap.parse_args()
    logdir = args.logdir or tempfile.mkdtemp(prefix="torch-suite-logs-")
    os.makedirs(logdir, exist_ok=True)
    import torch

    backends = [b for b in args.backends.split(",") if b]
    runs = [run_backend(b, args, logdir) for b in backends]
    summary = {
        "argv": sys.argv, "torch": torch.__version__, "world_size": args.world_size, "k": args.k, "timeout_s": args.timeout,
        "start": os.environ.get("TORCH_SUITE_START", "fork"), "load_avg": os.getloadavg(), "runs": runs,
    }
    if len(runs) > 1:
        ref = runs[-1]
        for run in runs[:-1]:
            run["not_passed_where_reference_passed"] = sorted(
                n for n, t in run["tests"].items()
                if t["outcome"] in ("failed", "error") and ref["tests"].get(n, {}).get("outcome") == "passed")
            run["passed_where_reference_skipped"] = sorted(
                n for n, t in run["tests"].items()
                if t["outcome"] == "passed" and ref["tests"].get(n, {}).get("outcome") == "skipped")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
    for run in runs:
        c = run["counts"]
        print(f"{run['backend']}: passed {c['passed']}, failed {c['failed']}, errors {c['error']}, skipped {c['skipped']}")
        for n in run.get("not_passed_where_reference_passed", []):
            print(f"  {run['backend']} fails where {runs[-1]['backend']} passes: {n}: {run['tests'][n].get('error', '')}")
    print(f"summary: {args.json}; logs: {logdir}")


if __name__ == "__main__":
    main()
