"""Property tests of rumor.compression against exact references (numpy/torch, float64 math)."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rumor import compression as C
from rumor.errors import RumorError

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
FINITE_MAX = {torch.float32: 1e30, torch.float64: 1e30, torch.bfloat16: 1e30, torch.float16: 6e4}
EPS = 2.0**-23

settings.register_profile("rumor", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
# RUMOR_HYPOTHESIS_PROFILE=long for a deeper search than the quick default.
settings.register_profile("long", deadline=None, max_examples=1500, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("RUMOR_HYPOTHESIS_PROFILE", "rumor"))


@st.composite
def tensors(draw, min_size=0, max_size=3000):
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(min_size, max_size))
    kind = draw(st.sampled_from(["normal", "constant", "huge", "tiny", "sparse"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "constant":
        x = torch.full((n,), draw(st.floats(-1e4, 1e4, allow_nan=False)), dtype=torch.float64)
    elif kind == "huge":
        x = x.sign() * FINITE_MAX[dtype] * (0.5 + x.abs() / 8).clamp(max=1.0)
    elif kind == "tiny":
        x = x * draw(st.sampled_from([1e-30, 1e-38])) if dtype != torch.float16 else x * 1e-3
    elif kind == "sparse":
        x = x * (torch.rand(n, generator=g) < 0.1)
    return x.to(dtype)


def chunks(n, chunk):
    return [(c0, min(n, c0 + chunk)) for c0 in range(0, n, chunk)]


def seen(x):
    """The float32 values a codec reads (float64 is rounded to float32 first), in float64."""
    return x.to(torch.float32).to(torch.float64)


@given(tensors(), st.sampled_from([None, 8, 64]))
def test_minmax_bound_and_constants(x, chunk):
    c = C.MinMaxUInt8(chunk=chunk)
    buf = c.encode(x)
    assert buf.dtype == torch.uint8 and buf.numel() == c.encoded_bytes(x.numel())
    d = c.decode(buf, x.shape).to(torch.float64)
    v = seen(x)
    for a, b in chunks(x.numel(), chunk or 1024):
        lo, hi = v[a:b].min().item(), v[a:b].max().item()
        err = (d[a:b] - v[a:b]).abs().max().item()
        if lo == hi:
            assert err == 0.0
        else:
            assert err <= (hi - lo) / 510 + 4 * EPS * max(abs(lo), abs(hi), hi - lo)


@given(tensors(), st.sampled_from([2, 16, 127, 128, 256]), st.sampled_from([None, 24]), st.integers(0, 2**64 - 1))
def test_qsgd_bound_and_reproducible(x, levels, chunk, seed):
    c = C.QSGD(levels=levels, chunk=chunk)
    buf = c.encode(x, seed=seed)
    assert torch.equal(buf, c.encode(x, seed=seed))
    d = c.decode(buf, x.shape).to(torch.float64)
    v = seen(x)
    for a, b in chunks(x.numel(), chunk or 1024):
        norm = v[a:b].norm().item()
        # The stored norm's float32 sum of squares is within 40 ulp (norm within 20), and a
        # subnormal step rounds by up to 2^-150 per level.
        bound = norm / levels * (1 + 10 * EPS) + 4 * EPS * norm + levels * 2.0**-149
        assert (d[a:b] - v[a:b]).abs().max().item() <= bound


def test_qsgd_unbiased():
    # Mean of N decodes: within (norm/s) * sqrt(ln(2n/delta) / (2N)) of x for all n elements
    # (Hoeffding; each decode is one of the two levels around x, spaced norm/s apart).
    n, s, N = 256, 4, 1000
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    c = C.QSGD(levels=s, chunk=256)
    mean = sum(c.decode(c.encode(x, seed=k), n).double() for k in range(N)) / N
    bound = x.double().norm().item() / s * math.sqrt(math.log(2 * n / 1e-6) / (2 * N))
    assert (mean - x.double()).abs().max().item() <= bound + 1e-5


@given(tensors(), st.sampled_from([None, 8, 40]))
def test_sign_scale(x, chunk):
    c = C.SignScale(chunk=chunk)
    buf = c.encode(x)
    assert buf.numel() == 32 + 4 * len(chunks(x.numel(), chunk or 1024)) + (x.numel() + 7) // 8
    d = c.decode(buf, x.shape).to(torch.float64)
    v = seen(x)
    for a, b in chunks(x.numel(), chunk or 1024):
        scale = v[a:b].abs().mean().item()
        # mean |x| rounded once to float32 (half an ulp; 2^-150 where subnormal), with margin for
        # the reference sum's own rounding.
        assert (d[a:b].abs() - scale).abs().max().item() <= EPS * scale + 2.0**-149
        want_neg = (v[a:b] < 0) & (scale > 0)
        assert torch.equal(d[a:b] < 0, want_neg)
    # Error feedback: what the caller keeps is exactly the residual.
    e = x.double() - d
    assert torch.allclose(e + d, x.double())


@given(tensors())
def test_casts_match_torch_bitwise(x):
    for codec, dt in ((C.Float16(), torch.float16), (C.BFloat16(), torch.bfloat16)):
        d = codec.decode(codec.encode(x), x.shape, dtype=dt)
        assert torch.equal(d.view(torch.int16), x.to(dt).view(torch.int16))


def test_casts_special_values():
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 65520.0, 1e-8, 3.4e38, -1e-45])
    for codec, dt in ((C.Float16(), torch.float16), (C.BFloat16(), torch.bfloat16)):
        d = codec.decode(codec.encode(x), x.shape, dtype=dt)
        ref = x.to(dt)
        assert torch.isnan(d[2])
        keep = torch.ones(len(x), dtype=torch.bool)
        keep[2] = False
        assert torch.equal(d[keep].view(torch.int16), ref[keep].view(torch.int16))


@given(tensors(max_size=500), st.sampled_from(DTYPES))
def test_decode_out_and_accumulate(x, out_dtype):
    for c in (C.MinMaxUInt8(), C.QSGD(), C.SignScale(), C.Float16(), C.BFloat16()):
        buf = c.encode(x, seed=5)
        ref = c.decode(buf, x.shape)  # float32
        base = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(out_dtype)
        out = base.clone()
        got = c.decode(buf, x.shape, dtype=out_dtype, out=out, accumulate=True)
        assert got is out
        if out_dtype == torch.float64:
            want = base + ref.double()
        else:
            want = (base.float() + ref).to(out_dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(c.decode(buf, x.shape, dtype=out_dtype), ref.to(out_dtype))


@given(st.sampled_from(["minmax", "qsgd", "qsgd256", "sign", "f16", "bf16"]), st.integers(0, 2000), st.data())
def test_corruption_rejected_or_harmless(name, n, data):
    c = {
        "minmax": C.MinMaxUInt8(),
        "qsgd": C.QSGD(),
        "qsgd256": C.QSGD(levels=256),
        "sign": C.SignScale(),
        "f16": C.Float16(),
        "bf16": C.BFloat16(),
    }[name]
    buf = c.encode(torch.randn(n))
    cut = data.draw(st.integers(0, buf.numel() - 1))
    with pytest.raises(ValueError, match=r"decode"):
        c.decode(buf[:cut].clone(), n)
    with pytest.raises(ValueError, match="elements"):
        c.decode(buf, n + 1)
    # Any header byte flipped is detected: every header field is checked against the codec.
    pos = data.draw(st.integers(0, 31))
    bad = buf.clone()
    bad[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(RumorError, match=c.name.split("(")[0]):
        c.decode(bad, n)


def test_other_codec_and_parameters_rejected():
    x = torch.randn(100)
    with pytest.raises(ValueError, match="chunk"):
        C.MinMaxUInt8(chunk=64).decode(C.MinMaxUInt8().encode(x), 100)
    with pytest.raises(ValueError, match="levels"):
        C.QSGD(levels=8).decode(C.QSGD(levels=16).encode(x), 100)
    with pytest.raises(ValueError, match="kind"):
        C.SignScale().decode(C.QSGD().encode(x), 100)
    with pytest.raises(ValueError, match="levels"):
        C.QSGD(levels=1)
    with pytest.raises(ValueError, match="levels"):
        C.QSGD(levels=257)
    with pytest.raises(ValueError, match="multiple of 8"):
        C.SignScale(chunk=12)


def test_bad_tensors():
    c = C.MinMaxUInt8()
    with pytest.raises(TypeError, match="dtype"):
        c.encode(torch.arange(10))
    with pytest.raises(TypeError, match="Tensor"):
        c.encode([1.0, 2.0])
    with pytest.raises(ValueError, match="contiguous"):
        c.encode(torch.randn(4, 4).t())
    with pytest.raises(ValueError, match="shape"):
        c.decode(c.encode(torch.randn(4)), (2, 3), out=torch.empty(4))
    with pytest.raises(TypeError, match="out.dtype"):
        c.decode(c.encode(torch.randn(4)), 4, dtype=torch.float64, out=torch.empty(4))
    with pytest.raises(TypeError, match="uint8"):
        c.decode(torch.zeros(40, dtype=torch.int32), 4)
    if torch.cuda.is_available() and not C.cuda_available():  # CUDA codecs: test_cuda_codecs.py
        with pytest.raises(ValueError, match="CUDA"):
            c.encode(torch.randn(4, device="cuda"))


def test_meta_device_rejected():
    with pytest.raises(ValueError, match="expected a CPU tensor"):
        C.QSGD().encode(torch.empty(4, device="meta"))


def test_shapes_and_bytes_input():
    x = torch.randn(3, 5, 7, dtype=torch.float64)
    c = C.Float16()
    b = c.encode(x)
    d = c.decode(bytes(b.numpy()), x.shape, dtype=torch.float64)
    assert d.shape == x.shape and torch.equal(d, x.to(torch.float16).to(torch.float64))
    assert C.MinMaxUInt8().encode(torch.tensor(2.5)).numel() == C.MinMaxUInt8().encoded_bytes(1)
    y = torch.randn(6)
    m = C.MinMaxUInt8()
    assert m.decode(m.encode(y), np.int64(6)).shape == (6,)
    assert m.decode(m.encode(y), [2, np.int32(3)]).shape == (2, 3)
    with pytest.raises(ValueError, match="shape"):
        m.decode(m.encode(y), (2, -3))
    with pytest.raises(ValueError, match="shape"):
        m.decode(m.encode(y), 6.0)


def test_generic_isa_gives_identical_bytes():
    # The scalar kernels (forced by RUMOR_CODEC_ISA=generic in a fresh process) and the default
    # ones must produce the same encodings.
    script = (
        "import sys, torch, hashlib; from rumor import compression as C; "
        "x = torch.randn(10007, generator=torch.Generator().manual_seed(3)); h = hashlib.sha256(); "
        "[h.update(c.encode(x.to(dt), seed=9).numpy().tobytes()) for c in "
        "(C.MinMaxUInt8(), C.QSGD(), C.QSGD(levels=200, chunk=40), C.SignScale(), C.Float16(), C.BFloat16()) "
        "for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64)]; "
        "print(C.isa(), h.hexdigest())"
    )
    outs = {}
    for isa in ("generic", "auto"):
        env = dict(os.environ, RUMOR_CODEC_ISA=isa)
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        outs[isa] = r.stdout.split()
    assert outs["generic"][0] == "generic"
    assert outs["generic"][1] == outs["auto"][1]


def test_encode_into_out():
    x = torch.randn(1000)
    c = C.QSGD(levels=64)
    out = torch.empty(c.encoded_bytes(1000), dtype=torch.uint8)
    assert c.encode(x, seed=4, out=out) is out
    assert torch.equal(out, c.encode(x, seed=4))
    with pytest.raises(ValueError, match="bytes"):
        c.encode(x, out=torch.empty(out.numel() - 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        c.encode(x, out=torch.empty(out.numel(), dtype=torch.int8))


def test_float64_input_rounds_through_float32_like_torch():
    # Values that float32 rounding puts exactly on a float16/bfloat16 tie: torch (and the
    # codecs) round float64 to float32 first, so these round down to even, not up.
    x = torch.tensor([1 + 2**-11 + 2**-40, 1 + 2**-8 + 2**-40, -(1 + 2**-11 + 2**-40)], dtype=torch.float64)
    for codec, dt in ((C.Float16(), torch.float16), (C.BFloat16(), torch.bfloat16)):
        d = codec.decode(codec.encode(x), x.shape, dtype=dt)
        assert torch.equal(d.view(torch.int16), x.to(dt).view(torch.int16))
        assert torch.equal(d.view(torch.int16), x.float().to(dt).view(torch.int16))


def test_minmax_extreme_range():
    x = torch.tensor([3.0e38, -3.0e38, 1.0, -2.5e38] * 300)
    c = C.MinMaxUInt8()
    d = c.decode(c.encode(x), x.shape).double()
    for a, b in chunks(x.numel(), 1024):
        v = x[a:b].double()
        rng = v.max().item() - v.min().item()
        assert (d[a:b] - v).abs().max().item() <= rng / 510 + 4 * EPS * rng
