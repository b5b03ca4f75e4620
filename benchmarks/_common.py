"""What benchmarks/collectives.py and benchmarks/training.py share.

Both drivers run a job per world size: its ranks are `python <script> --worker <cfg.json>`,
started by rumor.testing.launch (here or in emulated hosts). Rank 0 reports on stdout in lines
`@@<kind> <json>` (info, progress, cell, error, done), which the driver's Job reads while the
ranks run; everything else a rank prints goes to its log, whose tail ends up in the job's error.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib): no plot written"


def parse_rate(rate: str) -> float:
    """tc rate string -> bytes/s ("1gbit" -> 125e6, "100mbit", "500kbit", "10mbps" = bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*", rate.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bad rate {rate!r} (examples: 1gbit, 500mbit)")
    v = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return v / 8 if (m.group(3) or "bit") == "bit" else v


class _Lines:
    """A stream for tqdm where stderr is not a terminal (a log, a pipe): tqdm redraws its line
    after a carriage return, which a log shows as one ever-growing line; here each redraw becomes
    a line of its own, and the blank redraw that erases the bar is dropped."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, s: str) -> None:
        line = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", s.replace("\r", "")).rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


class Progress:
    """The benchmarks' progress bar: tqdm on stderr, updated from the jobs' reader threads with
    update(done, label, force) and erased with clear(). On a terminal tqdm redraws in place;
    elsewhere every redraw is a new line, so quiet_s spaces those out (tqdm's mininterval) unless
    an update is forced (a job's milestone)."""

    def __init__(self, total: int, unit: str = "", quiet_s: float = 0.0, stream=sys.stderr):
        try:
            from tqdm import tqdm
        except ImportError:
            raise SystemExit("the benchmarks draw their progress with tqdm: pip install 'rumor[bench]' "
                             "(or pip install tqdm)") from None
        self.tty = stream.isatty()
        self.lock = threading.Lock()
        self.bar = tqdm(total=max(1, total), unit=f" {unit}" if unit else "", leave=False,
                        file=stream if self.tty else _Lines(stream), dynamic_ncols=self.tty,
                        ncols=None if self.tty else 160, ascii=not self.tty,
                        mininterval=0.1 if self.tty else max(0.1, quiet_s),
                        bar_format="[{bar:30}] {n}/{total}{unit} {elapsed}{postfix}")

    @property
    def done(self) -> int:
        return self.bar.n

    def update(self, done: Optional[int] = None, label: str = "", force: bool = False) -> None:
        with self.lock:
            if label:
                self.bar.set_postfix_str(label[:100], refresh=False)
            if done is not None and done != self.bar.n:
                self.bar.update(done - self.bar.n)  # redraws only once mininterval has passed
            if force:
                self.bar.refresh()

    def clear(self) -> None:
        # Erases the line (a message or a table follows); the next update draws the bar again.
        with self.lock:
            self.bar.clear()


# ==== inside a rank ==================================================================================

def emit(kind: str, payload) -> None:
    sys.stdout.write(f"@@{kind} {json.dumps(payload)}\n")
    sys.stdout.flush()


def worker_main(cfg_path: str, describe: Callable[[int, int], Dict], body: Callable[[Dict, int, int], None]) -> int:
    """A rank: rumor.init(), then a gloo group over rumor's store, so that both libraries run in
    the same processes. Rank 0 emits every rank's describe(rank, n) as "info", body(cfg, rank, n)
    measures, rank 0 emits "done". An exception is emitted by rank 0 as "error" (every rank's
    traceback is in its log) and the rank exits 1."""
    with open(cfg_path) as f:
        cfg = json.load(f)
    rank = int(os.environ["RANK"])
    try:
        _guard(cfg)
        import torch  # noqa: F401  (before rumor, as in a user's script)
        import torch.distributed as dist

        import rumor

        rumor.init(timeout=cfg["rumor_timeout"])
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["rumor_timeout"]))
        n = rumor.size()
        assert dist.get_world_size() == n and dist.get_rank() == rank == rumor.rank()
        infos = [None] * n
        dist.all_gather_object(infos, describe(rank, n))
        if rank == 0:
            emit("info", infos)
        body(cfg, rank, n)
        dist.barrier()
        rumor.barrier()
        if rank == 0:
            emit("done", {})
    except BaseException:  # noqa: BLE001
        tb = traceback.format_exc()
        sys.stderr.write(f"rank {rank} failed:\n{tb}")
        sys.stderr.flush()
        if rank == 0:
            emit("error", {"rank": rank, "traceback": tb})
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip teardown of rumor's and gloo's threads


