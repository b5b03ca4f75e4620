#!/usr/bin/env python
"""Is the WAN element honest? rumor.testing.netns's delay/jitter/loss (rumor-wanem) measured
against its settings, per configuration, in one run (issue 46; BENCHMARKS.md asks for this check
before every WAN benchmark).

    sudo python benchmarks/wan_emulation.py                                   # RTT 100 ms, unshaped and 1 Gbit
    sudo python benchmarks/wan_emulation.py --rtt 5ms,50ms,100ms --rates 100mbit,1gbit --loss 0.001

Each configuration builds 3 emulated hosts (rumor.testing.netns.check_wan): one-way delay RTT/2
between every pair, the tbf rate (if any) on each host's egress, loss only between hosts 0 and 2.
  RTT    ICMP echo (ping) host0 -> host1, --probes probes: median (min-max) over the set RTT;
  TCP    one stream host0 -> host1 per receive buffer (SO_RCVBUF 1 MiB, 4 MiB, kernel-autotuned;
         tcp_wmem raised to tcp_rmem's maximum so the sender's buffer is not the limit), rate over
         the second half of --seconds, against its bound min(rate, advertised window / set RTT);
  loss   --datagrams UDP datagrams host0 -> host2: share lost over the set probability (with the
         binomial 95% range of the count, and the forwarder's own count of drops).
Output: a table, JSON with every figure and a PNG of the ratios in --out; the last line is the
headline (the ratios' ranges).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> int:
    from rumor.testing import netns

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rtt", default="100ms", help="round trips to emulate, comma-separated (default 100ms)")
    ap.add_argument("--rates", default="none,1gbit", help="tbf rates, comma-separated; none = unshaped")
    ap.add_argument("--loss", type=float, default=0.001, help="loss probability between host0 and host2")
    ap.add_argument("--jitter", default=None, help="jitter (e.g. 1ms); default none")
    ap.add_argument("--probes", type=int, default=50)
    ap.add_argument("--datagrams", type=int, default=50000)
    ap.add_argument("--seconds", type=float, default=4.0, help="length of each TCP stream")
    ap.add_argument("--seed", type=int, default=1, help="forwarder seed of the first configuration (+1 each)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    ok, why = netns.available()
    if not ok:
        print(f"wan_emulation: emulated hosts unavailable: {why}")
        return 1

    configs = [(rtt, None if r.lower() == "none" else r) for rtt in args.rtt.split(",") for r in args.rates.split(",")]
    runs = []
    t0 = time.monotonic()
    for i, (rtt, rate) in enumerate(configs):
        print(f"[{i + 1}/{len(configs)}] RTT {rtt}, rate {rate or 'unshaped'} ({time.monotonic() - t0:.0f} s)",
              file=sys.stderr)
        one_way = netns.parse_time(rtt) / 2
        res = netns.check_wan(delay=one_way, rate=rate, loss=args.loss, jitter=args.jitter, probes=args.probes,
                              datagrams=args.datagrams, seconds=args.seconds, seed=args.seed + i,
                              out=lambda s: print("  " + s))
        res["config"] = {"rtt": rtt, "rate": rate}
        runs.append(res)

    print()
    print(f"{'RTT':>6} {'rate':>9} {'RTT meas/set':>13} " + " ".join(f"{t['label'][:20]:>21}" for t in runs[0]["tcp"])
          + f" {'loss meas/set':>14}")
    for r in runs:
        cells = " ".join(f"{t['rate'] / 1e6:7.1f}/{t['bound'] / 1e6:6.1f}={t['ratio']:5.3f}" for t in r["tcp"])
        loss = r["loss"]["ratio"]
        print(f"{r['config']['rtt']:>6} {r['config']['rate'] or 'none':>9} {r['rtt']['ratio']:13.4f} {cells} "
              + (f"{loss:14.3f}" if loss is not None else f"{'n/a':>14}"))
    print("(TCP cells: MB/s measured / MB/s bound = ratio)")

    rtt_r = [r["rtt"]["ratio"] for r in runs]
    tcp_r = [t["ratio"] for r in runs for t in r["tcp"]]
    loss_r = [r["loss"]["ratio"] for r in runs if r["loss"]["ratio"] is not None]
    headline = (f"WAN element: RTT measured/set {min(rtt_r):.4f}-{max(rtt_r):.4f} (target within 0.95-1.05); "
                f"one TCP stream / its bound {min(tcp_r):.3f}-{max(tcp_r):.3f}"
                + (f"; loss measured/set {min(loss_r):.2f}-{max(loss_r):.2f}" if loss_r else ""))

    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(args.out, f"wan_emulation-{stamp}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "loadavg_end": os.getloadavg(), "runs": runs, "headline": headline}, f,
                  indent=1)
    print(f"wrote {path}")
    if not args.no_plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot written")
        else:
            fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(runs)), 4))
            names = ["RTT"] + [t["label"] for t in runs[0]["tcp"]] + ["loss"]
            width = 0.8 / len(names)
            for k, name in enumerate(names):
                ys = []
                for r in runs:
                    if name == "RTT":
                        ys.append(r["rtt"]["ratio"])
                    elif name == "loss":
                        ys.append(r["loss"]["ratio"] or 0.0)
                    else:
                        ys.append(next(t["ratio"] for t in r["tcp"] if t["label"] == name))
                ax.bar([i + k * width for i in range(len(runs))], ys, width, label=name)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(runs))],
                          [f"RTT {r['config']['rtt']}\n{r['config']['rate'] or 'unshaped'}" for r in runs])
            ax.set_ylabel("measured / set (TCP: / bound)")
            ax.set_title("rumor-wanem: measured vs setting")
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
            fig.tight_layout()
            png = path.replace(".json", ".png")
            fig.savefig(png, dpi=110)
            plt.close(fig)
            print(f"wrote {png}")
    print(headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
