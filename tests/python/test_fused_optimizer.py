"""rumor.optim.fuse_optimizer and the C++ optimizer kernels, against torch.optim itself.

Tolerances: the torch path of a fused optimizer (Adagrad, RMSprop, NAdam ...) runs torch's own
update over flat views, elementwise the same arithmetic: parameters are asserted bit-equal. The C++ kernels follow torch's operation order; after 30 steps we
assert the same 1e-6 relative bound, for Adam also under amsgrad, maximize and weight decay.
"""
import copy

import pytest
import torch

import rumor
from rumor import _C
from rumor.optim import fuse_optimizer
from rumor.optim.fused import FusionError

RTOL = 1e-6


def assert_close(a, b, rtol=RTOL):
    a, b = a.detach().double(), b.detach().double()
    err = ((a - b).abs() / b.abs().clamp(min=1.0)).max().item() if a.numel() else 0.0
    assert err <= rtol, f"max relative difference {err:.3g} > {rtol}"


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 13, generator=g), torch.randn(16, 3, generator=g)) for _ in range(n)]


def train(model, opt, data, scaler=None, autocast=False, sched=None):
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if sched is not None:
            sched.step()


def groups_of(model, kind):
    if kind == "one":
        return model.parameters()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    other = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": decay}, {"params": other, "lr": 0.003, "weight_decay": 0.0}]


OPTIMIZERS = [
    ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.05)),
    ("sgd-momentum-wd", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2, dampening=0.1)),
    ("sgd-nesterov", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    ("sgd-maximize", lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.5, maximize=True)),
    ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2)),
    ("adam-l2-amsgrad", lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2, amsgrad=True)),
    ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99))),
    ("adam-maximize", lambda ps: torch.optim.Adam(ps, lr=1e-3, maximize=True)),
    ("adagrad", lambda ps: torch.optim.Adagrad(ps, lr=0.05, weight_decay=1e-3)),
    ("rmsprop", lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, centered=True)),
    ("nadam", lambda ps: torch.optim.NAdam(ps, lr=1e-3)),
]


@pytest.mark.parametrize("groups", ["one", "two"])
@pytest.mark.parametrize("name,make", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_fused_training_equals_unfused(name, make, groups):
    plain_model, fused_model = make_model(), make_model()
    plain = make(groups_of(plain_model, groups))
    fused = fuse_optimizer(make(groups_of(fused_model, groups)))
    data = batches(20)
    train(plain_model, plain, data)
    train(fused_model, fused, data)
    kernel = fused._rumor_fusion._kernel is not None
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        if kernel:
            assert_close(a, b)
        else:  # torch's own update over flat views: the same arithmetic, bit for bit
            assert torch.equal(a, b)
    # Same state keys, shapes and values as the unfused optimizer's.
    sd_f, sd_p = fused.state_dict(), plain.state_dict()
    assert sd_f["param_groups"] == sd_p["param_groups"]
    assert sd_f["state"].keys() == sd_p["state"].keys()
    for i in sd_p["state"]:
        assert sd_f["state"][i].keys() == sd_p["state"][i].keys()
        for k, v in sd_p["state"][i].items():
            if isinstance(v, torch.Tensor):
                assert sd_f["state"][i][k].shape == v.shape, (i, k)
                assert_close(sd_f["state"][i][k], v, rtol=1e-5)
            else:
                assert sd_f["state"][i][k] == v


def test_parameters_and_grads_are_views_of_flat_buffers():
    model = make_model()
    opt = fuse_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    fusion = opt._rumor_fusion
    assert len(fusion.segments) == 1
    seg = fusion.segments[0]
    base, gbase = seg.flat.data_ptr(), seg.grad.data_ptr()
    for p, off in zip(seg.params, seg.offsets):
        assert p.data_ptr() == base + 4 * off
        assert p.grad.data_ptr() == gbase + 4 * off
    train(model, opt, batches(2))
    for p, off in zip(seg.params, seg.offsets):
        assert p.grad.data_ptr() == gbase + 4 * off  # zero_grad keeps the buffers


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_cpp_kernels_match_torch(kind):
    torch.manual_seed(3)
    n = 10007
    p0 = torch.randn(n)
    grads = [torch.randn(n) * 0.1 for _ in range(30)]
    if kind == "sgd":
        cfg = dict(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=1e-2, nesterov=False, maximize=False)
        ref = torch.nn.Parameter(p0.clone())
        opt = torch.optim.SGD([ref], foreach=False, **cfg)
        p, buf = p0.clone(), torch.empty(n)
        for i, g in enumerate(grads):
            ref.grad = g.clone()
            opt.step()
            _C.sgd_step(p.data_ptr(), g.data_ptr(), buf.data_ptr(), n, first=i == 0, **cfg)
        assert_close(buf, opt.state[ref]["momentum_buffer"])
    else:
        cfg = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, amsgrad=True, maximize=kind == "adam")
        ref = torch.nn.Parameter(p0.clone())
        opt = (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)([ref], foreach=False, **cfg)
        p, m, v, vmax = p0.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n)
        for i, g in enumerate(grads):
            ref.grad = g.clone()
            opt.step()
            _C.adam_step(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), vmax.data_ptr(), n, lr=cfg["lr"],
                         beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, decoupled_weight_decay=kind == "adamw",
                         amsgrad=True, maximize=cfg["maximize"], step=i + 1)
        assert_close(m, opt.state[ref]["exp_avg"])
        assert_close(v, opt.state[ref]["exp_avg_sq"])
    assert_close(p, ref)


