"""Gradient codecs: compact encodings of float tensors for the wire.

Each codec turns a CPU or CUDA tensor (float32, float16, bfloat16 or float64, contiguous) into a
self-describing ``torch.uint8`` buffer whose length depends only on the element count
(``encoded_bytes(numel)``), and decodes such a buffer back, optionally adding into an existing
tensor. The kernels are C++ (AVX2 where the CPU has it, see :func:`isa`), single-threaded, and
run without the GIL. CUDA tensors go to CUDA kernels (where rumor was built with nvcc, see
:func:`cuda_available`) that write the same bytes as the CPU ones, so encodings cross freely
between GPU and CPU ranks. They run on torch's current stream; decoding a CUDA buffer first
reads its 32-byte header to the host to validate it, which waits for that stream. See
docs/compression.md for formats and error bounds.

- :class:`MinMaxUInt8`: per chunk min and max, one byte per element; error <= (max-min)/510.
- :class:`QSGD`: per chunk L2 norm, sign and stochastic level per element; unbiased, error
  <= norm/levels, reproducible for a given ``seed``.
- :class:`SignScale`: one bit per element and the chunk's mean |x| (signSGD with scale; keep
  the error feedback ``e = x - decode(encode(x))`` yourself).
- :class:`Float16`, :class:`BFloat16`: casts, round to nearest even.
"""
from __future__ import annotations

import math
import operator
from typing import Optional, Sequence, Union

import torch

from . import _C
from ._tensor import check_tensor, dtype_code

__all__ = ["Codec", "MinMaxUInt8", "QSGD", "SignScale", "Float16", "BFloat16", "isa", "cuda_available"]

_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def isa() -> str:
    """The kernel set the codecs run: ``"avx2"`` or ``"generic"`` (``RUMOR_CODEC_ISA=generic``
    forces the scalar one; the variable is read once per process)."""
    return _C.codec_isa()


def cuda_available() -> bool:
    """Whether CUDA tensors can be encoded and decoded: this build has the CUDA codec kernels
    (nvcc was found when it was built) and a CUDA device is visible. Never raises."""
    return bool(_C.cuda_built()) and _C.cuda_device_count() > 0


