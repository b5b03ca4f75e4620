"""Emulated clusters on one machine: one Linux network namespace per "host".

Layout (nothing is added to the root namespace):

    <prefix>s                 the "switch": a namespace holding bridge br0
      br0 ── h0 ─┐ ┌─ h1 ...  switch-side veth ends, enslaved to br0
                 │ │
    <prefix>h0   eth0 = 10.213.0.1/24   (host 0: its own namespace, lo up)
    <prefix>h1   eth0 = 10.213.0.2/24   (host 1) ...

Each host's eth0 egress can be shaped with tbf (``rate`` argument, e.g. "1gbit"). Addresses live
only in namespaces this module creates, so the same private /24 can be reused by concurrent
instances.

WAN emulation (``delay``, ``jitter``, ``loss``; scalars, H x H matrices or functions of
(src, dst)): netem is not available on the kernels we run on, so delay, jitter and loss come from
``rumor-wanem`` (csrc/tools/wanem.cpp, shipped as rumor/lib/rumor-wanem), a forwarder running in
the caller's namespace that gives every host a TUN device ``wan0``. Each host routes its peers'
addresses (/32, more specific than eth0's /24) through wan0, so ``c.ip(j)`` is still what host i
dials; the forwarder holds every packet for its pair's one-way delay (plus jitter, without
reordering a pair's packets unless ``reorder=True``) or drops it with the pair's loss probability,
then writes it into the destination's wan0. With ``rate`` as well, the tbf shapes each host's wan0
egress instead of eth0, so a link has both. wan0's MTU is 65000 by default, so 1 Gbit takes about
2,000 packets/s through user space.

    with netns.Cluster(4, rate="1gbit", delay="50ms", jitter="1ms", loss=0.001) as c:
        ...   # 100 ms round trip between any two hosts, 0.1% of packets lost each way
    far = lambda i, j: "5ms" if i // 2 == j // 2 else "80ms"      # two pairs, far apart
    with netns.Cluster(4, delay=far) as c:
        print(c.wan_stats())   # the forwarder's counters: forwarded / lost per pair, lateness

    from rumor.testing import netns
    ok, why = netns.available()
    with netns.Cluster(4, rate="1gbit") as c:
        p = c.popen(1, ["python", "worker.py"], env=env)   # runs inside host 1's namespace
        ...
    # namespaces, veths, the bridge and qdiscs are gone here, also after an exception,
    # Ctrl-C or SIGTERM; processes started with popen() are killed first.

Command line: ``python -m rumor.testing.netns --check`` builds a 2-host cluster, pings across it and
measures TCP throughput through a shaped link; ``--check-wan --delay 50ms [--rate 1gbit]
[--loss 0.001]`` verifies the WAN element (ping round trip vs the setting, one TCP stream vs its
window/RTT bound, loss counted over UDP datagrams); ``--list`` / ``--cleanup-stale`` show or
remove namespaces left behind by dead processes (after a SIGKILL nothing could clean up).
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

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


# -- WAN parameters --------------------------------------------------------------------------------

WANEM_ENV = "RUMOR_WANEM"
WAN_TXQUEUELEN = 10000  # overrides where rumor-wanem is looked up (a build tree's binary)
PairValue = Union[None, float, str, Sequence[Sequence[Union[float, str]]], Callable[[int, int], Union[float, str]]]
_TIME_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|ms|us|ns)?\s*$")


def parse_time(v: Union[float, int, str]) -> float:
    """A duration in seconds: a number is seconds, a str may carry a unit ("50ms", "200us",
    "1.5s", "0ns"). Negative durations are refused."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if v < 0:
            raise ValueError(f"a duration must be >= 0, got {v}")
        return float(v)
    m = _TIME_RE.match(str(v))
    if not m:
        raise ValueError(f"bad duration {v!r} (examples: 50ms, 200us, 0.1s, or seconds as a number)")
    return float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[m.group(2) or "s"]


