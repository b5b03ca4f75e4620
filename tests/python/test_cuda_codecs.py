"""rumor.compression on CUDA tensors: the same bytes as on the CPU, decoding into every dtype,
torch's current stream, clear errors for mixed devices and corrupt buffers.

Skipped without a GPU or without the CUDA kernels in this build (tests/cpp/test_cuda_codecs.cpp
checks the kernels' arithmetic on the CPU there)."""
import os

import pytest
import torch

from rumor import compression as C
from rumor.errors import RumorError

GPU = torch.cuda.is_available() and C.cuda_available()
# scripts/gpu_check.sh sets RUMOR_EXPECT_GPU=1: there the tests run (and fail) instead of skipping.
EXPECT_GPU = os.environ.get("RUMOR_EXPECT_GPU") == "1"
needs_gpu = pytest.mark.skipif(not GPU and not EXPECT_GPU, reason="needs a CUDA device and rumor's CUDA kernels")


def test_cuda_available_never_raises():
    # Also where the build has no CUDA kernels, or no driver is installed (the CUDA runtime is
    # linked statically, so the extension loads and just sees no device).
    assert isinstance(C.cuda_available(), bool)
    if EXPECT_GPU:
        assert torch.cuda.is_available(), "RUMOR_EXPECT_GPU=1 but torch sees no CUDA device"
        assert C.cuda_available(), "RUMOR_EXPECT_GPU=1 but rumor has no CUDA kernels or sees no device"

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
CODECS = [
    C.MinMaxUInt8(),
    C.MinMaxUInt8(chunk=24),
    C.QSGD(levels=16),
    C.QSGD(levels=127, chunk=40),
    C.QSGD(levels=256, chunk=8),
    C.SignScale(),
    C.SignScale(chunk=8),
    C.Float16(),
    C.BFloat16(),
]
SIZES = [0, 1, 7, 33, 1000, 4133, (1 << 20) + 5]


