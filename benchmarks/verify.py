"""State parity check time: rumor.elastic.verify() on the mlp25m state vs its bytes.

One host, --ranks ranks (default 2), mlp25m with Adam after one step (weights and the two
moments, ~302 MB per rank), the same state on every rank. Per iteration the slowest rank's time
of
  - rumor verify: rumor.elastic.verify(model, opt, repair=False) (per-tensor digests, two
    allgathers of 16 bytes per entry),
  - gloo gather+compare: the check without digests, every tensor torch.distributed.all_gather'ed
    over gloo and compared byte for byte (torch.equal on uint8 views),
and the bound: the same bytes hashed with hashlib's sha256 on one thread, alternating with the
others in the same ranks (what a digest check costs on one core; verify may use more threads
where a rank has more than one core). Also printed: the one-thread rates of sha256 and blake2b
over a 64 MiB buffer (sha256 is used where it is the faster). Median of
--iters after --warmup, min-max; JSON + PNG under benchmarks/results/.

Run: python benchmarks/verify.py   (smoke: --iters 2 --warmup 1)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import NO_MATPLOTLIB, finish_meta, pyplot, run_meta, save_figure, write_results  # noqa: E402

VARIANTS = ("rumor verify", "gloo gather+compare")
BOUND = "hash only"  # the same bytes through sha256 on one thread: what verify cannot beat on one core


def hash_rate(name: str) -> float:
    import torch

    buf = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    best = float("inf")
    for _ in range(3):
        h = hashlib.new(name) if name != "blake2b" else hashlib.blake2b(digest_size=16)
        t = time.perf_counter()
        h.update(mv)
        best = min(best, time.perf_counter() - t)
    return len(mv) / best


def worker(cfg_path: str) -> None:
    import torch
    import torch.distributed as dist

    import rumor
    from rumor.testing import models

    with open(cfg_path) as f:
        cfg = json.load(f)
    rumor.init()
    r, n = rumor.rank(), rumor.size()
    dist.init_process_group("gloo", init_method=f"file://{cfg['store']}", rank=r, world_size=n)
    model = models.build("mlp25m", seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    opt.step()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    nbytes += sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))

    def rumor_verify():
        rep = rumor.elastic.verify(model, opt, repair=False)
        assert rep.equal, str(rep)

    tensors = [p.detach() for p in model.parameters()] + [v for st in opt.state.values() for v in st.values()
                                                          if torch.is_tensor(v)]

    def gloo_compare():
        for t in tensors:
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            every = [torch.empty_like(raw) for _ in range(n)]
            dist.all_gather(every, raw)
            assert all(torch.equal(every[0], e) for e in every)

    def hash_only():
        for t in tensors:
            hashlib.sha256(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())).digest()

    fns = {"rumor verify": rumor_verify, "gloo gather+compare": gloo_compare, BOUND: hash_only}
    times = {v: [] for v in fns}
    for i in range(cfg["warmup"] + cfg["iters"]):
        for v in fns:  # alternating, after warm-up
            dist.barrier()
            t = time.perf_counter()
            fns[v]()
            dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time
            if i >= cfg["warmup"]:
                times[v].append(float(dt))
        if r == 0:
            print(f"@@progress {i + 1}/{cfg['warmup'] + cfg['iters']}", flush=True)
    entries = rumor.elastic.verify(model, opt, repair=False).entries  # a collective: every rank
    if r == 0:
        with open(cfg["out"], "w") as f:
            json.dump(dict(times=times, bytes=nbytes, entries=entries), f)
    dist.barrier()


def run_job(ranks: int, iters: int, warmup: int, deadline: float) -> dict:
    from rumor.testing.launch import Ranks

    tmp = tempfile.mkdtemp(prefix="rumor-bench-verify-")
    cfg = dict(store=os.path.join(tmp, "gloo"), out=os.path.join(tmp, "out.json"), iters=iters, warmup=warmup)
    cfg_path = os.path.join(tmp, "cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    job = Ranks([sys.executable, os.path.abspath(__file__), "--worker", cfg_path], ranks, pipe_stdout=(0,),
                env={"PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), HERE]))})
    codes = job.wait(deadline)
    if job.timed_out or any(c != 0 for c in codes):
        logs = "".join(open(p, errors="replace").read()[-3000:] for p in job.log_paths)
        raise SystemExit(f"verify benchmark: ranks exited {codes} (timed out: {job.timed_out}):\n{logs}")
    with open(cfg["out"]) as f:
        return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--job-timeout", type=float, default=900.0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        os._exit(0)  # skip the teardown of rumor's and gloo's threads
    meta = run_meta(args)
    sha, blake = hash_rate("sha256"), hash_rate("blake2b")
    cores = max(1, (os.cpu_count() or 1) // args.ranks)
    res = run_job(args.ranks, args.iters, args.warmup, args.job_timeout)
    finish_meta(meta)
    nbytes = res["bytes"]
    med = {v: statistics.median(res["times"][v]) for v in res["times"]}
    bound = med[BOUND]
    print(f"mlp25m + Adam state: {nbytes / 1e6:.0f} MB per rank, {res['entries']} entries, {args.ranks} ranks, "
          f"median of {args.iters}; hash rate one thread: sha256 {sha / 1e9:.2f} GB/s, blake2b {blake / 1e9:.2f} GB/s; "
          f"{cores} core(s) per rank")
    print(f"{'variant':22s} {'median':>9s} {'min-max':>17s} {'GB/s':>6s}")
    for v in VARIANTS:
        ts = res["times"][v]
        print(f"{v:22s} {med[v] * 1e3:7.0f}ms {min(ts) * 1e3:7.0f}-{max(ts) * 1e3:.0f}ms {nbytes / med[v] / 1e9:6.2f}")
    ts = res["times"][BOUND]
    print(f"{'bound: ' + BOUND:22s} {bound * 1e3:7.0f}ms {min(ts) * 1e3:7.0f}-{max(ts) * 1e3:.0f}ms {nbytes / bound / 1e9:6.2f}")
    headline = (f"verify of {nbytes / 1e6:.0f} MB: {med['rumor verify'] * 1e3:.0f} ms = "
                f"{nbytes / med['rumor verify'] / 1e9:.2f} GB/s per rank; {bound / med['rumor verify']:.0%} of the "
                f"hash bound; {med['gloo gather+compare'] / med['rumor verify']:.1f}x faster than gloo gather+compare")
    out = os.path.join(HERE, "results")
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, "verify")
    cells = [dict(variant=v, seconds=res["times"][v], median_s=med[v], GBps=nbytes / med[v] / 1e9) for v in med]
    result = dict(meta=meta, sha256_Bps=sha, blake2b_Bps=blake, cores_per_rank=cores, bound_s=bound, bytes=nbytes,
                  entries=res["entries"], cells=cells, errors=[])

    def plot():
        plt = pyplot()
        if plt is None:
            return NO_MATPLOTLIB
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.bar(list(VARIANTS) + ["bound (hash only)"], [med[v] * 1e3 for v in VARIANTS] + [bound * 1e3],
               color=["C0", "C1", "0.6"])
        ax.set_ylabel(f"ms for {nbytes / 1e6:.0f} MB")
        ax.set_title(f"state parity check, mlp25m + Adam, {args.ranks} ranks")
        save_figure(plt, fig, stem + ".png")
        return None

    write_results(result, headline, "no verify measured", stem + ".json", stem + ".png", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
