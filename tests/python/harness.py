"""Multi-process test harness: runs a module-level function on N spawned ranks.

    results = harness.run(fn, world_size, timeout=60, env=None, args=(), rank_env=None)

Every rank is a fresh `python -c` process with RANK / WORLD_SIZE / LOCAL_RANK /
LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT / RUMOR_TIMEOUT set, as torchrun would. Each
rank calls fn(*args) and its return value comes back through a pickle file. The harness
guarantees that a test finishes or fails, never hangs:

* the whole run has a deadline (`timeout`); when it passes, every rank still running is
  killed (SIGKILL to its process group) and the test fails naming those ranks, with the
  Python stacks faulthandler dumped just before the deadline;
* a rank that raises makes the test fail with that rank's traceback (and every other
  failing rank's); the other ranks are not waited for longer than the deadline;
* a rank that exits without a result fails the test, unless it is listed in `may_die`.

The rank function must be importable by name: a module-level function in a module on
sys.path (the test modules here and this one are; tests/python is added to PYTHONPATH).
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from rumor._ports import free_port  # noqa: F401  (the tests take it from here)
from rumor.testing.launch import kill_process_group

HERE = os.path.dirname(os.path.abspath(__file__))

# Variables a parent environment could leak into a rank and change what rumor.init() sees.
_SCRUB_PREFIXES = ("OMPI_", "PMI_", "SLURM_", "TORCHELASTIC_", "RUMOR_", "PMIX_")
_SCRUB_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT")


class RankFailed(AssertionError):
    """One or more ranks raised, died, or missed the deadline."""


@dataclass
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error: Optional[str] = None          # formatted traceback
    error_type: Optional[str] = None     # e.g. "rumor.errors.PeerError"
    returncode: Optional[int] = None
    output: str = ""


def _child_env(rank: int, world_size: int, port: int, timeout_s: float, env: Optional[Dict[str, str]],
               rank_env: Optional[Dict[str, str]]) -> Dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_NAMES}
    e.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RUMOR_TIMEOUT="30",
        # Two cores for up to four ranks: torch's own thread pools would only fight the ranks.
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
    )
    path = e.get("PYTHONPATH", "")
    e["PYTHONPATH"] = HERE + (os.pathsep + path if path else "")
    if env:
        e.update({k: str(v) for k, v in env.items()})
    if rank_env:
        e.update({k: str(v) for k, v in rank_env.items()})
    return e


_BOOT = "import sys; sys.path.insert(0, {here!r}); import harness; harness._child_main({spec!r})"


def run(fn: Callable, world_size: int, timeout: float = 60, env: Optional[Dict[str, str]] = None,
        args: Sequence[Any] = (), rank_env: Optional[Sequence[Optional[Dict[str, str]]]] = None,
        may_die: Sequence[int] = (), raw: bool = False, port: Optional[int] = None):
    """Runs fn(*args) on `world_size` ranks; returns the list of return values by rank.

    env: extra variables for every rank; rank_env: a list with one dict (or None) per rank.
    may_die: ranks that are allowed to exit without a result (fault injection); their entry
      in the returned list is None.
    raw: return the list of RankResult instead of raising on the first problem.
    """
    __tracebackhide__ = True
    assert 1 <= world_size <= 8
    if rank_env is not None:
        assert len(rank_env) == world_size
    module, name = fn.__module__, fn.__qualname__
    assert "<" not in name, f"{name}: rank functions must be module-level (they are imported by name)"
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="rumor-harness-")
    procs: List[_Rank] = []
    logs = []
    start = time.monotonic()
    deadline = start + timeout
    try:
        for r in range(world_size):
            spec_path = os.path.join(workdir, f"spec{r}.pkl")
            out_path = os.path.join(workdir, f"result{r}.pkl")
            with open(spec_path, "wb") as f:
                pickle.dump(dict(module=module, name=name, args=tuple(args), out=out_path,
                                 dump_after=max(1.0, timeout - 4.0) if timeout > 8 else None), f)
            log = open(os.path.join(workdir, f"log{r}.txt"), "w+b")
            logs.append(log)
            e = _child_env(r, world_size, port, timeout, env, rank_env[r] if rank_env else None)
            procs.append(_start(spec_path, e, log))
        # Poll (which also reaps exited ranks promptly: rumor notices a dead peer on the same
        # host through kill(pid, 0), which a zombie would still answer).
        while True:
            # Poll every rank each time (no short-circuit), so none stays a zombie.
            if all([p.poll() is not None for p in procs]):
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        timed_out = [r for r, p in enumerate(procs) if p.poll() is None]
        for r in timed_out:
            kill_process_group(procs[r])
        results = []
        for r, p in enumerate(procs):
            logs[r].seek(0)
            output = logs[r].read().decode("utf-8", "replace")
            out_path = os.path.join(workdir, f"result{r}.pkl")
            res = RankResult(rank=r, ok=False, returncode=p.returncode, output=output)
            if os.path.exists(out_path):
                with open(out_path, "rb") as f:
                    payload = pickle.load(f)
                if payload["ok"]:
                    res.ok, res.value = True, payload["value"]
                else:
                    res.error, res.error_type = payload["error"], payload["type"]
            elif r in timed_out:
                res.error = f"rank {r} did not finish within the {timeout:.0f} s deadline and was killed"
                res.error_type = "timeout"
            else:
                res.error = f"rank {r} exited with code {p.returncode} without a result"
                res.error_type = "died"
            results.append(res)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_process_group(p)
        for log in logs:
            log.close()
        _rmtree(workdir)
    if raw:
        return results
    bad = [res for res in results if not res.ok and not (res.rank in may_die and res.error_type == "died")]
    if bad:
        raise RankFailed(_report(fn, world_size, results, bad))
    return [res.value if res.ok else None for res in results]


def _report(fn, world_size, results, bad) -> str:
    lines = [f"{fn.__module__}.{fn.__qualname__} on {world_size} rank(s): "
             f"{len(bad)} rank(s) failed: {[b.rank for b in bad]}"]
    for res in bad:
        lines.append(f"\n===== rank {res.rank} ({res.error_type}, exit code {res.returncode}) =====")
        lines.append(res.error or "")
        tail = res.output[-6000:]
        if tail.strip():
            lines.append(f"----- rank {res.rank} output (tail) -----")
            lines.append(tail)
    others = [r.rank for r in results if r not in bad and r.output.strip()]
    for r in others[:2]:
        lines.append(f"----- rank {r} output (tail, rank passed) -----")
        lines.append(results[r].output[-1500:])
    return "\n".join(lines)


# ---- starting ranks ----------------------------------------------------------------------------
#
# Importing torch costs about two CPU seconds per process, which over a whole suite of 1-4 rank
# runs on a two-core machine is most of its time. By default ranks are therefore forked from a
# multiprocessing fork server that has imported torch and rumor once (a fresh, single-threaded
# process: thread pools are pinned to one thread before it starts, and rumor creates no thread
# before init()). Each forked rank gets its own session, environment and log file, exactly like a
# `python -c` subprocess would. RUMOR_TEST_START=subprocess starts every rank as a fresh
# interpreter instead.

_PRELOAD = ["torch", "torch.distributed", "numpy", "rumor", "harness"]
_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_mp_ctx = None


class _Rank:
    """A started rank: poll(), returncode, pid, and kill() (the rank's whole session)."""

    def __init__(self, popen=None, process=None):
        self._popen, self._process = popen, process

    @property
    def pid(self) -> int:
        return self._popen.pid if self._popen is not None else self._process.pid

    def poll(self) -> Optional[int]:
        return self._popen.poll() if self._popen is not None else self._process.exitcode

    @property
    def returncode(self) -> Optional[int]:
        return self.poll()

    def wait(self, timeout: float) -> None:
        if self._popen is not None:
            try:
                self._popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        else:
            self._process.join(timeout)

    def kill(self) -> None:
        if self._popen is not None:
            self._popen.kill()
        else:
            self._process.kill()


def _start_method() -> str:
    return os.environ.get("RUMOR_TEST_START", "forkserver")


def _forkserver_context():
    global _mp_ctx
    if _mp_ctx is None:
        import multiprocessing
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        # The server inherits this process's environment when it starts: start it now, with
        # single-threaded math libraries, so that forking from it is safe.
        saved = {k: os.environ.get(k) for k in _THREAD_ENV}
        os.environ.update(_THREAD_ENV)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _mp_ctx = ctx
    return _mp_ctx


def _start(spec_path: str, env: Dict[str, str], log) -> _Rank:
    if _start_method() == "subprocess":
        cmd = [sys.executable, "-c", _BOOT.format(here=HERE, spec=spec_path)]
        return _Rank(popen=subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True))
    ctx = _forkserver_context()
    proc = ctx.Process(target=_forked_main, args=(spec_path, env, log.name, list(sys.path)),
                       name=os.path.basename(spec_path))
    proc.start()
    return _Rank(process=proc)


