#!/usr/bin/env python
"""Advisor benchmark: rumor.advise's predicted step per algorithm vs the measured one, on emulated
hosts at several link rates, or on this host alone (docs/advisor.md), per BENCHMARKS.md. Emulated
hosts need root (namespaces).

For each --rates entry (default 1gbit and 100mbit) it builds --hosts emulated hosts (network
namespaces on one bridge, tbf on each host's link, rumor.testing.netns; removed afterwards, also
on Ctrl-C) with --ranks-per-host ranks each, and per model (rumor.testing.models):

  1. every rank calls rumor.advise(model, SGD(momentum 0.9), its batch): the table of predicted
     steps (the link-bound model of benchmarks/training.py, fed by what the advisor measured);
  2. every algorithm of that table (built from its row by rumor.advisor.build_algorithm, with
     PowerSGD compressing from the first measured step) and torch DDP (gloo) are trained in
     --rounds visits each, the order rotated every round so that the machine's slow and fast
     minutes fall on all of them (this VM's compute step moved by a third between the blocks
     of one run when each algorithm ran once, in one block). A visit builds its wrapper afresh
     and trains --warmup steps, then ceil(--iters / --rounds) measured ones: zero_grad,
     forward, cross-entropy, backward, step, after a gloo barrier. A step's time is its
     slowest rank's, from the barrier's return to the end of step(), as in
     benchmarks/training.py, plus that barrier's own time on the last rank to reach it (so a
     step's communication still running after step(), as LowPrecisionDecentralized's
     exchange, counts where it delays the barrier: its messages
     queue behind that traffic on a shaped link). Timing from the barrier's start instead would
     count the spread of the step before twice, once in its slowest rank and again in the
     others' wait. The measured step is the median of those, or for the periodic algorithms
     (LocalSGD, DiLoCo, Streaming DiLoCo) its mean over whole rounds (each visit's steps rounded
     up to a multiple of the round: 8 or 32 steps), so that every round's averaging is counted.
     AsyncModelAverage and the periodic algorithms run without the barrier (training itself
     has none): AsyncModelAverage's and StreamingDiLoCo's averaging runs in the background
     across steps, where the barrier's messages would wait behind its traffic on the shaped
     link, and the local steps of LocalSGD and DiLoCo synchronize nothing, where a barrier
     would add each step's spread between the ranks; their step is the slowest rank's mean
     (over whole rounds).
     After each measured step, every rank also takes one step of a plain copy of the model,
     timed apart: the compute-only step under the load of that moment (for the algorithms
     whose traffic runs into the next step, --ref-iters plain steps before each visit instead).

With --hosts 0 the ranks (one job per --ranks entry) run on this host alone, over shared memory
and loopback, with no namespace and no shaping: one cell per (world size, model).

Checks printed per (rate, model), from one run: the advisor's top-ranked algorithm measures
within 10% of the fastest measured one (target), and every algorithm's predicted step is within
15% of its measured one (target); both also load-adjusted, with each block's compute-only step
swapped for the advisor's compute (this VM's compute step varies by a third between blocks). 1-bit Adam is left out (it needs its own optimizer, whose
compute the SGD measurement does not cover).

  sudo python benchmarks/advise.py                                   # 4 hosts, 1gbit and 100mbit, all models
  python benchmarks/advise.py --hosts 0 --ranks 4                    # one host, 4 ranks
  sudo python benchmarks/advise.py --models transformer --iters 3 --warmup 1 --batch transformer=4   # smoke
Output: tables, JSON and PNG in --out (benchmarks/results/advise-<hosts>hosts.json/png), headline last.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import _common
from _common import Progress, emit, parse_rate

MODELS = ("mlp25m", "cnn", "transformer")
# 1-bit Adam needs its own optimizer, whose compute the SGD measurement does not cover.
SKIP = ("1-bit Adam",)
TOP_WITHIN = 1.10
ASYNC_ROUNDS = 3  # whole averaging rounds a visit of AsyncModelAverage measures
STEADY_CAP = 12  # a steady-state phase (waiting for the first round, measuring rounds) ends after this many times --iters
PRED_WITHIN = 0.15


def _describe(rank: int, n: int) -> Dict:
    import rumor

    return dict(rank=rank, size=n, local_size=rumor.local_size(), machine_size=rumor.machine_size(),
                netns=os.readlink("/proc/self/ns/net"))


def _build(row: Dict, cfg: Dict):
    """The row's algorithm, with its warm-up shortened to the benchmark's: PowerSGD compresses
    from the first measured step on."""
    from rumor.advisor import build_algorithm

    if row["ctor"]["cls"] == "PowerSGD":
        row = dict(row, ctor=dict(cls="PowerSGD", kwargs=dict(row["ctor"]["kwargs"], start_powerSGD_iter=cfg["warmup"])))
    return build_algorithm(row)


def _background(row: Dict) -> bool:
    """Whether the row's algorithm averages in the background across steps."""
    return row["kind"] == "async" or row["ctor"]["cls"] == "StreamingDiLoCo"


