"""Churn soak: training that goes on while workers keep dying, live and on the restart path.

    python benchmarks/churn.py                          # 4 emulated hosts at 1 Gbit, 10 min, a kill every 20 s
    python benchmarks/churn.py --minutes 3 --kill-every 15 --restart-minutes 3
    python benchmarks/churn.py --store etcd --kill-store-host 60 --restart-minutes 0   # no single point of failure

One launcher per emulated host (rumor.testing.netns, each host's egress shaped to --rate), one
worker each, training a 25 MB MLP with rumor's DistributedDataParallel (GradientAllReduce). Three
runs, one after the other:

  failure-free  `rumor-run --live`, nobody killed, --baseline-minutes long: the goodput to beat;
  live          `rumor-run --live --max-restarts 1000 --live-spares 1`: every --kill-every seconds a
                member drawn at random (a newcomer as likely as an original; not an idle spare) is
                SIGKILLed; its launcher calls its spare in its place, which the survivors admit as
                they re-form (with --spares 0 the launcher starts a newcomer from nothing);
  restart       plain `rumor-run` (torchrun's agents, c10d rendezvous on host 0, commits every
                --commit-every steps through rumor.elastic): the same kills; every worker of every
                host restarts and resumes from the last commit.

With --store etcd the live runs keep their store in etcd members on hosts 0-2; --kill-store-host T
kills host 0 whole T seconds into the live run (its launcher, its etcd member, its worker and
spare; nothing of it is started again), and a failure-free run on three hosts gives the
capacity left: the live run is then measured against failure-free training on the same hosts
(all four until T, three after). The machine's speed drifts over minutes when it is shared:
--baseline-after runs the failure-free runs again after the soak and measures it against the mean
of both.

Goodput is the samples of the steps that count (each step once, with the world size that trained
it: a step redone after a restore counts once) over the run's wall time from its first step. The workers stop together
when the driver asks (a flag allreduced every 5 steps) and write their final parameters' hash:
the members of the last group must agree bit for bit. After each run nothing of it may be left:
no worker process, and nothing new in /dev/shm. Prints the figures, the target (live goodput >= 90%
of failure-free) and writes benchmarks/results/churn.{json,png}.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import secrets
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
    import hashlib, json, os, sys, time
    import torch
    import rumor
    from rumor import collectives
    from rumor.parallel import DistributedDataParallel

    out, model_mb, stop_file, commit_every = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    live = bool(os.environ.get("RUMOR_LIVE_ID"))
    me = os.environ.get("RUMOR_LIVE_ID") or f"n{os.environ['GROUP_RANK']}a{os.environ['TORCHELASTIC_RESTART_COUNT']}"
    tag = f"{me}-{os.getpid()}"
    with open(os.path.join(out, "procs", tag), "w") as f:  # every process, a spare too: none may be left
        f.write(str(os.getpid()))
    rumor.init()
    with open(os.path.join(out, "pids", tag), "w") as f:  # a member (a spare once called): the kills' pool
        f.write(str(os.getpid()))
    width = 1024
    layers = max(1, int(model_mb * 2**20 / 4 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    state = rumor.elastic.State(ddp, opt)
    x = torch.randn(32, width)
    log = open(os.path.join(out, f"steps-{tag}.jsonl"), "a")


    @rumor.elastic.run
    def train(state):
        while True:
            if state.step % 5 == 0:
                flag = torch.tensor([1.0 if os.path.exists(stop_file) else 0.0])
                if float(collectives.allreduce(flag, collectives.ReduceOp.MAX)[0]) > 0:
                    return
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            log.write(json.dumps({"step": state.step, "size": rumor.size(), "t": time.time()}) + "\\n")
            log.flush()
            state.step += 1
            if not live and state.step % commit_every == 0:
                state.commit()


    train(state)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    with open(os.path.join(out, f"final-{tag}.json"), "w") as f:
        json.dump({"step": state.step, "size": rumor.size(), "hash": digest}, f)
    """
)

BATCH = 32


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _shm_names():
    return set(os.listdir("/dev/shm"))


