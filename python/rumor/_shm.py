"""Sweeping /dev/shm of names that dead rumor processes left behind.

rumor unlinks every shared-memory name as soon as all its users have mapped it, but a process
killed in between (SIGKILL during init, say) cannot. Every name ends with "@" and the tags
("<pid namespace inode>.<pid>", followed in the core's names by ".<random hex>", which makes
them unpredictable to other local users) of the processes that own it; a name whose owners are
all gone is garbage. Only names owned by this user (and regular files, not links) are ever
removed. The launcher (rumor.run) sweeps when its workers have exited, and rumor.init()
sweeps before it creates its own names, so a restarted job starts on a clean /dev/shm.
rumor.elastic's commits and rumor-run --tls auto's certificates live in this user's private
directory (rumor._secret.private_dir()), swept by the same rule, with the temporary files a
killed writer left there.
"""
from __future__ import annotations

import os
import re
import stat
from typing import List, Optional

from . import _secret

SHM_DIR = "/dev/shm"
# rumor-<token>-...: the core's segments; rumor_elastic-...: rumor.elastic's commits, owned by
# the launcher's agent (they outlive the workers on purpose, not the job); rumor_tls-...: the
# certificates of rumor-run --tls auto, owned by the launcher (rumor._tlsauto).
_TAG = r"\d+\.\d+(?:\.[0-9a-f]+)?"
_NAME = re.compile(r"^rumor(?:-[0-9a-f]+|_elastic|_tls)-.+@(" + _TAG + r"(?:\+" + _TAG + r")*)$")
# rumor._secret.write_private's temporary names: ".<name>.<writer pid>.<random hex>.tmp".
TMP_NAME = re.compile(r"^\.(.+)\.\d+\.[0-9a-f]+\.tmp$")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # someone else's live process
    try:  # exited but not reaped yet
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:][:1] in (b"Z", b"X")
    except (OSError, ValueError):
        return False


def owners(name: str):
    """[(pid namespace, pid)] of a rumor shared-memory name, or None for other names."""
    m = _NAME.match(name)
    if m is None:
        return None
    return [tuple(int(x) for x in tag.split(".")[:2]) for tag in m.group(1).split("+")]


def sweep(directory: Optional[str] = None) -> List[str]:
    """Unlinks rumor names whose owners have all exited; returns the names removed. Names owned
    by a process of another pid namespace are left alone: their pids mean nothing here. Without
    a directory: /dev/shm and this user's private directory (if there is one)."""
    if directory is not None:
        return _sweep(directory, temporaries=False)
    removed = _sweep(SHM_DIR, temporaries=False)
    try:
        private = _secret.private_dir(create=False)
    except OSError:  # none yet, or not ours (then it is not swept either)
        return removed
    return removed + _sweep(private, temporaries=True)


def _sweep(directory: str, temporaries: bool) -> List[str]:
    """temporaries: a write_private temporary file counts as owned by the name it would replace."""
    ns = _pid_namespace()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = TMP_NAME.match(name) if temporaries else None
        tags = owners(m.group(1) if m else name)
        if not tags or any(t_ns != ns or not _gone(pid) for t_ns, pid in tags):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        # Another user's name (or a link planted under a rumor name) is never ours to remove.
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
            continue
        try:
            os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            pass  # another sweeper was first
        except OSError:
            pass
    return removed