def _unbarriered(row: Optional[Dict]) -> bool:
    """Whether the row's algorithm is timed without the per-step barrier, the slowest rank's
    mean step: the background averages, and the periodic algorithms, whose local steps
    synchronize nothing (a barrier there adds every step's spread between ranks, which the
    round's average absorbs once in training: measured on mlp25m at 1 Gbit, LocalSGD's local
    steps 460 ms against a 316 ms compute-only step with the barrier)."""
    return row is not None and (_background(row) or row["period"] > 1 or row["kind"] == "decentralized")


def _spans_steps(row: Optional[Dict]) -> bool:
    """Whether the row's communication runs on past optimizer.step() into the next step: the
    background averages, and LowPrecisionDecentralized's exchange (started after the step,
    waited for after the next backward)."""
    return row is not None and (_background(row) or row["ctor"]["cls"] == "LowPrecisionDecentralized")


def _timed_steps(model, opt, data, warmup: int, steps: int, barrier: bool = True, plain=None,
                 begin: Optional[Callable[[], bool]] = None, end: Optional[Callable[[], bool]] = None):
    """Seconds of each step after the first `warmup`. With the barrier: from the barrier's return
    to the end of optimizer.step(), and the barrier's own time as a second list (the caller
    takes each step's slowest rank plus the shortest barrier, the one the last rank to arrive
    waited: the barrier's latency and any traffic it queued behind, without the spread of the
    step before, which that step's slowest rank already counted). ``barrier=False``
    (asynchronous algorithms): no barrier, the ranks run at their own pace and a step is timed
    from the end of the one before. Returns dict(step=..., barrier=..., plain=..., cpu=...,
    beside=...): cpu and beside, each measured step's CPU seconds on the training thread and on
    the process's other threads.

    plain: (model, optimizer) of the unwrapped model; after each measured step it takes one step
    of its own, timed apart: the compute-only step under the load of that moment ("plain").
    Only for algorithms whose communication has ended when step() returns.

    begin / end (a background average, no barrier): after the warm-up, measuring starts with the
    first step at whose start begin() holds, and goes on past `steps` until end() holds, each
    phase at most STEADY_CAP times `steps` steps."""
    import torch.distributed as dist

    from rumor.testing import models

    out, bar, ref, cpu, beside = [], [], [], [], []
    cap = STEADY_CAP * max(1, steps)
    t = time.perf_counter()
    i = 0
    measuring = False
    while True:
        if not measuring and i >= warmup and (begin is None or i >= warmup + cap or begin()):
            measuring = True
        if measuring and len(out) >= steps and (end is None or len(out) >= cap or end()):
            break
        x, y = data[i % len(data)]
        i += 1
        if barrier:
            t = time.perf_counter()
            dist.barrier()
            b = time.perf_counter()
            if measuring:
                bar.append(b - t)
            t = b
        c0, o0 = time.thread_time(), _cpu_beside_main()
        opt.zero_grad()
        models.loss(model(x), y).backward()
        opt.step()
        if measuring:
            out.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c0)
            beside.append(_cpu_beside_main() - o0)
            if plain is not None:
                t = time.perf_counter()
                plain[1].zero_grad()
                models.loss(plain[0](x), y).backward()
                plain[1].step()
                ref.append(time.perf_counter() - t)
        t = time.perf_counter()
    return dict(step=out, barrier=bar, plain=ref, cpu=cpu, beside=beside)


def _train(cfg: Dict, rank: int, n: int) -> None:
    for name in cfg["models"]:
        _run_model(cfg, name, rank, n)


