"""Real NCCL through rumor's net plugin, on a machine with one GPU.

NCCL refuses two ranks of one communicator on the same GPU of one host, and uses its net
transport only between hosts. Giving each of two processes its own NCCL_HOSTID makes NCCL treat
them as two hosts sharing nothing: they then pass the duplicate-GPU check and every byte between
them goes through the net plugin (staged through host buffers: the plugin reports
NCCL_PTR_HOST). That runs the plugin inside a real NCCL, which the plugin harness (tests/cpp)
cannot do, and compares it with NCCL's own socket transport on the same interface:

* allreduce busbw, torch.distributed NCCL, sizes 1 MiB..256 MiB, results checked;
* a plain torch DistributedDataParallel job (no rumor code in it) with the plugin turned on by
  RUMOR_NCCL_NET_PLUGIN=1, checked against one process training on both ranks' data;
* the bound: one TCP stream over the same interface (what a single socket gives).

    python benchmarks/nccl_netplugin.py [--sizes-mb 1,16,64,256] [--iters 10] [--out F.json]

NCCL_DEBUG=INFO's "NET/rumor" lines in each rank's log prove which transport ran; a variant
whose log lacks them (or has them when it should not) is reported as failed, not measured.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))


# ==== inside a rank =================================================================================

def _pg_timeout():
    """NCCL's own deadline, inside the driver's: a stalled job ends with NCCL's diagnostics."""
    import datetime

    return datetime.timedelta(seconds=float(os.environ.get("NETPLUGIN_BENCH_PG_TIMEOUT", "600")))


def _rank_allreduce(rank: int, sizes_mb: List[float], iters: int) -> Dict:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", 0),
                            timeout=_pg_timeout())
    out = {}
    for mb in sizes_mb:
        numel = int(mb * (1 << 20)) // 4
        base = (torch.arange(numel, device="cuda") % 251).float()
        x = base + rank
        want = 2 * base + 1
        dist.all_reduce(x)  # warm-up, and the correctness check
        ok = bool(torch.equal(x, want))
        times = []
        for _ in range(iters):
            x.copy_(base)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        # busbw of a ring allreduce: 2 (n-1)/n * bytes / time, n = 2
        out[str(mb)] = dict(bytes=numel * 4, ok=ok, times=times, median_s=med, busbw=numel * 4 / med)
    dist.destroy_process_group()
    return out


def _rank_ddp(rank: int, steps: int) -> Dict:
    """Plain torch DDP over NCCL; rumor appears only through the environment (import rumor
    with RUMOR_NCCL_NET_PLUGIN=1 points NCCL at the plugin)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import rumor  # noqa: F401 - RUMOR_NCCL_NET_PLUGIN=1 acts at import

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", 0),
                            timeout=_pg_timeout())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(ddp(x.cuda()), y.cuda()).backward()
        opt.step()
    params = [p.detach().cpu().tolist() for p in model.parameters()]
    dist.destroy_process_group()
    return dict(params=params, plugin=os.environ.get("NCCL_NET_PLUGIN"))


def _ddp_reference(steps: int):
    """One process on the CPU training on both ranks' batches: the average of two equal-sized
    batches' mean-loss gradients is the mean-loss gradient of their concatenation."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        xs, ys = [], []
        for rank in range(2):
            g = torch.Generator().manual_seed(100 * step + rank)
            xs.append(torch.randn(16, 64, generator=g))
            ys.append(torch.randint(0, 10, (16,), generator=g))
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def rank_main(args) -> int:
    if args.role == "allreduce":
        res = _rank_allreduce(args.rank, [float(s) for s in args.sizes_mb.split(",")], args.iters)
    else:
        res = _rank_ddp(args.rank, args.steps)
    with open(args.result, "w") as f:
        json.dump(res, f)
    return 0


# ==== the driver ====================================================================================

# Allreduce variants: the plugin as shipped, the plugin on one TCP stream per connection (what
# striping adds), NCCL's own socket transport. Extra ones help find where a job stalls.
VARIANTS = {"rumor": {}, "rumor-1stream": {"RUMOR_NET_PLUGIN_STREAMS": "1"},
            "rumor-simple": {"NCCL_PROTO": "Simple"}, "socket": {}}


def _plugin_env(variant: str, ifname: str) -> Dict[str, str]:
    env = dict(os.environ, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_SOCKET_IFNAME=ifname,
                NCCL_IB_DISABLE="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1")
    env.pop("NCCL_NET_PLUGIN", None)
    env.pop("RUMOR_NCCL_NET_PLUGIN", None)
    env.update(VARIANTS.get(variant, {}))
    if variant.startswith("rumor") and variant != "rumor-env":
        import rumor.netplugin as netplugin

        env.update(netplugin.environment())
    elif variant == "rumor-env":  # what a user of plain torch DDP sets
        env["RUMOR_NCCL_NET_PLUGIN"] = "1"
    else:  # NCCL's built-in socket transport, no plugin at all
        env["NCCL_NET_PLUGIN"] = "none"
        env["NCCL_NET"] = "Socket"
    return env


