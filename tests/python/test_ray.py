"""Ray Train's TorchTrainer on rumor's torch.distributed backend (docs/ray.md): 2 workers on a
local Ray cluster started here (loopback, stopped in a finally), against the same run on gloo;
and rumor.DistributedDataParallel inside the Ray train loop (rumor.init() reads Ray's env).

Ray's workers create the process group before the train function runs, so they must have
imported rumor by then: the job's runtime_env names rumor's registration as the worker setup
hook. Starting Ray and two trainers takes minutes on two busy cores: marked slow.
"""
from __future__ import annotations

import os

import pytest
import torch

import harness

pytest.importorskip("ray.train.torch")

pytestmark = pytest.mark.slow

STEPS = 4


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _batches(rank: int):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)) for _ in range(2 * STEPS)]
    return data[rank::2]


def _train_loop(config):
    import torch.distributed as dist

    import rumor

    r = dist.get_rank()
    model = _mlp()
    if config["rumor_ddp"]:
        rumor.init()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=rumor.algorithms.ByteGrad(),
                                            bucket_split_gap_ms=float("inf"))
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in _batches(r):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    if config["rumor_ddp"]:
        rumor.shutdown()
    torch.save(dict(group=type(dist.group.WORLD).__name__, backend=dist.get_backend(),
                    params=[p.detach().clone() for p in model.parameters()]),
               os.path.join(config["out"], f"{config['name']}.{r}.pt"))


def _without_ray_rank():
    """The ByteGrad loop of _train_loop, launched by the test harness (torchrun's env) instead."""
    import rumor

    rumor.init()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=rumor.algorithms.ByteGrad(),
                                        bucket_split_gap_ms=float("inf"))
    for x, y in _batches(rumor.rank()):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    rumor.shutdown()
    return [p.detach().clone() for p in model.parameters()]


def test_torch_trainer_on_rumor_matches_gloo(tmp_path):
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "rumor.torch_backend.register"})
    try:
        def fit(name, backend, rumor_ddp=False):
            TorchTrainer(_train_loop, train_loop_config=dict(out=str(tmp_path), name=name, rumor_ddp=rumor_ddp),
                         torch_config=TorchConfig(backend=backend, timeout_s=60),
                         scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                         run_config=RunConfig(name=name, storage_path=str(tmp_path / "ray"))).fit()

        fit("rumor", "rumor")
        fit("gloo", "gloo")
        fit("algo", "rumor", rumor_ddp=True)
    finally:
        ray.shutdown()
    res = {(n, r): torch.load(tmp_path / f"{n}.{r}.pt") for n in ("rumor", "gloo", "algo") for r in (0, 1)}
    for r in (0, 1):
        assert res["rumor", r]["group"] == "RumorProcessGroup" and res["gloo", r]["backend"] == "gloo"
        # torch DDP averages two float32 gradients on either backend: the same bits.
        for a, b in zip(res["rumor", r]["params"], res["gloo", r]["params"]):
            assert torch.equal(a, b)
    # ByteGrad inside Ray's loop: the same bits as the same script under the test harness.
    for r, without in enumerate(harness.run(_without_ray_rank, 2, timeout=120)):
        for a, b in zip(res["algo", r]["params"], without):
            assert torch.equal(a, b)
