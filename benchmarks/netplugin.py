#!/usr/bin/env python
"""NCCL net plugin benchmark: libnccl-net-rumor.so between emulated hosts, per BENCHMARKS.md.

Needs: root (network namespaces, rumor.testing.netns), the netplugin_peer harness built with the
C++ tests (a non-sanitized build is picked: cmake -B build/np -DRUMOR_BUILD_TESTS=ON
-DRUMOR_BUILD_PYTHON=OFF && cmake --build build/np --target netplugin_peer; or --peer PATH), and
for the plot `pip install matplotlib`.

What it measures
  H emulated hosts (default 4), each host's egress shaped with `tbf rate 1gbit burst 256kb
  latency 20ms` (--rate), and the same hosts unshaped. The harness loads the plugin with dlopen
  and drives ncclNetPlugin_v12 as NCCL's proxy thread does: --window isend/irecv requests of
  --bytes each in flight, --messages per sample.
    pair  host 0 -> host 1; figure: the receiver's throughput.
    ring  every host sends to the next and receives from the previous at once; figure: the
          slowest host's receive throughput (a ring runs at its slowest link).
  Throughput is steady-state: the first message of a sample is 1 byte (a start marker) and the
  figure is (messages - 1) x bytes over the time from its receive completion to the last
  message's, so neither the hosts' start skew nor data a sender buffered before the receiver's
  clock started counts.
  Peer: the same harness with RUMOR_NET_PLUGIN_STREAMS=1, i.e. one plain TCP stream per
  connection. Bound: the link rate (125 MB/s at 1 Gbit); unshaped links have none.
  Each sample is a fresh harness run (connection set-up is not timed); plugin and peer alternate
  sample by sample. Reported: median over --iters samples and min-max.

Output: a table, JSON with every raw figure and a PNG plot in --out (default benchmarks/results/);
the last line printed is the headline: plugin / link bound on the shaped links (target >= 0.95).

  sudo python benchmarks/netplugin.py                       # 4 hosts, 1 Gbit and unshaped, 10 samples
  sudo python benchmarks/netplugin.py --iters 3 --messages 16   # a quick check
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

import _common
from _common import Progress, parse_rate

ROOT = os.path.dirname(_common.HERE)
MB = 1e6


def find_peer(explicit: Optional[str]) -> str:
    """The harness: --peer, RUMOR_NETPLUGIN_PEER, else the newest non-sanitized build under build/."""
    exe = explicit or os.environ.get("RUMOR_NETPLUGIN_PEER")
    if exe:
        return exe
    found = [p for p in glob.glob(os.path.join(ROOT, "build", "*", "tests", "cpp", "netplugin_peer"))
             if "san" not in os.path.basename(os.path.dirname(os.path.dirname(os.path.dirname(p))))]
    if not found:
        raise SystemExit("netplugin_peer not found: build it (cmake -B build/np -DRUMOR_BUILD_TESTS=ON "
                         "-DRUMOR_BUILD_PYTHON=OFF && cmake --build build/np --target netplugin_peer) or pass --peer")
    return max(found, key=os.path.getmtime)


def run_sample(cluster, exe: str, hosts: List[int], ring: bool, streams: int, args) -> List[float]:
    """One harness run over `hosts`; returns each receiving host's MB/s."""
    env = dict(os.environ, RUMOR_NET_PLUGIN_IFNAME="eth0", RUMOR_NET_PLUGIN_STREAMS=str(streams),
               RUMOR_NET_PLUGIN_TIMEOUT="30")
    if args.chunk_kb:
        env["RUMOR_NET_PLUGIN_CHUNK_KB"] = str(args.chunk_kb)
    common = ["--bytes", str(args.bytes), "--iters", str(args.messages), "--window", str(args.window),
              "--deadline", str(args.sample_timeout), "--start-marker"]
    kw = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    n = len(hosts)
    if ring:
        procs = [cluster.popen(h, [exe, "--send", "--recv", *common], **kw) for h in hosts]
        receivers = list(procs)
    else:
        procs = [cluster.popen(hosts[1], [exe, "--recv", *common], **kw)]
        receivers = list(procs)
    handles = []
    for p in procs:
        line = p.stdout.readline()
        if not line.startswith("HANDLE "):
            raise RuntimeError(f"harness did not print its handle: {line!r} {p.stderr.read()[-2000:]}")
        handles.append(line.split()[1])
    if ring:
        for i, p in enumerate(procs):  # host i sends to host i+1
            p.stdin.write(handles[(i + 1) % n] + "\n")
            p.stdin.flush()
    else:
        sender = cluster.popen(hosts[0], [exe, "--send", *common], **kw)
        sender.stdin.write(handles[0] + "\n")
        sender.stdin.flush()
        procs.append(sender)
    rates = []
    for p in procs:
        out, err = p.communicate(timeout=args.sample_timeout + 10)
        if p.returncode != 0:
            raise RuntimeError(f"harness exited {p.returncode}: {err.strip()[-2000:]}")
        if p in receivers:
            line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
            rates.append(json.loads(line[len("RESULT "):])["steady_MBps"])
    return rates


