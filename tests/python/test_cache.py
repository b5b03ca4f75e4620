"""rumor.data.CachedDataset / CacheLoader against a real redis-server and the /dev/shm backend.

The reference is always the uncached dataset: every value read through the cache must be
bit-identical to dataset[i], whatever the cache did (hit, miss, eviction, corrupt value,
server killed). Every redis-server started here is bound to loopback and stopped in a finally.
"""
from __future__ import annotations

import glob
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch

import harness
from rumor.data import CachedDataset, CacheLoader, CacheWarning
from rumor.data import _codec
from rumor.data.cache import owner_of

HAVE_REDIS_SERVER = shutil.which("redis-server") is not None
try:
    import redis  # noqa: F401

    HAVE_REDIS_PY = True
except ImportError:
    HAVE_REDIS_PY = False
needs_redis = pytest.mark.skipif(not (HAVE_REDIS_SERVER and HAVE_REDIS_PY),
                                 reason="redis-server (apt-get install redis-server) and redis-py (pip install redis) "
                                        "are needed; scripts/setup.sh installs both")


# ---- datasets ---------------------------------------------------------------------------------------

class Samples:
    """Deterministic samples of mixed structure; counts how often each index was computed."""

    def __init__(self, n=40, width=16):
        self.n, self.width = n, width
        self.calls = [0] * n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.calls[i] += 1
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(self.width, 3, generator=g)
        return (x, {"label": i % 7, "weight": 0.5 + i, "name": f"s{i}", "half": x[:, 0].to(torch.bfloat16)},
                [np.arange(i, i + 3, dtype=np.int16), None, True])


class Big:
    """Samples of `kib` KiB of float32 each."""

    def __init__(self, n, kib):
        self.n, self.kib = n, kib

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.arange(self.kib * 256, dtype=torch.float32) * 0.25 + i


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def epoch(ds, ref, order=None):
    for i in order if order is not None else range(len(ds)):
        got = ds[i]
        assert same(got, ref[i]), f"sample {i} differs from the uncached dataset"
    ds.on_epoch_end()


# ---- servers ----------------------------------------------------------------------------------------

@pytest.fixture
def servers():
    """Starts RedisServer instances on loopback addresses; all stopped at the end."""
    from rumor.data._redis_server import RedisServer

    started = []

    def start(host="127.0.0.1", capacity=64 << 20):
        s = RedisServer(host, capacity).start()
        started.append(s)
        return s

    try:
        yield start
    finally:
        for s in started:
            s.stop()


def client(endpoint):
    import redis

    return redis.Redis(endpoint["host"], endpoint["port"], password=endpoint["password"], socket_timeout=2)


