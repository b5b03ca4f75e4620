"""Host copies of device tensors, for the paths that stage through host memory (windows, the
async averager, the engine's staged mode): page-locked where the source is on a GPU, so copies
are asynchronous, and waited for with rumor's deadline rather than without one."""
from __future__ import annotations

import torch


def host_like(t: torch.Tensor) -> torch.Tensor:
    """A host tensor shaped like t: page-locked for a CUDA tensor (copies to and from it can be
    asynchronous), plain memory for a CPU one (the emulation)."""
    if t.device.type == "cuda":
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return torch.empty_like(t)


def to_host(src: torch.Tensor, dst: torch.Tensor, what: str, timeout: float) -> torch.Tensor:
    """dst <- src, complete when this returns; a CUDA source is copied on its current stream
    and waited for with an event and a deadline (Event.synchronize() has none)."""
    if src.device.type != "cuda":
        dst.copy_(src)
        return dst
    from .routing import wait_event

    dst.copy_(src, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(src.device))
    wait_event(ev, timeout, what + ": copying to host memory")
    return dst