def summary(xs: List[float]) -> Dict:
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs), samples=xs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=4, help="emulated hosts (>= 2)")
    ap.add_argument("--rate", default="1gbit", help="tbf rate of the shaped links")
    ap.add_argument("--no-unshaped", action="store_true", help="skip the unshaped links")
    ap.add_argument("--iters", type=int, default=10, help="measured samples per case (>= 10 for reports)")
    ap.add_argument("--messages", type=int, default=64, help="messages per sample")
    ap.add_argument("--bytes", type=int, default=1 << 20, help="bytes per message")
    ap.add_argument("--window", type=int, default=4, help="requests in flight per direction (NCCL: up to 8)")
    ap.add_argument("--streams", type=int, default=4, help="plugin streams per connection")
    ap.add_argument("--chunk-kb", type=int, default=0, help="RUMOR_NET_PLUGIN_CHUNK_KB (0: the plugin's default)")
    ap.add_argument("--sample-timeout", type=float, default=120.0, help="deadline of one harness run (s)")
    ap.add_argument("--peer", help="netplugin_peer executable")
    ap.add_argument("--out", default=os.path.join(_common.HERE, "results"))
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.hosts < 2:
        ap.error("--hosts needs at least 2 hosts")
    from rumor.testing import netns

    ok, why = netns.available()
    if not ok:
        raise SystemExit(f"netplugin benchmark: {why}")
    exe = find_peer(args.peer)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(started=time.strftime("%Y-%m-%dT%H:%M:%S"), argv=sys.argv, args=vars(args), peer=exe,
                cpus=os.cpu_count(), loadavg_start=os.getloadavg())
    result: Dict = dict(meta=meta, cells=[], errors=[])
    rates = [args.rate] + ([] if args.no_unshaped else [None])
    modes = ("pair", "ring")
    progress = Progress(len(rates) * len(modes) * 2 * (args.iters + 1), "runs", quiet_s=10)
    done = 0
    for rate in rates:
        with netns.Cluster(args.hosts, rate=rate) as cluster:
            for mode in modes:
                hosts = list(range(args.hosts)) if mode == "ring" else [0, 1]
                samples: Dict[str, List[float]] = {"plugin": [], "one_stream": []}
                per_host: Dict[str, List[List[float]]] = {"plugin": [], "one_stream": []}  # raw, per sample
                try:
                    for it in range(args.iters + 1):  # the first round is warm-up
                        order = [("plugin", args.streams), ("one_stream", 1)]
                        for name, streams in (order if it % 2 == 0 else order[::-1]):
                            r = run_sample(cluster, exe, hosts, mode == "ring", streams, args)
                            if it > 0:
                                samples[name].append(min(r))
                                per_host[name].append(r)
                            done += 1
                            progress.update(done, f"{rate or 'unshaped'} {mode} {name}")
                except Exception as e:  # noqa: BLE001 - recorded, the other cases still run
                    result["errors"].append(f"{rate or 'unshaped'} {mode}: {e}")
                    print(f"ERROR {rate or 'unshaped'} {mode}: {e}", file=sys.stderr)
                    continue
                bound = parse_rate(rate) / MB if rate else None
                cell = dict(rate=rate or "unshaped", mode=mode, hosts=len(hosts), bound_MBps=bound,
                            plugin=summary(samples["plugin"]), one_stream=summary(samples["one_stream"]),
                            per_host_MBps=per_host)
                cell["plugin_over_bound"] = cell["plugin"]["median"] / bound if bound else None
                cell["plugin_over_one_stream"] = cell["plugin"]["median"] / cell["one_stream"]["median"]
                result["cells"].append(cell)
    progress.clear()
    meta["loadavg_end"] = os.getloadavg()
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")

    print(f"\nNCCL net plugin, {args.hosts} emulated hosts, {args.messages} x {args.bytes} B per sample, "
          f"window {args.window}, {args.streams} streams; MB/s median (min-max) over {args.iters} samples")
    print(f"{'link':>9} {'case':>5} {'plugin':>24} {'1 TCP stream':>24} {'bound':>7} {'/bound':>7} {'/1 stream':>9}")
    for c in result["cells"]:
        p, o = c["plugin"], c["one_stream"]
        print(f"{c['rate']:>9} {c['mode']:>5} {p['median']:8.1f} ({p['min']:6.1f}-{p['max']:6.1f})"
              f" {o['median']:8.1f} ({o['min']:6.1f}-{o['max']:6.1f})"
              f" {c['bound_MBps'] or float('nan'):7.1f} {c['plugin_over_bound'] or float('nan'):7.3f}"
              f" {c['plugin_over_one_stream']:9.2f}")

    shaped = {c["mode"]: c["plugin_over_bound"] for c in result["cells"] if c["plugin_over_bound"]}
    headline = None
    if shaped:
        parts = ", ".join(f"{m} {r:.3f}" for m, r in shaped.items())
        # The ceiling of this machine, from the same run: one plain TCP stream through the same
        # shaped links (TCP/IP headers alone cap goodput at ~0.957 of a tbf rate at MTU 1500).
        ceil = {c["mode"]: c["one_stream"]["median"] / c["bound_MBps"] for c in result["cells"] if c["bound_MBps"]}
        vs = ", ".join(f"{m} {ceil[m]:.3f} (plugin {shaped[m] / ceil[m]:.2f}x)" for m in shaped)
        headline = (f"headline: plugin / link bound at {args.rate}, {args.hosts} hosts: {parts} "
                    f"(target >= 0.95: {'met' if min(shaped.values()) >= 0.95 else 'NOT met'}); "
                    f"ceiling, one TCP stream / link bound: {vs}")

    json_path = os.path.join(args.out, "netplugin.json")
    png_path = os.path.join(args.out, "netplugin.png")

    def plot() -> Optional[str]:
        plt = _common.pyplot()
        if plt is None:
            return _common.NO_MATPLOTLIB
        fig, ax = plt.subplots(figsize=(8, 4.5))
        cells = result["cells"]
        xs = range(len(cells))
        for k, (name, color) in enumerate((("plugin", "tab:blue"), ("one_stream", "tab:gray"))):
            med = [c[name]["median"] for c in cells]
            err = [[c[name]["median"] - c[name]["min"] for c in cells], [c[name]["max"] - c[name]["median"] for c in cells]]
            ax.bar([x + (k - 0.5) * 0.38 for x in xs], med, 0.38, yerr=err, color=color,
                   label="rumor plugin" if name == "plugin" else "1 TCP stream")
        for x, c in zip(xs, cells):
            if c["bound_MBps"]:
                ax.hlines(c["bound_MBps"], x - 0.45, x + 0.45, colors="k", linestyles="--")
        ax.set_xticks(list(xs), [f"{c['rate']}\n{c['mode']}" for c in cells])
        # Shaped links run at ~120 MB/s, unshaped ones at thousands: only a log axis shows both.
        ax.set_yscale("log")
        ax.set_ylabel("MB/s per receiving host (log)")
        ax.set_title(f"NCCL net plugin, {args.hosts} emulated hosts (dashed: link bound)")
        ax.legend(loc="lower right")
        _common.save_figure(plt, fig, png_path)
        return None

    _common.write_results(result, headline, "headline: n/a (no shaped-link figure)", json_path, png_path,
                          None if args.no_plot else plot)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
