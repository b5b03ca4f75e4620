"""torch's generic distributed test class (DistributedTest._DistTestBase) on the backend named
by $BACKEND, as torch's own test/distributed/test_distributed_spawn.py runs it for gloo.

Collected by scripts/torch_suite.py (not by the project's test suite). Every test spawns
$WORLD_SIZE processes that unpickle the test class, which imports this module in each of them:
so `import rumor` (which registers the "rumor" backend) and the feature sets below take effect
in every rank before it calls init_process_group.
"""
from __future__ import annotations

import os

import torch

BACKEND = os.environ["BACKEND"]

if BACKEND == "rumor":
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


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
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

