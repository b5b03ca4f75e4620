"""The job secret (rumor._secret) and the rendezvous that uses it (docs/security.md).

Findings of issue 48 covered here: the job token sat in clear in torch's TCPStore and was all a
stranger needed to join (now: a secret that never enters the store; the store holds a public
session token, the connection key is derived from both); values in the store were taken
unchecked (now: MACed and validated, a tampered entry is refused); --rumor-port clashed with
several workers per host.
"""
import os
import stat
import threading
import warnings

import pytest

import harness
from rumor import _rendezvous as rdv
from rumor import _runtime, _secret


@pytest.fixture
def private(tmp_path, monkeypatch):
    d = tmp_path / "priv"
    monkeypatch.setenv(_secret.PRIVATE_DIR_ENV, str(d))
    monkeypatch.delenv(_secret.SECRET_ENV, raising=False)
    monkeypatch.delenv(_secret.SECRET_FILE_ENV, raising=False)
    return d


# ---- where the secret comes from ----------------------------------------------------------------

def test_the_environment_secret_wins_and_must_be_long_enough(private, monkeypatch):
    monkeypatch.setenv(_secret.SECRET_ENV, "x" * 16)
    js = _secret.resolve(single_host=False)
    assert js.authenticated and js.secret == b"x" * 16 and js.source == _secret.SECRET_ENV
    monkeypatch.setenv(_secret.SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16"):
        _secret.resolve(single_host=True)


@pytest.mark.parametrize("mode,ok", [(0o600, True), (0o400, True), (0o640, False), (0o604, False)])
def test_a_secret_file_must_be_private(private, tmp_path, monkeypatch, mode, ok):
    f = tmp_path / "secret"
    f.write_text("s" * 40 + "\n")
    os.chmod(f, mode)
    monkeypatch.setenv(_secret.SECRET_FILE_ENV, str(f))
    if ok:
        assert _secret.resolve(single_host=False).secret == b"s" * 40
    else:
        with pytest.raises(_secret.UntrustedFileError, match="mode"):
            _secret.resolve(single_host=False)


def test_a_secret_file_of_another_user_or_a_symlink_is_refused(private, tmp_path, monkeypatch):
    f = tmp_path / "secret"
    f.write_text("s" * 40)
    os.chmod(f, 0o600)
    link = tmp_path / "link"
    link.symlink_to(f)
    monkeypatch.setenv(_secret.SECRET_FILE_ENV, str(link))
    with pytest.raises(_secret.UntrustedFileError, match="symbolic link"):
        _secret.resolve(single_host=False)
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    os.chown(f, 65534, 65534)
    monkeypatch.setenv(_secret.SECRET_FILE_ENV, str(f))
    with pytest.raises(_secret.UntrustedFileError, match="owned by uid 65534"):
        _secret.resolve(single_host=False)


def test_one_host_shares_the_private_user_secret_and_many_hosts_have_none(private):
    a = _secret.resolve(single_host=True)
    b = _secret.resolve(single_host=True)
    assert a.authenticated and a.secret == b.secret and len(a.secret) == 64 and a.source == "user"
    st = os.lstat(private / "secret")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert stat.S_IMODE(os.lstat(private).st_mode) == 0o700
    assert not _secret.resolve(single_host=False).authenticated


def test_a_private_directory_planted_by_another_user_is_refused(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    d = tmp_path / "planted"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    monkeypatch.setenv(_secret.PRIVATE_DIR_ENV, str(d))
    monkeypatch.delenv(_secret.SECRET_ENV, raising=False)
    monkeypatch.delenv(_secret.SECRET_FILE_ENV, raising=False)
    with pytest.raises(_secret.UntrustedFileError, match="owned by uid 65534"):
        _secret.resolve(single_host=True)
    assert not (d / "secret").exists()


def test_the_user_secret_lives_in_a_private_config_directory(tmp_path, monkeypatch):
    for k in (_secret.PRIVATE_DIR_ENV, _secret.SECRET_ENV, _secret.SECRET_FILE_ENV):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    a = _secret.user_secret()
    assert _secret.user_secret() == a and len(a) == 64
    # The same bytes through RUMOR_JOB_SECRET_FILE (what rumor.run gives the NCCL net plugin).
    monkeypatch.setenv(_secret.SECRET_FILE_ENV, _secret.user_secret_path())
    assert _secret.resolve(single_host=False).secret == a
    monkeypatch.delenv(_secret.SECRET_FILE_ENV)
    d = tmp_path / "cfg" / "rumor"
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700 and stat.S_IMODE(os.lstat(d / "secret").st_mode) == 0o600
    os.chmod(d, 0o755)  # opened up by someone: refused, not used
    with pytest.raises(_secret.UntrustedFileError, match="mode 0755"):
        _secret.user_secret()


def test_keys_differ_by_purpose_and_session_and_need_the_secret():
    js = _secret.JobSecret(b"k" * 32, "test")
    other = _secret.JobSecret(b"j" * 32, "test")
    anon = _secret.JobSecret(None, "none")
    s1, s2 = b"\1" * 16, b"\2" * 16
    keys = {js.key("connection", s1), js.key("connection", s2), js.key("store", s1),
            other.key("connection", s1), anon.key("connection", s1)}
    assert len(keys) == 5 and all(len(k) == 32 for k in keys)
    # Without a secret the key is a function of the public session alone.
    assert anon.key("connection", s1) == _secret.JobSecret(None, "x").key("connection", s1)


def test_write_private_replaces_a_planted_symlink_instead_of_following_it(private, tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    d = _secret.private_dir()
    path = os.path.join(d, "file")
    os.symlink(target, path)
    _secret.write_private(path, b"new")
    assert target.read_bytes() == b"precious"
    assert not os.path.islink(path) and _secret.read_private(path) == b"new"
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600


# ---- single host or not, before anyone met -------------------------------------------------------

@pytest.mark.parametrize("env,addr,single", [
    ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"}, "10.1.1.1", True),
    ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}, "127.0.0.1", False),
    ({}, "127.0.0.1", True),
    ({}, "10.1.1.1", False),
], ids=["torchrun-one-node", "torchrun-two-nodes", "loopback", "remote"])
def test_single_host_detection(monkeypatch, env, addr, single):
    for k in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert rdv.single_host(rdv.Env(1, 4, addr, 1, "torchrun")) is single


def test_a_multi_host_job_without_a_secret_warns_once(private, monkeypatch):
    monkeypatch.setattr(rdv, "_UNAUTH_WARNED", False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    env = rdv.Env(1, 2, "10.1.1.1", 1, "torchrun")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not rdv.job_secret_for(env).authenticated
        assert not rdv.job_secret_for(env).authenticated
    msgs = [str(x.message) for x in w if "NOT authenticated" in str(x.message)]
    assert len(msgs) == 1, msgs


# ---- the rendezvous: MACed entries ---------------------------------------------------------------

class _Store:
    """torch's Store API as _exchange uses it, in memory, shared by threads."""

    def __init__(self):
        self.d, self.cv = {}, threading.Condition()

    def set(self, k, v):
        with self.cv:
            self.d[k] = v.encode() if isinstance(v, str) else bytes(v)
            self.cv.notify_all()

    def get(self, k):
        with self.cv:
            return self.d[k]

    def check(self, keys):
        with self.cv:
            return all(k in self.d for k in keys)

    def multi_get(self, keys):
        with self.cv:
            return [self.d[k] for k in keys]


class _Ctx:
    def __init__(self, port):
        self.port, self.shm_tag = port, f"1.{port}"


def _meet(store, secrets, tamper=None, timeout=10.0):
    """Runs _exchange for len(secrets) ranks in threads; returns {rank: entries or exception}."""
    out = {}

    def rank(r):
        env = rdv.Env(r, len(secrets), "127.0.0.1", 1, "test")
        try:
            out[r] = rdv.exchange(store, env, timeout, lambda tok: _Ctx(40000 + r), f"host{r}", "127.0.0.1",
                                        secrets[r])[2]
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[r] = e

    ts = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(len(secrets))]
    if tamper is None:
        for t in ts:
            t.start()
    else:
        tamper(store, ts)
    for t in ts:
        t.join(timeout + 5)
        assert not t.is_alive(), "a rank of the rendezvous did not finish"
    return out


def test_rendezvous_with_one_secret_agrees():
    js = _secret.JobSecret(b"s" * 32, "test")
    out = _meet(_Store(), [js, js, js])
    assert out[0] == out[1] == out[2]
    assert [e[1] for e in out[0]] == ["127.0.0.1:40000", "127.0.0.1:40001", "127.0.0.1:40002"]


def test_the_secret_never_enters_the_store():
    js = _secret.JobSecret(b"S3cr3t-" * 5, "test")
    store = _Store()
    _meet(store, [js, js])
    blob = b"".join(store.d.values()) + b"".join(k.encode() for k in store.d)
    assert js.secret not in blob and js.secret.hex().encode() not in blob
    token = bytes.fromhex(store.d["token"].decode())
    assert js.key("connection", token) not in blob and js.key("connection", token).hex().encode() not in blob


def test_ranks_with_different_secrets_are_refused_by_name():
    out = _meet(_Store(), [_secret.JobSecret(b"a" * 32, "t"), _secret.JobSecret(b"b" * 32, "t")], timeout=3)
    assert isinstance(out[0], PermissionError) and "rank 1's entry" in str(out[0]), out[0]
    assert "MAC" in str(out[0])


def test_a_tampered_table_is_refused():
    js = _secret.JobSecret(b"s" * 32, "test")

    def tamper(store, ts):
        # Rank 0 publishes; before rank 1 starts, a stranger rewrites the table with its own address.
        ts[0].start()
        import json
        import time

        deadline = time.monotonic() + 10
        while not any(k.endswith("/table") for k in store.d) and time.monotonic() < deadline:
            # rank 1's entry is needed for rank 0 to finish: write a genuine one on its behalf
            if "token" in store.d and not any("/peer/1" in k for k in store.d):
                t = store.d["token"].decode()
                key = js.key("store", bytes.fromhex(t))
                store.set(f"{t}/peer/1", rdv.seal(key, "peer/1", ["ab", "127.0.0.1:40001", "h1", "1.2", ""]))
            time.sleep(0.01)
        t = store.d["token"].decode()
        body, mac = json.loads(store.d[f"{t}/table"])
        forged = json.loads(body)
        forged[0][1] = "203.0.113.9:1"
        store.set(f"{t}/table", json.dumps([json.dumps(forged), mac]))
        ts[1].start()

    out = _meet(_Store(), [js, js], tamper=tamper, timeout=5)
    assert isinstance(out[1], PermissionError) and "table of peers" in str(out[1]), out[1]


@pytest.mark.parametrize("entry", [
    ["n", "nohost", "h", "t", ""], ["n", "h:99999", "h", "t", ""], ["n", "h:1", "h", "../../x", ""],
    ["n", "h:1", "h", "t"], ["n", "h:1", "h", 5, ""], ["n", "h:1", "h", "t", "s" * 257], "x",
], ids=["no-port", "port-range", "tag-path", "short", "not-str", "site-too-long", "not-list"])
def test_malformed_entries_are_refused(entry):
    assert rdv.valid_entry(["n", "h:1", "h", "t", "site-a"], 1)
    assert not rdv.valid_entry(entry, 1)


# ---- ports ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value,local,port", [("", "3", 0), ("30000", "0", 30000), ("30000", "3", 30003)])
def test_rumor_port_is_the_first_of_the_hosts_ports(monkeypatch, value, local, port):
    monkeypatch.setenv("RUMOR_PORT", value)
    monkeypatch.setenv("LOCAL_RANK", local)
    assert rdv.listen_port(rdv.Env(0, 4, "127.0.0.1", 1, "torchrun")) == port


@pytest.mark.parametrize("value", ["abc", "70000", "-1"])
def test_a_bad_rumor_port_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("RUMOR_PORT", value)
    with pytest.raises(ValueError, match="RUMOR_PORT"):
        rdv.listen_port(rdv.Env(0, 4, "127.0.0.1", 1, "torchrun"))


# ---- the launcher hands a secret to its workers --------------------------------------------------

def _secret_of_worker():
    import rumor

    rumor.init()
    js = _runtime.state().secret
    return js.source, js.secret


def test_two_ranks_join_with_the_host_secret(private):
    res = harness.run(_secret_of_worker, 2, timeout=60, env={_secret.PRIVATE_DIR_ENV: str(private)})
    assert res[0] == res[1] and res[0][0] == "user"


@pytest.mark.parametrize("nnodes,warns", [("1", False), ("2", True), ("1:3", True)])
def test_rumor_run_warns_of_a_multi_node_job_without_a_secret(monkeypatch, capsys, nnodes, warns):
    from rumor import run

    monkeypatch.delenv(_secret.SECRET_ENV, raising=False)
    monkeypatch.delenv(_secret.SECRET_FILE_ENV, raising=False)
    lo, _, hi = nnodes.partition(":")
    run._warn_without_secret(lo, hi)
    assert ("runs unauthenticated" in capsys.readouterr().err) is warns
    monkeypatch.setenv(_secret.SECRET_ENV, "z" * 32)
    run._warn_without_secret(lo, hi)
    assert capsys.readouterr().err == ""
