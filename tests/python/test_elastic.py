"""Restarts under the launcher and elastic training.

* rumor.run restarts the workers after one is SIGKILLed (once, and twice in a row): the new
  workers rendezvous again (the agent's store still holds the keys of the killed attempt), train
  to the end, and the launcher exits by itself with status 0.
* a rank SIGKILLed in init or mid-training leaves no shared-memory name of the job behind.
* rumor.elastic: a restart continues from the last commit and ends bitwise where an
  uninterrupted run ends; a node that leaves (4 -> 3) and one that joins (3 -> 4, marked slow:
  about 2 minutes on 2 cores) likewise, against a run chained through disk commits.
Every launcher run has a deadline: on timeout its whole process group is killed and the test
fails with the output so far.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

import harness

DEADLINE_S = 150

# Trains a small model with DistributedDataParallel; while TORCHELASTIC_RESTART_COUNT < KILLS,
# rank VICTIM SIGKILLs itself at step 5. Reports the attempt and a checksum of the weights.
DDP_WORKER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import rumor
    from rumor.parallel import DistributedDataParallel

    kills, victim = int(sys.argv[1]), int(sys.argv[2])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rumor.init()
    r, n = rumor.rank(), rumor.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + r)
    for step in range(10):
        if attempt < kills and r == victim and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    s = sum(float(p.double().sum()) for p in model.parameters())
    print(f"DONE rank={r} attempt={attempt} sum={s!r}", flush=True)
    """
)


def _env(extra=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(harness._SCRUB_PREFIXES) and k not in harness._SCRUB_NAMES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RUMOR_TIMEOUT="30")
    env.update(extra or {})
    return env


def launch(cmd, cwd, env_extra=None, deadline=DEADLINE_S):
    """Runs a launcher command under a deadline; returns (returncode, output)."""
    p = subprocess.Popen(cmd, env=_env(env_extra), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish within {deadline} s:\n"
                    f"{out.decode(errors='replace')[-6000:]}")
    return p.returncode, out.decode(errors="replace")


def rumor_run(nproc, max_restarts, script, *args):
    return [sys.executable, "-m", "rumor.run", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.2", "--nnodes", "1", "--master-addr", "127.0.0.1",
            "--master-port", str(harness.free_port()), str(script), *map(str, args)]


def done_reports(text):
    # The launcher merges the workers' streams: several reports may share a line.
    # The sum as a number only: other ranks' output (a warning, say) can land right after it on
    # the shared pipe, with no separator in between.
    num = r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
    return [(int(r), int(a), float(s)) for r, a, s in re.findall(rf"DONE rank=(\d+) attempt=(\d+) sum=({num})", text)]


@pytest.mark.parametrize("kills", [1, 2], ids=["one-restart", "two-restarts-in-a-row"])
def test_rumor_run_restarts_ddp_workers(tmp_path, kills):
    script = tmp_path / "ddp_worker.py"
    script.write_text(DDP_WORKER)
    rc, text = launch(rumor_run(4, kills, script, kills, 1), tmp_path)
    assert rc == 0, f"launcher exited with {rc}:\n{text[-6000:]}"
    reports = done_reports(text)
    # Every rank of the last attempt finished (and none of an earlier attempt did).
    assert sorted((r, a) for r, a, _ in reports) == [(r, kills) for r in range(4)], text[-6000:]
    # The restarted job trained as one: identical weights everywhere.
    assert len({s for _, _, s in reports}) == 1, reports
    assert f"attempt={kills}" in text


# ---- /dev/shm after a rank is SIGKILLed --------------------------------------------------------

