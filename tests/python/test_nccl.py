"""rumor.gpu.nccl: where NCCL is looked for, the errors of a bad library, is_available() on a machine
without NCCL, and (when the C++ tests are built) the NcclLibrary / NcclCommunicator bindings and
communicator() over the fake libnccl (tests/cpp/fake_nccl.cpp, a host-memory test double whose
ranks must share one process). The tests that need the extension's NCCL classes skip when the
imported rumor._C predates them. Nothing here needs a GPU; docs/gpu.md lists what has not run on
one."""
from __future__ import annotations

import ctypes
import importlib
import os
import sys

import pytest

import harness
from nccl_fakes import ext as _ext
from nccl_fakes import fake_path as _fake_path

# An installed rumor older than this tree has no rumor.gpu.nccl: these tests need a reinstall, or a
# build of this tree on PYTHONPATH (its python/rumor with the built _C beside it).
pytest.importorskip("rumor.gpu.nccl", reason="the imported rumor has no rumor.gpu.nccl (reinstall, or PYTHONPATH)")


def test_env_var_is_the_only_candidate(monkeypatch):
    from rumor.gpu import nccl

    monkeypatch.setenv("RUMOR_NCCL_LIBRARY", "/opt/nccl/lib/libnccl.so.2")
    assert nccl.candidates() == ["/opt/nccl/lib/libnccl.so.2"]
    assert nccl.find_library() == "/opt/nccl/lib/libnccl.so.2"


def test_default_candidates_end_with_the_loader_search(monkeypatch):
    from rumor.gpu import nccl

    monkeypatch.delenv("RUMOR_NCCL_LIBRARY", raising=False)
    c = nccl.candidates()
    assert c[-1] == "libnccl.so.2"
    assert all(os.path.isfile(p) for p in c[:-1]), c


