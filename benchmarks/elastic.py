"""Elastic training: time from a killed worker to training again.

    python benchmarks/elastic.py                       # 4 ranks, 25 MB MLP, 3 repeats
    python benchmarks/elastic.py --ranks 4 --model-mb 100 --repeats 5
    python benchmarks/elastic.py --model transformer   # BENCHMARKS.md's transformer instead
    python benchmarks/elastic.py --hosts 4 --rate 1gbit   # 4 emulated hosts (one rank each)

Each repeat launches `python -m rumor.run --nproc-per-node N --max-restarts 1` on a worker that
trains an MLP with DistributedDataParallel under rumor.elastic (commit every --commit-every
steps). Rank N-1 SIGKILLs itself at step --kill-step of the first attempt. The workers log wall
clock events to a file; the driver splits the recovery into
  detect+restart: the kill -> the restarted workers' scripts start (torchrun's agent: it notices
                  the dead worker, stops the others, rendezvous, spawns; the floor rumor cannot
                  go below, "bound" in the output)
  imports:        script start -> torch and rumor imported
  init:           -> rumor.init() returned (rendezvous, connections)
  model/DDP:      -> the model built and wrapped (the user's code, parameter broadcast)
  restore:        -> the last commit restored on every rank (broadcast from a survivor)
  first step:     -> the first training step after the restore finished
and prints the total as a ratio to the floor. JSON and PNG go to benchmarks/results/elastic.*.
The steady step time and the cost of one commit are reported beside it.
With --rejoin-delay the newcomer starts that many seconds late: with steps longer than its start
(the transformer here), its admission would otherwise give up the survivors' first step after
the failure and be counted in their recovery.

In the same repeat (unless --no-live) the same worker runs under `rumor-run --live`: no process
is restarted but the killed one, which comes back as a newcomer. Printed beside the restart path:
recovery (the kill -> every survivor finished a training step again), rejoin (the newcomer's
process started -> its first step with the others finished, split into imports, admitted and
connected, model built, state received), and whether every step was applied (by some member)
and none twice (by any process), and the state's transfer to the newcomer: its bytes over the
time of their broadcast, beside the link's rate with --hosts (rumor.elastic logs the same).

--hosts H runs each launcher in an emulated host of its own (rumor.testing.netns: network
namespaces on one bridge, each host's egress shaped to --rate), --ranks / H ranks on each; the
restart path then is torchrun's across nodes (c10d rendezvous on host 0: every agent restarts its
workers), the live path one `rumor-run --live` per host with node 0's launcher holding the store.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    if os.environ.get("RUMOR_LIVE_JOIN") == "1":  # --rejoin-delay: a replacement that comes up later
        time.sleep(float(os.environ.get("ELASTIC_BENCH_REJOIN_DELAY", "0")))
    T_START = time.time()
    import torch
    import rumor
    from rumor.parallel import DistributedDataParallel

    log, model_mb, steps, commit_every, kill_step = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    kind = sys.argv[6]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    # Under rumor-run --live the processes keep their ids (r<rank>, j<n> for newcomers).
    me = os.environ.get("RUMOR_LIVE_ID", "")
    live = bool(me)
    nproc = int(os.environ["WORLD_SIZE"])

    def event(name, **kw):
        with open(log, "a") as f:
            f.write(json.dumps(dict(ev=name, t=time.time(), rank=int(os.environ["RANK"]), attempt=attempt, id=me,
                                    **kw)) + "\\n")

    event("start", t_start=T_START)
    event("imported")
    rumor.init()
    event("init")
    if kind == "mlp":
        width = 1024
        layers = max(1, int(model_mb * 2**20 / 4 / (width * width)))
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
        x = torch.randn(32, width)
        loss_of = lambda out: out.square().mean()
    else:  # a standard model of BENCHMARKS.md, on its synthetic data
        from rumor.testing import models
        model = models.build(kind, seed=0)
        x, y = models.batch(model, models.BATCH[kind], step=0, shard=int(os.environ["RANK"]))
        loss_of = lambda out: models.loss(out, y)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    state = rumor.elastic.State(ddp, opt)
    event("built", bytes=sum(p.numel() * p.element_size() for p in model.parameters()))

    # Live: the step the newcomer joined at, the same on every member (the members hear of it
    # through on_change, the newcomer when it enters train()).
    rejoined = []
    if live:
        def changed(c):
            event("change", degraded_s=c.degraded_s, left=c.left, joined=c.joined)
            if c.joined:
                rejoined.append(state.step)
        rumor.elastic.on_change(changed)

    def watcher_cpu():
        # CPU seconds the live watcher thread (heartbeats, store reads) has used: what the live
        # machinery costs beside the two optimizer hooks, measured rather than read off a step
        # time that the shared machine moves by more than the cost itself.
        from rumor import _live
        with open(f"/proc/self/task/{_live.current().thread.native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def hooks_s(n=20000):
        # The two optimizer hooks live mode adds, per step, timed alone.
        from rumor import _live
        t = time.perf_counter()
        for _ in range(n):
            _live.before_step()
            _live.after_step()
        dt = (time.perf_counter() - t) / n
        _live.current().applied -= n
        return dt

    measure = live and kill_step < 0  # the failure-free runs
    cost = {}
    start_cpu = (watcher_cpu(), time.time()) if measure else None

    @rumor.elastic.run
    def train(state):
        transfer = None
        if live:
            from rumor import _live
            transfer = _live.current().transfer  # (bytes, seconds): the state this process received or sent
        event("restored", step=state.restored_step, transfer=transfer)
        if me.startswith("j") and not rejoined:
            rejoined.append(state.step)
        first = True
        # Live: on until the newcomer trained 3 steps with the others.
        while state.step < steps or live and kill_step >= 0 and (not rejoined or state.step < rejoined[-1] + 3) \
                and state.step < 20 * steps:
            victim = me == f"r{nproc - 1}" if live else (attempt == 0 and rumor.rank() == rumor.size() - 1)
            if victim and state.step == kill_step:
                event("kill")
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.time()
            loss_of(ddp(x)).backward()
            opt.step()
            opt.zero_grad()
            state.step += 1
            t1 = time.time()
            if state.step % commit_every == 0:
                state.commit()
                event("commit", dt=time.time() - t1)
            event("step", step=state.step, dt=t1 - t0, first=first)
            first = False
        if measure:  # while the watcher still runs (run() stops it on return)
            cost.update(cpu_s=watcher_cpu() - start_cpu[0], wall_s=time.time() - start_cpu[1], hooks_s=hooks_s())

    train(state)
    if cost:
        event("watcher", **cost)
    event("done")
    """
)


