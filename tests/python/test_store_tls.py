"""The store's TLS tunnel (python/rumor/_storetls.py), piece by piece on loopback: a TCPStore
reached through a forwarder and a terminator, what crosses between them (TLS records only),
strangers refused at the terminator, other uids refused at the forwarder, one altered byte
failing the client with the reason, and the close semantics (either end closes both; nothing is
left behind). The two-host job is tests/python/test_store_tls_hosts.py."""
from __future__ import annotations

import datetime
import os
import select
import socket
import ssl
import threading
import time

import pytest

from tls_pki import make_pki
from tls_relay import Relay, tls_records

DEADLINE_S = 30.0


@pytest.fixture
def pki(tmp_path):
    return make_pki(tmp_path, 2)


def _ctx(pki, server, rank, foreign=False):
    from rumor import _storetls

    cert, key = (pki["foreign.pem"], pki["foreign.key"]) if foreign else (pki[f"cert{rank}.pem"], pki[f"key{rank}.pem"])
    return _storetls._context(server, cert, key, pki["ca.pem"])


def _store_server():
    """A TCPStore listening on loopback only, as the launcher hosts it."""
    import torch.distributed as dist

    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=DEADLINE_S),
                          wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.fileno())
    sock.detach()
    return store, port


def _client(port):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, 1, False, datetime.timedelta(seconds=DEADLINE_S), wait_for_workers=False)


def _tunnel_threads():
    return [t for t in threading.enumerate() if t.name.startswith(("terminator", "forwarder")) and t.is_alive()]


def test_a_store_through_the_tunnel_answers_and_only_tls_records_cross(pki, tmp_path):
    from rumor import _storetls

    store, port = _store_server()
    rec = tmp_path / "rec"
    rec.mkdir()
    value = os.urandom(3 << 20)  # past a TLS record and the pump's chunk many times
    with _storetls.Terminator("127.0.0.1", 0, ("127.0.0.1", port), _ctx(pki, True, 0)) as term, \
            Relay(("127.0.0.1", 0), ("127.0.0.1", term.port), record=str(rec)) as relay, \
            _storetls.Forwarder(("127.0.0.1", relay.port), _ctx(pki, False, 1)) as fwd:
        c = _client(fwd.port)
        c.set("rumor/secret-key-name", value)
        assert c.get("rumor/secret-key-name") == value
        assert store.get("rumor/secret-key-name") == value  # the real store holds it
        c.set("small", b"visible-marker-value")
        assert store.get("small") == b"visible-marker-value"
        del c
    assert _tunnel_threads() == []
    files = sorted(rec.iterdir())
    assert files, "nothing crossed the relay"
    for f in files:
        data = f.read_bytes()
        kinds = [k for k, _ in tls_records(data)]  # raises at a byte that is not a TLS record
        # A handshake record (and the compatibility change_cipher_spec) first, then only encrypted records.
        assert kinds[0] == 22 and set(kinds[1:]) <= {20, 23}, (f.name, kinds[:8])
        for needle in (b"secret-key-name", b"visible-marker", value[:32], value[-32:]):
            assert needle not in data, (f.name, needle)


def _refused(tunnel, n: int) -> int:
    """The tunnel's count of refused connections once it reaches n (or the deadline passes): the
    client may see its connection end before the tunnel's thread has counted it."""
    deadline = time.monotonic() + DEADLINE_S
    while tunnel.refused < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return tunnel.refused


def test_strangers_at_the_terminator_are_refused_and_the_store_goes_on(pki):
    from rumor import _storetls

    store, port = _store_server()
    store.set("k", b"the value")
    with _storetls.Terminator("127.0.0.1", 0, ("127.0.0.1", port), _ctx(pki, True, 0)) as term:
        # A plaintext client (a TCPStore client would send this kind of request): closed, nothing learnt.
        with socket.create_connection(("127.0.0.1", term.port), timeout=DEADLINE_S) as s:
            s.sendall(b"\x02\x00\x00\x00\x00\x00\x00\x00\x01k" * 4)
            got = b""
            try:
                while chunk := s.recv(4096):
                    got += chunk
            except ConnectionResetError:
                pass
            assert b"the value" not in got and not got.startswith(b"\x00"), got[:64]
        # TLS clients: without a certificate, and with one of another CA.
        for foreign in (None, True):
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.load_verify_locations(pki["ca.pem"])
            if foreign:
                ctx.load_cert_chain(pki["foreign.pem"], pki["foreign.key"])
            with socket.create_connection(("127.0.0.1", term.port), timeout=DEADLINE_S) as raw:
                with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)) as e:
                    with ctx.wrap_socket(raw) as s:  # TLS 1.3: the server checks after the client's Finished
                        s.sendall(b"\x02\x00\x00\x00")
                        assert s.recv(4096) == b"", "the terminator answered a stranger"
                        raise ssl.SSLError("closed without an answer")
                assert "answered a stranger" not in str(e.value)
        assert _refused(term, 3) == 3, term.refused
        # The store still answers a client of the job.
        with _storetls.Forwarder(("127.0.0.1", term.port), _ctx(pki, False, 1)) as fwd:
            assert _client(fwd.port).get("k") == b"the value"
    assert _tunnel_threads() == []


