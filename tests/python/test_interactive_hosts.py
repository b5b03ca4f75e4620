"""rumor.interactive.start(hosts=...): ranks laid out over several hosts.

Pure-Python checks of the host list parsing, the rank layout and the launcher commands run
everywhere. The end-to-end tests run on two emulated hosts (Linux network namespaces,
rumor.testing.netns; root only, skipped with the reason otherwise): the "notebook" is a driver
process inside host 0's namespace, which starts the controller there and the engines on both
hosts through the launcher `ip netns exec <namespace>`. Every wait has a deadline."""
import glob
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import harness
import numpy as np
import pytest

from rumor.interactive import _check_args, _hosts

# ---- pure Python: hosts parsing, layout, launcher commands --------------------------------------


def _layout(hosts, n):
    return [(h.name, list(h.ranks)) for h in _hosts.layout(hosts, n)]


def test_layout_with_slots_fills_hosts_in_order():
    assert _layout(["a:2", "b:2"], 4) == [("a", [0, 1]), ("b", [2, 3])]
    assert _layout(["a:3", "b:4"], 5) == [("a", [0, 1, 2]), ("b", [3, 4])]
    # Hosts left without a rank are dropped, as horovodrun does.
    assert _layout(["a:4", "b:4"], 3) == [("a", [0, 1, 2])]
    assert _layout(["[fe80::1]:2", "10.0.0.2:1"], 3) == [("fe80::1", [0, 1]), ("10.0.0.2", [2])]


def test_layout_without_slots_splits_evenly():
    assert _layout(["a", "b"], 4) == [("a", [0, 1]), ("b", [2, 3])]
    assert _layout(["a", "b", "c"], 5) == [("a", [0, 1]), ("b", [2, 3]), ("c", [4])]
    assert _layout(["fe80::1"], 2) == [("fe80::1", [0, 1])]


@pytest.mark.parametrize("hosts, n, match", [
    (["a:2", "b:1"], 4, r"3 slot\(s\) .*n=4"),
    (["a:2", "b"], 3, r"\['b'\] have no slots"),
    (["a:2", "a:2"], 4, r"'a:2' names host 'a' again"),
    (["a:0"], 1, r"'a:0': slots must be a positive"),
    (["a:x"], 1, r"'a:x': slots must be a positive"),
    ([":2"], 1, r"':2': the host name must be non-empty"),
    (["-oProxyCommand=x:2"], 1, r"must not start with '-'"),
    (["a b:2"], 1, r"without spaces"),
    (["[fe80::1:2"], 1, r"in brackets"),
    (["a", "b", "c"], 2, r"3 hosts for n=2"),
    ([], 1, r"must not be empty"),
])
def test_bad_hosts_name_the_entry(hosts, n, match):
    with pytest.raises(ValueError, match=match):
        _check_args(n, hosts, 30.0, 60.0)


def test_hosts_type_errors():
    with pytest.raises(TypeError, match="hosts must be a list"):
        _check_args(2, "a:2", 30.0, 60.0)
    with pytest.raises(TypeError, match="every hosts entry must be a str"):
        _check_args(2, ["a:1", 3], 30.0, 60.0)
    with pytest.raises(TypeError, match="launcher must be None"):
        _check_args(2, ["a:2"], 30.0, 60.0, launcher=42)
    with pytest.raises(ValueError, match="must contain '{host}'"):
        _check_args(2, ["a:2"], 30.0, 60.0, launcher="ip netns exec")
    with pytest.raises(ValueError, match="launcher= needs hosts="):
        _check_args(2, None, 30.0, 60.0, launcher="ssh {host}")


def test_only_this_machine_is_the_one_host_session():
    assert _check_args(4, ["localhost:4"], 30.0, 60.0) is None
    # A launcher makes every host go through it, even one named localhost.
    assert _check_args(4, ["localhost:4"], 30.0, 60.0, launcher="ip netns exec {host}") is not None
    assert [h.name for h in _check_args(4, ["localhost:2", "node9:2"], 30.0, 60.0)] == ["localhost", "node9"]


def test_launcher_commands():
    argv = ["/opt/py/bin/python", "/opt/x y/_proc.py", "engine-stdin"]
    # ssh: the remote shell parses one string, so the command is quoted.
    assert _hosts.command(None, "node1", argv, local=False) == [*_hosts.SSH, "node1",
                                                                "/opt/py/bin/python '/opt/x y/_proc.py' engine-stdin"]
    assert _hosts.command(None, "localhost", argv, local=True) == argv
    assert _hosts.command("ip netns exec {host}", "ns1", argv, local=False) == ["ip", "netns", "exec", "ns1", *argv]
    assert _hosts.command(["ssh", "-p", "2222", "{host}"], "n2", argv, local=True) == ["ssh", "-p", "2222", "n2", *argv]
    wrap = _hosts.command(lambda h, a: ["run-on", h, "--", *a], "n3", argv, local=False)
    assert wrap == ["run-on", "n3", "--", *argv]
    with pytest.raises(TypeError, match="must return a list of str"):
        _hosts.command(lambda h, a: "run-on " + h, "n3", argv, local=False)


