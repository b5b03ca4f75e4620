"""rumor.lightning.RumorStrategy and DDPStrategy(process_group_backend="rumor") in a real
lightning.Trainer on 2 CPU processes, against the same training without Lightning.

Each rank runs Lightning's fit (Lightning sees an outside launcher: LOCAL_RANK is set) and then
the same steps as a plain rumor loop (same seed, model, sampler and batches), and compares the
losses of every step and the final parameters bit for bit: both runs do the same arithmetic on
the same buckets (bucket_split_gap_ms=inf keeps the layout off the clock).
"""
from __future__ import annotations

import math
import os
import re

import pytest
import torch

import harness

pytest.importorskip("lightning")

TIMEOUT = 240
SAMPLES, FEATURES, BATCH = 16, 8, 2        # 2 ranks: 4 steps per epoch
NO_SPLIT = {"bucket_split_gap_ms": math.inf}


def _data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x @ torch.randn(FEATURES, 1, generator=g) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _module(opt: str = "sgd"):
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.losses = []

        def forward(self, batch):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def training_step(self, batch, batch_idx):
            loss = self(batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return _optimizer(opt, self.parameters())

    torch.manual_seed(0)
    return Net()


def _optimizer(opt, params):
    if opt == "onebit_adam":
        import rumor

        return rumor.optim.OneBitAdamOptimizer(params, lr=0.01, freeze_step=2)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _loader():
    # One sampler for both runs (Lightning's own would shuffle with its seed); the launcher's
    # RANK, which Lightning's teardown leaves in place (it removes WORLD_SIZE).
    sampler = torch.utils.data.DistributedSampler(_data(), num_replicas=2, rank=int(os.environ["RANK"]),
                                                  shuffle=False)
    return torch.utils.data.DataLoader(_data(), batch_size=BATCH, sampler=sampler)


def _trainer(strategy, **kw):
    import lightning as L

    kw.setdefault("max_steps", 4)
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=0, deterministic=True, use_distributed_sampler=False, **kw)


def _params(module):
    return [p.detach().clone() for p in module.parameters()]


def _plain(name, kwargs, opt, steps):
    """The same training without Lightning: rumor.init(), rumor's wrapper, a DistributedSampler."""
    import rumor
    from rumor.lightning import ALGORITHMS

    os.environ["WORLD_SIZE"] = "2"  # Lightning's teardown removed it
    rumor.init()
    try:
        model = _module(opt)
        optimizer = model.configure_optimizers()
        cls = ALGORITHMS[name]
        if name == "onebit_adam":
            algorithm = cls(optimizer, **kwargs)
        else:
            algorithm = cls(**kwargs)
        ddp = rumor.DistributedDataParallel(model, optimizer=optimizer, algorithm=algorithm, **NO_SPLIT)
        loader = _loader()
        losses, step = [], 0
        while step < steps:
            for batch in loader:
                loss = ddp(batch)
                losses.append(loss.item())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                if step == steps:
                    break
        if isinstance(algorithm, rumor.algorithms.AsyncModelAverage):
            algorithm.finish()
        return losses, _params(model)
    finally:
        rumor.shutdown()


def _compare(what, got, want):
    (gl, gp), (wl, wp) = got, want
    if gl != wl:
        return f"{what}: losses {gl} vs without Lightning {wl}"
    for i, (a, b) in enumerate(zip(gp, wp)):
        if not torch.equal(a, b):
            return f"{what}: parameter {i} differs by {(a - b).abs().max().item():.3g}"
    return None


def _algorithms_rank(cases):
    from rumor.lightning import RumorStrategy

    torch.set_num_threads(1)
    bad = []
    for name, kwargs, opt in cases:
        model = _module(opt)
        strategy = RumorStrategy(name, ddp_kwargs=NO_SPLIT, **kwargs)
        _trainer(strategy).fit(model, _loader())
        got = (model.losses, _params(model))
        want = _plain(name, kwargs, opt, 4)
        if len(got[0]) != 4:
            bad.append(f"{name}: Lightning ran {len(got[0])} steps, not 4")
        d = _compare(name, got, want)
        if d:
            bad.append(d)
    return bad


CI_CASES = [
    ("gradient_allreduce", {}, "sgd"),
    ("bytegrad", {}, "sgd"),
    ("decentralized", {}, "sgd"),
    ("local_sgd", {"sync_every": 2}, "sgd"),
    # The two names the strategy builds specially (fp16's dtype, 1-bit Adam's optimizer).
    ("fp16", {}, "sgd"),
    ("onebit_adam", {}, "onebit_adam"),
]
SLOW_CASES = [
    ("qsgd", {}, "sgd"),
    ("low_precision_decentralized", {}, "sgd"),
    ("powersgd", {"start_powerSGD_iter": 2}, "sgd"),
    ("diloco", {"inner_steps": 2}, "sgd"),
]


def test_algorithms_match_rumor_without_lightning():
    for bad in harness.run(_algorithms_rank, 2, timeout=TIMEOUT, args=(CI_CASES,)):
        assert not bad, bad


@pytest.mark.slow
def test_more_algorithms_match_rumor_without_lightning():
    for bad in harness.run(_algorithms_rank, 2, timeout=TIMEOUT, args=(SLOW_CASES,)):
        assert not bad, bad


def _async_rank():
    """AsyncModelAverage's rounds run on their own clock, so no bit-exact reference: fit must
    end through finish(), which leaves every rank with the same weights."""
    import torch.distributed as dist

    from rumor.lightning import RumorStrategy

    model = _module()
    strategy = RumorStrategy("async", sync_interval_ms=5, ddp_kwargs=NO_SPLIT)
    _trainer(strategy).fit(model, _loader())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    both = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    return torch.equal(both[0], both[1])