def test_the_forwarder_serves_only_its_own_uid(pki):
    """A connection from another uid (a forked child that drops to nobody) is closed before
    anything is dialled; this uid's is served. peer_uid reads /proc/net/tcp{,6}."""
    from rumor import _storetls

    if os.geteuid() != 0:
        pytest.skip("dropping to another uid needs root")
    store, port = _store_server()
    with _storetls.Terminator("127.0.0.1", 0, ("127.0.0.1", port), _ctx(pki, True, 0)) as term, \
            Relay(("127.0.0.1", 0), ("127.0.0.1", term.port)) as relay, \
            _storetls.Forwarder(("127.0.0.1", relay.port), _ctx(pki, False, 1)) as fwd:
        # Resolving a str host loads the idna codec, which a child dropped to nobody may no longer
        # read (a Python under /root): load it here, before the fork.
        "127.0.0.1".encode("idna")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: only system calls, then _exit
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                s = socket.create_connection(("127.0.0.1", fwd.port), timeout=DEADLINE_S)
                s.sendall(b"\x02\x00\x00\x00")
                code = 0 if s.recv(16) == b"" else 2  # 0: closed without a byte
            except ConnectionResetError:
                code = 0
            except BaseException:
                code = 3
            os.write(w, bytes([code]))
            os._exit(0)
        os.close(w)
        ready, _, _ = select.select([r], [], [], DEADLINE_S)
        assert ready, "the other uid's client did not finish"
        code = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert code == b"\x00", code
        assert _refused(fwd, 1) == 1 and relay.connections == 0  # nothing was dialled for it
        # This uid's connection is served.
        store.set("own", b"1")
        assert _client(fwd.port).get("own") == b"1"
        assert relay.connections >= 1
        with socket.create_server(("127.0.0.1", 0)) as l:
            c = socket.create_connection(l.getsockname())
            a, _ = l.accept()
            assert _storetls.peer_uid(a) == os.geteuid()
            c.close()
            a.close()


def test_an_altered_byte_fails_the_client_with_the_reason(pki, capfd):
    """A byte flipped in the store's answer: the forwarder's TLS finds the record's integrity
    broken, closes both ends and says so; the client's request fails (no hang, nothing wrong
    returned)."""
    import torch.distributed as dist

    from rumor import _storetls

    store, port = _store_server()
    store.set("k", b"the value")
    with _storetls.Terminator("127.0.0.1", 0, ("127.0.0.1", port), _ctx(pki, True, 0)) as term, \
            Relay(("127.0.0.1", 0), ("127.0.0.1", term.port), flip_app_record=2) as relay, \
            _storetls.Forwarder(("127.0.0.1", relay.port), _ctx(pki, False, 1)) as fwd:
        c = _client(fwd.port)  # its ping is the server's first answer
        with pytest.raises(dist.DistError):
            c.get("k")  # the second: altered on the way
        assert relay.flipped.is_set()
    err = capfd.readouterr().err
    assert "forwarder: the connection to the store at 127.0.0.1:" in err and "BAD_RECORD_MAC" in err.upper(), err
    assert _tunnel_threads() == []


