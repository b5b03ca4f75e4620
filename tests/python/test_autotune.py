"""DistributedDataParallel(autotune=...): agreement, correctness, cache, budget, bad arguments.

Each scenario trains the same float64 model twice in the same processes, without and with
autotuning, and compares: the tuned run must end with the untuned run's weights (allclose at
float64 tolerance: rebuilt buckets change only the summation order), every rank must report the
same settings applied at the same training forward, the search must stay inside its budget and
must really rebuild the buckets. A third wrapper then finds the result in the cache and tunes
nothing. No timings are asserted (scores are whatever the machine measured).
"""
from __future__ import annotations

import json
import os
import tempfile

import pytest

import harness

TOL64 = dict(rtol=1e-9, atol=1e-12)
# Small candidates, so that even the test model spans a different number of buckets per trial.
SPACE = {"bucket_cap_mb": [0.01, 0.05, 0.2, 1.0], "first_bucket_mb": [0.002, 0.01, 0.05],
         "bucket_split_gap_ms": [0.01, 1.0, float("inf")]}
TUNE = dict(budget_steps=10, warm_steps=1, measure_steps=1, seed=3, space=SPACE, verbose=False)


def _train_pair(cache_path, steps, mode=None):
    import torch

    import rumor
    from rumor import autotune
    from rumor.engine import device as device_engine
    from rumor.testing import models

    torch.set_num_threads(1)
    rumor.init()
    rank = rumor.rank()
    # mode: the engine of CUDA parameters, emulated on CPU ones (rumor.engine.device.EMULATE)
    device_engine.EMULATE = mode

    def run(tune):
        model = models.build("mlp25m", seed=1, scale=1 / 64, dtype=torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ddp = rumor.DistributedDataParallel(model, optimizer=opt, bucket_cap_mb=0.05, first_bucket_mb=0.01,
                                            autotune=tune)
        buckets, applied = [], []
        for step in range(steps):
            x, y = models.batch(model, 4, step=step, shard=rank)
            opt.zero_grad()
            models.loss(ddp(x), y).backward()
            opt.step()
            buckets.append(len(ddp.buckets))
            # what the wrapper really ran this step with
            applied.append(dict(bucket_cap_mb=ddp._cap_bytes, first_bucket_mb=ddp._first_cap_bytes,
                                bucket_split_gap_ms=ddp._split_gap_s, hierarchical=ddp.algorithm.hierarchical,
                                shared_buckets=ddp._shared_setting is not False and ddp._shared_buckets(),
                                small_allreduce_kb=ddp.algorithm.small_allreduce_kb,
                                arena=ddp.buckets[0].arena is not None))
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return (params, buckets, autotune.status(ddp), (ddp._cap_bytes, ddp._first_cap_bytes, ddp._split_gap_s),
                applied)

    ref, ref_buckets, none_status, _, _ = run(False)
    tuned, buckets, st, attrs, applied = run(dict(TUNE, cache=cache_path))
    again, _, st2, attrs2, _ = run(dict(TUNE, cache=cache_path))
    return dict(rank=rank, ref=ref, tuned=tuned, again=again, buckets=buckets, ref_buckets=ref_buckets,
                none_status=none_status, status=st, status2=st2, attrs=attrs, attrs2=attrs2, applied=applied)


def _check(results, knobs):
    import torch

    n_trials = TUNE["budget_steps"] // (TUNE["warm_steps"] + TUNE["measure_steps"])
    r0 = results[0]
    assert r0["none_status"] is None
    for r in results:
        # same results as the untuned run (float64, only the summation order differs)
        torch.testing.assert_close(r["tuned"], r["ref"], **TOL64)
        torch.testing.assert_close(r["again"], r["ref"], **TOL64)
        # every rank applied the same settings at the same forward, and decided the same
        assert r["status"]["history"] == r0["status"]["history"], f"rank {r['rank']} disagrees"
        assert r["status"]["best"]["setting"] == r0["status"]["best"]["setting"]
        assert r["buckets"] == r0["buckets"]
        torch.testing.assert_close(r["tuned"], r0["tuned"], rtol=0, atol=0)
    st = r0["status"]
    assert st["done"] and sorted(st["knobs"]) == sorted(knobs)
    hist = st["history"]
    kinds = [h["kind"] for h in hist]
    search = n_trials - 2  # the budget holds 5 trials: 3 search, then 2 confirm if one led
    gain = st["config"]["min_gain"]
    scores = [h["score_s"] for h in hist[:-1]]
    assert all(s > 0 for s in scores)
    best = min(range(search), key=lambda i: scores[i])
    if scores[best] > scores[0] * (1 - gain):
        best = 0
    if best == 0:
        assert kinds == ["trial"] * search + ["final"]
    else:
        # the leader and the defaults measured again, back to back; the leader stays only if
        # it leads there by min_gain too
        assert kinds == ["trial"] * search + ["confirm"] * 2 + ["final"]
        assert hist[search]["setting"] == hist[best]["setting"] and hist[search + 1]["setting"] == st["default"]
        if scores[search] > scores[search + 1] * (1 - gain):
            best = 0
    assert hist[0]["setting"] == st["default"]  # the first trial is the wrapper's own setting
    # budget: the search starts at the second training forward and is over within budget_steps
    first, final = hist[0]["step"], hist[-1]["step"]
    assert first == 2 and final - first <= TUNE["budget_steps"]
    assert [h["step"] for h in hist[:-1]] == [first + i * 2 for i in range(len(hist) - 1)]
    # what stays in place is the verdict
    assert hist[-1]["setting"] == hist[best]["setting"] == st["best"]["setting"]
    cap, first_cap, gap = r0["attrs"]
    s = st["best"]["setting"]
    assert (cap, first_cap) == (int(s["bucket_cap_mb"] * 1024 * 1024), int(s["first_bucket_mb"] * 1024 * 1024))
    assert gap == s["bucket_split_gap_ms"] / 1e3
    # search trials differed (a setting already measured is never searched again) ...
    keys = [json.dumps(h["setting"], sort_keys=True) for h in hist[:search]]
    assert len(set(keys)) == len(keys)
    # ... and each one really ran: the step that began at forward f (1-based) ran the setting of
    # the last history entry applied at or before f
    mb = 1024 * 1024
    for r in results:
        for f, a in enumerate(r["applied"], start=1):
            s = [h for h in hist if h["step"] <= f][-1]["setting"] if f >= first else st["default"]
            assert a["bucket_cap_mb"] == int(s["bucket_cap_mb"] * mb), (f, a, s)
            assert a["first_bucket_mb"] == int(s["first_bucket_mb"] * mb), (f, a, s)
            assert a["bucket_split_gap_ms"] == s["bucket_split_gap_ms"] / 1e3, (f, a, s)
            for k in ("hierarchical", "small_allreduce_kb"):
                if k in s:
                    assert a[k] == s[k], (f, k, a, s)
            if "shared_buckets" in s:
                assert a["arena"] == a["shared_buckets"] == s["shared_buckets"], (f, a, s)
    # the second wrapper found the result in the cache: no trials, the same setting at once
    st2 = r0["status2"]
    assert [h["kind"] for h in st2["history"]] == ["cached"]
    assert st2["history"][0]["setting"] == s and st2["done"]
    assert r0["attrs2"] == r0["attrs"]
    for r in results:
        assert r["status2"]["history"] == st2["history"]


def _check_cache(path, knobs, world_size, hosts):
    with open(path) as f:
        data = json.load(f)
    assert data["version"] == 1 and len(data["entries"]) == 1
    (key, entry), = data["entries"].items()
    assert f"world={world_size},hosts={hosts}" in key and "algorithm=GradientAllReduce" in key
    (streams, rec), = entry["by_streams"].items()
    assert streams == "2" and sorted(rec["setting"]) == sorted(knobs) and rec["trials"] in (3, 5)


def test_autotune_one_host_two_ranks():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "sub", "autotune.json")
        res = harness.run(_train_pair, 2, timeout=120, args=(path, 14))
        knobs = ["bucket_cap_mb", "first_bucket_mb", "bucket_split_gap_ms", "shared_buckets", "small_allreduce_kb"]
        _check(res, knobs)
        _check_cache(path, knobs, 2, 1)


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_autotune_on_the_device_engine(mode):
    """CUDA parameters' engine (emulated on CPU): only the bucket layout is searched, with the
    same agreement, correctness, budget and cache as above."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "autotune.json")
        res = harness.run(_train_pair, 2, timeout=120, args=(path, 14, mode))
        knobs = ["bucket_cap_mb", "first_bucket_mb", "bucket_split_gap_ms"]
        _check(res, knobs)
        _check_cache(path, knobs, 2, 1)
        with open(path) as f:
            assert all(k.endswith(f"|engine=device-{mode}") for k in json.load(f)["entries"])


def test_autotune_two_hosts_hierarchical_knob():
    """2 hosts x 2 ranks (RUMOR_HOST_ID): hierarchical on/off is searched too."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "autotune.json")
        rank_env = [{"RUMOR_HOST_ID": h} for h in ("hA", "hA", "hB", "hB")]
        res = harness.run(_train_pair, 4, timeout=150, args=(path, 14), rank_env=rank_env)
        knobs = ["bucket_cap_mb", "first_bucket_mb", "bucket_split_gap_ms", "hierarchical", "small_allreduce_kb"]
        _check(res, knobs)
        _check_cache(path, knobs, 4, 2)


