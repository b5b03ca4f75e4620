"""Start N rank processes, on this host or inside an emulated cluster, with a deadline.

What tests and benchmarks that run their own ranks share (torchrun is for users; these tools
need per-rank namespaces, per-rank environment and a hard deadline):

    from rumor.testing import launch, netns
    with netns.Cluster(2) as c, launch.Ranks(argv, world=4, cluster=c, ranks_per_host=2) as ranks:
        ranks.wait(timeout=120)            # -> exit codes; ranks.timed_out lists killed ranks
        print(ranks.report())              # every failing rank's log tail
    # locally: launch.Ranks(argv, world=4) (127.0.0.1, a free port)

Every rank gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) over a copy of this environment with launcher-specific variables
(Open MPI, PMI, Slurm, torchelastic, RUMOR_HOST_ID, ...) removed, one thread for torch's pools
(several ranks share few cores) and GLOO_SOCKET_IFNAME set to the interface that reaches rank 0.
Rank r runs on host r // ranks_per_host. Each rank is its own process group, so a deadline kills
the rank and whatever it started.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from typing import Dict, List, Mapping, Optional, Sequence

from .._ports import free_port

SCRUB_PREFIXES = ("OMPI_", "PMI_", "SLURM_", "TORCHELASTIC_", "PMIX_", "RUMOR_")
SCRUB_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")
# Where one process listens and which host it is on: right for one process, wrong when every rank inherits it.
RUMOR_PER_PROCESS = ("RUMOR_HOST_ID", "RUMOR_ADVERTISE_ADDR", "RUMOR_PORT")


def base_env(keep_rumor: bool = False) -> Dict[str, str]:
    """This process's environment without the variables that would tell a rank who it is.
    keep_rumor: keep RUMOR_* settings (RUMOR_SOCKET_STREAMS, ...) except RUMOR_PER_PROCESS."""
    out = {}
    for k, v in os.environ.items():
        if k in SCRUB_NAMES or k in RUMOR_PER_PROCESS:
            continue
        if k.startswith(SCRUB_PREFIXES) and not (keep_rumor and k.startswith("RUMOR_")):
            continue
        out[k] = v
    return out


def kill_process_group(p, wait: bool = True) -> None:
    """SIGKILLs a process started with start_new_session=True and everything it started (falling
    back to the process alone), then reaps it (up to 10 s) unless wait=False."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            p.kill()
        except ProcessLookupError:
            pass
    if wait:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass


def stop_and_collect(procs, outs, label: str = "launcher", tail: int = 6000) -> str:
    """Kills the processes of procs still running (kill_process_group) and returns the last
    tail characters of each output file in outs (binary files open for reading and writing,
    one per process, closed here), each under a header naming label and its index."""
    for p in procs:
        if p.poll() is None:
            kill_process_group(p)
    text = ""
    for i, out in enumerate(outs):
        out.seek(0)
        text += f"\n===== {label} {i} =====\n" + out.read().decode(errors="replace")[-tail:]
        out.close()
    return text


