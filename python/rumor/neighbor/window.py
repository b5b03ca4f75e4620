"""One-sided window operations with BlueFog's names and semantics (csrc/comm/window.h).

A window is created collectively from a tensor under a name. Each rank then owns one receive
slot per other rank and a published copy of its own tensor; other ranks write into its slots
(``win_put`` overwrites, ``win_accumulate`` adds) or read its published copy (``win_get``)
without any call on its side: peers on the same host write straight into its shared memory, and
remote peers' frames are applied by its communication thread. ``win_update`` combines
``x <- self_weight * x + sum_j w_j * slot_j`` into the registered tensor. Every slot access holds
the slot's lock, so a combined tensor is never torn and accumulates are atomic per slot.

Differences from BlueFog, on purpose:

* a put/accumulate/get completes when the target *applied* it (acknowledged), so a put followed
  by a barrier is visible to the target's next ``win_update``;
* ``win_get`` reads the value the owner last *published*: at ``win_create``, after every in-place
  ``win_update``, after ``win_put``/``win_accumulate`` of the registered tensor itself, and on
  ``win_publish(name)``. (BlueFog read the live tensor, which could be torn mid-update.)
* ``dst_weights``/``src_weights``/``neighbor_weights`` may name any other rank (dynamic
  topologies); without them the static topology's neighbours are used.
* the push-sum weight p of ``turn_on_win_ops_with_associated_p()`` travels with every put and
  accumulate (w * p), is scaled by ``self_weight`` with the tensor, and is combined by
  ``win_update``, so the sums of x and of p over all ranks and slots are preserved.

CUDA tensors are staged (docs/gpu.md): the window's memory is a page-locked host twin of the
registered tensor, which every operation that reads the tensor (a put of it, win_update,
win_publish) first refreshes from the device (a copy waited for with rumor's deadline), and
win_update's result is copied back on the current stream; a put of another CUDA tensor goes
through a page-locked copy of it. Slots, locks and the wire are those of CPU windows.
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from .. import _C, _runtime
from .._tensor import address, check_dense, check_tensor, dtype_code
from .ops import LIVE_WHERE, _topologies, in_neighbor_ranks, out_neighbor_ranks

__all__ = [
    "win_create",
    "win_free",
    "win_put",
    "win_put_nonblocking",
    "win_accumulate",
    "win_accumulate_nonblocking",
    "win_get",
    "win_get_nonblocking",
    "win_update",
    "win_update_then_collect",
    "win_publish",
    "win_poll",
    "win_wait",
    "win_mutex",
    "get_win_version",
    "get_current_created_window_names",
    "win_associated_p",
    "turn_on_win_ops_with_associated_p",
    "turn_off_win_ops_with_associated_p",
    "WinHandle",
]

_FLOAT_CODES = {0, 1, 2, 3}
# Tests only: stage CPU tensors through a twin as CUDA ones are (the staging logic on any machine).
_STAGE_CPU = False


@dataclass
class _Win:
    id: int
    name: str
    tensor: torch.Tensor
    code: int
    handles: List["WinHandle"] = field(default_factory=list)
    twin: Optional[torch.Tensor] = None  # the window's host memory when the tensor is staged


def _stages(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or _STAGE_CPU


def _check(t, what: str) -> int:
    """check_tensor for the window ops: CPU tensors, and CUDA ones on this rank's device."""
    if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}: the tensor is on {t.device}; windows take CPU or CUDA tensors")
    if isinstance(t, torch.Tensor) and t.device.type == "cuda":
        from ..gpu import routing

        check_dense(t, what)
        routing.route(what, None, ("tensor", t), collective=False)  # the rank's device, or a clear error
        return dtype_code(t.dtype, what)
    return check_tensor(t, what)


def _host_like(t: torch.Tensor) -> torch.Tensor:
    from ..gpu.staging import host_like

    return host_like(t)


def _to_host(src: torch.Tensor, dst: torch.Tensor, what: str) -> torch.Tensor:
    """dst <- src, complete when this returns (the C++ side reads dst from the host)."""
    from ..gpu.staging import to_host

    return to_host(src, dst, what, _timeout())


