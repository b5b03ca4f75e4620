#!/usr/bin/env python
"""What TLS on the store traffic costs a two-host job's start (issue 46): two emulated hosts
(network namespaces), one rumor-run launcher and one worker each (torchrun's static rendezvous),
with --tls off and with --tls auto (the store through the launchers' TLS tunnels, and TLS on the
data channels, whose handshakes are part of rumor.init()).

Per mode, from the workers: seconds from the launchers' start to rumor.init()'s return (the
slower rank), rumor.init()'s own seconds, and the mean round trip of --gets store.get() calls on
the workers' store (MASTER_ADDR: node 0's store directly there, node 1's through its forwarder).
Modes alternate off, on, off, on... (--rounds of each).

    sudo PYTHONPATH=python python benchmarks/store_tls.py [--rounds 1]

Writes a table to stdout and JSON to --out (default docs/benchmarks/store_tls.json); the last line
is the headline.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WORKER = textwrap.dedent(
    """
    import datetime, json, os, sys, time
    import torch.distributed as dist
    import rumor

    t0 = float(os.environ["BENCH_T0"])
    start = time.time()
    rumor.init()
    done = time.time()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    store.set(f"bench/{rumor.rank()}", b"x" * 64)
    gets = int(sys.argv[1])
    t = time.perf_counter()
    for _ in range(gets):
        store.get(f"bench/{rumor.rank()}")
    rtt = (time.perf_counter() - t) / gets
    print("BENCH " + json.dumps({"rank": rumor.rank(), "to_init_s": done - t0, "init_s": done - start,
                                 "store_get_s": rtt}), flush=True)
    rumor.shutdown()
    """
)


def run_job(cluster, tmp, tls: bool, gets: int, deadline_s: float):
    script = os.path.join(tmp, "worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    priv = tempfile.mkdtemp(dir=tmp)
    os.chmod(priv, 0o700)
    t0 = time.time()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", RUMOR_TIMEOUT="60", BENCH_T0=repr(t0),
               RUMOR_JOB_SECRET="5a" * 32, RUMOR_PRIVATE_DIR=priv)
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "rumor.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
               "--max-restarts", "0", "--master-addr", cluster.ip(0), "--master-port", "29500",
               "--rdzv-id", "bench", *(["--tls", "auto"] if tls else []), script, str(gets)]
        procs.append(cluster.popen(node, cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            out, _ = p.communicate()
        outs.append(out.decode(errors="replace"))
    text = "\n".join(outs)
    rows = [json.loads(line.split("BENCH ", 1)[1]) for line in text.splitlines() if "BENCH " in line]
    if len(rows) != 2 or any(p.returncode for p in procs):
        raise RuntimeError(f"the job (tls={tls}) failed:\n{text[-4000:]}")
    return {"to_init_s": max(r["to_init_s"] for r in rows), "init_s": max(r["init_s"] for r in rows),
            "store_get_s": {r["rank"]: r["store_get_s"] for r in rows}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--gets", type=int, default=500)
    ap.add_argument("--deadline", type=float, default=180.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "store_tls.json"))
    args = ap.parse_args()
    from rumor.testing import netns

    ok, why = netns.available()
    if not ok:
        raise SystemExit(f"store_tls.py needs network namespaces: {why}")
    runs = {"off": [], "auto": []}
    with tempfile.TemporaryDirectory() as tmp, netns.Cluster(2) as cluster:
        for _ in range(args.rounds):
            for mode in ("off", "auto"):
                runs[mode].append(run_job(cluster, tmp, mode == "auto", args.gets, args.deadline))
    print(f"{'mode':6} {'start->init s':>14} {'init() s':>9} {'get rank0 ms':>13} {'get rank1 ms':>13}")
    summary = {}
    for mode, rs in runs.items():
        s = {"to_init_s": statistics.median(r["to_init_s"] for r in rs),
             "init_s": statistics.median(r["init_s"] for r in rs),
             "store_get_ms": {k: 1e3 * statistics.median(r["store_get_s"][k] for r in rs) for k in (0, 1)}}
        summary[mode] = s
        print(f"{mode:6} {s['to_init_s']:14.3f} {s['init_s']:9.3f} {s['store_get_ms'][0]:13.3f} "
              f"{s['store_get_ms'][1]:13.3f}")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "cpus": os.cpu_count(), "load": os.getloadavg(), "rounds": args.rounds,
              "gets": args.gets, "runs": runs, "summary": summary}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    off, on = summary["off"], summary["auto"]
    print(f"store TLS: launch to rumor.init() {on['to_init_s']:.2f} s with --tls auto vs {off['to_init_s']:.2f} s "
          f"without; rumor.init() {on['init_s']:.3f} vs {off['init_s']:.3f} s; a store get from node 1 "
          f"{on['store_get_ms'][1]:.3f} vs {off['store_get_ms'][1]:.3f} ms")


if __name__ == "__main__":
    main()