class Ranks:
    """`world` processes running argv (the same for every rank), started at construction.

    cluster: a started rumor.testing.netns.Cluster, or None for this host.
    ranks_per_host: with a cluster, rank r runs in host r // ranks_per_host (default: world /
      hosts); without one, LOCAL_RANK = RANK.
    env: extra variables for every rank; rank_env: one dict (or None) per rank, applied last.
    stdout: per-rank list of file objects / subprocess.PIPE / None (log file, the default);
      stderr goes to the rank's log (or, where stdout is a pipe or file, there too unless a
      log file was asked for).
    """

    def __init__(self, argv: Sequence[str], world: int, *, cluster=None, ranks_per_host: Optional[int] = None,
                 env: Optional[Mapping[str, str]] = None, rank_env: Optional[Sequence[Optional[Mapping]]] = None,
                 port: Optional[int] = None, logdir: Optional[str] = None, keep_rumor_env: bool = False,
                 pipe_stdout: Sequence[int] = (), cwd: Optional[str] = None):
        if world < 1:
            raise ValueError("Ranks: world must be >= 1")
        if rank_env is not None and len(rank_env) != world:
            raise ValueError("Ranks: rank_env needs one entry per rank")
        self.argv, self.world, self.cluster = list(argv), int(world), cluster
        if cluster is not None:
            rph = ranks_per_host or -(-world // cluster.n)
            if -(-world // rph) > cluster.n:
                raise ValueError(f"Ranks: {world} ranks at {rph} per host need more than {cluster.n} hosts")
            master, ifname = cluster.ip(0), cluster.host(0).ifname
            port = port or 29500  # a fresh namespace: nothing else listens there
        else:
            rph = world
            master, ifname = "127.0.0.1", "lo"
            port = port or free_port()
        self.ranks_per_host, self.master_addr, self.master_port = rph, master, port
        self.logdir = logdir or tempfile.mkdtemp(prefix="rumor-ranks-")
        self.log_paths: List[str] = []
        self.procs: List[subprocess.Popen] = []
        self.timed_out: List[int] = []
        self.elapsed = 0.0
        self._t0 = time.monotonic()
        # Emulated hosts are several hosts to rumor.init(), which would run them unauthenticated
        # without a secret: they get this user's (docs/security.md), the same for every job, as a
        # user's fixed RUMOR_JOB_SECRET would be (a disk commit of one job is read by the next).
        from .. import _secret

        job_secret = _secret.user_secret().hex()
        try:
            for r in range(world):
                e = base_env(keep_rumor_env)
                e.setdefault("RUMOR_JOB_SECRET", job_secret)
                e.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r % rph),
                         LOCAL_WORLD_SIZE=str(min(rph, world - (r // rph) * rph)), MASTER_ADDR=master,
                         MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=ifname, OMP_NUM_THREADS="1",
                         MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
                if env:
                    e.update({k: str(v) for k, v in env.items()})
                if rank_env and rank_env[r]:
                    e.update({k: str(v) for k, v in rank_env[r].items()})
                log = os.path.join(self.logdir, f"rank{r}.log")
                self.log_paths.append(log)
                with open(log, "wb") as lf:
                    kw = dict(env=e, stdin=subprocess.DEVNULL, stderr=lf, cwd=cwd,
                              stdout=subprocess.PIPE if r in pipe_stdout else lf)
                    if cluster is not None:
                        p = cluster.popen(r // rph, self.argv, **kw)
                    else:
                        p = subprocess.Popen(self.argv, start_new_session=True, **kw)
                self.procs.append(p)
        except BaseException:
            self.kill()
            raise

    # -- waiting ---------------------------------------------------------------------------------

    def wait(self, timeout: float, grace_after_failure: float = 20.0, poll_s: float = 0.05,
             on_poll=None) -> List[Optional[int]]:
        """Waits until every rank exited, the deadline passed (ranks still running are killed and
        listed in .timed_out), or `grace_after_failure` seconds after the first rank failed.
        on_poll(): called every poll (e.g. to draw a progress bar). Returns the exit codes."""
        deadline = self._t0 + timeout
        failed_at = None
        while True:
            codes = [p.poll() for p in self.procs]  # poll all: reap exited ranks promptly
            if all(c is not None for c in codes):
                break
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
                deadline = min(deadline, failed_at + grace_after_failure)
            if time.monotonic() >= deadline:
                break
            if on_poll is not None:
                on_poll()
            time.sleep(poll_s)
        self.elapsed = time.monotonic() - self._t0
        self.timed_out = [r for r, p in enumerate(self.procs) if p.poll() is None]
        self.kill()
        return [p.returncode for p in self.procs]

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(p.returncode == 0 for p in self.procs)

    def log(self, r: int, tail: int = 0) -> str:
        try:
            with open(self.log_paths[r], "rb") as f:
                data = f.read()
        except OSError:
            return ""
        return data[-tail:].decode("utf-8", "replace") if tail else data.decode("utf-8", "replace")

    def report(self, tail: int = 6000) -> str:
        """Status of every rank and the log tails of those that failed (all logs if none did)."""
        bad = [r for r, p in enumerate(self.procs) if r in self.timed_out or p.returncode != 0]
        where = f" in {self.cluster.n} emulated hosts" if self.cluster is not None else ""
        lines = [f"{self.world} rank(s){where}, {self.elapsed:.1f}s: "
                 + (f"ranks {bad} failed" if bad else "all exited with 0")]
        for r in (bad or range(self.world)):
            status = "killed at the deadline" if r in self.timed_out else f"exit code {self.procs[r].returncode}"
            host = f", host {r // self.ranks_per_host}" if self.cluster is not None else ""
            lines.append(f"===== rank {r}{host} ({status}) =====")
            lines.append(self.log(r, tail))
        return "\n".join(lines)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_process_group(p, wait=False)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
