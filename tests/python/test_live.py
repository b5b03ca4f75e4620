"""Live membership (rumor-run --live): survivors keep training in the same processes.

* a worker SIGKILLed before its step 4 (GradientAllReduce, ByteGrad): the three others give that
  step up, re-form and go on with three; the launcher starts a newcomer, which the members admit
  at step 8 (rumor.elastic.wait_for_members), receiving the whole state from a survivor;
* a worker SIGSTOPped: the others find it silent past the heartbeat and go on without it; when
  it is continued it learns it was dropped, exits, and comes back as a newcomer;
* a newcomer whose model differs is refused, and the others go on without it;
* a second member dies while the job recovers from the first (after the group re-formed, or
  inside its rumor.init()): the two left go on, then admit two newcomers;
* host 1's link is cut for a second and restored (two emulated hosts): training goes on;
* the newcomer, or the member sending it the state, dies in the middle of the transfer: the
  others re-form without the dead one, and the newcomer that never got the state receives it
  in the next epoch (it is not taken for up to date).
The survivors' pids never change, every step is applied (no process applies one twice; a member
behind the others receives their state), the members' final parameters are bitwise equal, and
with GradientAllReduce they equal a float64 run of the same membership timeline (which ranks
averaged their gradients at each step) to float32 rounding.
Every launcher run has a deadline; on timeout its whole process group is killed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import harness
import live_runs

DEADLINE_S = 150
STEPS, GROW = 14, 8

WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import torch
    import rumor
    from rumor.parallel import DistributedDataParallel

    victim, fault_step, grow_step, total, out, fault, newcomer, algorithm = sys.argv[1:9]
    also = sys.argv[9] if len(sys.argv) > 9 else ""  # a member that dies once the first change is made
    fault_step, grow_step, total = int(fault_step), int(grow_step), int(total)
    me, pid = os.environ["RUMOR_LIVE_ID"], os.getpid()
    pace = float(os.environ.get("LIVE_TEST_STEP_S", "0"))
    # "<id>:<step>:<file>": that member waits before that step until the test makes the file, then stops itself
    hold = os.environ.get("LIVE_TEST_HOLD", "::").split(":", 2)
    with open(os.path.join(out, f"{me}.started"), "w") as f:  # a spare: before it waits in init
        f.write(f"{time.time()!r} {pid}")
    gate = os.environ.get("LIVE_TEST_GATE", "")  # the victim waits for this file before its fault
    rumor.init()
    # LIVE_TEST_OWN_SEEDS="r2,r3": those members start from weights of their own (only the
    # wrapper's broadcast, or the state sent at a change, makes them equal)
    torch.manual_seed(100 + int(me[1:]) if me in os.environ.get("LIVE_TEST_OWN_SEEDS", "").split(",") else 0)
    width = 33 if newcomer == "wrong-model" and me.startswith("j") else 32
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    ddp = DistributedDataParallel(model, algorithm=getattr(rumor.algorithms, algorithm)())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = rumor.elastic.State(ddp, opt)
    log = open(os.path.join(out, f"{me}.log"), "a")
    changes = []
    rumor.elastic.on_change(lambda c: changes.append([c.epoch, c.size, c.left, c.joined, c.reason]))
    refused = lambda: any("refused" in c[4] for c in changes)
    rumor.elastic.on_change(lambda c: os.kill(pid, signal.SIGKILL) if me == also and c.epoch == 1 else None)


    def batch(step, rank):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)


    @rumor.elastic.run
    def train(state):
        while state.step < total:
            if me == victim and state.step == fault_step:
                until = time.monotonic() + 60
                while gate and not os.path.exists(gate) and time.monotonic() < until:
                    time.sleep(0.05)
                with open(os.path.join(out, f"{me}.fault"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            if me == hold[0] and str(state.step) == hold[1]:
                until = time.monotonic() + 60
                while not os.path.exists(hold[2]) and time.monotonic() < until:
                    time.sleep(0.05)
                os.kill(pid, signal.SIGSTOP)
            if state.step == grow_step and not refused():
                rumor.elastic.wait_for_members(4, timeout=100)
            x, y = batch(state.step, rumor.rank())
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            log.write(json.dumps({"step": state.step, "size": rumor.size(), "pid": pid}) + "\\n")
            log.flush()
            state.step += 1
            time.sleep(pace)  # a test that acts on the network mid-training paces the steps


    train(state)
    with open(os.path.join(out, f"{me}.final.json"), "w") as f:
        json.dump({"pid": pid, "changes": changes,
                   "params": [p.detach().double().flatten().tolist() for p in model.parameters()]}, f)
    """
)


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(harness._SCRUB_PREFIXES) and k not in harness._SCRUB_NAMES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RUMOR_TIMEOUT="60")
    return env


