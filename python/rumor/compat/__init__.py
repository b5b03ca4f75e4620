"""Drop-in modules for code written against BlueFog and Bagua (docs/compat.md).

    import rumor.compat.bluefog as bf        # bluefog.torch
    import rumor.compat.bagua as bagua       # bagua.torch_api

Nothing is installed under the other projects' names unless asked: enable_aliases() registers
``bluefog``, ``bluefog.torch``, ``bluefog.common.topology_util``, ``bagua`` and
``bagua.torch_api`` (and its submodules) in sys.modules, so unchanged scripts import rumor.
"""
from __future__ import annotations

import importlib
import sys
import types

__all__ = ["enable_aliases", "disable_aliases"]

_ALIASES = {
    "bluefog": {
        "bluefog": None,
        "bluefog.torch": "rumor.compat.bluefog",
        "bluefog.common": None,
        "bluefog.common.topology_util": "rumor.compat.bluefog.topology_util",
        "bluefog.common.util": "rumor.compat.bluefog.util",
        "bluefog.torch.topology_util": "rumor.compat.bluefog",
    },
    "bagua": {
        "bagua": None,
        "bagua.torch_api": "rumor.compat.bagua",
        "bagua.torch_api.algorithms": "rumor.compat.bagua.algorithms",
        "bagua.torch_api.algorithms.gradient_allreduce": "rumor.compat.bagua.algorithms.gradient_allreduce",
        "bagua.torch_api.algorithms.bytegrad": "rumor.compat.bagua.algorithms.bytegrad",
        "bagua.torch_api.algorithms.decentralized": "rumor.compat.bagua.algorithms.decentralized",
        "bagua.torch_api.algorithms.q_adam": "rumor.compat.bagua.algorithms.q_adam",
        "bagua.torch_api.algorithms.async_model_average": "rumor.compat.bagua.algorithms.async_model_average",
        "bagua.torch_api.communication": "rumor.compat.bagua",
        "bagua.torch_api.contrib": "rumor.compat.bagua.contrib",
    },
}
_installed = []


def enable_aliases(bluefog: bool = True, bagua: bool = True) -> None:
    """Makes ``import bluefog.torch`` / ``import bagua.torch_api`` give rumor's compat modules
    in this process. A real installed package of that name wins only if imported first; this
    raises RuntimeError then rather than mixing the two."""
    for which, on in (("bluefog", bluefog), ("bagua", bagua)):
        if not on:
            continue
        for name, target in _ALIASES[which].items():
            present = sys.modules.get(name)
            if present is not None and not getattr(present, "__rumor_alias__", False) \
                    and not (target and present.__name__ == target):
                raise RuntimeError(f"rumor.compat.enable_aliases: a module {name!r} is already imported "
                                   f"({getattr(present, '__file__', present)}); enable the aliases first")
            if target is None:
                mod = types.ModuleType(name, f"rumor.compat alias package for {name}")
                mod.__path__ = []
                mod.__rumor_alias__ = True
            else:
                mod = importlib.import_module(target)
            sys.modules[name] = mod
            parent, _, leaf = name.rpartition(".")
            # Only the alias packages get attributes; rumor's own modules keep theirs.
            if parent and getattr(sys.modules[parent], "__rumor_alias__", False):
                setattr(sys.modules[parent], leaf, mod)
            _installed.append(name)


def disable_aliases() -> None:
    """Removes what enable_aliases() registered."""
    while _installed:
        sys.modules.pop(_installed.pop(), None)