def _bad_args():
    import warnings

    import torch

    import rumor
    from rumor import autotune
    from rumor.algorithms import Decentralized, GradientAllReduce

    rumor.init()
    model = torch.nn.Linear(4, 4)
    errors = {}
    cases = {
        "str": dict(autotune="yes"),
        "unknown option": dict(autotune={"budget": 10}),
        "small budget": dict(autotune={"budget_steps": 5}),
        "zero measure": dict(autotune={"measure_steps": 0}),
        "negative warm": dict(autotune={"warm_steps": -1}),
        "float budget": dict(autotune={"budget_steps": 50.0}),
        "bad knob": dict(autotune={"space": {"streams": [1, 2]}}),
        "bad value": dict(autotune={"space": {"bucket_cap_mb": [0]}}),
        "bad bool": dict(autotune={"space": {"hierarchical": [1]}}),
        "algorithm": dict(autotune=True, algorithm=Decentralized()),
        "gap": dict(bucket_split_gap_ms=0),
        "shared": dict(shared_buckets=1),
        "gain too big": dict(autotune={"min_gain": 1.0}),
        "confirm str": dict(autotune={"confirm": "yes"}),
        "gain negative": dict(autotune={"min_gain": -0.01}),
        "gain str": dict(autotune={"min_gain": "2%"}),
    }
    for name, kw in cases.items():
        try:
            rumor.DistributedDataParallel(model, **kw)
            errors[name] = None
        except Exception as e:  # noqa: BLE001
            errors[name] = (type(e).__name__, str(e))
    try:
        GradientAllReduce(small_allreduce_kb=-1)
        errors["threshold"] = None
    except ValueError as e:
        errors["threshold"] = ("ValueError", str(e))
    # From the environment (rumor-run --autotune) an algorithm it cannot tune is a warning, not an error.
    os.environ["RUMOR_AUTOTUNE"] = "1"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ddp = rumor.DistributedDataParallel(torch.nn.Linear(4, 4), algorithm=Decentralized())
    env_warned = [str(x.message) for x in w]
    env_status = autotune.status(ddp)
    os.environ["RUMOR_AUTOTUNE_BUDGET"] = "3"
    try:
        rumor.DistributedDataParallel(torch.nn.Linear(4, 4))
        errors["env budget"] = None
    except ValueError as e:
        errors["env budget"] = ("ValueError", str(e))
    return errors, env_warned, env_status


