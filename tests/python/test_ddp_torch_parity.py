"""rumor.DistributedDataParallel against torch.nn.parallel.DistributedDataParallel where they
should agree (docs/torch_ddp.md), and the RUMOR_* environment checks (docs/environment.md).

The two-rank tests run torch DDP (gloo) and rumor's wrapper side by side in the same processes
(as test_ddp.py does) and compare bitwise: checkpoints move between the two wrappers in both
directions, torch DDP's constructor arguments mean what they mean in torch or are refused with
a message that says what to do. The environment parsers are pure functions, tested here
directly; init() with a bad variable runs in a spawned process.
"""
from __future__ import annotations

import logging

import pytest

import harness
import test_ddp as T


# ==== inside a rank ===============================================================================

def _torch_ddp(module, **kw):
    import torch

    return torch.nn.parallel.DistributedDataParallel(module, **kw)


def _save_load(sd, path):
    import torch

    torch.save(sd, path)
    return torch.load(path, weights_only=True)


def sc_checkpoints(chk, tmp):
    """torch DDP -> rumor and rumor -> torch DDP through torch.save/torch.load, bit for bit, and
    the module's own state dict (model.module.state_dict()) in and out of rumor's wrapper."""
    import os

    import torch

    import rumor

    world, rank = T._ctx()
    path = os.path.join(tmp, f"ckpt{rank}.pt")
    tm = T._build("cnn", 70)
    tddp = _torch_ddp(tm)
    topt = T._sgd(tddp.parameters())
    for s in range(2):  # trained, so the buffers (BatchNorm statistics) are not their initial values
        topt.zero_grad()
        x, y = T._batch(tm, s, rank)
        T._loss(tddp(x), y).backward()
        topt.step()
    torch_sd = tddp.state_dict()

    rm = T._build("cnn", 71)  # other initial values, so that a load that does nothing is seen
    rddp = rumor.DistributedDataParallel(rm, **T.SMALL_BUCKETS)
    chk.check(list(rddp.state_dict()) == list(torch_sd),
              f"state_dict keys: rumor {list(rddp.state_dict())[:3]}..., torch DDP {list(torch_sd)[:3]}...")
    res = rddp.load_state_dict(_save_load(torch_sd, path))
    chk.check(not res.missing_keys and not res.unexpected_keys, f"torch DDP checkpoint into rumor: {res}")
    T._compare(chk, dict(rddp.state_dict()), dict(torch_sd), "torch DDP checkpoint loaded into rumor", exact=True)

    # Training goes on from the loaded values: both wrappers take the same step.
    ropt = T._sgd(rddp.parameters())
    for opt, ddp, m in ((topt, tddp, tm), (ropt, rddp, rm)):
        opt.zero_grad()
        x, y = T._batch(m, 5, rank)
        T._loss(ddp(x), y).backward()
        opt.step()
    T._compare(chk, T._params(rm), T._params(tm), "one step after the load, rumor vs torch DDP")
    T._same_on_all_ranks(chk, T._params(rm), "one step after the load: parameters")

    # rumor -> torch DDP
    fresh = _torch_ddp(T._build("cnn", 72))
    res = fresh.load_state_dict(_save_load(rddp.state_dict(), path))
    chk.check(not res.missing_keys and not res.unexpected_keys, f"rumor checkpoint into torch DDP: {res}")
    T._compare(chk, dict(fresh.state_dict()), dict(rddp.state_dict()), "rumor checkpoint loaded into torch DDP",
               exact=True)

    # The module's own keys: out through .module, in through the wrapper (torch DDP would refuse
    # them) and through a plain module.
    own = _save_load(rddp.module.state_dict(), path)
    chk.check(not any(k.startswith("module.") for k in own), f"module.state_dict() keys: {list(own)[:3]}")
    other = rumor.DistributedDataParallel(T._build("cnn", 73), **T.SMALL_BUCKETS)
    res = other.load_state_dict(own)
    chk.check(not res.missing_keys and not res.unexpected_keys, f"module's own keys into rumor: {res}")
    T._compare(chk, dict(other.module.state_dict()), dict(own), "module.state_dict() loaded into rumor's wrapper",
               exact=True)
    plain = T._build("cnn", 74)
    plain.load_state_dict(own)
    T._compare(chk, dict(plain.state_dict()), dict(own), "module.state_dict() into a plain module", exact=True)

    # strict still means strict: a key of neither form is reported, not dropped.
    bad = dict(rddp.state_dict())
    bad["module.extra"] = torch.zeros(1)
    chk.raises(RuntimeError, lambda: rddp.load_state_dict(bad), "an unexpected key", match="module.extra")
    res = rddp.load_state_dict(bad, strict=False)
    chk.check(res.unexpected_keys == ["module.extra"] and not res.missing_keys, f"strict=False: {res}")


