"""Autotuning of rumor.DistributedDataParallel's system settings (docs/autotune.md).

``DistributedDataParallel(model, autotune=True)`` (or ``rumor-run --autotune``, which sets
RUMOR_AUTOTUNE=1) spends the first training steps trying settings that change only how the
gradients travel, never what they sum to: bucket_cap_mb, first_bucket_mb, bucket_split_gap_ms,
hierarchical (jobs spanning hosts with several ranks on some host), shared_buckets (all ranks on
one host) and GradientAllReduce's small_allreduce_kb.

How a search runs, all of it between iterations (at the start of a training forward, when no
bucket is in flight):

* the first iteration is left alone (it observes the ready order, as without tuning); from the
  second on, steps are counted in trials of ``warm_steps + measure_steps`` steps, the first trial
  being the settings the wrapper was given;
* a step's time is the time from one training forward to the next on each rank; at the end of a
  trial one allreduce (MAX) gives the slowest rank's time of each measured step, and the trial's
  score is their median;
* rank 0 alone runs the optimizer (optuna's TPE sampler, seeded: the proposals depend only on the
  seed and the scores) and broadcasts the next setting (or, once the budget is spent, the best
  one) with rumor's own broadcast; every rank applies it at that same step, so the buckets are
  rebuilt in step everywhere (the gradients they hold are kept);
* the best setting is saved in a JSON cache (RUMOR_AUTOTUNE_CACHE, default
  ~/.cache/rumor/autotune.json) under the model's signature (parameter names, shapes, dtypes),
  the group's layout (ranks, hosts, largest local size) and the algorithm, per socket-stream
  count; a later run with the same key applies it at once and tunes nothing. Rank 0 prints the
  result as the keyword arguments to pass by hand.

The number of TCP streams per peer pair is fixed when rumor.init() builds the Context (its
channels are made with it), so it cannot be tried within a run: the cache keeps one result per
stream count, and the printout names the stream count that was fastest among the runs so far
(``rumor-run --socket-streams N --autotune`` for each N to compare).
"""
from __future__ import annotations

import datetime
import hashlib
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import torch

from . import _runtime
from ._autotune_cache import (CACHE_ENV, CACHE_VERSION, LOCK_TIMEOUT_ENV, LOCK_TIMEOUT_S,  # noqa: F401
                              default_cache_path, read_cache, update_cache, valid_setting)

if TYPE_CHECKING:  # pragma: no cover
    from .parallel import DistributedDataParallel

_MB = 1024 * 1024

# Candidate values per knob; the wrapper's own value is always added (it is the first trial).
DEFAULT_SPACE: Dict[str, tuple] = {
    "bucket_cap_mb": (1, 2, 5, 10, 25, 50, 100),
    "first_bucket_mb": (0.25, 0.5, 1, 2, 4),
    "bucket_split_gap_ms": (1, 2, 5, 10, 20, math.inf),
    "hierarchical": (False, True),
    "shared_buckets": (False, True),
    "small_allreduce_kb": (4, 16, 64, 256, 1024),
}
KNOBS = tuple(DEFAULT_SPACE)