def _write_worker(tmp: str) -> str:
    script = os.path.join(tmp, "worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    return script


def _worker_args(args, tmp: str, log: str):
    return [_write_worker(tmp), log, str(args.model_mb), str(args.steps), str(args.commit_every),
            str(args.kill_step), args.model]


def _launch(args, tmp: str, log: str, i: int, live: bool) -> None:
    if args.hosts > 1:
        return _launch_hosts(args, tmp, log, i, live)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    how = ["--live"] if live else ["--monitor-interval", str(args.monitor_interval), "--master-addr", "127.0.0.1",
                                   "--master-port", str(port), "--rdzv-id", f"elastic-bench-{os.getpid()}-{i}"]
    cmd = [sys.executable, "-m", "rumor.run", "--nproc-per-node", str(args.ranks), "--max-restarts", "1",
           "--nnodes", "1", *how, *_worker_args(args, tmp, log)]
    what = "live" if live else "restart"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               ELASTIC_BENCH_REJOIN_DELAY=str(args.rejoin_delay))
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        raise RuntimeError(f"{what} run {i} did not finish within {args.timeout} s:\n"
                           f"{out.decode(errors='replace')[-3000:]}")
    if p.returncode != 0:
        raise RuntimeError(f"{what} run {i} exited with {p.returncode}:\n{out.decode(errors='replace')[-3000:]}")


_port_seq = [29400]


