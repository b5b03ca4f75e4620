"""Live membership (rumor-run --live) with BlueFog's neighbor ops and windows used directly on a
plain model (no DistributedDataParallel): rumor.elastic.State(model, opt, replicas="differ").

Four workers mix their parameters with rumor.neighbor_allreduce over RingGraph (set once, before
rumor.elastic.run: a graph family) at the start of every step, then take an SGD step on their own
data; a window made in the training function carries each rank's step count. r1 is SIGKILLed
before its step 3; the three others give that step up (its mixing may already have changed
their weights: each puts back those of its last applied step), lay the ring over three ranks,
start from the average of their replicas and go on; a newcomer, which set RingGraph(4) before it
joined, is admitted at step 6, where the four start from the average again, over RingGraph(4)
(not the default ExponentialGraph(4)). The final replicas equal a float64 run of
that timeline, to float32 rounding, and not the run where nobody failed.

Also here, without a launcher: what a change does to a topology made by a graph family (laid
over the new world), to a fixed graph (refused until set again) and to windows (refused by name).
"""
from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import harness
import live_runs
from test_live_algorithms import _each_replica_matches, _grads, _model64

DEADLINE_S = 150
STEPS, GROW, FAULT = 9, 6, 3

WORKER = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    import rumor
    from rumor import topology as T

    victim, fault_step, grow_step, total, out = sys.argv[1:6]
    fault_step, grow_step, total = int(fault_step), int(grow_step), int(total)
    me, pid = os.environ["RUMOR_LIVE_ID"], os.getpid()
    rumor.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = rumor.elastic.State(model, opt, replicas="differ")
    # Set once, outside the training function: a graph family, laid over every new world.
    rumor.set_topology(T.RingGraph(rumor.size()))
    log = open(os.path.join(out, f"{me}.log"), "a")
    changes = []
    rumor.elastic.on_change(lambda c: changes.append([c.epoch, c.size, c.left, c.joined]))


    @rumor.elastic.run
    def train(state):
        # Windows belong to one world: made here, they are made again after every change.
        rumor.win_create(torch.zeros(1), "steps")
        while state.step < total:
            if state.step == fault_step and not changes:
                rumor.barrier()  # every member applied the steps before the fault
            if me == victim and state.step == fault_step:
                os.kill(pid, signal.SIGKILL)
            if state.step == grow_step:
                rumor.elastic.wait_for_members(4, timeout=60)
            params = list(model.parameters())
            flat = torch.cat([p.detach().flatten() for p in params])
            mixed = rumor.neighbor_allreduce(flat)  # the step's exchange, before the optimizer
            with torch.no_grad():
                i = 0
                for p in params:
                    p.copy_(mixed[i:i + p.numel()].view_as(p))
                    i += p.numel()
            # the window: every rank puts its step count; each reads what its in-neighbors put
            rumor.win_put(torch.tensor([float(state.step)]), "steps")
            rumor.barrier()  # a put is applied at its target when it returns: visible after this
            seen = rumor.win_update("steps", self_weight=0.0, neighbor_weights={
                r: 1.0 / len(rumor.in_neighbor_ranks()) for r in rumor.in_neighbor_ranks()})
            g = torch.Generator().manual_seed(1000 * state.step + rumor.rank())
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            topo = rumor.load_topology()
            log.write(json.dumps({"step": state.step, "size": rumor.size(), "rank": rumor.rank(), "pid": pid,
                                  "topology": [topo.name, topo.size], "window": float(seen[0])}) + "\\n")
            log.flush()
            state.step += 1


    train(state)
    with open(os.path.join(out, f"{me}.final.json"), "w") as f:
        json.dump({"pid": pid, "changes": changes,
                   "params": [p.detach().double().flatten().tolist() for p in model.parameters()]}, f)
    """
)


def _simulate(sizes, members_at_change):
    """float64: each step, every rank mixes its replica with its in-neighbors' over RingGraph(n)
    (uniform weights), then takes an SGD step (lr 0.1) on its own data (seed
    1000 * step + rank). members_at_change[s]: where the world changed before step s, the old
    ranks that go on, in their new order (None for a newcomer); every replica of the new world
    is the average of those of the members that go on. Returns the final replicas by rank."""
    from rumor.topology import RingGraph

    model = _model64()
    x = [torch.cat([p.detach().flatten() for p in model.parameters()]) for _ in range(sizes[0])]
    shapes = [p.shape for p in model.parameters()]

    def load(v):
        with torch.no_grad():
            i = 0
            for p, shape in zip(model.parameters(), shapes):
                n = p.numel()
                p.copy_(v[i:i + n].view(shape))
                i += n

    for s, n in enumerate(sizes):
        if s in members_at_change:
            keep = [r for r in members_at_change[s] if r is not None]
            avg = sum(x[r] for r in keep) / len(keep)
            x = [avg.clone() for _ in range(n)]
        w = torch.tensor(RingGraph(n).mixing_matrix, dtype=torch.float64)
        x = [sum(w[r, j] * x[j] for j in range(n)) for r in range(n)]
        for r in range(n):
            load(x[r])
            g = torch.cat([t.flatten() for t in _grads(model, s, r + 1)[r].values()])
            x[r] = x[r] - 0.1 * g
    out = []
    for v in x:
        load(v)
        out.append([p.detach().clone().flatten() for p in model.parameters()])
    return out


def test_neighbor_ops_and_windows_used_directly_go_on_live(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "rumor.run", "--live", "--nproc-per-node", "4", "--max-restarts", "1",
           "--live-min", "3", str(script), "r1", str(FAULT), str(GROW), str(STEPS), str(tmp_path)]
    text = harness.launch(cmd, tmp_path, env_extra={"RUMOR_TIMEOUT": "60"}, deadline_s=DEADLINE_S)
    assert "worker r1" in text and "signal 9" in text
    survivors = ["r0", "r2", "r3"]
    logs, finals = live_runs.load_and_check(tmp_path, text, survivors + ["j1"], survivors, STEPS)
    for m in survivors:
        assert [(c[1], c[2], c[3]) for c in finals[m]["changes"]] == [(3, ["r1"], []), (4, [], ["j1"])], finals[m]
    sizes = live_runs.sizes_by_step(logs, STEPS)
    first = logs["j1"][0]["step"]
    assert sizes == [4] * FAULT + [3] * (first - FAULT) + [4] * (STEPS - first) and FAULT < first <= GROW, sizes
    # the exponential graph was laid over each world; the window of each world carried the step
    for m, entries in logs.items():
        for e in entries:
            assert e["topology"] == ["RingGraph", e["size"]], (m, e)
            assert e["window"] == float(e["step"]), (m, e)
    assert [e["rank"] for e in logs["r0"]][-1] == 0 and logs["j1"][-1]["rank"] == 3
    # r1 (old rank 1) left: r0, r2, r3 go on as ranks 0, 1, 2; then j1 joins as rank 3
    changes = {FAULT: [0, 2, 3], first: [0, 1, 2, None]}
    want = _simulate(sizes, changes)
    full = _simulate([4] * STEPS, {})
    _each_replica_matches(finals, logs, want, full)


# ---- the carry, without a launcher ---------------------------------------------------------------

def _carry_rank():
    import rumor
    from rumor import topology as T
    from rumor.neighbor import ops, window

    rumor.init()
    n = rumor.size()
    out = {}
    # a family set in a world of n + 2 ranks, carried into this one
    ops.restore_topologies(ops.TopologyCarry(T.RingGraph(n + 2, style=2), False, None, False))
    t = rumor.load_topology()
    out["family"] = (t.name, t.size, t == T.RingGraph(n, style=2))
    # a fixed graph (its weights only) of another world: refused until set again
    ops.restore_topologies(ops.TopologyCarry(T.Topology(T.ExponentialGraph(n + 2).weights), False, None, False))
    try:
        rumor.neighbor_allreduce(torch.ones(3))
        out["fixed"] = None
    except ValueError as e:
        out["fixed"] = str(e)
    rumor.set_topology(T.RingGraph(n))
    out["after set"] = rumor.neighbor_allreduce(torch.full((3,), float(rumor.rank()))).tolist()
    window.restore_windows((["w"], n + 2))
    try:
        rumor.win_put(torch.ones(2), "w")
        out["window"] = None
    except ValueError as e:
        out["window"] = str(e)
    rumor.win_create(torch.ones(2), "w")  # made again: usable
    rumor.win_put(torch.full((2,), 3.0), "w")
    rumor.barrier()  # every put applied
    out["window again"] = rumor.win_update("w").tolist()
    rumor.barrier()  # nobody leaves while another still puts
    rumor.shutdown()
    return out


def test_a_change_lays_a_graph_family_over_the_new_world_and_refuses_what_it_cannot_carry():
    for out in harness.run(_carry_rank, 3, timeout=DEADLINE_S):
        assert out["family"] == ("RingGraph", 3, True)
        msg = out["fixed"]
        assert msg and "fixed graph of 5 ranks" in msg and "world now has 3" in msg and "set_topology" in msg, msg
        assert out["after set"] == pytest.approx([1.0, 1.0, 1.0])  # a ring of 3: the mean of 0, 1, 2
        msg = out["window"]
        assert msg and "'w'" in msg and "membership changed" in msg and "training function" in msg, msg
        # a ring of 3, uniform thirds: its own ones and the two neighbours' puts of 3
        assert out["window again"] == pytest.approx([7.0 / 3, 7.0 / 3])