def one_run(args, cluster, kind: str, minutes: float, kills: bool, hosts: int = 0, kill_store_host: float = 0.0) -> dict:
    """kind: "live" or "restart"; hosts: how many of the cluster's hosts run a launcher (0: all);
    kill_store_host: seconds into the run at which host 0 is killed whole (its launcher, its
    etcd member, its worker and spare), never started again. Returns the run's figures."""
    hosts = hosts or args.hosts
    from rumor.testing import launch

    tmp = tempfile.mkdtemp(prefix=f"churn-{kind}-")
    os.makedirs(os.path.join(tmp, "pids"))
    os.makedirs(os.path.join(tmp, "procs"))
    script = os.path.join(tmp, "churn_worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    stop = os.path.join(tmp, "stop")
    shm_before = _shm_names()
    # Below the kernel's ephemeral range (as free_port() picks): the emulated hosts' own
    # connections take ports from that range inside their namespaces, where the root namespace
    # cannot see them (an etcd member's peer port, the next one, once collided); even, as the
    # next one is the peer port.
    port = random.Random().randrange(20000, 32000, 2)
    run_id = f"churn-{os.getpid()}-{kind}-{int(time.time())}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RUMOR_JOB_SECRET=secrets.token_hex(32),
               RUMOR_ETCD_DIR=tmp)  # a killed host's member cannot remove its data: not in /dev/shm
    procs, outs = [], []
    rng = random.Random(args.seed)
    killed = []
    host_lost = None
    t_start = time.time()
    try:
        for node in range(hosts):
            if kind == "live":
                how = ["--live", "--master-addr", cluster.ip(0), "--master-port", str(port), "--rdzv-id", run_id,
                       "--live-min", "2", "--live-spares", str(args.spares)]
                if args.store == "etcd":
                    how += ["--store", "etcd", "--store-hosts", ",".join(cluster.ip(i) for i in range(min(3, hosts)))]
            else:
                how = ["--monitor-interval", "0.1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       f"{cluster.ip(0)}:{port}", "--rdzv-id", run_id, "--local-addr", cluster.ip(node),
                       "--rdzv-conf", f"last_call_timeout=1,join_timeout=120,is_host={str(node == 0).lower()}"]
            cmd = [sys.executable, "-m", "rumor.run", "--nnodes", str(hosts), "--node-rank", str(node),
                   "--nproc-per-node", "1", "--max-restarts", "1000", *how, script, tmp, str(args.model_mb), stop,
                   str(args.commit_every)]
            out = open(os.path.join(tmp, f"launcher{node}.txt"), "w+b")
            outs.append(out)
            procs.append(cluster.popen(node, cmd, env=env, cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL))
        end = t_start + 60 * minutes
        next_kill = t_start + args.kill_every
        while time.time() < end:
            if any(p.poll() is not None for i, p in enumerate(procs) if not (host_lost is not None and i == 0)):
                raise RuntimeError(f"{kind}: a launcher ended during the soak")
            if kill_store_host and host_lost is None and time.time() >= t_start + kill_store_host:
                os.killpg(procs[0].pid, 9)  # the host that ran the store's first member, whole
                host_lost = time.time()
                killed.append((host_lost - t_start, "host0"))
            if kills and time.time() >= next_kill:
                pids = [(t, int(open(os.path.join(tmp, "pids", t)).read())) for t in sorted(os.listdir(
                    os.path.join(tmp, "pids")))]
                running = [(t, pid) for t, pid in pids if _alive(pid)]
                if running:
                    t, pid = rng.choice(running)
                    os.kill(pid, 9)
                    killed.append((time.time() - t_start, t))
                next_kill += args.kill_every
            time.sleep(0.05)
        open(stop, "w").close()
        t_stop = time.time()
        deadline = t_stop + args.end_timeout
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            time.sleep(0.1)
        hung = any(p.poll() is None for p in procs)
        if host_lost is not None:
            procs[0].wait()
    finally:
        text = launch.stop_and_collect(procs, outs, "host", tail=3000)
    codes = [p.returncode for p in procs]
    # Each step once (a step redone after a restore counts once), with the world size that trained it.
    steps, first = {}, t_stop
    for path in glob.glob(os.path.join(tmp, "steps-*.jsonl")):
        with open(path) as f:
            for line in f:
                e = json.loads(line)
                if e["t"] <= t_stop:
                    steps[e["step"]] = e["size"]
                    first = min(first, e["t"])
    finals = []
    for path in glob.glob(os.path.join(tmp, "final-*.json")):
        with open(path) as f:
            finals.append(json.load(f))
    last = max((f["step"] for f in finals), default=None)
    hashes = {f["hash"] for f in finals if f["step"] == last}
    time.sleep(1.0)  # the launchers' last sweeps are done when they exit; give the kernel a moment to reap
    left_procs = [int(open(os.path.join(tmp, "procs", t)).read()) for t in os.listdir(os.path.join(tmp, "procs"))]
    left_procs = [pid for pid in left_procs if _alive(pid)]
    left_shm = sorted(_shm_names() - shm_before)
    # From the first step (the start-up, the same in every run, is not what the runs compare).
    wall = t_stop - first
    samples = sum(steps.values()) * BATCH
    res = dict(kind=kind, kills=len(killed), killed=killed, wall_s=wall, steps=len(steps), samples=samples,
               goodput=samples / wall if wall > 0 else 0.0, finals=len(finals), agree=len(hashes) == 1, hung=hung, codes=codes,
               left_processes=left_procs, left_shm=left_shm, hosts=hosts, store=args.store if kind == "live" else "c10d")
    if host_lost is not None:
        # From the first step: how long the job had four hosts, and how long three.
        res["host_lost_s"] = host_lost - first
        res["codes"] = codes[1:]  # host 0's launcher was killed (-9); the others must end well
    if hung or len(hashes) != 1:
        res["log_tail"] = text[-6000:]
    return res