def test_engines_get_the_notebooks_rumor_settings_but_not_its_host_identity(monkeypatch):
    from rumor.interactive._launch import _forwarded_env

    for k in [k for k in os.environ if k.startswith("RUMOR_") or k == "OMP_NUM_THREADS"]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("RUMOR_SOCKET_STREAMS", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("RUMOR_HOST_ID", "notebook-box")
    monkeypatch.setenv("RUMOR_ADVERTISE_ADDR", "10.0.0.1")
    monkeypatch.setenv("RUMOR_INTERACTIVE_SLOT", "0")
    assert _forwarded_env() == {"RUMOR_SOCKET_STREAMS": "3", "OMP_NUM_THREADS": "2"}


def test_rumor_run_interactive_rejects_bad_hosts(capsys):
    from rumor.interactive.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["-n", "4", "--hosts", "a:2,b:1"])
    assert e.value.code == 2
    assert "hosts offer 3 slot(s)" in capsys.readouterr().err


def test_launcher_that_hangs_fails_within_start_timeout_and_leaves_nothing():
    """A host whose launcher never starts the engine (a hung ssh, say): start() gives up at
    start_timeout naming the hosts, and the launcher processes are gone afterwards."""
    pytest.importorskip("ipyparallel", reason="rumor.interactive needs ipyparallel >= 8 (scripts/setup.sh installs it)")
    import rumor.interactive as ri
    from rumor.interactive import _session

    made = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        p = real_popen(*args, **kwargs)
        made.append(p.pid)
        return p

    t0 = time.monotonic()
    try:
        subprocess.Popen = recording_popen
        with pytest.raises(TimeoutError) as e:
            ri.start(n=2, hosts=["hung-a", "hung-b"], launcher=["sh", "-c", "exec sleep 300", "{host}"],
                     controller_ip="127.0.0.1", start_timeout=4, quiet=True)
    finally:
        subprocess.Popen = real_popen
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "0 of 2 engines registered within 4 s" in msg, msg
    assert "rank 0 on host 'hung-a' has not registered" in msg and "rank 1 on host 'hung-b'" in msg, msg
    assert _session._session is None
    assert len(made) >= 2
    assert [p for p in made if harness.pid_alive(p)] == [], (made, took)


# ---- end to end on two emulated hosts ----------------------------------------------------------

DRIVER = r'''
import json, os, subprocess, sys, time
import rumor.interactive as ri
from rumor.interactive import _session

spec = json.loads(sys.argv[1])
ns_of = spec["ns_of"]
out = {}

def emit(key, value):
    print(json.dumps({key: value}), flush=True)

def launcher(host, argv):
    # An unknown host gets a namespace that does not exist: `ip netns exec` fails like an
    # unreachable ssh host does, with a message on stderr.
    return ["ip", "netns", "exec", ns_of.get(host, "rmr-no-such-host"), *argv]

hosts = [f"{ip}:2" for ip in spec["ips"]]
try:
    ri.start(n=4, hosts=[hosts[0], "unreachable-host:2"], launcher=launcher, timeout=20, start_timeout=60, quiet=True)
    emit("bad_host", "started")
except Exception as e:
    emit("bad_host", f"{type(e).__name__}: {e}")
emit("after_bad", ri._session._session is None)

ri.start(n=4, hosts=hosts, launcher=launcher, timeout=20, start_timeout=150, quiet=True)
s = _session.current()
emit("session", {"pids": s.all_pids(), "engine_pids": s.pids, "pid_local": s.pid_local,
                 "controller_ip": s.controller_ip, "shm_prefixes": s.shm_prefixes,
                 "profile_dir": s.profile_dir})
ri.run("""
import os, socket
t = torch.tensor([float(rumor.rank() + 1)], dtype=torch.float64)
h = rumor.allreduce(t, op=rumor.ReduceOp.SUM, hierarchical=True)
rumor.allreduce_(t, op=rumor.ReduceOp.SUM)
rumor.set_topology(rumor.topology.ExponentialGraph(rumor.size()))
x = rumor.neighbor_allreduce(torch.tensor([float(rumor.rank())], dtype=torch.float64))
info = dict(rank=rumor.rank(), size=rumor.size(), local_rank=rumor.local_rank(), local_size=rumor.local_size(),
            machine_rank=rumor.machine_rank(), machine_size=rumor.machine_size(),
            env_local_rank=int(os.environ["LOCAL_RANK"]), env_local_size=int(os.environ["LOCAL_WORLD_SIZE"]),
            host=os.environ["RUMOR_INTERACTIVE_HOST"], netns=os.readlink("/proc/self/ns/net"),
            allreduce=t.item(), hierarchical=h.item(), neighbor=x.item())
""")
emit("ranks", ri.pull("info"))
emit("status", ri.status())
emit("shm_prefixes", s.shm_prefixes)

# As on real remote hosts, where the engines' pids mean nothing here: interrupts go through
# ipyparallel's nanny, a death is seen when the launcher process ends.
s.pid_local = [False] * s.n
try:
    ri.run("import time\nfor _ in range(2000): time.sleep(0.05)", timeout=1)
    emit("interrupted", "no error")
except ri.RankError as e:
    emit("interrupted", {str(r): f[0] for r, f in e.failures.items()})
emit("after_interrupt", ri.run("rumor.rank() * 10"))
try:
    ri.run("import os, signal\nif rumor.rank() == 3: os.kill(os.getpid(), signal.SIGKILL)")
    emit("died", "no error")
except ri.RankError as e:
    emit("died", {"first": e.first, "message": str(e)})
ri.stop()
emit("stopped", True)
'''