def values(n: int, kind: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 3
    if kind == "constant":
        x = torch.full((n,), -1.75, dtype=torch.float64)
    elif kind == "tiny" and dtype != torch.float16:
        x = x * 1e-38
    elif kind == "sparse":
        x = x * (torch.rand(n, generator=g) < 0.1)
    return x.to(dtype)


@needs_gpu
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_matches_cpu_bytes(codec, dtype):
    for n in SIZES:
        for kind in ("normal", "constant", "tiny", "sparse"):
            if n > 5000 and kind != "normal":
                continue
            x = values(n, kind, dtype, seed=n)
            want = codec.encode(x, seed=n + 1)
            got = codec.encode(x.cuda(), seed=n + 1)
            assert got.device.type == "cuda" and got.dtype == torch.uint8
            assert torch.equal(got.cpu(), want), f"{codec.name} {dtype} n={n} {kind}"


@needs_gpu
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_decode_matches_cpu(codec):
    n = 10007
    buf = codec.encode(values(n, "normal", torch.float32, seed=3), seed=5)
    for dtype in DTYPES:
        want = codec.decode(buf, (n,), dtype=dtype)
        got = codec.decode(buf.cuda(), (n,), dtype=dtype)
        assert got.device.type == "cuda" and got.dtype == dtype
        # The CPU's AVX2 kernels fuse MinMaxU8's multiply-add (the GPU follows the scalar ones):
        # one float32 rounding of the decoded value apart, which may flip the last bit of a half
        # result; everything else is exact.
        eps = max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
        if isinstance(codec, C.MinMaxUInt8):
            torch.testing.assert_close(got.cpu(), want, rtol=2 * eps, atol=1e-6)
        else:
            assert torch.equal(got.cpu(), want), f"{codec.name} into {dtype}"
        base = values(n, "normal", dtype, seed=9)
        acc_cpu = codec.decode(buf, (n,), out=base.clone(), accumulate=True)
        acc_gpu = codec.decode(buf.cuda(), (n,), out=base.cuda(), accumulate=True)
        if isinstance(codec, C.MinMaxUInt8):
            torch.testing.assert_close(acc_gpu.cpu(), acc_cpu, rtol=4 * eps, atol=1e-5)
        else:
            assert torch.equal(acc_gpu.cpu(), acc_cpu), f"{codec.name} accumulate into {dtype}"


@needs_gpu
def test_gpu_and_cpu_decode_each_others_encodings():
    x = torch.randn(3, 1000, dtype=torch.float32)
    q = C.QSGD(levels=64)
    on_gpu = q.encode(x.cuda(), seed=7)
    assert torch.equal(q.decode(on_gpu.cpu(), x.shape), q.decode(q.encode(x, seed=7), x.shape))
    assert torch.equal(q.decode(q.encode(x, seed=7).cuda(), x.shape).cpu(), q.decode(on_gpu, x.shape).cpu())


@needs_gpu
def test_runs_on_the_current_stream():
    s = torch.cuda.Stream()
    c = C.SignScale()
    with torch.cuda.stream(s):
        x = torch.randn(1 << 22, device="cuda")
        y = x * 2  # queued on s; the encode must come after it
        buf = c.encode(y)
        out = torch.zeros_like(y)
        c.decode(buf, y.shape, out=out, accumulate=True)
    s.synchronize()
    assert torch.equal(buf.cpu(), c.encode(y.cpu()))
    assert torch.equal(out.cpu(), c.decode(c.encode(y.cpu()), y.shape))


@needs_gpu
def test_out_buffers_and_odd_offsets():
    c = C.MinMaxUInt8()
    torch.manual_seed(0)
    x = torch.randn(999, device="cuda")
    n = c.encoded_bytes(999)
    backing = torch.zeros(n + 3, dtype=torch.uint8, device="cuda")
    out = backing[3:]  # an encoding packed at an odd address
    assert c.encode(x, out=out) is out
    assert torch.equal(out.cpu(), c.encode(x.cpu()))
    dst = torch.empty(999, device="cuda", dtype=torch.float64)
    assert c.decode(out, 999, out=dst) is dst
    # Decoding computes lo + q * step in float32, unfused on the GPU and fused by the CPU's AVX2
    # kernels: one float32 rounding of the value apart (a fixed atol of 1e-7 failed on a draw).
    atol = 4 * torch.finfo(torch.float32).eps * float(x.abs().max())
    torch.testing.assert_close(dst.cpu(), c.decode(c.encode(x.cpu()), 999, dtype=torch.float64), rtol=0, atol=atol)


@needs_gpu
def test_mixed_devices_rejected():
    c = C.QSGD()
    x = torch.randn(100, device="cuda")
    with pytest.raises(ValueError, match="same device"):
        c.encode(x, out=torch.empty(c.encoded_bytes(100), dtype=torch.uint8))
    with pytest.raises(ValueError, match="same device"):
        c.encode(x.cpu(), out=torch.empty(c.encoded_bytes(100), dtype=torch.uint8, device="cuda"))
    buf = c.encode(x)
    with pytest.raises(ValueError, match="same device"):
        c.decode(buf, 100, out=torch.empty(100))
    with pytest.raises(ValueError, match="same device"):
        c.decode(buf.cpu(), 100, out=torch.empty(100, device="cuda"))
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="same device"):
            c.decode(buf, 100, out=torch.empty(100, device="cuda:1"))


@needs_gpu
def test_other_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    c = C.BFloat16()
    x = torch.randn(1000, device="cuda:1")
    buf = c.encode(x)
    assert buf.device == x.device and torch.equal(buf.cpu(), c.encode(x.cpu()))
    assert torch.equal(c.decode(buf, 1000).cpu(), x.cpu().to(torch.bfloat16).float())


@needs_gpu
def test_corrupt_buffers_rejected():
    c = C.QSGD(levels=16, chunk=64)
    good = c.encode(torch.randn(500, device="cuda"))
    for offset, value, words in [
        (0, 0, "bad magic"),
        (4, 1, "codec kind"),
        (8, 65, "chunk"),
        (16, 7, "elements"),
        (24, 1, "reserved"),
    ]:
        bad = good.clone()
        bad[offset] = value
        with pytest.raises(ValueError, match=words) as e:
            c.decode(bad, 500)
        assert isinstance(e.value, RumorError) and "(CUDA)" in str(e.value)
    with pytest.raises(ValueError, match="bytes"):
        c.decode(good[:-1], 500)
    with pytest.raises(ValueError, match="header"):
        c.decode(good[:20], 500)
    with pytest.raises(ValueError, match="elements"):
        c.decode(good, 499)
    assert c.decode(good, 500).shape == (500,)  # the stream is still usable


@needs_gpu
def test_bad_cuda_tensors():
    c = C.MinMaxUInt8()
    with pytest.raises(TypeError, match="dtype"):
        c.encode(torch.arange(10, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        c.encode(torch.randn(4, 4, device="cuda").t())
    empty = c.encode(torch.empty(0, device="cuda"))
    assert empty.numel() == c.encoded_bytes(0)
    assert c.decode(empty, 0).numel() == 0
