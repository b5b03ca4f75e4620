"""Strangers on the network against a training job (issue 48, docs/security.md).

Finding covered: "an unauthenticated listener can be exhausted": every connection that had not
finished its handshake was kept 10 s with no cap, and past the fd limit the accept loop spun at
100% CPU and flooded the log, until the job failed. Here 2,000 half-open connections, partial
hellos and a connect-and-close flood hit rank 0's listener while two ranks train; rank 0 runs
with its fd limit lowered so that the flood drives its listener to EMFILE. The job must finish
with the right weights, the listener thread must not spin while it sits at the limit, and the
process's fd count must come back.
"""
import os
import resource
import socket
import struct
import threading
import time

import pytest

import harness

HALF_OPEN = 2000
CONNECT_CLOSE = 1000


def _thread_cpu(stat_fd: int) -> float:
    # Read through a descriptor opened before the flood: at the fd limit, open() fails with EMFILE
    # (seen in CI when the loop ended while the listener still held the limit's last descriptors).
    fields = os.pread(stat_fd, 4096, 0).decode().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _listener_tid() -> int:
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "rumor-listen":
                return int(tid)
    raise AssertionError("no thread named rumor-listen in this process")


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _wait_for(path: str, deadline: float, what: str) -> None:
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {path} did not appear")
        time.sleep(0.02)


def train_under_flood(workdir: str):
    import torch

    import rumor
    from rumor import _runtime

    rumor.init()
    r, n = rumor.rank(), rumor.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).double()
    ref = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).double()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt)

    def batch(step, rank):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(8, 32, generator=g, dtype=torch.float64), torch.randint(0, 4, (8,), generator=g)

    def step(i):
        x, y = batch(i, r)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        # The reference: the same step on every rank's batch at once (DDP averages the gradients).
        xs, ys = zip(*(batch(i, q) for q in range(n)))
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()

    step(0)
    rumor.barrier()
    out = {}
    if r == 0:
        stat_fd = os.open(f"/proc/self/task/{_listener_tid()}/stat", os.O_RDONLY)
        fds_before = _fd_count()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        # Room for 48 more descriptors: the flood runs the listener into EMFILE.
        resource.setrlimit(resource.RLIMIT_NOFILE, (fds_before + 48, hard))
        cpu0, t0 = _thread_cpu(stat_fd), time.monotonic()
        tmp = os.path.join(workdir, "port.tmp")
        with open(tmp, "w") as f:
            f.write(str(_runtime.state().ctx.port))
        os.rename(tmp, os.path.join(workdir, "port"))
    deadline = time.monotonic() + 120
    i = 1
    # Train through the flood: rank 0 says when the flooder is done (a broadcast, so both ranks
    # run the same number of steps).
    while True:
        step(i)
        i += 1
        done = torch.tensor([1 if r == 0 and os.path.exists(os.path.join(workdir, "flood-done")) else 0])
        rumor.broadcast_(done, 0)
        if int(done[0]) and i >= 5:
            break
        if time.monotonic() > deadline:
            raise TimeoutError("the flood did not end within 120 s")
    if r == 0:
        wall, cpu = time.monotonic() - t0, _thread_cpu(stat_fd) - cpu0
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        os.close(stat_fd)
        # The flooder closed everything: the listener drops what it held within its handshake
        # deadline, so the count comes back.
        back = time.monotonic() + 30
        while _fd_count() > fds_before + 2 and time.monotonic() < back:
            time.sleep(0.05)
        out = dict(fds_before=fds_before, fds_after=_fd_count(), cpu=cpu, wall=wall,
                   rejected=_runtime.state().ctx.rejected_connections)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-9, atol=1e-12)
    out["steps"] = i
    return out


def _flood(workdir: str, errors: list) -> None:
    try:
        _wait_for(os.path.join(workdir, "port"), time.monotonic() + 90, "rank 0's port")
        port = int(open(os.path.join(workdir, "port")).read())
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, HALF_OPEN + 512)), hard))
        held = []
        partial = b"RUMORHS" + struct.pack("<I", 2)[:1]
        for k in range(HALF_OPEN):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                continue
            if k % 3 == 1:
                try:
                    s.send(partial)  # a hello that never finishes
                except OSError:
                    pass
            held.append(s)
        for _ in range(CONNECT_CLOSE):
            # Connect and hang up at once, without waiting for the handshake to complete: a
            # listener that has stopped accepting (at its fd limit) must not slow the flooder.
            with socket.socket() as s:
                s.setblocking(False)
                try:
                    s.connect(("127.0.0.1", port))
                except (BlockingIOError, OSError):
                    pass
        time.sleep(3.5)  # hold the half-open ones past the listener's handshake deadline
        for s in held:
            s.close()
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)
    finally:
        with open(os.path.join(workdir, "flood-done"), "w"):
            pass


@pytest.mark.parametrize("shm", ["0", "1"], ids=["tcp", "shm"])
def test_training_goes_on_through_a_connection_flood(tmp_path, shm):
    errors = []
    t = threading.Thread(target=_flood, args=(str(tmp_path), errors), daemon=True)
    t.start()
    res = harness.run(train_under_flood, 2, timeout=150, args=(str(tmp_path),), env={"RUMOR_SHM": shm})
    t.join(30)
    assert not errors, errors
    r0 = res[0]
    assert r0["steps"] >= 5
    # Not spinning: while it sat at its fd limit the listener used a small part of one core
    # (measured: 0.5% here; 44% with the EMFILE back-off removed, which this bound catches).
    assert r0["cpu"] < 0.2 * r0["wall"], r0
    assert r0["fds_after"] <= r0["fds_before"] + 2, r0
    assert r0["rejected"] >= 100, r0


def knock_with_garbage():
    import rumor
    from rumor import _runtime

    rumor.init()
    ctx = _runtime.state().ctx
    before = ctx.rejected_connections
    with socket.create_connection(("127.0.0.1", ctx.port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64)
        port = s.getsockname()[1]
        s.settimeout(10)
        try:
            s.recv(64)  # the listener closes: refused
        except (ConnectionResetError, socket.timeout):
            pass
    deadline = time.monotonic() + 20
    while ctx.rejected_connections == before and time.monotonic() < deadline:
        time.sleep(0.01)
    rumor.shutdown()
    return port


def test_a_refused_connection_is_logged_with_the_peers_address():
    # Issue 48 ("logs do not name the peer address of a refused connection").
    res = harness.run(knock_with_garbage, 1, timeout=60, raw=True)[0]
    assert res.ok, res.error
    assert f"127.0.0.1:{res.value}" in res.output and "bad magic" in res.output, res.output[-2000:]


def listening_addresses():
    import rumor
    from rumor import _runtime

    rumor.init()
    port = _runtime.state().ctx.port
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            local, state = ln.split()[1], ln.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                found.append(addr)
    rumor.barrier()
    return found


def test_the_listener_binds_the_advertised_address_only():
    # Issue 48 ("rumor's listener binds every interface, not the rendezvous one"): with the store
    # on loopback, ranks advertise 127.0.0.1 and listen there, not on 0.0.0.0.
    for found in harness.run(listening_addresses, 2, timeout=60):
        assert found == ["0100007F"], found  # 127.0.0.1 in /proc/net/tcp's byte order
