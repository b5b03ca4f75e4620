"""The job secret and the private files rumor reads back.

Trust model (docs/security.md): processes of the same user are trusted; other local users and
anyone on the network are not. So:

- A per-job secret never enters torch's TCPStore (which any client on the network may read) nor
  the wire. Every connection proves it by HMAC challenge-response (csrc/net/auth.h) and values
  put in the store carry a MAC keyed by it.
- Files rumor reads back (elastic commits, the autotune cache, the local secret) live in a
  directory only this user can enter, are created with O_EXCL|O_NOFOLLOW and mode 0600, and are
  checked with fstat (a regular file, owned by this user, no group/other bits) before anything
  in them is trusted.

Where the secret comes from, first found wins:
  RUMOR_JOB_SECRET       the secret itself (at least 16 characters; a process's environment is
                         readable only by its own user);
  RUMOR_JOB_SECRET_FILE  a file holding it, owned by this user and not readable by others;
  one host               this user's secret: 32 random bytes (as hex) created once in
                         ~/.config/rumor/secret
                         (0600, in a 0700 directory; the private directory where there is no home),
                         shared by every rumor process of this user. It is stable across launches
                         and reboots, so what rumor MACs with it (elastic's disk commits, a
                         persistent data cache) stays readable by the next launch;
  otherwise              none: the job runs unauthenticated (one warning), its connection key
                         derived from the store's public session token, as before this module.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat
import tempfile
from dataclasses import dataclass
from typing import Optional

SECRET_ENV = "RUMOR_JOB_SECRET"
SECRET_FILE_ENV = "RUMOR_JOB_SECRET_FILE"
PRIVATE_DIR_ENV = "RUMOR_PRIVATE_DIR"
MIN_SECRET_CHARS = 16
_USER_SECRET = "secret"


class UntrustedFileError(PermissionError):
    """A file or directory rumor was about to trust is not private to this user."""


# ---- private directory and files ----------------------------------------------------------------

def private_dir(create: bool = True) -> str:
    """/dev/shm/rumor-<uid> (or RUMOR_PRIVATE_DIR): a directory only this user can enter.

    Checked with lstat every time: a directory, not a symlink, owned by this user, mode without
    group/other bits. Another user who created it first makes this raise (naming the path), it
    never makes rumor use it."""
    path = os.environ.get(PRIVATE_DIR_ENV) or os.path.join("/dev/shm", f"rumor-{os.geteuid()}")
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except (FileNotFoundError, PermissionError):
            # No (writable) /dev/shm, as in some containers: the temporary directory, same checks.
            if os.environ.get(PRIVATE_DIR_ENV):
                raise
            path = os.path.join(tempfile.gettempdir(), f"rumor-{os.geteuid()}")
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
    check_private_dir(path)
    return path


def untrusted_why(st: os.stat_result, kind: str = "file", forbid: int = 0o077) -> Optional[str]:
    """Why a file (kind "file") or directory ("dir") with this stat is not this user's own, or
    None: a symlink (from lstat), another type, another owner, or any mode bit in forbid."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if kind == "dir" and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not this user (uid {os.geteuid()})"
    if st.st_mode & forbid:
        who = "others can write it" if forbid == 0o022 else "group and others must have no access"
        return f"has mode {stat.S_IMODE(st.st_mode):04o}; {who}"
    return None


def check_private_dir(path: str) -> None:
    why = untrusted_why(os.lstat(path), "dir")
    if why:
        raise UntrustedFileError(f"rumor: the private directory {path} {why}; remove it or point "
                                 f"{PRIVATE_DIR_ENV} at a directory of your own (mode 0700)")


def _check_fd(fd: int, path: str) -> os.stat_result:
    st = os.fstat(fd)
    why = untrusted_why(st)
    if why:
        raise UntrustedFileError(f"rumor: refusing to read {path}: it {why}")
    return st


