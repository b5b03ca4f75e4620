"""Hugging Face Accelerate and transformers.Trainer on rumor's torch.distributed backend
(docs/huggingface.md), each against the same run on gloo; and a rumor algorithm inside an
Accelerate loop against the same rumor script without Accelerate.

Both libraries refuse backend="rumor" by name on CPU (accelerate's PartialState maps every CPU
backend but "mpi" to "gloo" and raises when they differ), so the supported route is to create
the default group first: accelerate then takes the group that exists.
"""
from __future__ import annotations

import datetime
import os

import pytest
import torch

import harness

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

# Importing transformers alone takes tens of seconds on two busy cores.
TIMEOUT = 300
STEPS = 4


def _init(backend: str, file_store: str = ""):
    import torch.distributed as dist

    import rumor  # noqa: F401 (registers the backend)

    kw = dict(init_method=f"file://{file_store}") if file_store else {}
    dist.init_process_group(backend, rank=harness.env_rank(), world_size=harness.env_world(),
                            timeout=datetime.timedelta(seconds=60), **kw)
    return dist


def _reset(dist):
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    dist.destroy_process_group()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(16 * STEPS, 8, generator=g),
                                          torch.randn(16 * STEPS, 2, generator=g))


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _accelerate_loop():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    assert acc.num_processes == 2 and acc.distributed_type == "MULTI_CPU", acc.state
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = torch.utils.data.DataLoader(_data(), batch_size=8)
    model, opt, dl = acc.prepare(model, opt, dl)
    for x, y in dl:
        opt.zero_grad()
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
    return [p.detach().clone() for p in acc.unwrap_model(model).parameters()]


def _trainer_run(out_dir: str):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(0, 50, (32, 8), generator=g), torch.randint(0, 2, (32,), generator=g)
    ds = [{"input_ids": ids[i], "labels": labels[i]} for i in range(32)]
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, max_steps=3, use_cpu=True,
                             learning_rate=1e-2, report_to=[], save_strategy="no", logging_strategy="no",
                             dataloader_num_workers=0, seed=0)
    assert args.world_size == 2, args.world_size
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.train()
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    return [p.detach().clone() for p in model.parameters()]


def _hf_rank(tmp: str):
    """Accelerate's loop and Trainer on "rumor", then both again on gloo (met through a file
    store: the first group's TCP store may still hold MASTER_PORT)."""
    dist = _init("rumor")
    group_type = type(dist.group.WORLD).__name__
    acc_rumor = _accelerate_loop()
    tr_rumor = _trainer_run(os.path.join(tmp, f"rumor{harness.env_rank()}"))
    _reset(dist)
    dist = _init("gloo", os.path.join(tmp, "store"))
    acc_gloo = _accelerate_loop()
    tr_gloo = _trainer_run(os.path.join(tmp, f"gloo{harness.env_rank()}"))
    _reset(dist)
    return group_type, acc_rumor, acc_gloo, tr_rumor, tr_gloo


def _max_diff(a, b):
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_accelerate_and_trainer_match_gloo(tmp_path):
    res = harness.run(_hf_rank, 2, timeout=TIMEOUT, args=(str(tmp_path),))
    for group_type, acc_rumor, acc_gloo, tr_rumor, tr_gloo in res:
        assert group_type == "RumorProcessGroup"
        # torch DDP averages two float32 gradients on either backend: the same bits.
        assert _max_diff(acc_rumor, acc_gloo) == 0.0
        assert _max_diff(tr_rumor, tr_gloo) == 0.0
    assert _max_diff(res[0][1], res[1][1]) == 0.0 and _max_diff(res[0][3], res[1][3]) == 0.0


def _algorithm_rank():
    """rumor.DistributedDataParallel with ByteGrad inside an Accelerate loop (Accelerate prepares
    the optimizer and data, not the model), then the same training without Accelerate."""
    import rumor
    from accelerate import Accelerator
    from rumor.algorithms import ByteGrad

    dist = _init("rumor")
    rumor.init()
    r = dist.get_rank()
    acc = Accelerator(cpu=True)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=ByteGrad(), bucket_split_gap_ms=float("inf"))
    opt, dl = acc.prepare(opt, torch.utils.data.DataLoader(_data(), batch_size=8))
    seen = []
    for x, y in dl:
        seen.append(x.clone())
        opt.zero_grad()
        acc.backward(torch.nn.functional.mse_loss(ddp(x), y))
        opt.step()
    with_acc = [p.detach().clone() for p in model.parameters()]

    # Accelerate gives rank r the batches r, r + 2, ... of the unsharded loader.
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=ByteGrad(), bucket_split_gap_ms=float("inf"))
    batches = list(torch.utils.data.DataLoader(_data(), batch_size=8))[r::2]
    assert len(batches) == len(seen) and all(torch.equal(b[0], s) for b, s in zip(batches, seen))
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    without = [p.detach().clone() for p in model.parameters()]
    rumor.shutdown()
    _reset(dist)
    return with_acc, without


def test_rumor_algorithm_inside_accelerate_loop():
    res = harness.run(_algorithm_rank, 2, timeout=TIMEOUT)
    for with_acc, without in res:
        assert _max_diff(with_acc, without) == 0.0
    assert _max_diff(res[0][0], res[1][0]) == 0.0