def test_best_setting_must_lead_the_defaults_by_min_gain():
    """Trial 0 is the defaults: another trial replaces them only if it scored min_gain lower."""
    from types import SimpleNamespace

    from rumor.autotune import AutotuneConfig, Autotuner

    def pick(scores, **kw):
        return Autotuner._best_trial(SimpleNamespace(_scores=scores, cfg=AutotuneConfig(**kw)))

    assert pick([1.00, 0.99, 1.20]) == 0      # 1% faster: noise, the defaults stay
    assert pick([1.00, 0.99, 0.97]) == 2      # 3% faster: taken
    assert pick([1.00, 0.98]) == 1            # exactly min_gain
    assert pick([1.00, 0.99], min_gain=0.0) == 1
    assert pick([0.90, 0.95, 1.00]) == 0      # the defaults were best anyway
    assert pick([1.00, 0.97], min_gain=0.05) == 0


def test_confirmation_keeps_a_setting_only_if_it_still_leads():
    """With confirm, trials 0..s-1 search and s, s+1 re-measure the leader and the defaults."""
    from types import SimpleNamespace

    from rumor.autotune import AutotuneConfig, Autotuner

    cfg = AutotuneConfig(budget_steps=30, warm_steps=1, measure_steps=2)  # 10 trials: 8 search
    assert cfg.search_trials == 8
    assert AutotuneConfig(budget_steps=30, warm_steps=1, measure_steps=2, confirm=False).search_trials == 10
    assert AutotuneConfig(budget_steps=9, warm_steps=1, measure_steps=2).search_trials == 3  # < 4 trials

    def verdict(scores, **kw):
        return Autotuner._verdict(SimpleNamespace(_scores=scores, cfg=AutotuneConfig(
            budget_steps=30, warm_steps=1, measure_steps=2, **kw)))

    search = [1.00, 1.01, 0.90, 1.02, 0.99, 1.00, 0.98, 1.00]
    assert verdict(search + [0.91, 0.95]) == (2, 0.91, 0.95)    # led again: kept, the pair reported
    assert verdict(search + [0.96, 0.97]) == (0, 0.97, 0.97)    # 1% lead back to back: the defaults
    assert verdict(search + [1.05, 0.97])[0] == 0               # lucky once
    assert verdict([1.00] * 8) == (0, 1.00, 1.00)               # nobody led: no confirmation ran


