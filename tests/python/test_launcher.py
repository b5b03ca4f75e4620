"""The launchers: `python -m rumor.run` (rumor's torchrun wrapper with its own flags), the
`rumor-run` console script, and plain torchrun. Each run has a deadline; on timeout the whole
process group (launcher and workers) is killed and the test fails with the output so far."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import harness

DEADLINE_S = harness.LAUNCH_DEADLINE_S

WORKER = textwrap.dedent(
    """
    import os, sys
    import torch
    import rumor

    want_streams = sys.argv[1]
    if want_streams != "-":
        got = os.environ.get("RUMOR_SOCKET_STREAMS")
        assert got == want_streams, f"RUMOR_SOCKET_STREAMS={got!r}, expected {want_streams!r}"
    rumor.init()
    n, r = rumor.size(), rumor.rank()
    assert n == int(os.environ["WORLD_SIZE"]) == 2, (n, os.environ.get("WORLD_SIZE"))
    assert r == int(os.environ["RANK"])
    assert rumor.local_rank() == int(os.environ["LOCAL_RANK"]), (rumor.local_rank(), os.environ["LOCAL_RANK"])
    assert rumor.local_size() == 2 and rumor.machine_size() == 1
    for size in [7, 100_003]:
        out = rumor.allreduce(torch.full((size,), float(r + 1)), rumor.ReduceOp.SUM)
        assert torch.equal(out, torch.full((size,), 3.0)), out[:4]
    # the TCP path too, with the launcher's stream count
    rumor.shutdown()
    rumor.init(shm=False)
    out = rumor.allreduce(torch.full((300_001,), float(r + 1)), rumor.ReduceOp.SUM)
    assert torch.equal(out, torch.full((300_001,), 3.0)), out[:4]
    rumor.barrier()
    print(f"WORKER-OK rank {r}", flush=True)
    """
)


def _run(cmd, tmp_path, env_extra=None):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [str(c).replace("{script}", str(script)) for c in cmd]
    text = harness.launch(cmd, tmp_path, env_extra)
    for r in range(2):
        assert f"WORKER-OK rank {r}" in text, f"rank {r} did not report success:\n{text[-6000:]}"
    return text


def _rdzv():
    return ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(harness.free_port())]


def test_rumor_run_module_sets_socket_streams(tmp_path):
    _run([sys.executable, "-m", "rumor.run", "--nproc-per-node", "2", "--socket-streams", "3", *_rdzv(),
          "{script}", "3"], tmp_path)


def test_rumor_run_console_script(tmp_path):
    exe = shutil.which("rumor-run")
    assert exe is not None, "the rumor-run console script is not installed (pyproject [project.scripts])"
    _run([exe, "--nproc-per-node", "2", "--socket-streams", "1", *_rdzv(), "{script}", "1"], tmp_path)


def test_rumor_run_rejects_bad_socket_streams(tmp_path):
    for bad in ["0", "abc"]:
        p = subprocess.run([sys.executable, "-m", "rumor.run", "--nproc-per-node", "1", "--socket-streams", bad,
                            "x.py"], cwd=tmp_path, capture_output=True, timeout=DEADLINE_S)
        assert p.returncode != 0, f"--socket-streams {bad} was accepted"
        assert b"socket-streams" in p.stderr + p.stdout, (p.stdout, p.stderr)


def test_plain_torchrun(tmp_path):
    """rumor.init() under torchrun: the agent hosts the TCPStore (TORCHELASTIC_USE_AGENT_STORE)."""
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *_rdzv(), "{script}", "-"],
         tmp_path)


def test_plain_torchrun_standalone_with_env_streams(tmp_path):
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "{script}", "4"],
         tmp_path, env_extra={"RUMOR_SOCKET_STREAMS": "4"})


@pytest.mark.parametrize("mode", ["exp2", "pushsum"])
def test_rumor_run_async_example(tmp_path, mode):
    """examples/async_train.py under rumor.run: AsyncModelAverage gossip (and push-sum) with a
    slow rank; every rank finishes with identical weights (spread 0 for AsyncModelAverage, whose
    finish() ends with one exact average) and a finite loss."""
    example = os.path.join(os.path.dirname(harness.HERE), os.pardir, "examples", "async_train.py")
    cmd = [sys.executable, "-m", "rumor.run", "--nproc-per-node", "2", *_rdzv(), os.path.abspath(example),
           "--mode", mode, "--seconds", "1.5"]
    text = harness.launch(cmd, tmp_path)
    # The launcher merges the ranks' output streams, so two reports may share a line: count them.
    assert text.count("eval loss") == 2, text[-6000:]
    if mode != "pushsum":
        assert text.count("replica spread 0.00e+00") == 2, text[-6000:]


def test_rumor_run_checks_live_spares(tmp_path):
    for args, want in ((["--live", "--live-spares", "abc"], b"--live-spares must be a number"),
                       (["--live", "--live-spares", "-1"], b"--live-spares must be a number"),
                       (["--live-spares", "1"], b"--live-spares is for --live")):
        p = subprocess.run([sys.executable, "-m", "rumor.run", "--nproc-per-node", "1", *args, "x.py"], cwd=tmp_path,
                           capture_output=True, timeout=DEADLINE_S)
        assert p.returncode != 0 and want in p.stderr + p.stdout, (args, p.stdout, p.stderr)
