"""Emulated clusters on one machine: one Linux network namespace per "host".

Layout (nothing is added to the root namespace):

    <prefix>s                 the "switch": a namespace holding bridge br0
      br0 ── h0 ─┐ ┌─ h1 ...  switch-side veth ends, enslaved to br0
                 │ │
    <prefix>h0   eth0 = 10.213.0.1/24   (host 0: its own namespace, lo up)
    <prefix>h1   eth0 = 10.213.0.2/24   (host 1) ...

Each host's eth0 egress can be shaped with tbf (``rate`` argument, e.g. "1gbit"); netem is not
available on the kernels we run on, so there is no delay emulation here. Addresses live only in
namespaces this module creates, so the same private /24 can be reused by concurrent instances.

    from rumor.testing import netns
    ok, why = netns.available()
    with netns.Cluster(4, rate="1gbit") as c:
        p = c.popen(1, ["python", "worker.py"], env=env)   # runs inside host 1's namespace
        ...
    # namespaces, veths, the bridge and qdiscs are gone here, also after an exception,
    # Ctrl-C or SIGTERM; processes started with popen() are killed first.

Command line: ``python -m rumor.testing.netns --check`` builds a 2-host cluster, pings across it and
measures TCP throughput through a shaped link; ``--list`` / ``--cleanup-stale`` show or remove
namespaces left behind by dead processes (after a SIGKILL nothing could clean up).
"""
from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

PREFIX = "rmr"  # every namespace this module creates starts with this: rmr<pid>x<k>{s,h<i>}
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)x(\d+)(s|h\d+)$")
_counter = itertools.count()
_live: Dict[int, "Cluster"] = {}  # id -> open clusters, for the atexit / signal safety net
_live_lock = threading.Lock()
_available_cache: Optional[Tuple[bool, str]] = None


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be created; the message carries ip/tc's stderr."""


def _ip(*args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    cmd = ["ip", *args]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed (exit {r.returncode}): {r.stderr.strip()}")
    return r


def _netns_names() -> List[str]:
    r = _ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def available() -> Tuple[bool, str]:
    """(True, "") if this process can build emulated clusters, else (False, why) for a skip message.

    Checks root, the ip and tc tools, and actually creates (and removes) a probe namespace with a
    bridge and a veth, because containers often run as root without CAP_NET_ADMIN/CAP_SYS_ADMIN.
    The result is cached per process.
    """
    global _available_cache
    if _available_cache is not None:
        return _available_cache
    if not sys.platform.startswith("linux"):
        _available_cache = (False, f"network namespaces need Linux (this is {sys.platform})")
        return _available_cache
    if os.geteuid() != 0:
        _available_cache = (False, "network namespaces need root (ip netns add); run as root to emulate hosts")
        return _available_cache
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            _available_cache = (False, f"`{tool}` not found (install iproute2)")
            return _available_cache
    probe = f"{PREFIX}{os.getpid()}x{next(_counter)}s"
    try:
        _ip("netns", "add", probe)
        try:
            _ip("-n", probe, "link", "set", "lo", "up")
            _ip("-n", probe, "link", "add", "br0", "type", "bridge")
            _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
            r = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "p0", "root",
                                "tbf", "rate", "1gbit", "burst", "256kb", "latency", "20ms"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=20)
            if r.returncode != 0:
                raise NetnsError(f"tc tbf qdisc failed: {r.stderr.strip()}")
        finally:
            _ip("netns", "del", probe, check=False)
    except (NetnsError, OSError, subprocess.SubprocessError) as e:
        _available_cache = (False, f"cannot build network namespaces here: {e}")
        return _available_cache
    _available_cache = (True, "")
    return _available_cache


@dataclass
class Host:
    """One emulated host of a Cluster (Cluster.host(i) returns it).

    Attributes:
        index: the host's number i in its Cluster, 0..H-1.
        netns: the network namespace's name (for `ip netns exec`).
        ip: the address of ifname inside the namespace, <subnet>.<index + 1>.
        ifname: the host's interface, "eth0".
        switch_port: the name of the veth end in the switch namespace, "h<index>".
    """

    index: int
    netns: str      # namespace name (for `ip netns exec`)
    ip: str         # address of eth0 inside the namespace
    ifname: str     # "eth0"
    switch_port: str  # the veth end in the switch namespace ("h<index>")


