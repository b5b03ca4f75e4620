"""The Ray side of test_ray.py: a driver that starts a local Ray cluster and fits one 2-worker
TorchTrainer on the rumor backend, run as a script (`python ray_job.py OUT_DIR`) inside a private network namespace.

Run as a script, this module is ``__main__``, which cloudpickle always serializes by value: the
train loop and everything it calls travel to Ray's workers inside the pickle, so the workers need
neither tests/python on their path nor the test module (they only import rumor, torch and ray).
The same file is also imported by name (by test_ray.py's harness ranks) for the run without Ray.

Output: one ``rumor.<rank>.pt`` per worker in OUT_DIR, then a line ``RAY_JOB_DONE``.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch

STEPS = 4


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def batches(rank: int):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)) for _ in range(2 * STEPS)]
    return data[rank::2]


def train_ddp(rank: int):
    """torch DDP on the default process group (its backend is whatever the launcher chose)."""
    model = mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in batches(rank):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train_bytegrad(rank: int):
    """rumor.DistributedDataParallel with ByteGrad over rumor's own runtime (rumor.init() reads the
    launcher's RANK/WORLD_SIZE/MASTER_*: Ray's or the test harness's); the final parameters."""
    import rumor

    rumor.init()
    try:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # math.inf: one bucket whatever the timing, so that two runs give the same bits.
        ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=rumor.algorithms.ByteGrad(),
                                            bucket_split_gap_ms=float("inf"))
        for x, y in batches(rank):
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    finally:
        rumor.shutdown()
    return [p.detach().clone() for p in model.parameters()]


def train_both(rank: int) -> dict:
    """What a worker runs under either launcher: torch DDP, then ByteGrad through rumor's wrapper."""
    return dict(ddp=train_ddp(rank), algo=train_bytegrad(rank))


def train_loop(config) -> None:
    """Ray's train function, on the group Ray made (TorchConfig's backend): train_both, saved with
    what the group is and whether the worker could have imported this module by name."""
    import importlib.util

    import torch.distributed as dist

    rank = dist.get_rank()
    res = train_both(rank)
    res.update(group=type(dist.group.WORLD).__name__, backend=dist.get_backend(),
               ray_job_importable=importlib.util.find_spec("ray_job") is not None)
    torch.save(res, os.path.join(config["out"], f"rumor.{rank}.pt"))


def main(out: str) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # By value, whatever the module's name: imported under its own name (not as a script) it
    # would otherwise be pickled by reference and fail on workers that cannot import it.
    if __name__ != "__main__":
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # Nor may Ray hand this script's directory (tests/python, sys.path[0]) on to the workers with
    # the driver's path: they must do without it, as on a cluster.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    # Ray's session files (sockets included, whose paths must stay short) in a directory of
    # this run, not in the shared /tmp/ray.
    ray_tmp = tempfile.mkdtemp(prefix="rumor-ray-")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             _temp_dir=ray_tmp, object_store_memory=100 * 1024 * 1024,
             runtime_env={"worker_process_setup_hook": "rumor.torch_backend.register"})
    try:
        TorchTrainer(train_loop, train_loop_config=dict(out=out),
                     torch_config=TorchConfig(backend="rumor", timeout_s=60),
                     scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                     run_config=RunConfig(name="rumor", storage_path=os.path.join(out, "ray"))).fit()
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print("RAY_JOB_DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