def _namespace_pids(ns):
    r = subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=20)
    return {int(t) for t in r.stdout.split()}


def _left(cluster, allowed, timeout):
    """Processes still inside the emulated hosts' namespaces (besides `allowed`), after waiting
    at most `timeout` seconds for them to go."""
    deadline = time.monotonic() + timeout
    while True:
        left = {h.netns: sorted(_namespace_pids(h.netns) - set(allowed)) for h in cluster.hosts}
        left = {k: v for k, v in left.items() if v}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _read_events(proc, until, deadline):
    """JSON lines from the driver until the key `until` arrives (or it exits, or the deadline)."""
    events, buf = {}, b""
    while until not in events:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None and not select.select([proc.stdout], [], [], 0)[0]:
            break
        if select.select([proc.stdout], [], [], min(left, 1.0))[0]:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    events.update(json.loads(line))
                except ValueError:
                    events.setdefault("_noise", []).append(line.decode(errors="replace"))
    return events


def _neighbor_reference(n):
    """float64 reference of one neighbor average over ExponentialGraph(n) from x_i = i: rank i
    receives from i - 2^k (mod n), weights 1 / (in_degree + 1)."""
    out = []
    for i in range(n):
        srcs = {(i - 2 ** k) % n for k in range(n.bit_length()) if 2 ** k < n}
        out.append(sum(float(j) for j in srcs | {i}) / (len(srcs) + 1))
    return out


@pytest.fixture
def cluster():
    pytest.importorskip("ipyparallel", reason="rumor.interactive needs ipyparallel >= 8 (scripts/setup.sh installs it)")
    from rumor.testing import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(f"emulated hosts need Linux network namespaces: {why}")
    with netns.Cluster(2) as c:
        yield c