def gather_samples(samples: Dict[str, List[float]]) -> Dict[str, List[List[float]]]:
    """Every rank's timings per variant (all ranks must call it with the same variants, in the
    same order), so that rank 0 can take a sample's time as the slowest rank's. Ranks may hold
    different numbers of samples of a variant."""
    import torch
    import torch.distributed as dist

    per_rank = {}
    for v, mine in samples.items():
        count = torch.tensor([len(mine)], dtype=torch.int64)
        counts = [torch.empty_like(count) for _ in range(dist.get_world_size())]
        dist.all_gather(counts, count)
        most = max(int(c) for c in counts)
        t = torch.zeros(most, dtype=torch.float64)
        t[:len(mine)] = torch.tensor(mine, dtype=torch.float64)
        allr = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(allr, t)
        per_rank[v] = [x[:int(c)].tolist() for x, c in zip(allr, counts)]
    return per_rank


def _guard(cfg: Dict) -> None:
    """A hung rank dumps its stacks (into its log) before the job deadline kills it, and a rank
    whose driver died, even by SIGKILL, exits instead of waiting for peers forever."""
    import faulthandler

    if cfg.get("dump_after"):
        faulthandler.dump_traceback_later(cfg["dump_after"], exit=True)
    parent = os.getppid()

    def orphan_watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=orphan_watch, daemon=True).start()


# ==== the driver =====================================================================================

_LAUNCHED: list = []  # every job's launch.Ranks, killed however the driver ends