def run_pair(variant: str, role: str, args, workdir: str) -> Dict:
    """Two ranks as two NCCL 'hosts'; returns both ranks' results and whether the logs show the
    plugin (NET/rumor lines) where it should run and only there."""
    from rumor._ports import free_port

    env = _plugin_env(variant, args.ifname)
    env["MASTER_PORT"] = str(free_port())
    procs, logs, results = [], [], []
    for rank in range(2):
        result = os.path.join(workdir, f"{variant}-{role}-{rank}.json")
        log = os.path.join(workdir, f"{variant}-{role}-{rank}.log")
        cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--rank", str(rank), "--result", result,
               "--sizes-mb", args.sizes_mb, "--iters", str(args.iters), "--steps", str(args.steps)]
        e = dict(env, NCCL_HOSTID=f"rumor-bench-host-{rank}", RANK=str(rank), WORLD_SIZE="2")
        with open(log, "w") as lf:
            procs.append(subprocess.Popen(cmd, env=e, stdout=lf, stderr=subprocess.STDOUT))
        logs.append(log)
        results.append(result)
    deadline = time.monotonic() + args.job_timeout
    failed = None
    for rank, p in enumerate(procs):
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0 and failed is None:
                failed = f"rank {rank} exited with {rc}"
        except subprocess.TimeoutExpired:
            failed = failed or f"rank {rank} did not finish within {args.job_timeout:.0f} s"
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = [open(log, errors="replace").read() for log in logs]
    if args.keep_logs:
        os.makedirs(args.keep_logs, exist_ok=True)
        for rank, t in enumerate(text):
            with open(os.path.join(args.keep_logs, f"{variant}-{role}-{rank}.log"), "w") as f:
                f.write(t)
    used_plugin = all("NET/rumor" in t for t in text)
    out = dict(variant=variant, role=role, error=failed, plugin_in_log=used_plugin,
               log_tail=[t[-1500:] for t in text])
    if failed is None:
        out["ranks"] = [json.load(open(r)) for r in results]
    want_plugin = variant != "socket"
    if failed is None and used_plugin != want_plugin:
        out["error"] = ("the plugin did not run (no NET/rumor lines in the NCCL log)" if want_plugin
                        else "the plugin ran where it should not")
    return out