def test_either_end_closing_closes_both_and_nothing_is_left(pki):
    from rumor import _storetls

    fds = len(os.listdir("/proc/self/fd"))
    with socket.create_server(("127.0.0.1", 0)) as target:
        term = _storetls.Terminator("127.0.0.1", 0, target.getsockname(), _ctx(pki, True, 0))
        fwd = _storetls.Forwarder(("127.0.0.1", term.port), _ctx(pki, False, 1))
        try:
            for closer in ("target", "client"):
                client = socket.create_connection(("127.0.0.1", fwd.port), timeout=DEADLINE_S)
                client.sendall(b"hello")
                target.settimeout(DEADLINE_S)
                server, _ = target.accept()
                server.settimeout(DEADLINE_S)
                assert server.recv(16) == b"hello"
                server.sendall(b"world")
                assert client.recv(16) == b"world"
                ended, other = (server, client) if closer == "target" else (client, server)
                ended.close()
                assert other.recv(16) == b"", f"{closer} closed; the other end did not see it"
                other.close()
        finally:
            fwd.close()
            term.close()
    assert _tunnel_threads() == []
    assert len(os.listdir("/proc/self/fd")) == fds


def test_files_from_env_takes_all_three_or_none():
    from rumor import _storetls

    assert _storetls.files_from_env({}) is None
    assert _storetls.files_from_env({"RUMOR_TLS_CERT": "c", "RUMOR_TLS_KEY": "k", "RUMOR_TLS_CA": "a"}) == ("c", "k", "a")
    with pytest.raises(SystemExit, match="RUMOR_TLS_KEY, RUMOR_TLS_CA not set"):
        _storetls.files_from_env({"RUMOR_TLS_CERT": "c"})


def _args(**kw):
    import argparse

    base = dict(nnodes="2", node_rank=1, rdzv_backend="static", rdzv_endpoint="", master_addr="10.9.8.7",
                master_port=29500)
    base.update(kw)
    return argparse.Namespace(**base)


def test_for_launch_points_a_static_multi_node_job_at_its_tunnel(pki, capfd):
    from rumor import _storetls

    files = {"RUMOR_TLS_CERT": pki["cert1.pem"], "RUMOR_TLS_KEY": pki["key1.pem"], "RUMOR_TLS_CA": pki["ca.pem"]}
    # Not for one node, nor without TLS files.
    assert _storetls.for_launch(_args(nnodes="1"), dict(files)) is None
    assert _storetls.for_launch(_args(), {}) is None
    # c10d and an elastic node count: none, and it says what stays in clear.
    assert _storetls.for_launch(_args(rdzv_backend="c10d", rdzv_endpoint="10.9.8.7:29400"), dict(files)) is None
    assert _storetls.for_launch(_args(nnodes="1:4"), dict(files)) is None
    assert capfd.readouterr().err.count("torchrun's own keys travel in clear, and rumor's workers keep theirs") == 2
    # Node 1 of a static job: torchrun (and so its workers) get the forwarder's loopback end,
    # the workers' route the public host.
    env = dict(files)
    args = _args()
    st = _storetls.for_launch(args, env)
    try:
        assert isinstance(st.tunnel, _storetls.Forwarder)
        assert (args.master_addr, args.master_port) == ("127.0.0.1", st.tunnel.port)
        assert args.rdzv_endpoint == f"127.0.0.1:{st.tunnel.port}"
        assert env["RUMOR_ROUTE_ADDR"] == "10.9.8.7" and st.tunnel.remote == ("10.9.8.7", 29500)
    finally:
        st.close()
    assert _tunnel_threads() == []


def test_route_addr_picks_the_advertised_interface(monkeypatch):
    from rumor import _rendezvous

    monkeypatch.delenv("RUMOR_ADVERTISE_ADDR", raising=False)
    monkeypatch.setenv("RUMOR_ROUTE_ADDR", "127.0.0.2")
    assert _rendezvous.advertise_address("192.0.2.1", 29500) == "127.0.0.1"  # loopback's route, not 192.0.2.1's
    monkeypatch.delenv("RUMOR_ROUTE_ADDR")
    assert _rendezvous.advertise_address("127.0.0.1", 29500) == "127.0.0.1"