def _forked_main(spec_path: str, env: Dict[str, str], log_path: str, path: List[str]) -> None:
    """Runs in a rank forked from the fork server: become a session of its own with its own
    environment and output, then continue as a `python -c` rank would."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = [HERE] + [p for p in path if p != HERE]  # the caller's, as of this run
    _child_main(spec_path)


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ---- inside a rank -----------------------------------------------------------------------------

def _child_main(spec_path: str) -> None:
    import faulthandler
    import importlib

    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    # A crash (SIGSEGV, SIGABRT, ...) prints every thread's Python stack into the rank's output,
    # which a failed test shows.
    faulthandler.enable(all_threads=True)
    if spec["dump_after"]:
        # Just before the parent's deadline, print every thread's stack and exit: a hung rank
        # then shows where it hung.
        faulthandler.dump_traceback_later(spec["dump_after"], exit=True)
    try:
        mod = importlib.import_module(spec["module"])
        fn = mod
        for part in spec["name"].split("."):
            fn = getattr(fn, part)
        value = fn(*spec["args"])
        payload = dict(ok=True, value=value)
        try:
            data = pickle.dumps(payload)
        except Exception:  # noqa: BLE001
            data = pickle.dumps(dict(ok=True, value=repr(value)))
    except BaseException as e:  # noqa: BLE001
        t = type(e)
        data = pickle.dumps(dict(ok=False, error=traceback.format_exc(),
                                 type=f"{t.__module__}.{t.__qualname__}"))
    tmp = spec["out"] + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, spec["out"])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (torch and rumor threads): the result is already on disk.
    os._exit(0)


# ---- helpers for rank functions ----------------------------------------------------------------

def pid_alive(pid: int) -> bool:
    """True while the process runs (a zombie counts as gone), read from /proc by the tests
    themselves rather than through the code under test."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def env_rank() -> int:
    return int(os.environ["RANK"])