def _pair_matrix(name: str, v: PairValue, n: int, conv: Callable[[Any], float]) -> List[List[float]]:
    """v as an n x n matrix of floats (row = sending host): a scalar for every pair, a matrix, or a
    function of (src, dst). The diagonal is 0 (a host's traffic to itself never leaves it)."""
    if v is None:
        return [[0.0] * n for _ in range(n)]
    if callable(v):
        get = lambda i, j: v(i, j)  # noqa: E731
    elif isinstance(v, (int, float, str)) and not isinstance(v, bool):
        get = lambda i, j: v  # noqa: E731
    else:
        rows = [list(r) for r in v]  # type: ignore[union-attr]
        if len(rows) != n or any(len(r) != n for r in rows):
            raise ValueError(f"Cluster: {name} as a matrix must be {n} x {n} (hosts x hosts), got "
                             f"{len(rows)} rows of lengths {sorted({len(r) for r in rows})}")
        get = lambda i, j: rows[i][j]  # noqa: E731
    return [[0.0 if i == j else conv(get(i, j)) for j in range(n)] for i in range(n)]


_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit)?\s*$", re.IGNORECASE)


def parse_rate_bps(v: Union[float, int, str]) -> float:
    """A link rate in bits/s: a number is bits/s, a str may carry tc's units ("100mbit",
    "1gbit", "512kbit"). 0 means no rate of its own; negative rates are refused."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        r = float(v)
    else:
        m = _RATE_RE.match(str(v))
        if not m:
            raise ValueError(f"bad link rate {v!r} (examples: 100mbit, 1gbit, or bits/s as a number)")
        r = float(m.group(1)) * {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[(m.group(2) or "bit").lower()]
    if r < 0:
        raise ValueError(f"a link rate must be >= 0, got {v!r}")
    return r


def _probability(v: Any) -> float:
    p = float(v)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"Cluster: a loss probability must be in [0, 1], got {v!r}")
    return p


def wanem_path() -> str:
    """Full path of the rumor-wanem forwarder: $RUMOR_WANEM, else rumor/lib/rumor-wanem (built by
    CMake beside the NCCL net plugin). FileNotFoundError saying how to get it otherwise."""
    env = os.environ.get(WANEM_ENV)
    p = env or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lib", "rumor-wanem")
    if not (os.path.isfile(p) and os.access(p, os.X_OK)):
        how = (f"{WANEM_ENV}={env} is not an executable file" if env else
               f"{p} does not exist: it is built with the extension (CMake target rumor-wanem, "
               "`cmake --build <dir> --target rumor-wanem`); copy it there or set " + WANEM_ENV)
        raise FileNotFoundError(f"WAN emulation needs rumor-wanem: {how}")
    return p


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
    delay:   one-way delay of every pair ("50ms", 0.05), an H x H matrix of them (row = sender),
             or a function (src, dst) -> delay. Any of delay / jitter / loss / link_rate turns the WAN
             element on (module docstring); with none of them the cluster is as before.
    jitter:  added to each packet's delay, drawn per packet: uniform in `[-jitter, +jitter]` or
             normal with that standard deviation (jitter_dist), never making a delay negative.
             Same forms as delay.
    loss:    probability in `[0, 1]` that a packet of the pair is dropped; same forms as delay.
    link_rate: the pair's own wire ("100mbit", bits/s as a number; 0 or None: none), same forms
             as delay: links of different speeds, e.g. two sites, fast inside and slow between.
             Each pair's packets leave one after the other at its rate, behind a drop-tail queue
             of one bandwidth-delay product (256 KiB at least); `rate` (tbf) still shapes the host.
    link_wire: which pairs share one wire (and its link_rate and queue): a label per pair, same
             forms as delay (pairs with equal labels share; None: every pair its own), e.g. each
             host's one uplink to every host of another site.
    jitter_dist: "uniform" (default) or "normal".
    reorder: let jitter reorder a pair's packets (default False: a packet leaves no earlier than
             the one sent before it on the same pair).
    wan_mtu: MTU of the hosts' wan0 TUN devices (default 65000).
    seed:    seed of the forwarder's loss and jitter draws (runs are repeatable packet by packet
             only as far as the packets themselves are).
    wan_spin_us: the forwarder wakes this early and waits out the rest busy, so packets leave
             within a microsecond or so of their time instead of a timer wake-up's tens of
             microseconds late (default 50; 0 saves the CPU it costs).
    """

    def __init__(self, hosts: int, rate: Optional[str] = None, *, burst: str = "256kb",
                 latency: str = "20ms", shape_switch_side: bool = False, subnet: str = "10.213.0",
                 mtu: int = 1500, delay: PairValue = None, jitter: PairValue = None,
                 loss: PairValue = None, link_rate: PairValue = None, link_wire: PairValue = None,
                 jitter_dist: str = "uniform",
                 reorder: bool = False,
                 wan_mtu: int = 65000, seed: int = 1, wan_spin_us: int = 50):
        if not 1 <= int(hosts) <= 250:
            raise ValueError(f"Cluster: hosts must be in 1..250, got {hosts}")
        self.n = int(hosts)
        self.wan = any(v is not None for v in (delay, jitter, loss, link_rate))
        self.delays = _pair_matrix("delay", delay, self.n, parse_time)
        self.jitters = _pair_matrix("jitter", jitter, self.n, parse_time)
        self.losses = _pair_matrix("loss", loss, self.n, _probability)
        self.link_rates = _pair_matrix("link_rate", link_rate, self.n, parse_rate_bps)
        self.link_wires = self._wires(link_wire)
        if jitter_dist not in ("uniform", "normal"):
            raise ValueError(f"Cluster: jitter_dist must be 'uniform' or 'normal', got {jitter_dist!r}")
        if self.wan and shape_switch_side:
            raise ValueError("Cluster: shape_switch_side is not available with delay/jitter/loss "
                             "(host-to-host traffic then bypasses the switch); shape each host's "
                             "egress with rate")
        self.jitter_dist = jitter_dist
        self.reorder = bool(reorder)
        self.wan_mtu = int(wan_mtu)
        self.seed = int(seed)
        self.wan_spin_us = int(wan_spin_us)
        self.wan_ifname = "wan0"
        self._wanem: Optional[subprocess.Popen] = None
        self._wanem_err: Any = None
        self._wanem_buf = b""
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

    def _wires(self, link_wire: PairValue) -> List[int]:
        """Row-major wire index per pair: pairs with equal labels share the first one's index."""
        n = self.n
        if link_wire is None:
            return list(range(n * n))
        labels = _pair_matrix("link_wire", link_wire, n, lambda v: v)
        first: Dict[Any, int] = {}
        out = []
        for i in range(n):
            for j in range(n):
                k = i * n + j
                label = ("self", i) if i == j else labels[i][j]
                idx = first.setdefault(label, k)
                if self.link_rates[i][j] != self.link_rates[idx // n][idx % n]:
                    raise ValueError(f"Cluster: pairs ({idx // n}, {idx % n}) and ({i}, {j}) share wire {label!r} "
                                     "but not its link_rate")
                out.append(idx)
        return out

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
            if self.rate and not self.wan:
                self._tbf(h.netns, h.ifname)
                if self.shape_switch_side:
                    self._tbf(sw, h.switch_port)
        if self.wan and self.n > 1:
            self._start_wan()
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

    def _start_wan(self) -> None:
        us = lambda m: ",".join(str(int(round(v * 1e6))) for row in m for v in row)  # noqa: E731
        argv = [wanem_path(), "--ifname", self.wan_ifname, "--parent-pid", str(os.getpid()),
                "--seed", str(self.seed), "--jitter-dist", self.jitter_dist, "--spin-us", str(self.wan_spin_us),
                "--delay-us", us(self.delays), "--jitter-us", us(self.jitters),
                "--loss", ",".join(repr(v) for row in self.losses for v in row),
                "--rate-bps", ",".join(repr(v) for row in self.link_rates for v in row),
                "--wire-of", ",".join(str(w) for w in self.link_wires)]
        if self.reorder:
            argv.append("--reorder")
        for h in self.hosts:
            argv += ["--host", f"/run/netns/{h.netns}={h.ip}"]
        import tempfile
        self._wanem_err = tempfile.TemporaryFile()
        # Its own session: a Ctrl-C meant for the caller reaches it only through close().
        self._wanem = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=self._wanem_err, start_new_session=True)
        line = self._wanem_line(10.0)
        if line != "ready":
            raise NetnsError(f"rumor-wanem did not start (said {line!r}): {self._wanem_stderr()}")
        for h in self.hosts:
            # Routes to the peers' /32s through wan0 win over eth0's /24; the source stays the
            # host's eth0 address, so the peers see the same addresses as without emulation.
            # A long queue (and TUN ring) absorbs the forwarder's scheduling hiccups on a busy
            # machine instead of dropping packets before they reach the emulated link.
            cmds = [f"link set {self.wan_ifname} mtu {self.wan_mtu} txqueuelen {WAN_TXQUEUELEN} up"]
            cmds += [f"route add {p.ip}/32 dev {self.wan_ifname} src {h.ip}"
                     for p in self.hosts if p is not h]
            r = subprocess.run(["ip", "-n", h.netns, "-batch", "-"], input="\n".join(cmds) + "\n",
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=20)
            if r.returncode != 0:
                raise NetnsError(f"routing {h.netns} through {self.wan_ifname} failed: {r.stderr.strip()}")
            # Replies arrive on wan0 from addresses eth0's /24 also covers: no reverse-path filter.
            self.exec_run_ns(h.netns, ["sysctl", "-q", "-w", "net.ipv4.conf.all.rp_filter=0",
                                       f"net.ipv4.conf.{self.wan_ifname}.rp_filter=0"])
            # IPv6 router solicitations would only show up as "unroutable" in wan_stats().
            self.exec_run_ns(h.netns, ["sysctl", "-q", "-w", f"net.ipv6.conf.{self.wan_ifname}.disable_ipv6=1"])
            if self.rate:
                self._tbf(h.netns, self.wan_ifname)

    def _wanem_line(self, timeout: float) -> str:
        """The forwarder's next stdout line, waiting at most timeout seconds ("" if none came)."""
        p = self._wanem
        assert p is not None and p.stdout is not None
        deadline = time.monotonic() + timeout
        fd = p.stdout.fileno()
        while b"\n" not in self._wanem_buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return ""
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return ""
                self._wanem_buf += chunk
        line, self._wanem_buf = self._wanem_buf.split(b"\n", 1)
        return line.decode(errors="replace").strip()

    def _wanem_stderr(self) -> str:
        f = self._wanem_err
        if f is None:
            return ""
        try:
            f.seek(0)
            return f.read().decode(errors="replace").strip()[-2000:]
        except (OSError, ValueError):
            return ""

    def wan_stats(self, timeout: float = 5.0) -> Dict[str, Any]:
        """The WAN forwarder's counters: "forwarded" and "lost" (H x H lists, row = sender),
        "overflow" (dropped on a full queue), "unroutable", "write_errors", "queued" (held now),
        "released", and how late packets left: "late_mean_us", "late_max_us".

        Raises:
            RuntimeError: the cluster has no WAN element (no delay, jitter or loss asked for).
            NetnsError: the forwarder exited or did not answer within timeout seconds.
        """
        if self._wanem is None:
            raise RuntimeError("Cluster.wan_stats(): this cluster has no WAN element (give delay, jitter or loss)")
        if self._wanem.poll() is not None:
            raise NetnsError(f"rumor-wanem exited with status {self._wanem.returncode}: {self._wanem_stderr()}")
        self._wanem.send_signal(signal.SIGUSR1)
        line = self._wanem_line(timeout)
        if not line:
            raise NetnsError(f"rumor-wanem did not report its counters within {timeout} s: {self._wanem_stderr()}")
        return json.loads(line)

    def _stop_wan(self) -> None:
        p, self._wanem = self._wanem, None
        if p is not None:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(3)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
            if p.stdout is not None:
                p.stdout.close()
        if self._wanem_err is not None:
            self._wanem_err.close()
            self._wanem_err = None

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
            self._stop_wan()
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
        """`tc -s qdisc show dev IF` inside host i (for diagnostics), IF being the shaped
        interface: wan0 with WAN emulation, else eth0."""
        dev = self.wan_ifname if self._wanem is not None else self.hosts[i].ifname
        return self.exec_run_ns(self.hosts[i].netns, ["tc", "-s", "qdisc", "show", "dev", dev]).stdout

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
        line = read_line(sink, 30.0)
        if line != "ready":
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


