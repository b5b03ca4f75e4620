"""Cache value format: raw tensor bytes behind a small checked header.

A cache is shared by processes that trust each other only as far as the network does, so a
value must never be able to run code when it is read back: tensors, numpy arrays and plain
containers of them are written as raw bytes with their dtype and shape, and pickle is used only
for values the user explicitly allowed it for (allow_pickle=True on both sides).

    header:  magic b"RMRC" | version u8 | flags u8 | reserved u16 | payload length u64 | crc32 u32
    payload: one tagged item, recursively (see _enc)

Anything that does not parse exactly (bad magic or version, length or checksum mismatch, a
truncated item, trailing bytes, a pickled item where pickle is not allowed) raises CorruptValue.

The CRC32 catches accidents only: anyone who can write to the backend can compute it. The
cache therefore stores values sealed (encode/decode with mac_key): an HMAC-SHA256 in front,
keyed by the job secret (rumor._runtime.job_secret().key("data-cache")) and bound to the value's
cache key, checked before a single byte of the value is parsed (BadMac otherwise). In an
authenticated job only its own ranks can produce a value that checks out; in an unauthenticated
one the key is public and the MAC catches accidents like the CRC.

    sealed:  mac (32 bytes) = HMAC(mac_key, "rumor-cache-value", cache key, header + payload) | header | payload
"""
from __future__ import annotations

import pickle
import re
import struct
import zlib
from typing import Any, List, Optional, Tuple

from .._secret import mac as _mac
from .._secret import mac_ok as _mac_ok

MAGIC = b"RMRC"
VERSION = 1
_HEADER = struct.Struct("<4sBBHQI")
HEADER_SIZE = _HEADER.size
_FLAG_PICKLE = 1  # some item in the payload is pickled
_MAX_DEPTH = 64
_MAX_NDIM = 64

# Tags: one byte in front of each item.
_T_TENSOR, _T_NDARRAY, _T_INT, _T_BIGINT, _T_FLOAT, _T_STR, _T_BYTES = b"T", b"A", b"i", b"I", b"f", b"s", b"b"
_T_NONE, _T_TRUE, _T_FALSE, _T_LIST, _T_TUPLE, _T_DICT, _T_PICKLE = b"n", b"1", b"0", b"l", b"t", b"d", b"P"

_U8, _U32, _U64, _I64, _F64 = (struct.Struct(f) for f in ("<B", "<I", "<Q", "<q", "<d"))


# The dtype strings encode() writes for numpy arrays: byte order, kind, item size.
_NDARRAY_DTYPE = re.compile(rb"[<>|=][biufc](1|2|4|8|16)")


class CorruptValue(ValueError):
    """A stored value that is not a well-formed rumor cache value (or pickled where not allowed)."""


class PickleRefused(CorruptValue):
    """A stored value holds a pickled item but the reader did not allow pickle."""


class BadMac(CorruptValue):
    """A sealed value whose MAC does not match: altered, stored under another key, or written by
    a job with another job secret."""


MAC_SIZE = 32
_MAC_LABEL = b"rumor-cache-value"


def _read_shape(buf, pos: int, ndim: int):
    """(shape tuple, element count, payload byte count, position after them) of an encoded
    tensor or array: ndim u64 extents, then the u64 byte count."""
    shape = tuple(_U64.unpack_from(buf, pos + 8 * i)[0] for i in range(ndim))
    pos += 8 * ndim
    nbytes = _U64.unpack_from(buf, pos)[0]
    numel = 1
    for s in shape:
        numel *= s
    return shape, numel, nbytes, pos + 8

def _torch_dtypes():
    import torch

    names = ["float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
             "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"]
    table = []
    for i, n in enumerate(names):
        dt = getattr(torch, n, None)
        if dt is not None:
            table.append((i, dt))
    return {dt: i for i, dt in table}, {i: dt for i, dt in table}


_DT = None


