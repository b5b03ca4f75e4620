"""The WAN element of rumor.testing.netns (rumor-wanem): delay, jitter and loss between emulated
hosts. Only what holds on every run is asserted: a packet is never released before its delay, a
pair with loss 1.0 passes nothing while the others pass everything (counted by the forwarder),
TCP through delay, jitter and loss delivers every byte, and nothing is left behind. Accuracy
(RTT within 5%, window/RTT) is measured by `python -m rumor.testing.netns --check-wan`, not here.
Needs root and network namespaces; skipped with the reason otherwise.
"""
import hashlib
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from rumor.testing import netns


def _need_netns():
    ok, why = netns.available()
    if not ok:
        pytest.skip(f"emulated hosts need Linux network namespaces: {why}")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


# -- no namespaces needed ---------------------------------------------------------------------------

def test_parse_time_and_pair_forms():
    assert netns.parse_time("50ms") == pytest.approx(0.05)
    assert netns.parse_time("200us") == pytest.approx(200e-6)
    assert netns.parse_time(0.1) == 0.1
    with pytest.raises(ValueError):
        netns.parse_time("fast")
    with pytest.raises(ValueError):
        netns.parse_time(-1)
    c = netns.Cluster(3, delay=lambda i, j: f"{10 * (i + j)}ms", loss=[[0, 0.5, 0], [0, 0, 0], [1, 0, 0]])
    assert c.wan
    assert c.delays[0][1] == pytest.approx(0.01) and c.delays[2][1] == pytest.approx(0.03)
    assert c.delays[1][1] == 0.0  # the diagonal never leaves a host
    assert c.losses[0][1] == 0.5 and c.losses[2][0] == 1.0
    assert not netns.Cluster(3, rate="1gbit").wan  # nothing asked: no forwarder, as before
    with pytest.raises(ValueError, match="3 x 3"):
        netns.Cluster(3, delay=[[0, 1], [1, 0]])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        netns.Cluster(2, loss=1.5)
    with pytest.raises(ValueError, match="shape_switch_side"):
        netns.Cluster(2, rate="1gbit", shape_switch_side=True, delay="1ms")