def test_kernel_arguments_are_checked():
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="betas"):
        _C.adam_step(t.data_ptr(), t.data_ptr(), t.data_ptr(), t.data_ptr(), 0, 4, lr=1e-3, beta1=1.0, beta2=0.9,
                     eps=1e-8, weight_decay=0, decoupled_weight_decay=False, amsgrad=False, maximize=False, step=1)
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        _C.adam_step(t.data_ptr(), t.data_ptr(), t.data_ptr(), t.data_ptr(), 0, 4, lr=1e-3, beta1=0.9, beta2=0.9,
                     eps=1e-8, weight_decay=0, decoupled_weight_decay=False, amsgrad=True, maximize=False, step=1)
    with pytest.raises(ValueError, match="kernel set"):
        _C.sgd_step(t.data_ptr(), t.data_ptr(), 0, 4, lr=0.1, momentum=0, dampening=0, weight_decay=0,
                    nesterov=False, maximize=False, first=True, isa="sse9")


@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3),
                                  lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                                  lambda ps: torch.optim.RMSprop(ps, lr=1e-3)], ids=["adam", "sgd", "rmsprop"])
def test_state_dict_round_trips_both_ways(make):
    data = batches(16)
    # fused for 8 steps -> plain continues; plain for 8 steps -> fused continues; both equal a
    # plain run of 16 steps.
    ref_model = make_model()
    ref = make(groups_of(ref_model, "two"))
    train(ref_model, ref, data)

    m1 = make_model()
    f1 = fuse_optimizer(make(groups_of(m1, "two")))
    train(m1, f1, data[:8])
    sd = copy.deepcopy(f1.state_dict())
    steps = [v["step"] for v in sd["state"].values() if "step" in v]
    assert len({id(s) for s in steps}) == len(steps)  # one step tensor per parameter
    assert all(isinstance(s, torch.Tensor) for s in steps)
    m2 = make_model()
    m2.load_state_dict(m1.state_dict())
    p2 = make(groups_of(m2, "two"))
    p2.load_state_dict(f1.state_dict())
    train(m2, p2, data[8:])
    for a, b in zip(m2.parameters(), ref_model.parameters()):
        assert_close(a, b)

    m3 = make_model()
    p3 = make(groups_of(m3, "two"))
    train(m3, p3, data[:8])
    m4 = make_model()
    f4 = fuse_optimizer(make(groups_of(m4, "two")))
    m4.load_state_dict(m3.state_dict())  # copies into the flat buffers (views stay)
    f4.load_state_dict(p3.state_dict())
    train(m4, f4, data[8:])
    for a, b in zip(m4.parameters(), ref_model.parameters()):
        assert_close(a, b)
    # The loaded state was copied into the fused buffers, not aliased with p3's tensors.
    seg_state = f4._rumor_fusion.flat_state[f4._rumor_fusion.segments[0].flat]
    for st in p3.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim():
                assert all(v.data_ptr() != s.data_ptr() for s in seg_state.values() if isinstance(s, torch.Tensor))


