"""Two emulated hosts x two ranks each, in Linux network namespaces (rumor.testing.netns).

Ranks 0,1 run in host 0's namespace and ranks 2,3 in host 1's, so each pair shares memory while
traffic between the pairs goes over TCP through a veth/bridge "network": the cross-host transport
and the hierarchical allreduce (intra-host reduce, leader allreduce, intra-host broadcast) really
run. Every value is checked exactly against a locally computed reference.

Skipped, with the reason, where namespaces cannot be built (not root, no iproute2, no
CAP_NET_ADMIN). The whole run has a deadline; on timeout every rank is killed and the test fails
with each rank's output.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rumor.testing.launch import kill_process_group

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTS = 2
RANKS_PER_HOST = 2
WORLD = HOSTS * RANKS_PER_HOST
DEADLINE_S = 75.0          # whole run; a healthy run takes a few seconds
RUMOR_TIMEOUT_S = 30       # every blocking wait inside rumor
GRACE_AFTER_FAILURE_S = 15 # after one rank fails, how long the others may take to notice
PORT = 29500               # inside host 0's fresh namespace nothing else listens

# Byte size at or below which rumor's auto allreduce uses recursive doubling (see test_collectives).
SMALL_ALLREDUCE_BYTES = 64 * 1024
# Element counts: tiny, odd, just past the small-message switch, and large enough for the ring
# path, TCP striping and shared-memory ring wrap-around (uneven chunks: not a multiple of 4).
SIZES = [1, 7, 1023, SMALL_ALLREDUCE_BYTES // 4 + 1, 3 * 1024 * 1024 + 5]

_SCRUB_PREFIXES = ("OMPI_", "PMI_", "SLURM_", "TORCHELASTIC_", "RUMOR_", "PMIX_")
_SCRUB_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT")

_BOOT = "import sys; sys.path.insert(0, {here!r}); import test_multihost; test_multihost._rank_main()"


# ---- inside a rank -------------------------------------------------------------------------------

def _input(n: int, rank: int, salt: int):
    """Integer-valued float32 in [-30, 30]: sums over 4 ranks and their quarter (AVG) are exact."""
    import torch

    i = torch.arange(n, dtype=torch.int64)
    return (((i * 7 + rank * 13 + salt * 5) % 61) - 30).to(torch.float32)


def _rank_main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(DEADLINE_S - 5, exit=True)  # a hung rank shows its stacks
    import torch

    import rumor

    rank = int(os.environ["RANK"])
    failures = []

    def check(ok, what):
        if not ok:
            failures.append(what)

    def equal(actual, expected, what):
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            failures.append(f"{what}: got {actual.dtype}{list(actual.shape)}, expected "
                            f"{expected.dtype}{list(expected.shape)}")
        elif not torch.equal(actual, expected):
            bad = (actual != expected).nonzero()
            j = tuple(bad[0].tolist())
            failures.append(f"{what}: {bad.shape[0]} of {expected.numel()} elements differ, first at "
                            f"{list(j)}: got {actual[j].item()}, expected {expected[j].item()}")

    t0 = time.monotonic()
    rumor.init(timeout=RUMOR_TIMEOUT_S)
    print(f"rank {rank}: init in {time.monotonic() - t0:.2f}s", flush=True)

    # -- topology as rumor sees it
    check(rumor.size() == WORLD, f"size() = {rumor.size()}, expected {WORLD}")
    check(rumor.rank() == rank, f"rank() = {rumor.rank()}, expected {rank}")
    check(rumor.local_size() == RANKS_PER_HOST, f"local_size() = {rumor.local_size()}, expected {RANKS_PER_HOST}")
    check(rumor.local_rank() == rank % RANKS_PER_HOST, f"local_rank() = {rumor.local_rank()}, expected {rank % RANKS_PER_HOST}")
    check(rumor.machine_size() == HOSTS, f"machine_size() = {rumor.machine_size()}, expected {HOSTS}")
    check(rumor.machine_rank() == rank // RANKS_PER_HOST,
          f"machine_rank() = {rumor.machine_rank()}, expected {rank // RANKS_PER_HOST}")

    SUM, AVG, MAX = rumor.ReduceOp.SUM, rumor.ReduceOp.AVG, rumor.ReduceOp.MAX

    # -- allreduce: default (auto) and hierarchical, also in place and the explicit algorithms
    for salt, n in enumerate(SIZES):
        inputs = [_input(n, r, salt) for r in range(WORLD)]
        total = torch.stack([x.double() for x in inputs]).sum(0)
        exp_sum = total.float()
        exp_avg = (total / WORLD).float()
        exp_max = torch.stack(inputs).amax(0)
        mine = inputs[rank]
        for hier in (False, True):
            tag = f"allreduce n={n} hierarchical={hier}"
            equal(rumor.allreduce(mine, op=SUM, hierarchical=hier), exp_sum, f"{tag} SUM")
            equal(rumor.allreduce(mine, op=AVG, hierarchical=hier), exp_avg, f"{tag} AVG")
            equal(mine, inputs[rank], f"{tag}: input modified by out-of-place allreduce")
            buf = mine.clone()
            rumor.allreduce_(buf, op=SUM, hierarchical=hier)
            equal(buf, exp_sum, f"{tag} SUM in place")
        equal(rumor.allreduce(mine, op=MAX, hierarchical=True), exp_max, f"allreduce n={n} hierarchical MAX")
        algos = ["ring", "recursive_doubling"] if n < 1_000_000 else ["ring"]
        for algo in algos:
            equal(rumor.allreduce(mine, op=SUM, algorithm=algo), exp_sum, f"allreduce n={n} algorithm={algo} SUM")

    # -- allgather: a different number of rows per rank, 3 columns
    for rows_base in (1, 40_000):
        parts = [_input((rows_base + r) * 3, r, 17).reshape(rows_base + r, 3) for r in range(WORLD)]
        equal(rumor.allgather(parts[rank]), torch.cat(parts), f"allgather rows {rows_base}+rank")

    # -- broadcast from a rank on each host (a leader and a non-leader)
    for root in (0, 3):
        for n in (5, 1 << 20):
            data = [_input(n, r, 23) for r in range(WORLD)]
            equal(rumor.broadcast(data[rank], root), data[root], f"broadcast n={n} root={root}")
            buf = data[rank].clone()
            rumor.broadcast_(buf, root)
            equal(buf, data[root], f"broadcast_ n={n} root={root}")

    # -- reduce_scatter: uneven rows (first dim0 % 4 ranks get one more row), SUM and AVG
    for rows in (9, 4 * 50_000 + 3):
        inputs = [_input(rows * 5, r, 31).reshape(rows, 5) for r in range(WORLD)]
        total = torch.stack([x.double() for x in inputs]).sum(0)
        block_sum = torch.tensor_split(total.float(), WORLD)[rank]
        block_avg = torch.tensor_split((total / WORLD).float(), WORLD)[rank]
        equal(rumor.reduce_scatter(inputs[rank], op=SUM), block_sum, f"reduce_scatter rows={rows} SUM")
        equal(rumor.reduce_scatter(inputs[rank], op=AVG), block_avg, f"reduce_scatter rows={rows} AVG")

    # -- a group spanning both hosts with one rank each (pure TCP), and one inside host 1 (pure shm)
    cross = rumor.new_group([0, 3])
    local1 = rumor.new_group([2, 3])
    x = _input(100_003, rank, 41)
    if rank in (0, 3):
        exp = (_input(100_003, 0, 41).double() + _input(100_003, 3, 41).double()).float()
        equal(rumor.allreduce(x, op=SUM, group=cross), exp, "allreduce group [0, 3]")
    if rank in (2, 3):
        exp = (_input(100_003, 2, 41).double() + _input(100_003, 3, 41).double()).float()
        equal(rumor.allreduce(x, op=SUM, group=local1), exp, "allreduce group [2, 3]")

    # -- decentralized ops across the hosts: a dynamic ring (receive from rank - 1, send to rank + 1)
    #    and the hierarchical neighbor allreduce (host averages over shm, combined between the
    #    machines over TCP). Values are multiples of 1/8: exact in float32.
    x = torch.full((1 << 20,), float(rank))
    left = (rank - 1) % WORLD
    got = rumor.neighbor_allreduce(x, self_weight=0.5, src_weights={left: 0.5}, dst_weights=[(rank + 1) % WORLD])
    equal(got, torch.full_like(x, 0.5 * rank + 0.5 * left), "neighbor_allreduce ring across hosts")
    me, other = rank // RANKS_PER_HOST, 1 - rank // RANKS_PER_HOST
    host_avg = [sum(range(h * RANKS_PER_HOST, (h + 1) * RANKS_PER_HOST)) / RANKS_PER_HOST for h in range(HOSTS)]
    got = rumor.hierarchical_neighbor_allreduce(x, self_weight=0.25, src_machine_weights={other: 0.75},
                                                dst_machine_weights=[other])
    equal(got, torch.full_like(x, 0.25 * host_avg[me] + 0.75 * host_avg[other]), "hierarchical_neighbor_allreduce")

    # -- one-sided windows across the hosts: ranks 0,1 share memory, 0 <-> 2 goes over TCP and is
    #    applied by the target's progress thread. Put to rank + 2 (other host) and rank + 1.
    w = torch.full((1 << 18,), float(rank + 1))
    rumor.win_create(w, "mh", zero_init=True)
    far, near = (rank + 2) % WORLD, (rank + 1) % WORLD
    rumor.win_put(w, "mh", dst_weights={far: 0.5, near: 0.25})
    rumor.win_accumulate(w, "mh", dst_weights={far: 1.0})
    rumor.barrier()
    src_far, src_near = (rank - 2) % WORLD, (rank - 1) % WORLD
    got = rumor.win_update("mh", self_weight=1.0, neighbor_weights={src_far: 1.0, src_near: 1.0}, clone=True)
    want = (rank + 1) + 1.5 * (src_far + 1) + 0.25 * (src_near + 1)
    equal(got, torch.full_like(w, want), "win_put/win_accumulate across hosts")
    rumor.win_get("mh", src_weights={src_far: 2.0})
    got = rumor.win_update("mh", self_weight=0.0, neighbor_weights={src_far: 1.0}, clone=True)
    equal(got, torch.full_like(w, 2.0 * (src_far + 1)), "win_get across hosts")
    rumor.win_free("mh")

    rumor.barrier()
    print(f"rank {rank}: {len(failures)} failure(s), {time.monotonic() - t0:.2f}s", flush=True)
    if failures:
        print("\n".join(f"rank {rank}: FAIL {f}" for f in failures[:100]), flush=True)
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of torch/rumor threads


# ---- the test (pytest process) -------------------------------------------------------------------

def _child_env(rank: int, master: str):
    e = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_NAMES}
    e.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank % RANKS_PER_HOST),
        LOCAL_WORLD_SIZE=str(RANKS_PER_HOST),
        MASTER_ADDR=master,
        MASTER_PORT=str(PORT),
        RUMOR_TIMEOUT=str(RUMOR_TIMEOUT_S),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
    )
    return e


def test_two_hosts_two_ranks_each(tmp_path):
    from rumor.testing import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(f"emulated hosts need Linux network namespaces: {why}")

    procs, logs = [], []
    with netns.Cluster(HOSTS) as cluster:  # no shaping: this test is about correctness
        try:
            for r in range(WORLD):
                log = open(tmp_path / f"rank{r}.log", "w+b")
                logs.append(log)
                procs.append(cluster.popen(
                    r // RANKS_PER_HOST, [sys.executable, "-c", _BOOT.format(here=HERE)],
                    env=_child_env(r, cluster.ip(0)), stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL))
            start = time.monotonic()
            deadline = start + DEADLINE_S
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                if any(c not in (None, 0) for c in codes):
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            elapsed = time.monotonic() - start
            timed_out = [r for r, p in enumerate(procs) if p.poll() is None]
            for r in timed_out:
                kill_process_group(procs[r])
        finally:
            for p in procs:
                if p.poll() is None:
                    kill_process_group(p)
    # (namespaces are gone here)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read().decode("utf-8", "replace"))
        log.close()
    bad = [r for r, p in enumerate(procs) if r in timed_out or p.returncode != 0]
    if bad:
        lines = [f"{len(bad)} of {WORLD} rank(s) failed after {elapsed:.1f}s: {bad}"]
        for r in range(WORLD):
            status = ("killed at the deadline" if r in timed_out else f"exit code {procs[r].returncode}")
            lines.append(f"\n===== rank {r} (host {r // RANKS_PER_HOST}, {status}) =====")
            lines.append(outputs[r][-6000:])
        pytest.fail("\n".join(lines), pytrace=False)