def env_world() -> int:
    return int(os.environ["WORLD_SIZE"])


class Checker:
    """Collects mismatches instead of stopping at the first, so one run reports them all."""

    def __init__(self, limit: int = 200):
        self.failures: List[str] = []
        self.count = 0
        self.limit = limit

    def check(self, ok: bool, what: str) -> None:
        self.count += 1
        if not ok and len(self.failures) < self.limit:
            self.failures.append(what)

    def equal(self, actual, expected, what: str) -> None:
        """Same dtype, same shape, same values (bit-exact for floats, NaN == NaN)."""
        self.count += 1
        msg = compare(actual, expected, exact=True)
        if msg and len(self.failures) < self.limit:
            self.failures.append(f"{what}: {msg}")

    def close(self, actual, expected, what: str, rtol=None, atol=None) -> None:
        """Same dtype and shape, values within rtol/atol (torch.testing's defaults per dtype)."""
        self.count += 1
        msg = compare(actual, expected, exact=False, rtol=rtol, atol=atol)
        if msg and len(self.failures) < self.limit:
            self.failures.append(f"{what}: {msg}")

    def raises(self, exc_types, fn, what: str, match: Optional[str] = None):
        """fn() must raise one of exc_types (and mention `match`); returns the exception."""
        self.count += 1
        try:
            fn()
        except exc_types as e:  # noqa: PERF203
            if match is not None and match.lower() not in str(e).lower():
                self.failures.append(f"{what}: raised {type(e).__name__} without {match!r}: {e}")
            return e
        except BaseException as e:  # noqa: BLE001
            self.failures.append(f"{what}: expected {_names(exc_types)}, got {type(e).__name__}: {e}")
            return e
        self.failures.append(f"{what}: expected {_names(exc_types)}, nothing was raised")
        return None