def test_sweep_removes_only_names_of_dead_owners(tmp_path):
    from rumor import _shm

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ns = _shm._pid_namespace()
    me, gone = f"{ns}.{os.getpid()}", f"{ns}.{dead.pid}"
    names = {
        f"rumor-00aa-db-1@{gone}": True,                  # dead owner
        f"rumor-00aa-db-0@{me}": False,                   # live owner
        f"rumor-00aa-c0-0-1@{me}+{gone}": False,          # channel: one owner still alive
        f"rumor-00aa-c0-1-2@{gone}+{gone}": True,
        f"rumor-00aa-db-2@{ns + 1}.{dead.pid}": False,    # another pid namespace: not ours to judge
        "rumor-00aa-db-3": False,                         # not a tagged rumor name
        f"rumor_elastic-1f2e-77aa@{gone}": True,          # a commit whose launcher agent exited
        f"rumor_elastic-1f2e-77aa.tmp99@{gone}": True,
        f"rumor_elastic-1f2e-77bb@{me}": False,
        "other-file": False,
    }
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    removed = _shm.sweep(str(tmp_path))
    assert sorted(removed) == sorted(n for n, gone_ in names.items() if gone_)
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, gone_ in names.items() if not gone_)


SHM_WORKER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import rumor
    from rumor.parallel import DistributedDataParallel

    kill_step, victim = int(sys.argv[1]), int(sys.argv[2])
    print(f"PID rank={os.environ['RANK']} pid={os.getpid()}", flush=True)
    rumor.init()
    r = rumor.rank()
    model = torch.nn.Linear(64, 64)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(8):
        if r == victim and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        ddp(torch.randn(4, 64)).sum().backward()
        opt.step()
        rumor.allreduce(torch.ones(300_000))  # a second communicator use: large ring over shm
    print(f"DONE rank={r}", flush=True)
    """
)


def _job_names(pids):
    from rumor import _shm

    left = []
    for name in os.listdir(_shm.SHM_DIR):
        tags = _shm.owners(name)
        if tags and any(pid in pids for _, pid in tags):
            left.append(name)
    return left


@pytest.mark.parametrize("where,victim", [("init:context", 2), ("init:peers", 0), ("step:4", 1)])
def test_sigkilled_rank_leaves_nothing_in_dev_shm(tmp_path, where, victim):
    script = tmp_path / "shm_worker.py"
    script.write_text(SHM_WORKER)
    env = {}
    kill_step = -1
    if where.startswith("init"):
        env["RUMOR_TEST_DIE_AT"] = f"{where}:{victim}"
    else:
        kill_step = int(where.split(":")[1])
    rc, text = launch(rumor_run(4, 0, script, kill_step, victim), tmp_path, env)
    assert rc != 0, f"the job survived a SIGKILLed rank:\n{text[-4000:]}"
    assert "exitcode: -9" in text, f"rank {victim} was not SIGKILLed:\n{text[-4000:]}"
    # A worker the agent stopped before it printed had not reached init: it made no names.
    by_rank = {int(r): int(p) for r, p in re.findall(r"PID rank=(\d+) pid=(\d+)", text)}
    assert victim in by_rank, text[-4000:]
    pids = set(by_rank.values())
    assert _job_names(pids) == [], f"left in /dev/shm: {_job_names(pids)}"


# ---- rumor.elastic: commit, restart, restore ----------------------------------------------------

ELASTIC_WORKER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import rumor
    from rumor.parallel import DistributedDataParallel
    from torch.utils.data import TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    kill_step, victim, out, total, split, drop_b = sys.argv[1:7]
    kill_step, victim, total, split, drop_b = int(kill_step), int(victim), int(total), split == "1", drop_b == "1"
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if split:  # two emulated hosts: ranks 0-1 and 2-3 (TCP between them, one commit file each)
        os.environ["RUMOR_HOST_ID"] = "host-a" if int(os.environ["RANK"]) < 2 else "host-b"
    rumor.init()
    r, n = rumor.rank(), rumor.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
    sampler = DistributedSampler(data, num_replicas=n, rank=r, shuffle=True, seed=1)
    state = rumor.elastic.State(ddp, opt, sampler, epoch=0, losses=[])
    if drop_b and attempt > 0 and r == 2:
        # host-b comes back as a new node: nothing of the job in its memory
        os.unlink(rumor.elastic._snapshot_file())
    rumor.barrier()
    BATCH = 4
    per_epoch = len(sampler) // BATCH

    @rumor.elastic.run
    def train(state):
        print(f"RESTORED rank={r} attempt={attempt} step={state.restored_step} from={state.restored_from}", flush=True)
        while state.step < total:
            state.epoch, i = divmod(state.step, per_epoch)
            sampler.set_epoch(state.epoch)
            idx = list(sampler)[i * BATCH:(i + 1) * BATCH]
            if attempt == 0 and r == victim and state.step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = data[idx]
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.losses.append(loss.item())
            state.step += 1
            if state.step % 3 == 0:
                state.commit()

    train(state)
    if r == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "losses": state.losses}, out)
    print(f"DONE rank={r} attempt={attempt} sum=0", flush=True)
    """
)

