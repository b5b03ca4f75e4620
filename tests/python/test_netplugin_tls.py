"""TLS on the NCCL net plugin's streams (RUMOR_NET_PLUGIN_TLS=1 with RUMOR_TLS_*, docs/netplugin.md):
two netplugin_peer processes (built with the C++ tests) over loopback (RUMOR_NET_PLUGIN_IFNAME=lo).

Messages arrive byte for byte (--verify); a connector whose certificate another CA issued is refused
by the listener, naming TLS; a relay that flips one byte of what the sender sends makes the receiver
fail with the integrity error and the sender fail too, and no altered message is ever delivered.
Every process has a deadline (--deadline and a wait timeout) and is killed if still running.
"""
from __future__ import annotations

import os
import socket
import subprocess
import threading

import pytest

from test_netplugin import _Lines, _peer_binary
from tls_pki import make_pki, tls_env

COMMON = ["--bytes", str(1_000_003), "--iters", "12", "--window", "4", "--verify", "--deadline", "40"]


def _env(files, rank, foreign=False, tls=True):
    env = dict(os.environ)
    env.update(RUMOR_NET_PLUGIN_IFNAME="lo", RUMOR_NET_PLUGIN_TIMEOUT="15")
    if tls:
        env.update(tls_env(files, rank, foreign), RUMOR_NET_PLUGIN_TLS="1")
    return env


class _FlipRelay:
    """Listens on loopback and forwards each connection to `port`, XOR-ing the byte at `flip_at` of
    what the dialer sends on every connection with 0x80."""

    def __init__(self, port: int, flip_at: int):
        self.port, self.flip_at = port, flip_at
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(30)
        self.socks = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    @property
    def listen_port(self) -> int:
        return self.srv.getsockname()[1]

    def _accept(self):
        try:
            while True:
                a, _ = self.srv.accept()
                b = socket.create_connection(("127.0.0.1", self.port), timeout=30)
                self.socks += [a, b]
                for src, dst, flip in ((a, b, True), (b, a, False)):
                    t = threading.Thread(target=self._pipe, args=(src, dst, flip), daemon=True)
                    t.start()
                    self.threads.append(t)
        except OSError:
            return  # closed

    def _pipe(self, src, dst, flip):
        seen = 0
        try:
            while True:
                data = bytearray(src.recv(65536))
                if not data:
                    break
                if flip and seen <= self.flip_at < seen + len(data):
                    data[self.flip_at - seen] ^= 0x80
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.srv.close()
        for s in self.socks:
            s.close()
        for t in self.threads:
            t.join(timeout=10)


def _relayed(handle: str, port: int) -> str:
    """The listen handle (hex) with its port (bytes 6-7, host order) replaced."""
    raw = bytearray.fromhex(handle)
    raw[6:8] = port.to_bytes(2, "little")
    return raw.hex()


def _run_pair(recv_env, send_env, relay_flip_at=None):
    """Receiver and sender; returns (recv rc, recv stderr, send rc, send stderr)."""
    exe = _peer_binary()
    if exe is None:
        pytest.skip("netplugin_peer is not built (cmake -DRUMOR_BUILD_TESTS=ON; or set RUMOR_NETPLUGIN_PEER)")
    popen = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 start_new_session=True)
    procs, relay = [], None
    try:
        recv = subprocess.Popen([exe, "--recv", *COMMON], env=recv_env, **popen)
        procs.append(recv)
        handle = _Lines(recv.stdout).wait_for("HANDLE ", 30).split()[1]
        if relay_flip_at is not None:
            port = int.from_bytes(bytes.fromhex(handle)[6:8], "little")
            relay = _FlipRelay(port, relay_flip_at)
            handle = _relayed(handle, relay.listen_port)
        send = subprocess.Popen([exe, "--send", *COMMON], env=send_env, **popen)
        procs.append(send)
        send.stdin.write(handle + "\n")
        send.stdin.flush()
        out = []
        for p in (recv, send):
            _, err = p.communicate(timeout=60)
            out += [p.returncode, err]
        return tuple(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        if relay is not None:
            relay.close()


def test_transfer_over_tls_arrives_byte_for_byte(tmp_path):
    files = make_pki(tmp_path)
    rrc, rerr, src, serr = _run_pair(_env(files, 0), _env(files, 1))
    assert rrc == 0, rerr[-3000:]
    assert src == 0, serr[-3000:]


def test_connector_with_certificate_of_another_ca_is_refused(tmp_path):
    files = make_pki(tmp_path)
    rrc, rerr, src, serr = _run_pair(_env(files, 0), _env(files, 1, foreign=True))
    assert rrc == 1 and src == 1, (rerr[-2000:], serr[-2000:])
    assert "certificate refused" in rerr, rerr[-3000:]
    assert "ERROR:" in serr, serr[-3000:]


def test_tls_on_one_side_only_fails_both(tmp_path):
    files = make_pki(tmp_path)
    rrc, rerr, src, serr = _run_pair(_env(files, 0, tls=False), _env(files, 1))
    assert rrc == 1 and src == 1, (rerr[-2000:], serr[-2000:])
    assert "TLS" in serr, serr[-3000:]


def test_flipped_byte_fails_both_ends_and_delivers_nothing_altered(tmp_path):
    files = make_pki(tmp_path)
    # Past the HMAC hello and the TLS handshake (a few KiB), inside the first chunks' records.
    rrc, rerr, src, serr = _run_pair(_env(files, 0), _env(files, 1), relay_flip_at=100_000)
    assert rrc == 1 and src == 1, (rerr[-2000:], serr[-2000:])
    assert "integrity check failed" in rerr, rerr[-3000:]
    assert "differs at byte" not in rerr, rerr[-3000:]
    assert "ERROR:" in serr, serr[-3000:]


@pytest.mark.parametrize("setting,named", [
    (dict(RUMOR_NET_PLUGIN_TLS="yes"), "RUMOR_NET_PLUGIN_TLS=yes"),
    (dict(RUMOR_NET_PLUGIN_TLS="1", RUMOR_TLS_CA=""), "RUMOR_TLS_CA"),
    (dict(RUMOR_NET_PLUGIN_TLS="1", RUMOR_TLS_KEY="/nonexistent/key.pem"), "/nonexistent/key.pem")])
def test_tls_asked_for_but_unusable_refuses_to_start(tmp_path, setting, named):
    """Never a silent fall back to clear text: init fails, naming what is wrong."""
    exe = _peer_binary()
    if exe is None:
        pytest.skip("netplugin_peer is not built (cmake -DRUMOR_BUILD_TESTS=ON; or set RUMOR_NETPLUGIN_PEER)")
    env = dict(_env(make_pki(tmp_path), 0), **setting)
    p = subprocess.run([exe, "--recv", *COMMON], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "refusing to start" in p.stderr and "ERROR: init" in p.stderr, p.stderr[-2000:]
    assert named in p.stderr, p.stderr[-2000:]
