"""rumor.timeline: Chrome trace files, their merge, and the flight recorder.

Ranks run through harness.run (deadline per test). What is checked:
* every file is valid trace JSON; complete events ("X") nest per thread (an event that starts
  inside another ends inside it) and appear in the order they ended on their thread;
* a DDP step on 4 ranks shows forward, backward, optimizer step, user ranges and every bucket
  of the step (as a span on the thread that ran it and as a ready -> finished async span);
* an algorithm's after_backward wait (a decentralized weight mix's) shows in the trace and in
  last_iteration_timeline(), after backward's buckets;
* the merged file has a process per rank, each moved by exactly its measured clock offset,
  and that offset is within half the round trip it was measured with (the midpoint estimate
  cannot be further off on one host's shared monotonic clock);
* a rank SIGKILLed while recording leaves a file that is valid once "]" is appended;
* the flight recorder keeps the last N operations in order and is dumped, naming the op, to
  the log and the trace when an operation times out.
"""
from __future__ import annotations

import json
import os
import signal

import pytest

import harness

# ==== inside a rank ===============================================================================


def _ddp_rank(base):
    import torch

    import rumor
    from rumor.testing import models

    torch.set_num_threads(1)
    rumor.init()
    model = models.build("mlp25m", seed=0, scale=1 / 64, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, bucket_cap_mb=0.01, first_bucket_mb=0.002)
    mine = rumor.timeline.start(base)
    steps = 3
    for step in range(steps):
        with rumor.timeline.range("data", step=step):
            x, y = models.batch(model, 4, step=step, shard=rumor.rank())
        out = ddp(x)
        models.loss(out, y).backward()
        opt.step()
        opt.zero_grad()
    w = torch.full((10,), float(rumor.rank()))
    rumor.win_create(w, "tl-win")
    rumor.win_put(w, "tl-win")
    rumor.barrier()
    rumor.win_update("tl-win")
    rumor.win_free("tl-win")
    t = torch.ones(30000)  # 120 kB: above the small-message threshold, so direct or a ring
    rumor.allreduce_(t)
    rumor.timeline.instant("marker", rank=rumor.rank())
    merged = rumor.timeline.stop(merge=True)
    return dict(file=mine, merged=merged, buckets=len(ddp.buckets), steps=steps,
                flight=rumor.timeline.flight_records())


def _hook_rank(base, pause_s):
    import time

    import torch

    import rumor
    from rumor.testing import models

    torch.set_num_threads(1)
    rumor.init()

    class Pausing(rumor.algorithms.GradientAllReduce):
        """Waits in after_backward as a decentralized algorithm waits there for its weight mix."""

        def after_backward(self, ddp):
            super().after_backward(ddp)
            time.sleep(pause_s)

    model = models.build("mlp25m", seed=0, scale=1 / 64, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=Pausing())
    mine = rumor.timeline.start(base)
    seen = []
    for step in range(2):
        x, y = models.batch(model, 4, step=step, shard=rumor.rank())
        t0 = time.monotonic()
        models.loss(ddp(x), y).backward()
        seen.append(dict(ddp.last_iteration_timeline(), returned=time.monotonic() - t0))
        opt.step()
        opt.zero_grad()
    rumor.timeline.stop()
    return dict(file=mine, seen=seen)


def _killed_rank():
    import time

    import rumor

    rumor.init()  # RUMOR_TIMELINE starts the recording
    mine = rumor.timeline.path()
    if rumor.rank() == 0:
        rumor.timeline.stop()
        return mine
    for i in range(50):
        with rumor.timeline.range(f"work {i}"):
            pass
    rumor.timeline.instant("last before kill")
    # Wait (bounded) until the background writer has put the last event on disk by itself: no
    # stop() and no flush(), as in a job killed from outside.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with open(mine) as f:
            if "last before kill" in f.read():
                break
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def _flight_rank(base):
    import datetime

    import torch

    import rumor
    from rumor import _runtime

    rumor.init()
    with rumor.timeline.record(base):
        sizes = [100 + 10 * i for i in range(10)]
        for n in sizes:
            rumor.allreduce_(torch.ones(n))
        before = rumor.timeline.flight_records()
        store = _runtime.rendezvous_store()
        err = None
        if rumor.rank() == 0:
            # Rank 1 skips this barrier: rank 0 times out (RUMOR_TIMEOUT) in it.
            try:
                rumor.barrier()
            except rumor.errors.CommTimeoutError as e:
                err = str(e)
            store.set("flight-test-done", b"1")
            # Rank 0 hosts the store: leaving now could close it before rank 1 has seen the key
            # (a CI run failed so: rank 1's wait read a closed connection).
            store.wait(["flight-test-seen"], datetime.timedelta(seconds=60))
        else:
            store.wait(["flight-test-done"], datetime.timedelta(seconds=60))  # its default: RUMOR_TIMEOUT
            store.set("flight-test-seen", b"1")  # rank 0 waits for it before closing the store
        after = rumor.timeline.flight_records()
    assert not rumor.timeline.is_recording()
    return dict(before=before, after=after, err=err, sizes=sizes)


