"""Reading rumor's RUMOR_* environment variables (docs/environment.md lists every one).

A value that cannot be parsed raises ValueError naming the variable, the value and what is
accepted: a typo in a launch script should stop the job, not fall back to a default silently.
An unset or empty variable gives the default. This is the ground layer so that everything
that reads the environment (the rendezvous included) can share one parser.
"""
from __future__ import annotations

import math
import os
from typing import Mapping, Optional, Sequence

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

# The C++ core's log levels (csrc/core/log.cpp), read by it on its first log line.
LOG_LEVELS = ("error", "warn", "info", "debug")
# "generic" forces the scalar kernels; anything else lets the CPU choose (csrc/core/isa_dispatch.h).
ISA_CHOICES = ("auto", "avx2", "generic")
ISA_VARS = ("RUMOR_CODEC_ISA", "RUMOR_OPTIM_ISA", "RUMOR_POWERSGD_ISA")
# The NCCL net plugin's numbers and their ranges (csrc/netplugin/setup.cpp). The plugin runs
# inside NCCL and can only log a bad value and use its default; a rumor process checks first.
NET_PLUGIN_INTS = {"RUMOR_NET_PLUGIN_STREAMS": (1, 16), "RUMOR_NET_PLUGIN_CHUNK_KB": (4, 16384),
                   "RUMOR_NET_PLUGIN_TIMEOUT": (1, 86400), "RUMOR_NET_PLUGIN_HELLO_TIMEOUT": (1, 86400),
                   "RUMOR_NET_PLUGIN_TRACE": (0, 1000000), "RUMOR_NET_PLUGIN_TLS": (0, 1)}


def _raw(name: str, env: Optional[Mapping[str, str]]) -> Optional[str]:
    v = (os.environ if env is None else env).get(name)
    if v is None or v.strip() == "":
        return None
    return v


def _bad(name: str, raw: str, accepted: str) -> ValueError:
    return ValueError(f"environment variable {name}={raw!r} is not valid: expected {accepted}")


def env_bool(name: str, default: bool, env: Optional[Mapping[str, str]] = None) -> bool:
    raw = _raw(name, env)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise _bad(name, raw, f"one of {', '.join(_TRUE)} (on) or {', '.join(_FALSE)} (off)")


def env_int(name: str, default: Optional[int], minimum: Optional[int] = None, maximum: Optional[int] = None,
            env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    raw = _raw(name, env)
    if raw is None:
        return default
    try:
        n = int(raw.strip(), 10)
    except ValueError:
        n = None
    if n is None or (minimum is not None and n < minimum) or (maximum is not None and n > maximum):
        raise _bad(name, raw, _range("an integer", minimum, maximum))
    return n


def env_float(name: str, default: Optional[float], minimum: Optional[float] = None, positive: bool = False,
              env: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """A finite number; positive=True refuses 0 too."""
    raw = _raw(name, env)
    if raw is None:
        return default
    try:
        x = float(raw.strip())
    except ValueError:
        x = math.nan
    if not math.isfinite(x) or (positive and x <= 0) or (minimum is not None and x < minimum):
        what = "a finite number" + (" > 0" if positive else "")
        raise _bad(name, raw, _range(what, minimum, None))
    return x


def env_choice(name: str, choices: Sequence[str], default: str, env: Optional[Mapping[str, str]] = None,
               exact: bool = False) -> str:
    """One of choices, compared in lower case without surrounding blanks; exact=True for the
    variables the C++ core compares byte for byte (there "INFO" would not be "info")."""
    raw = _raw(name, env)
    if raw is None:
        return default
    v = raw if exact else raw.strip().lower()
    if v not in choices:
        raise _bad(name, raw, f"one of {', '.join(choices)}")
    return v


def check_core_env(env: Optional[Mapping[str, str]] = None) -> None:
    """The variables the C++ code reads by itself and would otherwise take any value of (an
    unknown RUMOR_LOG level meant "warn", an unknown ISA meant "auto", a bad net plugin number
    its default)."""
    env_choice("RUMOR_LOG", LOG_LEVELS, "warn", env, exact=True)
    for name in ISA_VARS:
        env_choice(name, ISA_CHOICES, "auto", env, exact=True)
    for name, (lo, hi) in NET_PLUGIN_INTS.items():
        env_int(name, None, minimum=lo, maximum=hi, env=env)


def _range(what: str, lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"{what} from {lo} to {hi}"
    if lo is not None:
        return f"{what} >= {lo}"
    if hi is not None:
        return f"{what} <= {hi}"
    return what


TLS_FILE_VARS = (("RUMOR_TLS_CERT", "this rank's certificate"), ("RUMOR_TLS_KEY", "its private key"),
                 ("RUMOR_TLS_CA", "the CA certificate"))


def tls_files(env: Optional[Mapping[str, str]] = None):
    """The paths RUMOR_TLS_CERT, RUMOR_TLS_KEY and RUMOR_TLS_CA name, {variable: path}, and the
    variables not set: valid are all three or none (each caller says so in its own words)."""
    env = os.environ if env is None else env
    given = {name: env.get(name, "") for name, _ in TLS_FILE_VARS}
    return given, [name for name, _ in TLS_FILE_VARS if not given[name]]


def tls_options_from_env(opts, env: Optional[Mapping[str, str]] = None) -> None:
    """TLS 1.3 on the TCP data channels (docs/security.md): RUMOR_TLS_CERT, RUMOR_TLS_KEY and
    RUMOR_TLS_CA name PEM files, all three or none; RUMOR_TLS_PEER_NAME, optional, is the name
    every peer's certificate must carry. Reads the files into opts' tls_* fields."""
    env = os.environ if env is None else env
    given, unset = tls_files(env)
    if not any(given.values()):
        if env.get("RUMOR_TLS_PEER_NAME"):
            raise ValueError("RUMOR_TLS_PEER_NAME is set but TLS is off: set RUMOR_TLS_CERT, RUMOR_TLS_KEY "
                             "and RUMOR_TLS_CA too")
        return
    missing = [f"{name} ({what})" for name, what in TLS_FILE_VARS if name in unset]
    if missing:
        raise ValueError("TLS needs RUMOR_TLS_CERT, RUMOR_TLS_KEY and RUMOR_TLS_CA together; missing: "
                         + ", ".join(missing))
    pem = {}
    for name, what in TLS_FILE_VARS:
        try:
            with open(given[name], encoding="ascii") as f:
                pem[name] = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{name}={given[name]!r} ({what}) cannot be read: {e}") from e
    opts.tls_cert_pem = pem["RUMOR_TLS_CERT"]
    opts.tls_key_pem = pem["RUMOR_TLS_KEY"]
    opts.tls_ca_pem = pem["RUMOR_TLS_CA"]
    opts.tls_peer_name = env.get("RUMOR_TLS_PEER_NAME", "")