def test_async_model_average_finishes_with_equal_weights():
    assert harness.run(_async_rank, 2, timeout=TIMEOUT) == [True, True]


def _ddp_backend_rank(backend):
    import lightning as L

    model = _module()
    _trainer(L.pytorch.strategies.DDPStrategy(process_group_backend=backend)).fit(model, _loader())
    import torch.distributed as dist

    used = dist.get_backend()
    return used, model.losses, _params(model)


def test_ddp_strategy_on_rumor_backend_equals_gloo():
    gloo = harness.run(_ddp_backend_rank, 2, timeout=TIMEOUT, args=("gloo",))
    ours = harness.run(_ddp_backend_rank, 2, timeout=TIMEOUT, args=("rumor",))
    for r in range(2):
        assert gloo[r][0] == "gloo" and ours[r][0] == "rumor"
        assert len(ours[r][1]) == 4
        # Two ranks: a sum of two floats is the same in either order, so gloo's bits.
        assert ours[r][1] == gloo[r][1]
        for a, b in zip(ours[r][2], gloo[r][2]):
            assert torch.equal(a, b)


def _checkpoint_rank(path):
    """2 epochs in one go vs 1 epoch, a checkpoint, and a resumed second epoch (PowerSGD: its
    error feedback, P, Q and random state are per rank and must come back)."""
    from rumor.lightning import RumorStrategy

    kwargs = dict(matrix_approximation_rank=1, start_powerSGD_iter=2)

    def strategy():
        return RumorStrategy("powersgd", ddp_kwargs=NO_SPLIT, **kwargs)

    whole = _module()
    _trainer(strategy(), max_steps=-1, max_epochs=2).fit(whole, _loader())

    first = _module()
    trainer = _trainer(strategy(), max_steps=-1, max_epochs=1)
    trainer.fit(first, _loader())
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["rumor_algorithm"]

    resumed = _module()
    _trainer(strategy(), max_steps=-1, max_epochs=2).fit(resumed, _loader(), ckpt_path=path)
    return (saved["algorithm"], len(saved["states"]), first.losses + resumed.losses == whole.losses,
            all(torch.equal(a, b) for a, b in zip(_params(resumed), _params(whole))))


def test_checkpoint_resume_restores_algorithm_state(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    for got in harness.run(_checkpoint_rank, 2, timeout=TIMEOUT, args=(path,)):
        assert got == ("PowerSGD", 2, True, True)


def _registered_rank():
    import lightning as L

    import rumor.lightning  # noqa: F401 (registers "rumor")

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="rumor", logger=False)
    return type(trainer.strategy).__name__


def test_short_name_registered():
    assert harness.run(_registered_rank, 2, timeout=TIMEOUT) == ["RumorStrategy"] * 2


def test_bad_arguments_are_named():
    from rumor.lightning import RumorStrategy

    with pytest.raises(ValueError, match="unknown algorithm 'bagua_magic'.*gradient_allreduce"):
        RumorStrategy("bagua_magic")
    with pytest.raises(TypeError, match="Algorithm object already"):
        import rumor

        RumorStrategy(rumor.algorithms.ByteGrad(), chunk=4)
    with pytest.raises(TypeError, match="algorithm must be"):
        RumorStrategy(3)
    with pytest.raises(ValueError, match="ddp_kwargs may not hold 'optimizer'"):
        RumorStrategy(ddp_kwargs={"optimizer": None})
    # Names are matched without case, "_" or "-".
    from rumor.algorithms import GradientAllReduce

    assert RumorStrategy("Gradient-AllReduce")._algorithm_class is GradientAllReduce


_OWN_LAUNCHER_SCRIPT = """
import os, sys
sys.path.insert(0, {here!r})
import torch, lightning as L
import rumor.lightning  # registers "rumor"
import test_lightning as T

model = T._module()
loader = torch.utils.data.DataLoader(T._data(), batch_size=T.BATCH)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="rumor", max_steps=3, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, loader)
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
both = [torch.zeros_like(flat) for _ in range(2)]
torch.distributed.all_gather(both, flat)
# One write(2) of under PIPE_BUF bytes: the two processes share the pipe, and print() may split.
os.write(1, f"DONE {{trainer.global_rank}} {{len(model.losses)}} {{torch.equal(both[0], both[1])}}\\n".encode())
"""


def test_lightning_own_launcher(tmp_path):
    """`python train.py` with devices=2: Lightning starts the second process itself and sets no
    RANK; the strategy gives rumor.init() Lightning's ranks."""
    import subprocess
    import sys

    from rumor.testing.launch import kill_process_group

    script = tmp_path / "train.py"
    script.write_text(_OWN_LAUNCHER_SCRIPT.format(here=harness.HERE))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(harness._SCRUB_PREFIXES) and k not in harness._SCRUB_NAMES}
    import rumor

    # The checkout's rumor (PYTHONPATH may be relative, and the script runs in tmp_path).
    env.update(OMP_NUM_THREADS="1", RUMOR_TIMEOUT="60", MASTER_PORT=str(harness.free_port()),
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(rumor.__file__))))
    p = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=TIMEOUT)
    finally:
        kill_process_group(p)
    done = sorted(re.findall(r"DONE \d+ \d+ (?:True|False)", out))
    assert done == ["DONE 0 3 True", "DONE 1 3 True"], out[-4000:]
