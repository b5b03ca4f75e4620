"""Where the ranks of an interactive session run: parsing hosts=, laying ranks out over them,
and the command that starts an engine on a host (ssh by default, or the caller's launcher).

No ipyparallel or torch here: this module is imported by the argument checks of start().
"""
from __future__ import annotations

import shlex
import socket
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

Launcher = Union[None, str, Sequence[str], Callable[[str, List[str]], Sequence[str]]]

# What ssh gets before the host: no password prompt that would hang start(), and a bounded
# connect, so an unreachable host fails inside start_timeout with ssh's own message.
SSH = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]


@dataclass(frozen=True)
class HostRanks:
    """One host of the layout: its name (as the user wrote it) and the global ranks it runs,
    contiguous; local_rank of ranks[i] is i and its local world size is len(ranks)."""
    name: str
    ranks: tuple

    @property
    def size(self) -> int:
        return len(self.ranks)


def _split_entry(entry: object, what: str):
    """'host' -> (host, None); 'host:4' -> (host, 4); '[fe80::1]:2' -> ('fe80::1', 2)."""
    if not isinstance(entry, str):
        raise TypeError(f"{what}: every hosts entry must be a str like 'node1' or 'node1:4', "
                        f"got {type(entry).__name__} {entry!r}")
    e = entry.strip()
    if e.startswith("["):
        host, sep, rest = e[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{what}: hosts entry {entry!r}: an address in brackets is written "
                             "'[addr]' or '[addr]:slots'")
        slots = rest[1:] if rest else None
    elif e.count(":") == 1:
        host, _, slots = e.partition(":")
    else:
        host, slots = e, None  # a bare IPv6 address, or no slots given
    if not host or any(c.isspace() for c in host) or host.startswith("-"):
        # A leading '-' would be read by ssh as an option.
        raise ValueError(f"{what}: hosts entry {entry!r}: the host name must be non-empty, without "
                         "spaces, and must not start with '-'")
    if slots is not None:
        if not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"{what}: hosts entry {entry!r}: slots must be a positive whole number "
                             f"('{host}:2'), got {slots!r}")
        return host, int(slots)
    return host, None


def layout(hosts: Sequence[str], n: int, what: str = "rumor.interactive.start()") -> List[HostRanks]:
    """Lays n ranks out over hosts, contiguous per host (ranks 0..s0-1 on the first host, ...).

    With 'host:slots' entries the hosts are filled in order and hosts left without a rank are
    dropped; slots must add up to at least n. With bare names only, n is split evenly (the
    first n % len(hosts) hosts get one more rank). Mixing the two forms is an error, as is a
    host named twice."""
    if isinstance(hosts, str) or not isinstance(hosts, (list, tuple)):
        raise TypeError(f"{what}: hosts must be a list of host names like ['node1:2', 'node2:2'], "
                        f"got {type(hosts).__name__}")
    if not hosts:
        raise ValueError(f"{what}: hosts must not be empty (leave it out to run every rank on this host)")
    parsed = [_split_entry(h, what) for h in hosts]
    seen = {}
    for entry, (host, _) in zip(hosts, parsed):
        if host in seen:
            raise ValueError(f"{what}: hosts entry {entry!r} names host {host!r} again (first as {seen[host]!r}); "
                             "give each host once, with its slots")
        seen[host] = entry
    with_slots = [s is not None for _, s in parsed]
    if any(with_slots) and not all(with_slots):
        bare = [e for e, w in zip(hosts, with_slots) if not w]
        raise ValueError(f"{what}: hosts entries {bare} have no slots while others do; "
                         "write 'host:slots' for every host, or for none (then n is split evenly)")
    if all(with_slots):
        total = sum(s for _, s in parsed)
        if total < n:
            raise ValueError(f"{what}: hosts offer {total} slot(s) ({', '.join(map(str, hosts))}) "
                             f"but n={n} ranks were asked for")
        counts = []
        left = n
        for _, s in parsed:
            counts.append(min(s, left))
            left -= counts[-1]
    else:
        if len(parsed) > n:
            raise ValueError(f"{what}: {len(parsed)} hosts for n={n} rank(s); every host named "
                             "without slots gets at least one rank")
        q, r = divmod(n, len(parsed))
        counts = [q + (1 if i < r else 0) for i in range(len(parsed))]
    out, first = [], 0
    for (host, _), c in zip(parsed, counts):
        if c:
            out.append(HostRanks(host, tuple(range(first, first + c))))
            first += c
    return out


def local_names() -> set:
    names = {"localhost", "127.0.0.1", "::1"}
    for f in (socket.gethostname, socket.getfqdn):
        try:
            names.add(f())
        except OSError:
            pass
    return names


def is_local(host: str) -> bool:
    return host in local_names()


def check_launcher(launcher: Launcher, what: str = "rumor.interactive.start()") -> None:
    if launcher is None or callable(launcher):
        return
    words = shlex.split(launcher) if isinstance(launcher, str) else launcher
    if isinstance(words, (list, tuple)) and words and all(isinstance(w, str) for w in words):
        if not any("{host}" in w for w in words):
            raise ValueError(f"{what}: launcher {launcher!r} must contain '{{host}}' where the host name goes, "
                             "e.g. 'ip netns exec {host}' or ['ssh', '-p', '2222', '{host}']")
        return
    raise TypeError(f"{what}: launcher must be None (ssh), a command template with '{{host}}' "
                    f"(str or list of str), or a callable (host, argv) -> argv; got {type(launcher).__name__}")


def command(launcher: Launcher, host: str, argv: List[str], local: bool) -> List[str]:
    """The local command that runs argv on host.

    None: ssh, the remote command quoted into one string for the remote shell; a host of this
    machine (localhost, its own name) runs argv directly. A template ('ip netns exec {host}' or
    a list of words): '{host}' replaced, argv appended word by word. A callable: whatever it
    returns for (host, argv)."""
    if launcher is None:
        if local:
            return list(argv)
        return [*SSH, host, shlex.join(argv)]
    if callable(launcher):
        cmd = launcher(host, list(argv))
        if isinstance(cmd, str) or not all(isinstance(w, str) for w in cmd):
            raise TypeError(f"rumor.interactive: launcher({host!r}, argv) must return a list of str, got {cmd!r}")
        return list(cmd)
    words = shlex.split(launcher) if isinstance(launcher, str) else list(launcher)
    return [w.replace("{host}", host) for w in words] + list(argv)


def engine_count_label(hosts: List[HostRanks]) -> str:
    return ", ".join(f"{h.name} x{h.size}" for h in hosts)


def route_address(host: str, port: int = 9) -> Optional[str]:
    """This machine's address on the route to host (None if host does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return None
    for *_, addr in infos:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(addr)  # a UDP connect sends nothing
                return s.getsockname()[0]
        except OSError:
            continue
    return None
