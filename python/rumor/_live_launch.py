"""rumor-run --live: a host's workers under live membership (rumor._live, docs/elastic.md).

torchrun's agent stops every worker when one fails and starts them all again; here a failed
worker is the only one started again, as a newcomer, while the others keep training. The
launchers host the job's store (the survivors agree through it, so it must outlive any
worker): node 0's TCPStore, or with --store etcd an etcd member in each of the first three
(rumor._etcd_member), so that it outlives any one launcher too. A launcher tells the store at
once when a worker exits (the members learn it within a beat, before any heartbeat could), and
ends when the job's training has ended on its members.
"""
from __future__ import annotations

import atexit
import datetime
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Dict, List, Optional

_POLL_S = 0.02
_GRACE_S = 1.0  # ten etcd heartbeats: every member learns the last commit before a member stops
_BEAT_S = 0.5  # a launcher's beat in the store (--store etcd): how its peers know it still runs


def _command(args) -> List[str]:
    if getattr(args, "no_python", False):
        return [args.training_script, *args.training_script_args]
    if getattr(args, "module", False):
        return [sys.executable, "-u", "-m", args.training_script, *args.training_script_args]
    return [sys.executable, "-u", args.training_script, *args.training_script_args]


def main(args) -> None:
    import torch.distributed as dist

    from . import _live, _rendezvous, _secret, _shm, _storetls
    from ._etcd_store import ENDPOINTS_ENV, FOLLOW_ENV

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
    spares = getattr(args, "rumor_live_spares", None) or "0"
    if not str(spares).isdigit():
        raise SystemExit(f"rumor-run: --live-spares must be a number >= 0, got {spares!r}")
    spares = int(spares)
    restarts = int(args.max_restarts)
    rdzv = str(getattr(args, "rdzv_id", None) or "none")
    if nodes == 1 and rdzv == "none":
        rdzv = uuid.uuid4().hex[:12]
    run_id = f"live-{rdzv}"
    kind = str(getattr(args, "rumor_store", None) or "tcp")
    tls = None
    if getattr(args, "rumor_tls", "off") == "auto":
        from ._tlsauto import AutoTls

        if kind.startswith("etcd://"):
            raise SystemExit("rumor-run: --tls auto makes a job CA, which cannot vouch for an etcd cluster you run "
                             "(--store etcd://...): give its https:// endpoints and RUMOR_TLS_CERT/KEY/CA yourself")
        tls = AutoTls(multi_node=nodes > 1, job_id=rdzv)
        tls.prepare()
        atexit.register(tls.close)
    etcd_member = None
    store_tls = None
    if kind == "tcp":
        if getattr(args, "rumor_store_hosts", None):
            raise SystemExit("rumor-run: --store-hosts is for --store etcd")
        if tls is not None:
            tls.write()
        # Node 0's launcher hosts the store every member agrees through; the others connect to it.
        addr = "127.0.0.1" if nodes == 1 else args.master_addr
        port = 0 if nodes == 1 else int(args.master_port or 29500)
        public = f"{addr}:{port}"
        store_env = {}
        # Several hosts with TLS files set (--tls auto's or the user's): the store's traffic
        # through the launchers' tunnels, as for torchrun's static rendezvous.
        files = _storetls.files_from_env()
        if nodes > 1 and files is not None:
            store_tls = _storetls.open_tunnel(node, nodes, addr, port, files)
            atexit.register(store_tls.close)
            # The workers' MASTER_ADDR is the tunnel's loopback end: rumor.init() advertises the
            # interface that reaches this address instead.
            store_env[_storetls.ROUTE_ENV] = addr
            addr, port = "127.0.0.1", store_tls.local_port
        if store_tls is not None and node == 0:
            store = store_tls.store  # the real one, on loopback only, behind the terminator
        else:
            store = dist.TCPStore(addr, port, is_master=node == 0, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=60))
        port = store.port
        where = f"store {public} over TLS" if store_tls is not None else f"store {addr}:{port}"
    else:
        from . import _etcd_member
        from ._etcd_store import EtcdStore, tls_context_from_env

        endpoints, etcd_member, own = _etcd(args, kind, nodes, node, run_id, tls)
        follow = kind == "etcd"  # members rumor-run runs: one lost is replaced (_Replacer)
        store = EtcdStore(endpoints, 60.0, tls_context_from_env() if tls is not None else None, follow=follow)
        try:
            _etcd_member.wait_ready(store, [etcd_member] if etcd_member else [], _env_timeout())
        except BaseException:
            if etcd_member is not None:
                etcd_member.stop()
            raise
        addr, port = store.endpoints[0].split("://", 1)[1].rsplit(":", 1)
        where = f"etcd {','.join(endpoints)}" + (f", member rumor{node} here" if etcd_member else "")
        store_env = {ENDPOINTS_ENV: ",".join(endpoints), **({FOLLOW_ENV: "1"} if follow else {})}
    live = _rendezvous.prefixed(store, f"rumor/{run_id}/live/")
    replacer = None
    if kind == "etcd" and etcd_member is None and own is not None:
        replacer = _Replacer(live, node, nodes, own, run_id, tls, _env_timeout())
    base_env = dict(os.environ)
    base_env.update(MASTER_ADDR=addr, MASTER_PORT=str(port), WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(n), GROUP_RANK=str(node), ROLE_RANK=str(node),
                    TORCHELASTIC_USE_AGENT_STORE="true", TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0",
                    **{_live.LIVE_ENV: "1", _live.MIN_ENV: str(least)}, **store_env)
    for var in (ENDPOINTS_ENV, FOLLOW_ENV):  # what this shell happened to name is not the job's
        if var not in store_env:
            base_env.pop(var, None)
    base_env.pop(_live.JOIN_ENV, None)
    if _secret.given() is None:  # one host: this user's secret, as rumor-run gives torchrun's workers
        _secret.user_secret()
        base_env[_secret.SECRET_FILE_ENV] = _secret.user_secret_path()
    procs: Dict[str, subprocess.Popen] = {}
    slots: Dict[str, int] = {}
    cmd = _command(args)

    idle: List[str] = []  # spares started and waiting to be called, oldest first
    calls: Dict[str, int] = {}  # an idle spare's pipe, where the launcher writes the slot it calls it to
    called: List[str] = []  # spares called in place of a worker: a new spare follows each's admission

    zygote = _Zygote.start(base_env, args) if spares else None

    def start(member: str, slot: int, newcomer: bool, spare: bool = False) -> bool:
        """Starts a worker; a spare gets the pipe it is called on, and is forked by the zygote
        when it is ready. Returns whether the zygote forked it."""
        env = dict(base_env, RANK=str(node * n + slot), LOCAL_RANK=str(slot), **{_live.ID_ENV: member})
        if kind != "tcp":  # the members as this launcher knows them now (one may have been replaced)
            env[ENDPOINTS_ENV] = ",".join(store.endpoints)
        if newcomer:
            env[_live.JOIN_ENV] = "1"
        if not spare:
            procs[member] = subprocess.Popen(cmd, env=env)
            slots[member] = slot
            return False
        r, w = os.pipe()
        try:
            proc = zygote.fork(env, args, r) if zygote is not None and zygote.ready() else None
            forked = proc is not None
            if proc is None:
                proc = subprocess.Popen(cmd, env=dict(env, **{_live.SPARE_ENV: str(r)}), pass_fds=(r,))
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        procs[member], slots[member], calls[member] = proc, slot, w
        idle.append(member)
        return forked

    def start_spare() -> None:
        j = f"j{int(live.add('joinseq', 1))}"
        how = ", forked by the zygote" if start(j, 0, True, spare=True) else ""  # slot: the one it is called to
        print(f"rumor-run --live: started spare {j} (pid {procs[j].pid}{how})", file=sys.stderr, flush=True)

    def stop_all(sig) -> None:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(sig)

    for r in range(n):
        start(f"r{node * n + r}", r, False)
    for _ in range(spares):
        start_spare()
    print(f"rumor-run --live: node {node} of {nodes}: {n} workers, at least {least} of {world} to train on, "
          f"{restarts} restart(s) ({where}, run {run_id})", file=sys.stderr, flush=True)
    failed_after_end = False

    def on_signal(signum, _frame):
        stop_all(signum)
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    next_beat = 0.0
    finished = False
    zygote_told = False
    try:
        # Until every worker's end was seen below (not until none runs: the last one to die must
        # still be reported to the others, and started again as a newcomer).
        while not all(m.startswith("~") for m in procs):
            if kind != "tcp" and time.monotonic() >= next_beat:  # _leave_etcd: this launcher still runs
                _beat(live, node)
                next_beat = time.monotonic() + _BEAT_S
                if replacer is not None and replacer.tick() is not None:
                    etcd_member = replacer.member
                    atexit.register(etcd_member.stop)  # whatever way this launcher ends short of SIGKILL
                    replacer = None  # a launcher runs one member at most
                    for st in (store, live):  # this host's member first, as for the first ones
                        st.prefer(etcd_member.client_url)
            if zygote is not None and not zygote_told and zygote.ready():
                zygote_told = True
                print(f"rumor-run --live: zygote ready (pid {zygote.proc.pid}): spares are forked from it",
                      file=sys.stderr, flush=True)
            for member, p in list(procs.items()):
                code = p.poll()
                if code is None or member.startswith("~"):
                    continue
                procs[f"~{member}"] = procs.pop(member)  # reported once
                done = live.check(["job_done"])
                spare = member in idle  # never called: not a member; the job's end sends spares home
                if spare:
                    idle.remove(member)
                    os.close(calls.pop(member))
                call = None
                if code != 0 and not done and not spare and restarts > 0 and idle:
                    # Called before the death is told: the members that re-form on seeing it wait
                    # for the spare (rumor._live._called_spares), so one change replaces the worker.
                    restarts -= 1
                    call = idle.pop(0)
                    slots[call] = slots[member]
                    live.set(f"call/{call}", str(slots[member]))
                    fd = calls.pop(call)
                    os.write(fd, f"{slots[member]}\n".encode())
                    os.close(fd)
                    called.append(call)
                    print(f"rumor-run --live: spare {call} takes slot {slots[member]} "
                          f"({restarts} restart(s) left)", file=sys.stderr, flush=True)
                live.add(f"dead/{member}", 1)
                live.add("events", 1)
                if code != 0:
                    how = f"signal {-code}" if code < 0 else f"exit status {code}"
                    print(f"rumor-run --live: worker {member} (pid {p.pid}) ended with {how}", file=sys.stderr,
                          flush=True)
                    if done:  # a member failing at the end fails the job; a newcomer never admitted does not
                        admitted = live.check([f"done/{member}"]) and live.get(f"done/{member}") == b"admitted"
                        failed_after_end = failed_after_end or not member.startswith("j") or admitted
                    elif spare:  # lost before it was called: another takes its place
                        if restarts > 0:
                            restarts -= 1
                            start_spare()
                    elif call is None and restarts > 0:
                        restarts -= 1
                        j = int(live.add("joinseq", 1))
                        start(f"j{j}", slots[member], True)
                        print(f"rumor-run --live: started newcomer j{j} in slot {slots[member]} "
                              f"({restarts} restart(s) left)", file=sys.stderr, flush=True)
            # A new spare once the one called is admitted (or gone): not before, since starting one
            # takes the CPU the newcomer and the survivors need while it joins.
            for j in list(called):
                if live.check([f"done/{j}"]) or j not in procs:
                    called.remove(j)
                    if not live.check(["job_done"]):
                        start_spare()
            # One host: with no member left, nobody can admit the newcomers waiting. (With several,
            # the members may be elsewhere: the newcomers' own deadline ends their wait.) Asked of
            # the store only then: a poll of every newcomer 50 times a second is load on an etcd.
            if nodes == 1 and not any(
                    not m.startswith("~") and p.poll() is None and (m.startswith("r") or live.check([f"done/{m}"]))
                    for m, p in procs.items()) and not live.check(["job_done"]):
                print("rumor-run --live: no member is left to admit the newcomers; the job ends", file=sys.stderr,
                      flush=True)
                break
            time.sleep(_POLL_S)
    finally:
        try:
            if zygote is not None:
                zygote.stop()
            stop_all(signal.SIGKILL)
            _shm.sweep()
            try:
                finished = live.check(["job_done"])
            except Exception:
                finished = False
            if kind == "tcp":
                # The store lives in node 0's launcher: it stays until every launcher is done with it.
                try:
                    live.add("launchers_done", 1)
                    deadline = time.monotonic() + 30
                    while node == 0 and int(live.add("launchers_done", 0)) < nodes and time.monotonic() < deadline:
                        time.sleep(0.05)
                except Exception:
                    pass
            else:
                _leave_etcd(store, live, nodes, node, etcd_member)
            if store_tls is not None:
                store_tls.close()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    if not finished or failed_after_end:
        raise SystemExit(1)