def test_the_nvidia_wheel_is_found_without_importing_it(monkeypatch, tmp_path):
    from rumor.gpu import nccl

    lib = tmp_path / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_bytes(b"")
    monkeypatch.delenv("RUMOR_NCCL_LIBRARY", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    if "nvidia" in sys.modules:
        pytest.skip("an nvidia package is already imported")
    assert nccl.find_library() == str(lib / "libnccl.so.2")
    assert nccl.candidates()[-1] == "libnccl.so.2"


def test_bad_paths_give_clear_errors(monkeypatch):
    _ext()
    from rumor.gpu import nccl
    from rumor.errors import RumorError

    monkeypatch.setenv("RUMOR_NCCL_LIBRARY", "/nonexistent/dir/libnccl.so.2")
    with pytest.raises(RumorError, match=r"/nonexistent/dir/libnccl.so.2 \(file not found\)") as e:
        nccl.load()
    assert "RUMOR_NCCL_LIBRARY" in str(e.value)
    monkeypatch.setenv("RUMOR_NCCL_LIBRARY", "libm.so.6")
    with pytest.raises(RumorError, match=r"not an NCCL library: missing symbol ncclGetVersion"):
        nccl.load()


def test_is_available_is_false_here_and_never_raises(monkeypatch):
    from rumor import _C
    from rumor.gpu import nccl

    if _C.cuda_device_count() > 0:
        pytest.skip("this machine has a GPU")
    assert nccl.is_available() is False
    monkeypatch.setenv("RUMOR_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    assert nccl.is_available() is False


def test_library_and_communicator_bindings_on_the_fake(monkeypatch):
    C = _ext()
    import numpy as np

    from rumor.gpu import nccl
    from rumor.errors import AbortedError

    fake = _fake_path()
    monkeypatch.setenv("RUMOR_NCCL_LIBRARY", fake)
    lib = nccl.load()
    assert lib.version == "2.27.3" and lib.version_code == 22703
    assert os.path.realpath(lib.path) == os.path.realpath(fake)
    assert C.NcclLibrary.min_version == "2.14.0"
    uid = lib.unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128 and uid != lib.unique_id()

    with pytest.raises(TypeError, match="expected a path"):
        C.NcclLibrary(3)
    with pytest.raises(ValueError, match="empty"):
        C.NcclLibrary([])
    with pytest.raises(ValueError, match="must be 128 bytes"):
        C.NcclCommunicator(lib, b"x" * 10, 1, 0, 5.0)
    with pytest.raises(ValueError, match=r"rank 1 is outside \[0, 1\)"):
        C.NcclCommunicator(lib, uid, 1, 1, 5.0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        C.NcclCommunicator(lib, uid, 1, 0, -1.0)

    comm = C.NcclCommunicator(lib, uid, 1, 0, 5.0)
    assert (comm.rank, comm.size, comm.aborted) == (0, 1, False)
    idle = ctypes.CDLL(fake).fakeNcclStreamIdle
    idle.argtypes = [ctypes.c_void_p]
    stream = 0x1234  # any integer: the fake keys its streams by it
    x = np.arange(8, dtype=np.float32)
    y = np.zeros(8, dtype=np.float32)
    comm.allreduce(x.ctypes.data, y.ctypes.data, 8, 0, 0, stream)  # float32, SUM
    comm.wait(lambda: bool(idle(stream)), 5.0, "allreduce")
    assert y.tolist() == x.tolist()
    with pytest.raises(ValueError, match="count must be >= 0"):
        comm.allreduce(x.ctypes.data, y.ctypes.data, -1, 0, 0, stream)
    with pytest.raises(ValueError, match="int16 has no NCCL type"):
        comm.allreduce(x.ctypes.data, y.ctypes.data, 8, 8, 0, stream)
    with pytest.raises(Exception, match="completion query failed: .*boom"):
        comm.wait(lambda: (_ for _ in ()).throw(RuntimeError("boom")), 5.0, "allreduce")
    assert comm.aborted
    with pytest.raises(AbortedError, match="no longer usable"):
        comm.allreduce(x.ctypes.data, y.ctypes.data, 8, 0, 0, stream)
    comm.abort()


# ---- communicator(): the unique id shared over rumor's own collectives -------------------------

def _shared_id_rank():
    """Each rank records what communicator() would create (the fake cannot join processes), then
    makes a real one-rank communicator over its own group."""
    import rumor
    from rumor.gpu import nccl

    rumor.init()
    try:
        lib = nccl.load()  # cached in rumor's state: communicator() below reuses it
        made = []

        class _Recorder:
            def NcclCommunicator(self, lib, uid, nranks, rank, timeout):
                made.append((uid, nranks, rank, timeout))
                return None

        real = nccl._extension
        nccl._extension = lambda: _Recorder()
        try:
            nccl.communicator(timeout=7.0)
        finally:
            nccl._extension = real
        lib_cached = nccl.load() is lib
        solo = [rumor.new_group([r]) for r in range(rumor.size())][rumor.rank()]
        comm = nccl.communicator(solo)
        out = (made, lib_cached, comm.size, comm.rank)
        comm.close()
        return out
    finally:
        rumor.shutdown()


def _failing_rank():
    import rumor
    from rumor.gpu import nccl

    rumor.init()
    try:
        nccl.communicator()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    finally:
        rumor.shutdown()
    return None


def test_communicator_shares_one_unique_id_over_the_group():
    _ext()
    fake = _fake_path()
    (made0, cached0, size0, rank0), (made1, cached1, size1, rank1) = harness.run(
        _shared_id_rank, 2, timeout=90, env={"RUMOR_NCCL_LIBRARY": fake})
    assert len(made0) == len(made1) == 1
    uid0, n0, r0, t0 = made0[0]
    uid1, n1, r1, t1 = made1[0]
    assert len(uid0) == 128 and uid0 == uid1 and any(uid0)
    assert (n0, r0, n1, r1) == (2, 0, 2, 1)
    assert t0 == t1 == 7.0
    assert cached0 and cached1
    assert (size0, rank0, size1, rank1) == (1, 0, 1, 0)


def test_a_rank_without_nccl_fails_every_rank():
    _ext()
    fake = _fake_path()
    r0, r1 = harness.run(_failing_rank, 2, timeout=90, env={"RUMOR_NCCL_LIBRARY": fake},
                         rank_env=[None, {"RUMOR_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"}])
    assert r1[0] == "RumorError" and "/nonexistent/libnccl.so.2 (file not found)" in r1[1], r1
    assert r0[0] == "RumorError" and "could not be loaded on every rank" in r0[1], r0
