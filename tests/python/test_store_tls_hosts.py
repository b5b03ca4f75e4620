"""The store's traffic of a two-host `rumor-run --tls auto` job under TLS (python/rumor/_storetls.py,
docs/security.md "The rendezvous store"), on two emulated hosts (network namespaces).

Node 1's launcher reaches node 0's store through a relay in its own namespace (tls_relay.py),
which records every byte or alters one. A short training job runs with TLS off and on: with it
off the relay sees the store's keys in clear (the check's control); with it on every byte that
crossed is a TLS record, none of the keys appears, and the trained parameters are bit for bit
those of the TLS-off run. Strangers (a plaintext client, a TLS client without a certificate, one
with another CA's) are refused at node 0's store port while node 0 waits for node 1, and the job
then runs. A byte altered in the store's answers makes the job fail with the integrity error
named, on both launchers, before their deadline (node 0's worker at its RUMOR_TIMEOUT, waiting for rank 1).

Every process runs in a namespace of the cluster, with a deadline; the cluster's close kills
whatever is left.
"""
from __future__ import annotations

import json
import os
import secrets
import select
import subprocess
import sys
import textwrap
import time

import pytest

from tls_relay import tls_records

DEADLINE_S = 90
PORT = 29500
HERE = os.path.dirname(os.path.abspath(__file__))