def test_a_trial_over_a_far_link_rebuilds_with_the_link_schedule():
    """Where the first rebuild let the link's schedule pick the buckets (a round trip longer than
    the split gap, a tunable algorithm), the autotuner's rebuilds do as well: cut at its own
    split gap, then merged by merge_for_link; a gap longer than the round trip keeps the old rule."""
    import types
    from types import SimpleNamespace

    from rumor.autotune import Autotuner
    from rumor.parallel import DistributedDataParallel

    calls = []
    d = SimpleNamespace(_split_gap_s=0.005, _bucket_latency_s=0.3, algorithm=SimpleNamespace(tunable_buckets=True),
                        _link_figures=([0.0, 0.001, 0.4, 0.41], 8e6, 0.3),
                        _build_buckets=lambda order, breaks=frozenset(), link=None: calls.append((breaks, link)))
    d._bucket_rule = types.MethodType(DistributedDataParallel._bucket_rule, d)
    tuner = SimpleNamespace(ddp=d)
    setting = {"bucket_cap_mb": 25.0, "first_bucket_mb": 1.0, "bucket_split_gap_ms": 5.0}
    gaps = [0.0, 0.001, 0.399, 0.01]
    Autotuner._apply(tuner, setting, [3, 2, 1, 0], gaps)
    assert calls[-1] == ({2, 3}, d._link_figures)  # cut at every pause over 5 ms, link merges
    Autotuner._apply(tuner, dict(setting, bucket_split_gap_ms=float("inf")), [3, 2, 1, 0], gaps)
    assert calls[-1] == (set(), None)  # never split: the round trip is not above the gap
    d.algorithm.tunable_buckets = False
    Autotuner._apply(tuner, setting, [3, 2, 1, 0], gaps)
    assert calls[-1] == ({2}, None)  # not tunable: only pauses longer than the round trip