def _dtypes():
    global _DT
    if _DT is None:
        _DT = _torch_dtypes()
    return _DT


def _is_tensor(x) -> bool:
    t = type(x).__module__
    if not t.startswith("torch"):
        return False
    import torch

    return isinstance(x, torch.Tensor)


def _is_ndarray(x) -> bool:
    if type(x).__module__ != "numpy":
        return False
    import numpy as np

    return type(x) is np.ndarray


def encode(value: Any, allow_pickle: bool = False, mac_key: Optional[bytes] = None, key: bytes = b"") -> bytes:
    """Header + payload for value, sealed with a MAC in front when mac_key is given (bound to the
    cache key `key`). TypeError for what the format cannot hold without pickle."""
    parts: List[bytes] = []
    flags = [0]
    _enc(value, parts, allow_pickle, flags, 0)
    payload = b"".join(parts)
    head = _HEADER.pack(MAGIC, VERSION, flags[0], 0, len(payload), zlib.crc32(payload))
    if mac_key is None:
        return head + payload
    return b"".join((_mac(mac_key, _MAC_LABEL, key, head, payload), head, payload))


def _open_sealed(data, mac_key: bytes, key: bytes) -> memoryview:
    mv = memoryview(data)
    if len(mv) < MAC_SIZE + HEADER_SIZE:
        raise BadMac(f"sealed value of {len(mv)} bytes is shorter than MAC and header")
    head, payload = mv[MAC_SIZE:MAC_SIZE + HEADER_SIZE], mv[MAC_SIZE + HEADER_SIZE:]
    if not _mac_ok(mac_key, bytes(mv[:MAC_SIZE]), _MAC_LABEL, key, head, payload):
        raise BadMac("MAC mismatch (altered, stored under another key, or written by a job with another secret)")
    return mv[MAC_SIZE:]