def _cpu_beside_main() -> float:
    """CPU seconds this process spent on threads other than the calling one (the background
    averaging, the communicator's threads and the socket work charged to them)."""
    t = os.times()
    return t.user + t.system - time.thread_time()


def _visit(cfg: Dict, name: str, row: Optional[Dict], data, times: Dict, ref: Dict, bars: Dict, iters: int,
           extras: Dict, cpu: Dict) -> None:
    """One visit of an algorithm (row None: torch DDP): a fresh model, optimizer and wrapper,
    --warmup steps, then `iters` measured steps (whole rounds for the periodic algorithms),
    appended to times / ref / bars under its name, each step's CPU on the training thread and
    beside it to cpu[name + " main"] / cpu[name + " beside"]; AsyncModelAverage's own counts
    (rounds, busy and CPU seconds, measured steps and seconds) to extras."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import rumor
    from rumor.testing import models

    alg = "torch DDP" if row is None else row["algorithm"]
    model = models.build(name, seed=cfg["seed"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    # The compute-only step (the plain model, no communication): the bound, and the
    # yardstick for the load of a shared machine. Taken after each measured step, so that
    # it sees the load of that moment, where the algorithm's traffic has ended when step()
    # returns; else (traffic running into the next step would slow the yardstick and hide
    # under it) --ref-iters steps right before the visit.
    interleave = not _spans_steps(row)
    plain = None
    if interleave:
        twin = models.build(name, seed=cfg["seed"])
        plain = (twin, torch.optim.SGD(twin.parameters(), lr=cfg["lr"], momentum=0.9))
        del twin
    else:
        ref.setdefault(alg, []).extend(_timed_steps(model, opt, data, 0, cfg["ref_iters"])["step"])
    algo = None
    if row is None:
        wrapped = TorchDDP(model)
    else:
        algo = _build(row, cfg)
        wrapped = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=algo)
    # Periodic algorithms are measured over whole rounds (every round's averaging counted).
    period = row["period"] if row is not None else 1
    measured = iters if period == 1 else period * -(-iters // period)
    # The background averaging in its steady state, as a long run sees it: from the end of the
    # thread's first round (before it, the thread waits its interval and the first round's
    # start-up) over ASYNC_ROUNDS whole rounds. A visit of a fixed step count does not: at
    # 1 Gbit mlp25m's rounds took 2.4 s, an 8-step visit 2.8 s, and the thread was idle for
    # 40% of it (2 rounds in 24 steps).
    begin = end = None
    window = {}
    if row is not None and row["kind"] == "async":
        def begin():
            if algo.rounds < 1:
                return False
            window.update(rounds=algo.rounds, busy_s=algo.busy_s, cpu_s=_cpu_beside_main())
            return True

        def end():
            return algo.rounds >= window["rounds"] + ASYNC_ROUNDS
    # Algorithms that average in the background across steps run without the per-step
    # barrier: on a shaped link the barrier's messages queue behind that traffic (measured
    # at 100 Mbit, cnn: +55 ms a step for AsyncModelAverage with the barrier, +15 ms
    # without; a plain step: +10 ms; 1 Gbit, mlp25m: StreamingDiLoCo 50-75 ms a step over
    # its compute-only step with the barrier, 15-45 ms in a loop without one).
    asynchronous = _unbarriered(row)
    if asynchronous:
        dist.barrier()
    got = _timed_steps(wrapped, opt, data, cfg["warmup"], measured, barrier=not asynchronous, plain=plain,
                       begin=begin, end=end)
    times.setdefault(alg, []).extend(got["step"])
    cpu.setdefault(alg + " main", []).extend(got["cpu"])
    cpu.setdefault(alg + " beside", []).extend(got["beside"])
    if not asynchronous:
        bars.setdefault(alg, []).extend(got["barrier"])
    if interleave:
        ref.setdefault(alg, []).extend(got["plain"])
    if hasattr(algo, "finish"):  # AsyncModelAverage: every rank ends its averaging
        # what the model's round_cpu and rounds per step stand for, before finish() adds its own
        extras.setdefault(alg, []).append(dict(rounds=algo.rounds - window.get("rounds", 0),
                                               busy_s=algo.busy_s - window.get("busy_s", 0.0),
                                               cpu_s=_cpu_beside_main() - window.get("cpu_s", 0.0),
                                               measured_s=sum(got["step"]), measured_steps=len(got["step"])))
        algo.finish()
    if asynchronous:
        dist.barrier()  # the next visit starts together
    if dist.get_rank() == 0:
        emit("progress", {"model": name, "what": f"{alg}: {statistics.median(got['step']) * 1e3:.0f} ms/step"})
    del wrapped, opt, model, algo, plain
    gc.collect()


def _compute_of(mi: Dict) -> float:
    """The advisor's compute step: forward + backward + optimizer."""
    return mi["forward_s"] + mi["backward_s"] + mi["optimizer_s"]


