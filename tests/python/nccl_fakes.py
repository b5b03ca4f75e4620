"""Helpers shared by the tests that run rumor's NCCL path without a GPU: the extension's NCCL
classes (skip when the imported rumor._C predates them), the fake libnccl
(tests/cpp/fake_nccl.cpp, a host-memory test double whose ranks must share one process), and
torch.cuda's streams and events played by the fake's. Used by test_nccl.py, test_gpu_watch.py and
test_gpu_ops_nccl_fake.py (and by rank functions of theirs, in spawned processes)."""
from __future__ import annotations

import contextlib
import ctypes
import glob
import itertools
import os
import threading
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ext():
    """rumor._C, or a skip when the imported rumor has no rumor.gpu.nccl or its _C no NCCL classes."""
    # An installed rumor older than this tree has no rumor.gpu.nccl: these tests need a reinstall, or
    # a build of this tree on PYTHONPATH (its python/rumor with the built _C beside it).
    pytest.importorskip("rumor.gpu.nccl", reason="the imported rumor has no rumor.gpu.nccl (reinstall, or PYTHONPATH)")
    from rumor import _C

    if not hasattr(_C, "NcclLibrary"):
        pytest.skip("the imported rumor._C has no NCCL classes (reinstall, or put a build of this tree on PYTHONPATH)")
    return _C


def fake_path():
    """libnccl-fake.so from RUMOR_FAKE_NCCL or the newest unsanitized C++ test build under build/
    (a sanitizer build cannot be loaded into a plain Python)."""
    p = os.environ.get("RUMOR_FAKE_NCCL")
    if p:
        return p
    found = []
    for lib in glob.glob(os.path.join(ROOT, "build", "*", "tests", "cpp", "libnccl-fake.so")):
        cache = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(lib))), "CMakeCache.txt")
        try:
            with open(cache) as f:
                if any(line.startswith("RUMOR_SANITIZE:") and line.strip().split("=", 1)[1] for line in f):
                    continue
        except OSError:
            continue
        found.append(lib)
    if not found:
        pytest.skip("libnccl-fake.so is not built (cmake -DRUMOR_BUILD_TESTS=ON; or set RUMOR_FAKE_NCCL)")
    return max(found, key=os.path.getmtime)


# torch.cuda's streams and events, played by the fake libnccl's: one "stream" per thread (an
# integer handle), and events that pass once their stream is idle (fakeNcclStreamIdle plays
# cudaEventQuery).

def fake_cuda(fake: str):
    """torch.cuda's current stream (one per thread), events, stream contexts and record_stream,
    played by the fake's streams; returns the list of stream handles record_stream was given."""
    import torch

    idle = ctypes.CDLL(fake).fakeNcclStreamIdle
    idle.argtypes = [ctypes.c_void_p]
    local, handles = threading.local(), itertools.count(0x5150, 16)

    def current_stream(device=None):
        s = getattr(local, "stream", None)
        if s is None:
            s = local.stream = types.SimpleNamespace(cuda_stream=next(handles))
        return s

    class FakeEvent:
        def __init__(self, *a, **k):
            self.handle = None

        def record(self, stream=None):
            self.handle = (stream or current_stream()).cuda_stream

        def query(self):
            return bool(idle(self.handle))

    recorded = []
    torch.cuda.current_stream = current_stream
    torch.cuda.current_device = lambda: 0
    torch.cuda.Event = FakeEvent
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: recorded.append(stream.cuda_stream)
    return recorded
