#!/usr/bin/env python
"""What authentication costs: connection setup and training throughput, rumor before the job
secret and mutual HMAC handshake (a baseline checkout) vs now, in one run (issue 48).

    python benchmarks/auth.py --baseline /path/to/old/checkout/python      # one host
    sudo python benchmarks/auth.py --baseline ... --hosts 4                # + 4 emulated hosts, 1 Gbit

--baseline is a `python/` folder of a rumor checkout from before the change, with its extension
built in place (python/rumor/_C*.so); "new" is this checkout's python/ (or the installed rumor
with --new installed). Both run the same worker (this file), alternating jobs A B B A ...

Per job (rumor.testing.launch; every rank has a deadline):
  init     rumor.init() wall time, slowest rank (rendezvous + the world communicator's
           connections; includes the store and process start-up noise);
  setup    connections of a fresh communicator: rumor.new_group(all ranks) + a 1-element
           allreduce on it, median of --groups groups, slowest rank (here the handshake is the
           difference: the new one does two HMAC-SHA256 and one more round trip per stream);
  train    rumor.DistributedDataParallel(mlp25m) step time, --iters measured steps after
           --warmup, each step started after a barrier, slowest rank; samples/s = global batch /
           median step.
Cases: one host 4 ranks (shared memory between ranks, as by default), one host 4 ranks over TCP
only (RUMOR_SHM=0: every pair handshakes), and with --hosts H, H emulated hosts x 1 rank.
The bound for "new" is the baseline itself (authentication can only add); the target: training
samples/s within 1% of the baseline.

Output: a table (progress on stderr), JSON with every raw figure and a PNG in --out; the last
line is the headline: new/baseline samples/s on each case.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


# ==== inside a rank ===============================================================================

def worker(cfg: dict) -> None:
    import torch

    t0 = time.perf_counter()
    import rumor

    rumor.init()
    init_s = time.perf_counter() - t0
    n, r = rumor.size(), rumor.rank()

    def slowest(x: float) -> float:
        return float(rumor.allreduce(torch.tensor([x], dtype=torch.float64), rumor.ReduceOp.MAX)[0])

    init_s = slowest(init_s)
    setups = []
    for _ in range(cfg["groups"]):
        rumor.barrier()
        t = time.perf_counter()
        g = rumor.new_group(list(range(n)))
        rumor.allreduce(torch.ones(1), group=g)
        setups.append(slowest(time.perf_counter() - t))
    from rumor.testing import models

    batch_per_rank = 32  # BENCHMARKS.md: mlp25m [32]
    model = models.build("mlp25m")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ddp = rumor.DistributedDataParallel(model, optimizer=opt)
    x, y = models.batch(model, batch_per_rank, shard=r)
    steps = []
    for i in range(cfg["warmup"] + cfg["iters"]):
        rumor.barrier()
        t = time.perf_counter()
        opt.zero_grad()
        models.loss(ddp(x), y).backward()
        opt.step()
        dt = slowest(time.perf_counter() - t)
        if i >= cfg["warmup"]:
            steps.append(dt)
    if r == 0:
        print("@@result " + json.dumps({"init_s": init_s, "setup_s": setups, "step_s": steps,
                                        "global_batch": batch_per_rank * n}), flush=True)
    rumor.shutdown()


# ==== the driver =================================================================================

def run_job(pythonpath: str, world: int, env: dict, cluster, timeout: float, cfg: dict) -> dict:
    from rumor.testing.launch import Ranks

    e = dict(env)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, HERE, os.environ.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)]
    with Ranks(argv, world, cluster=cluster, env=e, pipe_stdout=[0]) as job:
        out = job.procs[0].stdout.read().decode()
        job.wait(timeout)
        if not job.ok:
            raise RuntimeError("job failed:\n" + job.report(3000))
    for line in out.splitlines():
        if line.startswith("@@result "):
            return json.loads(line[len("@@result "):])
    raise RuntimeError("rank 0 printed no result:\n" + out[-2000:])


def med(xs):
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", help="python/ folder of the pre-authentication checkout (built in place)")
    ap.add_argument("--new", default=os.path.join(ROOT, "python"),
                    help="python/ folder of the new rumor; 'installed' for the installed one")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--hosts", type=int, default=0, help="also H emulated hosts x 1 rank (needs root)")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--reps", type=int, default=2, help="A B B A blocks per case")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--groups", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    if not args.baseline:
        ap.error("--baseline is required (a python/ folder of the checkout before the change)")
    from _common import Progress

    cfg = {"groups": args.groups, "iters": args.iters, "warmup": args.warmup}
    variants = {"baseline": os.path.abspath(args.baseline),
                "new": "" if args.new == "installed" else os.path.abspath(args.new)}
    cases = [("one host, shm", args.ranks, {}, None), ("one host, tcp", args.ranks, {"RUMOR_SHM": "0"}, None)]
    cluster = None
    if args.hosts:
        from rumor.testing.netns import Cluster

        cluster = Cluster(args.hosts, rate=args.rate).start()
        cases.append((f"{args.hosts} hosts @ {args.rate}", args.hosts, {}, cluster))
    order = []
    for _ in range(args.reps):
        order += ["baseline", "new", "new", "baseline"]
    bar = Progress(len(cases) * len(order), "jobs", quiet_s=10)
    raw = {c[0]: {"baseline": [], "new": []} for c in cases}
    try:
        for name, world, env, cl in cases:
            for v in order:
                bar.update(label=f"{name}: {v}")
                raw[name][v].append(run_job(variants[v], world, env, cl, args.timeout, cfg))
                bar.update(bar.done + 1, force=True)
    finally:
        bar.clear()
        if cluster is not None:
            cluster.close()

    rows, headline = [], []
    print(f"{'case':24} {'variant':9} {'init s':>8} {'setup ms':>9} {'step s [min-max]':>22} {'samples/s':>10}")
    summary = {}
    for name in raw:
        s = {}
        for v in ("baseline", "new"):
            jobs = raw[name][v]
            steps = [x for j in jobs for x in j["step_s"]]
            setups = [x for j in jobs for x in j["setup_s"]]
            gb = jobs[0]["global_batch"]
            s[v] = dict(init=med([j["init_s"] for j in jobs]), setup=med(setups), step=med(steps),
                        step_min=min(steps), step_max=max(steps), sps=gb / med(steps))
            print(f"{name:24} {v:9} {s[v]['init']:8.3f} {s[v]['setup'] * 1e3:9.2f} "
                  f"{s[v]['step']:8.3f} [{s[v]['step_min']:.3f}-{s[v]['step_max']:.3f}] {s[v]['sps']:10.1f}")
        ratio = s["new"]["sps"] / s["baseline"]["sps"]
        setup_ratio = s["new"]["setup"] / s["baseline"]["setup"]
        summary[name] = dict(s, sps_ratio=ratio, setup_ratio=setup_ratio)
        rows.append((name, ratio, setup_ratio))
        headline.append(f"{name}: {ratio:.3f}x samples/s, setup {setup_ratio:.2f}x")
    print()
    for name, ratio, setup_ratio in rows:
        verdict = "ok" if ratio >= 0.99 else "MISS"
        print(f"  {name}: training new/baseline {ratio:.3f} (target >= 0.99: {verdict}); connection setup "
              f"new/baseline {setup_ratio:.2f} ({summary[name]['baseline']['setup'] * 1e3:.2f} -> "
              f"{summary[name]['new']['setup'] * 1e3:.2f} ms)")
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(args.out, f"auth-{stamp}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "raw": raw, "summary": summary}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        names = list(summary)
        xs = range(len(names))
        for i, v in enumerate(("baseline", "new")):
            axes[0].bar([x + 0.4 * i for x in xs], [summary[n][v]["sps"] for n in names], 0.4, label=v)
            axes[1].bar([x + 0.4 * i for x in xs], [summary[n][v]["setup"] * 1e3 for n in names], 0.4, label=v)
        for ax, t in zip(axes, ("training samples/s (mlp25m)", "communicator setup, ms")):
            ax.set_xticks([x + 0.2 for x in xs], names, fontsize=8)
            ax.set_title(t)
            ax.legend()
        fig.tight_layout()
        fig.savefig(path.replace(".json", ".png"), dpi=100)
    except ImportError:
        print("matplotlib is not installed: no plot written")
    print(f"wrote {path}")
    print("auth overhead: " + "; ".join(headline))


if __name__ == "__main__":
    main()
