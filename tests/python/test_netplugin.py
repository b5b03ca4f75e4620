"""rumor's NCCL net plugin from Python: rumor.netplugin.path() and its command line, the launcher's
--nccl-net-plugin / RUMOR_NCCL_NET_PLUGIN=1, and transfers between two emulated hosts (network
namespaces, rumor.testing.netns; root only, skipped with the reason otherwise) through the
netplugin_peer harness built with the C++ tests, including a peer killed mid-transfer.
Every spawned process has a deadline."""
from __future__ import annotations

import glob
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def _installed_path():
    from rumor import netplugin

    return netplugin.path()


def test_path_is_the_installed_library():
    from rumor import netplugin

    p = netplugin.path()
    assert os.path.isabs(p) and os.path.isfile(p), p
    assert p == os.path.join(netplugin.lib_dir(), "libnccl-net-rumor.so")
    # NCCL reads the plugin's tables through these symbols.
    with open(p, "rb") as f:
        blob = f.read()
    for v in range(8, 13):
        assert f"ncclNetPlugin_v{v}".encode() in blob


def test_path_without_the_library_is_a_clear_error(monkeypatch, tmp_path):
    from rumor import netplugin

    monkeypatch.setattr(netplugin, "lib_dir", lambda: str(tmp_path))
    with pytest.raises(FileNotFoundError, match="NCCL net plugin is not installed"):
        netplugin.path()


def test_environment_serves_full_path_and_short_name():
    from rumor import netplugin

    env = {"LD_LIBRARY_PATH": "/opt/x"}
    got = netplugin.environment(env)
    assert got["NCCL_NET_PLUGIN"] == netplugin.path()
    # NCCL_NET_PLUGIN=rumor resolves to libnccl-net-rumor.so on the search path.
    assert got["LD_LIBRARY_PATH"] == os.pathsep.join([netplugin.lib_dir(), "/opt/x"])


def test_module_command_line(capsys):
    r = subprocess.run([sys.executable, "-m", "rumor.netplugin", "--path"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == _installed_path()
    # --env in-process (one interpreter start above is enough: `import rumor` is not cheap).
    from rumor import netplugin

    assert netplugin._main(["--env"]) == 0
    assert f"export NCCL_NET_PLUGIN={_installed_path()}" in capsys.readouterr().out


WORKER = textwrap.dedent(
    """
    import os
    print("ENV NCCL_NET_PLUGIN=" + os.environ.get("NCCL_NET_PLUGIN", ""), flush=True)
    print("ENV LD_LIBRARY_PATH=" + os.environ.get("LD_LIBRARY_PATH", ""), flush=True)
    """
)


def _launch_env(tmp_path, extra_args, env_extra):
    """rumor-run with one worker that prints its environment; returns {name: value}."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "rumor.run", "--nproc-per-node", "1", "--nnodes", "1", "--master-addr",
           "127.0.0.1", "--master-port", str(harness.free_port()), *extra_args, str(script)]
    out = harness.launch(cmd, tmp_path, env_extra)  # scrubbed env, deadline, exit code
    return dict(line[4:].split("=", 1) for line in out.splitlines() if line.startswith("ENV "))


@pytest.mark.parametrize("how", ["flag", "env"])
def test_rumor_run_sets_the_nccl_environment(tmp_path, how):
    from rumor import netplugin

    args, extra = (["--nccl-net-plugin"], {}) if how == "flag" else ([], {"RUMOR_NCCL_NET_PLUGIN": "1"})
    got = _launch_env(tmp_path, args, extra)
    assert got["NCCL_NET_PLUGIN"] == netplugin.path()
    assert got["LD_LIBRARY_PATH"].split(os.pathsep)[0] == netplugin.lib_dir()


# ---- two emulated hosts -------------------------------------------------------------------------

def _peer_binary():
    """netplugin_peer from RUMOR_NETPLUGIN_PEER or the newest C++ test build under build/."""
    exe = os.environ.get("RUMOR_NETPLUGIN_PEER")
    if exe:
        return exe if os.access(exe, os.X_OK) else None
    found = [p for p in glob.glob(os.path.join(ROOT, "build", "*", "tests", "cpp", "netplugin_peer"))
             if os.access(p, os.X_OK)]
    return max(found, key=os.path.getmtime) if found else None


def _needs_hosts():
    from rumor.testing import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    exe = _peer_binary()
    if exe is None:
        pytest.skip("netplugin_peer is not built (cmake -DRUMOR_BUILD_TESTS=ON; or set RUMOR_NETPLUGIN_PEER)")
    return netns, exe


class _Lines:
    """Lines of a pipe, read by a thread, so waiting for one has a deadline."""

    def __init__(self, pipe):
        self.q: "queue.Queue[str]" = queue.Queue()
        self.all = []
        threading.Thread(target=self._pump, args=(pipe,), daemon=True).start()

    def _pump(self, pipe):
        for line in pipe:
            self.all.append(line)
            self.q.put(line)
        self.q.put(None)

    def wait_for(self, prefix, timeout):
        end = time.monotonic() + timeout
        while True:
            try:
                line = self.q.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None or time.monotonic() > end:
                raise AssertionError(f"no {prefix!r} line within {timeout} s; got:\n{''.join(self.all)[-3000:]}")
            if line.startswith(prefix):
                return line.strip()


def _start_pair(cluster, exe, common, env):
    """Receiver on host 1, sender on host 0 (given the receiver's handle); both over eth0."""
    popen = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    recv = cluster.popen(1, [exe, "--recv", *common], **popen)
    recv_out = _Lines(recv.stdout)
    handle = recv_out.wait_for("HANDLE ", 30).split()[1]
    send = cluster.popen(0, [exe, "--send", *common], **popen)
    send.stdin.write(handle + "\n")
    send.stdin.flush()
    return recv, recv_out, send, _Lines(send.stdout)


def _env():
    env = dict(os.environ)
    env.update(RUMOR_NET_PLUGIN_IFNAME="eth0", RUMOR_NET_PLUGIN_TIMEOUT="20")
    return env


def test_transfer_between_two_emulated_hosts():
    netns, exe = _needs_hosts()
    common = ["--bytes", str(3_000_017), "--iters", "12", "--window", "4", "--verify", "--deadline", "60"]
    with netns.Cluster(2) as cluster:
        recv, recv_out, send, send_out = _start_pair(cluster, exe, common, _env())
        for p, out, name in ((recv, recv_out, "receiver"), (send, send_out, "sender")):
            line = out.wait_for("RESULT ", 60)
            assert p.wait(timeout=30) == 0, f"{name}: {p.stderr.read()[-3000:]}"
            assert '"iters": 12' in line


def test_killed_peer_mid_transfer_is_an_error():
    netns, exe = _needs_hosts()
    # Far more data than the deadline allows, so the sender is surely mid-transfer when killed.
    common = ["--bytes", str(1 << 20), "--iters", "1000000", "--window", "4", "--progress", "--deadline", "40"]
    with netns.Cluster(2) as cluster:
        recv, recv_out, send, _ = _start_pair(cluster, exe, common, _env())
        recv_out.wait_for("PROGRESS ", 30)
        os.killpg(send.pid, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            rc = recv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the receiver did not notice its peer died within 30 s")
        err = recv.stderr.read()
        assert rc == 1, f"receiver exit code {rc}:\n{err[-3000:]}"
        assert time.monotonic() - t0 < 20
        assert "ERROR: receive" in err and "remote error" in err, err[-3000:]
        assert any(s in err for s in ("connection closed by peer", "the peer closed the connection",
                                      "Connection reset")), err[-3000:]