# ==== checks ======================================================================================

def _x_by_tid(events):
    by = {}
    for e in events:
        if e.get("ph") == "X":
            by.setdefault((e["pid"], e["tid"]), []).append(e)
    return by


def _check_nesting_and_order(events, what):
    eps = 0.002  # timestamps are written with 3 decimals (nanoseconds)
    for key, evs in _x_by_tid(events).items():
        ends = [e["ts"] + e["dur"] for e in evs]
        assert all(b >= a - eps for a, b in zip(ends, ends[1:])), f"{what} {key}: events not in end order"
        stack = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            end = e["ts"] + e["dur"]
            while stack and stack[-1][1] <= e["ts"] + eps:
                stack.pop()
            if stack:
                assert end <= stack[-1][1] + eps, (
                    f"{what} {key}: {e['name']} [{e['ts']}, {end}] starts inside {stack[-1][0]} "
                    f"but ends after it ({stack[-1][1]})")
            stack.append((e["name"], end))


def _events(path):
    with open(path) as f:
        return json.load(f)  # a stopped timeline is a complete JSON array


# ==== tests =======================================================================================

def test_ddp_timeline_four_ranks_and_merge(tmp_path):
    import rumor.timeline as tl

    base = str(tmp_path / "trace.json")
    # The 120 kB allreduce takes the direct path however many cores this machine has.
    res = harness.run(_ddp_rank, 4, timeout=120, args=(base,), env={"RUMOR_HOST_DIRECT_MIN_BYTES": "0"})
    assert res[0]["merged"] == str(tmp_path / "trace.json")
    assert all(r["merged"] is None for r in res[1:])
    offsets = {}
    for rank, r in enumerate(res):
        assert r["file"] == str(tmp_path / f"trace.rank{rank}.json")
        events = _events(r["file"])
        _check_nesting_and_order(events, f"rank {rank}")
        assert all(e["pid"] == rank for e in events)
        clock = [e for e in events if e["name"] == "rumor_clock"][0]["args"]
        offsets[rank] = clock["offset_us"]
        if rank > 0:
            assert abs(clock["offset_us"]) <= clock["rtt_us"] / 2 + 0.002, clock
        names = [e["name"] for e in events]
        for phase in ("forward", "backward", "optimizer step", "wait for buckets"):
            assert names.count(phase) == r["steps"], (phase, names.count(phase))
        # GradientAllReduce has no after_backward of its own, so no span for it
        assert not [n for n in names if n.endswith(".after_backward")]
        data = [e for e in events if e["name"] == "data"]
        assert [e["args"]["step"] for e in data] == list(range(r["steps"]))
        assert all(e["cat"] == "user" for e in data)
        # Every bucket of the last step: one span each inside the last backward, and an async
        # ready -> finished span; buckets were rebuilt after the first step, so count the last.
        back = [e for e in events if e["name"] == "backward"][-1]
        lo, hi = back["ts"], back["ts"] + back["dur"]
        spans = [e for e in events if e["ph"] == "X" and e["cat"] == "bucket" and lo <= e["ts"] <= hi]
        assert sorted(e["name"] for e in spans) == sorted(f"bucket {k}" for k in range(r["buckets"]))
        for s in spans:
            assert s["args"]["bytes"] > 0 and s["args"]["queued_us"] >= 0
        begins = {(e["name"], e["id"]) for e in events if e["ph"] == "b"}
        ends = {(e["name"], e["id"]) for e in events if e["ph"] == "e"}
        assert begins == ends and len(begins) >= r["buckets"] * r["steps"] - r["buckets"]
        # The bucket's collective runs inside the bucket's span, on the same thread.
        comm = [e for e in events if e["ph"] == "X" and e["cat"] == "comm"]
        in_buckets = [c for c in comm for s in spans
                      if c["tid"] == s["tid"] and s["ts"] <= c["ts"] and c["ts"] + c["dur"] <= s["ts"] + s["dur"]]
        assert len(in_buckets) >= len(spans)
        # Time asleep waiting for peers is part of each operation's time.
        ops = [c for c in comm if "tag" in c["args"]]  # communicator operations (not window calls)
        assert ops and all(0 <= c["args"]["blocked_us"] <= c["dur"] + 0.002 for c in ops)
        plain = [c for c in comm if c["name"] == "allreduce" and c["args"]["bytes"] == 120000]
        assert len(plain) == 1
        # One host over shared memory: the direct path (csrc/comm/direct.h); otherwise the ring.
        assert plain[0]["args"]["transport"] in ("shm", "tcp")
        want = "direct" if plain[0]["args"]["transport"] == "shm" else "ring"
        assert plain[0]["args"]["ranks"] == 4 and plain[0]["args"]["algorithm"] == want, plain[0]["args"]
        for op in ("win_put", "win_update"):
            wins = [e for e in events if e["name"] == op]
            assert len(wins) == 1 and wins[0]["args"]["window"] == "tl-win" and wins[0]["args"]["bytes"] == 40
        marker = [e for e in events if e["name"] == "marker"]
        assert marker and marker[0]["args"]["rank"] == rank
        # The flight recorder saw the same operations, oldest first.
        seqs = [f["seq"] for f in r["flight"]]
        assert 0 < len(seqs) <= 64 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        # ... ending with the plain allreduce and stop(merge=True)'s barrier.
        assert [(f["name"], f["bytes"], f["state"]) for f in r["flight"][-2:]] == [
            ("allreduce", 120000, "done"), ("barrier", -1, "done")]
    merged = tl.load(res[0]["merged"])
    _check_nesting_and_order(merged, "merged")
    procs = {e["pid"]: e["args"]["name"] for e in merged if e["name"] == "process_name"}
    assert procs == {r: f"rank {r}" for r in range(4)}
    # Each rank's events are moved by exactly that rank's offset.
    for rank, r in enumerate(res):
        mine = [e for e in _events(r["file"]) if e["name"] == "marker"][0]
        there = [e for e in merged if e["name"] == "marker" and e["pid"] == rank][0]
        assert there["ts"] == pytest.approx(mine["ts"] - offsets[rank], abs=0.002)


