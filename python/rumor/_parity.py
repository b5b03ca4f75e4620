"""State parity: rumor.elastic.verify() proves that the ranks hold the same training state.

Every rank lists its state as named entries (parameters, buffers, optimizer state and
hyperparameters, the algorithm's state and configuration, the caller's extras), hashes each
entry's raw bytes, and the ranks compare the digests: two allgathers of 16 bytes per entry, not
the state itself. Entries that differ are named with the ranks that differ from the majority;
a repair broadcasts just those tensors from a majority rank and compares again.
"""
from __future__ import annotations

import hashlib
import json
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .errors import RumorError

_DIGEST = 16  # bytes per entry: 2**-128 odds that different contents compare equal
# CUDA tensors reach the host in pieces of this many bytes (one pinned buffer, reused).
_PIECE = 64 << 20
# Tensors at least this large are hashed on worker threads (hashlib releases the GIL for them).
_THREADED_BYTES = 1 << 20


def _hasher():
    # sha256 truncated to 16 bytes rather than blake2b: hashlib's sha256 runs on the CPU's SHA
    # instructions where there are some, measured 1.45 GB/s against blake2b's 0.59 GB/s on one
    # core of the development machine. Either is exact for equality: a difference in any byte
    # changes the digest.
    return hashlib.sha256()


class ParityError(RuntimeError):
    """The replicas differ in a way verify() cannot or may not repair: a different model (names,
    shapes, dtypes), algorithm state or configuration, a plain value, no majority to repair
    from, or a repair that did not make them equal. ``report`` holds the ParityReport.

    Args:
        message: what differs, naming the entries and the ranks.
        report: the ParityReport of the comparison that failed (also ``.report``).
    """

    def __init__(self, message: str, report: "ParityReport"):
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class Mismatch:
    """One entry on which the ranks disagree.

    Attributes:
        name: the entry, e.g. ``param:0.weight``, ``optimizer:state[0.weight].exp_avg``,
            ``algorithm:step``, ``extra:seed``.
        kind: ``"value"`` (same layout, other contents) or ``"layout"`` (another shape or dtype,
            or the entry is missing on some ranks: a different model; never repaired).
        ranks: the (global) ranks that differ from the reference.
        reference: the ranks holding the reference contents (the majority, or the source rank
            the caller named); empty when there is none.
        repairable: whether verify() can repair it by broadcast (tensors of the model, the
            optimizer and the extras whose layout agrees).
        detail: what each rank holds, for layout mismatches (e.g. ``float32[4, 3]``).
    """

    name: str
    kind: str
    ranks: Tuple[int, ...]
    reference: Tuple[int, ...]
    repairable: bool
    detail: str = ""

    def __str__(self) -> str:
        ref = f"reference ranks {list(self.reference)}" if self.reference else "no majority"
        extra = f"; {self.detail}" if self.detail else ""
        return f"{self.name} ({self.kind}): ranks {list(self.ranks)} differ, {ref}{extra}"


