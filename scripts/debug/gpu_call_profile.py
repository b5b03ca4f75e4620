"""Where the time of a small CUDA collective and of a DDP step goes, on one GPU (issue 47).

    python3 scripts/debug/gpu_call_profile.py [--out DIR] [--calls N] [--no-ddp]

One process, one rank: rumor over NCCL and torch.distributed's NCCL group on cuda:0. Prints

- per call, for a one-element allreduce: torch, rumor with RUMOR_GPU_WAIT=host and =stream, and
  the pieces rumor's call is made of (each timed alone in a loop: enqueue through the
  communicator, an event's create/record/query, the current stream, routing, ...) and the floor
  a host-waiting call cannot beat (launch, record, spin until the event passed);
- cProfile's top entries for both rumor modes;
- for one DDP step of each model (rumor vs torch DDP): torch.profiler's top CPU entries, and a
  chrome trace of rumor's mlp25m steps into DIR.

A diagnostic, not a benchmark: benchmarks/gpu.py is where the ratios are reported.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29561")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
os.environ.setdefault("RUMOR_GPU_TRANSPORT", "nccl")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def per_call(fn, n: int, reps: int = 5) -> float:
    """Seconds per call: the best of reps loops of n calls, each ended by a synchronize."""
    for _ in range(min(n, 200)):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def top(prof: cProfile.Profile, k: int = 28) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(k)
    return s.getvalue()


def calls(args, out: dict) -> None:
    import rumor
    from rumor import _host_collectives as C
    from rumor._runtime import communicator
    from rumor._tensor import address, dtype_code
    from rumor.gpu import routing

    t = torch.ones(1, device="cuda")
    n = args.calls
    res = {}
    res["torch all_reduce"] = per_call(lambda: dist.all_reduce(t), n)
    rumor.set_gpu_wait("host")
    res["rumor allreduce_ (host wait)"] = per_call(lambda: rumor.allreduce_(t, op=rumor.ReduceOp.SUM), n)
    rumor.set_gpu_wait("stream")
    res["rumor allreduce_ (stream wait)"] = per_call(lambda: rumor.allreduce_(t, op=rumor.ReduceOp.SUM), n)
    rumor.set_gpu_wait("host")
    res["torch all_reduce (again)"] = per_call(lambda: dist.all_reduce(t), n)

    g = communicator(None, "profile")
    gpu = g._gpu
    comm = gpu.comm
    code, op = dtype_code(t.dtype, "p"), C.op_code(rumor.ReduceOp.SUM, "p")
    a = address(t)
    h = torch.cuda.current_stream().cuda_stream
    res["comm.allreduce alone (pybind + NCCL enqueue)"] = per_call(lambda: comm.allreduce(a, a, 1, code, op, h), n)
    ev = torch.cuda.Event()

    def floor_nccl():
        comm.allreduce(a, a, 1, code, op, h)
        ev.record()
        while not ev.query():
            pass

    res["floor: enqueue + record + spin on query"] = per_call(floor_nccl, n)

    def floor_kernel():
        t.add_(0)
        ev.record()
        while not ev.query():
            pass

    res["floor: one tiny kernel + record + spin"] = per_call(floor_kernel, n)
    res["tiny kernel launch alone (t.add_(0))"] = per_call(lambda: t.add_(0), n)

    def new_event():
        e = torch.cuda.Event()
        e.record()

    res["torch.cuda.Event() + record"] = per_call(new_event, n)
    res["event.record (reused)"] = per_call(lambda: ev.record(), n)
    ev.record()
    torch.cuda.synchronize()
    res["event.query (passed)"] = per_call(lambda: ev.query(), n)
    res["torch.cuda.current_stream()"] = per_call(lambda: torch.cuda.current_stream(), n)
    res["torch.cuda.current_stream(dev).cuda_stream"] = per_call(
        lambda: torch.cuda.current_stream(gpu.torch_device).cuda_stream, n)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        res["torch._C._cuda_getCurrentRawStream(0)"] = per_call(lambda: raw(0), n)
    res["torch.cuda.current_device()"] = per_call(lambda: torch.cuda.current_device(), n)
    res["routing.route()"] = per_call(lambda: routing.route("p", None, ("t", t)), n)
    res["communicator(None)"] = per_call(lambda: communicator(None, "p"), n)
    res["t.data_ptr()"] = per_call(lambda: t.data_ptr(), n)
    res["comm.check()"] = per_call(lambda: comm.check("p"), n)
    ev.record()
    torch.cuda.synchronize()
    res["comm.wait(passed event)"] = per_call(lambda: comm.wait(ev.query, 10.0, "p"), n)
    res["time.monotonic()"] = per_call(time.monotonic, n)

    base = res["torch all_reduce"]
    print(f"\n== one-element float32 allreduce on cuda:0, one rank; per call, best of 5 loops of {n}")
    for k, v in res.items():
        print(f"  {v * 1e6:9.2f} us  {v / base:6.2f}x torch   {k}")
    out["per_call_s"] = res

    for mode in ("host", "stream"):
        rumor.set_gpu_wait(mode)
        for _ in range(200):
            rumor.allreduce_(t, op=rumor.ReduceOp.SUM)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            rumor.allreduce_(t, op=rumor.ReduceOp.SUM)
        torch.cuda.synchronize()
        prof.disable()
        text = top(prof)
        print(f"\n== cProfile, {n} calls of rumor.allreduce_ with gpu_wait={mode}\n{text}")
        out[f"cprofile_{mode}"] = text
    rumor.set_gpu_wait("host")


def ddp(args, out: dict) -> None:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from torch.profiler import ProfilerActivity, profile

    import rumor
    from rumor.testing import models

    dev = torch.device("cuda", 0)
    for name in args.models:
        batch = models.BATCH[name]
        data = [tuple(x.to(dev) for x in models.batch(name, batch, step=i, shard=0, seed=0)) for i in range(4)]
        for v in ("rumor", "torch"):
            model = models.build(name, seed=0).to(dev)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            m = rumor.DistributedDataParallel(model, optimizer=opt) if v == "rumor" else TorchDDP(model, device_ids=[0])

            def step(i):
                x, y = data[i % 4]
                opt.zero_grad()
                models.loss(m(x), y).backward()
                opt.step()

            for i in range(8):
                step(i)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(20):
                step(i)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 20
            pr = cProfile.Profile()
            pr.enable()
            for i in range(10):
                step(i)
            torch.cuda.synchronize()
            pr.disable()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for i in range(3):
                    step(i)
                torch.cuda.synchronize()
            table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60)
            print(f"\n== DDP {name} {v}: {wall * 1e3:.3f} ms/step (20 steps, no sync between)\n{table}")
            ptext = top(pr, 22)
            print(f"-- cProfile of 10 steps ({v} {name})\n{ptext}")
            out.setdefault("ddp", {})[f"{name}/{v}"] = dict(step_s=wall, profiler=table, cprofile=ptext)
            if v == "rumor" and name == args.models[0] and args.out:
                p.export_chrome_trace(os.path.join(args.out, f"trace_{name}_rumor.json"))
            del m, model, opt
            torch.cuda.empty_cache()


def timing(args, out: dict) -> None:
    """Step times only, interleaved rounds (medians), for variants that each test one suspect:
    the model alone (the floor), torch DDP, rumor DDP as is, with a 0.1 ms GIL switch interval
    (a thread holding the GIL delays the autograd thread's return from each op), and with every
    bucket handed to the worker thread (no inline launch)."""
    import statistics

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import rumor
    from rumor.engine import device as engine_device
    from rumor.testing import models

    dev = torch.device("cuda", 0)
    variants = ["alone", "torch", "rumor", "rumor-switch1e-4", "rumor-worker"]
    for name in args.models:
        batch = models.BATCH[name]
        data = [tuple(x.to(dev) for x in models.batch(name, batch, step=i, shard=0, seed=0)) for i in range(4)]
        runs = {}
        for v in variants:
            model = models.build(name, seed=0).to(dev)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            if v == "alone":
                m = model
            elif v == "torch":
                m = TorchDDP(model, device_ids=[0])
            else:
                m = rumor.DistributedDataParallel(model, optimizer=opt)
            runs[v] = (m, opt, model)
        times = {v: [] for v in variants}
        default_switch = sys.getswitchinterval()
        for rnd in range(args.rounds + 1):
            for v in variants:
                m, opt, _ = runs[v]
                sys.setswitchinterval(1e-4 if v == "rumor-switch1e-4" else default_switch)
                engine_device.INLINE_LAUNCH = v != "rumor-worker"
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(args.steps):
                    x, y = data[i % 4]
                    opt.zero_grad()
                    models.loss(m(x), y).backward()
                    opt.step()
                torch.cuda.synchronize()
                if rnd:  # round 0 warms up
                    times[v].append((time.perf_counter() - t0) / args.steps)
        sys.setswitchinterval(default_switch)
        engine_device.INLINE_LAUNCH = True
        med = {v: statistics.median(t) for v, t in times.items()}
        line = "  ".join(f"{v} {med[v] * 1e3:.3f}" for v in variants)
        print(f"== timing {name} (ms/step, median of {args.rounds} rounds of {args.steps}): {line}; "
              f"torch/rumor {med['torch'] / med['rumor']:.2f}x", flush=True)
        out.setdefault("timing", {})[name] = {v: t for v, t in times.items()}
        del runs
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--models", nargs="*", default=["mlp25m", "cnn", "transformer"])
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--no-calls", action="store_true")
    p.add_argument("--timing", action="store_true", help="step times of DDP variants only (see timing())")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.cuda.set_device(0)
    import rumor

    rumor.init()
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    out: dict = {"torch": torch.__version__}
    if args.timing:
        timing(args, out)
    elif not args.no_calls:
        calls(args, out)
    if not args.no_ddp and not args.timing:
        ddp(args, out)
    if args.out:
        with open(os.path.join(args.out, "gpu_call_profile.json"), "w") as f:
            json.dump(out, f, indent=1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
