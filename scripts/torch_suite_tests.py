"""torch's generic distributed test class (DistributedTest._DistTestBase) on the backend named
by $BACKEND, as torch's own test/distributed/test_distributed_spawn.py runs it for gloo.

Collected by scripts/torch_suite.py (not by the project's test suite). Every test starts
$WORLD_SIZE ranks, forked from the pytest process that imported this module (or, with
TORCH_SUITE_START=spawn, spawned ranks that import it again to unpickle the test class): either
way `import rumor` (which registers the "rumor" backend) and the settings below are in place in
every rank before it calls init_process_group.
"""
from __future__ import annotations

import functools
import inspect
import os

import torch

BACKEND = os.environ["BACKEND"]
# TORCH_SUITE_AS=rumor with BACKEND=gloo: the suite takes its gloo branches (tests it keeps
# for gloo by name: get_future, coalesced MIN/MAX, scatter_object_list, batch_isend_irecv...)
# while every group it makes is rumor's. Tests that check the backend's name, or that torch
# implements for gloo alone (monitored_barrier), fail there by construction.
AS = os.environ.get("TORCH_SUITE_AS", "")

if AS:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    import rumor  # noqa: F401 (registers the backend)

    def _substituted(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            if str(bound.arguments.get("backend")).lower() == BACKEND:
                bound.arguments["backend"] = AS
            return fn(*bound.args, **bound.kwargs)
        return call

    dist.init_process_group = _substituted(c10d.init_process_group)
    dist.new_group = c10d.new_group = _substituted(c10d.new_group)
elif BACKEND == "rumor":
    import rumor  # noqa: F401 (registers the backend)
    from torch.testing._internal.common_distributed import DistTestCases

    # torch decides at import of distributed_test which tests a backend may run, from these
    # sets of backend names: rumor is a plugin (CPU only) that runs DDP on CPU models and
    # subgroups. The CUDA and GPU sets stay without it.
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add(BACKEND)

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestTorchSuite(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._start_ranks()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    def _start_ranks(self):
        # torch's spawn runner re-imports torch and this suite in every rank of every test
        # (about 30 s a test on a loaded 2-core machine); forked ranks start from this
        # process's imports. The parent holds no process group or rumor context, so a fork
        # copies no connection or thread a rank would use.
        if os.environ.get("TORCH_SUITE_START", "fork") == "spawn":
            self._spawn_processes()
        else:
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