class Job:
    """One set of ranks (a world size, on this host or in the emulated cluster) running
    `script --worker cfg`. Subclasses give the label, the worker's config() and may react to rank
    0's messages in on_message(); cells, info, error and finished are filled here."""

    def __init__(self, script: str, args, n: int, workdir: str, progress: Progress, base: int, cluster=None):
        self.script, self.args, self.n, self.cluster = script, args, n, cluster
        self.hosts = args.hosts if cluster is not None else 1
        self.rph = args.ranks_per_host if cluster is not None else n
        self.workdir, self.progress, self.base = workdir, progress, base
        self.cells: List[Dict] = []
        self.info = None
        self.error: Optional[str] = None
        self.finished = False

    @property
    def label(self) -> str:
        """'4 ranks, 1 host' or '4 emulated hosts x 1 rank(s), tbf 1gbit'."""
        if self.cluster is not None:
            return f"{self.hosts} emulated hosts x {self.rph} rank(s), tbf {self.args.rate}"
        return f"{self.n} ranks, 1 host"

    def config(self) -> Dict:
        raise NotImplementedError

    def on_message(self, kind: str, data) -> None:
        pass

    def run(self) -> None:
        from rumor.testing import launch

        a = self.args
        cfg = dict(self.config(), rumor_timeout=a.rumor_timeout, dump_after=max(10, a.job_timeout - 10))
        tag = f"{self.n}-{self.hosts}"
        cfg_path = os.path.join(self.workdir, f"cfg-{tag}.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        logdir = os.path.join(self.workdir, f"logs-{tag}")
        os.makedirs(logdir, exist_ok=True)
        ranks = launch.Ranks([sys.executable, self.script, "--worker", cfg_path], self.n, cluster=self.cluster,
                             ranks_per_host=self.rph if self.cluster is not None else None,
                             env={"PYTHONWARNINGS": "ignore"}, keep_rumor_env=True, logdir=logdir,
                             pipe_stdout=(0,))
        _LAUNCHED.append(ranks)
        reader = threading.Thread(target=self._read, args=(ranks.procs[0].stdout,), daemon=True)
        reader.start()
        try:
            ranks.wait(a.job_timeout, grace_after_failure=30)  # the others' time to report
        finally:
            ranks.kill()
        reader.join(5)
        if not ranks.ok or not self.finished:
            self.error = (self.error + "\n" if self.error else "") + ranks.report(3000)

    def _read(self, stream) -> None:
        for raw in stream:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if not line.startswith("@@"):
                continue
            kind, _, payload = line[2:].partition(" ")
            try:
                data = json.loads(payload)
            except ValueError:
                continue
            if kind == "cell":
                data.update(hosts=self.hosts, ranks_per_host=self.rph, job=self.label)
                self.cells.append(data)
            elif kind == "info":
                self.info = data
            elif kind == "error":
                self.error = f"rank {data['rank']} raised:\n{data['traceback']}"
            elif kind == "done":
                self.finished = True
            self.on_message(kind, data)


def run_jobs(jobs: List[Job], result: Dict, progress: Progress) -> int:
    """Runs the jobs one after the other into result's cells, jobs and errors; 1 if one failed."""
    rc = 0
    for job in jobs:
        progress.update(job.base, f"{job.label}: starting", force=True)
        job.run()
        result["cells"].extend(job.cells)
        result["jobs"].append(dict(label=job.label, n=job.n, info=job.info, error=job.error))
        if job.error:
            progress.clear()
            print(f"\nERROR in job {job.label}:\n{job.error}", file=sys.stderr)
            result["errors"].append(job.error)
            rc = 1
    return rc


class Driver:
    """What a benchmark run must release however it ends (done, failed, Ctrl-C, SIGTERM): the
    ranks, the emulated hosts and the work directory."""

    def __init__(self, workdir_prefix: str, progress: Progress, hosts_mode: bool):
        self.workdir = tempfile.mkdtemp(prefix=workdir_prefix)
        self.progress, self.hosts_mode = progress, hosts_mode
        self.cluster = None

    def start_cluster(self, hosts: int, rate: str, **wan) -> Optional[float]:
        """Starts the emulated hosts and returns one TCP stream's throughput through a shaped link
        (bytes/s); None, after saying why, where network namespaces cannot be made here. `wan`:
        netns.Cluster's delay / jitter / loss (wan_kwargs(args) of add_world_args' options)."""
        from rumor.testing import netns

        ok, why = netns.available()
        if not ok:
            print(f"cannot emulate hosts: {why}", file=sys.stderr)
            return None
        wan = {k: v for k, v in wan.items() if v is not None}
        self.cluster = netns.Cluster(hosts, rate=rate, **wan).start()
        return self.tcp_throughput()

    def tcp_throughput(self) -> float:
        from rumor.testing import netns

        return netns.tcp_throughput(self.cluster, 0, 1, nbytes=64 << 20)

    def close_cluster(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None

    def run(self, body: Callable[[], int]) -> int:
        def on_term(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        old_term = signal.signal(signal.SIGTERM, on_term)
        try:
            return body()
        except KeyboardInterrupt:
            self.progress.clear()
            print("\ninterrupted: killing ranks" + (" and removing namespaces" if self.hosts_mode else ""),
                  file=sys.stderr)
            return 130
        finally:
            for ranks in _LAUNCHED:
                ranks.kill()
            self.close_cluster()
            signal.signal(signal.SIGTERM, old_term)
            import shutil

            # The ranks' logs (RUMOR_LOG=debug's lines among them) are kept on request.
            if os.environ.get("RUMOR_BENCH_KEEP"):
                print(f"rank logs and configs kept in {self.workdir}", file=sys.stderr)
            else:
                shutil.rmtree(self.workdir, ignore_errors=True)


class GradReady:
    """When each gradient of the compute-only model is ready in backward (ms from its start), and
    when backward returns: what the DDP bound (exposed_allreduce_s below) needs. A post-accumulate-grad
    hook per parameter, on compute-only's steps only."""

    def __init__(self, model):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.on, self.t0, self.cur, self.steps = False, 0.0, [], []
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._hit(i))

    def _hit(self, i: int) -> None:
        if self.on:
            self.cur[i] = (time.perf_counter() - self.t0) * 1e3

    def begin(self, on: bool) -> None:
        self.on, self.t0, self.cur = on, time.perf_counter(), [None] * len(self.params)

    def end(self) -> None:
        if self.on:
            self.steps.append((self.cur, (time.perf_counter() - self.t0) * 1e3))
        self.on = False

    def summary(self, skip: int) -> Optional[Dict]:
        """Medians over the measured steps: each parameter's bytes and ready time, and backward."""
        steps = [s for s in self.steps[skip:] if all(t is not None for t in s[0])]
        if not steps:
            return None
        return dict(bytes=[p.numel() * p.element_size() for p in self.params],
                    ready_ms=[statistics.median(s[0][i] for s in steps) for i in range(len(self.params))],
                    backward_ms=statistics.median(s[1] for s in steps))


class DDPFloor:
    """A compute-only model plus, in each rank's own thread, the memory traffic a data-parallel
    step needs with a perfect allreduce: when a gradient is ready, the allreduce at the memory
    bound (one copy of the gradient: every byte read and written once, host_collectives.py's
    n*S/C spread over the n ranks); with into_bucket, the copy of the gradient into its bucket
    before it, and with copy_back, after backward, the copy of the bucket back into .grad (torch
    DDP's Reducer on any backend does both; rumor's DDP only the first: its .grad are views of its
    buckets, but zero_grad(set_to_none=True), torch's default, makes autograd put each new
    gradient elsewhere, and from torch's Python-level extension points it cannot be made to write
    it into the bucket, which peers read in place). Neither copy: the floor of an allreduce that
    reads the gradients where autograd put them. No rank waits
    for another. Where the ranks' threads keep every core busy (4 ranks on 2 cores), that traffic
    takes cycles from the computation instead of hiding behind it, so this step is what such a
    DDP with a perfect allreduce can reach on this host; exposed_allreduce_s assumes idle cores
    and gives a lower figure. The gradients stay those of compute-only: the losses agree exactly."""

    def __init__(self, model, into_bucket: bool = True, copy_back: bool = True):
        import torch
        # rumor's copy (it streams large buffers past the cache): the floor takes the fastest
        # copy this library has, not torch's copy_
        from rumor._tensor import copy_into

        self.copy = copy_into
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.into_bucket, self.copy_back = into_bucket, copy_back
        self.bucket = [torch.empty_like(p) for p in self.params] if into_bucket else []
        self.reduced = [torch.empty_like(p) for p in self.params]
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._ready(i, p))

    def _ready(self, i: int, p) -> None:
        if self.into_bucket:
            self.copy(self.bucket[i], p.grad)
            self.copy(self.reduced[i], self.bucket[i])
        else:
            self.copy(self.reduced[i], p.grad)

    def finish(self) -> None:
        """The Reducer's copy back into .grad, at the end of backward (with copy_back)."""
        if self.copy_back:
            for p, r in zip(self.params, self.reduced):
                self.copy(p.grad, r)


def sample_copy_rate(result: Dict) -> float:
    """Adds one measurement of the all-core copy rate (collectives.measure_memcpy, 256 MiB) to
    result["copy_rate"] and returns result["C"], the fastest so far: a shared machine can only
    make it look slower. Taken before and after a run's jobs."""
    import collectives  # here: collectives imports this module

    result.setdefault("copy_rate", []).append(
        collectives.measure_memcpy(256 * collectives.MiB, 10, os.cpu_count() or 1))
    result["C"] = max(r["bw"] for r in result["copy_rate"])
    return result["C"]


def exposed_allreduce_s(grad_ready: Dict, n: int, copy_rate: float) -> float:
    """The least time any data-parallel step must add to the compute-only step on one host: the
    allreduce of the gradients ready last, at the memory bound, past the end of backward.

    An allreduce of S bytes per rank over n ranks of one host reads and writes n*S bytes at least
    (host_collectives.py's bound: n*S / C, C the all-core copy rate). Gradient j is ready at r_j;
    at best every allreduce runs at that bound from the moment its gradient is ready, one after
    another, and costs the computation nothing before backward ends (generous: on a host whose
    cores all compute, it does cost). The last finishes at max_k (r_k + sum of n*S_j/C over the
    gradients ready at or after r_k); what lies past backward's end is exposed. Buckets only
    group gradients, so no bucketing does better."""
    order = sorted(zip(grad_ready["ready_ms"], grad_ready["bytes"]))
    finish, tail = 0.0, 0.0
    for r, b in reversed(order):
        tail += n * b / copy_rate * 1e3
        finish = max(finish, r + tail)
    return max(0.0, finish - grad_ready["backward_ms"]) / 1e3


def add_world_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hosts", type=int, default=0,
                    help="0: one host (ranks from --ranks); H>=2: H emulated hosts in network namespaces")
    ap.add_argument("--ranks", default="2,4", help="one-host mode: world sizes to run")
    ap.add_argument("--ranks-per-host", type=int, default=1, help="--hosts mode: ranks per emulated host")
    ap.add_argument("--rate", default="1gbit", help="--hosts mode: tbf rate of each host's link")
    ap.add_argument("--delay", default=None,
                    help="--hosts mode: one-way delay of every link (e.g. 50ms: a 100 ms round trip), "
                         "through rumor-wanem")
    ap.add_argument("--jitter", default=None, help="--hosts mode: per-packet jitter added to --delay")
    ap.add_argument("--loss", type=float, default=None, help="--hosts mode: packet loss probability, e.g. 0.001")