def gone(pid: int, timeout: float = 10.0) -> bool:
    """True once pid no longer runs (a zombie left for a non-reaping init counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


# The dataset names of this module's local-backend tests: only their directories are looked at, so
# another test's cache made at the same time (pytest-xdist runs other modules beside this one) is not
# taken for a leftover of these.
_LOCAL_NAMES = ("loc", "loc-ev", "share", "copy")


def my_shm_dirs():
    # the cache directories: in the private directory (/dev/shm/rumor-<uid>), or /dev/shm itself before
    found = set()
    for root in ("/dev/shm", f"/dev/shm/rumor-{os.geteuid()}"):
        for name in _LOCAL_NAMES:
            found |= set(glob.glob(f"{root}/rumor-cache-{name}-[0-9]*-*"))
    return found


# ---- value format -----------------------------------------------------------------------------------

def test_codec_roundtrip_exact():
    x = torch.randn(5, 6)
    values = [
        torch.tensor(3.5), torch.empty(0, 4), x.t(), x[:, 1:4], torch.arange(10, dtype=torch.int64),
        torch.tensor([True, False]), x.to(torch.bfloat16), x.to(torch.float16), x.double(),
        torch.randn(3, dtype=torch.complex64), torch.randint(0, 255, (7,), dtype=torch.uint8),
        np.arange(12, dtype=np.float64).reshape(3, 4), np.zeros((0,), np.int8),
        (1, -2 ** 70, 2.5, "héllo", b"\x00raw", None, False), [[], {}, ()], {"a": [x], 3: "b"},
    ]
    for v in values:
        out = _codec.decode(_codec.encode(v))
        assert same(out, v), v
    t = _codec.decode(_codec.encode(x))
    t.add_(1)  # a decoded tensor is writable and its own memory
    assert not torch.equal(t, x)


def test_codec_rejects_corruption():
    data = _codec.encode((torch.arange(6.0), {"k": "v"}))
    for n in range(len(data)):  # every truncation
        with pytest.raises(_codec.CorruptValue):
            _codec.decode(data[:n])
    for pos in (0, 5, 10, len(data) - 1):  # flipped bytes in header and payload
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        with pytest.raises(_codec.CorruptValue):
            _codec.decode(bytes(bad))
    with pytest.raises(_codec.CorruptValue):
        _codec.decode(data + b"x")


def test_codec_pickle_only_when_allowed(tmp_path):
    from fractions import Fraction

    with pytest.raises(TypeError, match="allow_pickle"):
        _codec.encode(Fraction(1, 3))
    assert _codec.decode(_codec.encode([Fraction(1, 3)], allow_pickle=True), allow_pickle=True) == [Fraction(1, 3)]
    poison = _poisoned_value(tmp_path / "pwned")
    with pytest.raises(_codec.PickleRefused):
        _codec.decode(poison)
    assert not (tmp_path / "pwned").exists()


class _Poison:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _poisoned_value(path) -> bytes:
    """A well-formed value (right magic, length and checksum) whose pickled item runs code."""
    return _codec.encode(_Poison(path), allow_pickle=True)


# ---- key placement ----------------------------------------------------------------------------------

def test_rendezvous_hashing_moves_only_the_changed_share():
    keys = [f"rumor:ds:i{i}".encode() for i in range(6000)]
    four = [f"10.0.0.{h}:6379".encode() for h in range(1, 5)]
    five = four + [b"10.0.0.5:6379"]
    before = [owner_of(k, four) for k in keys]
    after = [owner_of(k, five) for k in keys]
    moved = [i for i in range(len(keys)) if before[i] != after[i]]
    assert all(after[i] == 4 for i in moved), "a key moved between two hosts that were there before and after"
    assert 0.15 < len(moved) / len(keys) < 0.25  # ~1/5 of the keys go to the new host
    # Removing host 2 moves exactly the keys it owned, and nothing else.
    three = [h for j, h in enumerate(four) if j != 2]
    idx = [0, 1, 3]
    for k, b in zip(keys, before):
        a = idx[owner_of(k, three)]
        assert a == b or b == 2
    counts = np.bincount(before, minlength=4)
    assert counts.min() > 0.8 * len(keys) / 4  # balanced


# ---- redis backend ----------------------------------------------------------------------------------

@needs_redis
def test_redis_hits_and_misses():
    ref, base = Samples(), Samples()
    with CachedDataset(base, backend="redis", dataset_name="hm", writer_buffer_size=8) as ds:
        pid = ds.cache_loader.server_pid
        assert pid is not None
        epoch(ds, ref)
        s = ds.stats()
        assert (s["misses"], s["hits"], s["writes"], s["pending"]) == (40, 0, 40, 0)
        assert ds.num_keys() == 40
        epoch(ds, ref, order=list(reversed(range(40))))
        s = ds.stats()
        assert (s["misses"], s["hits"], s["errors"], s["corrupt"], s["dropped_writes"]) == (40, 40, 0, 0, 0)
        assert base.calls == [1] * 40  # epoch 2 computed nothing
        assert ds[-1] is not None and base.calls[-1] == 1  # negative index: same key
        with pytest.raises(IndexError):
            ds[40]
    assert gone(pid, 5), "redis-server still runs after close()"


@needs_redis
def test_redis_two_hosts_share_and_shard(servers):
    a, b = servers("127.0.0.1"), servers("127.0.0.2")
    hosts = [a.endpoint(), b.endpoint()]
    ref = Samples()
    base_a, base_b = Samples(), Samples()
    # Two "hosts": each has its own dataset object and the same list of servers.
    with CachedDataset(base_a, hosts=hosts, dataset_name="two", writer_buffer_size=5) as da, \
            CachedDataset(base_b, hosts=hosts, dataset_name="two", writer_buffer_size=5) as db:
        epoch(da, ref, order=range(0, 40, 2))  # host A computes the even samples
        epoch(db, ref, order=range(1, 40, 2))  # host B the odd ones
        epoch(da, ref)
        epoch(db, ref)
        assert da.stats()["hits"] == 40 and db.stats()["hits"] == 40  # each reads the other's writes
        assert base_a.calls == [1, 0] * 20 and base_b.calls == [0, 1] * 20
        ca, cb = client(hosts[0]), client(hosts[1])
        ids = [f"{h['host']}:{h['port']}".encode() for h in hosts]
        on_a = on_b = 0
        for i in range(40):
            k = f"rumor:two:i{i}".encode()
            owner = owner_of(k, ids)
            assert (ca.exists(k), cb.exists(k)) == ((1, 0) if owner == 0 else (0, 1)), f"key {i} not on its owner"
            on_a += owner == 0
            on_b += owner == 1
        assert on_a > 0 and on_b > 0
        assert da.num_keys() == 40
        ca.close()
        cb.close()


@needs_redis
def test_redis_eviction_keeps_values_correct():
    n, kib = 150, 64  # ~9.6 MiB of values into 4 MiB
    ref, base = Big(n, kib), Big(n, kib)
    with CachedDataset(base, backend="redis", dataset_name="ev", writer_buffer_size=10,
                       capacity_per_node=4 << 20) as ds:
        for _ in range(2):
            epoch(ds, ref)
        s = ds.stats()
        info = client(_endpoint_of(ds)).info("stats")
        assert info["evicted_keys"] > 0
        assert 0 < ds.num_keys() < n
        assert s["errors"] == 0 and s["dropped_writes"] == 0 and s["corrupt"] == 0
        assert s["hits"] + s["misses"] == 2 * n and s["misses"] > n  # evicted samples were recomputed


def _endpoint_of(ds):
    return ds.cache_loader._backend.endpoints[0]


@needs_redis
def test_redis_server_killed_mid_epoch():
    n = 40
    ref = Samples(n)
    ds = CachedDataset(Samples(n), backend="redis", dataset_name="kill", writer_buffer_size=4, max_pending_writes=8)
    try:
        pid = ds.cache_loader.server_pid
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(n):
                if i == 20:
                    os.kill(pid, signal.SIGKILL)
                    assert gone(pid, 5)
                assert same(ds[i], ref[i]), f"sample {i}"
            ds.on_epoch_end()
            s = ds.stats()
            assert s["errors"] >= 1
            assert s["writes"] == 20  # samples 0..19 made it before the kill, none after
            assert s["pending"] == 8  # the buffer is bounded ...
            assert s["dropped_writes"] == 20 - 8  # ... by dropping the oldest, counted
            epoch(ds, ref)  # training goes on; every sample is recomputed
        s = ds.stats()
        assert s["misses"] == 80 and s["hits"] == 0 and s["writes"] == 20
        assert s["pending"] == 8 and s["dropped_writes"] == 60 - 8
        msgs = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
        assert any("failed" in m for m in msgs) and any("dropped" in m for m in msgs), msgs
        assert len(msgs) <= 5 < s["errors"] + s["dropped_writes"]  # reported once per kind, counted every time
    finally:
        ds.close()
    assert ds.stats()["dropped_writes"] == 60  # the 8 still pending at close are counted too


@needs_redis
def test_redis_corrupt_values_rejected_and_recomputed(tmp_path):
    ref, base = Samples(), Samples()
    with CachedDataset(base, backend="redis", dataset_name="bad", writer_buffer_size=40) as ds:
        epoch(ds, ref)
        c = client(_endpoint_of(ds))
        good = c.get(b"rumor:bad:i4")
        c.set(b"rumor:bad:i3", b"garbage that is not a cache value")
        flipped = bytearray(good)
        flipped[-1] ^= 1
        c.set(b"rumor:bad:i4", bytes(flipped))
        c.set(b"rumor:bad:i5", good[:-3])
        c.set(b"rumor:bad:i6", _poisoned_value(tmp_path / "pwned"))  # a poisoned cache runs no code
        with pytest.warns(CacheWarning):
            epoch(ds, ref)
        assert not (tmp_path / "pwned").exists()
        s = ds.stats()
        assert s["corrupt"] == 4 and s["hits"] == 36
        assert [base.calls[i] for i in (2, 3, 4, 5, 6, 7)] == [1, 2, 2, 2, 2, 1]
        ds.flush()
        assert c.get(b"rumor:bad:i4") == good  # rewritten with the recomputed value
        epoch(ds, ref)
        assert ds.stats()["hits"] == 76
        c.close()


@needs_redis
def test_redis_pickle_only_when_allowed():
    from fractions import Fraction

    class Fractions:
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return {"x": Fraction(i, 7), "t": torch.tensor([i])}

    with CachedDataset(Fractions(), backend="redis", dataset_name="pk") as ds:
        with pytest.raises(TypeError, match="allow_pickle"):
            ds[0]
    with CachedDataset(Fractions(), backend="redis", dataset_name="pk2", allow_pickle=True) as ds:
        epoch(ds, Fractions())
        epoch(ds, Fractions())
        assert ds.stats()["hits"] == 3


@needs_redis
def test_cache_loader_api():
    with CacheLoader(backend="redis", dataset_name="loader", writer_buffer_size=1) as cl:
        calls = []

        def load(k):
            calls.append(k)
            return torch.full((3,), float(len(k)))

        assert torch.equal(cl.get("ab", load), torch.full((3,), 2.0))
        assert torch.equal(cl.get("ab", load), torch.full((3,), 2.0))
        assert cl.get(b"ab", lambda k: 7) == 7  # bytes, str and int keys are distinct
        assert calls == ["ab"] and cl.num_keys() == 2
        with pytest.raises(TypeError, match="key"):
            cl.get(1.5, load)
    for bad, match in [(dict(dataset_name=""), "dataset_name"), (dict(dataset_name="x", backend="mem"), "backend"),
                       (dict(dataset_name="x", writer_buffer_size=0), "writer_buffer_size"),
                       (dict(dataset_name="x", hosts=[{"host": "h"}]), "hosts"),
                       (dict(dataset_name="x", capacity_per_node=-1), "capacity_per_node")]:
        with pytest.raises(ValueError, match=match):
            CacheLoader(**bad)


@needs_redis
def test_redis_dataloader_workers_write_back():
    """Values computed in DataLoader worker processes reach the cache when the workers exit."""
    ref = Samples(24)
    with CachedDataset(Samples(24), backend="redis", dataset_name="dl", writer_buffer_size=100) as ds:
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                             multiprocessing_context="fork")
        for _ in range(2):
            for i, v in enumerate(loader):
                assert same(v, torch.utils.data.default_convert(ref[i]))
            assert ds.num_keys() == 24


_CHILD = textwrap.dedent("""
    import sys, time, torch
    from rumor.data import CachedDataset
    r = CachedDataset([torch.ones(2)] * 4, backend="redis", dataset_name="child")
    l = CachedDataset([torch.ones(2)] * 4, backend="local", dataset_name="child")
    r[0]; l[0]; r.flush(); l.flush()
    print(r.cache_loader.server_pid, l.cache_loader.local_path, flush=True)
    if sys.argv[1] == "hang":
        time.sleep(120)