@dataclass
class AutotuneConfig:
    """budget_steps: steps (after the first iteration) the search may take; it fits as many
    trials of warm_steps + measure_steps steps as the budget holds (at least two), then fixes the
    best. cache: path of the JSON cache (None: RUMOR_AUTOTUNE_CACHE or
    ~/.cache/rumor/autotune.json); use_cache=False neither reads nor writes it. seed: the TPE
    sampler's seed. space: {knob: candidate values} replacing DEFAULT_SPACE's entries (knobs
    that do not apply to the job are left out anyway). verbose: rank 0 prints the result.
    min_gain: the best setting replaces the defaults only if it scored at least this fraction
    below them (a trial's score is the median of a few steps: a smaller lead is noise, and a
    compute-bound job should not end on a setting that only looked faster). confirm: when the
    budget holds at least 4 trials, the last two re-measure the best setting and the defaults back
    to back, and the best is kept only if it leads by min_gain there too (the lowest of many noisy
    scores is biased low, and the defaults' first trial runs first: one lucky or unlucky trial
    must not decide)."""

    budget_steps: int = 80
    warm_steps: int = 2
    measure_steps: int = 3
    cache: Optional[str] = None
    use_cache: bool = True
    seed: int = 0
    space: Optional[Dict[str, Sequence]] = None
    verbose: bool = True
    min_gain: float = 0.02
    confirm: bool = True

    def validate(self) -> "AutotuneConfig":
        """Checks every field (DistributedDataParallel calls it on the config it is given).

        Returns:
            This config, unchanged, so that ``AutotuneConfig(...).validate()`` can be passed on.

        Raises:
            TypeError: a field has the wrong type (budget_steps, warm_steps, measure_steps and
                seed ints; min_gain a number; confirm a bool; cache a path or None; space a dict
                whose hierarchical / shared_buckets values are bools).
            ValueError: warm_steps < 0, measure_steps < 1, budget_steps holds fewer than two
                trials, min_gain outside [0, 1), or space names an unknown knob, is empty for a
                knob or holds a non-positive value.
        """
        what = "rumor autotune"
        for name in ("budget_steps", "warm_steps", "measure_steps", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{what}: {name} must be an int, got {type(v).__name__}")
        if self.warm_steps < 0:
            raise ValueError(f"{what}: warm_steps must be >= 0, got {self.warm_steps}")
        if self.measure_steps < 1:
            raise ValueError(f"{what}: measure_steps must be >= 1, got {self.measure_steps}")
        trial = self.warm_steps + self.measure_steps
        if self.budget_steps < 2 * trial:
            raise ValueError(f"{what}: budget_steps={self.budget_steps} holds fewer than two trials of "
                             f"warm_steps + measure_steps = {trial} steps (the defaults and one other setting)")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float)):
            raise TypeError(f"{what}: min_gain must be a number, got {type(self.min_gain).__name__}")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"{what}: min_gain must be in [0, 1), got {self.min_gain}")
        if not isinstance(self.confirm, bool):
            raise TypeError(f"{what}: confirm must be a bool, got {type(self.confirm).__name__}")
        if self.cache is not None and not isinstance(self.cache, (str, os.PathLike)):
            raise TypeError(f"{what}: cache must be a path or None, got {type(self.cache).__name__}")
        if self.space is not None:
            if not isinstance(self.space, dict):
                raise TypeError(f"{what}: space must be a dict of knob -> candidate values")
            for k, vals in self.space.items():
                if k not in DEFAULT_SPACE:
                    raise ValueError(f"{what}: unknown knob {k!r} in space; knobs: {list(KNOBS)}")
                vals = list(vals)
                if not vals:
                    raise ValueError(f"{what}: space[{k!r}] is empty")
                for v in vals:
                    _check_value(k, v)
        return self

    @property
    def trials(self) -> int:
        """How many trials the budget holds: budget_steps // (warm_steps + measure_steps)."""
        return self.budget_steps // (self.warm_steps + self.measure_steps)

    @property
    def search_trials(self) -> int:
        """The trials that search; the rest (two, with confirm) re-measure the best and the defaults."""
        return self.trials - 2 if self.confirm and self.trials >= 4 else self.trials


def _check_value(knob: str, v) -> None:
    if knob in ("hierarchical", "shared_buckets"):
        if not isinstance(v, bool):
            raise TypeError(f"rumor autotune: space[{knob!r}] values must be bools, got {v!r}")
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 and not (
            knob == "small_allreduce_kb" and v == 0):
        raise ValueError(f"rumor autotune: space[{knob!r}] values must be positive numbers, got {v!r}")