def sc_nested_module_name(chk):
    """A module whose own child is called "module": its keys already start with "module.", and
    both forms still load to the right place (as torch DDP's keys, "module.module.")."""
    import torch

    import rumor

    class Outer(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.module = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.module(x)

    want = _torch_ddp(Outer(1)).state_dict()
    rddp = rumor.DistributedDataParallel(Outer(2))
    chk.check(list(rddp.state_dict()) == list(want), f"nested keys: {list(rddp.state_dict())} vs {list(want)}")
    rddp.load_state_dict(want)
    T._compare(chk, dict(rddp.state_dict()), dict(want), "nested: torch DDP's keys", exact=True)
    inner = Outer(3).state_dict()  # keys "module.weight", "module.bias"
    rddp.load_state_dict(inner)
    T._compare(chk, dict(rddp.module.state_dict()), dict(inner), "nested: the module's own keys", exact=True)


def sc_arguments(chk):
    """device_ids, output_device, process_group, gradient_as_bucket_view and static_graph."""
    import torch
    import torch.distributed as dist

    import rumor

    world, rank = T._ctx()
    DDP = rumor.DistributedDataParallel
    lin = torch.nn.Linear(4, 3)

    # device_ids / output_device: CPU modules take None (an empty list too), as in torch.
    for kw in ({"device_ids": None}, {"device_ids": []}, {"device_ids": None, "output_device": None}):
        d = DDP(torch.nn.Linear(4, 3), **kw)
        chk.check(d.device_ids is None and d.output_device is None, f"{kw}: device_ids {d.device_ids}")
    chk.raises(ValueError, lambda: DDP(lin, device_ids=[0]), "device_ids=[0] for a CPU module",
               match="device_ids=[0] says the module is on cuda:0, but its parameters and buffers are on cpu")
    chk.raises(ValueError, lambda: DDP(lin, device_ids=["cpu"]), "device_ids=['cpu']",
               match="for a CPU module pass device_ids=None")
    chk.raises(ValueError, lambda: DDP(lin, device_ids=[0, 1]), "two devices per process",
               match="one process drives one device")
    chk.raises(TypeError, lambda: DDP(lin, device_ids=0), "device_ids=0 (not a list)", match="list of one device")
    chk.raises(ValueError, lambda: DDP(lin, output_device=0), "output_device without device_ids",
               match="output_device=0 needs device_ids")
    # torch's positional order (module, device_ids): said so, not a confusing optimizer error.
    chk.raises(TypeError, lambda: DDP(lin, [0]), "device_ids passed positionally",
               match="keyword arguments here (device_ids=[d])")

    # process_group: a rumor group is the group; torch's are refused with what to do.
    sub = rumor.new_group(list(range(world)))
    d = DDP(torch.nn.Linear(4, 3), process_group=sub)
    chk.check(d.group is sub, "process_group=rumor group: used as the group")
    chk.raises(TypeError, lambda: DDP(lin, process_group=dist.group.WORLD), "a torch ProcessGroup",
               match="cannot use a torch.distributed process group. For the whole job pass nothing; for a "
                     "subset pass group=rumor.new_group(ranks)")
    other = rumor.new_group(list(range(world)))
    chk.raises(ValueError, lambda: DDP(lin, group=sub, process_group=other),
               "group= and process_group= differ", match="pass one of them")
    for name in ("gradient_as_bucket_view", "static_graph"):
        chk.raises(TypeError, lambda: DDP(lin, **{name: 1}), f"{name}=1", match=f"{name} must be True or False")

    # gradient_as_bucket_view=True: every gradient is a view into its bucket, as torch promises.
    for flag in (True, False):
        m = T._build("mlp25m", 90)
        tm = T._build("mlp25m", 90)
        d = DDP(m, gradient_as_bucket_view=flag, **T.SMALL_BUCKETS)
        td = _torch_ddp(tm, gradient_as_bucket_view=flag)
        x, y = T._batch(m, 0, rank)
        T._loss(d(x), y).backward()
        T._loss(td(x), y).backward()
        chk.check(d.gradient_as_bucket_view is flag, f"gradient_as_bucket_view={flag}: attribute")
        T._check_bucket_views(chk, d, f"gradient_as_bucket_view={flag}")
        T._compare(chk, T._grads(m), T._grads(tm), f"gradient_as_bucket_view={flag}: gradients vs torch DDP")

    # static_graph=True: a parameter unused in every iteration needs no find_unused_parameters.
    class Partly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(5)
            self.used = torch.nn.Linear(4, 3).double()
            self.unused = torch.nn.Linear(4, 3).double()

        def forward(self, x):
            return self.used(x)

    m, tm = Partly(), Partly()
    d, td = DDP(m, static_graph=True), _torch_ddp(tm, static_graph=True)
    chk.check(d.static_graph is True, "static_graph attribute")
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(5, 4, generator=g, dtype=torch.float64)
        for mm in (m, tm):
            mm.zero_grad()
        d(x).square().sum().backward()
        td(x).square().sum().backward()
        T._compare(chk, T._grads(m), T._grads(tm), f"static_graph step {step}: gradients vs torch DDP")


def sc_attributes(chk):
    """Attributes are not forwarded to the module (torch DDP's behaviour); the error points at
    .module, or, for torch DDP's own methods, at what to do instead."""
    import torch

    import rumor

    m = torch.nn.Linear(4, 3)
    m.tag = "x"
    d = rumor.DistributedDataParallel(m)
    chk.raises(AttributeError, lambda: d.weight, "the module's parameter", match="use .module.weight")
    chk.raises(AttributeError, lambda: d.tag, "the module's attribute", match="use .module.tag")
    chk.raises(AttributeError, lambda: d.join, "torch DDP's join", match="same number of batches")
    chk.raises(AttributeError, lambda: d.register_comm_hook, "torch DDP's register_comm_hook",
               match="rumor.algorithms.Algorithm")
    e = chk.raises(AttributeError, lambda: d.nothing_here, "a missing attribute")
    chk.check(str(e) == "'DistributedDataParallel' object has no attribute 'nothing_here'", f"missing: {e}")
    chk.check(d.module.weight is m.weight and not hasattr(d, "weight"), "d.module.weight")


def parity_rank(tmp):
    T._init()
    chk = harness.Checker()
    for sc in (lambda: sc_checkpoints(chk, tmp), lambda: sc_nested_module_name(chk), lambda: sc_arguments(chk),
               lambda: sc_attributes(chk)):
        sc()
    T._finish()
    return chk.failures, chk.count


def test_torch_ddp_parity_two_ranks(tmp_path):
    res = harness.run(parity_rank, 2, timeout=150, args=(str(tmp_path),))
    assert harness.assert_no_failures(res, "torch DDP parity") > 30


# ---- rumor.init() outside a launcher -------------------------------------------------------------

def _init_alone():
    """In a spawned process, without the launcher's variables: two init()s, one INFO line."""
    import os

    import rumor

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.name, record.levelno, record.getMessage()))

    log = logging.getLogger("rumor")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    for _ in range(2):
        rumor.init()
        size = rumor.size()
        rumor.shutdown()
    return size, records


