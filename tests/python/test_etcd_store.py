"""rumor._etcd_store.EtcdStore: the job's store kept in etcd (rumor-run --live --store etcd).

* the same sequence of ops on torch's TCPStore and on the etcd store gives the same results,
  through a PrefixStore as the live protocol and init()'s rendezvous use it (waits that time out
  included: both raise torch's DistStoreError);
* add and compare_set are atomic across processes: concurrent adders end on the exact count and
  each saw a value of its own; concurrent compare_sets on an empty key agree on one winner;
* with three members, killing one changes nothing for the client; with two of three gone (no
  majority) and with all gone, an op fails within its deadline with an error naming the op and
  the endpoints.
Every etcd member here listens on loopback and is stopped at the end of its test.
"""
from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from rumor import _etcd_member, _ports, _rendezvous
from rumor._etcd_store import EtcdStore, EtcdStoreError, parse_endpoints

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd (Debian's etcd-server) is not installed")

WORKER_DEADLINE_S = 60


def _cluster(n):
    peers = [("127.0.0.1", _ports.free_port("127.0.0.1"), _ports.free_port("127.0.0.1")) for _ in range(n)]
    token = f"test-{os.getpid()}-{time.monotonic_ns()}"
    members = [_etcd_member.Member(i, peers, token) for i in range(n)]
    try:
        for m in members:
            m.start()
        endpoints = [m.client_url for m in members]
        _etcd_member.wait_ready(EtcdStore(endpoints, 30.0), members, 30.0)
    except BaseException:
        for m in members:
            m.stop()
        raise
    return members, endpoints


@pytest.fixture(scope="module")
def etcd():
    members, endpoints = _cluster(1)
    yield endpoints
    for m in members:
        m.stop()


def _ops(store, tag):
    """A sequence of store ops (under a prefix, as the live protocol and init() use the store)
    and what each returned or raised."""
    p = _rendezvous.prefixed(store, f"t/{tag}")
    out = []

    def do(name, fn):
        try:
            out.append((name, fn()))
        except dist.DistStoreError as e:
            out.append((name, "DistStoreError" if "timeout" in str(e) else f"other: {e}"))

    do("set", lambda: p.set("a", "1"))
    do("get", lambda: p.get("a"))
    do("set bytes", lambda: p.set("b", b"\x00\xff raw"))
    do("get bytes", lambda: p.get("b"))
    do("add new", lambda: p.add("n", 5))
    do("add more", lambda: p.add("n", 3))
    do("add negative", lambda: p.add("n", -10))
    do("add 0 makes the key", lambda: (p.add("z", 0), p.check(["z"]), p.get("z")))
    do("cas missing, expected set", lambda: (p.compare_set("c", "x", "y"), p.check(["c"])))
    do("cas missing, expected empty", lambda: (p.compare_set("c", "", "y"), p.get("c")))
    do("cas mismatch", lambda: (p.compare_set("c", "q", "w"), p.get("c")))
    do("cas match", lambda: (p.compare_set("c", "y", "w"), p.get("c")))
    do("cas to empty", lambda: (p.compare_set("e", "", ""), p.check(["e"]), p.get("e")))
    do("check some", lambda: (p.check(["a", "n"]), p.check(["a", "nope"]), p.check(["nope"])))
    do("multi_set", lambda: p.multi_set(["m1", "m2"], ["1", b"2"]))
    do("multi_get", lambda: p.multi_get(["m1", "m2", "a"]))
    do("wait present", lambda: p.wait(["a", "m1"]))
    do("wait missing", lambda: p.wait(["a", "never"], datetime.timedelta(seconds=0.3)))
    do("get missing", lambda: p.get("never"))
    # On the store itself, counting keys of this sequence only (the etcd cluster is the module's).
    base = store.num_keys()
    do("set plain", lambda: store.set(f"plain/{tag}", "v"))
    do("num_keys grew", lambda: store.num_keys() - base)
    do("delete", lambda: store.delete_key(f"plain/{tag}"))
    do("delete again", lambda: store.delete_key(f"plain/{tag}"))
    do("num_keys back", lambda: store.num_keys() - base)
    return out


def test_same_results_as_tcpstore(etcd):
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=1))
    ours = EtcdStore(etcd, 1.0)
    try:
        want, got = _ops(tcp, "tcp"), _ops(ours, "etcd")
    finally:
        ours.close()
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, w), (_, g) in zip(want, got):
        assert g == w, f"{name}: TCPStore gave {w!r}, the etcd store {g!r}"