def test_an_algorithms_after_backward_wait_is_in_the_breakdown_and_the_trace(tmp_path):
    pause = 0.05
    res = harness.run(_hook_rank, 2, timeout=120, args=(str(tmp_path / "hook.json"), pause))
    for rank, r in enumerate(res):
        for tl in r["seen"]:
            # The hook's time is counted, after backward's buckets and before backward() returned.
            assert tl["after_backward"] >= pause, tl
            assert tl["after_backward_end"] - tl["after_backward"] >= tl["backward_end"] - 1e-6, tl
            assert tl["after_backward_end"] <= tl["returned"] + 1e-6, tl
        events = _events(r["file"])
        _check_nesting_and_order(events, f"rank {rank}")
        hooks = [e for e in events if e["name"] == "Pausing.after_backward"]
        assert len(hooks) == 2 and all(e["cat"] == "wait" and e["dur"] >= pause * 1e6 for e in hooks), hooks
        # Each comes after that step's backward span ends (the buckets' wait included).
        backs = [e for e in events if e["name"] == "backward"]
        assert len(backs) == 2
        for b, h in zip(backs, hooks):
            assert h["ts"] >= b["ts"] + b["dur"] - 1, (b, h)


def test_killed_rank_leaves_a_readable_file(tmp_path):
    import rumor.timeline as tl

    base = str(tmp_path / "killed.json")
    res = harness.run(_killed_rank, 2, timeout=90, env={"RUMOR_TIMELINE": base}, may_die=[1])
    assert res[0] == str(tmp_path / "killed.rank0.json")
    _events(res[0])  # rank 0 stopped normally: complete JSON
    path = str(tmp_path / "killed.rank1.json")
    with open(path) as f:
        text = f.read()
    assert not text.rstrip().endswith("]")  # cut short, as a killed run leaves it
    events = json.loads(text + "]")  # only the closing bracket is missing
    assert events == tl.load(path)
    names = [e["name"] for e in events]
    assert [n for n in names if n.startswith("work ")] == [f"work {i}" for i in range(50)]
    assert "last before kill" in names
    _check_nesting_and_order(events, "killed rank")


