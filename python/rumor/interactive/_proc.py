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

    python /path/to/_proc.py engine-stdin      (engines of start(hosts=...), on any host)

reads one JSON line from stdin, {"connection": <ipcontroller-engine.json>, "env": {...},
"controller": [ip, port]}, so neither the controller's key nor the environment travels on a
command line (visible in ps) or needs quoting through ssh. stdin then stays open as the
owner's lifeline: the process that called start() holds its other end (through ssh for a
remote host), and when that process ends, however it ends, this engine reads EOF. Pids of
another host mean nothing here, so the controller is watched by connecting to its
registration port: refused twice in a row means it is gone.
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
                # No clean-up of rumor itself is needed: its shared-memory names are unlinked
                # once every peer has mapped them, and the kernel closes the sockets. The
                # controller forks its schedulers (they have no watchdog thread): this process
                # leads their process group, so the group goes with it.
                _end_group(cleanup_dir)


def _read_line(fd):
    # Byte by byte: nothing after the newline may be consumed (the rest of stdin is the lifeline).
    buf = bytearray()
    while True:
        b = os.read(fd, 1)
        if not b:
            raise SystemExit("_proc.py engine-stdin: stdin closed before the connection info arrived")
        if b == b"\n":
            return bytes(buf)
        buf += b


def _remove_own_shm():
    # This job's names, recorded by _engine_side.setup(); the peers on this host go down with
    # the session too, so no one still needs them.
    side = sys.modules.get("rumor.interactive._engine_side")
    for prefix in getattr(side, "shm_prefixes", ()):
        try:
            names = os.listdir("/dev/shm")
        except OSError:
            return
        for name in names:
            if name.startswith(prefix):
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass


def _exit_now(why, cleanup_dir):
    sys.stderr.write(f"rumor.interactive: {why}; exiting\n")
    sys.stderr.flush()
    _remove_own_shm()
    _end_group(cleanup_dir)


def _group_members(pgid):
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != me:
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().decode(errors="replace").rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                out.append(int(d))
    return out


def _end_group(cleanup_dir):
    """Ends this process and, when it leads its process group, the rest of the group, removing
    cleanup_dir in between: the others go first (SIGKILL, then up to 5 s until they are gone), so
    that none of them writes into the directory while or after it is removed."""
    leader = os.getpgrp() == os.getpid()
    if leader:
        deadline = time.monotonic() + 5
        while True:
            members = _group_members(os.getpid())
            if not members or time.monotonic() > deadline:
                break
            for pid in members:
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            time.sleep(0.02)
    if cleanup_dir:
        _remove_dir(cleanup_dir)
    if leader:
        os.killpg(os.getpid(), 9)  # whatever was forked meanwhile, and this process
    os._exit(3)


def _remove_dir(path):
    """Removes path although this process's other threads may still create files in it (the
    controller's hub saves its engine state into the profile's log/ as the engines go): renamed
    first, the directory no longer takes files by its path, so nothing lands in it between
    rmtree's listing and its rmdir."""
    parent, name = os.path.split(os.path.abspath(path))
    for attempt in range(3):
        gone = os.path.join(parent, f".{name}.removed-{os.getpid()}-{attempt}")
        try:
            os.rename(path, gone)
        except FileNotFoundError:
            return
        except OSError:
            gone = path  # not renamable (another file system's mount point): remove in place
        shutil.rmtree(gone, ignore_errors=True)
        if not os.path.exists(path):
            return
        time.sleep(0.05)  # recreated meanwhile by a makedirs: once more


def _watch_lifeline(fd, controller, cleanup_dir):
    import select
    import socket

    refused = 0
    last_probe = 0.0
    while True:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready:
            try:
                data = os.read(fd, 4096)
            except OSError:
                data = b""
            if not data:
                _exit_now("the process that started the session is gone (its end of stdin closed)", cleanup_dir)
        now = time.monotonic()
        if controller and now - last_probe >= 1.0:
            last_probe = now
            try:
                socket.create_connection(tuple(controller), timeout=2.0).close()
                refused = 0
            except ConnectionRefusedError:
                refused += 1
                if refused >= 2:
                    _exit_now(f"the controller at {controller[0]}:{controller[1]} is gone", cleanup_dir)
            except OSError:
                refused = 0  # unreachable for a moment is not gone; stdin EOF still ends us


def _engine_stdin():
    import json
    import tempfile

    info = json.loads(_read_line(0))
    lifeline = os.dup(0)  # not inheritable: the engine's nanny and user subprocesses do not get it
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        os.setsid()  # lead a process group, so that one kill takes the nanny and user subprocesses
    except OSError:
        pass  # already a group leader
    # One IPython profile directory per user, shared by every engine like ipcluster's engines
    # share theirs: an engine killed by SIGKILL leaves nothing of its own there. (Not the
    # user's profile_default, whose startup files and config would run on the ranks.)
    profile, temporary = os.path.join(os.path.expanduser("~"), ".cache", "rumor", "ipengine-profile"), None
    try:
        os.makedirs(profile, mode=0o700, exist_ok=True)
    except OSError:
        profile = temporary = tempfile.mkdtemp(prefix="rumor-ipe-")
    env = {str(k): str(v) for k, v in info.get("env", {}).items()}
    os.environ.update(env)
    if "OMP_NUM_THREADS" not in os.environ:
        local = max(1, int(env.get("RUMOR_INTERACTIVE_LOCAL_SIZE", "1")))
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local))
    os.environ["IPP_CONNECTION_INFO"] = json.dumps(info["connection"])
    threading.Thread(target=_watch_lifeline, args=(lifeline, info.get("controller"), temporary),
                     daemon=True, name="rumor-watchdog").start()
    sys.argv[1:] = [f"--profile-dir={profile}", "--log-level=40"]
    from ipyparallel.engine.app import main as ipp_main

    try:
        ipp_main()
    finally:
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)


def main():
    role = sys.argv[1]
    if role == "engine-stdin":
        del sys.argv[1]
        return _engine_stdin()
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