def _config_from(autotune) -> Optional[AutotuneConfig]:
    if autotune is None or autotune is False:
        return None
    if autotune is True:
        return AutotuneConfig().validate()
    if isinstance(autotune, AutotuneConfig):
        return autotune.validate()
    if isinstance(autotune, dict):
        names = {f.name for f in fields(AutotuneConfig)}
        bad = sorted(set(autotune) - names)
        if bad:
            raise TypeError(f"rumor.DistributedDataParallel: unknown autotune options {bad}; valid: {sorted(names)}")
        return AutotuneConfig(**autotune).validate()
    raise TypeError("rumor.DistributedDataParallel: autotune must be a bool, a dict of AutotuneConfig fields or "
                    f"an AutotuneConfig, got {type(autotune).__name__}")


def _config_from_env() -> Optional[AutotuneConfig]:
    if not _runtime.env_bool("RUMOR_AUTOTUNE", False):
        return None
    cfg = AutotuneConfig()
    cfg.budget_steps = _runtime.env_int("RUMOR_AUTOTUNE_BUDGET", cfg.budget_steps, minimum=1)
    return cfg.validate()


def _supported(algorithm) -> bool:
    # Algorithms whose every step is one synchronous bucket exchange: their step time is what the
    # knobs change, and rebuilding their buckets between steps is all a new setting needs.
    return bool(getattr(algorithm, "tunable_buckets", False))


def _make_autotuner(ddp: "DistributedDataParallel", autotune) -> Optional["Autotuner"]:
    """Called by the wrapper at the end of its __init__ (collective when tuning is on)."""
    explicit = autotune is not None
    cfg = _config_from(autotune) if explicit else _config_from_env()
    if cfg is None:
        return None
    if not _supported(ddp.algorithm):
        msg = (f"autotune supports GradientAllReduce, ByteGrad, QSGD and LowPrecision, not "
               f"{type(ddp.algorithm).__name__} (its step is not one bucket exchange per step)")
        if explicit:
            raise ValueError(f"rumor.DistributedDataParallel: {msg}")
        warnings.warn(f"RUMOR_AUTOTUNE ignored: {msg}", stacklevel=3)
        return None
    return Autotuner(ddp, cfg)


def _fmt(v) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "math.inf"
    if isinstance(v, float) and v == int(v):
        return str(int(v))
    if isinstance(v, float):
        return f"{v:.6g}"
    return repr(v)


def ddp_kwargs(setting: Dict, algorithm_name: str = "GradientAllReduce") -> str:
    """The setting as the arguments to pass by hand.

    Args:
        setting: {knob: value}, e.g. the "setting" of status(ddp)["best"].
        algorithm_name: the algorithm class named for the algorithm's own knobs (hierarchical,
            small_allreduce_kb); default "GradientAllReduce".

    Returns:
        A str of keyword arguments for DistributedDataParallel, e.g.
        ``bucket_cap_mb=25, first_bucket_mb=1, algorithm=GradientAllReduce(hierarchical=True)``.
    """
    parts = [f"{k}={_fmt(setting[k])}" for k in ("bucket_cap_mb", "first_bucket_mb", "bucket_split_gap_ms",
                                                  "shared_buckets") if k in setting]
    # small_allreduce_kb=None is GradientAllReduce's default: nothing to pass
    alg = [f"{k}={_fmt(setting[k])}" for k in ("hierarchical", "small_allreduce_kb")
           if k in setting and setting[k] is not None]
    if alg:
        parts.append(f"algorithm={algorithm_name}({', '.join(alg)})")
    return ", ".join(parts)