def _launch_hosts(args, tmp: str, log: str, i: int, live: bool) -> None:
    """One launcher per emulated host (args.cluster), each with ranks / hosts workers."""
    import secrets

    c = args.cluster
    _port_seq[0] += 7  # a port of its own per run: the last run's may still be in TIME_WAIT
    port = _port_seq[0]
    run_id = f"elastic-bench-{os.getpid()}-{i}-{'live' if live else 'restart'}"
    per = args.ranks // args.hosts
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RUMOR_JOB_SECRET=secrets.token_hex(32),
               ELASTIC_BENCH_REJOIN_DELAY=str(args.rejoin_delay))
    procs, outs = [], []
    try:
        for node in range(args.hosts):
            if live:
                how = ["--live", "--master-addr", c.ip(0), "--master-port", str(port), "--rdzv-id", run_id]
            else:
                # --local-addr: the emulated hosts share one hostname, which torchrun would
                # publish as the master's address otherwise.
                how = ["--monitor-interval", str(args.monitor_interval), "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"{c.ip(0)}:{port}", "--rdzv-id", run_id, "--local-addr", c.ip(node),
                       "--rdzv-conf", f"last_call_timeout=1,join_timeout=120,is_host={str(node == 0).lower()}"]
            cmd = [sys.executable, "-m", "rumor.run", "--nnodes", str(args.hosts), "--node-rank", str(node),
                   "--nproc-per-node", str(per), "--max-restarts", "1", *how, *_worker_args(args, tmp, log)]
            out = open(os.path.join(tmp, f"launcher-{run_id}-{node}.txt"), "w+b")
            outs.append(out)
            procs.append(c.popen(node, cmd, env=env, cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        late = any(p.poll() is None for p in procs)
    finally:
        from rumor.testing import launch

        text = launch.stop_and_collect(procs, outs, "host", tail=1500)
    what = "live" if live else "restart"
    if late:
        raise RuntimeError(f"{what} run {i} did not finish within {args.timeout} s:\n{text}")
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"{what} run {i} exited with {[p.returncode for p in procs]}:\n{text}")


def live_run(args, tmp: str, i: int):
    """rumor-run --live: the survivors' recovery (the kill -> every survivor finished a step
    again) and the newcomer's rejoin (its process started -> its first step with the others)."""
    log = os.path.join(tmp, f"live-{i}.jsonl")
    _launch(args, tmp, log, i, True)
    ev = [json.loads(line) for line in open(log)]
    kill = min(e["t"] for e in ev if e["ev"] == "kill")
    victim = next(e["id"] for e in ev if e["ev"] == "kill")
    survivors = {e["id"] for e in ev if e["id"].startswith("r") and e["id"] != victim}
    # Each survivor's first step of the epoch the failure began (its change callback runs once
    # the group re-formed, before training goes on): a step of the old epoch may still end after
    # the kill on a survivor whose allreduce had completed.
    changed = {m: min(e["t"] for e in ev if e["ev"] == "change" and e["id"] == m and e["left"] and e["t"] > kill)
               for m in survivors}
    back = [min(e["t"] for e in ev if e["ev"] == "step" and e["id"] == m and e["t"] > changed[m]) for m in survivors]
    new = [e for e in ev if e["id"].startswith("j")]
    start = min(e["t_start"] for e in new if e["ev"] == "start")

    def at(name):
        return max(e["t"] for e in new if e["ev"] == name) - start

    # No process applied a step twice, and every step was applied by some member (a member that
    # failed a step another applied receives that member's state and skips it).
    per = {}
    for e in ev:
        if e["ev"] == "step":
            per.setdefault(e["id"], []).append(e["step"])
    everyone = set().union(*per.values())
    once = all(v == sorted(set(v)) for v in per.values()) and everyone == set(range(1, max(everyone) + 1))
    got = [e["transfer"] for e in new if e["ev"] == "restored" and e.get("transfer")]
    nbytes, secs = got[-1] if got else (0, float("nan"))
    # The re-forming alone (the failure seen -> the new group formed), as each survivor's log says.
    reform = max(e["degraded_s"] for e in ev if e["ev"] == "change" and e["left"] and e["t"] > kill)
    return dict(recovery=max(back) - kill, reform=reform, rejoin=min(e["t"] for e in new if e["ev"] == "step") - start,
                rejoin_imports=at("imported"), rejoin_admitted=at("init"), rejoin_built=at("built"),
                rejoin_state=at("restored"), steps_once=once, transfer_bytes=nbytes, transfer_s=secs,
                transfer_gbit_s=nbytes * 8 / secs / 1e9 if nbytes else float("nan"),
                steady_step=statistics.median(e["dt"] for e in ev if e["ev"] == "step" and e["t"] < kill
                                              and not e["first"]))


def overhead_run(args, tmp: str, i: int, live: bool):
    """Failure-free: the median step (all ranks) with no kill, under --live or plain, and under
    --live what the live machinery was measured to cost (None for plain)."""
    log = os.path.join(tmp, f"overhead-{'live' if live else 'plain'}-{i}.jsonl")
    saved = args.kill_step, args.steps
    args.kill_step, args.steps = -1, args.overhead_steps
    try:
        _launch(args, tmp, log, i, live)
    finally:
        args.kill_step, args.steps = saved
    ev = [json.loads(line) for line in open(log)]
    step = statistics.median(e["dt"] for e in ev if e["ev"] == "step" and not e["first"])
    if not live:
        return step, None
    w = [e for e in ev if e["ev"] == "watcher"]
    # Per rank: the watcher's CPU per second, and the hooks' time per step; with more ranks than
    # cores (as here) every CPU second the watchers take is a second the steps do not get.
    return step, dict(watcher_cpu_per_s=statistics.median(e["cpu_s"] / e["wall_s"] for e in w),
                      hooks_per_step_s=statistics.median(e["hooks_s"] for e in w), ranks=len(w))


def one_run(args, tmp: str, i: int):
    log = os.path.join(tmp, f"events-{i}.jsonl")
    _launch(args, tmp, log, i, False)
    ev = [json.loads(line) for line in open(log)]
    kill = min(e["t"] for e in ev if e["ev"] == "kill")
    # The restarted processes' events (a node's agent that restarts its workers because another
    # node's failed, rather than its own, counts no attempt: its workers' attempt stays 0).
    a1 = [e for e in ev if e["t"] > kill and e["ev"] != "step" or e["ev"] == "step" and e["first"] and e["t"] > kill]
    start = min(e["t_start"] for e in a1 if e["ev"] == "start")
    imported = max(e["t"] for e in a1 if e["ev"] == "imported")
    init = max(e["t"] for e in a1 if e["ev"] == "init")
    built = max(e["t"] for e in a1 if e["ev"] == "built")
    restored = max(e["t"] for e in a1 if e["ev"] == "restored")
    first = max(e["t"] for e in a1 if e["ev"] == "step" and e["first"])
    steady = [e["dt"] for e in ev if e["ev"] == "step" and not e["first"]]
    commits = [e["dt"] for e in ev if e["ev"] == "commit" and e["rank"] == 0]
    restored_step = {e["step"] for e in a1 if e["ev"] == "restored"}
    return dict(detect_restart=start - kill, imports=imported - start, init=init - imported, build=built - init,
                restore=restored - built, first_step=first - restored,
                total=first - kill, steady_step=statistics.median(steady),
                commit=statistics.median(commits) if commits else None, restored_step=sorted(restored_step))


def model_name(args) -> str:
    return f"{args.model_mb:g} MB MLP" if args.model == "mlp" else args.model


def plot(path, runs):
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(7, 2.0 + 0.45 * len(runs)))
    phases = [("detect_restart", "torchrun detect+restart (bound)"), ("imports", "import torch, rumor"),
              ("init", "rumor.init"), ("build", "model + DDP"),
              ("restore", "restore commit"), ("first_step", "first step")]
    for i, r in enumerate(runs):
        left = 0.0
        for k, label in phases:
            ax.barh(i, r[k], left=left, label=label if i == 0 else None, color=f"C{phases.index((k, label))}")
            left += r[k]
    ax.set_yticks(range(len(runs)), [f"run {i}" for i in range(len(runs))])
    ax.set_xlabel("seconds from the SIGKILL")
    ax.set_title("elastic recovery: killed worker -> training again")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)
    _common.save_figure(plt, fig, path)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--model-mb", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--commit-every", type=int, default=3)
    ap.add_argument("--kill-step", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--monitor-interval", type=float, default=0.1, help="torchrun's --monitor-interval (s)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-live", action="store_true", help="only the restart path, not rumor-run --live beside it")
    ap.add_argument("--overhead-repeats", type=int, default=2,
                    help="failure-free runs, plain and --live alternately, for the live machinery's cost")
    ap.add_argument("--overhead-steps", type=int, default=30)
    ap.add_argument("--model", default="mlp", choices=["mlp", "mlp25m", "cnn", "transformer"],
                    help="mlp: --model-mb of 1024x1024 layers; else BENCHMARKS.md's model of that name")
    ap.add_argument("--hosts", type=int, default=1, help="emulated hosts (network namespaces), ranks split evenly")
    ap.add_argument("--rate", default="1gbit", help="each emulated host's egress rate (tbf), with --hosts")
    ap.add_argument("--rejoin-delay", type=float, default=0.0,
                    help="live: the newcomer's script waits this long before it starts (a replacement that comes "
                         "up later), so that its admission, which gives up a step, does not fall inside the "
                         "survivors' recovery; its rejoin time is counted from after the wait")
    args = ap.parse_args(argv)
    if not 0 < args.kill_step < args.steps:
        ap.error("--kill-step must be inside (0, --steps)")
    if args.hosts < 1 or args.ranks % args.hosts:
        ap.error("--ranks must be a multiple of --hosts")
    if args.hosts > 1:
        from rumor.testing import netns

        ok, why = netns.available()
        if not ok:
            ap.error(f"--hosts needs network namespaces: {why}")
        args.cluster = netns.Cluster(args.hosts, rate=args.rate)
        args.cluster.start()
        args.link_bps = netns.parse_rate_bps(args.rate)
    try:
        return _main(args)
    finally:
        if args.hosts > 1:
            args.cluster.close()


def _main(args) -> int:
    meta = _common.run_meta(argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "cluster"}))
    result = dict(meta=meta, cells=[], errors=[], targets=[])
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.overhead_repeats):
            # Alternating, so that a load change on the shared machine hits both.
            (plain, _), (live, cost) = overhead_run(args, tmp, i, False), overhead_run(args, tmp, i, True)
            cores = len(os.sched_getaffinity(0))
            # The live machinery's share of the step: the hooks' time, and the watchers' CPU over
            # the step when the ranks share the cores (all ranks' watchers, spread over the cores).
            share = (cost["hooks_per_step_s"] + cost["watcher_cpu_per_s"] * live * max(1.0, args.ranks / cores)) / live
            result.setdefault("overhead", []).append(dict(plain=plain, live=live, cost=cost, share=share))
            print(f"failure-free step, run {i}: plain {plain * 1e3:.1f} ms, --live {live * 1e3:.1f} ms "
                  f"({(live / plain - 1) * 100:+.1f}%); measured cost: watcher {cost['watcher_cpu_per_s'] * 1e3:.2f} ms "
                  f"CPU per s per rank, hooks {cost['hooks_per_step_s'] * 1e6:.1f} us per step -> "
                  f"{share * 100:.2f}% of the step")
        def attempt(fn, label):
            try:
                return fn(args, tmp, i)
            except RuntimeError as e:  # a run that failed is reported and counted, the others go on
                print(f"{label} {i}: {e}")
                result["errors"].append(str(e))
                return None

        for i in range(args.repeats):
            r = attempt(one_run, "run")
            if r is None:
                continue
            result["cells"].append(r)
            print(f"run {i}: killed -> training again {r['total']:.2f} s = detect+restart {r['detect_restart']:.2f} "
                  f"+ imports {r['imports']:.2f} + init {r['init']:.2f} + model/DDP {r['build']:.2f} + restore {r['restore']:.3f} + first step {r['first_step']:.3f} "
                  f"(steady step {r['steady_step'] * 1e3:.0f} ms, commit {r['commit'] * 1e3:.0f} ms, "
                  f"restored step {r['restored_step']})")
            lr = None if args.no_live else attempt(live_run, "live run")
            if lr is None:
                continue
            result.setdefault("live", []).append(lr)
            print(f"live run {i}: killed -> every survivor trained a step again {lr['recovery']:.2f} s "
                  f"(restart path {r['total']:.2f} s: {r['total'] / lr['recovery']:.1f}x; = "
                  f"{lr['recovery'] / lr['steady_step']:.1f} steady steps, the step given up and redone included; "
                  f"re-forming the group {lr['reform']:.2f} s); newcomer started -> "
                  f"its first step {lr['rejoin']:.2f} s (imports {lr['rejoin_imports']:.2f}, admitted and "
                  f"connected {lr['rejoin_admitted']:.2f}, built {lr['rejoin_built']:.2f}, state received "
                  f"{lr['rejoin_state']:.2f}); no step applied twice, none missing: {lr['steps_once']}; steady step "
                  f"{lr['steady_step'] * 1e3:.0f} ms (restart path {r['steady_step'] * 1e3:.0f} ms); state transfer "
                  f"{lr['transfer_bytes'] / 1e6:.1f} MB in {lr['transfer_s']:.3f} s = {lr['transfer_gbit_s']:.2f} Gbit/s"
                  + (f" = {lr['transfer_gbit_s'] * 1e9 / args.link_bps:.2f} of the link" if args.hosts > 1 else ""))
    _common.finish_meta(meta)
    os.makedirs(args.out, exist_ok=True)
    stem = "elastic" + ("" if args.model == "mlp" else f"-{args.model}") + (f"-{args.hosts}hosts" if args.hosts > 1 else "")
    json_path, png_path = os.path.join(args.out, f"{stem}.json"), os.path.join(args.out, f"{stem}.png")
    headline = None
    if result["cells"]:
        med = {k: statistics.median(c[k] for c in result["cells"])
               for k in ("total", "detect_restart", "imports", "init", "build", "restore", "first_step", "steady_step", "commit")}
        result["median"] = med
        rumor_part = med["init"] + med["restore"] + med["first_step"]
        headline = (f"killed worker -> training again: {med['total']:.2f} s median over {len(result['cells'])} runs "
                    f"({args.ranks} ranks{f' on {args.hosts} emulated hosts at {args.rate}' if args.hosts > 1 else ''}, "
                    f"{model_name(args)}) = {med['total'] / med['detect_restart']:.2f}x "
                    f"the torchrun restart floor ({med['detect_restart']:.2f} s); rumor's part (init + restore + "
                    f"first step) {rumor_part:.2f} s = {rumor_part / med['steady_step']:.1f} steady steps; "
                    f"imports {med['imports']:.2f} s, model/DDP {med['build']:.2f} s")
        if result.get("overhead"):
            ratio = statistics.median(c["live"] / c["plain"] for c in result["overhead"])
            share = statistics.median(c["share"] for c in result["overhead"])
            result["targets"].append(dict(name="live failure-free overhead <= 1% (measured cost)", value=share,
                                          met=share <= 0.01))
            headline += (f"; failure-free step under --live {(ratio - 1) * 100:+.1f}% vs plain (step times, noisy), "
                         f"the live machinery's measured cost {share * 100:.2f}% of the step [target <= 1%: "
                         f"{'MET' if share <= 0.01 else 'NOT MET'}]")
        if result.get("live"):
            rec = statistics.median(c["recovery"] for c in result["live"])
            rej = statistics.median(c["rejoin"] for c in result["live"])
            rate = statistics.median(c["transfer_gbit_s"] for c in result["live"])
            reform = statistics.median(c["reform"] for c in result["live"])
            steps = statistics.median(c["recovery"] / c["steady_step"] for c in result["live"])
            result["live_median"] = dict(recovery=rec, rejoin=rej, transfer_gbit_s=rate, reform=reform,
                                         recovery_steps=steps)
            ok = rec <= 1.0
            result["targets"].append(dict(name="live recovery <= 1 s", value=rec, met=ok))
            headline += (f"; LIVE (rumor-run --live): kill -> survivors training again {rec:.2f} s = "
                         f"{med['total'] / rec:.1f}x faster than the restart path [target <= 1 s: "
                         f"{'MET' if ok else 'NOT MET'}; {steps:.1f} steady steps, of which re-forming the group "
                         f"{reform:.2f} s], newcomer start -> first step {rej:.2f} s, "
                         f"state transfer {rate:.2f} Gbit/s")
            if args.hosts > 1:
                frac = rate * 1e9 / args.link_bps
                result["targets"].append(dict(name="state transfer >= 80% of the link rate", value=frac,
                                              met=frac >= 0.8))
                headline += f" = {frac:.2f} of the {args.rate} link [target >= 0.8: {'MET' if frac >= 0.8 else 'NOT MET'}]"
    draw = None if args.no_plot else (lambda: plot(png_path, result["cells"]))
    _common.write_results(result, headline, "headline: n/a (no run finished)", json_path, png_path, draw)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