@dataclass
class ParityReport:
    """What rumor.elastic.verify() found. ``bool(report)`` is ``report.equal``.

    Attributes:
        equal: whether the replicas agree on return (after a repair, if one was made).
        ranks: the group's global ranks, in group order.
        replicas: ``"identical"`` (every value compared) or ``"differ"`` (floating-point
            contents of the model and the optimizer compared by layout only, see verify()).
        entries: how many entries were compared.
        bytes_hashed: the bytes this rank hashed (the last comparison).
        seconds: this rank's time in verify(), repair included.
        mismatches: what the first comparison found (empty when the replicas agreed).
        repaired: the names of the entries re-sent from the reference rank.
    """

    equal: bool
    ranks: Tuple[int, ...]
    replicas: str
    entries: int
    bytes_hashed: int
    seconds: float = 0.0
    mismatches: List[Mismatch] = field(default_factory=list)
    repaired: List[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.equal

    def __str__(self) -> str:
        head = (f"rumor.elastic.verify: {self.entries} entries on ranks {list(self.ranks)} "
                f"({self.replicas} replicas): {'equal' if self.equal else 'NOT equal'}")
        lines = [head] + [f"  {m}" for m in self.mismatches]
        if self.repaired:
            lines.append(f"  repaired from the reference: {', '.join(self.repaired)}")
        return "\n".join(lines)


# ---- the entries ---------------------------------------------------------------------------------

@dataclass
class _Entry:
    name: str
    value: Any            # a tensor or a plain value
    compare: bool         # the contents are compared (else the layout alone)
    repairable: bool      # a tensor a broadcast may overwrite


def _layout(v) -> str:
    if torch.is_tensor(v):
        return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
    return type(v).__name__


def _flatten(prefix: str, v, out: List[Tuple[str, Any]], own: Sequence[str], depth: int = 0) -> None:
    """Nested dicts, lists and tuples into (path, leaf) pairs; keys listed in own are left out."""
    if depth > 50:
        raise ValueError(f"rumor.elastic.verify: {prefix} is nested more than 50 deep")
    if isinstance(v, dict):
        for k in v:
            if k in own:
                continue
            sep = "" if not prefix or prefix.endswith(":") else "."
            _flatten(f"{prefix}{sep}{k}", v[k], out, own, depth + 1)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _flatten(f"{prefix}[{i}]", x, out, own, depth + 1)
    else:
        out.append((prefix, v))


def _algorithm_config(algo) -> Dict[str, Any]:
    """The configuration every rank must share: the algorithm's type and its constructor's
    arguments as the algorithm stores them under their own names (plain values only)."""
    import inspect

    cfg: Dict[str, Any] = {"type": f"{type(algo).__module__}.{type(algo).__qualname__}"}
    try:
        params = inspect.signature(type(algo).__init__).parameters
    except (TypeError, ValueError):
        return cfg
    for name in params:
        if name == "self" or not hasattr(algo, name):
            continue
        try:
            v = getattr(algo, name)
        except Exception:  # noqa: BLE001 - a property that cannot be read now is not configuration
            continue
        if v is None or isinstance(v, (bool, int, float, str)):
            cfg[name] = v
    return cfg


def _leaf(name: str, v, compare: bool) -> _Entry:
    """An entry of the optimizer's state: a value verify cannot hash (an object some optimizer
    keeps there) is compared by its type alone rather than refused."""
    if torch.is_tensor(v):
        return _Entry(name, v.detach(), compare, True)
    return _Entry(name, v, compare and comparable(v), False)


def _entries(module, optimizer, algorithm, extra, differ: bool) -> List[_Entry]:
    out: List[_Entry] = []
    for n, p in module.named_parameters():
        out.append(_Entry(f"param:{n}", p.detach(), not (differ and p.is_floating_point()), True))
    for n, b in module.named_buffers():
        out.append(_Entry(f"buffer:{n}", b.detach(), not (differ and b.is_floating_point()), True))
    own = tuple(getattr(algorithm, "parity_own_keys", ())) if algorithm is not None else ()
    if optimizer is not None:
        names = {id(p): n for n, p in module.named_parameters()}
        k = 0
        for gi, g in enumerate(optimizer.param_groups):
            for key in g:
                if key == "params":
                    continue
                leaves: List[Tuple[str, Any]] = []
                _flatten(f"optimizer:param_groups[{gi}].{key}", g[key], leaves, ())
                out += [_leaf(n, v, True) for n, v in leaves]
            for p in g["params"]:
                st = optimizer.state.get(p)
                pname = names.get(id(p), str(k))
                k += 1
                if not st:
                    continue
                for key in st:
                    if key in own:
                        continue
                    leaves = []
                    _flatten(f"optimizer:state[{pname}].{key}", st[key], leaves, ())
                    for n, v in leaves:
                        # Floating-point state of replicas that differ (momenta) differs with
                        # them; the step counters do not.
                        layout_only = differ and torch.is_tensor(v) and v.is_floating_point() and key != "step"
                        out.append(_leaf(n, v, not layout_only))
    if algorithm is not None:
        leaves = []
        _flatten("algorithm:config", _algorithm_config(algorithm), leaves, ())
        if hasattr(algorithm, "elastic_state_dict"):
            _flatten("algorithm:", algorithm.elastic_state_dict(), leaves, own)
        for n, v in leaves:  # compared, never re-sent (a rank out of step is no corrupted tensor)
            e = _leaf(n, v, True)
            e.repairable = False
            out.append(e)
    if extra is not None:
        if not isinstance(extra, dict):
            raise TypeError(f"rumor.elastic.verify: extra must be a dict of name -> tensor or plain value, "
                            f"got {type(extra).__name__}")
        for key, v in extra.items():
            leaves = []
            _flatten(f"extra:{key}", v, leaves, ())
            out += [_Entry(n, v.detach() if torch.is_tensor(v) else v, True, torch.is_tensor(v)) for n, v in leaves]
    return out


# ---- hashing -------------------------------------------------------------------------------------

def _plain_bytes(v, where: str) -> bytes:
    """Exact bytes of a plain leaf: floats by their IEEE bits (so -0.0 != 0.0, NaN payloads count)."""
    if v is None:
        return b"N"
    if isinstance(v, bool):
        return b"B1" if v else b"B0"
    if isinstance(v, int):
        return b"I" + str(v).encode()
    if isinstance(v, float):
        return b"F" + struct.pack("<d", v)
    if isinstance(v, complex):
        return b"C" + struct.pack("<dd", v.real, v.imag)
    if isinstance(v, str):
        return b"S" + v.encode("utf-8", "surrogatepass")
    if isinstance(v, (bytes, bytearray)):
        return b"Y" + bytes(v)
    if isinstance(v, (torch.dtype, torch.device, torch.Size)):
        return b"T" + str(v).encode()
    if isinstance(v, (set, frozenset)):
        return b"E" + b"|".join(sorted(_plain_bytes(x, where) for x in v))
    raise TypeError(f"rumor.elastic.verify: {where} is a {type(v).__module__}.{type(v).__qualname__}; "
                    "verify compares tensors and plain values (None, bool, int, float, complex, str, bytes, "
                    "sets, and dicts, lists and tuples of them)")


def comparable(v, depth: int = 0) -> bool:
    """Whether verify() can compare v: a strided tensor or a plain value, or dicts, lists and
    tuples of them."""
    if depth > 50:
        return False
    if torch.is_tensor(v):
        return v.layout == torch.strided
    if isinstance(v, dict):
        return all(comparable(x, depth + 1) for x in v.values())
    if isinstance(v, (list, tuple)):
        return all(comparable(x, depth + 1) for x in v)
    try:
        _plain_bytes(v, "")
    except TypeError:
        return False
    return True


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """The logical contents of t, row-major, as a flat uint8 tensor (a view where t allows it):
    the same values give the same bytes whatever the strides."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class _Hasher:
    def __init__(self):
        self._pinned: Optional[torch.Tensor] = None
        self.bytes = 0

    def _staging(self, n: int) -> torch.Tensor:
        if self._pinned is None or self._pinned.numel() < n:
            size = min(_PIECE, max(n, 1 << 20))
            try:
                self._pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # no CUDA runtime to pin with: pageable memory does as well
                self._pinned = torch.empty(size, dtype=torch.uint8)
        return self._pinned

    def tensor(self, t: torch.Tensor, where: str) -> bytes:
        if t.is_sparse or t.layout != torch.strided:
            raise TypeError(f"rumor.elastic.verify: {where} is a {t.layout} tensor; verify compares strided tensors")
        if t.is_meta:  # no contents: the layout is all there is to compare
            return _hasher().digest()[:_DIGEST]
        raw = _host_bytes(t)
        h = _hasher()
        n = raw.numel()
        self.bytes += n
        if raw.device.type == "cpu":
            if n:
                h.update(memoryview(raw.numpy()))
        else:
            for off in range(0, n, _PIECE):
                m = min(_PIECE, n - off)
                buf = self._staging(m)[:m]
                buf.copy_(raw[off:off + m])
                h.update(memoryview(buf.numpy()))
        return h.digest()[:_DIGEST]

    def entry(self, e: _Entry) -> bytes:
        if torch.is_tensor(e.value):
            return self.tensor(e.value, e.name)
        h = _hasher()
        b = _plain_bytes(e.value, e.name)
        self.bytes += len(b)
        h.update(b)
        return h.digest()[:_DIGEST]


def _threads() -> int:
    """Hashing threads for this rank: its share of the cores this process may run on (the host's
    ranks hash at once; more threads than cores only contend), at most 8."""
    import os

    from . import _runtime

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    local = _runtime.local_size() if _runtime.is_initialized() else 1
    return max(1, min(8, cores // max(1, local)))


def _digests(entries: List[_Entry]) -> Tuple[torch.Tensor, int]:
    """[len(entries), 2] int64: each compared entry's 16-byte digest (zeros for layout-only
    entries), and the bytes hashed. Large CPU tensors are hashed on threads."""
    out = torch.zeros(len(entries), _DIGEST // 8, dtype=torch.int64)
    hasher = _Hasher()
    big = [i for i, e in enumerate(entries) if e.compare and torch.is_tensor(e.value) and e.value.device.type == "cpu"
           and e.value.numel() * e.value.element_size() >= _THREADED_BYTES]
    threaded = set(big)
    rest = [i for i, e in enumerate(entries) if e.compare and i not in threaded]
    results: Dict[int, bytes] = {}
    if big:
        workers = min(len(big), _threads())
        counters = [_Hasher() for _ in big]

        def one(job):
            i, h = job
            return h.tensor(entries[i].value, entries[i].name)

        with ThreadPoolExecutor(workers, thread_name_prefix="rumor-verify") as pool:
            results.update(zip(big, pool.map(one, zip(big, counters))))
        hasher.bytes += sum(c.bytes for c in counters)
    for i in rest:
        results[i] = hasher.entry(entries[i])
    for i, d in results.items():
        out[i] = torch.frombuffer(bytearray(d), dtype=torch.int64)
    return out, hasher.bytes


# ---- comparing across the group -------------------------------------------------------------------

def _layout_signature(entries: List[_Entry]) -> bytes:
    return json.dumps([(e.name, _layout(e.value), e.compare) for e in entries]).encode()


def _gather_bytes(data: bytes, group) -> List[bytes]:
    from . import collectives

    mine = torch.tensor([[len(data)]], dtype=torch.int64)
    lengths = [int(x) for x in collectives.allgather(mine, group).reshape(-1)]
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    every = collectives.allgather(payload, group)
    out, off = [], 0
    for n in lengths:
        out.append(every[off:off + n].numpy().tobytes())
        off += n
    return out


def _layout_mismatches(layouts: List[bytes], ranks: Sequence[int]) -> List[Mismatch]:
    per_rank = [{name: (lay, cmp) for name, lay, cmp in json.loads(b)} for b in layouts]
    names: List[str] = []
    seen = set()
    for d in per_rank:
        for k in d:
            if k not in seen:
                seen.add(k)
                names.append(k)
    out = []
    for name in names:
        held = [d[name][0] if name in d else "missing" for d in per_rank]
        if len(set(held)) == 1:
            continue
        ref_value, ref = _majority(held, ranks)
        differ = tuple(r for r, h in zip(ranks, held) if ref_value is None or h != ref_value)
        groups: Dict[str, List[int]] = {}
        for r, h in zip(ranks, held):
            groups.setdefault(h, []).append(r)
        detail = ", ".join(f"{h} on rank{'s' if len(rs) > 1 else ''} {rs}" for h, rs in groups.items())
        out.append(Mismatch(name, "layout", differ, ref, False, detail))
    return out


def _majority(held: Sequence, ranks: Sequence[int], source: Optional[int] = None):
    """(the reference value, the ranks holding it): the source's when one was named, else the
    value more than half the ranks hold, else (None, ())."""
    if source is not None:
        ref_value = held[list(ranks).index(source)]
    else:
        counts: Dict[Any, int] = {}
        for h in held:
            counts[h] = counts.get(h, 0) + 1
        best = max(counts.items(), key=lambda kv: kv[1])
        if 2 * best[1] <= len(held):
            return None, ()
        ref_value = best[0]
    return ref_value, tuple(r for r, h in zip(ranks, held) if h == ref_value)


def _value_mismatches(entries: List[_Entry], every: torch.Tensor, ranks: Sequence[int],
                      source: Optional[int]) -> List[Mismatch]:
    """every: [group size, entries, 2] digests."""
    differs = (every != every[0:1]).any(dim=2).any(dim=0)
    out = []
    for i in differs.nonzero().flatten().tolist():
        held = [tuple(every[j, i].tolist()) for j in range(every.shape[0])]
        ref_value, ref = _majority(held, ranks, source)
        bad = tuple(r for r, h in zip(ranks, held) if ref_value is None or h != ref_value)
        out.append(Mismatch(entries[i].name, "value", bad, ref, entries[i].repairable))
    return out


def _compare(entries: Optional[List[_Entry]], group, ranks, source,
             failed: Optional[BaseException] = None) -> Tuple[List[Mismatch], int]:
    """Collective: the mismatches across the group, and the bytes this rank hashed. A rank whose
    own entries could not be made (failed) still takes part in the first exchange, so that every
    rank raises at once instead of its peers waiting for it until their deadline."""
    from . import collectives

    sig, digests, nbytes = b"", None, 0
    if failed is None:
        try:  # hashed before the first exchange: a value only this rank cannot hash fails here too
            sig = _layout_signature(entries)
            digests, nbytes = _digests(entries)
        except (TypeError, ValueError) as e:
            failed = e
    sig_digest = torch.frombuffer(bytearray(hashlib.sha256(sig).digest()), dtype=torch.int64).reshape(1, -1)
    row = torch.cat([torch.tensor([[int(failed is not None)]], dtype=torch.int64), sig_digest], dim=1)
    sigs = collectives.allgather(row, group)
    if bool(sigs[:, 0].any()):
        _raise_local_failures(failed, [int(f) for f in sigs[:, 0]], group, ranks)
    sigs = sigs[:, 1:]
    if not bool((sigs == sigs[0:1]).all()):
        return _layout_mismatches(_gather_bytes(sig, group), ranks), 0
    every = collectives.allgather(digests.reshape(1, -1), group).reshape(len(ranks), len(entries), -1)
    return _value_mismatches(entries, every, ranks, source), nbytes


def _raise_local_failures(failed: Optional[BaseException], flags: List[int], group, ranks) -> None:
    """Every rank raises: a rank that failed its own error, the others the first failed rank's
    error text, naming that rank, as the same type where it is TypeError or ValueError."""
    text = f"{type(failed).__name__}: {failed}" if failed is not None else ""
    texts = _gather_bytes(text.encode(), group)
    if failed is not None:
        raise failed
    first = flags.index(1)
    kind, _, message = texts[first].decode(errors="replace").partition(": ")
    others = [r for r, f in zip(ranks, flags) if f][1:]
    more = f" (and ranks {others} failed too)" if others else ""
    err_type = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RumorError)
    raise err_type(f"rumor.elastic.verify: rank {ranks[first]} could not take part{more}: {kind}: {message}")


def _broadcast_into(t: torch.Tensor, root: int, group) -> None:
    """Overwrites t with root's t, byte for byte (any dtype; a strided t through a copy)."""
    from . import collectives

    with torch.no_grad():
        flat = t if t.is_contiguous() and not t.is_conj() and not t.is_neg() else t.contiguous()
        raw = flat.reshape(-1).view(torch.uint8)
        if raw.numel():
            collectives.broadcast_(raw, root, group)
        if flat is not t:
            t.copy_(flat)