def one_stream_bandwidth(ifname: str, nbytes: int = 256 << 20) -> float:
    """Bytes/s of one TCP stream over loopback (or the interface's first address): the rate one
    socket gives, which the plugin's several streams should beat."""
    host = "127.0.0.1"
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    got = [0]

    def sink():
        conn, _ = srv.accept()
        with conn:
            buf = bytearray(1 << 20)
            view = memoryview(buf)
            while True:
                n = conn.recv_into(view)
                if not n:
                    break
                got[0] += n

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    payload = bytes(4 << 20)
    with socket.create_connection((host, port)) as c:
        t0 = time.perf_counter()
        sent = 0
        while sent < nbytes:
            c.sendall(payload)
            sent += len(payload)
        c.shutdown(socket.SHUT_WR)
        t.join(60)
        dt = time.perf_counter() - t0
    srv.close()
    return got[0] / dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["allreduce", "ddp"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--sizes-mb", default="1,16,64,256")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--steps", type=int, default=5, help="DDP steps")
    ap.add_argument("--ifname", default="lo", help="NCCL_SOCKET_IFNAME for both transports")
    ap.add_argument("--job-timeout", type=float, default=120.0)
    ap.add_argument("--variants", default="rumor,rumor-1stream,socket",
                    help=f"allreduce variants, from {list(VARIANTS)}")
    ap.add_argument("--no-ddp", action="store_true", help="skip the torch DDP check")
    ap.add_argument("--keep-logs", default=None, help="folder for every rank's full NCCL log")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "nccl_netplugin.json"))
    args = ap.parse_args()
    if args.role:
        return rank_main(args)

    import torch

    if not torch.cuda.is_available():
        print("nccl_netplugin: needs a CUDA device (NCCL runs on GPU tensors)")
        return 2
    ver = torch.cuda.nccl.version()
    ver = ".".join(map(str, ver)) if isinstance(ver, tuple) else str(ver)
    result = dict(torch=torch.__version__, nccl=ver,
                  device=torch.cuda.get_device_name(0), sizes_mb=args.sizes_mb, iters=args.iters)
    bad = 0
    with tempfile.TemporaryDirectory() as wd:
        result["one_stream_Bps"] = one_stream_bandwidth(args.ifname)
        os.environ.setdefault("NETPLUGIN_BENCH_PG_TIMEOUT", str(max(5.0, args.job_timeout - 10)))
        runs = {}
        for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
            if variant not in VARIANTS:
                ap.error(f"--variants: {variant!r} is not one of {list(VARIANTS)}")
            runs[variant] = run_pair(variant, "allreduce", args, wd)
        ddp = None if args.no_ddp else run_pair("rumor-env", "ddp", args, wd)
    result["allreduce"] = runs
    result["ddp"] = None if ddp is None else {k: v for k, v in ddp.items() if k != "ranks"}

    print(f"\nNCCL {result['nccl']} on {result['device']}, 2 ranks as 2 NCCL hosts (NCCL_HOSTID), "
          f"interface {args.ifname}; one TCP stream: {result['one_stream_Bps'] / 1e9:.2f} GB/s")
    for v, r in runs.items():
        if r["error"]:
            bad += 1
            print(f"  {v}: FAILED: {r['error']}\n    " + "\n    ".join(r["log_tail"][0].splitlines()[-15:]))
    names = list(runs)
    print("busbw GB/s (slowest rank's median of --iters allreduces; n = 2, so busbw = algbw)")
    print(f"{'size MiB':>9} " + " ".join(f"{v:>14}" for v in names) + f" {'rumor/socket':>13} "
          f"{'rumor/1stream':>14} {'rumor/TCP':>10} {'correct':>8}")
    ratios = []
    table = []
    f = lambda x: f"{x / 1e9:.2f}" if x else "-"  # noqa: E731
    for mb in args.sizes_mb.split(","):
        key = str(float(mb))
        cell = {}
        for v, r in runs.items():
            if not r["error"]:
                per = [rk[key] for rk in r["ranks"]]
                cell[v] = dict(busbw=min(p["busbw"] for p in per), ok=all(p["ok"] for p in per),
                               min_s=min(min(p["times"]) for p in per), max_s=max(max(p["times"]) for p in per))
        table.append(dict(size_mb=float(mb), **cell))
        bw = {v: c["busbw"] for v, c in cell.items()}
        ok = all(c["ok"] for c in cell.values())
        bad += 0 if ok else 1
        r_bw = bw.get("rumor")
        ratio = r_bw / bw["socket"] if r_bw and bw.get("socket") else None
        if ratio:
            ratios.append(ratio)
        one = r_bw / bw["rumor-1stream"] if r_bw and bw.get("rumor-1stream") else None
        nan = float("nan")
        print(f"{mb:>9} " + " ".join(f"{f(bw.get(v)):>14}" for v in names) +
              f" {ratio or nan:>13.2f} {one or nan:>14.2f} {(r_bw or 0) / result['one_stream_Bps']:>10.2f} {str(ok):>8}")
    result["table"] = table

    if ddp is None:
        pass
    elif ddp["error"]:
        bad += 1
        print(f"torch DDP with RUMOR_NCCL_NET_PLUGIN=1: FAILED: {ddp['error']}\n    "
              + "\n    ".join(ddp["log_tail"][0].splitlines()[-15:]))
    else:
        ref = _ddp_reference(args.steps)
        worst = 0.0
        for rk in ddp["ranks"]:
            for p, want in zip(rk["params"], ref):
                worst = max(worst, float((torch.tensor(p) - want).abs().max()))
        same = ddp["ranks"][0]["params"] == ddp["ranks"][1]["params"]
        result["ddp"].update(max_diff_vs_reference=worst, ranks_identical=same)
        good = same and worst < 1e-4
        bad += 0 if good else 1
        print(f"torch DDP through the plugin ({args.steps} steps): ranks identical {same}, "
              f"max |param - single-process reference| {worst:.2e} -> {'ok' if good else 'FAILED'}")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [row["size_mb"] for row in table]
        for v in runs:
            label = {"rumor": "rumor net plugin", "socket": "NCCL socket transport"}.get(v, v)
            ys = [row[v]["busbw"] / 1e9 if v in row else float("nan") for row in table]
            ax.plot(xs, ys, marker="o", label=label)
        ax.axhline(result["one_stream_Bps"] / 1e9, color="gray", ls="--", label="one TCP stream")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("allreduce size (MiB)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"NCCL {result['nccl']}, 2 ranks as 2 hosts on one GPU")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=100)
    except ImportError:
        print("(matplotlib missing: no plot)")
    except ValueError as e:  # nothing measured: no finite point to draw
        print(f"(no plot: {e})")
    print(f"wrote {args.out}")
    if ratios:
        print(f"rumor plugin / NCCL socket busbw, median over sizes: {statistics.median(ratios):.2f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
