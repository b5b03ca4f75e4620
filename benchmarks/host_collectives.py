#!/usr/bin/env python
"""One host at memory speed (issue 44): rumor's host collectives against the memory bound, gloo
and DeepSpeed's shared-memory allreduce, per benchmarks/BENCHMARKS.md ("Wave 3 additions").

Needs: the installed rumor package, torch; for the DeepSpeed column `pip install deepspeed
torch==2.13.0` (its CPU shared-memory op is compiled with the system compiler on first use);
for the plot `pip install matplotlib`.

What it runs: the cells of benchmarks/collectives.py (same timing loop, same exact-value checks),
for 2 and 4 ranks on this machine, allreduce / reduce_scatter / allgather / broadcast, float32 and
bfloat16, 4 KiB .. 256 MiB. Sizes are the full buffer (allreduce: each rank's buffer;
reduce_scatter: each rank's input; allgather: the gathered output; broadcast: the buffer). Columns:
  rumor, gloo            rumor.allreduce_ / reduce_scatter / allgather and torch.distributed on gloo
  deepspeed              deepspeed.comm.inference_all_reduce (allreduce only), set up as DeepSpeed
                         does on CPU: DS_ACCELERATOR=cpu, LOCAL_SIZE = ranks on the host,
                         deepspeed.init_distributed("gloo"), which builds and initializes its
                         shared-memory comm op. Where that op cannot reduce a dtype (bf16/fp16 need
                         AVX512-BW, float32 AVX2) DeepSpeed itself falls back to gloo: that column
                         then says n/a with the reason instead of timing gloo twice.
The bound: C = the machine's all-core copy rate (torch copy_ of 256 MiB split over every core's
thread, bytes copied per second; buffers 16x the L3 here), measured before and after the jobs
(and the one-thread rate of 64 MiB): C is the fastest of them, since on a shared machine a
measurement can only come out too low. A
perfect implementation must read every input byte once and write every output byte once, and C
moves a byte read plus a byte written per copied byte, so
  bound = (bytes read + bytes written) / (2 C), with P ranks and size S:
    allreduce       reads P*S, writes P*S          -> P*S / C
    reduce_scatter  reads P*S, writes P * S/P = S  -> (P+1)*S / (2C)
    allgather       reads P * S/P = S, writes P*S  -> (P+1)*S / (2C)
    broadcast       reads S (the root's), writes (P-1)*S  -> P*S / (2C)
Each time is printed as a fraction of that bound (bound/time, 1.0 = at the bound). "moved" is what
rumor's design reads plus writes, all ranks together, counted from the algorithm (every copy into
and out of the shared-memory rings and every reduction pass, cache-resident staging included),
as a multiple of the bound's bytes, twice: "touched" (cache-resident staging included) and
"memory" (without it: what the copy rate limits; 1/memory is about the best fraction that design
could reach). "before" is rumor's allreduce forced to what it used on one host before issue 44
(recursive doubling up to 64 KiB, the ring above; csrc/comm/direct.h has the new paths), timed in
the same run. The other collectives have no algorithm to force from Python: for their "before",
run this script twice, once with an older build of rumor's extension on PYTHONPATH.

The floor under the small sizes: with 4 KiB and float32 allreduce in the run, rumor-syncfloor
(csrc/tools/sync_floor.cpp, shipped as rumor/lib/rumor-syncfloor) times P processes that only
synchronize, as rumor's small path does without its data: each op every process adds one to a
shared counter and the last wakes the sleepers with one futex wake-up; the best of sleeping at
once, spinning 50 us first and yielding the core a few times first (sched_yield, as rumor's
small path does where ranks share cores), measured before and after the jobs. Every rank must run once
after the last arrival in any small collective, so no design beats it here; the 4 KiB targets
print rumor's time beside it.

The core handoff (with 2 ranks in the run): rumor-syncfloor with 2 processes spinning on one
counter, 12 short probes 0.25 s apart before and after the jobs (core_handoff()). On this VM it
reads ~30 ns in one state and ~220 ns in the other (the vCPUs on cores that share a cache or
not), and the cells of 2 ranks that stay in the caches (1 MiB) are bimodal with it, for every
library: a 1 MiB median compares whichever state each library's samples fell in. rumor's
allreduce of 2 ranks from 1 to 16 MiB follows the state since rank 0 times the rings and the
direct path and names the faster (PathChoice, csrc/comm/direct.h; RUMOR_TWO_RANK_PATH fixes it).

  python benchmarks/host_collectives.py                               # full run (long)
  python benchmarks/host_collectives.py --sizes 4KiB,1MiB,64MiB --iters 10   # quicker
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import stat
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import _common
import collectives as coll
from _common import Progress, emit
from collectives import KiB, MiB, fmt_size, fmt_time

OPS = coll.OPS + ("broadcast",)
DTYPES = ("float32", "bfloat16")
PEERS = ("gloo", "deepspeed")
SMALL_ALLREDUCE = 64 * KiB  # rumor's recursive-doubling threshold on one host (context.h)
SMALL_SLOT = 64 * KiB  # one shared slot (HostSmall::kMaxBytes in csrc/comm/direct.h)


# ==== the floor under small collectives ============================================================

# (spin us, yield): sleeping at once, spinning a while before the sleep, yielding before it
SYNC_PROTOCOLS = ((0, 0), (50, 0), (0, 1))


def fmt_fine(s: float) -> str:
    """fmt_time, in nanoseconds below a microsecond (two processes with a core each synchronize
    in tens of ns, which fmt_time prints as 0.0us)."""
    return f"{s * 1e9:.0f}ns" if s < 1e-6 else fmt_time(s)


def syncfloor_path() -> str:
    """rumor-syncfloor: $RUMOR_SYNCFLOOR, else rumor/lib/rumor-syncfloor of the installed package
    (built with the extension, csrc/tools/sync_floor.cpp); found without importing rumor here."""
    env = os.environ.get("RUMOR_SYNCFLOOR")
    if env:
        return env
    spec = importlib.util.find_spec("rumor")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("rumor-syncfloor: the rumor package is not installed (or set RUMOR_SYNCFLOOR)")
    return os.path.join(list(spec.submodule_search_locations)[0], "lib", "rumor-syncfloor")


def sync_floor(P: int) -> Dict:
    """What one synchronization of P processes costs here with nothing else around it (rumor-
    syncfloor: each op every process adds one to a shared counter, the last wakes the sleepers
    with one futex wake-up), the lowest of its medians sleeping at once, spinning first and
    yielding first (SYNC_PROTOCOLS).
    Any small collective among P ranks needs at least that: every rank must run once after the
    last one arrived, and with more ranks than cores that means waking descheduled ones."""
    runs = []
    for spin, yld in SYNC_PROTOCOLS:
        out = subprocess.run([syncfloor_path(), "--procs", str(P), "--spin-us", str(spin), "--yield", str(yld),
                              "--samples", "10", "--batch", "1000", "--warmup", "1000"],
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"rumor-syncfloor --procs {P} --spin-us {spin} --yield {yld}: exit {out.returncode}: "
                               f"{out.stderr.strip()[-500:]}")
        d = json.loads(out.stdout)
        d["median_s"] = statistics.median(d["per_op_us"]) * 1e-6
        runs.append(d)
    best = min(runs, key=lambda d: d["median_s"])
    return dict(procs=P, median_s=best["median_s"], spin_us=best["spin_us"], yielded=best["yield"], runs=runs)


def core_handoff(probes: int = 12, gap_s: float = 0.25) -> Dict:
    """How fast two processes hand a cache line back and forth here right now: rumor-syncfloor
    with 2 processes spinning on one shared counter (no sleeping), one short batch per probe,
    probes gap_s apart. On a VM the hypervisor may run the two vCPUs on cores that share a cache
    or on cores that do not, and move them: this 2-vCPU EPYC VM read 0.04 us a handoff in one
    state and 0.2 us in the other, switching every second or so. Cells that stay in the caches
    (two ranks, up to a few MiB) follow that state, every library alike: their samples are
    bimodal, and a median compares whichever state each library's samples happened to fall in."""
    per_op = []
    for k in range(probes):
        if k:
            time.sleep(gap_s)
        out = subprocess.run([syncfloor_path(), "--procs", "2", "--spin-us", "100000", "--yield", "0",
                              "--samples", "1", "--batch", "20000", "--warmup", "1000"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"rumor-syncfloor --procs 2 (core handoff): exit {out.returncode}: "
                               f"{out.stderr.strip()[-500:]}")
        per_op.append(json.loads(out.stdout)["per_op_us"][0] * 1e-6)
    fast = min(per_op)
    return dict(per_op_s=per_op, fastest_s=fast, median_s=statistics.median(per_op),
                slow_probes=sum(1 for x in per_op if x > 2 * fast))


# ==== what the bound and rumor's designs move ========================================================

def bound_bytes(op: str, P: int, S: int) -> int:
    """Bytes a perfect implementation reads plus writes, all ranks together (module docstring)."""
    if op == "broadcast":  # the root's buffer read once, P-1 copies written
        return P * S
    return 2 * P * S if op == "allreduce" else (P + 1) * S


def rumor_moved(op: str, P: int, S: int, variant: str = "rumor") -> Tuple[int, int, str]:
    """(bytes touched, bytes to and from memory, design): what a rumor design reads plus writes,
    all ranks together. "Touched" counts every copy and reduction pass, staging included; "memory"
    leaves out staging that stays in the caches (the 1 MiB shm rings, the direct path's chunks),
    which is what the bound's copy rate limits. Through a shared-memory ring a send is a copy into
    the ring (S read, S written), a receive a copy out (2S) or a reduction out of it into the
    destination (2 reads, 1 write: 3S). variant "rumor_before" is allreduce as it ran before issue 44."""
    slots = variant == "rumor" and os.environ.get("RUMOR_HOST_DIRECT", "1") != "0"
    if slots and op == "allreduce" and S <= SMALL_SLOT:
        # Shared slots (csrc/comm/direct.h, HostSmall): each rank copies its buffer into its slot
        # (2S), then folds the P slots into its buffer in one pass (P reads, 1 write).
        t = P * (P + 3) * S
        return t, t, "shared slots, one wait"
    if slots and op == "reduce_scatter" and S <= SMALL_SLOT:
        # Shared slots: each rank copies its whole input into its slot (2S), then folds its block
        # of the P slots into its output (P reads of S/P, one write).
        t = 2 * P * S + (P + 1) * S
        return t, t, "shared slots, one wait"
    if slots and op == "allgather" and S // P <= SMALL_SLOT:
        # Shared slots (the limit is one block per slot): the own block copied into the output
        # (rumor.allgather, 2 S/P per rank) and into the slot (2 S/P), the P-1 others copied out
        # of their slots (2 S/P each).
        t = 2 * (P + 1) * S
        return t, t, "shared slots, one wait"
    if slots and op == "broadcast" and S <= SMALL_SLOT:
        # Shared slots: the root copies its buffer into its slot (2S), the P-1 others copy it out.
        t = 2 * P * S
        return t, t, "shared slots, one wait"
    if op == "allreduce" and S <= SMALL_ALLREDUCE:
        # Recursive doubling: per round each rank sends S (2S), receives into scratch (2S), then
        # reduces scratch into its buffer (3S); ranks beyond the largest power of two fold in
        # (send 2S, partner reduces 3S) and get the result back (2S + 2S). All of it in cache.
        p2 = 1 << (P.bit_length() - 1)
        rounds = int(math.log2(p2))
        t = 7 * S * p2 * rounds + 9 * S * (P - p2)
        return t, t, f"recursive doubling ({rounds} rounds)"
    # The direct path: from 3 ranks on (2 ranks from 16 MiB with huge pages), unless
    # RUMOR_HOST_DIRECT=0, and where the ranks share cores from 8 MiB only
    # (Communicator::use_direct, Options::host_direct_min_bytes, kTwoRankDirectMinBytes).
    shared_cores = P > len(os.sched_getaffinity(0))
    direct_min = int(os.environ.get("RUMOR_HOST_DIRECT_MIN_BYTES", 8 * MiB if shared_cores else 0))
    huge = os.environ.get("RUMOR_HUGE_PAGES", "1") != "0"
    direct = ((P > 2 or (huge and S >= 16 * MiB)) and S > SMALL_ALLREDUCE and S >= direct_min
              and os.environ.get("RUMOR_HOST_DIRECT", "1") != "0")
    if op == "allreduce" and variant == "rumor" and direct:
        # Direct (csrc/comm/direct.h): per chunk c the taker reads P-1 peers' chunks into its
        # cache (2c each), folds the P chunks into its own buffer in one pass ((P+1)c), writes the
        # result into the P-1 peers (2c each). From memory: every input read once and every
        # output written once.
        return (5 * P - 3) * S, 2 * P * S, "direct: chunks taken from a shared counter"
    # Two ranks from 1 MiB to 16 MiB: the rings or the direct path, each operation as rank 0
    # named it by its recent times of both (Communicator::two_rank_choice, PathChoice).
    chosen = (variant == "rumor" and op == "allreduce" and P == 2 and MiB <= S < 16 * MiB and S >= direct_min
              and os.environ.get("RUMOR_HOST_DIRECT", "1") != "0")
    if op == "allreduce":
        # Ring: P-1 reduce-scatter steps of S/P (send 2, reduce-receive 3) and P-1 allgather
        # steps (send 2, receive 2), on every rank; from memory: 3 and 2 of them (the ring's
        # side stays in cache). The figures are the ring's where rank 0 chooses.
        return 9 * (P - 1) * S, 5 * (P - 1) * S, "ring via shm rings" + (
            " or direct, as rank 0 timed them" if chosen else "")
    if op == "broadcast" and direct:
        # Direct (an allgather whose only block is the root's): per chunk the taker copies it
        # from the root into its own buffer (2c), then from its cache into the P-2 others (2c
        # each). From memory: the root's buffer read once, every copy written once.
        return 2 * (P - 1) * S, P * S, "direct: chunks taken from a shared counter"
    if op == "broadcast" and S >= 512 * KiB:
        # Scatter + ring allgather (Communicator::broadcast): the root sends P-1 blocks of S/P
        # through the rings (into 2, out 2), then P-1 ring steps of S/P on every rank (send 2,
        # receive 2); from memory the root's read, the scatter's write and the steps' 1 and 1.
        return 4 * (P - 1) * S // P + 4 * (P - 1) * S, 2 * (P - 1) * S // P + 2 * (P - 1) * S, \
            "scatter + ring allgather via shm rings"
    if op == "broadcast":
        # Binomial tree: each of the P-1 receivers gets S once through a ring (into 2, out 2).
        return 4 * (P - 1) * S, 2 * (P - 1) * S, "binomial tree via shm rings"
    if op == "reduce_scatter" and direct:
        # Direct: per chunk c of a block the taker reads P-1 peers' chunks into its cache (2c
        # each), folds the P chunks into scratch in one pass ((P+1)c) and writes the sum into the
        # block owner's output (2c). From memory: the bound.
        return (3 * P + 1) * S, P * S + S, "direct: chunks taken from a shared counter"
    if op == "allgather" and direct:
        # Direct: the taker of chunk c reads it once from where its owner holds it (the input
        # tensor) into its own output (2c), then from its cache into the P-1 other outputs, the
        # owner's included (2c each). From memory: every input read once and every output
        # written once, the bound.
        return 2 * P * S, (P + 1) * S, "direct: chunks taken from a shared counter"
    if op == "reduce_scatter":
        # Ring over two scratch blocks: each step copies the input block into scratch (2), sends
        # (2) and reduce-receives (3), S/P each, P-1 steps per rank; from memory: each input
        # block read once, the output written once.
        return 7 * (P - 1) * S, P * S + S, "ring via shm rings, scratch blocks"
    # allgather: the own block copied into the output (2 S/P per rank), then P-1 ring steps of
    # S/P (send 2, receive 2; from memory 1 and 1).
    return 2 * S + 4 * (P - 1) * S, 2 * P * S, "ring via shm rings"


# ==== inside a rank ==================================================================================

def _deepspeed_peer(n: int) -> Tuple[Optional[Callable], Dict]:
    """DeepSpeed's CPU allreduce set up as on a CPU host, or None and why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # Its shared-memory path is taken only when LOCAL_SIZE equals the world size.
    os.environ["LOCAL_SIZE"] = os.environ.get("LOCAL_WORLD_SIZE", str(n))
    try:
        import deepspeed
        import deepspeed.comm as dscomm
        from deepspeed.comm import comm as ds_state

        deepspeed.init_distributed(dist_backend="gloo")
        op = getattr(ds_state.cdb, "shm_comm_op", None)
        level = int(getattr(ds_state.cdb, "shm_vector_kernel_level", 0) or 0)
    except Exception as e:  # noqa: BLE001  (any failure means: no column, with the reason)
        return None, dict(available=False, why=f"deepspeed could not be set up: {type(e).__name__}: {e}")
    if op is None:
        return None, dict(available=False, why="deepspeed built no shared-memory comm op (ShareMemCommBuilder)")
    version = getattr(deepspeed, "__version__", "?")
    # What its inference_all_reduce checks before taking the shm kernel (comm/torch.py).
    need = {"float32": 1, "bfloat16": 2, "float16": 2}
    why = {d: f"deepspeed {version}: shm kernel level {level} < {lvl} needed for {d} "
              f"({'AVX512-BW' if lvl == 2 else 'AVX2'}); it falls back to gloo"
           for d, lvl in need.items() if level < lvl}

    def make(dtype: str):
        return None if dtype in why else (lambda t: dscomm.inference_all_reduce(t))

    return make, dict(available=True, version=version, kernel_level=level, unavailable=why)


def _body(cfg: Dict, rank: int, n: int) -> None:
    import rumor

    # "Before": what allreduce took on one host until issue 44, timed in the same run: recursive
    # doubling up to 64 KiB, the ring through the shared-memory rings above.
    def before(t):
        algo = "recursive_doubling" if t.numel() * t.element_size() <= SMALL_ALLREDUCE else "ring"
        return rumor.allreduce_(t, op=rumor.ReduceOp.SUM, algorithm=algo)

    peers = {"rumor_before": lambda dtype: before}
    if cfg.get("deepspeed"):
        make, status = _deepspeed_peer(n)
        if rank == 0:
            emit("deepspeed", status)
        if make is not None:
            peers["deepspeed"] = make
    coll._measure(cfg, rank, n, peers)


# ==== the driver =====================================================================================

class Job(coll.Job):
    def __init__(self, args, n, sizes, workdir, progress, base):
        super().__init__(args, n, args.ops, sizes, workdir, progress, base, script=os.path.abspath(__file__))
        self.deepspeed: Optional[Dict] = None

    def config(self) -> Dict:
        return dict(super().config(), dtypes=self.args.dtypes, deepspeed=not self.args.no_deepspeed)

    def on_message(self, kind: str, data) -> None:
        if kind == "deepspeed":
            self.deepspeed = data
        elif kind == "cell":
            self.progress.update(self.base + len(self.cells),
                                 f"{self.label}: {data['dtype']} {data['op']} {fmt_size(data['size'])} done")


def summarize(cell: Dict, C: float) -> None:
    op, P, S = cell["op"], cell["n"], cell["size"]
    cell["bound_bytes"] = bound_bytes(op, P, S)
    cell["bound_s"] = cell["bound_bytes"] / (2 * C)
    for v in ("rumor", "rumor_before"):
        if v in cell["variants"]:
            d = cell["variants"][v]
            d["touched_bytes"], d["memory_bytes"], d["design"] = rumor_moved(op, P, S, v)
    for d in cell["variants"].values():
        s = d["samples_s"]
        d["median_s"], d["min_s"], d["max_s"] = statistics.median(s), min(s), max(s)
        d["of_bound"] = cell["bound_s"] / d["median_s"]


def print_table(cells: List[Dict], ds_status: Optional[Dict]) -> None:
    c0 = cells[0]
    op, P, dtype = c0["op"], c0["n"], c0["dtype"]
    ds_why = None
    if op != "allreduce":
        ds_why = "allreduce only"
    elif not ds_status or not ds_status.get("available"):
        ds_why = (ds_status or {}).get("why", "not run (--no-deepspeed)")
    elif dtype in ds_status.get("unavailable", {}):
        ds_why = ds_status["unavailable"][dtype]
    print(f"\n{P} ranks, 1 host: {op} {dtype}   (time = median [min-max] of {len(c0['variants']['rumor']['samples_s'])}"
          f" samples; frac = bound/time; moved = rumor's bytes / bound's bytes)")
    before = "rumor_before" in c0["variants"]
    head = (f"{'size':>9} | {'bound':>8} | {'rumor time':>26} {'frac':>5} | "
            + (f"{'before':>13} {'frac':>5} | " if before else "")
            + f"{'gloo':>9} {'frac':>5} | {'deepspeed':>9} {'frac':>5} | {'r/gloo':>7} {'r/ds':>6} | "
            f"{'touched':>7} {'memory':>6} design" + (" [before: touched memory]" if before else ""))
    print(head)
    print("-" * len(head))
    for c in cells:
        v = c["variants"]
        r, g, d, b = v["rumor"], v.get("gloo"), v.get("deepspeed"), v.get("rumor_before")
        bad = lambda x: "" if x is None or x["correct"] else "!"
        rt = f"{fmt_time(r['median_s'])} [{fmt_time(r['min_s'])}-{fmt_time(r['max_s'])}]{bad(r)}"
        gt = f"{fmt_time(g['median_s'])}{bad(g)}" if g else "n/a"
        dt = f"{fmt_time(d['median_s'])}{bad(d)}" if d else "n/a"
        gf = f"{g['of_bound']:.2f}" if g else "-"
        df = f"{d['of_bound']:.2f}" if d else "-"
        rg = f"{g['median_s'] / r['median_s']:.2f}x" if g else "-"
        rd = f"{d['median_s'] / r['median_s']:.2f}x" if d else "-"
        bt = (f"{fmt_time(b['median_s']) + bad(b):>13} {b['of_bound']:>5.2f} | " if b else
              (f"{'-':>13} {'-':>5} | " if before else ""))
        x = lambda e, k: e[k] / c["bound_bytes"]
        print(f"{fmt_size(c['size']):>9} | {fmt_time(c['bound_s']):>8} | {rt:>26} {r['of_bound']:>5.2f} | {bt}"
              f"{gt:>9} {gf:>5} | {dt:>9} {df:>5} | {rg:>7} {rd:>6} | "
              f"{x(r, 'touched_bytes'):>7.2f} {x(r, 'memory_bytes'):>6.2f} {r['design']}"
              + (f" [{x(b, 'touched_bytes'):.2f} {x(b, 'memory_bytes'):.2f} {b['design']}]" if b else ""))
    if ds_why and op == "allreduce":
        print(f"  deepspeed n/a: {ds_why}")
    if any(not x["correct"] for c in cells for x in c["variants"].values()):
        print("  ! = result differed from the exact expected value (see JSON 'errors')")


def plot(path: str, cells: List[Dict], C: float) -> Optional[str]:
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    ops = [o for o in OPS if any(c["op"] == o for c in cells)]
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.5), squeeze=False)
    styles = {"rumor": "-", "rumor_before": ":", "gloo": "--", "deepspeed": "-."}
    for j, op in enumerate(ops):
        ax = axes[0][j]
        for (P, dtype) in sorted({(c["n"], c["dtype"]) for c in cells if c["op"] == op}):
            cs = sorted((c for c in cells if c["op"] == op and c["n"] == P and c["dtype"] == dtype),
                        key=lambda c: c["size"])
            for v in ("rumor", "rumor_before") + PEERS:
                pts = [(c["size"], c["variants"][v]["of_bound"]) for c in cs if v in c["variants"]]
                if pts:
                    ax.plot(*zip(*pts), styles[v], marker="o", ms=3, label=f"{v} {P} ranks {dtype}")
        ax.axhline(1.0, color="k", lw=1, ls=":", label="bound")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("bound / time")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"one host: fraction of the memory bound (all-core copy rate C = {C / 1e9:.2f} GB/s)")
    _common.save_figure(plt, fig, path)
    return None


def _remove_deepspeed_segments(since: float) -> None:
    """DeepSpeed's shared-memory allreduce leaves its segments in /dev/shm when its ranks exit
    (they are os._exit()ed here): removes this user's that the run made (not older ones, which
    another job of this user may still be using)."""
    for path in glob.glob("/dev/shm/deepspeed_allreduce_buffer*"):
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_ctime >= since - 1:
                os.unlink(path)
        except OSError:
            pass  # gone meanwhile, or not ours to remove


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="one-host collectives vs the memory bound (module docstring)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--sizes", default="4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,256MiB")
    ap.add_argument("--iters", type=int, default=10, help="measured samples per library (protocol: >= 10)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--target-ms", type=float, default=5.0)
    ap.add_argument("--max-reps", type=int, default=64)
    ap.add_argument("--copy-bytes", type=coll.parse_size, default=256 * MiB, help="buffer of the all-core copy rate")
    ap.add_argument("--no-deepspeed", action="store_true")
    _common.add_run_args(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return _common.worker_main(args.worker, coll._describe, _body)
    args.hosts = 0
    args.ops = [o for o in args.ops.split(",") if o]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if set(args.ops) - set(OPS) or set(args.dtypes) - set(DTYPES):
        ap.error(f"ops from {OPS}, dtypes from {DTYPES}")
    sizes = [coll.parse_size(s) for s in args.sizes.split(",")]
    worlds = [int(x) for x in args.ranks.split(",")]
    for P in worlds:
        for s in sizes:
            if s % (4 * P):
                ap.error(f"size {s} is not a multiple of 4*{P} bytes")
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first warm-up op is also the correctness check)")
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "host_collectives.json")
    png_path = os.path.join(args.out, "host_collectives.png")
    meta = _common.run_meta(args)
    meta.update(sizes=sizes, worlds=worlds, bound="(bytes read + bytes written) / (2 C), see bound_bytes()",
                size_meaning="allreduce: buffer; allgather: gathered output; reduce_scatter: input")
    result = dict(meta=meta, cells=[], jobs=[], targets=[], errors=[], copy_rate=[])
    print(f"rumor {meta['rumor']} vs gloo and deepspeed | {meta['hostname']}, {meta['cpus']} cpus, load "
          f"{meta['loadavg_start'][0]:.2f} | {','.join(args.ops)} | {','.join(args.dtypes)} | sizes "
          f"{fmt_size(sizes[0])}..{fmt_size(sizes[-1])} ({len(sizes)}) | iters {args.iters}")
    per_job = len(args.ops) * len(sizes) * len(args.dtypes)
    progress = Progress(len(worlds) * per_job)
    drv = _common.Driver("rumor-hostbench-", progress, False)
    threads = os.cpu_count() or 1

    small = 4 * KiB in sizes and "allreduce" in args.ops and "float32" in args.dtypes
    result["sync_floor"] = {P: [] for P in worlds} if small else {}

    def floors() -> None:
        for P in result["sync_floor"]:
            result["sync_floor"][P].append(sync_floor(P))
        if 2 in worlds and threads >= 2:
            result.setdefault("core_handoff", []).append(core_handoff())

    def body() -> int:
        floors()  # before the jobs, and again after them: the machine's load drifts
        result["copy_rate"].append(coll.measure_memcpy(args.copy_bytes, 10, threads))
        one = coll.measure_memcpy(64 * MiB, 10, 1)
        jobs = [Job(args, P, sizes, drv.workdir, progress, k * per_job) for k, P in enumerate(worlds)]
        started = time.time()
        try:
            rc = _common.run_jobs(jobs, result, progress)
        finally:
            _remove_deepspeed_segments(started)
        result["copy_rate"].append(coll.measure_memcpy(args.copy_bytes, 10, threads))
        floors()
        progress.clear()
        # The fastest copy rate the run saw: on a shared machine a measurement can only come out
        # too low, and a bound that is too low would flatter every implementation.
        C = max([m["bw"] for m in result["copy_rate"]] + [one["bw"]])
        result["C"], result["memcpy_1thread"] = C, one
        result["deepspeed"] = {j.n: j.deepspeed for j in jobs}
        for c in result["cells"]:
            summarize(c, C)
        _common.finish_meta(meta)
        rates = " / ".join(f"{m['bw'] / 1e9:.2f}" for m in result["copy_rate"])
        print(f"\nall-core copy rate C (torch copy_, {threads} threads, {fmt_size(args.copy_bytes)}): {rates} GB/s "
              f"(start / end); 1 thread, 64 MiB: {one['bw'] / 1e9:.2f} GB/s; C = the fastest of these = {C / 1e9:.2f} GB/s")
        for job in jobs:
            for dtype in args.dtypes:
                for op in args.ops:
                    cs = sorted((c for c in job.cells if c["op"] == op and c["dtype"] == dtype),
                                key=lambda c: c["size"])
                    if cs:
                        print_table(cs, job.deepspeed)
        print()
        headline = None
        for P, want in ((2, 0.6), (4, 0.5)):
            c = next((c for c in result["cells"] if c["op"] == "allreduce" and c["n"] == P
                      and c["dtype"] == "float32" and c["size"] == 64 * MiB), None)
            if c is None:
                continue
            f = c["variants"]["rumor"]["of_bound"]
            t = dict(name=f"allreduce 64 MiB float32 {P} ranks: rumor >= {want} of the bound", value=f, met=f >= want)
            result["targets"].append(t)
            print(f"target: {t['name']}: {f:.2f} -> {'MET' if t['met'] else 'NOT MET'}")
            headline = (headline + "; " if headline else "headline: allreduce 64 MiB float32 rumor/bound = ") + \
                f"{f:.2f} ({P} ranks)"
        for P, fl in result["sync_floor"].items():
            print(f"sync floor, {P} processes that only synchronize (rumor-syncfloor, one futex wake-up per op, "
                  "the best of sleeping at once, spinning 50 us or yielding first): " +
                  " / ".join(f"{fmt_fine(f['median_s'])}" for f in fl) + " (start / end)")
        for P, limit in ((2, 10e-6), (4, 50e-6)):
            c = next((c for c in result["cells"] if c["op"] == "allreduce" and c["n"] == P
                      and c["dtype"] == "float32" and c["size"] == 4 * KiB), None)
            if c is not None:
                r_t = c["variants"]["rumor"]["median_s"]
                t = dict(name=f"allreduce 4 KiB float32 {P} ranks <= {fmt_time(limit)}", value=r_t, met=r_t <= limit)
                fl = result["sync_floor"].get(P)
                floor_note = ""
                if fl:
                    # The lower of the two: a floor measured while the machine was busier is too high.
                    t["sync_floor_s"] = f = min(x["median_s"] for x in fl)
                    floor_note = (f" (sync floor in this run {fmt_fine(f)}: rumor = floor + {fmt_time(r_t - f)}"
                                  f"{'; the target is below the floor' if f > limit else ''})")
                result["targets"].append(t)
                print(f"target: {t['name']}: {fmt_time(r_t)} -> {'MET' if t['met'] else 'NOT MET'}{floor_note}")
        if result.get("core_handoff"):
            print("core handoff (2 processes spinning on one shared counter, rumor-syncfloor; probes 0.25 s apart, "
                  "start / end): " + " / ".join(
                      f"fastest {h['fastest_s'] * 1e9:.0f} ns, median {h['median_s'] * 1e9:.0f} ns, "
                      f"{h['slow_probes']} of {len(h['per_op_s'])} probes above twice the fastest"
                      for h in result["core_handoff"]) +
                  "; where probes differ several-fold, the vCPUs moved between cores that share a cache and "
                  "cores that do not, and the in-cache cells of 2 ranks are bimodal with them (core_handoff())")
        slow_ds = [c for c in result["cells"] if c["size"] >= MiB and "deepspeed" in c["variants"]
                   and c["variants"]["deepspeed"]["median_s"] / c["variants"]["rumor"]["median_s"] < 1.2]
        if any("deepspeed" in c["variants"] for c in result["cells"]):
            where = ", ".join(f"{c['n']} ranks {c['dtype']} {fmt_size(c['size'])}" for c in slow_ds)
            print("target: allreduce >= 1.2x deepspeed at every size >= 1 MiB: " +
                  ("MET" if not slow_ds else "NOT MET in " + where))
            for c in slow_ds:
                # The libraries' samples alternate, so the two of one index are taken about a
                # second apart at most: more often in one core handoff state than two medians.
                pairs = [d / r for r, d in zip(c["variants"]["rumor"]["samples_s"],
                                               c["variants"]["deepspeed"]["samples_s"])]
                c["paired_ds_ratio"] = statistics.median(pairs)
                print(f"  {c['n']} ranks {c['dtype']} {fmt_size(c['size'])}: deepspeed / rumor per sample pair "
                      f"(the same index, taken one after the other): median {c['paired_ds_ratio']:.2f}x, "
                      f"range {min(pairs):.2f}x-{max(pairs):.2f}x")
        wrong = [(c["op"], c["n"], c["dtype"], c["size"], v) for c in result["cells"]
                 for v, d in c["variants"].items() if not d["correct"]]
        if wrong:
            print("WRONG RESULTS: " + ", ".join(f"{v} {o} n={n} {dt} {fmt_size(s)}" for o, n, dt, s, v in wrong))
            rc = rc or 1
        draw = None if args.no_plot else (lambda: plot(png_path, result["cells"], C))
        _common.write_results(result, headline, "headline: n/a (no 64 MiB float32 allreduce in this run)",
                              json_path, png_path, draw)
        return rc

    return drv.run(body)


if __name__ == "__main__":
    sys.exit(main())