def _enc(x, out: List[bytes], allow_pickle: bool, flags: List[int], depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise TypeError(f"rumor.data cache: value nested deeper than {_MAX_DEPTH} levels")
    tx = type(x)
    if tx is bool:
        out.append(_T_TRUE if x else _T_FALSE)
    elif tx is int:
        if -(1 << 63) <= x < (1 << 63):
            out += [_T_INT, _I64.pack(x)]
        else:
            s = str(x).encode()
            out += [_T_BIGINT, _U32.pack(len(s)), s]
    elif tx is float:
        out += [_T_FLOAT, _F64.pack(x)]
    elif tx is str:
        s = x.encode("utf-8", "surrogatepass")
        out += [_T_STR, _U64.pack(len(s)), s]
    elif tx is bytes:
        out += [_T_BYTES, _U64.pack(len(x)), x]
    elif x is None:
        out.append(_T_NONE)
    elif tx is list or tx is tuple:
        out += [_T_LIST if tx is list else _T_TUPLE, _U64.pack(len(x))]
        for v in x:
            _enc(v, out, allow_pickle, flags, depth + 1)
    elif tx is dict:
        out += [_T_DICT, _U64.pack(len(x))]
        for k, v in x.items():
            _enc(k, out, allow_pickle, flags, depth + 1)
            _enc(v, out, allow_pickle, flags, depth + 1)
    elif _is_tensor(x) and _tensor_ok(x):
        to_code, _ = _dtypes()
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype not in to_code:
            raise TypeError(f"rumor.data cache: tensor dtype {t.dtype} is not supported without allow_pickle=True")
        nbytes = t.numel() * t.element_size()
        out += [_T_TENSOR, _U8.pack(to_code[t.dtype]), _U8.pack(t.dim())]
        out += [_U64.pack(s) for s in t.shape]
        out += [_U64.pack(nbytes), _tensor_bytes(t, nbytes)]
    elif _is_ndarray(x) and x.dtype.kind in "biufc" and not x.dtype.fields:
        import numpy as np

        a = np.ascontiguousarray(x).reshape(x.shape)  # (ascontiguousarray makes a 0-d array 1-d)
        d = a.dtype.str.encode()
        out += [_T_NDARRAY, _U8.pack(len(d)), d, _U8.pack(a.ndim)]
        out += [_U64.pack(s) for s in a.shape]
        out += [_U64.pack(a.nbytes), a.tobytes()]
    elif allow_pickle:
        p = pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
        flags[0] |= _FLAG_PICKLE
        out += [_T_PICKLE, _U64.pack(len(p)), p]
    else:
        raise TypeError(
            f"rumor.data cache: cannot store a {tx.__module__}.{tx.__qualname__} without pickle; the cache holds "
            "tensors, numpy arrays, int/float/str/bytes/bool/None and exact list/tuple/dict of those. "
            "Pass allow_pickle=True to store other objects (only if every process that can write to the cache "
            "is trusted: unpickling runs code)")


def _tensor_ok(t) -> bool:
    import torch

    return t.layout == torch.strided and not t.is_quantized and not getattr(t, "is_nested", False)


def _tensor_bytes(t, nbytes: int) -> bytes:
    import torch

    if nbytes == 0:
        return b""
    # A byte view of the storage: no dtype conversion, works for bfloat16 and other
    # dtypes numpy lacks.
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes()


def decode(data, allow_pickle: bool = False, mac_key: Optional[bytes] = None, key: bytes = b"") -> Any:
    """Parses what encode() wrote; CorruptValue for anything else. With mac_key the value must
    be sealed under that key and cache key: BadMac (a CorruptValue) otherwise, raised before
    anything of the value is parsed."""
    mv = _open_sealed(data, mac_key, key) if mac_key is not None else memoryview(data)
    if len(mv) < HEADER_SIZE:
        raise CorruptValue(f"value of {len(mv)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, flags, reserved, length, crc = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptValue(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise CorruptValue(f"unknown format version {version} (this rumor writes {VERSION})")
    if flags & ~_FLAG_PICKLE or reserved:
        raise CorruptValue(f"unknown header flags {flags:#x} / reserved field {reserved:#x}")
    if length != len(mv) - HEADER_SIZE:
        raise CorruptValue(f"payload is {len(mv) - HEADER_SIZE} bytes, header says {length} (truncated?)")
    if (flags & _FLAG_PICKLE) and not allow_pickle:
        raise PickleRefused("value holds pickled objects and allow_pickle is False")
    # One writable copy that decoded tensors share, so that torch never sees read-only memory.
    buf = bytearray(mv[HEADER_SIZE:])
    if zlib.crc32(buf) != crc:
        raise CorruptValue("checksum mismatch")
    try:
        value, pos = _dec(buf, 0, allow_pickle, 0)
    except CorruptValue:
        raise
    except (struct.error, IndexError, ValueError, UnicodeDecodeError, OverflowError, RuntimeError, TypeError) as e:
        raise CorruptValue(f"malformed payload: {e}") from None
    if pos != len(buf):
        raise CorruptValue(f"{len(buf) - pos} trailing bytes after the value")
    return value


def _take(buf: bytearray, pos: int, n: int) -> Tuple[int, int]:
    end = pos + n
    if n < 0 or end > len(buf):
        raise CorruptValue(f"item of {n} bytes at offset {pos} runs past the end ({len(buf)} bytes)")
    return pos, end


def _dec(buf: bytearray, pos: int, allow_pickle: bool, depth: int):
    if depth > _MAX_DEPTH:
        raise CorruptValue("nesting too deep")
    _, pos1 = _take(buf, pos, 1)
    tag = bytes(buf[pos:pos1])
    pos = pos1
    if tag == _T_INT:
        return _I64.unpack_from(buf, pos)[0], pos + 8
    if tag == _T_FLOAT:
        return _F64.unpack_from(buf, pos)[0], pos + 8
    if tag == _T_TRUE:
        return True, pos
    if tag == _T_FALSE:
        return False, pos
    if tag == _T_NONE:
        return None, pos
    if tag in (_T_STR, _T_BYTES, _T_BIGINT, _T_PICKLE):
        if tag == _T_BIGINT:
            n = _U32.unpack_from(buf, pos)[0]
            pos += 4
        else:
            n = _U64.unpack_from(buf, pos)[0]
            pos += 8
        a, b = _take(buf, pos, n)
        raw = bytes(buf[a:b])
        if tag == _T_STR:
            return raw.decode("utf-8", "surrogatepass"), b
        if tag == _T_BYTES:
            return raw, b
        if tag == _T_BIGINT:
            return int(raw.decode("ascii")), b
        if not allow_pickle:
            raise PickleRefused("value holds a pickled object and allow_pickle is False")
        return pickle.loads(raw), b
    if tag in (_T_LIST, _T_TUPLE):
        n = _U64.unpack_from(buf, pos)[0]
        pos += 8
        if n > len(buf) - pos:  # every item takes at least one byte
            raise CorruptValue(f"list of {n} items cannot fit")
        items = []
        for _ in range(n):
            v, pos = _dec(buf, pos, allow_pickle, depth + 1)
            items.append(v)
        return (items if tag == _T_LIST else tuple(items)), pos
    if tag == _T_DICT:
        n = _U64.unpack_from(buf, pos)[0]
        pos += 8
        if 2 * n > len(buf) - pos:
            raise CorruptValue(f"dict of {n} items cannot fit")
        d = {}
        for _ in range(n):
            k, pos = _dec(buf, pos, allow_pickle, depth + 1)
            v, pos = _dec(buf, pos, allow_pickle, depth + 1)
            d[k] = v
        return d, pos
    if tag == _T_TENSOR:
        import torch

        _, from_code = _dtypes()
        code, ndim = buf[pos], buf[pos + 1]
        pos += 2
        if code not in from_code or ndim > _MAX_NDIM:
            raise CorruptValue(f"bad tensor dtype code {code} or ndim {ndim}")
        dtype = from_code[code]
        shape, numel, nbytes, pos = _read_shape(buf, pos, ndim)
        shape = list(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize != nbytes:
            raise CorruptValue(f"tensor of shape {shape} and {dtype} cannot hold {nbytes} bytes")
        a, b = _take(buf, pos, nbytes)
        if numel == 0:
            return torch.empty(shape, dtype=dtype), b
        t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=a)
        return t.view(dtype).reshape(shape), b
    if tag == _T_NDARRAY:
        import numpy as np

        n = buf[pos]
        a, b = _take(buf, pos + 1, n)
        # Only what encode() writes (a plain numeric dtype.str such as "<f4"): numpy parses any
        # other string with its own grammar (found by fuzzing: "A,\x00..." raised SyntaxError).
        spec = bytes(buf[a:b])
        if _NDARRAY_DTYPE.fullmatch(spec) is None:
            raise CorruptValue(f"bad array dtype {spec[:32]!r}")
        dt = np.dtype(spec.decode("ascii"))
        if dt.kind not in "biufc" or dt.fields:
            raise CorruptValue(f"bad array dtype {dt}")
        pos = b
        ndim = buf[pos]
        pos += 1
        if ndim > _MAX_NDIM:
            raise CorruptValue(f"bad array ndim {ndim}")
        shape, numel, nbytes, pos = _read_shape(buf, pos, ndim)
        if numel * dt.itemsize != nbytes:
            raise CorruptValue(f"array of shape {shape} and {dt} cannot hold {nbytes} bytes")
        a, b = _take(buf, pos, nbytes)
        return np.frombuffer(buf, dtype=dt, count=numel, offset=a).reshape(shape), b
    raise CorruptValue(f"unknown tag {tag!r} at offset {pos - 1}")