""")


@needs_redis
@pytest.mark.parametrize("how", ["exit", "sigkill", "sigterm"])
def test_server_and_shm_released_when_the_owner_ends(how):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.Popen([sys.executable, "-c", _CHILD, "exit" if how == "exit" else "hang"], env=env,
                         stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().split()
        assert len(line) == 2, f"child printed {line}"
        pid, path = int(line[0]), line[1]
        if how != "exit":
            assert not gone(pid, 0.2) and os.path.isdir(path)
            p.send_signal(signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
        assert p.wait(30) is not None
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    assert gone(pid), f"redis-server {pid} outlived its owner ({how})"
    deadline = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(path), f"{path} left behind ({how})"


# ---- the local backend ------------------------------------------------------------------------------

def test_local_hits_misses_eviction_corruption():
    before = my_shm_dirs()
    ref, base = Samples(), Samples()
    with CachedDataset(base, backend="local", dataset_name="loc", writer_buffer_size=8) as ds:
        path = ds.cache_loader.local_path
        assert path.startswith("/dev/shm/")
        epoch(ds, ref)
        epoch(ds, ref)
        s = ds.stats()
        assert (s["misses"], s["hits"], s["errors"]) == (40, 40, 0) and base.calls == [1] * 40
        # Corrupt one stored value and replace another with a foreign file: both recomputed.
        files = sorted(glob.glob(os.path.join(path, "k-*")))
        assert len(files) == 40
        with open(files[0], "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
        with open(files[1], "wb") as f:
            f.write(b"junk")
        with pytest.warns(CacheWarning):
            epoch(ds, ref)
        assert ds.stats()["corrupt"] == 2
    assert my_shm_dirs() == before

    n, kib = 60, 64
    with CachedDataset(Big(n, kib), backend="local", dataset_name="loc-ev", capacity_per_node=1 << 20,
                       writer_buffer_size=4) as ds:
        for _ in range(2):
            epoch(ds, Big(n, kib))
        assert 0 < ds.num_keys() < n
        assert ds.cache_loader._backend.store.total_bytes() <= 1 << 20
        s = ds.stats()
        assert s["hits"] + s["misses"] == 2 * n and s["misses"] > n and s["errors"] == 0
    assert my_shm_dirs() == before


def _ranks_share(backend: str):
    """Rank 0 computes the even samples, rank 1 the odd ones; then each reads everything."""
    import rumor
    import rumor.data

    rumor.init()
    r = rumor.rank()
    ref, base = Samples(), Samples()
    ds = rumor.data.CachedDataset(base, backend=backend, dataset_name="share", writer_buffer_size=3)
    for i in range(r, 40, 2):
        assert same(ds[i], ref[i])
    ds.flush()
    rumor.barrier()
    for i in range(40):
        assert same(ds[i], ref[i])
    s = ds.stats()
    rumor.barrier()
    info = (ds.cache_loader.server_pid, ds.cache_loader.local_path, base.calls, s)
    rumor.barrier()
    ds.close()
    return info


@pytest.mark.parametrize("backend", ["local", pytest.param("redis", marks=needs_redis)])
def test_ranks_of_one_host_share_one_cache(backend):
    before = my_shm_dirs()
    out = harness.run(_ranks_share, 2, timeout=60, args=(backend,))
    for r, (pid, path, calls, s) in enumerate(out):
        assert calls == [1 if i % 2 == r else 0 for i in range(40)], f"rank {r} recomputed shared samples"
        assert s["hits"] == 40 and s["misses"] == 20 and s["errors"] == 0
    if backend == "redis":
        assert out[0][0] is not None and out[1][0] is None  # local rank 0 started the one server
        assert gone(out[0][0])
    else:
        assert out[0][1] == out[1][1]
    assert my_shm_dirs() == before


@pytest.mark.parametrize("backend", ["local", pytest.param("redis", marks=needs_redis)])
def test_a_copy_uses_the_cache_but_does_not_own_it(backend):
    """What a spawned DataLoader worker gets: the same cache, without the server or directory."""
    ref = [torch.full((3,), float(i)) for i in range(5)]
    with CachedDataset(list(ref), backend=backend, dataset_name="copy") as ds:
        epoch(ds, ref)
        copy = pickle.loads(pickle.dumps(ds))
        epoch(copy, ref)
        assert copy.stats()["hits"] == 5 and copy.cache_loader.server_pid is None
        copy.close()
        epoch(ds, ref)  # the owner's cache outlives the copy
        assert ds.stats()["hits"] == 5


def _hosts_share():
    """Two emulated hosts (RUMOR_HOST_ID), one rank each: each starts its host's server on its
    own loopback address and every key lives on its owner only."""
    import redis as redis_py

    import rumor
    import rumor.data

    rumor.init()
    r = rumor.rank()
    assert rumor.machine_size() == 2 and rumor.local_rank() == 0
    ref, base = Samples(), Samples()
    ds = rumor.data.CachedDataset(base, backend="redis", dataset_name="hosts", writer_buffer_size=4)
    for i in range(r, 40, 2):
        assert same(ds[i], ref[i])
    ds.flush()
    rumor.barrier()
    for i in range(40):
        assert same(ds[i], ref[i])
    eps = ds.cache_loader._backend.endpoints
    ids = [f"{e['host']}:{e['port']}".encode() for e in eps]
    placement = []
    for i in range(40):
        k = f"rumor:hosts:i{i}".encode()
        on = [redis_py.Redis(e["host"], e["port"], password=e["password"]).exists(k) for e in eps]
        placement.append((owner_of(k, ids), on))
    out = (ds.cache_loader.server_pid, [e["host"] for e in eps], base.calls, ds.stats(), placement)
    rumor.barrier()
    ds.close()
    return out


@needs_redis
def test_two_emulated_hosts_through_rumor_rendezvous():
    out = harness.run(_hosts_share, 2, timeout=60,
                      rank_env=[{"RUMOR_HOST_ID": "hA", "RUMOR_ADVERTISE_ADDR": "127.0.0.1"},
                                {"RUMOR_HOST_ID": "hB", "RUMOR_ADVERTISE_ADDR": "127.0.0.2"}])
    assert out[0][1] == out[1][1] == ["127.0.0.1", "127.0.0.2"]  # host m's server on host m's address
    for r, (pid, _, calls, s, placement) in enumerate(out):
        assert calls == [1 if i % 2 == r else 0 for i in range(40)]
        assert s["hits"] == 40 and s["errors"] == 0
        assert all(on == [int(o == 0), int(o == 1)] for o, on in placement)
        assert 0 < sum(o for o, _ in placement) < 40
        assert gone(pid)


@needs_redis
def test_loopback_address_for_several_hosts_is_refused(monkeypatch):
    """127.0.1.1 (Debian's /etc/hosts entry for the hostname) must never be handed to other hosts."""
    from rumor.data import cache as C

    class Store:
        def set(self, *a):
            raise AssertionError("nothing may be published")

    monkeypatch.delenv("RUMOR_ADVERTISE_ADDR", raising=False)
    monkeypatch.setattr(C, "_rumor_context", lambda: (Store(), 0, 2, 0, "127.0.1.1", 5.0))
    with pytest.raises(RuntimeError, match="RUMOR_ADVERTISE_ADDR"):
        CacheLoader(backend="redis", dataset_name="loopback-refused")