def _start_driver(cluster, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    spec = {"ips": [h.ip for h in cluster.hosts], "ns_of": {h.ip: h.netns for h in cluster.hosts}}
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RUMOR_TIMEOUT"):
        env.pop(var, None)
    env["OMP_NUM_THREADS"] = "1"
    return cluster.popen(0, [sys.executable, str(script), json.dumps(spec)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)


def _stderr(proc):
    try:
        return proc.stderr.read().decode(errors="replace")[-3000:] if proc.poll() is not None else ""
    except (OSError, ValueError):
        return ""


def test_two_hosts_allreduce_neighbors_status_and_clean_stop(cluster, tmp_path):
    driver = _start_driver(cluster, tmp_path)
    try:
        ev = _read_events(driver, "stopped", time.monotonic() + 240)
        assert "stopped" in ev, f"driver did not finish: events {ev}, stderr: {_stderr(driver)}"
        assert driver.wait(30) == 0, _stderr(driver)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(10)

    # An unreachable host: the error names it and carries the launcher's own message; start()
    # left no session behind.
    assert ev["bad_host"].startswith("RuntimeError: "), ev["bad_host"]
    assert "'unreachable-host'" in ev["bad_host"], ev["bad_host"]
    assert "rmr-no-such-host" in ev["bad_host"], ev["bad_host"]  # ip netns exec's stderr
    assert ev["after_bad"] is True

    ips = [h.ip for h in cluster.hosts]
    ranks = ev["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    ref = _neighbor_reference(4)
    for r, info in enumerate(ranks):
        host = r // 2
        assert info["size"] == 4
        assert info["host"] == ips[host]
        assert (info["local_rank"], info["env_local_rank"]) == (r % 2, r % 2)
        assert (info["local_size"], info["env_local_size"]) == (2, 2)
        assert (info["machine_rank"], info["machine_size"]) == (host, 2)
        assert info["allreduce"] == info["hierarchical"] == 10.0  # 1 + 2 + 3 + 4, exact in float64
        np.testing.assert_allclose(info["neighbor"], ref[r], rtol=1e-12)
    # Ranks of one host share a network namespace, the two hosts do not.
    assert ranks[0]["netns"] == ranks[1]["netns"] != ranks[2]["netns"] == ranks[3]["netns"]
    assert [row["host"] for row in ev["status"]] == [ips[0], ips[0], ips[1], ips[1]]
    assert all(row["state"] == "idle" for row in ev["status"]), ev["status"]
    assert ev["session"]["controller_ip"] == ips[0]
    assert all(ev["session"]["pid_local"])  # namespaces share this machine's pids

    # Remote-style control: the cell limit interrupts every rank through the nanny, the
    # session stays usable; a killed rank is named with its host.
    assert ev["interrupted"] == {str(r): "CellTimeout" for r in range(4)}, ev["interrupted"]
    assert ev["after_interrupt"] == ["0", "10", "20", "30"]
    assert ev["died"]["first"] == 3, ev["died"]
    assert f"rank 3 (engine pid {ev['session']['engine_pids'][3]} on host '{ips[1]}') died" in ev["died"]["message"]

    # Nothing is left: no process of the session, none in either host, no /dev/shm name.
    pids = ev["session"]["pids"]
    assert set(ev["session"]["engine_pids"]) <= set(pids)
    assert [p for p in pids if harness.pid_alive(p)] == []
    assert [p for pre in ev["session"]["shm_prefixes"] for p in glob.glob(f"/dev/shm/{pre}*")] == []
    assert _left(cluster, allowed=(), timeout=10) == {}
    assert ev["shm_prefixes"], "the 4-rank job used no shared memory between the ranks of a host"
    assert [p for pre in ev["shm_prefixes"] for p in glob.glob(f"/dev/shm/{pre}*")] == []
    assert not os.path.exists(ev["session"]["profile_dir"])


def test_rumor_run_interactive_hosts_killed_leaves_nothing(cluster, tmp_path):
    """`rumor-run --interactive --hosts` with a launcher template and --controller-ip, then
    SIGKILLed as a notebook kernel can be: nothing may stay on either host."""
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RUMOR_TIMEOUT"):
        env.pop(var, None)
    env["OMP_NUM_THREADS"] = "1"
    hosts = ",".join(f"{h.netns}:2" for h in cluster.hosts)  # the template puts the namespace in {host}
    conn = tmp_path / "conn.json"
    cli = cluster.popen(0, [sys.executable, "-m", "rumor.run", "--interactive", "-n", "4", "--hosts", hosts,
                            "--launcher", "ip netns exec {host}", "--controller-ip", cluster.ip(0),
                            "--start-timeout", "150", "--connection-file", str(conn)],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    out = b""
    try:
        deadline = time.monotonic() + 200
        while b"Ctrl-C here stops the ranks" not in out and time.monotonic() < deadline and cli.poll() is None:
            if select.select([cli.stdout], [], [], 1.0)[0]:
                out += os.read(cli.stdout.fileno(), 65536)
        text = out.decode(errors="replace")
        assert "4 rank(s) running on " + ", ".join(sorted(h.netns for h in cluster.hosts)) in text, text
        info = json.loads(conn.read_text())
        assert info["hosts"] == [cluster.hosts[0].netns] * 2 + [cluster.hosts[1].netns] * 2
        pids = info["pids"]
        assert all(harness.pid_alive(p) for p in pids)
        assert set(pids[2:]) <= _namespace_pids(cluster.hosts[1].netns)  # ranks 2, 3 run on host 1
    finally:
        # As a notebook kernel (or the shell running rumor-run) is killed: no stop(), no atexit.
        # (Unless it exited already: then the assertion above says why.)
        if cli.poll() is None:
            os.kill(cli.pid, signal.SIGKILL)
        cli.wait(10)
    # The engines read EOF on the stdin the killed process held, the controller's watchdog sees
    # its owner gone; each kills its own process group.
    left = _left(cluster, allowed=(), timeout=20)
    assert left == {}, f"still running after rumor-run was killed: {left}"
    assert [p for p in pids if harness.pid_alive(p)] == []
    # The controller's watchdog removes the session's private profile directory (it may still be
    # at it when the last process in the namespaces is gone).
    profile = os.path.dirname(os.path.dirname(info["client_file"]))
    deadline = time.monotonic() + 20
    while os.path.exists(profile) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(profile), f"the profile directory {profile} is still there"