class _Windows:
    """The windows of one rumor.init() (kept on the runtime state, so shutdown drops them)."""

    def __init__(self, ctx):
        self.hub = _C.WindowHub(ctx)
        self.by_name: Dict[str, _Win] = {}
        self.next_id = 1
        self.with_p = False
        # name -> why: windows of an earlier live membership epoch (neighbor.ops.restore_neighbors)
        self.gone: Dict[str, str] = {}


def registry() -> _Windows:
    st = _runtime.state()
    w = getattr(st, "_rumor_windows", None)
    if w is None:
        w = _Windows(st.ctx)
        st._rumor_windows = w
    return w


def carry_windows() -> Optional[Tuple[List[str], int]]:
    """The names of the current rumor.init()'s windows and its world size, or None without any:
    a live membership change drops them with the old world (restore_windows)."""
    st = _runtime.state()
    ws = getattr(st, "_rumor_windows", None)
    if ws is None or not ws.by_name:
        return None
    return sorted(ws.by_name), st.env.size


def restore_windows(carry: Optional[Tuple[List[str], int]]) -> None:
    """In the next live epoch: a use of a window of the old world raises, saying why, until a
    window of that name is created again."""
    if carry is None:
        return
    names, size = carry
    registry().gone = {n: (f"window {n!r} was created before the membership changed (a world of {size} ranks) "
                           f"and is gone with that world; create windows in {LIVE_WHERE}") for n in names}


def _timeout() -> float:
    return _runtime.state().timeout


def find_window(name: str, what: str) -> _Win:
    ws = registry()
    if not isinstance(name, str):
        raise TypeError(f"{what}: name must be a str, got {type(name).__name__}")
    w = ws.by_name.get(name)
    if w is None and name in ws.gone:
        raise ValueError(f"{what}: {ws.gone[name]}")
    if w is None:
        known = sorted(ws.by_name)
        raise ValueError(f"{what}: no window named {name!r} (created: {known}); call rumor.win_create first")
    return w


def _check_like(t: torch.Tensor, w: _Win, what: str) -> None:
    code = _check(t, what)
    if t.device != w.tensor.device:
        raise ValueError(f"{what}: window {w.name!r} was created from a tensor on {w.tensor.device}, got one on "
                         f"{t.device}")
    if code != w.code or t.numel() != w.tensor.numel():
        raise ValueError(f"{what}: window {w.name!r} holds {w.tensor.numel()} elements of {w.tensor.dtype}, "
                         f"got {t.numel()} of {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: the tensor must be contiguous")


def _weights(weights, default: List[int], what: str, arg: str) -> Dict[int, float]:
    me, n = _runtime.rank(), _runtime.size()
    if weights is None:
        return {r: 1.0 for r in default}
    if not isinstance(weights, dict):
        raise TypeError(f"{what}: {arg} must be a dict {{rank: weight}}, got {type(weights).__name__}")
    out = {}
    for r, wt in weights.items():
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"{what}: {arg} keys must be int ranks, got {r!r}")
        if not 0 <= r < n:
            raise ValueError(f"{what}: rank {r} in {arg} is outside the world of size {n}")
        if r == me:
            raise ValueError(f"{what}: {arg} names this rank ({me}); use self_weight for it")
        out[r] = float(wt)
    return out