def _unwrap(model):
    from .parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module, model.algorithm, model.group
    return model, None, None


def _replicas_mode(replicas: str, algorithm) -> str:
    if replicas not in ("auto", "identical", "differ"):
        raise ValueError(f"rumor.elastic.verify: replicas must be 'auto', 'identical' or 'differ', got {replicas!r}")
    if replicas != "auto":
        return replicas
    return "differ" if getattr(algorithm, "elastic_consensus", False) else "identical"


def verify(model, optimizer=None, *, extra: Optional[Dict[str, Any]] = None, repair: bool = True,
           source: Optional[int] = None, replicas: str = "auto", group=None) -> ParityReport:
    """Collective: proves that every rank of the group holds the same training state, and
    repairs what differs from the majority.

    Every rank hashes its replica's state entry by entry (the raw bytes of each tensor, every
    dtype: a one-ulp change, another NaN payload or -0.0 against 0.0 all differ; strided tensors
    by their logical contents; CUDA tensors through the host in 64 MiB pieces) and the ranks
    compare the 16-byte digests with two allgathers. The entries: the model's parameters and
    buffers, the optimizer's state and its param_groups' hyperparameters, the algorithm's
    configuration (its type and constructor arguments) and state (its elastic_state_dict()),
    and ``extra``.

    Which contents must agree depends on the algorithm (``replicas="auto"``):

    - GradientAllReduce, ByteGrad, QSGD, LowPrecision, PowerSGD, OneBitAdamAlgorithm (every rank
      ends a step with the same weights): everything, values included. Error feedback is each
      rank's own and is not compared (PowerSGD keeps it outside its elastic state; 1-bit Adam's
      ``worker_error``/``server_error`` optimizer state is named by the algorithm's
      ``parity_own_keys``).
    - Decentralized, LowPrecisionDecentralized, AsyncModelAverage, LocalSGD, DiLoCo (their
      ``elastic_consensus`` is set: the replicas legitimately differ, between outer syncs for
      the local-step ones): the floating-point contents of the parameters, the buffers and the
      optimizer state are compared by name, shape and dtype only; their integer tensors, the
      optimizer's ``step`` counters, the hyperparameters, the algorithm's state (step and round
      counters; DiLoCo's outer parameters and outer optimizer, which are shared) and
      configuration are compared by value.
    - A plain module (no DistributedDataParallel): everything, unless ``replicas="differ"``,
      which a model trained with BlueFog-style neighbor operations (rumor.neighbor) passes.

    A mismatch of names, shapes or dtypes (a replica of another model) is reported as
    ``kind="layout"`` and never repaired. With ``repair``, the tensors of the model, the
    optimizer and ``extra`` that differ are broadcast from the lowest rank of the majority (or
    from ``source``), then everything is compared again.

    Args:
        model: the torch.nn.Module, or its rumor DistributedDataParallel wrapper (whose
            algorithm and group are then used).
        optimizer: the torch.optim.Optimizer whose state is compared; None (the default) for none.
        extra: a dict of the caller's tensors and plain values (None, bool, int, float, str,
            bytes, and lists, tuples and dicts of them) to compare as well; tensors in it are
            repaired in place. None (the default) for none.
        repair: if True (the default), re-send what differs from the reference and verify again;
            raise ParityError where that is impossible. False only reports.
        source: the global rank whose state is the reference, overriding the majority (needed
            to repair two ranks that differ); None (the default): the majority, more than half
            the group's ranks.
        replicas: ``"auto"`` (the default, by the algorithm as above), ``"identical"`` or
            ``"differ"``.
        group: the rumor.Group to verify over; None (the default) means the wrapper's group, or
            every rank for a plain module.

    Returns:
        A ParityReport: ``equal`` on return, the ``mismatches`` found (entry names and the
        ranks that differ from the reference) and what was ``repaired``.

    Raises:
        ParityError: with ``repair``: a layout mismatch (another model), a mismatch of the
            algorithm's state or configuration or of a plain value, an entry with no majority
            and no ``source``, or replicas still unequal after the repair. The message names the
            entries and the ranks; ``.report`` holds the report.
        TypeError: model is not a module, or an entry holds a value verify cannot compare.
        ValueError: an unknown ``replicas`` or a ``source`` outside the group.
        CommTimeoutError, PeerError: a rank of the group did not take part.
    """
    from . import _runtime

    t0 = time.perf_counter()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"rumor.elastic.verify: model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"rumor.elastic.verify: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    module, algorithm, ddp_group = _unwrap(model)
    if group is None:
        group = ddp_group
    ranks = tuple(group.ranks) if group is not None else tuple(range(_runtime.size()))
    entries, failed = None, None
    try:
        mode = _replicas_mode(replicas, algorithm)
        if source is not None and (isinstance(source, bool) or not isinstance(source, int) or source not in ranks):
            raise ValueError(f"rumor.elastic.verify: source must be a rank of the group {list(ranks)}, got {source!r}")
        entries = _entries(module, optimizer, algorithm, extra, mode == "differ")
    except (TypeError, ValueError) as e:
        failed = e  # raised by _compare on every rank, after telling the others
    found, nbytes = _compare(entries, group, ranks, source, failed)
    report = ParityReport(not found, ranks, mode, len(entries), nbytes, mismatches=found)
    if found and repair:
        _repair(entries, found, group, report)
        again, nbytes = _compare(entries, group, ranks, source)
        report.bytes_hashed = nbytes
        if again:
            report.equal = False
            raise ParityError("rumor.elastic.verify: the replicas still differ after the repair: "
                              + "; ".join(map(str, again)), report)
        report.equal = True
    report.seconds = time.perf_counter() - t0
    return report


