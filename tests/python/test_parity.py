"""rumor.elastic.verify(): state parity across ranks.

Every multi-rank check is made against an independent reference: each rank's raw state bytes
gathered over a torch.distributed gloo group (FileStore rendezvous) and compared with
torch.equal on uint8 views, not against verify() itself.

* equal replicas (2, 3, 4 ranks; a NaN held by every rank included) give an equal report;
* one rank's parameter one ulp off, a flipped NaN payload, -0.0 against 0.0, a bf16 buffer one
  ulp off, Adam's exp_avg one ulp off, and two ranks off on two tensors at once: the report names
  exactly the tensors and ranks the reference finds; repair=True makes every rank's bytes equal
  to the majority's and a second verify equal;
* 2 ranks that differ: no majority, a ParityError naming the ranks and the tensor, nothing
  changed; source=0 repairs it;
* a replica of another shape: reported as a layout mismatch, ParityError with repair, nothing
  changed;
* Decentralized: the replicas' differing parameters are not reported, a differing step count is;
* State.restore() ends with a verify (on by default, State(verify=False) skips it).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import harness
from test_elastic import _train_steps

TIMEOUT = 120


# ---- the reference: gloo, raw bytes ----------------------------------------------------------------

def _gloo(store_path):
    import torch.distributed as dist

    import rumor

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rumor.rank(),
                                world_size=rumor.size())
    return dist


def _raw(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


def _state_bytes(model, opt):
    out = {f"param:{n}": _raw(p) for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": _raw(b) for n, b in model.named_buffers()})
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"optimizer:state[{names[id(p)]}].{k}"] = _raw(v)
    return out


def _reference(store_path, model, opt):
    """{name: sorted ranks whose bytes differ from the majority's} over every rank, and the
    gathered bytes, by gloo."""
    dist = _gloo(store_path)
    n = dist.get_world_size()
    every = [None] * n
    dist.all_gather_object(every, _state_bytes(model, opt))
    diff = {}
    for name in every[0]:
        held = [every[r][name] for r in range(n)]
        groups = []
        for r, b in enumerate(held):
            for g in groups:
                if torch.equal(held[g[0]], b):
                    g.append(r)
                    break
            else:
                groups.append([r])
        if len(groups) > 1:
            best = max(groups, key=len)
            diff[name] = sorted(r for r in range(n) if r not in best) if 2 * len(best) > n else list(range(n))
    return diff, every


class _Net(torch.nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, hidden)
        self.fc2 = torch.nn.Linear(hidden, 1)
        self.register_buffer("flags", torch.zeros(4))
        self.register_buffer("fp16", torch.linspace(-1, 1, 8).half())
        self.register_buffer("brain", torch.linspace(-1, 1, 8).bfloat16())

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _trained_ddp(algorithm=None, steps=2, hidden=16):
    import rumor
    from rumor.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = _Net(hidden)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ddp = DistributedDataParallel(model, optimizer=opt, algorithm=algorithm)
    _train_steps(ddp, opt, torch.Generator().manual_seed(100 + rumor.rank()), steps)  # rank-different data
    return model, opt, ddp


def _ulp(t, index):
    with torch.no_grad():
        flat = t.view(-1)
        flat[index] = torch.nextafter(flat[index], torch.tensor(math.inf, dtype=t.dtype))


def _perturb(case, model, opt, r, n):
    """Changes this rank's state as the case says; returns {name: ranks} expected to differ."""
    last = n - 1
    if case == "ulp":
        if r == last:
            _ulp(model.fc1.weight.data, 3)
        return {"param:fc1.weight": [last]}
    if case == "nan_payload":
        if r == last:
            model.flags.view(torch.int32)[1] ^= 1  # another quiet NaN
        return {"buffer:flags": [last]}
    if case == "negative_zero":
        if r == last:
            model.flags[0] = -0.0
        return {"buffer:flags": [last]}
    if case == "bf16":
        if r == last:
            model.brain.view(torch.int16)[2] += 1
        return {"buffer:brain": [last]}
    if case == "exp_avg":
        if r == last:
            _ulp(opt.state[model.fc2.weight]["exp_avg"], 0)
        return {"optimizer:state[fc2.weight].exp_avg": [last]}
    if case == "two_ranks":
        if r == 1:
            _ulp(model.fc1.bias.data, 0)
        if r == 2:
            model.fp16.view(torch.int16)[5] += 1
        return {"param:fc1.bias": [1], "buffer:fp16": [2]}
    raise AssertionError(case)


CASES = ["ulp", "nan_payload", "negative_zero", "bf16", "exp_avg", "two_ranks"]


def found_and_repaired(store_path):
    import rumor

    rumor.init()
    r, n = rumor.rank(), rumor.size()
    model, opt, ddp = _trained_ddp()
    with torch.no_grad():
        model.flags[1] = float("nan")  # the same NaN everywhere: equal bytes, an equal report
    first = rumor.elastic.verify(ddp, opt, repair=False)
    ref0, _ = _reference(store_path, model, opt)
    out = {"equal": (bool(first), first.mismatches, ref0, first.entries, first.replicas)}
    for case in CASES:
        if case == "two_ranks" and n < 3:
            continue
        before, every_before = _reference(store_path, model, opt)
        assert not before, before
        want = _perturb(case, model, opt, r, n)
        ref, _ = _reference(store_path, model, opt)
        rep = rumor.elastic.verify(ddp, opt, repair=False)
        found = {m.name: list(m.ranks) for m in rep.mismatches}
        kinds = {m.kind for m in rep.mismatches}
        fixed = rumor.elastic.verify(ddp, opt)  # repair=True
        after, every_after = _reference(store_path, model, opt)
        # Every rank now holds, byte for byte, what the majority held before the perturbation.
        same_as_before = all(torch.equal(every_after[r2][k], every_before[0][k])
                             for r2 in range(n) for k in every_before[0])
        again = rumor.elastic.verify(ddp, opt, repair=False)
        out[case] = dict(want=want, reference=ref, found=found, kinds=kinds, equal=bool(rep),
                         repaired=sorted(fixed.repaired), fixed_equal=bool(fixed), after=after,
                         same_as_before=same_as_before, again=bool(again))
    return out


@pytest.mark.parametrize("n", [3, 4])
def test_verify_finds_exactly_what_differs_and_repairs_it(tmp_path, n):
    res = harness.run(found_and_repaired, n, timeout=TIMEOUT, args=(str(tmp_path / "gloo"),))
    for r, out in enumerate(res):
        eq, mism, ref0, entries, replicas = out["equal"]
        assert eq and not mism and not ref0 and replicas == "identical", (r, out["equal"])
        assert entries >= 5 + 6, entries  # 4 parameters, 3 buffers, Adam's state, hyperparameters
        for case in CASES:
            c = out[case]
            assert c["reference"] == c["want"], (case, c)
            assert c["found"] == c["want"], (case, c)
            assert c["kinds"] == {"value"} and not c["equal"], (case, c)
            assert c["repaired"] == sorted(c["want"]), (case, c)
            assert c["fixed_equal"] and c["again"] and not c["after"] and c["same_as_before"], (case, c)


def two_ranks_no_majority(store_path):
    import rumor

    rumor.init()
    r = rumor.rank()
    model, opt, ddp = _trained_ddp()
    out = {"equal": bool(rumor.elastic.verify(ddp, opt, repair=False))}
    if r == 1:
        _ulp(model.fc2.bias.data, 0)
    ref, every_before = _reference(store_path, model, opt)
    rep = rumor.elastic.verify(ddp, opt, repair=False)
    out["report"] = [(m.name, list(m.ranks), list(m.reference)) for m in rep.mismatches]
    try:
        rumor.elastic.verify(ddp, opt)
        out["error"] = None
    except rumor.elastic.ParityError as e:
        out["error"] = str(e)
    unchanged, every_mid = _reference(store_path, model, opt)
    out["unchanged"] = unchanged == ref and all(
        torch.equal(every_mid[i][k], every_before[i][k]) for i in range(2) for k in every_before[0])
    fixed = rumor.elastic.verify(ddp, opt, source=0)
    after, every_after = _reference(store_path, model, opt)
    out["fixed"] = (sorted(fixed.repaired), bool(fixed), after,
                    all(torch.equal(every_after[1][k], every_before[0][k]) for k in every_before[0]))
    out["reference"] = ref
    return out


def test_two_ranks_that_differ_have_no_majority(tmp_path):
    res = harness.run(two_ranks_no_majority, 2, timeout=TIMEOUT, args=(str(tmp_path / "gloo"),))
    for out in res:
        assert out["equal"], out
        assert out["reference"] == {"param:fc2.bias": [0, 1]}, out
        assert out["report"] == [("param:fc2.bias", [0, 1], [])], out
        err = out["error"]
        assert err and "no majority" in err and "param:fc2.bias" in err and "[0, 1]" in err and "source=" in err, err
        assert out["unchanged"], out
        assert out["fixed"] == (["param:fc2.bias"], True, {}, True), out


def other_shape(store_path):
    import rumor

    rumor.init()
    r = rumor.rank()
    torch.manual_seed(0)
    model = _Net(hidden=12 if r == 2 else 16)  # rank 2 built another model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rep = rumor.elastic.verify(model, repair=False)
    out = {"report": sorted((m.name, m.kind, list(m.ranks), list(m.reference), m.repairable, m.detail)
                            for m in rep.mismatches), "equal": bool(rep)}
    try:
        rumor.elastic.verify(model)
        out["error"] = None
    except rumor.elastic.ParityError as e:
        out["error"] = str(e)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return out


def test_replica_of_another_shape_is_an_error_never_repaired(tmp_path):
    res = harness.run(other_shape, 3, timeout=TIMEOUT, args=(str(tmp_path / "gloo"),))
    for out in res:
        assert not out["equal"], out
        names = [m[0] for m in out["report"]]
        assert names == ["param:fc1.bias", "param:fc1.weight", "param:fc2.weight"], out
        for name, kind, ranks, ref, repairable, detail in out["report"]:
            assert kind == "layout" and ranks == [2] and ref == [0, 1] and not repairable, out
            assert "on rank [2]" in detail and "on ranks [0, 1]" in detail, detail
        assert "float32[12, 6] on rank [2]" in out["report"][1][5], out
        err = out["error"]
        assert err and "different models" in err and "nothing was repaired" in err and "param:fc1.weight" in err, err
        assert out["unchanged"], out


def decentralized_counts(store_path):
    import rumor

    rumor.init()
    r = rumor.rank()
    algo = rumor.algorithms.Decentralized("shift_one", hierarchical=False)
    model, opt, ddp = _trained_ddp(algorithm=algo, steps=3)
    ref, _ = _reference(store_path, model, opt)
    rep = rumor.elastic.verify(ddp, opt, repair=False)
    out = {"reference": ref, "replicas": rep.replicas, "equal": bool(rep), "mismatches": rep.mismatches}
    if r == 1:
        algo.step += 1  # this rank is a step ahead of the others
    rep = rumor.elastic.verify(ddp, opt, repair=False)
    out["step"] = [(m.name, m.kind, list(m.ranks), m.repairable) for m in rep.mismatches]
    try:
        rumor.elastic.verify(ddp, opt)
        out["error"] = None
    except rumor.elastic.ParityError as e:
        out["error"] = str(e)
    if r == 1:
        algo.step -= 1
    if r == 2:
        opt.state[model.fc1.weight]["step"] += 1  # Adam's count of steps, out of step on rank 2
    rep = rumor.elastic.verify(ddp, opt, repair=False)
    out["adam_step"] = [(m.name, list(m.ranks)) for m in rep.mismatches]
    return out


def test_decentralized_values_differ_legitimately_step_counts_do_not(tmp_path):
    res = harness.run(decentralized_counts, 3, timeout=TIMEOUT, args=(str(tmp_path / "gloo"),))
    for out in res:
        # The reference sees the replicas' parameters and momenta differ; verify does not report them.
        assert "param:fc1.weight" in out["reference"] and "optimizer:state[fc1.weight].exp_avg" in out["reference"], out
        assert out["replicas"] == "differ" and out["equal"] and not out["mismatches"], out
        assert out["step"] == [("algorithm:step", "value", [1], False)], out
        assert out["error"] and "algorithm:step" in out["error"] and "[1]" in out["error"], out
        assert out["adam_step"] == [("optimizer:state[fc1.weight].step", [2])], out


# ---- hashing, one process --------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]


def _digest(t):
    from rumor import _parity

    return _parity._Hasher().tensor(t, "t")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_digest_is_of_the_logical_bytes(dtype):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(5, 7, generator=g) * 50).to(dtype) if dtype != torch.bool else torch.rand(5, 7, generator=g) > 0.5
    d = _digest(base)
    assert d == _digest(base.clone()) and len(d) == 16
    # The same values under another layout: a transposed copy seen through its transpose.
    strided = base.t().contiguous().t()
    assert not strided.is_contiguous() and torch.equal(strided, base)
    assert _digest(strided) == d
    # A slice hashes as its values, not as the storage behind it.
    assert _digest(base[1:3, ::2]) == _digest(base[1:3, ::2].contiguous())
    # One byte changed anywhere changes the digest.
    changed = base.clone()
    raw = changed.view(-1).view(torch.uint8)
    raw[raw.numel() // 2] ^= 1
    assert _digest(changed) != d


def test_digest_tells_signed_zeros_and_nan_payloads_apart():
    z = torch.zeros(3)
    nz = z.clone()
    nz[1] = -0.0
    assert torch.equal(z, nz) and _digest(z) != _digest(nz)
    a = torch.full((3,), float("nan"))
    b = a.clone()
    b.view(torch.int32)[0] ^= 1
    assert torch.isnan(b).all() and _digest(a) == _digest(a.clone()) and _digest(a) != _digest(b)
    c = torch.randn(4, dtype=torch.complex64)
    assert _digest(c.conj()) == _digest(c.conj().resolve_conj())
    assert _digest(-c) == _digest((-c).clone()) and _digest(torch.empty(0)) != _digest(torch.zeros(1))
    assert len(_digest(torch.empty(3, device="meta"))) == 16  # layout only: nothing to read


def test_plain_values_are_hashed_exactly():
    from rumor import _parity

    def d(v):
        return _parity._Hasher().entry(_parity._Entry("v", v, True, False))

    assert d(0.0) != d(-0.0) and d(1) != d(True) and d(1) != d(1.0) and d("1") != d(1)
    assert d(float("nan")) == d(float("nan")) and d({1, 2}) == d({2, 1}) and d(b"x") != d("x")
    with pytest.raises(TypeError, match="verify compares tensors and plain values"):
        d(object())
    assert _parity.comparable({"a": [1, torch.ones(2)], "b": None}) and not _parity.comparable(object())
    # What an optimizer keeps that verify cannot hash is compared by its type, not refused.
    assert not _parity._leaf("optimizer:x", object(), True).compare and _parity._leaf("o", 1.5, True).compare


# ---- State.restore() ends with a verify ------------------------------------------------------------

def restore_verifies(verify_on, perturb):
    import warnings

    import rumor

    rumor.init()
    r = rumor.rank()
    model, opt, ddp = _trained_ddp()
    state = rumor.elastic.State(ddp, opt, epoch=3, seed=torch.arange(4))
    state.step = 2
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    model2, opt2, ddp2 = _trained_ddp(steps=1)  # other weights, the same shapes
    state2 = rumor.elastic.State(ddp2, opt2, verify=verify_on, epoch=0, seed=torch.zeros(4, dtype=torch.int64))
    if perturb and r == 2:
        apply = state2._apply

        def apply_then_lose_one(snap):  # a load that left one tensor of this rank behind
            apply(snap)
            _ulp(model2.fc1.weight.data, 0)

        state2._apply = apply_then_lose_one
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = state2.restore()
    rep = state2.verified
    out = {"step": step, "verified": None if rep is None else (rep.equal, [m.name for m in rep.mismatches],
                                                                  sorted(rep.repaired), rep.entries),
           "warned": [str(w.message) for w in caught if "repaired from the majority" in str(w.message)],
           "weights_committed": all(torch.equal(v, committed[k]) for k, v in model2.state_dict().items())}
    state2._finish()
    return out


@pytest.mark.parametrize("verify_on,perturb", [(True, False), (True, True), (False, False)],
                         ids=["verified", "repaired", "opted-out"])
def test_restore_proves_the_replicas_equal(verify_on, perturb):
    res = harness.run(restore_verifies, 3, timeout=TIMEOUT, args=(verify_on, perturb),
                      env={"RUMOR_ELASTIC_JOB": f"parity-{verify_on}-{perturb}-{os.getpid()}"})
    for r, out in enumerate(res):
        assert out["step"] == 2, out
        if not verify_on:
            assert out["verified"] is None and not out["warned"], out
            continue
        equal, names, repaired, entries = out["verified"]
        assert equal and entries > 10, out
        assert out["weights_committed"], out
        if perturb:
            assert names == ["param:fc1.weight"] and repaired == ["param:fc1.weight"], out
            assert len(out["warned"]) == 1, out
        else:
            assert names == [] and not out["warned"], out


# ---- no false alarms: every algorithm, after real training -----------------------------------------

def _algorithm(name, model):
    import rumor

    if name == "OneBitAdam":
        opt = rumor.optim.OneBitAdamOptimizer(model.parameters(), lr=0.01, freeze_step=2)
        return opt, rumor.algorithms.OneBitAdamAlgorithm(opt)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    algo = {"GradientAllReduce": lambda: rumor.algorithms.GradientAllReduce(),
            "ByteGrad": lambda: rumor.algorithms.ByteGrad(),
            "PowerSGD": lambda: rumor.algorithms.PowerSGD(start_powerSGD_iter=2),
            "LowPrecisionDecentralized": lambda: rumor.algorithms.LowPrecisionDecentralized(hierarchical=False),
            "AsyncModelAverage": lambda: rumor.algorithms.AsyncModelAverage(sync_interval_ms=1, warmup_steps=1),
            "LocalSGD": lambda: rumor.algorithms.LocalSGD(sync_every=3),
            "DiLoCo": lambda: rumor.algorithms.DiLoCo(inner_steps=3)}[name]()
    return opt, algo


ALGORITHMS = ["GradientAllReduce", "ByteGrad", "PowerSGD", "OneBitAdam", "LowPrecisionDecentralized",
              "AsyncModelAverage", "LocalSGD", "DiLoCo"]


def trained_with_each(store_path):
    """Every algorithm in turn, in one launch (a launch per algorithm cost more than the training)."""
    import rumor
    from rumor.parallel import DistributedDataParallel

    rumor.init()
    out = {}
    for name in ALGORITHMS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        opt, algo = _algorithm(name, model)
        ddp = DistributedDataParallel(model, optimizer=opt, algorithm=algo)
        _train_steps(ddp, opt, torch.Generator().manual_seed(100 + rumor.rank()), 4)
        if name == "AsyncModelAverage":
            algo.finish(timeout=60)  # the averaging thread no longer writes the weights
        ref, _ = _reference(store_path, model, opt)
        rep = rumor.elastic.verify(ddp, opt, repair=False)
        out[name] = dict(replicas=rep.replicas, mismatches=[str(m) for m in rep.mismatches], reference=sorted(ref),
                         names=rep.entries)
        ddp.remove_hooks()
    return out


def test_trained_replicas_verify_equal_under_every_algorithm(tmp_path):
    res = harness.run(trained_with_each, 3, timeout=TIMEOUT, args=(str(tmp_path / "gloo"),))
    for name in ALGORITHMS:
        differ = name in ("LowPrecisionDecentralized", "AsyncModelAverage", "LocalSGD", "DiLoCo")
        for rank_out in res:
            out = rank_out[name]
            assert out["replicas"] == ("differ" if differ else "identical"), (name, out)
            assert out["mismatches"] == [], (name, out)
            if differ:  # the reference sees what verify must not report (weights or momenta)
                assert out["reference"], (name, out)
            else:
                # 1-bit Adam's error feedback is each rank's own (parity_own_keys); nothing else differs.
                assert all(n.endswith(("worker_error", "server_error")) for n in out["reference"]), (name, out)


def extra_and_arguments(store_path):
    import rumor

    rumor.init()
    r = rumor.rank()
    model = _Net()  # a plain module: the whole world, every value compared
    ema = torch.arange(6, dtype=torch.float64).reshape(2, 3).t()  # strided, repaired through a copy
    if r == 0:
        ema[1, 0] = 7.5
    out = {}
    rep = rumor.elastic.verify(model, extra={"ema": ema, "seed": 11}, repair=False)
    out["found"] = [(m.name, list(m.ranks)) for m in rep.mismatches]
    rep = rumor.elastic.verify(model, extra={"ema": ema, "seed": 11})
    out["ema"] = (rep.repaired, rep.equal, ema.tolist())
    try:
        rumor.elastic.verify(model, extra={"seed": 11 + (r == 1)})
        out["plain"] = None
    except rumor.elastic.ParityError as e:
        out["plain"] = (str(e), [(m.name, list(m.ranks)) for m in e.report.mismatches])
    bad = []
    for kw in ({"replicas": "some"}, {"source": 5}, {"source": True}, {"extra": [1]}):
        try:
            rumor.elastic.verify(model, **kw)
        except (TypeError, ValueError) as e:
            bad.append(type(e).__name__)
    out["bad"] = bad
    try:
        rumor.elastic.verify(model, extra={"o": object()})
    except TypeError as e:
        out["object"] = str(e)
    # One rank alone with a bad argument: every rank raises at once (before, the others waited in
    # the first allgather until their deadline and raised CommTimeoutError).
    rumor.set_timeout(60)
    for mine, others in (({"extra": {"o": {object()}}}, {"extra": {"o": {1}}}), ({"replicas": "some"}, {})):
        try:
            rumor.elastic.verify(model, **(mine if r == 1 else others))
            out.setdefault("alone", []).append(None)
        except Exception as e:  # noqa: BLE001 - the type is what the test checks
            out.setdefault("alone", []).append((type(e).__name__, str(e)))
    out["after"] = rumor.elastic.verify(model, extra={"seed": 11}).equal  # the group goes on
    return out


def test_extra_tensors_are_repaired_plain_values_are_reported(tmp_path):
    res = harness.run(extra_and_arguments, 3, timeout=TIMEOUT, args=(str(tmp_path / "gloo"),))
    for out in res:
        assert out["found"] == [("extra:ema", [0])], out
        assert out["ema"] == (["extra:ema"], True, [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]), out
        msg, found = out["plain"]
        assert found == [("extra:seed", [1])] and "not tensors" in msg and "extra:seed" in msg, out
        assert out["bad"] == ["ValueError", "ValueError", "ValueError", "TypeError"], out
        assert "extra:o is a builtins.object" in out["object"], out
        (t1, m1), (t2, m2) = out["alone"]
        assert t1 == "TypeError" and "is a builtins.object" in m1, out
        assert t2 == "ValueError" and "replicas must be" in m2, out
        if "rank 1 could not take part" not in m1:  # rank 1 raises its own error, the others name it
            assert "could not take part" not in m1 and "could not take part" not in m2, out
        assert out["after"] is True, out
    assert sum("rank 1 could not take part" in out["alone"][0][1] for out in res) == 2, res
