"""`rumor-run --tls auto` (python/rumor/_tlsauto.py, docs/security.md): the launcher makes the job's
CA and certificates, hands the workers only the paths of 0600 files in this user's private
directory, and removes them when the job ends (success, failure, Ctrl-C). On several nodes every
launcher derives the same CA key from the job secret: CAs made apart from one secret let ranks
connect, CAs from two secrets do not.

Workers force every byte between ranks through TCP (RUMOR_SHM=0, RUMOR_HOST_DIRECT=0), where TLS
runs. Every launcher runs in its own process group with a deadline, killed whole when it passes.
"""
from __future__ import annotations

import hashlib
import json
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import harness
from rumor.testing.launch import kill_process_group

TCP = {"RUMOR_SHM": "0", "RUMOR_HOST_DIRECT": "0"}
DEADLINE_S = harness.LAUNCH_DEADLINE_S

# argv: mode (ok | fail | hang), the number of ranks expected.
WORKER = textwrap.dedent(
    """
    import hashlib, json, os, stat, sys, time
    import torch
    import rumor

    mode, world = sys.argv[1], int(sys.argv[2])
    paths = {v: os.environ[v] for v in ("RUMOR_TLS_CERT", "RUMOR_TLS_KEY", "RUMOR_TLS_CA")}
    for var, path in paths.items():
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode), (var, path, "not a regular file")
        assert st.st_uid == os.geteuid(), (var, path, st.st_uid)
        assert stat.S_IMODE(st.st_mode) == 0o600, (var, path, oct(st.st_mode))
        d = os.lstat(os.path.dirname(path))
        assert d.st_uid == os.geteuid() and stat.S_IMODE(d.st_mode) == 0o700, (path, oct(d.st_mode))
    # The paths travel, never the key: not in any variable, not on this command line or the launcher's.
    with open(paths["RUMOR_TLS_KEY"]) as f:
        key = f.read()
    assert "PRIVATE KEY" in key
    body = "".join(key.strip().splitlines()[1:-1])
    seen = list(os.environ.values())
    for pid in (os.getpid(), os.getppid()):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            seen.append(f.read().decode(errors="replace"))
    for text in seen:
        assert "PRIVATE KEY" not in text and body[:40] not in text.replace("\\n", ""), "key material leaked"
    with open(paths["RUMOR_TLS_CA"], "rb") as f:
        ca = f.read()
    rumor.init()
    r = rumor.rank()
    assert rumor.size() == world
    print("TLS-FILES " + json.dumps({"rank": r, "paths": paths, "ca_sha256": hashlib.sha256(ca).hexdigest(),
                                     "tls": rumor._runtime._state.ctx.tls}), flush=True)
    assert rumor._runtime._state.ctx.tls, "the communicator runs without TLS"
    for size in [7, 300_001]:
        out = rumor.allreduce(torch.full((size,), float(r + 1)), rumor.ReduceOp.SUM)
        assert torch.equal(out, torch.full((size,), float(world * (world + 1) // 2))), out[:4]
    rumor.barrier()
    print(f"WORKER-OK rank {r}", flush=True)
    if mode == "fail":
        sys.exit(3)
    if mode == "hang":
        # The test interrupts the job now; this bound only ends a worker the launcher failed to stop.
        time.sleep(float(os.environ.get("HANG_S", "60")))
    rumor.shutdown()
    """
)


def _private_dir(tmp_path, name="private"):
    d = tmp_path / name
    d.mkdir(mode=0o700)
    return d


def _env(private_dir, **extra):
    return dict(TCP, RUMOR_PRIVATE_DIR=str(private_dir), **extra)


def _cmd(tmp_path, mode="ok", world=2, nproc=2, extra=()):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return [sys.executable, "-m", "rumor.run", "--nproc-per-node", str(nproc), *extra, "--tls", "auto",
            str(script), mode, str(world)]


def _single_node():
    return ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(harness.free_port())]


def _reports(text):
    """Every worker's report. The launcher merges the workers' output streams, so two reports may
    share a line: each is decoded from where it starts to where its JSON ends."""
    decoder, out = json.JSONDecoder(), []
    for part in text.split("TLS-FILES ")[1:]:
        out.append(decoder.raw_decode(part)[0])
    return sorted(out, key=lambda d: d["rank"])