# -- WAN checks: ping round trip, one TCP stream against its window/RTT bound, loss -----------------------

_ICMP_PING = r"""
import json, os, select, socket, struct, sys, time
addr, count, gap, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
def csum(b):
    b += b"\0" * (len(b) & 1); x = sum(struct.unpack(f"!{len(b) // 2}H", b))
    x = (x >> 16) + (x & 0xFFFF); x += x >> 16
    return ~x & 0xFFFF
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
ident = os.getpid() & 0xFFFF; rtts = []; lost = 0; pad = bytes(56)
for k in range(count):
    hdr = struct.pack("!BBHHH", 8, 0, 0, ident, k)
    pkt = struct.pack("!BBHHH", 8, 0, csum(hdr + pad), ident, k) + pad
    t0 = time.perf_counter(); s.sendto(pkt, (addr, 0)); deadline = t0 + wait
    while True:
        left = deadline - time.perf_counter()
        if left <= 0 or not select.select([s], [], [], left)[0]:
            lost += 1; break
        d = s.recv(2048); t = time.perf_counter(); ihl = (d[0] & 15) * 4
        typ, _, _, i, seq = struct.unpack_from("!BBHHH", d, ihl)
        if typ == 0 and i == ident and seq == k:
            rtts.append(t - t0); break
    time.sleep(gap)
print(json.dumps({"rtts": rtts, "lost": lost}))
"""