_DEFAULT_TOL = {"float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5), "float32": (1.3e-6, 1e-5),
                "float64": (1e-7, 1e-7)}


def compare(actual, expected, exact: bool, rtol=None, atol=None) -> Optional[str]:
    """None if actual matches expected, else a short description of the first mismatches.
    (torch.testing.assert_close costs most of a second per process to import its helpers.)"""
    import torch

    if not isinstance(actual, torch.Tensor):
        return f"expected a tensor, got {type(actual).__name__}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.numel() == 0:
        return None
    a, e = actual.detach(), expected.detach()
    if exact or not a.dtype.is_floating_point:
        if a.dtype.is_floating_point:
            bad = ~((a == e) | (torch.isnan(a) & torch.isnan(e)))
        else:
            bad = a != e
    else:
        d_rtol, d_atol = _DEFAULT_TOL[dname(a.dtype)]
        rtol = d_rtol if rtol is None else rtol
        atol = d_atol if atol is None else atol
        bad = ~torch.isclose(a.double(), e.double(), rtol=rtol, atol=atol, equal_nan=True)
    nbad = int(bad.sum())
    if nbad == 0:
        return None
    idx = bad.reshape(-1).nonzero()[:4].reshape(-1).tolist()
    af, ef = a.reshape(-1), e.reshape(-1)
    sample = ", ".join(f"[{i}] {af[i].item()!r} vs {ef[i].item()!r}" for i in idx)
    kind = "exactly" if exact else f"within rtol={rtol}, atol={atol}"
    return f"{nbad} of {a.numel()} elements differ ({kind}); first: {sample}"


def _names(exc_types) -> str:
    if isinstance(exc_types, tuple):
        return " or ".join(t.__name__ for t in exc_types)
    return exc_types.__name__