WORKER = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import torch
    import rumor

    rumor.init()
    r, n = rumor.rank(), rumor.size()
    torch.manual_seed(0)
    w = torch.randn(64, 32, dtype=torch.float32)
    g = torch.Generator().manual_seed(100 + r)
    for step in range(5):
        x = torch.randn(16, 64, generator=g)
        y = torch.randn(16, 32, generator=g)
        grad = 2 * x.t() @ (x @ w - y) / 16
        rumor.allreduce_(grad, rumor.ReduceOp.SUM)
        w -= 0.01 * grad / n
    print("RESULT " + json.dumps({"rank": r, "tls": bool(rumor._runtime._state.ctx.tls),
                                  "digest": hashlib.sha256(w.numpy().tobytes()).hexdigest()}), flush=True)
    rumor.shutdown()
    """
)

# The same under rumor-run --live: r1 kills itself at step 3, node 1's launcher starts newcomer j1
# (its store connections go through node 1's tunnel too), and the members wait for it at step 6.
LIVE_WORKER = textwrap.dedent(
    """
    import hashlib, json, os, signal
    import torch
    import rumor
    from rumor.parallel import DistributedDataParallel

    rumor.init()
    me = os.environ["RUMOR_LIVE_ID"]
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = rumor.elastic.State(ddp, opt)


    @rumor.elastic.run
    def train(state):
        while state.step < 8:
            if me == "r1" and state.step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step == 6:
                rumor.elastic.wait_for_members(2, timeout=60)
            g = torch.Generator().manual_seed(100 * state.step + rumor.rank())
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.step += 1


    train(state)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print("RESULT " + json.dumps({"rank": rumor.rank(), "me": me, "tls": bool(rumor._runtime._state.ctx.tls),
                                  "digest": digest}), flush=True)
    """
)

# What a stranger on host 1 gets from node 0's store port: "refused: why" per kind of client.
STRANGER = textwrap.dedent(
    """
    import json, socket, ssl, sys
    host, port, fcert, fkey = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    out = {}

    def read_all(s):
        got = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return got
            got += chunk

    for kind in ("plaintext", "no certificate", "another CA"):
        try:
            raw = socket.create_connection((host, port), timeout=30)
            if kind == "plaintext":
                raw.sendall(b"\\x02\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x05token")
                got = read_all(raw)
                out[kind] = "refused: closed" if not got else f"ANSWERED {got[:40]!r}"
            else:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE  # a stranger takes any server: the refusal must be the server's
                if kind == "another CA":
                    ctx.load_cert_chain(fcert, fkey)
                s = ctx.wrap_socket(raw)
                s.sendall(b"\\x02\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x05token")
                got = read_all(s)
                out[kind] = "refused: closed" if not got else f"ANSWERED {got[:40]!r}"
        except (ssl.SSLError, ConnectionError) as e:
            out[kind] = f"refused: {e}"
    print("STRANGERS " + json.dumps(out), flush=True)
    """
)


def _cluster():
    from rumor.testing import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(f"emulated hosts need Linux network namespaces: {why}")
    return netns.Cluster(2)


def _wait_line(p, prefix: str, deadline: float) -> str:
    """The first line of p's stdout starting with prefix."""
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
        if ready:
            chunk = os.read(p.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line
    raise AssertionError(f"no line {prefix!r} before the deadline: {buf[-2000:]!r}")


def _wait_file(path, needle: str, proc, deadline: float) -> None:
    while time.monotonic() < deadline:
        if path.exists() and needle in path.read_text(errors="replace"):
            return
        assert proc.poll() is None, path.read_text(errors="replace")[-4000:]
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not in {path} before the deadline")


def _wait_all(procs, deadline: float):
    """Waits for procs until the deadline; returns the indices of those still running."""
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [i for i, p in enumerate(procs) if p.poll() is None]


def _kill_all(procs, relay) -> None:
    for p in procs + [relay]:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    relay.stdout.close()


def _run_job(tmp_path, cluster, name, tls, relay_args, during=None, timeout_s=20, live=False):
    """Node 0 on host 0 with the store; node 1 on host 1, reaching it through a relay on host 1.
    Returns (return codes, the launchers' outputs, RESULT reports)."""
    script = tmp_path / ("live_worker.py" if live else "worker.py")
    script.write_text(LIVE_WORKER if live else WORKER)
    how = ["--live", "--max-restarts", "1"] if live else ["--max-restarts", "0", "--rdzv-conf", "timeout=40"]
    priv = tmp_path / f"{name}-private"
    priv.mkdir(mode=0o700)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", RUMOR_TIMEOUT=str(timeout_s),
               RUMOR_JOB_SECRET="0f1e2d3c4b5a69788796a5b4c3d2e1f0" * 2, RUMOR_PRIVATE_DIR=str(priv))
    env.pop("RUMOR_ROUTE_ADDR", None)
    deadline = time.monotonic() + DEADLINE_S
    relay = cluster.popen(1, [sys.executable, os.path.join(HERE, "tls_relay.py"), cluster.ip(1), "0", cluster.ip(0),
                              str(PORT), str(DEADLINE_S), *relay_args], stdout=subprocess.PIPE, env=env)
    relay_port = int(_wait_line(relay, "RELAY-READY", deadline).split()[1])
    tls_flag = ["--tls", "auto"] if tls else []
    outs, procs = [], []
    try:
        for node, (addr, port) in enumerate([(cluster.ip(0), PORT), (cluster.ip(1), relay_port)]):
            out = tmp_path / f"{name}-launcher{node}.txt"
            outs.append(out)
            cmd = [sys.executable, "-m", "rumor.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                   "1", *how, "--master-addr", addr, "--master-port", str(port), "--rdzv-id", "storetls-job",
                   *tls_flag, str(script)]
            with open(out, "wb") as sink:
                procs.append(cluster.popen(node, cmd, env=env, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL))
            if node == 0 and tls:
                # Node 1's relay would otherwise accept node 1's first dial and find nobody to
                # forward it to (a real network refuses it, and the forwarder dials again).
                _wait_file(out, "store TLS: node 0 serves the store", procs[0], deadline)
            if node == 0 and during is not None:
                during(procs[0], outs[0], deadline)
        hung = _wait_all(procs, deadline)
    finally:
        _kill_all(procs, relay)
    texts = [o.read_text(errors="replace") for o in outs]
    text = "".join(f"\n===== {o.name} =====\n" + t[-6000:] for o, t in zip(outs, texts))
    assert not hung, f"launcher(s) {hung} still running at the deadline:\n{text}"
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT " in line]
    return [p.returncode for p in procs], text, sorted(results, key=lambda d: d["rank"]), texts


# Store keys and values of this job that must not cross in clear: rumor's rendezvous prefix,
# torchelastic's keys, the rendezvous id, and the workers' MASTER_* values the agent publishes.
NEEDLES = (b"rumor/", b"torchelastic", b"storetls-job", b"/peer/", b"token")