def plot(path, runs):
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(6, 3))
    labels = [f"{r['kind']}\n{r['kills']} kills" for r in runs]
    ax.bar(labels, [r["goodput"] for r in runs], color=["C2", "C0", "C3"][:len(runs)])
    ax.set_ylabel("goodput (samples/s)")
    ax.set_title("churn soak: 4 emulated hosts")
    _common.save_figure(plt, fig, path)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--model-mb", type=float, default=25.0)
    ap.add_argument("--minutes", type=float, default=10.0, help="the live soak")
    ap.add_argument("--baseline-minutes", type=float, default=2.0, help="the failure-free run")
    ap.add_argument("--baseline-after", action="store_true",
                    help="run the failure-free runs again after the live soak and compare with their mean")
    ap.add_argument("--restart-minutes", type=float, default=5.0, help="the restart path's soak (0: none)")
    ap.add_argument("--kill-every", type=float, default=20.0)
    ap.add_argument("--spares", type=int, default=1,
                    help="rumor-run --live-spares for the live runs (0: a failed worker's newcomer starts from nothing)")
    ap.add_argument("--store", choices=["tcp", "etcd"], default="tcp",
                    help="the live runs' store: node 0's TCPStore, or etcd members on hosts 0-2 (rumor-run --store)")
    ap.add_argument("--kill-store-host", type=float, default=0.0, metavar="SECONDS",
                    help="with --store etcd: host 0 (its launcher, etcd member, worker and spare) is killed whole "
                         "this many seconds into the live run and not started again; a failure-free run on three "
                         "hosts measures the capacity left")
    ap.add_argument("--commit-every", type=int, default=10, help="the restart path's commits, in steps")
    ap.add_argument("--end-timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--from-json", help="no runs: the headline and the plot again from a churn.json this wrote")
    args = ap.parse_args(argv)
    if args.kill_store_host and args.store != "etcd":
        ap.error("--kill-store-host needs --store etcd (with tcp the store dies with host 0, and the job with it)")
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        result["targets"] = []
        return _report(args, result)
    from rumor.testing import netns

    ok, why = netns.available()
    if not ok:
        ap.error(f"emulated hosts need network namespaces: {why}")
    meta = _common.run_meta(args)
    result = dict(meta=meta, runs=[], errors=[], targets=[])
    with netns.Cluster(args.hosts, rate=args.rate) as cluster:
        plan = [("failure-free", "live", args.baseline_minutes, False, 0, 0.0)]
        if args.kill_store_host:
            plan.append(("failure-free, three hosts", "live", args.baseline_minutes, False, args.hosts - 1, 0.0))
        plan.append(("live", "live", args.minutes, True, 0, args.kill_store_host))
        if args.baseline_after:
            # The machine's speed drifts over minutes (it is shared): the failure-free runs again
            # after the soak, and the soak compared with their mean.
            plan += [(f"{label} (after)", *rest) for label, *rest in plan if label.startswith("failure-free")]
        if args.restart_minutes > 0:
            plan.append(("restart", "restart", args.restart_minutes, True, 0, 0.0))
        for label, kind, minutes, kills, hosts, host_kill in plan:
            try:
                r = one_run(args, cluster, kind, minutes, kills, hosts, host_kill)
            except RuntimeError as e:
                print(f"{label}: {e}")
                result["errors"].append(f"{label}: {e}")
                continue
            r["label"] = label
            result["runs"].append(r)
            print(f"{label}: {r['wall_s']:.0f} s, {r['kills']} kills, {r['steps']} steps, goodput "
                  f"{r['goodput']:.0f} samples/s; members agree bitwise: {r['agree']} ({r['finals']} finals); "
                  f"hung: {r['hung']}; left behind: {len(r['left_processes'])} processes, "
                  f"{len(r['left_shm'])} /dev/shm entries {r['left_shm'][:5]}")
    _common.finish_meta(meta)
    return _report(args, result)