TOTAL_STEPS = 40  # 16 steps per epoch with 4 ranks: the kill lands in the second or third epoch


def _elastic_job(tmp_path, name, kill_step, victim, split=False, drop_b=False):
    import torch

    script = tmp_path / "elastic_worker.py"
    script.write_text(ELASTIC_WORKER)
    out = tmp_path / f"{name}.pt"
    restarts = 1 if kill_step >= 0 else 0
    rc, text = launch(rumor_run(4, restarts, script, kill_step, victim, out, TOTAL_STEPS, int(split), int(drop_b)),
                      tmp_path)
    assert rc == 0, f"launcher exited with {rc}:\n{text[-6000:]}"
    assert sorted(r for r, _, _ in done_reports(text)) == [0, 1, 2, 3], text[-6000:]
    return torch.load(out), text


@pytest.mark.parametrize("split,drop_b", [(False, False), (True, True)],
                         ids=["one-host", "two-hosts-one-comes-back-empty"])
def test_elastic_restart_equals_uninterrupted_run(tmp_path, split, drop_b):
    """A rank SIGKILLed at a random (seeded) step: torchrun restarts the workers, run() restores
    the last commit (momentum, sampler epoch, user fields) and the job ends with exactly the
    weights of an uninterrupted run (GradientAllReduce: the same sums in the same order)."""
    import random

    import torch

    rng = random.Random(1414 + int(split))
    kill_step = rng.randrange(17, TOTAL_STEPS - 1)
    victim = 3 if split else rng.randrange(4)
    ref, _ = _elastic_job(tmp_path, "reference", -1, victim, split)
    got, text = _elastic_job(tmp_path, "restarted", kill_step, victim, split, drop_b)
    committed = kill_step // 3 * 3
    restored = re.findall(r"RESTORED rank=(\d+) attempt=1 step=(\d+|None) from=(-?\d+|None)", text)
    assert sorted(int(r) for r, _, _ in restored) == [0, 1, 2, 3], text[-6000:]
    assert {s for _, s, _ in restored} == {str(committed)}, (kill_step, restored)
    if drop_b:  # host-b had nothing: everyone got the commit from host-a's first rank
        assert {f for _, _, f in restored} == {"0"}, restored
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), (k, (v - got["model"][k]).abs().max())
    assert ref["opt"]["state"].keys() == got["opt"]["state"].keys()
    for i, st in ref["opt"]["state"].items():
        assert torch.equal(st["momentum_buffer"], got["opt"]["state"][i]["momentum_buffer"]), i
    # The user field came back too: one loss per step, the recomputed steps replacing the lost ones.
    assert got["losses"] == ref["losses"] and len(got["losses"]) == TOTAL_STEPS
    # Neither a finished run nor the launcher leaves the job's commits in memory.
    from rumor import elastic

    assert not [n for n in os.listdir(elastic.snapshot_dir()) if n.startswith(f"{elastic._PREFIX}{elastic._job()}")]


