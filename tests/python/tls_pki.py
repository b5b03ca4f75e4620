"""Test support for TLS (RUMOR_TLS_*): a job's CA, a certificate per rank, one from another CA, as
PEM files, and each rank's environment."""
from __future__ import annotations

import os

PEER_NAME = "job.rumor.test"


def make_pki(tmp_path, ranks: int = 2):
    """The job's CA, a certificate per rank, and one from another CA; PEM file paths by name."""
    from rumor import _C

    ca_cert, ca_key = _C.tls_make_ca("rumor test job")
    other_cert, other_key = _C.tls_make_ca("another job")
    files = {}

    def write(name, data):
        path = tmp_path / name
        path.write_bytes(data)
        os.chmod(path, 0o600)
        files[name] = str(path)

    write("ca.pem", ca_cert)
    for r in range(ranks):
        cert, key = _C.tls_issue_certificate(ca_cert, ca_key, f"rank-{r}", [PEER_NAME, "127.0.0.1"])
        write(f"cert{r}.pem", cert)
        write(f"key{r}.pem", key)
    cert, key = _C.tls_issue_certificate(other_cert, other_key, "intruder", [PEER_NAME, "127.0.0.1"])
    write("foreign.pem", cert)
    write("foreign.key", key)
    return files


def tls_env(files, rank, foreign=False):
    """Rank `rank`'s RUMOR_TLS_* (its certificate from another CA with foreign=True)."""
    return {"RUMOR_TLS_CERT": files["foreign.pem" if foreign else f"cert{rank}.pem"],
            "RUMOR_TLS_KEY": files["foreign.key" if foreign else f"key{rank}.pem"],
            "RUMOR_TLS_CA": files["ca.pem"], "RUMOR_TLS_PEER_NAME": PEER_NAME}