def _short(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return " | ".join(s[:6])


def assert_no_failures(results, what: str = "") -> int:
    """results: per-rank (failures, count) pairs from Checker; raises listing every failure."""
    __tracebackhide__ = True
    lines = []
    total = 0
    for r, res in enumerate(results):
        if res is None:
            continue
        failures, count = res
        total += count
        for f in failures:
            lines.append(f"rank {r}: {f}")
    if lines:
        head = f"{what}: {len(lines)} mismatch(es)\n" if what else f"{len(lines)} mismatch(es)\n"
        raise AssertionError(head + "\n".join(lines[:80]))
    return total



# ---- named scenarios: one test id each, one launch per batch ------------------------------------
#
# Starting ranks costs seconds, so a test module runs many named scenarios in one launch. To give
# each scenario its own test id (`pytest -k NAME` picks it), a test is parametrized by scenario
# and fetches its result through batch(): the first test of a batch launches once, running every
# scenario of that batch that this session selected (after -k / -m), and the others take their
# part of that launch's result. A failed launch fails every test of its batch (it is not retried).

def run_scenarios(chk: "Checker", names, table, *args) -> Dict[str, tuple]:
    """Rank side: runs table[name](chk, *args) for each name in order; returns {name: (failures,
    count)}, each scenario's part of the Checker's, for assert_no_failures."""
    out = {}
    for name in names:
        f0, c0 = len(chk.failures), chk.count
        table[name](chk, *args)
        out[name] = (chk.failures[f0:], chk.count - c0)
    return out


def selected(request, argname: str) -> list:
    """The values of parametrize argument `argname` of the tests this session runs (after
    deselection) that differ from request's test only in `argname`, in their order."""
    fn, mine = request.function, request.node.callspec.params
    out = []
    for item in request.session.items:
        cs = getattr(item, "callspec", None)
        if cs is None or getattr(item, "function", None) is not fn or argname not in cs.params:
            continue
        if any(cs.params.get(k) != v for k, v in mine.items() if k != argname):
            continue
        v = cs.params[argname]
        if v not in out:
            out.append(v)
    return out


def batch(cache: dict, key, launch: Callable[[], Any]):
    """launch()'s result, computed once per key in `cache` (the conftest fixture `batches`, one
    dict per module); a launch that raised raises the same for every later test of its key."""
    __tracebackhide__ = True
    if key not in cache:
        try:
            cache[key] = (True, launch())
        except BaseException as e:  # noqa: BLE001 - kept and raised again for each test of the batch
            cache[key] = (False, e)
            raise
    ok, value = cache[key]
    if not ok:
        raise value.with_traceback(None)
    return value


def scenario_results(results, name: str) -> list:
    """Per-rank (failures, count) of scenario `name` from per-rank run_scenarios() dicts."""
    return [None if r is None else r[name] for r in results]

# ---- deterministic inputs and exact references --------------------------------------------------

OP_NAMES = ("SUM", "AVG", "MIN", "MAX", "PROD")


def dtypes():
    import torch

    return [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8]


def dname(dtype) -> str:
    return str(dtype).replace("torch.", "")


def gen(key: str, owner: int, dtype, op: str, shape):
    """The input `owner` contributes to the case `key`. Every rank can build every other rank's
    input, so each rank computes the expected result itself.

    Values are chosen so the exact result is representable in the dtype: small integers for
    SUM/AVG (sums of four stay exact even in bfloat16 and below 256 in uint8), +-1/+-2 for PROD,
    anything for MIN/MAX and the copying collectives ("COPY")."""
    import zlib

    import torch

    if isinstance(shape, int):
        shape = (shape,)
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}|{owner}|{dname(dtype)}|{op}|{tuple(shape)}".encode()))
    n = 1
    for d in shape:
        n *= d
    floating = dtype.is_floating_point
    if op in ("SUM", "AVG"):
        t = torch.randint(0, 61, (n,), generator=g) if dtype == torch.uint8 else torch.randint(-8, 9, (n,), generator=g)
    elif op == "PROD":
        if dtype == torch.uint8:
            t = torch.randint(1, 4, (n,), generator=g)
        else:
            t = torch.randint(1, 3, (n,), generator=g) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    elif floating:
        t = torch.randn(n, generator=g, dtype=torch.float64) * 100
    elif dtype == torch.uint8:
        t = torch.randint(0, 256, (n,), generator=g)
    elif dtype == torch.int32:
        t = torch.randint(-(2**31), 2**31, (n,), generator=g)
    else:
        t = torch.randint(-(2**62), 2**62, (n,), generator=g)
    return t.to(dtype).reshape(shape)


def reference(inputs, op: str):
    """The exact reduction of `inputs` (one tensor per rank), in their dtype.
    AVG on integers truncates toward zero, like rumor's C++ integer division."""
    import torch

    dtype = inputs[0].dtype
    n = len(inputs)
    acc = torch.stack([x.double() if dtype.is_floating_point else x.long() for x in inputs])
    if op == "SUM":
        out = acc.sum(0)
    elif op == "PROD":
        out = acc.prod(0)
    elif op == "MIN":
        out = acc.amin(0) if acc.numel() else acc.sum(0)
    elif op == "MAX":
        out = acc.amax(0) if acc.numel() else acc.sum(0)
    elif op == "AVG":
        s = acc.sum(0)
        out = s / n if dtype.is_floating_point else torch.div(s, n, rounding_mode="trunc")
    else:
        raise ValueError(op)
    return out.to(dtype)


def check_reduced(chk: "Checker", actual, expected, op: str, what: str) -> None:
    """Exact where the math is exact (everything but a float AVG, which divides once)."""
    if op == "AVG" and expected.dtype.is_floating_point:
        chk.close(actual, expected, what)
    else:
        chk.equal(actual, expected, what)


