"""Failures of other processes: a rank that dies, a rank that never shows up, a stranger that
connects with the wrong credentials. The survivors must raise rumor errors (not hang), and
hostile connections must be rejected without disturbing the job."""
from __future__ import annotations

import os
import signal
import socket
import struct
import tempfile
import time

import pytest

import harness
from harness import Checker

BIG = 2 * 1024 * 1024 + 3   # float32 elements: ring allreduce, several shm-ring fills, TCP striping


# ---- a rank dies in the middle of a collective ----------------------------------------------------

def _die(how: str):
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(17)


def killed_rank(victim: int, how: str, op: str):
    """Everyone loops on a large collective; the victim starts one, then dies while it is (most
    likely) in flight. Whether it dies before, during or after its part of that op, the
    survivors can never complete their loop: they must raise RumorError, and then refuse
    further work instead of hanging."""
    import threading

    import torch

    import rumor

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    x = torch.full((BIG,), float(r + 1))

    def one():
        if op == "allreduce":
            return rumor.allreduce(x, rumor.ReduceOp.SUM)
        if op == "broadcast":
            return rumor.broadcast(x, 0)
        if op == "allgather":
            return rumor.allgather(x[: BIG // 2])
        if op == "recv":  # the victim streams messages to rank 0
            return rumor.send(x, 0) if r == victim else rumor.recv(torch.empty(BIG), victim)
        raise ValueError(op)

    involved = op != "recv" or r in (0, victim)
    # A few good rounds first, so every channel is up and the failure hits a running job.
    for _ in range(2):
        if involved:
            one()
    rumor.barrier()
    if r == victim:
        # The op runs in the worker thread (nonblocking) or a helper thread (send) while the
        # main thread kills the process.
        if op == "allreduce":
            rumor.allreduce_nonblocking(x, rumor.ReduceOp.SUM)
        elif op == "broadcast":
            rumor.broadcast_nonblocking(x, 0)
        elif op == "allgather":
            rumor.allgather_nonblocking(x[: BIG // 2])
        else:
            threading.Thread(target=lambda: [one() for _ in range(100)], daemon=True).start()
        time.sleep(0.2)  # only makes "mid-transfer" likelier; correctness does not depend on it
        _die(how)
    if not involved:
        return []
    errors = []
    try:
        for _ in range(10_000):  # bounded, so a missed failure ends (and fails) the test
            one()
        raise AssertionError(f"rank {r}: 10000 rounds of {op} completed after rank {victim} died")
    except rumor.RumorError as e:
        errors.append((type(e).__name__, str(e)))
    # The failed communicator refuses new work at once.
    try:
        rumor.allreduce(torch.ones(3))
    except rumor.RumorError as e:
        errors.append((type(e).__name__, str(e)))
    else:
        raise AssertionError(f"rank {r}: an allreduce on the broken world succeeded")
    return errors


FAULT_CASES = [
    ("shm", {}, 3, 1, "sigkill", "allreduce"),
    ("tcp", {"RUMOR_SHM": "0"}, 3, 1, "sigkill", "allreduce"),
    ("shm", {}, 4, 3, "exit", "allreduce"),
    ("tcp", {"RUMOR_SHM": "0"}, 4, 0, "exit", "broadcast"),
    ("shm", {}, 3, 2, "sigkill", "allgather"),
    ("shm", {}, 3, 2, "sigkill", "recv"),
    ("tcp", {"RUMOR_SHM": "0", "RUMOR_SOCKET_STREAMS": "4"}, 2, 1, "sigkill", "recv"),
]


@pytest.mark.parametrize("transport,env,world,victim,how,op", FAULT_CASES,
                         ids=[f"{c[0]}-{c[2]}ranks-victim{c[3]}-{c[4]}-{c[5]}" for c in FAULT_CASES])
def test_rank_killed_mid_collective(transport, env, world, victim, how, op):
    env = dict(env, RUMOR_TIMEOUT="30")
    res = harness.run(killed_rank, world, timeout=75, env=env, args=(victim, how, op), may_die=[victim])
    for r, errs in enumerate(res):
        if r == victim or (op == "recv" and r != 0):
            continue
        # Detected through the peer's death (or a neighbour's abort): PeerError, well before
        # the op's own 30 s deadline would have turned it into a CommTimeoutError.
        assert len(errs) == 2, (r, errs)
        assert errs[0][0] == "PeerError", (r, errs)
        assert errs[1][0] in ("AbortedError", "PeerError"), (r, errs)


def test_rank_killed_in_emulated_hosts_hierarchical():
    """2 emulated hosts x 2 ranks (shm inside, TCP between): a rank dies during hierarchical
    allreduces; ranks on both hosts must raise."""
    hosts = ["hA", "hA", "hB", "hB"]
    res = harness.run(hier_killed_rank, 4, timeout=75, env={"RUMOR_TIMEOUT": "30"}, args=(3,),
                      rank_env=[{"RUMOR_HOST_ID": h} for h in hosts], may_die=[3])
    for r in range(3):
        assert res[r] and res[r][0][0] == "PeerError", (r, res[r])


def hier_killed_rank(victim: int):
    import torch

    import rumor

    rumor.init()
    r = rumor.rank()
    x = torch.full((BIG,), 1.0)
    rumor.allreduce(x, rumor.ReduceOp.SUM, hierarchical=True)
    rumor.barrier()
    if r == victim:
        rumor.allreduce_nonblocking(x, rumor.ReduceOp.SUM, hierarchical=True)
        time.sleep(0.2)
        _die("sigkill")
    try:
        for _ in range(10_000):
            rumor.allreduce(x, rumor.ReduceOp.SUM, hierarchical=True)
    except rumor.RumorError as e:
        return [(type(e).__name__, str(e))]
    raise AssertionError("10000 hierarchical allreduces completed after a rank died")


# ---- a rank never joins: the others time out -------------------------------------------------------

def absent_rank(absent: int, marker_dir: str, nonblocking: bool, set_to=None):
    import torch

    import rumor

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()
    rumor.allreduce(torch.ones(10))  # everyone is connected
    if set_to is not None:
        # The job started with a 60 s deadline; from here on waits give up after set_to.
        chk.raises(ValueError, lambda: rumor.set_timeout(0), "a zero timeout")
        chk.raises(ValueError, lambda: rumor.set_timeout(float("inf")), "an infinite timeout")
        chk.raises(TypeError, lambda: rumor.set_timeout("3"), "a string timeout")
        chk.check(rumor.get_timeout() == 60.0, f"bad values changed the timeout: {rumor.get_timeout()}")
        rumor.set_timeout(set_to)
        chk.check(rumor.get_timeout() == set_to, f"get_timeout() {rumor.get_timeout()} after set_timeout({set_to})")
    if r == absent:
        # Busy in Python and never reaching the allreduce until the others gave up on it.
        end = time.monotonic() + 55
        while len(os.listdir(marker_dir)) < n - 1:
            if time.monotonic() > end:
                raise AssertionError("the other ranks never reported their timeout")
            time.sleep(0.05)
        # Late: the others have failed and given up. This rank must not hang. Its allreduce
        # may still complete over TCP (everything it needs from its partner may already sit in
        # its socket buffer), but by its next op at the latest it must fail.
        try:
            rumor.allreduce(torch.ones(1000))
        except rumor.RumorError:
            pass
        chk.raises(rumor.RumorError, lambda: rumor.barrier(), "the late rank's next op")
        return None, chk.failures, chk.count
    # A rank waiting on the absent one times out (CommTimeoutError); a rank waiting on a rank
    # that timed out may instead learn of its abort first (PeerError). Either way it names the op.
    if nonblocking:
        h = rumor.allreduce_nonblocking(torch.ones(1000))
        e = chk.raises((rumor.CommTimeoutError, rumor.PeerError), h.wait, "waiting for an allreduce a rank never joined")
    else:
        e = chk.raises((rumor.CommTimeoutError, rumor.PeerError), lambda: rumor.allreduce(torch.ones(1000)),
                       "an allreduce a rank never joined")
    if isinstance(e, rumor.RumorError):
        chk.check("allreduce" in str(e), f"the error does not name the op: {e}")
        if set_to is not None and isinstance(e, rumor.CommTimeoutError):
            chk.check(f"timed out after {set_to:.6f}" in str(e), f"not the deadline set: {e}")
        if isinstance(e, rumor.CommTimeoutError):
            chk.check(isinstance(e, TimeoutError), f"CommTimeoutError is not a TimeoutError: {type(e).__mro__}")
    open(os.path.join(marker_dir, f"timed-out-{r}"), "w").close()
    return type(e).__name__, chk.failures, chk.count


@pytest.mark.parametrize("env,nonblocking", [({}, False), ({"RUMOR_SHM": "0"}, False), ({}, True)],
                         ids=["shm", "tcp", "shm-nonblocking"])
def test_rank_that_never_joins_times_out(env, nonblocking):
    with tempfile.TemporaryDirectory() as d:
        res = harness.run(absent_rank, 3, timeout=75, env=dict(env, RUMOR_TIMEOUT="3"), args=(1, d, nonblocking))
    harness.assert_no_failures([x[1:] for x in res])
    kinds = [x[0] for r, x in enumerate(res) if r != 1]
    assert "CommTimeoutError" in kinds, kinds


def test_set_timeout_applies_to_the_next_waits():
    """rumor.init's deadline is 60 s; after rumor.set_timeout(2.5) an allreduce a rank never joins
    fails at 2.5 s (at 60 s the absent rank's own 55 s wait for the others' reports fails)."""
    with tempfile.TemporaryDirectory() as d:
        res = harness.run(absent_rank, 3, timeout=75, env={"RUMOR_TIMEOUT": "60"}, args=(1, d, False, 2.5))
    harness.assert_no_failures([x[1:] for x in res])
    assert "CommTimeoutError" in [x[0] for r, x in enumerate(res) if r != 1]


# ---- strangers knocking: wrong token, garbage, bad magic --------------------------------------------

def _raw(addr, payload: bytes) -> bytes:
    """Connects, sends payload and closes the sending side; returns whatever comes back before
    the listener closes the connection."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.settimeout(20)
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)  # ENOTCONN if the listener already dropped us
            got = b""
            while True:
                chunk = s.recv(64)
                if not chunk:
                    return got
                got += chunk
        except (ConnectionResetError, BrokenPipeError, OSError):
            return b"<reset>"


def _hello(magic=b"RUMORHS1", version=2, rank=0, comm=0, stream=0) -> bytes:
    """A protocol v2 hello (csrc/net/handshake.h) with a fresh nonce: without the key's proof
    that follows it, the listener never accepts it."""
    return magic + struct.pack("<IIQII", version, rank, comm, stream, 0) + os.urandom(32)


def intruder_rank():
    import torch

    import rumor
    from rumor import _C, _runtime

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()
    st = _runtime.state()
    # Every rank publishes its listener port; each probes the next rank's listener.
    ports = rumor.allgather(torch.tensor([st.ctx.port], dtype=torch.int64)).tolist()
    mine = _runtime.listen_address()
    chk.check(mine.endswith(f":{st.ctx.port}"), f"_listen_address() {mine} vs port {st.ctx.port}")
    target = f"127.0.0.1:{ports[(r + 1) % n]}"
    before = st.ctx.rejected_connections
    rumor.barrier()

    probes = 0
    # The highest rank dials every other one, so only the key's proof can refuse these.
    ok = _C.probe_connect(target, token=b"x" * 16, rank=n - 1)
    chk.check(ok is False, f"probe_connect with a wrong token was accepted ({ok!r})")
    probes += 1
    ok = _C.probe_connect(target, token=b"x" * 16, rank=n - 1, comm_id=0, stream=1, key=os.urandom(32))
    chk.check(ok is False, "probe_connect with a wrong key (stream 1) was accepted")
    probes += 1
    # What anyone who reaches the rendezvous store reads: the session token. Before the job
    # secret it was the whole proof (issue 48, "the job token is not a secret": a probe with it
    # was accepted); now the key needs the secret too.
    import datetime

    import torch.distributed as dist

    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=datetime.timedelta(seconds=30))
    public = bytes.fromhex(bytes(dist.PrefixStore("rumor/0/", client).get("token")).decode())
    ok = _C.probe_connect(target, token=public, rank=n - 1)
    chk.check(ok is False, "probe_connect with the store's session token (no secret) was accepted")
    probes += 1
    if (r + 1) % n != n - 1:  # a listener accepts only dialers above its own rank
        # The positive control: with the job's key (on a communicator id nobody uses) it passes.
        ok = _C.probe_connect(target, token=public, rank=n - 1, comm_id=1 << 62,
                              key=_runtime.state().secret.key("connection", public))
        chk.check(ok is True, "probe_connect with the job's own key was refused")
    got = _raw(target, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(200))
    chk.check(b"RUMOROK" not in got, f"garbage got a handshake reply: {got!r}")
    probes += 1
    got = _raw(target, _hello(magic=b"NOTRUMOR"))
    chk.check(b"RUMOROK" not in got, f"a hello with bad magic got accepted: {got!r}")
    probes += 1
    got = _raw(target, _hello(version=99))
    chk.check(b"RUMOROK" not in got, f"a hello with a bad version got accepted: {got!r}")
    probes += 1
    # Well-formed hellos that the listener refuses before any proof: a rank that is not in the
    # world, or another protocol version.
    got = _raw(target, _hello(rank=1000))
    chk.check(b"RUMOROK" not in got, f"a hello with an out-of-range rank got accepted: {got!r}")
    probes += 1
    got = _raw(target, _hello(rank=n))
    chk.check(b"RUMOROK" not in got, f"a hello with rank {n} (= world size) got accepted: {got!r}")
    probes += 1
    got = _raw(target, _hello(version=3, rank=n - 1))
    chk.check(b"RUMOROK" not in got, f"a hello with protocol version 3 got accepted: {got!r}")
    probes += 1
    # A v1 hello (the job token where v2 has its nonce), as an older rumor would send it.
    got = _raw(target, _hello(version=1, rank=n - 1))
    chk.check(b"RUMOROK" not in got, f"a protocol version 1 hello got accepted: {got!r}")
    probes += 1
    got = _raw(target, _hello()[:20])  # half a handshake, then close
    chk.check(got == b"" or got == b"<reset>", f"half a handshake got a reply: {got!r}")
    probes += 1

    rumor.barrier()
    # Each listener saw exactly the probes of its predecessor; the counter is bumped before the
    # listener closes a connection, and every probe above waited for that close.
    # A probe that refuses the listener's proof hangs up first: its refusal is counted a moment later.
    deadline = time.monotonic() + 20
    while st.ctx.rejected_connections - before < probes and time.monotonic() < deadline:
        time.sleep(0.01)
    after = st.ctx.rejected_connections
    chk.check(after - before >= probes, f"rejected_connections went {before} -> {after}, expected +{probes}")
    # The job is undisturbed: collectives on fresh channels (TCP and shm) are still correct.
    g = rumor.new_group(list(range(n))[::-1])
    for group in [None, g]:
        for size in [3, 100_000, 1_000_003]:
            x = torch.full((size,), float(r + 1))
            chk.equal(rumor.allreduce(x, rumor.ReduceOp.SUM, group=group), torch.full((size,), float(n * (n + 1) // 2)),
                      f"allreduce numel={size} after the intruders")
    return chk.failures, chk.count


@pytest.mark.parametrize("env", [{"RUMOR_SHM": "0"}, {}], ids=["tcp", "shm"])
def test_wrong_token_and_garbage_are_rejected(env):
    res = harness.run(intruder_rank, 3, timeout=90, env=env)
    harness.assert_no_failures(res)