_RACER = textwrap.dedent("""
    import json, sys, datetime
    import torch.distributed as dist
    kind, where, me, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if kind == "tcp":
        host, port = where.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
    else:
        from rumor._etcd_store import EtcdStore
        store = EtcdStore(where.split(","), 30.0)
    if kind == "tcp":
        p = dist.PrefixStore("race", store)
    else:
        p = store.with_prefix("race")
    p.add("go", 1)
    p.wait(["start"])
    seen = [int(p.add("count", 1)) for _ in range(n)]
    won = p.compare_set("winner", "", me).decode()
    print(json.dumps({"seen": seen, "won": won}))
""")


def _race(kind, where, store, procs=3, n=60):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    ps = [subprocess.Popen([sys.executable, "-c", _RACER, kind, where, f"p{i}", str(n)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(procs)]
    try:
        p = _rendezvous.prefixed(store, "race")
        deadline = time.monotonic() + WORKER_DEADLINE_S
        while int(p.add("go", 0)) < procs:  # every racer connected: they start together
            assert time.monotonic() < deadline and all(x.poll() is None for x in ps), [x.communicate() for x in ps]
            time.sleep(0.01)
        p.set("start", "1")
        results = []
        for x in ps:
            out, err = x.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert x.returncode == 0, err[-3000:]
            import json

            results.append(json.loads(out.strip().splitlines()[-1]))
        return results, int(p.add("count", 0)), p.get("winner").decode()
    finally:
        for x in ps:
            if x.poll() is None:
                x.kill()
                x.wait()


@pytest.mark.parametrize("kind", ["tcp", "etcd"])
def test_concurrent_add_and_compare_set_are_atomic(etcd, kind):
    procs, n = 3, 60
    if kind == "tcp":
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
        where = f"127.0.0.1:{store.port}"
    else:
        store = EtcdStore(etcd, 30.0)
        where = ",".join(etcd)
        for k in ("count", "go", "start", "winner"):  # the module's cluster: earlier runs of this test
            store.delete_key(f"race/{k}")
    results, final, winner = _race(kind, where, store, procs, n)
    assert final == procs * n
    # Every add returned a value nobody else saw: 1..procs*n, each once.
    assert sorted(v for r in results for v in r["seen"]) == list(range(1, procs * n + 1))
    assert all(r["seen"] == sorted(r["seen"]) for r in results)
    # compare_set("", me): one racer won, and everybody was told the same winner.
    assert winner in {f"p{i}" for i in range(procs)} and {r["won"] for r in results} == {winner}


def test_a_member_lost_is_not_noticed_and_a_majority_lost_fails_naming_the_endpoints():
    members, endpoints = _cluster(3)
    store = EtcdStore(endpoints, 3.0)
    try:
        store.set("k", "before")
        assert store.add("n", 2) == 2
        members[0].proc.send_signal(signal.SIGKILL)  # the member the client talks to first
        members[0].proc.wait(10)
        store.set_timeout(datetime.timedelta(seconds=20))  # a new leader may need an election
        assert store.get("k") == b"before"
        assert store.add("n", 3) == 5
        assert store.compare_set("k", "before", "after") == b"after"
        members[1].stop()  # one of three left: no majority
        store.set_timeout(datetime.timedelta(seconds=2))
        with pytest.raises(EtcdStoreError) as e:
            store.add("n", 1)
        msg = str(e.value)
        assert "add('n', 1)" in msg and all(ep in msg for ep in endpoints), msg
        members[2].stop()  # none left: refused connections, same error
        with pytest.raises(EtcdStoreError) as e:
            store.get("k")
        assert "get('k')" in str(e.value) and all(ep in str(e.value) for ep in endpoints), str(e.value)
    finally:
        store.close()
        for m in members:
            m.stop()
    assert all(m.dir is None for m in members)


def test_a_member_replaced_through_the_cluster_api_is_found_by_a_client_that_follows():
    """Three members; member 0 is killed, removed and replaced by a member 3 that joins the
    running cluster (_etcd_member.join). Two clients knew only members 0 and 1: once member 1 is
    killed too, the one that follows the membership (it learned members 2 and 3 when it moved
    on from member 0) still reads and writes; the other fails at its deadline naming its
    endpoints. The replacement lock is held by one holder at a time."""
    members, endpoints = _cluster(3)
    store = EtcdStore(endpoints, 20.0)
    following = EtcdStore(endpoints[:2], 20.0, follow=True)
    fixed = EtcdStore(endpoints[:2], 20.0)
    try:
        lease = store.try_lock("lock", 30)
        assert lease is not None and following.try_lock("lock", 30) is None
        store.unlock(lease)
        lease = following.try_lock("lock", 30)
        assert lease is not None
        following.set("k", "before")
        members[0].proc.send_signal(signal.SIGKILL)
        members[0].proc.wait(10)
        assert following.get("k") == b"before" and fixed.get("k") == b"before"
        store.remove_member(next(str(m["ID"]) for m in store.members() if m["name"] == "rumor0"))
        h = "127.0.0.1"
        members.append(_etcd_member.join(store, 3, (h, _ports.free_port(h), _ports.free_port(h)),
                                         members[0].token, None, None, 30.0))
        assert sorted(m["name"] for m in store.members()) == ["rumor1", "rumor2", "rumor3"]
        members[1].stop()
        assert following.add("n", 2) == 2 and following.get("k") == b"before"
        assert following.scan("") == {"k": b"before", "n": b"2", "lock": lease.encode(),
                                      "rumor/etcd-ready": b"1"}
        assert members[3].client_url in following.endpoints and endpoints[0] not in following.endpoints
        fixed.set_timeout(datetime.timedelta(seconds=2))
        with pytest.raises(EtcdStoreError) as e:
            fixed.get("k")
        assert "get('k')" in str(e.value) and all(ep in str(e.value) for ep in endpoints[:2]), str(e.value)
    finally:
        for s in (store, following, fixed):
            s.close()
        for m in members:
            m.stop()


def test_tls_members_take_only_clients_with_a_certificate_of_the_job_ca(tmp_path):
    """A member started with the --tls auto credentials (the job CA; the host certificate names
    127.0.0.1): a client with the host certificate works; one without a client certificate, one
    that does not trust the job CA, and plain http are refused."""
    import ssl

    from rumor import _tlsauto

    creds = _tlsauto.make_credentials(None, "test-etcd-tls", sans=["127.0.0.1"])
    paths = {}
    for kind in ("cert", "key", "ca"):
        paths[kind] = str(tmp_path / f"{kind}.pem")
        with open(os.open(paths[kind], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(creds[kind])
    peers = [("127.0.0.1", _ports.free_port("127.0.0.1"), _ports.free_port("127.0.0.1"))]
    member = _etcd_member.Member(0, peers, f"tls-{os.getpid()}", tls=paths)
    good = ssl.create_default_context(cafile=paths["ca"])
    good.load_cert_chain(paths["cert"], paths["key"])
    stores = []
    try:
        member.start()
        assert member.client_url.startswith("https://127.0.0.1:")
        store = EtcdStore([member.client_url], 30.0, good)
        stores.append(store)
        _etcd_member.wait_ready(store, [member], 30.0)
        store.set("k", "v")
        assert store.get("k") == b"v" and store.add("n", 4) == 4
        no_cert = ssl.create_default_context(cafile=paths["ca"])
        other_ca = ssl.create_default_context()
        for ctx, url in ((no_cert, member.client_url), (other_ca, member.client_url),
                         (None, member.client_url.replace("https://", "http://"))):
            s = EtcdStore([url], 1.0, ctx)
            stores.append(s)
            with pytest.raises(EtcdStoreError):
                s.get("k")
    finally:
        for s in stores:
            s.close()
        member.stop()


def test_parse_endpoints():
    assert parse_endpoints("etcd://h1:2379,h2:2380") == ["http://h1:2379", "http://h2:2380"]
    assert parse_endpoints("https://10.0.0.1:2379, 10.0.0.2:2379") == ["https://10.0.0.1:2379", "https://10.0.0.2:2379"]
    for bad in ("", "etcd://", "h1", "ftp://h:1", "http://h:1/path"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)