BAD_ARGUMENTS = {  # case: (exception type, a word its message must hold or None)
    "str": ("TypeError", None), "unknown option": ("TypeError", None), "small budget": ("ValueError", "budget_steps"),
    "zero measure": ("ValueError", None), "negative warm": ("ValueError", None), "float budget": ("TypeError", None),
    "bad knob": ("ValueError", None), "bad value": ("ValueError", None), "bad bool": ("TypeError", None),
    "algorithm": ("ValueError", "Decentralized"), "gap": ("ValueError", "bucket_split_gap_ms"),
    "shared": ("TypeError", None), "threshold": ("ValueError", "small_allreduce_kb"),
    "env budget": ("ValueError", None),
    "gain too big": ("ValueError", "min_gain"), "gain negative": ("ValueError", "min_gain"),
    "gain str": ("TypeError", "min_gain"), "confirm str": ("TypeError", "confirm")}


def _bad_args_once(batches):
    """_bad_args's result: one launch for every test of this file that needs it (every case in it)."""
    return harness.batch(batches, "bad args", lambda: harness.run(_bad_args, 1, timeout=60)[0])


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS), ids=[k.replace(" ", "_") for k in BAD_ARGUMENTS])
def test_autotune_bad_arguments(name, batches):
    errors, _, _ = _bad_args_once(batches)
    kind, word = BAD_ARGUMENTS[name]
    assert errors[name] is not None, f"{name}: no exception"
    assert errors[name][0] == kind, (name, errors[name])
    if word is not None:
        assert word in errors[name][1], (name, errors[name])


def test_autotune_from_the_environment_only_warns_for_an_untunable_algorithm(batches):
    _, warned, env_status = _bad_args_once(batches)
    assert env_status is None and any("RUMOR_AUTOTUNE ignored" in m for m in warned)


def test_rumor_run_autotune_flag(monkeypatch):
    from rumor import run

    args = run._parser().parse_args(["--nproc-per-node", "2", "--autotune", "--autotune-budget", "20", "train.py"])
    run._validate(args)
    assert args.rumor_autotune and args.rumor_autotune_budget == "20"
    bad = run._parser().parse_args(["--autotune-budget", "x", "train.py"])
    with pytest.raises(SystemExit, match="--autotune-budget"):
        run._validate(bad)
    # main() turns the flags into the variables DistributedDataParallel reads in every worker.
    seen = {}
    monkeypatch.setattr("torch.distributed.run.run", lambda a: seen.update(
        auto=os.environ.get("RUMOR_AUTOTUNE"), budget=os.environ.get("RUMOR_AUTOTUNE_BUDGET")))
    monkeypatch.setattr("rumor._shm.sweep", lambda: None)
    monkeypatch.delenv("RUMOR_AUTOTUNE", raising=False)
    monkeypatch.delenv("RUMOR_AUTOTUNE_BUDGET", raising=False)
    try:
        run.main(["--nproc-per-node", "1", "--autotune", "--autotune-budget", "20", "train.py"])
    finally:
        os.environ.pop("RUMOR_AUTOTUNE", None)
        os.environ.pop("RUMOR_AUTOTUNE_BUDGET", None)
    assert seen == {"auto": "1", "budget": "20"}
