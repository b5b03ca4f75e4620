#!/usr/bin/env python
"""What TLS costs a training step: benchmarks/training.py on emulated hosts, TLS off and on.

One run starts training.py --hosts H twice (same arguments), first with the data channels in
clear, then with TLS 1.3 (RUMOR_TLS_CERT/KEY/CA set to a job CA's files, made the way
`rumor-run --tls auto` makes them: rumor._tlsauto.make_credentials, in a 0700 temporary directory
removed at the end). Each run measures compute-only, the rumor variants (--algorithms) and torch
DDP over gloo, whose traffic TLS does not touch: its samples/s in both runs tells how much the
machine itself drifted between them.

Prints, per model and variant: samples/s without and with TLS, their ratio, and that ratio over
torch DDP's (the machine's drift between the runs taken out); saves the two training JSONs and a
summary JSON (--out). Needs root (network namespaces).

  sudo python benchmarks/tls_training.py --hosts 4 --models mlp25m --algorithms rumor,bytegrad
  python benchmarks/tls_training.py --summarize benchmarks/results   # the table again, from the JSONs
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))


def _credentials(directory: str) -> Dict[str, str]:
    from rumor._tlsauto import make_credentials

    creds = make_credentials(None, "tls-training-benchmark")
    paths = {}
    for var, kind in (("RUMOR_TLS_CERT", "cert"), ("RUMOR_TLS_KEY", "key"), ("RUMOR_TLS_CA", "ca")):
        path = os.path.join(directory, f"{kind}.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(creds[kind])
        paths[var] = path
    return paths


def _run(passthrough: List[str], out: str, tag: str, env: Dict[str, str], timeout_s: float) -> Dict:
    cmd = [sys.executable, os.path.join(HERE, "training.py"), *passthrough, "--out", out, "--tag", tag, "--no-plot"]
    print(f"== TLS {tag}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, env=env, check=True, timeout=timeout_s)
    hosts = passthrough[passthrough.index("--hosts") + 1]
    with open(os.path.join(out, f"training-{hosts}hosts-{tag}.json")) as f:
        return json.load(f)


def summarize(runs: Dict[str, Dict], args, out: str) -> None:
    rows = []
    print(f"\n{args.hosts} emulated hosts, tbf {args.rate}; samples/s (median step), TLS off then on, one run each; "
          "vs torch: on/off over torch DDP's on/off (gloo: no TLS)")
    print(f"{'model':12} {'variant':10} {'off':>10} {'on':>10} {'on/off':>8} {'vs torch':>9}")
    for c_off in runs["off"]["cells"]:
        c_on = next(c for c in runs["on"]["cells"] if c["model"] == c_off["model"])
        torch_ratio = c_on["variants"]["torch"]["samples_per_s"] / c_off["variants"]["torch"]["samples_per_s"]
        for v, d in c_off["variants"].items():
            off, on = d["samples_per_s"], c_on["variants"][v]["samples_per_s"]
            rows.append(dict(model=c_off["model"], variant=v, off=off, on=on, ratio=on / off,
                             ratio_over_torch=on / off / torch_ratio))
            print(f"{c_off['model']:12} {v:10} {off:10.1f} {on:10.1f} {on / off:8.3f} {on / off / torch_ratio:9.3f}")
    summary = dict(hosts=args.hosts, rate=args.rate, rows=rows,
                   args={k: r["meta"]["args"] for k, r in runs.items()},
                   started={k: r["meta"]["started"] for k, r in runs.items()},
                   loadavg={k: [r["meta"]["loadavg_start"], r["meta"]["loadavg_end"]] for k, r in runs.items()})
    path = os.path.join(out, f"tls-training-{args.hosts}hosts.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--models", default="mlp25m")
    ap.add_argument("--algorithms", default="rumor,bytegrad")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0, help="deadline of each training.py run (seconds)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--summarize", metavar="DIR",
                    help="run nothing: summarize DIR's training-<hosts>hosts-off.json and -on.json")
    args = ap.parse_args(argv)
    if args.summarize:
        runs = {}
        for tag in ("off", "on"):
            with open(os.path.join(args.summarize, f"training-{args.hosts}hosts-{tag}.json")) as f:
                runs[tag] = json.load(f)
        summarize(runs, args, args.summarize)
        return 0
    os.makedirs(args.out, exist_ok=True)
    passthrough = ["--hosts", str(args.hosts), "--rate", args.rate, "--models", args.models,
                   "--algorithms", args.algorithms, "--iters", str(args.iters), "--warmup", str(args.warmup),
                   "--job-timeout", str(args.timeout - 30)]
    base = {k: v for k, v in os.environ.items() if not k.startswith("RUMOR_TLS_")}
    tmp = tempfile.mkdtemp(prefix="rumor-tls-bench-")  # 0700
    try:
        runs = {"off": _run(passthrough, args.out, "off", base, args.timeout),
                "on": _run(passthrough, args.out, "on", {**base, **_credentials(tmp)}, args.timeout)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    summarize(runs, args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
