"""The runtime API: init / shutdown life cycle, rank queries, launcher environments, defaults,
the exception hierarchy. Everything that initializes rumor runs in spawned ranks."""
from __future__ import annotations

import os
import tempfile
import time

import pytest

import harness
from harness import Checker


def test_exception_hierarchy():
    import rumor
    from rumor import errors

    assert issubclass(rumor.RumorError, RuntimeError)
    for cls in (rumor.CommTimeoutError, rumor.PeerError, rumor.ProtocolError, rumor.AbortedError):
        assert issubclass(cls, rumor.RumorError)
    assert issubclass(rumor.CommTimeoutError, TimeoutError)
    assert issubclass(rumor.PeerError, ConnectionError)
    assert issubclass(errors._InvalidArgument, ValueError) and issubclass(errors._InvalidArgument, rumor.RumorError)


def test_extension_exports_its_init_alone():
    """A compiler that links libstdc++ statically (the GPU machine's) put a second copy of it in
    the extension; exported, its symbols mixed with torch's libstdc++ and the first number
    formatted into a stream crashed (docs/gpu.md). csrc/bindings/exports.map keeps it private."""
    import shutil
    import subprocess

    import rumor._C

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) on this machine")
    out = subprocess.run([nm, "-D", "--defined-only", rumor._C.__file__], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert names == ["PyInit__C"], f"{len(names)} exported: {names[:10]}"


def test_reduce_op_and_version():
    import rumor

    assert [op.name for op in rumor.ReduceOp] == ["SUM", "AVG", "MIN", "MAX", "PROD"]
    assert isinstance(rumor.__version__, str) and rumor.__version__
    assert not rumor.is_initialized()


@pytest.mark.parametrize("case", ["contiguous", "transposed", "tracked", "dtype", "bfloat16"])
def test_copy_into_equals_copy_(case):
    # The gradient-to-bucket copy takes libc's path only for plain contiguous tensors; every
    # case must land exactly what Tensor.copy_ lands.
    import torch

    from rumor._tensor import copy_into

    g = torch.Generator().manual_seed(3)
    src = torch.randn(257, 129, generator=g)
    dst = torch.full((257, 129), float("nan"))
    if case == "transposed":
        src = torch.randn(129, 257, generator=g).t()
    elif case == "tracked":
        src.requires_grad_(True)
    elif case == "dtype":
        src = src.double()
    elif case == "bfloat16":
        src, dst = src.bfloat16(), dst.bfloat16()
    want = torch.empty_like(dst).copy_(src.detach())
    with torch.no_grad():
        copy_into(dst, src)
    assert torch.equal(dst, want)


def lifecycle_rank(sync_dir):
    import torch

    import rumor

    chk = Checker()
    n = int(os.environ["WORLD_SIZE"])
    r = int(os.environ["RANK"])
    x = torch.ones(3)

    # Before init: every query and collective raises RuntimeError.
    chk.check(not rumor.is_initialized(), "is_initialized() before init")
    for name, call in {
        "rank": rumor.rank, "size": rumor.size, "local_rank": rumor.local_rank, "local_size": rumor.local_size,
        "machine_rank": rumor.machine_rank, "machine_size": rumor.machine_size,
        "allreduce": lambda: rumor.allreduce(x), "allreduce_": lambda: rumor.allreduce_(x.clone()),
        "allreduce_nonblocking": lambda: rumor.allreduce_nonblocking(x),
        "broadcast": lambda: rumor.broadcast(x, 0), "reduce": lambda: rumor.reduce(x, 0),
        "allgather": lambda: rumor.allgather(x), "reduce_scatter": lambda: rumor.reduce_scatter(x),
        "alltoall": lambda: rumor.alltoall(x.reshape(3, 1).repeat(n, 1)), "barrier": rumor.barrier,
        "send": lambda: rumor.send(x, 0), "recv": lambda: rumor.recv(x.clone(), 0),
        "new_group": lambda: rumor.new_group([0]),
    }.items():
        chk.raises(RuntimeError, call, f"{name}() before init", match="init")
    rumor.shutdown()  # harmless when not initialized

    # Bad init arguments: ValueError, and the process can still init afterwards.
    chk.raises(ValueError, lambda: rumor.init(timeout=0), "init(timeout=0)")
    chk.raises(ValueError, lambda: rumor.init(timeout=-5), "init(timeout=-5)")
    chk.check(not rumor.is_initialized(), "is_initialized() after a failed init")

    for cycle in range(3):
        kwargs = [{}, {"socket_streams": 3, "shm": False}, {"timeout": 20.0}][cycle]
        rumor.init(**kwargs)
        chk.check(rumor.is_initialized(), f"cycle {cycle}: is_initialized() after init")
        chk.check((rumor.rank(), rumor.size()) == (r, n), f"cycle {cycle}: rank/size {rumor.rank()}/{rumor.size()}")
        chk.raises(RuntimeError, lambda: rumor.init(), f"cycle {cycle}: a second init()", match="already")
        chk.check(rumor.is_initialized(), f"cycle {cycle}: the failed second init() shut rumor down")
        # Default op is AVG; out-of-place results are new tensors.
        t = torch.full((5,), float(r * 2))
        out = rumor.allreduce(t)
        chk.equal(out, torch.full((5,), float(n - 1)), f"cycle {cycle}: allreduce default op (AVG)")
        chk.check(out.data_ptr() != t.data_ptr(), f"cycle {cycle}: allreduce returned its input's storage")
        chk.equal(rumor.reduce_scatter(torch.full((2 * n,), float(r * 2))), torch.full((2,), float(n - 1)),
                  f"cycle {cycle}: reduce_scatter default op (AVG)")
        red = rumor.reduce(torch.full((2,), float(r * 2)), 0)
        chk.equal(red, torch.full((2,), float(n - 1) if r == 0 else float(r * 2)), f"cycle {cycle}: reduce default op")
        b = rumor.broadcast(t, 0)
        chk.check(b.data_ptr() != t.data_ptr(), f"cycle {cycle}: broadcast returned its input's storage")
        chk.equal(rumor.allgather(torch.tensor(float(r))), torch.arange(n, dtype=torch.float32),
                  f"cycle {cycle}: allgather of 0-dim tensors")
        g = rumor.new_group(list(range(n)))
        chk.check(g.id >= 1 and g.ranks == list(range(n)), f"cycle {cycle}: {g!r}")
        chk.equal(rumor.allreduce(torch.ones(2), rumor.ReduceOp.SUM, group=g), torch.full((2,), float(n)),
                  f"cycle {cycle}: group allreduce")
        h = rumor.allreduce_nonblocking(torch.ones(2), rumor.ReduceOp.SUM)
        chk.equal(h.wait(timeout=60), torch.full((2,), float(n)), f"cycle {cycle}: Handle.wait(timeout=)")
        chk.check(h.poll(), f"cycle {cycle}: Handle.poll() after wait")
        rumor.barrier()
        rumor.shutdown()
        # Every rank shuts down before any re-inits: the uncoordinated case is a known library
        # race of its own (test_reinit_while_rank0_has_not_shut_down_yet).
        harness.file_barrier(sync_dir, f"cycle{cycle}")
        chk.check(not rumor.is_initialized(), f"cycle {cycle}: is_initialized() after shutdown")
        chk.raises(RuntimeError, lambda: rumor.allreduce(x), f"cycle {cycle}: allreduce after shutdown")
    return chk.failures, chk.count


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_lifecycle(world_size):
    """Before init everything raises RuntimeError; init twice raises; shutdown then init again
    works (three times, with different options) in the same processes."""
    with tempfile.TemporaryDirectory() as d:
        res = harness.run(lifecycle_rank, world_size, timeout=120, args=(d,))
    harness.assert_no_failures(res)


# ---- launcher environments ------------------------------------------------------------------------

LAUNCHER_STYLES = ["mpirun", "pmi", "slurm", "none"]


def launcher_env_rank(styles_run, sync_dir):
    """rumor.init() reads mpirun (Open MPI), MPICH/PMI and Slurm variables as well as torchrun's;
    with none of them ("none"), a world of one. Runs the named styles in order; returns
    {style: (failures, count)}."""
    import torch

    import rumor

    chk = Checker()
    r, n = int(os.environ.pop("RANK")), int(os.environ.pop("WORLD_SIZE"))
    styles = {
        "mpirun": {"OMPI_COMM_WORLD_RANK": r, "OMPI_COMM_WORLD_SIZE": n, "OMPI_COMM_WORLD_LOCAL_SIZE": n},
        "pmi": {"PMI_RANK": r, "PMI_SIZE": n},
        "slurm": {"SLURM_PROCID": r, "SLURM_NTASKS": n},
    }
    out = {}
    for style in styles_run:
        f0, c0 = len(chk.failures), chk.count
        if style == "none":
            # Nothing at all: a world of one.
            rumor.init()
            chk.check((rumor.rank(), rumor.size()) == (0, 1), f"no launcher: rank/size {rumor.rank()}/{rumor.size()}")
            chk.equal(rumor.allreduce(torch.tensor([5.0])), torch.tensor([5.0]), "no launcher: allreduce")
            rumor.shutdown()
            # the other ranks may still be in a world of their own: none joins another's
            harness.file_barrier(sync_dir, style, rank=r, world=n)
            out[style] = (chk.failures[f0:], chk.count - c0)
            continue
        env = styles[style]
        os.environ.update({k: str(v) for k, v in env.items()})
        rumor.init()
        chk.check((rumor.rank(), rumor.size()) == (r, n), f"{style}: rank/size {rumor.rank()}/{rumor.size()}")
        chk.equal(rumor.allreduce(torch.tensor([r + 1]), rumor.ReduceOp.SUM), torch.tensor([n * (n + 1) // 2]),
                  f"{style}: allreduce")
        rumor.barrier()
        rumor.shutdown()
        harness.file_barrier(sync_dir, style, rank=r, world=n)  # see lifecycle_rank
        for k in env:
            del os.environ[k]
        out[style] = (chk.failures[f0:], chk.count - c0)
    return out


@pytest.mark.parametrize("style", LAUNCHER_STYLES)
def test_launcher_environments(style, request, batches):
    """One test id per launcher's variables; the selected ones run in one launch of 2 ranks."""
    def launch():
        with tempfile.TemporaryDirectory() as d:
            return harness.run(launcher_env_rank, 2, timeout=120, args=(harness.selected(request, "style"), d))

    res = harness.batch(batches, "launcher environments", launch)
    assert harness.assert_no_failures(harness.scenario_results(res, style), style) > 0


def test_rank_outside_world_is_rejected():
    res = harness.run(bad_rank_rank, 1, timeout=60)
    harness.assert_no_failures(res)


def bad_rank_rank():
    import rumor

    chk = Checker()
    os.environ.update(RANK="3", WORLD_SIZE="2")
    chk.raises(ValueError, rumor.init, "init() with RANK=3 WORLD_SIZE=2")
    chk.check(not rumor.is_initialized(), "is_initialized() after a rejected init")
    return chk.failures, chk.count


def rank0_shuts_down_last_rank(sync_dir: str):
    """Rank 0 (which hosts the TCPStore when no launcher agent does) is the last to call
    shutdown(): the other ranks are already inside their next init() by then."""
    import torch

    import rumor

    chk = Checker()
    r = int(os.environ["RANK"])
    n = int(os.environ["WORLD_SIZE"])
    for cycle in range(2):
        rumor.init()
        chk.equal(rumor.allreduce(torch.ones(3), rumor.ReduceOp.SUM), torch.full((3,), float(n)),
                  f"cycle {cycle}: allreduce")
        rumor.barrier()
        if r == 0:
            harness.file_barrier_wait(sync_dir, f"reinit{cycle}", [q for q in range(1, n)])
            # Give the others a moment to reach the store. Without the bug this test passes
            # however long that takes; with it, it can only fail when they got there first.
            time.sleep(1.0)
        else:
            harness.file_barrier_arrive(sync_dir, f"reinit{cycle}")
        rumor.shutdown()
    rumor.init()
    chk.equal(rumor.allreduce(torch.ones(3), rumor.ReduceOp.SUM), torch.full((3,), float(n)), "final allreduce")
    rumor.barrier()
    rumor.shutdown()
    return chk.failures, chk.count


def test_reinit_while_rank0_has_not_shut_down_yet(tmp_path):
    """shutdown() + init() needs no coordination between ranks: a rank may start its next init()
    before rank 0 has left the previous one."""
    res = harness.run(rank0_shuts_down_last_rank, 3, timeout=90, args=(str(tmp_path),), env={"RUMOR_TIMEOUT": "10"})
    harness.assert_no_failures(res)