class Cluster:
    """H emulated hosts on one bridge. Use as a context manager (or start()/close()).

    hosts:   number of namespaces ("hosts"), 1..250.
    rate:    tbf rate on each host's eth0 egress ("1gbit", "500mbit", ...) or None for no shaping.
    burst, latency: tbf parameters (defaults as in BENCHMARKS.md).
    shape_switch_side: also shape the switch->host direction (each host's download), as a
             full-duplex NIC would be; off by default, as in BENCHMARKS.md (egress only).
    subnet:  the first three octets of the private /24; host i gets <subnet>.<i+1>.
    mtu:     MTU of the veth links.
    """

    def __init__(self, hosts: int, rate: Optional[str] = None, *, burst: str = "256kb",
                 latency: str = "20ms", shape_switch_side: bool = False, subnet: str = "10.213.0",
                 mtu: int = 1500):
        if not 1 <= int(hosts) <= 250:
            raise ValueError(f"Cluster: hosts must be in 1..250, got {hosts}")
        self.n = int(hosts)
        self.rate = rate
        self.burst = burst
        self.latency = latency
        self.shape_switch_side = shape_switch_side
        self.subnet = subnet
        self.mtu = int(mtu)
        base = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self.switch = base + "s"
        self.hosts: List[Host] = [
            Host(i, f"{base}h{i}", f"{subnet}.{i + 1}", "eth0", f"h{i}") for i in range(self.n)
        ]
        self._created: List[str] = []
        self._procs: List[subprocess.Popen] = []
        self._started = False
        self._closed = False
        self._old_handlers: Dict[int, object] = {}

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "Cluster":
        """Creates the namespaces, the bridge, the veth links and (with rate) the tbf qdiscs,
        and waits until every host's interface is up; what a `with` block does on entry. Calling
        it again does nothing. On a failure everything made so far is removed.

        Returns:
            This Cluster.

        Raises:
            NetnsError: network namespaces are not available here (not Linux, not root, or
                ip / tc missing: see available()), or a namespace, link or qdisc could not be
                made.
        """
        if self._started:
            return self
        ok, why = available()
        if not ok:
            raise NetnsError(why)
        self._started = True
        with _live_lock:
            _live[id(self)] = self
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        sw = self.switch
        self._add_ns(sw)
        _ip("-n", sw, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for h in self.hosts:
            self._add_ns(h.netns)
            _ip("-n", h.netns, "link", "set", "lo", "up")
            # Created inside the switch namespace with the peer moved straight into the host's,
            # so no interface ever appears in the root namespace (and names cannot collide).
            _ip("-n", sw, "link", "add", h.switch_port, "mtu", str(self.mtu), "type", "veth",
                "peer", "name", h.ifname, "mtu", str(self.mtu), "netns", h.netns)
            _ip("-n", sw, "link", "set", h.switch_port, "master", "br0")
            _ip("-n", sw, "link", "set", h.switch_port, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", h.ifname)
            _ip("-n", h.netns, "link", "set", h.ifname, "up")
            if self.rate:
                self._tbf(h.netns, h.ifname)
                if self.shape_switch_side:
                    self._tbf(sw, h.switch_port)
        # Wait until every host's eth0 is operationally up (veth carrier, bridge forwarding).
        deadline = time.monotonic() + 10
        for h in self.hosts:
            while True:
                r = _ip("-n", h.netns, "-o", "link", "show", h.ifname, check=False)
                if "state UP" in r.stdout or "LOWER_UP" in r.stdout:
                    break
                if time.monotonic() > deadline:
                    raise NetnsError(f"{h.netns}/{h.ifname} did not come up: {r.stdout.strip()}")
                time.sleep(0.02)

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)

    def _tbf(self, ns: str, dev: str) -> None:
        r = self.exec_run_ns(ns, ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                                  "burst", self.burst, "latency", self.latency])
        if r.returncode != 0:
            raise NetnsError(f"tc tbf on {ns}/{dev} failed: {r.stderr.strip()}")

    def close(self) -> None:
        """Kills processes started with popen(), then deletes every namespace this instance made
        (which removes its veths, the bridge and the qdiscs with them). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._kill_procs()
            for name in reversed(self._created):
                self._kill_netns_pids(name)
                _ip("netns", "del", name, check=False)
            self._created.clear()
        finally:
            with _live_lock:
                _live.pop(id(self), None)
            self._restore_signal_handlers()

    # -- signals: turn SIGTERM/SIGHUP into an exception so `with` blocks unwind and clean up ------

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; atexit still covers normal exits
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                old = signal.getsignal(sig)
                if old is _raise_on_signal:
                    continue
                self._old_handlers[sig] = old
                signal.signal(sig, _raise_on_signal)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            try:
                if signal.getsignal(sig) is _raise_on_signal:
                    signal.signal(sig, old if old is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        self._old_handlers.clear()

    # -- running things inside hosts -------------------------------------------------------------

    def host(self, i: int) -> Host:
        """Host number i.

        Args:
            i: the host's index, 0..H-1.

        Returns:
            Its Host record.

        Raises:
            IndexError: i is not a host's index.
        """
        return self.hosts[i]

    def ip(self, i: int) -> str:
        """Host i's address (of its eth0), what other hosts dial.

        Args:
            i: the host's index, 0..H-1.

        Returns:
            The address as a dotted str.

        Raises:
            IndexError: i is not a host's index.
        """
        return self.hosts[i].ip

    @property
    def namespaces(self) -> List[str]:
        """The names of every namespace of the cluster: the switch's first, then each host's."""
        return [self.switch] + [h.netns for h in self.hosts]

    def popen(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Starts argv inside host i's namespace (`ip netns exec <ns> argv...`) and returns the
        Popen. The process gets its own session (so it and its children can be killed as a group)
        unless start_new_session is given; close() kills whatever is still running."""
        if not self._started or self._closed:
            raise RuntimeError("Cluster.popen(): the cluster is not running (use it inside `with`)")
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(["ip", "netns", "exec", self.hosts[i].netns, *argv], **kwargs)
        self._procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], timeout: float = 60.0, check: bool = False,
            **kwargs) -> subprocess.CompletedProcess:
        """Runs argv to completion inside host i's namespace (output captured as text).

        Args:
            i: the host's index, 0..H-1.
            argv: the command and its arguments.
            timeout: seconds it may run (default 60); then its process group is killed.
            check: if True (default False), a non-zero exit status raises.
            **kwargs: passed on to subprocess.Popen (stdout, stderr and text default to
                captured text).

        Returns:
            A subprocess.CompletedProcess with returncode, stdout and stderr.

        Raises:
            RuntimeError: the cluster is not running.
            subprocess.TimeoutExpired: it ran longer than timeout.
            subprocess.CalledProcessError: check is True and it exited non-zero.
        """
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        p = self.popen(i, argv, **kwargs)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(p)
            out, err = p.communicate()
            raise
        r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            r.check_returncode()
        return r

    @staticmethod
    def exec_run_ns(ns: str, argv: Sequence[str], timeout: float = 20.0) -> subprocess.CompletedProcess:
        """Runs argv inside namespace ns (`ip netns exec ns argv...`), output captured as
        text; unlike run(), it needs no running cluster and takes any namespace by name.

        Args:
            ns: the namespace's name (e.g. one of namespaces).
            argv: the command and its arguments.
            timeout: seconds it may run (default 20).

        Returns:
            A subprocess.CompletedProcess; a non-zero exit status does not raise.

        Raises:
            subprocess.TimeoutExpired: it ran longer than timeout.
        """
        return subprocess.run(["ip", "netns", "exec", ns, *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=timeout)

    def qdisc(self, i: int) -> str:
        """`tc -s qdisc show dev eth0` inside host i (for diagnostics)."""
        return self.exec_run_ns(self.hosts[i].netns, ["tc", "-s", "qdisc", "show", "dev", "eth0"]).stdout

    def _kill_procs(self) -> None:
        live = [p for p in self._procs if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 3
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in live:
            if p.poll() is None:
                _kill_group(p)
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        self._procs.clear()

    @staticmethod
    def _kill_netns_pids(name: str) -> None:
        # Anything still inside one of *our* namespaces was started by us (or our children).
        r = _ip("netns", "pids", name, check=False)
        for tok in r.stdout.split():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except (ValueError, ProcessLookupError, PermissionError):
                pass


class _Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM/SIGHUP while a Cluster is open, so that `with` blocks
    unwind (and clean up) like they do on Ctrl-C."""


def _raise_on_signal(signum, frame):
    raise _Terminated(f"received signal {signum}")


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass


def _kill_group(p: subprocess.Popen) -> None:
    _signal_group(p, signal.SIGKILL)


@atexit.register
def _close_all() -> None:
    with _live_lock:
        clusters = list(_live.values())
    for c in clusters:
        try:
            c.close()
        except Exception:
            pass


def stale_namespaces() -> List[str]:
    """Namespaces named by this module whose creating process no longer exists."""
    out = []
    for name in _netns_names():
        m = _NAME_RE.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            out.append(name)
    return out


def cleanup_stale() -> List[str]:
    names = stale_namespaces()
    for name in names:
        Cluster._kill_netns_pids(name)
        _ip("netns", "del", name, check=False)
    return names


# -- self check ------------------------------------------------------------------------------------

_TCP_SINK = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None; buf = bytearray(1 << 20)
while True:
    k = c.recv_into(buf)
    if not k: break
    if t0 is None: t0 = time.perf_counter()
    n += k
dt = time.perf_counter() - t0
print(f"{n} {dt}", flush=True)
"""

_TCP_SOURCE = r"""
import socket, sys, time
addr, port, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(200):
    try:
        c = socket.create_connection((addr, port), timeout=5); break
    except OSError: time.sleep(0.05)
buf = b"\0" * (1 << 20); sent = 0
while sent < total:
    sent += c.send(buf[: min(len(buf), total - sent)])
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


def tcp_throughput(cluster: Cluster, src: int, dst: int, nbytes: int = 64 << 20, port: int = 5201,
                   timeout: float = 60.0) -> float:
    """Bytes/s of one TCP stream from host src to host dst (both inside the cluster)."""
    sink = cluster.popen(dst, [sys.executable, "-c", _TCP_SINK, str(port)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = sink.stdout.readline()
        if line.strip() != "ready":
            raise NetnsError(f"tcp sink did not start: {line!r} {sink.stderr.read()}")
        cluster.run(src, [sys.executable, "-c", _TCP_SOURCE, cluster.ip(dst), str(port), str(nbytes)],
                    timeout=timeout, check=True)
        out, err = sink.communicate(timeout=timeout)
        n, dt = out.split()
        return int(n) / float(dt)
    finally:
        if sink.poll() is None:
            _kill_group(sink)
            sink.wait()


def _main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m rumor.testing.netns", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="build 2 hosts, ping, measure shaped TCP")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--list", action="store_true", help="list namespaces made by this module")
    ap.add_argument("--cleanup-stale", action="store_true", help="remove namespaces of dead processes")
    a = ap.parse_args(argv)
    if a.list:
        for name in _netns_names():
            if _NAME_RE.match(name):
                print(name, "(stale)" if name in stale_namespaces() else "")
        return 0
    if a.cleanup_stale:
        for name in cleanup_stale():
            print("removed", name)
        return 0
    ok, why = available()
    if not ok:
        print("unavailable:", why)
        return 1
    with Cluster(2, rate=a.rate) as c:
        print("namespaces:", " ".join(c.namespaces))
        if shutil.which("ping"):
            r = c.run(0, ["ping", "-c", "2", "-W", "2", c.ip(1)])
            print(r.stdout.strip().splitlines()[-1] if r.returncode == 0 else f"ping failed: {r.stdout}{r.stderr}")
        else:
            print("ping is not installed: reachability is shown by the TCP transfer below")
        bw = tcp_throughput(c, 0, 1)
        print(f"TCP host0 -> host1 through tbf {a.rate}: {bw / 1e6:.1f} MB/s")
        print(c.qdisc(0).strip())
    left = [n for n in c.namespaces if n in _netns_names()]
    print("cleaned up" if not left else f"LEFT BEHIND: {left}")
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(_main())