class WinHandle:
    """What a *_nonblocking window call returns: wait() blocks until the targets applied the
    operation (then scales the tensor by self_weight), poll() tells whether it is done.

    Made by the nonblocking window calls, not by users.

    Args:
        win: the window the operation acts on.
        op: the C++ core's operation (None when nothing was sent).
        tensor: the tensor to scale by self_weight when done, or None.
        self_weight: the factor applied to tensor on completion.
        with_p: whether the push-sum weight p travels with the operation.
        publish: whether the operation publishes the window's value (win_get's source).
    """

    def __init__(self, win: _Win, op, tensor: Optional[torch.Tensor], self_weight: float, with_p: bool,
                 publish: bool):
        self._win = win
        self._op = op
        self._tensor = tensor  # kept alive: the C++ side reads it until the op completes
        self._keep = None  # a staged tensor's host copy, which the C++ side reads instead
        self._self_weight = self_weight
        self._with_p = with_p
        self._publish = publish
        self._done = False

    def poll(self) -> bool:
        """Whether the targets applied the operation, without waiting.

        Returns:
            A bool.
        """
        return self._done or self._op.done()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the targets applied the operation, then scales the tensor by self_weight.

        Args:
            timeout: the most seconds to wait; None (the default) means rumor's timeout.

        Returns:
            True.

        Raises:
            CommTimeoutError: the targets did not answer in time.
        """
        if self._done:
            return True
        ws = registry()
        try:
            ws.hub.wait(self._op, timeout if timeout is not None else _timeout())
        finally:
            if self in self._win.handles:
                self._win.handles.remove(self)
        self._done = True
        if self._tensor is not None and self._self_weight != 1.0:
            with torch.no_grad():
                self._tensor.mul_(self._self_weight)
            if self._with_p:
                ws.hub.set_p(self._win.id, ws.hub.p(self._win.id) * self._self_weight)
        if self._publish:
            if self._win.twin is not None:  # publish the scaled value, not the one sent
                _to_host(self._win.tensor, self._win.twin, "rumor.win_put")
            ws.hub.publish(self._win.id, _timeout())
        self._tensor = self._keep = None
        return True


def win_poll(handle: WinHandle) -> bool:
    """Whether a nonblocking window operation finished, without waiting.

    Args:
        handle: a WinHandle.

    Returns:
        A bool.
    """
    return handle.poll()


def win_wait(handle: WinHandle) -> bool:
    """Waits for a nonblocking window operation (handle.wait()).

    Args:
        handle: a WinHandle.

    Returns:
        True.
    """
    return handle.wait()


def _fingerprint(name: str, numel: int, code: int) -> int:
    h = hashlib.sha256(f"{name}|{numel}|{code}".encode()).digest()
    return int.from_bytes(h[:7], "little")


def win_create(tensor: torch.Tensor, name: str, zero_init: bool = False) -> bool:
    """Creates the window `name` over `tensor` (collective: every rank, same name, size and dtype).

    The slots start as copies of this rank's tensor, or zeros with zero_init. The tensor itself
    is the window's value: win_update writes into it. Returns True."""
    what = "rumor.win_create"
    code = _check(tensor, what)
    if code not in _FLOAT_CODES:
        raise TypeError(f"{what}: windows hold float32, float64, float16 or bfloat16, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: the tensor must be contiguous (win_update writes into it)")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what}: name must be a non-empty str")
    ws = registry()
    if name in ws.by_name:
        raise ValueError(f"{what}: a window named {name!r} already exists; win_free it first")
    from ..collectives import allgather

    world = _runtime.state().world
    mine = torch.tensor([_fingerprint(name, tensor.numel(), code), tensor.numel(), code], dtype=torch.int64)
    every = allgather(mine, group=world).view(-1, 3)
    bad = [r for r in range(every.shape[0]) if not torch.equal(every[r], every[0])]
    if bad:
        raise ValueError(f"{what}: ranks disagree on window {name!r}: rank 0 has {int(every[0, 1])} elements "
                         f"of dtype code {int(every[0, 2])}, rank(s) {bad} another name, size or dtype")
    wid = ws.next_id
    ws.next_id += 1
    t = _timeout()
    twin = _to_host(tensor, _host_like(tensor), what) if _stages(tensor) else None
    ws.hub.create(wid, name, address(tensor if twin is None else twin), tensor.numel(), code, bool(zero_init), t)
    world._comm.barrier(False)
    ws.hub.attach(wid, t)
    world._comm.barrier(False)
    ws.hub.seal(wid)
    ws.by_name[name] = _Win(wid, name, tensor, code, twin=twin)
    ws.gone.pop(name, None)
    return True


def win_free(name: Optional[str] = None) -> bool:
    """Frees the window `name`, or every window (collective). This rank's nonblocking operations
    on it are waited for first; a barrier then makes sure no peer still writes to it."""
    ws = registry()
    wins = list(ws.by_name.values()) if name is None else [find_window(name, "rumor.win_free")]
    for w in wins:
        for h in list(w.handles):
            h.wait()
    _runtime.state().world._comm.barrier(False)
    for w in wins:
        ws.hub.free(w.id, _timeout())
        del ws.by_name[w.name]
    return True