def _wait_for(cond, p, what, deadline):
    while not cond():
        if p.poll() is not None or time.monotonic() > deadline:
            os.killpg(p.pid, signal.SIGKILL)
            path = getattr(p, "out_path", None)  # _run_live's launcher writes to a file
            out = path.read_bytes() if path is not None else p.communicate()[0]
            pytest.fail(f"{what} did not happen:\n{out.decode(errors='replace')[-6000:]}")
        time.sleep(0.05)


def _sizes_applied(logs):
    return live_runs.sizes_by_step(logs, STEPS)


def _simulate(sizes):
    """float64: at step s, the gradients of ranks 0..sizes[s]-1 averaged, then SGD with momentum."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, n in enumerate(sizes):
        opt.zero_grad()
        for r in range(n):
            g = torch.Generator().manual_seed(1000 * step + r)
            x, y = torch.randn(6, 8, generator=g).double(), torch.randn(6, 1, generator=g).double()
            (torch.nn.functional.mse_loss(model(x), y) / n).backward()
        opt.step()
    return [p.detach().flatten() for p in model.parameters()]


def _run_live(tmp_path, victim, fault_step, fault, on_progress=None, newcomer="same-model",
              algorithm="GradientAllReduce", env=None, restarts=1, least=3, also="", spares=0):
    # The launcher starts four workers (with spares also a spare and the zygote), each importing
    # torch, at once; on CI's two cores beside another test module a worker's watcher stood
    # still 2.1 s there (with spares, and once without), past the default 2 s heartbeat, and the
    # job re-formed with the same four members before any fault (a change the checks do not
    # expect). Where the fault is a death (found by the exit, not the heartbeat) the heartbeat
    # is longer.
    if fault == "kill":
        env = {"RUMOR_LIVE_HEARTBEAT": "6", **(env or {})}
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "rumor.run", "--live", "--nproc-per-node", "4", "--max-restarts", str(restarts),
           "--live-min", str(least), "--live-spares", str(spares), str(script), victim, str(fault_step), str(GROW), str(STEPS), str(tmp_path), fault, newcomer,
           algorithm, also]
    out = tmp_path / "launcher.txt"  # a file, so that on_progress may read what the launcher said so far
    with open(out, "wb") as f:
        p = subprocess.Popen(cmd, env=dict(_env(), **(env or {})), cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    p.out_path = out
    deadline = time.monotonic() + DEADLINE_S
    try:
        if on_progress is not None:
            on_progress(p, deadline)
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        pytest.fail(f"rumor-run --live did not finish within {DEADLINE_S} s:\n"
                    f"{out.read_bytes().decode(errors='replace')[-8000:]}")
    text = out.read_bytes().decode(errors="replace")
    assert p.returncode == 0, text[-8000:]
    return text


def _check(tmp_path, victim, text, exact=True, merged=False):
    survivors = sorted(m for m in ("r0", "r1", "r2", "r3") if m != victim)
    # No process applied a step twice; the survivors trained to the end in their first process.
    logs, finals = live_runs.load_and_check(tmp_path, text, survivors + ["j1"], survivors, STEPS, every_step=False)
    # Every step was applied, by members that agree on how many averaged it.
    sizes = _sizes_applied(logs)
    # The membership timeline: 4 until the fault, 3 from the step it hit (given up and redone),
    # 4 again from the newcomer's admission (at the latest the step that waited for it).
    fault = len(logs.get(victim, []))
    first = logs["j1"][0]["step"]
    assert [e["step"] for e in logs["j1"]] == list(range(first, STEPS))
    if merged:  # the newcomer was ready when the others re-formed: one change, and 4 at every step
        assert first == fault and sizes == [4] * STEPS, (first, fault, sizes)
    else:
        # A fault before the first step (inside the first restore) re-forms before step 0, and a
        # newcomer ready by then is admitted at that same boundary (CI saw it under load): no step
        # runs with three. Later faults hit a step, which is redone with three.
        assert sizes[:fault] == [4] * fault and first <= GROW, sizes
        assert sizes[fault] == 3 or first == fault == 0, (first, fault, sizes)
        # Three from the fault to the admission: none at all when both are the step-0 boundary.
        assert fault <= first and sizes[fault:first] == [3] * (first - fault), (first, fault, sizes)
        assert sizes[first:] == [4] * (STEPS - first), (first, fault, sizes)
    # Each member saw two changes: the victim left, then the newcomer joined (one, merged).
    want = [(4, [victim], ["j1"])] if merged else [(3, [victim], []), (4, [], ["j1"])]
    # A newcomer at the very boundary of a fault before step 0 may have come with the re-forming
    # (one change) or right after it (two): the steps are the same.
    wants = [want, [(4, [victim], ["j1"])]] if first == fault == 0 and not merged else [want]
    for m in survivors:
        assert [(c[1], c[2], c[3]) for c in finals[m]["changes"]] in wants, finals[m]
    # Every member ends bitwise equal, and equal to the float64 run of this timeline.
    ref = finals[survivors[0]]["params"]
    for m, f in finals.items():
        assert f["params"] == ref, f"{m} differs from {survivors[0]}"
    if not exact:  # ByteGrad rounds each gradient to 8 bits: the members agree bitwise, no float64 run
        return
    expect = _simulate(sizes)
    for got, want in zip(ref, expect):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=2e-5, atol=2e-6)
    if merged or sizes == [4] * STEPS:  # four at every step: the same averaging as a run without the failure
        return
    # Against the run where every rank always trained: the averaging followed the membership.
    full = _simulate([4] * STEPS)
    assert any(not torch.allclose(torch.tensor(g, dtype=torch.float64), w, rtol=1e-3, atol=1e-4)
               for g, w in zip(ref, full))

def test_a_silence_is_counted_in_the_watchers_own_waking_time():
    from rumor._live import _Silences

    s = _Silences(heartbeat_s=2.0, period_s=0.1)

    def watch(t0, t1, counts):  # the watcher ticks every period from t0 to t1, reading counts(t)
        t, quiet = t0, None
        while t < t1 - 1e-9 and quiet is None:
            t = round(t + 0.1, 6)
            s.tick(t)
            quiet = s.silent_for("r1", counts(t), t)
        return t, quiet

    # A member that beats is never silent.
    assert watch(0.0, 5.0, lambda t: int(t * 5))[1] is None
    # A member stopped while its observer runs is found just past the heartbeat.
    t, quiet = watch(5.0, 10.0, lambda t: 25)
    assert quiet is not None and 2.0 < quiet <= 2.1 + 1e-9 and t == pytest.approx(7.1)
    # The observer itself stalled 1.5 s while the member was quiet 2.5 s (one load stalled both):
    # only the observer's waking time counts, so 1 s, not a silence.
    s = _Silences(heartbeat_s=2.0, period_s=0.1)
    watch(0.0, 1.0, lambda t: int(t * 5))
    s.tick(2.6)  # the watcher woke 1.6 s after its last tick
    assert s.silent_for("r1", 5, 2.6) is None
    t, quiet = watch(2.6, 3.5, lambda t: 5)
    assert quiet is None
    # ... and it is found once the observer has been awake a heartbeat past the member's last beat.
    t, quiet = watch(3.5, 10.0, lambda t: 5)
    assert quiet is not None and t == pytest.approx(4.6)



@pytest.mark.parametrize("algorithm", ["GradientAllReduce", "ByteGrad"])
def test_a_killed_worker_leaves_and_a_newcomer_joins(tmp_path, algorithm):
    trace = tmp_path / "trace.json"
    text = _run_live(tmp_path, "r2", 4, "kill", algorithm=algorithm, env={"RUMOR_TIMELINE": str(trace)})
    _check(tmp_path, "r2", text, exact=algorithm == "GradientAllReduce")
    assert "worker r2" in text and "signal 9" in text
    # The timeline: every epoch records to files of its own, which begin with the change.
    from rumor import timeline

    assert os.path.exists(tmp_path / "trace.rank0.json")
    for epoch, size, left, joined in ((1, 3, ["r2"], []), (2, 4, [], ["j1"])):
        for rank in range(size):
            marks = [e for e in timeline.load(tmp_path / f"trace.epoch{epoch}.rank{rank}.json")
                     if e.get("name") == f"rumor.elastic: epoch {epoch}"]
            assert len(marks) == 1, (epoch, rank, marks)
            a = marks[0]["args"]
            assert (a["size"], a["rank"], a["left"], a["joined"]) == (size, rank, left, joined), a


def test_a_spare_takes_the_place_of_a_killed_worker(tmp_path):
    """rumor-run --live-spares 1: the launcher starts spare j1 with the workers; it waits, imported,
    inside rumor.init(). When r2 dies the launcher calls it to r2's slot; it is ready before the
    three others re-form, so the one change that removes r2 admits j1, and every step is trained
    by four. The launcher starts spare j2 once j1 is in, and the job's end sends j2 home."""
    text = _run_live(tmp_path, "r2", 4, "kill", spares=1)
    assert "spare j1 takes slot 2" in text, text[-6000:]
    # j1 was started, as a spare, before r2 died: not started by its death.
    started = float((tmp_path / "j1.started").read_text().split()[0])
    assert started < float((tmp_path / "r2.fault").read_text())
    _check(tmp_path, "r2", text, merged=True)
    assert "started spare j2" in text and not (tmp_path / "j2.final.json").exists(), text[-6000:]
    # The step r2 died in was given up, not lost: j1 trained it and every step after.
    logs, _ = live_runs.load(tmp_path)
    assert [e["step"] for e in logs["j1"]] == list(range(4, STEPS))