def read_private(path: str) -> bytes:
    """The bytes of a file this user owns and only this user can read; never follows a symlink.
    Raises FileNotFoundError when it does not exist and UntrustedFileError when it is not private."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UntrustedFileError(f"rumor: refusing to read {path}: it is a symbolic link") from None
        raise
    try:
        _check_fd(fd, path)
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_private(path: str, *chunks: bytes) -> None:
    """Writes path atomically with mode 0600: the bytes go to a fresh temporary name in the same
    directory (O_CREAT|O_EXCL|O_NOFOLLOW, so nothing planted there is followed or reused), then
    rename() replaces path (a symlink planted at path is replaced, not followed). A writer killed
    mid-write leaves the previous file intact."""
    d = os.path.dirname(path) or "."
    base = os.path.basename(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = os.path.join(d, f".{base}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(tmp, flags, 0o600)
            break
        except FileExistsError:
            continue
    else:
        raise OSError(errno.EEXIST, f"rumor: no free temporary name beside {path}")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            for c in chunks:
                f.write(c)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ---- MACs ---------------------------------------------------------------------------------------

def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over the parts, each length-prefixed so that no two splits collide."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def mac_ok(key: bytes, tag: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(mac(key, *parts), tag)


# ---- the secret ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobSecret:
    """secret: the job's secret bytes, or None (unauthenticated); source: where it came from."""

    secret: Optional[bytes]
    source: str

    @property
    def authenticated(self) -> bool:
        return self.secret is not None

    def key(self, label: str, session: bytes = b"") -> bytes:
        """A key for one purpose (label), bound to a session where one is given. Without a secret
        it is derived from the session alone: anyone who can read the store can compute it."""
        if self.secret is None:
            return mac(b"rumor/unauthenticated", label.encode(), session)
        return mac(self.secret, label.encode(), session)


def _from_text(text: str, where: str) -> bytes:
    s = text.strip()
    if len(s) < MIN_SECRET_CHARS:
        raise ValueError(f"rumor: the job secret from {where} has {len(s)} characters; "
                         f"give at least {MIN_SECRET_CHARS} (e.g. python -c 'import secrets; "
                         "print(secrets.token_hex(32))')")
    return s.encode()


def _user_dir() -> str:
    """Where this user's secret lives: RUMOR_PRIVATE_DIR when set, else ~/.config/rumor (or
    $XDG_CONFIG_HOME/rumor; 0700, owner checked), else the private directory (no usable home)."""
    if os.environ.get(PRIVATE_DIR_ENV):
        return private_dir()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    path = os.path.join(base, "rumor")
    try:
        os.makedirs(base, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        check_private_dir(path)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(path)
        return path
    except UntrustedFileError:
        raise
    except OSError:
        return private_dir()


def user_secret_path() -> str:
    """The file of this user's secret: 64 hex characters, so that it is also a valid
    RUMOR_JOB_SECRET_FILE (rumor.run points the NCCL net plugin at it)."""
    return os.path.join(_user_dir(), _USER_SECRET)


def user_secret() -> bytes:
    """This user's secret, created once and shared by every rumor process of this user (see the
    module docstring): the same bytes RUMOR_JOB_SECRET_FILE=user_secret_path() gives."""
    path = user_secret_path()
    try:
        return _user_secret_from(read_private(path), path)
    except FileNotFoundError:
        pass
    # Create under a temporary name, then link(): exactly one creator wins, every other process
    # (EEXIST) reads the winner's bytes.
    tmp = os.path.join(os.path.dirname(path), f".{_USER_SECRET}.{os.getpid()}.{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(os.urandom(32).hex().encode())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)
    return _user_secret_from(read_private(path), path)


def _user_secret_from(raw: bytes, path: str) -> bytes:
    s = raw.strip()
    if len(s) != 64 or any(c not in b"0123456789abcdef" for c in s):
        raise UntrustedFileError(f"rumor: {path} is not a rumor user secret (64 hex characters); remove it")
    return s


def given() -> Optional[JobSecret]:
    """The secret the user or the launcher gave (environment or file), or None."""
    env = os.environ
    if env.get(SECRET_ENV):
        return JobSecret(_from_text(env[SECRET_ENV], SECRET_ENV), SECRET_ENV)
    if env.get(SECRET_FILE_ENV):
        path = env[SECRET_FILE_ENV]
        try:
            raw = read_private(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"rumor: {SECRET_FILE_ENV}={path} does not exist") from None
        return JobSecret(_from_text(raw.decode("utf-8", "strict"), f"{SECRET_FILE_ENV}={path}"),
                         SECRET_FILE_ENV)
    return None


def resolve(single_host: bool) -> JobSecret:
    """The job's secret: given, else this user's secret when every rank runs on this host, else
    none (the caller warns once that the job is unauthenticated)."""
    g = given()
    if g is not None:
        return g
    if single_host:
        return JobSecret(user_secret(), "user")
    return JobSecret(None, "none")
