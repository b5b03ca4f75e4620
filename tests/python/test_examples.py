"""examples/: every example runs for a few steps on 2 ranks under the real launcher
(`python -m rumor.run --nproc-per-node 2 examples/X.py --steps N ...`), exits 0, and the metric it
prints goes down (the loss averaged over the ranks, or the distance to the mean), so that the
examples never rot. examples/async_train.py runs in test_launcher.py. The ddp_cnn algorithms
beyond the first, the plain DiLoCo run and elastic's restart are `slow` (each is another launch of
~20 s on two busy cores)."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys

import pytest

import harness

EXAMPLES = os.path.abspath(os.path.join(harness.HERE, os.pardir, os.pardir, "examples"))
STEP = re.compile(r"^step (\d+) loss ([0-9.eE+-]+)", re.M)


def _run(tmp_path, example, *args, launcher=(), env=None, nproc=2):
    cmd = [sys.executable, "-m", "rumor.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(harness.free_port()), *launcher,
           os.path.join(EXAMPLES, example), *map(str, args)]
    return harness.launch(cmd, tmp_path, env)


def _losses(text):
    got = [(int(s), float(v)) for s, v in STEP.findall(text)]
    assert len(got) >= 2, f"fewer than two loss lines:\n{text[-4000:]}"
    steps = [s for s, _ in got]
    assert steps == sorted(steps), f"loss lines out of order (two ranks printing?): {steps}"
    return [v for _, v in got]


def _went_down(text, factor=0.9):
    losses = _losses(text)
    assert losses[-1] < factor * losses[0], f"loss did not go down: {losses}\n{text[-4000:]}"
    return losses


CNN_FAST = ["gradient_allreduce"]
CNN_ALGORITHMS = ["gradient_allreduce", "bytegrad", "qsgd", "low_precision", "onebit_adam", "decentralized",
                  "low_precision_decentralized", "async", "powersgd", "local_sgd", "diloco", "streaming_diloco"]


def test_every_algorithm_is_offered():
    spec = importlib.util.spec_from_file_location("ddp_cnn", os.path.join(EXAMPLES, "ddp_cnn.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert sorted(mod.ALGORITHMS) == sorted(CNN_ALGORITHMS)


@pytest.mark.parametrize("algorithm", [a if a in CNN_FAST else pytest.param(a, marks=pytest.mark.slow)
                                       for a in CNN_ALGORITHMS])
def test_ddp_cnn(tmp_path, algorithm):
    text = _run(tmp_path, "ddp_cnn.py", "--algorithm", algorithm, "--steps", 12, "--log-every", 4,
                "--warmup", 2, "--sync-every", 2)
    assert f"{algorithm} on 2 ranks (cpu)" in text
    _went_down(text)


def test_ddp_cnn_cuda(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    # One GPU per rank (NCCL refuses two ranks on one device): a single GPU runs one rank.
    nproc = min(2, torch.cuda.device_count())
    text = _run(tmp_path, "ddp_cnn.py", "--device", "cuda", "--steps", 12, "--log-every", 4, nproc=nproc)
    assert f"on {nproc} ranks (cuda)" in text
    _went_down(text)


@pytest.mark.parametrize("streaming", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_diloco_lm(tmp_path, streaming):
    text = _run(tmp_path, "diloco_lm.py", *(["--streaming"] if streaming else []), "--steps", 16,
                "--inner-steps", 4, "--log-every", 4)
    assert ("StreamingDiLoCo" if streaming else "DiLoCo") in text
    _went_down(text, 0.6)


def test_decentralized(tmp_path):
    text = _run(tmp_path, "decentralized.py", "--steps", 15, "--log-every", 5)
    _went_down(text, 0.5)
    # The replicas differ (gossip, not an exact average) but stay close.
    spreads = [float(s) for s in re.findall(r" spread ([0-9.eE+-]+)", text)]
    assert spreads and all(0 < s < 1 for s in spreads[1:]), spreads


def test_consensus(tmp_path):
    text = _run(tmp_path, "consensus.py", "--steps", 3, "--size", 100)
    start = float(re.search(r"^start distance ([0-9.eE+-]+)", text, re.M).group(1))
    assert start > 0.1
    for kind in ("neighbor_allreduce", "push-sum"):
        d = [float(v) for v in re.findall(rf"^{kind} step \d+ distance ([0-9.eE+-]+)", text, re.M)]
        # Two ranks are each other's only neighbour: one round averages exactly (up to rounding).
        assert len(d) == 3 and max(d) < 1e-12 * start, (kind, d, text[-3000:])


def test_elastic(tmp_path):
    text = _run(tmp_path, "elastic.py", "--steps", 15, "--commit-every", 5, launcher=["--max-restarts", "1"])
    assert "resumed" not in text
    _went_down(text)


@pytest.mark.slow
def test_elastic_restart_continues_from_the_last_commit(tmp_path):
    text = _run(tmp_path, "elastic.py", "--steps", 20, "--commit-every", 5, "--crash-at-step", 12,
                launcher=["--max-restarts", "1"])
    assert "exiting at step 12" in text and "resumed at step 10" in text, text[-4000:]
    _went_down(text)


def test_cached_data(tmp_path):
    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh installs it)")
    text = _run(tmp_path, "cached_data.py", "--epochs", 2, "--samples", 128, "--prep-ms", 0)
    epochs = re.findall(r"^epoch (\d) loss ([0-9.]+) .* cached samples (\d+)", text, re.M)
    assert [e[0] for e in epochs] == ["0", "1"], text[-4000:]
    assert float(epochs[1][1]) < float(epochs[0][1])
    assert all(int(e[2]) == 128 for e in epochs)  # every sample cached once the first epoch ended
    # Balanced by cost: the two ranks' token counts differ by at most one sample's worth.
    lo, hi = map(int, re.search(r"tokens per rank (\d+)\.\.(\d+)", text).groups())
    assert hi - lo <= 128


def test_autotune(tmp_path):
    pytest.importorskip("optuna")
    text = _run(tmp_path, "autotune.py", "--steps", 30, "--budget-steps", 15, "--no-cache", "--log-every", 10)
    assert "rumor autotune:" in text
    _went_down(text, 0.97)


def test_examples_use_only_public_names():
    """No example reaches for a private rumor name (rumor._x, obj._x on a rumor object)."""
    import ast

    for root, _, files in os.walk(EXAMPLES):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            tree = ast.parse(open(path).read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    # os._exit is the one allowed (the elastic example's crash).
                    ok = node.attr == "_exit" and isinstance(node.value, ast.Name) and node.value.id == "os"
                    assert ok, f"{path}:{node.lineno}: private name .{node.attr}"
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    mods = [a.name for a in node.names] + ([node.module] if getattr(node, "module", None) else [])
                    for m in mods:
                        assert not any(p.startswith("_") and not p.startswith("__") for p in m.split(".")), \
                            f"{path}:{node.lineno}: private module {m}"
