"""An etcd member started by rumor-run --live --store etcd (docs/elastic.md, "No single point of
failure"): the first min(3, nnodes) launchers each run one, as a static cluster; a launcher past
them runs one that replaces a lost member (join: added through etcd's cluster API, then started
to join the running cluster).

Each member binds its client and peer URLs to its host's address (never 0.0.0.0), keeps its data
in a private temporary directory removed when it stops, and dies with its launcher
(PR_SET_PDEATHSIG): a launcher killed with SIGKILL leaves no member behind. The data is for this
job only: a member that fails is never started again with it, so nothing is lost by keeping it
in memory (/dev/shm, or RUMOR_ETCD_DIR) rather than paying a disk's fsync on every write. A
launcher killed with SIGKILL cannot remove its member's directory: a host lost takes it along,
and on a host that lives on it is left in /dev/shm.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import List, Optional, Sequence

from ._etcd_store import EtcdStore, EtcdStoreError

ETCD_ENV = "RUMOR_ETCD_BIN"  # the etcd binary (default: etcd on PATH)
DIR_ENV = "RUMOR_ETCD_DIR"  # where members make their data directories (default /dev/shm)
MAX_MEMBERS = 3
# Revisions kept: every put makes one (heartbeats are puts), and etcd keeps them all unless told.
_KEEP_REVISIONS = "1000"


def etcd_binary() -> str:
    path = os.environ.get(ETCD_ENV) or shutil.which("etcd")
    if not path or not os.access(path, os.X_OK):
        raise FileNotFoundError("rumor-run --store etcd: no etcd binary (install Debian's etcd-server, or set "
                                f"{ETCD_ENV} to one)")
    return path


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Member:
    """One member of the static cluster peers ([(host, client port, peer port)], member i named
    rumor<i>), the index-th one running here. token separates this job's cluster from others
    (etcd refuses peers with another --initial-cluster-token)."""

    def __init__(self, index: int, peers: Sequence[tuple], token: str, tls: Optional[dict] = None,
                 cluster: Optional[Sequence[tuple]] = None):
        """tls: {"cert", "key", "ca"} paths: https for clients and peers, and both must show a
        certificate of that CA (mutual TLS); its certificate must name this host's address.
        cluster: [(name, peer URL)] of a running cluster this member was added to (member add),
        itself included: it joins it (--initial-cluster-state existing) rather than forming one
        with peers; peers[index] is then its own address and ports."""
        self.index = index
        self.tls = tls
        self.peers = list(peers) if cluster is None else {index: peers[index]}
        self.cluster = None if cluster is None else list(cluster)
        self.token = token
        self.proc: Optional[subprocess.Popen] = None
        self.dir: Optional[str] = None
        self.log_path = ""

    @property
    def peer_url(self) -> str:
        host, _, pport = self.peers[self.index]
        return f"{self.scheme}://{host}:{pport}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def client_url(self) -> str:
        host, cport, _ = self.peers[self.index]
        return f"{self.scheme}://{host}:{cport}"

    def start(self) -> None:
        binary = etcd_binary()
        host, cport, pport = self.peers[self.index]
        if self.cluster is None:
            cluster = ",".join(f"rumor{i}={self.scheme}://{h}:{p}" for i, (h, _, p) in enumerate(self.peers))
        else:
            cluster = ",".join(f"{name}={url}" for name, url in self.cluster)
        base = os.environ.get(DIR_ENV) or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
        self.dir = tempfile.mkdtemp(prefix="rumor-etcd-", dir=base)
        self.log_path = os.path.join(self.dir, "etcd.log")
        argv = [binary, "--name", f"rumor{self.index}", "--data-dir", os.path.join(self.dir, "data"),
                "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
                "--listen-peer-urls", f"{self.scheme}://{host}:{pport}",
                "--initial-advertise-peer-urls", f"{self.scheme}://{host}:{pport}",
                "--initial-cluster", cluster, "--initial-cluster-token", self.token,
                "--initial-cluster-state", "new" if self.cluster is None else "existing",
                "--auto-compaction-mode", "revision", "--auto-compaction-retention", _KEEP_REVISIONS,
                "--logger", "zap", "--log-outputs", "stderr"]
        if self.tls:
            t = self.tls
            argv += ["--cert-file", t["cert"], "--key-file", t["key"], "--trusted-ca-file", t["ca"],
                     "--client-cert-auth", "--peer-cert-file", t["cert"], "--peer-key-file", t["key"],
                     "--peer-trusted-ca-file", t["ca"], "--peer-client-cert-auth"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent)

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def wait_ready(store: EtcdStore, members: List[Member], timeout: float) -> None:
    """Until the cluster answers a write (a majority of the members is up and has a leader).
    Raises SystemExit with the member's log when this host's member exited first."""
    deadline = time.monotonic() + timeout
    probe = store.copy()
    probe.set_timeout(datetime.timedelta(seconds=1))
    try:
        while True:
            for m in members:
                if not m.alive():
                    raise SystemExit(f"rumor-run: the etcd member rumor{m.index} exited with status "
                                     f"{m.proc.returncode if m.proc else '?'}:\n{m.log_tail()}")
            try:
                probe.set("rumor/etcd-ready", "1")
                return
            except EtcdStoreError as e:
                if time.monotonic() > deadline:
                    hint = ("are the other store hosts' launchers started?" if members
                            else "is the cluster running and reachable from here?")
                    raise SystemExit(f"rumor-run: the etcd cluster {', '.join(store.endpoints)} did not answer "
                                     f"within {timeout:g} s ({hint}): {e}")
    finally:
        probe.close()


def own_address(toward: str, port: int) -> str:
    """This host's address on the route to toward (a UDP socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((toward, port))
        return s.getsockname()[0]


def join(store: EtcdStore, index: int, addr: tuple, token: str, tls: Optional[dict], ssl_context,
         timeout: float) -> Member:
    """Adds a member named rumor<index> at addr (host, client port, peer port) to the cluster
    store reaches, starts it here to join it, and returns it once a write through it alone was
    answered. On failure it is stopped and removed from the cluster again (an added member that
    never starts counts against the majority), and the error raised."""
    member = Member(index, {index: tuple(addr)}, token, tls=tls, cluster=[])
    url = member.peer_url
    try:
        new_id, members = store.add_member(url)
    except EtcdStoreError:
        # A retried add whose first attempt was applied is refused: the member is there already.
        members = store.members()
        mine = [m for m in members if url in (m.get("peerURLs") or [])]
        if not mine:
            raise
        new_id = str(mine[0]["ID"])
    member.cluster = [(f"rumor{index}" if str(m["ID"]) == new_id else m.get("name", ""), u)
                      for m in members for u in m.get("peerURLs") or []]
    try:
        member.start()
        alone = EtcdStore([member.client_url], timeout, ssl_context)
        try:
            wait_ready(alone, [member], timeout)
        finally:
            alone.close()
    except BaseException as e:
        member.stop()
        try:
            store.remove_member(new_id)
        except EtcdStoreError:
            pass
        if isinstance(e, SystemExit):  # wait_ready's way of saying it: an error here, not an exit
            raise EtcdStoreError(str(e)) from None
        raise
    return member