def test_a_spare_lost_before_its_call_is_replaced_by_another(tmp_path):
    """The idle spare j1 is SIGKILLed while r2 waits before its fault: the launcher starts spare
    j2 in its place (no member notices: a spare is not one), and j2 takes r2's slot."""
    gate = tmp_path / "gate"

    def kill_the_spare(p, deadline):
        _wait_for(lambda: (tmp_path / "j1.started").exists(), p, "spare j1 started", deadline)
        os.kill(int((tmp_path / "j1.started").read_text().split()[1]), signal.SIGKILL)
        _wait_for(lambda: (tmp_path / "j2.started").exists(), p, "spare j2 started", deadline)
        gate.write_text("")

    text = _run_live(tmp_path, "r2", 4, "kill", spares=1, restarts=2, on_progress=kill_the_spare,
                     env={"LIVE_TEST_GATE": str(gate)})
    assert "worker j1" in text and "spare j2 takes slot 2" in text, text[-6000:]
    logs, finals = live_runs.load_and_check(tmp_path, text, ["r0", "r1", "r3", "j2"], ["r0", "r1", "r3"], STEPS,
                                            every_step=False)
    assert live_runs.sizes_by_step(logs, STEPS) == [4] * STEPS
    for m in ("r0", "r1", "r3"):  # one change: r2 left and j2 joined; j1 was never a member
        assert [(c[1], c[2], c[3]) for c in finals[m]["changes"]] == [(4, ["r2"], ["j2"])], finals[m]