def test_forwarder_refuses_bad_arguments():
    exe = netns.wanem_path()
    r = subprocess.run([exe, "--host", "/nonexistent=10.0.0.1", "--host", "/nonexistent2=10.0.0.2",
                        "--delay-us", "0,1,2"], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and "expected 4 values" in r.stderr, r.stderr
    r = subprocess.run([exe, "--host", "/x=not-an-ip"], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and "not an IPv4 address" in r.stderr, r.stderr


# -- emulated hosts --------------------------------------------------------------------------------

def test_round_trip_never_shorter_than_twice_the_delay():
    _need_netns()
    with netns.Cluster(2, delay="20ms", jitter="2ms") as c:
        got = netns.ping_rtt(c, 0, 1, count=10, gap=0.005)
        st = c.wan_stats()
    assert got["lost"] == 0 and len(got["rtts"]) == 10
    # Jitter is drawn in [-2, +2] ms: each way takes at least 18 ms.
    assert min(got["rtts"]) >= 2 * 0.018, got["rtts"]
    assert st["forwarded"][0][1] >= 10 and st["forwarded"][1][0] >= 10
    assert st["lost"] == [[0, 0], [0, 0]] and st["overflow"] == 0


_SEND = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for addr in sys.argv[2:]:
    for k in range(int(sys.argv[1])):
        s.sendto(k.to_bytes(4, "big"), (addr, 5400))
"""


def test_loss_one_drops_that_pair_only():
    _need_netns()
    n = 200
    with netns.Cluster(3, delay="2ms", loss=lambda i, j: 1.0 if (i, j) == (0, 1) else 0.0) as c:
        c.run(0, [sys.executable, "-c", _SEND, str(n), c.ip(1), c.ip(2)], timeout=30, check=True)
        # Every datagram has been decided once the forwarder counted it; nothing else travels
        # between these hosts.
        deadline = time.monotonic() + 20
        while True:
            st = c.wan_stats()
            if st["lost"][0][1] + st["forwarded"][0][1] >= n and st["forwarded"][0][2] >= n:
                break
            assert time.monotonic() < deadline, f"the forwarder did not see {n} datagrams per pair: {st}"
            time.sleep(0.02)
    assert st["lost"][0][1] == n and st["forwarded"][0][1] == 0
    assert st["forwarded"][0][2] == n and st["lost"][0][2] == 0


_SINK = r"""
import hashlib, socket, sys
s = socket.socket(); s.bind(("0.0.0.0", 5401)); s.listen(1); print("ready", flush=True)
s.settimeout(60); c, _ = s.accept(); c.settimeout(60); h = hashlib.sha256(); n = 0
while True:
    d = c.recv(1 << 20)
    if not d: break
    h.update(d); n += len(d)
print(n, h.hexdigest(), flush=True)
"""

_SOURCE = r"""
import random, socket, sys
data = random.Random(7).randbytes(int(sys.argv[2]))
c = socket.create_connection((sys.argv[1], 5401), timeout=60); c.sendall(data); c.close()
"""


def test_tcp_through_delay_jitter_loss_and_rate_is_intact():
    _need_netns()
    # 1 MiB in ~720 packets of 1500 bytes at 5% loss each way: some loss is certain
    # (P(none) < 1e-15), and TCP must repair it.
    size = 1 << 20
    want = hashlib.sha256(random.Random(7).randbytes(size)).hexdigest()
    with netns.Cluster(2, rate="200mbit", delay="5ms", jitter="1ms", loss=0.05, jitter_dist="normal",
                       wan_mtu=1500) as c:
        assert "tbf" in c.qdisc(0)  # the rate is shaped on wan0, before the delay
        sink = c.popen(1, [sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
        assert netns.read_line(sink, 30) == "ready"
        c.run(0, [sys.executable, "-c", _SOURCE, c.ip(1), str(size)], timeout=60, check=True)
        out, _ = sink.communicate(timeout=60)
        st = c.wan_stats()
    n, digest = out.split()
    assert int(n) == size and digest == want
    assert st["lost"][0][1] + st["lost"][1][0] > 0  # the transfer did go through losses


def test_parse_rate_bps():
    assert netns.parse_rate_bps("100mbit") == 100e6 and netns.parse_rate_bps("1gbit") == 1e9
    assert netns.parse_rate_bps(5e6) == 5e6 and netns.parse_rate_bps("512kbit") == 512e3
    for bad in ("fast", "-1mbit", -5):
        with pytest.raises(ValueError):
            netns.parse_rate_bps(bad)
    c = netns.Cluster(3, link_rate=lambda i, j: "1gbit" if i // 2 == j // 2 else "100mbit")
    assert c.wan and c.link_rates[0][1] == 1e9 and c.link_rates[0][2] == 100e6 and c.link_rates[1][1] == 0.0
    # Host 0's pairs to 1 and 2 share one wire; every other pair has its own.
    c = netns.Cluster(3, link_rate="10mbit", link_wire=lambda i, j: ("up", i) if i == 0 else (i, j))
    assert c.link_wires[0 * 3 + 2] == c.link_wires[0 * 3 + 1] == 1
    assert len(set(c.link_wires)) == 9 - 1
    with pytest.raises(ValueError, match="share wire"):
        netns.Cluster(3, link_rate=[[0, 1e6, 2e6], [0, 0, 0], [0, 0, 0]], link_wire=lambda i, j: i)


def test_a_pair_link_rate_paces_that_pair_only():
    """Host 0 -> 1 has a 20 Mbit/s wire of its own: 2 MiB cannot arrive sooner than the wire
    sends it (a bound that holds on any machine), every byte arrives, and the way back (no rate)
    is untouched."""
    _need_netns()
    size = 2 << 20
    want = hashlib.sha256(random.Random(7).randbytes(size)).hexdigest()
    with netns.Cluster(2, delay="1ms", link_rate=[[0, "20mbit"], [0, 0]], wan_mtu=1500) as c:
        sink = c.popen(1, [sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
        assert netns.read_line(sink, 30) == "ready"
        t0 = time.monotonic()
        c.run(0, [sys.executable, "-c", _SOURCE, c.ip(1), str(size)], timeout=60, check=True)
        out, _ = sink.communicate(timeout=60)
        took = time.monotonic() - t0
        st = c.wan_stats()
    n, digest = out.split()
    assert int(n) == size and digest == want
    assert took >= 0.95 * size * 8 / 20e6, took
    assert st["rate_drops"][1][0] == 0 and st["lost"] == [[0, 0], [0, 0]]


def test_pairs_on_one_wire_share_its_rate():
    """Host 0 reaches hosts 1 and 2 over one 20 Mbit/s wire (an uplink): 1 MiB to each at once
    cannot arrive sooner than the wire sends both; the forwarder drops nothing else."""
    _need_netns()
    size = 1 << 20
    want = hashlib.sha256(random.Random(7).randbytes(size)).hexdigest()
    with netns.Cluster(3, delay="1ms", link_rate=lambda i, j: "20mbit" if i == 0 else 0,
                       link_wire=lambda i, j: "up" if i == 0 else (i, j), wan_mtu=1500) as c:
        sinks = [c.popen(h, [sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True) for h in (1, 2)]
        assert all(netns.read_line(s, 30) == "ready" for s in sinks)
        t0 = time.monotonic()
        sources = [c.popen(0, [sys.executable, "-c", _SOURCE, c.ip(h), str(size)]) for h in (1, 2)]
        outs = [s.communicate(timeout=60)[0] for s in sinks]
        took = time.monotonic() - t0
        assert [p.wait(timeout=60) for p in sources] == [0, 0]
        st = c.wan_stats()
    for out in outs:
        n, digest = out.split()
        assert int(n) == size and digest == want
    assert took >= 0.95 * 2 * size * 8 / 20e6, took
    assert st["lost"] == [[0] * 3] * 3


_LONG_LINK_RANK = r"""
import os, torch, rumor
rumor.init(timeout=60)
r = rumor.rank()
n = 3 * (1 << 20) + 5  # 12 MiB of float32: the ring sends each block in several pieces
base = torch.arange(n, dtype=torch.float32).remainder(97)
y = rumor.allreduce(base * (r + 1), op=rumor.ReduceOp.AVG)
assert torch.equal(y, base * 1.5), "allreduce over the long link differs from the reference"
if r == 1:
    # This host runs rank 1 alone: its established TCP connections, the store's aside, are the
    # streams of the one pair.
    store = int(os.environ["MASTER_PORT"])
    count = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, remote, state = line.split()[1:4]
            ports = {int(local.split(":")[1], 16), int(remote.split(":")[1], 16)}
            count += state == "01" and store not in ports
    print("established", count, flush=True)
# Rank 0 must not close the pair's streams before rank 1 has counted them.
rumor.barrier()
rumor.shutdown()
"""


def _sysctl_last(name: str) -> int:
    with open("/proc/sys/" + name.replace(".", "/")) as f:
        return int(f.read().split()[-1])


def test_long_link_gets_streams_for_its_bandwidth_delay_product(tmp_path):
    """A pair 20 ms apart gets ceil(rate x round trip / window) streams (net/link.h), both ends
    use them all, and the allreduce through them is exact."""
    _need_netns()
    from rumor.testing import launch

    rate_gbit = 20
    with netns.Cluster(2, delay="10ms") as c, \
            launch.Ranks([sys.executable, "-c", _LONG_LINK_RANK], world=2, cluster=c,
                         env={"RUMOR_LINK_GBIT": rate_gbit, "RUMOR_LOG": "debug"}, pipe_stdout=[1]) as ranks:
        codes = ranks.wait(timeout=120)
        out = ranks.procs[1].stdout.read().decode()
        assert codes == [0, 0], ranks.report()
        log = ranks.log(1)
    said = [ln for ln in log.splitlines() if "ms away:" in ln]
    assert said, f"rank 1 (the dialer) did not log its long-link sizing:\n{log[-3000:]}"
    rtt_ms = float(said[0].split(" is ")[1].split(" ms away")[0])
    streams = int(said[0].split("ms away: ")[1].split(" TCP streams")[0])
    assert rtt_ms >= 20.0, said[0]  # never below the emulated round trip
    # The rule, from this namespace's limits (payload is half of a socket buffer).
    window = min(max(_sysctl_last("net.ipv4.tcp_wmem") // 2, _sysctl_last("net.core.wmem_max")),
                 max(_sysctl_last("net.ipv4.tcp_rmem") // 2, _sysctl_last("net.core.rmem_max")))
    want = min(16, max(2, -(-int(rate_gbit * 1.25e8 * rtt_ms * 1e-3) // window)))
    assert streams == want, (said[0], window)
    assert streams > 2, said[0]  # more than the default: the delay is what asked for them
    assert f"established {streams}" in out, out


def test_cleanup_after_exception_leaves_nothing():
    _need_netns()
    with pytest.raises(RuntimeError, match="boom"):
        with netns.Cluster(2, delay="1ms") as c:
            fw = c._wanem.pid
            names = c.namespaces
            raise RuntimeError("boom")
    assert _gone(fw)
    assert not set(names) & set(netns._netns_names())


_ORPHAN = r"""
import importlib.util, sys, time
# The module file alone (stdlib only): importing the rumor package would import torch.
spec = importlib.util.spec_from_file_location("netns", sys.argv[1])
netns = sys.modules["netns"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(netns)
c = netns.Cluster(2, delay="1ms").start()
print(c._wanem.pid, flush=True)
time.sleep(60)
"""


def test_forwarder_exits_when_its_parent_is_killed():
    _need_netns()
    p = subprocess.Popen([sys.executable, "-c", _ORPHAN, netns.__file__], stdout=subprocess.PIPE, text=True)
    try:
        fw = int(netns.read_line(p, 60))
        p.send_signal(signal.SIGKILL)  # no cleanup runs: the forwarder must notice by itself
        p.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(fw):
            assert time.monotonic() < deadline, "rumor-wanem outlived its parent"
            time.sleep(0.02)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        netns.cleanup_stale()  # the SIGKILLed parent left its namespaces


def test_forwarder_outlives_the_thread_that_started_it():
    # PR_SET_PDEATHSIG fires when the starting *thread* exits; the forwarder must stay while its
    # process lives.
    _need_netns()
    import threading

    box = {}
    t = threading.Thread(target=lambda: box.setdefault("c", netns.Cluster(2, delay="1ms").start()))
    t.start()
    t.join(60)
    c = box["c"]
    try:
        assert netns.ping_rtt(c, 0, 1, count=3, gap=0.0)["lost"] == 0
        assert c.wan_stats()["forwarded"][0][1] >= 3
        assert c._wanem.poll() is None
    finally:
        c.close()