def _is_cuda(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def _cuda_stream(device: torch.device) -> int:
    # The kernels run on torch's current stream of the tensors' device, ordered with the work
    # that produced the input and before the work that reads the output.
    return torch.cuda.current_stream(device).cuda_stream


def _check_same_device(who: str, what: str, t: torch.Tensor, other: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{who}: {what} is on {t.device} but {other} is on {device}; both must be on the same device")


def _require_cuda(what: str, device: torch.device) -> None:
    if not cuda_available():
        why = "has no CUDA codec kernels (built without nvcc)" if not _C.cuda_built() else "sees no CUDA device"
        raise ValueError(f"{what}: tensor is on {device} but this rumor build {why}")


def _check_float_tensor(t, what: str) -> int:
    if _is_cuda(t):
        _require_cuda(what, t.device)
        if t.layout != torch.strided:
            raise TypeError(f"{what}: expected a dense (strided) tensor, got layout {t.layout}")
        code = dtype_code(t.dtype, what)
    else:
        code = check_tensor(t, what)  # a dense CPU tensor
    if t.dtype not in _FLOAT_TYPES:
        raise TypeError(f"{what}: unsupported dtype {t.dtype}; expected float32, float16, bfloat16 or float64")
    if not t.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous (call .contiguous() first)")
    return code


def _dims(shape) -> tuple:
    try:
        dims = (operator.index(shape),) if not isinstance(shape, (tuple, list, torch.Size)) else tuple(
            operator.index(d) for d in shape
        )
    except TypeError:
        raise ValueError(f"shape must be an int or a sequence of non-negative ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must be an int or a sequence of non-negative ints, got {shape!r}")
    return dims


class Codec:
    """Base class: one C++ codec with fixed parameters. Use the subclasses (MinMaxUInt8,
    QSGD, SignScale, Float16, BFloat16), which pick kind and validate their own arguments.

    Args:
        kind: the codec's kind, a rumor._C.CodecKind.
        chunk: elements per chunk for the chunked codecs, a multiple of 8 in [8, 2**24]; None
            (the default) means 1024. Float16 and BFloat16 ignore it.
        levels: quantization levels, used by QSGD only (default 16).

    Raises:
        ValueError: chunk is not a positive int, or not a multiple of 8 in range.
    """

    def __init__(self, kind, chunk: Optional[int] = None, levels: int = 16):
        if chunk is not None and (not isinstance(chunk, int) or chunk <= 0):
            raise ValueError(f"chunk must be a positive multiple of 8, got {chunk!r}")
        self._c = _C.make_codec(kind, 0 if chunk is None else chunk, levels)

    @property
    def name(self) -> str:
        """The codec and its parameters as text, e.g. "QSGD(levels=16, chunk=1024)" or
        "Float16" (also its repr)."""
        return self._c.name

    def __repr__(self) -> str:
        return self._c.name

    def encoded_bytes(self, numel: int) -> int:
        """Bytes the encoding of ``numel`` elements takes, header included."""
        if not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        return self._c.encoded_bytes(numel)

    def encode(self, tensor: torch.Tensor, seed: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Encodes ``tensor`` into a 1-D ``torch.uint8`` tensor on its device (a new one, or
        ``out``, which must hold exactly ``encoded_bytes(tensor.numel())`` bytes). ``seed``
        drives QSGD's stochastic rounding (same seed and input, same bytes); the other codecs
        ignore it."""
        who = f"{self.name}.encode"
        code = _check_float_tensor(tensor, who)
        if not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        n = tensor.numel()
        want = self._c.encoded_bytes(n)
        if out is None:
            out = torch.empty(want, dtype=torch.uint8, device=tensor.device)
        elif not isinstance(out, torch.Tensor) or out.dtype != torch.uint8:
            raise TypeError(f"{who}: out must be a torch.uint8 tensor")
        else:
            _check_same_device(who, "out", out, "the tensor", tensor.device)
            if not out.is_contiguous() or out.dim() != 1 or out.numel() != want:
                raise ValueError(f"{who}: out must be a contiguous 1-D tensor of {want} bytes")
        if tensor.device.type == "cuda":
            _C.cuda_encode(
                self._c, tensor.data_ptr(), n, code, out.data_ptr(), out.numel(), seed, _cuda_stream(tensor.device)
            )
        else:
            self._c.encode(tensor.data_ptr(), n, code, out.data_ptr(), out.numel(), seed)
        return out

    def decode(
        self,
        buf: Union[torch.Tensor, bytes, bytearray],
        shape: Union[int, Sequence[int]],
        dtype: Optional[torch.dtype] = None,
        out: Optional[torch.Tensor] = None,
        accumulate: bool = False,
    ) -> torch.Tensor:
        """Decodes ``buf`` into a tensor of ``shape`` on ``buf``'s device (``out`` must be on it
        too). ``dtype`` defaults to ``out.dtype`` if ``out`` is given, else float32. With
        ``out``, writes into it (or, with ``accumulate``, adds the decoded values to it) and
        returns it. A buffer that is not a valid encoding of that many elements by this codec
        raises ValueError (rumor's invalid-argument error)."""
        who = f"{self.name}.decode"
        if isinstance(buf, (bytes, bytearray)):
            buf = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"{who}: buf must be a torch.uint8 tensor or bytes, got {type(buf).__name__}")
        if buf.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{who}: buffer is on {buf.device}; codecs take CPU or CUDA tensors")
        if buf.device.type == "cuda":
            _require_cuda(who, buf.device)
        if buf.dtype != torch.uint8:
            raise TypeError(f"{who}: buf must have dtype torch.uint8, got {buf.dtype}")
        if not buf.is_contiguous():
            raise ValueError(f"{who}: buf must be contiguous")
        dims = _dims(shape)
        n = math.prod(dims)
        if out is None:
            if accumulate:
                raise ValueError(f"{who}: accumulate=True needs out=")
            dtype = torch.float32 if dtype is None else dtype
            if dtype not in _FLOAT_TYPES:
                raise TypeError(f"{who}: unsupported dtype {dtype}; expected float32, float16, bfloat16 or float64")
            out = torch.empty(dims, dtype=dtype, device=buf.device)
        else:
            if isinstance(out, torch.Tensor):
                _check_same_device(who, "out", out, "buf", buf.device)
            _check_float_tensor(out, who + " out")
            if dtype is not None and dtype != out.dtype:
                raise TypeError(f"{who}: dtype {dtype} does not match out.dtype {out.dtype}")
            if tuple(out.shape) != dims:
                raise ValueError(f"{who}: out has shape {tuple(out.shape)}, expected {dims}")
        code = dtype_code(out.dtype, who)
        if buf.device.type == "cuda":
            stream = _cuda_stream(buf.device)
            _C.cuda_decode(self._c, buf.data_ptr(), buf.numel(), out.data_ptr(), n, code, bool(accumulate), stream)
        else:
            self._c.decode(buf.data_ptr(), buf.numel(), out.data_ptr(), n, code, bool(accumulate))
        return out


class MinMaxUInt8(Codec):
    """Per chunk (default 1024 elements) min and max as float32 and one byte per element:
    q = round((x - min) * 255 / (max - min)); |decode(x) - x| <= (max - min) / 510 plus float
    rounding; a constant chunk decodes exactly. About 1.008 bytes per element."""

    def __init__(self, chunk: Optional[int] = None):
        super().__init__(_C.CodecKind.MinMaxU8, chunk)


class QSGD(Codec):
    """QSGD with ``levels`` (2..256) levels: per chunk the L2 norm, per element a sign and a
    level rounded stochastically (unbiased; |decode(x) - x| <= norm / levels). One byte per
    element for levels <= 127, two above."""

    def __init__(self, levels: int = 16, chunk: Optional[int] = None):
        if not isinstance(levels, int):
            raise TypeError(f"levels must be an int, got {type(levels).__name__}")
        if not 2 <= levels <= 256:
            raise ValueError(f"QSGD levels must be in 2..256, got {levels}")
        super().__init__(_C.CodecKind.QSGD, chunk, levels)
        self.levels = levels


class SignScale(Codec):
    """One bit per element (set for x < 0; zero encodes as +) and one float32 scale per chunk,
    the chunk's mean |x|. Biased: pair it with error feedback, e = x - decode(encode(x))."""

    def __init__(self, chunk: Optional[int] = None):
        super().__init__(_C.CodecKind.Sign, chunk)


class Float16(Codec):
    """IEEE half precision, round to nearest even (matches ``tensor.to(torch.float16)``)."""

    def __init__(self):
        super().__init__(_C.CodecKind.F16)


class BFloat16(Codec):
    """bfloat16, round to nearest even, NaN stays NaN (matches ``tensor.to(torch.bfloat16)``)."""

    def __init__(self):
        super().__init__(_C.CodecKind.BF16)