def test_strangers_holding_handshakes_open_do_not_keep_the_job_out(pki, monkeypatch):
    """MAX_PENDING idle connections (strangers that never speak): the next connection drops the
    oldest of them at once, so the job's own client is served without waiting out their deadline."""
    from rumor import _storetls

    monkeypatch.setattr(_storetls, "MAX_PENDING", 4)
    # Their own deadline cannot be what ends them here: only the drop can.
    monkeypatch.setattr(_storetls, "HANDSHAKE_S", 10 * DEADLINE_S)
    store, port = _store_server()
    store.set("k", b"v")
    idle = []
    try:
        with _storetls.Terminator("127.0.0.1", 0, ("127.0.0.1", port), _ctx(pki, True, 0)) as term, \
                _storetls.Forwarder(("127.0.0.1", term.port), _ctx(pki, False, 1)) as fwd:
            for _ in range(4):
                idle.append(socket.create_connection(("127.0.0.1", term.port), timeout=DEADLINE_S))
            deadline = time.monotonic() + DEADLINE_S
            while len(term._pending) < 4:  # every one of them in its handshake
                assert time.monotonic() < deadline, len(term._pending)
                time.sleep(0.01)
            assert _client(fwd.port).get("k") == b"v"
            # The oldest idle stranger (in the order their handshakes began) was dropped: it sees
            # its connection end, unanswered.
            ended, _, _ = select.select(idle, [], [], DEADLINE_S)
            assert len(ended) == 1 and ended[0].recv(16) == b"", ended
            assert _refused(term, 1) == 1
    finally:
        for s in idle:
            s.close()
    assert _tunnel_threads() == []


# ---- ranks that host the store themselves (no rumor-run: srun, mpirun, variables set by hand) ----

def _store_tls_rank():
    import datetime

    import torch
    import torch.distributed as dist

    import rumor
    from rumor import _storetls

    rumor.init()
    t = rumor.allreduce(torch.full((1000,), float(rumor.rank() + 1)), rumor.ReduceOp.SUM)
    # torch's own env:// rendezvous after rumor's, as scripts that use both do: it finds the store
    # where rumor does (with TLS, through rumor's end of the tunnel) rather than a busy port.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    g = torch.full((10,), float(rumor.rank() + 1))
    dist.all_reduce(g)
    dist.destroy_process_group()
    rumor.shutdown()
    rumor.init()  # a second init() in the process: led back to the same end
    t2 = rumor.allreduce(torch.full((10,), float(rumor.rank() + 2)), rumor.ReduceOp.SUM)
    ends = sorted(type(tunnel).__name__ for tunnel, _ in _storetls._workers.values())
    rumor.shutdown()
    return float(t[0]), float(t[-1]), ends, float(g[0]), float(t2[0])


def _job_through_a_relay(pki, rec, tls: bool, rank1_foreign: bool = False, timeout_s: int = 30, **kw):
    """Two ranks as mpirun starts them, rank 1's store traffic through a recording relay."""
    import harness
    from tls_pki import tls_env

    port = harness.free_port()
    with Relay(("127.0.0.1", 0), ("127.0.0.1", port), record=str(rec)) as relay:
        rank_env = [{"MASTER_PORT": str(port), **(tls_env(pki, 0) if tls else {})},
                    {"MASTER_PORT": str(relay.port), **(tls_env(pki, 1, foreign=rank1_foreign) if tls else {})}]
        return harness.run(_store_tls_rank, 2, timeout=90, rank_env=rank_env,
                           env={"RUMOR_JOB_SECRET": "store-tls-test-secret-0123", "RUMOR_TIMEOUT": str(timeout_s)},
                           **kw)


def test_ranks_that_host_the_store_carry_it_over_tls_only(pki, tmp_path):
    """Without rumor-run (RANK, WORLD_SIZE and MASTER_* as mpirun or srun give them) and with the
    TLS files set, rank 0 serves the store behind a terminator on MASTER_PORT and rank 1 reaches it
    through a forwarder: what crosses is TLS records only, no key of the rendezvous, also once
    torch's own init_process_group() has met there and rumor has initialized a second time. The
    same job with TLS off shows its keys to the same capture (so the capture would see them)."""
    seen = {}
    for tls in (False, True):
        rec = tmp_path / f"rec-{tls}"
        rec.mkdir()
        results = _job_through_a_relay(pki, rec, tls)
        assert [r[:2] + r[3:] for r in results] == [(3.0, 3.0, 3.0, 5.0)] * 2, results
        ends = [r[2] for r in results]
        assert ends == ([["Terminator"], ["Forwarder"]] if tls else [[], []]), ends
        seen[tls] = [f.read_bytes() for f in sorted(rec.iterdir())]
        assert sum(len(d) for d in seen[tls]) > 0, "nothing crossed the relay"
    assert any(b"rumor/" in d for d in seen[False])  # in clear: the rendezvous keys are there
    for data in seen[True]:
        kinds = [k for k, _ in tls_records(data)]  # raises at a byte that is not a TLS record
        assert kinds and kinds[0] == 22 and set(kinds[1:]) <= {20, 21, 23}, kinds[:8]
        assert b"rumor/" not in data