def ping_rtt(cluster: Cluster, src: int, dst: int, count: int = 50, gap: float = 0.01,
             wait: float = 5.0) -> Dict[str, Any]:
    """Round trips of count ICMP echo requests from host src to host dst, answered by dst's kernel
    (a raw socket: the machines we run on have no ping binary): `{"rtts": [seconds, ...], "lost":
    requests without an answer within wait s}`."""
    r = cluster.run(src, [sys.executable, "-c", _ICMP_PING, cluster.ip(dst), str(count), str(gap), str(wait)],
                    timeout=count * (gap + wait) + 30, check=True)
    return json.loads(r.stdout)


_UDP_COUNT = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20); s.bind(("0.0.0.0", int(sys.argv[1])))
idle, deadline = float(sys.argv[2]), time.monotonic() + float(sys.argv[3]); seen = set()
print("ready", flush=True); s.settimeout(deadline - time.monotonic())
try:
    while True:
        d = s.recv(2048); seen.add(int.from_bytes(d[:4], "big")); s.settimeout(idle)
except (socket.timeout, ValueError):
    pass
print(len(seen), flush=True)
"""

_UDP_FLOOD = r"""
import socket, sys, time
addr, port, count, pps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); pad = bytes(60); t0 = time.perf_counter()
for k in range(count):
    s.sendto(k.to_bytes(4, "big") + pad, (addr, port))
    if k % 50 == 49:
        ahead = t0 + (k + 1) / pps - time.perf_counter()
        if ahead > 0: time.sleep(ahead)