def test_store_traffic_is_tls_only_strangers_are_refused_and_the_result_equals_tls_off(tmp_path):
    from tls_pki import make_pki

    pki = make_pki(tmp_path, 1)
    captures, runs, texts = {}, {}, {}
    with _cluster() as cluster:
        def strangers(p0, out0, deadline):
            """While node 0 waits for node 1: three strangers at its store port, from host 1."""
            r = cluster.run(1, [sys.executable, "-c", STRANGER, cluster.ip(0), str(PORT), pki["foreign.pem"],
                                pki["foreign.key"]], timeout=60)
            line = [x for x in r.stdout.splitlines() if x.startswith("STRANGERS ")]
            assert line, (r.stdout, r.stderr)
            got = json.loads(line[0].split(" ", 1)[1])
            assert sorted(got) == ["another CA", "no certificate", "plaintext"], got
            assert all(v.startswith("refused") for v in got.values()), got

        for tls in (False, True):
            rec = tmp_path / f"capture-{'tls' if tls else 'clear'}"
            rec.mkdir()
            rcs, text, results, _ = _run_job(tmp_path, cluster, rec.name, tls, ["--record", str(rec)],
                                             during=strangers if tls else None)
            assert rcs == [0, 0], text
            assert [r["rank"] for r in results] == [0, 1] and all(r["tls"] == tls for r in results), text
            assert ("store TLS: node 0 serves the store" in text) == tls, text
            runs[tls], texts[tls] = results, text
            captures[tls] = {f.name: f.read_bytes() for f in sorted(rec.iterdir())}
    # The strangers were refused by node 0's terminator (and the job went on, above).
    for why in ("WRONG_VERSION_NUMBER", "PEER_DID_NOT_RETURN_A_CERTIFICATE", "CERTIFICATE_VERIFY_FAILED"):
        assert f"terminator: refused the connection from {cluster.ip(1)}:" in texts[True] and why in texts[True], \
            (why, texts[True])
    clear = b"".join(captures[False].values())
    for needle in NEEDLES:
        assert needle in clear, f"the control failed: {needle!r} not seen in the clear run's store traffic"
    assert captures[True], "no store connection crossed the relay"
    for name, data in captures[True].items():
        kinds = [k for k, _ in tls_records(data)]  # raises where a byte is not part of a TLS record
        assert kinds and kinds[0] == 22 and set(kinds[1:]) <= {20, 23}, (name, kinds[:8])
        for needle in NEEDLES:
            assert needle not in data, (name, needle)
    assert runs[True][0]["digest"] == runs[True][1]["digest"]
    assert [r["digest"] for r in runs[True]] == [r["digest"] for r in runs[False]]


def test_an_altered_byte_on_the_store_stream_fails_the_job_clearly(tmp_path):
    with _cluster() as cluster:
        rcs, text, _, texts = _run_job(tmp_path, cluster, "flip", True, ["--flip-app-record", "3"], timeout_s=8)
    assert rcs[0] != 0 and rcs[1] != 0, text
    # Node 1's forwarder finds the altered record; node 0's terminator hears its alert.
    assert "forwarder: the connection to the store at" in texts[1] and "BAD_RECORD_MAC" in texts[1], text
    assert f"terminator: the connection from {cluster.ip(1)}:" in texts[0] and "BAD_RECORD_MAC" in texts[0], text


def test_live_store_traffic_is_tls_only_through_a_change(tmp_path):
    """rumor-run --live --tls auto on two hosts: the live store (node 0's launcher) is reached
    through the tunnels. r1 dies at step 3 and node 1's launcher starts newcomer j1, whose store
    connections cross the relay too; the job trains to the end with j1, whose parameters equal
    r0's, and every byte the relay carried is a TLS record with none of the live keys in it."""
    rec = tmp_path / "capture-live"
    rec.mkdir()
    with _cluster() as cluster:
        rcs, text, results, _ = _run_job(tmp_path, cluster, rec.name, True, ["--record", str(rec)], live=True)
    assert rcs == [0, 0], text
    assert "over TLS" in text and "worker r1" in text and "signal 9" in text, text
    assert sorted(r["me"] for r in results) == ["j1", "r0"] and all(r["tls"] for r in results), text
    assert results[0]["digest"] == results[1]["digest"], results
    captures = {f.name: f.read_bytes() for f in sorted(rec.iterdir())}
    # the launcher's, r1's and j1's (each with its watcher's) connections, at least
    assert len(captures) >= 5 and sum(map(len, captures.values())) > 20000, {k: len(v) for k, v in captures.items()}
    for name, data in captures.items():
        kinds = [k for k, _ in tls_records(data)]
        assert kinds and kinds[0] == 22 and set(kinds[1:]) <= {20, 23}, (name, kinds[:8])
        for needle in NEEDLES + (b"/live/", b"joinseq", b"hb/"):
            assert needle not in data, (name, needle)