def test_grad_scaler_and_autocast():
    data = batches(10)
    ref_model, fused_model = make_model(), make_model()
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    fused = fuse_optimizer(torch.optim.Adam(fused_model.parameters(), lr=1e-2))
    s1 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    s2 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    train(ref_model, ref, data, scaler=s1, autocast=True)
    train(fused_model, fused, data, scaler=s2, autocast=True)
    for a, b in zip(fused_model.parameters(), ref_model.parameters()):
        assert_close(a, b)
    assert s1.get_scale() == s2.get_scale()


def test_grad_scaler_skips_step_on_inf():
    model = make_model()
    opt = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    loss = model(torch.randn(4, 13)).sum() * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a.detach(), b)
    assert scaler.get_scale() < 2.0 ** 8


def test_lr_scheduler_is_honoured():
    data = batches(12)
    m1, m2 = make_model(), make_model()
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)
    s1 = torch.optim.lr_scheduler.StepLR(o1, step_size=3, gamma=0.5)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=3, gamma=0.5)  # created before fusing
    fuse_optimizer(o2)
    train(m1, o1, data, sched=s1)
    train(m2, o2, data, sched=s2)
    for a, b in zip(m2.parameters(), m1.parameters()):
        assert_close(a, b)
    assert o2.param_groups[0]["lr"] == o1.param_groups[0]["lr"]


def test_frozen_parameters_stay_out():
    m1, m2 = make_model(), make_model()
    for m in (m1, m2):
        m[0].weight.requires_grad_(False)
    o1 = torch.optim.Adam(m1.parameters(), lr=1e-2)
    o2 = fuse_optimizer(torch.optim.Adam(m2.parameters(), lr=1e-2))
    data = batches(5)
    train(m1, o1, data)
    train(m2, o2, data)
    for a, b in zip(m2.parameters(), m1.parameters()):
        assert_close(a, b)
    assert m2[0].weight not in o2.state


class _MyAdam(torch.optim.Adam):
    pass


@pytest.mark.parametrize("make,match", [
    (lambda ps: torch.optim.LBFGS(ps), "line search"),
    (lambda ps: torch.optim.Adafactor(ps), "factored"),
    (lambda ps: torch.optim.SparseAdam(ps), "sparse"),
    (lambda ps: _MyAdam(ps), "only optimizers known"),
    (lambda ps: torch.optim.Adam(ps, differentiable=True), "differentiable"),
], ids=["lbfgs", "adafactor", "sparseadam", "subclass", "differentiable"])
def test_refused(make, match):
    opt = make(make_model().parameters())
    with pytest.raises(FusionError, match=match):
        fuse_optimizer(opt)
    assert not hasattr(opt, "_rumor_fusion")


def test_refuses_bad_input_and_double_fusion():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        fuse_optimizer(object())
    opt = fuse_optimizer(torch.optim.SGD(make_model().parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already fused"):
        fuse_optimizer(opt)


def test_replaced_parameter_data_is_detected():
    model = make_model()
    opt = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model[0].weight.data = torch.zeros_like(model[0].weight)
    model(torch.randn(2, 13)).sum().backward()
    with pytest.raises(RuntimeError, match="data was replaced"):
        opt.step()


def test_kernel_isa_reported():
    assert _C.optim_isa() in ("avx2", "generic")