def _tls_files(private_dir):
    return sorted(n for n in os.listdir(private_dir) if n.startswith("rumor_tls-"))


class Launcher:
    """A launcher in its own process group; its output is read as it comes (for waits on a line)."""

    def __init__(self, cmd, cwd, env):
        self.cmd = cmd
        self.p = subprocess.Popen(cmd, env=harness.launcher_env(env), cwd=cwd, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.deadline = time.monotonic() + DEADLINE_S
        self.text = ""
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.p.stdout, selectors.EVENT_READ)
        os.set_blocking(self.p.stdout.fileno(), False)

    def _read(self, timeout):
        for _ in self._sel.select(timeout):
            chunk = self.p.stdout.read()
            if chunk is None:  # nothing after all (non-blocking read)
                return True
            if not chunk:
                return False  # end of output
            self.text += chunk.decode(errors="replace")
        return True

    def wait_for(self, needle, count=1):
        while self.text.count(needle) < count:
            left = self.deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 1.0)):
                kill_process_group(self.p)
                pytest.fail(f"{' '.join(self.cmd)}: no {count} x {needle!r} in time:\n{self.text[-6000:]}")

    def finish(self) -> int:
        while time.monotonic() < self.deadline and self._read(min(self.deadline - time.monotonic(), 1.0)):
            pass
        try:
            return self.p.wait(max(0.1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_process_group(self.p)
            pytest.fail(f"{' '.join(self.cmd)} did not finish within {DEADLINE_S} s:\n{self.text[-6000:]}")
        finally:
            self._sel.close()
            self.p.stdout.close()


# ==== one node =====================================================================================

def test_tls_auto_two_workers_allreduce_over_tls_then_files_are_gone(tmp_path):
    priv = _private_dir(tmp_path)
    text = harness.launch(_cmd(tmp_path, extra=_single_node()), tmp_path, _env(priv))
    reports = _reports(text)
    assert [r["rank"] for r in reports] == [0, 1], text[-6000:]
    assert all(r["tls"] for r in reports)
    assert reports[0]["paths"] == reports[1]["paths"]  # one host: one certificate
    assert text.count("rumor-run: TLS on the data channels: job CA 'rumor job CA ") == 1, text[-6000:]
    assert "(a random key, one node)" in text
    for path in reports[0]["paths"].values():
        assert os.path.dirname(path) == str(priv)
        assert not os.path.lexists(path), f"{path} outlived the job"
    assert "WORKER-OK rank 0" in text and "WORKER-OK rank 1" in text
    assert _tls_files(priv) == []


def test_tls_auto_files_are_gone_after_a_failed_job(tmp_path):
    priv = _private_dir(tmp_path)
    job = Launcher(_cmd(tmp_path, mode="fail", extra=[*_single_node(), "--max-restarts", "0"]), tmp_path, _env(priv))
    rc = job.finish()
    assert rc != 0, job.text[-6000:]
    reports = _reports(job.text)
    assert reports, job.text[-6000:]
    assert "WORKER-OK rank 0" in job.text  # it failed after the TLS allreduce, by design
    for path in reports[0]["paths"].values():
        assert not os.path.lexists(path), f"{path} outlived the failed job"
    assert _tls_files(priv) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_tls_auto_files_are_gone_after_an_interrupt(tmp_path, sig):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM to the
    launcher alone (as a scheduler sends it), while the workers run."""
    priv = _private_dir(tmp_path)
    job = Launcher(_cmd(tmp_path, mode="hang", extra=_single_node()), tmp_path, _env(priv, HANG_S="90"))
    job.wait_for("WORKER-OK rank", count=2)
    paths = _reports(job.text)[0]["paths"]
    assert all(os.path.exists(p) for p in paths.values())
    if sig == signal.SIGINT:
        os.killpg(job.p.pid, sig)
    else:
        job.p.send_signal(sig)
    rc = job.finish()
    assert rc != 0, job.text[-6000:]
    for path in paths.values():
        assert not os.path.lexists(path), f"{path} outlived the interrupted job"
    assert _tls_files(priv) == []


def test_tls_auto_refuses_user_tls_files(tmp_path):
    priv = _private_dir(tmp_path)
    job = Launcher(_cmd(tmp_path, extra=_single_node()), tmp_path,
                   _env(priv, RUMOR_TLS_CERT=str(tmp_path / "mine.pem"), RUMOR_TLS_PEER_NAME="job.example"))
    rc = job.finish()
    assert rc != 0
    assert "--tls auto makes the job's certificates itself, but RUMOR_TLS_CERT, RUMOR_TLS_PEER_NAME are set" \
        in job.text, job.text
    assert "TLS-FILES" not in job.text and _tls_files(priv) == []


def test_tls_auto_on_several_nodes_refuses_without_a_job_secret(tmp_path):
    priv = _private_dir(tmp_path)
    rdzv = ["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
            "--master-port", str(harness.free_port())]
    job = Launcher(_cmd(tmp_path, extra=rdzv), tmp_path, _env(priv))
    rc = job.finish()
    assert rc != 0
    assert "--tls auto on several nodes" in job.text and "RUMOR_JOB_SECRET" in job.text, job.text
    assert "TLS-FILES" not in job.text and _tls_files(priv) == []


def test_tls_flag_takes_only_off_or_auto(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rumor.run", "--nproc-per-node", "1", "--tls", "on", "x.py"],
                       cwd=tmp_path, capture_output=True, timeout=DEADLINE_S, env=harness.launcher_env())
    assert p.returncode != 0
    assert b"--tls" in p.stderr and b"'auto'" in p.stderr, p.stderr


def test_files_of_a_killed_launcher_are_swept(tmp_path):
    """A launcher killed with SIGKILL cannot remove its files: the names carry its owner tag, and
    the sweep every launcher and rumor.init() run removes them once it is gone."""
    from rumor import _shm

    priv = _private_dir(tmp_path)
    code = "import json, os; from rumor._tlsauto import AutoTls; print(json.dumps(AutoTls(False, 'x').write()))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=DEADLINE_S,
                       env=harness.launcher_env({"RUMOR_PRIVATE_DIR": str(priv)}))
    assert p.returncode == 0, p.stderr
    paths = json.loads(p.stdout)
    assert sorted(os.path.basename(x) for x in paths.values()) == _tls_files(priv)
    assert sorted(_shm.sweep(str(priv))) == sorted(os.path.basename(x) for x in paths.values())
    assert _tls_files(priv) == []


# ==== several nodes: one CA key derived from the job secret ===============================================

def rank_allreduce_once():
    import torch

    import rumor

    rumor.init()
    try:
        assert rumor._runtime._state.ctx.tls
        t = torch.arange(100_003, dtype=torch.float32) * (rumor.rank() + 1)
        rumor.allreduce_(t, rumor.ReduceOp.SUM)
        return hashlib.sha256(t.numpy().tobytes()).hexdigest()
    finally:
        rumor.shutdown()


def _node_files(tmp_path, name, creds):
    paths = {}
    for var, kind in (("RUMOR_TLS_CERT", "cert"), ("RUMOR_TLS_KEY", "key"), ("RUMOR_TLS_CA", "ca")):
        path = tmp_path / f"{name}-{kind}.pem"
        path.write_bytes(creds[kind])
        os.chmod(path, 0o600)
        paths[var] = str(path)
    return paths


def test_cas_derived_apart_from_one_secret_connect_and_from_two_secrets_are_refused(tmp_path):
    """Two 'nodes' each make their credentials alone, as two launchers would: with one secret the
    ranks connect over TLS (though the two CA certificates differ), with two secrets the TLS
    handshake refuses (the ranks still share the harness's job secret, so only TLS can refuse)."""
    from rumor._tlsauto import make_credentials

    secret = b"0123456789abcdef0123456789abcdef"
    a = make_credentials(secret, "job-7", host="node-a")
    b = make_credentials(secret, "job-7", host="node-b")
    assert a["ca"] != b["ca"]
    env = [_node_files(tmp_path, "a", a), _node_files(tmp_path, "b", b)]
    got = harness.run(rank_allreduce_once, 2, timeout=90, env=TCP, rank_env=env)
    assert got[0] == got[1]

    other = make_credentials(b"another secret, another job CA!!", "job-7", host="node-b")
    env = [_node_files(tmp_path, "a", a), _node_files(tmp_path, "x", other)]
    # The store in clear (RUMOR_STORE_TLS=0): its tunnel would refuse first, and the data
    # channels' own refusal is what is shown here.
    refusing = dict(TCP, RUMOR_TIMEOUT="10", RUMOR_STORE_TLS="0")
    res = harness.run(rank_allreduce_once, 2, timeout=90, env=refusing, raw=True, rank_env=env)
    assert not any(r.ok for r in res), [r.error for r in res]
    assert any("certificate refused" in r.error for r in res), [r.error for r in res]
    # The same secret under another rendezvous id is another CA too.
    other_job = make_credentials(secret, "job-8", host="node-b")
    env = [_node_files(tmp_path, "a", a), _node_files(tmp_path, "y", other_job)]
    res = harness.run(rank_allreduce_once, 2, timeout=90, env=refusing, raw=True, rank_env=env)
    assert any("certificate refused" in r.error for r in res), [r.error for r in res]


def test_tls_auto_two_launchers_as_two_nodes(tmp_path):
    """Two rumor-run launchers, one per 'node' (--nnodes 2 on loopback), with the same job secret
    and nothing else shared: each makes its own CA certificate and the job runs over TLS."""
    priv = [_private_dir(tmp_path, f"node{i}") for i in range(2)]
    port = harness.free_port()
    secret = "fedcba9876543210fedcba9876543210"
    jobs = []
    for node in range(2):
        rdzv = ["--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        jobs.append(Launcher(_cmd(tmp_path, world=2, nproc=1, extra=rdzv), tmp_path,
                             _env(priv[node], RUMOR_JOB_SECRET=secret)))
    rcs = [j.finish() for j in jobs]
    text = "\n".join(j.text for j in jobs)
    assert rcs == [0, 0], text[-8000:]
    reports = _reports(text)
    assert [r["rank"] for r in reports] == [0, 1], text[-8000:]
    assert all(r["tls"] for r in reports)
    assert reports[0]["ca_sha256"] != reports[1]["ca_sha256"]  # made apart: no file was shared
    names = [line.split("job CA ", 1)[1] for j in jobs for line in j.text.splitlines() if "job CA " in line]
    assert len(names) == 2 and names[0] == names[1] and "derived from the job secret" in names[0], names
    # The store's traffic went through the launchers' TLS tunnel (test_store_tls_hosts.py looks at the wire).
    assert "store TLS: node 0 serves the store on port" in jobs[0].text, jobs[0].text[-4000:]
    assert "store TLS: the store at 127.0.0.1:" in jobs[1].text, jobs[1].text[-4000:]
    for r in reports:
        for path in r["paths"].values():
            assert not os.path.lexists(path)
    assert _tls_files(priv[0]) == _tls_files(priv[1]) == []


# ==== the derivation ===============================================================================

def test_hkdf_sha256_matches_rfc5869():
    from rumor._tlsauto import hkdf_sha256

    # RFC 5869, test cases 1 and 3.
    okm = hkdf_sha256(bytes([0x0B] * 22), bytes(range(13)), bytes(range(0xF0, 0xFA)), 42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c"
                         "5db02d56ecc4c5bf34007208d5b887185865")
    okm = hkdf_sha256(bytes([0x0B] * 22), b"", b"", 42)
    assert okm.hex() == ("8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879e"
                         "c3454e5f3c738d2d9d201395faa4b61a96c8")


def test_ca_scalar_depends_on_secret_and_job_only():
    from rumor._tlsauto import P256_ORDER, ca_name, ca_scalar

    s = b"0123456789abcdef0123456789abcdef"
    d = ca_scalar(s, "job-7")
    assert len(d) == 32 and 1 <= int.from_bytes(d, "big") < P256_ORDER
    assert ca_scalar(s, "job-7") == d and ca_name(s, "job-7") == ca_name(s, "job-7")
    assert ca_scalar(s, "job-8") != d and ca_scalar(s[:-1] + b"!", "job-7") != d
    assert ca_name(s, "job-8") != ca_name(s, "job-7")
    assert ca_name(None, "job-7") != ca_name(None, "job-7")  # one node: random
