"""The one-host direct allreduce (csrc/comm/direct.h) with a rank descheduled by force: a rank
stops itself (SIGSTOP) right after it started a large allreduce, rank 0 resumes it a while later.
The running ranks take the stopped rank's share of the work meanwhile; the result must still be
exact and nothing may time out early. Also: the ring (algorithm="ring") gives the same bits."""
from __future__ import annotations

import harness

SIZE = (16 << 20) // 4 + 3  # many chunks, and a partial last one
STOP_S = 2.0


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def stopped_peer_rank(rounds: int):
    import os
    import signal
    import time

    import torch

    import rumor

    rumor.init()
    r, n = rumor.rank(), rumor.size()
    pids = rumor.allgather(torch.tensor([os.getpid()], dtype=torch.int64)).tolist()
    base = torch.arange(SIZE, dtype=torch.float64) % 1009
    expected = sum(base + 3 * q for q in range(n)).to(torch.float32)  # integers: exact
    for k in range(rounds):
        x = (base + 3 * r).to(torch.float32)
        h = rumor.allreduce_nonblocking(x, op=rumor.ReduceOp.SUM)
        if r == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # stopped with its collective in flight
        elif r == 0:
            deadline = time.monotonic() + 30
            while _state(pids[1]) != "T":
                assert time.monotonic() < deadline, "rank 1 never stopped"
                time.sleep(0.01)
            time.sleep(STOP_S)  # keep it stopped while the others work
            os.kill(pids[1], signal.SIGCONT)
        out = h.wait()
        if not torch.equal(out, expected):
            bad = (out != expected).nonzero()
            raise AssertionError(f"round {k}: rank {r}: {len(bad)} wrong elements, first at {int(bad[0])}: "
                                 f"{float(out[bad[0]])} != {float(expected[bad[0]])}")
        ring = (base + 3 * r).to(torch.float32)
        rumor.allreduce_(ring, op=rumor.ReduceOp.SUM, algorithm="ring")
        assert torch.equal(ring, out), f"round {k}: rank {r}: the ring's result differs from the direct one"
    return True


def test_stopped_rank_mid_allreduce_three_ranks():
    # RUMOR_TIMEOUT well above the stop: a wait that gave up early would fail the test.
    res = harness.run(stopped_peer_rank, 3, timeout=120, env={"RUMOR_TIMEOUT": "30"}, args=(2,))
    assert res == [True, True, True]
