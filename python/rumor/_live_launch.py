"""rumor-run --live: a host's workers under live membership (rumor._live, docs/elastic.md).

torchrun's agent stops every worker when one fails and starts them all again; here a failed
worker is the only one started again, as a newcomer, while the others keep training. The
launcher hosts the job's store (the survivors agree through it, so it must outlive any
worker), tells the store at once when a worker exits (the members learn it within a beat, before
any heartbeat could), and ends when the job's training has ended on its members.
"""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Dict, List

_POLL_S = 0.02


def _command(args) -> List[str]:
    if getattr(args, "no_python", False):
        return [args.training_script, *args.training_script_args]
    if getattr(args, "module", False):
        return [sys.executable, "-u", "-m", args.training_script, *args.training_script_args]
    return [sys.executable, "-u", args.training_script, *args.training_script_args]


def main(args) -> None:
    import torch.distributed as dist

    from . import _live, _secret, _shm

    min_nodes, _, max_nodes = str(args.nnodes).partition(":")
    if not min_nodes.isdigit() or (max_nodes and max_nodes != min_nodes) or int(min_nodes) < 1:
        raise SystemExit(f"rumor-run: --live takes a fixed --nnodes N (hosts come and go as newcomers), got "
                         f"{args.nnodes!r}")
    nodes = int(min_nodes)
    node = int(args.node_rank)
    if not 0 <= node < nodes:
        raise SystemExit(f"rumor-run: --node-rank {node} is outside --nnodes {nodes}")
    n = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 0
    if n < 1:
        raise SystemExit(f"rumor-run: --live needs --nproc-per-node as a number >= 1, got {args.nproc_per_node!r}")
    world = nodes * n
    least = args.rumor_live_min
    if least is None:
        least = 1
    elif not str(least).isdigit() or not 1 <= int(least) <= world:
        raise SystemExit(f"rumor-run: --live-min must be a number in [1, {world}], got {least!r}")
    if nodes > 1 and _secret.given() is None:
        raise SystemExit(f"rumor-run: --live on several hosts needs the same job secret on each "
                         f"({_secret.SECRET_ENV} or {_secret.SECRET_FILE_ENV}; docs/security.md)")
    restarts = int(args.max_restarts)
    # Node 0's launcher hosts the store every member agrees through; the others connect to it.
    addr = "127.0.0.1" if nodes == 1 else args.master_addr
    port = 0 if nodes == 1 else int(args.master_port or 29500)
    store = dist.TCPStore(addr, port, is_master=node == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    rdzv = str(getattr(args, "rdzv_id", None) or "none")
    if nodes == 1 and rdzv == "none":
        rdzv = uuid.uuid4().hex[:12]
    run_id = f"live-{rdzv}"
    live = dist.PrefixStore(f"rumor/{run_id}/live/", store)
    base_env = dict(os.environ)
    base_env.update(MASTER_ADDR=addr, MASTER_PORT=str(store.port), WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(n), GROUP_RANK=str(node), ROLE_RANK=str(node),
                    TORCHELASTIC_USE_AGENT_STORE="true", TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0",
                    **{_live.LIVE_ENV: "1", _live.MIN_ENV: str(least)})
    base_env.pop(_live.JOIN_ENV, None)
    if _secret.given() is None:  # one host: this user's secret, as rumor-run gives torchrun's workers
        _secret.user_secret()
        base_env[_secret.SECRET_FILE_ENV] = _secret.user_secret_path()
    procs: Dict[str, subprocess.Popen] = {}
    slots: Dict[str, int] = {}
    cmd = _command(args)

    def start(member: str, slot: int, newcomer: bool) -> None:
        env = dict(base_env, RANK=str(node * n + slot), LOCAL_RANK=str(slot), **{_live.ID_ENV: member})
        if newcomer:
            env[_live.JOIN_ENV] = "1"
        procs[member] = subprocess.Popen(cmd, env=env)
        slots[member] = slot

    def stop_all(sig) -> None:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(sig)

    for r in range(n):
        start(f"r{node * n + r}", r, False)
    print(f"rumor-run --live: node {node} of {nodes}: {n} workers, at least {least} of {world} to train on, "
          f"{restarts} restart(s) (store {addr}:{store.port}, run {run_id})", file=sys.stderr, flush=True)
    failed_after_end = False

    def on_signal(signum, _frame):
        stop_all(signum)
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(p.poll() is None for p in procs.values()):
            for member, p in list(procs.items()):
                code = p.poll()
                if code is None or member.startswith("~"):
                    continue
                procs[f"~{member}"] = procs.pop(member)  # reported once
                live.add(f"dead/{member}", 1)
                live.add("events", 1)
                done = live.check(["job_done"])
                if code != 0:
                    how = f"signal {-code}" if code < 0 else f"exit status {code}"
                    print(f"rumor-run --live: worker {member} (pid {p.pid}) ended with {how}", file=sys.stderr,
                          flush=True)
                    if done:  # a member failing at the end fails the job; a newcomer never admitted does not
                        admitted = live.check([f"done/{member}"]) and live.get(f"done/{member}") == b"admitted"
                        failed_after_end = failed_after_end or not member.startswith("j") or admitted
                    elif restarts > 0:
                        restarts -= 1
                        j = int(live.add("joinseq", 1))
                        start(f"j{j}", slots[member], True)
                        print(f"rumor-run --live: started newcomer j{j} in slot {slots[member]} "
                              f"({restarts} restart(s) left)", file=sys.stderr, flush=True)
            # One host: with no member left, nobody can admit the newcomers waiting. (With several,
            # the members may be elsewhere: the newcomers' own deadline ends their wait.)
            members_left = [m for m, p in procs.items() if not m.startswith("~") and p.poll() is None
                            and (m.startswith("r") or live.check([f"done/{m}"]))]
            if nodes == 1 and not members_left and not live.check(["job_done"]):
                print("rumor-run --live: no member is left to admit the newcomers; the job ends", file=sys.stderr,
                      flush=True)
                break
            time.sleep(_POLL_S)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        stop_all(signal.SIGKILL)
        _shm.sweep()
        # The store lives in node 0's launcher: it stays until every launcher is done with it.
        try:
            live.add("launchers_done", 1)
            deadline = time.monotonic() + 30
            while node == 0 and int(live.add("launchers_done", 0)) < nodes and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:
            pass
    if not live.check(["job_done"]) or failed_after_end:
        raise SystemExit(1)
