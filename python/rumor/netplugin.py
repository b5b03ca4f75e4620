"""rumor's NCCL net plugin: libnccl-net-rumor.so, shipped in the wheel as rumor/lib/ (docs/netplugin.md).

NCCL loads a net plugin named by NCCL_NET_PLUGIN: a full path is dlopen()ed as given, a short
name such as ``rumor`` is looked up as ``libnccl-net-rumor.so`` on the library search path
(LD_LIBRARY_PATH). ``environment()`` sets both, so either form works in the processes it reaches.

    python -m rumor.netplugin --path     # prints the library's full path
    python -m rumor.netplugin --env      # prints `export ...` lines for a shell
    rumor-run --nccl-net-plugin ...      # the launcher sets the environment for its workers
    RUMOR_NCCL_NET_PLUGIN=1              # the same, for rumor-run or for `import rumor` (plain torchrun)
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import warnings
from typing import Dict, MutableMapping, Optional, Sequence

from ._env import env_bool

LIB_NAME = "libnccl-net-rumor.so"
ENABLE_VAR = "RUMOR_NCCL_NET_PLUGIN"


def lib_dir() -> str:
    """The folder the wheel installs the plugin into (rumor/lib)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")


def path() -> str:
    """Full path of the installed libnccl-net-rumor.so; FileNotFoundError if this install has none."""
    p = os.path.join(lib_dir(), LIB_NAME)
    if not os.path.isfile(p):
        raise FileNotFoundError(
            f"rumor's NCCL net plugin is not installed: {p} does not exist. It is built with the "
            "wheel (CMake target nccl-net-rumor); reinstall rumor from source (pip install .) to get it.")
    return p


def environment(env: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """The variables that make NCCL load the plugin: NCCL_NET_PLUGIN (full path) and
    LD_LIBRARY_PATH with rumor/lib first (for NCCL_NET_PLUGIN=rumor in child processes)."""
    env = os.environ if env is None else env
    lib = path()
    dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d and d != lib_dir()]
    return {"NCCL_NET_PLUGIN": lib, "LD_LIBRARY_PATH": os.pathsep.join([lib_dir(), *dirs])}


def enable(env: Optional[MutableMapping[str, str]] = None) -> str:
    """Sets environment() in env (default os.environ) and returns the plugin's path. Processes
    started afterwards inherit it; in this process NCCL reads it when it creates its first
    communicator (the full path needs no library search path)."""
    env = os.environ if env is None else env
    env.update(environment(env))
    return env["NCCL_NET_PLUGIN"]


def enabled_by_env(env: Optional[MutableMapping[str, str]] = None) -> bool:
    return env_bool(ENABLE_VAR, False, env)


def enable_from_env() -> None:
    """At `import rumor`: with RUMOR_NCCL_NET_PLUGIN=1 and no NCCL_NET_PLUGIN of the user's, point
    NCCL at the plugin (jobs started by plain torchrun, mpirun or srun)."""
    if not enabled_by_env() or os.environ.get("NCCL_NET_PLUGIN"):
        return
    try:
        os.environ["NCCL_NET_PLUGIN"] = path()
    except FileNotFoundError as e:
        warnings.warn(f"{ENABLE_VAR}=1 ignored: {e}", RuntimeWarning, stacklevel=2)


def _main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rumor.netplugin", description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--path", action="store_true", help="print the plugin library's full path")
    what.add_argument("--env", action="store_true", help="print shell `export` lines that enable it")
    args = parser.parse_args(argv)
    try:
        if args.path:
            print(path())
        else:
            for k, v in environment().items():
                print(f"export {k}={shlex.quote(v)}")
    except FileNotFoundError as e:
        print(f"rumor.netplugin: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
