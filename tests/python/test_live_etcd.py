"""Live membership with its store in etcd (rumor-run --live --store etcd): no single point of
failure (docs/elastic.md).

Three emulated hosts (network namespaces), one launcher, one etcd member and one worker each,
with --tls auto: the members' client and peer traffic is https with certificates of the job CA
each launcher derives from the job secret.
Node 0's worker stops itself before its step 4; the test then kills node 0's whole host: its
launcher (which, with --store tcp, would have held the store), its etcd member and its worker.
The other two hosts go on: their workers find r0 silent, re-form as two through the two etcd
members left (a majority of three), train to the end and their launchers exit 0. Their final
parameters are bitwise equal and equal a float64 run of the membership timeline (3 ranks for
steps 0-3, then 2). Every process has a deadline; at the end nothing is left running in any
host's namespace (etcd included) and the survivors' members removed their data directories.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import harness
import live_runs
from test_live import STEPS, WORKER, _env, _simulate, _sizes_applied, _stop_and_collect

DEADLINE_S = 120
HOSTS, FAULT = 3, 4


def _ns_pids(ns):
    r = subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE, text=True, timeout=10)
    return [int(t) for t in r.stdout.split()]


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd (Debian's etcd-server) is not installed")
def test_the_job_survives_the_host_that_ran_the_store(tmp_path):
    from rumor.testing import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(f"emulated hosts need Linux network namespaces: {why}")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    data = tmp_path / "etcd"
    data.mkdir()
    # The worker's growth step is past the end: nobody waits for newcomers (node 0's launcher
    # is gone, and the others have no restarts to give).
    env = dict(_env(), RUMOR_JOB_SECRET=secrets.token_hex(32), RUMOR_ETCD_DIR=str(data))
    procs, outs = [], []
    with netns.Cluster(HOSTS) as cluster:
        hosts = ",".join(cluster.ip(i) for i in range(HOSTS))
        try:
            for node in range(HOSTS):
                out = open(tmp_path / f"launcher{node}.txt", "w+b")
                outs.append(out)
                procs.append(cluster.popen(node, [
                    sys.executable, "-m", "rumor.run", "--live", "--store", "etcd", "--store-hosts", hosts,
                    "--tls", "auto", "--nnodes", str(HOSTS), "--node-rank", str(node), "--nproc-per-node", "1",
                    "--max-restarts", "0", "--live-min", "2", "--master-port", "29500", "--rdzv-id", "live-etcd-test",
                    str(script), "r0", str(FAULT), str(STEPS + 1), str(STEPS), str(tmp_path), "stop", "same-model",
                    "GradientAllReduce"],
                    env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            deadline = time.monotonic() + DEADLINE_S
            r0_log = tmp_path / "r0.log"
            # r0 logs steps 0..3, then stops itself before step 4: the others wait in step 4 for it.
            reached, left = False, None
            while time.monotonic() < deadline and all(p.poll() is None for p in procs) and not reached:
                reached = r0_log.exists() and len(live_runs.read_log(r0_log)) == FAULT
                time.sleep(0.05)
            if reached:
                os.killpg(procs[0].pid, signal.SIGKILL)  # node 0's launcher, etcd member and worker
                procs[0].wait(10)
                while any(p.poll() is None for p in procs[1:]) and time.monotonic() < deadline:
                    time.sleep(0.1)
                left = {i: _ns_pids(cluster.host(i).netns) for i in range(HOSTS)}
        finally:
            text = _stop_and_collect(procs, outs)
    assert reached, f"the job did not reach step {FAULT} with every launcher running:\n{text}"
    assert [p.returncode for p in procs] == [-signal.SIGKILL, 0, 0], text
    assert text.count("etcd https://") == HOSTS, text
    # Nothing left running on any host: the survivors' etcd members stopped with their launchers.
    assert left == {i: [] for i in range(HOSTS)}, (left, text)
    # Only the killed host's member left its data directory behind (SIGKILL: no cleanup).
    assert len(os.listdir(data)) == 1, (os.listdir(data), text)

    logs, finals = live_runs.load(tmp_path)
    assert sorted(finals) == ["r1", "r2"], text
    sizes = _sizes_applied(logs)
    assert sizes == [3] * FAULT + [2] * (STEPS - FAULT), sizes
    for m in ("r1", "r2"):
        assert {e["pid"] for e in logs[m]} == {finals[m]["pid"]}, m  # trained in its first process
        assert [(c[1], c[2], c[3]) for c in finals[m]["changes"]] == [(2, ["r0"], [])], finals[m]
    ref = finals["r1"]["params"]
    assert finals["r2"]["params"] == ref
    for got, want in zip(ref, _simulate(sizes)):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=2e-5, atol=2e-6)
    assert "the etcd store stopped answering" not in text, text


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd (Debian's etcd-server) is not installed")
@pytest.mark.parametrize("how", ["started-tls", "external"])
def test_one_host_with_its_store_in_etcd(tmp_path, how):
    """--store etcd on one host (no netns needed): r1 is SIGKILLed before its step 4 and r0 goes
    on alone; the launcher exits 0. started-tls: the launcher runs one member on loopback, with
    --tls auto (https, the job's certificates on both sides), stopped at the end with its data
    directory removed; external: --store etcd://... names a plain-http member this test runs, and
    the launcher starts none (nor stops it)."""
    from rumor import _etcd_member

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    data = tmp_path / "etcd"
    data.mkdir()
    store = ["--store", "etcd", "--tls", "auto"]
    external = None
    try:
        if how == "external":
            peers = [("127.0.0.1", _etcd_member.free_port("127.0.0.1"), _etcd_member.free_port("127.0.0.1"))]
            external = _etcd_member.Member(0, peers, f"external-{os.getpid()}")
            external.start()
            store = ["--store", f"etcd://127.0.0.1:{peers[0][1]}"]
        cmd = [sys.executable, "-m", "rumor.run", "--live", *store, "--nproc-per-node", "2", "--max-restarts", "0",
               str(script), "r1", str(FAULT), str(STEPS + 1), str(STEPS), str(tmp_path), "kill", "same-model",
               "GradientAllReduce"]
        text = harness.launch(cmd, tmp_path, {"RUMOR_ETCD_DIR": str(data), "RUMOR_TIMEOUT": "60"}, DEADLINE_S)
        if external is not None:
            assert external.alive(), "the launcher stopped a member it did not start"
    finally:
        if external is not None:
            external.stop()
    scheme = "https" if how == "started-tls" else "http"
    assert f"etcd {scheme}://127.0.0.1:" in text and os.listdir(data) == [], text[-6000:]
    assert ("member rumor0 here" in text) == (how != "external"), text[-6000:]
    logs, finals = live_runs.load(tmp_path)
    final = finals["r0"]
    sizes = _sizes_applied(logs)
    assert sizes == [2] * FAULT + [1] * (STEPS - FAULT), sizes
    for got, want in zip(final["params"], _simulate(sizes)):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=2e-5, atol=2e-6)
