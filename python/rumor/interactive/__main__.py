"""python -m rumor.interactive -n 4   (also: rumor-run --interactive -n 4)
   rumor-run --interactive -n 4 --hosts node1:2,node2:2 [--launcher 'ssh -p 2222 {host}']

Starts the controller and the ranks in the foreground, prints how a notebook attaches to them
(rumor.interactive.connect(path)), and stops everything on Ctrl-C or SIGTERM."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="rumor-run --interactive",
                                description="start rumor ranks as ipyparallel engines for a notebook")
    p.add_argument("-n", "--nproc-per-node", dest="n", type=int, default=4, help="number of ranks (default 4)")
    p.add_argument("--rumor-timeout", "--timeout", dest="timeout", type=float, default=30.0,
                   help="rumor's deadline for blocking waits on the ranks, seconds (default 30)")
    p.add_argument("--start-timeout", type=float, default=60.0, help="seconds to start the ranks (default 60)")
    p.add_argument("-H", "--hosts", default=None,
                   help="comma-separated hosts for the ranks, 'host:slots' (node1:2,node2:2) or bare names "
                        "(-n split evenly); default: all ranks on this host")
    p.add_argument("--launcher", default=None,
                   help="command that runs the engine's command on {host} (default: ssh -o BatchMode=yes {host}), "
                        "e.g. 'ip netns exec {host}'")
    p.add_argument("--controller-ip", default=None,
                   help="address the controller listens on when ranks run on other hosts "
                        "(default: this machine's address on the route to the first other host)")
    p.add_argument("--connection-file", default=None,
                   help="where to write the file a notebook passes to rumor.interactive.connect()")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.n < 1:
        p.error(f"-n must be at least 1, got {args.n}")
    if not args.timeout > 0:
        p.error(f"--rumor-timeout must be positive, got {args.timeout}")

    hosts = None
    if args.hosts is not None:
        hosts = [h for h in (x.strip() for x in args.hosts.split(",")) if h]
    from . import _check_args, _session, start, stop

    try:
        _check_args(args.n, hosts, args.timeout, args.start_timeout, args.launcher, args.controller_ip)
    except (TypeError, ValueError) as e:
        p.error(str(e).replace("rumor.interactive.start(): ", ""))
    start(args.n, hosts=hosts, timeout=args.timeout, start_timeout=args.start_timeout, quiet=True,
          launcher=args.launcher, controller_ip=args.controller_ip)
    path = args.connection_file or os.path.join(_session.current().profile_dir, "rumor-connection.json")
    _session.current().write_connection_file(path)
    where = f" on {', '.join(sorted(set(_session.current().hosts)))}" if hosts else ""
    print(f"rumor.interactive: {args.n} rank(s) running{where} (rumor timeout {args.timeout:g} s). In a notebook:\n\n"
          f"    import rumor.interactive as ri\n    ri.connect({path!r})\n\n"
          "then use %%rumor, %%rank0, %rumor_status. Ctrl-C here stops the ranks.", flush=True)

    def _term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        while _session._session is not None and not _session._session.dead:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stop()
        if args.connection_file:
            try:
                os.unlink(args.connection_file)
            except OSError:
                pass
        print("rumor.interactive: stopped", flush=True)


if __name__ == "__main__":
    main()
