#!/usr/bin/env python
"""What TLS 1.3 on the data channels costs an allreduce (issue 46): 2 ranks on this host over
loopback TCP (RUMOR_SHM=0, RUMOR_HOST_DIRECT=0), allreduce of --mib MiB of float32, with TLS off
and on (RUMOR_TLS_*; certificates made here with rumor's PKI helpers).

Jobs alternate off, on, off, on... (--rounds of each), each with a warm-up and --iters timed
allreduces, so the machine's noise falls on both alike. Reports the median [min-max] seconds per
allreduce of each mode, the bound (the plaintext run: TLS can only add), and the ratio TLS / off.

    PYTHONPATH=python python benchmarks/tls_channel.py

Writes a table to stdout, JSON to --out (default docs/benchmarks/tls_channel.json) and a plot next
to it (.png, needs matplotlib). The last line is the headline.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import NO_MATPLOTLIB, pyplot, save_figure, write_results  # noqa: E402

PEER_NAME = "bench.rumor"


def worker(cfg_path: str) -> int:
    import time

    import torch

    import rumor

    with open(cfg_path) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    rumor.init()
    try:
        t = torch.ones(cfg["mib"] * 1024 * 1024 // 4)
        times = []
        for i in range(cfg["warmup"] + cfg["iters"]):
            rumor.barrier()
            t0 = time.perf_counter()
            rumor.allreduce_(t, rumor.ReduceOp.SUM)
            if i >= cfg["warmup"]:
                times.append(time.perf_counter() - t0)
        if rumor.rank() == 0:
            with open(cfg["out"], "w") as f:
                json.dump(times, f)
    finally:
        rumor.shutdown()
    return 0


def make_pki(d: str) -> list:
    from rumor import _C

    ca_cert, ca_key = _C.tls_make_ca("rumor benchmark")
    with open(os.path.join(d, "ca.pem"), "wb") as f:
        f.write(ca_cert)
    envs = []
    for r in range(2):
        cert, key = _C.tls_issue_certificate(ca_cert, ca_key, f"rank-{r}", [PEER_NAME])
        paths = [os.path.join(d, f"cert{r}.pem"), os.path.join(d, f"key{r}.pem")]
        for p, data in zip(paths, (cert, key)):
            with open(p, "wb") as f:
                f.write(data)
            os.chmod(p, 0o600)
        envs.append(dict(RUMOR_TLS_CERT=paths[0], RUMOR_TLS_KEY=paths[1], RUMOR_TLS_CA=os.path.join(d, "ca.pem"),
                         RUMOR_TLS_PEER_NAME=PEER_NAME))
    return envs


def draw(cells: list, title: str, png: str):
    """Bars of the median seconds per mode, min-max as error bars; why not, or None once drawn."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, c in enumerate(cells):
        ax.bar(i, c["median_s"], yerr=[[c["median_s"] - c["min_s"]], [c["max_s"] - c["median_s"]]], capsize=6)
    ax.set_xticks(range(len(cells)), [f"TLS {c['mode']}" for c in cells])
    ax.set_ylabel("seconds per allreduce (median, min-max)")
    ax.set_title(title)
    save_figure(plt, fig, png)
    return None


def output_png(json_path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    return os.path.splitext(json_path)[0] + ".png"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="allreduce size")
    ap.add_argument("--iters", type=int, default=10, help="timed allreduces per job")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="jobs per mode, alternating")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a job may run")
    ap.add_argument("--out", default=os.path.join(HERE, "..", "docs", "benchmarks", "tls_channel.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)

    from rumor.testing.launch import Ranks

    tmp = tempfile.mkdtemp(prefix="rumor-tls-bench-")
    tls_env = make_pki(tmp)
    env = dict(RUMOR_SHM="0", RUMOR_HOST_DIRECT="0", PYTHONPATH=os.pathsep.join(sys.path))
    times = {"off": [], "on": []}
    errors = []
    for job in range(2 * args.rounds):
        mode = "off" if job % 2 == 0 else "on"
        out = os.path.join(tmp, f"times{job}.json")
        cfg = os.path.join(tmp, f"cfg{job}.json")
        with open(cfg, "w") as f:
            json.dump(dict(mib=args.mib, iters=args.iters, warmup=args.warmup, out=out), f)
        print(f"job {job + 1}/{2 * args.rounds}: TLS {mode}", file=sys.stderr)
        ranks = Ranks([sys.executable, os.path.abspath(__file__), "--worker", cfg], 2, env=env,
                      rank_env=tls_env if mode == "on" else None)
        ranks.wait(args.timeout)
        if not ranks.ok:
            errors.append(dict(job=job, mode=mode, report=ranks.report()))
            print(ranks.report(), file=sys.stderr)
            continue
        with open(out) as f:
            times[mode] += json.load(f)

    cells = []
    print(f"allreduce of {args.mib} MiB float32, 2 ranks, loopback TCP; median [min-max] of "
          f"{args.rounds} x {args.iters} per mode")
    print(f"{'TLS':6s} {'seconds':>28s} {'GB/s (payload)':>16s} {'vs off':>8s}")
    med = {m: statistics.median(v) for m, v in times.items() if v}
    for mode in ("off", "on"):
        v = times[mode]
        if not v:
            continue
        gbs = args.mib * 2**20 / med[mode] * 1e-9
        ratio = med[mode] / med["off"] if "off" in med else float("nan")
        cells.append(dict(mode=mode, median_s=med[mode], min_s=min(v), max_s=max(v), gbs=gbs, ratio_to_off=ratio,
                          times_s=v))
        print(f"{mode:6s} {med[mode]:9.4f} [{min(v):.4f}-{max(v):.4f}] {gbs:16.2f} {ratio:7.2f}x")
    headline = None
    if len(med) == 2:
        headline = (f"allreduce {args.mib} MiB, 2 ranks, loopback TCP: TLS on {med['on']:.4f} s vs off "
                    f"(the bound) {med['off']:.4f} s = {med['on'] / med['off']:.2f}x the plaintext time")
    result = dict(when=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  host=platform.node(), cpus=os.cpu_count(), loadavg=os.getloadavg(), argv=sys.argv,
                  mib=args.mib, iters=args.iters, rounds=args.rounds, cells=cells, errors=errors)
    png = output_png(args.out)
    write_results(result, headline, "no headline: a mode has no figures", args.out, png,
                  lambda: draw(cells, f"rumor allreduce {args.mib} MiB, 2 ranks, loopback TCP", png))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