def test_state_rejects_bad_arguments():
    import torch

    import rumor

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="model"):
        rumor.elastic.State("model", opt)
    with pytest.raises(TypeError, match="optimizer"):
        rumor.elastic.State(model, "opt")
    with pytest.raises(TypeError, match="sampler"):
        rumor.elastic.State(model, opt, sampler=[1, 2, 3])
    with pytest.raises(ValueError, match="reserved"):
        rumor.elastic.State(model, opt, _mine=3)
    with pytest.raises(TypeError, match="step must be an int"):
        rumor.elastic.State(model, opt, step=2.5)
    with pytest.raises(TypeError, match="step must be an int"):
        rumor.elastic.State(model, opt, step=True)
    with pytest.raises(ValueError, match="step must be >= 0"):
        rumor.elastic.State(model, opt, step=-1)
    with pytest.raises(TypeError, match="train_fn"):
        rumor.elastic.run(None)


def starting_step_then_commit_and_restore(path):
    """Horovod's spelling, State(model, opt, step=N): a fresh start continues from N (restore
    finds no commit and leaves it), a commit saves the counter reached, and a restore replaces
    whatever step= a restarted State was given with the committed one."""
    import torch

    import rumor
    from rumor.parallel import DistributedDataParallel

    rumor.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = rumor.elastic.State(ddp, opt, step=7, path=path, epoch=1)
    seen = {"constructed": state.step}
    seen["restore"] = state.restore()
    seen["after_fresh_restore"] = state.step
    g = torch.Generator().manual_seed(rumor.rank())
    while state.step < 10:
        loss = ddp(torch.randn(3, 4, generator=g)).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.step += 1
    state.commit()
    weights = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    again = rumor.elastic.State(ddp, opt, step=3, path=path, epoch=0)
    seen["restored"] = again.restore()
    seen["after_restore"] = again.step
    seen["weights_back"] = all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    again._finish()
    return seen


def test_state_step_keyword_is_the_starting_step(tmp_path):
    res = harness.run(starting_step_then_commit_and_restore, 2, timeout=90, args=(str(tmp_path / "c.pt"),))
    for seen in res:
        assert seen == {"constructed": 7, "restore": None, "after_fresh_restore": 7, "restored": 10,
                        "after_restore": 10, "weights_back": True}, seen


def _make_consensus_job(name, seed):
    import torch

    import rumor
    from rumor.parallel import DistributedDataParallel

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    if name == "Plain-differ":  # a plain module whose ranks train apart (State(replicas="differ"))
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), None, model
    if name == "OneBitAdam":
        opt = rumor.optim.OneBitAdamOptimizer(model.parameters(), lr=0.01, freeze_step=2)
        algo = rumor.algorithms.OneBitAdamAlgorithm(opt)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        algo = {"Decentralized": lambda: rumor.algorithms.Decentralized("shift_one", hierarchical=False),
                "LowPrecisionDecentralized": lambda: rumor.algorithms.LowPrecisionDecentralized(hierarchical=False),
                "AsyncModelAverage": lambda: rumor.algorithms.AsyncModelAverage(sync_interval_ms=0,
                                                                               warmup_steps=2),
                # no warm-up: the restore must stop the running thread's rounds around the load
                "AsyncModelAverage-running": lambda: rumor.algorithms.AsyncModelAverage(sync_interval_ms=1),
                "LocalSGD": lambda: rumor.algorithms.LocalSGD(sync_every=3),
                "DiLoCo": lambda: rumor.algorithms.DiLoCo(inner_steps=3),
                "PowerSGD": lambda: rumor.algorithms.PowerSGD(start_powerSGD_iter=2)}[name]()
    ddp = DistributedDataParallel(model, optimizer=opt, algorithm=algo)
    return model, opt, algo, ddp