def get_current_created_window_names() -> List[str]:
    """The names of the windows this rank created and has not freed.

    Returns:
        A sorted list of str.
    """
    return sorted(registry().by_name)


def _put(tensor, name, self_weight, dst_weights, require_mutex, accumulate: bool, what: str) -> WinHandle:
    w = find_window(name, what)
    _check_like(tensor, w, what)
    dsts = _weights(dst_weights, out_neighbor_ranks(), what, "dst_weights")
    sw = 1.0 if self_weight is None else float(self_weight)
    ws = registry()
    publish = tensor.data_ptr() == w.tensor.data_ptr()
    src = tensor
    if w.twin is not None:  # the registered tensor's twin, refreshed, or a host copy of another one
        src = _to_host(tensor, w.twin if publish else _host_like(tensor), what)
    op = ws.hub.put(w.id, address(src), sorted(dsts.items()), accumulate, ws.with_p, bool(require_mutex),
                    _timeout())
    h = WinHandle(w, op, tensor, sw, ws.with_p, publish)
    h._keep = src
    w.handles.append(h)
    return h


def put_registered(w: _Win, dsts, accumulate: bool, with_p: bool, what: str):
    """hub.put of the window's own tensor (push-sum's z), through its twin when staged;
    returns (op, what the C++ side reads until the op completes)."""
    src = w.tensor if w.twin is None else _to_host(w.tensor, w.twin, what)
    return registry().hub.put(w.id, address(src), sorted(dsts.items()), accumulate, with_p, False, _timeout()), src


def update_registered(w: _Win, self_weight: float, srcs, reset: bool, with_p: bool, what: str) -> None:
    """In-place hub.update of the window's own tensor, through its twin when staged."""
    hub = registry().hub
    if w.twin is None:
        hub.update(w.id, self_weight, sorted(srcs.items()), reset, with_p, address(w.tensor), False, _timeout())
        return
    _to_host(w.tensor, w.twin, what)
    hub.update(w.id, self_weight, sorted(srcs.items()), reset, with_p, address(w.twin), False, _timeout())
    w.tensor.copy_(w.twin, non_blocking=w.tensor.device.type == "cuda")


def win_put_nonblocking(tensor: torch.Tensor, name: str, self_weight: Optional[float] = None,
                        dst_weights: Optional[Dict[int, float]] = None, require_mutex: bool = False) -> WinHandle:
    """Starts writing dst_weights[j] * tensor into rank j's slot for this rank (default: every
    out-neighbour, weight 1); wait() then scales tensor by self_weight (default 1). The tensor
    must not change until then.

    Args:
        tensor: the value to write; must not change until the handle is waited.
        name: the window's name, as given to win_create.
        self_weight: after the write, tensor is scaled by it; None (the default) means 1.
        dst_weights: {rank: weight}; None (the default) means every out-neighbour, weight 1.
        require_mutex: if True, hold each target's window mutex around its write; default False.

    Returns:
        A WinHandle.
    """
    return _put(tensor, name, self_weight, dst_weights, require_mutex, False, "rumor.win_put")


def win_put(tensor: torch.Tensor, name: str, self_weight: Optional[float] = None,
            dst_weights: Optional[Dict[int, float]] = None, require_mutex: bool = False) -> bool:
    """Overwrites each destination's slot for this rank with w * tensor (landed when this
    returns), then tensor *= self_weight. require_mutex holds each destination's window mutex
    around its write.

    Args:
        tensor: the value to write; same shape and dtype as the window.
        name: the window's name, as given to win_create.
        self_weight: after the write, tensor is scaled by it; None (the default) means 1.
        dst_weights: {rank: weight} of the destinations; None (the default) means every
            out-neighbour with weight 1.
        require_mutex: if True, hold each target's window mutex around its write; default False.

    Returns:
        True.
    """
    return win_put_nonblocking(tensor, name, self_weight, dst_weights, require_mutex).wait()


