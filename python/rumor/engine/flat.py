"""Trainable parameters regrouped into flat buffers, for the algorithms and optimizers that
exchange WEIGHTS (decentralized SGD, local SGD, async averaging, the neighbor optimizers)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .buckets import default_bucket_plan


class FlatWeights:
    """Trainable parameters regrouped into flat buffers of one dtype each (the parameters
    become views into them), so that a weight exchange sends one message per buffer."""

    def __init__(self, params: Sequence[torch.nn.Parameter], cap_bytes: int, what: str,
                 dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16)):
        self.params = list(params)
        for p in self.params:
            if p.dtype not in dtypes:
                names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
                raise TypeError(f"{what}: parameters must be one of {names}, got {p.dtype}")
        self.groups: List[List[int]] = default_bucket_plan(self.params, cap_bytes, cap_bytes)
        self.flats: List[torch.Tensor] = []
        for idx in self.groups:
            total = sum(self.params[i].numel() for i in idx)
            first = self.params[idx[0]]
            flat = torch.empty(total, dtype=first.dtype, device=first.device)
            self.flats.append(flat)
        self._views: List[Optional[torch.Tensor]] = [None] * len(self.params)
        self.repoint(copy=True)

    def repoint(self, copy: bool) -> None:
        """Makes every parameter a view into its flat buffer (copying its values in if asked)."""
        with torch.no_grad():
            for flat, idx in zip(self.flats, self.groups):
                off = 0
                for i in idx:
                    p = self.params[i]
                    view = flat[off:off + p.numel()].view_as(p)
                    if copy:
                        view.copy_(p.data)
                    p.data = view
                    self._views[i] = view
                    off += p.numel()

    def ensure_views(self) -> None:
        """If someone replaced a parameter's .data (e.g. load_state_dict(assign=True)), copies
        the new values into the flat buffer and points the parameter back at it."""
        for i, p in enumerate(self.params):
            v = self._views[i]
            if p.data_ptr() != v.data_ptr() or p.shape != v.shape:
                with torch.no_grad():
                    v.copy_(p.data)
                    p.data = v