def _train_steps(ddp, opt, g, steps):
    import torch

    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def consensus_commit_restores_the_average(name, path):
    """Trains with rank-different data, commits, then builds a fresh job in the same processes
    (other initial weights) and restores: every rank must hold the float64 average of the
    ranks' committed weights and optimizer state, the algorithm's counters, and train on."""
    import torch

    import rumor
    from rumor import collectives

    rumor.init()
    r, n = rumor.rank(), rumor.size()
    model, opt, algo, ddp = _make_consensus_job(name, 0)
    kw = {"replicas": "differ"} if name == "Plain-differ" else {}
    state = rumor.elastic.State(ddp, opt, path=path, **kw)
    g = torch.Generator().manual_seed(100 + r)
    _train_steps(ddp, opt, g, 5)
    state.step = 5
    # (AsyncModelAverage: only this thread writes the weights, so they are the ones committed.)
    mine = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    key = "momentum_buffer" if name != "OneBitAdam" else "exp_avg"
    mom = torch.cat([opt.state[p][key].double().reshape(-1) for p in model.parameters()])
    def own_error(m, o, a):
        if name == "OneBitAdam":
            return float(sum(o.state[p][k].abs().sum() for p in m.parameters() for k in ("worker_error", "server_error")))
        return float(sum(s.error.abs().sum() for s in a._states.values() if s.error is not None))

    before = {"worker_error": own_error(model, opt, algo) if name in ("OneBitAdam", "PowerSGD") else None}

    def scalars(sd):
        return {k: v for k, v in sd.items() if isinstance(v, (int, float))}

    counters = scalars(algo.elastic_state_dict()) if algo is not None else {}
    state.commit()
    # float32 weights and momenta: the gathered copies are exact; their mean is taken in float64.
    every = collectives.allgather(torch.stack([mine, mom]).float().unsqueeze(0)).double()
    want_w, want_m = every[:, 0].mean(0), every[:, 1].mean(0)
    if name.startswith("AsyncModelAverage"):
        algo.finish(timeout=60)

    model2, opt2, algo2, ddp2 = _make_consensus_job(name, 1)
    state2 = rumor.elastic.State(ddp2, opt2, path=path, **kw)
    got_step = state2.restore()
    got_w = torch.cat([p.detach().double().reshape(-1) for p in model2.parameters()])
    got_m = torch.cat([opt2.state[p][key].double().reshape(-1) for p in model2.parameters()])
    out = {
        "step": got_step,
        "w_err": float((got_w - want_w).abs().max()),
        "m_err": float((got_m - want_m).abs().max()),
        "w_spread": float((every[:, 0] - want_w).abs().max()),
        "counters": (counters, scalars(algo2.elastic_state_dict()) if algo2 is not None else {}),
        "worker_error_before": before["worker_error"],
    }
    if name in ("OneBitAdam", "PowerSGD"):
        out["errors_after"] = own_error(model2, opt2, algo2)
    g2 = torch.Generator().manual_seed(200 + r)
    _train_steps(ddp2, opt2, g2, 3)
    if name.startswith("AsyncModelAverage"):
        algo2.finish(timeout=60)
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in model2.parameters())
    state2._finish()
    return out


@pytest.mark.parametrize("name", ["Decentralized", "LowPrecisionDecentralized", "AsyncModelAverage",
                                  "AsyncModelAverage-running", "LocalSGD", "DiLoCo", "OneBitAdam", "PowerSGD",
                                  "Plain-differ"])
def test_commit_of_rank_replicas_restores_their_average(tmp_path, name):
    res = harness.run(consensus_commit_restores_the_average, 3, timeout=90, args=(name, str(tmp_path / "c.pt")),
                      env={"RUMOR_ELASTIC_JOB": f"consensus-{name}-{os.getpid()}"})
    for out in res:
        assert out["step"] == 5, out
        assert out["w_err"] <= 1e-6 and out["m_err"] <= 1e-6, out
        assert out["counters"][0] == out["counters"][1], out
        assert out["finite"], out
    if name in ("OneBitAdam", "PowerSGD"):
        # These keep every rank's weights equal; their error feedback starts over.
        assert all(o["w_spread"] == 0 for o in res), res
        assert res[0]["worker_error_before"] > 0 and all(o["errors_after"] == 0 for o in res), res
    else:
        assert max(o["w_spread"] for o in res) > 1e-4, "the ranks' replicas never differed: nothing was averaged"