def test_a_rank_with_another_cas_certificate_never_reaches_the_store(pki, tmp_path):
    """Rank 1's certificate is from another job's CA: its forwarder's handshake fails and says so,
    its init() fails, and rank 0's fails at its deadline waiting for it; nothing hangs."""
    rec = tmp_path / "rec"
    rec.mkdir()
    results = _job_through_a_relay(pki, rec, True, rank1_foreign=True, timeout_s=8, raw=True)
    assert not results[0].ok and not results[1].ok, results
    assert "the TLS handshake with the store" in results[1].output, results[1].output[-3000:]
    for f in rec.iterdir():
        tls_records(f.read_bytes())  # only the refused handshake crossed


class _Pointers:
    """The part of an agent's store rank_store uses, counting the reads of each key."""

    def __init__(self, values):
        self.values = {k: v.encode() for k, v in values.items()}
        self.reads = 0
        self.cond = threading.Condition()

    def check(self, keys):
        with self.cond:
            return all(k in self.values for k in keys)

    def get(self, key):
        with self.cond:
            self.reads += 1
            self.cond.notify_all()
            return self.values[key]

    def set(self, key, value):
        with self.cond:
            self.values[key] = value.encode() if isinstance(value, str) else value

    def wait_reads(self, n, timeout):
        with self.cond:
            assert self.cond.wait_for(lambda: self.reads >= n, timeout), f"{self.reads} reads"


def test_rank_store_dials_past_the_address_an_earlier_attempt_left(pki, monkeypatch):
    """Under a torchrun agent the agent's store outlives the workers: a restarted rank 1 may find
    the address a dead rank 0 published. Its forwarder is refused there and reads the address
    again before each dial, so once the new rank 0 publishes, rank 1's store reaches it."""
    import harness
    from rumor import _storetls

    monkeypatch.setattr(_storetls, "_workers", {})
    files = [(pki[f"cert{r}.pem"], pki[f"key{r}.pem"], pki["ca.pem"]) for r in range(2)]
    agent = _Pointers({_storetls.POINTER_KEY: f"127.0.0.1:{harness.free_port()}"})  # nobody listens there
    got = {}

    def rank1():
        try:
            got["store"] = _storetls.rank_store(agent, False, 2, "127.0.0.1", DEADLINE_S, files[1])
        except BaseException as e:  # noqa: BLE001 (shown by the assertion below)
            got["error"] = e

    t = threading.Thread(target=rank1, daemon=True)
    t.start()
    try:
        agent.wait_reads(3, DEADLINE_S)  # the first read, and two dials at the dead address
        store0 = _storetls.rank_store(agent, True, 2, "127.0.0.1", DEADLINE_S, files[0])
        t.join(DEADLINE_S)
        assert not t.is_alive() and "error" not in got, got
        got["store"].set("rumor/k", b"through the new address")
        assert store0.get("rumor/k") == b"through the new address"
        assert agent.values[_storetls.POINTER_KEY].decode().startswith("127.0.0.1:")
    finally:
        got.pop("store", None)
        _storetls.close_workers()
    assert _tunnel_threads() == []


def test_rank_store_takes_its_port_from_rumor_store_port(pki, monkeypatch):
    """RUMOR_STORE_PORT fixes the port rank 0's store listens on (a firewall between the hosts);
    a value that is not a port is refused naming the variable."""
    import harness
    from rumor import _storetls

    monkeypatch.setattr(_storetls, "_workers", {})
    files = (pki["cert0.pem"], pki["key0.pem"], pki["ca.pem"])
    agent = _Pointers({})
    monkeypatch.setenv("RUMOR_STORE_PORT", "70000")
    with pytest.raises(ValueError, match="RUMOR_STORE_PORT"):
        _storetls.rank_store(agent, True, 1, "127.0.0.1", DEADLINE_S, files)
    port = harness.free_port()
    monkeypatch.setenv("RUMOR_STORE_PORT", str(port))
    try:
        _storetls.rank_store(agent, True, 1, "127.0.0.1", DEADLINE_S, files)
        assert agent.values[_storetls.POINTER_KEY] == f"127.0.0.1:{port}".encode()
    finally:
        _storetls.close_workers()
    assert _tunnel_threads() == []