# Exits 0 once host:port accepts a connection, 1 at the deadline.
LISTENING = textwrap.dedent(
    """
    import socket, sys, time
    host, port, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=5).close()
            sys.exit(0)
        except OSError:
            time.sleep(0.05)
    sys.exit(1)
    """
)

# rumor's own rendezvous keys in the store: the session token, each rank's entry, rank 0's table.
RENDEZVOUS = (b"/token", b"/peer/", b"/table")


def _torchrun_job(tmp_path, cluster, name, pki, store_tls: bool, record):
    """Plain torchrun (no rumor-run) on the two hosts, static rendezvous, TLS files per node;
    node 1's agent and worker reach node 0's agent store through a recording relay on host 1."""
    from tls_pki import tls_env

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    deadline = time.monotonic() + DEADLINE_S
    base = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", RUMOR_TIMEOUT="20",
                RUMOR_JOB_SECRET="0f1e2d3c4b5a69788796a5b4c3d2e1f0" * 2, RUMOR_STORE_TLS=str(int(store_tls)))
    base.pop("RUMOR_ROUTE_ADDR", None)
    relay = cluster.popen(1, [sys.executable, os.path.join(HERE, "tls_relay.py"), cluster.ip(1), "0", cluster.ip(0),
                              str(PORT), str(DEADLINE_S), "--record", str(record)], stdout=subprocess.PIPE, env=base)
    relay_port = int(_wait_line(relay, "RELAY-READY", deadline).split()[1])
    outs, procs = [], []
    try:
        for node, (addr, port) in enumerate([(cluster.ip(0), PORT), (cluster.ip(1), relay_port)]):
            out = tmp_path / f"{name}-torchrun{node}.txt"
            outs.append(out)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "1", "--max-restarts", "0", "--master-addr", addr, "--master-port", str(port),
                   str(script)]
            with open(out, "wb") as sink:
                procs.append(cluster.popen(node, cmd, env=dict(base, **tls_env(pki, node)), cwd=tmp_path, stdout=sink,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            if node == 0:
                # Node 1's relay would otherwise accept node 1's first dial before node 0's agent
                # listens and close it (a real network refuses it, and torch dials again).
                r = cluster.run(1, [sys.executable, "-c", LISTENING, cluster.ip(0), str(PORT), str(DEADLINE_S)],
                                timeout=DEADLINE_S)
                assert r.returncode == 0, (r.stdout, r.stderr, out.read_text(errors="replace")[-3000:])
        hung = _wait_all(procs, deadline)
    finally:
        _kill_all(procs, relay)
    text = "".join(f"\n===== {o.name} =====\n" + o.read_text(errors="replace")[-6000:] for o in outs)
    assert not hung, f"torchrun(s) {hung} still running at the deadline:\n{text}"
    assert [p.returncode for p in procs] == [0, 0], text
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT " in line]
    return sorted(results, key=lambda d: d["rank"]), text


def test_plain_torchrun_moves_rumors_rendezvous_off_the_agents_store(tmp_path):
    """torchrun's agent hosts the store in clear and rumor cannot carry its connections; with the
    TLS files set, rumor.init() moves its own rendezvous to a store rank 0 hosts behind a
    terminator, and the agent's store holds only that store's address. A relay on node 1's path to
    the agent's store sees the session token, the ranks' entries and the table with
    RUMOR_STORE_TLS=0 (the control), and none of them with it on; the results are equal."""
    from tls_pki import make_pki

    pki = make_pki(tmp_path, 2)
    captures, runs = {}, {}
    with _cluster() as cluster:
        for store_tls in (False, True):
            rec = tmp_path / f"agent-capture-{int(store_tls)}"
            rec.mkdir()
            results, text = _torchrun_job(tmp_path, cluster, rec.name, pki, store_tls, rec)
            assert [r["rank"] for r in results] == [0, 1] and all(r["tls"] for r in results), text
            runs[store_tls] = results
            captures[store_tls] = b"".join(f.read_bytes() for f in sorted(rec.iterdir()))
    for needle in RENDEZVOUS:
        assert needle in captures[False], f"the control failed: {needle!r} not in the agent store's traffic"
        assert needle not in captures[True], needle
    assert _storetls_pointer() in captures[True] and _storetls_pointer() not in captures[False]
    assert [r["digest"] for r in runs[True]] == [r["digest"] for r in runs[False]]


def _storetls_pointer() -> bytes:
    from rumor import _storetls

    return _storetls.POINTER_KEY.encode()
