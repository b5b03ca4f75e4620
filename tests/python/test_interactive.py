"""rumor.interactive against a real Jupyter kernel (no browser): the example notebook executed by
nbclient, and one kernel driven cell by cell through start/stop, a skipped collective, an
engine killed mid-cell, and finally the kernel itself killed.

Each kernel runs the interpreter running pytest, through a kernelspec written to a temporary
JUPYTER_PATH, so the engines import this checkout's rumor. Every cell has a deadline."""
import glob
import json
import os
import re
import signal
import sys
import time

import harness
import numpy as np
import pytest

pytest.importorskip("ipyparallel", reason="rumor.interactive needs ipyparallel >= 8 (scripts/setup.sh installs it)")
nbclient = pytest.importorskip("nbclient", reason="the notebook tests need nbclient (scripts/setup.sh installs it)")
nbformat = pytest.importorskip("nbformat", reason="the notebook tests need nbformat (scripts/setup.sh installs it)")
pytest.importorskip("ipykernel", reason="the notebook tests need ipykernel (scripts/setup.sh installs it)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "examples", "interactive.ipynb")
KERNEL = "rumor-test-python"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def kernelspec(tmp_path, monkeypatch):
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "rumor test python", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # The kernel and its engines must not take the test's own launcher variables.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RUMOR_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    return KERNEL


def _left(pids, timeout):
    """Waits (bounded) until neither the pids nor anything in their process groups runs (each
    was started in a session of its own, so its group holds what it forked, e.g. the
    controller's schedulers); returns what still runs."""
    from rumor.interactive._launch import group_members

    deadline = time.monotonic() + timeout
    while True:
        left = sorted(set(p for p in pids if harness.pid_alive(p)) | set(group_members(pids)))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _shm(prefixes):
    return [p for pre in prefixes for p in glob.glob(f"/dev/shm/{pre}*")]


def _text(outputs, name="stdout"):
    return "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == name)


def _consensus_reference(n, steps):
    """float64 reference of `steps` neighbor averages over ExponentialGraph(n): rank i receives
    from i - 2^k (mod n) with uniform weights 1 / (in_degree + 1)."""
    W = np.zeros((n, n))
    for i in range(n):
        srcs = {(i - 2 ** k) % n for k in range(n.bit_length()) if 2 ** k < n}
        for j in srcs | {i}:
            W[i, j] = 1.0 / (len(srcs) + 1)
    x = np.arange(n, dtype=np.float64)
    for _ in range(steps):
        x = W @ x
    return x


def test_example_notebook(kernelspec, tmp_path, monkeypatch):
    plot = tmp_path / "distance.png"
    monkeypatch.setenv("RUMOR_EXAMPLE_PLOT", str(plot))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=kernelspec, timeout=120, startup_timeout=60,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    status = _text(code[1].outputs)
    assert re.findall(r"^\s*(\d) ", status, re.M) == ["0", "1", "2", "3"], status
    consensus = _text(code[2].outputs)
    lines = sorted(re.findall(r"^\[rank (\d)\] consensus value ([0-9.]+), in-neighbors \[(.*)\]$", consensus, re.M))
    assert [int(r) for r, _, _ in lines] == [0, 1, 2, 3], consensus
    ref = _consensus_reference(4, 30)
    for r, v, nbrs in lines:
        assert float(v) == pytest.approx(ref[int(r)], abs=1e-6)
        assert sorted(int(x) for x in nbrs.split(",")) == sorted({(int(r) - 1) % 4, (int(r) - 2) % 4})
    pulled = re.search(r"per rank: \[(.*)\]", _text(code[3].outputs)).group(1)
    np.testing.assert_allclose([float(v) for v in pulled.split(",")], ref, rtol=0, atol=1e-12)
    training = _text(code[4].outputs)
    dists = re.findall(r"^\[rank (\d)\] loss ([0-9.]+) -> ([0-9.]+), distance to mean ([0-9.e+-]+) -> ([0-9.e+-]+)$",
                       training, re.M)
    assert sorted(int(d[0]) for d in dists) == [0, 1, 2, 3], training
    for _, _, _, d0, d1 in dists:
        assert float(d1) < float(d0)  # mixing pulls the replicas together
    assert "rank 0 weight norm" in _text(code[5].outputs)
    assert not re.search(r"^\[rank", _text(code[5].outputs), re.M)  # %%rank0 runs on rank 0 only, unprefixed
    with open(plot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


class _Kernel:
    def __init__(self, kernel_name):
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(kernel_name=kernel_name, startup_timeout=60)

    def run(self, code, timeout=90):
        outputs = []
        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=lambda m: outputs.append(m))
        stdout = "".join(m["content"]["text"] for m in outputs
                         if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")
        err = reply["content"] if reply["content"]["status"] == "error" else None
        if err is not None:
            err = dict(err, traceback=ANSI.sub("", "\n".join(err["traceback"])))
        return stdout, err

    def ok(self, code, timeout=90):
        out, err = self.run(code, timeout)
        assert err is None, f"{err['ename']}: {err['evalue']}\n{err['traceback']}"
        return out

    def info(self):
        out = self.ok("import json; _s = ri.session(); "
                      "print('INFO' + json.dumps({'pids': _s.all_pids(), 'shm': _s.shm_prefixes, 'profile': _s.profile_dir}))")
        return json.loads(out.split("INFO", 1)[1])


def _failures(traceback):
    """rank -> error name from a RankError's rendering, first rank first."""
    return [(int(r), name) for r, name in re.findall(r"^--- rank (\d+)(?: of \d+)?: (\w+)", traceback, re.M)]


def test_session_lifecycle(kernelspec):
    k = _Kernel(kernelspec)
    seen_pids, seen_shm, profiles = [], [], []
    try:
        # start / stop twice in a row in one kernel; nothing outlives stop()
        for _ in range(2):
            k.ok("import rumor.interactive as ri\nri.start(3, timeout=4, quiet=True)")
            info = k.info()
            seen_pids += info["pids"]
            seen_shm += info["shm"]
            profiles.append(info["profile"])
            assert len(info["pids"]) == 4 and all(harness.pid_alive(p) for p in info["pids"])  # 3 engines + controller
            out = k.ok("%%rumor\nt = torch.full((2,), float(rumor.rank()))\nrumor.allreduce_(t, op=rumor.ReduceOp.SUM)\nprint(t.tolist())")
            assert sorted(re.findall(r"^\[rank (\d)\] \[3.0, 3.0\]$", out, re.M)) == ["0", "1", "2"], out
            k.ok("ri.stop()")
            assert _left(info["pids"], 10) == []
            assert _shm(info["shm"]) == []
            assert not os.path.exists(info["profile"])

        k.ok("ri.start(3, timeout=30, quiet=True)")
        # a collective that rank 1 skips: rumor's deadline error on every rank that entered it,
        # at the cell's deadline (not the session's 30 s)
        out, err = k.run("%%rumor --timeout 4\nif rumor.rank() != 1:\n    rumor.allreduce_(torch.ones(4))")
        assert err is not None and err["ename"] == "RankError", (out, err)
        # Ranks 0 and 2 fail, with the deadline error; a rank whose peer timed out first may
        # instead get the PeerError that the peer's abort sends (it quotes the timeout).
        failures = sorted(_failures(err["traceback"]))
        assert [r for r, _ in failures] == [0, 2], err["traceback"]
        assert {e for _, e in failures} <= {"CommTimeoutError", "PeerError"}, err["traceback"]
        assert "CommTimeoutError" in {e for _, e in failures}, err["traceback"]
        assert "timed out after 4" in err["traceback"], err["traceback"]
        assert "restart()" in err["traceback"]
        # restart() with one call, and the session works again
        k.ok("ri.restart()")
        out = k.ok("%%rumor\nt = torch.ones(2) * (rumor.rank() + 1)\nrumor.allreduce_(t, op=rumor.ReduceOp.SUM)\nprint(t.tolist())")
        assert sorted(re.findall(r"^\[rank (\d)\] \[6.0, 6.0\]$", out, re.M)) == ["0", "1", "2"], out
        # a cell's deadline holds for that cell only, on every rank
        out = k.ok("%%rumor --timeout 7\nprint('DL', rumor.get_timeout())")
        assert sorted(re.findall(r"^\[rank (\d)\] DL 7.0$", out, re.M)) == ["0", "1", "2"], out
        out = k.ok("%%rumor\nprint('DL', rumor.get_timeout())")
        assert sorted(re.findall(r"^\[rank (\d)\] DL 30.0$", out, re.M)) == ["0", "1", "2"], out

        # an engine killed mid-cell: the error names the rank, first
        info = k.info()
        seen_pids += info["pids"]
        seen_shm += info["shm"]
        victim = info["pids"][2]
        out, err = k.run("%%rumor\nimport os, signal\nrumor.allreduce_(torch.ones(2))\n"
                         "if rumor.rank() == 2:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                         "rumor.allreduce_(torch.ones(2))")
        assert err is not None and err["ename"] == "RankError", (out, err)
        assert err["evalue"].startswith(f"rank 2: EngineDied: rank 2 (engine pid {victim}) died"), err["evalue"]
        fails = _failures(err["traceback"])
        assert fails[0] == (2, "EngineDied") and {r for r, _ in fails} == {0, 1, 2}, err["traceback"]
        assert "must be restarted" in err["traceback"]
        k.ok("ri.restart()")  # new engines
        out = k.ok("%%rumor\nprint(rumor.rank(), rumor.size())")
        assert sorted(re.findall(r"^\[rank (\d)\] \1 3$", out, re.M)) == ["0", "1", "2"], out
        status = k.ok("%rumor_status")
        assert len(re.findall(r"^\s+\d\s.*idle$", status, re.M)) == 3, status

        # the kernel killed with the session running: engines and controller notice and exit
        info = k.info()
        seen_pids += info["pids"]
        seen_shm += info["shm"]
        k.km.shutdown_kernel(now=True)
        assert _left(info["pids"], 15) == []
        assert not os.path.exists(info["profile"])
    finally:
        try:
            k.km.shutdown_kernel(now=True)
        except Exception:
            pass
        for p in seen_pids:  # never leave a process behind, even when an assertion failed
            try:
                os.killpg(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    assert _left(seen_pids, 5) == []
    assert _shm(seen_shm) == []


# start(2), record every process it started, stop(): nothing of it may still run when stop()
# returns (no waiting after it), and its own children must be reaped (kill(pid, 0) fails).
STOP_PROBE = """
import json, os, sys
import rumor.interactive as ri
from rumor.interactive import _session

def proc_table():  # pid -> (parent, state, start time)
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().decode(errors="replace").rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(d)] = (int(fields[1]), fields[0], fields[19])
    return out

ri.start(2, timeout=30, quiet=True)
# Independently of what the session tracks: everything descended from this process now.
table = proc_table()
found, todo = {}, [os.getpid()]
while todo:
    p = todo.pop()
    for c, (pp, state, start) in table.items():
        if pp == p and c not in found:
            found[c] = start
            todo.append(c)
for p in _session.current().all_pids():
    found.setdefault(p, table[p][2])
ri.stop()
after = proc_table()
same = {p: after[p] for p, start in found.items() if p in after and after[p][2] == start}
running = sorted(p for p, (pp, state, _) in same.items() if state not in ("Z", "X"))
children = []
for p, (pp, state, _) in same.items():
    if pp == os.getpid():
        try:
            os.kill(p, 0)
            children.append(p)
        except ProcessLookupError:
            pass
print("RESULT " + json.dumps({"recorded": len(found), "running": running, "unreaped_children": children}))
"""


def test_stop_returns_after_every_process_exited(tmp_path):
    # The rumor this process imports (installed in CI, the checkout's where PYTHONPATH says so).
    import rumor

    here = os.path.dirname(os.path.dirname(os.path.abspath(rumor.__file__)))
    env = {"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    text = harness.launch([sys.executable, "-c", STOP_PROBE], str(tmp_path), env, deadline_s=150)
    res = json.loads(re.search(r"^RESULT (.*)$", text, re.M).group(1))
    # 2 engines and the controller at least, with whatever they started
    assert res["recorded"] >= 3 and res["running"] == [] and res["unreaped_children"] == [], (res, text[-3000:])


def test_the_watchdog_removes_a_directory_its_own_process_still_writes_into(tmp_path):
    """The controller's watchdog removes the session's profile directory while the controller's
    own main thread may still write into it (ipyparallel's hub saves its engine state when the
    engines go): the directory must be gone all the same when the process has ended."""
    import subprocess

    import rumor.interactive

    profile = tmp_path / "profile"
    (profile / "log").mkdir(parents=True)
    proc_dir = os.path.dirname(rumor.interactive.__file__)
    code = f"""
import os, sys, threading, time
sys.path.insert(0, {proc_dir!r})
import _proc
log = os.path.join({str(profile)!r}, "log")
started = threading.Event()
def write():
    i = 0
    while True:
        try:
            with open(os.path.join(log, f"engines{{i % 64}}.json"), "w") as f:
                f.write("{{}}")
        except OSError:
            pass
        i += 1
        if i == 64:
            started.set()
threading.Thread(target=write, daemon=True).start()
started.wait(30)
_proc._end_group({str(profile)!r})
"""
    for _ in range(5):
        profile.mkdir(exist_ok=True)
        (profile / "log").mkdir(exist_ok=True)
        # not a group leader (no new session): _end_group then kills nothing but itself
        p = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
        assert p.returncode == 3, p.stderr
        assert not profile.exists(), sorted(str(q.relative_to(tmp_path)) for q in profile.rglob("*"))
    assert [q.name for q in tmp_path.iterdir()] == []