"""


def udp_delivered(cluster: Cluster, src: int, dst: int, count: int = 20000, pps: float = 20000.0,
                  port: int = 5302, idle: float = 1.0) -> int:
    """Sends count numbered UDP datagrams from host src to host dst at pps per second and
    returns how many distinct ones arrived (the receiver stops idle s after the last one)."""
    sink = cluster.popen(dst, [sys.executable, "-c", _UDP_COUNT, str(port), str(idle), str(count / pps + 60)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if read_line(sink, 30.0) != "ready":
            raise NetnsError(f"udp sink did not start: {sink.stderr.read()}")
        cluster.run(src, [sys.executable, "-c", _UDP_FLOOD, cluster.ip(dst), str(port), str(count), str(pps)],
                    timeout=count / pps + 60, check=True)
        out, err = sink.communicate(timeout=count / pps + 90)
        return int(out.split()[-1])
    finally:
        if sink.poll() is None:
            _kill_group(sink)
            sink.wait()


_TCP_TIMED_SINK = r"""
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
if int(sys.argv[2]) > 0:  # before listen(): the window scale is agreed in the handshake
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, int(sys.argv[2]))
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); buf = bytearray(4 << 20); marks = []; n = 0
while True:
    k = c.recv_into(buf)
    if not k: break
    n += k; marks.append((time.perf_counter(), n))
