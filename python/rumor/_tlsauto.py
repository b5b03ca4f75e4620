"""`rumor-run --tls auto`: the job's CA and this host's certificate, made by the launcher.

One node: a CA with a random key, made and forgotten by this launcher. Several nodes: there is
no channel between the nodes' launchers before the job starts but the job secret, which every
node must already share (docs/security.md). So each launcher derives the same CA key from it
(HKDF-SHA256 -> a P-256 scalar, bound to the rendezvous id), makes a CA certificate with the
same subject and public key, and issues its own host's certificate with it: every node's ranks
then trust every other node's, and no file is copied between nodes.

The CA key never leaves the launcher's memory. The host's certificate, its key and the CA
certificate are written to this user's private directory (rumor._secret: 0700, files 0600
created O_EXCL|O_NOFOLLOW) under names of their own per launch; the workers get only their
paths, in RUMOR_TLS_CERT / RUMOR_TLS_KEY / RUMOR_TLS_CA, which they inherit. The launcher
removes the files when the job ends, whatever way it ends; their names end with the launcher's
owner tag, so that rumor._shm's sweep removes them once the launcher is gone (SIGKILL).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import sys
from typing import Dict, List, Optional, Sequence

from . import _secret

TLS_VARS = ("RUMOR_TLS_CERT", "RUMOR_TLS_KEY", "RUMOR_TLS_CA", "RUMOR_TLS_PEER_NAME")
# The files, by the variable that names each.
_FILES = (("RUMOR_TLS_CERT", "cert"), ("RUMOR_TLS_KEY", "key"), ("RUMOR_TLS_CA", "ca"))
# The order n of P-256's group (SEC 2): a private key is an integer in [1, n-1].
P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
# A job may run for months and restart workers (elastic) at any point: its certificates must
# outlast it. They are worth nothing once the files are gone, and a derived CA is remade by any
# launcher holding the secret anyway.
VALID_S = 365 * 86400.0
_SALT = b"rumor-run --tls auto"


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """HKDF with SHA-256 (RFC 5869): extract, then expand to `length` bytes."""
    if not 0 < length <= 255 * 32:
        raise ValueError(f"hkdf_sha256: length must be in [1, {255 * 32}], got {length}")
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
    return out[:length]


def _info(what: str, job_id: str) -> bytes:
    # Length-prefixed, so no two (what, job_id) pairs give the same bytes.
    w, j = what.encode(), job_id.encode()
    return len(w).to_bytes(2, "big") + w + len(j).to_bytes(2, "big") + j


def ca_scalar(secret: bytes, job_id: str) -> bytes:
    """The job CA's P-256 private key as 32 big-endian bytes. 48 bytes of HKDF reduced into
    [1, n-1]: the 128 extra bits make the result's bias from uniform negligible (FIPS 186-4
    B.4.1), and no retry loop is needed."""
    okm = hkdf_sha256(secret, _SALT, _info("CA private key, P-256", job_id), 48)
    d = int.from_bytes(okm, "big") % (P256_ORDER - 1) + 1
    return d.to_bytes(32, "big")


def ca_name(secret: Optional[bytes], job_id: str) -> str:
    """The CA's subject: the same on every node of a job (derived) or random (one node)."""
    tag = os.urandom(8) if secret is None else hkdf_sha256(secret, _SALT, _info("CA name", job_id), 8)
    return f"rumor job CA {tag.hex()}"


def make_credentials(secret: Optional[bytes], job_id: str, host: Optional[str] = None,
                     valid_s: float = VALID_S, sans: Sequence[str] = ()) -> Dict[str, bytes]:
    """{"cert", "key", "ca"}: this host's certificate and key, and the CA certificate (PEM); and
    "name", the CA's subject. secret None: a CA with a random key (one node); else the CA derived
    from it (see above). sans: the names (or addresses) the certificate answers for as a server
    (the etcd member rumor-run --live --store etcd runs on this host, reached by its address)."""
    from . import _C

    name = ca_name(secret, job_id)
    if secret is None:
        ca_cert, ca_key = _C.tls_make_ca(name, valid_s)
    else:
        ca_cert, ca_key = _C.tls_make_ca(name, valid_s, ca_scalar(secret, job_id))
    host = (host or socket.gethostname() or "host")[:48]
    cert, key = _C.tls_issue_certificate(ca_cert, ca_key, f"rumor host {host}", list(sans), valid_s)
    return {"cert": cert, "key": key, "ca": ca_cert, "name": name.encode()}


def _owner_tag() -> str:
    from . import _shm

    return f"{_shm._pid_namespace()}.{os.getpid()}"


class AutoTls:
    """The launcher's side: prepare() checks everything that can be refused before the job starts;
    write() makes the files and points the environment at them; close() removes both."""

    def __init__(self, multi_node: bool, job_id: str):
        self.multi_node = multi_node
        self.job_id = job_id
        self.env = os.environ  # the workers inherit it
        self.paths: Dict[str, str] = {}
        self._secret: Optional[bytes] = None
        self._saved: Dict[str, Optional[str]] = {}

    def prepare(self) -> None:
        """Raises SystemExit with what to do when --tls auto cannot run as asked."""
        given = [v for v in TLS_VARS if self.env.get(v)]
        if given:
            raise SystemExit(f"rumor-run: --tls auto makes the job's certificates itself, but {', '.join(given)} "
                             f"{'is' if len(given) == 1 else 'are'} set: unset {'it' if len(given) == 1 else 'them'} "
                             "to let it, or leave --tls off to use your own files (docs/security.md)")
        if not self.multi_node:
            return  # a random CA: nothing to share with other nodes
        try:
            js = _secret.given()
        except (OSError, ValueError) as e:
            raise SystemExit(f"rumor-run: --tls auto: {e}") from None
        if js is None:
            raise SystemExit(
                "rumor-run: --tls auto on several nodes derives the job's CA on every node from the job secret, "
                f"and none is set: give every node the same {_secret.SECRET_ENV} (or {_secret.SECRET_FILE_ENV}), "
                f"e.g. export {_secret.SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') "
                "(docs/security.md)")
        self._secret = js.secret

    def write(self, sans: Sequence[str] = ()) -> Dict[str, str]:
        """Makes the credentials, writes them (0600) and sets RUMOR_TLS_CERT/KEY/CA to their paths;
        returns {variable: path}. sans: see make_credentials."""
        creds = make_credentials(self._secret, self.job_id, sans=sans)
        directory = _secret.private_dir()
        token = os.urandom(8).hex()
        tag = _owner_tag()
        for var, kind in _FILES:
            # Recorded before the write, so that close() removes a file whose write failed midway.
            path = os.path.join(directory, f"rumor_tls-{token}-{kind}.pem@{tag}")
            self.paths[var] = path
            _secret.write_private(path, creds[kind])
        for var, path in self.paths.items():
            self._saved[var] = self.env.get(var)
            self.env[var] = path
        # Every node of a job prints the same name; a node that differs has another secret or
        # rendezvous id, and its ranks' handshakes fail with "unknown ca".
        how = "its key derived from the job secret" if self._secret is not None else "a random key, one node"
        print(f"rumor-run: TLS on the data channels: job CA '{creds['name'].decode()}' ({how})", file=sys.stderr)
        return dict(self.paths)

    def close(self) -> List[str]:
        """Removes the files and restores the environment; returns the paths removed."""
        removed = []
        for path in self.paths.values():
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
        for var, old in self._saved.items():
            if old is None:
                self.env.pop(var, None)
            else:
                self.env[var] = old
        self.paths, self._saved = {}, {}
        return removed

