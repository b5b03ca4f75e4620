#!/usr/bin/env python
"""What TLS 1.3 costs one core (issue 46: at least 2 GB/s per core), beside memcpy of the same bytes.

Runs the C++ program rumor_tls_speed (tests/cpp/tls_speed.cpp, built with -DRUMOR_BUILD_TESTS=ON):
in one thread, a client TlsSession seals --mib MiB in 16 KiB records and a server TlsSession opens
them, wired back to back through their in-memory BIOs (net/tls.h), --batch-kib at a time (what a
socket loop moves per round), alternating with a memcpy of the same batch. Per suite of the policy it reports GB/s of plaintext:

  encrypt     TlsSession::write of every record + taking the ciphertext out (what a sender pays)
  decrypt     feeding the ciphertext in + TlsSession::read of every record (what a receiver pays)
  memcpy      the same bytes copied once: the bound
  AEAD only   the suite's cipher through EVP on the same records, no session: what OpenSSL's
              cipher costs before the session's own copies and framing

by wall clock and by the thread's CPU time (the machine is shared: CPU time leaves out waits for a
core, so its ratios compare like with like). Figures are medians over --repeats after a warm-up,
min-max beside them. Sockets are not involved: this is the per-core crypto cost, not a link.

    python benchmarks/tls_cipher.py --bin build/tests/tests/cpp/rumor_tls_speed

Writes a table to stdout, JSON to --out (default docs/benchmarks/tls_cipher.json) and a bar chart
next to it (.png, needs matplotlib). The last line is the headline.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import NO_MATPLOTLIB, pyplot, save_figure, write_results  # noqa: E402

TARGET_GBS = 2.0  # issue 46: per core


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build", "tests", "tests", "cpp", "rumor_tls_speed"),
                    help="path of the rumor_tls_speed program")
    ap.add_argument("--out", default=os.path.join(HERE, "..", "docs", "benchmarks", "tls_cipher.json"),
                    help="JSON path; the PNG goes next to it")
    ap.add_argument("--mib", type=int, default=256, help="plaintext sealed and opened per repetition")
    ap.add_argument("--record", type=int, default=16384, help="plaintext bytes per record (TLS max 16384)")
    ap.add_argument("--batch-kib", type=int, default=256,
                    help="plaintext sealed before it is opened: what a socket loop moves per round")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600, help="seconds the program may run")
    args = ap.parse_args()
    if not os.access(args.bin, os.X_OK):
        raise SystemExit(f"no rumor_tls_speed at {args.bin}: build with -DRUMOR_BUILD_TESTS=ON, or pass --bin")

    cmd = [args.bin, "--mib", str(args.mib), "--record", str(args.record), "--batch-kib", str(args.batch_kib),
           "--repeats", str(args.repeats)]
    print("running " + " ".join(cmd), file=sys.stderr)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        raise SystemExit(f"rumor_tls_speed failed ({p.returncode}): {p.stderr.strip()}")
    raw = json.loads(p.stdout)

    rows = [("encrypt", "encrypt"), ("decrypt", "decrypt"), ("memcpy", "memcpy"), ("AEAD only", "aead_only")]
    for clock, label in (("", "wall clock"), ("_cpu", "thread CPU time")):
        print(f"TLS 1.3 on one core, {raw['mib']} MiB in {raw['record_bytes']} B records, "
              f"{raw['batch_kib']} KiB batches, {raw['openssl']}; "
              f"median of {raw['repeats']} [min-max] GB/s by {label} (ratio to memcpy)")
        print(f"{'suite':30s} " + " ".join(f"{name:>26s}" for name, _ in rows))
        for s in raw["suites"]:
            cells = []
            memcpy = s["median"][f"memcpy{clock}_gbs"]
            for _, key in rows:
                if f"{key}{clock}_gbs" not in s:  # the AEAD alone is timed by CPU time only
                    cells.append("-")
                    continue
                v = s[f"{key}{clock}_gbs"]
                med = s["median"][f"{key}{clock}_gbs"]
                cells.append(f"{med:5.2f} [{min(v):5.2f}-{max(v):5.2f}] ({med / memcpy:4.2f}x)")
            print(f"{s['suite']:30s} " + " ".join(f"{c:>26s}" for c in cells))

    first = raw["suites"][0]
    enc, dec = first["median"]["encrypt_cpu_gbs"], first["median"]["decrypt_cpu_gbs"]
    slower = min(enc, dec)
    headline = (f"{first['suite']}, one core (thread CPU time): encrypt {enc:.2f} GB/s = "
                f"{first['ratio_to_memcpy']['encrypt_cpu']:.2f}x memcpy, decrypt {dec:.2f} GB/s = "
                f"{first['ratio_to_memcpy']['decrypt_cpu']:.2f}x memcpy; target {TARGET_GBS:.0f} GB/s per core "
                f"{'met' if slower >= TARGET_GBS else 'NOT met'} ({slower / TARGET_GBS:.2f}x of it)")
    result = dict(when=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  host=platform.node(), cpu=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                  loadavg=os.getloadavg(), argv=sys.argv, target_gbs_per_core=TARGET_GBS, raw=raw, headline=headline)
    result.update(cells=raw["suites"], errors=[])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    png = os.path.splitext(args.out)[0] + ".png"

    def plot():
        plt = pyplot()
        if plt is None:
            return NO_MATPLOTLIB
        fig, ax = plt.subplots(figsize=(9, 4.5))
        width = 0.8 / len(rows)
        suites = [s["suite"] for s in raw["suites"]]
        for i, (name, key) in enumerate(rows):
            xs = [g + (i - (len(rows) - 1) / 2) * width for g in range(len(suites))]
            ax.bar(xs, [s["median"][f"{key}_cpu_gbs"] for s in raw["suites"]], width, label=name)
        ax.axhline(TARGET_GBS, color="k", lw=0.8, ls="--", label=f"target {TARGET_GBS:.0f} GB/s")
        ax.set_xticks(range(len(suites)), [s.replace("TLS_", "").replace("_", " ", 2) for s in suites], fontsize=8)
        ax.set_ylabel("GB/s of plaintext, one core (thread CPU time)")
        ax.set_title(f"rumor TLS 1.3 sessions, {raw['record_bytes']} B records ({raw['openssl']})")
        ax.legend(fontsize=8)
        save_figure(plt, fig, png)
        return None

    write_results(result, headline, "no headline", args.out, png, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