def win_accumulate_nonblocking(tensor: torch.Tensor, name: str, self_weight: Optional[float] = None,
                               dst_weights: Optional[Dict[int, float]] = None,
                               require_mutex: bool = False) -> WinHandle:
    """Starts win_accumulate and returns at once.

    Args:
        tensor: the value; must not change until the handle is waited.
        name: the window's name, as given to win_create.
        self_weight: after the write, tensor is scaled by it; None (the default) means 1.
        dst_weights: {rank: weight}; None (the default) means every out-neighbour, weight 1.
        require_mutex: if True, hold each target's window mutex around its write; default False.

    Returns:
        A WinHandle whose wait() blocks until the targets applied the operation.
    """
    return _put(tensor, name, self_weight, dst_weights, require_mutex, True, "rumor.win_accumulate")


def win_accumulate(tensor: torch.Tensor, name: str, self_weight: Optional[float] = None,
                   dst_weights: Optional[Dict[int, float]] = None, require_mutex: bool = False) -> bool:
    """Adds w * tensor into each destination's slot for this rank, atomically per slot, then
    tensor *= self_weight.

    Args:
        tensor: the value to add; same shape and dtype as the window.
        name: the window's name, as given to win_create.
        self_weight: after the write, tensor is scaled by it; None (the default) means 1.
        dst_weights: {rank: weight}; None (the default) means every out-neighbour, weight 1.
        require_mutex: if True, hold each target's window mutex around its write; default False.

    Returns:
        True.
    """
    return win_accumulate_nonblocking(tensor, name, self_weight, dst_weights, require_mutex).wait()


def win_get_nonblocking(name: str, src_weights: Optional[Dict[int, float]] = None,
                        require_mutex: bool = False) -> WinHandle:
    """Starts win_get and returns at once.

    Args:
        name: the window's name, as given to win_create.
        src_weights: {rank: weight}; None (the default) means every in-neighbour, weight 1.
        require_mutex: if True (default False), hold each source's mutex around the read.

    Returns:
        A WinHandle.
    """
    what = "rumor.win_get"
    w = find_window(name, what)
    srcs = _weights(src_weights, in_neighbor_ranks(), what, "src_weights")
    ws = registry()
    op = ws.hub.get(w.id, sorted(srcs.items()), ws.with_p, bool(require_mutex), _timeout())
    h = WinHandle(w, op, None, 1.0, False, False)
    w.handles.append(h)
    return h


def win_get(name: str, src_weights: Optional[Dict[int, float]] = None, require_mutex: bool = False) -> bool:
    """Copies w * (rank j's published value) into this rank's slot for j, for each source
    (default: every in-neighbour, weight 1). win_update then combines the slots.

    Args:
        name: the window's name, as given to win_create.
        src_weights: {rank: weight} of the sources; None (the default) means every in-neighbour,
            weight 1.
        require_mutex: if True, hold each source's window mutex around the read; default False.

    Returns:
        True.
    """
    return win_get_nonblocking(name, src_weights, require_mutex).wait()


def _receive_weights(what: str):
    tops = _topologies()
    me = _runtime.rank()
    if tops.weighted:
        return tops.topo.receive_weights(me)
    return tops.topo.uniform_receive_weights(me)


def win_update(name: str, self_weight: Optional[float] = None,
               neighbor_weights: Optional[Dict[int, float]] = None, reset: bool = False, clone: bool = False,
               require_mutex: bool = False) -> torch.Tensor:
    """x <- self_weight * x + sum_j neighbor_weights[j] * slot_j on the registered tensor (or a
    clone with clone=True) and returns it. Without weights: the topology's receive weights if it
    was set with is_weighted=True, else 1/(in_degree + 1) for self and each in-neighbour. reset
    zeroes the combined slots afterwards. require_mutex holds this rank's window mutex.

    Args:
        name: the window's name, as given to win_create.
        self_weight: the weight of this rank's value; None (the default) as described above.
        neighbor_weights: {in-neighbour: weight}; None (the default) as described above.
        reset: if True (default False), zero the combined slots afterwards.
        clone: if True (default False), return a combined clone and leave the tensor as it was.
        require_mutex: if True (default False), hold this rank's window mutex.

    Returns:
        The combined tensor (the registered one, or its clone).
    """
    what = "rumor.win_update"
    w = find_window(name, what)
    if (self_weight is None) != (neighbor_weights is None):
        raise ValueError(f"{what}: give self_weight and neighbor_weights together, or neither")
    if self_weight is None:
        sw, nbrs = _receive_weights(what)
    else:
        sw = float(self_weight)
        nbrs = _weights(neighbor_weights, [], what, "neighbor_weights")
    ws = registry()
    if w.twin is not None:
        # x is read from the twin: bring it up to date, combine there, copy the result back.
        _to_host(w.tensor, w.twin, what)
        host = w.twin.clone() if clone else w.twin
        ws.hub.update(w.id, sw, sorted(nbrs.items()), bool(reset), ws.with_p, address(host), bool(require_mutex),
                      _timeout())
        if clone:
            return host.to(w.tensor.device) if w.tensor.device.type == "cuda" else host
        w.tensor.copy_(host, non_blocking=w.tensor.device.type == "cuda")
        return w.tensor
    out = w.tensor.clone() if clone else w.tensor
    ws.hub.update(w.id, sw, sorted(nbrs.items()), bool(reset), ws.with_p, address(out), bool(require_mutex),
                  _timeout())
    return out


