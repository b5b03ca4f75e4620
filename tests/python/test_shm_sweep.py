"""The /dev/shm sweep (rumor._shm) with the core's name format (owner tags carry a random part)
and names it must never touch: another user's, and links planted under a rumor name."""
import os
import subprocess
import sys

import pytest

from rumor import _shm


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_random_tags_are_parsed_and_swept(tmp_path):
    ns, gone = _shm._pid_namespace(), _dead_pid()
    me = f"{ns}.{os.getpid()}.0123456789abcdef"
    dead = f"{ns}.{gone}.fedcba9876543210"
    names = {
        f"rumor-00aa-db-1@{dead}": True,
        f"rumor-00aa-db-0@{me}": False,
        f"rumor-00aa-c0-0-1@{me}+{dead}": False,
        f"rumor-00aa-c0-1-2@{dead}+{dead}": True,
    }
    assert _shm.owners(f"rumor-00aa-db-1@{dead}") == [(ns, gone)]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    removed = _shm.sweep(str(tmp_path))
    assert sorted(removed) == sorted(n for n, g in names.items() if g)


def test_never_removes_another_users_name_or_a_link(tmp_path):
    ns, gone = _shm._pid_namespace(), _dead_pid()
    tag = f"{ns}.{gone}.00ff"
    target = tmp_path / "precious"
    target.write_bytes(b"x")
    link = tmp_path / f"rumor-00aa-db-5@{tag}"
    os.symlink(target, link)
    names = [link.name]
    if os.geteuid() == 0:
        foreign = tmp_path / f"rumor-00aa-db-6@{tag}"
        foreign.write_bytes(b"x")
        os.chown(foreign, 65534, 65534)
        names.append(foreign.name)
    assert _shm.sweep(str(tmp_path)) == []
    for n in names:
        assert os.path.lexists(tmp_path / n)
    assert target.exists()
