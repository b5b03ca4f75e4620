"""The one-host direct allreduce (csrc/comm/direct.h) with a rank descheduled by force: a rank
stops itself (SIGSTOP) right after it started a large allreduce, rank 0 resumes it a while later.
The running ranks take the stopped rank's share of the work meanwhile; the result must still be
exact and nothing may time out early. Also: the ring (algorithm="ring") gives the same bits."""
from __future__ import annotations

import pytest

import harness

SIZE = (16 << 20) // 4 + 3  # many chunks, and a partial last one
STOP_S = 2.0


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages of the mapping holding addr (/proc/self/smaps), in kB."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return -1


def _collapse_possible() -> bool:
    """MADV_COLLAPSE exists (Linux 6.1) and transparent huge pages are not "never"."""
    import os

    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            never = "[never]" in f.read()
    except OSError:
        return False
    return (major, minor) >= (6, 1) and not never


def stopped_peer_rank(rounds: int, same_buffer: bool = False, size: int = SIZE):
    import os
    import signal
    import time

    import torch

    import rumor

    rumor.init()
    r, n = rumor.rank(), rumor.size()
    pids = rumor.allgather(torch.tensor([os.getpid()], dtype=torch.int64)).tolist()
    base = torch.arange(size, dtype=torch.float64) % 1009
    expected = sum(base + 3 * q for q in range(n)).to(torch.float32)  # integers: exact
    kept = torch.empty(size, dtype=torch.float32)
    for k in range(rounds):
        x = (base + 3 * r).to(torch.float32)
        if same_buffer:  # as DDP's buckets: the direct path backs it with 2 MiB pages from round 2
            h = rumor.allreduce_nonblocking_(kept.copy_(x), op=rumor.ReduceOp.SUM)
        else:
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
    if same_buffer and _collapse_possible():
        huge = _anon_huge_kb(kept.data_ptr())
        assert huge >= 8 * 1024, f"rank {r}: the buffer holds {huge} kB of huge pages after {rounds} rounds"
    return True


def test_stopped_rank_mid_allreduce_three_ranks():
    # RUMOR_TIMEOUT well above the stop: a wait that gave up early would fail the test.
    res = harness.run(stopped_peer_rank, 3, timeout=120, env={"RUMOR_TIMEOUT": "30"}, args=(2,))
    assert res == [True, True, True]


def test_stopped_rank_mid_allreduce_two_ranks_on_huge_pages():
    # Two ranks take the direct path from 16 MiB where buffers go onto huge pages
    # (Communicator::use_direct); the same buffer three times, so the later rounds run on them.
    res = harness.run(stopped_peer_rank, 2, timeout=120, env={"RUMOR_TIMEOUT": "30"}, args=(3, True))
    assert res == [True, True]


@pytest.mark.parametrize("path", ["ring", "direct"])
def test_stopped_rank_mid_allreduce_two_ranks_on_the_path_rank_0_names(path):
    # Two ranks from 1 MiB to 16 MiB take the path rank 0 names (PathChoice, csrc/comm/direct.h);
    # rank 1's own setting says the other one, and is not read.
    size = (3 << 20) // 4 + 5
    res = harness.run(stopped_peer_rank, 2, timeout=120, args=(2, False, size),
                      env={"RUMOR_TIMEOUT": "30"},
                      rank_env=[{"RUMOR_TWO_RANK_PATH": path},
                                {"RUMOR_TWO_RANK_PATH": "direct" if path == "ring" else "ring"}])
    assert res == [True, True]


def bound_rank():
    import os

    import torch

    import rumor

    rumor.init()
    r, n = rumor.rank(), rumor.size()
    mine = sorted(os.sched_getaffinity(0))
    for k in range(200):  # small collectives through the shared slots, exact every time
        x = torch.arange(1000, dtype=torch.int64) + 1000 * r + k
        rumor.allreduce_(x, op=rumor.ReduceOp.SUM)
        want = n * (torch.arange(1000, dtype=torch.int64) + k) + 1000 * (n * (n - 1) // 2)
        assert torch.equal(x, want), f"op {k}: rank {r}: allreduce differs"
    return rumor.local_rank(), mine


def test_bind_cores_binds_only_where_ranks_outnumber_the_cpus():
    import os

    saved = os.sched_getaffinity(0)
    two = set(sorted(saved)[:2])
    os.sched_setaffinity(0, two)  # the ranks inherit it: 4 ranks on at most 2 CPUs
    try:
        crowded = harness.run(bound_rank, 4, timeout=120, env={"RUMOR_BIND_CORES": "1"})
        roomy = harness.run(bound_rank, len(two), timeout=120, env={"RUMOR_BIND_CORES": "1"})
    finally:
        os.sched_setaffinity(0, saved)
    cpus = sorted(two)
    assert [mine for _, mine in crowded] == [[cpus[lr % len(cpus)]] for lr, _ in crowded]
    # As many ranks as CPUs: each has a core to itself already, and nothing is bound.
    assert [mine for _, mine in roomy] == [cpus] * len(two)