def win_update_then_collect(name: str, require_mutex: bool = True) -> torch.Tensor:
    """x <- x + sum of the in-neighbours' slots, which are then zeroed (what accumulate-based
    push-sum needs): win_update(name, 1.0, {j: 1.0 for in-neighbours}, reset=True).

    Args:
        name: the window's name, as given to win_create.
        require_mutex: if True (the default), hold this rank's window mutex while combining.

    Returns:
        The registered tensor.
    """
    return win_update(name, 1.0, {r: 1.0 for r in in_neighbor_ranks()}, reset=True, require_mutex=require_mutex)


def win_publish(name: str) -> None:
    """Makes the registered tensor's current value the one win_get returns to peers (rumor's
    addition: see the module docstring).

    Args:
        name: the window's name, as given to win_create.
    """
    w = find_window(name, "rumor.win_publish")
    if w.twin is not None:
        _to_host(w.tensor, w.twin, "rumor.win_publish")
    registry().hub.publish(w.id, _timeout())


def get_win_version(name: str) -> Dict[int, int]:
    """{in-neighbour: writes into its slot since this rank last combined it} (0: nothing new).

    Args:
        name: the window's name, as given to win_create.

    Returns:
        A dict {in-neighbour rank: int}.
    """
    w = find_window(name, "rumor.get_win_version")
    v = registry().hub.versions(w.id)
    return {r: int(v[r]) for r in in_neighbor_ranks()}


@contextlib.contextmanager
def win_mutex(name: str, for_self: bool = False, ranks: Optional[List[int]] = None) -> Iterator[None]:
    """Holds the window mutex of `ranks` (default: the out-neighbours; for_self: this rank's own)
    for the body. Puts and accumulates with require_mutex=True, and win_update with
    require_mutex=True on the owner, wait for it. Acquired in ascending rank order.

    Args:
        name: the window's name, as given to win_create.
        for_self: if True (default False), lock this rank's own window.
        ranks: the ranks whose mutex to hold; None (the default) means the out-neighbours.
    """
    what = "rumor.win_mutex"
    w = find_window(name, what)
    n = _runtime.size()
    if for_self:
        targets = [_runtime.rank()]
    else:
        targets = list(out_neighbor_ranks() if ranks is None else ranks)
    for r in targets:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
            raise ValueError(f"{what}: rank {r!r} is not in the world of size {n}")
    hub = registry().hub
    hub.mutex_acquire(w.id, targets, _timeout())
    try:
        yield
    finally:
        hub.mutex_release(w.id, targets, _timeout())


def win_associated_p(name: str) -> float:
    """This rank's push-sum weight p of the window (1.0 at creation).

    Args:
        name: the window's name, as given to win_create.

    Returns:
        A float.
    """
    w = find_window(name, "rumor.win_associated_p")
    return float(registry().hub.p(w.id))


def turn_on_win_ops_with_associated_p() -> None:
    """From now on win_put / win_accumulate carry w * p, win_get fetches w * p_j, and win_update
    combines p like the tensor."""
    registry().with_p = True


def turn_off_win_ops_with_associated_p() -> None:
    """Undoes turn_on_win_ops_with_associated_p: window operations carry the tensor only."""
    registry().with_p = False