class _Adopted:
    """A spare forked by the zygote and adopted by this launcher (a child subreaper): waited for
    like a subprocess.Popen."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not this launcher's child after all: gone is all it can tell
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    self.returncode = 1
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class _Zygote:
    """rumor._zygote, run by this launcher: spares are forked from it once it has imported torch
    and rumor, instead of each starting Python from nothing. Python scripts only (not
    --no-python), and only where this launcher can adopt them (Linux's child subreaper)."""

    def __init__(self, proc, sock):
        self.proc, self.sock, self._ready = proc, sock, False

    @classmethod
    def start(cls, env: dict, args) -> Optional["_Zygote"]:
        import ctypes
        import socket

        if getattr(args, "no_python", False):
            return None
        try:
            if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
                return None
        except (OSError, AttributeError):
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen([sys.executable, "-u", "-m", "rumor._zygote", str(theirs.fileno())], env=env,
                                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(proc, ours)

    def ready(self) -> bool:
        if not self._ready and self.proc.poll() is None:
            try:
                self._ready = self.sock.recv(64) == b"ready\n"
            except BlockingIOError:
                pass
            if self._ready:
                self.sock.setblocking(True)
                self.sock.settimeout(10.0)
        return self._ready and self.proc.poll() is None

    def fork(self, env: dict, args, call_fd: int) -> Optional[_Adopted]:
        import json
        import socket

        req = dict(env=env, cwd=os.getcwd(), module=bool(getattr(args, "module", False)),
                   argv=[args.training_script, *args.training_script_args])
        try:
            socket.send_fds(self.sock, [json.dumps(req).encode()], [call_fd])
            pid = int(self.sock.recv(64).decode())
        except (OSError, ValueError) as e:
            print(f"rumor-run --live: the zygote failed ({e}); spares start from nothing", file=sys.stderr, flush=True)
            self._ready = False
            self.proc.kill()
            return None
        return _Adopted(pid)

    def stop(self) -> None:
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _etcd(args, kind: str, nodes: int, node: int, run_id: str, tls):
    """The endpoints of the job's etcd cluster, this host's first; the member this launcher runs
    (None: an external cluster, or a host past the first three); and for a host past the first
    three, where a member replacing a lost one would run here ((address, client port, peer
    port); else None). tls: the launcher's AutoTls (--tls auto), whose host certificate then
    also names this host's member address."""
    from ._etcd_member import MAX_MEMBERS, Member, own_address
    from ._ports import free_port
    from ._etcd_store import parse_endpoints

    hosts_arg = str(getattr(args, "rumor_store_hosts", None) or "")
    if kind.startswith("etcd://"):
        if hosts_arg:
            raise SystemExit("rumor-run: --store-hosts names the hosts rumor-run starts etcd on; with an external "
                             "cluster (--store etcd://...) leave it out")
        try:
            return parse_endpoints(kind), None, None
        except ValueError as e:
            raise SystemExit(f"rumor-run: --store: {e}") from None
    if kind != "etcd":
        raise SystemExit(f"rumor-run: --store takes tcp, etcd or etcd://host:port[,host:port...], got {kind!r}")
    k = min(MAX_MEMBERS, nodes)
    if nodes == 1:
        peers = [("127.0.0.1", free_port("127.0.0.1"), free_port("127.0.0.1"))]
    else:
        hosts = [h.strip() for h in hosts_arg.split(",") if h.strip()]
        if len(hosts) != k:
            raise SystemExit(f"rumor-run: --store etcd on {nodes} hosts runs an etcd member on nodes 0..{k - 1}: give "
                             f"their addresses in that order, the same on every node, with --store-hosts "
                             f"(e.g. --store-hosts {','.join(f'10.0.0.{i + 1}' for i in range(k))}); got "
                             f"{hosts_arg or 'none'}")
        port = int(args.master_port or 29500)  # clients on --master-port, peers on the next one
        peers = [(h, port, port + 1) for h in hosts]
    own = None
    if node >= k:  # the address the store hosts see this host at
        own = (own_address(peers[0][0], peers[0][1]), peers[0][1], peers[0][2])
    member = None
    paths = None
    if tls is not None:
        tls.write(sans=[(peers[node] if node < k else own)[0]])
        paths = _tls_paths(tls)
    if node < k:
        member = Member(node, peers, token=run_id, tls=paths)
        atexit.register(member.stop)  # whatever way this launcher ends short of SIGKILL
        member.start()
    scheme = "https" if tls is not None else "http"
    endpoints = [f"{scheme}://{h}:{c}" for h, c, _ in peers]
    if member is not None:  # this host's member first: the traffic stays local while it is up
        endpoints = endpoints[node:] + endpoints[:node]
    return endpoints, member, own


def _tls_paths(tls) -> Dict[str, str]:
    """An etcd member's TLS files ({"cert", "key", "ca"}) from the launcher's AutoTls."""
    return {name: tls.paths[var] for var, name in (("RUMOR_TLS_CERT", "cert"), ("RUMOR_TLS_KEY", "key"),
                                                   ("RUMOR_TLS_CA", "ca"))}


class _Replacer:
    """--store etcd, on a host that runs no member: replaces a member whose host is gone.

    A member's host is gone when its launcher's beat (launcher/<i>/beat; member rumor<i> runs
    with launcher i) stood still for twice RUMOR_LIVE_HEARTBEAT while the launcher had not said
    it is done. The lowest-ranked launcher whose beat moves and that runs no member then takes
    the lock etcd/replace (a lease: a holder that dies loses it), removes the lost member, adds
    its own and starts it to join the cluster (_etcd_member.join). Clients learn the new member
    when they next move on from one that failed (EtcdStore's follow)."""

    _LOCK_TTL_S = 60  # past the join's deadline: only a holder that died loses the lock to time

    def __init__(self, live, node: int, nodes: int, own: tuple, token: str, tls, timeout: float):
        from . import _live
        from ._env import env_float

        self.live = live.copy()  # its own connection, with a short deadline: the loop must go on
        self.live.set_timeout(datetime.timedelta(seconds=5))
        self.node, self.nodes, self.own, self.token = node, nodes, own, token
        self.tls = None if tls is None else _tls_paths(tls)
        self.join_s = min(timeout, 30.0)
        self.silence_s = 2 * env_float(_live.HEARTBEAT_ENV, 2.0, positive=True)
        self.seen: Dict[int, tuple] = {}  # launcher -> (its beat, when it last moved as seen here)
        self.retry_at = 0.0
        self.member = None

    def tick(self):
        """Called every beat: the member started here when this call replaced one, else None."""
        from ._etcd_member import MAX_MEMBERS, join
        from ._etcd_store import EtcdStoreError, tls_context_from_env

        now = time.monotonic()
        if now < self.retry_at:
            return None
        try:
            keys = self.live.scan("launcher/")
            beats = {int(k.split("/")[1]): int(v) for k, v in keys.items() if k.endswith("/beat")}
            done = {int(k.split("/")[1]) for k in keys if k.endswith("/done")}
            for i, c in beats.items():
                if self.seen.get(i, (None,))[0] != c:
                    self.seen[i] = (c, now)
            # Only a launcher seen beating and then silent is gone (one not started yet is not).
            silent = {i for i, (_, t) in self.seen.items() if now - t > self.silence_s and i not in done}
            if not silent or self.live.check(["job_done"]):
                return None
            on = _member_nodes(self.live, None)
            if on is None or (not silent & set(on) and len(on) >= min(MAX_MEMBERS, self.nodes)):
                return None  # no member lost (or one lost and removed, but none added since)
            free = sorted(i for i in self.seen if i not in silent and i not in done and i not in on)
            if not free or free[0] != self.node:
                return None  # not this launcher's turn
            lease = self.live.try_lock("etcd/replace", self._LOCK_TTL_S)
            if lease is None:
                return None
            try:
                t0 = time.monotonic()
                # Under the lock, nobody else is adding a member: one without a name is a join
                # that failed midway, and counts against the majority as a lost one does.
                members = self.live.members()
                lost = [m for m in members if not m.get("name") or _node_of(m) in silent]
                for m in lost:
                    self.live.remove_member(str(m["ID"]))
                self.member = join(self.live, self.node, self.own, self.token, self.tls,
                                   tls_context_from_env() if self.tls else None, self.join_s)
            finally:
                try:
                    self.live.unlock(lease)
                except EtcdStoreError:
                    pass  # the lease runs out by itself
        except Exception as e:  # whatever failed, this launcher goes on with its workers
            self.retry_at = time.monotonic() + self.silence_s
            print(f"rumor-run --live: replacing a lost etcd member failed (tried again in {self.silence_s:g} s): {e}",
                  file=sys.stderr, flush=True)
            return None
        names = ", ".join(str(m.get("name") or m["ID"]) for m in lost) or "none"
        print(f"rumor-run --live: etcd member rumor{self.node} started here ({self.member.client_url}) in "
              f"{time.monotonic() - t0:.1f} s, replacing {names} (launcher silent past {self.silence_s:g} s)",
              file=sys.stderr, flush=True)
        return self.member


def _node_of(member: dict):
    """The launcher that runs an etcd member (rumor<i>: launcher i), or None."""
    name = str(member.get("name", ""))
    return int(name[5:]) if name.startswith("rumor") and name[5:].isdigit() else None


def _env_timeout() -> float:
    from ._env import env_float

    return env_float("RUMOR_TIMEOUT", 300.0, positive=True)


def _beat(live, node: int) -> None:
    live.add(f"launcher/{node}/beat", 1)


def _leave_etcd(store, live, nodes: int, node: int, member) -> None:
    """With etcd every member's launcher is needed for the majority, not only node 0's. A launcher
    that is done keeps its member up while another launcher still runs (its beat moves) and is not
    done. Then the member launchers leave together: each says it released its member, and stops
    it once every other member launcher released (or is gone) and a grace period passed, in which
    the others' members learn that its last write was committed. Launchers that are gone (their
    beat stood still past the silence) are not waited for. The waits read this host's member
    alone (serializable reads), which answers also once the others stopped theirs."""
    import datetime

    from . import _live
    from ._env import env_float

    silence_s = 2 * env_float(_live.HEARTBEAT_ENV, 2.0, positive=True)
    for s in (store, live):
        s.set_timeout(datetime.timedelta(seconds=5))
    local = live.local_reads()
    released = False
    try:
        live.set(f"launcher/{node}/done", "1")
        if member is not None:
            _await_launchers(local, live, node, range(nodes), "done", silence_s)
            live.set(f"launcher/{node}/released", "1")
            released = True
            _await_launchers(local, live, node, _member_nodes(local, nodes), "released", silence_s)
            time.sleep(_GRACE_S)
    except Exception as e:
        if not released:  # after it, the others stopped their members: nothing was left to do
            print(f"rumor-run --live: the etcd store stopped answering while this launcher left: {e}",
                  file=sys.stderr, flush=True)
    finally:
        if member is not None:
            member.stop()
        for s in (store, live, local):
            s.close()


def _member_nodes(store, nodes: Optional[int]):
    """The launchers that run the cluster's members (member rumor<i> runs with launcher i; the
    first ones, or those that replaced a lost one); if the cluster does not answer, every
    launcher (range(nodes)), or None when nodes is None."""
    from ._etcd_store import EtcdStoreError

    try:
        members = store.members()
    except EtcdStoreError:
        return None if nodes is None else range(nodes)
    return sorted(i for i in map(_node_of, members) if i is not None)


def _await_launchers(local, live, node: int, nodes, mark: str, silence_s: float) -> None:
    """Until every launcher of nodes but this one set launcher/<i>/<mark> or is silent; this
    launcher beats meanwhile (it is not gone, only waiting)."""
    seen: Dict[int, tuple] = {}
    while True:
        now = time.monotonic()
        waiting = []
        for i in nodes:
            if i == node or local.check([f"launcher/{i}/{mark}"]):
                continue
            key = f"launcher/{i}/beat"
            c = int(local.get(key)) if local.check([key]) else 0
            if seen.get(i, (None,))[0] != c:
                seen[i] = (c, now)
            if now - seen[i][1] <= silence_s:
                waiting.append(i)
        if not waiting:
            return
        _beat(live, node)
        time.sleep(0.1)