def _report(args, result) -> int:
    os.makedirs(args.out, exist_ok=True)
    json_path, png_path = os.path.join(args.out, "churn.json"), os.path.join(args.out, "churn.png")
    by = {r["label"]: r for r in result["runs"]}
    headline = None

    def failure_free(label):
        """The failure-free goodput: the mean of the runs before and after the soak (if any)."""
        runs = [by[k]["goodput"] for k in (label, f"{label} (after)") if k in by]
        return sum(runs) / len(runs)

    if "failure-free" in by and "live" in by:
        live = by["live"]
        want = failure_free("failure-free")
        bracketed = "failure-free (after)" in by
        if "host_lost_s" in live and "failure-free, three hosts" in by:
            # What failure-free training would have done with the hosts the job had: all of them
            # until host 0 was lost, the others after.
            t = live["host_lost_s"]
            want = (t * want + (live["wall_s"] - t) * failure_free("failure-free, three hosts")) / live["wall_s"]
            live["failure_free_same_hosts"] = want
        frac = live["goodput"] / want
        clean = all(r["agree"] and not r["hung"] and not r["left_processes"] and not r["left_shm"]
                    and all(c == 0 for c in r["codes"]) for r in result["runs"])
        result["targets"].append(dict(name="live goodput >= 90% of failure-free", value=frac, met=frac >= 0.9))
        result["targets"].append(dict(name="no divergence, no hang, nothing left", value=clean, met=clean))
        a = result["meta"]["args"]
        headline = (f"churn soak, {a['hosts']} emulated hosts at {a['rate']}, {a['model_mb']:g} MB MLP: live "
                    f"{live['goodput']:.0f} samples/s over {live['wall_s'] / 60:.1f} min with {live['kills']} kills "
                    f"(--live-spares {a.get('spares', 0)}, --store {a.get('store', 'tcp')}"
                    + (f", host 0 killed whole at {live['host_lost_s']:.0f} s" if "host_lost_s" in live else "")
                    + f") = {frac:.2f} of failure-free ({want:.0f}"
                    + (" with the same hosts" if "failure_free_same_hosts" in live else "")
                    + (", run before and after the soak" if bracketed else "") + ") [target >= 0.9: "
                    f"{'MET' if frac >= 0.9 else 'NOT MET'}]")
        if "restart" in by:
            rs = by["restart"]
            headline += (f"; torchrun restart path {rs['goodput']:.0f} samples/s with {rs['kills']} kills = "
                         f"{rs['goodput'] / failure_free('failure-free'):.2f} of failure-free")
        headline += f"; divergence 0, hangs 0, leftovers 0: {'yes' if clean else 'NO'}"
    result["cells"] = result["runs"]  # what _common.write_results looks for
    draw = None if args.no_plot else (lambda: plot(png_path, result["runs"]))
    _common.write_results(result, headline, "headline: n/a (no run finished)", json_path, png_path, draw)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