def test_a_spare_forked_by_the_zygote_takes_a_place_and_trains(tmp_path):
    """Once the launcher's zygote has imported torch and rumor, spares are forked from it: r2
    dies (after the zygote is ready), spare j1 takes its place and the launcher forks j2; r0
    dies at that change, and j2, a fresh run of the script with its own pid, takes r0's place
    and trains to the end with the others, as in a run where nobody failed."""
    gate = tmp_path / "gate"
    out = tmp_path / "launcher.txt"

    def after_the_zygote(p, deadline):
        _wait_for(lambda: b"zygote ready" in out.read_bytes(), p, "the zygote ready", deadline)
        gate.write_text("")

    text = _run_live(tmp_path, "r2", 4, "kill", spares=1, restarts=2, also="r0", on_progress=after_the_zygote,
                     env={"LIVE_TEST_GATE": str(gate)})
    assert "spare j2 takes slot 0" in text, text[-6000:]
    line = next(x for x in text.splitlines() if "started spare j2" in x)
    assert "forked by the zygote" in line, line
    pid = int(line.split("(pid ")[1].split(",")[0])
    members = ["r1", "r3", "j1", "j2"]
    logs, finals = live_runs.load_and_check(tmp_path, text, members, ["r1", "r3"], STEPS, every_step=False)
    assert {e["pid"] for e in logs["j2"]} == {pid} and (tmp_path / "j2.started").read_text().split()[1] == str(pid)
    sizes = live_runs.sizes_by_step(logs, STEPS)
    assert sizes == [4] * STEPS, sizes
    ref = finals["r1"]["params"]
    assert all(f["params"] == ref for f in finals.values())
    for got, want in zip(ref, _simulate(sizes)):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=2e-5, atol=2e-6)
    assert [(c[1], c[2], c[3]) for c in finals["r1"]["changes"]] == [(4, ["r2"], ["j1"]), (4, ["r0"], ["j2"])]


