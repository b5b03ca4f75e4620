"""Property tests of the cache value format (rumor.data._codec), run in CI with hypothesis.

decode() reads bytes anyone who reaches the cache backend may have written: whatever it is
given, it returns a value or raises CorruptValue (BadMac and PickleRefused are CorruptValues),
never anything else, and never runs a pickle unless allowed. encode -> decode returns the value.
The same properties through the MAC layer. (tests/fuzz/fuzz_cache_codec.py fuzzes the same
entry points with atheris, coverage-guided.)
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rumor.data import _codec  # noqa: E402

MAC_KEY = b"k" * 32
KEY = b"rumor:props:i7"
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.uint8,
           torch.bool, torch.complex64]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * torch.empty((), dtype=dtype).element_size(),
                         max_size=n * torch.empty((), dtype=dtype).element_size()))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return t.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


@st.composite
def arrays(draw):
    dt = np.dtype(draw(st.sampled_from(["<f4", "<f8", "<i2", "<u8", "|b1", "<c16", ">i4"])))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * dt.itemsize, max_size=n * dt.itemsize))
    return np.frombuffer(raw, dtype=dt).reshape(shape).copy()


leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20),
                   st.binary(max_size=20), tensors(), arrays())
values = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
    st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), inner, max_size=4)), max_leaves=12)


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        # bit for bit (NaNs included)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _decode_only_corrupt(data, **kw):
    try:
        _codec.decode(data, **kw)
    except _codec.CorruptValue:
        pass  # the one documented way to refuse; anything else propagates and fails the test


@SETTINGS
@given(values)
def test_encode_decode_round_trips(v):
    assert _same(_codec.decode(_codec.encode(v)), v)
    assert _same(_codec.decode(_codec.encode(v, mac_key=MAC_KEY, key=KEY), mac_key=MAC_KEY, key=KEY), v)


@SETTINGS
@given(st.binary(max_size=300))
def test_decode_of_random_bytes_raises_only_corrupt_value(data):
    _decode_only_corrupt(data)
    _decode_only_corrupt(data, mac_key=MAC_KEY, key=KEY)
    # behind a valid header (right magic, length and CRC), so that the payload parser is reached
    import struct
    import zlib

    head = struct.pack("<4sBBHQI", _codec.MAGIC, _codec.VERSION, 0, 0, len(data), zlib.crc32(data))
    _decode_only_corrupt(head + data)


@SETTINGS
@given(values, st.data())
def test_decode_of_mutated_values_raises_only_corrupt_value(v, data):
    import struct
    import zlib

    enc = bytearray(_codec.encode(v))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip" and enc:
            i = data.draw(st.integers(0, len(enc) - 1))
            enc[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut" and enc:
            i = data.draw(st.integers(0, len(enc) - 1))
            del enc[i:i + data.draw(st.integers(1, 9))]
        else:
            i = data.draw(st.integers(0, len(enc)))
            enc[i:i] = data.draw(st.binary(min_size=1, max_size=9))
    _decode_only_corrupt(bytes(enc))
    # the same mutation with header length and CRC fixed up, as someone who can write the backend
    # would: the payload parser sees it; with the MAC layer the value is refused before that
    if len(enc) >= _codec.HEADER_SIZE:
        payload = bytes(enc[_codec.HEADER_SIZE:])
        fixed = struct.pack("<4sBBHQI", _codec.MAGIC, _codec.VERSION, 0, 0, len(payload), zlib.crc32(payload)) \
            + payload
        _decode_only_corrupt(fixed)
        with pytest.raises(_codec.BadMac):
            _codec.decode(b"\0" * _codec.MAC_SIZE + fixed, mac_key=MAC_KEY, key=KEY)