def _repair(entries: List[_Entry], found: List[Mismatch], group, report: ParityReport) -> None:
    """Broadcasts each repairable mismatch from its reference rank; raises ParityError first,
    repairing nothing, when any mismatch cannot be repaired. Every rank computed the same
    mismatches from the same gathered digests, so all broadcast the same tensors in order."""
    layout = [m for m in found if m.kind == "layout"]
    if layout:
        raise ParityError(
            "rumor.elastic.verify: the replicas are of different models (names, shapes or dtypes differ), "
            "which a repair must not paper over; nothing was repaired: " + "; ".join(map(str, layout)), report)
    orphans = [m for m in found if not m.reference]
    if orphans:
        raise ParityError(
            "rumor.elastic.verify: no majority to repair from (a repair needs more than half the ranks to agree, "
            "or source= naming the rank to copy); nothing was repaired: " + "; ".join(map(str, orphans)), report)
    fixed = [m for m in found if not m.repairable]
    if fixed:
        raise ParityError(
            "rumor.elastic.verify: these differ and are not tensors of the model, the optimizer or extra, "
            "which is all a repair re-sends (a rank out of step or configured differently); nothing was "
            "repaired: " + "; ".join(map(str, fixed)), report)
    by_name = {e.name: e for e in entries}
    for m in found:
        _broadcast_into(by_name[m.name].value, m.reference[0], group)
        report.repaired.append(m.name)


__all__: List[str] = []  # public through rumor.elastic
