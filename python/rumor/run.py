"""rumor's launcher: torchrun plus rumor's own flags.

    python -m rumor.run --nproc-per-node 4 [torchrun flags] [rumor flags] train.py [script args]
    rumor-run ...            (the same, as a console script)
    rumor-run --interactive -n 4   (ranks for a notebook: rumor.interactive, docs/interactive.md)

Everything torchrun offers (elastic restarts, multi-node rendezvous, --max-restarts, ...) comes
from torch.distributed.run, which this module delegates to. rumor's flags become environment
variables that rumor.init() reads in every worker, so scripts started by plain torchrun, mpirun
or srun can set the same variables instead.
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional

# flag -> (environment variable, help)
_RUMOR_FLAGS = {
    "--socket-streams": ("RUMOR_SOCKET_STREAMS", "parallel TCP streams per peer pair (default 2)"),
    "--rumor-timeout": ("RUMOR_TIMEOUT", "seconds any blocking wait may go with no byte moving before it raises (default 300)"),
    "--rumor-shm": ("RUMOR_SHM", "1/0: shared memory between ranks of one host (default 1)"),
    "--rumor-log": ("RUMOR_LOG", "log level of the C++ core: error, warn, info, debug"),
    "--rumor-port": ("RUMOR_PORT", "first port of the workers' listeners: a host's workers listen on this port + "
                                   "their local rank (default: any free port)"),
    "--autotune-budget": ("RUMOR_AUTOTUNE_BUDGET", "steps the autotuner may take (default 80; with --autotune)"),
    "--autotune-cache": ("RUMOR_AUTOTUNE_CACHE", "the autotuner's JSON cache (default ~/.cache/rumor/autotune.json)"),
}


def _parser():
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "rumor-run"
    parser.description = "rumor launcher (torchrun's flags plus rumor's)"
    group = parser.add_argument_group("rumor")
    for flag, (_, help_) in _RUMOR_FLAGS.items():
        group.add_argument(flag, dest="rumor_" + flag.lstrip("-").replace("-", "_"), default=None, help=help_)
    group.add_argument("--autotune", dest="rumor_autotune", action="store_true",
                       help="DistributedDataParallel tunes its settings during the first steps (RUMOR_AUTOTUNE=1, "
                            "docs/autotune.md)")
    group.add_argument("--bind-cores", dest="rumor_bind_cores", action="store_true",
                       help="where a host has more workers than CPUs, bind each worker to one CPU (local rank "
                            "modulo the CPUs), which lets small collectives keep a core busy instead of "
                            "sleeping (RUMOR_BIND_CORES=1; docs/environment.md)")
    group.add_argument("--tls", dest="rumor_tls", choices=("off", "auto"), default="off",
                       help="auto: TLS 1.3 with mutual certificates on the data channels between ranks, with a job CA "
                            "this launcher makes (one node: a random key; several nodes: a key derived from "
                            "RUMOR_JOB_SECRET or RUMOR_JOB_SECRET_FILE, which every node must share). The workers get "
                            "the paths of 0600 files in this user's private directory, removed when the job ends; it "
                            "refuses to start if RUMOR_TLS_* is set. With several nodes and --master-addr/--master-port "
                            "(static rendezvous) the store's traffic goes through TLS tunnels too, as it does with your "
                            "own RUMOR_TLS_CERT/KEY/CA set for the launcher. off (default): TLS only where you set "
                            "RUMOR_TLS_CERT/KEY/CA yourself (docs/security.md)")
    group.add_argument("--nccl-net-plugin", dest="rumor_nccl_net_plugin", action="store_true",
                       help="NCCL sends through rumor's multi-stream TCP net plugin: sets NCCL_NET_PLUGIN to "
                            "libnccl-net-rumor.so and puts its folder on LD_LIBRARY_PATH "
                            "(RUMOR_NCCL_NET_PLUGIN=1 does the same; docs/netplugin.md)")
    group.add_argument("--live", dest="rumor_live", action="store_true",
                       help="live membership: a worker that fails leaves, the others keep training "
                            "in the same processes, and it is started again as a newcomer that joins at a step "
                            "boundary (--max-restarts times; rumor.elastic.run scripts; docs/elastic.md)")
    group.add_argument("--live-min", dest="rumor_live_min", default=None,
                       help="with --live: the fewest workers training goes on with; below it the job waits "
                            "for newcomers (default 1)")
    group.add_argument("--live-spares", dest="rumor_live_spares", default=None,
                       help="with --live: how many spare workers each launcher keeps started, imported and "
                            "waiting before rumor.init(); a worker that fails is replaced by a spare at once instead "
                            "of a process that starts from nothing (default 0; docs/elastic.md)")
    group.add_argument("--store", dest="rumor_store", default=None,
                       help="with --live: where the job's store lives. tcp (default): in node 0's launcher. etcd: an "
                            "etcd member in each of the first min(3, nnodes) launchers, so that no one host is needed "
                            "(--store-hosts). etcd://h1:2379,h2:2379,...: an etcd cluster run by you "
                            "(docs/elastic.md, \"No single point of failure\")")
    group.add_argument("--store-hosts", dest="rumor_store_hosts", default=None,
                       help="with --store etcd on several nodes: the addresses of nodes 0, 1, 2 (as many as there are "
                            "members), comma-separated, the same on every node; each member listens there on "
                            "--master-port (clients) and the next port (peers)")
    return parser


def _validate(args) -> None:
    streams = args.rumor_socket_streams
    if streams is not None and (not streams.isdigit() or not 1 <= int(streams) <= 16):
        raise SystemExit(f"rumor-run: --socket-streams must be an integer in [1, 16], got {streams!r}")
    timeout = args.rumor_rumor_timeout
    if timeout is not None:
        try:
            ok = float(timeout) > 0
        except ValueError:
            ok = False
        if not ok:
            raise SystemExit(f"rumor-run: --rumor-timeout must be a positive number of seconds, got {timeout!r}")
    budget = args.rumor_autotune_budget
    if budget is not None and (not budget.isdigit() or int(budget) < 2):
        raise SystemExit(f"rumor-run: --autotune-budget must be a whole number of steps >= 2, got {budget!r}")


def _warn_without_secret(min_nodes: str, max_nodes: str) -> None:
    """A job on several nodes needs the same secret on each, which only the user can give; on one
    node every worker finds this user's secret by itself (docs/security.md)."""
    from . import _secret

    if _secret.given() is not None:  # also checks a given one (length, file owner and mode)
        return
    if (max_nodes or min_nodes) != "1":
        print(f"rumor-run: warning: a multi-node job without {_secret.SECRET_ENV} or {_secret.SECRET_FILE_ENV} "
              "runs unauthenticated: anyone who can reach the rendezvous store can join it. Give every node "
              f"the same secret, e.g. export {_secret.SECRET_ENV}=$(python -c 'import secrets; "
              "print(secrets.token_hex(32))') (docs/security.md)", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> None:
    from torch.distributed.run import run

    argv = sys.argv[1:] if argv is None else argv
    # Ranks as notebook engines (docs/interactive.md). Only as the first flag: anywhere else it
    # could be the training script's own argument.
    if argv[:1] == ["--interactive"]:
        from .interactive.__main__ import main as interactive_main

        return interactive_main(argv[1:])
    args = _parser().parse_args(argv)
    _validate(args)
    for flag, (var, _) in _RUMOR_FLAGS.items():
        value = getattr(args, "rumor_" + flag.lstrip("-").replace("-", "_"))
        if value is not None:
            # Workers inherit the launcher's environment.
            os.environ[var] = str(value)
    if args.rumor_autotune:
        os.environ["RUMOR_AUTOTUNE"] = "1"
    if args.rumor_bind_cores:
        os.environ["RUMOR_BIND_CORES"] = "1"
    if args.rumor_live:
        from . import _live_launch

        return _live_launch.main(args)
    for flag, value in (("--live-min", args.rumor_live_min), ("--live-spares", args.rumor_live_spares),
                        ("--store", args.rumor_store),
                        ("--store-hosts", args.rumor_store_hosts)):
        if value is not None:
            raise SystemExit(f"rumor-run: {flag} is for --live")
    from . import netplugin

    min_nodes, _, max_nodes = str(args.nnodes).partition(":")
    tls = None
    if args.rumor_tls == "auto":
        from ._tlsauto import AutoTls

        tls = AutoTls(multi_node=(max_nodes or min_nodes) != "1", job_id=str(args.rdzv_id))
        tls.prepare()  # refuses before anything is made
    _warn_without_secret(min_nodes, max_nodes)
    if args.rumor_nccl_net_plugin or netplugin.enabled_by_env():
        try:
            netplugin.enable()
        except FileNotFoundError as e:
            raise SystemExit(f"rumor-run: --nccl-net-plugin: {e}")
        from . import _secret

        # The plugin (C++, inside NCCL) reads only the environment: on one node, point it at
        # this user's secret, which rumor.init() uses there anyway.
        if (max_nodes or min_nodes) == "1" and _secret.given() is None:
            _secret.user_secret()  # created if this user has none yet
            os.environ[_secret.SECRET_FILE_ENV] = _secret.user_secret_path()
    if max_nodes and max_nodes != min_nodes:
        # An elastic node count: with the agent's shared TCP store, torch 2.x gives a node that
        # joins in a later round no MASTER_ADDR (only a node without one publishes it) and its
        # workers wait forever; a store per round, hosted by the rank 0 worker, has no such gap.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    store_tls = None
    try:
        if tls is not None:
            tls.write()
        from . import _storetls

        # Several nodes with TLS files (--tls auto's or the user's): the store's traffic
        # through TLS tunnels run by the launchers (python/rumor/_storetls.py).
        store_tls = _storetls.for_launch(args)
        run(args)
    finally:
        if store_tls is not None:
            store_tls.close()
        if tls is not None:
            tls.close()
        # Workers killed before they could unlink their shared memory (SIGKILL in init, the
        # agent's SIGTERM to the survivors of a failure) leave names only a sweep removes.
        from . import _shm, elastic

        _shm.sweep()
        # The in-memory commits of rumor.elastic outlive the workers on purpose; not the job.
        elastic.remove_snapshots(str(getattr(args, "rdzv_id", None) or "none"), os.getpid())


if __name__ == "__main__":
    main()