def test_init_without_a_launcher_says_so_once():
    (r,) = harness.run(_init_alone, 1, timeout=60)
    size, records = r
    assert size == 1
    assert len(records) == 1, records
    name, level, msg = records[0]
    assert (name, level) == ("rumor", logging.INFO)
    assert "runs as one process" in msg and "python -m rumor.run --nproc-per-node" in msg and "torchrun" in msg


def test_single_process_message_is_logged_at_info_once(caplog, monkeypatch):
    from rumor import _rendezvous, _runtime

    monkeypatch.setattr(_runtime, "_said_single", False)
    alone = _rendezvous.Env(0, 1, "127.0.0.1", 29500, "single process")
    launched = _rendezvous.Env(0, 2, "127.0.0.1", 29500, "torchrun")
    with caplog.at_level(logging.INFO, logger="rumor"):
        _runtime._say_single_process(launched)
        _runtime._say_single_process(alone)
        _runtime._say_single_process(alone)
    got = [(r.name, r.levelno) for r in caplog.records]
    assert got == [("rumor", logging.INFO)]
    assert "one process" in caplog.records[0].getMessage()


# ---- RUMOR_* variables ---------------------------------------------------------------------------

def test_env_parsers_accept_and_refuse():
    from rumor import _env

    env = {"B": "Yes", "I": " 7 ", "F": "2.5", "C": "Stream", "E": ""}
    assert _env.env_bool("B", False, env) is True and _env.env_bool("E", True, env) is True
    assert _env.env_bool("missing", False, env) is False
    assert _env.env_int("I", 1, minimum=0, env=env) == 7 and _env.env_int("E", 3, env=env) == 3
    assert _env.env_float("F", 1.0, positive=True, env=env) == 2.5
    assert _env.env_choice("C", ("host", "stream"), "host", env) == "stream"
    cases = [
        (lambda: _env.env_bool("RUMOR_SHM", True, {"RUMOR_SHM": "maybe"}), r"RUMOR_SHM='maybe'.*1, true, yes, on"),
        (lambda: _env.env_int("RUMOR_SPIN_US", 20, minimum=0, env={"RUMOR_SPIN_US": "-1"}),
         r"RUMOR_SPIN_US='-1'.*an integer >= 0"),
        (lambda: _env.env_int("RUMOR_SOCKET_STREAMS", 2, 1, 16, {"RUMOR_SOCKET_STREAMS": "2.5"}),
         r"RUMOR_SOCKET_STREAMS='2.5'.*an integer from 1 to 16"),
        (lambda: _env.env_float("RUMOR_TIMEOUT", 300.0, positive=True, env={"RUMOR_TIMEOUT": "0"}),
         r"RUMOR_TIMEOUT='0'.*a finite number > 0"),
        (lambda: _env.env_float("RUMOR_TIMEOUT", 300.0, positive=True, env={"RUMOR_TIMEOUT": "inf"}),
         r"RUMOR_TIMEOUT='inf'"),
        (lambda: _env.check_core_env({"RUMOR_LOG": "verbose"}), r"RUMOR_LOG='verbose'.*error, warn, info, debug"),
        # The C++ core compares these byte for byte: "INFO" would silently mean "warn" there.
        (lambda: _env.check_core_env({"RUMOR_LOG": "INFO"}), r"RUMOR_LOG='INFO'"),
        (lambda: _env.check_core_env({"RUMOR_POWERSGD_ISA": "sse"}), r"RUMOR_POWERSGD_ISA='sse'.*auto, avx2, generic"),
        (lambda: _env.check_core_env({"RUMOR_NET_PLUGIN_CHUNK_KB": "2"}),
         r"RUMOR_NET_PLUGIN_CHUNK_KB='2'.*an integer from 4 to 16384"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()
    _env.check_core_env({"RUMOR_LOG": "debug", "RUMOR_CODEC_ISA": "generic", "RUMOR_OPTIM_ISA": ""})


def test_env_bool_users_refuse_a_bad_value():
    from rumor import netplugin

    assert netplugin.enabled_by_env({"RUMOR_NCCL_NET_PLUGIN": "on"}) is True
    assert netplugin.enabled_by_env({}) is False
    with pytest.raises(ValueError, match="RUMOR_NCCL_NET_PLUGIN='2'"):
        netplugin.enabled_by_env({"RUMOR_NCCL_NET_PLUGIN": "2"})


def _init_with_env():
    import rumor

    try:
        rumor.init()
    except ValueError as e:
        return str(e)
    rumor.shutdown()
    return None


@pytest.mark.parametrize("var, value, match", [
    ("RUMOR_LOG", "verbose", "RUMOR_LOG='verbose'"),
    ("RUMOR_TIMEOUT", "soon", "RUMOR_TIMEOUT='soon'"),
    ("RUMOR_SOCKET_STREAMS", "17", "RUMOR_SOCKET_STREAMS='17'"),
    ("RUMOR_SHM", "sometimes", "RUMOR_SHM='sometimes'"),
    ("RUMOR_SHM_RING_BYTES", "1MB", "RUMOR_SHM_RING_BYTES='1MB'"),
    ("RUMOR_SPIN_US", "x", "RUMOR_SPIN_US='x'"),
    ("RUMOR_TWO_RANK_PATH", "fast", "RUMOR_TWO_RANK_PATH='fast'"),
    ("RUMOR_STRIPE_MIN_BYTES", "-4", "RUMOR_STRIPE_MIN_BYTES='-4'"),
    ("RUMOR_FLIGHT_RECORDER", "many", "RUMOR_FLIGHT_RECORDER='many'"),
    ("RUMOR_ADAPTIVE_DEADLINE", "maybe", "RUMOR_ADAPTIVE_DEADLINE='maybe'"),
    ("RUMOR_DEADLINE_FLOOR", "0", "RUMOR_DEADLINE_FLOOR='0'"),
    ("WORLD_SIZE", "two", "WORLD_SIZE='two'"),
])
def test_init_refuses_a_bad_variable_by_name(var, value, match):
    (r,) = harness.run(_init_with_env, 1, timeout=60, env={var: value})
    assert r is not None and match in r and "expected" in r, r