class Autotuner:
    """One per wrapper; created by DistributedDataParallel when autotune is on. Everything here
    runs on every rank in the same order; only rank 0 holds the optuna study.

    Args:
        ddp: the DistributedDataParallel wrapper whose settings are tuned.
        cfg: the validated AutotuneConfig of the search.

    Raises:
        RuntimeError: rumor.init() has not run.
    """

    def __init__(self, ddp: "DistributedDataParallel", cfg: AutotuneConfig):
        self.ddp = ddp
        self.cfg = cfg
        st = _runtime.state()
        self.group = ddp.group
        self.root = ddp.group.ranks[0]
        self.is_root = st.env.rank == self.root
        self.streams = st.streams
        comm = ddp.group._comm
        hosts = [st.hosts[r] for r in ddp.group.ranks]
        per_host = {h: hosts.count(h) for h in hosts}
        self.layout = dict(world_size=len(hosts), hosts=len(per_host), local_size=max(per_host.values()))
        alg = ddp.algorithm
        self.knobs: List[str] = ["bucket_cap_mb", "first_bucket_mb", "bucket_split_gap_ms"]
        # CUDA parameters (rumor.engine.device): only the buckets' layout is ours to tune there
        # (NCCL picks its own algorithms, and device buckets live in no shared memory); each
        # step's time is measured with the device synchronized (an event waited for with the
        # deadline), since the host may run ahead of the GPU.
        self.device = ddp._device_mode is not None
        if self.device:
            pass
        elif hasattr(alg, "hierarchical") and self.layout["hosts"] > 1 and self.layout["local_size"] > 1:
            self.knobs.append("hierarchical")
        if (not self.device and comm.size > 1 and comm.all_local and comm.uses_shm
                and _runtime.env_bool("RUMOR_SHARED_BUCKETS", True)):
            self.knobs.append("shared_buckets")
        from .algorithms import GradientAllReduce

        if not self.device and isinstance(alg, GradientAllReduce) and comm.size > 1:
            self.knobs.append("small_allreduce_kb")
        self.default = self._current()
        space = dict(DEFAULT_SPACE, **(cfg.space or {}))
        # None sorts first (the communicator's own threshold); inf last (never split).
        self.choices = {k: sorted(set(space[k]) | {self.default[k]}, key=lambda v: (v is not None, v or 0))
                        for k in self.knobs}
        self.key = self._cache_key()
        self.cache_path = os.fspath(cfg.cache) if cfg.cache is not None else default_cache_path()
        self.history: List[Dict] = []  # what every rank applied, and when (identical on every rank)
        self.done = False
        self.best: Optional[Dict] = None
        self.forwards = 0
        self.trial = -1
        self.step_in_trial = 0
        self.samples: List[float] = []
        self.last: Optional[float] = None
        self.started_at: Optional[int] = None
        self.tuning_s = 0.0  # wall time of the tuning steps (the cost of the search, all trials)
        self._order: Optional[List[int]] = None
        self._gaps: Optional[List[float]] = None
        self._study = None
        self._trials = []
        self._scores: List[float] = []
        self._settings: List[Dict] = []
        self._open_cached()

    # ---- settings ---------------------------------------------------------------------------

    def _current(self) -> Dict:
        d = self.ddp
        # Exact (a power of two divides), so that applying the defaults gives the same bytes back.
        s = dict(bucket_cap_mb=d._cap_bytes / _MB, first_bucket_mb=d._first_cap_bytes / _MB,
                 bucket_split_gap_ms=d._split_gap_s * 1e3)
        if "hierarchical" in self.knobs:
            s["hierarchical"] = bool(d.algorithm.hierarchical)
        if "shared_buckets" in self.knobs:
            s["shared_buckets"] = d._shared_setting is not False
        if "small_allreduce_kb" in self.knobs:
            s["small_allreduce_kb"] = d.algorithm.small_allreduce_kb
        return {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v) for k, v in s.items()}

    def _encode(self, status: int, setting: Optional[Dict]) -> torch.Tensor:
        # float64: NaN carries None (the communicator's own threshold), inf "never split"
        t = torch.full((1 + len(self.knobs),), math.nan, dtype=torch.float64)
        t[0] = status
        if setting is not None:
            for i, k in enumerate(self.knobs):
                v = setting[k]
                t[1 + i] = math.nan if v is None else float(v)
        return t

    def _decode(self, t: torch.Tensor) -> Dict:
        s = {}
        for i, k in enumerate(self.knobs):
            v = float(t[1 + i])
            s[k] = bool(v) if k in ("hierarchical", "shared_buckets") else (None if math.isnan(v) else v)
        return s

    def _apply(self, setting: Dict, order: Optional[List[int]] = None, gaps: Optional[List[float]] = None) -> None:
        d = self.ddp
        d._cap_bytes = int(setting["bucket_cap_mb"] * _MB)
        d._first_cap_bytes = int(setting["first_bucket_mb"] * _MB)
        d._split_gap_s = setting["bucket_split_gap_ms"] / 1e3
        if "hierarchical" in setting:
            d.algorithm.hierarchical = setting["hierarchical"]
        if "shared_buckets" in setting:
            d._shared_setting = setting["shared_buckets"]
        if "small_allreduce_kb" in setting:
            d.algorithm.small_allreduce_kb = setting["small_allreduce_kb"]
        if order is None:  # before the first iteration: its rebuild splits with the new gap
            d._build_buckets(list(reversed(range(len(d._params)))))
        else:  # as the wrapper's own rebuild, with this setting's split gap
            split, by_link = d._bucket_rule(d._bucket_latency_s, d._link_figures is not None)
            link = d._link_figures if by_link else None
            breaks = {j for j, g in enumerate(gaps) if g > split}
            d._build_buckets(order, breaks, link)

    # ---- cache ------------------------------------------------------------------------------

    def _cache_key(self) -> str:
        d = self.ddp
        sig = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in zip(d._names, d._params))
        digest = hashlib.sha256(sig.encode()).hexdigest()[:16]
        lay = self.layout
        # CUDA parameters run another engine: their best setting is theirs (CPU keys unchanged).
        engine = f"|engine=device-{d._device_mode}" if self.device else ""
        return (f"model={digest}|world={lay['world_size']},hosts={lay['hosts']},local={lay['local_size']}"
                f"|algorithm={type(d.algorithm).__name__}|knobs={','.join(self.knobs)}{engine}")

    def _read_cache(self) -> Dict:
        return read_cache(self.cache_path)

    def _write_cache(self, record: Dict) -> None:
        update_cache(self.cache_path, self.key, {"layout": self.layout, "algorithm": type(self.ddp.algorithm).__name__},
                     self.streams, record)

    def _cached_record(self) -> Optional[Dict]:
        """This key's record for this stream count, if the cache has a valid one; a bad one is
        ignored with a warning (it is tuned again and replaced)."""
        entry = self._read_cache()["entries"].get(self.key)
        if entry is None:
            return None
        by_streams = entry.get("by_streams") if isinstance(entry, dict) else None
        if not isinstance(by_streams, dict):
            rec, why = None, "the entry is not a dict with by_streams"
        else:
            rec = by_streams.get(str(self.streams))
            if rec is None:
                return None
            why = (valid_setting(rec.get("setting"), self.knobs) if isinstance(rec, dict)
                   else "its record is not a dict")
        if why is not None:
            warnings.warn(f"rumor autotune: ignoring the cache entry for this model and layout in {self.cache_path}: "
                          f"{why}; tuning again", RuntimeWarning, stacklevel=3)
            return None
        return rec

    def _streams_note(self) -> str:
        entry = self._read_cache()["entries"].get(self.key, {})
        entry = entry.get("by_streams", {}) if isinstance(entry, dict) else {}
        entry = {s: r for s, r in entry.items() if s.isdigit() and isinstance(r, dict)
                 and isinstance(r.get("step_s"), (int, float)) and not isinstance(r.get("step_s"), bool)}
        if len(entry) < 2:
            return (f"socket streams: {self.streams} (fixed per run; compare with rumor-run --socket-streams N "
                    "--autotune)")
        best = min(entry, key=lambda s: entry[s]["step_s"])
        runs = ", ".join(f"{s}: {entry[s]['step_s'] * 1e3:.1f} ms" for s in sorted(entry, key=int))
        return f"socket streams: fastest so far RUMOR_SOCKET_STREAMS={best} ({runs})"

    def _open_cached(self) -> None:
        """Rank 0 looks the key up (and checks optuna is there if it must tune); all ranks learn
        the outcome from one broadcast, so they agree even where their caches differ. Rank 0
        reaches the broadcast whatever the cache holds: a bad entry is ignored (tuned again), and
        an unexpected error there is sent as a status that makes every rank raise, so that no
        rank waits in the broadcast for a root that gave up."""
        from .collectives import broadcast_

        status = 0  # 0: tune, 1: cached setting follows, 2: optuna missing, 3: rank 0 failed
        setting = None
        root_error = None
        if self.is_root:
            try:
                if self.cfg.use_cache:
                    rec = self._cached_record()
                    if rec is not None:
                        setting, status = rec["setting"], 1
                        self.best = dict(rec, source="cache")
                if status == 0:
                    try:
                        import optuna  # noqa: F401
                    except ImportError:
                        status = 2
                t = self._encode(status, setting)
            except Exception as e:  # noqa: BLE001  (re-raised below, after the broadcast)
                root_error = e
                t = self._encode(3, None)
        else:
            t = self._encode(status, setting)
        broadcast_(t, self.root, self.group)
        status = int(t[0])
        if status == 3:
            if root_error is not None:
                raise root_error
            raise RuntimeError(f"rumor autotune: the group's first rank (rank {self.root}) failed while looking up the "
                               "cache (see its error)")
        if status == 2:
            raise ImportError("rumor.DistributedDataParallel(autotune=True) needs optuna on the group's first rank "
                              "(pip install 'rumor[autotune]')")
        if status == 1:
            setting = self._decode(t)
            self._apply(setting)
            self.history.append(dict(step=0, kind="cached", setting=setting))
            self.done = True
            if self.best is None:
                self.best = dict(setting=setting, source="cache")
            if self.is_root and self.cfg.verbose:
                print(f"rumor autotune: using the cached setting for this model and layout ({self.cache_path}): "
                      f"{ddp_kwargs(setting, type(self.ddp.algorithm).__name__)}", file=sys.stderr, flush=True)

    # ---- the search -------------------------------------------------------------------------

    def observe_ready_times(self, local_order: List[int], local_times: List[Optional[float]],
                            order: List[int]) -> None:
        """From the wrapper's first-iteration rebuild: the agreed order, and (meaningful on the
        group's first rank, whose order it is) how far apart the gradients arrived.

        Args:
            local_order: the order in which this rank's gradients became ready (parameter
                indices); kept for the wrapper's signature, not used here.
            local_times: the time each gradient of local_order became ready, in seconds (None
                where unknown); on the group's first rank their differences become the gaps
                the bucket_split_gap_ms knob splits at.
            order: the ready order every rank agreed on (parameter indices).
        """
        self._order = list(order)
        gaps = [0.0] * len(order)
        if self.is_root:
            for j in range(1, len(local_times)):
                a, b = local_times[j - 1], local_times[j]
                gaps[j] = (b - a) if a is not None and b is not None else 0.0
        self._gaps = gaps

    def _settle_device(self) -> None:
        """Waits until the GPU finished the work queued so far, so that host time is step time."""
        params = self.ddp._params
        if not params or params[0].device.type != "cuda":
            return  # the emulation on CPU tensors: nothing runs ahead
        from .gpu.routing import wait_event

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(params[0].device))
        wait_event(ev, _runtime.state().timeout, "rumor autotune: the previous step on the GPU")

    def before_forward(self) -> None:
        """The wrapper calls this at the start of every training forward: it times the step
        that just ended and, at the end of a trial, agrees on the scores and applies the next
        setting (or the best one, once the budget is spent) on every rank. Collective at trial
        boundaries; does nothing once the search is done."""
        if self.done:
            return
        if self.device:
            self._settle_device()
        now = time.perf_counter()
        self.forwards += 1
        if not self.ddp._rebuilt:
            return  # the first iteration's rebuild is still to come
        if self.started_at is None:
            self._begin(now)
            return
        interval = now - self.last
        self.tuning_s += interval
        self.last = now
        if self.step_in_trial >= self.cfg.warm_steps:
            self.samples.append(interval)
        self.step_in_trial += 1
        if self.step_in_trial == self.cfg.warm_steps + self.cfg.measure_steps:
            self._end_trial()
        self.last = time.perf_counter()  # the decision and the rebuild count as tuning, not as the next step
        self.tuning_s += self.last - now

    def _begin(self, now: float) -> None:
        from .collectives import broadcast_

        n = len(self.ddp._params)
        if self._order is None:  # the algorithm kept its first buckets: no ready order observed
            self._order, self._gaps = list(reversed(range(n))), [0.0] * n
        g = torch.tensor(self._gaps, dtype=torch.float64)
        broadcast_(g, self.root, self.group)
        self._gaps = g.tolist()
        self.started_at = self.forwards
        if self.is_root:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            trials = self.cfg.trials
            sampler = optuna.samplers.TPESampler(seed=self.cfg.seed, n_startup_trials=max(2, min(10, trials // 3)))
            self._study = optuna.create_study(direction="minimize", sampler=sampler)
            self._study.enqueue_trial({k: self.choices[k].index(self.default[k]) for k in self.knobs})
            self._ask()  # trial 0: the enqueued defaults, already in place
        self._next_trial(self._canonical(self.default), kind="trial")
        self.last = time.perf_counter()
        self.tuning_s += self.last - now

    def _best_trial(self, upto: Optional[int] = None) -> int:
        """The lowest-scoring of the first `upto` trials (all by default), or trial 0 (the
        defaults) unless it leads them by min_gain."""
        scores = self._scores[:upto]
        best = min(range(len(scores)), key=lambda i: scores[i])
        return best if scores[best] <= scores[0] * (1 - self.cfg.min_gain) else 0

    def _verdict(self) -> Tuple[int, float, float]:
        """(trial whose setting stays, its step, the defaults' step) once the trials are over:
        the search's best if it led the defaults by min_gain, and, with confirmation trials, led
        them again when both were measured back to back (whose scores are then reported)."""
        s = self.cfg.search_trials
        best = Autotuner._best_trial(self, s)  # (also callable on a stand-in with _scores and cfg)
        if best == 0 or len(self._scores) < s + 2:
            return best, self._scores[best], self._scores[0]
        cand, default = self._scores[s], self._scores[s + 1]
        if cand <= default * (1 - self.cfg.min_gain):
            return best, cand, default
        return 0, default, default

    def _ask(self) -> Dict:
        for _ in range(32):
            trial = self._study.ask()
            # Ordered knobs as an index, so that TPE sees neighbouring values as neighbours.
            setting = {k: self.choices[k][trial.suggest_int(k, 0, len(self.choices[k]) - 1)] for k in self.knobs}
            done = [i for i, s in enumerate(self._settings) if s == self._canonical(setting)]
            if not done:
                break
            # Already measured: tell the sampler its score instead of spending steps on it again.
            self._study.tell(trial, self._scores[done[0]])
        self._trials.append(trial)
        return setting

    def _canonical(self, setting: Dict) -> Dict:
        # What every rank holds after the broadcast (floats, None, bools), for comparisons.
        return self._decode(self._encode(0, setting))

    def _next_trial(self, setting: Dict, kind: str) -> None:
        self.trial += 1
        self.step_in_trial = 0
        self.samples = []
        self._settings.append(setting)
        self.history.append(dict(step=self.forwards, kind=kind, trial=self.trial, setting=setting))

    def _end_trial(self) -> None:
        from .collectives import ReduceOp, allreduce, broadcast_

        worst = allreduce(torch.tensor(self.samples, dtype=torch.float64), op=ReduceOp.MAX, group=self.group)
        score = statistics.median(worst.tolist())
        self._scores.append(score)
        self.history[-1]["score_s"] = score
        # status: 0 a search trial next, 2 a confirmation trial next, 1 done
        status, setting = 0, None
        if self.is_root:
            n, search = len(self._scores), self.cfg.search_trials
            if n <= search:
                self._study.tell(self._trials[-1], score)
            if n < search:
                setting = self._ask()
            elif n == search and search < self.cfg.trials and self._best_trial(search) != 0:
                status, setting = 2, self._settings[self._best_trial(search)]
            elif n == search + 1:
                status, setting = 2, self._settings[0]
            else:
                status, setting = 1, self._settings[self._verdict()[0]]
        t = self._encode(status, setting)
        broadcast_(t, self.root, self.group)
        setting = self._decode(t)
        self._apply(setting, self._order, self._gaps)
        if int(t[0]) != 1:
            self._next_trial(setting, kind="trial" if int(t[0]) == 0 else "confirm")
            return
        self.done = True
        self.history.append(dict(step=self.forwards, kind="final", setting=setting))
        _, step_s, default_s = self._verdict()
        self.best = dict(setting=setting, step_s=step_s, default_step_s=default_s,
                         trials=len(self._scores), tuning_steps=self.forwards - self.started_at,
                         tuning_s=self.tuning_s, source="search")
        if self.is_root:
            record = dict(setting=setting, step_s=step_s, default_step_s=default_s,
                          trials=len(self._scores), budget_steps=self.cfg.budget_steps,
                          torch=torch.__version__, saved=datetime.datetime.now(datetime.timezone.utc).isoformat())
            saved = ""
            if self.cfg.use_cache:
                try:
                    self._write_cache(record)
                    saved = f"; saved to {self.cache_path}"
                except OSError as e:  # tuning worked; only the reuse is lost
                    saved = f"; could not save to {self.cache_path}: {e}"
            if self.cfg.verbose:
                print(f"rumor autotune: {len(self._scores)} trials in {self.forwards - self.started_at} steps "
                      f"({self.tuning_s:.1f} s); step {step_s * 1e3:.1f} ms vs "
                      f"{default_s * 1e3:.1f} ms with the defaults{saved}\n"
                      f"rumor autotune: pass by hand: rumor.DistributedDataParallel(model, "
                      f"{ddp_kwargs(setting, type(self.ddp.algorithm).__name__)})\n"
                      f"rumor autotune: {self._streams_note()}", file=sys.stderr, flush=True)
        self._study = None


def status(ddp: "DistributedDataParallel") -> Optional[Dict]:
    """The autotuner's state for a wrapper (None when autotune is off): done, the settings every
    rank applied and at which training forward (history; identical on every rank), the knobs
    searched, and once done the best setting with its score and the defaults' (best).

    Args:
        ddp: a rumor.DistributedDataParallel.

    Returns:
        A dict with keys done, knobs, key (the cache key), cache (the cache's path), history,
        best, default (the wrapper's own setting) and config (the AutotuneConfig as a dict);
        None when the wrapper does not tune.
    """
    tuner = getattr(ddp, "_autotuner", None)
    if tuner is None:
        return None
    return dict(done=tuner.done, knobs=list(tuner.knobs), key=tuner.key, cache=tuner.cache_path,
                history=[dict(h) for h in tuner.history], best=None if tuner.best is None else dict(tuner.best),
                default=dict(tuner.default), config=asdict(tuner.cfg))