def test_a_death_inside_the_first_restore(tmp_path):
    """r2 dies inside the job's first restore (rumor.elastic.State.restore, before its first
    collective): the three others re-form and restore again, without spare j1, which would not
    take part in the restore's collectives; j1 enters at the next step boundary. Before, the
    survivors' restore raised and every one of them ended."""
    text = _run_live(tmp_path, "none", 0, "kill", spares=1, env={"RUMOR_TEST_DIE_AT": "elastic:restore:r2"})
    assert "worker r2" in text and "signal 9" in text, text[-6000:]
    _check(tmp_path, "r2", text)


def test_a_death_while_the_wrappers_are_built(tmp_path):
    """r0, the root of the DDP wrapper's weight broadcast, dies as the wrappers are built; r2 and r3
    initialised their models differently, so only that broadcast would have made them equal. The
    others record the failed broadcast instead of raising; rumor.elastic.run re-forms them before
    the first step and sends r1's state to r2 and r3. Before, every survivor's wrapper raised and
    the job ended."""
    text = _run_live(tmp_path, "none", 0, "kill",
                     env={"RUMOR_TEST_DIE_AT": "ddp:broadcast:r0", "LIVE_TEST_OWN_SEEDS": "r2,r3"})
    assert "worker r0" in text and "signal 9" in text, text[-6000:]
    _check(tmp_path, "r0", text)