rcvbuf = c.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF); c.close()
print(json.dumps({"marks": marks[:: max(1, len(marks) // 500)] + marks[-1:], "rcvbuf": rcvbuf}), flush=True)
"""

_TCP_TIMED_SOURCE = r"""
import json, socket, struct, sys, time
addr, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
for _ in range(200):
    try:
        c = socket.create_connection((addr, port), timeout=10); break
    except OSError: time.sleep(0.05)
buf = b"\0" * (1 << 20); t0 = time.perf_counter(); end = t0 + seconds; wnd = []; last = 0.0
while True:
    t = time.perf_counter()
    if t >= end: break
    c.send(buf)
    if t - last > 0.01:
        last = t; i = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        # struct tcp_info (linux/tcp.h): tcpi_snd_mss at byte 16, tcpi_rtt at 68, tcpi_snd_cwnd
        # at 80, tcpi_total_retrans at 100, tcpi_snd_wnd (the peer's advertised window, bytes)
        # at 228 on kernels from 6.x.
        mss, = struct.unpack_from("I", i, 16); rtt, = struct.unpack_from("I", i, 68)
        cwnd, = struct.unpack_from("I", i, 80); retr, = struct.unpack_from("I", i, 100)
        snd_wnd = struct.unpack_from("I", i, 228)[0] if len(i) >= 232 else 0
        wnd.append((t, snd_wnd, rtt, retr, cwnd * mss))
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
print(json.dumps({"samples": wnd}), flush=True)
"""


def tcp_stream(cluster: Cluster, src: int, dst: int, seconds: float = 4.0, rcvbuf: int = 0,
               port: int = 5203) -> Dict[str, Any]:
    """One TCP stream from host src to host dst for `seconds`; rcvbuf > 0 sets the receiver's
    SO_RCVBUF (else the kernel autotunes up to tcp_rmem). The rate is taken over the second half
    of the transfer (slow start left out), with the mean advertised window the sender saw then.

    Returns:
        A dict: "rate" (bytes/s), "window" (bytes: the mean tcpi_snd_wnd, the receiver's
        advertised window), "cwnd" (bytes: the mean congestion window), "srtt" (s: the kernel's
        smoothed RTT), "retrans" (segments retransmitted), "rcvbuf" (the receiver's SO_RCVBUF),
        "bytes" (total).
    """
    sink = cluster.popen(dst, [sys.executable, "-c", _TCP_TIMED_SINK, str(port), str(int(rcvbuf))],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if read_line(sink, 30.0) != "ready":
            raise NetnsError(f"tcp sink did not start: {sink.stderr.read()}")
        r = cluster.run(src, [sys.executable, "-c", _TCP_TIMED_SOURCE, cluster.ip(dst), str(port), str(seconds)],
                        timeout=seconds + 60, check=True)
        out, _ = sink.communicate(timeout=60)
    finally:
        if sink.poll() is None:
            _kill_group(sink)
            sink.wait()
    got = json.loads(out)
    marks = got["marks"]
    t_first, t_last = marks[0][0], marks[-1][0]
    t_half = t_first + (t_last - t_first) / 2
    n_half = next(n for t, n in marks if t >= t_half)
    rate = (marks[-1][1] - n_half) / max(1e-9, t_last - t_half)
    samples = json.loads(r.stdout)["samples"]
    late = [x for x in samples if x[0] >= t_half] or samples
    return {"rate": rate, "window": sum(x[1] for x in late) / len(late),
            "cwnd": sum(x[4] for x in late) / len(late),
            "srtt": sum(x[2] for x in late) / len(late) / 1e6, "retrans": samples[-1][3] if samples else 0,
            "rcvbuf": got["rcvbuf"], "bytes": marks[-1][1]}


def check_wan(delay: str = "50ms", rate: Optional[str] = None, loss: float = 0.001, jitter: Optional[str] = None,
              probes: int = 50, datagrams: int = 50000, seconds: float = 4.0,
              rcvbufs: Sequence[int] = (1 << 20, 4 << 20, 0), seed: int = 1, out=print) -> Dict[str, Any]:
    """Builds 3 hosts with `delay` one way between every pair (and `rate` on each host's egress),
    loss only between hosts 0 and 2, and measures: the ping round trip 0->1 against 2 x delay, one
    TCP stream 0->1 per receive buffer in rcvbufs (SO_RCVBUF; 0: kernel-autotuned) against
    min(rate, window / RTT), and the share of `datagrams` UDP datagrams 0->2 lost against `loss`.
    Prints each figure with its ratio to the setting and returns them all. seed: the
    forwarder's (which packets are lost); the same seed loses the same datagrams."""
    d = parse_time(delay)
    rtt_set = 2 * d
    losses = [[0.0] * 3 for _ in range(3)]
    losses[0][2] = losses[2][0] = float(loss)
    res: Dict[str, Any] = {"delay_s": d, "rtt_set_s": rtt_set, "rate": rate, "loss_set": loss, "jitter": jitter}
    rate_bps = _rate_bytes(rate) if rate else None
    with Cluster(2) as c:  # the hosts' own round trip, without the element, for reference
        base = sorted(ping_rtt(c, 0, 1, count=20, gap=0.005)["rtts"])
        base_med = base[len(base) // 2]
    with Cluster(3, rate=rate, delay=d, jitter=jitter, loss=losses, seed=seed) as c:
        out(f"set: one-way delay {d * 1e3:g} ms (RTT {rtt_set * 1e3:g} ms), jitter {jitter or 0}, "
            f"rate {rate or 'unshaped'}, loss {loss:g} between host0 and host2")
        # A sender's buffer (tcp_wmem, 4 MiB at most by default) caps a stream at wmem/RTT long
        # before the receiver's window does: raise it to tcp_rmem's maximum so the window is the
        # limit the check compares against.
        rmem = c.exec_run_ns(c.host(0).netns, ["sysctl", "-n", "net.ipv4.tcp_rmem"]).stdout.split()
        wmem = f"4096 16384 {rmem[2]}" if len(rmem) == 3 else "4096 16384 33554432"
        for h in c.hosts:
            c.exec_run_ns(h.netns, ["sysctl", "-q", "-w", f"net.ipv4.tcp_wmem={wmem}"])
        res["tcp_rmem"], res["tcp_wmem"] = " ".join(rmem), wmem
        out(f"hosts: tcp_rmem {' '.join(rmem)}, tcp_wmem raised to {wmem}")
        p = ping_rtt(c, 0, 1, count=probes)
        rtts = sorted(p["rtts"])
        med = rtts[len(rtts) // 2]
        res["rtt"] = {"median_s": med, "min_s": rtts[0], "max_s": rtts[-1], "lost": p["lost"],
                      "ratio": med / rtt_set if rtt_set else None, "base_s": base_med,
                      "ratio_less_base": (med - base_med) / rtt_set if rtt_set else None}
        out(f"RTT host0->host1 (ICMP echo, {len(rtts)} probes): median {med * 1e3:.3f} ms, min "
            f"{rtts[0] * 1e3:.3f}, max {rtts[-1] * 1e3:.3f}; set {rtt_set * 1e3:g} ms; ratio "
            + (f"{med / rtt_set:.4f}; less the hosts' own {base_med * 1e3:.3f} ms (no element): "
               f"{(med - base_med) / rtt_set:.4f}" if rtt_set else "n/a"))
        res["tcp"] = []
        for rb in rcvbufs:
            label = f"SO_RCVBUF {rb >> 10} KiB" if rb else "rcvbuf autotuned"
            t = tcp_stream(c, 0, 1, seconds=seconds, rcvbuf=rb)
            # The receiver's window is the bound the emulation must honour; the congestion
            # window (growing in slow start, cut by tbf's drops) is printed beside it.
            wbound = t["window"] / rtt_set if rtt_set else float("inf")
            bound = min(wbound, rate_bps) if rate_bps else wbound
            limit = "rate" if rate_bps and rate_bps < wbound else "receive window"
            if t["cwnd"] < t["window"] and t["cwnd"] / rtt_set < bound:
                limit = "congestion window"
            elif t["rate"] < 0.9 * bound:
                # Neither window nor rate explains it: the end hosts' processes (CPU) do.
                limit = "the end hosts, not the link (window and cwnd allow more)"
            t.update(label=label, window_bound=wbound, rate_bound=rate_bps, bound=bound, ratio=t["rate"] / bound,
                     limit=limit)
            res["tcp"].append(t)
            out(f"TCP host0->host1 ({label}, rcvbuf {t['rcvbuf'] >> 10} KiB): {t['rate'] / 1e6:.1f} MB/s; "
                f"window {t['window'] / 1e6:.2f} MB / RTT {rtt_set * 1e3:g} ms = {wbound / 1e6:.1f} MB/s"
                + (f", rate {rate_bps / 1e6:.1f} MB/s" if rate_bps else "")
                + f"; bound {bound / 1e6:.1f} MB/s; ratio {t['rate'] / bound:.3f} "
                f"(cwnd {t['cwnd'] / 1e6:.2f} MB, kernel srtt {t['srtt'] * 1e3:.1f} ms, "
                f"{t['retrans']} retransmits; limited by {limit})")
        before = c.wan_stats()
        queue_drops0 = _tx_dropped(c, 0)
        got = udp_delivered(c, 0, 2, count=datagrams, pps=25000.0, idle=max(1.0, 4 * rtt_set))
        after = c.wan_stats()
        dropped = after["lost"][0][2] - before["lost"][0][2]
        passed = after["forwarded"][0][2] - before["forwarded"][0][2]
        measured = 1 - got / datagrams
        queue_drops = _tx_dropped(c, 0) - queue_drops0
        # Losses are Bernoulli draws: the count has a binomial spread, 2 sigma ~ 95% of runs.
        spread = 2 * (datagrams * loss * (1 - loss)) ** 0.5
        lo, hi = max(0.0, datagrams * loss - spread), datagrams * loss + spread
        res["loss"] = {"sent": datagrams, "received": got, "measured": measured,
                       "forwarder_dropped": dropped, "forwarder_passed": passed, "queue_drops": queue_drops,
                       "expected_95": [lo, hi], "ratio": measured / loss if loss else None}
        out(f"loss host0->host2: {datagrams - got} of {datagrams} UDP datagrams lost = {measured:.5f}; set {loss:g}; "
            + (f"ratio {measured / loss:.3f}; " if loss else "")
            + f"95% of runs lose {lo:.0f}..{hi:.0f} (forwarder dropped {dropped}, passed {passed}; "
            f"{queue_drops} dropped on host0's full wan0 queue before the forwarder)")
        st = c.wan_stats()
        res["forwarder"] = {k: st[k] for k in ("late_mean_us", "late_max_us", "overflow", "write_errors")}
        out(f"forwarder: packets left {st['late_mean_us']:.1f} us after their time on average "
            f"(max {st['late_max_us']:.0f} us); overflow drops {st['overflow']}, write errors {st['write_errors']}")
    return res


def read_line(p: subprocess.Popen, timeout: float) -> str:
    """The next line p writes on its stdout (a text pipe), stripped; "" if none comes within
    timeout seconds or p closes it first."""
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    return p.stdout.readline().strip() if ready else ""


def _tx_dropped(c: Cluster, i: int) -> int:
    r = c.exec_run_ns(c.host(i).netns, ["cat", f"/sys/class/net/{c.wan_ifname}/statistics/tx_dropped"])
    return int(r.stdout.strip() or 0)


def _rate_bytes(rate: str) -> float:
    """A tc rate ("1gbit", "100mbit", "500kbit") in bytes/s."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)bit\s*", rate.lower())
    if not m:
        raise ValueError(f"bad rate {rate!r} (examples: 1gbit, 100mbit)")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)] / 8


def _main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m rumor.testing.netns", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="build 2 hosts, ping, measure shaped TCP")
    ap.add_argument("--rate", default="1gbit", help="tbf rate ('none': unshaped; --check-wan: default unshaped)")
    ap.add_argument("--check-wan", action="store_true",
                    help="verify the WAN element: ping RTT, one TCP stream vs window/RTT, loss")
    ap.add_argument("--delay", default="50ms", help="--check-wan: one-way delay (default 50ms)")
    ap.add_argument("--jitter", default=None, help="--check-wan: jitter (default none)")
    ap.add_argument("--loss", type=float, default=0.001, help="--check-wan: loss between host0 and host2")
    ap.add_argument("--json", default=None, help="--check-wan: also write the figures to this file")
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
    rate = None if a.rate.lower() == "none" else a.rate
    if a.check_wan:
        wan_rate = rate if "--rate" in (argv if argv is not None else sys.argv) else None
        res = check_wan(delay=a.delay, rate=wan_rate, loss=a.loss, jitter=a.jitter)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        left = [n for n in _netns_names() if _NAME_RE.match(n) and int(_NAME_RE.match(n).group(1)) == os.getpid()]
        print("cleaned up" if not left else f"LEFT BEHIND: {left}")
        return 0 if not left else 1
    with Cluster(2, rate=rate) as c:
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
