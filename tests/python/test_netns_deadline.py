"""Progress deadlines (issue 46, csrc/net/stall.h) between two emulated hosts (rumor.testing.netns).

- A slow link: an allreduce that takes several times RUMOR_TIMEOUT completes, exactly, because
  bytes keep moving; the same allreduce with RUMOR_ADAPTIVE_DEADLINE=0 (the whole-op deadline of
  before) times out, so the link really is slow enough for the first half to mean something.
- A peer stopped (SIGSTOP) in the middle of a large message: the survivor's error names it and
  the rule, and arrives before the RUMOR_TIMEOUT ceiling (no tighter timing is asserted).

One rank per host, so every byte goes over TCP through a rate-limited link. Skipped, with the
reason, where network namespaces cannot be built. Every run has a deadline; on it every rank is
killed and the test fails with each rank's output.
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
PORT = 29500             # inside host 0's fresh namespace nothing else listens
RATE = "20mbit"          # each host's egress: 2.5 MB/s
INIT_TIMEOUT_S = 60      # rendezvous and the first connections, before the deadline under test
SLOW_TIMEOUT_S = 3       # RUMOR_TIMEOUT for the slow-link allreduce
SLOW_COUNT = 6 << 20     # float32: 24 MiB, about 10 s each way at RATE (ring: the whole buffer)
STOP_TIMEOUT_S = 120     # the ceiling in the stopped-peer case
STOP_FLOOR_S = 2         # RUMOR_DEADLINE_FLOOR there
STOP_COUNT = 8 << 20     # 32 MiB: the victim stops after a few MiB of it
STOP_AFTER_BYTES = 2 << 20
RUN_DEADLINE_S = 100     # a whole run; below STOP_TIMEOUT_S, so a fixed deadline would miss it

_BOOT = "import sys; sys.path.insert(0, {here!r}); import test_netns_deadline as t; t._rank_main()"


def _need_netns():
    from rumor.testing import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(f"emulated hosts need Linux network namespaces: {why}")


# ---- inside a rank -------------------------------------------------------------------------------

def _input(n: int, rank: int):
    """Integer-valued float32 in [-30, 30]: the sum over two ranks is exact."""
    import torch

    i = torch.arange(n, dtype=torch.int64)
    return (((i * 7 + rank * 13) % 61) - 30).to(torch.float32)


def _tx_bytes(ifname: str = "eth0") -> int:
    # This process's namespace: the emulated host's own interface.
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                return int(rest.split()[8])
    raise RuntimeError(f"no {ifname} in /proc/self/net/dev")


def _stop_self_after(nbytes: int) -> None:
    """SIGSTOPs this process once its host has sent nbytes more: the allreduce is then
    mid-message, whatever the scheduling (no sleep decides it)."""
    import signal
    import threading

    base = _tx_bytes()

    def watch():
        end = time.monotonic() + RUN_DEADLINE_S
        while _tx_bytes() - base < nbytes:
            if time.monotonic() > end:
                return
            time.sleep(0.01)
        print("victim: stopping itself", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)

    threading.Thread(target=watch, daemon=True).start()


def _rank_main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(RUN_DEADLINE_S - 5, exit=True)
    import torch

    import rumor

    rank = int(os.environ["RANK"])
    scenario = os.environ["DEADLINE_TEST_SCENARIO"]
    out = {"rank": rank, "scenario": scenario}
    rumor.init(timeout=INIT_TIMEOUT_S)
    rumor.allreduce(torch.ones(4))  # connected, both ranks here
    if scenario in ("slow", "slow-fixed"):
        rumor.set_timeout(SLOW_TIMEOUT_S)
        x = _input(SLOW_COUNT, rank)
        expected = (_input(SLOW_COUNT, 0).double() + _input(SLOW_COUNT, 1).double()).float()
        t0 = time.monotonic()
        try:
            y = rumor.allreduce(x, op=rumor.ReduceOp.SUM)
            out.update(ok=True, exact=bool(torch.equal(y, expected)))
        except rumor.RumorError as e:
            out.update(ok=False, error=type(e).__name__, message=str(e))
        out["elapsed"] = time.monotonic() - t0
    elif scenario == "stop":
        rumor.set_timeout(STOP_TIMEOUT_S)
        x = _input(STOP_COUNT, rank)
        t0 = time.monotonic()
        if rank == 1:
            _stop_self_after(STOP_AFTER_BYTES)
        try:
            rumor.allreduce(x, op=rumor.ReduceOp.SUM)
            out.update(ok=True)
        except rumor.RumorError as e:
            out.update(ok=False, error=type(e).__name__, message=str(e))
        out["elapsed"] = time.monotonic() - t0
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of torch/rumor threads (a failed op aborted them)


# ---- the test (pytest process) -------------------------------------------------------------------

def _run(tmp_path, scenario: str, extra_env: dict, wait_for=(0, 1)):
    """Runs both ranks on their own emulated hosts; returns each rank's RESULT dict (None if it
    printed none) once the ranks in wait_for have exited; the others are killed then."""
    from rumor.testing import launch, netns

    env = dict(extra_env, DEADLINE_TEST_SCENARIO=scenario)
    argv = [sys.executable, "-c", _BOOT.format(here=HERE)]
    logdir = tmp_path / scenario
    logdir.mkdir()
    with netns.Cluster(WORLD, rate=RATE) as cluster, \
            launch.Ranks(argv, WORLD, cluster=cluster, env=env, port=PORT,
                         logdir=str(logdir)) as ranks:
        deadline = time.monotonic() + RUN_DEADLINE_S
        while any(ranks.procs[r].poll() is None for r in wait_for) and time.monotonic() < deadline:
            time.sleep(0.05)
        late = [r for r in wait_for if ranks.procs[r].poll() is None]
        ranks.kill()  # the stopped rank, and any rank still running at the deadline
        outputs = [ranks.log(r) for r in range(WORLD)]
        codes = [p.returncode for p in ranks.procs]
    results = []
    for text in outputs:
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        results.append(json.loads(lines[-1][len("RESULT "):]) if lines else None)
    dump = "\n".join(f"===== rank {r} =====\n{outputs[r][-4000:]}" for r in range(WORLD))
    if late:
        pytest.fail(f"{scenario}: rank(s) {late} still running after {RUN_DEADLINE_S} s\n{dump}", pytrace=False)
    for r in wait_for:
        if results[r] is None:
            pytest.fail(f"{scenario}: rank {r} reported no result (exit code {codes[r]})\n{dump}", pytrace=False)
    return results, dump


def test_slow_link_completes_past_the_fixed_deadline(tmp_path):
    _need_netns()
    res, dump = _run(tmp_path, "slow", {})
    for r in range(WORLD):
        assert res[r]["ok"], f"rank {r}: {res[r]}\n{dump}"
        assert res[r]["exact"], f"rank {r}: the allreduce result differs from the float64 reference\n{dump}"
        # Completion after the old deadline is the point: a link fast enough to finish within it
        # would test nothing.
        assert res[r]["elapsed"] > SLOW_TIMEOUT_S, f"rank {r}: the link was not slow enough: {res[r]}"
    # The reference: the same transfer under the whole-op deadline fails at RUMOR_TIMEOUT.
    res, dump = _run(tmp_path, "slow-fixed", {"RUMOR_ADAPTIVE_DEADLINE": "0"})
    assert not any(res[r]["ok"] for r in range(WORLD)), f"the fixed deadline did not expire\n{dump}"
    timed_out = [r for r in range(WORLD) if res[r]["error"] == "CommTimeoutError"]
    assert timed_out, f"no rank timed out: {res}"
    for r in timed_out:
        assert f"timed out after {SLOW_TIMEOUT_S:.6f} s waiting for rank {1 - r}" in res[r]["message"], res[r]


def test_peer_stopped_mid_message_reported_before_the_ceiling(tmp_path):
    _need_netns()
    # Only the survivor is waited for; the stopped rank is killed afterwards.
    res, dump = _run(tmp_path, "stop", {"RUMOR_DEADLINE_FLOOR": str(STOP_FLOOR_S)}, wait_for=(0,))
    r0 = res[0]
    assert not r0["ok"] and r0["error"] == "CommTimeoutError", f"{r0}\n{dump}"
    msg = r0["message"]
    assert "allreduce" in msg and "rank 1 stopped in the middle of a message" in msg, msg
    # The rule's numbers: idle time, bytes outstanding, the link, floor and ceiling.
    for part in ("no byte for", "outstanding", "link to rank 1", "RTT", f"floor {STOP_FLOOR_S} s",
                 f"ceiling {STOP_TIMEOUT_S} s"):
        assert part in msg, f"{part!r} missing from: {msg}"
    assert r0["elapsed"] < STOP_TIMEOUT_S, r0  # before the ceiling (ordering only)