def test_a_death_inside_the_first_init(tmp_path):
    """r2 dies inside the script's rumor.init(), after the rendezvous and before the first barrier:
    the others' init() re-forms without it and returns in that epoch (rank and size of three), so
    the script goes on as written; newcomer j1 is admitted at a step boundary. Before, every
    survivor's init() raised; and one slower to reach set_peers than the others were to give up
    on that world waited out RUMOR_TIMEOUT for their doorbells, which were gone."""
    text = _run_live(tmp_path, "none", 0, "kill", env={"RUMOR_TEST_DIE_AT": "init:peers:r2"})
    assert "worker r2" in text and "signal 9" in text, text[-6000:]
    survivors = ["r0", "r1", "r3"]
    logs, finals = live_runs.load_and_check(tmp_path, text, survivors + ["j1"], survivors, STEPS, every_step=False)
    sizes = _sizes_applied(logs)
    first = logs["j1"][0]["step"]
    # j1 (r2's replacement) enters at the first boundary it is ready for: step 0 where the
    # re-forming took longer than its start.
    assert 0 <= first <= GROW and sizes == [3] * first + [4] * (STEPS - first), sizes
    for m in survivors:  # the change inside init() came before the script's callbacks
        assert [(c[1], c[2], c[3]) for c in finals[m]["changes"]] == [(4, [], ["j1"])], finals[m]
    ref = finals["r0"]["params"]
    assert all(f["params"] == ref for f in finals.values())
    for got, want in zip(ref, _simulate(sizes)):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=2e-5, atol=2e-6)


def test_a_stopped_worker_is_dropped_and_comes_back_as_a_newcomer(tmp_path):
    victim_log = tmp_path / "r1.log"
    r0_log = tmp_path / "r0.log"

    def resume_after_the_others_went_on(p, deadline):
        # The victim stopped itself at step 3; once the others trained a step without it, it is
        # continued: it must find itself dropped, exit, and come back as newcomer j1.
        _wait_for(lambda: r0_log.exists() and any(e["size"] == 3 for e in live_runs.read_log(r0_log)), p,
                  "the survivors training without the stopped worker", deadline)
        os.kill(live_runs.read_log(victim_log)[0]["pid"], signal.SIGCONT)

    text = _run_live(tmp_path, "r1", 3, "stop", resume_after_the_others_went_on)
    _check(tmp_path, "r1", text)
    assert "silent" in text and "worker r1" in text


def test_a_newcomer_with_another_model_is_refused_and_the_others_go_on(tmp_path):
    text = _run_live(tmp_path, "r2", 4, "kill", newcomer="wrong-model")
    _, finals = live_runs.load(tmp_path)
    assert sorted(finals) == ["r0", "r1", "r3"], text[-6000:]
    # The newcomer got the model check's error; the members re-formed without it.
    assert "the wrapped models differ across ranks" in text and "refused" in text, text[-6000:]
    for m, f in finals.items():
        assert [(c[1], c[2], c[3]) for c in f["changes"]] == [(3, ["r2"], []), (3, ["j1"], [])], (m, f["changes"])
    sizes = [4] * 4 + [3] * (STEPS - 4)
    for m in finals:
        log = live_runs.read_log(tmp_path / f"{m}.log")
        assert [e["step"] for e in log] == list(range(STEPS)) and [e["size"] for e in log] == sizes, m
        assert finals[m]["params"] == finals["r0"]["params"], m
    for got, want in zip(finals["r0"]["params"], _simulate(sizes)):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=2e-5, atol=2e-6)


def _stop_and_collect(procs, outs):
    """Kills the launchers still running (their whole process groups) and returns their outputs."""
    from rumor.testing import launch

    return launch.stop_and_collect(procs, outs)