def test_flight_recorder_last_n_and_dump_on_timeout(tmp_path):
    base = str(tmp_path / "flight.json")
    results = harness.run(_flight_rank, 2, timeout=90, args=(base,), raw=True,
                          env={"RUMOR_FLIGHT_RECORDER": "8", "RUMOR_TIMEOUT": "3"})
    for r in results:
        assert r.ok, r.error
    out = [r.value for r in results]
    sizes = out[0]["sizes"]
    for rank in range(2):
        before = out[rank]["before"]
        # The clock ping-pong of timeline.start came first; the last 8 are the 10 allreduces' tail.
        assert [f["name"] for f in before] == ["allreduce"] * 8
        assert [f["bytes"] for f in before] == [4 * n for n in sizes[-8:]]
        assert all(f["state"] == "done" and f["ended"] >= f["started"] for f in before)
        assert [f["seq"] for f in before] == list(range(before[0]["seq"], before[0]["seq"] + 8))
    assert "barrier" in out[0]["err"] and "timed out" in out[0]["err"]
    last = out[0]["after"][-1]
    assert last["name"] == "barrier" and last["state"] == "failed" and "timed out" in last["error"]
    assert out[1]["after"] == out[1]["before"]  # rank 1 ran nothing more
    log = results[0].output
    assert "flight recorder of rank 0" in log
    assert "barrier (op #" in log and " failed " in log
    events = _events(str(tmp_path / "flight.rank0.json"))
    flight = [e for e in events if e.get("cat") == "flight"]
    assert any(e["name"] == "failure" for e in flight)
    dumped = [e for e in flight if e["name"].startswith("flight: ")]
    assert [e["name"] for e in dumped] == ["flight: allreduce"] * 7 + ["flight: barrier"]
    assert dumped[-1]["args"]["state"] == "failed"


def test_flight_records_env_is_validated(monkeypatch):
    from rumor import _runtime

    monkeypatch.setenv("RUMOR_FLIGHT_RECORDER", "0")
    assert _runtime.flight_records_from_env() == 0
    monkeypatch.delenv("RUMOR_FLIGHT_RECORDER")
    assert _runtime.flight_records_from_env() == 64
    for bad in ("-1", "many"):
        monkeypatch.setenv("RUMOR_FLIGHT_RECORDER", bad)
        with pytest.raises(ValueError, match="RUMOR_FLIGHT_RECORDER"):
            _runtime.flight_records_from_env()


def test_merge_inputs_are_checked(tmp_path):
    import rumor.timeline as tl

    def write(name, rank, offset, events, close=True):
        meta = {"name": "rumor_clock", "ph": "M", "pid": rank, "args": {"rank": rank, "offset_us": offset}}
        body = ",\n".join(json.dumps(e) for e in [meta] + events)
        p = tmp_path / name
        p.write_text("[\n" + body + ("\n]\n" if close else ""))
        return str(p)

    a = write("t.rank0.json", 0, 0.0, [{"name": "a", "ph": "X", "pid": 0, "tid": 1, "ts": 10.0, "dur": 1.0}])
    b = write("t.rank1.json", 1, 2.5, [{"name": "b", "ph": "X", "pid": 1, "tid": 1, "ts": 10.0, "dur": 1.0}],
              close=False)
    out = tl.merge(str(tmp_path / "t.rank*.json"), str(tmp_path / "m.json"))
    merged = {e["name"]: e for e in _events(out)}
    assert merged["a"]["ts"] == 10.0 and merged["b"]["ts"] == 7.5 and merged["b"]["pid"] == 1
    with pytest.raises(ValueError, match="both rank 0"):
        tl.merge([a, a], str(tmp_path / "x.json"))
    with pytest.raises(ValueError, match="no file matches"):
        tl.merge(str(tmp_path / "nothing*.json"), str(tmp_path / "x.json"))
    (tmp_path / "plain.json").write_text("[]")
    with pytest.raises(ValueError, match="rumor_clock"):
        tl.merge([str(tmp_path / "plain.json")], str(tmp_path / "x.json"))
    assert b


def test_bad_arguments_raise_clear_errors(tmp_path):
    import rumor.timeline as tl

    with pytest.raises(TypeError, match="name"):
        tl.range(3)
    with tl.range("not recording"):  # no timeline: nothing to do, no error, no init needed
        pass
    with pytest.raises(TypeError, match="path"):
        tl.start(42)