def rank_stateful_algorithm_refused():
    import torch

    import rumor
    from rumor.parallel import DistributedDataParallel

    class Custom(rumor.algorithms.GradientAllReduce):  # a user's algorithm that says nothing
        elastic_replicated = False

    rumor.init()
    out = []
    for algo in [Custom(), rumor.algorithms.GradientAllReduce(), rumor.algorithms.ByteGrad()]:
        model = torch.nn.Linear(4, 4)
        ddp = DistributedDataParallel(model, algorithm=algo)
        try:
            rumor.elastic.State(ddp, torch.optim.SGD(model.parameters(), lr=0.1))
            out.append("ok")
        except NotImplementedError as e:
            out.append(str(e))
    return out


def test_state_refuses_algorithms_that_would_lose_state():
    res = harness.run(rank_stateful_algorithm_refused, 2, timeout=60)
    for r in res:
        assert "Custom keeps state" in r[0] and r[1:] == ["ok", "ok"], r


# ---- scale down 4 -> 3 and up 3 -> 4 (one agent per emulated node, c10d rendezvous) -------------

SCALE_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    import rumor
    from rumor.parallel import DistributedDataParallel
    from torch.utils.data import TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    out, total, kill_step, wait_step, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    rumor.init()
    r, n = rumor.rank(), rumor.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
    sampler = DistributedSampler(data, num_replicas=n, rank=r, shuffle=True, seed=1)
    state = rumor.elastic.State(ddp, opt, sampler, path=None if path == "-" else path, epoch=0)
    BATCH = 4

    @rumor.elastic.run
    def train(state):
        print(f"RESTORED rank={r} world={n} step={state.restored_step} from={state.restored_from}", flush=True)
        per_epoch = len(sampler) // BATCH
        while state.step < total:
            state.epoch, i = divmod(state.step, per_epoch)
            sampler.set_epoch(state.epoch)
            idx = list(sampler)[i * BATCH:(i + 1) * BATCH]
            if state.step == kill_step and os.environ["NODE_ID"] == "3" and n == 4:
                os.kill(os.getppid(), signal.SIGKILL)  # the whole node goes: its agent, then this worker
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step == wait_step and n == 3:
                # Wait for the agent to restart us with the node that joins (the test starts it
                # when it sees this marker); bounded, so a missing restart fails the job.
                if r == 0:
                    open(out + ".marker", "w").close()
                time.sleep(60)
                raise SystemExit(f"rank {r}: no restart for the new node within 60 s")
            x, y = data[idx]
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.step += 1
            if state.step % 3 == 0:
                state.commit()

    train(state)
    if r == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out)
    print(f"DONE rank={r} attempt=0 sum=0", flush=True)
    """
)


def _agent(script, port, run_id, args, nnodes="3:4", is_host=False):
    # Node 0's agent hosts the rendezvous store; it must outlive the job (as on a real cluster).
    return [sys.executable, "-m", "rumor.run", "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "2",
            "--monitor-interval", "0.2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", run_id, "--rdzv-conf", f"last_call_timeout=5,join_timeout=90,is_host={str(is_host).lower()}", str(script), *map(str, args)]


@pytest.mark.slow
def test_elastic_scale_down_4_to_3_then_up_3_to_4(tmp_path):
    """Four single-worker nodes; one node dies at step 10 (the job goes on with 3 from the commit
    of step 9), at step 15 the three wait and a new node joins (4 again, from the commit of step
    15; the newcomer gets it by broadcast). The final weights equal those of a run made of
    uninterrupted pieces over the same committed steps: 4 ranks to 9, 3 ranks to 15, 4 to the end
    (chained through the disk commit of State(path=...))."""
    import time

    import torch

    script = tmp_path / "scale_worker.py"
    script.write_text(SCALE_WORKER)
    total, kill_step, wait_step = 24, 10, 15
    out = tmp_path / "elastic.pt"
    port = harness.free_port()
    procs = []

    def start(nnodes="3:4"):
        node = len(procs)
        log = open(tmp_path / f"agent{node}.log", "wb")
        procs.append((subprocess.Popen(_agent(script, port, "scale", [out, total, kill_step, wait_step, "-"], nnodes,
                                              is_host=node == 0),
                                       # (rumor.run turns the agent's shared store off for an elastic
                                       # node count, or the node joining later would hang: see run.py)
                                       env=_env({"NODE_ID": str(node)}), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True), log))

    def logs():
        return "\n".join((tmp_path / f"agent{i}.log").read_text(errors="replace")[-3000:] for i in range(len(procs)))

    deadline = time.monotonic() + DEADLINE_S
    try:
        for node in range(4):
            start()
            if node == 0:
                time.sleep(1)  # only makes it likelier that the store is up before the others retry
        marker = tmp_path / "elastic.pt.marker"
        while not marker.exists():
            assert time.monotonic() < deadline, f"the job never reached step {wait_step} with 3 nodes:\n{logs()}"
            assert any(p.poll() is None for p, _ in procs), f"every agent exited:\n{logs()}"
            time.sleep(0.1)
        start()
        for p, _ in procs:
            p.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the scaled job did not finish within {DEADLINE_S} s:\n{logs()}")
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    text = logs()
    codes = [p.returncode for p, _ in procs]
    # Node 3 was SIGKILLed with its agent; the others and the newcomer finish by themselves.
    assert codes[3] == -signal.SIGKILL and codes[:3] + codes[4:] == [0, 0, 0, 0], (codes, text)
    restored = re.findall(r"RESTORED rank=(\d+) world=(\d+) step=(\d+|None) from=(-?\d+|None)", text)
    by_world = {(w, s) for _, w, s, _ in restored}
    assert ("4", "None") in by_world and ("3", "9") in by_world and ("4", "15") in by_world, restored
    assert sorted(int(r) for r, w, s, _ in restored if s == "15") == [0, 1, 2, 3], restored

    # The reference: the same committed steps, each piece uninterrupted, chained through the disk.
    disk = tmp_path / "chain.commit"
    for i, (n, upto) in enumerate([(4, 9), (3, 15), (4, total)]):
        ref_out = tmp_path / f"ref{i}.pt"
        rc, ref_text = launch(rumor_run(n, 0, script, ref_out, upto, -1, -1, disk), tmp_path, {"NODE_ID": "-"})
        assert rc == 0, ref_text[-4000:]
    ref, got = torch.load(tmp_path / "ref2.pt"), torch.load(out)
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), (k, (v - got["model"][k]).abs().max())
    for i, st in ref["opt"]["state"].items():
        assert torch.equal(st["momentum_buffer"], got["opt"]["state"][i]["momentum_buffer"]), i


def _replicas_with_wrapper_rank():
    import torch

    import rumor
    from rumor.parallel import DistributedDataParallel

    rumor.init()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = DistributedDataParallel(model, optimizer=opt, algorithm=rumor.algorithms.Decentralized(hierarchical=False))
    try:
        rumor.elastic.State(ddp, opt, replicas="differ")
        return None
    except ValueError as e:
        return str(e)
    finally:
        rumor.shutdown()


def test_state_replicas_is_checked():
    import torch

    import rumor

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="replicas must be 'auto', 'identical' or 'differ'"):
        rumor.elastic.State(model, opt, replicas="same")
    (msg,) = harness.run(_replicas_with_wrapper_rank, 1, timeout=90)
    assert msg and "replicas applies to a plain module" in msg, msg