def _run_model(cfg: Dict, name: str, rank: int, n: int) -> None:
    import gc

    import torch

    import rumor
    from rumor.testing import models

    batch = cfg["batch"].get(name) or models.BATCH[name]
    data = [models.batch(name, batch, step=i, shard=rank, seed=cfg["seed"]) for i in range(4)]

    def advise():
        model = models.build(name, seed=cfg["seed"])
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        t0 = time.perf_counter()
        got = rumor.advise(model, opt, data[0], steps=cfg["advise_steps"], print_table=False)
        took = time.perf_counter() - t0
        if rank == 0:
            emit("progress", {"model": name, "what": f"advised in {took:.1f} s: {got.best['algorithm']} first"})
        del model, opt
        gc.collect()
        return got, took

    # The advisor measures the compute of its own few seconds; the visits sample the machine
    # over every round. With --advise-each-round it is asked again at the start of every round
    # (its measurements then fall on the same minutes as the visits'), and the cell compares
    # the mean of its predictions; the first advice's are kept beside them.
    advice, advise_s = advise()
    advices = [advice]
    times: Dict[str, List[float]] = {}
    ref: Dict[str, List[float]] = {}
    bars: Dict[str, List[float]] = {}  # each step's barrier, per barriered algorithm
    rows = [r for r in advice.rows if r["algorithm"] not in SKIP and (not cfg.get("only") or r["algorithm"] in cfg["only"])]
    rows.append(None)  # torch DDP
    # Every algorithm is visited --rounds times, the order rotated each round, so that the
    # machine's slow and fast minutes fall on all of them alike (BENCHMARKS.md: alternating);
    # a visit builds its wrapper afresh, warms up and measures its share of the steps.
    rounds = cfg["rounds"]
    extras: Dict[str, List[Dict]] = {}
    cpu: Dict[str, List[float]] = {}
    for r in range(rounds):
        if r > 0 and cfg["advise_each_round"]:
            advices.append(advise()[0])
        k = r % len(rows)
        for row in rows[k:] + rows[:k]:
            _visit(cfg, name, row, data, times, ref, bars, -(-cfg["iters"] // rounds), extras, cpu)
        if rank == 0:
            emit("progress", {"model": name, "what": f"round {r + 1} of {rounds} done"})
    per_rank = _common.gather_samples(times)
    per_rank_ref = _common.gather_samples(ref)
    per_rank_bar = _common.gather_samples(bars)
    per_rank_cpu = _common.gather_samples(cpu)
    if rank == 0:
        from rumor.advisor import rank_rows

        each = [{r["algorithm"]: r["predicted_step_s"] for r in a.rows} for a in advices]
        mean_rows = rank_rows([dict(r, predicted_step_s=statistics.fmean(e[r["algorithm"]] for e in each))
                               for r in advice.rows])
        cell = dict(model=name, n=n, batch=batch, advise_s=advise_s, measured_inputs=advice.measured,
                    predicted={r["algorithm"]: r["predicted_step_s"] for r in mean_rows},
                    predicted_torch=statistics.fmean(a.torch["predicted_step_s"] for a in advices),
                    ranking=[r["algorithm"] for r in mean_rows], advices=len(advices),
                    predicted_first=each[0], ranking_first=[r["algorithm"] for r in advice.rows],
                    predicted_each=each, advised_compute_s=[_compute_of(a.measured) for a in advices],
                    advised_free_s=[a.measured["free_step_s"] for a in advices],
                    kinds={r["algorithm"]: r["kind"] for r in advice.rows},
                    background=extras, measured={})
        periods = {r["algorithm"]: r["period"] for r in advice.rows}
        unsync = {r["algorithm"] for r in advice.rows if _unbarriered(r)}
        spanning = {r["algorithm"] for r in advice.rows if _spans_steps(r)}
        for alg in times:
            # A step starts together on every rank (the barrier's return) and ends with its
            # slowest rank; the barrier itself costs what the last rank to reach it waited.
            # (Unbarriered ranks may measure different numbers of steps: a background average's
            # visit ends with its thread's rounds.)
            steps = [max(per_rank[alg][r][i] for r in range(n))
                     + (min(per_rank_bar[alg][r][i] for r in range(n)) if alg in bars else 0.0)
                     for i in range(min(len(per_rank[alg][r]) for r in range(n)))]
            # per-step algorithms: the median step; periodic ones: the mean over whole rounds
            per = periods.get(alg, 1)
            comp = [max(per_rank_ref[alg][r][i] for r in range(n)) for i in range(len(ref[alg]))]
            if alg in unsync:  # unsynchronized ranks: the slowest rank's mean step
                measure = max(statistics.fmean(per_rank[alg][r]) for r in range(n))
            else:
                measure = statistics.median(steps) if per == 1 else statistics.fmean(steps)
            cell["measured"][alg] = dict(step_s=steps, period=per, median_s=statistics.median(steps),
                                         step_measure_s=measure,
                                         compute_only_s=statistics.median(comp) if comp else None,
                                         compute_only_interleaved=alg not in spanning,
                                         cpu_main_s=statistics.median(x for r in per_rank_cpu[alg + " main"] for x in r),
                                         cpu_beside_s=statistics.median(
                                             x for r in per_rank_cpu[alg + " beside"] for x in r))
        emit("cell", cell)
    gc.collect()


class Job(_common.Job):
    def __init__(self, *a, rate: str, **kw):
        super().__init__(*a, **kw)
        self.rate = rate

    @property
    def label(self) -> str:
        if self.cluster is None:
            return f"{self.n} ranks, 1 host"
        return f"{self.hosts} emulated hosts x {self.rph} rank(s), tbf {self.rate}"

    def config(self) -> Dict:
        a = self.args
        return dict(models=a.models, batch=a.batch_map, iters=a.iters, warmup=a.warmup, lr=a.lr, seed=a.seed,
                    only=[x.strip() for x in a.only.split(",") if x.strip()],
                    advise_steps=a.advise_steps, ref_iters=a.ref_iters, rounds=a.rounds,
                    advise_each_round=not a.advise_once)

    def on_message(self, kind: str, data) -> None:
        if kind == "progress":
            self.progress.update(None, f"{self.label}: {data['model']} {data['what']}", force=True)
        elif kind == "cell":
            data["rate"] = self.rate
            self.progress.update(self.progress.done + 1, f"{self.label}: {data['model']} done", force=True)


def summarize(cell: Dict) -> None:
    from rumor.advisor import UNSYNCHRONIZED_STEPS

    meas = {k: v["step_measure_s"] for k, v in cell["measured"].items() if k != "torch DDP"}
    fastest = min(meas, key=meas.get)
    top = next(a for a in cell["ranking"] if a in meas)
    cell["fastest_measured"] = fastest
    cell["top_predicted"] = top
    cell["top_over_fastest"] = meas[top] / meas[fastest]
    cell["pred_error"] = {a: cell["predicted"][a] / meas[a] - 1 for a in meas}
    cell["pred_error"]["torch DDP"] = cell["predicted_torch"] / cell["measured"]["torch DDP"]["step_measure_s"] - 1
    # The same comparison with each block's compute swapped for the advisor's: the measured step
    # minus the block's compute-only step (taken between its steps, or right before each visit
    # where the algorithm's traffic runs into the next step) plus the advisor's compute. On a
    # shared machine whose load changes, that compares what the model adds to compute with
    # what the block really added, apart from the load of the moment.
    # (The periodic and asynchronous rows' compute is the advisor's mean step of the ranks.)
    pred_compute = statistics.fmean(cell.get("advised_compute_s") or [_compute_of(cell["measured_inputs"])])
    pred_free = statistics.fmean(cell.get("advised_free_s") or [pred_compute])
    cell["pred_error_load_adjusted"] = {}
    adjusted = {}
    for a, v in cell["measured"].items():
        if v.get("compute_only_s"):
            pred = cell["predicted_torch"] if a == "torch DDP" else cell["predicted"][a]
            own = pred_free if cell.get("kinds", {}).get(a) in UNSYNCHRONIZED_STEPS else pred_compute
            adjusted[a] = max(v["step_measure_s"] - v["compute_only_s"], 0.0) + own
            cell["pred_error_load_adjusted"][a] = pred / adjusted[a] - 1
    # ... and the top pick against the fastest on those load-adjusted steps.
    adj = {a: t for a, t in adjusted.items() if a in meas}
    if top in adj:
        fastest_adj = min(adj, key=adj.get)
        cell["fastest_load_adjusted"] = fastest_adj
        cell["top_over_fastest_load_adjusted"] = adj[top] / adj[fastest_adj]
    # The first advice alone (what one call of the advisor gives), where it was asked again.
    if cell.get("advices", 1) > 1:
        first = cell["predicted_first"]
        top1 = next(a for a in cell["ranking_first"] if a in meas)
        cell["top_first"] = top1
        cell["top_over_fastest_first"] = meas[top1] / meas[fastest]
        cell["pred_error_first"] = {a: first[a] / meas[a] - 1 for a in meas}


def print_table(cells: List[Dict], title: str) -> None:
    for c in cells:
        links = {k: c["measured_inputs"][k] for k in ("inter", "intra") if c["measured_inputs"].get(k)}
        print(f"\n{title}: {c['model']} (batch {c['batch']} x {c['n']}; advisor took {c['advise_s']:.1f} s; "
              + "; ".join(f"link {'between hosts' if k == 'inter' else 'inside a host'} measured "
                          f"{v['bandwidth_Bps'] / 1e6:.1f} MB/s, {v['latency_s'] * 1e6:.0f} us" for k, v in links.items())
              + ")")
        each = c.get("advised_compute_s") or [_compute_of(c["measured_inputs"])]
        print(f"compute (forward + backward + optimizer) as the advisor measured it: "
              + ", ".join(f"{t * 1e3:.1f}" for t in each) + " ms"
              + (f" ({len(each)} advices, one per round: predictions are their mean)" if len(each) > 1 else ""))
        if c.get("advised_free_s"):
            print("the ranks' mean compute step (the local step of the periodic and asynchronous rows): "
                  + ", ".join(f"{t * 1e3:.1f}" for t in c["advised_free_s"]) + " ms")
        head = (f"{'rank':>4} {'algorithm':<28} {'predicted ms':>12} {'measured ms':>11} {'pred/meas':>9} "
                f"{'compute-only ms':>15} {'load-adj.':>9} {'CPU ms main/beside':>18}")
        print(head)
        print("-" * len(head))
        for i, a in enumerate([a for a in c["ranking"] if a in c["measured"]] + ["torch DDP"]):
            pred = c["predicted"].get(a, c["predicted_torch"] if a == "torch DDP" else None)
            m = c["measured"][a]["step_measure_s"]
            co = c["measured"][a].get("compute_only_s")
            adj = c.get("pred_error_load_adjusted", {}).get(a)
            # * : the compute-only step was taken before each visit, not between its steps
            before = "*" if co and not c["measured"][a].get("compute_only_interleaved", False) else " "
            print(f"{(i + 1) if a != 'torch DDP' else '-':>4} {a:<28} {pred * 1e3:>12.1f} {m * 1e3:>11.1f} "
                  f"{pred / m:>8.2f}x {co * 1e3 if co else float('nan'):>14.1f}{before} "
                  f"{(1 + adj) if adj is not None else float('nan'):>8.2f}x "
                  + (f"{c['measured'][a]['cpu_main_s'] * 1e3:>10.0f} / {c['measured'][a]['cpu_beside_s'] * 1e3:<5.0f}"
                     if "cpu_main_s" in c["measured"][a] else ""))
        print("compute-only ms: the plain model's step taken after each measured step (* before each visit: "
              "the algorithm's traffic runs into the next step); load-adj.: predicted over "
              "(measured - compute-only + the advisor's compute); CPU: a measured step's CPU time on the "
              "training thread and on the process's other threads (median over ranks and steps)")
        print(f"top-ranked {c['top_predicted']} measures {c['top_over_fastest']:.2f}x the fastest measured "
              f"({c['fastest_measured']})")
        if "pred_error_first" in c:
            e1 = c["pred_error_first"]
            w1 = max(e1, key=lambda a: abs(e1[a]))
            print(f"the first advice alone: top-ranked {c['top_first']} {c['top_over_fastest_first']:.2f}x the fastest; "
                  f"worst prediction {w1} {100 * e1[w1]:+.0f}%, median |error| "
                  f"{100 * statistics.median(abs(e) for e in e1.values()):.0f}%")
        for alg, visits in (c.get("background") or {}).items():
            # rank 0's own counts: rounds it took, its thread's busy seconds, over the measured steps
            steps = sum(v["measured_steps"] for v in visits)
            rounds = sum(v["rounds"] for v in visits)
            busy = sum(v["busy_s"] for v in visits)
            wall = sum(v["measured_s"] for v in visits)
            cpu = sum(v.get("cpu_s", 0.0) for v in visits)
            print(f"{alg} (rank 0, measured steps): {rounds} rounds in {steps} steps "
                  f"({wall:.1f} s); background thread busy {busy:.1f} s, CPU beside the training thread {cpu:.1f} s"
                  + (f"; a round: {busy / rounds * 1e3:.0f} ms, {cpu / rounds * 1e3:.0f} ms CPU" if rounds else ""))


def plot(path: str, cells: List[Dict]) -> Optional[str]:
    plt = _common.pyplot()
    if plt is None:
        return _common.NO_MATPLOTLIB
    fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 4.2), squeeze=False)
    for ax, c in zip(axes[0], cells):
        algs = [a for a in c["ranking"] if a in c["measured"]] + ["torch DDP"]
        pred = [c["predicted"].get(a, c["predicted_torch"]) * 1e3 for a in algs]
        meas = [c["measured"][a]["step_measure_s"] * 1e3 for a in algs]
        xs = range(len(algs))
        ax.bar([x - 0.2 for x in xs], pred, 0.4, label="predicted", color="#9ecae1")
        ax.bar([x + 0.2 for x in xs], meas, 0.4, label="measured", color="#3182bd")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(algs, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("step (ms, slowest rank)")
        ax.set_title(f"{c['model']} @ {c['rate']}: top {c['top_over_fastest']:.2f}x of fastest", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("rumor.advise: predicted vs measured step per algorithm (ranked by the advisor)", fontsize=9)
    _common.save_figure(plt, fig, path)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="rumor.advise predictions vs measurements on emulated hosts",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common.add_world_args(ap)
    ap.set_defaults(hosts=4)
    ap.add_argument("--rates", default="1gbit,100mbit", help="comma list of tbf rates, one cluster each")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", default="", help="per-rank batch overrides, e.g. mlp25m=16,cnn=8")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps at the start of every visit")
    ap.add_argument("--rounds", type=int, default=3,
                    help="visits of every algorithm, in an order rotated each round; each measures "
                         "ceil(iters / rounds) steps (whole rounds for the periodic algorithms)")
    ap.add_argument("--advise-steps", type=int, default=5, help="rumor.advise(steps=...)")
    ap.add_argument("--advise-once", action="store_true",
                    help="advise once per model (default: again at the start of every round, predictions averaged)")
    ap.add_argument("--ref-iters", type=int, default=3,
                    help="compute-only steps (no communication) measured before each visit of an algorithm "
                         "whose traffic runs into the next step")
    ap.add_argument("--only", default="",
                    help="comma list of the table's algorithms to measure (e.g. 'Decentralized shift_one'); "
                         "default all (torch DDP always)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    _common.add_run_args(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return _common.worker_main(args.worker, _describe, _train)
    worlds = _common.world_sizes(ap, args)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        ap.error(f"unknown models {bad}; choose from {MODELS}")
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for r in rates:
        parse_rate(r)
    args.batch_map = {}
    for kv in filter(None, args.batch.split(",")):
        k, _, v = kv.partition("=")
        args.batch_map[k.strip()] = int(v)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.iters < 10:
        print(f"WARNING: --iters {args.iters} is below the protocol's minimum of 10; smoke test only", file=sys.stderr)
    hosts_mode = args.hosts > 0
    if not hosts_mode:
        rates = ["1 host"]  # one cell per world size, shared memory and loopback inside the host
    os.makedirs(args.out, exist_ok=True)
    tag = (f"{args.hosts}hosts" + (f"x{args.ranks_per_host}" if args.ranks_per_host > 1 else "")) if hosts_mode \
        else "1host"
    if args.tag:
        tag += "-" + args.tag
    json_path = os.path.join(args.out, f"advise-{tag}.json")
    png_path = os.path.join(args.out, f"advise-{tag}.png")
    meta = _common.run_meta(args)
    meta.update(rates=rates, rounds=args.rounds,
                step="gloo barrier, then zero_grad + forward + cross-entropy + backward + step: the slowest rank's "
                     "time from the barrier's return, plus the last arrival's barrier; visits rotated over rounds")
    result = dict(meta=meta, jobs=[], cells=[], targets=[], errors=[])
    layout = (f"{args.hosts} hosts x {args.ranks_per_host} | rates {','.join(rates)}" if hosts_mode
              else f"1 host, {','.join(map(str, worlds))} ranks")
    print(f"rumor {meta['rumor']} advisor benchmark | {meta['hostname']}, {meta['cpus']} cpus, load "
          f"{meta['loadavg_start'][0]:.2f} | {layout} | "
          f"models {','.join(args.models)} | iters {args.iters} in {args.rounds} rounds, warmup {args.warmup} a visit")
    progress = Progress(len(rates) * len(worlds) * len(args.models), unit="models", quiet_s=10)
    drv = _common.Driver("rumor-advise-bench-", progress, hosts_mode)

    def body() -> int:
        rc = 0
        jobs = []
        for rate in rates:
            if hosts_mode:
                tcp = drv.start_cluster(args.hosts, rate)
                if tcp is None:
                    return 2
                print(f"tbf {rate}: one TCP stream through a shaped link {tcp / 1e6:.1f} MB/s", file=sys.stderr)
            for n in worlds:
                job = Job(os.path.abspath(__file__), args, n, drv.workdir, progress, 0, cluster=drv.cluster,
                          rate=rate)
                jobs.append(job)
                rc |= _common.run_jobs([job], result, progress)
            drv.close_cluster()
        progress.clear()
        for c in result["cells"]:
            summarize(c)
        _common.finish_meta(meta)
        for job in jobs:
            print_table(job.cells, job.label)
        print()
        for c in result["cells"]:
            name = f"{c['job']}: {c['model']} top-ranked ({c['top_predicted']}) within {TOP_WITHIN:.2f}x of fastest"
            result["targets"].append(dict(name=name, value=c["top_over_fastest"], met=c["top_over_fastest"] <= TOP_WITHIN))
            print(f"target: {name}: {c['top_over_fastest']:.2f}x -> "
                  f"{'MET' if c['top_over_fastest'] <= TOP_WITHIN else 'NOT MET'}")
            worst = max(c["pred_error"], key=lambda a: abs(c["pred_error"][a]))
            # torch DDP's prediction counts too: every speed-up the advisor prints is over it.
            ok = all(abs(e) <= PRED_WITHIN for e in c["pred_error"].values())
            name = f"{c['job']}: {c['model']} every prediction within {100 * PRED_WITHIN:.0f}%"
            result["targets"].append(dict(name=name, value=c["pred_error"][worst], met=ok))
            print(f"target: {name}: worst {worst} {100 * c['pred_error'][worst]:+.0f}% -> {'MET' if ok else 'NOT MET'}")
            adj = c.get("pred_error_load_adjusted") or {}
            if adj:
                worst = max(adj, key=lambda a: abs(adj[a]))
                print(f"  (load-adjusted, each block's compute-only step swapped for the advisor's compute: worst {worst} "
                      f"{100 * adj[worst]:+.0f}%, median |error| {100 * statistics.median(abs(e) for e in adj.values()):.0f}%;"
                      f" top-ranked {c['top_over_fastest_load_adjusted']:.2f}x the fastest, {c['fastest_load_adjusted']})")
        headline = None
        if result["cells"]:
            met = sum(t["met"] for t in result["targets"][::2])
            headline = (f"headline: advisor's top pick within {TOP_WITHIN:.2f}x of the fastest measured in {met} of "
                        f"{len(result['cells'])} (rate, model) cells; median |prediction error| "
                        f"{100 * statistics.median(abs(e) for c in result['cells'] for e in c['pred_error'].values()):.0f}%")
        draw = None if args.no_plot else (lambda: plot(png_path, result["cells"]))
        _common.write_results(result, headline, "headline: n/a (no results)", json_path, png_path, draw)
        return rc

    return drv.run(body)


if __name__ == "__main__":
    sys.exit(main())
