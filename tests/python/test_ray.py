"""Ray Train's TorchTrainer on rumor's torch.distributed backend (docs/ray.md).

ray_job.py, run as a script, starts a local Ray cluster and fits a 2-worker trainer on
TorchConfig(backend="rumor") whose loop runs torch DDP and then rumor.DistributedDataParallel
(ByteGrad); both must equal the same code under torchrun's environment on gloo. Ray's workers create the process group before the train function runs, so they
must have imported rumor by then: the job's runtime_env names rumor's registration as the worker
setup hook. The workers import the rumor this process imports (the installed one, or the one
PYTHONPATH names) and get the train loop by value (ray_job.py's docstring).

Ray's head and workers listen on every interface, so the driver runs in a network namespace of
its own (only its loopback exists) and a PID namespace of its own (when the driver ends, or the
deadline kills it, the kernel ends every Ray process it started).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import harness
import ray_job

DEADLINE_S = 900


def _namespaced(argv):
    """argv run as PID 1's child in new network, PID and mount namespaces with lo up; --kill-child:
    if unshare itself is killed, so is the namespace."""
    return ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c",
            'ip link set lo up && exec "$@"', "sh"] + list(argv)


def _namespaces_available() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    try:
        return subprocess.run(_namespaced(["true"]), capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _torchrun_rank():
    """The same worker code under the test harness (torchrun's environment) on gloo: the run Ray's
    must equal."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=harness.env_rank(), world_size=harness.env_world())
    try:
        return ray_job.train_both(dist.get_rank())
    finally:
        dist.destroy_process_group()


def test_torch_trainer_on_rumor_matches_gloo(tmp_path):
    from rumor.testing.launch import kill_process_group

    # Here, not at collection: importing Ray costs seconds even where `-m "not slow"` deselects this.
    pytest.importorskip("ray.train.torch")
    if not _namespaces_available():
        pytest.skip("needs `unshare --net --pid` (root or CAP_SYS_ADMIN) and `ip`: Ray listens on every "
                    "interface, which this test only allows inside a private network namespace")
    import rumor

    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(harness._SCRUB_PREFIXES) and k not in harness._SCRUB_NAMES}
    # The rumor this process imports, whatever the working directory (PYTHONPATH may be relative);
    # not tests/python: the workers must get the train loop by value.
    env.update(OMP_NUM_THREADS="1", RUMOR_TIMEOUT="60", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(rumor.__file__))))
    driver = os.path.join(harness.HERE, "ray_job.py")
    p = subprocess.Popen(_namespaced([sys.executable, driver, str(out)]), cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = p.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        kill_process_group(p)
        log, _ = p.communicate()
        pytest.fail(f"the Ray driver did not finish within {DEADLINE_S} s and was killed; its output:\n"
                    f"{log[-6000:]}")
    finally:
        kill_process_group(p)
    assert p.returncode == 0 and "RAY_JOB_DONE" in log, f"exit code {p.returncode}; output:\n{log[-6000:]}"

    ref = harness.run(_torchrun_rank, 2, timeout=120)
    for r in (0, 1):
        got = torch.load(out / f"rumor.{r}.pt")
        assert got["group"] == "RumorProcessGroup" and got["backend"] == "rumor", (got["group"], got["backend"])
        # The train loop reached the workers by value: they could not have imported it by name.
        assert not got["ray_job_importable"]
        # torch DDP averages two float32 gradients on either backend: the same bits as on gloo;
        # ByteGrad inside Ray's loop: the same bits as outside it.
        for part in ("ddp", "algo"):
            assert len(got[part]) == len(ref[r][part]) == 4
            for a, b in zip(got[part], ref[r][part]):
                assert torch.equal(a, b), (part, r)
