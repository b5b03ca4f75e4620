"""TLS 1.3 on the TCP data channels (RUMOR_TLS_*, docs/security.md), two ranks over loopback TCP
(RUMOR_SHM=0, RUMOR_HOST_DIRECT=0: every byte between the ranks goes through a TCP channel).

Collectives and DDP steps with TLS on must give exactly the bytes of the same run without TLS;
a rank whose certificate another CA issued makes every rank fail with an error that says TLS,
and an incomplete RUMOR_TLS_* setting is a ValueError naming what is missing.
"""
from __future__ import annotations

import hashlib

import pytest

import harness
from tls_pki import PEER_NAME
from tls_pki import make_pki as _pki
from tls_pki import tls_env as _tls_env

TCP = {"RUMOR_SHM": "0", "RUMOR_HOST_DIRECT": "0", "RUMOR_STRIPE_MIN_BYTES": str(256 * 1024)}
# The store in clear: a foreign certificate would otherwise be refused at the store's tunnel
# (tests/python/test_store_tls.py) before any data channel checks it.
DATA_ONLY = {"RUMOR_STORE_TLS": "0"}


def _digest(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


# ==== inside a rank ===============================================================================

def rank_workload():
    """Collectives of odd and striped sizes, then a few DDP steps; the digest of every result."""
    import torch

    import rumor

    torch.set_num_threads(1)
    rumor.init()
    try:
        rank = rumor.rank()
        out = {}
        g = torch.Generator().manual_seed(100 + rank)
        for n in (7, 100_003, 3 * 1024 * 1024 + 5):  # recursive doubling, ring, ring striped
            t = torch.randn(n, generator=g, dtype=torch.float32)
            rumor.allreduce_(t, rumor.ReduceOp.SUM)
            out[f"allreduce {n}"] = _digest(t)
        b = torch.randn(2 * 1024 * 1024 + 3, generator=g) if rank == 1 else torch.zeros(2 * 1024 * 1024 + 3)
        rumor.broadcast_(b, 1)
        out["broadcast"] = _digest(b)
        out["allgather"] = _digest(rumor.allgather(torch.randn(333_333, generator=g)))

        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        ddp = rumor.DistributedDataParallel(model, bucket_cap_mb=0.05)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(16, 64, generator=g)
            y = torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        for name, p in model.named_parameters():
            out[f"ddp {name}"] = _digest(p)
        return out
    finally:
        rumor.shutdown()


def rank_allreduce_once():
    import torch

    import rumor

    rumor.init()
    try:
        t = torch.ones(1000)
        rumor.allreduce_(t, rumor.ReduceOp.SUM)
        return float(t[0])
    finally:
        rumor.shutdown()


def rank_torch_backend_allreduce():
    """The same settings through torch.distributed's "rumor" backend (torch_backend.py)."""
    import datetime

    import torch
    import torch.distributed as dist

    import harness
    import rumor  # noqa: F401 (registers the backend)

    dist.init_process_group("rumor", rank=harness.env_rank(), world_size=harness.env_world(),
                            timeout=datetime.timedelta(seconds=20))
    try:
        t = torch.arange(5 * 1024 * 1024, dtype=torch.float32) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return _digest(t)
    finally:
        dist.destroy_process_group()


# ==== test side ===================================================================================

def test_tls_results_are_bit_identical_to_plaintext(tmp_path):
    files = _pki(tmp_path)
    plain = harness.run(rank_workload, 2, timeout=120, env=TCP)
    tls = harness.run(rank_workload, 2, timeout=120, env=TCP, rank_env=[_tls_env(files, r) for r in range(2)])
    assert plain[0] == plain[1]  # every result is the same on both ranks
    assert tls == plain


@pytest.mark.parametrize("foreign_rank", [0, 1])
def test_certificate_of_another_ca_fails_every_rank_naming_tls(tmp_path, foreign_rank):
    files = _pki(tmp_path)
    env = dict(TCP, RUMOR_TIMEOUT="10", **DATA_ONLY)
    res = harness.run(rank_allreduce_once, 2, timeout=60, env=env, raw=True,
                      rank_env=[_tls_env(files, r, foreign=r == foreign_rank) for r in range(2)])
    for r in res:
        assert not r.ok, f"rank {r.rank} succeeded"
        assert "TLS" in r.error or "tls" in r.error, f"rank {r.rank}: {r.error}"
    # The rank that checked the foreign certificate says so.
    checker = res[1 - foreign_rank]
    assert "certificate refused" in checker.error, checker.error


def test_torch_backend_takes_the_tls_settings(tmp_path):
    files = _pki(tmp_path)
    plain = harness.run(rank_torch_backend_allreduce, 2, timeout=90, env=TCP)
    tls = harness.run(rank_torch_backend_allreduce, 2, timeout=90, env=TCP,
                      rank_env=[_tls_env(files, r) for r in range(2)])
    assert tls == plain
    # Proof that the backend's channels do run TLS: a foreign certificate is refused.
    res = harness.run(rank_torch_backend_allreduce, 2, timeout=90, env=dict(TCP, RUMOR_TIMEOUT="10"), raw=True,
                      rank_env=[_tls_env(files, r, foreign=r == 1) for r in range(2)])
    assert not res[0].ok and "certificate refused" in res[0].error, res[0].error


def test_incomplete_tls_settings_are_a_value_error(tmp_path):
    from rumor import _C
    from rumor._env import tls_options_from_env

    files = _pki(tmp_path)
    opts = _C.Options()
    with pytest.raises(ValueError, match="RUMOR_TLS_KEY"):
        tls_options_from_env(opts, {"RUMOR_TLS_CERT": files["cert0.pem"], "RUMOR_TLS_CA": files["ca.pem"]})
    with pytest.raises(ValueError, match="RUMOR_TLS_CERT.*RUMOR_TLS_CA"):
        tls_options_from_env(opts, {"RUMOR_TLS_PEER_NAME": PEER_NAME})
    with pytest.raises(ValueError, match="cannot be read"):
        tls_options_from_env(opts, dict(_tls_env(files, 0), RUMOR_TLS_CA=str(tmp_path / "absent.pem")))
    tls_options_from_env(opts, _tls_env(files, 0))
    assert opts.tls_ca_pem.startswith("-----BEGIN CERTIFICATE-----")
    assert opts.tls_peer_name == PEER_NAME
