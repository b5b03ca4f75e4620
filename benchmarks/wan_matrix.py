#!/usr/bin/env python
"""The WAN matrix of issue 46: the allreduce on 4 emulated hosts over every link of
{--rates} x {--rtts} x {--losses}, TLS off and on, rumor vs gloo vs the ring bound, in one table.

    sudo python benchmarks/wan_matrix.py                       # 2 x 3 x 2 links x TLS off/on, 10 iterations
    sudo python benchmarks/wan_matrix.py --rates 1gbit --rtts 100ms --losses 0 --tls off
    python benchmarks/wan_matrix.py --summarize benchmarks/results/wan-matrix   # the table again

Each link is one run of benchmarks/collectives.py --hosts H (rumor.testing.netns: tbf for the
rate, rumor-wanem for the delay, half the round trip each way, and the loss), allreduce of one
size per rate (--size-per-rate: the same wire time at every rate, 64 MiB at 1 Gbit), --iters
samples after --warmup. With TLS on, rumor's data channels run TLS 1.3 with a job CA's
certificates (made as `rumor-run --tls auto` makes them, in a 0700 directory removed at the
end); gloo has no TLS, so its figure in the TLS run tells how far the machine drifted between the
two runs of a link. Runs go link by link, TLS off then on, so drift falls on both alike.

Bounds: the ring bound on the link's rate, 2 (n-1)/n * S / B for n hosts (what a ring or any
bandwidth-optimal allreduce needs at best; round trips and loss only add). The table prints each
library's median time [min-max], its fraction of that bound, TLS on over off, and rumor over gloo.
Every collectives.py run's JSON is kept under --out/<link>-tls-<off|on>/, the summary in
--out/wan-matrix.json and a plot in --out/wan-matrix.png. --resume skips links whose JSON exists.

--training adds, per link and TLS mode, benchmarks/training.py (compute-only, --train-algorithms
such as GradientAllReduce and ByteGrad, torch DDP over gloo; --train-iters steps) and
benchmarks/local_sgd.py (compute-only and --train-local such as DiLoCo and Streaming DiLoCo,
one measured block of --train-block steps) on --train-models, and prints samples/s per variant,
TLS on over off, and the fraction of compute-only. --no-allreduce runs the training part only.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import NO_MATPLOTLIB, parse_rate, pyplot, save_figure  # noqa: E402
from tls_training import _credentials  # noqa: E402  (the job CA's files, as rumor-run --tls auto makes them)

MiB = 1 << 20


def _ms(text: str) -> float:
    if text.endswith("ms"):
        return float(text[:-2])
    if text.endswith("s"):
        return float(text[:-1]) * 1e3
    return float(text)


def link_name(rate: str, rtt: str, loss: float) -> str:
    return f"{rate}-rtt{rtt}-loss{loss:g}"


def size_for(rate: str, per_gbit: int) -> int:
    """Bytes of the allreduce at `rate`: per_gbit at 1 Gbit, in proportion elsewhere, a multiple of
    1 MiB (so it splits evenly over the hosts as float32)."""
    return max(MiB, int(per_gbit * parse_rate(rate) / 125e6) // MiB * MiB)


def run_link(args, rate: str, rtt: str, loss: float, tls: str, env: Dict[str, str]) -> Optional[Dict]:
    out = os.path.join(args.out, f"{link_name(rate, rtt, loss)}-tls-{tls}")
    path = os.path.join(out, f"collectives-{args.hosts}hosts.json")
    if args.resume and os.path.exists(path):
        print(f"== {out}: kept from an earlier run", flush=True)
    elif args.summarize:
        return None
    else:
        size = size_for(rate, args.size_per_gbit)
        cmd = [sys.executable, os.path.join(HERE, "collectives.py"), "--hosts", str(args.hosts), "--rate", rate,
               "--ops", "allreduce", "--sizes", str(size), "--iters", str(args.iters), "--warmup", str(args.warmup),
               "--out", out, "--no-plot", "--job-timeout", str(args.timeout - 60)]
        if _ms(rtt) > 0:
            cmd += ["--delay", f"{_ms(rtt) / 2:g}ms"]
        if loss > 0:
            cmd += ["--loss", f"{loss:g}"]
        print(f"== TLS {tls}: {' '.join(cmd[1:])}", flush=True)
        try:
            subprocess.run(cmd, env=env, check=True, timeout=args.timeout)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            print(f"== {out}: {e}", flush=True)
            return None
    with open(path) as f:
        return json.load(f)


def _wan_args(rtt: str, loss: float, delay_flag: str, loss_flag: str) -> List[str]:
    out = [delay_flag, f"{_ms(rtt) / 2:g}ms"] if _ms(rtt) > 0 else []
    return out + ([loss_flag, f"{loss:g}"] if loss > 0 else [])


def run_training(args, rate: str, rtt: str, loss: float, tls: str, env: Dict[str, str]) -> Dict[str, Optional[Dict]]:
    """training.py and local_sgd.py on one link: their JSONs (None where a run failed)."""
    out = os.path.join(args.out, f"{link_name(rate, rtt, loss)}-tls-{tls}")
    runs: Dict[str, Optional[Dict]] = {}
    common = ["--hosts", str(args.hosts), "--rate", rate, "--models", args.train_models, "--out", out, "--no-plot",
              "--job-timeout", str(args.timeout - 60)]
    for script, extra, wan, name in (
            ("training.py", ["--algorithms", args.train_algorithms, "--iters", str(args.train_iters),
                             "--warmup", "2"], _wan_args(rtt, loss, "--delay", "--loss"),
             f"training-{args.hosts}hosts-wan.json"),
            ("local_sgd.py", ["--variants", "compute," + args.train_local, "--block", str(args.train_block),
                              "--blocks", "1"], _wan_args(rtt, loss, "--link-delay", "--link-loss"),
             f"local_sgd-{args.hosts}hosts-wan.json")):
        path = os.path.join(out, name)
        if not (args.resume and os.path.exists(path)) and not args.summarize:
            cmd = [sys.executable, os.path.join(HERE, script), *common, *extra, *wan, "--tag", "wan"]
            print(f"== TLS {tls}: {' '.join(cmd[1:])}", flush=True)
            try:
                subprocess.run(cmd, env=env, check=True, timeout=args.timeout)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
                print(f"== {out}: {e}", flush=True)
        runs[script] = json.load(open(path)) if os.path.exists(path) else None
    return runs


def training_rows(rate: str, rtt: str, loss: float, runs: Dict[str, Dict[str, Optional[Dict]]]) -> List[Dict]:
    """One row per model and variant: samples/s with TLS off and on, and of compute-only."""
    rows: Dict[tuple, Dict] = {}
    for tls, by_script in runs.items():
        for script, res in by_script.items():
            for cell in (res or {}).get("cells", []):
                v = cell["variants"]
                comp = v.get("compute", {}).get("samples_per_s")
                for name, d in v.items():
                    if name == "compute" and script == "local_sgd.py":
                        continue  # training.py's compute-only stands for the model
                    row = rows.setdefault((cell["model"], name), dict(rate=rate, rtt_ms=_ms(rtt), loss=loss,
                                                                     model=cell["model"], variant=name))
                    row[f"samples_per_s_{tls}"] = d["samples_per_s"]
                    if comp:
                        row[f"of_compute_{tls}"] = d["samples_per_s"] / comp
    out = list(rows.values())
    for r in out:
        if r.get("samples_per_s_off") and r.get("samples_per_s_on"):
            r["tls_on_over_off"] = r["samples_per_s_on"] / r["samples_per_s_off"]
    return out


def print_training(rows: List[Dict]) -> None:
    print("\ntraining: samples/s (median step; DiLoCo/Streaming: one block), TLS off and on, and of compute-only "
          "(the same run's); torch DDP over gloo has no TLS (its on/off is the machine's drift)")
    print(f"{'rate':>7} {'rtt':>6} {'loss':>6} {'model':>12} {'variant':>10} | {'off':>8} {'of comp':>7} | "
          f"{'on':>8} {'of comp':>7} | {'on/off':>6}")
    for r in rows:
        def f(key, fmt):
            return format(r[key], fmt) if key in r else "-"
        print(f"{r['rate']:>7} {r['rtt_ms']:>4g}ms {r['loss']:>6g} {r['model']:>12} {r['variant']:>10} | "
              f"{f('samples_per_s_off', '8.1f'):>8} {f('of_compute_off', '7.2f'):>7} | "
              f"{f('samples_per_s_on', '8.1f'):>8} {f('of_compute_on', '7.2f'):>7} | {f('tls_on_over_off', '6.3f'):>6}")


def row_of(rate: str, rtt: str, loss: float, runs: Dict[str, Optional[Dict]], hosts: int) -> Dict:
    row = dict(rate=rate, rtt_ms=_ms(rtt), loss=loss, hosts=hosts)
    for tls, res in runs.items():
        if res is None or not res.get("cells"):
            row[f"error_{tls}"] = "no result" if res is None else f"no cell: {res.get('errors')}"
            continue
        cell = res["cells"][0]
        size, n = cell["size"], hosts
        bound_s = 2 * (n - 1) / n * size / parse_rate(rate)
        row.update(size=size, bound_s=bound_s)
        for lib in ("rumor", "gloo"):
            v = cell["variants"].get(lib)
            if not v or "median_s" not in v:
                continue
            row[f"{lib}_{tls}"] = dict(median_s=v["median_s"], min_s=v["min_s"], max_s=v["max_s"],
                                      of_bound=bound_s / v["median_s"], correct=v.get("correct"),
                                      samples_s=v["samples_s"])
    for tls in ("off", "on"):
        r, g = row.get(f"rumor_{tls}"), row.get(f"gloo_{tls}")
        if r and g:
            row[f"rumor_over_gloo_{tls}"] = g["median_s"] / r["median_s"]
    if row.get("rumor_off") and row.get("rumor_on"):
        row["tls_cost"] = row["rumor_on"]["median_s"] / row["rumor_off"]["median_s"]
        if row.get("gloo_off") and row.get("gloo_on"):
            # gloo runs in clear both times: its ratio is the machine's drift between the two runs
            row["gloo_drift"] = row["gloo_on"]["median_s"] / row["gloo_off"]["median_s"]
    return row


def _fmt(d: Optional[Dict]) -> str:
    if not d:
        return f"{'-':>27}"
    return f"{d['median_s']:6.2f} [{d['min_s']:5.2f}-{d['max_s']:5.2f}] {d['of_bound']:5.2f}"


def print_table(rows: List[Dict]) -> None:
    print(f"\n{rows[0]['hosts'] if rows else '?'} emulated hosts, allreduce; time s median [min-max] and fraction "
          "of the ring bound; TLS on/off = rumor's time with TLS over without; gloo in clear in both runs")
    print(f"{'rate':>7} {'rtt':>6} {'loss':>6} {'size':>8} {'bound':>6} | {'rumor, TLS off':>27} | "
          f"{'rumor, TLS on':>27} | {'on/off':>6} | {'gloo':>27} | {'rumor/gloo':>10}")
    for r in rows:
        size = f"{r['size'] // MiB} MiB" if "size" in r else "-"
        bound = f"{r['bound_s']:6.2f}" if "bound_s" in r else f"{'-':>6}"
        tls = f"{r['tls_cost']:6.2f}" if "tls_cost" in r else f"{'-':>6}"
        speed = f"{r['rumor_over_gloo_off']:9.2f}x" if "rumor_over_gloo_off" in r else f"{'-':>10}"
        print(f"{r['rate']:>7} {r['rtt_ms']:>4g}ms {r['loss']:>6g} {size:>8} {bound} | {_fmt(r.get('rumor_off'))} | "
              f"{_fmt(r.get('rumor_on'))} | {tls} | {_fmt(r.get('gloo_off'))} | {speed}")


def plot(rows: List[Dict], path: str) -> Optional[str]:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    labels = [f"{r['rate']}\n{r['rtt_ms']:g} ms\nloss {r['loss']:g}" for r in rows]
    xs = list(range(len(rows)))
    for k, (key, name) in enumerate((("rumor_off", "rumor"), ("rumor_on", "rumor, TLS"), ("gloo_off", "gloo"))):
        ys = [r[key]["of_bound"] if r.get(key) else 0.0 for r in rows]
        ax.bar([x + (k - 1) * 0.27 for x in xs], ys, width=0.27, label=name)
    ax.axhline(0.9, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("fraction of the ring bound (time)")
    ax.set_title(f"allreduce on {rows[0]['hosts']} emulated hosts: rumor (TLS off, on) vs gloo")
    ax.legend(fontsize=8)
    save_figure(plt, fig, path)
    return None


def summarize(rows: List[Dict], train: List[Dict], meta: Dict, out: str, no_plot: bool) -> None:
    if rows:
        print_table(rows)
    if train:
        print_training(train)
    done = [r for r in rows if r.get("rumor_off")]
    headline = None
    if done:
        worst = min(done, key=lambda r: r["rumor_off"]["of_bound"])
        costs = [r["tls_cost"] for r in rows if "tls_cost" in r]
        headline = (f"WAN matrix, {len(done)} links: rumor at {worst['rumor_off']['of_bound']:.2f}-"
                    f"{max(r['rumor_off']['of_bound'] for r in done):.2f} of the ring bound (lowest at "
                    f"{worst['rate']}, {worst['rtt_ms']:g} ms, loss {worst['loss']:g})"
                    + (f"; TLS on/off {min(costs):.2f}-{max(costs):.2f}" if costs else "")
                    + f"; rumor/gloo {min(r.get('rumor_over_gloo_off', 0) for r in done):.2f}x-"
                      f"{max(r.get('rumor_over_gloo_off', 0) for r in done):.2f}x")
    path = os.path.join(out, "wan-matrix.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows, training=train, headline=headline), f, indent=1)
    print(f"wrote {path}")
    if not no_plot and rows:
        print(plot(rows, os.path.join(out, "wan-matrix.png")) or f"wrote {os.path.join(out, 'wan-matrix.png')}")
    print(headline or ("no allreduce link finished" if rows or not train else "training only"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rates", default="100mbit,1gbit")
    ap.add_argument("--rtts", default="5ms,50ms,100ms", help="round trips (each link gets half each way)")
    ap.add_argument("--losses", default="0,0.001")
    ap.add_argument("--tls", default="off,on")
    ap.add_argument("--size-per-gbit", type=int, default=64 * MiB,
                    help="allreduce bytes at 1 Gbit; other rates in proportion")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1200.0, help="deadline of each collectives.py run (s)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "wan-matrix"))
    ap.add_argument("--resume", action="store_true", help="keep the links whose JSON is already in --out")
    ap.add_argument("--summarize", metavar="DIR", help="print the table from DIR's JSONs; run nothing")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--training", action="store_true", help="also the training runs per link (see the docstring)")
    ap.add_argument("--no-allreduce", action="store_true", help="skip the allreduce runs")
    ap.add_argument("--train-models", default="transformer,mlp25m")
    ap.add_argument("--train-algorithms", default="rumor,bytegrad", help="training.py's --algorithms")
    ap.add_argument("--train-local", default="diloco,streaming", help="local_sgd.py's variants beside compute-only")
    ap.add_argument("--train-iters", type=int, default=10)
    ap.add_argument("--train-block", type=int, default=32, help="local_sgd.py's --block (a multiple of its H)")
    args = ap.parse_args(argv)
    if args.summarize:  # every run is found in DIR, so nothing runs
        args.out, args.resume = args.summarize, True
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    rtts = [r.strip() for r in args.rtts.split(",") if r.strip()]
    losses = [float(x) for x in args.losses.split(",") if x.strip()]
    modes = [m.strip() for m in args.tls.split(",") if m.strip()]
    if any(m not in ("off", "on") for m in modes):
        ap.error("--tls takes off, on or both")
    if args.iters < 10 and not args.summarize:
        print(f"WARNING: --iters {args.iters} is below the protocol's minimum of 10", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                argv=sys.argv, args=vars(args), loadavg_start=os.getloadavg())
    base = {k: v for k, v in os.environ.items() if not k.startswith("RUMOR_TLS_")}
    tmp = tempfile.mkdtemp(prefix="rumor-wan-matrix-")  # 0700
    rows, train = [], []
    try:
        creds = _credentials(tmp) if "on" in modes and not args.summarize else {}
        for rate in rates:
            for rtt in rtts:
                for loss in losses:
                    runs, truns = {}, {}
                    for tls in modes:
                        env = {**base, **creds} if tls == "on" else base
                        if not args.no_allreduce:
                            runs[tls] = run_link(args, rate, rtt, loss, tls, env)
                        if args.training:
                            truns[tls] = run_training(args, rate, rtt, loss, tls, env)
                    if runs:
                        rows.append(row_of(rate, rtt, loss, runs, args.hosts))
                    train += training_rows(rate, rtt, loss, truns)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta["loadavg_end"] = os.getloadavg()
    summarize(rows, train, meta, args.out, args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
