#!/usr/bin/env python3
"""atheris fuzz target: rumor.data._codec.decode, the parser of cache values.

Cache values come from a backend (redis, a shared directory) that others may be able to write,
so decode() must, for any bytes, return a value or raise CorruptValue (BadMac and PickleRefused
are CorruptValues); any other exception, a hang or a crash is a finding.

    pip install atheris
    python3 tests/fuzz/fuzz_cache_codec.py -max_total_time=60          # libFuzzer flags
    python3 tests/fuzz/fuzz_cache_codec.py crash-<sha1>                 # replay one input

The first input byte picks how the rest reaches decode():
  0  as is (header checks first)
  1  through the MAC layer with the rest as the sealed value (almost always BadMac: checks that
     the MAC layer refuses without parsing)
  2  behind a valid header (magic, version, length, CRC32 computed here), so that every input
     reaches the payload parser, as a writer who knows the format (the CRC is no secret) would
  3  the same, sealed with a valid MAC: the whole path a job's own value takes
allow_pickle stays False (pickles are refused, never loaded; allow_pickle=True is for trusted
caches only and then running code is the documented behaviour).
tests/python/test_cache_codec_properties.py checks the same properties with hypothesis in CI.
"""
from __future__ import annotations

import glob
import importlib
import os
import struct
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(HERE, "..", "..", "python")
# This checkout's package where its extension is built in place (a developer's tree); else the
# installed rumor, which scripts/setup.sh built from this checkout (CI's clean clone).
if glob.glob(os.path.join(_SRC, "rumor", "_C*.so")):
    sys.path.insert(0, _SRC)

import atheris  # noqa: E402

# torch, numpy and the rumor package first, uninstrumented (instrumenting torch costs minutes and
# finds nothing of ours); then the codec itself, instrumented for coverage.
import numpy  # noqa: E402,F401
import torch  # noqa: E402,F401

import rumor  # noqa: E402,F401
from rumor import _secret  # noqa: E402

sys.modules.pop("rumor.data._codec", None)
with atheris.instrument_imports(include=["rumor.data._codec"]):
    codec = importlib.import_module("rumor.data._codec")

MAC_KEY = b"fuzz-key".ljust(32, b"\0")
KEY = b"rumor:fuzz:i1"
_HEADER = struct.Struct("<4sBBHQI")


def _with_header(payload: bytes) -> bytes:
    return _HEADER.pack(codec.MAGIC, codec.VERSION, 0, 0, len(payload), zlib.crc32(payload)) + payload


def TestOneInput(data: bytes) -> None:  # noqa: N802 (atheris' name)
    if not data:
        return
    mode, rest = data[0] % 4, data[1:]
    try:
        if mode == 0:
            codec.decode(rest)
        elif mode == 1:
            codec.decode(rest, mac_key=MAC_KEY, key=KEY)
        elif mode == 2:
            codec.decode(_with_header(rest))
        else:
            sealed = _with_header(rest)
            tag = _secret.mac(MAC_KEY, codec._MAC_LABEL, KEY, sealed[:codec.HEADER_SIZE], sealed[codec.HEADER_SIZE:])
            codec.decode(tag + sealed, mac_key=MAC_KEY, key=KEY)
    except codec.CorruptValue:
        pass  # the documented refusal


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
