"""The runtime API: init / shutdown life cycle, rank queries, launcher environments, defaults,
the exception hierarchy. Everything that initializes rumor runs in spawned ranks."""
from __future__ import annotations

import os

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


def test_reduce_op_and_version():
    import rumor

    assert [op.name for op in rumor.ReduceOp] == ["SUM", "AVG", "MIN", "MAX", "PROD"]
    assert isinstance(rumor.__version__, str) and rumor.__version__
    assert not rumor.is_initialized()


def lifecycle_rank():
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
        chk.check(not rumor.is_initialized(), f"cycle {cycle}: is_initialized() after shutdown")
        chk.raises(RuntimeError, lambda: rumor.allreduce(x), f"cycle {cycle}: allreduce after shutdown")
    return chk.failures, chk.count


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_lifecycle(world_size):
    """Before init everything raises RuntimeError; init twice raises; shutdown then init again
    works (three times, with different options) in the same processes."""
    res = harness.run(lifecycle_rank, world_size, timeout=120)
    harness.assert_no_failures(res)


# ---- launcher environments ------------------------------------------------------------------------

def launcher_env_rank():
    """rumor.init() reads mpirun (Open MPI), MPICH/PMI and Slurm variables as well as torchrun's."""
    import torch

    import rumor

    chk = Checker()
    r, n = int(os.environ.pop("RANK")), int(os.environ.pop("WORLD_SIZE"))
    styles = {
        "mpirun": {"OMPI_COMM_WORLD_RANK": r, "OMPI_COMM_WORLD_SIZE": n, "OMPI_COMM_WORLD_LOCAL_SIZE": n},
        "pmi": {"PMI_RANK": r, "PMI_SIZE": n},
        "slurm": {"SLURM_PROCID": r, "SLURM_NTASKS": n},
    }
    for style, env in styles.items():
        os.environ.update({k: str(v) for k, v in env.items()})
        rumor.init()
        chk.check((rumor.rank(), rumor.size()) == (r, n), f"{style}: rank/size {rumor.rank()}/{rumor.size()}")
        chk.equal(rumor.allreduce(torch.tensor([r + 1]), rumor.ReduceOp.SUM), torch.tensor([n * (n + 1) // 2]),
                  f"{style}: allreduce")
        rumor.barrier()
        rumor.shutdown()
        for k in env:
            del os.environ[k]
    # Nothing at all: a world of one.
    rumor.init()
    chk.check((rumor.rank(), rumor.size()) == (0, 1), f"no launcher: rank/size {rumor.rank()}/{rumor.size()}")
    chk.equal(rumor.allreduce(torch.tensor([5.0])), torch.tensor([5.0]), "no launcher: allreduce")
    rumor.shutdown()
    return chk.failures, chk.count


def test_launcher_environments():
    res = harness.run(launcher_env_rank, 2, timeout=120)
    harness.assert_no_failures(res)


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