def _two_hosts(tmp_path, victim, restarts=1, least=3, env=None, during=None, hosts=2):
    """Two hosts (network namespaces) x two workers (or four hosts x one), one launcher per host;
    node 0's launcher hosts the store. during(cluster, deadline), if given, acts while they
    train. Returns the launchers' output."""
    import secrets

    from rumor.testing import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(f"emulated hosts need Linux network namespaces: {why}")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    # The victim is killed (found by its exit): the longer heartbeat, as in _run_live (on CI a
    # loaded start-up stood a worker's watcher still 2.5 s here).
    env = dict(_env(), RUMOR_JOB_SECRET=secrets.token_hex(32), RUMOR_LIVE_HEARTBEAT="6", **(env or {}))
    procs, outs = [], []
    per = 4 // hosts
    with netns.Cluster(hosts) as cluster:
        try:
            for node in range(hosts):
                out = open(tmp_path / f"launcher{node}.txt", "w+b")
                outs.append(out)
                procs.append(cluster.popen(node, [
                    sys.executable, "-m", "rumor.run", "--live", "--nnodes", str(hosts), "--node-rank", str(node),
                    "--nproc-per-node", str(per), "--max-restarts", str(restarts), "--live-min", str(least),
                    "--master-addr", cluster.ip(0), "--master-port", "29500", "--rdzv-id", "live-test", str(script),
                    victim, "4", str(GROW), str(STEPS), str(tmp_path), "kill", "same-model", "GradientAllReduce"],
                    env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            deadline = time.monotonic() + DEADLINE_S
            if during is not None:
                during(cluster, procs, deadline)
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            text = _stop_and_collect(procs, outs)
    assert [p.returncode for p in procs] == [0] * hosts, text
    return text


def test_live_on_two_emulated_hosts(tmp_path):
    """r3 (host 1) is killed; the newcomer host 1's launcher starts joins."""
    _check(tmp_path, "r3", _two_hosts(tmp_path, "r3"))


def test_a_launcher_whose_only_worker_died_starts_the_newcomer(tmp_path):
    """Four hosts of one worker each; r3, host 3's only worker, is killed. Its launcher, left with
    no worker running, still reports the death to the others and starts the newcomer, which
    joins (a launcher that stopped watching once none of its workers ran left the others to find
    the death by its silence, and never started the newcomer)."""
    text = _two_hosts(tmp_path, "r3", hosts=4)
    assert "worker r3" in text and "started newcomer j1" in text, text[-6000:]
    _check(tmp_path, "r3", text)


def test_a_link_that_flaps_is_survived(tmp_path):
    """Host 1's link is cut for a second in the middle of training, then restored. Whatever the
    heartbeat then decides (the members carry on over TCP's retransmissions, or host 1's are
    dropped and come back as newcomers), training ends on every member left, bitwise equal and
    equal to the float64 run of the steps as they were applied; nothing hangs."""
    r0_log = tmp_path / "r0.log"

    def flap(cluster, procs, deadline):
        _wait_for(lambda: r0_log.exists() and len(live_runs.read_log(r0_log)) >= 3, procs[0], "r0's third step", deadline)
        port = cluster.host(1).switch_port
        for state in ("down", "up"):
            r = cluster.exec_run_ns(cluster.switch, ["ip", "link", "set", port, state])
            assert r.returncode == 0, r.stderr
            if state == "down":
                time.sleep(1.0)  # the length of the cut, not a wait for something to happen

    text = _two_hosts(tmp_path, "none", restarts=2, least=2, env={"LIVE_TEST_STEP_S": "0.3"}, during=flap)
    finals = sorted(f[:-len(".final.json")] for f in os.listdir(tmp_path) if f.endswith(".final.json"))
    assert {"r0", "r1"} <= set(finals), text[-6000:]
    _, _, sizes = _check_timeline(tmp_path, text, finals, ["r0", "r1"])
    assert sizes[:3] == [4] * 3, sizes


def _check_timeline(tmp_path, text, members, stayed):
    """The end of a run with several changes: members are the processes that end training,
    stayed those that must have trained from start to end in their first process. Returns the
    logs, the finals and the world size of each step; every step was applied by members that
    agree on its size, and the members end bitwise equal to each other and to the float64 run
    of that timeline."""
    logs, finals = live_runs.load_and_check(tmp_path, text, members, stayed, STEPS)
    sizes = _sizes_applied(logs)
    ref = finals[members[0]]["params"]
    assert all(f["params"] == ref for f in finals.values())
    for got, want in zip(ref, _simulate(sizes)):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=2e-5, atol=2e-6)
    return logs, finals, sizes


def test_a_second_failure_while_the_job_recovers_from_the_first(tmp_path):
    """r1 is killed before its step 4; r3 dies as soon as the three re-formed (in its change
    callback, before the group's first step): the two left re-form again, then admit both
    newcomers. Training goes on throughout and ends equal to the float64 run of its timeline."""
    text = _run_live(tmp_path, "r1", 4, "kill", restarts=2, least=2, also="r3")
    _, finals, sizes = _check_timeline(tmp_path, text, ["r0", "r2", "j1", "j2"], ["r0", "r2"])
    # 4 until r1's fault; step 4 applied by the two left (the three never finished a step: r3
    # died first); then growing back to 4 (one newcomer may come a little before the other).
    assert sizes[:4] == [4] * 4 and sizes[4] == 2 and sizes[-1] == 4, sizes
    assert sizes[4:] == sorted(sizes[4:]), sizes
    for m in ("r0", "r2"):
        assert [(c[1], c[2]) for c in finals[m]["changes"][:2]] == [(3, ["r1"]), (2, ["r3"])], finals[m]["changes"]


def test_a_member_killed_inside_the_next_epochs_init(tmp_path):
    """r2 is killed before its step 4; r3 dies inside the three's rumor.init() of epoch 1 (its
    peers known, the group's first barrier not yet passed): the init fails on the other two at
    once, they form epoch 2 and admit both newcomers later."""
    text = _run_live(tmp_path, "r2", 4, "kill", restarts=2, least=2, env={"RUMOR_TEST_DIE_AT": "init:peers:r3@1"})
    _, finals, sizes = _check_timeline(tmp_path, text, ["r0", "r1", "j1", "j2"], ["r0", "r1"])
    assert "worker r3" in text and text.count("signal 9") == 2, text[-6000:]
    # Epoch 1 never trained: step 4 was applied by the two left.
    assert sizes[:4] == [4] * 4 and sizes[4] == 2 and sizes[-1] == 4 and sizes[4:] == sorted(sizes[4:]), sizes
    for m in ("r0", "r1"):
        # epoch 1 never trained (its init failed), so the callbacks hear of both leaving at once
        first = finals[m]["changes"][0]
        assert (first[1], first[2], first[3]) == (2, ["r2", "r3"], []), finals[m]["changes"]


@pytest.mark.parametrize("who", ["j1", "r0"])
def test_a_death_during_the_state_transfer_to_a_newcomer(tmp_path, who):
    """The newcomer j1 is admitted at step 8; while the state is being sent to it (the length
    broadcast, the payload not), j1 itself dies, or r0, the member sending it. The others re-form
    without the dead one; the one who never received the state is not taken for up to date."""
    text = _run_live(tmp_path, "r2", 4, "kill", restarts=2, env={"RUMOR_TEST_DIE_AT": f"live:transfer:{who}"})
    if who == "j1":
        members, stayed = ["r0", "r1", "r3", "j2"], ["r0", "r1", "r3"]
    else:
        members, stayed = ["r1", "r3", "j1", "j2"], ["r1", "r3"]
    _, finals, sizes = _check_timeline(tmp_path, text, members, stayed)
    assert f"worker {who}" in text and text.count("signal 9") == 2, text[-6000:]
    assert sizes[:4] == [4] * 4 and sizes[4] == 3 and sizes[-1] == 4, sizes
    # The epoch that admitted j1 never trained: the callbacks are told against the one before it.
    told = [(3, ["r2"], []), (3, ["j1"], []), (4, [], ["j2"])] if who == "j1" else \
        [(3, ["r2"], []), (3, ["r0"], ["j1"]), (4, [], ["j2"])]
    for m in stayed:
        assert [(c[1], c[2], c[3]) for c in finals[m]["changes"]] == told, (m, finals[m]["changes"])
