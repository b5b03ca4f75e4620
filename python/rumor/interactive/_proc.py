"""Entry point of the controller and engine processes that rumor.interactive starts.

    python /path/to/_proc.py controller|engine [ipyparallel arguments]

Run as a script (not as rumor.interactive._proc) so the controller never imports torch. It
starts a watchdog thread, then hands over to ipyparallel's own controller or engine main().

Why a watchdog: ipyparallel starts its processes in new sessions, so they outlive a notebook
kernel that is killed (SIGKILL, OOM, "restart kernel"); the controller has no idea who its
client was, and an engine busy in a collective does not check the controller's heartbeat. The
watchdog polls the owner (the process that called start(), env RUMOR_INTERACTIVE_OWNER as
"pid:start-time" so a recycled pid does not count) and, for engines, the controller (env
RUMOR_INTERACTIVE_CONTROLLER), and ends this process when either is gone.
"""
import os
import shutil
import sys
import threading
import time

POLL_S = 0.5


def _start_time(pid):
    """Field 22 of /proc/<pid>/stat, or None if the process is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _alive(spec):
    pid, _, started = spec.partition(":")
    now = _start_time(int(pid))
    return now is not None and (not started or now == started)


def _watch(specs, cleanup_dir):
    while True:
        time.sleep(POLL_S)
        for what, spec in specs:
            if not _alive(spec):
                sys.stderr.write(f"rumor.interactive: the {what} (pid {spec.split(':')[0]}) is gone; exiting\n")
                sys.stderr.flush()
                if cleanup_dir:
                    shutil.rmtree(cleanup_dir, ignore_errors=True)
                # No clean-up of rumor itself is needed: its shared-memory names are unlinked
                # once every peer has mapped them, and the kernel closes the sockets. The
                # controller forks its schedulers (they have no watchdog thread): this process
                # leads their process group, so the group goes with it.
                if os.getpgrp() == os.getpid():
                    os.killpg(os.getpid(), 9)
                os._exit(3)


def main():
    role = sys.argv[1]
    del sys.argv[1]
    specs = []
    if os.environ.get("RUMOR_INTERACTIVE_OWNER"):
        specs.append(("process that started the cluster", os.environ["RUMOR_INTERACTIVE_OWNER"]))
    if role == "engine" and os.environ.get("RUMOR_INTERACTIVE_CONTROLLER"):
        specs.append(("controller", os.environ["RUMOR_INTERACTIVE_CONTROLLER"]))
    # The controller removes the cluster's private profile directory when its owner dies.
    cleanup = os.environ.get("RUMOR_INTERACTIVE_PROFILE") if role == "controller" else None
    if specs:
        threading.Thread(target=_watch, args=(specs, cleanup), daemon=True, name="rumor-watchdog").start()
    if role == "controller":
        from ipyparallel.controller.app import main as ipp_main
    elif role == "engine":
        from ipyparallel.engine.app import main as ipp_main
    else:
        raise SystemExit(f"_proc.py: role must be controller or engine, got {role!r}")
    ipp_main()


if __name__ == "__main__":
    # sys.path[0] is this file's directory; drop it so "rumor/interactive" modules do not
    # shadow anything ipyparallel imports.
    sys.path.pop(0)
    main()