def wan_kwargs(args, prefix: str = "") -> Dict:
    """netns.Cluster's WAN keywords from add_world_args' options (None: not asked for); `prefix`
    names options of another spelling (local_sgd.py's --link-delay: "link_")."""
    return {k: getattr(args, prefix + k) for k in ("delay", "jitter", "loss")}


def wan_label(args, prefix: str = "") -> str:
    parts = [f"{k} {v}" for k, v in wan_kwargs(args, prefix).items() if v is not None]
    return (", " + ", ".join(parts)) if parts else ""


def add_run_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rumor-timeout", type=float, default=300.0, help="rumor.init(timeout) and gloo's")
    ap.add_argument("--job-timeout", type=float, default=3600.0, help="deadline of each job (seconds)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)


def parse_size(text: str) -> int:
    """Bytes from "64MiB", "4KiB", "1GiB" or a plain integer."""
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, f in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * f)
    return int(text)


def world_sizes(ap: argparse.ArgumentParser, args) -> List[int]:
    if args.hosts > 0:
        if args.hosts < 2:
            ap.error("--hosts needs at least 2 hosts")
        return [args.hosts * args.ranks_per_host]
    return [int(x) for x in args.ranks.split(",")]


def rumor_origin(rumor) -> str:
    """Which rumor a run measures: the package's folder, and the checkout's commit where it is one
    (benchmarks import the installed rumor unless PYTHONPATH points at python/, and an installed
    copy may be older than the tree beside it)."""
    import subprocess

    where = os.path.dirname(os.path.abspath(rumor.__file__))

    def git(*a: str) -> str:
        try:
            out = subprocess.run(["git", "-C", where, *a], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    # Only a checkout that tracks this very file (site-packages may lie inside some other repository).
    if not git("ls-files", "--error-unmatch", "__init__.py"):
        return where
    commit = git("describe", "--always", "--dirty")
    return f"{where} (git {commit})" if commit else where


def run_meta(args) -> Dict:
    """Where and with what a run ran, for the JSON; says on stderr which rumor it measures."""
    import torch

    import rumor

    origin = rumor_origin(rumor)
    print(f"rumor from {origin}", file=sys.stderr)
    return dict(started=datetime.datetime.now().isoformat(timespec="seconds"), argv=sys.argv,
                args={k: v for k, v in vars(args).items() if k != "worker"},
                python=platform.python_version(), torch=torch.__version__,
                rumor=getattr(rumor, "__version__", "?"), rumor_from=origin, hostname=socket.gethostname(),
                cpus=os.cpu_count(), loadavg_start=os.getloadavg(),
                rumor_env={k: v for k, v in os.environ.items() if k.startswith("RUMOR_")})


def finish_meta(meta: Dict) -> None:
    meta["loadavg_end"] = os.getloadavg()
    meta["finished"] = datetime.datetime.now().isoformat(timespec="seconds")


def pyplot():
    """matplotlib.pyplot drawing into files only, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt, fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(result: Dict, headline: Optional[str], no_headline: str, json_path: str, png_path: str,
                  plot: Optional[Callable[[], Optional[str]]]) -> None:
    """Writes the JSON and (plot: draws png_path, returns why not or None) the plot, then prints
    the headline last, where scripts reading the output look for it."""
    result["headline"] = headline
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {json_path}")
    if plot is not None and result["cells"]:
        print(plot() or f"wrote {png_path}")
    if result["errors"]:
        print(f"{len(result['errors'])} job(s) failed (see above and JSON 'errors')")
    print(headline or no_headline)