def file_barrier(directory: str, name: str, timeout: float = 60.0, rank: Optional[int] = None,
                 world: Optional[int] = None) -> None:
    """Waits until every rank has reached the barrier `name` (through marker files in a
    directory shared by the ranks of one run); for points where no communicator is usable.
    rank/world default to $RANK/$WORLD_SIZE."""
    file_barrier_arrive(directory, name, rank)
    file_barrier_wait(directory, name, range(env_world() if world is None else world), timeout)


def file_barrier_arrive(directory: str, name: str, rank: Optional[int] = None) -> None:
    open(os.path.join(directory, f"{name}.{env_rank() if rank is None else rank}"), "w").close()


def file_barrier_wait(directory: str, name: str, ranks, timeout: float = 60.0) -> None:
    """Waits until every rank in `ranks` has arrived at `name` (with a deadline)."""
    ranks = list(ranks)
    end = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(directory, f"{name}.{q}")) for q in ranks):
        if time.monotonic() > end:
            missing = [q for q in ranks if not os.path.exists(os.path.join(directory, f"{name}.{q}"))]
            raise TimeoutError(f"file barrier {name!r}: ranks {missing} did not arrive within {timeout} s")
        time.sleep(0.01)


# ---- running a launcher command ------------------------------------------------------------------

LAUNCH_DEADLINE_S = 120


def launcher_env(env_extra=None) -> Dict[str, str]:
    """A launcher's environment: this one scrubbed like a rank's, then env_extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_NAMES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RUMOR_TIMEOUT="30")
    if env_extra:
        env.update(env_extra)
    return env


def launch(cmd, cwd, env_extra=None, deadline_s: float = LAUNCH_DEADLINE_S) -> str:
    """Runs a launcher command (rumor.run, rumor-run, torchrun) with a deadline (the whole process
    group is killed when it passes, and the test fails) in an environment scrubbed like a rank's;
    returns the combined output after checking the exit code."""
    __tracebackhide__ = True
    import pytest

    p = subprocess.Popen(cmd, env=launcher_env(env_extra), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {deadline_s} s:\n{out.decode(errors='replace')[-6000:]}")
    text = out.decode(errors="replace")
    assert p.returncode == 0, f"{' '.join(cmd)} exited with {p.returncode}:\n{text[-6000:]}"
    return text


def run_on_hosts(tmp_path, name: str, boot: str, world: int, port: int, deadline_s: float,
                 env: Optional[Dict[str, str]] = None, **cluster) -> tuple:
    """Runs `python -c boot` as `world` ranks, one per emulated host (rumor.testing.netns.Cluster
    with the `cluster` keywords), until all exit or deadline_s passes (then every rank is killed
    and the test fails with each rank's output). Skips where namespaces cannot be built.

    Returns:
        (each rank's last "RESULT <json>" line, parsed; the ranks' output tails for messages).
        A rank that printed none fails the test with everyone's output.
    """
    import json

    import pytest

    from rumor.testing import launch, netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(f"emulated hosts need Linux network namespaces: {why}")
    logdir = tmp_path / name
    logdir.mkdir()
    argv = [sys.executable, "-c", boot]
    with netns.Cluster(world, **cluster) as hosts, \
            launch.Ranks(argv, world, cluster=hosts, env=env or {}, port=port, logdir=str(logdir)) as ranks:
        deadline = time.monotonic() + deadline_s
        while any(p.poll() is None for p in ranks.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        late = [r for r in range(world) if ranks.procs[r].poll() is None]
        ranks.kill()
        outputs = [ranks.log(r) for r in range(world)]
        codes = [p.returncode for p in ranks.procs]
    dump = "\n".join(f"===== rank {r} =====\n{outputs[r][-4000:]}" for r in range(world))
    if late:
        pytest.fail(f"{name}: rank(s) {late} still running after {deadline_s} s\n{dump}", pytrace=False)
    results = []
    for r, text in enumerate(outputs):
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            pytest.fail(f"{name}: rank {r} reported no result (exit code {codes[r]})\n{dump}", pytrace=False)
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results, dump
