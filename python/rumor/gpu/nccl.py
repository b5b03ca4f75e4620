"""NCCL for rumor's GPU path, loaded at run time (docs/gpu.md).

rumor links no NCCL: the C++ core dlopen()s one (``_C.NcclLibrary``) from the candidates this
module lists, in this order:

1. ``RUMOR_NCCL_LIBRARY``: a file path (or a name for the loader). When set, it is the only
   candidate: a wrong value is an error, never a silent fall-back to another NCCL.
2. the ``nvidia-nccl-cu*`` wheel torch's CUDA builds depend on (``nvidia/<pkg>/lib/libnccl.so*``),
   found through the ``nvidia`` namespace package's folders without importing torch or CUDA;
3. ``torch/lib/libnccl.so*``, for builds that ship it there (found without importing torch);
4. ``libnccl.so.2`` through the dynamic loader's search path (LD_LIBRARY_PATH, the ld cache,
   or the copy torch already loaded into this process).

The loaded library lives in rumor's runtime state (dropped by rumor.shutdown()); without
rumor.init() each load() opens it afresh.
"""
from __future__ import annotations

import glob
import importlib.util
import math
import os
from typing import List, Optional

ENV_VAR = "RUMOR_NCCL_LIBRARY"
SONAME = "libnccl.so.2"


def _package_dirs(name: str) -> List[str]:
    """The folders of a package, found without importing it (a namespace package may have several)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [str(p) for p in spec.submodule_search_locations]
    return [os.path.dirname(spec.origin)] if spec.origin else []


def _libraries_in(folder: str) -> List[str]:
    """libnccl.so.2 first, then other versioned names (libnccl.so.2.27.3), then libnccl.so."""
    found = sorted(glob.glob(os.path.join(folder, "libnccl.so*")),
                   key=lambda p: (os.path.basename(p) != SONAME, os.path.basename(p) == "libnccl.so", p))
    return [p for p in found if os.path.isfile(p)]


def candidates(env=None) -> List[str]:
    """Where load() looks for NCCL, in order (see the module docstring)."""
    env = os.environ if env is None else env
    override = env.get(ENV_VAR, "").strip()
    if override:
        return [override]
    out: List[str] = []
    # nvidia-nccl-cu12 installs nvidia/nccl/lib; other layouts put it in nvidia/<name>/lib.
    for root in _package_dirs("nvidia"):
        for lib in [os.path.join(root, "nccl", "lib")] + sorted(glob.glob(os.path.join(root, "*", "lib"))):
            out.extend(_libraries_in(lib))
    for root in _package_dirs("torch"):
        out.extend(_libraries_in(os.path.join(root, "lib")))
    out.append(SONAME)
    return list(dict.fromkeys(out))


def find_library(env=None) -> str:
    """The first candidate: RUMOR_NCCL_LIBRARY when set, else the first NCCL file found in the
    nvidia wheel or torch's lib folder, else ``libnccl.so.2`` (left to the loader's search)."""
    return candidates(env)[0]


def _extension():
    from .. import _C

    if not hasattr(_C, "NcclLibrary"):
        raise RuntimeError("this build of rumor's extension has no NCCL support (rumor._C.NcclLibrary is "
                           "missing): reinstall rumor from this source tree")
    return _C


def load():
    """The NCCL library (rumor._C.NcclLibrary), loaded once per rumor.init(). Raises
    rumor.errors.RumorError naming every candidate tried and why each was rejected."""
    from .. import _runtime

    st = _runtime.state() if _runtime.is_initialized() else None
    lib = getattr(st, "nccl", None) if st is not None else None
    if lib is None:
        lib = _extension().NcclLibrary(candidates())
        if st is not None:
            st.nccl = lib
    return lib


def is_available() -> bool:
    """True when rumor can use NCCL here: a usable NCCL library and at least one CUDA device.
    Never raises."""
    try:
        from .. import _C

        if _C.cuda_device_count() < 1:
            return False
        load()
        return True
    except Exception:  # noqa: BLE001 - a probe: any failure means "not available"
        return False


def communicator(group=None, timeout: Optional[float] = None, device: Optional[int] = None):
    """A new rumor._C.NcclCommunicator over `group` (default: the world); every member must call
    it at the same point of its sequence of collectives, like rumor.new_group().

    The group's first rank makes the ncclUniqueId and rumor's own broadcast (on the CPU, over the
    group) hands it to the others: no extra service. Every rank first agrees, through one small
    allreduce, that all of them loaded NCCL, so a rank without NCCL becomes an error on every
    rank instead of a wait for its init. `timeout` (default: rumor's) bounds the creation and
    every later wait of the communicator; `device` (default: torch's current CUDA device when
    CUDA is available) is the GPU NCCL binds the communicator to.
    """
    import contextlib

    import torch

    from .. import _host_collectives as collectives
    from .. import _runtime
    from ..errors import RumorError

    what = "rumor.gpu.nccl.communicator"
    st = _runtime.state()
    g = _runtime.communicator(group, what)
    timeout = st.timeout if timeout is None else float(timeout)
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"{what}: timeout must be positive and finite, got {timeout!r}")

    lib, error = None, None
    try:
        lib = load()
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = e
    loaded = collectives.allreduce(torch.tensor([0 if lib is None else 1], dtype=torch.int32),
                                   collectives.ReduceOp.MIN, group, False, False, "auto", what)
    if error is not None:
        raise error
    if int(loaded.item()) == 0:
        raise RumorError(f"{what}: NCCL could not be loaded on every rank of {g!r}; see those ranks' errors")

    root = g.ranks[0]
    uid = torch.zeros(128, dtype=torch.uint8)
    if st.env.rank == root:
        uid = torch.frombuffer(bytearray(lib.unique_id()), dtype=torch.uint8)
    uid = collectives.broadcast(uid, root, group, False, False, what)

    if device is None and torch.cuda.is_available():
        device = torch.cuda.current_device()
    ctx = torch.cuda.device(device) if device is not None else contextlib.nullcontext()
    with ctx:
        return _extension().NcclCommunicator(lib, uid.numpy().tobytes(), g.size(), g.rank(), timeout)
